"""Population view of each cell (no sampling): the tail token carrying the largest term of the true
linearized variance V -- its inclusion probability, its share of V, its future attention w_i,
and the attention the scorer's observation window and the held-out queries gave it.

usage: python diag_pop.py [design] [capture.pkl]   (design paper or floor05; the capture of collect.py,
default cap1824.pkl in the current folder); writes pop_<design>.npy in the current folder."""
import sys
import numpy as np
import torch
import kvcert.fast as F
from kvcert import reference as R
from collect import L, FUT, OFFS, WINDOW, BUDGETS, design_kwargs, load_capture
cap = load_capture(sys.argv[2] if len(sys.argv) > 2 else "cap1824.pkl")
scale, g, T = cap.scaling, cap.group, L + FUT
qpos = np.array([L + o for o in OFFS]); causal = torch.from_numpy(np.arange(T)[None, :] <= qpos[:, None])
rows = []
for layer in range(cap.layers):
    imp = F.snapkv_scores(cap.queries[layer][None, :, L - WINDOW:L], cap.keys[layer][None, :, :L], scale=scale)[0].double().numpy()
    for h in range(3):
        k = cap.keys[layer][h, :T].double(); v = cap.values[layer][h, :T].double()
        q = cap.queries[layer][h * g:(h + 1) * g][:, qpos].double()
        s = torch.where(causal[None], scale * torch.einsum("gqd,td->gqt", q, k), -torch.inf)
        w = torch.softmax(s, -1); o = w @ v
        D = ((v[None, None] - o[:, :, None]) ** 2).sum(-1)
        for b in BUDGETS:
            budget, kw = design_kwargs(imp[h], b, sys.argv[1] if len(sys.argv) > 1 else "paper")
            pi = torch.cat([torch.from_numpy(R.inclusion_probabilities(imp[h], budget, **kw)).float().double(), torch.ones(FUT, dtype=torch.float64)])
            tail = pi < 1
            tt = torch.where(tail, (1 - pi) / pi, 0.0) * w ** 2 * D
            i = tt.argmax(-1)
            un = imp[h] / imp[h].sum()
            for j in range(g):
                for t in range(len(OFFS)):
                    ii = int(i[j, t])
                    rows.append((layer, h * g + j, OFFS[t], b, float(pi[ii]), float(tt[j, t, ii] / tt[j, t].sum()),
                                 float(w[j, t, ii]), float(un[ii]) if ii < L else np.nan, ii,
                                 float(w[j, t, :L][tail[:L]].sum())))
np.save("pop_" + (sys.argv[1] if len(sys.argv) > 1 else "paper") + ".npy", np.array(rows))
