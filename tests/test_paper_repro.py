"""Smoke test of the reproduction runner on a tiny configuration."""

import json

import pytest

from kvcert import reference as R
from paper_repro.__main__ import main


def test_runner_tiny(tmp_path, capsys):
    rc = main(["--quick", "--tables", "T1,T2a", "--cells", "2", "--draws", "5", "--n", "512", "--out", str(tmp_path),
               "--no-docs", "--no-progress"])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("coverage_pooled", "coverage_worst_decile", "spearman_radius_error", "cells", "quick"):
        assert key in summary
    assert summary["quick"] is True
    # T1: the adversary leaves the retained state bit-identical
    assert summary["impossibility"]["max_retained_change"] == 0.0
    t2a = (tmp_path / "table2a_synthetic_coverage.csv").read_text().splitlines()
    # header + regimes (4) x budgets (3) x kinds (4) x deltas (2)
    assert len(t2a) == 1 + 4 * 3 * len(R.KINDS) * 2
    assert "kvcert paper reproduction" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--tables", "T9"], ["--budgets", "0,0.5"], ["--cells", "0"],
                                  ["--draws", "0", "--tables", "T2a"]])
def test_runner_bad_arguments(argv, tmp_path, capsys):
    assert main(argv + ["--out", str(tmp_path), "--no-docs"]) == 2
    assert "error:" in capsys.readouterr().err
