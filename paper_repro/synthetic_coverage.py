"""Table 2a: coverage of every certificate kind on synthetic attention.

Cells = (regime, budget, head); each cell is one synthetic head with its own
future query, replayed over ``draws`` independent Poisson samples. Reported
per (regime, budget, kind, delta): pooled coverage (all draws of all cells),
the mean coverage of the worst decile of cells, the Spearman correlation
across cells of the median radius and the realized RMS error, and the
tightness median_cells(median radius / RMS error).

The draws of a cell are replayed in one batch by ``kvcert.fast`` in float64
(:func:`draw_estimates`, which Tables 2 and 2d use too); ``kvcert.fast`` is
checked against the float64 reference by the property tests, and
``tests/test_paper_repro.py`` checks this replay against a per-draw loop over
``kvcert.reference``.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

import kvcert.fast as F
from kvcert import reference as R

from .common import Config, Table, progress
from .synthetic import REGIMES, design_pi, make_head


#: draw_estimates packs the draws when they keep less than this fraction of the tokens on average
#: (measured on Table 2a's cells, n = 1024, 200 draws: packed 0.47x / 0.73x / 1.20x the time of the
#: unpacked replay at budgets 0.1 / 0.25 / 0.5)
PACK_BELOW = 0.4


def draw_estimates(q, k, v, pi, qpos, scale, kinds_need, *, block_size: int | None = None,
                   pack: bool | None = None):
    """fast.hajek_attention over M draws: q (g, Q, d), k/v (n, d), pi (M, n) (0 = not sampled).

    With ``pack`` each draw's sample is first packed (``kvcert.fast.compact``),
    as a serving cache would hold it, so the cost scales with the kept count,
    not n; without, the draws share the full k/v (stride 0 over M) and the
    unsampled tokens are padding (pi = 0): the same estimate (to rounding),
    cheaper when the draws keep most tokens. None (default): pack when the
    draws keep less than ``PACK_BELOW`` of the tokens on average. With
    ``block_size`` the sample is a block sample and ``fast.block_hajek_attention``
    gives the cluster-sampling variance (Table 2d). ``qpos`` (Q,) positions of
    the queries (causal mask), or None (every query sees every token).
    """
    M, n = pi.shape
    if pack is None:
        pack = bool((pi > 0).double().mean() < PACK_BELOW)
    positions = torch.arange(n).expand(M, 1, n)
    keys, values, p = k.expand(M, 1, *k.shape), v.expand(M, 1, *v.shape), pi[:, None, :]
    if pack:
        cc = F.compact(p > 0, keys, values, p, positions)
        keys, values, p, positions = cc.keys, cc.values, cc.pi, cc.positions
    causal = {} if qpos is None else dict(positions=positions, query_positions=qpos)
    kw = dict(scale=scale, **causal, **F.estimate_options(kinds_need))
    if block_size is not None:
        return F.block_hajek_attention(q.expand(M, *q.shape), keys, values, p, block_size=block_size, **kw)
    # validate=False: pi is made here (in [0, 1], every query sees a certain token), so the value checks,
    # a tenth of Table 2's time, would find nothing; shapes are still checked
    return F.hajek_attention(q.expand(M, *q.shape), keys, values, p, validate=False, **kw)


def draw_statistics(est, exact, kinds, deltas) -> list:
    """Per query head j and query t of a batched estimate over M draws (output (M, g, Q, dv)) and the
    exact output (g, Q, dv): the cell's (err (M,), radius {(kind, delta): (M,)}, hit {(kind, delta): (M,)}),
    in the order j-major. Norm kinds: hit = ||o_hat - o|| <= radius. ``wald`` (per coordinate): hit =
    the fraction of coordinates inside their interval, radius = the norm of the half-widths."""
    err = (est.output - exact).norm(dim=-1)                               # (M, g, Q)
    radius, hit = {}, {}
    for kind in kinds:
        for d in deltas:
            r = F.certificate(est, delta=d, kind=kind).radius
            if R.CERTIFICATE_KINDS[kind].per_coordinate:
                hit[kind, d] = ((est.output - exact).abs() <= r).double().mean(-1)
                radius[kind, d] = r.norm(dim=-1).double()
            else:
                hit[kind, d] = (err <= r).double()
                radius[kind, d] = r.double()
    _, g, Q = err.shape
    return [(err[:, j, t].double().numpy(), {key: x[:, j, t].numpy() for key, x in radius.items()},
             {key: x[:, j, t].numpy() for key, x in hit.items()}) for j in range(g) for t in range(Q)]


def replay_draws(q, keys, values, pi, draws, rng, *, kinds, deltas, scale=None):
    """One head and one query over ``draws`` Poisson samples, batched (float64): (err (draws,),
    radius {(kind, delta): (draws,)}, hit {(kind, delta): (draws,)}) as :func:`draw_statistics`.

    Draw t keeps token i iff U_ti < pi_i with U = ``rng.random((draws, n))`` (the stream
    ``reference.poisson_sample(pi, generator=rng)`` reads, draw after draw); the truth is
    ``reference.attention``. q (d,), keys (n, d), values (n, dv), pi (n,) NumPy arrays."""
    qt, kt, vt = (torch.from_numpy(np.ascontiguousarray(x, dtype=np.float64)) for x in (q, keys, values))
    p = torch.from_numpy(np.asarray(pi, dtype=np.float64))
    keep = torch.from_numpy(rng.random((draws, p.numel()))) < p
    exact = torch.from_numpy(R.attention(q, keys, values, scale=scale))[None, None]        # (1, 1, dv)
    est = draw_estimates(qt[None, None], kt, vt, torch.where(keep, p, 0.0), None, scale, kinds)
    return draw_statistics(est, exact, kinds, deltas)[0]


def replay_cell(head, pi, draws, deltas, rng):
    """Replay one cell: per kind and delta, arrays (draws,) of radius and hit, and the errors
    (:func:`replay_draws` with every kind)."""
    return replay_draws(head.q, head.keys, head.values, pi, draws, rng, kinds=R.KINDS, deltas=deltas)


def summarize(cells, kind, delta):
    """cells: list of (err, radius, hit) -> the four summary statistics."""
    cov = np.array([c[2][kind, delta].mean() for c in cells])
    rms = np.array([np.sqrt(np.mean(c[0] ** 2)) for c in cells])
    med = np.array([np.median(c[1][kind, delta]) for c in cells])
    worst = np.sort(cov)[: max(1, int(np.ceil(0.1 * cov.size)))]
    rho = stats.spearmanr(med, rms).statistic if np.ptp(rms) > 0 and np.ptp(med) > 0 else np.nan
    tight = np.median(med / np.where(rms > 0, rms, np.nan))
    return dict(coverage=float(cov.mean()), worst_decile=float(worst.mean()),
                spearman=float(rho), tightness=float(tight))


def run(cfg: Config) -> Table:
    rng = np.random.default_rng([cfg.seed, 2])
    rows = []
    jobs = [(r, b) for r in REGIMES for b in cfg.budgets]
    for regime, budget in progress(jobs, desc="T2a synthetic coverage", enabled=cfg.progress):
        cells = []
        for _ in range(cfg.cells):
            head = make_head(rng, regime, n=cfg.n, d=cfg.d, dv=cfg.dv)
            pi = design_pi(head, budget)
            cells.append(replay_cell(head, pi, cfg.draws, cfg.deltas, rng))
        for kind in R.KINDS:
            for delta in cfg.deltas:
                rows.append(dict(regime=regime, budget=budget, kind=kind, delta=delta,
                                 nominal=1 - delta, **summarize(cells, kind, delta)))
    notes = [
        f"{cfg.cells} cells per (regime, budget), {cfg.draws} Poisson draws per cell; n = {cfg.n}, "
        f"d = dv = {cfg.d}; design: sinks 4, window 32, top slice half the free budget, floor 0.1, "
        "SnapKV importance from an 8-query observation window.",
        "coverage: pooled over all draws of all cells (wald: fraction of coordinates covered). "
        "worst_decile: mean coverage of the 10% of cells with the lowest coverage. spearman: across "
        "cells, median radius vs realized RMS error. tightness: median over cells of "
        "median radius / RMS error (1 would be a radius equal to the typical error).",
    ]
    return Table("table2a_synthetic_coverage", "Table 2a: certificate coverage on synthetic attention",
                 rows, notes)
