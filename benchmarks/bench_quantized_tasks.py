"""Task accuracy at equal memory: the recommended design at 16 bits against the same design storing its kept
tokens at 8 and 4 bits and at the width it chooses (``kv_bits="auto"``), on Table 3's suites (issue 54 item 3).

    .venv/bin/python benchmarks/bench_quantized_tasks.py [--protocols query-aware query-agnostic]
        [--examples 16] [--out benchmarks/results/quantized_tasks.json]

The examples, prefills, protocols and scoring are Table 3's quick suites (paper_repro.suites.collect with its
``methods`` hook: the needle tasks of ``QUICK_TASKS``, ``--examples`` seeded examples per task at about 768
tokens, greedy decoding of 10 tokens, exact match; query-aware in left-padded batches sharing one exact prefill,
query-agnostic through ``kvcert.compress_context``), at Table 3's budgets 0.1 / 0.25 / 0.5. A budget is the
memory: ``compression_ratio = 1 - budget`` keeps its meaning at every width (the 16-bit design's expected kept
count), so ``PoissonPress(compression_ratio=r, kv_bits=8)`` keeps about twice the tokens in the same memory,
scales included (docs/quantized.md section 6). Methods, all at the press's default design (tilted sketch, kind
tilted_hull):

- ``tilted_16``: ``PoissonPress(compression_ratio=r)``, the sampled-only design (Table 3's ``poisson_tilted``);
- ``tilted_8`` / ``tilted_4``: the same with ``kv_bits=8`` / ``4`` (per-channel key scales, the variance
  rounding term: the defaults);
- ``tilted_auto``: ``kv_bits="auto"`` (each layer's width of the smallest predicted certificate at the memory,
  docs/quantized.md section 11).

Reported per protocol and budget, pooled over the tasks and per task: accuracy, the full cache's, and each
quantized method's paired difference to ``tilted_16`` on the same examples with a 95% percentile bootstrap
interval (1,000 resamples stratified by task, paper_repro.bootstrap); and the mean relative certificate radius.
Issue 54's line: task accuracy at equal memory at least the sampled-only design's, with the interval. No
timing assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: method -> kv_bits of the default press
METHODS = {"tilted_16": 16, "tilted_8": 8, "tilted_4": 4, "tilted_auto": "auto"}
BASE = "tilted_16"


def presses(ratio: float, seed: int) -> list:
    import kvcert

    return [(m, kvcert.PoissonPress(compression_ratio=ratio, seed=seed, kv_bits=bits)) for m, bits in METHODS.items()]


def summarize(records: list[dict], *, resamples: int, seed: int) -> dict:
    """protocol -> budget -> {pooled, per task}: accuracies, paired differences to BASE with intervals, mean
    certificate."""
    from paper_repro.bootstrap import Runs, percentile_interval, weighted_accuracy
    from paper_repro.suites import protocol_of

    out = {}
    for protocol in dict.fromkeys(protocol_of(r) for r in records):
        runs = Runs([r for r in records if protocol_of(r) == protocol], resamples=resamples, seed=seed)
        per_budget = {}
        for b in runs.budgets(BASE):
            def acc(m, weights, task=None):
                if task is not None:
                    return runs.cell_acc(m, b if m != "full" else 1.0, task, weights)
                return weighted_accuracy(runs.get(m, b if m != "full" else 1.0, "correct"), weights)

            cell = {}
            for task in [None, *runs.tasks]:
                row = {"examples": int(len(runs.keys) if task is None else (runs.task_of == runs.tasks.index(task)).sum()),
                       "acc_full": float(acc("full", runs.unit, task)[0])}
                base_point, base_samples = acc(BASE, runs.unit, task), acc(BASE, runs.weights, task)
                for m in METHODS:
                    point = acc(m, runs.unit, task)
                    row[f"acc_{m}"] = float(point[0])
                    cert = runs.get(m, b, "cert")
                    use = np.ones(len(runs.keys), bool) if task is None else runs.task_of == runs.tasks.index(task)
                    row[f"cert_{m}"] = float(np.nanmean(cert[use])) if np.isfinite(cert[use]).any() else None
                    if m != BASE:
                        lo, hi = percentile_interval(acc(m, runs.weights, task) - base_samples)
                        row[f"diff_{m}"] = float(point[0] - base_point[0])
                        row[f"diff_{m}_ci"] = [float(lo), float(hi)]
                cell["pooled" if task is None else task] = row
            per_budget[str(b)] = cell
        out[protocol] = per_budget
    return out


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protocols", nargs="+", default=["query-aware", "query-agnostic"],
                    choices=["query-aware", "query-agnostic"])
    ap.add_argument("--examples", type=int, default=16, help="seeded examples per task")
    ap.add_argument("--resamples", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "quantized_tasks.json"))
    a = ap.parse_args(argv)
    if a.examples < 2:
        ap.error(f"--examples must be >= 2, got {a.examples}")
    import kvcert
    from paper_repro.common import Config
    from paper_repro.suites import collect
    from runinfo import git

    cfg = Config(quick=True, suite_examples=a.examples, protocols=tuple(a.protocols), seed=a.seed, progress=True)
    model, tokenizer = kvcert.load_model()
    t0 = time.perf_counter()
    records = collect(cfg, model, tokenizer, methods=presses)
    result = {"command": " ".join([".venv/bin/python", "benchmarks/bench_quantized_tasks.py", *argv]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git("rev-parse", "--short", "HEAD"),
              "settings": {**vars(a), "budgets": list(cfg.budgets), "context_tokens": cfg.suite_context,
                           "methods": {m: str(b) for m, b in METHODS.items()}},
              "seconds": time.perf_counter() - t0,
              "results": summarize(records, resamples=a.resamples, seed=a.seed), "records": records}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for protocol, per_budget in result["results"].items():
        print(f"\n{protocol}: pooled over tasks")
        print("| budget | full | " + " | ".join(METHODS) + " | " +
              " | ".join(f"{m} - {BASE} [95%]" for m in METHODS if m != BASE) + " |")
        print("|---|---|" + "---|" * (2 * len(METHODS) - 1))
        for b, cell in per_budget.items():
            r = cell["pooled"]
            diffs = " | ".join(f"{r[f'diff_{m}']:+.3f} [{r[f'diff_{m}_ci'][0]:+.3f}, {r[f'diff_{m}_ci'][1]:+.3f}]"
                               for m in METHODS if m != BASE)
            print(f"| {b} | {r['acc_full']:.3f} | " + " | ".join(f"{r[f'acc_{m}']:.3f}" for m in METHODS) +
                  f" | {diffs} |")


if __name__ == "__main__":
    main()
