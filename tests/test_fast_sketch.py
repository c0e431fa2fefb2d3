"""kvcert.fast.sketch (the cluster design, batched torch) against kvcert.reference.sketch (float64 oracle).

Float64: the same labels, sketch fields, V_cl and radii as the reference head by head, to float64
rounding (1e-12 relative on sums of a few hundred terms, as tests/test_reference_sketch.py; V_cl is
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

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcert.fast as F
from kvcert.fast import sketch as FS
from kvcert.reference import sketch as RS
from sketch_support import (FLOAT32_CASES, RTOL, RTOL_V, T, _centred_scale, _check_fields, _compact, _full, _heads,
                            _ref_sketch, _reference_rows, _sketch_tolerances, check_float32_step,
                            with_error)
from support import EPS, assert_close, rounding

FEW = settings(max_examples=6, deadline=None)


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


def test_principal_direction_is_the_svd_direction_with_a_fixed_sign():
    """The reference's initial direction (eigh of the d x d scatter matrix) is the first right singular
    vector of the centred keys up to sign, signed so that its largest |component| is positive. Both
    solvers' directions are off by about eps / g (g = 1 - (s_2/s_1)^2, the relative gap of the top
    eigenvalue), so 1 - |cos| <= (100 eps / g)^2 with a wide margin."""
    rng = np.random.default_rng(3)
    eps = np.finfo(np.float64).eps
    for n, d in ((50, 1), (3, 8), (400, 16), (2000, 64)):
        k = rng.normal(size=(n, d)) * np.linspace(2.0, 0.5, d) ** 2 + rng.normal(size=d)
        u = RS._principal_direction(k)
        _, sv, vt = np.linalg.svd(k - k.mean(0), full_matrices=False)
        gap = 1.0 - (sv[1] / sv[0]) ** 2 if d > 1 else 1.0
        assert abs(abs(u @ vt[0]) - 1.0) <= (100 * eps / gap) ** 2 + 4 * eps, (n, d, gap)
        assert u[np.argmax(np.abs(u))] > 0


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
    got = FS.sketch_hajek_attention(T(q), T(K), T(V), T(P), sk, delta=0.1)
    ref = _reference_rows(q, k, v, pi, keep, valid, RS.ClusterDesign(clusters=clusters, iterations=4), bound=True)
    # the estimate is hajek_attention's trace-only one (same inputs, cached moments)
    mu, r2 = F.value_moments(T(V), T(P))
    est = F.hajek_attention(T(q), T(K), T(V), T(P), per_coordinate=False, value_center=mu, value_sqdist=r2)
    for f in ("output", "trace", "lse"):
        want = getattr(est, f).numpy()
        assert_close(f, getattr(got.estimate, f).numpy(), want, RTOL * (np.abs(want).max() + 1.0))
    var_fn = FS.cluster_variance(T(q), T(K), T(V), T(P), sk, output=got.output)
    r64 = rounding(torch.float64, n)
    for (bi, hq), (e, var, hull) in ref.items():
        hi = hq // g
        kept = P[bi, hi] > 0
        kk, vv, pp, o = K[bi, hi][kept], V[bi, hi][kept], P[bi, hi][kept], e.output
        assert_close(f"output[{bi}, {hq}]", got.output[bi, hq].numpy(), o, RTOL * (np.abs(o).max() + 1))
        # the centred form's cancellation: sum c_i (||v_i - mu|| + ||o - mu||)^2 (see the module docstring)
        mu_k = vv.mean(0)
        c_scale = np.sum((1 - pp) * e.weights ** 2 * (np.linalg.norm(vv - mu_k, axis=1) + np.linalg.norm(o - mu_k)) ** 2)
        assert_close(f"trace[{bi}, {hq}]", float(got.estimate.trace[bi, hq]), e.trace, RTOL * e.trace + r64 * c_scale)
        tol = RTOL_V * var + r64 * _centred_scale(q[bi, hq], kk, vv, pp, sk, bi, hi, o)
        for name, x in (("sketch_hajek_attention", got.cluster_variance), ("cluster_variance", var_fn)):
            assert_close(f"{name}[{bi}, {hq}]", float(x[bi, hq]), var, tol)
        # the radius reads max(V_cl, HT trace): max is 1-Lipschitz, so its error is at most the larger of the two
        both = RS.sketched_variance(var, e.trace)
        tol_b = max(tol, RTOL * e.trace + r64 * c_scale)
        assert_close(f"variance[{bi}, {hq}]", float(got.variance[bi, hq]), both, tol_b)
        want_r = RS.radius_from_variance(both, delta=0.1, rule=rule, multiplier=2.5)
        # the hull bound: norms and a max of float64 sums, relative rounding r64; the radius is the smaller
        assert_close(f"bound[{bi}, {hq}]", float(got.bound[bi, hq]), hull, r64 * hull)
        # sqrt halves the relative error
        assert_close(f"radius[{bi}, {hq}]", float(got.radius[bi, hq]), min(want_r, hull),
                     max(want_r * (tol_b / max(both, 1e-300)), r64 * hull))


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
    ce = FS.sketch_hajek_attention(T(q), T(K), T(V), T(P), sk, rule="chebyshev")
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
    ce = FS.sketch_hajek_attention(T(q), T(K), T(V), T(P), sk)
    for bi in range(2):
        for hq in range(6):
            hi = hq // 3
            kk = valid[bi, hi]
            s = k[bi, hi][kk] @ q[bi, hq] / math.sqrt(8)
            p = pi[bi, hi][kk]
            o = ce.output[bi, hq].numpy()
            dist = np.sum((v[bi, hi][kk] - o) ** 2, axis=1)
            want = np.sum((1 - p) / p * np.exp(2 * (s - s.max())) * dist) / np.sum(np.exp(s - s.max())) ** 2
            assert_close(f"V_cl[{bi}, {hq}]", float(ce.cluster_variance[bi, hq]), want, RTOL_V * want + 1e-300)
            assert float(ce.variance[bi, hq]) == max(float(ce.cluster_variance[bi, hq]),
                                                     float(ce.estimate.trace[bi, hq]))


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
    ce = FS.sketch_hajek_attention(T(q), T(K), T(V), T(P), sk)
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


@pytest.mark.parametrize("n, g, clusters", FLOAT32_CASES)
def test_float32_within_derived_tolerance(n, g, clusters):
    check_float32_step(FS.sketch_hajek_attention, n, g, clusters)


@pytest.mark.parametrize("field", ["output", "trace", "cluster_variance"])
def test_the_float32_tolerance_rejects_a_step_with_a_deliberate_error(field):
    """Negative control of :func:`check_float32_step`: the same step with one field moved by 100 units
    of the float32 rounding allowance (about 1e-3 of its value at n = 113) fails it. Its tolerances
    are 10-30 such units (the (1 + 4 S) growth of exponents of size S), so a smaller error can pass."""
    with pytest.raises(AssertionError, match={"output": "output32", "trace": "trace32", "cluster_variance": "V_cl32"}[field]):
        check_float32_step(with_error(FS.sketch_hajek_attention, field, 100, 113), 113, 1, 6)


@pytest.mark.parametrize("n, clusters", [(239, 6), (113, 1), (3, 4)])
def test_float32_cache_with_float64_pi(n, clusters):
    """A design's pi is float64 and the cache float32: the sketch is float32 (w = (1 - pi)/pi computed
    in float64, rounded once), within the float32 sketch tolerance above (rounding(float32, n) times
    the magnitude each field sums) of the float64 reference on the float32-rounded keys and values
    and the unrounded pi, tiny pi (1e-6, w ~ 1e6) included."""
    k, v, pi, keep, valid = _full(200 + n, 2, 2, n, 16, 5, budget=0.3)
    k, v = (x.astype(np.float32).astype(np.float64) for x in (k, v))
    labels = FS.kmeans_assign(T(k), clusters, valid=T(valid, torch.bool))
    f32 = torch.float32
    sk = FS.cluster_sketch(T(k, f32), T(v, f32), T(pi), T(keep, torch.bool), FS.ClusterDesign(clusters=clusters),
                           labels=labels)
    assert sk.mean.dtype == sk.weight.dtype == sk.mu.dtype == f32
    r, lab = rounding(torch.float32, n), labels.numpy()
    for bi, hi in _heads(valid):
        ok = valid[bi, hi]
        ref = _ref_sketch(k, v, pi, keep, valid, bi, hi, RS.ClusterDesign(clusters=clusters), labels=lab)
        tol = _sketch_tolerances(r, k[bi, hi], v[bi, hi], pi[bi, hi], ok & ~keep[bi, hi], lab[bi, hi], ok, ref)
        _check_fields(sk, ref, bi, hi, tol=tol)


def test_float64_pi_beyond_float32_keeps_float64():
    """An evicted token with pi = 1e-45 has w ~ 1e45, not a float32: the sketch of float32 keys and values
    is then float64, finite, and the float64 sketch of the same inputs (to its float64 rounding)."""
    k, v, pi, keep, valid = _full(8, 1, 2, 60, 8, 3, pad=False)
    evicted = np.flatnonzero(~keep[0, 1])
    pi[0, 1, evicted[0]] = 1e-45
    k, v = (x.astype(np.float32).astype(np.float64) for x in (k, v))
    design = FS.ClusterDesign(clusters=4)
    lab = FS.kmeans_assign(T(k), 4)
    got = FS.cluster_sketch(T(k, torch.float32), T(v, torch.float32), T(pi), T(keep, torch.bool), design, labels=lab)
    want = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), design, labels=lab)
    assert got.weight.dtype == torch.float64 and bool(torch.isfinite(got.weight).all())
    for f in ("mean", "var", "weight", "wnorm", "count", "mu"):
        x, y = getattr(got, f).numpy(), getattr(want, f).numpy()
        assert_close(f, x, y, RTOL * (np.abs(y) + np.abs(y).max() + 1e-300))


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
        FS.sketch_hajek_attention(q, K, V, P, sk, delta=1.5)
    with pytest.raises(ValueError, match="rule must be one of"):
        FS.sketch_hajek_attention(q, K, V, P, sk, rule="bernstein")
    with pytest.raises(ValueError, match="multiplier must be a finite number > 0"):
        FS.sketch_hajek_attention(q, K, V, P, sk, multiplier=-1.0)
    with pytest.raises(ValueError, match=r"sketch.mean must have shape \(b, h_kv, C, d\) = \(1, 2, 3, 4\)"):
        FS.sketch_hajek_attention(q, K, V, P, dataclasses.replace(sk, mean=sk.mean[..., :2]))
    with pytest.raises(ValueError, match=r"sketch.mu must have shape \(b, h_kv, dv\)"):
        FS.cluster_variance(q, K, V[..., :2], P, sk, output=torch.zeros(1, 4, 2))
    with pytest.raises(TypeError, match="sketch must be a ClusterSketch"):
        FS.sketch_hajek_attention(q, K, V, P, {"mean": sk.mean})
    with pytest.raises(ValueError, match=r"output must have shape \(b, h_q\[, t\], dv\) = \(1, 4, 3\)"):
        FS.cluster_variance(q, K, V, P, sk, output=torch.zeros(1, 4, 2))
    with pytest.raises(ValueError, match="must be a multiple of"):
        FS.sketch_hajek_attention(q[:, :3], K, V, P, sk)
    with pytest.raises(TypeError, match="give both value_center= and value_sqdist="):
        FS.sketch_hajek_attention(q, K, V, P, sk, value_center=torch.zeros(1, 2, 3))
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
    a = FS.sketch_hajek_attention(q, K, V, P, sk)
    mu, r2 = F.value_moments(V, P)
    b = FS.sketch_hajek_attention(q, K, V, None, sk, log_pi=torch.log(P), value_center=mu, value_sqdist=r2,
                                   validate=False)
    for x, y in ((a.output, b.output), (a.variance, b.variance), (a.radius, b.radius), (a.estimate.trace,
                                                                                       b.estimate.trace)):
        assert_close("log_pi path", y.numpy(), x.numpy(), 1e-13 * (np.abs(x.numpy()) + 1))
    assert F.sketch_hajek_attention is FS.sketch_hajek_attention and F.ClusterSketch is FS.ClusterSketch


@pytest.mark.parametrize("n", [0, 37])
def test_without_the_trace_the_step_is_the_same_but_for_the_trace(n):
    """trace=False drops the HT trace's rows only: output, lse, V_cl and radius are the same numbers
    (float64; one fewer row block in the matmul, so bit-equality is not asserted), trace is None."""
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 3, 80, 8, generator=g, dtype=torch.float64), torch.randn(2, 3, 80, 5, generator=g,
                                                                                  dtype=torch.float64)
    pi = torch.rand(2, 3, 80, generator=g, dtype=torch.float64).clamp(min=0.05)
    keep = torch.rand(2, 3, 80, generator=g, dtype=torch.float64) < pi
    keep[..., :n] = True
    sk = F.cluster_sketch(k, v, pi, keep, F.ClusterDesign(clusters=5))
    kept = torch.where(keep, pi, torch.zeros_like(pi))[..., :max(n, 1)] if n else pi[..., :0]
    q = torch.randn(2, 6, 8, generator=g, dtype=torch.float64)
    a = F.sketch_hajek_attention(q, k[..., :kept.shape[-1], :], v[..., :kept.shape[-1], :], kept, sk)
    b = F.sketch_hajek_attention(q, k[..., :kept.shape[-1], :], v[..., :kept.shape[-1], :], kept, sk, trace=False)
    assert b.estimate.trace is None and a.estimate.trace is not None
    for x, y in ((a.output, b.output), (a.estimate.lse, b.estimate.lse), (a.variance, b.variance),
                 (a.radius, b.radius)):
        assert torch.allclose(x, y, rtol=1e-12, atol=0.0, equal_nan=True)
    if n == 0:  # nothing kept: the empty-sample convention either way
        assert bool(torch.isinf(b.variance).all()) and bool((b.output == 0).all())


def test_the_cached_decode_form_follows_the_sketch():
    """The decode step keeps each sketch's per-step constants on the sketch between calls: a second
    call, another scale, another dtype and an in-place change of a sketch tensor all give what a fresh
    copy of the sketch gives (the cache is rebuilt, never read stale); ``dataclasses.replace`` makes a
    sketch that starts without the constants and decodes the same."""
    k, v, pi, keep, sk, q, K, V, P = _small()

    def fresh(sketch, **kw):  # the same numbers in new tensors: no state kept for them
        return FS.sketch_hajek_attention(q, K, V, P, sketch.map(torch.clone), **kw)

    def same(a, b):
        for x, y in ((a.output, b.output), (a.variance, b.variance), (a.radius, b.radius)):
            assert torch.equal(x, y)

    first = FS.sketch_hajek_attention(q, K, V, P, sk)
    same(FS.sketch_hajek_attention(q, K, V, P, sk), first)
    with torch.no_grad():
        sk.mean.mul_(1.5)           # an in-place change: the cached constants must not be read
        sk.wnorm.add_(1.0)
    moved = FS.sketch_hajek_attention(q, K, V, P, sk)
    same(moved, fresh(sk))
    assert not torch.equal(moved.variance, first.variance)
    same(FS.sketch_hajek_attention(q, K, V, P, sk, scale=0.3), fresh(sk, scale=0.3))
    q32, K32, V32, P32 = q.float(), K.float(), V.float(), P.float()
    a = FS.sketch_hajek_attention(q32, K32, V32, P32, sk)   # float32 inputs read the float64 sketch as float32
    assert a.variance.dtype == torch.float32
    same(a, FS.sketch_hajek_attention(q32, K32, V32, P32, sk.map(torch.clone)))
    rebuilt = dataclasses.replace(sk)
    same(FS.sketch_hajek_attention(q, K, V, P, rebuilt), moved)
    # the constants follow the heads too: the same sketch read for a batch of other heads is refused, after
    # a step that built them for these heads
    with pytest.raises(ValueError, match=r"sketch.mean must have shape \(b, h_kv, C, d\)"):
        FS.sketch_hajek_attention(q.repeat(2, 1, 1), K.repeat(2, 1, 1, 1), V.repeat(2, 1, 1, 1), P.repeat(2, 1, 1), sk)


def test_the_per_step_path_reads_a_built_form_without_the_version_counters():
    """``follow_in_place=False`` (the op's per-layer steps, on a cache layer's sketch) returns the form built for
    the same layout without reading the sketch's version counters, so an in-place change is not followed there
    (no cache layer's sketch is changed in place); the default follows it, and another layout rebuilds either way."""
    from types import SimpleNamespace

    *_, sk, q, K, V, P = _small()
    L = SimpleNamespace(dtype=torch.float32, scale=0.5, b=1, h_kv=2, d=4, dv=3, q=q)
    built = FS._decode_form(sk, L)
    assert FS._decode_form(sk, L, follow_in_place=False) is built
    with torch.no_grad():
        sk.mean.mul_(1.5)
    assert FS._decode_form(sk, L, follow_in_place=False) is built        # not followed on the step path
    moved = FS._decode_form(sk, L)                                        # followed by default
    assert moved is not built and not torch.equal(moved.W, built.W)
    other = FS._decode_form(sk, SimpleNamespace(**{**vars(L), "scale": 0.25}), follow_in_place=False)
    assert other is not moved and other.key[1] == 0.25
