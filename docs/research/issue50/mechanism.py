"""Why the recommended certificate regressed, and what the radius must not hinge on (issue 50).

Research script (not library code): it calls the public API only and patches nothing. It reads the capture of
held-out text 2 that ``docs/research/issue30/heldout.py --text 2`` caches (post-RoPE q, k, v of SmolLM2-135M-
Instruct's layers 2 / 8 / 15 / 22 / 28 over pydoc topics no sketch design was tuned on), and measures:

1. **Which clusterings changed.** ``kvcert.reference.kmeans_assign`` at main against the k-means before commit
   0154fbb (written out below as ``kmeans_before``: the principal direction from NumPy's SVD, whose sign is
   LAPACK's, and the argmin with ||k||^2), as partitions (labels up to renaming), for every KV head and every
   cache length n = prefix + t + 1, t = 0..39.
2. **What the certificate does under other k-means optima.** The same draws (common random numbers, Poisson
   sampling, the tilted design's sample at equal total memory) certified with the tilted sketch built on three
   clusterings of the same keys: the library's, and two k-means++ starts (seeds 0 and 1) followed by the same
   Lloyd rounds; each with the radius before issue 50, min(3 sqrt(V_cl), H), and with the radius after,
   min(3 sqrt(max(V_cl, V_HT)), H) (``kvcert.reference.sketch.sketched_variance``). The paper design at the same
   memory beside them (its own sample, Chebyshev), and the oracle 3 sqrt(V) of the true design variance.

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue30/heldout.py --text 2 --quick   # caches the capture
    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue50/mechanism.py                  # about 4 minutes

Writes ``mechanism.md`` beside this file (``--out``).
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvcert.fast as F
from kvcert import reference as R
from kvcert.reference import sketch as SK

DELTA, C, WINDOW, SINKS, FLOOR = 0.05, 8, 32, 4, 0.1
PREFIX, OFFSETS, LAYERS = 1536, (3, 11, 29), (2, 8, 15, 22, 28)
SILENT = 0.05


def kmeans_before(keys, clusters: int, iterations: int = 10) -> np.ndarray:
    """``kvcert.reference.kmeans_assign`` as it was before commit 0154fbb (SVD direction, LAPACK's sign)."""
    k = np.asarray(keys, dtype=np.float64)
    n = k.shape[0]
    c = min(clusters, n)
    kc = k - k.mean(axis=0)
    _, _, vt = np.linalg.svd(kc, full_matrices=False)
    order = np.argsort(kc @ vt[0], kind="stable")
    centres = k[order[((np.arange(c) + 0.5) * n / c).astype(int)]].copy()
    k2 = (k * k).sum(1)
    for _ in range(iterations + 1):
        lab = np.argmin(k2[:, None] - 2.0 * k @ centres.T + (centres * centres).sum(1)[None, :], axis=1)
        for j in range(c):
            if (lab == j).any():
                centres[j] = k[lab == j].mean(0)
    return lab


def kmeans_pp(keys, clusters: int, seed: int, iterations: int = 10) -> np.ndarray:
    """Another local optimum: a k-means++ start (seeded) and the same Lloyd rounds."""
    k = np.asarray(keys, dtype=np.float64)
    rng = np.random.default_rng(seed)
    centres = [k[rng.integers(len(k))]]
    for _ in range(clusters - 1):
        d2 = np.min(((k[:, None, :] - np.array(centres)[None]) ** 2).sum(-1), axis=1)
        centres.append(k[rng.choice(len(k), p=d2 / d2.sum())])
    centres = np.array(centres)
    for _ in range(iterations + 1):
        lab = np.argmin((centres * centres).sum(1)[None] - 2.0 * k @ centres.T, axis=1)
        for j in range(clusters):
            if (lab == j).any():
                centres[j] = k[lab == j].mean(0)
    return lab


def same_partition(a, b) -> bool:
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def partitions(cap) -> dict:
    """How many (KV head, n) partitions differ between main's k-means and the one before 0154fbb, by n mod 2C."""
    out = {True: [0, 0], False: [0, 0]}
    for layer in LAYERS:
        k_all = cap["k"][layer].double().numpy()
        for h in range(k_all.shape[0]):
            for t in range(40):
                n = PREFIX + t + 1
                key = n % (2 * C) == 0
                out[key][0] += not same_partition(kmeans_before(k_all[h, :n], C), SK.kmeans_assign(k_all[h, :n], C))
                out[key][1] += 1
    return out


def certify(cap, M: float, draws: int) -> list[dict]:
    tau, g = float(cap["scaling"]), int(cap["group"])
    spec = SK.TILTED
    rows = []
    for layer in LAYERS:
        q_all, k_all, v_all = (cap[x][layer].double().numpy() for x in "qkv")
        t = lambda x: torch.from_numpy(x[:, :PREFIX]).float()[None]  # noqa: E731
        u_all = F.SCORERS["snapkv"](torch.from_numpy(q_all[:, PREFIX - WINDOW:PREFIX]).float()[None], t(k_all),
                                    t(v_all), scale=tau)[0].double().numpy()
        d, dv = k_all.shape[-1], v_all.shape[-1]
        for h in range(k_all.shape[0]):
            wq = q_all[h * g:(h + 1) * g, PREFIX - WINDOW:PREFIX].reshape(-1, d)
            for off in OFFSETS:
                n = PREFIX + off + 1
                kk, vv = k_all[h, :n], v_all[h, :n]
                labels = {"library": SK.kmeans_assign(kk, C), "k-means++ 0": kmeans_pp(kk, C, 0),
                          "k-means++ 1": kmeans_pp(kk, C, 1)}
                u = np.concatenate([u_all[h], np.zeros(off + 1)])
                B = M * PREFIX * (d + dv) / (d + dv + 1)
                top = F.design_sizes(B, sinks=SINKS, window=WINDOW, top_fraction=0.5).top
                pi = R.inclusion_probabilities(u, B + off + 1 - spec.tokens(d, dv), sinks=SINKS,
                                               window=WINDOW + off + 1, top=top, floor=FLOOR)
                pi_paper = R.inclusion_probabilities(u, B + off + 1, sinks=SINKS, window=WINDOW + off + 1, top=top,
                                                     floor=FLOOR)
                for j in range(h * g, (h + 1) * g):
                    q = q_all[j, PREFIX + off]
                    s = tau * kk @ q
                    e = np.exp(s - s.max())
                    o = e @ vv / e.sum()
                    v_true = np.sum((1 - pi) / pi * e ** 2 * np.sum((vv - o) ** 2, 1)) / e.sum() ** 2
                    for r in range(draws):
                        seed = (layer * 3 + h) * draws + r
                        keep = R.poisson_sample(pi, seed=seed)
                        est = R.hajek_attention(q, kk[keep], vv[keep], pi[keep], scale=tau)
                        kp = R.poisson_sample(pi_paper, seed=seed)
                        ep = R.hajek_attention(q, kk[kp], vv[kp], pi_paper[kp], scale=tau)
                        row = dict(cell=(layer, j, off), err=np.linalg.norm(est.output - o), norm=np.linalg.norm(o),
                                   ht=est.trace, v_true=v_true, paper_err=np.linalg.norm(ep.output - o),
                                   paper_radius=math.sqrt(ep.trace / DELTA))
                        for name, lab in labels.items():
                            sk = SK.cluster_sketch(kk, vv, pi, keep, spec, labels=lab, tilt=wq, scale=tau)
                            v_cl = SK.cluster_variance(q, kk[keep], vv[keep], pi[keep], sk, output=est.output,
                                                       scale=tau)
                            hull = SK.hull_bound(vv[keep], pi[keep], sk, output=est.output)
                            row[f"{name}: V_cl alone"] = min(3.0 * math.sqrt(v_cl), hull)
                            both = SK.sketched_variance(v_cl, est.trace)
                            row[f"{name}: max(V_cl, V_HT)"] = min(3.0 * math.sqrt(both), hull)
                        rows.append(row)
    return rows


def summary(rows, radius_key: str, err_key: str = "err") -> dict:
    cells: dict = {}
    silent = 0
    for r in rows:
        rad = r[radius_key] if isinstance(radius_key, str) else radius_key(r)
        hit = r[err_key] <= rad
        cells.setdefault(r["cell"], []).append((hit, rad, r[err_key]))
        silent += (not hit) and r[err_key] > SILENT * r["norm"]
    cov = np.array([np.mean([h for h, _, _ in v]) for v in cells.values()])
    k = math.ceil(cov.size / 10)
    tight = np.median([np.median([x for _, x, _ in v]) / math.sqrt(np.mean([e ** 2 for _, _, e in v]))
                       for v in cells.values()])
    return dict(pooled=cov.mean(), worst=np.sort(cov)[:k].mean(), silent=silent / len(rows), tightness=tight)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvcert_issue30_heldout_text2.pt"))
    p.add_argument("--draws", type=int, default=32)
    p.add_argument("--memories", type=float, nargs="+", default=[0.15, 0.3, 0.55])
    p.add_argument("--out", default=str(Path(__file__).resolve().parent))
    args = p.parse_args(argv)
    cap = torch.load(args.cache)
    t0 = time.perf_counter()
    part = partitions(cap)
    md = ["# Mechanism of the regression and robustness to the clustering (issue 50)", "",
          f"`OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue50/mechanism.py` "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; held-out text 2, layers {LAYERS}, "
          f"prefix {PREFIX}, offsets {OFFSETS}, {args.draws} Poisson draws per cell, delta {DELTA})", "",
          "Partitions of main's `kmeans_assign` that differ from the k-means before 0154fbb (labels up to renaming):",
          "", f"- n a multiple of 2C = {2 * C}: {part[True][0]} of {part[True][1]} (KV head, n)",
          f"- any other n: {part[False][0]} of {part[False][1]}", "",
          "| M | certificate | pooled | worst decile | silent | tightness |", "|---|---|---|---|---|---|"]
    for M in args.memories:
        rows = certify(cap, M, args.draws)
        entries = [("paper design (Chebyshev, its own sample)", summary(rows, "paper_radius", "paper_err"))]
        for name in ("library", "k-means++ 0", "k-means++ 1"):
            for rule in ("V_cl alone", "max(V_cl, V_HT)"):
                entries.append((f"tilted, {name} clusters, {rule}", summary(rows, f"{name}: {rule}")))
        entries.append(("oracle 3 sqrt(true design variance)", summary(rows, lambda r: 3 * math.sqrt(r["v_true"]))))
        for name, x in entries:
            md.append(f"| {M} | {name} | {x['pooled']:.3f} | {x['worst']:.3f} | {100 * x['silent']:.2f}% | "
                      f"{x['tightness']:.2f} |")
    md += ["", f"{time.perf_counter() - t0:.0f} s."]
    Path(args.out, "mechanism.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
