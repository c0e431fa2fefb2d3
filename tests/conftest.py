"""Shared test configuration: Hypothesis profiles and common fixtures.

Profiles (STYLE.md rule 4): ``dev`` (default, random, 50 examples) and ``ci``
(derandomized, no deadline). ``make test`` selects ``ci`` through
HYPOTHESIS_PROFILE=ci.
"""

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
