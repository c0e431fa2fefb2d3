"""kvcert.fast: ``return_tail_moment`` and the ``chebyshev_ucb`` certificate against the reference.

Tolerance (STYLE.md, as in test_fast_estimators): |fast - ref64| <= 2 |naive - ref64| + the
first-order rounding of s2 = sum_i w_i r_i^4 (w_i = (1 - pi_i)^3 a_i^4, r_i = ||v_i - o_hat||):

- a_i^4 carries 4 x the weight error ROUNDING * L_i (L_i = |logit_i| + |lse| + 1);
- r_i^2 = ||v_i - mu||^2 - 2 (v_i - mu).(o - mu) + ||o - mu||^2 is off by ROUNDING (r_i + 2 |D|)^2
  (D: distance of the centre mu from o_hat) plus the move of o_hat itself, at most
  dr = ROUNDING |sc_o| (the output's own condition number), i.e. (r_i + dr)^2 - r_i^2;
- terms below float32's smallest normal may flush to 0: n * tiny for a float32 computation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.fast as F
import kvcert.reference as R
from kvcert import dispatch as DSP
from kvcert.fast import certificates as FC
from support import COMPUTE, EPS, assert_close, float64_batches, make_case, naive_tail, problems, rounding


def _rows(est, q, k, v, pi, bias=None, positions=None, qpos=None, centre=None):
    """Yield (index, fast value, reference Estimate, tolerance) for every (b, h_q[, t]) row."""
    decode = q.dim() == 3
    dtype = q.dtype
    qn = q.double().numpy()[:, :, None] if decode else q.double().numpy()
    kn, vn, pn = k.double().numpy(), v.double().numpy(), pi.double().numpy()
    b, h_q, t = qn.shape[:3]
    n = kn.shape[2]
    g = h_q // kn.shape[1]
    bn = None
    if bias is not None:
        bb = bias.double().numpy()
        bn = np.broadcast_to(bb[:, :, None] if decode else bb, (b, h_q, t, n))
    refs, bias_rows = {}, {}
    for bi in range(b):
        for hq in range(h_q):
            for j in range(t):
                rb = np.zeros(n) if bn is None else bn[bi, hq, j].copy()
                if qpos is not None:
                    rb = np.where(positions[bi, hq // g].numpy() <= qpos[j], rb, -np.inf)
                bias_rows[bi, hq, j] = rb
                refs[bi, hq, j] = R.hajek_attention(qn[bi, hq, j], kn[bi, hq // g], vn[bi, hq // g],
                                                    pn[bi, hq // g], bias=rb)
    rnd = rounding(dtype, n)
    eps = EPS[COMPUTE[dtype]]
    tiny = float(torch.finfo(COMPUTE[dtype]).tiny)
    for (bi, hq, j), r in refs.items():
        idx = (bi, hq) if decode else (bi, hq, j)
        got = float(est.tail_moment[idx])
        h = hq // g
        if r.lse == -np.inf:
            yield idx, got, r, 0.0
            continue
        a = r.weights
        logit = np.log(np.where(a > 0, a, 1.0)) + r.lse
        Lw = np.where(a > 0, np.abs(logit) + abs(r.lse) + 1.0, 0.0)
        res = vn[bi, h] - r.output
        dist = np.linalg.norm(res, axis=1)
        sc_o = (a[:, None] * (np.abs(vn[bi, h]) + Lw[:, None] * np.abs(res))).sum(0)
        if centre is None:  # mu = the mean output of the KV head's live query rows
            group = [refs[bi, hh, jj].output for hh in range(h * g, (h + 1) * g) for jj in range(t)
                     if refs[bi, hh, jj].lse > -np.inf]
            D = np.max(np.abs(np.array(group) - r.output), axis=0) + eps * np.abs(r.output)
        else:
            D = np.abs(centre[bi, h] - r.output) + eps * np.abs(r.output)
        dr = rnd * np.linalg.norm(sc_o)
        dr2 = rnd * (dist + 2 * np.linalg.norm(D)) ** 2 + (dist + dr) ** 2 - dist ** 2
        w = (1 - pn[bi, h]) ** 3 * a ** 4
        r2 = dist ** 2
        tol = (np.sum(w * ((r2 + dr2) ** 2 - r2 ** 2)) + 4 * rnd * np.sum(Lw * w * r2 * r2)
               + rnd * r.tail_moment + n * tiny)
        if dtype != torch.float64:
            naive = naive_tail(qn[bi, hq, j], kn[bi, h], vn[bi, h], pn[bi, h], bias_rows[bi, hq, j], dtype)
            tol += 2 * abs(naive - r.tail_moment)
        yield idx, got, r, tol


def check_tail(est, *args, **kw):
    assert est.tail_moment is not None
    want_dtype = torch.float64 if args[0].dtype == torch.float64 else torch.float32
    assert est.tail_moment.dtype == want_dtype and est.tail_moment.shape == est.trace.shape
    assert not torch.isnan(est.tail_moment).any()
    for idx, got, ref, tol in _rows(est, *args, **kw):
        assert_close(f"tail_moment[{idx}]", np.array(got), np.array(ref.tail_moment), tol)


@given(problems(), st.sampled_from([(True, False), (False, False), (False, True), (True, True)]))
def test_decode_matches_reference(problem, flags):
    dtype, q, k, v, pi, bias = problem
    per_coordinate, max_term = flags
    est = F.hajek_attention(q, k, v, pi, bias=bias, per_coordinate=per_coordinate, return_max_term=max_term,
                            return_tail_moment=True)
    check_tail(est, q, k, v, pi, bias=bias)


@given(problems(multi=True), st.integers(0, 200))
def test_several_queries_with_causal_offset(problem, offset):
    dtype, q, k, v, pi, bias = problem
    b, h_kv, n = pi.shape
    t = q.shape[2]
    rng = np.random.default_rng(offset)
    positions = torch.from_numpy(np.sort(rng.choice(n + 200 + t, size=(b, h_kv, n)), axis=-1))
    est = F.hajek_attention(q, k, v, pi, bias=bias, positions=positions, offset=offset, per_coordinate=False,
                            return_tail_moment=True)
    check_tail(est, q, k, v, pi, bias=bias, positions=positions, qpos=np.arange(t) + offset)


@given(problems())
def test_cached_value_moments_path(problem):
    """value_center / value_sqdist (the cheap trace): the centre is the mean kept value."""
    dtype, q, k, v, pi, bias = problem
    mu, r2 = F.value_moments(v, pi)
    est = F.hajek_attention(q, k, v, pi, bias=bias, per_coordinate=False, value_center=mu, value_sqdist=r2,
                            return_tail_moment=True)
    check_tail(est, q, k, v, pi, bias=bias, centre=mu.double().numpy())


def test_not_requested_is_none_and_other_fields_unchanged():
    torch.manual_seed(0)
    q, k, v, pi = torch.randn(2, 4, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 8), torch.rand(2, 2, 70)
    base = F.hajek_attention(q, k, v, pi, return_max_term=True)
    assert base.tail_moment is None
    est = F.hajek_attention(q, k, v, pi, return_max_term=True, return_tail_moment=True)
    for f in ("output", "variance", "trace", "lse", "n_eff", "max_term"):
        assert torch.equal(getattr(base, f), getattr(est, f)), f


def test_chunking_paths_give_the_same_result():
    """V tiles (chunk_bytes) and query blocks (query_chunk_bytes) only regroup the same sums."""
    torch.manual_seed(5)
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 3, 301, 16), torch.randn(2, 3, 301, 7) + 3
    pi = torch.rand(2, 3, 301).clamp(min=0.02)
    pi[1, 2, 250:] = 0.0
    kw = dict(offset=250, return_tail_moment=True)
    whole = F.hajek_attention(q, k, v, pi, chunk_bytes=1 << 40, **kw)
    tol = 8 * rounding(torch.float32, 301)
    for extra in (dict(chunk_bytes=1), dict(chunk_bytes=7 * 4 * 50), dict(chunk_bytes=7 * 4 * 301 * 2),
                  dict(query_chunk_bytes=2 * 6 * 301 * 4 * 3 * 2), dict(per_coordinate=False, chunk_bytes=7 * 4 * 50)):
        part = F.hajek_attention(q, k, v, pi, **kw, **extra)
        x, y = whole.tail_moment, part.tail_moment
        assert torch.allclose(x, y, rtol=tol, atol=0), (extra, float(((x - y).abs() / x).max()))


def test_gqa_padding_empty_and_certain_rows():
    torch.manual_seed(3)
    dt = torch.float64
    q, k, v = torch.randn(2, 4, 8, dtype=dt), torch.randn(2, 2, 30, 8, dtype=dt), torch.randn(2, 2, 30, 3, dtype=dt)
    pi = torch.rand(2, 2, 30, dtype=dt).clamp(min=0.05)
    base = F.hajek_attention(q, k, v, pi, return_tail_moment=True)
    # GQA equals the repeated heads (K, V read once per KV head; only the centre differs)
    rep = F.hajek_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), pi.repeat_interleave(2, 1),
                            return_tail_moment=True)
    assert torch.allclose(base.tail_moment, rep.tail_moment, rtol=1e-12, atol=0)
    # 17 padding slots of large garbage, interleaved
    real = torch.randperm(47, generator=torch.Generator().manual_seed(0))[:30].sort().values
    K, V, P = torch.full((2, 2, 47, 8), 1e4, dtype=dt), torch.full((2, 2, 47, 3), -1e4, dtype=dt), \
        torch.zeros(2, 2, 47, dtype=dt)
    K[:, :, real], V[:, :, real], P[:, :, real] = k, v, pi
    padded = F.hajek_attention(q, K, V, P, return_tail_moment=True)
    assert torch.allclose(base.tail_moment, padded.tail_moment, rtol=1e-12, atol=0)
    # an all-padding KV head: +inf (uncertifiable); all pi = 1: exactly 0
    P[0, 1] = 0.0
    est = F.hajek_attention(q, K, V, P, return_tail_moment=True, per_coordinate=False)
    assert torch.all(est.tail_moment[0, 2:] == math.inf) and torch.isfinite(est.tail_moment[0, :2]).all()
    assert torch.all(F.hajek_attention(q, k, v, torch.ones_like(pi), return_tail_moment=True).tail_moment == 0)
    n0 = F.hajek_attention(q, k[:, :, :0], v[:, :, :0], pi[:, :, :0], return_tail_moment=True)
    assert n0.tail_moment.shape == (2, 4) and torch.all(n0.tail_moment == math.inf)


# ----------------------------------------------------------------------------- the certificate


@given(n=st.integers(1, 60), dv=st.sampled_from([1, 4]), delta=st.sampled_from([0.01, 0.05, 0.3]),
       data=st.data())
def test_certificate_matches_reference(n, dv, delta, data):
    b, h_kv, g = 2, 2, 2
    q, k, v, pi = data.draw(float64_batches(n, dv, b=b, h_kv=h_kv, g=g))
    est = F.hajek_attention(q, k, v, pi, per_coordinate=False, return_tail_moment=True)
    cert = F.certificate(est, delta=delta, kind="chebyshev_ucb")
    assert cert.kind == "chebyshev_ucb" and not torch.isnan(cert.radius).any()
    assert not torch.isnan(cert.relative_radius).any()
    for bi in range(b):
        for hq in range(g * h_kv):
            h = hq // g
            ref = R.hajek_attention(q[bi, hq].numpy(), k[bi, h].numpy(), v[bi, h].numpy(), pi[bi, h].numpy())
            want = R.certificate(ref, delta=delta, kind="chebyshev_ucb")
            # float64 end to end; the radius is smooth in (tr, s2) (d log r / d log s2 <= 1/2)
            tol = 1e-9 * (1.0 + np.abs(want.radius))
            assert_close("radius", cert.radius[bi, hq].numpy(), want.radius, tol)
            assert_close("rel", cert.relative_radius[bi, hq].numpy(), want.relative_radius,
                         1e-9 * (1.0 + abs(want.relative_radius)))
            assert_close("lower", cert.lower[bi, hq].numpy(), want.lower, tol + 1e-12)


def test_batched_radius_matches_the_scalar_formula_on_edge_cases():
    tr = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.5, math.inf, 1.0, 1e-30, 1e30, 3.0]
    s2 = [0.0, 1.0, 0.0, 1e-300, 0.5, 1.0, 3.0, 1.0, math.inf, 1e-61, 1e59, 90.0]  # last: s2 > tr^2 (clip)
    for dtype in (torch.float64, torch.float32):
        t, s = torch.tensor(tr, dtype=dtype), torch.tensor(s2, dtype=dtype)
        for delta in (0.05, 0.5):
            got = F.radius_from_moments("chebyshev_ucb", delta, trace=t, tail_moment=s)
            assert got.dtype == dtype and not torch.isnan(got).any()
            want = np.array([R.radius_from_moments("chebyshev_ucb", delta, trace=float(a), tail_moment=float(c))
                             for a, c in zip(t.double(), s.double())])
            tol = 4 * EPS[dtype] * np.where(np.isfinite(want), want, 0)
            assert_close(f"radius {dtype} {delta}", got.double().numpy(), want, tol)
    # batched shapes and devices: (b, h, t)
    t = torch.rand(2, 3, 4) + 0.1
    r = F.radius_from_moments("chebyshev_ucb", 0.05, trace=t, tail_moment=0.3 * t * t)
    assert r.shape == (2, 3, 4) and torch.all(r > (2 * t / 0.05).sqrt())


def test_missing_or_bad_tail_moment_is_named():
    est = F.hajek_attention(torch.randn(1, 1, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 2),
                            torch.full((1, 1, 6), 0.5))
    with pytest.raises(ValueError) as e:
        F.certificate(est, kind="chebyshev_ucb")
    assert "return_tail_moment=True" in str(e.value)
    tr = torch.ones(3)
    with pytest.raises(ValueError, match="tail_moment must have the shape of trace"):
        F.radius_from_moments("chebyshev_ucb", 0.05, trace=tr, tail_moment=torch.ones(2))
    with pytest.raises(ValueError, match="tail_moment must be >= 0"):
        F.radius_from_moments("chebyshev_ucb", 0.05, trace=tr, tail_moment=-tr)
    with pytest.raises(ValueError, match="NaN"):
        F.radius_from_moments("chebyshev_ucb", 0.05, trace=tr * math.nan, tail_moment=tr)
    with pytest.raises(TypeError, match="tail_moment must be a torch.Tensor"):
        F.radius_from_moments("chebyshev_ucb", 0.05, trace=tr, tail_moment=1.0)
    with pytest.raises(ValueError, match="chebyshev_ucb"):  # the message lists every accepted kind
        F.certificate(est, kind="hoeffding")
    assert FC.KINDS == R.KINDS and F.KINDS == R.KINDS


def test_empty_and_certain_estimates():
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 3)
    empty = F.hajek_attention(q, k, v, torch.zeros(1, 1, 5), return_tail_moment=True)
    cert = F.certificate(empty, kind="chebyshev_ucb")
    assert torch.all(cert.radius == math.inf) and not torch.isnan(cert.relative_radius).any()
    certain = F.hajek_attention(q, k, v, torch.ones(1, 1, 5), return_tail_moment=True)
    cert = F.certificate(certain, kind="chebyshev_ucb")
    assert torch.all(cert.radius == 0) and torch.all(cert.relative_radius == 0)


# ----------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("t", [None, 2])
def test_dispatch_passes_return_tail_moment(monkeypatch, t):
    monkeypatch.delenv(DSP.ENV_VAR, raising=False)
    q, k, v, pi = make_case(1, 2, 2, 2, 9, 8, 5, torch.float32, pad="ragged", pi_kind="interior", t=t)
    assert DSP.select_backend(q, return_tail_moment=True) == "fast"
    fast = DSP.hajek_attention(q, k, v, pi, return_tail_moment=True)
    assert (fast.backend, fast.route) == ("fast", "torch")
    assert torch.equal(fast.tail_moment, F.hajek_attention(q, k, v, pi, return_tail_moment=True).tail_moment)
    ref = DSP.hajek_attention(q, k, v, pi, backend="reference", return_tail_moment=True)
    also = DSP.hajek_attention(q, k, v, pi, backend="reference")  # the oracle fills it anyway
    assert torch.equal(ref.tail_moment, also.tail_moment)
    g = 2
    for idx in np.ndindex(*ref.tail_moment.shape):
        bi, hq = idx[0], idx[1]
        qq = q[idx] if t is None else q[bi, hq, idx[2]]
        e = R.hajek_attention(qq.double().numpy(), k[bi, hq // g].double().numpy(), v[bi, hq // g].double().numpy(),
                              pi[bi, hq // g].double().numpy())
        assert ref.tail_moment[idx] == torch.tensor(e.tail_moment, dtype=torch.float32)
    assert torch.allclose(fast.tail_moment, ref.tail_moment, rtol=8 * rounding(torch.float32, 9), atol=0)
