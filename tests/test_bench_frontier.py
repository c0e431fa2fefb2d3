"""benchmarks/bench_frontier.py's pure functions: cost accounting, the baseline interpolation, the paired
bootstrap and the summary's fields, on made-up records (no model runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_frontier as B  # noqa: E402


def _point(family, correct, cost, name=None):
    correct, cost = np.asarray(correct, dtype=float), np.asarray(cost, dtype=float)
    return B.Point(family, name or family, {}, correct, cost)


def test_escalation_counts_both_runs_where_it_reruns():
    lo_c, lo_k = [0, 1, 0, 0], [0.25, 0.25, 0.26, 0.24]
    hi_c, hi_k = [1, 1, 0, 1], [1.0, 1.0, 1.0, 1.0]
    mask = [True, False, True, False]
    c, cost = B.escalated(lo_c, lo_k, hi_c, hi_k, mask)
    assert c.tolist() == [1, 1, 0, 0]
    np.testing.assert_allclose(cost, [1.25, 0.25, 1.26, 0.24])
    # no re-run: the first run's answers and cost exactly
    c0, cost0 = B.escalated(lo_c, lo_k, hi_c, hi_k, [False] * 4)
    assert c0.tolist() == lo_c and cost0.tolist() == lo_k


def test_top_share_ranks_nan_last_and_takes_round_share():
    s = [0.1, np.nan, 0.9, 0.5]
    assert B.top_share(s, 0.5).tolist() == [False, False, True, True]
    assert B.top_share(s, 0.0).sum() == 0
    assert B.top_share(s, 1.0).sum() == 4


def test_family_interpolates_linearly_in_cost_as_a_mixture():
    a = _point("fixed", [1, 0, 0, 0], [0.25] * 4)
    b = _point("fixed", [1, 1, 1, 0], [0.5] * 4)
    full = _point("full", [1, 1, 1, 1], [1.0] * 4)
    mid = B.family_at([b, a, full], 0.375)  # order of the points does not matter
    np.testing.assert_allclose(mid, [1, 0.5, 0.5, 0])
    np.testing.assert_allclose(B.family_at([a, b, full], 0.75), [1, 1, 1, 0.5])
    np.testing.assert_allclose(B.family_at([a, b, full], 0.25), a.correct)
    np.testing.assert_allclose(B.family_at([a, b, full], 1.4), full.correct)  # above 1: the full cache
    assert B.family_at([a, b, full], 0.2) is None  # below the family's cheapest point: not available


def _keys(n, tasks=("t1", "t2")):
    return sorted(("query-aware", t, i) for t in tasks for i in range(n))


def test_paired_bootstrap_is_zero_for_a_copy_and_above_zero_for_a_dominating_policy():
    keys = _keys(10)
    rng = np.random.default_rng(0)
    base_c = rng.integers(0, 2, size=len(keys)).astype(float)
    fam = {"fixed": [_point("fixed", base_c, [0.5] * len(keys)), _point("full", [1] * len(keys), [1.0] * len(keys))]}
    w = B.bootstrap_weights(keys, resamples=300, seed=0)
    same = B.paired_vs_baselines(_point("allocation", base_c, [0.5] * len(keys)), fam, w)
    assert same["diff"] == 0 and same["diff_ci"] == [0.0, 0.0] and same["baseline"] == "fixed"
    better = np.maximum(base_c, 1.0)  # right everywhere
    res = B.paired_vs_baselines(_point("allocation", better, [0.5] * len(keys)), fam, w)
    assert res["diff"] == pytest.approx(1 - base_c.mean())
    assert res["diff_ci"][0] > 0
    # the best of several families is the comparison, and a family that cannot reach the cost is left out
    fam["snapkv"] = [_point("snapkv", better, [0.5] * len(keys)), fam["fixed"][1]]
    fam["dear"] = [_point("dear", better, [0.9] * len(keys))]
    res = B.paired_vs_baselines(_point("allocation", base_c, [0.5] * len(keys)), fam, w)
    assert res["baseline"] == "snapkv" and res["diff"] < 0 and res["diff_ci"][1] < 0


def test_strata_fall_back_to_the_protocol_when_a_task_has_one_example():
    assert B.strata_of(_keys(3)) == [3, 3]
    assert B.strata_of(_keys(1)) == [2]
    assert "protocol, task" in B.strata_label(_keys(2)) and "one example" in B.strata_label(_keys(1))


def test_answer_signals_leave_out_the_exact_prefill_step():
    rel = np.zeros((3, 2, 2))
    rel[0] = 100.0  # step 0: the exact prefill, never counted query-aware
    rel[1] = [[1.0, 0.0], [0.0, 0.0]]
    rel[2] = 0.5
    s = B.answer_signals(rel, exact_first=True)
    assert s["cert_max"] == 1.0
    assert s["cert_mean"] == pytest.approx((0.25 + 0.5) / 2)
    assert s["cert_step_max"] == pytest.approx(0.5)
    assert B.answer_signals(rel, exact_first=False)["cert_max"] == 100.0
    assert np.isnan(B.answer_signals(np.zeros((1, 2, 2)), exact_first=True)["cert_mean"])


def test_cost_bins_and_summary_fields():
    assert B.cost_bin(0.3) == 0.25 and B.cost_bin(0.6) == 0.5 and B.cost_bin(1.7) == 1.0
    rows = [
        dict(family="fixed", name="fixed", cost=0.5, accuracy=0.5),
        dict(family="allocation", name="a", cost=0.5, accuracy=0.6, baseline="fixed", baseline_accuracy=0.5,
             diff=0.1, diff_ci=[-0.1, 0.3]),
        dict(family="escalation", name="e", cost=0.74, accuracy=0.9, baseline="fixed", baseline_accuracy=0.7,
             diff=0.2, diff_ci=[0.05, 0.35]),
        dict(family="recompute-cells", name="r", cost=0.55, accuracy=0.4, baseline="fixed", baseline_accuracy=0.5,
             diff=-0.1, diff_ci=[-0.3, 0.1]),
        dict(family="target", name="t", cost=0.3, accuracy=0.9, baseline="fixed", baseline_accuracy=0.2,
             diff=0.7, diff_ci=[0.5, 0.9]),  # an error target is not a certificate-driven policy here
    ]
    s = B.summarize(rows, recompute_gain=-1.5, failure_auc_best=0.8)
    assert s["dominates_at_cost_points"] == 2 and isinstance(s["dominates_at_cost_points"], int)
    assert s["dominated_cost_bins"] == [0.5, 0.75]
    assert s["best_interval_excludes_zero"] is True
    assert s["best_point"]["name"] == "e"
    assert isinstance(s["recompute_gain_points"], float) and s["recompute_gain_points"] == -1.5
    assert isinstance(s["failure_auc_best"], float)
    none = B.summarize(rows[:2], recompute_gain=0.0, failure_auc_best=0.5)
    assert none["dominates_at_cost_points"] == 1 and none["best_interval_excludes_zero"] is False


def _records(n=4, seed=0):
    """Made-up runs of every family the benchmark writes, on two tasks."""
    rng = np.random.default_rng(seed)
    out = []
    levels = {"fixed": [0.125, 0.25, 0.5, 0.75], "snapkv": [0.125, 0.25, 0.5, 0.75], "allocation": [0.5],
              "target": [0.1], "recompute-cells": [0.25]}
    for task in ("a", "b"):
        for i in range(n):
            out.append(dict(protocol="query-aware", task=task, example=i, family="full", level=1.0, correct=True,
                            kept=1.0, extra_cost=0.0, cert_t3=np.nan, conf=0.1, cert_max=np.nan,
                            cert_mean=np.nan, cert_step_max=np.nan))
            for fam, lv in levels.items():
                for level in lv:
                    p = level if fam != "target" else 0.6
                    ok = bool(rng.random() < p)
                    cert = float(rng.random() + (0 if ok else 0.5))
                    out.append(dict(protocol="query-aware", task=task, example=i, family=fam, level=level,
                                    correct=ok, kept=p if fam != "target" else 0.6,
                                    extra_cost=0.2 if fam == "recompute-cells" else 0.0, cert_t3=cert,
                                    conf=float(rng.random()), cert_max=cert * 3, cert_mean=cert,
                                    cert_step_max=cert))
    return out


def test_analysis_of_made_up_runs_writes_the_summary_names():
    res = B.analyse(_records(), seed=0, resamples=50)
    s = res["summary"]
    for name, kind in (("dominates_at_cost_points", int), ("best_interval_excludes_zero", bool),
                       ("recompute_gain_points", float), ("failure_auc_best", float)):
        assert isinstance(s[name], kind), name
    fams = {r["family"] for r in res["rows"]}
    assert {"full", "fixed", "snapkv", "allocation", "target", "escalation", "recompute-request",
            "recompute-cells"} <= fams
    # escalation to the full cache costs the base run plus the re-runs: above the base, at most base + 1
    esc = [r for r in res["rows"] if r["name"].startswith("escalate 0.25->full cert_max top 50%")][0]
    assert 0.25 < esc["cost"] <= 1.25
    assert esc["params"]["escalated"] == pytest.approx(0.5)
    cells = [r for r in res["rows"] if r["family"] == "recompute-cells"][0]
    assert cells["cost"] == pytest.approx(0.45)  # kept plus recompute reads
    # the recompute gain is Table 4's on the same runs
    assert res["recompute_t4"]["gain_points"] == pytest.approx(np.mean(res["recompute_t4"]["gains"]))
    # the record JSON is strict (no NaN)
    text = json.dumps(B._finite(res), default=B._json, allow_nan=False)
    assert "NaN" not in text


def test_goals_are_not_tested_on_a_handful_of_examples():
    goals = B.analyse(_records(n=4), seed=0, resamples=20)["summary"]["goals"]
    assert goals["testable"] is False
    assert goals["dominates_two_cost_points"] is None and goals["failure_auc_at_least_085"] is None
    goals = B.analyse(_records(n=B.MIN_STRATUM_FOR_GOALS), seed=0, resamples=20)["summary"]["goals"]
    assert goals["testable"] is True and isinstance(goals["failure_auc_at_least_085"], bool)


def test_allocation_policy_is_the_library_press():
    """The allocation runs kvcert's own PoissonPress(allocation="neyman") (the design measured is the design
    shipped), at the benchmark's kept fractions, floor and grid step; the benchmark defines no press of its own
    for it."""
    import kvcert

    specs = [s for s in B._run_specs(B.parse_args(["--quick"])) if s[0] == "allocation"]
    assert [level for _, level, _, _ in specs] == list(B.ALLOC_FRACTIONS)
    for _, f, _, make in specs:
        press = make(3)
        assert type(press) is kvcert.PoissonPress
        assert (press.allocation, press.compression_ratio, press.allocation_floor, press.allocation_step,
                press.seed, press.sketch) == ("neyman", 1 - f, B.ALLOC_FLOOR, B.ALLOC_STEP, 3, None)
    assert not hasattr(B, "AllocatedPress")


def test_allocation_info_summarizes_a_row():
    import torch

    from kvcert.presses.allocation import RowAllocation

    row = RowAllocation(n=100, uniform=50.0, total=200, floor=37, layers=(0, 1),
                        budgets=torch.tensor([[37, 63], [40, 60]]), allocation=None)
    assert B.allocation_info(row) == dict(total=200, floor=37, n=100, budget_min=37, budget_max=63, budget_sum=200)
    assert B.allocation_info(None) == {}


def _calib_records(informative: bool, n=30, seed=0):
    """Two tasks of n examples: the paper design at kept 0.25 / 0.5 changes 40% / 20% of the answers, KeyDiff at
    0.25 / 0.5 / 0.75 changes 40% / 20% / 0%; the signal separates the changed answers (informative) or not."""
    rng = np.random.default_rng(seed)
    out = []
    for t in ("t1", "t2"):
        for i in range(n):
            base = dict(protocol="query-aware", task=t, example=i, correct=True, extra_cost=0.0, cert_t3=0.0,
                        conf=0.0, cert_max=0.0, cert_mean=0.0)
            out.append(dict(base, family="full", level=1.0, kept=1.0, answer="A", cert_step_max=float("nan")))
            u = (i + 0.5) / n  # exactly 40% / 20% of each task's answers change
            for fam, levels in (("fixed", (0.25, 0.5)), ("keydiff", (0.25, 0.5, 0.75))):
                for lv in levels:
                    changed = u < {0.25: 0.4, 0.5: 0.2, 0.75: 0.0}[lv]
                    sig = (1.0 + rng.random() if changed else rng.random()) if informative else rng.random()
                    out.append(dict(base, family=fam, level=lv, kept=lv, answer=" B" if changed else "A ",
                                    cert_step_max=sig))
    return out


def test_calibrated_escalation_meets_alpha_and_is_cheaper_only_when_the_signal_informs():
    cal = B.calibration_holdout(_calib_records(informative=True), alpha=0.1, splits=60, seed=1)
    qa = cal["protocols"]["query-aware"]
    assert qa["calibration_prompts"] == 30 and qa["heldout_prompts"] == 30
    for name, row in qa["policies"].items():
        # conformal risk control: expected risk <= alpha; the mean over 60 splits within 3 standard errors
        assert row["risk"] <= 0.1 + 3 * row["risk_se"], name
    # KeyDiff needs its 0.75 budget (0.25 and 0.5 change 40% / 20% of the answers; 0.5 qualifies only in a
    # split whose calibration half holds at most 2 of its 12 changed answers)
    chosen = qa["policies"]["budget keydiff"]["budget_chosen"]
    assert "0.25" not in chosen and chosen.get("0.75", 0) >= 54
    # a separating signal re-runs about the 40% that changed: cost about 0.25 + 0.4 < 0.75
    esc = qa["policies"]["escalate 0.25->full"]
    assert 0.3 < esc["escalated"] < 0.5 and esc["cost"] < 0.75
    assert qa["escalation_cheaper"] is True
    # negative control: a signal that knows nothing must re-run nearly everything to meet alpha
    blind = B.calibration_holdout(_calib_records(informative=False), alpha=0.1, splits=60, seed=1)
    qb = blind["protocols"]["query-aware"]
    assert qb["policies"]["escalate 0.25->full"]["escalated"] > 0.7
    assert qb["escalation_cheaper"] is False


def test_calibration_needs_recorded_answers():
    recs = _calib_records(informative=True, n=4)
    for r in recs:
        r.pop("answer")
    assert B.calibration_holdout(recs) is None
    assert B.differs_from_full(recs) is None


def test_another_scorers_design_is_a_baseline_and_its_cell_recompute_is_certificate_driven():
    recs = _records()
    for r in [r for r in recs if r["family"] in ("fixed", "recompute-cells")]:
        recs.append(dict(r, family=("fixed-keydiff" if r["family"] == "fixed" else "recompute-cells-keydiff"),
                         correct=not r["correct"]))
    assert B.is_baseline("fixed-keydiff") and not B.is_cert_driven("fixed-keydiff")
    assert B.is_cert_driven("recompute-cells-keydiff") and not B.is_baseline("recompute-cells-keydiff")
    assert B.sampled_families(["snapkv", "fixed-keydiff", "fixed", "recompute-cells"]) == ["fixed", "fixed-keydiff"]
    res = B.analyse(recs, seed=0, resamples=20)
    rows = {r["name"]: r for r in res["rows"]}
    # escalation from the keydiff-scored design, tagged, alongside the paper design's
    assert "escalate[keydiff] 0.25->full cert_max top 50%" in rows and "escalate 0.25->full cert_max top 50%" in rows
    # the keydiff-scored design is compared against, not compared: no difference on its rows
    assert "diff" not in rows["fixed-keydiff kept=0.25"] and "diff" in rows["recompute-cells-keydiff kept=0.25"]
    assert any(r["family"] == "recompute-cells-keydiff" for r in res["rows"])
    assert res["summary"]["certificate_driven_points"] == sum(B.is_cert_driven(r["family"]) for r in res["rows"])


def test_cert_margin_divides_each_steps_radius_by_its_greedy_margin():
    rel = np.array([[[9.0]], [[0.2]], [[0.3]]])  # (steps, layers, heads); step 0 the exact prefill
    margins = np.array([0.001, 2.0, 0.1])
    s = B.answer_signals(rel, exact_first=True, margins=margins)
    assert s["cert_margin"] == pytest.approx(max(0.2 / 2.0, 0.3 / 0.1))
    assert s["margin"] == pytest.approx(-0.1)  # step 0 left out with the radius
    assert s["cert_step_max"] == pytest.approx(0.3)
    # a tie (margin 0) is floored, not a division by zero
    tie = B.answer_signals(rel, exact_first=False, margins=np.array([0.0, 1.0, 1.0]))
    assert tie["cert_margin"] == pytest.approx(9.0 / B.MARGIN_FLOOR)
    # no certificate (the full cache, a deterministic press): the margin alone
    none = B.answer_signals(np.zeros((0,)), exact_first=True, margins=margins)
    assert np.isnan(none["cert_margin"]) and none["margin"] == pytest.approx(-0.1)
