"""kvcert.reference.sketch: the page-sketch design of issue 14 and the contract call evict_and_certify.

Exact properties (bounds, accounting, composition) are checked exactly; the one
statistical claim (the page design's Chebyshev radius covers at >= 1 - delta)
with a tolerance of 3 binomial standard errors.
"""

import numpy as np
import pytest

from kvcert.reference import (
    attention,
    certificate,
    hajek_attention,
    inclusion_probabilities,
    linearized_variance,
    poisson_sample,
    scores,
)
from kvcert.reference import sketch as sk
from kvcert.reference.sketch import (
    SketchDesign,
    evict_and_certify,
    memory_fraction,
    page_score_bounds,
    page_sketch,
    sketch_budget,
    sketch_pages,
    variance_bound,
)
from kvcert.reference.design import certainty_mask


def _head(rng, n=200, d=8, dv=5, heavy=False):
    q = rng.normal(size=d) * (3.0 if heavy else 1.0)
    k = rng.normal(size=(n, d))
    v = rng.normal(size=(n, dv))
    imp = rng.random(n) ** 4
    return q, k, v, imp


@pytest.mark.parametrize("page_size", [1, 3, 16, 113])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_page_bounds_contain_every_evicted_score(page_size, scale):
    rng = np.random.default_rng(page_size)
    q, k, v, imp = _head(rng, n=239, heavy=True)
    pi = inclusion_probabilities(imp, 60.0)
    keep = poisson_sample(pi, seed=3)
    sketch = page_sketch(k, v, pi, keep, page_size=page_size)
    lo, up = page_score_bounds(q, sketch, scale=scale)
    s = scores(q, k, scale=scale)
    gone = np.flatnonzero(~keep)
    g = np.searchsorted(sketch.pages, gone // page_size)
    assert np.array_equal(sketch.pages[g], gone // page_size)  # every evicted token has its page
    assert np.all(s[gone] <= up[g] + 1e-12 * np.abs(up[g])), np.max(s[gone] - up[g])
    assert np.all(s[gone] >= lo[g] - 1e-12 * np.abs(lo[g])), np.max(lo[g] - s[gone])
    # the page statistics are those of the evicted tokens only
    assert sketch.unseen.sum() == gone.size
    assert np.all(sketch.min_pi[g] <= pi[gone])
    assert np.all(np.linalg.norm(v[gone] - sketch.mu, axis=1) <= sketch.value_radius[g] + 1e-12)
    if page_size == 1:  # one token per page: the bounds are the score itself
        np.testing.assert_allclose(up[g], s[gone], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lo[g], s[gone], rtol=1e-12, atol=1e-12)


def test_variance_bound_dominates_the_true_design_variance_for_every_sample():
    """With the true o as plug-in, V_bar >= V = tr linearized_variance for every sample (proven)."""
    rng = np.random.default_rng(5)
    q, k, v, imp = _head(rng, n=150, heavy=True)
    pi = inclusion_probabilities(imp, 40.0)
    o = attention(q, k, v)
    V = np.trace(linearized_variance(q, k, v, pi))
    for seed in range(40):
        keep = poisson_sample(pi, seed=seed)
        for P in (1, 8):
            sketch = page_sketch(k, v, pi, keep, page_size=P)
            vbar = variance_bound(q, k[keep], v[keep], pi[keep], sketch, output=o)
            assert vbar >= V * (1 - 1e-12), (seed, P, vbar, V)


def test_memory_fraction_formula():
    n, d, dv = 1000, 64, 48
    assert memory_fraction(n, d, dv, kept=n) == 1.0
    assert memory_fraction(n, d, dv, kept=100) == pytest.approx(100 * (d + dv + 1) / (n * (d + dv)), rel=1e-15)
    want = (100 * (d + dv + 1) + 30 * (2 * d + 3) + dv) / (n * (d + dv))
    assert memory_fraction(n, d, dv, kept=100, pages=30) == pytest.approx(want, rel=1e-15)
    with pytest.raises(ValueError, match="kept"):
        memory_fraction(n, d, dv, kept=n + 1)
    with pytest.raises(ValueError, match="pages"):
        memory_fraction(n, d, dv, kept=1, pages=-1)


def test_sketch_budget_gives_equal_expected_memory():
    n, d, dv, B, G = 1000, 64, 64, 300.0, 60
    b = sketch_budget(B, n, d, dv, pages=G)
    assert b * (d + dv + 1) + G * (2 * d + 3) + dv == pytest.approx(B * (d + dv + 1), rel=1e-14)


def test_evict_and_certify_reports_the_memory_it_holds():
    rng = np.random.default_rng(1)
    q, k, v, imp = _head(rng, n=400)
    n, d = k.shape
    dv = v.shape[1]
    for design in ("paper", SketchDesign(page_size=16)):
        r = evict_and_certify(q, k, v, imp, 150.0, seed=2, design=design)
        pi = inclusion_probabilities(imp, r.budget)
        keep = poisson_sample(pi, seed=2)
        assert r.kept == keep.sum()
        pages = 0 if design == "paper" else page_sketch(k, v, pi, keep, page_size=16).pages.size
        assert r.memory == memory_fraction(n, d, dv, kept=r.kept, pages=pages)
    paper = evict_and_certify(q, k, v, imp, 150.0, seed=2, design="paper")
    page = evict_and_certify(q, k, v, imp, 150.0, seed=2, design="page")
    reserved = sketch_pages(certainty_mask(imp), 16)
    assert page.budget == pytest.approx(sketch_budget(150.0, n, d, dv, pages=reserved), rel=1e-15)
    assert page.budget < paper.budget == 150.0


def test_paper_design_is_the_composition_of_the_reference_functions():
    rng = np.random.default_rng(7)
    q, k, v, imp = _head(rng, n=300)
    for seed in (0, 11):
        r = evict_and_certify(q, k, v, imp, 90.0, seed=seed, delta=0.1, design="paper")
        pi = inclusion_probabilities(imp, 90.0)
        keep = poisson_sample(pi, seed=seed)
        est = hajek_attention(q, k[keep], v[keep], pi[keep])
        cert = certificate(est, delta=0.1, kind="chebyshev")
        assert np.array_equal(r.output, est.output)
        assert r.radius == cert.radius
        assert r.variance == est.trace


def test_design_none_is_the_documented_recommendation():
    rng = np.random.default_rng(8)
    q, k, v, imp = _head(rng, n=300)
    a = evict_and_certify(q, k, v, imp, 90.0, seed=4)
    b = evict_and_certify(q, k, v, imp, 90.0, seed=4, design=sk.RECOMMENDED)
    assert np.array_equal(a.output, b.output) and a.radius == b.radius and a.memory == b.memory
    assert a.design == sk.RECOMMENDED


@pytest.mark.parametrize("design", ["paper", "page", SketchDesign(page_size=4, radius="gaussian")])
@pytest.mark.parametrize("budget", [300, 300.0, 1e9])
def test_budget_at_least_n_keeps_everything(design, budget):
    rng = np.random.default_rng(9)
    q, k, v, imp = _head(rng, n=300)
    r = evict_and_certify(q, k, v, imp, budget, seed=0, design=design)
    np.testing.assert_allclose(r.output, attention(q, k, v), rtol=1e-13, atol=1e-13)
    assert r.radius == 0.0 and r.memory == 1.0 and r.kept == 300


def test_page_design_uses_the_same_estimator_on_its_own_sample():
    rng = np.random.default_rng(10)
    q, k, v, imp = _head(rng, n=300)
    r = evict_and_certify(q, k, v, imp, 150.0, seed=5, design=SketchDesign(page_size=8, radius="gaussian"))
    pi = inclusion_probabilities(imp, r.budget)
    keep = poisson_sample(pi, seed=5)
    est = hajek_attention(q, k[keep], v[keep], pi[keep])
    assert np.array_equal(r.output, est.output)
    vbar = variance_bound(q, k[keep], v[keep], pi[keep], page_sketch(k, v, pi, keep, page_size=8),
                          output=est.output)
    assert r.variance == vbar
    assert r.radius == pytest.approx(1.959963984540054 * np.sqrt(vbar), rel=1e-12)


def test_page_chebyshev_covers_on_a_heavy_tailed_needle_cell():
    """P(||o_hat - o|| <= sqrt(V_bar / delta)) >= 1 - delta; tolerance 3 binomial s.e. at N draws.

    A heavy-tailed head (scores x3) with one low-importance needle (future score 3 ||q|| tau, value far
    from the rest). The paper design misses it (its documented unseen-mass failure, docs/theory.md
    section 6), so the same check on it must fail: the cell discriminates.
    """
    rng = np.random.default_rng(12)
    n, d, dv = 256, 8, 4
    q, k, v, imp = _head(rng, n=n, d=d, dv=dv, heavy=True)
    k[100] = 3.0 * q / np.linalg.norm(q)  # large future score
    v[100] = 10.0
    imp[100] = 0.0  # the scorer rates it at the floor
    o = attention(q, k, v)
    delta, N = 0.05, 400
    se = np.sqrt(delta * (1 - delta) / N)

    def coverage(design):
        hits = [np.linalg.norm((r := evict_and_certify(q, k, v, imp, 80.0, seed=s, delta=delta,
                                                       design=design)).output - o) <= r.radius
                for s in range(N)]
        return float(np.mean(hits))

    page = coverage(SketchDesign(page_size=8))
    assert page >= 1 - delta - 3 * se, page
    paper = coverage("paper")
    assert paper < 1 - delta - 3 * se, paper


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(q=np.zeros((2, 8))), "q must have shape"),
        (dict(keys=np.zeros((50, 7))), "keys must have shape"),
        (dict(values=np.zeros((49, 5))), "values must have shape"),
        (dict(importance=np.ones(49)), "importance must have shape"),
        (dict(delta=0.0), "delta must be in"),
        (dict(delta=1.5), "delta must be in"),
        (dict(budget=0.0), "budget must be"),
        (dict(budget=np.nan), "budget must be"),
        (dict(design="quest"), "design must be"),
        (dict(design="page", budget=37.0), "budget .* too small for the page design"),
    ],
)
def test_bad_inputs_name_the_argument(kwargs, match):
    rng = np.random.default_rng(0)
    q, k, v, imp = _head(rng, n=50)
    args = dict(q=q, keys=k, values=v, importance=imp, budget=40.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        evict_and_certify(args.pop("q"), args.pop("keys"), args.pop("values"), args.pop("importance"),
                          args.pop("budget"), seed=0, **args)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_sketch_design_validates_page_size(bad):
    with pytest.raises(ValueError, match="page_size"):
        SketchDesign(page_size=bad)


def test_sketch_design_validates_radius():
    with pytest.raises(ValueError, match="radius must be one of"):
        SketchDesign(radius="bernstein")


def test_page_sketch_refuses_an_evicted_token_with_zero_pi():
    rng = np.random.default_rng(0)
    _, k, v, _ = _head(rng, n=20)
    pi = np.full(20, 0.5)
    pi[3] = 0.0
    keep = np.ones(20, bool)
    keep[3] = False
    with pytest.raises(ValueError, match="pi must be > 0"):
        page_sketch(k, v, pi, keep, page_size=4)
