r"""Choosing the bit width at the budget's memory: kept count and bits together, batched.

Torch twin of ``kvcert.reference.choose_kv_bits`` (docs/quantized.md section 11). At an eviction event every
token is visible. For each width b of :data:`kvcert.fast.KV_BITS`, at the memory of the budget B (16-bit
tokens, as ``budget`` means everywhere):

- the expected kept count :math:`B_b` (:func:`kept_at_bits`: ``kvcert.fast.sampled_budget``, n when the whole
  cache fits): exact memory accounting;
- the predicted relative sampling radius at that count,
  :math:`\rho_b = r_{\text{kind}}(\delta; \frac1m\sum_q V_q(B_b)/\lVert o_q\rVert^2)` with
  :math:`V_q = \sum_i (1/\pi_i - 1)\,p_{qi}^2\lVert v_i - o_q\rVert^2` (:func:`kvcert.fast.window_variance_terms`,
  :func:`kvcert.fast.predicted_radius`), pi the token design's at :math:`B_b`;
- the predicted rounding term of the population stored at b bits (b < 16), from its own scales:
  ``"variance"`` :math:`R_q = \sum_i \frac{p_{qi}^2}{\pi_i}(\sigma_{qi}^2\lVert v_i - o_q\rVert^2 +
  \sum_j s_{v,ij}^2/4)`, total :math:`r_{\text{kind}}(\delta; \frac1m\sum_q (V_q + R_q)/\lVert o_q\rVert^2)`;
  ``"strict"`` :math:`B_q` of the population rounded to nearest, total
  :math:`\rho_b + (\frac1m\sum_q B_q^2/\lVert o_q\rVert^2)^{1/2}`;

and the width of the smallest predicted total, ties to more bits. Radius and rounding are predictions (the
sample is not drawn yet); the memory is exact.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from ._checks import check_scale, check_tensor
from .certificates import radius_from_moments
from .design import design_sizes, inclusion_probabilities, nonnegative_importance
from .quantized import (KV_BITS, KV_FORMAT, QuantizedChannels, QuantizedRows, check_kv_layout, check_quantized_bound,
                        logit_variance, quantization_bound, quantize, quantize_channels, sampled_budget)
from .target import TARGET_KINDS, predicted_radius, window_variance_terms

__all__ = ["BitsChoice", "BitsPrediction", "KV_BITS_CHOICES", "check_kv_bits_choice", "choose_kv_bits",
           "kept_at_bits"]

#: what a design's ``kv_bits`` accepts: a width of :data:`kvcert.fast.KV_BITS`, or ``"auto"`` (chosen at the
#: event by :func:`choose_kv_bits`)
KV_BITS_CHOICES = KV_BITS + ("auto",)


def check_kv_bits_choice(kv_bits, name: str = "kv_bits"):
    """``kv_bits`` as an int of :data:`kvcert.fast.KV_BITS` or the string ``"auto"``, else ValueError naming
    the argument and the accepted values (``kvcert.reference.quantized.check_kv_bits_choice``)."""
    if isinstance(kv_bits, str) and kv_bits == "auto":
        return "auto"
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, numbers.Integral) or int(kv_bits) not in KV_BITS:
        raise ValueError(f"{name} must be one of {KV_BITS} or 'auto' (16: unquantized; 'auto': the width of least "
                         f"predicted radius at the budget's memory), got {kv_bits!r}")
    return int(kv_bits)


class BitsPrediction(NamedTuple):
    """One width's predictions (``kvcert.reference.BitsPrediction``, batched): ``bits`` (int), ``kept``
    (float, the expected kept count at the budget's memory, the same for every head; +inf where a sketch
    leaves less than one token), and (b, h_kv) float64 ``radius`` (relative sampling radius), ``rounding``
    (``"variance"``: the kind's radius of V_q alone; ``"strict"``: the root mean square of B_q / ||o_q||; 0 at
    16 bits) and ``total`` (the predicted certificate), +inf where the width cannot sample (a count not above
    the certainty set, or a sketch that leaves less than one token)."""

    bits: int
    kept: float
    radius: torch.Tensor
    rounding: torch.Tensor
    total: torch.Tensor


class BitsChoice(NamedTuple):
    """:func:`choose_kv_bits`'s result: ``bits`` (b, h_kv) int64, each KV head's width of smallest predicted
    total (ties: more bits), and ``predictions``, one :class:`BitsPrediction` per width of ``KV_BITS``."""

    bits: torch.Tensor
    predictions: tuple

    def shared(self) -> int:
        """The one width for every head (a cache layer stores one): the smallest sum over heads (and rows) of
        the predicted totals, ties to more bits."""
        best, low = self.predictions[0].bits, float(self.predictions[0].total.sum())
        for pred in self.predictions[1:]:
            total = float(pred.total.sum())
            if total < low:
                best, low = pred.bits, total
        return best


def kept_at_bits(budget: float, n: int, d: int, dv: int, kv_bits: int, *, extra: float = 0.0,
                 layout: str = "channel"):
    """The expected kept count at ``kv_bits`` in the memory of ``budget`` 16-bit tokens
    (``kvcert.reference.kept_at_bits``): n when the whole cache fits, None when the sketch's ``extra`` elements
    leave less than one token, else :func:`kvcert.fast.sampled_budget`."""
    if budget >= n or sampled_budget(budget, d, dv, kv_bits, layout=layout) >= n:
        return float(n)
    kept = sampled_budget(budget, d, dv, kv_bits, extra=extra, layout=layout)
    return None if kept < 1.0 else float(kept)


def _relative(x: torch.Tensor, norm2: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """x / norm2**power per query, +inf where o_q = 0 and x > 0 (as ``predicted_radius``)."""
    safe = torch.where(norm2 > 0, norm2, 1.0) ** power
    return torch.where(norm2 > 0, x / safe, torch.where(x > 0, math.inf, 0.0))


def _stored(keys: torch.Tensor, values: torch.Tensor, fmt: str, layout: str, rounding: str):
    """The population's keys and values rounded to nearest in ``layout``, labelled ``rounding`` (the scales are
    the same either way: a "stochastic" label reads the variance bound s^2/4 from them)."""
    vq = quantize(values, fmt)
    vq = QuantizedRows(vq.codes, vq.scales, fmt, rounding)
    if layout == "values":
        return keys.to(torch.float64), vq
    if layout == "channel":
        kq = quantize_channels(keys, fmt)
        return QuantizedChannels(kq.codes, kq.scales, kq.group, fmt, rounding), vq
    kq = quantize(keys, fmt)
    return QuantizedRows(kq.codes, kq.scales, fmt, rounding), vq


def _rounding(q4, keys, values, p, terms, norm2, pi, fmt: str, layout: str, bound: str, scale) -> torch.Tensor:
    """(b, h_kv, m) each window query's predicted relative rounding term (``"variance"``: R_q / ||o_q||^2;
    ``"strict"``: B_q / ||o_q||) of the population stored at ``fmt``, a sample drawn with ``pi``."""
    b, h_kv, m = norm2.shape
    if bound == "strict":
        kq, vq = _stored(keys, values, fmt, layout, "nearest")
        b_q = quantization_bound(q4, kq, vq, torch.ones_like(pi), scale=scale).reshape(b, h_kv, m)
        return _relative(b_q, norm2, 0.5)
    kq, vq = _stored(keys, values, fmt, layout, "stochastic")
    vvar = vq.variance_bound(torch.float64).sum(dim=-1)[:, :, None, :]            # (b, h_kv, 1, n)
    sigma2 = 0.0 if layout == "values" else logit_variance(q4, kq, scale=scale).reshape(p.shape)
    r_q = ((sigma2 * terms + p * p * vvar) / pi[:, :, None, :]).sum(dim=-1)
    return _relative(r_q, norm2)


def _pi_at(u: torch.Tensor, kept: float, n: int, *, sinks, window, top, top_fraction, floor):
    """pi (b, h_kv, n) at the expected kept count, as :meth:`kvcert.fast.TokenDesign.decide` solves it (``top``
    None: :func:`kvcert.fast.design_sizes`; an int: that certainty set at every width), or None where the
    certainty set is not below the count."""
    if kept >= n:
        return torch.ones_like(u)
    if top is None:
        sz = design_sizes(kept, sinks=sinks, window=window, top_fraction=top_fraction, randomized=True)
        sinks, window, top = sz.sinks, sz.window, sz.top
    if sinks + window + top >= kept:
        return None
    tops = torch.full(tuple(u.shape[:-1]), int(top), dtype=torch.int64, device=u.device)
    valid = torch.ones(u.shape, dtype=torch.bool, device=u.device)
    return inclusion_probabilities(u, kept, sinks=sinks, window=window, top=tops, floor=floor, valid=valid)


def choose_kv_bits(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor,
                   budget: float, *, delta: float = 0.05, kind: str = "chebyshev", sinks: int = 4, window: int = 32,
                   top: int | None = None, top_fraction: float = 0.0, floor: float = 0.1,
                   scale: float | None = None, layout: str = "channel", quantized_bound: str = "variance",
                   extra: float = 0.0) -> BitsChoice:
    r"""Per (row, KV head), the width of ``KV_BITS`` whose design at the memory of ``budget`` 16-bit tokens has
    the smallest predicted certificate for the window queries (module docstring), as
    ``kvcert.reference.choose_kv_bits`` head by head.

    Parameters
    ----------
    queries : (b, h_q, w, d), the window queries (h_q = g h_kv)
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), the event's tokens (no padding)
    importance : (b, h_kv, n), the scorer's scores (negative ones shifted per head)
    budget : float > 0, the memory to compare at, in 16-bit tokens
    delta, kind : the radius rule (a kind of :data:`kvcert.fast.TARGET_KINDS`)
    sinks, window, top, top_fraction, floor : the certainty set (``top`` None: sized at each count by
        :func:`kvcert.fast.design_sizes` with ``top_fraction``, as the token design; an int: kept at every width)
    scale : float, default 1/sqrt(d)   layout : a name of ``KV_LAYOUTS``
    quantized_bound : a name of ``QUANTIZED_BOUNDS``   extra : float >= 0, a sketch's elements

    Returns
    -------
    BitsChoice
    """
    layout, bound = check_kv_layout(layout, "layout"), check_quantized_bound(quantized_bound)
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind: kv_bits='auto' compares radii that are functions of the variance trace, one of "
                         f"{TARGET_KINDS}; got {kind!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0.0 < float(budget) < math.inf:
        raise ValueError(f"budget must be a finite float > 0, got {budget!r}")
    terms, norm2 = window_variance_terms(queries, keys, values, scale=scale)    # (b, h_kv, m, n), (b, h_kv, m)
    b, h_kv, n, d = keys.shape
    dv = values.shape[-1]
    importance = check_tensor("importance", importance, floating=True)
    if tuple(importance.shape) != (b, h_kv, n) or not bool(torch.isfinite(importance).all()):
        raise ValueError(f"importance must be a finite tensor of shape (b, h_kv, n) = ({b}, {h_kv}, {n})")
    u = nonnegative_importance(importance.to(torch.float64))
    q4 = queries.to(torch.float64)
    q = q4.reshape(b, h_kv, -1, d)
    p = torch.softmax(check_scale(scale, d) * (q @ keys.to(torch.float64).transpose(-1, -2)), dim=-1)
    k64, v64 = keys.to(torch.float64), values.to(torch.float64)
    inf = torch.full((b, h_kv), math.inf, dtype=torch.float64, device=keys.device)
    preds = []
    for bits in KV_BITS:
        kept = kept_at_bits(float(budget), n, d, dv, bits, extra=extra, layout=layout)
        pi = None if kept is None else _pi_at(u, kept, n, sinks=sinks, window=window, top=top,
                                              top_fraction=top_fraction, floor=floor)
        if pi is None:
            preds.append(BitsPrediction(bits, math.inf if kept is None else kept, inf, inf, inf))
            continue
        radius = predicted_radius(terms, norm2, pi, kind=kind, delta=delta)
        if bits == 16:
            preds.append(BitsPrediction(bits, kept, radius, torch.zeros_like(radius), radius))
            continue
        rel = _rounding(q4, k64, v64, p, terms, norm2, pi, KV_FORMAT[bits], layout, bound, scale)
        if bound == "strict":
            rounding = (rel * rel).mean(-1).sqrt()
            preds.append(BitsPrediction(bits, kept, radius, rounding, radius + rounding))
            continue
        rel_v = _relative((terms @ (1.0 / pi - 1.0).unsqueeze(-1)).squeeze(-1), norm2)
        rounding = radius_from_moments(kind, delta, trace=rel.mean(-1))
        total = radius_from_moments(kind, delta, trace=(rel_v + rel).mean(-1))
        preds.append(BitsPrediction(bits, kept, radius, rounding, total))
    chosen = torch.full((b, h_kv), KV_BITS[0], dtype=torch.int64, device=keys.device)
    low = preds[0].total
    for pred in preds[1:]:
        better = pred.total < low                                    # strictly smaller: ties keep more bits
        chosen = torch.where(better, pred.bits, chosen)
        low = torch.where(better, pred.total, low)
    return BitsChoice(chosen, tuple(preds))

