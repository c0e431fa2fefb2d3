"""TokenDesign.event: a design's whole eviction event in one call, the one the press and the vLLM plugin make.

The event is scores -> budget (the sampled budget, or an error target's per-head budgets) -> decision ->
sketch. Checked here: each branch equals the design's own steps composed by hand (what the press and the
plugin each did before they called the event), the press's prefill keeps exactly the event's sample in a
padded batch, and the pieces a caller relies on (queries read, nothing evicted below the budget).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvcert
from kvcert.fast import TokenDesign

H_Q, H_KV, D = 4, 2, 16


def _inputs(n: int, seed: int = 0, w: int = 40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H_Q, w, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, H_KV, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, H_KV, n, D, generator=g, dtype=torch.float64)
    return q, k, v


def _by_hand(design: TokenDesign, q, k, v, layer: int):
    """The event's steps composed as the plugin composed them before the event existed."""
    n = k.shape[2]
    u = design.score(q, k, v, layer=layer)
    if design.target_error is not None:
        chosen = design.target_budget(q, k, v, u)
        budget = chosen.sampled[0] if bool(chosen.evicts.any()) else float(n)
    else:
        budget = design.sampled_budget(n, k.shape[-1], v.shape[-1])
    decision = design.decide(u[0], layer=layer, event=0, budget=budget)
    return decision, design.sketch_of(k, v, decision, queries=q)


@pytest.mark.parametrize("fields", [dict(compression_ratio=0.5),  # the paper design
                                    dict(compression_ratio=0.6, sketch="tilted", kind="tilted_hull",
                                         sampling="systematic"),  # the recommended design
                                    dict(target_error=2.0, kind="chebyshev")])
def test_the_event_is_the_designs_steps_composed(fields):
    design = TokenDesign(seed=3, **fields)
    q, k, v = _inputs(300)
    ev = design.event(q, k, v, layer=2)
    decision, sketch = _by_hand(design, q, k, v, layer=2)
    assert ev.sampled and ev.evicts
    assert torch.equal(ev.decision.keep, decision.keep)
    assert torch.equal(ev.decision.pi, decision.pi)
    assert (ev.sketch is None) == (sketch is None) == (design.sketch is None)
    if sketch is not None:
        tensors = [f.name for f in dataclasses.fields(sketch) if isinstance(getattr(sketch, f.name), torch.Tensor)]
        assert "count" in tensors or len(tensors) >= 3
        for name in tensors:
            assert torch.equal(getattr(ev.sketch, name), getattr(sketch, name)), name
    assert (ev.target is not None) == (design.target_error is not None)


def test_a_target_no_head_needs_to_evict_keeps_every_token():
    """Random keys are hard to sample: at eps = 0.2 every head's predicted radius needs the whole prompt, so the
    event keeps every token (pi 1, no sketch) and still reports what the target chose."""
    design = TokenDesign(seed=3, target_error=0.2)
    q, k, v = _inputs(300)
    ev = design.event(q, k, v, layer=2)
    assert ev.target is not None and not bool(ev.target.evicts.any())
    assert not ev.sampled and bool(ev.decision.keep.all()) and ev.budget == 300.0


def test_the_event_reads_the_window_a_tilt_or_a_target_needs():
    """The scorer "random" reads no query; the tilted sketch's tilt and an error target read the observation
    window, so the event asks for it (else the tilt would have no query to average)."""
    tilted = TokenDesign(compression_ratio=0.5, scorer="random", sketch="tilted", kind="tilted_hull")
    paper = TokenDesign(compression_ratio=0.5, scorer="random")
    assert tilted.event_queries(100, 500) == tilted.observation_window == 32
    assert paper.event_queries(100, 500) == paper.queries_read(100, 500)
    assert TokenDesign(target_error=0.1, scorer="random").event_queries(10, 500) == 10  # all there are


def test_nothing_is_scored_or_evicted_at_or_below_the_budget():
    design = TokenDesign(compression_ratio=0.5, sketch="tilted", kind="tilted_hull")
    # budget 15 tokens less the tilted sketch's (8 (4 16 + 4) + 33) / 33 = 17.5: no sampled token fits
    q, k, v = _inputs(30)
    assert not design.evicts(30, D, D) and design.evicts(300, D, D)
    ev = design.event(q, k, v, scores=torch.full((1, H_KV, 30), float("nan")))  # never read
    assert not ev.sampled and not ev.evicts and ev.sketch is None
    assert bool((ev.decision.pi == 1).all()) and ev.budget == 30.0


def test_one_sequences_tokens_only():
    q, k, v = _inputs(100)
    with pytest.raises(ValueError, match="keys: one sequence"):
        TokenDesign(compression_ratio=0.5).event(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1))


def test_the_press_keeps_the_events_sample_in_a_padded_batch(monkeypatch):
    """The press's prefill event is the design's event on each row's real tokens: a row padded on the left in
    a batch keeps, per KV head, exactly the positions the event draws on that row alone (negative control: a
    different seed's event keeps other positions, so the comparison can fail)."""
    from model_fixtures import forced_logits, tiny_family_model

    model = tiny_family_model("llama")
    g = torch.Generator().manual_seed(0)
    long, short = torch.randint(3, 256, (1, 200), generator=g), torch.randint(3, 256, (1, 150), generator=g)
    events = []
    original = TokenDesign.event

    def spy(self, queries, keys, values, **kw):
        out = original(self, queries, keys, values, **kw)
        events.append((kw["layer"], keys.shape[2], self, queries, keys, values, kw, out))
        return out

    monkeypatch.setattr(TokenDesign, "event", spy)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 50, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    _, cache = forced_logits(model, ids, [], kvcert.PoissonPress(compression_ratio=0.5, seed=1), mask=mask)
    layer0 = [e for e in events if e[0] == 0]
    assert sorted(e[1] for e in layer0) == [150, 200]
    for row, n in ((0, 200), (1, 150)):
        _, _, design, q, k, v, kw, ev = next(e for e in layer0 if e[1] == n)
        kept = cache.layers[0].positions[row]
        assert kept.shape[0] == ev.decision.keep.shape[0]
        for h in range(kept.shape[0]):
            got = sorted(p for p in kept[h].tolist() if p >= 0)
            assert got == ev.decision.keep[h].nonzero().flatten().tolist()
        other = original(dataclasses.replace(design, seed=2), q, k, v, **kw)
        assert not torch.equal(other.decision.keep, ev.decision.keep)
