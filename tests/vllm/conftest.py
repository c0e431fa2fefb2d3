"""Fixtures shared by the vLLM tests (the helpers they build on are in tests/vllm/vllm_support.py).

``engine``: the module's plugin engine, started once. A module states it as data,

    ENGINE_SPEC = dict(plugin=True, compression_ratio=0.5, seed=3, kvcert={"granularity": "block"},
                       runs=[{"order": [0, 1], "max_tokens": 6}])

the keyword arguments of ``vllm_support.run_engine``; a module whose engine depends on a parameter (one
engine per design) defines an ``engine_spec`` fixture of its own instead, which this ``engine`` then reads.
Engines are expensive (a minute or more each on the CPU): module scope, and equal specs run once per session
(``vllm_support.engine_of``).
"""

from __future__ import annotations

import pytest

from vllm_support import engine_of


@pytest.fixture(scope="module")
def engine_spec(request) -> dict:
    """The keyword arguments of ``run_engine`` for the module's engine: its ``ENGINE_SPEC``."""
    spec = getattr(request.module, "ENGINE_SPEC", None)
    if not isinstance(spec, dict):
        raise pytest.UsageError(f"{request.module.__name__} uses the engine fixture: it needs ENGINE_SPEC, a dict of "
                                f"run_engine's keyword arguments, or an engine_spec fixture of its own (got {spec!r})")
    return spec


@pytest.fixture(scope="module")
def engine(engine_spec) -> dict:
    """The module's engine: the driver's JSON of ``run_engine(**engine_spec)`` (tests/vllm/vllm_driver.py)."""
    return engine_of(engine_spec)
