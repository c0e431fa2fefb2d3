"""kvcert.reference.sketch: the call evict_and_certify (paper and cluster designs) and its memory count.

Exact properties (accounting, composition, limits) are checked exactly.
"""

import numpy as np
import pytest

from kvcert.reference import (
    attention,
    certificate,
    hajek_attention,
    inclusion_probabilities,
    poisson_sample,
)
from kvcert.reference import sketch as sk
from kvcert.reference.sketch import (
    ClusterDesign,
    evict_and_certify,
    memory_fraction,
)


def _head(rng, n=200, d=8, dv=5, heavy=False):
    q = rng.normal(size=d) * (3.0 if heavy else 1.0)
    k = rng.normal(size=(n, d))
    v = rng.normal(size=(n, dv))
    imp = rng.random(n) ** 4
    return q, k, v, imp


def test_memory_fraction_formula():
    n, d, dv = 1000, 64, 48
    assert memory_fraction(n, d, dv, kept=n) == 1.0
    assert memory_fraction(n, d, dv, kept=100) == pytest.approx(100 * (d + dv + 1) / (n * (d + dv)), rel=1e-15)
    want = (100 * (d + dv + 1) + 2161) / (n * (d + dv))
    assert memory_fraction(n, d, dv, kept=100, extra=2161) == pytest.approx(want, rel=1e-15)
    with pytest.raises(ValueError, match="kept"):
        memory_fraction(n, d, dv, kept=n + 1)
    with pytest.raises(ValueError, match="extra"):
        memory_fraction(n, d, dv, kept=1, extra=-1.0)


def test_evict_and_certify_reports_the_memory_it_holds():
    rng = np.random.default_rng(1)
    q, k, v, imp = _head(rng, n=400)
    n, d = k.shape
    dv = v.shape[1]
    design = ClusterDesign(clusters=4)
    for spec in ("paper", design):
        r = evict_and_certify(q, k, v, imp, 150.0, seed=2, design=spec)
        pi = inclusion_probabilities(imp, r.budget)
        keep = poisson_sample(pi, seed=2)
        assert r.kept == keep.sum()
        extra = 0 if spec == "paper" else design.elements(d, dv)
        assert r.memory == memory_fraction(n, d, dv, kept=r.kept, extra=extra)
    paper = evict_and_certify(q, k, v, imp, 150.0, seed=2, design="paper")
    cluster = evict_and_certify(q, k, v, imp, 150.0, seed=2, design=design)
    assert cluster.budget == pytest.approx(150.0 - design.elements(d, dv) / (d + dv + 1), rel=1e-15)
    assert cluster.budget < paper.budget == 150.0


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
    window = rng.normal(size=(5, k.shape[1]))
    a = evict_and_certify(q, k, v, imp, 90.0, seed=4, tilt=window)
    b = evict_and_certify(q, k, v, imp, 90.0, seed=4, design=sk.RECOMMENDED, tilt=window)
    assert np.array_equal(a.output, b.output) and a.radius == b.radius and a.memory == b.memory
    assert a.design == sk.RECOMMENDED == "tilted"
    # the paper's design stays available by name, and differs (it samples more tokens, no sketch)
    p = evict_and_certify(q, k, v, imp, 90.0, seed=4, design="paper", tilt=window)
    assert p.design == "paper" and p.budget == 90.0 > a.budget
    # None without the tilt point tilts at the certified query itself; the tilted design named explicitly needs one
    c = evict_and_certify(q, k, v, imp, 90.0, seed=4)
    d = evict_and_certify(q, k, v, imp, 90.0, seed=4, tilt=q)
    assert c.design == "tilted" and np.array_equal(c.output, d.output) and c.radius == d.radius
    assert c.memory == a.memory and c.radius != a.radius  # same memory, another tilt point
    with pytest.raises(ValueError, match=r"tilt is required by a tilted design"):
        evict_and_certify(q, k, v, imp, 90.0, seed=4, design="tilted")


@pytest.mark.parametrize("design", ["paper", "cluster", ClusterDesign(clusters=4, radius="chebyshev")])
@pytest.mark.parametrize("budget", [300, 300.0, 1e9])
def test_budget_at_least_n_keeps_everything(design, budget):
    rng = np.random.default_rng(9)
    q, k, v, imp = _head(rng, n=300)
    r = evict_and_certify(q, k, v, imp, budget, seed=0, design=design)
    np.testing.assert_allclose(r.output, attention(q, k, v), rtol=1e-13, atol=1e-13)
    assert r.radius == 0.0 and r.memory == 1.0 and r.kept == 300


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
        (dict(design="page"), "design must be"),
        (dict(design="cluster", budget=37.0), "budget .* too small for the cluster design"),
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
