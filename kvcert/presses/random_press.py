"""Uniform random eviction without correction as a press: :class:`RandomPress`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import accept_kvpress_names
from .scorer import ScorerPress, RegistryScorer


@accept_kvpress_names
@dataclass
class RandomPress(RegistryScorer, ScorerPress):
    r"""Random eviction: keep a uniformly random subset, without correction (the contrast to PoissonPress).

    The score is :math:`u_i \sim U[0, 1)` (:func:`kvcert.fast.random_scores`), drawn from the stream
    keyed by (``seed``, layer, event). Unlike :class:`~kvcert.presses.PoissonPress`, the decode
    treats the kept tokens as certain (no -log pi offset), so its estimate is biased and its
    certificate says nothing.

    Deterministic: the sinks, the window and the highest scores are kept, exactly the budget;
    pi = 1 on the kept tokens, so the recorded certificates are 0 (uninformative: the
    impossibility the paper proves). ``PoissonPress(scorer="random")`` samples by the same score.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`~kvcert.presses.BasePress` (kvpress's ``n_sink`` is accepted for ``sinks``).
    seed : int >= 0
        Key of the random scores (default 0).
    """

    seed: int = 0

    scorer_name = "random"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep): the registered scorer
        ``kvcert.fast.SCORERS["random"]`` with this press's ``seed``."""
        return SCORERS[self.scorer_name](queries, keys, values, scale=scale, layer=layer, event=event,
                                         seed=self.seed)
