"""The tilted cluster design (issue 14, fifth slice): exact properties of the reference, and kvcert.fast against it.

The tilted sketch keeps, per cluster c of evicted tokens U_c, moments under the tilted weights
w_i e^{2 tau q0.k_i} (squared terms) and e^{tau q0.k_i} (Z), and takes the Gaussian step in r = q - q0
(docs/theory.md section 8). Two properties hold exactly, whatever the keys, and are tested on
heavy-tailed (Student t, 2 degrees of freedom) keys in float64 at 1e-10 relative (exp of a log-sum
whose absolute error is a few eps times exponents of at most ~60, tests/test_fast_sketch.py):

- at q = q0 the sketch's evicted sums are the true ones, so V_cl is the design variance V with
  ||v_i - o||^2 replaced by nu_i^2 + ||mu - o||^2 (the value rule of every cluster design);
- when the evicted keys of each cluster coincide (a point mass), the tilted moments have variance 0
  and mean that key, so V_cl is that same quantity at every q.

kvcert.fast is checked against the reference in float64 (sketch fields at 1e-12, V_cl at 1e-10 plus
the centred form's rounding, as tests/test_fast_sketch.py) and in float32 at tilt exponents of ~100,
where e^{2 tau q0.k} overflows float32 unless the masses are held scaled by e^{-2 h_c}.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

import kvcert.fast as F
from kvcert.fast import sketch as FS
from kvcert import reference as R
from kvcert.reference import hajek_attention as ref_hajek
from kvcert.reference import sketch as RS
from sketch_support import RTOL, RTOL_V, T, _compact, _full, _heads
from support import assert_close, rounding, triton_kernels

FEW = settings(max_examples=6, deadline=None)


def _heavy(seed, n, d, dv, budget=0.3):
    """One head: Student-t keys (2 degrees of freedom: infinite variance), values, pi with a certain prefix, a
    Poisson sample (at least one evicted token)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_t(2, size=(n, d)) * rng.uniform(0.5, 1.5, size=d)
    v = rng.normal(size=(n, dv)) + 1.0
    pi = np.clip(budget * rng.uniform(0.2, 2.0, size=n), 0.02, 1.0)
    pi[:2] = 1.0
    keep = rng.random(n) < pi
    keep[pi == 1.0] = True
    keep[-1], pi[-1] = False, min(pi[-1], 0.5)
    return k, v, pi, keep, rng


def _direct(q, k, v, pi, keep, o, scale=None):
    """V_cl's exact target at q: the kept terms exact, the evicted ones with nu_i^2 + ||mu - o||^2, Z over all."""
    tau = 1.0 / math.sqrt(k.shape[1]) if scale is None else scale
    s = tau * k @ q
    mu = v.mean(0)
    w = (1.0 - pi) / pi
    dist = np.where(keep, np.sum((v - o) ** 2, 1), np.sum((v - mu) ** 2, 1) + np.sum((mu - o) ** 2))
    m = (w > 0) & (dist > 0)
    log_num = logsumexp(np.log(w[m]) + 2 * s[m] + np.log(dist[m]))
    return float(np.exp(log_num - 2 * logsumexp(s)))


@FEW
@given(n=st.sampled_from([9, 60, 211]), d=st.sampled_from([3, 16]), dv=st.sampled_from([1, 4]),
       clusters=st.sampled_from([1, 4, 9]), seed=st.integers(0, 10**6))
def test_exact_at_the_tilt_point(n, d, dv, clusters, seed):
    k, v, pi, keep, rng = _heavy(seed, n, d, dv)
    q0 = 2.0 * rng.normal(size=d)
    sk = RS.cluster_sketch(k, v, pi, keep, RS.ClusterDesign(clusters=clusters, tilt=True), tilt=q0)
    est = ref_hajek(q0, k[keep], v[keep], pi[keep])
    got = RS.cluster_variance(q0, k[keep], v[keep], pi[keep], sk, output=est.output)
    want = _direct(q0, k, v, pi, keep, est.output)
    assert_close("V_cl at q0", got, want, RTOL_V * want)


@FEW
@given(n=st.sampled_from([12, 80]), d=st.sampled_from([2, 8]), points=st.sampled_from([1, 3, 5]),
       seed=st.integers(0, 10**6))
def test_exact_everywhere_on_point_mass_clusters(n, d, points, seed):
    """Evicted keys equal to one of a few points, clustered by point: every tilted variance is 0, so the
    Gaussian step is exact at every q, near q0 or not."""
    k, v, pi, keep, rng = _heavy(seed, n, d, 2)
    centres = 3.0 * rng.normal(size=(points, d))
    labels = rng.integers(0, points, size=n)
    k = centres[labels]
    q0 = rng.normal(size=(7, d))          # window queries: the tilt point is their mean
    sk = RS.cluster_sketch(k, v, pi, keep, RS.ClusterDesign(clusters=points, tilt=True), labels=labels, tilt=q0)
    assert np.allclose(sk.tilt, q0.mean(0), rtol=0, atol=1e-15) and np.all(sk.var < 1e-20) and np.all(sk.zvar < 1e-20)
    for q in 2.0 * rng.normal(size=(4, d)):
        est = ref_hajek(q, k[keep], v[keep], pi[keep])
        want = _direct(q, k, v, pi, keep, est.output)
        assert_close("V_cl", RS.cluster_variance(q, k[keep], v[keep], pi[keep], sk, output=est.output), want,
                     RTOL_V * want)


def test_window_tilt():
    g = torch.Generator().manual_seed(0)
    qs = torch.randn(2, 6, 10, 4, generator=g, dtype=torch.float64)
    got = F.window_tilt(qs, 2, window=3)
    assert got.shape == (2, 2, 4)
    want = qs[:, :3, 7:].mean((1, 2))
    assert torch.allclose(got[:, 0], want, rtol=0, atol=1e-15)
    assert torch.allclose(F.window_tilt(qs, 3, window=50), qs.reshape(2, 3, 2, 10, 4).mean((2, 3)), atol=1e-15)
    with pytest.raises(ValueError, match="not a multiple of h_kv = 4"):
        F.window_tilt(qs, 4)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        F.window_tilt(qs, 2, window=0)


# ----------------------------------------------------------------------------- kvcert.fast == reference


def _kept_scale(q, k, v, p, o, tau):
    """The magnitude the one-pass centred form cancels (tests/test_fast_sketch.py), with Z over the kept tokens
    only (Z >= that: an upper bound on the scale)."""
    if p.size == 0:
        return 0.0
    s = tau * k @ q
    mu = v.mean(0)
    dist = (np.linalg.norm(v - mu, axis=1) + np.linalg.norm(o - mu)) ** 2
    return float(np.sum((1 - p) / p * np.exp(2 * s - 2 * logsumexp(s)) * dist))


@FEW
@given(n=st.sampled_from([5, 17, 113, 239]), d=st.sampled_from([4, 16]), dv=st.sampled_from([1, 5]),
       g=st.sampled_from([1, 3]), clusters=st.sampled_from([1, 6, 8]), budget=st.sampled_from([0.15, 0.5]),
       seed=st.integers(0, 10**6))
def test_fast_matches_reference_float64(n, d, dv, g, clusters, budget, seed):
    _check_tilted_against_reference(n, d, dv, g, clusters, budget, seed)


@pytest.mark.parametrize("moved", [1e-6, 1e-3])
def test_the_tilted_check_rejects_a_sketch_tilted_at_another_point(moved):
    """Negative control: the fast sketch tilted at q0 moved by ``moved`` of its norm (a design that
    reads the window queries off by one rounding-level step, or by 0.1%) fails the same check."""
    with pytest.raises(AssertionError):
        _check_tilted_against_reference(113, 16, 5, 3, 6, 0.15, 11, moved=moved)


def _check_tilted_against_reference(n, d, dv, g, clusters, budget, seed, moved=0.0):
    """kvcert.fast's tilted sketch and step against the float64 reference on the same inputs; the
    fast sketch is tilted at q0 (1 + ``moved``) (0: the same point; the negative control moves it)."""
    k, v, pi, keep, valid = _full(seed, 2, 2, n, d, dv, budget=budget)
    rng = np.random.default_rng(seed + 7)
    window = rng.normal(size=(2, 2 * g, 5, d))
    q0 = F.window_tilt(T(window), 2)
    design = FS.ClusterDesign(clusters=clusters, iterations=4, radius="fixed", multiplier=3.0, tilt=True)
    sk = FS.cluster_sketch(T(k), T(v), T(pi), T(keep, torch.bool), design, tilt=q0 * (1 + moved))
    assert sk.tilt.shape == (2, 2, d) and sk.zmean.shape == sk.mean.shape and sk.shift.shape == sk.count.shape
    q = 1.5 * rng.normal(size=(2, 2 * g, d))
    K, V, P = _compact(k, v, pi, keep)
    got = FS.sketch_hajek_attention(T(q), T(K), T(V), T(P), sk, delta=0.1)
    tau = 1.0 / math.sqrt(d)
    rdesign = RS.ClusterDesign(clusters=clusters, iterations=4, radius="fixed", multiplier=3.0, tilt=True)
    r64 = rounding(torch.float64, n)
    for bi, hi in _heads(valid):
        ok = valid[bi, hi]
        ref = RS.cluster_sketch(k[bi, hi][ok], v[bi, hi][ok], pi[bi, hi][ok], keep[bi, hi][ok], rdesign,
                                tilt=q0[bi, hi].numpy())
        used = sk.count[bi, hi].numpy() > 0
        assert used.sum() == ref.count.size
        for f in ("mean", "var", "weight", "wnorm", "count", "zmean", "zvar", "shift"):
            want = getattr(ref, f)
            top = np.abs(want).max() if want.size else 0.0
            assert_close(f"{f}[{bi}, {hi}]", getattr(sk, f)[bi, hi].numpy()[used], want,
                         RTOL * (np.abs(want) + top + 1e-300))
        assert_close(f"reach[{bi}, {hi}]", float(sk.reach[bi, hi]), ref.reach, RTOL * (ref.reach + 1e-300))
        kk = ok & keep[bi, hi]
        for h in range(g):
            hq = hi * g + h
            o = got.output[bi, hq].numpy()
            want = RS.cluster_variance(q[bi, hq], k[bi, hi][kk], v[bi, hi][kk], pi[bi, hi][kk], ref, output=o)
            tol = RTOL_V * want + r64 * _kept_scale(q[bi, hq], k[bi, hi][kk], v[bi, hi][kk], pi[bi, hi][kk], o, tau)
            if not kk.any():
                assert float(got.variance[bi, hq]) == math.inf
                continue
            assert_close(f"V_cl[{bi}, {hq}]", float(got.cluster_variance[bi, hq]), want, tol)
            # the radius reads max(V_cl, HT trace) (1-Lipschitz: the larger of the two tolerances)
            e = ref_hajek(q[bi, hq], k[bi, hi][kk], v[bi, hi][kk], pi[bi, hi][kk])
            both = RS.sketched_variance(want, e.trace)
            tol = max(tol, RTOL_V * e.trace + r64 * _kept_scale(q[bi, hq], k[bi, hi][kk], v[bi, hi][kk],
                                                               pi[bi, hi][kk], o, tau))
            assert_close(f"variance[{bi}, {hq}]", float(got.variance[bi, hq]), both, tol)
            hull = RS.hull_bound(v[bi, hi][kk], pi[bi, hi][kk], ref, output=o)
            assert_close(f"bound[{bi}, {hq}]", float(got.bound[bi, hq]), hull, r64 * hull)
            assert_close(f"radius[{bi}, {hq}]", float(got.radius[bi, hq]), min(3.0 * math.sqrt(both), hull),
                         max(3.0 * math.sqrt(both) * tol / max(both, 1e-300), r64 * hull))


@pytest.mark.parametrize("backend", ["fast", "kernel"])
def test_float32_holds_large_tilt_exponents(backend):
    """tau q0.k ~ 100 on the evicted keys: e^{2 tau q0.k} ~ e^{200} is not a float32, the scaled masses are. The
    float32 V_cl is finite and within the rounding of its exponents: an absolute error eps S in an exponent of
    magnitude S is 2 eps S relative in e^{2s}, 2 eps S more through Z^{-2}, so |V32 - V64| <= r (1 + 4 S) V64
    plus the centred form's term (r = rounding(float32, n)), on the same float32-rounded inputs. The Triton
    step shares the torch epilogue that reads the sketch (its kept pass is tested in test_kernels_sketch.py)."""
    step, device = FS.sketch_hajek_attention, "cpu"
    if backend == "kernel":
        kernels, device = triton_kernels()
        step = kernels.sketch_hajek_attention
    n, d, dv = 200, 16, 4
    k, v, pi, keep, valid = _full(3, 1, 2, n, d, dv, pad=False, budget=0.3)
    direction = np.ones(d) / math.sqrt(d)
    k = k + 25.0 * direction                  # keys along q0's direction: tau q0.k ~ 100
    q0 = np.broadcast_to(40.0 * direction, (1, 2, d)).copy()
    q = q0[:, [0, 0, 1, 1]] + np.random.default_rng(1).normal(size=(1, 4, d))
    k, v, pi, q, q0 = (x.astype(np.float32).astype(np.float64) for x in (k, v, pi, q, q0))
    design = FS.ClusterDesign(clusters=4, tilt=True)
    labels = FS.kmeans_assign(T(k), 4)
    f32 = torch.float32
    sk = FS.cluster_sketch(T(k, f32), T(v, f32), T(pi, f32), T(keep, torch.bool), design, labels=labels,
                           tilt=T(q0, f32))
    assert float(sk.shift.max()) > 80.0 and bool(torch.isfinite(sk.weight).all())
    K, V, P = _compact(k, v, pi, keep)
    on = lambda x: x.to(device)  # noqa: E731
    ce = step(on(T(q, f32)), on(T(K, f32)), on(T(V, f32)), on(T(P, f32)), sk.map(on))
    ce = FS.ClusterEstimate(estimate=ce.estimate, variance=ce.variance.cpu(), radius=ce.radius.cpu(), rule=ce.rule,
                            delta=ce.delta)
    assert bool(torch.isfinite(ce.variance).all())
    r = rounding(torch.float32, n)
    tau = 1.0 / math.sqrt(d)
    lab = labels.numpy()
    for hq in range(4):
        hi = hq // 2
        ref = RS.cluster_sketch(k[0, hi], v[0, hi], pi[0, hi], keep[0, hi], RS.ClusterDesign(clusters=4, tilt=True),
                                labels=lab[0, hi], tilt=q0[0, hi])
        kk = keep[0, hi]
        o = ce.output[0, hq].double().cpu().numpy()
        want = RS.cluster_variance(q[0, hq], k[0, hi][kk], v[0, hi][kk], pi[0, hi][kk], ref, output=o)
        S = float(np.max(tau * np.abs(k[0, hi]) @ np.abs(q[0, hq])))
        tol = r * ((1 + 4 * S) * want + _kept_scale(q[0, hq], k[0, hi][kk], v[0, hi][kk], pi[0, hi][kk], o, tau))
        assert_close(f"V_cl32[{hq}]", float(ce.variance[0, hq]), want, tol)


# ----------------------------------------------------------------------------- design, memory, the one call


def test_design_memory_and_names():
    for kw in (dict(tilt=True), dict(clusters=3, tilt=True, radius="chebyshev")):
        a, r = FS.ClusterDesign(**kw), RS.ClusterDesign(**kw)
        assert a.elements(64, 48) == r.elements(64, 48) == a.clusters * (4 * 64 + 4) + 64 + 48 + 1
    assert RS.TILTED.elements(64, 64) == 8 * 260 + 128 + 1 and "tilted" in RS.DESIGNS
    assert FS.as_design(RS.TILTED).tilt is True
    with pytest.raises(ValueError, match="tilt must be a bool"):
        FS.ClusterDesign(tilt="window")


def test_evict_and_certify_tilted():
    rng = np.random.default_rng(4)
    n, d, dv = 400, 16, 16
    k, v = rng.normal(size=(n, d)), rng.normal(size=(n, dv))
    u = rng.random(n)
    window = rng.normal(size=(8, d))
    res = RS.evict_and_certify(window[-1], k, v, u, 120.0, seed=3, design="tilted", tilt=window)
    assert res.design == "tilted"
    held = RS.TILTED.elements(d, dv)
    assert res.budget == pytest.approx(120.0 - held / (d + dv + 1))
    assert res.memory == pytest.approx((res.kept * (d + dv + 1) + held) / (n * (d + dv)))
    assert res.radius == pytest.approx(3.0 * math.sqrt(res.variance))
    # the same as composing the steps by hand
    pi = RS.inclusion_probabilities(u, res.budget, sinks=4, window=32, top=0, floor=0.1)
    keep = RS.poisson_sample(pi, seed=3)
    sk = RS.cluster_sketch(k, v, pi, keep, RS.TILTED, tilt=window.mean(0))
    est = ref_hajek(window[-1], k[keep], v[keep], pi[keep])
    assert res.variance == pytest.approx(RS.cluster_variance(window[-1], k[keep], v[keep], pi[keep], sk,
                                                             output=est.output), rel=1e-12)
    with pytest.raises(ValueError, match=r"tilt is required by a tilted design"):
        RS.evict_and_certify(window[-1], k, v, u, 120.0, seed=3, design="tilted")
    with pytest.raises(ValueError, match=r"tilt must be a finite \(d,\) = \(16,\) point"):
        RS.evict_and_certify(window[-1], k, v, u, 120.0, seed=3, design="tilted", tilt=window[:, :3])


@pytest.mark.parametrize("design", ["paper", "cluster", RS.ClusterDesign(clusters=4, radius="chebyshev")])
def test_designs_that_do_not_tilt_ignore_tilt(design):
    """``tilt=`` is accepted by every design (a caller passes the same arguments whatever ``design=None``
    selects): a design that does not tilt gives the bit-identical result with or without it, for the window
    queries (w, d) and their mean (d,); a wrong shape is still refused by name."""
    rng = np.random.default_rng(5)
    n, d, dv = 300, 16, 8
    k, v, u = rng.normal(size=(n, d)), rng.normal(size=(n, dv)), rng.random(n)
    window = rng.normal(size=(6, d))
    plain = RS.evict_and_certify(window[-1], k, v, u, 120.0, seed=2, design=design)
    for tilt in (window, window.mean(0)):
        got = RS.evict_and_certify(window[-1], k, v, u, 120.0, seed=2, design=design, tilt=tilt)
        assert np.array_equal(got.output, plain.output) and got.radius == plain.radius
        assert got.memory == plain.memory and got.kept == plain.kept and got.design == plain.design
    with pytest.raises(ValueError, match=r"tilt must be a finite \(d,\) = \(16,\) point"):
        RS.evict_and_certify(window[-1], k, v, u, 120.0, seed=2, design=design, tilt=window[:, :3])


def test_fast_tilt_errors():
    k, v, pi, keep, _ = _full(0, 1, 2, 20, 4, 3, pad=False)
    args = (T(k), T(v), T(pi), T(keep, torch.bool))
    tilted = FS.ClusterDesign(clusters=3, tilt=True)
    with pytest.raises(ValueError, match=r"tilt is required by a tilted design.*\(b, h_kv, d\) = \(1, 2, 4\)"):
        FS.cluster_sketch(*args, tilted)
    with pytest.raises(ValueError, match=r"tilt must have shape \(b, h_kv, d\) = \(1, 2, 4\)"):
        FS.cluster_sketch(*args, tilted, tilt=torch.zeros(1, 2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="tilt must be finite"):
        FS.cluster_sketch(*args, tilted, tilt=torch.full((1, 2, 4), math.nan, dtype=torch.float64))
    with pytest.raises(ValueError, match="tilt is for a tilted design"):
        FS.cluster_sketch(*args, FS.ClusterDesign(clusters=3), tilt=torch.zeros(1, 2, 4, dtype=torch.float64))
    a = FS.cluster_sketch(*args, tilted, tilt=torch.zeros(1, 2, 4, dtype=torch.float64))
    b = FS.cluster_sketch(*args, FS.ClusterDesign(clusters=3))
    assert FS.ClusterSketch.cat([a, a]).tilt.shape == (2, 2, 4)
    with pytest.raises(ValueError, match="must share the heads, C, d, rule, multiplier, tilt and reach"):
        FS.ClusterSketch.cat([a, b])
    K, V, P = _compact(k, v, pi, keep)
    bad = dataclasses.replace(a, zmean=a.zmean[..., :2])
    with pytest.raises(ValueError, match=r"sketch.zmean must have shape \(b, h_kv, C, d\) = \(1, 2, 3, 4\)"):
        FS.sketch_hajek_attention(T(np.ones((1, 2, 4))), T(K), T(V), T(P), bad)


def test_the_hull_bound_holds_for_every_draw_and_caps_a_far_query():
    """||o_hat - o|| <= hull_bound on every draw (a deterministic inequality: o and o_hat are convex
    combinations of the values), on heavy-tailed keys and values; a query far from the tilt point, whose
    Gaussian step explodes, gets the bound as its radius from evict_and_certify."""
    rng = np.random.default_rng(11)
    n, d, dv = 300, 8, 5
    k = rng.standard_t(2, size=(n, d))
    v = rng.standard_t(2, size=(n, dv)) * 3.0
    imp = rng.random(n) ** 4
    window = rng.normal(size=(6, d))
    tau = 1.0 / math.sqrt(d)
    worst = 0.0
    for seed in range(40):
        pi = R.inclusion_probabilities(imp, 60.0, sinks=2, window=4, floor=0.1)
        keep = R.poisson_sample(pi, seed=seed)
        sk = RS.cluster_sketch(k, v, pi, keep, RS.TILTED, tilt=window)
        assert sk.reach == pytest.approx(np.sqrt(np.max(np.sum((v[~keep] - v.mean(0)) ** 2, axis=1))), rel=1e-12)
        for q in (window.mean(0), rng.normal(size=d) * 4.0):
            o_hat = R.hajek_attention(q, k[keep], v[keep], pi[keep], scale=tau).output
            o = R.attention(q, k, v, scale=tau)
            hull = RS.hull_bound(v[keep], pi[keep], sk, output=o_hat)
            worst = max(worst, np.linalg.norm(o_hat - o) / hull)
    assert worst <= 1.0 + 1e-12
    # far from q0 the Gaussian step's radius exceeds the bound, and the design's radius is the bound
    q_far = window.mean(0) + 4.0 * rng.normal(size=d)
    r = RS.evict_and_certify(q_far, k, v, imp, 60.0, seed=0, design="tilted", tilt=window, sinks=2, window=4)
    pi = R.inclusion_probabilities(imp, 60.0 - RS.TILTED.elements(d, dv) / (d + dv + 1), sinks=2, window=4, floor=0.1)
    keep = R.poisson_sample(pi, seed=0)
    sk = RS.cluster_sketch(k, v, pi, keep, RS.TILTED, tilt=window)
    var = RS.cluster_variance(q_far, k[keep], v[keep], pi[keep], sk, output=r.output)
    hull = RS.hull_bound(v[keep], pi[keep], sk, output=r.output)
    rule = RS.radius_from_variance(var, delta=0.05, rule=RS.TILTED.radius, multiplier=RS.TILTED.multiplier)
    assert rule > hull and r.radius == hull
    assert np.linalg.norm(r.output - R.attention(q_far, k, v)) <= r.radius
    without = RS.ClusterSketch(**{**sk.__dict__, "reach": None})
    assert RS.hull_bound(v[keep], pi[keep], without, output=r.output) == math.inf
