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


@pytest.mark.parametrize("regime, budget", [("heavy", 0.25), ("needle", 0.25), ("heavy", 0.6)])
def test_synthetic_replay_matches_the_reference_draw_by_draw(regime, budget):
    """T2a replays a cell's draws in one float64 batch of kvcert.fast; draw by draw, kvcert.reference on the
    same uniforms gives the same errors, radii and hits (every kind and delta). Budget 0.25 takes the packed
    path of draw_estimates, 0.6 the unpacked one (PACK_BELOW)."""
    import numpy as np

    from paper_repro.synthetic import design_pi, make_head
    from paper_repro.synthetic_coverage import PACK_BELOW, replay_cell

    assert budget < PACK_BELOW or budget > PACK_BELOW + 0.1  # the draws' kept fraction is near the budget
    head = make_head(np.random.default_rng(4), regime, n=256, d=16, dv=8)
    pi = design_pi(head, budget)
    deltas = (0.1, 0.05)
    err, radius, hit = replay_cell(head, pi, 12, deltas, np.random.default_rng(9))
    o = R.attention(head.q, head.keys, head.values)
    rng = np.random.default_rng(9)
    for t in range(12):
        keep = R.poisson_sample(pi, generator=rng)
        est = R.hajek_attention(head.q, head.keys[keep], head.values[keep], pi[keep])
        assert err[t] == pytest.approx(np.linalg.norm(est.output - o), rel=1e-10)
        for kind in R.KINDS:
            for delta in deltas:
                cert = R.certificate(est, delta=delta, kind=kind)
                assert radius[kind, delta][t] == pytest.approx(np.linalg.norm(cert.radius), rel=1e-9)
                assert hit[kind, delta][t] == np.mean(R.covers(cert, est, o))


def test_results_md_quotes_the_sketch_goal_table(tmp_path, monkeypatch):
    """results.md quotes issue 14's curated goal-line table (every row, with where it comes from);
    without the research file the section is left out rather than written empty."""
    from paper_repro import report

    section = report._sketch_section()
    table = [x for x in section if x.startswith("|")]
    assert section[0].startswith("### Sketched designs") and "evaluate_t2.py" in section[2]
    assert table[0].startswith("| M | design | variance | radius |") and table[0].endswith("| goal lines met |")
    assert table[2].startswith("| 0.15 | paper | trace | chebyshev |") and table[-1].startswith("| 0.55 |")
    assert any("| cluster |" in x for x in table) and len(table) > 10
    # the curated table only: the memory table above it and the prose after it are not quoted
    assert not any(x.startswith("| design | sketch held |") for x in table)
    text = report.SKETCH_RESULTS.read_text()
    assert all(x in text for x in table)
    monkeypatch.setattr(report, "SKETCH_RESULTS", tmp_path / "missing.md")
    assert report._sketch_section() == []


def test_summary_and_results_md_put_the_sketched_design_beside_the_paper_design():
    """T3's *_cluster columns and T4's _cluster headline keys reach summary() and results.md's section,
    each design's number in its own column; Table 4's :cluster rows are not counted as paper findings."""
    from paper_repro import report
    from paper_repro.common import Config, Table

    cells = [dict(protocol="query-aware", task="t", budget=b, auc_certificate=a, auc_confidence=0.9,
                  auc_certificate_cluster=c, auc_confidence_cluster=0.8, acc_poisson=0.5, acc_poisson_cluster=0.25,
                  auc_certificate_tilted=0.9, auc_confidence_tilted=0.7, acc_poisson_tilted=0.125,
                  auc_certificate_median=0.65, auc_certificate_median_tilted=0.35)
             for b, a, c in ((0.1, 0.6, 0.4), (0.25, 0.8, float("nan")))]
    t4 = Table("table4_claims", "T4", [dict(protocol="query-aware", claim="attribution", holds_here="yes"),
                                       dict(protocol="query-aware", claim="attribution:cluster", holds_here="no"),
                                       dict(protocol="query-aware", claim="attribution:tilted", holds_here="yes")], [])
    raw = {"T4": {"attribution_auc": 0.67, "attribution_auc_confidence": 0.48, "attribution_auc_cluster": 0.55,
                  "attribution_auc_confidence_cluster": 0.5, "recompute_gain_points": -2.1,
                  "recompute_gain_points_prefill": 0.5, "recompute_gain_points_cluster": 1.5,
                  "attribution_auc_tilted": 0.75, "attribution_auc_confidence_tilted": 0.45,
                  "recompute_gain_points_tilted": -3.0}}
    s = report.summary({"T3": Table("table3", "T3", cells, []), "T4": t4}, Config(quick=True, progress=False), raw)
    assert s["sketch_t3"]["auc_certificate"] == pytest.approx(0.7)
    assert s["sketch_t3"]["auc_certificate_cluster"] == pytest.approx(0.4)  # the NaN cell left out
    assert s["sketch_t4"]["recompute_gain_points_cluster"] == 1.5
    text = "\n".join(report._sketch_payoff(s))
    assert "| T3 failure-prediction AUC of the certificate, mean over cells | 0.700 | 0.400 | 0.900 |" in text
    assert "| T3 accuracy, mean over cells | 0.500 | 0.250 | 0.125 |" in text
    # a statistic a design's cells lack (the cluster rows here have no median column): n/a, not 0
    assert "| T3 the same for the run's median relative radius (diagnostic) | 0.650 | n/a | 0.350 |" in text
    assert "| T4 attribution AUC of the certificate | 0.670 | 0.550 | 0.750 |" in text
    assert "compressed once after the prefill (mean over budgets) | +0.5 | +1.5 | -3.0 |" in text
    # a run with the cluster sketch only (an older records file): its column alone
    only = report._sketch_payoff({"sketch_t4": {k: v for k, v in raw["T4"].items() if "tilted" not in k}})
    assert "| T4 attribution AUC of the certificate | 0.670 | 0.550 |" in "\n".join(only)
    assert report._sketch_payoff({}) == []
    # the sketched designs' reruns of a claim are not the paper's findings
    assert report._findings(s["claims"]) == "Of the paper's findings tested in Table 4, 1 of 1 hold here (attribution)."
