"""H2O (Zhang et al. 2023) as a deterministic press: :class:`H2OPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class H2OPress(RegistryScorer, ScorerPress):
    r"""H2O (Zhang et al. 2023): keep the heavy hitters of the accumulated causal attention.

    .. math:: u_j = \frac{1}{g}\sum_{h} \sum_{t \ge j} \operatorname{softmax}_{i \le t}(\tau\, q_{ht}\cdot k_i)_j

    over every prefill query (:func:`kvcert.fast.h2o_scores`, GQA-averaged). A decode-time event
    (:class:`~kvcert.presses.DecodingPress`) has only the recent queries left (the last ``window``),
    and accumulates their attention (SnapKV without pooling).

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="h2o")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    """

    scorer_name = "h2o"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["h2o"]``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event)
