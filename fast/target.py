r"""Error-targeted budgets: the fewest kept tokens whose predicted certificate meets a target.

At an eviction event every token is still visible, so the design variance of the
Hajek estimate of the observation-window queries' attention outputs is known
exactly (to first order) for any budget. :func:`target_budget` picks, per KV head,
the smallest budget whose *predicted* relative radius is at most the target
``eps``; the certificate recorded at decode stays the design's own.

The prediction rule (docs/theory.md section 9), per KV head with window queries
:math:`q \in Q` (the group's query heads times the last ``w`` prefill positions,
:math:`m = |Q|`):

.. math::

    p_{qi} = \operatorname{softmax}_i(\tau\, q\cdot k_i), \qquad o_q = \sum_i p_{qi} v_i, \qquad
    A_{qi} = p_{qi}^2 \lVert v_i - o_q\rVert^2,

    V_q(B) = \sum_i \Bigl(\frac{1}{\pi_i(B)} - 1\Bigr) A_{qi}, \qquad
    \rho(B) = r_{\text{kind}}\Bigl(\delta;\ \frac{1}{m}\sum_{q\in Q} \frac{V_q(B)}{\lVert o_q\rVert^2}\Bigr),

with :math:`\pi(B)` the token design's inclusion probabilities at the sampled budget
:math:`B - s` (``s`` the sketch's memory in tokens; the certainty set of
:func:`kvcert.fast.design_sizes`) and :math:`r_{\text{kind}}(\delta; V)` the kind's radius
of a variance V (``chebyshev``: :math:`\sqrt{V/\delta}`; ``tilted_hull``: :math:`3\sqrt V`,
uncapped). :math:`V_q(B)` is the linearized design variance of the Hajek estimate of
:math:`o_q`, :math:`E\lVert\hat o_q - o_q\rVert^2 \approx V_q(B)`; the decode-time
certificate estimates it from the kept tokens. So :math:`\rho(B)` is the root-mean-square
over the window of the relative radius the certificate would report for those queries.

The chosen budget :math:`B^*` is an integer in :math:`[B_{\min}, n]`,
:math:`B_{\min} = \lceil s \rceil + \text{sinks} + \text{window} + 1`, found by bisection that
keeps :math:`\rho(\text{hi}) \le \varepsilon` (hi starts at n: nothing evicted, :math:`\rho = 0`):
:math:`\rho(B^*) \le \varepsilon` always holds, and :math:`B^*` is the smallest such budget
whenever :math:`\rho` is non-increasing in B on the range. It is with ``top_fraction = 0``; the top
slice can break it (a token that joins the certain top set renormalizes the tail's importance and
lowers other tokens' pi), and then the bisection may return a larger budget than the smallest
(docs/theory.md section 9 has how often).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._checks import check_scale, check_tensor
from .certificates import CERTIFICATE_KINDS, radius_from_moments
from .design import inclusion_probabilities, nonnegative_importance

__all__ = ["TARGET_KINDS", "TargetBudget", "target_budget", "window_variance_terms", "predicted_radius",
           "check_target_error", "head_tops"]

#: the certificate kinds a target can be stated in: those whose radius is a function of the variance trace
#: alone (``CertificateKind.needs == ()``)
TARGET_KINDS = tuple(name for name, spec in CERTIFICATE_KINDS.items() if not spec.needs and not spec.per_coordinate)


def check_target_error(name: str, value) -> float:
    """An error target eps as a float: a finite int or float > 0 (bool refused), else ``ValueError`` naming
    ``name``. The one check of a target a user states (``TokenDesign``, ``Certificates.exceeds``,
    ``kvcert.vllm.generate_within_target``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < float(value) < math.inf):
        raise ValueError(f"{name} must be a finite float > 0 (a relative radius), got {value!r}")
    return float(value)


class TargetBudget(NamedTuple):
    """What :func:`target_budget` chose, per (row, KV head), all float64 (b, h_kv) but ``top``.

    ``budget``: the total budget B* (expected kept tokens, a sketch's memory included), n where the
    event evicts nothing; ``sampled``: the expected kept count sampled, B* - s (n where nothing is
    evicted); ``top``: int64, the certainty set's top slice at the sampled budget
    (:func:`kvcert.fast.design_sizes`); ``predicted``: the predicted relative radius rho(B*) (0 where
    nothing is evicted); ``evicts``: bool, whether the head evicts anything.
    """

    budget: torch.Tensor
    sampled: torch.Tensor
    top: torch.Tensor
    predicted: torch.Tensor
    evicts: torch.Tensor


def window_variance_terms(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
                          scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The per-token variance terms :math:`A_{qi} = p_{qi}^2 \lVert v_i - o_q\rVert^2` and
    :math:`\lVert o_q\rVert^2` of the window queries, in float64.

    Parameters
    ----------
    queries : (b, h_q, w, d), the observation-window queries (h_q = g h_kv)
    keys : (b, h_kv, n, d)
    values : (b, h_kv, n, dv)
    scale : float, default 1/sqrt(d)

    Returns
    -------
    terms : (b, h_kv, g w, n) float64
    norm2 : (b, h_kv, g w) float64
    """
    queries = check_tensor("queries", queries, ndim=(4,), floating=True)
    keys = check_tensor("keys", keys, ndim=(4,), floating=True)
    values = check_tensor("values", values, ndim=(4,), floating=True)
    b, h_kv, n, d = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = ({b}, {h_kv}, {n}, dv), "
                         f"got {tuple(values.shape)}")
    bq, hq, w, dq = queries.shape
    if bq != b or dq != d or hq % h_kv or w == 0:
        raise ValueError(f"queries must have shape (b, g * h_kv, w >= 1, d) = ({b}, g * {h_kv}, w, {d}), "
                         f"got {tuple(queries.shape)}")
    for name, x in (("queries", queries), ("keys", keys), ("values", values)):
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
    g = hq // h_kv
    tau = check_scale(scale, d)
    q = queries.to(torch.float64).reshape(b, h_kv, g * w, d)
    k = keys.to(torch.float64)
    v = values.to(torch.float64)
    p = torch.softmax(tau * (q @ k.transpose(-1, -2)), dim=-1)  # (b, h_kv, m, n)
    o = p @ v  # (b, h_kv, m, dv)
    v2 = (v * v).sum(-1)  # (b, h_kv, n)
    o2 = (o * o).sum(-1)  # (b, h_kv, m)
    dist = (v2.unsqueeze(-2) - 2.0 * (o @ v.transpose(-1, -2)) + o2.unsqueeze(-1)).clamp_min(0.0)
    return p * p * dist, o2


def predicted_radius(terms: torch.Tensor, norm2: torch.Tensor, pi: torch.Tensor, *, kind: str,
                     delta: float) -> torch.Tensor:
    r"""The predicted relative radius :math:`\rho = r_{\text{kind}}(\delta; \frac1m\sum_q V_q/\lVert o_q\rVert^2)`,
    :math:`V_q = \sum_i (1/\pi_i - 1) A_{qi}`, (b, h_kv) float64, from :func:`window_variance_terms` and the
    inclusion probabilities ``pi`` (b, h_kv, n) (> 0). A query with :math:`o_q = 0` and :math:`V_q > 0`
    gives +inf (no relative error is certifiable there)."""
    pi = pi.to(torch.float64)
    var = (terms @ (1.0 / pi - 1.0).unsqueeze(-1)).squeeze(-1)  # (b, h_kv, m)
    rel = torch.where(norm2 > 0, var / norm2.clamp_min(torch.finfo(torch.float64).tiny),
                      torch.where(var > 0, math.inf, torch.where(torch.isnan(var), math.nan, 0.0)))
    return radius_from_moments(kind, delta, trace=rel.mean(-1))


def head_tops(sampled: torch.Tensor, sinks: int, window: int, top_fraction: float) -> torch.Tensor:
    """:func:`kvcert.fast.design_sizes`'s top slice at each sampled budget (edges unshrunk: sampled >= sinks +
    window + 1)."""
    free = sampled - sinks - window
    cap = torch.ceil(sampled) - 1 - sinks - window
    return torch.minimum(torch.floor(top_fraction * free), cap).clamp_min(0).to(torch.int64)


def target_budget(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor,
                  target_error: float, *, delta: float = 0.05, kind: str = "chebyshev", sinks: int = 4,
                  window: int = 32, top_fraction: float = 0.5, floor: float = 0.1, scale: float | None = None,
                  sketch_tokens: float = 0.0) -> TargetBudget:
    r"""The smallest budget per KV head whose predicted relative radius is at most ``target_error``.

    The rule and what it guarantees are in the module docstring: :math:`\rho(B^*) \le \varepsilon`
    for the observation-window queries, :math:`B^*` minimal when :math:`\rho` is non-increasing in B.
    One bisection over every (row, KV head) at once, :math:`\lceil\log_2 n\rceil` rounds of
    :func:`kvcert.fast.inclusion_probabilities` and one (m x n) mat-vec per head each.

    Parameters
    ----------
    queries : (b, h_q, w, d), the observation-window queries (the last prefill queries)
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), one event's tokens (no padding)
    importance : (b, h_kv, n), the scorer's scores (negative ones shifted per head,
        :func:`kvcert.fast.nonnegative_importance`)
    target_error : float > 0, the target relative radius eps
    delta : float in (0, 1)
    kind : one of :data:`TARGET_KINDS`, the radius rule the prediction uses (the design's recorded kind)
    sinks, window, top_fraction, floor : the token design's certainty set and floor
    scale : float, default 1/sqrt(d)
    sketch_tokens : float >= 0, the sketch's memory in kept tokens (a sketched design samples B - s)

    Returns
    -------
    TargetBudget

    Raises
    ------
    ValueError
        A target that is not a finite number > 0, a kind whose radius needs more than the variance trace,
        bad shapes (naming the argument).
    """
    eps = float(target_error)
    if not (eps > 0.0 and math.isfinite(eps)):
        raise ValueError(f"target_error must be a finite float > 0 (a relative radius), got {target_error!r}")
    delta = float(delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    top_fraction = float(top_fraction)
    if not 0.0 <= top_fraction < 1.0:
        raise ValueError(f"top_fraction must be in [0, 1), got {top_fraction}")
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind: a target error is stated in a certificate kind whose radius is a function of "
                         f"the variance trace alone, one of {TARGET_KINDS}; got {kind!r}")
    sketch_tokens = float(sketch_tokens)
    if not (sketch_tokens >= 0.0 and math.isfinite(sketch_tokens)):
        raise ValueError(f"sketch_tokens must be a finite float >= 0, got {sketch_tokens!r}")
    terms, norm2 = window_variance_terms(queries, keys, values, scale=scale)
    b, h_kv, n = keys.shape[:3]
    importance = check_tensor("importance", importance, floating=True)
    if tuple(importance.shape) != (b, h_kv, n):
        raise ValueError(f"importance must have shape (b, h_kv, n) = ({b}, {h_kv}, {n}), "
                         f"got {tuple(importance.shape)}")
    if not bool(torch.isfinite(importance).all()):
        raise ValueError("importance must be finite (found NaN or inf)")
    u = nonnegative_importance(importance.to(torch.float64))
    device = keys.device
    full = torch.full((b, h_kv), float(n), dtype=torch.float64, device=device)
    low = math.ceil(sketch_tokens) + sinks + window + 1
    if low >= n:  # no budget below n holds the sketch and the certainty set and one sampled token
        zero = torch.zeros_like(full)
        return TargetBudget(full, full.clone(), zero.to(torch.int64), zero,
                            torch.zeros((b, h_kv), dtype=torch.bool, device=device))

    def rho(total: torch.Tensor) -> torch.Tensor:
        sampled = total - sketch_tokens
        top = head_tops(sampled, sinks, window, top_fraction)
        pi = inclusion_probabilities(u, sampled, sinks=sinks, window=window, top=top, floor=floor)
        return predicted_radius(terms, norm2, pi, kind=kind, delta=delta)

    lo = torch.full_like(full, float(low))
    at_low = rho(lo)
    hi = torch.where(at_low <= eps, lo, full)  # hi always meets the target (n evicts nothing: rho = 0)
    lo = torch.where(at_low <= eps, lo - 1.0, lo)  # lo never does
    while bool((hi - lo > 1.0).any()):
        mid = torch.floor((lo + hi) / 2.0).clamp(min=float(low), max=float(n - 1))  # closed heads: any valid B
        ok = rho(mid) <= eps
        open_ = hi - lo > 1.0
        hi = torch.where(open_ & ok, mid, hi)
        lo = torch.where(open_ & ~ok, mid, lo)
    evicts = hi < n
    sampled = torch.where(evicts, hi - sketch_tokens, full)
    top = torch.where(evicts, head_tops(sampled.clamp_min(float(low) - sketch_tokens), sinks, window, top_fraction),
                      torch.zeros_like(sampled, dtype=torch.int64))
    predicted = torch.where(evicts, rho(torch.where(evicts, hi, torch.full_like(hi, float(low)))),
                            torch.zeros_like(hi))
    return TargetBudget(hi, sampled, top, predicted, evicts)
