"""kvcert.reference.quantized and evict_and_certify(kv_bits=...): quantized KV caches with a certificate that
covers rounding and sampling (docs/quantized.md).

What is exact is tested exactly:

- the quantizer rounds within its stored bound (per element s/2 for integers, s max(2^-4 |c|, 2^-10) for
  float8 e4m3), and its e4m3 rounding is torch's ``float8_e4m3fn`` cast;
- Proposition 2: ||o_hat_q - o_hat|| <= B_q on every input (Hypothesis over lengths, score regimes,
  inclusion probabilities with 1.0, 1e-6 and padding, the three formats), on adversarially aligned
  rounding, and through ``evict_and_certify`` for every design and bit width, with the same sample's exact
  Hajek estimate rebuilt from the public functions;
- kv_bits=16 is bit-for-bit the call without the argument, for every design;
- the memory count, and the sampled budget at equal expected memory.

Tolerances are the float64 evaluation's own rounding, derived where used (``support.rounding``: a length-n
reduction's relative allowance). Negative controls: half of B_q is exceeded by inputs whose value rounding is
aligned, and the bound without its logit term is exceeded by inputs whose key rounding is aligned, so the
property tests can fail.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcert import reference as R
from kvcert.reference import quantized as Q
from kvcert.reference.quantized import QuantizedRows, quantization_bound, quantize
from support import lengths, pi_vectors, rounding

EPS = float(np.finfo(np.float64).eps)
FORMATS = tuple(Q.FORMATS)
DESIGNS = [None, "paper", "cluster", "tilted", R.ClusterDesign(clusters=4, radius="chebyshev")]
PROPERTY = settings(max_examples=60, deadline=None)


def _head(seed, n=300, d=16, dv=8, spread=1.0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=d) * spread
    k = rng.normal(size=(n, d))
    k[:, 0] *= 6.0                                                 # an outlier channel, as real keys have
    v = rng.normal(size=(n, dv)) + 0.5
    imp = rng.random(n) ** 4
    return q, k, v, imp


def _hajek_gap(q, k, v, pi, fmt, scale=None):
    """(||o_hat_q - o_hat||, B_q, allowance): the rounding's effect on one sample's Hajek estimate, its bound,
    and the float64 rounding of the two estimates and of B_q (two length-n reductions of values of norm at most
    vmax, and B_q's own sum)."""
    kq, vq = quantize(k, fmt), quantize(v, fmt)
    exact = R.hajek_attention(q, k, v, pi, scale=scale).output
    stored = R.hajek_attention(q, kq.dequantize(), vq.dequantize(), pi, scale=scale).output
    b = quantization_bound(q, kq, vq, pi, scale=scale)
    vmax = max(np.abs(v).max(), np.abs(vq.dequantize()).max()) * np.sqrt(v.shape[1])
    tol = rounding(torch.float64, len(pi)) * (2.0 * vmax + b)
    return float(np.linalg.norm(stored - exact)), b, tol


# ----------------------------------------------------------------------------- the quantizer


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_rounds_within_its_stored_bound(fmt):
    """|x - Q(x)| <= error_bound() elementwise, up to float64's rounding of x / s and s c
    (<= eps/2 (|x| + s |c|)); rows of every magnitude, heavy tails, one-hot rows and all-zero rows (stored
    exactly, scale 0). The scales are float16 numbers at or above absmax / t (rounded up: no code clipped)."""
    rng = np.random.default_rng(0)
    normal = rng.normal(size=(50, 24))
    onehot = np.zeros((3, 24))
    onehot[:, 5] = [-2.0, 1e-5, 7.0]
    x = np.concatenate([normal * m for m in (1e-30, 1e-6, 1.0, 3e3)]
                       + [rng.standard_t(2, size=(50, 24)), onehot, np.zeros((2, 24))])
    qx = quantize(x, fmt)
    err = np.abs(x - qx.dequantize())
    allowance = EPS * (np.abs(x) + qx.scales[:, None] * np.abs(qx.codes))
    assert np.all(err <= qx.error_bound() + allowance), float(np.max(err - qx.error_bound()))
    assert np.all(qx.scales >= np.abs(x).max(axis=1) / Q.FORMATS[fmt])
    assert np.array_equal(qx.scales.astype(np.float16).astype(np.float64), qx.scales)
    assert np.all(qx.codes[-2:] == 0) and np.all(qx.scales[-2:] == 0) and np.all(qx.dequantize()[-2:] == 0)
    # not loose by construction: random rows use most of the per-element bound somewhere
    assert (err / np.where(qx.error_bound() > 0, qx.error_bound(), 1.0))[100:150].max() > 0.9


def test_e4m3_rounding_is_torch_float8_e4m3fn():
    """The reference's e4m3 rounding (3 mantissa bits, subnormals below 2^-6, ties to even) is torch's cast, on
    float32 values (one rounding step in both) across every binade, the subnormals and exact ties."""
    rng = np.random.default_rng(1)
    y = np.concatenate([
        rng.uniform(-448.0, 448.0, 4000), np.exp2(rng.uniform(-12.0, 8.7, 4000)) * rng.choice([-1, 1], 4000),
        np.arange(-64, 65) * 2.0 ** -10,                            # subnormal ties and midpoints
        (np.arange(16, 32) + 0.5) * 2.0 ** -3,                      # ties in the binade [2, 4)
    ]).astype(np.float32).astype(np.float64)
    y = np.clip(y, -448.0, 448.0)
    want = torch.from_numpy(y).to(torch.float8_e4m3fn).to(torch.float64).numpy()
    assert np.array_equal(Q._round_e4m3(y), want)


# ----------------------------------------------------------------------------- Proposition 2


@st.composite
def rounding_cases(draw):
    """(q, keys, values, pi, format, scale): lengths from the tile edges and random sizes, typical /
    one-dominant / large-query / tiny-key regimes, pi with exact 1.0, 1e-6 and padding (never all padding)."""
    n = draw(lengths(129))
    d, dv = draw(st.sampled_from([1, 4, 16, 64])), draw(st.sampled_from([1, 3, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k = rng.normal(size=d), rng.normal(size=(n, d))
    v = rng.normal(size=(n, dv)) + draw(st.sampled_from([0.0, 0.0, 3.0, -50.0]))
    regime = draw(st.sampled_from(["typical", "typical", "dominant", "large_q", "tiny_k"]))
    if regime == "dominant":
        k[draw(st.integers(0, n - 1))] = q * draw(st.floats(2.0, 8.0))
    elif regime == "large_q":
        q *= draw(st.floats(3.0, 30.0))                           # logit bounds of several nats
    elif regime == "tiny_k":
        k *= 1e-4
    pi = draw(pi_vectors(n))
    if not np.any(pi > 0):
        pi[draw(st.integers(0, n - 1))] = 1.0
    return q, k, v, pi, draw(st.sampled_from(FORMATS)), draw(st.sampled_from([None, 0.125]))


@PROPERTY
@given(rounding_cases())
def test_the_bound_holds_on_every_input(case):
    """||o_hat_q - o_hat|| <= B_q, and B_q <= its eta_max form (the docstring's corollary)."""
    q, k, v, pi, fmt, scale = case
    gap, b, tol = _hajek_gap(q, k, v, pi, fmt, scale)
    assert gap <= b + tol, (gap, b)
    kq, vq = quantize(k, fmt), quantize(v, fmt)
    est = R.hajek_attention(q, kq.dequantize(), vq.dequantize(), pi, scale=scale)
    on = est.weights > 0
    eta = Q.logit_bound(q, kq, scale=scale)[on].max()
    spread = est.weights[on] @ np.linalg.norm(vq.dequantize()[on] - est.output, axis=1)
    with np.errstate(over="ignore", invalid="ignore"):
        coarse = np.expm1(2 * eta) * spread + np.exp(2 * eta) * Q.value_bound(vq)[on].max()
    assert b <= coarse * (1 + 1e-12) or not np.isfinite(coarse)


def _aligned_rows(n, d, top, step, frac):
    """(n, d) rows whose absmax is ``top * step`` (channel 0, its own code) and whose other elements are
    (m_j + frac) step with m_j = 1, 2, ... (< top - 1): each rounds by the same amount in the same direction
    (frac < 1/2: down, x above its stored value by frac step; frac > 1/2: up, below it by (1 - frac) step)."""
    m = 1 + np.arange(d - 1) % (int(top) - 2)
    return np.tile(np.concatenate([[top], m + frac]) * step, (n, 1))


def test_aligned_value_rounding_nearly_attains_the_bound_negative_control():
    """Negative control: values whose rounding errors all point one way (one value for every token, so the
    logit part of B_q multiplies ||Q(v_i) - o_hat_q|| = 0) give ||o_hat_q - o_hat|| = ||v - Q(v)|| =
    sqrt(dv - 1) (1/2 - 1e-6) s, against B_q = h sqrt(dv) s / 2 with h -> 1 as the query shrinks: half of B_q
    is exceeded, so a test of a bound too small by 2x fails."""
    n, d, dv, step = 40, 8, 32, 2.0 ** -6
    rng = np.random.default_rng(3)
    k = rng.normal(size=(n, d))
    v = _aligned_rows(n, dv, 127.0, step, 0.5 - 1e-6)
    q = rng.normal(size=d) * 1e-6
    pi = rng.uniform(0.1, 1.0, n)
    gap, b, tol = _hajek_gap(q, k, v, pi, "int8")
    assert gap <= b + tol
    assert gap > 0.95 * b > 0.5 * b + tol, (gap, b)


def test_aligned_key_rounding_needs_the_logit_term_negative_control():
    """Negative control of the logit part: two groups of tokens with equal exact logits and values +-a (stored
    exactly), keys rounded so that group A's logits drop by eta_r and group B's rise by eta_r (A's elements
    m + 1/2 - g round down, B's m' + 1/2 + g round up, g = 1 / (2 (d - 1)) and sum m' = sum m - 1 so the exact
    logits agree). Then o_hat = 0 and o_hat_q = -a tanh(eta_r) e_1; the value-only bound sum_S w'_i eps_i is
    exceeded, and B_q is within a factor 2.5 of the realized error (the symmetric case's ratio is about
    (1 + e^{-2 eta}) / 4 -> 1/2 as eta -> 0, less the value part)."""
    n, d, dv, top, step = 10, 64, 1, 127.0, 2.0 ** -6
    g = 1.0 / (2 * (d - 1))
    group_a = _aligned_rows(n // 2, d, top, step, 0.5 - g)
    group_b = _aligned_rows(n // 2, d, top, step, 0.5 + g)
    group_b[:, 1] -= step                                         # sum m' = sum m - 1: equal exact logits
    k = np.concatenate([group_a, group_b])
    q = np.ones(d)
    a = top * 2.0 ** -4
    v = np.where(np.arange(n)[:, None] < n // 2, a, -a) * np.ones((n, dv))
    pi = np.ones(n)
    kq, vq = quantize(k, "int8"), quantize(v, "int8")
    assert np.array_equal(vq.dequantize(), v)                     # the values are stored exactly
    tau = 1.0 / np.sqrt(d)
    s_exact, s_stored = tau * k @ q, tau * kq.dequantize() @ q
    assert np.ptp(s_exact) < 1e-12                                # equal exact logits: o_hat = 0
    eta_r = float(s_exact[0] - s_stored[0])
    assert eta_r > 0 and s_stored[-1] - s_exact[-1] == pytest.approx(eta_r, rel=1e-12)
    stored = R.hajek_attention(q, kq.dequantize(), vq.dequantize(), pi).output
    assert stored[0] == pytest.approx(-a * np.tanh(eta_r), rel=1e-9)
    gap, b, tol = _hajek_gap(q, k, v, pi, "int8")
    value_only = float(np.mean(Q.value_bound(vq)))
    assert gap > value_only + tol                                 # without the logit term: violated
    assert gap <= b + tol and gap > b / 2.5, (gap, b)


@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("design", DESIGNS, ids=str)
def test_evict_and_certify_bound_covers_the_rounding_of_its_sample(design, kv_bits):
    """Through the public call: the same sample's exact Hajek estimate (pi rebuilt at ``result.budget``, the
    sample from the same seed) is within ``quantization_bound`` of ``output``; the output is the Hajek estimate
    over the quantized kept rows; the paper design's radius is B_q plus its Chebyshev radius."""
    tilt = np.random.default_rng(6).normal(size=(4, 16))
    for spread, seed in ((0.3, 0), (0.3, 1), (1.0, 2), (1.0, 3)):    # the hull cap binds in some, not in others
        q, k, v, imp = _head(5, spread=spread)
        r = R.evict_and_certify(q, k, v, imp, 60.0, seed=seed, design=design, tilt=tilt, kv_bits=kv_bits)
        pi = R.inclusion_probabilities(imp, r.budget)
        keep = R.poisson_sample(pi, seed=seed)
        assert r.kept == keep.sum() and r.quantization_bound > 0
        fmt = Q.KV_FORMAT[kv_bits]
        kq, vq = quantize(k[keep], fmt), quantize(v[keep], fmt)
        est = R.hajek_attention(q, kq.dequantize(), vq.dequantize(), pi[keep])
        assert np.array_equal(r.output, est.output)
        assert r.quantization_bound == quantization_bound(q, kq, vq, pi[keep])
        gap, _, tol = _hajek_gap(q, k[keep], v[keep], pi[keep], fmt)
        assert gap <= r.quantization_bound + tol
        full = R.attention(q, k, v)
        if design == "paper":
            assert r.radius == r.quantization_bound + R.certificate(est, kind="chebyshev").radius
        else:                                 # min(B_q + rule, H_q): below B_q + rule only where H_q caps it
            spec = R.sketch._design(design)
            rule = R.sketch.radius_from_variance(r.variance, delta=0.05, rule=spec.radius,
                                                 multiplier=spec.multiplier)
            assert r.radius <= r.quantization_bound + rule
            if r.radius < r.quantization_bound + rule:            # the cap H_q bounds the true error itself
                assert np.linalg.norm(r.output - full) <= r.radius


# ----------------------------------------------------------------------------- kv_bits=16 and the memory


@pytest.mark.parametrize("sampling", ["poisson", "systematic"])
@pytest.mark.parametrize("design", DESIGNS, ids=str)
def test_kv_bits_16_is_the_call_without_it(design, sampling):
    """kv_bits=16 returns bit-for-bit the fields of the call without the argument (and B_q = 0)."""
    q, k, v, imp = _head(7)
    tilt = np.random.default_rng(8).normal(size=(4, 16))
    for budget, seed in ((60.0, 0), (120.0, 1), (1e9, 2)):
        kw = dict(seed=seed, design=design, tilt=tilt, sampling=sampling)
        a = R.evict_and_certify(q, k, v, imp, budget, **kw)
        b = R.evict_and_certify(q, k, v, imp, budget, kv_bits=16, **kw)
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), f.name
        assert b.quantization_bound == 0.0


def test_token_elements_and_sampled_budget():
    """Per kept token: d + dv + 1 at 16 bits, (d + dv) b / 16 + 2 scales + 1 below; the sampled budget keeps
    the expected memory of the unquantized paper design, sketch included."""
    assert Q.token_elements(64, 64, 16) == 129.0
    assert Q.token_elements(64, 64, 8) == 67.0 and Q.token_elements(64, 64, 4) == 35.0
    assert Q.sampled_budget(100.0, 64, 64, 16) == 100.0
    for bits in (8, 4):
        for extra in (0.0, 1000.0):
            b = Q.sampled_budget(100.0, 64, 64, bits, extra=extra)
            assert b * Q.token_elements(64, 64, bits) + extra == pytest.approx(100.0 * 129.0, rel=1e-15)
    assert Q.quantized_memory_fraction(10, 64, 64, kept=10, kv_bits=8) == 66.0 / 128.0
    assert Q.quantized_memory_fraction(10, 64, 64, kept=3, kv_bits=16) == R.memory_fraction(10, 64, 64, kept=3)


@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("design", DESIGNS, ids=str)
def test_memory_at_kv_bits_is_counted_with_the_scales(design, kv_bits):
    q, k, v, imp = _head(9)
    n, d = k.shape
    dv = v.shape[1]
    tilt = np.random.default_rng(10).normal(size=(4, 16))
    spec = R.sketch._design(design)
    extra = 0.0 if spec is None else float(spec.elements(d, dv))
    r16 = R.evict_and_certify(q, k, v, imp, 60.0, seed=0, design=design, tilt=tilt)
    r = R.evict_and_certify(q, k, v, imp, 60.0, seed=0, design=design, tilt=tilt, kv_bits=kv_bits)
    assert r.budget == Q.sampled_budget(60.0, d, dv, kv_bits, extra=extra)
    assert r.budget > 1.4 * r16.budget                            # more tokens in the same memory
    assert r.memory == Q.quantized_memory_fraction(n, d, dv, kept=r.kept, kv_bits=kv_bits, extra=extra)
    whole = R.evict_and_certify(q, k, v, imp, 0.9 * n, seed=0, design=design, tilt=tilt, kv_bits=kv_bits)
    assert whole.kept == n and whole.budget == n and whole.variance == 0.0      # the whole cache fits
    assert whole.radius == whole.quantization_bound > 0
    assert whole.memory == (Q.token_elements(d, dv, kv_bits) - 1) / (d + dv)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kv_bits", [3, 32, 0, 8.0, True, "8", None])
def test_unsupported_kv_bits_are_refused(kv_bits):
    q, k, v, imp = _head(11, n=50)
    with pytest.raises(ValueError, match=r"kv_bits must be one of \(16, 8, 4\)"):
        R.evict_and_certify(q, k, v, imp, 20.0, seed=0, kv_bits=kv_bits)


@pytest.mark.parametrize("codes, scales, match", [
    (np.ones((2, 3)), [np.nan, 0.5], "scales must be finite and >= 0"),
    (np.ones((2, 3)), [-0.5, 0.5], "scales must be finite and >= 0"),
    (np.ones((2, 3)), [np.inf, 0.5], "scales must be finite and >= 0"),
    (np.ones((2, 3)), [0.0, 0.5], "zero scale stores an all-zero row"),
    (np.ones((2, 3)), [0.1, 0.5], "float16 numbers"),
    (np.ones((2, 3)), [0.5], r"scales must have shape \(n,\) = \(2,\)"),
    (np.full((2, 3), 128.0), [0.5, 0.5], r"codes must lie in \[-127, 127\]"),
    (np.full((2, 3), 0.5), [0.5, 0.5], "codes must be integers"),
    (np.full((2, 3), np.nan), [0.5, 0.5], "codes must lie in"),
    (np.ones(3), [0.5], r"codes must have shape \(n, m\)"),
])
def test_bad_stored_rows_are_refused(codes, scales, match):
    with pytest.raises(ValueError, match=match):
        QuantizedRows(codes=codes, scales=np.asarray(scales, dtype=np.float64), format="int8")


def test_bad_quantizer_input_is_refused():
    with pytest.raises(ValueError, match="format must be one of"):
        quantize(np.ones((2, 2)), "int3")
    with pytest.raises(ValueError, match="x must be finite"):
        quantize(np.array([[1.0, np.nan]]), "int8")
    with pytest.raises(ValueError, match=r"x must have \|x\| <="):
        quantize(np.array([[1e12, 0.0]]), "int8")
    with pytest.raises(ValueError, match="codes must be float8 e4m3 values"):
        QuantizedRows(codes=np.array([[17.0]]), scales=np.array([1.0]), format="e4m3")
    with pytest.raises(ValueError, match=r"q must be a finite \(d,\)"):
        Q.logit_bound(np.ones(3), quantize(np.ones((2, 2)), "int8"))
    q, k, v, imp = _head(12, n=50)
    k[3, 2] = np.inf
    with pytest.raises(ValueError, match="keys must be finite"):
        R.evict_and_certify(q, k, v, imp, 20.0, seed=0, kv_bits=8)
