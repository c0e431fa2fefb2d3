"""Certificates of kvcert.reference: formulas, and coverage with binomial tolerances."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from kvcert import reference as R
from support import attention_case, probabilities


def _estimate(seed=0, n=40, dv=3):
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=8), rng.normal(size=(n, 8)), rng.normal(size=(n, dv))
    pi = rng.uniform(0.2, 1.0, size=n)
    keep = R.poisson_sample(pi, seed=seed)
    return R.hajek_attention(q, k[keep], v[keep], pi[keep])


def test_chebyshev_and_wald_formulas():
    est = _estimate()
    for delta in (0.1, 0.05, 0.01):
        assert R.certificate(est, delta=delta).radius == pytest.approx(np.sqrt(est.trace / delta), rel=1e-12)
        w = R.certificate(est, delta=delta, kind="wald")
        np.testing.assert_allclose(w.radius, stats.norm.ppf(1 - delta / 2) * np.sqrt(est.variance), rtol=1e-12)
        np.testing.assert_allclose(w.upper - w.lower, 2 * w.radius, rtol=1e-12)


def test_chi2_reduces_to_wald_in_one_dimension():
    est = _estimate(dv=1)
    c = R.certificate(est, kind="chi2", delta=0.05)
    w = R.certificate(est, kind="wald", delta=0.05)
    assert c.radius == pytest.approx(float(w.radius[0]), rel=1e-9)


def test_chi2_isotropic_is_exact_chi2_quantile():
    lam = np.full(5, 0.3)
    r = R.radius_from_moments("chi2", 0.1, trace=lam.sum(), eigenvalues=lam)
    assert r == pytest.approx(np.sqrt(0.3 * stats.chi2.ppf(0.9, 5)), rel=1e-12)


def test_bernstein_without_range_is_gaussian_tail_form():
    r = R.radius_from_moments("bernstein", 0.05, trace=2.0, max_term=0.0)
    assert r == pytest.approx(np.sqrt(2 * 2.0 * np.log(2 / 0.05)), rel=1e-12)
    # the range term only widens it, and r solves 2 exp(-r^2 / (2V + 2Br/3)) = delta
    V, B, d = 2.0, 0.7, 0.05
    r = R.radius_from_moments("bernstein", d, trace=V, max_term=B)
    assert 2 * np.exp(-r * r / (2 * V + 2 * B * r / 3)) == pytest.approx(d, rel=1e-10)


@given(attention_case(), st.data(), st.sampled_from(R.KINDS))
def test_radius_shrinks_with_delta_and_relative_radius(case, data, kind):
    q, k, v, bias = case
    pi = data.draw(probabilities(k.shape[0]))
    est = R.hajek_attention(q, k, v, pi, bias=bias)
    c1 = R.certificate(est, delta=0.1, kind=kind)
    c2 = R.certificate(est, delta=0.01, kind=kind)
    assert np.all(np.asarray(c2.radius) >= np.asarray(c1.radius))
    norm_r = np.linalg.norm(c1.radius)
    if norm_r > 0:
        assert c1.relative_radius == pytest.approx(norm_r / np.linalg.norm(est.output), rel=1e-12)
    else:
        assert c1.relative_radius == 0.0


def test_certificate_errors():
    est = _estimate()
    with pytest.raises(ValueError, match="delta"):
        R.certificate(est, delta=0.0)
    with pytest.raises(ValueError, match="delta"):
        R.certificate(est, delta=1.5)
    with pytest.raises(ValueError, match="kind"):
        R.certificate(est, kind="hoeffding")
    with pytest.raises(TypeError, match="Estimate"):
        R.certificate({"trace": 1.0})


def _coverage(q, k, v, pi, reps, delta, seed):
    """Coverage of each kind over `reps` Poisson draws (wald: per coordinate, averaged)."""
    rng = np.random.default_rng(seed)
    o = R.attention(q, k, v)
    hits = {kind: [] for kind in R.KINDS}
    for _ in range(reps):
        keep = R.poisson_sample(pi, generator=rng)
        est = R.hajek_attention(q, k[keep], v[keep], pi[keep])
        for kind in R.KINDS:
            hits[kind].append(np.mean(R.covers(R.certificate(est, delta=delta, kind=kind), est, o)))
    return {kind: float(np.mean(h)) for kind, h in hits.items()}


def test_coverage_on_well_behaved_population():
    """Flat scores, n = 800, pi around 0.3: every kind covers at least nominal
    minus 4 binomial standard errors; the asymptotically exact kinds (wald,
    chi2) are also within 4 SE above; the conservative ones (chebyshev,
    bernstein) are well above nominal."""
    n, reps, delta = 800, 600, 0.05
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=8), 0.4 * rng.normal(size=(n, 8)), rng.normal(size=(n, 4))
    pi = R.inclusion_probabilities(rng.random(n), 0.3 * n, sinks=4, window=16, floor=0.5)
    cov = _coverage(q, k, v, pi, reps, delta, seed=12)
    se = np.sqrt(delta * (1 - delta) / reps)
    for kind in R.KINDS:
        assert cov[kind] >= 1 - delta - 4 * se, (kind, cov)
    for kind in ("wald", "chi2"):
        assert cov[kind] <= 1 - delta + 4 * se, (kind, cov)
    # Markov/Bernstein are loose by construction: their miscoverage is far below delta
    assert cov["chebyshev"] >= 1 - delta / 2 and cov["bernstein"] >= 1 - delta / 2


def test_wald_undercovers_with_an_unsampled_needle():
    """Documented failure regime (unseen mass): one token carries about half the
    attention but has pi = 0.05. When it is not sampled (95% of draws) neither
    the estimate nor the variance estimate sees it, so the interval misses;
    coverage is then at most about pi_needle plus the rare lucky misses, far
    below 0.95."""
    n, reps = 200, 300
    rng = np.random.default_rng(2)
    q = rng.normal(size=8)
    k = 0.3 * rng.normal(size=(n, 8))
    v = rng.normal(size=(n, 2))
    j = 100
    k[j] = q * np.log(n) * np.sqrt(8) / (q @ q)  # score log(n): about half the mass
    v[j] = 5.0
    w = np.exp(R.scores(q, k))
    assert 0.3 < w[j] / w.sum() < 0.8  # the needle carries a large share
    pi = np.full(n, 0.5)
    pi[:4] = 1.0
    pi[j] = 0.05
    cov = _coverage(q, k, v, pi, reps, 0.05, seed=3)
    assert cov["wald"] <= 0.5, cov
