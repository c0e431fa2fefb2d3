"""The block design (cluster sampling with blocks as the units), batched (torch): whole blocks of
``block_size`` tokens are sampled.

Torch twin of ``kvcert.reference.blocks`` (docs/design.md section 7, derivation in
docs/theory.md section 7). A paged engine stores K/V in blocks that hold every
head of a layer, and one block table serves all layers, so the block choice
is one per *sequence*: shapes are (b, n_blocks) for the design, and the same
kept blocks are applied to every layer and KV head of a batch row.

- :func:`block_importance`: token importance (b, ..., n) -> block importance
  (b, n_blocks), summed over the tokens of a block, each head normalized to
  shares, then the mean (or max) over the heads and layers in the middle dims.
- :func:`block_inclusion_probabilities`: the token design's capped-PPS solver
  (:func:`kvcert.fast.inclusion_probabilities`) run on blocks, with
  ``lengths`` for right-padded batches (padding blocks get pi = 0).
- :func:`block_uniforms` / :func:`block_sample`: a counter-based SplitMix64
  stream keyed by (seed, event) and indexed by the block index, so a
  sequence keeps the same blocks whatever the batch it is in and whatever the
  call order; bit-identical to ``kvcert.reference.block_uniforms``. ``seed``
  may be a (b,) tensor (one seed per request). :func:`prompt_event` is the
  event of a prompt (a hash of its token ids), shared by the vLLM plugin and
  the Hugging Face ``BlockPoissonPress``.
- :func:`block_compact` / :func:`block_evict`: the kept blocks packed into a
  padded :class:`~kvcert.fast.types.CompressedCache` (same kept tokens on every
  KV head; the token pi is pi_b).
- :func:`block_hajek_attention`: the Hajek estimate (offset -log pi_b on every
  token of a kept block, computed by :func:`kvcert.fast.hajek_attention`) with
  the cluster-sampling variance
  :math:`\\hat\\Sigma = \\sum_{b\\in S} (1-\\pi_b) z_b z_b^\\top`,
  :math:`z_b = \\sum_{i\\in b} a_i (v_i - \\hat o)`.
- :func:`paged_block_hajek_attention`: the same estimate and trace for one decode
  query per row whose units are whole kept blocks, read from a paged cache in
  vLLM's CPU ``vec`` layout by a chunked gather (:func:`block_chunks`, at most
  :data:`GATHER_BYTES` at once); the torch backend's paged block estimator (the
  vLLM plugin's CPU route, :data:`kvcert.dispatch.PAGED_TORCH`). Its Triton twin
  for the FlashAttention layout is :func:`kvcert.kernels.paged_block_hajek_attention`.

Stream: with ``mix`` the SplitMix64 finalizer, ``G = 0x9E3779B97F4A7C15`` and
``TAG = 0x6B76626C6F636B73`` ("kvblocks"), the key is
``k = mix(seed + G); k = mix((k ^ TAG) + G); k = mix((k ^ event) + G)`` and
block ``j`` draws ``U_j = (mix(k + (j + 1) G) >> 11) * 2**-53`` (all modulo 2**64).
"""

from __future__ import annotations

import hashlib
import numbers
import threading
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from ._checks import (check_int, check_kernel_size, check_nonneg_int, check_probabilities, check_real, check_scale,
                      check_tensor, stat_dtype)
from .design import inclusion_probabilities, nonnegative_importance, splitmix64
from .estimators import hajek_attention
from .eviction import compact
from .options import check_kind, check_scorer, scorer_params, set_fields
from .scorers import SCORERS, queries_needed, queries_read
from .types import CompressedCache, Estimate

__all__ = [
    "BLOCK_REDUCTIONS",
    "REDUCTIONS",
    "BlockDecision",
    "BlockDesign",
    "block_count",
    "block_uniforms",
    "block_importance",
    "block_inclusion_probabilities",
    "block_sample",
    "block_budget",
    "prompt_event",
    "expand_blocks",
    "block_keep",
    "block_compact",
    "block_evict",
    "block_hajek_attention",
    "paged_block_hajek_attention",
    "block_chunks",
    "BlockChunk",
    "GATHER_BYTES",
]

#: name -> how :func:`block_importance` combines the per-head block shares (b, heads, n_blocks) -> (b, n_blocks):
#: ``"mean"`` targets the average head, ``"max"`` protects the blocks any single head needs (the reasons are in
#: ``kvcert.reference.block_importance``); the one list of reductions (the presses and the vLLM plugin read it)
REDUCTIONS = MappingProxyType({
    "mean": lambda shares: shares.mean(1),
    "max": lambda shares: shares.amax(1),
})
#: the names of :data:`REDUCTIONS`, in its order
BLOCK_REDUCTIONS = tuple(REDUCTIONS)

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """Python int -> the int64 with the same low 64 bits (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, SplitMix64's increment
_TAG = _i64(0x6B76626C6F636B73)  # "kvblocks": domain tag of the block stream


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise TypeError(f"block_size must be an int >= 1, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size}")
    return int(block_size)


def block_count(n: int, block_size: int) -> int:
    """Number of blocks ``ceil(n / block_size)`` covering n tokens (the last one may be partial)."""
    n = check_nonneg_int("n", n)
    return -(-n // _check_block_size(block_size))


# ----------------------------------------------------------------------------- the stream


def block_budget(n_blocks: int, compression_ratio: float, certain_blocks: int) -> float | None:
    """Expected kept blocks of a prompt of ``n_blocks`` blocks at ``compression_ratio``, or None when
    nothing is evicted: ratio 0, or the certainty set (``certain_blocks`` = sinks + recent + top, capped
    at ``n_blocks``) fills the budget ``(1 - compression_ratio) * n_blocks``. The rule of the vLLM
    plugin (``KVCertConfig.budget``) and of the Hugging Face ``BlockPoissonPress``."""
    if compression_ratio <= 0:
        return None
    budget = (1.0 - float(compression_ratio)) * n_blocks
    certain = min(n_blocks, certain_blocks)
    if budget <= certain or certain >= n_blocks:
        return None
    return budget


def prompt_event(token_ids) -> int:
    """The stream's event key of a prompt: the first 63 bits of BLAKE2b over its token ids (int64, little endian).

    With the seed it keys the block stream (:func:`block_uniforms`), so a
    prompt keeps the same blocks whatever the batch, the call order or the
    engine (the vLLM plugin's scheduler and the Hugging Face
    ``kvcert.presses.BlockPoissonPress`` both call it), and different prompts
    draw independent streams. ``token_ids``: any iterable of ints (padding
    excluded).
    """
    data = np.asarray(list(token_ids or ()), dtype="<i8").tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _seed_keys(seed, lead: tuple[int, ...], event: int, device) -> torch.Tensor:
    """int64 keys of shape ``lead`` (one per row) from an int seed or a tensor of seeds."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype not in (torch.int64, torch.int32) or (seed.numel() and bool((seed < 0).any())):
            raise ValueError(f"seed must be an int >= 0 or an int64 tensor of seeds >= 0, got dtype {seed.dtype}")
        try:
            s = torch.broadcast_to(seed.to(device=device, dtype=torch.int64), lead)
        except RuntimeError:
            raise ValueError(f"seed must be an int or a tensor broadcastable to the leading dims {lead}, "
                             f"got shape {tuple(seed.shape)}") from None
        k = splitmix64(s + _GOLDEN)
    else:
        s = check_nonneg_int("seed", seed)
        k = splitmix64(torch.full(lead, _i64(s + (_GOLDEN & _MASK64)), dtype=torch.int64, device=device))
    k = splitmix64((k ^ _TAG) + _GOLDEN)
    return splitmix64((k ^ _i64(event)) + _GOLDEN)


def block_uniforms(shape, seed, *, event: int = 0, index: torch.Tensor | None = None, device=None) -> torch.Tensor:
    r"""The uniforms :math:`U_j \in [0, 1)` of the block stream, float64 (module docstring).

    Parameters
    ----------
    shape : tuple of int
        (n_blocks,) or (..., n_blocks); the last dim is the block index.
    seed : int >= 0, or int64 tensor broadcastable to ``shape[:-1]``
        One seed for all rows (every row draws the same stream), or one per
        row (e.g. per request). No row index enters the key, so a sequence's
        draws do not depend on the batch it is in.
    event : int >= 0
    index : int64 tensor of ``shape``, optional
        Block index of each slot (default: the slot index along the last dim).
    device : torch device, optional

    Returns
    -------
    U : float64 tensor of ``shape``, bit-identical to
        ``kvcert.reference.block_uniforms(n_blocks, seed, event=event)`` on every row.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("shape must have at least one dim (n_blocks,)")
    event = check_nonneg_int("event", event)
    if index is not None:
        index = check_tensor("index", index)
        if tuple(index.shape) != shape or index.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"index must be an int64 tensor of shape {shape}, got {index.dtype} "
                             f"of shape {tuple(index.shape)}")
        device = index.device
    if device is None and isinstance(seed, torch.Tensor):
        device = seed.device
    keys = _seed_keys(seed, shape[:-1], event, device)
    if index is None:
        ctr = torch.arange(1, shape[-1] + 1, dtype=torch.int64, device=device)
    else:
        ctr = index.to(torch.int64) + 1
    z = splitmix64(keys[..., None] + ctr * _GOLDEN)
    return _srl(z, 11).to(torch.float64) * (2.0 ** -53)


# ----------------------------------------------------------------------------- the design


def _lengths(lengths, b: int, n: int, device) -> torch.Tensor | None:
    if lengths is None:
        return None
    lengths = check_tensor("lengths", lengths)
    if lengths.dtype not in (torch.int64, torch.int32) or tuple(lengths.shape) != (b,):
        raise ValueError(f"lengths must be an int64 tensor of shape (b,) = ({b},), got {lengths.dtype} "
                         f"of shape {tuple(lengths.shape)}")
    if lengths.numel() and not bool(((lengths >= 1) & (lengths <= n)).all()):
        raise ValueError(f"lengths must lie in [1, n] = [1, {n}], got {lengths.tolist()}")
    return lengths.to(device=device, dtype=torch.int64)


def block_importance(importance: torch.Tensor, block_size: int, *, reduce: str = "mean", normalize: bool = True,
                     lengths: torch.Tensor | None = None) -> torch.Tensor:
    r"""Block importance (b, n_blocks) from token importance (b, ..., n), shared across heads.

    .. math::

        U_{hb} = \sum_{i\in b} u_{hi}, \qquad
        \tilde U_{hb} = U_{hb} / \textstyle\sum_{b'} U_{hb'} \ (\text{normalize}), \qquad
        u_b = \operatorname{mean}_h \tilde U_{hb} \ \ \text{or} \ \ \max_h \tilde U_{hb},

    with h running over every middle index (layers, KV heads) of ``importance``:
    stack the scorers' (b, h_kv, n) outputs of the layers sharing a block
    table as (b, layers, h_kv, n). Same formula as
    ``kvcert.reference.block_importance`` on each batch row; the reasons for
    the sum, the normalization and the two reductions are given there.

    Parameters
    ----------
    importance : floating tensor (b, n) or (b, ..., n), >= 0 and finite on the valid tokens
    block_size : int >= 1
    reduce : {"mean", "max"}
    normalize : bool
    lengths : int64 (b,), optional
        Valid tokens per row (right padding); tokens at ``>= lengths`` are ignored.

    Returns
    -------
    tensor (b, n_blocks), float64 for float64 input, float32 otherwise (computed in float64);
        0 on blocks past a row's length.
    """
    importance = check_tensor("importance", importance, floating=True)
    if importance.ndim < 2 or importance.shape[-1] == 0:
        raise ValueError(f"importance must have shape (b, n) or (b, ..., n) with n >= 1, "
                         f"got shape {tuple(importance.shape)}")
    if not isinstance(reduce, str) or reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {BLOCK_REDUCTIONS}, got {reduce!r}")
    bs = _check_block_size(block_size)
    b, n = importance.shape[0], importance.shape[-1]
    u = importance.reshape(b, -1, n).to(torch.float64)
    lens = _lengths(lengths, b, n, u.device)
    if lens is not None:
        u = u.masked_fill(~(torch.arange(n, device=u.device) < lens[:, None])[:, None, :], 0.0)
    if not bool(torch.isfinite(u).all()):
        raise ValueError("importance must be finite (found NaN or inf)")
    if u.numel() and bool((u < 0).any()):
        raise ValueError(f"importance must be >= 0, found min {float(u.min()):.3g}")
    nb = block_count(n, bs)
    u = torch.nn.functional.pad(u, (0, nb * bs - n))
    tot = u.reshape(b, u.shape[1], nb, bs).sum(-1)  # U_hb
    if normalize:
        mass = tot.sum(-1, keepdim=True)
        tot = torch.where(mass > 0, tot / torch.where(mass > 0, mass, 1.0), 0.0)
    return REDUCTIONS[reduce](tot).to(stat_dtype(importance))


#: the token solver's words -> the block design's (its error messages, reworded)
_BLOCK_WORDS = (("sinks=", "sink_blocks="), ("window=", "recent_blocks="), ("top=", "top_blocks="),
                ("<= n =", "<= n_blocks ="), ("< n =", "< n_blocks ="))


def block_inclusion_probabilities(importance: torch.Tensor, budget, *, block_size: int, sink_blocks: int = 1,
                                  recent_blocks: int = 2, top_blocks: int = 0, floor: float = 0.1,
                                  reduce: str = "mean", normalize: bool = True,
                                  lengths: torch.Tensor | None = None) -> torch.Tensor:
    r"""Inclusion probabilities pi_b (b, n_blocks) of the block design, one design per batch row.

    :func:`block_importance`, then the token design's capped PPS
    (:func:`kvcert.fast.inclusion_probabilities`) on the blocks: certainty set
    = the first ``sink_blocks``, the last ``recent_blocks`` (counted among a
    row's valid blocks) and the ``top_blocks`` most important others;
    :math:`\sum_b \pi_b` = ``budget`` (expected kept *blocks*).

    Parameters
    ----------
    importance : (b, n) or (b, ..., n)
    budget : float or tensor broadcastable to (b,)
        Expected kept blocks per row, ``|C| < budget <= n_blocks`` (of the row).
    block_size, sink_blocks, recent_blocks, top_blocks, floor, reduce, normalize
        As in ``kvcert.reference.block_inclusion_probabilities``.
    lengths : int64 (b,), optional
        Valid tokens per row; blocks past ``ceil(lengths / block_size)`` get pi = 0.

    Returns
    -------
    pi_blocks : (b, n_blocks), float64 for float64 input, float32 otherwise
        (computed in float64); equal to the reference on each row up to the
        summation order of the block totals (about 1e-15 relative).

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import block_inclusion_probabilities
    >>> pi = block_inclusion_probabilities(torch.rand(2, 3, 100, dtype=torch.float64), 4.0, block_size=16)
    >>> pi.shape, [round(float(s), 12) for s in pi.sum(-1)]
    (torch.Size([2, 7]), [4.0, 4.0])
    """
    for name, value in (("sink_blocks", sink_blocks), ("recent_blocks", recent_blocks), ("top_blocks", top_blocks)):
        check_nonneg_int(name, value)
    ub = block_importance(importance, block_size, reduce=reduce, normalize=normalize, lengths=lengths)
    valid = None
    if lengths is not None:
        nbv = -(-lengths.to(ub.device, torch.int64) // block_size)
        valid = torch.arange(ub.shape[-1], device=ub.device) < nbv[:, None]
    try:
        return inclusion_probabilities(ub if ub.dtype == torch.float64 else ub.double(), budget, sinks=sink_blocks,
                                       window=recent_blocks, top=top_blocks, floor=floor,
                                       valid=valid).to(ub.dtype)
    except (TypeError, ValueError) as err:  # the token solver's message, in block units
        msg = str(err)
        for token, block in _BLOCK_WORDS:
            msg = msg.replace(token, block)
        raise type(err)(f"{msg} (block design: budget and the certainty set count blocks of "
                        f"{block_size} tokens; leading index = batch row)") from None


def block_sample(pi_blocks: torch.Tensor, *, seed=None, event: int = 0, uniforms: torch.Tensor | None = None,
                 index: torch.Tensor | None = None) -> torch.Tensor:
    r"""Poisson sampling of blocks, batched: :math:`I_{rj} = [U_{rj} < \pi_{rj}]`.

    Parameters
    ----------
    pi_blocks : (n_blocks,) or (b, n_blocks), in [0, 1] (0 = padding block, never kept)
    seed : int or int64 tensor broadcastable to (b,)
        The stream of :func:`block_uniforms`.
    event : int >= 0
    uniforms : tensor of pi_blocks' shape, optional
        The uniforms themselves, in [0, 1) (instead of ``seed``).
    index : int64 tensor of pi_blocks' shape, optional
        Block index of each slot for the stream.

    Returns
    -------
    keep_blocks : bool tensor of pi_blocks' shape
    """
    pi = check_tensor("pi_blocks", pi_blocks, floating=True)
    if pi.ndim == 0:
        raise ValueError("pi_blocks must have shape (n_blocks,) or (b, n_blocks), got a scalar")
    check_probabilities("pi_blocks", pi)
    if (seed is None) == (uniforms is None):
        raise TypeError("pass exactly one of seed= or uniforms=")
    if uniforms is not None:
        u = check_tensor("uniforms", uniforms, floating=True)
        if u.shape != pi.shape:
            raise ValueError(f"uniforms must have shape {tuple(pi.shape)}, got {tuple(u.shape)}")
        if u.numel() and not bool(((u >= 0) & (u < 1)).all()):
            raise ValueError("uniforms must lie in [0, 1)")
        u = u.to(pi.device)
    else:
        u = block_uniforms(tuple(pi.shape), seed, event=event, index=index, device=pi.device)
    return u.to(torch.float64) < pi.to(torch.float64)


def expand_blocks(x: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """(..., n_blocks) per-block values -> (..., n) per-token values: token i gets ``x[..., i // block_size]``."""
    x = check_tensor("x", x)
    bs = _check_block_size(block_size)
    nb = block_count(n, bs)
    if x.ndim == 0 or x.shape[-1] != nb:
        raise ValueError(f"x must have shape (..., n_blocks) = (..., {nb}) for n = {n}, block_size = {bs}, "
                         f"got shape {tuple(x.shape)}")
    return x[..., torch.arange(n, device=x.device) // bs]


def block_keep(keep_blocks: torch.Tensor, block_size: int, n: int) -> torch.Tensor:
    """Token mask (..., n) of a block sample: token i is kept iff block ``i // block_size`` is."""
    keep_blocks = check_tensor("keep_blocks", keep_blocks)
    if keep_blocks.dtype != torch.bool:
        raise TypeError(f"keep_blocks must be a bool tensor, got dtype {keep_blocks.dtype}")
    return expand_blocks(keep_blocks, block_size, n)


def block_compact(keep_blocks: torch.Tensor, pi_blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                  block_size: int, lengths: torch.Tensor | None = None) -> CompressedCache:
    """Pack the kept blocks of every batch row (the same on every KV head) into a padded cache.

    One layer's keys/values (b, h_kv, n, d/dv); call it once per layer with the
    ``keep_blocks``/``pi_blocks`` (b, n_blocks) of the sequence. Every kept
    token gets pi = pi_b of its block; positions are the original token
    positions (block = position // block_size); tokens past ``lengths`` are
    never kept. See :func:`kvcert.fast.compact` for the layout.
    """
    keys = check_tensor("keys", keys, ndim=(4,), floating=True)
    values = check_tensor("values", values, ndim=(4,), floating=True)
    b, h, n, _ = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = ({b}, {h}, {n}, dv), got {tuple(values.shape)}")
    bs = _check_block_size(block_size)
    nb = block_count(n, bs)
    for name, x in (("keep_blocks", keep_blocks), ("pi_blocks", pi_blocks)):
        check_tensor(name, x)
        if tuple(x.shape) != (b, nb):
            raise ValueError(f"{name} must have shape (b, n_blocks) = ({b}, {nb}), got {tuple(x.shape)}")
    keep = block_keep(keep_blocks.to(keys.device), bs, n)
    pi_tok = expand_blocks(pi_blocks.to(keys.device), bs, n).to(stat_dtype(pi_blocks))
    lens = _lengths(lengths, b, n, keys.device)
    if lens is not None:
        inside = torch.arange(n, device=keys.device) < lens[:, None]
        keep = keep & inside
        pi_tok = pi_tok.masked_fill(~inside, 0.0)
    pos = torch.arange(n, device=keys.device).expand(b, h, n)
    return compact(keep[:, None, :].expand(b, h, n), keys, values, pi_tok[:, None, :].expand(b, h, n), pos)


def block_evict(keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor, budget, *, block_size: int,
                sink_blocks: int = 1, recent_blocks: int = 2, top_blocks: int = 0, floor: float = 0.1,
                reduce: str = "mean", normalize: bool = True, seed=0, event: int = 0,
                lengths: torch.Tensor | None = None, uniforms: torch.Tensor | None = None) -> CompressedCache:
    r"""One block eviction event: :func:`block_inclusion_probabilities`, :func:`block_sample`, :func:`block_compact`.

    ``importance`` (b, ..., n) may hold several layers' scores (their blocks
    are shared); ``keys``/``values`` are the layer to compact. For several
    layers, compute ``pi_blocks`` and ``keep_blocks`` once and call
    :func:`block_compact` per layer. ``uniforms`` (b, n_blocks) replaces the
    seeded stream.
    """
    pi_b = block_inclusion_probabilities(importance, budget, block_size=block_size, sink_blocks=sink_blocks,
                                         recent_blocks=recent_blocks, top_blocks=top_blocks, floor=floor,
                                         reduce=reduce, normalize=normalize, lengths=lengths)
    keep_b = block_sample(pi_b, seed=None if uniforms is not None else seed, event=event, uniforms=uniforms)
    return block_compact(keep_b, pi_b, keys, values, block_size=block_size, lengths=lengths)


# ----------------------------------------------------------------------------- the design as one object


@dataclass
class BlockDecision:
    """The block sample of one sequence (:meth:`BlockDesign.decide`).

    Attributes
    ----------
    n_tokens : int
        Prompt tokens of the sequence (padding excluded).
    importance : tensor (n_blocks,) float64
        Block importance u_b (:meth:`BlockDesign.block_importance` over every layer and KV head).
    pi : tensor (n_blocks,) float64
        Inclusion probabilities pi_b (1 on the certainty set).
    kept : bool tensor (n_blocks,)
        The sample: block b is kept iff U_b < pi_b, U from the block stream keyed by (seed, event).
    event : int
        :func:`prompt_event` of the prompt's token ids.
    """

    n_tokens: int
    importance: torch.Tensor
    pi: torch.Tensor
    kept: torch.Tensor
    event: int

    @property
    def evicted(self) -> list[int]:
        """Indices of the evicted blocks, ascending."""
        return [int(j) for j in torch.nonzero(~self.kept).flatten()]

    @property
    def log_pi(self) -> torch.Tensor:
        """(n_blocks,) log pi_b on the kept blocks, -inf on the evicted ones (the attention offset's negative)."""
        return torch.where(self.kept, torch.log(self.pi), torch.full_like(self.pi, float("-inf")))


@dataclass(frozen=True)
class BlockDesign:
    r"""The block design (docs/design.md section 7) as one object: fields and checks, budget, decision.

    A paged engine frees whole blocks, and one block table serves every layer:
    the prompt's tokens are grouped into blocks of ``block_size`` positions
    (from position 0; the last block may be partial) and one Poisson sample
    of blocks is drawn per sequence, for every layer and KV head:

    1. token scores per layer and KV head from the registered scorer
       ``scorer`` (:meth:`score`, ``kvcert.fast.SCORERS``; the last
       :meth:`queries_read` prompt queries);
    2. block importance (:meth:`block_importance`): negative scores shifted
       per head (:func:`kvcert.fast.nonnegative_importance`), block totals
       normalized per (layer, KV head), then the ``reduce`` of
       :data:`REDUCTIONS` over them;
    3. :math:`\pi_b` (:func:`block_inclusion_probabilities` on the block
       importance) with :math:`\sum_b \pi_b` = :meth:`budget` expected kept
       blocks and the certainty set ``sink_blocks`` + ``recent_blocks`` +
       ``top_blocks``;
    4. the sample :func:`block_sample` keyed by ``seed`` and the prompt's
       :func:`prompt_event`: the same prompt and seed keep the same blocks
       alone or in any batch, in the Hugging Face press and in the vLLM plugin.

    Parameters
    ----------
    compression_ratio : float in [0, 1)
        Fraction of the prompt's blocks evicted in expectation; 0 evicts nothing.
    block_size : int >= 1, or None
        Tokens per block; None: the paged engine's (given to :meth:`block_importance`).
    seed : int >= 0
        Key of the block stream (:func:`block_uniforms`) and of the ``random`` scorer.
    sink_blocks : int >= 0
        First blocks kept with certainty.
    recent_blocks : int >= 1
        Last blocks kept with certainty (the last, partial block, where decoding continues, is one).
    top_blocks : int >= 0
        Most important other blocks kept with certainty.
    floor : float in (0, 1]
        Defensive mixture weight.
    observation_window : int >= 1
        Prompt queries a window scorer reads.
    reduce : str
        A key of :data:`REDUCTIONS`.
    scorer : str
        A key of ``kvcert.fast.SCORERS`` (default ``"snapkv"``); its ``event`` is 0 (one decision per sequence).
    kernel_size : odd int >= 1
        The scorer's pooling width where it has one (default 1: no pooling).
    delta : float in (0, 1)
        Miscoverage of the certificates.
    kind : str
        Certificate kind, a key of ``kvcert.fast.CERTIFICATE_KINDS``.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import BlockDesign
    >>> design = BlockDesign(compression_ratio=0.5, block_size=32, seed=0)
    >>> design.budget(8), design.budget(2)
    (4.0, None)
    >>> d = design.decide(torch.rand(8, dtype=torch.float64), event=7)
    >>> d.kept.shape, bool(d.kept[0] and d.kept[-1])
    (torch.Size([8]), True)
    """

    compression_ratio: float = 0.0
    block_size: int | None = 16
    seed: int = 0
    sink_blocks: int = 1
    recent_blocks: int = 1
    top_blocks: int = 0
    floor: float = 0.1
    observation_window: int = 16
    reduce: str = "mean"
    scorer: str = "snapkv"
    kernel_size: int = 1
    delta: float = 0.05
    kind: str = "chebyshev"

    def __post_init__(self):
        if not isinstance(self.reduce, str) or self.reduce not in REDUCTIONS:
            raise ValueError(f"reduce must be one of {BLOCK_REDUCTIONS}, got {self.reduce!r}")
        set_fields(self, compression_ratio=check_real("compression_ratio", self.compression_ratio, 0.0, 1.0, hi_open=True),
             block_size=check_int("block_size", self.block_size, low=1, optional=True),
             seed=check_int("seed", self.seed), sink_blocks=check_int("sink_blocks", self.sink_blocks),
             recent_blocks=check_int("recent_blocks", self.recent_blocks, low=1),
             top_blocks=check_int("top_blocks", self.top_blocks),
             floor=check_real("floor", self.floor, 0.0, 1.0, lo_open=True),
             observation_window=check_int("observation_window", self.observation_window, low=1),
             scorer=check_scorer(self.scorer), kernel_size=check_kernel_size(self.kernel_size),
             delta=check_real("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True),
             kind=check_kind(self.kind))

    # -- the budget -----------------------------------------------------------------------------
    @property
    def compresses(self) -> bool:
        """Whether anything is ever evicted (ratio > 0)."""
        return self.compression_ratio > 0

    def _block_size(self, block_size) -> int:
        bs = self.block_size if block_size is None else block_size
        if bs is None:
            raise ValueError("block_size: this design takes the engine's block size; pass block_size=")
        return _check_block_size(bs)

    def n_blocks(self, n_tokens: int, block_size: int | None = None) -> int:
        """Blocks ``ceil(n_tokens / block_size)`` of a prompt (``block_size`` default: the design's)."""
        return block_count(n_tokens, self._block_size(block_size))

    def budget(self, n_blocks: int) -> float | None:
        """Expected kept blocks of a prompt of ``n_blocks`` blocks, or None when nothing is evicted (ratio 0, or
        the certainty set ``sink_blocks + recent_blocks + top_blocks`` fills the budget): :func:`block_budget`."""
        n_blocks = check_int("n_blocks", n_blocks)
        return block_budget(n_blocks, self.compression_ratio, self.sink_blocks + self.recent_blocks + self.top_blocks)

    # -- the importance -------------------------------------------------------------------------
    @property
    def query_need(self) -> str:
        """Which prompt queries the scorer reads: ``"window"``, ``"all"`` or ``"none"``."""
        return SCORERS[self.scorer].queries

    def queries_read(self, available: int, n: int) -> int:
        """How many of the last ``available`` prompt queries the scorer is given for a prompt of n tokens:
        the observation window, or all n for a scorer of every query when all n are available
        (``kvcert.fast.scorers.queries_read``)."""
        return queries_read(self.query_need, available, n, self.observation_window)

    def queries_needed(self, n: int) -> int:
        """Prompt queries the scorer reads for a prompt of n tokens."""
        return queries_needed(self.query_need, n, self.observation_window)

    @property
    def scorer_params(self) -> dict:
        """The scorer's hyperparameters this design sets (``kernel_size``, ``seed``); the others keep their
        registry defaults."""
        return scorer_params(self, SCORERS[self.scorer])

    def score(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None, *,
              scale: float | None = None, layer: int = 0) -> torch.Tensor:
        """One layer's token scores (b, h_kv, n): the scorer on keys/values (b, h_kv, n, d) and the last
        :meth:`queries_read` of the queries (b, h_q, w, d) given."""
        queries = check_tensor("queries", queries, ndim=(4,), floating=True)
        keys = check_tensor("keys", keys, ndim=(4,), floating=True)
        w = self.queries_read(queries.shape[2], keys.shape[2])
        return SCORERS[self.scorer](queries[:, :, -w:], keys, values, scale=scale, layer=layer, event=0,
                                    **self.scorer_params)

    def block_importance(self, scores: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
        """Block importance (b, n_blocks) float64 of token scores (b, ..., n) stacked over the layers and KV
        heads that share the block table: :func:`nonnegative_importance` per head, then :func:`block_importance`
        with this design's ``reduce``."""
        scores = check_tensor("scores", scores, floating=True)
        u = nonnegative_importance(scores.to(torch.float64))
        return block_importance(u, self._block_size(block_size), reduce=self.reduce)

    # -- the decision ---------------------------------------------------------------------------
    def inclusion_probabilities(self, scores: torch.Tensor, budget, *, block_size: int | None = None) -> torch.Tensor:
        """pi_b (b, n_blocks) float64 of token scores (b, ..., n), stacked over the layers and KV heads that share
        the block table, at ``budget`` expected kept blocks per row: :func:`nonnegative_importance` per head, then
        :func:`block_inclusion_probabilities` with this design's ``reduce``, certainty set (``sink_blocks``,
        ``recent_blocks``, ``top_blocks``) and ``floor``. The chain of :meth:`block_importance` and :meth:`decide`
        in one call, for a budget the caller sets (the paper's replay sets it by equal memory)."""
        scores = check_tensor("scores", scores, floating=True)
        return block_inclusion_probabilities(nonnegative_importance(scores.to(torch.float64)), budget,
                                             block_size=self._block_size(block_size), sink_blocks=self.sink_blocks,
                                             recent_blocks=self.recent_blocks, top_blocks=self.top_blocks,
                                             floor=self.floor, reduce=self.reduce)

    def decide(self, importance: torch.Tensor, *, event: int, n_tokens: int | None = None) -> BlockDecision | None:
        """Block importance -> pi_b -> sample for one sequence; None when nothing is evicted (:meth:`budget`).

        Parameters
        ----------
        importance : floating tensor (n_blocks,)
            Block importance (:meth:`block_importance`), finite and >= 0 (checked whatever the budget).
        event : int >= 0
            The prompt's :func:`prompt_event`.
        n_tokens : int, optional
            The prompt's tokens (recorded in the decision; default ``n_blocks * block_size``).

        Returns
        -------
        BlockDecision or None
            pi_b = :func:`block_inclusion_probabilities` (blocks as units, ``block_size=1``) at
            :meth:`budget`, kept = :func:`block_sample` with ``seed`` and ``event``.
        """
        ub = check_tensor("importance", importance, ndim=(1,), floating=True)
        if ub.shape[0] == 0:
            raise ValueError("importance must have shape (n_blocks,) with n_blocks >= 1, got shape (0,)")
        if not bool(torch.isfinite(ub).all()):
            raise ValueError("importance must be finite (found NaN or inf)")
        if bool((ub < 0).any()):
            raise ValueError(f"importance must be >= 0, found min {float(ub.min()):.3g}")
        event = check_nonneg_int("event", event)
        nb = ub.shape[0]
        if n_tokens is None:
            if self.block_size is None:
                raise ValueError("n_tokens: give the prompt's token count (this design has no block_size of its own)")
            n_tokens = nb * self.block_size
        budget = self.budget(nb)
        if budget is None:
            return None
        pi = block_inclusion_probabilities(ub[None], budget, block_size=1, sink_blocks=self.sink_blocks,
                                           recent_blocks=self.recent_blocks, top_blocks=self.top_blocks,
                                           floor=self.floor)[0]
        kept = block_sample(pi, seed=self.seed, event=event)
        return BlockDecision(int(n_tokens), ub, pi, kept, event)


# ----------------------------------------------------------------------------- the estimator


def _clusters(p: torch.Tensor, omp: torch.Tensor, present: torch.Tensor, labels: torch.Tensor, name: str,
              validate: bool = True):
    """Dense cluster ids (R, n) in [0, n) (n = padding), and (1 - pi_b), pi_b (log pi_b) per cluster (R, n).

    Sort the labels of each row (padding last), number the runs, scatter back: no loop over rows.
    ``validate`` checks that pi is equal on the sampled tokens of each block (one host read).
    """
    R, n = labels.shape
    big = torch.iinfo(torch.int64).max
    # sampling units: tokens with pi < 1 by block label; a token with pi = 1 on its own (never pooled
    # into a sampled block, e.g. a decode token appended after the eviction)
    own = labels.amax() + 1 + torch.arange(n, device=labels.device) if n else labels
    key = torch.where(present, torch.where(omp > 0, labels, own), big)
    sl, order = torch.sort(key, dim=-1, stable=True)
    new = torch.ones_like(sl, dtype=torch.bool)
    new[:, 1:] = sl[:, 1:] != sl[:, :-1]
    seg = torch.empty_like(order).scatter_(-1, order, new.cumsum(-1) - 1)
    seg = torch.where(present, seg, n)  # padding -> dump cluster n
    hi = torch.full((R, n + 1), float("-inf"), dtype=p.dtype, device=p.device)
    lo = torch.full((R, n + 1), float("inf"), dtype=p.dtype, device=p.device)
    hi.scatter_reduce_(-1, seg, p, "amax")
    lo.scatter_reduce_(-1, seg, p, "amin")
    used = hi[:, :n] > float("-inf")
    if validate and bool((used & (hi[:, :n] != lo[:, :n])).any()):
        raise ValueError(f"{name} must be equal on all sampled tokens (pi < 1) of a block (positions // block_size)")
    pib = torch.where(used, hi[:, :n], 0.0 if name == "log_pi" else 1.0)  # unused clusters: pi 1
    ompb = torch.zeros(R, n + 1, dtype=omp.dtype, device=omp.device).scatter_(-1, seg, omp)[:, :n]
    return seg, ompb.masked_fill(~used, 0.0), pib


def block_hajek_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor | None = None,
                          *, block_size: int, positions: torch.Tensor | None = None,
                          log_pi: torch.Tensor | None = None, scale: float | None = None,
                          per_coordinate: bool = True, bias: torch.Tensor | None = None,
                          query_positions: torch.Tensor | None = None, offset: int | None = None,
                          return_weights: bool = False, return_max_term: bool = False,
                          return_covariance: bool = False, return_tail_moment: bool = False,
                          chunk_bytes: int = 64 << 20, validate: bool = True) -> Estimate:
    r"""Hajek attention over a block sample and its cluster-sampling variance, batched, GQA.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \qquad a_i = \operatorname{softmax}_S(s_i - \log\pi_{b(i)}),
        \qquad \hat\Sigma = \sum_{b\in S} (1-\pi_b)\, z_b z_b^\top, \qquad
        z_b = \sum_{i\in b} a_i (v_i - \hat o),

        \mathrm{trace} = \sum_{b\in S} (1-\pi_b)\lVert z_b\rVert^2, \qquad
        \mathrm{tail\_moment} = \sum_{b\in S} (1-\pi_b)\, x_b^2,\ x_b = (1-\pi_b)\lVert z_b\rVert^2,

    ``n_eff`` = 1 / sum_b A_b^2 (A_b = sum_{i in b} a_i, the effective number
    of blocks; certain tokens count one by one), ``max_term`` = max over sampled tail blocks of
    max(1 - pi_b, pi_b) ||z_b||: the reference's ``block_hajek_attention`` on
    every (batch row, query head[, query]). Output, weights and lse are those
    of :func:`kvcert.fast.hajek_attention` (the token estimator with pi_b on
    every token of block b), which this function calls.

    Parameters
    ----------
    q, keys, values, pi, log_pi, scale, bias, query_positions, offset
        As in :func:`kvcert.fast.hajek_attention` (pi per token: pi_b of the
        token's block, equal on all its tokens with pi < 1 (checked); 0 on
        padding). A token with pi = 1 is a sampling unit of its own (a decode
        token appended to a sampled block stays certain).
    block_size : int >= 1
    positions : int64 (b, h_kv, n), optional
        Original token positions (-1 on padding), e.g. ``CompressedCache.positions``;
        a slot's block is ``positions // block_size``. Default: the slot index.
        Also the causal mask's key positions when ``query_positions``/``offset`` is given.
    per_coordinate, return_weights, return_max_term, return_covariance, return_tail_moment
        Which optional fields to fill (as in :func:`kvcert.fast.hajek_attention`).
    chunk_bytes : int
        Memory bound of the per-chunk (rows, g t, n, dv) temporaries of the block sums.
    validate : bool
        Check the values: those :func:`kvcert.fast.hajek_attention` checks (pi in [0, 1],
        no NaN in the output), pi = 0 on the padding slots (positions -1) and pi equal on the
        sampled tokens of each block. These are the only host reads of a call; ``False`` skips
        them, for a caller that checked the state when it was installed (a decode step over a
        cache layer whose eviction event built pi per block, :func:`block_compact`). The
        estimate is the same either way on valid input.

    Returns
    -------
    Estimate
        Statistics in float32 (float64 when an input is float64). Empty
        sample: output 0, lse -inf, variance/trace/tail_moment/max_term +inf,
        n_eff 0 (the token design's convention).

    Notes
    -----
    The block sums z_b are formed directly from :math:`v_i - \hat o` (no
    moment expansion, so no cancellation on offset values), one chunk of KV
    heads at a time: O(g t n dv) temporaries per KV head, bounded by
    ``chunk_bytes``. This is the oracle-matching torch path; a fused kernel
    would accumulate z_b per block tile in the same pass as the output.
    """
    bs = _check_block_size(block_size)
    causal = query_positions is not None or offset is not None
    est = hajek_attention(q, keys, values, pi, log_pi=log_pi, scale=scale, per_coordinate=False, bias=bias,
                          positions=positions if causal else None, query_positions=query_positions, offset=offset,
                          return_weights=True, validate=validate)
    b, h_kv, n, dv = values.shape
    g = q.shape[1] // h_kv
    t = 1 if q.ndim == 3 else q.shape[2]
    B, G = b * h_kv, g * t
    a = est.weights.reshape(B, G, n)
    v = values.to(a.dtype).reshape(B, n, dv)
    seg, ompb, pib = _block_units(pi, log_pi, positions, bs, a.dtype, (b, h_kv, n), v.device, validate)
    stats = _block_moments(a, v, seg, ompb, pib, per_coordinate, return_covariance, return_tail_moment,
                           return_max_term, chunk_bytes)
    return _block_estimate(est, (B, G), return_weights, *stats)


def _block_units(pi, log_pi, positions, bs: int, dt, shape, device, validate: bool):
    """The sampling units of each (batch row, KV head) row: :func:`_clusters` of the slots' blocks
    (``positions // block_size``, default the slot index), with pi_b (not log pi_b) per cluster; ``validate``
    checks pi = 0 on padding (positions -1) and pi equal on the sampled tokens of a block."""
    b, h_kv, n = shape
    B = b * h_kv
    if positions is not None:
        positions = check_tensor("positions", positions)
        if positions.dtype not in (torch.int64, torch.int32) or tuple(positions.shape) != (b, h_kv, n):
            raise ValueError(f"positions must be an int64 tensor of shape (b, h_kv, n) = ({b}, {h_kv}, {n}), "
                             f"got {positions.dtype} of shape {tuple(positions.shape)}")
        pos = positions.to(torch.int64).reshape(B, n)
    else:
        pos = torch.arange(n, device=device).expand(B, n)
    if pi is not None:
        p = pi.to(dt).reshape(B, n)
        present, omp, name = p > 0, 1.0 - p, "pi"
    else:
        p = log_pi.to(dt).reshape(B, n)
        present, omp, name = p > float("-inf"), -torch.expm1(p), "log_pi"
    if validate and bool((present & (pos < 0)).any()):
        raise ValueError(f"{name} must be 0 (log_pi -inf) on padding slots (positions == -1)")
    seg, ompb, pib = _clusters(p, omp, present, torch.div(pos, bs, rounding_mode="floor"), name, validate)
    if pi is None:
        pib = torch.exp(pib)
    return seg, ompb, pib


def _block_moments(a, v, seg, ompb, pib, per_coordinate, return_covariance, return_tail_moment, return_max_term,
                   chunk_bytes):
    """The cluster sums z_b = sum_{i in b} a_i (v_i - o_hat) and A_b = sum_{i in b} a_i, chunk by chunk of rows
    (at most ``chunk_bytes`` of temporaries), reduced to (trace, n_eff, variance, covariance, max_term,
    tail_moment) per (row, query row); the optional ones None when not asked for."""
    B, G, n = a.shape
    dv = v.shape[-1]
    dt = a.dtype
    o = torch.bmm(a, v)  # o_hat in the compute dtype (est.output is in the dtype of values)
    trace = torch.empty(B, G, dtype=dt, device=v.device)
    n_eff = torch.empty(B, G, dtype=dt, device=v.device)
    variance = torch.empty(B, G, dv, dtype=dt, device=v.device) if per_coordinate else None
    covariance = torch.empty(B, G, dv, dv, dtype=dt, device=v.device) if return_covariance else None
    max_term = torch.empty(B, G, dtype=dt, device=v.device) if return_max_term else None
    tail = torch.empty(B, G, dtype=dt, device=v.device) if return_tail_moment else None
    per_row = max(1, G * max(n, 1) * dv * torch.empty((), dtype=dt).element_size() * 3)
    hc = max(1, int(chunk_bytes) // per_row)
    for r0 in range(0, B, hc):
        r1 = min(B, r0 + hc)
        m = r1 - r0
        ar = a[r0:r1, :, :, None] * (v[r0:r1, None] - o[r0:r1, :, None])  # a_i (v_i - o_hat)
        idx = seg[r0:r1, None, :].expand(m, G, n)
        z = torch.zeros(m, G, n + 1, dv, dtype=dt, device=v.device)
        z.scatter_add_(2, idx[..., None].expand(m, G, n, dv), ar)
        z = z[:, :, :n]  # z_b per cluster
        A = torch.zeros(m, G, n + 1, dtype=dt, device=v.device).scatter_add_(2, idx, a[r0:r1])[:, :, :n]
        c = ompb[r0:r1, None, :]  # (m, 1, n): 1 - pi_b (0 on unused clusters)
        z2 = (z * z).sum(-1)
        trace[r0:r1] = (c * z2).sum(-1)
        n_eff[r0:r1] = (A * A).sum(-1).reciprocal()
        if variance is not None:
            variance[r0:r1] = (c[..., None] * z * z).sum(-2)
        if covariance is not None:
            cz = z * c[..., None]
            cov = torch.einsum("mgkd,mgke->mgde", cz, z)
            covariance[r0:r1] = 0.5 * (cov + cov.transpose(-1, -2))
        if tail is not None:
            x = c * z2
            tail[r0:r1] = (c * x * x).sum(-1)
        if max_term is not None:
            pb = pib[r0:r1, None, :]
            terms = torch.maximum(1.0 - pb, pb) * z2.sqrt()
            live = (c > 0) & (A > 0)
            max_term[r0:r1] = torch.where(live, terms, 0.0).amax(-1) if n else 0.0
    return trace, n_eff, variance, covariance, max_term, tail


def _block_estimate(est: Estimate, rows: tuple[int, int], return_weights: bool, trace, n_eff, variance, covariance,
                    max_term, tail) -> Estimate:
    """The Estimate: the token estimator's output, weights and lse, the cluster statistics in its shape
    (b, h_q[, t], ...), and the empty-sample convention on the rows that see no token."""
    empty = (est.lse == float("-inf")).reshape(rows)
    inf = float("inf")
    trace = trace.masked_fill(empty, inf)
    n_eff = n_eff.masked_fill(empty, 0.0)
    if variance is not None:
        variance = variance.masked_fill(empty[..., None], inf)
    if covariance is not None:
        covariance = covariance.masked_fill(empty[..., None, None], inf)
    if max_term is not None:
        max_term = max_term.masked_fill(empty, inf)
    if tail is not None:
        tail = tail.masked_fill(empty, inf)
    lead = tuple(est.lse.shape)  # (b, h_q[, t])
    shape = lambda x: None if x is None else x.reshape(*lead, *x.shape[2:])  # noqa: E731
    return Estimate(output=est.output, weights=est.weights if return_weights else None, variance=shape(variance),
                    trace=shape(trace), lse=est.lse, n_eff=shape(n_eff), max_term=shape(max_term),
                    covariance=shape(covariance), tail_moment=shape(tail))


# ----------------------------------------------------------------------------- the paged estimator

#: most bytes of K/V that :func:`paged_block_hajek_attention` gathers at once: rows are processed in chunks within
#: it, so the copy is still in the last-level cache when the two matrix products read it (a fraction of a server
#: L3; the sizes tried and their step times: docs/serving.md, measured by benchmarks/bench_masked_decode.py)
GATHER_BYTES = 8 << 20


@dataclass
class BlockChunk:
    """Rows ``rows`` of a :func:`paged_block_hajek_attention` batch whose kept blocks are gathered at once, and what
    does not depend on the layer: the blocks (c * m,), the scores' bias (c * m * h_kv, 1, bs) and 1 - pi_b (c, m)."""

    rows: slice
    block_ids: torch.Tensor
    bias: torch.Tensor
    one_minus_pi: torch.Tensor


def block_chunks(kv_cache: torch.Tensor, block_ids: torch.Tensor, log_pi: torch.Tensor) -> list[BlockChunk]:
    """:func:`paged_block_hajek_attention`'s row chunks (each gathering at most :data:`GATHER_BYTES`, or one row),
    computed once per step: every layer of a step has the same rows, blocks and pi, and a cache of the same
    geometry (arguments as :func:`paged_block_hajek_attention`'s)."""
    E = block_ids.shape[0]
    h, bs = kv_cache.shape[1], kv_cache.shape[2]
    row_bytes = kv_cache[0].numel() * kv_cache.element_size()  # one block, all KV heads, K and V
    kept = (log_pi[:, :, 0] > float("-inf")).sum(1).tolist()  # padding blocks come last in a row
    out, j = [], 0
    while j < E:
        c, m = 1, kept[j]
        while j + c < E and max(m, kept[j + c]) * (c + 1) * row_bytes <= GATHER_BYTES:
            m = max(m, kept[j + c])
            c += 1
        lp = log_pi[j : j + c, :m].float()
        bias = torch.where(lp > float("-inf"), -lp, float("-inf"))  # -log pi_b on the row's tokens, -inf elsewhere
        bias = bias[:, :, None, None, :].expand(c, m, h, 1, bs).reshape(c * m * h, 1, bs)
        omp = -torch.expm1(lp[:, :, 0])  # 1 - pi_b per block (0: certain; padding: 1 with z = 0)
        out.append(BlockChunk(slice(j, j + c), block_ids[j : j + c, :m].reshape(-1), bias, omp))
        j += c
    return out


def paged_block_hajek_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                                log_pi: torch.Tensor, *, scale: float | None = None,
                                chunks: list[BlockChunk] | None = None, validate: bool = True) -> Estimate:
    r"""Hajek decode attention over whole kept blocks of a paged cache, and the cluster-sampling trace, batched.

    The estimate and trace of :func:`block_hajek_attention` (the units are whole kept blocks, one decode query
    per row), read from a paged cache in vLLM's CPU ``vec`` layout (the layout of
    :func:`kvcert.kernels.cpu.paged_hajek_attention`), so the block sums are a reshape instead of a scatter:

    .. math::

        \hat o = \sum_{i\in S} a_i v_i,\quad a = \operatorname{softmax}_S(\tau q\cdot k_i - \log\pi_{b(i)}),
        \quad \mathrm{trace} = \sum_{b\in S}(1-\pi_b)\lVert z_b\rVert^2,\quad
        z_b = \sum_{i\in b} a_i (v_i - \hat o),

    with :math:`A_b = \sum_{i\in b} a_i`, computed as :math:`W_b - A_b\hat o`, :math:`W_b = \sum_{i\in b} a_i v_i`
    (K/V copied once by the gather; the scores are one ``baddbmm`` with the offset as its bias, the softmax is
    taken in the block layout without a transposed copy, and W_b is one batched matmul of the unnormalized
    weights, scaled afterwards; float32 cancellation is of order eps |v|, far below the radii reported). Slots
    that hold no token of the row (padding blocks, the tail of the last block) get weight exactly 0; vLLM
    allocates the cache with zeros, so they hold finite values (zeros or an earlier request's keys/values), which
    the zero weights cancel. Rows are processed in consecutive chunks (:func:`block_chunks`) whose gathered blocks
    fit in :data:`GATHER_BYTES`, each padded only to its own longest row; a row's result does not depend on its
    chunk or batch.

    Parameters
    ----------
    q : (E, h_q, d), one decode query per row
    kv_cache : (num_blocks, h_kv, block_size, 2 d), float32 or bfloat16: per (block, KV head) the keys transposed
        ``[d, block_size]``, then the values ``[block_size, d]``
    block_ids : int64 (E, M), kept physical blocks per row, padding last (any allocated block)
    log_pi : (E, M, block_size) float32, log pi_b on every valid token of a kept block (0 on certain blocks and
        decode tokens), -inf on padding and on slots past the sequence end; the first slot of a kept block holds a
        token
    scale : float, default 1/sqrt(d)
    chunks : list of BlockChunk, optional
        ``block_chunks(kv_cache, block_ids, log_pi)`` if already computed; any cache of the same shape and dtype
        gives the same chunks (the vLLM plugin computes them once per step and every layer reuses them)
    validate : bool
        Check shapes and that log_pi lies in [-inf, 0] (one host read); ``False`` skips it.

    Returns
    -------
    Estimate
        ``output`` (E, h_q, d) in the query's dtype; ``trace`` and ``lse`` (E, h_q) float32; no weights or
        per-coordinate variance.
    """
    if validate:
        _check_paged_blocks(q, kv_cache, block_ids, log_pi)
    scale = check_scale(scale, q.shape[-1])
    if chunks is None:
        chunks = block_chunks(kv_cache, block_ids, log_pi)
    parts = [_paged_chunk(q[ch.rows], kv_cache, ch, scale) for ch in chunks]
    if len(parts) == 1:
        o, tr, lse = parts[0]
    else:
        o, tr, lse = (torch.cat(x) for x in zip(*parts))
    return Estimate(output=o, weights=None, variance=None, trace=tr, lse=lse)


def _check_paged_blocks(q, kv_cache, block_ids, log_pi) -> None:
    """:func:`paged_block_hajek_attention`'s argument checks (ValueError naming the argument)."""
    if q.dim() != 3 or kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * q.shape[-1]:
        raise ValueError(f"q must be (E, h_q, d) and kv_cache (num_blocks, h_kv, block_size, 2 d), got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    E, M = block_ids.shape if block_ids.dim() == 2 else (-1, -1)
    if E != q.shape[0] or block_ids.dtype != torch.int64:
        raise ValueError(f"block_ids must be an int64 tensor (E, M) with E = {q.shape[0]}, got {block_ids.dtype} "
                         f"of shape {tuple(block_ids.shape)}")
    if tuple(log_pi.shape) != (E, M, kv_cache.shape[2]):
        raise ValueError(f"log_pi must be (E, M, block_size) = ({E}, {M}, {kv_cache.shape[2]}), got "
                         f"{tuple(log_pi.shape)}")
    if q.shape[1] % kv_cache.shape[1]:
        raise ValueError(f"h_q = {q.shape[1]} must be a multiple of h_kv = {kv_cache.shape[1]} (GQA)")
    if bool((torch.isnan(log_pi) | (log_pi > 0)).any()):
        raise ValueError("log_pi must lie in [-inf, 0] (-inf: the slot holds no token), found NaN or > 0")


_BUFFER = threading.local()


def _gather_buffer(flat: torch.Tensor, rows: int) -> torch.Tensor:
    """A (rows, flat.shape[1]) tensor over this thread's reused gather buffer (grown when too small).

    A fresh multi-MB tensor per layer would be page-faulted in again on every call (glibc returns large blocks to
    the system), which inside vLLM's worker costs more than the copy itself; the buffer holds one chunk
    (:data:`GATHER_BYTES`, or one row when a row is larger) and is overwritten by the next chunk, after the chunk's
    products have read it.
    """
    n = rows * flat.shape[1]
    buf = getattr(_BUFFER, "buf", None)
    if buf is None or buf.numel() < n or buf.dtype != flat.dtype:
        buf = _BUFFER.buf = torch.empty(max(n, GATHER_BYTES // flat.element_size()), dtype=flat.dtype)
    return buf[:n].view(rows, flat.shape[1])


def _paged_chunk(query, kv_cache, ch: BlockChunk, scale):
    """:func:`paged_block_hajek_attention` on the rows of one chunk, whose gathered blocks are copied at once:
    output, trace and lse."""
    E, h_q, d = query.shape
    nb, h, bs, two_d = kv_cache.shape
    M = ch.one_minus_pi.shape[1]
    g = h_q // h
    B = E * M * h  # one small matrix product per (row, block, KV head)
    flat = kv_cache.view(nb, h * bs * two_d)
    blk = torch.index_select(flat, 0, ch.block_ids, out=_gather_buffer(flat, E * M)).view(B, bs * two_d)
    kt = blk[:, : bs * d].view(B, d, bs)  # keys transposed
    v = blk[:, bs * d:].view(B, bs, d)
    qx = query.float().view(E, 1, h, g, d).expand(E, M, h, g, d).reshape(B, g, d)
    s = torch.baddbmm(ch.bias, qx, kt.float(), alpha=scale).view(E, M, h, g, bs)  # tau q.k - log pi_b
    mx = s.amax(dim=(1, 4), keepdim=True)  # the softmax's max over all kept tokens of the row
    p = s.sub_(mx).exp_()  # unnormalized weights; exactly 0 off the row's tokens
    total = p.sum(dim=(1, 4))  # (E, h, g)
    inv = total.reciprocal()  # 1 / sum over the kept tokens
    w = torch.bmm(p.view(B, g, bs), v.float()).view(E, M, h, g, d).mul_(inv[:, None, ..., None])  # W_b
    A = p.sum(-1).mul_(inv[:, None])  # (E, M, h, g): A_b
    o = w.sum(1)  # (E, h, g, d)
    z = w.sub_(A[..., None] * o[:, None])  # z_b = W_b - A_b o_hat
    trace = (ch.one_minus_pi[:, :, None, None] * (z * z).sum(-1)).sum(1)  # (E, h, g)
    lse = mx.view(E, h, g) + total.log()
    return o.reshape(E, h_q, d).to(query.dtype), trace.reshape(E, h_q), lse.reshape(E, h_q)
