"""The per-step decode path (issue 15): reserved-buffer appends, cached value moments, no host
synchronisation per layer, deferred certificates, and the checks moved to the events. Every design
(token, block, sketch) decodes through one entry, ``kvcert.dispatch.decode``, and each route keeps
the host-read budget (issue 28).

Every test here compares against an independent computation (a ``torch.cat`` cache, a fresh
``value_moments``, the validated call, ``kvcert.fast.certificate``) or counts what the path does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_fixtures import cache_of, forced_logits, tiny_model

import kvcert
from kvcert import fast as F
from kvcert.cache import KVCertLayer, cache_keyword

EPS32 = float(torch.finfo(torch.float32).eps)


def _layer(b=2, h=3, n=7, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    layer = KVCertLayer()
    layer.update(torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g))
    return layer, g


def test_appends_equal_concatenation_across_buffer_growth_and_events():
    """Tokens appended into the reserved buffer hold what torch.cat would; an event (replace) or a
    batch operation starts a new buffer without touching the views handed out before."""
    layer, g = _layer()
    keys, values = [layer.keys.clone()], [layer.values.clone()]
    first = None
    for step in range(150):  # past the first reservation (64 slots): the buffer grows
        k, v = torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g)
        out_k, out_v = layer.update(k, v)
        keys.append(k)
        values.append(v)
        assert out_k is layer.keys and out_v is layer.values
        if step == 0:
            first = out_k
            first_copy = out_k.clone()
    assert torch.equal(layer.keys, torch.cat(keys, dim=2)) and torch.equal(layer.values, torch.cat(values, dim=2))
    assert torch.equal(first, first_copy), "a view handed out earlier was overwritten"
    n = layer.physical_length
    assert torch.equal(layer.positions, torch.arange(n).expand(2, 3, n))
    assert torch.equal(layer.log_weights, torch.zeros(2, 3, n))
    assert torch.equal(layer.kept, torch.full((2, 3), n))
    # an eviction event: a new state; appends continue from it
    keep = torch.arange(0, n, 2)
    lw = torch.log(torch.rand(2, 3, keep.numel(), generator=g).clamp(0.1, 1.0))
    layer.replace(layer.keys[:, :, keep].clone(), layer.values[:, :, keep].clone(), lw,
                  layer.positions[:, :, keep].clone())
    before = layer.keys.clone()
    k, v = torch.randn(2, 3, 2, 4, generator=g), torch.randn(2, 3, 2, 4, generator=g)
    layer.update(k, v)
    assert torch.equal(layer.keys, torch.cat([before, k], dim=2))
    assert torch.equal(layer.positions[..., -2:], torch.tensor([n, n + 1]).expand(2, 3, 2))
    assert torch.equal(layer.log_weights[..., :-2], lw) and torch.equal(layer.log_weights[..., -2:], torch.zeros(2, 3, 2))
    assert torch.equal(layer.kept, torch.full((2, 3), keep.numel() + 2))
    # the reserve is bounded: at most 1/16 of the length (at least 64 slots) spare
    held = sum(getattr(layer, x).numel() * 4 for x in ("keys", "values")) + layer.log_weights.numel() * 4 \
        + layer.positions.numel() * 8
    assert held <= layer.reserved_bytes() <= held * (1 + (64 + layer.physical_length // 16) / layer.physical_length)


def test_cached_value_moments_follow_appends_and_events():
    layer, g = _layer(n=9)
    lw = torch.log(torch.rand(2, 3, 9, generator=g).clamp(0.2, 1.0))
    lw[1, 2, -3:] = float("-inf")  # padding slots of one head
    layer.replace(layer.keys.clone(), layer.values.clone(), lw, layer.positions.clone())
    mu, r2 = layer.value_moments()
    mu_ref, r2_ref = F.value_moments(layer.values, log_pi=layer.log_weights)
    assert torch.equal(mu, mu_ref) and torch.equal(r2, r2_ref)
    for _ in range(70):
        layer.update(torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g))
    mu2, r2b = layer.value_moments()
    assert torch.equal(mu2, mu), "the centre is that of the event"
    want = (layer.values - mu[:, :, None]).square().sum(-1)
    want = torch.where(layer.log_weights > float("-inf"), want, 0.0)   # value_moments: 0 on padding
    assert bool((r2b[1, 2, 6:9] == 0).all())
    torch.testing.assert_close(r2b, want, rtol=4 * EPS32, atol=0)
    # a new event recomputes them from the held tokens
    layer.replace(layer.keys[:, :, :5].clone(), layer.values[:, :, :5].clone(), layer.log_weights[..., :5].clone(),
                  layer.positions[:, :, :5].clone())
    mu3, _ = layer.value_moments()
    assert torch.equal(mu3, F.value_moments(layer.values, log_pi=layer.log_weights)[0])


def test_value_distances_are_brought_up_to_date_only_when_asked_for(monkeypatch):
    """The distances ||v_i - mu||^2 of appended tokens are computed when a step asks for them, once, and equal the
    per-token formula; a step that reads the centre alone (the compiled op's, which computes them in its pass) leaves
    them as they were, and then a later ask adds them all. The decode's op route asks for the centre alone, its torch
    route for both."""
    from kvcert import dispatch as D

    layer, g = _layer(n=9)
    mu, r2 = layer.value_moments()
    for _ in range(5):
        layer.update(torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g))
    assert layer.value_sqdist.shape[-1] == 9, "an append computes no distance"
    centre, none = layer.value_moments(distances=False)
    assert centre is mu and none is None and layer.value_sqdist.shape[-1] == 9
    mu2, r2b = layer.value_moments()
    assert mu2 is mu and r2b.shape[-1] == 14 and torch.equal(r2b[..., :9], r2)
    assert torch.equal(r2b[..., 9:], (layer.values[:, :, 9:] - mu[:, :, None]).square().sum(-1))
    assert layer.value_moments()[1] is r2b, "brought up to date once"
    layer.update(torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g))
    q = torch.randn(2, 6, 1, 4, generator=g)
    kw = dict(scale=0.5, options={"per_coordinate": False}, kind="chebyshev")
    dec = D.decode(q, layer, **kw)
    if dec.backend == D.CPU_OP:  # the op's step (where the op is built): the centre alone
        assert layer.value_sqdist.shape[-1] == 14
    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")  # the torch path reads the distances
    t = D.decode(q, layer, **kw)
    assert t.backend == D.TORCH and layer.value_sqdist.shape[-1] == 15
    torch.testing.assert_close(t.output, dec.output, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", [0.5, float("nan")])
def test_replace_checks_log_weights_once_per_event(bad):
    layer, _ = _layer()
    lw = torch.zeros(2, 3, 7)
    lw[0, 1, 2] = bad
    with pytest.raises(ValueError, match="log_weights must be log inclusion probabilities"):
        layer.replace(layer.keys.clone(), layer.values.clone(), lw, layer.positions.clone())


def test_validate_false_is_the_same_estimate_on_valid_input():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 6, 8, generator=g), torch.randn(2, 3, 40, 8, generator=g), torch.randn(2, 3, 40, 5,
                                                                                                    generator=g)
    pi = torch.rand(2, 3, 40, generator=g).clamp(0.05, 1.0)
    pi[..., :4] = 1.0
    pi[1, 2, -6:] = 0.0
    mu, r2 = F.value_moments(v, pi)
    for kw in ({}, {"value_center": mu, "value_sqdist": r2}):
        a = F.hajek_attention(q, k, v, pi, per_coordinate=False, **kw)
        b = F.hajek_attention(q, k, v, pi, per_coordinate=False, validate=False, **kw)
        assert torch.equal(a.output, b.output) and torch.equal(a.trace, b.trace) and torch.equal(a.lse, b.lse)
    # the one-pass path (cached moments, trace only) leaves n_eff to the full path
    assert b.n_eff is None and a.variance is None
    # what validate=True checks, validate=False does not read
    with pytest.raises(ValueError, match="pi"):
        F.hajek_attention(q, k, v, pi * 2, per_coordinate=False, value_center=mu, value_sqdist=r2)
    F.hajek_attention(q, k, v, pi * 2, per_coordinate=False, value_center=mu, value_sqdist=r2, validate=False)


def _host_syncs(fn) -> int:
    """Device-to-host reads (``aten::_local_scalar_dense``: bool(), item(), int() of a tensor) in ``fn``."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "aten::_local_scalar_dense")


def test_a_decode_step_reads_the_device_once(monkeypatch):
    """The per-step path has one host read per forward (the NaN check over all layers), not per layer;
    the same step through the validated path would read several per layer."""
    model = tiny_model()
    n_layers = model.config.num_hidden_layers
    ids = torch.randint(1, 96, (1, 40), generator=torch.Generator().manual_seed(0))
    press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=0, sketch=None)
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, use_cache=True)
        cache, kw = cache_of(out), cache_keyword(model)
        nxt = out.logits[:, -1:].argmax(-1)
        model(input_ids=nxt, use_cache=True, **{kw: cache})  # first step: buffers and moments
        syncs = _host_syncs(lambda: model(input_ids=nxt, use_cache=True, **{kw: cache}))
    assert syncs == 1
    assert n_layers >= 2
    # the control: the validated estimate reads the device (value checks, NaN) on every call
    layer = cache.layers[0]
    q = torch.randn(1, 4, 16)
    assert _host_syncs(lambda: F.hajek_attention(q, layer.keys, layer.values, log_pi=layer.log_weights,
                                                 per_coordinate=False)) >= 2


#: a press per decode route of kvcert.dispatch.decode, sized for tiny_model and a 120-token prompt
#: (a sketch of 4 clusters costs about 6-10 tokens of the 48-token budget)
ROUTE_PRESSES = {
    "token": lambda: kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=0, sketch=None),
    "block": lambda: kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=4, seed=1),
    "sketch": lambda: kvcert.PoissonPress(compression_ratio=0.6, sinks=2, window=8, seed=2,
                                          sketch=F.ClusterDesign(clusters=4, radius="chebyshev")),
    "tilted": lambda: kvcert.PoissonPress(compression_ratio=0.6, sinks=2, window=8, seed=2,
                                          sketch=F.ClusterDesign(clusters=4, radius="chebyshev", tilt=True)),
}
ROUTE_OF = {"token": "token", "block": "block", "sketch": "sketch", "tilted": "sketch"}
def _compressed(model, press, n=120, seed=0):
    """Prefill n tokens under ``press`` (entered by the caller) and take one decode step (buffers,
    moments and the forward's backend): the cache, its keyword and the next token."""
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))
    out = model(input_ids=ids, use_cache=True)
    cache, kw = cache_of(out), cache_keyword(model)
    nxt = out.logits[:, -1:].argmax(-1)
    model(input_ids=nxt, use_cache=True, **{kw: cache})
    return cache, kw, nxt


@pytest.mark.parametrize("chunk", [1, pytest.param(3, id="chunk3")])
@pytest.mark.parametrize("design", list(ROUTE_PRESSES))
def test_every_route_reads_the_device_once_per_forward(design, chunk):
    """One host read per decode forward (the NaN check over all layers) on every route of
    kvcert.dispatch.decode, for a one-token step and for a causal chunk of 3 queries."""
    model = tiny_model()
    press = ROUTE_PRESSES[design]()
    with torch.no_grad(), press(model):
        cache, kw, nxt = _compressed(model, press)
        assert {kvcert.dispatch.decode_route(layer) for layer in cache.layers} == {ROUTE_OF[design]}
        syncs = _host_syncs(lambda: model(input_ids=nxt.expand(1, chunk), use_cache=True, **{kw: cache}))
    assert model.config.num_hidden_layers >= 2  # one read per layer would be >= 2
    assert syncs == 1


def test_the_validated_block_estimate_reads_the_device_per_call():
    """The control of the test above: the validated block estimate (what the block route ran before)
    reads the device several times per call, so the count of one per forward is not vacuous."""
    model = tiny_model()
    press = ROUTE_PRESSES["block"]()
    with torch.no_grad(), press(model):
        cache, _, _ = _compressed(model, press)
    layer = cache.layers[0]
    q = torch.randn(1, 4, 16)
    kw = dict(log_pi=layer.log_weights, block_size=layer.block_size, positions=layer.positions,
              per_coordinate=False)
    assert _host_syncs(lambda: F.block_hajek_attention(q, layer.keys, layer.values, **kw)) >= 4
    # validate=False skips the block checks (padding positions, pi equal per block) and the token
    # estimator's value checks; its empty rows are filled without asking whether there are any
    assert _host_syncs(lambda: F.block_hajek_attention(q, layer.keys, layer.values, validate=False, **kw)) == 0
    # the skipped checks are what make the difference, and skipping them changes no number
    a = F.block_hajek_attention(q, layer.keys, layer.values, **kw)
    b = F.block_hajek_attention(q, layer.keys, layer.values, validate=False, **kw)
    for name in ("output", "trace", "lse", "n_eff"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_block_validate_false_skips_only_the_checks():
    """block_hajek_attention(validate=False) is the validated estimate on valid input (every optional
    field), and what validate=True refuses (pi unequal within a block) it does not read."""
    g = torch.Generator().manual_seed(5)
    b, h_kv, n, d, bs = 2, 2, 24, 8, 4
    q, k, v = torch.randn(b, 4, 3, d, generator=g), torch.randn(b, h_kv, n, d, generator=g), \
        torch.randn(b, h_kv, n, 6, generator=g)
    pib = torch.rand(b, h_kv, n // bs, generator=g).clamp(0.1, 1.0)
    pi = pib.repeat_interleave(bs, dim=-1)
    pi[..., -2:] = 1.0  # decoded tokens: certain, units of their own
    pi[1, 0, 4:8] = 0.0  # an unsampled block: padding
    pos = torch.arange(n).expand(b, h_kv, n).clone()
    pos[1, 0, 4:8] = -1
    opts = dict(block_size=bs, positions=pos, return_max_term=True, return_tail_moment=True, return_weights=True,
                query_positions=torch.full((b, 3), n))
    a = F.block_hajek_attention(q, k, v, pi, **opts)
    c = F.block_hajek_attention(q, k, v, pi, validate=False, **opts)
    for name in ("output", "weights", "variance", "trace", "lse", "n_eff", "max_term", "tail_moment"):
        assert torch.equal(getattr(a, name), getattr(c, name)), name
    bad = pi.clone()
    bad[0, 1, 1] *= 0.5
    with pytest.raises(ValueError, match="equal on all sampled tokens"):
        F.block_hajek_attention(q, k, v, bad, **opts)
    F.block_hajek_attention(q, k, v, bad, validate=False, **opts)


@pytest.mark.parametrize("design", list(ROUTE_PRESSES))
def test_every_route_goes_through_dispatch_decode(monkeypatch, design):
    """The session has one decode entry: kvcert.dispatch.decode once per layer and forward, on the
    route of what the layer holds; what it returns is what the model reads and the press records."""
    import kvcert.dispatch

    seen = []
    original = kvcert.dispatch.decode

    def spy(query, layer, **kw):
        dec = original(query, layer, **kw)
        seen.append((query.shape[2], dec))
        return dec

    monkeypatch.setattr(kvcert.dispatch, "decode", spy)
    model = tiny_model()
    press = ROUTE_PRESSES[design]()
    ids = torch.randint(1, 96, (1, 120), generator=torch.Generator().manual_seed(0))
    cont = [torch.tensor([[5 + t]]) for t in range(2)]
    forced_logits(model, ids, cont, press)
    n_layers = model.config.num_hidden_layers
    assert len(seen) == 2 * n_layers
    certs = press.certificates
    for i, (t, dec) in enumerate(seen):
        step, layer = 1 + i // n_layers, i % n_layers
        assert dec.route == ROUTE_OF[design] and dec.output.shape == (1, t, 4, 16)
        assert len(dec.records) == t
        est = dec.records[0].estimate
        assert torch.equal(dec.output[:, 0], est.output)
        assert torch.equal(certs.trace[:, step, layer], est.trace.float())


def test_dispatch_decode_refuses_a_softcap_off_the_token_route():
    from types import SimpleNamespace

    q = torch.randn(1, 4, 1, 16)
    for holds in ({"block_size": 4, "sketch": None}, {"block_size": None, "sketch": object()}):
        layer = SimpleNamespace(**holds)
        with pytest.raises(ValueError, match="softcap"):
            kvcert.dispatch.decode(q, layer, scale=0.25, options={}, softcap=2.0)
    assert kvcert.dispatch.decode_route(SimpleNamespace(block_size=None, sketch=None)) == "token"
    assert set(kvcert.dispatch.DECODE_ROUTES) == set(ROUTE_OF.values())


def test_nan_in_the_cache_is_refused_at_the_step():
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 30), generator=torch.Generator().manual_seed(1))
    press = kvcert.PoissonPress(compression_ratio=0.5, sinks=2, window=4, seed=0, sketch=None)
    with torch.no_grad(), press(model):
        out = model(input_ids=ids, use_cache=True)
        cache, kw = cache_of(out), cache_keyword(model)
        layer = cache.layers[1]
        layer.values[0, 0, 3] = float("nan")  # a held slot (the sinks alone hold 2, the budget 15)
        with pytest.raises(ValueError, match="NaN at this decoding step"):
            model(input_ids=ids[:, -1:], use_cache=True, **{kw: cache})


@pytest.mark.parametrize("kind", list(F.PLAIN_KINDS))
def test_deferred_certificates_equal_certificate_of_each_step(monkeypatch, kind):
    """The recorder keeps statistics and computes the radii at the end: the same numbers as
    kvcert.fast.certificate on each step's estimate."""
    import kvcert.dispatch

    model = tiny_model(seed=2)
    seen = []
    original = kvcert.dispatch.hajek_attention

    def spy(*a, **k):
        est = original(*a, **k)
        seen.append(est)
        return est

    monkeypatch.setattr(kvcert.dispatch, "hajek_attention", spy)
    ids = torch.randint(1, 96, (2, 48), generator=torch.Generator().manual_seed(4))
    press = kvcert.PoissonPress(compression_ratio=0.6, sinks=2, window=4, seed=5, kind=kind, delta=0.1)
    forced_logits(model, ids, torch.tensor([[7], [9], [11]]), press)
    certs = press.certificates
    n_layers = model.config.num_hidden_layers
    assert len(seen) == 3 * n_layers and certs.radius.shape[1] == 4
    for i, est in enumerate(seen):
        step, layer = 1 + i // n_layers, i % n_layers
        cert = F.certificate(est, delta=0.1, kind=kind)
        radius = cert.radius if cert.radius.dim() == est.trace.dim() else torch.linalg.vector_norm(cert.radius, dim=-1)
        np.testing.assert_array_equal(certs.radius[:, step, layer].numpy(), radius.float().numpy())
        np.testing.assert_array_equal(certs.relative_radius[:, step, layer].numpy(),
                                      cert.relative_radius.float().numpy())
    assert bool((certs.radius[:, 1:] > 0).any())
