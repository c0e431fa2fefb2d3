"""kvcert.reference.quantized and evict_and_certify(kv_bits=...): quantized KV caches with a certificate that
covers rounding and sampling (docs/quantized.md).

What is exact is tested exactly:

- the quantizer rounds within its stored bound (per element s/2 for integers, s max(2^-4 |c|, 2^-10) for
  float8 e4m3), and its e4m3 rounding is torch's ``float8_e4m3fn`` cast;
- Proposition 2: ||o_hat_q - o_hat|| <= B_q on every input (Hypothesis over lengths, score regimes,
  inclusion probabilities with 1.0, 1e-6 and padding, the three formats), on adversarially aligned
  rounding, and through ``evict_and_certify`` for every design and bit width, with the same sample's exact
  Hajek estimate rebuilt from the public functions;
- kv_bits=16 is bit-for-bit the call without the argument, for every design (and any ``kv_layout`` /
  ``quantized_bound``, which it ignores);
- the memory count, and the sampled budget at equal expected memory, for every layout.

What is random is tested in Monte Carlo, within 4 standard errors of the Monte Carlo mean (seeded, so the
outcome is fixed; each check fails by chance with probability about 6e-5 per compared number):

- stochastic rounding is unbiased per element, with variance s^2 p(1 - p) <= s^2/4;
- the value term of V_q is exact: with exact keys, E||o_hat_q - o_hat||^2 = sum w_i^2 sum_j s^2 p(1 - p);
- the logit term is the delta method's: with exact values, the Monte Carlo mean square is the linear term's
  sum w_i^2 Var(e_i) ||v_i - o_hat||^2 within 4 standard errors plus the second-order remainder's allowance
  (4 sigma_max^2 relative: the rounding errors are symmetric at p = 1/2, so the remainder's cross term with
  the linear term vanishes and what is left is of order sigma^2), and V_q bounds it;
- the variance certificate covers >= 0.95 of roundings on adversarial input (every rounding at p = 1/2,
  where V_q's s^2/4 is attained).

Tolerances of the exact checks are the float64 evaluation's own rounding, derived where used
(``support.rounding``: a length-n reduction's relative allowance). Negative controls: half of B_q is exceeded
by inputs whose value rounding is aligned, the bound without its logit term is exceeded by inputs whose key
rounding is aligned, round to nearest fails the unbiasedness check, and a V_q without its logit term (or a
third of the radius) fails coverage, so the property tests can fail.
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
from kvcert.reference.quantized import (
    QuantizedChannels,
    QuantizedRows,
    quantization_bound,
    quantization_variance,
    quantize,
    quantize_channels,
)
from support import lengths, pi_vectors, rounding

EPS = float(np.finfo(np.float64).eps)
FORMATS = tuple(Q.FORMATS)
DESIGNS = [None, "paper", "cluster", "tilted", R.ClusterDesign(clusters=4, radius="chebyshev")]
#: (kv_layout, quantized_bound): every variant evict_and_certify accepts
VARIANTS = [(layout, bound) for layout in Q.KV_LAYOUTS for bound in Q.QUANTIZED_BOUNDS]
PROPERTY = settings(max_examples=60, deadline=None)
Z = 4.0                                                            # Monte Carlo checks: 4 standard errors


def _head(seed, n=300, d=16, dv=8, spread=1.0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=d) * spread
    k = rng.normal(size=(n, d))
    k[:, 0] *= 6.0                                                 # an outlier channel, as real keys have
    v = rng.normal(size=(n, dv)) + 0.5
    imp = rng.random(n) ** 4
    return q, k, v, imp


def _store(k, v, fmt, layout="token", bound="strict", seed=0):
    """The rows as evict_and_certify stores them: ``"strict"`` rounds to nearest, ``"variance"`` rounds
    stochastically from ``rounding_generator(seed)``, keys first (none in the ``"values"`` layout)."""
    kw = dict(rounding="stochastic", generator=Q.rounding_generator(seed)) if bound == "variance" else {}
    keys = k if layout == "values" else (quantize_channels if layout == "channel" else quantize)(k, fmt, **kw)
    return keys, quantize(v, fmt, **kw)


def _rows(keys):
    return keys if isinstance(keys, np.ndarray) else keys.dequantize()


def _hajek_gap(q, k, v, pi, fmt, scale=None, layout="token", bound="strict", seed=0):
    """(||o_hat_q - o_hat||, B_q, allowance): the rounding's effect on one sample's Hajek estimate, its bound,
    and the float64 rounding of the two estimates and of B_q (two length-n reductions of values of norm at most
    vmax, and B_q's own sum)."""
    kq, vq = _store(k, v, fmt, layout, bound, seed)
    exact = R.hajek_attention(q, k, v, pi, scale=scale).output
    stored = R.hajek_attention(q, _rows(kq), vq.dequantize(), pi, scale=scale).output
    b = quantization_bound(q, kq, vq, pi, scale=scale)
    vmax = max(np.abs(v).max(), np.abs(vq.dequantize()).max()) * np.sqrt(v.shape[1])
    tol = rounding(torch.float64, len(pi)) * (2.0 * vmax + b)
    return float(np.linalg.norm(stored - exact)), b, tol


def _half_rows(rng, n, m, top=127.0, step=2.0 ** -6):
    """(n, m) rows whose channel 0 is ``top * step`` (so the per-token scale is ``step``, a float16 number,
    and channel 0 is stored exactly) and whose other elements are (integer + 1/2) step: under stochastic
    rounding each rounds up or down with probability 1/2, the variance s^2/4 the bound assumes."""
    c = rng.integers(-int(top) + 1, int(top) - 1, size=(n, m)) + 0.5
    c[:, 0] = top
    return c * step


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


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("layout", ["token", "channel"])
def test_stochastic_and_channel_rounding_stay_within_their_stored_bound(fmt, layout):
    """Stochastic rounding stores floor(x/s) or ceil(x/s): |x - Q(x)| < s (the stored bound), codes within
    [-t, t], elements on the grid (x/s an integer) stored exactly; per-channel scales (groups of 32 rows, the
    last one partial) are float16 numbers at or above each (group, channel)'s absmax / t. The same
    generator seed replays the same codes, and ``generator`` is ``uniforms = generator.random(x.shape)``."""
    rng = np.random.default_rng(2)
    x = rng.standard_t(3, size=(70, 12))
    x[:, 3] *= 20.0                                                # an outlier channel
    x[5] = 0.0
    x[7, :] = 0.0
    x[7, 0] = Q.FORMATS[fmt] * 2.0 ** -6                           # one-hot row: x/s on the grid (0 and t)
    quant = quantize_channels if layout == "channel" else quantize
    for rounding_ in ("nearest", "stochastic"):
        kw = dict(rounding=rounding_, generator=Q.rounding_generator(4)) if rounding_ == "stochastic" else {}
        qx = quant(x, fmt, **kw)
        err = np.abs(x - qx.dequantize())
        scales = qx.scale_rows() if layout == "channel" else np.broadcast_to(qx.scales[:, None], x.shape)
        assert np.all(err <= qx.error_bound() + EPS * (np.abs(x) + np.abs(qx.dequantize())))
        assert np.all(qx.error_bound() == (scales if rounding_ == "stochastic" else scales / 2))
        assert np.all(np.abs(qx.codes) <= Q.FORMATS[fmt]) and np.all(qx.dequantize()[[5, 7], 1:] == 0.0)
        assert layout == "channel" or qx.dequantize()[7, 0] == x[7, 0]
        if layout == "channel":
            for g in range(3):
                top = np.abs(x[32 * g:32 * (g + 1)]).max(axis=0) / Q.FORMATS[fmt]
                assert np.all(qx.scales[g] >= top) and np.all(qx.scales[g] < top * (1 + 2.0 ** -10) + 1e-300)
    a = quant(x, fmt, rounding="stochastic", generator=Q.rounding_generator(9))
    b = quant(x, fmt, rounding="stochastic", uniforms=Q.rounding_generator(9).random(x.shape))
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.scales, b.scales)
    assert a.rounding == "stochastic" and not np.array_equal(a.codes, quant(x, fmt).codes)


def test_stochastic_rounding_is_unbiased_with_variance_at_most_s2_over_4():
    """Per element over R = 4000 roundings: the mean of Q(x) - x is within 4 standard errors of 0 (the
    standard error sqrt(p (1 - p) / R) s, p the fractional part of x/s), and the variance is s^2 p(1 - p)
    within 4 standard errors of the mean square (its standard error sqrt((mu_4 - sigma^4) / R), mu_4 =
    s^4 p (1 - p) (1 - 3 p (1 - p)) for a shifted Bernoulli; 0 at p = 1/2, where every error is s/2) and at
    most s^2/4. 48 elements, so a chance
    failure has probability about 48 x 6e-5 = 3e-3; the seed fixes the outcome. Negative control: round to
    nearest fails the unbiasedness check on the same elements."""
    rng = np.random.default_rng(11)
    x = np.concatenate([np.full((4, 1), 127.0), rng.uniform(-120, 120, size=(4, 12))], axis=1) * 2.0 ** -5
    x[0, 1:4] = np.array([0.5, 0.25, 0.9]) * 2.0 ** -5             # p = 1/2, 1/4, 0.9
    draws = 4000
    gen = Q.rounding_generator(3)
    err = np.stack([quantize(x, "int8", rounding="stochastic", generator=gen).dequantize() - x
                    for _ in range(draws)])
    s = 2.0 ** -5
    y = x / s
    p = y - np.floor(y)
    var = s ** 2 * p * (1 - p)
    inner = (p > 0)
    assert np.all(err[:, ~inner] == 0.0)                           # on the grid: stored exactly
    mean_z = err.mean(axis=0)[inner] / np.sqrt(var[inner] / draws)
    assert np.max(np.abs(mean_z)) <= Z, float(np.max(np.abs(mean_z)))
    mu4 = s ** 4 * p * (1 - p) * (1 - 3 * p * (1 - p))              # E (Q(x) - x)^4
    gap = np.abs(np.mean(err ** 2, axis=0) - var)                  # the mean is 0: the raw second moment
    assert np.all(gap <= Z * np.sqrt((mu4 - var ** 2) / draws) + 8 * EPS * var)   # p = 1/2: exactly s^2/4
    assert np.all(var <= quantize(x, "int8", rounding="stochastic", uniforms=np.zeros(x.shape))
                  .variance_bound())
    nearest = (quantize(x, "int8").dequantize() - x)[inner] / np.sqrt(var[inner] / draws)
    assert np.max(np.abs(nearest)) > 10 * Z                        # negative control: biased per element


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
    fmt = draw(st.sampled_from(FORMATS))
    nearest_only = [("token", "strict"), ("channel", "strict")]          # e4m3 rounds to nearest only
    layout, bound = draw(st.sampled_from(VARIANTS if fmt != "e4m3" else nearest_only))
    return q, k, v, pi, fmt, draw(st.sampled_from([None, 0.125])), layout, bound, draw(st.integers(0, 2**31))


@PROPERTY
@given(rounding_cases())
def test_the_bound_holds_on_every_input(case):
    """||o_hat_q - o_hat|| <= B_q, and B_q <= its eta_max form (the docstring's corollary), for every layout
    (per-token, per-channel keys, exact keys) and either rounding (stochastic: per-element bound s)."""
    q, k, v, pi, fmt, scale, layout, bound, seed = case
    gap, b, tol = _hajek_gap(q, k, v, pi, fmt, scale, layout, bound, seed)
    assert gap <= b + tol, (gap, b)
    kq, vq = _store(k, v, fmt, layout, bound, seed)
    est = R.hajek_attention(q, _rows(kq), vq.dequantize(), pi, scale=scale)
    on = est.weights > 0
    eta = 0.0 if layout == "values" else Q.logit_bound(q, kq, scale=scale)[on].max()
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


@pytest.mark.parametrize("layout, bound", VARIANTS)
@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("design", DESIGNS, ids=str)
def test_evict_and_certify_bound_covers_the_rounding_of_its_sample(design, kv_bits, layout, bound):
    """Through the public call: the same sample's exact Hajek estimate (pi rebuilt at ``result.budget``, the
    sample from the same seed) is within ``quantization_bound`` of ``output``; the output is the Hajek estimate
    over the kept rows as stored (``"variance"``: stochastically rounded from ``rounding_generator(seed)``);
    ``"strict"``: the paper design's radius is B_q plus its Chebyshev radius, a sketched design's
    min(B_q + rule, H_q); ``"variance"``: V_q = ``quantization_variance`` of the stored rows is added to the
    design's variance, and the radius is the design's rule on it (Chebyshev sqrt((tr + V_q) / delta) for the
    paper design, capped by H_q for a sketched one)."""
    tilt = np.random.default_rng(6).normal(size=(4, 16))
    for spread, seed in ((0.3, 0), (0.3, 1), (1.0, 2), (1.0, 3)):    # the hull cap binds in some, not in others
        q, k, v, imp = _head(5, spread=spread)
        r = R.evict_and_certify(q, k, v, imp, 60.0, seed=seed, design=design, tilt=tilt, kv_bits=kv_bits,
                                kv_layout=layout, quantized_bound=bound)
        pi = R.inclusion_probabilities(imp, r.budget)
        keep = R.poisson_sample(pi, seed=seed)
        assert r.kept == keep.sum() and r.quantization_bound > 0
        fmt = Q.KV_FORMAT[kv_bits]
        kq, vq = _store(k[keep], v[keep], fmt, layout, bound, seed)
        est = R.hajek_attention(q, _rows(kq), vq.dequantize(), pi[keep])
        assert np.array_equal(r.output, est.output)
        assert r.quantization_bound == quantization_bound(q, kq, vq, pi[keep])
        gap, _, tol = _hajek_gap(q, k[keep], v[keep], pi[keep], fmt, layout=layout, bound=bound, seed=seed)
        assert gap <= r.quantization_bound + tol
        full = R.attention(q, k, v)
        v_q = quantization_variance(q, kq, vq, pi[keep]) if bound == "variance" else 0.0
        assert r.quantization_variance == v_q and (v_q > 0) == (bound == "variance")
        if design == "paper":
            if bound == "strict":
                assert r.radius == r.quantization_bound + R.certificate(est, kind="chebyshev").radius
            else:
                assert r.variance == est.trace + v_q
                assert r.radius == pytest.approx(np.sqrt(r.variance / 0.05), rel=4 * EPS)
            continue
        spec = R.sketch._design(design)
        rule = R.sketch.radius_from_variance(r.variance, delta=0.05, rule=spec.radius, multiplier=spec.multiplier)
        if bound == "variance":                   # min(rule(V + V_q), H_q)
            assert r.variance == R.sketch.sketched_variance(r.cluster_variance, est.trace) + v_q
            assert r.radius <= rule
            if r.radius < rule:
                assert np.linalg.norm(r.output - full) <= r.radius
        else:                                     # min(B_q + rule, H_q): below B_q + rule only where H_q caps it
            assert r.radius <= r.quantization_bound + rule
            if r.radius < r.quantization_bound + rule:            # the cap H_q bounds the true error itself
                assert np.linalg.norm(r.output - full) <= r.radius


# ----------------------------------------------------------------------------- V_q: stochastic rounding


def test_value_term_of_v_q_is_exact_in_monte_carlo():
    """Keys exact (the "values" layout), values stochastically rounded: o_hat_q - o_hat = sum w_i (Q(v_i) -
    v_i) with the exact weights, so E||o_hat_q - o_hat||^2 = sum w_i^2 sum_j s_i^2 p_ij (1 - p_ij) exactly (no
    linearization): the Monte Carlo mean over R = 2000 roundings is within 4 standard errors of it, and V_q
    (s^2/4 per element) is at least it, attained at p = 1/2 (every element but the anchor channel)."""
    rng = np.random.default_rng(21)
    n, d, dv = 48, 8, 6
    q, k = rng.normal(size=d), rng.normal(size=(n, d))
    v = _half_rows(rng, n, dv)
    v[::3, 1:] += 0.25 * 2.0 ** -6                                # p = 3/4 on a third of the tokens
    pi = rng.uniform(0.2, 1.0, n)
    est = R.hajek_attention(q, k, v, pi)
    y = v / 2.0 ** -6
    p = y - np.floor(y)
    exact = float(np.sum(est.weights ** 2 * np.sum(2.0 ** -12 * p * (1 - p), axis=1)))
    gen = Q.rounding_generator(5)
    sq, vqs = [], []
    for _ in range(2000):
        vq = quantize(v, "int8", rounding="stochastic", generator=gen)
        sq.append(np.sum((R.hajek_attention(q, k, vq.dequantize(), pi).output - est.output) ** 2))
        vqs.append(quantization_variance(q, k, vq, pi))
    sq = np.array(sq)
    assert abs(sq.mean() - exact) <= Z * sq.std() / np.sqrt(sq.size), (sq.mean(), exact)
    assert np.all(np.array(vqs) == vqs[0])                         # exact keys: the weights do not move
    attained = float(np.sum(est.weights ** 2 * (dv - 1) * 2.0 ** -12 / 4))
    assert exact < vqs[0] and vqs[0] == pytest.approx(attained * dv / (dv - 1), rel=1e-12)


@pytest.mark.parametrize("spread", [1.0, 6.0])
def test_logit_term_of_v_q_is_the_delta_method_in_monte_carlo(spread):
    """Values stored exactly (on the grid), keys stochastically rounded at p = 1/2 in every channel but the
    anchor, so Var(e_i) = tau^2 sum_{j>0} q_j^2 s^2/4 is what ``logit_variance`` bounds (it also counts the
    anchor channel). Over R = 2000 roundings the mean of ||o_hat_q - o_hat||^2 is the linear term's
    sum w_i^2 Var(e_i) ||v_i - o_hat||^2 within 4 standard errors plus 4 sigma_max^2 relative (the
    second-order remainder: symmetric errors, so its cross term with the linear term vanishes), and the mean of
    V_q (stored rows, per rounding) is at least the Monte Carlo mean. sigma_max is 0.009 and 0.054 nats (int8 on
    SmolLM2's keys: about 0.06)."""
    rng = np.random.default_rng(22)
    n, d, dv = 48, 16, 4
    q, k = rng.normal(size=d) * spread, _half_rows(rng, n, d)
    v = rng.integers(-100, 100, size=(n, dv)) * 2.0 ** -6
    v[:, 0] = 127 * 2.0 ** -6
    pi = np.ones(n)
    est = R.hajek_attention(q, k, v, pi)
    var_e = np.sum(q[1:] ** 2) / d * 2.0 ** -12 / 4 * np.ones(n)
    linear = float(np.sum(est.weights ** 2 * var_e * np.sum((v - est.output) ** 2, axis=1)))
    gen = Q.rounding_generator(6)
    sq, vqs = [], []
    for _ in range(2000):
        kq = quantize(k, "int8", rounding="stochastic", generator=gen)
        vq = quantize(v, "int8", rounding="stochastic", generator=gen)
        assert np.array_equal(vq.dequantize(), v)
        sq.append(np.sum((R.hajek_attention(q, kq.dequantize(), v, pi).output - est.output) ** 2))
        vqs.append(quantization_variance(q, kq, vq, pi))
    sq = np.array(sq)
    sigma_max = float(np.sqrt(var_e.max()))
    assert abs(sq.mean() - linear) <= Z * sq.std() / np.sqrt(sq.size) + 4 * sigma_max ** 2 * linear
    assert np.mean(vqs) >= sq.mean()


def _coverage(q, k, v, budget, radius_scale=1.0, draws=400, **kw):
    """Fraction of seeds (a fresh rounding each) whose evict_and_certify radius, times ``radius_scale``,
    covers ||output - o||."""
    o = R.attention(q, k, v)
    hits = []
    for seed in range(draws):
        r = R.evict_and_certify(q, k, v, np.ones(len(k)), budget, seed=seed, kv_bits=8, kv_layout="token",
                                quantized_bound="variance", **kw)
        hits.append(np.linalg.norm(r.output - o) <= radius_scale * r.radius)
    return float(np.mean(hits))


def test_variance_certificate_covers_adversarial_rounding_negative_controls():
    """The whole cache kept at 8 bits (o_hat = o: the error is rounding alone), keys and values at p = 1/2
    (V_q's per-element s^2/4 attained, but for the anchor channel, which q does not read), one key for every
    token (equal exact logits: uniform weights, each token's rounding moves its own logit) and two value
    groups, so the logit term dominates (97% of V_q; V_q is within 1% of the realized mean square): the
    recommended design's 3 sqrt(V_q) covers >= 0.95 of 400 roundings (seen: 1.0), and the paper design's
    sqrt(V_q / delta) too. Negative controls: a third of the radius (sqrt(V_q), a V_q too small by 9x)
    covers < 0.85 (seen: 0.68); the radius from a V_q without its logit term misses > 0.5 (the bound B_q,
    reported, is far larger and does not cap it)."""
    rng = np.random.default_rng(23)
    n, d, dv = 40, 16, 4
    q = rng.normal(size=d) * 6.0
    q[0] = 0.0
    k = np.tile(_half_rows(rng, 1, d), (n, 1))
    v = np.abs(_half_rows(rng, n, dv)) * np.where(np.arange(n)[:, None] < n // 2, 1.0, -1.0)  # two groups
    v[:, 0] = 127 * 2.0 ** -6
    budget = 0.9 * n
    assert _coverage(q, k, v, budget) >= 0.95
    assert _coverage(q, k, v, budget, design="paper") >= 0.95
    assert _coverage(q, k, v, budget, radius_scale=1 / 3, draws=200) < 0.85
    o = R.attention(q, k, v)
    misses = []
    for seed in range(200):                     # V_q's value term alone, through the same stored rows
        kq, vq = _store(k, v, "int8", "token", "variance", seed)
        r = R.evict_and_certify(q, k, v, np.ones(n), budget, seed=seed, kv_bits=8, kv_layout="token",
                                quantized_bound="variance")
        on_values = quantization_variance(q, kq.dequantize(), vq, np.ones(n))
        assert on_values < 0.2 * r.quantization_variance
        misses.append(np.linalg.norm(r.output - o) > 3 * np.sqrt(on_values))
    assert np.mean(misses) > 0.5


# ----------------------------------------------------------------------------- kv_bits=16 and the memory


@pytest.mark.parametrize("sampling", ["poisson", "systematic"])
@pytest.mark.parametrize("design", DESIGNS, ids=str)
def test_kv_bits_16_is_the_call_without_it(design, sampling):
    """kv_bits=16 returns bit-for-bit the fields of the call without the argument (and B_q = V_q = 0), whatever
    ``kv_layout`` and ``quantized_bound`` say (checked, then unused)."""
    q, k, v, imp = _head(7)
    tilt = np.random.default_rng(8).normal(size=(4, 16))
    for budget, seed in ((60.0, 0), (120.0, 1), (1e9, 2)):
        kw = dict(seed=seed, design=design, tilt=tilt, sampling=sampling)
        a = R.evict_and_certify(q, k, v, imp, budget, **kw)
        for layout, bound in VARIANTS:
            b = R.evict_and_certify(q, k, v, imp, budget, kv_bits=16, kv_layout=layout, quantized_bound=bound, **kw)
            for f in dataclasses.fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), f.name
            assert b.quantization_bound == 0.0 and b.quantization_variance == 0.0


def test_the_default_at_8_bits_is_channel_layout_and_variance():
    """``kv_bits=8`` alone is ``kv_layout="channel", quantized_bound="variance"`` (the variant measured best on
    held-out attention, docs/quantized.md section 7), field for field."""
    q, k, v, imp = _head(13)
    a = R.evict_and_certify(q, k, v, imp, 60.0, seed=3, kv_bits=8)
    b = R.evict_and_certify(q, k, v, imp, 60.0, seed=3, kv_bits=8, kv_layout="channel", quantized_bound="variance")
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y), f.name
    extra = float(R.sketch._design(None).elements(16, 8))
    assert a.quantization_variance > 0 and a.budget == Q.sampled_budget(60.0, 16, 8, 8, extra=extra)


def test_token_elements_and_sampled_budget():
    """Per kept token: d + dv + 1 at 16 bits, (d + dv) b / 16 + 2 scales + 1 below; the sampled budget keeps
    the expected memory of the unquantized paper design, sketch included."""
    tok = dict(layout="token")
    assert Q.token_elements(64, 64, 16) == 129.0
    assert Q.token_elements(64, 64, 8, **tok) == 67.0 and Q.token_elements(64, 64, 4, **tok) == 35.0
    assert Q.sampled_budget(100.0, 64, 64, 16) == 100.0
    for bits in (8, 4):
        for extra in (0.0, 1000.0):
            b = Q.sampled_budget(100.0, 64, 64, bits, extra=extra, **tok)
            assert b * Q.token_elements(64, 64, bits, **tok) + extra == pytest.approx(100.0 * 129.0, rel=1e-15)
    assert Q.quantized_memory_fraction(10, 64, 64, kept=10, kv_bits=8, **tok) == 66.0 / 128.0
    assert Q.quantized_memory_fraction(10, 64, 64, kept=3, kv_bits=16) == R.memory_fraction(10, 64, 64, kept=3)
    # the other layouts: per-channel key scales (64 per group of 32 kept tokens; the default, evict_and_certify's)
    # and 16-bit keys
    assert Q.token_elements(64, 64, 8) == Q.token_elements(64, 64, 8, layout="channel") == 64.0 + 2.0 + 2.0
    assert Q.token_elements(64, 64, 8, layout="values") == 64.0 + 32.0 + 2.0
    assert Q.token_elements(64, 64, 16, layout="values") == 129.0
    b = Q.sampled_budget(100.0, 64, 64, 8, extra=1000.0, layout="channel")
    assert b * Q.token_elements(64, 64, 8, layout="channel") + 1000.0 + 64 == pytest.approx(12900.0, rel=1e-15)
    assert Q.quantized_memory_fraction(100, 64, 64, kept=33, kv_bits=8, layout="channel") == (
        33 * (64 + 1 + 1) + 2 * 64) / (100 * 128)                   # 33 tokens: two groups of key scales
    assert Q.quantized_memory_fraction(10, 64, 64, kept=10, kv_bits=4, layout="values") == (64 + 16 + 1) / 128


@pytest.mark.parametrize("layout", Q.KV_LAYOUTS)
@pytest.mark.parametrize("kv_bits", [8, 4])
@pytest.mark.parametrize("design", DESIGNS, ids=str)
def test_memory_at_kv_bits_is_counted_with_the_scales(design, kv_bits, layout):
    """The sampled budget and the memory held follow the layout's count; when the whole cache fits at
    ``kv_bits`` it is kept with radius B_q (strict), or the design's rule on V_q capped by B_q (variance:
    o_hat = o there, so B_q bounds the whole error)."""
    q, k, v, imp = _head(9)
    n, d = k.shape
    dv = v.shape[1]
    tilt = np.random.default_rng(10).normal(size=(4, 16))
    spec = R.sketch._design(design)
    extra = 0.0 if spec is None else float(spec.elements(d, dv))
    r16 = R.evict_and_certify(q, k, v, imp, 60.0, seed=0, design=design, tilt=tilt)
    kw = dict(seed=0, design=design, tilt=tilt, kv_bits=kv_bits, kv_layout=layout)
    r = R.evict_and_certify(q, k, v, imp, 60.0, quantized_bound="strict", **kw)
    assert r.budget == Q.sampled_budget(60.0, d, dv, kv_bits, extra=extra, layout=layout)
    assert r.budget > (1.1 if layout == "values" else 1.2) * r16.budget   # more tokens in the same memory
    assert r.memory == Q.quantized_memory_fraction(n, d, dv, kept=r.kept, kv_bits=kv_bits, extra=extra,
                                                   layout=layout)
    whole = R.evict_and_certify(q, k, v, imp, 0.95 * n, quantized_bound="strict", **kw)
    assert whole.kept == n and whole.budget == n and whole.variance == 0.0      # the whole cache fits
    assert whole.radius == whole.quantization_bound > 0
    assert whole.memory == Q.quantized_memory_fraction(n, d, dv, kept=n, kv_bits=kv_bits, layout=layout)
    if layout == "token":
        assert whole.memory == (Q.token_elements(d, dv, kv_bits, layout="token") - 1) / (d + dv)
    var = R.evict_and_certify(q, k, v, imp, 0.95 * n, quantized_bound="variance", **kw)
    assert var.kept == n and var.variance == var.quantization_variance > 0
    rule = (np.sqrt(var.variance / 0.05) if spec is None else
            R.sketch.radius_from_variance(var.variance, delta=0.05, rule=spec.radius, multiplier=spec.multiplier))
    assert var.radius == pytest.approx(min(rule, var.quantization_bound), rel=4 * EPS)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kv_bits", [3, 32, 0, 8.0, True, "8", None])
def test_unsupported_kv_bits_are_refused(kv_bits):
    q, k, v, imp = _head(11, n=50)
    with pytest.raises(ValueError, match=r"kv_bits must be one of \(16, 8, 4\)"):
        R.evict_and_certify(q, k, v, imp, 20.0, seed=0, kv_bits=kv_bits)


@pytest.mark.parametrize("kw, match", [
    (dict(kv_layout="kivi"), r"kv_layout must be one of \('token', 'channel', 'values'\)"),
    (dict(kv_layout=None), "kv_layout must be one of"),
    (dict(quantized_bound="loose"), r"quantized_bound must be one of \('strict', 'variance'\)"),
    (dict(quantized_bound=True), "quantized_bound must be one of"),
])
@pytest.mark.parametrize("kv_bits", [16, 8])
def test_unsupported_layouts_and_bounds_are_refused(kw, match, kv_bits):
    q, k, v, imp = _head(11, n=50)
    with pytest.raises(ValueError, match=match):
        R.evict_and_certify(q, k, v, imp, 20.0, seed=0, kv_bits=kv_bits, **kw)


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
    gen = Q.rounding_generator(0)
    x = np.ones((2, 3))
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize(x, "int8", rounding="up")
    with pytest.raises(ValueError, match="rounding='stochastic' needs an integer format"):
        quantize(x, "e4m3", rounding="stochastic", generator=gen)
    with pytest.raises(ValueError, match="needs exactly one source of randomness"):
        quantize(x, "int8", rounding="stochastic")
    with pytest.raises(ValueError, match="needs exactly one source of randomness"):
        quantize(x, "int8", rounding="stochastic", generator=gen, uniforms=np.zeros((2, 3)))
    with pytest.raises(ValueError, match="rounding='nearest' takes neither"):
        quantize(x, "int8", generator=gen)
    with pytest.raises(TypeError, match="generator must be a numpy.random.Generator"):
        quantize(x, "int8", rounding="stochastic", generator=0)
    with pytest.raises(ValueError, match=r"uniforms must have the shape of x, \(2, 3\)"):
        quantize(x, "int8", rounding="stochastic", uniforms=np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"uniforms must lie in \[0, 1\)"):
        quantize(x, "int8", rounding="stochastic", uniforms=np.ones((2, 3)))
    with pytest.raises(ValueError, match="group must be an int >= 1"):
        quantize_channels(x, "int8", group=0)
    with pytest.raises(ValueError, match=r"scales must have shape \(ceil\(n / group\), m\) = \(1, 3\)"):
        QuantizedChannels(codes=np.ones((2, 3)), scales=np.ones(3), group=2, format="int8")
    with pytest.raises(ValueError, match="zero scale stores a group's channel of zeros"):
        QuantizedChannels(codes=np.ones((2, 3)), scales=np.array([[1.0, 0.0, 1.0]]), group=2, format="int8")
    with pytest.raises(ValueError, match="rounding must be one of"):
        QuantizedRows(codes=np.ones((2, 3)), scales=np.ones(2), format="int8", rounding="floor")
    with pytest.raises(TypeError, match="seed must be an int"):
        Q.rounding_generator(1.5)
    nearest, stochastic = quantize(x, "int8"), quantize(x, "int8", rounding="stochastic", generator=gen)
    with pytest.raises(ValueError, match="values must be stochastically rounded"):
        quantization_variance(np.ones(3), stochastic, nearest, np.ones(2))
    with pytest.raises(ValueError, match="keys must be stochastically rounded"):
        quantization_variance(np.ones(3), nearest, stochastic, np.ones(2))
    with pytest.raises(ValueError, match="rows must be stochastically rounded"):
        nearest.variance_bound()
    with pytest.raises(TypeError, match="keys must be QuantizedRows, QuantizedChannels or an"):
        quantization_bound(np.ones(3), [[1.0] * 3] * 2, nearest, np.ones(2))
    with pytest.raises(TypeError, match="values must be QuantizedRows or QuantizedChannels"):
        quantization_variance(np.ones(3), x, x, np.ones(2))
