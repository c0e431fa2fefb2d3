"""What a benchmark's JSON records about its run: the command, the date, the commit and the machine.

One helper for the research benchmarks (bench_target.py, bench_target_tasks.py, bench_allocation.py), so
every JSON they write names the command, date and commit its numbers were measured at (the docs rule).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def git(*args) -> str | None:
    """``git <args>`` in the repository root, stripped; None where git is not available."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:  # pragma: no cover - no git
        return None


def run_info(script: str, argv=None, *, threads: int, note: str) -> dict:
    """``command`` (``.venv/bin/python benchmarks/<script> <argv>``), ``date`` (UTC, ISO), ``git_commit``,
    ``git_dirty`` (uncommitted changes under fast/ or kvcert/, the code measured) and ``machine``
    (platform, Python, torch, CPUs, torch threads, load average, ``note``)."""
    import torch

    return dict(
        command=" ".join([".venv/bin/python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)]),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=git("rev-parse", "--short", "HEAD"),
        git_dirty=bool(git("status", "--porcelain", "--", "fast", "kvcert")),
        machine=dict(note=note, platform=platform.platform(), python=platform.python_version(),
                     torch=torch.__version__, cpus=os.cpu_count(), threads=threads, loadavg=os.getloadavg()),
    )
