r"""Sketched designs (issue 14): sketches of the evicted tokens, at equal total memory.

Three sketches: the page design (below, bounds), the cluster design and the code design
(second slice, at the end of the module: estimates of the evicted part of the design
variance, docs/research/issue14/RESULTS_T2.md).

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
    "CODE_RADII",
    "DESIGNS",
    "RADII",
    "RECOMMENDED",
    "ClusterDesign",
    "ClusterSketch",
    "CodeDesign",
    "CodeSketch",
    "EvictionResult",
    "PageSketch",
    "SketchDesign",
    "TILTED",
    "cluster_sketch",
    "cluster_variance",
    "code_budget",
    "code_scores",
    "code_sketch",
    "evict_and_certify",
    "hull_bound",
    "hybrid_variance",
    "kmeans_assign",
    "memory_fraction",
    "page_score_bounds",
    "page_sketch",
    "radius_from_variance",
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


#: the designs ``evict_and_certify`` accepts by name; ``None`` means :data:`RECOMMENDED`.
#: ``"cluster"`` is ``ClusterDesign()``, ``"tilted"`` is :data:`TILTED` and ``"code"`` is ``CodeDesign()``
#: (defined further down)
DESIGNS = ("paper", "page", "cluster", "tilted", "code")

#: the design ``design=None`` selects (see docs/research/issue14/RESULTS.md and RESULTS_T2.md for why:
#: no sketched design, the tilted one included, meets every goal line of issue 14 on the real model's
#: T2 cells at every M)
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
    design : str, ``"paper"``, ``"page"``, ``"cluster"`` or ``"code"``
    budget : float, expected kept tokens the design sampled with (smaller for a sketched design)
    kept : int, tokens actually kept
    variance : float, the variance used by the radius (HT trace for paper, V_bar for page,
        V_cl for cluster, V_hybrid for code)
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


def memory_fraction(n: int, d: int, dv: int, *, kept: int, pages: int = 0, page_size: int | None = None,
                    extra: float = 0.0) -> float:
    r"""Fraction of the full cache's memory held.

    .. math::

        M = \frac{|S|\,(d + d_v + 1) + G\,(2d + 3) + [G > 0]\, d_v + E}{n\,(d + d_v)},

    with :math:`|S|` = ``kept``, G = ``pages`` sketched pages and E = ``extra``
    elements of any other sketch (the cluster and code designs); M = 1 when
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
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    if kept == n:
        return 1.0
    held = kept * (d + dv + TOKEN_SCALARS) + pages * (2 * d + PAGE_SCALARS) + (dv if pages else 0) + float(extra)
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


def _kept_inputs(q, keys, values, pi, output):
    """``(q, keys, values, pi, output)`` of a sketched variance as float64 arrays, checked: the kept
    tokens' pi must be in (0, 1]."""
    q, k, v = _as_qkv(q, keys, values)
    p = np.asarray(pi, dtype=np.float64)
    if p.shape != (k.shape[0],) or np.any(~(p > 0)) or np.any(p > 1):
        raise ValueError(f"pi must have shape ({k.shape[0]},) with values in (0, 1]")
    return q, k, v, p, np.asarray(output, dtype=np.float64)


def _sketch_inputs(keys, values, pi, keep):
    """``(keys (n, d), values (n, dv), pi (n,), keep (n,) bool)`` as float64 / bool arrays, checked: the
    inputs every sketch is built from (an evicted token needs pi > 0 to be observable)."""
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if k.ndim != 2:
        raise ValueError(f"keys must have shape (n, d), got shape {k.shape}")
    n = k.shape[0]
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
    return k, v, p, keep


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
    k, v, p, keep = _sketch_inputs(keys, values, pi, keep)
    n, d = k.shape
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
    q, k, v, p, o = _kept_inputs(q, keys, values, pi, output)
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


def _design(design):
    """None for the paper design, else the design object (SketchDesign, ClusterDesign or CodeDesign)."""
    if design is None:
        design = RECOMMENDED
    if isinstance(design, (SketchDesign, ClusterDesign, CodeDesign)):
        return design
    if isinstance(design, str):
        named = {"paper": None, "page": SketchDesign(), "cluster": ClusterDesign(), "tilted": TILTED,
                 "code": CodeDesign()}
        if design in named:
            return named[design]
    raise ValueError(f"design must be None, one of {DESIGNS}, a SketchDesign, ClusterDesign or CodeDesign, "
                     f"got {design!r}")


def _design_name(spec) -> str:
    if spec is None:
        return "paper"
    if isinstance(spec, ClusterDesign) and spec.tilt:
        return "tilted"
    return {SketchDesign: "page", ClusterDesign: "cluster", CodeDesign: "code"}[type(spec)]


def radius_from_variance(variance: float, *, delta: float, rule: str, multiplier: float = 3.0) -> float:
    r"""Radius from a variance: ``chebyshev`` :math:`\sqrt{V/\delta}`, ``gaussian``
    :math:`z_{1-\delta/2}\sqrt V`, ``fixed`` :math:`c\sqrt V` (c = ``multiplier``)."""
    v = max(float(variance), 0.0)
    if rule == "chebyshev":
        return float(np.sqrt(v / delta))
    if rule == "gaussian":
        return float(stats.norm.ppf(1.0 - delta / 2.0) * np.sqrt(v))
    if rule == "fixed":
        return float(multiplier * np.sqrt(v))
    raise ValueError(f"rule must be one of {CODE_RADII}, got {rule!r}")


def code_budget(budget: float, n: int, d: int, dv: int, design: "CodeDesign") -> float:
    r"""Expected kept tokens of a code design at the paper design's expected memory for ``budget``.

    Every evicted token holds ``token_bits / 16`` elements (c) and the head
    ``head_elements`` (h); with expected kept count b the expected memory is
    :math:`b(d + d_v + 1) + (n - b)c + h`, equal to :math:`B(d + d_v + 1)` at

    .. math:: b = \frac{B(d + d_v + 1) - nc - h}{d + d_v + 1 - c}.
    """
    c = design.token_bits(dv) / 16.0
    slot = d + dv + TOKEN_SCALARS
    return (float(budget) * slot - c * n - design.head_elements(d, dv)) / (slot - c)


def evict_and_certify(q, keys, values, importance, budget, *, seed: int, delta: float = 0.05, design=None,
                      sinks: int = 4, window: int = 32, top: int = 0, floor: float = 0.1,
                      scale: float | None = None, tilt=None) -> EvictionResult:
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

    ``design="cluster"`` or a :class:`ClusterDesign`: sampling at
    ``budget - ClusterDesign.elements(d, dv) / (d + dv + 1)`` (equal expected
    memory), the same Hajek estimate, a :func:`cluster_sketch` of the evicted
    tokens and the radius of ``design.radius`` on :math:`V_{\mathrm{cl}}`
    (:func:`cluster_variance`, :func:`radius_from_variance`), capped at the
    deterministic :func:`hull_bound`.

    ``design="tilted"`` (:data:`TILTED`) or a ``ClusterDesign(tilt=True)``: the
    same, with the sketch's moments tilted at ``tilt`` (the observation-window
    queries (w, d) of the head's query group, or their mean q0 (d,)), memory
    C (4d + 4) + d + dv + 1 (docs/theory.md section 8, fifth slice).

    ``design="code"`` or a :class:`CodeDesign`: sampling at :func:`code_budget`
    (equal expected memory), a :func:`code_sketch` of the evicted tokens and the
    radius on :math:`V_{\mathrm{hyb}}` (:func:`hybrid_variance`).

    Every sketched design keeps the given ``top`` (the certainty set is the
    paper design's); only the Poisson tail shrinks.

    ``design=None`` is :data:`RECOMMENDED` (``"paper"``: on the synthetic cells
    of docs/research/issue14/RESULTS.md and on the real model's T2 cells of
    RESULTS_T2.md no sketched design meets every goal line of issue 14 (the
    cluster design misses tightness, 5.7-7.8 at quick sizes and 18.5-20 at
    full size; the tilted design meets every line at M = 0.55 with the
    radius 2.5 sqrt(V) on the held-out text and at full size, and every line
    but tightness (3.7-4.1) at every M with its 3 sqrt(V)), and on T3,
    with the radius capped at :func:`hull_bound`, the tilted certificate
    ranks failing runs at AUC 0.790 against the paper design's 0.812
    (docs/theory.md section 8, seventh slice); the choice is explicit).

    Parameters
    ----------
    q : (d,) query   keys : (n, d)   values : (n, dv), one KV head's full cache
    importance : (n,) scorer importance, >= 0
    budget : float > 0
        Expected kept tokens of the *paper* design at the memory to compare at;
        ``budget >= n`` keeps everything (radius 0, exact output, memory 1).
    seed : int >= 0, the sampling stream (``design_generator(seed)``)
    delta : float in (0, 1)
    design : None, one of :data:`DESIGNS`, or a :class:`SketchDesign`, :class:`ClusterDesign`
        or :class:`CodeDesign`
    sinks, window, top, floor : the certainty set and defensive floor of
        :func:`inclusion_probabilities`
    scale : float, default 1/sqrt(d)
    tilt : (w, d) or (d,), the tilt point of a tilted design (required there, refused elsewhere)

    Returns
    -------
    EvictionResult

    Raises
    ------
    ValueError
        Bad shapes (naming the argument and the expected shape), delta outside
        (0, 1), budget <= 0, a sketched design whose sketch leaves no budget
        above the certainty set.
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
    name = _design_name(spec)
    if isinstance(spec, ClusterDesign) and spec.tilt:
        tilt = _tilt_point(tilt, d)
    elif tilt is not None:
        raise ValueError(f"tilt is for a tilted design (design='tilted' or ClusterDesign(tilt=True)), not {name!r}")
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
    if isinstance(spec, SketchDesign):
        reserved = sketch_pages(certain, spec.page_size)
        b_design = sketch_budget(budget, n, d, dv, pages=reserved)
        what = f"its sketch ({reserved} pages of page_size={spec.page_size})"
    elif isinstance(spec, ClusterDesign):
        b_design = budget - spec.tokens(d, dv)
        what = f"its sketch ({spec.clusters} clusters, {spec.elements(d, dv)} elements)"
    else:
        b_design = code_budget(budget, n, d, dv, spec)
        what = f"its sketch ({spec.token_bits(dv)} bits per evicted token)"
    if b_design <= certain.sum():
        raise ValueError(
            f"budget = {budget} is too small for the {name} design: {what} leaves an expected "
            f"{b_design:.3g} kept tokens, not above the certainty set |C| = {int(certain.sum())}; raise budget")
    pi = inclusion_probabilities(u, b_design, sinks=sinks, window=window, top=top, floor=floor)
    keep = poisson_sample(pi, seed=seed)
    est = hajek_attention(q, k[keep], v[keep], pi[keep], scale=scale)
    kept = int(keep.sum())
    args = (q, k[keep], v[keep], pi[keep])
    if isinstance(spec, SketchDesign):
        sk = page_sketch(k, v, pi, keep, page_size=spec.page_size)
        var = variance_bound(*args, sk, output=est.output, scale=scale)
        radius = radius_from_variance(var, delta=delta, rule=spec.radius)
        memory = memory_fraction(n, d, dv, kept=kept, pages=int(sk.pages.size))
    elif isinstance(spec, ClusterDesign):
        sk = cluster_sketch(k, v, pi, keep, spec, tilt=tilt, scale=scale)
        var = cluster_variance(*args, sk, output=est.output, scale=scale)
        radius = min(radius_from_variance(var, delta=delta, rule=spec.radius, multiplier=spec.multiplier),
                     hull_bound(v[keep], pi[keep], sk, output=est.output))
        memory = memory_fraction(n, d, dv, kept=kept, extra=spec.elements(d, dv) if kept < n else 0)
    else:
        var = hybrid_variance(*args, code_sketch(k, v, pi, keep, spec), output=est.output, scale=scale)
        radius = radius_from_variance(var, delta=delta, rule=spec.radius, multiplier=spec.multiplier)
        extra = (n - kept) * spec.token_bits(dv) / 16.0 + spec.head_elements(d, dv) if kept < n else 0
        memory = memory_fraction(n, d, dv, kept=kept, extra=extra)
    return EvictionResult(output=est.output, radius=radius, memory=memory, design=name,
                          budget=b_design, kept=kept, variance=float(var))


# ----------------------------------------------------------------------------------------------------
# Code designs (issue 14, second slice): per-token low-rank key codes of the evicted tokens and the
# hybrid variance V_hybrid (exact kept terms, sketched evicted terms).

#: score rules of a code sketch: ``plain`` s_hat = tau q.k_hat; ``lognormal`` s_hat plus the
#: second-moment correction of a Gaussian residual; ``bound`` deterministic upper (and lower) bounds
SCORE_RULES = ("plain", "lognormal", "bound")
#: value rules: ``orthogonal`` ||v_i - o||^2 ~ nu_i^2 + ||mu - o||^2; ``triangle`` (nu_i + ||mu - o||)^2 >= it;
#: ``exact`` keeps the whole value (dv elements per evicted token: the lossless limit, for checks)
VALUE_RULES = ("orthogonal", "triangle", "exact")
#: radius rules of a code design: chebyshev, gaussian, or ``fixed`` = multiplier * sqrt(V)
CODE_RADII = ("chebyshev", "gaussian", "fixed")
#: bits of one stored per-token scalar (fp16): the value norm nu_i, pi_i, and (if used) rho_i
SCALAR_BITS = 16


@dataclass(frozen=True)
class CodeDesign:
    r"""A code design: Poisson sampling plus, for every evicted token, a low-rank key code.

    At eviction the head's prefix keys are centred (mean :math:`m_k`) and projected on their
    top-``rank`` principal directions :math:`P \in \mathbb R^{d\times r}`; each evicted token
    keeps its r coordinates quantized uniformly to ``bits`` bits per coordinate (per-coordinate
    range of the head), its value norm :math:`\nu_i = \lVert v_i - \mu\rVert`, its
    :math:`\pi_i` and, for the ``lognormal`` and ``bound`` score rules, its residual norm
    :math:`\rho_i = \lVert (I - PP^\top)(k_i - m_k)\rVert`.

    Attributes
    ----------
    rank : int in [1, d]
    bits : int in [1, 16], or None for unquantized codes (counted as 16 bits: the lossless limit)
    score : one of :data:`SCORE_RULES`
    value : one of :data:`VALUE_RULES`
    radius : one of :data:`CODE_RADII`
    multiplier : float > 0, the ``fixed`` rule's c in c sqrt(V_hybrid)
    """

    rank: int = 8
    bits: int = 4
    score: str = "lognormal"
    value: str = "orthogonal"
    radius: str = "gaussian"
    multiplier: float = 3.0

    def __post_init__(self):
        for name in ("rank", "bits"):
            x = getattr(self, name)
            if name == "bits" and x is None:
                continue
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 1:
                raise ValueError(f"{name} must be an int >= 1, got {x!r}")
        if self.bits is not None and self.bits > 16:
            raise ValueError(f"bits must be <= 16, got {self.bits}")
        if self.score not in SCORE_RULES:
            raise ValueError(f"score must be one of {SCORE_RULES}, got {self.score!r}")
        if self.value not in VALUE_RULES:
            raise ValueError(f"value must be one of {VALUE_RULES}, got {self.value!r}")
        if self.radius not in CODE_RADII:
            raise ValueError(f"radius must be one of {CODE_RADII}, got {self.radius!r}")
        if not (np.isfinite(self.multiplier) and self.multiplier > 0):
            raise ValueError(f"multiplier must be a finite number > 0, got {self.multiplier!r}")

    def token_bits(self, dv: int = 0) -> int:
        """Bits held per evicted token: r codes, nu_i, pi_i, and rho_i unless ``score == "plain"``
        (the ``exact`` value rule adds the value itself, dv fp16 elements)."""
        scalars = 2 + (self.score != "plain")
        bits = 16 if self.bits is None else self.bits
        return self.rank * bits + scalars * SCALAR_BITS + (dv * 16 if self.value == "exact" else 0)

    def head_elements(self, d: int, dv: int) -> int:
        """Elements (16-bit) held once per head: basis P (d r), key mean (d), code ranges (2 r), mu (dv)."""
        return self.rank * d + d + 2 * self.rank + dv


@dataclass(frozen=True)
class CodeSketch:
    """Per-token sketch of the evicted tokens of one head (see :class:`CodeDesign`).

    Attributes
    ----------
    positions : (U,) int, the evicted tokens
    mean_key : (d,)   basis : (d, r) orthonormal columns   step : (r,) quantization steps
    codes : (U, r) the dequantized coordinates c_hat_i (multiples of ``step`` above the range minimum)
    residual : (U,) rho_i = ||(I - P P^T)(k_i - m_k)||
    value_norm : (U,) nu_i = ||v_i - mu||   pi : (U,)   mu : (dv,) mean of the head's n values
    score_rule, value_rule : str
    values : (U, dv) the evicted values (``exact`` value rule only), else None
    """

    positions: np.ndarray
    mean_key: np.ndarray
    basis: np.ndarray
    step: np.ndarray
    codes: np.ndarray
    residual: np.ndarray
    value_norm: np.ndarray
    pi: np.ndarray
    mu: np.ndarray
    score_rule: str = "lognormal"
    value_rule: str = "orthogonal"
    values: np.ndarray | None = None


def code_sketch(keys, values, pi, keep, design: CodeDesign | None = None) -> CodeSketch:
    r"""Build the code sketch of the evicted tokens (``keep == False``) of one head.

    PCA of all n keys of the head (they are all in memory at eviction):
    :math:`m_k = n^{-1}\sum_i k_i`, P = top-r right singular vectors of the centred keys;
    :math:`c_i = P^\top (k_i - m_k)`, quantized per coordinate j to
    :math:`\hat c_{ij} = a_j + \Delta_j\,\mathrm{round}((c_{ij} - a_j)/\Delta_j)`,
    :math:`\Delta_j = (b_j - a_j)/(2^{\text{bits}} - 1)` over the head's range
    :math:`[a_j, b_j]`, so :math:`|c_{ij} - \hat c_{ij}| \le \Delta_j / 2`.
    """
    design = CodeDesign() if design is None else design
    k, v, p, keep = _sketch_inputs(keys, values, pi, keep)
    n, d = k.shape
    r = min(design.rank, d)
    mk = k.mean(axis=0)
    kc = k - mk
    _, _, vt = np.linalg.svd(kc, full_matrices=False)
    basis = vt[:r].T                                   # (d, r)
    c = kc @ basis                                     # (n, r)
    if design.bits is None:
        step, chat = np.zeros(r), c
    else:
        a, b = c.min(axis=0), c.max(axis=0)
        step = (b - a) / (2 ** design.bits - 1)
        safe = np.where(step > 0, step, 1.0)
        chat = a + np.where(step > 0, np.round((c - a) / safe), 0.0) * step
    gone = np.flatnonzero(~keep)
    resid = np.linalg.norm(kc[gone] - c[gone] @ basis.T, axis=1)
    mu = v.mean(axis=0)
    return CodeSketch(positions=gone, mean_key=mk, basis=basis, step=step, codes=chat[gone], residual=resid,
                      value_norm=np.linalg.norm(v[gone] - mu, axis=1), pi=p[gone], mu=mu,
                      score_rule=design.score, value_rule=design.value,
                      values=v[gone] if design.value == "exact" else None)


def code_scores(q, sketch: CodeSketch, *, scale: float | None = None, kind: str | None = None) -> dict:
    r"""What the sketch says about the evicted tokens' scores, for one or several queries.

    With :math:`\hat s_i = \tau\, q\cdot(m_k + P\hat c_i)`, :math:`q_P = P^\top q`,
    :math:`q_\perp = (I - PP^\top) q` and the exact decomposition
    :math:`s_i - \hat s_i = \tau\, q_P\cdot(c_i - \hat c_i) + \tau\, q_\perp\cdot(k_i - m_k)`:

    - ``plain``: ``first = square = s_hat`` (s_hat stands in for s_i);
    - ``lognormal``: the residual as a centred Gaussian of variance
      :math:`\sigma_i^2 = \tau^2(\lVert q_\perp\rVert^2 \rho_i^2/(d - r) + \sum_j q_{Pj}^2\Delta_j^2/12)`
      (isotropic residual, uniform rounding), so :math:`E e^{s_i} = e^{\hat s_i + \sigma_i^2/2}` and
      :math:`E e^{2 s_i} = e^{2\hat s_i + 2\sigma_i^2}`: ``first = s_hat + sigma^2/2``,
      ``square = s_hat + sigma^2`` (the exponent of the square is 2 ``square``);
    - ``bound``: :math:`|s_i - \hat s_i| \le g_i = \tau(\lVert q_\perp\rVert\rho_i + \sum_j |q_{Pj}|\Delta_j/2)`
      (Cauchy-Schwarz and the rounding bound, exact): ``first = s_hat - g`` (a lower bound, for Z),
      ``square = s_hat + g`` (an upper bound).

    Parameters
    ----------
    q : (d,) or (m, d)
    kind : a score rule, default the sketch's

    Returns
    -------
    dict with ``first``, ``square`` and ``shat``, each (U,) or (m, U)
    """
    kind = sketch.score_rule if kind is None else kind
    if kind not in SCORE_RULES:
        raise ValueError(f"kind must be one of {SCORE_RULES}, got {kind!r}")
    q = np.asarray(q, dtype=np.float64)
    d, r = sketch.basis.shape
    if q.shape[-1] != d or q.ndim not in (1, 2):
        raise ValueError(f"q must have shape (d,) or (m, d) with d = {d}, got shape {q.shape}")
    tau = 1.0 / np.sqrt(d) if scale is None else float(scale)
    if not (tau >= 0 and np.isfinite(tau)):
        raise ValueError(f"scale must be finite and >= 0, got {scale}")
    khat = sketch.mean_key + sketch.codes @ sketch.basis.T           # (U, d)
    shat = tau * q @ khat.T                                           # (U,) or (m, U)
    qp = q @ sketch.basis                                             # (r,) or (m, r)
    qperp = np.sqrt(np.maximum((q * q).sum(-1) - (qp * qp).sum(-1), 0.0))
    if kind == "plain":
        return dict(first=shat, square=shat, shat=shat)
    if kind == "lognormal":
        free = max(d - r, 1)
        var = tau ** 2 * (np.multiply.outer(qperp ** 2, sketch.residual ** 2) / free
                          + ((qp ** 2) @ (sketch.step ** 2) / 12.0)[..., None])
        return dict(first=shat + var / 2.0, square=shat + var, shat=shat)
    gap = tau * (np.multiply.outer(qperp, sketch.residual) + (np.abs(qp) @ sketch.step / 2.0)[..., None])
    return dict(first=shat - gap, square=shat + gap, shat=shat)


def hybrid_variance(q, keys, values, pi, sketch: CodeSketch, *, output, scale: float | None = None) -> float:
    r"""The hybrid variance :math:`V_{\mathrm{hyb}}` of the linearized Hajek error.

    .. math::

        V_{\mathrm{hyb}} = \frac{1}{\tilde Z^2}\Big[\sum_{i\in S}\frac{1-\pi_i}{\pi_i}e^{2 s_i}
            \lVert v_i - \hat o\rVert^2 + \sum_{i\notin S}\frac{1-\pi_i}{\pi_i} e^{2\tilde s_i}
            \tilde D_i\Big],\qquad \tilde Z = \sum_{i\in S} e^{s_i} + \sum_{i\notin S} e^{\tilde s'_i},

    with :math:`\tilde s, \tilde s'` the sketch's ``square`` and ``first`` scores
    (:func:`code_scores`) and :math:`\tilde D_i = \nu_i^2 + \lVert\mu - \hat o\rVert^2`
    (``orthogonal``), :math:`(\nu_i + \lVert\mu - \hat o\rVert)^2` (``triangle``) or
    :math:`\lVert v_i - \hat o\rVert^2` (``exact``, the lossless limit).

    This is not a Horvitz-Thompson estimate (the kept terms are not divided by pi again):
    every token of the population appears once, the kept ones with their exact term, the
    evicted ones through the sketch. Its target is the design variance V itself (DESIGN.md
    section 2, over all n tokens), a fixed number given the population and pi, which is
    what the radius needs: a radius c sqrt(V_hyb) inherits the Chebyshev / Gaussian statement
    about the linearized error whenever V_hyb >= V, and is otherwise only as good as the
    sketch's stand-in for the evicted terms. With an exact sketch (r = d, lossless codes, :math:`\tilde D_i = \lVert v_i -
    \hat o\rVert^2`) and the true o in place of :math:`\hat o`, :math:`V_{\mathrm{hyb}} = V` for
    every sample. With the ``bound`` score rule and the ``triangle`` value rule and the true o,
    :math:`V_{\mathrm{hyb}} \ge V` for every sample (as :func:`variance_bound`).

    Parameters
    ----------
    q : (d,)   keys, values, pi : the kept tokens (m, d), (m, dv), (m,) in (0, 1] (certain tokens
        with pi = 1, e.g. tokens appended after the eviction, contribute to Z only)
    sketch : CodeSketch of the evicted tokens
    output : (dv,) the plug-in o_hat
    """
    q, k, v, p, o = _kept_inputs(q, keys, values, pi, output)
    s = scores(q, k, scale=scale)
    sc = code_scores(q, sketch, scale=scale)
    log_z = logsumexp(np.concatenate([s, sc["first"]])) if (s.size + sc["first"].size) else -np.inf
    a = np.linalg.norm(sketch.mu - o)
    if sketch.value_rule == "exact":
        dist = np.sum((sketch.values - o) ** 2, axis=1)
    elif sketch.value_rule == "orthogonal":
        dist = sketch.value_norm ** 2 + a ** 2
    else:
        dist = (sketch.value_norm + a) ** 2
    logs = []
    for ratio, sq, dd in (((1.0 - p) / p, s, np.sum((v - o) ** 2, axis=1)),
                          ((1.0 - sketch.pi) / sketch.pi, sc["square"], dist)):
        m = (ratio > 0) & (dd > 0)
        logs.append(np.log(ratio[m]) + 2.0 * sq[m] + np.log(dd[m]))
    terms = np.concatenate(logs)
    if terms.size == 0:
        return 0.0
    return float(np.exp(logsumexp(terms) - 2.0 * log_z))


# ----------------------------------------------------------------------------------------------------
# Cluster designs: per-cluster Gaussian moments of the evicted keys (no per-token memory).


@dataclass(frozen=True)
class ClusterDesign:
    r"""A cluster design: Poisson sampling plus weighted Gaussian moments of the evicted keys per cluster.

    At eviction the head's n keys are split into ``clusters`` groups by Lloyd's k-means
    (:func:`kmeans_assign`, deterministic). For every cluster c with evicted tokens U_c the
    sketch keeps, with :math:`w_i = (1-\pi_i)/\pi_i`: the w-weighted mean key :math:`m_c`
    and per-channel variance :math:`\sigma^2_c` (2d elements), :math:`W_c = \sum w_i`,
    :math:`Y_c = \sum w_i \nu_i^2` (:math:`\nu_i = \lVert v_i - \mu\rVert`) and
    :math:`N_c = |U_c|` (3 scalars); per head the value centre :math:`\mu` (dv).

    On the real model's T2 cells (docs/research/issue14/RESULTS_T2.md) the defaults
    (16 clusters, ``gaussian``) cover (pooled >= 0.996, worst decile >= 0.96, silent <= 0.32%)
    at <= 1.06x the paper design's error, but the radius is 5.7-7.8x the RMS error: the
    Gaussian moment step over-estimates the evicted part in most cells (it is exact only for
    Gaussian keys), so this design does not replace the default.

    With ``tilt=True`` (the *tilted* cluster design, docs/theory.md section 8, "Fifth
    slice") the moments are taken at a tilt point :math:`q_0` (the mean observation-window
    query of the KV head's query group, given at eviction): for the squared terms under the
    weights :math:`\omega_i \propto w_i e^{2\tau q_0\cdot k_i}` (mean :math:`\tilde m_c`,
    variance :math:`\tilde\sigma^2_c`, masses :math:`S_c = \sum w_i e^{2\tau q_0\cdot k_i}`,
    :math:`Y_c = \sum w_i \nu_i^2 e^{2\tau q_0\cdot k_i}`), for :math:`\tilde Z` under
    :math:`e^{\tau q_0\cdot k_i}` (mean :math:`m'_c`, variance :math:`\sigma'^2_c`, mass
    :math:`N_c = \sum e^{\tau q_0\cdot k_i}`), and the Gaussian step is taken in
    :math:`r = q - q_0`: exact at :math:`q = q_0` for any keys. The masses are held scaled by
    :math:`e^{-2h_c}` / :math:`e^{-h_c}` with :math:`h_c = \max_{U_c}\tau q_0\cdot k_i` (one
    more scalar, so no overflow): C (4d + 4) + d + dv + 1 elements per head with :math:`q_0`.

    Attributes
    ----------
    clusters : int >= 1
    iterations : int >= 0, Lloyd iterations
    radius : one of :data:`CODE_RADII`   multiplier : float > 0 (``fixed``)
    tilt : bool, the tilted design (needs the tilt point at eviction)
    """

    clusters: int = 16
    iterations: int = 10
    radius: str = "gaussian"
    multiplier: float = 3.0
    tilt: bool = False

    def __post_init__(self):
        for name, low in (("clusters", 1), ("iterations", 0)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < low:
                raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
        if self.radius not in CODE_RADII:
            raise ValueError(f"radius must be one of {CODE_RADII}, got {self.radius!r}")
        if not (np.isfinite(self.multiplier) and self.multiplier > 0):
            raise ValueError(f"multiplier must be a finite number > 0, got {self.multiplier!r}")
        if not isinstance(self.tilt, (bool, np.bool_)):
            raise ValueError(f"tilt must be a bool, got {self.tilt!r}")

    def elements(self, d: int, dv: int) -> int:
        """Elements held by the sketch of one head: C (2d + 3) + dv + 1, tilted C (4d + 4) + d + dv + 1
        (the + 1: ``reach``, the evicted values' largest distance to mu, for :func:`hull_bound`)."""
        if self.tilt:
            return self.clusters * (4 * d + TILTED_SCALARS) + d + dv + HEAD_SCALARS
        return self.clusters * (2 * d + CLUSTER_SCALARS) + dv + HEAD_SCALARS

    def tokens(self, d: int, dv: int) -> float:
        """:meth:`elements` in kept-token units of d + dv + 1 elements (key, value, log pi)."""
        return self.elements(d, dv) / float(d + dv + TOKEN_SCALARS)


#: per-cluster scalars beside the 2 d moments (W_c, Y_c, N_c)
CLUSTER_SCALARS = 3
#: per-head scalars of a cluster sketch beside mu (and q0): ``reach``, for :func:`hull_bound`
HEAD_SCALARS = 1
#: per-cluster scalars of the tilted design beside its 4 d moments (S_c, Y_c, N_c and the exponent h_c)
TILTED_SCALARS = 4
#: the tilted design ``design="tilted"`` names: 8 clusters (its memory is about the 16-cluster
#: design's) and the radius 3 sqrt(V) (docs/research/issue14/RESULTS_T2.md, "Fifth slice")
TILTED = ClusterDesign(clusters=8, radius="fixed", multiplier=3.0, tilt=True)


@dataclass(frozen=True)
class ClusterSketch:
    """Per-cluster moments of the evicted tokens (clusters without an evicted token are dropped).

    Attributes
    ----------
    mean : (C, d) w-weighted mean key   var : (C, d) w-weighted per-channel variance
    weight : (C,) W_c = sum (1 - pi)/pi   wnorm : (C,) Y_c = sum (1 - pi)/pi nu^2   count : (C,) N_c
    mu : (dv,)

    A tilted sketch (``ClusterDesign(tilt=True)``) also holds ``tilt`` (d,) the tilt point q0,
    ``zmean`` / ``zvar`` (C, d) the moments under e^{tau q0.k} and ``shift`` (C,) h_c; then
    ``mean`` / ``var`` are the moments under w e^{2 tau q0.k}, ``weight`` = S_c e^{-2 h_c},
    ``wnorm`` = Y_c e^{-2 h_c}, ``count`` = N_c e^{-h_c}. Untilted: those four are None.
    ``reach`` is max over the evicted tokens of ||v_i - mu|| (0 when none is evicted), the sketch's
    part of :func:`hull_bound`; None (a sketch built by hand without it): no hull bound.
    """

    mean: np.ndarray
    var: np.ndarray
    weight: np.ndarray
    wnorm: np.ndarray
    count: np.ndarray
    mu: np.ndarray
    tilt: np.ndarray | None = None
    zmean: np.ndarray | None = None
    zvar: np.ndarray | None = None
    shift: np.ndarray | None = None
    reach: float | None = None


def kmeans_assign(keys, clusters: int, *, iterations: int = 10) -> np.ndarray:
    """Deterministic Lloyd k-means of the keys: (n,) cluster index in [0, clusters).

    Initial centres: the keys at the evenly spaced quantiles of the projection on the first
    principal direction (ties and empty clusters keep their previous centre).
    """
    k = np.asarray(keys, dtype=np.float64)
    n = k.shape[0]
    C = min(int(clusters), n)
    kc = k - k.mean(axis=0)
    _, _, vt = np.linalg.svd(kc, full_matrices=False)
    order = np.argsort(kc @ vt[0], kind="stable")
    centres = k[order[((np.arange(C) + 0.5) * n / C).astype(int)]].copy()
    k2 = (k * k).sum(1)
    for _ in range(iterations + 1):
        dist = k2[:, None] - 2.0 * k @ centres.T + (centres * centres).sum(1)[None, :]
        lab = np.argmin(dist, axis=1)
        cnt = np.bincount(lab, minlength=C)
        sums = np.zeros_like(centres)
        np.add.at(sums, lab, k)
        nz = cnt > 0
        centres[nz] = sums[nz] / cnt[nz, None]
    return lab


def _weighted_moments(k, weights, inv, C: int):
    """Per-cluster mass, weighted mean and per-channel variance of keys ``k`` under ``weights``."""
    d = k.shape[1]
    mass = np.bincount(inv, weights=weights, minlength=C)
    ms = np.where(mass > 0, mass, 1.0)
    mean = np.zeros((C, d))
    np.add.at(mean, inv, weights[:, None] * k)
    mean /= ms[:, None]
    var = np.zeros((C, d))
    np.add.at(var, inv, weights[:, None] * (k - mean[inv]) ** 2)
    var /= ms[:, None]
    return mass, mean, var


def cluster_sketch(keys, values, pi, keep, design: ClusterDesign | None = None, *, labels=None,
                   tilt=None, scale: float | None = None) -> ClusterSketch:
    r"""Build the cluster sketch of the evicted tokens (``keep == False``); ``labels`` (n,) overrides k-means.

    A tilted design (``design.tilt``) needs ``tilt``: the tilt point :math:`q_0` (d,), or the
    observation-window queries (w, d) whose mean it is; ``scale`` is :math:`\tau` (default
    1/sqrt(d)). With :math:`e_i = \tau q_0\cdot k_i` and :math:`h_c = \max_{U_c} e_i`:

    .. math::

        S_c e^{-2h_c} = \sum_{U_c} w_i e^{2(e_i - h_c)},\quad
        Y_c e^{-2h_c} = \sum_{U_c} w_i \nu_i^2 e^{2(e_i - h_c)},\quad
        N_c e^{-h_c} = \sum_{U_c} e^{e_i - h_c},

    ``mean`` / ``var`` weighted by :math:`w_i e^{2 e_i}`, ``zmean`` / ``zvar`` by :math:`e^{e_i}`.
    """
    design = ClusterDesign() if design is None else design
    k, v, p, keep = _sketch_inputs(keys, values, pi, keep)
    n, d = k.shape
    lab = kmeans_assign(k, design.clusters, iterations=design.iterations) if labels is None else np.asarray(labels)
    mu = v.mean(axis=0)
    gone = np.flatnonzero(~keep)
    used, inv = np.unique(lab[gone], return_inverse=True)
    C = used.size
    w = (1.0 - p[gone]) / p[gone]
    nu2 = np.sum((v[gone] - mu) ** 2, axis=1)
    reach = float(np.sqrt(nu2.max())) if gone.size else 0.0
    if not design.tilt:
        if tilt is not None:
            raise ValueError("tilt is for a tilted design (ClusterDesign(tilt=True)); this design has tilt=False")
        # w-weighted moments; a cluster whose evicted tokens all have pi = 1 cannot occur (pi = 1 is kept)
        W, mean, var = _weighted_moments(k[gone], w, inv, C)
        Y = np.bincount(inv, weights=w * nu2, minlength=C)
        N = np.bincount(inv, minlength=C).astype(np.float64)
        return ClusterSketch(mean=mean, var=var, weight=W, wnorm=Y, count=N, mu=mu, reach=reach)
    q0 = _tilt_point(tilt, d)
    tau = 1.0 / np.sqrt(d) if scale is None else float(scale)
    e = tau * k[gone] @ q0
    h = np.full(C, -np.inf)
    np.maximum.at(h, inv, e)
    x = e - h[inv]                                                     # <= 0
    S, mean, var = _weighted_moments(k[gone], w * np.exp(2.0 * x), inv, C)
    Y = np.bincount(inv, weights=w * nu2 * np.exp(2.0 * x), minlength=C)
    N, zmean, zvar = _weighted_moments(k[gone], np.exp(x), inv, C)
    return ClusterSketch(mean=mean, var=var, weight=S, wnorm=Y, count=N, mu=mu, tilt=q0, zmean=zmean, zvar=zvar,
                         shift=h, reach=reach)


def _tilt_point(tilt, d: int) -> np.ndarray:
    """The tilt point q0 (d,) from ``tilt``: q0 itself (d,) or window queries (w, d), averaged."""
    if tilt is None:
        raise ValueError("tilt is required by a tilted design (ClusterDesign(tilt=True)): the tilt point q0 (d,) "
                         "or the observation-window queries (w, d) whose mean it is")
    t = np.asarray(tilt, dtype=np.float64)
    if t.ndim == 2 and t.shape[0] >= 1 and t.shape[1] == d:
        t = t.mean(axis=0)
    if t.shape != (d,) or not np.all(np.isfinite(t)):
        raise ValueError(f"tilt must be a finite (d,) = ({d},) point or (w, d) = (w, {d}) window queries, "
                         f"got shape {np.shape(tilt)}")
    return t


def hull_bound(values, pi, sketch: ClusterSketch, *, output) -> float:
    r"""A deterministic bound on :math:`\lVert\hat o - o\rVert` from the values' convex hull.

    The exact output :math:`o` and the Hajek estimate :math:`\hat o` are both convex combinations of
    the head's values (every token: kept, evicted, and those added after the eviction), so for the
    sketch's centre :math:`\mu`

    .. math::

        \lVert\hat o - o\rVert \le \lVert\hat o - \mu\rVert + \max_i \lVert v_i - \mu\rVert
            \le \lVert\hat o - \mu\rVert + \max\big(\rho_U,\ \max_{i\in S}\lVert v_i - c\rVert
            + \lVert c - \mu\rVert\big),

    :math:`\rho_U` = ``sketch.reach`` (the evicted tokens' largest :math:`\lVert v_i - \mu\rVert`, held
    at eviction) and :math:`c` the mean of the kept values (``kvcert.fast.value_moments``: the kept
    part goes through the distances the decode already has). No probability is involved: it holds
    for every draw. The cluster designs' radius is the smaller of their rule's radius and this
    bound, which only binds where the rule's radius is large (docs/theory.md section 8).

    Parameters
    ----------
    values : (n, dv), the kept tokens' values   pi : (n,), 0 on padding
    sketch : ClusterSketch   output : (dv,), the Hajek estimate o_hat

    Returns
    -------
    float, +inf when the sketch holds no ``reach`` (built without it) or nothing is kept.
    """
    v = np.asarray(values, dtype=np.float64)
    p = np.asarray(pi, dtype=np.float64)
    o = np.asarray(output, dtype=np.float64)
    if v.ndim != 2 or p.shape != (v.shape[0],) or o.shape != (v.shape[1],):
        raise ValueError(f"values must be (n, dv), pi (n,) and output (dv,), got {v.shape}, {p.shape}, {o.shape}")
    kept = v[p > 0]
    if sketch.reach is None or kept.shape[0] == 0:
        return float("inf")
    mu = np.asarray(sketch.mu, dtype=np.float64)
    c = kept.mean(axis=0)
    inside = float(np.sqrt(np.max(np.sum((kept - c) ** 2, axis=1)))) + float(np.linalg.norm(c - mu))
    return float(np.linalg.norm(o - mu)) + max(float(sketch.reach), inside)


def cluster_variance(q, keys, values, pi, sketch: ClusterSketch, *, output, scale: float | None = None) -> float:
    r"""The hybrid variance with the evicted part from per-cluster Gaussian moments.

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
    Same target as :func:`hybrid_variance`: V itself.

    A tilted sketch (``sketch.tilt`` not None) takes the step in :math:`r = q - q_0` with its
    tilted moments (:func:`cluster_sketch`):

    .. math::

        \sum_c (Y_c + S_c \lVert\mu - \hat o\rVert^2)\, e^{2\tau r\cdot\tilde m_c
            + 2\tau^2\sum_j r_j^2\tilde\sigma^2_{cj}},\qquad
        \sum_c N_c\, e^{\tau r\cdot m'_c + \tau^2\sum_j r_j^2\sigma'^2_{cj}/2},

    the exponential-tilting identity :math:`\sum_{U_c} w_i e^{2\tau q\cdot k_i} =
    S_c\,E_\omega[e^{2\tau r\cdot k}]` with the Gaussian step on :math:`\omega`: exact at
    :math:`q = q_0` for any keys (docs/theory.md section 8, fifth slice).
    """
    q, k, v, p, o = _kept_inputs(q, keys, values, pi, output)
    tau = 1.0 / np.sqrt(q.shape[0]) if scale is None else float(scale)
    s = scores(q, k, scale=scale)
    r = q if sketch.tilt is None else q - sketch.tilt
    h = 0.0 if sketch.shift is None else sketch.shift
    lin = tau * sketch.mean @ r + h
    quad = tau ** 2 * sketch.var @ (r * r)
    zmean = sketch.mean if sketch.zmean is None else sketch.zmean
    zvar = sketch.var if sketch.zvar is None else sketch.zvar
    zexp = tau * zmean @ r + h + tau ** 2 * zvar @ (r * r) / 2.0
    log_z = logsumexp(np.concatenate([s, np.log(np.maximum(sketch.count, 1e-300)) + zexp]))
    a2 = float(np.sum((sketch.mu - o) ** 2))
    ratio = (1.0 - p) / p
    dd = np.sum((v - o) ** 2, axis=1)
    m = (ratio > 0) & (dd > 0)
    ev = sketch.wnorm + a2 * sketch.weight
    me = ev > 0
    terms = np.concatenate([np.log(ratio[m]) + 2.0 * s[m] + np.log(dd[m]),
                            np.log(ev[me]) + 2.0 * lin[me] + 2.0 * quad[me]])
    if terms.size == 0:
        return 0.0
    return float(np.exp(logsumexp(terms) - 2.0 * log_z))
