"""SnapKV mixed with expected attention as a deterministic press: :class:`ExpectedAttentionPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class ExpectedAttentionPress(RegistryScorer, ScorerPress):
    r"""Expected attention: SnapKV mixed with the attention expected under a Gaussian fit of the window's queries.

    .. math:: u_i = \tfrac12\, \frac{\mathrm{snapkv}_i}{\sum_j \mathrm{snapkv}_j}
              + \tfrac12 \operatorname{softmax}_i\Bigl(\log \mathbb{E}_{q \sim N(\mu, C)} e^{\tau q\cdot k_i}\Bigr),

    :math:`N(\mu, C)` fitted to the queries of the observation window of each KV head's group
    (:func:`kvcert.fast.expected_attention_scores` with ``mix=0.5``).

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="expected")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    observation_window : int >= 1
        The last prefill queries the score reads (default 32; kvpress's ``window_size``).
    kernel_size : odd int >= 1
        Width of SnapKV's average pool (default 7).
    """

    observation_window: int = 32
    kernel_size: int = 7

    scorer_name = "expected"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["expected"]`` with this press's ``kernel_size``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event,
                                         kernel_size=self.kernel_size)
