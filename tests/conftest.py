"""Shared test configuration: Hypothesis profiles and common fixtures.

Profiles (STYLE.md rule 4): ``dev`` (default, random, 50 examples) and ``ci``
(derandomized, no deadline). ``make test`` selects ``ci`` through
HYPOTHESIS_PROFILE=ci.
"""

import importlib.util
import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Suites that need other pins run in venvs of their own (Makefile: test-kvpress,
# test-vllm); where their package is missing they are not collected at all.
# (origin None: only the namespace package that tests/kvpress or tests/vllm itself forms on sys.path)


def _installed(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


collect_ignore = [name for name in ("kvpress", "vllm") if not _installed(name)]
