"""Token designs in a paged cache, by compaction (docs/design.md section 7).

A paged engine frees whole blocks, but the tokens a token design keeps need
not stay where they were. After a prompt of n tokens is processed, every
(layer, KV head) draws the token design (:meth:`kvcert.fast.TokenDesign.decide`);
the kept tokens of head h, in position order, are copied to the logical slots
0 .. C_h - 1 of the request's block table (slot j in logical block
``j // block_size`` at offset ``j % block_size``), where C_h is the head's kept
count. The compacted prompt occupies the first

.. math:: m = \\lceil \\max_{l, h} C_{l,h} / \\text{block\\_size} \\rceil

blocks (slots past a head's own count are padding, log pi = -inf); the
prompt's other *full* blocks, m .. floor(n / block_size) - 1, are freed; the
last, partly filled prompt block and the blocks of later tokens stay where
they are, those tokens at their logical positions (>= n) with pi = 1.
Positions stay logical: keys are cached after the rotary embedding, so a
moved key needs no re-rotation.

Memory, padding counted: the prompt holds ``ceil(n / bs) - freed`` of its
``ceil(n / bs)`` blocks, plus one log pi per compacted slot and head.

`compact_slots` computes the layout from a decision's ``keep`` and ``pi``
(any leading dims, e.g. (layers, h_kv, n)); ``kvcert.reference.compact_slots`` is
its NumPy oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_tensor

__all__ = ["Compaction", "compact_slots"]


@dataclass(frozen=True)
class Compaction:
    """The compacted layout of one prompt's token design (:func:`compact_slots`).

    Attributes
    ----------
    block_size : int
        The engine's block size (tokens per block).
    n_tokens : int
        Prompt tokens n the design was drawn over.
    counts : int64 tensor (..., h_kv)
        Kept tokens C per (layer, KV head).
    positions : int64 tensor (..., h_kv, m * block_size)
        Prompt position of the token in compacted slot j, in increasing order; -1 on padding slots.
    log_pi : float64 tensor (..., h_kv, m * block_size)
        log pi of the token in slot j (0 for a token kept with certainty); -inf on padding slots.
    """

    block_size: int
    n_tokens: int
    counts: torch.Tensor
    positions: torch.Tensor
    log_pi: torch.Tensor

    @property
    def m(self) -> int:
        """Blocks holding the compacted slots: ceil(max kept count / block_size)."""
        return self.positions.shape[-1] // self.block_size

    @property
    def prompt_blocks(self) -> int:
        """Blocks the uncompressed prompt occupies: ceil(n / block_size)."""
        return -(-self.n_tokens // self.block_size)

    @property
    def full_blocks(self) -> int:
        """Full prompt blocks: floor(n / block_size) (the partly filled last one is never freed)."""
        return self.n_tokens // self.block_size

    @property
    def freed_blocks(self) -> int:
        """Blocks returned to the pool: the full prompt blocks m .. full_blocks - 1 (0 when m >= full_blocks)."""
        return max(0, self.full_blocks - self.m)

    @property
    def held_blocks(self) -> int:
        """Blocks the prompt still holds: ceil(n / bs) - freed."""
        return self.prompt_blocks - self.freed_blocks

    def memory(self, head_dim: int | None = None, value_dim: int | None = None) -> float:
        """Fraction of the full prompt's K/V memory the compacted prompt holds, padding counted.

        ``held_blocks / prompt_blocks``; with ``head_dim`` (d) and ``value_dim`` (dv, default d) the log pi
        side buffer counts too: ``(held * bs * (d + dv) + m * bs) / (prompt_blocks * bs * (d + dv))``.
        """
        if head_dim is None:
            return self.held_blocks / self.prompt_blocks
        d = int(head_dim)
        dv = d if value_dim is None else int(value_dim)
        if d < 1 or dv < 1:
            raise ValueError(f"head_dim and value_dim must be >= 1, got {head_dim!r}, {value_dim!r}")
        bs = self.block_size
        return (self.held_blocks * bs * (d + dv) + self.m * bs) / (self.prompt_blocks * bs * (d + dv))

    def blocks(self, index) -> int:
        """Blocks holding the compacted slots of one leading index (e.g. a layer): ceil(max C / bs)."""
        c = int(self.counts[index].max()) if self.counts[index].numel() else 0
        return -(-c // self.block_size)


def compact_slots(keep: torch.Tensor, pi: torch.Tensor, block_size: int) -> Compaction:
    """The compacted layout of a token design's sample (module docstring).

    Parameters
    ----------
    keep : bool tensor (..., h_kv, n)
        The sample of every (layer, KV head) over the prompt's n tokens (:attr:`TokenDecision.keep`).
    pi : floating tensor (..., h_kv, n)
        Its inclusion probabilities in (0, 1] on kept tokens (:attr:`TokenDecision.pi`).
    block_size : int >= 1

    Returns
    -------
    Compaction
        Slot j < C of a head holds its j-th kept token (positions increasing); ``m * block_size`` slots
        per head, m = ceil(max C / block_size) (0 slots when nothing is kept anywhere).

    Raises
    ------
    ValueError
        keep not bool, shapes that differ, pi not in (0, 1] on a kept token, block_size < 1.
    """
    keep = check_tensor("keep", keep, ndim=None)
    if keep.dtype != torch.bool or keep.dim() < 2:
        raise ValueError(f"keep must be a bool tensor of shape (..., h_kv, n), got {keep.dtype} of shape "
                         f"{tuple(keep.shape)}")
    pi = check_tensor("pi", pi, ndim=None, floating=True)
    if tuple(pi.shape) != tuple(keep.shape):
        raise ValueError(f"pi must have keep's shape {tuple(keep.shape)}, got {tuple(pi.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    pk = pi[keep]
    if pk.numel() and not bool(((pk > 0) & (pk <= 1)).all()):
        raise ValueError("pi must lie in (0, 1] on every kept token")
    n = keep.shape[-1]
    counts = keep.sum(-1)
    cmax = int(counts.max()) if counts.numel() else 0
    slots = math.ceil(cmax / block_size) * block_size
    idx = torch.arange(n, device=keep.device).expand(keep.shape)
    order = torch.where(keep, idx, idx + n).sort(dim=-1).values[..., :slots]  # kept positions first, in order
    if slots > n:  # the last block's slots past n: padding
        order = torch.nn.functional.pad(order, (0, slots - n), value=n)
    valid = order < n
    positions = torch.where(valid, order, -1)
    src = torch.where(valid, order, 0)
    log_pi = torch.where(valid, torch.log(pi.to(torch.float64).gather(-1, src)), float("-inf"))
    return Compaction(block_size, n, counts, positions, log_pi)
