r"""Choosing the bit width at the budget's memory: kept count and bits together, one KV head.

Float64 NumPy, the oracle of ``kvcert.fast.bits`` (docs/quantized.md section 11). At an eviction event every
token is visible. For each width b of :data:`KV_BITS`, at the memory of the budget B (16-bit tokens, as
``evict_and_certify``'s ``budget``):

- the expected kept count :math:`B_b` (:func:`kept_at_bits`: :func:`kvcert.reference.sampled_budget`, n when
  the whole cache fits): exact memory accounting;
- the predicted relative sampling radius at that count, :func:`kvcert.reference.predicted_radius` of
  :func:`kvcert.reference.window_variance_terms` at the design's pi for :math:`B_b`;
- the predicted rounding term of the population stored at b bits (b < 16), from its own scales
  (:func:`choose_kv_bits` has the formulas);

and the width of the smallest predicted total (ties: more bits). ``evict_and_certify(kv_bits="auto")`` calls
:func:`auto_kv_bits`, then runs exactly the chosen width.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import numpy as np
from scipy.special import logsumexp

from .certificates import radius_from_moments
from .design import inclusion_probabilities
from .quantized import (KV_BITS, KV_FORMAT, KV_LAYOUTS, QUANTIZED_BOUNDS, logit_variance, quantization_bound,
                        quantize, quantize_channels, sampled_budget)
from .sketch import RECOMMENDED_KIND, TILTED
from .target import TARGET_KINDS, predicted_radius, window_variance_terms

__all__ = ["BitsChoice", "BitsPrediction", "KV_BITS_CHOICES", "check_kv_bits_choice", "choose_kv_bits",
           "kept_at_bits"]

#: what ``kv_bits`` accepts where the width may be chosen at the event (``evict_and_certify``): a width of
#: :data:`KV_BITS`, or ``"auto"`` (:func:`choose_kv_bits`)
KV_BITS_CHOICES = KV_BITS + ("auto",)


def check_kv_bits_choice(kv_bits, name: str = "kv_bits"):
    """``kv_bits`` as an int of :data:`KV_BITS` or the string ``"auto"``, else ValueError naming the argument
    and the accepted values."""
    if isinstance(kv_bits, str) and kv_bits == "auto":
        return "auto"
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, (int, np.integer)) or int(kv_bits) not in KV_BITS:
        raise ValueError(f"{name} must be one of {KV_BITS} or 'auto' (16: unquantized; 'auto': the width of least "
                         f"predicted radius at the budget's memory), got {kv_bits!r}")
    return int(kv_bits)


class BitsPrediction(NamedTuple):
    """What :func:`choose_kv_bits` predicts for one width (docs/quantized.md section 11).

    ``bits``: the width; ``kept``: the expected kept count at the budget's memory (:func:`sampled_budget`;
    n when the whole cache fits); ``radius``: the predicted relative sampling radius at that count
    (``kvcert.reference.predicted_radius``); ``rounding``: the predicted rounding term (``"variance"``: the
    kind's radius of :math:`V_q` alone; ``"strict"``: the root mean square of :math:`B_q/\\lVert o_q\\rVert`;
    0 at 16 bits); ``total``: the predicted certificate (``"variance"``: the kind's radius of
    :math:`V + V_q`; ``"strict"``: ``radius + rounding``). ``radius``, ``rounding`` and ``total`` are +inf
    where the width cannot sample at that count (a count not above the certainty set; ``kept`` +inf too when
    the sketch leaves less than one token)."""

    bits: int
    kept: float
    radius: float
    rounding: float
    total: float


class BitsChoice(NamedTuple):
    """:func:`choose_kv_bits`'s result: ``bits``, the width of the smallest predicted total (ties: more bits),
    and ``predictions``, one :class:`BitsPrediction` per width of :data:`KV_BITS`, in that order."""

    bits: int
    predictions: tuple


def _event_sizes(kept: float, sinks: int, window: int, top, top_fraction: float) -> tuple[int, int, int]:
    """(sinks, window, top) at an expected kept count: ``top`` as given (``evict_and_certify``'s certainty set,
    the same at every width), or ``kvcert.fast.design_sizes``' rule with ``top_fraction`` (the token design's:
    edges shrunk to ceil(kept) - 1, the top slice a share of the free budget)."""
    if top is not None:
        return sinks, window, int(top)
    cap = max(math.ceil(kept) - 1, 0)
    if sinks + window > cap:
        window = max(0, cap - sinks)
        sinks = min(sinks, cap)
    return sinks, window, max(min(math.floor(top_fraction * (kept - sinks - window)), cap - sinks - window), 0)


def kept_at_bits(budget: float, n: int, d: int, dv: int, kv_bits: int, *, extra: float = 0.0,
                 layout: str = "channel"):
    """The expected kept count of a design at ``kv_bits`` in the memory of ``budget`` 16-bit tokens: n when the
    whole cache fits at ``kv_bits`` (``budget >= n`` or :func:`sampled_budget` without the sketch >= n), None
    when the sketch's ``extra`` elements leave less than one token, else :func:`sampled_budget`."""
    if budget >= n or sampled_budget(budget, d, dv, kv_bits, layout=layout) >= n:
        return float(n)
    kept = sampled_budget(budget, d, dv, kv_bits, extra=extra, layout=layout)
    return None if kept < 1.0 else float(kept)


def _relative(x: np.ndarray, norm2: np.ndarray, power: float = 1.0) -> np.ndarray:
    """x / norm2**power per query, +inf where o_q = 0 and x > 0 (as ``predicted_radius``)."""
    safe = np.where(norm2 > 0, norm2, 1.0) ** power
    return np.where(norm2 > 0, x / safe, np.where(x > 0, math.inf, 0.0))


def _population_rounding(queries, k, v, p, terms, norm2, pi, fmt: str, layout: str, quantized_bound: str,
                         scale) -> np.ndarray:
    r"""Per window query, the predicted rounding term of a sample drawn with ``pi`` from the population ``k``,
    ``v`` stored at ``fmt`` in ``layout``: ``"variance"`` the relative
    :math:`\sum_i \frac{p_{qi}^2}{\pi_i}(\sigma_{qi}^2\lVert v_i - o_q\rVert^2 + \sum_j s_{v,ij}^2/4)
    /\lVert o_q\rVert^2`
    (its expectation over the design, Hajek weights to first order), ``"strict"`` the relative
    :math:`B_q/\lVert o_q\rVert` of the whole population rounded to nearest (pi drops out to first order)."""
    values = quantize(v, fmt)                                       # every token, rounded to nearest
    keys = k if layout == "values" else (quantize_channels(k, fmt) if layout == "channel" else quantize(k, fmt))
    n = k.shape[0]
    if quantized_bound == "strict":
        b_q = np.array([quantization_bound(qi, keys, values, np.ones(n), scale=scale) for qi in queries])
        return _relative(b_q, norm2, 0.5)
    flag = dict(rounding="stochastic")                              # the scales are the same: read s^2/4
    vvar = replace(values, **flag).variance_bound().sum(axis=1)     # (n,)
    sigma2 = 0.0
    if not isinstance(keys, np.ndarray):
        keys = replace(keys, **flag)
        sigma2 = np.stack([logit_variance(qi, keys, scale=scale) for qi in queries])   # (m, n)
    r_q = ((sigma2 * terms + p * p * vvar[None, :]) / pi[None, :]).sum(axis=1)
    return _relative(r_q, norm2)


def choose_kv_bits(queries, keys, values, importance, budget: float, *, delta: float = 0.05,
                   kind: str = "chebyshev", sinks: int = 4, window: int = 32, top: int | None = None,
                   top_fraction: float = 0.0, floor: float = 0.1, scale: float | None = None,
                   layout: str = "channel", quantized_bound: str = "variance", extra: float = 0.0) -> BitsChoice:
    r"""The width of :data:`KV_BITS` whose design, at the memory of ``budget`` 16-bit tokens, has the smallest
    predicted certificate for the window queries of one KV head.

    For each width b: the kept count :math:`B_b` at equal memory (:func:`kept_at_bits`, exact accounting), pi
    at :math:`B_b` (:func:`kvcert.reference.inclusion_probabilities`, the certainty set of ``top`` or
    ``top_fraction``), the predicted relative sampling radius
    :math:`\rho_b = r_{\text{kind}}(\delta; \frac1m\sum_q V_q(B_b)/\lVert o_q\rVert^2)`,
    :math:`V_q = \sum_i (1/\pi_i - 1) p_{qi}^2\lVert v_i - o_q\rVert^2` (``window_variance_terms``,
    ``predicted_radius``: every token is visible at the event), and the predicted rounding term of the
    population stored at b bits (b < 16):

    - ``"variance"``: :math:`R_q = \sum_i \frac{p_{qi}^2}{\pi_i}\big(\sigma_{qi}^2 \lVert v_i - o_q\rVert^2
      + \sum_j s_{v,ij}^2/4\big)`, total :math:`r_{\text{kind}}(\delta; \frac1m\sum_q (V_q + R_q)/\lVert o_q\rVert^2)`;
    - ``"strict"``: :math:`B_q` (:func:`quantization_bound`) of the population rounded to nearest, total
      :math:`\rho_b + (\frac1m\sum_q B_q^2/\lVert o_q\rVert^2)^{1/2}`.

    The scales (:math:`s_v`, and :math:`\sigma_{qi}^2` from the key scales, :func:`logit_variance`) are the
    population's own; in the ``"channel"`` layout its groups are 32 consecutive tokens of the population, not of
    the kept set. The memory is exact; radius and rounding are predictions (docs/quantized.md section 11).

    Parameters
    ----------
    queries : (m, d), the window queries of the KV head   keys, values : (n, d), (n, dv), its whole cache
    importance : (n,) the scorer's importance (a negative one shifts all by the minimum)
    budget : float > 0, the memory to compare at, in 16-bit tokens (``evict_and_certify``'s ``budget``)
    delta, kind : the radius rule (a kind of ``kvcert.reference.TARGET_KINDS``)
    sinks, window, top, top_fraction, floor : the certainty set: ``top`` an int kept at every width
        (``evict_and_certify``), or None to size it at each count from ``top_fraction`` (the token design)
    scale : float, default 1/sqrt(d)   layout : a name of :data:`KV_LAYOUTS`
    quantized_bound : a name of :data:`QUANTIZED_BOUNDS`   extra : float >= 0, a sketch's elements

    Returns
    -------
    BitsChoice
    """
    if not isinstance(layout, str) or layout not in KV_LAYOUTS:
        raise ValueError(f"layout must be one of {KV_LAYOUTS}, got {layout!r}")
    if not isinstance(quantized_bound, str) or quantized_bound not in QUANTIZED_BOUNDS:
        raise ValueError(f"quantized_bound must be one of {QUANTIZED_BOUNDS}, got {quantized_bound!r}")
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind: kv_bits='auto' compares radii that are functions of the variance trace, one of "
                         f"{TARGET_KINDS}; got {kind!r}")
    if not (float(budget) > 0 and math.isfinite(float(budget))):
        raise ValueError(f"budget must be a finite float > 0, got {budget!r}")
    terms, norm2 = window_variance_terms(queries, keys, values, scale=scale)
    q = np.asarray(queries, dtype=np.float64)
    k, v = np.asarray(keys, dtype=np.float64), np.asarray(values, dtype=np.float64)
    (n, d), dv = k.shape, v.shape[1]
    s = (1.0 / math.sqrt(d) if scale is None else float(scale)) * (q @ k.T)
    p = np.exp(s - logsumexp(s, axis=1, keepdims=True))
    u = np.asarray(importance, dtype=np.float64)
    if u.shape != (n,) or not np.all(np.isfinite(u)):
        raise ValueError(f"importance must be a finite array of shape (n,) = ({n},)")
    u = u - u.min() if u.min() < 0 else u
    out = []
    for bits in KV_BITS:
        kept = kept_at_bits(float(budget), n, d, dv, bits, extra=extra, layout=layout)
        sizes = None if kept is None or kept >= n else _event_sizes(kept, sinks, window, top, top_fraction)
        if kept is None or (sizes is not None and sum(sizes) >= kept):
            out.append(BitsPrediction(bits, math.inf if kept is None else kept, math.inf, math.inf, math.inf))
            continue
        pi = np.ones(n) if sizes is None else inclusion_probabilities(u, kept, sinks=sizes[0], window=sizes[1],
                                                                      top=sizes[2], floor=floor)
        radius = predicted_radius(terms, norm2, pi, kind=kind, delta=delta)
        if bits == 16:
            out.append(BitsPrediction(bits, kept, radius, 0.0, radius))
            continue
        rel = _population_rounding(q, k, v, p, terms, norm2, pi, KV_FORMAT[bits], layout, quantized_bound, scale)
        if quantized_bound == "strict":
            rounding = float(np.sqrt(np.mean(rel ** 2)))
            out.append(BitsPrediction(bits, kept, radius, rounding, radius + rounding))
            continue
        rel_v = _relative(terms @ (1.0 / pi - 1.0), norm2)
        rounding = float(radius_from_moments(kind, delta, trace=float(rel.mean())))
        total = float(radius_from_moments(kind, delta, trace=float((rel_v + rel).mean())))
        out.append(BitsPrediction(bits, kept, radius, rounding, total))
    best = out[0]
    for pred in out[1:]:
        if pred.total < best.total:                                  # strictly smaller: ties keep more bits
            best = pred
    return BitsChoice(best.bits, tuple(out))


def auto_kv_bits(q, k, v, u, budget: float, *, spec, tilt, delta: float, sinks: int, window: int, top: int,
                 floor: float, scale, kv_layout: str, quantized_bound: str) -> BitsChoice:
    """``evict_and_certify(kv_bits="auto")``'s choice (arguments checked there): :func:`choose_kv_bits` for the
    window queries ``tilt`` ((w, d), or the mean (d,)), or the certified ``q`` without them, at the design's
    certainty set (``top`` at every width), radius kind (``chebyshev``; ``tilted_hull`` for the tilted design)
    and sketch memory."""
    if spec is not None and spec != TILTED and spec.radius != "chebyshev":
        raise ValueError(f"kv_bits: 'auto' predicts a trace-only radius (the paper design's chebyshev, the tilted "
                         f"design's tilted_hull, a ClusterDesign with radius='chebyshev'); got radius "
                         f"{spec.radius!r}")
    queries = q[None, :] if tilt is None else np.atleast_2d(np.asarray(tilt, dtype=np.float64))
    kind = RECOMMENDED_KIND if spec == TILTED else "chebyshev"
    extra = 0.0 if spec is None else float(spec.elements(k.shape[1], v.shape[1]))
    return choose_kv_bits(queries, k, v, u, budget, delta=delta, kind=kind, sinks=sinks, window=window, top=top,
                          floor=floor, scale=scale, layout=kv_layout, quantized_bound=quantized_bound, extra=extra)
