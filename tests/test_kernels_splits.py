"""The split count of the decode kernels (``kvcert.kernels.hajek.num_splits_heuristic``) and the kernels at the
splits it picks.

The heuristic is a pure function of the launch (programs, tokens, tile) and the GPU's SM count, so its
answers are derived here by hand (the comments give the arithmetic) without a GPU. The kernels then run at
the split counts it picks for a 132-SM card (an H100 SXM or an H200), on Triton's CPU interpreter where
there is no GPU (the wrapper's SM count patched in), against the float64 oracle with the derived tolerances
of tests/kernel_support.py (the paged kernels' case is in tests/test_kernels_paged.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernel_support import DEVICE, KN, as_on_sms, assert_matches_oracle
from support import make_case

from kvcert.kernels import hajek as H  # noqa: E402  (after kernel_support: skipped without triton)

_make_case = functools.partial(make_case, device=DEVICE)
SMS = 132  # an H100 SXM's or an H200's streaming multiprocessors

# ----------------------------------------------------------------------------- the function, by hand

# e(s) = P s / (ceil(P s / C) C), C = sms * ctas_per_sm; s_max = min(128, C, n // 1024, ceil(n / block_n) // 4);
# the answer is the least s <= s_max with e(s) >= 0.85 max e.
HAND = [
    # b = 1, h_kv = 8: P = 8, n = 64k, tiles of 64: s_max = min(128, 132, 64, 256) = 64. For s <= 16,
    # 8 s <= 128 < 132 (one wave): e = 8 s / 132; s = 33 fills two waves exactly (264 = 2 x 132): best 1.
    # Least s with 8 s / 132 >= 0.85: s >= 14.03 -> 15 (120 / 132 = 0.909).
    ((8, 65536, 64, SMS), {}, 15),
    # the same launch at 4k tokens: s_max = min(4096 // 1024, 64 // 4) = 4; e = 8 s / 132 grows with s, best
    # 32 / 132 at 4: 0.85 x 32 = 27.2 <= 8 s -> s >= 3.4 -> 4
    ((8, 4096, 64, SMS), {}, 4),
    # within one wave the answer is the least s >= 0.85 s_max, not s_max: 8k tokens, s_max = 8 -> 7 (6.8)
    ((8, 8192, 64, SMS), {}, 7),
    # b = 32: P = 256, e(1) = 256 / 264 = 0.970 >= 0.85 x 1 (s = 33: 8448 = 64 x 132): one split
    ((256, 65536, 64, SMS), {}, 1),
    # exactly one wave: e(1) = 1
    ((132, 65536, 64, SMS), {}, 1),
    # P = 200: e(1) = 200/264 = 0.758, e(2) = 400/528 = 0.758, e(3) = 600/660 = 0.909 (s = 33 gives 1): 3
    ((200, 65536, 64, SMS), {}, 3),
    # one program past a wave, P = 133: 133 s = 132 s + s, so for s <= 64 it takes s + 1 waves and
    # e(s) = 133 s / (132 (s + 1)), increasing; best e(64) = 8512 / 8580 = 0.99207, x 0.85 = 0.84326;
    # e(5) = 665 / 792 = 0.83965 < 0.84326 <= e(6) = 798 / 924 = 0.86364: 6
    ((133, 65536, 64, SMS), {}, 6),
    # two programs per SM: C = 264, e = 8 s / 264 for s <= 33 (s = 33: 1); 8 s >= 0.85 x 264 = 224.4 -> 29
    ((8, 65536, 64, SMS), {"ctas_per_sm": 2}, 29),
    # threshold 1: the least s at the best, s = 33
    ((8, 65536, 64, SMS), {"threshold": 1.0}, 33),
    # at most 10 splits: best e(10) = 80 / 132, x 0.85 = 68 / 132 <= 8 s -> s >= 8.5 -> 9
    ((8, 65536, 64, SMS), {"max_splits": 10}, 9),
    # the paged block kernel at blocks of 16 (a block is a tile): 256 blocks = 4096 tokens,
    # s_max = min(4096 // 1024, 256 // 4) = 4, under-filled: 4
    ((8, 4096, 16, SMS), {}, 4),
    # a paged unit of 1024 tokens: 4 units = 4096 tokens, s_max = min(4, 4 // 4 = 1) = 1: the tile rule binds
    ((8, 4096, 1024, SMS), {}, 1),
    # at 2048 tokens s_max = 2 (and 32 tiles // 4 = 8): e = 8 s / 132 -> 2
    ((8, 2048, 64, SMS), {}, 2),
]

# the cases that must not split: a short sequence (< 2 x 1024 tokens: s_max = 1), an empty launch
NEGATIVE = [
    ((8, 2047, 64, SMS), {}),   # 2047 // 1024 = 1
    ((8, 1000, 64, SMS), {}),   # the short case, kept n = 1000
    ((1, 1024, 16, SMS), {}),   # one program, 1024 tokens: 1024 // 1024 = 1
    ((0, 65536, 64, SMS), {}),  # no program
    ((8, 0, 64, SMS), {}),      # no token
    ((8, 65536, 64, SMS), {"min_tokens": 65536}),  # one split's worth of tokens only
]


@pytest.mark.parametrize("args,kw,want", HAND)
def test_heuristic_hand_derived(args, kw, want):
    assert H.num_splits_heuristic(*args, **kw) == want


@pytest.mark.parametrize("args,kw", NEGATIVE)
def test_heuristic_does_not_split(args, kw):
    assert H.num_splits_heuristic(*args, **kw) == 1


def test_heuristic_is_the_fewest_near_the_best():
    """Brute force over launches: the answer is within s_max, reaches 0.85 of the best efficiency, and no
    smaller split count does (the defining property, beside the hand-derived cases)."""
    for programs in (1, 2, 7, 8, 31, 64, 100, 131, 132, 133, 200, 263, 264, 1000):
        for n in (1, 1023, 2048, 5000, 16384, 65536, 262144):
            for block_n in (16, 64):
                s = H.num_splits_heuristic(programs, n, block_n, SMS)
                s_max = max(1, min(128, SMS, n // 1024, -(-n // block_n) // 4))
                eff = [programs * k / (-(-programs * k // SMS) * SMS) for k in range(1, s_max + 1)]
                assert 1 <= s <= s_max
                assert eff[s - 1] >= 0.85 * max(eff)
                assert all(e < 0.85 * max(eff) for e in eff[:s - 1]), (programs, n, block_n, s)


def test_heuristic_refuses_bad_arguments():
    with pytest.raises(ValueError, match="sms must be an int >= 1"):
        H.num_splits_heuristic(8, 4096, 64, 0)
    with pytest.raises(ValueError, match="block_n must be an int >= 1"):
        H.num_splits_heuristic(8, 4096, 0, SMS)
    with pytest.raises(ValueError, match="programs must be an int >= 0"):
        H.num_splits_heuristic(-1, 4096, 64, SMS)
    with pytest.raises(ValueError, match="threshold must lie in"):
        H.num_splits_heuristic(8, 4096, 64, SMS, threshold=0.0)


def test_default_config_uses_the_heuristic():
    """``default_config`` on a CUDA device with a given SM count is the heuristic's split count (no GPU is
    queried when ``sms`` is given); without a CUDA device, one split."""
    cuda = torch.device("cuda")
    assert KN.default_config(65536, 128, 8, cuda, sms=SMS)["num_splits"] == 15
    assert KN.default_config(65536, 128, 256, cuda, sms=SMS)["num_splits"] == 1
    # float32 tiles of 32: the same token rule (64 tiles of 64 vs 128 of 32 both exceed 4 per split)
    assert KN.default_config(4096, 128, 8, cuda, dtype=torch.float32, sms=SMS)["num_splits"] == 4
    assert KN.default_config(65536, 128, 8, torch.device("cpu"))["num_splits"] == 1
    assert KN.default_config(65536, 128, 8, torch.device("cpu"), sms=SMS)["num_splits"] == 15


# ----------------------------------------------------------------------------- the kernels at its splits

@pytest.fixture
def on_132_sms(monkeypatch):
    """The wrappers' split count as on a 132-SM GPU, with spies on the merge kernels (kernel_support)."""
    return as_on_sms(monkeypatch, SMS)


# (n, g, dtype, moments, want) over 2 programs (b = 1, h_kv = 2), one wave: e = 2 s / 132 grows with s, so the
# answer is the least s >= 0.85 s_max, s_max = n // 1024 (the tile rule, n // block_n // 4, is looser):
# n = 3 x 1024 + 37: s_max = 3, 0.85 x 3 = 2.55 -> 3; n = 8 x 1024 + 5: s_max = 8, 0.85 x 8 = 6.8 -> 7
SPLIT_CASES = [
    (3109, 2, torch.float32, "onepass", 3),
    (3109, 4, torch.bfloat16, "exact", 3),
    (8197, 1, torch.float32, "exact", 7),
    (8197, 4, torch.bfloat16, "onepass", 7),
]


@pytest.mark.parametrize("n,g,dtype,moments,want", SPLIT_CASES)
def test_kernel_at_the_heuristics_splits(on_132_sms, n, g, dtype, moments, want):
    """The wrapper, given no ``num_splits``, launches the heuristic's split count (the merge kernel sees it) and
    its estimate is the explicit call's bit for bit, within the derived allowance of the float64 oracle
    (ragged heads: the splits cut through padding)."""
    spy, spy1 = on_132_sms
    q, k, v, pi = _make_case(n + g, 1, 2, g, n, 16, 16, dtype, pad="ragged", pi_kind="interior")
    est = KN.hajek_attention(q, k, v, pi, moments=moments)
    launched = (spy1 if moments == "onepass" else spy).splits
    assert launched == [want], launched
    explicit = KN.hajek_attention(q, k, v, pi, moments=moments, num_splits=want)
    for f in ("output", "lse", "variance", "trace", "n_eff"):
        assert torch.equal(getattr(est, f), getattr(explicit, f)), f
    assert_matches_oracle(est, q, k, v, pi, dtype, moments=moments)
