"""Hypothesis strategies for attention inputs (STYLE.md rule 4).

Scores come in three regimes in stated proportions: typical (standard normal
keys), one-dominant (one key aligned with the query) and masked (some -inf
bias). Inclusion probabilities mix interior values with exact 1.0 and tiny
values (1e-6).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

#: sequence lengths that break tiling, mixed with small random sizes
TILE_EDGES = (1, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 113)


def lengths(max_n: int = 113):
    return st.one_of(st.sampled_from([n for n in TILE_EDGES if n <= max_n]), st.integers(1, max_n))


@st.composite
def attention_case(draw, max_n: int = 113, d_choices=(4, 8, 16), dv_choices=(1, 3, 8)):
    """(q, keys, values, bias) float64 with bias None or containing -inf (never all)."""
    n = draw(lengths(max_n))
    d = draw(st.sampled_from(d_choices))
    dv = draw(st.sampled_from(dv_choices))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.normal(size=d)
    k = rng.normal(size=(n, d))
    v = rng.normal(size=(n, dv))
    regime = draw(st.sampled_from(["typical"] * 3 + ["dominant", "masked"]))  # 60/20/20
    bias = None
    if regime == "dominant":
        j = draw(st.integers(0, n - 1))
        k[j] = q * draw(st.floats(2.0, 8.0))
    elif regime == "masked" and n > 1:
        bias = np.where(rng.random(n) < 0.3, -np.inf, 0.0)
        bias[rng.integers(n)] = 0.0  # at least one visible token
    return q, k, v, bias


@st.composite
def probabilities(draw, n: int):
    """pi in (0, 1]: interior values, exact 1.0 and tiny 1e-6 values."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    pi = rng.uniform(0.05, 1.0, size=n)
    kind = rng.random(n)
    pi[kind < 0.2] = 1.0
    pi[(kind >= 0.2) & (kind < 0.3)] = 1e-6
    return pi
