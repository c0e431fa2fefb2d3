"""Command line of the reproduction: ``python -m paper_repro [--quick|--full] ...``.

Runs every table that this checkout can build, writes Markdown + CSV under
``paper_repro/out/`` (or ``--out``), a ``summary.json`` of the headline
figures, and regenerates ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import impossibility, report, synthetic_coverage
from .common import OUT, Config, write_json

TABLES = {
    "T1": impossibility.run,
    "T2a": synthetic_coverage.run,
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paper_repro",
                                description="Regenerate the tables of arXiv 2607.21475 on this machine.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True,
                      help="small sizes, <= 15 min on 2 cores (default)")
    mode.add_argument("--full", action="store_true", help="the larger sizes (hours on 2 cores)")
    p.add_argument("--tables", default=",".join(TABLES),
                   help=f"comma-separated subset of {','.join(TABLES)} (default: all)")
    p.add_argument("--seed", type=int, default=0, help="master seed (default 0)")
    p.add_argument("--out", default=str(OUT), help="output folder (default paper_repro/out)")
    p.add_argument("--budgets", default="0.1,0.25,0.5", help="kept fractions (default 0.1,0.25,0.5)")
    p.add_argument("--cells", type=int, help="synthetic cells per (regime, budget)")
    p.add_argument("--draws", type=int, help="Poisson draws per cell")
    p.add_argument("--n", type=int, help="synthetic cache length (default 1024)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/results.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        budgets = tuple(float(b) for b in args.budgets.split(","))
        cfg = Config(quick=not args.full, seed=args.seed, out=args.out, budgets=budgets,
                     progress=not args.no_progress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in ("cells", "draws", "n"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                print(f"error: --{name} must be >= 1, got {value}", file=sys.stderr)
                return 2
            setattr(cfg, name, value)
    wanted = [t.strip() for t in args.tables.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in TABLES]
    if unknown:
        print(f"error: unknown table(s) {unknown}; choose from {list(TABLES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results, timings = {}, {}
    for name in wanted:
        t = time.perf_counter()
        try:
            table = TABLES[name](cfg)
        except ValueError as e:  # a configuration the design cannot serve (e.g. --n too small)
            print(f"error: {name}: {e}", file=sys.stderr)
            return 2
        table.write(cfg.out)
        results[name] = table
        timings[name] = round(time.perf_counter() - t, 1)
        print(f"[{name}] {table.title}: {len(table.rows)} rows in {timings[name]} s -> "
              f"{cfg.out / (table.key + '.md')}", file=sys.stderr)
    summary = report.summary(results, cfg)
    summary["seconds"] = dict(timings, total=round(time.perf_counter() - t0, 1))
    write_json(cfg.out / "summary.json", summary)
    if not args.no_docs:
        report.write_results_md(results, summary, cfg)
    print(report.console_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
