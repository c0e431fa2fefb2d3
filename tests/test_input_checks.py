"""Bad input is refused with an error naming the argument, before any forward of the model.

Sampling arguments (``temperature`` finite and > 0, an int ``sample_seed``), prompts (empty,
whitespace only, or text the tokenizer drops entirely, so that nothing of it would follow the
chat template; each item of a list named by its index), contexts and questions of the
query-agnostic protocol, ``system_prompt`` without a chat template, ``load_model``'s name and
device, and the same through the ``kvcert generate`` command line (one line, exit status 2).

The models are tiny random-weight Llamas (``tests/model_fixtures.tiny_model``) whose forward is
replaced by one that fails the test: a refusal that came after a forward would show as that
failure instead of the expected error.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import tiny_model

import kvcert
from kvcert import cli
from kvcert.generation import encode_prompts

#: a character the test tokenizer drops (as a tokenizer drops what its vocabulary cannot encode)
DROPPED = "\x7f"


class DroppingTokenizer:
    """A character tokenizer that drops ``DROPPED``; ``chat=True`` gives it a chat template that wraps
    the user message in ``<u>`` ... ``</u><a>`` (system message in ``<s>`` ... ``</s>``)."""

    bos_token = ""
    eos_token = "\x01"
    eos_token_id = 1
    pad_token = "\x00"
    pad_token_id = 0
    model_max_length = 10**6

    def __init__(self, chat: bool = False):
        self.chat_template = "<u>{content}</u><a>" if chat else None

    def _ids(self, text):
        return [2 + ord(c) % 94 for c in text if c != DROPPED]

    def encode(self, text, return_tensors=None, add_special_tokens=True):
        ids = self._ids(text)
        return torch.tensor([ids], dtype=torch.long) if return_tensors == "pt" else ids

    def __call__(self, texts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=True):
        rows = [self._ids(t) for t in texts]
        n = max(len(r) for r in rows)
        return {"input_ids": torch.tensor([[0] * (n - len(r)) + r for r in rows], dtype=torch.long),
                "attention_mask": torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        parts = [f"<s>{m['content']}</s>" if m["role"] == "system" else f"<u>{m['content']}</u><a>" for m in messages]
        return "".join(parts)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + int(i) % 90) for i in ids)


def _no_forward(model):
    """``model`` with a forward that fails the test (the decoder's too: compress_context calls it)."""

    def fail(*args, **kwargs):
        raise AssertionError("the model ran a forward before the bad input was refused")

    model.forward = fail
    model.model.forward = fail
    return model


@pytest.fixture()
def tiny():
    return _no_forward(tiny_model("llama", seed=0))


# ---------------------------------------------------------------------------------------------
# generate: sampling arguments
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [math.inf, -math.inf, math.nan, 0.0, -1.0, "1.0", True, None])
def test_temperature_must_be_finite_and_positive_when_sampling(tiny, temperature):
    with pytest.raises(ValueError, match="temperature must be a finite float > 0 when sampling"):
        kvcert.generate(tiny, DroppingTokenizer(), "hello", do_sample=True, temperature=temperature)


@pytest.mark.parametrize("seed", [1.5, "3", None])
def test_sample_seed_must_be_an_int_when_sampling(tiny, seed):
    with pytest.raises(TypeError, match="sample_seed must be an int"):
        kvcert.generate(tiny, DroppingTokenizer(), "hello", do_sample=True, sample_seed=seed)


def test_temperature_is_unused_and_unchecked_when_greedy():
    # greedy decoding reads no temperature: inf there changes nothing (the greedy tokens of the default call)
    model, tok = tiny_model("llama", seed=0), DroppingTokenizer()
    want = kvcert.generate(model, tok, "hello", max_new_tokens=3)
    got = kvcert.generate(model, tok, "hello", max_new_tokens=3, temperature=math.inf)
    assert got.token_ids == want.token_ids


# ---------------------------------------------------------------------------------------------
# generate and prefill: prompts
# ---------------------------------------------------------------------------------------------
BAD_PROMPTS = [
    ("", "prompt: an empty prompt"),
    ("  \n\t ", "prompt: a whitespace-only prompt"),
    (DROPPED * 3, "prompt encodes to no token"),
    (["fine", " "], r"prompt\[1\]: a whitespace-only prompt"),
    (["fine", "also fine", DROPPED], r"prompt\[2\] encodes to no token"),
    ([""], r"prompt\[0\]: an empty prompt"),
]


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
@pytest.mark.parametrize("prompt,match", BAD_PROMPTS)
def test_generate_refuses_prompts_without_text(tiny, prompt, match, chat):
    # with a chat template the row would still hold the template's tokens: the prompt itself is checked
    with pytest.raises(ValueError, match=match):
        kvcert.generate(tiny, DroppingTokenizer(chat), prompt, max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        kvcert.generate(tiny, DroppingTokenizer(chat), prompt, press=kvcert.PoissonPress(compression_ratio=0.5))


@pytest.mark.parametrize("prompt,match", BAD_PROMPTS)
def test_prefill_refuses_prompts_without_text(tiny, prompt, match):
    with pytest.raises(ValueError, match=match):
        kvcert.prefill(tiny, DroppingTokenizer(), prompt)


def test_a_dropped_character_beside_text_is_fine():
    model, tok = tiny_model("llama", seed=0), DroppingTokenizer()
    r = kvcert.generate(model, tok, "hi" + DROPPED, max_new_tokens=2)
    assert r.prompt_tokens == 2 and len(r.token_ids) == 2


def test_template_arguments_need_the_chat_template(tiny):
    for call in (lambda: kvcert.generate(tiny, DroppingTokenizer(), "hello", system_prompt="be brief"),
                 lambda: kvcert.prefill(tiny, DroppingTokenizer(), "hello", system_prompt="be brief"),
                 lambda: kvcert.compress_context(tiny, DroppingTokenizer(), "a context", system_prompt="be brief"),
                 lambda: encode_prompts(DroppingTokenizer(chat=True), ["hello"], chat_template=False,
                                        system_prompt="be brief")):
        with pytest.raises(ValueError, match="system_prompt needs the chat template"):
            call()
    with pytest.raises(ValueError, match="enable_thinking needs the chat template"):
        kvcert.compress_context(tiny, DroppingTokenizer(), "a context", enable_thinking=True)
    ids, _ = encode_prompts(DroppingTokenizer(chat=True), ["hi"], system_prompt="sys")
    assert ids[0].tolist() == DroppingTokenizer()._ids("<s>sys</s><u>hi</u><a>")


# ---------------------------------------------------------------------------------------------
# the query-agnostic protocol: contexts and questions
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat-template"])
@pytest.mark.parametrize("context,match", [(" \n ", "context: a whitespace-only context"),
                                           (DROPPED, "context encodes to no token")])
def test_compress_context_refuses_contexts_without_text(tiny, context, match, chat):
    for press in (None, kvcert.PoissonPress(compression_ratio=0.5)):
        with pytest.raises(ValueError, match=match):
            kvcert.compress_context(tiny, DroppingTokenizer(chat), context, press=press)
        with pytest.raises(ValueError, match=match):
            kvcert.prefill_context(tiny, DroppingTokenizer(chat), context)
    with pytest.raises(TypeError, match="non-empty str"):  # as before: the empty str is no context
        kvcert.compress_context(tiny, DroppingTokenizer(chat), "")


@pytest.mark.parametrize("question,match", [(" ", "question: a whitespace-only question"),
                                            (DROPPED, "question encodes to no token"),
                                            (["who?", "\t"], r"question\[1\]: a whitespace-only question"),
                                            (["who?", "what?", DROPPED * 2], r"question\[2\] encodes to no token")])
def test_answer_refuses_questions_without_text_before_answering_any(question, match):
    model, tok = tiny_model("llama", seed=0), DroppingTokenizer()
    ctx = kvcert.compress_context(model, tok, "the quick brown fox jumps over the lazy dog",
                                  press=kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4))
    _no_forward(model)  # every question is checked before the first one is answered
    with pytest.raises(ValueError, match=match):
        kvcert.answer(model, tok, ctx, question)
    with pytest.raises(ValueError, match=match):
        kvcert.generate(model, tok, question, context=ctx)


def test_answer_keeps_kvpress_empty_question():
    model, tok = tiny_model("llama", seed=0), DroppingTokenizer()
    ctx = kvcert.compress_context(model, tok, "the quick brown fox jumps over the lazy dog")
    r = kvcert.answer(model, tok, ctx, "", max_new_tokens=2)  # the question suffix "\n" is the whole question
    assert r.prompt_tokens == ctx.context_tokens + 1 and len(r.token_ids) >= 1


# ---------------------------------------------------------------------------------------------
# load_model: checked before anything is loaded
# ---------------------------------------------------------------------------------------------
def _nothing_loaded(monkeypatch):
    from kvcert import models

    def fail(*args, **kwargs):
        raise AssertionError("load_model went on past its argument checks")

    monkeypatch.setattr(models, "check_transformers_version", fail)
    return models


@pytest.mark.parametrize("name", ["", "   "])
def test_load_model_refuses_an_empty_name(monkeypatch, name):
    models = _nothing_loaded(monkeypatch)
    with pytest.raises(ValueError, match="name_or_path is empty"):
        models.load_model(name)


@pytest.mark.parametrize("device", ["gpu0", "cuda:x", object()])
def test_load_model_refuses_an_unknown_device(monkeypatch, device):
    models = _nothing_loaded(monkeypatch)
    with pytest.raises(ValueError, match="device must name a torch device"):
        models.load_model(device=device)


# ---------------------------------------------------------------------------------------------
# the command line: the same refusals, one line, exit status 2, before the model is loaded
# ---------------------------------------------------------------------------------------------
def _one_line_error(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "" and len(lines) == 1 and lines[0].startswith("kvcert: error: "), out
    return lines[0]


@pytest.fixture()
def no_model(monkeypatch):
    import kvcert.models

    def fail(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad argument was refused")

    monkeypatch.setattr(kvcert.models, "load_model", fail)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "0", "-0.5"])
def test_cli_refuses_a_bad_temperature(no_model, capsys, value):
    line = _one_line_error(["generate", "--prompt", "hi", "--sample", f"--temperature={value}", "--no-progress"],
                           capsys)
    assert "--temperature must be a finite number > 0" in line


def test_cli_refuses_whitespace_prompts(no_model, capsys, tmp_path):
    f = tmp_path / "blank.txt"
    f.write_text(" \n\n\t", encoding="utf-8")
    assert "empty or whitespace only (--prompt-file" in _one_line_error(["generate", "--prompt-file", str(f)], capsys)
    assert "empty or whitespace only (--prompt)" in _one_line_error(["generate", "--prompt", "\n"], capsys)


def test_cli_refuses_a_system_prompt_without_the_chat_template(no_model, capsys):
    line = _one_line_error(["generate", "--prompt", "hi", "--system", "be brief", "--no-chat-template"], capsys)
    assert "--system needs the chat template" in line


def test_cli_refuses_a_prompt_that_encodes_to_no_token(monkeypatch, capsys):
    import kvcert.models

    model = _no_forward(tiny_model("llama", seed=0))
    monkeypatch.setattr(kvcert.models, "load_model", lambda *a, **k: (model, DroppingTokenizer(chat=True)))
    line = _one_line_error(["generate", "--prompt", DROPPED * 4, "--no-progress"], capsys)
    assert "prompt encodes to no token" in line
