r"""The page and code designs of the sketched-design study (research code, not part of kvcert).

Two sketches of the evicted tokens measured in this folder and not shipped by the library: the
*page* design (Quest-style per-page key bounds of the evicted tokens and a variance bound V_bar that
holds for every sample) and the *code* design (per-token low-rank key codes and the hybrid variance
V_hyb). Findings: RESULTS.md, RESULTS_T2.md and docs/theory.md section 8 ("Sketched designs"). The
library keeps the cluster and tilted designs (``kvcert.reference.sketch``, ``kvcert.fast``); this
module is built from their public pieces and the public reference estimators only.

One KV head, one query, float64 NumPy.

Memory accounting (in elements of the K/V dtype, e.g. fp16; one head):

- full cache: :math:`n (d + d_v)`;
- a kept token: :math:`d + d_v + 1` (its key, value and :math:`\log\pi_i`);
  when nothing is evicted the cache *is* the full cache (no :math:`\log\pi`);
- a sketched page: :math:`2d + 3` (key min and max, the value radius, the
  smallest :math:`\pi`, the evicted count), plus :math:`d_v` per head for the
  value centre :math:`\mu`;
- a code design: ``CodeDesign.token_bits / 16`` elements per evicted token and
  ``CodeDesign.head_elements`` per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

from kvcert.reference import (certainty_mask, evict_and_certify as library_evict_and_certify, hajek_attention,
                              inclusion_probabilities, poisson_sample, scores)
from kvcert.reference.sketch import RADIUS_RULES, EvictionResult, radius_from_variance

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


def _as_qkv(q, keys, values):
    """``(q (d,), keys (n, d), values (n, dv))`` as finite float64 arrays, checked."""
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


#: score rules of a code sketch: ``plain`` s_hat = tau q.k_hat; ``lognormal`` s_hat plus the
#: second-moment correction of a Gaussian residual; ``bound`` deterministic upper (and lower) bounds
SCORE_RULES = ("plain", "lognormal", "bound")
#: value rules: ``orthogonal`` ||v_i - o||^2 ~ nu_i^2 + ||mu - o||^2; ``triangle`` (nu_i + ||mu - o||)^2 >= it;
#: ``exact`` keeps the whole value (dv elements per evicted token: the lossless limit, for checks)
VALUE_RULES = ("orthogonal", "triangle", "exact")
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
    radius : a name of ``kvcert.reference.sketch.RADIUS_RULES``
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
        if self.radius not in RADIUS_RULES:
            raise ValueError(f"radius must be one of {tuple(RADIUS_RULES)}, got {self.radius!r}")
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
    evicted ones through the sketch. Its target is the design variance V itself (docs/theory.md,
    over all n tokens), a fixed number given the population and pi, which is
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


def evict_and_certify(q, keys, values, importance, budget, *, seed: int, delta: float = 0.05, design="paper",
                      sinks: int = 4, window: int = 32, top: int = 0, floor: float = 0.1,
                      scale: float | None = None) -> EvictionResult:
    r"""``kvcert.reference.evict_and_certify`` extended to the page and code designs of this module.

    ``design="page"`` or a :class:`SketchDesign`: sampling at the reduced budget :func:`sketch_budget`
    (equal memory), the Hajek estimate, a :func:`page_sketch` of the evicted tokens and the radius
    :math:`\sqrt{\bar V/\delta}` (``chebyshev``) or :math:`z_{1-\delta/2}\sqrt{\bar V}` (``gaussian``),
    :math:`\bar V` from :func:`variance_bound`. ``design="code"`` or a :class:`CodeDesign`: sampling at
    :func:`code_budget`, a :func:`code_sketch` and the radius on :math:`V_{\mathrm{hyb}}`
    (:func:`hybrid_variance`). Every other design goes to the library's function. Both sketched designs keep
    the given ``top`` (the certainty set is the paper design's); only the Poisson tail shrinks.
    """
    if isinstance(design, str) and design in ("page", "code"):
        design = SketchDesign() if design == "page" else CodeDesign()
    if not isinstance(design, (SketchDesign, CodeDesign)):
        return library_evict_and_certify(q, keys, values, importance, budget, seed=seed, delta=delta, design=design,
                                         sinks=sinks, window=window, top=top, floor=floor, scale=scale)
    q, k, v = _as_qkv(q, keys, values)
    n, d = k.shape
    dv = v.shape[1]
    u = np.asarray(importance, dtype=np.float64)
    if u.shape != (n,):
        raise ValueError(f"importance must have shape (n,) = ({n},), got shape {u.shape}")
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    budget = min(float(budget), float(n))
    name = "page" if isinstance(design, SketchDesign) else "code"
    if budget >= n:
        return EvictionResult(output=hajek_attention(q, k, v, np.ones(n), scale=scale).output, radius=0.0,
                              memory=1.0, design=name, budget=float(n), kept=n, variance=0.0)
    certain = certainty_mask(u, sinks=sinks, window=window, top=top)
    if isinstance(design, SketchDesign):
        reserved = sketch_pages(certain, design.page_size)
        b_design = sketch_budget(budget, n, d, dv, pages=reserved)
    else:
        b_design = code_budget(budget, n, d, dv, design)
    if b_design <= certain.sum():
        raise ValueError(f"budget = {budget} is too small for the {name} design: its sketch leaves an expected "
                         f"{b_design:.3g} kept tokens, not above the certainty set |C| = {int(certain.sum())}")
    pi = inclusion_probabilities(u, b_design, sinks=sinks, window=window, top=top, floor=floor)
    keep = poisson_sample(pi, seed=seed)
    est = hajek_attention(q, k[keep], v[keep], pi[keep], scale=scale)
    kept = int(keep.sum())
    args = (q, k[keep], v[keep], pi[keep])
    if isinstance(design, SketchDesign):
        sk = page_sketch(k, v, pi, keep, page_size=design.page_size)
        var = variance_bound(*args, sk, output=est.output, scale=scale)
        radius = radius_from_variance(var, delta=delta, rule=design.radius)
        memory = memory_fraction(n, d, dv, kept=kept, pages=int(sk.pages.size))
    else:
        var = hybrid_variance(*args, code_sketch(k, v, pi, keep, design), output=est.output, scale=scale)
        radius = radius_from_variance(var, delta=delta, rule=design.radius, multiplier=design.multiplier)
        extra = (n - kept) * design.token_bits(dv) / 16.0 + design.head_elements(d, dv) if kept < n else 0
        memory = memory_fraction(n, d, dv, kept=kept, extra=extra)
    return EvictionResult(output=est.output, radius=radius, memory=memory, design=name,
                          budget=b_design, kept=kept, variance=float(var))
