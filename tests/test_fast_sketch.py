"""kvcert.fast.sketch (the cluster design, batched torch) against kvcert.reference.sketch (float64 oracle).

Float64: the same labels, sketch fields, V_cl and radii as the reference head by head, to float64
rounding (1e-12 relative on sums of a few hundred terms, as tests/test_sketch_designs.py; V_cl is
compared at 1e-10: it is exp(log-numerator - 2 log Z), whose absolute log error of a few eps times
the largest exponent |s| <= 30 becomes a relative error), plus, for the trace and V_cl, the
rounding of the one-pass centred form (rounding(float64, n) times V_c, defined below).

Float32 (the tolerance rule of tests/support.py, STYLE.md): a result from float32 inputs is compared
with the float64 reference on the *same* (float32-rounded) inputs and must satisfy

    |fast32 - ref64| <= 2 * |naive32 - ref64| + rounding(float32, n) * scale,

``naive32`` the reference's formula evaluated term by term in plain float32 torch, ``rounding`` the
shared 8 eps sqrt(n + 1) of a length-n reduction, ``scale`` the magnitude the formula sums:
sum w |k| / W for a mean, sum w (|k| + |m|)^2 / W for a variance, sum w (||v|| + ||mu||)^2 for
Y = sum w nu^2 (nu_i = ||v_i - mu||, mu itself rounded), and (1 + 4 S) V + V_c for V_cl, where S is
the largest exponent magnitude (tau sum_j |q_j k_ij| on the kept tokens, tau |q|.|m_c| +
tau^2 q^2.sigma^2_c on the clusters): an absolute error eps S in one exponent is a relative error
2 eps S in e^{2s} and 2 eps S more through Z^{-2}; and V_c is the kept part of V_cl with
(||v_i - mu|| + ||o - mu||)^2 in place of ||v_i - o||^2 (mu the mean kept value): the magnitude the
one-pass centred form cancels (the same form, and the same limit, as hajek_attention's cached trace). Labels are discrete: float32 k-means is checked
on well separated clusters, and the float32 sketch is built from the float64 labels.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

import kvcert.fast as F
from kvcert.fast import sketch as FS
from kvcert.reference import hajek_attention as ref_hajek
from kvcert.reference import sketch as RS
from support import EPS, assert_close, rounding

RTOL = 1e-12
RTOL_V = 1e-10
FEW = settings(max_examples=6, deadline=None)


# ----------------------------------------------------------------------------- inputs


def _full(seed, b, h, n, d, dv, *, pad=True, budget=0.5, spread=1.0):
    """A batch of full caches (b, h, n, .) float64 numpy with per-head lengths (suffix padding, and one
    head with scattered padding), pi with exact 1.0, interior and tiny values (0 on padding), a
    Poisson sample ``keep`` and garbage keys/values on the padding slots."""
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(b, h, n, d)) * rng.uniform(0.5, 2.0, size=(b, h, 1, d)) * spread \
        + rng.normal(size=(b, h, 1, d))
    v = rng.normal(size=(b, h, n, dv)) + 2.0
    valid = np.ones((b, h, n), bool)
    if pad and b * h > 1:
        lengths = rng.integers(1, n + 1, size=(b, h))
        lengths[0, 0] = n
        valid = np.arange(n) < lengths[..., None]
        valid[-1, -1] = rng.random(n) < 0.7
        valid[-1, -1, 0] = True
    pi = np.clip(budget * rng.uniform(0.1, 2.0, size=(b, h, n)), 0.05, 1.0)
    u = rng.random((b, h, n))
    pi[u < 0.15] = 1.0
    pi[(u >= 0.15) & (u < 0.2)] = 1e-6
    pi[..., :2] = 1.0
    pi[~valid] = 0.0
    keep = (rng.random((b, h, n)) < pi) & valid
    k[~valid] = 1e3 * rng.normal(size=k[~valid].shape)
    v[~valid] = -1e3
    return k, v, pi, keep, valid


def _compact(k, v, pi, keep):
    """The kept tokens packed to the front of each head, padded with pi = 0 (and garbage keys/values)."""
    b, h, n, d = k.shape
    m = max(int(keep.sum(-1).max()), 1)
    K = np.full((b, h, m, d), 7.0)
    V = np.full((b, h, m, v.shape[-1]), -7.0)
    P = np.zeros((b, h, m))
    for bi in range(b):
        for hi in range(h):
            idx = np.flatnonzero(keep[bi, hi])
            K[bi, hi, :idx.size], V[bi, hi, :idx.size], P[bi, hi, :idx.size] = k[bi, hi, idx], v[bi, hi, idx], \
                pi[bi, hi, idx]
    return K, V, P


def T(x, dtype=torch.float64):
    return torch.as_tensor(np.asarray(x), dtype=dtype)


def _heads(valid):
    b, h = valid.shape[:2]
    return [(bi, hi) for bi in range(b) for hi in range(h)]


def _ref_sketch(k, v, pi, keep, valid, bi, hi, design, labels=None):
    ok = valid[bi, hi]
    lab = None if labels is None else labels[bi, hi][ok]
    return RS.cluster_sketch(k[bi, hi][ok], v[bi, hi][ok], pi[bi, hi][ok], keep[bi, hi][ok], design, labels=lab)


def _check_fields(fast, ref, bi, hi, dtype=torch.float64, tol=None):
    """Fast slots with an evicted token == the reference's clusters (label order); the rest 0."""
    used = fast.count[bi, hi].numpy() > 0
    assert used.sum() == ref.count.size
    for f in ("mean", "var", "weight", "wnorm", "count"):
        got = getattr(fast, f)[bi, hi].double().numpy()
        want = getattr(ref, f)
        if tol is None:
            top = np.abs(want).max() if want.size else 0.0
            assert_close(f"{f}[{bi}, {hi}]", got[used], want, RTOL * (np.abs(want) + top + 1e-300))
        else:
            assert_close(f"{f}[{bi}, {hi}]", got[used], want, tol[f])
        assert not np.any(got[~used]), f"{f}[{bi}, {hi}]: a slot without an evicted token must hold 0"
    want = ref.mu
    got = fast.mu[bi, hi].double().numpy()
    assert_close(f"mu[{bi}, {hi}]", got, want, RTOL * (np.abs(want).max() + 1.0) if tol is None else tol["mu"])


# ----------------------------------------------------------------------------- k-means


@FEW
@given(n=st.sampled_from([1, 3, 17, 64, 113, 239]), d=st.sampled_from([1, 4, 16]),
       clusters=st.sampled_from([1, 3, 8, 16]), iterations=st.sampled_from([0, 2, 10]), seed=st.integers(0, 10**6))
def test_kmeans_labels_match_reference_float64(n, d, clusters, iterations, seed):
    k, _, _, _, valid = _full(seed, 2, 3, n, d, 2)
    lab = FS.kmeans_assign(T(k), clusters, iterations=iterations, valid=T(valid, torch.bool)).numpy()
    assert lab.shape == valid.shape and lab.dtype == np.int64
    assert np.all(lab[~valid] == -1)
    for bi, hi in _heads(valid):
        ok = valid[bi, hi]
        want = RS.kmeans_assign(k[bi, hi][ok], clusters, iterations=iterations)
        assert np.array_equal(lab[bi, hi][ok], want), (bi, hi)


def test_kmeans_without_valid_and_all_padding_head():
    k, _, _, _, _ = _full(3, 1, 2, 50, 6, 2, pad=False)
    lab = FS.kmeans_assign(T(k), 5).numpy()
    for hi in range(2):
        assert np.array_equal(lab[0, hi], RS.kmeans_assign(k[0, hi], 5))
    valid = np.ones((1, 2, 50), bool)
    valid[0, 1] = False
    lab = FS.kmeans_assign(T(k), 5, valid=T(valid, torch.bool)).numpy()
    assert np.all(lab[0, 1] == -1) and np.array_equal(lab[0, 0], RS.kmeans_assign(k[0, 0], 5))


def test_kmeans_float32_on_separated_clusters():
    """Keys in 6 blobs 40 standard deviations apart: no key is near a boundary, so float32 rounding
    cannot move a label; the labels are the float64 reference's."""
    rng = np.random.default_rng(5)
    centres = 40.0 * rng.normal(size=(6, 16))
    k = (centres[rng.integers(0, 6, size=(2, 2, 300))] + rng.normal(size=(2, 2, 300, 16))).astype(np.float32)
    lab = FS.kmeans_assign(T(k, torch.float32), 6).numpy()
    for bi, hi in _heads(np.ones((2, 2), bool)):
        assert np.array_equal(lab[bi, hi], RS.kmeans_assign(k[bi, hi].astype(np.float64), 6))


# ----------------------------------------------------------------------------- the sketch


@FEW
@given(n=st.sampled_from([3, 17, 113, 239]), d=st.sampled_from([4, 16]), dv=st.sampled_from([1, 5]),
       clusters=st.sampled_from([1, 4, 16]), budget=st.sampled_from([0.1, 0.4, 0.8]), seed=st.integers(0, 10**6))
def test_sketch_fields_match_reference_float64(n, d, dv, clusters, budget, seed):
    k, v, pi, keep, valid = _full(seed, 2, 2, n, d, dv, budget=budget)
    design = FS.ClusterDesign(clusters=clusters, iterations=5)
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), design)
    assert sk.mean.shape == (2, 2, clusters, d) and sk.mu.shape == (2, 2, dv) and sk.count.shape == (2, 2, clusters)
    assert sk.rule == "gaussian" and sk.multiplier == 3.0
    for bi, hi in _heads(valid):
        ref = _ref_sketch(k, v, pi, keep, valid, bi, hi, RS.ClusterDesign(clusters=clusters, iterations=5))
        _check_fields(sk, ref, bi, hi)


def test_sketch_accepts_the_reference_design_and_labels():
    """Duck typing: a kvcert.reference.ClusterDesign works; labels= overrides k-means (as the reference)."""
    k, v, pi, keep, valid = _full(11, 1, 2, 80, 8, 3, pad=False)
    rd = RS.ClusterDesign(clusters=5, radius="fixed", multiplier=2.5)
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), rd)
    assert sk.rule == "fixed" and sk.multiplier == 2.5 and sk.clusters == 5
    labels = np.random.default_rng(0).integers(0, 5, size=(1, 2, 80))
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), rd, labels=torch.from_numpy(labels))
    for hi in range(2):
        _check_fields(sk, _ref_sketch(k, v, pi, keep, valid, 0, hi, rd, labels=labels), 0, hi)


def test_design_matches_reference():
    for kw in ({}, dict(clusters=3, iterations=0, radius="chebyshev", multiplier=1.5)):
        a, r = FS.ClusterDesign(**kw), RS.ClusterDesign(**kw)
        assert (a.clusters, a.iterations, a.radius, a.multiplier) == (r.clusters, r.iterations, r.radius, r.multiplier)
        assert a.elements(64, 48) == r.elements(64, 48)


# ----------------------------------------------------------------------------- V_cl, radius, the decode step


def _reference_rows(q, k, v, pi, keep, valid, design, *, out=None, t=None, labels=None):
    """Per (b, h_q[, t]) the reference o_hat, V_cl, and the Hajek estimate (float64 numpy); ``labels``
    (b, h, n) the clusters to use (default: the reference's own k-means)."""
    b, h_q = q.shape[:2]
    g = h_q // k.shape[1]
    res = {}
    for bi in range(b):
        for hq in range(h_q):
            hi = hq // g
            ok = valid[bi, hi]
            rsk = _ref_sketch(k, v, pi, keep, valid, bi, hi, design, labels=labels)
            kk = ok & keep[bi, hi]
            for j in range(1 if t is None else t):
                qq = q[bi, hq] if t is None else q[bi, hq, j]
                if kk.any():
                    e = ref_hajek(qq, k[bi, hi][kk], v[bi, hi][kk], pi[bi, hi][kk])
                else:
                    e = None
                o = (e.output if e is not None else np.zeros(v.shape[-1])) if out is None else \
                    (out[bi, hq] if t is None else out[bi, hq, j])
                var = RS.cluster_variance(qq, k[bi, hi][kk], v[bi, hi][kk], pi[bi, hi][kk], rsk, output=o)
                res[(bi, hq) if t is None else (bi, hq, j)] = (e, var)
    return res


@FEW
@given(n=st.sampled_from([5, 17, 113, 239]), d=st.sampled_from([4, 16]), dv=st.sampled_from([1, 5]),
       g=st.sampled_from([1, 3]), clusters=st.sampled_from([1, 6, 16]), budget=st.sampled_from([0.15, 0.5, 0.9]),
       rule=st.sampled_from(FS.CLUSTER_RADII), seed=st.integers(0, 10**6))
def test_decode_step_matches_reference_float64(n, d, dv, g, clusters, budget, rule, seed):
    k, v, pi, keep, valid = _full(seed, 2, 2, n, d, dv, budget=budget)
    rng = np.random.default_rng(seed + 1)
    q = 1.5 * rng.normal(size=(2, 2 * g, d))
    design = FS.ClusterDesign(clusters=clusters, iterations=4, radius=rule, multiplier=2.5)
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), design)
    K, V, P = _compact(k, v, pi, keep)
    got = FS.cluster_hajek_attention(T(q), T(K), T(V), T(P), sk, delta=0.1)
    ref = _reference_rows(q, k, v, pi, keep, valid, RS.ClusterDesign(clusters=clusters, iterations=4))
    # the estimate is hajek_attention's trace-only one (same inputs, cached moments)
    mu, r2 = F.value_moments(T(V), T(P))
    est = F.hajek_attention(T(q), T(K), T(V), T(P), per_coordinate=False, value_center=mu, value_sqdist=r2)
    for f in ("output", "trace", "lse"):
        want = getattr(est, f).numpy()
        assert_close(f, getattr(got.estimate, f).numpy(), want, RTOL * (np.abs(want).max() + 1.0))
    var_fn = FS.cluster_variance(T(q), T(K), T(V), T(P), sk, output=got.output)
    r64 = rounding(torch.float64, n)
    for (bi, hq), (e, var) in ref.items():
        hi = hq // g
        kept = P[bi, hi] > 0
        kk, vv, pp, o = K[bi, hi][kept], V[bi, hi][kept], P[bi, hi][kept], e.output
        assert_close(f"output[{bi}, {hq}]", got.output[bi, hq].numpy(), o, RTOL * (np.abs(o).max() + 1))
        # the centred form's cancellation: sum c_i (||v_i - mu|| + ||o - mu||)^2 (see the module docstring)
        mu_k = vv.mean(0)
        c_scale = np.sum((1 - pp) * e.weights ** 2 * (np.linalg.norm(vv - mu_k, axis=1) + np.linalg.norm(o - mu_k)) ** 2)
        assert_close(f"trace[{bi}, {hq}]", float(got.estimate.trace[bi, hq]), e.trace, RTOL * e.trace + r64 * c_scale)
        tol = RTOL_V * var + r64 * _centred_scale(q[bi, hq], kk, vv, pp, sk, bi, hi, o)
        for name, x in (("cluster_hajek_attention", got.variance), ("cluster_variance", var_fn)):
            assert_close(f"{name}[{bi}, {hq}]", float(x[bi, hq]), var, tol)
        want_r = RS.radius_from_variance(var, delta=0.1, rule=rule, multiplier=2.5)
        # sqrt halves the relative error
        assert_close(f"radius[{bi}, {hq}]", float(got.radius[bi, hq]), want_r, want_r * (tol / max(var, 1e-300)))


def test_cluster_variance_several_queries_and_plug_in():
    """q (b, h_q, t, d) with GQA g = 3, any plug-in output: every query's V_cl is the reference's."""
    k, v, pi, keep, valid = _full(21, 2, 2, 90, 8, 4, budget=0.3)
    rng = np.random.default_rng(2)
    q = rng.normal(size=(2, 6, 3, 8))
    out = rng.normal(size=(2, 6, 3, 4)) + 2.0
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), FS.ClusterDesign(clusters=7))
    K, V, P = _compact(k, v, pi, keep)
    got = FS.cluster_variance(T(q), T(K), T(V), T(P), sk, output=T(out))
    assert got.shape == (2, 6, 3)
    ce = FS.cluster_hajek_attention(T(q), T(K), T(V), T(P), sk, rule="chebyshev")
    assert ce.variance.shape == ce.radius.shape == ce.estimate.lse.shape == (2, 6, 3)
    for key, (_, var) in _reference_rows(q, k, v, pi, keep, valid, RS.ClusterDesign(clusters=7), out=out,
                                         t=3).items():
        assert_close(f"V_cl{key}", float(got[key]), var, RTOL_V * var)


def test_all_kept_gives_weight_zero_and_the_exact_kept_part():
    """Nothing evicted: every slot has count 0 and weight 0 (no NaN, no -inf leaks) and V_cl is the
    exact kept part sum_S (1 - pi)/pi e^{2 s} ||v - o_hat||^2 / (sum_S e^s)^2."""
    k, v, pi, _, valid = _full(4, 2, 2, 60, 8, 3)
    keep = valid.copy()
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), FS.ClusterDesign(clusters=5))
    for f in ("mean", "var", "weight", "wnorm", "count"):
        x = getattr(sk, f)
        assert torch.isfinite(x).all() and not x.any(), f
    q = np.random.default_rng(1).normal(size=(2, 6, 8))
    K, V, P = _compact(k, v, pi, keep)
    ce = FS.cluster_hajek_attention(T(q), T(K), T(V), T(P), sk)
    for bi in range(2):
        for hq in range(6):
            hi = hq // 3
            kk = valid[bi, hi]
            s = k[bi, hi][kk] @ q[bi, hq] / math.sqrt(8)
            p = pi[bi, hi][kk]
            o = ce.output[bi, hq].numpy()
            dist = np.sum((v[bi, hi][kk] - o) ** 2, axis=1)
            want = np.sum((1 - p) / p * np.exp(2 * (s - s.max())) * dist) / np.sum(np.exp(s - s.max())) ** 2
            assert_close(f"V_cl[{bi}, {hq}]", float(ce.variance[bi, hq]), want, RTOL_V * want + 1e-300)


def test_empty_heads():
    """A KV head with nothing kept: the decode step follows the Estimate convention (output 0, lse -inf,
    trace, V_cl and radius +inf); cluster_variance of a plug-in uses the evicted part alone, as the
    reference with an empty kept set; a head with no token at all has V_cl = 0 (no term)."""
    k, v, pi, _, valid = _full(9, 1, 3, 40, 4, 2, pad=False)
    pi = np.clip(pi, 0.05, 0.9)
    keep = np.ones_like(valid)
    keep[0, 1] = False                     # head 1: everything evicted
    pi[0, 2], valid[0, 2], keep[0, 2] = 0.0, False, False   # head 2: no token at all
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), FS.ClusterDesign(clusters=3))
    K, V, P = _compact(k, v, pi, keep)
    q = np.random.default_rng(0).normal(size=(1, 3, 4))
    ce = FS.cluster_hajek_attention(T(q), T(K), T(V), T(P), sk)
    for h in (1, 2):
        assert float(ce.estimate.lse[0, h]) == -math.inf and not ce.output[0, h].any()
        assert math.isinf(float(ce.estimate.trace[0, h])) and math.isinf(float(ce.variance[0, h]))
        assert math.isinf(float(ce.radius[0, h]))
    assert torch.isfinite(ce.variance[0, 0]) and torch.isfinite(ce.radius[0, 0])
    out = np.full((1, 3, 2), 0.5)
    var = FS.cluster_variance(T(q), T(K), T(V), T(P), sk, output=T(out))
    rsk = _ref_sketch(k, v, pi, keep, valid, 0, 1, RS.ClusterDesign(clusters=3))
    want = RS.cluster_variance(q[0, 1], k[0, 1][:0], v[0, 1][:0], pi[0, 1][:0], rsk, output=out[0, 1])
    assert want > 0
    assert_close("V_cl evicted only", float(var[0, 1]), want, RTOL_V * want)
    assert float(var[0, 2]) == 0.0


# ----------------------------------------------------------------------------- float32


def _naive_vcl32(q, K, V, P, sk, o):
    """The reference's formula, term by term, in plain float32 torch (one query per row; the sketch as
    given). (b, h_q) float64 numpy."""
    b, h_q, d = q.shape
    g = h_q // K.shape[1]
    tau = 1.0 / math.sqrt(d)
    out = np.zeros((b, h_q))
    for bi in range(b):
        for hq in range(h_q):
            hi = hq // g
            ok = P[bi, hi] > 0
            k, v, p, qq, oo = K[bi, hi][ok], V[bi, hi][ok], P[bi, hi][ok], q[bi, hq], o[bi, hq]
            s = tau * (k @ qq)
            lin = tau * (sk.mean[bi, hi] @ qq)
            quad = tau ** 2 * (sk.var[bi, hi] @ (qq * qq))
            a2 = ((sk.mu[bi, hi] - oo) ** 2).sum()
            log_z = torch.logsumexp(torch.cat([s, torch.log(sk.count[bi, hi]) + lin + quad / 2]), 0)
            ev = sk.wnorm[bi, hi] + a2 * sk.weight[bi, hi]
            terms = torch.cat([torch.log((1 - p) / p) + 2 * s + torch.log(((v - oo) ** 2).sum(-1)),
                               torch.log(ev) + 2 * lin + 2 * quad])
            out[bi, hq] = float(torch.exp(torch.logsumexp(terms, 0) - 2 * log_z))
    return out


def _sketch_tolerances(r, k, v, pi, gone, lab, ok, ref):
    """rounding x the magnitude each sketch field sums, per used cluster (see the module docstring)."""
    w = (1 - pi[gone]) / pi[gone]
    kk, vv, lg = k[gone], v[gone], lab[gone]
    masks = [lg == c for c in np.unique(lg)]
    mu_abs = np.linalg.norm(ref.mu)
    d = k.shape[-1]
    mean = [(w[m, None] * np.abs(kk[m])).sum(0) / w[m].sum() for m in masks]
    var = [(w[m, None] * (np.abs(kk[m]) + np.abs(ref.mean[j])) ** 2).sum(0) / w[m].sum() for j, m in enumerate(masks)]
    wnorm = [np.sum(w[m] * (np.linalg.norm(vv[m], axis=1) + mu_abs) ** 2) for m in masks]
    return {"weight": r * ref.weight, "count": 0.0, "mu": r * np.abs(v[ok]).mean(0),
            "wnorm": r * np.array(wnorm), "mean": r * np.array(mean).reshape(-1, d),
            "var": r * np.array(var).reshape(-1, d)}


def _centred_scale(q, k, v, p, sk, bi, hi, o):
    """The kept part of V_cl with (||v_i - mu|| + ||o - mu||)^2 for ||v_i - o||^2 (mu = mean kept value):
    the magnitude the centred form sum c r - 2 (o - mu).(sum c (v - mu)) + ||o - mu||^2 sum c cancels
    (a token with v_i ~ o_hat has a tiny term computed as a difference of O(||v_i - mu||^2) ones)."""
    if p.size == 0:
        return 0.0
    tau = 1.0 / math.sqrt(q.shape[0])
    s = tau * k @ q
    mu = v.mean(0)
    dist = (np.linalg.norm(v - mu, axis=1) + np.linalg.norm(o - mu)) ** 2
    m, var, cnt = (getattr(sk, f)[bi, hi].double().numpy() for f in ("mean", "var", "count"))
    with np.errstate(divide="ignore"):
        log_z = logsumexp(np.concatenate([s, np.log(cnt) + tau * m @ q + tau ** 2 * var @ q ** 2 / 2]))
    return float(np.sum((1 - p) / p * np.exp(2 * s - 2 * log_z) * dist))


FLOAT32_CASES = [(113, 1, 6), (239, 3, 16), (64, 3, 1), (3, 3, 4)]


@pytest.mark.parametrize("n, g, clusters", FLOAT32_CASES)
def test_float32_within_derived_tolerance(n, g, clusters):
    check_float32_step(FS.cluster_hajek_attention, n, g, clusters)


def check_float32_step(step, n, g, clusters, device="cpu"):
    """The float32 decode step ``step`` (kvcert.fast's, or the Triton kernel's: tests/test_kernels_sketch.py)
    against the float64 reference on the same rounded inputs: the sketch fields, V_cl, and the output and
    trace (|o32 - o64| <= r ((1 + 2 S) sum a_i |v_i - o| + max |v|): an exponent off by eps S moves each
    a_i by 2 eps S relative; trace: r ((1 + 4 S) trace + the centred form's scale), as V_cl)."""
    d, dv = 16, 5
    k, v, pi, keep, valid = _full(100 + n, 2, 2, n, d, dv, budget=0.3)
    pi[(pi > 0) & (pi < 1e-3)] = 0.02      # tiny pi: a 1e6 weight, whose fp32 1 - pi is exact anyway
    k, v, pi = (x.astype(np.float32).astype(np.float64) for x in (k, v, pi))   # the same rounded inputs
    q = (1.5 * np.random.default_rng(n).normal(size=(2, 2 * g, d))).astype(np.float32).astype(np.float64)
    design = FS.ClusterDesign(clusters=clusters)
    labels = FS.kmeans_assign(T(k), clusters, valid=T(valid, torch.bool))
    f32 = torch.float32
    sk = FS.cluster_sketch(T(k, f32), T(v, f32), T(pi, f32), T(keep, torch.bool), design, labels=labels)
    assert sk.mean.dtype == f32
    r = rounding(torch.float32, n)
    lab = labels.numpy()
    for bi, hi in _heads(valid):
        ok = valid[bi, hi]
        ref = _ref_sketch(k, v, pi, keep, valid, bi, hi, RS.ClusterDesign(clusters=clusters), labels=lab)
        tol = _sketch_tolerances(r, k[bi, hi], v[bi, hi], pi[bi, hi], ok & ~keep[bi, hi], lab[bi, hi], ok, ref)
        _check_fields(sk, ref, bi, hi, tol=tol)
    K, V, P = _compact(k, v, pi, keep)
    on = lambda x: x.to(device)  # noqa: E731
    sk_dev = FS.ClusterSketch(*(on(getattr(sk, f)) for f in ("mean", "var", "weight", "wnorm", "count", "mu")),
                              rule=sk.rule, multiplier=sk.multiplier)
    ce = step(on(T(q, f32)), on(T(K, f32)), on(T(V, f32)), on(T(P, f32)), sk_dev)
    ce = FS.ClusterEstimate(estimate=type(ce.estimate)(**{f: None if x is None else x.cpu() for f, x in
                                                          vars(ce.estimate).items()}),
                            variance=ce.variance.cpu(), radius=ce.radius.cpu(), rule=ce.rule, delta=ce.delta)
    assert ce.variance.dtype == f32 and ce.output.dtype == f32
    o = ce.output.double().numpy()
    # the labels the float32 sketch was built with
    ref = _reference_rows(q, k, v, pi, keep, valid, RS.ClusterDesign(clusters=clusters), out=o, labels=lab)
    sk32 = FS.cluster_sketch(T(k, f32), T(v, f32), T(pi, f32), T(keep, torch.bool), design, labels=labels)
    naive = _naive_vcl32(T(q, f32), T(K, f32), T(V, f32), T(P, f32), sk32, ce.output)
    tau = 1.0 / math.sqrt(d)
    for (bi, hq), (_, want) in ref.items():
        hi = hq // g
        kept = P[bi, hi] > 0
        S = max([0.0] + list(tau * np.abs(K[bi, hi][kept]) @ np.abs(q[bi, hq])))
        m64, s64 = sk.mean[bi, hi].double().numpy(), sk.var[bi, hi].double().numpy()
        S = max(S, float(np.max(tau * np.abs(m64) @ np.abs(q[bi, hq]) + tau ** 2 * s64 @ q[bi, hq] ** 2)))
        tol = 2 * abs(naive[bi, hq] - want) + r * ((1 + 4 * S) * want + _centred_scale(
            q[bi, hq], K[bi, hi][kept], V[bi, hi][kept], P[bi, hi][kept], sk, bi, hi, o[bi, hq]))
        assert_close(f"V_cl32[{bi}, {hq}]", float(ce.variance[bi, hq]), want, tol)
        e = ref_hajek(q[bi, hq], K[bi, hi][kept], V[bi, hi][kept], P[bi, hi][kept]) if kept.any() else None
        if e is None:
            assert not ce.output[bi, hq].any() and float(ce.estimate.trace[bi, hq]) == math.inf
            continue
        vv, pp = V[bi, hi][kept], P[bi, hi][kept]
        dev = np.linalg.norm(vv - e.output, axis=1)
        assert_close(f"output32[{bi}, {hq}]", ce.output[bi, hq].double().numpy(), e.output,
                     r * ((1 + 2 * S) * np.sum(e.weights * dev) + np.abs(vv).max()))
        mu_k = vv.mean(0)
        c_scale = np.sum((1 - pp) * e.weights ** 2 * (np.linalg.norm(vv - mu_k, axis=1)
                                                      + np.linalg.norm(e.output - mu_k)) ** 2)
        assert_close(f"trace32[{bi}, {hq}]", float(ce.estimate.trace[bi, hq]), e.trace,
                     r * ((1 + 4 * S) * e.trace + c_scale))


# ----------------------------------------------------------------------------- errors


def _small():
    k, v, pi, keep, _ = _full(0, 1, 2, 20, 4, 3, pad=False)
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), FS.ClusterDesign(clusters=3))
    K, V, P = _compact(k, v, pi, keep)
    q = T(np.ones((1, 4, 4)))
    return T(k), T(v), T(pi), T(keep, torch.bool), sk, q, T(K), T(V), T(P)


@pytest.mark.parametrize("kwargs, match", [
    (dict(clusters=0), "clusters must be an int >= 1"), (dict(iterations=-1), "iterations must be an int >= 0"),
    (dict(clusters=2.5), "clusters must be an int"), (dict(radius="wald"), "radius must be one of"),
    (dict(multiplier=0.0), "multiplier must be a finite number > 0"),
])
def test_design_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FS.ClusterDesign(**kwargs)


def test_clear_errors():
    k, v, pi, keep, sk, q, K, V, P = _small()
    with pytest.raises(ValueError, match="clusters must be an int >= 1"):
        FS.kmeans_assign(k, 0)
    with pytest.raises(ValueError, match=r"keys must be 4-d"):
        FS.kmeans_assign(k[0], 3)
    with pytest.raises(ValueError, match=r"valid must be a bool tensor of shape \(b, h_kv, n\)"):
        FS.kmeans_assign(k, 3, valid=pi)
    with pytest.raises(ValueError, match=r"values must have shape \(b, h_kv, n, dv\) = \(1, 2, 20, dv\)"):
        FS.cluster_sketch(k, v[:, :, :5], pi, keep)
    with pytest.raises(ValueError, match=r"pi must have shape \(b, h_kv, n\)"):
        FS.cluster_sketch(k, v, pi[..., :5], keep)
    with pytest.raises(ValueError, match=r"keep must be a bool tensor of shape \(b, h_kv, n\)"):
        FS.cluster_sketch(k, v, pi, keep.double())
    with pytest.raises(ValueError, match=r"pi must lie in \[0, 1\]"):
        FS.cluster_sketch(k, v, pi * 2, keep)
    with pytest.raises(ValueError, match="pi must be > 0 for every evicted token"):
        FS.cluster_sketch(k, v, torch.zeros_like(pi), keep, valid=torch.ones_like(keep))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, clusters\) = \[0, 3\)"):
        FS.cluster_sketch(k, v, pi, keep, FS.ClusterDesign(clusters=3), labels=torch.full(keep.shape, 3))
    with pytest.raises(TypeError, match="design must be None or have the attributes clusters"):
        FS.cluster_sketch(k, v, pi, keep, "cluster")
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        FS.cluster_hajek_attention(q, K, V, P, sk, delta=1.5)
    with pytest.raises(ValueError, match="rule must be one of"):
        FS.cluster_hajek_attention(q, K, V, P, sk, rule="bernstein")
    with pytest.raises(ValueError, match="multiplier must be a finite number > 0"):
        FS.cluster_hajek_attention(q, K, V, P, sk, multiplier=-1.0)
    with pytest.raises(ValueError, match=r"sketch.mean must have shape \(b, h_kv, C, d\) = \(1, 2, 3, 4\)"):
        FS.cluster_hajek_attention(q, K, V, P, FS.ClusterSketch(**{**sk.__dict__, "mean": sk.mean[..., :2]}))
    with pytest.raises(ValueError, match=r"sketch.mu must have shape \(b, h_kv, dv\)"):
        FS.cluster_variance(q, K, V[..., :2], P, sk, output=torch.zeros(1, 4, 2))
    with pytest.raises(TypeError, match="sketch must be a ClusterSketch"):
        FS.cluster_hajek_attention(q, K, V, P, {"mean": sk.mean})
    with pytest.raises(ValueError, match=r"output must have shape \(b, h_q\[, t\], dv\) = \(1, 4, 3\)"):
        FS.cluster_variance(q, K, V, P, sk, output=torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="must be a multiple of"):
        FS.cluster_hajek_attention(q[:, :3], K, V, P, sk)
    with pytest.raises(TypeError, match="give both value_center= and value_sqdist="):
        FS.cluster_hajek_attention(q, K, V, P, sk, value_center=torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match=r"variance must not contain NaN"):
        FS.cluster_radius(torch.tensor([1.0, float("nan")]), delta=0.05, rule="gaussian")
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        FS.cluster_radius(torch.tensor([1.0]), delta=0.0, rule="gaussian")


def test_radius_rules_match_reference():
    v = torch.tensor([0.0, 4.0, 0.3, -1e-20, float("inf")], dtype=torch.float64)
    for rule in FS.CLUSTER_RADII:
        for delta in (0.05, 0.3):
            got = FS.cluster_radius(v, delta=delta, rule=rule, multiplier=2.5).numpy()
            want = [RS.radius_from_variance(x, delta=delta, rule=rule, multiplier=2.5) for x in v.numpy()[:4]]
            assert_close(f"radius {rule}", got[:4], np.array(want), 4 * EPS[torch.float64] * np.array(want))
            assert got[4] == math.inf


def test_log_pi_and_cached_moments_give_the_same_step():
    """log_pi= instead of pi=, and value_center/value_sqdist from value_moments, change nothing."""
    k, v, pi, keep, sk, q, K, V, P = _small()
    a = FS.cluster_hajek_attention(q, K, V, P, sk)
    mu, r2 = F.value_moments(V, P)
    b = FS.cluster_hajek_attention(q, K, V, None, sk, log_pi=torch.log(P), value_center=mu, value_sqdist=r2,
                                   validate=False)
    for x, y in ((a.output, b.output), (a.variance, b.variance), (a.radius, b.radius), (a.estimate.trace,
                                                                                       b.estimate.trace)):
        assert_close("log_pi path", y.numpy(), x.numpy(), 1e-13 * (np.abs(x.numpy()) + 1))
    assert F.cluster_hajek_attention is FS.cluster_hajek_attention and F.ClusterSketch is FS.ClusterSketch
