r"""Sketched designs (issue 14): a page sketch of the evicted tokens, at equal total memory.

One KV head, one query, float64 NumPy, written to be read beside
docs/theory.md section "Sketched designs (issue 14)".

The pure Poisson design (``design="paper"``) certifies with the HT trace
:math:`\hat V = \mathrm{tr}\hat\Sigma`, which misses any tail token the sample
did not draw. The page design keeps, at eviction time, for every page of
``page_size`` consecutive positions that holds evicted tokens, Quest-style
per-channel min/max keys of its *evicted* tokens, the largest
:math:`\lVert v_i - \mu\rVert` among them, their smallest :math:`\pi_i` and their
count. At decode this gives, for every evicted token, a deterministic upper
bound on its score, and so a bound :math:`\bar V \ge V` on the design variance
of the linearized Hajek error that holds for *every* sample (with the plug-in
:math:`\hat o` for :math:`o`). Its memory counts: the page design samples fewer
tokens so that kept K+V plus the sketch plus the per-token scalars equal the
paper design's memory at the same ``budget``.

Memory accounting (in elements of the K/V dtype, e.g. fp16; one head):

- full cache: :math:`n (d + d_v)`;
- a kept token: :math:`d + d_v + 1` (its key, value and :math:`\log\pi_i`);
  when nothing is evicted the cache *is* the full cache (no :math:`\log\pi`);
- a sketched page: :math:`2d + 3` (key min and max, the value radius, the
  smallest :math:`\pi`, the evicted count), plus :math:`d_v` per head for the
  value centre :math:`\mu`.

``memory`` = held elements / :math:`n (d + d_v)`. Token positions and RoPE are
the same for both designs and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats
from scipy.special import logsumexp

from .certificates import certificate
from .design import certainty_mask, inclusion_probabilities, poisson_sample
from .estimators import _as_qkv, hajek_attention, scores

__all__ = [
    "DESIGNS",
    "RADII",
    "EvictionResult",
    "PageSketch",
    "SketchDesign",
    "evict_and_certify",
    "memory_fraction",
    "page_score_bounds",
    "page_sketch",
    "sketch_budget",
    "sketch_pages",
    "variance_bound",
]

#: radius kinds of the page design: ``chebyshev`` sqrt(V_bar / delta); ``gaussian`` z_{1-delta/2} sqrt(V_bar)
RADII = ("chebyshev", "gaussian")

#: per-token scalars held beside each kept key/value (log pi)
TOKEN_SCALARS = 1
#: per-page scalars beside the 2 d key bounds (value radius, smallest pi, evicted count)
PAGE_SCALARS = 3


@dataclass(frozen=True)
class SketchDesign:
    """The page design: Poisson sampling plus a page sketch of the evicted tokens.

    Attributes
    ----------
    page_size : int >= 1
        Tokens per page (pages are consecutive positions 0..P-1, P..2P-1, ...).
    radius : str
        ``"chebyshev"`` (Markov on the bound V_bar: proven up to the
        linearization and the plug-in o_hat) or ``"gaussian"`` (z_{1-delta/2}
        sqrt(V_bar), valid for any covariance shape under a Gaussian limit,
        Szekely & Bakirov 2003; empirical where the limit fails).
    """

    page_size: int = 16
    radius: str = "chebyshev"

    def __post_init__(self):
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, (int, np.integer)) \
                or self.page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {self.page_size!r}")
        if self.radius not in RADII:
            raise ValueError(f"radius must be one of {RADII}, got {self.radius!r}")


#: the designs ``evict_and_certify`` accepts by name; ``None`` means :data:`RECOMMENDED`
DESIGNS = ("paper", "page")

#: the design ``design=None`` selects (see docs/research/issue14/RESULTS.md for why)
RECOMMENDED = "paper"


@dataclass(frozen=True)
class PageSketch:
    """Summary of the evicted tokens, page by page (only pages with an evicted token).

    Attributes
    ----------
    page_size : int
    pages : (G,) int, page index g (tokens g P .. g P + P - 1)
    key_min, key_max : (G, d), per-channel min / max of the evicted keys of the page
    value_radius : (G,), max over the page's evicted tokens of ||v_i - mu||
    min_pi : (G,), smallest pi_i among them
    unseen : (G,) int, how many tokens of the page were evicted
    mu : (dv,), the value centre (mean of all n values of the head)
    """

    page_size: int
    pages: np.ndarray
    key_min: np.ndarray
    key_max: np.ndarray
    value_radius: np.ndarray
    min_pi: np.ndarray
    unseen: np.ndarray
    mu: np.ndarray


@dataclass(frozen=True)
class EvictionResult:
    """Result of :func:`evict_and_certify` for one query head.

    Attributes
    ----------
    output : (dv,) Hajek estimate o_hat from the kept tokens
    radius : float, certified bound on ||o_hat - o||_2 at level 1 - delta
    memory : float, fraction of the full cache's K+V memory held (see module docstring)
    design : str, ``"paper"`` or ``"page"``
    budget : float, expected kept tokens the design sampled with (smaller for ``"page"``)
    kept : int, tokens actually kept
    variance : float, the variance used by the radius (HT trace for paper, V_bar for page)
    """

    output: np.ndarray
    radius: float
    memory: float
    design: str
    budget: float
    kept: int
    variance: float


def _check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    return int(page_size)


def memory_fraction(n: int, d: int, dv: int, *, kept: int, pages: int = 0, page_size: int | None = None) -> float:
    r"""Fraction of the full cache's memory held.

    .. math::

        M = \frac{|S|\,(d + d_v + 1) + G\,(2d + 3) + [G > 0]\, d_v}{n\,(d + d_v)},

    with :math:`|S|` = ``kept`` and G = ``pages`` sketched pages; M = 1 when
    ``kept == n`` (nothing evicted: the full cache, no log pi needed).
    ``page_size`` is accepted for symmetry and not used (a page's cost does not
    depend on how many tokens it summarizes).
    """
    for name, v in (("n", n), ("d", d), ("dv", dv)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (0 <= kept <= n):
        raise ValueError(f"kept must be in [0, n] = [0, {n}], got {kept}")
    if pages < 0:
        raise ValueError(f"pages must be >= 0, got {pages}")
    if kept == n:
        return 1.0
    held = kept * (d + dv + TOKEN_SCALARS) + pages * (2 * d + PAGE_SCALARS) + (dv if pages else 0)
    return float(held) / float(n * (d + dv))


def sketch_pages(certain, page_size: int) -> int:
    """Number of pages that hold at least one tail (pi < 1 possible) token: the pages the sketch reserves."""
    page_size = _check_page_size(page_size)
    certain = np.asarray(certain, dtype=bool)
    tail = np.flatnonzero(~certain)
    return int(np.unique(tail // page_size).size)


def sketch_budget(budget: float, n: int, d: int, dv: int, *, pages: int) -> float:
    r"""Expected kept tokens of the page design at the paper design's memory for ``budget``.

    .. math:: B_{\mathrm{page}} = B - \frac{G (2d + 3) + d_v}{d + d_v + 1},

    so that :math:`B_{\mathrm{page}}(d + d_v + 1) + G(2d+3) + d_v = B (d + d_v + 1)`:
    equal expected memory, with G = ``pages`` reserved (an upper bound on the
    pages that end up holding evicted tokens, so the realized memory is at most
    the paper design's expected memory).
    """
    return float(budget) - (pages * (2 * d + PAGE_SCALARS) + dv) / float(d + dv + TOKEN_SCALARS)


def page_sketch(keys, values, pi, keep, *, page_size: int = 16) -> PageSketch:
    r"""Build the page sketch of the evicted tokens (``keep == False``).

    For every page g with evicted tokens :math:`U_g`:

    .. math::

        \underline k_{g} = \min_{i\in U_g} k_{i},\quad \overline k_{g} = \max_{i\in U_g} k_{i}
        \ \text{(per channel)},\qquad
        \rho_g = \max_{i\in U_g} \lVert v_i - \mu\rVert,\qquad
        \underline\pi_g = \min_{i\in U_g} \pi_i,\qquad |U_g|,

    with :math:`\mu = n^{-1}\sum_i v_i`.

    Parameters
    ----------
    keys : (n, d)   values : (n, dv)   pi : (n,) in (0, 1]   keep : (n,) bool
    page_size : int >= 1
    """
    page_size = _check_page_size(page_size)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if k.ndim != 2:
        raise ValueError(f"keys must have shape (n, d), got shape {k.shape}")
    n, d = k.shape
    if v.ndim != 2 or v.shape[0] != n:
        raise ValueError(f"values must have shape (n, dv) = ({n}, dv), got shape {v.shape}")
    p = np.asarray(pi, dtype=np.float64)
    if p.shape != (n,):
        raise ValueError(f"pi must have shape (n,) = ({n},), got shape {p.shape}")
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != (n,):
        raise ValueError(f"keep must have shape (n,) = ({n},), got shape {keep.shape}")
    if np.any(~keep & ~(p > 0)):
        raise ValueError("pi must be > 0 for every evicted token (an evicted token with pi = 0 is unobservable)")
    mu = v.mean(axis=0)
    gone = np.flatnonzero(~keep)
    page_of = gone // page_size
    pages, inverse, counts = np.unique(page_of, return_inverse=True, return_counts=True)
    G = pages.size
    kmin = np.full((G, d), np.inf)
    kmax = np.full((G, d), -np.inf)
    np.minimum.at(kmin, inverse, k[gone])
    np.maximum.at(kmax, inverse, k[gone])
    rad = np.zeros(G)
    np.maximum.at(rad, inverse, np.linalg.norm(v[gone] - mu, axis=1))
    mpi = np.ones(G)
    np.minimum.at(mpi, inverse, p[gone])
    return PageSketch(page_size=page_size, pages=pages, key_min=kmin, key_max=kmax, value_radius=rad,
                      min_pi=mpi, unseen=counts.astype(np.int64), mu=mu)


def page_score_bounds(q, sketch: PageSketch, *, scale: float | None = None):
    r"""Deterministic bounds on the score of every evicted token of each sketched page.

    .. math::

        \ell_g = \tau \sum_j \min(q_j \underline k_{gj}, q_j \overline k_{gj})
        \;\le\; \tau\, q\cdot k_i \;\le\;
        u_g = \tau \sum_j \max(q_j \underline k_{gj}, q_j \overline k_{gj}),
        \qquad i \in U_g,

    exact because each :math:`q_j k_{ij}` is linear in :math:`k_{ij} \in
    [\underline k_{gj}, \overline k_{gj}]` and :math:`\tau \ge 0`.

    Returns
    -------
    lower, upper : (G,) each
    """
    q = np.asarray(q, dtype=np.float64)
    if q.ndim != 1 or q.shape[0] != sketch.key_min.shape[1]:
        raise ValueError(f"q must have shape (d,) = ({sketch.key_min.shape[1]},), got shape {q.shape}")
    tau = 1.0 / np.sqrt(q.shape[0]) if scale is None else float(scale)
    if not (tau >= 0 and np.isfinite(tau)):
        raise ValueError(f"scale must be finite and >= 0, got {scale}")
    a, b = sketch.key_min * q, sketch.key_max * q
    return tau * np.minimum(a, b).sum(axis=1), tau * np.maximum(a, b).sum(axis=1)


def variance_bound(q, keys, values, pi, sketch: PageSketch, *, output, scale: float | None = None) -> float:
    r"""Upper bound :math:`\bar V` on the design variance V of the linearized Hajek error.

    With S the kept tokens (``keys``, ``values``, ``pi``), U_g the evicted tokens
    of page g, o the true output and :math:`V = \sum_i \frac{1-\pi_i}{\pi_i}
    \frac{e^{2 s_i}}{Z^2}\lVert v_i - o\rVert^2` (over all n tokens),

    .. math::

        \bar V = \frac{1}{\underline Z^2}\Big[\sum_{i\in S} \frac{1-\pi_i}{\pi_i}
            e^{2 s_i}\lVert v_i - \hat o\rVert^2
          + \sum_g |U_g|\,\frac{1-\underline\pi_g}{\underline\pi_g}\, e^{2 u_g}
            \big(\rho_g + \lVert\mu - \hat o\rVert\big)^2\Big],
        \qquad \underline Z = \sum_{i\in S} e^{s_i} + \sum_g |U_g|\, e^{\ell_g}.

    Every evicted token's term is bounded by its page's: :math:`s_i \le u_g`,
    :math:`\pi_i \ge \underline\pi_g`, :math:`\lVert v_i - o\rVert \le \rho_g +
    \lVert\mu - o\rVert`, and :math:`Z \ge \underline Z`. So with the true o in
    place of the plug-in :math:`\hat o`, :math:`\bar V \ge V` for *every*
    sample (docs/theory.md, "Sketched designs"); the plug-in is the only
    approximation. Computed in log space (scores may be large).

    Parameters
    ----------
    q : (d,)   keys, values, pi : the kept tokens, (m, d), (m, dv), (m,) in (0, 1]
    sketch : PageSketch of the evicted tokens
    output : (dv,) the plug-in o_hat
    """
    q, k, v = _as_qkv(q, keys, values)
    p = np.asarray(pi, dtype=np.float64)
    if p.shape != (k.shape[0],) or np.any(~(p > 0)) or np.any(p > 1):
        raise ValueError(f"pi must have shape ({k.shape[0]},) with values in (0, 1]")
    o = np.asarray(output, dtype=np.float64)
    s = scores(q, k, scale=scale)
    lo, up = page_score_bounds(q, sketch, scale=scale)
    cnt = sketch.unseen.astype(np.float64)
    log_zlo = logsumexp(np.concatenate([s, lo + np.log(cnt)])) if (s.size + cnt.size) else -np.inf
    # kept tokens: exact scores; terms with pi = 1 vanish
    r_kept = np.linalg.norm(v - o, axis=1)
    ratio_kept = (1.0 - p) / p
    mk = ratio_kept > 0
    logs_kept = np.log(ratio_kept[mk]) + 2.0 * s[mk] + 2.0 * np.log(np.maximum(r_kept[mk], 1e-300))
    rg = sketch.value_radius + np.linalg.norm(sketch.mu - o)
    ratio_g = (1.0 - sketch.min_pi) / sketch.min_pi
    mg = (ratio_g > 0) & (rg > 0)
    logs_page = np.log(cnt[mg]) + np.log(ratio_g[mg]) + 2.0 * up[mg] + 2.0 * np.log(rg[mg])
    terms = np.concatenate([logs_kept[r_kept[mk] > 0], logs_page])
    if terms.size == 0:
        return 0.0
    return float(np.exp(logsumexp(terms) - 2.0 * log_zlo))


def _check_budget(budget, n: int) -> float:
    if isinstance(budget, bool):
        raise TypeError("budget must be a number, got bool")
    budget = float(budget)
    if not (np.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite number > 0 (expected kept tokens), got {budget}")
    return min(budget, float(n))


def _design(design) -> SketchDesign | None:
    """None for the paper design, a SketchDesign for the page design."""
    if design is None:
        design = RECOMMENDED
    if isinstance(design, SketchDesign):
        return design
    if design == "paper":
        return None
    if design == "page":
        return SketchDesign()
    raise ValueError(f"design must be None, one of {DESIGNS} or a SketchDesign, got {design!r}")


def evict_and_certify(q, keys, values, importance, budget, *, seed: int, delta: float = 0.05, design=None,
                      sinks: int = 4, window: int = 32, top: int = 0, floor: float = 0.1,
                      scale: float | None = None) -> EvictionResult:
    r"""Evict one KV head's cache at random and certify one query's attention output.

    ``design="paper"`` (today's design, DESIGN.md section 2):
    ``pi = inclusion_probabilities(importance, budget, ...)``,
    ``keep = poisson_sample(pi, seed=seed)``, the Hajek estimate
    ``hajek_attention`` over the kept tokens and the radius of
    ``certificate(kind="chebyshev")``: :math:`\sqrt{\mathrm{tr}\hat\Sigma/\delta}`.

    ``design="page"`` or a :class:`SketchDesign`: the same sampling at the
    reduced budget :func:`sketch_budget` (equal memory), the same Hajek
    estimate, a :func:`page_sketch` of the evicted tokens and the radius
    :math:`\sqrt{\bar V/\delta}` (``chebyshev``) or
    :math:`z_{1-\delta/2}\sqrt{\bar V}` (``gaussian``), :math:`\bar V` from
    :func:`variance_bound`.

    ``design=None`` is :data:`RECOMMENDED` (``"paper"``: on the synthetic cells
    of docs/research/issue14/RESULTS.md the page design's coverage gain costs
    more than the tightness and error goals allow; the choice is explicit).

    Parameters
    ----------
    q : (d,) query   keys : (n, d)   values : (n, dv), one KV head's full cache
    importance : (n,) scorer importance, >= 0
    budget : float > 0
        Expected kept tokens of the *paper* design at the memory to compare at;
        ``budget >= n`` keeps everything (radius 0, exact output, memory 1).
    seed : int >= 0, the sampling stream (``design_generator(seed)``)
    delta : float in (0, 1)
    design : None, ``"paper"``, ``"page"`` or a :class:`SketchDesign`
    sinks, window, top, floor : the certainty set and defensive floor of
        :func:`inclusion_probabilities`
    scale : float, default 1/sqrt(d)

    Returns
    -------
    EvictionResult

    Raises
    ------
    ValueError
        Bad shapes (naming the argument and the expected shape), delta outside
        (0, 1), budget <= 0, a page design whose sketch leaves no budget above
        the certainty set.
    """
    q, k, v = _as_qkv(q, keys, values)
    n, d = k.shape
    dv = v.shape[1]
    if n == 0:
        raise ValueError("keys must hold at least one token, got n = 0")
    u = np.asarray(importance, dtype=np.float64)
    if u.shape != (n,):
        raise ValueError(f"importance must have shape (n,) = ({n},), got shape {u.shape}")
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    budget = _check_budget(budget, n)
    spec = _design(design)
    name = "paper" if spec is None else "page"
    if budget >= n:
        return EvictionResult(output=hajek_attention(q, k, v, np.ones(n), scale=scale).output, radius=0.0,
                              memory=1.0, design=name, budget=float(n), kept=n, variance=0.0)
    if spec is None:
        pi = inclusion_probabilities(u, budget, sinks=sinks, window=window, top=top, floor=floor)
        keep = poisson_sample(pi, seed=seed)
        est = hajek_attention(q, k[keep], v[keep], pi[keep], scale=scale)
        cert = certificate(est, delta=delta, kind="chebyshev")
        return EvictionResult(output=est.output, radius=float(cert.radius),
                              memory=memory_fraction(n, d, dv, kept=int(keep.sum())), design=name,
                              budget=budget, kept=int(keep.sum()), variance=float(est.trace))
    certain = certainty_mask(u, sinks=sinks, window=window, top=top)
    reserved = sketch_pages(certain, spec.page_size)
    b_page = sketch_budget(budget, n, d, dv, pages=reserved)
    if b_page <= certain.sum():
        raise ValueError(
            f"budget = {budget} is too small for the page design: its sketch ({reserved} pages of "
            f"page_size={spec.page_size}) leaves an expected {b_page:.3g} kept tokens, not above the "
            f"certainty set |C| = {int(certain.sum())}; raise budget or page_size")
    pi = inclusion_probabilities(u, b_page, sinks=sinks, window=window, top=top, floor=floor)
    keep = poisson_sample(pi, seed=seed)
    est = hajek_attention(q, k[keep], v[keep], pi[keep], scale=scale)
    sk = page_sketch(k, v, pi, keep, page_size=spec.page_size)
    vbar = variance_bound(q, k[keep], v[keep], pi[keep], sk, output=est.output, scale=scale)
    if spec.radius == "chebyshev":
        radius = float(np.sqrt(vbar / delta))
    else:
        radius = float(stats.norm.ppf(1.0 - delta / 2.0) * np.sqrt(vbar))
    kept = int(keep.sum())
    return EvictionResult(output=est.output, radius=radius,
                          memory=memory_fraction(n, d, dv, kept=kept, pages=int(sk.pages.size)), design=name,
                          budget=b_page, kept=kept, variance=vbar)
