"""Presses: KV-cache compression policies for transformers models, kvpress style.

A press is a dataclass of hyperparameters (validated in ``__post_init__``)
used as a context manager around a model::

    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    with press(model):
        out = model.generate(**inputs, max_new_tokens=16)
    press.certificates          # per step x layer x query head (kvcert.records.Certificates)

Inside the context the model runs the ``"kvcert"`` attention function and a
:class:`~kvcert.cache.KVCertLayer` cache (:mod:`kvcert.attention`: the
context owns a :class:`~kvcert.attention.Session` that the attention function
calls); each layer is compressed right after its prefill (the prefill itself
is exact attention over the full prompt). Decoding attends over the kept
tokens with the Hajek correction -log pi and records a certificate per step,
layer and query head.

The family, as kvpress users know it, one module each:

- ``base``: :class:`Press` (the context manager and the certificates) and
  :class:`BasePress` (the common fields and the eviction event of the token
  designs).
- ``scorer``: :class:`ScorerPress`, deterministic top-k eviction by a score.
  A new method writes only ``score(queries, keys, values, *, scale, layer,
  event)``. Each built-in scorer of ``kvcert.fast.SCORERS`` has a small class
  of its own (``snapkv_press``: :class:`SnapKVPress`; :class:`H2OPress`,
  :class:`TOVAPress`, :class:`KNormPress`, :class:`StreamingLLMPress`,
  :class:`RandomPress`, :class:`ExpectedAttentionPress`,
  :class:`KeyDiffPress`, :class:`LagKVPress`); a scorer registered later gets
  one made from its registry entry (:func:`make_scorer_press`). pi = 1 on
  the kept tokens and 0 on the evicted ones: their recorded certificates are
  identically 0, which is exactly the impossibility the paper proves (a
  deterministic policy observes nothing of what it evicted), not a statement
  of zero error.
- ``poisson``: :class:`PoissonPress`, the randomized design of the paper
  (every token has a known inclusion probability pi > 0, so the certificates
  are informative), with its importance from ``scorer=``: a registry name, a
  :class:`ScorerPress` instance, a kvpress score-based press (duck-typed on
  kvpress's ``score(module, hidden_states, keys, values, attentions,
  kwargs)``, ``kvpress_interop``; docs/kvpress.md) or a callable.
- ``block``: :class:`BlockPoissonPress`, the block design of the vLLM plugin
  (whole blocks, one sample per sequence), and :class:`BlockDecision`.
- ``decoding``: :class:`DecodingPress`, decode-time compression around any
  token-design press (kvpress's ``DecodingPress(base_press,
  compression_interval, target_size)``).

The budget at an event with n tokens held (per batch row, padding excluded):
``target_size`` if given (capped at n), else ``n * (1 - compression_ratio)``
(kvpress's convention: the ratio is the fraction removed). PoissonPress keeps
that many tokens *in expectation*; the deterministic presses keep
``int(n * (1 - compression_ratio))`` exactly. The certainty set that fits
under the budget is :func:`kvcert.fast.design_sizes` (the one sizing rule,
also used by paper_repro).
"""

from __future__ import annotations

from ..fast import SCORERS
from .base import KVPRESS_NAMES, SCORER_PARAMS, BasePress, Press  # noqa: F401 (SCORER_PARAMS: public, not in __all__)
from .block import BlockDecision, BlockPoissonPress
from .decoding import DecodingPress
from .expected_attention_press import ExpectedAttentionPress
from .h2o_press import H2OPress
from .keydiff_press import KeyDiffPress
from .knorm_press import KNormPress
from .lagkv_press import LagKVPress
from .poisson import SKETCHES, PoissonPress  # noqa: F401 (SKETCHES: the CLI's --sketch names)
from .random_press import RandomPress
from .scorer import ScorerPress, make_scorer_press
from .snapkv_press import SnapKVPress
from .streaming_llm_press import StreamingLLMPress
from .tova_press import TOVAPress

#: the built-in deterministic presses, by the registered scorer each one scores with
_BUILTIN = {cls.scorer_name: cls for cls in (StreamingLLMPress, H2OPress, SnapKVPress, TOVAPress, KNormPress,
                                             RandomPress, ExpectedAttentionPress, KeyDiffPress, LagKVPress)}

for _name, _scorer in SCORERS.items():  # a scorer registered before this import: its press, made now
    if _name not in _BUILTIN:
        globals()[_scorer.press] = make_scorer_press(_name)

#: scorers a PoissonPress can draw its importance from (kvcert.fast.SCORERS)
SCORER_NAMES = tuple(SCORERS)

#: name -> press class (the CLI's --press choices): PoissonPress, and one deterministic
#: press per registered scorer (the press of a scorer registered after this import joins
#: on first use, ``kvcert.presses.<Scorer.press>``)
PRESSES = {"poisson": PoissonPress, **{name: globals()[s.press] for name, s in SCORERS.items()}}

__all__ = [
    "Press",
    "BasePress",
    "ScorerPress",
    "PoissonPress",
    "BlockPoissonPress",
    "BlockDecision",
    "DecodingPress",
    "PRESSES",
    "SCORER_NAMES",
    "make_scorer_press",
    "KVPRESS_NAMES",
    *(s.press for s in SCORERS.values()),
]


def __getattr__(name: str):
    """``kvcert.presses.<Scorer.press>`` of a scorer registered after this package was imported
    (``kvcert.fast.register_scorer``): its press (:func:`make_scorer_press`), made on first use,
    then kept here and in :data:`PRESSES`."""
    for key, scorer in SCORERS.items():
        if scorer.press == name:
            cls = globals()[name] = PRESSES[key] = make_scorer_press(key)
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
