"""Issue 14, T2 diagnostic: per-cluster Gaussian moment estimates of sum_{evicted} w_i e^{2 s_i} vs the truth.

M = 0.15, layers 1, 5, ..., 29, 16 draws per KV head; moments diagonal, full, rank-2 + diagonal, and the
oracle cluster maximum (W_c e^{2 max s}). Not memory-feasible variants (full covariance) are included as
ceilings of the Gaussian step. Run from the repository root (the optional argument is evaluate_t2.py's capture cache,
default as there; made by the first run, see README.md):

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/diag_cluster_moments_t2.py
"""
import sys, numpy as np
import evaluate_t2 as E
from pathlib import Path
from kvcert import reference as R
from kvcert.reference import sketch as SK
from kvcert.fast import design_sizes
from kvcert.reference import design_uniforms
cap = E.load_capture(Path(sys.argv[1]) if len(sys.argv) > 1 else E.default_cache())  # [capture cache]
tau = cap["scaling"]; L=E.PREFIX; T=L+E.FUTURE; d=dv=64; D=16
out = {}
for layer in range(1, 30, 4):
    UL = E.importance_of_layer(cap, layer)
    for h in range(3):
        U = np.stack([design_uniforms(L, seed=(layer*3+h)*1000 + s) for s in range(D)])
        k = cap["k"][layer][h,:T].double().numpy(); v = cap["v"][layer][h,:T].double().numpy()
        q = cap["q"][layer][h*3:(h+1)*3][:, [L+o for o in E.OFFSETS]].double().numpy().reshape(-1, d)
        head = E.Head(q, k, v, UL[h], tau)
        M = 0.15
        B = M*L*(d+dv)/(d+dv+1)
        sz = design_sizes(B, sinks=4, window=32, top_fraction=0.5)
        pi = R.inclusion_probabilities(UL[h], B, sinks=4, window=32, top=sz.top, floor=0.1)
        keep, pif, kf, A, oh = head.sample(pi, U)
        Vo = E.oracle_variance(head, pif, oh)
        w = (1-pi)/pi; kp = k[:L]
        s_true = head.s[:, :L]  # (m, L)
        for C in (8, 16):
            lab = SK.kmeans_assign(kp, C)
            for kind in ("diag", "full", "rank2+diag", "empirical-max"):
                rat = []
                for dr in range(D):
                    gone = ~keep[dr]
                    tot_true = np.zeros(q.shape[0]); tot_est = np.zeros(q.shape[0])
                    for c in range(C):
                        idx = np.flatnonzero((lab == c) & gone)
                        if idx.size == 0: continue
                        ww = w[idx]; W = ww.sum(); kk = kp[idx]
                        mean = ww @ kk / W; X = kk - mean
                        S = (X * ww[:, None]).T @ X / W
                        lin = tau * q @ mean
                        if kind == "diag": qv = tau**2 * (q**2) @ np.diag(S)
                        elif kind == "full": qv = tau**2 * np.einsum('mi,ij,mj->m', q, S, q)
                        elif kind == "rank2+diag":
                            ev_, evec = np.linalg.eigh(S); top = evec[:, -2:] * np.sqrt(ev_[-2:])
                            rest = np.diag(S - top @ top.T)
                            qv = tau**2 * (((q @ top)**2).sum(1) + (q**2) @ np.maximum(rest, 0))
                        else:
                            qv = None
                        st = s_true[:, idx] - head.smax
                        tot_true += (np.exp(2*st) * ww).sum(1)
                        if qv is None:
                            tot_est += W * np.exp(2*st.max(1))
                        else:
                            tot_est += W * np.exp(2*(lin - head.smax[:, 0]) + 2*qv)
                    rat.append(tot_est / tot_true)
                out.setdefault(f"C{C} {kind}", []).append(np.concatenate(rat))
for k_, vals in out.items():
    x = np.concatenate(vals)
    print(f"{k_:24s}", " ".join(f"{qq}:{np.quantile(x, qq):.3g}" for qq in (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)))
