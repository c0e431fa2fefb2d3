#!/usr/bin/env python
"""Acting on the certificate: every policy on one accuracy-against-cost frontier (issue 55, design section 12).

Table 3's tasks (paper_repro: the needle tasks and multi-key retrieval in quick mode, the six tasks in full
mode; seeded examples of pydoc text, greedy decoding of 10 tokens, exact match as ``Example.score``), under
the query-aware protocol (the paper's: the whole prompt prefilled and compressed, batches prefilled once with
``kvcert.prefill``) and the query-agnostic one (kvpress's: the context compressed once with
``kvcert.prefill_context`` + ``kvcert.compress_context``, the question answered over it with
``kvcert.answer``). Quick mode runs the query-aware protocol only, as paper_repro's quick mode does.

Policies (``kept`` is the kept fraction f = 1 - compression ratio):

- ``fixed``: the paper's design at one ratio for every head, ``PoissonPress(compression_ratio=r,
  sketch=None)`` (the design whose certificate Table 3 scores); ``fixed-default`` (``--default-design``,
  on in full mode): the recommended design, ``PoissonPress(compression_ratio=r)``, its sketch counted;
- deterministic presses at the same ratios: ``snapkv``, ``keydiff``, ``expected`` (``kvcert.SnapKVPress``,
  ``KeyDiffPress``, ``ExpectedAttentionPress``);
- ``target``: error targets, ``PoissonPress(target_error=eps)`` (fast/target.py);
- ``allocation``: budgets per (layer, KV head) from the certificate's predicted variance, Neyman-style,
  with floors: the library's ``PoissonPress(compression_ratio=1 - f, allocation="neyman")``
  (kvcert/presses/allocation.py: ``kvcert.fast.allocation.objective_tables`` of the window queries' predicted
  relative variance over every (layer, KV head) of a prompt, each head's table cut below its floor
  ``max(sinks + window + 1, ceil(floor f n))``, then ``allocate_from_tables`` with the total of the uniform
  fraction f, ``round(f n) x heads``); the paper's design samples each head at its budget;
- ``escalation``: from each sampled design's runs (``fixed``, ``fixed-default``, ``fixed-<scorer>``), a request
  whose signal (``cert_max``: the largest relative radius over the answer's (step, layer, head) cells;
  ``cert_mean``: their mean; ``cert_margin``: the largest per-step mean radius over the step's greedy margin)
  is among the ``share`` largest of its protocol's requests (a threshold at the (1 - share) quantile of the
  signal, which reads no answer) is re-run at the next larger ratio or with the full cache; computed from the
  runs already made (greedy decoding: a re-run is the run at that budget); cost: both runs. The same rule on
  the greedy margin alone (``margin``, no certificate) is the family ``escalation-output``;
- ``recompute-request``: Table 4's recomputation (paper_repro/claims.py): the ``RECOMPUTE_SHARE`` (25%) of
  requests with the largest certificate score (Table 3's: the mean relative radius over every certified
  query) re-served with the full cache; cost: both runs;
- ``recompute-cells``: exact attention for flagged cells, the library's ``PoissonPress(sketch=None,
  recompute_threshold=t)`` (kvcert/presses/recompute.py): at every decoding step, layer and query head whose
  recorded relative radius is at least ``--cell-threshold``, the Hajek estimate is replaced by exact attention
  over the full cache (the prefill's K/V, kept aside, plus the tokens decoded since); cost: the kept fraction
  plus the share of (step, layer, KV head) reads that went to the full cache (``press.recompute_share``).

Cost of a run, as a fraction of the full cache: the kept fraction of the prompt (``Certificates.summary()
["kept_fraction"]``, a sketch's memory counted; query-agnostic: ``CompressedContext.kept()`` over the context),
plus re-runs (escalation, request recompute: the re-run's kept fraction, 1 for the full cache) and cell
recompute reads. A policy point's cost is the mean over its requests.

Comparison with the baselines (``fixed``, ``fixed-default``, ``snapkv``, ``keydiff``, ``expected``, each
family's points joined with the full cache at cost 1): at a policy point's mean cost c, each baseline
family is interpolated linearly in cost between its two points around c. That is an achievable policy (run
the cheaper point with probability w, the dearer one otherwise, w set so the mean cost is c), whose expected
correctness on each example is the same mix of the two runs' correctness; a family whose cheapest point costs
more than c is left out at c. The difference is the policy's accuracy minus the best family's at c, with a
95% percentile bootstrap interval over examples (paper_repro/bootstrap.py: resampled with replacement within
each (protocol, task), paired: every policy and baseline on the same resampled examples, the best baseline
family taken again in each resample).

Usage::

    .venv/bin/python benchmarks/bench_frontier.py --quick   # 1 example per task, query-aware (a smoke run)
    .venv/bin/python benchmarks/bench_frontier.py --quick --examples 16   # Table 3's quick count
    .venv/bin/python benchmarks/bench_frontier.py            # paper_repro's full sizes, both protocols (hours)

Writes JSON (``--out``, default benchmarks/results/frontier_quick.json in quick mode, frontier.json
otherwise) with per-run records, per-point rows and a ``summary`` object, and a PNG beside it (accuracy
against cost, one line per policy family); prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: examples per task in quick mode: one per task (3 requests) fits about 20 minutes on 2 cores that other jobs
#: load (load average about 7): a smoke run of every policy, not a measurement (use --examples 16 for Table 3's
#: quick count)
QUICK_EXAMPLES = 1
#: examples per (protocol, task) below which the issue's goals are reported as not tested (None)
MIN_STRATUM_FOR_GOALS = 10
#: compression ratios of the fixed and deterministic policies (kept fraction 1 - r)
RATIOS = (0.25, 0.5, 0.75, 0.875)
#: deterministic presses: family name -> kvcert class name
DETERMINISTIC = {"snapkv": "SnapKVPress", "keydiff": "KeyDiffPress", "expected": "ExpectedAttentionPress"}
#: error targets (relative radius eps): full mode, and quick mode (one point: bench_target_tasks.py measured
#: eps 0.1 and 0.3 on these tasks already, and every run costs minutes on 2 cores)
TARGETS = (0.05, 0.1, 0.3)
QUICK_TARGETS = (0.1,)
#: kept fractions of the allocation policy and its per-head floor (share of the uniform budget f n;
#: ``PoissonPress(allocation_floor=...)``)
ALLOC_FRACTIONS = (0.5, 0.75)
ALLOC_FLOOR = 0.5
#: allocation's objective grid step (budgets B_min, B_min + step, ...; 1 = every budget;
#: ``PoissonPress(allocation_step=...)``)
ALLOC_STEP = 4
#: escalation: shares of requests escalated, and the signals it reads
ESCALATE_SHARES = (0.25, 0.5)
#: (``margin``: the output alone, no certificate: its points are the family ``escalation-output``, a reference
#: that the dominance count leaves out)
ESCALATE_SIGNALS = ("cert_max", "cert_mean", "cert_margin", "margin")
#: cell recompute: kept fractions it runs at, and the relative radius above which a cell is recomputed (fixed
#: before the quick run from the radii of a 2-example check, no answers read: at kept 0.25 a radius above 0.5
#: flagged 34% of the cells and about 65% of the (step, layer, KV head) reads, above 1.0 15% of the cells)
CELL_KEPT = (0.25, 0.5)
CELL_THRESHOLD = 1.0
#: the certificate signals whose failure-prediction AUC is reported (``conf`` and ``margin`` beside them: the
#: output alone, no certificate)
CERT_SIGNALS = ("cert_max", "cert_mean", "cert_step_max", "cert_t3", "cert_margin")
OUTPUT_SIGNALS = ("conf", "margin")
#: the floor of a step's greedy margin in ``cert_margin`` (a tie would divide by 0)
MARGIN_FLOOR = 1e-6
#: baseline families (the frontier a certificate-driven policy must beat)
BASELINES = ("fixed", "fixed-default", *DETERMINISTIC)
#: families that act on the certificate (the goal's "certificate-driven policies")
CERT_DRIVEN = ("allocation", "escalation", "recompute-request", "recompute-cells")


def is_baseline(family: str) -> bool:
    """A fixed-ratio family: the presses above, and the sampled design with another scorer (``fixed-<scorer>``,
    ``--scorers``)."""
    return family in BASELINES or family.startswith("fixed-")


def is_cert_driven(family: str) -> bool:
    """A family that acts on the certificate (cell recompute with another scorer included)."""
    return family in CERT_DRIVEN or family.startswith("recompute-cells-")


def sampled_families(families) -> list:
    """The families of kvcert's sampled designs at fixed ratios (they record certificates): ``fixed`` first."""
    return sorted((f for f in set(families) if f == "fixed" or f.startswith("fixed-")), key=lambda f: f != "fixed")


#: the cost grid the dominance count bins points on (the fixed kept fractions and the full cache)
COST_GRID = tuple(sorted(1.0 - r for r in RATIOS)) + (1.0,)


# ============================================================================ pure functions (tested)

from paper_repro.frontier import (Point, bootstrap_weights, escalated, family_at,  # noqa: E402,F401
                                  paired_vs_baselines, strata_label, strata_of, top_share, top_share_per_protocol)


def cost_bin(cost: float) -> float:
    """The nearest point of :data:`COST_GRID` (costs above 1 fall in 1.0)."""
    from paper_repro import frontier

    return frontier.cost_bin(cost, COST_GRID)


def summarize(rows: list, *, recompute_gain: float, failure_auc_best: float) -> dict:
    """paper_repro.frontier.summarize on this benchmark's families (:func:`is_cert_driven`) and cost grid."""
    from paper_repro import frontier

    return frontier.summarize(rows, recompute_gain=recompute_gain, failure_auc_best=failure_auc_best,
                              cert_driven=is_cert_driven, grid=COST_GRID)


def answer_signals(relative_radius, *, exact_first: bool, margins=None) -> dict:
    """``cert_max``, ``cert_mean`` (max and mean recorded relative radius over the answer's (step, layer,
    head) cells), ``cert_step_max`` (the largest per-step mean over layers and heads, what
    ``generate(escalate=...)`` reads) of one sequence's (steps, layers, heads) radii, and with the steps'
    greedy ``margins`` (``GenerationResult.margins``, one per step, aligned with the radii's steps):
    ``cert_margin``, the largest per-step mean radius over the step's margin (the certificate against what a
    greedy token can absorb: item 2's target on what the user sees; the margin floored at MARGIN_FLOOR), and
    ``margin``, minus the smallest margin (the output alone, no certificate). Step 0 left out with
    ``exact_first`` (the query-aware prefill, exact). NaN where there is nothing to read."""
    nan = float("nan")
    rel = np.asarray(relative_radius, dtype=np.float64)
    rel = rel[1:] if exact_first else rel
    m = None if margins is None else np.asarray(margins, dtype=np.float64).reshape(-1)
    m = m[1:] if m is not None and exact_first else m
    out = dict(margin=float(-m.min()) if m is not None and m.size else nan)
    if rel.size == 0:
        return dict(out, cert_max=nan, cert_mean=nan, cert_step_max=nan, cert_margin=nan)
    step = rel.reshape(rel.shape[0], -1).mean(-1)
    ratio = nan
    if m is not None and m.size == step.size:
        ratio = float((step / np.maximum(m, MARGIN_FLOOR)).max())
    return dict(out, cert_max=float(rel.max()), cert_mean=float(rel.mean()), cert_step_max=float(step.max()),
                cert_margin=ratio)


def allocation_info(row) -> dict:
    """A run record's summary of one row's ``kvcert.presses.allocation.RowAllocation`` (None: the row ran the
    uniform design): total, floor, n and the budgets' min, max and sum."""
    if row is None:
        return {}
    b = row.budgets
    return dict(total=int(row.total), floor=int(row.floor), n=int(row.n), budget_min=int(b.min()),
                budget_max=int(b.max()), budget_sum=int(b.sum()))


# ============================================================================ runs

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_EXAMPLES} example(s) per task of Table 3's quick tasks, query-aware (about 20 "
                        "minutes on 2 loaded cores)")
    p.add_argument("--examples", type=int,
                   help="examples per task (default QUICK_EXAMPLES quick / paper_repro's full count, 40)")
    p.add_argument("--protocols", help="comma-separated: query-aware,query-agnostic (default: query-aware quick, "
                                       "both full)")
    p.add_argument("--default-design", action=argparse.BooleanOptionalAction, default=None,
                   help="also run the recommended design at the fixed ratios (default: off quick, on full)")
    p.add_argument("--cell-threshold", type=float, default=CELL_THRESHOLD,
                   help=f"relative radius above which recompute-cells recomputes a cell (default {CELL_THRESHOLD})")
    p.add_argument("--scorers", default="",
                   help="comma-separated kvcert scorers (kvcert.fast.scorers.SCORERS, e.g. keydiff) whose sampled "
                        "design also runs: fixed-<scorer> at the fixed ratios (a baseline family, escalation derived "
                        "from it) and recompute-cells-<scorer> (default: none)")
    p.add_argument("--tasks", help="comma-separated subset of the mode's tasks (default: all of them; for smoke runs)")
    p.add_argument("--resamples", type=int, default=1000, help="bootstrap resamples (default 1000)")
    p.add_argument("--reanalyse", type=Path,
                   help="read the records of an earlier run's JSON and redo the analysis only (no model runs)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/frontier_quick.json quick, "
                                            "frontier.json full); the PNG goes beside it")
    args = p.parse_args(argv)
    full = not args.quick
    args.examples = args.examples or (None if full else QUICK_EXAMPLES)
    if args.examples is not None and args.examples < 1:
        p.error(f"--examples must be >= 1, got {args.examples}")
    args.protocols_given = args.protocols is not None  # with --reanalyse: keep only these protocols' records
    protocols = args.protocols or ("query-aware,query-agnostic" if full else "query-aware")
    args.protocols = tuple(x.strip() for x in protocols.split(",") if x.strip())
    bad = [x for x in args.protocols if x not in ("query-aware", "query-agnostic")]
    if bad or not args.protocols:
        p.error(f"--protocols must name query-aware and/or query-agnostic, got {protocols!r}")
    if args.default_design is None:
        args.default_design = full
    if not args.cell_threshold > 0:
        p.error(f"--cell-threshold must be > 0, got {args.cell_threshold}")
    args.scorers = tuple(x.strip() for x in args.scorers.split(",") if x.strip())
    from kvcert.fast.scorers import SCORERS

    bad = [x for x in args.scorers if x not in SCORERS or SCORERS[x].random]
    if bad:
        p.error(f"--scorers must name registered, non-random scorers ({', '.join(sorted(SCORERS))}), got {bad}")
    args.out = args.out or ROOT / "benchmarks" / "results" / ("frontier.json" if full else "frontier_quick.json")
    return args


def _run_specs(args) -> list:
    """(family, level, params, factory) of every press run per example: level is the kept fraction (eps for
    a target); factory(seed) -> press."""
    import kvcert

    specs = []
    for r in RATIOS:
        specs.append(("fixed", 1 - r, dict(compression_ratio=r, design="paper"),
                      lambda s, r=r: kvcert.PoissonPress(compression_ratio=r, seed=s, sketch=None)))
        if args.default_design:
            specs.append(("fixed-default", 1 - r, dict(compression_ratio=r, design="recommended"),
                          lambda s, r=r: kvcert.PoissonPress(compression_ratio=r, seed=s)))
        for fam, cls in DETERMINISTIC.items():
            specs.append((fam, 1 - r, dict(compression_ratio=r),
                          lambda s, r=r, cls=cls: getattr(kvcert, cls)(compression_ratio=r)))
    for eps in (QUICK_TARGETS if args.quick else TARGETS):
        specs.append(("target", eps, dict(target_error=eps),
                      lambda s, eps=eps: kvcert.PoissonPress(target_error=eps, seed=s)))
    for f in ALLOC_FRACTIONS:
        specs.append(("allocation", f, dict(kept=f, floor=ALLOC_FLOOR, step=ALLOC_STEP),
                      lambda s, f=f: kvcert.PoissonPress(compression_ratio=1 - f, seed=s, allocation="neyman",
                                                         allocation_floor=ALLOC_FLOOR, allocation_step=ALLOC_STEP)))
    for f in CELL_KEPT:
        specs.append(("recompute-cells", f, dict(kept=f, threshold=args.cell_threshold),
                      lambda s, f=f: kvcert.PoissonPress(compression_ratio=1 - f, seed=s, sketch=None,
                                                         recompute_threshold=args.cell_threshold)))
    for sc in getattr(args, "scorers", ()):  # the sampled design with another scorer, and cell recompute on it
        for r in RATIOS:
            specs.append((f"fixed-{sc}", 1 - r, dict(compression_ratio=r, design="paper", scorer=sc),
                          lambda s, r=r, sc=sc: kvcert.PoissonPress(compression_ratio=r, seed=s, sketch=None,
                                                                    scorer=sc)))
        for f in CELL_KEPT:
            specs.append((f"recompute-cells-{sc}", f, dict(kept=f, threshold=args.cell_threshold, scorer=sc),
                          lambda s, f=f, sc=sc: kvcert.PoissonPress(compression_ratio=1 - f, seed=s, sketch=None,
                                                                    scorer=sc,
                                                                    recompute_threshold=args.cell_threshold)))
    return specs


def _record(protocol, task, example, family, level, correct, kept, certs, cert_t3, conf, extra=0.0, info=None,
            answer=None):
    rec = dict(protocol=protocol, task=task, example=example, family=family, level=level, correct=bool(correct),
               kept=float(kept), extra_cost=float(extra), cert_t3=cert_t3, conf=conf, answer=answer)
    rec.update(certs)
    if info:
        rec["info"] = info
    return rec


def collect(args, model, tokenizer, cfg) -> list:
    """Every run: one record per (protocol, task, example, family, level)."""
    import kvcert
    from paper_repro.common import progress
    from paper_repro.suites import MAX_NEW_TOKENS, NEEDLE_SUITE, QUICK_TASKS, RULER_SUITE, _cert_conf, batches
    from paper_repro.tasks import make_examples

    tasks = QUICK_TASKS if cfg.quick else NEEDLE_SUITE + RULER_SUITE
    if args.tasks:
        tasks = tuple(t for t in tasks if t in args.tasks.split(","))
        if not tasks:
            raise SystemExit(f"--tasks: none of {args.tasks!r} is a task of this mode")
    n_ex = args.examples or cfg.suite_examples
    examples = {t: make_examples(t, n_ex, context_tokens=cfg.suite_context, seed=cfg.seed, tokenizer=tokenizer)
                for t in tasks}
    specs = _run_specs(args)
    records = []
    jobs = []
    if "query-aware" in args.protocols:
        jobs += [("query-aware", t, b) for t in tasks for b in batches(examples[t], cfg.suite_batch, tokenizer)]
    if "query-agnostic" in args.protocols:
        jobs += [("query-agnostic", t, [i]) for t in tasks for i in range(n_ex)]
    for protocol, task, idx in progress(jobs, desc="frontier"):
        exs = [examples[task][i] for i in idx]
        agn = protocol == "query-agnostic"
        if not agn:
            state = kvcert.prefill(model, tokenizer, [e.prompt for e in exs], chat_template=False)
        else:
            state = kvcert.prefill_context(model, tokenizer, exs[0].context, chat_template=False)

        def run(press):
            """[(correct, kept, signals, cert_t3, conf, extra, info)] per example of the job."""
            if not agn:
                res = kvcert.generate(model, tokenizer, [e.prompt for e in exs], press=press,
                                      max_new_tokens=MAX_NEW_TOKENS, chat_template=False, prefilled=state)
                rows = res.rows()
                outs = []
                for j, (e, row) in enumerate(zip(exs, rows)):
                    c = row.certificates
                    kept = 1.0 if press is None else c.summary()["kept_fraction"]
                    sig = answer_signals(c.relative_radius if c is not None and press is not None
                                         else np.zeros((0,)), exact_first=True, margins=row.margins)
                    cert, conf, _ = _cert_conf(row, press)
                    outs.append((e.score(row.text), kept, sig, cert, conf, j, row.text))
            else:
                e = exs[0]
                ctx = kvcert.compress_context(model, tokenizer, e.context, press=press, chat_template=False,
                                              prefilled=state)
                r = kvcert.answer(model, tokenizer, ctx, e.question, answer_prefix=e.answer_prefix,
                                  max_new_tokens=MAX_NEW_TOKENS)
                kept_t = ctx.kept()
                kept = 1.0 if kept_t is None else float(kept_t.double().mean()) / ctx.context_tokens
                c = r.certificates
                sig = answer_signals(c.relative_radius if c is not None and press is not None
                                     else np.zeros((0,)), exact_first=False, margins=r.margins)
                cert, conf, _ = _cert_conf(r, press, agnostic=True)
                outs = [(e.score(r.text), kept, sig, cert, conf, 0, r.text)]
            return outs

        for (ok, kept, sig, cert, conf, j, text) in run(None):
            records.append(_record(protocol, task, idx[j], "full", 1.0, ok, kept, sig, cert, conf, answer=text))
        for family, level, params, make in specs:
            press = make(cfg.seed)
            t0 = time.perf_counter()
            outs = run(press)
            dt = time.perf_counter() - t0
            for (ok, kept, sig, cert, conf, j, text) in outs:
                extra, info = 0.0, dict(seconds=dt / len(outs))
                if family.startswith("recompute-cells"):
                    share = float(press.recompute_share[j])
                    extra, info["recompute_share"] = share, share
                if family == "allocation":
                    info.update(allocation_info(press.allocations.get(j)))
                records.append(_record(protocol, task, idx[j], family, level, ok, kept, sig, cert, conf, extra,
                                       info, answer=text))
        del state
    return records


# ============================================================================ analysis

def _keys(records) -> list:
    return sorted({(r["protocol"], r["task"], r["example"]) for r in records})


def _vec(records, keys, family, level, field) -> np.ndarray:
    pos = {k: i for i, k in enumerate(keys)}
    out = np.full(len(keys), np.nan)
    for r in records:
        if r["family"] == family and r["level"] == level:
            out[pos[r["protocol"], r["task"], r["example"]]] = float(r.get(field, np.nan))  # NaN: not recorded
    return out


def _levels(records, family) -> list:
    return sorted({r["level"] for r in records if r["family"] == family})


def _design_tag(family: str) -> str:
    """How a point's name marks the sampled design it escalates from: nothing for the paper design (``fixed``),
    ``[x]`` for ``fixed-x``."""
    return "" if family == "fixed" else f"[{family[len('fixed-'):]}]"


def _escalations(pts, records, keys, protocols, bf, full_c, full_k) -> None:
    """Append the escalation points of sampled family ``bf``: from each of its levels to its next level and to
    the full cache, for each signal and share."""
    levels = _levels(records, bf)
    tag = _design_tag(bf)
    for i, lo in enumerate(levels):
        lo_c, lo_k = _vec(records, keys, bf, lo, "correct"), _vec(records, keys, bf, lo, "kept")
        targets = [levels[i + 1]] if i + 1 < len(levels) else []
        targets.append(1.0)
        for signal in ESCALATE_SIGNALS:
            s = _vec(records, keys, bf, lo, signal)
            for share in ESCALATE_SHARES:
                mask = top_share_per_protocol(s, protocols, share)
                tau = float(np.nanmin(s[mask])) if np.isfinite(s[mask]).any() else float("nan")
                for hi in targets:
                    hi_c = full_c if hi == 1.0 else _vec(records, keys, bf, hi, "correct")
                    hi_k = full_k if hi == 1.0 else _vec(records, keys, bf, hi, "kept")
                    c, cost = escalated(lo_c, lo_k, hi_c, hi_k, mask)
                    to = "full" if hi == 1.0 else f"{hi:g}"
                    fam = "escalation" if signal in CERT_SIGNALS else "escalation-output"
                    pts.append(Point(fam, f"escalate{tag} {lo:g}->{to} {signal} top {share:.0%}",
                                     dict(base=lo, base_family=bf, to=hi, signal=signal, share=share,
                                          threshold=tau, escalated=float(mask.mean())), c, cost))


def build_points(records) -> tuple[list, dict]:
    """Every policy point (run families and the derived escalation / request recompute) and the baseline
    families {name: [points...] + full}."""
    from paper_repro.claims import RECOMPUTE_SHARE

    keys = _keys(records)
    protocols = np.array([k[0] for k in keys])

    def point(family, level, name, params):
        c = _vec(records, keys, family, level, "correct")
        cost = _vec(records, keys, family, level, "kept") + _vec(records, keys, family, level, "extra_cost")
        return Point(family, name, params, c, cost)

    pts = [point("full", 1.0, "full", {})]
    families = sorted({r["family"] for r in records} - {"full"})
    for fam in families:
        for lv in _levels(records, fam):
            label = f"eps={lv:g}" if fam == "target" else f"kept={lv:g}"
            pts.append(point(fam, lv, f"{fam} {label}", {"level": lv}))
    # escalation derived from the runs of every sampled design (``fixed``: the paper design; ``fixed-<x>``:
    # another design, its points named "escalate[<x>] ..."); Table 4's request recompute from ``fixed`` only
    full_c, full_k = _vec(records, keys, "full", 1.0, "correct"), _vec(records, keys, "full", 1.0, "kept")
    for bf in sampled_families(r["family"] for r in records):
        _escalations(pts, records, keys, protocols, bf, full_c, full_k)
    fixed = _levels(records, "fixed")
    for lo in fixed:
        lo_c, lo_k = _vec(records, keys, "fixed", lo, "correct"), _vec(records, keys, "fixed", lo, "kept")
        # Table 4's request recompute (cert_t3, RECOMPUTE_SHARE, full cache)
        mask = top_share_per_protocol(_vec(records, keys, "fixed", lo, "cert_t3"), protocols, RECOMPUTE_SHARE)
        c, cost = escalated(lo_c, lo_k, full_c, full_k, mask)
        pts.append(Point("recompute-request", f"recompute-request kept={lo:g} top {RECOMPUTE_SHARE:.0%}",
                         dict(base=lo, share=RECOMPUTE_SHARE, signal="cert_t3"), c, cost))
    full_pt = pts[0]
    base = {fam: [p for p in pts if p.family == fam] + [full_pt] for fam in sorted({p.family for p in pts})
            if is_baseline(fam)}
    return pts, base


def failure_aucs(records, family: str = "fixed") -> dict:
    """Failure-prediction AUC of each signal over ``family``'s runs (default the paper design's): the mean over
    Table 3's cells
    (protocol, task, kept) that hold both outcomes; where none does (one example per task), over (protocol,
    kept) cells instead (``basis`` says which); and pooled over all those runs."""
    from paper_repro.suites import auc

    runs = [r for r in records if r["family"] == family]

    def per_cell(key):
        cells = sorted({key(r) for r in runs})
        out = {}
        for sig in CERT_SIGNALS + OUTPUT_SIGNALS:
            per = []
            for cell in cells:
                rs = [r for r in runs if key(r) == cell]
                a = auc([r.get(sig, np.nan) for r in rs], [not r["correct"] for r in rs])
                if np.isfinite(a):
                    per.append(a)
            out[sig] = (float(np.mean(per)) if per else float("nan"), len(per))
        return out

    basis = "mean over (protocol, task, kept) cells with both outcomes (Table 3's cells)"
    cells = per_cell(lambda r: (r["protocol"], r["task"], r["level"]))
    if not any(n for _, n in cells.values()):
        basis = "mean over (protocol, kept) cells with both outcomes (no (protocol, task, kept) cell had both)"
        cells = per_cell(lambda r: (r["protocol"], r["level"]))
    out = {"basis": basis}
    for sig in CERT_SIGNALS + OUTPUT_SIGNALS:
        out[sig] = dict(mean_over_cells=cells[sig][0], cells=cells[sig][1],
                        pooled=auc([r.get(sig, np.nan) for r in runs], [not r["correct"] for r in runs]))
    return out


def recompute_t4(records, seed: int, resamples: int) -> dict:
    """Table 4's recompute gain on these runs (paper_repro.claims / bootstrap, the first protocol's runs, the
    paper design compressed once after the prefill, every fixed budget): the figure, its interval and the
    claim's text."""
    from paper_repro import bootstrap, claims

    first = sorted({r["protocol"] for r in records}, key=lambda p: p != "query-aware")[0]
    mine = [r for r in records if r["protocol"] == first and r["family"] in ("full", "fixed")]
    t4 = [dict(protocol=first, task=r["task"], example=r["example"],
               method="full" if r["family"] == "full" else "poisson", budget=r["level"], correct=r["correct"],
               cert=r["cert_t3"], conf=r["conf"]) for r in mine]
    budgets = sorted({r["budget"] for r in t4 if r["method"] == "poisson"})
    gains, texts = [], []
    for b in budgets:
        g, text = claims._recompute_one(t4, "poisson", b)
        gains.append(g)
        texts.append(text)
    boot = bootstrap.t4_intervals(t4, share=claims.RECOMPUTE_SHARE, stream_budget=-1.0, resamples=resamples,
                                  seed=seed)
    return dict(protocol=first, setting="paper design compressed once after the prefill, request-level "
                "recompute of the 25% of requests with the largest mean relative radius, full cache",
                gain_points=float(np.mean(gains)), gain_ci=boot.get("recompute_gain_points_prefill_ci"),
                per_budget=dict(zip([f"{b:g}" for b in budgets], texts)), gains=gains)


#: item 4: the answer-level guarantee's level, the random calibration / held-out splits, and the signal
#: (``kvcert.calibration.escalation_signal``'s: the largest per-step mean relative radius of the answer)
CALIB_ALPHA = 0.1
CALIB_SPLITS = 200
CALIB_SIGNAL = "cert_step_max"
#: the signals item 4's escalation is calibrated on: the library's, the certificate over the greedy margin (item
#: 2's target on what the user sees), and the margin alone (the output, no certificate: a reference)
CALIB_SIGNALS = (CALIB_SIGNAL, "cert_margin", "margin")


def differs_from_full(records) -> dict | None:
    """{(protocol, task, example, family, level): the run's answer differs from the full cache's} (answers
    compared after stripping whitespace); None when the records hold no answers (runs before they were kept)."""
    full = {(r["protocol"], r["task"], r["example"]): r.get("answer") for r in records if r["family"] == "full"}
    if not full or any(a is None for a in full.values()):
        return None
    return {(r["protocol"], r["task"], r["example"], r["family"], r["level"]):
            str(r["answer"]).strip() != str(full[r["protocol"], r["task"], r["example"]]).strip()
            for r in records if r.get("answer") is not None}


def calibration_holdout(records, *, alpha: float = CALIB_ALPHA, splits: int = CALIB_SPLITS, seed: int = 0):
    """Item 4 on Table 3: per protocol, ``splits`` random halvings of each task's examples into a calibration
    and a held-out half. On the calibration half, conformal risk control (``kvcert.calibration``) calibrates
    (a) escalation to the full cache from each sampled design's budget, on each signal of ``CALIB_SIGNALS``
    that the records hold (a NaN signal escalates), and (b) one budget per baseline family (the kvcalib-style baseline: the family's kept fractions, then the full cache);
    on the held-out half, the rate of served answers that differ from the full cache's (the risk, to be <=
    alpha) and the mean cost (kept fraction, plus 1 for an escalated request's full re-run). Returns None
    without answers in the records."""
    from kvcert.calibration import calibrate_budget, calibrate_escalation

    diff = differs_from_full(records)
    if diff is None:
        return None
    rng = np.random.default_rng(seed)
    by_run = {(r["protocol"], r["task"], r["example"], r["family"], r["level"]): r for r in records}
    out = {}
    for protocol in sorted({r["protocol"] for r in records}):
        keys = sorted({(r["task"], r["example"]) for r in records if r["protocol"] == protocol})
        tasks = sorted({t for t, _ in keys})

        def col(family, level, field):
            return np.array([by_run[(protocol, t, e, family, level)].get(field, np.nan) if field != "differs" else
                             diff[(protocol, t, e, family, level)] for t, e in keys], dtype=float)

        policies = {}
        for bf in sampled_families(r["family"] for r in records):
            tag = _design_tag(bf)
            for lo in _levels(records, bf):
                for sig in CALIB_SIGNALS:
                    values = col(bf, lo, sig)
                    if not np.isfinite(values).any():  # not recorded (runs before margins were kept)
                        continue
                    suffix = "" if sig == CALIB_SIGNAL else f" on {sig}"
                    policies[f"escalate{tag} {lo:g}->full{suffix}"] = (
                        np.where(np.isnan(values), np.inf, values), col(bf, lo, "differs").astype(bool),
                        col(bf, lo, "kept"))
        grids = {}
        for fam in sorted({r["family"] for r in records}):
            levels = _levels(records, fam)
            if is_baseline(fam) and levels:
                grids[f"budget {fam}"] = (levels, np.stack([col(fam, lv, "differs") for lv in levels], 1),
                                          np.stack([col(fam, lv, "kept") for lv in levels], 1))
        acc = {name: dict(risk=[], cost=[], escalated=[], chosen=[]) for name in [*policies, *grids]}
        by_task = [np.array([i for i, k in enumerate(keys) if k[0] == t]) for t in tasks]
        for _ in range(splits):
            cal = np.zeros(len(keys), dtype=bool)
            for idx in by_task:
                cal[rng.permutation(idx)[: len(idx) // 2]] = True
            held = ~cal
            for name, (sig, d, kept) in policies.items():
                t_hat = calibrate_escalation(sig[cal], d[cal], alpha)
                esc = sig[held] >= t_hat
                acc[name]["risk"].append(float(np.mean(d[held] & ~esc)))
                acc[name]["cost"].append(float(np.mean(kept[held] + esc)))
                acc[name]["escalated"].append(float(esc.mean()))
                acc[name]["chosen"].append(t_hat)
            for name, (levels, d, kept) in grids.items():
                b = calibrate_budget(levels, d[cal].astype(bool).tolist(), alpha)
                if b is None:  # no budget of the grid qualifies: the full cache
                    risk, cost = 0.0, 1.0
                else:
                    j = levels.index(b)
                    risk, cost = float(np.mean(d[held, j])), float(np.mean(kept[held, j]))
                acc[name]["risk"].append(risk)
                acc[name]["cost"].append(cost)
                acc[name]["chosen"].append(1.0 if b is None else b)
        rows = {}
        for name, a in acc.items():
            risk, cost = np.array(a["risk"]), np.array(a["cost"])
            row = dict(risk=float(risk.mean()), risk_se=float(risk.std(ddof=1) / np.sqrt(len(risk))),
                       cost=float(cost.mean()), meets_alpha=bool(risk.mean() <= alpha))
            if a["escalated"]:
                row["escalated"] = float(np.mean(a["escalated"]))
                chosen = np.array(a["chosen"])
                row["threshold_median"] = float(np.median(chosen))
            else:
                vals, counts = np.unique(np.array(a["chosen"]), return_counts=True)
                row["budget_chosen"] = {f"{v:g}": int(c) for v, c in zip(vals, counts)}
            rows[name] = row
        esc = {k: v for k, v in rows.items() if k.startswith("escalate") and not k.endswith(" on margin")
               and v["meets_alpha"]}
        out_only = {k: v for k, v in rows.items() if k.endswith(" on margin") and v["meets_alpha"]}
        bud = {k: v for k, v in rows.items() if k.startswith("budget") and v["meets_alpha"]}
        best_e = min(esc, key=lambda k: esc[k]["cost"]) if esc else None
        best_b = min(bud, key=lambda k: bud[k]["cost"]) if bud else None
        out[protocol] = dict(
            calibration_prompts=int(cal.sum()), heldout_prompts=int(held.sum()),  # every split's sizes
            policies=rows, best_escalation=best_e, best_budget=best_b,
            best_output_escalation=min(out_only, key=lambda k: out_only[k]["cost"]) if out_only else None,
            escalation_cheaper=(None if best_e is None or best_b is None
                                else bool(esc[best_e]["cost"] < bud[best_b]["cost"])))
    return dict(alpha=alpha, splits=splits, signal=CALIB_SIGNAL, signals=list(CALIB_SIGNALS), protocols=out,
                note="risk: the held-out rate of served answers that differ from the full cache's, averaged over "
                     "the splits (conformal risk control bounds its expectation by alpha); best_*: the cheapest "
                     "rule of its kind whose mean held-out risk is <= alpha, chosen after the fact over the "
                     "escalation bases and the baseline families")


def analyse(records, *, seed: int, resamples: int) -> dict:
    pts, base = build_points(records)
    keys = _keys(records)
    weights = bootstrap_weights(keys, resamples=resamples, seed=seed)
    rows = []
    for p in pts:
        row = dict(family=p.family, name=p.name, params=p.params, cost=p.mean_cost, accuracy=p.accuracy,
                   requests=int(np.isfinite(p.correct).sum()))
        if not is_baseline(p.family) and p.family != "full":
            row.update(paired_vs_baselines(p, base, weights))
        rows.append(row)
    aucs = failure_aucs(records)
    aucs_by_design = {bf: {s: v["mean_over_cells"] for s, v in failure_aucs(records, bf).items() if s != "basis"}
                      for bf in sampled_families(r["family"] for r in records)}
    cert_best = max((aucs[s]["mean_over_cells"] for s in CERT_SIGNALS if np.isfinite(aucs[s]["mean_over_cells"])),
                    default=float("nan"))
    rec = recompute_t4(records, seed, resamples)
    summary = summarize(rows, recompute_gain=rec["gain_points"], failure_auc_best=cert_best)
    summary["failure_auc_basis"] = aucs["basis"]
    summary["failure_auc_confidence"] = aucs["conf"]["mean_over_cells"]
    summary["failure_auc_best_signal"] = max(CERT_SIGNALS, key=lambda s: np.nan_to_num(
        aucs[s]["mean_over_cells"], nan=-1))
    counts: dict = {}
    for p, t, _ in keys:
        counts[p, t] = counts.get((p, t), 0) + 1
    testable = min(counts.values()) >= MIN_STRATUM_FOR_GOALS
    summary["goals"] = dict(
        testable=testable,
        note=None if testable else f"fewer than {MIN_STRATUM_FOR_GOALS} examples per (protocol, task): the goals "
        "are not tested (None); the four fields above are what this run measured",
        dominates_two_cost_points=summary["dominates_at_cost_points"] >= 2 if testable else None,
        interval_excludes_zero=summary["best_interval_excludes_zero"] if testable else None,
        recompute_in_paper_range=1.9 <= summary["recompute_gain_points"] <= 3.7 if testable else None,
        failure_auc_at_least_085=bool(cert_best >= 0.85) if testable else None)
    calib = calibration_holdout(records, seed=seed)
    if calib is not None:
        summary["calibrated_escalation_cheaper"] = {p: v["escalation_cheaper"] for p, v in calib["protocols"].items()}
    summary["failure_auc_by_design"] = aucs_by_design
    return dict(rows=rows, failure_auc=aucs, recompute_t4=rec, summary=summary, examples=len(keys),
                calibration=calib)


# ============================================================================ output

FAMILY_STYLE = {"full": ("k", "*"), "fixed": ("C0", "o"), "fixed-default": ("C9", "o"), "snapkv": ("C1", "s"),
                "keydiff": ("C2", "s"), "expected": ("C3", "s"), "target": ("C4", "v"), "allocation": ("C5", "D"),
                "escalation": ("C6", "^"), "recompute-request": ("C7", "P"), "recompute-cells": ("C8", "X")}


def plot(rows, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.0), dpi=110)
    extra = sorted({r["family"] for r in rows} - set(FAMILY_STYLE))  # fixed-<scorer>, recompute-cells-<scorer>
    styles = dict(FAMILY_STYLE, **{fam: (f"C{(i + 10) % 10}", "o" if fam.startswith("fixed-") else "X")
                                   for i, fam in enumerate(extra)})
    for fam, (color, marker) in styles.items():
        ls = "--" if fam in extra else "-"
        rs = sorted([r for r in rows if r["family"] == fam], key=lambda r: r["cost"])
        if not rs:
            continue
        x, y = [r["cost"] for r in rs], [r["accuracy"] for r in rs]
        if fam.startswith("escalation") or fam == "recompute-request":
            ax.scatter(x, y, color=color, marker=marker, s=22, alpha=0.6, label=fam)
        else:
            ax.plot(x, y, color=color, marker=marker, ms=5, lw=1.2, ls=ls, label=fam)
    ax.set_xlabel("mean cost (kept K+V incl. sketch + re-runs + recompute), fraction of the full cache")
    ax.set_ylabel("accuracy (exact match)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def markdown(rows) -> str:
    def f(x, spec="{:.3f}"):
        return "" if x is None or (isinstance(x, float) and not np.isfinite(x)) else spec.format(x)

    lines = ["| family | policy | mean cost | accuracy | best baseline at that cost | its accuracy | "
             "difference [95% paired interval] |", "|---|---|---|---|---|---|---|"]
    order = list(FAMILY_STYLE)
    for r in sorted(rows, key=lambda r: (order.index(r["family"]) if r["family"] in order else len(order),
                                         r["family"], r["cost"])):
        diff = ""
        if "diff" in r and r["diff"] is not None and np.isfinite(r["diff"]):
            diff = f"{r['diff']:+.3f} [{r['diff_ci'][0]:+.3f}, {r['diff_ci'][1]:+.3f}]"
        lines.append(f"| {r['family']} | {r['name']} | {f(r['cost'])} | {f(r['accuracy'])} | "
                     f"{r.get('baseline') or ''} | {f(r.get('baseline_accuracy'))} | {diff} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from benchmarks.runinfo import run_info
    from kvcert.models import load_model
    from paper_repro.common import Config

    cfg = Config(quick=args.quick, progress=True)
    t0 = time.perf_counter()
    # command, date (UTC), commit and machine at the start: the code the runs import
    info = run_info("bench_frontier.py", argv, threads=args.threads,
                    note="2-core machine shared with other jobs (a test suite); timings are not the point")
    if args.reanalyse:
        earlier = json.loads(args.reanalyse.read_text())
        records, seconds_runs = earlier["records"], earlier["seconds"]["runs"]
        for r in records:  # strict JSON wrote NaN as null
            r.update({k: float("nan") for k in CERT_SIGNALS + OUTPUT_SIGNALS if r.get(k) is None})
        if args.protocols_given:
            records = [r for r in records if r["protocol"] in args.protocols]
            if not records:
                raise SystemExit(f"--reanalyse {args.reanalyse}: no records of protocols {list(args.protocols)}")
    else:
        model, tokenizer = load_model()
        records = collect(args, model, tokenizer, cfg)
        seconds_runs = time.perf_counter() - t0
        args.out.parent.mkdir(parents=True, exist_ok=True)  # the runs first, in case the analysis fails
        args.out.write_text(json.dumps(_finite(dict(partial=True, records=records, seconds=dict(runs=seconds_runs))),
                                       default=_json, allow_nan=False) + "\n")
    result = analyse(records, seed=cfg.seed, resamples=args.resamples)
    png = args.out.with_suffix(".png")
    if args.reanalyse:  # the runs' command, date, commit and machine; this analysis's beside them
        info = dict({k: earlier[k] for k in ("command", "date", "git_commit", "git_dirty", "machine")
                     if k in earlier}, reanalysed=info)
    data = dict(
        **info,
        model="SmolLM2-135M-Instruct (kvcert.models.load_model(), offline)",
        setup=dict(quick=args.quick, tasks=sorted({r["task"] for r in records}),
                   protocols=sorted({r["protocol"] for r in records}),
                   examples_per_task=args.examples or cfg.suite_examples, requests=result["examples"],
                   context_tokens=cfg.suite_context, batch=cfg.suite_batch, seed=cfg.seed, ratios=list(RATIOS),
                   deterministic=DETERMINISTIC, targets=list(QUICK_TARGETS if args.quick else TARGETS),
                   alloc_fractions=list(ALLOC_FRACTIONS),
                   alloc_floor=ALLOC_FLOOR, alloc_step=ALLOC_STEP, escalate_shares=list(ESCALATE_SHARES),
                   escalate_signals=list(ESCALATE_SIGNALS), cell_kept=list(CELL_KEPT),
                   cell_threshold=args.cell_threshold, default_design=args.default_design,
                   scorers=list(getattr(args, "scorers", ())),
                   resamples=args.resamples),
        notes=[
            "cost: mean over requests of the kept fraction of the prompt (a sketch counted), plus the re-run's "
            "kept fraction for escalated / recomputed requests (1 for the full cache), plus the share of "
            "(step, layer, KV head) reads recomputed over the full cache (recompute-cells; the full cache is "
            "kept aside in slower memory, not counted).",
            "diff: accuracy minus the best baseline family's (fixed, fixed-default, snapkv, keydiff, expected, "
            "each joined with the full cache at cost 1) linearly interpolated in cost at the point's mean cost "
            "(a mixture of two of the family's runs), paired over examples; diff_ci the 95% percentile bootstrap "
            "interval (resamples within (protocol, task); the best family re-chosen per resample).",
            "escalation thresholds are the (1 - share) quantile of the signal over the protocol's requests "
            "(the rule reads no answer); cert_* signals are relative radii over the answer's (step, layer, "
            "query head) cells (query-aware: decoding steps 1..; query-agnostic: every answer step).",
            "recompute-request is Table 4's recomputation (paper_repro/claims.py) as a frontier point; "
            "recompute-cells is the library's PoissonPress(recompute_threshold=...) (kvcert/presses/recompute.py).",
        ],
        rows=result["rows"], failure_auc=result["failure_auc"], recompute_t4=result["recompute_t4"],
        calibration=result["calibration"],
        strata=strata_label(_keys(records)),
        summary=result["summary"], plot=str(png.relative_to(ROOT)) if png.is_relative_to(ROOT) else str(png),
        records=records, seconds=dict(runs=seconds_runs, total=time.perf_counter() - t0) if not args.reanalyse
        else dict(earlier["seconds"], reanalysis=time.perf_counter() - t0))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(_finite(data), indent=1, default=_json, allow_nan=False) + "\n")
    try:
        plot(result["rows"], png, f"Table 3's tasks, {', '.join(data['setup']['protocols'])}, "
                                  f"{result['examples']} requests ({data['date']}, {data['git_commit']})")
    except ImportError:  # pragma: no cover - matplotlib missing
        print("matplotlib missing: no plot", file=sys.stderr)
    print(markdown(result["rows"]))
    print(calibration_markdown(result["calibration"]))
    print(json.dumps(result["summary"], indent=1, default=_json))
    print(f"{data['seconds'].get('total', 0):.0f} s; wrote {args.out} and {png}")


def calibration_markdown(calib) -> str:
    """Item 4's held-out table (one row per rule and protocol)."""
    if calib is None:
        return "(no answers recorded: no calibration analysis)"
    lines = [f"alpha {calib['alpha']}, {calib['splits']} random splits, signal {calib['signal']}", "",
             "| protocol | rule | held-out risk (se) | mean cost | escalated | meets alpha |",
             "|---|---|---|---|---|---|"]
    for p, v in calib["protocols"].items():
        for name, r in sorted(v["policies"].items(), key=lambda kv: kv[1]["cost"]):
            esc = f"{r['escalated']:.3f}" if "escalated" in r else ""
            lines.append(f"| {p} | {name} | {r['risk']:.3f} ({r['risk_se']:.3f}) | {r['cost']:.3f} | {esc} | "
                         f"{'yes' if r['meets_alpha'] else 'no'} |")
    return "\n".join(lines)


def _finite(x):
    """``x`` with every non-finite float as None (strict JSON)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, (float, np.floating)) and not np.isfinite(x):
        return None
    return x


def _json(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


if __name__ == "__main__":
    main()
