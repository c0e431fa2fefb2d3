"""``kv_bits="auto"``: the bit width chosen with the kept count at the budget's memory (docs/quantized.md
section 11).

What is checked, each against an independent computation:

- ``kvcert.fast.choose_kv_bits`` equals ``kvcert.reference.choose_kv_bits`` head by head (the choice, and each
  width's kept count, radius, rounding term and total within float32 rounding of their scale); negative
  control: the reference one token of memory away misses that tolerance;
- the choice is the argmin of the predictions returned (ties to more bits), and on synthetic heads whose
  answer is known (rounding-dominated -> 16 bits; flat attention with spread values -> fewer bits) the chosen
  width's *realized* mean error over R draws is no worse than any other width's; negative control: an
  always-16 chooser fails that on the rounding-cheap head;
- memory: the auto design's memory, counted as the reference counts it, is at most the 16-bit design's at the
  same budget plus one token; negative control: the naive 16/b kept count (scales not counted) is over it;
- ``TokenDesign(kv_bits="auto")``'s event is bit for bit the fixed-width event it chose, and the press's
  generation with ``kv_bits="auto"`` is bit for bit the press at the width each layer chose;
- bad input names the argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvcert
import kvcert.fast as F
import kvcert.reference as R
from model_fixtures import cache_of, forced_logits, tiny_model
from support import rounding

FIELDS = ("kept", "radius", "rounding", "total")


# ---------------------------------------------------------------------------------------------
# (a) the fast chooser is the reference's, head by head
# ---------------------------------------------------------------------------------------------
def _inputs(seed: int, n: int, h_kv: int = 2, g: int = 2, w: int = 5, d: int = 16):
    """float32 inputs (the fast chooser's) and their exact float64 values (the reference's)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h_kv * g, w, d, generator=gen)
    k = torch.randn(1, h_kv, n, d, generator=gen) * 1.5
    v = torch.randn(1, h_kv, n, d, generator=gen) + 0.4
    u = torch.rand(1, h_kv, n, generator=gen) - 0.1                 # a negative score: shifted per head
    return q, k, v, u


def _reference(q, k, v, u, h: int, budget: float, **kw):
    g = q.shape[1] // k.shape[1]
    queries = q[0, h * g:(h + 1) * g].reshape(-1, q.shape[-1]).double().numpy()
    return R.choose_kv_bits(queries, k[0, h].double().numpy(), v[0, h].double().numpy(), u[0, h].double().numpy(),
                            budget, **kw)


def _far(fast, ref, h: int, n: int) -> list:
    """The (width, field) pairs where the fast prediction is outside float32 rounding of the reference's scale
    (``rounding(float32, n)``: a length-n reduction) -- the fast chooser computes in float64 from float32 inputs,
    so this leaves it room it does not need."""
    tol = rounding(torch.float32, n)
    out = []
    for fp, rp in zip(fast.predictions, ref.predictions):
        assert fp.bits == rp.bits
        for name in FIELDS:
            a = getattr(fp, name)
            a = float(a[0, h]) if isinstance(a, torch.Tensor) else float(a)
            b = float(getattr(rp, name))
            if not (a == b or abs(a - b) <= tol * max(abs(b), 1e-300)):
                out.append((rp.bits, name, a, b))
    return out


CASES = [  # (seed, n, layout, quantized_bound, top, budget, extra)
    (0, 113, "channel", "variance", None, 30.0, 0.0),
    (1, 239, "token", "strict", None, 60.0, 0.0),
    (2, 300, "values", "variance", 6, 80.0, 0.0),
    (3, 257, "channel", "strict", None, 70.0, 400.0),
    (4, 64, "token", "variance", None, 50.0, 0.0),                   # 4 and 8 bits keep the whole cache
]


def test_one_name_per_operation():
    """The two backends' chooser modules have the same public names, exported by their packages."""
    import kvcert.fast.bits as FB
    import kvcert.reference.bits as RB

    assert FB.__all__ == RB.__all__ and FB.KV_BITS_CHOICES == RB.KV_BITS_CHOICES == (16, 8, 4, "auto")
    for name in FB.__all__:
        assert getattr(F, name) is getattr(FB, name) and getattr(R, name) is getattr(RB, name)


def _both_choosers(seed, n, layout, bound, top, budget, extra):
    """A case's inputs, chooser keywords, the fast choice and the reference choice of each KV head."""
    q, k, v, u = _inputs(seed, n)
    kw = dict(layout=layout, quantized_bound=bound, top=top, top_fraction=0.5, extra=extra, sinks=4, window=16)
    fast = F.choose_kv_bits(q, k, v, u, budget, **kw)
    return (q, k, v, u), kw, fast, [_reference(q, k, v, u, h, budget, **kw) for h in range(k.shape[1])]


@pytest.mark.parametrize("seed, n, layout, bound, top, budget, extra", CASES)
def test_fast_chooser_is_the_reference(seed, n, layout, bound, top, budget, extra):
    (q, k, v, u), kw, fast, refs = _both_choosers(seed, n, layout, bound, top, budget, extra)
    for h, ref in enumerate(refs):
        assert _far(fast, ref, h, n) == []
        assert int(fast.bits[0, h]) == ref.bits
        # negative control: one more token of memory moves the predictions past the tolerance
        assert _far(fast, _reference(q, k, v, u, h, budget + 1.0, **kw), h, n) != []


# ---------------------------------------------------------------------------------------------
# (b) the choice is the argmin, and the realized errors agree on heads whose answer is known
# ---------------------------------------------------------------------------------------------
def _argmin(predictions) -> int:
    best = predictions[0]
    for p in predictions[1:]:
        if p.total < best.total:
            best = p
    return best.bits


@pytest.mark.parametrize("seed, n, layout, bound, top, budget, extra", CASES)
def test_the_choice_is_the_argmin_of_its_predictions(seed, n, layout, bound, top, budget, extra):
    _, _, fast, refs = _both_choosers(seed, n, layout, bound, top, budget, extra)
    for ref in refs:
        assert ref.bits == _argmin(ref.predictions)
        assert [p.bits for p in ref.predictions] == list(R.KV_BITS)
    sums = [float(p.total.sum()) for p in fast.predictions]
    assert fast.shared() == F.KV_BITS[int(np.argmin(sums))]        # argmin takes the first: more bits on a tie


N_HEAD, D_HEAD, BUDGET, R_DRAWS = 400, 16, 40.0, 100


def _head(kind: str, seed: int = 0):
    """A synthetic head: ``"rounding"`` values 5 + 1e-3 noise (sampling error ~1e-3, rounding ~5/127 per element:
    16 bits must win); ``"sampling"`` near-flat attention (keys 0.05 N(0, 1)) over N(0, 1) values (the sampling
    error dominates, rounding is a small share of it: fewer bits must win)."""
    rng = np.random.default_rng(seed)
    if kind == "rounding":
        k, v = rng.normal(size=(N_HEAD, D_HEAD)), 5.0 + 1e-3 * rng.normal(size=(N_HEAD, D_HEAD))
    else:
        k, v = 0.05 * rng.normal(size=(N_HEAD, D_HEAD)), rng.normal(size=(N_HEAD, D_HEAD))
    return rng.normal(size=(8, D_HEAD)), k, v, np.ones(N_HEAD)


def _realized(q, k, v, imp, bits: int) -> tuple[float, float]:
    """(mean, standard error) of ||o_hat - o|| over R_DRAWS seeds at ``bits`` (the sampling and the
    stochastic rounding both drawn from the seed)."""
    exact = R.attention(q[-1], k, v)
    err = [np.linalg.norm(R.evict_and_certify(q[-1], k, v, imp, BUDGET, seed=s, design="paper", kv_bits=bits,
                                              sinks=4, window=8).output - exact) for s in range(R_DRAWS)]
    return float(np.mean(err)), float(np.std(err, ddof=1) / math.sqrt(R_DRAWS))


def _no_worse(errors: dict, chosen: int) -> bool:
    """Whether the chosen width's mean error is within 4 standard errors of the difference of every other's
    (one-sided: |mean_c - mean_b| <= 4 sqrt(se_c^2 + se_b^2) or below)."""
    m_c, s_c = errors[chosen]
    return all(m_c - m_b <= 4.0 * math.hypot(s_c, s_b) for m_b, s_b in errors.values())


def test_the_chosen_width_has_the_smallest_realized_error():
    """R_DRAWS = 100: on the pilot run (seed 0) the standard errors are at most 2.3e-5 / 2.4e-4 / 1.6e-3 of the
    means 1.1e-3 / 9.6e-3 / 2.7e-2 on the rounding head (16 / 8 / 4 bits) and 1.4e-2 / 9.4e-3 / 5.1e-3 of
    0.69 / 0.47 / 0.31 on the sampling head, so 4 standard errors of a difference (<= 0.07 of the gaps
    0.0085 and 0.38) resolve every gap the negative control needs; the control asserts that margin itself."""
    for kind, want in (("rounding", {16}), ("sampling", {8, 4})):
        q, k, v, imp = _head(kind)
        auto = R.evict_and_certify(q[-1], k, v, imp, BUDGET, seed=0, design="paper", kv_bits="auto", tilt=q, sinks=4,
                                   window=8)
        assert auto.bits.bits in want and auto.bits.bits == _argmin(auto.bits.predictions)
        errors = {b: _realized(q, k, v, imp, b) for b in R.KV_BITS}
        assert _no_worse(errors, auto.bits.bits), errors
        if kind == "sampling":  # negative control: always 16 bits is measurably worse here
            assert not _no_worse(errors, 16), errors
        # the auto result is the chosen width's, draw for draw
        fixed = R.evict_and_certify(q[-1], k, v, imp, BUDGET, seed=0, design="paper", kv_bits=auto.bits.bits,
                                    sinks=4, window=8)
        assert np.array_equal(auto.output, fixed.output) and auto.radius == fixed.radius and auto.kept == fixed.kept


# ---------------------------------------------------------------------------------------------
# (c) memory at equal footing
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["channel", "token"])
@pytest.mark.parametrize("budget", [30.0, 61.5, 120.0])
def test_auto_memory_is_the_budgets(layout, budget):
    """Systematic sampling keeps floor or ceil of the expected count, so each width's memory is its expected
    memory within one token: the auto design's is at most the 16-bit design's plus one 16-bit token."""
    q, k, v, imp = _head("sampling", seed=3)
    n, d = k.shape
    one = (d + d + 1) / (n * 2 * d)
    for design in ("paper", None):
        kw = dict(seed=1, design=design, sampling="systematic", tilt=q, kv_layout=layout, sinks=4, window=8)
        auto = R.evict_and_certify(q[-1], k, v, imp, budget, kv_bits="auto", **kw)
        full = R.evict_and_certify(q[-1], k, v, imp, budget, kv_bits=16, **kw)
        assert auto.memory <= full.memory + one
        assert auto.bits.bits != 16 and auto.kept > full.kept
    # negative control: 16/b times the tokens, the scales not counted, is over the budget's memory
    naive = R.quantized_memory_fraction(n, d, d, kept=int(2 * budget), kv_bits=8, layout=layout)
    assert naive > budget * (2 * d + 1) / (n * 2 * d) + one


# ---------------------------------------------------------------------------------------------
# the design's event and the press
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields", [dict(), dict(sketch="tilted", kind="tilted_hull", sampling="systematic"),
                                    dict(quantized_bound="strict", kv_layout="token")])
def test_auto_event_is_the_chosen_width_event(fields):
    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 40, 16, generator=gen), torch.randn(1, 2, 300, 16, generator=gen)
    v = torch.randn(1, 2, 300, 16, generator=gen) + 0.3
    design = F.TokenDesign(compression_ratio=0.8, kv_bits="auto", **fields)
    ev = design.event(q, k, v, layer=1, event=0)
    chosen = ev.bits.shared()
    fixed = design.with_bits(chosen).event(q, k, v, layer=1, event=0)
    assert ev.kv_bits == chosen == fixed.kv_bits and fixed.bits is None
    assert torch.equal(ev.decision.keep, fixed.decision.keep) and torch.equal(ev.decision.pi, fixed.decision.pi)
    if chosen != 16:
        for a, b in ((ev.stored.values, fixed.stored.values), (ev.stored.keys, fixed.stored.keys)):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    # the choice is the predictions' argmin summed over heads, from the design's own chooser call
    u = design.score(q, k, v, layer=1, event=0)
    again = design.choose_bits(q, k, v, u)
    assert again.shared() == chosen and torch.equal(again.bits, ev.bits.bits)


def _generate(press, steps: int = 4):
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), press(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False)
    return out, press.certificates


def test_press_auto_generates_and_records_the_bits():
    fields = dict(compression_ratio=0.8, sketch=None, sampling="systematic")
    press = kvcert.PoissonPress(kv_bits="auto", **fields)
    out, certs = _generate(press)
    assert out.shape == (1, 304) and set(press.chosen_bits) == {0, 1}
    widths = set(press.chosen_bits.values())
    for (layer, row), choice in press.bits_choices.items():
        assert choice.shared() == press.chosen_bits[layer] and row == 0
    assert len(widths) == 1  # this model's two layers choose alike, so one fixed press replays both
    fixed = kvcert.PoissonPress(kv_bits=widths.pop(), **fields)
    out_f, certs_f = _generate(fixed)
    assert torch.equal(out, out_f) and torch.equal(certs.radius, certs_f.radius)
    assert torch.equal(certs.kept, certs_f.kept)


def test_press_auto_scores_once_per_row():
    """A scorer of the press's own is called once per (layer, row) at kv_bits="auto" (the chooser's scores are the
    event's), and the run is the fixed press's at the chosen width."""
    calls = []

    def scorer(queries, keys, values, *, scale, layer, event):
        calls.append(layer)
        return keys.norm(dim=-1)

    logits = {}
    for bits in ("auto", 4):
        calls.clear()
        press = kvcert.PoissonPress(compression_ratio=0.8, kv_bits=bits, sketch=None, scorer=scorer)
        logits[bits] = forced_logits(tiny_model(), torch.randint(1, 96, (1, 300), generator=torch.Generator()
                                                                 .manual_seed(2)), [torch.tensor([[5]])], press)[0]
        assert calls == [0, 1]
        if bits == "auto":
            assert press.chosen_bits == {0: 4, 1: 4}
    assert torch.equal(logits["auto"], logits[4])


def test_press_auto_layer_memory():
    """Each layer's heads hold at most the 16-bit design's memory (60 tokens of d + dv + 1 elements) plus one
    16-bit token (systematic sampling: floor or ceil of the expected count), and more tokens than it."""
    press = kvcert.PoissonPress(kv_bits="auto", compression_ratio=0.8, sketch=None, sampling="systematic")
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, use_cache=True)
    d = dv = 16
    for layer in cache_of(out).layers:
        assert layer.quantized is not None and bool((layer.kept > 60).all())
        held = layer.memory_elements()
        assert bool((held <= (60.0 + 1.0) * (d + dv + 1)).all()), held


# ---------------------------------------------------------------------------------------------
# (d) bad input
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [12, "Auto", "8", 8.0, True, None])
def test_unsupported_kv_bits_name_the_accepted_values(bad):
    match = r"kv_bits must be one of \(16, 8, 4\) or 'auto'"
    with pytest.raises(ValueError, match=match):
        F.TokenDesign(compression_ratio=0.5, kv_bits=bad)
    with pytest.raises(ValueError, match=match):
        kvcert.PoissonPress(compression_ratio=0.5, kv_bits=bad)
    q, k, v, imp = _head("sampling")
    with pytest.raises(ValueError, match=match):
        R.evict_and_certify(q[-1], k, v, imp, 40.0, seed=0, kv_bits=bad)


def test_auto_refusals_name_the_arguments():
    with pytest.raises(ValueError, match="kv_bits: a target_error"):
        F.TokenDesign(target_error=0.1, kv_bits="auto")
    with pytest.raises(ValueError, match="kv_bits: a target_error"):
        kvcert.PoissonPress(target_error=0.1, kv_bits="auto")
    with pytest.raises(ValueError, match=r"kv_bits='auto' and allocation='neyman'"):
        kvcert.PoissonPress(compression_ratio=0.5, kv_bits="auto", allocation="neyman")
    with pytest.raises(ValueError, match="kind: kv_bits='auto'"):
        F.TokenDesign(compression_ratio=0.5, kv_bits="auto", kind="chi2")
    with pytest.raises(ValueError, match="kind: kv_bits='auto'"):
        kvcert.PoissonPress(compression_ratio=0.5, kv_bits="auto", sketch=None, kind="chi2")
    q, k, v, u = _inputs(0, 50)
    with pytest.raises(ValueError, match="kind: kv_bits='auto'"):
        F.choose_kv_bits(q, k, v, u, 20.0, kind="chi2")
    with pytest.raises(ValueError, match="budget must be a finite float > 0"):
        F.choose_kv_bits(q, k, v, u, 0.0)
    with pytest.raises(ValueError, match="layout must be one of"):
        F.choose_kv_bits(q, k, v, u, 20.0, layout="kivi")
    with pytest.raises(ValueError, match="kv_bits: with kv_bits='auto' the sampled budget"):
        F.TokenDesign(compression_ratio=0.5, kv_bits="auto").sampled_budget(100, 16, 16)
