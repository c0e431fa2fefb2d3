"""Every route into the Hajek estimators: which code computes a decode step, and the call.

``kvcert.hajek_attention`` runs one of three backends with one signature:

- ``"triton"``: :func:`kvcert.kernels.hajek_attention`, the fused decode
  kernel (output, log-normalizer and variance in one pass over K/V). Chosen
  automatically for CUDA tensors of dtype float16 / bfloat16 / float32 when
  Triton is importable.
- ``"fast"``: :func:`kvcert.fast.hajek_attention`, batched PyTorch (CPU or
  GPU). Chosen automatically otherwise. On CPU tensors, a trace-only call
  (``per_coordinate=False``: what the norm certificates and the Hugging Face
  decode ask for) with K/V in float32 or bfloat16 and no option the op
  lacks (bias, causal positions, weights, max_term, covariance,
  tail_moment) runs :func:`kvcert.kernels.cpu.hajek_attention` instead: the
  same estimate from one fused C++ pass over K and V, built on first use.
  If that op cannot be built (no compiler, no ninja, a failed build), one
  warning names the cause and kvcert.fast runs. ``KVCERT_CPU_OP=0`` keeps
  every call on kvcert.fast. :func:`sketch_hajek_attention` makes the same
  choice for the sketched designs' decode step (the op's kept pass and the
  sketch's epilogue in one call).
- ``"reference"``: loops over the (batch, query head[, query]) slices calling
  the float64 NumPy oracle :func:`kvcert.reference.hajek_attention` and packs
  a torch :class:`~kvcert.fast.types.Estimate`. Slow; for debugging.

The code a call ran is a :class:`Route` (a backend and its code: :data:`CPU_OP`,
:data:`TORCH`, :data:`TRITON`, :data:`REFERENCE`), chosen by one table, :data:`ROUTER`:
(design, cache layout, device) -> the codes that may compute the step, in order of
preference, the first that fits the call running. Every result says which ran: the
estimate's ``backend`` and ``route`` fields (:class:`kvcert.fast.types.Estimate`; for
:func:`sketch_hajek_attention`, ``result.estimate``); no module state records it (the
deprecated :func:`last_backend` / :func:`last_route` read a ContextVar kept for them alone).

The decode of one cache layer under a press has one entry, :func:`decode`: it picks the
design's route from what the layer holds (:func:`decode_route`; ``"token"``, ``"block"`` or
``"sketch"``, docs/design.md sections 5, 7 and 8) and runs it without host reads (the
values were checked when the eviction event installed them), so that a decode forward
reads the device once, for the caller's NaN check. The token route's code is resolved once
per forward, at its first layer: :attr:`LayerDecode.backend`, a :class:`Route`, handed back
to :func:`decode` for the forward's other layers.

The environment variable ``KVCERT_BACKEND`` (``reference``, ``fast`` or
``triton``; empty or ``auto`` for automatic) or the ``backend=`` argument
forces one; :func:`select_backend` says which backend would run.
:func:`last_backend` and :func:`last_route` are deprecated (read the result's fields).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import math
import os
import warnings
from dataclasses import dataclass, replace

import torch

from kvcert.fast._checks import check_scale, check_softcap
from kvcert.fast.contract import check_attention_inputs
from kvcert.fast.types import Estimate

__all__ = [
    "BACKENDS",
    "CPU_OP",
    "CPU_OP_ENV_VAR",
    "ENV_VAR",
    "DECODE_ROUTES",
    "GATHER",
    "PAGED_CPU_OP",
    "PAGED_TORCH",
    "PAGED_TRITON",
    "REFERENCE",
    "ROUTER",
    "TORCH",
    "TRITON",
    "BackendUnavailableError",
    "DecodeRecord",
    "LayerDecode",
    "PagedDecode",
    "Route",
    "sketch_hajek_attention",
    "cpu_op_available",
    "decode",
    "decode_route",
    "hajek_attention",
    "last_backend",
    "last_route",
    "paged_decode",
    "paged_route",
    "select_backend",
    "triton_available",
]

#: the backends :func:`hajek_attention` can run
BACKENDS = ("reference", "fast", "triton")
#: environment variable that forces a backend
ENV_VAR = "KVCERT_BACKEND"
#: keyword arguments that only tune the Triton kernel (dropped for the other backends)
_TRITON_ONLY = frozenset({"block_n", "num_splits", "num_warps", "num_stages", "certify", "moments"})
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: kvcert.fast options the kernel does not implement: when one is set (not None / False), the
#: automatic choice is "fast" (this is how ``return_max_term=True`` for the bernstein certificate
#: falls back to kvcert.fast on CUDA), and forcing "triton" raises a TypeError
_FAST_ONLY = ("bias", "positions", "query_positions", "offset", "return_weights", "return_max_term",
              "return_covariance", "value_center", "value_sqdist")
# (``return_tail_moment``, for the chebyshev_ucb certificate, is implemented by every backend: it is
# passed through and does not route the call away from the kernel)

#: environment variable: 0 (false/no/off) keeps the "fast" backend on kvcert.fast for CPU tensors
CPU_OP_ENV_VAR = "KVCERT_CPU_OP"
#: options of a "fast" call the compiled CPU op honours or ignores (value_sqdist, chunk_bytes and
#: query_chunk_bytes have no effect: the op computes the distances in its pass; the Triton tuning
#: arguments are dropped for every other backend)
_CPU_OP_KW = frozenset({"value_center", "value_sqdist", "validate", "chunk_bytes", "query_chunk_bytes"})
_CPU_OP_DTYPES = (torch.float32, torch.bfloat16)
#: the keywords of a resolved token call :func:`hajek_attention` passes to the op's per-step call
#: (besides q, K, V, log_pi and the scale; value_sqdist is not read: the op computes the distances in its pass)
_STEP_KW = frozenset({"value_center", "value_sqdist", "validate"})
_STEP_CALL = {"per_coordinate": False, "validate": False}  # the op's per-step call: trace only, no checks
#: the same for a resolved sketch call of :func:`sketch_hajek_attention`
_SKETCH_STEP_KW = frozenset({"log_pi", "scale", "delta", "value_center", "value_sqdist", "validate"})


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run on these tensors in this environment."""


# ---------------------------------------------------------------------------------------------
# routes: the code that computes a call, and the table that chooses it
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """The code that computes a decode step.

    Attributes
    ----------
    backend : str
        The backend (:data:`BACKENDS`): ``"reference"``, ``"fast"`` or ``"triton"``.
    code : str
        What ran it. On a dense cache (a Hugging Face layer, contiguous K/V): ``"reference"`` (the float64
        oracle), ``"torch"`` (kvcert.fast), ``"cpu_op"`` (the compiled CPU op, :mod:`kvcert.kernels.cpu`, a
        code of the "fast" backend) or ``"triton"``. On a paged cache (the vLLM plugin's, read through a block
        table, :func:`paged_decode`): ``"paged_cpu_op"`` (the compiled op's paged entries,
        :func:`kvcert.kernels.cpu.paged_hajek_attention` / :func:`~kvcert.kernels.cpu.paged_sketch_hajek_attention`,
        reading the slots in place), ``"paged_torch"`` (kvcert.fast's paged estimator,
        :func:`kvcert.fast.blocks.paged_block_hajek_attention`: a chunked gather of whole blocks), ``"gather"``
        (the rows' slots gathered by the caller's reader, then the dense route of the design; the dense code
        that ran is :attr:`PagedDecode.dense`) or ``"paged_triton"``
        (:func:`kvcert.kernels.paged_block_hajek_attention`, the FlashAttention cache layout, CUDA).

    A result carries the two as its estimate's ``backend`` and ``route`` fields. Handed back to
    :func:`decode` (or as ``backend=`` to :func:`hajek_attention` / :func:`sketch_hajek_attention`),
    a route is a forward's resolution: :data:`CPU_OP` calls the op's per-step form (no argument
    checks) where the layer's tensors fit it; any other route stands for its backend, the code
    chosen per call.
    """

    backend: str
    code: str


#: the compiled CPU op of the "fast" backend (:mod:`kvcert.kernels.cpu`)
CPU_OP = Route("fast", "cpu_op")
#: kvcert.fast, batched PyTorch on any device
TORCH = Route("fast", "torch")
#: the Triton kernel (:mod:`kvcert.kernels`)
TRITON = Route("triton", "triton")
#: the float64 NumPy oracle, slice by slice
REFERENCE = Route("reference", "reference")
#: the compiled CPU op's paged entries (:mod:`kvcert.kernels.cpu`), reading the vLLM plugin's ``vec`` cache in place
PAGED_CPU_OP = Route("fast", "paged_cpu_op")
#: kvcert.fast's paged block estimator (:func:`kvcert.fast.blocks.paged_block_hajek_attention`), ``vec`` cache
PAGED_TORCH = Route("fast", "paged_torch")
#: the rows' slots gathered from the paged cache (the caller's reader), then the design's dense route
GATHER = Route("fast", "gather")
#: the Triton paged block kernel (:func:`kvcert.kernels.paged_block_hajek_attention`), FlashAttention cache layout
PAGED_TRITON = Route("triton", "paged_triton")
#: a forced backend other than "fast" runs its one code, without a fit test (a kernel that cannot run says why)
_FORCED = {"reference": REFERENCE, "triton": TRITON}

#: The router: (design, cache layout, device type) -> the codes that may compute the design's decode step,
#: in order of preference; the first that fits the call runs (the op: a trace-only call on CPU tensors in
#: float32 / bfloat16 with no option it lacks; Triton: a decode query in a kernel dtype, no kvcert.fast-only
#: option, Triton installed), :data:`TORCH` always fits. A device not listed runs :data:`TORCH`; a forced
#: backend keeps its codes. The paged layout (a block table over the vLLM plugin's cache, :func:`paged_decode`):
#: :data:`PAGED_CPU_OP` fits a CPU query where the op is available (the token design: a trace-only kind),
#: :data:`PAGED_TORCH` a trace-only kind, :data:`PAGED_TRITON` a trace-only kind on CUDA; :data:`GATHER` always
#: fits (the dense row then chooses the code); a paged key not listed runs :data:`GATHER`.
ROUTER = {
    ("token", "dense", "cpu"): (CPU_OP, TORCH),
    ("token", "dense", "cuda"): (TRITON, TORCH),
    ("block", "dense", "cpu"): (TORCH,),
    ("block", "dense", "cuda"): (TORCH,),
    ("sketch", "dense", "cpu"): (CPU_OP, TORCH),
    ("sketch", "dense", "cuda"): (TORCH,),
    ("token", "paged", "cpu"): (PAGED_CPU_OP, GATHER),
    ("block", "paged", "cpu"): (PAGED_TORCH, GATHER),
    ("block", "paged", "cuda"): (PAGED_TRITON,),
    ("sketch", "paged", "cpu"): (PAGED_CPU_OP, GATHER),
}


def _route(design: str, q: torch.Tensor, fits, backend: str | None = None) -> Route:
    """The first of :data:`ROUTER`'s codes for ``design`` on a dense cache on ``q``'s device that ``fits(route)``
    (of ``backend``'s codes only, when it is given)."""
    for route in ROUTER.get((design, "dense", q.device.type), (TORCH,)):
        if (backend is None or route.backend == backend) and (route == TORCH or fits(route)):
            return route
    return TORCH


def _mark(est: Estimate, route: Route) -> Estimate:
    """``est`` with the route that computed it: its ``backend`` and ``route`` fields (set on the estimate the
    code just returned, no copy)."""
    est.backend, est.route = route.backend, route.code
    return est


def _ran(est: Estimate, route: Route) -> Estimate:
    """:func:`_mark`, for an entry point's result: also noted for the deprecated :func:`last_backend` /
    :func:`last_route`."""
    _LAST.set(route)
    return _mark(est, route)


# ---------------------------------------------------------------------------------------------
# deprecated: the route of the last call
# ---------------------------------------------------------------------------------------------
#: for the deprecated :func:`last_backend` and :func:`last_route` only: the route of the last
#: :func:`hajek_attention` or :func:`sketch_hajek_attention` call of the calling context (a ContextVar: each
#: thread, and each asyncio task, reads its own calls'). Results carry their route; this is kept only for the
#: callers of the deprecated functions.
_LAST: contextvars.ContextVar[Route | None] = contextvars.ContextVar("kvcert_dispatch_last_route", default=None)


def last_backend() -> str | None:
    """Deprecated: the backend of this thread's last :func:`hajek_attention` or :func:`sketch_hajek_attention`
    call (None before any). Read the result's ``backend`` field instead (``estimate.backend``;
    ``result.estimate.backend`` for a sketch call)."""
    warnings.warn("kvcert.dispatch.last_backend() is deprecated: read the result's `backend` field "
                  "(Estimate.backend; ClusterEstimate.estimate.backend for sketch_hajek_attention)",
                  DeprecationWarning, stacklevel=2)
    route = _LAST.get()
    return None if route is None else route.backend


def last_route() -> str | None:
    """Deprecated: the code that ran this thread's last :func:`hajek_attention` or :func:`sketch_hajek_attention`
    call, ``"cpu_op"``, ``"torch"``, ``"triton"`` or ``"reference"`` (None before any). Read the result's
    ``route`` field instead (``estimate.route``; ``result.estimate.route`` for a sketch call)."""
    warnings.warn("kvcert.dispatch.last_route() is deprecated: read the result's `route` field "
                  "(Estimate.route; ClusterEstimate.estimate.route for sketch_hajek_attention)",
                  DeprecationWarning, stacklevel=2)
    route = _LAST.get()
    return None if route is None else route.code


# ---------------------------------------------------------------------------------------------
# what each code computes
# ---------------------------------------------------------------------------------------------
@functools.cache
def _cpu_op_module():
    """kvcert.kernels.cpu, or None (with one warning naming the cause) when it cannot be imported."""
    try:
        return importlib.import_module("kvcert.kernels.cpu")
    except ImportError as e:  # kvcert.kernels imports Triton
        warnings.warn(f"kvcert: the compiled CPU decode op is unavailable: kvcert.kernels could not be imported "
                      f"({e}); decoding uses the torch path (kvcert.fast). Set {CPU_OP_ENV_VAR}=0 to choose "
                      "the torch path explicitly.", RuntimeWarning, stacklevel=5)
        return None


def cpu_op_available() -> bool:
    """Whether CPU calls of the "fast" backend run the compiled op: ``KVCERT_CPU_OP`` is not 0 and
    :mod:`kvcert.kernels.cpu` builds and loads (the first call may build it; a failure warns once)."""
    if os.environ.get(CPU_OP_ENV_VAR, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    mod = _cpu_op_module()
    return mod is not None and mod.available(warn=True)


def _cpu_op_fits(q, keys, values, kw: dict) -> bool:
    """Whether the compiled CPU op computes this trace-only "fast" call: CPU tensors, K and V both float32
    or both bfloat16, and no option it lacks (bias, positions, weights, max_term, covariance, tail_moment)."""
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        return False
    if not _op_tensors(q, keys, values):
        return False
    if any(k not in _CPU_OP_KW and k not in _TRITON_ONLY for k, v in kw.items() if v is not None and v is not False):
        return False
    return cpu_op_available()


def _op_tensors(q, keys, values) -> bool:
    """The tensors the compiled op reads: on the CPU, K and V both float32 or both bfloat16."""
    return (q.is_cpu and keys.is_cpu and values.is_cpu and keys.dtype in _CPU_OP_DTYPES
            and values.dtype == keys.dtype)


def _step_fits(q, keys, values, kw: dict) -> bool:
    """The per-layer checks of a resolved :data:`CPU_OP` call (the rest was checked once per forward): no value
    checks asked for (``validate=False``), and this layer's tensors fit the op (:func:`_op_tensors`)."""
    return kw.get("validate") is False and _op_tensors(q, keys, values)


def _step_scale(scale, q) -> float:
    """The score scale of a resolved step: a finite positive float as it is (a cache layer's, the common case:
    one type test), else :func:`kvcert.fast._checks.check_scale`'s (default 1/sqrt(d), or its error)."""
    return scale if type(scale) is float and 0.0 < scale < math.inf else check_scale(scale, q.shape[-1])


def triton_available() -> bool:
    """Whether Triton is installed (``kvcert.kernels`` is importable in principle)."""
    return importlib.util.find_spec("triton") is not None


def _forced(backend: str | None) -> str | None:
    if backend is None:
        backend = os.environ.get(ENV_VAR, "")
        source = f"environment variable {ENV_VAR}"
    else:
        source = "backend"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name in ("", "auto"):
        return None
    if name not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS} (or 'auto'/empty), got {backend!r}")
    return name


def _fast_only(kw: dict) -> list[str]:
    return [k for k in _FAST_ONLY if kw.get(k) is not None and kw.get(k) is not False]


def _kernel_fits(q: torch.Tensor) -> bool:
    return q.dim() == 3 or (q.dim() == 4 and q.shape[2] == 1)


def _triton_fits(q: torch.Tensor, kw: dict) -> bool:
    """Whether the Triton kernel computes this automatic call: a CUDA decode query (b, h_q, d) or (b, h_q, 1, d)
    in float16 / bfloat16 / float32, no kvcert.fast-only option, Triton installed."""
    return q.is_cuda and q.dtype in _TRITON_DTYPES and _kernel_fits(q) and not _fast_only(kw) and triton_available()


def select_backend(q: torch.Tensor | None = None, *, backend: str | None = None, **kw) -> str:
    """Name of the backend :func:`hajek_attention` would run for query ``q``.

    Parameters
    ----------
    q : torch.Tensor, optional
        The query; its device, dtype and shape decide the automatic choice.
        Without it the automatic choice is ``"fast"``.
    backend : {"reference", "fast", "triton"}, optional
        Force a backend (overrides ``KVCERT_BACKEND``).
    **kw
        The other keyword arguments of the call, if any: a kvcert.fast-only
        option (``bias``, ``positions``, ``query_positions``, ``offset``,
        ``return_weights``, ``return_max_term``, ``return_covariance``,
        ``value_center``, ``value_sqdist``) makes the automatic choice "fast".

    Returns
    -------
    str
        ``backend`` if given, else ``KVCERT_BACKEND`` if set, else
        ``"triton"`` for a decode query (b, h_q, d) or (b, h_q, 1, d) on CUDA
        of dtype float16/bfloat16/float32 when Triton is installed and no
        fast-only option is set, else ``"fast"`` (:data:`ROUTER`'s token row).
    """
    forced = _forced(backend)
    if forced is not None:
        return forced
    if not isinstance(q, torch.Tensor):
        return "fast"
    return _route("token", q, lambda route: route == TRITON and _triton_fits(q, kw)).backend


def _token_route(q, keys, values, per_coordinate, kw: dict, backend: str | None) -> Route:
    """The code :func:`hajek_attention` runs for this call (:data:`ROUTER`'s token row; ``backend``, or
    ``KVCERT_BACKEND``, forces a backend)."""
    forced = _forced(backend)
    if forced in _FORCED:
        return _FORCED[forced]

    def fits(route: Route) -> bool:
        if route == CPU_OP:
            return not per_coordinate and _cpu_op_fits(q, keys, values, kw)
        return route == TRITON and _triton_fits(q, kw)

    return _route("token", q, fits, forced)


def _check_triton_runnable(q: torch.Tensor) -> None:
    if not triton_available():
        raise BackendUnavailableError("backend 'triton' was forced but triton is not installed "
                                      "(pip install triton, or use backend='fast')")
    from kvcert import kernels

    if not q.is_cuda and not kernels.INTERPRETED:
        raise BackendUnavailableError(
            f"backend 'triton' was forced for tensors on {q.device}: Triton kernels need CUDA tensors, "
            "or TRITON_INTERPRET=1 set before kvcert.kernels is imported to run them on the CPU interpreter")


def hajek_attention(q, keys, values, pi=None, *, log_pi=None, scale=None, per_coordinate=True,
                    backend=None, **kw) -> Estimate:
    r"""Hajek-corrected attention over a compressed cache, on the selected backend.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \qquad a_i = \operatorname{softmax}_S(s_i - \log\pi_i),
        \qquad s_i = \tau\, q\cdot k_i,

        \hat\sigma^2_j = \sum_{i\in S} (1-\pi_i)\, a_i^2\, (v_{ij} - \hat o_j)^2, \qquad
        \mathrm{trace} = \sum_j \hat\sigma^2_j, \qquad
        \log\hat Z = \log\sum_{i\in S} e^{s_i}/\pi_i .

    Parameters
    ----------
    q : torch.Tensor, (b, h_q, d) or (b, h_q, t, d)
    keys : torch.Tensor, (b, h_kv, n, d)
    values : torch.Tensor, (b, h_kv, n, dv)
        The kept tokens, padded with pi = 0 slots; h_q = g * h_kv (GQA).
    pi : torch.Tensor, (b, h_kv, n), optional
        Inclusion probabilities in [0, 1]; 0 marks padding (bias -inf).
    log_pi : torch.Tensor, (b, h_kv, n), optional
        log pi instead of pi (-inf on padding). Give exactly one of the two.
    scale : float, default 1/sqrt(d)
        Finite and positive (every backend refuses a negative scale).
    per_coordinate : bool
        If False the fast and Triton backends may return ``variance=None``
        and compute only ``trace``.
    backend : {"reference", "fast", "triton"} or Route, optional
        Force a backend; default ``KVCERT_BACKEND`` or the automatic choice
        of :func:`select_backend`. On CPU tensors "fast" runs the compiled op
        (:mod:`kvcert.kernels.cpu`) for a trace-only call it covers (module
        docstring; ``KVCERT_CPU_OP=0`` keeps kvcert.fast). A :class:`Route`:
        :func:`decode`'s resolution for a forward. :data:`CPU_OP` with ``log_pi``,
        ``per_coordinate=False``, ``validate=False`` and at most ``value_center`` /
        ``value_sqdist`` besides calls :func:`kvcert.kernels.cpu.hajek_attention`
        with ``validate=False`` directly (the op's per-step call); any other call,
        or route, runs as its backend.
    **kw
        Passed to the backend. The Triton tuning arguments (``block_n``,
        ``num_splits``, ``num_warps``, ``num_stages``, ``certify``,
        ``moments``) are dropped when another backend runs. ``validate=False``
        (fast and triton) skips the checks that read tensor values, the only
        host synchronisations of a call; the reference always checks. The kvcert.fast
        options the kernel lacks (``return_max_term``, ``bias``, ``positions``, ...;
        see :func:`select_backend`) route an automatic call to "fast" (the
        ``bernstein`` certificate's max_term). ``return_tail_moment=True`` (for the
        ``chebyshev_ucb`` certificate) is implemented by every backend and does not
        change the choice.

    Returns
    -------
    kvcert.fast.types.Estimate
        Leading dimensions (b, h_q) or (b, h_q, t); ``backend`` and ``route`` name the
        code that ran (:class:`Route`). See the backends for which optional fields they
        fill (the Triton kernel leaves ``weights`` and ``max_term`` as None;
        ``tail_moment`` is filled on ``return_tail_moment=True`` by fast and triton,
        always by reference).

    Raises
    ------
    BackendUnavailableError
        A forced backend cannot run here (e.g. ``triton`` on CPU tensors
        without ``TRITON_INTERPRET=1``).

    Notes
    -----
    Empty heads (every slot padding): output 0, ``lse`` -inf, ``variance``
    and ``trace`` +inf, on every backend (the reference's convention).

    References
    ----------
    Hajek (1971); Sarndal, Swensson & Wretman (1992), sec. 5.6-5.7; arXiv 2607.21475.

    Examples
    --------
    >>> import torch
    >>> from kvcert.dispatch import hajek_attention
    >>> q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    >>> est = hajek_attention(q, k, v, torch.ones(1, 1, 5), backend="reference")
    >>> est.backend, est.route, float(est.trace.abs().max())
    ('reference', 'reference', 0.0)
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if isinstance(backend, Route):  # a forward's resolved token route (decode)
        if (backend == CPU_OP and pi is None and not per_coordinate and kw.keys() <= _STEP_KW
                and _step_fits(q, keys, values, kw)):
            est = _cpu_op_module().hajek_attention(q, keys, values, log_pi=log_pi, scale=_step_scale(scale, q),
                                                   value_center=kw.get("value_center"), **_STEP_CALL)
            return _ran(est, CPU_OP)
        backend = backend.backend
    route = _token_route(q, keys, values, per_coordinate, kw, backend)
    return _ran(_RUN["token", route](q, keys, values, pi, log_pi, scale, per_coordinate, kw), route)


def _untuned(kw: dict) -> dict:
    """``kw`` without the Triton tuning arguments (the backends other than Triton do not take them)."""
    return {k: v for k, v in kw.items() if k not in _TRITON_ONLY}


def _token_triton(q, keys, values, pi, log_pi, scale, per_coordinate, kw: dict) -> Estimate:
    """:func:`kvcert.kernels.hajek_attention`, after the checks that say why it cannot run."""
    _check_triton_runnable(q)
    unsupported = _fast_only(kw)
    if unsupported:
        raise TypeError(f"backend 'triton' does not support {', '.join(unsupported)} "
                        "(use backend='fast', or leave the backend automatic)")
    from kvcert import kernels

    return kernels.hajek_attention(q, keys, values, pi, log_pi=log_pi, scale=scale, per_coordinate=per_coordinate,
                                   **kw)


def _token_reference(q, keys, values, pi, log_pi, scale, per_coordinate, kw: dict) -> Estimate:
    """:func:`_reference`: the float64 oracle slice by slice."""
    return _reference(q, keys, values, pi, log_pi=log_pi, scale=scale, per_coordinate=per_coordinate,
                      **_untuned(kw))


def _token_cpu_op(q, keys, values, pi, log_pi, scale, per_coordinate, kw: dict) -> Estimate:
    """:func:`kvcert.kernels.cpu.hajek_attention` (its checks as ``validate`` asks)."""
    return _cpu_op_module().hajek_attention(q, keys, values, pi, log_pi=log_pi, scale=scale,
                                            per_coordinate=per_coordinate, value_center=kw.get("value_center"),
                                            validate=kw.get("validate", True))


def _token_torch(q, keys, values, pi, log_pi, scale, per_coordinate, kw: dict) -> Estimate:
    """:func:`kvcert.fast.hajek_attention`."""
    fn = getattr(importlib.import_module("kvcert.fast"), "hajek_attention", None)
    if fn is None:
        raise BackendUnavailableError("kvcert.fast.hajek_attention is not available yet (use backend='reference')")
    return fn(q, keys, values, pi, log_pi=log_pi, scale=scale, per_coordinate=per_coordinate, **_untuned(kw))


_REFERENCE_KW = frozenset(_FAST_ONLY) | {"validate"}


def _reference(q, keys, values, pi=None, *, log_pi=None, scale=None, per_coordinate=True, bias=None,
               positions=None, query_positions=None, offset=None, return_covariance=False,
               return_tail_moment=False, **ignored) -> Estimate:
    """Loop the float64 oracle over (b, h_q[, t]) and pack a torch Estimate.

    Fills every field (weights, n_eff, max_term, tail_moment always;
    covariance on ``return_covariance``; ``return_tail_moment`` is accepted
    for parity, the oracle computes tail_moment anyway). ``bias``
    (broadcastable to (b, h_q, [t,] n)) and the causal mask of
    ``positions`` / ``query_positions`` / ``offset`` follow kvcert.fast;
    ``return_weights``, ``return_max_term``, ``value_center`` and
    ``value_sqdist`` are accepted and have no effect (the oracle computes
    everything exactly). The arguments pass the same checker as the other
    backends (:func:`kvcert.fast.contract.check_attention_inputs`, values included).
    """
    import numpy as np

    from kvcert import reference as R

    unknown = sorted(set(ignored) - _REFERENCE_KW)
    if unknown:
        raise TypeError(f"backend 'reference' got unexpected keyword arguments {unknown}")
    L = check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale, bias=bias, positions=positions,
                               query_positions=query_positions, offset=offset, validate=True)
    decode, b, h_q, h_kv, g, n, dv = L.decode, L.b, L.h_q, L.h_kv, L.g, L.n, L.dv
    t = 1 if decode else L.t
    p64 = L.p.detach().to("cpu", torch.float64).numpy()
    if L.p_name == "log_pi":
        p64 = np.exp(p64)
    qq = q.detach().to("cpu", torch.float64).numpy()
    if decode:
        qq = qq[:, :, None, :]
    bb = np.zeros((b, h_q, t, n))
    if bias is not None:
        bt = torch.broadcast_to(bias, L.bias_shape).detach().to("cpu", torch.float64)
        bb = bb + (bt.unsqueeze(2) if decode else bt).numpy()
    if offset is not None:
        query_positions = int(offset) + torch.arange(t)
    if query_positions is not None:
        qp = query_positions.detach().to("cpu", torch.int64).expand(b, t)
        pos = torch.arange(n).expand(b, h_kv, n) if positions is None else positions.detach().to("cpu", torch.int64)
        pos_q = pos.repeat_interleave(g, dim=1)  # (b, h_q, n)
        visible = pos_q[:, :, None, :] <= qp[:, None, :, None]  # (b, h_q, t, n)
        bb = np.where(visible.numpy(), bb, -np.inf)
    kk = keys.detach().to("cpu", torch.float64).numpy()
    vv = values.detach().to("cpu", torch.float64).numpy()
    out = np.zeros((b, h_q, t, dv))
    var = np.zeros((b, h_q, t, dv))
    cov = np.zeros((b, h_q, t, dv, dv))
    wts = np.zeros((b, h_q, t, n))
    trace, lse, neff, mterm, tail = (np.zeros((b, h_q, t)) for _ in range(5))
    for bi in range(b):
        for h in range(h_q):
            kv = h // g
            for j in range(t):
                e = R.hajek_attention(qq[bi, h, j], kk[bi, kv], vv[bi, kv], p64[bi, kv], scale=scale,
                                      bias=bb[bi, h, j])
                out[bi, h, j], var[bi, h, j], wts[bi, h, j] = e.output, e.variance, e.weights
                cov[bi, h, j] = e.covariance
                trace[bi, h, j], lse[bi, h, j] = e.trace, e.lse
                neff[bi, h, j], mterm[bi, h, j] = e.n_eff, e.max_term
                tail[bi, h, j] = e.tail_moment

    def pack(x, dtype=torch.float32):
        x = torch.from_numpy(x[:, :, 0] if decode else x)
        return x.to(device=q.device, dtype=dtype)

    return Estimate(
        output=pack(out, values.dtype),
        weights=pack(wts),
        variance=pack(var) if per_coordinate else None,
        trace=pack(trace),
        lse=pack(lse),
        n_eff=pack(neff),
        max_term=pack(mterm),
        covariance=pack(cov) if return_covariance else None,
        tail_moment=pack(tail),
    )


def sketch_hajek_attention(q, keys, values, pi=None, sketch=None, *, trace: bool = True, record: str | None = None,
                            backend=None, **kw):
    r"""The cluster (sketched) design's decode step, :func:`kvcert.fast.sketch_hajek_attention`, on the code
    that runs it here (:data:`ROUTER`'s sketch row): with ``trace=False`` (the certificate reads
    :math:`V_{\mathrm{cl}}` only) on CPU tensors with K and V in float32 or bfloat16, the compiled op
    (:func:`kvcert.kernels.cpu.sketch_hajek_attention`: the same estimate from one C++ pass over K and V and the
    sketch's epilogue in the same call); else kvcert.fast. ``KVCERT_CPU_OP=0`` keeps kvcert.fast. Arguments and
    result as :func:`kvcert.fast.sketch_hajek_attention` (``result.estimate.backend`` / ``.route`` name the code
    that ran), and ``record``: with ``trace=False``, a certificate kind whose recorded trace
    (:func:`kvcert.fast.recorded_trace`) is then ``estimate.trace``. ``backend``: None or ``"fast"`` (the choice
    above), or a :class:`Route` of the "fast" backend, :func:`decode`'s resolution for a forward: with
    :data:`CPU_OP`, a one-query call with ``trace=False``, ``record``, ``log_pi``, ``value_center`` and
    ``validate=False`` calls the op's :func:`kvcert.kernels.cpu.sketch_hajek_attention` with ``validate=False``
    (its per-step call, without the argument checks a cache layer's tensors do not need per step)."""
    if record is not None and trace:
        raise TypeError("record= needs trace=False (estimate.trace then holds the recorded trace)")
    if not (backend is None or backend == "fast" or (isinstance(backend, Route) and backend.backend == "fast")):
        raise ValueError(f"backend must be None or 'fast' (kvcert.fast or the compiled CPU op), got {backend!r}")
    if (backend == CPU_OP and not trace and record is not None and pi is None
            and kw.get("value_center") is not None and kw.keys() <= _SKETCH_STEP_KW and _step_fits(q, keys, values, kw)):
        out = _cpu_op_module().sketch_hajek_attention(q, keys, values, None, sketch, log_pi=kw["log_pi"],
                                                      scale=_step_scale(kw.get("scale"), q),
                                                      delta=kw.get("delta", 0.05), value_center=kw["value_center"],
                                                      validate=False, record=record)
        _ran(out.estimate, CPU_OP)
        return out
    route = _route("sketch", q, lambda r: not trace and _cpu_op_fits(q, keys, values, {}))
    out = _RUN["sketch", route](q, keys, values, pi, sketch, trace, record, kw)
    _ran(out.estimate, route)
    return out


def _sketch_cpu_op(q, keys, values, pi, sketch, trace: bool, record: str | None, kw: dict):
    """:func:`kvcert.kernels.cpu.sketch_hajek_attention` (``trace=False``: the op's call)."""
    return _cpu_op_module().sketch_hajek_attention(q, keys, values, pi, sketch, record=record, **kw)


def _sketch_torch(q, keys, values, pi, sketch, trace: bool, record: str | None, kw: dict):
    """:func:`kvcert.fast.sketch_hajek_attention`, its estimate's trace the recorded one of ``record``."""
    fast = importlib.import_module("kvcert.fast")
    out = fast.sketch_hajek_attention(q, keys, values, pi, sketch, trace=trace, **kw)
    if record is not None:
        out = replace(out, estimate=replace(out.estimate, trace=fast.recorded_trace(out, record)))
    return out


def _block_torch(q, keys, values, **kw) -> Estimate:
    """:func:`kvcert.fast.block_hajek_attention` (torch, any device)."""
    return importlib.import_module("kvcert.fast").block_hajek_attention(q, keys, values, **kw)


#: the function that runs each (design, code) :data:`ROUTER` can choose; one signature per design
#: (token: :func:`hajek_attention`'s call; sketch: :func:`sketch_hajek_attention`'s; block: the torch call)
_RUN = {
    ("token", TRITON): _token_triton,
    ("token", REFERENCE): _token_reference,
    ("token", CPU_OP): _token_cpu_op,
    ("token", TORCH): _token_torch,
    ("sketch", CPU_OP): _sketch_cpu_op,
    ("sketch", TORCH): _sketch_torch,
    ("block", TORCH): _block_torch,
}


# ---------------------------------------------------------------------------------------------
# the decode of one cache layer: one entry, one route per design the layer can hold
# ---------------------------------------------------------------------------------------------
#: the routes of :func:`decode`, one per design a cache layer can hold (:func:`decode_route`)
DECODE_ROUTES = ("token", "block", "sketch")


def decode_route(layer) -> str:
    """The route :func:`decode` runs for a cache layer, read from what the layer holds.

    ``"block"`` when ``layer.block_size`` is set (a block eviction: a slot with pi < 1 is
    sampled with its block ``positions // block_size``), ``"sketch"`` when ``layer.sketch`` is
    set (a :class:`kvcert.fast.ClusterSketch` of the evicted tokens beside the held ones), else
    ``"token"`` (independent tokens).
    """
    if getattr(layer, "block_size", None) is not None:
        return "block"
    if getattr(layer, "sketch", None) is not None:
        return "sketch"
    return "token"


@dataclass(frozen=True)
class DecodeRecord:
    """The certificate statistics of a decode, one record step per query.

    Attributes
    ----------
    estimate : kvcert.fast.types.Estimate
        Leading dimensions (b, h_q) for one query, (b, h_q, t) for t consecutive queries; its
        ``backend`` and ``route`` fields name the code that computed it (:attr:`ran`).
    kept : torch.Tensor, int64
        The slots each query attended over: (b, h_kv), or (b, h_kv, t) for t queries.
    memory : float
        Memory of a sketch read beside the slots, in kept-token units (d + dv + 1 elements); 0 without.
    """

    estimate: Estimate
    kept: torch.Tensor
    memory: float = 0.0

    @property
    def ran(self) -> Route:
        """The code that computed :attr:`estimate` (its ``backend`` and ``route`` fields)."""
        return Route(self.estimate.backend, self.estimate.route)


@dataclass(frozen=True)
class LayerDecode:
    """What :func:`decode` returns for one layer.

    Attributes
    ----------
    route : str
        The design's route that ran (:data:`DECODE_ROUTES`).
    output : torch.Tensor, (b, t, h_q, dv)
        The Hajek estimate of each new token's attention output.
    records : tuple of DecodeRecord
        The certificate statistics, in query order; each estimate names the code that computed it
        (:attr:`ran`).
    backend : Route or None
        The token route's resolution for the forward's other layers (the one passed in, or the one
        resolved here at the forward's first layer: :data:`CPU_OP` where the compiled CPU op computes
        its calls, checked available once, else the route of the backend chosen); None when none was
        resolved (block route, a softcapped call).
    """

    route: str
    output: torch.Tensor
    records: tuple
    backend: Route | None = None

    @property
    def ran(self) -> Route:
        """The code that computed the layer's estimates (every query of a layer runs on the same)."""
        return self.records[0].ran


def decode(query: torch.Tensor, layer, *, scale: float, options: dict, kind: str | None = None,
           delta: float = 0.05, softcap: float | None = None, backend: Route | str | None = None) -> LayerDecode:
    r"""Hajek attention of the new tokens over one cache layer's held slots, by the layer's route.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \qquad a_i = \operatorname{softmax}_S(s_i - \log\pi_i),
        \qquad s_i = \tau\, q\cdot k_i \ \ (c\tanh(\tau\, q\cdot k_i / c) \text{ with a softcap } c),

    and the statistics of the route's certificate (docs/design.md sections 2, 7 and 8):

    - ``"token"``: :func:`hajek_attention` (this module's backend choice), the Taylor trace
      :math:`\sum_{i\in S} (1-\pi_i) a_i^2 \lVert v_i - \hat o\rVert^2`; a one-token step on the
      "fast" backend with a trace-only kind reads the layer's cached value moments
      (``layer.value_moments()``; the centre alone where the compiled op's step runs it), so the
      trace takes no pass over V of its own; a softcap enters
      as the additive bias :math:`c\tanh(s_i/c) - s_i`;
    - ``"block"``: :func:`kvcert.fast.block_hajek_attention`, the cluster-sampling trace
      :math:`\sum_{b\in S} (1-\pi_b) \lVert\sum_{i\in b} a_i (v_i - \hat o)\rVert^2` with block
      b(i) = position_i // ``layer.block_size`` (slots with pi = 1 are units of their own);
    - ``"sketch"``: :func:`kvcert.fast.sketch_hajek_attention` with the layer's sketch, one query
      at a time; the recorded trace is :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})` clipped at
      :math:`(H/c)^2`, with :math:`H` the hull bound and :math:`c` the kind's radius per unit
      square-root trace (:math:`1/\sqrt\delta` for chebyshev), so the radius
      :math:`c\sqrt{\mathrm{trace}}` is :math:`\min(c\sqrt{V}, H)`.

    A quantized layer (``layer.quantized``, ``PoissonPress(kv_bits=8)``) takes
    :func:`kvcert.fast.quantized_decode` whatever its route: its codes dequantized in the compiled CPU op's
    pass (:func:`kvcert.kernels.cpu.quantized_hajek_attention`, route ``"cpu_op"``) where the op is available
    and the layer fits it (``kvcert.fast.token_design.quantized_op_fits``), else in torch, one
    query at a time, the certificate of its design on the stored codes and scales
    (:meth:`kvcert.fast.TokenDesign.certify`: :math:`B_q + r`, or the rule on :math:`V + V_q`), recorded as
    the trace whose radius of ``kind`` it is.

    Every route runs with ``validate=False``: no host read (the layer's log pi was checked
    when the eviction event installed it; the caller checks the outputs for NaN once per
    forward). A chunk of t > 1 queries is causal by the stored positions: query j sees the
    slots at or before its own position.

    Parameters
    ----------
    query : torch.Tensor, (b, h_q, t, d)
        The new tokens' queries; h_q = g * h_kv.
    layer : kvcert.cache.KVCertLayer
        Or any object with ``keys`` (b, h_kv, n, d), ``values`` (b, h_kv, n, dv),
        ``log_weights`` (b, h_kv, n) (-inf on padding), ``positions`` (b, h_kv, n) int64,
        ``valid``, ``kept`` (b, h_kv), ``value_moments(distances=True)`` (the centre and the
        distances, which may be None with ``distances=False``), ``block_size`` and ``sketch``; its
        last t slots are the new tokens.
    scale : float
        The score scale tau.
    options : dict
        The estimate options of the certificate kind (:func:`kvcert.fast.estimate_options`).
    kind : str, optional
        The certificate kind (the sketch route's clip needs it).
    delta : float
        The certificate level 1 - delta (the sketch route).
    softcap : float, optional
        The model's attention logit softcap c (token route only).
    backend : Route or str, optional
        The token route's resolution for this forward (a previous layer's :attr:`LayerDecode.backend`);
        None resolves it here (:data:`ROUTER`), a backend name resolves it with that backend forced.

    Returns
    -------
    LayerDecode
        Its ``records``' estimates name the code that ran (``backend``, ``route``; :attr:`LayerDecode.ran`).

    Raises
    ------
    ValueError
        A softcap with a block or sketch layer.
    """
    route = decode_route(layer)
    if softcap is not None and route != "token":
        raise ValueError("kvcert: attention logit softcapping (the model's softcap) is supported on the token "
                         "design only, not with block eviction (BlockPoissonPress) or a sketch "
                         "(PoissonPress(sketch=...))")
    if getattr(layer, "quantized", None) is not None:  # a quantized cache: its codes dequantized here (torch)
        if softcap is not None or kind is None:
            raise ValueError("kvcert: a quantized cache (PoissonPress(kv_bits=...)) decodes without a logit softcap "
                             "and records a certificate kind (give kind=)")
        from kvcert.fast.token_design import quantized_decode

        op = _cpu_op_module().quantized_hajek_attention if query.is_cpu and cpu_op_available() else None
        output, steps = quantized_decode(query, layer, scale=scale, kind=kind, delta=delta, op=op)
        return LayerDecode(route, output, tuple(DecodeRecord(est, kept, 0.0 if layer.sketch is None else
                                                             layer.sketch.tokens) for est, kept in steps))
    return _DECODERS[route, "dense"](query, layer, scale=scale, options=options, kind=kind, delta=delta,
                                     softcap=softcap, backend=backend)


def _softcap_bias(query: torch.Tensor, keys: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    r"""The additive bias that turns the scores :math:`s = \tau q\cdot k` into softcapped ones:
    :math:`c\tanh(s/c) - s`, (b, h_q, n) for a query (b, h_q, 1, d), (b, h_q, t, n) for t > 1
    (query head j reads KV head j // g), in float32 (float64 for a float64 model)."""
    b, h_q, t, d = query.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    q = query.to(dt).reshape(b, h_kv, (h_q // h_kv) * t, d)
    s = torch.matmul(q, keys.to(dt).transpose(-1, -2)).mul_(scale)
    bias = (torch.tanh(s / cap) * cap).sub_(s).reshape(b, h_q, t, n)
    return bias[:, :, 0] if t == 1 else bias


def _chunk_positions(layer, q_len: int) -> torch.Tensor:
    """(b, q_len): the positions of the layer's last q_len slots (the new tokens; same on every KV head)."""
    return layer.positions[:, 0, -q_len:]


def _seen(layer, qpos: torch.Tensor) -> torch.Tensor:
    """(b, h_kv, t) int64: the held slots at or before each query position ``qpos`` (b, t)."""
    return (layer.valid[:, :, None, :] & (layer.positions[:, :, None, :] <= qpos[:, None, :, None])).sum(-1)


def _resolve(query, layer, options: dict, backend: Route | str | None) -> Route:
    """The token route's code for a forward (:attr:`LayerDecode.backend`), resolved at its first layer: ``backend``
    as it is when already a :class:`Route`, else :data:`ROUTER`'s choice for a trace-only call (``backend`` a name:
    that backend forced) on the layer's tensors: :data:`CPU_OP` where the certificate is trace-only and the
    compiled CPU op computes such calls here (available, not switched off, the layer's tensors on the CPU in
    float32 or bfloat16, no option the op lacks)."""
    if isinstance(backend, Route):
        return backend
    return _token_route(query[:, :, 0], layer.keys, layer.values, bool(options.get("per_coordinate")), options,
                        backend)


def _add_moments(kw: dict, query, layer, backend: Route) -> None:
    """A one-query step's cached value moments into ``kw``: ``value_center`` and ``value_sqdist`` from
    ``layer.value_moments()``, or the centre alone (``value_moments(distances=False)``) where the compiled op's
    step runs this layer (``backend`` :data:`CPU_OP` and its tensors fit, :func:`_op_tensors`): the op computes
    the distances in its own pass, so the layer does not bring them up to date."""
    step = backend == CPU_OP and _op_tensors(query, layer.keys, layer.values)
    kw["value_center"], r2 = layer.value_moments(distances=not step)
    if r2 is not None:
        kw["value_sqdist"] = r2


def _decode_token(query, layer, *, scale, options, kind, delta, softcap, backend) -> LayerDecode:
    """The token route of :func:`decode`: :func:`hajek_attention` over the held slots."""
    if softcap is not None:  # the bias is a kvcert.fast option: no resolution for the forward
        bias = _softcap_bias(query, layer.keys, scale, float(softcap))
        chosen = select_backend(query[:, :, 0], bias=bias, **options)
        kw = dict(options, log_pi=layer.log_weights, scale=scale, validate=False, backend=chosen, bias=bias)
        moments = False
    else:
        backend = _resolve(query, layer, options, backend)
        kw = dict(options, log_pi=layer.log_weights, scale=scale, validate=False, backend=backend)
        moments = backend.backend == "fast" and not options.get("per_coordinate")
    q_len = query.shape[2]
    if q_len == 1:
        if moments:
            _add_moments(kw, query, layer, backend)
        est = hajek_attention(query.select(2, 0), layer.keys, layer.values, **kw)
        return LayerDecode("token", est.output.unsqueeze(1), (DecodeRecord(est, layer.kept),), backend)
    qpos = _chunk_positions(layer, q_len)
    est = hajek_attention(query, layer.keys, layer.values, positions=layer.positions, query_positions=qpos, **kw)
    return LayerDecode("token", est.output.transpose(1, 2), (DecodeRecord(est, _seen(layer, qpos)),), backend)


def _decode_block(query, layer, *, scale, options, kind, delta, softcap, backend) -> LayerDecode:
    """The block route of :func:`decode`: :data:`ROUTER`'s block row (:func:`kvcert.fast.block_hajek_attention`)."""
    route = _route("block", query, lambda r: False)
    run = _RUN["block", route]
    kw = dict(options, log_pi=layer.log_weights, block_size=layer.block_size, positions=layer.positions,
              scale=scale, validate=False)
    q_len = query.shape[2]
    if q_len == 1:
        est = _mark(run(query[:, :, 0], layer.keys, layer.values, **kw), route)
        return LayerDecode("block", est.output[:, None], (DecodeRecord(est, layer.kept),), backend)
    qpos = _chunk_positions(layer, q_len)
    est = _mark(run(query, layer.keys, layer.values, query_positions=qpos, **kw), route)
    return LayerDecode("block", est.output.transpose(1, 2), (DecodeRecord(est, _seen(layer, qpos)),), backend)


def _decode_sketch(query, layer, *, scale, options, kind, delta, softcap, backend) -> LayerDecode:
    """The sketch route of :func:`decode`: :func:`sketch_hajek_attention` (this module's: the compiled CPU
    op's pass and epilogue on CPU), one query at a time (the function has no causal mask: query j reads the slots at
    or before its position)."""
    if kind is None:
        raise ValueError("the sketch route records V_cl clipped for a certificate kind: give kind=")
    q_len = query.shape[2]
    backend = _resolve(query, layer, options, backend)
    # V = max(V_cl, HT trace) is the certificate's variance; the recorded trace is V clipped at (H / c)^2, so that the
    # recorded radius c sqrt(trace) is min(c sqrt(V), H) (kvcert.fast.recorded_trace)
    kw = dict(scale=scale, delta=delta, validate=False, trace=False, record=kind,
              backend=CPU_OP if backend == CPU_OP else None)  # the sketch's code: the op's step, or its own choice
    held = layer.sketch.tokens  # its memory in kept-token units, as the press sized the budget
    if q_len == 1:  # a decode step: the held slots (log pi > -inf), the cached value moments
        _add_moments(kw, query, layer, backend)
        est = sketch_hajek_attention(query.select(2, 0), layer.keys, layer.values, None, layer.sketch,
                                      log_pi=layer.log_weights, **kw).estimate
        return LayerDecode("sketch", est.output.unsqueeze(1), (DecodeRecord(est, layer.kept, held),), backend)
    outs, records = [], []
    for j in range(q_len):  # causal: the slots after query j's position are not there yet
        qpos = layer.positions[:, 0, layer.positions.shape[-1] - q_len + j]
        log_pi = layer.log_weights.masked_fill(layer.positions > qpos[:, None, None], float("-inf"))
        est = sketch_hajek_attention(query[:, :, j], layer.keys, layer.values, None, layer.sketch, log_pi=log_pi,
                                      **kw).estimate
        records.append(DecodeRecord(est, (log_pi > float("-inf")).sum(-1), held))
        outs.append(est.output)
    return LayerDecode("sketch", torch.stack(outs, dim=1), tuple(records), backend)


#: :func:`decode`'s route for each (design, cache layout): the dense cache of a Hugging Face model
#: (:class:`kvcert.cache.KVCertLayer`); the code each runs is :data:`ROUTER`'s
_DECODERS = {("token", "dense"): _decode_token, ("block", "dense"): _decode_block,
             ("sketch", "dense"): _decode_sketch}


# ---------------------------------------------------------------------------------------------
# the paged layout: the vLLM plugin's decode rows, read through a block table
# ---------------------------------------------------------------------------------------------
#: the designs :func:`paged_decode` routes
PAGED_DESIGNS = ("token", "block", "sketch")


@dataclass(frozen=True)
class PagedDecode:
    """What :func:`paged_decode` returns for a batch of decode rows.

    Attributes
    ----------
    output : torch.Tensor, (E, h_q, dv)
        The rows' estimates, in the query's dtype.
    statistics : dict
        The certificate statistics of ``kind``, (E, h_q) each, the radii not yet taken: on the paged codes and the
        sketched design ``{"trace": ..., "output": ...}`` (the norm of the output not yet taken), on the token and
        block designs' gather route :func:`kvcert.fast.certificate_moments`' (with ``output_norm``).
    route : Route
        The paged code that ran (:data:`PAGED_CPU_OP`, :data:`PAGED_TORCH`, :data:`GATHER`, :data:`PAGED_TRITON`).
    dense : Route or None
        On :data:`GATHER`, the dense code that computed the gathered rows (:data:`CPU_OP`, :data:`TORCH`); else None.
    radius : torch.Tensor or None
        The relative radius (E, h_q) float32, where the caller took it (the vLLM plugin's ``token_decode``,
        ``block_decode``, ``sketch_decode``); None from :func:`paged_decode` itself.
    """

    output: torch.Tensor
    statistics: dict
    route: Route
    dense: Route | None = None
    radius: torch.Tensor | None = None


def _trace_only(kind: str) -> bool:
    """Whether the certificate ``kind`` reads the trace alone (no estimate option: chebyshev)."""
    return not any(importlib.import_module("kvcert.fast").estimate_options(kind).values())


def paged_route(design: str, device: torch.device | str, kind: str) -> Route:
    """The code :func:`paged_decode` runs for ``design``'s rows on a paged cache on ``device`` with certificate
    ``kind``: the first of :data:`ROUTER`'s paged codes that fits (:data:`PAGED_CPU_OP`: a CPU query where the op is
    available, not switched off by ``KVCERT_CPU_OP=0``, and for the token design a trace-only kind;
    :data:`PAGED_TORCH` and :data:`PAGED_TRITON`: a trace-only kind, Triton installed for the latter;
    :data:`GATHER` always).

    Raises
    ------
    ValueError
        ``design`` not one of :data:`PAGED_DESIGNS`, or no code of its row computes ``kind`` on ``device`` (the
        paged Triton kernel returns the trace only: the block design on CUDA serves trace-only kinds).
    """
    if design not in PAGED_DESIGNS:
        raise ValueError(f"design must be one of {PAGED_DESIGNS}, got {design!r}")
    dev = torch.device(device).type
    routes = ROUTER.get((design, "paged", dev), (GATHER,))
    for route in routes:
        if route == GATHER:
            return route
        if route == PAGED_CPU_OP and dev == "cpu" and (design != "token" or _trace_only(kind)) and cpu_op_available():
            return route
        if route == PAGED_TORCH and _trace_only(kind):
            return route
        if route == PAGED_TRITON and _trace_only(kind) and triton_available():
            return route
    raise ValueError(f"kind={kind!r}: no code of the {design} design's paged route on {dev} computes it "
                     f"({', '.join(r.code for r in routes)} return the trace only, for a trace-only kind: chebyshev)")


def paged_decode(design: str, query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                 log_pi: torch.Tensor, *, scale: float, kind: str, delta: float = 0.05, sketch=None, centre=None,
                 gather=None, chunks=None, seq_lens=None, max_seq_len=None, device=None,
                 softcap: float | None = None) -> PagedDecode:
    r"""The decode of a batch of rows over a paged cache (one query per row), on :data:`ROUTER`'s paged code.

    The estimate of ``design`` (docs/design.md sections 5, 7 and 8) and its certificate statistics:

    - ``"token"``: the Hajek estimate over the slots with log pi > -inf and the Taylor trace
      :math:`\sum_{i\in S}(1-\pi_i)a_i^2\lVert v_i-\hat o\rVert^2` (:data:`PAGED_CPU_OP`:
      :func:`kvcert.kernels.cpu.paged_hajek_attention`; :data:`GATHER`: :func:`hajek_attention` on the
      gathered rows and :func:`kvcert.fast.certificate_moments`);
    - ``"block"``: offset :math:`-\log\pi_b` on every token of a kept block and the cluster-sampling trace
      :math:`\sum_{b\in S}(1-\pi_b)\lVert z_b\rVert^2` (:data:`PAGED_TORCH`:
      :func:`kvcert.fast.blocks.paged_block_hajek_attention`; :data:`PAGED_TRITON`:
      :func:`kvcert.kernels.paged_block_hajek_attention`; :data:`GATHER`: :func:`kvcert.fast.block_hajek_attention`
      row by row, with the options of ``kind``);
    - ``"sketch"``: the sketched design's recorded trace (:data:`PAGED_CPU_OP`:
      :func:`kvcert.kernels.cpu.paged_sketch_hajek_attention`; :data:`GATHER`: :func:`sketch_hajek_attention`
      with ``trace=False`` and :func:`kvcert.fast.recorded_trace`).

    Every code runs without value checks (``validate=False``: the eviction event checked the state it installed).

    Parameters
    ----------
    design : {"token", "block", "sketch"}
    query : (E, h_q, d), one decode query per row
    kv_cache : the paged cache: (num_blocks, h_kv, bs, 2 d) in vLLM's CPU ``vec`` layout (keys transposed, then
        values, per block and KV head); on CUDA (block design) vLLM's FlashAttention cache of the same shape
    block_ids : int64 (E, M)
        The blocks each row reads (CPU: the kept blocks, padding last); on CUDA the rows' block table.
    log_pi : torch.Tensor
        Token and sketch designs: (E, h_kv, M * bs), log pi of each slot's token (-inf: none). Block design:
        (E, M, bs) float32, log pi_b on each valid token of a kept block (-inf on padding and past the end); on
        CUDA (E, M) float32 per logical block (-inf: evicted).
    scale : float   kind : str, the certificate kind   delta : float, the certificate level (sketch design)
    sketch : ClusterSketch of the E rows (sketch design)
    centre : (float64 (E, h_kv, d + 1), int64 (E,)), optional
        The sketch design's value centre from the compacted prompt's sums (:data:`PAGED_CPU_OP` only).
    gather : callable, optional
        ``gather(kv_cache, block_ids) -> (keys, values)``, (E, h_kv, M * bs, d) each: the caller's reader of its
        layout, for :data:`GATHER` (required when that code runs).
    chunks : optional
        :func:`kvcert.fast.blocks.block_chunks` of the rows, computed once per step (:data:`PAGED_TORCH`).
    seq_lens, max_seq_len : (E,) int32 and int, optional
        The rows' lengths (:data:`PAGED_TRITON`: the block design on CUDA).
    device : str, optional
        The device whose row of :data:`ROUTER` is read (default the query's): the vLLM plugin's CUDA backend names
        ``"cuda"``, whose cache is in the FlashAttention layout, so that its route is the same when the Triton
        interpreter (``TRITON_INTERPRET=1``) runs it on CPU tensors.
    softcap : float > 0, optional
        The model's attention logit softcap c (Gemma 2): the scores are :math:`c\tanh(\tau q\cdot k_i/c)` before
        the :math:`-\log\pi_i` offset, as in :func:`decode`. Token design only, on its paged route: the compiled
        op's (:func:`kvcert.kernels.cpu.paged_hajek_attention` with ``softcap``: the cap taken in its pass) or
        :data:`GATHER` (the rows gathered, the softcap as a score bias of :func:`hajek_attention`, the Hugging Face
        decode's).

    Returns
    -------
    PagedDecode
        Its ``route`` (and, on :data:`GATHER`, ``dense``) names the code that ran.

    Raises
    ------
    ValueError
        A softcap with the block or sketch design, or one that is not a finite number > 0.
    """
    if softcap is not None:
        if design != "token":
            raise ValueError("kvcert: attention logit softcapping (the model's softcap) is supported on the token "
                             f"design only, not on the {design} design's paged decode")
        softcap = check_softcap(softcap)
    route = paged_route(design, query.device if device is None else device, kind)
    if route == GATHER and gather is None:
        raise TypeError(f"the {design} design's paged route {route.code!r} reads the rows through gather=: give the "
                        "layout's reader, gather(kv_cache, block_ids) -> (keys, values)")
    extra = {} if softcap is None else {"softcap": softcap}  # the token design's two routes take it
    return _PAGED[design, route](query, kv_cache, block_ids, log_pi, scale=scale, kind=kind, delta=delta,
                                 sketch=sketch, centre=centre, gather=gather, chunks=chunks, seq_lens=seq_lens,
                                 max_seq_len=max_seq_len, **extra)


def _paged_token_op(query, kv_cache, block_ids, log_pi, *, scale, softcap=None, **_) -> PagedDecode:
    """The token design on :data:`PAGED_CPU_OP`: the op reads the slots in place (and takes a ``softcap`` in its
    pass); a trace-only kind's statistics."""
    est = _cpu_op_module().paged_hajek_attention(query, kv_cache, block_ids, log_pi.to(torch.float32), scale=scale,
                                                 validate=False, softcap=softcap)
    return PagedDecode(est.output.to(query.dtype), {"trace": est.trace, "output": est.output}, PAGED_CPU_OP)


def _paged_token_gather(query, kv_cache, block_ids, log_pi, *, scale, kind, gather, softcap=None,
                        **_) -> PagedDecode:
    """The token design on :data:`GATHER`: :func:`hajek_attention` on the gathered rows (its own dense code); with a
    ``softcap``, its score bias (:func:`_softcap_bias`, the Hugging Face decode's)."""
    fast = importlib.import_module("kvcert.fast")
    k, v = gather(kv_cache, block_ids)
    opts = fast.estimate_options(kind)
    if softcap is not None:
        opts["bias"] = _softcap_bias(query[:, :, None], k, scale, softcap)
    est = hajek_attention(query, k, v, log_pi=log_pi.to(torch.float32), scale=scale, validate=False, **opts)
    return PagedDecode(est.output.to(query.dtype), fast.certificate_moments(est, kind), GATHER,
                       Route(est.backend, est.route))


def _paged_sketch_op(query, kv_cache, block_ids, log_pi, *, scale, kind, delta, sketch, centre, **_) -> PagedDecode:
    """The sketch design on :data:`PAGED_CPU_OP`: the op's paged sketch route (its value centre from ``centre``)."""
    sums, start = centre if centre is not None else (None, None)
    ce = _cpu_op_module().paged_sketch_hajek_attention(query, kv_cache, block_ids, log_pi.to(torch.float32), sketch,
                                                       scale=scale, delta=delta, record=kind, center_sums=sums,
                                                       tail_start=start, validate=False)
    return PagedDecode(ce.output.to(query.dtype), {"trace": ce.estimate.trace, "output": ce.output}, PAGED_CPU_OP)


def _paged_sketch_gather(query, kv_cache, block_ids, log_pi, *, scale, kind, delta, sketch, gather,
                         **_) -> PagedDecode:
    """The sketch design on :data:`GATHER`: :func:`sketch_hajek_attention` on the gathered rows, the recorded trace."""
    k, v = gather(kv_cache, block_ids)
    ce = sketch_hajek_attention(query, k, v, None, sketch, log_pi=log_pi.to(torch.float32), scale=scale, delta=delta,
                                validate=False, trace=False)
    trace = importlib.import_module("kvcert.fast").recorded_trace(ce, kind)
    return PagedDecode(ce.output.to(query.dtype), {"trace": trace, "output": ce.output}, GATHER,
                       Route(ce.estimate.backend, ce.estimate.route))


def _paged_block_torch(query, kv_cache, block_ids, log_pi, *, scale, chunks, **_) -> PagedDecode:
    """The block design on :data:`PAGED_TORCH`: kvcert.fast's paged estimator (whole kept blocks, chunked gather)."""
    blocks = importlib.import_module("kvcert.fast.blocks")
    est = blocks.paged_block_hajek_attention(query, kv_cache, block_ids, log_pi, scale=scale, chunks=chunks,
                                             validate=False)
    return PagedDecode(est.output, {"trace": est.trace, "output": est.output}, PAGED_TORCH)


def _paged_block_gather(query, kv_cache, block_ids, log_pi, *, scale, kind, gather, **_) -> PagedDecode:
    """The block design on :data:`GATHER`: :func:`kvcert.fast.block_hajek_attention` with ``kind``'s options, row by
    row over the row's kept blocks (its dense route, :data:`TORCH`)."""
    fast = importlib.import_module("kvcert.fast")
    opts = fast.estimate_options(kind)
    bs = kv_cache.shape[2]
    outs, stats = [], []
    for j, m in enumerate((log_pi[:, :, 0] > float("-inf")).sum(1).tolist()):  # padding blocks come last
        k, v = gather(kv_cache, block_ids[j : j + 1, :m])  # (1, h_kv, m bs, d)
        lp = log_pi[j, :m].reshape(1, 1, m * bs).expand(1, k.shape[1], m * bs)
        pi = torch.exp(lp.double()).to(torch.float32)  # pi_b in float32 (0: no token), as the eviction drew it
        pos = torch.where(pi > 0, torch.arange(m * bs, device=lp.device), -1)
        est = fast.block_hajek_attention(query[j : j + 1], k, v, pi, block_size=bs, positions=pos, scale=scale,
                                         validate=False, **opts)
        outs.append(est.output.to(query.dtype))
        stats.append(fast.certificate_moments(est, kind))
    joined = {key: None if stats[0][key] is None else torch.cat([s[key] for s in stats]) for key in stats[0]}
    return PagedDecode(torch.cat(outs), joined, GATHER, TORCH)


def _paged_block_triton(query, kv_cache, block_ids, log_pi, *, scale, seq_lens, max_seq_len, **_) -> PagedDecode:
    """The block design on :data:`PAGED_TRITON`: the paged kernel over vLLM's FlashAttention cache (the rows'
    block table, log pi per block, their lengths)."""
    kernels = importlib.import_module("kvcert.kernels")
    key_cache, value_cache = kernels.kv_cache_views(kv_cache, kv_cache.shape[-1] // 2)
    est = kernels.paged_block_hajek_attention(query, key_cache, value_cache, block_ids, seq_lens, log_pi,
                                              scale=scale, max_seq_len=max_seq_len, validate=False)
    return PagedDecode(est.output, {"trace": est.trace, "output": est.output}, PAGED_TRITON)


#: the function that runs each (design, code) of :data:`ROUTER`'s paged rows; one signature (:func:`paged_decode`'s)
_PAGED = {
    ("token", PAGED_CPU_OP): _paged_token_op,
    ("token", GATHER): _paged_token_gather,
    ("sketch", PAGED_CPU_OP): _paged_sketch_op,
    ("sketch", GATHER): _paged_sketch_gather,
    ("block", PAGED_TORCH): _paged_block_torch,
    ("block", GATHER): _paged_block_gather,
    ("block", PAGED_TRITON): _paged_block_triton,
}
