"""Issue 14, synthetic cells: the paper design vs the page-sketch design at equal total memory.

Research script (not library code). Every cell is one synthetic KV head with a
fixed population (keys, values, importance, one future query); each design is
drawn ``--draws`` times per cell (seeds 0..draws-1) through ``evict_and_certify`` (the
library's, extended to the page design by ``page_code_designs.py`` in this folder). Memory M is the paper design's expected
memory: budget = M n (d + dv) / (d + dv + 1); the page design spends part of it
on its sketch (``sketch_budget``).

Cells (heavy-tailed logits, a few large-value tokens far from the sample):
keys = offset + low-rank AR(1) positional structure with Student-t(3)
innovations + isotropic noise; the importance is SnapKV-like attention of an
observation window of queries near q_obs; the future query q is q_obs rotated
by ``angle``; ``needles`` tail tokens get keys aligned with the rotated part
of q (high future score, importance near the floor) and values 6x the typical
norm. Grid: needles in {0, 1, 3} x angle in {30, 60} deg x temperature in
{1, 2} x ``--reps`` populations.

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/evaluate_sketch.py > docs/research/issue14/table.md
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from scipy import stats

from page_code_designs import (SketchDesign, evict_and_certify, page_score_bounds,  # this folder
                               page_sketch)

from kvcert.reference import attention, inclusion_probabilities, poisson_sample, scores

DELTA = 0.05
MEMORIES = (0.15, 0.3, 0.55)


def make_cell(rng, *, n, d, dv, needles, angle_deg, temperature, rank=4, rho=0.95, noise=0.5):
    """One synthetic head: (q, keys, values, importance)."""
    L = rng.normal(size=(d, rank)) / np.sqrt(rank)
    z = np.zeros((n, rank))
    innov = stats.t.rvs(3, size=(n, rank), random_state=rng) * np.sqrt(1 - rho ** 2)
    for i in range(1, n):
        z[i] = rho * z[i - 1] + innov[i]
    offset = rng.normal(size=d) * 0.5
    keys = offset + z @ L.T + noise * rng.normal(size=(n, d))
    values = rng.normal(size=(n, dv))
    # observation query and future query (q_obs rotated by angle)
    qdir = L @ rng.normal(size=rank)
    qdir /= np.linalg.norm(qdir)
    perp = rng.normal(size=d)
    perp -= perp @ qdir * qdir
    perp /= np.linalg.norm(perp)
    a = np.deg2rad(angle_deg)
    qf = np.cos(a) * qdir + np.sin(a) * perp
    # needles: tail tokens aligned with the future query's new direction
    idx = rng.choice(np.arange(8, n - 64), size=needles, replace=False) if needles else np.array([], int)
    for i in idx:
        keys[i] = offset + 4.0 * perp + noise * rng.normal(size=d)
        u = rng.normal(size=dv)
        values[i] = 6.0 * np.sqrt(dv) * u / np.linalg.norm(u)
    scale_q = temperature * np.sqrt(d) * 1.5
    q = scale_q * qf
    tau = 1.0 / np.sqrt(d)
    # SnapKV-like importance: mean attention of 8 observation queries near q_obs
    obs = scale_q * (qdir + 0.2 * rng.normal(size=(8, d)) / np.sqrt(d))
    s_obs = tau * obs @ keys.T
    imp = np.exp(s_obs - s_obs.max(axis=1, keepdims=True))
    imp = (imp / imp.sum(axis=1, keepdims=True)).mean(axis=0)
    return q, keys, values, imp


def oracle_variance(c, budget_used, seed, output):
    """V with exact evicted scores and values (plug-ins o_hat, Z >= Z_S + Z_U exact): the ceiling of any sketch."""
    pi = inclusion_probabilities(c["imp"], budget_used)
    keep = poisson_sample(pi, seed=seed)
    s = scores(c["q"], c["k"])
    z = np.exp(s - s.max())
    y = (1 - pi) / pi * z ** 2 * np.sum((c["v"] - output) ** 2, axis=1)
    return float(y.sum() / z.sum() ** 2), pi, keep, s


def page_gap(c, pi, keep, s, P):
    """Per sketched page: u_g - max over its evicted tokens of s_i (nats; 0 = a tight bound)."""
    sk = page_sketch(c["k"], c["v"], pi, keep, page_size=P)
    _, up = page_score_bounds(c["q"], sk)
    gone = np.flatnonzero(~keep)
    smax = np.full(sk.pages.size, -np.inf)
    np.maximum.at(smax, np.searchsorted(sk.pages, gone // P), s[gone])
    return up - smax


def run(args):
    designs = {"paper": "paper"}
    for P in args.pages:
        designs[f"page{P}"] = SketchDesign(page_size=P, radius="chebyshev")
    n, d, dv = args.n, args.d, args.dv
    grid = list(itertools.product((0, 1, 3), (30, 60), (1.0, 2.0), range(args.reps)))
    cells = []
    rng = np.random.default_rng(args.seed)
    for needles, angle, temp, _ in grid:
        q, k, v, imp = make_cell(rng, n=n, d=d, dv=dv, needles=needles, angle_deg=angle, temperature=temp)
        cells.append(dict(q=q, k=k, v=v, imp=imp, o=attention(q, k, v), tag=(needles, angle, temp)))
    z = stats.norm.ppf(1 - DELTA / 2)
    rows = []
    gaps = {}
    for M in MEMORIES:
        budget = M * n * (d + dv) / (d + dv + 1)
        res = {}  # (design, radius kind) -> per cell arrays (err, radius, rel, mem)
        oracle = []
        for name, design in designs.items():
            per = []
            for c in cells:
                err = np.empty(args.draws); rc = np.empty(args.draws); var = np.empty(args.draws)
                mem = np.empty(args.draws)
                for s in range(args.draws):
                    r = evict_and_certify(c["q"], c["k"], c["v"], c["imp"], budget, seed=s, delta=DELTA,
                                          design=design)
                    err[s] = np.linalg.norm(r.output - c["o"]); rc[s] = r.radius; var[s] = r.variance
                    mem[s] = r.memory
                per.append((err, rc, var, mem, np.linalg.norm(c["o"])))
                if name != "paper" and args.diag:
                    for s_ in range(min(args.draws, 8)):
                        r = evict_and_certify(c["q"], c["k"], c["v"], c["imp"], budget, seed=s_, design=design)
                        _, pi, keep, sc = oracle_variance(c, r.budget, s_, r.output)
                        gaps.setdefault((M, name), []).append(page_gap(c, pi, keep, sc, design.page_size))
                if name == "paper":
                    ov = np.empty(args.draws)
                    for s_ in range(args.draws):
                        r = evict_and_certify(c["q"], c["k"], c["v"], c["imp"], budget, seed=s_, design="paper")
                        ov[s_] = oracle_variance(c, r.budget, s_, r.output)[0]
                    oracle.append((err, ov, mem, np.linalg.norm(c["o"])))
            if name == "paper":
                res[("oracle-V (paper sample)", "chebyshev")] = [(e, np.sqrt(v_ / DELTA), m, on)
                                                              for e, v_, m, on in oracle]
                res[("oracle-V (paper sample)", "gaussian")] = [(e, z * np.sqrt(v_), m, on)
                                                             for e, v_, m, on in oracle]
            res[(name, "chebyshev")] = [(e, r, m, on) for e, r, v_, m, on in per]
            if name != "paper":
                res[(name, "gaussian")] = [(e, z * np.sqrt(v_), m, on) for e, r, v_, m, on in per]
        paper_rel = np.mean([e / on for e, r, m, on in res[("paper", "chebyshev")]])
        for (name, kind), per in res.items():
            cov = np.array([np.mean(e <= r) for e, r, m, on in per])
            worst = np.sort(cov)[: max(1, int(np.ceil(0.1 * cov.size)))].mean()
            pooled = np.mean(np.concatenate([e <= r for e, r, m, on in per]))
            silent = np.mean(np.concatenate([(e / on > 0.05) & (e > r) for e, r, m, on in per]))
            tight = np.median([np.median(r) / np.sqrt(np.mean(e ** 2)) for e, r, m, on in per])
            rel = np.mean([e / on for e, r, m, on in per])
            mem = np.mean([m.mean() for e, r, m, on in per])
            rows.append(dict(M=M, design=name, radius=kind, memory=mem, pooled=pooled, worst=worst,
                             silent=silent, tight=tight, rel=rel, ratio=rel / paper_rel))
    return rows, len(cells), gaps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draws", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--dv", type=int, default=64)
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--seed", type=int, default=14)
    ap.add_argument("--diag", type=int, default=1, help="page-bound gap diagnostic (8 draws per cell)")
    args = ap.parse_args()
    t0 = time.time()
    rows, ncells, gaps = run(args)
    print(f"{ncells} cells per M, {args.draws} draws per cell, n = {args.n}, d = {args.d}, dv = {args.dv}, "
          f"delta = {DELTA}; {time.time() - t0:.0f} s\n")
    print("| M | design | radius | memory held | pooled | worst decile | silent | tightness | mean rel err | vs paper |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['M']} | {r['design']} | {r['radius']} | {r['memory']:.3f} | {r['pooled']:.3f} | "
              f"{r['worst']:.3f} | {100 * r['silent']:.2f}% | {r['tight']:.2f} | {r['rel']:.4f} | {r['ratio']:.2f} |")
    if gaps:
        print("\nPage bound gap u_g - max_{i in U_g} s_i (nats), quantiles over sketched pages, 8 draws per cell:\n")
        print("| M | design | q10 | median | q90 | min |")
        print("|---|---|---|---|---|---|")
        for (M, name), g in gaps.items():
            g = np.concatenate(g)
            print(f"| {M} | {name} | {np.quantile(g, 0.1):.2f} | {np.median(g):.2f} | {np.quantile(g, 0.9):.2f} | "
                  f"{g.min():.2f} |")


if __name__ == "__main__":
    main()

