"""KeyDiff (Park et al. 2025) as a deterministic press: :class:`KeyDiffPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class KeyDiffPress(RegistryScorer, ScorerPress):
    r"""KeyDiff (Park et al. 2025): keep the keys far from the mean key direction.

    The score is minus the cosine of each key with the mean normalized key of its head
    (:func:`kvcert.fast.scorers.keydiff_scores`, kvpress's ``KeyDiffPress.score``). It reads no
    query.

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="keydiff")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    """

    scorer_name = "keydiff"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["keydiff"]``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event)
