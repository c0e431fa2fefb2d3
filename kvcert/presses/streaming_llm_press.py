"""StreamingLLM (Xiao et al. 2024) as a deterministic press: :class:`StreamingLLMPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class StreamingLLMPress(RegistryScorer, ScorerPress):
    r"""StreamingLLM (Xiao et al. 2024): keep the attention sinks and the most recent tokens.

    The score is recency, :math:`u_i = i` (:func:`kvcert.fast.streaming_llm_scores`), so after the
    sinks and the window the most recent tokens fill the budget. It reads no query.

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="streaming_llm")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    """

    scorer_name = "streaming_llm"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["streaming_llm"]``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event)
