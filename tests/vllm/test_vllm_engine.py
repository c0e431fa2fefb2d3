"""End-to-end tests of kvcert.vllm on the default model (SmolLM2-135M, CPU).

Four engines, each started once for the module in the session's engine driver of its kind
(vllm_support.run_engine; 10-20 s each on 2 cores):
stock vLLM without any plugin, the plugin at compression 0, the plugin at
compression 0.5 freeing blocks into a 20-block pool (so freed blocks are
handed to other running requests), and the same design in mask-only mode
(nothing freed). Prompts are 32 k + 1 tokens long and decode 12 tokens, so a
running request never needs a new block: no preemption can blur the
comparisons (checked through the scheduler's counters).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_support import MAX_TOKENS, PROMPT_BLOCKS, prompts, run_engine

pytestmark = [pytest.mark.slow, pytest.mark.model]

N = len(PROMPT_BLOCKS)
ALL = list(range(N))
#: the pool of the eviction runs: two prompts fit, a third only with freed blocks
POOL = 20
DESIGN = {"granularity": "block", "sink_blocks": 1, "recent_blocks": 1}


@pytest.fixture(scope="module")
def stock():
    return run_engine(plugin=False, runs=[{"order": ALL, "max_tokens": MAX_TOKENS}])


@pytest.fixture(scope="module")
def plugin_off():
    return run_engine(plugin=True, compression_ratio=0.0, runs=[{"order": ALL, "max_tokens": MAX_TOKENS}])


@pytest.fixture(scope="module")
def freeing():
    # run 0: all prompts; run 1: reversed order; run 2: two prompts alone (other batches)
    return run_engine(plugin=True, compression_ratio=0.5, seed=3, kvcert=DESIGN, num_gpu_blocks_override=POOL,
                      runs=[{"order": ALL, "max_tokens": MAX_TOKENS},
                            {"order": ALL[::-1], "max_tokens": MAX_TOKENS},
                            {"order": [5, 2], "max_tokens": MAX_TOKENS}])


@pytest.fixture(scope="module")
def mask_only():
    return run_engine(plugin=True, compression_ratio=0.5, seed=3, kvcert={**DESIGN, "free_blocks": False},
                      num_gpu_blocks_override=POOL, runs=[{"order": ALL, "max_tokens": MAX_TOKENS}])


def _tokens(result, run=0):
    return {int(i): o["token_ids"] for i, o in result["runs"][run]["outputs"].items()}


def _diff(a, b):
    bad = [i for i in sorted(a) if a[i] != b[i]]
    return "; ".join(f"prompt {i}: {a[i]} vs {b[i]}" for i in bad[:3])


def test_compression_zero_is_stock_vllm(stock, plugin_off):
    a, b = _tokens(stock), _tokens(plugin_off)
    assert all(len(t) == MAX_TOKENS for t in a.values())
    assert a == b, _diff(a, b)
    for o in plugin_off["runs"][0]["outputs"].values():
        assert o["certificates"] is None and o["report"] is None
    assert plugin_off["blocks_freed"] == 0


def test_eviction_happens_and_frees_exactly_the_evicted_blocks(freeing):
    total = 0
    for run in freeing["runs"]:
        for i, o in run["outputs"].items():
            rep = o["report"]
            assert rep is not None, f"prompt {i} was not decided"
            n_blocks = len(rep["pi"])
            assert n_blocks == math.ceil(len(prompts()[int(i)]) / 32)
            assert rep["evicted"] == [j for j, k in enumerate(rep["kept"]) if not k]
            assert rep["blocks_freed"] == len(rep["evicted"])
            assert rep["free_after"] - rep["free_before"] == len(rep["evicted"])
            # the certainty set (first and last block) is never evicted; pi sums to the budget
            assert rep["kept"][0] and rep["kept"][-1] and rep["pi"][0] == 1.0 and rep["pi"][-1] == 1.0
            assert sum(rep["pi"]) == pytest.approx(0.5 * n_blocks, rel=1e-9)
            total += len(rep["evicted"])
    assert total > 0
    assert freeing["blocks_freed"] == total == freeing["stats"]["blocks_freed"]
    assert freeing["stats"].get("evicted_requests_preempted", 0) == 0


def test_freed_blocks_are_reused_by_running_requests(freeing):
    # the negative control of issue 12: without the mask these reused blocks garble the owners' outputs
    assert freeing["stats"]["blocks_reused_while_owner_runs"] > 0


def test_eviction_equals_mask_only_run(freeing, mask_only):
    a, b = _tokens(freeing), _tokens(mask_only)
    assert a == b, _diff(a, b)
    for i, o in mask_only["runs"][0]["outputs"].items():
        rep = o["report"]
        assert rep["blocks_freed"] == 0 and rep["free_after"] == rep["free_before"]
        assert rep["kept"] == freeing["runs"][0]["outputs"][i]["report"]["kept"]
        np.testing.assert_allclose(o["certificates"], freeing["runs"][0]["outputs"][i]["certificates"],
                                   rtol=1e-6, atol=0)
    assert mask_only["blocks_freed"] == 0
    assert mask_only["stats"]["blocks_evicted"] > 0


def test_same_seed_same_blocks_whatever_the_batch(freeing):
    runs = freeing["runs"]
    first = runs[0]["outputs"]
    for run in runs[1:]:
        for i, o in run["outputs"].items():
            assert o["report"]["kept"] == first[i]["report"]["kept"], f"prompt {i}"
            np.testing.assert_allclose(o["report"]["pi"], first[i]["report"]["pi"], rtol=1e-6)
            assert o["token_ids"] == first[i]["token_ids"], f"prompt {i}"
    # different prompts draw different streams (prompt-keyed events): not all samples alike
    kept = {tuple(o["report"]["kept"][1:-1]) for o in first.values()}
    assert len(kept) > 1


def test_certificates_reach_the_caller(freeing):
    some_positive = False
    for i, o in freeing["runs"][0]["outputs"].items():
        rep, c = o["report"], o["certificates"]
        if not rep["evicted"]:
            assert c is None
            continue
        c = np.asarray(c)
        assert c.shape == (MAX_TOKENS,) and np.isfinite(c).all() and (c >= 0).all()
        assert c[0] == 0.0  # the first token comes from the full prompt cache
        sampled_kept = [j for j, (k, p) in enumerate(zip(rep["kept"], rep["pi"])) if k and p < 1]
        if sampled_kept:  # a kept sampled block: positive design variance at every decode step
            assert (c[1:] > 0).all(), (i, c)
            some_positive = True
        else:  # only the certainty set is left: the variance estimate is 0 (see docs/serving.md)
            assert (c[1:] == 0).all()
    assert some_positive


def test_a_failed_engine_leaves_the_driver_serving(plugin_off):
    """The engines of a kind share one driver process (vllm_support.run_engine): an engine that fails to start
    is reported to its caller with the engine's error, and the next engine of that driver still runs and
    reproduces an earlier engine's tokens."""
    with pytest.raises(RuntimeError, match="granularity"):
        run_engine(plugin=True, compression_ratio=0.5, kvcert={"granularity": "page"},
                   runs=[{"order": [0], "max_tokens": 2}])
    again = run_engine(plugin=True, compression_ratio=0.0, runs=[{"order": [0, 3], "max_tokens": MAX_TOKENS}])
    assert _tokens(again) == {i: t for i, t in _tokens(plugin_off).items() if i in (0, 3)}


@pytest.fixture(scope="module")
def bfloat16():
    # the default design (token design, tilted sketch) on a bfloat16 model: cache, queries and outputs in bfloat16
    return run_engine(plugin=True, compression_ratio=0.5, seed=3, dtype="bfloat16",
                      runs=[{"order": ALL[:4], "max_tokens": MAX_TOKENS}])


def test_a_bfloat16_model_is_served_with_eviction_and_certificates(bfloat16):
    """dtype="bfloat16" is served (the routes' numbers on bfloat16 caches are checked against their float32
    upcast and float64 in test_vllm_compaction.py): every request evicts, frees blocks, decodes its tokens and
    gets a finite positive certificate at every step after the first (which reads the full prompt)."""
    assert bfloat16["blocks_freed"] > 0
    for i, o in bfloat16["runs"][0]["outputs"].items():
        c = np.asarray(o["certificates"], dtype=float)
        assert len(o["token_ids"]) == MAX_TOKENS and c.shape == (MAX_TOKENS,), i
        assert np.isfinite(c).all() and c[0] == 0.0 and (c[1:] > 0).all(), (i, c)

