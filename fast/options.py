"""The checks of the design objects' shared fields (:class:`kvcert.fast.TokenDesign`,
:class:`kvcert.fast.BlockDesign`): a registered scorer, a certificate kind, a scorer's hyperparameters.

Above :mod:`kvcert.fast.scorers` and :mod:`kvcert.fast.certificates`, below the design objects.
"""

from __future__ import annotations

import dataclasses

from .certificates import KINDS
from .scorers import SCORERS

__all__ = ["check_kind", "check_scorer", "declare_fields", "scorer_params", "set_fields"]


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


_DESIGN_DEFAULT = object()


def declare_fields(design, names, *, default=_DESIGN_DEFAULT, **defaults):
    """Class decorator, under ``@dataclass``: declare the fields ``names`` of the dataclass ``design`` (a design
    object) on the class, in that order and before the class's own, with the design's annotations and
    defaults, so a press or an engine's settings restate none of them (docs/architecture.md, "Designs").

    ``default`` gives every declared field that default instead (``None``: "the design's"; the settings of the
    vLLM plugin), and a keyword ``name=value`` gives one field its own (a press's ``"auto"``)."""
    own = {f.name: f for f in dataclasses.fields(design)}
    unknown = [n for n in (*names, *defaults) if n not in own]
    if unknown:
        raise TypeError(f"{design.__name__} has no field(s) {unknown}")

    def decorate(cls):
        body = dict(cls.__dict__.get("__annotations__", {}))
        declared = {}
        for name in names:
            field = own[name]
            declared[name] = field.type
            value = defaults.get(name, field.default if default is _DESIGN_DEFAULT else default)
            setattr(cls, name, value)
        cls.__annotations__ = {**declared, **{k: v for k, v in body.items() if k not in declared}}
        return cls

    return decorate
