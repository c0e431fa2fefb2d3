"""Percentile bootstrap over examples for Tables 3 and 4, paired between designs.

An example (one seeded prompt of one task) is the unit that is resampled: the
runs of every press at every budget on that example travel together, so a
difference between two presses is computed on the same resampled examples
(paired). Examples are resampled with replacement within their task
(stratified: each task keeps its size), ``RESAMPLES`` times, from a generator
seeded by the configuration's seed.

A resample is a vector of multiplicities :math:`w_i` (how often example
:math:`i` was drawn). The statistics, with weights:

.. math::

    \\mathrm{acc}(w) = \\frac{\\sum_i w_i c_i}{\\sum_i w_i}, \\qquad
    \\mathrm{AUC}(w) = \\frac{\\sum_{i \\in F} \\sum_{j \\notin F} w_i w_j
    \\left([s_i > s_j] + \\tfrac12 [s_i = s_j]\\right)}{\\left(\\sum_{i \\in F} w_i\\right)
    \\left(\\sum_{j \\notin F} w_j\\right)}

(``F`` the failed runs, ``s`` the score), which at :math:`w = 1` are exactly
:func:`paper_repro.suites.auc` and the accuracy of Table 3. The recompute gain
of Table 4 ranks the resampled list itself (a drawn-twice example is two
runs), as :mod:`paper_repro.claims` ranks the runs.

The interval is the percentile interval: the :math:`(1 \\pm L)/2` quantiles of
the statistic over the resamples where it is defined, with ``L = LEVEL``. An
AUC is undefined in a resample with no failure or no success; when fewer than
``MIN_DEFINED`` of the resamples define the statistic the interval is NaN
(it would describe a minority of the resamples). A paired difference is
defined where both of its terms are.

References: Efron & Tibshirani, *An Introduction to the Bootstrap* (1993),
chapter 13 (percentile interval); arXiv 2607.21475 for the statistics.
"""

from __future__ import annotations

import numpy as np

from .suites import QUERY_AWARE, SKETCHES, protocol_of

#: bootstrap resamples of the reproduction
RESAMPLES = 1000
#: two-sided coverage of the intervals
LEVEL = 0.95
#: the share of resamples that must define a statistic for its interval to be reported
MIN_DEFINED = 0.5
#: the paper's design and the recommended one (``PoissonPress()``'s default: the tilted sketch), as
#: methods of :func:`paper_repro.suites.collect`; Table 3's paired differences are default minus paper
PAPER_METHOD = "poisson"
DEFAULT_SKETCH = "tilted"
#: salt of the bootstrap's generator, so its stream is not the presses' (both start from ``Config.seed``)
_SALT = 0xB007


def percentile_interval(samples, *, level: float = LEVEL, min_defined: float = MIN_DEFINED) -> tuple:
    """``(low, high)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the finite
    ``samples`` (linear interpolation); ``(nan, nan)`` when fewer than ``min_defined`` of them are finite.

    Parameters
    ----------
    samples : array of shape (B,), the statistic over B resamples (NaN where undefined)
    level : float in (0, 1)
    min_defined : float in [0, 1]
    """
    x = np.asarray(samples, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"samples must be a non-empty 1-d array, got shape {x.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not 0 <= min_defined <= 1:
        raise ValueError(f"min_defined must be in [0, 1], got {min_defined}")
    ok = x[np.isfinite(x)]
    if ok.size == 0 or ok.size < min_defined * x.size:
        return float("nan"), float("nan")
    lo, hi = np.quantile(ok, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def resample_indices(sizes, *, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """Stratified resamples: an int array of shape ``(resamples, sum(sizes))`` whose columns
    ``offset_s .. offset_s + sizes[s]`` hold draws with replacement from stratum ``s``'s own indices
    (a stratum is a task and keeps its size). Seeded by ``seed``; the same ``sizes`` and ``seed`` give
    the same array."""
    sizes = [int(n) for n in sizes]
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of ints >= 1, got {sizes}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = np.random.default_rng([int(seed), _SALT])
    offsets = np.cumsum([0] + sizes[:-1])
    return np.concatenate([off + rng.integers(0, n, size=(resamples, n)) for off, n in zip(offsets, sizes)],
                          axis=1)


def weights_of(indices: np.ndarray, n: int) -> np.ndarray:
    """Multiplicities ``w[b, i]`` (float) of item ``i`` in resample ``b`` of ``indices`` (shape (B, m))."""
    idx = np.asarray(indices)
    flat = (np.arange(idx.shape[0])[:, None] * n + idx).ravel()
    return np.bincount(flat, minlength=idx.shape[0] * n).reshape(idx.shape[0], n).astype(float)


def weighted_accuracy(correct, weights) -> np.ndarray:
    """``sum_i w_i c_i / sum_i w_i`` per row of ``weights`` (shape (B, n)); ``correct`` of shape (n,)."""
    c = np.asarray(correct, dtype=float)
    w = np.asarray(weights, dtype=float)
    total = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, w @ c / np.where(total > 0, total, 1), np.nan)


def weighted_auc(scores, positive, weights, use=None) -> np.ndarray:
    """The AUC of ``scores`` for ``positive`` (module docstring) per row of ``weights`` (shape (B, n)),
    over the items where ``use`` (default all) holds; NaN in a row without both classes. At unit weights
    it is :func:`paper_repro.suites.auc` (the same comparisons, NaN scores included)."""
    s = np.asarray(scores, dtype=float)
    pos = np.asarray(positive, dtype=bool)
    w = np.asarray(weights, dtype=float)
    if s.shape != pos.shape or s.ndim != 1 or w.ndim != 2 or w.shape[1] != s.size:
        raise ValueError(f"scores and positive must be (n,) and weights (B, n), got {s.shape}, {pos.shape}, "
                         f"{w.shape}")
    use = np.ones_like(pos) if use is None else np.asarray(use, dtype=bool)
    wp, wn = w * (use & pos), w * (use & ~pos)
    den = wp.sum(axis=1) * wn.sum(axis=1)
    # sum over pairs by sorting: a NaN score wins and ties nothing (as in suites.auc), so it adds nothing to
    # the numerator and stays in the denominator; the other scores in groups of equal values, ascending
    ok = np.flatnonzero(~np.isnan(s))
    num = np.zeros(w.shape[0])
    if ok.size:
        order = ok[np.argsort(s[ok], kind="stable")]
        v = s[order]
        starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
        gp = np.add.reduceat(wp[:, order], starts, axis=1)
        gn = np.add.reduceat(wn[:, order], starts, axis=1)
        below = np.cumsum(gn, axis=1) - gn  # negative weight strictly below each group
        num = (gp * (below + 0.5 * gn)).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def recompute_gain(correct, full, cert, conf, indices, *, share: float) -> np.ndarray:
    """Points gained by recomputing the ``round(share * n)`` runs with the largest certificate with the
    full cache, over the better of random (its exact expectation) and confidence scheduling, for each
    resample of ``indices`` (shape (B, n)): :func:`paper_repro.claims._recompute_one` on the resampled
    list (NaN scores rank last; ties by position, as there)."""
    idx = np.asarray(indices)
    c, f = np.asarray(correct, dtype=float)[idx], np.asarray(full, dtype=float)[idx]
    n = idx.shape[1]
    k = int(round(share * n))
    acc = {}
    for name, score in (("cert", cert), ("conf", conf)):
        s = np.asarray(score, dtype=float)
        s = np.where(np.isnan(s), -np.inf, s)[idx]
        top = np.zeros(idx.shape, dtype=bool)
        np.put_along_axis(top, np.argsort(-s, axis=1, kind="stable")[:, :k], True, axis=1)
        acc[name] = 100 * np.where(top, f, c).mean(axis=1)
    rand = 100 * (c.mean(axis=1) + k / n * (f.mean(axis=1) - c.mean(axis=1)))
    return acc["cert"] - np.maximum(rand, acc["conf"])


class Runs:
    """One protocol's runs as arrays over its examples, sorted by (task, example) as
    :func:`paper_repro.suites.select` sorts them: ``get(method, budget, field)`` is a float array of
    shape (n,), NaN where that press has no run on the example; ``indices`` the stratified resamples."""

    def __init__(self, records, *, resamples: int = RESAMPLES, seed: int = 0):
        self.keys = sorted({(r["task"], r["example"]) for r in records})
        if not self.keys:
            raise ValueError("records must hold at least one run")
        self.position = {k: i for i, k in enumerate(self.keys)}
        self.tasks = list(dict.fromkeys(t for t, _ in self.keys))
        self.task_of = np.array([self.tasks.index(t) for t, _ in self.keys])
        self.fields: dict = {}
        for r in records:
            cell = self.fields.setdefault((r["method"], r["budget"]), {})
            for name in ("correct", "cert", "conf"):
                cell.setdefault(name, np.full(len(self.keys), np.nan))[self.position[r["task"], r["example"]]] = \
                    float(r[name])
        self.indices = resample_indices([int((self.task_of == t).sum()) for t in range(len(self.tasks))],
                                        resamples=resamples, seed=seed)
        self.weights = weights_of(self.indices, len(self.keys))
        self.unit = np.ones((1, len(self.keys)))

    def has(self, method, budget) -> bool:
        return (method, budget) in self.fields

    def get(self, method, budget, name) -> np.ndarray:
        return self.fields[method, budget][name]

    def budgets(self, method) -> list:
        return sorted(b for m, b in self.fields if m == method)

    def cell_auc(self, method, budget, task, weights) -> np.ndarray:
        """Failure-prediction AUC of the certificate (Table 3's ``auc_certificate``) in one cell."""
        correct = self.get(method, budget, "correct")
        use = (self.task_of == self.tasks.index(task)) & ~np.isnan(correct)
        return weighted_auc(self.get(method, budget, "cert"), correct == 0, weights, use)

    def cell_acc(self, method, budget, task, weights) -> np.ndarray:
        correct = self.get(method, budget, "correct")
        use = (self.task_of == self.tasks.index(task)) & ~np.isnan(correct)
        return weighted_accuracy(np.where(use, correct, 0), weights * use)

    def attribution_auc(self, method, weights) -> np.ndarray:
        """Table 4's attribution AUC: over the failed runs of ``method`` at all its budgets, the
        certificate (NaN -> -inf) for 'the full cache answers right'."""
        full = self.get("full", 1.0, "correct")
        budgets = self.budgets(method)
        correct = np.concatenate([self.get(method, b, "correct") for b in budgets])
        cert = np.concatenate([self.get(method, b, "cert") for b in budgets])
        return weighted_auc(np.where(np.isnan(cert), -np.inf, cert), np.tile(full == 1, len(budgets)),
                            np.tile(weights, len(budgets)), correct == 0)

    def recompute(self, method, budget, indices, share) -> np.ndarray:
        present = ~np.isnan(self.get(method, budget, "correct"))
        if not present.all():
            raise ValueError(f"{method} @ {budget}: runs missing on some examples; recompute needs all")
        return recompute_gain(self.get(method, budget, "correct"), self.get("full", 1.0, "correct"),
                              self.get(method, budget, "cert"), self.get(method, budget, "conf"), indices,
                              share=share)


def _both(point, samples) -> tuple:
    """(point estimate, (low, high)) with the interval NaN where the point estimate is."""
    point = float(np.asarray(point).ravel()[0])
    return point, (percentile_interval(samples) if np.isfinite(point) else (float("nan"), float("nan")))


def _nanmean_rows(columns) -> np.ndarray:
    """Mean over cells of each resample, over the cells it defines (NaN where it defines none)."""
    x = np.stack(columns, axis=1)
    ok = np.isfinite(x)
    with np.errstate(invalid="ignore"):
        return np.where(ok.any(axis=1), np.where(ok, x, 0).sum(axis=1) / ok.sum(axis=1), np.nan)


def _sketches(runs: Runs) -> list:
    return [name for name in SKETCHES if any(m == f"poisson_{name}" for m, _ in runs.fields)]


def t3_cells(records, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Intervals of Table 3's rows: ``{(protocol, task, budget): columns}`` with ``acc_<m>_ci_low/high``
    (m: poisson, each sketch's "poisson_<name>", snapkv), ``auc_certificate[_<name>]_ci_low/high``, and
    the paired differences default (``poisson_<DEFAULT_SKETCH>``) minus paper (``poisson``):
    ``acc_diff_vs_paper``, ``auc_certificate_diff_vs_paper`` with ``*_diff_ci_low/high``."""
    out = {}
    for protocol in dict.fromkeys(protocol_of(r) for r in records):
        runs = Runs([r for r in records if protocol_of(r) == protocol], resamples=resamples, seed=seed)
        sketches = _sketches(runs)
        methods = [PAPER_METHOD, *(f"poisson_{n}" for n in sketches), "snapkv"]
        default = f"poisson_{DEFAULT_SKETCH}" if DEFAULT_SKETCH in sketches else None
        for task in runs.tasks:
            for b in runs.budgets(PAPER_METHOD):
                row, stats = {}, {}
                for m in methods:
                    if not runs.has(m, b):
                        continue
                    stats["acc", m] = (runs.cell_acc(m, b, task, runs.unit), runs.cell_acc(m, b, task, runs.weights))
                    row.update(_columns(f"acc_{m}", _both(*stats["acc", m])[1]))
                    if m != "snapkv":
                        stats["auc", m] = (runs.cell_auc(m, b, task, runs.unit),
                                           runs.cell_auc(m, b, task, runs.weights))
                        suffix = "" if m == PAPER_METHOD else m[len("poisson"):]
                        row.update(_columns(f"auc_certificate{suffix}", _both(*stats["auc", m])[1]))
                if default is not None and runs.has(default, b):
                    for stat, name in (("acc", "acc"), ("auc", "auc_certificate")):
                        (p0, s0), (p1, s1) = stats[stat, PAPER_METHOD], stats[stat, default]
                        point, (lo, hi) = _both(p1 - p0, s1 - s0)
                        row.update({f"{name}_diff_vs_paper": point, f"{name}_diff_ci_low": lo,
                                    f"{name}_diff_ci_high": hi})
                out[protocol, task, b] = row
    return out


def _columns(key, interval) -> dict:
    return {f"{key}_ci_low": interval[0], f"{key}_ci_high": interval[1]}


def with_intervals(table, records, *, resamples: int = RESAMPLES, seed: int = 0):
    """Table 3 (:func:`paper_repro.suites.table`) with :func:`t3_cells`'s columns added to each row and
    a note on them; the same table object. Its CSV holds every interval, its Markdown the paired
    differences (``*_diff_vs_paper`` and their intervals) beside the original columns."""
    cells = t3_cells(records, resamples=resamples, seed=seed)
    before = list(table.rows[0]) if table.rows else []
    for row in table.rows:
        row.update(cells.get((row["protocol"], row["task"], row["budget"]), {}))
    # every interval goes to the CSV; the Markdown adds only the paired differences with theirs
    table.columns = list(dict.fromkeys(k for row in table.rows for k in row))
    table.shown = before + [k for k in table.columns if k not in before and "_diff" in k]
    table.notes.append(NOTE_T3)
    return table


NOTE_T3 = (f"*_ci_low / *_ci_high: {LEVEL:.0%} percentile bootstrap intervals over the cell's examples "
           f"({RESAMPLES} resamples with replacement, seeded by the configuration's seed; an AUC's interval over "
           f"the resamples that have both a failure and a success, nan when fewer than {MIN_DEFINED:.0%} do). "
           f"*_diff_vs_paper: the recommended design (PoissonPress(sketch='{DEFAULT_SKETCH}'), the press's "
           "default sketch) minus the paper design on the same resampled examples (paired), with its interval; "
           "a difference whose interval contains 0 is not a finding.")


def t3_means(records, *, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Intervals of the means over Table 3's cells of the first protocol (results.md's sketch section):
    ``<stat>[_<name>]_ci`` for stat ``acc_poisson`` and ``auc_certificate``, and for each sketch the paired
    difference to the paper design, ``<stat>_<name>_diff`` with ``<stat>_<name>_diff_ci``. A resample's
    mean is over the cells it defines; the difference is of the two means (as results.md shows them)."""
    first = next((protocol_of(r) for r in records), QUERY_AWARE)
    runs = Runs([r for r in records if protocol_of(r) == first], resamples=resamples, seed=seed)
    budgets = runs.budgets(PAPER_METHOD)
    out = {}
    designs = {"": PAPER_METHOD, **{f"_{n}": f"poisson_{n}" for n in _sketches(runs)}}
    for stat, fn in (("acc_poisson", runs.cell_acc), ("auc_certificate", runs.cell_auc)):
        means = {}
        for suffix, m in designs.items():
            cells = [(task, b) for task in runs.tasks for b in budgets if runs.has(m, b)]
            if not cells:
                continue
            means[suffix] = (_nanmean_rows([fn(m, b, t, runs.unit) for t, b in cells]),
                             _nanmean_rows([fn(m, b, t, runs.weights) for t, b in cells]))
            out[f"{stat}{suffix}_ci"] = list(_both(*means[suffix])[1])
        for suffix in designs:
            if suffix and suffix in means and "" in means:
                point, ci = _both(means[suffix][0] - means[""][0], means[suffix][1] - means[""][1])
                out[f"{stat}{suffix}_diff"], out[f"{stat}{suffix}_diff_ci"] = point, list(ci)
    return out


def t4_intervals(records, *, share: float, stream_budget: float, resamples: int = RESAMPLES,
                 seed: int = 0) -> dict:
    """Intervals of Table 4's headline figures on one protocol's ``records``: ``attribution_auc_ci``,
    ``recompute_gain_points_ci`` (streaming runs at ``stream_budget`` when there are any, else the
    prefill-compressed ones, as :func:`paper_repro.claims.recompute` tests), and where sketches ran
    ``recompute_gain_points_prefill_ci`` and per sketch ``<key>_<name>_ci``, ``<key>_<name>_diff`` (sketch
    minus paper design, paired, the paper's prefill-compressed gain for the recompute key) and
    ``<key>_<name>_diff_ci``; point values under the same keys without ``_ci``."""
    runs = Runs(records, resamples=resamples, seed=seed)
    ident = np.arange(len(runs.keys))[None, :]
    out, samples = {}, {}

    def put(key, point, boot):
        point, ci = _both(point, boot)
        out[key], out[f"{key}_ci"] = point, list(ci)
        samples[key] = (np.asarray(point).ravel(), boot)

    def gain(method, budgets, indices):
        return np.mean([runs.recompute(method, b, indices, share) for b in budgets], axis=0)

    if not runs.has("full", 1.0):
        return out
    if runs.budgets(PAPER_METHOD):
        put("attribution_auc", runs.attribution_auc(PAPER_METHOD, runs.unit),
            runs.attribution_auc(PAPER_METHOD, runs.weights))
        once = runs.budgets(PAPER_METHOD)
        put("recompute_gain_points_prefill", gain(PAPER_METHOD, once, ident), gain(PAPER_METHOD, once, runs.indices))
    stream = runs.budgets("poisson_stream")
    if stream:
        put("recompute_gain_points", gain("poisson_stream", stream, ident),
            gain("poisson_stream", stream, runs.indices))
    elif "recompute_gain_points_prefill" in out:
        out["recompute_gain_points"] = out["recompute_gain_points_prefill"]
        out["recompute_gain_points_ci"] = out["recompute_gain_points_prefill_ci"]
    for name in _sketches(runs):
        m = f"poisson_{name}"
        put(f"attribution_auc_{name}", runs.attribution_auc(m, runs.unit), runs.attribution_auc(m, runs.weights))
        budgets = runs.budgets(m)
        put(f"recompute_gain_points_{name}", gain(m, budgets, ident), gain(m, budgets, runs.indices))
        for key, base in (("attribution_auc", "attribution_auc"),
                          ("recompute_gain_points", "recompute_gain_points_prefill")):
            if base in samples:
                (p1, s1), (p0, s0) = samples[f"{key}_{name}"], samples[base]
                point, ci = _both(p1 - p0, s1 - s0)
                out[f"{key}_{name}_diff"], out[f"{key}_{name}_diff_ci"] = point, list(ci)
    return out

