r"""kvcert.kernels.cpu: the compiled CPU decode op (C++ through ``torch.utils.cpp_extension``).

:func:`hajek_attention` is the fused Hajek decode over a compressed cache on
CPU tensors. For each (batch, KV head) it reads the kept K and V once and
returns, for every query head of the GQA group and every query row,

.. math::

    \hat o = \sum_{i\in S} a_i v_i, \quad a_i = \operatorname{softmax}_S(\tau q\cdot k_i - \log\pi_i),
    \quad \log\hat Z = \operatorname{logsumexp}_S(\tau q\cdot k_i - \log\pi_i),

    \mathrm{trace} = \sum_{i\in S} c_i \lVert v_i - \hat o\rVert^2, \quad c_i = (1-\pi_i) a_i^2,
    \quad n_\mathrm{eff} = 1 / \textstyle\sum_S a_i^2

(and, with ``per_coordinate=True``, the variance per output coordinate).
Padding and evicted slots (pi = 0, log pi = -inf) are skipped without
reading their K and V. The trace is accumulated in the centred form of the
cheap certificate, around a per-range centre mu (the caller's
``value_center``, else the first kept value of the range):

.. math::

    \mathrm{trace} = \sum_S c_i\lVert v_i-\mu\rVert^2 - 2(\hat o-\mu)\cdot\sum_S c_i(v_i-\mu)
                     + \lVert\hat o-\mu\rVert^2\sum_S c_i .

The slots of a head are cut into ranges (split-K, so that a few heads keep
every thread busy), each with its online-softmax sums; a merge rescales them
to the common maximum.

The sketched designs' decode step, :func:`sketch_hajek_attention`, is the same
pass with the weight :math:`\pi_i(1-\pi_i)` for :math:`1-\pi_i` (the kept part of
:math:`V_{\mathrm{cl}}`), followed in the same call by the sketch's O(C d) epilogue
per query row (:math:`V_{\mathrm{cl}}`, the radius, the hull bound, the recorded
trace), from the sketch's decode form.

:func:`quantized_hajek_attention` is the same pass over a quantized cache (``kvcert.fast.QuantizedKV``: int8
codes, formats int8 and int4, with float16 scales): each tile's key and value rows are dequantized as they
are read, never the whole cache, and the rounding variance :math:`V_q` of stochastic rounding is accumulated
beside the trace (or, ``combined=True``, into the trace's own sums).

Each entry point has one ``validate`` switch: ``validate=False`` is the
per-step call of a decode whose eviction event checked its tensors (the
Hugging Face decode once ``kvcert.dispatch.decode`` has resolved that the op
runs, the vLLM plugin's paged calls): no Python checks and no host reads, the
op's own checks of shapes, dtypes and block ids, and the contract's error
where the op refuses.

Threads: ``at::parallel_for``, i.e. torch's intra-op
pool (``torch.get_num_threads()``); vector code from ``#pragma omp simd`` and
``-march=native``. K and V in float32 or bfloat16 (any strides with a unit
last stride, so the cache's views are read in place); every sum in float32.

Built on first use (``torch.utils.cpp_extension.load``, which needs ``ninja``
and a C++ compiler; a few minutes, announced on stderr with a progress line
every 30 s; ``kvcert build-op`` builds it ahead, :func:`is_built` says whether
it is) into ``<cache>/torch_extensions/<name>``, ``<cache>`` =
``$KVCERT_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvcert``, else
``~/.cache/kvcert``; the name hashes the source, the flags, the torch and
Python versions, the CPU's instruction-set flags and the folder torch is
installed in, so a cache directory shared by different machines never loads
a binary built for another CPU, and virtual environments with the same torch
keep a build each (one shared folder was rebuilt at every switch between
them, the include paths differing).
:func:`available` builds it once per process and says whether it loaded;
:func:`unavailable_reason` says why not. ``kvcert.dispatch`` routes CPU
decodes here and falls back to ``kvcert.fast`` (with one warning) when the
op cannot be built; ``KVCERT_CPU_OP=0`` forces that torch path.

References
----------
Hajek (1971); Sarndal, Swensson & Wretman (1992), sec. 5.6-5.7; Dao et al.,
"Flash-Decoding for long-context inference" (2023), for the split-K merge;
arXiv 2607.21475.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from kvcert.fast._checks import check_scale, check_softcap
from kvcert.fast.contract import check_attention_inputs, check_attention_values
from kvcert.fast.quantized import CHANNEL_GROUP
from kvcert.fast.types import Estimate

__all__ = ["ENV_VAR", "SOURCE", "SUPPORTED_DTYPES", "CPUOpUnavailable", "available", "build_directory", "enabled",
           "hajek_attention", "is_built", "load", "paged_hajek_attention", "paged_sketch_hajek_attention",
           "quantized_hajek_attention", "sketch_hajek_attention", "unavailable_reason"]

#: environment variable: ``0`` (or false/no/off) keeps every call on the torch path
ENV_VAR = "KVCERT_CPU_OP"
#: the C++ source, shipped in the package
SOURCE = Path(__file__).with_name("hajek_decode.cpp")
#: dtypes of K and V the op reads (both the same)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# -fopenmp: at::parallel_for is a header template that runs its body serially unless the op itself is
# compiled with OpenMP; linked against libgomp.so.1, it shares the OpenMP runtime torch has already
# loaded (same soname), so torch.set_num_threads sizes its team too
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
_LDFLAGS = ("-fopenmp",)
_CACHE_ENV = "KVCERT_CACHE_DIR"  # the rule of kvcert.models: $KVCERT_CACHE_DIR, $XDG_CACHE_HOME/kvcert, ~/.cache/kvcert
_OFF = ("0", "false", "no", "off")

_lock = threading.Lock()
_state: dict = {"ops": None, "reason": None, "warned": False}
#: seconds between the progress lines of a build (stderr)
_TICK = 30.0


class CPUOpUnavailable(RuntimeError):
    """The compiled CPU op cannot be built or loaded here (no compiler, no ninja, a failed build)."""


def enabled() -> bool:
    """False when ``KVCERT_CPU_OP`` is 0 / false / no / off (the torch path is forced)."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in _OFF


def _cache_dir() -> Path:
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kvcert"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _name() -> str:
    h = hashlib.sha256()
    # torch's folder: venvs with the same torch version (the main one and the pinned ones of `make test`) build
    # apart; sharing one folder, cpp_extension rebuilt the op (~2 min) at each switch, its include paths differing
    for part in (SOURCE.read_bytes(), " ".join(_CFLAGS + _LDFLAGS).encode(), torch.__version__.encode(),
                 sys.version.encode(), _cpu_flags().encode(), str(Path(torch.__file__).resolve().parent).encode()):
        h.update(part)
        h.update(b"\0")
    return f"kvcert_cpu_{h.hexdigest()[:16]}"


def build_directory() -> Path:
    """Where the op is built: ``<cache>/torch_extensions/<name>`` (see the module docstring)."""
    return _cache_dir() / "torch_extensions" / _name()


def _ninja_on_path() -> str | None:
    """Make ``ninja`` findable (the pip package installs it next to the interpreter, which need not be
    on PATH when a venv is not activated); returns the PATH to restore, or None."""
    if shutil.which("ninja"):
        return None
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # the PyPI package: its binary directory

        candidates.insert(0, Path(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if (folder / "ninja").exists():
            old = os.environ.get("PATH", "")
            os.environ["PATH"] = f"{folder}{os.pathsep}{old}"
            return old
    raise CPUOpUnavailable("ninja is not installed (pip install ninja)")


def is_built() -> bool:
    """Whether this torch install's op is already built (its library is in :func:`build_directory`): then
    :func:`load` only loads it, else it compiles first (minutes)."""
    folder = build_directory()
    return (folder / f"{folder.name}.so").exists()


class _Progress:
    """Says on stderr that a build starts (where, about how long, how to build ahead or skip it), a line every
    ``_TICK`` seconds while it runs, and how long it took: a first use compiles for minutes, never silently."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.done = threading.Event()
        self.t0 = 0.0

    def _say(self, text: str) -> None:
        print(f"kvcert: {text}", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while not self.done.wait(_TICK):
            self._say(f"still building the CPU decode op ({time.monotonic() - self.t0:.0f} s)")

    def __enter__(self):
        self.t0 = time.monotonic()
        self._say(f"building the compiled CPU decode op for this torch install, once (about 2-4 minutes on 2 cores) "
                  f"into {self.folder}; 'kvcert build-op' builds it ahead, {ENV_VAR}=0 skips it (the torch path "
                  f"runs)")
        threading.Thread(target=self._tick, name="kvcert-op-build", daemon=True).start()
        return self

    def __exit__(self, kind, exc, tb):
        self.done.set()
        took = time.monotonic() - self.t0
        self._say(f"CPU decode op built in {took:.0f} s" if kind is None else
                  f"the CPU decode op's build failed after {took:.0f} s")
        return False


def _build(verbose: bool):
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise CPUOpUnavailable(f"no C++ compiler found ({cxx!r} is not on PATH; set CXX)")
    old_path = _ninja_on_path()
    try:
        folder = build_directory()
        folder.mkdir(parents=True, exist_ok=True)
        with (contextlib.nullcontext() if is_built() else _Progress(folder)):
            cpp_extension.load(name=folder.name, sources=[str(SOURCE)], extra_cflags=list(_CFLAGS),
                               extra_ldflags=list(_LDFLAGS),
                               build_directory=str(folder), is_python_module=False, verbose=verbose)
    except CPUOpUnavailable:
        raise
    except Exception as e:  # a compiler error, a linker error, an unwritable cache directory
        lines = [s for s in str(e).strip().splitlines() if s.strip()]
        detail = lines[0] if lines else type(e).__name__
        errors = [s.strip() for s in lines if "error" in s.lower()][:2]
        if errors and errors[0] != detail:
            detail = f"{detail} ({'; '.join(errors)})"
        raise CPUOpUnavailable(f"the build failed: {type(e).__name__}: {detail}") from e
    finally:
        if old_path is not None:
            os.environ["PATH"] = old_path
    return torch.ops.kvcert_cpu


def load(verbose: bool = False):
    """Build (first call; cached on disk) and load the op; returns ``torch.ops.kvcert_cpu``.

    Raises
    ------
    CPUOpUnavailable
        No C++ compiler, no ninja, or a failed build (the message names the
        cause; ``verbose=True`` prints the compiler's output).
    """
    with _lock:
        if _state["ops"] is not None:
            return _state["ops"]
        try:
            _state["ops"] = _build(verbose)
        except CPUOpUnavailable as e:
            _state["reason"] = str(e)
            raise
        _state["reason"] = None
        return _state["ops"]


def available(warn: bool = False) -> bool:
    """Whether the op is built and loaded (builds it on the first call of the process).

    A failed build is not retried in the same process. With ``warn=True`` the
    first failure emits one ``RuntimeWarning`` naming the cause.
    """
    if _state["ops"] is not None:
        return True
    if _state["reason"] is None:
        try:
            load()
            return True
        except CPUOpUnavailable:
            pass
    if warn and not _state["warned"]:
        _state["warned"] = True
        warnings.warn(f"kvcert: the compiled CPU decode op is unavailable: {_state['reason']}; decoding uses "
                      f"the torch path (kvcert.fast). Set {ENV_VAR}=0 to choose the torch path explicitly.",
                      RuntimeWarning, stacklevel=3)
    return False


def unavailable_reason() -> str | None:
    """Why the last build or load failed (None if it has not failed)."""
    return _state["reason"]


def hajek_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor | None = None,
                    *, log_pi: torch.Tensor | None = None, scale: float | None = None,
                    per_coordinate: bool = True, value_center: torch.Tensor | None = None, splits: int = 0,
                    validate: bool = True) -> Estimate:
    r"""Hajek attention over a compressed cache with its certificate statistics: the compiled op.

    Same contract as :func:`kvcert.fast.hajek_attention` (docs/design.md) for what it computes;
    see the module docstring for the math and the one pass.

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d), CPU, floating
        Query rows; all g * t rows of a GQA group share the pass over their KV head.
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), CPU, both float32 or both bfloat16
        The kept tokens, padding slots with pi = 0. Any strides (a last
        stride other than 1 costs a copy).
    pi, log_pi : (b, h_kv, n)
        Exactly one: inclusion probabilities in [0, 1] or their logarithm
        (-inf on padding). 1 - pi is evaluated as ``-expm1(log pi)``.
    scale : float, default 1/sqrt(d)
    per_coordinate : bool
        Also return ``variance`` (b, h_q, [t,] dv); the trace is then its sum.
    value_center : (b, h_kv, dv), optional
        The centre mu of the trace's centred form (e.g. the mean kept value,
        :func:`kvcert.fast.value_moments`); default: the first kept value of
        each range. Any centre gives the same trace in exact arithmetic.
    splits : int
        Slot ranges per head (0: automatic, enough tasks for 8 per thread and
        ranges of at least 256 slots).
    validate : bool
        Check the arguments and pi / log_pi values and refuse a NaN output (two host reads).
        ``False`` is the per-step call of a decode whose eviction event checked its tensors: no
        Python checks and no host reads; the op checks shapes, dtypes and devices, and where it
        refuses, the contract's error naming the argument is raised.

    Returns
    -------
    Estimate
        ``output`` in the dtype of ``values``; ``trace``, ``lse``, ``n_eff``
        (and ``variance``) in float32; ``weights``, ``max_term``,
        ``covariance``, ``tail_moment`` None. Empty rows (every slot padding):
        output 0, lse -inf, trace and variance +inf, n_eff 0, with or
        without ``validate``. Rows whose kept slots all have pi = 1: trace
        exactly 0.

    Raises
    ------
    CPUOpUnavailable
        The op cannot be built here.
    TypeError, ValueError
        Arguments outside the contract, tensors not on the CPU, K/V dtypes
        other than float32 / bfloat16.
    """
    def explain():  # where the op refused: the contract's error, if any, then the op's own checks
        check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale)
        _call(q, keys, values, pi, log_pi, scale, per_coordinate, value_center, splits, False)

    if not validate:  # the per-step call: the op checks shapes, dtypes and devices itself, in C++
        return _trusted(lambda: _run_op(q, _unit_stride(keys), _unit_stride(values), _one_log_pi(pi, log_pi),
                                        value_center, check_scale(scale, q.shape[-1]), bool(per_coordinate), splits),
                        explain)
    check_attention_values(check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale))
    return _trusted(lambda: _call(q, keys, values, pi, log_pi, scale, per_coordinate, value_center, splits, True),
                    lambda: check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale))


#: what the op and the argument handling around it raise on arguments outside the contract
_OP_ERRORS = (RuntimeError, AttributeError, IndexError, TypeError, ValueError, ZeroDivisionError)


def _trusted(run, explain):
    """``run()``; where it raises, ``explain()`` first (it raises the contract's error naming the argument,
    where there is one), then the original error. Checks cost nothing on a call the op accepts."""
    try:
        return run()
    except _OP_ERRORS:
        explain()
        raise


def _one_log_pi(pi, log_pi):
    """log pi from exactly one of ``pi`` and ``log_pi``."""
    if (pi is None) == (log_pi is None):
        raise TypeError("give exactly one of pi and log_pi, each of shape (b, h_kv, n)")
    return log_pi if pi is None else pi.log()


def _op_kv(q, keys, values):
    """The checks of the op's inputs that the contract does not make (CPU tensors, K and V both float32 or
    both bfloat16); K and V with a unit last stride (a copy only where it is not)."""
    if q.device.type != "cpu" or keys.device.type != "cpu" or values.device.type != "cpu":
        raise ValueError(f"kvcert.kernels.cpu needs CPU tensors, got q on {q.device}, keys on {keys.device}")
    if keys.dtype not in SUPPORTED_DTYPES or values.dtype != keys.dtype:
        raise TypeError(f"keys and values must both be float32 or both bfloat16, got {keys.dtype} and {values.dtype}")
    return _unit_stride(keys), _unit_stride(values)


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy where its last stride is not 1 (the op reads rows of unit stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _call(q, keys, values, pi, log_pi, scale, per_coordinate, value_center, splits, validate) -> Estimate:
    """The op's call, with the checks it cannot do (which of pi / log_pi, the GQA grouping, the scale,
    CPU tensors, the dtypes, the options); shapes otherwise checked by the op."""
    lp = _one_log_pi(pi, log_pi)
    keys, values = _op_kv(q, keys, values)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 0:
        raise ValueError(f"splits must be an int >= 0, got {splits!r}")
    b, h_q, h_kv, d, dv = q.shape[0], q.shape[1], keys.shape[1], q.shape[-1], values.shape[-1]
    if q.dim() not in (3, 4) or h_q % h_kv:
        raise ValueError("q must be (b, h_q, d) or (b, h_q, t, d) with h_q a multiple of h_kv")
    if value_center is not None and (not isinstance(value_center, torch.Tensor)
                                     or tuple(value_center.shape) != (b, h_kv, dv)):
        raise ValueError(f"value_center must be a tensor of shape (b, h_kv, dv) = ({b}, {h_kv}, {dv}), "
                         f"got {getattr(value_center, 'shape', type(value_center).__name__)}")
    est = _run_op(q, keys, values, lp, value_center, check_scale(scale, d), bool(per_coordinate), splits)
    if validate and bool(torch.isnan(est.output).any()):
        raise ValueError("hajek_attention produced NaN: q, keys and values must be finite")
    return est


def _run_op(q, keys, values, log_pi, value_center, scale: float, per_coordinate: bool, splits: int) -> Estimate:
    """The op's call on checked arguments (K and V with a unit last stride, the scale a float; log pi read as
    float32) and its Estimate; shapes are checked by the op."""
    if log_pi.dtype != torch.float32:
        log_pi = log_pi.to(torch.float32)
    ops = _state["ops"] if _state["ops"] is not None else load()
    out, lse, n_eff, trace, var = ops.hajek_decode(q, keys, values, log_pi, value_center, scale, per_coordinate,
                                                   splits)  # in q's leading shape
    return Estimate(output=out, weights=None, variance=var if per_coordinate else None, trace=trace, lse=lse,
                    n_eff=n_eff)


def sketch_hajek_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor | None,
                            sketch, *, scale: float | None = None, delta: float = 0.05, rule: str | None = None,
                            multiplier: float | None = None, log_pi: torch.Tensor | None = None,
                            value_center: torch.Tensor | None = None, value_sqdist: torch.Tensor | None = None,
                            validate: bool = True, record: str | None = None):
    r"""The cluster (sketched) design's decode step, pass and certificate, in one call of the compiled op.

    :func:`kvcert.fast.sketch_hajek_attention` with ``trace=False`` (the Hugging Face decode's call;
    same arguments and result). One C++ pass over the kept K and V gives per query row the Hajek output
    :math:`\hat o`, :math:`\log\hat Z`, the kept share :math:`\kappa = \sum_{i\in S}\pi_i a_i`,

    .. math::

        T' = \sum_{i\in S} \pi_i (1-\pi_i)\, a_i^2\, \lVert v_i - \hat o\rVert^2,\qquad
        \hat V_{\mathrm{HT}} = \sum_{i\in S} (1-\pi_i)\, a_i^2\, \lVert v_i - \hat o\rVert^2

    (both in the centred form around the value centre :math:`\mu`, as the trace of :func:`hajek_attention`)
    and :math:`\max_{i\in S}\lVert v_i-\mu\rVert^2`; then, per row, the sketch's O(C d) epilogue in double
    (``kvcert.fast.sketch._log_variance``): with :math:`r = q - q_0` (:math:`q_0 = 0` untilted) and the
    sketch's decode form :math:`x = b + [r;\ r^2]\,W`,

    .. math::

        \log N = \operatorname{logaddexp}\big(\log T' + 2\log\hat Z,\
                 \operatorname{logsumexp}_c\,[x_c + \log(Y_c + W_c\lVert\mu_s - \hat o\rVert^2)]\big),\quad
        \log\tilde Z = \operatorname{logaddexp}\big(\log\kappa + \log\hat Z,\ \operatorname{logsumexp}_c x_{C+c}\big),

        V_{\mathrm{cl}} = e^{\log N - 2\log\tilde Z},\quad V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}}),\quad
        \mathrm{radius} = \min(c\sqrt{V}, H),\quad
        H = \lVert\hat o-\mu_s\rVert + \max\big(\rho_U,\ \max_S\lVert v_i-\mu\rVert + \lVert\mu-\mu_s\rVert\big)

    (:math:`\mu_s` the sketch's value centre, :math:`\rho_U` its ``reach``, c the rule's factor; no H
    without ``reach``; a NaN H caps nothing, as ``torch.fmin``). The maximum over S is the op's own, over
    the kept slots: ``value_sqdist`` is not read (the torch path's maximum over every slot of it is the
    same for :func:`kvcert.fast.value_moments`' distances, which are 0 on padding). CPU tensors, K and V
    float32 or bfloat16; every sum in float32, the epilogue in double.

    Parameters
    ----------
    As :func:`kvcert.fast.sketch_hajek_attention` (no ``trace``). ``value_center`` (b, h_kv, dv) is the
    centre :math:`\mu` (default the mean kept value, :func:`kvcert.fast.value_moments`, one more pass
    over V). ``validate=False`` is the per-step call of a decode whose eviction event checked its
    tensors: no Python checks (the op checks shapes, dtypes and devices; where it refuses, the
    contract's error is raised), no host reads, and the sketch's decode form built for the layout is
    reused without looking for in-place changes of the sketch's tensors (an event installs a new
    sketch; a changed layout or sketch object still rebuilds it).
    record : str, optional
        A certificate kind: ``estimate.trace`` is then the trace the decode records for it,
        :func:`kvcert.fast.recorded_trace` (:math:`\min(V_{\mathrm{cl}}, (H/c_\mathrm{kind})^2)`, computed in
        the op; :math:`V_{\mathrm{cl}}` itself without a hull bound).

    Returns
    -------
    kvcert.fast.ClusterEstimate
        ``estimate.trace`` None (the op forms the HT trace for the variance, not as a field), as
        ``trace=False``, or the recorded trace of ``record``; ``variance`` is max(V_cl, HT trace) and
        ``cluster_variance`` None. An empty row (nothing kept): output 0, lse -inf, variance, radius,
        bound and recorded trace +inf.

    Raises
    ------
    CPUOpUnavailable
        The op cannot be built here.
    TypeError, ValueError
        As :func:`kvcert.fast.sketch_hajek_attention`; tensors not on the CPU, K/V dtypes other than
        float32 / bfloat16.
    """
    def explain():  # where the op refused: the contract's error, if any, then the op's own checks
        check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale)
        _op_kv(q, keys, values)  # CPU tensors, K and V float32 or bfloat16
        _check_centre(keys, values, value_center, value_sqdist, pair=validate)

    if not validate:  # the per-step call: shapes, dtypes and devices checked by the op, in C++
        def run():
            if value_sqdist is not None and value_center is None:
                raise TypeError("give both value_center= and value_sqdist= (from value_moments), or neither")
            lp = _one_log_pi(pi, log_pi)
            mu = value_center if value_center is not None else _sketch_imports()["value_moments"](values, log_pi=lp)[0]
            return _sketch_op(q, keys, values, lp, mu, check_scale(scale, q.shape[-1]), sketch, rule, delta,
                              multiplier, record, False, follow_in_place=False)

        return _trusted(run, explain)
    check_attention_values(check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale))
    return _trusted(lambda: _cluster_call(q, keys, values, pi, log_pi, sketch, scale, delta, rule, multiplier,
                                          value_center, value_sqdist, True, record), explain)


_FACTORS: dict = {}  # (rule, delta, multiplier, their types) -> (rule, delta, factor), checked once


def _radius_factor(rule, delta, multiplier) -> tuple[str, float, float]:
    """The checked rule and delta and the rule's factor c (radius c sqrt(V)), once per argument triple."""
    key = (rule, type(delta), delta, type(multiplier), multiplier)
    try:
        return _FACTORS[key]
    except (KeyError, TypeError):  # TypeError: an unhashable argument, refused by the checks below
        pass
    from kvcert.fast.certificates import check_delta
    from kvcert.fast.sketch import RADIUS_RULES, _check_multiplier, _check_rule

    delta = check_delta(delta)
    rule = _check_rule(rule)
    out = (rule, delta, float(RADIUS_RULES[rule].factor(delta, _check_multiplier(multiplier))))
    if len(_FACTORS) < 256:
        _FACTORS[key] = out
    return out


_sketch_names: dict = {}  # kvcert.fast's names the sketch route reads, imported at its first call


def _sketch_imports() -> dict:
    if not _sketch_names:
        from types import SimpleNamespace

        from kvcert.fast import sketch
        from kvcert.fast.estimators import value_moments

        _sketch_names.update(Layout=SimpleNamespace, form=sketch._decode_form, Result=sketch.ClusterEstimate,
                             value_moments=value_moments, clip=sketch._radius_per_root_trace)
    return _sketch_names


def _check_centre(keys, values, value_center, value_sqdist, *, pair: bool) -> None:
    """The centre arguments of the sketch route: ``value_sqdist`` only with ``value_center`` (and, where ``pair``,
    the checked call's rule: both or neither), each of its shape. The op reads the centre, not the distances."""
    if value_sqdist is not None and value_center is None or (pair and value_center is not None and value_sqdist is None):
        raise TypeError("give both value_center= and value_sqdist= (from value_moments), or neither")
    b, h_kv, n, dv = keys.shape[0], keys.shape[1], keys.shape[2], values.shape[-1]
    for name, x, shape, text in (("value_center", value_center, (b, h_kv, dv), "(b, h_kv, dv)"),
                                 ("value_sqdist", value_sqdist, (b, h_kv, n), "(b, h_kv, n)")):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != shape):
            raise ValueError(f"{name} must be a tensor of shape {text} = {shape}, "
                             f"got {getattr(x, 'shape', type(x).__name__)}")


def _cluster_call(q, keys, values, pi, log_pi, sketch, scale, delta, rule, multiplier, value_center, value_sqdist,
                  validate, record):
    """:func:`sketch_hajek_attention`'s op call, with the checks the op cannot do; shapes, devices and dtypes
    otherwise checked by the op. The sketch's decode form (``kvcert.fast.sketch._decode_form``, float32) is built at
    the first call for a layout and kept on the sketch, its shape check with it."""
    names = _sketch_imports()
    lp = _one_log_pi(pi, log_pi)
    _check_centre(keys, values, value_center, value_sqdist, pair=True)
    tau = check_scale(scale, q.shape[-1])
    mu = names["value_moments"](values, log_pi=lp)[0] if value_center is None else value_center
    return _sketch_op(q, keys, values, lp, mu, tau, sketch, rule, delta, multiplier, record, validate)


def _sketch_constants(q, sketch, tau: float, b: int, h_kv: int, dv: int, rule, delta, multiplier, record,
                      follow_in_place: bool = True):
    """What a sketch op call (dense or paged) reads besides the tensors: ``(form, rule, delta, factor, clip)``, the
    sketch's decode form (``kvcert.fast.sketch._decode_form``, float32, built at the first call for a layout and kept
    on the sketch, its shape check with it), the checked radius rule and delta and the rule's factor (the sketch's
    rule and multiplier where None), and the recorded kind's clip (0 without one)."""
    names = _sketch_names or _sketch_imports()
    form = names["form"](sketch, names["Layout"](dtype=torch.float32, scale=tau, b=b, h_kv=h_kv, d=q.shape[-1], dv=dv,
                                                 q=q), follow_in_place)
    rule, delta, factor = _radius_factor(sketch.rule if rule is None else rule, delta,
                                         sketch.multiplier if multiplier is None else multiplier)
    return form, rule, delta, factor, 0.0 if record is None else names["clip"](record, delta)


def _sketch_op(q, keys, values, log_pi, center, tau: float, sketch, rule, delta, multiplier, record, validate: bool,
               follow_in_place: bool = True):
    """The dense sketch op's call and its ClusterEstimate: the sketch's decode form (``kvcert.fast.sketch._decode_form``,
    float32, built at the first call for a layout and kept on the sketch, its shape check with it), the radius rule's
    factor (the sketch's rule and multiplier where None), the recorded kind's clip, and with ``validate`` the refusal
    of a NaN output or variance."""
    form, rule, delta, factor, clip = _sketch_constants(q, sketch, tau, keys.shape[0], keys.shape[1], values.shape[-1],
                                                        rule, delta, multiplier, record, follow_in_place)
    ops = _state["ops"] if _state["ops"] is not None else load()
    output, lse, var, rad, bnd, rec = ops.hajek_decode_sketch(q, keys, values, log_pi, center, tau, 0, form.W,
                                                              form.bias, form.weight, form.wnorm, form.tilt, form.mu,
                                                              form.reach, factor, clip)
    if validate and bool(torch.isnan(output).any() | torch.isnan(var).any()):
        raise ValueError("sketch_hajek_attention produced NaN: q, keys, values and the sketch must be finite")
    return _cluster_result(values.dtype, q.dtype == torch.float64, form, rule, delta, record, output, lse, var, rad,
                           bnd, rec)


def _cluster_result(out_dtype, double, form, rule, delta, record, output, lse, var, rad, bnd, rec):
    """The op's sketch outputs as :func:`kvcert.fast.sketch_hajek_attention`'s ClusterEstimate: the output in
    ``out_dtype`` (the values'), the statistics in float64 where ``double`` (kvcert.fast's compute dtype for a
    float64 q), the bound where the sketch has a reach, the recorded trace where ``record`` names a kind."""
    names = _sketch_names
    if out_dtype != torch.float32:
        output = output.to(out_dtype)
    bound = bnd if form.reach is not None else None
    trace = None if record is None else var if bound is None else rec
    if double:
        lse, var, rad, bound, trace = (x if x is None else x.double() for x in (lse, var, rad, bound, trace))
    est = Estimate(output=output, weights=None, variance=None, trace=trace, lse=lse)
    return names["Result"](estimate=est, variance=var, radius=rad, rule=rule, delta=delta, bound=bound)


def _paged_inputs(q, kv_cache, block_ids, log_pi, validate: bool):
    """The checks of the paged routes' inputs (q (E, h_q, d), a ``vec`` cache (num_blocks, h_kv, bs, 2 d) float32 or
    bfloat16, block_ids int64 (E, M), log_pi (E, h_kv, M bs)); ``(h_kv, d, E, log_pi as contiguous float32)``.
    With ``validate``, log pi must also lie in [-inf, 0] (a host read)."""
    if not all(isinstance(x, torch.Tensor) for x in (q, kv_cache, block_ids, log_pi)):
        raise TypeError("q, kv_cache, block_ids and log_pi must be torch tensors")
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"kv_cache must be (num_blocks, h_kv, bs, 2 d), got shape {tuple(kv_cache.shape)}")
    _, h_kv, bs, two_d = kv_cache.shape
    d = two_d // 2
    if block_ids.dim() != 2 or block_ids.dtype != torch.int64:
        raise ValueError(f"block_ids must be an int64 tensor (E, M), got {block_ids.dtype} of shape "
                         f"{tuple(block_ids.shape)}")
    E, M = block_ids.shape
    if q.dim() != 3 or q.shape[0] != E or q.shape[2] != d or q.shape[1] % h_kv:
        raise ValueError(f"q must be (E, h_q, d) = ({E}, a multiple of {h_kv}, {d}), got shape {tuple(q.shape)}")
    if tuple(log_pi.shape) != (E, h_kv, M * bs):
        raise ValueError(f"log_pi must be (E, h_kv, M * bs) = ({E}, {h_kv}, {M * bs}), got {tuple(log_pi.shape)}")
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"kv_cache must be float32 or bfloat16, got {kv_cache.dtype}")
    lp = log_pi.to(torch.float32).contiguous()  # no copy when it already is
    if validate and bool(((lp > 0) | torch.isnan(lp)).any()):
        raise ValueError("log_pi must lie in [-inf, 0] (-inf: the slot holds no token), found NaN or > 0")
    return h_kv, d, E, lp


def paged_hajek_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, log_pi: torch.Tensor,
                          *, scale: float | None = None, splits: int = 0, validate: bool = True,
                          softcap: float | None = None) -> Estimate:
    r"""The same decode and trace (module docstring), read straight from a paged cache in vLLM's CPU layout.

    Slot i of row e lies in physical block ``block_ids[e, i // bs]`` at offset ``i % bs`` of
    ``kv_cache`` (num_blocks, h_kv, bs, 2 d), which holds per (block, KV head) the keys transposed
    ``[d, bs]`` and then the values ``[bs, d]`` (vLLM's ``vec`` CPU layout): the vLLM plugin's decode of a
    compacted token design (``kvcert.vllm.backend.token_decode``) without gathering K and V first.

    Parameters
    ----------
    q : (E, h_q, d), one decode query per row
    kv_cache : (num_blocks, h_kv, bs, 2 d), float32 or bfloat16, contiguous
    block_ids : int64 (E, M), the blocks each row reads (any valid id where log pi is -inf throughout)
    log_pi : (E, h_kv, M * bs) float32: log pi of the slot's token, -inf where the slot holds none (never read)
    scale : float, default 1/sqrt(d)
    splits : int, slot ranges per head (0: automatic)
    validate : bool
        Check the shapes, that log_pi lies in [-inf, 0] (one host read) and refuse a NaN output.
        ``False``: the vLLM plugin's per-step call, no Python checks (the op checks shapes, dtypes and
        block ids; where it refuses, the contract's error is raised).
    softcap : float > 0, optional
        A model's attention logit softcap c (Gemma 2): each score is :math:`c\tanh(\tau q\cdot k_i/c)`, taken
        in the pass before the offset :math:`-\log\pi_i`, so the estimate and its trace are the softcapped
        estimator's (the same as a score bias :math:`c\tanh(s/c) - s` on the gathered rows).

    Returns
    -------
    Estimate
        ``output`` (E, h_q, d) in the cache's dtype; ``trace``, ``lse``, ``n_eff`` (E, h_q) float32.

    Raises
    ------
    CPUOpUnavailable
        The op cannot be built here.
    ValueError
        Shapes or values outside the contract (naming the argument); block ids outside the cache (always checked);
        a softcap that is not a finite number > 0.
    """
    cap = check_softcap(softcap) or 0.0  # the op's 0: no cap
    if not validate:  # the per-step call: the op checks shapes, dtypes and block ids; the contract's error where not
        return _trusted(lambda: _paged_op(q, kv_cache.contiguous(), block_ids.contiguous(), _f32(log_pi),
                                          check_scale(scale, q.shape[-1]), splits, cap),
                        lambda: _paged_inputs(q, kv_cache, block_ids, log_pi, False))
    h_kv, d, E, lp = _paged_inputs(q, kv_cache, block_ids, log_pi, validate)
    est = _paged_op(q, kv_cache.contiguous(), block_ids.contiguous(), lp, check_scale(scale, d), splits, cap)
    if bool(torch.isnan(est.output).any()):
        raise ValueError("paged_hajek_attention produced NaN: q and the cache must be finite")
    return est


def _paged_op(q, kv_cache, block_ids, log_pi, scale: float, splits: int, softcap: float = 0.0) -> Estimate:
    """The paged token op's call on checked arguments (the op checks shapes, dtypes and block ids itself) and its
    Estimate; ``softcap`` 0 for none."""
    ops = _state["ops"] if _state["ops"] is not None else load()
    E, h_q, d = q.shape
    out, lse, n_eff, trace = ops.hajek_decode_paged(q.reshape(E, kv_cache.shape[1], -1, d), kv_cache, block_ids,
                                                    log_pi, scale, splits, softcap)
    return Estimate(output=out.view(E, h_q, d), weights=None, variance=None, trace=trace.view(E, h_q),
                    lse=lse.view(E, h_q), n_eff=n_eff.view(E, h_q))


def paged_sketch_hajek_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                                  log_pi: torch.Tensor, sketch, *, scale: float | None = None, delta: float = 0.05,
                                  rule: str | None = None, multiplier: float | None = None, record: str | None = None,
                                  center_sums: torch.Tensor | None = None, tail_start: torch.Tensor | None = None,
                                  validate: bool = True):
    r"""The sketched decode step (:func:`sketch_hajek_attention`) read straight from a paged cache (vLLM's CPU layout).

    The slots as :func:`paged_hajek_attention` (slot i of row e in block ``block_ids[e, i // bs]``, ``vec``
    layout; log pi -inf where the slot holds no token, never read), the step and its certificate as
    :func:`sketch_hajek_attention` with ``value_center`` the mean kept value of each (row, KV head),

    .. math:: \mu = \frac{1}{|S|}\sum_{i\in S} v_i

    (:func:`kvcert.fast.value_moments`' centre), which the op computes first from the kept values (one read of
    them, in place): the vLLM plugin's sketched decode (``kvcert.vllm.backend.sketch_decode``) without
    gathering K and V nor computing the value moments in torch. With ``center_sums`` and ``tail_start`` that
    read covers only the slots from ``tail_start[e]`` on, added to the given sums of the slots before (a
    compacted prompt's kept values, which do not change from step to step: the plugin sums them once, when
    it compacts the prompt).

    Parameters
    ----------
    q : (E, h_q, d), one decode query per row
    kv_cache : (num_blocks, h_kv, bs, 2 d), float32 or bfloat16, contiguous
    block_ids : int64 (E, M)
    log_pi : (E, h_kv, M * bs), -inf where the slot holds no token
    sketch : ClusterSketch of the E rows (batch E), per KV head
    scale, delta, rule, multiplier, record : as :func:`sketch_hajek_attention`
    center_sums : float64 (E, h_kv, d + 1), optional
        Per row and KV head, the sum of the kept values of slots ``0 .. tail_start[e] - 1`` (first d entries)
        and their count (last entry); the op then reads the values of slots ``tail_start[e]`` on only.
    tail_start : int64 (E,), optional, with ``center_sums``
    validate : bool
        Check that log_pi lies in [-inf, 0] and tail_start in [0, M bs] (host reads) and refuse a NaN output or
        V_cl. (A tail_start outside that range reads no memory outside the rows' slots either way: the op reads
        the slots from max(tail_start[e], 0) to M bs.) ``False``: the vLLM plugin's per-step call, no Python
        checks (the op checks shapes, dtypes and block ids; where it refuses, the contract's error is raised),
        and the sketch's decode form reused without looking for in-place changes of its tensors.

    Returns
    -------
    kvcert.fast.ClusterEstimate
        As :func:`sketch_hajek_attention`: ``output`` (E, h_q, d) in the cache's dtype, ``lse``,
        ``variance``, ``radius``, ``bound`` (E, h_q) float32, ``estimate.trace`` the recorded trace of
        ``record`` (else None).

    Raises
    ------
    CPUOpUnavailable
        The op cannot be built here.
    TypeError, ValueError
        Shapes or values outside the contract (naming the argument), a sketch of other rows or heads, block ids
        outside the cache (always checked).
    """
    def checked():
        h_kv, d, E, lp = _paged_inputs(q, kv_cache, block_ids, log_pi, validate)
        _paged_sums(center_sums, tail_start, log_pi, E, h_kv, d, validate)
        return lp, check_scale(scale, d)

    if not validate:  # the per-step call: the op checks shapes, dtypes and block ids; the contract's error where not
        return _trusted(lambda: _paged_sketch_op(q, kv_cache.contiguous(), block_ids.contiguous(), _f32(log_pi),
                                                 check_scale(scale, q.shape[-1]), sketch, rule, delta, multiplier,
                                                 record, center_sums, tail_start, False, follow_in_place=False),
                        checked)
    lp, tau = checked()
    return _paged_sketch_op(q, kv_cache.contiguous(), block_ids.contiguous(), lp, tau, sketch, rule, delta, multiplier,
                            record, center_sums, tail_start, True)


def _f32(log_pi: torch.Tensor) -> torch.Tensor:
    """log pi as the op reads it: float32, contiguous (no copy when it already is)."""
    return log_pi.to(torch.float32).contiguous()


def _paged_sums(center_sums, tail_start, log_pi, E: int, h_kv: int, d: int, validate: bool) -> None:
    """The checks of the paged sketch route's ``center_sums`` / ``tail_start`` (given together or not at all)."""
    if (center_sums is None) != (tail_start is None):
        raise TypeError("center_sums and tail_start go together (the sums of the slots before tail_start)")
    if center_sums is not None:
        if center_sums.dtype != torch.float64 or tuple(center_sums.shape) != (E, h_kv, d + 1):
            raise ValueError(f"center_sums must be float64 of shape (E, h_kv, d + 1) = ({E}, {h_kv}, {d + 1}), got "
                             f"{center_sums.dtype} {tuple(center_sums.shape)}")
        if tail_start.dtype != torch.int64 or tuple(tail_start.shape) != (E,):
            raise ValueError(f"tail_start must be int64 of shape (E,) = ({E},), got {tail_start.dtype} "
                             f"{tuple(tail_start.shape)}")
        n_slots = log_pi.shape[-1]
        if validate and E and not bool(((tail_start >= 0) & (tail_start <= n_slots)).all()):
            raise ValueError(f"tail_start must lie in [0, {n_slots}] (the rows' slots), got {tail_start.tolist()}")


def _paged_sketch_op(q, kv_cache, block_ids, log_pi, tau: float, sketch, rule, delta, multiplier, record, center_sums,
                     tail_start, validate: bool, follow_in_place: bool = True):
    """The paged sketch op's call and its ClusterEstimate (:func:`_sketch_op`'s constants and result); with
    ``validate`` the refusal of a NaN output or variance. Shapes, dtypes and block ids are checked by the op."""
    form, rule, delta, factor, clip = _sketch_constants(q, sketch, tau, q.shape[0], kv_cache.shape[1], q.shape[-1],
                                                        rule, delta, multiplier, record, follow_in_place)
    ops = _state["ops"] if _state["ops"] is not None else load()
    output, lse, var, rad, bnd, rec, _ = ops.hajek_decode_sketch_paged(
        q, kv_cache, block_ids, log_pi, tau, 0, form.W, form.bias, form.weight, form.wnorm, form.tilt, form.mu,
        form.reach, factor, clip, center_sums, tail_start)
    if validate and bool(torch.isnan(output).any() | torch.isnan(var).any()):
        raise ValueError("paged_sketch_hajek_attention produced NaN: q, the cache and the sketch must be finite")
    return _cluster_result(kv_cache.dtype, False, form, rule, delta, record, output, lse, var, rad, bnd, rec)


#: ``layout`` of :func:`quantized_hajek_attention` -> the op's code (``kvcert.fast.KV_LAYOUTS``)
_QUANT_LAYOUTS = {"channel": 0, "token": 1, "values": 2}


def quantized_hajek_attention(q: torch.Tensor, key_codes: torch.Tensor, key_scales: torch.Tensor | None,
                              value_codes: torch.Tensor, value_scales: torch.Tensor, log_pi: torch.Tensor, *,
                              scale: float | None = None, layout: str = "channel", group: int = CHANNEL_GROUP,
                              tail: tuple | None = None, splits: int = 0, combined: bool = False,
                              validate: bool = True) -> tuple[Estimate, torch.Tensor | None]:
    r"""The Hajek decode over a quantized cache's held slots, dequantizing the codes in the op's pass.

    The stored slots are int8 codes (``int8`` and ``int4`` formats, one code per byte) with float16 scales,
    as ``kvcert.fast.QuantizedKV`` holds them; each tile's key and value rows are dequantized as the op reads
    them (:math:`Q(x) = s\,c`, exact in float32), never the whole cache. ``tail`` holds exact slots after the
    stored ones (tokens decoded since the event). Per query row, as :func:`hajek_attention` on the dequantized
    rows (output, :math:`\log\hat Z`, the trace :math:`\sum_S (1-\pi_i) a_i^2\lVert Q(v_i) - \hat o\rVert^2`,
    :math:`n_\mathrm{eff}`), and in the same pass the rounding variance of stochastic rounding
    (``kvcert.fast.held_rounding_terms``' :math:`V_q`, docs/quantized.md section 4):

    .. math::

        V_q = \sum_{i\in S} a_i^2\Big(\sigma_i^2\,\lVert Q(v_i) - \hat o\rVert^2 + \frac{d_v s_{v,i}^2}{4}\Big),
        \qquad \sigma_i^2 = \tau^2 \sum_j q_j^2\,\frac{s_{k,ij}^2}{4},

    accumulated like the trace (centred around each range's first kept value, rescaled with the softmax's
    running maximum); :math:`\sigma_i = 0` for exact keys (``"values"``), both terms 0 on the tail. With
    ``combined=True`` the pass forms only what the rule on :math:`V + V_q` reads: the trace's weights become
    :math:`a_i^2 (1 - \pi_i + \sigma_i^2)` (one set of sums, no third accumulator), its value term added at the
    merge, so ``trace`` holds :math:`\mathrm{trace} + V_q` and ``V_q`` is None (the decode's call).
    :math:`B_q` (``quantized_bound="strict"``) needs :math:`\hat o` and the sums :math:`F_\pm` before its
    terms, a second pass: not computed here.

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d) float32, CPU
    key_codes : (b, h_kv, m, d) int8 codes (``"channel"``, ``"token"``), or float32 exact keys (``"values"``)
    key_scales : float16, (b, h_kv, ceil(m / group), d) (``"channel"``), (b, h_kv, m) (``"token"``), None
        (``"values"``)
    value_codes : (b, h_kv, m, dv) int8   value_scales : (b, h_kv, m) float16
    log_pi : (b, h_kv, m + r), -inf on padding (its codes are never read)
    scale : float, default 1/sqrt(d)
    layout : ``"channel"``, ``"token"`` or ``"values"`` (``kvcert.fast.KV_LAYOUTS``)
    group : int >= 1, slots per key-scale group of ``"channel"``
    tail : (keys (b, h_kv, r, d), values (b, h_kv, r, dv)), optional; converted to float32
    splits : int, slot ranges per head (0: automatic)
    combined : bool, return trace + V_q as ``trace`` (module docstring above), V_q None
    validate : bool
        Check shapes, dtypes, scales (finite, >= 0), log pi in [-inf, 0] and q finite (host reads), and refuse
        a NaN output. ``False``: no Python checks; the op checks shapes, dtypes and devices.

    Returns
    -------
    (Estimate, V_q)
        ``output`` float32 (b, h_q[, t], dv); ``trace``, ``lse``, ``n_eff`` and ``V_q`` (b, h_q[, t]) float32.
        ``combined``: ``trace`` = trace + V_q, V_q None. An empty row: output 0, lse -inf, trace and V_q +inf.

    Raises
    ------
    CPUOpUnavailable
        The op cannot be built here.
    TypeError, ValueError
        Arguments outside the contract, naming the argument.
    """
    def explain():  # where the op refused: the error naming the argument, if any
        _quantized_inputs(q, key_codes, key_scales, value_codes, value_scales, log_pi, layout, group, tail)

    if validate:
        explain()

    def run():
        tk, tv = (None, None) if tail is None else (_unit_stride(tail[0].to(torch.float32)),
                                                     _unit_stride(tail[1].to(torch.float32)))
        ops = _state["ops"] if _state["ops"] is not None else load()
        return ops.hajek_decode_quantized(q, _unit_stride(key_codes), key_scales, _unit_stride(value_codes),
                                          value_scales, _f32(log_pi), tk, tv, check_scale(scale, q.shape[-1]),
                                          _QUANT_LAYOUTS.get(layout, -1), int(group), int(splits), bool(combined))

    out, lse, n_eff, trace, v_q = _trusted(run, explain)
    if validate and bool(torch.isnan(out).any()):
        raise ValueError("quantized_hajek_attention produced NaN: q and the tail must be finite")
    return Estimate(output=out, weights=None, variance=None, trace=trace, lse=lse, n_eff=n_eff), \
        (None if combined else v_q)


def _quantized_inputs(q, key_codes, key_scales, value_codes, value_scales, log_pi, layout, group, tail) -> None:
    """The checks of :func:`quantized_hajek_attention`'s arguments, each error naming its argument."""
    names = ("q", "key_codes", "value_codes", "value_scales", "log_pi")
    for name, x in zip(names, (q, key_codes, value_codes, value_scales, log_pi)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")
        if x.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor (kvcert.kernels.cpu), got {x.device}")
    if layout not in _QUANT_LAYOUTS:
        raise ValueError(f"layout must be one of {tuple(_QUANT_LAYOUTS)}, got {layout!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be an int >= 1, got {group!r}")
    if q.dtype != torch.float32 or q.dim() not in (3, 4):
        raise TypeError(f"q must be a float32 tensor (b, h_q, d) or (b, h_q, t, d), got {q.dtype} of shape "
                        f"{tuple(q.shape)}")
    if value_codes.dtype != torch.int8 or value_codes.dim() != 4:
        raise TypeError(f"value_codes must be int8 codes (b, h_kv, m, dv) (formats int8, int4; e4m3 decodes on the "
                        f"torch path), got {value_codes.dtype} of shape {tuple(value_codes.shape)}")
    b, h_kv, m, dv = value_codes.shape
    want = torch.float32 if layout == "values" else torch.int8
    if key_codes.dtype != want or key_codes.dim() != 4 or tuple(key_codes.shape[:3]) != (b, h_kv, m):
        raise TypeError(f"key_codes must be {want} (b, h_kv, m, d) = ({b}, {h_kv}, {m}, d) in the {layout!r} layout, "
                        f"got {key_codes.dtype} of shape {tuple(key_codes.shape)}")
    d = key_codes.shape[-1]
    if q.shape[0] != b or q.shape[-1] != d or q.shape[1] % h_kv:
        raise ValueError(f"q must be (b, h_q[, t], d) with b = {b}, d = {d}, h_q a multiple of {h_kv}, got "
                         f"{tuple(q.shape)}")
    shapes = {"channel": (b, h_kv, -(-m // group), d), "token": (b, h_kv, m), "values": None}
    for name, x, shape in (("key_scales", key_scales, shapes[layout]), ("value_scales", value_scales, (b, h_kv, m))):
        if shape is None:
            if x is not None:
                raise ValueError(f"{name} must be None in the 'values' layout (exact keys)")
            continue
        if not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or tuple(x.shape) != shape:
            raise ValueError(f"{name} must be a float16 tensor of shape {shape}, got "
                             f"{getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if x.numel() and not bool((torch.isfinite(x) & (x >= 0)).all()):
            raise ValueError(f"{name} must be finite and >= 0 (found NaN, inf or a negative scale)")
    r = 0
    if tail is not None:
        if not (isinstance(tail, tuple) and len(tail) == 2 and all(isinstance(t, torch.Tensor) for t in tail)):
            raise TypeError("tail must be a tuple (keys (b, h_kv, r, d), values (b, h_kv, r, dv)) of tensors")
        r = tail[0].shape[2] if tail[0].dim() == 4 else -1
        if tuple(tail[0].shape) != (b, h_kv, r, d) or tuple(tail[1].shape) != (b, h_kv, r, dv):
            raise ValueError(f"tail must hold keys (b, h_kv, r, d) = ({b}, {h_kv}, r, {d}) and values (b, h_kv, r, "
                             f"dv) = ({b}, {h_kv}, r, {dv}), got {tuple(tail[0].shape)}, {tuple(tail[1].shape)}")
    if tuple(log_pi.shape) != (b, h_kv, m + r):
        raise ValueError(f"log_pi must be (b, h_kv, m + r) = ({b}, {h_kv}, {m + r}), got {tuple(log_pi.shape)}")
    if log_pi.numel() and bool(((log_pi > 0) | torch.isnan(log_pi)).any()):
        raise ValueError("log_pi must lie in [-inf, 0] (-inf: padding), found NaN or > 0")
    if q.numel() and not bool(torch.isfinite(q).all()):
        raise ValueError("q must be finite (found NaN or inf)")
