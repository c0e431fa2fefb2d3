r"""The cluster design's decode step in Triton: one pass over the kept K and V.

The kept pass of :func:`kvcert.fast.sketch_hajek_attention` fused into one kernel:
one program per (batch row, KV head) streams the kept tokens once, with every query
head of the GQA group as a row, and keeps an online softmax of
:math:`\ell_i = \tau q\cdot k_i - \log\pi_i` (running max ``m``, normalizer ``l``)
beside nine rescaled accumulators:

.. math::

    p_i = e^{\ell_i - m},\quad w_i = (1-\pi_i)\, p_i^2,\quad w'_i = \pi_i w_i,\qquad
    A = \textstyle\sum p_i v_i,\ \ C = \sum w_i v_i,\ \ C' = \sum w'_i v_i,

    \textstyle\sum w_i,\ \sum w'_i,\ \sum w_i r_i,\ \sum w'_i r_i,\ \sum \pi_i p_i
    \quad (r_i = \lVert v_i - \mu\rVert^2),

first-order sums rescaled by :math:`e^{m - m'}` when the max moves, second-order ones
by :math:`e^{2(m - m')}`. At the end :math:`\hat o = A/l`, :math:`\sum c_i v_i = C/l^2`
(:math:`c_i = (1-\pi_i) a_i^2`, :math:`a_i = p_i/l`), ..., :math:`\kappa = \sum\pi_i a_i`,
:math:`\log\hat Z = m + \log l`: exactly the pieces ``kvcert.fast.sketch._kept_pass``
returns, and the same O(C d) epilogue (the centred kept sums, the sketch's evicted part,
V_cl and its radius) turns them into the :class:`kvcert.fast.ClusterEstimate`. Products
in float32 (``input_precision="ieee"``) for every input dtype; no split of the sequence
(one program per KV head). Importing this module imports Triton; without a GPU set
``TRITON_INTERPRET=1`` first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcert.fast.sketch import ClusterEstimate, sketch_step

from .hajek import check_decode_q, check_dtypes, neg_expm1, online_step, pow2

__all__ = ["sketch_hajek_attention"]


@triton.jit
def _sketch_kept_kernel(
    Q, K, V, LP, R2, O, CV, T, SC, KAP, LSE,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H_KV, N, scale,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    G: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One (batch row, KV head): the online softmax and the nine accumulators of the module docstring."""
    pid = tl.program_id(0).to(tl.int64)  # the flattened (b, h_kv) head, B index of the outputs
    kvh = pid % H_KV
    bi = pid // H_KV
    r = tl.arange(0, R_PAD)
    rmask = r < G
    head = kvh * G + r
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    dmask = offs_d < D
    vmask = offs_v < DV
    q = tl.load(Q + bi * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)

    m = tl.full([R_PAD], float("-inf"), tl.float32)
    l = tl.zeros([R_PAD], tl.float32)
    acc_a = tl.zeros([R_PAD, DV_PAD], tl.float32)
    acc_c = tl.zeros([R_PAD, DV_PAD], tl.float32)
    acc_p = tl.zeros([R_PAD, DV_PAD], tl.float32)
    sc_c = tl.zeros([R_PAD], tl.float32)
    sc_p = tl.zeros([R_PAD], tl.float32)
    t_c = tl.zeros([R_PAD], tl.float32)
    t_p = tl.zeros([R_PAD], tl.float32)
    kap = tl.zeros([R_PAD], tl.float32)

    k_base = K + bi * stride_kb + kvh * stride_kh
    v_base = V + bi * stride_vb + kvh * stride_vh
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < N
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                    mask=nmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_v[None, :] * stride_vd,
                    mask=nmask[:, None] & vmask[None, :], other=0.0).to(tl.float32)
        lp = tl.load(LP + pid * N + offs_n, mask=nmask, other=float("-inf"))
        r2 = tl.load(R2 + pid * N + offs_n, mask=nmask, other=0.0)
        present = lp > float("-inf")
        lp0 = tl.where(present, lp, 0.0)
        pi = tl.where(present, tl.exp(lp0), 0.0)
        om = tl.where(present, neg_expm1(lp0), 0.0)  # 1 - pi without cancellation near pi = 1
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
        logits = tl.where(present[None, :], s * scale - lp0[None, :], float("-inf"))
        m_new, alpha, p = online_step(m, logits)
        a2 = alpha * alpha
        l = l * alpha + tl.sum(p, axis=1)
        kap = kap * alpha + tl.sum(p * pi[None, :], axis=1)
        w = om[None, :] * p * p
        wp = w * pi[None, :]
        acc_a = acc_a * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        acc_c = acc_c * a2[:, None] + tl.dot(w, v, input_precision="ieee")
        acc_p = acc_p * a2[:, None] + tl.dot(wp, v, input_precision="ieee")
        sc_c = sc_c * a2 + tl.sum(w, axis=1)
        sc_p = sc_p * a2 + tl.sum(wp, axis=1)
        t_c = t_c * a2 + tl.sum(w * r2[None, :], axis=1)
        t_p = t_p * a2 + tl.sum(wp * r2[None, :], axis=1)
        m = m_new

    # an empty row (every slot padding): o = 0, every sum 0, lse = -inf (the torch pass's convention)
    empty = l == 0.0
    ls = tl.where(empty, 1.0, l)
    l2 = ls * ls
    omask = rmask[:, None] & vmask[None, :]
    row = pid * G + r                      # (B, G) rows
    tl.store(O + row[:, None] * DV + offs_v[None, :], acc_a / ls[:, None], mask=omask)
    crow = pid * 2 * G + r                 # (B, 2G) rows: the c rows, then the c' rows at + G
    tl.store(CV + crow[:, None] * DV + offs_v[None, :], acc_c / l2[:, None], mask=omask)
    tl.store(CV + (crow + G)[:, None] * DV + offs_v[None, :], acc_p / l2[:, None], mask=omask)
    tl.store(T + crow, t_c / l2, mask=rmask)
    tl.store(T + crow + G, t_p / l2, mask=rmask)
    tl.store(SC + crow, sc_c / l2, mask=rmask)
    tl.store(SC + crow + G, sc_p / l2, mask=rmask)
    tl.store(KAP + row, kap / ls, mask=rmask)
    tl.store(LSE + row, tl.where(empty, float("-inf"), m + tl.log(ls)), mask=rmask)


def _kernel_pass(block_n: int | None):
    """The kept pass of ``kvcert.fast.sketch.sketch_step`` run by :func:`_sketch_kept_kernel`."""

    def kept_pass(L, lp, omp, pf, mu, r2):
        dev, f32 = L.q.device, torch.float32
        B, G, n, dv = L.B, L.G, L.n, L.dv
        q = L.q if L.q.dim() == 3 else L.q[:, :, 0]
        lp32 = lp.to(f32).contiguous()
        r232 = r2.to(f32).contiguous()
        o = torch.empty(B, G, dv, dtype=f32, device=dev)
        cv = torch.empty(B, 2 * G, dv, dtype=f32, device=dev)
        t = torch.empty(B, 2 * G, dtype=f32, device=dev)
        sc = torch.empty(B, 2 * G, dtype=f32, device=dev)
        kappa = torch.empty(B, G, dtype=f32, device=dev)
        lse = torch.empty(B, G, dtype=f32, device=dev)
        bn = block_n or 32
        _sketch_kept_kernel[(B,)](
            q, L.keys, L.values, lp32, r232, o, cv, t, sc, kappa, lse,
            q.stride(0), q.stride(1), q.stride(2),
            *L.keys.stride(), *L.values.stride(),
            L.h_kv, n, float(L.scale),
            D=L.d, DV=dv, D_PAD=max(16, pow2(L.d)), DV_PAD=max(16, pow2(dv)),
            G=G, R_PAD=max(16, pow2(G)), BLOCK_N=bn,
        )
        return o, cv, t, sc[..., None], kappa, lse

    return kept_pass


def sketch_hajek_attention(q, keys, values, pi=None, sketch=None, *, scale=None, delta=0.05, rule=None,
                            multiplier=None, log_pi=None, value_center=None, value_sqdist=None, validate=True,
                            block_n=None) -> ClusterEstimate:
    r"""The cluster design's decode step with the kept pass in one Triton kernel.

    Same arguments, conventions and result as :func:`kvcert.fast.sketch_hajek_attention`
    (the formulas are there and in the module docstring), for a decode query only; the
    result's float32 fields (float32 accumulation for every input dtype) agree with the
    torch step's within float32 rounding (``tests/test_kernels_sketch.py`` derives the
    tolerance against the float64 reference).

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, 1, d), float16, bfloat16 or float32 (the dtype of keys and values)
    keys, values, pi, sketch, scale, delta, rule, multiplier, log_pi, value_center, value_sqdist, validate
        As :func:`kvcert.fast.sketch_hajek_attention`.
    block_n : int, optional
        Tokens per tile (a power of two >= 16; default 32).

    Returns
    -------
    ClusterEstimate (output in the dtype of ``values``; the statistics float32)
    """
    check_decode_q(q, "kvcert.fast.sketch_hajek_attention")
    check_dtypes(q=q, keys=keys, values=values)
    if block_n is not None and (isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16
                                or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    return sketch_step(q, keys, values, pi, sketch, scale=scale, delta=delta, rule=rule, multiplier=multiplier,
                        log_pi=log_pi, value_center=value_center, value_sqdist=value_sqdist, validate=validate,
                        kept_pass=_kernel_pass(block_n))
