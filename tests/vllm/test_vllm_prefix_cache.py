"""Prefix caching on (vLLM's default) with the plugin: plain requests use the cache as in stock vLLM; a
certified request reads it, compacts into blocks of its own, and feeds it the prompt blocks its compaction left
as computed (kvcert.vllm.scheduler, module docstring 4).

Prompts share a 4-block system prefix S (128 tokens) and differ in a 3-block suffix (+1 token: decoding 12
tokens stays in the last prompt block). The plugin's engine (compression 0 by default, prefix caching on, kept
positions reported) runs, one ``generate`` each: P0 = S + Q0 (plain), C1 = S + Q1 certified
(``kvcert_compression_ratio`` 0.5), P2 = S + Q2 (plain), P3 = S + Q1 (plain: the certified request's prompt
again), C4 = S + Q1 certified again. Stock vLLM with the same cache runs P0, P2, P3. A fresh plugin engine runs
F = S + Q1 certified on the empty cache, then R = S + Q1 plain.

- plain requests: the same greedy tokens as stock's, and the same prefix hits (``num_cached_tokens``: S's 128
  tokens for P2; P3 finds S and whatever C1 registered, none of C1's compacted blocks);
- C1 read S (128 cached tokens) and its compaction wrote blocks of its own: it evicted and certified as F did
  on the empty cache (the same kept positions, the same tokens, certificates equal to float32 rounding);
- C4 finds P3's 7 full blocks cached and reads 6 of them: its hit is cut to leave the event's 32 queries
  (the design's ``event_queries``) to compute, and it evicts and certifies as F did;
- F's compaction filled its last full prompt blocks first and left its first 7 - m as computed: after its
  event they were registered, and R finds exactly those and decodes stock's tokens;
- negative controls: a plugin whose compaction writes into the cached blocks it read (the worker's own blocks
  ignored), and one that registers a certified request's compacted blocks in the cache: the plain requests
  after C1 no longer decode stock's tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_support import BLOCK, MAX_TOKENS, model_path, run_engine

pytestmark = [pytest.mark.slow, pytest.mark.model]

S_BLOCKS, Q_BLOCKS = 4, 3
N_PROMPT = (S_BLOCKS + Q_BLOCKS) * BLOCK + 1
CERTIFY = {"kvcert_compression_ratio": 0.5}
ENGINE = {"enable_prefix_caching": True}
KVCERT = {"report_kept": True}
#: the plugin engine's runs in order, name -> prompt index (S + Q_i); stock runs the plain ones (P*) only
RUNS = {"P0": 0, "C1": 1, "P2": 2, "P3": 1, "C4": 1}
#: the fresh engine's
FRESH = {"F": 1, "R": 1}


def _prompt_ids() -> list[list[int]]:
    """[S + Q0, S + Q1, S + Q2]: S the first 4 blocks of one document, Q_i 3 blocks + 1 token of three others."""
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path())
    system = tok(f"You answer questions on Python.\n{topics['specialnames']}")["input_ids"][: S_BLOCKS * BLOCK]
    out = []
    for key in ("assert", "class", "for"):
        q = tok(f"\nQuestion on this text:\n{topics[key]}")["input_ids"][: Q_BLOCKS * BLOCK + 1]
        assert len(system) == S_BLOCKS * BLOCK and len(q) == Q_BLOCKS * BLOCK + 1
        out.append(system + q)
    return out


def _runs(names: dict, certified: bool = True) -> list[dict]:
    """One ``generate`` per name: P* and R plain, the others certified (left out with ``certified=False``)."""
    out = []
    for name, i in names.items():
        if name[0] in "PR":
            out.append({"order": [i], "max_tokens": MAX_TOKENS})
        elif certified:
            out.append({"order": [i], "max_tokens": MAX_TOKENS, "extra_args": [CERTIFY]})
    return out


def _outputs(result, names: dict, certified: bool = True) -> dict:
    """name -> output of each run (the plain ones only with ``certified=False``)."""
    names = [n for n in names if certified or n[0] in "PR"]
    return {n: next(iter(run["outputs"].values())) for n, run in zip(names, result["runs"], strict=True)}


def _plugin(prompts, patch=None) -> dict:
    return _outputs(run_engine(plugin=True, compression_ratio=0.0, prompt_ids=prompts, runs=_runs(RUNS),
                               kvcert=KVCERT, patch=patch, **ENGINE), RUNS)


@pytest.fixture(scope="module")
def prompts():
    return _prompt_ids()


@pytest.fixture(scope="module")
def stock(prompts):
    return _outputs(run_engine(plugin=False, prompt_ids=prompts, runs=_runs(RUNS, False), **ENGINE), RUNS, False)


@pytest.fixture(scope="module")
def plugin(prompts):
    return _plugin(prompts)


@pytest.fixture(scope="module")
def fresh(prompts):
    return _outputs(run_engine(plugin=True, compression_ratio=0.0, prompt_ids=prompts, runs=_runs(FRESH),
                               kvcert=KVCERT, **ENGINE), FRESH)


def _same_eviction(got: dict, want: dict) -> None:
    """``got`` evicted and certified as ``want``: the same kept positions in every layer and KV head, the same
    greedy tokens, and certificates equal to float32 rounding. The prompt's keys and values reach the two
    events through chunks of different lengths (a cached prefix is not recomputed), whose float32 sums are
    rounded in other orders where a kernel's blocking depends on the chunk's length: about 1e-7 of each value,
    through 30 layers. The bound, 1e-5 of the certificates' scale, is 100 times that; an eviction that differs
    in one token moves a certificate by about 1e-3 of it. (On the AMD EPYC this was written on, they were equal
    bit for bit.)"""
    assert got["report"]["kept_positions"] == want["report"]["kept_positions"]
    assert got["report"]["evicted"] == want["report"]["evicted"] > 0
    assert got["token_ids"] == want["token_ids"]
    a, b = np.asarray(got["certificates"]), np.asarray(want["certificates"])
    assert a.shape == b.shape == (MAX_TOKENS,) and a[0] == b[0] == 0.0 and (b[1:] > 0).all()
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_plain_requests_hit_the_cache_and_decode_as_stock(stock, plugin):
    prefix = S_BLOCKS * BLOCK
    assert [stock[p]["num_cached_tokens"] for p in ("P0", "P2", "P3")] == [0, prefix, prefix]
    # P3 (C1's prompt) finds S and the blocks C1 registered after its event, never a compacted one
    registered = plugin["C1"]["report"]["prefix_blocks_registered"]
    assert registered == max(0, S_BLOCKS + Q_BLOCKS - plugin["C1"]["report"]["m"] - S_BLOCKS)
    want_hits = {"P0": 0, "P2": prefix, "P3": prefix + registered * BLOCK}
    for p in want_hits:
        assert plugin[p]["num_cached_tokens"] == want_hits[p], p
        assert plugin[p]["token_ids"] == stock[p]["token_ids"], p
        assert plugin[p]["report"] is None, p  # plain: no eviction, no certificate


def test_a_certified_request_reads_the_cached_prefix_and_evicts_as_without_it(plugin, fresh):
    f, c1 = fresh["F"], plugin["C1"]
    assert f["num_cached_tokens"] == 0 and f["report"]["prefix_blocks_read"] == 0
    assert c1["num_cached_tokens"] == S_BLOCKS * BLOCK  # S, cached by P0
    assert c1["report"]["prefix_blocks_read"] == S_BLOCKS and c1["report"]["blocks_freed"] > 0
    _same_eviction(c1, f)


def test_a_certified_request_leaves_its_event_queries_to_compute(plugin, fresh):
    from kvcert.vllm.config import KVCertConfig

    w = KVCertConfig(compression_ratio=CERTIFY["kvcert_compression_ratio"]).design.event_queries(N_PROMPT, N_PROMPT)
    c4 = plugin["C4"]
    cut = (N_PROMPT - w) // BLOCK
    assert w == 32 and cut < S_BLOCKS + Q_BLOCKS  # P3 cached 7 full blocks; the cut takes fewer
    assert c4["num_cached_tokens"] == cut * BLOCK and c4["report"]["prefix_blocks_read"] == cut
    _same_eviction(c4, fresh["F"])


def test_a_certified_request_feeds_the_cache_the_blocks_its_compaction_left(fresh, stock):
    f, r = fresh["F"], fresh["R"]
    intact = S_BLOCKS + Q_BLOCKS - f["report"]["m"]
    assert intact > 0 and f["report"]["prefix_blocks_registered"] == intact
    assert r["num_cached_tokens"] == intact * BLOCK  # F's first blocks, none of its compacted ones
    assert r["token_ids"] == stock["P3"]["token_ids"]  # the same prompt on stock vLLM


@pytest.mark.parametrize("patch", ["compaction_writes_the_cached_prefix", "compacted_blocks_registered"])
def test_negative_control_certified_requests_writing_cached_blocks_corrupt_later_requests(prompts, stock, patch):
    got = _plugin(prompts, patch)
    assert got["C1"]["num_cached_tokens"] == S_BLOCKS * BLOCK and got["C1"]["report"]["evicted"] > 0
    assert any(got[p]["token_ids"] != stock[p]["token_ids"] for p in ("P2", "P3"))
