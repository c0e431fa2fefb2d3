"""The compiled CPU decode op (kvcert.kernels.cpu) against the float64 oracle and kvcert.fast.

Tolerances (flash-attention's rule): per field and query head,
|op - ref64| <= 2 |fast - ref64| + rounding, with kvcert.fast (float32 compute, the torch path at
the input dtype) as the low-precision mirror and ``rounding`` a first-order bound of the op's own
arithmetic (:func:`_gamma`, :func:`_tolerances`). The op is built on first use; without a
compiler these tests skip, except the fallback test, which needs none.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

import kvcert.dispatch as D
from kvcert import fast as F
from model_fixtures import SHORT_PROMPT, model_sdpa, reference_certificate, smollm2  # noqa: F401
from support import EPS, assert_close, make_case, reference_heads

cpu = pytest.importorskip("kvcert.kernels.cpu")

TILE = 64  # slots per tile of the op (kTile in hajek_decode.cpp)
LENGTHS = [1, 3, 113, 239, 1023, 1024]


@pytest.fixture(scope="module")
def op():
    if not cpu.available():
        pytest.skip(f"the compiled CPU op cannot be built here: {cpu.unavailable_reason()}")
    return cpu


@pytest.fixture(autouse=True)
def _default_routes(monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)
    monkeypatch.delenv(D.CPU_OP_ENV_VAR, raising=False)


def _gamma(n: int, splits: int) -> float:
    """Relative rounding of the op's float32 sums over n slots: Higham's first-order bound for a
    sequential sum inside a tile (TILE terms), one rounding per tile merge (with its rescale) and per
    range merge, plus the exponential's polynomial (2 ulp) and the finalization (3)."""
    return EPS[torch.float32] * (TILE + 2 * math.ceil(max(n, 1) / TILE) + 2 * splits + 5)


def _oracle(q, k, v, pi, scale=None):
    """float64 fields per (b, h_q) and the scales of the rounding bound, numpy arrays."""
    heads = reference_heads(q, k, v, pi, scale)
    b, h_q = q.shape[:2]
    keys = ("output", "lse", "trace", "n_eff", "variance", "vmax", "c_sum", "c_dev", "diam", "range")
    res = {f: [] for f in keys}
    for (bi, h), (e, vv, p) in heads.items():
        live = p > 0
        for f in ("output", "lse", "trace", "n_eff", "variance"):
            res[f].append(getattr(e, f))
        c = (1.0 - p) * e.weights ** 2
        vl = vv[live] if live.any() else np.zeros((1, vv.shape[1]))
        res["vmax"].append(np.abs(vl).max())
        res["c_sum"].append(c.sum())
        res["c_dev"].append((c[:, None] * np.abs(vv - e.output)).sum(0) if live.any() else np.zeros(vv.shape[1]))
        res["diam"].append(2.0 * np.linalg.norm(vl - vl.mean(0), axis=1).max())  # >= the kept values' diameter
        res["range"].append(vl.max(0) - vl.min(0))
    return {f: np.asarray(x, dtype=np.float64).reshape((b, h_q) + np.shape(x[0])) for f, x in res.items()}


def _tolerances(ref, dtype, n, splits):
    """Rounding of each field, from the op's arithmetic.

    output: the weighted sum of v, gamma max|v|, plus the cast to the input dtype.
    lse: gamma (relative error of Z) plus eps |lse|. n_eff = l^2 / sum p^2: 3 gamma relative.
    trace: the centred form R - 2 (o - mu).S + |o - mu|^2 C around a kept value or the mean kept value
    mu, each term at most C diam^2, so 4 gamma C diam^2; and the output's error delta <= gamma max|v|
    moves sum c |v - o|^2 by 2 delta sum c |v - o|. variance: the same per coordinate, with the range.
    """
    g = _gamma(n, splits)
    eps_out = EPS[dtype] if dtype != torch.float32 else 0.0
    shift = g * ref["vmax"]
    return {
        "output": shift[..., None] + eps_out * np.abs(ref["output"]),
        "lse": g + EPS[torch.float32] * np.abs(np.where(np.isfinite(ref["lse"]), ref["lse"], 0.0)),
        "n_eff": 3 * g * ref["n_eff"],
        "trace": 4 * g * ref["c_sum"] * ref["diam"] ** 2 + 2 * shift * ref["c_dev"].sum(-1),
        "variance": 4 * g * ref["c_sum"][..., None] * ref["range"] ** 2 + 2 * shift[..., None] * ref["c_dev"],
    }


def _check(est, q, k, v, pi, *, per_coordinate, splits=0, fields=None, scale=None, value_center=None):
    """The op's estimate against ref64 within 2 |fast - ref64| + rounding."""
    ref = _oracle(q, k, v, pi, scale)
    fst = F.hajek_attention(q, k, v, pi, per_coordinate=per_coordinate, scale=scale)
    n = k.shape[2]
    tol = _tolerances(ref, k.dtype, n, splits if splits else max(1, math.ceil(n / 256)))
    fields = fields or (("output", "lse", "trace", "n_eff") + (("variance",) if per_coordinate else ()))
    for f in fields:
        got = getattr(est, f).double().numpy()
        with np.errstate(invalid="ignore"):  # inf - inf on empty rows
            mirror = np.abs(getattr(fst, f).double().numpy() - ref[f])
        mirror = np.where(np.isfinite(mirror), mirror, 0.0)  # both inf (empty rows): compared exactly
        assert_close(f, got, ref[f], 2 * mirror + tol[f])


def _case(n, dtype, g, *, seed=0, d=64, dv=64, pad="ragged", pi_kind="interior", regime="typical", t=None):
    return make_case(seed, 2, 2, g, n, d, dv, dtype, regime=regime, pad=pad, pi_kind=pi_kind, t=t)


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("g", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", LENGTHS)
def test_op_matches_reference_and_fast(op, n, dtype, g):
    """Lengths that break the 64-slot tiles and the 256-slot ranges, GQA groups 1, 3, 4, ragged
    padding (with loud garbage in the padding slots), the automatic and a forced range split."""
    q, k, v, pi = _case(n, dtype, g, seed=n + g)
    for splits in (0, 5):
        est = op.hajek_attention(q, k, v, pi, per_coordinate=False, splits=splits)
        assert est.variance is None and est.output.dtype == dtype and est.trace.dtype == torch.float32
        _check(est, q, k, v, pi, per_coordinate=False, splits=splits)


@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (32, 16), (8, 5), (64, 128)])
@pytest.mark.parametrize("n", [113, 239])
def test_head_dimensions_and_per_coordinate_variance(op, d, dv, n):
    """The register-blocked micro-kernels (64, 128) and the generic loops (others), with the
    per-coordinate variance; tiny pi (1e-6, a +13.8 offset) mixed in."""
    q, k, v, pi = _case(n, torch.float32, 3, d=d, dv=dv, pi_kind="mixed", seed=d + dv)
    for per_coordinate in (False, True):
        est = op.hajek_attention(q, k, v, pi, per_coordinate=per_coordinate, splits=2)
        _check(est, q, k, v, pi, per_coordinate=per_coordinate, splits=2)
        if per_coordinate:  # the trace is then the sum of the variance
            torch.testing.assert_close(est.trace, est.variance.sum(-1), rtol=4 * EPS[torch.float32] * dv, atol=0)


def test_several_query_rows(op):
    """q (b, h_q, t, d): all g * t rows of a KV head share the pass; each row is its own estimate."""
    q, k, v, pi = _case(239, torch.float32, 3, t=2)
    est = op.hajek_attention(q, k, v, log_pi=pi.log(), per_coordinate=False)
    assert est.output.shape == (2, 6, 2, 64) and est.trace.shape == (2, 6, 2)
    for j in range(2):
        part = type(est)(output=est.output[:, :, j], weights=None, variance=None, trace=est.trace[:, :, j],
                         lse=est.lse[:, :, j], n_eff=est.n_eff[:, :, j])
        _check(part, q[:, :, j].contiguous(), k, v, pi, per_coordinate=False)


def test_offset_values_stay_well_conditioned(op):
    """Values sharing a large offset (1e4, spread 1): the centred form keeps the trace accurate both
    around the first kept value and around a given centre (the mean kept value)."""
    q, k, v, pi = _case(1023, torch.float32, 3, regime="offset")
    mu, _ = F.value_moments(v, pi)
    for center in (None, mu):
        est = op.hajek_attention(q, k, v, pi, per_coordinate=True, value_center=center)
        _check(est, q, k, v, pi, per_coordinate=True, fields=("trace", "variance"))


def test_empty_rows(op):
    """A KV head whose every slot is padding: output 0, lse -inf, trace and variance +inf, n_eff 0
    (the reference's convention), with or without validation; the other heads are unaffected."""
    q, k, v, pi = _case(113, torch.float32, 3, pad="empty_head")
    for validate in (True, False):
        est = op.hajek_attention(q, k, v, pi, per_coordinate=True, validate=validate)
        e = est.output[0, -3:]
        assert bool((e == 0).all()) and bool((est.lse[0, -3:] == -math.inf).all())
        assert bool((est.trace[0, -3:] == math.inf).all()) and bool((est.variance[0, -3:] == math.inf).all())
        assert bool((est.n_eff[0, -3:] == 0).all())
        _check(est, q, k, v, pi, per_coordinate=True)


def test_all_certain_rows_have_trace_exactly_zero(op):
    """pi = 1 everywhere: every c_i = (1 - pi_i) a_i^2 is exactly 0, so trace and variance are exactly
    0, and the output is exact attention."""
    q, k, v, pi = _case(239, torch.float32, 3, pi_kind="ones", pad="none")
    est = op.hajek_attention(q, k, v, pi, per_coordinate=True, splits=3)
    assert bool((est.trace == 0).all()) and bool((est.variance == 0).all())
    _check(est, q, k, v, pi, per_coordinate=True, splits=3, fields=("output", "lse", "n_eff"))


def test_padding_slots_are_never_read(op):
    """NaN and inf in the K and V of pi = 0 slots change nothing (those slots are skipped, not masked)."""
    q, k, v, pi = _case(239, torch.float32, 3)
    clean = op.hajek_attention(q, k, v, pi, per_coordinate=False)
    pad = (pi == 0)[..., None]
    k2, v2 = k.masked_fill(pad, float("nan")), v.masked_fill(pad, float("inf"))
    dirty = op.hajek_attention(q, k2, v2, pi, per_coordinate=False)
    for f in ("output", "trace", "lse", "n_eff"):
        assert torch.equal(getattr(clean, f), getattr(dirty, f)), f


def test_strided_cache_views_are_read_in_place(op):
    """The cache's tensors are views of larger buffers (spare slots after each head): the same result
    as contiguous copies, bit for bit."""
    q, k, v, pi = _case(113, torch.bfloat16, 3)
    big_k = torch.zeros(2, 2, 150, 64, dtype=k.dtype)
    big_v = torch.zeros(2, 2, 150, 64, dtype=v.dtype)
    big_p = torch.zeros(2, 2, 150)
    big_k[:, :, :113], big_v[:, :, :113], big_p[:, :, :113] = k, v, pi.log()
    a = op.hajek_attention(q, big_k[:, :, :113], big_v[:, :, :113], log_pi=big_p[:, :, :113], per_coordinate=False)
    b = op.hajek_attention(q, k, v, log_pi=pi.log(), per_coordinate=False)
    for f in ("output", "trace", "lse", "n_eff"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_negative_control_a_perturbed_offset_fails(op):
    """The comparison detects a 1 % error in the offsets -log pi (it is not vacuous)."""
    q, k, v, pi = _case(239, torch.float32, 3)
    bad = op.hajek_attention(q, k, v, log_pi=pi.log() * 1.01, per_coordinate=False)
    with pytest.raises(AssertionError, match="output"):
        _check(bad, q, k, v, pi, per_coordinate=False, fields=("output",))
    with pytest.raises(AssertionError, match="trace"):
        _check(bad, q, k, v, pi, per_coordinate=False, fields=("trace",))


def test_bad_inputs(op):
    q, k, v, pi = _case(3, torch.float32, 1)
    with pytest.raises(TypeError, match="float32 or both bfloat16"):
        op.hajek_attention(q, k.half(), v.half(), pi)
    with pytest.raises(ValueError, match="splits"):
        op.hajek_attention(q, k, v, pi, splits=-1)
    with pytest.raises(ValueError, match="value_center"):
        op.hajek_attention(q, k, v, pi, value_center=torch.zeros(2, 2, 3))
    with pytest.raises(ValueError, match="pi must lie"):
        op.hajek_attention(q, k, v, pi * 2)
    for bad_q, bad_v in ((q.masked_fill(q > 1, float("nan")), v), (q, v.masked_fill(v > 1, float("nan")))):
        with pytest.raises(ValueError, match="NaN"):
            op.hajek_attention(bad_q, k, bad_v, pi, splits=2)
    q, k, v, pi = _case(3, torch.float32, 1, pad="none")
    one = q.clone()
    one[0, 0, 5] = float("nan")  # one NaN coordinate of one query: that row is NaN, without validation too
    est = op.hajek_attention(one, k, v, pi, validate=False, per_coordinate=True)
    assert bool(torch.isfinite(est.output[1]).all())
    for f in ("output", "trace", "lse", "variance"):
        assert bool(torch.isnan(getattr(est, f)[0, 0]).all()), f
    with pytest.raises(ValueError, match="keys must have shape"):
        op.hajek_attention(q, k[..., :4], v, pi)


# ----------------------------------------------------------------------------- the dispatch switch
def test_dispatch_routes_cpu_decodes_to_the_op_and_the_switch_forces_torch(op, monkeypatch):
    q, k, v, pi = _case(239, torch.float32, 3)
    mu, r2 = F.value_moments(v, pi)
    kw = dict(log_pi=pi.log(), per_coordinate=False, value_center=mu, value_sqdist=r2, validate=False)
    a = D.hajek_attention(q, k, v, **kw)
    assert (a.backend, a.route) == ("fast", "cpu_op")
    b = D.hajek_attention(q, k, v, backend="fast", **kw)  # the HF session forces "fast": still the op
    assert b.route == "cpu_op" and torch.equal(a.output, b.output)
    _check(a, q, k, v, pi, per_coordinate=False)
    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    t = D.hajek_attention(q, k, v, **kw)
    assert (t.backend, t.route) == ("fast", "torch")
    assert t.n_eff is None  # kvcert.fast's one-pass path: not the op
    _check(a, q, k, v, pi, per_coordinate=False, fields=("output", "lse", "trace"))


@pytest.mark.parametrize("extra", [dict(per_coordinate=True), dict(return_tail_moment=True),
                                   dict(return_max_term=True), dict(bias=torch.zeros(1, 1, 1)),
                                   dict(dtype=torch.float64)])
def test_dispatch_keeps_torch_for_what_the_op_lacks(op, extra):
    q, k, v, pi = _case(113, torch.float32, 3)
    extra = dict(extra)
    if extra.pop("dtype", None) is not None:
        q, k, v = q.double(), k.double(), v.double()
    extra.setdefault("per_coordinate", False)
    est = D.hajek_attention(q, k, v, pi, **extra)
    assert (est.backend, est.route) == ("fast", "torch")


def test_failed_build_warns_once_and_runs_torch(monkeypatch):
    """No compiler: one RuntimeWarning naming the cause, then every call on kvcert.fast."""
    monkeypatch.setitem(cpu._state, "ops", None)
    monkeypatch.setitem(cpu._state, "reason", None)
    monkeypatch.setitem(cpu._state, "warned", False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    q, k, v, pi = _case(3, torch.float32, 1)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler found"):
        first = D.hajek_attention(q, k, v, pi, per_coordinate=False)
    assert first.route == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        second = D.hajek_attention(q, k, v, pi, per_coordinate=False)
    assert second.route == "torch" and "compiler" in cpu.unavailable_reason()


# ----------------------------------------------------------------------------- the real model
def _trace_rounding(call, head: int) -> float:
    """Rounding bound of a decode trace computed in float32 in the centred form around the mean kept
    value mu (what the Hugging Face decode hands both paths): each of its three sums carries a relative
    error of at most gamma, so |error| <= gamma (R + 2 |(o - mu).S| + C |o - mu|^2) with
    R = sum c |v - mu|^2, S = sum c (v - mu), C = sum c (float64 from the captured inputs), plus the
    output's rounding delta <= gamma max|v| moving it by 2 delta sum c |v - o|. R, S and C can exceed
    the trace by orders of magnitude when one token dominates (o far from mu): this is the bound's
    point, not a margin."""
    g = call["q"].shape[1] // call["keys"].shape[1]
    lp = call["log_pi"][0, head // g].double()
    live = torch.isfinite(lp)
    k, v = call["keys"][0, head // g].double()[live], call["values"][0, head // g].double()[live]
    s = call["scale"] * (k @ call["q"][0, head].double()) - lp[live]
    a = torch.softmax(s, 0)
    c = -torch.expm1(lp[live]) * a * a
    o, mu = a @ v, v.mean(0)
    dm = o - mu
    cond = float(c @ ((v - mu) ** 2).sum(1) + 2 * (dm @ (c @ (v - mu))).abs() + c.sum() * (dm @ dm))
    n = int(live.sum())
    gamma = _gamma(n, math.ceil(n / 256))
    return gamma * cond + 2 * gamma * float(v.abs().max()) * float(c @ (v - o).norm(dim=1))


@pytest.mark.model
@pytest.mark.slow
def test_recorded_certificates_unchanged_between_op_and_torch(op, model_sdpa, monkeypatch):
    """kvcert.generate with PoissonPress(0.5, seed=0, sketch=None) on the op path (A) and the torch path (B): the
    same text and kept counts, and per step, layer and head the recorded trace and radius agree
    within |A - ref64(A)| + |ref64(A) - ref64(B)| + |ref64(B) - B|: the triangle through the float64
    oracle on each run's own decode inputs (they differ by the rounding of the earlier layers), the
    outer terms bounded by :func:`_trace_rounding` (the radius sqrt(trace / delta) moves by half the
    trace's relative error)."""
    import kvcert

    model, tok = model_sdpa
    runs = {}
    for route in ("cpu_op", "torch"):
        if route == "torch":
            monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
        calls, original = [], D.hajek_attention

        def spy(q, keys, values, pi=None, _calls=calls, **kw):
            out = original(q, keys, values, pi, **kw)
            _calls.append({"q": q.clone(), "keys": keys.clone(), "values": values.clone(),
                           "log_pi": kw["log_pi"].clone(), "scale": kw["scale"], "route": out.route})
            return out

        monkeypatch.setattr(D, "hajek_attention", spy)
        press = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)  # the token route's op
        runs[route] = (kvcert.generate(model, tok, SHORT_PROMPT, press=press, max_new_tokens=4), calls)
        monkeypatch.setattr(D, "hajek_attention", original)
    (ra, ca), (rb, cb) = runs["cpu_op"], runs["torch"]
    assert {c["route"] for c in ca} == {"cpu_op"} and {c["route"] for c in cb} == {"torch"}
    assert ra.text == rb.text and torch.equal(ra.certificates.kept, rb.certificates.kept)
    n_layers, h_q = ra.certificates.trace.shape[1:]
    assert len(ca) == len(cb) == n_layers * (ra.certificates.trace.shape[0] - 1)
    compressed = 0
    for i, (a, b) in enumerate(zip(ca, cb)):
        step, layer = 1 + i // n_layers, i % n_layers
        for head in range(h_q):
            est_a, rad_a, _, _ = reference_certificate(a, head, delta=press.delta, kind=press.kind)
            est_b, rad_b, _, _ = reference_certificate(b, head, delta=press.delta, kind=press.kind)
            tol_a, tol_b = _trace_rounding(a, head), _trace_rounding(b, head)
            compressed += est_a.trace > 0
            t_a, t_b = (float(x.certificates.trace[step, layer, head]) for x in (ra, rb))
            assert abs(t_a - t_b) <= tol_a + tol_b + abs(est_a.trace - est_b.trace), (
                "trace", step, layer, head, t_a, t_b, est_a.trace, est_b.trace)
            r_a, r_b = (float(x.certificates.radius[step, layer, head]) for x in (ra, rb))
            rel = 0.5 * (tol_a / est_a.trace if est_a.trace > 0 else 0.0) * rad_a
            rel += 0.5 * (tol_b / est_b.trace if est_b.trace > 0 else 0.0) * rad_b
            assert abs(r_a - r_b) <= rel + abs(rad_a - rad_b), ("radius", step, layer, head, r_a, r_b, rad_a, rad_b)
    assert compressed > 0, "some heads carry a certificate"


# ----------------------------------------------------------------------------- the paged route (vLLM's CPU layout)
def _paged(k, v, pi, bs, *, seed=0, extra_blocks=3):
    """k, v (E, h, n, d) and pi (E, h, n) written into a ``vec`` cache (num_blocks, h, bs, 2 d) at scattered
    physical blocks: per (block, head) the keys transposed [d, bs], then the values [bs, d]; unused slots hold
    garbage. Returns the cache, block ids (E, M) and log pi (E, h, M * bs) (-inf past n and on pi = 0)."""
    E, h, n, d = k.shape
    M = -(-n // bs)
    g = torch.Generator().manual_seed(seed)
    nb = E * M + extra_blocks
    cache = 1e3 * torch.randn(nb, h, bs, 2 * d, generator=g).to(k.dtype)  # garbage wherever no token is written
    ids = torch.randperm(nb, generator=g)[: E * M].view(E, M)
    pad = M * bs - n
    kp = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(E, h, M, bs, d)
    vp = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(E, h, M, bs, d)
    flat = cache.view(nb, h, bs * 2 * d)
    for e in range(E):
        for j in range(M):
            blk = int(ids[e, j])
            flat[blk, :, : bs * d] = kp[e, :, j].transpose(-1, -2).reshape(h, d * bs)  # keys [d, bs]
            flat[blk, :, bs * d:] = vp[e, :, j].reshape(h, bs * d)  # values [bs, d]
    lp = torch.nn.functional.pad(torch.log(pi.double()), (0, pad), value=float("-inf")).float()
    return cache, ids, lp


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("n", [1, 113, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [1, 3])
def test_paged_route_matches_reference_and_fast(op, bs, n, dtype, g):
    q, k, v, pi = _case(n, dtype, g, seed=n + bs)
    cache, ids, lp = _paged(k, v, pi, bs, seed=n)
    est = op.paged_hajek_attention(q, cache, ids, lp)
    assert est.output.dtype == dtype and est.trace.shape == q.shape[:2]
    _check(est, q, k, v, pi, per_coordinate=False, fields=("output", "lse", "trace", "n_eff"))


@pytest.mark.parametrize("bs", [16, 64, 128])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_route_is_the_dense_op_bit_for_bit(op, bs, d, dtype):
    """The paged route scores a block's kept slots straight from its [d, bs] key matrix, kW slots to a vector
    (no key gathered): the same sums as the dense route's micro-kernel, in the same order, so the output, lse,
    trace and n_eff equal the dense op's over the gathered slots exactly, at the block sizes engines use and
    both micro-kernel head sizes, with runs cut by evicted slots (pi = 0) and block ends, and NaN in every slot
    not read."""
    q, k, v, pi = _case(700, dtype, 3, seed=bs + d, d=d, dv=d)
    cache, ids, lp = _paged(k, v, pi, bs, seed=d)
    poisoned = _poison(cache, ids, lp, bs, d)
    a = op.paged_hajek_attention(q, poisoned, ids, lp)
    kg, vg = _gather(cache, ids)
    b = op.hajek_attention(q, kg, vg, log_pi=lp, per_coordinate=False)
    for f in ("output", "lse", "trace", "n_eff"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    # negative control: one kept key changed moves the scores (and the output)
    e, h, i = 1, 0, int((lp[1, 0] > float("-inf")).nonzero()[5, 0])
    flat = poisoned.view(poisoned.shape[0], poisoned.shape[1], -1)
    flat[int(ids[e, i // bs]), h, (i % bs): bs * d: bs] += 3.0
    c = op.paged_hajek_attention(q, poisoned, ids, lp)
    assert not torch.equal(a.output[e], c.output[e]) and torch.equal(a.output[0], c.output[0])


def test_paged_route_reads_only_the_slots_it_is_given(op):
    q, k, v, pi = _case(239, torch.float32, 3, seed=5)
    cache, ids, lp = _paged(k, v, pi, 32, seed=2)
    a = op.paged_hajek_attention(q, cache, ids, lp)
    # garbage in every slot marked -inf (padding past n, pi = 0) and in blocks no row reads: the same result
    poisoned = cache.clone()
    flat = poisoned.view(cache.shape[0], cache.shape[1], -1)  # per (block, head): keys [d, bs], values [bs, d]
    bs, d = 32, 64
    unread = torch.isneginf(lp)
    for e in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            blk = int(ids[e, j])
            for h, o in (unread[e, :, j * bs:(j + 1) * bs]).nonzero().tolist():
                flat[blk, h, o: bs * d: bs] = float("nan")  # the slot's key
                flat[blk, h, bs * d + o * d: bs * d + (o + 1) * d] = float("nan")  # its value
    spare = sorted(set(range(cache.shape[0])) - set(ids.flatten().tolist()))
    poisoned[spare] = float("nan")
    b = op.paged_hajek_attention(q, poisoned, ids, lp)
    assert torch.equal(a.output, b.output) and torch.equal(a.trace, b.trace)
    # negative control: one read slot changed changes the output
    live = int((~unread[0, 0]).nonzero()[0, 0])
    flat[int(ids[0, live // bs]), 0, bs * d + (live % bs) * d: bs * d + (live % bs + 1) * d] += 100.0
    c = op.paged_hajek_attention(q, poisoned, ids, lp)
    assert not torch.allclose(a.output, c.output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_route_takes_a_logit_softcap_in_its_pass(op, dtype):
    """``softcap=c`` (Gemma 2): the op's scores are c tanh(tau q.k / c) - log pi. Against the float64 softcapped
    estimator (its weights w = softmax(c tanh(s/c) - log pi) computed here), within twice the float32 torch
    estimator's own distance from it plus the op's rounding (``_gamma``: the sums; the scores' tanh adds a few
    ulp per logit, inside gamma): output to gamma max|v|, lse to gamma + eps |lse|, the trace
    sum (1 - pi) w^2 |v - o|^2 to 4 gamma sum (1 - pi) w^2 diam^2. Negative control: the same call without the
    softcap fails the same check (the cap bends these scores: |tau q.k| reaches 3-4 against c = 2)."""
    cap = 2.0
    q, k, v, pi = _case(300, dtype, 3, seed=11)
    cache, ids, lp = _paged(k, v, pi, 32, seed=3)
    est = op.paged_hajek_attention(q, cache, ids, lp, softcap=cap)
    b, h_q, d = q.shape
    h = k.shape[1]
    scale = d ** -0.5
    q64, k64, v64 = q.double(), k.double(), v.double()
    s64 = torch.einsum("bhgd,bhnd->bhgn", q64.view(b, h, h_q // h, d), k64) * scale
    capped = cap * torch.tanh(s64 / cap)
    live = pi > 0
    lp64 = torch.where(live, pi.double().log(), float("-inf"))[:, :, None, :]
    logits = capped + torch.where(live[:, :, None, :], -lp64, float("-inf"))
    w = torch.softmax(logits, -1)  # (b, h, g, n)
    o = torch.einsum("bhgn,bhnd->bhgd", w, v64)
    lse = torch.logsumexp(logits, -1)
    om = (1 - pi.double())[:, :, None, :]
    trace = (om * w ** 2 * ((v64[:, :, None] - o[:, :, :, None]) ** 2).sum(-1)).sum(-1)
    bias = lambda qq, kk: (cap * torch.tanh(torch.einsum("bhgd,bhnd->bhgn", qq.view(b, h, h_q // h, d), kk) * scale / cap)
                           - torch.einsum("bhgd,bhnd->bhgn", qq.view(b, h, h_q // h, d), kk) * scale).reshape(b, h_q, -1)
    fst = F.hajek_attention(q.float(), k.float(), v.float(), pi.float(), scale=scale, per_coordinate=False,
                            bias=bias(q.float(), k.float()))
    g = _gamma(300, max(1, math.ceil(300 / 256)))
    vmax = v64.abs().amax((-1, -2))[:, :, None].expand(b, h, h_q // h).reshape(b, h_q)
    diam = 2 * v64.norm(dim=-1).amax(-1)[:, :, None].expand(b, h, h_q // h).reshape(b, h_q)
    c_sum = (om * w ** 2).sum(-1).reshape(b, h_q)
    ref = {"output": o.reshape(b, h_q, d), "lse": lse.reshape(b, h_q), "trace": trace.reshape(b, h_q)}
    eps_out = EPS[dtype] if dtype != torch.float32 else 0.0
    tol = {"output": g * vmax[..., None] + eps_out * ref["output"].abs(),
           "lse": g + EPS[torch.float32] * ref["lse"].abs(), "trace": 4 * g * c_sum * diam ** 2}
    bound = {}
    for f in ("output", "lse", "trace"):
        bound[f] = 2 * (getattr(fst, f).double() - ref[f]).abs() + tol[f]
        assert_close(f, getattr(est, f).double().numpy(), ref[f].numpy(), bound[f].numpy())
    plain = op.paged_hajek_attention(q, cache, ids, lp)
    assert not bool(((plain.output.double() - ref["output"]).abs() <= bound["output"]).all())
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        op.paged_hajek_attention(q, cache, ids, lp, softcap=0.0)


def test_paged_route_refuses_by_name(op):
    q, k, v, pi = _case(64, torch.float32, 1, seed=1)
    cache, ids, lp = _paged(k, v, pi, 32)
    with pytest.raises(RuntimeError, match=r"block_ids must lie in \[0, "):
        op.paged_hajek_attention(q, cache, ids + cache.shape[0], lp)
    with pytest.raises(ValueError, match="log_pi must be"):
        op.paged_hajek_attention(q, cache, ids, lp[:, :, :-1])
    with pytest.raises(ValueError, match=r"log_pi must lie in \[-inf, 0\]"):
        op.paged_hajek_attention(q, cache, ids, lp.abs())
    with pytest.raises(ValueError, match="block_ids must be an int64"):
        op.paged_hajek_attention(q, cache, ids.int(), lp)
    with pytest.raises(ValueError, match=r"q must be \(E, h_q, d\)"):
        op.paged_hajek_attention(q[:1], cache, ids, lp)


# ----------------------------------------------------------------------------- the sketch route (cluster designs)
def _sketch_case(n, dtype, g, *, seed=0, tilt=False, pad="ragged", clusters=4, reach=True):
    """A kept cache (make_case) and a sketch of 3 n other tokens of the same heads (``clusters`` clusters; the
    recommended tilted form when ``tilt``; no hull bound without ``reach``), with the value moments the Hugging
    Face decode passes."""
    q, k, v, pi = _case(n, dtype, g, seed=seed, pad=pad)
    gen = torch.Generator().manual_seed(seed + 1)
    b, h_kv, _, d = k.shape
    N = 3 * max(n, 4)
    ek, ev = torch.randn(b, h_kv, N, d, generator=gen), torch.randn(b, h_kv, N, v.shape[-1], generator=gen)
    epi = torch.rand(b, h_kv, N, generator=gen).clamp_(0.05, 0.95)
    keep = torch.rand(b, h_kv, N, generator=gen) < 0.3
    design = F.ClusterDesign(clusters=clusters, radius="chebyshev", tilt=tilt)
    sketch = F.cluster_sketch(ek, ev, epi, keep, design, tilt=torch.randn(b, h_kv, d, generator=gen) if tilt else None)
    if not reach:
        sketch = replace(sketch, reach=None)
    mu, r2 = F.value_moments(v.float(), pi)
    return q, k, v, pi, sketch, mu, r2


def _sketch_fields(ce, record=None):
    """The step's fields; ``record``: also the recorded trace, the op's ``estimate.trace`` (``op=True``) or
    kvcert.fast.recorded_trace of ``ce``."""
    out = {"output": ce.estimate.output, "lse": ce.estimate.lse, "variance": ce.variance, "radius": ce.radius}
    if ce.bound is not None:
        out["bound"] = ce.bound
    if record == "op":
        out["recorded"] = ce.estimate.trace
    elif record is not None:
        out["recorded"] = F.recorded_trace(ce, record)
    return out


def _check_sketch(ce, q, k, v, pi, sketch, mu, r2, record=None, scale=None):
    """The op's sketch step against kvcert.fast's in float64 (the oracle: the same formulas, exact to
    about 1e-15) within 2 |fast32 - ref64| + rounding: the output and lse as the token route's; V_cl 8 gamma
    relative (V_cl = (T' + the clusters' part) / Z^2: T' in the centred form of the trace, Z^2 two roundings
    of Z; the epilogue itself in double); the hull bound ||o - mu_s|| + max(reach, sqrt(max_S r) + ||mu - mu_s||)
    moves by ||delta o|| <= sqrt(dv) gamma max|v| and by the float32 sum of r over dv squares ((dv + 2) eps
    relative, with the final rounding); the radius min(c sqrt(V_cl), H) by either's; the recorded trace
    min(V_cl, (H / c)^2) by V_cl's or (2 H dH + dH^2) / c^2. ``record``: a kind whose recorded trace the op
    returned in ``estimate.trace``. Returns the oracle's fields and each field's tolerance."""
    lp = pi.log()
    kw = dict(trace=False, delta=ce.delta, rule=ce.rule, scale=scale)
    ref64 = F.sketch_hajek_attention(q.double(), k.double(), v.double(), None, sketch, log_pi=lp.double(),
                                      value_center=mu.double(), value_sqdist=r2.double(), **kw)
    ref = _sketch_fields(ref64, record)
    fst = _sketch_fields(F.sketch_hajek_attention(q, k, v, None, sketch, log_pi=lp, value_center=mu, value_sqdist=r2,
                                                   **kw), record)
    got = _sketch_fields(ce, "op" if record is not None else None)
    assert set(got) == set(ref), (set(got), set(ref))
    n, dv = k.shape[2], v.shape[-1]
    gam = _gamma(n, max(1, math.ceil(n / 256)))
    vmax = v.float().abs().amax(dim=(-2, -1)).repeat_interleave(q.shape[1] // k.shape[1], dim=1).double()
    if q.dim() == 4:
        vmax = vmax[..., None]
    eps_out = EPS[k.dtype] if k.dtype != torch.float32 else 0.0
    finite = lambda x: x.abs().nan_to_num(posinf=0.0, neginf=0.0)  # noqa: E731
    rounding = {"output": (gam * vmax)[..., None] + eps_out * ref["output"].abs(),
                "lse": gam + EPS[torch.float32] * finite(ref["lse"]),
                "variance": 8 * gam * finite(ref["variance"])}
    rounding["radius"] = 8 * gam * finite(ref["radius"])
    if "bound" in ref:
        rounding["bound"] = math.sqrt(dv) * gam * vmax + (dv + 2) * EPS[torch.float32] * finite(ref["bound"])
        rounding["radius"] = rounding["radius"] + rounding["bound"]
    if "recorded" in ref:
        rounding["recorded"] = rounding["variance"]
        if "bound" in ref:
            c = F.sketch._radius_per_root_trace(record, ref64.delta)
            h, dh = finite(ref["bound"]), rounding["bound"]
            rounding["recorded"] = rounding["recorded"] + (2 * h * dh + dh * dh) / c ** 2
    tols = {}
    for f, r in ref.items():
        r = r.numpy()
        with np.errstate(invalid="ignore"):
            mirror = np.abs(fst[f].double().numpy() - r)
        mirror = np.where(np.isfinite(mirror), mirror, 0.0)
        tols[f] = 2 * mirror + rounding[f].numpy()
        assert_close(f, got[f].double().numpy(), r, tols[f])
    return {f: r.numpy() for f, r in ref.items()}, tols


@pytest.mark.parametrize("tilt", [False, True])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, clusters", [(1, 1), (113, 8), (239, 3), (1023, 4), (1500, 8)])
def test_sketch_route_matches_fast(op, n, clusters, dtype, g, tilt):
    q, k, v, pi, sketch, mu, r2 = _sketch_case(n, dtype, g, seed=n, tilt=tilt, clusters=clusters)
    ce = op.sketch_hajek_attention(q, k, v, None, sketch, log_pi=pi.log(), value_center=mu, value_sqdist=r2)
    assert ce.estimate.trace is None  # as kvcert.fast's trace=False: the HT trace is not formed
    assert ce.bound is not None and ce.rule == "chebyshev"
    _check_sketch(ce, q, k, v, pi, sketch, mu, r2)


@pytest.mark.parametrize("record", ["chebyshev", "tilted_hull"])
@pytest.mark.parametrize("reach", [True, False])
@pytest.mark.parametrize("tilt", [False, True])
def test_sketch_route_matches_fast_with_the_recorded_trace(op, reach, tilt, record):
    """The recorded trace min(V_cl, (H / c)^2) computed in the op (``record=``), with and without a hull bound
    (without: V_cl itself, and no bound), the kind's c at another delta; and without value moments (the op's
    route computes the mean kept value)."""
    q, k, v, pi, sketch, mu, r2 = _sketch_case(239, torch.float32, 3, seed=5, tilt=tilt, reach=reach, clusters=5)
    ce = op.sketch_hajek_attention(q, k, v, None, sketch, log_pi=pi.log(), value_center=mu, value_sqdist=r2,
                                    record=record, delta=0.1)
    assert (ce.bound is not None) == reach and ce.delta == 0.1
    _check_sketch(ce, q, k, v, pi, sketch, mu, r2, record=record)
    if not reach:
        assert ce.estimate.trace is ce.variance  # as kvcert.fast.recorded_trace
    own = op.sketch_hajek_attention(q, k, v, pi, sketch, record=record, delta=0.1)  # pi, and no moments given
    for f in ("output", "lse", "variance", "radius", "recorded"):
        a, b = _sketch_fields(own, "op")[f], _sketch_fields(ce, "op")[f]
        assert torch.allclose(a.double(), b.double(), rtol=1e-5, atol=1e-6), f


def test_sketch_route_several_query_rows_and_a_float64_query(op):
    """q (b, h_q, t, d): the op's rows in the caller's layout, no causal mask (as kvcert.fast); a float64 q gets
    float64 statistics (kvcert.fast's compute dtype), from the same float32 computation."""
    q, k, v, pi, sketch, mu, r2 = _sketch_case(239, torch.float32, 3, seed=2, tilt=True)
    q4 = torch.randn(q.shape[0], q.shape[1], 3, q.shape[2], generator=torch.Generator().manual_seed(9))
    ce = op.sketch_hajek_attention(q4, k, v, None, sketch, log_pi=pi.log(), value_center=mu, value_sqdist=r2)
    assert ce.estimate.output.shape == (*q4.shape[:3], v.shape[-1]) and ce.variance.shape == q4.shape[:3]
    _check_sketch(ce, q4, k, v, pi, sketch, mu, r2)
    ce64 = op.sketch_hajek_attention(q.double(), k, v, None, sketch, log_pi=pi.log(), value_center=mu,
                                      value_sqdist=r2)
    ce32 = op.sketch_hajek_attention(q, k, v, None, sketch, log_pi=pi.log(), value_center=mu, value_sqdist=r2)
    assert ce64.variance.dtype == ce64.radius.dtype == ce64.bound.dtype == ce64.estimate.lse.dtype == torch.float64
    assert torch.equal(ce64.variance, ce32.variance.double()) and torch.equal(ce64.radius, ce32.radius.double())


def test_sketch_route_empty_rows_and_negative_controls(op):
    """A KV head with nothing kept: output 0, lse -inf, V_cl, the radius, the bound and the recorded trace
    +inf (as kvcert.fast), also for an empty cache (n = 0); and the comparison catches a 1 % error in the
    offsets -log pi, in the sketch's key means (the form's W), in its masses, and in its reach (the bound)."""
    q, k, v, pi, sketch, mu, r2 = _sketch_case(239, torch.float32, 3, pad="empty_head")
    ce = op.sketch_hajek_attention(q, k, v, None, sketch, log_pi=pi.log(), value_center=mu, value_sqdist=r2,
                                    record="tilted_hull")
    ref = F.sketch_hajek_attention(q, k, v, None, sketch, log_pi=pi.log(), value_center=mu, value_sqdist=r2,
                                    trace=False)
    empty = torch.isinf(ref.estimate.lse)
    assert bool(empty.any())
    assert torch.equal(torch.isinf(ce.estimate.lse), empty) and bool((ce.estimate.output[empty] == 0).all())
    for x in (ce.variance, ce.radius, ce.bound, ce.estimate.trace):
        assert bool((x[empty] == float("inf")).all()) and bool(torch.isfinite(x[~empty]).all())
    _check_sketch(ce, q, k, v, pi, sketch, mu, r2, record="tilted_hull")
    nothing = op.sketch_hajek_attention(q, k[:, :, :0], v[:, :, :0], pi[:, :, :0], sketch, record="chebyshev")
    assert bool((nothing.estimate.output == 0).all()) and bool((nothing.estimate.lse == float("-inf")).all())
    for x in (nothing.variance, nothing.radius, nothing.bound, nothing.estimate.trace):
        assert bool((x == float("inf")).all())
    kw = dict(value_center=mu, value_sqdist=r2)
    controls = [("output|variance", pi.log() * 1.01, sketch),
                ("variance", pi.log(), replace(sketch, mean=sketch.mean * 1.01)),
                ("variance", pi.log(), replace(sketch, weight=sketch.weight * 1.01, wnorm=sketch.wnorm * 1.01)),
                ("bound", pi.log(), replace(sketch, reach=sketch.reach * 1.01 + 0.01))]
    for match, lp, sk in controls:
        bad = op.sketch_hajek_attention(q, k, v, None, sk, log_pi=lp, **kw)
        with pytest.raises(AssertionError, match=match):
            _check_sketch(bad, q, k, v, pi, sketch, mu, r2)


def test_sketch_route_a_nan_bound_caps_nothing(op):
    """A NaN reach (a sketch that lost its hull bound) makes the bound NaN: the radius is then the rule's
    c sqrt(V_cl) uncapped (torch.fmin) and the recorded trace NaN (torch.minimum), as kvcert.fast."""
    q, k, v, pi, sketch, mu, r2 = _sketch_case(239, torch.float32, 3, pad="none", seed=4)
    reach = sketch.reach.clone()
    reach[0, 1] = float("nan")
    sk = replace(sketch, reach=reach)
    kw = dict(log_pi=pi.log(), value_center=mu, value_sqdist=r2)
    ce = op.sketch_hajek_attention(q, k, v, None, sk, record="chebyshev", **kw)
    fst = F.sketch_hajek_attention(q, k, v, None, sk, trace=False, **kw)
    rows = torch.zeros_like(ce.variance, dtype=torch.bool)
    rows[0, 3:6] = True  # the query heads of KV head (0, 1)
    assert torch.equal(torch.isnan(ce.bound), rows) and torch.equal(torch.isnan(fst.bound), rows)
    assert torch.equal(torch.isnan(ce.estimate.trace), rows)
    assert torch.equal(torch.isnan(F.recorded_trace(fst, "chebyshev")), rows)
    uncapped = ce.variance.sqrt() * (1 / 0.05) ** 0.5
    assert torch.allclose(ce.radius[rows], uncapped[rows], rtol=1e-6) and bool(torch.isfinite(ce.radius).all())
    assert torch.allclose(ce.radius, fst.radius, rtol=1e-4)


def test_sketch_route_refuses_by_name(op):
    """Bad input is refused with the contract's error naming the argument, with or without validate; a NaN
    output is refused with validate (no silent NaN)."""
    q, k, v, pi, sketch, mu, r2 = _sketch_case(113, torch.float32, 3)
    lp = pi.log()
    for validate in (True, False):
        kw = dict(log_pi=lp, value_center=mu, value_sqdist=r2, validate=validate)
        with pytest.raises(ValueError, match="h_q"):
            op.sketch_hajek_attention(q[:, :5], k, v, None, sketch, **kw)
        with pytest.raises(ValueError, match="log_pi"):
            op.sketch_hajek_attention(q, k, v, None, sketch, **{**kw, "log_pi": lp[..., :5]})
        with pytest.raises(ValueError, match="sketch.mean"):
            op.sketch_hajek_attention(q, k, v, None, sketch.map(lambda x: x[:, :1]), **kw)
        with pytest.raises(TypeError, match="ClusterSketch"):
            op.sketch_hajek_attention(q, k, v, None, object(), **kw)
        with pytest.raises(ValueError, match="delta"):
            op.sketch_hajek_attention(q, k, v, None, sketch, delta=1.5, **kw)
        with pytest.raises(ValueError, match="rule"):
            op.sketch_hajek_attention(q, k, v, None, sketch, rule="nope", **kw)
        with pytest.raises(ValueError, match="multiplier"):
            op.sketch_hajek_attention(q, k, v, None, sketch, rule="fixed", multiplier=-1.0, **kw)
        with pytest.raises(ValueError, match="kind"):
            op.sketch_hajek_attention(q, k, v, None, sketch, record="nope", **kw)
        with pytest.raises(ValueError, match="value_center"):
            op.sketch_hajek_attention(q, k, v, None, sketch, **{**kw, "value_center": mu[:, :, :3]})
        with pytest.raises(TypeError, match="value_center"):
            op.sketch_hajek_attention(q, k, v, None, sketch, **{**kw, "value_center": None})
        with pytest.raises(TypeError, match="float32 or both bfloat16"):
            op.sketch_hajek_attention(q, k.half(), v.half(), None, sketch, **kw)
        with pytest.raises(TypeError, match="exactly one"):
            op.sketch_hajek_attention(q, k, v, pi, sketch, **kw)
    with pytest.raises(ValueError, match="log_pi"):  # values: only with validate
        op.sketch_hajek_attention(q, k, v, None, sketch, log_pi=lp.abs(), value_center=mu, value_sqdist=r2)
    bad = q.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        op.sketch_hajek_attention(bad, k, v, None, sketch, log_pi=lp, value_center=mu, value_sqdist=r2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_forwards_resolved_op_route_gives_the_checked_calls_numbers(op, monkeypatch, dtype):
    """kvcert.dispatch.decode resolves its route once per forward: D.CPU_OP where the op computes the
    call. A layer's step on it (the op's hajek_attention / sketch_hajek_attention with validate=False, without
    the argument checks) gives the checked op call's numbers bit for bit, on the token and the sketch routes; a call the
    step does not cover runs as "fast"; KVCERT_CPU_OP=0 resolves to D.TORCH."""
    from types import SimpleNamespace

    q, k, v, pi, sketch, mu, r2 = _sketch_case(239, dtype, 3, tilt=True)
    lp = pi.log()
    token = SimpleNamespace(keys=k, values=v, log_weights=lp, positions=None, block_size=None, sketch=None,
                            kept=(pi > 0).sum(-1), value_moments=lambda distances=True: (mu, r2 if distances else None))
    kw = dict(scale=0.125, options={"per_coordinate": False}, kind="chebyshev", delta=0.05)
    dec = D.decode(q[:, :, None], token, **kw)
    assert (dec.backend, dec.ran) == (D.CPU_OP, D.CPU_OP)
    assert (dec.records[0].estimate.backend, dec.records[0].estimate.route) == ("fast", "cpu_op")
    again = D.decode(q[:, :, None], token, backend=dec.backend, **kw)  # the forward's next layer
    checked = op.hajek_attention(q, k, v, log_pi=lp, scale=0.125, per_coordinate=False, value_center=mu)
    for est in (dec.records[0].estimate, again.records[0].estimate):
        for f in ("output", "lse", "trace", "n_eff"):
            assert torch.equal(getattr(est, f), getattr(checked, f)), f
    assert torch.equal(dec.output[:, 0], checked.output)
    other = D.decode(q[:, :, None], replace_log_weights(token, lp.masked_fill(pi < 0.2, float("-inf"))), **kw)
    assert not torch.equal(other.records[0].estimate.trace, checked.trace)  # negative control: the inputs count
    full = D.hajek_attention(q, k, v, log_pi=lp, scale=0.125, per_coordinate=True, validate=False,
                             backend=D.CPU_OP)  # not a step's call: "fast", with the variance
    assert full.variance is not None and (full.backend, full.route) == ("fast", "torch")

    layer = SimpleNamespace(**{**vars(token), "sketch": sketch})
    kw = dict(kw, options={}, kind="tilted_hull")
    a = D.decode(q[:, :, None], layer, **kw)
    assert (a.backend, a.ran) == (D.CPU_OP, D.CPU_OP)
    ce = op.sketch_hajek_attention(q, k, v, None, sketch, log_pi=lp, scale=0.125, delta=0.05, value_center=mu,
                                   value_sqdist=r2, record="tilted_hull")
    est = a.records[0].estimate
    for got, want in ((est.output, ce.estimate.output), (est.lse, ce.estimate.lse), (est.trace, ce.estimate.trace),
                      (a.output[:, 0], ce.estimate.output)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="backend"):
        D.sketch_hajek_attention(q, k, v, None, sketch, log_pi=lp, backend="triton", trace=False)
    # another token backend resolved for the forward (the Triton kernel's, on CUDA) leaves the sketch's own choice
    b = D.decode(q[:, :, None], layer, backend="triton", **kw)
    assert (b.backend, b.ran) == (D.TRITON, D.CPU_OP) and torch.equal(b.output, a.output)

    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    t = D.decode(q[:, :, None], token, **dict(kw, options={"per_coordinate": False}, kind="chebyshev"))
    assert (t.backend, t.ran) == (D.TORCH, D.TORCH)
    # float32 sums of two codes (atol as above); in bfloat16 both round such values to bfloat16: at most one
    # bfloat16 spacing apart, 2^-7 relative at most
    rtol = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    assert torch.allclose(t.output.float(), dec.output.float(), rtol=rtol, atol=1e-5)


def _sqdist(values, kw):
    """A decode call's ||v_i - mu||^2: its ``value_sqdist``, or where the op's step was given the centre alone (the
    op computes them in its pass), the cache layer's formula (0 on padding, as kvcert.fast.value_moments)."""
    if kw.get("value_sqdist") is not None:
        return kw["value_sqdist"].clone()
    r2 = (values.float() - kw["value_center"][:, :, None]).square().sum(-1)
    return torch.where(kw["log_pi"] > float("-inf"), r2, 0.0)


def replace_log_weights(layer, log_weights):
    """A copy of a stand-in cache layer with other log pi (and its kept counts)."""
    from types import SimpleNamespace

    return SimpleNamespace(**{**vars(layer), "log_weights": log_weights, "kept": torch.isfinite(log_weights).sum(-1)})


def test_dispatch_runs_the_sketch_route_on_the_op_and_the_switch_forces_torch(op, monkeypatch):
    """kvcert.dispatch.decode on a sketch layer: the op's step, the same record as kvcert.fast's, and
    KVCERT_CPU_OP=0 runs kvcert.fast."""
    from types import SimpleNamespace

    q, k, v, pi, sketch, mu, r2 = _sketch_case(239, torch.float32, 3, tilt=True, pad="none")
    layer = SimpleNamespace(keys=k, values=v, log_weights=pi.log(), positions=None, block_size=None, sketch=sketch,
                            kept=(pi > 0).sum(-1), value_moments=lambda distances=True: (mu, r2 if distances else None))
    kw = dict(scale=0.125, options={}, kind="tilted_hull", delta=0.05)
    a = D.decode(q[:, :, None], layer, **kw)
    assert (a.route, a.ran) == ("sketch", D.CPU_OP)
    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    t = D.decode(q[:, :, None], layer, **kw)
    assert (t.route, t.ran) == ("sketch", D.TORCH)
    ra, rt = a.records[0].estimate, t.records[0].estimate
    assert torch.allclose(a.output, t.output, rtol=0, atol=1e-5)
    assert torch.allclose(ra.trace, rt.trace, rtol=1e-4, atol=0)  # the recorded (clipped) V_cl
    assert torch.equal(a.records[0].kept, t.records[0].kept)


def test_recorded_sketch_certificates_of_a_decode_are_unchanged(op, monkeypatch):
    """kvcert's default design (``PoissonPress``'s tilted sketch, kind tilted_hull) decoding a tiny model on the op
    route (A) and the torch route (B, KVCERT_CPU_OP=0): every op step within its tolerance of the float64 oracle on
    its own inputs (:func:`_check_sketch`, the recorded trace included) and recorded as computed; the same kept
    counts; and per step, layer and head A's recorded trace and radius within tol_A + tol_B + |ref64(A) - ref64(B)|
    of B's (the triangle through the oracle: the two runs' inputs differ by the rounding of earlier layers)."""
    import kvcert
    from model_fixtures import forced_logits, tiny_model

    model = tiny_model()
    ids = torch.randint(1, 96, (1, 150), generator=torch.Generator().manual_seed(0))
    cont = [torch.tensor([[5 + t]]) for t in range(4)]
    runs = {}
    for route in ("cpu_op", "torch"):
        if route == "torch":
            monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
        calls, original = [], D.sketch_hajek_attention

        def spy(q, keys, values, pi=None, sketch=None, _calls=calls, **kw):
            ce = original(q, keys, values, pi, sketch, **kw)
            _calls.append(dict(q=q.clone(), k=keys.clone(), v=values.clone(), pi=kw["log_pi"].exp(), sketch=sketch,
                               mu=kw["value_center"].clone(), r2=_sqdist(values, kw), scale=kw["scale"],
                               record=kw["record"], ce=ce, route=ce.estimate.route))
            return ce

        monkeypatch.setattr(D, "sketch_hajek_attention", spy)
        press = kvcert.PoissonPress(compression_ratio=0.6, seed=2, sinks=2, window=8)
        forced_logits(model, ids, cont, press)
        monkeypatch.setattr(D, "sketch_hajek_attention", original)
        runs[route] = (press.certificates[0], calls)
    (ca, calls_a), (cb, calls_b) = runs["cpu_op"], runs["torch"]
    assert {c["route"] for c in calls_a} == {"cpu_op"} and {c["route"] for c in calls_b} == {"torch"}
    assert ca.kind == "tilted_hull" and len(calls_a) == len(calls_b) == 2 * len(cont)
    assert torch.equal(ca.kept, cb.kept)
    for i, (a, b) in enumerate(zip(calls_a, calls_b)):
        s, li = divmod(i, 2)  # layer-major within a step
        assert a["sketch"].tilt is not None and a["record"] == "tilted_hull"
        args = lambda c: (c["q"], c["k"], c["v"], c["pi"], c["sketch"], c["mu"], c["r2"])  # noqa: E731
        ref_a, tol_a = _check_sketch(a["ce"], *args(a), record=a["record"], scale=a["scale"])
        ref_b, tol_b = _check_sketch(b["ce"], *args(b), record=b["record"], scale=b["scale"])
        assert torch.allclose(ca.trace[s + 1, li].double(), a["ce"].estimate.trace[0].double(), rtol=1e-6)
        t_a, t_b = (x.trace[s + 1, li].double().numpy() for x in (ca, cb))
        tol = tol_a["recorded"][0] + tol_b["recorded"][0] + np.abs(ref_a["recorded"][0] - ref_b["recorded"][0])
        assert_close(f"recorded trace A vs B, step {s}, layer {li}", t_a, t_b, tol)
        r_a, r_b = (x.radius[s + 1, li].double().numpy() for x in (ca, cb))  # c sqrt(trace): dr / r = dt / (2 t)
        assert_close(f"radius A vs B, step {s}, layer {li}", r_a, r_b,
                     0.5 * tol / np.minimum(t_a, t_b) * np.maximum(r_a, r_b))


# ----------------------------------------------------------------------------- the paged sketch route (vLLM)
def _gather(cache, ids):
    """Keys and values (E, h_kv, M * bs, d) of the blocks ``ids`` (E, M) of a ``vec`` cache: the vLLM plugin's
    gather route (``kvcert.vllm.backend.gather_rows``, which needs vllm to import)."""
    nb, h, bs, two_d = cache.shape
    d = two_d // 2
    E, M = ids.shape
    flat = cache.view(nb, h, bs * two_d)[ids.reshape(-1)].view(E, M, h, bs * two_d)
    k = flat[..., : bs * d].reshape(E, M, h, d, bs).permute(0, 2, 1, 4, 3).reshape(E, h, M * bs, d)
    v = flat[..., bs * d:].reshape(E, M, h, bs, d).permute(0, 2, 1, 3, 4).reshape(E, h, M * bs, d)
    return k, v


def _poison(cache, ids, lp, bs, d):
    """The cache with NaN in every slot marked -inf (padding past n, pi = 0) and in every block no row reads."""
    poisoned = cache.clone()
    flat = poisoned.view(cache.shape[0], cache.shape[1], -1)  # per (block, head): keys [d, bs], values [bs, d]
    unread = torch.isneginf(lp)
    for e in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            blk = int(ids[e, j])
            for h, o in (unread[e, :, j * bs:(j + 1) * bs]).nonzero().tolist():
                flat[blk, h, o: bs * d: bs] = float("nan")
                flat[blk, h, bs * d + o * d: bs * d + (o + 1) * d] = float("nan")
    spare = sorted(set(range(cache.shape[0])) - set(ids.flatten().tolist()))
    poisoned[spare] = float("nan")
    return poisoned


@pytest.mark.parametrize("tilt", [False, True])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, clusters, bs", [(1, 1, 16), (239, 3, 32), (1024, 8, 16), (1500, 5, 32)])
def test_paged_sketch_route_matches_the_gather_route(op, n, clusters, bs, dtype, g, tilt):
    """The paged sketch step (the vLLM plugin's, value centre computed by the op) against the float64 oracle on
    the held slots (:func:`_check_sketch`, with the centre the exact mean kept value, which the op's double sum
    rounds once to float32) and against the gather route (gather_rows, then the dense op, which computes the
    same centre in torch): the same output and lse (the same pass over the same values), V_cl, radius, bound
    and recorded trace within their tolerances."""
    q, k, v, pi, sketch, _, _ = _sketch_case(n, dtype, g, seed=n + bs, tilt=tilt, clusters=clusters)
    cache, ids, lp = _paged(k, v, pi, bs, seed=n)
    ce = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, record="tilted_hull")
    assert ce.estimate.output.dtype == dtype and ce.variance.shape == q.shape[:2]
    mu, r2 = (x.float() for x in F.value_moments(v.double(), pi.double()))
    _, tol = _check_sketch(ce, q, k, v, pi, sketch, mu, r2, record="tilted_hull")
    kg, vg = _gather(cache, ids)
    gather = op.sketch_hajek_attention(q, kg, vg, None, sketch, log_pi=lp, record="tilted_hull")
    got, want = _sketch_fields(ce, "op"), _sketch_fields(gather, "op")
    assert torch.equal(got["output"], want["output"]) and torch.equal(got["lse"], want["lse"])
    for f in ("variance", "radius", "bound", "recorded"):
        assert_close(f"{f} paged vs gather", got[f].double().numpy(), want[f].double().numpy(), 2 * tol[f])


def _head_sums(cache, ids, lp, upto):
    """float64 (E, h_kv, d + 1): the sums of the kept values (log pi > -inf) of each row's slots before
    ``upto[e]`` and their count, read from the cache as the op reads it (the plugin's compacted prompt sums)."""
    _, vg = _gather(cache, ids)
    E, h = lp.shape[:2]
    out = torch.zeros(E, h, vg.shape[-1] + 1, dtype=torch.float64)
    for e in range(E):
        live = (~torch.isneginf(lp[e, :, : int(upto[e])])).double()          # (h, upto)
        out[e, :, :-1] = live[..., None].mul(vg[e, :, : int(upto[e])].double()).sum(1)
        out[e, :, -1] = live.sum(-1)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_sketch_route_with_given_prefix_sums_reads_the_rest_only(op, dtype):
    """center_sums / tail_start (the plugin's compacted prompt, summed once): the op adds the given sums of the
    slots before tail_start[e] to its read of the slots from there on. Given the true sums, every field equals
    the op's own full read within float32 rounding of the centre (the same double sums in another order); wrong
    sums change the certificate and not the output (negative control: the centre comes from the sums); bad
    shapes and ranges are refused by name."""
    q, k, v, pi, sketch, _, _ = _sketch_case(1024, dtype, 3, seed=11, tilt=True, clusters=8)
    bs = 16
    cache, ids, lp = _paged(k, v, pi, bs, seed=3)
    E, h = lp.shape[:2]
    start = torch.tensor([(j * 7 * bs) % lp.shape[-1] for j in range(E)], dtype=torch.int64)
    sums = _head_sums(cache, ids, lp, start)
    full = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, record="tilted_hull")
    given = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, record="tilted_hull", center_sums=sums,
                                            tail_start=start)
    a, b = _sketch_fields(full, "op"), _sketch_fields(given, "op")
    # the output and lse do not read the centre; the certificate reads it through the centred sums (invariant to
    # the centre up to rounding) and the hull's max ||v - mu||. The two double sums differ only in their order, so
    # the float32 centre differs by at most one ulp (6e-8 relative; it was bit-identical when this was written),
    # which moves these fields by a few 1e-7 relative at most
    assert torch.equal(a["output"], b["output"]) and torch.equal(a["lse"], b["lse"])
    for f in ("variance", "radius", "bound", "recorded"):
        assert torch.allclose(a[f], b[f], rtol=1e-6, atol=0), f
    wrong = sums.clone()
    wrong[..., :-1] += 5.0 * wrong[..., -1:].clamp(min=1.0)   # every centre moved by 5 per coordinate
    w = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, record="tilted_hull", center_sums=wrong,
                                        tail_start=start)
    assert torch.equal(w.estimate.output, full.estimate.output) and not torch.allclose(w.bound, full.bound)
    with pytest.raises(TypeError, match="go together"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, center_sums=sums)
    with pytest.raises(ValueError, match="center_sums must be float64"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, center_sums=sums.float(), tail_start=start)
    with pytest.raises(ValueError, match="tail_start must be int64"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, center_sums=sums, tail_start=start.int())
    with pytest.raises(ValueError, match=r"tail_start must lie in \[0, "):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, center_sums=sums, tail_start=start + 10 ** 6)


def test_paged_sketch_route_reads_only_its_slots_and_refuses_by_name(op):
    """NaN in every slot marked -inf and in every unread block changes nothing (the kept mean, the pass and the
    hull's maximum skip them); one read value changed changes the output (negative control); bad input is
    refused naming the argument, block ids outside the cache always."""
    q, k, v, pi, sketch, _, _ = _sketch_case(239, torch.float32, 3, seed=5, tilt=True)
    bs, d = 32, 64
    cache, ids, lp = _paged(k, v, pi, bs, seed=2)
    a = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, record="tilted_hull")
    poisoned = _poison(cache, ids, lp, bs, d)
    b = op.paged_sketch_hajek_attention(q, poisoned, ids, lp, sketch, record="tilted_hull")
    for f, x in _sketch_fields(a, "op").items():
        assert torch.equal(x, _sketch_fields(b, "op")[f]), f
    live = int((~torch.isneginf(lp[0, 0])).nonzero()[0, 0])
    flat = poisoned.view(cache.shape[0], cache.shape[1], -1)
    flat[int(ids[0, live // bs]), 0, bs * d + (live % bs) * d: bs * d + (live % bs + 1) * d] += 100.0
    c = op.paged_sketch_hajek_attention(q, poisoned, ids, lp, sketch, record="tilted_hull")
    assert not torch.allclose(a.estimate.output, c.estimate.output) and not torch.allclose(a.bound, c.bound)
    with pytest.raises(RuntimeError, match=r"block_ids must lie in \[0, "):
        op.paged_sketch_hajek_attention(q, cache, ids + cache.shape[0], lp, sketch)
    with pytest.raises(ValueError, match="log_pi must be"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp[:, :, :-1], sketch)
    with pytest.raises(ValueError, match=r"log_pi must lie in \[-inf, 0\]"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp.abs(), sketch)
    with pytest.raises(ValueError, match="block_ids must be an int64"):
        op.paged_sketch_hajek_attention(q, cache, ids.int(), lp, sketch)
    with pytest.raises(ValueError, match=r"q must be \(E, h_q, d\)"):
        op.paged_sketch_hajek_attention(q[:1], cache, ids, lp, sketch)
    with pytest.raises(ValueError, match="sketch.mean"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch.map(lambda x: x[:1]))
    with pytest.raises(ValueError, match="kind"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, record="nope")
    nan_q = q.clone()
    nan_q[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        op.paged_sketch_hajek_attention(nan_q, cache, ids, lp, sketch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_plugins_paged_step_calls_give_the_checked_calls_numbers(op, dtype):
    """validate=False (the vLLM plugin's per-layer calls, without the Python checks) gives the checked calls'
    numbers bit for bit, with and without the compacted prompt's sums; the op's own checks remain, and where it
    refuses the contract's error names the argument; negative control: other log pi moves the trace."""
    q, k, v, pi = _case(300, dtype, 3, seed=4)
    cache, ids, lp = _paged(k, v, pi, 32, seed=1)
    scale = q.shape[-1] ** -0.5
    a = op.paged_hajek_attention(q, cache, ids, lp, scale=scale, validate=False)
    b = op.paged_hajek_attention(q, cache, ids, lp, scale=scale)
    for f in ("output", "lse", "trace", "n_eff"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    other = lp.clone()
    other[torch.isfinite(other)] = (other[torch.isfinite(other)] - 0.3).clamp(max=0.0)
    assert not torch.equal(op.paged_hajek_attention(q, cache, ids, other, scale=scale, validate=False).trace, a.trace)
    with pytest.raises(ValueError, match="log_pi must be"):
        op.paged_hajek_attention(q, cache, ids, lp[:, :, :-1].contiguous(), scale=scale, validate=False)
    q, k, v, pi, sketch, _, _ = _sketch_case(300, dtype, 3, seed=6, tilt=True, clusters=8)
    cache, ids, lp = _paged(k, v, pi, 32, seed=2)
    start = torch.full((ids.shape[0],), 64, dtype=torch.int64)
    for sums, tail in ((None, None), (_head_sums(cache, ids, lp, start), start)):
        kw = dict(scale=scale, delta=0.05, record="tilted_hull", center_sums=sums, tail_start=tail)
        got = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, validate=False, **kw)
        want = op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, **kw)
        for f, x in _sketch_fields(got, "op").items():
            assert torch.equal(x, _sketch_fields(want, "op")[f]), f
    with pytest.raises(RuntimeError, match="block_ids must lie in"):
        op.paged_sketch_hajek_attention(q, cache, ids + cache.shape[0], lp, sketch, scale=scale, validate=False)
    with pytest.raises(TypeError, match="center_sums and tail_start go together"):
        op.paged_sketch_hajek_attention(q, cache, ids, lp, sketch, scale=scale, tail_start=start, validate=False)


def test_build_folders_differ_by_torch_install(monkeypatch):
    """Two environments with the same torch version (the main venv and the pinned ones) build in folders of their
    own: the name hashes torch's folder (cpp_extension rebuilt a shared folder at each switch); the same install
    keeps its name."""
    from kvcert.kernels import cpu

    here = cpu.build_directory()
    assert cpu.build_directory() == here
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert cpu.build_directory() != here and cpu.build_directory().parent == here.parent


# ----------------------------------------------------------------------------- the other ISA's register blocking
_OTHER_ISA = r"""
import os, sys
from pathlib import Path
import kvcert.kernels.cpu as C
src = Path(sys.argv[1])
C.SOURCE = src  # the source with its ISA switch flipped: a build of its own (the name hashes the source)
os.environ["KVCERT_CACHE_DIR"] = sys.argv[2]
import pytest
sys.exit(pytest.main(["-q", "-p", "no:randomly", "-p", "no:cacheprovider", sys.argv[3], "-k",
                      "matches_reference_and_fast or head_dimensions or several_query_rows or sketch_route_matches",
                      "--rootdir", sys.argv[4]]))
"""


@pytest.mark.slow
def test_the_other_isa_configuration_passes_the_same_checks(op, tmp_path):
    """The op's vector width and register blocks follow the ISA (16 floats and 32 registers with AVX-512,
    8 and 16 otherwise): the configuration this machine does not build is built here with its switch
    flipped (GCC's vector extensions run either width on any x86-64 CPU) and passes the same correctness
    checks, so a CI or user machine with the other ISA runs tested code."""
    import pathlib
    import subprocess
    import sys

    src = pathlib.Path(cpu.SOURCE).read_text()
    native = "#if defined(__AVX512F__)"
    assert src.count(native) == 1
    here_avx512 = "avx512f" in cpu._cpu_flags().split()
    flipped = src.replace(native, "#if 0  // flipped" if here_avx512 else "#if 1  // flipped")
    (tmp_path / "hajek_decode.cpp").write_text(flipped)
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", _OTHER_ISA, str(tmp_path / "hajek_decode.cpp"), str(tmp_path / "cache"),
                          str(pathlib.Path(__file__)), str(root)], capture_output=True, text=True, cwd=root,
                         timeout=1200)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and "failed" not in res.stdout
    assert list((tmp_path / "cache").glob("torch_extensions/*/hajek_decode.o")) or \
        list((tmp_path / "cache").glob("torch_extensions/*/*.so"))  # the flipped source was built, not the cached op
