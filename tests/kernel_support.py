"""Helpers of the Triton decode kernel's tests (tests/test_kernels_hajek.py, tests/test_kernels_onepass.py): the
float64 oracle per query head, the derived rounding allowance of each moments mode, and
:func:`assert_matches_oracle`, the check both test modules make (a plain module, not collected)."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from support import (COMPUTE, EPS, assert_close, make_case, naive_hajek_heads, reference_heads, rounding, store_eps,
                     triton_kernels)

KN, DEVICE = triton_kernels()  # skips the importing module without triton, or without CUDA and TRITON_INTERPRET=1
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


def _without_fpc(est, q, k, v, pi):
    """The variance a kernel would give without the (1 - pi) factor: sum a_i^2 (v_i - o)^2 from the
    float64 reference's weights (per query head, GQA), cast like the kernel's variance."""
    out = torch.zeros_like(est.variance)
    for (bi, h), (e, vv, _) in reference_heads(q, k, v, pi).items():
        out[bi, h] = torch.as_tensor((e.weights[:, None] ** 2 * (vv - e.output) ** 2).sum(0), dtype=out.dtype)
    return out


# ----------------------------------------------------------------------------- the split count

class MergeSpy:
    """Stands in for a split-merge kernel and records the split count of each launch (its ninth argument, S)."""

    def __init__(self, kernel):
        self.kernel, self.splits = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kw):
            self.splits.append(int(args[8]))
            return launch(*args, **kw)

        return run


def as_on_sms(monkeypatch, sms):
    """Make the kernel wrappers pick their split count as on a GPU of ``sms`` streaming multiprocessors (the
    interpreter has none: ``kvcert.kernels.hajek._device_sms``), and spy on the merge kernels: returns
    ``(spy, spy_onepass)``, the :class:`MergeSpy` of ``hajek_merge_kernel`` (the two-pass and paged kernels')
    and of ``_onepass_merge_kernel``."""
    from kvcert.kernels import hajek as H
    from kvcert.kernels import paged as P

    monkeypatch.setattr(H, "_device_sms", lambda device: sms)
    spy, spy1 = MergeSpy(H.hajek_merge_kernel), MergeSpy(H._onepass_merge_kernel)
    monkeypatch.setattr(H, "hajek_merge_kernel", spy)
    monkeypatch.setattr(P, "hajek_merge_kernel", spy)
    monkeypatch.setattr(H, "_onepass_merge_kernel", spy1)
    return spy, spy1
