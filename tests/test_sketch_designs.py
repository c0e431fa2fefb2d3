"""kvcert.reference.sketch, second slice of issue 14: the cluster and code designs.

Exact properties only (accounting, limits, bounds, reproducibility); tolerances are
float64 rounding of sums of at most a few hundred exponentials (1e-12 relative), not
tuned constants. The designs' coverage is measured on the real model, not here
(docs/research/issue14/RESULTS_T2.md).
"""

import numpy as np
import pytest
from scipy.special import logsumexp

from kvcert.reference import (
    attention,
    hajek_attention,
    inclusion_probabilities,
    linearized_variance,
    poisson_sample,
    scores,
)
from kvcert.reference import sketch as sk
from kvcert.reference.sketch import (
    ClusterDesign,
    CodeDesign,
    cluster_sketch,
    cluster_variance,
    code_budget,
    code_scores,
    code_sketch,
    evict_and_certify,
    hybrid_variance,
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


def _true_v(q, k, v, pi, o):
    """V = sum_i (1 - pi_i)/pi_i w_i^2 ||v_i - o||^2 / Z^2 over all tokens (the design variance's trace)."""
    s = scores(q, k)
    w = np.exp(s - s.max())
    return float(np.sum((1 - pi) / pi * w ** 2 * np.sum((v - o) ** 2, axis=1)) / w.sum() ** 2)


@pytest.mark.parametrize("design", [ClusterDesign(clusters=5), CodeDesign(rank=3, bits=4),
                                    CodeDesign(rank=2, bits=2, score="plain")])
def test_memory_is_the_formula(design):
    rng = np.random.default_rng(1)
    q, k, v, imp = _head(rng, n=400)
    n, d = k.shape
    dv = v.shape[1]
    r = evict_and_certify(q, k, v, imp, 150.0, seed=3, design=design)
    if isinstance(design, ClusterDesign):
        extra = design.clusters * (2 * d + 3) + dv + 1     # + reach (the hull bound)
        b = 150.0 - extra / (d + dv + 1)
    else:
        scalars = 2 + (design.score != "plain")
        c = (design.rank * design.bits + 16 * scalars) / 16.0
        h = design.rank * d + d + 2 * design.rank + dv
        extra = (n - r.kept) * c + h
        b = (150.0 * (d + dv + 1) - c * n - h) / (d + dv + 1 - c)
        assert design.token_bits(dv) == 16 * c
    assert r.budget == pytest.approx(b, rel=1e-14)
    pi = inclusion_probabilities(imp, r.budget)
    assert r.kept == poisson_sample(pi, seed=3).sum()
    want = (r.kept * (d + dv + 1) + extra) / (n * (d + dv))
    assert r.memory == pytest.approx(want, rel=1e-14)
    assert r.memory == memory_fraction(n, d, dv, kept=r.kept, extra=extra)


def test_code_budget_gives_equal_expected_memory():
    n, d, dv, B = 1000, 64, 64, 300.0
    design = CodeDesign(rank=4, bits=4)
    b = code_budget(B, n, d, dv, design)
    c = design.token_bits(dv) / 16.0
    assert b * (d + dv + 1) + (n - b) * c + design.head_elements(d, dv) == pytest.approx(B * (d + dv + 1), rel=1e-14)


@pytest.mark.parametrize("design", ["cluster", "code", ClusterDesign(clusters=3, radius="chebyshev"),
                                    CodeDesign(score="bound", value="triangle", radius="gaussian")])
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
    assert hybrid_variance(q, k, v, pi, code_sketch(k, v, pi, keep, CodeDesign()), output=o) == 0.0


@pytest.mark.parametrize("design", ["cluster", "code", CodeDesign(rank=8, bits=None, score="bound", value="triangle")])
def test_seeds_reproduce(design):
    rng = np.random.default_rng(4)
    q, k, v, imp = _head(rng, n=300, d=32, dv=32)
    a = evict_and_certify(q, k, v, imp, 120.0, seed=7, design=design)
    b = evict_and_certify(q, k, v, imp, 120.0, seed=7, design=design)
    c = evict_and_certify(q, k, v, imp, 120.0, seed=8, design=design)
    assert np.array_equal(a.output, b.output) and a.radius == b.radius and a.memory == b.memory
    assert not np.array_equal(a.output, c.output)


def test_hybrid_variance_is_v_when_the_sketch_is_lossless():
    """r = d, unquantized codes, exact values, true o: V_hybrid = V for every sample (the target is V itself)."""
    rng = np.random.default_rng(5)
    q, k, v, imp = _head(rng, n=150, heavy=True)
    pi = inclusion_probabilities(imp, 40.0)
    o = attention(q, k, v)
    V = _true_v(q, k, v, pi, o)
    assert V == pytest.approx(np.trace(linearized_variance(q, k, v, pi)), rel=1e-10)
    design = CodeDesign(rank=k.shape[1], bits=None, score="plain", value="exact")
    for seed in range(20):
        keep = poisson_sample(pi, seed=seed)
        sketch = code_sketch(k, v, pi, keep, design)
        np.testing.assert_allclose(code_scores(q, sketch)["shat"], scores(q, k[~keep]), rtol=1e-10, atol=1e-12)
        vh = hybrid_variance(q, k[keep], v[keep], pi[keep], sketch, output=o)
        assert vh == pytest.approx(V, rel=1e-9), (seed, vh, V)


@pytest.mark.parametrize("rank, bits", [(1, 2), (3, 4), (8, 16), (8, None)])
def test_bound_rule_dominates_v_for_every_sample(rank, bits):
    """score = bound, value = triangle, true o: V_hybrid >= V for every sample (proven, as variance_bound)."""
    rng = np.random.default_rng(6)
    q, k, v, imp = _head(rng, n=150, heavy=True)
    pi = inclusion_probabilities(imp, 40.0)
    o = attention(q, k, v)
    V = _true_v(q, k, v, pi, o)
    design = CodeDesign(rank=rank, bits=bits, score="bound", value="triangle")
    for seed in range(30):
        keep = poisson_sample(pi, seed=seed)
        sketch = code_sketch(k, v, pi, keep, design)
        sc = code_scores(q, sketch)
        s = scores(q, k[~keep])
        assert np.all(sc["first"] <= s + RTOL * np.abs(s)) and np.all(s <= sc["square"] + RTOL * np.abs(s))
        assert hybrid_variance(q, k[keep], v[keep], pi[keep], sketch, output=o) >= V * (1 - RTOL)


def test_code_quantization_error_is_within_half_a_step():
    rng = np.random.default_rng(7)
    _, k, v, _ = _head(rng, n=239, d=16)
    pi = np.full(239, 0.3)
    keep = np.zeros(239, bool)
    for bits in (1, 3, 8):
        sketch = code_sketch(k, v, pi, keep, CodeDesign(rank=5, bits=bits))
        c = (k - sketch.mean_key) @ sketch.basis
        assert np.all(np.abs(c - sketch.codes) <= sketch.step / 2 * (1 + 1e-12) + 1e-12)
        np.testing.assert_allclose(sketch.basis.T @ sketch.basis, np.eye(5), atol=1e-12)


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
    assert radius_from_variance(4.0, delta=0.05, rule="chebyshev") == pytest.approx(np.sqrt(80.0), rel=1e-15)
    assert radius_from_variance(4.0, delta=0.05, rule="gaussian") == pytest.approx(2 * 1.959963984540054, rel=1e-12)
    assert radius_from_variance(4.0, delta=0.05, rule="fixed", multiplier=3.0) == 6.0
    with pytest.raises(ValueError, match="rule must be one of"):
        radius_from_variance(1.0, delta=0.05, rule="bernstein")


def test_recommended_stays_paper():
    """No sketched design meets every goal line on the real cells (RESULTS_T2.md): None is the paper design."""
    assert sk.RECOMMENDED == "paper"
    assert set(sk.DESIGNS) == {"paper", "page", "cluster", "tilted", "code"}


@pytest.mark.parametrize("kwargs, match", [
    (dict(clusters=0), "clusters must be"), (dict(iterations=-1), "iterations must be"),
    (dict(radius="wald"), "radius must be one of"), (dict(multiplier=0.0), "multiplier must be"),
])
def test_cluster_design_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterDesign(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank must be"), (dict(bits=17), "bits must be"), (dict(bits=True), "bits must be"),
    (dict(score="max"), "score must be one of"), (dict(value="l1"), "value must be one of"),
    (dict(radius="wald"), "radius must be one of"),
])
def test_code_design_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodeDesign(**kwargs)


@pytest.mark.parametrize("design", ["cluster", "code"])
def test_too_small_a_budget_names_the_design(design):
    rng = np.random.default_rng(0)
    q, k, v, imp = _head(rng, n=50)
    with pytest.raises(ValueError, match=f"too small for the {design} design"):
        evict_and_certify(q, k, v, imp, 40.0, seed=0, design=design)
