"""Hajek estimator, HT totals and the variance estimate of kvcert.reference.

Exact checks by enumerating all 2^n samples (n <= 12), algebraic properties by
Hypothesis, and Monte Carlo checks with tolerances from the estimator's own
standard error.
"""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import logsumexp

from kvcert import reference as R
from support import attention_case, probabilities


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


def _monte_carlo(q, k, v, pi, reps, seed):
    rng = np.random.default_rng(seed)
    outs, traces, var = [], [], []
    for _ in range(reps):
        keep = R.poisson_sample(pi, generator=rng)
        e = R.hajek_attention(q, k[keep], v[keep], pi[keep])
        outs.append(e.output)
        traces.append(e.trace)
        var.append(e.variance)
    return np.array(outs), np.array(traces), np.array(var)


def test_variance_estimate_matches_monte_carlo():
    """On a well-behaved population (flat scores, moderate pi, n = 600) the mean of
    the variance estimate and the Monte Carlo variance of o_hat agree within
    4 combined standard errors plus the O(1/n) linearization bias (bounded
    here by 5% of the variance, a second-order term of relative size ~ 1/E|S|)."""
    n = 600
    q, k, v = _population(n, d=8, dv=4, seed=3, spread=0.5)
    u = np.random.default_rng(4).random(n)
    pi = R.inclusion_probabilities(u, 0.3 * n, sinks=4, window=16, floor=0.5)
    reps = 1500
    outs, traces, var = _monte_carlo(q, k, v, pi, reps, seed=5)
    mc_var = outs.var(axis=0, ddof=1)
    # SE of a sample variance ~ var * sqrt(2 / reps) (near-normal o_hat); SE of the mean estimate
    se = np.sqrt(mc_var**2 * 2 / reps + var.var(axis=0, ddof=1) / reps)
    assert np.all(np.abs(var.mean(axis=0) - mc_var) <= 4 * se + 0.05 * mc_var)
    # and the linearized design variance (the truth the estimate targets) agrees too
    V = np.diag(R.linearized_variance(q, k, v, pi))
    assert np.all(np.abs(mc_var - V) <= 4 * mc_var * np.sqrt(2 / reps) + 0.05 * V)


def test_hajek_bias_is_small_on_well_behaved_population():
    """Hajek is ratio-biased only at O(1/n): |E o_hat - o| <= 4 SE + 1% of the sd."""
    n = 600
    q, k, v = _population(n, d=8, dv=4, seed=3, spread=0.5)
    pi = R.inclusion_probabilities(np.random.default_rng(4).random(n), 0.3 * n, sinks=4, window=16, floor=0.5)
    outs, _, _ = _monte_carlo(q, k, v, pi, 1500, seed=6)
    sd = outs.std(axis=0, ddof=1)
    assert np.all(np.abs(outs.mean(axis=0) - R.attention(q, k, v)) <= 4 * sd / np.sqrt(1500) + 0.01 * sd)


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
