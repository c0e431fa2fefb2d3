"""kvcert.fast.evict / topk_evict: exact masks, packing, composition of events."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.fast as F
import kvcert.reference as R
from support import TILE_N, random_cache, rounding


def _check_packed(cc, keys, values, keep_rows, pi_rows):
    """Every head of ``cc`` holds exactly the kept input slots, in order, then padding."""
    b, h = cc.kept.shape
    for bi in range(b):
        for hh in range(h):
            idx = np.flatnonzero(keep_rows[bi][hh])
            m = len(idx)
            assert int(cc.kept[bi, hh]) == m
            assert np.array_equal(cc.positions[bi, hh, :m].numpy(), idx)
            assert torch.equal(cc.keys[bi, hh, :m], keys[bi, hh, idx])
            assert torch.equal(cc.values[bi, hh, :m], values[bi, hh, idx])
            assert np.array_equal(cc.pi[bi, hh, :m].numpy(), pi_rows[bi][hh][idx])
            assert torch.all(cc.pi[bi, hh, m:] == 0) and torch.all(cc.positions[bi, hh, m:] == -1)
            assert torch.all(cc.keys[bi, hh, m:] == 0) and torch.all(cc.values[bi, hh, m:] == 0)
            assert torch.all(torch.isinf(cc.bias[bi, hh, m:]) & (cc.bias[bi, hh, m:] < 0))


@given(n=st.sampled_from([m for m in TILE_N if m >= 15] + [300]), b=st.integers(1, 2), h=st.integers(1, 3),
       frac=st.floats(0.05, 1.0), seed=st.integers(0, 10**6), layer=st.integers(0, 40), event=st.integers(0, 3),
       top=st.integers(0, 3))
def test_evict_equals_reference_design_under_shared_uniforms(n, b, h, frac, seed, layer, event, top):
    keys, values, imp = random_cache(b, h, n, seed=seed)
    kw = dict(sinks=2, window=4, top=top, floor=0.1)
    c = 2 + 4 + top
    budget = min(float(n), c + frac * (n - c))
    U = np.stack([np.stack([R.design_uniforms(n, seed, layer, hh, event) for hh in range(h)]) for _ in range(b)])
    cc = F.evict(keys, values, imp, budget, uniforms=torch.from_numpy(U), **kw)
    keep_rows, pi_rows = [], []
    for bi in range(b):
        keep_rows.append([]), pi_rows.append([])
        for hh in range(h):
            pi = R.inclusion_probabilities(imp[bi, hh].numpy(), budget, **kw)
            keep = R.poisson_sample(pi, uniforms=U[bi, hh])
            keep_rows[-1].append(keep)
            pi_rows[-1].append(F.inclusion_probabilities(imp[bi, hh], budget, **kw).numpy())
            assert np.allclose(pi_rows[-1][-1], pi, rtol=1e-12, atol=0)
    _check_packed(cc, keys, values, keep_rows, pi_rows)


def test_evict_default_stream_is_replayable_and_per_head():
    keys, values, imp = random_cache(2, 4, 200)
    a = F.evict(keys, values, imp, 80.0, seed=3, layer=1)
    b = F.evict(keys, values, imp, 80.0, seed=3, layer=1)
    assert torch.equal(a.positions, b.positions) and torch.equal(a.pi, b.pi)
    c = F.evict(keys, values, imp, 80.0, seed=3, layer=2)
    assert not torch.equal(a.positions, c.positions)
    # same importance on every head still gives different draws per head
    same = F.evict(keys, values, imp[:, :1].expand(2, 4, 200), 80.0, seed=3)
    assert not torch.equal(same.positions[0, 0], same.positions[0, 1])


def test_evict_mask_is_invariant_to_padding():
    """A token's draw depends on its position, not on its slot: padding moves nothing."""
    keys, values, imp = random_cache(1, 2, 120)
    base = F.evict(keys, values, imp, 50.0, seed=9, layer=4, event=1)
    # the same cache with 30 padding slots interleaved
    rng = np.random.default_rng(0)
    slots = np.sort(rng.choice(150, size=120, replace=False))
    K = torch.zeros(1, 2, 150, 8, dtype=torch.float64)
    V = torch.zeros(1, 2, 150, 4, dtype=torch.float64)
    P = torch.zeros(1, 2, 150, dtype=torch.float64)
    pos = torch.full((1, 2, 150), -1, dtype=torch.int64)
    U = torch.rand(1, 2, 150, dtype=torch.float64) * 7  # garbage importance on padding
    K[:, :, slots], V[:, :, slots], P[:, :, slots] = keys, values, 1.0
    pos[:, :, slots] = torch.arange(120)
    U[:, :, slots] = imp
    padded = F.evict(K, V, U, 50.0, seed=9, layer=4, event=1, pi=P, positions=pos)
    assert torch.equal(padded.positions, base.positions)
    assert torch.equal(padded.keys, base.keys) and torch.allclose(padded.pi, base.pi, rtol=1e-14, atol=0)


def test_two_events_compose_probabilities():
    keys, values, imp = random_cache(2, 3, 160)
    kw = dict(sinks=4, window=8, top=2, floor=0.2)
    first = F.evict(keys, values, imp, 90.0, seed=1, event=0, **kw)
    imp2 = torch.rand(first.pi.shape, dtype=torch.float64)
    second = F.evict(first.keys, first.values, imp2, 40.0, seed=1, event=1, pi=first.pi, positions=first.positions,
                     **kw)
    for bi in range(2):
        for hh in range(3):
            m1 = int(first.kept[bi, hh])
            p2 = R.inclusion_probabilities(imp2[bi, hh, :m1].numpy(), 40.0, **kw)  # the design on the survivors
            pos1 = first.positions[bi, hh, :m1].numpy()
            m2 = int(second.kept[bi, hh])
            pos2 = second.positions[bi, hh, :m2].numpy()
            assert set(pos2) <= set(pos1)
            where = np.searchsorted(pos1, pos2)
            want = first.pi[bi, hh, where].numpy() * p2[where]  # product over events
            assert np.allclose(second.pi[bi, hh, :m2].numpy(), want, rtol=1e-13, atol=0)
            # certain after both events only if certain in both
            certain2 = second.pi[bi, hh, :m2].numpy() == 1.0
            assert np.array_equal(certain2, (first.pi[bi, hh, where].numpy() == 1.0) & (p2[where] == 1.0))
            # sinks of the second event are the first survivors, which were certain before: still certain
            assert np.all(second.pi[bi, hh, :4].numpy() == 1.0)
            assert np.array_equal(pos2[:4], pos1[:4])


def test_composed_pi_is_the_survival_probability():
    """E[I_i / pi_i] = 1 for every token after two adaptive events (4 standard errors, 4000 replicas)."""
    reps, n = 4000, 24
    keys, values, _ = random_cache(1, reps, n)
    g = torch.Generator().manual_seed(0)
    imp = torch.rand(1, 1, n, generator=g, dtype=torch.float64).expand(1, reps, n)
    kw = dict(sinks=1, window=2, top=1, floor=0.3)
    first = F.evict(keys, values, imp, 14.0, seed=5, event=0, **kw)
    # the second design depends on who survived (importance = original importance of the survivors)
    imp2 = torch.where(first.positions >= 0, imp[0, 0][first.positions.clamp(min=0)], torch.zeros(()))
    second = F.evict(first.keys, first.values, imp2, 7.0, seed=5, event=1, pi=first.pi, positions=first.positions,
                     **kw)
    w = torch.zeros(reps, n, dtype=torch.float64)  # I_i / pi_i per replica
    rows = torch.arange(reps)[:, None].expand_as(second.positions[0])
    live = second.positions[0] >= 0
    w[rows[live], second.positions[0][live]] = 1.0 / second.pi[0][live]
    mean, se = w.mean(0), w.std(0) / np.sqrt(reps)
    ok = (mean - 1.0).abs() <= 4 * se + 1e-12
    assert bool(ok.all()), (mean, se)
    assert float(w.std(0).max()) > 0  # some tokens are random in the composition


def test_kept_count_moments():
    keys, values, imp = random_cache(1, 2000, 64)
    cc = F.evict(keys, values, imp, 30.0, sinks=2, window=4, seed=11)
    pi = F.inclusion_probabilities(imp, 30.0, sinks=2, window=4)
    var = (pi * (1 - pi)).sum(-1)
    z = (cc.kept.double() - 30.0) / var.sqrt()
    assert abs(float(z.mean())) <= 4 / np.sqrt(2000)
    assert abs(float(z.var()) - 1.0) <= 4 * np.sqrt(2 / 1999)


@given(n=st.integers(12, 150), budget_frac=st.floats(0.0, 1.0), b=st.integers(1, 2), h=st.integers(1, 3),
       ties=st.booleans(), seed=st.integers(0, 999))
def test_topk_evict_matches_deterministic_keep(n, budget_frac, b, h, ties, seed):
    keys, values, imp = random_cache(b, h, n, seed=seed)
    if ties:
        imp = torch.floor(imp * 3)
    sinks, window = 2, 5
    budget = int(round(sinks + window + budget_frac * (n - sinks - window)))
    cc = F.topk_evict(keys, values, imp, budget, sinks=sinks, window=window)
    keep_rows = [[R.deterministic_keep(imp[bi, hh].numpy(), budget, sinks=sinks, window=window) for hh in range(h)]
                 for bi in range(b)]
    _check_packed(cc, keys, values, keep_rows, [[np.ones(n)] * h] * b)


def _alone(cc, i):
    """Row i of a CompressedCache, trimmed to its own longest head."""
    m = int(cc.kept[i].max())
    return [x[i:i + 1, :, :m] for x in (cc.keys, cc.values, cc.pi, cc.positions)]


@given(n=st.integers(40, 150), seed=st.integers(0, 999), pads=st.lists(st.integers(0, 25), min_size=2, max_size=3))
def test_evict_rows_with_their_own_budget_and_top_equal_each_row_alone(n, seed, pads):
    # the presses' batched eviction: left-padded rows, per-row budget and top, every row on the row-0
    # stream (row_streams=False) -> each row's kept tokens, pi and positions are those of the row alone
    b = len(pads)
    keys, values, imp = random_cache(b, 2, n, seed=seed)
    pos = torch.arange(n).expand(b, 2, n).clone()
    pi = torch.ones(b, 2, n, dtype=torch.float64)
    for r, p in enumerate(pads):
        pos[r, :, :p], pi[r, :, :p] = -1, 0.0
    top = torch.tensor([[r * 3] for r in range(b)])
    c = [2 + 4 + r * 3 for r in range(b)]  # each row's certainty set: sinks + window + top
    budget = torch.tensor([[c[r] + f * (n - p - c[r]) for f in (0.3, 0.6)] for r, p in enumerate(pads)],
                          dtype=torch.float64)
    kw = dict(sinks=2, window=4, seed=seed, layer=3, event=1)
    cc = F.evict(keys, values, imp, budget, top=top, pi=pi, positions=pos, row_streams=False, **kw)
    for r, p in enumerate(pads):
        one = F.evict(keys[r:r + 1, :, p:], values[r:r + 1, :, p:], imp[r:r + 1, :, p:], budget[r:r + 1],
                      top=int(top[r]), pi=pi[r:r + 1, :, p:], positions=pos[r:r + 1, :, p:], **kw)
        k, v, p_got, pos_got = _alone(cc, r)
        assert torch.equal(pos_got, one.positions) and torch.equal(k, one.keys) and torch.equal(v, one.values), r
        # pi: the same sums over the tail, in another order (the padded row is longer)
        assert torch.allclose(p_got, one.pi, rtol=rounding(torch.float64, n), atol=0), r


def test_topk_evict_per_row_budgets_equal_one_call_per_row():
    keys, values, imp = random_cache(3, 2, 60, seed=5)
    budget = torch.tensor([[10], [25], [60]])
    cc = F.topk_evict(keys, values, imp, budget, sinks=2, window=3)
    for r in range(3):
        one = F.topk_evict(keys[r:r + 1], values[r:r + 1], imp[r:r + 1], int(budget[r]), sinks=2, window=3)
        assert torch.equal(cc.kept[r], one.kept[0])
        for got, want in zip(_alone(cc, r), [one.keys, one.values, one.pi, one.positions]):
            assert torch.equal(got, want), r
    with pytest.raises(ValueError, match="got 61"):
        F.topk_evict(keys, values, imp, torch.tensor([[10], [61], [5]]), sinks=2, window=3)
    with pytest.raises(TypeError, match="integer tensor"):
        F.topk_evict(keys, values, imp, budget.double(), sinks=2, window=3)


def test_compact_of_an_expanded_cache_equals_compact_of_its_copy():
    # one cache shared by many samples (stride 0, as paper_repro's replay passes it) is gathered in place
    keys, values, _ = random_cache(1, 1, 50, seed=2)
    keep = torch.rand(6, 1, 50, generator=torch.Generator().manual_seed(3)) < 0.3
    pi = torch.where(keep, 0.3, 0.0).double()
    pos = torch.arange(50).expand(6, 1, 50)
    shared = F.compact(keep, keys.expand(6, 1, 50, 8), values.expand(6, 1, 50, 4), pi, pos)
    copied = F.compact(keep, keys.expand(6, 1, 50, 8).contiguous(), values.expand(6, 1, 50, 4).contiguous(), pi, pos)
    for f in ("keys", "values", "pi", "positions", "kept"):
        assert torch.equal(getattr(shared, f), getattr(copied, f)), f
    assert torch.equal(shared.kept[:, 0], keep[:, 0].sum(-1))


def test_topk_evict_with_padding_and_prior_pi():
    keys, values, imp = random_cache(1, 2, 100)
    cc = F.evict(keys, values, imp, 50.0, seed=0)
    imp2 = torch.rand(cc.pi.shape, dtype=torch.float64)
    det = F.topk_evict(cc.keys, cc.values, imp2, 20, sinks=2, window=4, pi=cc.pi, positions=cc.positions)
    for hh in range(2):
        m = int(cc.kept[0, hh])
        keep = R.deterministic_keep(imp2[0, hh, :m].numpy(), 20, sinks=2, window=4)
        assert np.array_equal(det.positions[0, hh].numpy(), cc.positions[0, hh, :m].numpy()[keep])
        assert np.array_equal(det.pi[0, hh].numpy(), cc.pi[0, hh, :m].numpy()[keep])


@pytest.mark.parametrize("call, exc, words", [
    (lambda k, v, u: F.evict(k, v[:, :, :5], u, 5.0), ValueError, "values must have shape"),
    (lambda k, v, u: F.evict(k, v, u[..., :5], 5.0), ValueError, "importance must have shape"),
    (lambda k, v, u: F.evict(k[0], v, u, 5.0), ValueError, "keys must be 4-d"),
    (lambda k, v, u: F.evict(k, v, u, 5.0, seed=None), TypeError, "seed="),
    (lambda k, v, u: F.evict(k, v, u, 5.0, sinks=3, window=3), ValueError, "certainty set"),
    (lambda k, v, u: F.evict(k, v, u, 5.0, sinks=0, window=0, pi=torch.ones(1, 2, 9)), ValueError, "pi must have"),
    (lambda k, v, u: F.evict(k, v, u, 5.0, sinks=0, window=0, positions=torch.zeros(1, 2, 10)), TypeError,
     "positions must be an int64"),
    (lambda k, v, u: F.evict(k, v, u, 5.0, sinks=0, window=0, pi=torch.ones(1, 2, 10),
                             positions=torch.full((1, 2, 10), -1)), ValueError, "disagree on padding"),
    (lambda k, v, u: F.topk_evict(k, v, u, 5.5), TypeError, "budget must be an int"),
    (lambda k, v, u: F.topk_evict(k, v, u, 11, sinks=0, window=0), ValueError, "budget must be in"),
    (lambda k, v, u: F.topk_evict(k, v, u * float("nan"), 5, sinks=0, window=0), ValueError, "finite"),
])
def test_evict_errors(call, exc, words):
    k, v, u = torch.randn(1, 2, 10, 4), torch.randn(1, 2, 10, 3), torch.rand(1, 2, 10)
    with pytest.raises(exc) as e:
        call(k, v, u)
    assert words in str(e.value)


def test_evict_keeps_dtypes_and_bf16_cache():
    k, v = torch.randn(1, 2, 64, 8, dtype=torch.bfloat16), torch.randn(1, 2, 64, 8, dtype=torch.bfloat16)
    cc = F.evict(k, v, torch.rand(1, 2, 64), 30.0, sinks=2, window=4, seed=0)
    assert cc.keys.dtype == torch.bfloat16 and cc.pi.dtype == torch.float32 and cc.positions.dtype == torch.int64
    est = F.hajek_attention(torch.randn(1, 4, 8, dtype=torch.bfloat16), cc.keys, cc.values, cc.pi)
    assert est.output.dtype == torch.bfloat16 and torch.isfinite(est.trace).all()
