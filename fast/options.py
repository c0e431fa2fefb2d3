"""The checks of the design objects' shared fields (:class:`kvcert.fast.TokenDesign`,
:class:`kvcert.fast.BlockDesign`): a registered scorer, a certificate kind, a scorer's hyperparameters.

Above :mod:`kvcert.fast.scorers` and :mod:`kvcert.fast.certificates`, below the design objects.
"""

from __future__ import annotations

import dataclasses

from .certificates import KINDS
from .scorers import SCORERS

__all__ = ["check_kind", "check_scorer", "scorer_params", "set_fields"]


def check_scorer(value) -> str:
    """A key of ``kvcert.fast.SCORERS``, else ValueError listing them."""
    if not isinstance(value, str) or value not in SCORERS:
        raise ValueError(f"scorer must be one of {tuple(SCORERS)}, got {value!r}")
    return value


def check_kind(value, kinds=None) -> str:
    """A certificate kind of ``kinds`` (default ``kvcert.fast.KINDS``), else ValueError listing them."""
    kinds = KINDS if kinds is None else kinds
    if not isinstance(value, str) or value not in kinds:
        raise ValueError(f"kind must be one of {kinds}, got {value!r}")
    return value


def set_fields(obj, **values) -> None:
    """Normalized values into a frozen dataclass (its ``__post_init__``)."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def scorer_params(design, scorer) -> dict:
    """The registered scorer's hyperparameters that ``design`` sets: its fields of the same name."""
    own = {f.name for f in dataclasses.fields(design)}
    return {p: getattr(design, p) for p in scorer.params if p in own}
