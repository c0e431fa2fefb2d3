"""The input contract of ``hajek_attention``, checked once for every backend (internal).

:func:`check_attention_inputs` is the one place where the arguments shared by
:func:`kvcert.fast.hajek_attention`, :func:`kvcert.kernels.hajek_attention`
and the reference loop of :func:`kvcert.dispatch.hajek_attention` are checked
(docs/design.md section 3): q (b, h_q, d) or (b, h_q, t, d); keys (b, h_kv, n, d);
values (b, h_kv, n, dv); exactly one of pi / log_pi (b, h_kv, n); GQA
h_q = g * h_kv; a finite positive scale (default 1/sqrt(d)); and, for the
backends that take them, bias, positions, query_positions and offset. Bad input
raises ``TypeError`` (wrong kind) or ``ValueError`` (wrong shape or range)
naming the argument and what was expected (STYLE.md rule 6).

What only one backend needs (the Triton kernel's decode-only q, its dtypes,
CUDA) stays in that backend. The checks of values (pi in [0, 1], log_pi in
[-inf, 0], bias without NaN or +inf) read the tensors and so synchronise with
the device: they run only with ``validate=True``, one synchronisation each.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from ._checks import check_scale, check_tensor

__all__ = ["AttentionLayout", "check_attention_inputs", "check_attention_values"]


@dataclass(frozen=True, eq=False)
class AttentionLayout:
    """Checked sizes of one ``hajek_attention`` call.

    ``t`` is None for a decode query (b, h_q, d); ``p`` is the probability
    tensor as given (``pi`` or ``log_pi``, named by ``p_name``; both None for
    exact attention); ``scale`` is the resolved softmax scale.
    """

    b: int
    h_q: int
    h_kv: int
    g: int
    t: int | None
    n: int
    d: int
    dv: int
    scale: float
    p: torch.Tensor | None = None
    p_name: str | None = None

    @property
    def decode(self) -> bool:
        """q is (b, h_q, d): one query per head, no query dimension."""
        return self.t is None

    @property
    def bias_shape(self) -> tuple[int, ...]:
        """What ``bias`` must broadcast to: (b, h_q, n) or (b, h_q, t, n)."""
        if self.decode:
            return (self.b, self.h_q, self.n)
        return (self.b, self.h_q, self.t, self.n)


def check_attention_inputs(q, keys, values, pi=None, *, log_pi=None, scale=None, bias=None, positions=None,
                           query_positions=None, offset=None, probabilities: bool = True,
                           validate: bool = False) -> AttentionLayout:
    """Check the arguments of ``hajek_attention`` (or, with ``probabilities=False``, of ``attention``).

    Parameters
    ----------
    q : floating tensor (b, h_q, d) or (b, h_q, t, d)
    keys, values : floating tensors (b, h_kv, n, d), (b, h_kv, n, dv); h_q = g * h_kv, d, dv >= 1
    pi, log_pi : floating tensor (b, h_kv, n)
        Exactly one of the two (neither when ``probabilities=False``).
    scale : float, optional
        Finite and positive; default 1/sqrt(d).
    bias : tensor broadcastable to (b, h_q, [t,] n), optional
    positions : tensor (b, h_kv, n), optional; needs ``query_positions`` or ``offset``
    query_positions : tensor (t,) or (b, t), optional (t = 1 for a decode q)
    offset : int, optional; at most one of ``query_positions`` and ``offset``
    probabilities : bool
        Require exactly one of ``pi`` and ``log_pi``.
    validate : bool
        Also check the values: pi in [0, 1], log_pi in [-inf, 0] (NaN refused),
        bias free of NaN and +inf. Each reads a tensor (one device
        synchronisation); everything else looks at shapes only.

    Returns
    -------
    AttentionLayout

    Raises
    ------
    TypeError
        A non-tensor, a non-floating q/keys/values/pi, a missing or doubled
        pi/log_pi, a non-float scale, a non-int offset, positions without
        query positions.
    ValueError
        A wrong shape, GQA mismatch, zero head dimension, tensors on several
        devices, a non-positive or non-finite scale, values out of range.
    """
    q = check_tensor("q", q, floating=True)
    if q.ndim not in (3, 4):
        raise ValueError(f"q must be 3-d or 4-d, of shape (b, h_q, d) or (b, h_q, t, d), got shape {tuple(q.shape)}")
    keys = check_tensor("keys", keys, floating=True)
    values = check_tensor("values", values, floating=True)
    b, h_q, d = q.shape[0], q.shape[1], q.shape[-1]
    t = None if q.ndim == 3 else q.shape[2]
    if keys.ndim != 4 or keys.shape[0] != b or keys.shape[3] != d:
        raise ValueError(f"keys must have shape (b, h_kv, n, d) = ({b}, h_kv, n, {d}), got shape {tuple(keys.shape)}")
    h_kv, n = keys.shape[1], keys.shape[2]
    if values.ndim != 4 or tuple(values.shape[:3]) != (b, h_kv, n):
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = ({b}, {h_kv}, {n}, dv), "
                         f"got shape {tuple(values.shape)}")
    dv = values.shape[3]
    if h_kv == 0 or h_q % h_kv:
        raise ValueError(f"the number of query heads h_q = {h_q} (q.shape[1]) must be a multiple of "
                         f"h_kv = {h_kv} (keys.shape[1]; GQA)")
    if d == 0 or dv == 0:
        raise ValueError(f"head dimensions must be positive, got d = {d} (q.shape[-1]), dv = {dv} (values.shape[-1])")
    p, p_name = None, None
    if probabilities:
        if (pi is None) == (log_pi is None):
            raise TypeError("give exactly one of pi and log_pi, each of shape (b, h_kv, n)")
        p_name = "pi" if pi is not None else "log_pi"
        p = check_tensor(p_name, pi if pi is not None else log_pi)
        if tuple(p.shape) != (b, h_kv, n):
            raise ValueError(f"{p_name} must have shape (b, h_kv, n) = ({b}, {h_kv}, {n}), got shape {tuple(p.shape)}")
        if not p.is_floating_point():
            raise TypeError(f"{p_name} must be a floating-point tensor, got dtype {p.dtype}")
    named = [("q", q), ("keys", keys), ("values", values)] + ([(p_name, p)] if p is not None else [])
    if any(x.device != q.device for _, x in named):
        raise ValueError(f"{', '.join(k for k, _ in named[:-1])} and {named[-1][0]} must be on one device, "
                         f"got {', '.join(str(x.device) for _, x in named)}")
    tau = check_scale(scale, d)
    layout = AttentionLayout(b=b, h_q=h_q, h_kv=h_kv, g=h_q // h_kv, t=t, n=n, d=d, dv=dv, scale=tau,
                             p=p, p_name=p_name)
    if bias is not None:
        bias = check_tensor("bias", bias)
        full = layout.bias_shape
        try:
            fits = tuple(torch.broadcast_shapes(tuple(bias.shape), full)) == full
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"bias must broadcast to {full} (per query head), got {tuple(bias.shape)}")
    _check_causal(layout, positions, query_positions, offset)
    if validate:
        check_attention_values(layout, bias)
    return layout


def _check_causal(L: AttentionLayout, positions, query_positions, offset) -> None:
    """positions (b, h_kv, n) with query_positions (t,) / (b, t) or an int offset."""
    if query_positions is not None and offset is not None:
        raise TypeError("pass at most one of query_positions= and offset=")
    if offset is not None and (isinstance(offset, bool) or not isinstance(offset, numbers.Integral)):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    t = 1 if L.decode else L.t
    if query_positions is not None:
        qp = check_tensor("query_positions", query_positions)
        if tuple(qp.shape) not in ((t,), (L.b, t)):
            raise ValueError(f"query_positions must have shape (t,) or (b, t) = ({L.b}, {t}), "
                             f"got shape {tuple(qp.shape)}")
    if positions is not None:
        if query_positions is None and offset is None:
            raise TypeError("positions= needs query_positions= (or offset=) for the causal mask")
        pos = check_tensor("positions", positions)
        if tuple(pos.shape) != (L.b, L.h_kv, L.n):
            raise ValueError(f"positions must have shape (b, h_kv, n) = ({L.b}, {L.h_kv}, {L.n}), "
                             f"got shape {tuple(pos.shape)}")


def check_attention_values(layout: AttentionLayout, bias: torch.Tensor | None = None) -> None:
    """The checks of ``validate=True`` alone, for arguments whose shapes passed already.

    pi in [0, 1] or log_pi in [-inf, 0] (NaN refused), bias free of NaN and +inf:
    one host synchronisation per tensor.
    """
    p = layout.p
    if p is not None and p.numel():
        if layout.p_name == "pi":
            lo, hi = torch.stack(torch.aminmax(p)).tolist()  # NaN propagates into both
            if not (lo >= 0.0 and hi <= 1.0):
                raise ValueError("pi must lie in [0, 1] (found a value outside, or NaN)")
        elif not bool((p <= 0).all()):  # NaN <= 0 is False
            raise ValueError("log_pi must lie in [-inf, 0] (found a value above 0, or NaN)")
    if bias is not None and bias.numel() and bool((torch.isnan(bias) | (bias == float("inf"))).any()):
        raise ValueError("bias must not contain NaN or +inf (use -inf to mask a token)")
