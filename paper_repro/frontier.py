"""Accuracy against cost: the pure parts of the frontier (issue 55), shared by benchmarks/bench_frontier.py and
Table 6 of the reproduction (:func:`table`).

A *point* is one policy's per-example expected correctness and cost. A *baseline family* (a press at its fixed
ratios, joined with the full cache at cost 1) is interpolated linearly in cost at a point's mean cost c: the
mixture policy that runs the family's cheaper neighbouring point with probability w and the dearer one
otherwise, w set so that the mean cost is c, whose expected correctness on each example is the same mix.
A policy's difference is its accuracy minus the best family's at its cost, paired over examples, with a 95%
percentile bootstrap interval (paper_repro.bootstrap: resampled within (protocol, task); the best family
chosen again in each resample).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import Table

@dataclass
class Point:
    """One policy point: per-example expected correctness and cost (arrays over the example keys)."""

    family: str
    name: str
    params: dict
    correct: np.ndarray
    cost: np.ndarray

    @property
    def mean_cost(self) -> float:
        return float(np.mean(self.cost))

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.correct))


def top_share(scores, share: float) -> np.ndarray:
    """Bool mask of the ``round(share * n)`` largest scores (NaN ranks last, ties by position): the rule of
    paper_repro.claims._top, whose NaN handling is paper_repro.claims._score's."""
    from paper_repro.claims import _top

    s = np.asarray(scores, dtype=float)
    mask, _ = _top(np.where(np.isnan(s), -np.inf, s), share)
    return mask


def top_share_per_protocol(scores, protocols, share: float) -> np.ndarray:
    """:func:`top_share` within each protocol's requests (``protocols``: each request's protocol), joined: the
    requests an escalation rule re-runs when its threshold is a quantile of its own protocol's signal."""
    s, protocols = np.asarray(scores, dtype=float), np.asarray(protocols)
    mask = np.zeros(len(s), dtype=bool)
    for p in set(protocols.tolist()):
        sel = protocols == p
        mask[sel] = top_share(s[sel], share)
    return mask


def escalated(lo_correct, lo_cost, hi_correct, hi_cost, mask) -> tuple[np.ndarray, np.ndarray]:
    """Escalation's per-request correctness and cost: the re-run's answer where ``mask``, the first run's
    elsewhere; the cost counts both runs where re-run (``lo_cost + hi_cost``), the first run's elsewhere."""
    m = np.asarray(mask, dtype=bool)
    lo_c, hi_c = np.asarray(lo_correct, dtype=float), np.asarray(hi_correct, dtype=float)
    lo_k, hi_k = np.asarray(lo_cost, dtype=float), np.asarray(hi_cost, dtype=float)
    return np.where(m, hi_c, lo_c), lo_k + np.where(m, hi_k, 0.0)


def family_at(points: list, cost: float) -> np.ndarray | None:
    """A baseline family's per-example expected correctness at mean cost ``cost``: linear interpolation in
    cost between its two points around ``cost`` (the mixture policy of the module docstring); the dearest
    point above its cost; None below its cheapest point."""
    pts = sorted(points, key=lambda p: p.mean_cost)
    costs = np.array([p.mean_cost for p in pts])
    if not pts or cost < costs[0] - 1e-12:
        return None
    if cost >= costs[-1]:
        return np.asarray(pts[-1].correct, dtype=float)
    k = int(np.searchsorted(costs, cost, side="right")) - 1
    c0, c1 = costs[k], costs[k + 1]
    w = 1.0 if c1 <= c0 else (c1 - cost) / (c1 - c0)
    return w * np.asarray(pts[k].correct, dtype=float) + (1 - w) * np.asarray(pts[k + 1].correct, dtype=float)


def strata_of(keys: list) -> list[int]:
    """Sizes of the strata of sorted example keys (protocol, task, example): (protocol, task) when every such
    stratum holds at least 2 examples, else (protocol) (a stratum of one example resamples to itself: the
    interval would have no width)."""
    sizes: dict = {}
    for p, t, _ in keys:
        sizes[p, t] = sizes.get((p, t), 0) + 1
    if min(sizes.values()) < 2:
        sizes = {}
        for p, _, _ in keys:
            sizes[p] = sizes.get(p, 0) + 1
    return list(sizes.values())


def strata_label(keys: list) -> str:
    """Which strata :func:`strata_of` resamples within."""
    counts: dict = {}
    for p, t, _ in keys:
        counts[p, t] = counts.get((p, t), 0) + 1
    if min(counts.values()) >= 2:
        return "(protocol, task)"
    return "(protocol): a (protocol, task) stratum held one example"


def bootstrap_weights(keys: list, *, resamples: int, seed: int) -> np.ndarray:
    """Multiplicities (resamples, n) of the stratified resamples (paper_repro.bootstrap)."""
    from paper_repro.bootstrap import resample_indices, weights_of

    idx = resample_indices(strata_of(keys), resamples=resamples, seed=seed)
    return weights_of(idx, len(keys))


def paired_vs_baselines(point: Point, families: dict, weights: np.ndarray) -> dict:
    """The point's accuracy minus the best baseline family's at its mean cost, paired over examples:
    ``baseline`` (best family name at unit weights), ``baseline_accuracy``, ``diff`` and ``diff_ci``
    (95% percentile interval; the best family taken again in each resample); NaN where no family reaches
    the point's cost."""
    from paper_repro.bootstrap import percentile_interval, weighted_accuracy

    c = point.mean_cost
    at = {name: family_at(pts, c) for name, pts in families.items()}
    at = {k: v for k, v in at.items() if v is not None}
    if not at:
        nan = float("nan")
        return dict(baseline=None, baseline_accuracy=nan, diff=nan, diff_ci=[nan, nan])
    unit = np.ones((1, len(point.correct)))
    names = list(at)
    base_unit = np.array([weighted_accuracy(at[k], unit)[0] for k in names])
    best = names[int(np.argmax(base_unit))]
    mine = weighted_accuracy(point.correct, weights)
    base = np.max(np.stack([weighted_accuracy(at[k], weights) for k in names]), axis=0)
    lo, hi = percentile_interval(mine - base)
    return dict(baseline=best, baseline_accuracy=float(base_unit.max()),
                diff=float(point.accuracy - base_unit.max()), diff_ci=[lo, hi])


def cost_bin(cost: float, grid) -> float:
    """The nearest point of ``grid`` (costs above 1 fall in 1.0)."""
    return float(min(grid, key=lambda g: abs(g - min(cost, 1.0))))


def summarize(rows: list, *, recompute_gain: float, failure_auc_best: float, cert_driven, grid) -> dict:
    """The summary object: ``dominates_at_cost_points`` (cost bins, :func:`cost_bin` on ``grid``, holding a
    certificate-driven point (``cert_driven(family)``) whose accuracy is above the interpolated best
    baseline's), ``best_interval_excludes_zero`` (some certificate-driven point's paired interval lies above 0),
    ``recompute_gain_points`` and ``failure_auc_best`` as given, and the best point (largest interval low end)."""
    cert = [r for r in rows if cert_driven(r["family"]) and r.get("diff") is not None
            and np.isfinite(r["diff"])]
    bins = sorted({cost_bin(r["cost"], grid) for r in cert if r["diff"] > 0})
    excl = [r for r in cert if np.isfinite(r["diff_ci"][0]) and r["diff_ci"][0] > 0]
    best = max(cert, key=lambda r: (r["diff_ci"][0] if np.isfinite(r["diff_ci"][0]) else -np.inf, r["diff"]),
               default=None)
    return dict(
        dominates_at_cost_points=len(bins),
        best_interval_excludes_zero=bool(excl),
        recompute_gain_points=float(recompute_gain),
        failure_auc_best=float(failure_auc_best),
        dominated_cost_bins=bins,
        points_above_baseline=[r["name"] for r in cert if r["diff"] > 0],
        points_interval_above_zero=[r["name"] for r in excl],
        best_point=None if best is None else {k: best[k] for k in ("name", "cost", "accuracy", "baseline",
                                                                   "baseline_accuracy", "diff", "diff_ci")},
        certificate_driven_points=len(cert),
    )


# ---------------------------------------------------------------------------- Table 6: the frontier of T3's runs

#: T3's methods -> frontier family: the sampled designs at fixed ratios and SnapKV are the baselines (kvpress's
#: presses too, as "kvpress:<name>", when they ran)
T6_FAMILIES = {"poisson": "fixed", "poisson_tilted": "fixed-tilted", "poisson_cluster": "fixed-cluster",
               "snapkv": "snapkv"}
#: the sampled designs that escalation starts from (their certificate is recorded): the paper design, whose
#: certificate Table 3 scores, and the recommended design
T6_ESCALATE_FROM = ("poisson", "poisson_tilted")
#: the share of each protocol's requests escalated (Table 4's recompute share)
T6_SHARE = 0.25


def suite_points(records: list) -> tuple[list, dict, list]:
    """(points, baseline families, example keys) of Table 3's records (paper_repro.suites.collect): each
    method at each budget (cost: the budget, the memory every design is compared at; a sketch is counted in
    it), the full cache (cost 1), and escalation from each design of :data:`T6_ESCALATE_FROM`: the
    :data:`T6_SHARE` of each protocol's requests with the largest certificate score (Table 3's: the mean
    relative radius over every certified query; the rule reads no answer) re-run at the next budget or with
    the full cache, both runs' costs counted. Escalation to the full cache from the paper design is Table 4's
    request recompute. The streaming run (``poisson_stream``) is a different prompt processing and is left out."""
    from .suites import protocol_of

    keep = [r for r in records if r["method"] in T6_FAMILIES or r["method"] == "full"
            or r["method"].startswith("kvpress:")]
    keys = sorted({(protocol_of(r), r["task"], r["example"]) for r in keep})
    pos = {k: i for i, k in enumerate(keys)}
    protocols = np.array([k[0] for k in keys])

    def vec(method, budget, field):
        out = np.full(len(keys), np.nan)
        for r in keep:
            if r["method"] == method and r["budget"] == budget:
                out[pos[protocol_of(r), r["task"], r["example"]]] = float(r[field])
        return out

    def family(method):
        return T6_FAMILIES.get(method, method)

    budgets = sorted({r["budget"] for r in keep if r["method"] != "full"})
    full_c = vec("full", 1.0, "correct")
    pts = [Point("full", "full", {}, full_c, np.ones(len(keys)))]
    for method in sorted({r["method"] for r in keep} - {"full"}, key=lambda m: (family(m) != "fixed", m)):
        levels = [b for b in budgets if np.isfinite(vec(method, b, "correct")).any()]
        for b in levels:
            pts.append(Point(family(method), f"{family(method)} {b:g}", {"budget": b}, vec(method, b, "correct"),
                             np.full(len(keys), b)))
        if method not in T6_ESCALATE_FROM:
            continue
        for i, lo in enumerate(levels):
            mask = top_share_per_protocol(vec(method, lo, "cert"), protocols, T6_SHARE)
            for hi in levels[i + 1:i + 2] + [1.0]:
                hi_c = full_c if hi == 1.0 else vec(method, hi, "correct")
                c, cost = escalated(vec(method, lo, "correct"), np.full(len(keys), lo), hi_c,
                                    np.full(len(keys), hi), mask)
                to = "full" if hi == 1.0 else f"{hi:g}"
                pts.append(Point("escalation", f"escalate {family(method)} {lo:g}->{to}",
                                 dict(base=lo, to=hi, design=family(method), share=T6_SHARE), c, cost))
    families = {f: [p for p in pts if p.family == f] + [pts[0]] for f in dict.fromkeys(p.family for p in pts)
                if f not in ("full", "escalation")}
    return pts, families, keys


def table(records: list, cfg) -> Table:
    """Table 6: every T3 method and certificate-driven escalation on one accuracy-against-cost frontier, each
    escalation point against the best baseline family interpolated at its cost, paired over examples."""
    from .bootstrap import RESAMPLES

    pts, families, keys = suite_points(records)
    weights = bootstrap_weights(keys, resamples=RESAMPLES, seed=cfg.seed)
    rows = []
    for p in pts:
        row = dict(name=p.name, family=p.family, cost=p.mean_cost, accuracy=p.accuracy,
                   requests=int(np.isfinite(p.correct).sum()))
        if p.family == "escalation":
            d = paired_vs_baselines(p, families, weights)
            row.update(baseline=d["baseline"], baseline_accuracy=d["baseline_accuracy"], diff=d["diff"],
                       diff_ci_low=d["diff_ci"][0], diff_ci_high=d["diff_ci"][1], diff_ci=d["diff_ci"])
        rows.append(row)
    budgets = sorted({p.params["budget"] for p in pts if "budget" in p.params})
    s = summarize(rows, recompute_gain=float("nan"), failure_auc_best=float("nan"),
                  cert_driven=lambda f: f == "escalation", grid=tuple(budgets) + (1.0,))
    rows = [dict(policy=r.pop("name"), **{k: v for k, v in r.items() if k != "diff_ci"}) for r in rows]
    above = ", ".join(s["points_above_baseline"]) or "none"
    notes = [
        "cost: the budget (the memory every design is compared at, a sketch counted in it); an escalated request "
        "costs its first run plus the re-run (1 for the full cache)",
        f"escalation: the {T6_SHARE:.0%} of each protocol's requests with the largest certificate score (Table 3's "
        "mean relative radius; the rule reads no answer) re-run at the next budget or with the full cache; "
        "escalating the paper design's runs to the full cache is Table 4's request recompute",
        "diff: accuracy minus the best baseline family's (each design and press at its budgets, joined with the "
        "full cache) interpolated in cost at the point's mean cost, paired over examples; 95% percentile "
        "bootstrap interval, resampled within (protocol, task), the best family chosen again in each resample",
        f"escalation above the best baseline at its cost: {above} ({s['dominates_at_cost_points']} cost "
        f"point(s)); interval above 0: {', '.join(s['points_interval_above_zero']) or 'none'}",
        "the frontier with every policy (cell recompute, allocation, error targets, KeyDiff, ExpectedAttention) is "
        "benchmarks/bench_frontier.py (docs/frontier.md)",
    ]
    return Table("table6_frontier", "Table 6: acting on the certificate, accuracy against cost (T3's runs)", rows,
                 notes, columns=["policy", "family", "cost", "accuracy", "requests", "baseline", "baseline_accuracy",
                                 "diff", "diff_ci_low", "diff_ci_high"])
