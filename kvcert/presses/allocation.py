r"""Budgets per (layer, KV head) from the certificate's predicted variance: ``PoissonPress(allocation="neyman")``.

The paper's design gives every (layer, KV head) of a sequence the same budget B (``compression_ratio`` or
``target_size``). The allocation spends the same memory, ``round(B)`` tokens times the number of heads, where
the design's predicted variance is (Neyman-style, :mod:`kvcert.fast.allocation`): per batch row, every
compressible layer's window queries give each KV head's predicted relative variance :math:`F_h(B)` on a grid of
budgets (:func:`kvcert.fast.window_variance_terms`, :func:`kvcert.fast.allocation.objective_tables`), and
:func:`kvcert.fast.allocation.allocate_at_uniform_memory` splits the total with a floor per head of
:math:`\max(\text{sinks} + \text{window} + 1, \lceil \phi B \rceil)`. Each head is then sampled at its budget by
the token design's event (:meth:`kvcert.fast.TokenDesign.event` with ``budget=``).

One allocation covers every layer, so the press holds each layer's prefill (its tokens and its last
prefill queries) until the last compressible layer's prefill event, then runs every held layer's event. The
prefill attention is exact, so a layer's event reads nothing the layers before it changed: holding them changes
no event's inputs, only the peak memory of the prefill (the whole uncompressed cache, as a shared
:func:`kvcert.prefill` holds it). A row whose uniform budget cannot hold the certainty set of every head
(``round(B) < sinks + window + 1``) runs the uniform design.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from ..fast import nonnegative_importance, window_variance_terms
from ..fast.allocation import Allocation, allocate_at_uniform_memory, objective_tables
from ..fast.target import TARGET_KINDS
from .base import real_slots, row_tokens

__all__ = ["ALLOCATIONS", "RowAllocation", "check_allocation", "hold_prefill", "head_budgets"]

#: ``PoissonPress(allocation=...)``: the rules that split the uniform budget's memory over (layer, KV head)
ALLOCATIONS = ("neyman",)


class RowAllocation(NamedTuple):
    """One batch row's allocation (``PoissonPress.allocations[row]``).

    ``n``: the row's prompt tokens; ``uniform``: the uniform budget B per head; ``total``: the kept tokens
    allocated at most, round(B) x heads; ``floor``: the smallest budget a head takes below n; ``layers``: the
    model indices of the compressible layers, the rows of ``budgets``; ``budgets``: int64 (layers, h_kv), each
    head's expected kept count; ``allocation``: the solver's :class:`kvcert.fast.allocation.Allocation` over the
    heads, layer-major."""

    n: int
    uniform: float
    total: int
    floor: int
    layers: tuple
    budgets: torch.Tensor
    allocation: Allocation


def check_allocation(press) -> None:
    """The allocation fields of a ``PoissonPress``, checked (ValueError naming the field): ``allocation`` one
    of :data:`ALLOCATIONS` or None, ``allocation_floor`` in [0, 1], ``allocation_step`` an int >= 1; with an
    allocation, a uniform budget (``compression_ratio`` > 0 or ``target_size``) and the paper's design (no
    sketch: the tables predict its variance; ``sketch="auto"`` resolves to it), a kind of
    ``kvcert.fast.TARGET_KINDS``, ``kv_bits`` 16 and no ``target_error``."""
    a = press.allocation
    if a is not None and (not isinstance(a, str) or a not in ALLOCATIONS):
        raise ValueError(f"allocation must be None or one of {ALLOCATIONS}, got {a!r}")
    f = press.allocation_floor
    if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0.0 <= float(f) <= 1.0:
        raise ValueError(f"allocation_floor must be a number in [0, 1] (a share of the uniform budget), got {f!r}")
    s = press.allocation_step
    if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
        raise ValueError(f"allocation_step must be an int >= 1 (the spacing of the budgets compared), got {s!r}")
    press.allocation_floor, press.allocation_step = float(f), int(s)
    if a is None:
        return
    if press.target_error is not None:
        raise ValueError("allocation: an allocation spends the memory of a uniform budget; give compression_ratio "
                         f"or target_size, not target_error (got target_error={press.target_error!r})")
    if not press.compression_ratio and press.target_size is None:
        raise ValueError("allocation: give the uniform budget whose memory it spends, compression_ratio > 0 or "
                         "target_size")
    if isinstance(press.sketch, str) and press.sketch == "auto":
        press.sketch = None  # the paper's design: the tables predict its variance
    elif press.sketch is not None:
        raise ValueError(f"sketch: an allocation predicts the paper design's variance (no sketch); use sketch=None, "
                         f"got sketch={press.sketch!r}")
    if press.kind is not None and press.kind not in TARGET_KINDS:
        raise ValueError(f"kind: an allocation compares radii that are functions of the variance trace, one of "
                         f"{TARGET_KINDS}; got {press.kind!r}")
    if press.kv_bits != 16:
        raise ValueError(f"kv_bits: an allocation predicts the 16-bit design's variance; use kv_bits=16 (got "
                         f"kv_bits={press.kv_bits})")


def hold_prefill(press, layer, layer_idx: int, queries: torch.Tensor, scale: float, *, compressed: tuple,
                 importance) -> list:
    """The prefill event of one layer under an allocation: hold the layer, and return ``[]``; at the last
    compressible layer (``compressed``: their model indices, in order), allocate every row's budgets
    (``press.allocations``) and return the held layers, ``[(layer, layer_idx, queries, scale)]`` in order, whose
    events the press then runs. ``importance`` is the press's scorer on one row's real tokens,
    ``fn(queries, keys, values, *, scale, layer_idx, event, row, tokens) -> (1, h_kv, n)``."""
    if layer_idx == compressed[0]:
        press.__dict__["held_prefill"] = []
    held = press.__dict__.setdefault("held_prefill", [])
    need = min(queries.shape[2], press.queries_needed(layer.valid.shape[-1]))
    held.append((layer, layer_idx, queries[:, :, queries.shape[2] - need:], scale))
    if layer_idx != compressed[-1]:
        return []
    press.__dict__["held_prefill"] = []
    press.allocations = {r: _allocate_row(press, held, r, importance) for r in range(layer.keys.shape[0])}
    return held


def head_budgets(press, layer_idx: int, row: int) -> torch.Tensor | None:
    """The float64 (h_kv,) budgets the allocation gave (layer, row), or None (the row runs the uniform design)."""
    alloc = getattr(press, "allocations", {}).get(row)
    if alloc is None or layer_idx not in alloc.layers:
        return None
    return alloc.budgets[alloc.layers.index(layer_idx)].to(torch.float64)


def _allocate_row(press, held, r: int, importance) -> RowAllocation | None:
    """Row r's allocation over the held layers (module docstring), or None when its uniform budget cannot hold
    every head's certainty set."""
    design = press.design
    _, n = real_slots(held[0][0], r)
    uniform = design.budget(n)
    low = design.sinks + design.window + 1
    if n <= low or round(uniform) < low or uniform >= n:
        return None
    tables = []
    for layer, idx, q, scale in held:
        k, v, q_r, tokens = _row_inputs(layer, r, q)
        u = importance(q_r, k, v, scale=scale, layer_idx=idx, event=layer.events, row=r, tokens=tokens)
        t, o2 = window_variance_terms(q_r[:, :, -design.observation_window:], k, v, scale=scale)
        tables += objective_tables(t[0], o2[0], nonnegative_importance(u[0].to(torch.float64)), delta=design.delta,
                                   kind=design.kind, sinks=design.sinks, window=design.window,
                                   top_fraction=design.top_fraction, floor=design.floor, step=press.allocation_step)
    chosen = allocate_at_uniform_memory(tables, uniform, floor_share=press.allocation_floor, sinks=design.sinks,
                                        window=design.window)
    h_kv = held[0][0].keys.shape[1]
    budgets = chosen.allocation.budget.reshape(len(held), h_kv)
    return RowAllocation(n, float(uniform), chosen.total, chosen.floor, tuple(i for _, i, _, _ in held), budgets,
                         chosen.allocation)


def _row_inputs(layer, r: int, queries):
    """Row r's keys, values and prefill queries at its real slots, and the slots (None: every slot)."""
    idx, _ = real_slots(layer, r)
    k, v, q_r = row_tokens(layer, r, idx, queries)
    return k, v, q_r, idx
