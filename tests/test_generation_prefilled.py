"""A shared exact prefill (``kvcert.prefill``) gives the same generation as a
fresh one, for every press, on the real model.

The prefill is exact attention under every press, so ``generate(...,
prefilled=state)`` must reproduce ``generate(...)`` exactly: same tokens,
log-probabilities and certificates (bitwise: the same tensors go through the
same operations).
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import long_prompt, smollm2  # noqa: F401

import kvcert

PROMPT = long_prompt(600)
PROMPTS = [long_prompt(600), long_prompt(300)]  # left padding in the batch
NEW = 6


def _same(a, b):
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    rows_a, rows_b = a.rows(), b.rows()
    for ra, rb in zip(rows_a, rows_b):
        assert torch.equal(ra.logprobs, rb.logprobs)
        assert torch.equal(ra.margins, rb.margins) and ra.margins.shape == ra.logprobs.shape
        if ra.certificates is None:
            assert rb.certificates is None
            continue
        for f in ("radius", "relative_radius", "trace", "kept"):
            assert torch.equal(getattr(ra.certificates, f), getattr(rb.certificates, f)), f


PRESSES = [
    lambda: kvcert.PoissonPress(compression_ratio=0.5, seed=3),
    lambda: kvcert.PoissonPress(compression_ratio=0.7, seed=1, scorer="tova", kind="wald"),
    lambda: kvcert.PoissonPress(compression_ratio=0.6, seed=4, scorer="expected", kind="chebyshev_ucb"),
    lambda: kvcert.DecodingPress(kvcert.PoissonPress(target_size=60, seed=2), compression_interval=2),
    lambda: kvcert.SnapKVPress(compression_ratio=0.5),
    lambda: kvcert.StreamingLLMPress(compression_ratio=0.6),
    lambda: kvcert.KNormPress(compression_ratio=0.5),
]


@pytest.mark.parametrize("make", PRESSES, ids=["poisson", "poisson-tova-wald", "poisson-expected-ucb",
                                              "poisson-interval", "snapkv", "streaming", "knorm"])
def test_shared_prefill_equals_fresh_generation(smollm2, make):  # noqa: F811
    model, tok = smollm2
    state = kvcert.prefill(model, tok, PROMPT)
    fresh = kvcert.generate(model, tok, PROMPT, press=make(), max_new_tokens=NEW)
    shared = kvcert.generate(model, tok, PROMPT, press=make(), max_new_tokens=NEW, prefilled=state)
    _same(fresh, shared)
    again = kvcert.generate(model, tok, PROMPT, press=make(), max_new_tokens=NEW, prefilled=state)
    _same(fresh, again)  # the prefill is copied, never consumed


def test_shared_prefill_batch_with_padding_and_no_press(smollm2):  # noqa: F811
    model, tok = smollm2
    state = kvcert.prefill(model, tok, PROMPTS)
    for press in (kvcert.PoissonPress(compression_ratio=0.5, seed=0), None):
        fresh = kvcert.generate(model, tok, PROMPTS, press=press, max_new_tokens=NEW)
        shared = kvcert.generate(model, tok, PROMPTS, press=press, max_new_tokens=NEW, prefilled=state)
        _same(fresh, shared)


def _held(cache):
    """Every tensor the prefill's layers hold, cloned, by (layer, attribute)."""
    return {(i, k): v.clone() for i, layer in enumerate(cache.layers) for k, v in vars(layer).items()
            if isinstance(v, torch.Tensor)}


def test_runs_share_the_prefill_tensors_without_writing_into_them(smollm2):  # noqa: F811
    # the copy a run starts from shares the prefill's tensors (no deep copy of K and V): every
    # kind of run (compressing, decode-time compression, no press) must leave them bit-identical
    model, tok = smollm2
    state = kvcert.prefill(model, tok, PROMPTS)
    before = _held(state.cache)
    assert before, "the prefill holds no tensors"
    presses = [None, kvcert.PoissonPress(compression_ratio=0.5, seed=0), kvcert.SnapKVPress(compression_ratio=0.5),
               kvcert.DecodingPress(kvcert.PoissonPress(target_size=60, seed=2), compression_interval=2)]
    first = [kvcert.generate(model, tok, PROMPTS, press=p, max_new_tokens=NEW, prefilled=state) for p in presses]
    after = _held(state.cache)
    assert after.keys() == before.keys()
    for key, x in before.items():
        assert torch.equal(x, after[key]), key
    # and a second round from the same state gives the same generations
    for p, r in zip(presses, first):
        _same(r, kvcert.generate(model, tok, PROMPTS, press=p, max_new_tokens=NEW, prefilled=state))


def test_h2o_needs_every_prefill_query(smollm2):  # noqa: F811
    model, tok = smollm2
    state = kvcert.prefill(model, tok, PROMPT, query_window=32)
    with pytest.raises(ValueError, match="query_window=None"):
        kvcert.generate(model, tok, PROMPT, press=kvcert.H2OPress(compression_ratio=0.5), prefilled=state)
    full = kvcert.prefill(model, tok, PROMPT, query_window=None)
    fresh = kvcert.generate(model, tok, PROMPT, press=kvcert.H2OPress(compression_ratio=0.5), max_new_tokens=NEW)
    shared = kvcert.generate(model, tok, PROMPT, press=kvcert.H2OPress(compression_ratio=0.5), max_new_tokens=NEW,
                             prefilled=full)
    _same(fresh, shared)


def test_prefilled_argument_errors(smollm2):  # noqa: F811
    model, tok = smollm2
    state = kvcert.prefill(model, tok, PROMPT)
    with pytest.raises(ValueError, match="other prompts"):
        kvcert.generate(model, tok, PROMPT + " ", prefilled=state)
    with pytest.raises(TypeError, match="prefilled must be"):
        kvcert.generate(model, tok, PROMPT, prefilled=object())
    with pytest.raises(ValueError, match="chat_template"):
        kvcert.generate(model, tok, PROMPT, prefilled=state, chat_template=not state.chat_template)
    with pytest.raises(ValueError, match="query_window"):
        kvcert.prefill(model, tok, PROMPT, query_window=0)
    small = kvcert.prefill(model, tok, PROMPT, query_window=8)
    with pytest.raises(ValueError, match="reads 32 prefill queries"):
        kvcert.generate(model, tok, PROMPT, press=kvcert.SnapKVPress(compression_ratio=0.5), prefilled=small)


# ---------------------------------------------------------------------------------------------
# streaming: the prompt fed in chunks (prefill_chunk), compressed as it arrives
# ---------------------------------------------------------------------------------------------
def test_prefill_chunk_longer_than_the_prompt_changes_nothing(smollm2):  # noqa: F811
    model, tok = smollm2
    make = PRESSES[0]
    plain = kvcert.generate(model, tok, PROMPT, press=make(), max_new_tokens=NEW)
    chunked = kvcert.generate(model, tok, PROMPT, press=make(), max_new_tokens=NEW, prefill_chunk=10_000)
    _same(plain, chunked)
    assert chunked.prompt_certificates is None


def test_streaming_compression_keeps_the_budget(smollm2):  # noqa: F811
    model, tok = smollm2
    C, T = 32, 48
    press = kvcert.DecodingPress(kvcert.SnapKVPress(target_size=T, window=8), compression_interval=C)
    r = kvcert.generate(model, tok, PROMPT, press=press, max_new_tokens=NEW, prefill_chunk=C)
    n = r.prompt_tokens
    pc = r.prompt_certificates
    assert pc.radius.shape == (n - C, 30, 9)  # one step per prompt query after the first chunk
    # query j (position C + j) attends over at most T kept tokens plus the chunk so far, never more
    # than the tokens it has seen; a deterministic press certifies nothing (radius 0)
    pos = C + torch.arange(n - C)
    chunk_start = (pos // C) * C
    bound = torch.minimum(pos + 1, T + (pos - chunk_start) + 1)
    assert bool((pc.kept <= bound[:, None, None]).all())
    assert bool((pc.kept[-1] < n).all()) and torch.count_nonzero(pc.radius) == 0
    assert torch.equal(r.certificates.kept[0], pc.kept[-1])  # step 0 is the last prompt query


def test_streaming_poisson_certifies_and_replays(smollm2):  # noqa: F811
    model, tok = smollm2
    runs = [kvcert.generate(model, tok, PROMPT, max_new_tokens=NEW, prefill_chunk=32,
                            press=kvcert.DecodingPress(kvcert.PoissonPress(target_size=48, window=8, seed=5),
                                                       compression_interval=32))
            for _ in range(2)]
    _same(*runs)
    pc = runs[0].prompt_certificates
    assert torch.equal(pc.radius, runs[1].prompt_certificates.radius)
    assert bool((pc.radius[32:] > 0).any()) and bool(torch.isfinite(pc.radius).all())
    assert torch.equal(runs[0].certificates.radius[0], pc.radius[-1])


def test_prefill_chunk_errors(smollm2):  # noqa: F811
    model, tok = smollm2
    with pytest.raises(ValueError, match="prefill_chunk must be"):
        kvcert.generate(model, tok, PROMPT, prefill_chunk=0)
    state = kvcert.prefill(model, tok, PROMPT)
    with pytest.raises(ValueError, match="not both"):
        kvcert.generate(model, tok, PROMPT, prefilled=state, prefill_chunk=16)
