"""kvcert.fast.hajek_attention / attention vs the float64 reference, slice by slice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.fast as F
import kvcert.reference as R
from support import (COMPUTE, EPS, assert_close, assert_within_scale, expand_kv, field_scale, naive_hajek,
                     output_cast, problems, rounding)

FIELDS = ("output", "variance", "trace", "lse", "n_eff", "weights", "max_term")


def _rows(q, k, bias, positions, qpos):
    """Every (b, h_q, t) row: (key, batch, query head, KV head, row bias with the causal mask)."""
    b, h_q, t, _ = q.shape
    g = h_q // k.shape[1]
    for bi in range(b):
        for hq in range(h_q):
            for j in range(t):
                h = hq // g
                row_bias = np.zeros(k.shape[2]) if bias is None else bias[bi, hq, j].copy()
                if qpos is not None:
                    row_bias = np.where(positions[bi, h] <= qpos[j], row_bias, -np.inf)
                yield (bi, hq, j), bi, hq, h, row_bias


def _ref_rows(q, k, v, pi, bias, positions, qpos):
    """Reference estimates for every (b, h_q, t) row; inputs float64 numpy, q (b, h_q, t, d)."""
    plain = bias is None and qpos is None
    return {key: R.hajek_attention(q[key], k[bi, h], v[bi, h], pi[bi, h], bias=None if plain else rb)
            for key, bi, hq, h, rb in _rows(q, k, bias, positions, qpos)}


def _naive_rows(q, k, v, pi, bias, positions, qpos, dtype):
    """The textbook torch formulas at the fast path's compute dtype, same rows."""
    ct = COMPUTE[dtype]

    def T(x):
        return torch.as_tensor(np.asarray(x), dtype=ct)

    return {key: naive_hajek(T(q[key]), T(k[bi, h]), T(v[bi, h]), T(pi[bi, h]), bias=T(rb))
            for key, bi, hq, h, rb in _rows(q, k, bias, positions, qpos)}


def check_estimate(est, q, k, v, pi, *, dtype, bias=None, positions=None, qpos=None, decode=True):
    """Every field of ``est`` against the reference, with the STYLE.md tolerance."""
    qn = q.double().numpy()
    if decode:
        qn = qn[:, :, None]
    kn, vn, pn = k.double().numpy(), v.double().numpy(), pi.double().numpy()
    bn = None
    if bias is not None:
        bn = np.broadcast_to(bias.double().numpy(), qn.shape[:3] + (kn.shape[2],)).copy() if not decode else \
            np.broadcast_to(bias.double().numpy()[:, :, None], qn.shape[:3] + (kn.shape[2],)).copy()
    pos = None if positions is None else positions.numpy()
    ref = _ref_rows(qn, kn, vn, pn, bn, pos, qpos)
    naive = _naive_rows(qn, kn, vn, pn, bn, pos, qpos, dtype) if dtype != torch.float64 else None
    b, h_q, t = qn.shape[:3]
    g = h_q // kn.shape[1]
    n = kn.shape[2]
    rnd = rounding(dtype, n)
    for key, r in ref.items():
        bi, hq, j = key
        idx = (bi, hq) if decode else (bi, hq, j)
        if r.lse == -np.inf:  # empty sample: the reference convention
            assert float(est.lse[idx]) == -math.inf and float(est.trace[idx]) == math.inf
            assert torch.all(est.output[idx] == 0)
            if est.variance is not None:
                assert torch.all(est.variance[idx] == math.inf)
            continue
        # condition numbers of the formulas (first-order error propagation, see module doc)
        h = hq // g
        a = r.weights
        s = np.log(np.where(a > 0, a, 1.0)) + r.lse  # the finite logits s_i - log pi_i
        Lw = np.where(a > 0, np.abs(s) + abs(r.lse) + 1.0, 0.0)
        res = np.abs(vn[bi, h] - r.output)
        group = [ref[bi, hh, jj].output for hh in range(h - h % 1, h_q) if hh // g == h for jj in range(t)
                 if ref[bi, hh, jj].lse > -np.inf]
        # distance of the centre mu (the mean output of the group's rows) from o_hat, plus its rounding
        D = np.max(np.abs(np.array(group) - r.output), axis=0) + EPS[COMPUTE[dtype]] * np.abs(r.output)
        c = (1 - pn[bi, h]) * a * a
        sc_o = (a[:, None] * (np.abs(vn[bi, h]) + Lw[:, None] * res)).sum(0)
        # variance: rounding of its own terms, plus the error of o_hat it is centred on (d var / d o)
        # and the rounding of s1 = sum c v - mu sum c (about eps sum c |v|) times |o - mu| <= D
        sc_v = ((c[:, None] * (1 + 2 * Lw[:, None]) * (res + D) ** 2).sum(0) + 2 * (c[:, None] * res).sum(0) * sc_o
                + 2 * D * (c[:, None] * np.abs(vn[bi, h])).sum(0))
        want = {"output": r.output, "variance": r.variance, "trace": r.trace, "lse": r.lse, "n_eff": r.n_eff,
                "weights": a, "max_term": r.max_term}
        # max_term uses ||v_i - o||^2 = ||v_i - mu||^2 - 2 (v_i - mu).(o - mu) + ||o - mu||^2: an absolute
        # error e_i = rnd (||v_i - o|| + 2 ||D||)^2 in dist^2, so min(e_i / dist_i, sqrt(e_i)) in dist_i
        dist = np.linalg.norm(vn[bi, h] - r.output, axis=1)
        e2 = rnd * (dist + 2 * np.linalg.norm(D)) ** 2
        ddist = np.minimum(e2 / np.where(dist > 0, dist, np.inf), np.sqrt(e2))
        # ... plus the error of o_hat itself (rnd * sc_o), which moves every distance
        ddist = ddist / rnd + np.linalg.norm(sc_o)
        mt_tol = np.max(np.maximum(1 - pn[bi, h], pn[bi, h]) * a * ddist) + r.max_term * Lw.max()
        scale = {"output": sc_o, "variance": sc_v, "trace": sc_v.sum(), "lse": Lw.max(), "n_eff": r.n_eff * Lw.max(),
                 "weights": a * Lw, "max_term": mt_tol}
        for f in FIELDS:
            got = getattr(est, f)
            if got is None:
                continue
            got = got[idx].double().numpy()
            tol = rnd * scale[f]
            if f == "output":
                tol = tol + output_cast(dtype) * np.abs(want[f])
            if naive is not None and naive[key] is not None and f in naive[key]:
                tol = tol + 2.0 * np.abs(naive[key][f].double().numpy() - want[f])
            assert_close(f"{f}[{key}] {dtype}", got, want[f], tol)


@given(problems())
def test_decode_matches_reference(problem):
    dtype, q, k, v, pi, bias = problem
    est = F.hajek_attention(q, k, v, pi, bias=bias, return_weights=True, return_max_term=True)
    assert est.output.dtype == dtype and est.output.shape == q.shape[:2] + (v.shape[-1],)
    assert est.trace.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    check_estimate(est, q, k, v, pi, dtype=dtype, bias=bias)


@given(problems(), st.booleans())
def test_trace_only_path_matches_reference(problem, cached):
    dtype, q, k, v, pi, bias = problem
    kw = {}
    if cached:
        mu, r2 = F.value_moments(v, pi)
        kw = dict(value_center=mu, value_sqdist=r2)
    est = F.hajek_attention(q, k, v, pi, bias=bias, per_coordinate=False, **kw)
    assert est.variance is None and est.weights is None and est.max_term is None
    if cached:  # the centre is the mean kept value, not the group's output: widen D by its distance
        est_default = F.hajek_attention(q, k, v, pi, bias=bias, per_coordinate=False)
        ref_scale = (est_default.trace.double().abs() + 1.0)
        spread = (v.double() - v.double().mean(2, keepdim=True)).square().sum(-1).amax(-1)
        bound = rounding(dtype, k.shape[2]) * 8 * (ref_scale + expand_kv(spread, q.shape[1] // k.shape[1]))
        fin = torch.isfinite(est_default.trace)
        assert torch.all((est.trace.double() - est_default.trace.double()).abs()[fin] <= bound[fin])
        return
    check_estimate(est, q, k, v, pi, dtype=dtype, bias=bias)


@given(problems(multi=True), st.integers(0, 200))
def test_several_queries_with_causal_offset(problem, offset):
    dtype, q, k, v, pi, bias = problem
    b, h_kv, n = pi.shape
    t = q.shape[2]
    # kept tokens at increasing original positions with gaps, as after an eviction
    rng = np.random.default_rng(offset)
    positions = torch.from_numpy(np.sort(rng.choice(n + 200 + t, size=(b, h_kv, n)), axis=-1))
    est = F.hajek_attention(q, k, v, pi, bias=bias, positions=positions, offset=offset, return_weights=True)
    assert est.output.shape == q.shape[:3] + (v.shape[-1],)
    check_estimate(est, q, k, v, pi, dtype=dtype, bias=bias, positions=positions,
                   qpos=np.arange(t) + offset, decode=False)
    # query_positions= is the same mask
    est2 = F.hajek_attention(q, k, v, pi, bias=bias, positions=positions,
                             query_positions=torch.arange(t) + offset)
    assert torch.equal(est.output, est2.output) and torch.equal(est.trace, est2.trace)


def _log_pi_tolerance(pi):
    """Allowed |pi path - log pi path| in units of each field's scale (support.field_scale): each path is
    within rounding(float32, n) of the exact estimate; log pi's own rounding (<= eps |log pi_i|, absolute,
    in a logit) moves each a_i by <= 2 eps max|log pi| relative (the normalization adds the same once),
    and c_i = (1 - pi_i) a_i^2 by twice that plus 2 eps (1 - pi = -expm1(log pi): the log's relative error
    propagates as pi |log pi| / (1 - pi) <= 1 times it, expm1 adds one rounding)."""
    lp = torch.log(pi[pi > 0]).abs().max().item()
    return 2 * rounding(torch.float32, pi.shape[-1]) + (4 * lp + 2) * EPS[torch.float32]


def test_log_pi_equals_pi():
    """The two routes agree within their rounding against each field's scale (an output or variance row's
    largest entry, not each entry: a coordinate near 0 carries its row's rounding)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 8)
    pi = torch.rand(2, 2, 50)
    pi[..., :3] = 1.0
    pi[..., -5:] = 0.0
    a = F.hajek_attention(q, k, v, pi)
    b = F.hajek_attention(q, k, v, log_pi=torch.log(pi))
    tol = _log_pi_tolerance(pi)
    for f in ("output", "variance", "trace", "lse", "n_eff"):
        assert_within_scale(f, getattr(b, f), getattr(a, f), tol, f)
    # negative controls: log pi off by 0.1% (1 - pi and the weights move by about as much), and each field
    # moved by 20 units of the tolerance, are caught
    bad = F.hajek_attention(q, k, v, log_pi=torch.log(pi) * (1 + 1e-3))
    for f in ("output", "variance", "trace", "lse", "n_eff"):
        x = getattr(a, f)
        moved = x + 20 * tol * torch.from_numpy(field_scale(f, x)).to(x.dtype)
        for wrong in (getattr(bad, f), moved):
            with pytest.raises(AssertionError):
                assert_within_scale(f, wrong, x, tol, f)


def test_all_certain_is_exact_attention_with_zero_variance():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 6, 32, dtype=torch.float64), torch.randn(3, 2, 77, 32, dtype=torch.float64), \
        torch.randn(3, 2, 77, 5, dtype=torch.float64)
    est = F.hajek_attention(q, k, v, torch.ones(3, 2, 77, dtype=torch.float64), return_max_term=True)
    exact = F.attention(q, k, v)
    assert torch.allclose(est.output, exact, rtol=0, atol=1e-13)
    assert torch.all(est.variance == 0) and torch.all(est.trace == 0) and torch.all(est.max_term == 0)
    for bi in range(3):
        for h in range(6):
            want = R.attention(q[bi, h].numpy(), k[bi, h // 3].numpy(), v[bi, h // 3].numpy())
            assert np.allclose(exact[bi, h].numpy(), want, rtol=0, atol=1e-13)


def test_gqa_equals_repeated_heads():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 8, 3, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 4) + 7.0
    pi = torch.rand(2, 2, 40).clamp(min=0.1)
    gqa = F.hajek_attention(q, k, v, pi, offset=37, return_weights=True)
    rep = F.hajek_attention(q, expand_kv(k, 4), expand_kv(v, 4), expand_kv(pi, 4), offset=37, return_weights=True)
    r = rounding(torch.float32, 40)
    # the same sums, batched otherwise: each within one rounding of the exact value, against its scale
    for f in ("output", "lse"):
        assert_within_scale(f, getattr(gqa, f), getattr(rep, f), 2 * r, f)
    # the variance differs by the centring mu (the group's mean output vs the row's own 3 queries): each
    # one-pass form sum c (v - mu)^2 - 2 (o - mu) s1 + (o - mu)^2 sum c rounds at the scale it cancels,
    # sum_i c_i (|v_i - mu| + |o - mu|)^2 + 2 |o - mu| sum_i c_i |v_i| per coordinate
    scale = _centred_scale(gqa, v, pi, 4) + _centred_scale(rep, expand_kv(v, 4), expand_kv(pi, 4), 1)
    assert_close("variance", gqa.variance, rep.variance, r * scale)
    with pytest.raises(AssertionError):  # negative control: 20 units of that tolerance
        assert_close("variance", gqa.variance + 20 * r * scale.float(), rep.variance, r * scale)


def _centred_scale(est, v, pi, g):
    """Per (b, h_q, t, coordinate): the magnitude the fast path's one-pass variance cancels, about the
    centre mu of each KV head's group (the mean output of its g query heads' rows), float64."""
    o = est.output.double()  # (b, h_q, t, dv)
    b, h_q, t, dv = o.shape
    mu = o.reshape(b, h_q // g, g * t, dv).mean(2, keepdim=True).repeat_interleave(g, 1)  # (b, h_q, 1, dv)
    V = expand_kv(v, g).double()[:, :, None]  # (b, h_q, 1, n, dv)
    c = ((1 - expand_kv(pi, g).double())[:, :, None] * est.weights.double() ** 2)[..., None]  # (b, h_q, t, n, 1)
    dm = (o - mu).abs()
    return (c * ((V - mu[..., None, :]).abs() + dm[..., None, :]) ** 2).sum(-2) + 2 * dm * (c * V.abs()).sum(-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padding_slots_change_nothing(dtype):
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 8, dtype=dtype), torch.randn(2, 2, 30, 8, dtype=dtype), torch.randn(2, 2, 30, 3,
                                                                                                    dtype=dtype)
    pi = torch.rand(2, 2, 30, dtype=dtype).clamp(min=0.05)
    base = F.hajek_attention(q, k, v, pi, return_max_term=True)
    # interleave 17 padding slots holding large finite garbage
    perm = torch.randperm(47)
    real = perm[:30].sort().values
    K = torch.full((2, 2, 47, 8), 1e4, dtype=dtype)
    V = torch.full((2, 2, 47, 3), -1e4, dtype=dtype)
    P = torch.zeros(2, 2, 47, dtype=dtype)
    K[:, :, real], V[:, :, real], P[:, :, real] = k, v, pi
    padded = F.hajek_attention(q, K, V, P, return_max_term=True)
    tol = 4 * rounding(dtype, 47)
    for f in ("output", "variance", "trace", "lse", "n_eff", "max_term"):
        x, y = getattr(base, f), getattr(padded, f)
        assert torch.allclose(x, y, rtol=tol, atol=tol * float(x.abs().max())), f


def test_empty_sample_and_fully_masked_rows():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 3)
    est = F.hajek_attention(q, k, v, torch.zeros(1, 1, 5), return_max_term=True, return_covariance=True,
                             return_tail_moment=True)
    assert torch.all(est.output == 0) and torch.all(est.lse == -math.inf)
    assert torch.all(est.trace == math.inf) and torch.all(est.variance == math.inf)
    assert torch.all(est.n_eff == 0) and torch.all(est.max_term == math.inf)
    for kind in F.KINDS:
        cert = F.certificate(est, kind=kind)
        assert torch.all(cert.radius == math.inf) and not torch.isnan(cert.relative_radius).any()
    # one query fully masked by the bias, the other not
    bias = torch.tensor([[[-math.inf] * 5, [0.0] * 5]])
    est = F.hajek_attention(q, k, v, torch.full((1, 1, 5), 0.5), bias=bias)
    assert est.trace[0, 0] == math.inf and torch.isfinite(est.trace[0, 1])
    # the one-pass trace path (cached value moments, the decode path): a KV head all padding gives the
    # empty-sample convention too, beside a live head, as the tiled path does
    q2, k2, v2 = torch.randn(1, 4, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 3)
    p2 = torch.full((1, 2, 5), 0.5)
    p2[0, 1] = 0.0
    mu, r2 = F.value_moments(v2, p2)
    one = F.hajek_attention(q2, k2, v2, p2, per_coordinate=False, value_center=mu, value_sqdist=r2)
    tiled = F.hajek_attention(q2, k2, v2, p2, per_coordinate=False)
    assert torch.all(one.output[0, 2:] == 0) and torch.all(one.trace[0, 2:] == math.inf)
    assert torch.all(one.lse[0, 2:] == -math.inf)
    # the same output; the trace in another centring (the mean kept value vs the group's mean output):
    # each one-pass form rounds at the scale it cancels (test_gqa_equals_repeated_heads), n = 5
    r = rounding(torch.float32, 5)
    assert_within_scale("output", one.output, tiled.output, 2 * r, "output")
    w = F.hajek_attention(q2, k2, v2, p2, return_weights=True)
    c = (0.5 * w.weights[0, :2].double() ** 2)[:, :, None]  # (1 - pi) a^2 of the live KV head's two query rows
    vv, o = v2[0, 0].double(), tiled.output[0, :2].double()
    scale = sum((c * ((vv - m).norm(dim=-1, keepdim=True) + (o - m).norm(dim=-1, keepdim=True)[:, None]) ** 2)
                .sum((-2, -1)) for m in (mu[0, 0].double(), o.mean(0)))
    assert_close("trace", one.trace[0, :2], tiled.trace[0, :2], r * scale)
    # n = 0 cache
    est = F.hajek_attention(q, k[:, :, :0], v[:, :, :0], torch.zeros(1, 1, 0))
    assert torch.all(est.lse == -math.inf) and est.output.shape == (1, 2, 3)


def test_tiny_pi_does_not_overflow():
    q, k, v = torch.randn(1, 1, 8), torch.randn(1, 1, 20, 8), torch.randn(1, 1, 20, 2)
    pi = torch.full((1, 1, 20), 1e-6)
    pi[..., 0] = 1.0
    est = F.hajek_attention(q, k, v, pi)
    ref = R.hajek_attention(q[0, 0].double().numpy(), k[0, 0].double().numpy(), v[0, 0].double().numpy(),
                            pi[0, 0].double().numpy())
    assert torch.isfinite(est.output).all() and torch.isfinite(est.trace).all()
    assert abs(float(est.lse) - ref.lse) <= rounding(torch.float32, 20) * (abs(ref.lse) + 20)


def test_variance_is_stable_under_a_large_common_offset():
    """Values N(0, 1) + 1e3 at fp32: the centred moment form is as accurate as the textbook formula
    (centred on each row's own o_hat); the uncentred moment form is not."""
    torch.manual_seed(4)
    n, dv = 512, 8
    q, k = torch.randn(2, 8, 32), torch.randn(2, 2, n, 32)
    v = torch.randn(2, 2, n, dv) + 1e3
    pi = torch.rand(2, 2, n).clamp(min=0.05)
    est = F.hajek_attention(q, k, v, pi)
    est_tr = F.hajek_attention(q, k, v, pi, per_coordinate=False)
    ref, naive, unc, scale, prop = (np.zeros((2, 8, dv)) for _ in range(5))
    for bi in range(2):
        for h in range(8):
            args = (q[bi, h], k[bi, h // 4], v[bi, h // 4], pi[bi, h // 4])
            r = R.hajek_attention(*(x.double().numpy() for x in args))
            ref[bi, h] = r.variance
            nv = naive_hajek(*args)
            naive[bi, h] = nv["variance"].double().numpy()
            a, c = nv["weights"], (1 - args[3]) * nv["weights"] ** 2
            vv = args[2]
            # the uncentred moment form sum c v^2 - 2 o sum c v + o^2 sum c (what the centring avoids)
            unc[bi, h] = (c @ (vv * vv) - 2 * nv["output"] * (c @ vv) + nv["output"] ** 2 * c.sum()).double().numpy()
            res = vv.double().numpy() - r.output
            cn = c.double().numpy()[:, None]
            scale[bi, h] = (cn * res**2).sum(0)
            # every fp32 attention output carries an error ~ the textbook one; the variance, centred
            # on it, moves by |d var / d o| = 2 |sum c (v - o)| times that error
            o_err = 2 * np.abs(nv["output"].double().numpy() - r.output) + rounding(torch.float32, n) * np.abs(
                r.output)
            prop[bi, h] = 2 * np.abs((cn * res).sum(0)) * o_err
    tol = 2 * np.abs(naive - ref) + rounding(torch.float32, n) * scale + prop
    assert_close("variance", est.variance.double().numpy(), ref, tol)
    assert_close("trace", est_tr.trace.double().numpy(), ref.sum(-1), tol.sum(-1))
    assert np.any(np.abs(unc - ref) > tol)  # the test has teeth: the uncentred form fails it


@pytest.mark.parametrize("per_coordinate", [True, False])
def test_tiling_gives_the_same_result(per_coordinate):
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 6, 2, 16), torch.randn(2, 3, 301, 16), torch.randn(2, 3, 301, 7) + 3
    pi = torch.rand(2, 3, 301).clamp(min=0.02)
    kw = dict(offset=250, return_max_term=True, return_covariance=per_coordinate, per_coordinate=per_coordinate)
    whole = F.hajek_attention(q, k, v, pi, chunk_bytes=1 << 40, **kw)
    tol = 8 * rounding(torch.float32, 301)
    for cb in (1, 7 * 4 * 50, 7 * 4 * 301 * 2):  # one token, 50 tokens, two heads per tile
        tiled = F.hajek_attention(q, k, v, pi, chunk_bytes=cb, **kw)
        for f in ("output", "variance", "trace", "max_term", "covariance"):
            x, y = getattr(whole, f), getattr(tiled, f)
            if x is None:
                assert y is None
                continue
            assert torch.allclose(x, y, rtol=tol, atol=tol * float(x.abs().max())), (f, cb)


def test_covariance_matches_reference():
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 4, 8, dtype=torch.float64), torch.randn(1, 2, 40, 8, dtype=torch.float64), \
        torch.randn(1, 2, 40, 5, dtype=torch.float64)
    pi = torch.rand(1, 2, 40, dtype=torch.float64).clamp(min=0.1)
    est = F.hajek_attention(q, k, v, pi, return_covariance=True)
    assert est.covariance.shape == (1, 4, 5, 5)
    for h in range(4):
        ref = R.hajek_attention(q[0, h].numpy(), k[0, h // 2].numpy(), v[0, h // 2].numpy(), pi[0, h // 2].numpy())
        assert np.allclose(est.covariance[0, h].numpy(), ref.covariance, rtol=1e-10, atol=1e-14)
        assert np.allclose(np.diagonal(est.covariance[0, h].numpy()), est.variance[0, h].numpy(), rtol=1e-10)


def test_exact_attention_masks_and_errors():
    torch.manual_seed(7)
    q, k, v = torch.randn(1, 2, 3, 4, dtype=torch.float64), torch.randn(1, 1, 6, 4, dtype=torch.float64), \
        torch.randn(1, 1, 6, 2, dtype=torch.float64)
    out = F.attention(q, k, v, offset=3)  # query j sees tokens 0 .. 3 + j
    for h in range(2):
        for j in range(3):
            want = R.attention(q[0, h, j].numpy(), k[0, 0, : 4 + j].numpy(), v[0, 0, : 4 + j].numpy())
            assert np.allclose(out[0, h, j].numpy(), want, rtol=0, atol=1e-14)
    with pytest.raises(ValueError, match="empty"):
        F.attention(q, k, v, bias=torch.full((1, 2, 3, 6), -math.inf))


def _inputs():
    return torch.randn(1, 4, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 3), torch.rand(1, 2, 10)


@pytest.mark.parametrize("change, exc, words", [
    (lambda q, k, v, p: (q[0], k, v, p), ValueError, "q must be 3-d or 4-d"),
    (lambda q, k, v, p: (q, k[..., :5], v, p), ValueError, "keys must have shape"),
    (lambda q, k, v, p: (q, k, v[:, :, :9], p), ValueError, "values must have shape"),
    (lambda q, k, v, p: (q[:, :3], k, v, p), ValueError, "multiple of h_kv"),
    (lambda q, k, v, p: (q, k, v, p[..., :9]), ValueError, "pi must have shape (b, h_kv, n)"),
    (lambda q, k, v, p: (q, k, v, p + 1.0), ValueError, "pi must lie in [0, 1]"),
    (lambda q, k, v, p: (q, k, v, p * float("nan")), ValueError, "pi must lie in [0, 1]"),
    (lambda q, k, v, p: (q.numpy(), k, v, p), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v, p: (q.long(), k, v, p), TypeError, "floating-point"),
    (lambda q, k, v, p: (q, k, v * float("nan"), p), ValueError, "must be finite"),
])
def test_hajek_attention_errors(change, exc, words):
    q, k, v, p = change(*_inputs())
    with pytest.raises(exc) as e:
        F.hajek_attention(q, k, v, p)
    assert words in str(e.value)


def test_hajek_attention_keyword_errors():
    q, k, v, p = _inputs()
    with pytest.raises(TypeError, match="exactly one of pi and log_pi"):
        F.hajek_attention(q, k, v, p, log_pi=torch.log(p))
    with pytest.raises(ValueError, match="log_pi must lie in"):
        F.hajek_attention(q, k, v, log_pi=torch.ones_like(p))
    with pytest.raises(ValueError, match="bias must not contain NaN or \\+inf"):
        F.hajek_attention(q, k, v, p, bias=torch.full((1, 4, 10), math.inf))
    with pytest.raises(ValueError, match="bias must broadcast"):
        F.hajek_attention(q, k, v, p, bias=torch.zeros(3, 10))
    with pytest.raises(TypeError, match="needs query_positions"):
        F.hajek_attention(q, k, v, p, positions=torch.zeros(1, 2, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="query_positions must have shape"):
        F.hajek_attention(q, k, v, p, query_positions=torch.arange(3))
    with pytest.raises(ValueError, match="scale must be a finite positive"):
        F.hajek_attention(q, k, v, p, scale=-1.0)
    with pytest.raises(TypeError, match="value_sqdist= needs the value_center="):
        F.hajek_attention(q, k, v, p, per_coordinate=False, value_sqdist=torch.zeros(1, 2, 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu(dtype):
    torch.manual_seed(8)
    q, k, v = torch.randn(2, 8, 64), torch.randn(2, 2, 1000, 64), torch.randn(2, 2, 1000, 64) + 2.0
    pi = torch.rand(2, 2, 1000).clamp(min=0.02)
    pi[..., -7:] = 0.0
    cpu = F.hajek_attention(q.to(dtype), k.to(dtype), v.to(dtype), pi, return_max_term=True)
    gpu = F.hajek_attention(q.to(dtype).cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), pi.cuda(),
                            return_max_term=True)
    tol = 8 * rounding(dtype, 1000) + output_cast(dtype)
    for f in ("output", "variance", "trace", "lse", "n_eff", "max_term"):
        x, y = getattr(cpu, f).float(), getattr(gpu, f).float().cpu()
        assert torch.allclose(x, y, rtol=tol, atol=tol * float(x.abs().max())), f
    # the default random stream is device-agnostic: same kept set on both devices
    imp = torch.rand(2, 2, 1000)
    on_gpu = F.evict(k.cuda(), v.cuda(), imp.cuda(), 300.0, seed=1, layer=3)
    on_cpu = F.evict(k, v, imp, 300.0, seed=1, layer=3)
    assert torch.equal(on_gpu.positions.cpu(), on_cpu.positions)
    assert torch.allclose(on_gpu.pi.cpu(), on_cpu.pi, rtol=1e-6, atol=0)


def test_query_blocks_give_the_same_result():
    torch.manual_seed(9)
    q, k, v = torch.randn(2, 4, 37, 16), torch.randn(2, 2, 90, 16), torch.randn(2, 2, 90, 5)
    pi = torch.rand(2, 2, 90).clamp(min=0.05)
    bias = torch.where(torch.rand(2, 4, 37, 90) < 0.1, -math.inf, 0.0)
    kw = dict(bias=bias, offset=53, return_weights=True, return_max_term=True)
    whole = F.hajek_attention(q, k, v, pi, **kw)
    blocks = F.hajek_attention(q, k, v, pi, query_chunk_bytes=2 * 4 * 90 * 4 * 3 * 5, **kw)  # 5 queries a block
    tol = 8 * rounding(torch.float32, 90)
    for f in ("output", "variance", "trace", "lse", "n_eff", "weights", "max_term"):
        x, y = getattr(whole, f), getattr(blocks, f)
        assert x.shape == y.shape
        fin = torch.isfinite(x)
        assert torch.equal(fin, torch.isfinite(y)), f
        assert torch.allclose(x[fin], y[fin], rtol=tol, atol=tol * float(x[fin].abs().max())), f
