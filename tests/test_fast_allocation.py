"""kvcert.fast.allocation: budgets across heads (Neyman-style), the AdaKV-style and PyramidKV baselines."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from kvcert.fast import inclusion_probabilities, predicted_radius, window_variance_terms
from kvcert.fast import allocation as A
from kvcert.fast.target import head_tops as _tops

SMALL = dict(sinks=1, window=2)  # B_min = 4: tiny heads still have a range of budgets


def heads(seed, H=3, m=4, n=20, d=8, spread=True):
    """H heads' window terms from random attention inputs (window_variance_terms), with importance."""
    g = torch.Generator().manual_seed(seed)
    terms, norm2, imp = [], [], []
    for h in range(H):
        nh = n[h] if isinstance(n, (list, tuple)) else n
        q = torch.randn(1, 1, m, d, generator=g, dtype=torch.float64) * (1 + 2 * h * spread)
        k = torch.randn(1, 1, nh, d, generator=g, dtype=torch.float64)
        v = torch.randn(1, 1, nh, d, generator=g, dtype=torch.float64) + 0.5
        t, o = window_variance_terms(q, k, v)
        terms.append(t[0, 0])
        norm2.append(o[0, 0])
        imp.append(torch.rand(nh, generator=g, dtype=torch.float64) ** 3)
    return terms, norm2, imp


def brute(tables, total):
    """The exact minimum of sum_h F_h(B_h) over all grid splits with sum <= total, by enumeration."""
    best = math.inf
    for combo in itertools.product(*[range(len(t.budgets)) for t in tables]):
        if sum(int(t.budgets[k]) for t, k in zip(tables, combo)) <= total:
            best = min(best, sum(float(t.values[k]) for t, k in zip(tables, combo)))
    return best


def test_tables_match_the_target_prediction():
    # F(B) = rho(B)^2 delta for chebyshev (rho = sqrt(F / delta)): the same pi and terms as kvcert.fast.target
    terms, norm2, imp = heads(0, H=2, n=30)
    tables = A.objective_tables(terms, norm2, imp, **SMALL)
    radii = A.objective_tables(terms, norm2, imp, objective="radius", delta=0.1, **SMALL)
    for h in range(2):
        for j, b in enumerate(tables[h].budgets[:-1]):
            bt = torch.tensor(float(b), dtype=torch.float64)
            top = int(_tops(bt, 1, 2, 0.5))
            pi = inclusion_probabilities(imp[h], float(b), top=top, floor=0.1, **SMALL)
            rho = predicted_radius(terms[h][None, None], norm2[h][None, None], pi[None, None], kind="chebyshev",
                                   delta=0.05)
            # both sides are float64 sums of the same m * n products in other orders: 1e-12 relative
            assert tables[h].values[j] == pytest.approx(float(rho) ** 2 * 0.05, rel=1e-12)
            assert radii[h].values[j] == pytest.approx(math.sqrt(tables[h].values[j] / 0.1), rel=1e-12)
        assert tables[h].budgets[0] == 4 and tables[h].budgets[-1] == 30 and tables[h].values[-1] == 0.0
    at = A.head_objectives(terms, norm2, imp, torch.tensor([7, 30]), **SMALL)
    assert float(at[0]) == pytest.approx(tables[0].values[3], rel=1e-12) and float(at[1]) == 0.0


@pytest.mark.parametrize("seed", range(12))
def test_optimal_against_brute_force(seed):
    H = 2 + seed % 2
    n = [12, 16, 9][:H] if seed % 3 else 14
    terms, norm2, imp = heads(seed, H=H, n=n)
    kw = dict(SMALL, top_fraction=0.5 if seed % 2 else 0.0)
    tables = A.objective_tables(terms, norm2, imp, **kw)
    lows = sum(int(t.budgets[0]) for t in tables)
    highs = sum(int(t.budgets[-1]) for t in tables)
    for total in (lows, (lows + highs) // 3, (lows + highs) // 2, highs - 1, highs + 5):
        a = A.allocate_budgets(terms, norm2, imp, total, **kw)
        best = brute(tables, total)
        got = float(a.objective.sum())
        # exact (grid minimum) on these cases; the greedy is provably exact only for convex tables, the
        # exchange search closes the rest here: equal up to float64 summation order (1e-12 relative)
        assert got <= best * (1 + 1e-12) + 1e-300, (seed, total, got, best, a.budget.tolist())
        assert a.lower_bound <= best * (1 + 1e-12) + 1e-300
        assert int(a.budget.sum()) == min(total, highs)
        for t, b in zip(tables, a.budget.tolist()):
            assert int(t.budgets[0]) <= b <= int(t.budgets[-1])


def test_convex_tables_exact_and_neyman():
    # F_h(B) = c_h / B - c_h / n is convex and decreasing: the greedy is exact, and B_h ~ sqrt(c_h) (Neyman)
    n, c = 400, np.array([1.0, 4.0, 16.0, 64.0])
    grid = np.arange(10, n + 1)
    tables = [A.ObjectiveTable(grid, ch / grid - ch / n) for ch in c]
    a = A.allocate_from_tables(tables, 600)
    assert bool(a.convex.all()) and int(a.budget.sum()) == 600
    assert all(A.convexity_gap(t) == 0.0 for t in tables)
    bent = A.ObjectiveTable(np.array([1, 2, 3]), np.array([4.0, 3.0, 0.0]))  # (2, 3) lies 1.0 above the chord
    assert A.convexity_gap(bent) == pytest.approx(1.0 / 3.0, rel=1e-15)
    # integer rounding moves each budget by at most one token from the continuous optimum 600 sqrt(c)/sum sqrt(c)
    ideal = 600 * np.sqrt(c) / np.sqrt(c).sum()
    assert np.abs(a.budget.numpy() - ideal).max() <= 1.0 + 1e-9
    small = [A.ObjectiveTable(np.arange(2, 12), ch / np.arange(2, 12.0)) for ch in (1.0, 3.0, 9.0)]
    for total in range(6, 34):
        assert float(A.allocate_from_tables(small, total).objective.sum()) == pytest.approx(brute(small, total),
                                                                                       rel=1e-14)


@pytest.mark.parametrize("seed", range(6))
def test_never_worse_than_uniform(seed):
    H, n = 6, [40, 40, 25, 60, 40, 33]
    terms, norm2, imp = heads(100 + seed, H=H, n=n, m=6)
    for f in (0.2, 0.4, 0.7):
        total = int(sum(max(f * x, 4) for x in n))
        uni = A.uniform_budgets(n, total, **SMALL)
        a = A.allocate_budgets(terms, norm2, imp, total, **SMALL)
        f_uni = float(A.head_objectives(terms, norm2, imp, uni, **SMALL).sum())
        f_ney = float(A.head_objectives(terms, norm2, imp, a.budget, **SMALL).sum())
        assert f_ney == pytest.approx(float(a.objective.sum()), rel=1e-12)
        assert f_ney <= f_uni * (1 + 1e-12)
        assert int(uni.sum()) == total == int(a.budget.sum())


def test_short_heads_and_infinite_objective():
    terms, norm2, imp = heads(7, H=3, n=[3, 20, 20])  # the first head is below B_min: it keeps all 3
    norm2[2] = torch.zeros_like(norm2[2])  # o = 0 with V > 0: infinite relative variance below n
    a = A.allocate_budgets(terms, norm2, imp, 3 + 4 + 20, **SMALL)
    assert a.budget.tolist() == [3, 4, 20] and math.isfinite(float(a.objective.sum()))
    a = A.allocate_budgets(terms, norm2, imp, 3 + 4 + 10, **SMALL)
    assert a.budget[0] == 3 and math.isinf(float(a.objective[2]))


def test_step_grid():
    terms, norm2, imp = heads(3, H=3, n=50)
    tabs = A.objective_tables(terms, norm2, imp, step=5, **SMALL)
    assert tabs[0].budgets.tolist() == [4, 9, 14, 19, 24, 29, 34, 39, 44, 49, 50]
    a = A.allocate_from_tables(tabs, 80)
    assert int(a.budget.sum()) <= 80 and a.lower_bound <= brute(tabs, 80) * (1 + 1e-12)


def test_errors_named():
    terms, norm2, imp = heads(1, H=2, n=20)
    with pytest.raises(ValueError, match="total must be at least .* 8; got 7"):
        A.allocate_budgets(terms, norm2, imp, 7, **SMALL)
    with pytest.raises(ValueError, match="norm2\\[1\\] must have shape"):
        A.allocate_budgets(terms, [norm2[0], norm2[1][:2]], imp, 20, **SMALL)
    with pytest.raises(ValueError, match="importance\\[0\\] must have shape"):
        A.allocate_budgets(terms, norm2, [imp[0][:5], imp[1]], 20, **SMALL)
    with pytest.raises(ValueError, match="same number H"):
        A.allocate_budgets(terms, norm2[:1], imp, 20, **SMALL)
    bad = [terms[0].clone(), terms[1]]
    bad[0][0, 0] = float("nan")
    with pytest.raises(ValueError, match="terms\\[0\\] must be finite"):
        A.allocate_budgets(bad, norm2, imp, 20, **SMALL)
    with pytest.raises(ValueError, match="objective must be one of"):
        A.allocate_budgets(terms, norm2, imp, 20, objective="mse", **SMALL)
    with pytest.raises(ValueError, match="kind must be one of"):
        A.allocate_budgets(terms, norm2, imp, 20, kind="wald", **SMALL)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        A.allocate_budgets(terms, norm2, imp, 20, step=0, **SMALL)
    with pytest.raises(TypeError, match="terms must be a tensor stacked over heads"):
        A.allocate_budgets("x", norm2, imp, 20)
    with pytest.raises(ValueError, match="budgets\\[0\\] must be in \\[4, 20\\]"):
        A.head_objectives(terms, norm2, imp, torch.tensor([2, 10]), **SMALL)
    with pytest.raises(ValueError, match="total must be at least"):
        A.adakv_budgets(imp, 7, **SMALL)
    with pytest.raises(ValueError, match="safeguard must be in"):
        A.adakv_budgets(imp, 20, safeguard=2.0)
    with pytest.raises(ValueError, match="beta must be"):
        A.pyramid_budgets(3, 300, heads_per_layer=2, n=100, beta=0.5)
    with pytest.raises(ValueError, match="n must be an int or hold"):
        A.pyramid_budgets(3, 300, heads_per_layer=2, n=[100] * 5)


def test_adakv_budgets():
    n = 200
    g = torch.Generator().manual_seed(0)
    peaked = torch.zeros(n, dtype=torch.float64)
    peaked[torch.randperm(n - 40, generator=g)[:5] + 4] = 1.0  # the mass on 5 free tokens
    flat = torch.rand(n, generator=g, dtype=torch.float64) + 1.0  # the mass spread out
    imp = torch.stack([peaked, flat, flat.flip(0)])
    b = A.adakv_budgets(imp, 300, safeguard=0.2)
    assert int(b.sum()) == 300
    # the floor is max(B_min, floor(0.2 * 300 / 3)) = 37 each = 36 edge tokens + the largest free share; of the
    # 189 left, the peaked head's other 4 tokens (share 0.2 each) come first, its zero shares last: 37 + 4
    assert int(b[0]) == 37 + 4
    assert (A.adakv_budgets(imp, 3 * 37 + 4) == torch.tensor([41, 37, 37])).all()
    assert int(b[1]) > int(b[0]) and int(b[2]) > int(b[0])
    assert (b >= 37).all() and (b <= n).all()
    assert A.adakv_budgets(imp, 10_000).tolist() == [n] * 3
    for total in (111, 250, 400, 599):  # bounds hold up to the top: no head above n, the sum exact
        bt = A.adakv_budgets(imp, total)
        assert int(bt.sum()) == total and (bt >= 37).all() and (bt <= n).all()
    # safeguard 1: the floor is the uniform share, everyone gets at least T / H
    assert (A.adakv_budgets(imp, 300, safeguard=1.0) == 100).all()


def test_pyramid_budgets():
    b = A.pyramid_budgets(6, 6 * 2 * 100, heads_per_layer=2, n=300)
    assert int(b.sum()) == 1200 and (b >= 37).all() and (b <= 300).all()
    per_layer = b.view(6, 2)
    assert (per_layer[:-1, 0] >= per_layer[1:, 0]).all() and per_layer[0, 0] > per_layer[-1, 0]
    assert (per_layer.max(1).values - per_layer.min(1).values <= 1).all()  # a layer's heads share its budget
    assert A.pyramid_budgets(6, 1200, heads_per_layer=2, n=300, beta=1.0).tolist() == [100] * 12
    assert A.uniform_budgets([300] * 12, 1200).tolist() == [100] * 12
    # a short head keeps all it has; the others share the rest equally
    assert A.uniform_budgets([20, 300, 300], 220).tolist() == [20, 100, 100]
