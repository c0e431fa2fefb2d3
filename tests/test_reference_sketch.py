"""kvcert.reference.sketch: the cluster design (k-means, sketch, V_cl) and the radius-rule registry.

Exact properties only (accounting, limits, reproducibility); tolerances are float64 rounding
of sums of at most a few hundred exponentials (1e-12 relative), not tuned constants. The
design's coverage is measured on the real model, not here (docs/theory.md section 8).
"""

import numpy as np
import pytest
from scipy.special import logsumexp

from kvcert.reference import (
    attention,
    hajek_attention,
    inclusion_probabilities,
    poisson_sample,
    scores,
)
from kvcert.reference import sketch as sk
from kvcert.reference.sketch import (
    RADIUS_RULES,
    ClusterDesign,
    cluster_sketch,
    cluster_variance,
    evict_and_certify,
    kmeans_assign,
    memory_fraction,
    radius_from_variance,
)

RTOL = 1e-12


def _head(rng, n=200, d=8, dv=5, heavy=False):
    q = rng.normal(size=d) * (3.0 if heavy else 1.0)
    k = rng.normal(size=(n, d)) + 0.5 * rng.normal(size=d)
    v = rng.normal(size=(n, dv))
    imp = rng.random(n) ** 4
    return q, k, v, imp


@pytest.mark.parametrize("design", [ClusterDesign(clusters=5), ClusterDesign(clusters=3, tilt=True)])
def test_memory_is_the_formula(design):
    rng = np.random.default_rng(1)
    q, k, v, imp = _head(rng, n=400)
    n, d = k.shape
    dv = v.shape[1]
    tilt = rng.normal(size=(4, d)) if design.tilt else None
    r = evict_and_certify(q, k, v, imp, 150.0, seed=3, design=design, tilt=tilt)
    if design.tilt:
        extra = design.clusters * (4 * d + 4) + d + dv + 1   # + q0 and reach
    else:
        extra = design.clusters * (2 * d + 3) + dv + 1       # + reach (the hull bound)
    b = 150.0 - extra / (d + dv + 1)
    assert r.budget == pytest.approx(b, rel=1e-14)
    pi = inclusion_probabilities(imp, r.budget)
    assert r.kept == poisson_sample(pi, seed=3).sum()
    want = (r.kept * (d + dv + 1) + extra) / (n * (d + dv))
    assert r.memory == pytest.approx(want, rel=1e-14)
    assert r.memory == memory_fraction(n, d, dv, kept=r.kept, extra=extra)


@pytest.mark.parametrize("design", ["cluster", ClusterDesign(clusters=3, radius="chebyshev")])
@pytest.mark.parametrize("budget", [300, 1e9])
def test_nothing_evicted_gives_radius_zero_and_the_exact_output(design, budget):
    rng = np.random.default_rng(9)
    q, k, v, imp = _head(rng, n=300)
    r = evict_and_certify(q, k, v, imp, budget, seed=0, design=design)
    np.testing.assert_allclose(r.output, attention(q, k, v), rtol=1e-13, atol=1e-13)
    assert r.radius == 0.0 and r.memory == 1.0 and r.kept == 300


def test_all_pi_one_gives_zero_variance():
    """Nothing evicted by the sample either: the sketches are empty and every term has 1 - pi = 0."""
    rng = np.random.default_rng(2)
    q, k, v, _ = _head(rng, n=50)
    pi = np.ones(50)
    keep = np.ones(50, bool)
    o = attention(q, k, v)
    assert cluster_variance(q, k, v, pi, cluster_sketch(k, v, pi, keep, ClusterDesign(clusters=4)), output=o) == 0.0


@pytest.mark.parametrize("design", ["cluster", ClusterDesign(clusters=4, radius="fixed", multiplier=2.0)])
def test_seeds_reproduce(design):
    rng = np.random.default_rng(4)
    q, k, v, imp = _head(rng, n=300, d=32, dv=32)
    a = evict_and_certify(q, k, v, imp, 120.0, seed=7, design=design)
    b = evict_and_certify(q, k, v, imp, 120.0, seed=7, design=design)
    c = evict_and_certify(q, k, v, imp, 120.0, seed=8, design=design)
    assert np.array_equal(a.output, b.output) and a.radius == b.radius and a.memory == b.memory
    assert not np.array_equal(a.output, c.output)


def test_cluster_sketch_holds_the_weighted_sums_of_the_evicted_tokens():
    rng = np.random.default_rng(8)
    q, k, v, imp = _head(rng, n=120)
    pi = inclusion_probabilities(imp, 40.0)
    keep = poisson_sample(pi, seed=1)
    labels = kmeans_assign(k, 6)
    sketch = cluster_sketch(k, v, pi, keep, ClusterDesign(clusters=6), labels=labels)
    gone = np.flatnonzero(~keep)
    w = (1 - pi[gone]) / pi[gone]
    nu2 = np.sum((v[gone] - v.mean(0)) ** 2, axis=1)
    used = np.unique(labels[gone])
    for j, c in enumerate(used):
        m = labels[gone] == c
        assert sketch.count[j] == m.sum()
        assert sketch.weight[j] == pytest.approx(w[m].sum(), rel=RTOL)
        assert sketch.wnorm[j] == pytest.approx((w[m] * nu2[m]).sum(), rel=RTOL)
        mean = (w[m, None] * k[gone][m]).sum(0) / w[m].sum()
        np.testing.assert_allclose(sketch.mean[j], mean, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(sketch.var[j], (w[m, None] * (k[gone][m] - mean) ** 2).sum(0) / w[m].sum(),
                                   rtol=1e-10, atol=1e-12)
    assert sketch.count.sum() == gone.size
    # k-means is a deterministic function of the keys
    assert np.array_equal(labels, kmeans_assign(k, 6))


def test_cluster_variance_with_one_token_per_cluster_uses_the_exact_scores():
    """Singleton clusters have zero variance: the Gaussian moment step is exact and V_cl is the hybrid
    variance with exact evicted scores and the orthogonal value rule."""
    rng = np.random.default_rng(10)
    q, k, v, imp = _head(rng, n=90, heavy=True)
    pi = inclusion_probabilities(imp, 50.0)
    keep = poisson_sample(pi, seed=2)
    o = hajek_attention(q, k[keep], v[keep], pi[keep]).output
    sketch = cluster_sketch(k, v, pi, keep, ClusterDesign(clusters=90), labels=np.arange(90))
    # a single token's weighted mean w k / w is k up to 2 eps |k|: its variance is that rounding squared
    assert np.all(sketch.var <= (4 * np.finfo(float).eps * np.abs(k).max()) ** 2)
    got = cluster_variance(q, k[keep], v[keep], pi[keep], sketch, output=o)
    s = scores(q, k)
    mu = v.mean(0)
    ratio = (1 - pi) / pi
    dist = np.where(keep, np.sum((v - o) ** 2, axis=1), np.sum((v - mu) ** 2, axis=1) + np.sum((mu - o) ** 2))
    want = np.exp(logsumexp(2 * s, b=ratio * dist) - 2 * logsumexp(s))
    assert got == pytest.approx(want, rel=1e-11)


def test_evict_and_certify_cluster_is_the_composition():
    rng = np.random.default_rng(11)
    q, k, v, imp = _head(rng, n=300)
    design = ClusterDesign(clusters=4, radius="fixed", multiplier=2.5)
    r = evict_and_certify(q, k, v, imp, 150.0, seed=5, delta=0.1, design=design)
    pi = inclusion_probabilities(imp, r.budget)
    keep = poisson_sample(pi, seed=5)
    est = hajek_attention(q, k[keep], v[keep], pi[keep])
    assert np.array_equal(r.output, est.output)
    var = cluster_variance(q, k[keep], v[keep], pi[keep], cluster_sketch(k, v, pi, keep, design), output=est.output)
    assert r.variance == var and r.radius == 2.5 * np.sqrt(var) and r.design == "cluster"


def test_radius_rules():
    assert tuple(RADIUS_RULES) == ("chebyshev", "gaussian", "fixed")
    assert radius_from_variance(4.0, delta=0.05, rule="chebyshev") == pytest.approx(np.sqrt(80.0), rel=1e-15)
    assert radius_from_variance(4.0, delta=0.05, rule="gaussian") == pytest.approx(2 * 1.959963984540054, rel=1e-12)
    assert radius_from_variance(4.0, delta=0.05, rule="fixed", multiplier=3.0) == 6.0
    assert radius_from_variance(-1.0, delta=0.05, rule="chebyshev") == 0.0
    with pytest.raises(ValueError, match="rule must be one of"):
        radius_from_variance(1.0, delta=0.05, rule="bernstein")


def test_the_radius_rules_are_one_registry_in_both_backends():
    """The design's ``radius`` field is validated against the registry, and the batched backend's registry has
    the same names in the same order, with the same radius (its factor times sqrt(V))."""
    import torch

    from kvcert import fast

    assert tuple(fast.RADIUS_RULES) == tuple(RADIUS_RULES) == fast.CLUSTER_RADII
    for name in RADIUS_RULES:
        ClusterDesign(radius=name)
        want = radius_from_variance(4.0, delta=0.1, rule=name, multiplier=2.5)
        got = fast.cluster_radius(torch.tensor(4.0, dtype=torch.float64), delta=0.1, rule=name, multiplier=2.5)
        assert float(got) == pytest.approx(want, rel=1e-15)


def test_recommended_is_the_tilted_design_with_its_registered_kind():
    """The tilted design met every goal line on the replay cells and the held-out split (docs/theory.md
    section 8): None selects it, and its radius is the kind registered in both backends."""
    import torch

    from kvcert import fast
    from kvcert import reference as R

    assert sk.RECOMMENDED == "tilted" and sk.RECOMMENDED_KIND == "tilted_hull"
    assert set(sk.DESIGNS) == {"paper", "cluster", "tilted"}
    assert sk.RECOMMENDED_KIND in R.CERTIFICATE_KINDS and sk.RECOMMENDED_KIND in fast.CERTIFICATE_KINDS
    assert sk.TILTED.radius == "fixed" and sk.TILTED.multiplier == R.certificates.TILTED_HULL_MULTIPLIER == 3.0
    # the kind is the design's rule, min(3 sqrt(V), H), in both backends; a negative V counts as 0
    for v, h, want in ((4.0, None, 6.0), (4.0, 5.0, 5.0), (4.0, 7.0, 6.0), (-1.0, None, 0.0), (np.inf, 2.0, 2.0)):
        got = R.radius_from_moments("tilted_hull", 0.05, trace=v, bound=h)
        assert got == want
        assert got == min(radius_from_variance(v, delta=0.05, rule="fixed", multiplier=3.0),
                          np.inf if h is None else h)
        ft = fast.radius_from_moments("tilted_hull", 0.05, trace=torch.tensor([v], dtype=torch.float64),
                                      bound=None if h is None else torch.tensor([h], dtype=torch.float64))
        assert float(ft[0]) == want
    # calibrated at delta = 0.05: the multiplier does not move with delta
    assert R.radius_from_moments("tilted_hull", 0.01, trace=4.0) == R.radius_from_moments("tilted_hull", 0.2, trace=4.0)
    with pytest.raises(ValueError, match=r"bound must have the shape of trace \(1,\)"):
        fast.radius_from_moments("tilted_hull", 0.05, trace=torch.ones(1), bound=torch.ones(2))


def test_the_tilted_radius_is_the_registered_kind_with_the_hull_cap():
    """evict_and_certify(design=None) = the tilted design, its radius = radius_from_moments("tilted_hull",
    trace=V_cl, bound=hull_bound) composed by hand; the cap binds (radius < 3 sqrt(V)) on a head whose values
    sit on a small sphere and whose evicted keys make the Gaussian step explode, and never exceeds the bound."""
    from kvcert import reference as R

    rng = np.random.default_rng(12)
    n, d, dv = 400, 16, 8
    k = rng.standard_t(2, size=(n, d)) * 3.0
    v = rng.normal(size=(n, dv))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    u = rng.random(n) ** 3
    window = rng.normal(size=(6, d))
    bound_hit = 0
    for seed in range(6):
        q = 4.0 * rng.normal(size=d)
        r = evict_and_certify(q, k, v, u, 150.0, seed=seed, tilt=window)
        assert r.design == "tilted"
        pi = inclusion_probabilities(u, r.budget)
        keep = poisson_sample(pi, seed=seed)
        est = hajek_attention(q, k[keep], v[keep], pi[keep])
        skt = sk.cluster_sketch(k, v, pi, keep, sk.TILTED, tilt=window)
        cap = sk.hull_bound(v[keep], pi[keep], skt, output=est.output)
        assert r.radius == R.radius_from_moments("tilted_hull", 0.05, trace=r.variance, bound=cap)
        assert r.radius == min(3.0 * np.sqrt(r.variance), cap) and r.radius <= cap
        bound_hit += r.radius < 3.0 * np.sqrt(r.variance)
    assert bound_hit >= 1, "the hull cap never bound: the test does not exercise it"


@pytest.mark.parametrize("kwargs, match", [
    (dict(clusters=0), "clusters must be"), (dict(iterations=-1), "iterations must be"),
    (dict(radius="wald"), "radius must be one of"), (dict(multiplier=0.0), "multiplier must be"),
])
def test_cluster_design_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterDesign(**kwargs)


@pytest.mark.parametrize("design", ["cluster", "tilted"])
def test_too_small_a_budget_names_the_design(design):
    rng = np.random.default_rng(0)
    q, k, v, imp = _head(rng, n=50)
    tilt = rng.normal(size=(3, k.shape[1])) if design == "tilted" else None
    with pytest.raises(ValueError, match=f"too small for the {design} design"):
        evict_and_certify(q, k, v, imp, 40.0, seed=0, design=design, tilt=tilt)
