"""The compacted layout of a token design in a paged cache (kvcert.fast.compact_slots) against its oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcert.fast as F
import kvcert.reference as R


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), heads=st.integers(1, 4), n=st.integers(1, 90), bs=st.sampled_from([1, 4, 16, 32]),
       p=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_layout_equals_oracle(layers, heads, n, bs, p, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(layers, heads, n, generator=g) < p
    pi = torch.where(keep, torch.rand(layers, heads, n, generator=g).clamp_min(1e-3), torch.rand(layers, heads, n))
    c = F.compact_slots(keep, pi, bs)
    cmax = int(keep.sum(-1).max())
    assert c.m == math.ceil(cmax / bs) and c.positions.shape == (layers, heads, c.m * bs)
    for l in range(layers):
        for h in range(heads):
            o = R.compact_slots(keep[l, h].numpy(), pi[l, h].numpy(), bs)
            k = o["count"]
            assert int(c.counts[l, h]) == k
            np.testing.assert_array_equal(c.positions[l, h, :k].numpy(), o["positions"][:k])
            # torch's and NumPy's float64 log may differ in the last bit
            np.testing.assert_allclose(c.log_pi[l, h, :k].numpy(), o["log_pi"][:k], rtol=4 * np.finfo(float).eps,
                                       atol=4 * np.finfo(float).eps)
            assert (c.positions[l, h, k:] == -1).all() and torch.isneginf(c.log_pi[l, h, k:]).all()
    # what a paged engine frees: the full prompt blocks past the compacted ones, never the partial last block
    assert c.freed_blocks == max(0, n // bs - c.m)
    assert c.held_blocks == math.ceil(n / bs) - c.freed_blocks
    assert 0 <= c.memory() <= 1 and (c.memory() > 0) == (c.held_blocks > 0)


def test_memory_counts_padding_and_side_buffer():
    keep = torch.zeros(2, 2, 100, dtype=torch.bool)
    keep[0, 0, :40] = True  # the largest head sets m for every head: 40 tokens -> 2 blocks of 32
    keep[1, 1, :5] = True
    c = F.compact_slots(keep, torch.full((2, 2, 100), 0.5), 32)
    assert (c.m, c.full_blocks, c.freed_blocks, c.held_blocks) == (2, 3, 1, 3)
    assert c.memory() == 3 / 4
    assert c.memory(64) == pytest.approx((3 * 32 * 128 + 2 * 32) / (4 * 32 * 128))
    assert c.blocks(1) == 1


@pytest.mark.parametrize("bad, match", [
    (dict(keep=torch.ones(3, 5)), "keep must be a bool"),
    (dict(pi=torch.ones(3, 4)), "pi must have keep's shape"),
    (dict(pi=torch.zeros(3, 5)), r"pi must lie in \(0, 1\]"),
    (dict(block_size=0), "block_size must be an int >= 1"),
])
def test_refusals_name_the_argument(bad, match):
    args = dict(keep=torch.ones(3, 5, dtype=torch.bool), pi=torch.ones(3, 5), block_size=4) | bad
    with pytest.raises(ValueError, match=match):
        F.compact_slots(**args)
