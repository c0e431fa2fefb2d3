"""Deterministic eviction baselines (pi in {0, 1}) and their scorers.

Every scorer returns an importance (n,) for one KV head; higher means keep.
:func:`deterministic_keep` turns any importance into a kept set of a fixed
size, always keeping the sinks and the recent window, as the kvpress presses do.
All scorers here but LagKV depend on queries and keys only, never on
values: the adversary (:mod:`kvcert.reference.adversary`) relies on that
(the fast registry marks LagKV ``reads_values``).
"""

from __future__ import annotations

import numpy as np
from scipy.special import softmax

from .design import edge_mask

__all__ = [
    "SCORERS",
    "streaming_llm_scores",
    "h2o_scores",
    "snapkv_scores",
    "expected_attention_scores",
    "tova_scores",
    "knorm_scores",
    "random_scores",
    "keydiff_scores",
    "lagkv_scores",
    "deterministic_keep",
]


def _keys(keys) -> np.ndarray:
    k = np.asarray(keys, dtype=np.float64)
    if k.ndim != 2 or k.shape[0] == 0:
        raise ValueError(f"keys must have shape (n, d) with n >= 1, got shape {k.shape}")
    return k


def _queries(queries, d: int) -> np.ndarray:
    """(w, d) or (g, w, d) (g query heads of one KV group) -> (g, w, d)."""
    qs = np.asarray(queries, dtype=np.float64)
    if qs.ndim == 1:
        qs = qs[None, None, :]
    elif qs.ndim == 2:
        qs = qs[None]
    if qs.ndim != 3 or qs.shape[-1] != d or qs.shape[1] == 0:
        raise ValueError(f"queries must have shape (w, d) or (g, w, d) with d = {d}, got {np.shape(queries)}")
    return qs


def _scale(d: int, scale):
    return 1.0 / np.sqrt(d) if scale is None else float(scale)


def streaming_llm_scores(n: int) -> np.ndarray:
    """StreamingLLM (Xiao et al. 2024): recency, u_i = i; with the sinks kept
    by :func:`deterministic_keep` this keeps the sinks and the most recent tokens."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return np.arange(n, dtype=np.float64)


def h2o_scores(queries, keys, *, scale=None) -> np.ndarray:
    r"""H2O (Zhang et al. 2023): accumulated causal attention.

    ``queries`` (n, d) or (g, n, d) are the queries of the same n positions
    as the keys; :math:`u_j = \sum_{t \ge j} \operatorname{softmax}_{i\le t}(s_{ti})_j`,
    averaged over the g query heads.
    """
    k = _keys(keys)
    n, d = k.shape
    qs = _queries(queries, d)
    if qs.shape[1] != n:
        raise ValueError(f"h2o needs one query per key position: queries have {qs.shape[1]}, keys {n}")
    s = _scale(d, scale) * qs @ k.T
    s = np.where(np.tril(np.ones((n, n), dtype=bool)), s, -np.inf)
    return softmax(s, axis=-1).sum(axis=1).mean(axis=0)


def snapkv_scores(queries, keys, *, scale=None, kernel_size: int = 7) -> np.ndarray:
    r"""SnapKV (Li et al. 2024): attention of the last w (observation-window)
    queries to the keys before the window, summed over the window, averaged
    over the g query heads of the group, then average-pooled with
    ``kernel_size`` (odd) to keep neighbourhoods together.

    Keys inside the window get the window's own causal attention; they are in
    the recent window of every design anyway.
    """
    k = _keys(keys)
    n, d = k.shape
    qs = _queries(queries, d)
    w = qs.shape[1]
    if w > n:
        raise ValueError(f"the observation window ({w} queries) is longer than the cache ({n} keys)")
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size}")
    s = _scale(d, scale) * qs @ k.T  # (g, w, n): query t sits at position n - w + t
    pos_q = np.arange(n - w, n)[:, None]
    s = np.where(np.arange(n)[None, :] <= pos_q, s, -np.inf)
    u = softmax(s, axis=-1).sum(axis=1).mean(axis=0)
    if kernel_size > 1:
        pad = kernel_size // 2
        padded = np.pad(u, pad, mode="edge")
        u = np.convolve(padded, np.ones(kernel_size) / kernel_size, mode="valid")
    return u


def _softmax_limit(logit: np.ndarray) -> np.ndarray:
    """Max-subtracted softmax over the last axis; if the largest logit is
    infinite (overflow at a huge scale), the limit: equal mass on the logits
    that reach it."""
    top = np.max(logit, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # inf - inf in the branch np.where discards
        shifted = np.where(np.isfinite(top), logit - top, np.where(logit == top, 0.0, -np.inf))
    e = np.exp(shifted)
    return e / e.sum(axis=-1, keepdims=True)


def _mix(mix) -> float:
    if isinstance(mix, bool) or not isinstance(mix, (int, float, np.integer, np.floating)):
        raise TypeError(f"mix must be a float in [0, 1], got {type(mix).__name__}")
    mix = float(mix)
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be a float in [0, 1], got {mix}")
    return mix


def expected_attention_scores(queries, keys, *, scale=None, kernel_size: int = 7, mix: float = 0.5) -> np.ndarray:
    r"""SnapKV importance mixed with an expected-attention importance.

    The m = g w query vectors of the observation window (the last w queries
    of the g query heads of the KV group) are summarized by a Gaussian fit,
    and each key is scored by the softmax of its log-moment-generating
    function under that fit, i.e. by the attention a query drawn from the fit
    pays it in expectation (before normalization):

    .. math::

        \mu = \frac{1}{m}\sum_{j=1}^{m} q_j, \qquad
        C = \frac{1}{m-1}\sum_{j=1}^{m} (q_j - \mu)(q_j - \mu)^\top
        \quad (C = 0 \text{ if } m = 1),

        \ell_i = \log \mathbb{E}_{q \sim N(\mu, C)}\, e^{\tau q\cdot k_i}
               = \tau\, \mu\cdot k_i + \frac{\tau^2}{2}\, k_i^\top C\, k_i,
        \qquad e_i = \operatorname{softmax}_{i=1..n}(\ell_i),

        s_i = \frac{\mathrm{snapkv}_i}{\sum_{j=1}^{n} \mathrm{snapkv}_j}, \qquad
        u_i = (1 - \beta)\, s_i + \beta\, e_i, \quad \beta = \texttt{mix},

    with :math:`\mathrm{snapkv}` = :func:`snapkv_scores` on the same window and
    ``kernel_size``. :math:`e` is over all n keys, without a causal mask (a
    future query sees every cached key); :math:`\sum_i u_i = 1`.

    Parameters
    ----------
    queries : array_like, (w, d) or (g, w, d)
        The observation window (the last w queries, at positions n - w .. n - 1)
        of the g query heads of one KV head.
    keys : array_like, (n, d)
        The keys of that KV head, w <= n.
    scale : float, optional
        Softmax scale :math:`\tau`, default :math:`1/\sqrt{d}`.
    kernel_size : int, default 7
        Positive odd width of SnapKV's average pool (the e part is not pooled).
    mix : float in [0, 1], default 0.5
        :math:`\beta`: 0 gives normalized SnapKV, 1 the expected attention alone.

    Returns
    -------
    ndarray, (n,) float64
        Importance :math:`u \ge 0` summing to 1.

    Notes
    -----
    The logit is computed in float64 as
    :math:`\tau\,(\mu\cdot k_i + \tfrac{\tau}{2} k_i^\top C k_i)` (no
    :math:`0 \cdot \infty` when :math:`C = 0` at a huge scale), with the
    quadratic form clipped at 0 (C is positive semi-definite; rounding may
    leave it at -1e-17), and a max-subtracted softmax. If a logit overflows to
    +inf, :math:`e` is the limit: equal mass on the keys whose logit is +inf.
    Identical keys give :math:`e_i = 1/n`; n = 1 gives u = [1]. Non-finite
    queries or keys raise ``ValueError``.

    This is the simplest form of the expected-attention idea (kvpress's
    ``ExpectedAttentionPress``, Devoto et al. 2025): no RoPE extrapolation of
    future positions and no value norms.

    References
    ----------
    Li et al. (2024), SnapKV: LLM knows what you are looking for before generation.
    Devoto, Jeblick and Jegou (2025), Expected attention: KV cache compression
    by estimating attention from future queries distribution.

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import expected_attention_scores
    >>> keys = np.array([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    >>> window = np.array([[1.0, 1.0], [1.0, -1.0]])  # mu = (1, 0), C = diag(0, 2)
    >>> u = expected_attention_scores(window, keys, scale=1.0, kernel_size=1, mix=1.0)
    >>> np.round(np.log(u / u[2]), 12)  # logits tau mu.k + tau^2 k'Ck / 2 against k = 0
    array([1., 1., 0.])
    >>> float(expected_attention_scores(window, keys).sum())
    1.0
    """
    beta = _mix(mix)
    k = _keys(keys)
    n, d = k.shape
    qs = _queries(queries, d)
    for name, x in (("queries", qs), ("keys", k)):
        if not np.all(np.isfinite(x)):
            raise ValueError(f"{name} must be finite (found NaN or inf)")
    snap = snapkv_scores(qs, k, scale=scale, kernel_size=kernel_size)  # checks w <= n, kernel_size
    tau = _scale(d, scale)
    qw = qs.reshape(-1, d)  # the m = g * w window queries
    m = qw.shape[0]
    mu = qw.mean(axis=0)
    centered = qw - mu
    cov = centered.T @ centered / (m - 1) if m > 1 else np.zeros((d, d))
    quad = np.maximum(np.einsum("id,de,ie->i", k, cov, k), 0.0)  # k_i' C k_i
    with np.errstate(over="ignore"):
        logit = tau * (k @ mu + (tau / 2.0) * quad)
    e = _softmax_limit(logit)
    u = (1.0 - beta) * snap / snap.sum() + beta * e
    if not np.all(np.isfinite(u)):
        raise ValueError("the scores overflow at this scale: scale * q.k must be finite in float64")
    return u


def tova_scores(query, keys, *, scale=None) -> np.ndarray:
    """TOVA (Oren et al. 2024): attention of the last query (averaged over
    the group's query heads)."""
    k = _keys(keys)
    qs = _queries(query, k.shape[1])[:, -1:, :]
    return softmax(_scale(k.shape[1], scale) * qs @ k.T, axis=-1).mean(axis=(0, 1))


def knorm_scores(keys) -> np.ndarray:
    """K-norm (Devoto et al. 2024): keys with a small L2 norm draw more
    attention, so u_i = -||k_i||."""
    return -np.linalg.norm(_keys(keys), axis=1)


def random_scores(n: int, *, seed: int) -> np.ndarray:
    """Uniform random eviction without correction (a random kept set of fixed size)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return np.random.default_rng(seed).random(n)


def keydiff_scores(keys) -> np.ndarray:
    r"""KeyDiff (Park et al. 2025): minus the cosine of each key with the mean key direction.

    .. math::

        a = \frac{1}{n} \sum_{j=1}^{n} \frac{k_j}{\max(\lVert k_j \rVert, 10^{-12})}, \qquad
        u_i = -\,\frac{k_i}{\max(\lVert k_i \rVert, 10^{-8})} \cdot
              \frac{a}{\max(\lVert a \rVert, 10^{-8})}.

    The two eps are those of ``torch.nn.functional.normalize`` (anchor) and
    ``cosine_similarity`` (score) that kvpress calls.

    Parameters
    ----------
    keys : array_like, (n, d), n >= 1

    Returns
    -------
    ndarray, (n,) float64, in [-1, 1]
        Mostly negative: shift by the minimum before using it as a design
        importance. n = 1 gives [-1] up to rounding; a zero key scores 0.

    Examples
    --------
    >>> import numpy as np
    >>> keys = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])  # anchor (2/3, 1/3)
    >>> np.round(keydiff_scores(keys), 6)  # the odd key out scores highest
    array([-0.894427, -0.894427, -0.447214])
    """
    k = _keys(keys)
    if not np.all(np.isfinite(k)):
        raise ValueError("keys must be finite (found NaN or inf)")
    n, d = k.shape
    anchor = np.zeros(d)
    for j in range(n):
        anchor += k[j] / max(np.linalg.norm(k[j]), 1e-12)
    anchor /= n
    a_hat = anchor / max(np.linalg.norm(anchor), 1e-8)
    u = np.empty(n)
    for i in range(n):
        u[i] = -(k[i] / max(np.linalg.norm(k[i]), 1e-8)) @ a_hat
    return u


def _lag_relative(cur: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Softmax over the L tokens of ``cur`` (L, e) of the channel std of
    ``cur`` min-max scaled by the per-channel range of the next chunk ``ref``."""
    lag, e = cur.shape
    lo, hi = ref.min(axis=0), ref.max(axis=0)
    sd = np.empty(lag)
    for t in range(lag):
        z = np.zeros(e)
        for c in range(e):
            if hi[c] > lo[c]:  # a constant reference channel carries no information: z = 0
                z[c] = (cur[t, c] - lo[c]) / (hi[c] - lo[c])
        sd[t] = np.std(z, ddof=1 if e > 1 else 0)
    if not np.all(np.isfinite(sd)):
        raise ValueError("the LagKV scaling overflows (a reference range is too small)")
    return softmax(sd)


def _rank(a: np.ndarray) -> np.ndarray:
    """0 for the lowest entry; ties go to the lower index."""
    r = np.empty(a.size)
    for t in range(a.size):
        r[t] = np.sum(a < a[t]) + np.sum(a[:t] == a[t])
    return r


def lagkv_scores(keys, values, *, lag_size: int = 128, sinks: int = 4, cross_scoring: bool = False) -> np.ndarray:
    r"""LagKV (Liang et al. 2025): spread of each token, min-max scaled by the next chunk.

    With s = ``sinks`` (kvpress ``n_sink``) and L = ``lag_size``, the tokens
    after the sinks form C = (n - s) // L whole chunks
    :math:`P_c = \{s + cL, \dots, s + (c+1)L - 1\}`. Each chunk but the last
    is scored against the next one: for X in (keys, values), with
    :math:`m_e, M_e` the min and max of channel e over :math:`P_{c+1}`,

    .. math::

        z^X_{ie} = \frac{x_{ie} - m_e}{M_e - m_e}\ (0 \text{ if } M_e = m_e), \qquad
        p^X_i = \operatorname{softmax}_{j \in P_c}\bigl(\operatorname{std}_e z^X_{j\cdot}\bigr)_i, \qquad
        a_i = \tfrac12 (p^K_i + p^V_i),

        u_i = \operatorname{rank}_{j \in P_c}(a_j)_i \,/\, L \quad (a_i \text{ itself if } \texttt{cross\_scoring}),

    std with divisor e - 1 (1 if e = 1), rank 0 for the lowest, ties to the
    lower index. The sinks, the last whole chunk and the (n - s) mod L tokens
    after it score 1. If n < s + 2L nothing is scored: 1 on the sinks and
    (i - s) / (n - s) after them.

    Parameters
    ----------
    keys : array_like, (n, d), n >= 1
    values : array_like, (n, dv)
    lag_size : int >= 1, default 128
    sinks : int >= 0, default 4
    cross_scoring : bool, default False

    Returns
    -------
    ndarray, (n,) float64, in [0, 1]

    Examples
    --------
    >>> import numpy as np
    >>> u = lagkv_scores(np.ones((10, 2)), np.ones((10, 2)), lag_size=4, sinks=2)
    >>> u  # 10 < 2 + 2 * 4 is false: chunk 2..5 scored (all tied), 6..9 the tail
    array([1.  , 1.  , 0.  , 0.25, 0.5 , 0.75, 1.  , 1.  , 1.  , 1.  ])
    >>> lagkv_scores(np.ones((6, 2)), np.ones((6, 2)), lag_size=4, sinks=2)  # too short: recency
    array([1.  , 1.  , 0.  , 0.25, 0.5 , 0.75])
    """
    k = _keys(keys)
    v = np.asarray(values, dtype=np.float64)
    n = k.shape[0]
    if v.ndim != 2 or v.shape[0] != n:
        raise ValueError(f"values must have shape (n, dv) with n = {n}, got shape {v.shape}")
    for name, x in (("lag_size", lag_size), ("sinks", sinks)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(x).__name__}")
    if lag_size < 1:
        raise ValueError(f"lag_size must be >= 1, got {lag_size}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    if not isinstance(cross_scoring, (bool, np.bool_)):
        raise TypeError(f"cross_scoring must be a bool, got {type(cross_scoring).__name__}")
    lag, s = int(lag_size), int(sinks)
    u = np.ones(n)
    if n < s + 2 * lag:
        for i in range(s, n):
            u[i] = (i - s) / (n - s)
        return u
    n_chunks = (n - s) // lag
    end = s + n_chunks * lag
    for name, x in (("keys", k), ("values", v)):
        if not np.all(np.isfinite(x[s:end])):
            raise ValueError(f"{name} must be finite in the scored chunks (found NaN or inf)")
    for c in range(n_chunks - 1):
        cur = slice(s + c * lag, s + (c + 1) * lag)
        ref = slice(s + (c + 1) * lag, s + (c + 2) * lag)
        a = 0.5 * (_lag_relative(k[cur], k[ref]) + _lag_relative(v[cur], v[ref]))
        u[cur] = a if cross_scoring else _rank(a) / lag
    return u


def _h2o(queries, keys, values, *, scale=None, **_):
    # one query per key (a prefill event): accumulated causal attention; fewer (a decode-time
    # event's recent window): their accumulated attention, SnapKV without pooling
    qs = _queries(queries, _keys(keys).shape[1])
    if qs.shape[1] == _keys(keys).shape[0]:
        return h2o_scores(queries, keys, scale=scale)
    return snapkv_scores(queries, keys, scale=scale, kernel_size=1)


#: name -> float64 twin of ``kvcert.fast.SCORERS[name]`` for one KV head, all with one signature:
#: ``scorer(queries (g, w, d) or (w, d), keys (n, d), values (n, dv), *, scale=None, layer=0, event=0,
#: **params) -> (n,)`` with the fast entry's hyperparameters ``params`` (same names and defaults);
#: keywords a scorer does not use are ignored. The method's metadata (which queries it reads, its
#: press, its defaults) lives in the fast registry.
SCORERS = {
    "streaming_llm": lambda q, k, v, **_: streaming_llm_scores(_keys(k).shape[0]),
    "h2o": _h2o,
    "snapkv": lambda q, k, v, *, scale=None, kernel_size=7, **_: snapkv_scores(q, k, scale=scale,
                                                                              kernel_size=kernel_size),
    "tova": lambda q, k, v, *, scale=None, **_: tova_scores(q, k, scale=scale),
    "knorm": lambda q, k, v, **_: knorm_scores(k),
    "random": lambda q, k, v, *, seed=0, **_: random_scores(_keys(k).shape[0], seed=seed),
    "expected": lambda q, k, v, *, scale=None, kernel_size=7, **_: expected_attention_scores(
        q, k, scale=scale, kernel_size=kernel_size),
    "keydiff": lambda q, k, v, **_: keydiff_scores(k),
    "lagkv": lambda q, k, v, *, lag_size=128, n_sink=4, **_: lagkv_scores(k, v, lag_size=lag_size, sinks=n_sink),
}


def deterministic_keep(importance, budget: int, *, sinks: int = 4, window: int = 32) -> np.ndarray:
    """Kept set of exactly ``budget`` tokens: sinks, recent window, then the
    highest importance (ties to the lower index).

    Returns a bool mask (n,). Its Hajek estimate with pi = 1 on the kept set
    is plain softmax attention over it, with variance 0: a deterministic
    policy carries no information about what it evicted.
    """
    u = np.asarray(importance, dtype=np.float64)
    if u.ndim != 1 or u.size == 0:
        raise ValueError(f"importance must have shape (n,) with n >= 1, got shape {u.shape}")
    if not np.all(np.isfinite(u)):
        raise ValueError("importance must be finite (found NaN or inf)")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise TypeError(f"budget must be an int (a kept count), got {type(budget).__name__}")
    n = u.size
    keep = edge_mask(n, sinks=sinks, window=window)
    if not (int(keep.sum()) <= budget <= n):
        raise ValueError(f"budget must be in [{int(keep.sum())}, {n}] (sinks + window .. n), got {budget}")
    free = np.flatnonzero(~keep)
    order = free[np.argsort(-u[free], kind="stable")]
    keep[order[: budget - int(keep.sum())]] = True
    return keep
