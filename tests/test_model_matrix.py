"""The architecture matrix: every model family of ``model_fixtures.FAMILIES`` in the Hugging Face path.

Tiny random-weight models built offline from each family's config
(:func:`model_fixtures.tiny_family_model`: Llama, Qwen 2, Qwen 3, Mistral,
Phi-3, Gemma 2, Gemma 3 text, GPT-NeoX), driven with token ids. Per family:
compression 0 is the plain model token for token; ``PoissonPress`` records
the certificates the float64 reference gives on the captured decode inputs;
the deterministic presses keep what the float64 reference scorers keep;
``DecodingPress`` around a ``PoissonPress`` certifies after its events too.
Gemma 2 and 3 mix sliding-window layers (left exact, never certified) with
global ones (compressed); Gemma 2's attention logit softcap enters the
reference as c tanh(s / c).

Tolerances as in test_hf_units.py: logits against a float64 copy of the model
(|kvcert - ref64| <= 2 |plain fp32 - ref64| + rounding), certificates against
the float64 reference estimator within the float32 summation bound 4 n eps32.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from model_fixtures import FAMILIES, forced_logits, reference_certificate, spy_hajek, tiny_family_model

import kvcert
from kvcert import fast as F
from kvcert import reference as R
from kvcert.cache import SlidingWindowLayer, attention_layout, compressed_layers

EPS32 = float(torch.finfo(torch.float32).eps)
PROMPT, NEW = 150, 8


@functools.lru_cache(maxsize=None)
def _model(family: str):
    return tiny_family_model(family)


@functools.lru_cache(maxsize=None)
def _model64(family: str):
    ref = copy.deepcopy(_model(family)).double()
    ref.set_attn_implementation("eager")
    return ref


def _ids(seed: int, n: int = PROMPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def _softcap(model) -> float | None:
    return getattr(model.config, "attn_logit_softcapping", None)


def _greedy(model, ids, press=None):
    kw = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if press is None:
            return model.generate(input_ids=ids, **kw)[0, ids.shape[1]:]
        with press(model):
            return model.generate(input_ids=ids, **kw)[0, ids.shape[1]:]


def _check_sliding_layers(model, cache, seen: int) -> None:
    """Sliding-window layers hold the last window - 1 tokens the model has seen, all with pi = 1."""
    for i, w in enumerate(attention_layout(model.config)):
        layer = cache.layers[i]
        assert isinstance(layer, SlidingWindowLayer) == (w is not None) == (not layer.compressible), i
        if w is not None:
            held = min(w - 1, seen)
            assert layer.physical_length == held and layer.get_seq_length() == seen
            assert torch.equal(layer.positions[0], torch.arange(seen - held, seen).expand_as(layer.positions[0]))
            assert bool((layer.log_weights == 0).all())


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_is_the_plain_model(family):
    """Greedy decoding under PoissonPress(0) is the stock model's, token for token; the prefill
    logits are bit-identical, the decode logits within the float64 oracle's bound; every
    certificate is 0 over the full cache, one layer entry per compressed layer."""
    model = _model(family)
    ids = _ids(1)
    plain = _greedy(model, ids)
    assert torch.equal(_greedy(model, ids, kvcert.PoissonPress(compression_ratio=0.0)), plain)

    cont = plain[:NEW - 1]
    ref_plain, _ = forced_logits(model, ids, cont)
    press = kvcert.PoissonPress(compression_ratio=0.0)
    mine, cache = forced_logits(model, ids, cont, press)
    assert torch.equal(mine[:, 0], ref_plain[:, 0])
    with torch.no_grad():
        ref = _model64(family)(torch.cat([ids, cont[None]], 1)).logits[:, PROMPT - 1:].float()
    err, err_plain = float((mine - ref).abs().max()), float((ref_plain - ref).abs().max())
    bound = 2 * err_plain + 8 * EPS32 * float(ref.abs().max())
    assert err <= bound, f"max |kvcert - ref64| = {err:.3g} > {bound:.3g} (plain fp32 {err_plain:.3g})"

    certs = press.certificates
    compressed = compressed_layers(model.config)
    assert certs.shape == (1, NEW, len(compressed), model.config.num_attention_heads)
    assert torch.count_nonzero(certs.radius) == 0 and torch.count_nonzero(certs.trace) == 0
    assert torch.equal(certs.kept[0, :, 0, 0], PROMPT + torch.arange(NEW))
    assert bool(torch.isfinite(certs.per_step()).all()) and certs.per_step().shape == (1, NEW)
    _check_sliding_layers(model, cache, PROMPT + NEW - 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_poisson_certificates_equal_reference(family, monkeypatch):
    """PoissonPress(0.5, sketch=None), the paper's design: each compressed layer's recorded certificate
    (radius, relative radius, trace, kept) equals the float64 reference on the decode inputs it read
    (Gemma 2: the softcapped scores); sliding-window layers never reach the estimator."""
    model = _model(family)
    calls = spy_hajek(monkeypatch)
    ids, cont = _ids(2), _ids(3, 4)[0]
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)
    _, cache = forced_logits(model, ids, cont, press)
    certs = press.certificates[0]
    compressed = compressed_layers(model.config)
    steps = 1 + len(cont)
    assert certs.shape == (steps, len(compressed), model.config.num_attention_heads)
    assert len(calls) == (steps - 1) * len(compressed)
    softcap = _softcap(model)
    for step in range(1, steps):
        for axis, li in enumerate(compressed):
            call = calls[(step - 1) * len(compressed) + axis]
            kept_kv = torch.isfinite(call["log_pi"][0]).sum(-1)
            assert bool((kept_kv < PROMPT).all()), "the layer was compressed"
            for head in range(certs.shape[-1]):
                est, radius, rel, kept = reference_certificate(call, head, delta=press.delta, kind=press.kind,
                                                               softcap=softcap)
                tol = 4 * kept * EPS32
                where = (step, li, head)
                assert float(certs.radius[step, axis, head]) == pytest.approx(radius, rel=tol, abs=tol * 1e-3), where
                assert float(certs.relative_radius[step, axis, head]) == pytest.approx(rel, rel=tol,
                                                                                       abs=tol * 1e-3), where
                assert float(certs.trace[step, axis, head]) == pytest.approx(est.trace, rel=tol,
                                                                             abs=tol * 1e-6), where
                assert int(certs.kept[step, axis, head]) == kept
    assert bool((certs.radius[1:] > 0).any()) and torch.count_nonzero(certs.radius[0]) == 0
    _check_sliding_layers(model, cache, PROMPT + len(cont))


def test_gemma2_certificates_are_those_of_the_softcapped_attention(monkeypatch):
    """The softcap changes the certificate beyond the reference tolerance: the same captured inputs
    without the softcap give another radius (so the test above would see a softcap left out)."""
    model = _model("gemma2")
    calls = spy_hajek(monkeypatch)
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)
    forced_logits(model, _ids(2), _ids(3, 1)[0], press)
    certs = press.certificates[0]
    far = 0
    for axis, call in enumerate(calls):
        for head in range(certs.shape[-1]):
            _, capped, _, kept = reference_certificate(call, head, delta=press.delta, kind=press.kind,
                                                       softcap=_softcap(model))
            _, uncapped, _, _ = reference_certificate(call, head, delta=press.delta, kind=press.kind)
            got = float(certs.radius[1, axis, head])
            assert got == pytest.approx(capped, rel=4 * kept * EPS32, abs=1e-9)
            far += abs(got - uncapped) > 100 * 4 * kept * EPS32 * abs(uncapped)
    assert far > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_default_press_runs_the_recommended_design(family):
    """PoissonPress(0.5) with no design arguments: the recommended design (tilted sketch, kind
    tilted_hull) on every family, finite positive certificates on the compressed layers; on Gemma 2,
    whose softcap the sketch cannot carry, it warns and records exactly what the paper design records."""
    model = _model(family)
    ids, cont = _ids(2), _ids(3, 4)[0]
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    assert press.kind == "tilted_hull" and press.sketch is not None
    if _softcap(model) is None:
        logits, _ = forced_logits(model, ids, cont, press)
        paper = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)
        paper_logits, _ = forced_logits(model, ids, cont, paper)
        assert not torch.equal(logits, paper_logits)  # the sketched estimate is another estimate
    else:
        with pytest.warns(UserWarning, match="softcaps its attention logits"):
            logits, _ = forced_logits(model, ids, cont, press)
        paper = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)
        paper_logits, _ = forced_logits(model, ids, cont, paper)
        assert torch.equal(logits, paper_logits)
        assert torch.equal(press.certificates[0].radius, paper.certificates[0].radius)
    certs = press.certificates[0]
    assert bool(torch.isfinite(certs.radius).all()) and bool((certs.radius[1:] > 0).any())
    assert press.kind == "tilted_hull"  # the press the user holds is unchanged


DETERMINISTIC = ["snapkv", "streaming_llm", "knorm"]


@pytest.mark.parametrize("name", DETERMINISTIC)
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_presses_keep_what_the_reference_keeps(family, name):
    """At the prefill event of each compressed layer the press keeps, per KV head, the tokens the
    float64 reference scorer and ``reference.deterministic_keep`` keep; a token may differ only in
    a near tie, closer than twice the float32 scorer's own deviation from the float64 one."""
    model = _model(family)
    press = kvcert.PRESSES[name](compression_ratio=0.5)
    seen = {}
    original = press.prefill_event

    def capture(layer, layer_idx, queries, scale):
        seen[layer_idx] = (layer.keys.clone(), layer.values.clone(), queries.clone(), scale)
        return original(layer, layer_idx, queries, scale)

    press.prefill_event = capture
    ids = _ids(4)
    _, cache = forced_logits(model, ids, _ids(5, 1)[0], press)
    assert sorted(seen) == list(compressed_layers(model.config))
    scorer = F.SCORERS[name]
    params = {p: getattr(press, p) for p in scorer.params if hasattr(press, p)}
    budget = press._budget(PROMPT)
    sizes = press._sizes(budget)
    for li, (k, v, q, scale) in seen.items():
        need = press.queries_needed(PROMPT)
        qw = q[:, :, q.shape[2] - need:] if need else q[:, :, :0]
        u32 = scorer(qw, k, v, scale=scale, **params)[0].double().numpy()
        h_kv = k.shape[1]
        g = q.shape[1] // h_kv
        layer = cache.layers[li]
        for h in range(h_kv):
            u = R.SCORERS[name](qw[0, h * g:(h + 1) * g].double().numpy(), k[0, h].double().numpy(),
                                v[0, h].double().numpy(), scale=scale, **params)
            want = R.deterministic_keep(u, int(budget), sinks=sizes.sinks, window=sizes.window)
            got = np.zeros(PROMPT, dtype=bool)
            pos = layer.positions[0, h][layer.valid[0, h]].numpy()
            got[pos[pos < PROMPT]] = True
            assert got.sum() == want.sum() == int(budget), (li, h)
            diff = got ^ want
            if diff.any():
                tol = 2 * float(np.abs(u32[h] - u).max())
                assert float(np.ptp(u[diff])) <= tol, (li, h, np.flatnonzero(diff))


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_press_around_poisson(family, monkeypatch):
    """DecodingPress(PoissonPress): every compressed layer has its prefill event and one per 4
    decoded tokens, sliding-window layers none; certificates are finite and, at the step after
    the second event, equal the reference on the inputs read."""
    model = _model(family)
    calls = spy_hajek(monkeypatch)
    press = kvcert.DecodingPress(kvcert.PoissonPress(target_size=48, sinks=2, window=8, seed=2),
                                 compression_interval=4)
    cont = _ids(6, 9)[0]
    _, cache = forced_logits(model, _ids(7), cont, press)
    certs = press.certificates[0]
    compressed = compressed_layers(model.config)
    assert certs.shape == (1 + len(cont), len(compressed), model.config.num_attention_heads)
    assert bool(torch.isfinite(certs.radius).all()) and bool((certs.radius[1:] > 0).any())
    for i, layer in enumerate(cache.layers):
        if i in compressed:
            assert layer.events == 1 + len(cont) // 4 and layer.tokens_since_event == len(cont) % 4
            pi = layer.pi[layer.valid]
            assert bool((pi > 0).all()) and bool((pi <= 1).all())
        else:
            assert layer.events == 0
    _check_sliding_layers(model, cache, PROMPT + len(cont))
    step = 5  # the first step after the first decode-time event (after the 4th token fed)
    for axis in range(len(compressed)):
        call = calls[(step - 1) * len(compressed) + axis]
        for head in range(certs.shape[-1]):
            _, radius, _, kept = reference_certificate(call, head, delta=press.delta, kind=press.kind,
                                                       softcap=_softcap(model))
            assert float(certs.radius[step, axis, head]) == pytest.approx(radius, rel=4 * kept * EPS32, abs=1e-9)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_sliding_layers_with_left_padding_match_single_rows(family):
    """A left-padded batch under PoissonPress(0): each row's logits equal its run alone within the
    float64 oracle's bound. The short row's padding stays inside the sliding window while decoding,
    so its layers need the stock sliding-window mask with padding at every step."""
    model = _model(family)
    long_ids, short_ids = _ids(8, 60), _ids(9, 10)
    ids = torch.cat([long_ids, torch.cat([torch.zeros(1, 50, dtype=torch.long), short_ids], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    cont = _ids(10, 4)[0]
    batch, cache = forced_logits(model, ids, cont, kvcert.PoissonPress(), mask=mask)
    for row, single in ((0, long_ids), (1, short_ids)):
        alone, _ = forced_logits(model, single, cont)
        with torch.no_grad():
            ref = _model64(family)(torch.cat([single, cont[None]], 1)).logits[:, single.shape[1] - 1:].float()
        err, err_alone = float((batch[row] - ref[0]).abs().max()), float((alone[0] - ref[0]).abs().max())
        assert err <= 2 * err_alone + 8 * EPS32 * float(ref.abs().max()), (row, err, err_alone)
    # the window holds the last 23 slots: the short row's last 9 padding slots (marked, pi = 0) and its 14 tokens
    window = cache.layers[0]
    assert isinstance(window, SlidingWindowLayer) and bool(window.valid[0].all())
    assert torch.equal(window.positions[1, 0], torch.cat([torch.full((9,), -1), torch.arange(14)]))
    assert torch.equal(window.valid[1, 0], torch.arange(23) >= 9)


# ---------------------------------------------------------------------------------------------
# what is refused, by name
# ---------------------------------------------------------------------------------------------
def _config(family, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, num_hidden_layers=2, **kw)


@pytest.mark.parametrize("make, words", [
    (lambda: _config("mistral", sliding_window=64), "every layer of this model is a sliding-window layer"),
    (lambda: _config("gemma3_text", use_bidirectional_attention=True), "bidirectional attention"),
    (lambda: _config("llama", layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
])
def test_unsupported_layouts_are_refused_by_name(make, words):
    cfg = make()
    with pytest.raises(ValueError, match=words):
        attention_layout(cfg)
    with pytest.raises(ValueError, match=words):
        kvcert.cache.KVCertCache(cfg)


def test_unsupported_attention_features_are_refused_by_name():
    from kvcert.attention import _refuse_unsupported

    class Module(torch.nn.Module):
        is_causal = True

    with pytest.raises(ValueError, match="attention sinks"):
        _refuse_unsupported(Module(), {"s_aux": torch.zeros(4)})
    with pytest.raises(ValueError, match="ALiBi"):
        _refuse_unsupported(Module(), {"position_bias": torch.zeros(1, 4, 1, 8)})
    m = Module()
    m.is_causal = False
    with pytest.raises(ValueError, match="non-causal"):
        _refuse_unsupported(m, {})
    _refuse_unsupported(Module(), {"sliding_window": None, "softcap": 50.0})  # what Gemma passes: accepted


def test_block_press_and_softcapped_sketch_are_refused_on_gemma():
    """The block design decides for every layer at once (Gemma's sliding layers are never compressed),
    and the sketch's decode takes no score bias (Gemma 2's softcap): both refused, by name."""
    model, ids = _model("gemma3_text"), _ids(11, 80)
    with pytest.raises(ValueError, match="sliding-window layers"):
        forced_logits(model, ids, _ids(12, 1)[0], kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=4))
    assert model.config._attn_implementation == "sdpa"  # restored after the refusal
    model = _model("gemma2")
    with pytest.raises(ValueError, match="softcapping"):
        forced_logits(model, ids, _ids(12, 1)[0], kvcert.PoissonPress(compression_ratio=0.5, sketch="cluster"))
    assert model.config._attn_implementation == "eager"


def test_as_kvcert_cache_follows_the_config():
    """A stock cache of a Gemma 3 model becomes one of KVCertLayer / SlidingWindowLayer per layer type:
    a DynamicSlidingWindowLayer holding tokens keeps its window, positions and mask sizes; a cache
    made without the config gets every layer of its own type; a full-attention layer holding tokens
    where the model has a sliding-window one is refused."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from kvcert.cache import KVCertLayer, as_kvcert_cache

    config = _model("gemma3_text").config
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    stock = DynamicCache(config=config)
    assert isinstance(stock.layers[0], DynamicSlidingWindowLayer)
    stock.update(k, v, 0)
    sizes = stock.layers[0].get_mask_sizes(1)
    as_kvcert_cache(stock, config)
    layer = stock.layers[0]
    assert isinstance(layer, SlidingWindowLayer) and layer.get_mask_sizes(1) == sizes == (24, 7)
    assert torch.equal(layer.keys, k[:, :, 7:]) and torch.equal(layer.positions[0, 0], torch.arange(7, 30))
    assert [type(x) for x in stock.layers] == [SlidingWindowLayer, KVCertLayer, SlidingWindowLayer,
                                                SlidingWindowLayer]
    lazy = as_kvcert_cache(DynamicCache(), config)
    assert [type(x) for x in lazy.layers] == [type(x) for x in stock.layers]
    wrong = as_kvcert_cache(DynamicCache())  # without the config: every layer full attention
    wrong.update(k, v, 0)
    with pytest.raises(ValueError, match="layer 0 holds tokens as a full-attention layer"):
        as_kvcert_cache(wrong, config)
