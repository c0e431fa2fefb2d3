"""The query-agnostic protocol (issue 13): compress a context once, answer questions over it.

``kvcert.compress_context`` + ``kvcert.answer`` follow kvpress's ``kv-press-text-generation``
pipeline: the context alone is prefilled and compressed, each question (with the chat template's
end of turn) is prefilled over the compressed context at positions after the *full* context length,
never compressed, then answered greedily; every question starts from the same compressed context.
The compressed cache stays decodable with the Hajek estimate after the press context closes
(``kvcert.attention.Carrier``), which is also what makes kvcert's presses work inside kvpress's own
pipeline (tests/kvpress/test_kvpress_pipeline.py).

Each check compares against an independent computation: plain greedy decoding of context +
question, the query-aware streaming path of ``generate`` (``prefill_chunk`` at the context's end,
a different code path through the same press), separate compress-then-answer runs, or decoding
inside the press context.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import cache_of, long_prompt, smollm2, tiny_model  # noqa: F401

import kvcert
from kvcert.cache import KVCertLayer, cache_keyword


class CharTokenizer:
    """A character tokenizer for the tiny random models: no special tokens, no chat template
    (kvpress's pipeline then prefixes the BOS token, here empty, and ends each question with "\\n")."""

    chat_template = None
    bos_token = ""
    eos_token = "\x01"
    eos_token_id = 1
    pad_token = "\x00"
    pad_token_id = 0
    model_max_length = 10**6

    def _ids(self, text):
        return [2 + ord(c) % 94 for c in text]

    def encode(self, text, return_tensors=None, add_special_tokens=True):
        ids = self._ids(text)
        return torch.tensor([ids]) if return_tensors == "pt" else ids

    def __call__(self, texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=True):
        rows = [self._ids(t) for t in texts]
        n = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (n - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + int(i) % 90) for i in ids)


TOK = CharTokenizer()
CONTEXT = "the quick brown fox jumps over the lazy dog; " * 3  # 135 tokens
QUESTIONS = ["who jumps?", "over what?"]
NEW = 6


def _press(seed=0, **kw):
    kw.setdefault("compression_ratio", 0.5)
    return kvcert.PoissonPress(seed=seed, sinks=2, window=4, **kw)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", seed=0)


def _greedy(model, ids, new):
    """Plain greedy decoding (the model's own attention, no press), one token at a time."""
    kw = cache_keyword(model)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, logits, tokens = cache_of(out), [], []
        for _ in range(new):
            logits.append(out.logits[0, -1])
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{kw: cache})
            cache = cache_of(out)
    return tokens, torch.stack(logits)


def _same_result(a, b):
    assert a.token_ids == b.token_ids and a.text == b.text
    assert torch.equal(a.logprobs, b.logprobs)
    for f in ("radius", "relative_radius", "trace", "kept"):
        assert torch.equal(getattr(a.certificates, f), getattr(b.certificates, f)), f
        assert torch.equal(getattr(a.prompt_certificates, f), getattr(b.prompt_certificates, f)), f


# ---------------------------------------------------------------------------------------------
# tiny random models
# ---------------------------------------------------------------------------------------------
def test_no_press_equals_greedy_decoding_of_context_and_question(tiny):
    """Without a press the protocol is plain greedy decoding of context + question + "\\n"."""
    ctx = kvcert.compress_context(tiny, TOK, CONTEXT)
    r = kvcert.answer(tiny, TOK, ctx, QUESTIONS[0], max_new_tokens=NEW, stop_at_eos=False)
    ids = TOK.encode(CONTEXT + QUESTIONS[0] + "\n", return_tensors="pt")
    tokens, logits = _greedy(tiny, ids, NEW)
    assert r.token_ids == tokens
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    eps = torch.finfo(torch.float32).eps
    assert torch.allclose(r.logprobs, ref, rtol=0, atol=64 * eps * float(logits.abs().max())), (r.logprobs, ref)
    # the greedy margin: top-1 minus top-2 log-probability of each step's logits (>= 0; the chosen token is top-1)
    top = torch.log_softmax(logits, -1).topk(2, -1).values
    assert r.margins.shape == (len(tokens),) and bool((r.margins >= 0).all())
    assert torch.allclose(r.margins, top[:, 0] - top[:, 1], rtol=0, atol=64 * eps * float(logits.abs().max()))
    assert r.certificates is None and r.protocol == "query-agnostic"
    assert r.context_tokens == ids.shape[1] - len(QUESTIONS[0]) - 1 and r.prompt_tokens == ids.shape[1]


def test_all_pi_one_equals_no_press_with_zero_certificates(tiny):
    """compression_ratio=0: every pi = 1, the Hajek decode is exact attention, every radius 0."""
    plain = kvcert.answer(tiny, TOK, kvcert.compress_context(tiny, TOK, CONTEXT), QUESTIONS,
                          max_new_tokens=NEW, stop_at_eos=False)
    ctx = kvcert.compress_context(tiny, TOK, CONTEXT, press=_press(compression_ratio=0.0))
    full = kvcert.answer(tiny, TOK, ctx, QUESTIONS, max_new_tokens=NEW, stop_at_eos=False)
    assert full.token_ids == plain.token_ids
    for lp_full, lp_plain, c, p in zip(full.logprobs, plain.logprobs, full.certificates, full.prompt_certificates):
        assert torch.allclose(lp_full, lp_plain, rtol=0, atol=1e-4), (lp_full, lp_plain)
        assert c.radius.shape == (len(lp_full), 2, 4)  # answer tokens x layers x query heads
        assert torch.equal(c.radius, torch.zeros_like(c.radius)) and torch.equal(p.trace, torch.zeros_like(p.trace))


def test_equals_query_aware_streaming_at_the_context_end(tiny):
    """The same computation by another path: ``generate`` with ``prefill_chunk`` = the context length
    prefills and compresses the context, then streams the question over the compressed cache."""
    ctx = kvcert.compress_context(tiny, TOK, CONTEXT, press=_press(seed=3))
    agnostic = kvcert.answer(tiny, TOK, ctx, QUESTIONS[0], max_new_tokens=NEW, stop_at_eos=False)
    aware = kvcert.generate(tiny, TOK, CONTEXT + QUESTIONS[0] + "\n", press=_press(seed=3), max_new_tokens=NEW,
                            stop_at_eos=False, chat_template=False, prefill_chunk=ctx.context_tokens)
    assert aware.protocol == "query-aware" and agnostic.protocol == "query-agnostic"
    # the same tensors through the same operations: equal bit for bit
    _same_result(agnostic, aware)
    assert float(agnostic.certificates.radius.max()) > 0  # the sampled tail is observed


def test_two_questions_equal_separate_runs_and_repeat(tiny):
    """Every question starts from the compressed context: [q1, q2] over one context gives what two
    compress-then-answer runs give, and asking again gives the same answer."""
    ctx = kvcert.compress_context(tiny, TOK, CONTEXT, press=_press(seed=5))
    both = kvcert.answer(tiny, TOK, ctx, QUESTIONS, max_new_tokens=NEW, stop_at_eos=False).rows()
    for q, row in zip(QUESTIONS, both):
        alone = kvcert.answer(tiny, TOK, kvcert.compress_context(tiny, TOK, CONTEXT, press=_press(seed=5)), q,
                              max_new_tokens=NEW, stop_at_eos=False)
        _same_result(row, alone)
    again = kvcert.answer(tiny, TOK, ctx, QUESTIONS[0], max_new_tokens=NEW, stop_at_eos=False)
    _same_result(both[0], again)


def test_shared_context_prefill_equals_compressing_from_scratch(tiny):
    """``prefill_context`` once, then ``compress_context(..., prefilled=)`` per press: the press compresses
    a copy of the exact prefill, so every press gives what a prefill of its own gives, bit for bit, and
    the shared prefill is left untouched for the next press."""
    state = kvcert.prefill_context(tiny, TOK, CONTEXT)
    for press in (None, _press(seed=7), kvcert.SnapKVPress(compression_ratio=0.5, window=4)):
        shared = kvcert.compress_context(tiny, TOK, CONTEXT, press=press, prefilled=state)
        alone = kvcert.compress_context(tiny, TOK, CONTEXT, press=press)
        a = kvcert.answer(tiny, TOK, shared, QUESTIONS, max_new_tokens=NEW, stop_at_eos=False)
        b = kvcert.answer(tiny, TOK, alone, QUESTIONS, max_new_tokens=NEW, stop_at_eos=False)
        if press is None:
            assert a.token_ids == b.token_ids and a.certificates is None
            assert all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(a.logprobs, b.logprobs))
        else:
            for x, y in zip(a.rows(), b.rows()):
                _same_result(x, y)
        if press is not None and press.compresses:
            assert shared.kept() is not None and torch.equal(shared.kept(), alone.kept())
            assert int(shared.kept().max()) < shared.context_tokens
    assert all(layer.keys.shape[-2] == state.input_ids.shape[1] for layer in state.cache.layers)


def test_shared_context_prefill_must_match_the_context(tiny):
    state = kvcert.prefill_context(tiny, TOK, CONTEXT)
    with pytest.raises(ValueError, match="prefill_context"):
        kvcert.compress_context(tiny, TOK, CONTEXT + "more", press=_press(), prefilled=state)
    with pytest.raises(TypeError, match="prefilled must be a kvcert.Prefill"):
        kvcert.compress_context(tiny, TOK, CONTEXT, press=_press(), prefilled="state")
    with pytest.raises(ValueError, match="query_window"):
        kvcert.prefill_context(tiny, TOK, CONTEXT, query_window=0)


def test_question_and_answer_never_compressed(tiny):
    """After an answer every layer holds the compressed context (one eviction event: the context's)
    plus every question and answer token with pi = 1, at positions n, n + 1, ... ."""
    ctx = kvcert.compress_context(tiny, TOK, CONTEXT, press=_press(seed=1, compression_ratio=0.7))
    kept = ctx.kept()
    n = ctx.context_tokens
    assert kept.shape == (2, 2) and bool((kept < n).all())
    r = kvcert.answer(tiny, TOK, ctx, QUESTIONS[1], max_new_tokens=NEW, stop_at_eos=False)
    added = len(QUESTIONS[1]) + 1 + len(r.token_ids) - 1  # question + "\n", then the fed-back answer tokens
    for i, layer in enumerate(ctx.cache.layers):
        assert isinstance(layer, KVCertLayer) and layer.events == 1
        late = layer.positions >= n
        assert torch.equal(late.sum(-1), torch.full((1, 2), added))
        assert torch.equal(torch.sort(layer.positions[late].view(2, -1), -1).values,
                           torch.arange(n, n + added).expand(2, -1))
        assert torch.equal(layer.log_weights[late], torch.zeros(2 * added))
        assert torch.equal((layer.valid & ~late).sum(-1)[0], kept[i])
    assert torch.equal(r.certificates.kept[0], kept.repeat_interleave(2, -1) + len(QUESTIONS[1]) + 1)


def test_the_cache_carries_the_hajek_decode_outside_the_press_context(tiny):
    """Decoding after ``with press(model):`` closed (kvpress's pipeline does that) gives the logits
    and certificates of decoding inside it; another cache meanwhile runs the plain model; a cache
    trimmed from outside (kvpress's ``_remove_answer_from_cache``) returns to the context."""
    import gc

    ids = TOK.encode(CONTEXT, return_tensors="pt")
    q = TOK.encode(QUESTIONS[0], return_tensors="pt")
    kw = cache_keyword(tiny)
    pos = torch.arange(ids.shape[1], ids.shape[1] + q.shape[1])[None]
    with torch.no_grad():
        plain_before = tiny(input_ids=ids, use_cache=True).logits

    def run(outside: bool):
        press = _press(seed=2)
        with torch.no_grad():
            with press(tiny):
                cache = cache_of(tiny(input_ids=ids, use_cache=True))
                if not outside:
                    out = tiny(input_ids=q, position_ids=pos, use_cache=True, **{kw: cache})
            if outside:
                assert tiny.config._attn_implementation == "sdpa"
                out = tiny(input_ids=q, position_ids=pos, use_cache=True, **{kw: cache})
                assert tiny.config._attn_implementation == "sdpa"
        return out.logits[0, -1], press, cache

    inside, p_in, cache_in = run(False)
    outside, p_out, cache = run(True)
    assert torch.equal(inside, outside)
    # inside: the exact prefill row, then one row per question query; outside: the question's record
    c_in, c_out = p_in.certificates, p_out.certificates
    assert c_out.radius.shape == (1, q.shape[1], 2, 4) and float(c_out.radius.max()) > 0
    for f in ("radius", "trace", "kept"):
        assert torch.equal(getattr(c_in, f)[:, 1:], getattr(c_out, f)), f
    with torch.no_grad():  # another cache meanwhile: the plain model, untouched by the carrier
        assert torch.equal(tiny(input_ids=ids, use_cache=True).logits, plain_before)
    # kvpress's trim after an answer: slices of keys/values to get_seq_length (the logical length)
    for layer in cache.layers:
        keep = layer.get_seq_length()
        layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
    with torch.no_grad():
        again = tiny(input_ids=q, position_ids=pos, use_cache=True, **{kw: cache}).logits[0, -1]
    assert torch.equal(again, outside)
    assert len(kvcert.answer_certificates(p_out)) == 2
    del cache, cache_in
    gc.collect()
    assert len(tiny.model._forward_pre_hooks) == 0, "the carrier's hooks outlived the cache"


def test_argument_errors(tiny):
    ctx = kvcert.compress_context(tiny, TOK, CONTEXT, press=_press())
    with pytest.raises(ValueError, match="context's own press"):
        kvcert.generate(tiny, TOK, "q", press=_press(), context=ctx)
    with pytest.raises(ValueError, match="greedily"):
        kvcert.generate(tiny, TOK, "q", context=ctx, do_sample=True)
    with pytest.raises(ValueError, match="prefilled nor prefill_chunk"):
        kvcert.generate(tiny, TOK, "q", context=ctx, prefill_chunk=4)
    with pytest.raises(TypeError, match="CompressedContext"):
        kvcert.answer(tiny, TOK, "not a context", "q")
    with pytest.raises(ValueError, match="another model"):
        kvcert.answer(tiny_model("llama", seed=1), TOK, ctx, "q")
    with pytest.raises(TypeError, match="kvcert press"):
        kvcert.compress_context(tiny, TOK, CONTEXT, press="snapkv")
    with pytest.raises(TypeError, match="non-empty str"):
        kvcert.compress_context(tiny, TOK, ["a", "b"])
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvcert.answer(tiny, TOK, ctx, "q", max_new_tokens=0)
    with pytest.warns(UserWarning, match="truncated from 135 to 100"):
        short = kvcert.compress_context(tiny, TOK, CONTEXT, max_context_length=100)
    assert short.context_tokens == 100


# ---------------------------------------------------------------------------------------------
# the default model (SmolLM2-135M-Instruct, chat template), sparingly
# ---------------------------------------------------------------------------------------------
DOC = long_prompt(500).rsplit("\n\n", 1)[0]  # the documentation without its question
Q1, Q2 = "What is the assert statement for?", "Answer in one word: is assert a statement or a function?"


def test_default_model_no_press_equals_greedy_over_the_chat_formatted_prompt(smollm2):  # noqa: F811
    model, tok = smollm2
    ctx = kvcert.compress_context(model, tok, DOC)
    r = kvcert.answer(model, tok, ctx, Q1, max_new_tokens=8)
    # kvpress's formatting: the user turn holds the context then the question, nothing between;
    # the two halves are tokenized apart
    full = tok.apply_chat_template([{"role": "user", "content": DOC + Q1}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok.decode(ctx.context_ids[0]) + Q1 + ctx.question_suffix == full
    ids = torch.cat([ctx.context_ids, tok.encode(Q1 + ctx.question_suffix, return_tensors="pt",
                                                 add_special_tokens=False)], dim=1)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    expected = ref[0, ids.shape[1]:].tolist()
    assert r.token_ids == expected[:len(r.token_ids)] and len(r.token_ids) == len(expected)


def test_default_model_poisson_two_questions_certified(smollm2):  # noqa: F811
    model, tok = smollm2
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    ctx = kvcert.compress_context(model, tok, DOC, press=press)
    both = kvcert.answer(model, tok, ctx, [Q1, Q2], max_new_tokens=6)
    assert both.protocol == "query-agnostic" and both.context_tokens == [ctx.context_tokens] * 2
    alone = kvcert.answer(model, tok, kvcert.compress_context(model, tok, DOC,
                                                              press=kvcert.PoissonPress(compression_ratio=0.5, seed=0)),
                          Q2, max_new_tokens=6)
    _same_result(both.rows()[1], alone)
    n = ctx.context_tokens
    for row in both.rows():
        c = row.certificates
        assert c.radius.shape == (len(row.token_ids), 30, 9)
        assert bool(torch.isfinite(c.radius).all()) and float(c.relative_radius.max()) > 0
        q = row.prompt_tokens - n
        assert row.prompt_certificates.radius.shape[0] == q
        assert torch.equal(row.prompt_certificates.radius[-1], c.radius[0])
        # every head holds about half the context (the expected budget; Poisson sample sizes have standard
        # deviation <= sqrt(n) / 2) plus the whole question, the default design's sketch counted in kept-token
        # units (Certificates.memory = kept + sketch_memory: the sampled budget is the budget less the sketch)
        assert c.sketch_memory is not None and float(c.sketch_memory.min()) > 0
        held = (c.memory[0] - q).double()
        assert float((held - n / 2).abs().max()) <= 4 * n ** 0.5 / 2, held
    records = kvcert.answer_certificates(press)  # what a kvpress pipeline user reads
    assert len(records) == 2
    for rec, row in zip(records, both.rows()):
        assert torch.equal(rec.radius, row.certificates.radius) and torch.equal(rec.kept, row.certificates.kept)
