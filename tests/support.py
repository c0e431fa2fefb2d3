"""Shared support for the tests (a plain module, not collected: no ``test_`` prefix).

One place for what the three backends' tests share:

1. **The dtype / tolerance table** (STYLE.md, flash-attention's criterion). A result computed from
   inputs of dtype D is compared with the float64 reference on the *same* (D-rounded) inputs and
   must satisfy

       |result - ref64| <= 2 * |naive_D - ref64| + rounding * scale

   where ``naive_D`` is the textbook formula evaluated by plain torch at the precision the
   implementation computes in (:data:`COMPUTE`; the output of the kernel at D itself), ``scale`` is
   the magnitude the formula cancels (derived per quantity by each test) and ``rounding`` comes
   from :func:`rounding`: a few units of the compute dtype's epsilon times the growth of a length-n
   reduction, plus the final store (:func:`output_cast`, :func:`store_eps`).
   :func:`assert_close` checks it and, on failure, prints max/mean diff and the worst coordinate.
2. **Oracles**: the float64 reference per (batch, query head) slice (:func:`reference_heads`) and
   the naive torch mirrors of it (:func:`naive_hajek`, :func:`naive_hajek_heads`,
   :func:`naive_tail`, :func:`naive_tail_heads`); :func:`expand_kv` for grouped-query attention.
3. **Input generators** with one vocabulary (STYLE.md rule 4): lengths from :data:`TILE_N` mixed
   with random sizes; scores in typical, one-dominant, masked (-inf bias) and value-offset regimes;
   inclusion probabilities with interior values, exact 1.0, tiny 1e-6 and padding 0
   (:func:`sample_pi`, :func:`pi_vectors`). Shaped for each backend: :func:`attention_case` (one
   float64 slice, the reference), :func:`problems` (batched torch at a drawn dtype, kvcert.fast),
   :func:`make_case` / :func:`decode_case` (batched, seeded, the kernels and dispatch),
   :func:`float64_batches` (certificates) and :func:`qk_windows` (scorers' query windows).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from kvcert import reference as R

# ----------------------------------------------------------------------------- the dtype / tolerance table

EPS = {
    torch.float64: float(torch.finfo(torch.float64).eps),
    torch.float32: float(torch.finfo(torch.float32).eps),
    torch.bfloat16: float(torch.finfo(torch.bfloat16).eps),
    torch.float16: float(torch.finfo(torch.float16).eps),
}
#: dtype the fast path and the kernels compute in for each input dtype (half inputs accumulate in fp32)
COMPUTE = {torch.float64: torch.float64, torch.float32: torch.float32,
           torch.bfloat16: torch.float32, torch.float16: torch.float32}
#: input dtypes of kvcert.fast (all four) and of the Triton kernels (no float64)
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: sequence lengths that break tiling (flash-attention's list, trimmed for 2 CPU cores: tile edges of
#: 16, 32, 64 and 128 and a few odd sizes)
TILE_N = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 113, 127, 128, 129, 239]


def rounding(dtype: torch.dtype, n: int, block_n: int | None = None) -> float:
    """Relative rounding allowance of a length-n reduction at the compute dtype of ``dtype`` inputs.

    ``block_n=None`` (one torch reduction, the fast path): ``8 eps sqrt(n + 1)``, the statistical
    growth of a long sum with a safety factor. ``block_n`` given (a tiled Triton kernel): Higham's
    first-order deterministic bound, ``eps (log2 block_n + n_tiles + 3)``: log2(block_n) for the
    in-tile pairwise reductions, one rounding per tile merge, three for the finalization (division,
    log / square). For every (n, block_n) the kernel tests use, the tiled bound is the tighter one
    (test_support.py checks it), so neither replaces the other.
    """
    eps = EPS[COMPUTE[dtype]]
    if block_n is None:
        return 8.0 * eps * math.sqrt(n + 1.0)
    return eps * (math.log2(block_n) + max(1, math.ceil(n / block_n)) + 3)


def output_cast(dtype: torch.dtype) -> float:
    """Relative error of casting the fp32 result to the input dtype (half an ulp, twice)."""
    return EPS[dtype] if dtype in (torch.bfloat16, torch.float16) else 0.0


def store_eps(field: str, dtype: torch.dtype) -> float:
    """One unit of the dtype a kernel field is stored in: the output in the input dtype, the
    statistics (lse, variance, trace, n_eff, tail_moment) in the compute dtype."""
    return EPS[dtype if field == "output" else COMPUTE[dtype]]


def report(name: str, got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> str:
    """Failure message: max/mean diff and the worst coordinate."""
    diff = np.abs(got - want)
    excess = np.where(np.isfinite(diff), diff - tol, np.inf)
    i = np.unravel_index(int(np.argmax(excess)), diff.shape) if diff.ndim else ()
    return (f"{name}: max diff {np.nanmax(diff):.3g}, mean diff {np.nanmean(diff):.3g}, worst at {i}: "
            f"got {got[i]!r} want {want[i]!r} tol {np.broadcast_to(tol, diff.shape)[i]:.3g}")


def _f64(x) -> np.ndarray:
    """float64 numpy of an array, scalar or torch tensor (any dtype, any device)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_close(name: str, got, want, tol) -> None:
    """|got - want| <= tol elementwise (equal infinities pass); the message is :func:`report`'s."""
    got = _f64(got)
    want = _f64(want)
    tol = np.broadcast_to(_f64(tol), want.shape)
    same_inf = (got == want) & ~np.isfinite(want)
    with np.errstate(invalid="ignore"):  # inf - inf where both are inf: handled by same_inf
        ok = same_inf | (np.abs(got - want) <= tol)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert bool(ok.all()), report(name, got, want, tol)


#: fields holding one vector per (batch, head[, query]) row: the last axis is the row (covariance: the
#: last two axes)
ROW_FIELDS = ("output", "variance", "weights", "covariance")


def field_scale(field: str, want) -> np.ndarray:
    """The magnitude a field's rounding is measured against, broadcast to ``want``'s shape.

    A row of a vector field (:data:`ROW_FIELDS`) against its largest entry: a coordinate near 0 is a sum
    whose terms are the row's size, so it carries the row's rounding, not its own (an output coordinate
    of 8.5e-5 in a row of 0.32 moves by ~eps * 0.32, far beyond eps * 8.5e-5). ``lse`` against
    max(|lse|, 1) (log's rounding is absolute below 1). The per-head sums of non-negative terms (trace,
    n_eff, max_term, tail_moment) against themselves. A non-finite entry (an empty head's -inf lse,
    +inf trace) gets scale 0: it must be matched exactly (:func:`assert_close` passes equal infinities).
    """
    w = np.abs(_f64(want))
    w = np.where(np.isfinite(w), w, 0.0)
    if field in ROW_FIELDS and w.ndim:
        axes = (-2, -1) if field == "covariance" and w.ndim >= 2 else (-1,)
        s = np.broadcast_to(w.max(axis=axes, keepdims=True), w.shape) if w.size else w
    elif field == "lse":
        s = np.maximum(w, 1.0)
    else:
        s = w
    return np.where(np.isfinite(_f64(want)), s, 0.0)


def assert_within_scale(name: str, got, want, rel: float, field: str) -> None:
    """|got - want| <= rel * :func:`field_scale` (field, want): two results of one quantity (two paths,
    two devices, a result and its oracle) that agree to ``rel`` units of the field's own scale, never
    elementwise relative to entries near 0."""
    assert_close(name, got, want, rel * field_scale(field, want))


def variant_tolerance(field: str, dtype: torch.dtype, n: int, block_n: int) -> float:
    """Allowed difference of two compiled variants of one kernel (constexpr flags that add or drop
    fields), in units of the field's scale: each within the tiled rounding of the exact value, and a
    half output one rounding of its own on top (fp32 results a few ulps apart may round to neighbouring
    half values)."""
    return 2 * rounding(dtype, n, block_n) + (output_cast(dtype) if field == "output" else 0.0)


def assert_same_variant(field: str, x, y, dtype: torch.dtype, n: int, block_n: int, *, exact: bool) -> None:
    """Two constexpr variants of one kernel give the same field: bit for bit where ``exact`` (Triton's
    interpreter runs one program for both); compiled, each variant is a kernel of its own whose float32
    sums the compiler may schedule otherwise: within :func:`variant_tolerance` of the field's scale
    (:func:`field_scale`, never elementwise relative to entries near 0)."""
    if exact:
        assert torch.equal(x, y), field
        return
    assert_within_scale(field, x, y, variant_tolerance(field, dtype, n, block_n), field)


# ----------------------------------------------------------------------------- oracles


def expand_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """(b, h_kv, ...) -> (b, h_q, ...) by repeating each KV head g times (test-only)."""
    return x.repeat_interleave(g, dim=1)


def reference_heads(q, k, v, pi, scale=None):
    """The float64 reference per (b, h_q) slice of batched inputs (GQA: query head h reads KV head
    h // g): ``{(b, h): (Estimate, values (n, dv), pi (n,))}``, numpy float64."""
    q64, k64, v64, p64 = (x.detach().cpu().double().numpy() for x in (q, k, v, pi))
    b, h_q, _ = q64.shape
    g = h_q // k64.shape[1]
    out = {}
    for bi in range(b):
        for h in range(h_q):
            kv = h // g
            e = R.hajek_attention(q64[bi, h], k64[bi, kv], v64[bi, kv], p64[bi, kv], scale=scale)
            out[bi, h] = (e, v64[bi, kv], p64[bi, kv])
    return out


def naive_hajek(q, k, v, pi, *, scale=None, bias=None):
    """Textbook Hajek estimate for one query head in plain torch at q's dtype (the fast path's order:
    logsumexp, then a = exp(logit - lse)).

    q (d,), k (n, d), v (n, dv), pi (n,), bias (n,) or None. Direct formulas:
    (v - o)^2 per coordinate, no moment tricks. None for an empty sample.
    """
    d = q.shape[-1]
    tau = 1.0 / math.sqrt(d) if scale is None else scale
    s = tau * (k @ q)
    if bias is not None:
        s = s + bias
    present = pi > 0
    logits = torch.where(present, s - torch.log(torch.where(present, pi, torch.ones_like(pi))),
                         torch.full_like(s, -math.inf))
    if logits.numel() == 0 or bool((logits == -math.inf).all()):
        return None
    lse = torch.logsumexp(logits, 0)
    a = torch.exp(logits - lse)
    o = a @ v
    c = (1 - pi) * a * a
    r = v - o
    var = (c[:, None] * r * r).sum(0)
    return {"output": o, "variance": var, "trace": var.sum(), "lse": lse, "n_eff": 1.0 / (a * a).sum(),
            "weights": a}


def naive_tail(q, k, v, pi, bias, dtype):
    """The textbook s2 = sum_i (1 - pi_i) x_i^2, x_i = (1 - pi_i) a_i^2 ||v_i - o||^2, of one row in
    plain torch at the compute dtype of ``dtype`` (numpy inputs; None for an empty row)."""
    ct = COMPUTE[dtype]
    T = lambda x: torch.as_tensor(np.asarray(x), dtype=ct)  # noqa: E731
    nv = naive_hajek(T(q), T(k), T(v), T(pi), bias=None if bias is None else T(bias))
    if nv is None:
        return None
    p = T(pi)
    x = (1 - p) * nv["weights"] ** 2 * ((T(v) - nv["output"]) ** 2).sum(-1)
    return float(((1 - p) * x * x).sum())


def naive_hajek_heads(q, k, v, pi, dtype, scale=None):
    """The reference's formulas evaluated naively in ``dtype`` arithmetic over batched GQA inputs
    (torch, CPU; the kernel's order: max shift, exp, sum, divide). q (b, h_q, d), k (b, h_kv, n, d).

    The inputs are first rounded to the kernel's input dtype (``q.dtype``); ``dtype`` is the
    arithmetic: the input dtype for ``output``, float32 for the float32 fields (the precision
    the kernel computes them at). Returns a dict of (b, h_q[, dv]) float64 numpy arrays."""
    q, k, v, p = (x.detach().cpu().to(dtype) for x in (q, k, v, pi))
    g = q.shape[1] // k.shape[1]
    k, v, p = (expand_kv(x, g) for x in (k, v, p))
    tau = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (k @ q.unsqueeze(-1)).squeeze(-1) * tau
    ninf = torch.tensor(float("-inf"), dtype=dtype)
    logits = torch.where(p > 0, s - torch.log(torch.where(p > 0, p, torch.ones_like(p))), ninf)
    m = logits.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(logits - m)
    lsum = e.sum(-1, keepdim=True)
    a = e / lsum
    o = (a.unsqueeze(-2) @ v).squeeze(-2)
    c = (1 - p) * a * a
    var = (c.unsqueeze(-1) * (v - o.unsqueeze(-2)) ** 2).sum(-2)
    out = {"output": o, "lse": (m + torch.log(lsum)).squeeze(-1), "variance": var,
           "trace": var.sum(-1), "n_eff": 1.0 / (a * a).sum(-1)}
    return {f: x.double().numpy() for f, x in out.items()}


def naive_tail_heads(q, k, v, pi):
    """The reference's s2 in plain float32 torch over batched GQA inputs (already rounded):
    (b, h_q) s2 and lse, float64 numpy."""
    q, k, v, p = (x.detach().cpu().float() for x in (q, k, v, pi))
    g = q.shape[1] // k.shape[1]
    k, v, p = (expand_kv(x, g) for x in (k, v, p))
    s = (k @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(q.shape[-1])
    logits = torch.where(p > 0, s - torch.log(torch.where(p > 0, p, torch.ones_like(p))), -math.inf)
    lse = torch.logsumexp(logits, -1)
    a = torch.exp(logits - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = (a.unsqueeze(-2) @ v).squeeze(-2)
    x = (1 - p) * a * a * ((v - o.unsqueeze(-2)) ** 2).sum(-1)
    return ((1 - p) * x * x).sum(-1).double().numpy(), lse.double().numpy()


# ----------------------------------------------------------------------------- input generators

#: inclusion probability of a "tiny" token: a +13.8 logit bias, so it dominates its row
TINY_PI = 1e-6


def sample_pi(rng: np.random.Generator, shape, kind: str = "mixed") -> np.ndarray:
    """Inclusion probabilities in (0, 1] from a seeded generator.

    ``"mixed"``: interior U(0.05, 1) with exact 1.0 (20 %) and tiny 1e-6 (10 %); ``"interior"``: the
    same without the tiny ones (they carry a +13.8 logit bias and dominate, so this keeps the other
    pi visible); ``"ones"``: all 1; a number (as a str or float): that constant.
    """
    if kind in ("mixed", "interior"):
        pi = rng.uniform(0.05, 1.0, size=shape)
        u = rng.random(size=pi.shape)
        pi[u < 0.2] = 1.0
        if kind == "mixed":
            pi[(u >= 0.2) & (u < 0.3)] = TINY_PI
        return pi
    if kind == "ones":
        return np.ones(shape)
    return np.full(shape, float(kind))


def mask_bias(rng: np.random.Generator, shape, frac: float = 0.3, keep_one: bool = False) -> np.ndarray:
    """Additive bias: -inf (masked) with probability ``frac``, else 0; ``keep_one`` unmasks one
    random token of a 1-d bias so the row is never empty."""
    bias = np.where(rng.random(shape) < frac, -np.inf, 0.0)
    if keep_one:
        bias[rng.integers(bias.shape[-1])] = 0.0
    return bias


def lengths(max_n: int = 113, tile_max: int | None = None):
    """Sequence lengths: :data:`TILE_N` up to ``tile_max`` (default ``max_n``) mixed with random
    sizes in [1, max_n]."""
    top = max_n if tile_max is None else tile_max
    return st.one_of(st.sampled_from([n for n in TILE_N if n <= top]), st.integers(1, max_n))


@st.composite
def probabilities(draw, n: int):
    """pi in (0, 1] of length n: :func:`sample_pi` ``"mixed"`` (interior, exact 1.0, tiny 1e-6)."""
    return sample_pi(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), n, "mixed")


@st.composite
def pi_vectors(draw, n: int, *, padding: bool = True):
    """Inclusion probabilities, one kind per token drawn by Hypothesis (so it shrinks them):
    interior U(0.02, 0.98), exact 1.0, tiny 1e-6 and (optionally) padding 0."""
    kinds = draw(st.lists(st.sampled_from(["interior", "one", "tiny", "pad"] if padding
                                          else ["interior", "one", "tiny"]), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.02, 0.98, size=n)
    p = np.where(np.array(kinds) == "one", 1.0, p)
    p = np.where(np.array(kinds) == "tiny", TINY_PI, p)
    p = np.where(np.array(kinds) == "pad", 0.0, p)
    return p


@st.composite
def attention_case(draw, max_n: int = 113, d_choices=(4, 8, 16), dv_choices=(1, 3, 8)):
    """One slice for the reference: (q, keys, values, bias) float64 numpy, bias None or containing
    -inf (never all). Regimes typical / one-dominant / masked 60/20/20."""
    n = draw(lengths(max_n))
    d = draw(st.sampled_from(d_choices))
    dv = draw(st.sampled_from(dv_choices))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.normal(size=d)
    k = rng.normal(size=(n, d))
    v = rng.normal(size=(n, dv))
    regime = draw(st.sampled_from(["typical"] * 3 + ["dominant", "masked"]))  # 60/20/20
    bias = None
    if regime == "dominant":
        j = draw(st.integers(0, n - 1))
        k[j] = q * draw(st.floats(2.0, 8.0))
    elif regime == "masked" and n > 1:
        bias = mask_bias(rng, n, keep_one=True)  # at least one visible token
    return q, k, v, bias


@st.composite
def problems(draw, *, multi: bool = False):
    """Batched inputs for kvcert.fast: (dtype, q, k, v, pi, bias) torch, q (b, h_q[, t], d) at a
    drawn dtype, pi (b, h_kv, n) from :func:`pi_vectors` (with padding 0). Regimes typical /
    one-dominant / masked 70/20/10; values offset by 0, 3 or -50."""
    dtype = draw(st.sampled_from(DTYPES))
    b, h_kv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 3]))
    n = draw(lengths(160, tile_max=TILE_N[-1]))
    d = draw(st.sampled_from([4, 16, 64]))
    dv = draw(st.sampled_from([1, 3, 16]))
    t = draw(st.integers(1, 3)) if multi else 1
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    offset = draw(st.sampled_from([0.0, 0.0, 3.0, -50.0]))
    q = rng.normal(size=(b, g * h_kv, t, d))
    k = rng.normal(size=(b, h_kv, n, d))
    v = rng.normal(size=(b, h_kv, n, dv)) + offset
    regime = draw(st.sampled_from(["typical"] * 7 + ["dominant"] * 2 + ["masked"]))
    bias = None
    if regime == "dominant":
        j = int(rng.integers(0, n))
        k[:, :, j] = 3.0 * math.sqrt(d) * q[:, ::g, 0] / np.linalg.norm(q[:, ::g, 0], axis=-1, keepdims=True)
    elif regime == "masked":
        bias = mask_bias(rng, (b, g * h_kv, t, n))
    pi = np.stack([np.stack([draw(pi_vectors(n)) for _ in range(h_kv)]) for _ in range(b)])
    cast = lambda x: torch.from_numpy(x).to(dtype)  # noqa: E731
    qq = cast(q) if multi else cast(q[:, :, 0])
    bb = None if bias is None else (torch.from_numpy(bias) if multi else torch.from_numpy(bias[:, :, 0]))
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    return dtype, qq, cast(k), cast(v), torch.from_numpy(pi).to(pdt), bb


def make_case(seed, b, h_kv, g, n, d, dv, dtype, regime="typical", pad="none", pi_kind="mixed", *, t=None,
              device="cpu"):
    """Seeded batched inputs (q, k, v, pi) for the kernels and dispatch: q (b, h_kv g[, t], d),
    k (b, h_kv, n, d), v (b, h_kv, n, dv) at ``dtype``; pi (b, h_kv, n) float32 from
    :func:`sample_pi` (``pi_kind``).

    ``regime``: ``"typical"``; ``"dominant"`` (one key per KV head aligned with its first query
    head's query); ``"offset"`` (values + 1e4 at float32, + 1e2 at half: the one-pass moments
    cancel). ``pad``: ``"none"``; ``"ragged"`` (each KV head keeps a random prefix, the padding
    slots hold loud garbage so leaks show); ``"empty_head"`` (ragged, and the last KV head of
    batch 0 all padding).
    """
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, h_kv * g, d) if t is None else (b, h_kv * g, t, d))
    k = rng.normal(size=(b, h_kv, n, d))
    v = rng.normal(size=(b, h_kv, n, dv))
    if regime == "dominant" and n > 0:
        for bi in range(b):
            for h in range(h_kv):
                qh = q[bi, h * g] if t is None else q[bi, h * g, 0]
                k[bi, h, rng.integers(n)] = qh * rng.uniform(2.0, 8.0)
    if regime == "offset":
        v = v + (1e4 if dtype == torch.float32 else 1e2)
    pi = sample_pi(rng, (b, h_kv, n), pi_kind)
    if pad in ("ragged", "empty_head") and n > 0:
        kept = rng.integers(0, n + 1, size=(b, h_kv))
        slot = np.arange(n)
        padm = slot[None, None, :] >= kept[..., None]
        pi[padm] = 0.0
        k[padm] = 40.0 * rng.normal(size=k[padm].shape)  # loud garbage: leaks would show
        v[padm] = 40.0 * rng.normal(size=v[padm].shape)
        if pad == "empty_head":
            pi[0, -1] = 0.0
    t_ = lambda x: torch.from_numpy(x).to(dtype).to(device)  # noqa: E731
    return t_(q), t_(k), t_(v), torch.from_numpy(pi).float().to(device)


@st.composite
def decode_case(draw, dtypes=KERNEL_DTYPES):
    """(make_case kwargs, kernel kwargs) for a decode step: lengths around the drawn block_n
    (1, 3, 113, block_n - 1, block_n, block_n + 1) mixed with random ones; regimes typical /
    dominant / offset 60/20/20; ragged and empty-head padding; every pi kind."""
    block_n = draw(st.sampled_from([16, 32, 64]))
    n = draw(st.one_of(st.sampled_from([1, 3, 113, block_n - 1, block_n, block_n + 1]), st.integers(1, 300)))
    d = draw(st.sampled_from([16, 64]))
    dv = draw(st.sampled_from([d, 16, 24]))
    case = dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        b=draw(st.sampled_from([1, 2])),
        h_kv=draw(st.sampled_from([1, 2])),
        g=draw(st.sampled_from([1, 2, 4, 5])),
        n=n, d=d, dv=dv,
        dtype=draw(st.sampled_from(dtypes)),
        regime=draw(st.sampled_from(["typical"] * 3 + ["dominant", "offset"])),  # 60/20/20
        pad=draw(st.sampled_from(["none", "ragged", "ragged", "empty_head"])),
        pi_kind=draw(st.sampled_from(["mixed", "mixed", "interior", "interior", "0.3", "ones"])),
    )
    kw = dict(block_n=block_n, num_splits=draw(st.sampled_from([1, 2, 3, 7])),
              use_log=draw(st.booleans()), moments=draw(st.sampled_from(["auto", "exact", "shifted"])))
    return case, kw


@st.composite
def float64_batches(draw, n: int, dv: int, *, b: int = 2, h_kv: int = 2, g: int = 2, d: int = 8,
                    v_offset: float = 2.0):
    """(q, k, v, pi) float64 torch for the certificates: normal q, k, v + ``v_offset`` (b, h_kv g, d),
    pi from :func:`pi_vectors` per KV head."""
    rng = np.random.default_rng(draw(st.integers(0, 10**6)))
    q = torch.from_numpy(rng.normal(size=(b, g * h_kv, d)))
    k = torch.from_numpy(rng.normal(size=(b, h_kv, n, d)))
    v = torch.from_numpy(rng.normal(size=(b, h_kv, n, dv)) + v_offset)
    pi = torch.from_numpy(np.stack([np.stack([draw(pi_vectors(n)) for _ in range(h_kv)]) for _ in range(b)]))
    return q, k, v, pi


def qk_windows(b, h_kv, g, w, n, d, seed, dtype=torch.float64, spread=1.0):
    """Scorer inputs: query windows (b, g h_kv, w, d) and keys (b, h_kv, n, d); ``spread`` scales the
    queries (peaked scores)."""
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(spread * rng.normal(size=(b, g * h_kv, w, d))).to(dtype)
    k = torch.from_numpy(rng.normal(size=(b, h_kv, n, d))).to(dtype)
    return q, k


# ----------------------------------------------------------------------------- the Triton kernels


def triton_kernels():
    """``(kvcert.kernels, device)`` for a kernel test module, or skip the module: the kernels need
    triton and a CUDA device or Triton's CPU interpreter (TRITON_INTERPRET=1, set before anything
    imports triton; then device is "cpu")."""
    pytest.importorskip("triton", reason="triton is not installed")
    if not (os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available()):
        pytest.skip("the Triton kernels need a CUDA device or TRITON_INTERPRET=1 (set before triton is imported)",
                    allow_module_level=True)
    from kvcert import kernels

    return kernels, ("cpu" if kernels.INTERPRETED else "cuda")


def assert_certificate_matches_reference(cert, q, k, v, pi, *, delta, kind):
    """Every (batch row, query head) of a batched fast certificate equals the float64 reference's
    certificate of the same head (float64 end to end: a rounding tolerance of 1e-9 relative; chi2
    uses the Frobenius moment instead of eigenvalues, the same sums)."""
    from kvcert import reference as R

    b, h_q = q.shape[0], q.shape[1]
    g = h_q // k.shape[1]
    for bi in range(b):
        for hq in range(h_q):
            h = hq // g
            ref = R.hajek_attention(q[bi, hq].numpy(), k[bi, h].numpy(), v[bi, h].numpy(), pi[bi, h].numpy())
            want = R.certificate(ref, delta=delta, kind=kind)
            assert np.ndim(want.radius) == (1 if R.CERTIFICATE_KINDS[kind].per_coordinate else 0)
            tol = 1e-9 * (1.0 + np.abs(np.asarray(want.radius)))
            assert_close(f"{kind} radius", cert.radius[bi, hq].numpy(), want.radius, tol)
            assert_close(f"{kind} rel", cert.relative_radius[bi, hq].numpy(), want.relative_radius,
                         1e-9 * (1.0 + abs(want.relative_radius)))
            assert_close(f"{kind} lower", cert.lower[bi, hq].numpy(), want.lower, tol + 1e-12)
            assert_close(f"{kind} upper", cert.upper[bi, hq].numpy(), want.upper, tol + 1e-12)



# every path of the inclusion-probability solver checks the importance: the early returns (budget == n, every
# token certain) and the refusals (budget > n, budget <= |C|) name it first, as the sampling path does; shared by
# the torch and NumPy tests of the solver
SOLVER_PATHS = [  # (n, budget, sinks, window): the path taken with a valid importance
    (10, 10.0, 2, 2),  # budget == n: everything kept
    (10, 10.0, 6, 6),  # every token in the certainty set, budget == n
    (10, 7.5, 2, 2),  # sampling
    (10, 11.0, 2, 2),  # budget > n: refused
    (10, 4.0, 2, 2),  # budget <= |C|: refused
]


#: SplitMix64 in Python ints: every intermediate masked to 64 bits; GOLDEN the stream's increment
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def splitmix64_py(x: int) -> int:
    """SplitMix64 finalizer on Python ints (independent of the torch int64 code): the tests of the designs'
    counter-based streams (kvcert.fast.design's tokens, the blocks' streams) spell the streams out with it."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def random_cache(b: int, h: int, n: int, d: int = 8, dv: int = 4, seed: int = 0):
    """(keys (b, h, n, d), values (b, h, n, dv), importance (b, h, n) uniform on [0, 1)): float64, from one
    torch generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, n, d, generator=g, dtype=torch.float64),
            torch.randn(b, h, n, dv, generator=g, dtype=torch.float64),
            torch.rand(b, h, n, generator=g, dtype=torch.float64))
