r"""Quantized KV caches, batched: rounding, and the terms of a certificate that covers rounding and sampling.

Torch twin of ``kvcert.reference.quantized`` (docs/quantized.md has the math and the proofs) for the batched
shapes of ``kvcert.fast``: keys and values (b, h_kv, n, d), pi (b, h_kv, n) with 0 on padding, queries
(b, h_q, d) or (b, h_q, t, d), GQA by h_q = g h_kv. A kept token's key and value are stored as codes with a
16-bit scale per row (per token, :func:`quantize`) or, for keys, per channel and group of ``group``
consecutive slots (:func:`quantize_channels`, KIVI's layout):

.. math::

    Q(x) = s\,c, \qquad s = \mathrm{up}_{16}\Big(\frac{\max |x|}{t}\Big), \qquad c = \mathrm{round}(x / s),

with :math:`t` the format's largest code (:data:`FORMATS`), and :math:`\mathrm{up}_{16}` rounding the scale up
to a float16 number. Codes are stored as ``torch.int8`` (``int8``, ``int4``: one code per byte, not packed)
or ``torch.float8_e4m3fn`` (``e4m3``), scales as ``torch.float16``. The quotient :math:`x/s` and its
rounding are evaluated in float64 whatever the input dtype (every float dtype upcasts exactly), so the codes
and scales are the reference's bit for bit on the same inputs, and :meth:`QuantizedRows.dequantize` is exact
in float32 (a float16 scale times a code has at most 19 significant bits).

From the stored codes and scales and the queries, per (batch, query head[, query], slot):
:func:`logit_bound` (:math:`\eta_i`), :func:`logit_variance` (:math:`\sigma_i^2`), per (batch, KV head, slot):
:func:`value_bound` (:math:`\epsilon_i`), and per (batch, query head[, query]): :func:`quantization_bound`
(:math:`B_q`, Proposition 2: holds on every input) and :func:`quantization_variance` (:math:`V_q`, section 4).
:func:`token_elements`, :func:`sampled_budget` and :func:`quantized_memory_fraction` count memory in 16-bit
elements, as the reference does.

Stochastic-rounding stream (:func:`rounding_uniforms`)
------------------------------------------------------
The counter-based stream of :mod:`kvcert.fast.design` (:func:`kvcert.fast.design_uniforms`), with the event
word offset into a domain of its own: ``event + 2**33`` for keys and ``event + 3 * 2**32`` for values (the
sampling stream uses ``event``, the random scorer ``event + 2**32``; ``event`` must be below 2**32), and
element (token position p, channel j) of an (n, m) slab drawing counter ``p m + j``. So a rounding is
replayable per (seed, layer, batch row, KV head, event), independent of the sample drawn at the same event,
and a token's uniforms do not depend on where padding sits when its position is passed (``index=``). The
reference draws NumPy's PCG64 (``rounding_generator``) instead: the two agree in distribution; pass the
reference's uniforms (``uniforms=``) to get its codes bit for bit.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ._checks import check_nonneg_int, check_scale, check_tensor
from .design import design_uniforms
from .estimators import hajek_attention

__all__ = [
    "CHANNEL_GROUP",
    "FORMATS",
    "KV_BITS",
    "KV_FORMAT",
    "KV_LAYOUTS",
    "QUANTIZED_BOUNDS",
    "ROUNDINGS",
    "ROUNDING_EVENTS",
    "QuantizedChannels",
    "QuantizedKV",
    "QuantizedRows",
    "check_kv_bits",
    "check_kv_layout",
    "check_quantized_bound",
    "logit_bound",
    "logit_variance",
    "quantization_bound",
    "quantization_variance",
    "quantize",
    "quantize_channels",
    "quantized_memory_fraction",
    "held_rounding_terms",
    "rounding_uniforms",
    "sampled_budget",
    "store_kv",
    "token_elements",
    "value_bound",
]

#: the bit widths a quantized cache accepts; 16 stores keys and values unquantized
KV_BITS = (16, 8, 4)
#: format name -> largest code t (a row's absmax maps to t): symmetric integers and float8 e4m3 (fn variant)
FORMATS = MappingProxyType({"int8": 127.0, "int4": 7.0, "e4m3": 448.0})
#: the format a quantized ``kv_bits`` stores
KV_FORMAT = MappingProxyType({8: "int8", 4: "int4"})
#: how a value becomes a code: the nearest code, or unbiased stochastic rounding (integer formats)
ROUNDINGS = ("nearest", "stochastic")
#: what a cache stores: "token" keys and values with one scale per token; "channel" keys with one scale per
#: channel and group of CHANNEL_GROUP kept tokens (KIVI), values per token; "values" 16-bit keys
KV_LAYOUTS = ("token", "channel", "values")
#: the rounding term of a quantized certificate: "strict" B_q (round to nearest) or "variance" V_q (stochastic)
QUANTIZED_BOUNDS = ("strict", "variance")
#: kept tokens per group of the "channel" layout's key scales (KIVI's group size along tokens)
CHANNEL_GROUP = 32
#: scales per kept token of the "token" layout (its key row's and its value row's), 16 bits each
SCALES_PER_TOKEN = 2
#: 16-bit scalars kept per token beside its key and value (log pi)
TOKEN_SCALARS = 1
#: event-word offsets of the rounding streams (module docstring): keys, values
ROUNDING_EVENTS = MappingProxyType({"keys": 2 << 32, "values": 3 << 32})
#: e4m3: mantissa bits, and the exponent of the smallest normal number (2^-6); subnormals are spaced 2^-9
E4M3_MANTISSA, E4M3_MIN_EXPONENT = 3, -6
#: e4m3 rounding: relative to the stored code (half a spacing of its binade), and absolute among subnormals
E4M3_RELATIVE, E4M3_ABSOLUTE = 2.0 ** -(E4M3_MANTISSA + 1), 2.0 ** (E4M3_MIN_EXPONENT - E4M3_MANTISSA - 1)
#: elements of one chunk of the (slots x query rows x dv) differences Q(v_i) - o_hat_q
_CHUNK_ELEMENTS = 1 << 24


def _code_dtype(fmt: str) -> torch.dtype:
    return torch.float8_e4m3fn if fmt == "e4m3" else torch.int8


def _round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round float64 y (|y| <= 448) to the nearest float8 e4m3 value, ties to even: 3 mantissa bits in each
    binade [2^e, 2^(e+1)), e >= -6, and the subnormal spacing 2^-9 below 2^-6."""
    a = y.abs()
    _, ex = torch.frexp(a)                                             # a = m 2^ex, m in [1/2, 1)
    step = torch.ldexp(torch.ones_like(a), (ex - 1).clamp_min(E4M3_MIN_EXPONENT) - E4M3_MANTISSA)
    return torch.sign(y) * torch.round(a / step) * step


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


def _check_group(group) -> int:
    if isinstance(group, bool) or not isinstance(group, numbers.Integral) or group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    return int(group)


def _check_codes(codes, fmt: str) -> torch.Tensor:
    """Codes in the format's storage dtype (int8, or float8_e4m3fn), from any real tensor of its values."""
    c = check_tensor("codes", codes)
    if c.ndim < 2:
        raise ValueError(f"codes must have shape (..., n, m), got shape {tuple(c.shape)}")
    top = FORMATS[fmt]
    if c.dtype == _code_dtype(fmt):
        c64 = c.to(torch.float64)
        if c.numel() and not bool((c64.abs() <= top).all()):
            raise ValueError(f"codes must lie in [-{top:g}, {top:g}] for {fmt} (found a value outside, or NaN)")
        return c
    if c.dtype == torch.bool or c.is_complex():
        raise TypeError(f"codes must be a real tensor, got dtype {c.dtype}")
    c64 = c.to(torch.float64)
    if c.numel() and not bool((c64.abs() <= top).all()):
        raise ValueError(f"codes must lie in [-{top:g}, {top:g}] for {fmt} (found a value outside, or NaN)")
    exact = _round_e4m3(c64) if fmt == "e4m3" else torch.round(c64)
    if not torch.equal(exact, c64):
        raise ValueError(f"codes must be {'float8 e4m3 values' if fmt == 'e4m3' else 'integers'} for {fmt}")
    return c64.to(_code_dtype(fmt))


def _check_scales(scales, shape: tuple, what: str, device) -> torch.Tensor:
    """Scales as float16, from a float16 tensor or any float tensor of float16 numbers."""
    s = check_tensor("scales", scales, floating=True)
    if tuple(s.shape) != shape:
        raise ValueError(f"scales must have shape {what} = {shape}, got shape {tuple(s.shape)}")
    if s.device != device:
        raise ValueError(f"scales must be on the codes' device {device}, got {s.device}")
    s64 = s.to(torch.float64)
    if s.numel() and not bool((torch.isfinite(s64) & (s64 >= 0)).all()):
        raise ValueError("scales must be finite and >= 0 (found NaN, inf or a negative scale)")
    s16 = s.to(torch.float16)
    if s.dtype != torch.float16 and not torch.equal(s16.to(torch.float64), s64):
        raise ValueError("scales must be float16 numbers (the cache stores them in 16 bits)")
    return s16


def _element_bound(scales: torch.Tensor, codes: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    """Per element: s/2 (nearest integer), s (stochastic), s max(2^-4 |c|, 2^-10) (nearest e4m3); ``scales``
    (float, the codes' shape or broadcasting to it)."""
    if fmt == "e4m3":
        return scales * (E4M3_RELATIVE * codes.to(scales.dtype).abs()).clamp_min(E4M3_ABSOLUTE)
    return (scales / 2.0 if rounding == "nearest" else scales).expand(codes.shape)


def _element_variance(scales: torch.Tensor, codes: torch.Tensor, rounding: str) -> torch.Tensor:
    if rounding != "stochastic":
        raise ValueError("rows must be stochastically rounded (rounding='stochastic') for a variance bound: "
                         "round-to-nearest errors are not random")
    return (scales * scales / 4.0).expand(codes.shape)


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    r"""Rows stored as codes with one 16-bit scale per row, batched: :math:`Q(x)_{\ldots i} = s_{\ldots i}
    c_{\ldots i}`.

    Attributes
    ----------
    codes : (..., n, m) ``torch.int8`` (``int8``, ``int4``: integers in [-t, t]) or ``torch.float8_e4m3fn``
        (``e4m3``); any real tensor of the format's values is accepted and converted
    scales : (..., n) ``torch.float16``, >= 0; 0 stores an all-zero row (its codes must be 0); a float tensor
        of float16 numbers is accepted and converted
    format : str, a name of :data:`FORMATS`
    rounding : str, one of :data:`ROUNDINGS` (default ``"nearest"``): sets the per-element bound
        (:meth:`error_bound`) and whether there is a variance (:meth:`variance_bound`)

    Raises
    ------
    ValueError
        A format not in :data:`FORMATS`, a rounding not in :data:`ROUNDINGS` (or stochastic e4m3), codes that
        are not the format's (non-integer, out of range, NaN), scales of the wrong shape or device, NaN,
        infinite, negative or not float16 numbers, or a zero scale on a row with a non-zero code.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    format: str
    rounding: str = "nearest"

    def __post_init__(self):
        fmt = _check_format(self.format)
        _check_rounding(self.rounding, fmt)
        c = _check_codes(self.codes, fmt)
        s = _check_scales(self.scales, tuple(c.shape[:-1]), "(..., n)", c.device)
        if c.numel() and bool(((s == 0) & (c.to(torch.float32) != 0).any(dim=-1)).any()):
            raise ValueError("a zero scale stores an all-zero row: scales must be > 0 where a row has a non-zero "
                             "code")
        object.__setattr__(self, "codes", c)
        object.__setattr__(self, "scales", s)

    def scale_rows(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., n, 1) each row's scale, in ``dtype`` (broadcasts against the codes)."""
        return self.scales.to(dtype)[..., None]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., n, m) the stored rows :math:`s_i c_i` in ``dtype`` (exact in float32 and float64)."""
        return self.scale_rows(dtype) * self.codes.to(dtype)

    def error_bound(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        r"""(..., n, m) a bound on :math:`|x_{ij} - s_i c_{ij}|` from the stored codes and scales alone:
        :math:`s_i/2` (integers, round to nearest), :math:`s_i` (integers, stochastic) or
        :math:`s_i \max(2^{-4}|c_{ij}|, 2^{-10})` (e4m3), as ``kvcert.reference`` (a broadcast view for
        the integer formats)."""
        return _element_bound(self.scale_rows(dtype), self.codes, self.format, self.rounding)

    def variance_bound(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        r"""(..., n, m) :math:`s_i^2/4 \ge \mathrm{Var}(s_i c_{ij})` of stochastic rounding; ValueError for
        round to nearest."""
        return _element_variance(self.scale_rows(dtype), self.codes, self.rounding)


@dataclass(frozen=True, eq=False)
class QuantizedChannels:
    r"""Rows stored as codes with one 16-bit scale per channel and group of ``group`` consecutive slots (KIVI's
    key layout), batched: :math:`Q(x)_{\ldots ij} = s_{\ldots g(i) j} c_{\ldots ij}`,
    :math:`g(i) = \lfloor i/\text{group}\rfloor`.

    Attributes
    ----------
    codes : (..., n, m), as :class:`QuantizedRows`
    scales : (..., ceil(n / group), m) ``torch.float16``, >= 0; 0 stores a (group, channel) of zeros
    group : int >= 1, slots per group (:data:`CHANNEL_GROUP` by default in :func:`quantize_channels`)
    format : str   rounding : str, as :class:`QuantizedRows`

    Notes
    -----
    Padding slots take part in their group's absmax: a compressed cache's padding (zero keys, at the end of
    each head) leaves every scale as the kept rows alone give it.

    Raises
    ------
    ValueError
        As :class:`QuantizedRows`, and ``group`` not an int >= 1.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    group: int
    format: str
    rounding: str = "nearest"

    def __post_init__(self):
        fmt = _check_format(self.format)
        _check_rounding(self.rounding, fmt)
        group = _check_group(self.group)
        c = _check_codes(self.codes, fmt)
        n = c.shape[-2]
        shape = tuple(c.shape[:-2]) + (-(-n // group), c.shape[-1])
        s = _check_scales(self.scales, shape, "(..., ceil(n / group), m)", c.device)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "codes", c)
        object.__setattr__(self, "scales", s)
        if c.numel() and bool(((self.scale_rows() == 0) & (c.to(torch.float32) != 0)).any()):
            raise ValueError("a zero scale stores a group's channel of zeros: scales must be > 0 where the "
                             "channel has a non-zero code in the group")

    def scale_rows(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., n, m) each element's scale :math:`s_{g(i) j}`, in ``dtype``."""
        n = self.codes.shape[-2]
        return self.scales.to(dtype).repeat_interleave(self.group, dim=-2)[..., :n, :]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., n, m) the stored rows :math:`s_{g(i) j} c_{ij}` in ``dtype`` (exact in float32 and float64)."""
        return self.scale_rows(dtype) * self.codes.to(dtype)

    def error_bound(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., n, m) the per-element bound of :meth:`QuantizedRows.error_bound`, with each element's scale."""
        return _element_bound(self.scale_rows(dtype), self.codes, self.format, self.rounding)

    def variance_bound(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(..., n, m) :math:`s^2/4` per element of stochastic rounding; ValueError for round to nearest."""
        return _element_variance(self.scale_rows(dtype), self.codes, self.rounding)


_STORED = (QuantizedRows, QuantizedChannels)


# ----------------------------------------------------------------------------- the quantizers


def _scales_up(absmax: torch.Tensor, top: float, per: str) -> torch.Tensor:
    """float64 absmax / top rounded up to a float16 number (0 stays 0), as float16; ValueError on overflow."""
    s = absmax / top
    s16 = s.to(torch.float16)
    up = (s16.view(torch.int16) + 1).view(torch.float16)              # the next float16 above (s16 >= 0)
    s16 = torch.where(s16.to(torch.float64) < s, up, s16)
    if s16.numel() and not bool(torch.isfinite(s16).all()):
        raise ValueError(f"x must have |x| <= {float(torch.finfo(torch.float16).max) * top:g} {per}: larger "
                         f"values overflow a float16 scale")
    return s16


def rounding_uniforms(shape, seed: int, *, part: str = "values", layer: int = 0, event: int = 0,
                      index: torch.Tensor | None = None, device=None, row_streams: bool = True,
                      head_offset: int = 0) -> torch.Tensor:
    r"""The uniforms :math:`U \in [0, 1)` of stochastic rounding, float64 of ``shape`` (..., n, m).

    Drawn from :func:`kvcert.fast.design_uniforms` over the flattened (..., n m) slab, the event word offset by
    ``ROUNDING_EVENTS[part]`` (module docstring), element (p, j) at counter ``p m + j`` with p the slot index
    or ``index[..., i]``: replayable per (seed, layer, batch row, KV head, event, part), independent of the
    sampling stream of the same event.

    Parameters
    ----------
    shape : tuple of int
        (n, m), (h, n, m) or (..., h, n, m); dims before (n, m) as ``design_uniforms``' leading dims.
    seed, layer, event : int >= 0 (event < 2**32)
    part : ``"keys"`` or ``"values"`` (:data:`ROUNDING_EVENTS`): the keys' and the values' streams differ.
    index : int64 tensor of ``shape[:-1]``, optional
        Each slot's token position (``CompressedCache.positions``): a token draws the same uniforms
        wherever it sits.
    device, row_streams, head_offset : as :func:`kvcert.fast.design_uniforms`.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"shape must be (..., n, m), got {shape}")
    if not isinstance(part, str) or part not in ROUNDING_EVENTS:
        raise ValueError(f"part must be one of {tuple(ROUNDING_EVENTS)}, got {part!r}")
    event = check_nonneg_int("event", event)
    if event >= 1 << 32:
        raise ValueError(f"event must be < 2**32 (the rounding streams offset it by multiples of 2**32), "
                         f"got {event}")
    n, m = shape[-2:]
    flat = shape[:-2] + (n * m,)
    ctr = None
    if index is not None:
        index = check_tensor("index", index)
        if tuple(index.shape) != shape[:-1] or index.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"index must be an int64 tensor of shape {shape[:-1]}, got {index.dtype} of shape "
                             f"{tuple(index.shape)}")
        j = torch.arange(m, dtype=torch.int64, device=index.device)
        ctr = (index.to(torch.int64)[..., None] * m + j).reshape(flat)
    u = design_uniforms(flat, seed, layer=layer, event=event + ROUNDING_EVENTS[part], index=ctr, device=device,
                        row_streams=row_streams, head_offset=head_offset)
    return u.reshape(shape)


def _uniforms(x: torch.Tensor, rounding: str, *, uniforms, generator, seed, layer, event, index, part):
    """None for round to nearest; stochastic rounding's float64 uniforms of x's shape otherwise."""
    given = sum(v is not None for v in (uniforms, generator, seed))
    if rounding == "nearest":
        if given:
            raise ValueError("seed, generator and uniforms are stochastic rounding's randomness: "
                             "rounding='nearest' takes none of them")
        return None
    if given != 1:
        raise ValueError("rounding='stochastic' needs exactly one source of randomness: seed (the counter "
                         "stream, rounding_uniforms), generator (a torch.Generator) or uniforms")
    if seed is not None:
        return rounding_uniforms(tuple(x.shape), seed, part=part, layer=layer, event=event, index=index,
                                 device=x.device)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        return torch.rand(x.shape, generator=generator, dtype=torch.float64, device=generator.device).to(x.device)
    u = check_tensor("uniforms", uniforms, floating=True)
    if u.shape != x.shape:
        raise ValueError(f"uniforms must have the shape of x, {tuple(x.shape)}, got shape {tuple(u.shape)}")
    u = u.to(device=x.device, dtype=torch.float64)
    if u.numel() and not bool(((u >= 0) & (u < 1)).all()):
        raise ValueError("uniforms must lie in [0, 1) (found a value outside, or NaN)")
    return u


def _check_x(x) -> torch.Tensor:
    a = check_tensor("x", x, floating=True)
    if a.ndim < 2:
        raise ValueError(f"x must have shape (..., n, m), got shape {tuple(a.shape)}")
    a = a.to(torch.float64)
    if a.numel() and not bool(torch.isfinite(a).all()):
        raise ValueError("x must be finite (found NaN or inf)")
    return a


def _codes(y: torch.Tensor, fmt: str, u) -> torch.Tensor:
    """float64 codes of y = x / s (|y| <= t): nearest (u None; ties to even) or floor(y) + [u < y - floor(y)]."""
    if u is None:
        return _round_e4m3(y) if fmt == "e4m3" else torch.round(y)
    f = torch.floor(y)
    return f + (u < y - f).to(y.dtype)


def quantize(x: torch.Tensor, format: str, *, rounding: str = "nearest", uniforms: torch.Tensor | None = None,
             generator: torch.Generator | None = None, seed: int | None = None, layer: int = 0, event: int = 0,
             index: torch.Tensor | None = None, part: str = "values") -> QuantizedRows:
    r"""Quantize each row of x (the last dim) with its own absmax scale, batched.

    .. math::

        s_i = \mathrm{up}_{16}\big(\max_j |x_{ij}| / t\big), \qquad c_{ij} = \mathrm{round}(x_{ij}/s_i),
        \qquad Q(x)_i = s_i c_i,

    as ``kvcert.reference.quantize`` row by row (bit for bit on the same inputs and uniforms).
    ``rounding="stochastic"`` (integer formats) takes :math:`c_{ij} = \lfloor y\rfloor + [U_{ij} < y -
    \lfloor y\rfloor]`, :math:`y = x_{ij}/s_i`: unbiased, variance :math:`\le s_i^2/4`.

    Parameters
    ----------
    x : (..., n, m) float, finite (e.g. values (b, h_kv, n, dv))
    format : a name of :data:`FORMATS`   rounding : one of :data:`ROUNDINGS`
    uniforms : float tensor of x's shape in [0, 1), generator : torch.Generator, or seed : int
        Exactly one with ``rounding="stochastic"``, none otherwise. ``seed`` draws
        :func:`rounding_uniforms` (x.shape, seed, part=part, layer=layer, event=event, index=index).
    layer, event, index, part : the stream coordinates of ``seed`` (:func:`rounding_uniforms`; ``part``
        ``"values"`` by default: pass ``part="keys"`` when quantizing keys per token).

    Returns
    -------
    QuantizedRows (codes (..., n, m), scales (..., n) float16)

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast.quantized import quantize
    >>> x = torch.tensor([[0.6, -1.75, 0.3], [0.0, 0.0, 0.0]], dtype=torch.float64)
    >>> qx = quantize(x, "int4")
    >>> qx.codes.tolist(), qx.scales.tolist()
    ([[2, -7, 1], [0, 0, 0]], [0.25, 0.0])
    >>> bool((torch.abs(x - qx.dequantize(torch.float64)) <= qx.error_bound(torch.float64)).all())
    True
    """
    top = FORMATS[_check_format(format)]
    rounding = _check_rounding(rounding, format)
    a = _check_x(x)
    u = _uniforms(a, rounding, uniforms=uniforms, generator=generator, seed=seed, layer=layer, event=event,
                  index=index, part=part)
    s = _scales_up(a.abs().amax(dim=-1) if a.shape[-1] else a.new_zeros(a.shape[:-1]), top, "per row")
    s64 = s.to(torch.float64)
    y = (a / torch.where(s64 > 0, s64, 1.0)[..., None]).clamp(-top, top)
    return QuantizedRows(codes=_codes(y, format, u).to(_code_dtype(format)), scales=s, format=format,
                         rounding=rounding)


def quantize_channels(x: torch.Tensor, format: str, *, group: int = CHANNEL_GROUP, rounding: str = "nearest",
                      uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None,
                      seed: int | None = None, layer: int = 0, event: int = 0, index: torch.Tensor | None = None,
                      part: str = "keys") -> QuantizedChannels:
    r"""Quantize x with one absmax scale per channel and group of ``group`` consecutive slots (KIVI's key
    layout), batched: :math:`s_{gj} = \mathrm{up}_{16}(\max_{i\in g}|x_{ij}|/t)`,
    :math:`c_{ij} = \mathrm{round}(x_{ij}/s_{g(i)j})`, as ``kvcert.reference.quantize_channels`` per
    (batch, head) slab. ``rounding`` and the randomness as :func:`quantize` (``part="keys"`` by default).

    Parameters
    ----------
    x : (..., n, m) float, finite (e.g. keys (b, h_kv, n, d), kept tokens first and padding zero)
    format, rounding, uniforms, generator, seed, layer, event, index, part : as :func:`quantize`
    group : int >= 1

    Returns
    -------
    QuantizedChannels (codes (..., n, m), scales (..., ceil(n / group), m) float16)
    """
    top = FORMATS[_check_format(format)]
    rounding = _check_rounding(rounding, format)
    group = _check_group(group)
    a = _check_x(x)
    u = _uniforms(a, rounding, uniforms=uniforms, generator=generator, seed=seed, layer=layer, event=event,
                  index=index, part=part)
    n, m = a.shape[-2:]
    groups = -(-n // group)
    padded = torch.nn.functional.pad(a.abs(), (0, 0, 0, groups * group - n))   # zeros: no effect on a max
    absmax = padded.reshape(a.shape[:-2] + (groups, group, m)).amax(dim=-2) if n else a.new_zeros(
        a.shape[:-2] + (0, m))
    s = _scales_up(absmax, top, "per channel and group")
    se = s.to(torch.float64).repeat_interleave(group, dim=-2)[..., :n, :]
    y = (a / torch.where(se > 0, se, 1.0)).clamp(-top, top)
    return QuantizedChannels(codes=_codes(y, format, u).to(_code_dtype(format)), scales=s, group=group,
                             format=format, rounding=rounding)


# ----------------------------------------------------------------------------- what rounding does


def _check_stored(x, name: str):
    if not isinstance(x, _STORED):
        raise TypeError(f"{name} must be QuantizedRows or QuantizedChannels (see quantize, quantize_channels), "
                        f"got {type(x).__name__}")
    return x


def _stat_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _query_rows(q, keys_shape: tuple) -> tuple[torch.Tensor, tuple]:
    """q (b, h_q, [t,] d) as (b, h_kv, g t, d) (query head h reads KV head h // g), and the output's leading
    shape (b, h_q[, t])."""
    q = check_tensor("q", q, ndim=(3, 4), floating=True)
    if len(keys_shape) != 4:
        raise ValueError(f"keys must have shape (b, h_kv, n, d), got shape {keys_shape}")
    b, h_kv, _, d = keys_shape
    if q.shape[0] != b or q.shape[-1] != d or q.shape[1] % max(h_kv, 1):
        raise ValueError(f"q must have shape (b, h_q, d) or (b, h_q, t, d) with b = {b}, d = {d} and h_q a "
                         f"multiple of h_kv = {h_kv}, got shape {tuple(q.shape)}")
    if q.numel() and not bool(torch.isfinite(q).all()):
        raise ValueError("q must be finite (found NaN or inf)")
    lead = tuple(q.shape[:-1])
    t = q.shape[2] if q.ndim == 4 else 1
    return q.reshape(b, h_kv, (q.shape[1] // max(h_kv, 1)) * t, d), lead


def _per_query(q, keys, elementwise, power: int, scale) -> torch.Tensor:
    """tau^power sum_j |q_j|^power e_ij over the KV head's slots, per query: (b, h_q, [t,] n)."""
    keys = _check_stored(keys, "keys")
    q3, lead = _query_rows(q, tuple(keys.codes.shape))
    dt = _stat_dtype(q)
    tau = check_scale(scale, q3.shape[-1])
    e = elementwise(dt)                                                # (b, h_kv, n, d)
    w = q3.to(dt).abs() ** power
    out = (tau ** power) * (w @ e.transpose(-1, -2))                   # (b, h_kv, g t, n)
    return out.reshape(lead + (e.shape[-2],))


def logit_bound(q: torch.Tensor, keys, *, scale: float | None = None) -> torch.Tensor:
    r"""(b, h_q, [t,] n) :math:`\eta_i = \tau\sum_j |q_j|\, e_{ij} \ge |\tau\, q\cdot(k_i - Q(k_i))|`,
    e = ``keys.error_bound()`` (:math:`\tau\lVert q\rVert_1 s_i/2` for per-token integer rows rounded to
    nearest), for every key the stored row can stand for; ``keys`` (b, h_kv, n, d) QuantizedRows or
    QuantizedChannels. float64 for a float64 q, float32 otherwise."""
    keys = _check_stored(keys, "keys")
    return _per_query(q, keys, keys.error_bound, 1, scale)


def logit_variance(q: torch.Tensor, keys, *, scale: float | None = None) -> torch.Tensor:
    r"""(b, h_q, [t,] n) :math:`\sigma_i^2 = \tau^2 \sum_j q_j^2\, s_{ij}^2/4 \ge \mathrm{Var}(\tau\, q\cdot
    Q(k_i))` for stochastically rounded keys; ValueError for keys rounded to nearest."""
    keys = _check_stored(keys, "keys")
    if keys.rounding != "stochastic":
        raise ValueError("keys must be stochastically rounded (rounding='stochastic') for a logit variance: "
                         "round-to-nearest errors are not random")
    return _per_query(q, keys, keys.variance_bound, 2, scale)


def value_bound(values, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""(..., n) :math:`\epsilon_i = (\sum_j e_{ij}^2)^{1/2} \ge \lVert v_i - Q(v_i)\rVert_2`:
    :math:`\sqrt{d_v}\, s_i/2` for integer rows rounded to nearest (:math:`\sqrt{d_v}\, s_i` stochastic)."""
    e = _check_stored(values, "values").error_bound(dtype)
    return torch.sqrt((e * e).sum(dim=-1))


def _stored_keys(keys, dt: torch.dtype):
    """(stored keys (b, h_kv, n, d) in dt, quantized?): QuantizedRows / QuantizedChannels, or a tensor of
    exact keys (the ``"values"`` layout: no logit term)."""
    if isinstance(keys, _STORED):
        return keys.dequantize(dt), True
    if isinstance(keys, torch.Tensor):
        return keys.to(dt), False
    raise TypeError(f"keys must be QuantizedRows, QuantizedChannels or a tensor of exact keys, "
                    f"got {type(keys).__name__}")


def _distances(v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    r"""(b, h_kv, r, n) :math:`\lVert v_i - o_r\rVert^2` from v (b, h_kv, n, dv) and out (b, h_kv, r, dv),
    by direct differences (no cancellation) in chunks of query rows."""
    b, h, n, dv = v.shape
    r = out.shape[2]
    step = max(1, _CHUNK_ELEMENTS // max(1, b * h * n * dv))
    parts = [((v[:, :, None] - out[:, :, i:i + step, None]) ** 2).sum(dim=-1) for i in range(0, r, step)]
    return torch.cat(parts, dim=2) if parts else v.new_zeros((b, h, 0, n))


def _stored_estimate(q, keys, values, pi, log_pi, scale):
    """The Hajek estimate over the stored rows and what the rounding terms read, in the (b, h_kv, g t, n)
    layout: ``(weights w', squared distances ||Q(v_i) - o_hat_q||^2, the sample's mask w' > 0, the output's
    leading shape, dtype, whether keys are rounded)``."""
    dt = _stat_dtype(q)
    k_stored, rounded = _stored_keys(keys, dt)
    vq = _check_stored(values, "values").dequantize(dt)
    return _held_estimate(q, k_stored, vq, pi, log_pi, scale) + (rounded,)


def _held_estimate(q, k_stored, vq, pi, log_pi, scale):
    """:func:`_stored_estimate` on dequantized rows (b, h_kv, n, d/dv): ``(w', distances, mask, lead, dtype)``."""
    dt = _stat_dtype(q)
    q3, lead = _query_rows(q, tuple(k_stored.shape))
    if vq.shape[:3] != k_stored.shape[:3]:
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = {tuple(k_stored.shape[:3])} + (dv,), got "
                         f"shape {tuple(vq.shape)}")
    est = hajek_attention(q.to(dt), k_stored, vq, pi, log_pi=log_pi, scale=scale, per_coordinate=False,
                          return_weights=True)
    r = q3.shape[2]
    w = est.weights.reshape(q3.shape[:2] + (r, -1))
    dist2 = _distances(vq, est.output.to(dt).reshape(q3.shape[:2] + (r, -1)))
    return w, dist2, w > 0, lead, dt


def _bound_from(w, dist2, on, lead, eta, eps):
    """B_q (Proposition 2) from the weights w', distances and mask (b, h_kv, g t, n), eta in that layout and
    eps (b, h_kv, 1, n), in log space."""
    logw = torch.where(on, torch.log(torch.where(on, w, 1.0)), -torch.inf)
    log_f_low = torch.logsumexp(logw - eta, dim=-1, keepdim=True)
    log_f_high = torch.logsumexp(logw + eta, dim=-1, keepdim=True)
    h_minus_1 = torch.expm1(eta - log_f_low)                           # w_i / w'_i <= 1 + h_minus_1
    g = torch.maximum(h_minus_1, -torch.expm1(-eta - log_f_high))       # |w_i / w'_i - 1| <= g
    dist = torch.sqrt(dist2)
    terms = (torch.where(dist > 0, g * dist, 0.0) + torch.where(eps > 0, (1.0 + h_minus_1) * eps, 0.0))
    b_q = torch.where(on, w * terms, 0.0).sum(dim=-1)
    return torch.where(on.any(dim=-1), b_q, torch.inf).reshape(lead)


def _variance_from(w, dist2, on, lead, sigma2, value_var):
    """V_q (section 4) from the weights, distances and mask, sigma2 in their layout, value_var (b, h_kv, 1, n)."""
    v_q = torch.where(on, w * w * (sigma2 * dist2 + value_var), 0.0).sum(dim=-1)
    return torch.where(on.any(dim=-1), v_q, torch.inf).reshape(lead)


def held_rounding_terms(q: torch.Tensor, stored: "QuantizedKV", *, tail: tuple | None = None,
                        scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    r""":math:`(B_q, V_q)` of the Hajek estimate over a quantized cache's held tokens: the ``stored`` ones and
    an exact ``tail`` after them (tokens appended at 16 bits since the event, e.g. decoded ones), whose
    rounding terms are 0 (:math:`\eta_i = \epsilon_i = \sigma_i = 0`, no value variance).
    :func:`quantization_bound` and :func:`quantization_variance` over the stored rows when there is no tail.

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d)
    stored : QuantizedKV (b, h_kv, m, ...)
    tail : (keys (b, h_kv, r, d), values (b, h_kv, r, dv), log_pi (b, h_kv, r)), optional
    scale : float, default 1/sqrt(d)

    Returns
    -------
    (B_q, V_q) of shape (b, h_q[, t]); V_q None for rows rounded to nearest.
    """
    dt = _stat_dtype(q)
    keys, values = stored.keys, stored.values
    k, v = stored.dequantize(dt)
    log_pi = stored.log_pi.to(dt)
    rounded = isinstance(keys, _STORED)
    stochastic = values.rounding == "stochastic"
    eta = logit_bound(q, keys, scale=scale) if rounded else None
    sigma2 = logit_variance(q, keys, scale=scale) if rounded and stochastic else None
    eps = value_bound(values, dtype=dt)
    vvar = values.variance_bound(dt).sum(dim=-1) if stochastic else torch.zeros_like(eps)
    if tail is not None:
        tk, tv, tl = tail
        r = tk.shape[2]
        k, v = torch.cat([k, tk.to(dt)], dim=2), torch.cat([v, tv.to(dt)], dim=2)
        log_pi = torch.cat([log_pi, tl.to(dt)], dim=-1)
        pad = lambda x: torch.nn.functional.pad(x, (0, r)) if x is not None else None  # noqa: E731
        eta, sigma2, eps, vvar = pad(eta), pad(sigma2), pad(eps), pad(vvar)
    w, dist2, on, lead, _ = _held_estimate(q, k, v, None, log_pi, scale)
    zero = torch.zeros_like(w)
    b_q = _bound_from(w, dist2, on, lead, zero if eta is None else _rows_layout(eta, w), eps[:, :, None, :])
    if not stochastic:
        return b_q, None
    v_q = _variance_from(w, dist2, on, lead, zero if sigma2 is None else _rows_layout(sigma2, w),
                         vvar[:, :, None, :])
    return b_q, v_q


def _rows_layout(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(b, h_q, [t,] n) per-query terms in the (b, h_kv, g t, n) layout of w."""
    return x.reshape(w.shape)


def quantization_bound(q: torch.Tensor, keys, values, pi: torch.Tensor | None = None, *,
                       log_pi: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    r"""A bound on :math:`\lVert\hat o_q - \hat o\rVert` per query from the stored rows, batched:
    ``kvcert.reference.quantization_bound`` for every (batch, query head[, query]).

    .. math::

        B_q = \sum_{i\in S} w'_i \big( g_i \lVert Q(v_i) - \hat o_q\rVert + h_i \epsilon_i \big),
        \qquad h_i = \frac{e^{\eta_i}}{F_-},\quad g_i = \max\Big(h_i - 1,\ 1 - \frac{e^{-\eta_i}}{F_+}\Big),

        F_- = \sum_{j\in S} w'_j e^{-\eta_j}, \qquad F_+ = \sum_{j\in S} w'_j e^{\eta_j},

    :math:`w'` the Hajek weights over the stored rows, :math:`\eta_i` (:func:`logit_bound`; 0 for exact keys),
    :math:`\epsilon_i` (:func:`value_bound`). :math:`\lVert\hat o_q - \hat o\rVert \le B_q` for every input
    (docs/quantized.md, Proposition 2), for either rounding. Evaluated in log space (large :math:`\eta` gives
    +inf, not NaN).

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d)
    keys : QuantizedRows or QuantizedChannels (b, h_kv, n, d), or a tensor of exact keys
    values : QuantizedRows (b, h_kv, n, dv), the kept tokens as stored
    pi : (b, h_kv, n) in [0, 1] (0: padding), or log_pi : (b, h_kv, n) (-inf: padding); exactly one
    scale : float, default 1/sqrt(d)

    Returns
    -------
    (b, h_q[, t]) float64 for a float64 q, float32 otherwise; +inf where the sample is empty.
    """
    w, dist2, on, lead, dt, rounded = _stored_estimate(q, keys, values, pi, log_pi, scale)
    eta = _rows_layout(logit_bound(q, keys, scale=scale), w) if rounded else torch.zeros_like(w)
    eps = value_bound(values, dtype=dt)[:, :, None, :]                 # (b, h_kv, 1, n)
    return _bound_from(w, dist2, on, lead, eta, eps)


def quantization_variance(q: torch.Tensor, keys, values, pi: torch.Tensor | None = None, *,
                          log_pi: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    r"""The variance stochastic rounding adds to the Hajek estimate per query, from the stored rows, batched:
    ``kvcert.reference.quantization_variance`` for every (batch, query head[, query]).

    .. math::

        V_q = \sum_{i\in S} w_i'^2 \Big(\sigma_i^2\,\lVert Q(v_i) - \hat o_q\rVert^2
              + \sum_j \frac{s_{v,ij}^2}{4}\Big),

    :math:`\sigma_i^2` (:func:`logit_variance`; 0 for exact keys). The value term is exact, the logit term the
    delta method's evaluated at the stored rows (docs/quantized.md, section 4).

    Parameters
    ----------
    q, pi, log_pi, scale : as :func:`quantization_bound`
    keys : stochastically rounded QuantizedRows or QuantizedChannels, or a tensor of exact keys
    values : stochastically rounded QuantizedRows

    Returns
    -------
    (b, h_q[, t]) float64 for a float64 q, float32 otherwise; +inf where the sample is empty.
    """
    if isinstance(values, QuantizedRows) and values.rounding != "stochastic":
        raise ValueError("values must be stochastically rounded (rounding='stochastic') for a variance: "
                         "round-to-nearest errors are not random")
    w, dist2, on, lead, dt, rounded = _stored_estimate(q, keys, values, pi, log_pi, scale)
    sigma2 = _rows_layout(logit_variance(q, keys, scale=scale), w) if rounded else torch.zeros_like(w)
    value_var = values.variance_bound(dt).sum(dim=-1)[:, :, None, :]   # (b, h_kv, 1, n)
    return _variance_from(w, dist2, on, lead, sigma2, value_var)


# ----------------------------------------------------------------------------- memory


def check_kv_bits(kv_bits, name: str = "kv_bits") -> int:
    """``kv_bits`` as an int of :data:`KV_BITS`, else ValueError naming the argument and the accepted values."""
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, numbers.Integral) or int(kv_bits) not in KV_BITS:
        raise ValueError(f"{name} must be one of {KV_BITS} (16: unquantized), got {kv_bits!r}")
    return int(kv_bits)


def check_kv_layout(layout, name: str = "kv_layout") -> str:
    """A name of :data:`KV_LAYOUTS`, else ValueError naming the argument and the accepted values."""
    if not isinstance(layout, str) or layout not in KV_LAYOUTS:
        raise ValueError(f"{name} must be one of {KV_LAYOUTS}, got {layout!r}")
    return layout


def check_quantized_bound(bound, name: str = "quantized_bound") -> str:
    """A name of :data:`QUANTIZED_BOUNDS`, else ValueError naming the argument and the accepted values."""
    if not isinstance(bound, str) or bound not in QUANTIZED_BOUNDS:
        raise ValueError(f"{name} must be one of {QUANTIZED_BOUNDS}, got {bound!r}")
    return bound


def _check_kv_bits(kv_bits) -> int:
    return check_kv_bits(kv_bits)


def _check_layout(layout) -> str:
    return check_kv_layout(layout, "layout")


def _code_elements(d: int, dv: int, b: int, layout: str) -> float:
    """16-bit elements of one kept token's codes: keys unquantized in the "values" layout."""
    return d + dv * b / 16.0 if layout == "values" else (d + dv) * b / 16.0


def token_elements(d: int, dv: int, kv_bits: int, *, layout: str = "channel") -> float:
    r"""16-bit elements held per kept token at ``kv_bits`` in ``layout`` (:data:`KV_LAYOUTS`), with
    :math:`\log\pi_i`, as ``kvcert.reference.token_elements``: ``"token"`` :math:`(d + d_v)\,b/16 + 2 + 1`;
    ``"channel"`` :math:`(d + d_v)\,b/16 + d/G + 1 + 1` (G = :data:`CHANNEL_GROUP`); ``"values"``
    :math:`d + d_v\,b/16 + 1 + 1`; :math:`d + d_v + 1` at 16 bits (every layout)."""
    b = _check_kv_bits(kv_bits)
    layout = _check_layout(layout)
    for name, v in (("d", d), ("dv", dv)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if b == 16 or layout == "token":
        return (d + dv) * b / 16.0 + (SCALES_PER_TOKEN if b < 16 else 0) + TOKEN_SCALARS
    key_scales = d / CHANNEL_GROUP if layout == "channel" else 0.0
    return _code_elements(d, dv, b, layout) + key_scales + 1 + TOKEN_SCALARS


def sampled_budget(budget, d: int, dv: int, kv_bits: int, *, extra: float = 0.0, layout: str = "channel"):
    r"""The expected kept count a design samples at ``kv_bits`` in the memory of ``budget`` unquantized tokens,
    :math:`B_b = (B\,(d + d_v + 1) - E - E_G) / \text{token\_elements}`, as ``kvcert.reference.sampled_budget``
    (:math:`E` = ``extra``, a sketch's elements; :math:`E_G = d` in the ``"channel"`` layout below 16 bits).
    ``budget``: a float, or a float tensor (one per (batch, KV head)), returned in kind."""
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    partial = float(d) if _check_layout(layout) == "channel" and kv_bits != 16 else 0.0
    per_token = token_elements(d, dv, kv_bits, layout=layout)
    if isinstance(budget, torch.Tensor):
        return (budget.to(torch.float64) * token_elements(d, dv, 16) - float(extra) - partial) / per_token
    return (float(budget) * token_elements(d, dv, 16) - float(extra) - partial) / per_token


def quantized_memory_fraction(n: int, d: int, dv: int, *, kept, kv_bits: int, extra: float = 0.0,
                              layout: str = "channel"):
    r"""Fraction of the full 16-bit cache's K+V memory held at ``kv_bits`` in ``layout``,
    :math:`(|S|\,\text{token\_elements} + E) / (n\,(d + d_v))`, as
    ``kvcert.reference.quantized_memory_fraction`` (the ``"channel"`` key scales per started group,
    :math:`\lceil |S|/G\rceil d`; no :math:`\log\pi` and no sketch when ``kept == n``). ``kept``: an int, or an
    integer tensor of kept counts (e.g. ``CompressedCache.kept`` (b, h_kv)), giving a float64 tensor."""
    per_token = token_elements(d, dv, kv_bits, layout=layout)
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    k = kept.to(torch.float64) if isinstance(kept, torch.Tensor) else torch.tensor(float(kept), dtype=torch.float64)
    if k.numel() and not bool(((k >= 0) & (k <= n) & (k == k.round())).all()):
        raise ValueError(f"kept must be integers in [0, n] = [0, {n}]")
    full, cells = k == n, float(n * (d + dv))
    if layout == "channel" and kv_bits != 16:
        stored = k * (_code_elements(d, dv, kv_bits, layout) + 1) + torch.ceil(k / CHANNEL_GROUP) * d
        out = torch.where(full, stored / cells, (stored + k * TOKEN_SCALARS + float(extra)) / cells)
    else:
        out = torch.where(full, (per_token - TOKEN_SCALARS) / float(d + dv), (k * per_token + float(extra)) / cells)
    return out if isinstance(kept, torch.Tensor) else float(out)


# ----------------------------------------------------------------------------- a quantized cache's kept tokens


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    r"""The kept tokens of an eviction event as a quantized cache stores them, packed to the front of each
    head (:func:`kvcert.fast.compact`'s slots) and padded: what :meth:`kvcert.fast.TokenDesign.event` returns
    at ``kv_bits`` < 16 and what the Hugging Face cache layer holds in place of its keys and values.

    Attributes
    ----------
    keys : QuantizedChannels (``"channel"``), QuantizedRows (``"token"``) or a tensor of exact keys
        (``"values"``), (b, h_kv, m, d); padding slots hold zeros (codes 0), which leave every scale as the
        kept rows alone give it
    values : QuantizedRows (b, h_kv, m, dv)
    log_pi : (b, h_kv, m) float64, log pi of each slot (-inf on padding)
    positions : (b, h_kv, m) int64, each slot's token position (-1 on padding)
    kv_bits : int, 8 or 4   layout : str, a name of :data:`KV_LAYOUTS`
    """

    keys: object
    values: QuantizedRows
    log_pi: torch.Tensor
    positions: torch.Tensor
    kv_bits: int
    layout: str

    def __post_init__(self):
        bits = check_kv_bits(self.kv_bits)
        if bits == 16:
            raise ValueError("kv_bits: a QuantizedKV stores 8 or 4 bits (16 bits is the unquantized cache)")
        check_kv_layout(self.layout)
        if not isinstance(self.values, QuantizedRows):
            raise TypeError(f"values must be QuantizedRows, got {type(self.values).__name__}")
        lead = tuple(self.values.codes.shape[:3])
        for name in ("log_pi", "positions"):
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != lead:
                raise ValueError(f"{name} must be a tensor of shape (b, h_kv, m) = {lead}")
        shape = self.keys.codes.shape if isinstance(self.keys, _STORED) else getattr(self.keys, "shape", None)
        if shape is None or tuple(shape[:3]) != lead:
            raise ValueError(f"keys must have shape (b, h_kv, m, d) with (b, h_kv, m) = {lead}")

    @property
    def rounding(self) -> str:
        """``"stochastic"`` or ``"nearest"``: how the values (and quantized keys) were rounded."""
        return self.values.rounding

    @property
    def kept(self) -> torch.Tensor:
        """(b, h_kv) int64 tokens held per head."""
        return (self.log_pi > float("-inf")).sum(-1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys (b, h_kv, m, d), values (b, h_kv, m, dv)) the stored rows in ``dtype`` (exact in float32)."""
        keys = self.keys.dequantize(dtype) if isinstance(self.keys, _STORED) else self.keys.to(dtype)
        return keys, self.values.dequantize(dtype)

    def map(self, fn) -> "QuantizedKV":
        """The same storage with ``fn`` applied to every tensor along the batch dim (a beam reorder, a select)."""
        def one(x):
            if isinstance(x, QuantizedChannels):
                return QuantizedChannels(fn(x.codes), fn(x.scales), x.group, x.format, x.rounding)
            if isinstance(x, QuantizedRows):
                return QuantizedRows(fn(x.codes), fn(x.scales), x.format, x.rounding)
            return fn(x)
        return QuantizedKV(one(self.keys), one(self.values), fn(self.log_pi), fn(self.positions), self.kv_bits,
                           self.layout)

    @staticmethod
    def cat(parts) -> "QuantizedKV":
        """Stack QuantizedKV of single rows (1, h_kv, m_r, ...) along the batch, each padded to the largest m
        (zero codes and scales, log pi -inf, position -1: padding slots), in one layout and bit width."""
        parts = list(parts)
        first = parts[0]
        if any((p.kv_bits, p.layout, p.rounding) != (first.kv_bits, first.layout, first.rounding) for p in parts):
            raise ValueError("parts: every part must share kv_bits, layout and rounding")
        m = max(p.log_pi.shape[-1] for p in parts)
        pad = torch.nn.functional.pad

        def grow(x, value=0.0, rows=True):  # slots dim -2 for (.., m, m') tensors, -1 for (.., m)
            extra = m - x.shape[-2 if rows else -1]
            if extra == 0:
                return x
            return pad(x, (0, 0, 0, extra) if rows else (0, extra), value=value)

        def one(x):
            if isinstance(x, QuantizedChannels):
                groups = -(-m // x.group)
                return x.codes.new_zeros(0), (grow(x.codes), pad(x.scales, (0, 0, 0, groups - x.scales.shape[-2])))
            if isinstance(x, QuantizedRows):
                return x.codes.new_zeros(0), (grow(x.codes), grow(x.scales, rows=False))
            return None, grow(x)

        def join(get):
            items = [one(get(p))[1] for p in parts]
            if isinstance(items[0], tuple):
                return tuple(torch.cat([it[i] for it in items]) for i in range(2))
            return torch.cat(items)

        kc = join(lambda p: p.keys)
        vc, vs = join(lambda p: p.values)
        keys = kc
        if isinstance(first.keys, QuantizedChannels):
            keys = QuantizedChannels(kc[0], kc[1], first.keys.group, first.keys.format, first.keys.rounding)
        elif isinstance(first.keys, QuantizedRows):
            keys = QuantizedRows(kc[0], kc[1], first.keys.format, first.keys.rounding)
        values = QuantizedRows(vc, vs, first.values.format, first.values.rounding)
        log_pi = torch.cat([grow(p.log_pi, float("-inf"), rows=False) for p in parts])
        positions = torch.cat([grow(p.positions, -1, rows=False) for p in parts])
        return QuantizedKV(keys, values, log_pi, positions, first.kv_bits, first.layout)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales (one code per byte at 4 bits: not packed) and exact keys, without
        log pi and positions."""
        parts = [self.values.codes, self.values.scales]
        parts += [self.keys.codes, self.keys.scales] if isinstance(self.keys, _STORED) else [self.keys]
        return sum(t.numel() * t.element_size() for t in parts)


def store_kv(keys: torch.Tensor, values: torch.Tensor, log_pi: torch.Tensor, positions: torch.Tensor, *,
             kv_bits: int, layout: str = "channel", rounding: str = "stochastic", seed: int = 0, layer: int = 0,
             event: int = 0, head_offset: int = 0) -> QuantizedKV:
    r"""Quantize packed kept tokens (b, h_kv, m, d/dv) as ``evict_and_certify(kv_bits=...)`` stores them.

    ``layout`` (:data:`KV_LAYOUTS`): ``"channel"`` keys per channel and group of :data:`CHANNEL_GROUP` slots,
    values per token; ``"token"`` both per token; ``"values"`` exact keys. Stochastic rounding draws
    :func:`rounding_uniforms` (seed, layer, event, KV head + ``head_offset``; ``row_streams=False``, so every
    batch row draws what row 0 would), keys (``part="keys"``) and values apart, indexed by each slot's token
    position (padding draws position 0; its zeros round to 0 whatever the uniform), so a token's rounding
    does not depend on the slot it sits in. Codes ``torch.int8`` (int4 one code per byte), scales float16.

    Parameters
    ----------
    keys, values : (b, h_kv, m, d), (b, h_kv, m, dv), finite, zeros on padding
    log_pi, positions : (b, h_kv, m), -inf / -1 on padding
    kv_bits : 8 or 4   layout : a name of :data:`KV_LAYOUTS`   rounding : ``"stochastic"`` or ``"nearest"``
    seed, layer, event, head_offset : int >= 0, the rounding stream's coordinates
    """
    bits = check_kv_bits(kv_bits)
    if bits == 16:
        raise ValueError("kv_bits: store_kv quantizes to 8 or 4 bits (16 bits is the unquantized cache)")
    layout = check_kv_layout(layout, "layout")
    fmt = KV_FORMAT[bits]
    rounding = _check_rounding(rounding, fmt)
    positions = check_tensor("positions", positions)
    index = positions.clamp(min=0).to(torch.int64)

    def draw(x, part):
        if rounding == "nearest":
            return {}
        u = rounding_uniforms(tuple(x.shape), seed, part=part, layer=layer, event=event, index=index,
                              device=x.device, row_streams=False, head_offset=head_offset)
        return dict(rounding="stochastic", uniforms=u)

    if layout == "values":
        k_stored = keys
    elif layout == "channel":
        k_stored = quantize_channels(keys, fmt, **draw(keys, "keys"))
    else:
        k_stored = quantize(keys, fmt, **draw(keys, "keys"))
    v_stored = quantize(values, fmt, **draw(values, "values"))
    return QuantizedKV(k_stored, v_stored, log_pi.to(torch.float64), positions.to(torch.int64), bits, layout)
