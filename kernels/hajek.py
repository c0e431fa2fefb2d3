"""Fused Hajek decode attention: output, log-normalizer and survey variance in one pass.

Flash-decoding layout: one program per (batch, KV head, block of the query
heads that share it, split of the sequence). The program streams its K/V
tiles once, keeps an online softmax (running max ``m``, normalizer ``l``,
unnormalized output ``acc``) and, for the variance, moments of the values
under the weights ``w_i = (1 - pi_i) e^{2 (l_i - m)}``: either each tile's
weighted mean and centred second moment merged with Chan's pairwise formula
(``moments="exact"`` / ``"shifted"``, ``_hajek_decode_kernel``), or the sums
U, S1, S2 around a centre shared by the query heads, rescaled like the softmax
sum (``moments="onepass"``, ``_hajek_onepass_kernel``). Splits of a long
sequence are merged by a second kernel with the same formulas. See docs/gpu.md
for the derivations.

On request (``return_tail_moment=True``) an epilogue kernel makes a second pass
over the kept K/V once o_hat and lse are known, for the ``chebyshev_ucb``
certificate's s2 = sum_i (1 - pi_i)^3 a_i^4 ||v_i - o_hat||^4 (it needs o_hat
inside the sum, so it cannot join the first pass without dv^2 accumulators).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcert.fast.contract import AttentionLayout, check_attention_inputs
from kvcert.fast.types import Estimate

__all__ = ["hajek_attention", "default_config", "default_moments", "num_splits_heuristic", "SUPPORTED_DTYPES",
           "INTERPRETED"]

#: input dtypes the kernel accepts (accumulation is always float32)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: how the variance's moments are formed (``moments=``; "auto" picks :func:`default_moments`)
MOMENTS = ("onepass", "exact", "shifted")
MAX_ROWS = 16  # query heads per program (tl.dot needs M >= 16; more rows -> more programs)
_MIN_TILES_PER_SPLIT = 4  # a split streams at least this many tiles, so merging stays cheap
_MIN_TOKENS_PER_SPLIT = 1024  # ... and at least this many tokens (flash decoding's splits are ~1k tokens or more)
_WAVE_EFFICIENCY = 0.85  # the fewest splits within this fraction of the best wave efficiency (FlashAttention-3)
_MAX_SPLITS = 128  # FlashAttention-3's cap on the split count


@triton.jit
def program_rows(H_KV, H_Q, G: tl.constexpr, G_BLOCK: tl.constexpr, N_RB: tl.constexpr, R_PAD: tl.constexpr):
    """The program's (batch row or sequence, KV head) and the query heads it serves, packed as the rows of
    one tile (GQA): ``(bi, kvh, r, rmask, head, rows)``, ``rows = bi * H_Q + head`` the flattened output
    rows; int64 indices (b * stride_b exceeds 2^31 for large caches). The set-up of every decode kernel."""
    pid = tl.program_id(0)
    rb = pid % N_RB
    bk = pid // N_RB
    kvh = (bk % H_KV).to(tl.int64)
    bi = (bk // H_KV).to(tl.int64)
    r = tl.arange(0, R_PAD)
    g_idx = rb * G_BLOCK + r  # index of the query head inside its GQA group
    rmask = (r < G_BLOCK) & (g_idx < G)
    head = kvh * G + g_idx
    return bi, kvh, r, rmask, head, bi * H_Q + head


@triton.jit
def load_rows(Qb, head, rmask, stride_qh, stride_qd, D: tl.constexpr, D_PAD: tl.constexpr, DOT_F32: tl.constexpr):
    """The program's query rows (R_PAD, D_PAD) from ``Qb`` (the row's base pointer), 0 where masked; float32
    where DOT_F32."""
    offs_d = tl.arange(0, D_PAD)
    q = tl.load(Qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=rmask[:, None] & (offs_d < D)[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def exact_tile_moments(w, vf, r, R_PAD: tl.constexpr, DV_PAD: tl.constexpr, G_BLOCK: tl.constexpr):
    """A tile's weighted mean and centred second moment of v under w (R_PAD, T), per query head, in two
    passes over the tile held in registers (the "exact" tile moments; the paged compacted kernel's too)."""
    t_mean = tl.zeros([R_PAD, DV_PAD], tl.float32)
    t_M2 = tl.zeros([R_PAD, DV_PAD], tl.float32)
    for j in tl.static_range(G_BLOCK):
        sel = r == j
        wj = tl.sum(tl.where(sel[:, None], w, 0.0), axis=0)
        Wj = tl.sum(wj, axis=0)
        mj = tl.sum(wj[:, None] * vf, axis=0) / tl.where(Wj > 0.0, Wj, 1.0)
        cj = vf - mj[None, :]
        M2j = tl.sum(wj[:, None] * cj * cj, axis=0)
        t_mean = tl.where(sel[:, None], mj[None, :], t_mean)
        t_M2 = tl.where(sel[:, None], M2j[None, :], t_M2)
    return t_mean, t_M2


@triton.jit
def neg_expm1(x):
    """1 - e^x for x <= 0, accurate to float32 rounding near x = 0 (where 1 - e^x cancels)."""
    # Taylor series of -(e^x - 1) = -x (1 + x/2 + x^2/6 + ... + x^6/5040) for |x| <= 1/4:
    # the truncated term x^8/8! is below 4e-10 relative there.
    p = 1.0 / 5040.0
    p = p * x + 1.0 / 720.0
    p = p * x + 1.0 / 120.0
    p = p * x + 1.0 / 24.0
    p = p * x + 1.0 / 6.0
    p = p * x + 0.5
    p = p * x + 1.0
    small = -x * p
    # away from 0, e^x <= 0.78 and 1 - e^x has no cancellation
    return tl.where(x > -0.25, small, 1.0 - tl.exp(x))


@triton.jit
def load_tile(q, k_base, v_base, p_base, offs_n, nmask, offs_d, dmask, offs_v, vmask,
          stride_kn, stride_kd, stride_vn, stride_vd, stride_pn, scale,
          LOG_PI: tl.constexpr, DOT_F32: tl.constexpr):
    """One tile of kept tokens, shared by both passes: V, the Hajek logits tau q.k_i - log pi_i
    (padding gets -inf, not -log 0 = +inf), 1 - pi_i (0 on padding) and the present mask."""
    k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_v[None, :] * stride_vd,
                mask=nmask[:, None] & vmask[None, :], other=0.0)
    if LOG_PI:
        log_p = tl.load(p_base + offs_n * stride_pn, mask=nmask, other=float("-inf")).to(tl.float32)
        one_minus = neg_expm1(log_p)
    else:
        pi = tl.load(p_base + offs_n * stride_pn, mask=nmask, other=0.0).to(tl.float32)
        log_p = tl.where(pi > 0.0, tl.log(tl.where(pi > 0.0, pi, 1.0)), float("-inf"))  # padding
        one_minus = 1.0 - pi
    present = log_p > float("-inf")
    one_minus = tl.where(present, one_minus, 0.0)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    logits = tl.where(present[None, :], s * scale - log_p[None, :], float("-inf"))
    return v, logits, one_minus, present


@triton.jit
def online_step(m, logits):
    """Online-softmax step over one tile: m' = max(m, max_i l_i), alpha = e^{m - m'}, p_i = e^{l_i - m'}
    (a row still all -inf uses m' = 0 for the exponents, so no -inf - -inf is evaluated)."""
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: avoid -inf - -inf
    alpha = tl.exp(m - m_use)
    p = tl.exp(logits - m_use[:, None])
    return m_new, alpha, p


@triton.jit
def softmax_pv(m, l, l_o, logits, v, ROUND_P: tl.constexpr, DOT_F32: tl.constexpr):
    """One tile of the online softmax and its P V product: (m', alpha, p, l, l_o, P V, the tile's sum of the
    p that formed P V); the caller rescales its accumulator by alpha and adds P V. P V runs at the input precision (tensor cores); with ROUND_P, l_o sums the *rounded*
    p, so that acc / l_o stays a weighted mean of v (unbiased towards 0 by 2^-9 |v|, which would swamp the
    variance under a value offset)."""
    m_new, alpha, p = online_step(m, logits)
    t = tl.sum(p, axis=1)
    l = l * alpha + t
    p_lo = p.to(v.dtype)
    if ROUND_P:
        t = tl.sum(p_lo.to(tl.float32), axis=1)
        l_o = l_o * alpha + t
    if DOT_F32:
        pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p_lo, v)
    return m_new, alpha, p, l, l_o, pv, t


@triton.jit
def chan_merge(W_a, mean_a, M2_a, W_b, mean_b, M2_b):
    """Chan's pairwise merge of two weighted (W, mean, M2) states whose W and M2 are already rescaled to
    the common max: W = W_a + W_b, mean = mean_a + delta W_b / W, M2 = M2_a + M2_b + delta^2 W_a W_b / W."""
    W_n = W_a + W_b
    ratio = W_b / tl.where(W_n > 0.0, W_n, 1.0)
    delta = mean_b - mean_a
    mean = mean_a + delta * ratio[:, None]
    M2 = M2_a + M2_b + delta * delta * (W_a * ratio)[:, None]
    return W_n, mean, M2


@triton.jit
def store_split(PartS, PartV, base, smask, offs_v, m, l, l_o, acc, W, mean, M2, Q2,
                 DV_PAD: tl.constexpr, CERTIFY: tl.constexpr, ROUND_P: tl.constexpr):
    """One split's state to the float32 workspace read by ``hajek_merge_kernel``:
    PartS[base] = (m, l, W, Q2, l_o), PartV[base] = (acc, mean, M2)."""
    tl.store(PartS + base * 5 + 0, m, mask=smask)
    tl.store(PartS + base * 5 + 1, l, mask=smask)
    tl.store(PartS + base * 5 + 2, W, mask=smask)
    tl.store(PartS + base * 5 + 3, Q2, mask=smask)
    if ROUND_P:
        tl.store(PartS + base * 5 + 4, l_o, mask=smask)
    vptr = PartV + (base * 3)[:, None] * DV_PAD + offs_v[None, :]
    pmask = smask[:, None]
    tl.store(vptr, acc, mask=pmask)
    if CERTIFY:
        tl.store(vptr + DV_PAD, mean, mask=pmask)
        tl.store(vptr + 2 * DV_PAD, M2, mask=pmask)


@triton.jit
def finalize_rows(rows, rmask, offs_v, vmask, m, l, l_o, acc, W, mean, M2, Q2,
              Out, Lse, Var, Tr, Neff, DV,
              CERTIFY: tl.constexpr, PER_COORD: tl.constexpr):
    """o = acc / l_o, lse = m + log l, var = [M2 + W (mean - o)^2] / l^2, n_eff = l^2 / Q2
    (l_o: the normalizer of the rounded probabilities that formed acc; l_o = l in float32)."""
    empty = l == 0.0  # every slot padding: o = 0, lse = -inf, variance = +inf, n_eff = 0
    l_safe = tl.where(empty, 1.0, l)
    o = acc / tl.where(empty, 1.0, l_o)[:, None]
    omask = rmask[:, None] & vmask[None, :]
    tl.store(Out + rows[:, None] * DV + offs_v[None, :], o.to(Out.dtype.element_ty), mask=omask)
    lse = tl.where(empty, float("-inf"), m + tl.log(l_safe))
    tl.store(Lse + rows, lse, mask=rmask)
    if CERTIFY:
        diff = mean - o
        var = (M2 + W[:, None] * diff * diff) / (l_safe * l_safe)[:, None]
        var = tl.where(empty[:, None], float("inf"), var)
        if PER_COORD:
            tl.store(Var + rows[:, None] * DV + offs_v[None, :], var, mask=omask)
        tr = tl.sum(tl.where(vmask[None, :], var, 0.0), axis=1)
        tl.store(Tr + rows, tr, mask=rmask)
        q2_safe = tl.where(empty, 1.0, Q2)
        tl.store(Neff + rows, tl.where(empty, 0.0, l_safe * l_safe / q2_safe), mask=rmask)


@triton.jit
def _hajek_decode_kernel(
    Q, K, V, P, Out, Lse, Var, Tr, Neff, PartS, PartV,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_ph, stride_pn,
    H_KV, H_Q, N, CHUNK, BH, scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    G: tl.constexpr, G_BLOCK: tl.constexpr, N_RB: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, LOG_PI: tl.constexpr, CERTIFY: tl.constexpr, PER_COORD: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, ROUND_P: tl.constexpr, EXACT_MOMENTS: tl.constexpr,
):
    """One (batch, KV head, query-head block, split): online softmax of s_i - log pi_i and the
    Chan-merged (1 - pi_i) a_i^2 weighted mean / second moment of v_i."""
    sid = tl.program_id(1)
    bi, kvh, r, rmask, head, rows = program_rows(H_KV, H_Q, G, G_BLOCK, N_RB, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    dmask = offs_d < D
    vmask = offs_v < DV

    q = load_rows(Q + bi * stride_qb, head, rmask, stride_qh, stride_qd, D, D_PAD, DOT_F32)

    m = tl.full([R_PAD], float("-inf"), tl.float32)
    l = tl.zeros([R_PAD], tl.float32)
    l_o = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, DV_PAD], tl.float32)
    W = tl.zeros([R_PAD], tl.float32)
    mean = tl.zeros([R_PAD, DV_PAD], tl.float32)
    M2 = tl.zeros([R_PAD, DV_PAD], tl.float32)
    Q2 = tl.zeros([R_PAD], tl.float32)

    k_base = K + bi * stride_kb + kvh * stride_kh
    v_base = V + bi * stride_vb + kvh * stride_vh
    p_base = P + bi * stride_pb + kvh * stride_ph
    start = sid * CHUNK
    end = tl.minimum(start + CHUNK, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        v, logits, one_minus, present = load_tile(q, k_base, v_base, p_base, offs_n, nmask, offs_d, dmask, offs_v,
                                              vmask, stride_kn, stride_kd, stride_vn, stride_vd, stride_pn,
                                              scale, LOG_PI, DOT_F32)

        m_new, alpha, p, l, l_o, pv, _ = softmax_pv(m, l, l_o, logits, v, ROUND_P, DOT_F32)
        acc = acc * alpha[:, None] + pv

        if CERTIFY:
            a2 = alpha * alpha  # weights e^{2(l_i - m)} rescale by e^{2 dm}
            pp = p * p
            Q2 = Q2 * a2 + tl.sum(pp, axis=1)
            w = one_minus[None, :] * pp
            vf = v.to(tl.float32)
            t_W = tl.sum(w, axis=1)
            if EXACT_MOMENTS:
                # exact two-pass moments of the tile, one query head at a time (V stays in registers)
                t_mean, t_M2 = exact_tile_moments(w, vf, r, R_PAD, DV_PAD, G_BLOCK)
            else:
                # shifted sums on the tensor cores: mu = the tile's mean kept value (shared by the
                # query heads), S1 = sum w (v - mu), S2 = sum w (v - mu)^2, M2 = S2 - S1^2 / W
                n_kept = tl.sum(present.to(tl.float32), axis=0)
                vp = tl.where(present[:, None], vf, 0.0)
                mu = tl.sum(vp, axis=0) / tl.maximum(n_kept, 1.0)
                vc = tl.where(present[:, None], vf - mu[None, :], 0.0)
                if DOT_F32:
                    S1 = tl.dot(w, vc, input_precision="ieee")
                    S2 = tl.dot(w, vc * vc, input_precision="ieee")
                else:
                    S1 = tl.dot(w, vc, input_precision="tf32x3")
                    S2 = tl.dot(w, vc * vc, input_precision="tf32x3")
                d1 = S1 / tl.where(t_W > 0.0, t_W, 1.0)[:, None]
                t_mean = mu[None, :] + d1
                t_M2 = tl.maximum(S2 - S1 * d1, 0.0)
            # Chan's pairwise merge of (W, mean, M2) with the tile's moments
            W, mean, M2 = chan_merge(W * a2, mean, M2 * a2[:, None], t_W, t_mean, t_M2)
        m = m_new

    if SPLIT:
        store_split(PartS, PartV, sid * BH + rows, rmask, offs_v, m, l, l_o, acc, W, mean, M2, Q2,
                     DV_PAD, CERTIFY, ROUND_P)
    else:
        if not ROUND_P:
            l_o = l
        finalize_rows(rows, rmask, offs_v, vmask, m, l, l_o, acc, W, mean, M2, Q2,
                  Out, Lse, Var, Tr, Neff, DV, CERTIFY, PER_COORD)


@triton.jit
def hajek_merge_kernel(
    PartS, PartV, Out, Lse, Var, Tr, Neff, BH, S,
    DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
    CERTIFY: tl.constexpr, PER_COORD: tl.constexpr, ROUND_P: tl.constexpr,
):
    """Merge S split states per row: rescale by e^{m_s - m} (weights by e^{2(m_s - m)}), Chan for
    (W, mean, M2), then finalize."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < BH
    offs_v = tl.arange(0, DV_PAD)
    vmask = offs_v < DV
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    l_o = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    W = tl.zeros([BLOCK_R], tl.float32)
    mean = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    M2 = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    Q2 = tl.zeros([BLOCK_R], tl.float32)
    for s in range(S):
        base = s * BH + rows
        m_s = tl.load(PartS + base * 5 + 0, mask=rmask, other=float("-inf"))
        l_s = tl.load(PartS + base * 5 + 1, mask=rmask, other=0.0)
        vptr = PartV + (base * 3)[:, None] * DV_PAD + offs_v[None, :]
        acc_s = tl.load(vptr, mask=rmask[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        beta = tl.exp(m_s - m_use)
        l = l * alpha + l_s * beta
        if ROUND_P:
            l_o = l_o * alpha + tl.load(PartS + base * 5 + 4, mask=rmask, other=0.0) * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        if CERTIFY:
            W_s = tl.load(PartS + base * 5 + 2, mask=rmask, other=0.0)
            Q2_s = tl.load(PartS + base * 5 + 3, mask=rmask, other=0.0)
            mean_s = tl.load(vptr + DV_PAD, mask=rmask[:, None], other=0.0)
            M2_s = tl.load(vptr + 2 * DV_PAD, mask=rmask[:, None], other=0.0)
            a2 = alpha * alpha
            b2 = beta * beta
            W, mean, M2 = chan_merge(W * a2, mean, M2 * a2[:, None], W_s * b2, mean_s, M2_s * b2[:, None])
            Q2 = Q2 * a2 + Q2_s * b2
        m = m_new
    if not ROUND_P:
        l_o = l
    finalize_rows(rows, rmask, offs_v, vmask, m, l, l_o, acc, W, mean, M2, Q2,
              Out, Lse, Var, Tr, Neff, DV, CERTIFY, PER_COORD)


# ----------------------------------------------------------------------------- one-pass moments

@triton.jit
def _onepass_finalize(rows, rmask, offs_v, vmask, m, l, l_o, acc, U, S1, S2, Q2, c,
                      Out, Lse, Var, Tr, Neff, DV,
                      CERTIFY: tl.constexpr, PER_COORD: tl.constexpr):
    """o = acc / l_o, lse = m + log l, var = max(S2 - 2 delta S1 + delta^2 U, 0) / l^2 with
    delta = o - c (per coordinate; the trace from T2 = S2 and delta . S1 when PER_COORD is off),
    n_eff = l^2 / Q2. Empty rows (l = 0): o = 0, lse = -inf, variance and trace +inf, n_eff 0."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    o = acc / tl.where(empty, 1.0, l_o)[:, None]
    omask = rmask[:, None] & vmask[None, :]
    tl.store(Out + rows[:, None] * DV + offs_v[None, :], o.to(Out.dtype.element_ty), mask=omask)
    tl.store(Lse + rows, tl.where(empty, float("-inf"), m + tl.log(l_safe)), mask=rmask)
    if CERTIFY:
        delta = o - c  # 0 on padded coordinates (acc and c are 0 there), so are S1 and S2
        l2 = l_safe * l_safe
        if PER_COORD:
            num = S2 - delta * (2.0 * S1 - delta * U[:, None])
            var = tl.where(empty[:, None], float("inf"), tl.maximum(num, 0.0) / l2[:, None])
            tl.store(Var + rows[:, None] * DV + offs_v[None, :], var, mask=omask)
            tr = tl.sum(tl.where(vmask[None, :], var, 0.0), axis=1)
        else:
            num = S2 - tl.sum(delta * (2.0 * S1 - delta * U[:, None]), axis=1)
            tr = tl.where(empty, float("inf"), tl.maximum(num, 0.0) / l2)
        tl.store(Tr + rows, tr, mask=rmask)
        q2_safe = tl.where(empty, 1.0, Q2)
        tl.store(Neff + rows, tl.where(empty, 0.0, l2 / q2_safe), mask=rmask)


@triton.jit
def _follow_centre(logits, rmask, vf, c, M, U, S1, S2, BLOCK_N: tl.constexpr, PER_COORD: tl.constexpr):
    """Move the centre c to the value of the tile's largest logit over the block's rows when it beats M, the
    largest so far, and the sums with it exactly (S2 += e (2 S1 + e U), S1 += e U, e = c - c'): a token
    that dominates a row then adds exactly 0 to S1 and S2, and no large term cancels at the end."""
    col = tl.max(tl.where(rmask[:, None], logits, float("-inf")), axis=0)
    best = tl.max(col, axis=0)
    j = tl.argmax(col, axis=0)
    v_j = tl.sum(tl.where((tl.arange(0, BLOCK_N) == j)[:, None], vf, 0.0), axis=0)
    move = best > M
    e = tl.where(move, c - v_j, 0.0)  # 0 (an exact no-op below) unless the max moved
    c = tl.where(move, v_j, c)
    M = tl.maximum(M, best)
    if PER_COORD:
        S2 = S2 + e[None, :] * (2.0 * S1 + e[None, :] * U[:, None])
    else:
        S2 = S2 + tl.sum(e[None, :] * (2.0 * S1 + e[None, :] * U[:, None]), axis=1)
    S1 = S1 + e[None, :] * U[:, None]
    return c, M, S1, S2


@triton.jit
def _onepass_store_split(PartS, PartV, base, rmask, offs_v, m, l, l_o, acc, U, Q2, S1, S2, M, c,
                         R_PAD: tl.constexpr, DV_PAD: tl.constexpr, CERTIFY: tl.constexpr,
                         PER_COORD: tl.constexpr, ROUND_P: tl.constexpr):
    """One split's one-pass state to the float32 workspace read by ``_onepass_merge_kernel``:
    PartS[base] = (m, l, U, Q2, l_o, T2, M), PartV[base] = (acc, S1, S2, c)."""
    tl.store(PartS + base * 7 + 0, m, mask=rmask)
    tl.store(PartS + base * 7 + 1, l, mask=rmask)
    if ROUND_P:
        tl.store(PartS + base * 7 + 4, l_o, mask=rmask)
    vptr = PartV + (base * 4)[:, None] * DV_PAD + offs_v[None, :]
    pmask = rmask[:, None]
    tl.store(vptr, acc, mask=pmask)
    if CERTIFY:
        tl.store(PartS + base * 7 + 2, U, mask=rmask)
        tl.store(PartS + base * 7 + 3, Q2, mask=rmask)
        if not PER_COORD:
            tl.store(PartS + base * 7 + 5, S2, mask=rmask)
        tl.store(PartS + base * 7 + 6, M + tl.zeros([R_PAD], tl.float32), mask=rmask)
        tl.store(vptr + DV_PAD, S1, mask=pmask)
        if PER_COORD:
            tl.store(vptr + 2 * DV_PAD, S2, mask=pmask)
        tl.store(vptr + 3 * DV_PAD, c[None, :] + tl.zeros([R_PAD, DV_PAD], tl.float32), mask=pmask)


@triton.jit
def _hajek_onepass_kernel(
    Q, K, V, P, C, Out, Lse, Var, Tr, Neff, PartS, PartV,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_ph, stride_pn,
    stride_cb, stride_ch, stride_cd,
    H_KV, H_Q, N, CHUNK, BH, scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    G: tl.constexpr, G_BLOCK: tl.constexpr, N_RB: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, LOG_PI: tl.constexpr, CERTIFY: tl.constexpr, PER_COORD: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, ROUND_P: tl.constexpr, HAS_CENTER: tl.constexpr,
):
    """One (batch, KV head, query-head block, split): online softmax of s_i - log pi_i and the sums
    U = sum u_i, S1 = sum u_i (v_i - c), S2 = sum u_i (v_i - c)^2 (T2 = sum u_i ||v_i - c||^2 without
    PER_COORD) of u_i = (1 - pi_i) e^{2 (l_i - m)}, rescaled by e^{2 (m_old - m)} like the softmax sum,
    around a centre c shared by the block's query heads: the given one (HAS_CENTER), else the value of
    the token with the largest logit over the block so far (the sums move to a new centre c' exactly:
    S2 += e (2 S1 + e U), S1 += e U, e = c - c')."""
    sid = tl.program_id(1)
    bi, kvh, r, rmask, head, rows = program_rows(H_KV, H_Q, G, G_BLOCK, N_RB, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    dmask = offs_d < D
    vmask = offs_v < DV

    q = load_rows(Q + bi * stride_qb, head, rmask, stride_qh, stride_qd, D, D_PAD, DOT_F32)
    k_base = K + bi * stride_kb + kvh * stride_kh
    v_base = V + bi * stride_vb + kvh * stride_vh
    p_base = P + bi * stride_pb + kvh * stride_ph

    m = tl.full([R_PAD], float("-inf"), tl.float32)
    l = tl.zeros([R_PAD], tl.float32)
    l_o = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, DV_PAD], tl.float32)
    U = tl.zeros([R_PAD], tl.float32)
    Q2 = tl.zeros([R_PAD], tl.float32)
    S1 = tl.zeros([R_PAD, DV_PAD], tl.float32)
    if PER_COORD:
        S2 = tl.zeros([R_PAD, DV_PAD], tl.float32)
    else:
        S2 = tl.zeros([R_PAD], tl.float32)  # T2
    c = tl.zeros([DV_PAD], tl.float32)  # the centre shared by the query heads of this block
    M = tl.full([], float("-inf"), tl.float32)  # the largest logit of the block so far (its token is c)
    if CERTIFY:
        if HAS_CENTER:
            c = tl.load(C + bi * stride_cb + kvh * stride_ch + offs_v * stride_cd, mask=vmask, other=0.0)
            c = c.to(tl.float32)

    start = sid * CHUNK
    end = tl.minimum(start + CHUNK, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        v, logits, one_minus, present = load_tile(q, k_base, v_base, p_base, offs_n, nmask, offs_d, dmask, offs_v,
                                              vmask, stride_kn, stride_kd, stride_vn, stride_vd, stride_pn,
                                              scale, LOG_PI, DOT_F32)
        m_new, alpha, p, l, l_o, pv, _ = softmax_pv(m, l, l_o, logits, v, ROUND_P, DOT_F32)
        acc = acc * alpha[:, None] + pv
        if CERTIFY:
            a2 = alpha * alpha  # the squared weights rescale by e^{2 dm}
            pp = p * p
            Q2 = Q2 * a2 + tl.sum(pp, axis=1)
            u = one_minus[None, :] * pp
            vf = v.to(tl.float32)
            if not HAS_CENTER:
                c, M, S1, S2 = _follow_centre(logits, rmask, vf, c, M, U, S1, S2, BLOCK_N, PER_COORD)
            U = U * a2 + tl.sum(u, axis=1)
            vc = vf - c[None, :]  # 0 on padded coordinates
            if DOT_F32:
                S1 = tl.dot(u, vc, S1 * a2[:, None], input_precision="ieee")
            else:
                S1 = tl.dot(u, vc, S1 * a2[:, None], input_precision="tf32x3")
            if PER_COORD:
                if DOT_F32:
                    S2 = tl.dot(u, vc * vc, S2 * a2[:, None], input_precision="ieee")
                else:
                    S2 = tl.dot(u, vc * vc, S2 * a2[:, None], input_precision="tf32x3")
            else:
                S2 = S2 * a2 + tl.sum(u * tl.sum(vc * vc, axis=1)[None, :], axis=1)
        m = m_new

    if SPLIT:
        _onepass_store_split(PartS, PartV, sid * BH + rows, rmask, offs_v, m, l, l_o, acc, U, Q2, S1, S2, M, c,
                             R_PAD, DV_PAD, CERTIFY, PER_COORD, ROUND_P)
    else:
        if not ROUND_P:
            l_o = l
        _onepass_finalize(rows, rmask, offs_v, vmask, m, l, l_o, acc, U, S1, S2, Q2, c[None, :],
                          Out, Lse, Var, Tr, Neff, DV, CERTIFY, PER_COORD)


@triton.jit
def _onepass_merge_kernel(
    PartS, PartV, Out, Lse, Var, Tr, Neff, BH, S,
    DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
    CERTIFY: tl.constexpr, PER_COORD: tl.constexpr, ROUND_P: tl.constexpr,
):
    """Merge S split states of the one-pass kernel per row: move each split's sums to the centre of the
    split with the largest logit (S2 += e (2 S1 + e U), S1 += e U, e = c_s - c), rescale by
    e^{m_s - m} (U, S1, S2, Q2 by e^{2 (m_s - m)}) and add, then finalize."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < BH
    offs_v = tl.arange(0, DV_PAD)
    vmask = offs_v < DV
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    l_o = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    U = tl.zeros([BLOCK_R], tl.float32)
    Q2 = tl.zeros([BLOCK_R], tl.float32)
    S1 = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    if PER_COORD:
        S2 = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    else:
        S2 = tl.zeros([BLOCK_R], tl.float32)
    cmask = rmask[:, None] & vmask[None, :]
    c = tl.zeros([BLOCK_R, DV_PAD], tl.float32)
    if CERTIFY:
        # the common centre: that of the split with the largest logit (the first on ties, split 0 if none)
        c = tl.load(PartV + (rows * 4 + 3)[:, None] * DV_PAD + offs_v[None, :], mask=cmask, other=0.0)
        M = tl.load(PartS + rows * 7 + 6, mask=rmask, other=float("-inf"))
        for s in range(1, S):
            base = s * BH + rows
            M_s = tl.load(PartS + base * 7 + 6, mask=rmask, other=float("-inf"))
            c_s = tl.load(PartV + (base * 4 + 3)[:, None] * DV_PAD + offs_v[None, :], mask=cmask, other=0.0)
            c = tl.where((M_s > M)[:, None], c_s, c)
            M = tl.maximum(M, M_s)
    for s in range(S):
        base = s * BH + rows
        m_s = tl.load(PartS + base * 7 + 0, mask=rmask, other=float("-inf"))
        l_s = tl.load(PartS + base * 7 + 1, mask=rmask, other=0.0)
        vptr = PartV + (base * 4)[:, None] * DV_PAD + offs_v[None, :]
        m_new = tl.maximum(m, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        beta = tl.exp(m_s - m_use)
        l = l * alpha + l_s * beta
        if ROUND_P:
            l_o = l_o * alpha + tl.load(PartS + base * 7 + 4, mask=rmask, other=0.0) * beta
        acc = acc * alpha[:, None] + tl.load(vptr, mask=rmask[:, None], other=0.0) * beta[:, None]
        if CERTIFY:
            a2 = alpha * alpha
            b2 = beta * beta
            U_s = tl.load(PartS + base * 7 + 2, mask=rmask, other=0.0)
            S1_s = tl.load(vptr + DV_PAD, mask=cmask, other=0.0)
            e = tl.load(vptr + 3 * DV_PAD, mask=cmask, other=0.0) - c  # the split's centre, moved to c
            if PER_COORD:
                S2_s = tl.load(vptr + 2 * DV_PAD, mask=cmask, other=0.0)
                S2_s = S2_s + e * (2.0 * S1_s + e * U_s[:, None])
                S2 = S2 * a2[:, None] + S2_s * b2[:, None]
            else:
                S2_s = tl.load(PartS + base * 7 + 5, mask=rmask, other=0.0)
                S2_s = S2_s + tl.sum(e * (2.0 * S1_s + e * U_s[:, None]), axis=1)
                S2 = S2 * a2 + S2_s * b2
            S1 = S1 * a2[:, None] + (S1_s + e * U_s[:, None]) * b2[:, None]
            U = U * a2 + U_s * b2
            Q2 = Q2 * a2 + tl.load(PartS + base * 7 + 3, mask=rmask, other=0.0) * b2
        m = m_new
    if not ROUND_P:
        l_o = l
    _onepass_finalize(rows, rmask, offs_v, vmask, m, l, l_o, acc, U, S1, S2, Q2, c,
                      Out, Lse, Var, Tr, Neff, DV, CERTIFY, PER_COORD)


@triton.jit
def _tail_moment_kernel(
    Q, K, V, P, O, Lse, Part, OutLow,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pb, stride_ph, stride_pn,
    H_KV, H_Q, N, CHUNK, BH, scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    G: tl.constexpr, G_BLOCK: tl.constexpr, N_RB: tl.constexpr, R_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, LOG_PI: tl.constexpr, DOT_F32: tl.constexpr, STORE_LOW: tl.constexpr,
):
    """Part[split, row] = sum over the split of (1 - pi_i) x_i^2, x_i = (1 - pi_i) a_i^2 ||v_i - o_hat||^2,
    a_i = exp(s_i - log pi_i - lse): the first pass's o_hat (float32) and lse, recomputed scores.
    STORE_LOW: split 0 also writes o_hat cast to OutLow's dtype (the cast the first pass would do)."""
    sid = tl.program_id(1)
    bi, kvh, r, rmask, head, rows = program_rows(H_KV, H_Q, G, G_BLOCK, N_RB, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    dmask = offs_d < D
    vmask = offs_v < DV

    q = load_rows(Q + bi * stride_qb, head, rmask, stride_qh, stride_qd, D, D_PAD, DOT_F32)
    omask = rmask[:, None] & vmask[None, :]
    o = tl.load(O + rows[:, None] * DV + offs_v[None, :], mask=omask, other=0.0)
    if STORE_LOW:
        if sid == 0:
            tl.store(OutLow + rows[:, None] * DV + offs_v[None, :], o.to(OutLow.dtype.element_ty), mask=omask)
    lse = tl.load(Lse + rows, mask=rmask, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), 0.0, lse)  # empty rows: every a_i is 0 anyway (set to +inf later)
    s2 = tl.zeros([R_PAD], tl.float32)

    k_base = K + bi * stride_kb + kvh * stride_kh
    v_base = V + bi * stride_vb + kvh * stride_vh
    p_base = P + bi * stride_pb + kvh * stride_ph
    start = sid * CHUNK
    end = tl.minimum(start + CHUNK, N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        v, logits, one_minus, _ = load_tile(q, k_base, v_base, p_base, offs_n, nmask, offs_d, dmask, offs_v,
                                        vmask, stride_kn, stride_kd, stride_vn, stride_vd, stride_pn,
                                        scale, LOG_PI, DOT_F32)
        a = tl.exp(logits - lse[:, None])  # the normalized weights; 0 on padding
        # ||v_i - o_hat||^2 row by row, from the differences (no ||v||^2 - 2 v.o + ||o||^2 cancellation)
        vf = v.to(tl.float32)
        r2 = tl.zeros([R_PAD, BLOCK_N], tl.float32)
        for j in tl.static_range(G_BLOCK):
            sel = r == j
            oj = tl.sum(tl.where(sel[:, None], o, 0.0), axis=0)
            dj = tl.where(vmask[None, :], vf - oj[None, :], 0.0)
            r2 = tl.where(sel[:, None], tl.sum(dj * dj, axis=1)[None, :], r2)
        x = one_minus[None, :] * (a * a) * r2
        s2 += tl.sum(one_minus[None, :] * (x * x), axis=1)
    tl.store(Part + sid * BH + rows, s2, mask=rmask)


#: True when the kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import):
#: they then run on CPU tensors, and not on CUDA ones at full speed
INTERPRETED = type(_hajek_decode_kernel).__name__ == "InterpretedFunction"


def _interpreting() -> bool:
    return INTERPRETED


def pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_moments(dtype: torch.dtype) -> str:
    """Moment mode of ``moments="auto"``: "exact" for every input dtype.

    "exact" computes each tile's weighted mean and centred second moment per query head in
    registers (two passes over the tile held in registers, no cancellation) and merges tiles by
    Chan's formula. "shifted" gets each tile's moments from two tensor-core products (tf32x3)
    against v - mu, mu the tile's mean kept value: M2 = S2 - S1^2 / W, whose cancellation leaves
    an absolute floor of about 10 eps32 sum_i c_i range(v)^2 on the variance. "onepass" keeps the
    sums U, S1, S2 (or the trace's T2) around one centre shared by the query heads of a program,
    rescaled like the softmax sum: no per-head loop, no division in the token loop, two tensor-core
    products per tile. Its rounding floor is gamma sum_i c_i (|v_i - c| + |o_hat - c|)^2, with the
    centre c the value of the largest logit so far: within the "exact" mode's error allowance
    except where the query heads of one KV head are dominated by different tokens with pi < 1
    (the centre can follow only one), where the variance of a dominated head, far below that floor,
    is off by up to the floor. "exact" stays the default until GPU timings weigh that against the
    speed (benchmarks/gpu_check.py times every mode).
    """
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    return "exact"


def num_splits_heuristic(programs: int, n: int, block_n: int, sms: int, *, ctas_per_sm: int = 1,
                         min_tokens: int = _MIN_TOKENS_PER_SPLIT, min_tiles: int = _MIN_TILES_PER_SPLIT,
                         max_splits: int = _MAX_SPLITS, threshold: float = _WAVE_EFFICIENCY) -> int:
    r"""Split count of a split-K decode launch: the fewest splits whose wave efficiency is within
    ``threshold`` of the best (FlashAttention-3's ``num_splits_heuristic``).

    A launch of :math:`P` programs per split over a GPU that runs :math:`C` = ``sms * ctas_per_sm``
    programs at once takes :math:`\lceil P s / C\rceil` waves with :math:`s` splits, of which

    .. math:: e(s) = \frac{P s}{\lceil P s / C \rceil \, C}

    is busy (the wave efficiency). Among :math:`s = 1 .. s_{max}`,

    .. math:: s_{max} = \max\bigl(1, \min(\text{max\_splits},\ C,\ \lfloor n / \text{min\_tokens} \rfloor,
              \ \lfloor \lceil n / \text{block\_n} \rceil / \text{min\_tiles} \rfloor)\bigr),

    it returns the smallest :math:`s` with :math:`e(s) \ge` ``threshold`` :math:`\max_{s'} e(s')`: each
    extra split costs one more state store and merge input, so a split is added only while it buys
    efficiency. A launch that already fills its waves (:math:`P` a multiple of :math:`C`, or more
    than :math:`6 C` programs: :math:`e(1) > 6/7`) gets one split; a short sequence (fewer than
    ``2 min_tokens`` tokens, or ``2 min_tiles`` tiles) is never split; a launch that stays within
    one wave (:math:`P s_{max} \le C`, where :math:`e` grows with :math:`s`) takes the least
    :math:`s \ge` ``threshold`` :math:`s_{max}`.

    Parameters
    ----------
    programs : int >= 0
        Programs of one split: (batch row or sequence, KV head, block of query heads).
    n : int >= 0
        Tokens each program streams (the longest sequence; for the paged kernels the units times the
        tokens per unit).
    block_n : int >= 1
        Tokens per tile (a paged kernel's unit).
    sms : int >= 1
        Streaming multiprocessors of the GPU (``torch.cuda.get_device_properties(dev).multi_processor_count``:
        132 on an H100 SXM or an H200).
    ctas_per_sm : int >= 1, default 1
        Programs resident per SM (registers and shared memory allowing; 1 for the default tiles of the
        certified kernels, whose register counts exceed half the register file).
    min_tokens, min_tiles : int >= 1
        Least tokens and tiles per split (1024 and 4).
    max_splits : int >= 1
        Cap on the split count (128, FlashAttention-3's).
    threshold : float in (0, 1]
        Fraction of the best efficiency that suffices (0.85).

    Returns
    -------
    int >= 1

    Examples
    --------
    >>> num_splits_heuristic(8, 65536, 64, 132)       # b = 1, h_kv = 8: 15 splits fill 120 of 132 SMs
    15
    >>> num_splits_heuristic(256, 65536, 64, 132)     # b = 32: 256 of 264 slots busy with one split
    1

    References
    ----------
    Shah et al. (2024), "FlashAttention-3" (``hopper/heuristics.h``, ``num_splits_heuristic``);
    Dao et al. (2023), flash-decoding.
    """
    for name, x, low in (("programs", programs, 0), ("n", n, 0), ("block_n", block_n, 1), ("sms", sms, 1),
                         ("ctas_per_sm", ctas_per_sm, 1), ("min_tokens", min_tokens, 1),
                         ("min_tiles", min_tiles, 1), ("max_splits", max_splits, 1)):
        if isinstance(x, bool) or not isinstance(x, int) or x < low:
            raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold!r}")
    if programs == 0 or n == 0:
        return 1
    slots = sms * ctas_per_sm
    n_tiles = math.ceil(n / block_n)
    s_max = max(1, min(max_splits, slots, n // min_tokens, n_tiles // min_tiles))
    eff = [programs * s / (math.ceil(programs * s / slots) * slots) for s in range(1, s_max + 1)]
    best = max(eff)
    return next(s for s, e in enumerate(eff, 1) if e >= threshold * best)


def _device_sms(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device; None elsewhere (the CPU interpreter: one split)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(n: int, d: int, programs: int, device: torch.device, block_n: int | None = None,
                   dtype: torch.dtype = torch.bfloat16, moments: str | None = None, *,
                   sms: int | None = None) -> dict:
    """Block size, warps, stages and split count the wrapper uses when none are given.

    ``block_n`` = 64 tokens per tile for float16/bfloat16 with head dimension <= 128, 32 for
    float32 inputs or larger heads; 8 warps. With ``moments="onepass"`` half those (32 and 16).
    These are the largest tiles that compiled for sm_90 without register spills (ptxas, d = 128,
    g = 4); GPU timings may move them.
    ``num_splits`` is :func:`num_splits_heuristic` of the ``programs`` (batch, KV head, query block)
    programs over n tokens on the device's ``sms`` streaming multiprocessors (default: the CUDA
    device's count), one program per SM; 1 without a CUDA device (the CPU interpreter).
    """
    if block_n is None:
        block_n = 64 if (d <= 128 and dtype != torch.float32) else 32
        if moments == "onepass":
            block_n //= 2
    if sms is None:
        sms = _device_sms(device)
    num_splits = 1 if sms is None else num_splits_heuristic(max(int(programs), 0), max(int(n), 0), block_n, int(sms))
    return {"block_n": block_n, "num_splits": num_splits, "num_warps": 8, "num_stages": 2}


def check_decode_q(q, fallback: str = "kvcert.fast") -> None:
    """A decode query, (b, h_q, d) or (b, h_q, 1, d) (the kernels are decode kernels)."""
    if isinstance(q, torch.Tensor) and not (q.dim() == 3 or (q.dim() == 4 and q.shape[2] == 1)):
        raise ValueError(f"the Triton kernel is a decode kernel: q must have shape (b, h_q, d) or "
                         f"(b, h_q, 1, d), got shape {tuple(q.shape)} (use {fallback} for t > 1)")


def check_dtypes(**named) -> None:
    """Every named tensor in SUPPORTED_DTYPES, all in one dtype (arguments that are not tensors are left
    to the shape checks)."""
    xs = [(name, x) for name, x in named.items() if isinstance(x, torch.Tensor)]
    for name, x in xs:
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must have dtype float16, bfloat16 or float32, got {x.dtype}")
    if len({x.dtype for _, x in xs}) > 1:
        names = [name for name, _ in xs]
        raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must share one dtype, got "
                        f"{', '.join(str(x.dtype) for _, x in xs)}")


def _check_center(value_center, layout: AttentionLayout, keys, validate: bool) -> torch.Tensor:
    """A ``value_center`` of shape (b, h_kv, dv), floating point, on the cache's device, as float32
    (finite when ``validate``)."""
    if not isinstance(value_center, torch.Tensor):
        raise TypeError(f"value_center must be a torch.Tensor, got {type(value_center).__name__}")
    want = (layout.b, layout.h_kv, layout.dv)
    if tuple(value_center.shape) != want:
        raise ValueError(f"value_center must have shape (b, h_kv, dv) = {want}, got {tuple(value_center.shape)}")
    if not value_center.is_floating_point():
        raise TypeError(f"value_center must be floating-point, got {value_center.dtype}")
    if value_center.device != keys.device:
        raise ValueError(f"value_center is on {value_center.device}, the cache on {keys.device}")
    value_center = value_center.to(torch.float32)
    if validate and not bool(torch.isfinite(value_center).all()):
        raise ValueError("value_center must be finite (found NaN or inf)")
    return value_center


def _check_inputs(q, keys, values, pi, log_pi, scale, validate) -> AttentionLayout:
    """The shared contract (kvcert.fast.contract) and what only this kernel adds: a decode q,
    one input dtype among SUPPORTED_DTYPES, and (``validate``) a finite q."""
    check_decode_q(q)
    layout = check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale, validate=validate)
    check_dtypes(q=q, keys=keys, values=values)
    if validate and not bool(torch.isfinite(q).all()):
        raise ValueError("q must be finite (found NaN or inf)")
    return layout


def _check_moments(moments, value_center, layout: AttentionLayout, keys, values, validate: bool):
    """``moments`` resolved ("auto": :func:`default_moments`) and checked, and ``value_center`` checked
    (:func:`_check_center`; refused with any mode but "onepass")."""
    if moments == "auto":
        moments = default_moments(values.dtype)
    if moments not in MOMENTS:
        raise ValueError(f"moments must be 'auto', 'onepass', 'exact' or 'shifted', got {moments!r}")
    if value_center is not None:
        if moments != "onepass":
            raise ValueError(f"value_center is the centre of moments='onepass', not of moments={moments!r}")
        value_center = _check_center(value_center, layout, keys, validate)
    return moments, value_center


@dataclass
class _DecodePlan:
    """One call of :func:`hajek_attention` laid out for its kernels (:func:`_decode_plan`): the grid
    (``programs`` x ``splits``), the probabilities as the kernels read them, the arguments every kernel takes
    alike, and the outputs and split partials."""

    programs: int
    splits: int
    p: torch.Tensor
    strides: tuple  # of q (3), keys (4), values (4) and p (3)
    sizes: tuple  # h_kv, h_q, n, chunk, bh = b * h_q, scale
    meta: dict  # the shape constexprs, BLOCK_N, LOG_PI and DOT_F32
    launch: dict
    round_p: bool
    out: torch.Tensor
    lse: torch.Tensor
    var: torch.Tensor | None
    trace: torch.Tensor | None
    neff: torch.Tensor | None
    part_s: torch.Tensor
    part_v: torch.Tensor

    @property
    def split(self) -> bool:
        return self.splits > 1

    @property
    def bh(self) -> int:
        return self.sizes[4]

    def outputs(self) -> tuple:
        """The kernels' output arguments: out, lse, var, trace, n_eff (lse stands in for the absent ones) and
        the split partials."""
        dummy = self.lse  # placeholder pointer for outputs a constexpr branch never touches
        return (self.out, self.lse, self.var if self.var is not None else dummy,
                self.trace if self.trace is not None else dummy, self.neff if self.neff is not None else dummy,
                self.part_s, self.part_v)


def _split_plan(n, d, programs, device, dtype, moments, block_n, num_splits, num_warps, num_stages):
    """The launch configuration (:func:`default_config`, overridden by the arguments given), the tokens per
    split (whole tiles) and the split count, recomputed so that no split is empty."""
    if block_n is not None and (not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    cfg = default_config(n, d, programs, device, block_n, dtype, moments)
    if num_splits is not None:
        if not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        cfg["num_splits"] = num_splits
    if num_warps is not None:
        cfg["num_warps"] = int(num_warps)
    if num_stages is not None:
        cfg["num_stages"] = int(num_stages)
    bn = cfg["block_n"]
    # chunk = whole tiles; recompute the split count so that no split is empty
    chunk = max(bn, math.ceil(math.ceil(max(n, 1) / cfg["num_splits"]) / bn) * bn)
    return cfg, chunk, max(1, math.ceil(n / chunk))


def _decode_plan(layout: AttentionLayout, q, keys, values, moments, block_n, num_splits, num_warps, num_stages, *,
                 certify, per_coordinate, return_tail_moment) -> _DecodePlan:
    """The probabilities the kernels read (float64 ones as float32 log pi), the query heads packed per program,
    the split-K plan (:func:`_split_plan`), the outputs and the split partials of one call."""
    b, h_q, h_kv, g, n, d, dv = layout.b, layout.h_q, layout.h_kv, layout.g, layout.n, layout.d, layout.dv
    use_log = layout.p_name == "log_pi"
    p = layout.p
    if p.dtype == torch.float64:
        # float64 probabilities below float32's range would round to 0 (padding): pass log pi
        p = (p if use_log else torch.log(p)).to(torch.float32)
        use_log = True
    g_block = min(g, MAX_ROWS)
    n_rb = math.ceil(g / g_block)
    r_pad = max(16, pow2(g_block))
    programs = b * h_kv * n_rb
    cfg, chunk, splits = _split_plan(n, d, programs, q.device, values.dtype, moments, block_n, num_splits,
                                     num_warps, num_stages)
    dev = q.device
    # the tail pass needs o_hat unrounded: then the first pass stores it in float32 and the tail
    # kernel writes the input-dtype output
    out = torch.empty((b, h_q, dv), device=dev, dtype=torch.float32 if return_tail_moment else values.dtype)
    lse = torch.empty((b, h_q), device=dev, dtype=torch.float32)
    var = torch.empty((b, h_q, dv), device=dev, dtype=torch.float32) if certify and per_coordinate else None
    trace = torch.empty((b, h_q), device=dev, dtype=torch.float32) if certify else None
    neff = torch.empty((b, h_q), device=dev, dtype=torch.float32) if certify else None
    dv_pad = max(16, pow2(dv))
    bh = b * h_q
    if splits > 1:
        # one-pass state: (m, l, U, Q2, l_o, T2, M) and (acc, S1, S2, c); else (m, l, W, Q2, l_o), (acc, mean, M2)
        onepass = moments == "onepass"
        part_s = torch.empty((splits, bh, 7 if onepass else 5), device=dev, dtype=torch.float32)
        part_v = torch.empty((splits, bh, 4 if onepass else 3, dv_pad), device=dev, dtype=torch.float32)
    else:
        part_s = part_v = lse
    meta = dict(D=d, DV=dv, D_PAD=max(16, pow2(d)), DV_PAD=dv_pad, G=g, G_BLOCK=g_block, N_RB=n_rb, R_PAD=r_pad,
                BLOCK_N=cfg["block_n"], LOG_PI=use_log, DOT_F32=values.dtype == torch.float32 or _interpreting())
    launch = {} if _interpreting() else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    strides = (q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3),
               values.stride(0), values.stride(1), values.stride(2), values.stride(3), p.stride(0), p.stride(1),
               p.stride(2))
    return _DecodePlan(programs=programs, splits=splits, p=p, strides=strides,
                       sizes=(h_kv, h_q, n, chunk, bh, layout.scale), meta=meta, launch=launch,
                       round_p=values.dtype != torch.float32, out=out, lse=lse, var=var, trace=trace, neff=neff,
                       part_s=part_s, part_v=part_v)


def _merge_splits(kernel, P: _DecodePlan, certify) -> None:
    """The split-K merge of the plan's partials into its outputs (``kernel``: :func:`hajek_merge_kernel`, or
    :func:`_onepass_merge_kernel` for the one-pass state)."""
    block_r = 16
    kernel[(math.ceil(P.bh / block_r),)](
        P.part_s, P.part_v, *P.outputs()[:5], P.bh, P.splits,
        DV=P.meta["DV"], DV_PAD=P.meta["DV_PAD"], BLOCK_R=block_r, CERTIFY=bool(certify), PER_COORD=P.var is not None,
        ROUND_P=P.round_p,
        **({} if _interpreting() else {"num_warps": 4}),
    )


def _launch_onepass(P: _DecodePlan, q, keys, values, value_center, certify) -> None:
    """``moments="onepass"``: the one-pass kernel over the plan's grid, then its merge when the sequence is split."""
    center = value_center if value_center is not None else P.lse
    c_strides = (center.stride(0), center.stride(1), center.stride(2)) if value_center is not None else (0, 0, 0)
    _hajek_onepass_kernel[(P.programs, P.splits)](
        q, keys, values, P.p, center, *P.outputs(), *P.strides, *c_strides, *P.sizes, **P.meta,
        CERTIFY=bool(certify), PER_COORD=P.var is not None, SPLIT=P.split, ROUND_P=P.round_p,
        HAS_CENTER=value_center is not None, **P.launch,
    )
    if P.split:
        _merge_splits(_onepass_merge_kernel, P, certify)


def _launch_two_pass(P: _DecodePlan, q, keys, values, moments, certify) -> None:
    """``moments="exact"`` or ``"shifted"``: the decode kernel over the plan's grid, then the merge when the
    sequence is split."""
    _hajek_decode_kernel[(P.programs, P.splits)](
        q, keys, values, P.p, *P.outputs(), *P.strides, *P.sizes, **P.meta,
        CERTIFY=bool(certify), PER_COORD=P.var is not None, SPLIT=P.split, ROUND_P=P.round_p,
        EXACT_MOMENTS=moments == "exact", **P.launch,
    )
    if P.split:
        _merge_splits(hajek_merge_kernel, P, certify)


def _tail_moment(P: _DecodePlan, q, keys, values):
    """``return_tail_moment``: the epilogue pass's s2 (b, h_q), summed over the splits and +inf on empty heads,
    and the output in the input dtype (the first pass left o_hat in float32 for it)."""
    b, h_q, dv = P.out.shape
    dev = P.out.device
    low = values.dtype != torch.float32
    out_low = torch.empty((b, h_q, dv), device=dev, dtype=values.dtype) if low else P.out
    if P.programs > 0:
        part = torch.empty((P.splits, P.bh), device=dev, dtype=torch.float32)
        _tail_moment_kernel[(P.programs, P.splits)](
            q, keys, values, P.p, P.out, P.lse, part, out_low, *P.strides, *P.sizes, **P.meta, STORE_LOW=low,
            **P.launch,
        )
        tail = part.sum(0).view(b, h_q) if P.splits > 1 else part.view(b, h_q)
        tail = tail.masked_fill(torch.isneginf(P.lse), float("inf"))  # empty heads: +inf
    else:
        tail = torch.full((b, h_q), float("inf"), device=dev, dtype=torch.float32)
    return out_low, tail


def hajek_attention(q, keys, values, pi=None, *, log_pi=None, scale=None, per_coordinate=True,
                    block_n=None, num_splits=None, num_warps=None, num_stages=None,
                    certify=True, validate=True, moments="auto", value_center=None,
                    return_tail_moment=False) -> Estimate:
    r"""Fused Triton decode kernel for the Hajek estimate and its variance (one pass over K/V).

    .. math::

        \ell_i = \tau\, q\cdot k_i - \log\pi_i, \qquad
        a_i = e^{\ell_i - m} / l, \quad l = \sum_{i\in S} e^{\ell_i - m}, \qquad
        \hat o = \sum_{i\in S} a_i v_i, \qquad \log\hat Z = m + \log l,

        \hat\sigma^2_j = \sum_{i\in S} (1-\pi_i) a_i^2 (v_{ij} - \hat o_j)^2
                       = \frac{M_{2,j} + W (\bar v_j - \hat o_j)^2}{l^2},

    with :math:`w_i = (1-\pi_i) e^{2(\ell_i - m)}`, :math:`W = \sum w_i`,
    :math:`\bar v = \sum w_i v_i / W` and :math:`M_2 = \sum w_i (v_i - \bar v)^2`
    accumulated in one pass (per tile exactly, across tiles and splits by
    Chan's pairwise update
    :math:`M_2 = M_{2,a} + M_{2,b} + \delta^2 W_a W_b / (W_a + W_b)`,
    :math:`\delta = \bar v_b - \bar v_a`, after rescaling each side's ``W`` and
    ``M2`` by :math:`e^{2(m_{side} - m)}`). Also
    :math:`n_\mathrm{eff} = 1/\sum a_i^2 = l^2 / \sum e^{2(\ell_i - m)}`.

    With ``moments="onepass"`` the pass keeps, around a centre :math:`c` shared
    by the query heads of a KV head, the sums

    .. math::

        U = \sum_{i\in S} w_i, \quad S_1 = \sum_{i\in S} w_i (v_i - c), \quad
        S_2 = \sum_{i\in S} w_i (v_i - c)^2
        \quad \Bigl(T_2 = \sum_{i\in S} w_i \lVert v_i - c\rVert^2 \text{ for the trace alone}\Bigr),

        \hat\sigma^2 = \frac{S_2 - 2\,\delta S_1 + \delta^2 U}{l^2}, \qquad \delta = \hat o - c,

    each rescaled by :math:`e^{2(m_{old} - m)}` when the running max moves and
    merged across splits like the softmax sum (no division, no per-head loop).
    :math:`c` is ``value_center`` when given, else the value of the token with
    the largest logit so far over the query heads of the program (those of one
    KV head, up to 16 of them); when it moves by
    :math:`e` the sums follow exactly (:math:`S_2 \mathrel{+}= e(2 S_1 + e U)`,
    :math:`S_1 \mathrel{+}= e U`), and splits move to the centre of the split
    with the largest logit.

    With ``return_tail_moment=True`` a second kernel (an epilogue pass over the
    kept K/V, split like the first) computes

    .. math::

        s_2 = \sum_{i\in S} (1-\pi_i)\, x_i^2, \qquad
        x_i = (1-\pi_i)\, a_i^2 \lVert v_i - \hat o\rVert^2, \qquad
        a_i = e^{\ell_i - \log\hat Z},

    from the first pass's float32 :math:`\hat o` and :math:`\log\hat Z`
    (scores recomputed, distances formed from the differences
    :math:`v_i - \hat o`, float32 accumulation; splits summed in torch).

    Parameters
    ----------
    q : torch.Tensor, (b, h_q, d) or (b, h_q, 1, d)
        float16, bfloat16 or float32; the dtype of ``keys`` and ``values``.
    keys : torch.Tensor, (b, h_kv, n, d)
    values : torch.Tensor, (b, h_kv, n, dv)
        The compressed cache, padded with pi = 0 slots; h_q = g * h_kv (GQA:
        query head h reads KV head h // g). Any strides.
    pi : torch.Tensor, (b, h_kv, n), optional
        Inclusion probabilities in [0, 1], 0 on padding.
    log_pi : torch.Tensor, (b, h_kv, n), optional
        log pi instead (-inf on padding); 1 - pi is then computed as
        -expm1(log pi). Give exactly one of ``pi`` and ``log_pi``.
    scale : float, default 1/sqrt(d)
        Finite and positive (every backend refuses a negative scale).
    per_coordinate : bool, default True
        Return the (b, h_q, dv) variance; if False only ``trace`` (the same
        pass computes both, only the store is skipped).
    block_n : int, optional
        Tokens per tile (power of two >= 16); default from :func:`default_config`.
    num_splits : int, optional
        Split-K: the sequence is cut into this many chunks streamed by
        separate programs and merged by a second kernel. Default from
        :func:`default_config` (:func:`num_splits_heuristic`: the fewest
        splits within 85% of the best wave efficiency, >= 1024 tokens per
        split; 1 on the CPU interpreter).
    num_warps, num_stages : int, optional
        Triton launch parameters (ignored by the interpreter).
    certify : bool, default True
        False skips the variance state (a benchmarking baseline): the
        Estimate then has ``variance``, ``trace`` and ``n_eff`` None.
    moments : {"auto", "onepass", "exact", "shifted"}, default "auto"
        How the variance's moments are formed (see :func:`default_moments`;
        "auto" = "exact"): "exact" and "shifted" form each tile's weighted mean
        and second moment and merge them by Chan's update; "onepass" keeps the
        centred sums above (the trace alone without a per-coordinate second
        moment when ``per_coordinate=False``).
    value_center : torch.Tensor, (b, h_kv, dv), optional
        The centre :math:`c` of ``moments="onepass"`` (any floating dtype, used
        in float32), e.g. a running mean of the kept values; by default the
        value of the largest logit. Its rounding floor grows with
        :math:`\sum_i c_i (|v_i - c| + |\hat o - c|)^2`, so a centre far from
        the values (0 under a large common offset) loses accuracy. Refused
        with the other modes.
    validate : bool, default True
        Check that pi lies in [0, 1] (log_pi in [-inf, 0]) and q is finite.
        These checks synchronise with the device; pass False in timed or
        graph-captured loops. K and V are never scanned (a NaN there shows
        up as NaN in the output).
    return_tail_moment : bool, default False
        Fill ``Estimate.tail_moment`` (b, h_q) float32 for the
        ``chebyshev_ucb`` certificate: one more pass over K/V (the
        epilogue kernel), no extra cache memory; +inf on empty heads.

    Returns
    -------
    kvcert.fast.types.Estimate
        ``output`` (b, h_q, dv) in the input dtype; ``lse``, ``trace``,
        ``n_eff`` (b, h_q) float32; ``variance`` (b, h_q, dv) float32 or None;
        ``weights`` None (never materialized) and ``max_term`` None: it needs
        o_hat before the pass, so the ``bernstein`` certificate recomputes it
        with kvcert.fast on demand. ``tail_moment`` (b, h_q) float32 or None.
        With a 4-D q of t = 1 the leading dimensions are (b, h_q, 1).

    Notes
    -----
    - Padding (pi = 0, log pi = -inf) gets logit -inf, never -log 0 = +inf.
    - pi = 1 tokens contribute to the output but not to the variance.
    - Empty heads (all padding, or n = 0): output 0, lse -inf, variance and
      trace +inf, n_eff 0; never NaN.
    - With ``moments="onepass"`` a rounded-negative variance is clamped at 0;
      on a GPU its two products per tile run in tf32x3 for half inputs
      (float32 inputs: IEEE float32).
    - float32 accumulation throughout; for float16/bfloat16 the probabilities
      are rounded to the input dtype before the P V product (as in flash
      attention) and the output is normalized by the sum of the rounded
      probabilities (so it stays a weighted mean of the values, with no
      2^-9 |v| shrinkage that a large value offset would turn into variance
      error); lse, n_eff and the variance moments use the float32 weights.
    - Weights below about 1e-19 of the largest square to 0 in float32; their
      variance contribution is below float32 resolution of the total unless
      every tail token is that small, in which case the variance is ~0 too.
      Likewise a term of ``tail_moment`` below float32's smallest normal
      (1.2e-38) may flush to 0: its absolute error is at most n times that.

    References
    ----------
    Chan, Golub & LeVeque (1979), "Updating formulae and a pairwise algorithm
    for computing sample variances"; Dao et al. (2023), flash-decoding;
    Sarndal, Swensson & Wretman (1992), sec. 5.6-5.7; arXiv 2607.21475.
    """
    layout = _check_inputs(q, keys, values, pi, log_pi, scale, validate)
    moments, value_center = _check_moments(moments, value_center, layout, keys, values, validate)
    if not INTERPRETED and not q.is_cuda:
        raise ValueError(f"q, keys, values are on {q.device}: the Triton kernel needs CUDA tensors, or "
                         "TRITON_INTERPRET=1 set before kvcert.kernels is imported (CPU interpreter)")
    squeeze_t = q.dim() == 4
    if squeeze_t:
        q = q[:, :, 0]
    P = _decode_plan(layout, q, keys, values, moments, block_n, num_splits, num_warps, num_stages, certify=certify,
                     per_coordinate=per_coordinate, return_tail_moment=return_tail_moment)
    if P.programs > 0 and moments == "onepass":
        _launch_onepass(P, q, keys, values, value_center, certify)
    elif P.programs > 0:
        _launch_two_pass(P, q, keys, values, moments, certify)
    out, tail = P.out, None
    if return_tail_moment:
        out, tail = _tail_moment(P, q, keys, values)
    est = Estimate(output=out, weights=None, variance=P.var, trace=P.trace, lse=P.lse, n_eff=P.neff, max_term=None,
                   tail_moment=tail)
    if squeeze_t:
        est = Estimate(**{f: (x.unsqueeze(2) if x is not None else None) for f, x in vars(est).items()})
    return est
