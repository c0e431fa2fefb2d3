"""Hajek estimator, HT totals and the variance estimate of kvcert.reference.

Exact checks by enumerating all 2^n samples (n <= 12), algebraic properties by
Hypothesis, and Monte Carlo checks with tolerances from the estimator's own
standard error.
"""

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import logsumexp

from kvcert import reference as R
from support import assert_close, attention_case, probabilities


def _population(n, d=6, dv=3, seed=0, spread=1.0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=d), spread * rng.normal(size=(n, d)), rng.normal(size=(n, dv))


def _all_samples(n):
    for bits in itertools.product([False, True], repeat=n):
        yield np.array(bits)


def _sample_prob(keep, pi):
    return float(np.prod(np.where(keep, pi, 1 - pi)))


@pytest.mark.parametrize("n, seed", [(1, 0), (5, 1), (9, 2), (12, 3)])
def test_ht_totals_unbiased_by_enumeration(n, seed):
    q, k, v = _population(n, seed=seed)
    pi = np.random.default_rng(seed).uniform(0.1, 1.0, size=n)
    s = R.scores(q, k)
    N, Z = np.exp(s) @ v, np.exp(s).sum()
    EN, EZ, total = np.zeros_like(N), 0.0, 0.0
    for keep in _all_samples(n):
        p = _sample_prob(keep, pi)
        total += p
        if keep.any():
            Nh, Zh = R.horvitz_thompson_totals(q, k[keep], v[keep], pi[keep])
            EN += p * Nh
            EZ += p * Zh
    assert abs(total - 1) < 1e-12
    np.testing.assert_allclose(EN, N, rtol=1e-11, atol=1e-12 * np.abs(N).max())
    np.testing.assert_allclose(EZ, Z, rtol=1e-11)


@pytest.mark.parametrize("n, seed", [(2, 0), (7, 1), (12, 2)])
def test_linearized_variance_ht_unbiased_by_enumeration(n, seed):
    """E[sum_S (1-pi)/pi^2 w^2 (v-o)(v-o)^T] = sum (1-pi)/pi w^2 (v-o)(v-o)^T exactly."""
    q, k, v = _population(n, seed=seed)
    pi = np.random.default_rng(seed + 10).uniform(0.1, 1.0, size=n)
    pi[0] = 1.0  # a certain token contributes 0
    o = R.attention(q, k, v)
    lse = logsumexp(R.scores(q, k))
    V = R.linearized_variance(q, k, v, pi)
    EV = np.zeros_like(V)
    for keep in _all_samples(n):
        EV += _sample_prob(keep, pi) * R.linearized_variance_ht(q, k, v, pi, keep, output=o, lse=lse)
    np.testing.assert_allclose(EV, V, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("n, seed", [(6, 0), (10, 1)])
def test_hajek_covariance_is_ht_form_with_estimates(n, seed):
    """With o_hat and Z_hat plugged in, the HT form is exactly hajek_attention's covariance."""
    q, k, v = _population(n, seed=seed)
    pi = np.random.default_rng(seed).uniform(0.2, 1.0, size=n)
    keep = np.random.default_rng(seed + 1).random(n) < pi
    keep[0] = True
    est = R.hajek_attention(q, k[keep], v[keep], pi[keep])
    plug = R.linearized_variance_ht(q, k, v, pi, keep, output=est.output, lse=est.lse)
    np.testing.assert_allclose(est.covariance, plug, rtol=1e-12, atol=1e-15)


@given(attention_case(), st.floats(-50, 50))
def test_shift_invariance(case, c):
    q, k, v, bias = case
    n = k.shape[0]
    pi = np.random.default_rng(n).uniform(0.1, 1.0, size=n)
    base = np.zeros(n) if bias is None else bias
    e0 = R.hajek_attention(q, k, v, pi, bias=base)
    e1 = R.hajek_attention(q, k, v, pi, bias=base + c)
    np.testing.assert_allclose(e1.output, e0.output, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(e1.trace, e0.trace, rtol=1e-8, atol=1e-15)
    assert abs(e1.lse - e0.lse - c) <= 1e-9 * (1 + abs(c))


@given(attention_case())
def test_all_pi_one_is_exact(case):
    q, k, v, bias = case
    est = R.hajek_attention(q, k, v, np.ones(k.shape[0]), bias=bias)
    np.testing.assert_allclose(est.output, R.attention(q, k, v, bias=bias), rtol=1e-12, atol=1e-12)
    assert est.trace == 0.0 and np.all(est.variance == 0.0) and est.max_term == 0.0
    for kind in R.KINDS:
        assert np.all(np.asarray(R.certificate(est, kind=kind).radius) == 0.0)


@given(attention_case(), st.floats(1e-6, 1.0))
def test_equal_pi_is_plain_softmax(case, p):
    q, k, v, bias = case
    est = R.hajek_attention(q, k, v, np.full(k.shape[0], p), bias=bias)
    np.testing.assert_allclose(est.output, R.attention(q, k, v, bias=bias), rtol=1e-10, atol=1e-12)


@given(attention_case(), st.data())
def test_variance_properties(case, data):
    q, k, v, bias = case
    pi = data.draw(probabilities(k.shape[0]))
    est = R.hajek_attention(q, k, v, pi, bias=bias)
    cov = est.covariance
    assert np.all(np.isfinite(cov))
    np.testing.assert_array_equal(cov, cov.T)
    scale = max(np.abs(cov).max(), 1e-300)
    assert np.linalg.eigvalsh(cov).min() >= -1e-12 * scale
    np.testing.assert_allclose(np.diag(cov), est.variance, rtol=1e-12, atol=1e-15 * scale)
    assert np.all(est.variance >= 0)
    np.testing.assert_allclose(est.trace, est.variance.sum(), rtol=1e-12, atol=1e-300)
    np.testing.assert_allclose(est.weights.sum(), 1.0, rtol=1e-12)
    assert 1.0 <= est.n_eff <= np.sum(est.weights > 0) * (1 + 1e-12)


@given(attention_case(), st.data())
def test_padding_invariance(case, data):
    """Rows with pi = 0 are padding: they change nothing, whatever their keys and values."""
    q, k, v, bias = case
    n = k.shape[0]
    pi = data.draw(probabilities(n))
    e0 = R.hajek_attention(q, k, v, pi, bias=bias)
    extra = data.draw(st.integers(1, 5))
    rng = np.random.default_rng(n)
    k2 = np.vstack([k, 100 * rng.normal(size=(extra, k.shape[1]))])
    v2 = np.vstack([v, 100 * rng.normal(size=(extra, v.shape[1]))])
    pi2 = np.concatenate([pi, np.zeros(extra)])
    b2 = None if bias is None else np.concatenate([bias, np.zeros(extra)])
    e1 = R.hajek_attention(q, k2, v2, pi2, bias=b2)
    # equal up to float64 rounding of a longer reduction (a few ulps)
    np.testing.assert_allclose(e1.output, e0.output, rtol=1e-14, atol=1e-15)
    assert abs(e1.lse - e0.lse) <= 1e-13 * (1 + abs(e0.lse))
    # the trace's rounding scale: sum_S c_i ||v_i||^2 (residuals v - o_hat carry ulps of v)
    c = (1 - pi) * e0.weights**2
    assert abs(e1.trace - e0.trace) <= 1e-13 * np.sum(c * (v * v).sum(axis=1)) + 1e-300
    assert np.all(e1.weights[n:] == 0)


def test_tiny_pi_is_finite():
    q, k, v = _population(20)
    pi = np.full(20, 1e-6)
    pi[:3] = 1.0
    est = R.hajek_attention(q, k, v, pi)
    assert np.all(np.isfinite(est.output)) and np.isfinite(est.trace) and np.isfinite(est.lse)


def test_empty_sample_is_uncertifiable():
    q, k, v = _population(4)
    est = R.hajek_attention(q, k, v, np.zeros(4))
    assert np.all(est.output == 0) and est.lse == -np.inf and est.trace == np.inf
    for kind in R.KINDS:
        assert np.all(np.asarray(R.certificate(est, kind=kind).radius) == np.inf)


def _monte_carlo(q, k, v, pi, reps, seed, estimate=R.hajek_attention):
    """Per Poisson draw of ``pi`` over the population (q, k, v): the estimate's output and variance,
    and the exact decomposition the tests below derive their allowances from (w_i = e^{s_i} / Z the
    true weights, o the true output):

    - D = sum_S w_i / pi_i, the HT normalizer's ratio to Z (E D = 1);
    - e = o_hat - o = L / D with L = sum_S (w_i / pi_i)(v_i - o), linear: E L = 0, Var L = diag V
      (:func:`R.linearized_variance`), exactly, for Poisson sampling;
    - v_HT = diag of :func:`R.linearized_variance_ht` (the true o and Z), exactly unbiased for diag V;
    - the plug-in remainder rem = D^-2 (v_HT - 2 e S1 + e^2 S0) - v_HT, S1 = sum_S c_i (v_i - o),
      S0 = sum_S c_i, c_i = (1 - pi_i) w_i^2 / pi_i^2: the estimate's variance is v_HT + rem
      exactly (it is v_HT with o_hat and Z_hat = D Z plugged in), and rem is of second order."""
    rng = np.random.default_rng(seed)
    s = R.scores(q, k)
    lse = float(logsumexp(s))
    w = np.exp(s - lse)
    o = w @ v
    rows = {f: [] for f in ("output", "variance", "D", "v_ht", "rem")}
    for _ in range(reps):
        keep = R.poisson_sample(pi, generator=rng)
        est = estimate(q, k[keep], v[keep], pi[keep])
        wk, pk, rk = w[keep], pi[keep], v[keep] - o
        D = float((wk / pk).sum())
        c = (1 - pk) * wk**2 / pk**2
        v_ht = np.diag(R.linearized_variance_ht(q, k, v, pi, keep, output=o, lse=lse))
        e = est.output - o
        rows["output"].append(est.output), rows["variance"].append(est.variance), rows["D"].append(D)
        rows["v_ht"].append(v_ht), rows["rem"].append((v_ht - 2 * e * (c @ rk) + e**2 * c.sum()) / D**2 - v_ht)
    return o, {f: np.array(x) for f, x in rows.items()}


def _well_behaved(n=600):
    """Flat scores, moderate pi (n = 600, expected kept 0.3 n): where the linearization is accurate."""
    q, k, v = _population(n, d=8, dv=4, seed=3, spread=0.5)
    pi = R.inclusion_probabilities(np.random.default_rng(4).random(n), 0.3 * n, sinks=4, window=16, floor=0.5)
    return q, k, v, pi


def _check_variance(q, k, v, pi, estimate=R.hajek_attention, reps=1500):
    o, mc = _monte_carlo(q, k, v, pi, reps, seed=5, estimate=estimate)
    V = np.diag(R.linearized_variance(q, k, v, pi))
    mean_se = lambda x: (x.mean(0), x.std(0, ddof=1) / np.sqrt(reps))  # noqa: E731
    # 1. the HT part is exactly unbiased for V: no allowance beyond 4 standard errors
    m, se = mean_se(mc["v_ht"])
    assert np.all(np.abs(m - V) <= 4 * se), ("E v_HT != V", m, V, se)
    # 2. the estimate's variance is v_HT plus the plug-in remainder, draw by draw (an identity: a
    #    variance formula with another weight or centre breaks it), the remainder second order
    assert_close("variance = v_HT + rem", mc["variance"], mc["v_ht"] + mc["rem"], 1e-9 * V)
    m, se = mean_se(mc["variance"])
    r, r_se = mean_se(mc["rem"])
    assert np.all(np.abs(m - V) <= 4 * np.hypot(se, r_se) + np.abs(r)), ("E variance != V", m, V, r)
    # 3. the Monte Carlo error of o_hat against V: e = L - e (D - 1) exactly, so by the triangle
    #    inequality in L2, | ||e||_2 - ||L||_2 | <= ||e (D - 1)||_2 with ||L||_2 = sqrt(V)
    e2 = (mc["output"] - o) ** 2
    rmse, rmse_se = np.sqrt(e2.mean(0)), e2.std(0, ddof=1) / np.sqrt(reps) / (2 * np.sqrt(e2.mean(0)))
    g2 = e2 * (mc["D"][:, None] - 1) ** 2
    gap, gap_se = np.sqrt(g2.mean(0)), g2.std(0, ddof=1) / np.sqrt(reps) / (2 * np.sqrt(g2.mean(0)))
    assert np.all(np.abs(rmse - np.sqrt(V)) <= gap + 4 * np.hypot(rmse_se, gap_se)), ("rmse", rmse, np.sqrt(V), gap)
    return mc


def test_variance_estimate_matches_monte_carlo():
    """On a well-behaved population the variance estimate's mean, the Monte Carlo error of o_hat and
    the linearized design variance V agree, with allowances derived from the exact decomposition of
    :func:`_monte_carlo` (4 standard errors plus the measured second-order remainder, 2-4% of V
    here), not fixed fractions; the normalizer's spread sd(D), which sets the size of every
    second-order term, is the design's sqrt(sum w^2 (1 - pi) / pi)."""
    q, k, v, pi = _well_behaved()
    mc = _check_variance(q, k, v, pi)
    sd_D = np.sqrt(float(np.sum(np.exp(2 * (R.scores(q, k) - logsumexp(R.scores(q, k)))) * (1 - pi) / pi)))
    assert abs(mc["D"].std(ddof=1) / sd_D - 1) <= 4 / np.sqrt(2 * len(mc["D"]))  # SE of a sample sd


def test_variance_check_rejects_a_variance_without_the_finite_population_factor():
    """Negative control: the same check on an estimate that drops (1 - pi) from its variance (the
    with-replacement formula, too large by sum_S w^2 / pi^2 (v - o)^2 pi) fails."""
    def no_fpc(q, k, v, pi):
        est = R.hajek_attention(q, k, v, pi)
        r = v - est.output
        return dataclasses.replace(est, variance=(est.weights[:, None] ** 2 * r * r).sum(0))

    with pytest.raises(AssertionError, match="variance = v_HT"):
        _check_variance(*_well_behaved(), estimate=no_fpc, reps=200)


def test_hajek_bias_is_small_on_well_behaved_population():
    """Hajek is ratio-biased only at second order. Exactly, o_hat - o = L / D with E L = 0, so
    E(o_hat - o) = -E[(o_hat - o)(D - 1)], and by Cauchy-Schwarz
    |E o_hat - o| <= sqrt(E (o_hat - o)^2) sd(D): the allowance is that bound (estimated from the
    same draws) plus 4 standard errors of the mean."""
    q, k, v, pi = _well_behaved()
    reps = 1500
    o, mc = _monte_carlo(q, k, v, pi, reps, seed=6)
    e = mc["output"] - o
    sd = e.std(axis=0, ddof=1)
    bound = np.sqrt((e**2).mean(0)) * mc["D"].std(ddof=1)
    assert np.all(np.abs(e.mean(0)) <= 4 * sd / np.sqrt(reps) + bound), (e.mean(0), sd, bound)


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.ones((2, 2)), np.ones((3, 2)), np.ones((3, 1)), np.ones(3)), "q must have shape"),
        ((np.ones(2), np.ones((3, 4)), np.ones((3, 1)), np.ones(3)), "keys must have shape"),
        ((np.ones(2), np.ones((3, 2)), np.ones((4, 1)), np.ones(3)), "values must have shape"),
        ((np.ones(2), np.ones((3, 2)), np.ones((3, 1)), np.ones(4)), "pi must have shape"),
        ((np.ones(2), np.ones((3, 2)), np.ones((3, 1)), np.array([0.5, 2.0, 1])), "pi must lie"),
        ((np.ones(2), np.ones((3, 2)), np.ones((3, 1)), np.array([0.5, np.nan, 1])), "pi must lie"),
        ((np.array([1.0, np.nan]), np.ones((3, 2)), np.ones((3, 1)), np.ones(3)), "q must be finite"),
    ],
)
def test_hajek_errors(args, match):
    with pytest.raises(ValueError, match=match):
        R.hajek_attention(*args)


def test_bias_errors_and_masked_attention():
    q, k, v = _population(3)
    with pytest.raises(ValueError, match="bias"):
        R.attention(q, k, v, bias=np.array([0.0, np.inf, 0.0]))
    with pytest.raises(ValueError, match="empty"):
        R.attention(q, k, v, bias=np.full(3, -np.inf))
