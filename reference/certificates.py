"""Error certificates built from an :class:`Estimate`.

Each kind turns the design-variance estimate of the Hajek output into a
radius at level 1 - delta. What each assumes is stated in its docstring and in
docs/theory.md; none is a finite-sample guarantee for every population, since
all of them plug in a variance estimated from the sample (see the unseen-mass
discussion in docs/theory.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

from .estimators import Estimate

__all__ = ["Certificate", "KINDS", "NU_MIN", "certificate", "covers", "radius_from_moments"]

#: certificate kinds; the norm kinds bound ||o_hat - o||_2, ``wald`` bounds each coordinate
KINDS = ("wald", "chebyshev", "chi2", "bernstein", "chebyshev_ucb")

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


def _check_delta(delta) -> float:
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return delta


def _ucb_ratio(nu: float, delta: float) -> float:
    """nu / chi2_{nu; delta/2}: the factor by which the chi-square UCB inflates the trace (1 at nu = inf)."""
    if nu == np.inf:
        return 1.0
    return float(nu / stats.chi2.ppf(delta / 2.0, nu))


def radius_from_moments(kind: str, delta: float, *, trace: float, variance=None, eigenvalues=None,
                        max_term: float = 0.0, tail_moment: float | None = None):
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
    """
    delta = _check_delta(delta)
    trace = float(trace)
    if kind == "wald":
        if variance is None:
            raise ValueError("the wald certificate needs the per-coordinate variance "
                             "(compute the estimate with per_coordinate=True)")
        return stats.norm.ppf(1.0 - delta / 2.0) * np.sqrt(np.maximum(np.asarray(variance, float), 0.0))
    if kind == "chebyshev":
        return float(np.sqrt(max(trace, 0.0) / delta))
    if kind == "chi2":
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
    if kind == "bernstein":
        if not np.isfinite(trace):
            return np.inf
        L = np.log(2.0 / delta)
        b = float(max_term) * L / 3.0
        return float(b + np.sqrt(b * b + 2.0 * max(trace, 0.0) * L))
    if kind == "chebyshev_ucb":
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
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def certificate(estimate: Estimate, *, delta: float = 0.05, kind: str = "chebyshev") -> Certificate:
    r"""Confidence region for the true attention output from a Hajek estimate.

    Parameters
    ----------
    estimate : Estimate
        From :func:`kvcert.reference.hajek_attention`.
    delta : float in (0, 1)
        Nominal miscoverage (level 1 - delta).
    kind : {"wald", "chebyshev", "chi2", "bernstein", "chebyshev_ucb"}
        See :func:`radius_from_moments` for the formula and assumption of each
        (``chebyshev_ucb`` reads ``estimate.tail_moment``).

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
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    eig = None
    if kind == "chi2":
        cov = estimate.covariance
        eig = np.full(1, np.inf) if not np.all(np.isfinite(cov)) else np.linalg.eigvalsh(cov)
    radius = radius_from_moments(kind, delta, trace=estimate.trace, variance=estimate.variance,
                                 eigenvalues=eig, max_term=estimate.max_term,
                                 tail_moment=estimate.tail_moment)
    o = estimate.output
    norm_r = float(np.linalg.norm(radius)) if np.ndim(radius) else float(radius)
    norm_o = float(np.linalg.norm(o))
    rel = 0.0 if norm_r == 0 else (np.inf if norm_o == 0 else norm_r / norm_o)
    return Certificate(kind=kind, delta=float(delta), radius=radius, relative_radius=rel,
                       lower=o - radius, upper=o + radius)


def covers(cert: Certificate, estimate: Estimate, truth) -> bool | np.ndarray:
    """Does the certificate hold the true output?

    Norm kinds: ``||o_hat - o||_2 <= radius`` (a bool). ``wald``: per-coordinate
    ``lower <= o <= upper`` (a (dv,) bool array; its mean is the coordinate
    coverage).
    """
    o = np.asarray(truth, dtype=np.float64)
    if cert.kind == "wald":
        return (cert.lower <= o) & (o <= cert.upper)
    return bool(np.linalg.norm(estimate.output - o) <= cert.radius)
