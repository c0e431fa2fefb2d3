"""The block design in the Hugging Face path: :class:`kvcert.BlockPoissonPress`.

Synthetic checks run on a tiny random Llama (tests/model_fixtures.py); the
decision, compaction and decode checks also on the default model
(SmolLM2-135M-Instruct, offline). Tolerances: the HF decode and its
certificate are compared with kvcert.fast.block_hajek_attention on the
compacted cache (the same function: equal bit for bit) and with the float64
reference ``kvcert.reference.block_hajek_attention`` within the float32
summation bound 4 n eps32 (n = kept tokens), as tests/test_hf_model.py does
for the token design; a plumbing error (wrong block, pi, head, layer or
step) gives O(1) relative differences.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import model_fixtures
from model_fixtures import cache_of, forced_logits, long_prompt, spy_block_hajek, tiny_model

import kvcert
from kvcert import reference as R
from kvcert.cache import cache_keyword
from kvcert.fast import prompt_event

EPS32 = float(torch.finfo(torch.float32).eps)
#: the shared fixtures of the default model (tests/model_fixtures.py)
smollm2, model_sdpa = model_fixtures.smollm2, model_fixtures.model_sdpa


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _left_pad(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of token-id rows, left-padded to a common length."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, n - len(r):] = torch.tensor(r)
        mask[i, n - len(r):] = 1
    return ids, mask


def _check_layer(layer, decisions, lengths, bs):
    """Every row, KV head: the held prompt tokens are exactly the kept blocks, log pi = log pi_b on them,
    0 on the tokens appended after the prefill; returns the held prompt positions per row."""
    held = []
    for r, (d, n) in enumerate(zip(decisions, lengths)):
        valid, pos, lw = layer.valid[r], layer.positions[r], layer.log_weights[r]
        want = [p for p in range(n) if d is None or bool(d.kept[p // bs])]
        heads = []
        for h in range(valid.shape[0]):
            p = pos[h][valid[h]]
            prompt = p[p < n]
            heads.append(prompt.tolist())
            assert prompt.tolist() == want, f"row {r} head {h}: held prompt positions are not the kept blocks"
            got = lw[h][valid[h]][p < n].double()
            exp = torch.zeros_like(got) if d is None else torch.log(d.pi[prompt // bs]).float().double()
            assert torch.equal(got, exp), f"row {r} head {h}: log pi is not log pi_b"
            assert bool((lw[h][valid[h]][p >= n] == 0).all()), "appended tokens must have pi = 1"
        held.append(heads[0])
    return held


# ---------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------
BAD = [
    ("compression_ratio", 1.0, ValueError, r"compression_ratio must be in \[0.0, 1.0\)"),
    ("compression_ratio", -0.1, ValueError, "compression_ratio"),
    ("compression_ratio", "0.5", TypeError, "compression_ratio must be a float"),
    ("block_size", 0, ValueError, "block_size must be >= 1"),
    ("block_size", 16.0, TypeError, "block_size must be an int"),
    ("seed", -1, ValueError, "seed must be >= 0"),
    ("sink_blocks", -1, ValueError, "sink_blocks must be >= 0"),
    ("recent_blocks", 0, ValueError, "recent_blocks must be >= 1"),
    ("top_blocks", -2, ValueError, "top_blocks must be >= 0"),
    ("floor", 0.0, ValueError, r"floor must be in \(0.0, 1.0\]"),
    ("floor", 1.5, ValueError, "floor"),
    ("observation_window", 0, ValueError, "observation_window must be >= 1"),
    ("reduce", "sum", ValueError, "reduce must be one of"),
    ("delta", 1.0, ValueError, r"delta must be in \(0.0, 1.0\)"),
    ("kind", "hoeffding", ValueError, "kind must be one of"),
]


@pytest.mark.parametrize("name,value,error,match", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_bad_arguments_raise_naming_them(name, value, error, match):
    with pytest.raises(error, match=match):
        kvcert.BlockPoissonPress(**{name: value})


def test_defaults_mirror_the_vllm_config():
    from kvcert.vllm.config import KVCertConfig

    press, cfg = kvcert.BlockPoissonPress(), KVCertConfig(granularity="block")
    for name in ("seed", "sink_blocks", "recent_blocks", "top_blocks", "floor", "observation_window", "reduce",
                 "delta", "kind"):
        assert getattr(press, name) == getattr(cfg, name), name
    assert press.compression_ratio == 0.0 and press.block_size == 16  # kvpress's convention: nothing by default
    # the plugin's default design is the token design, with PoissonPress's defaults
    token, default = kvcert.PoissonPress(), KVCertConfig()
    assert default.granularity == "token"
    for name in ("seed", "sinks", "window", "top_fraction", "floor", "observation_window", "scorer", "kernel_size",
                 "delta", "kind"):
        assert getattr(token, name) == getattr(default, name), name


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.5, 0.75, 0.9])
def test_budget_is_the_vllm_config_budget(ratio):
    from kvcert.vllm.config import KVCertConfig

    for sinks, recent, top in ((1, 1, 0), (0, 1, 0), (2, 3, 1)):
        press = kvcert.BlockPoissonPress(compression_ratio=ratio, sink_blocks=sinks, recent_blocks=recent,
                                         top_blocks=top)
        cfg = KVCertConfig(compression_ratio=ratio, granularity="block", sink_blocks=sinks, recent_blocks=recent,
                           top_blocks=top)
        for nb in range(1, 40):
            assert press.budget(nb) == cfg.budget(nb), (ratio, sinks, recent, top, nb)


def test_decoding_press_refuses_the_block_design():
    with pytest.raises(TypeError, match="base_press: BlockPoissonPress decides its block sample once"):
        kvcert.DecodingPress(kvcert.BlockPoissonPress(compression_ratio=0.5), compression_interval=8, target_size=64)


def test_inputs_embeds_are_refused_with_a_clear_message():
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 80), generator=torch.Generator().manual_seed(0))
    press = kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=8)
    with torch.no_grad(), press(model), pytest.raises(ValueError, match="input_ids, not inputs_embeds"):
        model(inputs_embeds=model.get_input_embeddings()(ids), use_cache=True)


# ---------------------------------------------------------------------------------------------
# no eviction: the full cache
# ---------------------------------------------------------------------------------------------
def test_ratio_zero_is_the_token_path_bit_for_bit():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    ids, cont = torch.randint(1, 96, (1, 70), generator=g), torch.randint(1, 96, (4,), generator=g)
    token, _ = forced_logits(model, ids, cont, kvcert.PoissonPress(compression_ratio=0.0))
    press = kvcert.BlockPoissonPress(compression_ratio=0.0, block_size=8)
    block, cache = forced_logits(model, ids, cont, press)
    assert torch.equal(block, token)
    assert press.decisions == [None]
    assert all(layer.block_size is None for layer in cache.layers)  # the token design's decode, unchanged
    assert torch.count_nonzero(press.certificates.radius) == 0


class _KeepAllDesign(kvcert.fast.BlockDesign):
    """Budget = every block: pi_b = 1 everywhere."""

    def budget(self, n_blocks):
        return float(n_blocks)


class _KeepAll(kvcert.BlockPoissonPress):
    """Budget = every block: pi_b = 1 everywhere, but through the block machinery (compaction, block decode).
    The budget is the design's (the press holds a ``kvcert.fast.BlockDesign``), so the design is swapped."""

    def _make_design(self):
        return _KeepAllDesign(**{name: getattr(self, name) for name in self._design_fields})


def test_all_pi_one_gives_the_full_cache_output():
    model = tiny_model()
    g = torch.Generator().manual_seed(2)
    ids, cont = torch.randint(1, 96, (1, 75), generator=g), torch.randint(1, 96, (4,), generator=g)
    plain, _ = forced_logits(model, ids, cont)
    press = _KeepAll(compression_ratio=0.5, block_size=8, seed=1)
    mine, cache = forced_logits(model, ids, cont, press)
    d = press.decisions[0]
    assert bool((d.pi == 1).all()) and bool(d.kept.all())
    assert all(layer.block_size == 8 for layer in cache.layers)  # decoded by block_hajek_attention
    # prefill bit-identical; decode = exact attention up to float32 rounding of two softmax orders
    assert torch.equal(mine[:, 0], plain[:, 0])
    tol = 8 * EPS32 * math.sqrt(ids.shape[1] + len(cont)) * float(plain.abs().max())
    err = float((mine - plain).abs().max())
    assert err <= tol, f"max |block - plain| = {err:.3g} > {tol:.3g}"
    certs = press.certificates
    assert torch.count_nonzero(certs.trace) == 0 and torch.count_nonzero(certs.radius) == 0


def test_short_prompt_whose_certainty_set_fills_the_budget_evicts_nothing():
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 20), generator=torch.Generator().manual_seed(3))
    cont = torch.tensor([5, 6])
    token, _ = forced_logits(model, ids, cont, kvcert.PoissonPress(compression_ratio=0.0))
    press = kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=16)  # 2 blocks = sink + recent
    block, cache = forced_logits(model, ids, cont, press)
    assert press.decisions == [None] and torch.equal(block, token)
    assert all(layer.block_size is None for layer in cache.layers)


# ---------------------------------------------------------------------------------------------
# the decision and the compacted cache (tiny model: batches with padding)
# ---------------------------------------------------------------------------------------------
def test_tiny_batch_kept_blocks_whole_and_shared_and_batch_independent():
    model = tiny_model()
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(1, 96, (130,), generator=g).tolist(), torch.randint(1, 96, (97,), generator=g).tolist()
    cont = torch.randint(1, 96, (3,), generator=g)
    kw = dict(compression_ratio=0.5, block_size=8, seed=5, sink_blocks=1, recent_blocks=2)
    alone = kvcert.BlockPoissonPress(**kw)
    forced_logits(model, torch.tensor([a]), cont, alone)
    ids, mask = _left_pad([b, a])
    press = kvcert.BlockPoissonPress(**kw)
    _, cache = forced_logits(model, ids, cont, press, mask=mask)
    db, da = press.decisions
    assert da.event == alone.decisions[0].event == prompt_event(a) and db.event == prompt_event(b)
    assert torch.equal(da.kept, alone.decisions[0].kept)
    torch.testing.assert_close(da.pi, alone.decisions[0].pi, rtol=1e-5, atol=0)
    first = None
    for layer in cache.layers:
        held = _check_layer(layer, [db, da], [len(b), len(a)], 8)
        first = held if first is None else first
        assert held == first  # the same kept tokens in every layer
    for d in (da, db):  # sinks and the last (partial) block are kept with certainty
        assert d.pi[0] == 1 and d.pi[-1] == 1 and d.pi[-2] == 1 and bool(d.kept[[0, -2, -1]].all())
        assert float(d.pi.sum()) == pytest.approx(0.5 * d.pi.numel(), rel=1e-12)
        assert not bool(d.kept.all())


def test_same_seed_same_blocks_different_seed_other_blocks():
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 400), generator=torch.Generator().manual_seed(6))
    cont = torch.tensor([7])
    kept = {}
    for seed in (0, 0, 1, 2):
        press = kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=8, seed=seed)
        forced_logits(model, ids, cont, press)
        kept.setdefault(seed, []).append(press.decisions[0].kept)
    assert torch.equal(kept[0][0], kept[0][1])
    assert len({tuple(k[0].tolist()) for k in kept.values()}) > 1


# ---------------------------------------------------------------------------------------------
# the default model
# ---------------------------------------------------------------------------------------------
pytest_model = pytest.mark.model


@pytest_model
def test_model_kept_set_and_offsets_and_batch_independence(model_sdpa):
    model, tok = model_sdpa
    bs = 16
    pa = tok(long_prompt(900)).input_ids
    pb = tok(long_prompt(500)).input_ids
    cont = torch.tensor(tok(" It checks", add_special_tokens=False).input_ids)
    kw = dict(compression_ratio=0.5, block_size=bs, seed=7)
    alone = kvcert.BlockPoissonPress(**kw)
    forced_logits(model, torch.tensor([pa]), cont, alone)
    ids, mask = _left_pad([pb, pa], pad=tok.pad_token_id or 0)
    press = kvcert.BlockPoissonPress(**kw)
    _, cache = forced_logits(model, ids, cont, press, mask=mask)
    db, da = press.decisions
    assert da.event == alone.decisions[0].event == prompt_event(pa)
    assert torch.equal(da.kept, alone.decisions[0].kept), "the batch changed the kept blocks"
    # the importance comes from padded vs unpadded forwards (float32 rounding only)
    torch.testing.assert_close(da.pi, alone.decisions[0].pi, rtol=1e-4, atol=0)
    first = None
    for layer in cache.layers:
        held = _check_layer(layer, [db, da], [len(pb), len(pa)], bs)
        first = held if first is None else first
        assert held == first
    assert not bool(da.kept.all()) and not bool(db.kept.all())


@pytest_model
@pytest.mark.parametrize("kind", ["chebyshev", "wald"])
def test_model_decode_equals_block_hajek_attention_and_reference(model_sdpa, monkeypatch, kind):
    model, tok = model_sdpa
    calls = spy_block_hajek(monkeypatch)
    press = kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=16, seed=3, kind=kind, delta=0.1)
    result = kvcert.generate(model, tok, long_prompt(700), press=press, max_new_tokens=3)
    certs = result.certificates
    n_layers, h_q = certs.radius.shape[1], certs.radius.shape[2]
    assert len(calls) == n_layers * 2  # two decode steps, every layer through the block estimator
    d = press.decisions[0]
    assert d is not None and not bool(d.kept.all())
    for step in (1, 2):
        for layer in (0, 13, n_layers - 1):
            call = calls[(step - 1) * n_layers + layer]
            assert call["block_size"] == 16
            est = call["estimate"]
            # the recorded certificate is the one of this estimate
            trace = est.trace[0].float()
            assert torch.equal(certs.trace[step, layer], trace)
            again = kvcert.fast.block_hajek_attention(call["q"], call["keys"], call["values"], **call["kw"])
            assert torch.equal(again.output, est.output) and torch.equal(again.trace, est.trace)
            g = h_q // call["keys"].shape[1]
            for head in range(h_q):
                kv = head // g
                lp = call["log_pi"][0, kv].double().numpy()
                valid = np.isfinite(lp)
                ref = R.block_hajek_attention(call["q"][0, head].double().numpy(),
                                              call["keys"][0, kv].double().numpy()[valid],
                                              call["values"][0, kv].double().numpy()[valid], np.exp(lp[valid]),
                                              block_size=16, positions=call["positions"][0, kv].numpy()[valid],
                                              scale=call["scale"])
                n = int(valid.sum())
                tol = 4 * n * EPS32
                out = est.output[0, head].double().numpy()
                scale_v = float(np.abs(call["values"][0, kv].double().numpy()[valid]).max())
                err = float(np.abs(out - ref.output).max())
                assert err <= tol * scale_v, f"step {step} layer {layer} head {head}: output err {err:.3g}"
                assert float(est.trace[0, head]) == pytest.approx(ref.trace, rel=tol, abs=tol * 1e-6), \
                    (step, layer, head)
                cert = R.certificate(ref, delta=0.1, kind=kind)
                radius = float(np.linalg.norm(cert.radius)) if np.ndim(cert.radius) else float(cert.radius)
                assert float(certs.radius[step, layer, head]) == pytest.approx(radius, rel=tol, abs=tol * 1e-3)
                assert float(certs.relative_radius[step, layer, head]) == pytest.approx(
                    float(cert.relative_radius), rel=tol, abs=tol * 1e-3)
    assert bool((certs.radius[1:] > 0).any())
    assert torch.count_nonzero(certs.radius[0]) == 0  # the prefill step is exact


@pytest_model
def test_model_shared_prefill_gives_the_same_decision(model_sdpa):
    """kvcert.prefill + generate(prefilled=...) replays the prefill events: same blocks, same certificates."""
    model, tok = model_sdpa
    prompt = long_prompt(600)
    live = kvcert.BlockPoissonPress(compression_ratio=0.6, block_size=16, seed=11, top_blocks=1)
    a = kvcert.generate(model, tok, prompt, press=live, max_new_tokens=3)
    state = kvcert.prefill(model, tok, prompt, query_window=16)
    shared = kvcert.BlockPoissonPress(compression_ratio=0.6, block_size=16, seed=11, top_blocks=1)
    b = kvcert.generate(model, tok, prompt, press=shared, prefilled=state, max_new_tokens=3)
    assert torch.equal(live.decisions[0].kept, shared.decisions[0].kept)
    assert live.decisions[0].event == shared.decisions[0].event
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(a.certificates.relative_radius, b.certificates.relative_radius, rtol=1e-4, atol=1e-7)
    assert bool((b.certificates.radius[1:] > 0).any())


def test_a_chunk_of_queries_equals_one_token_at_a_time():
    """The causal chunk path of the block decode (a question fed at once, kvcert.answer) against single steps."""
    model = tiny_model()
    g = torch.Generator().manual_seed(8)
    ids, cont = torch.randint(1, 96, (1, 120), generator=g), torch.randint(1, 96, (1, 4), generator=g)
    kw = dict(compression_ratio=0.6, block_size=8, seed=9)
    one = kvcert.BlockPoissonPress(**kw)
    steps, _ = forced_logits(model, ids, cont[0], one)
    chunk = kvcert.BlockPoissonPress(**kw)
    with torch.no_grad(), chunk(model):
        out = model(input_ids=ids, use_cache=True)
        out = model(input_ids=cont, use_cache=True, **{cache_keyword(model): cache_of(out)})
    assert torch.equal(one.decisions[0].kept, chunk.decisions[0].kept) and not bool(chunk.decisions[0].kept.all())
    tol = 8 * EPS32 * math.sqrt(ids.shape[1]) * float(steps.abs().max())
    err = float((out.logits[0] - steps[0, 1:]).abs().max())
    assert err <= tol, f"max |chunk - steps| = {err:.3g} > {tol:.3g}"
    a, b = one.certificates, chunk.certificates
    assert a.shape == b.shape and bool((a.trace[0, 1:] > 0).any())
    torch.testing.assert_close(b.relative_radius, a.relative_radius, rtol=4 * 128 * EPS32, atol=1e-7)
    assert torch.equal(a.kept, b.kept)


def test_carried_context_decodes_with_the_block_estimate():
    """After ``with press(model):`` closes, the compressed cache stays decodable (the query-agnostic
    protocol's Carrier): a question fed outside the context goes through the same block decode."""
    model = tiny_model()
    g = torch.Generator().manual_seed(10)
    ids, question = torch.randint(1, 96, (1, 120), generator=g), torch.randint(1, 96, (1, 3), generator=g)
    kw = dict(compression_ratio=0.6, block_size=8, seed=9)
    inside = kvcert.BlockPoissonPress(**kw)
    with torch.no_grad(), inside(model):
        out = model(input_ids=ids, use_cache=True)
        name = cache_keyword(model)
        want = model(input_ids=question, use_cache=True, **{name: cache_of(out)}).logits
    carried = kvcert.BlockPoissonPress(**kw)
    ctx = carried(model)
    with torch.no_grad():
        with ctx:
            cache = model(input_ids=ids, use_cache=True)[name]
        assert ctx.carrier is not None and all(layer.block_size == 8 for layer in cache.layers)
        got = model(input_ids=question, use_cache=True, **{name: cache}).logits
    assert torch.equal(got, want)
    (answer,) = ctx.carrier.session.answer_certificates()
    # the answer's record starts at the question's last query (kvpress's pipeline semantics)
    torch.testing.assert_close(answer.relative_radius, inside.certificates.relative_radius[0, -1:], rtol=0, atol=0)
    assert bool((answer.trace > 0).any())
    ctx.carrier.close()
