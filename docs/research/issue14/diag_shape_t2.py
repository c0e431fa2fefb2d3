"""Issue 14 diagnostic: does the *shape* of the error (its effective dimension) buy tightness?

The radius rules so far are c sqrt(V) with one c for every cell. The error o_hat - o is a vector in
R^dv; to first order it is a sum of independent terms with covariance
Sigma = sum_t (1 - pi_t)/pi_t a_t^2 (v_t - o)(v_t - o)^T / Z^2, tr Sigma = V. If Sigma spreads over
several directions, ||o_hat - o||^2 concentrates (Welch-Satterthwaite: ~ V chi2_nu / nu with
nu = (tr Sigma)^2 / tr Sigma^2), and the radius for a 1 - delta level is sqrt(V chi2_{nu,1-delta} / nu),
from 1.96 sqrt(V) at nu = 1 down towards sqrt(V) as nu grows. This script measures, on T2's replay
cells with the paper design's sample, whether a nu-aware radius meets S (silent <= 0.5%) and T
(tightness <= 3) together with room to spare, first with the true Sigma (the oracle) and then with
Sigma estimated from the kept tokens alone (Horvitz-Thompson, what a decode step can compute).

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/diag_shape_t2.py --layer-step 3 --draws 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy import stats

import evaluate_t2 as E  # this folder

from kvcert import reference as R
from kvcert.fast import design_sizes
from kvcert.reference import design_uniforms


def sigma_stats(W, v, oh):
    """tr Sigma and tr Sigma^2 of Sigma = sum_t W_t (v_t - oh)(v_t - oh)^T for W (D, m, T), oh (D, m, dv)."""
    D, m, T = W.shape
    dv = v.shape[1]
    VV = (v[:, :, None] * v[:, None, :]).reshape(T, dv * dv)
    S = (W.reshape(D * m, T) @ VV).reshape(D, m, dv, dv)
    b = W @ v                                            # (D, m, dv)
    s0 = W.sum(-1)                                       # (D, m)
    S = S - oh[..., :, None] * b[..., None, :] - b[..., :, None] * oh[..., None, :] \
        + s0[..., None, None] * oh[..., :, None] * oh[..., None, :]
    tr = np.trace(S, axis1=-2, axis2=-1)
    tr2 = (S ** 2).sum((-2, -1))
    return tr, tr2


def chi_factor(nu, delta):
    """sqrt(chi2_{nu, 1 - delta} / nu) for real nu >= 1."""
    nu = np.clip(nu, 1.0, None)
    return np.sqrt(stats.chi2.ppf(1 - delta, nu) / nu)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--layer-step", type=int, default=3)
    p.add_argument("--draws", type=int, default=64)
    p.add_argument("--mults", type=float, nargs="*", default=[1.0, 1.2, 1.4, 1.6, 1.7, 1.8])
    p.add_argument("--cache", type=Path, default=E.default_cache(), help="evaluate_t2.py's capture cache")
    a = p.parse_args(argv)
    cap = E.load_capture(a.cache)
    tau = float(cap["scaling"])
    h_kv = cap["k"][0].shape[0]
    g = cap["q"][0].shape[0] // h_kv
    d = cap["k"][0].shape[-1]
    dv = cap["v"][0].shape[-1]
    L, T = E.PREFIX, E.PREFIX + E.FUTURE
    mults = tuple(a.mults)
    consts = (2.5, 2.8, 3.0)
    res = {}
    nus = {M: [] for M in E.MEMORIES}
    for layer in range(0, 30, a.layer_step):
        u_layer = E.importance_of_layer(cap, layer)
        for h in range(h_kv):
            cid = layer * h_kv + h
            U = np.stack([design_uniforms(L, seed=cid * 256 + s) for s in range(a.draws)])
            k = cap["k"][layer][h, :T].double().numpy()
            v = cap["v"][layer][h, :T].double().numpy()
            q = cap["q"][layer][h * g:(h + 1) * g][:, [L + o for o in E.OFFSETS]].double().numpy().reshape(-1, d)
            head = E.Head(q, k, v, u_layer[h], tau)
            for M in E.MEMORIES:
                B = M * L * (d + dv) / (d + dv + 1)
                sz = design_sizes(B, sinks=E.SINKS, window=E.WINDOW, top_fraction=E.TOP_FRACTION)
                pi = R.inclusion_probabilities(u_layer[h], B, sinks=sz.sinks, window=sz.window, top=sz.top,
                                               floor=E.FLOOR)
                keep, pif, kf, A, oh = head.sample(pi, U)
                err = np.linalg.norm(oh - head.o, axis=-1)                     # (D, m)
                b_or = np.broadcast_to(((1 - pif) / pif * head.E ** 2 / head.Z[:, None] ** 2)[None],
                                       A.shape)
                b_ht = (1 - pif) * A ** 2
                for name, Wt in (("oracle", b_or), ("trace", b_ht)):
                    V, V2 = sigma_stats(Wt, v, oh)
                    nu = np.where(V2 > 0, V ** 2 / np.where(V2 > 0, V2, 1), 1.0)
                    if name == "oracle":
                        nus[M].append(nu.ravel())
                    sq = np.sqrt(np.maximum(V, 0))
                    rules = {f"x{c}": c * sq for c in consts}
                    cf = chi_factor(nu, E.DELTA)
                    rules.update({f"chi2nu*{k}": k * cf * sq for k in mults})
                    for rule, rad in rules.items():
                        for j in range(rad.shape[1]):
                            res.setdefault((M, "paper", name, rule), []).append(
                                (err[:, j], rad[:, j], head.onorm[j], np.full(1, M)))
        print(f"[shape] layer {layer}", file=sys.stderr)
    rows = E.summarize({kk: vv for kk, vv in res.items()} | {
        (M, "paper", "trace", next(iter(E.RULES))): res[(M, "paper", "trace", "x2.5")] for M in E.MEMORIES})
    rows = [r for r in rows if r["rule"] != next(iter(E.RULES))]
    print(E.markdown(rows))
    print()
    for M in E.MEMORIES:
        x = np.concatenate(nus[M])
        print(f"M = {M}: nu (oracle Sigma) quantiles 5/25/50/75/95%: "
              + " / ".join(f"{np.quantile(x, qq):.2f}" for qq in (0.05, 0.25, 0.5, 0.75, 0.95)))


if __name__ == "__main__":
    main()
