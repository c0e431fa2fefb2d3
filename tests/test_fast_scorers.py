"""kvcert.fast scorers vs their reference twins, slice by slice (GQA groups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

import kvcert.fast as F
import kvcert.reference as R
from support import assert_close, qk_windows, rounding


def _tol(dtype, n, want):
    # attention probabilities: relative rounding of a length-n softmax (scores O(1) here), summed over w
    return rounding(dtype, n) * (np.abs(want) + 1e-30) * 4


shapes = dict(b=st.integers(1, 2), h_kv=st.integers(1, 2), g=st.sampled_from([1, 3]), d=st.sampled_from([4, 16]),
              seed=st.integers(0, 10**6), dtype=st.sampled_from([torch.float64, torch.float32]))


@given(n=st.integers(1, 130), w=st.integers(1, 12), kernel=st.sampled_from([1, 3, 7]), **shapes)
def test_snapkv_matches_reference(n, w, kernel, b, h_kv, g, d, seed, dtype):
    w = min(w, n)
    q, k = qk_windows(b, h_kv, g, w, n, d, seed, dtype)
    got = F.snapkv_scores(q, k, kernel_size=kernel)
    assert got.shape == (b, h_kv, n)
    for bi in range(b):
        for h in range(h_kv):
            want = R.snapkv_scores(q[bi, h * g:(h + 1) * g].double().numpy(), k[bi, h].double().numpy(),
                                   kernel_size=kernel)
            assert_close("snapkv", got[bi, h].double().numpy(), want, _tol(dtype, n, want) * w)


@given(n=st.integers(1, 90), chunk=st.sampled_from([1, 7, 512]), **shapes)
def test_h2o_matches_reference(n, chunk, b, h_kv, g, d, seed, dtype):
    q, k = qk_windows(b, h_kv, g, n, n, d, seed, dtype)
    got = F.h2o_scores(q, k, chunk=chunk)
    for bi in range(b):
        for h in range(h_kv):
            want = R.h2o_scores(q[bi, h * g:(h + 1) * g].double().numpy(), k[bi, h].double().numpy())
            assert_close("h2o", got[bi, h].double().numpy(), want, _tol(dtype, n, want) * n)


@given(n=st.integers(1, 130), w=st.integers(1, 4), decode=st.booleans(), **shapes)
def test_tova_matches_reference(n, w, decode, b, h_kv, g, d, seed, dtype):
    q, k = qk_windows(b, h_kv, g, w, n, d, seed, dtype)
    got = F.tova_scores(q[:, :, -1] if decode else q, k)
    for bi in range(b):
        for h in range(h_kv):
            want = R.tova_scores(q[bi, h * g:(h + 1) * g].double().numpy(), k[bi, h].double().numpy())
            assert_close("tova", got[bi, h].double().numpy(), want, _tol(dtype, n, want))


@given(n=st.integers(1, 50), **shapes)
def test_knorm_and_streaming_match_reference(n, b, h_kv, g, d, seed, dtype):
    _, k = qk_windows(b, h_kv, g, 1, n, d, seed, dtype)
    kn = F.knorm_scores(k)
    st_ = F.streaming_llm_scores(k)
    assert torch.equal(F.streaming_llm_scores(n), torch.arange(n, dtype=torch.float32))
    for bi in range(b):
        for h in range(h_kv):
            want = R.knorm_scores(k[bi, h].double().numpy())
            assert_close("knorm", kn[bi, h].double().numpy(), want, rounding(dtype, d) * np.abs(want))
            assert np.array_equal(st_[bi, h].numpy(), R.streaming_llm_scores(n))


def test_random_scores_are_uniform_replayable_and_per_head():
    k = torch.zeros(2, 4, 3000, 2)
    u = F.random_scores(k, seed=1, layer=2)
    assert torch.equal(u, F.random_scores(k, seed=1, layer=2))
    assert not torch.equal(u, F.random_scores(k, seed=2, layer=2))
    assert not torch.equal(u[0, 0], u[0, 1])
    assert stats.kstest(u.numpy().ravel(), "uniform").pvalue > 1e-4
    # independent of the sampling stream of the same (seed, layer, event)
    s = F.design_uniforms((2, 4, 3000), 1, layer=2)
    assert abs(np.corrcoef(u.numpy().ravel(), s.numpy().ravel())[0, 1]) < 4 / np.sqrt(u.numel())
    assert F.random_scores(10, seed=0).shape == (10,)


def test_registry_covers_the_reference():
    assert list(F.SCORERS) == list(R.SCORERS)
    for name, scorer in F.SCORERS.items():
        assert scorer.name == name and scorer.press.endswith("Press") and scorer.summary


@pytest.mark.parametrize("name", list(F.SCORERS))
@pytest.mark.parametrize("n", [1, 6, 33, 70, 300])
def test_every_registered_scorer_matches_its_reference_twin(name, n):
    """Called through the one registry signature (as the presses call it), every scorer equals its
    float64 reference twin per (batch row, KV head) on float64 inputs; a random scorer agrees in
    shape and range (its twin draws another stream)."""
    scorer = F.SCORERS[name]
    b, h_kv, g, d, dv, scale = 2, 2, 3, 8, 5, 0.4
    w = max(scorer.queries_needed(n, 4), 1)
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(b, h_kv * g, w, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, h_kv, n, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, n, dv, generator=gen, dtype=torch.float64)
    params = {p: {"kernel_size": 3, "seed": 1}.get(p, default) for p, default in scorer.params.items()}
    u = scorer(q, k, v, scale=scale, **params)
    assert u.shape == (b, h_kv, n) and u.dtype == torch.float64 and bool(torch.isfinite(u).all())
    for r in range(b):
        for h in range(h_kv):
            ref = R.SCORERS[name](q[r, h * g:(h + 1) * g].numpy(), k[r, h].numpy(), v[r, h].numpy(),
                                  scale=scale, **params)
            assert ref.shape == (n,)
            if scorer.random:
                assert (0 <= ref).all() and (ref < 1).all() and bool(((0 <= u) & (u < 1)).all())
            else:  # float64 on both sides: rounding of sums over at most n * w terms
                np.testing.assert_allclose(u[r, h].numpy(), ref, rtol=1e-9, atol=1e-12)
    if not scorer.random:  # the twin's defaults are the registry's: called with none, they agree too
        u0 = scorer(q, k, v, scale=scale)
        ref0 = R.SCORERS[name](q[0, :g].numpy(), k[0, 0].numpy(), v[0, 0].numpy(), scale=scale)
        np.testing.assert_allclose(u0[0, 0].numpy(), ref0, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("call, exc, words", [
    (lambda q, k: F.snapkv_scores(q, k, kernel_size=4), ValueError, "kernel_size must be a positive odd int"),
    (lambda q, k: F.snapkv_scores(q[:, :, :, :3], k), ValueError, "queries must have shape"),
    (lambda q, k: F.snapkv_scores(q[:, :1].expand(1, 5, 4, 8), k), ValueError, "multiple of h_kv"),
    (lambda q, k: F.snapkv_scores(q.repeat(1, 1, 5, 1), k), ValueError, "longer than the cache"),
    (lambda q, k: F.h2o_scores(q, k), ValueError, "one query per key position"),
    (lambda q, k: F.knorm_scores(k[0]), ValueError, "keys must be 4-d"),
    (lambda q, k: F.knorm_scores(k[:, :, :0]), ValueError, "n >= 1"),
    (lambda q, k: F.tova_scores(q.numpy(), k), TypeError, "torch.Tensor"),
    (lambda q, k: F.streaming_llm_scores(0), ValueError, "n must be >= 1"),
    (lambda q, k: F.random_scores(5, seed=-1), ValueError, "seed must be >= 0"),
])
def test_scorer_errors(call, exc, words):
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 10, 8)
    with pytest.raises(exc) as e:
        call(q, k)
    assert words in str(e.value)
