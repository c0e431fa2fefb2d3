"""The strict certificate ``chebyshev_ucb`` in kvcert.reference: its tail moment, formula and coverage.

tail_moment = s2 = sum_S (1 - pi_i) x_i^2 with x_i = (1 - pi_i) a_i^2 ||v_i - o_hat||^2 (the trace's
terms); nu = 2 tr^2 / s2; radius^2 = 2 tr nu / (delta chi2_{nu; delta/2}) (docs/theory.md).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats
from scipy.special import logsumexp, softmax

from kvcert import reference as R
from support import attention_case, probabilities

EPS64 = float(np.finfo(np.float64).eps)


def _direct_tail_moment(q, k, v, pi, bias):
    """s2 recomputed from scratch, token by token (scipy softmax, Python sums), not the library's code.

    Returns (s2, rounding bound of the comparison)."""
    s = k @ q / math.sqrt(q.shape[0]) + (0.0 if bias is None else bias)
    live = (pi > 0) & (s > -np.inf)
    if not live.any():
        return np.inf, None
    logits = np.where(live, s - np.log(np.where(live, pi, 1.0)), -np.inf)
    a = softmax(logits)
    lse = logsumexp(logits[live])
    o = sum(a[i] * v[i] for i in range(len(a)) if live[i])
    terms, bound = [], []
    for i in np.flatnonzero(live):
        r2 = math.fsum((v[i] - o) ** 2)
        omega = (1.0 - pi[i]) ** 3 * a[i] ** 4
        terms.append(omega * r2 * r2)
        # rounding: a_i^4 carries 4 x the relative error of a softmax weight, eps (|logit| + |lse| + n);
        # ||v - o||^4 moves by at most (r + e)^4 - r^4 for a distance error e ~ eps sqrt(dv) (|v| + |o|)
        e = 4 * EPS64 * math.sqrt(v.shape[1]) * (np.abs(v[i]).max() + np.abs(o).max())
        r = math.sqrt(r2)
        rel_a = EPS64 * (abs(logits[i]) + abs(lse) + len(a))
        bound.append(omega * ((r + e) ** 4 - r ** 4) + 4 * rel_a * terms[-1])
    total = math.fsum(terms)
    return total, 8 * math.fsum(bound) + 4 * EPS64 * len(terms) * total


# ----------------------------------------------------------------------------- the tail moment


@given(attention_case(), st.data())
def test_tail_moment_matches_a_direct_computation(case, data):
    q, k, v, bias = case
    pi = data.draw(probabilities(k.shape[0]))
    if data.draw(st.booleans()):  # some padding slots (pi = 0)
        pi = np.where(np.random.default_rng(k.shape[0]).random(pi.shape) < 0.2, 0.0, pi)
    est = R.hajek_attention(q, k, v, pi, bias=bias)
    want, tol = _direct_tail_moment(q, k, v, pi, bias)
    if want == np.inf:
        assert est.tail_moment == np.inf and est.trace == np.inf
        return
    assert isinstance(est.tail_moment, float) and est.tail_moment >= 0.0
    assert abs(est.tail_moment - want) <= tol, (est.tail_moment, want, tol)
    # s2 = sum (1 - pi) x_i^2 <= (sum x_i)^2 = tr^2 (0 <= 1 - pi <= 1, x_i >= 0): nu = 2 tr^2 / s2 >= 2
    assert est.tail_moment <= est.trace ** 2 * (1 + 64 * EPS64 * (k.shape[0] + 1))


def test_tail_moment_edge_cases():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=4), rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    assert R.hajek_attention(q, k, v, np.ones(6)).tail_moment == 0.0  # certainty set only
    assert R.hajek_attention(q, k, v, np.zeros(6)).tail_moment == np.inf  # empty sample
    single = R.hajek_attention(q, k[:1], v[:1], np.array([0.3]))  # one token: o_hat = v, distance 0
    assert single.trace == 0.0 and single.tail_moment == 0.0
    # padding slots change nothing
    pi = rng.uniform(0.1, 0.9, size=6)
    base = R.hajek_attention(q, k, v, pi)
    padded = R.hajek_attention(q, np.vstack([k, 50 * k[:2]]), np.vstack([v, 50 * v[:2]]), np.r_[pi, 0.0, 0.0])
    assert padded.tail_moment == pytest.approx(base.tail_moment, rel=1e-12)


def test_tail_moment_is_the_ht_variance_estimate_of_the_trace_by_enumeration():
    """With the true o and Z in the terms (x_i = y_i / pi_i, y_i = (1 - pi_i)/pi_i w_i^2 ||v_i - o||^2),
    E[sum_S (1 - pi_i) x_i^2] = Var(sum_S x_i) exactly over all 2^n Poisson samples: the formula's
    (1 - pi) weight (not, e.g., (1 - pi)/pi) is the HT variance estimator of a Poisson HT sum."""
    rng = np.random.default_rng(4)
    n = 10
    q, k, v = rng.normal(size=4), rng.normal(size=(n, 4)), rng.normal(size=(n, 2))
    p = rng.uniform(0.1, 0.95, size=n)
    w = np.exp(R.scores(q, k))
    w /= w.sum()
    y = (1 - p) / p * w * w * np.sum((v - w @ v) ** 2, axis=1)
    x = y / p
    masks = np.array(list(itertools.product([0, 1], repeat=n)), dtype=bool)
    prob = np.prod(np.where(masks, p, 1 - p), axis=1)
    tr = masks @ x
    s2 = masks @ ((1 - p) * x * x)
    assert prob @ tr == pytest.approx(y.sum(), rel=1e-12)  # unbiased trace (the HT property)
    var_tr = prob @ (tr - y.sum()) ** 2
    assert prob @ s2 == pytest.approx(var_tr, rel=1e-12)
    assert not np.isclose(prob @ (masks @ ((1 - p) / p * x * x)), var_tr, rtol=1e-3)  # the test has teeth


# ----------------------------------------------------------------------------- the radius


@given(tr=st.floats(1e-30, 1e30), ratio=st.floats(0.0, 1.0), delta=st.sampled_from([0.5, 0.1, 0.05, 0.01, 1e-4]))
def test_radius_is_the_chi2_upper_bound_then_markov(tr, ratio, delta):
    """r^2 (delta/2) = V_U solves P(chi2_nu / nu <= tr / V_U) = delta/2 (the UCB at level delta/2), and
    sqrt(2) x chebyshev < r <= the nu = 2 value sqrt(2 tr / (-delta log(1 - delta/2)))."""
    s2 = ratio * tr * tr  # s2 <= tr^2 for every estimate
    r = R.radius_from_moments("chebyshev_ucb", delta, trace=tr, tail_moment=s2)
    assert np.isfinite(r) and r > 0
    cheb = R.radius_from_moments("chebyshev", delta, trace=tr)
    nu = np.inf if s2 == 0 else max(2.0 * tr * tr / s2, 2.0)
    v_u = r * r * delta / 2.0
    limit = math.sqrt(2 * tr / delta)
    if nu <= 1e10:  # (scipy's chi2.cdf loses accuracy beyond)
        assert stats.chi2.cdf(nu * tr / v_u, nu) == pytest.approx(delta / 2.0, rel=1e-8)
    elif np.isfinite(nu):  # Wilson-Hilferty: r^2 / limit^2 = nu / chi2_{nu; delta/2} ~ 1 + z sqrt(2 / nu)
        assert -1e-14 <= (r / limit) ** 2 - 1 <= 1.01 * stats.norm.ppf(1 - delta / 2) * math.sqrt(2 / nu) + 1e-14
    else:
        assert r == pytest.approx(limit, rel=1e-14)
    assert r >= math.sqrt(2.0) * cheb * (1 - 1e-14)
    assert r <= math.sqrt(2.0 * tr / (-delta * math.log1p(-delta / 2.0))) * (1 + 1e-12)


@pytest.mark.parametrize("delta", [0.3, 0.05, 0.001])
def test_radius_decreases_in_nu_towards_the_limit(delta):
    """For fixed tr the radius decreases in nu (s2 smaller), from the nu = 2 closed form
    (chi2_{2; p} = -2 log(1 - p)) to sqrt(2 tr / delta); s2 > tr^2 (impossible for an estimate) is
    clipped at nu = 2."""
    tr = 3.7
    nus = np.concatenate([np.linspace(2.0, 40.0, 400), np.geomspace(40.0, 1e14, 400)])
    r = np.array([R.radius_from_moments("chebyshev_ucb", delta, trace=tr, tail_moment=2 * tr * tr / nu)
                  for nu in nus])
    assert np.all(np.diff(r) <= 0), np.min(np.diff(r))
    at2 = math.sqrt(2 * tr / (-delta * math.log1p(-delta / 2)))
    assert r[0] == pytest.approx(at2, rel=1e-10)
    limit = math.sqrt(2 * tr / delta)
    assert R.radius_from_moments("chebyshev_ucb", delta, trace=tr, tail_moment=0.0) == pytest.approx(limit, rel=1e-15)
    # Wilson-Hilferty: nu / chi2_{nu; p} ~ 1 + z_{1-p} sqrt(2 / nu); at nu = 1e14 within 2e-7 of the limit
    assert 0 < r[-1] / limit - 1 <= stats.norm.ppf(1 - delta / 2) * math.sqrt(2 / 1e14)
    assert R.radius_from_moments("chebyshev_ucb", delta, trace=tr, tail_moment=100 * tr * tr) == \
        pytest.approx(at2, rel=1e-12)


def test_radius_edge_cases_and_errors():
    f = lambda **kw: R.radius_from_moments("chebyshev_ucb", 0.05, **kw)  # noqa: E731
    assert f(trace=0.0, tail_moment=0.0) == 0.0
    assert f(trace=np.inf, tail_moment=np.inf) == np.inf
    assert f(trace=1.0, tail_moment=np.inf) == np.inf
    assert f(trace=np.inf, tail_moment=1.0) == np.inf
    with pytest.raises(ValueError, match="tail_moment"):
        f(trace=1.0)
    with pytest.raises(ValueError, match="tail_moment must be >= 0"):
        f(trace=1.0, tail_moment=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        f(trace=np.nan, tail_moment=1.0)
    est = R.hajek_attention(np.ones(2), np.ones((3, 2)), np.ones((3, 1)), np.full(3, 0.5))
    by_hand = R.Estimate(est.output, est.weights, est.variance, est.covariance, 1.0, est.lse, est.n_eff)
    assert by_hand.tail_moment is None
    with pytest.raises(ValueError, match="tail_moment"):
        R.certificate(by_hand, kind="chebyshev_ucb")
    assert R.KINDS[-1] == "chebyshev_ucb" and R.KINDS[:4] == ("wald", "chebyshev", "chi2", "bernstein")


@given(attention_case(), st.data(), st.sampled_from([0.1, 0.05, 0.01]))
def test_certificate_on_estimates(case, data, delta):
    """Never NaN; 0 with all pi = 1; +inf on an empty sample; else above sqrt(2) x chebyshev."""
    q, k, v, bias = case
    pi = data.draw(probabilities(k.shape[0]))
    est = R.hajek_attention(q, k, v, pi, bias=bias)
    c = R.certificate(est, delta=delta, kind="chebyshev_ucb")
    cheb = R.certificate(est, delta=delta, kind="chebyshev")
    assert not np.isnan(c.radius) and not np.isnan(c.relative_radius)
    assert c.kind == "chebyshev_ucb" and np.allclose(c.upper - c.lower, 2 * c.radius)
    if est.trace > 0:
        assert c.radius >= math.sqrt(2) * cheb.radius * (1 - 1e-12)
    else:
        assert c.radius == 0.0
    assert R.certificate(R.hajek_attention(q, k, v, np.ones_like(pi), bias=bias), kind="chebyshev_ucb").radius == 0
    assert R.certificate(R.hajek_attention(q, k, v, np.zeros_like(pi)), kind="chebyshev_ucb").radius == np.inf


# ----------------------------------------------------------------------------- coverage


def _concentrated_population(seed):
    """24 tokens: 4 sinks (pi = 1), 17 homogeneous tail tokens (pi = 0.5) and 3 tail tokens at pi = 0.15
    that hold half of the attention with values 3x as spread: the design variance V sits on those 3,
    and in the 61% of draws (0.85^3) that miss all of them the trace sees only the homogeneous rest."""
    rng = np.random.default_rng(seed)
    n, m, d, dv = 24, 3, 8, 2
    q, k, v = rng.normal(size=d), 0.3 * rng.normal(size=(n, d)), rng.normal(size=(n, dv))
    heavy = np.arange(n - m, n)
    rest = np.exp(R.scores(q, k)[: n - m]).sum()
    k[heavy] = q * np.log(rest / m) * math.sqrt(d) / (q @ q)  # each heavy score log(rest / m): half the mass
    v[heavy] = 3.0 * rng.normal(size=(m, dv))
    pi = np.full(n, 0.5)
    pi[:4] = 1.0
    pi[heavy] = 0.15
    w = np.exp(R.scores(q, k))
    assert abs(w[heavy].sum() / w.sum() - 0.5) < 1e-9
    return q, k, v, pi


def test_chebyshev_ucb_covers_where_chebyshev_undercovers():
    """Five such populations, 1000 Poisson draws each, delta = 0.05: chebyshev misses far more than
    delta (pooled coverage below 1 - delta - 4 SE), chebyshev_ucb covers at least 1 - delta - 4 SE in
    every population."""
    delta, reps = 0.05, 1000
    se = math.sqrt(delta * (1 - delta) / reps)
    cheb_hits, ucb_cov = [], []
    for seed in range(5):
        q, k, v, pi = _concentrated_population(seed)
        o = R.attention(q, k, v)
        rng = np.random.default_rng([seed, 1])
        hits = {"chebyshev": 0, "chebyshev_ucb": 0}
        for _ in range(reps):
            keep = R.poisson_sample(pi, generator=rng)
            est = R.hajek_attention(q, k[keep], v[keep], pi[keep])
            for kind in hits:
                hits[kind] += R.covers(R.certificate(est, delta=delta, kind=kind), est, o)
        cheb_hits.append(hits["chebyshev"] / reps)
        ucb_cov.append(hits["chebyshev_ucb"] / reps)
    assert np.mean(cheb_hits) <= 1 - delta - 4 * se / math.sqrt(5), cheb_hits  # the regime: chebyshev fails
    assert min(ucb_cov) >= 1 - delta - 4 * se, ucb_cov
