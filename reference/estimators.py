"""Exact attention, the Hajek estimator and its survey-sampling variance.

One query head at a time, float64 NumPy, no tricks: the oracle the torch and
Triton backends are checked against. Notation of docs/design.md section 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

__all__ = [
    "Estimate",
    "scores",
    "attention",
    "hajek_attention",
    "horvitz_thompson_totals",
    "linearized_variance",
    "linearized_variance_ht",
]


@dataclass(frozen=True)
class Estimate:
    """Result of :func:`hajek_attention` for one query head.

    Attributes
    ----------
    output : (dv,) Hajek estimate o_hat.
    weights : (n,) corrected softmax weights a_i (0 where pi = 0).
    variance : (dv,) per-coordinate variance estimate, diag(Sigma_hat).
    covariance : (dv, dv) Sigma_hat (reference backend only).
    trace : float, tr(Sigma_hat) = sum(variance).
    lse : float, log Z_hat, the log Horvitz-Thompson normalizer.
    n_eff : float, Kish effective sample size 1 / sum a_i^2 of the sample.
    max_term : float, plug-in range of the linearized summands,
        max over sampled tail tokens of max(1 - pi_i, pi_i) a_i ||v_i - o_hat||
        (used by the ``bernstein`` certificate).
    tail_moment : float or None, the HT estimate of the design variance of the
        trace itself, sum_S (1 - pi_i) x_i^2 with x_i = (1 - pi_i) a_i^2
        ||v_i - o_hat||^2 the trace's terms (used by the ``chebyshev_ucb``
        certificate); +inf for an empty sample. :func:`hajek_attention`
        always fills it; None only for an Estimate built by hand.
    """

    output: np.ndarray
    weights: np.ndarray
    variance: np.ndarray | None
    covariance: np.ndarray | None
    trace: float
    lse: float
    n_eff: float
    max_term: float = 0.0
    tail_moment: float | None = None


def as_qkv(q, keys, values):
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if q.ndim != 1:
        raise ValueError(f"q must have shape (d,), got shape {q.shape}")
    if k.ndim != 2 or k.shape[1] != q.shape[0]:
        raise ValueError(f"keys must have shape (n, d) = (n, {q.shape[0]}), got shape {k.shape}")
    if v.ndim != 2 or v.shape[0] != k.shape[0]:
        raise ValueError(f"values must have shape (n, dv) = ({k.shape[0]}, dv), got shape {v.shape}")
    for name, x in (("q", q), ("keys", k), ("values", v)):
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
    return q, k, v


def check_vector(name: str, x, n: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.shape != (n,):
        raise ValueError(f"{name} must have shape (n,) = ({n},), got shape {x.shape}")
    return x


def scores(q, keys, *, scale: float | None = None, bias=None) -> np.ndarray:
    r"""Attention scores :math:`s_i = \tau\, q \cdot k_i + b_i`, tau = 1/sqrt(d) by default.

    ``bias`` is an optional additive mask (n,) whose entries may be -inf
    (masked) but not +inf or NaN.
    """
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = float(scale) * (k @ q)
    if bias is not None:
        b = check_vector("bias", bias, k.shape[0])
        if np.any(np.isnan(b)) or np.any(b == np.inf):
            raise ValueError("bias must not contain NaN or +inf (use -inf to mask a token)")
        s = s + b
    return s


def attention(q, keys, values, *, scale: float | None = None, bias=None) -> np.ndarray:
    r"""Exact softmax attention over the full cache.

    .. math:: o = \sum_i \frac{e^{s_i}}{Z} v_i, \qquad Z = \sum_i e^{s_i}.

    Parameters
    ----------
    q : (d,)   keys : (n, d)   values : (n, dv)
    scale : float, default 1/sqrt(d)
    bias : (n,), optional additive mask (-inf masks a token)

    Returns
    -------
    output : (dv,)
    """
    q, k, v = as_qkv(q, keys, values)
    s = scores(q, k, scale=scale, bias=bias)
    if k.shape[0] == 0 or np.all(s == -np.inf):
        raise ValueError("attention over an empty (or fully masked) cache is undefined")
    a = np.exp(s - logsumexp(s))
    return a @ v


def hajek_attention(q, keys, values, pi, *, scale: float | None = None, per_coordinate: bool = True,
                    bias=None) -> Estimate:
    r"""Hajek-corrected attention over a Poisson sample and its variance estimate.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \qquad
        a_i = \operatorname{softmax}_S(s_i - \log \pi_i),

        \hat\Sigma = \sum_{i\in S} (1-\pi_i)\, a_i^2\, (v_i - \hat o)(v_i - \hat o)^\top,
        \qquad \mathrm{trace} = \sum_{i\in S} (1-\pi_i)\, a_i^2 \lVert v_i - \hat o\rVert^2,

        \log \hat Z = \log \sum_{i\in S} e^{s_i} / \pi_i,

        \mathrm{tail\_moment} = \sum_{i\in S} (1-\pi_i)\, x_i^2
            = \sum_{i\in S} (1-\pi_i)^3 a_i^4 \lVert v_i - \hat o\rVert^4,
        \qquad x_i = (1-\pi_i)\, a_i^2 \lVert v_i - \hat o\rVert^2 .

    :math:`\hat\Sigma` is the Horvitz-Thompson estimate of the design variance
    of the Taylor linearization
    :math:`\hat o - o \approx Z^{-1}\sum_i (I_i/\pi_i - 1) e^{s_i}(v_i - o)`,
    with Z and o replaced by their estimates. The trace is itself an HT sum:
    :math:`x_i \approx y_i/\pi_i` with
    :math:`y_i = \tfrac{1-\pi_i}{\pi_i} w_i^2 \lVert v_i - o\rVert^2` the terms
    of :math:`\mathrm{tr}\,V` (up to the plug-ins o_hat, Z_hat), so under
    Poisson sampling the HT estimate of its own design variance
    :math:`\sum_S (1-\pi_i)\, y_i^2/\pi_i^2` is ``tail_moment`` (the
    ``chebyshev_ucb`` certificate turns it into Satterthwaite's degrees of
    freedom :math:`\nu = 2\,\mathrm{tr}^2/\mathrm{tail\_moment}`).

    Parameters
    ----------
    q : (d,)
    keys, values : (n, d), (n, dv)
        The *kept* tokens (the sample S; rows with pi = 0 are padding).
    pi : (n,)
        Their inclusion probabilities in [0, 1]; 0 marks padding (bias -inf).
    scale : float, default 1/sqrt(d)
    per_coordinate : bool
        Accepted for signature parity with the fast backends; the reference
        always computes the full covariance.
    bias : (n,), optional additive score mask (-inf masks a token).

    Returns
    -------
    Estimate

    Notes
    -----
    - pi = 1 tokens (the certainty set) contribute nothing to the variance;
      with all pi = 1 the estimate is exact attention and the variance is 0.
    - Equal pi on S cancel in the softmax: o_hat is plain attention over S.
    - The correction is the additive bias -log pi, so a tiny pi (1e-6) gives a
      large positive bias, not an overflow (the softmax is max-shifted).
    - Padding (pi = 0) gets bias -inf: computing -log(0) would give +inf.
    - An empty sample (every row padding or masked) has no estimate: the
      output is 0, ``lse`` is -inf and ``variance``/``trace``/``tail_moment``
      are +inf, so any
      certificate built from it has an infinite radius ("uncertifiable").

    References
    ----------
    Horvitz & Thompson (1952), JASA 47; Hajek (1971), in Foundations of
    Statistical Inference; Sarndal, Swensson & Wretman (1992), sec. 5.6-5.7;
    arXiv 2607.21475.

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import attention, hajek_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=4), rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    >>> est = hajek_attention(q, k, v, np.ones(6))
    >>> bool(np.allclose(est.output, attention(q, k, v))), est.trace
    (True, 0.0)
    """
    q, k, v = as_qkv(q, keys, values)
    n, dv = v.shape
    p = check_pi(pi, n)
    logits = hajek_logits(scores(q, k, scale=scale, bias=bias), p)
    if n == 0 or np.all(logits == -np.inf):
        return empty_estimate(n, dv)
    lse = float(logsumexp(logits))
    return _linearized_estimate(np.exp(logits - lse), lse, v, p)


def _linearized_estimate(a: np.ndarray, lse: float, v: np.ndarray, p: np.ndarray) -> Estimate:
    """The estimate of the Hajek weights a (n,): o_hat = a v, the HT covariance of its linearization and the
    statistics derived from it (trace, n_eff, max_term, tail_moment)."""
    out = a @ v
    c = (1.0 - p) * a * a  # 0 for pi = 1 and for padding (a = 0)
    r = v - out
    cov = (r * c[:, None]).T @ r
    cov = 0.5 * (cov + cov.T)
    var = np.einsum("i,ij,ij->j", c, r, r)
    tail = (p < 1) & (a > 0)
    r2 = np.einsum("ij,ij->i", r, r)  # ||v_i - o_hat||^2
    x = c * r2  # the trace's HT terms x_i
    terms = np.maximum(1.0 - p, p) * a * np.linalg.norm(r, axis=1)
    return Estimate(
        output=out,
        weights=a,
        variance=var,
        covariance=cov,
        trace=float(var.sum()),
        lse=lse,
        n_eff=float(1.0 / np.sum(a * a)),
        max_term=float(terms[tail].max()) if np.any(tail) else 0.0,
        tail_moment=float(np.sum((1.0 - p) * x * x)),
    )


def check_pi(pi, n: int) -> np.ndarray:
    """pi as a float64 (n,) array in [0, 1]."""
    p = check_vector("pi", pi, n)
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError("pi must lie in [0, 1] (found a value outside, or NaN)")
    return p


def hajek_logits(s: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The Hajek logits s_i - log pi_i, -inf on padding (pi = 0: never -log 0 = +inf)."""
    present = p > 0
    logits = np.full(p.size, -np.inf)
    logits[present] = s[present] - np.log(p[present])
    return logits


def empty_estimate(n: int, dv: int) -> Estimate:
    """The estimate of an empty sample: output 0, lse -inf, the variance statistics +inf, n_eff 0."""
    inf = np.full(dv, np.inf)
    return Estimate(np.zeros(dv), np.zeros(n), inf, np.full((dv, dv), np.inf), np.inf, -np.inf, 0.0, np.inf,
                    tail_moment=np.inf)


def horvitz_thompson_totals(q, keys, values, pi, *, scale: float | None = None, bias=None):
    r"""Horvitz-Thompson totals over a sample S (rows with pi = 0 excluded).

    .. math:: \hat N = \sum_{i\in S} e^{s_i} v_i / \pi_i, \qquad \hat Z = \sum_{i\in S} e^{s_i}/\pi_i,

    design-unbiased for :math:`N = \sum_i e^{s_i} v_i` and :math:`Z = \sum_i e^{s_i}`
    (Horvitz & Thompson 1952). Unshifted exponentials: keep scores moderate
    (|s| < 700) or use ``lse`` of :func:`hajek_attention`.

    Returns
    -------
    N_hat : (dv,), Z_hat : float
    """
    q, k, v = as_qkv(q, keys, values)
    p = check_vector("pi", pi, k.shape[0])
    s = scores(q, k, scale=scale, bias=bias)
    present = p > 0
    w = np.zeros_like(s)
    w[present] = np.exp(s[present]) / p[present]
    return w @ v, float(w.sum())


def linearized_variance(q, keys, values, pi, *, scale: float | None = None, bias=None) -> np.ndarray:
    r"""Design covariance of the linearized Hajek error, over the *full* population.

    .. math:: V = \sum_i \frac{1-\pi_i}{\pi_i}\, w_i^2\, (v_i - o)(v_i - o)^\top,
              \qquad w_i = e^{s_i}/Z.

    Needs every token (the truth); :func:`hajek_attention` estimates it from S.
    """
    q, k, v = as_qkv(q, keys, values)
    p = check_vector("pi", pi, k.shape[0])
    if np.any(p <= 0) or np.any(p > 1):
        raise ValueError("pi must lie in (0, 1] over the population")
    s = scores(q, k, scale=scale, bias=bias)
    w = np.exp(s - logsumexp(s))
    r = v - w @ v
    c = (1.0 - p) / p * w * w
    return (r * c[:, None]).T @ r


def linearized_variance_ht(q, keys, values, pi, keep, *, output, lse, scale: float | None = None,
                           bias=None) -> np.ndarray:
    r"""HT estimate of :func:`linearized_variance` from a sample, with the *true* o and log Z.

    .. math:: \hat V = \sum_{i\in S} \frac{1-\pi_i}{\pi_i^2}\, w_i^2 (v_i - o)(v_i - o)^\top,

    exactly design-unbiased for V (each term is divided by its pi_i). With
    the estimated o_hat and Z_hat in place of o and Z it becomes the
    ``covariance`` of :func:`hajek_attention`.

    Parameters
    ----------
    keys, values, pi : the full population; keep : (n,) bool, the sample S.
    output, lse : the true attention output o and log Z.
    """
    q, k, v = as_qkv(q, keys, values)
    p = check_vector("pi", pi, k.shape[0])
    keep = np.asarray(keep, dtype=bool)
    s = scores(q, k, scale=scale, bias=bias)
    w = np.exp(s - float(lse))
    r = v - np.asarray(output, dtype=np.float64)
    c = np.where(keep, (1.0 - p) / np.where(keep, p, 1.0) ** 2 * w * w, 0.0)
    return (r * c[:, None]).T @ r
