"""The real-model parts of paper_repro: capture of q/k/v and the T2 replay (small sizes)."""

import numpy as np
import pytest
import torch
from model_fixtures import smollm2  # noqa: F401
import kvcert.fast
import kvcert.reference

from paper_repro import replay
from paper_repro.common import Config
from paper_repro.realmodel import Captured, capture, haystack_ids

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def captured(smollm2):  # noqa: F811
    model, tokenizer = smollm2
    ids = haystack_ids(tokenizer, 256 + 32, seed=0)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    cap = capture(model, ids)
    with torch.no_grad():
        after = model(input_ids=ids, use_cache=False).logits
    return model, ids, cap, plain, after


def test_capture_leaves_the_model_unchanged(captured):
    model, ids, cap, plain, after = captured
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(after, plain, rtol=0, atol=0)
    cfg = model.config
    assert cap.layers == cfg.num_hidden_layers
    assert cap.queries[0].shape == (cfg.num_attention_heads, ids.shape[1], cfg.head_dim)
    assert cap.keys[0].shape == (cfg.num_key_value_heads, ids.shape[1], cfg.head_dim)
    assert cap.scaling == pytest.approx(cfg.head_dim ** -0.5)


def test_replay_tiny(captured):
    _, _, full, _, _ = captured
    cap = Captured(full.queries[:3], full.keys[:3], full.values[:3], full.scaling)  # 3 layers: quick
    cfg = Config(quick=True, context=256, budgets=(0.5,), progress=False)
    t2, t2b, t2c, raw = replay.run(cfg, cap)
    cells = raw["cells"][0.5, "paper"]
    # layers x 9 query heads x 4 future query positions
    assert len(cells) == 3 * cap.queries[0].shape[0] * 4
    for row in t2.rows:
        assert 0.0 <= row["worst_decile"] <= row["coverage"] <= 1.0
    # quick mode leaves chi2 (a dv x dv covariance per draw and query) to T2a and --full, and says so
    kinds = {row["kind"] for row in t2.rows}
    assert kinds == set(kvcert.reference.KINDS) - set(replay.QUICK_SKIPS) and "chi2" not in kinds
    assert any("leaves out chi2" in note for note in t2.notes)
    methods = {r["method"] for r in t2b.rows}
    assert {"poisson_paper", *kvcert.fast.SCORERS} <= methods
    # Hajek with every token certain would be exact: the realized errors here are positive but
    # finite, and the radius is 0 only where the error is 0 (certain cells)
    err, radius, _ = cells[0]
    assert np.all(np.isfinite(err)) and np.all(np.isfinite(radius["chebyshev", 0.05]))


def test_impossibility_on_real_caches(captured):
    from paper_repro import impossibility

    _, _, cap, _, _ = captured
    cfg = Config(quick=True, context=256, draws=20, progress=False)
    t1b = impossibility.run_real(cfg, cap)
    policies = impossibility._policies()  # the registered scorers that read no values
    assert len(t1b.rows) == len(impossibility.REAL_CACHES) * len(impossibility.TARGETS) * len(policies)
    for r in t1b.rows:
        assert r["retained_change"] == 0.0 and r["policy_radius"] == 0.0  # bit-identical retained state
        assert r["policy_error_after"] == pytest.approx(r["target_error"], rel=1e-9)
        assert 0.0 <= r["poisson_coverage_after"] <= 1.0
        # the randomized certificate sees the attack: its radius grows with the target
    big = [r for r in t1b.rows if r["target_error"] == max(impossibility.TARGETS)]
    assert all(r["poisson_radius_after"] > r["poisson_radius_before"] for r in big)


def test_suites_tiny(smollm2):  # noqa: F811
    from paper_repro import claims, suites

    model, tokenizer = smollm2
    cfg = Config(quick=True, budgets=(0.25, 0.5), progress=False, suite_examples=2, suite_context=200,
                 suite_batch=2, protocols=("query-aware", "query-agnostic"), kvpress=())
    records = suites.collect(cfg, model, tokenizer)
    aware = [r for r in records if r["protocol"] == "query-aware"]
    agnostic = [r for r in records if r["protocol"] == "query-agnostic"]
    # per example: one full run, one Poisson, one sketched Poisson and one SnapKV run per budget;
    # query-aware adds a streaming run
    per_example = 1 + (2 + len(suites.SKETCHES)) * len(cfg.budgets)
    assert len(aware) == len(suites.QUICK_TASKS) * cfg.suite_examples * (per_example + 1)
    assert len(agnostic) == len(suites.QUICK_TASKS) * cfg.suite_examples * per_example
    assert sum(r["method"] == "poisson_stream" for r in records) == len(suites.QUICK_TASKS) * cfg.suite_examples
    assert {(r["task"], r["example"]) for r in aware} == {(t, i) for t in suites.QUICK_TASKS for i in range(2)}
    t3 = suites.table(records, cfg)
    assert [(r["protocol"], r["task"]) for r in t3.rows] == [
        (p, t) for p in cfg.protocols for t in suites.QUICK_TASKS for _ in cfg.budgets]
    for r in t3.rows:
        assert r["examples"] == 2 and r["failures"] == round((1 - r["acc_poisson"]) * r["examples"])
        assert all(0.0 <= r[k] <= 1.0 for k in ("acc_full", "acc_poisson", "acc_snapkv", "acc_poisson_cluster",
                                                 "acc_poisson_tilted"))
        assert np.isnan(r["acc_poisson_streaming"]) == (r["budget"] != suites.STREAM_BUDGET
                                                        or r["protocol"] != "query-aware")
    for r in records:
        assert np.isfinite(r["conf"])
        # the full cache records no certificate; SnapKV's kept tokens have pi = 1, so its radius is 0
        assert np.isnan(r["cert"]) == (r["method"] == "full")
        assert np.isnan(r["cert_median"]) == (r["method"] == "full")   # the median of the same radii
        if r["method"] == "snapkv":
            assert r["cert"] == 0.0 and r["cert_median"] == 0.0
        if r["method"] in ("poisson_cluster", "poisson_tilted"):  # evicted tokens: the sketch's variance is > 0
            assert r["cert"] > 0.0
    # a batch of two gives each example the runs it gets alone (rows mapped back to their examples):
    # the deterministic runs agree to float rounding (Poisson draws are keyed by the batch row)
    alone = suites.collect(Config(quick=True, budgets=(0.25,), progress=False, suite_examples=2, suite_context=200,
                                  suite_batch=1, kvpress=()), model, tokenizer)
    together = {(r["task"], r["example"], r["method"], r["budget"]): r for r in aware}
    for r in alone:
        if r["method"] in ("full", "snapkv"):
            t = together[r["task"], r["example"], r["method"], r["budget"]]
            assert t["correct"] == r["correct"] and abs(t["conf"] - r["conf"]) < 1e-3
    t4, headline = claims.run(records, cfg)
    assert [(r["protocol"], r["claim"]) for r in t4.rows] == [
        (p, key) for p in cfg.protocols
        for key in [c.key for c in claims.CLAIMS] + [f"{k}:{name}" for name in suites.SKETCHES
                                                     for k in claims.SKETCH_CLAIMS]]
    assert {r["holds_here"] for r in t4.rows} <= {"yes", "no", "not testable"}
    assert "recompute_gain_points" in headline


def test_auc():
    from paper_repro.suites import auc

    assert auc([3, 2, 1, 0], [True, True, False, False]) == 1.0
    assert auc([0, 1, 2, 3], [True, True, False, False]) == 0.0
    assert auc([1, 1], [True, False]) == 0.5
    assert np.isnan(auc([1, 2], [True, True]))


def test_block_replay_tiny(captured):
    """T2d on 3 layers: equal expected memory, the exact estimate when every block is kept, and a
    row naming why a design cannot run."""
    from paper_repro import replay_blocks

    _, _, full, _, _ = captured
    cap = Captured(full.queries[:3], full.keys[:3], full.values[:3], full.scaling)
    cfg = Config(quick=True, context=256, budgets=(0.5, 1.0), progress=False)
    t2d = replay_blocks.run(cfg, cap, designs=("token", "block16_mean", "block128_mean"), draws=16)
    rows = {(r["budget"], r["design"], r.get("delta")): r for r in t2d.rows}
    for (budget, design, delta), row in rows.items():
        if design == "block128_mean":  # 256 tokens = 2 blocks: no room beside the sink and recent block
            assert row["cells"] == 0 and "cannot hold" in row["note"]
            continue
        assert row["cells"] == 3 * cap.queries[0].shape[0] * 4
        assert row["expected_kept"] == pytest.approx(budget, abs=1e-6)  # equal expected memory
        assert 0.0 <= row["worst_decile"] <= row["coverage"] <= 1.0
        if budget == 1.0:  # every block kept with pi = 1: exact attention (float32)
            assert row["mean_relative_error"] < 1e-5
        else:
            assert row["mean_relative_error"] > 1e-3


def test_block_design_pi_budget_and_certainty():
    from paper_repro.replay_blocks import block_design_pi

    g = torch.Generator().manual_seed(0)
    u = torch.rand(2, 3, 512, generator=g, dtype=torch.float64)
    pib = block_design_pi(u, 0.25, 16, "mean")                  # 32 blocks, budget 8 blocks
    assert pib.shape == (32,) and float(pib.sum()) == pytest.approx(8.0)
    assert pib[0] == 1.0 and pib[-1] == 1.0 and pib[-2] == 1.0  # sink block, two recent blocks
    with pytest.raises(ValueError, match="cannot hold the sink and recent blocks"):
        block_design_pi(u, 0.25, 128, "mean")                   # 1 block of budget
