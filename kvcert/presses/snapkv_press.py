"""SnapKV (Li et al. 2024) as a deterministic press: :class:`SnapKVPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class SnapKVPress(RegistryScorer, ScorerPress):
    r"""SnapKV (Li et al. 2024): keep the tokens the last ``observation_window`` queries attend to.

    .. math:: u_j = \frac{1}{g}\sum_{h \in \text{group}} \sum_{t=1}^{w}
              \operatorname{softmax}_{i \le n-w+t}(\tau\, q_{ht}\cdot k_i)_j,

    w = ``observation_window``, then an average pool of width ``kernel_size``
    (:func:`kvcert.fast.snapkv_scores`).

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="snapkv")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    observation_window : int >= 1
        The last prefill queries the score reads (default 32; kvpress's ``window_size``).
    kernel_size : odd int >= 1
        Width of the average pool (default 7).
    pooling : {"replicate", "kvpress"}
        ``"replicate"`` (default): the formula above over all tokens, the pool's edges padded with
        the edge values; ``"kvpress"``: kvpress 0.5's score (window mean, pooled before the window
        with zero padding, window tokens scored above every other).
    """

    observation_window: int = 32
    kernel_size: int = 7
    pooling: str = "replicate"

    scorer_name = "snapkv"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["snapkv"]`` with this press's ``kernel_size`` and ``pooling``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event,
                                         kernel_size=self.kernel_size, pooling=self.pooling)
