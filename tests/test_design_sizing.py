"""One design sizing: paper_repro's replay cells and PoissonPress build the same design.

The replay (Table 2) scores a captured prefix and builds pi with the float64
reference; the press scores its prefill queries and builds pi with
``kvcert.fast``. Both read the scorer registry and ``kvcert.fast.design_sizes``,
so the same inputs must give the same importance and the same pi, including
budgets below sinks + window, where the window shrinks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert
from kvcert.fast import SCORERS, design_sizes
from paper_repro import replay, synthetic


@pytest.mark.parametrize("n, fraction, top", [(300, 0.1, 0.5), (300, 0.25, 0.0), (1792, 0.5, 0.5),
                                              (40, 0.5, 0.5), (12, 0.5, 0.9)])
def test_replay_pi_equals_the_press_pi(n, fraction, top):
    rng = np.random.default_rng(n)
    u = rng.gamma(0.3, size=n)
    press = synthetic.paper_press(fraction, top_fraction=top)
    pi_replay = synthetic.press_pi(press, u)
    pi_press = press.inclusion_probabilities(torch.from_numpy(u)[None, None])[0, 0].numpy()
    np.testing.assert_allclose(pi_press, pi_replay, rtol=1e-9, atol=1e-12)
    sizes = press.design_sizes(n)
    assert pi_replay.sum() == pytest.approx(sizes.budget, rel=1e-9)
    assert sizes.sinks + sizes.window + sizes.top < sizes.budget  # something is sampled: pi > 0
    assert (pi_replay > 0).all()


@pytest.mark.parametrize("name", list(SCORERS))
def test_replay_importance_equals_the_press_importance(name):
    """replay.layer_importance (the T2 cells) is what PoissonPress(scorer=name) scores."""
    h_kv, g, T, L, d = 2, 3, 80, 64, 8
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(h_kv * g, T, d, generator=gen)
    keys, values = torch.randn(h_kv, T, d, generator=gen), torch.randn(h_kv, T, d, generator=gen)
    got = replay.layer_importance(name, queries, keys, values, L, 0.35, seed=5)
    press = kvcert.PoissonPress(compression_ratio=0.5, scorer=name, seed=5, kernel_size=7,
                                observation_window=synthetic.WINDOW)
    q = press._window_queries(queries[None, :, :L], L)
    want = press._score(q, keys[None, :, :L], values[None, :, :L], scale=0.35, layer=0, event=0)[0]
    np.testing.assert_array_equal(got, want.double().numpy())


@given(budget=st.floats(0.0, 500.0), sinks=st.integers(0, 8), window=st.integers(0, 64),
       top_fraction=st.floats(0.0, 0.95), randomized=st.booleans())
def test_design_sizes_fit_under_the_budget(budget, sinks, window, top_fraction, randomized):
    b, s, w, top = design_sizes(budget, sinks=sinks, window=window, top_fraction=top_fraction,
                                randomized=randomized)
    assert b == budget and 0 <= s <= sinks and 0 <= w <= window and top >= 0
    if randomized:
        assert s + w + top <= max(math.ceil(budget) - 1, 0)
        if budget > sinks + window + 1:
            assert (s, w) == (sinks, window)
    else:
        assert top == 0 and s + w <= int(budget)


@pytest.mark.parametrize("bad, match", [({"budget": -1.0}, "budget"), ({"budget": math.inf}, "budget"),
                                        ({"sinks": -1}, "sinks"), ({"top_fraction": 1.0}, "top_fraction")])
def test_design_sizes_errors(bad, match):
    kwargs = {"budget": 10.0, **bad}
    with pytest.raises(ValueError, match=match):
        design_sizes(kwargs.pop("budget"), **kwargs)
