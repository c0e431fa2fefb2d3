r"""The cluster design, batched (torch): Gaussian moments of the evicted keys per cluster.

Torch twin of the cluster design of ``kvcert.reference.sketch`` (docs/theory.md
section 8, "Second slice"): same math, batched over (b, h_kv) heads, grouped-query
attention (h_q = g * h_kv) and several queries, float32 or float64. Never imports
``kvcert.reference`` (docs/design.md section 3); the reference checks it
(tests/test_fast_sketch.py).

- :class:`ClusterDesign`: the design's fields (``clusters``, ``iterations``,
  ``radius``, ``multiplier``), the same validation and memory count as the
  reference's. Every function also accepts any object with those attributes
  (e.g. ``kvcert.reference.ClusterDesign``).
- :func:`kmeans_assign`: deterministic Lloyd k-means of each head's keys, labels
  (b, h_kv, n), -1 on padding.
- :func:`cluster_sketch`: at eviction, per cluster c of each head with evicted
  tokens :math:`U_c` and :math:`w_i = (1-\pi_i)/\pi_i`: the w-weighted mean key
  :math:`m_c` and per-channel variance :math:`\sigma^2_c`, :math:`W_c = \sum w_i`,
  :math:`Y_c = \sum w_i \nu_i^2` (:math:`\nu_i = \lVert v_i - \mu\rVert`),
  :math:`N_c = |U_c|`; per head the value centre :math:`\mu`. A fixed number
  C = ``clusters`` of slots per head: a cluster without an evicted token has
  ``count`` 0 and ``weight`` 0 and contributes nothing (the reference drops it).
- :func:`cluster_variance`: :math:`V_{\mathrm{cl}}` for a plug-in output.
- :func:`sketched_variance`: the variance the radius reads, the larger of
  :math:`V_{\mathrm{cl}}` and the sample's HT trace.
- :func:`cluster_radius`: radius from a variance (``chebyshev``, ``gaussian``,
  ``fixed``).
- :func:`sketch_hajek_attention`: the decode step: Hajek output, HT trace,
  :math:`V_{\mathrm{cl}}`, :func:`sketched_variance` and its radius with one read of K
  and V (the trace and the kept part of :math:`V_{\mathrm{cl}}` are two more rows of the
  output's matmul) and O(C d) more work per query for the sketch.

Memory (elements of the K/V dtype, one head): C (2d + 3) + dv + 1
(:meth:`ClusterDesign.elements`), whatever the number of evicted tokens.

The tilted design (``ClusterDesign(tilt=True)``, docs/theory.md section 8, fifth slice) takes
each cluster's moments under the weights :math:`w_i e^{2\tau q_0\cdot k_i}` (squared terms) and
:math:`e^{\tau q_0\cdot k_i}` (:math:`\tilde Z`) at a tilt point :math:`q_0` per KV head
(:func:`window_tilt`: the observation window's mean query of the head's group) and the decode's
Gaussian step in :math:`r = q - q_0`; exact at :math:`q = q_0` for any keys; C (4d + 4) + d + dv + 1
elements.
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass, field, fields, replace
from statistics import NormalDist
from types import MappingProxyType
from typing import Callable

import torch

from ._checks import check_tensor, compute_dtype
from .certificates import check_delta, radius_from_moments
from .contract import check_attention_inputs, check_attention_values
from .estimators import WORKSPACE, cast_to, centred_sum, QueryLayout, offset_scores, value_moments
from .types import Estimate

__all__ = [
    "CLUSTER_RADII",
    "RADIUS_RULES",
    "RadiusRule",
    "ClusterDesign",
    "ClusterEstimate",
    "ClusterSketch",
    "sketch_hajek_attention",
    "cluster_radius",
    "cluster_sketch",
    "sketch_step",
    "cluster_variance",
    "kmeans_assign",
    "sketched_variance",
    "window_tilt",
]

@dataclass(frozen=True)
class RadiusRule:
    r"""One radius rule of the sketched designs: a radius on :math:`\lVert\hat o - o\rVert` from a variance V.

    Attributes
    ----------
    name : str
        The ``radius`` field of :class:`ClusterDesign` and the ``rule`` argument of :func:`cluster_radius`.
    factor : callable
        ``factor(delta, multiplier) -> float``, the c of the radius :math:`c\sqrt V`; ``delta`` already
        checked to lie in (0, 1) and ``multiplier`` to be a finite number > 0.
    summary : str
        The formula in one line.
    """

    name: str
    factor: Callable[[float, float], float]
    summary: str


#: name -> :class:`RadiusRule`, read-only: the radius rules of the sketched designs (twin of
#: ``kvcert.reference.sketch.RADIUS_RULES``, same names and order)
RADIUS_RULES = MappingProxyType({rule.name: rule for rule in (
    RadiusRule("chebyshev", lambda delta, multiplier: math.sqrt(1.0 / delta),
               "sqrt(V / delta): Markov's inequality on the squared error"),
    RadiusRule("gaussian", lambda delta, multiplier: NormalDist().inv_cdf(1.0 - delta / 2.0),
               "z_{1-delta/2} sqrt(V): a Gaussian limit of the error"),
    RadiusRule("fixed", lambda delta, multiplier: multiplier,
               "c sqrt(V), c = the design's multiplier"),
)})
#: the names of :data:`RADIUS_RULES`, in registry order
CLUSTER_RADII = tuple(RADIUS_RULES)
#: per-cluster scalars beside the 2 d moments (W_c, Y_c, N_c)
CLUSTER_SCALARS = 3
#: per-cluster scalars of the tilted design beside its 4 d moments (S_c, Y_c, N_c, h_c)
TILTED_SCALARS = 4
#: per-head scalars beside mu (and q0): ``reach``, the evicted values' largest ||v_i - mu|| (the hull bound)
HEAD_SCALARS = 1


def _check_int(name: str, x, low: int) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < low:
        raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
    return int(x)


def _check_rule(rule) -> str:
    if not isinstance(rule, str) or rule not in RADIUS_RULES:
        raise ValueError(f"rule must be one of {tuple(RADIUS_RULES)}, got {rule!r}")
    return rule


def _check_multiplier(multiplier) -> float:
    if isinstance(multiplier, bool) or not isinstance(multiplier, numbers.Real) \
            or not (math.isfinite(multiplier) and multiplier > 0):
        raise ValueError(f"multiplier must be a finite number > 0, got {multiplier!r}")
    return float(multiplier)


@dataclass(frozen=True)
class ClusterDesign:
    r"""A cluster design: Poisson sampling plus weighted Gaussian moments of the evicted keys per cluster.

    Same fields, defaults, validation and memory count as
    ``kvcert.reference.ClusterDesign`` (which the functions of this module also
    accept, as any object with these four attributes).

    Attributes
    ----------
    clusters : int >= 1
        Clusters per head (k-means of the head's keys); the sketch holds this many slots.
    iterations : int >= 0
        Lloyd iterations.
    radius : a name of :data:`RADIUS_RULES`
    multiplier : float > 0, the ``fixed`` rule's c in c sqrt(V)
    tilt : bool
        The tilted design (docs/theory.md section 8, fifth slice): the moments are taken at a
        tilt point q0 per KV head given at eviction (:func:`window_tilt`), the decode step in
        r = q - q0; memory C (4d + 4) + d + dv + 1.
    """

    clusters: int = 16
    iterations: int = 10
    radius: str = "gaussian"
    multiplier: float = 3.0
    tilt: bool = False

    def __post_init__(self):
        _check_int("clusters", self.clusters, 1)
        _check_int("iterations", self.iterations, 0)
        if not isinstance(self.radius, str) or self.radius not in RADIUS_RULES:
            raise ValueError(f"radius must be one of {tuple(RADIUS_RULES)}, got {self.radius!r}")
        _check_multiplier(self.multiplier)
        if not isinstance(self.tilt, bool):
            raise ValueError(f"tilt must be a bool, got {self.tilt!r}")

    def elements(self, d: int, dv: int) -> int:
        """Elements held by the sketch of one head: C (2d + 3) + dv + 1, tilted C (4d + 4) + d + dv + 1
        (the + 1: ``reach``, for the hull bound of :func:`sketch_hajek_attention`)."""
        if self.tilt:
            return self.clusters * (4 * d + TILTED_SCALARS) + d + dv + HEAD_SCALARS
        return self.clusters * (2 * d + CLUSTER_SCALARS) + dv + HEAD_SCALARS

    def tokens(self, d: int, dv: int) -> float:
        """:meth:`elements` in kept-token units of d + dv + 1 elements (key, value, log pi): what the
        sketch takes off the sampled budget, and what the certificate record counts beside the kept tokens."""
        return self.elements(d, dv) / (d + dv + 1)


def as_design(design) -> ClusterDesign:
    """None -> ClusterDesign(); a ClusterDesign as is; any object with the four fields (and ``tilt``,
    default False) -> a checked copy."""
    if design is None:
        return ClusterDesign()
    if isinstance(design, ClusterDesign):
        return design
    try:
        fields = {f: getattr(design, f) for f in ("clusters", "iterations", "radius", "multiplier")}
    except AttributeError:
        raise TypeError(f"design must be None or have the attributes clusters, iterations, radius and multiplier "
                        f"(a ClusterDesign), got {type(design).__name__}") from None
    return ClusterDesign(**fields, tilt=bool(getattr(design, "tilt", False)))


@functools.lru_cache(maxsize=64)
def _sketch_tokens(clusters: int, tilt: bool, d: int, dv: int) -> float:
    """:meth:`ClusterDesign.tokens` of a sketch's C, tilt, d and dv, once per shape (the decode reads it every step)."""
    return ClusterDesign(clusters=clusters, tilt=tilt).tokens(d, dv)


@dataclass(frozen=True)
class ClusterSketch:
    """Per-cluster moments of the evicted tokens of every head (fixed C slots per head).

    Attributes
    ----------
    mean : (b, h_kv, C, d) w-weighted mean key m_c of the cluster's evicted tokens
    var : (b, h_kv, C, d) w-weighted per-channel variance sigma^2_c
    weight : (b, h_kv, C) W_c = sum (1 - pi)/pi
    wnorm : (b, h_kv, C) Y_c = sum (1 - pi)/pi nu^2, nu_i = ||v_i - mu||
    count : (b, h_kv, C) N_c, evicted tokens of the cluster (a float)
    mu : (b, h_kv, dv) the value centre: mean of the head's values (every valid token, kept or not)
    rule : str, the design's radius rule     multiplier : float, its ``fixed`` multiplier
    tilt : (b, h_kv, d) or None, the tilt point q0 of a tilted design
    zmean, zvar : (b, h_kv, C, d) or None, a tilted design's moments for Z~ (weights e^{tau q0.k})
    shift : (b, h_kv, C) or None, a tilted design's h_c = max over U_c of tau q0.k_i
    reach : (b, h_kv) or None, max over the evicted tokens of ||v_i - mu|| (0 where none is evicted), the
        sketch's part of the hull bound (:func:`sketch_hajek_attention`); None: no hull bound

    A tilted sketch's ``mean`` / ``var`` are the moments under w e^{2 tau q0.k}, and ``weight``,
    ``wnorm``, ``count`` hold S_c e^{-2 h_c}, Y_c e^{-2 h_c}, N_c e^{-h_c} (:func:`cluster_sketch`).
    A slot whose cluster has no evicted token holds count 0, weight 0, wnorm 0, mean 0 and var 0
    (and shift 0) and takes no part in :func:`cluster_variance`. Float32 for float32 inputs
    (float64 for float64).

    The decode step keeps the sketch's per-step constants on the sketch itself (a private field,
    not an argument, not compared, not shown): built at the first step for a compute dtype, score scale
    and head layout, rebuilt when one of them differs or when a tensor of the sketch was changed in place
    (the sum of their version counters moved). ``map``, ``cat`` and ``dataclasses.replace`` make new
    sketches, which start without it.
    """

    mean: torch.Tensor
    var: torch.Tensor
    weight: torch.Tensor
    wnorm: torch.Tensor
    count: torch.Tensor
    mu: torch.Tensor
    rule: str = "gaussian"
    multiplier: float = 3.0
    tilt: torch.Tensor | None = None
    zmean: torch.Tensor | None = None
    zvar: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    reach: torch.Tensor | None = None
    _form: "_DecodeForm | None" = field(default=None, init=False, repr=False, compare=False)

    @property
    def clusters(self) -> int:
        """C, the slots per head."""
        return self.mean.shape[-2]

    @property
    def design(self) -> ClusterDesign:
        """A design of this sketch's C and tilt (the memory count's; rule and multiplier are the sketch's own)."""
        return ClusterDesign(clusters=self.clusters, tilt=self.tilt is not None)

    @property
    def elements(self) -> int:
        """Elements this sketch holds per head: :meth:`ClusterDesign.elements` of its C, d, dv and tilt."""
        return self.design.elements(self.mean.shape[-1], self.mu.shape[-1])

    @property
    def tokens(self) -> float:
        """The same in kept-token units (:meth:`ClusterDesign.tokens`)."""
        return _sketch_tokens(self.clusters, self.tilt is not None, self.mean.shape[-1], self.mu.shape[-1])

    @property
    def nbytes(self) -> int:
        """Bytes the sketch's tensors hold (every one it carries: the moments, and a tilted sketch's tilt,
        tilted moments and shifts, and the reach)."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, f.name) for f in fields(self))
                   if isinstance(t, torch.Tensor))

    def map(self, fn) -> "ClusterSketch":
        """The same sketch with ``fn`` applied to each of its six tensors (e.g. a batch selection
        ``lambda x: x[idx]`` or a device move); the rule and multiplier are kept."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})

    @staticmethod
    def cat(sketches) -> "ClusterSketch":
        """Sketches of batch rows joined along the batch dimension (same C, d, dv, rule and multiplier)."""
        sketches = list(sketches)
        if not sketches:
            raise ValueError("sketches must hold at least one ClusterSketch")
        first = sketches[0]
        if any((s.rule, s.multiplier, s.mean.shape[1:], s.tilt is None, s.reach is None)
               != (first.rule, first.multiplier, first.mean.shape[1:], first.tilt is None, first.reach is None)
               for s in sketches):
            raise ValueError("sketches must share the heads, C, d, rule, multiplier, tilt and reach to be joined")
        return replace(first, **{f.name: torch.cat([getattr(s, f.name) for s in sketches])
                                 for f in fields(first) if isinstance(getattr(first, f.name), torch.Tensor)})


@dataclass
class ClusterEstimate:
    r"""Result of :func:`sketch_hajek_attention`.

    Attributes
    ----------
    estimate : Estimate
        What ``hajek_attention(..., per_coordinate=False)`` returns on the same inputs
        (output, lse and the HT ``trace``; ``weights``, ``variance``, ``n_eff`` None).
    variance : (b, h_q[, t]) the variance the radius reads, :func:`sketched_variance`: the larger of
        V_cl (the hybrid variance with the sketch's evicted part) and the sample's HT trace
    radius : (b, h_q[, t]) the radius of ``rule`` on ``variance`` at level 1 - ``delta``, capped at ``bound``
    rule : str   delta : float
    bound : (b, h_q[, t]) or None, the deterministic hull bound
        :math:`\lVert\hat o-\mu\rVert + \max(\rho_U, \max_S\lVert v_i - c\rVert + \lVert c-\mu\rVert)` on
        :math:`\lVert\hat o - o\rVert` (``kvcert.reference.sketch.hull_bound``; None for a sketch without
        ``reach``)
    cluster_variance : (b, h_q[, t]) or None, V_cl alone (the torch and Triton steps; None from the
        compiled op, which returns ``variance`` only)
    """

    estimate: Estimate
    variance: torch.Tensor
    radius: torch.Tensor
    rule: str
    delta: float
    bound: torch.Tensor | None = None
    cluster_variance: torch.Tensor | None = None

    @property
    def output(self) -> torch.Tensor:
        """The Hajek estimate o_hat (``estimate.output``)."""
        return self.estimate.output


# ----------------------------------------------------------------------------------------------------
# eviction time: k-means and the sketch


def _valid_mask(name: str, valid, shape, device) -> torch.Tensor | None:
    if valid is None:
        return None
    valid = check_tensor(name, valid)
    if valid.dtype != torch.bool or tuple(valid.shape) != tuple(shape):
        raise ValueError(f"{name} must be a bool tensor of shape (b, h_kv, n) = {tuple(shape)}, "
                         f"got {valid.dtype} {tuple(valid.shape)}")
    return valid.to(device)


def _initial_centres(k: torch.Tensor, ok: torch.Tensor, C: int, full: bool):
    r"""Initial centres (B, C, d) of every head and its cluster count min(C, n_valid) (B,).

    As ``kvcert.reference.kmeans_assign``: the head's valid keys (in slot order) at the evenly
    spaced quantiles ``floor((j + 1/2) n' / C')`` of their projection :math:`(k_i - \bar k)\cdot u`
    (stable sort), u the unit eigenvector of the largest eigenvalue of the scatter matrix
    :math:`\sum_i (k_i - \bar k)(k_i - \bar k)^\top` (d x d, batched ``torch.linalg.eigh`` in
    float64), signed so that its largest-magnitude component (the first, on ties) is positive: the
    reference's rule, which makes the order of the centres independent of the eigensolver.
    """
    B, n, d = k.shape
    okf = ok.to(k.dtype)
    m = ok.sum(-1)                                                             # (B,) valid keys
    mean = (okf[:, None, :] @ k).squeeze(1) / m.clamp(min=1).to(k.dtype)[:, None]
    kc = k - mean[:, None, :]
    if not full:
        kc = torch.where(ok[:, :, None], kc, 0.0)                             # centred, 0 on padding
    # baddbmm, not bmm: torch's CPU bmm takes a far slower path for this long (n) reduction
    scatter = torch.baddbmm(kc.new_zeros(B, d, d), kc.transpose(1, 2), kc, beta=0.0)
    _, vecs = torch.linalg.eigh(scatter.to(torch.float64))
    u = vecs[:, :, -1]                                                         # (B, d): largest eigenvalue
    top = torch.gather(u, 1, u.abs().argmax(-1, keepdim=True))                 # first largest |u_j|
    u = torch.where(top < 0, -u, u).to(k.dtype)
    proj = torch.where(ok, (kc @ u[:, :, None]).squeeze(-1), float("inf"))   # padding sorts last
    order = torch.sort(proj, dim=-1, stable=True).indices                     # (B, n)
    live = m.clamp(max=C)                                                      # (B,) C' = min(C, n')
    j = torch.arange(C, device=k.device, dtype=torch.float64)
    pos = ((j[None, :] + 0.5) * m[:, None].to(torch.float64) / live.clamp(min=1)[:, None].to(torch.float64))
    pos = pos.to(torch.int64).clamp_(max=max(n - 1, 0))                        # floor((j + 1/2) n'/C')
    slot = torch.gather(order, 1, pos)                                         # (B, C)
    centres = torch.gather(k, 1, slot[:, :, None].expand(B, C, d))
    dead = torch.arange(C, device=k.device)[None, :] >= live[:, None]          # slots beyond C'
    return centres.masked_fill_(dead[:, :, None], 0.0), live


def kmeans_assign(keys: torch.Tensor, clusters: int, *, iterations: int = 10,
                  valid: torch.Tensor | None = None) -> torch.Tensor:
    r"""Deterministic Lloyd k-means of every head's keys: labels (b, h_kv, n) in [0, clusters), -1 on padding.

    Per head, with the n' valid keys and C' = min(``clusters``, n'): initial centres at the
    evenly spaced quantiles of the projection on the first principal direction (see
    :func:`_initial_centres`), then ``iterations + 1`` rounds of

    .. math::

        \ell_i = \arg\min_c\ \lVert m_c\rVert^2 - 2\, k_i\cdot m_c, \qquad
        m_c \leftarrow \frac{1}{|\{i: \ell_i = c\}|}\sum_{\ell_i = c} k_i\ \text{(if non-empty)},

    (the squared distance less :math:`\lVert k_i\rVert^2`, the same for every c), ties to the
    lowest index and empty clusters keeping their previous centre: the labels of
    ``kvcert.reference.kmeans_assign`` on the head's valid keys (tested in float64 on generic
    inputs; float32 differs only for keys within rounding of a cluster boundary or of a tie in
    the projection order).

    Parameters
    ----------
    keys : (b, h_kv, n, d) floating
    clusters : int >= 1
    iterations : int >= 0
    valid : (b, h_kv, n) bool, optional
        The real tokens (default: all). Padding takes no part and gets label -1; a head
        without a valid token gets -1 everywhere.

    Returns
    -------
    labels : (b, h_kv, n) int64

    Notes
    -----
    Everything runs batched on the keys' device in their compute dtype: the initialisation
    (O(n d^2) for the scatter matrix, a d x d float64 eigensolve per head) and the Lloyd rounds
    (O(n C d) each, stopping early once a round repeats the previous round's labels, after which
    every round would).
    """
    keys = check_tensor("keys", keys, ndim=(4,), floating=True)
    clusters = _check_int("clusters", clusters, 1)
    iterations = _check_int("iterations", iterations, 0)
    b, h, n, d = keys.shape
    valid = _valid_mask("valid", valid, (b, h, n), keys.device)
    if valid is None:
        valid = torch.ones((b, h, n), dtype=torch.bool, device=keys.device)
    dt = compute_dtype(keys)
    B = b * h
    k = cast_to(keys, dt).reshape(B, n, d)
    ok = valid.reshape(B, n)
    if n == 0 or d == 0:
        return torch.full((b, h, n), -1, dtype=torch.int64, device=keys.device)
    full = bool(ok.all())
    centres, live = _initial_centres(k, ok, clusters, full)
    C = clusters
    dead = torch.arange(C, device=k.device)[None, :] >= live[:, None]  # (B, C): slots beyond C'
    kz = k if full else torch.where(ok[:, :, None], k, 0.0)          # padding adds nothing to a centre
    okf = ok.to(dt)
    kt = k.transpose(1, 2).contiguous()                              # (B, d, n)
    prev = None
    for _ in range(iterations + 1):
        c2 = (centres * centres).sum(-1).masked_fill_(dead, float("inf"))
        dist = torch.baddbmm(c2[:, :, None], centres, kt, alpha=-2.0)  # (B, C, n): the faster gemm layout
        # the first minimum on ties, as NumPy (torch.min's documented rule; on CPU 1.7x faster than a transposed
        # copy and argmin, 7x faster than argmin over dim 1)
        lab = dist.min(1).indices
        if prev is not None and torch.equal(lab, prev):
            break   # the same labels give the same centres: every later round repeats this one
        cnt = _cluster_sums(lab, C, okf)                               # (B, C), padding counts 0
        sums = _cluster_sums(lab, C, kz)                               # (B, C, d)
        nz = cnt > 0
        centres = torch.where(nz[:, :, None], sums / cnt.clamp(min=1.0)[:, :, None], centres)
        prev = lab
    return lab.masked_fill(~ok, -1).reshape(b, h, n)


def _probabilities(name: str, pi, shape, device) -> torch.Tensor:
    pi = check_tensor(name, pi, floating=True)
    if tuple(pi.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape (b, h_kv, n) = {tuple(shape)}, got shape {tuple(pi.shape)}")
    if pi.device != device:
        raise ValueError(f"{name} must be on the device of keys ({device}), got {pi.device}")
    return pi


def cluster_sketch(keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor, keep: torch.Tensor, design=None, *,
                   labels: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                   tilt: torch.Tensor | None = None, scale: float | None = None) -> ClusterSketch:
    r"""Build the cluster sketch of the evicted tokens (``keep == False``) of every head.

    Per head, with the labels of :func:`kmeans_assign` (or ``labels``), :math:`\mu` the mean of
    the head's valid values, :math:`w_i = (1-\pi_i)/\pi_i` and U_c the evicted tokens of cluster c:

    .. math::

        W_c = \sum_{U_c} w_i,\quad Y_c = \sum_{U_c} w_i \lVert v_i - \mu\rVert^2,\quad N_c = |U_c|,\quad
        m_c = \frac{\sum_{U_c} w_i k_i}{W_c},\quad
        \sigma^2_{cj} = \frac{\sum_{U_c} w_i (k_{ij} - m_{cj})^2}{W_c}

    (with :math:`W_c` replaced by 1 where it is 0, as the reference: only a cluster whose evicted
    tokens all have pi = 1, which a Poisson sample never evicts). The same numbers as
    ``kvcert.reference.cluster_sketch`` for the clusters with an evicted token, in label order;
    the other slots hold zeros.

    Parameters
    ----------
    keys : (b, h_kv, n, d)   values : (b, h_kv, n, dv)
        Every head's full cache at the eviction (kept and evicted tokens).
    pi : (b, h_kv, n) in [0, 1], > 0 on every valid evicted token (an evicted token with pi = 0 is
        unobservable)
    keep : (b, h_kv, n) bool, the sample
    design : ClusterDesign (or any object with its fields), default ``ClusterDesign()``
    labels : (b, h_kv, n) int64 in [0, design.clusters) on the valid tokens, optional
        Overrides k-means (padding labels are ignored).
    valid : (b, h_kv, n) bool, optional
        The real tokens of a padded batch; default ``pi > 0`` (0 on padding, the ``kvcert.fast``
        convention). Padding takes no part in k-means, mu or the moments.
    tilt : (b, h_kv, d), required by a tilted design (``design.tilt``), refused otherwise
        The tilt point :math:`q_0` of every KV head (:func:`window_tilt`). With
        :math:`e_i = \tau q_0\cdot k_i` and :math:`h_c = \max_{U_c} e_i` the sketch holds
        ``weight`` :math:`\sum_{U_c} w_i e^{2(e_i - h_c)}`, ``wnorm``
        :math:`\sum_{U_c} w_i\nu_i^2 e^{2(e_i - h_c)}`, ``count`` :math:`\sum_{U_c} e^{e_i - h_c}`,
        ``mean`` / ``var`` weighted by :math:`w_i e^{2e_i}`, ``zmean`` / ``zvar`` by :math:`e^{e_i}`,
        ``shift`` :math:`h_c` and ``tilt`` (as ``kvcert.reference.cluster_sketch``).
    scale : float, default 1/sqrt(d), the :math:`\tau` of the tilt

    Returns
    -------
    ClusterSketch with C = ``design.clusters`` slots per head, in the compute dtype of ``keys`` and
    ``values`` (float64 if either is): a float64 ``pi`` (a design's inclusion probabilities) sets
    only the precision of :math:`w_i`, computed in float64 and rounded once to float32, unless a
    weight overflows float32 (:math:`\pi_i \lesssim 3\cdot 10^{-39}`): then the sketch is float64.
    """
    design = as_design(design)
    keys, values, p, keep, valid = _check_sketch_inputs(keys, values, pi, keep, valid)
    b, h, n, d = keys.shape
    dev = keys.device
    gone = valid & ~keep
    if bool((gone & ~(p > 0)).any()):
        raise ValueError("pi must be > 0 for every evicted token (an evicted token with pi = 0 is unobservable)")
    C = design.clusters
    lab = _sketch_labels(keys, labels, valid, design)
    B = b * h
    dv = values.shape[-1]
    g = gone.reshape(B, n)
    w, dt = _evicted_weights(g, p.reshape(B, n), compute_dtype(keys, values))
    q0 = None
    if design.tilt:
        q0 = _tilt_tensor(tilt, (b, h, d), dev)
    elif tilt is not None:
        raise ValueError("tilt is for a tilted design (ClusterDesign(tilt=True)); this design has tilt=False")
    k = cast_to(keys, dt).reshape(B, n, d)
    v = cast_to(values, dt).reshape(B, n, dv)
    okf = valid.reshape(B, n).to(dt)
    mu = (okf[:, None, :] @ v).squeeze(1) / okf.sum(-1, keepdim=True).clamp(min=1.0)   # (B, dv)
    lab = torch.where(g, lab.reshape(B, n), 0)
    nu2 = (v - mu[:, None, :]).square().sum(-1)                             # (B, n)
    reach = nu2.masked_fill(~g, 0.0).amax(-1).sqrt() if n else torch.zeros(B, dtype=dt, device=dev)
    out = dict(mu=mu.reshape(b, h, dv), rule=design.radius, multiplier=float(design.multiplier),
               reach=reach.reshape(b, h))
    if q0 is None:
        W, mean, var = _weighted_moments(lab, C, w, k)
        N = _cluster_sums(lab, C, g.to(dt))
    else:
        tau = 1.0 / math.sqrt(d) if scale is None else float(scale)
        w, W, mean, var, N, tilted = _tilted_moments(lab, C, w, k, g, q0, tau, (b, h))
        out.update(tilted)
    Y = _cluster_sums(lab, C, w * nu2)
    return ClusterSketch(mean=mean.reshape(b, h, C, d), var=var.reshape(b, h, C, d), weight=W.reshape(b, h, C),
                         wnorm=Y.reshape(b, h, C), count=N.reshape(b, h, C), **out)


def _check_sketch_inputs(keys, values, pi, keep, valid):
    """:func:`cluster_sketch`'s arguments checked: keys (b, h_kv, n, d), values (b, h_kv, n, dv) on its device,
    pi in [0, 1] (returned as ``p``, at the compute precision of keys, values and pi), the bool mask keep, and
    valid (default ``pi > 0``)."""
    keys = check_tensor("keys", keys, ndim=(4,), floating=True)
    b, h, n, _ = keys.shape
    values = check_tensor("values", values, floating=True)
    if values.ndim != 4 or tuple(values.shape[:3]) != (b, h, n):
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = ({b}, {h}, {n}, dv), "
                         f"got shape {tuple(values.shape)}")
    dev = keys.device
    if values.device != dev:
        raise ValueError(f"values must be on the device of keys ({dev}), got {values.device}")
    pi = _probabilities("pi", pi, (b, h, n), dev)
    keep = check_tensor("keep", keep)
    if keep.dtype != torch.bool or tuple(keep.shape) != (b, h, n):
        raise ValueError(f"keep must be a bool tensor of shape (b, h_kv, n) = {(b, h, n)}, "
                         f"got {keep.dtype} {tuple(keep.shape)}")
    keep = keep.to(dev)
    p = cast_to(pi, compute_dtype(keys, values, pi))                   # checks and weights at pi's precision
    if p.numel():
        lo, hi = torch.stack(torch.aminmax(p)).tolist()
        if not (lo >= 0.0 and hi <= 1.0):
            raise ValueError("pi must lie in [0, 1] (found a value outside, or NaN)")
    valid = _valid_mask("valid", valid, (b, h, n), dev)
    if valid is None:
        valid = p > 0
    return keys, values, p, keep, valid


def _sketch_labels(keys, labels, valid, design) -> torch.Tensor:
    """The cluster labels (b, h_kv, n) int64: :func:`kmeans_assign` of the valid keys, or the given ``labels``
    checked to lie in [0, clusters) on every valid token."""
    b, h, n, _ = keys.shape
    C = design.clusters
    if labels is None:
        return kmeans_assign(keys, C, iterations=design.iterations, valid=valid)
    lab = check_tensor("labels", labels)
    if lab.dtype.is_floating_point or lab.dtype == torch.bool or tuple(lab.shape) != (b, h, n):
        raise ValueError(f"labels must be an integer tensor of shape (b, h_kv, n) = {(b, h, n)}, "
                         f"got {lab.dtype} {tuple(lab.shape)}")
    lab = lab.to(device=keys.device, dtype=torch.int64)
    bad = valid & ((lab < 0) | (lab >= C))
    if bool(bad.any()):
        raise ValueError(f"labels must lie in [0, clusters) = [0, {C}) on every valid token")
    return lab


def _evicted_weights(g, p, dt):
    """w_i = (1 - pi_i) / pi_i on the evicted tokens g (B, n), 0 elsewhere, and the dtype of the moments: the
    compute dtype ``dt`` of keys and values, unless a weight of float64 pi overflows it (then float64)."""
    w = torch.where(g, (1.0 - p) / torch.where(g, p, 1.0), 0.0)   # 0 off U
    if w.dtype != dt:   # float64 pi, float32 keys: the moments in float32 unless a weight overflows it
        w32 = w.to(dt)
        if bool(torch.isfinite(w32).all()):
            w = w32
        else:
            dt = w.dtype
    return w, dt


def _tilted_moments(lab, C, w, k, g, q0, tau: float, bh: tuple[int, int]):
    """A tilted sketch's moments at q0 (b, h_kv, d): with e_i = tau q0.k_i and h_c its largest value on the
    evicted tokens of cluster c, the tilted weights w_i e^{2(e_i - h_c)} (for the value moment) with their
    (W, mean, var), the count N = sum e^{e_i - h_c}, and the fields only a tilted sketch has (tilt, zmean, zvar
    under e^{e_i - h_c}, shift h_c)."""
    (b, h), (B, n, d), dt, dev = bh, k.shape, k.dtype, k.device
    e = torch.bmm(k, cast_to(q0, dt).reshape(B, d, 1)).squeeze(-1).mul_(tau)   # (B, n): tau q0.k
    hc = torch.full((B, C), float("-inf"), dtype=dt, device=dev).scatter_reduce_(
        1, lab, e.masked_fill(~g, float("-inf")), reduce="amax")
    hc = torch.where(torch.isfinite(hc), hc, 0.0)                        # 0 on a slot without evicted tokens
    x = (e - torch.gather(hc, 1, lab)).masked_fill_(~g, 0.0)             # <= 0 on U
    ex = torch.exp(x) * g.to(dt)
    w = w * ex.square()
    W, mean, var = _weighted_moments(lab, C, w, k)
    N, zmean, zvar = _weighted_moments(lab, C, ex, k)
    return w, W, mean, var, N, dict(tilt=cast_to(q0, dt).reshape(b, h, d), zmean=zmean.reshape(b, h, C, d),
                                    zvar=zvar.reshape(b, h, C, d), shift=hc.reshape(b, h, C))


def _cluster_sums(lab: torch.Tensor, C: int, x: torch.Tensor) -> torch.Tensor:
    """Per-cluster sums (B, C, ...) of x (B, n, ...) under the labels lab (B, n) in [0, C): ``index_add_`` on the
    CPU, a one-hot matmul elsewhere (deterministic, where CUDA's ``index_add_`` adds atomically in any order)."""
    B, n = lab.shape
    tail = tuple(x.shape[2:])
    if x.device.type == "cpu":
        flat = (lab + C * torch.arange(B, device=lab.device)[:, None]).reshape(-1)
        return x.new_zeros((B * C, *tail)).index_add_(0, flat, x.reshape(B * n, *tail)).reshape(B, C, *tail)
    E = (lab[:, None, :] == torch.arange(C, device=lab.device)[None, :, None]).to(x.dtype)   # (B, C, n)
    return torch.bmm(E, x.reshape(B, n, -1)).reshape(B, C, *tail)


def _weighted_moments(lab, C, w, k):
    """Per-cluster mass (B, C), w-weighted mean and per-channel variance (B, C, d) of the keys k (B, n, d)
    under the labels lab (B, n) (w = 0 off the evicted tokens; a mass of 0 divides by 1: its slot holds zeros)."""
    B, n, d = k.shape
    W = _cluster_sums(lab, C, w)
    Ws = torch.where(W > 0, W, 1.0)[:, :, None]
    wk = w[:, :, None]
    mean = _cluster_sums(lab, C, wk * k) / Ws
    flat = (lab + C * torch.arange(B, device=lab.device)[:, None]).reshape(-1)
    centred = k - mean.reshape(B * C, d).index_select(0, flat).reshape(B, n, d)
    var = _cluster_sums(lab, C, centred.square_().mul_(wk)) / Ws
    return W, mean, var


def _tilt_tensor(tilt, shape, device) -> torch.Tensor:
    if tilt is None:
        raise ValueError(f"tilt is required by a tilted design (ClusterDesign(tilt=True)): the tilt point q0 of "
                         f"every KV head, shape (b, h_kv, d) = {shape} (window_tilt(queries, h_kv))")
    tilt = check_tensor("tilt", tilt, floating=True)
    if tuple(tilt.shape) != tuple(shape):
        raise ValueError(f"tilt must have shape (b, h_kv, d) = {tuple(shape)}, got shape {tuple(tilt.shape)}")
    if tilt.device != device:
        raise ValueError(f"tilt must be on the device of keys ({device}), got {tilt.device}")
    if not bool(torch.isfinite(tilt).all()):
        raise ValueError("tilt must be finite")
    return tilt


def window_tilt(queries: torch.Tensor, h_kv: int, window: int | None = None) -> torch.Tensor:
    r"""The tilted design's tilt point: the mean of the last ``window`` queries over each KV head's query group.

    .. math:: q_0^{(j)} = \frac{1}{g\,w}\sum_{h \in \text{group } j}\ \sum_{t > T - w} q_{h,t}

    Parameters
    ----------
    queries : (b, h_q, T, d), the prefill's queries (h_q = g h_kv)
    h_kv : int >= 1, KV heads
    window : int >= 1, optional, the observation window (default all T queries)

    Returns
    -------
    (b, h_kv, d), in the dtype of ``queries``
    """
    queries = check_tensor("queries", queries, ndim=(4,), floating=True)
    b, hq, T, d = queries.shape
    h_kv = _check_int("h_kv", h_kv, 1)
    if hq % h_kv:
        raise ValueError(f"queries have {hq} heads, not a multiple of h_kv = {h_kv}")
    if T == 0:
        raise ValueError("queries must hold at least one query (T >= 1)")
    w = T if window is None else min(_check_int("window", window, 1), T)
    return queries[:, :, T - w:].reshape(b, h_kv, hq // h_kv, w, d).mean((2, 3))


# ----------------------------------------------------------------------------------------------------
# decode time: V_cl, the radius, and the one-pass decode step


@functools.lru_cache(maxsize=64)
def _radius_per_root_trace(kind: str, delta: float) -> float:
    """c with radius = c sqrt(trace) for a norm kind (its radius at trace 1), once per (kind, delta)."""
    return float(radius_from_moments(kind, delta, trace=torch.ones((), dtype=torch.float64)))


def recorded_trace(ce: "ClusterEstimate", kind: str) -> torch.Tensor:
    r"""The trace a sketched decode records for certificate ``kind``: its variance
    :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})` (``ce.variance``, :func:`sketched_variance`) clipped at
    :math:`(H/c)^2`,

    .. math:: \mathrm{trace} = \min\big(V,\ (H / c)^2\big), \qquad
              c\sqrt{\mathrm{trace}} = \min\big(c\sqrt{V},\ H\big),

    with :math:`H` the hull bound (``ce.bound``; no clip without one) and :math:`c` the kind's radius per
    unit square-root trace at ``ce.delta`` (:math:`1/\sqrt\delta` for ``chebyshev``, 3 for ``tilted_hull``):
    the kind's radius of the recorded trace is the sketched design's radius. One definition for the Hugging
    Face decode (``kvcert.dispatch.decode``) and the vLLM plugin (``kvcert.vllm.backend.sketch_decode``).
    """
    if ce.bound is None:
        return ce.variance
    c = _radius_per_root_trace(kind, float(ce.delta))
    return torch.minimum(ce.variance, (ce.bound / c).square())


def cluster_radius(variance: torch.Tensor, *, delta: float, rule: str, multiplier: float = 3.0) -> torch.Tensor:
    r"""Radius from a variance, elementwise: ``chebyshev`` :math:`\sqrt{V/\delta}`, ``gaussian``
    :math:`z_{1-\delta/2}\sqrt V`, ``fixed`` :math:`c\sqrt V` (c = ``multiplier``); negative V
    counts as 0, +inf stays +inf (:data:`RADIUS_RULES`). As ``kvcert.reference.sketch.radius_from_variance``.

    Raises
    ------
    ValueError
        delta outside (0, 1), an unknown rule, a multiplier that is not a finite number > 0, NaN in
        ``variance``.
    """
    variance = check_tensor("variance", variance, floating=True)
    delta = check_delta(delta)
    rule = _check_rule(rule)
    multiplier = _check_multiplier(multiplier)
    if bool(torch.isnan(variance).any()):
        raise ValueError("variance must not contain NaN")
    return _radius(variance, delta, rule, multiplier)


def _radius(variance: torch.Tensor, delta: float, rule: str, multiplier: float, clamp: bool = True) -> torch.Tensor:
    factor = RADIUS_RULES[rule].factor(delta, multiplier)
    return (variance.clamp(min=0.0) if clamp else variance).sqrt().mul_(factor)


def _check_sketch(sketch: ClusterSketch, L: QueryLayout) -> None:
    """The tensors of ``sketch`` must be those of the KV heads of these keys and values (shapes, device)."""
    C = sketch.mean.shape[-2] if isinstance(sketch.mean, torch.Tensor) and sketch.mean.ndim == 4 else "C"
    want = {"mean": ("(b, h_kv, C, d)", (L.b, L.h_kv, C, L.d)), "var": ("(b, h_kv, C, d)", (L.b, L.h_kv, C, L.d)),
            "weight": ("(b, h_kv, C)", (L.b, L.h_kv, C)), "wnorm": ("(b, h_kv, C)", (L.b, L.h_kv, C)),
            "count": ("(b, h_kv, C)", (L.b, L.h_kv, C)), "mu": ("(b, h_kv, dv)", (L.b, L.h_kv, L.dv))}
    if sketch.tilt is not None:
        want.update({"tilt": ("(b, h_kv, d)", (L.b, L.h_kv, L.d)), "zmean": ("(b, h_kv, C, d)", (L.b, L.h_kv, C, L.d)),
                     "zvar": ("(b, h_kv, C, d)", (L.b, L.h_kv, C, L.d)), "shift": ("(b, h_kv, C)", (L.b, L.h_kv, C))})
    if sketch.reach is not None:
        want["reach"] = ("(b, h_kv)", (L.b, L.h_kv))
    for name, (text, shape) in want.items():
        x = getattr(sketch, name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"sketch.{name} must have shape {text} = {shape} for these keys and values, got {got}")
        if x.device != L.q.device:
            raise ValueError(f"sketch.{name} must be on the device of q ({L.q.device}), got {x.device}")


def _probs(L: QueryLayout, C) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log pi, 1 - pi, pi) as (B, n) in the compute dtype, from ``pi`` or ``log_pi`` (as hajek_attention)."""
    dt = L.dtype
    if C.p_name == "pi":
        pf = cast_to(C.p, dt).reshape(L.B, L.n)
        return torch.log(pf), 1.0 - pf, pf
    lp = cast_to(C.p, dt).reshape(L.B, L.n)
    return lp, -torch.expm1(lp), torch.exp(lp)


def _kept_pass(L: QueryLayout, lp, omp, pf, mu, r2):
    r"""One pass over K and V: the Hajek output and the HT trace, and the kept pieces of V_cl.

    .. math::

        s = \tau\, q K^\top - \log\pi, \quad a = \operatorname{softmax}(s),\quad c = (1-\pi)\, a^2,
        \quad c' = \pi c,\quad [\hat o;\ \textstyle\sum c_i v_i;\ \sum c'_i v_i] = [a; c; c']\, V,

    and, with :math:`r_i = \lVert v_i - \mu\rVert^2`, :math:`[\sum c_i r_i, \sum c'_i r_i]`,
    :math:`[\sum c_i, \sum c'_i]` and the kept share :math:`\kappa = \sum_S \pi_i a_i =
    \hat Z^{-1}\sum_S e^{s_i}`. Empty rows (every slot padding) get a = 0 (so o = 0, kappa = 0,
    every sum 0) and lse = -inf. Returns ``(o (B, G, dv), cv (B, KG, dv), t (B, KG), sc (B, KG, 1),
    kappa (B, G), lse (B, G))``, the c rows first (K = 2 kinds of rows).
    """
    dt, B, G, n = L.dtype, L.B, L.G, L.n
    dev = L.q.device
    v, s, m = offset_scores(L, lp, None, "sketch_scores")     # m finite: an empty row gets a = e^{-inf} = 0
    rows = WORKSPACE.get("sketch_rows", B * 3 * G * n, dt, dev).view(B, 3 * G, n)   # [a; c; c']
    a = torch.sub(s, m, out=rows[:, :G]).exp_()
    l = a.sum(-1, keepdim=True)
    lse = torch.log(l).add_(m).squeeze(-1)                     # -inf on empty rows (l = 0)
    a.div_(l.clamp_(min=1.0))                                  # l >= 1 on a non-empty row (its max is e^0)
    c = torch.mul(a, a, out=rows[:, G:2 * G]).mul_(omp.view(B, 1, n))
    torch.mul(c, pf.view(B, 1, n), out=rows[:, 2 * G:])
    oc = torch.bmm(rows, v)                                    # (B, 3G, dv): [o; sum c v; sum c' v]
    t = torch.linalg.vecdot(rows[:, G:], r2.view(B, 1, n))    # (B, 2G): [sum c r; sum c' r]
    kappa = torch.linalg.vecdot(a, pf.view(B, 1, n))            # (B, G): sum pi a
    sc = rows[:, G:].sum(-1, keepdim=True)
    return oc[:, :G], oc[:, G:], t, sc, kappa, lse


def _centred(t, cv, sc, o, mu):
    r"""The kept sums :math:`\sum c_i\lVert v_i - \hat o\rVert^2` (c rows, then c' rows), (B, K, G):
    :math:`\sum c_i r_i - 2(\hat o-\mu)\cdot(\sum c_i v_i - \mu\sum c_i) + \lVert\hat o-\mu\rVert^2
    \sum c_i` (:func:`kvcert.fast.estimators.centred_sum`, for the two kinds of rows at once), clamped at 0."""
    B, KG, dv = cv.shape
    G = o.shape[1]
    K = KG // G
    dm = (o - mu).view(B, 1, G, dv)
    return centred_sum(t.view(B, K, G), cv.view(B, K, G, dv), sc.view(B, K, G, 1), dm, mu.view(B, 1, 1, dv))


#: the tensor fields of a ClusterSketch (the decode form is rebuilt when the sum of their version counters moves)
_SKETCH_TENSORS = ("mean", "var", "weight", "wnorm", "count", "mu", "tilt", "zmean", "zvar", "shift", "reach")
_sketch_tensors = operator.attrgetter(*_SKETCH_TENSORS)  # the tuple of them (None where absent), in one call


@dataclass(frozen=True)
class _DecodeForm:
    r"""A sketch's per-step constants for one compute dtype, score scale :math:`\tau` and head layout,
    B = b h_kv rows (:func:`_decode_form`).

    ``W`` (B, 2d, 2C) :math:`= \begin{bmatrix} 2\tau m_c & \tau m'_c \\ 2\tau^2\sigma^2_c &
    \tau^2\sigma'^2_c/2\end{bmatrix}` (columns c; :math:`m' = m`, :math:`\sigma'^2 = \sigma^2` without a
    tilt) and ``bias`` (B, 1, 2C) :math:`= [2h_c \mid \log N_c + h_c]` (h = 0 without a tilt), so that one
    ``baddbmm`` of :math:`[r;\ r^2]` gives, per cluster, :math:`2(\tau r\cdot m_c + \tau^2 r^2\cdot\sigma^2_c)
    + 2h_c` (the numerator's exponent, before :math:`\log(Y_c + W_c a^2)`) and :math:`\log N_c + h_c +
    \tau r\cdot m'_c + \tau^2 r^2\cdot\sigma'^2_c/2` (Z~'s term). ``weight``, ``wnorm`` (B, 1, C);
    ``tilt`` (B, 1, d) or None; ``mu`` (B, 1, dv); ``reach`` (B, 1) or None; ``kept`` = (2, 1), the
    powers of :math:`\hat Z` in the kept sums. ``W`` and ``bias`` are working memory of the decode (4 d C + 2 C
    elements per head), not part of the design's memory count; the other fields are views of the sketch's
    own tensors (copies only when the compute dtype differs from the sketch's). ``key`` is what the form
    was built for: (dtype, scale, b, h_kv, d, dv, device); ``version`` the sum of the sketch tensors'
    version counters then (:func:`_version`)."""

    W: torch.Tensor
    bias: torch.Tensor
    weight: torch.Tensor
    wnorm: torch.Tensor
    tilt: torch.Tensor | None
    mu: torch.Tensor
    reach: torch.Tensor | None
    kept: torch.Tensor
    key: tuple
    version: int | None


def _version(sketch: ClusterSketch) -> int | None:
    """The sum of the version counters of the sketch's tensors: every in-place change moves it up (None when
    one of them is an inference tensor, which keeps no counter)."""
    try:
        return sum([x._version for x in _sketch_tensors(sketch) if x is not None])
    except RuntimeError:  # inference tensors (torch.inference_mode) have no version counter
        return None


def _decode_form(sketch, L: QueryLayout, follow_in_place: bool = True) -> _DecodeForm:
    """The per-step constants (:class:`_DecodeForm`) of ``sketch`` for the layout ``L`` (compute dtype, score
    scale, heads, device), kept on the sketch (its ``_form`` field) so that later steps read them as they are.

    Rebuilt, with the sketch's shape check, for another dtype, scale or layout, or when a tensor of the
    sketch was changed in place (the sum of their version counters moved; inference tensors keep none, so a
    sketch of them must not be changed in place, as no ClusterSketch should be: ``map`` and
    ``dataclasses.replace`` make new ones). ``follow_in_place=False`` skips that last test (the version
    counters of its eleven tensors, a few microseconds a call inside a model's forward): for a cache layer's
    sketch on the per-step path, which the eviction event made and nothing changes in place. TypeError when
    ``sketch`` is not a :class:`ClusterSketch`."""
    if not isinstance(sketch, ClusterSketch):
        raise TypeError(f"sketch must be a ClusterSketch (kvcert.fast.cluster_sketch), got {type(sketch).__name__}")
    dt = L.dtype
    key = (dt, float(L.scale), L.b, L.h_kv, L.d, L.dv, L.q.device)
    form = sketch._form
    if form is not None and form.key == key and not follow_in_place:
        return form
    version = _version(sketch)
    if form is not None and form.key == key and form.version == version:
        return form
    _check_sketch(sketch, L)
    mean, var = sketch.mean, sketch.var
    b, h, C, d = mean.shape
    B = b * h
    col = lambda x: cast_to(x, dt).reshape(B, C, d).transpose(1, 2)  # noqa: E731  (B, d, C)
    zmean, zvar = (mean, var) if sketch.zmean is None else (sketch.zmean, sketch.zvar)
    t1, t2 = float(L.scale), float(L.scale) ** 2
    W = torch.cat((torch.cat((col(mean) * (2.0 * t1), col(zmean) * t1), dim=-1),
                   torch.cat((col(var) * (2.0 * t2), col(zvar) * (0.5 * t2)), dim=-1)), dim=1).contiguous()
    row = lambda x: cast_to(x, dt).reshape(B, 1, -1)  # noqa: E731
    log_count = torch.log(row(sketch.count))
    if sketch.shift is None:
        bias = torch.cat((torch.zeros_like(log_count), log_count), dim=-1)
    else:  # the masses are held scaled by e^{-h_c} and e^{-2 h_c}
        h = row(sketch.shift)
        bias = torch.cat((2.0 * h, log_count + h), dim=-1)
    form = _DecodeForm(W=W, bias=bias, weight=row(sketch.weight), wnorm=row(sketch.wnorm),
                       tilt=None if sketch.tilt is None else row(sketch.tilt), mu=row(sketch.mu),
                       reach=None if sketch.reach is None else cast_to(sketch.reach, dt).reshape(B, 1),
                       kept=torch.tensor([2.0, 1.0], dtype=dt, device=mean.device), key=key, version=version)
    object.__setattr__(sketch, "_form", form)  # a cache on a frozen dataclass: not a field anyone sets
    return form


def _log_variance(L: QueryLayout, f: _DecodeForm, o, lse, kappa, t_kept):
    r"""log of V_cl's numerator and of Z~ from the kept pieces and the sketch, (B, G) each.

    Kept part: :math:`\sum_S \frac{1-\pi_i}{\pi_i} e^{2 s_i}\lVert v_i - \hat o\rVert^2 = \hat Z^2 T'`
    with :math:`T' = \sum_S (1-\pi_i)\pi_i a_i^2 \lVert v_i-\hat o\rVert^2`, and
    :math:`\sum_S e^{s_i} = \hat Z \kappa`, :math:`\log\hat Z` = lse. Evicted part: one ``baddbmm`` of
    :math:`[r;\ r^2]` (:math:`r = q`, or :math:`q - q_0` for a tilted sketch) with the sketch's
    :class:`_DecodeForm` gives both Gaussian steps of every cluster, then one logsumexp over the
    clusters and one logaddexp with the kept part, for the numerator and Z~ at once. A row without a
    kept token (lse = -inf, kappa = T' = 0) has no kept part (-inf + -inf = -inf, never NaN); slots
    with count 0 / weight 0 give log 0 = -inf: absent. ``f``: the sketch's :func:`_decode_form` for ``L``.
    """
    dt, B, G = L.dtype, L.B, L.G
    C = f.weight.shape[-1]
    r = cast_to(L.q, dt).reshape(B, G, L.d)
    if f.tilt is not None:                                                                # r = q - q0
        r = r - f.tilt
    x = torch.baddbmm(f.bias, torch.cat((r, r * r), dim=-1), f.W)                         # (B, G, 2C)
    dmu = f.mu - o
    a2 = torch.linalg.vecdot(dmu, dmu).unsqueeze_(-1)                                     # ||mu - o||^2
    x[..., :C] += torch.addcmul(f.wnorm, f.weight, a2).log_()
    evicted = torch.logsumexp(x.view(B, G, 2, C), dim=-1)                                 # [log nu, log Z_U]
    kept = torch.stack((t_kept, kappa), dim=-1).log_().addcmul_(lse.unsqueeze(-1), f.kept)  # [log T' + 2 lse, log kappa + lse]
    both = torch.logaddexp(kept, evicted)
    return both[..., 0], both[..., 1]


def _empty_kept(L: QueryLayout):
    """The kept pieces of a cache with n = 0 slots (as an all-padding one), both kinds of rows (c, c')."""
    dt, dev = L.dtype, L.q.device
    z = torch.zeros(L.B, L.G, dtype=dt, device=dev)
    zz = torch.zeros(L.B, 2 * L.G, dtype=dt, device=dev)
    return (torch.zeros(L.B, L.G, L.dv, dtype=dt, device=dev), torch.zeros(L.B, 2 * L.G, L.dv, dtype=dt, device=dev),
            zz, zz[..., None], z, torch.full_like(z, float("-inf")))


def cluster_variance(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor,
                     sketch: ClusterSketch, *, output: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    r"""The hybrid variance :math:`V_{\mathrm{cl}}` with the evicted part from per-cluster Gaussian moments.

    .. math::

        V_{\mathrm{cl}} = \frac{1}{\tilde Z^2}\Big[\sum_{i\in S}\frac{1-\pi_i}{\pi_i} e^{2 s_i}
            \lVert v_i - \hat o\rVert^2 + \sum_c (Y_c + W_c \lVert\mu - \hat o\rVert^2)\,
            e^{2\tau q\cdot m_c + 2\tau^2 \sum_j q_j^2\sigma^2_{cj}}\Big],\quad
        \tilde Z = \sum_{i\in S} e^{s_i} + \sum_c N_c\, e^{\tau q\cdot m_c + \tau^2\sum_j q_j^2\sigma^2_{cj}/2}.

    The exponentials are the moment generating function of a Gaussian with the cluster's
    weighted mean and diagonal covariance: exact for Gaussian keys with independent channels,
    an approximation otherwise (heavy tails: too small; correlated channels: either way), and
    :math:`\nu_i^2 + \lVert\mu-\hat o\rVert^2` stands for :math:`\lVert v_i - \hat o\rVert^2`
    (exact on average when :math:`v_i - \mu` is uncorrelated with :math:`\mu - \hat o`).
    Its target is the design variance V itself. A tilted
    sketch (``sketch.tilt`` set) takes the step in :math:`r = q - q_0` with its tilted moments:
    :math:`(Y_c + S_c\lVert\mu-\hat o\rVert^2) e^{2\tau r\cdot\tilde m_c + 2\tau^2\sum_j r_j^2
    \tilde\sigma^2_{cj}}` and :math:`N_c e^{\tau r\cdot m'_c + \tau^2\sum_j r_j^2\sigma'^2_{cj}/2}`
    (``kvcert.reference.cluster_variance``). Computed in
    log space (:math:`s_i = \tau q\cdot k_i` may be large), the kept sums in the centred form
    around the mean kept value (``value_moments``); slots with count 0 and weight 0 are absent.
    Every query head reads its KV head's sketch (GQA); several queries (b, h_q, t, d) see every
    kept token (no causal mask).

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d)
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), the kept tokens
    pi : (b, h_kv, n) in [0, 1], 0 on padding (certain tokens, pi = 1, count in Z only)
    sketch : ClusterSketch of the evicted tokens (:func:`cluster_sketch`), per KV head
    output : (b, h_q[, t], dv), the plug-in o_hat
    scale : float, default 1/sqrt(d)

    Returns
    -------
    (b, h_q[, t]) V_cl in float32 (float64 for float64 inputs); 0 when no term is positive
    (the reference's ``0.0``).
    """
    C = check_attention_inputs(q, keys, values, pi, scale=scale, validate=True)
    L = QueryLayout(C, q, keys, values)
    form = _decode_form(sketch, L)
    output = check_tensor("output", output, floating=True)
    want = (L.b, L.h_q, L.dv) if L.decode else (L.b, L.h_q, L.t, L.dv)
    if tuple(output.shape) != want:
        raise ValueError(f"output must have shape (b, h_q[, t], dv) = {want}, got shape {tuple(output.shape)}")
    o = cast_to(output, L.dtype).reshape(L.B, L.G, L.dv)
    lp, omp, pf = _probs(L, C)
    if L.n == 0:
        mu = torch.zeros(L.B, 1, L.dv, dtype=L.dtype, device=o.device)
        _, cv, t, sc, kappa, lse = _empty_kept(L)
    else:
        mu, r2 = value_moments(L.values.to(L.dtype), pf.reshape(L.b, L.h_kv, L.n))
        mu = mu.reshape(L.B, 1, L.dv)
        _, cv, t, sc, kappa, lse = _kept_pass(L, lp, omp, pf, mu, r2.reshape(L.B, L.n))
    t_kept = _centred(t, cv, sc, o, mu)[:, 1]
    log_num, log_z = _log_variance(L, form, o, lse, kappa, t_kept)
    # no term at all (no kept token and an empty sketch): 0, the reference's convention, not exp(-inf + inf)
    variance = torch.where(log_num == float("-inf"), 0.0, torch.exp(log_num - 2.0 * log_z))
    return L.unrows(variance[..., None]).squeeze(-1)


def sketched_variance(cluster_var: torch.Tensor, ht_trace: torch.Tensor) -> torch.Tensor:
    r"""The variance a sketched design certifies with, elementwise: :math:`\max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})`.

    The sketch's model-based estimate of the design variance (:func:`cluster_variance`, which depends on
    the clusters k-means lands in) and the sample's own HT trace (``hajek_attention(...).trace`` over the
    kept tokens, which no clustering enters) share the kept tokens' part and differ in how they estimate
    the evicted tokens' part; the radius reads the larger (``kvcert.reference.sketch.sketched_variance``,
    docs/theory.md section 8). +inf stays +inf, NaN propagates (``torch.maximum``).
    """
    return torch.maximum(cluster_var, ht_trace.to(cluster_var.dtype))


def sketch_hajek_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor | None,
                            sketch: ClusterSketch, *, scale: float | None = None, delta: float = 0.05,
                            rule: str | None = None, multiplier: float | None = None,
                            log_pi: torch.Tensor | None = None, value_center: torch.Tensor | None = None,
                            value_sqdist: torch.Tensor | None = None, validate: bool = True,
                            trace: bool = True) -> ClusterEstimate:
    r"""The cluster design's decode step: Hajek output, HT trace, :math:`V_{\mathrm{cl}}` and its radius.

    .. math::

        s = \tau\, q K^\top - \log\pi,\quad a = \operatorname{softmax}(s),\quad c = (1-\pi) a^2,\quad
        c' = \pi c,\qquad [\hat o;\ \textstyle\sum c_i v_i;\ \sum c'_i v_i] = [a; c; c']\, V,

        \mathrm{trace} = \textstyle\sum_S c_i \lVert v_i - \hat o\rVert^2,\qquad
        \sum_{i\in S}\frac{1-\pi_i}{\pi_i} e^{2 s_i}\lVert v_i - \hat o\rVert^2
            = \hat Z^2 \textstyle\sum_S c'_i \lVert v_i - \hat o\rVert^2,\qquad
        \sum_{i\in S} e^{s_i} = \hat Z \textstyle\sum_S \pi_i a_i,

    (:math:`\hat Z` = e^lse; here :math:`s_i` in the sums is the raw score :math:`\tau q\cdot k_i`),
    the squared distances in the centred form around ``value_center``
    (:math:`\sum c_i r_i - 2(\hat o-\mu)\cdot(\sum c_i v_i - \mu\sum c_i) + \lVert\hat o-\mu\rVert^2\sum c_i`,
    :math:`r_i` = ``value_sqdist``), then :math:`V_{\mathrm{cl}}` as :func:`cluster_variance` with
    :math:`\hat o` as the plug-in, and the radius of :func:`cluster_radius`. K and V are read once
    (one score matmul, one [a; c; c'] x V matmul: one more row per query than the trace-only
    ``hajek_attention`` path); the sketch adds one (g t x 2d)(2d x 2C) matmul and O(C) work per
    query, with its per-step constants built at the first call and kept for the sketch. No causal
    mask: every query sees every kept token.

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d)
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), the kept tokens (padding: pi = 0)
    pi : (b, h_kv, n) in [0, 1], or None with ``log_pi`` (exactly one of the two)
    sketch : ClusterSketch of the evicted tokens, per KV head
    scale : float, default 1/sqrt(d)
    delta : float in (0, 1)
    rule : a name of :data:`RADIUS_RULES`, default the sketch's (its design's ``radius``)
    multiplier : float > 0, the ``fixed`` rule's c, default the sketch's
    log_pi : (b, h_kv, n), log pi instead of pi (-inf = padding), as the Hugging Face cache holds it
    value_center, value_sqdist : (b, h_kv, dv), (b, h_kv, n), optional
        :math:`\mu` and :math:`\lVert v_i - \mu\rVert^2` kept beside the cache
        (:func:`kvcert.fast.value_moments`); without them they are computed here (one more pass
        over V). Give both or neither. The hull bound reads the largest ``value_sqdist`` over all
        slots: ``value_moments`` puts 0 on padding; anything larger there only loosens the bound.
    validate : bool, default True
        Check pi / log_pi values and refuse a NaN output (host synchronisations); ``False`` for a
        caller that checked its inputs once.
    trace : bool, default True
        Report the HT trace as ``estimate.trace``. ``False``: ``estimate.trace`` is None (the
        Hugging Face path's decode, which records its own trace); the c rows are formed either way,
        since the variance is :func:`sketched_variance` of V_cl and the HT trace.

    Returns
    -------
    ClusterEstimate
        ``estimate`` as ``hajek_attention(..., per_coordinate=False)`` (output in the dtype of
        ``values``; trace and lse float32, float64 for float64 inputs), ``variance`` V_cl and
        ``radius``, (b, h_q[, t]). A query head whose KV head holds no kept token: output 0, lse
        -inf, trace, variance and radius +inf (the empty-sample convention of ``Estimate``).

    Raises
    ------
    TypeError / ValueError
        Bad shapes (naming the argument and the expected shape), a sketch of other heads, delta
        outside (0, 1), an unknown rule, a bad multiplier, pi outside [0, 1].

    Notes
    -----
    The kept sums use the centred form, so a kept token with :math:`v_i \approx \hat o` has its
    (small) term computed as a difference of :math:`O(\lVert v_i - \mu\rVert^2)` ones: an absolute
    error of about eps times :math:`\sum c_i(\lVert v_i-\mu\rVert + \lVert\hat o-\mu\rVert)^2`,
    as the cached trace of ``hajek_attention`` (tests/test_fast_sketch.py derives its float32
    tolerance from it). V_cl is a model-based estimate of the design variance, not a bound
    (docs/theory.md section 8): the reference's ``evict_and_certify(design="cluster")`` is the
    per-head composition this function batches for the decode step.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import ClusterDesign, sketch_hajek_attention, cluster_sketch, hajek_attention
    >>> g = torch.Generator().manual_seed(0)
    >>> k, v = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 4, generator=g)
    >>> pi = torch.full((1, 2, 40), 0.5)
    >>> keep = torch.arange(40) < 20                           # tokens 0..19 kept in both heads
    >>> keep = keep.expand(1, 2, 40)
    >>> sketch = cluster_sketch(k, v, pi, keep, ClusterDesign(clusters=4))
    >>> q = torch.randn(1, 6, 8, generator=g)                  # GQA: 3 query heads per KV head
    >>> ce = sketch_hajek_attention(q, k[:, :, :20], v[:, :, :20], pi[:, :, :20], sketch)
    >>> ce.variance.shape, ce.radius.shape, int(sketch.count.sum())
    (torch.Size([1, 6]), torch.Size([1, 6]), 40)
    >>> est = hajek_attention(q, k[:, :, :20], v[:, :, :20], pi[:, :, :20], per_coordinate=False)
    >>> bool(torch.allclose(ce.output, est.output, atol=1e-6))
    True
    """
    return sketch_step(q, keys, values, pi, sketch, scale=scale, delta=delta, rule=rule, multiplier=multiplier,
                        log_pi=log_pi, value_center=value_center, value_sqdist=value_sqdist, validate=validate,
                        kept_pass=_kept_pass, report_trace=trace)


def sketch_step(q, keys, values, pi, sketch, *, scale, delta, rule, multiplier, log_pi, value_center,
                 value_sqdist, validate, kept_pass, report_trace: bool = True) -> ClusterEstimate:
    """:func:`sketch_hajek_attention` with its one pass over K and V given: ``kept_pass(L, lp, omp, pf, mu, r2)``
    -> ``(o, cv, t, sc, kappa, lse)`` as :func:`_kept_pass` with the c rows of the HT trace (this module's torch
    pass, or the Triton kernel of ``kvcert.kernels.sketch_hajek_attention``). The checks, the value moments and the
    O(C d) epilogue are shared (the compiled CPU op computes all of it in C++:
    ``kvcert.kernels.cpu.sketch_hajek_attention``). The variance is :func:`sketched_variance` of V_cl and the HT
    trace; ``report_trace=False`` leaves ``estimate.trace`` None."""
    C = check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale)
    L = QueryLayout(C, q, keys, values)
    form = _decode_form(sketch, L)
    delta = check_delta(delta)
    rule = _check_rule(sketch.rule if rule is None else rule)
    multiplier = _check_multiplier(sketch.multiplier if multiplier is None else multiplier)
    if (value_center is None) != (value_sqdist is None):
        raise TypeError("give both value_center= and value_sqdist= (from value_moments), or neither")
    if validate:
        check_attention_values(C)
    probs = _probs(L, C)
    dt = L.dtype
    if L.n == 0:
        mu = torch.zeros(L.B, 1, L.dv, dtype=dt, device=L.q.device)
        o, cv, t, sc, kappa, lse = _empty_kept(L)
        both = _centred(t, cv, sc, o, mu)
    else:
        if value_center is None:
            mu, r2 = value_moments(L.values, probs[2].reshape(L.b, L.h_kv, L.n))
        else:
            mu, r2 = value_center, value_sqdist
            for name, x, shape, text in (("value_center", mu, (L.b, L.h_kv, L.dv), "(b, h_kv, dv)"),
                                         ("value_sqdist", r2, (L.b, L.h_kv, L.n), "(b, h_kv, n)")):
                check_tensor(name, x)
                if tuple(x.shape) != shape:
                    raise ValueError(f"{name} must have shape {text} = {shape}, got {tuple(x.shape)}")
        mu = cast_to(mu, dt).reshape(L.B, 1, L.dv)
        o, cv, t, sc, kappa, lse = kept_pass(L, *probs, mu, cast_to(r2, dt).reshape(L.B, L.n))
        both = _centred(t, cv, sc, o, mu)                      # (B, 2, G): trace, T'
    log_num, log_z = _log_variance(L, form, o, lse, kappa, both[:, 1])
    v_cl = torch.add(log_num, log_z, alpha=-2.0).exp_()
    # an empty row (nothing kept): trace, V_cl and the radius +inf, the Estimate convention
    empty = (lse == float("-inf")).unsqueeze_(1)
    stats = torch.stack((both[:, 0], v_cl), dim=1).masked_fill_(empty, float("inf"))
    trace, v_cl = stats[:, 0], stats[:, 1]
    variance = sketched_variance(v_cl, trace)
    if not report_trace:
        trace = None
    if validate and bool(torch.isnan(o).any()):
        raise ValueError("sketch_hajek_attention produced NaN: q, keys, values must be finite")
    unrow = lambda x: L.unrows(x[..., None]).squeeze(-1)  # noqa: E731
    est = Estimate(output=cast_to(L.unrows(o.contiguous()), values.dtype), weights=None, variance=None,
                   trace=None if trace is None else unrow(trace), lse=unrow(lse))
    variance = unrow(variance)
    radius = _radius(variance, delta, rule, multiplier, clamp=False)
    bound = None
    if form.reach is not None:  # the hull bound (reference.sketch.hull_bound); an empty row keeps +inf
        if L.n == 0:
            inside = torch.zeros(L.B, 1, dtype=dt, device=o.device)
        else:  # value_sqdist is 0 on padding (value_moments); other values there only loosen the bound
            inside = cast_to(r2, dt).reshape(L.B, L.n).amax(-1, keepdim=True).sqrt_()
            inside += torch.linalg.vector_norm(mu - form.mu, dim=-1)
        far = torch.maximum(form.reach, inside)                                            # (B, 1)
        bound = unrow(torch.linalg.vector_norm(o - form.mu, dim=-1).add_(far).masked_fill_(empty[:, 0], float("inf")))
        radius = torch.fmin(radius, bound.to(radius.dtype))                            # a NaN bound: no cap
    return ClusterEstimate(estimate=est, variance=variance, radius=radius, rule=rule, delta=delta, bound=bound,
                           cluster_variance=unrow(v_cl))
