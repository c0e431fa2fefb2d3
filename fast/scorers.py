"""Batched token-importance scorers (b, h_kv, n), twins of ``reference.baselines``.

Each returns one importance per KV head; higher means keep. Query-based
scorers take the queries of all h_q = g * h_kv heads and average over the g
query heads of a KV head (GQA pooling), which is the reference scorer applied
to the (g, w, d) slice of that group. Computation in float32 (float64 for
float64 inputs); nothing here repeats K for GQA (queries are reshaped to
(b, h_kv, g * w, d) instead).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ._checks import check_nonneg_int, check_scale, check_tensor, compute_dtype
from .design import design_uniforms

__all__ = [
    "SCORERS",
    "Scorer",
    "register_scorer",
    "queries_needed",
    "queries_read",
    "streaming_llm_scores",
    "h2o_scores",
    "snapkv_scores",
    "expected_attention_scores",
    "tova_scores",
    "knorm_scores",
    "random_scores",
    "keydiff_scores",
    "lagkv_scores",
    "SNAPKV_POOLINGS",
    "HEAD_POOLINGS",
]


def _keys(keys) -> torch.Tensor:
    keys = check_tensor("keys", keys, ndim=(4,), floating=True)
    if keys.shape[2] == 0:
        raise ValueError(f"keys must have shape (b, h_kv, n, d) with n >= 1, got {tuple(keys.shape)}")
    return keys


def _group_queries(queries, keys: torch.Tensor, *, decode_ok: bool = False) -> tuple[torch.Tensor, int, int]:
    """queries (b, h_q, w, d) [or (b, h_q, d) if decode_ok] -> (b, h_kv, g*w, d), g, w."""
    queries = check_tensor("queries", queries, ndim=(3, 4) if decode_ok else (4,), floating=True)
    if queries.ndim == 3:
        queries = queries.unsqueeze(2)
    b, h_kv, n, d = keys.shape
    if queries.shape[0] != b or queries.shape[-1] != d:
        raise ValueError(f"queries must have shape (b, h_q, w, d) = ({b}, h_q, w, {d}), got {tuple(queries.shape)}")
    h_q, w = queries.shape[1], queries.shape[2]
    if h_q % h_kv:
        raise ValueError(f"the number of query heads h_q = {h_q} must be a multiple of h_kv = {h_kv} (GQA)")
    if w == 0:
        raise ValueError("queries must hold at least one query (w >= 1)")
    g = h_q // h_kv
    return queries.reshape(b, h_kv, g * w, d), g, w


def streaming_llm_scores(n_or_keys, *, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r"""StreamingLLM (Xiao et al. 2024): recency, :math:`u_i = i`.

    ``n_or_keys``: an int n (returns (n,)) or keys (b, h_kv, n, d) (returns
    (b, h_kv, n) on their device).
    """
    if isinstance(n_or_keys, torch.Tensor):
        k = _keys(n_or_keys)
        b, h, n, _ = k.shape
        return torch.arange(n, dtype=compute_dtype(k), device=k.device).expand(b, h, n).clone()
    n = check_nonneg_int("n", n_or_keys)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return torch.arange(n, dtype=dtype, device=device)


def snapkv_scores(queries: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None,
                  kernel_size: int = 7, pooling: str = "replicate") -> torch.Tensor:
    r"""SnapKV (Li et al. 2024): observation-window attention, GQA-pooled, smoothed.

    .. math:: u_j = \frac{1}{g}\sum_{h \in \text{group}} \sum_{t=1}^{w}
              \operatorname{softmax}_{i \le n-w+t}(\tau\, q_{ht}\cdot k_i)_j,

    then an average pool of width ``kernel_size`` (odd) with edge padding.
    The last w queries sit at positions n - w .. n - 1 (causal inside the window).

    Parameters
    ----------
    queries : (b, h_q, w, d), the observation window
    keys : (b, h_kv, n, d), w <= n
    scale : float, default 1/sqrt(d)
    kernel_size : positive odd int
    pooling : {"replicate", "kvpress"}
        ``"replicate"`` (default): the formula above over all n tokens, the
        pool's edges padded with the edge values. ``"kvpress"``: kvpress
        0.5's ``SnapKVPress.score``: the mean (not the sum) over the window,
        pooled over the n - w tokens *before* the window only, with zero
        padding counted in the average (``avg_pool1d(padding=kernel_size // 2)``),
        then the group mean; the w window tokens score the row's maximum + 1
        (so a top-k keeps them). The two rank the tokens before the window
        alike except within ``kernel_size // 2`` of either end of that span.

    Returns
    -------
    (b, h_kv, n) float32 (float64 for float64 inputs)
    """
    pooling = _choice("pooling", pooling, SNAPKV_POOLINGS)
    s, g, w = _window_scores(queries, keys, scale, kernel_size)
    return _snapkv_from_scores(s, g, w, kernel_size, pooling)


#: how :func:`snapkv_scores` pools: kvcert's edge-replicated pool over every token, or kvpress's
SNAPKV_POOLINGS = ("replicate", "kvpress")
#: how :func:`tova_scores` averages over query heads: per KV group (kvcert), or over all heads (kvpress, TOVA)
HEAD_POOLINGS = ("group", "all")


def _choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _window_scores(queries, keys, scale, kernel_size) -> tuple[torch.Tensor, int, int]:
    """Checked inputs -> window scores tau q.k (b, h_kv, g*w, n) at the compute dtype, g, w."""
    k = _keys(keys)
    qs, g, w = _group_queries(queries, k)
    n, d = k.shape[2], k.shape[3]
    if w > n:
        raise ValueError(f"the observation window ({w} queries) is longer than the cache ({n} keys)")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size}")
    dt = compute_dtype(qs, k)
    tau = check_scale(scale, d)
    return torch.matmul(qs.to(dt) * tau, k.to(dt).transpose(-1, -2)), g, w


def _snapkv_from_scores(s: torch.Tensor, g: int, w: int, kernel_size: int,
                        pooling: str = "replicate") -> torch.Tensor:
    """SnapKV from the window scores (b, h_kv, g*w, n); masks ``s`` in place."""
    b, h_kv, _, n = s.shape
    s = s.view(b, h_kv, g, w, n)
    pos_q = torch.arange(n - w, n, device=s.device)[:, None]
    future = torch.arange(n, device=s.device)[None, :] > pos_q  # (w, n)
    s.masked_fill_(future, float("-inf"))
    if pooling == "kvpress":
        return _snapkv_kvpress(torch.softmax(s, dim=-1), kernel_size)
    u = torch.softmax(s, dim=-1).sum(dim=3).mean(dim=2)  # (b, h_kv, n)
    if kernel_size > 1:
        pad = kernel_size // 2
        up = F.pad(u.reshape(b * h_kv, 1, n), (pad, pad), mode="replicate")
        u = F.avg_pool1d(up, kernel_size, stride=1).reshape(b, h_kv, n)
    return u


def _snapkv_kvpress(p: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """kvpress 0.5's SnapKV score from the window's attention p (b, h_kv, g, w, n), in its order:
    mean over the window, zero-padded pool over the n - w tokens before it, group mean, then the
    window tokens at the row's maximum + 1."""
    b, h_kv, g, w, n = p.shape
    m = n - w
    u = torch.ones(b, h_kv, n, dtype=p.dtype, device=p.device)
    if m == 0:  # the window is the whole cache: every token is kept alike
        return u
    a = p[..., :m].mean(dim=3).reshape(b, h_kv * g, m)
    if kernel_size > 1:
        a = F.avg_pool1d(a, kernel_size, stride=1, padding=kernel_size // 2)  # count_include_pad: zeros count
    a = a.reshape(b, h_kv, g, m).mean(dim=2)
    u[..., :m] = a
    u[..., m:] = a.amax(dim=(1, 2), keepdim=True) + 1  # per row (kvpress: over its batch of one)
    return u


def _softmax_limit(logit: torch.Tensor) -> torch.Tensor:
    """Max-subtracted softmax over the last dim; if the largest logit is
    infinite (overflow at a huge scale), the limit: equal mass on the logits
    that reach it."""
    top = logit.amax(dim=-1, keepdim=True)
    shifted = torch.where(torch.isfinite(top), logit - top,
                          torch.where(logit == top, 0.0, float("-inf")).to(logit.dtype))
    e = shifted.exp()
    return e / e.sum(dim=-1, keepdim=True)


def expected_attention_scores(queries: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None,
                              kernel_size: int = 7, mix: float = 0.5) -> torch.Tensor:
    r"""SnapKV importance mixed with an expected-attention importance, GQA-pooled.

    Per KV head, the m = g w query vectors :math:`q_j` of the window (the w
    queries of each of its g query heads) are fitted by a Gaussian
    :math:`N(\mu, C)` (mean, and covariance with divisor m - 1; C = 0 if
    m = 1), and each key is scored by the log-moment-generating function of
    its score under the fit:

    .. math::

        \ell_i = \log \mathbb{E}_{q \sim N(\mu, C)}\, e^{\tau q\cdot k_i}
               = \tau\, \mu\cdot k_i + \frac{\tau^2}{2}\, k_i^\top C\, k_i
               = \bar s_i + \tfrac12 \hat\sigma_i^2,
        \qquad e_i = \operatorname{softmax}_{i=1..n}(\ell_i),

        u_i = (1 - \beta)\, \frac{\mathrm{snapkv}_i}{\sum_{j=1}^{n} \mathrm{snapkv}_j}
              + \beta\, e_i, \quad \beta = \texttt{mix},

    where :math:`\bar s_i` and :math:`\hat\sigma_i^2` are the mean and the
    sample variance (divisor m - 1) of the window's scores
    :math:`s_{ji} = \tau\, q_j\cdot k_i` on key i: the same identity, computed
    from the score matrix that :func:`snapkv_scores` needs anyway (one matmul
    for both parts). :math:`e` is over all n keys, not causal-masked;
    :math:`\sum_i u_i = 1` per KV head. The reference twin is
    ``kvcert.reference.expected_attention_scores`` (literal mu and C).

    Parameters
    ----------
    queries : (b, h_q, w, d)
        The observation window (positions n - w .. n - 1), h_q = g * h_kv.
    keys : (b, h_kv, n, d)
        w <= n.
    scale : float, default 1/sqrt(d)
    kernel_size : positive odd int, default 7
        SnapKV's average pool (the e part is not pooled).
    mix : float in [0, 1], default 0.5
        :math:`\beta`: 0 gives normalized SnapKV exactly, 1 the expected attention alone.

    Returns
    -------
    (b, h_kv, n) float32 (float64 for float64 inputs), >= 0, summing to 1 over n

    Notes
    -----
    Computed at the dtype of :func:`snapkv_scores` (float32 for float32, bf16
    and fp16 inputs) with a max-subtracted softmax. The score variance is a
    sum of squares (>= 0), so at a huge scale the logit can only overflow to
    +inf, never to NaN; then :math:`e` is the limit, equal mass on the keys
    whose logit is +inf. Raises ``ValueError`` if the result is not finite
    (non-finite inputs, or scores that overflow the dtype).
    """
    if isinstance(mix, bool) or not isinstance(mix, numbers.Real):
        raise TypeError(f"mix must be a float in [0, 1], got {type(mix).__name__}")
    beta = float(mix)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"mix must be a float in [0, 1], got {beta}")
    s, g, w = _window_scores(queries, keys, scale, kernel_size)  # (b, h_kv, m, n)
    m = g * w
    var, mean = torch.var_mean(s, dim=2, correction=1 if m > 1 else 0)  # over the m window queries
    e = _softmax_limit(mean + 0.5 * var)
    snap = _snapkv_from_scores(s, g, w, kernel_size)  # masks s in place: after the statistics
    u = (1.0 - beta) * (snap / snap.sum(dim=-1, keepdim=True)) + beta * e
    if not bool(torch.isfinite(u).all()):
        raise ValueError("queries and keys must be finite (the scores are NaN or overflow at this scale)")
    return u


def h2o_scores(queries: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None,
               chunk: int = 512) -> torch.Tensor:
    r"""H2O (Zhang et al. 2023): accumulated causal attention, GQA-averaged.

    .. math:: u_j = \frac{1}{g}\sum_{h} \sum_{t \ge j} \operatorname{softmax}_{i \le t}(\tau\, q_{ht}\cdot k_i)_j

    ``queries`` (b, h_q, n, d) are the queries of the same n positions as the
    keys. Query rows are processed ``chunk`` at a time, so memory is
    O(h_q * chunk * n), never the full n x n attention at once.
    """
    k = _keys(keys)
    qs, g, w = _group_queries(queries, k)
    b, h_kv, n, d = k.shape
    if w != n:
        raise ValueError(f"h2o needs one query per key position: queries have {w}, keys {n}")
    check_nonneg_int("chunk", chunk)
    dt = compute_dtype(qs, k)
    tau = check_scale(scale, d)
    q5 = qs.to(dt).view(b, h_kv, g, n, d) * tau
    kt = k.to(dt).transpose(-1, -2)
    u = torch.zeros(b, h_kv, n, dtype=dt, device=k.device)
    cols = torch.arange(n, device=k.device)
    for t0 in range(0, n, max(chunk, 1)):
        t1 = min(n, t0 + max(chunk, 1))
        s = torch.matmul(q5[:, :, :, t0:t1], kt.unsqueeze(2))  # (b, h_kv, g, c, n)
        future = cols[None, :] > torch.arange(t0, t1, device=k.device)[:, None]
        s.masked_fill_(future, float("-inf"))
        u += torch.softmax(s, dim=-1).sum(dim=3).sum(dim=2)
    return u / g


def tova_scores(query: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None,
                head_pooling: str = "group") -> torch.Tensor:
    r"""TOVA (Oren et al. 2024): attention of the last query, averaged over the group.

    .. math:: u_j = \frac{1}{g}\sum_h \operatorname{softmax}_i(\tau\, q_{h,\mathrm{last}}\cdot k_i)_j

    ``query`` (b, h_q, d) or (b, h_q, w, d) (the last of the w is used).
    ``head_pooling``: ``"group"`` (default) averages over the g query heads of
    each KV head, as above; ``"all"`` averages over all h_q query heads, so
    every KV head of the layer gets the same score (the TOVA paper's policy,
    and kvpress 0.5's ``TOVAPress``).
    """
    head_pooling = _choice("head_pooling", head_pooling, HEAD_POOLINGS)
    k = _keys(keys)
    q = check_tensor("query", query, ndim=(3, 4), floating=True)
    if q.ndim == 4:
        q = q[:, :, -1]
    qs, g, _ = _group_queries(q, k, decode_ok=True)
    b, h_kv, n, d = k.shape
    dt = compute_dtype(qs, k)
    s = torch.matmul(qs.to(dt) * check_scale(scale, d), k.to(dt).transpose(-1, -2))  # (b, h_kv, g, n)
    p = torch.softmax(s, dim=-1)
    if head_pooling == "all":
        return p.mean(dim=(1, 2)).unsqueeze(1).expand(b, h_kv, n).contiguous()
    return p.mean(dim=2)


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    r"""K-norm (Devoto et al. 2024): :math:`u_i = -\lVert k_i \rVert_2` (small-norm keys draw attention).

    Negative: shift it (e.g. ``u - u.amin(-1, keepdim=True)``) before using it
    as a design importance, which must be >= 0.
    """
    k = _keys(keys)
    return -torch.linalg.vector_norm(k.to(compute_dtype(k)), dim=-1)


def random_scores(n_or_keys, *, seed: int, layer: int = 0, event: int = 0, device=None) -> torch.Tensor:
    r"""Uniform random importance :math:`u_i \sim U[0, 1)` (random eviction, no correction).

    ``n_or_keys``: an int n (returns (n,)) or keys (b, h_kv, n, d) (returns
    (b, h_kv, n)). Draws come from the counter-based stream of
    :mod:`kvcert.fast.design` with the event counter offset by 2**32 (so they
    are independent of the sampling draws of the same layer and event), one
    stream per (batch row, KV head). The reference draws NumPy's PCG64
    instead, so the two agree in distribution, not bit for bit.
    """
    event = check_nonneg_int("event", event)
    if isinstance(n_or_keys, torch.Tensor):
        k = _keys(n_or_keys)
        b, h, n, _ = k.shape
        return design_uniforms((b, h, n), seed, layer=layer, event=event + (1 << 32), device=k.device)
    n = check_nonneg_int("n", n_or_keys)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return design_uniforms((n,), seed, layer=layer, event=event + (1 << 32), device=device)


_NORMALIZE_EPS = 1e-12  # torch.nn.functional.normalize's default eps (kvpress builds the anchor with it)
_COSINE_EPS = 1e-8  # torch.nn.functional.cosine_similarity's default eps (norms clamped from below)


def keydiff_scores(keys: torch.Tensor) -> torch.Tensor:
    r"""KeyDiff (Park et al. 2025): minus the cosine of each key with the mean key direction.

    .. math::

        a = \frac{1}{n} \sum_{j=1}^{n} \frac{k_j}{\max(\lVert k_j \rVert, 10^{-12})}, \qquad
        u_i = -\,\frac{k_i}{\max(\lVert k_i \rVert, 10^{-8})} \cdot
              \frac{a}{\max(\lVert a \rVert, 10^{-8})},

    per (batch row, KV head). Keys pointing away from the average direction
    are distinctive and kept; keys aligned with it are evicted first. This is
    kvpress's ``KeyDiffPress.score`` (``-cosine_similarity(keys, anchor)``
    with ``anchor = normalize(keys).mean(dim=2)``), the eps included.

    Parameters
    ----------
    keys : (b, h_kv, n, d), n >= 1

    Returns
    -------
    (b, h_kv, n) float32 (float64 for float64 inputs), in [-1, 1]

    Notes
    -----
    Mostly negative (keys of a head share a direction): shift it (e.g.
    ``u - u.amin(-1, keepdim=True)``) before using it as a design importance,
    which must be >= 0. n = 1 gives u = [-1] up to rounding (a key is aligned with itself).
    A zero key scores 0 and adds nothing to the anchor; keys that cancel
    (anchor below 1e-8) score :math:`-\hat k_i \cdot a / 10^{-8}`, as in
    kvpress. kvpress computes in the cache dtype (bf16 in practice), this
    port in float32 (float64 for float64 inputs). Raises ``ValueError`` for
    non-finite keys (the anchor, hence every score, would be NaN).

    References
    ----------
    Park et al. (2025), KeyDiff: Key similarity-based KV cache eviction for
    long-context LLM inference in resource-constrained environments, arXiv 2504.15364.
    """
    k = _keys(keys)
    kk = k.to(compute_dtype(k))
    norm = torch.linalg.vector_norm(kk, dim=-1, keepdim=True)  # (b, h_kv, n, 1)
    anchor = (kk / norm.clamp_min(_NORMALIZE_EPS)).mean(dim=2, keepdim=True)  # (b, h_kv, 1, d)
    a_hat = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp_min(_COSINE_EPS)
    u = -((kk / norm.clamp_min(_COSINE_EPS)) * a_hat).sum(dim=-1)
    if not bool(torch.isfinite(u).all()):
        raise ValueError("keys must be finite (found NaN or inf: the KeyDiff anchor is NaN)")
    return u


def lagkv_scores(keys: torch.Tensor, values: torch.Tensor, *, lag_size: int = 128, sinks: int = 4,
                 cross_scoring: bool = False) -> torch.Tensor:
    r"""LagKV (Liang et al. 2025): spread of each token, min-max scaled by the next chunk.

    After the ``sinks`` first tokens the cache is cut into C = (n - s) // L
    whole chunks :math:`P_c = \{s + cL, \dots, s + (c+1)L - 1\}` (s = sinks,
    L = lag_size). Chunk :math:`P_c` (c <= C - 2) is scored against the next
    one, its lag reference :math:`P_{c+1}`: for X = K and X = V, with
    :math:`m_e, M_e` the min and max of channel e over :math:`P_{c+1}`,

    .. math::

        z^X_{ie} = \frac{x_{ie} - m_e}{M_e - m_e}, \qquad
        \sigma^X_i = \operatorname{std}_e\bigl(z^X_{i\cdot}\bigr), \qquad
        p^X_i = \operatorname{softmax}_{j \in P_c}\bigl(\sigma^X_j\bigr)_i, \qquad
        a_i = \tfrac12\bigl(p^K_i + p^V_i\bigr),

        u_i = \frac{\operatorname{rank}_{j \in P_c}(a_j)_i}{L} \in \{0, \tfrac1L, \dots, \tfrac{L-1}{L}\}
        \quad (u_i = a_i \text{ if } \texttt{cross\_scoring}),

    with std over the channels (divisor e - 1) and rank 0 for the lowest
    :math:`a` of the chunk. The sinks and the tail, i.e. the last whole chunk
    (no reference after it) and the r = (n - s) mod L tokens after it, get
    :math:`u_i = 1`, above every scored token. A cache shorter than s + 2L
    has no scored chunk: :math:`u_i = 1` for i < s and
    :math:`u_i = (i - s) / (n - s)` for i >= s (recency, as kvpress).

    Parameters
    ----------
    keys : (b, h_kv, n, d), n >= 1
    values : (b, h_kv, n, dv), same b, h_kv, n
    lag_size : int >= 1, default 128
        L, kvpress's ``lag_size``: the chunk length.
    sinks : int >= 0, default 4
        s, kvpress's ``n_sink``: the first tokens, always scored 1.
    cross_scoring : bool, default False
        kvpress's ``cross_scoring``: keep :math:`a_i` itself (comparable across
        chunks, in (0, 1)) instead of its within-chunk rank.

    Returns
    -------
    (b, h_kv, n) float32 (float64 for float64 inputs), in [0, 1]

    Notes
    -----
    Already >= 0 (no shift needed for a design importance); the lowest token
    of each chunk scores 0, which kvcert's defensive floor keeps at pi > 0.
    Ranks make every chunk contribute the same share to a global top-k, as
    the paper's per-chunk selection does; exact ties break to the lower
    index (kvpress's unstable argsort leaves them unspecified), and scores
    equal up to rounding (discrete inputs) may rank either way, here as in
    kvpress.

    Edge cases, defined here where kvpress gives NaN or inf: a channel that
    is constant over the reference chunk (:math:`M_e = m_e`: lag_size = 1,
    repeated tokens) has :math:`z_{ie} = 0`; a single channel (d = 1 or
    dv = 1) has std 0 (divisor 1, not 0). ``values`` may have dv != d
    (kvpress views them with the key dim, so it needs dv = d). Only tokens
    s .. s + CL - 1 are read; NaN or inf there raises ``ValueError``, as
    does a scaled value that overflows (a reference range near the dtype's
    smallest normal).

    kvpress computes in the cache dtype (bf16 in practice) and rounds the
    ramp and the ranks to float32; this port computes in float32 (float64
    for float64 inputs). kvpress's ``compression_ratio`` belongs to the
    press, not to the score.

    References
    ----------
    Liang et al. (2025), LagKV: Lag-relative information of the KV cache tells
    which tokens are important, arXiv 2504.04704.
    """
    k = _keys(keys)
    v = check_tensor("values", values, ndim=(4,), floating=True)
    b, h_kv, n, _ = k.shape
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = ({b}, {h_kv}, {n}, dv), got {tuple(v.shape)}")
    lag = check_nonneg_int("lag_size", lag_size)
    if lag < 1:
        raise ValueError(f"lag_size must be >= 1, got {lag}")
    s = check_nonneg_int("sinks", sinks)
    if not isinstance(cross_scoring, bool):
        raise TypeError(f"cross_scoring must be a bool, got {type(cross_scoring).__name__}")
    dt = compute_dtype(k, v)
    u = torch.ones(b, h_kv, n, dtype=dt, device=k.device)
    if n < s + 2 * lag:  # no scored chunk: sinks, then a recency ramp in [0, 1)
        if n > s:
            u[:, :, s:] = torch.arange(n - s, dtype=dt, device=k.device) / (n - s)
        return u
    c = (n - s) // lag  # whole chunks, >= 2
    end = s + c * lag
    a = 0.5 * (_lag_softmax("keys", k[:, :, s:end], c, lag, dt) + _lag_softmax("values", v[:, :, s:end], c, lag, dt))
    if not cross_scoring:  # within-chunk rank / L; stable sort: ties to the lower index
        rank = torch.argsort(torch.argsort(a, dim=-1, stable=True), dim=-1)
        a = rank.to(dt) / lag
    u[:, :, s:end - lag] = a.reshape(b, h_kv, (c - 1) * lag)
    return u


def _lag_softmax(name: str, x: torch.Tensor, c: int, lag: int, dt: torch.dtype) -> torch.Tensor:
    """x (b, h_kv, c*L, e) -> p (b, h_kv, c-1, L): softmax over each chunk of the
    channel std of the chunk min-max scaled by the next chunk's range."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must be finite in the scored chunks (found NaN or inf)")
    b, h_kv, _, e = x.shape
    x = x.to(dt).reshape(b, h_kv, c, lag, e)
    cur, ref = x[:, :, :-1], x[:, :, 1:]
    lo = ref.amin(dim=3, keepdim=True)
    span = ref.amax(dim=3, keepdim=True) - lo  # (b, h_kv, c-1, 1, e)
    spread = span > 0
    z = torch.where(spread, (cur - lo) / torch.where(spread, span, torch.ones_like(span)), torch.zeros_like(cur))
    sd = torch.std(z, dim=-1, correction=1 if e > 1 else 0)  # (b, h_kv, c-1, L)
    if not bool(torch.isfinite(sd).all()):
        raise ValueError(f"the LagKV scaling of {name} overflows (a reference range is too small for the dtype)")
    return torch.softmax(sd, dim=-1)


# ---------------------------------------------------------------------------------------------
# the registry: one signature for every scorer
# ---------------------------------------------------------------------------------------------
#: what a scorer reads of the prefill queries: the last ``observation_window`` of them, every one
#: (one per key position), or none (key/value-only and position-only scorers)
QUERY_NEEDS = ("window", "all", "none")


@dataclass(frozen=True)
class Scorer:
    r"""A registered importance scorer: one name, one signature, one deterministic press.

    Every registered scorer is called the same way,

    ``scorer(queries, keys, values, *, scale=None, layer=0, event=0, **params)``
    -> (b, h_kv, n) importance (higher = keep),

    with ``queries`` (b, h_q, w, d) the observation window (the last w
    queries before the event, w <= n; for ``queries="all"`` scorers at a
    prefill event, one query per key position), ``keys``/``values``
    (b, h_kv, n, d), ``layer``/``event`` the eviction event (random
    scorers seed their streams with them) and ``params`` the scorer's own
    hyperparameters (defaults in :attr:`params`). The float64 twin of the
    same name is ``kvcert.reference.SCORERS[name]`` (one KV head, same
    keywords).

    Attributes
    ----------
    name : str
        Registry key (``PoissonPress(scorer=name)``, the CLI's ``--scorer``).
    fn : callable
        ``fn(queries, keys, values, *, scale, layer, event, **params)``.
    queries : {"window", "all", "none"}
        Which prefill queries it reads (so a shared prefill knows what to keep).
    press : str
        Class name of its deterministic press in :mod:`kvcert.presses`
        (top-k by this score), e.g. ``"SnapKVPress"``; its fields are the
        common press fields, ``observation_window`` if it reads a window,
        and :attr:`params`.
    params : dict
        Hyperparameter name -> default (ints, or a str choice such as SnapKV's
        ``pooling``), e.g. ``{"kernel_size": 7, "pooling": "replicate"}``.
    summary : str
        One line: the method and its rule (docstring of the press).
    random : bool
        The score is a random draw: its reference twin agrees in
        distribution, not value by value.
    reads_values : bool
        The score depends on the values (not only on queries and keys):
        the value-shifting adversary of the impossibility result
        (``kvcert.reference.adversarial_cache``) does not apply to it.
    """

    name: str
    fn: Callable
    queries: str
    press: str
    params: dict = field(default_factory=dict)
    summary: str = ""
    random: bool = False
    reads_values: bool = False

    def __post_init__(self):
        if self.queries not in QUERY_NEEDS:
            raise ValueError(f"queries must be one of {QUERY_NEEDS}, got {self.queries!r}")

    def __call__(self, queries, keys, values=None, *, scale=None, layer: int = 0, event: int = 0,
                 **params) -> torch.Tensor:
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise TypeError(f"scorer {self.name!r} takes the hyperparameters {sorted(self.params)}, got {unknown}")
        return self.fn(queries, keys, values, scale=scale, layer=layer, event=event, **{**self.params, **params})

    def queries_needed(self, n: int, observation_window: int) -> int:
        """Prefill queries this scorer reads at an event over n tokens (:func:`queries_needed`)."""
        return queries_needed(self.queries, n, observation_window)

    def queries_read(self, available: int, n: int, observation_window: int) -> int:
        """How many of the last ``available`` queries to pass it (:func:`queries_read`)."""
        return queries_read(self.queries, available, n, observation_window)


def queries_needed(need: str, n: int, observation_window: int) -> int:
    """Prefill queries a scorer that reads ``need`` (one of :data:`QUERY_NEEDS`) reads at an event
    over n tokens: the observation window, one per token, or none."""
    return {"window": min(observation_window, n), "all": n, "none": 0}[need]


def queries_read(need: str, available: int, n: int, observation_window: int) -> int:
    """How many of the last ``available`` queries a scorer is given at an event over n tokens (>= 1):
    all n for an all-query scorer given one query per token (a prefill event), otherwise the last
    ``observation_window`` (a decode-time event keeps only a recent window of queries)."""
    if need == "all" and available == n:
        return n
    return max(min(observation_window, available, n), 1)


#: name -> :class:`Scorer`; the presses, the CLI, paper_repro and the tests all read this
SCORERS: dict[str, Scorer] = {}


def register_scorer(scorer: Scorer) -> Scorer:
    """Add a :class:`Scorer` to :data:`SCORERS` (a name is registered once)."""
    if not isinstance(scorer, Scorer):
        raise TypeError(f"scorer must be a kvcert.fast.scorers.Scorer, got {type(scorer).__name__}")
    if scorer.name in SCORERS:
        raise ValueError(f"a scorer named {scorer.name!r} is already registered")
    SCORERS[scorer.name] = scorer
    return scorer


def _h2o(queries, keys, values, *, scale, **_):
    # a prefill event sees one query per key: accumulated causal attention; a decode-time event
    # sees only the recent window (the attention of evicted steps is gone): its accumulated
    # attention, i.e. SnapKV without pooling
    if queries.shape[2] == keys.shape[2]:
        return h2o_scores(queries, keys, scale=scale)
    return snapkv_scores(queries, keys, scale=scale, kernel_size=1)


for _scorer in (  # the order of the tables' rows (paper_repro T1, T2b)
    Scorer("streaming_llm", lambda q, k, v, **_: streaming_llm_scores(k), "none", "StreamingLLMPress", {},
           "StreamingLLM (Xiao et al. 2024): recency (with the sinks and the window, the most recent tokens)."),
    Scorer("h2o", _h2o, "all", "H2OPress", {},
           "H2O (Zhang et al. 2023): heavy hitters of the accumulated causal attention of every prefill "
           "query (decode-time events accumulate over the recent queries only)."),
    Scorer("snapkv", lambda q, k, v, *, scale, kernel_size, pooling, **_: snapkv_scores(
               q, k, scale=scale, kernel_size=kernel_size, pooling=pooling),
           "window", "SnapKVPress", {"kernel_size": 7, "pooling": "replicate"},
           "SnapKV (Li et al. 2024): attention of the last observation_window queries, GQA-pooled, "
           "smoothed with kernel_size (pooling=\"kvpress\": kvpress's edges and window scores)."),
    Scorer("tova", lambda q, k, v, *, scale, head_pooling, **_: tova_scores(q[:, :, -1], k, scale=scale,
                                                                             head_pooling=head_pooling),
           "window", "TOVAPress", {"head_pooling": "group"},
           "TOVA (Oren et al. 2024): attention of the last query, GQA-averaged (head_pooling=\"all\": "
           "over all query heads, as kvpress)."),
    Scorer("knorm", lambda q, k, v, **_: knorm_scores(k), "none", "KNormPress", {},
           "K-norm (Devoto et al. 2024): keys of small L2 norm (score -||k||)."),
    Scorer("random", lambda q, k, v, *, seed, layer, event, **_: random_scores(k, seed=seed, layer=layer,
                                                                              event=event),
           "none", "RandomPress", {"seed": 0},
           "Uniform random importance without correction (the contrast to PoissonPress).", random=True),
    Scorer("expected", lambda q, k, v, *, scale, kernel_size, **_: expected_attention_scores(
               q, k, scale=scale, kernel_size=kernel_size),
           "window", "ExpectedAttentionPress", {"kernel_size": 7},
           "SnapKV mixed with expected attention under a Gaussian fit of the window's queries."),
):
    register_scorer(_scorer)
register_scorer(Scorer("keydiff", lambda q, k, v, **_: keydiff_scores(k), "none", "KeyDiffPress", {},
                       "KeyDiff (Park et al. 2025): keys far from the mean key direction (minus the cosine "
                       "with it)."))
register_scorer(Scorer("lagkv", lambda q, k, v, *, lag_size, n_sink, **_: lagkv_scores(k, v, lag_size=lag_size,
                                                                                       sinks=n_sink),
                       "none", "LagKVPress", {"lag_size": 128, "n_sink": 4},
                       "LagKV (Liang et al. 2025): per chunk of lag_size tokens, the spread of keys and values "
                       "min-max scaled by the next chunk (ranked within the chunk).", reads_values=True))
