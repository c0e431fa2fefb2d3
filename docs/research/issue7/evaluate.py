"""Candidate certificates on the per-draw statistics written by collect.py.

All constants below are fixed by the argument in REPORT.md, before any coverage was read.
usage: python evaluate.py base.npz [label]
"""
import sys

import numpy as np
from scipy import stats

DELTA = 0.05
NU0 = 8.0  # verdict: relative s.e. of the trace sqrt(2/nu) > 1/2  <=>  nu < 8


def radii(D):
    tr, s2, f2 = D["trace"], D["sumx2"], D["frob2"]
    tr = np.maximum(tr, 1e-300)
    h = np.clip(tr ** 2 / np.maximum(f2, 1e-300), 1.0, 64.0)       # Satterthwaite dof of ||e||^2
    nu = 2 * tr ** 2 / np.maximum(s2, 1e-300)                       # Satterthwaite dof of trace_hat
    nuK = np.maximum(D["neff_tail"] - 1, 1e-6)                      # Kish dof of the tail
    out = {}
    out["chebyshev"] = np.sqrt(tr / DELTA)
    out["chi2"] = np.sqrt(tr / h * stats.chi2.ppf(1 - DELTA, h))
    out["F_satt"] = np.sqrt(tr * stats.f.ppf(1 - DELTA, h, nu))
    out["F_kish"] = np.sqrt(tr * stats.f.ppf(1 - DELTA, h, nuK))
    trU = tr + stats.norm.ppf(1 - DELTA / 2) * np.sqrt(s2)
    out["ucb_chi2"] = np.sqrt(trU / h * stats.chi2.ppf(1 - DELTA / 2, h))
    out["ucb_cheb"] = np.sqrt(trU / (DELTA / 2))
    out["cheb_ucb_nu"] = np.sqrt(tr * nu / stats.chi2.ppf(DELTA / 2, nu) / (DELTA / 2))
    # diagnostic only (uses the truth): chebyshev with the true linearized design variance
    out["oracle_cheb"] = np.sqrt(np.broadcast_to(D["Vtrue"][:, None], tr.shape) / DELTA)
    out["oracle_chi2h"] = np.sqrt(np.broadcast_to(D["Vtrue"][:, None], tr.shape) / h * stats.chi2.ppf(1 - DELTA, h))
    if "r_add" in D:   # candidate 3: eviction-time sketch of E, additive (triangle inequality)
        out["cheb+sketch"] = out["chebyshev"] + D["r_add"]
        out["chi2+sketch"] = out["chi2"] + D["r_add"]
        out["F_satt+sketch"] = out["F_satt"] + D["r_add"]
    if "r_add2" in D:  # candidate 3b: only the model-predicted mass beyond the HT imputation
        out["cheb+sketch2"] = out["chebyshev"] + D["r_add2"]
        out["chi2+sketch2"] = out["chi2"] + D["r_add2"]
    if "cal_max" in D:  # candidate 5: split-conformal factor from 32 held-out prefix queries
        out["conformal"] = np.sqrt(D["cal_max"] * tr)
        vp = np.broadcast_to((D["relse_held"] > 0.5)[:, None], tr.shape)      # eviction-time verdict
        vo = np.broadcast_to((D["relse_future"] > 0.5)[:, None], tr.shape)    # oracle verdict (truth)
        out["chebyshev+popverdict"] = np.where(vp, np.inf, out["chebyshev"])
        out["chi2+popverdict"] = np.where(vp, np.inf, out["chi2"])
        out["conformal+popverdict"] = np.where(vp, np.inf, out["conformal"])
        out["chi2+oracleverdict"] = np.where(vo, np.inf, out["chi2"])
        out["chebyshev+oracleverdict"] = np.where(vo, np.inf, out["chebyshev"])
    fires = nu < NU0
    out["F_satt+verdict"] = np.where(fires, np.inf, out["F_satt"])
    out["chi2+verdict"] = np.where(fires, np.inf, out["chi2"])
    return out, dict(nu=nu, h=h, nuK=nuK, fires=fires)


def summarize(err, r, fires=None):
    """pooled, worst decile, tightness, fires% -- as paper_repro.synthetic_coverage.summarize;
    with a verdict, coverage is over the draws where it does not fire (a fired draw is neither)."""
    ok = np.ones_like(err, bool) if fires is None else ~fires
    hit = (err <= r) & ok
    n_ok = ok.sum(1)
    cov_cell = np.where(n_ok > 0, hit.sum(1) / np.maximum(n_ok, 1), np.nan)
    pooled = hit.sum() / ok.sum()
    cc = cov_cell[~np.isnan(cov_cell)]
    worst = np.sort(cc)[: max(1, int(np.ceil(0.1 * cc.size)))].mean()
    rms = np.sqrt((err ** 2).mean(1))
    rr = np.where(ok, r, np.nan)
    med = np.nanmedian(rr, 1)
    tight = np.nanmedian(med / rms)
    return dict(pooled=pooled, worst=worst, tight=tight, fires=1 - ok.mean())


def main(path, label=""):
    D = dict(np.load(path))
    out, aux = radii(D)
    rng = np.random.default_rng(1)
    print(f"## {label or path}")
    print("noise floor of worst_decile for an exactly calibrated 0.95 certificate, 1080 cells x 64 draws:",
          round(float(np.mean([np.sort(rng.binomial(64, .95, 1080) / 64)[:108].mean() for _ in range(50)])), 3))
    rel = (D["err"] / D["onorm"][:, None]).mean(1)
    print("accuracy (relative L2 error, mean over draws then cells):",
          {b: round(float(rel[D["budget"] == b].mean()), 4) for b in (0.1, 0.25, 0.5)},
          "median:", {b: round(float(np.median(rel[D["budget"] == b])), 4) for b in (0.1, 0.25, 0.5)})
    print("| kind | layers | budget | pooled | worst decile | tightness | fires% |")
    print("|---|---|---|---|---|---|---|")
    for kind, r in out.items():
        fires = (np.isinf(r) if "verdict" in kind else None)
        for lay, lm in [("all", np.ones_like(D["layer"], bool)), ("0-14", D["layer"] < 15), ("15-29", D["layer"] >= 15)]:
            if lay != "all" and kind not in ("chebyshev", "conformal", "chi2+popverdict", "conformal+popverdict"):
                continue
            for b in (0.1, 0.25, 0.5):
                m = (D["budget"] == b) & lm
                s = summarize(D["err"][m], r[m], None if fires is None else fires[m])
                print(f"| {kind} | {lay} | {b} | {s['pooled']:.3f} | {s['worst']:.3f} | {s['tight']:.2f} | "
                      f"{100 * s['fires']:.1f} |")
    return D, out, aux


if __name__ == "__main__":
    main(*sys.argv[1:])
