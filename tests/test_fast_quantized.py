"""kvcert.fast.quantized (batched torch) against kvcert.reference.quantized (the float64 oracle).

What is exact is compared exactly:

- round to nearest: the codes and scales of ``quantize`` / ``quantize_channels`` are the reference's bit for
  bit, (b, h_kv) slab by slab, for int8, int4 and e4m3, at every input dtype (the reference on the same
  upcast inputs), with ties, all-zero rows, one-hot rows, underflowing scales and partial channel groups
  (n = 4, 31, 33, 65 in groups of 32 and 5);
  ``dequantize`` is exact in float32;
- stochastic rounding: the same uniforms give the same codes (uniforms placed exactly on the fractional part
  too, where ``u < p`` must decide the same way);
- Proposition 2: ||o_hat_q - o_hat|| <= B_q on every input (Hypothesis, batched, GQA, several queries, pi with
  1.0, 1e-6 and padding, every layout and rounding), and on the reference's adversarial inputs, where it is
  nearly attained (so a bound too small by 2x fails);
- the memory count.

Tolerances of fast-vs-reference sums are the float64 rounding of the quantity measured against its own
scale (``support.rounding``: 8 eps sqrt(n + 1) of a length-n reduction), never elementwise relative to an
entry near 0. B_q and V_q are sums of non-negative terms, so they are their own scale, widened by what their
evaluation cancels: an absolute error of eps S in an exponent (S the largest logit or logit-bound magnitude
of the head) is a relative error of about 2 eps S in a weight, hence the factor (1 + 4 S); and the distances
||Q(v_i) - o_hat_q|| are differences of vectors of norm ||Q(v_i)|| + ||o_hat_q||, so that magnitude, weighted
as B_q (V_q) weights the distance, is added to the scale.

What is random is tested in Monte Carlo within bands derived in place (CLT, stated where used), seeded, so
each outcome is fixed; every band has a negative control that must fail it.
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcert.fast as F
from kvcert.fast import quantized as FQ
from kvcert import reference as R
from kvcert.reference import quantized as Q
from support import assert_close, assert_within_scale, lengths, pi_vectors, rounding

F64 = torch.float64
EPS = float(np.finfo(np.float64).eps)
FORMATS = tuple(Q.FORMATS)
VARIANTS = [(layout, bound) for layout in Q.KV_LAYOUTS for bound in Q.QUANTIZED_BOUNDS]
PROPERTY = settings(max_examples=60, deadline=None)
Z = 4.0                                      # Monte Carlo bands: 4 standard errors (two-sided 6.3e-5 each)


def _t(x, dtype=F64) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x), dtype=dtype)


def _np(x) -> np.ndarray:
    return x.detach().cpu().to(F64).numpy()


def _slabs(shape):
    """Every (batch, KV head) index of a (b, h_kv, ...) shape."""
    return [(bi, hi) for bi in range(shape[0]) for hi in range(shape[1])]


def _slab(stored, bi, hi):
    """The (bi, hi) slab of a batched QuantizedRows / QuantizedChannels, as one of its own."""
    if isinstance(stored, FQ.QuantizedChannels):
        return FQ.QuantizedChannels(stored.codes[bi, hi], stored.scales[bi, hi], stored.group, stored.format,
                                    stored.rounding)
    return FQ.QuantizedRows(stored.codes[bi, hi], stored.scales[bi, hi], stored.format, stored.rounding)


def _assert_same_rows(fast, ref, name):
    """Codes, scales and stored rows of one slab bit for bit (codes and scales as float64)."""
    assert np.array_equal(_np(fast.codes), ref.codes), f"{name}: codes"
    assert np.array_equal(_np(fast.scales), ref.scales), f"{name}: scales"
    assert np.array_equal(_np(fast.dequantize(torch.float32)), ref.dequantize()), f"{name}: dequantize float32"
    assert np.array_equal(_np(fast.error_bound(F64)), ref.error_bound()), f"{name}: error_bound"


def _rows_for_rounding(rng, shape):
    """(..., n, m) rows that stress the quantizer: magnitudes from 1e-30 to 3e3, heavy tails, an outlier channel,
    one-hot rows, all-zero rows, and elements at exact ties of x / s (n >= 4)."""
    x = rng.standard_t(3, size=shape) * 10.0 ** rng.integers(-6, 4, size=shape[:-1] + (1,))
    x[..., 0] *= 8.0                                               # an outlier channel
    x[..., 0, :] *= 1e-30                                          # a scale that underflows float16 (rounds up)
    x[..., 1, :] = 0.0                                             # an all-zero row
    x[..., 2, :] = 0.0
    x[..., 2, -1] = -3.0                                           # a one-hot row
    x[..., 3, :] = (np.arange(shape[-1]) % 9 - 4 + 0.5) * 2.0 ** -4  # half-integer codes at scale 2^-4...
    x[..., 3, 0] = 127.0 * 2.0 ** -4                               # ...set by a channel at t s (int8)
    return x


# ----------------------------------------------------------------------------- constants, the quantizer


def test_names_and_constants_are_the_reference():
    """The fast module has the reference's public names (plus its stream) with the same constants, and
    kvcert.fast exports them."""
    assert set(Q.__all__) - {"rounding_generator"} <= set(FQ.__all__)
    assert dict(FQ.FORMATS) == dict(Q.FORMATS) and dict(FQ.KV_FORMAT) == dict(Q.KV_FORMAT)
    for name in ("KV_BITS", "KV_LAYOUTS", "QUANTIZED_BOUNDS", "ROUNDINGS", "CHANNEL_GROUP", "SCALES_PER_TOKEN",
                 "E4M3_RELATIVE", "E4M3_ABSOLUTE"):
        assert getattr(FQ, name) == getattr(Q, name), name
    for name in FQ.__all__:
        assert getattr(F, name) is getattr(FQ, name), name


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_nearest_codes_and_scales_are_the_reference_bit_for_bit(fmt, dtype):
    """Per token and per channel (groups of 32 and of 5, the last partial), every slab of a (b, h_kv, n, m)
    batch gives the reference's codes, scales, stored rows and per-element bounds, on the same inputs (the
    reference on x upcast from ``dtype``); the stored rows are within the bound of x."""
    rng = np.random.default_rng(0)
    for n in (4, 31, 33, 65):
        x = _t(_rows_for_rounding(rng, (2, 3, n, 12)), dtype)
        x64 = _np(x)
        rows = FQ.quantize(x, fmt)
        assert rows.codes.dtype == (torch.float8_e4m3fn if fmt == "e4m3" else torch.int8)
        assert rows.scales.dtype == torch.float16 and rows.scales.shape == x.shape[:-1]
        for group in (32, 5):
            chans = FQ.quantize_channels(x, fmt, group=group)
            assert chans.scales.shape == (2, 3, -(-n // group), 12)
            for bi, hi in _slabs(x.shape):
                _assert_same_rows(_slab(chans, bi, hi), Q.quantize_channels(x64[bi, hi], fmt, group=group),
                                  f"channels[{bi}, {hi}], n={n}, group={group}")
        for bi, hi in _slabs(x.shape):
            ref = Q.quantize(x64[bi, hi], fmt)
            _assert_same_rows(_slab(rows, bi, hi), ref, f"rows[{bi}, {hi}]")
            assert_within_scale(f"value_bound[{bi}, {hi}]", FQ.value_bound(_slab(rows, bi, hi), dtype=F64),
                                Q.value_bound(ref), rounding(F64, x.shape[-1]), "trace")
        err = np.abs(x64 - _np(rows.dequantize(F64)))
        assert np.all(err <= _np(rows.error_bound(F64)) + EPS * (np.abs(x64) + np.abs(_np(rows.dequantize(F64)))))


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stochastic_codes_given_the_same_uniforms_are_the_reference(fmt):
    """Fed the same uniforms, fast and reference draw the same codes, per token and per channel, including
    uniforms placed exactly on the fractional part p = x/s - floor(x/s) (the comparison u < p rounds down
    there) and at 0 (rounds up wherever p > 0)."""
    rng = np.random.default_rng(1)
    x = _t(_rows_for_rounding(rng, (2, 2, 37, 10)))
    x64 = _np(x)
    for quant, ref_quant in ((FQ.quantize, Q.quantize), (FQ.quantize_channels, Q.quantize_channels)):
        u = rng.random(x.shape)
        s_rows = np.broadcast_to(_np(quant(x, fmt).scale_rows(F64)), x.shape)
        y = x64 / np.where(s_rows > 0, s_rows, 1.0)
        frac = y - np.floor(y)
        u[..., ::3] = np.where(frac < 1.0, frac, 0.5)[..., ::3]     # on the boundary: u == p (p rounds to 1.0
                                                                    # for a tiny negative y: not a uniform)
        u[..., 1::7] = 0.0
        fast = quant(x, fmt, rounding="stochastic", uniforms=_t(u))
        assert fast.rounding == "stochastic"
        for bi, hi in _slabs(x.shape):
            ref = ref_quant(x64[bi, hi], fmt, rounding="stochastic", uniforms=u[bi, hi])
            sub = _slab(fast, bi, hi)
            _assert_same_rows(sub, ref, f"{quant.__name__}[{bi}, {hi}]")
            assert np.array_equal(_np(sub.variance_bound(F64)), ref.variance_bound())


def test_counter_stream_is_keyed_and_replayable():
    """rounding_uniforms is design_uniforms over the (n m) slab at the event offset by ROUNDING_EVENTS[part],
    element (p, j) at counter p m + j; it replays, differs across seed / layer / event / KV head / batch row /
    part, never equals the sampling stream of the same event, keeps a token's draws when it moves to another
    slot (index=), slices by head_offset, and quantize(seed=...) is quantize(uniforms=rounding_uniforms(...))."""
    shape = (2, 3, 5, 4)
    u = FQ.rounding_uniforms(shape, 7, layer=2, event=3)
    assert u.dtype == F64 and u.shape == shape and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, FQ.rounding_uniforms(shape, 7, layer=2, event=3))
    flat = F.design_uniforms((2, 3, 20), 7, layer=2, event=3 + FQ.ROUNDING_EVENTS["values"])
    assert torch.equal(u, flat.reshape(shape))
    others = [FQ.rounding_uniforms(shape, 8, layer=2, event=3), FQ.rounding_uniforms(shape, 7, layer=1, event=3),
              FQ.rounding_uniforms(shape, 7, layer=2, event=4),
              FQ.rounding_uniforms(shape, 7, layer=2, event=3, part="keys")]
    assert all(not torch.isin(o, u).any() for o in others)
    assert not torch.isin(F.design_uniforms((2, 3, 20), 7, layer=2, event=3), u).any()   # not the sampling draws
    assert not torch.isin(u[0], u[1]).any() and not torch.isin(u[:, 0], u[:, 1]).any()    # rows and heads differ
    positions = torch.tensor([[3, 0, 4, -1, -1]]).expand(2, 3, 5)            # slots hold tokens 3, 0, 4, padding
    moved = FQ.rounding_uniforms(shape, 7, layer=2, event=3, index=positions)
    assert torch.equal(moved[:, :, :3], u[:, :, [3, 0, 4]])
    assert torch.equal(FQ.rounding_uniforms((2, 2, 5, 4), 7, layer=2, event=3, head_offset=1), u[:, 1:])
    x = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    a = FQ.quantize(x, "int8", rounding="stochastic", seed=7, layer=2, event=3, index=positions)
    b = FQ.quantize(x, "int8", rounding="stochastic", uniforms=moved)
    assert torch.equal(a.codes, b.codes)
    c = FQ.quantize_channels(x, "int4", rounding="stochastic", seed=7)
    assert torch.equal(c.codes, FQ.quantize_channels(x, "int4", rounding="stochastic",
                                                     uniforms=FQ.rounding_uniforms(shape, 7, part="keys")).codes)
    g = FQ.quantize(x, "int8", rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert torch.equal(g.codes, FQ.quantize(x, "int8", rounding="stochastic",
                                            uniforms=torch.rand(shape, dtype=F64,
                                                                generator=torch.Generator().manual_seed(1))).codes)


def _grid_rows(rng, n, m, step=2.0 ** -5, top=127):
    """(n, m) rows with channel 0 at top * step (the scale is exactly ``step``, a float16 number, and channel 0
    is stored exactly) and the other elements at (integer + fraction) step, fractions U(0, 1) with some at
    exactly 1/2, 1/4 and 0.9."""
    c = rng.integers(-top + 2, top - 2, size=(n, m)) + rng.random((n, m))
    c[0, 1:4] = [0.5, 0.25, 0.9]
    c[:, 0] = top
    return c * step


def test_stochastic_rounding_is_unbiased_within_a_derived_band_negative_controls():
    """R = 4000 roundings of the same rows from the counter stream (R batch rows, one stream each).

    Band (CLT): per element the rounding error Q(x) - x is (1 - p) s with probability p and -p s otherwise:
    mean 0, variance s^2 p (1 - p). The mean of R independent errors is within 4 standard errors
    s sqrt(p (1 - p) / R) of 0 except with probability 6.3e-5 per element (40 elements: 2.5e-3 in all; the
    seed fixes the outcome). Pooled, the K element means are independent, so
    z = sum_k mean_k / sqrt(sum_k s^2 p_k (1 - p_k) / R) is standard normal, |z| <= 4: it detects a common
    bias of about 4 s sqrt(mean p (1 - p)) / sqrt(K R) = 0.004 s per element. The variance is s^2 p (1 - p)
    within 4 standard errors (the fourth central moment of a shifted Bernoulli,
    mu_4 = s^4 p (1 - p) (1 - 3 p (1 - p))) and at most variance_bound() = s^2/4.

    Negative controls: round to nearest fails the per-element band by far; a deliberately biased stochastic
    rounding (uniforms scaled by 0.98, so P(up) = min(p / 0.98, 1): a bias of about 0.02 p s, 0.01 s on
    average) is hard to see element by element (within twice the band) and fails the pooled band."""
    rng = np.random.default_rng(11)
    step, draws = 2.0 ** -5, 4000
    x = _grid_rows(rng, 4, 11, step)
    xs = _t(np.broadcast_to(x, (draws, 1) + x.shape).copy())              # (R, 1, n, m): one stream per row
    inner = np.ones(x.shape, bool)
    inner[:, 0] = False                                                   # channel 0 is on the grid
    p = (x / step - np.floor(x / step))[inner]
    var = step ** 2 * p * (1 - p)

    def z_scores(err):
        mean = err.mean(axis=0)[inner]
        return mean / np.sqrt(var / draws), mean.sum() / np.sqrt(var.sum() / draws)

    u = FQ.rounding_uniforms(tuple(xs.shape), 5)
    stoch = FQ.quantize(xs, "int8", rounding="stochastic", uniforms=u)
    err = _np(stoch.dequantize(F64))[:, 0] - x
    assert np.all(err[:, ~inner] == 0.0)                                  # on the grid: stored exactly
    per, pooled = z_scores(err)
    assert np.max(np.abs(per)) <= Z and abs(pooled) <= Z, (np.max(np.abs(per)), pooled)
    mu4 = step ** 4 * p * (1 - p) * (1 - 3 * p * (1 - p))
    gap = np.abs(np.mean(err ** 2, axis=0)[inner] - var)
    assert np.all(gap <= Z * np.sqrt((mu4 - var ** 2) / draws) + 8 * EPS * var)
    assert np.all(var <= _np(stoch.variance_bound(F64))[0, 0][inner])
    nearest = np.abs(_np(FQ.quantize(_t(x), "int8").dequantize(F64)) - x)[inner] / np.sqrt(var / draws)
    assert np.max(nearest) > 10 * Z                                       # negative control: biased per element
    biased = FQ.quantize(xs, "int8", rounding="stochastic", uniforms=0.98 * u)
    per_b, pooled_b = z_scores(_np(biased.dequantize(F64))[:, 0] - x)
    assert np.max(np.abs(per_b)) <= 2 * Z < abs(pooled_b), (np.max(np.abs(per_b)), pooled_b)   # negative control


# ----------------------------------------------------------------------------- B_q and V_q, batched


@st.composite
def batched_cases(draw):
    """(q, k, v, pi, format, scale, layout, bound, seed) float64: b, h_kv in {1, 2}, GQA g in {1, 2}, one or two
    queries per head, lengths from the tile edges and random sizes (the channel groups' edges among them),
    typical / one-dominant / large-query / tiny-key regimes, value offsets, pi with 1.0, 1e-6 and padding per
    (batch, KV head) (an all-padding head included: B_q = V_q = +inf there)."""
    b, h_kv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    t = draw(st.sampled_from([None, 2]))
    n = draw(lengths(70))
    d, dv = draw(st.sampled_from([1, 4, 16, 64])), draw(st.sampled_from([1, 3, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.normal(size=(b, h_kv * g) + ((t,) if t else ()) + (d,))
    k = rng.normal(size=(b, h_kv, n, d))
    v = rng.normal(size=(b, h_kv, n, dv)) + draw(st.sampled_from([0.0, 0.0, 3.0, -50.0]))
    regime = draw(st.sampled_from(["typical", "typical", "dominant", "large_q", "tiny_k"]))
    if regime == "dominant":
        k[:, :, draw(st.integers(0, n - 1))] = q[:, ::g].reshape(b, h_kv, -1, d)[:, :, 0] * draw(st.floats(2.0, 8.0))
    elif regime == "large_q":
        q *= draw(st.floats(3.0, 30.0))                                   # logit bounds of several nats
    elif regime == "tiny_k":
        k *= 1e-4
    pi = np.stack([draw(pi_vectors(n)) for _ in range(b * h_kv)]).reshape(b, h_kv, n)
    fmt = draw(st.sampled_from(FORMATS))
    layout, bound = draw(st.sampled_from(VARIANTS if fmt != "e4m3" else [("token", "strict"), ("channel", "strict")]))
    return q, k, v, pi, fmt, draw(st.sampled_from([None, 0.125])), layout, bound, draw(st.integers(0, 2**31))


def _store(k, v, fmt, layout, bound, seed):
    """The fast cache as stored, and the stochastic uniforms it used (None when rounding to nearest): keys
    from the keys' stream, values from the values' (a seed), so the reference can be fed the same."""
    uk = FQ.rounding_uniforms(tuple(k.shape), seed, part="keys") if bound == "variance" else None
    uv = FQ.rounding_uniforms(tuple(v.shape), seed, part="values") if bound == "variance" else None
    kw = (lambda u: dict(rounding="stochastic", uniforms=u)) if bound == "variance" else (lambda u: {})
    keys = k if layout == "values" else (FQ.quantize_channels if layout == "channel" else FQ.quantize)(
        k, fmt, **kw(uk))
    return keys, FQ.quantize(v, fmt, **kw(uv)), uk, uv


def _reference_store(k, v, fmt, layout, uk, uv):
    """One slab as the reference stores it, from the same uniforms."""
    kw = (lambda u: {}) if uk is None else (lambda u: dict(rounding="stochastic", uniforms=u))
    keys = k if layout == "values" else (Q.quantize_channels if layout == "channel" else Q.quantize)(k, fmt, **kw(uk))
    return keys, Q.quantize(v, fmt, **kw(uv))


def _query_slices(q, g):
    """(index into a (b, h_q[, t]) result, KV head, the (d,) query) for every query."""
    for bi in range(q.shape[0]):
        for hq in range(q.shape[1]):
            for ti in (range(q.shape[2]) if q.ndim == 4 else (None,)):
                yield ((bi, hq) if ti is None else (bi, hq, ti)), hq // g, (q[bi, hq] if ti is None else q[bi, hq, ti])


def _scales(qi, keys, values, pi, scale):
    r"""The magnitudes B_q and V_q are measured against (module docstring), for one query of one slab:
    ``(S, sum w' g (||Q(v)|| + ||o_q||), sum w'^2 sigma^2 (||Q(v)|| + ||o_q||)^2)``, S the largest exponent
    magnitude (stored logit, -log pi and logit bound)."""
    kq = keys if isinstance(keys, np.ndarray) else keys.dequantize()
    vq = values.dequantize()
    est = R.hajek_attention(qi, kq, vq, pi, scale=scale)
    on = est.weights > 0
    if not on.any():
        return 0.0, 0.0, 0.0
    tau = 1.0 / math.sqrt(len(qi)) if scale is None else scale
    eta = np.zeros(len(pi)) if isinstance(keys, np.ndarray) else Q.logit_bound(qi, keys, scale=scale)
    s_big = float(np.max(np.abs(tau * kq[on] @ qi) + np.abs(np.log(pi[on])) + eta[on]))
    mag = np.linalg.norm(vq[on], axis=1) + np.linalg.norm(est.output)
    with np.errstate(over="ignore"):
        g = np.expm1(2 * eta[on]) + 1.0
    sigma2 = (0.0 if isinstance(keys, np.ndarray) or keys.rounding != "stochastic"
              else Q.logit_variance(qi, keys, scale=scale)[on])
    w = est.weights[on]
    return s_big, float(np.sum(w * g * mag)), float(np.sum(w ** 2 * sigma2 * mag ** 2))


@PROPERTY
@given(batched_cases())
def test_bound_and_variance_match_the_reference_and_the_bound_holds(case):
    """Per query: B_q (and V_q for stochastic rounding) equals the reference's on the same stored rows within
    float64 rounding of its scale (module docstring), and ||o_hat_q - o_hat|| <= B_q + the rounding of the
    two estimates (two length-n reductions of values of norm <= vmax, and B_q's own sum), the estimates being
    kvcert.fast.hajek_attention over the stored and the exact rows of the same sample."""
    q, k, v, pi, fmt, scale, layout, bound, seed = case
    qt, kt, vt, pt = _t(q), _t(k), _t(v), _t(pi)
    g = q.shape[1] // k.shape[1]
    keys, values, uk, uv = _store(kt, vt, fmt, layout, bound, seed)
    b_q = _np(FQ.quantization_bound(qt, keys, values, pt, scale=scale))
    v_q = _np(FQ.quantization_variance(qt, keys, values, pt, scale=scale)) if bound == "variance" else None
    assert b_q.shape == q.shape[:-1]
    k_stored = kt if layout == "values" else keys.dequantize(F64)
    exact = _np(F.hajek_attention(qt, kt, vt, pt, scale=scale).output)
    stored = _np(F.hajek_attention(qt, k_stored, values.dequantize(F64), pt, scale=scale).output)
    gap = np.linalg.norm(stored - exact, axis=-1)
    vmax = max(np.abs(v).max(), np.abs(_np(values.dequantize(F64))).max()) * math.sqrt(v.shape[-1])
    n = k.shape[2]
    rel = rounding(F64, n)
    assert np.all(gap <= b_q + rel * (2 * vmax + b_q)), float(np.max(gap - b_q))
    refs = {}
    for idx, hi, qi in _query_slices(q, g):
        bi = idx[0]
        rk, rv = _reference_store(k[bi, hi], v[bi, hi], fmt, layout, None if uk is None else _np(uk[bi, hi]),
                                  None if uv is None else _np(uv[bi, hi]))
        s_big, dist_b, dist_v = _scales(qi, rk, rv, pi[bi, hi], scale)
        ref_b = Q.quantization_bound(qi, rk, rv, pi[bi, hi], scale=scale)
        refs.setdefault("B_q", []).append((idx, ref_b, rel * ((1 + 4 * s_big) * ref_b + dist_b)))
        if v_q is not None:
            ref_v = Q.quantization_variance(qi, rk, rv, pi[bi, hi], scale=scale)
            refs.setdefault("V_q", []).append((idx, ref_v, rel * ((1 + 4 * s_big) * ref_v + dist_v)))
    for name, got in (("B_q", b_q), ("V_q", v_q)):
        if got is None:
            continue
        want, tol = np.zeros_like(got), np.zeros_like(got)
        for idx, r, t in refs[name]:
            want[idx], tol[idx] = r, (t if np.isfinite(t) else 0.0)
        assert_close(name, got, want, tol)


def _aligned_rows(n, d, top, step, frac):
    """(n, d) rows whose absmax is ``top * step`` (channel 0, its own code) and whose other elements are
    (m_j + frac) step with m_j = 1, 2, ...: each rounds by the same amount in the same direction (the
    reference's adversarial construction, docs/quantized.md section 3)."""
    m = 1 + np.arange(d - 1) % (int(top) - 2)
    return np.tile(np.concatenate([[top], m + frac]) * step, (n, 1))


def test_bound_holds_and_is_nearly_attained_on_adversarial_inputs_negative_controls():
    """Batched through the fast path, two heads of the reference's adversarial inputs: (0) values whose rounding
    errors all point one way (the query tiny): ||o_hat_q - o_hat|| > 0.95 B_q, so half of B_q fails; (1) two
    groups of keys rounded in opposite directions (equal exact logits, values +-a stored exactly): the
    realized error is a tanh(eta_r), above the value-only bound sum w' eps (so a bound without its logit term
    fails) and within a factor 2.5 of B_q. B_q holds on both, and matches the reference."""
    n, d, dv, step = 10, 64, 32, 2.0 ** -6
    rng = np.random.default_rng(3)
    k0 = rng.normal(size=(n, d))
    v0 = _aligned_rows(n, dv, 127.0, step, 0.5 - 1e-6)
    g = 1.0 / (2 * (d - 1))
    group_a = _aligned_rows(n // 2, d, 127.0, step, 0.5 - g)
    group_b = _aligned_rows(n // 2, d, 127.0, step, 0.5 + g)
    group_b[:, 1] -= step                                                  # equal exact logits
    k1 = np.concatenate([group_a, group_b])
    a = 127.0 * 2.0 ** -4
    v1 = np.where(np.arange(n)[:, None] < n // 2, a, -a) * np.ones((n, dv))
    q = np.stack([rng.normal(size=d) * 1e-6, np.ones(d)])[None]            # (1, 2, d): one query per head
    k, v = np.stack([k0, k1])[None], np.stack([v0, v1])[None]
    pi = np.stack([rng.uniform(0.1, 1.0, n), np.ones(n)])[None]
    keys, values = FQ.quantize(_t(k), "int8", part="keys"), FQ.quantize(_t(v), "int8")
    b_q = _np(FQ.quantization_bound(_t(q), keys, values, _t(pi)))[0]
    exact = _np(F.hajek_attention(_t(q), _t(k), _t(v), _t(pi)).output)[0]
    stored = _np(F.hajek_attention(_t(q), keys.dequantize(F64), values.dequantize(F64), _t(pi)).output)[0]
    gap = np.linalg.norm(stored - exact, axis=-1)
    tol = rounding(F64, n) * (2 * a * math.sqrt(dv) + b_q)
    assert np.all(gap <= b_q + tol), (gap, b_q)
    assert gap[0] > 0.95 * b_q[0] > 0.5 * b_q[0] + tol[0], (gap, b_q)     # value rounding aligned
    w1 = _np(F.hajek_attention(_t(q), keys.dequantize(F64), values.dequantize(F64), _t(pi),
                               return_weights=True).weights)[0, 1]
    value_only = float(w1 @ _np(FQ.value_bound(values, dtype=F64))[0, 1])
    assert gap[1] > value_only + tol[1] and gap[1] > b_q[1] / 2.5, (gap, b_q, value_only)   # key rounding aligned
    for h in range(2):
        ref = Q.quantization_bound(q[0, h], Q.quantize(k[0, h], "int8"), Q.quantize(v[0, h], "int8"), pi[0, h])
        assert_within_scale(f"B_q[{h}]", b_q[h], ref, 4 * rounding(F64, n), "trace")


def test_value_term_of_v_q_is_exact_in_monte_carlo_negative_control():
    """Exact keys, values stochastically rounded from the counter stream (R = 2000 batch rows of the same head,
    one stream each): o_hat_q - o_hat = sum w_i (Q(v_i) - v_i) with fixed weights, so
    E||o_hat_q - o_hat||^2 = sum w_i^2 sum_j s^2 p_ij (1 - p_ij) exactly; the Monte Carlo mean is within 4
    standard errors of it (CLT on R i.i.d. squared norms, their sample standard deviation), and V_q
    (s^2/4 per element) is at least it. Negative control: half the exact value is far outside the band."""
    rng = np.random.default_rng(21)
    n, d, dv, draws, step = 48, 8, 6, 2000, 2.0 ** -5
    q1, k1 = rng.normal(size=d), rng.normal(size=(n, d))
    v1 = _grid_rows(rng, n, dv, step)
    pi1 = rng.uniform(0.2, 1.0, n)
    rep = lambda x: _t(np.broadcast_to(x, (draws, 1) + x.shape).copy())    # noqa: E731
    q, k, v, pi = rep(q1), rep(k1), rep(v1), rep(pi1)
    values = FQ.quantize(v, "int8", rounding="stochastic", seed=3)
    est = F.hajek_attention(q[:1], k[:1], v[:1], pi[:1], return_weights=True)
    w = _np(est.weights)[0, 0]
    p = v1 / step - np.floor(v1 / step)
    exact = float(np.sum(w ** 2 * np.sum(step ** 2 * p * (1 - p), axis=1)))
    sq = np.sum((_np(F.hajek_attention(q, k, values.dequantize(F64), pi).output) - _np(est.output)) ** 2,
                axis=-1)[:, 0]
    band = Z * sq.std() / math.sqrt(draws)
    assert abs(sq.mean() - exact) <= band, (sq.mean(), exact, band)
    assert abs(sq.mean() - exact / 2) > band                               # negative control
    v_q = _np(FQ.quantization_variance(q[:1], k[:1], FQ.QuantizedRows(values.codes[:1], values.scales[:1], "int8",
                                                                       "stochastic"), pi[:1]))
    assert v_q.item() >= exact
    assert_within_scale("V_q", v_q.item(), float(np.sum(w ** 2 * dv * step ** 2 / 4)), 4 * rounding(F64, n), "trace")


def test_a_compressed_cache_is_stored_as_its_kept_rows():
    """kvcert.fast.evict's padded cache (kept rows first, zero padding) quantized per channel gives, on each
    head, the reference's codes and scales of the kept rows alone (padding moves no group's absmax); with the
    rows' positions as the stream's index a token draws the same rounding wherever it sits; and B_q, V_q over
    the padded cache (pi = 0 on padding, or log_pi) are the reference's over the kept rows."""
    rng = np.random.default_rng(17)
    b, h_kv, g, n, d, dv = 2, 2, 2, 150, 16, 8
    k, v = _t(rng.normal(size=(b, h_kv, n, d))), _t(rng.normal(size=(b, h_kv, n, dv)) + 1.0)
    q = _t(rng.normal(size=(b, h_kv * g, d)))
    cc = F.evict(k, v, _t(rng.random((b, h_kv, n)) ** 4), F.sampled_budget(40.0, d, dv, 8), seed=3)
    keys = FQ.quantize_channels(cc.keys, "int8", rounding="stochastic", seed=3, index=cc.positions)
    values = FQ.quantize(cc.values, "int8", rounding="stochastic", seed=3, index=cc.positions)
    u_k = FQ.rounding_uniforms(tuple(cc.keys.shape), 3, part="keys", index=cc.positions)
    u_v = FQ.rounding_uniforms(tuple(cc.values.shape), 3, part="values", index=cc.positions)
    full_k = FQ.rounding_uniforms(tuple(k.shape), 3, part="keys")
    b_q = FQ.quantization_bound(q, keys, values, cc.pi)
    v_q = FQ.quantization_variance(q, keys, values, log_pi=cc.log_pi)
    for bi, hi in _slabs(cc.keys.shape):
        c = int(cc.kept[bi, hi])
        assert torch.equal(u_k[bi, hi, :c], full_k[bi, hi, cc.positions[bi, hi, :c]])   # as in the whole cache
        rk = Q.quantize_channels(_np(cc.keys[bi, hi, :c]), "int8", rounding="stochastic", uniforms=_np(u_k[bi, hi, :c]))
        rv = Q.quantize(_np(cc.values[bi, hi, :c]), "int8", rounding="stochastic", uniforms=_np(u_v[bi, hi, :c]))
        groups = -(-c // 32)
        assert np.array_equal(_np(keys.codes[bi, hi, :c]), rk.codes)
        assert np.array_equal(_np(keys.scales[bi, hi, :groups]), rk.scales) and not keys.scales[bi, hi, groups:].any()
        assert np.array_equal(_np(values.codes[bi, hi, :c]), rv.codes)
        p = _np(cc.pi[bi, hi, :c])
        for hq in range(hi * g, (hi + 1) * g):
            qi = _np(q[bi, hq])
            s_big, dist_b, dist_v = _scales(qi, rk, rv, p, None)
            ref_b, ref_v = Q.quantization_bound(qi, rk, rv, p), Q.quantization_variance(qi, rk, rv, p)
            rel = rounding(F64, c)
            assert_close(f"B_q[{bi}, {hq}]", b_q[bi, hq], ref_b, rel * ((1 + 4 * s_big) * ref_b + dist_b))
            assert_close(f"V_q[{bi}, {hq}]", v_q[bi, hq], ref_v, rel * ((1 + 4 * s_big) * ref_v + dist_v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_queries_are_within_float32_rounding_of_the_reference(dtype):
    """A float32 / bf16 query computes the terms in float32: B_q and V_q are within float32 rounding of their
    scale (module docstring) of the reference on the same (upcast) inputs and the same stored rows."""
    rng = np.random.default_rng(5)
    b, h_kv, g, n, d, dv = 2, 2, 2, 67, 16, 8
    q = _t(rng.normal(size=(b, h_kv * g, d)), dtype)
    k = _t(rng.normal(size=(b, h_kv, n, d)), dtype)
    v = _t(rng.normal(size=(b, h_kv, n, dv)) + 2.0, dtype)
    pi = _t(rng.uniform(0.05, 1.0, (b, h_kv, n)), torch.float32)
    keys = FQ.quantize_channels(k, "int8", rounding="stochastic", seed=1)
    values = FQ.quantize(v, "int8", rounding="stochastic", seed=1)
    b_q, v_q = FQ.quantization_bound(q, keys, values, pi), FQ.quantization_variance(q, keys, values, pi)
    assert b_q.dtype == v_q.dtype == torch.float32
    rel = rounding(torch.float32, n)
    for idx, hi, qi in _query_slices(_np(q), g):
        bi = idx[0]
        rk = Q.QuantizedChannels(_np(keys.codes[bi, hi]), _np(keys.scales[bi, hi]), 32, "int8", "stochastic")
        rv = Q.QuantizedRows(_np(values.codes[bi, hi]), _np(values.scales[bi, hi]), "int8", "stochastic")
        p = _np(pi[bi, hi])
        s_big, dist_b, dist_v = _scales(qi, rk, rv, p, None)
        ref_b, ref_v = Q.quantization_bound(qi, rk, rv, p), Q.quantization_variance(qi, rk, rv, p)
        assert_close(f"B_q{idx}", b_q[idx], ref_b, rel * ((1 + 4 * s_big) * ref_b + dist_b))
        assert_close(f"V_q{idx}", v_q[idx], ref_v, rel * ((1 + 4 * s_big) * ref_v + dist_v))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_is_the_cpu_path():
    """On a GPU: the same uniforms, codes and scales as on the CPU bit for bit (the stream is device-agnostic,
    the quotient is float64 on both), and B_q, V_q within float64 rounding of their own size."""
    rng = np.random.default_rng(9)
    q, k = _t(rng.normal(size=(2, 4, 3, 16))), _t(rng.normal(size=(2, 2, 77, 16)))
    v, pi = _t(rng.normal(size=(2, 2, 77, 8)) + 1.0), _t(rng.uniform(0.05, 1.0, (2, 2, 77)))
    out = {}
    for device in ("cpu", "cuda"):
        kq = FQ.quantize_channels(k.to(device), "int8", rounding="stochastic", seed=4, layer=1, event=2)
        vq = FQ.quantize(v.to(device), "int4", rounding="stochastic", seed=4, layer=1, event=2)
        out[device] = (kq, vq, FQ.quantization_bound(q.to(device), kq, vq, pi.to(device)),
                       FQ.quantization_variance(q.to(device), kq, vq, pi.to(device)))
    (kc, vc, bc, vqc), (kg, vg, bg, vqg) = out["cpu"], out["cuda"]
    for a, b in ((kc.codes, kg.codes), (kc.scales, kg.scales), (vc.codes, vg.codes), (vc.scales, vg.scales)):
        assert torch.equal(a, b.cpu())
    assert_within_scale("B_q", bg, bc, rounding(F64, 77), "trace")
    assert_within_scale("V_q", vqg, vqc, rounding(F64, 77), "trace")


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("layout", Q.KV_LAYOUTS)
@pytest.mark.parametrize("kv_bits", Q.KV_BITS)
def test_memory_count_is_the_reference(kv_bits, layout):
    """token_elements, sampled_budget (a float or one per head) and quantized_memory_fraction (an int or the
    kept counts of a compressed cache, the whole cache included) are the reference's numbers."""
    for d, dv in ((64, 64), (128, 96), (16, 8)):
        assert FQ.token_elements(d, dv, kv_bits, layout=layout) == Q.token_elements(d, dv, kv_bits, layout=layout)
        for extra in (0.0, 1000.0):
            want = Q.sampled_budget(100.0, d, dv, kv_bits, extra=extra, layout=layout)
            assert FQ.sampled_budget(100.0, d, dv, kv_bits, extra=extra, layout=layout) == want
            per_head = FQ.sampled_budget(torch.tensor([[100.0, 50.0]]), d, dv, kv_bits, extra=extra, layout=layout)
            assert per_head[0, 0].item() == want
        kept = torch.tensor([[0, 1, 31, 32], [33, 99, 100, 64]])
        frac = FQ.quantized_memory_fraction(100, d, dv, kept=kept, kv_bits=kv_bits, extra=500.0, layout=layout)
        assert frac.dtype == F64
        for (i, j), c in np.ndenumerate(kept.numpy()):
            want = Q.quantized_memory_fraction(100, d, dv, kept=int(c), kv_bits=kv_bits, extra=500.0, layout=layout)
            assert frac[i, j].item() == want
            assert FQ.quantized_memory_fraction(100, d, dv, kept=int(c), kv_bits=kv_bits, extra=500.0,
                                                layout=layout) == want


# ----------------------------------------------------------------------------- bad input


def test_docstring_examples():
    result = doctest.testmod(FQ, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def _bad(x, match, exc=ValueError):
    with pytest.raises(exc, match=match):
        x()


def test_bad_quantizer_input_is_refused():
    """Each refusal names the argument and the expected shape or range."""
    x = torch.ones(2, 3, dtype=F64)
    u = torch.zeros(2, 3, dtype=F64)
    _bad(lambda: FQ.quantize(x, "int3"), r"format must be one of \('int8', 'int4', 'e4m3'\)")
    _bad(lambda: FQ.quantize(x, "int8", rounding="up"), r"rounding must be one of \('nearest', 'stochastic'\)")
    _bad(lambda: FQ.quantize(x, "e4m3", rounding="stochastic", uniforms=u), "needs an integer format")
    _bad(lambda: FQ.quantize(x, "int8", rounding="stochastic"), "exactly one source of randomness")
    _bad(lambda: FQ.quantize(x, "int8", rounding="stochastic", seed=0, uniforms=u), "exactly one source")
    _bad(lambda: FQ.quantize(x, "int8", seed=0), "rounding='nearest' takes none of them")
    _bad(lambda: FQ.quantize(x, "int8", rounding="stochastic", uniforms=u.T), r"uniforms must have the shape of x, "
         r"\(2, 3\), got shape \(3, 2\)")
    _bad(lambda: FQ.quantize(x, "int8", rounding="stochastic", uniforms=u + 1), r"uniforms must lie in \[0, 1\)")
    _bad(lambda: FQ.quantize(x, "int8", rounding="stochastic", generator=0), "generator must be a torch.Generator",
         TypeError)
    _bad(lambda: FQ.quantize(torch.tensor([[1.0, float("nan")]]), "int8"), "x must be finite")
    _bad(lambda: FQ.quantize(torch.tensor([[1e12, 0.0]], dtype=F64), "int8"), r"x must have \|x\| <= ")
    _bad(lambda: FQ.quantize(torch.ones(3), "int8"), r"x must have shape \(\.\.\., n, m\), got shape \(3,\)")
    _bad(lambda: FQ.quantize([[1.0]], "int8"), "x must be a torch.Tensor", TypeError)
    _bad(lambda: FQ.quantize_channels(x, "int8", group=0), "group must be an int >= 1")
    _bad(lambda: FQ.rounding_uniforms((2, 3), 0, part="queries"), r"part must be one of \('keys', 'values'\)")
    _bad(lambda: FQ.rounding_uniforms((2, 3), 0, event=1 << 32), r"event must be < 2\*\*32")
    _bad(lambda: FQ.rounding_uniforms((2, 3), 0, index=torch.zeros(3, dtype=torch.int64)),
         r"index must be an int64 tensor of shape \(2,\)")
    _bad(lambda: FQ.rounding_uniforms((3,), 0), r"shape must be \(\.\.\., n, m\)")


@pytest.mark.parametrize("codes, scales, match", [
    (torch.ones(2, 3), torch.tensor([float("nan"), 0.5]), "scales must be finite and >= 0"),
    (torch.ones(2, 3), torch.tensor([-0.5, 0.5]), "scales must be finite and >= 0"),
    (torch.ones(2, 3), torch.tensor([0.0, 0.5]), "zero scale stores an all-zero row"),
    (torch.ones(2, 3), torch.tensor([0.1, 0.5], dtype=F64), "float16 numbers"),
    (torch.ones(2, 3), torch.tensor([0.5]), r"scales must have shape \(\.\.\., n\) = \(2,\)"),
    (torch.full((2, 3), 128.0), torch.tensor([0.5, 0.5]), r"codes must lie in \[-127, 127\]"),
    (torch.full((2, 3), -128, dtype=torch.int8), torch.tensor([0.5, 0.5]), r"codes must lie in \[-127, 127\]"),
    (torch.full((2, 3), 0.5), torch.tensor([0.5, 0.5]), "codes must be integers"),
    (torch.full((2, 3), float("nan")), torch.tensor([0.5, 0.5]), "codes must lie in"),
    (torch.ones(3), torch.tensor([0.5]), r"codes must have shape \(\.\.\., n, m\)"),
])
def test_bad_stored_rows_are_refused(codes, scales, match):
    with pytest.raises(ValueError, match=match):
        FQ.QuantizedRows(codes=codes, scales=scales, format="int8")


def test_bad_bound_input_is_refused():
    """Queries, keys, values and roundings that the bounds cannot read are refused, naming the argument."""
    x = torch.ones(1, 1, 4, 3, dtype=F64)
    near, stoch = FQ.quantize(x, "int8"), FQ.quantize(x, "int8", rounding="stochastic", seed=0)
    pi = torch.ones(1, 1, 4, dtype=F64)
    q = torch.ones(1, 2, 3, dtype=F64)
    _bad(lambda: FQ.logit_bound(torch.ones(1, 2, 5, dtype=F64), near), r"q must have shape \(b, h_q, d\) or "
         r"\(b, h_q, t, d\) with b = 1, d = 3")
    _bad(lambda: FQ.logit_bound(torch.ones(1, 3, 3, dtype=F64), FQ.quantize(torch.ones(1, 2, 4, 3), "int8")),
         "h_q a multiple of h_kv = 2")
    _bad(lambda: FQ.logit_bound(torch.full((1, 2, 3), float("nan")), near), "q must be finite")
    _bad(lambda: FQ.logit_bound(q, FQ.quantize(torch.ones(4, 3), "int8")), r"keys must have shape \(b, h_kv, n, d\)")
    _bad(lambda: FQ.logit_bound(q, x), "keys must be QuantizedRows or QuantizedChannels", TypeError)
    _bad(lambda: FQ.quantization_bound(q, [[1.0]], near, pi), "keys must be QuantizedRows, QuantizedChannels or a "
         "tensor", TypeError)
    _bad(lambda: FQ.quantization_bound(q, near, x, pi), "values must be QuantizedRows or QuantizedChannels", TypeError)
    _bad(lambda: FQ.quantization_bound(q, near, FQ.quantize(torch.ones(1, 1, 5, 2), "int8"), pi),
         r"values must have shape \(b, h_kv, n, dv\) = \(1, 1, 4\) \+ \(dv,\)")
    _bad(lambda: FQ.quantization_variance(q, stoch, near, pi), "values must be stochastically rounded")
    _bad(lambda: FQ.quantization_variance(q, near, stoch, pi), "keys must be stochastically rounded")
    _bad(lambda: near.variance_bound(), "rows must be stochastically rounded")
    _bad(lambda: FQ.token_elements(64, 64, 3), r"kv_bits must be one of \(16, 8, 4\)")
    _bad(lambda: FQ.token_elements(64, 64, 8, layout="kivi"), r"layout must be one of \('token', 'channel', 'values'\)")
    _bad(lambda: FQ.token_elements(0, 64, 8), "d must be an int >= 1")
    _bad(lambda: FQ.quantized_memory_fraction(10, 4, 4, kept=torch.tensor([11]), kv_bits=8),
         r"kept must be integers in \[0, n\] = \[0, 10\]")
    _bad(lambda: FQ.sampled_budget(10.0, 4, 4, 8, extra=-1.0), "extra must be >= 0")
    _bad(lambda: FQ.QuantizedChannels(torch.ones(2, 3), torch.ones(3), 2, "int8"),
         r"scales must have shape \(\.\.\., ceil\(n / group\), m\) = \(1, 3\)")
    _bad(lambda: FQ.QuantizedChannels(torch.ones(2, 3), torch.tensor([[1.0, 0.0, 1.0]]), 2, "int8"),
         "zero scale stores a group's channel of zeros")
