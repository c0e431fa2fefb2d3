"""Exact attention and the Hajek estimator with its variance, batched (torch).

Shapes (docs/design.md section 3): q (b, h_q, d) for decode or (b, h_q, t, d) for
several queries; keys (b, h_kv, n, d), values (b, h_kv, n, dv); pi (b, h_kv, n)
with 0 on padding slots. GQA: h_q = g * h_kv, query head j reads KV head
j // g. The query heads of a KV head are stacked into the rows of one matrix,
q -> (b * h_kv, g * t, d), so K and V are read once per KV head and never
repeated.
"""

from __future__ import annotations

import threading

import torch

from ._checks import check_tensor, compute_dtype
from .contract import AttentionLayout, check_attention_inputs, check_attention_values
from .types import Estimate

__all__ = ["attention", "hajek_attention", "value_moments", "clear_workspace"]


class _Workspace(threading.local):
    """Per-thread scratch buffers reused across calls (one per (name, device, dtype)).

    The large temporaries of one call (scores, the [a; c] rows, the centred V
    tile: a few MB at long contexts) would otherwise be fresh allocations on
    every decode step; with glibc those are often returned to the OS on free
    and page-faulted back in on the next call. Nothing handed back to the
    caller aliases these buffers. They only grow, up to 64 MiB each; larger
    requests are ordinary allocations.
    """

    def __init__(self):
        self.buffers: dict = {}

    limit = 64 << 20  # bytes: larger requests (long prefill blocks) are plain allocations

    def get(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        if numel * torch.empty((), dtype=dtype).element_size() > self.limit:
            return torch.empty(max(numel, 1), dtype=dtype, device=device)[:numel]
        key = (name, torch.device(device), dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


WORKSPACE = _Workspace()


def clear_workspace() -> None:
    """Free the scratch buffers kept by :func:`hajek_attention` in this thread."""
    WORKSPACE.buffers.clear()


class QueryLayout:
    """The checked sizes of one call (a contract.AttentionLayout) and the (b*h_kv, g*t, .) views."""

    def __init__(self, C: AttentionLayout, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        self.decode = C.decode
        self.b, self.h_q, self.h_kv, self.g, self.n, self.d, self.dv = C.b, C.h_q, C.h_kv, C.g, C.n, C.d, C.dv
        self.t = 1 if C.decode else C.t
        self.B, self.G = C.b * C.h_kv, C.g * self.t
        self.scale = C.scale
        self.bias_shape = C.bias_shape
        self.q, self.keys, self.values = q, keys, values
        self.dtype = compute_dtype(q, keys, values)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """(b, h_q, [t,] k) per-query-head tensor -> (B, G, k)."""
        return x.reshape(self.B, self.G, x.shape[-1])

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        """(B, G, k) -> (b, h_q, [t,] k); (B, G) -> (b, h_q[, t])."""
        tail = tuple(x.shape[2:])
        if self.decode:
            return x.reshape(self.b, self.h_q, *tail)
        return x.reshape(self.b, self.h_q, self.t, *tail)


def _per_kv(name: str, x: torch.Tensor, L: QueryLayout) -> torch.Tensor:
    x = check_tensor(name, x)
    if tuple(x.shape) != (L.b, L.h_kv, L.n):
        raise ValueError(f"{name} must have shape (b, h_kv, n) = ({L.b}, {L.h_kv}, {L.n}), got {tuple(x.shape)}")
    return x


def _logits(L: QueryLayout, *, log_pi: torch.Tensor | None, bias, positions, query_positions, offset,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """s_i - log pi_i (+ bias, causal mask) as (B, G, n) in the compute dtype (into ``out``).

    The arguments have passed :func:`check_attention_inputs` (shapes, and bias values).
    """
    dt = L.dtype
    qf = L.q.to(dt).reshape(L.B, L.G, L.d) * L.scale
    kf = L.keys.to(dt).reshape(L.B, L.n, L.d)
    s = torch.bmm(qf, kf.transpose(1, 2), out=out)
    if log_pi is not None:
        lp = log_pi.to(dt).reshape(L.B, 1, L.n)
        # bias -log pi, and -inf (not +inf = -log 0) on padding slots
        s.add_(torch.where(lp > float("-inf"), -lp, float("-inf")))
    if bias is not None:
        s.add_(_broadcast_bias(bias, L).to(dt).reshape(L.B, L.G, L.n))
    qp = _query_positions(L, query_positions, offset, s.device)
    if qp is not None:
        if positions is None:
            pos = torch.arange(L.n, device=s.device).expand(L.B, L.n)
        else:
            pos = positions.reshape(L.B, L.n)
        qpB = qp.repeat_interleave(L.h_kv, dim=0)  # (B, t), row b*h_kv + h
        future = pos[:, None, None, :] > qpB[:, None, :, None]  # (B, 1, t, n)
        s.view(L.B, L.g, L.t, L.n).masked_fill_(future, float("-inf"))
    return s


def _broadcast_bias(bias: torch.Tensor, L: QueryLayout) -> torch.Tensor:
    """The (checked) bias as a (b, h_q, [t,] n) view."""
    return torch.broadcast_to(bias, L.bias_shape)


def _query_positions(L: QueryLayout, query_positions, offset, device) -> torch.Tensor | None:
    """(b, t) int64 positions of the queries (checked arguments), or None without a causal mask."""
    if query_positions is None and offset is None:
        return None
    if offset is not None:
        qp = torch.arange(L.t, device=device) + int(offset)
    else:
        qp = query_positions
    return torch.broadcast_to(qp.to(device), (L.b, L.t))


def _query_chunk(L: "QueryLayout", query_chunk_bytes: int) -> int:
    """Queries per block so that a (b*h_q, block, n) fp32 score tensor fits the budget."""
    if L.decode or L.t <= 1:
        return max(L.t, 1)
    per_query = L.b * L.h_q * max(L.n, 1) * 4 * 3  # scores, weights, c
    return int(max(1, min(L.t, query_chunk_bytes // per_query)))


def _cat_estimates(parts: list) -> Estimate:
    """Concatenate the Estimates of query blocks along the query dim (dim 2)."""
    def cat(name):
        xs = [getattr(p, name) for p in parts]
        return None if xs[0] is None else torch.cat(xs, dim=2)
    return Estimate(output=cat("output"), weights=cat("weights"), variance=cat("variance"), trace=cat("trace"),
                    lse=cat("lse"), n_eff=cat("n_eff"), max_term=cat("max_term"), covariance=cat("covariance"),
                    tail_moment=cat("tail_moment"))


def _softmax(s: torch.Tensor):
    """In place: s -> a = softmax(s); returns (a, lse, empty) with empty rows a = 0."""
    m = s.amax(-1, keepdim=True)
    empty = m == float("-inf")  # (B, G, 1): every slot padding or masked
    m.masked_fill_(empty, 0.0)
    a = s.sub_(m).exp_()
    l = a.sum(-1, keepdim=True)
    lse = (m + torch.log(l)).squeeze(-1)  # -inf on empty rows (l = 0)
    a.div_(l.masked_fill_(empty, 1.0))
    return a, lse, empty.squeeze(-1)


def _tiles(n: int, dv: int, dt: torch.dtype, device, chunk_bytes: int | None) -> tuple[int, int]:
    """(heads per chunk, tokens per tile) so a centred V tile holds about ``chunk_bytes``.

    The default (4 MiB on CPU: a slice of the L3 cache; 1 GiB elsewhere, i.e.
    no tiling on a GPU) keeps the (V - mu) temporaries cache-resident on CPU
    instead of materializing them over the whole cache.
    """
    if chunk_bytes is None:
        chunk_bytes = (4 << 20) if torch.device(device).type == "cpu" else (1 << 30)
    per_token = dv * torch.empty((), dtype=dt).element_size()
    per_head = max(1, n * per_token)
    hc = max(1, chunk_bytes // per_head)
    nc = max(1, min(n, chunk_bytes // per_token)) if hc == 1 else max(n, 1)
    return hc, nc


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float | None = None,
              bias: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              query_positions: torch.Tensor | None = None, offset: int | None = None) -> torch.Tensor:
    r"""Exact softmax attention over the full cache, batched, GQA.

    .. math:: o = \sum_i \frac{e^{s_i}}{Z} v_i, \qquad Z = \sum_i e^{s_i},
              \qquad s_i = \tau\, q \cdot k_i + b_i .

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d)
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), h_q = g * h_kv
    scale : float, default 1/sqrt(d)
        Finite and positive (every backend refuses a negative scale).
    bias : tensor broadcastable to (b, h_q, [t,] n), optional additive mask
    positions, query_positions, offset
        Causal mask as in :func:`hajek_attention`.

    Returns
    -------
    output : (b, h_q, [t,] dv) in the dtype of ``values`` (fp32 accumulation).

    Raises
    ------
    ValueError if a query sees no token (empty or fully masked cache), as the reference.
    """
    C = check_attention_inputs(q, keys, values, scale=scale, bias=bias, positions=positions,
                               query_positions=query_positions, offset=offset, probabilities=False, validate=True)
    L = QueryLayout(C, q, keys, values)
    if L.n == 0:
        raise ValueError("attention over an empty (or fully masked) cache is undefined")
    s = _logits(L, log_pi=None, bias=bias, positions=positions, query_positions=query_positions, offset=offset)
    a, _, empty = _softmax(s)
    if bool(empty.any()):
        raise ValueError("attention over an empty (or fully masked) cache is undefined")
    o = torch.bmm(a, L.values.to(L.dtype).reshape(L.B, L.n, L.dv))
    if bool(torch.isnan(o).any()):
        raise ValueError("attention produced NaN: q, keys and values must be finite")
    return L.unrows(o).to(values.dtype)


def value_moments(values: torch.Tensor, pi: torch.Tensor | None = None, *, log_pi: torch.Tensor | None = None):
    r"""Per-head reference value and per-token squared distances, for the cheap trace.

    .. math:: \mu = \frac{1}{|S|}\sum_{i\in S} v_i, \qquad r_i = \lVert v_i - \mu \rVert^2,

    the mean kept value of each KV head (padding excluded; r is 0 there) and the scalars a
    compressed cache can keep beside log pi (1/dv extra memory), so that
    ``hajek_attention(..., value_center=mu, value_sqdist=r, per_coordinate=False)``
    computes the trace without another pass over V.

    Returns
    -------
    mu : (b, h_kv, dv) float32 (float64 for float64 values)
    r : (b, h_kv, n) same dtype
    """
    values = check_tensor("values", values, ndim=(4,), floating=True)
    dt = compute_dtype(values)
    v = values.to(dt)
    if pi is None and log_pi is None:
        present = torch.ones(values.shape[:3], dtype=torch.bool, device=values.device)
    else:
        present = (pi > 0) if pi is not None else (log_pi > float("-inf"))
    w = present.to(dt)
    cnt = w.sum(-1, keepdim=True).clamp(min=1.0)
    mu = (w.unsqueeze(-2) @ v).squeeze(-2) / cnt
    r = (v - mu.unsqueeze(-2)).square_().sum(-1).mul_(w)       # 0 on padding
    return mu, r


def cast_to(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``x.to(dt)``, without a dispatcher call when it is a no-op (the per-step path makes many)."""
    return x if x.dtype == dt else x.to(dt)


def _cached_moments(L: QueryLayout, value_center, value_sqdist):
    """The checked ``value_center`` (B, 1, dv) and ``value_sqdist`` (B, n) in the compute dtype, or None."""
    mu_all = r2_all = None
    if value_center is not None:
        mu_all = check_tensor("value_center", value_center)
        if tuple(mu_all.shape) != (L.b, L.h_kv, L.dv):
            raise ValueError(f"value_center must have shape (b, h_kv, dv) = ({L.b}, {L.h_kv}, {L.dv}), "
                             f"got {tuple(mu_all.shape)}")
        mu_all = cast_to(mu_all, L.dtype).reshape(L.B, 1, L.dv)
    if value_sqdist is not None:
        if value_center is None:
            raise TypeError("value_sqdist= needs the value_center= it was computed with")
        r2_all = cast_to(_per_kv("value_sqdist", value_sqdist, L), L.dtype).reshape(L.B, L.n)
    return mu_all, r2_all


def _tiled_moments(L: QueryLayout, ac, sc, v, lp, omp, empty, mu_all, r2_all, per_coordinate: bool,
                   want_max: bool, want_cov: bool, chunk_bytes, want_tail: bool = False):
    """Output and centred moments, one cache-resident chunk of V at a time.

    Per chunk of KV heads: [o; sum c v] = [a; c] @ V in one matmul (V read
    from memory once), the centre mu, then the centred tile V - mu (written
    into one reused buffer, still in cache) gives ||v_i - mu||^2 (a row norm)
    or, per coordinate, c @ (V - mu)^2; on request the covariance, max_term
    and tail_moment pieces. max_term and tail_moment need the per-token
    distances ||v_i - o_hat||^2 = ||v_i - mu||^2 - 2 (v_i - mu).(o_hat - mu)
    + ||o_hat - mu||^2, available once the chunk's o_hat is known: one more
    small matmul per tile (the second reduction over S; the weights are the
    chunk's own). The epilogue combining the moments runs once, batched.
    """
    dt, G, dev, dv = L.dtype, L.G, v.device, L.dv
    a, c = ac[:, :G], ac[:, G:]  # (B, 2G, n): rows [a; c]
    oc = torch.empty(L.B, 2 * G, dv, dtype=dt, device=dev)
    mu = torch.empty(L.B, 1, dv, dtype=dt, device=dev) if mu_all is None else mu_all
    acc = torch.zeros(L.B, G, dv, dtype=dt, device=dev) if per_coordinate else None
    r2 = torch.empty(L.B, L.n, dtype=dt, device=dev) if (r2_all is None and not per_coordinate) else r2_all
    max_term = torch.zeros(L.B, G, dtype=dt, device=dev) if want_max else None
    tail = torch.zeros(L.B, G, dtype=dt, device=dev) if want_tail else None
    want_dist = want_max or want_tail
    cov = torch.zeros(L.B, G, dv, dv, dtype=dt, device=dev) if want_cov else None
    pf = torch.exp(lp) if want_max else None
    # the centre of a group is the mean output of its non-empty query rows, written as a weighted mean
    # so that no host read decides whether any row is empty (with none empty it is the plain mean)
    live = (~empty).to(dt).unsqueeze(-1) if mu_all is None else None
    hc, nc = _tiles(L.n, dv, dt, dev, chunk_bytes)
    buf = WORKSPACE.get("tile", min(hc, L.B) * min(nc, L.n) * dv, dt, dev)
    for h0 in range(0, L.B, hc):
        h1 = min(L.B, h0 + hc)
        vh = v[h0:h1]
        och = torch.bmm(ac[h0:h1], vh, out=oc[h0:h1])
        oh = och[:, :G]
        if mu_all is None:  # the mean output of the group's non-empty query rows
            lv = live[h0:h1]
            torch.div((oh * lv).sum(1, keepdim=True), lv.sum(1, keepdim=True).clamp_(min=1.0), out=mu[h0:h1])
        muh = mu[h0:h1]
        need_tile = per_coordinate or want_dist or want_cov or r2_all is None
        if not need_tile:
            continue
        if want_dist:
            dm = oh - muh
            dm2 = (dm * dm).sum(-1, keepdim=True)
        for n0 in range(0, L.n, nc):
            n1 = min(L.n, n0 + nc)
            vt = torch.sub(vh[:, n0:n1], muh, out=buf[: (h1 - h0) * (n1 - n0) * dv].view(h1 - h0, n1 - n0, dv))
            ct = c[h0:h1, :, n0:n1]
            if want_cov:
                for j in range(G):
                    cov[h0:h1, j].baddbmm_(vt.transpose(1, 2), vt * ct[:, j, :, None])
            if want_dist:
                cross = torch.bmm(dm, vt.transpose(1, 2))  # (v_i - mu).(o - mu), (hc, G, nc)
            if r2_all is None and not per_coordinate:
                torch.linalg.vector_norm(vt, dim=-1, out=r2[h0:h1, n0:n1])
                r2t = r2[h0:h1, n0:n1].square_()  # ||v_i - mu||^2
            elif r2_all is not None:
                r2t = r2_all[h0:h1, n0:n1]
            else:
                r2t = None
            if per_coordinate:
                wt = vt.square_()
                acc[h0:h1].baddbmm_(ct, wt)  # sum_S c_i (v_i - mu)^2 per coordinate
                if want_dist and r2t is None:
                    r2t = wt.sum(-1)
            if want_dist:
                # ||v_i - o||^2 = ||v_i - mu||^2 - 2 (v_i - mu).(o - mu) + ||o - mu||^2
                dist2 = (r2t[:, None, :] - 2.0 * cross + dm2).clamp_(min=0.0)
                ot = omp[h0:h1, None, n0:n1]
            if want_tail:
                # x_i = c_i ||v_i - o||^2, the trace's terms; s2 += sum_i (1 - pi_i) x_i^2
                # (0 on pi = 1, on padding and on masked tokens, where c_i = 0)
                x = ct * dist2
                tail[h0:h1] += (x * x).mul_(ot).sum(-1)
            if want_max:
                dist = dist2.sqrt_()  # (tail_moment, if asked, has used dist2 already)
                at = a[h0:h1, :, n0:n1]
                terms = torch.maximum(ot, pf[h0:h1, None, n0:n1]) * at * dist
                terms = torch.where((ot > 0) & (at > 0), terms, torch.zeros_like(terms))
                torch.maximum(max_term[h0:h1], terms.amax(-1), out=max_term[h0:h1])
    # epilogue, batched: sum c (v - o)^2 = sum c (v - mu)^2 - 2 (o - mu) s1 + (o - mu)^2 sum c
    o, cv = oc[:, :G], oc[:, G:]
    dm = o - mu
    s1 = cv - mu * sc  # sum_S c_i (v_i - mu); its rounding is multiplied by the small (o - mu)
    variance = None
    if per_coordinate:
        variance = (acc - 2.0 * dm * s1 + dm * dm * sc).clamp_(min=0.0)
        trace = variance.sum(-1)
    else:
        t1 = torch.bmm(c, r2.unsqueeze(-1)).squeeze(-1)  # sum_S c_i ||v_i - mu||^2
        trace = (t1 - 2.0 * (dm * s1).sum(-1) + (dm * dm).sum(-1) * sc.squeeze(-1)).clamp_(min=0.0)
    covariance = None
    if want_cov:
        cov -= dm[..., :, None] * s1[..., None, :] + s1[..., :, None] * dm[..., None, :]
        cov += sc[..., None] * dm[..., :, None] * dm[..., None, :]
        covariance = 0.5 * (cov + cov.transpose(-1, -2))
    return o.contiguous(), variance, trace, max_term, covariance, tail


def _one_pass(L: QueryLayout, lp: torch.Tensor, omp: torch.Tensor, bias, mu: torch.Tensor, r2: torch.Tensor):
    r"""Output, log-normalizer and trace with the cached centre: one matmul over V, no tiles.

    The trace-only path with ``value_center`` / ``value_sqdist`` (docs/design.md
    section 3, "the cheap certificate"), in about fifteen batched ops:

    .. math::

        s = \tau\, q K^\top - \log\pi \ (+\,\mathrm{bias}), \quad a = \operatorname{softmax}(s),
        \quad c = (1-\pi)\, a^2, \quad [\hat o;\ \textstyle\sum_S c_i v_i] = [a; c]\, V,

        \mathrm{trace} = \textstyle\sum_S c_i r_i - 2 (\hat o-\mu)\cdot(\sum_S c_i v_i - \mu \sum_S c_i)
                        + \lVert \hat o - \mu\rVert^2 \sum_S c_i, \qquad r_i = \lVert v_i-\mu\rVert^2 .

    The scores go straight into a reused buffer (``baddbmm`` with the bias
    -log pi as its input), the softmax writes the rows a into the [a; c]
    buffer, and the epilogue is a handful of (B, G)-sized ops. Returns
    (o (B, G, dv), trace (B, G), lse (B, G)); empty rows (every slot padding
    or masked: lse -inf) come back NaN and are fixed by the caller.
    """
    dt, B, G, n, dev = L.dtype, L.B, L.G, L.n, L.q.device
    v, s, m = offset_scores(L, lp, bias, "scores")
    ac = WORKSPACE.get("rows", B * 2 * G * n, dt, dev).view(B, 2 * G, n)  # rows [a; c]
    a = torch.sub(s, m, out=ac[:, :G]).exp_()  # the softmax, written into the [a; c] rows
    l = a.sum(-1, keepdim=True)
    a.div_(l)
    lse = l.log_().add_(m).squeeze(-1)
    c = torch.mul(a, a, out=ac[:, G:]).mul_(omp.view(B, 1, n))  # (1 - pi) a^2: 0 on pi = 1 and on padding
    oc = torch.bmm(ac, v)  # (B, 2G, dv): [o; sum c v]
    o, cv = oc[:, :G], oc[:, G:]
    sc = c.sum(-1, keepdim=True)  # (B, G, 1)
    t1 = torch.linalg.vecdot(c, r2.view(B, 1, n))  # sum c_i ||v_i - mu||^2
    return o, centred_sum(t1, cv, sc, o - mu, mu), lse


def offset_scores(L: QueryLayout, lp: torch.Tensor, bias, name: str):
    r"""The one-pass paths' scores: ``(v, s, m)`` with v the values as (B, n, dv),
    :math:`s = \tau q K^\top - \log\pi` (+ bias) (B, G, n) written into the workspace buffer
    ``name`` by one ``baddbmm`` (-log pi as its input; -inf, not +inf, on padding slots), and the
    row max m (B, G, 1) clamped to a finite value, so that on an empty row (every slot padding or
    masked) s - m stays -inf (not NaN) and the log-normalizer comes out -inf, which callers detect."""
    dt, B, G, n = L.dtype, L.B, L.G, L.n
    qf = cast_to(L.q, dt).reshape(B, G, L.d)
    kf = cast_to(L.keys, dt).reshape(B, n, L.d)
    v = cast_to(L.values, dt).reshape(B, n, L.dv)
    off = lp.neg().nan_to_num_(nan=float("nan"), posinf=float("-inf")).view(B, 1, n)  # NaN stays NaN
    if bias is not None:
        off = off + _broadcast_bias(bias, L).to(dt).reshape(B, G, n)
    s = WORKSPACE.get(name, B * G * n, dt, L.q.device).view(B, G, n)
    torch.baddbmm(off, qf, kf.transpose(1, 2), alpha=L.scale, out=s)
    return v, s, s.amax(-1, keepdim=True).clamp_(min=torch.finfo(dt).min)


def centred_sum(t: torch.Tensor, cv: torch.Tensor, sc: torch.Tensor, dm: torch.Tensor, mu: torch.Tensor):
    r"""The centred form of :math:`\sum_S c_i \lVert v_i - \hat o\rVert^2`, clamped at 0:

    .. math:: \textstyle\sum c_i r_i - 2 (\hat o-\mu)\cdot(\sum c_i v_i - \mu \sum c_i)
              + \lVert \hat o - \mu\rVert^2 \sum c_i,

    from t = sum c r (...), cv = sum c v (..., dv), sc = sum c (..., 1), dm = o_hat - mu and
    mu (broadcast against cv): the epilogue of the one-pass trace, and of any weights c."""
    half = torch.addcmul(cv, mu, sc, value=-1.0).addcmul_(dm, sc, value=-0.5)  # s1 - (o - mu) sum c / 2
    return torch.add(t, torch.linalg.vecdot(dm, half), alpha=-2.0).clamp_(min=0.0)


def empty_estimate(L: QueryLayout, weights: bool, max_term: bool, covariance: bool, per_coordinate: bool,
                    tail_moment: bool = False) -> Estimate:
    """The reference's convention for an empty sample, for every query row (n = 0)."""
    dt, dev = L.dtype, L.q.device
    inf = float("inf")
    rows = lambda k: L.unrows(torch.full((L.B, L.G, k), inf, dtype=dt, device=dev))  # noqa: E731
    scalar = lambda val: L.unrows(torch.full((L.B, L.G, 1), val, dtype=dt, device=dev)).squeeze(-1)  # noqa: E731
    return Estimate(
        output=L.unrows(torch.zeros(L.B, L.G, L.dv, dtype=L.values.dtype, device=dev)),
        weights=L.unrows(torch.zeros(L.B, L.G, 0, dtype=dt, device=dev)) if weights else None,
        variance=rows(L.dv) if per_coordinate else None,
        trace=scalar(inf),
        lse=scalar(-inf),
        n_eff=scalar(0.0),
        max_term=scalar(inf) if max_term else None,
        covariance=L.unrows(torch.full((L.B, L.G, L.dv, L.dv), inf, dtype=dt, device=dev)) if covariance else None,
        tail_moment=scalar(inf) if tail_moment else None,
    )


def hajek_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor | None = None, *,
                    scale: float | None = None, per_coordinate: bool = True, log_pi: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    query_positions: torch.Tensor | None = None, offset: int | None = None,
                    return_weights: bool = False, return_max_term: bool = False,
                    return_covariance: bool = False, value_center: torch.Tensor | None = None,
                    value_sqdist: torch.Tensor | None = None, chunk_bytes: int | None = None,
                    query_chunk_bytes: int = 256 << 20, return_tail_moment: bool = False,
                    validate: bool = True) -> Estimate:
    r"""Hajek-corrected attention over a compressed cache and its variance, batched.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \qquad a_i = \operatorname{softmax}_S(s_i - \log \pi_i),
        \qquad \log \hat Z = \log \sum_{i\in S} e^{s_i}/\pi_i,

        \mathrm{variance}_d = \sum_{i\in S} c_i (v_{id} - \hat o_d)^2, \qquad
        \mathrm{trace} = \sum_{i\in S} c_i \lVert v_i - \hat o\rVert^2,
        \qquad c_i = (1-\pi_i)\, a_i^2,

        \mathrm{tail\_moment} = \sum_{i\in S} (1-\pi_i)\, x_i^2, \qquad
        x_i = c_i \lVert v_i - \hat o\rVert^2 \quad\text{(on request)}.

    Both variance and trace are evaluated in the centred moment form around a per-head reference
    :math:`\mu` (no catastrophic cancellation when the values share a large
    offset, and no (v - o)^2 over n x dv per query):

    .. math::

        \mathrm{trace} = \sum_S c_i \lVert v_i-\mu\rVert^2
            - 2(\hat o-\mu)\cdot\sum_S c_i (v_i-\mu) + \lVert\hat o-\mu\rVert^2 \sum_S c_i

    (per coordinate the same with squares instead of squared norms). Default
    path: :math:`\hat o = aV` in one matmul per chunk of KV heads, :math:`\mu`
    = the mean output of the KV head's query rows (so the expansion is the
    exact formula when g * t = 1), then the centred tile V - mu, small enough
    to stay in cache (``chunk_bytes``), gives :math:`\sum c_i (v_i-\mu)` and
    :math:`\sum c_i (v_i-\mu)^2` by two more small matmuls: K and V are read
    from memory once. With ``value_center``/``value_sqdist`` (the "cheap
    certificate" of docs/design.md section 3: :math:`\mu` and
    :math:`\lVert v_i-\mu\rVert^2` kept beside log pi) and
    ``per_coordinate=False``, the rows [a; c] are stacked against V in a
    single matmul and nothing else touches V: this **one-pass path** (no
    tiles, no causal mask, none of ``return_weights`` / ``return_max_term``
    / ``return_covariance`` / ``return_tail_moment``) leaves ``n_eff``
    None; it is the decode path of the Hugging Face integration.

    Parameters
    ----------
    q : (b, h_q, d) or (b, h_q, t, d)
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv)
        The kept tokens; padding slots carry pi = 0.
    pi : (b, h_kv, n), optional
        Inclusion probabilities in [0, 1] (0 = padding, bias -inf, never +inf).
    log_pi : (b, h_kv, n), optional
        log pi instead of pi (-inf = padding), as the HF cache stores it;
        1 - pi is then computed as ``-expm1(log_pi)``. Pass exactly one.
    scale : float, default 1/sqrt(d)
        Finite and positive (every backend refuses a negative scale).
    per_coordinate : bool
        Compute ``variance`` (b, h_q, [t,] dv). False computes only ``trace``
        (all the norm certificates need) and leaves ``variance`` None.
    bias : tensor broadcastable to (b, h_q, [t,] n), optional
        Extra additive score mask (-inf masks a token).
    positions : int64 (b, h_kv, n), optional
        Original positions of the kept tokens (``CompressedCache.positions``).
    query_positions : int64 (t,) or (b, t), optional
        Position of each query; query j sees the kept tokens with
        ``positions <= query_positions[j]`` (causal mask). Without
        ``positions`` the slot index is the position.
    offset : int, optional
        Shortcut for ``query_positions = offset + arange(t)``.
    return_weights : bool
        Fill ``Estimate.weights`` (b, h_q, [t,] n).
    return_max_term : bool
        Fill ``Estimate.max_term`` (for the ``bernstein`` certificate): one
        more small matmul per V tile.
    return_covariance : bool
        Fill ``Estimate.covariance`` (b, h_q, [t,] dv, dv), the full
        :math:`\hat\Sigma` (O(n dv^2) per query; for ``chi2`` and diagnostics).
    return_tail_moment : bool
        Fill ``Estimate.tail_moment`` (b, h_q, [t,] ): the HT estimate
        :math:`s_2 = \sum_S (1-\pi_i)^3 a_i^4 \lVert v_i - \hat o\rVert^4`
        of the design variance of the trace itself, for the
        ``chebyshev_ucb`` certificate. Needs :math:`\hat o` first, so it is a
        second reduction over S inside each chunk (one more small matmul
        per V tile, as ``max_term``); no extra memory beyond a (b, h_q)
        accumulator.
    value_center, value_sqdist : (b, h_kv, dv), (b, h_kv, n), optional
        Precomputed :math:`\mu` and :math:`\lVert v_i - \mu\rVert^2` (see
        :func:`value_moments`): the trace-only path then makes no extra pass
        over V.
    chunk_bytes : int, optional
        Size of the centred V tiles (default 4 MiB on CPU, no tiling on GPU).
    query_chunk_bytes : int
        With several queries, process query blocks whose scores take at most
        this many bytes (default 256 MiB), so memory stays bounded for long t.
    validate : bool, default True
        Check the values (pi in [0, 1] / log_pi <= 0, bias without NaN or
        +inf), fix up empty rows, and refuse a NaN output: the only reads
        of tensor values, hence the only host synchronisations of a call.
        ``False`` is for a caller that has checked its inputs once (the
        Hugging Face session checks log pi at each eviction event and the
        outputs once per forward): shapes are still checked, values are
        not, and a query row that sees no token gives NaN instead of the
        empty-sample convention.

    Returns
    -------
    Estimate
        output in the dtype of ``values``; variance, trace, lse, n_eff,
        max_term, tail_moment in float32 (float64 when an input is float64).
        Empty sample (every slot padding or masked for a query): output 0,
        lse -inf, variance, trace and tail_moment +inf, n_eff 0, max_term +inf.

    Notes
    -----
    Computation in float32 (float64 for float64 inputs) whatever the input
    dtype: bf16/fp16 K and V are upcast. The variance is accurate relative to
    the computed :math:`\hat o`; the rounding error of :math:`\hat o` itself
    (as in any fp32 attention, about eps * max |v|) moves it by
    :math:`2|\sum c_i (v_i - \hat o)|` times that error. ``max_term`` uses
    the expansion of :math:`\lVert v_i - \hat o\rVert^2` around mu, so its
    small distances carry an absolute error of about sqrt(eps) times the
    spread of the values (the max is dominated by the large ones);
    ``tail_moment`` uses the same squared distances (absolute error about
    eps (||v_i - o_hat|| + 2 ||o_hat - mu||)^2 each, exact when g * t = 1
    since mu = o_hat then). In float32 its terms below about 1e-38 flush to 0
    (a total error below n times that).
    pi = 1 tokens add nothing to the variance; with all pi = 1 the output is
    exact attention and the variance 0. Tiny pi (1e-6) give a large positive
    bias, handled by the max shift. NaN in the inputs raises a ValueError
    (checked on the small output).

    References
    ----------
    Horvitz & Thompson (1952); Hajek (1971); Sarndal, Swensson & Wretman
    (1992), sec. 5.6-5.7; arXiv 2607.21475.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import hajek_attention, attention
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g),
    ...            torch.randn(1, 2, 6, 3, generator=g))
    >>> est = hajek_attention(q, k, v, torch.ones(1, 2, 6))  # every pi = 1: exact, variance 0
    >>> bool(torch.allclose(est.output, attention(q, k, v), atol=1e-6)), float(est.trace.max())
    (True, 0.0)
    """
    C = check_attention_inputs(q, keys, values, pi, log_pi=log_pi, scale=scale, bias=bias, positions=positions,
                               query_positions=query_positions, offset=offset)
    L = QueryLayout(C, q, keys, values)
    tc = _query_chunk(L, query_chunk_bytes)
    if tc < L.t:  # many queries: bound the (b * h_q * t * n) score memory, query block by query block
        kw = dict(scale=scale, per_coordinate=per_coordinate, log_pi=log_pi, positions=positions,
                  return_weights=return_weights, return_max_term=return_max_term,
                  return_covariance=return_covariance, value_center=value_center, value_sqdist=value_sqdist,
                  chunk_bytes=chunk_bytes, return_tail_moment=return_tail_moment, validate=validate)
        return _by_query_blocks(L, tc, pi, bias, query_positions, offset, kw)
    if validate:  # pi / log_pi and bias values; a call split above checks them per block
        check_attention_values(C, bias)
    lp, omp = _log_pi(C, L)
    if L.n == 0:
        return empty_estimate(L, return_weights, return_max_term, return_covariance, per_coordinate,
                               return_tail_moment)
    one_pass = (value_sqdist is not None and not per_coordinate and not return_weights and not return_max_term
                and not return_covariance and not return_tail_moment and positions is None
                and query_positions is None and offset is None)
    mu_all, r2_all = _cached_moments(L, value_center, value_sqdist)
    if one_pass:
        return _one_pass_estimate(L, lp, omp, bias, mu_all, r2_all, validate)
    a, lse, empty, stats = _tiled_path(L, lp, omp, mu_all, r2_all, bias, positions, query_positions, offset,
                                       per_coordinate, return_max_term, return_covariance, return_tail_moment,
                                       chunk_bytes)
    return _tiled_estimate(L, a, lse, empty, *stats, validate=validate, return_weights=return_weights)


def _by_query_blocks(L: QueryLayout, tc: int, pi, bias, query_positions, offset, kw: dict) -> Estimate:
    """:func:`hajek_attention` block by block of ``tc`` queries (the bias and the query positions sliced
    alike), the blocks' estimates concatenated along the queries."""
    q, keys, values = L.q, L.keys, L.values
    qp = _query_positions(L, query_positions, offset, q.device)
    full = None if bias is None else _broadcast_bias(bias, L)
    parts = [hajek_attention(q[:, :, t0:t0 + tc], keys, values, pi,
                             bias=None if full is None else full[:, :, t0:t0 + tc],
                             query_positions=None if qp is None else qp[:, t0:t0 + tc],
                             query_chunk_bytes=1 << 62, **kw)
             for t0 in range(0, L.t, tc)]
    return _cat_estimates(parts)


def _log_pi(C: AttentionLayout, L: QueryLayout):
    """log pi and 1 - pi (B, n) in the compute dtype, from pi (log 0 = -inf on padding: the logit becomes -inf,
    never +inf) or from log pi (1 - pi = -expm1(log pi))."""
    dt = L.dtype
    if C.p_name == "pi":
        pf = cast_to(C.p, dt).reshape(L.B, L.n)
        lp = torch.log(pf)  # -inf on padding: the logit becomes -inf, never +inf
        omp = 1.0 - pf
    else:
        lp = cast_to(C.p, dt).reshape(L.B, L.n)
        omp = -torch.expm1(lp)
    return lp, omp


def _one_pass_estimate(L: QueryLayout, lp, omp, bias, mu_all, r2_all, validate: bool) -> Estimate:
    """The one-pass path's Estimate (:func:`_one_pass`): output, trace and lse; with ``validate`` the empty
    rows get the empty-sample convention and a NaN output is refused."""
    o, trace, lse = _one_pass(L, lp, omp, bias, mu_all, r2_all)
    empty = lse == float("-inf") if validate else None
    if validate and bool(empty.any()):
        o = o.masked_fill(empty[..., None], 0.0)
        trace = trace.masked_fill(empty, float("inf"))
    if validate and bool(torch.isnan(o).any()):
        raise ValueError("hajek_attention produced NaN: q, keys, values (and bias) must be finite")
    return Estimate(output=cast_to(L.unrows(o), L.values.dtype), weights=None, variance=None,
                    trace=L.unrows(trace[..., None]).squeeze(-1), lse=L.unrows(lse[..., None]).squeeze(-1))


def _tiled_path(L: QueryLayout, lp, omp, mu_all, r2_all, bias, positions, query_positions, offset, per_coordinate: bool,
                return_max_term: bool, return_covariance: bool, return_tail_moment: bool, chunk_bytes):
    """The default path: the logits (causal mask and bias included) and their softmax a (B, G, n) with lse and the
    rows that see no token, then c = (1 - pi) a^2 and :func:`_tiled_moments` over the centred V tiles; returns
    (a, lse, empty, (o, variance, trace, max_term, covariance, tail_moment, n_eff))."""
    dt, dev = L.dtype, L.q.device
    ws = WORKSPACE.get("scores", L.B * L.G * L.n, dt, dev).view(L.B, L.G, L.n)
    s = _logits(L, log_pi=lp.reshape(L.b, L.h_kv, L.n), bias=bias, positions=positions,
                query_positions=query_positions, offset=offset, out=ws)
    a, lse, empty = _softmax(s)  # (B, G, n), (B, G), (B, G)
    ac = WORKSPACE.get("rows", L.B * 2 * L.G * L.n, dt, dev).view(L.B, 2 * L.G, L.n)  # rows [a; c]
    ac[:, : L.G] = a
    a = ac[:, : L.G]
    c = torch.mul(a, a, out=ac[:, L.G:]).mul_(omp[:, None, :])  # (1 - pi) a^2: 0 on pi = 1 and on padding
    v = L.values.to(dt).reshape(L.B, L.n, L.dv)
    sc = c.sum(-1, keepdim=True)  # (B, G, 1) sum_S c_i
    stats = _tiled_moments(L, ac, sc, v, lp, omp, empty, mu_all, r2_all, per_coordinate, return_max_term,
                           return_covariance, chunk_bytes, want_tail=bool(return_tail_moment))
    n_eff = torch.linalg.vector_norm(a, dim=-1).square_().reciprocal_()  # 1 / sum a^2
    return a, lse, empty, (*stats, n_eff)


def _tiled_estimate(L: QueryLayout, a, lse, e, o, variance, trace, max_term, covariance, tail, n_eff, *,
                    validate: bool, return_weights: bool) -> Estimate:
    """The default path's Estimate in the caller's shape: the rows ``e`` that see no token get output 0, the
    statistics +inf and n_eff 0 (filled unconditionally: no host read); with ``validate`` a NaN output is
    refused."""
    o = o.masked_fill(e[..., None], 0.0)
    trace = trace.masked_fill(e, float("inf"))
    n_eff = n_eff.masked_fill(e, 0.0)
    if variance is not None:
        variance = variance.masked_fill(e[..., None], float("inf"))
    if max_term is not None:
        max_term = max_term.masked_fill(e, float("inf"))
    if covariance is not None:
        covariance = covariance.masked_fill(e[..., None, None], float("inf"))
    if tail is not None:
        tail = tail.masked_fill(e, float("inf"))
    # NaN anywhere in q, keys, values or bias reaches o (through the scores or the values)
    if validate and bool(torch.isnan(o).any()):
        raise ValueError("hajek_attention produced NaN: q, keys, values (and bias) must be finite")
    weights = L.unrows(a.clone()) if return_weights else None  # never hand out the workspace
    return Estimate(
        output=L.unrows(o).to(L.values.dtype),
        weights=weights,
        variance=None if variance is None else L.unrows(variance),
        trace=L.unrows(trace[..., None]).squeeze(-1),
        lse=L.unrows(lse[..., None]).squeeze(-1),
        n_eff=L.unrows(n_eff[..., None]).squeeze(-1),
        max_term=None if max_term is None else L.unrows(max_term[..., None]).squeeze(-1),
        covariance=None if covariance is None else L.unrows(covariance),
        tail_moment=None if tail is None else L.unrows(tail[..., None]).squeeze(-1),
    )
