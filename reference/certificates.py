"""Error certificates built from an :class:`Estimate`.

Each kind turns the design-variance estimate of the Hajek output into a
radius at level 1 - delta. What each assumes is stated in its docstring and in
docs/theory.md; none is a finite-sample guarantee for every population, since
all of them plug in a variance estimated from the sample (see the unseen-mass
discussion in docs/theory.md).

Every kind is one entry of :data:`CERTIFICATE_KINDS` (a
:class:`CertificateKind`: the estimate's statistics it needs, its radius
function, a one-line formula); :func:`radius_from_moments` and
:func:`certificate` dispatch through it, and :data:`KINDS` is its key order.
Adding a kind = one entry here, one in ``kvcert.fast``, and its test
(tests/test_certificate_registry.py iterates both registries).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
from scipy import stats

from .estimators import Estimate

__all__ = ["CERTIFICATE_KINDS", "Certificate", "CertificateKind", "KINDS", "NU_MIN", "TILTED_HULL_MULTIPLIER",
           "certificate", "covers", "radius_from_moments"]

#: lower end of the Satterthwaite degrees of freedom of ``chebyshev_ucb``: nu = 2 tr^2 / s2 >= 2
#: holds exactly for every estimate (s2 <= tr^2), so the clip only absorbs rounding
NU_MIN = 2.0


@dataclass(frozen=True)
class Certificate:
    """A confidence region for the true attention output o.

    Attributes
    ----------
    kind : str
    delta : float
        Nominal miscoverage: the region holds o with probability about 1 - delta.
    radius : float or ndarray
        For the norm kinds a bound on ||o_hat - o||_2; for ``wald`` the (dv,)
        per-coordinate half-widths.
    relative_radius : float
        ||radius||_2 / ||o_hat||_2 (inf if o_hat = 0 < radius, 0 if both are 0).
    lower, upper : ndarray, shape (dv,)
        The per-coordinate box o_hat -/+ radius.
    """

    kind: str
    delta: float
    radius: float | np.ndarray
    relative_radius: float
    lower: np.ndarray
    upper: np.ndarray


def check_delta(delta) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return delta


def _ucb_ratio(nu: float, delta: float) -> float:
    """nu / chi2_{nu; delta/2}: the factor by which the chi-square UCB inflates the trace (1 at nu = inf)."""
    if nu == np.inf:
        return 1.0
    return float(nu / stats.chi2.ppf(delta / 2.0, nu))


def _wald_radius(delta: float, trace: float, *, variance=None, **_) -> np.ndarray:
    r""":math:`z_{1-\delta/2}\sqrt{\hat\sigma^2_d}` per coordinate, shape (dv,)."""
    if variance is None:
        raise ValueError("the wald certificate needs the per-coordinate variance "
                         "(compute the estimate with per_coordinate=True)")
    return stats.norm.ppf(1.0 - delta / 2.0) * np.sqrt(np.maximum(np.asarray(variance, float), 0.0))


def _chebyshev_radius(delta: float, trace: float, **_) -> float:
    r""":math:`\sqrt{\mathrm{tr}\hat\Sigma/\delta}` (Markov on :math:`\lVert\hat o - o\rVert^2`)."""
    return float(np.sqrt(max(trace, 0.0) / delta))


def _chi2_radius(delta: float, trace: float, *, eigenvalues=None, **_) -> float:
    r""":math:`\sqrt{g\,\chi^2_{h,1-\delta}}`, :math:`g = \sum\ell^2/\sum\ell`, :math:`h = (\sum\ell)^2/\sum\ell^2`.

    :math:`\ell` = ``eigenvalues`` of :math:`\hat\Sigma` (negatives clipped to 0); +inf if
    :math:`\sum\ell` is not finite, 0 if :math:`\sum\ell^2 = 0`.
    """
    if eigenvalues is None:
        raise ValueError("the chi2 certificate needs the eigenvalues of the covariance")
    lam = np.clip(np.asarray(eigenvalues, float), 0.0, None)
    s1, s2 = lam.sum(), (lam * lam).sum()
    if not np.isfinite(s1):
        return np.inf
    if s2 <= 0:
        return 0.0
    g, h = s2 / s1, s1 * s1 / s2
    return float(np.sqrt(g * stats.chi2.ppf(1.0 - delta, h)))


def _bernstein_radius(delta: float, trace: float, *, max_term: float = 0.0, **_) -> float:
    r""":math:`r = \tfrac{BL}{3} + \sqrt{(\tfrac{BL}{3})^2 + 2VL}`, :math:`L = \log(2/\delta)`.

    :math:`V = \mathrm{tr}\hat\Sigma` (``trace``), :math:`B` = ``max_term``; +inf if the trace is not finite.
    """
    if not np.isfinite(trace):
        return np.inf
    L = np.log(2.0 / delta)
    b = float(max_term) * L / 3.0
    return float(b + np.sqrt(b * b + 2.0 * max(trace, 0.0) * L))


def _chebyshev_ucb_radius(delta: float, trace: float, *, tail_moment: float | None = None, **_) -> float:
    r""":math:`r^2 = 2\,\mathrm{tr}\,\nu/(\delta\,\chi^2_{\nu;\delta/2})`, :math:`\nu = \max(2\,\mathrm{tr}^2/s_2, 2)`.

    :math:`s_2` = ``tail_moment``; :math:`s_2 = 0 < \mathrm{tr}` gives :math:`\nu = \infty`, i.e.
    :math:`\sqrt{2\,\mathrm{tr}/\delta}`; tr = 0 gives 0; tr or :math:`s_2` = +inf gives +inf.
    """
    if tail_moment is None:
        raise ValueError("the chebyshev_ucb certificate needs tail_moment = sum_S (1 - pi) x_i^2 "
                         "(an Estimate from kvcert.reference.hajek_attention has it)")
    s2 = float(tail_moment)
    if np.isnan(trace) or np.isnan(s2) or s2 < 0.0:
        raise ValueError(f"trace must not be NaN and tail_moment must be >= 0, got {trace} and {s2}")
    if trace == np.inf or s2 == np.inf:
        return np.inf
    if trace <= 0.0:
        return 0.0
    nu = np.inf if s2 <= 0.0 else max(2.0 * trace * trace / s2, NU_MIN)
    return float(np.sqrt(2.0 * trace * _ucb_ratio(nu, delta) / delta))


#: the calibrated multiplier of ``tilted_hull``: c in c sqrt(V), picked on the real model's replay cells at
#: delta = 0.05 and checked on a held-out split (docs/theory.md section 8); it does not scale with delta
TILTED_HULL_MULTIPLIER = 3.0


def _tilted_hull_radius(delta: float, trace: float, *, bound: float | None = None, **_) -> float:
    r""":math:`\min(c\sqrt V, H)`, :math:`c` = ``TILTED_HULL_MULTIPLIER``, :math:`V` = ``trace``, :math:`H` = ``bound``.

    ``bound`` is the deterministic hull bound of ``kvcert.reference.sketch.hull_bound`` (None: no cap,
    as for an estimate without a sketch); +inf if the trace is not finite and no bound is given.
    """
    r = float(TILTED_HULL_MULTIPLIER * np.sqrt(max(trace, 0.0)))
    return r if bound is None else min(r, float(bound))


def _eigenvalues(estimate: Estimate) -> dict:
    """The eigenvalues of Sigma_hat (one +inf when it is not finite)."""
    cov = estimate.covariance
    return {"eigenvalues": np.full(1, np.inf) if not np.all(np.isfinite(cov)) else np.linalg.eigvalsh(cov)}


#: statistic (a field of Estimate) -> the keywords of :func:`radius_from_moments` computed from it
_MOMENTS = {
    "variance": lambda est: {"variance": est.variance},
    "covariance": _eigenvalues,
    "max_term": lambda est: {"max_term": est.max_term},
    "tail_moment": lambda est: {"tail_moment": est.tail_moment},
}


@dataclass(frozen=True)
class CertificateKind:
    r"""One certificate kind: what it needs from an :class:`Estimate` and how it makes a radius.

    Attributes
    ----------
    name : str
        The ``kind`` argument of :func:`certificate` and :func:`radius_from_moments`.
    needs : tuple of str
        The :class:`Estimate` fields the certificate reads besides ``output``
        and ``trace`` (``"variance"``, ``"covariance"``, ``"max_term"``,
        ``"tail_moment"``). :func:`kvcert.reference.hajek_attention` always
        fills all of them; ``kvcert.fast.estimate_options`` says how to ask
        the batched backend for them.
    radius : callable
        ``radius(delta, trace, **moments)`` with ``trace`` a float and
        ``moments`` the keywords of :func:`radius_from_moments` (each function
        reads the ones it needs). ``delta`` must already be checked to lie in
        (0, 1): call it through :func:`radius_from_moments`.
    per_coordinate : bool
        True when the radius is a (dv,) array of per-coordinate half-widths
        (``wald``); otherwise a float bound on :math:`\lVert\hat o - o\rVert_2`.
    summary : str
        The formula in one line, for CLI help and docs.
    """

    name: str
    needs: tuple[str, ...]
    radius: Callable[..., float | np.ndarray]
    per_coordinate: bool
    summary: str

    def __post_init__(self):
        unknown = [s for s in self.needs if s not in _MOMENTS]
        if unknown:
            raise ValueError(f"CertificateKind {self.name!r}: unknown statistics {unknown}; "
                             f"known: {tuple(_MOMENTS)}")


def _registry(*kinds: CertificateKind) -> MappingProxyType:
    return MappingProxyType({k.name: k for k in kinds})


#: name -> :class:`CertificateKind`, read-only; the norm kinds bound ||o_hat - o||_2, ``wald`` bounds
#: each coordinate
CERTIFICATE_KINDS = _registry(
    CertificateKind(
        name="wald", needs=("variance",), radius=_wald_radius, per_coordinate=True,
        summary="per coordinate |o_hat_d - o_d| <= z_{1-delta/2} sqrt(variance_d)"),
    CertificateKind(
        name="chebyshev", needs=(), radius=_chebyshev_radius, per_coordinate=False,
        summary="||o_hat - o||_2 <= sqrt(trace / delta)"),
    CertificateKind(
        name="chi2", needs=("covariance",), radius=_chi2_radius, per_coordinate=False,
        summary="||o_hat - o||_2^2 <= g chi2_{h, 1-delta}, g = sum l^2 / sum l, h = (sum l)^2 / sum l^2 "
                "over the eigenvalues l of Sigma_hat"),
    CertificateKind(
        name="bernstein", needs=("max_term",), radius=_bernstein_radius, per_coordinate=False,
        summary="||o_hat - o||_2 <= B L / 3 + sqrt((B L / 3)^2 + 2 trace L), L = log(2 / delta), B = max_term"),
    CertificateKind(
        name="tilted_hull", needs=(), radius=_tilted_hull_radius, per_coordinate=False,
        summary="||o_hat - o||_2 <= min(3 sqrt(trace), H): trace = the tilted sketch's V_cl, H = the hull bound "
                "(3 calibrated at delta = 0.05)"),
    CertificateKind(
        name="chebyshev_ucb", needs=("tail_moment",), radius=_chebyshev_ucb_radius, per_coordinate=False,
        summary="||o_hat - o||_2^2 <= 2 trace nu / (delta chi2_{nu; delta/2}), "
                "nu = max(2 trace^2 / tail_moment, 2)"),
)

#: certificate kinds, in registry order; the norm kinds bound ||o_hat - o||_2, ``wald`` bounds each coordinate
KINDS = tuple(CERTIFICATE_KINDS)


def _kind(kind) -> CertificateKind:
    """The registry entry of ``kind``; ValueError listing KINDS if there is none."""
    if not isinstance(kind, str) or kind not in CERTIFICATE_KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return CERTIFICATE_KINDS[kind]


def radius_from_moments(kind: str, delta: float, *, trace: float, variance=None, eigenvalues=None,
                        max_term: float = 0.0, tail_moment: float | None = None, bound: float | None = None):
    r"""Certificate radius from the variance summaries (shared by all kinds).

    - ``wald``: :math:`z_{1-\delta/2}\sqrt{\hat\sigma^2_d}` per coordinate
      (asymptotic normality of each coordinate of the linearized sum).
    - ``chebyshev``: :math:`\sqrt{\mathrm{tr}\hat\Sigma/\delta}`, from Markov's
      inequality on :math:`\lVert\hat o - o\rVert^2` with
      :math:`E\lVert\hat o - o\rVert^2 \approx \mathrm{tr}\,\Sigma`
      (needs only the linearization and a good variance estimate).
    - ``chi2``: :math:`\sqrt{g\,\chi^2_{h,1-\delta}}` with Satterthwaite's
      :math:`g = \sum\ell^2/\sum\ell`, :math:`h = (\sum\ell)^2/\sum\ell^2` from
      the eigenvalues :math:`\ell` of :math:`\hat\Sigma`: matches the first two
      moments of :math:`\lVert\hat o - o\rVert^2` under a Gaussian limit.
    - ``bernstein``: :math:`r = \tfrac{BL}{3} + \sqrt{(\tfrac{BL}{3})^2 + 2VL}`,
      :math:`L = \log(2/\delta)`, solving Pinelis' (1994) Hilbert-space
      Bernstein bound :math:`P(\lVert\sum Y_i\rVert \ge r) \le
      2\exp(-r^2/(2V + 2Br/3))` for independent zero-mean summands with
      :math:`\lVert Y_i\rVert \le B`, :math:`\sum E\lVert Y_i\rVert^2 \le V`,
      with the plug-ins :math:`V = \mathrm{tr}\hat\Sigma` and
      :math:`B =` ``max_term`` (an empirical-Bernstein radius: both are
      estimated from the sample, so it is not a guarantee).
    - ``chebyshev_ucb`` (strict, opt-in):

      .. math::

          r^2 = \frac{2\,\mathrm{tr}\,\nu}{\delta\,\chi^2_{\nu;\,\delta/2}}, \qquad
          \nu = \frac{2\,\mathrm{tr}^2}{s_2}, \qquad
          s_2 = \sum_{i\in S} (1-\pi_i)\, x_i^2, \quad
          x_i = (1-\pi_i)\, a_i^2 \lVert v_i - \hat o\rVert^2

      (``tail_moment`` = :math:`s_2`, the HT estimate of the design variance
      of the trace estimator itself). Satterthwaite's approximation
      :math:`\mathrm{tr} \sim V\chi^2_\nu/\nu` gives the upper confidence
      bound :math:`V_U = \mathrm{tr}\,\nu/\chi^2_{\nu;\delta/2}` on
      :math:`V = E\lVert\hat o - o\rVert^2` at level :math:`\delta/2`; Markov
      at :math:`\delta/2` then gives
      :math:`P(\lVert\hat o - o\rVert^2 > V_U/(\delta/2)) \le \delta/2 + \delta/2`
      (union bound). The chi-square model of the trace is an approximation,
      so this is not a finite-sample guarantee either: its coverage is
      measured (docs/theory.md, paper_repro). Since :math:`s_2 \le
      \mathrm{tr}^2`, :math:`\nu \ge 2` (clipped at ``NU_MIN`` = 2 against
      rounding); the radius decreases in :math:`\nu`, from
      :math:`\sqrt{4\,\mathrm{tr}/(\delta\chi^2_{2;\delta/2})}` at
      :math:`\nu = 2` to :math:`\sqrt{2\,\mathrm{tr}/\delta}` as
      :math:`\nu\to\infty` (used when :math:`s_2 = 0`), so it is always
      more than :math:`\sqrt 2` times the ``chebyshev`` radius. tr = 0 gives
      0, tr = +inf (empty sample) or :math:`s_2` = +inf gives +inf.
    - ``tilted_hull`` (the recommended design's rule, ``evict_and_certify(design=None)``):
      :math:`\min(c\sqrt V, H)` with :math:`V` = ``trace`` the tilted cluster
      sketch's variance :math:`V_{\mathrm{cl}}` (``kvcert.reference.sketch.cluster_variance``),
      :math:`H` = ``bound`` the hull bound (``hull_bound``; None: no cap) and
      :math:`c` = ``TILTED_HULL_MULTIPLIER`` = 3. The cap is proven (it holds on
      every draw, so it changes no coverage); :math:`c` is calibrated at
      :math:`\delta = 0.05` on a real model's attention and does not scale with
      ``delta`` (docs/theory.md section 8). On an estimate without a sketch
      (``certificate(estimate, kind="tilted_hull")``) it is :math:`3\sqrt{\mathrm{tr}\hat\Sigma}`,
      which misses the unseen tail like the other kinds.

    Parameters
    ----------
    kind : str
        A key of :data:`CERTIFICATE_KINDS` (one of :data:`KINDS`).
    delta : float in (0, 1)
    trace : float
        :math:`\mathrm{tr}\hat\Sigma` (+inf for an empty sample).
    variance : (dv,) array, for ``wald``
    eigenvalues : array of the eigenvalues of :math:`\hat\Sigma`, for ``chi2``
    max_term : float, default 0, for ``bernstein``
    tail_moment : float, for ``chebyshev_ucb``
    bound : float, optional, for ``tilted_hull``: a deterministic bound on the error (the hull bound)

    Returns
    -------
    radius : (dv,) ndarray for the per-coordinate kind (``wald``), float otherwise.

    Raises
    ------
    ValueError
        ``delta`` outside (0, 1); an unknown kind (the message lists
        :data:`KINDS`); a statistic the kind needs is None.
    """
    delta = check_delta(delta)
    trace = float(trace)
    return _kind(kind).radius(delta, trace, variance=variance, eigenvalues=eigenvalues, max_term=max_term,
                              tail_moment=tail_moment, bound=bound)


def certificate(estimate: Estimate, *, delta: float = 0.05, kind: str = "chebyshev") -> Certificate:
    r"""Confidence region for the true attention output from a Hajek estimate.

    Parameters
    ----------
    estimate : Estimate
        From :func:`kvcert.reference.hajek_attention`.
    delta : float in (0, 1)
        Nominal miscoverage (level 1 - delta).
    kind : str
        A key of :data:`CERTIFICATE_KINDS` (one of :data:`KINDS`). See
        :func:`radius_from_moments` for the formula and assumption of each
        (``chebyshev_ucb`` reads ``estimate.tail_moment``; each kind reads the
        fields in ``CERTIFICATE_KINDS[kind].needs``).

    Returns
    -------
    Certificate

    Notes
    -----
    An empty sample (``trace = inf``) gives an infinite radius. With every
    pi = 1 the radius is 0 for every kind.

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import hajek_attention, certificate
    >>> rng = np.random.default_rng(0)
    >>> est = hajek_attention(rng.normal(size=4), rng.normal(size=(8, 4)),
    ...                       rng.normal(size=(8, 2)), np.full(8, 0.5))
    >>> c = certificate(est, delta=0.05, kind="chebyshev")
    >>> bool(np.isclose(c.radius, np.sqrt(est.trace / 0.05)))
    True
    >>> strict = certificate(est, delta=0.05, kind="chebyshev_ucb")  # > sqrt(2) x chebyshev
    >>> bool(strict.radius > np.sqrt(2) * c.radius)
    True
    """
    if not isinstance(estimate, Estimate):
        raise TypeError(f"estimate must be a kvcert.reference.Estimate, got {type(estimate).__name__}")
    spec = _kind(kind)
    moments = {}
    for stat in spec.needs:
        moments.update(_MOMENTS[stat](estimate))
    radius = radius_from_moments(kind, delta, trace=estimate.trace, **moments)
    o = estimate.output
    norm_r = float(np.linalg.norm(radius)) if np.ndim(radius) else float(radius)
    norm_o = float(np.linalg.norm(o))
    rel = 0.0 if norm_r == 0 else (np.inf if norm_o == 0 else norm_r / norm_o)
    return Certificate(kind=kind, delta=float(delta), radius=radius, relative_radius=rel,
                       lower=o - radius, upper=o + radius)


def covers(cert: Certificate, estimate: Estimate, truth) -> bool | np.ndarray:
    """Does the certificate hold the true output?

    Norm kinds: ``||o_hat - o||_2 <= radius`` (a bool). Per-coordinate kinds
    (``wald``): ``lower <= o <= upper`` (a (dv,) bool array; its mean is the
    coordinate coverage).
    """
    o = np.asarray(truth, dtype=np.float64)
    spec = CERTIFICATE_KINDS.get(cert.kind)
    if spec is not None and spec.per_coordinate:
        return (cert.lower <= o) & (o <= cert.upper)
    return bool(np.linalg.norm(estimate.output - o) <= cert.radius)
