"""LagKV (Liang et al. 2025) as a deterministic press: :class:`LagKVPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class LagKVPress(RegistryScorer, ScorerPress):
    r"""LagKV (Liang et al. 2025): keep the tokens whose keys and values vary most within their chunk.

    Per chunk of ``lag_size`` tokens after the first ``n_sink``, the spread over the channels of
    each token's keys and values, min-max scaled by the next chunk, ranked within the chunk
    (:func:`kvcert.fast.scorers.lagkv_scores`); the first ``n_sink`` tokens and the last chunk score
    above every other. It reads no query, and reads the values.

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="lagkv")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress`.
    lag_size : int >= 1
        Chunk length L (default 128, kvpress's ``lag_size``).
    n_sink : int >= 1
        Tokens before the first chunk, scored as kept (default 4, kvpress's ``n_sink``; a field of
        its own here, not an alias of ``sinks``).
    """

    lag_size: int = 128
    n_sink: int = 4

    scorer_name = "lagkv"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["lagkv"]`` with this press's ``lag_size`` and ``n_sink``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event,
                                         lag_size=self.lag_size, n_sink=self.n_sink)
