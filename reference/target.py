r"""Error-targeted budgets, one KV head at a time: the oracle of ``kvcert.fast.target``.

Plain float64 NumPy, written to be read beside the fast module's docstring (same rule,
same names). At an eviction event every token is visible, so the linearized design
variance of the Hajek estimate of each observation-window query's output is known for
any budget B. With the window queries :math:`q \in Q` of one KV head (its query heads
times the last ``w`` prefill positions, :math:`m = |Q|`):

.. math::

    p_{qi} = \operatorname{softmax}_i(\tau\, q\cdot k_i), \qquad o_q = \sum_i p_{qi} v_i, \qquad
    A_{qi} = p_{qi}^2 \lVert v_i - o_q\rVert^2,

    V_q(B) = \sum_i \Bigl(\frac{1}{\pi_i(B)} - 1\Bigr) A_{qi}, \qquad
    \rho(B) = r_{\text{kind}}\Bigl(\delta;\ \frac{1}{m}\sum_{q\in Q} \frac{V_q(B)}{\lVert o_q\rVert^2}\Bigr),

with :math:`\pi(B)` the token design's inclusion probabilities
(:func:`kvcert.reference.inclusion_probabilities`) at the sampled budget :math:`B_s = B - s`
(``s`` the sketch's memory in tokens) and the certainty set's top slice

.. math:: \text{top}(B_s) = \max\bigl(\min(\lfloor f\,(B_s - \text{sinks} - \text{window})\rfloor,\
          \lceil B_s\rceil - 1 - \text{sinks} - \text{window}),\ 0\bigr)

(``kvcert.fast.design_sizes`` with the edges unshrunk, f = ``top_fraction``), and
:math:`r_{\text{kind}}(\delta; V)` the kind's radius of a variance V
(:func:`kvcert.reference.radius_from_moments`: ``chebyshev`` :math:`\sqrt{V/\delta}`,
``tilted_hull`` :math:`3\sqrt V` uncapped). :math:`V_q(B)` is the trace of
:func:`kvcert.reference.linearized_variance` for q, so :math:`\rho(B)` is the
root-mean-square over the window of the relative radius the certificate would report.

:func:`target_budget` returns the budget :math:`B^*` found by the fast module's bisection
over the integers :math:`[B_{\min}, n]`, :math:`B_{\min} = \lceil s\rceil + \text{sinks} +
\text{window} + 1`, with the invariant "hi meets the target, lo does not" (hi starts at n:
nothing evicted, :math:`\rho = 0`), so :math:`\rho(B^*) \le \varepsilon` always;
:func:`smallest_budget_scan` scans every budget and returns the smallest one that meets the
target, which equals :math:`B^*` whenever :math:`\rho` is non-increasing in B on the range.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from scipy.special import logsumexp

from .certificates import CERTIFICATE_KINDS, radius_from_moments
from .design import inclusion_probabilities

__all__ = ["TARGET_KINDS", "TargetBudget", "predicted_radius", "radius_at_budget", "smallest_budget_scan",
           "target_budget", "window_variance_terms"]

#: the certificate kinds a target can be stated in: those whose radius is a function of the variance trace
#: alone (``CertificateKind.needs == ()``, not per coordinate)
TARGET_KINDS = tuple(name for name, spec in CERTIFICATE_KINDS.items() if not spec.needs and not spec.per_coordinate)


class TargetBudget(NamedTuple):
    """What :func:`target_budget` chose for one KV head.

    ``budget``: the total budget B* (a sketch's memory included), n where nothing is evicted;
    ``sampled``: B* - s, the expected kept count sampled (n where nothing is evicted); ``top``: the
    certainty set's top slice at ``sampled`` (0 where nothing is evicted); ``predicted``: rho(B*)
    (0 where nothing is evicted); ``evicts``: whether B* < n.
    """

    budget: float
    sampled: float
    top: int
    predicted: float
    evicts: bool


def _matrix(name: str, x, shape: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"{name} must have shape {shape}, got shape {a.shape}")
    return a


def window_variance_terms(queries, keys, values, *, scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    r"""The variance terms :math:`A_{qi} = p_{qi}^2 \lVert v_i - o_q\rVert^2` and :math:`\lVert o_q\rVert^2`.

    Parameters
    ----------
    queries : (m, d), the window queries of one KV head (its query heads times the window positions)
    keys : (n, d)
    values : (n, dv)
    scale : float, default 1/sqrt(d)

    Returns
    -------
    terms : (m, n) float64
    norm2 : (m,) float64

    Raises
    ------
    ValueError
        Bad shapes, non-finite queries, keys or values, a scale that is not finite and > 0.
    """
    k = _matrix("keys", keys, "(n, d)")
    n, d = k.shape
    v = _matrix("values", values, f"(n, dv) = ({n}, dv)")
    if v.shape[0] != n:
        raise ValueError(f"values must have shape (n, dv) = ({n}, dv), got shape {v.shape}")
    q = np.asarray(queries, dtype=np.float64)
    if q.ndim != 2 or q.shape[0] == 0 or q.shape[1] != d:
        raise ValueError(f"queries must have shape (m >= 1, d) = (m, {d}), got shape {q.shape}")
    for name, x in (("queries", q), ("keys", k), ("values", v)):
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
    if scale is None:
        tau = 1.0 / math.sqrt(d)
    else:
        tau = float(scale)
        if not (tau > 0.0 and math.isfinite(tau)):
            raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    s = tau * (q @ k.T)  # (m, n)
    p = np.exp(s - logsumexp(s, axis=1, keepdims=True))
    o = p @ v  # (m, dv)
    dist = ((v[None, :, :] - o[:, None, :]) ** 2).sum(-1)  # ||v_i - o_q||^2, (m, n)
    return p * p * dist, (o * o).sum(-1)


def predicted_radius(terms, norm2, pi, *, kind: str, delta: float) -> float:
    r"""The predicted relative radius :math:`\rho = r_{\text{kind}}(\delta; \frac1m\sum_q V_q/\lVert o_q\rVert^2)`.

    :math:`V_q = \sum_i (1/\pi_i - 1) A_{qi}` from :func:`window_variance_terms` and the inclusion
    probabilities ``pi`` (n,) (> 0). A query with :math:`o_q = 0` and :math:`V_q > 0` gives +inf.
    """
    terms = np.asarray(terms, dtype=np.float64)
    norm2 = np.asarray(norm2, dtype=np.float64)
    pi = np.asarray(pi, dtype=np.float64)
    if terms.ndim != 2 or norm2.shape != terms.shape[:1] or pi.shape != terms.shape[1:]:
        raise ValueError(f"terms (m, n), norm2 (m,) and pi (n,) must agree, got shapes {terms.shape}, "
                         f"{norm2.shape}, {pi.shape}")
    if not np.all((pi > 0) & (pi <= 1)):
        raise ValueError("pi must lie in (0, 1] (found a value outside, or NaN)")
    if np.any(np.isnan(terms)) or np.any(np.isnan(norm2)):
        raise ValueError("terms and norm2 must not be NaN")
    var = terms @ (1.0 / pi - 1.0)  # V_q, (m,)
    safe = np.where(norm2 > 0, norm2, 1.0)
    rel = np.where(norm2 > 0, var / safe, np.where(var > 0, math.inf, 0.0))
    return float(radius_from_moments(kind, delta, trace=float(rel.mean())))


def _top(sampled: float, sinks: int, window: int, top_fraction: float) -> int:
    """The top slice of ``kvcert.fast.design_sizes`` at the sampled budget (edges unshrunk)."""
    return max(min(math.floor(top_fraction * (sampled - sinks - window)), math.ceil(sampled) - 1 - sinks - window), 0)


def _nonnegative(importance, n: int) -> np.ndarray:
    """Importance (n,) shifted by its minimum if it has a negative score (``kvcert.fast.nonnegative_importance``)."""
    u = np.asarray(importance, dtype=np.float64)
    if u.shape != (n,):
        raise ValueError(f"importance must have shape (n,) = ({n},), got shape {u.shape}")
    if not np.all(np.isfinite(u)):
        raise ValueError("importance must be finite (found NaN or inf)")
    low = u.min()
    return u - low if low < 0 else u


def radius_at_budget(terms, norm2, importance, budget: float, *, kind: str = "chebyshev", delta: float = 0.05,
                     sinks: int = 4, window: int = 32, top_fraction: float = 0.5, floor: float = 0.1,
                     sketch_tokens: float = 0.0) -> float:
    r""":math:`\rho(B)` at one total budget B: the design at :math:`B_s = B - s` with its top slice, then
    :func:`predicted_radius`. ``importance`` must already be >= 0."""
    sampled = float(budget) - float(sketch_tokens)
    pi = inclusion_probabilities(importance, sampled, sinks=sinks, window=window,
                                 top=_top(sampled, sinks, window, top_fraction), floor=floor)
    return predicted_radius(terms, norm2, pi, kind=kind, delta=delta)


def _prepare(queries, keys, values, importance, target_error, kind, sketch_tokens, scale, delta, top_fraction):
    eps = float(target_error)
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"target_error must be a finite float > 0 (a relative radius), got {target_error!r}")
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind: a target error is stated in a certificate kind whose radius is a function of "
                         f"the variance trace alone, one of {TARGET_KINDS}; got {kind!r}")
    s = float(sketch_tokens)
    if not (s >= 0.0 and math.isfinite(s)):
        raise ValueError(f"sketch_tokens must be a finite float >= 0, got {sketch_tokens!r}")
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not (0.0 <= float(top_fraction) < 1.0):
        raise ValueError(f"top_fraction must be in [0, 1), got {top_fraction}")
    terms, norm2 = window_variance_terms(queries, keys, values, scale=scale)
    n = terms.shape[1]
    u = _nonnegative(importance, n)
    return eps, s, terms, norm2, u, n


def target_budget(queries, keys, values, importance, target_error: float, *, delta: float = 0.05,
                  kind: str = "chebyshev", sinks: int = 4, window: int = 32, top_fraction: float = 0.5,
                  floor: float = 0.1, scale: float | None = None, sketch_tokens: float = 0.0) -> TargetBudget:
    r"""The budget of one KV head whose predicted relative radius is at most ``target_error``.

    Bisection over the integers :math:`[B_{\min}, n]`, :math:`B_{\min} = \lceil s\rceil + \text{sinks}
    + \text{window} + 1`: if :math:`\rho(B_{\min}) \le \varepsilon` the answer is :math:`B_{\min}`;
    otherwise lo = :math:`B_{\min}` (fails), hi = n (meets: nothing evicted) and while hi - lo > 1,
    mid = :math:`\lfloor (\text{lo} + \text{hi})/2\rfloor` replaces hi if :math:`\rho(\text{mid}) \le
    \varepsilon`, lo otherwise. The same steps as ``kvcert.fast.target_budget``, so the two agree
    exactly; the result is the smallest budget meeting the target when :math:`\rho` is non-increasing
    (:func:`smallest_budget_scan` checks every budget).

    Parameters
    ----------
    queries : (m, d), the window queries of the KV head (its g query heads times the w window positions)
    keys, values : (n, d), (n, dv)
    importance : (n,), the scorer's scores (a negative one shifts all by the minimum)
    target_error : float > 0, the target relative radius eps
    delta : float in (0, 1)
    kind : one of :data:`TARGET_KINDS`
    sinks, window, top_fraction, floor : the token design's certainty set and floor
    scale : float, default 1/sqrt(d)
    sketch_tokens : float >= 0, the sketch's memory in kept tokens

    Returns
    -------
    TargetBudget

    Raises
    ------
    ValueError
        A target that is not a finite number > 0, a kind not in :data:`TARGET_KINDS`, bad shapes,
        non-finite queries, keys, values or importance, ``scale``, ``delta``, ``top_fraction`` or
        ``sketch_tokens`` out of range (checked even where nothing can be evicted).

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import target_budget, smallest_budget_scan
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(8, 8)), rng.normal(size=(200, 8)), rng.normal(size=(200, 8)) + 0.5
    >>> chosen = target_budget(q, k, v, rng.random(200), 1.0, sinks=4, window=16)
    >>> chosen.evicts, chosen.predicted <= 1.0, chosen.top == (chosen.budget - 20) // 2
    (True, True, True)
    """
    eps, s, terms, norm2, u, n = _prepare(queries, keys, values, importance, target_error, kind, sketch_tokens,
                                          scale, delta, top_fraction)
    low = math.ceil(s) + sinks + window + 1
    if low >= n:  # no budget below n holds the sketch, the certainty edges and one sampled token
        return TargetBudget(float(n), float(n), 0, 0.0, False)

    def rho(budget: int) -> float:
        return radius_at_budget(terms, norm2, u, float(budget), kind=kind, delta=delta, sinks=sinks, window=window,
                                top_fraction=top_fraction, floor=floor, sketch_tokens=s)

    if rho(low) <= eps:
        hi = low
    else:
        lo, hi = low, n  # rho(lo) > eps, rho(n) = 0 <= eps
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if rho(mid) <= eps:
                hi = mid
            else:
                lo = mid
    if hi == n:
        return TargetBudget(float(n), float(n), 0, 0.0, False)
    sampled = float(hi) - s
    return TargetBudget(float(hi), sampled, _top(sampled, sinks, window, top_fraction), rho(hi), True)


def smallest_budget_scan(queries, keys, values, importance, target_error: float, *, delta: float = 0.05,
                         kind: str = "chebyshev", sinks: int = 4, window: int = 32, top_fraction: float = 0.5,
                         floor: float = 0.1, scale: float | None = None,
                         sketch_tokens: float = 0.0) -> tuple[int, np.ndarray]:
    r"""The smallest integer budget in :math:`[B_{\min}, n-1]` with :math:`\rho(B) \le \varepsilon`, by scanning.

    Arguments as :func:`target_budget`. Returns ``(budget, radii)``: the budget (n if none below n meets
    the target) and :math:`\rho(B)` for every :math:`B = B_{\min}, \dots, n-1` (empty if
    :math:`B_{\min} \ge n`), so a caller can check whether :math:`\rho` is non-increasing.
    """
    eps, s, terms, norm2, u, n = _prepare(queries, keys, values, importance, target_error, kind, sketch_tokens,
                                          scale, delta, top_fraction)
    low = math.ceil(s) + sinks + window + 1
    radii = np.array([radius_at_budget(terms, norm2, u, float(b), kind=kind, delta=delta, sinks=sinks,
                                       window=window, top_fraction=top_fraction, floor=floor, sketch_tokens=s)
                      for b in range(low, n)])
    meets = np.flatnonzero(radii <= eps)
    return (low + int(meets[0]) if meets.size else n), radii
