"""The Triton epilogue pass ``_tail_moment_kernel`` (``return_tail_moment=True``) against the oracle and
kvcert.fast. Without a GPU this runs on Triton's CPU interpreter (TRITON_INTERPRET=1).

Tolerance per query head (STYLE.md; the criterion of test_kernels_hajek.py): |kernel - ref64| <=
2 |lowp - ref64| (the textbook formula at float32 on the same rounded inputs) plus the rounding the
kernel adds on top:

- its o_hat is off by at most delta = 2 (eps32 max|v| + eps_dtype sum_i a_i |v_i - o|) per
  coordinate (float32 accumulation; half inputs round the probabilities before P V: see
  ``_variance_rounding`` in test_kernels_hajek.py), which moves each ||v_i - o_hat||^4 by at most
  (r_i + |delta|)^4 - r_i^4 (triangle inequality);
- a_i = exp(logit_i - lse) takes the error of the first pass's lse and of the recomputed logit,
  4 x in a_i^4; (1 - pi_i)^3 three roundings (log-pi path: 8 eps each, see test_kernels_hajek.py);
- the float32 sum: the tiled accumulation bound ``rounding(float32, n, block_n)`` of tests/support.py;
  terms below float32's smallest normal may flush to 0 (n * tiny).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from kvcert import dispatch as DSP
from kvcert import fast as F
from kvcert import reference as R
from support import (COMPUTE, EPS, assert_close, assert_same_variant, make_case, naive_tail_heads, reference_heads,
                     rounding, triton_kernels)

KN, DEVICE = triton_kernels()  # skips this module without triton, or without CUDA and TRITON_INTERPRET=1
_make_case = functools.partial(make_case, device=DEVICE)  # the shared generator, on the kernel's device
EPS32 = EPS[torch.float32]
TINY32 = float(torch.finfo(torch.float32).tiny)


def tail_tolerance(q, k, v, pi, dtype, block_n):
    """(reference s2 (b, h_q), allowed |kernel - reference| (b, h_q))."""
    ref = reference_heads(q, k, v, pi)
    low, low_lse = naive_tail_heads(q, k, v, pi)
    eps_w = EPS[dtype] if dtype != COMPUTE[dtype] else 0.0  # half inputs: P rounded to the input dtype
    n = k.shape[2]
    want = np.zeros(low.shape)
    tol = np.zeros(low.shape)
    for (bi, h), (e, vv, p) in ref.items():
        want[bi, h] = e.tail_moment
        if not np.isfinite(e.lse):
            continue
        a = e.weights
        live = p > 0
        res = vv - e.output
        r = np.linalg.norm(res, axis=1)
        delta = 2 * (EPS32 * np.abs(vv[live]).max() + eps_w * (a[:, None] * np.abs(res)).sum(0))
        w = (1 - p) ** 3 * a ** 4
        logit = np.log(np.where(a > 0, a, 1.0)) + e.lse
        rel_a = (2 * abs(low_lse[bi, h] - e.lse) + EPS32 * (abs(e.lse) + 1)
                 + (EPS32 + rounding(torch.float32, q.shape[-1], 16)) * (np.abs(logit) + abs(e.lse)))
        tol[bi, h] = (2 * abs(low[bi, h] - e.tail_moment)
                      + np.sum(w * ((r + np.linalg.norm(delta)) ** 4 - r ** 4))
                      + 4 * np.sum(rel_a * w * r ** 4)
                      + (32 * EPS32 + rounding(torch.float32, n, block_n)) * e.tail_moment + n * TINY32)
    return want, tol


def assert_tail_matches(est, q, k, v, pi, dtype, block_n, *, other=None):
    assert est.tail_moment is not None and est.tail_moment.dtype == torch.float32
    got = est.tail_moment.detach().cpu().double().numpy()
    assert not np.isnan(got).any()
    want, tol = tail_tolerance(q, k, v, pi, dtype, block_n)
    dead = ~np.isfinite(want)
    assert np.all(got[dead] == np.inf), got[dead]
    live = ~dead
    if other is not None:  # against kvcert.fast: both are off the oracle, by up to their own budgets
        y = other.tail_moment.detach().cpu().double().numpy()
        assert np.all(y[dead] == np.inf)
        tol = tol + np.where(live, np.abs(np.where(live, y, 0.0) - np.where(live, want, 0.0)), 0.0)
        want = y
    # empty heads were checked above: compare them with themselves (equal infinities pass)
    assert_close("tail_moment", got, np.where(live, want, got), tol)


CASES = [  # (seed, b, h_kv, g, n, d, dv, dtype, regime, pad, pi_kind), block_n, num_splits, use_log
    ((1, 1, 2, 4, 113, 16, 16, torch.float32, "typical", "ragged", "mixed"), 32, 3, False),
    ((2, 2, 1, 5, 33, 16, 24, torch.bfloat16, "typical", "empty_head", "interior"), 32, 1, True),
    ((3, 1, 2, 2, 1, 16, 16, torch.float16, "typical", "none", "0.3"), 16, 1, False),
    ((4, 1, 1, 20, 70, 16, 16, torch.float32, "dominant", "ragged", "interior"), 16, 2, True),
    ((5, 1, 2, 3, 64, 64, 16, torch.float32, "offset", "ragged", "interior"), 64, 2, False),
    ((6, 1, 1, 4, 65, 16, 16, torch.bfloat16, "offset", "none", "mixed"), 16, 3, False),
]


@pytest.mark.parametrize("case, block_n, num_splits, use_log", CASES,
                         ids=[f"{c[7]}-n{c[4]}-g{c[3]}-{c[8]}-{c[9]}-s{s}" for c, _, s, _ in CASES])
def test_matches_reference_and_fast(case, block_n, num_splits, use_log):
    seed, b, h_kv, g, n, d, dv, dtype, regime, pad, pi_kind = case
    q, k, v, pi = _make_case(seed, b, h_kv, g, n, d, dv, dtype, regime=regime, pad=pad, pi_kind=pi_kind)
    kw = dict(block_n=block_n, num_splits=num_splits, return_tail_moment=True)
    est = (KN.hajek_attention(q, k, v, log_pi=torch.log(pi), **kw) if use_log
           else KN.hajek_attention(q, k, v, pi, **kw))
    assert est.tail_moment.shape == (b, h_kv * g)
    assert_tail_matches(est, q, k, v, pi, dtype, block_n)
    fast = F.hajek_attention(q, k, v, pi, per_coordinate=False, return_tail_moment=True)
    assert_tail_matches(est, q, k, v, pi, dtype, block_n, other=fast)


def test_other_fields_are_unchanged_and_splits_agree():
    """The epilogue pass changes nothing else (the output is still cast once, in a kernel), and the
    split partial sums (summed in torch) agree with one split to the accumulation bound."""
    q, k, v, pi = _make_case(7, 2, 2, 2, 90, 16, 16, torch.bfloat16, pad="ragged")
    base = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=3)
    est = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=3, return_tail_moment=True)
    assert base.tail_moment is None
    for f in ("output", "variance", "trace", "lse", "n_eff"):
        x, y = getattr(est, f), getattr(base, f)
        assert_same_variant(f, x, y, torch.bfloat16, 90, 16, exact=KN.INTERPRETED)
    assert est.output.dtype == torch.bfloat16
    one = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=1, return_tail_moment=True)
    fin = torch.isfinite(one.tail_moment)
    assert torch.equal(fin, torch.isfinite(est.tail_moment))
    tol = 4 * rounding(torch.float32, 90, 16)
    # o_hat (and so the distances) may differ between split counts by the first pass's rounding too
    want, budget = tail_tolerance(q, k, v, pi, torch.bfloat16, 16)
    diff = (one.tail_moment - est.tail_moment).abs().double().cpu().numpy()
    assert np.all(diff[fin.cpu().numpy()] <= (2 * budget + tol * np.abs(want))[fin.cpu().numpy()])


def test_log_pi_path_4d_query_and_zero_length_cache():
    q, k, v, pi = _make_case(8, 1, 2, 2, 50, 16, 16, torch.float32, pad="ragged", pi_kind="interior")
    a = KN.hajek_attention(q, k, v, pi, block_n=16, return_tail_moment=True)
    b = KN.hajek_attention(q.unsqueeze(2), k, v, log_pi=torch.log(pi), block_n=16, return_tail_moment=True)
    assert b.tail_moment.shape == (1, 4, 1)
    # 1 - pi from log pi: <= 8 eps relative per factor (test_kernels_hajek.py), three factors
    assert torch.allclose(a.tail_moment, b.tail_moment[..., 0],
                          rtol=24 * EPS32 + 2 * rounding(torch.float32, 50, 16), atol=0)
    z = KN.hajek_attention(torch.randn(1, 2, 16, device=DEVICE), torch.randn(1, 1, 0, 16, device=DEVICE),
                           torch.randn(1, 1, 0, 8, device=DEVICE), torch.ones(1, 1, 0, device=DEVICE),
                           return_tail_moment=True)
    assert torch.all(z.tail_moment == math.inf) and torch.all(z.output == 0)
    ones = KN.hajek_attention(q, k, v, torch.ones_like(pi), block_n=16, return_tail_moment=True)
    assert torch.all(ones.tail_moment == 0)


def test_certificate_and_dispatch():
    q, k, v, pi = _make_case(9, 2, 2, 2, 40, 16, 16, torch.float32, pad="empty_head", pi_kind="interior")
    assert DSP._fast_only({"return_tail_moment": True}) == []  # not a reason to leave the kernel
    est = DSP.hajek_attention(q, k, v, pi, backend="triton", return_tail_moment=True, block_n=16)
    assert (est.backend, est.route) == ("triton", "triton") and est.tail_moment is not None
    cert = F.certificate(est, kind="chebyshev_ucb", delta=0.05)
    assert not torch.isnan(cert.radius).any() and torch.isposinf(cert.radius[0, 2:]).all()
    # the batched certificate on the kernel's statistics is the reference formula (float32 rounding)
    for bi, h in np.ndindex(*est.trace.shape):
        want = R.radius_from_moments("chebyshev_ucb", 0.05, trace=float(est.trace[bi, h]),
                                     tail_moment=float(est.tail_moment[bi, h]))
        got = float(cert.radius[bi, h])
        assert got == want or abs(got - want) <= 4 * EPS32 * want, (bi, h, got, want)
    assert_tail_matches(est, q, k, v, pi, torch.float32, 16)


@pytest.mark.parametrize("bug", ["one (1 - pi) factor dropped", "v not centred at o_hat"])
def test_the_tolerance_rejects_a_tail_moment_with_a_deliberate_error(bug):
    """Negative control of :func:`assert_tail_matches`: the kernel's tail moment passes, and the s2 a
    kernel with one of two plausible bugs would return (computed from the float64 reference's own
    weights, so nothing but the bug differs) fails, on float32 and bfloat16 inputs."""
    import dataclasses

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, pi = _make_case(1, 1, 2, 4, 113, 16, 16, dtype, regime="typical", pad="ragged", pi_kind="interior")
        est = KN.hajek_attention(q, k, v, pi, block_n=32, num_splits=3, return_tail_moment=True)
        assert_tail_matches(est, q, k, v, pi, dtype, 32)
        bad = torch.empty_like(est.tail_moment)
        for (bi, h), (e, vv, p) in reference_heads(q, k, v, pi).items():
            r2 = ((vv - (0.0 if bug.startswith("v not") else e.output)) ** 2).sum(1)
            x = (1 - p) * e.weights ** 2 * r2
            bad[bi, h] = float(((1 - p) ** (0 if bug.startswith("one") else 1) * x * x).sum())
        with pytest.raises(AssertionError, match="tail_moment"):
            assert_tail_matches(dataclasses.replace(est, tail_moment=bad), q, k, v, pi, dtype, 32)
