r"""Quantized KV caches: rounding, and a certificate that covers rounding and sampling.

One KV head, one query, float64 NumPy, written to be read beside docs/quantized.md.

A kept token's key and value are stored as codes with a scale per row (per token, :func:`quantize`) or, for
keys, per channel and group of kept tokens (:func:`quantize_channels`, KIVI's layout):

.. math::

    Q(x) = s\,c, \qquad s = \mathrm{up}_{16}\Big(\frac{\max |x|}{t}\Big), \qquad c = \mathrm{round}(x / s),

with :math:`t` the format's largest code (:data:`FORMATS`: 127 for ``int8``, 7 for ``int4``, 448 for
``e4m3``), the max over the elements that share the scale, and :math:`\mathrm{up}_{16}` rounding the scale
*up* to a float16 number (the scale is stored in 16 bits, and rounding it up keeps :math:`|x/s| \le t`, so no
code is clipped). ``round`` is one of :data:`ROUNDINGS`:

- ``"nearest"``: the nearest code (integers, or float8 e4m3 values), ties to even. Per element
  :math:`|x_j - Q(x)_j| \le s/2` (int) or :math:`s\,\max(2^{-4}|c_j|, 2^{-10})` (e4m3).
- ``"stochastic"`` (integer formats): :math:`c_j = \lfloor y_j\rfloor + [U_j < y_j - \lfloor y_j\rfloor]`,
  :math:`y = x/s`, with uniforms :math:`U_j` passed in (a ``numpy.random.Generator``, e.g.
  :func:`rounding_generator`, or the uniforms themselves). Then :math:`E\,Q(x)_j = x_j` (unbiased),
  :math:`\mathrm{Var}\,Q(x)_j = s^2 p_j(1 - p_j) \le s^2/4`, :math:`|x_j - Q(x)_j| < s`, independently
  across elements (:meth:`QuantizedRows.variance_bound`).

From the stored codes and scales and q:

- :func:`logit_bound`: :math:`\eta_i \ge |\tau q\cdot(k_i - Q(k_i))|` on every input;
  :func:`logit_variance`: :math:`\sigma_i^2 \ge \mathrm{Var}(\tau q\cdot Q(k_i))` under stochastic rounding;
- :func:`value_bound`: :math:`\epsilon_i \ge \lVert v_i - Q(v_i)\rVert`;
- :func:`quantization_bound`: :math:`B_q \ge \lVert\hat o_q - \hat o\rVert` on every input (docs/quantized.md,
  Proposition 2), the strict certificate's rounding term;
- :func:`quantization_variance`: :math:`V_q`, the variance stochastic rounding adds to the Hajek estimate
  (its value part exact, its key part the delta method's; docs/quantized.md, section 4), the ``"variance"``
  certificate's rounding term.

``evict_and_certify(..., kv_bits=8, kv_layout=..., quantized_bound=...)`` stores its kept tokens this way and
certifies :math:`\lVert\hat o_q - o\rVert` by :math:`B_q + r` (``"strict"``: round to nearest) or by the
design's radius rule on :math:`V + V_q` (``"variance"``: stochastic rounding from :func:`rounding_generator`).

Memory (16-bit elements per kept token, :func:`token_elements`): the codes, the scales and
:math:`\log\pi_i`; 16 bits is the unquantized :math:`d + d_v + 1`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from scipy.special import logsumexp

from .certificates import certificate, radius_from_moments
from .design import check_nonneg_int, certainty_mask, inclusion_probabilities
from .estimators import as_qkv, hajek_attention
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
    "CHANNEL_GROUP",
    "FORMATS",
    "KV_BITS",
    "KV_FORMAT",
    "KV_LAYOUTS",
    "QUANTIZED_BOUNDS",
    "ROUNDINGS",
    "QuantizedChannels",
    "QuantizedRows",
    "logit_bound",
    "logit_variance",
    "quantization_bound",
    "quantization_variance",
    "quantize",
    "quantize_channels",
    "quantized_memory_fraction",
    "rounding_generator",
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
#: how a value becomes a code: the nearest code, or unbiased stochastic rounding (integer formats)
ROUNDINGS = ("nearest", "stochastic")
#: what ``evict_and_certify(kv_layout=...)`` stores: "token" keys and values with one scale per token;
#: "channel" keys with one scale per channel and group of CHANNEL_GROUP kept tokens (KIVI), values per token;
#: "values" keys unquantized (16 bits), values per token
KV_LAYOUTS = ("token", "channel", "values")
#: the rounding term of a quantized certificate: "strict" B_q (round to nearest, added to the radius) or
#: "variance" V_q (stochastic rounding, added to the design's variance before its radius rule)
QUANTIZED_BOUNDS = ("strict", "variance")
#: kept tokens per group of the "channel" layout's key scales (KIVI's group size along tokens)
CHANNEL_GROUP = 32
#: scales per kept token of the "token" layout (one for its key row, one for its value row), 16 bits each
SCALES_PER_TOKEN = 2
#: the last entropy word of :func:`rounding_generator`: its stream is not ``design_generator``'s
ROUNDING_STREAM = 0x5152
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


def _check_rounding(rounding, fmt: str) -> str:
    if not isinstance(rounding, str) or rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and fmt == "e4m3":
        raise ValueError("rounding='stochastic' needs an integer format ('int8', 'int4'), got format 'e4m3'")
    return rounding


def _check_codes(codes, fmt: str) -> np.ndarray:
    c = np.asarray(codes, dtype=np.float64)
    if c.ndim != 2:
        raise ValueError(f"codes must have shape (n, m), got shape {c.shape}")
    top = FORMATS[fmt]
    if not np.all(np.abs(c) <= top):
        raise ValueError(f"codes must lie in [-{top:g}, {top:g}] for {fmt} (found a value outside, or NaN)")
    exact = _round_e4m3(c) if fmt == "e4m3" else np.round(c)
    if not np.array_equal(exact, c):
        raise ValueError(f"codes must be {'float8 e4m3 values' if fmt == 'e4m3' else 'integers'} for {fmt}")
    return c


def _check_scales(scales, shape: tuple, what: str) -> np.ndarray:
    s = np.asarray(scales, dtype=np.float64)
    if s.shape != shape:
        raise ValueError(f"scales must have shape {what} = {shape}, got shape {s.shape}")
    if not np.all(np.isfinite(s) & (s >= 0)):
        raise ValueError("scales must be finite and >= 0 (found NaN, inf or a negative scale)")
    if not np.array_equal(s.astype(np.float16).astype(np.float64), s):
        raise ValueError("scales must be float16 numbers (the cache stores them in 16 bits)")
    return s


def _element_bound(scales: np.ndarray, codes: np.ndarray, fmt: str, rounding: str) -> np.ndarray:
    """Per element: s/2 (nearest integer), s (stochastic: the code is the floor or the ceiling of x/s),
    s max(2^-4 |c|, 2^-10) (nearest e4m3); ``scales`` broadcasts against ``codes``."""
    if fmt == "e4m3":
        return scales * np.maximum(E4M3_RELATIVE * np.abs(codes), E4M3_ABSOLUTE)
    return np.broadcast_to(scales / 2.0 if rounding == "nearest" else scales, codes.shape).copy()


def _element_variance(scales: np.ndarray, codes: np.ndarray, rounding: str, name: str) -> np.ndarray:
    if rounding != "stochastic":
        raise ValueError(f"{name} must be stochastically rounded (rounding='stochastic') for a variance bound: "
                         f"round-to-nearest errors are not random")
    return np.broadcast_to(scales ** 2 / 4.0, codes.shape).copy()


@dataclass(frozen=True)
class QuantizedRows:
    r"""Rows stored as codes with one 16-bit scale per row: :math:`Q(x)_i = s_i c_i`.

    Attributes
    ----------
    codes : (n, m) float64, the codes: integers in [-t, t] (``int8``, ``int4``) or float8 e4m3 values
        in [-448, 448]
    scales : (n,) float64, float16 numbers >= 0; 0 stores an all-zero row (its codes must be 0)
    format : str, a name of :data:`FORMATS`
    rounding : str, one of :data:`ROUNDINGS` (default ``"nearest"``): how the codes were drawn, which sets
        the per-element bound (:meth:`error_bound`) and whether there is a variance (:meth:`variance_bound`)

    Raises
    ------
    ValueError
        A format not in :data:`FORMATS`, a rounding not in :data:`ROUNDINGS` (or stochastic e4m3), codes
        that are not the format's (non-integer, out of range, not an e4m3 value, NaN), scales of the wrong
        shape, NaN, infinite, negative or not float16 numbers, or a zero scale on a row with a non-zero code.
    """

    codes: np.ndarray
    scales: np.ndarray
    format: str
    rounding: str = "nearest"

    def __post_init__(self):
        fmt = _check_format(self.format)
        _check_rounding(self.rounding, fmt)
        c = _check_codes(self.codes, fmt)
        s = _check_scales(self.scales, (c.shape[0],), "(n,)")
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
        :math:`s_i/2` (integers, round to nearest), :math:`s_i` (integers, stochastic: :math:`c_{ij}` is the
        floor or the ceiling of :math:`x_{ij}/s_i`) or :math:`s_i \max(2^{-4}|c_{ij}|, 2^{-10})` (e4m3: half
        a spacing, relative to the code in a normal binade, absolute among the subnormals)."""
        return _element_bound(self.scales[:, None], self.codes, self.format, self.rounding)

    def variance_bound(self) -> np.ndarray:
        r"""(n, m) :math:`s_i^2/4 \ge \mathrm{Var}(s_i c_{ij}) = s_i^2 p_{ij}(1 - p_{ij})` of stochastic
        rounding (:math:`p_{ij}` the fractional part of :math:`x_{ij}/s_i`); ValueError for round to
        nearest."""
        return _element_variance(self.scales[:, None], self.codes, self.rounding, "rows")

    def rows(self, index) -> "QuantizedRows":
        """The rows ``index`` (a boolean mask or integer index) as QuantizedRows."""
        return QuantizedRows(codes=self.codes[index], scales=self.scales[index], format=self.format,
                             rounding=self.rounding)


@dataclass(frozen=True)
class QuantizedChannels:
    r"""Rows stored as codes with one 16-bit scale per channel and group of ``group`` consecutive rows
    (KIVI's key layout): :math:`Q(x)_{ij} = s_{g(i) j} c_{ij}`, :math:`g(i) = \lfloor i/\text{group}\rfloor`.

    Attributes
    ----------
    codes : (n, m) float64, integers in [-t, t] or e4m3 values, as :class:`QuantizedRows`
    scales : (ceil(n / group), m) float64, float16 numbers >= 0; 0 stores a (group, channel) of zeros
    group : int >= 1, rows per group (:data:`CHANNEL_GROUP` in ``evict_and_certify``)
    format : str   rounding : str, as :class:`QuantizedRows`

    Raises
    ------
    ValueError
        As :class:`QuantizedRows`, and ``group`` not an int >= 1.
    """

    codes: np.ndarray
    scales: np.ndarray
    group: int
    format: str
    rounding: str = "nearest"

    def __post_init__(self):
        fmt = _check_format(self.format)
        _check_rounding(self.rounding, fmt)
        if isinstance(self.group, bool) or not isinstance(self.group, (int, np.integer)) or self.group < 1:
            raise ValueError(f"group must be an int >= 1, got {self.group!r}")
        c = _check_codes(self.codes, fmt)
        g = -(-c.shape[0] // int(self.group))
        s = _check_scales(self.scales, (g, c.shape[1]), "(ceil(n / group), m)")
        if np.any((self._expand(s, c.shape[0]) == 0) & (c != 0)):
            raise ValueError("a zero scale stores a group's channel of zeros: scales must be > 0 where the "
                             "channel has a non-zero code in the group")
        object.__setattr__(self, "codes", c)
        object.__setattr__(self, "scales", s)
        object.__setattr__(self, "group", int(self.group))

    def _expand(self, s: np.ndarray, n: int) -> np.ndarray:
        return np.repeat(s, int(self.group), axis=0)[:n]

    def scale_rows(self) -> np.ndarray:
        """(n, m) each element's scale :math:`s_{g(i) j}`."""
        return self._expand(self.scales, self.codes.shape[0])

    def dequantize(self) -> np.ndarray:
        """(n, m) the stored rows :math:`s_{g(i) j} c_{ij}`."""
        return self.scale_rows() * self.codes

    def error_bound(self) -> np.ndarray:
        """(n, m) the per-element bound of :meth:`QuantizedRows.error_bound`, with each element's scale."""
        return _element_bound(self.scale_rows(), self.codes, self.format, self.rounding)

    def variance_bound(self) -> np.ndarray:
        """(n, m) :math:`s^2/4` per element of stochastic rounding; ValueError for round to nearest."""
        return _element_variance(self.scale_rows(), self.codes, self.rounding, "rows")


_STORED = (QuantizedRows, QuantizedChannels)


def _scales_up(absmax: np.ndarray, top: float, per: str = "per row") -> np.ndarray:
    """absmax / top rounded up to a float16 number (0 stays 0); ValueError if one overflows float16."""
    s = absmax / top
    with np.errstate(over="ignore"):                                   # an overflow is refused just below
        s16 = s.astype(np.float16)
    low = s16.astype(np.float64) < s
    s16[low] = np.nextafter(s16[low], np.float16(np.inf))
    if not np.all(np.isfinite(s16)):
        raise ValueError(f"x must have |x| <= {float(np.finfo(np.float16).max) * top:g} {per}: larger values "
                         f"overflow a float16 scale")
    return s16.astype(np.float64)


def rounding_generator(seed: int, layer: int = 0, kv_head: int = 0, event: int = 0) -> np.random.Generator:
    """The stochastic-rounding stream of one (seed, layer, KV head, event):
    ``np.random.default_rng(SeedSequence([seed, layer, kv_head, event, ROUNDING_STREAM]))``, independent of
    the sampling stream ``design_generator(seed, layer, kv_head, event)`` (a different entropy pool), and
    replayable. ``evict_and_certify(quantized_bound="variance")`` draws from it the kept keys' uniforms
    (kept x d, row-major; none in the ``"values"`` layout), then the kept values' (kept x dv)."""
    for name, v in (("seed", seed), ("layer", layer), ("kv_head", kv_head), ("event", event)):
        check_nonneg_int(name, v)
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(layer), int(kv_head), int(event),
                                                         ROUNDING_STREAM]))


def _rounding_uniforms(shape: tuple, rounding: str, generator, uniforms):
    """None for round to nearest (which takes no randomness); the uniforms of stochastic rounding."""
    if rounding == "nearest":
        if generator is not None or uniforms is not None:
            raise ValueError("generator and uniforms are stochastic rounding's randomness: rounding='nearest' "
                             "takes neither")
        return None
    if (generator is None) == (uniforms is None):
        raise ValueError("rounding='stochastic' needs exactly one source of randomness: generator (e.g. "
                         "rounding_generator(seed)) or uniforms")
    if uniforms is None:
        if not isinstance(generator, np.random.Generator):
            raise TypeError(f"generator must be a numpy.random.Generator, got {type(generator).__name__}")
        return generator.random(shape)
    u = np.asarray(uniforms, dtype=np.float64)
    if u.shape != shape:
        raise ValueError(f"uniforms must have the shape of x, {shape}, got shape {u.shape}")
    if not np.all((u >= 0.0) & (u < 1.0)):
        raise ValueError("uniforms must lie in [0, 1) (found a value outside, or NaN)")
    return u


def _codes(y: np.ndarray, fmt: str, u) -> np.ndarray:
    """Codes of y = x / s (|y| <= t): nearest (u None; ties to even) or floor(y) + [u < y - floor(y)]."""
    if u is None:
        return _round_e4m3(y) if fmt == "e4m3" else np.round(y)
    f = np.floor(y)
    return f + (u < y - f)


def _check_x(x) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"x must have shape (n, m), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError("x must be finite (found NaN or inf)")
    return a


def quantize(x, format: str, *, rounding: str = "nearest", generator=None, uniforms=None) -> QuantizedRows:
    r"""Quantize each row of x with its own absmax scale.

    .. math::

        s_i = \mathrm{up}_{16}\big(\max_j |x_{ij}| / t\big), \qquad c_{ij} = \mathrm{round}(x_{ij}/s_i),
        \qquad Q(x)_i = s_i c_i,

    t the format's largest code (:data:`FORMATS`), :math:`\mathrm{up}_{16}` rounding up to a float16 number
    (so :math:`|x_{ij}/s_i| \le t`); an all-zero row gets scale 0 and codes 0. ``rounding="nearest"`` rounds
    to the nearest integer or float8 e4m3 value (ties to even); ``rounding="stochastic"`` (integer formats)
    takes :math:`c_{ij} = \lfloor y\rfloor + [U_{ij} < y - \lfloor y\rfloor]`, :math:`y = x_{ij}/s_i`, with
    the uniforms drawn from ``generator`` (``generator.random(x.shape)``) or given as ``uniforms``: an
    unbiased code, :math:`E[s_i c_{ij}] = x_{ij}`, with variance :math:`\le s_i^2/4`.

    Parameters
    ----------
    x : (n, m) finite   format : a name of :data:`FORMATS` (``"int8"``, ``"int4"``, ``"e4m3"``)
    rounding : one of :data:`ROUNDINGS`
    generator : numpy.random.Generator, or uniforms : (n, m) in [0, 1)
        Exactly one with ``rounding="stochastic"`` (e.g. :func:`rounding_generator`), neither otherwise.

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
    >>> quantize(x, "int4", rounding="stochastic", uniforms=np.full((2, 3), 0.5)).codes[0]
    array([ 2., -7.,  1.])
    """
    top = FORMATS[_check_format(format)]
    rounding = _check_rounding(rounding, format)
    a = _check_x(x)
    u = _rounding_uniforms(a.shape, rounding, generator, uniforms)
    s = _scales_up(np.max(np.abs(a), axis=1, initial=0.0), top)
    y = np.clip(a / np.where(s > 0, s, 1.0)[:, None], -top, top)
    return QuantizedRows(codes=_codes(y, format, u) + 0.0, scales=s, format=format,   # + 0.0: no -0.0 codes
                         rounding=rounding)


def quantize_channels(x, format: str, *, group: int = CHANNEL_GROUP, rounding: str = "nearest", generator=None,
                      uniforms=None) -> QuantizedChannels:
    r"""Quantize x with one absmax scale per channel and group of ``group`` consecutive rows (KIVI's key
    layout): :math:`s_{gj} = \mathrm{up}_{16}(\max_{i\in g}|x_{ij}|/t)`, :math:`c_{ij} =
    \mathrm{round}(x_{ij}/s_{g(i)j})`, with ``rounding``, ``generator`` and ``uniforms`` as in
    :func:`quantize`. A channel with one outlier token no longer sets the scale of every other channel.

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference.quantized import quantize_channels
    >>> x = np.array([[8.0, 0.5], [-4.0, 0.25], [1.0, 0.0]])
    >>> qx = quantize_channels(x, "int4", group=2)          # scales (2 groups, 2 channels)
    >>> qx.codes                                              # per token, channel 1 would round to 0
    array([[ 7.,  7.],
           [-3.,  3.],
           [ 7.,  0.]])
    >>> bool(np.all(np.abs(x - qx.dequantize()) <= qx.error_bound()))
    True
    """
    top = FORMATS[_check_format(format)]
    rounding = _check_rounding(rounding, format)
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    a = _check_x(x)
    u = _rounding_uniforms(a.shape, rounding, generator, uniforms)
    n, m = a.shape
    absmax = (np.maximum.reduceat(np.abs(a), np.arange(0, n, int(group)), axis=0) if n
              else np.zeros((0, m)))
    s = _scales_up(absmax, top, "per channel and group")
    se = np.repeat(s, int(group), axis=0)[:n]
    y = np.clip(a / np.where(se > 0, se, 1.0), -top, top)
    return QuantizedChannels(codes=_codes(y, format, u) + 0.0, scales=s, group=int(group), format=format,
                             rounding=rounding)


def _check_stored(x, name: str):
    if not isinstance(x, _STORED):
        raise TypeError(f"{name} must be QuantizedRows or QuantizedChannels (see quantize, quantize_channels), "
                        f"got {type(x).__name__}")
    return x


def _check_query(q, keys):
    q = np.asarray(q, dtype=np.float64)
    if q.shape != (keys.codes.shape[1],) or not np.all(np.isfinite(q)):
        raise ValueError(f"q must be a finite (d,) = ({keys.codes.shape[1]},) vector, got shape {q.shape}")
    return q


def logit_bound(q, keys, *, scale: float | None = None) -> np.ndarray:
    r"""(n,) :math:`\eta_i \ge |\tau\, q\cdot(k_i - Q(k_i))|` for every key the stored row can stand for.

    .. math:: \eta_i = \tau \sum_j |q_j|\, e_{ij}, \qquad e = \text{keys.error\_bound()},

    which for per-token integer rows rounded to nearest is :math:`\tau\lVert q\rVert_1 s_i/2`. It is the
    largest logit change over the box of keys that round to the stored codes, so no bound from the stored
    row alone is smaller. ``keys``: :class:`QuantizedRows` or :class:`QuantizedChannels`.
    """
    q = _check_query(q, _check_stored(keys, "keys"))
    tau = 1.0 / np.sqrt(q.shape[0]) if scale is None else float(scale)
    return tau * keys.error_bound() @ np.abs(q)


def logit_variance(q, keys, *, scale: float | None = None) -> np.ndarray:
    r"""(n,) :math:`\sigma_i^2 = \tau^2 \sum_j q_j^2\, s_{ij}^2/4 \ge \mathrm{Var}(\tau\, q\cdot Q(k_i))` for
    stochastically rounded keys (independent, unbiased codes: the variance of the sum is the sum of the
    :math:`\tau^2 q_j^2 s_{ij}^2 p_{ij}(1 - p_{ij})`). ValueError for keys rounded to nearest."""
    q = _check_query(q, _check_stored(keys, "keys"))
    if keys.rounding != "stochastic":
        raise ValueError("keys must be stochastically rounded (rounding='stochastic') for a logit variance: "
                         "round-to-nearest errors are not random")
    tau = 1.0 / np.sqrt(q.shape[0]) if scale is None else float(scale)
    return tau ** 2 * keys.variance_bound() @ (q * q)


def value_bound(values) -> np.ndarray:
    r"""(n,) :math:`\epsilon_i \ge \lVert v_i - Q(v_i)\rVert_2`: the norm of the per-element bounds,
    :math:`\sqrt{d_v}\, s_i/2` for integer rows rounded to nearest (:math:`\sqrt{d_v}\, s_i` stochastic)."""
    return np.sqrt(np.sum(_check_stored(values, "values").error_bound() ** 2, axis=1))


def _stored_keys(keys):
    """(stored keys (n, d), quantized?): QuantizedRows / QuantizedChannels, or an (n, d) array of exact keys
    (the ``"values"`` layout: no logit term)."""
    if isinstance(keys, _STORED):
        return keys.dequantize(), True
    if isinstance(keys, np.ndarray):
        return keys, False
    raise TypeError(f"keys must be QuantizedRows, QuantizedChannels or an (n, d) array of exact keys, "
                    f"got {type(keys).__name__}")


def quantization_bound(q, keys, values, pi, *, scale: float | None = None) -> float:
    r"""A bound on :math:`\lVert\hat o_q - \hat o\rVert` from the stored rows: the rounding's effect on the
    Hajek estimate over one sample.

    :math:`\hat o_q = \sum_S w'_i Q(v_i)` is the Hajek estimate over the kept tokens' stored keys and values,
    :math:`\hat o = \sum_S w_i v_i` the same sample's estimate with the exact ones (logits
    :math:`\tau q\cdot k_i - \log\pi_i`). With :math:`\eta_i` (:func:`logit_bound`; 0 for exact keys) and
    :math:`\epsilon_i` (:func:`value_bound`),

    .. math::

        B_q = \sum_{i\in S} w'_i \big( g_i \lVert Q(v_i) - \hat o_q\rVert + h_i \epsilon_i \big),
        \qquad h_i = \frac{e^{\eta_i}}{F_-},\quad g_i = \max\Big(h_i - 1,\ 1 - \frac{e^{-\eta_i}}{F_+}\Big),

        F_- = \sum_{j\in S} w'_j e^{-\eta_j}, \qquad F_+ = \sum_{j\in S} w'_j e^{\eta_j},

    and :math:`\lVert\hat o_q - \hat o\rVert \le B_q` for every input (docs/quantized.md, Proposition 2:
    :math:`w_i/w'_i \in [e^{-\eta_i}/F_+,\ e^{\eta_i}/F_-]`, and
    :math:`\hat o_q - \hat o = \sum_S (w'_i - w_i)(Q(v_i) - \hat o_q) + \sum_S w_i (Q(v_i) - v_i)`).
    With :math:`\eta = \max_S \eta_i` it is at most
    :math:`(e^{2\eta} - 1)\sum_S w'_i\lVert Q(v_i) - \hat o_q\rVert + e^{2\eta}\max_S\epsilon_i`.
    It holds for either rounding (stochastic rows carry the per-element bound s, not s/2).

    Parameters
    ----------
    q : (d,)   keys : QuantizedRows or QuantizedChannels (n, d), or an (n, d) array of exact keys
    values : QuantizedRows (n, dv), the kept tokens as stored
    pi : (n,) their inclusion probabilities in [0, 1] (0: padding)   scale : float, default 1/sqrt(d)

    Returns
    -------
    float >= 0; 0 when nothing is rounded (all scales 0), +inf for an empty sample or a logit bound
    too large for exp.
    """
    q, vq, est, on, rounded = _stored_estimate(q, keys, values, pi, scale)
    if not np.any(on):
        return float("inf")
    w = est.weights
    eta = logit_bound(q, keys, scale=scale)[on] if rounded else np.zeros(int(on.sum()))
    eps = value_bound(values)[on]
    w, dist = w[on], np.linalg.norm(vq[on] - est.output, axis=1)
    log_f_low, log_f_high = logsumexp(np.log(w) - eta), logsumexp(np.log(w) + eta)
    with np.errstate(over="ignore", invalid="ignore"):                 # exp overflow: B_q = +inf
        h_minus_1 = np.expm1(eta - log_f_low)                          # w_i / w'_i <= 1 + h_minus_1
        g = np.maximum(h_minus_1, -np.expm1(-eta - log_f_high))         # |w_i / w'_i - 1| <= g
        terms = np.where(dist > 0, g * dist, 0.0) + np.where(eps > 0, (1.0 + h_minus_1) * eps, 0.0)
    return float(np.sum(w * terms))


def _stored_estimate(q, keys, values, pi, scale):
    """The Hajek estimate over the stored rows (keys dequantized, or exact keys as given) and what the
    rounding terms read: ``(q, stored values, estimate, the sample's mask w > 0, whether keys are rounded)``."""
    k_stored, rounded = _stored_keys(keys)
    _check_stored(values, "values")
    q, kq, vq = as_qkv(q, k_stored, values.dequantize())
    est = hajek_attention(q, kq, vq, pi, scale=scale)
    return q, vq, est, est.weights > 0, rounded


def quantization_variance(q, keys, values, pi, *, scale: float | None = None) -> float:
    r"""The variance stochastic rounding adds to the Hajek estimate over one sample, from the stored rows.

    .. math::

        V_q = \sum_{i\in S} w_i'^2 \Big(\sigma_i^2\,\lVert Q(v_i) - \hat o_q\rVert^2
              + \sum_j \frac{s_{v,ij}^2}{4}\Big),
        \qquad \sigma_i^2 = \tau^2\sum_j q_j^2 \frac{s_{k,ij}^2}{4}\ \ (\text{:func:`logit_variance`; 0 for
        exact keys}),

    :math:`w'` the stored sample's Hajek weights. What is proven and what is not (docs/quantized.md,
    section 4): the value term bounds :math:`E\lVert\sum_S w'_i (Q(v_i) - v_i)\rVert^2` given the keys'
    rounding exactly (its codes are unbiased and independent of the keys'); the logit term is the delta
    method's variance :math:`\sum_S w_i^2 \mathrm{Var}(e_i)\lVert v_i - \hat o\rVert^2` of the first-order
    change :math:`\sum_S w_i e_i (v_i - \hat o)`, an upper bound on that linear term's second moment,
    evaluated at the stored :math:`w'`, :math:`Q(v_i)`, :math:`\hat o_q`. The remainder is second order in
    the logit errors :math:`e_i` (typically :math:`\sigma_i^2`; at 8 bits :math:`\sigma_i \approx 0.06`
    nats on SmolLM2's keys) and is not bounded here.

    Parameters
    ----------
    q : (d,)   keys : stochastically rounded QuantizedRows or QuantizedChannels, or an (n, d) array of exact
    keys   values : stochastically rounded QuantizedRows   pi : (n,) in [0, 1]   scale : default 1/sqrt(d)

    Returns
    -------
    float >= 0; +inf for an empty sample.
    """
    if isinstance(values, QuantizedRows) and values.rounding != "stochastic":
        raise ValueError("values must be stochastically rounded (rounding='stochastic') for a variance: "
                         "round-to-nearest errors are not random")
    q, vq, est, on, rounded = _stored_estimate(q, keys, values, pi, scale)
    if not np.any(on):
        return float("inf")
    w = est.weights
    sigma2 = logit_variance(q, keys, scale=scale)[on] if rounded else 0.0
    dist2 = np.sum((vq[on] - est.output) ** 2, axis=1)
    return float(np.sum(w[on] ** 2 * (sigma2 * dist2 + np.sum(values.variance_bound()[on], axis=1))))


def _check_kv_bits(kv_bits) -> int:
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, (int, np.integer)) or int(kv_bits) not in KV_BITS:
        raise ValueError(f"kv_bits must be one of {KV_BITS} (16: unquantized), got {kv_bits!r}")
    return int(kv_bits)


def _check_layout(kv_layout) -> str:
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    return kv_layout


def _check_quantized_bound(quantized_bound) -> str:
    if not isinstance(quantized_bound, str) or quantized_bound not in QUANTIZED_BOUNDS:
        raise ValueError(f"quantized_bound must be one of {QUANTIZED_BOUNDS}, got {quantized_bound!r}")
    return quantized_bound


def _code_elements(d: int, dv: int, b: int, layout: str) -> float:
    """16-bit elements of one kept token's codes: keys unquantized in the "values" layout."""
    return d + dv * b / 16.0 if layout == "values" else (d + dv) * b / 16.0


def token_elements(d: int, dv: int, kv_bits: int, *, layout: str = "channel") -> float:
    r"""16-bit elements held per kept token at ``kv_bits`` in ``layout`` (:data:`KV_LAYOUTS`), with
    :math:`\log\pi_i` (the default layout is ``evict_and_certify``'s, ``"channel"``):

    - ``"token"``: :math:`(d + d_v)\,b/16 + 2 + 1` (key and value codes, their two scales);
    - ``"channel"``: :math:`(d + d_v)\,b/16 + d/G + 1 + 1` (the keys' d scales per group of G =
      :data:`CHANNEL_GROUP` kept tokens, amortized; the value's scale);
    - ``"values"``: :math:`d + d_v\,b/16 + 1 + 1` (16-bit keys, the value's codes and scale);

    :math:`d + d_v + 1` at 16 bits (every layout)."""
    b = _check_kv_bits(kv_bits)
    layout = _check_layout(layout)
    for name, v in (("d", d), ("dv", dv)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if b == 16 or layout == "token":
        return (d + dv) * b / 16.0 + (SCALES_PER_TOKEN if b < 16 else 0) + TOKEN_SCALARS
    key_scales = d / CHANNEL_GROUP if layout == "channel" else 0.0
    return _code_elements(d, dv, b, layout) + key_scales + 1 + TOKEN_SCALARS


def sampled_budget(budget: float, d: int, dv: int, kv_bits: int, *, extra: float = 0.0,
                   layout: str = "channel") -> float:
    r"""The expected kept count a design samples at ``kv_bits`` in the memory of ``budget`` unquantized tokens.

    .. math:: B_b = \frac{B\,(d + d_v + 1) - E - E_G}{\text{token\_elements}(d, d_v, b)},

    E = ``extra`` elements of a sketch (:meth:`ClusterDesign.elements`), so that the expected memory
    :math:`B_b` :func:`token_elements` :math:`+ E` equals the paper design's at 16 bits,
    :math:`B\,(d + d_v + 1)`. :math:`E_G = d` in the ``"channel"`` layout (the last, partial group's key
    scales, so that the expected memory stays at or below it), 0 otherwise.
    """
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    partial = float(d) if _check_layout(layout) == "channel" and kv_bits != 16 else 0.0
    return ((float(budget) * token_elements(d, dv, 16) - float(extra) - partial)
            / token_elements(d, dv, kv_bits, layout=layout))


def quantized_memory_fraction(n: int, d: int, dv: int, *, kept: int, kv_bits: int, extra: float = 0.0,
                              layout: str = "channel") -> float:
    r"""Fraction of the full 16-bit cache's K+V memory held at ``kv_bits`` in ``layout``.

    .. math:: M = \frac{|S|\,\text{token\_elements} + E}{n\,(d + d_v)},

    with the ``"channel"`` layout's key scales counted per group, :math:`\lceil |S|/G\rceil d`; without
    :math:`\log\pi` and the sketch when ``kept == n`` (nothing evicted); at 16 bits it is ``memory_fraction``.
    """
    per_token = token_elements(d, dv, kv_bits, layout=layout)
    if not (0 <= kept <= n):
        raise ValueError(f"kept must be in [0, n] = [0, {n}], got {kept}")
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    if layout == "channel" and kv_bits != 16:
        stored = kept * (_code_elements(d, dv, kv_bits, layout) + 1) + -(-kept // CHANNEL_GROUP) * d
        if kept == n:
            return stored / float(n * (d + dv))
        return (stored + kept * TOKEN_SCALARS + float(extra)) / float(n * (d + dv))
    if kept == n:
        return (per_token - TOKEN_SCALARS) / float(d + dv)
    return (kept * per_token + float(extra)) / float(n * (d + dv))


def _quantized_hull(values_q: QuantizedRows, pi, sketch, *, output) -> float:
    r"""The hull bound on :math:`\lVert\hat o_q - o\rVert`: ``hull_bound`` of the stored kept values plus
    :math:`\max_S \epsilon_i` (an exact kept value lies within :math:`\epsilon_i` of its stored one, and
    :math:`\hat o_q` is a convex combination of the stored values)."""
    eps = value_bound(values_q)
    return hull_bound(values_q.dequantize(), pi, sketch, output=output) + (float(eps.max()) if eps.size else 0.0)


def _store(k, v, fmt: str, layout: str, generator):
    """The kept keys and values as the cache stores them: stochastic rounding from ``generator`` (keys
    first, then values), round to nearest without one."""
    kw = dict(rounding="nearest") if generator is None else dict(rounding="stochastic", generator=generator)
    if layout == "values":
        keys = k
    elif layout == "channel":
        keys = quantize_channels(k, fmt, **kw)
    else:
        keys = quantize(k, fmt, **kw)
    return keys, quantize(v, fmt, **kw)


def _rule_radius(spec, delta: float, variance: float, cap: float) -> float:
    """The design's radius rule on a variance, capped by a deterministic bound: Chebyshev for the paper
    design, ``tilted_hull`` for the recommended one, a ClusterDesign's own rule."""
    if spec is None:
        return min(float(radius_from_moments("chebyshev", delta, trace=variance)), cap)
    if spec == TILTED:
        return float(radius_from_moments(RECOMMENDED_KIND, delta, trace=variance, bound=cap))
    return min(radius_from_variance(variance, delta=delta, rule=spec.radius, multiplier=spec.multiplier), cap)


def _evict_quantized(q, k, v, u, budget: float, *, seed: int, delta: float, spec, name: str, sinks: int,
                     window: int, top: int, floor: float, scale, tilt, sampling: str, kv_bits: int,
                     kv_layout: str, quantized_bound: str) -> EvictionResult:
    """``evict_and_certify`` at ``kv_bits`` < 16 (arguments already checked there): the design samples at
    :func:`sampled_budget`, its kept tokens are stored by :func:`_store`; the radius is min(B_q + r, H_q)
    (``"strict"``) or the design's rule on V + V_q, capped by H_q (``"variance"``; docs/quantized.md)."""
    n, d = k.shape
    dv = v.shape[1]
    fmt = KV_FORMAT[kv_bits]
    by_variance = quantized_bound == "variance"
    gen = rounding_generator(seed) if by_variance else None
    extra = 0.0 if spec is None else float(spec.elements(d, dv))
    if sampled_budget(budget, d, dv, kv_bits, layout=kv_layout) >= n:   # the whole cache fits at kv_bits
        kq, vq = _store(k, v, fmt, kv_layout, gen)
        est = hajek_attention(q, _stored_keys(kq)[0], vq.dequantize(), np.ones(n), scale=scale)
        b_q = quantization_bound(q, kq, vq, np.ones(n), scale=scale)
        v_q = quantization_variance(q, kq, vq, np.ones(n), scale=scale) if by_variance else 0.0
        # o_hat = o here, so B_q bounds the whole error: it caps the variance rule's radius
        return EvictionResult(output=est.output, radius=_rule_radius(spec, delta, v_q, b_q) if by_variance else b_q,
                              memory=quantized_memory_fraction(n, d, dv, kept=n, kv_bits=kv_bits, layout=kv_layout),
                              design=name, budget=float(n), kept=n, variance=v_q, quantization_bound=b_q,
                              quantization_variance=v_q)
    b_design = sampled_budget(budget, d, dv, kv_bits, extra=extra, layout=kv_layout)
    certain = certainty_mask(u, sinks=sinks, window=window, top=top)
    if spec is not None and b_design <= certain.sum():
        raise ValueError(
            f"budget = {budget} is too small for the {name} design at kv_bits = {kv_bits}: its sketch "
            f"({spec.elements(d, dv)} elements) leaves an expected {b_design:.3g} kept tokens, not above the "
            f"certainty set |C| = {int(certain.sum())}; raise budget")
    pi = inclusion_probabilities(u, b_design, sinks=sinks, window=window, top=top, floor=floor)
    keep = _sample(pi, seed, sampling)
    kq, vq = _store(k[keep], v[keep], fmt, kv_layout, gen)   # per-token: the same rows as quantizing all
    kept = int(keep.sum())
    k_stored = _stored_keys(kq)[0]
    est = hajek_attention(q, k_stored, vq.dequantize(), pi[keep], scale=scale)
    b_q = quantization_bound(q, kq, vq, pi[keep], scale=scale)
    v_q = quantization_variance(q, kq, vq, pi[keep], scale=scale) if by_variance else 0.0
    if spec is None:
        var = float(est.trace) + v_q
        radius = (_rule_radius(None, delta, var, np.inf) if by_variance
                  else b_q + float(certificate(est, delta=delta, kind="chebyshev").radius))
        return EvictionResult(output=est.output, radius=radius, memory=quantized_memory_fraction(
            n, d, dv, kept=kept, kv_bits=kv_bits, layout=kv_layout), design=name, budget=b_design, kept=kept,
            variance=var if by_variance else float(est.trace), quantization_bound=b_q, quantization_variance=v_q)
    sk = cluster_sketch(k, v, pi, keep, spec, tilt=tilt, scale=scale)  # at eviction, from the exact cache
    v_cl = cluster_variance(q, k_stored, vq.dequantize(), pi[keep], sk, output=est.output, scale=scale)
    var = sketched_variance(v_cl, est.trace)
    cap = _quantized_hull(vq, pi[keep], sk, output=est.output)
    if by_variance:
        var = var + v_q
        radius = _rule_radius(spec, delta, var, cap)
    elif spec == TILTED:
        radius = min(b_q + float(radius_from_moments(RECOMMENDED_KIND, delta, trace=var, bound=cap)), cap)
    else:
        radius = min(b_q + min(radius_from_variance(var, delta=delta, rule=spec.radius,
                                                    multiplier=spec.multiplier), cap), cap)
    memory = quantized_memory_fraction(n, d, dv, kept=kept, kv_bits=kv_bits, extra=extra if kept < n else 0.0,
                                       layout=kv_layout)
    return EvictionResult(output=est.output, radius=radius, memory=memory, design=name, budget=b_design,
                          kept=kept, variance=float(var), cluster_variance=float(v_cl), quantization_bound=b_q,
                          quantization_variance=v_q)
