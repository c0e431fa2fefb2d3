"""Table 2d: the block (cluster) design beside the token design at equal expected memory (issue 12).

The replay cells of Table 2 (:mod:`paper_repro.replay`: real model, real text,
eviction after the prefix, future queries), with the design that a paged
serving engine can free memory with: whole blocks of ``block_size`` tokens
sampled with known pi_b, **the same blocks for every layer and KV head** of
the sequence (one block table), every token of a kept block offset by
-log pi_b, and the cluster-sampling certificate
(:func:`kvcert.fast.block_hajek_attention`; docs/theory.md section 7).

Equal expected memory: at kept fraction f of the prefix of L tokens, the token
design keeps f L tokens per KV head in expectation (``paper``: Table 2's
design), the block design f L / block_size blocks of every layer and head.
The block design's certainty set is the token design's in blocks: sink blocks
covering the 4 sinks, recent blocks covering the 32-token window, and half
of the free budget as certain top blocks, sized by
:func:`kvcert.fast.design_sizes` in block units. Block importance: SnapKV
importance (32-query window) of every layer and KV head, each head's block
totals normalized to shares, then the mean (``mean``) or the max (``max``)
over all 30 x 3 heads (:func:`kvcert.fast.block_importance`).

A draw samples the blocks once for the whole model; each (layer, KV head) cell
then sees the same kept blocks, so the cells of one draw are dependent (the
coverage is still a per-cell frequency over independent draws).
"""

from __future__ import annotations

import math

import numpy as np
import torch

import kvcert.fast as F

from .common import Config, Table, progress
from .replay import _layer_importance, setup_for
from .synthetic import SINKS, WINDOW, paper_press, press_pi
from .synthetic_coverage import draw_estimates, draw_statistics, summarize

#: compared designs: name -> (block_size, reduce); block_size None = the token design ("paper" of Table 2)
BLOCK_DESIGNS = {"token": (None, None), "block16_mean": (16, "mean"), "block16_max": (16, "max"),
                 "block128_mean": (128, "mean")}
KIND = "chebyshev"  # the default certificate; the block trace is the cluster-sampling trace


def block_design_pi(importance: torch.Tensor, fraction: float, block_size: int, reduce: str) -> torch.Tensor:
    """pi_b (n_blocks,) float64 of the block design at kept fraction ``fraction`` of the L prefix tokens.

    importance: (layers, h_kv, L) token importance of every head sharing the block table.
    Budget f L / block_size blocks; certainty set = the token design's sinks, window and top slice
    in blocks (``kvcert.fast.design_sizes``). Raises ValueError where the budget cannot hold the
    certainty set (e.g. f = 0.1 with 128-token blocks: 1.4 blocks).
    """
    L = importance.shape[-1]
    budget = fraction * L / block_size
    sizes = F.design_sizes(budget, sinks=math.ceil(SINKS / block_size), window=math.ceil(WINDOW / block_size),
                           top_fraction=0.5)
    if sizes.sinks + sizes.window < math.ceil(SINKS / block_size) + math.ceil(WINDOW / block_size):
        raise ValueError(f"budget {budget:.2f} blocks of {block_size} tokens cannot hold the sink and recent "
                         f"blocks")
    return F.block_inclusion_probabilities(importance[None].double(), budget, block_size=block_size,
                                           sink_blocks=sizes.sinks, recent_blocks=sizes.window,
                                           top_blocks=sizes.top, floor=0.1, reduce=reduce)[0]


def run(cfg: Config, captured, *, designs=None, draws: int | None = None) -> Table:
    """T2d: coverage, worst decile, tightness and relative error of the block and token designs.

    ``designs`` (names of :data:`BLOCK_DESIGNS`, default all) and ``draws`` (default: Table 2's
    draws per cell) shrink the run, e.g. for tests.
    """
    setup = setup_for(cfg)
    if draws is not None:
        setup.draws = draws
    chosen = {name: BLOCK_DESIGNS[name] for name in (designs or BLOCK_DESIGNS)}
    L, Fut = setup.prefix, setup.future
    T = L + Fut
    scale, g = captured.scaling, captured.group
    h_kv = captured.keys[0].shape[0]
    qpos = torch.tensor([L + o for o in setup.query_offsets])
    rng = np.random.default_rng([cfg.seed, 4])
    importance = torch.stack([torch.from_numpy(_layer_importance("snapkv", captured.queries[layer],
                                                                  captured.keys[layer], captured.values[layer],
                                                                  L, scale, seed=cfg.seed + layer))
                              for layer in range(captured.layers)])          # (layers, h_kv, L)
    designs = {}  # (fraction, name) -> (block_size, pi_b (nb,) or None, keep_b (M, nb) or None) | reason str
    for fraction in cfg.budgets:
        for name, (bs, reduce) in chosen.items():
            if bs is None:
                designs[fraction, name] = (None, None, None)
                continue
            try:
                pib = block_design_pi(importance, fraction, bs, reduce)
            except ValueError as err:
                designs[fraction, name] = str(err)
                continue
            keep = torch.from_numpy(rng.random((setup.draws, pib.shape[0]))) < pib
            designs[fraction, name] = (bs, pib, keep)
    cells, errors, jobs = {}, {}, [(layer, h) for layer in range(captured.layers) for h in range(h_kv)]
    for layer, h in progress(jobs, desc="T2d block-design replay", enabled=cfg.progress):
        k = captured.keys[layer][h, :T]
        v = captured.values[layer][h, :T]
        q = captured.queries[layer][h * g:(h + 1) * g, :T][:, qpos]          # (g, Q, d)
        exact = F.hajek_attention(q[None], k[None, None], v[None, None], torch.ones(1, 1, T), scale=scale,
                                  query_positions=qpos, per_coordinate=False).output[0]  # (g, Q, dv)
        onorm = exact.norm(dim=-1)
        for (fraction, name), spec in designs.items():
            if isinstance(spec, str):
                continue
            bs, pib, keep_b = spec
            if bs is None:  # Table 2's token design, its own draws
                pi = torch.from_numpy(press_pi(paper_press(fraction), importance[layer, h].numpy())).float()
                keep = torch.from_numpy(rng.random((setup.draws, L))) < pi
            else:
                pi = F.expand_blocks(pib.float(), bs, L)
                keep = F.block_keep(keep_b, bs, L)
            pis = torch.cat([torch.where(keep, pi, 0.0), torch.ones(setup.draws, Fut)], dim=1)
            est = draw_estimates(q, k, v, pis, qpos, scale, (KIND,), block_size=bs)
            cells.setdefault((fraction, name), []).extend(draw_statistics(est, exact, (KIND,), cfg.deltas))
            err = (est.output - exact).norm(dim=-1)                                # (M, g, Q)
            errors.setdefault((fraction, name), []).extend((err / onorm).mean(0).flatten().tolist())
    rows = []
    for fraction in cfg.budgets:
        for name, (bs, reduce) in chosen.items():
            spec = designs[fraction, name]
            base = dict(budget=fraction, design=name, block_size=bs or 1)
            if isinstance(spec, str):
                rows.append(dict(base, cells=0, note=spec))
                continue
            kept = fraction if bs is None else float(F.expand_blocks(spec[1], bs, L).sum()) / L
            for d in cfg.deltas:
                rows.append(dict(base, kind=KIND, delta=d, nominal=1 - d, cells=len(cells[fraction, name]),
                                 expected_kept=kept, **summarize(cells[fraction, name], KIND, d),
                                 mean_relative_error=float(np.mean(errors[fraction, name])), note=""))
    notes = [
        f"Replay cells of Table 2 ({captured.layers} layers x {h_kv * g} query heads x "
        f"{len(setup.query_offsets)} future queries, eviction after {L} pydoc tokens), {setup.draws} draws "
        f"per cell; certificate `{KIND}` (for blocks: radius sqrt(trace / delta) with the cluster-sampling "
        "trace sum_{b in S} (1 - pi_b) ||sum_{i in b} a_i (v_i - o_hat)||^2).",
        "token: Table 2's `paper` design (per KV head, SnapKV importance). blockB_mean / blockB_max: whole "
        "blocks of B tokens, one sample for all layers and heads, block importance = mean / max over the "
        "90 heads of each head's normalized block totals of SnapKV importance; certainty set in blocks "
        "(sink and recent blocks covering 4 sinks and a 32-token window, half the free budget as top "
        "blocks), floor 0.1. expected_kept: sum_b pi_b |b| / L (= budget: equal expected memory).",
        "mean_relative_error: ||o_hat - o|| / ||o||, mean over draws, then cells. A row with cells = 0 "
        "names why the design cannot run at that budget.",
    ]
    return Table("table2d_block_design", "Table 2d: block design vs token design at equal expected memory",
                 rows, notes)
