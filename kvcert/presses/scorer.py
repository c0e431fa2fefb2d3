"""Deterministic presses: :class:`ScorerPress` (top-k eviction by a score) and the press of a
scorer registered at run time (:func:`make_scorer_press`).

A new method subclasses :class:`ScorerPress` and writes only ``score``; the
built-in scorers of ``kvcert.fast.SCORERS`` have one small class each
(``snapkv_press.py``, ``h2o_press.py``, ...), whose fields are the scorer's
hyperparameters. pi = 1 on the kept tokens and 0 on the evicted ones: their
recorded certificates are identically 0, which is the impossibility the paper
proves (a deterministic policy observes nothing of what it evicted), not a
statement of zero error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..fast import SCORERS
from .base import SCORER_PARAMS, BasePress, accept_kvpress_names


@dataclass
class ScorerPress(BasePress):
    """Deterministic eviction by a score: keep the sinks, the window and the
    highest-scoring tokens, exactly the budget. pi = 1 on kept tokens, so the
    certificates are 0 (uninformative; the paper's impossibility).

    A new method subclasses it and writes only :meth:`score` (and, if it
    reads prefill queries, sets ``query_need`` to ``"window"`` or ``"all"``);
    an instance can also serve as ``PoissonPress(scorer=...)``.
    """

    #: which prefill queries :meth:`score` reads: "window" (the last observation_window), "all", "none"
    query_need = "window"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep); queries (b, h_q, w, d)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(queries, keys, values, *, scale, "
                                  "layer, event)")

    def _query_need(self) -> str:
        return self.query_need

    def _score(self, queries, keys, values, *, scale, layer, event):
        return self.score(queries, keys, values, scale=scale, layer=layer, event=event)

    def _evict(self, keys, values, importance, budget, *, sinks, window, top, valid, log_weights, positions,
               layer_idx, event, tilt=None, scale=None):
        from .. import fast

        # one kept count per row: its smallest budget, at most its smallest head
        k = torch.minimum(budget.amin(-1).floor().to(torch.int64), valid.sum(-1).amin(-1))
        return fast.topk_evict(keys, values, importance, k[:, None], sinks=sinks, window=window,
                               pi=log_weights.exp(), positions=positions)


def _scorer_params(press, scorer) -> dict:
    """The registered scorer's hyperparameters that ``press`` sets (fields of the same name; a
    kvpress-name property such as ``n_sink`` -> ``sinks`` is not one)."""
    own = {f.name for f in dataclasses.fields(press)}
    return {p: getattr(press, p) for p in scorer.params if p in own}


class RegistryScorer:
    """What a press of a ``kvcert.fast.SCORERS`` entry reads from the registry: ``query_need`` (the
    scorer's ``queries``) and, for a press made by :func:`make_scorer_press`, ``score`` (the scorer
    called with the press's fields of the same names). The built-in presses name their scorer in
    ``scorer_name`` and write their ``score`` out."""

    scorer_name = ""

    @property
    def query_need(self):
        return SCORERS[self.scorer_name].queries

    def score(self, queries, keys, values, *, scale, layer=0, event=0):
        scorer = SCORERS[self.scorer_name]
        return scorer(queries, keys, values, scale=scale, layer=layer, event=event,
                      **_scorer_params(self, scorer))


def make_scorer_press(name: str) -> type:
    """The deterministic press class of the registered scorer ``name``: a :class:`ScorerPress`
    whose fields are :class:`BasePress`'s, ``observation_window`` if the scorer reads a query
    window, and the scorer's ``params`` (with their registry defaults).

    The press of a scorer registered with ``kvcert.fast.register_scorer`` (the built-in scorers
    have classes of their own, e.g. :class:`~kvcert.presses.SnapKVPress`, with the same fields);
    ``kvcert.presses.<Scorer.press>`` and ``kvcert.<Scorer.press>`` make it on first use. Each call
    makes a new class."""
    scorer = SCORERS[name]
    names = (["observation_window"] if scorer.queries == "window" else []) + list(scorer.params)
    defaults = {"observation_window": SCORER_PARAMS["observation_window"][0], **scorer.params}
    fields = [(p, type(defaults[p]), dataclasses.field(default=defaults[p])) for p in names]
    doc = (f"Deterministic {scorer.summary} Keeps the sinks, the window and the top of the score "
           f"(scorer ``{name}``, :data:`kvcert.fast.SCORERS`); pi = 1 on kept tokens: certificates "
           "are 0 (uninformative).")
    cls = dataclasses.make_dataclass(scorer.press, fields, bases=(RegistryScorer, ScorerPress),
                                     namespace={"scorer_name": name, "__doc__": doc})
    cls.__module__ = __package__  # kvcert.presses, whose __getattr__ finds it again
    return accept_kvpress_names(cls)
