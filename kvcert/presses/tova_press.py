"""TOVA (Oren et al. 2024) as a deterministic press: :class:`TOVAPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class TOVAPress(RegistryScorer, ScorerPress):
    r"""TOVA (Oren et al. 2024): keep the tokens the last query attends to.

    .. math:: u_j = \frac{1}{g}\sum_h \operatorname{softmax}_i(\tau\, q_{h,\mathrm{last}}\cdot k_i)_j

    (:func:`kvcert.fast.tova_scores`): the last query of the observation window, averaged over
    the query heads of each KV head's group.

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="tova")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    observation_window : int >= 1
        The last prefill queries the score reads (default 32; kvpress's ``window_size``).
    head_pooling : {"group", "all"}
        ``"group"`` (default) averages over each KV head's g query heads; ``"all"`` over all query
        heads, so every KV head gets the same score (the TOVA paper, kvpress 0.5).
    """

    observation_window: int = 32
    head_pooling: str = "group"

    scorer_name = "tova"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["tova"]`` with this press's ``head_pooling``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event,
                                         head_pooling=self.head_pooling)
