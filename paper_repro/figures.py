"""Figures (PNG, matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvcert import reference as R


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def calibration(raw_cells: dict, path: Path, *, kind: str = "chebyshev", delta: float = 0.05) -> Path:
    """Median certificate radius vs realized RMS error, one point per replay cell, per budget."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.2, 4.6), dpi=110)
    lo, hi = np.inf, 0.0
    for (budget, design), cells in sorted(raw_cells.items()):
        if design != "paper":  # one design: the paper's (the others are in Table 2)
            continue
        rms = np.array([np.sqrt(np.mean(c[0] ** 2)) for c in cells])
        med = np.array([np.median(c[1][kind, delta]) for c in cells])
        ok = (rms > 0) & (med > 0)
        ax.scatter(rms[ok], med[ok], s=4, alpha=0.35, label=f"budget {budget:g} ({design})")
        if ok.any():
            lo, hi = min(lo, rms[ok].min(), med[ok].min()), max(hi, rms[ok].max(), med[ok].max())
    if np.isfinite(lo):
        grid = np.array([lo, hi])
        ax.plot(grid, grid, "k-", lw=0.8, label="radius = RMS error")
        ax.plot(grid, grid * np.sqrt(1 / delta), "k--", lw=0.8, label=r"radius = RMS / $\sqrt{\delta}$")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("realized RMS error per cell")
    ax.set_ylabel(f"median {kind} radius (delta = {delta:g})")
    ax.set_title("Calibration on the real model")
    ax.legend(fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def coverage_vs_budget(rows_real: list, rows_synth: list | None, path: Path, *, delta: float = 0.05) -> Path:
    """Coverage vs budget per certificate kind: pooled (left) and worst decile of cells (right).

    Real-model cells solid (design 'paper'); synthetic heads without the needle regime dashed.
    """
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 3.8), dpi=110, sharey=True)
    for i, kind in enumerate(R.KINDS):
        color = f"C{i}"
        real = sorted((r["budget"], r["coverage"], r["worst_decile"]) for r in rows_real
                      if r["kind"] == kind and r["delta"] == delta and r.get("design", "paper") == "paper")
        if real:
            b, c, w = map(np.array, zip(*real))
            axes[0].plot(b, c, "o-", color=color, label=f"{kind} (real model)")
            axes[1].plot(b, w, "o-", color=color, label=f"{kind} (real model)")
        if rows_synth:
            syn = {}
            for r in rows_synth:
                if r["kind"] == kind and r["delta"] == delta and r["regime"] != "needle":
                    syn.setdefault(r["budget"], []).append((r["coverage"], r["worst_decile"]))
            if syn:
                b = np.array(sorted(syn))
                axes[0].plot(b, [np.mean([x[0] for x in syn[t]]) for t in b], "s--", color=color, alpha=0.5,
                             label=f"{kind} (synthetic)")
                axes[1].plot(b, [min(x[1] for x in syn[t]) for t in b], "s--", color=color, alpha=0.5,
                             label=f"{kind} (synthetic)")
    for ax, title in zip(axes, ("pooled over cells", "worst decile of cells")):
        ax.axhline(1 - delta, color="k", lw=0.8)
        ax.set_xlabel("kept fraction (budget)")
        ax.set_title(f"{title} (nominal {1 - delta:.2f})", fontsize=10)
    axes[0].set_ylabel("coverage")
    axes[0].set_ylim(0.3, 1.02)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def roc_points(scores, positive):
    """ROC curve (false positive rate, true positive rate) of ranking by ``scores``.

    Thresholds at every distinct score, highest first; ties move both rates
    together (the diagonal segment), so the area under the returned curve
    equals :func:`paper_repro.suites.auc`.
    """
    s = np.asarray(scores, dtype=float)
    y = np.asarray(positive, dtype=bool)
    p, n = int(y.sum()), int((~y).sum())
    if p == 0 or n == 0:
        return np.array([0.0, 1.0]), np.array([0.0, 1.0])
    fpr, tpr = [0.0], [0.0]
    for t in np.unique(s)[::-1]:
        at = s >= t
        fpr.append(float((at & ~y).sum() / n))
        tpr.append(float((at & y).sum() / p))
    fpr.append(1.0)
    tpr.append(1.0)
    return np.array(fpr), np.array(tpr)


def roc(records: list, path: Path) -> Path:
    """ROC curves of the certificate and of output confidence: failure prediction
    (left, every PoissonPress run) and attribution (right, failed runs:
    cache-induced vs inherent), on the query-aware runs (the paper's protocol)."""
    from .claims import attribution_scores
    from .suites import QUERY_AWARE, auc, protocol_of

    plt = _plt()
    records = [r for r in records if protocol_of(r) == QUERY_AWARE] or records
    runs = [r for r in records if r["method"] == "poisson"]
    failed = np.array([not r["correct"] for r in runs])
    cert = np.array([r["cert"] for r in runs], dtype=float)
    panels = [("failure prediction", np.where(np.isnan(cert), -np.inf, cert),
               np.array([r["conf"] for r in runs], dtype=float), failed, "failed", "correct")]
    a_cert, a_conf, induced = attribution_scores(records)
    panels.append(("attribution of failures", a_cert, a_conf, induced, "cache-induced", "inherent"))
    fig, axes = plt.subplots(1, 2, figsize=(9.0, 4.2), dpi=110)
    for ax, (title, s_cert, s_conf, y, pos, neg) in zip(axes, panels):
        for scores, label, color in ((s_cert, "certificate (mean relative radius)", "C0"),
                                     (s_conf, "output confidence (-mean log p)", "C1")):
            x, t = roc_points(scores, y)
            a = auc(scores, y)
            ax.plot(x, t, "-", color=color, label=f"{label}: AUC {a:.2f}" if np.isfinite(a) else label)
        ax.plot([0, 1], [0, 1], "k:", lw=0.8)
        ax.set_xlabel(f"false positive rate ({neg} runs flagged)")
        ax.set_ylabel(f"true positive rate ({pos} runs flagged)")
        ax.set_title(f"{title} ({int(y.sum())} {pos} / {int((~y).sum())} {neg})", fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
