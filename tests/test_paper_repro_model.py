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
    # the deterministic runs agree to float rounding (Poisson draws are keyed by the batch row), so the
    # runs alone are the deterministic ones only (the full cache and SnapKV)
    alone = suites.collect(Config(quick=True, budgets=(0.25,), progress=False, suite_examples=2, suite_context=200,
                                  suite_batch=1, kvpress=(), protocols=("query-aware",)), model, tokenizer,
                           methods=lambda ratio, seed: [("snapkv", kvcert.SnapKVPress(compression_ratio=ratio))])
    assert {r["method"] for r in alone} == {"full", "snapkv"} and len(alone) == 2 * len(suites.QUICK_TASKS) * 2
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
        # a silent error is a miss: per cell, silent draws are a subset of the uncovered ones
        assert 0.0 <= row["silent"] <= 1.0 - row["coverage"] + 1e-12
        if budget == 1.0:  # every block kept with pi = 1: exact attention (float32)
            assert row["mean_relative_error"] < 1e-5
        else:
            assert row["mean_relative_error"] > 1e-3
        if design == "token":  # its own error over itself; undefined where the token design is exact
            assert row["error_ratio"] == 1.0 if budget < 1.0 else np.isnan(row["error_ratio"])


def test_served_replay_tiny(captured):
    """T2d's served token design on 3 layers: its rows, memory >= kept fraction, the equal-memory
    bisection within its tolerance, and the token design's estimate read from the compacted slots."""
    from paper_repro import replay_blocks as RB
    from paper_repro.replay import layer_importance
    from paper_repro.synthetic_coverage import draw_estimates

    _, _, full, _, _ = captured
    cap = Captured(full.queries[:3], full.keys[:3], full.values[:3], full.scaling)
    budgets = (0.25, 0.5)
    cfg = Config(quick=True, context=256, budgets=budgets, progress=False)
    t2d = RB.run(cfg, cap, designs=("token", "served16", "served64"), draws=8)
    rows = {(r["budget"], r["design"], r.get("delta")): r for r in t2d.rows}
    assert set(rows) == {(b, n, dl) for b in budgets for n in ("token", "served16", "served64") for dl in cfg.deltas
                         if (b, n) != (0.25, "served64")} | {(0.25, "served64", None)}
    for (budget, design, _), row in rows.items():
        if (budget, design) == (0.25, "served64"):
            # 4 blocks of 64; the 36 certain tokens need one, which with the log pi buffer is
            # 0.25 (1 + 1/128) > 0.25 + MEMORY_TOL: the row says so
            assert row["cells"] == 0 and "exceeds the target" in row["note"]
            continue
        assert row["cells"] == 3 * cap.queries[0].shape[0] * 4
        assert 0.0 <= row["worst_decile"] <= row["coverage"] <= 1.0
        assert 0.0 <= row["silent"] <= 1.0 - row["coverage"] + 1e-12
        if design.startswith("served"):
            assert abs(row["memory_expected"] - budget) <= RB.MEMORY_TOL   # the bisection's stated tolerance
            assert row["expected_kept"] < budget                           # padding costs kept tokens
            assert row["memory"] >= row["expected_kept"]                   # padding can only add
            assert row["memory_max"] >= row["memory"]
            assert row["error_ratio"] > 0 and np.isfinite(row["error_ratio"])

    # per draw: Compaction.memory >= the largest head's kept fraction >= the mean kept fraction; and the
    # exact expected memory (served_memory) is the Monte Carlo mean within 4 standard errors
    L, Fut, d = 256, 32, cap.keys[0].shape[-1]
    T = L + Fut
    imp = torch.stack([torch.from_numpy(layer_importance("snapkv", cap.queries[layer][:, :T], cap.keys[layer][:, :T],
                                                          cap.values[layer][:, :T], L, cap.scaling, seed=layer))
                       for layer in range(3)])
    f = rows[0.5, "served64", 0.05]["expected_kept"]
    pi = RB.token_pi(imp, f)
    rng = np.random.default_rng(1)
    keep = torch.from_numpy(rng.random((400, *pi.shape))) < pi
    mem = np.array([kvcert.fast.compact_slots(kk, pi, 64).memory(d, d) for kk in keep])
    largest = keep.sum(-1).flatten(1).max(-1).values.numpy() / L
    assert np.all(mem >= largest) and np.all(largest >= keep.double().mean((1, 2, 3)).numpy())
    exact = RB.served_memory(pi, 64, d, d)
    assert abs(mem.mean() - exact) <= 4 * mem.std(ddof=1) / np.sqrt(mem.size), (mem.mean(), exact)

    # the served estimate (compacted slots, -inf padding, later tokens after) is the token design's
    # estimate on the same keep mask (draw_estimates, Table 2's path)
    qpos = torch.tensor([L, L + 10, L + 20, L + 31])
    g = cap.group
    comps = [kvcert.fast.compact_slots(kk, pi, 16) for kk in keep[:16]]
    S = max(c.positions.shape[-1] for c in comps)
    for layer, h in ((0, 0), (2, 1)):
        pos = torch.stack([torch.nn.functional.pad(c.positions[layer, h], (0, S - c.positions.shape[-1]), value=-1)
                           for c in comps])
        lp = torch.stack([torch.nn.functional.pad(c.log_pi[layer, h], (0, S - c.log_pi.shape[-1]),
                                                  value=float("-inf")) for c in comps]).float()
        q = cap.queries[layer][h * g:(h + 1) * g, :T][:, qpos]
        k, v = cap.keys[layer][h, :T], cap.values[layer][h, :T]
        served = RB.served_estimates(q, k, v, pos, lp, L, qpos, cap.scaling, (RB.KIND,))
        p = pi[layer, h].float()
        kp = keep[:16, layer, h]
        token = draw_estimates(q, k, v, torch.cat([torch.where(kp, p, 0.0), torch.ones(16, Fut)], 1), qpos,
                               cap.scaling, (RB.KIND,))
        # float32 sums over the same terms in another order (padding between, pi from log pi): measured
        # <= 4.1 eps32 max|o| on these cells (0.1 / 0.25 / 0.5, every head); allowed 8
        eps = torch.finfo(torch.float32).eps
        gap = (served.output - token.output).abs().max()
        assert gap <= 8 * eps * token.output.abs().max(), gap
        # the trace sums (1 - pi) a_i^2 ||v_i - o_hat||^2 from moments, so its rounding scales with the
        # uncancelled terms <= sum a_i^2 (2 max ||v||)^2 = 4 max ||v||^2 / n_eff: measured <= 0.4 eps32
        # of that; allowed 2
        scale = 4 * v.norm(dim=-1).max() ** 2 / token.n_eff
        trace_gap = ((served.trace - token.trace).abs() / (eps * scale)).max()
        assert trace_gap <= 2, trace_gap
        # negative control: without the -log pi offset the served slots give another estimate
        plain = RB.served_estimates(q, k, v, pos, torch.where(torch.isfinite(lp), 0.0, lp), L, qpos, cap.scaling,
                                    (RB.KIND,))
        assert (plain.output - token.output).abs().max() > 100 * gap


def test_max_count_cdf_by_enumeration():
    """P(max_h C_h <= c) of independent Poisson designs equals the enumeration of all 2^(H n) samples."""
    import itertools

    from paper_repro.replay_blocks import max_count_cdf

    pi = torch.tensor([[0.3, 1.0, 0.7, 0.05, 0.0], [0.5, 0.9, 1.0, 1.0, 0.2]], dtype=torch.float64)
    H, n = pi.shape
    want = np.zeros(n + 1)
    for bits in itertools.product((0, 1), repeat=H * n):
        keep = torch.tensor(bits, dtype=torch.float64).reshape(H, n)
        prob = float(torch.where(keep > 0, pi, 1 - pi).prod())
        want[int(keep.sum(-1).max()):] += prob
    np.testing.assert_allclose(max_count_cdf(pi).numpy(), want, rtol=0, atol=1e-12)


def test_block_design_pi_budget_and_certainty():
    from paper_repro.replay_blocks import block_design_pi

    g = torch.Generator().manual_seed(0)
    u = torch.rand(2, 3, 512, generator=g, dtype=torch.float64)
    pib = block_design_pi(u, 0.25, 16, "mean")                  # 32 blocks, budget 8 blocks
    assert pib.shape == (32,) and float(pib.sum()) == pytest.approx(8.0)
    assert pib[0] == 1.0 and pib[-1] == 1.0 and pib[-2] == 1.0  # sink block, two recent blocks
    with pytest.raises(ValueError, match="cannot hold the sink and recent blocks"):
        block_design_pi(u, 0.25, 128, "mean")                   # 1 block of budget
