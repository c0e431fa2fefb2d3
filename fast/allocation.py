r"""Budget allocation across (layer, KV head): one total, many heads.

A fixed total of kept tokens :math:`T` is split over H heads (every (layer, KV head) of one
sequence's eviction events; the heads are the strata of one stratified Poisson design). Three rules:

- :func:`allocate_budgets` (Neyman-style): minimize the summed predicted variance,

  .. math::

      \min_{B_1..B_H}\ \sum_h F_h(B_h) \quad\text{s.t.}\quad \sum_h B_h \le T,\quad
      B_{\min,h} \le B_h \le n_h,\ B_h \in \mathbb Z,

      F_h(B) = \frac{1}{m_h}\sum_{q\in Q_h} \frac{V_{hq}(B)}{\lVert o_{hq}\rVert^2}, \qquad
      V_{hq}(B) = \sum_i \Bigl(\frac{1}{\pi_{hi}(B)} - 1\Bigr) A_{hqi},

  with :math:`A_{hqi} = p_{hqi}^2\lVert v_{hi} - o_{hq}\rVert^2` and :math:`\lVert o_{hq}\rVert^2` the window
  queries' terms (:func:`kvcert.fast.window_variance_terms`), :math:`\pi_h(B)` the token design's
  inclusion probabilities at budget B (:func:`kvcert.fast.inclusion_probabilities`, the top slice of
  :func:`kvcert.fast.design_sizes`), :math:`B_{\min,h} = \min(\text{sinks} + \text{window} + 1, n_h)`
  (docs/theory.md section 9 has the prediction; docs/design.md section 2 the design). ``objective``
  ``"absolute"`` drops the :math:`\lVert o\rVert^2`; ``"radius"`` sums the predicted radii
  :math:`r_{\text{kind}}(\delta; F_h(B))` instead (``chebyshev``: :math:`\sqrt{F_h/\delta}`).
  Neyman's allocation is the continuous case: with :math:`\pi = B/n` uniform,
  :math:`F_h(B) \approx S_h / B` and the optimum is :math:`B_h \propto \sqrt{S_h}`.
- :func:`adakv_budgets` (AdaKV-style baseline): the global top-T of the heads' normalized attention shares.
- :func:`pyramid_budgets` (PyramidKV baseline): budgets decreasing linearly with depth.

The solver (:func:`allocate_from_tables`) is marginal-gain water-filling on each head's lower convex hull:
tabulate :math:`F_h` on the grid :math:`B_{\min,h}, B_{\min,h} + \text{step}, \dots, n_h`
(:func:`objective_tables`), take the hull segments of every head in decreasing order of gain per token
:math:`g = -\Delta F / \Delta B` (the Lagrange multiplier :math:`\lambda` is the gain of the last segment
taken) while they fit. For objectives convex on the grid with ``step = 1`` every segment costs one token
and the greedy is exactly optimal (separable convex resource allocation: Gross 1956; Fox 1966). The real
tables are not convex (the top slice :math:`\lfloor \text{top\_fraction}(B - s - w)\rfloor` grows every
other token and renormalizes the tail, a sawtooth; capping bends them too): the hull greedy is then optimal
among allocations at its own total on hull points (Everett 1963), and a local search finishes it (the best
single move, one head up and at most one head down, while it lowers the sum; run from the greedy and from
the equal split, the better kept, so the result is never worse than the equal split on the grid). The
continuous-knapsack value on the hulls is a lower bound on every grid allocation
(``Allocation.lower_bound``), so the gap to the optimum is known.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import numpy as np
import torch

from ._checks import check_nonneg_int, check_tensor
from .certificates import radius_from_moments
from .design import inclusion_probabilities, nonnegative_importance
from .target import TARGET_KINDS, head_tops

__all__ = ["OBJECTIVES", "Allocation", "FlooredAllocation", "ObjectiveTable", "objective_tables",
           "allocate_from_tables", "allocate_at_uniform_memory", "allocate_budgets", "convexity_gap",
           "head_objectives", "uniform_budgets", "adakv_budgets", "pyramid_budgets"]

#: what :func:`allocate_budgets` sums over heads
OBJECTIVES = ("relative", "absolute", "radius")
#: a finite stand-in for an infinite objective (a query with o = 0 and V > 0) inside the hull arithmetic
_BIG = 1e200


class ObjectiveTable(NamedTuple):
    """One head's objective on its budget grid: ``budgets`` int64 (K,) increasing, from B_min to n (the last
    is n, where nothing is evicted and the objective is 0); ``values`` float64 (K,)."""

    budgets: np.ndarray
    values: np.ndarray


class Allocation(NamedTuple):
    """What :func:`allocate_budgets` / :func:`allocate_from_tables` chose, per head (H,).

    ``budget``: int64, the expected kept count B_h; ``objective``: float64, F_h(B_h) (the ``objective``
    asked for); ``lower_bound``: float, the convex relaxation's value (<= every grid allocation's
    summed objective); ``convex``: bool, whether the head's table lies on its lower convex hull (then the
    greedy is exact for it); ``multiplier``: float, lambda, the gain per token of the last hull segment taken.
    """

    budget: torch.Tensor
    objective: torch.Tensor
    lower_bound: float
    convex: torch.Tensor
    multiplier: float


def _check_options(delta, kind, sinks, window, top_fraction, floor, objective, step):
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind must be one of {TARGET_KINDS} (a radius that is a function of the variance), "
                         f"got {kind!r}")
    sinks, window = check_nonneg_int("sinks", sinks), check_nonneg_int("window", window)
    top_fraction = float(top_fraction)
    if not 0.0 <= top_fraction < 1.0:
        raise ValueError(f"top_fraction must be in [0, 1), got {top_fraction}")
    floor = float(floor)
    if not 0.0 < floor <= 1.0:
        raise ValueError(f"floor must be in (0, 1], got {floor}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    step = check_nonneg_int("step", step)
    if step < 1:
        raise ValueError(f"step must be an int >= 1 (the budget grid's spacing), got {step}")
    return delta, sinks, window, top_fraction, floor, step


def _heads(terms, norm2, importance) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per head (terms (m, n), norm2 (m,), importance (n,)) in float64, from stacks or sequences."""
    def split(name, x, ndim):
        if isinstance(x, torch.Tensor):
            x = check_tensor(name, x, ndim=(ndim + 1,), floating=True)
            return list(x.unbind(0))
        if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
            raise TypeError(f"{name} must be a tensor stacked over heads or a sequence of per-head tensors, "
                            f"got {type(x).__name__}")
        return [check_tensor(f"{name}[{h}]", t, ndim=(ndim,), floating=True) for h, t in enumerate(x)]

    ts, ns, us = split("terms", terms, 2), split("norm2", norm2, 1), split("importance", importance, 1)
    if not (len(ts) == len(ns) == len(us)) or not ts:
        raise ValueError(f"terms, norm2 and importance must hold the same number H >= 1 of heads, got "
                         f"{len(ts)}, {len(ns)}, {len(us)}")
    out = []
    for h, (t, o, u) in enumerate(zip(ts, ns, us)):
        m, n = t.shape
        if n == 0 or m == 0:
            raise ValueError(f"terms[{h}] must have shape (m >= 1, n >= 1), got {tuple(t.shape)}")
        if tuple(o.shape) != (m,):
            raise ValueError(f"norm2[{h}] must have shape (m,) = ({m},), got {tuple(o.shape)}")
        if tuple(u.shape) != (n,):
            raise ValueError(f"importance[{h}] must have shape (n,) = ({n},), got {tuple(u.shape)}")
        for name, x in (("terms", t), ("norm2", o), ("importance", u)):
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"{name}[{h}] must be finite (found NaN or inf)")
        if bool((t < 0).any()) or bool((o < 0).any()):
            raise ValueError(f"terms[{h}] and norm2[{h}] must be >= 0 (window_variance_terms' outputs)")
        out.append((t.to(torch.float64), o.to(torch.float64), nonnegative_importance(u.to(torch.float64))))
    return out


def _curve(t, o, u, budgets, *, delta, kind, sinks, window, top_fraction, floor, objective) -> torch.Tensor:
    """F at budgets (G, K) for G heads of one shape: t (G, m, n), o (G, m), u (G, n); every budget < n."""
    G, K = budgets.shape
    n = u.shape[-1]
    top = head_tops(budgets, sinks, window, top_fraction)
    pi = inclusion_probabilities(u.unsqueeze(1).expand(G, K, n), budgets, sinks=sinks, window=window, top=top,
                                 floor=floor)
    var = torch.einsum("gmn,gkn->gkm", t, 1.0 / pi - 1.0)  # (G, K, m)
    if objective == "absolute":
        return var.mean(-1)
    on = o.unsqueeze(1)
    rel = torch.where(on > 0, var / on.clamp_min(torch.finfo(torch.float64).tiny),
                      torch.where(var > 0, math.inf, 0.0)).mean(-1)
    if objective == "radius":
        return radius_from_moments(kind, delta, trace=rel)
    return rel


def objective_tables(terms, norm2, importance, *, delta: float = 0.05, kind: str = "chebyshev", sinks: int = 4,
                     window: int = 32, top_fraction: float = 0.5, floor: float = 0.1, objective: str = "relative",
                     step: int = 1, chunk: int = 64) -> list[ObjectiveTable]:
    r"""Each head's objective :math:`F_h(B)` on the grid :math:`B_{\min,h}, B_{\min,h} + \text{step}, \dots`
    (below :math:`n_h`) and :math:`n_h` (module docstring; :math:`F_h(n_h) = 0`).

    Parameters
    ----------
    terms : (H, m, n) tensor or sequence of H (m_h, n_h) tensors, :func:`kvcert.fast.window_variance_terms`'s
        terms of each head (its (b, h_kv) dims flattened)
    norm2 : (H, m) or H (m_h,), the window queries' :math:`\lVert o_q\rVert^2`
    importance : (H, n) or H (n_h,), the scorer's scores (negative ones shifted per head)
    delta, kind : the radius rule (``objective="radius"``)
    sinks, window, top_fraction, floor : the token design's certainty set and floor
    objective : one of :data:`OBJECTIVES`
    step : int >= 1, the grid's spacing (1: every integer budget)
    chunk : budgets evaluated at once per head group (memory: G * chunk * n float64)

    Returns
    -------
    list of :class:`ObjectiveTable`, one per head

    Notes
    -----
    Heads of equal (m, n) are evaluated together: one :func:`kvcert.fast.inclusion_probabilities` call over
    (heads, budgets) rows and one batched (m x n) @ (n x chunk) product per chunk of budgets.
    """
    delta, sinks, window, top_fraction, floor, step = _check_options(delta, kind, sinks, window, top_fraction,
                                                                      floor, objective, step)
    chunk = max(1, check_nonneg_int("chunk", chunk))
    heads = _heads(terms, norm2, importance)
    groups: dict[tuple[int, int], list[int]] = {}
    for h, (t, _, _) in enumerate(heads):
        groups.setdefault(tuple(t.shape), []).append(h)
    tables: list[ObjectiveTable | None] = [None] * len(heads)
    opts = dict(delta=delta, kind=kind, sinks=sinks, window=window, top_fraction=top_fraction, floor=floor,
                objective=objective)
    for (m, n), idx in groups.items():
        low = min(sinks + window + 1, n)
        grid = np.append(np.arange(low, n, step, dtype=np.int64), n)
        inner = torch.tensor(grid[:-1], dtype=torch.float64)
        t = torch.stack([heads[h][0] for h in idx])
        o = torch.stack([heads[h][1] for h in idx])
        u = torch.stack([heads[h][2] for h in idx])
        vals = [torch.zeros(len(idx), 1, dtype=torch.float64)]  # F(n) = 0: pi = 1 everywhere
        parts = [_curve(t, o, u, inner[s:s + chunk].to(t.device).expand(len(idx), -1).contiguous(), **opts).cpu()
                 for s in range(0, inner.numel(), chunk)]
        table = torch.cat(parts + vals, dim=1).numpy()
        for j, h in enumerate(idx):
            tables[h] = ObjectiveTable(grid.copy(), table[j].copy())
    return tables  # type: ignore[return-value]


def _lower_hull(x: np.ndarray, y: np.ndarray) -> list[int]:
    """Indices of the lower convex hull of the points (x, y), x increasing (Andrew's monotone chain)."""
    hull: list[int] = []
    for k in range(len(x)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b when it lies on or above the chord a -> k
            if (y[b] - y[a]) * (x[k] - x[a]) >= (y[k] - y[a]) * (x[b] - x[a]):
                hull.pop()
            else:
                break
        hull.append(k)
    return hull


def allocate_from_tables(tables: Sequence[ObjectiveTable], total: int) -> Allocation:
    r"""Water-filling on the heads' lower convex hulls (module docstring): the budgets minimizing
    :math:`\sum_h F_h(B_h)` with :math:`\sum_h B_h \le T`, each :math:`B_h` a grid point of its table.

    Exact when every table is convex and the grid step is 1 (then :math:`\sum_h B_h = T` or every head
    keeps all); otherwise the hull greedy and the exchange search (module docstring), with
    ``lower_bound`` the continuous-knapsack value on the hulls. Cost: sorting the hull segments, then
    O(H (K + n)) per exchange move (NumPy over heads).

    Raises
    ------
    ValueError
        ``total`` below the sum of the smallest budgets (naming both), an empty or malformed table.
    """
    total = check_nonneg_int("total", total)
    if not tables:
        raise ValueError("tables must hold at least one head's ObjectiveTable")
    xs, ys = [], []
    for h, tab in enumerate(tables):
        x = np.asarray(tab.budgets, dtype=np.int64)
        y = np.asarray(tab.values, dtype=np.float64)
        if x.ndim != 1 or x.shape != y.shape or x.size == 0 or bool((np.diff(x) <= 0).any()):
            raise ValueError(f"tables[{h}] must hold budgets (K,) increasing and values (K,), got shapes "
                             f"{x.shape}, {y.shape}")
        if np.isnan(y).any():
            raise ValueError(f"tables[{h}].values must not be NaN")
        xs.append(x)
        ys.append(np.where(np.isinf(y), _BIG, y))
    lows = np.array([x[0] for x in xs])
    if total < lows.sum():
        raise ValueError(f"total must be at least the sum of the heads' smallest budgets "
                         f"(sinks + window + 1 each, or n_h), {int(lows.sum())}; got {total}")
    H = len(xs)
    hulls = [_lower_hull(x.astype(np.float64), y) for x, y in zip(xs, ys)]
    convex = np.array([len(hl) == len(x) or _on_hull(x, y, hl) for x, y, hl in zip(xs, ys, hulls)])
    segs = []  # (-gain, head, j, cost)
    for h, (x, y, hl) in enumerate(zip(xs, ys, hulls)):
        for j in range(len(hl) - 1):
            a, b = hl[j], hl[j + 1]
            cost = int(x[b] - x[a])
            segs.append((-(y[a] - y[b]) / cost, h, j, cost))
    segs.sort()
    pos = np.zeros(H, dtype=np.int64)  # index into the head's grid
    nxt = np.zeros(H, dtype=np.int64)  # next hull segment
    blocked = np.zeros(H, dtype=bool)
    left = total - int(lows.sum())
    relaxed = lows.astype(np.float64)  # the continuous relaxation takes segments in the same order, the last in part
    relax_left, multiplier = float(left), 0.0
    for neg, h, j, cost in segs:
        gain = -neg
        if relax_left > 0:
            take = min(cost, relax_left)
            relaxed[h] += take
            relax_left -= take
        if blocked[h] or j != nxt[h]:
            continue
        if cost <= left:
            pos[h] = hulls[h][j + 1]
            nxt[h] += 1
            left -= cost
            multiplier = gain
        else:
            blocked[h] = True
    pos, left = _exchange(xs, ys, pos, left)
    # a second start: the equal split on the grid, improved the same way; the better one is kept
    even = uniform_budgets([int(x[-1]) for x in xs], total, sinks=0, window=0).numpy()
    even = np.maximum(even, lows)
    if even.sum() <= total:
        start = np.array([int(np.searchsorted(x, b, side="right")) - 1 for x, b in zip(xs, even)])
        start = np.maximum(start, 0)
        alt, alt_left = _exchange(xs, ys, start, total - int(sum(x[k] for x, k in zip(xs, start))))
        if sum(y[k] for y, k in zip(ys, alt)) < sum(y[k] for y, k in zip(ys, pos)):
            pos, left = alt, alt_left
    budget = torch.tensor([int(x[p]) for x, p in zip(xs, pos)], dtype=torch.int64)
    value = torch.tensor([float(np.asarray(t.values)[p]) for t, p in zip(tables, pos)], dtype=torch.float64)
    bound = sum(float(np.interp(r, x[hl].astype(np.float64), y[hl])) for r, x, y, hl in zip(relaxed, xs, ys, hulls))
    return Allocation(budget, value, bound, torch.from_numpy(convex), float(multiplier))


class FlooredAllocation(NamedTuple):
    """What :func:`allocate_at_uniform_memory` chose: ``allocation`` over the H heads (:class:`Allocation`),
    ``total`` the kept tokens of the uniform budget (round(B) H) and ``floor`` the smallest budget a head may
    take below its :math:`n_h`."""

    allocation: Allocation
    total: int
    floor: int


def allocate_at_uniform_memory(tables: Sequence[ObjectiveTable], budget: float, *, floor_share: float = 0.5,
                               sinks: int = 4, window: int = 32) -> FlooredAllocation:
    r"""Neyman-style budgets at the memory of a uniform budget B per head, with floors.

    .. math:: T = \operatorname{round}(B)\, H, \qquad
              B_{\text{floor}} = \max\bigl(\text{sinks} + \text{window} + 1,\ \lceil \phi B \rceil\bigr),

    :math:`\phi` = ``floor_share``; each head's table is cut below :math:`B_{\text{floor}}` (its last point,
    :math:`n_h`, stays: a head may keep every token), then :func:`allocate_from_tables` with the total T.
    The floor keeps every head a share of the uniform budget whatever the window queries predict (heads
    whose variance at the window is small may still be read by later queries).

    Parameters
    ----------
    tables : H :class:`ObjectiveTable` (:func:`objective_tables`; ``step`` > 1 allowed)
    budget : float > 0, the uniform budget B per head (``PoissonPress``'s ``n (1 - compression_ratio)``)
    floor_share : float in [0, 1], :math:`\phi`
    sinks, window : int >= 0, the token design's certainty edges

    Raises
    ------
    ValueError
        A bad ``budget`` or ``floor_share``; a floor above the grid's reach (the cut tables' smallest budgets
        sum to more than T: lower ``floor_share`` or the grid's step).
    """
    budget = float(budget)
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite number > 0 (the uniform budget per head), got {budget}")
    if isinstance(floor_share, bool) or not (0.0 <= float(floor_share) <= 1.0):
        raise ValueError(f"floor_share must be a number in [0, 1] (a share of the uniform budget), got {floor_share!r}")
    sinks, window = check_nonneg_int("sinks", sinks), check_nonneg_int("window", window)
    total = int(round(budget)) * len(tables)
    floor_b = max(sinks + window + 1, math.ceil(float(floor_share) * budget))
    cut = []
    for tab in tables:
        x, y = np.asarray(tab.budgets), np.asarray(tab.values)
        keep = (x >= floor_b) | (x == x[-1])
        cut.append(ObjectiveTable(x[keep], y[keep]))
    lows = sum(int(t.budgets[0]) for t in cut)
    if lows > total:
        raise ValueError(f"floor_share: the floor {floor_b} leaves the heads' smallest grid budgets summing to {lows}, "
                         f"above the uniform total round(budget) x heads = {total} (budget {budget}): lower "
                         f"floor_share or the grid's step")
    return FlooredAllocation(allocate_from_tables(cut, total), total, floor_b)


def _exchange(xs, ys, pos, left, max_rounds: int = 100_000):
    """Local search on the grid: the best single move (one head takes grid points up, paid by the leftover
    and at most one other head going down) while it lowers the summed objective; returns (pos, left)."""
    pos = np.asarray(pos, dtype=np.int64).copy()
    H = len(xs)
    E = int(max(x[-1] - x[0] for x in xs)) + 1
    for _ in range(max_rounds):
        cur = np.array([y[p] for y, p in zip(ys, pos)])
        scale = max(float(np.abs(cur).sum()), 1e-300)
        gains = np.full((H, E + 1), -np.inf)  # gains[h, e]: best decrease of F_h taking at most e more tokens
        for h in range(H):
            x, y, p = xs[h], ys[h], pos[h]
            up = slice(p + 1, None)
            np.maximum.at(gains[h], x[up] - x[p], cur[h] - y[up])
        gains = np.maximum.accumulate(gains, axis=1)
        best_head = np.argmax(gains, axis=0)
        best = gains[best_head, np.arange(E + 1)]
        masked = gains.copy()
        masked[best_head, np.arange(E + 1)] = -np.inf
        second = masked.max(axis=0)
        move = None
        e0 = min(left, E)
        if best[e0] > 1e-12 * scale:
            move = (best[e0], None, None, int(best_head[e0]), e0)
        for a in range(H):
            x, y, p = xs[a], ys[a], pos[a]
            if p == 0:
                continue
            freed = x[p] - x[:p]
            room = np.minimum(freed + left, E)
            partner = np.where(best_head[room] == a, second[room], best[room])
            gain = partner - (y[:p] - cur[a])
            k = int(np.argmax(gain))
            if gain[k] > 1e-12 * scale and (move is None or gain[k] > move[0]):
                b = int(best_head[room[k]]) if best_head[room[k]] != a else int(np.argmax(masked[:, room[k]]))
                move = (gain[k], a, k, b, int(room[k]))
        if move is None:
            break
        _, a, k, b, room = move
        if a is not None:
            left += int(xs[a][pos[a]] - xs[a][k])
            pos[a] = k
        x, y, p = xs[b], ys[b], pos[b]
        reach = np.flatnonzero((x > x[p]) & (x <= x[p] + room))
        kb = int(reach[np.argmin(y[reach])])
        left -= int(x[kb] - x[p])
        pos[b] = kb
    return pos, left


def convexity_gap(table: ObjectiveTable) -> float:
    r"""How far a head's table is from convex: :math:`\max_k (F_k - \check F_k) / F_k` over its grid,
    :math:`\check F` the lower convex hull (0 for a convex table; where the hull greedy alone is exact)."""
    x = np.asarray(table.budgets, dtype=np.float64)
    y = np.asarray(table.values, dtype=np.float64)
    y = np.where(np.isinf(y), _BIG, y)
    hull = _lower_hull(x, y)
    gap = y - np.interp(x, x[hull], y[hull])
    return float(np.max(np.where(gap > 0, gap / np.maximum(y, 1e-300), 0.0)))


def _on_hull(x, y, hull) -> bool:
    """Whether every point lies on the lower hull's interpolation (relative slack 1e-12)."""
    interp = np.interp(x.astype(np.float64), x[hull].astype(np.float64), y[hull])
    return bool((y <= interp + 1e-12 * np.maximum(np.abs(y), np.abs(interp)) + 1e-300).all())


def allocate_budgets(terms, norm2, importance, total: int, *, delta: float = 0.05, kind: str = "chebyshev",
                     sinks: int = 4, window: int = 32, top_fraction: float = 0.5, floor: float = 0.1,
                     objective: str = "relative", step: int = 1) -> Allocation:
    r"""Neyman-style allocation: the integer budgets :math:`B_h \in [B_{\min,h}, n_h]`, :math:`\sum_h B_h \le T`
    (as close as the grid allows), minimizing :math:`\sum_h F_h(B_h)`, the summed predicted relative variance
    of the window queries (module docstring has the formula and the solver).

    Parameters
    ----------
    terms, norm2, importance : per head, as :func:`objective_tables` takes them
    total : int, T, at least :math:`\sum_h B_{\min,h}`
    delta, kind, sinks, window, top_fraction, floor, objective, step : as :func:`objective_tables`

    Returns
    -------
    Allocation

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast.allocation import allocate_budgets
    >>> g = torch.Generator().manual_seed(0)
    >>> terms, norm2 = torch.rand(3, 4, 60, generator=g, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64)
    >>> terms[0] *= 10  # the first head's variance is larger: it gets more tokens
    >>> a = allocate_budgets(terms, norm2, torch.rand(3, 60, generator=g, dtype=torch.float64), 120, sinks=2, window=4)
    >>> int(a.budget.sum()), bool(a.budget[0] > a.budget[1:].max())
    (120, True)
    """
    tables = objective_tables(terms, norm2, importance, delta=delta, kind=kind, sinks=sinks, window=window,
                              top_fraction=top_fraction, floor=floor, objective=objective, step=step)
    return allocate_from_tables(tables, total)


def head_objectives(terms, norm2, importance, budgets, *, delta: float = 0.05, kind: str = "chebyshev",
                    sinks: int = 4, window: int = 32, top_fraction: float = 0.5, floor: float = 0.1,
                    objective: str = "relative") -> torch.Tensor:
    r""":math:`F_h(B_h)` (H,) float64 at given per-head budgets (H,) (each in :math:`[B_{\min,h}, n_h]`), to
    compare any allocation with :func:`allocate_budgets`'s."""
    delta, sinks, window, top_fraction, floor, _ = _check_options(delta, kind, sinks, window, top_fraction,
                                                                   floor, objective, 1)
    heads = _heads(terms, norm2, importance)
    budgets = torch.as_tensor(budgets)
    if budgets.shape != (len(heads),):
        raise ValueError(f"budgets must have shape (H,) = ({len(heads)},), got {tuple(budgets.shape)}")
    out = torch.zeros(len(heads), dtype=torch.float64)
    for h, (t, o, u) in enumerate(heads):
        n = t.shape[-1]
        b = float(budgets[h])
        low = min(sinks + window + 1, n)
        if not (low <= b <= n):
            raise ValueError(f"budgets[{h}] must be in [{low}, {n}] (sinks + window + 1 .. n_h), got {b}")
        if b < n:
            out[h] = _curve(t[None], o[None], u[None], torch.tensor([[b]], dtype=torch.float64, device=t.device),
                            delta=delta, kind=kind, sinks=sinks, window=window, top_fraction=top_fraction,
                            floor=floor, objective=objective)[0, 0].cpu()
    return out


# ---------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------


def _bounds(n, sinks: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    n = np.asarray([check_nonneg_int(f"n[{h}]", int(v)) for h, v in enumerate(n)], dtype=np.int64)
    if n.size == 0 or (n < 1).any():
        raise ValueError(f"n must hold H >= 1 head lengths >= 1, got {n.tolist()}")
    return np.minimum(sinks + window + 1, n), n


def _check_total(total, low: np.ndarray) -> int:
    """``total`` as an int, refused below the sum of the heads' smallest budgets ``low``."""
    total = check_nonneg_int("total", total)
    if total < low.sum():
        raise ValueError(f"total must be at least the sum of the heads' smallest budgets (sinks + window + 1 "
                         f"each, or n_h), {int(low.sum())}; got {total}")
    return total


def _fit_to_total(x: np.ndarray, low: np.ndarray, high: np.ndarray, total: int) -> torch.Tensor:
    r"""Integers :math:`B_h = \operatorname{clip}(x_h + c, \text{low}_h, \text{high}_h)` rounded, the level c
    solved (bisection) so that :math:`\sum B_h = \min(T, \sum \text{high})`; largest remainders round up."""
    total = _check_total(total, low)
    if total >= high.sum():
        return torch.from_numpy(high.copy())
    x = x.astype(np.float64)
    lo, hi = float(low.min() - x.max()) - 1.0, float(high.max() - x.min()) + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if np.clip(x + mid, low, high).sum() > total:
            hi = mid
        else:
            lo = mid
    y = np.clip(x + lo, low, high)
    b = np.floor(y).astype(np.int64)
    rest = total - int(b.sum())
    order = np.argsort(-(y - b), kind="stable")
    for h in order:
        if rest <= 0:
            break
        if b[h] < high[h]:
            b[h] += 1
            rest -= 1
    return torch.from_numpy(b)


def uniform_budgets(n, total: int, *, sinks: int = 4, window: int = 32) -> torch.Tensor:
    r"""Equal budgets :math:`B_h \approx T / H` (int64 (H,), sum T), clipped to :math:`[B_{\min,h}, n_h]` with the
    excess of short heads spread over the others. ``n``: the heads' lengths (H,)."""
    low, high = _bounds(n, sinks, window)
    return _fit_to_total(np.zeros(len(high)), low, high, total)


def adakv_budgets(importance, total: int, *, sinks: int = 4, window: int = 32,
                  safeguard: float = 0.2) -> torch.Tensor:
    r"""AdaKV-style baseline (Feng et al. 2024, Ada-KV): the global top of the heads' attention shares.

    Each head's importance is normalized to shares :math:`a_{hi} = u_{hi} / \sum_j u_{hj}` (SnapKV's
    window attention: the head's attention mass per token). Every head first gets
    :math:`\max(B_{\min,h}, \lfloor \text{safeguard}\cdot T/H \rfloor)` (AdaKV's safety floor, capped at
    :math:`n_h`); the rest of the total goes to the largest shares over all heads' other tokens, so a head
    keeps every token whose share is above a common threshold t: heads whose attention is spread out
    need more tokens to cover the same mass and get more. Shares of the certainty edges (sinks, window) and
    of the tokens the floor already covers (the head's largest free shares) are not counted again.

    Parameters
    ----------
    importance : (H, n) tensor or sequence of H (n_h,) tensors, the scorer's scores (shifted >= 0 per head)
    total : int, T
    sinks, window : the certainty edges (kept anyway)
    safeguard : float in [0, 1], the share of the uniform budget every head is guaranteed

    Returns
    -------
    int64 (H,), sum min(T, sum n_h)
    """
    safeguard = float(safeguard)
    if not 0.0 <= safeguard <= 1.0:
        raise ValueError(f"safeguard must be in [0, 1], got {safeguard}")
    sinks, window = check_nonneg_int("sinks", sinks), check_nonneg_int("window", window)
    if isinstance(importance, torch.Tensor):
        importance = list(check_tensor("importance", importance, ndim=(2,), floating=True).unbind(0))
    us = [check_tensor(f"importance[{h}]", u, ndim=(1,), floating=True) for h, u in enumerate(importance)]
    for h, u in enumerate(us):
        if not bool(torch.isfinite(u).all()):
            raise ValueError(f"importance[{h}] must be finite (found NaN or inf)")
    low, high = _bounds([u.numel() for u in us], sinks, window)
    total = _check_total(total, low)
    if total >= high.sum():
        return torch.from_numpy(high.copy())
    H = len(us)
    start = np.minimum(np.maximum(low, int(math.floor(safeguard * total / H))), high)
    if start.sum() > total:  # the floor does not fit: scale it back to the total
        return _fit_to_total(np.zeros(H), low, high, total)
    values, owner = [], []
    for h, u in enumerate(us):
        u = nonnegative_importance(u.to(torch.float64))
        n = u.numel()
        if start[h] >= n:
            continue
        s, w = min(sinks, n), min(window, max(n - sinks, 0))
        free = u[s:n - w]
        share = free / u.sum().clamp_min(torch.finfo(torch.float64).tiny)
        ranked = torch.sort(share, descending=True).values[int(start[h]) - s - w:]  # B_min holds one free token
        values.append(ranked)
        owner.append(torch.full((ranked.numel(),), h, dtype=torch.int64))
    left = total - int(start.sum())
    budget = torch.from_numpy(start.copy())
    if values and left > 0:
        vals, own = torch.cat(values), torch.cat(owner)
        order = torch.sort(vals, descending=True, stable=True).indices[:left]
        budget += torch.bincount(own[order], minlength=H)
    return budget


def pyramid_budgets(n_layers: int, total: int, *, heads_per_layer: int, n, sinks: int = 4, window: int = 32,
                    beta: float = 20.0) -> torch.Tensor:
    r"""PyramidKV baseline (Cai et al. 2024): budgets decreasing linearly with depth, the same total.

    With :math:`\mu = T / (L H_l)` the mean per head, the last layer gets :math:`k_{L-1} = \mu/\beta`, the
    first :math:`k_0 = 2\mu - k_{L-1}`, layer l the linear interpolation
    :math:`k_l = k_0 - l (k_0 - k_{L-1})/(L - 1)` (every head of a layer the same); then clipped to
    :math:`[B_{\min,h}, n_h]` and shifted by a common level so the integers sum to T (:func:`uniform_budgets`'s
    fitting). ``beta = 1`` is the uniform allocation.

    Parameters
    ----------
    n_layers : int >= 1, L
    total : int, T
    heads_per_layer : int >= 1, KV heads per layer
    n : int or (L * heads_per_layer,) head lengths, layer-major
    beta : float >= 1

    Returns
    -------
    int64 (L * heads_per_layer,), layer-major
    """
    L, Hl = check_nonneg_int("n_layers", n_layers), check_nonneg_int("heads_per_layer", heads_per_layer)
    if L < 1 or Hl < 1:
        raise ValueError(f"n_layers and heads_per_layer must be >= 1, got {L}, {Hl}")
    beta = float(beta)
    if not (beta >= 1.0 and math.isfinite(beta)):
        raise ValueError(f"beta must be a finite float >= 1, got {beta}")
    n = [n] * (L * Hl) if isinstance(n, (int, np.integer)) and not isinstance(n, bool) else list(n)
    if len(n) != L * Hl:
        raise ValueError(f"n must be an int or hold n_layers * heads_per_layer = {L * Hl} lengths, got {len(n)}")
    low, high = _bounds(n, sinks, window)
    mu = check_nonneg_int("total", total) / (L * Hl)
    last = mu / beta
    first = 2.0 * mu - last
    k = first - np.arange(L) * ((first - last) / (L - 1) if L > 1 else 0.0)
    return _fit_to_total(np.repeat(k, Hl), low, high, total)
