"""Prefix caching on (vLLM's default) with the plugin: plain requests use the cache as in stock vLLM; a
request that may evict neither reads nor feeds it (kvcert.vllm.scheduler, module docstring 4).

Prompts share a 4-block system prefix S (128 tokens) and differ in a 3-block suffix (+1 token: decoding 12
tokens stays in the last prompt block). The plugin's engine (compression 0 by default, prefix caching on)
runs, one ``generate`` each: P0 = S + Q0 (plain), C1 = S + Q1 certified (``kvcert_compression_ratio`` 0.5),
P2 = S + Q2 (plain), P3 = S + Q1 (plain: the certified request's prompt again). Stock vLLM with the same cache
runs P0, P2, P3: without C1, because a certified request adds nothing to the cache, so the plain requests
meet the same cache in both engines.

- plain requests: the same prefix hits (``num_cached_tokens``: S's 128 tokens for P2 and P3) and the same
  greedy tokens as stock's;
- the certified request read nothing from the cache (``num_cached_tokens`` 0, though S was cached), evicted,
  and has its certificates;
- P3 repeats C1's prompt after C1 compacted its blocks: it hits S only, never C1's blocks, and decodes
  stock's tokens;
- negative control: a plugin whose certified requests read and feed the cache (the scheduler's privacy off)
  lets C1's compaction overwrite cached blocks: the plain requests after it no longer decode stock's tokens.
"""

from __future__ import annotations

import pytest

from vllm_support import BLOCK, MAX_TOKENS, model_path, run_engine

pytestmark = [pytest.mark.slow, pytest.mark.model]

S_BLOCKS, Q_BLOCKS = 4, 3
CERTIFY = {"kvcert_compression_ratio": 0.5}
ENGINE = {"enable_prefix_caching": True}


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


def _runs(certified: bool) -> list[dict]:
    plain = [{"order": [0], "max_tokens": MAX_TOKENS}]
    if certified:
        plain.append({"order": [1], "max_tokens": MAX_TOKENS, "extra_args": [CERTIFY]})
    return plain + [{"order": [2], "max_tokens": MAX_TOKENS}, {"order": [1], "max_tokens": MAX_TOKENS}]


@pytest.fixture(scope="module")
def prompts():
    return _prompt_ids()


@pytest.fixture(scope="module")
def stock(prompts):
    return run_engine(plugin=False, prompt_ids=prompts, runs=_runs(False), **ENGINE)


@pytest.fixture(scope="module")
def plugin(prompts):
    return run_engine(plugin=True, compression_ratio=0.0, prompt_ids=prompts, runs=_runs(True), **ENGINE)


def _plain(result, certified: bool) -> dict:
    """name -> output of the plain requests P0, P2, P3."""
    runs = result["runs"]
    first, rest = runs[0], runs[2:] if certified else runs[1:]
    return {"P0": first["outputs"]["0"], "P2": rest[0]["outputs"]["2"], "P3": rest[1]["outputs"]["1"]}


def test_plain_requests_hit_the_cache_and_decode_as_stock(stock, plugin):
    want, got = _plain(stock, False), _plain(plugin, True)
    prefix = S_BLOCKS * BLOCK
    assert [want[p]["num_cached_tokens"] for p in ("P0", "P2", "P3")] == [0, prefix, prefix]
    for p in want:
        assert got[p]["num_cached_tokens"] == want[p]["num_cached_tokens"], p
        assert got[p]["token_ids"] == want[p]["token_ids"], p
        assert got[p]["report"] is None, p  # plain: no eviction, no certificate


def test_a_certified_request_neither_reads_nor_feeds_the_cache(plugin):
    c1 = plugin["runs"][1]["outputs"]["1"]
    assert c1["num_cached_tokens"] == 0  # S was cached by P0, and not read
    rep = c1["report"]
    assert rep is not None and rep["evicted"] > 0 and rep["blocks_freed"] > 0
    assert len(c1["certificates"]) == MAX_TOKENS and c1["certificates"][0] == 0.0
    assert all(c > 0 for c in c1["certificates"][1:])
    # the same prompt afterwards, plain: only S's blocks are found (C1's compacted blocks were never cached)
    assert plugin["runs"][3]["outputs"]["1"]["num_cached_tokens"] == S_BLOCKS * BLOCK


def test_negative_control_certified_requests_in_the_cache_corrupt_later_requests(prompts, stock):
    broken = run_engine(plugin=True, compression_ratio=0.0, prompt_ids=prompts, runs=_runs(True),
                        patch="evicting_requests_share_the_prefix_cache", **ENGINE)
    c1 = broken["runs"][1]["outputs"]["1"]
    assert c1["num_cached_tokens"] == S_BLOCKS * BLOCK and c1["report"]["evicted"] > 0  # read S, then compacted
    want, got = _plain(stock, False), _plain(broken, True)
    assert any(got[p]["token_ids"] != want[p]["token_ids"] for p in ("P2", "P3"))
