"""PoissonPress(scorer=<a kvpress-style scorer>) without kvpress installed, and kvpress's names.

A kvpress ``ScorerPress`` is duck-typed on ``score(module, hidden_states, keys, values,
attentions, kwargs) -> (batch, kv_heads, seq)``; the fakes below have that method and nothing
of kvpress. The parity with kvpress itself runs in its own venv (tests/kvpress).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from model_fixtures import SHORT_PROMPT, cache_of, long_prompt, smollm2, tiny_model  # noqa: F401 (fixture)

import kvcert
from kvcert.fast import scorers as S


class FakeKnorm:
    """A kvpress-style scorer: minus the key norm (kvpress's KnormPress.score), recording its calls."""

    compression_ratio = 0.0

    def __init__(self):
        self.calls = []

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        self.calls.append({"module": module, "hidden_states": hidden_states, "keys": keys, "values": values,
                           "attentions": attentions, "kwargs": kwargs})
        return -torch.linalg.vector_norm(keys, dim=-1)


class FakeReturning:
    """A kvpress-style scorer returning ``fn(keys)``."""

    def __init__(self, fn):
        self.fn = fn

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return self.fn(keys)


def _ids(n, b=1, seed=0):
    return torch.randint(1, 96, (b, n), generator=torch.Generator().manual_seed(seed))


def _run(model, press, ids, mask=None, new=4):
    """Greedy generation under the press: (tokens, certificates, cache)."""
    kw = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad(), press(model):
        out = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True,
                             **kw)
    return out.sequences, press.certificates, cache_of(out)


# ---------------------------------------------------------------------------------------------
# the scores are the importance, exactly as a kvcert scorer's
# ---------------------------------------------------------------------------------------------
def test_a_kvpress_style_scorer_drives_the_design_as_kvcerts_own():
    """FakeKnorm computes kvcert's knorm importance through kvpress's signature: the Poisson design,
    the kept tokens, their pi, the decoded tokens and every certificate are bitwise those of
    PoissonPress(scorer="knorm") with the same seed."""
    model = tiny_model()
    ids = _ids(150)
    fake = FakeKnorm()
    a = _run(model, kvcert.PoissonPress(compression_ratio=0.6, scorer=fake, seed=3), ids)
    b = _run(model, kvcert.PoissonPress(compression_ratio=0.6, scorer="knorm", seed=3), ids)
    assert len(fake.calls) == model.config.num_hidden_layers  # one prefill event per layer, none at decode
    assert torch.equal(a[0], b[0])
    for field in ("radius", "relative_radius", "trace", "kept"):
        assert torch.equal(getattr(a[1], field), getattr(b[1], field)), field
    for la, lb in zip(a[2].layers, b[2].layers):
        assert torch.equal(la.positions, lb.positions) and torch.equal(la.log_weights, lb.log_weights)
    steps = a[1].relative_radius[0, 1:]  # decoding steps: informative (> 0) and finite
    assert bool(torch.isfinite(steps).all()) and float(steps.max()) > 0
    assert int(a[1].kept[0, 1].max()) < ids.shape[1]  # it did compress


def test_the_scorer_gets_what_kvpress_forward_hook_gives():
    """Per layer: the attention module, its input hidden states (bitwise those of a plain forward),
    its forward kwargs with the position embeddings, the layer's prefill keys and values, and
    attentions=None."""
    model = tiny_model()
    ids = _ids(90, seed=1)
    seen = {}

    def record(module, args, kwargs):
        seen[module.layer_idx] = kwargs

    hooks = [layer.self_attn.register_forward_pre_hook(record, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            plain = model(input_ids=ids, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    plain_cache = cache_of(plain)
    fake = FakeKnorm()
    _run(model, kvcert.PoissonPress(compression_ratio=0.5, scorer=fake, seed=0), ids, new=2)
    assert [c["module"] for c in fake.calls] == [layer.self_attn for layer in model.model.layers]
    for c in fake.calls:
        i = c["module"].layer_idx
        assert torch.equal(c["hidden_states"], seen[i]["hidden_states"])
        (cos, sin), (cos0, sin0) = c["kwargs"]["position_embeddings"], seen[i]["position_embeddings"]
        assert torch.equal(cos, cos0) and torch.equal(sin, sin0)
        layer = plain_cache.layers[i]
        assert torch.equal(c["keys"], layer.keys) and torch.equal(c["values"], layer.values)
        assert c["attentions"] is None and c["kwargs"]["hidden_states"] is c["hidden_states"]
    # the hooks and the rotary embedding kvpress's scorers read are set for the context only
    assert all(not layer.self_attn._forward_pre_hooks and not layer.self_attn._forward_hooks
               for layer in model.model.layers)
    assert all(not hasattr(layer.self_attn, "rotary_emb") for layer in model.model.layers)


class RotaryReader(FakeKnorm):
    """Reads module.rotary_emb, as kvpress's ExpectedAttentionPress does, and records post_init_from_model."""

    def __init__(self):
        super().__init__()
        self.inited = []

    def post_init_from_model(self, model):
        self.inited.append(model)

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        n = keys.shape[2]
        cos, _ = module.rotary_emb(keys, torch.arange(n, n + 4)[None])
        assert cos.shape[-2] == 4
        return super().score(module, hidden_states, keys, values, attentions, kwargs)


def test_rotary_emb_and_post_init_as_kvpress_sets_them():
    model = tiny_model()
    fake = RotaryReader()
    _run(model, kvcert.PoissonPress(compression_ratio=0.5, scorer=fake, seed=0), _ids(40), new=1)
    assert fake.inited == [model] and len(fake.calls) == model.config.num_hidden_layers


def test_padded_rows_are_scored_on_their_real_tokens_and_sample_as_alone():
    """A left-padded batch: each row's scorer call holds its n real tokens only (hidden states and
    position embeddings sliced alike), and each row keeps the tokens, with the same pi, that it
    keeps alone."""
    model = tiny_model()
    long_ids, short_ids = _ids(100, seed=2), _ids(70, seed=3)
    ids = torch.cat([long_ids, torch.cat([torch.zeros(1, 30, dtype=torch.long), short_ids], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    fake = FakeKnorm()
    _, _, batch = _run(model, kvcert.PoissonPress(compression_ratio=0.5, scorer=fake, seed=5), ids, mask, new=1)
    shapes = sorted({(tuple(c["hidden_states"].shape), tuple(c["keys"].shape)) for c in fake.calls})
    assert shapes == [((1, 70, 64), (1, 2, 70, 16)), ((1, 100, 64), (1, 2, 100, 16))]
    for c in fake.calls:
        cos, _ = c["kwargs"]["position_embeddings"]
        assert cos.shape[:2] == c["hidden_states"].shape[:2]
    for row, solo_ids in ((0, long_ids), (1, short_ids)):
        _, _, solo = _run(model, kvcert.PoissonPress(compression_ratio=0.5, scorer=FakeKnorm(), seed=5), solo_ids,
                          new=1)
        for lb, ls in zip(batch.layers, solo.layers):
            for h in range(lb.positions.shape[1]):
                got = {(int(p), float(w)) for p, w in zip(lb.positions[row, h], lb.log_weights[row, h]) if p >= 0}
                want = {(int(p), float(w)) for p, w in zip(ls.positions[0, h], ls.log_weights[0, h]) if p >= 0}
                assert got == want


# ---------------------------------------------------------------------------------------------
# errors name the argument and the expected shape
# ---------------------------------------------------------------------------------------------
class NoScore:
    """A kvpress press that is not score-based (AdaKVPress, ChunkPress, DecodingPress shape)."""

    compression_ratio = 0.5

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        return keys, values

    def forward_hook(self, module, input, kwargs, output):
        return output


class KvcertSignature:
    """kvcert's scorer signature on an object that is not a kvcert ScorerPress."""

    def score(self, queries, keys, values, *, scale, layer=0, event=0):
        return keys.norm(dim=-1)


@pytest.mark.parametrize("scorer, words", [
    (NoScore(), r"NoScore has no score\(module, hidden_states, keys, values, attentions, kwargs\)"),
    (KvcertSignature(), r"KvcertSignature.score must take \(module, hidden_states, keys, values, attentions, "
                        r"kwargs\)"),
])
def test_a_press_without_a_kvpress_score_is_refused_by_name(scorer, words):
    with pytest.raises(TypeError, match=words):
        kvcert.PoissonPress(compression_ratio=0.5, scorer=scorer)


@pytest.mark.parametrize("fn, words", [
    (lambda k: -k.norm(dim=-1)[:, :, 1:], r"scorer must return a tensor of shape \(b, h_kv, n\) = \(batch, kv_heads, "
                                          r"seq\) = \(1, 2, 60\): FakeReturning.score\(module, hidden_states, keys, "
                                          r"values, attentions, kwargs\) returned \(1, 2, 59\)"),
    (lambda k: -k.norm(dim=-1)[:, 0], r"= \(1, 2, 60\): .* returned \(1, 60\)"),
    (lambda k: k.norm(dim=-1).tolist(), r"= \(1, 2, 60\): .* returned list"),
    (lambda k: k.norm(dim=-1).index_fill(-1, torch.tensor([3]), math.nan),
     r"FakeReturning.score.* returned 2 NaN or inf scores of 120 at layer 0 \(shape \(batch, kv_heads, seq\) = "
     r"\(1, 2, 60\)\)"),
    (lambda k: k.norm(dim=-1).index_fill(-1, torch.tensor([0]), -math.inf), r"NaN or inf scores"),
])
def test_bad_scores_raise_naming_the_scorer_and_the_shape(fn, words):
    model = tiny_model()
    with pytest.raises(ValueError, match=words):
        _run(model, kvcert.PoissonPress(compression_ratio=0.5, scorer=FakeReturning(fn), seed=0), _ids(60), new=1)
    # the context is undone even so
    assert all(not layer.self_attn._forward_pre_hooks for layer in model.model.layers)
    assert model.config._attn_implementation != "kvcert"


def test_decoding_press_refuses_a_kvpress_scorer():
    with pytest.raises(TypeError, match="base_press: a PoissonPress whose scorer is a kvpress press"):
        kvcert.DecodingPress(kvcert.PoissonPress(target_size=16, scorer=FakeKnorm()), compression_interval=8)


def test_a_kvpress_scorer_outside_a_prefill_forward_says_what_it_needs():
    press = kvcert.PoissonPress(compression_ratio=0.5, scorer=FakeKnorm(), sketch=None)
    assert press.queries_needed(100) == 0  # it makes its own queries from the hidden states
    # the default design's tilted sketch reads the observation window's queries itself
    assert kvcert.PoissonPress(compression_ratio=0.5, scorer=FakeKnorm()).queries_needed(100) == 32
    k = torch.randn(1, 2, 20, 8)
    with pytest.raises(ValueError, match=r"needs layer 3's attention inputs .* call generate without prefilled="):
        press._prefill_importance(None, k, k, scale=0.3, layer_idx=3, event=0, row=0, tokens=None)
    with pytest.raises(ValueError, match="only a prefill event"):
        press._score(None, k, k, scale=0.3, layer=0, event=1)


def test_the_real_model_with_a_kvpress_style_scorer(smollm2):
    """End to end on the default model through kvcert.generate: informative, finite certificates;
    a shared kvcert.prefill cannot serve it (no hidden states kept) and says so."""
    model, tok = smollm2
    press = kvcert.PoissonPress(compression_ratio=0.5, scorer=FakeKnorm(), seed=0)
    r = kvcert.generate(model, tok, long_prompt(900), press=press, max_new_tokens=4)
    c = r.certificates.relative_radius[1:]
    assert bool(torch.isfinite(c).all()) and float(c.max()) > 0
    assert int(r.certificates.kept[1].max()) < r.prompt_tokens
    state = kvcert.prefill(model, tok, SHORT_PROMPT)
    with pytest.raises(ValueError, match="prefilled="):
        kvcert.generate(model, tok, SHORT_PROMPT, press=kvcert.PoissonPress(compression_ratio=0.5,
                                                                            scorer=FakeKnorm()),
                        max_new_tokens=2, prefilled=state)


# ---------------------------------------------------------------------------------------------
# kvpress's names and conventions
# ---------------------------------------------------------------------------------------------
def test_kvpress_names_are_aliases_of_kvcerts_fields():
    p = kvcert.SnapKVPress(compression_ratio=0.5, window_size=64, n_sink=0)
    assert (p.observation_window, p.sinks, p.window) == (64, 0, 32)  # window_size is not kvcert's window
    assert (p.window_size, p.n_sink) == (64, 0)
    p.window_size = 16
    assert p.observation_window == 16
    assert "window_size" not in repr(p) and "observation_window=16" in repr(p)
    assert dataclasses.replace(p, observation_window=8).window_size == 8
    assert kvcert.PoissonPress(window_size=48, n_sink=2).observation_window == 48
    assert kvcert.StreamingLLMPress(n_sink=2).sinks == 2
    assert kvcert.ExpectedAttentionPress(window_size=16).observation_window == 16
    lag = kvcert.LagKVPress(n_sink=2)  # LagKV's own n_sink (kvpress's name too) stays its field
    assert (lag.n_sink, lag.sinks) == (2, 4)
    with pytest.raises(TypeError, match="give observation_window or its kvpress name window_size, not both"):
        kvcert.SnapKVPress(window_size=64, observation_window=32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'window_size'"):
        kvcert.StreamingLLMPress(window_size=64)  # no observation window to name
    with pytest.raises(ValueError, match="observation_window must be >= 1"):
        kvcert.SnapKVPress(window_size=0)
    params = inspect.signature(kvcert.SnapKVPress).parameters
    assert params["window_size"].kind is inspect.Parameter.KEYWORD_ONLY


def test_scorer_params_stay_fields_not_aliases():
    """PoissonPress(scorer="lagkv") passes LagKV the fields it has (none: the registry's n_sink=4),
    not the n_sink alias of its sinks."""
    k = torch.randn(1, 2, 300, 8, generator=torch.Generator().manual_seed(0))
    q = torch.randn(1, 4, 1, 8)
    p = kvcert.PoissonPress(compression_ratio=0.5, scorer="lagkv", sinks=0)
    assert torch.equal(p._score(q, k, k, scale=0.3, layer=0, event=0), S.lagkv_scores(k, k, lag_size=128, sinks=4))


def _kvpress_snapkv(q, k, window, kernel):
    """kvpress 0.5.5's SnapKVPress.score transcribed (its operations, in its order) on post-RoPE
    queries q (1, h_q, w, d) and keys k (1, h_kv, n, d)."""
    bsz, h_kv, n, d = k.shape
    groups = q.shape[1] // h_kv
    key_states = k.repeat_interleave(groups, dim=1)
    attn = torch.matmul(q, key_states.transpose(2, 3)) / math.sqrt(d)
    attn = attn + torch.triu(torch.ones_like(attn) * float("-inf"), diagonal=n - window + 1)
    attn = torch.softmax(attn, dim=-1)[..., :-window]
    scores = F.avg_pool1d(attn.mean(dim=-2), kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(bsz, h_kv, groups, n - window).mean(2)
    return F.pad(scores, (0, window), value=scores.max().item() + 1)


@pytest.mark.parametrize("n, window, kernel", [(113, 64, 5), (70, 64, 5), (40, 8, 7), (9, 8, 3), (30, 30, 5)])
def test_snapkv_kvpress_pooling_is_kvpress_score(n, window, kernel):
    """pooling="kvpress" is kvpress's SnapKV score (float64, up to the order of float sums); the
    default pooling differs only within kernel_size // 2 of the ends of the span before the window
    (in rank: the tokens compared there are kept alike or not, see tests/kvpress)."""
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(1, 6, window, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2, n, 16, generator=gen, dtype=torch.float64)
    u = S.snapkv_scores(q, k, kernel_size=kernel, pooling="kvpress")
    if n == window:  # nothing before the window: kvpress asserts; kvcert keeps the window alike
        assert torch.equal(u, torch.ones_like(u))
        return
    want = _kvpress_snapkv(q, k, window, kernel)
    torch.testing.assert_close(u, want, rtol=1e-12, atol=1e-15)
    default = S.snapkv_scores(q, k, kernel_size=kernel)
    m, pad = n - window, kernel // 2
    inner = slice(pad, m - pad)
    ratio = default[..., inner] / u[..., inner]  # sum over the window vs mean: the factor w
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(window)), rtol=1e-12, atol=0)


def test_tova_head_pooling_all_is_the_mean_over_every_query_head():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, 50, 16, generator=gen, dtype=torch.float64)
    u = S.tova_scores(q, k, head_pooling="all")
    p = torch.softmax(torch.einsum("bhd,bhnd->bhn", q, k.repeat_interleave(2, dim=1)) / 4.0, dim=-1)
    for h in range(3):
        torch.testing.assert_close(u[:, h], p.mean(dim=1), rtol=1e-12, atol=1e-15)
    assert torch.equal(S.tova_scores(q, k), S.tova_scores(q, k, head_pooling="group"))


@pytest.mark.parametrize("make, words", [
    (lambda: kvcert.SnapKVPress(pooling="zeros"), r"pooling must be one of \('replicate', 'kvpress'\), got 'zeros'"),
    (lambda: kvcert.TOVAPress(head_pooling=1), r"head_pooling must be one of \('group', 'all'\), got 1"),
    (lambda: S.snapkv_scores(torch.randn(1, 2, 2, 4), torch.randn(1, 1, 5, 4), pooling="max"), "pooling must be"),
    (lambda: S.tova_scores(torch.randn(1, 2, 4), torch.randn(1, 1, 5, 4), head_pooling="layer"), "head_pooling"),
])
def test_pooling_choices_are_validated(make, words):
    with pytest.raises(ValueError, match=words):
        make()
