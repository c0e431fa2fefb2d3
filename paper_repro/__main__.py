"""Command line of the reproduction: ``python -m paper_repro [--quick|--full] ...``.

Runs every table that this checkout can build, writes Markdown + CSV under
``paper_repro/out/`` (or ``--out``), a ``summary.json`` of the headline
figures, and regenerates ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from . import cost, impossibility, report, synthetic_coverage
from .common import OUT, Config, write_json

#: tables on synthetic attention (need only the reference)
TABLES = {
    "T1": impossibility.run,
    "T2a": synthetic_coverage.run,
    "T5": cost.run,
}
#: tables on the real model (need the model and its captured attention)
MODEL_TABLES = ("T1b", "T2", "T2d", "T3", "T4", "T6")
ALL_TABLES = tuple(TABLES) + MODEL_TABLES
#: tables that only ``--full`` (or ``--tables``) runs: T2d (block design, issue 12) adds minutes to the quick run
FULL_ONLY = ("T2d",)


class RealModel:
    """Loads the model once and captures its attention inputs on demand."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._model = None
        self._captured = None

    def model(self):
        """(model, tokenizer), loaded once."""
        if self._model is None:
            import kvcert

            t = time.perf_counter()
            self._model = kvcert.load_model(self.cfg.model, device=self.cfg.device)
            print(f"[model] {self.cfg.model}: loaded in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        return self._model

    def captured(self, future: int):
        if self._captured is None:
            from .realmodel import capture, haystack_ids

            model, tokenizer = self.model()
            ids = haystack_ids(tokenizer, self.cfg.context + future, seed=self.cfg.seed)
            self._captured = capture(model, ids.to(model.device))
        return self._captured


def _run_model_table(name: str, cfg: Config, real: RealModel, raw: dict) -> dict:
    """Run one real-model table; returns {key: Table} (a table may come with companions)."""
    if name == "T1b":
        from . import replay

        return {"T1b": impossibility.run_real(cfg, real.captured(replay.setup_for(cfg).future))}
    if name == "T2":
        from . import replay

        setup = replay.setup_for(cfg)
        t2, t2b, t2c, raw["T2"] = replay.run(cfg, real.captured(setup.future))
        return {"T2": t2, "T2b": t2b, "T2c": t2c}
    if name == "T2d":
        from . import replay, replay_blocks

        return {"T2d": replay_blocks.run(cfg, real.captured(replay.setup_for(cfg).future))}
    if name in ("T3", "T4", "T6"):  # all from the same runs of the suites, collected once
        from . import claims, suites

        if "suites" not in raw:
            raw["suites"] = suites.collect(cfg, *real.model())
        if name == "T3":
            from .bootstrap import with_intervals

            return {"T3": with_intervals(suites.table(raw["suites"], cfg), raw["suites"], seed=cfg.seed)}
        if name == "T6":
            from . import frontier

            return {"T6": frontier.table(raw["suites"], cfg)}
        t4, raw["T4"] = claims.run(raw["suites"], cfg)
        return {"T4": t4}
    raise ValueError(f"unknown model table {name}")


def _figures(results: dict, raw: dict, cfg: Config) -> list:
    from . import figures

    folder = cfg.out / "figures"
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    if "T2" in raw:
        made.append(figures.calibration(raw["T2"]["cells"], folder / "calibration.png"))
    if "T2" in results or "T2a" in results:
        real = results["T2"].rows if "T2" in results else []
        synth = results["T2a"].rows if "T2a" in results else None
        made.append(figures.coverage_vs_budget(real, synth, folder / "coverage_vs_budget.png"))
    if "suites" in raw:
        made.append(figures.roc(raw["suites"], folder / "roc.png"))
    return made


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m paper_repro",
                                description="Regenerate the tables of arXiv 2607.21475 on this machine.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", default=True,
                      help="small sizes, <= 15 min on 2 cores (default)")
    mode.add_argument("--full", action="store_true", help="the larger sizes (hours on 2 cores)")
    p.add_argument("--tables", default=None,
                   help=f"comma-separated subset of {','.join(ALL_TABLES)} (default: all; quick mode leaves out "
                        f"{','.join(FULL_ONLY)})")
    p.add_argument("--seed", type=int, default=0, help="master seed (default 0)")
    p.add_argument("--out", default=str(OUT), help="output folder (default paper_repro/out)")
    p.add_argument("--budgets", default="0.1,0.25,0.5", help="kept fractions (default 0.1,0.25,0.5)")
    p.add_argument("--cells", type=int, help="synthetic cells per (regime, budget)")
    p.add_argument("--draws", type=int, help="Poisson draws per cell")
    p.add_argument("--n", type=int, help="synthetic cache length (default 1024)")
    p.add_argument("--model", default="smollm2", help="model for the real-model tables (default: the "
                   "embedded SmolLM2-135M-Instruct; any local HF causal LM path works)")
    p.add_argument("--context", type=int, help="prefix length of the real-model tables (default 1792, full 4096)")
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    p.add_argument("--suite-examples", type=int, help="examples per task in T3/T4 (default 16, full 40)")
    p.add_argument("--suite-context", type=int, help="prompt length in tokens in T3 (default 768, full 2048)")
    p.add_argument("--suite-batch", type=int, help="examples decoded together in T3's query-aware runs (default 8)")
    p.add_argument("--protocols", default=None,
                   help="T3/T4 protocols, comma-separated: query-aware (the paper's), query-agnostic (kvpress's "
                        "pipeline) (default: query-aware in quick mode, both in full mode)")
    p.add_argument("--kvpress", default="SnapKVPress",
                   help="kvpress presses run as T3 baselines when kvpress is installed, comma-separated class "
                        "names, or 'none' (default SnapKVPress)")
    p.add_argument("--no-docs", action="store_true", help="do not rewrite docs/results.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        budgets = tuple(float(b) for b in args.budgets.split(","))
        protocols = None if args.protocols is None else tuple(p.strip() for p in args.protocols.split(",")
                                                              if p.strip())
        kvpress = () if args.kvpress.strip().lower() == "none" else tuple(
            k.strip() for k in args.kvpress.split(",") if k.strip())
        cfg = Config(quick=not args.full, seed=args.seed, out=args.out, budgets=budgets,
                     progress=not args.no_progress, model=args.model, device=args.device, protocols=protocols,
                     kvpress=kvpress)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name in ("cells", "draws", "n", "context", "suite_examples", "suite_context", "suite_batch"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                print(f"error: --{name} must be >= 1, got {value}", file=sys.stderr)
                return 2
            setattr(cfg, name, value)
    if args.tables is None:
        args.tables = ",".join(t for t in ALL_TABLES if args.full or t not in FULL_ONLY)
    wanted = [t.strip() for t in args.tables.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in ALL_TABLES]
    if unknown:
        print(f"error: unknown table(s) {unknown}; choose from {list(ALL_TABLES)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results, timings, raw = {}, {}, {}
    real = RealModel(cfg)
    for name in wanted:
        t = time.perf_counter()
        try:
            new = {name: TABLES[name](cfg)} if name in TABLES else _run_model_table(name, cfg, real, raw)
        except ValueError as e:  # a configuration the design cannot serve (e.g. --n too small)
            print(f"error: {name}: {e}", file=sys.stderr)
            return 2
        timings[name] = round(time.perf_counter() - t, 1)
        for key, table in new.items():
            table.write(cfg.out)
            print(f"[{key}] {table.title}: {len(table.rows)} rows -> {cfg.out / (table.key + '.md')}",
                  file=sys.stderr)
        print(f"[{name}] done in {timings[name]} s", file=sys.stderr)
        results.update(new)
    figures = _figures(results, raw, cfg)
    summary = report.summary(results, cfg, raw)
    summary["figures"] = [str(f) for f in figures]
    summary["seconds"] = dict(timings, total=round(time.perf_counter() - t0, 1))
    write_json(cfg.out / "summary.json", summary)
    if not args.no_docs:
        docs_figs = report.DOCS / "figures"
        docs_figs.mkdir(parents=True, exist_ok=True)
        for f in figures:
            shutil.copyfile(f, docs_figs / f.name)
        report.write_results_md(results, summary, cfg)
    print(report.console_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
