"""The cluster design's test inputs, oracles and derived float32 check, shared by tests/test_fast_sketch.py
(the torch step) and tests/test_kernels_sketch.py (the Triton kernel); the tolerances are derived in
tests/test_fast_sketch.py's module docstring."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.special import logsumexp

from kvcert.fast import sketch as FS
from kvcert.reference import hajek_attention as ref_hajek
from kvcert.reference import sketch as RS
from support import assert_close, rounding

RTOL = 1e-12
RTOL_V = 1e-10
FLOAT32_CASES = [(113, 1, 6), (239, 3, 16), (64, 3, 1), (3, 3, 4)]


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


def _reference_rows(q, k, v, pi, keep, valid, design, *, out=None, t=None, labels=None, bound=False):
    """Per (b, h_q[, t]) the reference o_hat, V_cl, and the Hajek estimate (float64 numpy); ``labels``
    (b, h, n) the clusters to use (default: the reference's own k-means); ``bound``: each row also
    holds the reference's hull bound (``RS.hull_bound``, +inf where nothing is kept)."""
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
                row = (e, var)
                if bound:
                    row += (RS.hull_bound(v[bi, hi][kk], pi[bi, hi][kk], rsk, output=o),)
                res[(bi, hq) if t is None else (bi, hq, j)] = row
    return res


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




def with_error(step, field: str, units: float, n: int):
    """``step`` with one field of its result moved by ``units`` times the float32 rounding allowance
    ``rounding(float32, n)`` of its own value (``output`` by that share of its head's largest entry):
    the negative control of :func:`check_float32_step`, whose tolerances are a few such units."""
    import dataclasses

    rel = units * rounding(torch.float32, n)

    def wrong(*args, **kwargs):
        ce = step(*args, **kwargs)
        est = ce.estimate
        if field == "output":
            est = dataclasses.replace(est, output=est.output + rel * est.output.abs().amax(-1, keepdim=True))
        elif field == "trace":
            est = dataclasses.replace(est, trace=est.trace * (1 + rel))
        vcl = ce.cluster_variance * (1 + rel) if field == "cluster_variance" else ce.cluster_variance
        return dataclasses.replace(ce, estimate=est, cluster_variance=vcl, variance=torch.maximum(vcl, est.trace))

    return wrong


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
                            variance=ce.variance.cpu(), radius=ce.radius.cpu(), rule=ce.rule, delta=ce.delta,
                            cluster_variance=ce.cluster_variance.cpu())
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
        assert_close(f"V_cl32[{bi}, {hq}]", float(ce.cluster_variance[bi, hq]), want, tol)
        # the radius's variance is the larger of V_cl and the HT trace, elementwise as computed
        assert float(ce.variance[bi, hq]) == max(float(ce.cluster_variance[bi, hq]), float(ce.estimate.trace[bi, hq]))
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
