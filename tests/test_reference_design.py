"""The sampling design of kvcert.reference: inclusion probabilities and Poisson sampling."""

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvcert import reference as R
from support import SOLVER_PATHS


@st.composite
def design_case(draw):
    n = draw(st.integers(1, 300))
    sinks = draw(st.integers(0, 8))
    window = draw(st.integers(0, 40))
    top = draw(st.integers(0, 20))
    floor = draw(st.sampled_from([1e-3, 0.1, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    regime = draw(st.sampled_from(["uniform", "peaked", "zeros", "ties"]))
    if regime == "uniform":
        u = rng.random(n)
    elif regime == "peaked":
        u = rng.random(n) ** 8
        u[rng.integers(n)] = 1e3
    elif regime == "zeros":
        u = np.where(rng.random(n) < 0.7, 0.0, rng.random(n))
    else:
        u = np.full(n, 0.25)
    c = int(R.certainty_mask(u, sinks=sinks, window=window, top=top).sum())
    assume(c < n)
    frac = draw(st.one_of(st.just(1.0), st.floats(1e-6, 1.0)))
    budget = c + frac * (n - c)
    return u, budget, dict(sinks=sinks, window=window, top=top, floor=floor)


@given(design_case())
def test_sum_equals_budget_and_range(case):
    u, budget, kw = case
    pi = R.inclusion_probabilities(u, budget, **kw)
    assert pi.shape == u.shape
    assert abs(pi.sum() - budget) <= 1e-9 * max(1.0, budget)
    assert np.all(pi > 0) and np.all(pi <= 1)


@given(design_case())
def test_certainty_set_at_one(case):
    u, budget, kw = case
    pi = R.inclusion_probabilities(u, budget, **kw)
    certain = R.certainty_mask(u, sinks=kw["sinks"], window=kw["window"], top=kw["top"])
    assert np.all(pi[certain] == 1.0)


@given(design_case())
def test_pps_capping_is_exact(case):
    """On the tail, pi = min(1, lam u') for one lam: uncapped ratios pi / u' are
    equal, and every capped token has lam u' >= 1."""
    u, budget, kw = case
    pi = R.inclusion_probabilities(u, budget, **kw)
    certain = R.certainty_mask(u, sinks=kw["sinks"], window=kw["window"], top=kw["top"])
    ut = u[~certain]
    t = ut.size
    share = ut / ut.sum() if ut.sum() > 0 else np.full(t, 1 / t)
    w = (1 - kw["floor"]) * share + kw["floor"] / t
    pt = pi[~certain]
    free = pt < 1
    if free.any():
        lam = pt[free] / w[free]
        assert np.ptp(lam) <= 1e-9 * lam.max()
        assert np.all(lam.max() * w[~free] >= 1 - 1e-9)


def test_capping_example_by_hand():
    # tail weights (floor 1 -> uniform): no cap; with a heavy token the cap binds
    pi = R.inclusion_probabilities(np.array([10.0, 1, 1, 1]), 2.5, sinks=0, window=0, floor=1e-9)
    # lam * 10/13 >= 1 -> capped; the rest share 1.5 equally
    assert pi[0] == 1.0
    np.testing.assert_allclose(pi[1:], 0.5, rtol=1e-8)


def test_budget_n_keeps_everything():
    pi = R.inclusion_probabilities(np.random.default_rng(0).random(50), 50, sinks=2, window=2)
    assert np.all(pi == 1.0)


def test_budget_from_fraction():
    assert R.budget_from_fraction(200, 0.25) == 50.0
    with pytest.raises(ValueError, match="fraction"):
        R.budget_from_fraction(200, 0.0)


@pytest.mark.parametrize(
    "importance, budget, kw, match",
    [
        (np.ones(10), 5, dict(sinks=4, window=1), "certainty set"),
        (np.ones(10), 6, dict(sinks=4, window=2), "certainty set"),  # budget == |C| refused
        (np.ones(10), 11, {}, "budget must be <= n"),
        (np.array([1.0, -1.0, 2.0]), 2, dict(sinks=0, window=0), ">= 0"),
        (np.array([1.0, np.nan, 2.0]), 2, dict(sinks=0, window=0), "finite"),
        (np.array([]), 1, {}, "empty"),
        (np.ones((2, 3)), 1, {}, "shape"),
        (np.ones(10), 8, dict(sinks=1, window=1, floor=0.0), "floor"),
        (np.ones(10), np.nan, {}, "finite"),
    ],
)
def test_inclusion_probabilities_errors(importance, budget, kw, match):
    with pytest.raises(ValueError, match=match):
        R.inclusion_probabilities(importance, budget, **kw)


def test_inclusion_probabilities_type_errors():
    with pytest.raises(TypeError, match="sinks"):
        R.inclusion_probabilities(np.ones(10), 5, sinks=1.5)


def test_certainty_mask_parts():
    u = np.array([0, 0, 9, 0, 5, 0, 0, 0.0])
    m = R.certainty_mask(u, sinks=1, window=2, top=2)
    assert m.tolist() == [True, False, True, False, True, False, True, True]


def test_poisson_sample_uniforms_rule():
    pi = np.array([1.0, 0.0, 0.5, 0.5, 1e-6])
    u = np.array([0.999999, 0.0, 0.49, 0.5, 0.0])
    assert R.poisson_sample(pi, uniforms=u).tolist() == [True, False, True, False, True]


def test_poisson_sample_streams_replay_and_differ():
    pi = np.full(1000, 0.5)
    a = R.poisson_sample(pi, generator=R.design_generator(7, layer=3, kv_head=1, event=0))
    b = R.poisson_sample(pi, uniforms=R.design_uniforms(1000, 7, layer=3, kv_head=1, event=0))
    assert np.array_equal(a, b)
    others = [R.design_uniforms(1000, 7, 3, 2, 0), R.design_uniforms(1000, 7, 4, 1, 0),
              R.design_uniforms(1000, 7, 3, 1, 1), R.design_uniforms(1000, 8, 3, 1, 0)]
    for u in others:
        assert not np.array_equal(a, u < pi)
    assert np.array_equal(R.poisson_sample(pi, seed=5), R.poisson_sample(pi, seed=5))


def test_poisson_sample_size_moments():
    """E|S| = sum pi and Var|S| = sum pi (1 - pi), within 4 standard errors."""
    rng = np.random.default_rng(1)
    pi = R.inclusion_probabilities(rng.random(400) ** 3, 100, sinks=4, window=8)
    reps = 4000
    sizes = np.array([R.poisson_sample(pi, generator=rng).sum() for _ in range(reps)])
    mean, var = pi.sum(), np.sum(pi * (1 - pi))
    assert abs(sizes.mean() - mean) <= 4 * np.sqrt(var / reps)
    # Var of the sample variance ~ (mu4 - var^2)/reps, mu4 ~ 3 var^2 for a near-normal count
    assert abs(sizes.var(ddof=1) - var) <= 4 * np.sqrt(2 * var**2 / reps)


@pytest.mark.parametrize(
    "kw, exc, match",
    [
        (dict(), TypeError, "exactly one"),
        (dict(seed=1, generator=np.random.default_rng(0)), TypeError, "exactly one"),
        (dict(generator=1), TypeError, "Generator"),
        (dict(uniforms=np.zeros(2)), ValueError, "shape"),
        (dict(uniforms=np.ones(3)), ValueError, r"\[0, 1\)"),
    ],
)
def test_poisson_sample_errors(kw, exc, match):
    with pytest.raises(exc, match=match):
        R.poisson_sample(np.full(3, 0.5), **kw)


def test_poisson_sample_bad_pi():
    with pytest.raises(ValueError, match="pi must lie"):
        R.poisson_sample(np.array([0.5, 1.5]), seed=0)
    with pytest.raises(ValueError, match="pi must lie"):
        R.poisson_sample(np.array([0.5, np.nan]), seed=0)
    with pytest.raises(ValueError, match="seed"):
        R.design_generator(-1)


# every path of the solver checks the importance (tests/support.py: SOLVER_PATHS)
_PATHS = SOLVER_PATHS


@pytest.mark.parametrize("n, budget, sinks, window", _PATHS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_inclusion_probabilities_checks_importance_on_every_path(n, budget, sinks, window, bad):
    u = np.random.default_rng(n).random(n)
    u[3] = bad
    with pytest.raises(ValueError, match="importance must be"):
        R.inclusion_probabilities(u, budget, sinks=sinks, window=window)
    with pytest.raises(ValueError, match="importance must be"):
        R.block_inclusion_probabilities(np.repeat(u, 4), budget, block_size=4, sink_blocks=sinks,
                                        recent_blocks=window)
