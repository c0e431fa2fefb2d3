"""Table 4's claim tests on hand-made runs, where every number is derived by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from paper_repro import claims
from paper_repro.common import Config
from paper_repro.figures import roc_points
from paper_repro.suites import auc


def _records(poisson_correct, cert, conf, full_correct, budget=0.25, task="t"):
    recs = []
    for i, (c, x, y, f) in enumerate(zip(poisson_correct, cert, conf, full_correct)):
        recs.append(dict(task=task, example=i, method="poisson", budget=budget, correct=c, cert=x, conf=y))
        recs.append(dict(task=task, example=i, method="full", budget=1.0, correct=f, cert=float("nan"), conf=0.0))
    return recs


CFG = Config(quick=True, budgets=(0.25,), progress=False)


def test_recompute_by_hand():
    # 4 requests, the full cache answers all; Poisson fails 0 and 1. The certificate ranks request 0
    # first, confidence ranks request 2 (a success) first. 25% of 4 = 1 recomputation:
    # certificate 3/4 = 75, confidence 2/4 = 50, random 50 + 1/4 * 50 = 62.5 -> gain 12.5 points
    recs = _records([False, False, True, True], [0.9, 0.8, 0.1, 0.2], [0.1, 0.2, 0.9, 0.8], [True] * 4)
    holds, text, head = claims.recompute(recs, CFG)
    assert head["recompute_gain_points"] == pytest.approx(12.5)
    assert holds is True and "certificate 75.0, confidence 50.0, random 62.5" in text


def test_attribution_by_hand():
    # failures: 0, 1 (cache-induced: full right) and 2 (inherent: full wrong); the certificate is
    # larger on both cache-induced ones (AUC 1), confidence puts the inherent one in the middle (AUC 1/2)
    recs = _records([False, False, False, True], [0.9, 0.7, 0.1, 0.0], [0.1, 0.9, 0.5, 0.0],
                    [True, True, False, True])
    holds, text, head = claims.attribution(recs, CFG)
    assert head["attribution_auc"] == 1.0 and head["attribution_auc_confidence"] == 0.5
    assert holds is True and "2 cache-induced and 1 inherent" in text


def test_attribution_without_inherent_failures_is_not_testable():
    recs = _records([False, True], [0.9, 0.1], [0.1, 0.9], [True, True])
    holds, _, head = claims.attribution(recs, CFG)
    assert holds is None and head["attribution_auc"] is None


def test_escalation_by_hand():
    cfg = Config(quick=True, budgets=(0.25, 0.5), progress=False)
    lo = _records([False, False, True, True], [0.9, 0.1, 0.5, 0.2], [0.0] * 4, [True] * 4, budget=0.25)
    hi = [dict(r, budget=0.5, correct=r["example"] in (0, 1)) for r in lo if r["method"] == "poisson"]
    # 50% of 4 = 2 escalated. Certificate picks 0 and 2: 0 becomes right, 2 becomes wrong -> 2/4.
    # Random: 0.5 + 0.5 * (0.5 - 0.5) = 0.5. Gain 0 < 2 points: "adds nothing" holds.
    holds, text, _ = claims.gating_adds_nothing(lo + hi, cfg)
    assert holds is True and "certificate-gated 50.0" in text and "random 50.0" in text


def _nearly_free_records(snapkv_half_wrong: int):
    """25 examples, full cache right on all; one Poisson failure at each budget, and
    ``snapkv_half_wrong`` SnapKV failures at budget 0.5."""
    recs = [dict(task="t", example=i, method="full", budget=1.0, correct=True, cert=0.0, conf=0.0)
            for i in range(25)]
    for b in (0.25, 0.5):
        for m in ("poisson", "snapkv"):
            wrong = snapkv_half_wrong if (m, b) == ("snapkv", 0.5) else 1
            recs += [dict(task="t", example=i, method=m, budget=b, correct=i >= wrong, cert=0.0, conf=0.0)
                     for i in range(25)]
    return recs


def test_nearly_free_threshold():
    cfg = Config(quick=True, budgets=(0.25, 0.5), progress=False)
    holds, text, _ = claims.nearly_free(_nearly_free_records(1), cfg)  # every drop 1/25 = 4 points
    assert holds is True and text.count("+4.0") == 4
    holds, text, _ = claims.nearly_free(_nearly_free_records(2), cfg)  # snapkv @ 0.5 drops 8 > 5 points
    assert holds is False and "snapkv @ 0.5: +8.0" in text


@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=30))
def test_roc_area_equals_auc(pairs):
    s = np.array([p[0] for p in pairs], dtype=float)
    y = np.array([p[1] for p in pairs])
    x, t = roc_points(s, y)
    assert np.all(np.diff(x) >= 0) and np.all(np.diff(t) >= 0)
    a = auc(s, y)
    if np.isfinite(a):
        assert np.trapezoid(t, x) == pytest.approx(a, abs=1e-12)


def test_recompute_prefers_the_streaming_runs():
    # the streaming runs decide the verdict; the prefill-compressed ones are reported beside them
    once = _records([False, False, True, True], [0.9, 0.8, 0.1, 0.2], [0.1, 0.2, 0.9, 0.8], [True] * 4)
    stream = [dict(r, method="poisson_stream", cert=-r["cert"]) for r in once if r["method"] == "poisson"]
    holds, text, head = claims.recompute(once + stream, CFG)
    # streaming: the certificate now ranks the successes first -> recomputes request 2 (already right):
    # 50; confidence also picks request 2: 50; random 62.5 -> gain 50 - 62.5 = -12.5
    assert head["recompute_gain_points"] == pytest.approx(-12.5)
    assert holds is False and "poisson_stream @ 0.25" in text and "compressed once" in text


def test_the_sketch_rows_test_the_cluster_runs_by_hand():
    # the paper design's runs and the sketched design's runs of the same examples differ: the :cluster
    # rows must read the latter (recompute on them: certificate 75, as test_recompute_by_hand), the
    # plain rows the former (here the certificate ranks a success first: certificate 50)
    paper = _records([False, False, True, True], [0.1, 0.2, 0.9, 0.8], [0.1, 0.2, 0.9, 0.8], [True] * 4)
    cluster = [dict(r, method="poisson_cluster", cert=x) for r, x in
               zip([r for r in paper if r["method"] == "poisson"], [0.9, 0.8, 0.1, 0.2])]
    stream = [dict(r, method="poisson_stream") for r in paper if r["method"] == "poisson"]
    view = claims.sketch_view(paper + cluster + stream)
    assert {r["method"] for r in view} == {"poisson", "full"} and len(view) == 8
    assert sorted(r["cert"] for r in view if r["method"] == "poisson") == [0.1, 0.2, 0.8, 0.9]
    table, head = claims.run(paper + cluster, CFG)
    rows = {r["claim"]: r for r in table.rows}
    assert [r["claim"] for r in table.rows] == [c.key for c in claims.CLAIMS] + [
        k + ":cluster" for k in claims.SKETCH_CLAIMS]
    assert "certificate 75.0" in rows["recompute:cluster"]["measured"]
    assert "certificate 50.0" in rows["recompute"]["measured"]
    assert head["recompute_gain_points_cluster"] == pytest.approx(12.5)
    assert head["recompute_gain_points"] == pytest.approx(-12.5)
    # a second sketch: its own rows after the first's, each view holding its own runs only
    tilted = [dict(r, method="poisson_tilted", cert=x) for r, x in zip(cluster, [0.1, 0.2, 0.9, 0.8])]
    assert sorted(r["cert"] for r in claims.sketch_view(paper + cluster + tilted, "tilted")
                  if r["method"] == "poisson") == [0.1, 0.2, 0.8, 0.9]
    table, head = claims.run(paper + cluster + tilted, CFG)
    assert [r["claim"] for r in table.rows] == [c.key for c in claims.CLAIMS] + [
        f"{k}:{name}" for name in ("cluster", "tilted") for k in claims.SKETCH_CLAIMS]
    assert head["recompute_gain_points_tilted"] == pytest.approx(-12.5)
    assert head["recompute_gain_points_cluster"] == pytest.approx(12.5)
