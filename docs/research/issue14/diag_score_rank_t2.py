"""Issue 14, T2 diagnostic: score error of low-rank key codes on the tail tokens, weighted by e^{2 s}.

Even layers, all KV heads, the 12 future queries per head; tail = positions 4 .. L - 33 (sinks and
window are kept with certainty). pca: principal directions of the prefix keys; qpca: principal
directions in the metric of the observation window's query second moment (the last 32 prefix
queries of the group). Unquantized codes. Run from the repository root (the optional argument is evaluate_t2.py's capture cache,
default as there; made by the first run, see README.md):

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/diag_score_rank_t2.py
"""
import sys, numpy as np
import evaluate_t2 as E
from pathlib import Path
cap = E.load_capture(Path(sys.argv[1]) if len(sys.argv) > 1 else E.default_cache())  # [capture cache]
tau = cap["scaling"]; L=E.PREFIX; T=L+E.FUTURE; d=64
res = {}
for layer in range(0, 30, 2):
    for h in range(3):
        k = cap["k"][layer][h,:L].double().numpy()
        q = cap["q"][layer][h*3:(h+1)*3][:, [L+o for o in E.OFFSETS]].double().numpy().reshape(-1, d)
        qobs = cap["q"][layer][h*3:(h+1)*3][:, L-32:L].double().numpy().reshape(-1, d)
        m = k.mean(0); kc = k - m
        s = tau * q @ k.T
        s = s[:, 4:L-32]; wgt = np.exp(2*(s - s.max(1, keepdims=True)))
        wgt /= wgt.sum(1, keepdims=True)
        Sq = qobs.T @ qobs / len(qobs); ev_, evec = np.linalg.eigh(Sq + 1e-3*np.trace(Sq)/d*np.eye(d))
        Sh = evec @ np.diag(np.sqrt(ev_)) @ evec.T; Shi = evec @ np.diag(1/np.sqrt(ev_)) @ evec.T
        _, _, vt = np.linalg.svd(kc, full_matrices=False)
        _, _, vq = np.linalg.svd(kc @ Sh, full_matrices=False)
        for basis in ("pca", "qpca"):
            for r in (4, 8, 16, 32):
                if basis == "pca": khat = m + kc @ vt[:r].T @ vt[:r]
                else: khat = m + (kc @ Sh @ vq[:r].T) @ (Shi @ vq[:r].T).T
                e = (tau * q @ (k - khat).T)[:, 4:L-32]
                rms = np.sqrt((wgt * e**2).sum(1))  # e^{2s}-weighted rms score error per query
                res.setdefault((basis, r), []).append(rms)
for key, v in res.items():
    x = np.concatenate(v)
    print(key, "e^{2s}-weighted RMS score error (nats): median %.2f q75 %.2f q90 %.2f" % tuple(np.quantile(x, [0.5, 0.75, 0.9])))
