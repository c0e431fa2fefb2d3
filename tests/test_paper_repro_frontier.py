"""Table 6 (paper_repro/frontier.py): T3's runs on one accuracy-against-cost frontier, escalation on the
certificate against the best baseline at its cost. Made-up records shaped as paper_repro.suites.collect writes
them; no model."""

import numpy as np
import pytest

from paper_repro import frontier as F
from paper_repro.common import Config


def _records(signal: str, n=40):
    """2 tasks x n examples: the full cache always right; every design and SnapKV right on exactly 50% / 75% of
    the examples at budget 0.25 / 0.5 (the same examples); the certificate score largest on the wrong answers
    (signal "informs"), on the right ones ("misleads"); plus a streaming run and a kvpress press."""
    recs = []
    for task in ("a", "b"):
        for i in range(n):
            base = dict(protocol="query-aware", task=task, example=i, conf=0.0, cert_median=0.0)
            recs.append(dict(base, method="full", budget=1.0, correct=True, cert=float("nan")))
            u = (i + 0.5) / n
            for b, rate in ((0.25, 0.5), (0.5, 0.75)):
                ok = u < rate
                cert = (1.0 - u) if (signal == "informs") == (not ok) else u - 1.0
                for m in ("poisson", "poisson_tilted", "poisson_cluster", "snapkv", "kvpress:knorm"):
                    recs.append(dict(base, method=m, budget=b, correct=ok, cert=cert if m.startswith("poisson")
                                     else float("nan")))
            recs.append(dict(base, method="poisson_stream", budget=0.25, correct=False, cert=0.0))
    return recs


def test_escalation_on_an_informative_certificate_beats_the_frontier_and_a_misleading_one_does_not():
    cfg = Config(quick=True, progress=False)
    t = F.table(_records("informs"), cfg)
    rows = {r["policy"]: r for r in t.rows}
    # every T3 method but the streaming run is on the frontier; kvpress's presses as their own family
    assert {r["family"] for r in t.rows} == {"full", "fixed", "fixed-tilted", "fixed-cluster", "snapkv",
                                             "kvpress:knorm", "escalation"}
    esc = rows["escalate fixed 0.5->full"]
    # the 25% escalated are exactly the 25% wrong: all right, at the cost of both runs
    assert esc["accuracy"] == pytest.approx(1.0) and esc["cost"] == pytest.approx(0.5 + 0.25)
    # the best baseline at cost 0.75: halfway between its 0.5 point (0.75 right) and the full cache (1.0)
    assert esc["baseline_accuracy"] == pytest.approx(0.875) and esc["diff"] == pytest.approx(0.125)
    assert esc["diff_ci_low"] > 0
    assert any("escalate fixed 0.5->full" in n for n in t.notes)
    # baselines carry no difference
    assert rows["snapkv 0.25"].get("diff") is None and rows["fixed 0.5"]["accuracy"] == pytest.approx(0.75)
    # from 0.25 to the next budget: the escalated quarter (wrong at 0.25, u in [0.5, 0.75)) is right at 0.5
    nxt = rows["escalate fixed 0.25->0.5"]
    assert nxt["cost"] == pytest.approx(0.25 + 0.25 * 0.5) and nxt["accuracy"] == pytest.approx(0.75)
    # negative control: a certificate that flags the right answers re-runs answers that were right already
    bad = {r["policy"]: r for r in F.table(_records("misleads"), cfg).rows}["escalate fixed 0.5->full"]
    assert bad["accuracy"] == pytest.approx(0.75) and bad["diff"] == pytest.approx(-0.125)
    assert bad["diff_ci_high"] < 0
    assert "| escalate fixed 0.5->full | escalation |" in t.markdown()


def test_points_are_per_example_means():
    pts, families, keys = F.suite_points(_records("informs", n=4))
    assert len(keys) == 8
    assert set(families) == {"fixed", "fixed-tilted", "fixed-cluster", "snapkv", "kvpress:knorm"}
    assert all(families[f][-1].family == "full" for f in families)
    for p in pts:
        assert p.correct.shape == (8,) and np.isfinite(p.correct).all() and np.isfinite(p.cost).all()
