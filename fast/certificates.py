"""Error certificates from a batched :class:`~kvcert.fast.types.Estimate`.

Same kinds and formulas as ``kvcert.reference.radius_from_moments``, applied
to every query head (and query) of a batch at once. Works on the estimates of
``kvcert.fast`` and ``kvcert.kernels`` alike: the kernels backend produces a
:class:`~kvcert.fast.types.Estimate` that :func:`certificate` consumes, so it
has no registry of its own.

Every kind is one entry of :data:`CERTIFICATE_KINDS` (a
:class:`CertificateKind`: the statistics it needs, its radius function, a
one-line formula); :func:`radius_from_moments`, :func:`certificate` and
:func:`estimate_options` dispatch through it, and :data:`KINDS` is its key
order. Adding a kind = one entry here, one in ``kvcert.reference``, and its
test (tests/test_certificate_registry.py iterates both registries).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from statistics import NormalDist
from types import MappingProxyType

import numpy as np
import torch
from scipy import special

from .types import Certificate, Estimate

__all__ = ["CERTIFICATE_KINDS", "CertificateKind", "KINDS", "NU_MIN", "PLAIN_KINDS", "SERVED_KINDS",
           "certificate", "certificate_moments",
           "estimate_options", "radius_from_moments", "radius_from_statistics"]

#: lower clip of the Satterthwaite degrees of freedom of ``chebyshev_ucb`` (nu >= 2 holds exactly)
NU_MIN = 2.0

#: the statistics a kind may need (fields of Estimate) -> the ``kvcert.fast.hajek_attention``
#: option that fills each one (all default off but ``per_coordinate``, which estimate_options sets)
_OPTIONS = {
    "variance": "per_coordinate",
    "covariance": "return_covariance",
    "max_term": "return_max_term",
    "tail_moment": "return_tail_moment",
}


def check_delta(delta) -> float:
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real):
        raise TypeError(f"delta must be a float, got {type(delta).__name__}")
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return delta


def _chi2_ppf(p: float, dof: torch.Tensor) -> torch.Tensor:
    """chi^2_{dof}(p) quantile, elementwise: 2 * gammaincinv(dof / 2, p) (SciPy, on CPU)."""
    h = dof.detach().to("cpu", torch.float64).numpy()
    q = 2.0 * special.gammaincinv(h / 2.0, p)
    return torch.from_numpy(np.asarray(q, dtype=np.float64)).to(dof.device)


def _ucb_radius(delta: float, trace: torch.Tensor, tail_moment: torch.Tensor) -> torch.Tensor:
    """sqrt(2 tr nu / (delta chi2_{nu; delta/2})), nu = max(2 tr^2 / s2, NU_MIN); batched, never NaN.

    Computed in float64 (tr^2 overflows float32 beyond 1.8e19); tr = 0 -> 0, tr or s2 = +inf -> +inf,
    s2 = 0 < tr -> nu = inf, i.e. sqrt(2 tr / delta).
    """
    tr = trace.detach().to(torch.float64)
    s2 = tail_moment.detach().to(device=tr.device, dtype=torch.float64)
    if bool((torch.isnan(tr) | torch.isnan(s2) | (s2 < 0)).any()):
        raise ValueError("trace must not be NaN and tail_moment must be >= 0 (found NaN or a negative value)")
    finite = torch.isfinite(tr) & torch.isfinite(s2)
    pos = finite & (tr > 0)
    tr_s = torch.where(pos, tr, 1.0)
    has_s2 = pos & (s2 > 0)
    nu = torch.where(has_s2, 2.0 * tr_s * tr_s / torch.where(has_s2, s2, 1.0), math.inf).clamp(min=NU_MIN)
    nu_f = torch.where(torch.isfinite(nu), nu, 1.0)  # nu = inf: the limit ratio 1, set below
    ratio = torch.where(torch.isfinite(nu), nu_f / _chi2_ppf(delta / 2.0, nu_f), 1.0)
    r = torch.sqrt(2.0 * tr_s * ratio / delta)
    r = torch.where(pos, r, torch.zeros_like(r))
    return torch.where(finite, r, torch.full_like(r, math.inf)).to(trace.dtype)


def _wald_radius(delta: float, trace: torch.Tensor, *, variance=None, **_) -> torch.Tensor:
    r""":math:`z_{1-\delta/2}\sqrt{\hat\sigma^2_d}` per coordinate, (..., dv)."""
    if variance is None:
        raise ValueError("the wald certificate needs the per-coordinate variance "
                         "(compute the estimate with per_coordinate=True)")
    z = NormalDist().inv_cdf(1.0 - delta / 2.0)
    return z * torch.sqrt(variance.clamp(min=0.0))


def _chebyshev_radius(delta: float, trace: torch.Tensor, **_) -> torch.Tensor:
    r""":math:`\sqrt{\mathrm{tr}\hat\Sigma/\delta}`."""
    return torch.sqrt(trace.clamp(min=0.0) / delta)


def _chi2_radius(delta: float, trace: torch.Tensor, *, sum_sq_eigenvalues=None, **_) -> torch.Tensor:
    r""":math:`\sqrt{g\,\chi^2_{h,1-\delta}}`, :math:`g = \sum\ell^2/\sum\ell`, :math:`h = (\sum\ell)^2/\sum\ell^2`.

    :math:`\sum\ell` = ``trace``, :math:`\sum\ell^2` = ``sum_sq_eigenvalues``; radius 0 where either
    is 0, +inf where either is not finite.
    """
    if sum_sq_eigenvalues is None:
        raise ValueError("the chi2 certificate needs sum l^2 = ||Sigma_hat||_F^2: compute the estimate "
                         "with hajek_attention(..., return_covariance=True)")
    s1 = trace.clamp(min=0.0)
    s2 = sum_sq_eigenvalues.clamp(min=0.0)
    pos = torch.isfinite(s1) & torch.isfinite(s2) & (s2 > 0) & (s1 > 0)
    g = torch.where(pos, s2 / torch.where(pos, s1, 1.0), 0.0)
    h = torch.where(pos, s1 * s1 / torch.where(pos, s2, 1.0), 1.0)
    q = _chi2_ppf(1.0 - delta, h).to(trace.dtype)
    r = torch.sqrt(g * q)
    return torch.where(torch.isfinite(s1) & torch.isfinite(s2), r, torch.full_like(r, math.inf))


def _bernstein_radius(delta: float, trace: torch.Tensor, *, max_term=None, **_) -> torch.Tensor:
    r""":math:`r = \tfrac{BL}{3} + \sqrt{(\tfrac{BL}{3})^2 + 2VL}`, :math:`L = \log(2/\delta)`.

    :math:`V = \mathrm{tr}\hat\Sigma` (``trace``), :math:`B` = ``max_term``; +inf where the trace is +inf.
    """
    if max_term is None:
        raise ValueError("the bernstein certificate needs max_term: compute the estimate with "
                         "kvcert.fast.hajek_attention(..., return_max_term=True)")
    L = math.log(2.0 / delta)
    b = max_term.to(trace.dtype) * (L / 3.0)
    r = b + torch.sqrt(b * b + 2.0 * trace.clamp(min=0.0) * L)
    return torch.where(torch.isfinite(trace), r, torch.full_like(r, math.inf))


def _chebyshev_ucb_radius(delta: float, trace: torch.Tensor, *, tail_moment=None, **_) -> torch.Tensor:
    r""":math:`r^2 = 2\,\mathrm{tr}\,\nu/(\delta\,\chi^2_{\nu;\delta/2})`, :math:`\nu = 2\,\mathrm{tr}^2/s_2`.

    :math:`s_2` = ``tail_moment`` (same shape as ``trace``); :math:`\nu` clipped at ``NU_MIN``;
    see :func:`_ucb_radius` for the edge cases.
    """
    if tail_moment is None:
        raise ValueError("the chebyshev_ucb certificate needs tail_moment: compute the estimate with "
                         "hajek_attention(..., return_tail_moment=True)")
    if not isinstance(tail_moment, torch.Tensor):
        raise TypeError(f"tail_moment must be a torch.Tensor, got {type(tail_moment).__name__}")
    if tail_moment.shape != trace.shape:
        raise ValueError(f"tail_moment must have the shape of trace {tuple(trace.shape)}, "
                         f"got {tuple(tail_moment.shape)}")
    return _ucb_radius(delta, trace, tail_moment)


#: the calibrated multiplier of ``tilted_hull`` (``kvcert.reference.certificates.TILTED_HULL_MULTIPLIER``)
TILTED_HULL_MULTIPLIER = 3.0


def _tilted_hull_radius(delta: float, trace: torch.Tensor, *, bound=None, **_) -> torch.Tensor:
    r""":math:`\min(c\sqrt V, H)`, :math:`c` = ``TILTED_HULL_MULTIPLIER``, :math:`V` = ``trace``, :math:`H` = ``bound``.

    ``bound`` (same shape as ``trace``): a deterministic bound on the error, the cluster sketch's hull bound
    (``ClusterEstimate.bound``); None: no cap, as for an estimate without a sketch.
    """
    r = TILTED_HULL_MULTIPLIER * trace.clamp(min=0.0).sqrt()
    if bound is None:
        return r
    if not isinstance(bound, torch.Tensor):
        raise TypeError(f"bound must be a torch.Tensor, got {type(bound).__name__}")
    if bound.shape != trace.shape:
        raise ValueError(f"bound must have the shape of trace {tuple(trace.shape)}, got {tuple(bound.shape)}")
    return torch.minimum(r, bound.to(r.dtype))


def _sum_sq_eigenvalues(estimate: Estimate, dt: torch.dtype) -> dict:
    """sum l^2 = ||Sigma_hat||_F^2 from the covariance (+inf where it is not finite; None without it)."""
    if estimate.covariance is None:
        return {"sum_sq_eigenvalues": None}
    cov = estimate.covariance.to(dt)
    s2 = cov.square().sum((-1, -2))
    s2 = torch.where(torch.isfinite(cov).all(-1).all(-1), s2, torch.full_like(s2, math.inf))
    return {"sum_sq_eigenvalues": s2}


#: statistic (a field of Estimate) -> the keywords of :func:`radius_from_moments` computed from it,
#: in the dtype ``dt`` of the trace; the same keys as ``_OPTIONS``
_MOMENTS = {
    "variance": lambda est, dt: {"variance": None if est.variance is None else est.variance.to(dt)},
    "covariance": _sum_sq_eigenvalues,
    "max_term": lambda est, dt: {"max_term": est.max_term},
    "tail_moment": lambda est, dt: {"tail_moment": est.tail_moment},
}


@dataclass(frozen=True)
class CertificateKind:
    r"""One certificate kind of the batched backend: what it needs and how it turns it into a radius.

    Attributes
    ----------
    name : str
        The ``kind`` argument of :func:`certificate` and :func:`radius_from_moments`.
    needs : tuple of str
        The :class:`~kvcert.fast.types.Estimate` fields the certificate reads
        besides ``output`` and ``trace`` (``"variance"``, ``"covariance"``,
        ``"max_term"``, ``"tail_moment"``); :func:`estimate_options` turns them
        into the ``kvcert.fast.hajek_attention`` options that fill them.
    radius : callable
        ``radius(delta, trace, **moments) -> tensor`` with ``moments`` the
        keywords of :func:`radius_from_moments` (each function reads the ones
        it needs and raises ``ValueError`` naming the missing option when one
        is None). ``delta`` must already be checked to lie in (0, 1): call it
        through :func:`radius_from_moments`.
    per_coordinate : bool
        True when the radius is per output coordinate, shape (..., dv)
        (``wald``); otherwise it bounds :math:`\lVert\hat o - o\rVert_2`,
        shape (...,).
    summary : str
        The formula in one line, for CLI help and docs.
    served : bool
        True when a paged serving engine can report it per decode step
        (``kvcert.vllm``): a norm bound whose statistics the block estimator
        gives in its one pass over the kept blocks. ``wald`` (per coordinate)
        and ``chebyshev_ucb`` (strict, a second pass) are not served.
    sketch : bool
        True for the radius of a sketched design (``tilted_hull``): calibrated on a sketch's hybrid variance
        and capped at its hull bound, not on a plain estimate's trace (:data:`PLAIN_KINDS` are the others).
    """

    name: str
    needs: tuple[str, ...]
    radius: Callable[..., torch.Tensor]
    per_coordinate: bool
    summary: str
    served: bool = False
    sketch: bool = False

    def __post_init__(self):
        unknown = [s for s in self.needs if s not in _OPTIONS or s not in _MOMENTS]
        if unknown:
            raise ValueError(f"CertificateKind {self.name!r}: unknown statistics {unknown}; "
                             f"known: {tuple(_OPTIONS)}")


def _registry(*kinds: CertificateKind) -> MappingProxyType:
    return MappingProxyType({k.name: k for k in kinds})


#: name -> :class:`CertificateKind`, read-only; the norm kinds bound ||o_hat - o||_2, ``wald`` bounds
#: each coordinate; same names, order, needs and summaries as ``kvcert.reference.CERTIFICATE_KINDS``
CERTIFICATE_KINDS = _registry(
    CertificateKind(
        name="wald", needs=("variance",), radius=_wald_radius, per_coordinate=True,
        summary="per coordinate |o_hat_d - o_d| <= z_{1-delta/2} sqrt(variance_d)"),
    CertificateKind(
        name="chebyshev", needs=(), radius=_chebyshev_radius, per_coordinate=False,
        summary="||o_hat - o||_2 <= sqrt(trace / delta)", served=True),
    CertificateKind(
        name="chi2", needs=("covariance",), radius=_chi2_radius, per_coordinate=False,
        summary="||o_hat - o||_2^2 <= g chi2_{h, 1-delta}, g = sum l^2 / sum l, h = (sum l)^2 / sum l^2 "
                "over the eigenvalues l of Sigma_hat", served=True),
    CertificateKind(
        name="bernstein", needs=("max_term",), radius=_bernstein_radius, per_coordinate=False,
        summary="||o_hat - o||_2 <= B L / 3 + sqrt((B L / 3)^2 + 2 trace L), L = log(2 / delta), B = max_term",
        served=True),
    CertificateKind(
        name="tilted_hull", needs=(), radius=_tilted_hull_radius, per_coordinate=False,
        summary="||o_hat - o||_2 <= min(3 sqrt(trace), H): trace = the tilted sketch's V_cl, H = the hull bound "
                "(3 calibrated at delta = 0.05)", sketch=True),
    CertificateKind(
        name="chebyshev_ucb", needs=("tail_moment",), radius=_chebyshev_ucb_radius, per_coordinate=False,
        summary="||o_hat - o||_2^2 <= 2 trace nu / (delta chi2_{nu; delta/2}), "
                "nu = max(2 trace^2 / tail_moment, 2)"),
)

#: certificate kinds, in registry order (that of ``kvcert.reference.KINDS``); the strict opt-in
#: ``chebyshev_ucb`` needs ``hajek_attention(..., return_tail_moment=True)``
KINDS = tuple(CERTIFICATE_KINDS)

#: the kinds a paged serving engine reports (``CertificateKind.served``), in registry order
SERVED_KINDS = tuple(name for name, spec in CERTIFICATE_KINDS.items() if spec.served)
#: the kinds of a plain estimate (every kind but the sketched designs' radii, ``CertificateKind.sketch``)
PLAIN_KINDS = tuple(name for name, spec in CERTIFICATE_KINDS.items() if not spec.sketch)


def _kind(kind) -> CertificateKind:
    """The registry entry of ``kind``; ValueError listing KINDS if there is none."""
    if not isinstance(kind, str) or kind not in CERTIFICATE_KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return CERTIFICATE_KINDS[kind]


def estimate_options(kinds: str | Iterable[str]) -> dict:
    r"""The ``kvcert.fast.hajek_attention`` options that make an estimate carry what ``kinds`` need.

    Parameters
    ----------
    kinds : str or iterable of str
        One kind, or several (the union of their needs: one estimate serves
        every certificate of the list).

    Returns
    -------
    dict
        ``{"per_coordinate": bool, **{option: True}}``: ``per_coordinate`` is
        True only when a kind needs the per-coordinate ``variance`` (``wald``);
        each other needed statistic adds its ``return_*`` option
        (``chi2`` -> ``return_covariance``, ``bernstein`` -> ``return_max_term``,
        ``chebyshev_ucb`` -> ``return_tail_moment``).

    Raises
    ------
    ValueError
        An unknown kind (the message lists :data:`KINDS`).

    Examples
    --------
    >>> from kvcert.fast import estimate_options
    >>> estimate_options("chi2")
    {'per_coordinate': False, 'return_covariance': True}
    >>> estimate_options(["wald", "chebyshev_ucb"])
    {'per_coordinate': True, 'return_tail_moment': True}
    """
    names = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    needs = [s for name in names for s in _kind(name).needs]
    options = {"per_coordinate": False}
    for stat, option in _OPTIONS.items():  # in _OPTIONS order, whatever the order of kinds
        if stat in needs:
            options[option] = True
    return options


def radius_from_moments(kind: str, delta: float, *, trace: torch.Tensor, variance: torch.Tensor | None = None,
                        sum_sq_eigenvalues: torch.Tensor | None = None,
                        max_term: torch.Tensor | None = None,
                        tail_moment: torch.Tensor | None = None, bound: torch.Tensor | None = None) -> torch.Tensor:
    r"""Certificate radius from the variance summaries, batched.

    - ``wald``: :math:`z_{1-\delta/2}\sqrt{\hat\sigma^2_d}` per coordinate.
    - ``chebyshev``: :math:`\sqrt{\mathrm{tr}\hat\Sigma/\delta}`.
    - ``chi2``: :math:`\sqrt{g\,\chi^2_{h,1-\delta}}`, Satterthwaite
      :math:`g = \sum\ell^2/\sum\ell`, :math:`h = (\sum\ell)^2/\sum\ell^2`
      with :math:`\sum\ell = \mathrm{tr}\hat\Sigma` and
      :math:`\sum\ell^2 = \lVert\hat\Sigma\rVert_F^2` (``sum_sq_eigenvalues``):
      the eigenvalue moments need no eigendecomposition.
    - ``bernstein``: :math:`r = \tfrac{BL}{3} + \sqrt{(\tfrac{BL}{3})^2 + 2VL}`,
      :math:`L = \log(2/\delta)`, :math:`V = \mathrm{tr}\hat\Sigma`,
      :math:`B` = ``max_term`` (Pinelis 1994 with plug-ins; empirical Bernstein).
    - ``chebyshev_ucb`` (strict, opt-in): :math:`r^2 = 2\,\mathrm{tr}\,\nu /
      (\delta\,\chi^2_{\nu;\delta/2})` with Satterthwaite's
      :math:`\nu = 2\,\mathrm{tr}^2/s_2`,
      :math:`s_2 = \sum_S (1-\pi_i) x_i^2` (``tail_moment``),
      :math:`x_i = (1-\pi_i) a_i^2 \lVert v_i - \hat o\rVert^2`: a chi-square
      upper confidence bound on the design variance at :math:`\delta/2`,
      then Markov at :math:`\delta/2`. Approximate (the chi-square model of
      the trace), not a finite-sample guarantee. :math:`\nu \ge 2` exactly
      (clipped at ``NU_MIN`` against rounding); :math:`s_2 = 0 <
      \mathrm{tr}` gives the limit :math:`\sqrt{2\,\mathrm{tr}/\delta}`.
      The quantile :math:`\chi^2_{\nu;p} = 2\,\mathrm{gammaincinv}(\nu/2, p)`
      runs in SciPy on the CPU (one host transfer per call), in float64.
    - ``tilted_hull`` (the recommended design's rule): :math:`\min(3\sqrt V, H)`,
      :math:`V` = ``trace`` the tilted cluster sketch's variance, :math:`H` =
      ``bound`` its hull bound (None: no cap); the multiplier 3 is calibrated
      at :math:`\delta = 0.05` and does not scale with ``delta``
      (``kvcert.reference.radius_from_moments`` has the full account).

    Parameters
    ----------
    kind : str
        A key of :data:`CERTIFICATE_KINDS` (one of :data:`KINDS`).
    delta : float in (0, 1)
    trace : (...,) tensor
    variance : (..., dv) tensor, for ``wald``
    sum_sq_eigenvalues : (...,) tensor, for ``chi2``
    max_term : (...,) tensor, for ``bernstein``
    tail_moment : (...,) tensor, for ``chebyshev_ucb``
    bound : (...,) tensor, optional, for ``tilted_hull``

    Returns
    -------
    radius : (..., dv) for ``wald``, (...,) otherwise; +inf where trace is +inf.
    """
    delta = check_delta(delta)
    if not isinstance(trace, torch.Tensor):
        raise TypeError(f"trace must be a torch.Tensor, got {type(trace).__name__}")
    return _kind(kind).radius(delta, trace, variance=variance, sum_sq_eigenvalues=sum_sq_eigenvalues,
                              max_term=max_term, tail_moment=tail_moment, bound=bound)


def certificate(estimate: Estimate, *, delta: float = 0.05, kind: str = "chebyshev") -> Certificate:
    r"""Confidence regions for the true attention outputs of a batched estimate.

    Norm kinds bound :math:`\lVert\hat o - o\rVert_2 \le r` per query head;
    ``wald`` gives per-coordinate half-widths
    :math:`z_{1-\delta/2}\sqrt{\hat\sigma^2_d}`. Formulas in
    :func:`radius_from_moments` (identical to the reference's).

    Parameters
    ----------
    estimate : Estimate
        From ``kvcert.fast.hajek_attention`` (or ``kvcert.kernels``).
        ``wald`` needs ``variance`` (per_coordinate=True), ``chi2`` needs
        ``covariance`` (return_covariance=True), ``bernstein`` needs
        ``max_term`` (return_max_term=True), ``chebyshev_ucb`` needs
        ``tail_moment`` (return_tail_moment=True):
        ``hajek_attention(..., **estimate_options(kind))`` fills what
        ``CERTIFICATE_KINDS[kind].needs``.
    delta : float in (0, 1)
        Nominal miscoverage.
    kind : str
        A key of :data:`CERTIFICATE_KINDS` (one of :data:`KINDS`).

    Returns
    -------
    Certificate
        radius (...,) ((..., dv) for wald), relative_radius (...,) =
        ||radius|| / ||o_hat|| (0 if radius = 0, inf if o_hat = 0 < radius),
        lower/upper (..., dv) = o_hat -/+ radius, in the statistics' dtype.

    Notes
    -----
    An empty sample (trace +inf) gives an infinite radius; every pi = 1
    gives radius 0 for every kind.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import hajek_attention, certificate
    >>> q, k, v = torch.randn(1, 2, 8), torch.randn(1, 1, 30, 8), torch.randn(1, 1, 30, 4)
    >>> est = hajek_attention(q, k, v, torch.full((1, 1, 30), 0.5), per_coordinate=False)
    >>> cert = certificate(est, delta=0.05, kind="chebyshev")
    >>> bool(torch.allclose(cert.radius, (est.trace / 0.05).sqrt()))
    True
    >>> est = hajek_attention(q, k, v, torch.full((1, 1, 30), 0.5), per_coordinate=False,
    ...                       return_tail_moment=True)
    >>> strict = certificate(est, delta=0.05, kind="chebyshev_ucb")  # > sqrt(2) x chebyshev
    >>> bool((strict.radius > 2 ** 0.5 * certificate(est, delta=0.05).radius).all())
    True
    """
    if not isinstance(estimate, Estimate):
        raise TypeError(f"estimate must be a kvcert.fast.types.Estimate, got {type(estimate).__name__}")
    spec = _kind(kind)
    delta = check_delta(delta)
    trace = estimate.trace
    dt = trace.dtype if trace.is_floating_point() else torch.float32
    o = estimate.output.to(dt)
    stats = certificate_moments(estimate, kind)
    radius, _, rel = radius_from_statistics(kind, delta, **stats)
    half = radius if spec.per_coordinate else radius.unsqueeze(-1)
    return Certificate(kind=kind, delta=delta, radius=radius, relative_radius=rel, lower=o - half, upper=o + half)


def certificate_moments(estimate: Estimate, kind: str = "chebyshev") -> dict:
    r"""The per-head statistics a certificate of ``kind`` is computed from, taken off an estimate.

    ``{"trace": tr, "output_norm": ||o_hat||_2, **moments}``, with ``moments``
    the keywords of :func:`radius_from_moments` that ``kind`` reads
    (``sum_sq_eigenvalues`` for chi2 is reduced from the covariance here), all
    in the trace's dtype and of the estimate's leading shape ((..., dv) for
    wald's ``variance``). Small enough to keep per decoding step and layer
    (the Hugging Face recorder does) and turn into radii later, in one batch,
    with :func:`radius_from_statistics`: the certificate is the same either way.
    """
    spec = _kind(kind)
    trace, output = estimate.trace, estimate.output
    dt = trace.dtype if trace.is_floating_point() else torch.float32
    if trace.dtype != dt:
        trace = trace.to(dt)
    if output.dtype != dt:
        output = output.to(dt)
    stats = {"trace": trace, "output_norm": torch.linalg.vector_norm(output, dim=-1)}
    for stat in spec.needs:
        stats.update(_MOMENTS[stat](estimate, dt))
    return stats


def radius_from_statistics(kind: str, delta: float, *, trace: torch.Tensor, output_norm: torch.Tensor,
                           **moments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Radius, its norm and the relative radius from :func:`certificate_moments`' statistics, batched.

    .. math:: r_{\mathrm{rel}} = \lVert r\rVert_2 / \lVert\hat o\rVert_2
              \quad (0 \text{ if } r = 0, \ +\infty \text{ if } \hat o = 0 < r),

    with :math:`r` from :func:`radius_from_moments` (per coordinate for wald,
    whose norm is taken; the norm kinds' radius is its own norm).

    Returns
    -------
    (radius, norm_radius, relative_radius)
    """
    delta = check_delta(delta)
    spec = _kind(kind)
    radius = spec.radius(delta, trace, **moments)
    norm_r = torch.linalg.vector_norm(radius, dim=-1) if spec.per_coordinate else radius
    norm_o = output_norm.to(norm_r.dtype)
    rel = torch.where(norm_r == 0, torch.zeros_like(norm_r),
                      torch.where(norm_o == 0, torch.full_like(norm_r, math.inf), norm_r / norm_o))
    return radius, norm_r, rel
