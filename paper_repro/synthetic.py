"""Synthetic attention heads in four regimes, and the paper's randomized design on them.

A head is a cache of n keys/values, an observation window of w queries (what
the scorer sees at eviction time) and a future query (what the certificate
must cover). Regimes (T2a):

- ``flat``: small key scale, attention spread over many tokens;
- ``peaked``: large key scale, a few tokens carry most of the mass;
- ``heavy``: Student-t (3 d.o.f.) values, so a few values are far from the mean;
- ``needle``: one token carries about 70% of the future query's attention,
  but the observation window does not point at it (its importance is typical,
  so its pi is small): the unseen-mass regime where CLT intervals fail.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcert import reference as R

REGIMES = ("flat", "peaked", "heavy", "needle")
#: the design's certain edges (PoissonPress's defaults): attention sinks and the recent window, which is
#: also the scorers' observation window
SINKS, WINDOW = 4, 32


@dataclass
class Head:
    queries: np.ndarray   # (n, d) queries at every position (the last is the current query)
    window: np.ndarray    # (w, d) observation window used by the scorers
    q: np.ndarray         # (d,) future query the certificate is about
    keys: np.ndarray      # (n, d)
    values: np.ndarray    # (n, dv)


def make_head(rng: np.random.Generator, regime: str, *, n: int, d: int, dv: int, w: int = 8) -> Head:
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    key_scale = {"flat": 0.5, "peaked": 2.5, "heavy": 1.0, "needle": 1.0}[regime]
    base = rng.normal(size=d)
    queries = base + 0.5 * rng.normal(size=(n, d))
    q = base + 0.5 * rng.normal(size=d)
    keys = key_scale * rng.normal(size=(n, d))
    if regime == "heavy":
        values = rng.standard_t(3, size=(n, dv))
    else:
        values = rng.normal(size=(n, dv))
    if regime == "needle":
        q = rng.normal(size=d)  # the future query asks about something the window did not
        j = int(rng.integers(n // 4, 3 * n // 4))
        s = R.scores(q, keys)
        rest = np.log(np.exp(s).sum() - np.exp(s[j]))
        # score of the needle: log(0.7/0.3) above the rest -> 70% of the mass
        keys[j] += q * (rest + np.log(0.7 / 0.3) - s[j]) * np.sqrt(d) / (q @ q)
        values[j] = 3.0 * rng.normal(size=dv)
    return Head(queries=queries, window=queries[-w:], q=q, keys=keys, values=values)


def paper_press(fraction: float, *, top_fraction: float = 0.5, sinks: int = SINKS, window: int = WINDOW,
                floor: float = 0.1):
    """The paper's design at a kept fraction, as the library ships it: a ``PoissonPress`` with
    compression_ratio 1 - fraction (sinks and the recent window certain, ``top_fraction`` of the
    free budget as a certain top slice, the rest a Poisson tail with the defensive floor)."""
    import kvcert

    return kvcert.PoissonPress(compression_ratio=1.0 - fraction, sinks=sinks, window=window,
                               top_fraction=top_fraction, floor=floor, sketch=None)  # the paper's design, by name


def press_pi(press, importance: np.ndarray) -> np.ndarray:
    """pi (n,) that ``press`` gives at its prefill event to tokens of this importance, computed by
    the float64 reference with the press's own sizing (``press.design_sizes``, which is
    :func:`kvcert.fast.design_sizes`): the replay and the library build the same design."""
    sizes = press.design_sizes(importance.shape[-1])
    if importance.min() < 0:  # as the press does for a negative score (knorm's -||k||)
        importance = importance - importance.min()
    return R.inclusion_probabilities(importance, sizes.budget, sinks=sizes.sinks, window=sizes.window,
                                     top=sizes.top, floor=press.floor)


def design_pi(head: Head, fraction: float) -> np.ndarray:
    """pi of the paper's design with SnapKV importance from the observation window."""
    return press_pi(paper_press(fraction), R.snapkv_scores(head.window, head.keys))
