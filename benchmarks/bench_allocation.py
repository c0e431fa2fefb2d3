#!/usr/bin/env python
"""Budget allocation across (layer, KV head) on the real default model: uniform, Neyman, AdaKV-style, Pyramid.

At one total memory T = f * L * H (H = every (layer, KV head) of the prompt, L its prefix length: the
memory of the uniform kept fraction f), four allocations of T over the heads
(``kvcert.fast.allocation``):

- ``uniform``: B_h = f L (``uniform_budgets``);
- ``neyman``: ``allocate_budgets``'s minimizer of the summed predicted relative variance of the window
  queries, sum_h (1/m) sum_q V_hq(B_h) / ||o_hq||^2 (``objective_tables`` once per prompt, with grid
  ``--step``, then ``allocate_from_tables`` per f);
- ``adakv``: ``adakv_budgets`` (global top-T of the heads' SnapKV attention shares, safeguard 0.2);
- ``pyramid``: ``pyramid_budgets`` (linear in depth, beta = 20).

Replay as ``benchmarks/bench_target.py`` and ``paper_repro/replay.py`` build it: one held-out pydoc topic
(``debugger``: none of its 32-token runs occurs in paper_repro's replay text), the first L + 32 tokens,
one forward pass capturing every layer's post-RoPE q, k, v (``paper_repro.realmodel.capture``); per layer
SnapKV importance from the last 32 prefix queries (``kvcert.fast.SCORERS["snapkv"]``); each allocation's
budgets go to ``TokenDesign(seed=0).decide(scores, budget=<per-KV-head tensor>, layer=l)`` (sinks 4,
window 32, top_fraction 0.5, floor 0.1) and D Poisson draws (draw e keeps ``design_uniforms(...,
event=e) < pi``); the 32 future tokens are kept with pi = 1. Future queries at L + (0, 10, 20, 31), every
query head, causal. Per (draw, query, query head): the Hajek estimate (``kvcert.fast.hajek_attention``),
its Chebyshev certificate (delta = 0.05) and the relative error ||o_hat - o|| / ||o||.

Reported per (f, allocation): the predicted objective (summed over heads), mean relative error, fraction
of records with error > 0.1, coverage (error <= radius) and the median relative radius (radius / ||o_hat||),
the budgets' min / max; and per prompt the share of heads whose objective table is convex (where the
greedy is exact) and the Neyman solution's gap to the convex relaxation's lower bound.

Usage::

    .venv/bin/python benchmarks/bench_allocation.py --quick   # L = 1024, 16 draws
    .venv/bin/python benchmarks/bench_allocation.py            # L = 2048, 64 draws

Writes JSON (``--out``, default benchmarks/results/allocation.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kvcert.fast as F  # noqa: E402
from benchmarks.bench_target import estimate  # noqa: E402  (Hajek estimates over draws, Chebyshev at delta 0.05)
from benchmarks.runinfo import run_info  # noqa: E402
from kvcert.fast import allocation as A  # noqa: E402

TOPIC = "debugger"  # held out from paper_repro's replay text (benchmarks/bench_target.py checks it)
OFFSETS = (0, 10, 20, 31)
FUTURE = 32
WINDOW = 32
SINKS = 4
DELTA = 0.05
KIND = "chebyshev"
TOP_FRACTION = 0.5
FLOOR = 0.1
THRESHOLD = 0.1
FRACTIONS = (0.1, 0.25, 0.5)
RULES = ("uniform", "neyman", "adakv", "pyramid")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="L = 1024, 16 draws")
    p.add_argument("--prefix", type=int, help="prefix tokens L (default 1024 quick / 2048 full)")
    p.add_argument("--draws", type=int, help="Poisson draws (default 16 quick / 64 full)")
    p.add_argument("--step", type=int, default=1, help="Neyman objective grid step (default 1: every budget)")
    p.add_argument("--layers", type=int, help="first layers only (default all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/allocation.json)")
    args = p.parse_args(argv)
    args.prefix = args.prefix or (1024 if args.quick else 2048)
    args.draws = args.draws or (16 if args.quick else 64)
    args.out = args.out or ROOT / "benchmarks" / "results" / "allocation.json"
    if args.prefix <= 2 * (SINKS + WINDOW + 1):
        p.error(f"--prefix must exceed {2 * (SINKS + WINDOW + 1)}, got {args.prefix}")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from pydoc_data.topics import topics

    from kvcert.models import load_model
    from paper_repro.realmodel import capture

    t0 = time.perf_counter()
    model, tokenizer = load_model()
    model.eval()
    L, D = args.prefix, args.draws
    T = L + FUTURE
    ids = tokenizer(topics[TOPIC].strip(), add_special_tokens=False)["input_ids"]
    if len(ids) < T:
        raise SystemExit(f"topic {TOPIC!r} has {len(ids)} tokens, fewer than L + {FUTURE} = {T}")
    cap = capture(model, torch.tensor([ids[:T]], dtype=torch.long))
    scale = cap.scaling
    n_layers = cap.layers if args.layers is None else min(args.layers, cap.layers)
    h_kv = cap.keys[0].shape[0]
    qpos = torch.tensor([L + o for o in OFFSETS])

    # per layer: SnapKV scores and the window variance terms
    scores, terms, norm2 = [], [], []
    for layer in range(n_layers):
        q, k, v = cap.queries[layer], cap.keys[layer], cap.values[layer]
        qwin = q[None, :, L - WINDOW:L]
        scores.append(F.SCORERS["snapkv"](qwin, k[None, :, :L], v[None, :, :L], scale=scale)[0])  # (h_kv, L)
        t, o = F.window_variance_terms(qwin, k[None, :, :L], v[None, :, :L], scale=scale)
        terms.append(t[0])
        norm2.append(o[0])
    S = torch.cat(scores)  # (H, L), layer-major
    Tm, N2 = torch.cat(terms), torch.cat(norm2)  # (H, m, L), (H, m)
    H = S.shape[0]
    opts = dict(delta=DELTA, kind=KIND, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION, floor=FLOOR)
    t1 = time.perf_counter()
    tables = A.objective_tables(Tm, N2, S, step=args.step, **opts)
    t_tables = time.perf_counter() - t1

    allocations, info = {}, {}
    for f in FRACTIONS:
        total = int(round(f * L)) * H
        t1 = time.perf_counter()
        ney = A.allocate_from_tables(tables, total)
        t_alloc = time.perf_counter() - t1
        allocations[f] = dict(
            uniform=A.uniform_budgets([L] * H, total, sinks=SINKS, window=WINDOW),
            neyman=ney.budget,
            adakv=A.adakv_budgets(S, total, sinks=SINKS, window=WINDOW),
            pyramid=A.pyramid_budgets(n_layers, total, heads_per_layer=h_kv, n=L, sinks=SINKS, window=WINDOW))
        info[f] = dict(total=total, neyman_seconds=t_alloc, neyman_lower_bound=ney.lower_bound,
                       neyman_table_objective=float(ney.objective.sum()), multiplier=ney.multiplier)

    # replay
    acc = {(f, r): dict(err=[], rel=[], rad=[]) for f in FRACTIONS for r in RULES}
    checks = dict(budget_sums_equal_total=all(int(b.sum()) == info[f]["total"] for f in FRACTIONS
                                              for b in allocations[f].values()))
    design = F.TokenDesign(seed=0, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION, floor=FLOOR)
    for layer in range(n_layers):
        q, k, v = cap.queries[layer], cap.keys[layer][:, :T], cap.values[layer][:, :T]
        qf = q[:, qpos]
        full = torch.ones(1, h_kv, T)
        pos1 = torch.arange(T).expand(1, h_kv, T)
        exact = F.hajek_attention(qf[None], k[None], v[None], full, scale=scale, per_coordinate=False,
                                  positions=pos1, query_positions=qpos).output
        norm = exact.norm(dim=-1)
        uni = torch.stack([F.design_uniforms((h_kv, L), design.seed, layer=layer, event=e, row_streams=False)
                           for e in range(D)])
        kd, vd = k.expand(D, *k.shape).contiguous(), v.expand(D, *v.shape).contiguous()
        positions = torch.arange(T).expand(D, h_kv, T).contiguous()
        ones = torch.ones(D, h_kv, FUTURE)
        sl = slice(layer * h_kv, (layer + 1) * h_kv)
        for f in FRACTIONS:
            for r in RULES:
                b = allocations[f][r][sl].to(torch.float64)
                dec = design.decide(scores[layer], budget=b, layer=layer, event=0)
                keep = uni < dec.pi
                if layer == 0 and f == FRACTIONS[0]:
                    checks.setdefault("draw0_equals_decide", True)
                    checks["draw0_equals_decide"] &= bool(torch.equal(keep[0], dec.keep))
                pis = torch.cat([torch.where(keep, dec.pi, 0.0).float(), ones], dim=-1)
                out, rad, rel = estimate(qf, kd, vd, pis, scale, positions, qpos)
                a = acc[f, r]
                a["err"].append(((out - exact).norm(dim=-1) / norm).flatten().double().numpy())
                a["rad"].append((rad / norm).flatten().double().numpy())
                a["rel"].append(rel.flatten().double().numpy())

    results = []
    for f in FRACTIONS:
        for r in RULES:
            a = acc[f, r]
            err, rad, rel = (np.concatenate(a[k]) for k in ("err", "rad", "rel"))
            b = allocations[f][r]
            pred = A.head_objectives(Tm, N2, S, b, objective="relative", **opts)
            results.append(dict(
                fraction=f, rule=r, total=info[f]["total"], budget_sum=int(b.sum()),
                budget_min=int(b.min()), budget_max=int(b.max()), heads_keeping_all=int((b >= L).sum()),
                predicted_relative_variance_sum=float(pred.sum()), records=int(err.size),
                mean_relative_error=float(err.mean()), over_threshold=float((err > THRESHOLD).mean()),
                coverage=float((err <= rad).mean()), median_relative_radius=float(np.median(rel)),
                budgets=b.tolist()))
    def violations(tabs):
        """per head: max over the grid of (F - its lower hull) / F, 0 for a convex table"""
        return np.array([A.convexity_gap(t) for t in tabs])

    viol = violations(tables)
    monotone = np.array([bool((np.diff(t.values) <= 1e-12 * np.abs(t.values[:-1]).max()).all()) for t in tables])
    t1 = time.perf_counter()
    no_top = dict(opts, top_fraction=0.0)
    viol0 = violations(A.objective_tables(Tm, N2, S, step=args.step, **no_top))
    t_no_top = time.perf_counter() - t1
    tols = (1e-9, 1e-6, 1e-3, 1e-2)
    convexity = dict(
        heads_convex_within={f"{t:g}": float((viol <= t).mean()) for t in tols},
        max_relative_violation_quantiles={q: float(np.quantile(viol, float(q))) for q in ("0", "0.5", "0.9", "1")},
        top_fraction_0_heads_convex_within={f"{t:g}": float((viol0 <= t).mean()) for t in tols},
        top_fraction_0_max_relative_violation_quantiles={q: float(np.quantile(viol0, float(q)))
                                                         for q in ("0", "0.5", "0.9", "1")},
        top_fraction_0_seconds=t_no_top)
    convex = viol <= 1e-9

    data = dict(
        **run_info("bench_allocation.py", argv, threads=args.threads,
                   note="measured on a loaded 2-core machine (shared by several agents)"),
        model="SmolLM2-135M-Instruct (kvcert.models.load_model(), offline)",
        setup=dict(topic=TOPIC, prefix=L, future=FUTURE, query_offsets=list(OFFSETS), draws=D, delta=DELTA,
                   kind=KIND, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION, floor=FLOOR,
                   threshold=THRESHOLD, fractions=list(FRACTIONS), layers=n_layers, kv_heads=h_kv, heads=H,
                   query_heads=int(cap.queries[0].shape[0]), neyman_grid_step=args.step,
                   adakv_safeguard=0.2, pyramid_beta=20.0),
        tables=dict(seconds=t_tables, heads_monotone=float(monotone.mean()),
                    grid_points=int(sum(t.budgets.size for t in tables)), **convexity),
        neyman={f"{f:g}": v for f, v in info.items()},
        checks=checks,
        notes=[
            "total = round(f L) * H expected kept tokens, the memory of the uniform kept fraction f; every "
            "allocation spends exactly it (checks.budget_sums_equal_total).",
            "predicted_relative_variance_sum: sum over heads of (1/m) sum_q V_hq(B_h)/||o_hq||^2 for the 32 "
            "window queries (what neyman minimizes on its grid); records: (draw, future query, query head).",
            "over_threshold: fraction of records with ||o_hat - o|| / ||o|| > 0.1; coverage: error <= the "
            "recorded Chebyshev radius (delta = 0.05); median_relative_radius: radius / ||o_hat||.",
            "tables.heads_convex_within[tol]: share of heads whose objective table lies within a relative tol "
            "of its lower convex hull (convex heads: the hull greedy is exact); the top slice (top_fraction "
            "0.5, floor(0.5 (B - 36)) grows every other token) makes the table a sawtooth; top_fraction_0_*: "
            "the same without the top slice. neyman lower_bound: the convex relaxation's value on the grid "
            "(<= every allocation's predicted sum).",
        ],
        results=results,
        seconds=dict(tables=t_tables, total=time.perf_counter() - t0),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")

    print(f"\nL = {L}, topic {TOPIC}, {H} (layer, KV head), {D} draws, delta = {DELTA}; tables {t_tables:.0f} s, "
          f"total {data['seconds']['total']:.0f} s; heads convex {convex.mean():.2f} "
          f"(top_fraction 0: {(viol0 <= 1e-9).mean():.2f}), monotone {monotone.mean():.2f}\n")
    print("| f | rule | predicted sum V/|o|^2 | mean rel err | err > 0.1 | coverage | median rel radius "
          "| B min / max |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['fraction']:g} | {r['rule']} | {r['predicted_relative_variance_sum']:.4g} "
              f"| {r['mean_relative_error']:.4f} | {r['over_threshold']:.4f} | {r['coverage']:.4f} "
              f"| {r['median_relative_radius']:.4f} | {r['budget_min']} / {r['budget_max']} |")
    for f, v in info.items():
        print(f"f = {f:g}: neyman grid objective {v['neyman_table_objective']:.4g}, lower bound "
              f"{v['neyman_lower_bound']:.4g}, {v['neyman_seconds']:.1f} s")
    print(f"\nchecks: {checks}; wrote {args.out}")


if __name__ == "__main__":
    main()
