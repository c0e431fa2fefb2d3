"""K-norm (Devoto et al. 2024) as a deterministic press: :class:`KNormPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class KNormPress(RegistryScorer, ScorerPress):
    r"""K-norm (Devoto et al. 2024): keep the keys of small L2 norm.

    The score is :math:`u_i = -\lVert k_i \rVert_2` (:func:`kvcert.fast.knorm_scores`): small-norm
    keys draw attention. It reads no query.

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="knorm")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    """

    scorer_name = "knorm"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["knorm"]``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event)
