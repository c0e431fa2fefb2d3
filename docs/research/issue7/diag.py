"""Which cells fail (chebyshev, delta 0.05): layer/head/budget pattern and the tail diagnostics."""
import sys
import numpy as np
from evaluate import radii
D = dict(np.load(sys.argv[1]))
out, aux = radii(D)
err = D["err"]; tr = D["trace"]; V = D["Vtrue"]
KIND = sys.argv[2] if len(sys.argv) > 2 else "chebyshev"
print("failure pattern of", KIND)
hit = err <= out[KIND]
cov = hit.mean(1)
mse = (err**2).mean(1)
for b in (0.1, 0.25, 0.5):
    m = D["budget"] == b
    idx = np.where(m)[0]
    worst = idx[np.argsort(cov[idx])[:108]]
    rest = np.setdiff1d(idx, worst)
    def show(name, sel):
        print(f"  {name:6s} cov {cov[sel].mean():.3f}  mse/V {np.median(mse[sel]/V[sel]):.2f}  "
              f"median(tr)/V {np.median(np.median(tr[sel],1)/V[sel]):.2f}  mean(tr)/V {np.median(tr[sel].mean(1)/V[sel]):.2f}  "
              f"pop_neff {np.median(D['pop_neff'][sel]):.1f}  maxshare {np.median(D['maxshare_true'][sel]):.2f}  "
              f"tail Kish {np.median(D['neff_tail'][sel]):.1f}  tailshare {np.median(D['tailshare'][sel]):.2f}  "
              f"miss_w {np.median(D['miss_w'][sel]):.3f}  relerr {np.median(np.sqrt(mse[sel])/D['onorm'][sel]):.3f}  nu {np.median(aux['nu'][sel]):.1f} h {np.median(aux['h'][sel]):.1f}")
    print(f"budget {b}")
    show("worst", worst); show("rest", rest)
    # failing draws vs covered draws inside worst cells
    W = hit[worst]
    print(f"  in worst cells: miss_w fail {np.median(D['miss_w'][worst][~W]):.3f} vs hit {np.median(D['miss_w'][worst][W]):.3f};"
          f" tr/V fail {np.median((tr[worst]/V[worst,None])[~W]):.2f} vs hit {np.median((tr[worst]/V[worst,None])[W]):.2f};"
          f" nu fail {np.median(aux['nu'][worst][~W]):.1f} vs hit {np.median(aux['nu'][worst][W]):.1f}")
    L = D["layer"][worst]; Hh = D["qhead"][worst]; off = D["off"][worst]
    print("  worst cells by layer:", np.bincount(L, minlength=30).tolist())
    print("  by qhead:", np.bincount(Hh, minlength=9).tolist(), " by offset:", {o: int((off == o).sum()) for o in (0, 10, 20, 31)})
