"""Two shapes for an upper confidence bound on the variance (issue 7, second session).

Both replace the trace by V_U = tr * nu / chi2_{nu; delta/2} (Satterthwaite, nu = 2 tr^2 / s2,
the UCB of `chebyshev_ucb`) and spend the other delta/2 on the tail of ||e||^2:
- cheb_ucb_nu  (= kvcert's chebyshev_ucb): Markov,          r^2 = V_U / (delta/2)
- chi2_ucb_nu: a Gaussian/Satterthwaite tail, r^2 = V_U / h * chi2_{h; 1-delta/2},
  h = tr^2 / ||Sigma_hat||_F^2 clipped to [1, 64] (as the chi2 kind)
Constants fixed by the derivation (delta = 0.05, union bound delta/2 + delta/2); nothing fitted.
usage: python evaluate_ucb_shapes.py base.npz
"""
import sys

import numpy as np
from scipy import stats

from evaluate import summarize

DELTA = 0.05


def main(path):
    D = dict(np.load(path))
    tr = np.maximum(D["trace"], 1e-300)
    h = np.clip(tr ** 2 / np.maximum(D["frob2"], 1e-300), 1.0, 64.0)
    nu = np.maximum(2 * tr ** 2 / np.maximum(D["sumx2"], 1e-300), 2.0)
    VU = tr * nu / stats.chi2.ppf(DELTA / 2, nu)
    radii = {
        "chebyshev": np.sqrt(tr / DELTA),
        "cheb_ucb_nu": np.sqrt(VU / (DELTA / 2)),
        "chi2_ucb_nu": np.sqrt(VU / h * stats.chi2.ppf(1 - DELTA / 2, h)),
    }
    budget = D["budget"]
    print("| kind | budget | pooled | worst decile | tightness |\n|---|---|---|---|---|")
    for name, r in radii.items():
        for b in np.unique(budget):
            m = budget == b
            s = summarize(D["err"][m], r[m])
            print(f"| {name} | {b:g} | {s['pooled']:.3f} | {s['worst']:.3f} | {s['tight']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
