"""Quantized KV caches at equal memory: sampled-only (16 bits) against sampled + quantized (8 and 4 bits).

Research script (not library code): it calls the public API only and patches nothing.

Data: the held-out guard's slice (tests/data/heldout_slice.npz; SmolLM2-135M-Instruct's post-RoPE keys,
values and queries of layers 5 / 11 / 17 over a pydoc text no design was tuned on; prefix 1024, queries at
prefix + 4 / 13 / 29; 81 cells = 3 layers x 9 query heads x 3 offsets), loaded and certified as
tests/test_heldout_validity.py does: SnapKV importance from the 32 window queries (``kvcert.fast.SCORERS``),
budget B = M prefix (d + dv) / (d + dv + 1) + t + 1, ``top`` from ``kvcert.fast.design_sizes(B,
top_fraction=0.5)``, sinks 4, window 32 + t + 1, floor 0.1, delta 0.05, ``sampling="systematic"``, the tilt at
the KV head's group's window queries. Each draw calls ``kvcert.reference.evict_and_certify(..., kv_bits=b)``
for b = 16 / 8 / 4 with the same seed, for the recommended design (``design=None``) and the paper design.

Per (design, M, bits): memory held, mean kept count, mean relative error ||o_hat - o|| / ||o||, its ratio to
the same design's 16-bit error, pooled coverage of the radius (B_q + r at 8 / 4 bits), worst decile (mean
coverage of the worst ceil(cells / 10) cells), silent material errors (error > 5% of ||o|| and outside the
radius), tightness (median over cells of median radius / RMS error), median B_q / ||o||, and the slack of B_q:
median of B_q / ||o_hat_q - o_hat||, o_hat the same sample's Hajek estimate over the exact keys and values
(pi rebuilt at ``result.budget`` with ``inclusion_probabilities``, the sample from ``systematic_sample`` with
the same seed), with its drivers: the largest logit bound max_S eta_i and the value part sum_S w'_i eps_i
(``logit_bound``, ``value_bound`` of the stored kept rows). For the paper design also the coverage of r alone (radius - B_q, the sampling radius computed
from the stored rows). Beside them: what an exact 0.95 certificate reads at this number of cells and draws
(the 0.1% quantile of its worst decile, by simulation).

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue54/measure.py --draws 32

Writes ``results.json`` and ``table.md`` into ``--out`` (default: this folder).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

import kvcert.fast as F
from kvcert import reference as R

HERE = Path(__file__).resolve().parent
SLICE = HERE.parents[2] / "tests" / "data" / "heldout_slice.npz"
DELTA, SINKS, FLOOR, TOP_FRACTION, SILENT = 0.05, 4, 0.1, 0.5, 0.05
MEMORIES, BITS, DESIGNS = (0.15, 0.3, 0.55), (16, 8, 4), ("default", "paper")


def _snapkv(q_window, keys, values, scale):
    t = lambda x: torch.from_numpy(x.astype(np.float32))[None]  # noqa: E731
    return F.SCORERS["snapkv"](t(q_window), t(keys), t(values), scale=scale)[0].double().numpy()


def cells(z):
    """Yield (layer, kv head, q, keys, values, importance, tilt, t, window) for the 81 cells of the slice."""
    tau, prefix, window = float(z["scaling"]), int(z["prefix"]), int(z["window"])
    for L in z["layers"]:
        k, v = z[f"k{L}"].astype(np.float64), z[f"v{L}"].astype(np.float64)
        qw, qt = z[f"qw{L}"].astype(np.float64), z[f"qt{L}"].astype(np.float64)
        h_kv, _, d = k.shape
        g = qw.shape[0] // h_kv
        u_all = _snapkv(qw, k[:, :prefix], v[:, :prefix], tau)
        for h in range(h_kv):
            tilt = qw[h * g:(h + 1) * g].reshape(-1, d)
            for j in range(h * g, (h + 1) * g):
                for oi, t in enumerate(z["offsets"]):
                    n = prefix + int(t) + 1
                    u = np.concatenate([u_all[h], np.zeros(int(t) + 1)])
                    yield int(L), h, qt[j, oi], k[h, :n], v[h, :n], u, tilt, int(t), window


def run(draws: int) -> list[dict]:
    z = np.load(SLICE)
    tau, prefix = float(z["scaling"]), int(z["prefix"])
    rows = []
    for cell, (L, h, q, kk, vv, u, tilt, t, window) in enumerate(cells(z)):
        d, dv = kk.shape[1], vv.shape[1]
        o = R.attention(q, kk, vv, scale=tau)
        for M in MEMORIES:
            B = M * prefix * (d + dv) / (d + dv + 1)
            top = F.design_sizes(B, sinks=SINKS, window=window, top_fraction=TOP_FRACTION).top
            kw = dict(delta=DELTA, tilt=tilt, sinks=SINKS, window=window + t + 1, top=top, floor=FLOOR, scale=tau,
                      sampling="systematic")
            for design in DESIGNS:
                for r in range(draws):
                    seed = (L * 3 + h) * draws + r
                    for bits in BITS:
                        e = R.evict_and_certify(q, kk, vv, u, B + t + 1, seed=seed,
                                                design=None if design == "default" else "paper", kv_bits=bits, **kw)
                        gap = eta_max = value_part = float("nan")
                        if bits < 16:                       # the same sample's exact-KV Hajek estimate
                            pi = (np.ones(len(u)) if e.budget >= len(u) else R.inclusion_probabilities(
                                u, e.budget, sinks=SINKS, window=window + t + 1, top=top, floor=FLOOR))
                            keep = R.systematic_sample(pi, seed=seed)
                            exact = R.hajek_attention(q, kk[keep], vv[keep], pi[keep], scale=tau).output
                            gap = float(np.linalg.norm(e.output - exact))
                            fmt = "int8" if bits == 8 else "int4"
                            kq, vq = R.quantize(kk[keep], fmt), R.quantize(vv[keep], fmt)
                            w = R.hajek_attention(q, kq.dequantize(), vq.dequantize(), pi[keep], scale=tau).weights
                            eta_max = float(R.logit_bound(q, kq, scale=tau).max())
                            value_part = float(w @ R.value_bound(vq))
                        rows.append(dict(cell=cell, M=M, design=design, bits=bits, err=float(np.linalg.norm(
                            e.output - o)), norm=float(np.linalg.norm(o)), radius=float(e.radius),
                            bq=float(e.quantization_bound), gap=gap, eta_max=eta_max, value_part=value_part, memory=float(e.memory), kept=int(e.kept)))
    return rows


def exact_worst_decile(cells_: int, draws: int, alpha: float = 1e-3, reps: int = 20000) -> float:
    """The alpha quantile of the worst decile an exact 0.95 certificate reads at this size."""
    cov = np.random.default_rng(0).binomial(draws, 1 - DELTA, size=(reps, cells_)) / draws
    return float(np.quantile(np.sort(cov, axis=1)[:, :math.ceil(cells_ / 10)].mean(1), alpha))


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    base_err = {}
    for design in DESIGNS:
        for M in MEMORIES:
            for bits in BITS:
                sel = [r for r in rows if r["design"] == design and r["M"] == M and r["bits"] == bits]
                cell = np.array([r["cell"] for r in sel])
                err, norm, rad = (np.array([r[f] for r in sel]) for f in ("err", "norm", "radius"))
                bq, gap = np.array([r["bq"] for r in sel]), np.array([r["gap"] for r in sel])
                hit = err <= rad
                per_cell = np.bincount(cell, weights=hit)[np.unique(cell)] / np.bincount(cell)[np.unique(cell)]
                tight = [np.median(rad[cell == c]) / math.sqrt(np.mean(err[cell == c] ** 2)) for c in np.unique(cell)]
                rel = float(np.mean(err / norm))
                if bits == 16:
                    base_err[(design, M)] = rel
                row = dict(design=design, M=M, bits=bits, memory=float(np.mean([r["memory"] for r in sel])),
                           kept=float(np.mean([r["kept"] for r in sel])), rel_error=rel,
                           error_vs_16=rel / base_err[(design, M)], pooled=float(hit.mean()),
                           worst=float(np.sort(per_cell)[:math.ceil(per_cell.size / 10)].mean()),
                           silent=float(np.mean(~hit & (err > SILENT * norm))), tightness=float(np.median(tight)),
                           bq_rel=float(np.median(bq / norm)), draws=len(sel))
                if bits < 16:
                    row["bq_slack"] = float(np.median(bq / np.maximum(gap, 1e-300)))
                    row["rounding_rel_error"] = float(np.mean(gap / norm))
                    row["bq_holds"] = bool(np.all(gap <= bq * (1 + 1e-9)))
                    row["eta_max"] = float(np.median([r["eta_max"] for r in sel]))
                    row["value_part_rel"] = float(np.median(np.array([r["value_part"] for r in sel]) / norm))
                    if design == "paper":
                        row["pooled_r_alone"] = float(np.mean(err <= rad - bq))
                out.append(row)
    return out


def table(summary: list[dict], cells_: int, draws: int) -> str:
    lines = [f"| design | M | bits | memory held | mean kept | mean rel err | vs 16-bit | pooled | worst decile | "
             f"silent | tightness | median B_q / norm(o) | B_q / rounding's error | rounding's rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        fmt = lambda x: f"{x:.3g}" if x < 1e4 else f"{x:.1e}"  # noqa: E731
        lines.append(
            f"| {r['design']} | {r['M']} | {r['bits']} | {r['memory']:.3f} | {r['kept']:.0f} | {r['rel_error']:.4f} | "
            f"{r['error_vs_16']:.2f} | {r['pooled']:.3f} | {r['worst']:.3f} | {100 * r['silent']:.2f}% | "
            f"{fmt(r['tightness'])} | {fmt(r['bq_rel'])} | {fmt(r.get('bq_slack', float('nan')))} | "
            f"{r.get('rounding_rel_error', float('nan')):.4f} |")
    lines.append("")
    lines.append(f"{cells_} cells x {draws} draws per row; an exact 0.95 certificate's worst decile reads "
                 f">= {exact_worst_decile(cells_, draws):.3f} with probability 0.999 at this size.")
    quant = [r for r in summary if r["bits"] < 16 and r["design"] == "default"]
    lines.append("B_q's drivers (default design; medians over draws): the largest logit bound max_S eta_i (nats) "
                 "and the value part sum_S w'_i eps_i / norm(o): "
                 + ", ".join(f"M {r['M']} / {r['bits']} bits {r['eta_max']:.3g} and {r['value_part_rel']:.3g}"
                             for r in quant) + ".")
    lines.append("B_q held on every draw (norm(o_hat_q - o_hat) <= B_q): "
                 + str(all(r["bq_holds"] for r in summary if r["bits"] < 16)) + ".")
    paper = [r for r in summary if "pooled_r_alone" in r]
    lines.append("Paper design, coverage of r alone (the sampling radius from the stored rows, without B_q): "
                 + ", ".join(f"M {r['M']} / {r['bits']} bits {r['pooled_r_alone']:.3f}" for r in paper) + ".")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--out", type=Path, default=HERE)
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = run(args.draws)
    summary = summarize(rows)
    cells_ = len({r["cell"] for r in rows})
    text = table(summary, cells_, args.draws)
    seconds = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(dict(draws=args.draws, cells=cells_, seconds=seconds,
                                                           summary=summary), indent=1))
    (args.out / "table.md").write_text(text + f"\n\n{seconds:.0f} s.\n")
    print(text)
    print(f"{seconds:.0f} s")


if __name__ == "__main__":
    main()
