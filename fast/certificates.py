"""Error certificates from a batched :class:`~kvcert.fast.types.Estimate`.

Same kinds and formulas as ``kvcert.reference.radius_from_moments``, applied
to every query head (and query) of a batch at once. Works on the estimates of
``kvcert.fast`` and ``kvcert.kernels`` alike.
"""

from __future__ import annotations

import math
import numbers
from statistics import NormalDist

import numpy as np
import torch
from scipy import special

from .types import Certificate, Estimate

__all__ = ["KINDS", "NU_MIN", "certificate", "radius_from_moments"]

#: certificate kinds; the norm kinds bound ||o_hat - o||_2, ``wald`` bounds each coordinate
#: (the order of ``kvcert.reference.KINDS``); the strict opt-in ``chebyshev_ucb`` needs
#: ``hajek_attention(..., return_tail_moment=True)``
KINDS = ("wald", "chebyshev", "chi2", "bernstein", "chebyshev_ucb")
#: lower clip of the Satterthwaite degrees of freedom of ``chebyshev_ucb`` (nu >= 2 holds exactly)
NU_MIN = 2.0


def _check_delta(delta) -> float:
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


def radius_from_moments(kind: str, delta: float, *, trace: torch.Tensor, variance: torch.Tensor | None = None,
                        sum_sq_eigenvalues: torch.Tensor | None = None,
                        max_term: torch.Tensor | None = None,
                        tail_moment: torch.Tensor | None = None) -> torch.Tensor:
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

    Parameters
    ----------
    kind : {"wald", "chebyshev", "chi2", "bernstein", "chebyshev_ucb"}
    delta : float in (0, 1)
    trace : (...,) tensor
    variance : (..., dv) tensor, for ``wald``
    sum_sq_eigenvalues : (...,) tensor, for ``chi2``
    max_term : (...,) tensor, for ``bernstein``
    tail_moment : (...,) tensor, for ``chebyshev_ucb``

    Returns
    -------
    radius : (..., dv) for ``wald``, (...,) otherwise; +inf where trace is +inf.
    """
    delta = _check_delta(delta)
    if not isinstance(trace, torch.Tensor):
        raise TypeError(f"trace must be a torch.Tensor, got {type(trace).__name__}")
    if kind == "wald":
        if variance is None:
            raise ValueError("the wald certificate needs the per-coordinate variance "
                             "(compute the estimate with per_coordinate=True)")
        z = NormalDist().inv_cdf(1.0 - delta / 2.0)
        return z * torch.sqrt(variance.clamp(min=0.0))
    if kind == "chebyshev":
        return torch.sqrt(trace.clamp(min=0.0) / delta)
    if kind == "chi2":
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
    if kind == "bernstein":
        if max_term is None:
            raise ValueError("the bernstein certificate needs max_term: compute the estimate with "
                             "kvcert.fast.hajek_attention(..., return_max_term=True)")
        L = math.log(2.0 / delta)
        b = max_term.to(trace.dtype) * (L / 3.0)
        r = b + torch.sqrt(b * b + 2.0 * trace.clamp(min=0.0) * L)
        return torch.where(torch.isfinite(trace), r, torch.full_like(r, math.inf))
    if kind == "chebyshev_ucb":
        if tail_moment is None:
            raise ValueError("the chebyshev_ucb certificate needs tail_moment: compute the estimate with "
                             "hajek_attention(..., return_tail_moment=True)")
        if not isinstance(tail_moment, torch.Tensor):
            raise TypeError(f"tail_moment must be a torch.Tensor, got {type(tail_moment).__name__}")
        if tail_moment.shape != trace.shape:
            raise ValueError(f"tail_moment must have the shape of trace {tuple(trace.shape)}, "
                             f"got {tuple(tail_moment.shape)}")
        return _ucb_radius(delta, trace, tail_moment)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


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
        ``tail_moment`` (return_tail_moment=True).
    delta : float in (0, 1)
        Nominal miscoverage.
    kind : {"wald", "chebyshev", "chi2", "bernstein", "chebyshev_ucb"}

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
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    delta = _check_delta(delta)
    trace = estimate.trace
    dt = trace.dtype if trace.is_floating_point() else torch.float32
    trace = trace.to(dt)
    s2 = None
    if kind == "chi2" and estimate.covariance is not None:
        cov = estimate.covariance.to(dt)
        s2 = cov.square().sum((-1, -2))
        s2 = torch.where(torch.isfinite(cov).all(-1).all(-1), s2, torch.full_like(s2, math.inf))
    radius = radius_from_moments(kind, delta, trace=trace,
                                 variance=None if estimate.variance is None else estimate.variance.to(dt),
                                 sum_sq_eigenvalues=s2, max_term=estimate.max_term,
                                 tail_moment=estimate.tail_moment)
    o = estimate.output.to(dt)
    norm_r = torch.linalg.vector_norm(radius, dim=-1) if kind == "wald" else radius
    norm_o = torch.linalg.vector_norm(o, dim=-1)
    rel = torch.where(norm_r == 0, torch.zeros_like(norm_r),
                      torch.where(norm_o == 0, torch.full_like(norm_r, math.inf), norm_r / norm_o))
    half = radius if kind == "wald" else radius.unsqueeze(-1)
    return Certificate(kind=kind, delta=delta, radius=radius, relative_radius=rel, lower=o - half, upper=o + half)
