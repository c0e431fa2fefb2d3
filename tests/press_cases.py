"""The shared press test cases (kvpress's ``tests/default_presses.py``): an easy and a hard keyword set
for every press of ``kvcert.PRESSES``, built from the registry, so a new press is covered without editing
a test (tests/test_hf_units.py, tests/test_hf_model.py; DecodingPress wraps each easy case there)."""

from __future__ import annotations

import dataclasses

from kvcert.fast import SCORERS
from kvcert.presses import PRESSES, PoissonPress


def _cases(name: str, cls) -> tuple[dict, dict]:
    """(easy, hard) keyword sets of a press: a typical setting, and an edge one (a budget below
    sinks + window, the non-default hyperparameters)."""
    easy = {"compression_ratio": 0.5}
    hard = {"target_size": 5, "sinks": 2, "window": 6, "delta": 0.2}
    if cls is PoissonPress:
        return ({**easy, "seed": 1},
                {**hard, "top_fraction": 0.9, "floor": 1.0, "scorer": "tova", "kind": "wald", "seed": 3})
    extra = {"observation_window": 3, "kernel_size": 3, "seed": 4, "pooling": "kvpress", "head_pooling": "all"}
    fields = {f.name for f in dataclasses.fields(cls)}
    return easy, {**hard, **{p: extra.get(p, 2) for p in fields if p in extra or p in SCORERS[name].params}}


#: name -> (easy, hard) keyword sets that the shared press tests iterate
PRESS_CASES = {name: _cases(name, cls) for name, cls in PRESSES.items()}
