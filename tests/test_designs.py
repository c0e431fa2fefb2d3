"""One object per design: ``kvcert.fast.TokenDesign`` and ``kvcert.fast.BlockDesign``.

Each owns its fields and checks, its budget and its decision (importance -> pi -> sample). The
presses and the vLLM plugin hold them, so the decisions are compared with what the presses keep,
bit for bit: the same float64 solver and the same counter-based streams run on the same scores.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcert
from kvcert import fast as F
from kvcert import reference as R
from kvcert.cache import KVCertLayer
from model_fixtures import forced_logits, tiny_model
from support import EPS, assert_close, rounding

SCORERS = tuple(F.SCORERS)


def _qkv(b, h_kv, g, n, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h_kv, n, d, generator=gen)
    v = torch.randn(b, h_kv, n, d, generator=gen)
    q = torch.randn(b, h_kv * g, n, d, generator=gen)
    return q, k, v


def _press_event(press, q, k, v, layer_idx, real=None):
    """One prefill event of ``press`` on a cache layer holding k, v (left padding where ``real`` is False)."""
    layer = KVCertLayer()
    layer.update(k.clone(), v.clone())
    if real is not None:
        layer.mark_padding(real)
    press.prefill_event(layer, layer_idx, q, k.shape[-1] ** -0.5)
    return layer


def _held(layer, r, h):
    """Positions (ascending) and log pi of row r, head h of a layer after an event."""
    pos = layer.positions[r, h]
    real = pos >= 0
    return pos[real], layer.log_weights[r, h][real]


# ---------------------------------------------------------------------------------------------
# TokenDesign: the decision is PoissonPress's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("n, options", [(300, {"compression_ratio": 0.7}), (113, {"compression_ratio": 0.5}),
                                        (41, {"compression_ratio": 0.4}), (150, {"target_size": 60})],
                         ids=["ratio0.7-n300", "ratio0.5-n113", "shrunk-window-n41", "target60-n150"])
def test_token_design_keeps_what_poisson_press_keeps(scorer, n, options):
    q, k, v = _qkv(1, 3, 3, n, seed=n)
    kw = dict(seed=5, scorer=scorer, sketch=None, **options)  # the paper's design (the default's: below)
    layer = _press_event(kvcert.PoissonPress(**kw), q, k, v, layer_idx=3)
    design = F.TokenDesign(**kw)
    scores = design.score(q, k, v, scale=k.shape[-1] ** -0.5, layer=3, event=0)
    d = design.decide(scores[0], layer=3, event=0)
    assert d.evicts and d.sizes == design.sizes(n)
    for h in range(3):
        pos, log_w = _held(layer, 0, h)
        kept = d.keep[h].nonzero().flatten()
        assert torch.equal(pos, kept), f"head {h}: kept tokens differ"
        assert torch.equal(log_w, torch.log(d.pi[h, kept]).to(log_w.dtype)), f"head {h}: pi differs"
    assert torch.equal(design.memory(d), torch.tensor([_held(layer, 0, h)[0].numel() for h in range(3)]))


@pytest.mark.parametrize("scorer", ["snapkv", "knorm", "h2o"])
def test_token_design_decides_each_row_of_a_padded_batch_as_alone(scorer):
    lengths = (130, 97, 64)
    n = max(lengths)
    q, k, v = _qkv(len(lengths), 2, 2, n, seed=11)
    real = torch.stack([torch.arange(n) >= n - m for m in lengths])  # left padding
    kw = dict(compression_ratio=0.6, seed=2, scorer=scorer, window=8, sinks=2, sketch=None)
    layer = _press_event(kvcert.PoissonPress(**kw), q, k, v, layer_idx=1, real=real)
    design = F.TokenDesign(**kw)
    for r, m in enumerate(lengths):
        idx = real[r].nonzero().flatten()
        qr, kr, vr = q[r:r + 1][:, :, idx], k[r:r + 1][:, :, idx], v[r:r + 1][:, :, idx]
        d = design.decide(design.score(qr, kr, vr, scale=0.25, layer=1)[0], layer=1)
        for h in range(2):
            pos, log_w = _held(layer, r, h)
            kept = d.keep[h].nonzero().flatten()
            assert torch.equal(pos, kept), f"row {r} head {h}: kept tokens differ"
            # the padded row's solver sums over padding zeros too: float64 rounding of the sums only
            pi = torch.log(d.pi[h, kept]).to(log_w.dtype)
            torch.testing.assert_close(log_w, pi, rtol=0, atol=4 * m * torch.finfo(torch.float64).eps)


@pytest.mark.parametrize("n", [300, 113])
def test_the_default_press_keeps_what_the_recommended_token_design_keeps(n):
    """PoissonPress()'s default is TokenDesign(sketch="tilted", kind="tilted_hull", sampling="systematic")
    (kvcert.fast.default_design, default_sampling):
    the press decides at the design's sampled budget (the budget less the sketch's memory) and holds the
    sketch of what it evicted (the tilt at the mean of the last observation_window queries)."""
    q, k, v = _qkv(1, 3, 3, n, seed=n)
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=5)
    design = F.TokenDesign(compression_ratio=0.5, seed=5, sketch="tilted", kind="tilted_hull", sampling="systematic")
    assert (press.kind, press.sketch, press.sampling) == ("tilted_hull", design.sketch, "systematic")
    assert press.design == design
    layer = _press_event(press, q, k, v, layer_idx=3)
    scale = k.shape[-1] ** -0.5
    scores = design.score(q, k, v, scale=scale, layer=3, event=0)
    budget = design.sampled_budget(n, k.shape[-1], v.shape[-1])
    assert budget == pytest.approx(n * 0.5 - design.sketch.tokens(k.shape[-1], v.shape[-1]))
    d = design.decide(scores[0], layer=3, event=0, budget=budget)
    for h in range(3):
        pos, log_w = _held(layer, 0, h)
        assert torch.equal(pos, d.keep[h].nonzero().flatten()), f"head {h}: kept tokens differ"
    sketch = design.sketch_of(k, v, d, queries=q, scale=scale)
    # one float32 computation on the same inputs, each within the rounding of a tilted mean of keys: the
    # length-n sums (rounding(float32, n)) of max|k|, and the weights e^{2 tau q0.k} carry 2 eps S relative
    # (S = max tau |q0.k|: an exponent's absolute rounding), moving the mean by twice that of max|k|
    S = scale * (k.abs() * sketch.tilt.abs()[:, :, None]).sum(-1).amax(-1)  # (b, h_kv)
    tol = (2 * (rounding(torch.float32, n) + 4 * EPS[torch.float32] * S) * k.abs().amax((-2, -1)))[..., None, None]
    want = sketch.mean.to(layer.sketch.mean.dtype)
    assert_close("sketch mean", layer.sketch.mean, want, tol.expand_as(want))
    with pytest.raises(AssertionError):  # negative control: 20 units of that tolerance
        assert_close("sketch mean", want + 20 * tol, want, tol.expand_as(want))
    # negative control: the paper's design keeps more (the full budget, no sketch)
    paper = _press_event(kvcert.PoissonPress(compression_ratio=0.5, seed=5, sketch=None), q, k, v, layer_idx=3)
    assert paper.sketch is None and int(paper.kept.sum()) > int(layer.kept.sum())


def test_token_design_budget_and_sizes_are_the_press_s():
    for options in ({"compression_ratio": 0.5}, {"compression_ratio": 0.9, "window": 4},
                    {"target_size": 64, "top_fraction": 0.25}, {"compression_ratio": 0.0}):
        press, design = kvcert.PoissonPress(**options), F.TokenDesign(**options)
        assert design.compresses == press.compresses
        for n in (0, 1, 7, 40, 41, 64, 100, 1000):
            assert design.sizes(n) == press.design_sizes(n), (options, n)
            assert design.budget(n) == press.design_sizes(n).budget


def test_token_design_evicts_nothing_when_the_budget_covers_n_and_checks_scores_anyway():
    q, k, v = _qkv(1, 2, 1, 50, seed=3)
    design = F.TokenDesign(target_size=64)
    layer = _press_event(kvcert.PoissonPress(target_size=64), q, k, v, layer_idx=0)
    d = design.decide(design.score(q, k, v)[0], layer=0)
    assert not d.evicts and d.sizes is None and bool((d.pi == 1).all()) and torch.equal(d.kept, torch.tensor([50, 50]))
    assert torch.equal(layer.positions[0], torch.arange(50).expand(2, 50))
    bad = torch.zeros(2, 50)
    for value in (math.nan, math.inf):
        bad[1, 7] = value
        with pytest.raises(ValueError, match="scores must be finite"):
            design.decide(bad, layer=0)
    with pytest.raises(ValueError, match="scores must have shape"):
        design.decide(torch.zeros(2, 0), layer=0)


def test_token_design_negative_scores_are_shifted_per_head():
    u = torch.tensor([[-3.0, -1.0, -2.0, 0.5], [1.0, 2.0, 0.0, 3.0]], dtype=torch.float64)
    shifted = F.nonnegative_importance(u)
    assert torch.equal(shifted[0], u[0] + 3.0) and torch.equal(shifted[1], u[1])
    valid = torch.tensor([[True, False, True, True], [True] * 4])
    shifted = F.nonnegative_importance(u, valid)
    assert torch.equal(shifted[0], torch.tensor([0.0, 0.0, 1.0, 3.5], dtype=torch.float64))
    nan = u.clone()
    nan[0, 1] = math.nan  # on padding: ignored
    assert torch.equal(F.nonnegative_importance(nan, valid), shifted)


BAD_TOKEN = [
    ("compression_ratio", 1.0, ValueError), ("compression_ratio", "0.5", TypeError), ("target_size", 0, ValueError),
    ("seed", -1, ValueError), ("sinks", 1.5, TypeError), ("window", -2, ValueError), ("top_fraction", 1.0, ValueError),
    ("floor", 0.0, ValueError), ("observation_window", 0, ValueError), ("kernel_size", 4, ValueError),
    ("delta", 1.0, ValueError), ("kind", "hoeffding", ValueError),
]


@pytest.mark.parametrize("name, value, error", BAD_TOKEN, ids=[f"{b[0]}={b[1]!r}" for b in BAD_TOKEN])
def test_token_design_refuses_what_the_press_refuses_with_the_same_message(name, value, error):
    with pytest.raises(error) as press_err:
        kvcert.PoissonPress(**{name: value})
    with pytest.raises(error, match=name) as design_err:
        F.TokenDesign(**{name: value})
    assert str(design_err.value) == str(press_err.value)


def test_token_design_refuses_unregistered_scorers_and_both_budgets():
    with pytest.raises(ValueError, match="scorer must be one of"):
        F.TokenDesign(scorer="nope")
    with pytest.raises(ValueError, match="give compression_ratio or target_size, not both"):
        F.TokenDesign(compression_ratio=0.5, target_size=10)
    with pytest.raises(ValueError, match="budget must be in"):
        F.TokenDesign(compression_ratio=0.5).decide(torch.rand(2, 10), budget=-1.0)


# ---------------------------------------------------------------------------------------------
# BlockDesign: the decision is BlockPoissonPress's
# ---------------------------------------------------------------------------------------------
def test_block_design_decides_what_block_poisson_press_decides(monkeypatch):
    ids = torch.randint(1, 96, (1, 203), generator=torch.Generator().manual_seed(9))
    cont = torch.randint(1, 96, (2,), generator=torch.Generator().manual_seed(10))
    kw = dict(compression_ratio=0.5, block_size=8, seed=4, sink_blocks=1, recent_blocks=2, observation_window=6)
    expected, seen = _block_press_run(monkeypatch, kvcert.BlockPoissonPress(**kw), ids, cont)
    design = F.BlockDesign(**kw)
    scores = torch.stack([design.score(q, k, v, scale=s, layer=i)[0] for i, (q, k, v, s) in sorted(seen.items())])
    ub = design.block_importance(scores[None])[0]
    d = design.decide(ub, event=F.prompt_event(ids[0].tolist()), n_tokens=203)
    assert d.n_tokens == expected.n_tokens and d.event == expected.event
    assert torch.equal(d.importance, expected.importance)
    assert torch.equal(d.pi, expected.pi) and torch.equal(d.kept, expected.kept)
    assert d.evicted == [j for j in range(d.kept.numel()) if not bool(expected.kept[j])] and d.evicted
    assert torch.equal(d.log_pi[d.kept], torch.log(d.pi[d.kept])) and bool((d.log_pi[~d.kept] == -math.inf).all())


def _block_press_run(monkeypatch, press, ids, cont):
    """Run ``press`` on a tiny model; -> (its first row's decision, each layer's full prompt (q, k, v, scale))."""
    seen = {}
    original = press.prefill_event

    def spy(layer, layer_idx, queries, scale):  # each layer's full prompt, before the decision compacts it
        seen[layer_idx] = (queries.clone(), layer.keys.clone(), layer.values.clone(), scale)
        return original(layer, layer_idx, queries, scale)

    monkeypatch.setattr(press, "prefill_event", spy)
    forced_logits(tiny_model(), ids, cont, press)
    return press.decisions[0], seen


def test_block_press_with_another_scorer_keeps_what_its_design_keeps(monkeypatch):
    """A scorer other than SnapKV drives the Hugging Face block press by configuration alone (``scorer=``):
    the press decides what ``BlockDesign(scorer=...).decide`` decides, and not what SnapKV decides."""
    kw = dict(compression_ratio=0.5, block_size=8, seed=4, sink_blocks=1, recent_blocks=2, observation_window=6)
    differs = []
    for seed in (11, 12, 13):
        gen = torch.Generator().manual_seed(seed)
        ids, cont = torch.randint(1, 96, (1, 203), generator=gen), torch.randint(1, 96, (2,), generator=gen)
        press = kvcert.BlockPoissonPress(scorer="knorm", **kw)
        assert press.design == F.BlockDesign(scorer="knorm", **kw)
        expected, seen = _block_press_run(monkeypatch, press, ids, cont)
        design = F.BlockDesign(scorer="knorm", **kw)
        scores = torch.stack([design.score(q, k, v, scale=s, layer=i)[0] for i, (q, k, v, s) in sorted(seen.items())])
        d = design.decide(design.block_importance(scores[None])[0], event=F.prompt_event(ids[0].tolist()),
                          n_tokens=203)
        assert torch.equal(d.importance, expected.importance) and torch.equal(d.pi, expected.pi)
        assert torch.equal(d.kept, expected.kept) and d.event == expected.event
        snap, _ = _block_press_run(monkeypatch, kvcert.BlockPoissonPress(**kw), ids, cont)  # negative control
        assert not torch.equal(snap.importance, expected.importance) and not torch.equal(snap.pi, expected.pi)
        differs.append(not torch.equal(snap.kept, expected.kept))
    assert any(differs), "knorm and snapkv kept the same blocks on every prompt"


BAD_BLOCK = [
    ("compression_ratio", 1.0, ValueError), ("block_size", 0, ValueError), ("seed", -1, ValueError),
    ("sink_blocks", 1.5, TypeError), ("recent_blocks", 0, ValueError), ("top_blocks", -1, ValueError),
    ("floor", 0.0, ValueError), ("observation_window", 0, ValueError), ("reduce", "sum", ValueError),
    ("scorer", "nope", ValueError), ("delta", 1.0, ValueError), ("kind", "hoeffding", ValueError),
]


@pytest.mark.parametrize("name, value, error", BAD_BLOCK, ids=[f"{b[0]}={b[1]!r}" for b in BAD_BLOCK])
def test_block_design_refuses_what_the_block_press_refuses_with_the_same_message(name, value, error):
    with pytest.raises(error) as press_err:
        kvcert.BlockPoissonPress(**{name: value})
    with pytest.raises(error, match=name) as design_err:
        F.BlockDesign(**{name: value})
    assert str(design_err.value) == str(press_err.value)


@pytest.mark.parametrize("make", [lambda: kvcert.PoissonPress(compression_ratio=0.5),
                                  lambda: kvcert.BlockPoissonPress(compression_ratio=0.5)], ids=["token", "block"])
def test_a_reassigned_press_field_rebuilds_and_rechecks_the_design(make):
    press = make()
    first = press.design
    assert press.design is first  # held, not rebuilt per call
    press.compression_ratio = 0.25
    assert press.design.compression_ratio == 0.25 and press.design is not first
    assert press.design.budget(8) == type(first)(compression_ratio=0.25).budget(8)
    press.floor = 0.0
    with pytest.raises(ValueError, match="floor must be in"):
        press.design


def test_block_design_budget_is_the_press_s_and_none_decides_nothing():
    for ratio in (0.0, 0.3, 0.5, 0.9):
        for sinks, recent, top in ((1, 1, 0), (0, 1, 0), (2, 3, 1)):
            kw = dict(compression_ratio=ratio, sink_blocks=sinks, recent_blocks=recent, top_blocks=top)
            press, design = kvcert.BlockPoissonPress(**kw), F.BlockDesign(**kw)
            assert design.compresses == press.compresses
            for nb in range(1, 30):
                assert design.budget(nb) == press.budget(nb)
    design = F.BlockDesign(compression_ratio=0.5)
    assert design.decide(torch.rand(2, dtype=torch.float64), event=0) is None  # certainty set fills the budget
    for value in (math.nan, -1.0):  # checked whatever the budget
        bad = torch.tensor([0.5, value], dtype=torch.float64)
        with pytest.raises(ValueError, match="importance must be"):
            design.decide(bad, event=0)
    with pytest.raises(ValueError, match="n_tokens"):
        F.BlockDesign(compression_ratio=0.5, block_size=None).decide(torch.rand(8, dtype=torch.float64), event=0)


def test_block_design_takes_any_registered_scorer():
    q, k, v = _qkv(1, 2, 2, 70, seed=5)
    for name in SCORERS:
        design = F.BlockDesign(compression_ratio=0.5, block_size=8, scorer=name)
        s = design.score(q, k, v, scale=0.25, layer=1)
        expected = F.SCORERS[name](q[:, :, -design.queries_read(70, 70):], k, v, scale=0.25, layer=1, event=0,
                                   **design.scorer_params)
        assert torch.equal(s, expected), name
        ub = design.block_importance(torch.stack([s, 2 * s], 1))  # (1, layers, h_kv, n)
        torch.testing.assert_close(ub, F.block_importance(F.nonnegative_importance(torch.stack([s, 2 * s], 1).double()),
                                                          8), rtol=0, atol=0)
        d = design.decide(ub[0], event=3)
        assert d is not None and d.pi.shape == (9,) and float(d.pi.sum()) == pytest.approx(4.5, rel=1e-12)
    assert F.BlockDesign(scorer="h2o").queries_read(70, 70) == 70  # every query when all are given
    assert F.BlockDesign(scorer="h2o", observation_window=16).queries_read(20, 70) == 16  # a later chunk: a window


BAD_BLOCK = [
    ("compression_ratio", -0.1, ValueError), ("block_size", 0, ValueError), ("seed", -1, ValueError),
    ("sink_blocks", -1, ValueError), ("recent_blocks", 0, ValueError), ("top_blocks", 1.0, TypeError),
    ("floor", 1.5, ValueError), ("observation_window", 0, ValueError), ("reduce", "min", ValueError),
    ("delta", 0.0, ValueError), ("kind", "hoeffding", ValueError),
]


@pytest.mark.parametrize("name, value, error", BAD_BLOCK, ids=[f"{b[0]}={b[1]!r}" for b in BAD_BLOCK])
def test_block_design_refuses_what_the_press_refuses(name, value, error):
    with pytest.raises(error, match=name):
        kvcert.BlockPoissonPress(**{name: value})
    with pytest.raises(error, match=name):
        F.BlockDesign(**{name: value})


def test_block_design_refuses_an_unregistered_scorer_and_kernel_size():
    with pytest.raises(ValueError, match="scorer must be one of"):
        F.BlockDesign(scorer="nope")
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        F.BlockDesign(kernel_size=2)


def test_reductions_registry_is_the_one_list():
    assert F.BLOCK_REDUCTIONS == tuple(F.REDUCTIONS) == R.BLOCK_REDUCTIONS
    u = torch.rand(2, 3, 4, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for name, reduce in F.REDUCTIONS.items():
        F.BlockDesign(reduce=name)  # every registered reduction is a design option
        shares = u.reshape(2, 12, 5, 8).sum(-1)
        shares = shares / shares.sum(-1, keepdim=True)
        torch.testing.assert_close(F.block_importance(u, 8, reduce=name), reduce(shares), rtol=1e-15, atol=0)


def test_served_kinds_come_from_the_registry():
    assert F.SERVED_KINDS == tuple(k for k, spec in F.CERTIFICATE_KINDS.items() if spec.served)
    assert set(F.SERVED_KINDS) <= set(F.KINDS)
    for name in F.SERVED_KINDS:  # a norm bound: one radius per head
        assert not F.CERTIFICATE_KINDS[name].per_coordinate


def test_sketched_kinds_are_refused_where_there_is_no_sketch():
    assert F.PLAIN_KINDS == tuple(k for k, spec in F.CERTIFICATE_KINDS.items() if not spec.sketch)
    sketched = [k for k in F.KINDS if k not in F.PLAIN_KINDS]
    assert sketched == ["tilted_hull"]  # the recommended design's radius (docs/theory.md section 8)
    for name in sketched:
        assert name not in F.SERVED_KINDS
        with pytest.raises(ValueError, match="sketch='tilted'"):
            kvcert.PoissonPress(compression_ratio=0.5, kind=name, sketch=None)
        assert kvcert.PoissonPress(compression_ratio=0.5, kind=name).sketch.tilt  # the default sketch: fine


def test_reference_reductions_are_the_fast_registry_s_twin():
    assert tuple(R.REDUCTIONS) == tuple(F.REDUCTIONS)
    u = torch.rand(3, 4, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for name in R.REDUCTIONS:
        fast = F.block_importance(u[None], 8, reduce=name)[0].numpy()
        ref = R.block_importance(u.numpy(), 8, reduce=name)
        # the same shares summed in another order: float64 rounding of 8-term sums and a 12-term mean
        assert abs(fast - ref).max() <= 32 * torch.finfo(torch.float64).eps * abs(ref).max()
