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
        if ra.certificates is None:
            assert rb.certificates is None
            continue
        for f in ("radius", "relative_radius", "trace", "kept"):
            assert torch.equal(getattr(ra.certificates, f), getattr(rb.certificates, f)), f


PRESSES = [
    lambda: kvcert.PoissonPress(compression_ratio=0.5, seed=3),
    lambda: kvcert.PoissonPress(compression_ratio=0.7, seed=1, scorer="tova", kind="wald"),
    lambda: kvcert.PoissonPress(target_size=60, compression_interval=2, seed=2),
    lambda: kvcert.SnapKVPress(compression_ratio=0.5),
    lambda: kvcert.StreamingLLMPress(compression_ratio=0.6),
    lambda: kvcert.KNormPress(compression_ratio=0.5),
]


@pytest.mark.parametrize("make", PRESSES, ids=["poisson", "poisson-tova-wald", "poisson-interval", "snapkv",
                                              "streaming", "knorm"])
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
