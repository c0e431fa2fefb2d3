"""Issue 14, T2 diagnostic: V_sketch / V on the paper design's sample at M = 0.15 (cluster moments, value rule).

Every 3rd layer, 32 draws per KV head. Quantiles over (draw, query) of the ratio to the oracle V
(plug-in o_hat, exact Z). Run from the repository root (the optional argument is evaluate_t2.py's capture cache,
default as there; made by the first run, see README.md):

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/diag_ratio_t2.py
"""
import sys, numpy as np
import evaluate_t2 as E
from pathlib import Path
from kvcert import reference as R
from kvcert.reference import sketch as SK
from kvcert.fast import design_sizes
from kvcert.reference import design_uniforms
cap = E.load_capture(Path(sys.argv[1]) if len(sys.argv) > 1 else E.default_cache())  # [capture cache]
tau = cap["scaling"]; L=E.PREFIX; T=L+E.FUTURE; d=dv=64; D=32
out = {}
for layer in range(0, 30, 3):
    UL = E.importance_of_layer(cap, layer)
    for h in range(3):
        U = np.stack([design_uniforms(L, seed=(layer*3+h)*1000 + s) for s in range(D)])
        k = cap["k"][layer][h,:T].double().numpy(); v = cap["v"][layer][h,:T].double().numpy()
        q = cap["q"][layer][h*3:(h+1)*3][:, [L+o for o in E.OFFSETS]].double().numpy().reshape(-1, d)
        head = E.Head(q, k, v, UL[h], tau)
        for M in (0.15,):
            B = M*L*(d+dv)/(d+dv+1)
            sz = design_sizes(B, sinks=4, window=32, top_fraction=0.5)
            pi = R.inclusion_probabilities(UL[h], B, sinks=4, window=32, top=sz.top, floor=0.1)
            keep, pif, kf, A, oh = head.sample(pi, U)
            Vo = E.oracle_variance(head, pif, oh)
            err2 = np.linalg.norm(oh - head.o, axis=-1)**2
            # exact scores, orthogonal value rule
            gone = ~keep; w=(1-pi)/pi; mu=v[:L].mean(0); nu2=((v[:L]-mu)**2).sum(1)
            a2 = ((oh-mu)**2).sum(-1)
            E2 = head.E[:, :L]**2
            Bm = gone[:,None,:]*(w*E2)[None]
            kept_term = head.quad(kf[:, None, :] * ((1 - pif) / pif * head.E ** 2)[None], oh)
            Vorth = (kept_term + Bm@nu2 + a2*Bm.sum(-1))/head.Z[None]**2
            out.setdefault("orth-value/oracle", []).append((Vorth/Vo).ravel())
            out.setdefault("err2/oracle", []).append((err2/Vo).ravel())
            for C in (16,):
                lab = SK.kmeans_assign(k[:L], C)
                for th in (0, 0.5, 0.75, 1.0):
                    Vc = E.cluster_variance(head, pi, keep, kf, oh, lab, C, th)
                    out.setdefault(f"cl{C}:{th}/oracle", []).append((Vc/Vo).ravel())
            # evicted share of V
            Vev = (Bm@((v[:L]**2).sum(1)) - 2*np.einsum('dmj,dmj->dm', oh, Bm@v[:L]) + (oh**2).sum(-1)*Bm.sum(-1))/head.Z[None]**2
            out.setdefault("evicted share of V", []).append((Vev/Vo).ravel())
for k_, vals in out.items():
    x = np.concatenate(vals)
    print(f"{k_:24s}", " ".join(f"{q}:{np.quantile(x, q):.3g}" for q in (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)))
