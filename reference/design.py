"""The sampling design: inclusion probabilities and Poisson sampling.

Everything here is plain float64 NumPy, one KV head at a time, written to be
read beside docs/design.md section 2 and the paper (arXiv 2607.21475).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "edge_mask",
    "certainty_mask",
    "inclusion_probabilities",
    "budget_from_fraction",
    "design_generator",
    "design_uniforms",
    "poisson_sample",
    "systematic_sample",
    "SAMPLINGS",
    "compact_slots",
]


def check_nonneg_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_importance(importance) -> np.ndarray:
    u = np.asarray(importance, dtype=np.float64)
    if u.ndim != 1:
        raise ValueError(f"importance must have shape (n,), got shape {u.shape}")
    if u.size == 0:
        raise ValueError("importance is empty (n = 0): there is nothing to evict")
    if not np.all(np.isfinite(u)):
        raise ValueError("importance must be finite (found NaN or inf)")
    if np.any(u < 0):
        raise ValueError(f"importance must be >= 0, found min {u.min():.3g}")
    return u


def edge_mask(n: int, *, sinks: int = 4, window: int = 32) -> np.ndarray:
    """Boolean mask (n,) of the first ``sinks`` and the last ``window`` tokens."""
    n = check_nonneg_int("n", n)
    sinks = check_nonneg_int("sinks", sinks)
    window = check_nonneg_int("window", window)
    mask = np.zeros(n, dtype=bool)
    mask[: min(sinks, n)] = True
    if window:
        mask[max(n - window, 0) :] = True
    return mask


def certainty_mask(importance, *, sinks: int = 4, window: int = 32, top: int = 0) -> np.ndarray:
    """Boolean mask of the certainty set C (tokens kept with pi = 1).

    C is the union of the first ``sinks`` tokens, the last ``window`` tokens and
    the ``top`` highest-importance tokens among the others (ties broken by the
    lower index, so the set is a deterministic function of ``importance``).

    Parameters
    ----------
    importance : array_like, shape (n,)
        Non-negative token importance.
    sinks, window, top : int
        Sizes of the three parts; overlaps are counted once, and ``top`` is
        clipped to the number of tokens left outside sinks and window.

    Returns
    -------
    ndarray of bool, shape (n,)
    """
    u = _check_importance(importance)
    top = check_nonneg_int("top", top)
    certain = edge_mask(u.size, sinks=sinks, window=window)
    free = np.flatnonzero(~certain)
    if top and free.size:
        # stable sort on -u: highest importance first, lower index on ties
        order = free[np.argsort(-u[free], kind="stable")]
        certain[order[: min(top, free.size)]] = True
    return certain


def budget_from_fraction(n: int, fraction: float) -> float:
    """Expected kept count for keeping ``fraction`` of ``n`` tokens.

    ``budget = fraction * n``; kvpress's ``compression_ratio`` is
    ``1 - fraction``.
    """
    n = check_nonneg_int("n", n)
    fraction = float(fraction)
    if not (0.0 < fraction <= 1.0):
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return fraction * n


def _capped_pps(w: np.ndarray, m: float) -> np.ndarray:
    """pi_i = min(1, lam * w_i) with sum(pi) = m, for w > 0 and 0 < m < len(w).

    Standard PPS capping: sort w descending; with k tokens capped at 1 the
    rest share m - k, lam_k = (m - k) / sum_{j > k} w_(j). The solution is the
    smallest k with lam_k * w_(k+1) <= 1 (lam is then consistent: every capped
    token has lam * w >= 1). Exact and O(t log t).
    """
    t = w.size
    order = np.argsort(-w, kind="stable")
    ws = w[order]
    # suffix[k] = sum_{j >= k} ws[j] (0-based): mass left when k are capped
    suffix = np.cumsum(ws[::-1])[::-1]
    k = np.arange(t)
    lam = (m - k) / suffix
    ok = (lam * ws <= 1.0) & (m - k > 0)
    kstar = int(np.argmax(ok))  # ok[t-1] holds whenever m < t (see Notes)
    pi_sorted = np.empty(t)
    pi_sorted[:kstar] = 1.0
    pi_sorted[kstar:] = lam[kstar] * ws[kstar:]
    pi = np.empty(t)
    pi[order] = np.minimum(pi_sorted, 1.0)
    return pi


def inclusion_probabilities(
    importance,
    budget: float,
    *,
    sinks: int = 4,
    window: int = 32,
    top: int = 0,
    floor: float = 0.1,
) -> np.ndarray:
    r"""Inclusion probabilities of the Poisson eviction design.

    .. math::

        u'_i = (1-\alpha)\,\frac{u_i}{\sum_{j\in T} u_j} + \frac{\alpha}{|T|},
        \qquad \pi_i = \min(1, \lambda u'_i)\ (i \in T), \qquad \pi_i = 1\ (i \in C),

    with :math:`\lambda` solved so that :math:`\sum_i \pi_i = B` (the budget,
    the expected kept count with the certainty set C included). Tokens whose
    :math:`\lambda u'_i` exceeds 1 are capped and join the certain tokens;
    :math:`\lambda` is re-solved on the rest (exact PPS capping).

    Parameters
    ----------
    importance : array_like, shape (n,)
        Non-negative importance u (e.g. SnapKV observation-window attention).
    budget : float
        Expected number of kept tokens, ``|C| < budget <= n`` (``budget = n``
        keeps everything; ``budget = |C|`` is refused because the tail would
        get pi = 0 and could never be observed). Use
        :func:`budget_from_fraction` for a fraction.
    sinks, window, top : int
        Certainty set, see :func:`certainty_mask`.
    floor : float
        Defensive mixture weight alpha in (0, 1]: every tail token gets at
        least ``alpha / |T|`` of the tail's share, so pi_i > 0 for all i.

    Returns
    -------
    pi : ndarray, shape (n,), float64, values in (0, 1]

    Notes
    -----
    If the tail mass is zero (all u_i = 0 on T) the tail is uniform. With
    ``budget == n`` every pi is 1 and the estimator is exact attention. A
    solution with ``k* < t`` always exists when ``m = budget - |C| < t``: at
    ``k = t - 1``, ``lam * w = m - t + 1 < 1``.

    References
    ----------
    Sarndal, Swensson & Wretman (1992), Model Assisted Survey Sampling, sec. 3.6.
    arXiv 2607.21475.

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import inclusion_probabilities
    >>> pi = inclusion_probabilities(np.arange(10.0), 6, sinks=1, window=2)
    >>> round(float(pi.sum()), 12), float(pi[0]), float(pi[-1])
    (6.0, 1.0, 1.0)
    """
    u = _check_importance(importance)
    n = u.size
    budget = float(budget)
    if not np.isfinite(budget):
        raise ValueError(f"budget must be finite, got {budget}")
    floor = float(floor)
    if not (0.0 < floor <= 1.0):
        raise ValueError(
            f"floor must be in (0, 1] (a zero floor gives pi = 0 to zero-importance "
            f"tokens, which breaks unbiasedness), got {floor}"
        )
    certain = certainty_mask(u, sinks=sinks, window=window, top=top)
    c = int(certain.sum())
    if budget > n:
        raise ValueError(f"budget must be <= n = {n}, got {budget}")
    pi = np.ones(n)
    t = n - c
    if t == 0:
        if budget < n:
            raise ValueError(
                f"budget = {budget} < n = {n}, but every token is in the certainty set "
                f"(sinks={sinks}, window={window}, top={top})"
            )
        return pi
    if budget <= c:
        raise ValueError(
            f"budget must exceed the certainty set size |C| = {c} "
            f"(sinks={sinks}, window={window}, top={top}), got {budget}"
        )
    m = budget - c  # expected kept count of the tail
    if m >= t:  # budget == n
        return pi
    ut = u[~certain]
    mass = ut.sum()
    share = ut / mass if mass > 0 else np.full(t, 1.0 / t)
    w = (1.0 - floor) * share + floor / t
    pi[~certain] = _capped_pps(w, m)
    return pi


def design_generator(seed: int, layer: int = 0, kv_head: int = 0, event: int = 0) -> np.random.Generator:
    """Independent, replayable random stream for one (layer, KV head, event).

    ``np.random.default_rng(SeedSequence([seed, layer, kv_head, event]))``:
    distinct tuples give statistically independent streams, the same tuple
    replays the same draws.
    """
    for name, v in (("seed", seed), ("layer", layer), ("kv_head", kv_head), ("event", event)):
        check_nonneg_int(name, v)
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(layer), int(kv_head), int(event)]))


def design_uniforms(n: int, seed: int, layer: int = 0, kv_head: int = 0, event: int = 0) -> np.ndarray:
    """The n uniforms U_i in [0, 1) that decide inclusion (I_i = U_i < pi_i).

    Other backends that want masks identical to the reference consume these.
    """
    return design_generator(seed, layer, kv_head, event).random(check_nonneg_int("n", n))


def poisson_sample(pi, *, seed: int | None = None, generator: np.random.Generator | None = None,
                   uniforms=None) -> np.ndarray:
    r"""Poisson sampling: independent :math:`I_i \sim \mathrm{Bernoulli}(\pi_i)`.

    :math:`I_i = [U_i < \pi_i]` with :math:`U_i \sim U[0, 1)`, so pi = 1 is
    always kept and pi = 0 never. :math:`E|S| = \sum \pi_i`,
    :math:`\mathrm{Var}|S| = \sum \pi_i (1 - \pi_i)`.

    Parameters
    ----------
    pi : array_like, shape (n,)
        Inclusion probabilities in [0, 1].
    seed, generator, uniforms
        Exactly one source of randomness: an int seed (the stream of
        ``design_generator(seed)``), a ``numpy.random.Generator``, or the
        uniforms themselves (shape (n,), in [0, 1)).

    Returns
    -------
    keep : ndarray of bool, shape (n,)
    """
    p, u, _ = _sample_inputs(pi, seed, generator, uniforms)
    return u < p


def _sample_inputs(pi, seed, generator, uniforms):
    """A sample's checked inputs: pi (n,) float64, the uniforms (given, or the first n draws of the generator
    or of ``design_generator(seed)``) and that generator (None with ``uniforms``), for a design that draws more."""
    p = np.asarray(pi, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"pi must have shape (n,), got shape {p.shape}")
    if not np.all((p >= 0) & (p <= 1)):  # also catches NaN
        raise ValueError("pi must lie in [0, 1] (found a value outside, or NaN)")
    given = sum(x is not None for x in (seed, generator, uniforms))
    if given != 1:
        raise TypeError("pass exactly one of seed=, generator= or uniforms=")
    if uniforms is not None:
        u = np.asarray(uniforms, dtype=np.float64)
        if u.shape != p.shape:
            raise ValueError(f"uniforms must have shape {p.shape}, got {u.shape}")
        if not np.all((u >= 0) & (u < 1)):
            raise ValueError("uniforms must lie in [0, 1)")
        return p, u, None
    gen = generator if generator is not None else design_generator(seed)
    if not isinstance(gen, np.random.Generator):
        raise TypeError(f"generator must be a numpy.random.Generator, got {type(gen).__name__}")
    return p, gen.random(p.size), gen


def systematic_sample(pi, *, seed: int | None = None, generator: np.random.Generator | None = None,
                      uniforms=None, start: float | None = None) -> np.ndarray:
    r"""Randomized systematic sampling: a fixed-size design with exactly the inclusion probabilities pi.

    The certain tokens (:math:`\pi_i = 1`) are kept. The others are put in a random order, the
    order of their uniforms :math:`U_i` (ascending, ties by index), and laid end to end on [0, T),
    token i on :math:`[c_{i-1}, c_i)` with :math:`c_i` the running sum of the tail's pi in that
    order and :math:`T = \sum_{\pi_j < 1} \pi_j`; one more uniform, the start :math:`s \in [0, 1)`,
    picks the points :math:`s, s + 1, s + 2, \dots` and token i is kept when one falls in its
    interval:

    .. math:: I_i = [\lfloor c_i - s \rfloor > \lfloor c_{i-1} - s \rfloor], \qquad
              P(I_i = 1) = \pi_i, \qquad |S| \in \{\lfloor \textstyle\sum_i \pi_i \rfloor,
              \lceil \textstyle\sum_i \pi_i \rceil\}.

    Each interval is shorter than 1, so it holds at most one point, and s is uniform, so it holds
    one with probability its length :math:`\pi_i`: the marginal inclusion probabilities are the
    Poisson design's, but the sample size no longer varies (Madow 1949; in random order, Goodman &
    Kish 1950 and Hartley & Rao 1962, who show the joint inclusion probabilities approach those of
    the maximum-entropy fixed-size design). Hajek's estimator and its Poisson-form variance
    estimate are used unchanged: for a high-entropy fixed-size design the variance of a total is at
    most the Poisson form's (it subtracts the regression of the residuals on pi; Hajek 1964), so the
    certificate stays conservative to first order (docs/theory.md section 7.7).

    Parameters
    ----------
    pi : array_like, shape (n,)
        Inclusion probabilities in [0, 1].
    seed, generator, uniforms
        Exactly one source of randomness: an int seed (``design_generator(seed)``: n uniforms, then the
        start), a ``numpy.random.Generator`` (the same order of draws), or the uniforms themselves
        (shape (n,), in [0, 1)) with ``start``.
    start : float in [0, 1), with ``uniforms`` only

    Returns
    -------
    keep : ndarray of bool, shape (n,)
    """
    p, u, gen = _sample_inputs(pi, seed, generator, uniforms)
    if gen is None:
        if start is None or not (0.0 <= float(start) < 1.0):
            raise ValueError(f"start must be a float in [0, 1) with uniforms=, got {start!r}")
        s = float(start)
    else:
        if start is not None:
            raise TypeError("start= goes with uniforms= only")
        s = float(gen.random())
    certain = p >= 1.0
    tail = np.where(certain, 0.0, p)
    order = np.argsort(u, kind="stable")
    t = tail[order]
    c = np.cumsum(t)
    prev = np.concatenate([[0.0], c[:-1]])
    keep = np.zeros(p.size, dtype=bool)
    keep[order] = np.floor(c - s) > np.floor(prev - s)
    return keep | certain


#: the sampling designs of the token design: independent draws (the paper's) or a fixed size
SAMPLINGS = ("poisson", "systematic")


def compact_slots(keep, pi, block_size: int) -> dict:
    """The compacted layout of one KV head's token-design sample in a paged cache (docs/design.md section 7).

    The kept tokens, in position order, fill slots 0 .. C - 1 (C = number kept); ``slots`` slots in all,
    a multiple of ``block_size`` at least C (``slots = ceil(C / block_size) * block_size``); the rest are
    padding. Oracle of ``kvcert.fast.compact_slots`` (which pads every head to the largest count).

    Parameters
    ----------
    keep : (n,) bool   pi : (n,) inclusion probabilities, in (0, 1] where kept   block_size : int >= 1

    Returns
    -------
    dict with ``count`` (C), ``positions`` (slots,) int64 (-1 = padding) and ``log_pi`` (slots,) float64
    (-inf = padding).
    """
    keep = np.asarray(keep)
    pi = np.asarray(pi, dtype=np.float64)
    if keep.dtype != bool or keep.ndim != 1:
        raise ValueError(f"keep must be a 1-d bool array (n,), got {keep.dtype} of shape {keep.shape}")
    if pi.shape != keep.shape:
        raise ValueError(f"pi must have keep's shape {keep.shape}, got {pi.shape}")
    block_size = check_nonneg_int("block_size", block_size)
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if np.any((pi[keep] <= 0) | (pi[keep] > 1)):
        raise ValueError("pi must lie in (0, 1] on every kept token")
    kept = np.flatnonzero(keep)
    slots = -(-kept.size // block_size) * block_size
    positions = np.full(slots, -1, dtype=np.int64)
    log_pi = np.full(slots, -np.inf)
    positions[: kept.size] = kept
    log_pi[: kept.size] = np.log(pi[kept])
    return {"count": int(kept.size), "positions": positions, "log_pi": log_pi}
