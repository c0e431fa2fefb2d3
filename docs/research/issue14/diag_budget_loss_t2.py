"""Issue 14, T2 diagnostic: the error cost of a sketch = the sampled budget it takes.

Every 5th layer, 64 draws per KV head: mean relative error of the paper design at budget B - loss
over that at B, with the top slice kept (fixtop) or re-sized at B - loss (retop). Run from the repository root (the optional argument is evaluate_t2.py's capture cache,
default as there; made by the first run, see README.md):

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/diag_budget_loss_t2.py
"""
import sys, numpy as np
import evaluate_t2 as E
from pathlib import Path
from kvcert import reference as R
from kvcert.fast import design_sizes
from kvcert.reference import design_uniforms
cap = E.load_capture(Path(sys.argv[1]) if len(sys.argv) > 1 else E.default_cache())  # [capture cache]
tau = cap["scaling"]; L=E.PREFIX; T=L+E.FUTURE; d=dv=64; D=64
out = {}
for layer in range(0, 30, 5):
    UL = E.importance_of_layer(cap, layer)
    for h in range(3):
        U = np.stack([design_uniforms(L, seed=(layer*3+h)*1000 + s) for s in range(D)])
        k = cap["k"][layer][h,:T].double().numpy(); v = cap["v"][layer][h,:T].double().numpy()
        q = cap["q"][layer][h*3:(h+1)*3][:, [L+o for o in E.OFFSETS]].double().numpy().reshape(-1, d)
        head = E.Head(q, k, v, UL[h], tau)
        for M in E.MEMORIES:
            B = M*L*(d+dv)/(d+dv+1)
            sz = design_sizes(B, sinks=4, window=32, top_fraction=0.5)
            for loss in (0, 5, 10, 20, 40):
                for mode in ("fixtop", "retop"):
                    b = B - loss
                    top = sz.top if mode == "fixtop" else design_sizes(b, sinks=4, window=32, top_fraction=0.5).top
                    pi = R.inclusion_probabilities(UL[h], b, sinks=4, window=32, top=top, floor=0.1)
                    keep, pif, kf, A, oh = head.sample(pi, U)
                    rel = (np.linalg.norm(oh - head.o, axis=-1) / head.onorm).mean()
                    out.setdefault((M, loss, mode), []).append(rel)
for M in E.MEMORIES:
    base = np.mean(out[(M, 0, "fixtop")])
    print(M, " ".join(f"{loss}:{np.mean(out[(M,loss,'fixtop')])/base:.3f}/{np.mean(out[(M,loss,'retop')])/base:.3f}" for loss in (0,5,10,20,40)))
