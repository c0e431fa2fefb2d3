"""Deterministic baselines and the adversary of the impossibility result."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import softmax

from kvcert import reference as R

N, D, DV, W = 64, 8, 4, 8


def _cache(seed=0, n=N):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, D)), rng.normal(size=(n, D)), rng.normal(size=(n, DV))


def _importance(name, queries, keys, values):
    """Each scorer fed as a serving system would (the registry says which queries it reads:
    all of them for H2O, the observation window for SnapKV and TOVA, none for K-norm)."""
    from kvcert.fast import SCORERS

    need = SCORERS[name].queries_read(queries.shape[0], keys.shape[0], W)
    return R.SCORERS[name](queries[-need:], keys, values, seed=0)


def test_registry_twins_the_fast_registry():
    from kvcert.fast import SCORERS

    assert list(R.SCORERS) == list(SCORERS)


@pytest.mark.parametrize("name", sorted(R.SCORERS))
def test_scorer_shape_and_keep_size(name):
    queries, keys, values = _cache()
    u = _importance(name, queries, keys, values)
    assert u.shape == (N,) and np.all(np.isfinite(u))
    keep = R.deterministic_keep(u, 20, sinks=4, window=8)
    assert keep.sum() == 20 and keep[:4].all() and keep[-8:].all()


def test_streaming_llm_keeps_sinks_and_recent():
    keep = R.deterministic_keep(R.streaming_llm_scores(30), 10, sinks=2, window=3)
    assert np.flatnonzero(keep).tolist() == [0, 1] + list(range(22, 30))


def test_h2o_is_causal_column_sum():
    queries, keys, _ = _cache(n=6)
    s = queries @ keys.T / np.sqrt(D)
    s[np.triu_indices(6, 1)] = -np.inf
    np.testing.assert_allclose(R.h2o_scores(queries, keys), softmax(s, axis=1).sum(axis=0), rtol=1e-12)


def test_snapkv_without_pooling_is_window_attention():
    queries, keys, _ = _cache()
    u = R.snapkv_scores(queries[-W:], keys, kernel_size=1)
    # the window's total attention mass is W; keys before the window see all W queries
    assert u.sum() == pytest.approx(W, rel=1e-12)
    s = queries[-W:] @ keys.T / np.sqrt(D)
    s = np.where(np.arange(N)[None] <= np.arange(N - W, N)[:, None], s, -np.inf)
    np.testing.assert_allclose(u, softmax(s, axis=1).sum(axis=0), rtol=1e-12)


def test_snapkv_gqa_is_mean_over_group():
    rng = np.random.default_rng(1)
    qs = rng.normal(size=(3, W, D))
    keys = rng.normal(size=(N, D))
    mean = np.mean([R.snapkv_scores(qs[g], keys) for g in range(3)], axis=0)
    np.testing.assert_allclose(R.snapkv_scores(qs, keys), mean, rtol=1e-12)


def test_knorm_prefers_small_keys():
    keys = np.diag([3.0, 1.0, 2.0])
    assert np.argmax(R.knorm_scores(keys)) == 1


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: R.deterministic_keep(np.ones(10), 3, sinks=2, window=2), ValueError, "budget"),
        (lambda: R.deterministic_keep(np.ones(10), 11), ValueError, "budget"),
        (lambda: R.deterministic_keep(np.ones(10), 5.5, sinks=1, window=1), TypeError, "int"),
        (lambda: R.deterministic_keep(np.array([1.0, np.nan]), 1, sinks=0, window=0), ValueError, "finite"),
        (lambda: R.h2o_scores(np.ones((3, D)), np.ones((4, D))), ValueError, "one query per key"),
        (lambda: R.snapkv_scores(np.ones((5, D)), np.ones((4, D))), ValueError, "longer than the cache"),
        (lambda: R.snapkv_scores(np.ones((2, D)), np.ones((4, D)), kernel_size=2), ValueError, "odd"),
        (lambda: R.tova_scores(np.ones(3), np.ones((4, D))), ValueError, "d = 8"),
        (lambda: R.knorm_scores(np.ones(3)), ValueError, "keys must have shape"),
    ],
)
def test_baseline_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("name", sorted(R.SCORERS))
@pytest.mark.parametrize("target", [0.0, 0.5, 10.0, 1e3])
def test_adversary_for_every_policy(name, target):
    """Retained state bit-identical, the policy picks the same set on the
    modified cache, and the true error equals the requested size."""
    queries, keys, values = _cache(seed=3)
    q = queries[-1]
    keep = R.deterministic_keep(_importance(name, queries, keys, values), 24, sinks=4, window=8)
    adv = R.adversarial_cache(q, keys, values, keep, target_error=target)
    assert np.array_equal(adv.keys[keep], keys[keep]) and np.array_equal(adv.values[keep], values[keep])
    # a policy that decides on keys (and queries) only keeps the same set on the modified cache
    # (the attack is built for those; a value-reading scorer declares reads_values in the registry)
    from kvcert.fast import SCORERS

    if not SCORERS[name].reads_values:
        assert np.array_equal(R.deterministic_keep(_importance(name, queries, adv.keys, adv.values), 24,
                                                   sinks=4, window=8), keep)
    # the policy's estimate cannot change; the truth moved by exactly `target`
    est = R.hajek_attention(q, adv.keys[keep], adv.values[keep], np.ones(int(keep.sum())))
    np.testing.assert_array_equal(est.output, R.attention(q, keys[keep], values[keep]))
    assert est.trace == 0.0  # and it certifies zero error
    assert adv.error == pytest.approx(target, rel=1e-9, abs=1e-9)
    assert np.linalg.norm(est.output - R.attention(q, adv.keys, adv.values)) == pytest.approx(
        target, rel=1e-9, abs=1e-9)


@given(st.integers(0, 2**32 - 1), st.floats(0, 100))
def test_adversary_any_direction(seed, target):
    queries, keys, values = _cache(seed=seed % 1000)
    rng = np.random.default_rng(seed)
    keep = rng.random(N) < 0.5
    keep[0], keep[1] = True, False
    u = rng.normal(size=DV)
    adv = R.adversarial_cache(queries[-1], keys, values, keep, target_error=target, direction=u)
    diff = adv.true_output - adv.retained_output
    assert np.linalg.norm(diff) == pytest.approx(target, rel=1e-9, abs=1e-9)
    if target > 1e-6:
        np.testing.assert_allclose(diff / np.linalg.norm(diff), u / np.linalg.norm(u), atol=1e-7)


def test_adversary_errors():
    queries, keys, values = _cache()
    with pytest.raises(ValueError, match="evict at least one"):
        R.adversarial_cache(queries[0], keys, values, np.ones(N, bool), target_error=1.0)
    with pytest.raises(ValueError, match="bool mask"):
        R.adversarial_cache(queries[0], keys, values, np.ones(N), target_error=1.0)
    keep = np.zeros(N, bool)
    keep[0] = True
    with pytest.raises(ValueError, match="target_error"):
        R.adversarial_cache(queries[0], keys, values, keep, target_error=-1.0)
