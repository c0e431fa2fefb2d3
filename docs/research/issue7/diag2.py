"""Worst-decile cells of a kind vs the rest, with the population view of diag_pop.py."""
import sys
import numpy as np
from evaluate import radii
D = dict(np.load(sys.argv[1])); P = np.load(sys.argv[2]); kind = sys.argv[3]
out, aux = radii(D)
cov = (D["err"] <= out[kind]).mean(1)
print(f"{kind} on {sys.argv[1]}: columns = median over cells")
print("| budget | cells | coverage | pi of top-V token | its V share | its future w | its obs-window share | its position | tail w share | tail Kish n_eff | rel err |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for b in (0.1, 0.25, 0.5):
    idx = np.where(D["budget"] == b)[0]
    worst = idx[np.argsort(cov[idx])[:108]]; rest = np.setdiff1d(idx, worst)
    for name, sel in (("worst 10%", worst), ("rest", rest)):
        rel = np.median(np.sqrt((D["err"][sel] ** 2).mean(1)) / D["onorm"][sel])
        print(f"| {b} | {name} | {cov[sel].mean():.3f} | {np.median(P[sel, 4]):.4f} | {np.median(P[sel, 5]):.2f} | {np.median(P[sel, 6]):.4f} | "
              f"{np.nanmedian(P[sel, 7]):.5f} | {np.median(P[sel, 8]):.0f} | {np.median(P[sel, 9]):.3f} | {np.median(D['neff_tail'][sel]):.1f} | {rel:.3f} |")
    L = D["layer"][worst]
    print(f"|  | worst by layer (0-29) | {np.bincount(L, minlength=30).tolist()} |")
    print(f"|  | worst by q-head | {np.bincount(D['qhead'][worst], minlength=9).tolist()} |")
