"""Paged Hajek decode attention: the block design read straight from a paged K/V cache.

One query token per sequence (decode). The kernel walks the sequence's block
table, skips every evicted block (log pi_b = -inf) without touching its memory,
adds the offset -log pi_b to every logit of a kept block, and returns in the same
pass the Hajek output, the log-normalizer and the cluster-sampling variance of
docs/design.md section 7 (docs/theory.md section 7):

    trace = sum_{b in S} (1 - pi_b) || sum_{i in b} a_i (v_i - o_hat) ||^2.

Layout targeted: vLLM 0.32's FlashAttention-style CUDA cache. vLLM allocates
``kv_cache`` as (num_blocks, h_kv, block_size, 2 d) and its FlashAttention
backend reads it as ``key_cache, value_cache = kv_cache.transpose(1, 2).split(d, -1)``:
two (num_blocks, block_size, h_kv, d) views with arbitrary strides, which is
what this kernel takes (any strides). The block table is (num_seqs, max_blocks)
int32 of physical block ids, logical block j holding tokens j * block_size ...
(j + 1) * block_size - 1 of the sequence.

Each kept block is streamed in sub-tiles of ``block_t`` tokens (the whole
block up to 64 tokens). Its unnormalized weights p_i (relative to the running
max) give A_b = sum p_i and S_b = sum p_i v_i (the P V product the output
needs anyway); the certificate state is the weighted mean and centred
second moment of the block means S_b / A_b under the weights (1 - pi_b) A_b^2,
merged block by block (and split by split, by the same merge kernel as
:mod:`kvcert.kernels.hajek`) with Chan's formula; docs/gpu.md derives it.

:func:`paged_hajek_attention` serves the token design by compaction
(docs/design.md section 7): each KV head's kept prompt tokens in logical slots
0 .. C_h - 1 with a per-slot log pi, the later tokens certain at their
positions; its variance is the same state with every token its own unit. It reads
tiles of ``block_t`` tokens (64 by default) gathered row by row through the block
table (token p: physical block ``block_table[s, p // block_size]``, row
``p % block_size``), so a tile spans blocks, and masks the padding slots instead
of branching on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcert.fast.types import Estimate

from .hajek import (
    exact_tile_moments,
    load_rows,
    program_rows,
    softmax_pv,
    MAX_ROWS,
    INTERPRETED,
    chan_merge,
    check_dtypes,
    finalize_rows,
    hajek_merge_kernel,
    neg_expm1,
    pow2,
    store_split,
    load_tile,
    default_config,
)

__all__ = ["paged_block_hajek_attention", "paged_hajek_attention", "kv_cache_views", "default_block_t"]


@dataclass
class _LaunchPlan:
    """What the paged kernels share around their launch (:func:`_launch_plan`): the split-K plan over ``units``
    blocks per head, the tile sizes and the output and partial buffers."""

    splits: int
    chunk: int
    bh: int
    out: torch.Tensor
    lse: torch.Tensor
    var: torch.Tensor | None
    trace: torch.Tensor | None
    neff: torch.Tensor | None
    part_s: torch.Tensor
    part_v: torch.Tensor
    constexprs: dict
    launch: dict
    programs: int  # of one split: (sequence, KV head, block of query heads)

    @property
    def split(self) -> bool:
        return self.splits > 1

    def outputs(self) -> tuple:
        """The kernel's output arguments: out, lse, var, trace, n_eff (lse stands in for the absent ones) and
        the split partials."""
        dummy = self.lse
        return (self.out, self.lse, dummy if self.var is None else self.var, dummy if self.trace is None else self.trace,
                dummy if self.neff is None else self.neff, self.part_s, self.part_v)

    def meta(self, certify: bool) -> dict:
        """The kernel's shared constexprs and launch options."""
        return dict(self.constexprs, CERTIFY=bool(certify), PER_COORD=self.var is not None, SPLIT=self.split,
                    **self.launch)

    def estimate(self) -> Estimate:
        return Estimate(output=self.out, weights=None, variance=self.var, trace=self.trace, lse=self.lse,
                        n_eff=self.neff, max_term=None)


def _launch_plan(q, value_cache, S, h_q, d, dv, bs, units, programs, certify, per_coordinate, num_splits, block_t,
                 num_warps, num_stages, *, compacted=False) -> _LaunchPlan:
    """The split-K plan (``default_config`` over ``units`` units, or ``num_splits``), the tile (``block_t``), the
    outputs and the split partials of one launch of a paged kernel. A unit is a block of ``bs`` tokens streamed
    in sub-tiles of ``block_t`` (the block kernel), or one tile of ``block_t`` gathered tokens (``compacted``)."""
    block_t = _check_block_t(default_block_t(bs, d, value_cache.dtype, compacted=compacted) if block_t is None
                             else block_t)
    bs_pad = max(16, pow2(bs))
    unit = block_t if compacted else bs
    cfg = default_config(units * unit, d, programs, q.device, unit, value_cache.dtype)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
        cfg["num_splits"] = num_splits
    chunk = max(1, math.ceil(units / cfg["num_splits"]))
    splits = max(1, math.ceil(units / chunk))
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    lse = torch.empty((S, h_q), **f32)
    dv_pad = max(16, pow2(dv))
    bh = S * h_q
    if splits > 1:
        part_s, part_v = torch.empty((splits, bh, 5), **f32), torch.empty((splits, bh, 3, dv_pad), **f32)
    else:
        part_s = part_v = lse
    constexprs = dict(BS=bs, BLOCK_T=block_t if compacted else min(block_t, bs_pad), D=d, DV=dv,
                      D_PAD=max(16, pow2(d)), DV_PAD=dv_pad,
                      DOT_F32=value_cache.dtype == torch.float32 or INTERPRETED,
                      ROUND_P=value_cache.dtype != torch.float32)
    if not compacted:
        constexprs["BS_PAD"] = bs_pad
    launch = {} if INTERPRETED else {"num_warps": int(num_warps or cfg["num_warps"]),
                                     "num_stages": int(num_stages or cfg["num_stages"])}
    return _LaunchPlan(
        splits, chunk, bh, torch.empty((S, h_q, dv), device=dev, dtype=value_cache.dtype), lse,
        torch.empty((S, h_q, dv), **f32) if certify and per_coordinate else None,
        torch.empty((S, h_q), **f32) if certify else None, torch.empty((S, h_q), **f32) if certify else None,
        part_s, part_v, constexprs, launch, programs)


def _check_block_t(block_t) -> int:
    if isinstance(block_t, bool) or not isinstance(block_t, int) or block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t!r}")
    return block_t


def _merge(L: _LaunchPlan, certify: bool) -> None:
    """The split-K merge of a paged launch (the contiguous kernel's :func:`hajek_merge_kernel`)."""
    block_r = 16
    dummy = L.lse
    hajek_merge_kernel[(math.ceil(L.bh / block_r),)](
        L.part_s, L.part_v, L.out, L.lse,
        L.var if L.var is not None else dummy, L.trace if L.trace is not None else dummy,
        L.neff if L.neff is not None else dummy, L.bh, L.splits,
        DV=L.constexprs["DV"], DV_PAD=L.constexprs["DV_PAD"], BLOCK_R=block_r, CERTIFY=bool(certify),
        PER_COORD=L.var is not None, ROUND_P=L.constexprs["ROUND_P"], **({} if INTERPRETED else {"num_warps": 4}),
    )


@triton.jit
def _paged_decode_kernel(
    Q, KC, VC, BT, SL, LP, Out, Lse, Var, Tr, Neff, PartS, PartV,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bs, stride_bm, stride_ls, stride_lm,
    H_KV, H_Q, CHUNK_B, BH, scale,
    BS: tl.constexpr, BS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    G: tl.constexpr, G_BLOCK: tl.constexpr, N_RB: tl.constexpr, R_PAD: tl.constexpr,
    CERTIFY: tl.constexpr, PER_COORD: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    ROUND_P: tl.constexpr,
):
    """One (sequence, KV head, query-head block, split of the block table): online softmax of
    tau q.k_i - log pi_b over the kept blocks, and the Chan-merged (1 - pi_b) A_b^2 weighted
    mean / second moment of the block means m_b = S_b / A_b."""
    sid = tl.program_id(1)
    si, kvh, r, rmask, head, rows = program_rows(H_KV, H_Q, G, G_BLOCK, N_RB, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    dmask = offs_d < D
    vmask = offs_v < DV

    q = load_rows(Q + si * stride_qs, head, rmask, stride_qh, stride_qd, D, D_PAD, DOT_F32)

    m = tl.full([R_PAD], float("-inf"), tl.float32)
    l = tl.zeros([R_PAD], tl.float32)
    l_o = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, DV_PAD], tl.float32)
    W = tl.zeros([R_PAD], tl.float32)
    mean = tl.zeros([R_PAD, DV_PAD], tl.float32)
    M2 = tl.zeros([R_PAD, DV_PAD], tl.float32)
    Q2 = tl.zeros([R_PAD], tl.float32)

    seq_len = tl.load(SL + si).to(tl.int64)
    n_blk = (seq_len + BS - 1) // BS
    j0 = sid * CHUNK_B
    j1 = tl.minimum(j0 + CHUNK_B, n_blk)
    lp_row = LP + si * stride_ls  # the sequence's log pi_b and block table rows
    bt_row = BT + si * stride_bs
    for j in range(j0, j1):
        lp_ptr = lp_row + j * stride_lm
        log_pi = tl.load(lp_ptr)
        # evicted blocks: neither the id nor the memory is read (the unit of the certificate is the block, so
        # the branch skips one unit's whole state update, not a tile of a token loop)
        if log_pi > float("-inf"):
            phys = tl.load(bt_row + j * stride_bm).to(tl.int64)
            k_blk = KC + phys * stride_kb + kvh * stride_kh
            v_blk = VC + phys * stride_vb + kvh * stride_vh
            omp = neg_expm1(log_pi)  # 1 - pi_b
            A_b = tl.zeros([R_PAD], tl.float32)  # sum_{i in b} p_i   (rescaled with the running max)
            S_b = tl.zeros([R_PAD, DV_PAD], tl.float32)  # sum_{i in b} p_i v_i
            Q_b = tl.zeros([R_PAD], tl.float32)  # sum_{i in b} p_i^2 (n_eff of a certain block)
            for t0 in range(0, BS_PAD, BLOCK_T):  # the block in sub-tiles of BLOCK_T tokens (not unrolled)
                offs_t = t0 + tl.arange(0, BLOCK_T)
                nmask = (offs_t < BS) & (j * BS + offs_t < seq_len)
                # the block's log pi broadcast to its tokens (stride 0); -inf past the sequence end
                v, logits, _, _ = load_tile(q, k_blk, v_blk, lp_ptr, offs_t, nmask, offs_d, dmask, offs_v, vmask,
                                        stride_kt, stride_kd, stride_vt, stride_vd, 0, scale, True, DOT_F32)
                # A_t: the normalizer of the (rounded, with ROUND_P) p that form S_b
                m_new, alpha, p, l, l_o, pv, A_t = softmax_pv(m, l, l_o, logits, v, ROUND_P, DOT_F32)
                acc = acc * alpha[:, None] + pv
                if CERTIFY:
                    a2 = alpha * alpha  # the state is quadratic in p: rescale by e^{2 dm}
                    A_b = A_b * alpha + A_t
                    S_b = S_b * alpha[:, None] + pv
                    Q_b = Q_b * a2 + tl.sum(p * p, axis=1)
                    W = W * a2
                    M2 = M2 * a2[:, None]
                    Q2 = Q2 * a2
                m = m_new
            if CERTIFY:
                # Kish's n_eff counts a sampled block as one unit, a certain block's tokens one by one
                Q2 = Q2 + tl.where(omp > 0.0, A_b * A_b, Q_b)
                t_mean = S_b / tl.where(A_b > 0.0, A_b, 1.0)[:, None]  # block mean m_b; one point: M2_b = 0
                W, mean, M2 = chan_merge(W, mean, M2, omp * A_b * A_b, t_mean, 0.0)

    if SPLIT:
        store_split(PartS, PartV, sid * BH + rows, rmask, offs_v, m, l, l_o, acc, W, mean, M2, Q2,
                     DV_PAD, CERTIFY, ROUND_P)
    else:
        if not ROUND_P:
            l_o = l
        finalize_rows(rows, rmask, offs_v, vmask, m, l, l_o, acc, W, mean, M2, Q2,
                  Out, Lse, Var, Tr, Neff, DV, CERTIFY, PER_COORD)


def default_block_t(block_size: int, d: int, dtype: torch.dtype, *, compacted: bool = False) -> int:
    """Tokens per tile of the paged kernels at their default, from sm_90 ptxas counts only (docs/gpu.md).

    The block kernel streams each block in sub-tiles: the whole block up to 64 tokens for float16/bfloat16
    with d <= 128, up to 32 otherwise (the contiguous kernel's ``default_config`` tiles; whole 128-token
    blocks spill registers at d = 128). The compacted kernel (``compacted=True``) gathers its tiles token by
    token across blocks, so the block size does not bound them: those same 64 or 32 tokens."""
    cap = 64 if (d <= 128 and dtype != torch.float32) else 32
    return cap if compacted else min(max(16, pow2(block_size)), cap)


def kv_cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's FlashAttention cache (num_blocks, h_kv, block_size, 2 d) -> the (num_blocks,
    block_size, h_kv, d) key and value views the kernel reads (no copy; what
    ``FlashAttentionImpl.forward`` does: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``)."""
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache must have shape (num_blocks, h_kv, block_size, 2 * head_size) with "
                         f"head_size = {head_size}, got {tuple(kv_cache.shape)}")
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return k, v


def _check(q, key_cache, value_cache, block_table, seq_lens, log_pi_blocks, scale, validate):
    for name, x in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens), ("log_pi_blocks", log_pi_blocks)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape (num_seqs, h_q, d) (one decode token per sequence), "
                         f"got {tuple(q.shape)}")
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(f"key_cache and value_cache must have shape (num_blocks, block_size, h_kv, d), got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    S, h_q, d = q.shape
    nb, bs, h_kv, dk = key_cache.shape
    if dk != d:
        raise ValueError(f"key_cache must have head size d = {d} (q's last dim), got {dk}")
    if tuple(value_cache.shape[:3]) != (nb, bs, h_kv):
        raise ValueError(f"value_cache must have shape (num_blocks, block_size, h_kv, dv) = ({nb}, {bs}, {h_kv}, dv), "
                         f"got {tuple(value_cache.shape)}")
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"h_q = {h_q} must be a positive multiple of h_kv = {h_kv} (GQA)")
    if block_table.dim() != 2 or block_table.shape[0] != S or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be an int32 tensor of shape (num_seqs, max_blocks) = ({S}, M), got "
                         f"{block_table.dtype} of shape {tuple(block_table.shape)}")
    M = block_table.shape[1]
    if tuple(seq_lens.shape) != (S,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be an int32 tensor of shape (num_seqs,) = ({S},), got "
                         f"{seq_lens.dtype} of shape {tuple(seq_lens.shape)}")
    if tuple(log_pi_blocks.shape) != (S, M) or log_pi_blocks.dtype != torch.float32:
        raise ValueError(f"log_pi_blocks must be a float32 tensor of shape (num_seqs, max_blocks) = ({S}, {M}), "
                         f"got {log_pi_blocks.dtype} of shape {tuple(log_pi_blocks.shape)}")
    check_dtypes(q=q, key_cache=key_cache, value_cache=value_cache)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0.0 < float(scale) < math.inf):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    if validate and S:
        if not bool(torch.isfinite(q).all()):
            raise ValueError("q must be finite (found NaN or inf)")
        lens = seq_lens.to(torch.int64)
        if bool((lens < 0).any()) or bool((lens > M * bs).any()):
            raise ValueError(f"seq_lens must lie in [0, max_blocks * block_size] = [0, {M * bs}], "
                             f"got {lens.tolist()}")
        used = torch.arange(M, device=lens.device)[None, :] < -(-lens // bs)[:, None]
        lp = log_pi_blocks
        if bool(torch.isnan(lp).any()) or bool((lp > 0).any()):
            raise ValueError("log_pi_blocks must lie in [-inf, 0] (-inf = evicted, 0 = certain), found NaN or > 0")
        kept = used & (lp > float("-inf"))
        ids = block_table.to(torch.int64)
        if bool((kept & ((ids < 0) | (ids >= nb))).any()):
            raise ValueError(f"block_table must hold physical block ids in [0, num_blocks) = [0, {nb}) on every "
                             f"kept block")
    return float(scale)


def paged_block_hajek_attention(q, key_cache, value_cache, block_table, seq_lens, log_pi_blocks, *, scale=None,
                          per_coordinate=False, certify=True, num_splits=None, max_seq_len=None, block_t=None,
                          num_warps=None, num_stages=None, validate=True) -> Estimate:
    r"""Hajek decode attention over the kept blocks of a paged cache, and its cluster-sampling variance.

    .. math::

        \ell_i = \tau\, q\cdot k_i - \log\pi_{b(i)}, \qquad
        \hat o = \sum_{i\in S} a_i v_i, \quad a_i = e^{\ell_i} / \textstyle\sum_{j\in S} e^{\ell_j},
        \qquad \log\hat Z = \log \textstyle\sum_{i\in S} e^{\ell_i},

        \hat\Sigma = \sum_{b\in S} (1-\pi_b)\, z_b z_b^\top, \quad
        z_b = \sum_{i\in b} a_i (v_i - \hat o) = A_b (\bar v_b - \hat o), \quad
        A_b = \sum_{i\in b} a_i, \ \bar v_b = \sum_{i\in b} a_i v_i / A_b,

    S = the kept blocks (log pi_b > -inf) within ``seq_lens``. The trace is
    accumulated as :math:`\sum_b w_b \lVert\bar v_b - \hat o\rVert^2 = M_2 + W\lVert\bar w - \hat o\rVert^2`
    with :math:`w_b = (1-\pi_b) A_b^2`, :math:`W = \sum w_b`, :math:`\bar w = \sum w_b \bar v_b / W`,
    :math:`M_2 = \sum w_b (\bar v_b - \bar w)^2` (Chan's merge, docs/gpu.md).

    Parameters
    ----------
    q : (num_seqs, h_q, d), float16, bfloat16 or float32
        One decode query per sequence.
    key_cache, value_cache : (num_blocks, block_size, h_kv, d | dv), q's dtype, any strides
        vLLM's FlashAttention layout (:func:`kv_cache_views` makes them from
        vLLM's ``kv_cache`` tensor). h_q = g * h_kv (GQA).
    block_table : (num_seqs, max_blocks) int32 (or int64)
        Physical block id of each logical block. Entries of evicted blocks
        and past ``seq_lens`` are never read (they may be stale);
        ``seq_lens <= max_blocks * block_size`` (checked with ``validate``).
    seq_lens : (num_seqs,) int32 (or int64)
        Tokens per sequence (the current decode token included); the last
        block may be partial; 0 = empty.
    log_pi_blocks : (num_seqs, max_blocks) float32
        log pi_b per logical block: 0 = certain (pi = 1: attended, no variance),
        -inf = evicted (masked; its memory is never read).
    scale : float, default 1/sqrt(d)
    per_coordinate : bool, default False
        Also return diag(Sigma_hat) (b, h_q, dv); the trace is always returned.
    certify : bool, default True
        False skips the variance state (a benchmarking baseline).
    num_splits : int, optional
        Split the block table into this many chunks (flash decoding), merged
        by :mod:`kvcert.kernels.hajek`'s merge kernel. Default:
        :func:`kvcert.kernels.hajek.num_splits_heuristic` with blocks as tiles
        (>= 4 blocks and >= 1024 tokens per split; 1 on the interpreter).
    max_seq_len : int, optional
        Upper bound of ``seq_lens`` for sizing the splits (default
        ``seq_lens.max()``, which synchronizes with the device). It must
        bound every ``seq_lens`` entry (checked with ``validate``): blocks
        past it would not be visited.
    block_t : int, optional
        Tokens per sub-tile (power of two >= 16): a block larger than this is
        streamed in sub-tiles (A_b, S_b rescaled with the running max like
        the output) so that a 128-token block does not need a 128 x d tile
        in registers. Default :func:`default_block_t`.
    num_warps, num_stages : int, optional
        Triton launch parameters (ignored by the interpreter).
    validate : bool, default True
        Check q finite, ``log_pi_blocks`` in [-inf, 0], ``seq_lens`` within
        the table and kept block ids within the cache (device syncs; pass
        False in timed or graph-captured loops).

    Returns
    -------
    kvcert.fast.types.Estimate
        ``output`` (num_seqs, h_q, dv) in the input dtype; ``lse``, ``trace``,
        ``n_eff`` (num_seqs, h_q) float32 (n_eff = 1 / sum of squared unit
        weights: a sampled block is one unit, a certain block's tokens count
        one by one, as in :func:`kvcert.fast.block_hajek_attention`);
        ``variance`` (num_seqs, h_q, dv) float32 or None; ``weights``,
        ``max_term``, ``tail_moment`` None.

    Notes
    -----
    - Every pi = 1 (log pi 0 everywhere): exact paged attention, trace 0.
    - Empty sequences (seq_len 0 or every block evicted): output 0, lse -inf,
      trace and variance +inf, n_eff 0, as in kvcert.fast.
    - Slots of a kept block past ``seq_len`` get weight 0 and are masked in
      the load (never read); values in kept slots must be finite.
    - float32 accumulation; for half inputs p is rounded to the input dtype
      for the P V product and A_b, l_o are sums of the rounded p, as in
      :func:`kvcert.kernels.hajek_attention`.
    """
    scale = _check(q, key_cache, value_cache, block_table, seq_lens, log_pi_blocks, scale, validate)
    _check_cuda(q)
    L, rows = _block_plan(q, key_cache, value_cache, block_table, seq_lens, max_seq_len, certify, per_coordinate,
                          num_splits, block_t, num_warps, num_stages, validate)
    _launch_blocks(L, rows, q, key_cache, value_cache, block_table, seq_lens, log_pi_blocks, scale, certify)
    return L.estimate()


def _check_cuda(q) -> None:
    """CUDA tensors, unless the kernels were built by Triton's interpreter."""
    if not INTERPRETED and not q.is_cuda:
        raise ValueError(f"q is on {q.device}: the Triton kernel needs CUDA tensors, or TRITON_INTERPRET=1 set "
                         "before kvcert.kernels is imported (CPU interpreter)")


def _query_rows(S: int, h_q: int, h_kv: int) -> tuple[int, dict]:
    """The programs of one split, (sequence, KV head, block of at most 16 of its query heads), and the
    constexprs that pack a block's query heads as the rows of one tile."""
    g = h_q // h_kv
    g_block = min(g, MAX_ROWS)
    n_rb = math.ceil(g / g_block)
    return S * h_kv * n_rb, dict(G=g, G_BLOCK=g_block, N_RB=n_rb, R_PAD=max(16, pow2(g_block)))


def _block_plan(q, key_cache, value_cache, block_table, seq_lens, max_seq_len, certify, per_coordinate, num_splits,
                block_t, num_warps, num_stages, validate) -> tuple[_LaunchPlan, dict]:
    """The launch plan of the block kernel over the logical blocks up to ``max_seq_len`` (default: the longest
    sequence, a device sync; checked to bound it with ``validate``), and its rows (:func:`_query_rows`)."""
    S, h_q, d = q.shape
    nb, bs, h_kv, _ = key_cache.shape
    M = block_table.shape[1]
    programs, rows = _query_rows(S, h_q, h_kv)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if S else 0
    elif validate and S and int(seq_lens.max()) > int(max_seq_len):
        raise ValueError(f"max_seq_len = {max_seq_len} is below the longest sequence ({int(seq_lens.max())})")
    n_blk = max(1, min(M, -(-int(max_seq_len) // bs)))
    L = _launch_plan(q, value_cache, S, h_q, d, value_cache.shape[-1], bs, n_blk, programs, certify, per_coordinate,
                     num_splits, block_t, num_warps, num_stages)
    return L, rows


def _launch_blocks(L: _LaunchPlan, rows: dict, q, key_cache, value_cache, block_table, seq_lens, log_pi_blocks,
                   scale, certify) -> None:
    """The block kernel over the plan's grid, then the merge when the table is split (nothing without programs)."""
    h_q, h_kv = q.shape[1], key_cache.shape[2]
    if L.programs > 0:
        _paged_decode_kernel[(L.programs, L.splits)](
            q, key_cache, value_cache, block_table, seq_lens, log_pi_blocks, *L.outputs(),
            q.stride(0), q.stride(1), q.stride(2),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
            block_table.stride(0), block_table.stride(1), log_pi_blocks.stride(0), log_pi_blocks.stride(1),
            h_kv, h_q, L.chunk, L.bh, scale, **rows, **L.meta(certify),
        )
        if L.split:
            _merge(L, certify)


# ----------------------------------------------------------------------------- compacted token slots

@triton.jit
def _token_step(m, l, l_o, acc, W, mean, M2, Q2, v, logits, one_minus, r,
                SAMPLED: tl.constexpr, CERTIFY: tl.constexpr, DOT_F32: tl.constexpr, ROUND_P: tl.constexpr,
                R_PAD: tl.constexpr, DV_PAD: tl.constexpr, G_BLOCK: tl.constexpr):
    """One tile of tokens, each its own sampling unit: the online softmax, P V, and (SAMPLED) the Chan merge
    of the tile's (1 - pi_i) p_i^2 weighted moments of v_i; a certain tile (pi = 1) only rescales them."""
    m_new, alpha, p, l, l_o, pv, _ = softmax_pv(m, l, l_o, logits, v, ROUND_P, DOT_F32)
    acc = acc * alpha[:, None] + pv
    if CERTIFY:
        a2 = alpha * alpha  # the state is quadratic in p: rescale by e^{2 dm}
        pp = p * p
        Q2 = Q2 * a2 + tl.sum(pp, axis=1)
        if SAMPLED:
            w = one_minus[None, :] * pp  # block size 1: w_i = (1 - pi_i) A_i^2 with A_i = p_i, vbar_i = v_i
            t_mean, t_M2 = exact_tile_moments(w, v.to(tl.float32), r, R_PAD, DV_PAD, G_BLOCK)
            W, mean, M2 = chan_merge(W * a2, mean, M2 * a2[:, None], tl.sum(w, axis=1), t_mean, t_M2)
        else:  # pi = 1: w_i = 0, no unit joins the variance state
            W = W * a2
            M2 = M2 * a2[:, None]
    return m_new, l, l_o, acc, W, mean, M2, Q2


@triton.jit
def _gathered_tile(q, k_head, v_head, bt_row, stride_bm, pos, mask, log_p, offs_d, dmask, offs_v, vmask,
                   stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, scale,
                   BS: tl.constexpr, DOT_F32: tl.constexpr):
    """A tile of tokens at the sequence's logical positions ``pos`` read row by row through its block table
    (token p: physical block ``bt_row[p // BS]``, row ``p % BS``): V and the logits tau q.k_i - log pi_i,
    -inf where ``mask`` is off (those tokens read neither their table entry nor their K and V)."""
    phys = tl.load(bt_row + (pos // BS) * stride_bm, mask=mask, other=0).to(tl.int64)
    row = (pos % BS).to(tl.int64)
    k = tl.load(k_head + (phys * stride_kb + row * stride_kt)[:, None] + offs_d[None, :] * stride_kd,
                mask=mask[:, None] & dmask[None, :], other=0.0)
    v = tl.load(v_head + (phys * stride_vb + row * stride_vt)[:, None] + offs_v[None, :] * stride_vd,
                mask=mask[:, None] & vmask[None, :], other=0.0)
    if DOT_F32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    logits = tl.where(mask[None, :], s * scale - log_p[None, :], float("-inf"))
    return v, logits


@triton.jit
def _paged_compacted_kernel(
    Q, KC, VC, BT, SL, PL, LPS, Out, Lse, Var, Tr, Neff, PartS, PartV,
    stride_qs, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bs, stride_bm, stride_ls, stride_lh, stride_lj,
    H_KV, H_Q, CMAX, NC, CHUNK_U, BH, scale,
    BS: tl.constexpr, BLOCK_T: tl.constexpr,
    D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    G: tl.constexpr, G_BLOCK: tl.constexpr, N_RB: tl.constexpr, R_PAD: tl.constexpr,
    CERTIFY: tl.constexpr, PER_COORD: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
    ROUND_P: tl.constexpr,
):
    """One (sequence, KV head, query-head block, split of the units): online softmax of
    tau q.k_i - log pi_i over the head's compacted slots (log pi_i > -inf) and the certain tail
    [P_s, L_s), with the Chan-merged (1 - pi_i) p_i^2 weighted mean / second moment of v_i; both in
    tiles of BLOCK_T tokens gathered row by row through the block table (masked, no branch)."""
    sid = tl.program_id(1)
    si, kvh, r, rmask, head, rows = program_rows(H_KV, H_Q, G, G_BLOCK, N_RB, R_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    offs_t = tl.arange(0, BLOCK_T)
    dmask = offs_d < D
    vmask = offs_v < DV

    q = load_rows(Q + si * stride_qs, head, rmask, stride_qh, stride_qd, D, D_PAD, DOT_F32)

    m = tl.full([R_PAD], float("-inf"), tl.float32)
    l = tl.zeros([R_PAD], tl.float32)
    l_o = tl.zeros([R_PAD], tl.float32)
    acc = tl.zeros([R_PAD, DV_PAD], tl.float32)
    W = tl.zeros([R_PAD], tl.float32)
    mean = tl.zeros([R_PAD, DV_PAD], tl.float32)
    M2 = tl.zeros([R_PAD, DV_PAD], tl.float32)
    Q2 = tl.zeros([R_PAD], tl.float32)

    seq_len = tl.load(SL + si).to(tl.int64)
    p_len = tl.load(PL + si).to(tl.int64)
    c_end = tl.minimum(p_len, CMAX)  # slots at or past the prompt length are never compacted slots
    u0 = sid * CHUNK_U
    u1 = u0 + CHUNK_U
    # the sequence's rows of the block table and of log pi, and the KV head's K and V, outside the loops
    bt_row = BT + si * stride_bs
    lp_head = LPS + si * stride_ls + kvh * stride_lh
    k_head = KC + kvh * stride_kh
    v_head = VC + kvh * stride_vh
    # units 0 .. NC-1: tiles of compacted slots (slot j: block j // BS, row j % BS); padding slots masked
    for u in range(u0, tl.minimum(u1, (c_end + BLOCK_T - 1) // BLOCK_T)):
        slot = u * BLOCK_T + offs_t
        lp = tl.load(lp_head + slot * stride_lj, mask=slot < c_end, other=float("-inf"))
        kept = lp > float("-inf")
        v, logits = _gathered_tile(q, k_head, v_head, bt_row, stride_bm, slot, kept, lp, offs_d, dmask, offs_v,
                                   vmask, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd, scale,
                                   BS, DOT_F32)
        one_minus = tl.where(kept, neg_expm1(lp), 0.0)
        m, l, l_o, acc, W, mean, M2, Q2 = _token_step(m, l, l_o, acc, W, mean, M2, Q2, v, logits, one_minus, r,
                                                      True, CERTIFY, DOT_F32, ROUND_P, R_PAD, DV_PAD, G_BLOCK)
    # units NC, NC+1, ...: tiles of the tail's positions P_s, P_s + 1, ... < L_s (log pi = 0)
    n_tail = (tl.maximum(seq_len - p_len, 0) + BLOCK_T - 1) // BLOCK_T
    zero = tl.zeros([BLOCK_T], tl.float32)
    for u in range(tl.maximum(u0, NC), tl.minimum(u1, NC + n_tail)):
        pos = p_len + (u - NC) * BLOCK_T + offs_t
        v, logits = _gathered_tile(q, k_head, v_head, bt_row, stride_bm, pos, pos < seq_len, zero, offs_d, dmask,
                                   offs_v, vmask, stride_kb, stride_kt, stride_kd, stride_vb, stride_vt, stride_vd,
                                   scale, BS, DOT_F32)
        m, l, l_o, acc, W, mean, M2, Q2 = _token_step(m, l, l_o, acc, W, mean, M2, Q2, v, logits, zero, r,
                                                      False, CERTIFY, DOT_F32, ROUND_P, R_PAD, DV_PAD, G_BLOCK)

    if SPLIT:
        store_split(PartS, PartV, sid * BH + rows, rmask, offs_v, m, l, l_o, acc, W, mean, M2, Q2,
                     DV_PAD, CERTIFY, ROUND_P)
    else:
        if not ROUND_P:
            l_o = l
        finalize_rows(rows, rmask, offs_v, vmask, m, l, l_o, acc, W, mean, M2, Q2,
                  Out, Lse, Var, Tr, Neff, DV, CERTIFY, PER_COORD)


def _check_compacted(q, key_cache, value_cache, block_table, seq_lens, prompt_lens, log_pi_slots, scale, validate):
    """The block kernel's checks (shapes, dtypes, scale, ``seq_lens`` within the table) and what the
    compacted slots add: ``prompt_lens`` in [0, seq_lens], ``log_pi_slots`` (S, h_kv, Cmax) float32 in
    [-inf, 0] and -inf at every slot j >= prompt_lens, and valid block ids wherever a slot is read."""
    for name, x in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache), ("block_table", block_table),
                    ("seq_lens", seq_lens), ("prompt_lens", prompt_lens), ("log_pi_slots", log_pi_slots)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    S, M = (q.shape[0] if q.dim() else 0), (block_table.shape[1] if block_table.dim() == 2 else 0)
    # the block kernel's checks, with an all-certain block table standing in for log_pi_blocks
    scale = _check(q, key_cache, value_cache, block_table, seq_lens,
                   torch.zeros((S, M), dtype=torch.float32, device=block_table.device), scale, False)
    nb, bs, h_kv, _ = key_cache.shape
    if tuple(prompt_lens.shape) != (S,) or prompt_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prompt_lens must be an int32 tensor of shape (num_seqs,) = ({S},), got "
                         f"{prompt_lens.dtype} of shape {tuple(prompt_lens.shape)}")
    if log_pi_slots.dim() != 3 or tuple(log_pi_slots.shape[:2]) != (S, h_kv) or log_pi_slots.dtype != torch.float32:
        raise ValueError(f"log_pi_slots must be a float32 tensor of shape (num_seqs, h_kv, Cmax) = ({S}, {h_kv}, C), "
                         f"got {log_pi_slots.dtype} of shape {tuple(log_pi_slots.shape)}")
    if validate and S:
        if not bool(torch.isfinite(q).all()):
            raise ValueError("q must be finite (found NaN or inf)")
        lens = seq_lens.to(torch.int64)
        plen = prompt_lens.to(torch.int64)
        if bool((lens < 0).any()) or bool((lens > M * bs).any()):
            raise ValueError(f"seq_lens must lie in [0, max_blocks * block_size] = [0, {M * bs}], "
                             f"got {lens.tolist()}")
        if bool((plen < 0).any()) or bool((plen > lens).any()):
            raise ValueError(f"prompt_lens must lie in [0, seq_lens] per sequence, got prompt_lens "
                             f"{plen.tolist()} and seq_lens {lens.tolist()}")
        lp = log_pi_slots
        if bool(torch.isnan(lp).any()) or bool((lp > 0).any()):
            raise ValueError("log_pi_slots must lie in [-inf, 0] (-inf = padding slot, 0 = certain), found NaN or > 0")
        C = lp.shape[2]
        kept = lp > float("-inf")  # (S, h_kv, C)
        past = torch.arange(C, device=lp.device)[None, :] >= plen[:, None]  # (S, C)
        if bool((kept & past[:, None, :]).any()):
            raise ValueError("log_pi_slots must be -inf at every slot j >= prompt_lens (a head keeps at most "
                             "prompt_lens tokens, compacted into slots 0 .. C_h - 1; later positions are the "
                             "certain tail)")
        # logical blocks read: those holding a kept slot of any head, and the tail's blocks
        used = torch.zeros((S, M), dtype=torch.bool, device=lp.device)
        if C:
            cb = torch.arange(C, device=lp.device) // bs
            anyk = kept.any(1) & (cb[None, :] < M)
            rows = torch.arange(S, device=lp.device)[:, None].expand(S, C)
            used[rows[anyk], cb[None, :].expand(S, C)[anyk]] = True
        jj = torch.arange(M, device=lp.device)[None, :]
        used |= (jj >= (plen // bs)[:, None]) & (jj < (-(-lens // bs))[:, None]) & (lens > plen)[:, None]
        ids = block_table.to(torch.int64)
        if bool((used & ((ids < 0) | (ids >= nb))).any()):
            raise ValueError(f"block_table must hold physical block ids in [0, num_blocks) = [0, {nb}) on every "
                             f"block holding a kept slot or a tail token")
    return scale


def paged_hajek_attention(q, key_cache, value_cache, block_table, seq_lens, prompt_lens, log_pi_slots, *,
                                    scale=None, per_coordinate=False, certify=True, num_splits=None,
                                    max_tail_len=None, block_t=None, num_warps=None, num_stages=None,
                                    validate=True) -> Estimate:
    r"""Hajek decode attention over a paged cache whose prompt was compacted per KV head (the token design).

    After a prompt's prefill each KV head h of sequence s keeps a Poisson sample of the prompt's tokens,
    copied to the logical slots 0 .. C_h - 1 of the sequence's block table (slot j in physical block
    ``block_table[s, j // block_size]`` at offset ``j % block_size``) with log pi_j in ``log_pi_slots``
    (-inf = padding, j >= C_h); tokens generated after the prompt stay at their logical positions
    p in [P_s, L_s) and are certain (docs/design.md section 7). With S_h the kept slots of head h and
    T the tail,

    .. math::

        \ell_i = \tau\, q\cdot k_i - \log\pi_i \ (i \in S_h), \qquad \ell_i = \tau\, q\cdot k_i \ (i \in T),

        \hat o = \sum_{i\in S_h\cup T} a_i v_i, \quad a_i = e^{\ell_i}/\textstyle\sum_j e^{\ell_j},
        \qquad \log\hat Z = \log \textstyle\sum_i e^{\ell_i},

        \hat\Sigma = \sum_{i\in S_h} (1-\pi_i)\, a_i^2 (v_i - \hat o)(v_i - \hat o)^\top
        \quad (\text{tail: } \pi_i = 1, \text{ no term}),

    the token design's variance. It is the block kernel's cluster variance with block size 1 (every
    token its own unit: A_i = a_i, vbar_i = v_i, w_i = (1 - pi_i) a_i^2), so the state is the block
    kernel's (W, mean, M2) with tokens as points: each tile's (``block_t`` tokens gathered through the
    block table, across blocks) weighted moments of v_i under
    :math:`w_i = (1-\pi_i) e^{2(\ell_i - m)}` (two exact passes over the tile in registers) join the
    running state by Chan's merge after rescaling W and M2 by :math:`e^{2(m_{old} - m_{new})}`, and
    :math:`\mathrm{trace} = [M_2 + W \lVert\bar w - \hat o\rVert^2] / l^2` at the end (docs/gpu.md).

    Parameters
    ----------
    q : (num_seqs, h_q, d), float16, bfloat16 or float32
        One decode query per sequence.
    key_cache, value_cache : (num_blocks, block_size, h_kv, d | dv), q's dtype, any strides
        As for :func:`paged_block_hajek_attention` (:func:`kv_cache_views`). h_q = g * h_kv.
    block_table : (num_seqs, max_blocks) int32 (or int64)
        Physical block ids; only blocks holding a kept slot of some head or a tail token are read.
    seq_lens : (num_seqs,) int32 (or int64)
        L_s, the tokens of the sequence (the current decode token included).
    prompt_lens : (num_seqs,) int32 (or int64)
        P_s in [0, L_s]: the compacted prompt's length; positions [P_s, L_s) are the certain tail.
    log_pi_slots : (num_seqs, h_kv, Cmax) float32
        log pi of compacted slot j of KV head h; -inf = padding (never read). Slots j >= P_s must be
        -inf (C_h <= P_s: the compacted slots and the tail never overlap). Cmax is free (need not be
        a multiple of block_size).
    scale : float, default 1/sqrt(d)
    per_coordinate : bool, default False
        Also return diag(Sigma_hat) (num_seqs, h_q, dv).
    certify : bool, default True
        False skips the variance state (a benchmarking baseline).
    num_splits : int, optional
        Split the units (the ceil(Cmax / block_t) tiles of compacted slots, then the tiles of the longest
        tail) into this many chunks merged by :mod:`kvcert.kernels.hajek`'s merge kernel. Default:
        :func:`kvcert.kernels.hajek.num_splits_heuristic` over those tiles (1 on the interpreter).
    max_tail_len : int, optional
        Upper bound of L_s - P_s, for sizing the splits (default: computed, a device sync). Checked
        with ``validate``: tail tokens past it would not be visited.
    block_t : int, optional
        Tokens per tile (power of two >= 16), gathered row by row through the block table, so a
        tile spans blocks of any size; default :func:`default_block_t` (``compacted=True``: 64 for
        float16/bfloat16 with d <= 128, else 32).
    num_warps, num_stages : int, optional
        Triton launch parameters (ignored by the interpreter).
    validate : bool, default True
        Check q finite, ``log_pi_slots`` in [-inf, 0] and -inf past ``prompt_lens``, 0 <= P_s <= L_s
        <= max_blocks * block_size, and block ids within the cache wherever a slot is read (device
        syncs; pass False in timed or graph-captured loops).

    Returns
    -------
    kvcert.fast.types.Estimate
        As :func:`paged_block_hajek_attention`: ``output`` (num_seqs, h_q, dv) in the input dtype; ``lse``,
        ``trace``, ``n_eff`` (num_seqs, h_q) float32 (n_eff = 1 / sum_i a_i^2, every token a unit);
        ``variance`` or None; ``weights``, ``max_term``, ``tail_moment`` None.

    Notes
    -----
    - pi = 1 slots and the tail contribute to the output, lse and n_eff but not to the variance; all
      certain: exact attention over the kept tokens, trace 0.
    - An empty head (C_h = 0 and no tail): output 0, lse -inf, trace and variance +inf, n_eff 0.
    - The K/V of padding slots are never loaded (masked per slot), so they may hold stale values.
    - float32 accumulation; half inputs round p for the P V product as in :func:`paged_block_hajek_attention`.

    References
    ----------
    Hajek (1971); Sarndal, Swensson & Wretman (1992), sec. 5.7; Chan, Golub & LeVeque (1979);
    arXiv 2607.21475.
    """
    scale = _check_compacted(q, key_cache, value_cache, block_table, seq_lens, prompt_lens, log_pi_slots, scale,
                             validate)
    _check_cuda(q)
    L, rows, nc = _compacted_plan(q, key_cache, value_cache, block_table, seq_lens, prompt_lens, log_pi_slots,
                                  max_tail_len, certify, per_coordinate, num_splits, block_t, num_warps, num_stages,
                                  validate)
    _launch_compacted(L, rows, nc, q, key_cache, value_cache, block_table, seq_lens, prompt_lens, log_pi_slots, scale,
                      certify)
    return L.estimate()


def _compacted_plan(q, key_cache, value_cache, block_table, seq_lens, prompt_lens, log_pi_slots, max_tail_len,
                    certify, per_coordinate, num_splits, block_t, num_warps, num_stages,
                    validate) -> tuple[_LaunchPlan, dict, int]:
    """The launch plan of the compacted kernel, its rows (:func:`_query_rows`) and its count of compacted units
    (tiles of ``block_t`` slots), the tail's units after them up to ``max_tail_len`` (default: the longest
    tail, a device sync; checked to bound it with ``validate``)."""
    S, h_q, d = q.shape
    nb, bs, h_kv, _ = key_cache.shape
    M = block_table.shape[1]
    C = log_pi_slots.shape[2]
    programs, rows = _query_rows(S, h_q, h_kv)
    bt = _check_block_t(default_block_t(bs, d, value_cache.dtype, compacted=True) if block_t is None else block_t)
    nc = -(-min(C, M * bs) // bt)  # compacted units: tiles of slots 0 .. bt - 1, bt .. 2 bt - 1, ...
    lens = seq_lens.to(torch.int64) - prompt_lens.to(torch.int64)
    if max_tail_len is None:
        tail = int(lens.max()) if S else 0
    else:
        if isinstance(max_tail_len, bool) or not isinstance(max_tail_len, int) or max_tail_len < 0:
            raise ValueError(f"max_tail_len must be a non-negative int, got {max_tail_len!r}")
        if validate and S and int(lens.max()) > max_tail_len:
            raise ValueError(f"max_tail_len = {max_tail_len} is below the longest tail (seq_lens - prompt_lens = "
                             f"{int(lens.max())})")
        tail = max_tail_len
    nt = -(-max(0, min(M * bs, tail)) // bt)  # tail units: tiles of positions P_s .. P_s + bt - 1, ...
    units = max(1, nc + nt)
    L = _launch_plan(q, value_cache, S, h_q, d, value_cache.shape[-1], bs, units, programs, certify, per_coordinate,
                     num_splits, bt, num_warps, num_stages, compacted=True)
    return L, rows, nc


def _launch_compacted(L: _LaunchPlan, rows: dict, nc: int, q, key_cache, value_cache, block_table, seq_lens,
                      prompt_lens, log_pi_slots, scale, certify) -> None:
    """The compacted kernel over the plan's grid, then the merge when the units are split (nothing without
    programs); a head without slots reads a one-slot padding row of log pi."""
    S, h_q, _ = q.shape
    h_kv = key_cache.shape[2]
    C = log_pi_slots.shape[2]
    lps = log_pi_slots if C else torch.full((S, h_kv, 1), float("-inf"), device=q.device, dtype=torch.float32)
    if L.programs > 0:
        _paged_compacted_kernel[(L.programs, L.splits)](
            q, key_cache, value_cache, block_table, seq_lens, prompt_lens, lps, *L.outputs(),
            q.stride(0), q.stride(1), q.stride(2),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.stride(3),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), value_cache.stride(3),
            block_table.stride(0), block_table.stride(1), lps.stride(0), lps.stride(1), lps.stride(2),
            h_kv, h_q, C, nc, L.chunk, L.bh, scale, **rows, **L.meta(certify),
        )
        if L.split:
            _merge(L, certify)


#: the arguments the JIT specializes when the kernels read vLLM's FlashAttention layout (:func:`kv_cache_views`),
#: a contiguous q, block table and log pi: the innermost strides are 1 (a constexpr for the compiler), and
#: with d and dv multiples of 16 the other strides of q, K and V are multiples of 16 (``tt.divisibility``)
_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_bm", "stride_lm", "stride_lj")
_ALIGNED_STRIDES = ("stride_qs", "stride_qh", "stride_kb", "stride_kt", "stride_kh",
                    "stride_vb", "stride_vt", "stride_vh")


def compile_paged(*, arch: int = 90, dtype: str = "bf16", d: int = 128, dv: int | None = None, g: int = 4,
                  block_size: int = 16, block_t: int | None = None, num_warps: int = 8, num_stages: int = 2,
                  certify: bool = True, per_coordinate: bool = False, split: bool = True, compacted: bool = False,
                  specialize: bool = True) -> dict:
    """Lower the paged decode kernel (``compacted=True``: the compacted token-slot kernel of
    :func:`paged_hajek_attention`) to a ``sm_<arch>`` cubin without a GPU (Triton's bundled ptxas)
    and return its resource usage (:func:`kvcert.kernels.aot.resource_usage`: registers, spills, shared memory).

    ``specialize`` (default): compile what the JIT compiles for a launch on vLLM's cache views, a
    contiguous q, block table and log pi: unit innermost strides as constants, 16-byte aligned pointers and
    (d, dv multiples of 16) strides of q, K and V divisible by 16, which lets the loads vectorize.
    ``specialize=False``: no such assumption (every stride a runtime int), the code a launch with a
    non-unit innermost stride gets.

    Static evidence only, like ``python -m kvcert.kernels.aot`` for the contiguous kernel; run it
    without ``TRITON_INTERPRET``.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import aot

    aot._check_compiled()
    dt = aot._DT[dtype]
    dv = d if dv is None else dv
    g_block = min(g, MAX_ROWS)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    bt = block_t or default_block_t(block_size, d, tdt, compacted=compacted)
    const = dict(BS=block_size, D=d, DV=dv, D_PAD=aot.pow2(d), DV_PAD=aot.pow2(dv),
                 G=g, G_BLOCK=g_block, N_RB=-(-g // g_block), R_PAD=aot.pow2(g_block), CERTIFY=certify,
                 PER_COORD=per_coordinate, SPLIT=split, DOT_F32=dt == "fp32", ROUND_P=dt != "fp32")
    if compacted:  # tiles gathered across blocks: the block size does not bound them
        const.update(BLOCK_T=bt)
    else:
        bt = min(bt, aot.pow2(block_size))
        const.update(BS_PAD=aot.pow2(block_size), BLOCK_T=bt)
    ptr = {"Q": dt, "KC": dt, "VC": dt, "Out": dt, "BT": "i32", "SL": "i32", "PL": "i32", "LP": "fp32", "LPS": "fp32",
           **{name: "fp32" for name in ("Lse", "Var", "Tr", "Neff", "PartS", "PartV")}}
    kern = _paged_compacted_kernel if compacted else _paged_decode_kernel
    if specialize:
        const.update({name: 1 for name in _UNIT_STRIDES if name in kern.arg_names})
    sig = aot._signature(kern, const, ptr)
    aligned = set(_ALIGNED_STRIDES) if specialize and d % 16 == 0 and dv % 16 == 0 else set()
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kern.arg_names)
             if specialize and (sig[name].startswith("*") or name in aligned)}
    k = triton.compile(ASTSource(kern, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages})
    return dict(kernel="paged_compacted" if compacted else "paged_decode", arch=f"sm_{arch}", dtype=dt, d=d, g=g,
                block_size=block_size, block_t=bt, num_warps=num_warps, certify=certify, split=split,
                specialize=specialize, **aot.resource_usage(k))
