"""kvcert against kvpress's own pipeline (``kv-press-text-generation``, kvpress 0.5.5) on the default model.

Runs in ``.venv-kvpress`` (``make test-kvpress``: transformers 5.2.x, kvpress 0.5.5).

- Without a press, kvcert's query-agnostic protocol (``compress_context`` + ``answer``) gives
  kvpress's answers token for token: same formatting, positions and per-question reuse of the
  context's cache.
- A kvcert press passed to kvpress's pipeline compresses the context (kvpress prefills through
  ``model.model`` under ``with press(model):``) and the answers are decoded with the Hajek estimate
  although kvpress decodes outside the press context (the cache carries it:
  ``kvcert.attention.Carrier``): the answers and certificates equal kvcert's own query-agnostic
  call with the same seed.

The answer tokens of the pipeline are read where it turns them into text (its tokenizer's
``decode``), so the comparison is of token ids, not of strings.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import long_prompt, smollm2  # noqa: F401
from transformers import pipeline

import kvcert

# kvpress's pipeline module (importing it registers "kv-press-text-generation"); a bare
# ``import kvpress`` would also find this test folder as a namespace package outside .venv-kvpress
pytest.importorskip("kvpress.pipeline", reason="kvpress is not installed (make test-kvpress)")

CONTEXT = long_prompt(450).rsplit("\n\n", 1)[0]  # Python's assert documentation, without a question
QUESTIONS = ["What is the assert statement for?", "When are assertions removed? Answer briefly."]
NEW = 8


@pytest.fixture(scope="module")
def model_tok(smollm2):  # noqa: F811
    model, tok = smollm2
    model.set_attn_implementation("sdpa")
    return model, tok


@pytest.fixture(scope="module")
def pipe(model_tok):
    model, tok = model_tok
    return pipeline("kv-press-text-generation", model=model, tokenizer=tok)


def _pipeline_tokens(pipe, monkeypatch, **kwargs) -> tuple[list[list[int]], dict]:
    """Run kvpress's pipeline on CONTEXT and QUESTIONS; the token ids of each answer, and its output."""
    seen = []
    decode = pipe.tokenizer.decode

    def spy(ids, *args, **kw):
        seen.append([int(i) for i in ids])
        return decode(ids, *args, **kw)

    monkeypatch.setattr(pipe.tokenizer, "decode", spy)
    out = pipe(CONTEXT, questions=QUESTIONS, max_new_tokens=NEW, **kwargs)
    monkeypatch.setattr(pipe.tokenizer, "decode", decode)
    assert len(seen) == len(QUESTIONS)
    return seen, out


def _kvcert_rows(model, tok, press):
    ctx = kvcert.compress_context(model, tok, CONTEXT, press=press)
    return ctx, kvcert.answer(model, tok, ctx, QUESTIONS, max_new_tokens=NEW).rows()


def test_no_press_answers_equal_kvpress_token_for_token(model_tok, pipe, monkeypatch):
    model, tok = model_tok
    theirs, out = _pipeline_tokens(pipe, monkeypatch)
    _, rows = _kvcert_rows(model, tok, None)
    eos = model.generation_config.eos_token_id
    for ours, their, text in zip(rows, theirs, out["answers"]):
        # kvpress does not test its first token for EOS; kvcert does (the one deliberate difference)
        assert ours.token_ids[0] != eos
        assert ours.token_ids == their, (ours.text, text)
        assert ours.text == text
        assert ours.certificates is None and ours.protocol == "query-agnostic"


@pytest.mark.parametrize("make", [lambda: kvcert.PoissonPress(compression_ratio=0.5, seed=7),
                                  lambda: kvcert.PoissonPress(compression_ratio=0.6, seed=2, scorer="tova",
                                                              kind="wald")],
                         ids=["poisson-snapkv", "poisson-tova-wald"])
def test_kvcert_press_inside_kvpress_pipeline_equals_kvcert(model_tok, pipe, monkeypatch, make):
    model, tok = model_tok
    press = make()
    theirs, out = _pipeline_tokens(pipe, monkeypatch, press=press)
    assert model.config._attn_implementation == "sdpa"  # the pipeline's decode ran outside the press
    records = kvcert.answer_certificates(press)
    ctx, rows = _kvcert_rows(model, tok, make())
    assert len(records) == len(rows) == len(QUESTIONS)
    n = ctx.context_tokens
    for ours, their, text, rec in zip(rows, theirs, out["answers"], records):
        assert ours.token_ids == their, (ours.text, text)
        assert ours.text == text
        c = ours.certificates
        for f in ("radius", "relative_radius", "trace", "kept"):
            assert torch.equal(getattr(rec, f), getattr(c, f)), f
        assert c.kind == rec.kind == press.kind
        # compressed (about half the context is held besides the question) and informative
        q = ours.prompt_tokens - n
        assert float((c.kept[0] - q).double().mean()) < 0.75 * n
        assert float(c.relative_radius.max()) > 0 and bool(torch.isfinite(c.radius).all())
