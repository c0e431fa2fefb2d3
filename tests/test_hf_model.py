"""The Hugging Face integration on the real model (SmolLM2-135M-Instruct, offline).

Tolerances: logits are compared with a float64 copy of the model as the
oracle, |kvcert - ref64| <= 2 |plain fp32 - ref64| + rounding (STYLE.md);
certificates with the float64 reference estimator, within the float32
summation bound 4 n eps32 (n = tokens summed), far below any plumbing error
(wrong head, layer, step or pi gives O(1) relative differences).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from model_fixtures import SHORT_PROMPT, long_prompt, topics, model_sdpa, smollm2, smollm2_float64, spy_hajek, reference_certificate  # noqa: F401
from model_fixtures import cache_of
from press_cases import PRESS_CASES

import kvcert
from kvcert.cache import cache_keyword
import kvcert.dispatch
from kvcert import reference as R
from kvcert.cache import KVCertLayer

pytestmark = pytest.mark.model

EPS32 = float(torch.finfo(torch.float32).eps)
N_LAYERS, H_Q, H_KV = 30, 9, 3


def forced_logits(model, ids, cont, press=None):
    """Last-position logits of the prefill and of each teacher-forced decode step,
    called like a user would (no position ids: the cache's logical length gives them).
    Returns (logits (1 + len(cont), vocab), cache)."""
    ctx = press(model) if press is not None else contextlib.nullcontext()
    with torch.no_grad(), ctx:
        out = model(input_ids=ids, use_cache=True)
        cache, logits = cache_of(out), [out.logits[0, -1]]
        for t in cont:
            out = model(input_ids=t.view(1, 1), use_cache=True, **{cache_keyword(model): cache})
            cache = cache_of(out)
            logits.append(out.logits[0, -1])
    return torch.stack(logits), cache


_REF64 = {}


def _logits64(model64, ids, n):
    """Float64 logits of positions n - 1 .. end (memoized: both implementations share them)."""
    key = tuple(ids[0].tolist())
    if key not in _REF64:
        with torch.no_grad():
            _REF64[key] = model64(ids).logits[0, n - 1:].float()
    return _REF64[key]


def _prompt_ids(tok, text):
    return tok(text, return_tensors="pt").input_ids


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_ratio_zero_equals_plain_model(model_sdpa, smollm2_float64, impl):
    model, tok = model_sdpa
    model.set_attn_implementation(impl)
    ids = _prompt_ids(tok, long_prompt(150))
    cont = tok(" It checks that a condition holds", add_special_tokens=False, return_tensors="pt").input_ids[0]
    plain, _ = forced_logits(model, ids, cont)
    press = kvcert.PoissonPress(compression_ratio=0.0)
    mine, cache = forced_logits(model, ids, cont, press)
    assert model.config._attn_implementation == impl  # restored on exit

    # the prefill is the model's own attention: bit-identical
    assert torch.equal(mine[0], plain[0])
    # decoding goes through the Hajek estimator with pi = 1: exact attention up to float32 rounding
    n = ids.shape[1]
    ref = _logits64(smollm2_float64, torch.cat([ids, cont[None]], dim=1), n)
    err_plain = float((plain - ref).abs().max())
    err = float((mine - ref).abs().max())
    bound = 2 * err_plain + 8 * EPS32 * float(ref.abs().max())
    worst = int((mine - ref).abs().max(-1).values.argmax())
    assert err <= bound, f"max |kvcert - ref64| = {err:.3g} > {bound:.3g} (plain {err_plain:.3g}), step {worst}"

    certs = press.certificates
    assert certs.shape == (1, 1 + len(cont), N_LAYERS, H_Q)
    for name in ("radius", "relative_radius", "trace"):
        assert torch.count_nonzero(getattr(certs, name)) == 0, name
    # nothing evicted: step s attends over the prompt and the s tokens fed since
    expected = n + torch.arange(1 + len(cont))
    assert torch.equal(certs.kept[0, :, 0, 0], expected)
    assert bool((certs.kept == certs.kept[:, :, :1, :1]).all())
    assert all(isinstance(layer, KVCertLayer) and layer.get_seq_length() == n + len(cont) for layer in cache.layers)


@pytest.mark.parametrize("kind", list(kvcert.fast.PLAIN_KINDS))
def test_recorded_certificate_equals_reference(model_sdpa, monkeypatch, kind):
    model, tok = model_sdpa
    calls = spy_hajek(monkeypatch)
    press = kvcert.PoissonPress(compression_ratio=0.6, sinks=2, window=8, seed=3, kind=kind, delta=0.1)
    result = kvcert.generate(model, tok, long_prompt(500), press=press, max_new_tokens=3)
    certs = result.certificates
    steps = certs.radius.shape[0]
    assert steps == len(result.token_ids) == 3 and len(calls) == N_LAYERS * (steps - 1)
    n_prompt = result.prompt_tokens
    for step in (1, 2):
        for layer in (0, 11, 29):
            call = calls[(step - 1) * N_LAYERS + layer]
            kept_kv = torch.isfinite(call["log_pi"][0]).sum(-1)
            assert bool((kept_kv < n_prompt).all()), "the layer was compressed"
            for head in range(H_Q):
                est, radius, rel, kept = reference_certificate(call, head, delta=0.1, kind=kind)
                tol = 4 * kept * EPS32
                got = float(certs.radius[step, layer, head])
                assert got == pytest.approx(radius, rel=tol, abs=tol * 1e-3), (step, layer, head)
                assert float(certs.relative_radius[step, layer, head]) == pytest.approx(rel, rel=tol, abs=tol * 1e-3)
                assert float(certs.trace[step, layer, head]) == pytest.approx(est.trace, rel=tol, abs=tol * 1e-6)
                # GQA: query head j reads KV head j // g
                assert int(certs.kept[step, layer, head]) == kept == int(kept_kv[head // (H_Q // H_KV)])
    assert bool((certs.radius[1:] > 0).any())
    assert torch.count_nonzero(certs.radius[0]) == 0  # the prefill step is exact


def test_kept_slots_hold_their_tokens_and_positions_stay_right(model_sdpa, monkeypatch):
    """Layer 0's keys depend only on the token and its RoPE position, so the
    compressed layer-0 cache must hold, slot by slot, the plain cache's keys at
    the recorded positions; and the next token's query (fed without position
    ids) must equal the uncompressed run's: the logical length drives RoPE."""
    model, tok = model_sdpa
    ids = _prompt_ids(tok, long_prompt(350))
    n = ids.shape[1]
    cont = torch.tensor([tok.convert_tokens_to_ids("Ġthe")])
    calls = spy_hajek(monkeypatch)
    forced_logits(model, ids, cont, kvcert.PoissonPress(compression_ratio=0.0))
    q_exact, keys_full = calls[0]["q"], calls[0]["keys"]
    calls.clear()
    _, cache = forced_logits(model, ids, cont, kvcert.PoissonPress(compression_ratio=0.7, sinks=2, window=8, seed=1,
                                                                    sketch=None))
    layer0 = cache.layers[0]
    assert torch.equal(calls[0]["q"], q_exact)
    pos, valid = layer0.positions[0], layer0.valid[0]
    assert bool((valid.sum(-1) < n).all())
    for h in range(H_KV):
        p = pos[h][valid[h]]
        assert bool((p[1:] > p[:-1]).all()), "kept slots are in position order"
        assert torch.equal(layer0.keys[0, h][valid[h]], keys_full[0, h, p])
    assert layer0.get_seq_length() == n + 1 and layer0.get_mask_sizes(1)[0] == layer0.physical_length + 1


def test_seed_replays_and_different_seeds_differ(model_sdpa):
    model, tok = model_sdpa
    ids = _prompt_ids(tok, long_prompt(350))

    def kept(seed):
        press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=8, seed=seed)
        with torch.no_grad(), press(model):
            cache = cache_of(model(input_ids=ids, use_cache=True))
        return [(layer.positions.clone(), layer.log_weights.clone()) for layer in cache.layers]

    a, b, c = kept(0), kept(0), kept(1)
    for (pa, la), (pb, lb) in zip(a, b):
        assert torch.equal(pa, pb) and torch.equal(la, lb)
    assert any(pa.shape != pc.shape or not torch.equal(pa, pc) for (pa, _), (pc, _) in zip(a, c))


def test_batch_with_padding_matches_single_prompts(model_sdpa):
    model, tok = model_sdpa
    prompts = [long_prompt(300), SHORT_PROMPT]
    press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=8, seed=0)
    batch = kvcert.generate(model, tok, prompts, press=press, max_new_tokens=3)
    singles = [kvcert.generate(model, tok, p, press=press, max_new_tokens=3) for p in prompts]
    assert batch.prompt_tokens == [s.prompt_tokens for s in singles]
    assert batch.prompt_tokens[0] > batch.prompt_tokens[1]  # the short prompt is left-padded
    for i, s in enumerate(singles):
        assert batch.token_ids[i] == s.token_ids and batch.text[i] == s.text
        # the same sample alone or in a batch (the design streams are indexed by token position,
        # and padding is excluded); float32 closeness of batched runs is checked on the tiny
        # model against a float64 oracle (test_hf_units.py)
        assert torch.equal(batch.certificates[i].kept, s.certificates.kept)

    # the padded positions never enter the cache as tokens
    from kvcert.generation import encode_prompts

    ids, mask = encode_prompts(tok, prompts)
    n_real = mask.sum(-1)
    with torch.no_grad(), press(model):
        cache = cache_of(model(input_ids=ids, attention_mask=mask,
                                position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=True))
    for layer in cache.layers:
        valid = layer.valid
        assert bool((layer.positions[valid] >= 0).all())
        for r in range(2):
            assert bool((layer.positions[r][valid[r]] < n_real[r]).all())
            assert bool((valid[r].sum(-1) <= n_real[r]).all())
        assert bool((layer.positions[~valid] == -1).all())
    assert cache.layers[0].get_seq_length() == ids.shape[1]


def test_model_generate_under_press_equals_kvcert_generate(model_sdpa):
    model, tok = model_sdpa
    press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=8, seed=5)
    ours = kvcert.generate(model, tok, long_prompt(400), press=press, max_new_tokens=4, stop_at_eos=False)
    from kvcert.generation import encode_prompts

    ids, mask = encode_prompts(tok, [long_prompt(400)])
    with torch.no_grad(), press(model):
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    out = gen.sequences
    assert out[0, ids.shape[1]:].tolist() == ours.token_ids
    # the greedy margin of each step: top-1 minus top-2 log-probability of the model's raw logits
    top = torch.stack([torch.log_softmax(x[0].float(), -1).topk(2).values for x in gen.logits])
    assert torch.allclose(ours.margins, top[:, 0] - top[:, 1], rtol=0, atol=1e-4), (ours.margins, top)
    theirs = press.certificates[0]
    assert theirs.shape == ours.certificates.shape
    assert torch.equal(theirs.kept, ours.certificates.kept)
    assert torch.equal(theirs.radius, ours.certificates.radius)  # the same computation, step by step


def test_decode_time_compression(model_sdpa, monkeypatch):
    model, tok = model_sdpa
    ids = _prompt_ids(tok, long_prompt(500))
    cont = tok(" The assert statement checks that a condition is true", add_special_tokens=False,
               return_tensors="pt").input_ids[0][:9]
    calls = spy_hajek(monkeypatch)
    press = kvcert.DecodingPress(kvcert.PoissonPress(target_size=48, sinks=2, window=8, seed=2), compression_interval=4)
    _, cache = forced_logits(model, ids, cont, press)
    certs = press.certificates[0]
    for layer in cache.layers:
        assert layer.events == 1 + len(cont) // 4  # prefill event + one per 4 decoded tokens
        assert layer.tokens_since_event == len(cont) % 4
        pi = layer.pi[layer.valid]
        assert bool((pi > 0).all()) and bool((pi <= 1).all())
        for h in range(H_KV):
            p = layer.positions[0, h][layer.valid[0, h]]
            assert bool((p[1:] > p[:-1]).all())
    kept = certs.kept[:, :, 0].double()  # (steps, layers)
    assert bool((kept[1:].diff(dim=0) < 0).any()), "a decode-time event shrank the cache"
    # the step right after the second event (tokens 4 and 8 trigger events) still certifies correctly
    step = 5
    call = calls[(step - 1) * N_LAYERS + 7]
    for head in (0, 4, 8):
        est, radius, _, kept_h = reference_certificate(call, head, delta=press.delta, kind=press.kind)
        tol = 4 * kept_h * EPS32
        assert float(certs.radius[step, 7, head]) == pytest.approx(radius, rel=tol, abs=tol * 1e-3)


@pytest.mark.parametrize("name", sorted(kvcert.PRESSES))
def test_every_press_on_the_model(model_sdpa, name):
    model, tok = model_sdpa
    cls = kvcert.PRESSES[name]
    press = cls(compression_ratio=0.5, sinks=2, window=8)
    ids = _prompt_ids(tok, long_prompt(350))
    n = ids.shape[1]
    cont = torch.tensor([tok.convert_tokens_to_ids("Ġthe")])
    _, cache = forced_logits(model, ids, cont, press)
    certs = press.certificates[0]
    assert certs.shape == (2, N_LAYERS, H_Q)
    if isinstance(press, kvcert.PoissonPress):
        # E|S| = B per head (the default design samples B less its sketch's memory, sampled_budget);
        # Var|S| = sum pi (1 - pi), estimated without bias by sum_S (1 - pi)
        assert press.sketch is not None  # the default: the recommended design
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        budget = press.design.sampled_budget(n, head_dim, head_dim)
        assert budget < n * 0.5
        total = sum(int(layer.kept.sum()) - H_KV for layer in cache.layers)  # minus the token fed after
        var = sum(float((1 - layer.pi[layer.valid]).sum()) for layer in cache.layers)
        heads = N_LAYERS * H_KV
        assert abs(total - heads * budget) <= 4 * math.sqrt(var) + 1
        assert bool((certs.radius[1] > 0).any())
    else:
        expected = int(n * 0.5)
        for layer in cache.layers:
            assert bool((layer.kept == expected + 1).all())
            assert bool((layer.log_weights[layer.valid] == 0).all())
        assert torch.count_nonzero(certs.radius) == 0  # deterministic: pi = 1, zero "certificates"
    for layer in cache.layers:  # sinks and window always kept
        for h in range(H_KV):
            p = set(layer.positions[0, h][layer.valid[0, h]].tolist())
            assert {0, 1} | set(range(n - 8, n + 1)) <= p
    if name == "streaming_llm":
        p = cache.layers[3].positions[0, 0][cache.layers[3].valid[0, 0]].tolist()
        assert p == [0, 1] + list(range(n - (int(n * 0.5) - 2), n + 1))


def test_flash_attention_falls_back_to_sdpa_with_a_warning(model_sdpa):
    model, tok = model_sdpa
    ids = _prompt_ids(tok, SHORT_PROMPT)
    cont = torch.tensor([tok.convert_tokens_to_ids("Ġthe")])
    expected, _ = forced_logits(model, ids, cont, kvcert.PoissonPress())
    model.config._attn_implementation_internal = "flash_attention_2"  # as if loaded with it
    try:
        with pytest.warns(UserWarning, match="flash_attention_2.*sdpa"):
            got, _ = forced_logits(model, ids, cont, kvcert.PoissonPress())
        assert model.config._attn_implementation == "flash_attention_2"
    finally:
        model.config._attn_implementation_internal = "sdpa"
    assert torch.equal(got, expected)


def test_bad_inputs_on_the_model(model_sdpa):
    model, tok = model_sdpa
    with pytest.raises(TypeError, match="prompt"):
        kvcert.generate(model, tok, 42)
    with pytest.raises(TypeError, match="prompt"):
        kvcert.generate(model, tok, [])
    with pytest.raises(ValueError, match="prompt"):
        kvcert.generate(model, tok, "")
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvcert.generate(model, tok, "hi", max_new_tokens=0)
    with pytest.raises(TypeError, match="press"):
        kvcert.generate(model, tok, "hi", press="poisson")
    with pytest.raises(ValueError, match="temperature"):
        kvcert.generate(model, tok, "hi", do_sample=True, temperature=0.0)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        kvcert.PoissonPress()(object())
    press = kvcert.PoissonPress(compression_ratio=0.5)
    with press(model):
        with pytest.raises(RuntimeError, match="already active"):
            with kvcert.SnapKVPress()(model):
                pass
    assert model.config._attn_implementation == "sdpa"


def test_load_model_default_is_offline_smollm2(smollm2):
    model, tok = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert model.dtype == torch.float32 and not model.training
    assert tok.pad_token is not None and tok.chat_template is not None


def test_default_model_cache_equals_the_gguf_load(smollm2, monkeypatch):
    """load_model() reads the default model from the folder convert_gguf wrote once: the same weights,
    logits, tokenizer and generation config as transformers' GGUF loader gives; where the cache cannot
    be written, load_model falls back to the GGUF file with a warning."""
    from kvcert import models

    model, tok = smollm2
    folder = models.default_model_folder()
    marker = folder / models._MARKER
    assert marker.is_file() and model.config._name_or_path == str(folder)
    before = marker.stat().st_mtime_ns
    assert models.convert_gguf(models.default_gguf_path(), folder) == folder  # reused, not rewritten
    assert marker.stat().st_mtime_ns == before

    def unwritable(*a, **k):
        raise PermissionError("read-only")

    monkeypatch.setattr(models, "convert_gguf", unwritable)
    with pytest.warns(UserWarning, match="loading the GGUF file instead"):
        ref, ref_tok = models.load_model()
    assert getattr(ref.config, "quantization_config", None) is not None  # really the GGUF loader
    text = "Read this documentation:\n\n" + topics["assert"][:2000]
    ids = tok(text)["input_ids"]
    assert ids == ref_tok(text)["input_ids"]
    msgs = [{"role": "user", "content": SHORT_PROMPT}]
    assert (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert (tok.pad_token, tok.eos_token) == (ref_tok.pad_token, ref_tok.eos_token)
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    mine, theirs = model.state_dict(), ref.state_dict()
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    x = torch.tensor([ids[:200]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)


def test_sampling_is_seeded_and_progress_bars_run(model_sdpa, capsys):
    model, tok = model_sdpa
    runs = [kvcert.generate(model, tok, SHORT_PROMPT, max_new_tokens=4, do_sample=True, temperature=1.5,
                            sample_seed=11, progress=True) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].certificates is None
    err = capsys.readouterr().err
    assert "prefill" in err and "decode" in err


def _case_presses():
    """Every registered press with its easy and hard keyword sets, and the easy one wrapped in a DecodingPress."""
    import copy

    out = []
    for name in sorted(PRESS_CASES):
        for which, kwargs in zip(("easy", "hard"), PRESS_CASES[name]):
            for decoding in (False, True) if which == "easy" else (False,):
                out.append(pytest.param(name, copy.deepcopy(kwargs), decoding,
                                        id=f"{name}-{which}{'-decoding' if decoding else ''}"))
    return out


@pytest.mark.parametrize("name, kwargs, decoding", _case_presses())
def test_press_cases_on_the_model(model_sdpa, name, kwargs, decoding):
    """The shared press test: every press of the registry, with its easy and hard settings, generates
    on the real model with finite certificates of the right shape; a deterministic press certifies 0,
    PoissonPress certifies > 0 once it has evicted; a DecodingPress keeps the cache at its target."""
    model, tok = model_sdpa
    press = kvcert.PRESSES[name](**kwargs)
    base = press
    if decoding:
        press = kvcert.DecodingPress(base, compression_interval=2, target_size=24)
    new = 5
    r = kvcert.generate(model, tok, long_prompt(120), press=press, max_new_tokens=new)
    c = r.certificates
    assert c.shape == (len(r.token_ids), N_LAYERS, H_Q)
    assert bool(torch.isfinite(c.radius).all()) and bool((c.radius >= 0).all())
    assert bool((c.kept <= r.prompt_tokens + new).all())
    assert torch.count_nonzero(c.radius[0]) == 0  # step 0 is the exact prefill
    if isinstance(base, kvcert.PoissonPress):
        assert bool((c.radius[1:] > 0).any())
    else:
        assert torch.count_nonzero(c.radius) == 0
    if decoding:  # events every 2 tokens bring each head back to 24 kept (+ at most 2 tokens since)
        if isinstance(base, kvcert.PoissonPress):  # 24 in expectation: Var|S| <= 24 per KV head
            assert float(c.kept[-1].double().mean()) <= 24 + 2 + 4 * math.sqrt(24 / (N_LAYERS * H_KV))
        else:
            assert int(c.kept[-1].max()) <= 24 + 2
    elif base.compresses:
        assert int(c.kept[1].max()) < r.prompt_tokens + 1
