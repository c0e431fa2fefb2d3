"""Batched token-importance scorers (b, h_kv, n), twins of ``reference.baselines``.

Each returns one importance per KV head; higher means keep. Query-based
scorers take the queries of all h_q = g * h_kv heads and average over the g
query heads of a KV head (GQA pooling), which is the reference scorer applied
to the (g, w, d) slice of that group. Computation in float32 (float64 for
float64 inputs); nothing here repeats K for GQA (queries are reshaped to
(b, h_kv, g * w, d) instead).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_nonneg_int, check_scale, check_tensor, compute_dtype
from .design import design_uniforms

__all__ = [
    "SCORERS",
    "streaming_llm_scores",
    "h2o_scores",
    "snapkv_scores",
    "tova_scores",
    "knorm_scores",
    "random_scores",
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
                  kernel_size: int = 7) -> torch.Tensor:
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

    Returns
    -------
    (b, h_kv, n) float32 (float64 for float64 inputs)
    """
    k = _keys(keys)
    qs, g, w = _group_queries(queries, k)
    b, h_kv, n, d = k.shape
    if w > n:
        raise ValueError(f"the observation window ({w} queries) is longer than the cache ({n} keys)")
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size}")
    dt = compute_dtype(qs, k)
    tau = check_scale(scale, d)
    s = torch.matmul(qs.to(dt) * tau, k.to(dt).transpose(-1, -2))  # (b, h_kv, g*w, n)
    s = s.view(b, h_kv, g, w, n)
    pos_q = torch.arange(n - w, n, device=k.device)[:, None]
    future = torch.arange(n, device=k.device)[None, :] > pos_q  # (w, n)
    s.masked_fill_(future, float("-inf"))
    u = torch.softmax(s, dim=-1).sum(dim=3).mean(dim=2)  # (b, h_kv, n)
    if kernel_size > 1:
        pad = kernel_size // 2
        up = F.pad(u.reshape(b * h_kv, 1, n), (pad, pad), mode="replicate")
        u = F.avg_pool1d(up, kernel_size, stride=1).reshape(b, h_kv, n)
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


def tova_scores(query: torch.Tensor, keys: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    r"""TOVA (Oren et al. 2024): attention of the last query, averaged over the group.

    .. math:: u_j = \frac{1}{g}\sum_h \operatorname{softmax}_i(\tau\, q_{h,\mathrm{last}}\cdot k_i)_j

    ``query`` (b, h_q, d) or (b, h_q, w, d) (the last of the w is used).
    """
    k = _keys(keys)
    q = check_tensor("query", query, ndim=(3, 4), floating=True)
    if q.ndim == 4:
        q = q[:, :, -1]
    qs, g, _ = _group_queries(q, k, decode_ok=True)
    b, h_kv, n, d = k.shape
    dt = compute_dtype(qs, k)
    s = torch.matmul(qs.to(dt) * check_scale(scale, d), k.to(dt).transpose(-1, -2))  # (b, h_kv, g, n)
    return torch.softmax(s, dim=-1).mean(dim=2)


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


#: name -> scorer, for tables and tests that iterate over every baseline
SCORERS = {
    "streaming_llm": streaming_llm_scores,
    "h2o": h2o_scores,
    "snapkv": snapkv_scores,
    "tova": tova_scores,
    "knorm": knorm_scores,
    "random": random_scores,
}
