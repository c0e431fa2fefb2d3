"""Fixtures shared by the kvpress tests (their helpers are in tests/kvpress/kvpress_support.py).

The default model comes from ``model_fixtures.smollm2`` (the main suite's, loaded once per process: one model
for every module here, the pipeline test's included).
"""

from __future__ import annotations

import pytest
from kvpress_support import needle_prompt, prompt_ids
from model_fixtures import smollm2  # noqa: F401 (the fixture inputs reads)


@pytest.fixture(scope="module")
def inputs(smollm2):  # noqa: F811
    """(model, tokenizer, prompt, ids): the default model (sdpa) and the needle prompt of 1,300 characters
    through the chat template (:func:`kvpress_support.prompt_ids`: 375 tokens), which the parity and scorer
    tests compress."""
    model, tokenizer = smollm2
    prompt = needle_prompt(1300)
    ids = prompt_ids(tokenizer, prompt)
    assert 250 < ids.shape[1] < 450
    return model, tokenizer, prompt, ids
