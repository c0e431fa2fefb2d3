"""PoissonPress(allocation="neyman"): budgets per (layer, KV head) from the design's predicted variance, at the
memory of the uniform budget, with floors (kvcert/presses/allocation.py, kvcert.fast.allocation).

The reference is the rule as benchmarks/bench_frontier.py's AllocatedPress wrote it (every layer's window terms
in one objective_tables call from a recorded prefill, each table cut below the floor, allocate_from_tables at
round(f n) x heads), then each head sampled by TokenDesign.decide at its budget: the press, which runs inside the
prefill without kvcert.prefill, must keep the same tokens. A tiny random-weight Llama (model_fixtures:
2 layers, 2 KV heads of dim 16).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from model_fixtures import forced_logits, tiny_family_model

import kvcert
import kvcert.fast as F
from kvcert import cli
from kvcert.fast import allocation as A
from kvcert.generation.prefilled import recorded_prefill

N = 300
PAD = 40
SEED = 3


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_family_model("llama")


def _batch():
    """Two rows: N tokens, and N - PAD tokens left-padded (ids and mask)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 256, (2, N), generator=g)
    mask = torch.ones(2, N, dtype=torch.long)
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
    return ids, mask


def _reference(f: float, floor_share: float = 0.5, step: int = 4):
    """Per row: (budgets {layer: (h_kv,) int64}, kept positions {layer: [per head sorted positions]}) by the
    benchmark's rule on a recorded exact prefill."""
    ids, mask = _batch()
    with torch.no_grad():
        _, cache, _ = recorded_prefill(_model(), ids, mask, None, False)
    design = F.TokenDesign(compression_ratio=1 - f, seed=SEED)
    out = []
    for r in range(ids.shape[0]):
        layers = [(i, l) for i, l in enumerate(cache.layers) if l.compressible]
        T, O, S, per = [], [], [], []
        for i, layer in layers:
            valid = layer.valid[r:r + 1]
            idx = valid[0, 0].nonzero().squeeze(-1)
            k, v = layer.keys[r:r + 1][:, :, idx], layer.values[r:r + 1][:, :, idx]
            q = layer.queries[r:r + 1][:, :, idx]
            u = design.score(q, k, v, scale=layer.query_scale, layer=i, event=0)
            t, o2 = F.window_variance_terms(q[:, :, -design.observation_window:], k, v, scale=layer.query_scale)
            T.append(t[0]), O.append(o2[0]), S.append(F.nonnegative_importance(u[0].to(torch.float64)))
            per.append((i, u, layer.positions[r][:, idx]))
        n = int(layers[0][1].valid[r, 0].sum())
        tables = A.objective_tables(torch.cat(T), torch.cat(O), torch.cat(S), sinks=design.sinks, window=design.window,
                                    top_fraction=design.top_fraction, floor=design.floor, step=step)
        total = int(round(f * n)) * len(tables)
        floor_b = max(design.sinks + design.window + 1, math.ceil(floor_share * f * n))
        cut = []
        for tab in tables:
            keep = (tab.budgets >= floor_b) | (tab.budgets == tab.budgets[-1])
            cut.append(A.ObjectiveTable(tab.budgets[keep], tab.values[keep]))
        budget = A.allocate_from_tables(cut, total).budget
        h_kv = layers[0][1].keys.shape[1]
        budgets, kept = {}, {}
        for j, (i, u, pos) in enumerate(per):
            b = budget[j * h_kv:(j + 1) * h_kv]
            budgets[i] = b
            d = design.decide(u[0], layer=i, event=0, budget=b.to(torch.float64).clamp(max=float(n)))
            kept[i] = [sorted(pos[h][d.keep[h]].tolist()) for h in range(h_kv)]
        out.append((budgets, kept, total, n))
    return out


def _press_run(press):
    ids, mask = _batch()
    _, cache = forced_logits(_model(), ids, torch.tensor([[5]]), press, mask=mask)
    kept = {}
    for i, layer in enumerate(cache.layers):
        # the decoded token (position >= its row's prompt length) is not part of the prefill's sample
        kept[i] = [[sorted(p for p in layer.positions[r, h][layer.valid[r, h]].tolist() if p < N - PAD * r)
                    for h in range(layer.keys.shape[1])] for r in range(ids.shape[0])]
    return kept


@pytest.mark.parametrize("f", [0.5, 0.75])
def test_press_keeps_the_benchmark_rules_tokens(f):
    """Same budgets per (layer, KV head) and the same kept tokens as the benchmark's rule, row by row (a padded
    row included), the press running inside an ordinary prefill (no kvcert.prefill). Negative control: the
    uniform press at the same ratio and seed keeps other tokens, and the budgets are not all round(f n)."""
    ref = _reference(f)
    press = kvcert.PoissonPress(compression_ratio=1 - f, allocation="neyman", seed=SEED)
    kept = _press_run(press)
    for r, (budgets, ref_kept, total, n) in enumerate(ref):
        row = press.allocations[r]
        assert row.n == n and row.total == total and row.layers == tuple(budgets)
        for j, i in enumerate(row.layers):
            assert torch.equal(row.budgets[j], budgets[i]), (r, i)
            assert kept[i][r] == ref_kept[i], (r, i)
        assert bool((row.budgets != round(f * n)).any())  # not the uniform design
    uniform = _press_run(kvcert.PoissonPress(compression_ratio=1 - f, seed=SEED, sketch=None))
    assert uniform != kept


def test_allocation_spends_the_uniform_budgets_memory():
    """Expected memory: each head's expected kept count is its budget (sum pi = B), and the budgets sum to the
    uniform total round(f n) x heads, within H/2 of the fixed-ratio press's f n H. Realized memory: over 6
    seeds the mean kept count of the allocated press and of the fixed-ratio press differ by less than
    4 sqrt((V_a + V_f) / 6), V <= sum B (Poisson: Var = sum pi (1 - pi) <= sum pi); negative control: the
    fixed press at ratio 0.6 lies outside that band."""
    f, seeds = 0.5, range(6)

    def kept_total(press):
        k = _press_run(press)
        return sum(len(h) for i in k for h in k[i][0])  # row 0

    alloc = kvcert.PoissonPress(compression_ratio=1 - f, allocation="neyman", seed=0)
    _press_run(alloc)
    row = alloc.allocations[0]
    heads = row.budgets.numel()
    assert int(row.budgets.sum()) == row.total == round(f * N) * heads
    assert abs(int(row.budgets.sum()) - f * N * heads) <= heads / 2
    a = np.mean([kept_total(kvcert.PoissonPress(compression_ratio=1 - f, allocation="neyman", seed=s)) for s in seeds])
    fixed = np.mean([kept_total(kvcert.PoissonPress(compression_ratio=1 - f, seed=s, sketch=None)) for s in seeds])
    band = 4 * math.sqrt(2 * f * N * heads / len(seeds))
    assert abs(a - fixed) <= band, (a, fixed, band)
    other = np.mean([kept_total(kvcert.PoissonPress(compression_ratio=0.6, seed=s, sketch=None)) for s in seeds])
    assert abs(a - other) > band, (a, other, band)


def test_a_budget_too_small_for_the_certainty_set_runs_the_uniform_design():
    """round(B) < sinks + window + 1: the row runs the ratio's uniform design (allocations[row] None)."""
    ids = torch.randint(3, 256, (1, 60), generator=torch.Generator().manual_seed(2))
    cont = torch.tensor([[5]])
    press = kvcert.PoissonPress(compression_ratio=0.5, allocation="neyman", seed=1)
    _, c1 = forced_logits(_model(), ids, cont, press)
    _, c2 = forced_logits(_model(), ids, cont, kvcert.PoissonPress(compression_ratio=0.5, seed=1, sketch=None))
    assert press.allocations == {0: None}
    for l1, l2 in zip(c1.layers, c2.layers):
        assert torch.equal(l1.positions, l2.positions) and torch.equal(l1.log_weights, l2.log_weights)


@pytest.mark.parametrize("kwargs, match", [
    (dict(compression_ratio=0.5, allocation="optimal"), "allocation must be None or one of"),
    (dict(compression_ratio=0.5, allocation=True), "allocation must be None or one of"),
    (dict(compression_ratio=0.5, allocation="neyman", allocation_floor=1.5), "allocation_floor"),
    (dict(compression_ratio=0.5, allocation="neyman", allocation_floor=True), "allocation_floor"),
    (dict(compression_ratio=0.5, allocation="neyman", allocation_step=0), "allocation_step"),
    (dict(compression_ratio=0.5, allocation="neyman", allocation_step=2.0), "allocation_step"),
    (dict(target_error=0.1, allocation="neyman"), "not target_error"),
    (dict(allocation="neyman"), "compression_ratio > 0 or target_size"),
    (dict(compression_ratio=0.5, allocation="neyman", sketch="tilted"), "sketch"),
    (dict(compression_ratio=0.5, allocation="neyman", preset="recommended"), "sketch"),
    (dict(compression_ratio=0.5, allocation="neyman", kind="wald"), "kind"),
    (dict(compression_ratio=0.5, allocation="neyman", kv_bits=8), "kv_bits"),
])
def test_bad_options_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kvcert.PoissonPress(**kwargs)


def test_defaults_and_target_size():
    p = kvcert.PoissonPress(compression_ratio=0.5, allocation="neyman")
    assert (p.sketch, p.kind, p.sampling, p.allocation_floor, p.allocation_step) == (None, "chebyshev", "poisson",
                                                                                      0.5, 4)
    assert kvcert.PoissonPress(target_size=100, allocation="neyman").design.budget(300) == 100.0
    assert kvcert.PoissonPress(compression_ratio=0.5).allocation is None


def test_refused_under_decoding_press():
    press = kvcert.DecodingPress(kvcert.PoissonPress(compression_ratio=0.5, allocation="neyman"),
                                 compression_interval=4)
    ids = torch.randint(3, 256, (1, 80), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="does not run under DecodingPress"):
        forced_logits(_model(), ids, torch.tensor([[5]]), press)


def test_token_design_event_takes_per_head_budgets():
    """event(budget=...) samples each head at its budget, exactly as decide does; every head >= n keeps all;
    a budget of the wrong shape or dtype is refused by name."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 2, 120, 16, generator=g),
               torch.randn(1, 2, 120, 16, generator=g))
    design = F.TokenDesign(compression_ratio=0.5, seed=2)
    b = torch.tensor([50.0, 90.0], dtype=torch.float64)
    ev = design.event(q, k, v, layer=1, budget=b)
    want = design.decide(design.score(q, k, v, layer=1)[0], layer=1, budget=b)
    assert torch.equal(ev.decision.keep, want.keep) and torch.equal(ev.decision.pi, want.pi)
    assert torch.allclose(ev.decision.pi.sum(-1), b)
    assert not torch.equal(ev.decision.keep, design.event(q, k, v, layer=1).decision.keep)  # not the ratio's
    assert not design.event(q, k, v, budget=torch.tensor([120.0, 500.0])).sampled
    for bad in (torch.tensor([50.0]), torch.tensor([50, 60]), [50.0, 60.0]):
        with pytest.raises(ValueError, match="budget"):
            design.event(q, k, v, budget=bad)


def test_allocate_at_uniform_memory_floors_and_total():
    """Every head at or above the floor (or at n_h), the sum at most round(B) H; a head shorter than the floor
    keeps all; a floor the grid cannot reach under the total is refused naming floor_share."""
    g = torch.Generator().manual_seed(1)
    terms = torch.rand(4, 8, 200, generator=g, dtype=torch.float64)
    terms[0] *= 50
    tables = A.objective_tables(terms, torch.ones(4, 8, dtype=torch.float64),
                                torch.rand(4, 200, generator=g, dtype=torch.float64), sinks=4, window=8, step=3)
    out = A.allocate_at_uniform_memory(tables, 80.0, floor_share=0.5, sinks=4, window=8)
    assert out.total == 320 and out.floor == 40
    assert int(out.allocation.budget.sum()) <= 320 and bool((out.allocation.budget >= 40).all())
    assert int(out.allocation.budget[0]) > 80  # the high-variance head takes more than the uniform budget
    free = A.allocate_from_tables(tables, 320).budget
    assert bool((free < 40).any())  # without the floor some head goes below it (the floor binds)
    short = tables[:3] + [A.ObjectiveTable(np.array([13, 16, 19, 22, 25, 28, 30]), np.linspace(1, 0, 7))]
    assert int(A.allocate_at_uniform_memory(short, 80.0, sinks=4, window=8).allocation.budget[3]) == 30
    with pytest.raises(ValueError, match="floor_share"):
        A.allocate_at_uniform_memory(tables, 80.0, floor_share=1.0, sinks=4, window=8)
    for bad in (dict(budget=0.0), dict(budget=float("nan"))):
        with pytest.raises(ValueError, match="budget"):
            A.allocate_at_uniform_memory(tables, floor_share=0.5, **bad)
    with pytest.raises(ValueError, match="floor_share"):
        A.allocate_at_uniform_memory(tables, 80.0, floor_share=-0.1)


def test_cli_allocation_option():
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--allocation", "neyman",
                                          "--compression-ratio", "0.75"])
    press = cli.make_press(args)
    assert (type(press), press.allocation, press.compression_ratio) == (kvcert.PoissonPress, "neyman", 0.75)
    args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--allocation", "neyman", "--press", "snapkv"])
    with pytest.raises(cli.UsageError, match="--allocation does not apply"):
        cli.make_press(args)
    with pytest.raises(cli.UsageError):
        cli.build_parser().parse_args(["generate", "--prompt", "x", "--allocation", "optimal"])
