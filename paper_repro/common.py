"""Shared plumbing of the reproduction: configuration, tables on disk, progress."""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "out"
DOCS = ROOT.parent / "docs"


@dataclass
class Config:
    """Run configuration; ``quick`` sizes fit the 15-minute budget on 2 cores."""

    quick: bool = True
    seed: int = 0
    out: Path = OUT
    budgets: tuple = (0.1, 0.25, 0.5)
    deltas: tuple = (0.1, 0.05)
    progress: bool = True

    # the real model (T2 and later)
    model: str = "smollm2"
    context: int = 1792
    device: str = "cpu"

    # synthetic suites on the real model (T3)
    suite_examples: int = 16
    suite_context: int = 768
    #: examples decoded together (left-padded batch) in the query-aware runs
    suite_batch: int = 8
    #: protocols of T3/T4: "query-aware" (the paper's: the question is compressed with the context) and
    #: "query-agnostic" (kvpress's pipeline: the context compressed once, the question not compressed);
    #: None = query-aware in quick mode, both in full mode
    protocols: tuple | None = None
    #: kvpress presses run as baselines in T3 when kvpress is installed (class names in kvpress)
    kvpress: tuple = ("SnapKVPress",)

    # synthetic attention (T1, T2a)
    n: int = 1024
    d: int = 64
    dv: int = 64
    cells: int = 40
    draws: int = 200

    def __post_init__(self):
        if not self.quick:
            self.cells, self.draws = 200, 500
            self.context = 4096
            self.suite_examples, self.suite_context = 40, 2048
        if self.protocols is None:
            self.protocols = ("query-aware",) if self.quick else ("query-aware", "query-agnostic")
        self.protocols = tuple(self.protocols)
        bad = [p for p in self.protocols if p not in ("query-aware", "query-agnostic")]
        if bad or not self.protocols:
            raise ValueError(f"protocols must be a non-empty subset of ('query-aware', 'query-agnostic'), got "
                             f"{self.protocols!r}")
        if isinstance(self.suite_batch, bool) or not isinstance(self.suite_batch, int) or self.suite_batch < 1:
            raise ValueError(f"suite_batch must be an int >= 1, got {self.suite_batch!r}")
        self.kvpress = tuple(self.kvpress)
        self.out = Path(self.out)
        for b in self.budgets:
            if not 0 < b <= 1:
                raise ValueError(f"budgets must be fractions in (0, 1], got {b}")

    def as_dict(self):
        d = asdict(self)
        d["out"] = str(self.out)
        return d


@dataclass
class Table:
    """A result table: rows of dicts, with a title and notes for the Markdown."""

    key: str
    title: str
    rows: list
    notes: list = field(default_factory=list)
    columns: list | None = None
    #: the columns the Markdown shows (default: all of the CSV's); the CSV always has every column
    shown: list | None = None

    def _columns(self):
        return self.columns or list(self.rows[0].keys())

    def markdown(self) -> str:
        cols = [c for c in self._columns() if self.shown is None or c in self.shown]
        lines = [f"| {' | '.join(cols)} |", f"|{'|'.join('---' for _ in cols)}|"]
        for r in self.rows:
            lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
        text = f"### {self.title}\n\n" + "\n".join(lines) + "\n"
        if self.notes:
            text += "\n" + "\n".join(f"- {n}" for n in self.notes) + "\n"
        return text

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        cols = self._columns()
        with open(out / f"{self.key}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)
        (out / f"{self.key}.md").write_text(self.markdown())


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (float, np.floating)):
        if not np.isfinite(x):
            return str(x)
        if x == 0:
            return "0"
        if abs(x) >= 1e4 or abs(x) < 1e-3:
            return f"{x:.2e}"
        return f"{x:.3f}"
    return str(x)


def progress(iterable, *, total=None, desc="", enabled=True):
    """tqdm progress bar on stderr (plain iteration when disabled or absent)."""
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is in the repro extra
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")
