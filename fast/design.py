"""The sampling design, batched: inclusion probabilities and Poisson sampling.

Torch twin of ``kvcert.reference.design`` for importance tensors of shape
(b, h_kv, n) (or (h, n), or (n,)): every KV head of every batch row is an
independent design, solved in one vectorized pass (sort-based exact PPS
capping, no Python loop over heads). docs/design.md section 2 has the math.

Random stream (the default of :func:`poisson_sample`)
-----------------------------------------------------
A counter-based hash, so draws are replayable, independent per head and
identical on every device:

- ``mix(x)`` is the SplitMix64 finalizer on 64-bit words (Steele, Lea &
  Flood 2014): ``x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27;
  x *= 0x94D049BB133111EB; x ^= x >> 31`` (logical shifts, wrapping products).
- The stream key of one (seed, layer, batch row, KV head, event) is the chain
  ``k = mix(seed + G); k = mix(k ^ layer + G); k = mix(k ^ batch + G);
  k = mix(k ^ kv_head + G); k = mix(k ^ event + G)`` with
  ``G = 0x9E3779B97F4A7C15`` (the golden-ratio increment), each integer taken
  modulo 2**64.
- Token ``i`` (the slot index, or the original position when ``index=`` is
  given, as :func:`kvcert.fast.evict` does) draws
  ``U_i = (mix(k + (i + 1) G) >> 11) * 2**-53``, the ``i``-th output of a
  SplitMix64 generator whose state is the key: a float64 in [0, 1) with 53
  random bits.

It is a statistical (not cryptographic) generator: SplitMix64 passes BigCrush,
and distinct tuples give distinct keys with overwhelming probability. The
NumPy reference uses PCG64 streams instead; to get masks bit-identical to the
reference pass its uniforms (``uniforms=reference.design_uniforms(...)``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._checks import (check_int, check_kernel_size, check_nonneg_int, check_probabilities, check_real, check_tensor,
                      stat_dtype)

__all__ = [
    "edge_mask",
    "certainty_mask",
    "inclusion_probabilities",
    "budget_from_fraction",
    "DesignSizes",
    "design_sizes",
    "design_uniforms",
    "poisson_sample",
    "systematic_sample",
    "start_uniforms",
    "SAMPLINGS",
    "splitmix64",
    "nonnegative_importance",
]

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """Python int -> the int64 with the same low 64 bits (two's complement)."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN = _i64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio, SplitMix64's increment
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finalizer on int64 tensors (bit patterns of uint64 words).

    .. math:: z \\leftarrow (z \\oplus (z \\gg 30))\\,M_1,\\quad
              z \\leftarrow (z \\oplus (z \\gg 27))\\,M_2,\\quad
              z \\leftarrow z \\oplus (z \\gg 31) \\pmod{2^{64}}
    """
    if x.dtype != torch.int64:
        raise TypeError(f"x must be an int64 tensor, got dtype {x.dtype}")
    z = (x ^ _srl(x, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


def _leading(shape: tuple[int, ...]) -> tuple[int, int]:
    """(batch rows, kv heads) of a (..., h, n) / (h, n) / (n,) shape."""
    if len(shape) == 1:
        return 1, 1
    rows = 1
    for s in shape[:-2]:
        rows *= s
    return rows, shape[-2]


def _stream_keys(seed: int, layer: int, event: int, rows: int, heads: int, device, head_offset: int = 0) -> torch.Tensor:
    """(rows, heads) int64 stream keys of the chain documented in the module (KV heads head_offset ..
    head_offset + heads - 1)."""
    base = torch.tensor(_i64(seed + _GOLDEN), dtype=torch.int64, device=device)
    k = splitmix64(base)
    k = splitmix64((k ^ _i64(layer)) + _GOLDEN)
    b = torch.arange(rows, dtype=torch.int64, device=device)[:, None]
    k = splitmix64((k ^ b) + _GOLDEN)
    h = torch.arange(head_offset, head_offset + heads, dtype=torch.int64, device=device)[None, :]
    k = splitmix64((k ^ h) + _GOLDEN)
    return splitmix64((k ^ _i64(event)) + _GOLDEN)


def design_uniforms(shape, seed: int, *, layer: int = 0, event: int = 0, index: torch.Tensor | None = None,
                    device=None, row_streams: bool = True, head_offset: int = 0) -> torch.Tensor:
    r"""The uniforms :math:`U_i \in [0, 1)` of the default stream, float64.

    Parameters
    ----------
    shape : tuple of int
        (n,), (h, n) or (..., h, n): the leading dims before the last two are
        flattened into the batch-row counter, dim -2 is the KV head.
    seed, layer, event : int >= 0
    index : int64 tensor of ``shape``, optional
        Counter of each slot (default: the slot index along the last dim).
        :func:`kvcert.fast.evict` passes the original token positions, so a
        token's draw does not depend on where padding sits.
    device : torch device, optional
    row_streams : bool
        True (default): leading row r draws from the stream of batch row r.
        False: every leading row draws from the stream of batch row 0, so a
        row's draw does not depend on where it sits in a batch (the presses'
        rule: a sequence draws the same sample alone or in a batch).
    head_offset : int >= 0
        KV head index of dim -2's first head (default 0): the heads are
        ``head_offset .. head_offset + h - 1`` of the layer, so a slice of a
        layer's heads (a tensor-parallel rank's) draws what the whole layer
        draws there: ``design_uniforms((h1, n), s, head_offset=o) ==
        design_uniforms((h, n), s)[o : o + h1]``.

    Returns
    -------
    U : float64 tensor of ``shape``
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        raise ValueError("shape must have at least one dim (n,)")
    seed = check_nonneg_int("seed", seed)
    layer = check_nonneg_int("layer", layer)
    event = check_nonneg_int("event", event)
    head_offset = check_nonneg_int("head_offset", head_offset)
    rows, heads = _leading(shape)
    n = shape[-1]
    if index is not None:
        index = check_tensor("index", index)
        if tuple(index.shape) != shape:
            raise ValueError(f"index must have shape {shape}, got {tuple(index.shape)}")
        device = index.device
    keys = _stream_keys(seed, layer, event, rows if row_streams else 1, heads, device, head_offset)  # (rows or 1, heads)
    if not row_streams:
        keys = keys.expand(rows, heads)
    if index is None:
        ctr = torch.arange(1, n + 1, dtype=torch.int64, device=device)
        state = keys[:, :, None] + ctr * _GOLDEN
    else:
        ctr = index.reshape(rows, heads, n).to(torch.int64) + 1
        state = keys[:, :, None] + ctr * _GOLDEN
    z = splitmix64(state)
    u = _srl(z, 11).to(torch.float64) * (2.0 ** -53)
    return u.reshape(shape)


def poisson_sample(pi: torch.Tensor, *, seed: int | None = None, generator: torch.Generator | None = None,
                   uniforms: torch.Tensor | None = None, layer: int = 0, event: int = 0,
                   index: torch.Tensor | None = None) -> torch.Tensor:
    r"""Poisson sampling, batched: independent :math:`I_i \sim \mathrm{Bernoulli}(\pi_i)`.

    .. math:: I_i = [U_i < \pi_i], \qquad E|S| = \sum_i \pi_i, \qquad
              \mathrm{Var}|S| = \sum_i \pi_i (1 - \pi_i),

    so pi = 1 is always kept and pi = 0 (padding) never.

    Parameters
    ----------
    pi : tensor (b, h_kv, n), (h, n) or (n,)
        Inclusion probabilities in [0, 1].
    seed : int, optional
        Default stream (module docstring): the uniforms of
        :func:`design_uniforms` for (seed, layer, batch row, KV head, event).
    generator : torch.Generator, optional
        Draw ``torch.rand`` from it instead (not device-agnostic).
    uniforms : tensor of pi's shape, optional
        The uniforms themselves, in [0, 1): with
        ``reference.design_uniforms(n, seed, layer, head, event)`` per slice
        the mask equals ``reference.poisson_sample`` bit for bit.
    layer, event : int >= 0
        Stream coordinates (used with ``seed``).
    index : int64 tensor of pi's shape, optional
        Counter of each slot in the default stream (see :func:`design_uniforms`).

    Returns
    -------
    keep : bool tensor of pi's shape

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import poisson_sample
    >>> keep = poisson_sample(torch.tensor([[1.0, 0.0, 0.5, 0.5]]), seed=0, layer=3)
    >>> keep.shape, bool(keep[0, 0]), bool(keep[0, 1])
    (torch.Size([1, 4]), True, False)
    """
    pi = check_tensor("pi", pi, floating=True)
    if pi.ndim == 0:
        raise ValueError("pi must have shape (n,), (h, n) or (b, h, n), got a scalar")
    check_probabilities("pi", pi)
    given = sum(x is not None for x in (seed, generator, uniforms))
    if given != 1:
        raise TypeError("pass exactly one of seed=, generator= or uniforms=")
    if uniforms is not None:
        u = check_tensor("uniforms", uniforms, floating=True)
        if u.shape != pi.shape:
            raise ValueError(f"uniforms must have shape {tuple(pi.shape)}, got {tuple(u.shape)}")
        if u.numel() and not bool(((u >= 0) & (u < 1)).all()):
            raise ValueError("uniforms must lie in [0, 1)")
        u = u.to(pi.device)
    elif generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        u = torch.rand(pi.shape, generator=generator, dtype=torch.float64, device=generator.device).to(pi.device)
    else:
        u = design_uniforms(tuple(pi.shape), seed, layer=layer, event=event, index=index, device=pi.device)
    # compare in float64 so a float32 pi sees exactly the reference's comparison
    return u.to(torch.float64) < pi.to(torch.float64)


#: the sampling designs a token design draws with: ``"poisson"`` (independent draws, the paper's) or
#: ``"systematic"`` (randomized systematic, a fixed sample size; :func:`systematic_sample`)
SAMPLINGS = ("poisson", "systematic")


def start_uniforms(lead, seed: int, *, layer: int = 0, event: int = 0, device=None,
                   row_streams: bool = True, head_offset: int = 0) -> torch.Tensor:
    r"""The start :math:`s \in [0, 1)` of each head's systematic draw, float64 of shape ``lead`` (..., h):
    counter 0 of the head's stream (:func:`design_uniforms`; token i draws counter i + 1, so the start is
    independent of every token's uniform)."""
    lead = tuple(int(x) for x in lead)
    index = torch.full(lead + (1,), -1, dtype=torch.int64, device=device)
    return design_uniforms(lead + (1,), seed, layer=layer, event=event, index=index, device=device,
                           row_streams=row_streams, head_offset=head_offset)[..., 0]


def _systematic_keep(pi: torch.Tensor, u: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """:func:`systematic_sample`'s rule on checked float tensors: pi, u (..., n), start (...)."""
    pi = pi.to(torch.float64)
    certain = pi >= 1.0
    tail = pi.masked_fill(certain, 0.0)
    order = torch.argsort(u.to(torch.float64), dim=-1, stable=True)
    c = torch.cumsum(tail.gather(-1, order), dim=-1)
    prev = torch.cat([torch.zeros_like(c[..., :1]), c[..., :-1]], dim=-1)
    s = start.to(torch.float64)[..., None]
    hit = torch.floor(c - s) > torch.floor(prev - s)
    keep = torch.empty_like(hit).scatter_(-1, order, hit)
    return keep | certain


def systematic_sample(pi: torch.Tensor, *, seed: int | None = None, uniforms: torch.Tensor | None = None,
                      start: torch.Tensor | None = None, layer: int = 0, event: int = 0,
                      index: torch.Tensor | None = None, row_streams: bool = True) -> torch.Tensor:
    r"""Randomized systematic sampling, batched: a fixed-size design with exactly the inclusion probabilities pi.

    Per head, the certain tokens (pi = 1) are kept; the others, in the order of their uniforms
    :math:`U_i` (ascending, ties by slot), are laid end to end on [0, T) and the points
    :math:`s, s+1, \dots` pick them, s the head's start uniform:

    .. math:: I_i = [\lfloor c_i - s \rfloor > \lfloor c_{i-1} - s \rfloor], \qquad P(I_i = 1) = \pi_i,
              \qquad |S| \in \{\lfloor \textstyle\sum_i \pi_i \rfloor, \lceil \textstyle\sum_i \pi_i \rceil\},

    :math:`c_i` the running sum of the tail's pi in that order. The torch twin of
    ``kvcert.reference.systematic_sample`` (the math and references are there): with the reference's
    uniforms and start the mask is the same bit for bit.

    Parameters
    ----------
    pi : tensor (..., n)
        Inclusion probabilities in [0, 1].
    seed : int, optional
        Default stream: U from :func:`design_uniforms`, s from :func:`start_uniforms` (counter 0).
    uniforms, start : tensors (..., n) in [0, 1) and (...) in [0, 1), optional
        The randomness itself (give both, or ``seed``).
    layer, event, index, row_streams
        Stream coordinates, as :func:`design_uniforms`.

    Returns
    -------
    keep : bool tensor of pi's shape

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import systematic_sample
    >>> pi = torch.tensor([[1.0, 0.5, 0.25, 0.25, 0.5, 0.5]])
    >>> int(systematic_sample(pi, seed=0).sum()), int(systematic_sample(pi, seed=1).sum())
    (3, 3)
    """
    pi = check_tensor("pi", pi, floating=True)
    if pi.ndim == 0:
        raise ValueError("pi must have shape (..., n), got a scalar")
    check_probabilities("pi", pi)
    if (seed is None) == (uniforms is None):
        raise TypeError("pass exactly one of seed= or uniforms= (with start=)")
    if uniforms is not None:
        u = check_tensor("uniforms", uniforms, floating=True)
        if u.shape != pi.shape:
            raise ValueError(f"uniforms must have shape {tuple(pi.shape)}, got {tuple(u.shape)}")
        if start is None:
            raise TypeError("start= (one uniform per head, shape (...)) goes with uniforms=")
        s = check_tensor("start", start, floating=True)
        if tuple(s.shape) != tuple(pi.shape[:-1]):
            raise ValueError(f"start must have shape {tuple(pi.shape[:-1])}, got {tuple(s.shape)}")
        for name, x in (("uniforms", u), ("start", s)):
            if x.numel() and not bool(((x >= 0) & (x < 1)).all()):
                raise ValueError(f"{name} must lie in [0, 1)")
        u, s = u.to(pi.device), s.to(pi.device)
    else:
        if start is not None:
            raise TypeError("start= goes with uniforms= only")
        u = design_uniforms(tuple(pi.shape), seed, layer=layer, event=event, index=index, device=pi.device,
                            row_streams=row_streams)
        return draw_sample("systematic", pi, u, seed, layer=layer, event=event, row_streams=row_streams)
    return _systematic_keep(pi, u, s)


def draw_sample(sampling: str, pi: torch.Tensor, u: torch.Tensor, seed: int, *, layer: int, event: int,
                row_streams: bool, head_offset: int = 0) -> torch.Tensor:
    r"""The sample of a token design's pi from its stream's uniforms u (same shape): Poisson
    :math:`[U_i < \pi_i]` or systematic (:func:`systematic_sample`, the start from :func:`start_uniforms`).
    One place for every caller (:meth:`TokenDesign.decide`, :func:`kvcert.fast.evict`)."""
    if sampling == "poisson":
        return u.to(torch.float64) < pi.to(torch.float64)
    s = start_uniforms(tuple(pi.shape[:-1]), seed, layer=layer, event=event, device=pi.device,
                       row_streams=row_streams, head_offset=head_offset)
    return _systematic_keep(pi, u, s)


def check_sampling(value) -> str:
    """``sampling`` checked: one of :data:`SAMPLINGS`."""
    if not isinstance(value, str) or value not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {value!r}")
    return value


# ---------------------------------------------------------------------------
# inclusion probabilities
# ---------------------------------------------------------------------------


def _as_rows(name: str, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    if x.ndim == 0:
        raise ValueError(f"{name} must have shape (n,), (h, n) or (b, h, n), got a scalar")
    shape = tuple(x.shape)
    if shape[-1] == 0:
        raise ValueError(f"{name} is empty (n = 0): there is nothing to evict")
    return x.reshape(-1, shape[-1]), shape


def _valid_rows(valid, shape, device) -> torch.Tensor | None:
    if valid is None:
        return None
    valid = check_tensor("valid", valid)
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got dtype {valid.dtype}")
    if tuple(valid.shape) != shape:
        raise ValueError(f"valid must have the shape of importance {shape}, got {tuple(valid.shape)}")
    return valid.reshape(-1, shape[-1]).to(device)


def edge_mask(n: int, *, sinks: int = 4, window: int = 32, valid: torch.Tensor | None = None,
              device=None) -> torch.Tensor:
    """Bool mask of the first ``sinks`` and the last ``window`` tokens.

    Without ``valid``: shape (n,). With ``valid`` (..., n) bool (padding
    False): the first/last tokens are counted among the valid slots of each
    row, in slot order, and padding is never in the mask.
    """
    n = check_nonneg_int("n", n)
    sinks = check_nonneg_int("sinks", sinks)
    window = check_nonneg_int("window", window)
    if valid is None:
        i = torch.arange(n, device=device)
        return (i < sinks) | (i >= n - window)
    rank = valid.cumsum(-1) - 1  # rank among the valid slots
    nv = valid.sum(-1, keepdim=True)
    return valid & ((rank < sinks) | (rank >= nv - window))


def certainty_mask(importance: torch.Tensor, *, sinks: int = 4, window: int = 32, top: int = 0,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """Bool mask of the certainty set C, batched over the leading dims.

    C is the first ``sinks`` and last ``window`` (valid) tokens plus the ``top``
    highest-importance tokens among the others, ties to the lower index (the
    reference's stable order), so it equals ``reference.certainty_mask`` on
    every (valid part of a) slice. The importance must be finite and >= 0 on
    the valid slots (ValueError otherwise, as the reference's).
    """
    importance = check_tensor("importance", importance, floating=True)
    u, shape = _as_rows("importance", importance)
    top = check_nonneg_int("top", top)
    vr = _valid_rows(valid, shape, u.device)
    _check_importance(u if vr is None else u.masked_fill(~vr, 0.0))
    return certainty_rows(u, sinks, window, top, vr).reshape(shape)


def _check_importance(u: torch.Tensor) -> None:
    """Finite and >= 0 (the valid slots of ``u``; padding already zeroed)."""
    if not bool(torch.isfinite(u).all()):
        raise ValueError("importance must be finite (found NaN or inf)")
    if bool((u < 0).any()):
        raise ValueError(f"importance must be >= 0, found min {float(u.min()):.3g}")


def certainty_rows(u: torch.Tensor, sinks: int, window: int, top, vr: torch.Tensor | None) -> torch.Tensor:
    """(R, n) certainty mask; ``top`` an int or an int64 (R,) tensor of per-row counts."""
    n = u.shape[-1]
    certain = edge_mask(n, sinks=sinks, window=window, valid=vr, device=u.device)
    if vr is None:
        certain = certain.expand_as(u).clone()
    if isinstance(top, torch.Tensor) or top:
        free = ~certain if vr is None else vr & ~certain
        key = u.masked_fill(~free, float("-inf"))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        nfree = free.sum(-1, keepdim=True)
        cap = torch.minimum(nfree, top.reshape(-1, 1)) if isinstance(top, torch.Tensor) else nfree.clamp(max=top)
        rank_ok = torch.arange(n, device=u.device) < cap
        chosen = torch.zeros_like(certain).scatter_(-1, order, rank_ok)
        certain = certain | chosen
    return certain


def _budget_rows(budget, rows: int, lead: tuple[int, ...], device) -> torch.Tensor:
    if isinstance(budget, torch.Tensor):
        if not (budget.is_floating_point() or budget.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"budget must be a float or a real tensor, got dtype {budget.dtype}")
        try:
            b = torch.broadcast_to(budget.to(torch.float64, copy=False), lead)
        except RuntimeError:
            raise ValueError(
                f"budget must be a float or a tensor broadcastable to the leading dims {lead}, "
                f"got shape {tuple(budget.shape)}") from None
        return b.reshape(rows).to(device)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(f"budget must be a float or a tensor, got {type(budget).__name__}")
    return torch.full((rows,), float(budget), dtype=torch.float64, device=device)


def count_rows(name: str, x, rows: int, lead: tuple[int, ...], device):
    """A count >= 0 as an int, or as an int64 (rows,) tensor when given per head (an integer tensor
    broadcast to ``lead``): ``top`` here, ``budget`` of :func:`kvcert.fast.topk_evict`."""
    if not isinstance(x, torch.Tensor):
        return check_nonneg_int(name, x)
    if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an int or an integer tensor, got dtype {x.dtype}")
    try:
        t = torch.broadcast_to(x.to(torch.int64), lead)
    except RuntimeError:
        raise ValueError(f"{name} must be an int or a tensor broadcastable to the leading dims {lead}, "
                         f"got shape {tuple(x.shape)}") from None
    if t.numel() and bool((t < 0).any()):
        raise ValueError(f"{name} must be >= 0, found {int(t.min())}")
    return t.reshape(rows).to(device)


def value_at(x, i: int):
    """Row i's value of a per-row tensor, or the int itself (for messages)."""
    return int(x[i]) if isinstance(x, torch.Tensor) else x


def _first_bad(mask: torch.Tensor, lead: tuple[int, ...]) -> str:
    i = int(torch.nonzero(mask)[0, 0])
    if not lead:
        return ""
    idx = []
    for s in reversed(lead):
        idx.append(i % s)
        i //= s
    return f" (at leading index {tuple(reversed(idx))})"


def inclusion_probabilities(importance: torch.Tensor, budget, *, sinks: int = 4, window: int = 32,
                            top: int = 0, floor: float = 0.1, valid: torch.Tensor | None = None) -> torch.Tensor:
    r"""Inclusion probabilities of the Poisson eviction design, batched over heads.

    .. math::

        u'_i = (1-\alpha)\,\frac{u_i}{\sum_{j\in T} u_j} + \frac{\alpha}{|T|},
        \qquad \pi_i = \min(1, \lambda u'_i)\ (i \in T), \qquad \pi_i = 1\ (i \in C),

    with :math:`\lambda` solved per head so that :math:`\sum_i \pi_i = B`
    (exact PPS capping: capped tokens join C and :math:`\lambda` is re-solved).

    Parameters
    ----------
    importance : tensor (b, h_kv, n), (h, n) or (n,)
        Non-negative, finite importance (on the valid slots).
    budget : float or tensor broadcastable to the leading dims
        Expected kept count per head, ``|C| < budget <= n_valid``
        (``budget == n_valid`` keeps everything).
    sinks, window : int
        Certainty edges, see :func:`certainty_mask`.
    top : int, or int tensor broadcastable to the leading dims
        Most important free tokens kept with certainty, per head (a tensor
        gives each head its own count, e.g. one per batch row as (b, 1)).
    floor : float in (0, 1]
        Defensive mixture weight alpha (every tail token gets pi > 0).
    valid : bool tensor of importance's shape, optional
        False marks padding slots (a compressed cache): they are not part of
        the population and get pi = 0; sinks/window count valid slots only.

    Returns
    -------
    pi : tensor of importance's shape, float64 for float64 input, float32
        otherwise (always computed in float64); 0 exactly on padding.

    Notes
    -----
    Vectorized over heads, no Python loop over heads. The top set is exact
    top-k selection (``torch.topk`` for the threshold, ties to the lower
    index by a running count). The capping is the fixed point
    :math:`K \leftarrow K \cup \{i : \lambda_K w_i > 1\}`,
    :math:`\lambda_K = (m - |K|) / \sum_{T \setminus K} w` from K = {} (a
    few O(n) rounds for all heads at once; lambda only grows, so it stops at
    the unique solution); heads still changing after 12 rounds are solved
    exactly by the sort-based method (sort ascending, prefix sums = the
    descending suffix sums, smallest k with :math:`\lambda_k w_{(k+1)} \le 1`).
    Everything runs in float64: float64 input matches
    ``reference.inclusion_probabilities`` to about 1e-15 relative (summation
    order differs); float32 input is rounded once at the end. Errors are the
    reference's (a ValueError naming the first offending head).

    References
    ----------
    Sarndal, Swensson & Wretman (1992), Model Assisted Survey Sampling, sec. 3.6;
    arXiv 2607.21475.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import inclusion_probabilities
    >>> pi = inclusion_probabilities(torch.rand(2, 3, 100, dtype=torch.float64), 40.0, sinks=2, window=8)
    >>> pi.shape, bool(torch.allclose(pi.sum(-1), torch.full((2, 3), 40.0, dtype=torch.float64)))
    (torch.Size([2, 3, 100]), True)
    """
    importance = check_tensor("importance", importance)
    if not importance.is_floating_point():
        raise TypeError(f"importance must be a floating-point tensor, got dtype {importance.dtype}")
    out_dtype = stat_dtype(importance)
    u, shape = _as_rows("importance", importance)
    n = shape[-1]
    lead = shape[:-1]
    rows = u.shape[0]
    if n == 0:
        raise ValueError("importance is empty (n = 0): there is nothing to evict")
    floor = _check_floor(floor)
    vr = _valid_rows(valid, shape, u.device)
    top = count_rows("top", top, rows, lead, u.device)
    uv = u if vr is None else u.masked_fill(~vr, 0.0)
    _check_importance(uv)
    bud = _budget_rows(budget, rows, lead, u.device)
    if not bool(torch.isfinite(bud).all()):
        raise ValueError("budget must be finite")
    free, ntop, t, c = _design_sets(vr, top, bud, n, rows, lead, sinks, window, u.device)
    tail = _tail_mask(uv, free, top, ntop, n, rows, vr)
    pi = _tail_probabilities(uv, tail, t, c, bud, floor, rows, u.device)
    if vr is not None:
        pi = pi.masked_fill_(~vr, 0.0)
    return pi.to(out_dtype).reshape(shape)


def _check_floor(floor) -> float:
    """The defensive mixture weight as a float in (0, 1]."""
    if isinstance(floor, bool) or not isinstance(floor, numbers.Real):
        raise TypeError(f"floor must be a float, got {type(floor).__name__}")
    floor = float(floor)
    if not (0.0 < floor <= 1.0):
        raise ValueError(
            f"floor must be in (0, 1] (a zero floor gives pi = 0 to zero-importance "
            f"tokens, which breaks unbiasedness), got {floor}")
    return floor


def _design_sets(vr, top, bud, n: int, rows: int, lead: tuple[int, ...], sinks: int, window: int, dev):
    """Per row: the free slots (valid, off the edges), the top count, the tail size t and the certainty set size
    c = n_valid - t; a budget above n_valid, or not above c while there is a tail, is refused (naming the first
    offending head)."""
    nv = torch.full((rows,), n, dtype=torch.int64, device=dev) if vr is None else vr.sum(-1)
    edge = edge_mask(n, sinks=sinks, window=window, valid=vr, device=dev)  # (n,) or (R, n)
    free = ~edge if vr is None else vr & ~edge
    nfree = free.sum(-1).expand(rows) if vr is None else free.sum(-1)
    ntop = torch.minimum(nfree, top) if isinstance(top, torch.Tensor) else torch.clamp(nfree, max=top)
    t = nfree - ntop  # tail size
    c = nv - t  # certainty set size
    bad = bud > nv
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"budget must be <= n = {int(nv[i])}, got {float(bud[i])}{_first_bad(bad, lead)}")
    bad = (t == 0) & (bud < nv)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"budget = {float(bud[i])} < n = {int(nv[i])}, but every token is in the certainty set "
            f"(sinks={sinks}, window={window}, top={value_at(top, i)}){_first_bad(bad, lead)}")
    bad = (t > 0) & (bud <= c)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"budget must exceed the certainty set size |C| = {int(c[i])} "
            f"(sinks={sinks}, window={window}, top={value_at(top, i)}), got {float(bud[i])}{_first_bad(bad, lead)}")
    return free, ntop, t, c


def _tail_mask(uv, free, top, ntop, n: int, rows: int, vr) -> torch.Tensor:
    """The tail T (R, n): the free slots less the top set, the ``ntop`` largest free importances of each row,
    ties to the lower index (exact, no sort)."""
    if isinstance(top, torch.Tensor):
        kmax = min(int(top.max()), n) if top.numel() else 0
    else:
        kmax = min(top, n)
    if kmax <= 0:
        return free.expand(rows, n) if vr is None else free
    key = uv.masked_fill(~free, float("-inf"))
    if isinstance(top, torch.Tensor):  # per-row counts: the ntop-th largest (+inf where ntop = 0)
        vals = torch.topk(key, kmax, dim=-1, sorted=True).values
        thr = vals.gather(-1, (ntop - 1).clamp(min=0)[:, None])
        thr = torch.where(ntop[:, None] > 0, thr, float("inf"))
    else:
        thr = torch.topk(key, kmax, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    gt = key > thr
    eq = (key == thr) & free
    need = ntop[:, None] - gt.sum(-1, keepdim=True)
    return free & ~(gt | (eq & (eq.cumsum(-1) <= need)))


def _tail_probabilities(uv, tail, t, c, bud, floor: float, rows: int, dev) -> torch.Tensor:
    """pi (R, n) float64: the capped PPS probabilities of the defensive mixture on the tail at its expected kept
    count ``bud - c``, 1 on the certainty set and on every slot of a row that keeps its whole tail."""
    m = (bud - c)[:, None]  # expected kept count of the tail
    tf = t.to(torch.float64)[:, None].clamp(min=1.0)
    ut = uv.to(torch.float64).masked_fill(~tail, 0.0)
    mass = ut.sum(-1, keepdim=True)
    # w = (1 - alpha) u / mass + alpha / |T| on the tail (uniform share when the tail mass is 0)
    coef = torch.where(mass > 0, (1.0 - floor) / torch.where(mass > 0, mass, 1.0), 0.0)
    const = floor / tf + torch.where(mass > 0, 0.0, (1.0 - floor) / tf)
    w = (ut * coef + const).masked_fill_(~tail, 0.0)
    pi_tail, done = _capped_pps_iterative(w, tail, m)
    if not bool(done.all()):  # rare: a long capping cascade; solve those heads by sorting
        r = torch.nonzero(~done)[:, 0]
        pi_tail[r] = _capped_pps_sorted(w[r], t[r], m[r])
    pi = torch.where(tail, pi_tail, 1.0)  # certain (edges, top) -> 1
    full = ((t == 0) | (m[:, 0] >= t)) if rows else torch.zeros(0, dtype=torch.bool, device=dev)
    if bool(full.any()):
        pi = torch.where(full[:, None], 1.0, pi)
    return pi


def _capped_pps_iterative(w: torch.Tensor, tail: torch.Tensor, m: torch.Tensor, max_iter: int = 12):
    r"""pi = min(1, lam w) with sum pi = m on each row's tail, by the capping fixed point.

    :math:`K_0 = \emptyset`, :math:`\lambda_s = (m - |K_s|) / \sum_{i \in T \setminus K_s} w_i`,
    :math:`K_{s+1} = K_s \cup \{i : \lambda_s w_i > 1\}`: lambda grows with K, so the sets
    grow to the smallest consistent capped set, the unique solution the sorted method
    finds. Stops when no row changes; rows still changing after ``max_iter`` rounds
    are reported (``done`` False) and solved by :func:`_capped_pps_sorted`.
    """
    capped = torch.zeros_like(tail)
    lam = None
    done = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
    for _ in range(max_iter):
        rem = w.masked_fill(capped, 0.0).sum(-1, keepdim=True)
        lam = (m - capped.sum(-1, keepdim=True)) / torch.where(rem > 0, rem, 1.0)
        new = capped | (tail & (lam * w > 1.0))
        done = (new == capped).all(-1)
        capped = new
        if bool(done.all()):
            break
    return torch.where(capped, 1.0, (lam * w).clamp_(max=1.0)), done


def _capped_pps_sorted(w: torch.Tensor, t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The reference's sorted capping, vectorized over rows (w = 0 off the tail).

    Sort ascending (off-tail zeros first); the prefix sum at position j is the
    reference's suffix sum at descending index k = n - 1 - j (same
    smallest-first summation), lam_k = (m - k) / suffix_k, and the solution is
    the smallest k (largest j) with lam_k w_(k) <= 1.
    """
    n = w.shape[-1]
    wa, order = torch.sort(w, dim=-1)
    cs = wa.cumsum(-1)
    j = torch.arange(n, device=w.device)
    kk = (n - 1 - j).to(torch.float64)
    lam = (m - kk) / torch.where(cs > 0, cs, 1.0)
    ok = (lam * wa <= 1.0) & (m - kk > 0) & (j >= n - t[:, None])
    jstar = torch.where(ok, j, -1).amax(-1, keepdim=True)
    lam_star = lam.gather(-1, jstar.clamp(min=0))
    pi_s = torch.where(j > jstar, 1.0, (lam_star * wa).clamp_(max=1.0))
    return torch.empty_like(pi_s).scatter_(-1, order, pi_s)


def budget_from_fraction(n: int, fraction: float) -> float:
    """Expected kept count ``fraction * n`` (kvpress's compression_ratio is ``1 - fraction``)."""
    n = check_nonneg_int("n", n)
    fraction = float(fraction)
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return fraction * n


class DesignSizes(NamedTuple):
    """Sizes of the certainty set of one eviction event (see :func:`design_sizes`)."""

    budget: float
    sinks: int
    window: int
    top: int


def design_sizes(budget: float, *, sinks: int = 4, window: int = 32, top_fraction: float = 0.0,
                 randomized: bool = True) -> DesignSizes:
    r"""The certainty set that fits under a budget: sinks, recent window, top slice.

    The one sizing rule of every kvcert design (``PoissonPress``, the
    deterministic presses and paper_repro's replay all call it). With the
    largest certainty set the budget admits,

    .. math:: c = \lceil B \rceil - 1 \ \text{(randomized)}, \qquad c = \lfloor B \rfloor
              \ \text{(deterministic)},

    the recent window shrinks first, then the sinks, until
    :math:`\text{sinks} + \text{window} \le c`; a randomized design then
    takes :math:`\text{top} = \min(\lfloor \text{top\_fraction}\,(B - \text{sinks}
    - \text{window}) \rfloor,\ c - \text{sinks} - \text{window})` of the most
    important tokens with certainty and samples the rest of the budget
    (at least a fraction of one token's worth is always left to sampling,
    so every tail token has pi > 0). A deterministic design has no top
    slice (it keeps the top of the importance anyway).

    Parameters
    ----------
    budget : float >= 0
        Expected kept count B of the event (an exact count for a deterministic design).
    sinks, window : int >= 0
        Requested certainty edges: the first ``sinks`` and last ``window`` tokens.
    top_fraction : float in [0, 1)
        Share of the free budget :math:`B - \text{sinks} - \text{window}` kept
        with certainty by importance (randomized designs only).
    randomized : bool
        Poisson design (True) or deterministic top-k (False).

    Returns
    -------
    DesignSizes
        ``(budget, sinks, window, top)`` with the shrunken edges.

    Examples
    --------
    >>> from kvcert.fast import design_sizes
    >>> design_sizes(100.0, sinks=4, window=32, top_fraction=0.5)
    DesignSizes(budget=100.0, sinks=4, window=32, top=32)
    >>> design_sizes(20.0, sinks=4, window=32, top_fraction=0.5)  # the window shrinks first
    DesignSizes(budget=20.0, sinks=4, window=15, top=0)
    """
    budget = float(budget)
    if not (budget >= 0.0 and math.isfinite(budget)):
        raise ValueError(f"budget must be a finite float >= 0, got {budget}")
    sinks = check_nonneg_int("sinks", sinks)
    window = check_nonneg_int("window", window)
    top_fraction = float(top_fraction)
    if not 0.0 <= top_fraction < 1.0:
        raise ValueError(f"top_fraction must be in [0, 1), got {top_fraction}")
    cap = max(math.ceil(budget) - 1, 0) if randomized else int(budget)
    if sinks + window > cap:
        window = max(0, cap - sinks)
        sinks = min(sinks, cap)
    top = 0
    if randomized:
        top = max(min(int(math.floor(top_fraction * (budget - sinks - window))), cap - sinks - window), 0)
    return DesignSizes(budget, sinks, window, top)


def nonnegative_importance(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    r"""Scores -> importance >= 0 per head (0 on padding): a head with a negative score is shifted by its minimum.

    .. math:: u_{hi} = s_{hi} - \min(0, \min_{j\,\text{valid}} s_{hj}) \quad (i\ \text{valid}), \qquad u_{hi} = 0
              \ \text{(padding)},

    so a scorer whose score is negative (``knorm``: :math:`-\lVert k\rVert`, ``keydiff``) ranks the tokens as
    it does, and heads whose scores are all >= 0 are left as they are (bit for bit).

    Parameters
    ----------
    scores : floating tensor (..., n), finite on the valid slots
    valid : bool tensor of the same shape, optional (default: every slot valid)

    Returns
    -------
    tensor of ``scores``' shape and dtype

    Raises
    ------
    ValueError
        A NaN or infinite score on a valid slot.
    """
    scores = check_tensor("scores", scores, floating=True)
    if valid is None:
        valid = torch.ones_like(scores, dtype=torch.bool)
    u = scores.masked_fill(~valid, 0.0)
    if u.numel() and not bool(torch.isfinite(u).all()):
        raise ValueError("scores must be finite on the valid slots (found NaN or inf)")
    low = u.masked_fill(~valid, math.inf).amin(-1, keepdim=True)
    neg = low < 0
    if bool(neg.any()):
        u = torch.where(neg, u - low, u).masked_fill(~valid, 0.0)
    return u


#: names that moved to :mod:`kvcert.fast.token_design` (the design objects, on top of this module's streams,
#: samplers and pi solver); still importable from here
_MOVED = ("SKETCHES", "SKETCH_KINDS", "RECOMMENDED", "RECOMMENDED_FIELDS", "RECOMMENDED_SAMPLING", "TOKEN_DESIGNS",
          "TokenDecision", "TokenEvent", "TokenDesign", "default_design", "default_sampling", "preset_fields",
          "register_design", "resolve_sketch")


def __getattr__(name):
    if name in _MOVED:
        from . import token_design

        return getattr(token_design, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
