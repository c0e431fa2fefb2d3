"""The cluster (sketch) design in the Hugging Face path: ``PoissonPress(sketch=...)`` (issue 14).

What is checked, each against an independent computation:

- ``kvcert.fast.evict(..., sketch=)`` keeps the eviction itself unchanged and its sketch is
  ``cluster_sketch`` of the same cache, pi and sample (reconstructed from the kept positions);
- ``ClusterSketch.map`` / ``cat`` round-trip a batch;
- the press samples B - (C (2d + 3) + dv + 1) / (d + dv + 1) expected tokens (equal memory), every
  real token of a head is either held or counted in its sketch, and each decode step records
  V_cl of ``sketch_hajek_attention`` on the layer's state as its trace, with the Chebyshev radius
  sqrt(V_cl / delta);
- a chunk of queries is causal: its j-th query's certificate is the one-query step over the slots
  at or before its position;
- a sequence gets the same sketch and certificates alone or in a padded batch;
- the same for the tilted sketch (``sketch="tilted"``), whose tilt point is the mean of the last
  ``observation_window`` prefill queries of each KV head's query group;
- bad configurations are refused with the argument named.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvcert
import kvcert.fast as F
from kvcert.cache import cache_keyword
from model_fixtures import cache_of, forced_logits, tiny_model
from support import random_cache

CHEB = F.ClusterDesign(clusters=4, radius="chebyshev")
TILT = F.ClusterDesign(clusters=4, radius="chebyshev", tilt=True)


def test_evict_with_a_sketch_is_the_same_eviction_and_the_sketch_of_its_sample():
    k, v, u = random_cache(2, 2, 60, dv=6)
    kw = dict(sinks=2, window=4, top=5, seed=3, layer=1)
    plain = F.evict(k, v, u, 25.0, **kw)
    cc = F.evict(k, v, u, 25.0, sketch=CHEB, **kw)
    for name in ("keys", "values", "pi", "positions", "kept"):
        assert torch.equal(getattr(cc, name), getattr(plain, name)), name
    assert plain.sketch is None
    # the sample, from the kept positions; pi over every token, from the design alone
    real = cc.positions >= 0
    keep = torch.zeros(u.shape, dtype=torch.long).scatter_add_(-1, cc.positions.clamp(min=0), real.long()) > 0
    pi = F.inclusion_probabilities(u, 25.0, sinks=2, window=4, top=5)
    want = F.cluster_sketch(k, v, pi, keep, CHEB)
    for name in ("mean", "var", "weight", "wnorm", "count", "mu"):
        assert torch.allclose(getattr(cc.sketch, name), getattr(want, name), rtol=1e-12, atol=1e-12), name
    # every token is held or counted in the sketch
    assert torch.equal(cc.sketch.count.sum(-1) + cc.kept, torch.full_like(cc.kept, u.shape[-1]).double())


def test_sketch_map_and_cat_round_trip_a_batch():
    k, v, u = random_cache(3, 2, 60, dv=6)
    s = F.evict(k, v, u, 25.0, sinks=2, window=4, seed=0, sketch=CHEB).sketch
    rows = [s.map(lambda x, i=i: x[i:i + 1]) for i in range(3)]
    back = F.ClusterSketch.cat(rows)
    assert all(torch.equal(getattr(back, f), getattr(s, f)) for f in ("mean", "var", "weight", "wnorm", "count", "mu"))
    assert (back.rule, back.multiplier) == (s.rule, s.multiplier)
    with pytest.raises(ValueError, match="at least one"):
        F.ClusterSketch.cat([])
    other = F.evict(k, v, u, 25.0, sinks=2, window=4, seed=0, sketch=F.ClusterDesign(clusters=3, radius="chebyshev")).sketch
    with pytest.raises(ValueError, match="share"):
        F.ClusterSketch.cat([s, other])


def _spy(monkeypatch):
    """Record every sketch decode step, on any code of kvcert.dispatch's sketch route (kvcert.fast, or the
    compiled CPU op where it builds: its checked call, or its per-step call ``validate=False`` on a forward's
    resolved route)."""
    import importlib

    calls = []

    def wrap(original):
        def spy(q, keys, values, pi, sketch, **kw):
            ce = original(q, keys, values, pi, sketch, **kw)
            calls.append(dict(q=q.clone(), keys=keys.clone(), values=values.clone(), log_pi=kw["log_pi"].clone(),
                              sketch=sketch, scale=kw["scale"], ce=ce))
            return ce
        return spy

    monkeypatch.setattr(F, "sketch_hajek_attention", wrap(F.sketch_hajek_attention))
    cpu = importlib.import_module("kvcert.kernels.cpu")
    monkeypatch.setattr(cpu, "sketch_hajek_attention", wrap(cpu.sketch_hajek_attention))
    return calls


def _sketched_variance(call):
    """What the spied decode step's certificate reads: max(V_cl, HT trace) of the call's inputs (torch path)."""
    pi = call["log_pi"].exp()
    v_cl = F.cluster_variance(call["q"], call["keys"], call["values"], pi, call["sketch"], output=call["ce"].output,
                              scale=call["scale"])
    ht = F.hajek_attention(call["q"], call["keys"], call["values"], pi, scale=call["scale"], per_coordinate=False)
    return F.sketched_variance(v_cl, ht.trace)


@pytest.mark.parametrize("design", [CHEB, TILT], ids=["cluster", "tilted"])
def test_press_samples_at_equal_memory_and_records_v_cl(monkeypatch, design):
    model = tiny_model()
    n, steps = 120, 3
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(0))
    cont = [torch.tensor([[5 + t]]) for t in range(steps)]
    press = kvcert.PoissonPress(compression_ratio=0.6, seed=2, sinks=2, window=8, sketch=design)
    calls = _spy(monkeypatch)
    _, cache = forced_logits(model, ids, cont, press)
    d = dv = 16
    held = (4 * (4 * d + 4) + d + dv + 1 if design.tilt else 4 * (2 * d + 3) + dv + 1) / (d + dv + 1)
    certs = press.certificates[0]
    assert certs.shape == (steps + 1, 2, 4) and len(calls) == 2 * steps
    for li, layer in enumerate(cache.layers):
        assert layer.budgets[0].item() == pytest.approx(n * 0.4 - held)   # the pure budget less the sketch
        assert layer.sketch is not None and layer.sketch.clusters == 4
        assert (layer.sketch.tilt is not None) == design.tilt
        if not design.tilt:  # every prompt token of each head is held or counted in the sketch (decoded: held)
            assert torch.equal(layer.sketch.count.sum(-1).long() + layer.kept, torch.full_like(layer.kept, n + steps))
    for i, c in enumerate(calls):  # layer-major within a step: step s, layer l is call 2 s + l
        s, li = divmod(i, 2)
        assert c["sketch"] is not None and c["q"].shape == (1, 4, 16)
        want = _sketched_variance(c)
        # recorded: V = max(V_cl, HT trace) clipped at delta H^2 (H the hull bound): radius min(sqrt(V / delta), H)
        hull = c["ce"].bound.double()
        got = certs.trace[s + 1, li]
        assert torch.allclose(got.double(), torch.minimum(want.double(), press.delta * hull ** 2), rtol=1e-5), (s, li)
        assert torch.allclose(certs.radius[s + 1, li].double(),
                              torch.minimum((want.double() / press.delta).sqrt(), hull), rtol=1e-5)
    assert certs.kind == "chebyshev" and bool((certs.radius[1:] > 0).all())
    # the record counts the sketch's memory at every decoding step (not at the exact prefill, step 0)
    assert layer.sketch.elements == design.elements(d, dv)
    assert torch.equal(certs.sketch_memory[0], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.allclose(certs.sketch_memory[1:], torch.full((steps, 2, 4), held, dtype=torch.float64), rtol=1e-12)
    assert torch.equal(certs.memory, certs.kept.double() + certs.sketch_memory)
    # the sketch's value centre is the mean of all n prompt values of the head (kept or not)
    _, full = forced_logits(model, ids, cont)
    for li, layer in enumerate(cache.layers):
        values = full.layers[li].values[:, :, :n].double()
        assert torch.allclose(layer.sketch.mu.double(), values.mean(-2), rtol=1e-5, atol=1e-6)


def _decode_tokens(model, press, ids, tokens, *, chunk: bool):
    """Prefill ``ids`` under ``press``, then feed ``tokens`` as one chunk or one at a time."""
    with torch.no_grad(), press(model):
        cache = cache_of(model(input_ids=ids, use_cache=True))
        kw = cache_keyword(model)
        if chunk:
            model(input_ids=tokens, use_cache=True, **{kw: cache})
        else:
            for t in range(tokens.shape[1]):
                cache = cache_of(model(input_ids=tokens[:, t:t + 1], use_cache=True, **{kw: cache}))
    return press.certificates[0]


@pytest.mark.parametrize("design", [CHEB, TILT], ids=["cluster", "tilted"])
def test_a_chunk_is_causal_and_equals_one_query_at_a_time(monkeypatch, design):
    model = tiny_model(seed=1)
    n = 100
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(1))
    tokens = torch.tensor([[7, 8, 9, 10]])
    make = lambda: kvcert.PoissonPress(compression_ratio=0.5, seed=4, sinks=2, window=8, sketch=design)  # noqa: E731
    calls = _spy(monkeypatch)
    chunked = _decode_tokens(model, make(), ids, tokens, chunk=True)
    first = (calls[0]["log_pi"] > float("-inf")).sum(-1)
    for j, c in enumerate(calls[:4]):  # layer 0's four queries: each sees the slots up to its own position
        assert torch.equal((c["log_pi"] > float("-inf")).sum(-1), first + j)
    single = _decode_tokens(model, make(), ids, tokens, chunk=False)
    assert chunked.shape == single.shape == (5, 2, 4)
    assert torch.allclose(chunked.trace[1:], single.trace[1:], rtol=1e-4)
    assert torch.equal(chunked.kept, single.kept)


@pytest.mark.parametrize("design", [CHEB, TILT], ids=["cluster", "tilted"])
def test_a_sequence_gets_the_same_certificates_alone_or_in_a_padded_batch(design):
    model = tiny_model(seed=2)
    g = torch.Generator().manual_seed(2)
    long, short = torch.randint(1, 96, (1, 110), generator=g), torch.randint(1, 96, (1, 80), generator=g)
    cont = [torch.tensor([[11 + t]]) for t in range(2)]
    make = lambda: kvcert.PoissonPress(compression_ratio=0.5, seed=5, sinks=2, window=8, sketch=design)  # noqa: E731
    ids = torch.cat([long, torch.cat([torch.zeros(1, 30, dtype=long.dtype), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    batch = make()
    forced_logits(model, ids, cont, batch, mask=mask)
    for row, x in ((0, long), (1, short)):
        alone = make()
        forced_logits(model, x, cont, alone)
        a, b = alone.certificates[0], batch.certificates[row]
        assert torch.equal(a.kept[1:], b.kept[1:]), row
        assert torch.allclose(a.trace[1:], b.trace[1:], rtol=1e-4), row


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"sketch": "page"}, ValueError, "sketch must be"),
    ({"sketch": 3}, TypeError, "sketch must be"),
    ({"sketch": True}, TypeError, "sketch must be"),
    ({"sketch": F.ClusterDesign()}, ValueError, "radius='chebyshev'"),
    ({"sketch": "cluster", "kind": "bernstein"}, ValueError, "kind='chebyshev'"),
    ({"sketch": "cluster", "kind": "tilted_hull"}, ValueError, "kind='tilted_hull'"),
    ({"kind": "tilted_hull", "sketch": None}, ValueError, "sketch='tilted', kind='tilted_hull'"),
    ({"sketch": SimpleNamespace(clusters=0, iterations=10, radius="chebyshev", multiplier=3.0)}, ValueError,
     "clusters must be an int >= 1"),
])
def test_sketch_configurations_are_refused_by_name(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        kvcert.PoissonPress(compression_ratio=0.5, **kwargs)


def test_the_tilt_is_the_observation_windows_mean_query_of_each_group(monkeypatch):
    """The tilted sketch's q0 of each layer and KV head is the mean of the last observation_window prefill
    queries over the head's query group (the queries the prefill event receives)."""
    model = tiny_model(seed=3)
    n, window = 90, 12
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(4))
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=1, sinks=2, window=8, observation_window=window,
                                sketch=TILT)
    seen = {}
    original = press.prefill_event

    def spy(layer, layer_idx, queries, scale):
        seen[layer_idx] = queries.detach().clone()
        return original(layer, layer_idx, queries, scale)

    monkeypatch.setattr(press, "prefill_event", spy)
    _, cache = forced_logits(model, ids, [torch.tensor([[3]])], press)
    for li, layer in enumerate(cache.layers):
        q = seen[li]
        assert q.shape[2] >= window
        h_kv = layer.keys.shape[1]
        g = q.shape[1] // h_kv
        want = torch.stack([q[0, j * g:(j + 1) * g, -window:].mean((0, 1)) for j in range(h_kv)])
        assert torch.allclose(layer.sketch.tilt[0].double(), want.double(), rtol=1e-6, atol=1e-6), li


def test_sketch_defaults_and_refusals_at_run_time():
    p = kvcert.PoissonPress(compression_ratio=0.5, sketch="cluster")
    assert p.sketch == F.ClusterDesign(clusters=16, radius="chebyshev")
    assert kvcert.PoissonPress(compression_ratio=0.5, sketch=None).sketch is None
    tilted = kvcert.PoissonPress(compression_ratio=0.5, sketch="tilted", observation_window=16)
    assert tilted.sketch == F.ClusterDesign(clusters=8, radius="chebyshev", tilt=True)
    # the tilt reads the observation window even for a scorer that reads no query
    assert kvcert.PoissonPress(compression_ratio=0.5, sketch="tilted", scorer="knorm").queries_needed(100) == 32
    assert kvcert.PoissonPress(compression_ratio=0.5, scorer="knorm", sketch=None).queries_needed(100) == 0
    with pytest.raises(ValueError, match="base_press: a sketched PoissonPress"):
        kvcert.DecodingPress(p, compression_interval=8)
    model = tiny_model()
    ids = torch.randint(1, 96, (1, 60), generator=torch.Generator().manual_seed(3))
    # a budget that cannot hold the sketch and one token evicts nothing (what the vLLM plugin does with such a
    # prompt), instead of an error: every token kept, no sketch
    tiny_budget = kvcert.PoissonPress(target_size=12, sinks=2, window=4, sketch="cluster")  # 16 clusters: 17.5 tokens
    with torch.no_grad(), tiny_budget(model):
        cache = cache_of(model(input_ids=ids, use_cache=True))
    assert all(layer.sketch is None and int(layer.kept.min()) == 60 for layer in cache.layers)
    assert tiny_budget.design.sampled_budget(60, 8, 8) == 60.0
    fits = kvcert.PoissonPress(target_size=30, sinks=2, window=4, sketch="cluster")
    with torch.no_grad(), fits(model):  # negative control: a budget that holds it evicts and sketches
        cache = cache_of(model(input_ids=ids, use_cache=True))
    assert all(layer.sketch is not None and int(layer.kept.max()) < 60 for layer in cache.layers)


def test_the_recommended_rule_is_recorded_with_the_tilted_sketch(monkeypatch):
    """PoissonPress(sketch="tilted", kind="tilted_hull") records min(3 sqrt(V), H), V = max(V_cl, HT trace): the
    radius of the registered kind on the larger of the tilted sketch's hybrid variance and the sample's HT trace,
    capped at the hull bound (the reference design's)."""
    model = tiny_model()
    n, steps = 120, 2
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(3))
    cont = [torch.tensor([[7 + t]]) for t in range(steps)]
    press = kvcert.PoissonPress(compression_ratio=0.6, seed=4, sinks=2, window=8, sketch="tilted", kind="tilted_hull")
    assert press.sketch.radius == "fixed" and press.sketch.multiplier == 3.0 and press.sketch.tilt
    calls = _spy(monkeypatch)
    forced_logits(model, ids, cont, press)
    certs = press.certificates[0]
    assert certs.kind == "tilted_hull" and len(calls) == 2 * steps
    capped = 0
    for i, c in enumerate(calls):
        s, li = divmod(i, 2)
        want = _sketched_variance(c).double()
        hull = c["ce"].bound.double()
        radius = torch.minimum(3.0 * want.sqrt(), hull)
        assert torch.allclose(certs.radius[s + 1, li].double(), radius, rtol=1e-5), (s, li)
        capped += int((hull < 3.0 * want.sqrt()).sum())
    # Chebyshev on the same variance would be sqrt(1/delta) / 3 = 1.49x looser wherever the cap does not bind
    print(f"hull cap binding in {capped} of {certs.radius[1:].numel()} (step, layer, head) radii")
