"""The cluster design's Triton decode step (kvcert.kernels.sketch_hajek_attention) against the oracles.

Runs on Triton's CPU interpreter where there is no GPU (``make test`` sets TRITON_INTERPRET=1).
Float32: the tolerances derived in tests/test_fast_sketch.py (``sketch_support.check_float32_step``: V_cl, output
and trace against the float64 reference on the same rounded inputs), the same rule the torch step
meets; the kernel's tiles add one rounding per tile merge, below the shared 8 eps sqrt(n + 1)
allowance for every (n, block) here (tests/test_support.py). Half inputs: exactly the float32
call on their upcast values (the kernel loads and casts them; the output is rounded once to the half dtype).
"""

from __future__ import annotations

import functools

import pytest
import torch
from support import triton_kernels
from sketch_support import FLOAT32_CASES, check_float32_step, with_error

import kvcert.fast as F

KN, DEVICE = triton_kernels()  # skips this module without triton, or without CUDA and TRITON_INTERPRET=1


@pytest.mark.parametrize("n, g, clusters", FLOAT32_CASES)
def test_kernel_step_within_the_derived_float32_tolerance(n, g, clusters):
    check_float32_step(KN.sketch_hajek_attention, n, g, clusters, device=DEVICE)


@pytest.mark.parametrize("field", ["output", "trace", "cluster_variance"])
def test_the_float32_tolerance_rejects_a_kernel_with_a_deliberate_error(field):
    """Negative control: the kernel's step with one field moved by 100 units of the float32 rounding
    allowance (about 1e-3 of its value at n = 113) fails the check its exact output passes."""
    check_float32_step(KN.sketch_hajek_attention, 113, 1, 6, device=DEVICE)
    with pytest.raises(AssertionError, match={"output": "output32", "trace": "trace32", "cluster_variance": "V_cl32"}[field]):
        check_float32_step(with_error(KN.sketch_hajek_attention, field, 100, 113), 113, 1, 6, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_n", [16, 64])
def test_half_inputs_are_the_float32_step_on_their_upcast(dtype, block_n):
    # the kernel loads half q, K, V and computes in float32: exactly the float32 call on the upcast values,
    # its output rounded once to the half dtype
    q, k, v, p, sk = _case(dtype, n=113)
    half = KN.sketch_hajek_attention(q, k, v, p, sk, block_n=block_n)
    full = KN.sketch_hajek_attention(q.float(), k.float(), v.float(), p, sk, block_n=block_n)
    assert half.output.dtype == dtype and half.variance.dtype == torch.float32
    assert torch.equal(half.output, full.output.to(dtype))
    for f in ("variance", "radius"):
        assert torch.equal(getattr(half, f), getattr(full, f)), f
    for f in ("trace", "lse"):
        assert torch.equal(getattr(half.estimate, f), getattr(full.estimate, f)), f


@pytest.mark.parametrize("block_n", [16, 64])
def test_other_tiles_within_the_derived_float32_tolerance(block_n):
    check_float32_step(functools.partial(KN.sketch_hajek_attention, block_n=block_n), 239, 3, 16, device=DEVICE)


def _case(dtype, n=90, b=2, h_kv=2, g=3, d=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h_kv, n, d, generator=gen)
    v = torch.randn(b, h_kv, n, dv, generator=gen) + 1.0
    pi = torch.rand(b, h_kv, n, generator=gen).clamp(min=0.05)
    pi[..., :4] = 1.0
    keep = torch.rand(b, h_kv, n, generator=gen) < pi
    sk = F.cluster_sketch(k, v, pi, keep, F.ClusterDesign(clusters=4))
    p = torch.where(keep, pi, 0.0)
    p[1, 1] = 0.0  # a KV head with nothing kept: the empty-sample convention
    q = torch.randn(b, h_kv * g, d, generator=gen)
    on = lambda x: x.to(DEVICE)  # noqa: E731
    sk = F.ClusterSketch(*(on(getattr(sk, f)) for f in ("mean", "var", "weight", "wnorm", "count", "mu")))
    return on(q.to(dtype)), on(k.to(dtype)), on(v.to(dtype)), on(p), sk


def test_a_head_with_nothing_kept_follows_the_empty_sample_convention():
    q, k, v, p, sk = _case(torch.float32)
    got = KN.sketch_hajek_attention(q, k, v, p, sk)
    want = F.sketch_hajek_attention(q, k, v, p, sk)
    for x in (got, want):
        assert not bool(x.output[1, 3:].any()) and bool((x.estimate.lse[1, 3:] == -torch.inf).all())
        assert bool((x.variance[1, 3:] == torch.inf).all()) and bool((x.estimate.trace[1, 3:] == torch.inf).all())
        assert bool(torch.isfinite(x.variance[0]).all()) and bool(torch.isfinite(x.variance[1, :3]).all())


def test_log_pi_and_cached_moments_give_the_same_step():
    q, k, v, p, sk = _case(torch.float32, seed=3)
    mu, r2 = F.value_moments(v, p)
    a = KN.sketch_hajek_attention(q, k, v, p, sk)
    b = KN.sketch_hajek_attention(q, k, v, None, sk, log_pi=torch.log(p), value_center=mu, value_sqdist=r2)
    assert torch.equal(a.output, b.output) and torch.equal(a.variance, b.variance)


def test_kernel_errors():
    q, k, v, p, sk = _case(torch.float32, n=20)
    with pytest.raises(ValueError, match="decode kernel"):
        KN.sketch_hajek_attention(q[:, :, None].expand(-1, -1, 2, -1), k, v, p, sk)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        KN.sketch_hajek_attention(q.double(), k.double(), v.double(), p, sk)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        KN.sketch_hajek_attention(q, k, v, p, sk, block_n=24)
    with pytest.raises(TypeError, match="sketch must be a ClusterSketch"):
        KN.sketch_hajek_attention(q, k, v, p, None)
