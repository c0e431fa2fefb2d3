r"""Quantized KV caches: per-token rounding, and a certificate that covers rounding and sampling.

One KV head, one query, float64 NumPy, written to be read beside docs/quantized.md.

A kept token's key and value are stored as codes with one scale per row (per token):

.. math::

    Q(x) = s\,c, \qquad s = \mathrm{up}_{16}\Big(\frac{\max_j |x_j|}{t}\Big), \qquad
    c = \mathrm{round}(x / s),

with :math:`t` the format's largest code (:data:`FORMATS`: 127 for ``int8``, 7 for ``int4``, 448 for
``e4m3``), ``round`` to the nearest code (integers, or float8 e4m3 values) and
:math:`\mathrm{up}_{16}` rounding the scale *up* to a float16 number (the scale is stored in 16 bits, and
rounding it up keeps :math:`|x/s| \le t`, so no code is clipped). Per element,

.. math::

    |x_j - Q(x)_j| \le s/2 \ \ (\text{int}), \qquad
    |x_j - Q(x)_j| \le s\,\max(2^{-4} |c_j|,\ 2^{-10}) \ \ (\text{e4m3}),

bounds computed from what the cache stores (:meth:`QuantizedRows.error_bound`). From them,
:func:`logit_bound` bounds each kept token's logit change :math:`|\tau q\cdot(k_i - Q(k_i))| \le \eta_i`,
:func:`value_bound` its value change :math:`\lVert v_i - Q(v_i)\rVert \le \epsilon_i`, and
:func:`quantization_bound` the change of the Hajek estimate over the same sample,
:math:`\lVert\hat o_q - \hat o\rVert \le B_q`, on every input (docs/quantized.md, Proposition 2).
``evict_and_certify(..., kv_bits=8)`` stores its kept tokens this way and certifies
:math:`\lVert\hat o_q - o\rVert \le B_q + r`.

Memory (16-bit elements per kept token, :func:`token_elements`): :math:`(d + d_v)\,b/16` for the key and
value, 2 scales, and :math:`\log\pi_i`; 16 bits is the unquantized :math:`d + d_v + 1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from scipy.special import logsumexp

from .certificates import certificate, radius_from_moments
from .design import certainty_mask, inclusion_probabilities
from .estimators import _as_qkv, hajek_attention
from .sketch import (
    RECOMMENDED_KIND,
    TILTED,
    TOKEN_SCALARS,
    EvictionResult,
    _sample,
    cluster_sketch,
    cluster_variance,
    hull_bound,
    radius_from_variance,
    sketched_variance,
)

__all__ = [
    "FORMATS",
    "KV_BITS",
    "KV_FORMAT",
    "QuantizedRows",
    "logit_bound",
    "quantization_bound",
    "quantize",
    "quantized_memory_fraction",
    "sampled_budget",
    "token_elements",
    "value_bound",
]

#: the bit widths ``evict_and_certify(kv_bits=...)`` accepts; 16 stores keys and values unquantized
KV_BITS = (16, 8, 4)
#: format name -> largest code t (a row's absmax maps to t): symmetric integers and float8 e4m3 (fn variant)
FORMATS = MappingProxyType({"int8": 127.0, "int4": 7.0, "e4m3": 448.0})
#: the format a quantized ``kv_bits`` stores
KV_FORMAT = MappingProxyType({8: "int8", 4: "int4"})
#: scales per kept token (one for its key row, one for its value row), each a 16-bit element
SCALES_PER_TOKEN = 2
#: e4m3: mantissa bits, and the exponent of the smallest normal number (2^-6); subnormals are spaced 2^-9
E4M3_MANTISSA, E4M3_MIN_EXPONENT = 3, -6
#: e4m3 rounding: relative to the stored code (half a spacing of its binade), and absolute among subnormals
E4M3_RELATIVE, E4M3_ABSOLUTE = 2.0 ** -(E4M3_MANTISSA + 1), 2.0 ** (E4M3_MIN_EXPONENT - E4M3_MANTISSA - 1)


def _round_e4m3(y) -> np.ndarray:
    """Round to the nearest float8 e4m3 value (ties to even), for |y| <= 448: 3 mantissa bits in each binade
    [2^e, 2^(e+1)), e >= -6, and the subnormal spacing 2^-9 below 2^-6."""
    a = np.abs(y)
    _, ex = np.frexp(a)                                                # a = m 2^ex, m in [1/2, 1)
    step = np.ldexp(1.0, np.maximum(ex - 1, E4M3_MIN_EXPONENT) - E4M3_MANTISSA)
    return np.sign(y) * np.round(a / step) * step


def _check_format(fmt) -> str:
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {fmt!r}")
    return fmt


@dataclass(frozen=True)
class QuantizedRows:
    r"""Rows stored as codes with one 16-bit scale per row: :math:`Q(x)_i = s_i c_i`.

    Attributes
    ----------
    codes : (n, m) float64, the codes: integers in [-t, t] (``int8``, ``int4``) or float8 e4m3 values
        in [-448, 448]
    scales : (n,) float64, float16 numbers >= 0; 0 stores an all-zero row (its codes must be 0)
    format : str, a name of :data:`FORMATS`

    Raises
    ------
    ValueError
        A format not in :data:`FORMATS`, codes that are not the format's (non-integer, out of range,
        not an e4m3 value, NaN), scales of the wrong shape, NaN, infinite, negative or not float16
        numbers, or a zero scale on a row with a non-zero code.
    """

    codes: np.ndarray
    scales: np.ndarray
    format: str

    def __post_init__(self):
        fmt = _check_format(self.format)
        c = np.asarray(self.codes, dtype=np.float64)
        s = np.asarray(self.scales, dtype=np.float64)
        if c.ndim != 2:
            raise ValueError(f"codes must have shape (n, m), got shape {c.shape}")
        top = FORMATS[fmt]
        if not np.all(np.abs(c) <= top):
            raise ValueError(f"codes must lie in [-{top:g}, {top:g}] for {fmt} (found a value outside, or NaN)")
        exact = _round_e4m3(c) if fmt == "e4m3" else np.round(c)
        if not np.array_equal(exact, c):
            raise ValueError(f"codes must be {'float8 e4m3 values' if fmt == 'e4m3' else 'integers'} for {fmt}")
        if s.shape != (c.shape[0],):
            raise ValueError(f"scales must have shape (n,) = ({c.shape[0]},), got shape {s.shape}")
        if not np.all(np.isfinite(s) & (s >= 0)):
            raise ValueError("scales must be finite and >= 0 (found NaN, inf or a negative scale)")
        if not np.array_equal(s.astype(np.float16).astype(np.float64), s):
            raise ValueError("scales must be float16 numbers (the cache stores them in 16 bits)")
        if np.any((s == 0) & np.any(c != 0, axis=1)):
            raise ValueError("a zero scale stores an all-zero row: scales must be > 0 where a row has a non-zero "
                             "code")
        object.__setattr__(self, "codes", c)
        object.__setattr__(self, "scales", s)

    def dequantize(self) -> np.ndarray:
        """(n, m) the stored rows :math:`s_i c_i`."""
        return self.scales[:, None] * self.codes

    def error_bound(self) -> np.ndarray:
        r"""(n, m) a bound on :math:`|x_{ij} - s_i c_{ij}|` from the stored codes and scales alone:
        :math:`s_i/2` (integers: round to nearest) or :math:`s_i \max(2^{-4}|c_{ij}|, 2^{-10})` (e4m3: half a
        spacing, relative to the code in a normal binade, absolute among the subnormals)."""
        if self.format == "e4m3":
            return self.scales[:, None] * np.maximum(E4M3_RELATIVE * np.abs(self.codes), E4M3_ABSOLUTE)
        return np.broadcast_to(self.scales[:, None] / 2.0, self.codes.shape).copy()

    def rows(self, index) -> "QuantizedRows":
        """The rows ``index`` (a boolean mask or integer index) as QuantizedRows."""
        return QuantizedRows(codes=self.codes[index], scales=self.scales[index], format=self.format)


def _scales_up(absmax: np.ndarray, top: float) -> np.ndarray:
    """absmax / top rounded up to a float16 number (0 stays 0); ValueError if one overflows float16."""
    s = absmax / top
    with np.errstate(over="ignore"):                                   # an overflow is refused just below
        s16 = s.astype(np.float16)
    low = s16.astype(np.float64) < s
    s16[low] = np.nextafter(s16[low], np.float16(np.inf))
    if not np.all(np.isfinite(s16)):
        raise ValueError(f"x must have |x| <= {float(np.finfo(np.float16).max) * top:g} per row: larger rows "
                         f"overflow a float16 scale")
    return s16.astype(np.float64)


def quantize(x, format: str) -> QuantizedRows:
    r"""Quantize each row of x with its own absmax scale.

    .. math::

        s_i = \mathrm{up}_{16}\big(\max_j |x_{ij}| / t\big), \qquad c_{ij} = \mathrm{round}(x_{ij}/s_i),
        \qquad Q(x)_i = s_i c_i,

    t the format's largest code (:data:`FORMATS`), ``round`` to the nearest integer or float8 e4m3 value
    (ties to even), :math:`\mathrm{up}_{16}` rounding up to a float16 number (so :math:`|x_{ij}/s_i| \le t`);
    an all-zero row gets scale 0 and codes 0.

    Parameters
    ----------
    x : (n, m) finite   format : a name of :data:`FORMATS` (``"int8"``, ``"int4"``, ``"e4m3"``)

    Returns
    -------
    QuantizedRows, whose :meth:`~QuantizedRows.error_bound` holds for x

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference.quantized import quantize
    >>> x = np.array([[0.6, -1.75, 0.3], [0.0, 0.0, 0.0]])
    >>> qx = quantize(x, "int4")
    >>> qx.codes, qx.scales
    (array([[ 2., -7.,  1.],
           [ 0.,  0.,  0.]]), array([0.25, 0.  ]))
    >>> bool(np.all(np.abs(x - qx.dequantize()) <= qx.error_bound()))
    True
    """
    top = FORMATS[_check_format(format)]
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"x must have shape (n, m), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("x must be finite (found NaN or inf)")
    s = _scales_up(np.max(np.abs(a), axis=1, initial=0.0), top)
    y = np.clip(a / np.where(s > 0, s, 1.0)[:, None], -top, top)
    codes = _round_e4m3(y) if format == "e4m3" else np.round(y)
    return QuantizedRows(codes=codes + 0.0, scales=s, format=format)   # + 0.0: no -0.0 codes


def logit_bound(q, keys: QuantizedRows, *, scale: float | None = None) -> np.ndarray:
    r"""(n,) :math:`\eta_i \ge |\tau\, q\cdot(k_i - Q(k_i))|` for every key the stored row can stand for.

    .. math:: \eta_i = \tau \sum_j |q_j|\, e_{ij}, \qquad e = \text{keys.error\_bound()},

    which for the integer formats is :math:`\tau\lVert q\rVert_1 s_i/2`. It is the largest logit change over
    the box of keys that round to the stored codes, so no bound from the stored row alone is smaller.
    """
    q = np.asarray(q, dtype=np.float64)
    if not isinstance(keys, QuantizedRows):
        raise TypeError(f"keys must be QuantizedRows (see quantize), got {type(keys).__name__}")
    if q.shape != (keys.codes.shape[1],) or not np.all(np.isfinite(q)):
        raise ValueError(f"q must be a finite (d,) = ({keys.codes.shape[1]},) vector, got shape {q.shape}")
    tau = 1.0 / np.sqrt(q.shape[0]) if scale is None else float(scale)
    return tau * keys.error_bound() @ np.abs(q)


def value_bound(values: QuantizedRows) -> np.ndarray:
    r"""(n,) :math:`\epsilon_i \ge \lVert v_i - Q(v_i)\rVert_2`: the norm of the per-element bounds,
    :math:`\sqrt{d_v}\, s_i/2` for the integer formats."""
    if not isinstance(values, QuantizedRows):
        raise TypeError(f"values must be QuantizedRows (see quantize), got {type(values).__name__}")
    return np.sqrt(np.sum(values.error_bound() ** 2, axis=1))


def quantization_bound(q, keys: QuantizedRows, values: QuantizedRows, pi, *, scale: float | None = None) -> float:
    r"""A bound on :math:`\lVert\hat o_q - \hat o\rVert` from the stored rows: the rounding's effect on the
    Hajek estimate over one sample.

    :math:`\hat o_q = \sum_S w'_i Q(v_i)` is the Hajek estimate over the kept tokens' stored keys and values,
    :math:`\hat o = \sum_S w_i v_i` the same sample's estimate with the exact ones (logits
    :math:`\tau q\cdot k_i - \log\pi_i`). With :math:`\eta_i` (:func:`logit_bound`) and :math:`\epsilon_i`
    (:func:`value_bound`),

    .. math::

        B_q = \sum_{i\in S} w'_i \big( g_i \lVert Q(v_i) - \hat o_q\rVert + h_i \epsilon_i \big),
        \qquad h_i = \frac{e^{\eta_i}}{F_-},\quad g_i = \max\Big(h_i - 1,\ 1 - \frac{e^{-\eta_i}}{F_+}\Big),

        F_- = \sum_{j\in S} w'_j e^{-\eta_j}, \qquad F_+ = \sum_{j\in S} w'_j e^{\eta_j},

    and :math:`\lVert\hat o_q - \hat o\rVert \le B_q` for every input (docs/quantized.md, Proposition 2:
    :math:`w_i/w'_i \in [e^{-\eta_i}/F_+,\ e^{\eta_i}/F_-]`, and
    :math:`\hat o_q - \hat o = \sum_S (w'_i - w_i)(Q(v_i) - \hat o_q) + \sum_S w_i (Q(v_i) - v_i)`).
    With :math:`\eta = \max_S \eta_i` it is at most
    :math:`(e^{2\eta} - 1)\sum_S w'_i\lVert Q(v_i) - \hat o_q\rVert + e^{2\eta}\max_S\epsilon_i`.

    Parameters
    ----------
    q : (d,)   keys : QuantizedRows (n, d)   values : QuantizedRows (n, dv), the kept tokens as stored
    pi : (n,) their inclusion probabilities in [0, 1] (0: padding)   scale : float, default 1/sqrt(d)

    Returns
    -------
    float >= 0; 0 when nothing is rounded (all scales 0), +inf for an empty sample or a logit bound
    too large for exp.
    """
    if not isinstance(keys, QuantizedRows) or not isinstance(values, QuantizedRows):
        raise TypeError("keys and values must be QuantizedRows (see quantize)")
    q, kq, vq = _as_qkv(q, keys.dequantize(), values.dequantize())
    est = hajek_attention(q, kq, vq, pi, scale=scale)
    w = est.weights
    on = w > 0
    if not np.any(on):
        return float("inf")
    eta = logit_bound(q, keys, scale=scale)[on]
    eps = value_bound(values)[on]
    w, dist = w[on], np.linalg.norm(vq[on] - est.output, axis=1)
    log_f_low, log_f_high = logsumexp(np.log(w) - eta), logsumexp(np.log(w) + eta)
    with np.errstate(over="ignore", invalid="ignore"):                 # exp overflow: B_q = +inf
        h_minus_1 = np.expm1(eta - log_f_low)                          # w_i / w'_i <= 1 + h_minus_1
        g = np.maximum(h_minus_1, -np.expm1(-eta - log_f_high))         # |w_i / w'_i - 1| <= g
        terms = np.where(dist > 0, g * dist, 0.0) + np.where(eps > 0, (1.0 + h_minus_1) * eps, 0.0)
    return float(np.sum(w * terms))


def _check_kv_bits(kv_bits) -> int:
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, (int, np.integer)) or int(kv_bits) not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (16: unquantized), got {kv_bits!r}")
    return int(kv_bits)


def token_elements(d: int, dv: int, kv_bits: int) -> float:
    r"""16-bit elements held per kept token at ``kv_bits``: :math:`(d + d_v)\,b/16 + 2\,[b < 16] + 1`
    (key and value codes, their two scales, :math:`\log\pi_i`); :math:`d + d_v + 1` at 16 bits."""
    b = _check_kv_bits(kv_bits)
    for name, v in (("d", d), ("dv", dv)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return (d + dv) * b / 16.0 + (SCALES_PER_TOKEN if b < 16 else 0) + TOKEN_SCALARS


def sampled_budget(budget: float, d: int, dv: int, kv_bits: int, *, extra: float = 0.0) -> float:
    r"""The expected kept count a design samples at ``kv_bits`` in the memory of ``budget`` unquantized tokens.

    .. math:: B_b = \frac{B\,(d + d_v + 1) - E}{(d + d_v)\,b/16 + 2 + 1},

    E = ``extra`` elements of a sketch (:meth:`ClusterDesign.elements`), so that the expected memory
    :math:`B_b` :func:`token_elements` :math:`+ E` equals the paper design's at 16 bits,
    :math:`B\,(d + d_v + 1)`.
    """
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    return (float(budget) * token_elements(d, dv, 16) - float(extra)) / token_elements(d, dv, kv_bits)


def quantized_memory_fraction(n: int, d: int, dv: int, *, kept: int, kv_bits: int, extra: float = 0.0) -> float:
    r"""Fraction of the full 16-bit cache's K+V memory held at ``kv_bits``.

    .. math:: M = \frac{|S|\,\big((d + d_v)\,b/16 + 2 + 1\big) + E}{n\,(d + d_v)},

    and :math:`M = ((d + d_v)\,b/16 + 2)/(d + d_v)` when ``kept == n`` (nothing evicted: no
    :math:`\log\pi`, no sketch); at 16 bits it is ``memory_fraction``.
    """
    per_token = token_elements(d, dv, kv_bits)
    if not (0 <= kept <= n):
        raise ValueError(f"kept must be in [0, n] = [0, {n}], got {kept}")
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    if kept == n:
        return (per_token - TOKEN_SCALARS) / float(d + dv)
    return (kept * per_token + float(extra)) / float(n * (d + dv))


def _quantized_hull(values_q: QuantizedRows, pi, sketch, *, output) -> float:
    r"""The hull bound on :math:`\lVert\hat o_q - o\rVert`: ``hull_bound`` of the stored kept values plus
    :math:`\max_S \epsilon_i` (an exact kept value lies within :math:`\epsilon_i` of its stored one, and
    :math:`\hat o_q` is a convex combination of the stored values)."""
    eps = value_bound(values_q)
    return hull_bound(values_q.dequantize(), pi, sketch, output=output) + (float(eps.max()) if eps.size else 0.0)


def _evict_quantized(q, k, v, u, budget: float, *, seed: int, delta: float, spec, name: str, sinks: int,
                     window: int, top: int, floor: float, scale, tilt, sampling: str, kv_bits: int) -> EvictionResult:
    """``evict_and_certify`` at ``kv_bits`` < 16 (arguments already checked there): the design samples at
    :func:`sampled_budget`, its kept tokens are stored by :func:`quantize`, the radius is
    min(B_q + r, H_q) (docs/quantized.md)."""
    n, d = k.shape
    dv = v.shape[1]
    fmt = KV_FORMAT[kv_bits]
    extra = 0.0 if spec is None else float(spec.elements(d, dv))
    if sampled_budget(budget, d, dv, kv_bits) >= n:                   # the whole cache fits at kv_bits
        kq, vq = quantize(k, fmt), quantize(v, fmt)
        est = hajek_attention(q, kq.dequantize(), vq.dequantize(), np.ones(n), scale=scale)
        b_q = quantization_bound(q, kq, vq, np.ones(n), scale=scale)
        return EvictionResult(output=est.output, radius=b_q, memory=quantized_memory_fraction(
            n, d, dv, kept=n, kv_bits=kv_bits), design=name, budget=float(n), kept=n, variance=0.0,
            quantization_bound=b_q)
    b_design = sampled_budget(budget, d, dv, kv_bits, extra=extra)
    certain = certainty_mask(u, sinks=sinks, window=window, top=top)
    if spec is not None and b_design <= certain.sum():
        raise ValueError(
            f"budget = {budget} is too small for the {name} design at kv_bits = {kv_bits}: its sketch "
            f"({spec.elements(d, dv)} elements) leaves an expected {b_design:.3g} kept tokens, not above the "
            f"certainty set |C| = {int(certain.sum())}; raise budget")
    pi = inclusion_probabilities(u, b_design, sinks=sinks, window=window, top=top, floor=floor)
    keep = _sample(pi, seed, sampling)
    kq, vq = quantize(k[keep], fmt), quantize(v[keep], fmt)       # per-token: the same rows as quantizing all
    kept = int(keep.sum())
    est = hajek_attention(q, kq.dequantize(), vq.dequantize(), pi[keep], scale=scale)
    b_q = quantization_bound(q, kq, vq, pi[keep], scale=scale)
    if spec is None:
        radius = b_q + float(certificate(est, delta=delta, kind="chebyshev").radius)
        return EvictionResult(output=est.output, radius=radius, memory=quantized_memory_fraction(
            n, d, dv, kept=kept, kv_bits=kv_bits), design=name, budget=b_design, kept=kept,
            variance=float(est.trace), quantization_bound=b_q)
    sk = cluster_sketch(k, v, pi, keep, spec, tilt=tilt, scale=scale)  # at eviction, from the exact cache
    v_cl = cluster_variance(q, kq.dequantize(), vq.dequantize(), pi[keep], sk, output=est.output, scale=scale)
    var = sketched_variance(v_cl, est.trace)
    cap = _quantized_hull(vq, pi[keep], sk, output=est.output)
    if spec == TILTED:
        r = float(radius_from_moments(RECOMMENDED_KIND, delta, trace=var, bound=cap))
    else:
        r = min(radius_from_variance(var, delta=delta, rule=spec.radius, multiplier=spec.multiplier), cap)
    memory = quantized_memory_fraction(n, d, dv, kept=kept, kv_bits=kv_bits, extra=extra if kept < n else 0.0)
    return EvictionResult(output=est.output, radius=min(b_q + r, cap), memory=memory, design=name,
                          budget=b_design, kept=kept, variance=float(var), cluster_variance=float(v_cl),
                          quantization_bound=b_q)
