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

Variants (``evict_and_certify``'s ``kv_layout`` and ``quantized_bound``): ``--layout token|channel|values``
(per-token scales; KIVI's per-channel key scales per group of 32 kept tokens; 16-bit keys with per-token value
scales) and ``--bound strict|variance`` (round to nearest and B_q + r; stochastic rounding and the design's
rule on V + V_q). ``--bits 16,8`` picks the bit widths (16 is the baseline of "vs 16-bit" and of the
tightness ratio). In a variance row the rounding-term columns read sqrt(V_q) (median over draws of
sqrt(V_q) / norm(o), and median over cells of sqrt(mean V_q) / RMS of the rounding's error), and B_q, still
reported, is checked on every draw; "tightness / paper 16" is the row's tightness over the paper design's
16-bit tightness at the same M (the goal: <= 1.1).

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue54/measure.py --draws 16 --bits 16,8 \
        --layout token --bound variance

Writes ``results.json`` and ``table.md`` into ``--out`` (default: this folder) for the first run's variant
(token, strict, 16,8,4 bits), ``results_<layout>_<bound>_<bits>.json`` and ``table_<...>.md`` otherwise.
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


def stored_rows(kk, vv, keep, bits, layout, bound, seed):
    """The kept keys and values as ``evict_and_certify`` stores them (public API only: the quantizers, and the
    stream ``rounding_generator(seed)`` in the variance variant, keys' uniforms first)."""
    fmt = "int8" if bits == 8 else "int4"
    kw = dict(rounding="stochastic", generator=R.rounding_generator(seed)) if bound == "variance" else {}
    if layout == "values":
        keys = kk[keep]
    elif layout == "channel":
        keys = R.quantize_channels(kk[keep], fmt, **kw)
    else:
        keys = R.quantize(kk[keep], fmt, **kw)
    return keys, R.quantize(vv[keep], fmt, **kw)


def run(draws: int, bits_list=BITS, layout: str = "token", bound: str = "strict") -> list[dict]:
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
                    for bits in bits_list:
                        e = R.evict_and_certify(q, kk, vv, u, B + t + 1, seed=seed,
                                                design=None if design == "default" else "paper", kv_bits=bits,
                                                kv_layout=layout, quantized_bound=bound, **kw)
                        gap = eta_max = value_part = float("nan")
                        if bits < 16:                       # the same sample's exact-KV Hajek estimate
                            pi = (np.ones(len(u)) if e.budget >= len(u) else R.inclusion_probabilities(
                                u, e.budget, sinks=SINKS, window=window + t + 1, top=top, floor=FLOOR))
                            keep = (np.ones(len(u), dtype=bool) if e.budget >= len(u)
                                    else R.systematic_sample(pi, seed=seed))
                            exact = R.hajek_attention(q, kk[keep], vv[keep], pi[keep], scale=tau).output
                            gap = float(np.linalg.norm(e.output - exact))
                            kq, vq = stored_rows(kk, vv, keep, bits, layout, bound, seed)
                            k_st = kq if layout == "values" else kq.dequantize()
                            w = R.hajek_attention(q, k_st, vq.dequantize(), pi[keep], scale=tau).weights
                            eta_max = 0.0 if layout == "values" else float(R.logit_bound(q, kq, scale=tau).max())
                            value_part = float(w @ R.value_bound(vq))
                        rows.append(dict(cell=cell, M=M, design=design, bits=bits, err=float(np.linalg.norm(
                            e.output - o)), norm=float(np.linalg.norm(o)), radius=float(e.radius),
                            bq=float(e.quantization_bound), vq=float(e.quantization_variance),
                            variance=float(e.variance), gap=gap, eta_max=eta_max, value_part=value_part,
                            memory=float(e.memory), kept=int(e.kept)))
    return rows


def exact_worst_decile(cells_: int, draws: int, alpha: float = 1e-3, reps: int = 20000) -> float:
    """The alpha quantile of the worst decile an exact 0.95 certificate reads at this size."""
    cov = np.random.default_rng(0).binomial(draws, 1 - DELTA, size=(reps, cells_)) / draws
    return float(np.quantile(np.sort(cov, axis=1)[:, :math.ceil(cells_ / 10)].mean(1), alpha))


def summarize(rows: list[dict], bits_list=BITS, bound: str = "strict") -> list[dict]:
    out = []
    base_err, paper_tight = {}, {}
    for design in ("paper", "default"):                     # the paper design's 16-bit tightness first
        for M in MEMORIES:
            for bits in bits_list:
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
                    if design == "paper":
                        paper_tight[M] = float(np.median(tight))
                vq = np.array([r["vq"] for r in sel])
                by_var = bound == "variance" and bits < 16
                row = dict(design=design, M=M, bits=bits, memory=float(np.mean([r["memory"] for r in sel])),
                           kept=float(np.mean([r["kept"] for r in sel])), rel_error=rel,
                           error_vs_16=rel / base_err[(design, M)], pooled=float(hit.mean()),
                           worst=float(np.sort(per_cell)[:math.ceil(per_cell.size / 10)].mean()),
                           silent=float(np.mean(~hit & (err > SILENT * norm))), tightness=float(np.median(tight)),
                           tight_vs_paper16=float(np.median(tight)) / paper_tight[M],
                           bq_rel=float(np.median(bq / norm)), term_rel=float(np.median(
                               (np.sqrt(vq) if by_var else bq) / norm)), draws=len(sel))
                if bits < 16:
                    row["bq_slack"] = float(np.median(bq / np.maximum(gap, 1e-300)))
                    if by_var:                              # sqrt(mean V_q) / RMS(rounding's error), per cell
                        row["term_slack"] = float(np.median([math.sqrt(np.mean(vq[cell == c]) / max(
                            np.mean(gap[cell == c] ** 2), 1e-300)) for c in np.unique(cell)]))
                        row["vq_ratio_pooled"] = float(np.sum(vq) / np.sum(gap ** 2))
                    else:
                        row["term_slack"] = row["bq_slack"]
                    row["rounding_rel_error"] = float(np.mean(gap / norm))
                    row["bq_holds"] = bool(np.all(gap <= bq * (1 + 1e-9)))
                    row["eta_max"] = float(np.median([r["eta_max"] for r in sel]))
                    row["value_part_rel"] = float(np.median(np.array([r["value_part"] for r in sel]) / norm))
                    if design == "paper":                   # the sampling radius alone, from the stored rows
                        var = np.array([r["variance"] for r in sel])
                        r_alone = np.sqrt(np.maximum(var - vq, 0.0) / DELTA) if by_var else rad - bq
                        row["pooled_r_alone"] = float(np.mean(err <= r_alone))
                out.append(row)
    order = {d: i for i, d in enumerate(DESIGNS)}
    return sorted(out, key=lambda r: (order[r["design"]], MEMORIES.index(r["M"]), -r["bits"]))


def table(summary: list[dict], cells_: int, draws: int, bound: str = "strict") -> str:
    term = "sqrt(V_q)" if bound == "variance" else "B_q"
    lines = [f"| design | M | bits | memory held | mean kept | mean rel err | vs 16-bit | pooled | worst decile | "
             f"silent | tightness | tightness / paper 16 | median {term} / norm(o) | {term} / rounding's error | "
             f"rounding's rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        fmt = lambda x: f"{x:.3g}" if x < 1e4 else f"{x:.1e}"  # noqa: E731
        lines.append(
            f"| {r['design']} | {r['M']} | {r['bits']} | {r['memory']:.3f} | {r['kept']:.0f} | {r['rel_error']:.4f} | "
            f"{r['error_vs_16']:.2f} | {r['pooled']:.3f} | {r['worst']:.3f} | {100 * r['silent']:.2f}% | "
            f"{fmt(r['tightness'])} | {r['tight_vs_paper16']:.2f} | {fmt(r['term_rel'])} | "
            f"{fmt(r.get('term_slack', float('nan')))} | {r.get('rounding_rel_error', float('nan')):.4f} |")
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
    if bound == "variance":
        lines.append("Pooled sum V_q / sum norm(o_hat_q - o_hat)^2 (the variance against the rounding's realized "
                     "mean square): " + ", ".join(f"{r['design']} M {r['M']} / {r['bits']} bits "
                                                  f"{r['vq_ratio_pooled']:.3g}" for r in summary if r["bits"] < 16)
                     + "; median B_q / norm(o) (reported, not in the radius): "
                     + ", ".join(f"{r['design']} M {r['M']} / {r['bits']} bits {r['bq_rel']:.3g}"
                                 for r in summary if r["bits"] < 16) + ".")
    paper = [r for r in summary if "pooled_r_alone" in r]
    lines.append("Paper design, coverage of r alone (the sampling radius from the stored rows, without B_q): "
                 + ", ".join(f"M {r['M']} / {r['bits']} bits {r['pooled_r_alone']:.3f}" for r in paper) + ".")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=32)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--layout", default="token", choices=R.quantized.KV_LAYOUTS)
    ap.add_argument("--bound", default="strict", choices=R.quantized.QUANTIZED_BOUNDS)
    ap.add_argument("--bits", default="16,8,4", help="comma-separated bit widths from 16, 8, 4 (16 first)")
    args = ap.parse_args(argv)
    bits_list = tuple(int(b) for b in args.bits.split(","))
    if not bits_list or bits_list[0] != 16 or not set(bits_list) <= set(BITS):
        ap.error("--bits must start with 16 (the baseline) and hold only 16, 8, 4")
    t0 = time.time()
    rows = run(args.draws, bits_list, args.layout, args.bound)
    summary = summarize(rows, bits_list, args.bound)
    cells_ = len({r["cell"] for r in rows})
    text = table(summary, cells_, args.draws, args.bound)
    seconds = time.time() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    first = (args.layout, args.bound, bits_list) == ("token", "strict", BITS)
    stem = "" if first else f"_{args.layout}_{args.bound}_{'-'.join(map(str, bits_list))}"
    (args.out / f"results{stem}.json").write_text(json.dumps(dict(
        draws=args.draws, cells=cells_, seconds=seconds, layout=args.layout, bound=args.bound,
        bits=list(bits_list), summary=summary), indent=1))
    (args.out / f"table{stem}.md").write_text(text + f"\n\n{seconds:.0f} s.\n")
    print(text)
    print(f"{seconds:.0f} s")


if __name__ == "__main__":
    main()
