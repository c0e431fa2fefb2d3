"""Decode-time compression around any token-design press: :class:`DecodingPress`
(kvpress's ``DecodingPress(base_press, compression_interval, target_size)``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast._checks import check_int
from .base import BasePress, Press
from .block import BlockPoissonPress


@dataclass
class DecodingPress(Press):
    """Decode-time compression around any press (kvpress's ``DecodingPress`` shape).

    The prefill event is the base press's own (it compresses if its
    ``compression_ratio``/``target_size`` say so); then every
    ``compression_interval`` new tokens each layer is compressed back to
    ``target_size`` by the base press's scorer and design, reading the last
    ``observation_window`` queries. Certificates are the base press's kind.

    Parameters
    ----------
    base_press : BasePress
        E.g. ``PoissonPress(seed=0)`` or ``SnapKVPress()``. A ``PoissonPress`` left at its default design
        (the recommended design, whose sketch is one event's) runs the paper's design here, kind
        ``chebyshev`` (a copy: ``self.base_press``; the caller's press is not changed); a sketch asked for
        by name is refused (repeated events would need several events' sketches merged).
    compression_interval : int >= 1
        New tokens (decoded, or prompt tokens of a streaming prefill) between events.
    target_size : int >= 1, optional
        Tokens per head kept after each event. Default: the base press's
        ``target_size``, else the budget of each row's prefill event.
    """

    base_press: BasePress = None
    compression_interval: int = 512
    target_size: int | None = None

    def __post_init__(self):
        if isinstance(self.base_press, BlockPoissonPress):
            raise TypeError("base_press: BlockPoissonPress decides its block sample once, after the prefill "
                            "(as the vLLM plugin); decode-time compression applies to the token designs "
                            "(PoissonPress, ScorerPress)")
        if not isinstance(self.base_press, BasePress):
            raise TypeError(f"base_press must be a kvcert press (e.g. kvcert.PoissonPress()), got "
                            f"{type(self.base_press).__name__}")
        if getattr(self.base_press, "_external", False):
            raise TypeError(f"base_press: a PoissonPress whose scorer is a kvpress press "
                            f"({type(self.base_press.scorer).__name__}) scores prefills only (its score reads a "
                            "layer's hidden states, which decode-time events do not keep); give DecodingPress a "
                            "kvcert scorer")
        if getattr(self.base_press, "recompute_threshold", None) is not None:
            raise ValueError("base_press: a PoissonPress(recompute_threshold=...) keeps the prefill's full cache "
                             "aside; decode-time events would evict tokens decoded since, which it reads (give "
                             "DecodingPress a base press without recompute_threshold)")
        if getattr(self.base_press, "target_error", None) is not None:
            raise ValueError("base_press: a PoissonPress(target_error=...) chooses its budgets at the prefill "
                             "event; DecodingPress compresses to a fixed target_size (give base_press a "
                             "compression_ratio or target_size)")
        if getattr(self.base_press, "sketch", None) is not None and \
                getattr(self.base_press, "_recommended_default", False):
            self.base_press = self.base_press.paper_design()
        if getattr(self.base_press, "sketch", None) is not None:
            raise ValueError("base_press: a sketched PoissonPress (sketch=...) evicts once per layer, at the "
                             "prefill; decode-time events would need the sketches of several events merged, which "
                             "kvcert does not do")
        self.compression_interval = check_int("compression_interval", self.compression_interval, low=1)
        self.target_size = check_int("target_size", self.target_size, low=1, optional=True)
        if self.target_size is None:
            self.target_size = self.base_press.target_size
        if self.target_size is None and not self.base_press.compresses:
            raise ValueError("target_size: give DecodingPress a target_size (or a base press that compresses "
                             "at the prefill, whose budget is then the target)")

    kind = property(lambda self: self.base_press.kind)
    delta = property(lambda self: self.base_press.delta)

    def queries_needed(self, n: int) -> int:
        return self.base_press.queries_needed(n)

    def prefill_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        layer.remember_queries(queries, self.base_press._observation_window())
        self.base_press.prefill_event(layer, layer_idx, queries, scale)

    def decode_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        layer.remember_queries(queries, self.base_press._observation_window())
        layer.tokens_since_event += queries.shape[2]
        if layer.tokens_since_event >= self.compression_interval:
            self.base_press._compress(layer, layer_idx, layer.queries, scale, prefill=False,
                                      target=self.target_size)
