"""kvcert.fast design: inclusion probabilities and Poisson sampling vs the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy import stats

import kvcert.fast as F
import kvcert.reference as R
from support import GOLDEN, MASK64, SOLVER_PATHS, TILE_N, assert_close, splitmix64_py


def py_uniform(seed, layer, batch, head, event, i) -> float:
    """The stream of the kvcert.fast.design docstring, written out with Python ints."""
    k = splitmix64_py(seed + GOLDEN)
    for part in (layer, batch, head, event):
        k = splitmix64_py((k ^ part) + GOLDEN)
    return (splitmix64_py(k + (i + 1) * GOLDEN) >> 11) * 2.0**-53


# ---------------------------------------------------------------------------
# random stream
# ---------------------------------------------------------------------------


@given(st.lists(st.integers(0, MASK64), min_size=1, max_size=64))
def test_splitmix64_matches_python_ints(words):
    x = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w for w in words], dtype=torch.int64)
    got = [int(z) & MASK64 for z in F.splitmix64(x)]
    assert got == [splitmix64_py(w) for w in words]


@given(seed=st.integers(0, 2**40), layer=st.integers(0, 80), event=st.integers(0, 9),
       shape=st.sampled_from([(5,), (3, 4), (2, 3, 6)]))
def test_design_uniforms_follow_the_documented_stream(seed, layer, event, shape):
    u = F.design_uniforms(shape, seed, layer=layer, event=event)
    assert u.dtype == torch.float64 and u.shape == shape
    flat = u.reshape(-1, shape[-2] if len(shape) > 1 else 1, shape[-1])
    for b in range(flat.shape[0]):
        for h in range(flat.shape[1]):
            for i in range(shape[-1]):
                assert float(flat[b, h, i]) == py_uniform(seed, layer, b, h, event, i)


def test_design_uniforms_index_and_replay():
    u = F.design_uniforms((2, 3, 10), 7, layer=1, event=2)
    assert torch.equal(u, F.design_uniforms((2, 3, 10), 7, layer=1, event=2))  # replayable
    idx = torch.arange(10).flip(0).expand(2, 3, 10).contiguous()
    assert torch.equal(F.design_uniforms((2, 3, 10), 7, layer=1, event=2, index=idx), u.flip(-1))
    others = [F.design_uniforms((2, 3, 10), 8, layer=1, event=2), F.design_uniforms((2, 3, 10), 7, layer=2, event=2),
              F.design_uniforms((2, 3, 10), 7, layer=1, event=3)]
    for o in others:
        assert not torch.equal(o, u)
    # heads and batch rows draw different streams
    assert not torch.equal(u[0, 0], u[0, 1]) and not torch.equal(u[0, 0], u[1, 0])


@pytest.mark.parametrize("row_streams", [True, False])
def test_head_offset_draws_the_slice_of_the_whole_layer(row_streams):
    """A tensor-parallel rank holding KV heads o .. o + h1 - 1 draws what the whole layer draws there
    (uniforms and systematic starts); negative control: offset 0 is the layer's first heads, not these."""
    full = F.design_uniforms((2, 6, 9), 11, layer=4, event=1, row_streams=row_streams)
    starts = F.start_uniforms((2, 6), 11, layer=4, event=1, row_streams=row_streams)
    for o, h1 in ((0, 3), (3, 3), (2, 1), (5, 1)):
        part = F.design_uniforms((2, h1, 9), 11, layer=4, event=1, row_streams=row_streams, head_offset=o)
        assert torch.equal(part, full[:, o : o + h1])
        s = F.start_uniforms((2, h1), 11, layer=4, event=1, row_streams=row_streams, head_offset=o)
        assert torch.equal(s, starts[:, o : o + h1])
    assert not torch.equal(F.design_uniforms((2, 3, 9), 11, layer=4, event=1, row_streams=row_streams),
                           full[:, 3:6])
    with pytest.raises(ValueError, match="head_offset"):
        F.design_uniforms((3, 9), 11, head_offset=-1)


@pytest.mark.parametrize("sampling", ["poisson", "systematic"])
@pytest.mark.parametrize("per_head", [False, True])
def test_token_design_decides_a_slice_of_heads_as_the_whole_layer(sampling, per_head):
    """TokenDesign.decide on heads o .. o + h1 - 1 with head_offset=o keeps and weighs what deciding all the
    layer's heads keeps there (a tensor-parallel rank's decision, kvcert.vllm)."""
    torch.manual_seed(0)
    scores = torch.rand(4, 200, dtype=torch.float64) ** 3
    design = F.TokenDesign(compression_ratio=0.5, seed=3, sampling=sampling)
    budget = torch.tensor([60.0, 90.0, 120.0, 200.0], dtype=torch.float64) if per_head else None
    whole = design.decide(scores, layer=2, budget=budget)
    for o in (0, 2):
        part = design.decide(scores[o : o + 2], layer=2, head_offset=o,
                             budget=None if budget is None else budget[o : o + 2])
        assert torch.equal(part.keep, whole.keep[o : o + 2]) and torch.equal(part.pi, whole.pi[o : o + 2])
    shifted = design.decide(scores[2:4], layer=2, budget=None if budget is None else budget[2:4])
    assert not torch.equal(shifted.keep, whole.keep[2:4])  # negative control: offset 0 draws heads 0-1's


def test_design_uniforms_are_uniform_and_uncorrelated():
    # KS test at level 1e-4 (deterministic: the stream is fixed), 4 x 8 x 4096 draws
    u = F.design_uniforms((4, 8, 4096), 123, layer=3).numpy()
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u.ravel(), "uniform").pvalue > 1e-4
    # neighbouring heads/rows/tokens: correlation within 4 standard errors of 0
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u[..., :-1], u[..., 1:])):
        r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(r) < 4.0 / np.sqrt(a.size), r  # sample correlation of independent pairs: se 1/sqrt(N)


@given(n=st.sampled_from(TILE_N), seed=st.integers(0, 10**6), layer=st.integers(0, 30),
       event=st.integers(0, 5), f32=st.booleans(), data=st.data())
def test_poisson_sample_equals_reference_under_shared_uniforms(n, seed, layer, event, f32, data):
    b, h = 2, 3
    rng = np.random.default_rng(seed)
    p = rng.uniform(0, 1, size=(b, h, n))
    p[rng.random((b, h, n)) < 0.2] = 1.0
    p[rng.random((b, h, n)) < 0.1] = 0.0
    p[rng.random((b, h, n)) < 0.1] = 1e-6
    pi = torch.from_numpy(p).to(torch.float32 if f32 else torch.float64)
    U = np.stack([np.stack([R.design_uniforms(n, seed, layer, hh, event) for hh in range(h)]) for _ in range(b)])
    got = F.poisson_sample(pi, uniforms=torch.from_numpy(U))
    for bi in range(b):
        for hh in range(h):
            want = R.poisson_sample(pi[bi, hh].numpy(), uniforms=U[bi, hh])
            assert np.array_equal(got[bi, hh].numpy(), want)


def test_poisson_sample_streams_and_generator():
    pi = torch.full((2, 4, 300), 0.5)
    a = F.poisson_sample(pi, seed=1, layer=2, event=0)
    assert torch.equal(a, F.poisson_sample(pi, seed=1, layer=2, event=0))
    assert not torch.equal(a, F.poisson_sample(pi, seed=1, layer=2, event=1))
    assert torch.equal(a, F.design_uniforms((2, 4, 300), 1, layer=2) < 0.5)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(F.poisson_sample(pi, generator=g1), F.poisson_sample(pi, generator=g2))
    one = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert F.poisson_sample(one, seed=0).tolist() == [False, True, True, False]


def test_poisson_sample_size_moments():
    # |S| over 2000 independent heads: mean sum(pi) within 4 standard errors
    rng = np.random.default_rng(0)
    p = torch.from_numpy(rng.uniform(0.05, 1.0, size=60))
    pi = p.expand(2000, 60).contiguous()
    sizes = F.poisson_sample(pi.reshape(1, 2000, 60), seed=3).sum(-1).double()
    mean, var = float(p.sum()), float((p * (1 - p)).sum())
    assert abs(float(sizes.mean()) - mean) <= 4 * np.sqrt(var / 2000)
    assert abs(float(sizes.var()) / var - 1.0) <= 4 * np.sqrt(2.0 / 1999)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(), TypeError, "exactly one"),
    (dict(seed=1, uniforms=torch.zeros(3)), TypeError, "exactly one"),
    (dict(uniforms=torch.zeros(4)), ValueError, "uniforms must have shape"),
    (dict(uniforms=torch.ones(3)), ValueError, "[0, 1)"),
    (dict(generator=np.random.default_rng(0)), TypeError, "torch.Generator"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
])
def test_poisson_sample_errors(kw, exc, words):
    with pytest.raises(exc, match=None) as e:
        F.poisson_sample(torch.full((3,), 0.5), **kw)
    assert words in str(e.value)


@pytest.mark.parametrize("bad", [torch.tensor([0.5, 1.5]), torch.tensor([0.5, float("nan")]),
                                 torch.tensor([-0.1, 0.2])])
def test_poisson_sample_rejects_bad_pi(bad):
    with pytest.raises(ValueError, match="pi must lie in"):
        F.poisson_sample(bad, seed=0)


# ---------------------------------------------------------------------------
# inclusion probabilities
# ---------------------------------------------------------------------------


@st.composite
def designs(draw):
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n = draw(st.one_of(st.sampled_from([m for m in TILE_N if m >= 7]), st.integers(8, 300)))
    sinks, window = draw(st.integers(0, 4)), draw(st.integers(0, 8))
    top = draw(st.integers(0, 5))
    floor = draw(st.sampled_from([1e-3, 0.1, 0.5, 1.0]))
    regime = draw(st.sampled_from(["uniform", "heavy", "zeros", "ties", "tiny"]))
    rng = np.random.default_rng(draw(st.integers(0, 10**6)))
    if regime == "uniform":
        u = rng.random((b, h, n))
    elif regime == "heavy":
        u = rng.pareto(0.7, size=(b, h, n))
    elif regime == "zeros":
        u = rng.random((b, h, n)) * (rng.random((b, h, n)) < 0.1)
    elif regime == "ties":
        u = rng.integers(0, 3, size=(b, h, n)).astype(float)
    else:
        u = rng.random((b, h, n)) * 1e-300
    frac = draw(st.floats(0.0, 1.0))
    return u, frac, dict(sinks=sinks, window=window, top=top, floor=floor)


def _budget(u_row, frac, kw):
    c = int(R.certainty_mask(u_row, sinks=kw["sinks"], window=kw["window"], top=kw["top"]).sum())
    n = u_row.size
    if c == n:
        return float(n)
    return c + max(frac, 1e-3) * (n - c)


@given(designs())
def test_inclusion_probabilities_match_reference_float64(design):
    u, frac, kw = design
    b, h, n = u.shape
    bud = np.array([[_budget(u[i, j], frac, kw) for j in range(h)] for i in range(b)])
    pi = F.inclusion_probabilities(torch.from_numpy(u), torch.from_numpy(bud), **kw)
    assert pi.dtype == torch.float64
    for i in range(b):
        for j in range(h):
            want = R.inclusion_probabilities(u[i, j], bud[i, j], **kw)
            assert_close("pi", pi[i, j].numpy(), want, 1e-12)
    assert_close("sum pi", pi.sum(-1).numpy(), bud, 1e-9 * n)


@given(designs())
def test_inclusion_probabilities_float32_and_scalar_budget(design):
    u, frac, kw = design
    u32 = torch.from_numpy(u).float()
    u64 = u32.double().numpy()  # the reference sees the same float32-rounded importance
    bud = min(_budget(u64[i, j], frac, kw) for i in range(u.shape[0]) for j in range(u.shape[1]))
    assume(all(bud > R.certainty_mask(u64[i, j], **{k: kw[k] for k in ("sinks", "window", "top")}).sum()
               or bud == u.shape[-1] for i in range(u.shape[0]) for j in range(u.shape[1])))
    pi = F.inclusion_probabilities(u32, bud, **kw)
    assert pi.dtype == torch.float32
    for i in range(u.shape[0]):
        for j in range(u.shape[1]):
            want = R.inclusion_probabilities(u64[i, j], bud, **kw)
            # computed in float64, rounded once to float32
            assert_close("pi32", pi[i, j].numpy(), want, float(torch.finfo(torch.float32).eps) * want + 1e-300)


def test_inclusion_probabilities_leading_dims_broadcast():
    rng = np.random.default_rng(1)
    u = torch.from_numpy(rng.random((3, 50)))
    kw = dict(sinks=2, window=8)
    one = F.inclusion_probabilities(u[0], 20.0, **kw)
    assert one.shape == (50,)
    assert torch.allclose(one, torch.from_numpy(R.inclusion_probabilities(u[0].numpy(), 20.0, **kw)), rtol=0,
                          atol=1e-14)
    two = F.inclusion_probabilities(u, torch.tensor([20.0, 30.0, 40.0]), **kw)
    assert two.shape == (3, 50) and torch.allclose(two.sum(-1), torch.tensor([20.0, 30.0, 40.0], dtype=torch.float64))
    # budget broadcast over a batch dim
    three = F.inclusion_probabilities(u.reshape(1, 3, 50).expand(2, 3, 50), torch.tensor([20.0, 30.0, 40.0]), **kw)
    assert torch.equal(three[0], two) and torch.equal(three[1], two)


@given(n=st.integers(10, 120), pads=st.integers(1, 30), data=st.data())
def test_inclusion_probabilities_invariant_to_padding(n, pads, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    u = rng.random(n)
    kw = dict(sinks=data.draw(st.integers(0, 3)), window=data.draw(st.integers(0, 5)), top=data.draw(st.integers(0, 3)))
    c = int(R.certainty_mask(u, **kw).sum())
    assume(c < n)
    budget = c + 0.4 * (n - c)
    want = R.inclusion_probabilities(u, budget, **kw)
    # scatter the n real slots among n + pads slots, padding importance arbitrary
    valid = np.zeros(n + pads, dtype=bool)
    valid[np.sort(rng.choice(n + pads, size=n, replace=False))] = True
    up = rng.random(n + pads) * 100
    up[valid] = u
    got = F.inclusion_probabilities(torch.from_numpy(up), budget, valid=torch.from_numpy(valid), **kw).numpy()
    assert np.all(got[~valid] == 0.0)
    assert_close("pi", got[valid], want, 1e-12)


@given(designs(), st.data())
def test_inclusion_probabilities_per_row_top_equals_one_call_per_row(design, data):
    # a top count per batch row (the presses' batched eviction) gives each row the design of a call with its int
    u, frac, kw = design
    b, h, n = u.shape
    tops = [data.draw(st.integers(0, 6)) for _ in range(b)]
    bud = np.array([[_budget(u[i, j], frac, {**kw, "top": tops[i]}) for j in range(h)] for i in range(b)])
    kw = {k: v for k, v in kw.items() if k != "top"}
    got = F.inclusion_probabilities(torch.from_numpy(u), torch.from_numpy(bud), top=torch.tensor(tops)[:, None], **kw)
    for i in range(b):
        want = F.inclusion_probabilities(torch.from_numpy(u[i]), torch.from_numpy(bud[i]), top=tops[i], **kw)
        assert torch.equal(got[i], want), i
        for j in range(h):
            assert_close("pi", got[i, j].numpy(), R.inclusion_probabilities(u[i, j], bud[i, j], top=tops[i], **kw),
                         1e-12)


def test_inclusion_probabilities_per_row_top_errors():
    u = torch.rand(2, 3, 20, dtype=torch.float64)
    with pytest.raises(ValueError, match="top must be >= 0"):
        F.inclusion_probabilities(u, 10.0, top=torch.tensor([[1], [-1]]))
    with pytest.raises(TypeError, match="integer tensor"):
        F.inclusion_probabilities(u, 10.0, top=torch.tensor([[1.0], [2.0]]))
    with pytest.raises(ValueError, match="broadcastable to the leading dims"):
        F.inclusion_probabilities(u, 10.0, top=torch.tensor([1, 2, 3, 4]))
    with pytest.raises(ValueError, match=r"top=7\).*leading index \(1, 0\)"):  # the message names the row's top
        F.inclusion_probabilities(u, 9.0, sinks=1, window=1, top=torch.tensor([[2], [7]]))


def test_design_uniforms_row_streams_false_gives_every_row_the_row_0_stream():
    index = torch.tensor([[[0, 5, 9]], [[3, 5, 100]]])  # (b=2, h=1, n=3)
    u = F.design_uniforms((2, 1, 3), 4, layer=2, event=1, index=index, row_streams=False)
    for r in range(2):
        for i in range(3):
            assert float(u[r, 0, i]) == py_uniform(4, 2, 0, 0, 1, int(index[r, 0, i]))
    per_row = F.design_uniforms((2, 1, 3), 4, layer=2, event=1, index=index)
    assert float(per_row[1, 0, 1]) == py_uniform(4, 2, 1, 0, 1, 5) != float(u[1, 0, 1])


def test_inclusion_probabilities_edge_cases():
    u = torch.rand(2, 40, dtype=torch.float64)
    assert torch.equal(F.inclusion_probabilities(u, 40.0), torch.ones_like(u))  # budget == n
    z = torch.zeros(40, dtype=torch.float64)  # zero tail mass -> uniform tail
    pi = F.inclusion_probabilities(z, 20.0, sinks=2, window=2)
    assert torch.allclose(pi[2:-2], torch.full((36,), 16 / 36, dtype=torch.float64), atol=1e-15)
    allc = F.inclusion_probabilities(torch.rand(6), 6.0, sinks=3, window=3)  # every token certain
    assert torch.equal(allc, torch.ones(6))


@pytest.mark.parametrize("kw, exc, words", [
    (dict(importance=torch.rand(2, 10), budget=5.0, sinks=4, window=4), ValueError, "exceed the certainty set size"),
    (dict(importance=torch.rand(2, 10), budget=11.0), ValueError, "budget must be <= n"),
    (dict(importance=torch.rand(10), budget=5.0, sinks=5, window=5), ValueError, "every token is in the certainty set"),
    (dict(importance=-torch.rand(10), budget=5.0, sinks=0, window=0), ValueError, "importance must be >= 0"),
    (dict(importance=torch.tensor([1.0, float("nan"), 1.0]), budget=2.0, sinks=0, window=0), ValueError, "finite"),
    (dict(importance=torch.rand(10), budget=5.0, floor=0.0), ValueError, "floor must be in (0, 1]"),
    (dict(importance=torch.rand(10), budget=float("inf"), sinks=0, window=0), ValueError, "budget must be finite"),
    (dict(importance=torch.rand(10), budget="5"), TypeError, "budget must be a float"),
    (dict(importance=torch.rand(2, 10), budget=torch.ones(3) * 5), ValueError, "broadcastable"),
    (dict(importance=torch.arange(10), budget=5.0), TypeError, "floating-point"),
    (dict(importance=np.random.rand(10), budget=5.0), TypeError, "torch.Tensor"),
    (dict(importance=torch.zeros(0), budget=0.0), ValueError, "empty"),
    (dict(importance=torch.rand(10), budget=5.0, top=-1), ValueError, "top must be >= 0"),
    (dict(importance=torch.rand(10), budget=5.0, sinks=1.5), TypeError, "sinks must be an int"),
])
def test_inclusion_probabilities_errors(kw, exc, words):
    with pytest.raises(exc) as e:
        F.inclusion_probabilities(**kw)
    assert words in str(e.value)


def test_inclusion_probabilities_error_names_the_head():
    u = torch.rand(2, 3, 20)
    with pytest.raises(ValueError, match=r"leading index \(1, 2\)"):
        F.inclusion_probabilities(u, torch.tensor([[10.0] * 3, [10.0, 10.0, 25.0]]), sinks=0, window=0)


@given(n=st.integers(1, 80), sinks=st.integers(0, 6), window=st.integers(0, 6), top=st.integers(0, 6),
       ties=st.booleans(), seed=st.integers(0, 999))
def test_certainty_mask_matches_reference(n, sinks, window, top, ties, seed):
    rng = np.random.default_rng(seed)
    u = rng.integers(0, 3, size=(2, n)).astype(float) if ties else rng.random((2, n))
    got = F.certainty_mask(torch.from_numpy(u), sinks=sinks, window=window, top=top)
    for r in range(2):
        assert np.array_equal(got[r].numpy(), R.certainty_mask(u[r], sinks=sinks, window=window, top=top))


@given(designs(), st.integers(1, 3))
def test_capping_fixed_point_and_sorted_fallback_agree_with_reference(design, max_iter):
    from kvcert.fast.design import _capped_pps_iterative, _capped_pps_sorted

    u, frac, kw = design
    rows = u.reshape(-1, u.shape[-1])
    n = rows.shape[-1]
    w, t, m, want = [], [], [], []
    for r in rows:  # the reference's tail weights, padded with zeros
        cert = R.certainty_mask(r, sinks=kw["sinks"], window=kw["window"], top=kw["top"])
        tail = ~cert
        if tail.sum() < 2:
            continue
        ut = r[tail]
        share = ut / ut.sum() if ut.sum() > 0 else np.full(tail.sum(), 1.0 / tail.sum())
        wr = np.zeros(n)
        wr[tail] = (1 - kw["floor"]) * share + kw["floor"] / tail.sum()
        mr = max(frac, 1e-3) * (tail.sum() - 1)
        full = np.zeros(n)
        full[tail] = R.design._capped_pps(wr[tail], mr)
        w.append(wr), t.append(int(tail.sum())), m.append(mr), want.append(full)
    assume(w)  # some row with a tail of two or more tokens to cap
    W = torch.tensor(np.array(w))
    M = torch.tensor(m, dtype=torch.float64)[:, None]
    got_sorted = _capped_pps_sorted(W, torch.tensor(t), M)
    got_iter, done = _capped_pps_iterative(W, W > 0, M, max_iter=max_iter)
    want = np.array(want)
    tail = W.numpy() > 0
    assert_close("sorted", got_sorted.numpy()[tail], want[tail], 1e-12)
    d = done.numpy()
    assert_close("fixed point", got_iter.numpy()[d][tail[d]], want[d][tail[d]], 1e-12)


def test_inclusion_probabilities_fallback_path(monkeypatch):
    import kvcert.fast.design as D

    orig = D._capped_pps_iterative
    monkeypatch.setattr(D, "_capped_pps_iterative", lambda w, tail, m: orig(w, tail, m, max_iter=1))
    rng = np.random.default_rng(3)
    u = rng.pareto(0.5, size=(3, 4, 200))  # heavy tail: long capping cascades
    pi = D.inclusion_probabilities(torch.from_numpy(u), 120.0, sinks=2, window=4, top=3)
    for i in range(3):
        for j in range(4):
            want = R.inclusion_probabilities(u[i, j], 120.0, sinks=2, window=4, top=3)
            assert_close("pi", pi[i, j].numpy(), want, 1e-12)


# every path of the solver checks the importance (tests/support.py: SOLVER_PATHS)
_PATHS = SOLVER_PATHS


@pytest.mark.parametrize("n, budget, sinks, window", _PATHS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_inclusion_probabilities_checks_importance_on_every_path(n, budget, sinks, window, bad):
    u = torch.rand(2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    u[1, 3] = bad
    with pytest.raises(ValueError, match="importance must be"):
        F.inclusion_probabilities(u, budget, sinks=sinks, window=window)
    valid = torch.ones(2, n, dtype=torch.bool)
    with pytest.raises(ValueError, match="importance must be"):
        F.inclusion_probabilities(u, budget, sinks=sinks, window=window, valid=valid)
    valid[1, 3] = False  # on padding the value is ignored (a compressed cache's padding holds anything)
    budget = min(budget, n - 1.0) if budget >= n else budget
    try:
        pi = F.inclusion_probabilities(u, budget, sinks=sinks, window=window, valid=valid)
    except ValueError as err:  # a refused budget, but not for the importance
        assert "importance" not in str(err)
    else:
        assert float(pi[1, 3]) == 0.0 and bool(torch.isfinite(pi).all())


@pytest.mark.parametrize("n, budget, sinks, window", _PATHS)
def test_block_inclusion_probabilities_checks_importance_on_every_path(n, budget, sinks, window):
    u = torch.rand(1, 3, 4 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    u[0, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="importance must be finite"):
        F.block_inclusion_probabilities(u, budget, block_size=4, sink_blocks=sinks, recent_blocks=window)
    u[0, 2, 5] = -0.5
    with pytest.raises(ValueError, match="importance must be >= 0"):
        F.block_inclusion_probabilities(u, budget, block_size=4, sink_blocks=sinks, recent_blocks=window)


@pytest.mark.parametrize("top", [0, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_certainty_mask_checks_importance_as_the_reference(top, bad):
    u = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]], dtype=torch.float64)
    u[0, 2] = bad
    with pytest.raises(ValueError, match="importance must be") as ref:
        R.certainty_mask(u[0].numpy(), sinks=1, window=1, top=top)
    with pytest.raises(ValueError, match="importance must be") as fast:
        F.certainty_mask(u, sinks=1, window=1, top=top)
    assert str(fast.value) == str(ref.value)
    valid = torch.ones_like(u, dtype=torch.bool)
    valid[0, 2] = False  # padding: ignored
    assert not bool(F.certainty_mask(u, sinks=1, window=1, top=top, valid=valid)[0, 2])
