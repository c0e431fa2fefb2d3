"""The fused Triton decode kernel (kvcert.kernels) against the float64 oracle and kvcert.fast.

Without a GPU these run on Triton's CPU interpreter (TRITON_INTERPRET=1, set by
``make test`` before anything imports Triton). Tolerances follow STYLE.md: the
kernel's error against the float64 reference must stay within twice the error
of the reference's own formulas evaluated at the input dtype (a naive torch
mirror, flash-attention's criterion) plus one unit of rounding of the field,
measured per query head relative to that head's scale (heads differ by orders
of magnitude in variance).
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kvcert import reference as R
from support import (COMPUTE, EPS, KERNEL_DTYPES, assert_close, assert_same_variant, assert_within_scale, decode_case,
                     field_scale, make_case, naive_hajek_heads, reference_heads, rounding, store_eps, triton_kernels,
                     variant_tolerance)

KN, DEVICE = triton_kernels()  # skips this module without triton, or without CUDA and TRITON_INTERPRET=1
DTYPES = KERNEL_DTYPES
FIELDS = ("output", "lse", "variance", "trace", "n_eff")
_make_case = functools.partial(make_case, device=DEVICE)  # the shared generator, on the kernel's device


# ----------------------------------------------------------------------------- helpers

def kernel_centres(q, k, v, pi, block_n, num_splits, scale=None, value_center=None):
    """Where the one-pass kernel centres each token's terms, replayed in float64 (numpy).

    Per program (batch row, KV head, block of <= 16 query heads, split of ``num_splits`` chunks of
    whole ``block_n`` tiles) the centre is the value of the token with the largest logit of the block
    so far, moved when a tile's largest logit beats it; the merge moves every split to the centre of
    the split with the largest logit (the first on ties). With ``value_center`` the centre is fixed.
    Returns ``(cen, moved, final, moves)``: (b, h_q, n, dv) the centre in force when token i's tile was
    added, (b, h_q, n, dv) the sum of |e| over the moves of the centre after that (in its split, then to
    the common centre), (b, h_q, dv) the final centre and (b, h_q) the number of moves that can round a
    nonzero sum (per split, after its first, the most over the splits; plus the merge's)."""
    q64, k64, v64, p64 = (x.detach().cpu().double().numpy() for x in (q, k, v, pi))
    b, h_q, d = q64.shape
    h_kv, n, dv = k64.shape[1], k64.shape[2], v64.shape[-1]
    g = h_q // h_kv
    tau = 1.0 / math.sqrt(d) if scale is None else scale
    cen, moved, final = np.zeros((b, h_q, n, dv)), np.zeros((b, h_q, n, dv)), np.zeros((b, h_q, dv))
    moves = np.zeros((b, h_q))
    if value_center is not None:
        c64 = value_center.detach().cpu().double().numpy()
        for h in range(h_q):
            cen[:, h] = c64[:, h // g, None, :]
            final[:, h] = c64[:, h // g]
        return cen, moved, final, moves
    g_block = min(g, 16)
    chunk = max(block_n, math.ceil(math.ceil(max(n, 1) / num_splits) / block_n) * block_n)
    bounds = [(s0, min(s0 + chunk, n)) for s0 in range(0, max(n, 1), chunk)]
    with np.errstate(divide="ignore"):
        log_p = np.where(p64 > 0, np.log(np.where(p64 > 0, p64, 1.0)), -np.inf)
    for bi in range(b):
        for kvh in range(h_kv):
            vv = v64[bi, kvh]
            for rb in range(math.ceil(g / g_block)):
                rows = [kvh * g + j for j in range(rb * g_block, min(g, (rb + 1) * g_block))]
                logits = np.where(log_p[bi, kvh] > -np.inf, tau * (q64[bi, rows] @ k64[bi, kvh].T) - log_p[bi, kvh],
                                  -np.inf)
                c_cen, c_mov, ends, k_max = np.zeros((n, dv)), np.zeros((n, dv)), [], 0
                for s0, s1 in bounds:
                    c, m_blk, k_s = np.zeros(dv), -np.inf, -1
                    for t0 in range(s0, s1, block_n):
                        col = logits[:, t0:min(t0 + block_n, s1)].max(0)
                        if col.max() > m_blk:
                            vj = vv[t0 + int(np.argmax(col))]
                            c_mov[s0:t0] += np.abs(c - vj)
                            c, m_blk, k_s = vj, col.max(), k_s + 1
                        c_cen[t0:min(t0 + block_n, s1)] = c
                    ends.append((m_blk, c))
                    k_max = max(k_max, k_s)
                best = max(range(len(ends)), key=lambda i: (ends[i][0], -i))  # the first split on ties
                for (s0, s1), (_, c) in zip(bounds, ends):
                    c_mov[s0:s1] += np.abs(c - ends[best][1])
                cen[bi, rows], moved[bi, rows], final[bi, rows] = c_cen, c_mov, ends[best][1]
                moves[bi, rows] = k_max + (len(bounds) > 1)
    return cen, moved, final, moves


def _oracle(q, k, v, pi, scale=None, centres=None):
    """float64 reference per (b, h_q) slice, and the ingredients of the variance's rounding: dict of
    numpy arrays (``centres``: :func:`kernel_centres`, for the one-pass allowance)."""
    res = {f: [] for f in FIELDS + ("c_dev", "a_dev", "vmax", "c_sum", "range", "c_far", "moves")}
    for (bi, h), (e, vv, p) in reference_heads(q, k, v, pi, scale).items():
        for f in FIELDS:
            res[f].append(getattr(e, f))
        dev = np.abs(vv - e.output)  # |v_ij - o_j|
        c = (1.0 - p) * e.weights ** 2
        live = p > 0
        res["c_dev"].append((c[:, None] * dev).sum(0))  # sum_i c_i |v_ij - o_j|
        res["c_sum"].append(c.sum())
        res["a_dev"].append((e.weights[:, None] * dev).sum(0))  # sum_i a_i |v_ij - o_j|
        res["vmax"].append(np.abs(vv[live]).max() if live.any() else 0.0)
        vl = vv[live]
        res["range"].append(vl.max(0) - vl.min(0) if live.any() else np.zeros(vv.shape[-1]))
        if centres is not None:  # sum_i c_i (|v_i - c_(i)| + moves after + |o - c_final|)^2, per coordinate
            cen, moved, final, moves = (x[bi, h] for x in centres)
            res["c_far"].append((c[:, None] * (np.abs(vv - cen) + moved + np.abs(e.output - final)) ** 2).sum(0))
            res["moves"].append(moves)
        else:
            res["c_far"].append(np.full(vv.shape[-1], np.nan))
            res["moves"].append(np.nan)
    b, h_q = q.shape[:2]
    out = {f: np.asarray(x, dtype=np.float64).reshape((b, h_q) + np.shape(x[0])) for f, x in res.items()}
    return out


def _variance_rounding(ref, dtype, moments="exact", block_n=64, n=None, dv=None, p_rounding=True):
    """Rounding allowance of the variance, from a first-order error analysis of the one-pass form.

    o_hat and the weighted mean of v are each off by at most eps32 max|v| (float32 rounding)
    plus, for half inputs, eps_dtype sum_i a_i |v_i - o| (the probabilities are rounded to the
    input dtype before P V): a shift delta of o moves sum_i c_i (v_i - o)^2 by at most
    2 |delta| sum_i c_i |v_i - o| + delta^2 sum_i c_i, with |delta| <= 2 shift (o and the
    mean). The second-order term is the absolute floor (eps32 |v|)^2 sum c of the one-pass form
    when one tail token dominates.

    ``moments="shifted"`` forms each tile's M2 as S2 - S1^2 / W from products against v - mu
    (mu a mean of kept values, so |v - mu| <= range(v)); each product carries
    gamma = (4 + log2 BLOCK_N + 2) eps32 (tf32x3 splitting, accumulation), so
    |dM2| <= 4 gamma W range^2 per tile, i.e. 4 gamma sum_i c_i range^2 after normalization,
    and the mean moves by gamma range.

    ``moments="onepass"`` (n tokens, dv value coordinates) forms
    var = (S2 - 2 delta S1 + delta^2 U) / l^2 from sums U = sum u_i, S1 = sum u_i r_i,
    S2 = sum u_i r_i^2, r_i = v_i - c, around a centre c shared by the query heads of a program
    (delta = o - c). Term i is formed around the centre c_(i) in force when its tile is added; each
    later move of the centre by e (S2 += e (2 S1 + e U), S1 += e U: exact in real arithmetic) can
    grow its magnitude to u_i (|v_i - c_(i)| + sum |e|)^k, and the final combination to
    u_i (|v_i - c_(i)| + sum |e| + |delta|)^2. With the weights u_i as computed (their rounding is
    the float32 mirror's, counted by the caller), every rounding step is relative to these
    magnitudes, so the variance is off by at most gamma * c_far after normalization, with
    c_far = sum_i c_i (|v_i - c_(i)| + sum |e| + |o - c|)^2 (:func:`kernel_centres` replays the
    centres) and gamma (:func:`onepass_gamma`) counting a term's roundings: 6 for forming it
    (v - c, the square, the product with u, the tf32x3 split of each operand on a GPU), log2
    BLOCK_N for the in-tile sum, 2 per tile (the e^{2 dm} rescale and the add; a split merge is
    one more such step, and there are fewer splits than tiles), 4 per move of the centre,
    log2 dv for the trace's sums over coordinates (r_i's norm and delta . S1) and 4 for the final
    combination. o's own rounding moves the result as in the other modes (the first two terms).
    With centres that are kept values the floor does not grow with a common offset of the values;
    with c = 0 (the raw form) c_far grows with the offset squared.

    ``p_rounding=False``: the probabilities are exact in the input dtype (powers of two), so rounding
    P before P V moves nothing and half inputs get float32's allowance.
    """
    eps32 = EPS[COMPUTE[dtype]]
    # half inputs: P rounded to the input dtype before P V
    eps_w = EPS[dtype] if dtype != COMPUTE[dtype] and p_rounding else 0.0
    shift = eps32 * ref["vmax"][..., None] + eps_w * ref["a_dev"]
    floor = 0.0
    if moments == "shifted":
        gamma = (6 + math.log2(block_n)) * eps32
        shift = shift + gamma * ref["range"]
        floor = 4.0 * gamma * ref["c_sum"][..., None] * ref["range"] ** 2
    elif moments == "onepass":
        floor = onepass_gamma(dtype, n, block_n, dv, ref["moves"])[..., None] * ref["c_far"]
    delta = 2.0 * shift
    return 2.0 * delta * ref["c_dev"] + delta * delta * ref["c_sum"][..., None] + floor


def onepass_gamma(dtype, n, block_n, dv, moves=0):
    """gamma of the one-pass floor (see :func:`_variance_rounding`): the roundings on one term's way into
    the variance, times the compute dtype's epsilon (``moves``: moves of the centre, per head)."""
    n_tiles = max(1, math.ceil(n / block_n))
    units = 6 + math.log2(block_n) + 2 * n_tiles + math.ceil(math.log2(max(dv, 1))) + 4
    return (units + 4 * np.asarray(moves, np.float64)) * EPS[COMPUTE[dtype]]


def _scale(ref):
    ref = np.asarray(ref, np.float64)
    s = np.abs(ref).max(-1) if ref.ndim == 3 else np.abs(ref)
    return np.where(np.isfinite(s) & (s > 0), s, 1.0)


def _row_errors(x, ref, live):
    """Per query head: max |x - ref| / scale, scale = max |ref| of the head (1 if that is 0)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if x.ndim == 2:
        x, ref = x[..., None], ref[..., None]
    with np.errstate(invalid="ignore"):
        err = np.abs(x - ref).max(-1)
    return np.where(live, err / _scale(ref[..., 0] if ref.shape[-1] == 1 else ref), 0.0)


def assert_matches_oracle(est, q, k, v, pi, dtype, *, scale=None, fields=FIELDS, other=None, block_n=None,
                          num_splits=None, moments="auto", value_center=None, p_rounding=True):
    """|kernel - ref64| <= 2 |lowp - ref64| + rounding (per head, relative); empty heads exact.

    ``other``: a second estimate (kvcert.fast) whose own error is added to the budget when
    comparing the kernel with it instead of with the oracle. ``block_n``, ``num_splits``: the
    kernel call's (None: the wrapper's defaults); ``moments``: the mode whose variance allowance
    applies ("auto": the default's); ``value_center``: the one-pass centre the kernel was given;
    ``p_rounding``: :func:`_variance_rounding`'s.
    """
    n, d = k.shape[2], q.shape[-1]
    programs = q.shape[0] * k.shape[1] * math.ceil((q.shape[1] // k.shape[1]) / 16)
    mode = KN.default_moments(dtype) if moments == "auto" else moments
    cfg = KN.default_config(n, d, programs, q.device, block_n, dtype, mode)
    block_n = cfg["block_n"]
    num_splits = cfg["num_splits"] if num_splits is None else num_splits
    centres = (kernel_centres(q, k, v, pi, block_n, num_splits, scale, value_center) if mode == "onepass"
               else None)
    ref = _oracle(q, k, v, pi, scale, centres)
    low = naive_hajek_heads(q, k, v, pi, torch.float32, scale)
    low["output"] = naive_hajek_heads(q, k, v, pi, dtype, scale)["output"]
    live = np.isfinite(ref["lse"])  # heads with a non-empty sample
    for f in fields:
        x = getattr(est, f)
        assert x is not None, f"{f} is None"
        x = x.detach().cpu().double().numpy()
        assert not np.isnan(x).any(), f"{f} has NaN"
        dead = ~live
        if dead.any():
            expect = {"output": 0.0, "lse": -np.inf, "variance": np.inf, "trace": np.inf, "n_eff": 0.0}[f]
            assert np.all(x[dead] == expect), f"{f} of an empty head must be {expect}, got {x[dead]}"
        if not live.any():
            continue
        assert np.all(np.isfinite(x[live])), f"{f} not finite on a non-empty head"
        e_k = _row_errors(x, ref[f], live)
        e_l = _row_errors(low[f], ref[f], live)
        tol = (2.0 * np.nan_to_num(e_l, nan=np.inf, posinf=np.inf).max() + store_eps(f, dtype)
               + rounding(dtype, k.shape[2], block_n))
        if f in ("variance", "trace"):  # + the propagated rounding of o_hat (per head, relative)
            sens = _variance_rounding(ref, dtype, mode, block_n, n, v.shape[-1], p_rounding)
            sens = sens.max(-1) if f == "variance" else sens.sum(-1)
            tol = tol + np.where(live, sens, 0.0) / _scale(ref[f])
        if other is not None:
            y = getattr(other, f).detach().cpu().double().numpy()
            e_o = _row_errors(y, ref[f], live)
            tol = tol + e_o.max()
            e_k = _row_errors(x, y, live)
        tol = np.broadcast_to(tol, e_k.shape)
        worst = np.unravel_index(np.argmax(e_k - tol), e_k.shape)
        assert_close(f"{f} error relative to the head's scale (worst head: kernel {x[worst]} vs ref {ref[f][worst]})",
                     e_k, np.zeros_like(e_k), tol)


def _run(q, k, v, pi, *, use_log=False, **kw):
    if use_log:
        return KN.hajek_attention(q, k, v, log_pi=torch.log(pi), **kw)
    return KN.hajek_attention(q, k, v, pi, **kw)


# ----------------------------------------------------------------------------- properties

@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(decode_case())
def test_matches_reference(c):
    case, kw = c
    q, k, v, pi = _make_case(**case)
    est = _run(q, k, v, pi, **kw)
    assert est.output.dtype == case["dtype"] and est.output.shape == (case["b"], q.shape[1], case["dv"])
    for f in ("lse", "variance", "trace", "n_eff"):
        assert getattr(est, f).dtype == torch.float32
    assert est.weights is None and est.max_term is None
    assert_matches_oracle(est, q, k, v, pi, case["dtype"], block_n=kw["block_n"], num_splits=kw["num_splits"],
                          moments=kw["moments"])


@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(decode_case())
def test_matches_fast(c):
    """|kernel - fast| within the kernel's budget plus fast's own error against the oracle."""
    fast = pytest.importorskip("kvcert.fast")
    case, kw = c
    q, k, v, pi = _make_case(**case)
    est = _run(q, k, v, pi, **kw)
    other = fast.hajek_attention(q, k, v, pi)
    assert_matches_oracle(est, q, k, v, pi, case["dtype"], block_n=kw["block_n"], num_splits=kw["num_splits"],
                          other=other, moments=kw["moments"])


# ----------------------------------------------------------------------------- tiling and splits

BLOCK = 32


@pytest.mark.parametrize("dtype, moments", [(torch.float32, "exact"), (torch.bfloat16, "shifted"),
                                            (torch.float32, "shifted"), (torch.bfloat16, "exact")])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("n", [1, 3, 113, BLOCK - 1, BLOCK, BLOCK + 1])
def test_tile_breaking_lengths(n, num_splits, dtype, moments):
    q, k, v, pi = _make_case(n, 1, 2, 4, n, 64, 64, dtype, pad="ragged", pi_kind="interior")
    est = KN.hajek_attention(q, k, v, pi, block_n=BLOCK, num_splits=num_splits, moments=moments)
    assert_matches_oracle(est, q, k, v, pi, dtype, block_n=BLOCK, num_splits=num_splits, moments=moments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_derived_tolerance_rejects_a_kernel_with_a_deliberate_error(dtype):
    """Negative control of :func:`assert_matches_oracle`: the kernel's estimate passes, and each of
    these deliberate errors fails it: the -log pi offset dropped (plain attention over the kept
    tokens), the variance without its (1 - pi) factor, and, for float32 inputs, every field moved by
    20 units of the tolerance's rounding term (a kernel whose error grows beyond its tiling's bound;
    for bfloat16 inputs the tolerance is the inputs' own rounding, far larger)."""
    import dataclasses

    n = 113
    q, k, v, pi = _make_case(n, 1, 2, 4, n, 64, 64, dtype, pad="ragged", pi_kind="interior")
    est = KN.hajek_attention(q, k, v, pi, block_n=BLOCK, num_splits=3)
    assert_matches_oracle(est, q, k, v, pi, dtype, block_n=BLOCK, num_splits=3)
    plain = KN.hajek_attention(q, k, v, torch.where(pi > 0, torch.ones_like(pi), pi), block_n=BLOCK, num_splits=3)
    wrong = {"output": dataclasses.replace(est, output=plain.output),
             "variance": dataclasses.replace(est, variance=_without_fpc(est, q, k, v, pi))}
    step = 20 * rounding(dtype, n, BLOCK)
    for f in FIELDS if dtype == torch.float32 else ():  # half inputs: their own rounding dominates
        x = getattr(est, f)
        wrong[f"{f} + 20 rounding"] = dataclasses.replace(est, **{f: x + step * x.abs().amax(-1, keepdim=True)
                                                                  if x.dim() == 3 else x + step * x.abs()})
    for name, bad in wrong.items():
        field = name.split()[0]
        with pytest.raises(AssertionError):
            assert_matches_oracle(bad, q, k, v, pi, dtype, block_n=BLOCK, num_splits=3, fields=(field,))


def _without_fpc(est, q, k, v, pi):
    """The variance a kernel would give without the (1 - pi) factor: sum a_i^2 (v_i - o)^2 from the
    float64 reference's weights (per query head, GQA), cast like the kernel's variance."""
    out = torch.zeros_like(est.variance)
    for (bi, h), (e, vv, _) in reference_heads(q, k, v, pi).items():
        out[bi, h] = torch.as_tensor((e.weights[:, None] ** 2 * (vv - e.output) ** 2).sum(0), dtype=out.dtype)
    return out


@pytest.mark.parametrize("d, dv, g, h_kv", [(128, 128, 4, 2), (40, 24, 3, 1), (16, 16, 20, 1)])
def test_head_dims_and_groups(d, dv, g, h_kv):
    """d = 128 (the realistic case), non-power-of-two dims, and g = 20 > 16 query heads per KV head
    (two row blocks per KV head)."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, pi = _make_case(d + g, 1, h_kv, g, 70, d, dv, dtype, pad="ragged")
        est = KN.hajek_attention(q, k, v, pi, block_n=32, num_splits=2)
        assert_matches_oracle(est, q, k, v, pi, dtype, block_n=32, num_splits=2)


# ----------------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_heads_follow_the_reference_convention(num_splits):
    """All-padding heads: output 0, lse -inf, variance/trace +inf, n_eff 0, no NaN anywhere."""
    q, k, v, pi = _make_case(7, 2, 2, 2, 100, 16, 16, torch.float32, pad="ragged")
    pi[0, 1] = 0.0
    pi[1, 0] = 0.0
    for use_log in (False, True):
        est = _run(q, k, v, pi, use_log=use_log, block_n=16, num_splits=num_splits)
        assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=num_splits)
        assert torch.equal(est.output[0, 2:], torch.zeros_like(est.output[0, 2:]))
        assert torch.isneginf(est.lse[0, 2:]).all() and torch.isposinf(est.trace[1, :2]).all()


def test_zero_length_cache():
    q = torch.randn(1, 2, 16, device=DEVICE)
    k = torch.randn(1, 1, 0, 16, device=DEVICE)
    v = torch.randn(1, 1, 0, 8, device=DEVICE)
    est = KN.hajek_attention(q, k, v, torch.ones(1, 1, 0, device=DEVICE))
    assert torch.equal(est.output, torch.zeros(1, 2, 8, device=DEVICE))
    assert torch.isneginf(est.lse).all() and torch.isposinf(est.variance).all() and torch.isposinf(est.trace).all()
    assert torch.equal(est.n_eff, torch.zeros(1, 2, device=DEVICE))


@pytest.mark.parametrize("use_log", [False, True])
def test_certain_tokens_give_exact_attention_and_zero_variance(use_log):
    """All pi = 1: the Hajek estimate is plain attention and every variance is exactly 0
    (1 - pi = 0 zeroes each weight, with log pi = 0 as well)."""
    q, k, v, pi = _make_case(3, 2, 2, 2, 90, 16, 24, torch.float32, pi_kind="ones")
    est = _run(q, k, v, pi, use_log=use_log, block_n=16, num_splits=2)
    assert torch.equal(est.variance, torch.zeros_like(est.variance))
    assert torch.equal(est.trace, torch.zeros_like(est.trace))
    assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=2, fields=("output", "lse", "n_eff"))
    g = 2
    for bi in range(2):
        for h in range(4):
            o = R.attention(q[bi, h].double().cpu().numpy(), k[bi, h // g].double().cpu().numpy(),
                            v[bi, h // g].double().cpu().numpy())
            assert np.allclose(est.output[bi, h].cpu().numpy(), o, rtol=0,
                               atol=rounding(torch.float32, 90, 16) * np.abs(v.cpu().numpy()).max())


def test_log_pi_path_matches_pi_path():
    """pi near 1 is where 1 - pi = -expm1(log pi) cancels: the two paths must agree to a few ulps.

    1 - pi is exact from pi (Sterbenz); from log pi it carries the rounding of log (eps/2,
    relative, propagated as eps/2) and of the series (7 fused steps): <= 8 eps relative on each
    positive weight c_i, so on the variance, plus the accumulation bound of the two runs."""
    rng = np.random.default_rng(11)
    q, k, v, _ = _make_case(11, 1, 2, 2, 150, 16, 16, torch.float32)
    pi = torch.from_numpy(rng.uniform(0.75, 1.0, size=(1, 2, 150))).float()
    pi[..., ::7] = 1.0
    pi = pi.to(DEVICE)
    a = KN.hajek_attention(q, k, v, pi, block_n=32)
    b = KN.hajek_attention(q, k, v, log_pi=torch.log(pi), block_n=32)
    eps = torch.finfo(torch.float32).eps
    tol = 8 * eps + 2 * rounding(torch.float32, 150, 32)
    assert not _paths_differ(a, b, tol), _paths_differ(a, b, tol)
    # negative control: log pi off by 0.1% (1 - pi by about as much) is caught
    bad = KN.hajek_attention(q, k, v, log_pi=torch.log(pi) * (1 + 1e-3), block_n=32)
    assert _paths_differ(a, bad, tol)


def _paths_differ(a, b, tol) -> list[str]:
    """The fields of two estimates whose difference exceeds ``tol`` against the field's scale: an output or
    per-coordinate variance row against its largest entry (a coordinate near 0 carries the row's rounding,
    not its own), lse against max(|lse|, 1) (log's rounding is absolute below 1), trace and n_eff against
    themselves."""
    out = []
    for f in ("variance", "trace", "output", "lse", "n_eff"):
        x, y = getattr(a, f).double().cpu().numpy(), getattr(b, f).double().cpu().numpy()
        rel = (np.abs(x - y) / np.maximum(field_scale(f, y), 1e-30)).max()
        if rel > tol:
            out.append(f"{f}: log_pi and pi paths differ by {rel:.2e} of its scale (tol {tol:.2e})")
    return out


def test_float64_probabilities_below_float32_range():
    """float64 pi of 1e-50 would round to 0 (= padding) in float32; the kernel keeps the token
    (its logit bias is +115, so it carries almost all the weight)."""
    q, k, v, pi = _make_case(5, 1, 1, 2, 40, 16, 16, torch.float32, pi_kind="interior")
    pi = pi.double()
    pi[0, 0, 3] = 1e-50
    est = KN.hajek_attention(q, k, v, pi, block_n=16)
    ref = _oracle(q, k, v, pi)
    # the table's lse allowance against max(|lse|, 1) (assert_matches_oracle's, less its low-precision
    # term: the float32 mirror would round pi = 1e-50 to padding): one store, the tiled sum of n = 40
    tol = store_eps("lse", torch.float32) + rounding(torch.float32, 40, 16)
    assert_within_scale("lse", est.lse, ref["lse"], tol, "lse")
    with pytest.raises(AssertionError):  # negative control: 20 units of it
        assert_within_scale("lse", ref["lse"] + 20 * tol * field_scale("lse", ref["lse"]), ref["lse"], tol, "lse")
    vmax = np.abs(v.cpu().numpy()).max()
    assert np.allclose(est.output.double().cpu().numpy(), ref["output"], rtol=0,
                       atol=rounding(torch.float32, 40, 16) * vmax)


def test_per_coordinate_false_and_certify_false():
    q, k, v, pi = _make_case(2, 1, 2, 2, 77, 16, 16, torch.bfloat16, pad="ragged")
    full = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=2)
    tr = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=2, per_coordinate=False)
    plain = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=2, certify=False)
    assert tr.variance is None and plain.variance is None and plain.trace is None and plain.n_eff is None
    for x, y, f in ((tr.trace, full.trace, "trace"), (tr.output, full.output, "output"),
                    (plain.output, full.output, "output"), (plain.lse, full.lse, "lse")):
        assert_same_variant(f, x, y, torch.bfloat16, 77, 16, exact=KN.INTERPRETED)
    # negative control of the compiled kernel's comparison (run here on the interpreter's results): each
    # field moved by 20 units of its allowance fails it
    for x, f in ((full.trace, "trace"), (full.output, "output"), (full.lse, "lse")):
        step = 20 * variant_tolerance(f, torch.bfloat16, 77, 16)
        moved = x.double().cpu() + step * torch.from_numpy(field_scale(f, x))
        assert_same_variant(f, x, x, torch.bfloat16, 77, 16, exact=False)
        with pytest.raises(AssertionError):
            assert_same_variant(f, moved, x, torch.bfloat16, 77, 16, exact=False)


def test_strided_inputs_and_4d_query():
    """Any strides (a (b, n, h, d) cache viewed as (b, h, n, d)) and q of shape (b, h_q, 1, d)."""
    q, k, v, pi = _make_case(4, 2, 2, 2, 50, 16, 16, torch.float32, pad="ragged")
    ks, vs = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    ps = pi.transpose(1, 2).contiguous().transpose(1, 2)
    assert not ks.is_contiguous()
    base = KN.hajek_attention(q, k, v, pi, block_n=16)
    est = KN.hajek_attention(q.unsqueeze(2), ks, vs, ps, block_n=16)
    assert est.output.shape == (2, 4, 1, 16) and est.trace.shape == (2, 4, 1)
    for f in FIELDS:
        assert torch.equal(getattr(est, f).squeeze(2), getattr(base, f)), f


# ----------------------------------------------------------------------------- bad input

def _good():
    return (torch.randn(1, 4, 16, device=DEVICE), torch.randn(1, 2, 5, 16, device=DEVICE),
            torch.randn(1, 2, 5, 8, device=DEVICE), torch.rand(1, 2, 5, device=DEVICE))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: dict(a, q=a["q"][0]), ValueError, "q must have shape"),
    (lambda a: dict(a, q=a["q"].unsqueeze(2).expand(1, 4, 2, 16)), ValueError, "decode kernel"),
    (lambda a: dict(a, keys=a["keys"][..., :8]), ValueError, "keys must have shape"),
    (lambda a: dict(a, values=a["values"][:, :, :4]), ValueError, "values must have shape"),
    (lambda a: dict(a, pi=a["pi"][..., :4]), ValueError, "pi must have shape"),
    (lambda a: dict(a, q=a["q"][:, :3]), ValueError, "multiple of h_kv"),
    (lambda a: dict(a, q=a["q"].double(), keys=a["keys"].double(), values=a["values"].double()),
     TypeError, "dtype float16, bfloat16 or float32"),
    (lambda a: dict(a, q=a["q"].half()), TypeError, "share one dtype"),
    (lambda a: dict(a, pi=None), TypeError, "exactly one of pi and log_pi"),
    (lambda a: dict(a, log_pi=torch.log(a["pi"])), TypeError, "exactly one of pi and log_pi"),
    (lambda a: dict(a, pi=a["pi"] + 1.5), ValueError, r"pi must lie in \[0, 1\]"),
    (lambda a: dict(a, pi=a["pi"].masked_fill(a["pi"] > 0.5, float("nan"))), ValueError, "pi must lie"),
    (lambda a: dict(a, pi=None, log_pi=torch.ones(1, 2, 5)), ValueError, r"log_pi must lie in \[-inf, 0\]"),
    (lambda a: dict(a, pi=(a["pi"] > 2).long()), TypeError, "floating-point"),
    (lambda a: dict(a, q=a["q"].masked_fill(a["q"] > 1, float("inf"))), ValueError, "q must be finite"),
    (lambda a: dict(a, block_n=24), ValueError, "block_n must be a power of two"),
    (lambda a: dict(a, num_splits=0), ValueError, "num_splits must be a positive int"),
    (lambda a: dict(a, scale=float("nan")), ValueError, "scale must be a finite positive"),
    (lambda a: dict(a, moments="fast"), ValueError, "moments must be"),
    (lambda a: dict(a, keys=a["keys"].numpy() if a["keys"].device.type == "cpu" else None),
     TypeError, "keys must be a torch.Tensor"),
])
def test_bad_input_raises(mutate, exc, match):
    q, k, v, pi = _good()
    args = mutate(dict(q=q, keys=k, values=v, pi=pi))
    if "log_pi" in args and args["log_pi"] is not None:
        args["log_pi"] = args["log_pi"].to(DEVICE)
    with pytest.raises(exc, match=match):
        KN.hajek_attention(**args)


# ----------------------------------------------------------------------------- real GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or KN.INTERPRETED,
                         reason="needs a CUDA device and the compiled (not interpreted) kernel")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_realistic_decode(dtype):
    """b=2, h_q=32, h_kv=8, d=128, n=5000 ragged, default block and split choice, against the
    oracle and kvcert.fast; the one-pass moments against the oracle."""
    fast = pytest.importorskip("kvcert.fast")
    q, k, v, pi = _make_case(0, 2, 8, 4, 5000, 128, 128, dtype, pad="ragged")
    est = KN.hajek_attention(q, k, v, pi)
    assert_matches_oracle(est, q, k, v, pi, dtype)
    assert_matches_oracle(est, q, k, v, pi, dtype, other=fast.hajek_attention(q, k, v, pi))
    est_log = KN.hajek_attention(q, k, v, log_pi=torch.log(pi), num_splits=7, block_n=32)
    assert_matches_oracle(est_log, q, k, v, pi, dtype, block_n=32, num_splits=7)
    for per_coordinate in (True, False):  # the one-pass moments at their default tiles and splits
        est_op = KN.hajek_attention(q, k, v, log_pi=torch.log(pi), moments="onepass", per_coordinate=per_coordinate)
        assert_matches_oracle(est_op, q, k, v, pi, dtype, moments="onepass",
                              fields=FIELDS if per_coordinate else ("output", "lse", "trace", "n_eff"))


# ----------------------------------------------------------------------------- benchmark script

def test_gpu_benchmark_dry_run(tmp_path):
    """benchmarks/gpu_decode.py runs every code path at tiny sizes and writes its JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"
    spec = importlib.util.spec_from_file_location("gpu_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dry.json"
    mod.main(["--dry-run", "--device", DEVICE, "--batch", "1", "--kept", "40", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["dry_run"] and rep["summary"]["correctness_ok"] is True
    assert rep["summary"]["correctness_cases"] == 12 and len(rep["timings"]) == 1 and rep["tuning"]
    res = rep["timings"][0]["results"]
    for name in ("hajek", "hajek_nocert", "sdpa_mask[auto]", "sdpa_nomask[auto]"):
        assert res[name]["median_ms"] > 0 and res[name]["q20_ms"] <= res[name]["q80_ms"], name
    t = rep["targets"][0]
    assert t["fastest_sdpa"].startswith("sdpa") and t["throughput_vs_fastest_sdpa"] > 0
    assert rep["measured_on_gpu"] == (DEVICE == "cuda")


@pytest.mark.slow
def test_compiles_for_sm90_without_a_gpu():
    """The compiled (non-interpreted) kernels lower to sm_90 cubins: the interpreter cannot catch
    type or layout errors of the compiled path. Runs in a subprocess without TRITON_INTERPRET."""
    import json
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kvcert.kernels.aot", "--dtype", "bf16"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["kernels"]
    assert len(rows) == 5 and all(r["ok"] for r in rows), rows
    assert [r["kernel"] for r in rows] == ["decode"] * 3 + ["merge", "tail_moment"]
