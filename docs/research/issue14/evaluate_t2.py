"""Issue 14 on the real model (T2 replay cells): sketched designs vs the paper design at equal memory.

Research script (not library code). Cells are paper_repro's T2 replay cells in quick-mode
sizes: SmolLM2-135M-Instruct reads 1792 + 32 tokens of pydoc text once
(``paper_repro.realmodel.capture``); at the end of the 1792-token prefix the cache of each
of the 30 x 3 KV heads is evicted; the 32 future tokens enter with pi = 1; a cell is
(layer, query head, future query at prefix + {0, 10, 20, 31}): 30 x 9 x 4 = 1080 cells per
(M, design). Importance: SnapKV from the last 32 prefix queries of the head's query group
(``kvcert.fast.SCORERS["snapkv"]`` as paper_repro's replay calls it, the "paper" design of T2).
Design: sinks 4, window 32, top slice = half the free budget (``kvcert.fast.design_sizes``
with top_fraction 0.5), floor 0.1. The paper and page designs use the top slice of the paper
budget (the page design as ``evict_and_certify`` does); the cluster and code designs re-size
it at their own smaller budget. The queries see the cache causally (a future query at
prefix + t sees the future tokens up to its own position).

Memory M is the paper design's expected memory, budget B = M L (d + dv) / (d + dv + 1)
(L = 1792 the evicted prefix, d = dv = 64). Sketched designs sample fewer tokens so that
their expected total memory (kept K+V + log pi + sketch) equals M; ``memory held`` is the
realized mean. Draws: ``--draws`` (default 256) independent Poisson samples per KV head,
shared by the head's 3 query heads and 4 query positions; the uniforms of draw s of KV
head c are ``design_uniforms(L, seed=c * draws + s)`` so ``poisson_sample(pi, seed=...)``
replays them. All designs of a KV head use the same uniforms (common random numbers).

Every row is a (sample design, variance, radius rule). Variances:
- ``trace``: the paper design's HT trace (docs/design.md section 2);
- ``oracle``: the true design variance V of the linearized Hajek error with the plug-in
  o_hat and the exact Z, on that row's own sample (needs the full cache: a ceiling, not a design);
- ``page``: V_bar of the page16 design (``page_code_designs.variance_bound``, this folder);
- ``cluster``: V_cl of a cluster design, ``--clusters C`` or ``C:theta`` (theta scales the
  Gaussian variance term; 1 = ``kvcert.reference.sketch.cluster_variance``);
- ``hybrid``: V_hybrid of a code design, ``--codes r8b4-lognormal-orthogonal``
  (``page_code_designs.hybrid_variance``, this folder).
Research rows ``--diffs C`` / ``C:tilt``: the difference estimator with a tilted C-cluster model
(:func:`difference_estimate`; variances ``ht``, ``oracle`` and, with ``:tilt``, ``tilted``); ``--check``
also checks that it is exact at q = q0.
The cluster and tilted rows cap each radius at the library's deterministic hull bound
(:func:`hull_cap`, ``kvcert.reference.sketch.hull_bound``; ``--no-hull`` leaves it out, as runs before
2026-12-04 did).
Radius rules (``--rules``): ``chebyshev`` sqrt(V / delta), ``gaussian`` z_{1-delta/2} sqrt(V),
``xC`` a fixed multiplier C sqrt(V).

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/evaluate_t2.py --draws 256 --clusters 8 16 \
        --codes r8b4-lognormal-orthogonal --oracle-all --rules chebyshev gaussian x1.5 x2.5 x3 \
        > docs/research/issue14/table_t2.md
    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue14/evaluate_t2.py --check   # vectorized == reference

The capture is cached in ``--cache`` (default ``kvcert_issue14_capture.pt`` in the system's temporary
folder, ``tempfile.gettempdir()``; ``--text-seed S`` captures another pydoc order, cached with a ``_seedS``
suffix, ``--full-size`` with ``_full``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy import stats

import page_code_designs as PC  # this folder: the page and code designs (research code)

import kvcert.fast as F
from kvcert import reference as R
from kvcert.fast import design_sizes
from kvcert.reference import certainty_mask, design_uniforms
from kvcert.reference import sketch as SK

DELTA = 0.05
MEMORIES = (0.15, 0.3, 0.55)
PREFIX, FUTURE, OFFSETS = 1792, 32, (0, 10, 20, 31)
SINKS, WINDOW, FLOOR, TOP_FRACTION = 4, 32, 0.1, 0.5
Z = float(stats.norm.ppf(1 - DELTA / 2))
RULES = {"chebyshev": 1 / np.sqrt(DELTA), "gaussian": Z, "x2.5": 2.5, "x3": 3.0}


def load_capture(path: Path, text_seed: int = 0):
    if path.exists():
        return torch.load(path)
    import kvcert
    from paper_repro.realmodel import capture, haystack_ids

    model, tok = kvcert.load_model()
    ids = haystack_ids(tok, PREFIX + FUTURE, seed=text_seed)
    c = capture(model, ids)
    data = dict(q=c.queries, k=c.keys, v=c.values, scaling=c.scaling)
    torch.save(data, path)
    return data


def default_cache(text_seed: int = 0, full_size: bool = False) -> Path:
    """Where the capture is cached by default: the system's temporary folder."""
    tail = "" if text_seed == 0 else f"_seed{text_seed}"
    return Path(tempfile.gettempdir()) / f"kvcert_issue14_capture{'_full' if full_size else ''}{tail}.pt"


def importance_of_layer(cap, layer, window: int = WINDOW):
    """SnapKV importance (h_kv, PREFIX) over the prefix of one layer, float64: the registered scorer
    (``kvcert.fast.SCORERS["snapkv"]``, float32) on the prefix queries it reads (the last ``window``), as
    paper_repro's replay computes the "paper" design's importance."""
    q, k, v = cap["q"][layer], cap["k"][layer], cap["v"][layer]
    scorer = F.SCORERS["snapkv"]
    need = scorer.queries_read(PREFIX, PREFIX, window)
    params = {"seed": layer} if "seed" in scorer.params else {}
    u = scorer(q[None, :, PREFIX - need:PREFIX], k[None, :, :PREFIX], v[None, :, :PREFIX], scale=cap["scaling"],
               **params)
    return u[0].double().numpy()


# ----------------------------------------------------------------------------- one KV head, vectorized


class Head:
    """One KV head's cells: exact attention of its m = g x |OFFSETS| future queries."""

    def __init__(self, q, k, v, u, tau):
        self.k, self.v, self.u, self.tau = k, v, u, tau
        self.q = q                                       # (m, d)
        T = k.shape[0]
        lim = np.tile(PREFIX + np.asarray(OFFSETS), q.shape[0] // len(OFFSETS))
        s = tau * q @ k.T
        s[np.arange(T)[None, :] > lim[:, None]] = -np.inf
        self.s = s                                       # (m, T) true scores, -inf where masked
        self.smax = s.max(1, keepdims=True)
        self.E = np.exp(s - self.smax)                   # (m, T)
        self.Z = self.E.sum(1)
        self.o = self.E @ v / self.Z[:, None]            # (m, dv) exact output
        self.onorm = np.linalg.norm(self.o, axis=1)
        self.vn2 = (v ** 2).sum(1)

    def sample(self, pi, U):
        """keep (D, L) from the shared uniforms, and the Hajek estimate over kept prefix + future."""
        keep = U < pi[None, :]
        pif = np.concatenate([pi, np.ones(FUTURE)])
        kf = np.concatenate([keep, np.ones((keep.shape[0], FUTURE), bool)], axis=1)
        W = kf[:, None, :] * (self.E / pif)[None]        # (D, m, T)
        Zh = W.sum(-1)
        A = W / Zh[..., None]
        oh = A @ self.v                                  # (D, m, dv)
        return keep, pif, kf, A, oh

    def quad(self, B, oh):
        """sum_t B_t ||v_t - oh||^2 for weights B (D, m, T) (or (m, T))."""
        return B @ self.vn2 - 2 * np.einsum("...j,...j->...", oh, B @ self.v) + (oh ** 2).sum(-1) * B.sum(-1)


def trace_variance(head, pif, A, oh):
    return head.quad((1 - pif) * A ** 2, oh)


def oracle_variance(head, pif, oh):
    b = (1 - pif) / pif * head.E ** 2 / head.Z[:, None] ** 2
    return head.quad(b, oh)


def page_variance(head, pi, keep, kf, oh, P=16):
    """V_bar of the page design for every draw (vectorized ``reference.sketch.variance_bound``)."""
    L = PREFIX
    k, v = head.k[:L], head.v[:L]
    D = keep.shape[0]
    G = -(-L // P)
    pad = G * P - L
    gone = ~keep
    kp = np.concatenate([k, np.zeros((pad, k.shape[1]))]).reshape(G, P, -1)
    gp = np.concatenate([gone, np.zeros((D, pad), bool)], axis=1).reshape(D, G, P)
    kmin = np.where(gp[..., None], kp[None], np.inf).min(2)       # (D, G, d)
    kmax = np.where(gp[..., None], kp[None], -np.inf).max(2)
    has = gp.any(2)                                                # (D, G)
    kmin = np.where(has[..., None], kmin, 0.0)
    kmax = np.where(has[..., None], kmax, 0.0)
    qp, qn = np.maximum(head.q, 0), np.maximum(-head.q, 0)
    up = head.tau * (np.einsum("dgc,mc->dmg", kmax, qp) - np.einsum("dgc,mc->dmg", kmin, qn))
    lo = head.tau * (np.einsum("dgc,mc->dmg", kmin, qp) - np.einsum("dgc,mc->dmg", kmax, qn))
    mu = v.mean(0)
    nu = np.linalg.norm(v - mu, axis=1)
    nup = np.concatenate([nu, np.zeros(pad)]).reshape(G, P)
    rho = np.where(gp, nup[None], 0.0).max(2)
    pip = np.concatenate([pi, np.ones(pad)]).reshape(G, P)
    mpi = np.where(gp, pip[None], 1.0).min(2)
    cnt = gp.sum(2)
    # in units of exp(s - smax), like head.E
    Elo = np.exp(lo - head.smax[None]) * (cnt * has)[:, None, :]
    Eup2 = np.exp(2 * (up - head.smax[None])) * (cnt * has)[:, None, :]
    Zlo = (kf[:, None, :] * head.E[None]).sum(-1) + Elo.sum(-1)
    kept_term = head.quad(kf[:, None, :] * ((1 - np.concatenate([pi, np.ones(FUTURE)])) /
                                             np.concatenate([pi, np.ones(FUTURE)]) * head.E ** 2)[None], oh)
    a = np.linalg.norm(mu - oh, axis=-1)                           # (D, m)
    rg = rho[:, None, :] + a[..., None]
    page_term = (Eup2 * ((1 - mpi) / mpi)[:, None, :] * rg ** 2).sum(-1)
    return (kept_term + page_term) / Zlo ** 2, has.sum(1)


def hybrid_variance(head, pi, keep, kf, oh, sk):
    """V_hybrid for every draw (vectorized ``reference.sketch.hybrid_variance``): exact kept terms,
    sketched evicted terms; Z = kept exact + evicted sketched. ``sk`` sketches every prefix token
    (the codes do not depend on the sample); the draw's mask picks the evicted ones."""
    pif = np.concatenate([pi, np.ones(FUTURE)])
    sc = PC.code_scores(head.q, sk, scale=head.tau)                   # (m, L)
    Ehat2 = np.exp(2 * (sc["square"] - head.smax))
    Ehat1 = np.exp(sc["first"] - head.smax)
    gone = ~keep
    kept_term = head.quad(kf[:, None, :] * ((1 - pif) / pif * head.E ** 2)[None], oh)
    Zh = (kf[:, None, :] * head.E[None]).sum(-1) + gone.astype(float) @ Ehat1.T        # (D, m)
    B = gone[:, None, :] * ((1 - sk.pi) / sk.pi * Ehat2)[None]                          # (D, m, L)
    a2 = ((oh - sk.mu) ** 2).sum(-1)
    nu = sk.value_norm
    if sk.value_rule == "triangle":
        ev = B @ nu ** 2 + 2 * np.sqrt(a2) * (B @ nu) + a2 * B.sum(-1)
    else:  # "orthogonal"
        ev = B @ nu ** 2 + a2 * B.sum(-1)
    return (kept_term + ev) / Zh ** 2


def calibrated_theta(head, qw, w, gone, idx, mean, var, how):
    """Per draw, the factor theta_c of the cluster's variance term calibrated on the observation window.

    For each window query q_j (known at eviction: the scorer reads them), the theta that makes the
    Gaussian moment term exact on this cluster's evicted tokens,
    W_c exp(2 tau q_j.m_c + 2 theta tau^2 q_j^2.sigma^2_c) = sum_{U_c} w_i exp(2 tau q_j.k_i),
    i.e. theta_j = (log(S_j / W_c) - 2 tau q_j.m_c) / (2 tau^2 q_j^2.sigma^2_c) >= 0 (Jensen); then a
    quantile of theta_j over the window (``how``: a float in [0, 1], 1 = the max). One scalar per
    cluster (memory C). Returns (D,)."""
    tau = head.tau
    sw = 2 * tau * qw @ head.k[idx].T                                   # (J, |idx|)
    top = sw.max(1, keepdims=True)
    Ew = np.exp(sw - top) * w[idx][None, :]                             # (J, |idx|)
    S = gone[:, idx] @ Ew.T                                             # (D, J)
    W = gone[:, idx] @ w[idx]                                           # (D,)
    with np.errstate(divide="ignore", invalid="ignore"):
        logratio = np.log(S) + top.T - np.log(W)[:, None]               # log(S_j / W_c)
        lin = 2 * tau * mean @ qw.T                                     # (D, J)
        den = 2 * tau ** 2 * var @ (qw ** 2).T                          # (D, J)
        th = np.where(den > 0, (logratio - lin) / den, 0.0)
    th = np.where(np.isfinite(th), np.maximum(th, 0.0), 0.0)
    return np.quantile(th, how, axis=1)


def hull_cap(head, keep, kf):
    """The library's hull bound (``kvcert.reference.sketch.hull_bound``) for every draw and query, (D, m):
    ||o_hat - mu|| + max(rho_U, max_S ||v_i - c|| + ||c - mu||), mu the prefix's mean value (the sketch's),
    rho_U the evicted values' largest distance to it, c the mean of the values query j attends (kept prefix
    and future tokens up to its position). Returns a function of o_hat (D, m, dv)."""
    v = head.v
    L = keep.shape[1]
    mu = v[:L].mean(0)
    nu2 = ((v[:L] - mu) ** 2).sum(1)
    reach = np.sqrt(np.where(~keep, nu2[None], 0.0).max(1))                   # (D,)
    m = head.q.shape[0]
    lim = np.tile(PREFIX + np.asarray(OFFSETS), m // len(OFFSETS))
    vis = np.arange(v.shape[0])[None, :] <= lim[:, None]                       # (m, T)
    S = (kf[:, None, :] & vis[None]).astype(float)                             # (D, m, T)
    c = (S @ v) / S.sum(-1, keepdims=True)                                     # (D, m, dv)
    d2 = head.vn2[None, None] - 2 * c @ v.T + (c ** 2).sum(-1, keepdims=True)  # (D, m, T)
    inside = np.sqrt(np.maximum(np.where(S > 0, d2, 0.0).max(-1), 0.0)) + np.linalg.norm(c - mu, axis=-1)
    far = np.maximum(reach[:, None], inside)
    return lambda oh: np.linalg.norm(oh - mu, axis=-1) + far


def _evicted_inputs(head, pi, keep):
    """What every sketched variance reads of one head's prefix: its keys, pi with the future tokens
    (pi = 1), the evicted indicator (D, L), w = (1 - pi)/pi, the value centre mu and nu^2."""
    k, v = head.k[:PREFIX], head.v[:PREFIX]
    mu = v.mean(0)
    return (k, np.concatenate([pi, np.ones(FUTURE)]), (~keep).astype(float), (1 - pi) / pi, mu,
            ((v - mu) ** 2).sum(1))


def _hybrid(head, kf, oh, pif, mu, z_evicted, v_mass, y_mass):
    """V_hyb from the evicted sums a sketch estimates, each (D, m), scaled by e^{-smax} (Z) or e^{-2 smax}:
    Z~ = kept + z_evicted; numerator = exact kept terms + y_mass + ||mu - o_hat||^2 v_mass."""
    Zh = (kf[:, None, :] * head.E[None]).sum(-1) + z_evicted
    kept_term = head.quad(kf[:, None, :] * ((1 - pif) / pif * head.E ** 2)[None], oh)
    a2 = ((oh - mu) ** 2).sum(-1)                                    # (D, m)
    return (kept_term + y_mass + a2 * v_mass) / Zh ** 2


def cluster_variance(head, pi, keep, kf, oh, labels, C, theta=1.0, qw=None):
    """V_cl for every draw (vectorized ``reference.sketch.cluster_variance``); ``theta`` a float, or
    ``("cal", quantile)`` with the window queries ``qw`` for :func:`calibrated_theta`."""
    k, pif, gone, w, mu, nu2 = _evicted_inputs(head, pi, keep)
    D, m = keep.shape[0], head.q.shape[0]
    lin = np.zeros((D, m, C)); quad = np.zeros((D, m, C))
    W = np.zeros((D, C)); Y = np.zeros((D, C)); N = np.zeros((D, C))
    for c in range(C):
        idx = np.flatnonzero(labels == c)
        if idx.size == 0:
            continue
        gc = gone[:, idx]
        W[:, c] = gc @ w[idx]; Y[:, c] = gc @ (w * nu2)[idx]; N[:, c] = gc.sum(1)
        Ws = np.where(W[:, c] > 0, W[:, c], 1.0)[:, None]
        mean = gc @ (w[idx, None] * k[idx]) / Ws
        var = np.maximum(gc @ (w[idx, None] * k[idx] ** 2) / Ws - mean ** 2, 0.0)
        lin[:, :, c] = head.tau * mean @ head.q.T
        th = calibrated_theta(head, qw, w, gone, idx, mean, var, theta[1])[:, None] if isinstance(theta, tuple) \
            else theta
        quad[:, :, c] = th * head.tau ** 2 * var @ (head.q ** 2).T
    sm = head.smax[None]                                             # (1, m, 1)
    e2 = np.exp(2 * lin + 2 * quad - 2 * sm)
    return _hybrid(head, kf, oh, pif, mu, (N[:, None, :] * np.exp(lin + quad / 2 - sm)).sum(-1),
                   (W[:, None, :] * e2).sum(-1), (Y[:, None, :] * e2).sum(-1))


def tilted_variance(head, pi, keep, kf, oh, labels, C, qw, per_head: bool, theta: float = 1.0, zhat: bool = False,
                    vmean: bool = False, cap: bool = False):
    """V with the evicted part from per-cluster moments *tilted* at a window query q0 (research variant).

    For each cluster c and tilt point q0 (the mean observation-window query of the query head, or of
    the KV head's group), the sketch keeps, over the cluster's evicted tokens U_c, the tilted masses
    and moments for the squares (weights w_i e^{2 tau q0.k_i}: S0, its mean key and per-channel
    variance, and Y0 = sum w_i nu_i^2 e^{2 tau q0.k_i}) and for Z (weights e^{tau q0.k_i}: N0, mean, var).
    At a query q, with r = q - q0, the Gaussian moment step is taken on the tilted distribution:
    sum_{U_c} w_i e^{2 tau q.k_i} ~ S0 exp(2 tau r.m~ + 2 tau^2 r^2.s~^2), small when q is near q0,
    where the untilted step (around q = 0) explodes. Returns (D, m)."""
    tau = head.tau
    k, pif, gone, w, mu, nu2 = _evicted_inputs(head, pi, keep)
    D, m = keep.shape[0], head.q.shape[0]
    g = m // len(OFFSETS)
    qwh = qw.reshape(g, -1, qw.shape[-1]).mean(1)                     # (g, d) mean window query per head
    q0 = np.repeat(qwh, len(OFFSETS), axis=0) if per_head else np.repeat(qwh.mean(0, keepdims=True), m, axis=0)
    r = head.q - q0                                                 # (m, d)
    logV = np.full((D, m, C), -np.inf)
    logY = np.full((D, m, C), -np.inf)
    logZ = np.full((D, m, C), -np.inf)
    cross = np.zeros((D, m, head.v.shape[1]))                       # vmean: sum_c e^{..} sum_U w e^{2s} (v - mu)
    vc = head.v[:PREFIX] - mu
    for c in range(C):
        idx = np.flatnonzero(labels == c)
        if idx.size == 0:
            continue
        gc = gone[:, idx]                                           # (D, |idx|)
        kc = k[idx]
        reach = None
        for tilt, out_mass, out_y, weight in ((2.0, logV, logY, w[idx]), (1.0, logZ, None, np.ones(idx.size)))[
                :1 if zhat else 2]:
            e = tilt * tau * q0 @ kc.T                                # (m, |idx|)
            top = e.max(1, keepdims=True)
            om = np.exp(e - top) * weight[None, :]                   # (m, |idx|)
            G = gc[:, None, :] * om[None, :, :]                      # (D, m, |idx|)
            S0 = G.sum(-1)                                          # (D, m)
            with np.errstate(divide="ignore", invalid="ignore"):
                mean = (G @ kc) / S0[..., None]
                var = np.maximum((G @ kc ** 2) / S0[..., None] - mean ** 2, 0.0)
                th = theta
                if isinstance(theta, tuple):  # ("cal", quantile): theta_c from the window's exact sums
                    rw = qw - q0[0]                                   # (J, d), the group's tilt point
                    ew = tilt * tau * qw @ kc.T                       # (J, |idx|)
                    tw = ew.max(1, keepdims=True)
                    Sw = gc @ (np.exp(ew - tw) * weight[None, :]).T   # (D, J), scaled by e^{-tw}
                    log_ratio = np.log(Sw) + tw.T - np.log(S0[:, :1]) - top[0, 0]
                    lin_w = tilt * tau * mean[:, 0] @ rw.T            # (D, J)
                    den = 0.5 * tilt ** 2 * tau ** 2 * var[:, 0] @ (rw ** 2).T
                    thj = np.where(den > 0, (log_ratio - lin_w) / den, 0.0)
                    thj = np.where(np.isfinite(thj), np.maximum(thj, 0.0), 0.0)
                    th = np.quantile(thj, theta[1], axis=1)[:, None]  # (D, 1)
                expo = tilt * tau * (r[None] * mean).sum(-1) \
                    + th * 0.5 * tilt ** 2 * tau ** 2 * (r[None] ** 2 * var).sum(-1)
                if cap:  # deterministic cap: max over U_c of r.k <= r.m~ + |r| R_c, R_c = max ||k_i - m~_c||
                    if reach is None:                               # the first pass is the squares' (m~)
                        centre = mean                                # (D, m, d)
                        dist = np.linalg.norm(kc[None] - centre[:, :1], axis=-1)   # (D, |idx|), row 0's tilt
                        reach = np.where(gc > 0, dist, 0.0).max(1)   # (D,)
                    bound = tilt * tau * ((r[None] * centre).sum(-1) + np.linalg.norm(r, axis=1)[None] * reach[:, None])
                    expo = np.minimum(expo, bound)
                live = S0 > 0                                       # a cluster with nothing evicted: no term
                out_mass[:, :, c] = np.where(live, np.log(S0) + top.T + expo, -np.inf)
                if out_y is not None:
                    Y0 = gc @ (om * nu2[idx][None, :]).T
                    out_y[:, :, c] = np.where(live & (Y0 > 0), np.log(Y0) + top.T + expo, -np.inf)
                    if vmean:  # the tilted mean value offset, scaled like the masses (e^{-2 smax} below)
                        X = G @ vc[idx]                               # (D, m, dv)
                        cross += np.where(live[..., None], X * np.exp(top.T + expo - 2 * head.smax[:, 0][None])[..., None],
                                          0.0)
    sm = head.smax[None]                                            # (1, m, 1)
    if zhat:  # research: no Z moments; the evicted part of Z from the kept tokens, sum_S e^s (1 - pi)/pi
        z_ev = (kf[:, None, :] * ((1 - pif) / pif * head.E)[None]).sum(-1)
    else:
        z_ev = np.exp(logZ - sm).sum(-1)
    y_mass = np.exp(logY - 2 * sm).sum(-1)
    if vmean:  # ||v - o||^2 = nu^2 + 2 (v - mu).(mu - o) + ||mu - o||^2: the middle term from the tilted mean
        y_mass = y_mass + 2 * np.einsum("dmv,dmv->dm", cross, mu[None, None] - oh)
    return _hybrid(head, kf, oh, pif, mu, z_ev, np.exp(logV - 2 * sm).sum(-1), y_mass)


def difference_estimate(head, pi, keep, kf, labels, C, qw):
    """The *difference estimator* with a tilted cluster model (research): returns o_DE (D, m, dv), the HT
    estimate of its variance from the kept tokens (D, m) and its true design variance (D, m).

    Model of token i's weight at a query q (r = q - q0): g_i = exp(tau q0.k_i + tau r.m_c), m_c the cluster's
    evicted-token mean key under the weights e^{tau q0.k}. The sketch keeps, per cluster, m_c (d), the mass
    B_c = sum_{U_c} e^{tau q0.k_i} (1) and X_c = sum_{U_c} e^{tau q0.k_i} v_i (dv), and q0 (d) per head; a kept
    token keeps tau q0.k_i and its label. Then sum_U g_i = sum_c B_c e^{tau r.m_c} and sum_U g_i v_i =
    sum_c X_c e^{tau r.m_c} exactly, and
        Z_DE = sum_all g_i + sum_S (a_i - g_i) / pi_i,   N_DE = sum_all g_i v_i + sum_S (a_i - g_i) v_i / pi_i,
    design-unbiased for Z and N whatever the model; o_DE - o = sum_i (I_i / pi_i - 1)(a_i - g_i)(v_i - o) / Z_DE
    exactly, so its variance is the HT variance of the residuals a_i - g_i, estimated from the kept tokens
    without bias. g_i = a_i at q = q0 for every token."""
    tau = head.tau
    L = keep.shape[1]
    k, v = head.k[:L], head.v[:L]
    D, m = keep.shape[0], head.q.shape[0]
    q0 = qw.mean(0)
    r = head.q - q0                                                  # (m, d)
    e0 = tau * k @ q0                                               # (L,)
    top0 = e0.max()
    w0 = np.exp(e0 - top0)
    gone = (~keep).astype(float)
    phase = np.zeros((D, m, C))
    logmass = np.full((D, m, C), -np.inf)
    XU = np.zeros((D, m, v.shape[1]))
    sm = head.smax[:, 0]                                            # (m,)
    for c in range(C):
        idx = np.flatnonzero(labels == c)
        if idx.size == 0:
            continue
        Bc = gone[:, idx] @ w0[idx]                                 # (D,)
        with np.errstate(invalid="ignore", divide="ignore"):
            mc = np.where(Bc[:, None] > 0, (gone[:, idx] * w0[idx]) @ k[idx] / Bc[:, None], k[idx].mean(0))
        phase[:, :, c] = tau * mc @ r.T                                # (D, m)
        with np.errstate(divide="ignore"):
            logmass[:, :, c] = np.log(Bc)[:, None] + top0 + phase[:, :, c] - sm[None]
        Xc = (gone[:, idx] * w0[idx]) @ v[idx]                      # (D, dv), scaled by e^{-top0}
        XU += Xc[:, None, :] * np.exp(top0 + phase[:, :, c] - sm[None])[..., None]
    g = np.exp(e0[None, None, :] + np.take_along_axis(phase, np.broadcast_to(labels[None, None, :], (D, m, L)), 2)
               - sm[None, :, None])                                  # (D, m, L), scaled by e^{-smax}
    a = head.E[:, :L][None]                                          # (1, m, L)
    kp = keep[:, None, :]
    corr = kp * (1 - 1 / pi)[None, None, :] * g                     # sum_S (1 - 1/pi) g_i, per token
    W = kf[:, None, :] * (head.E / np.concatenate([pi, np.ones(head.E.shape[1] - L)]))[None]
    Zd = W.sum(-1) + corr.sum(-1) + np.exp(logmass).sum(-1)
    Nd = W @ head.v + corr @ v + XU
    od = Nd / Zd[..., None]
    res2 = (a - g) ** 2                                              # (D, m, L)
    pad = np.zeros((D, m, head.E.shape[1] - L))
    b_ht = np.concatenate([kp * ((1 - pi) / pi ** 2)[None, None, :] * res2, pad], -1)
    b_or = np.concatenate([((1 - pi) / pi)[None, None, :] * res2, pad], -1)
    V_ht = head.quad(b_ht, od) / Zd ** 2
    V_or = head.quad(b_or, od) / head.Z[None, :] ** 2
    # V~: the kept tokens' residual terms exactly, the evicted ones from the tilted sketch's squares moments
    # (weights w e^{2 tau q0.k}: mass S0, mean m~, variance s~^2, Y0 = sum w e^{2 tau q0.k} nu^2): with
    # x = tau r.(k - m_c) ~ N(tau r.(m~ - m_c), tau^2 r^2.s~^2), sum_U w (a - g)^2 ||v - o||^2 ~
    # e^{2 tau r.m_c} E[(e^x - 1)^2] (Y0 + S0 ||mu - o_hat||^2) (the orthogonal value rule).
    mu = v.mean(0)
    nu2 = ((v - mu) ** 2).sum(1)
    wgt = (1 - pi) / pi
    e2 = 2 * e0
    top2 = e2.max()
    om = wgt * np.exp(e2 - top2)
    a2 = ((od - mu) ** 2).sum(-1)                                    # (D, m)
    ev = np.zeros((D, m))
    for c in range(C):
        idx = np.flatnonzero(labels == c)
        if idx.size == 0:
            continue
        G = gone[:, idx] * om[idx]                                  # (D, |idx|)
        S0 = G.sum(1)
        live = S0 > 0
        S0s = np.where(live, S0, 1.0)
        mt = G @ k[idx] / S0s[:, None]
        st = np.maximum(G @ k[idx] ** 2 / S0s[:, None] - mt ** 2, 0.0)
        Y0 = G @ nu2[idx]
        mc_phase = phase[:, :, c]                                    # tau r.m_c, (D, m)
        mx = tau * mt @ r.T - mc_phase                              # (D, m)
        sx = tau ** 2 * st @ (r ** 2).T
        F = np.exp(2 * mx + 2 * sx) - 2 * np.exp(mx + sx / 2) + 1
        ev += np.where(live[:, None], np.exp(top2 + 2 * mc_phase - 2 * sm[None]) * F
                       * (Y0[:, None] + S0[:, None] * a2), 0.0)
    kept_terms = np.concatenate([kp * wgt[None, None, :] * res2, pad], -1)
    V_sk = (head.quad(kept_terms, od) + ev) / Zd ** 2
    return od, V_ht, V_or, Zd, V_sk


def parse_code(name):
    """``r8b4-lognormal-orthogonal`` -> CodeDesign(rank=8, bits=4, score=..., value=...)."""
    rb, score, value = name.split("-")
    r, b = rb[1:].split("b")
    return PC.CodeDesign(rank=int(r), bits=int(b), score=score, value=value)


def code_budget(B, n, d, dv, design):
    """Expected kept count at equal expected memory (``page_code_designs.code_budget``)."""
    return PC.code_budget(B, n, d, dv, design)


# ----------------------------------------------------------------------------- the run


def run(args):
    t0 = time.perf_counter()
    zmin = []       # min Z_DE / Z per head (--diffs)
    trust_far = []  # the share of each head's future queries beyond the trust radius (":trust")
    cap = load_capture(Path(args.cache), args.text_seed)
    tau = float(cap["scaling"])
    layers = range(0, 30, args.layer_step)
    h_kv = cap["k"][0].shape[0]
    g = cap["q"][0].shape[0] // h_kv
    d = cap["k"][0].shape[-1]
    dv = cap["v"][0].shape[-1]
    L, T = PREFIX, PREFIX + FUTURE
    codes = {name: parse_code(name) for name in args.codes}
    res = {}   # (M, design, variance, rule) -> list of (err (D,), radius (D,), onorm, mem (D,))
    for layer in layers:
        U_layer = importance_of_layer(cap, layer)
        for h in range(h_kv):
            cid = layer * h_kv + h
            U = np.stack([design_uniforms(L, seed=cid * args.draws + s) for s in range(args.draws)])
            k = cap["k"][layer][h, :T].double().numpy()
            v = cap["v"][layer][h, :T].double().numpy()
            q = cap["q"][layer][h * g:(h + 1) * g][:, [L + o for o in OFFSETS]].double().numpy().reshape(-1, d)
            head = Head(q, k, v, U_layer[h], tau)
            u = U_layer[h]
            labels = {}
            for M in MEMORIES:
                B = M * L * (d + dv) / (d + dv + 1)
                sz = design_sizes(B, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION)
                kw = dict(sinks=sz.sinks, window=sz.window, top=sz.top, floor=FLOOR)
                certain = certainty_mask(u, sinks=sz.sinks, window=sz.window, top=sz.top)

                def add(design, var_name, V, keep, extra_mem, cap=None):
                    kept = keep.sum(1)
                    mem = (kept * (d + dv + 1) + extra_mem(keep)) / (L * (d + dv))
                    for rule, c in RULES.items():
                        rad = c * np.sqrt(np.maximum(V, 0))
                        if cap is not None:  # the cluster designs' radius: min(rule, hull bound)
                            rad = np.minimum(rad, cap)
                        for j in range(V.shape[1]):
                            res.setdefault((M, design, var_name, rule), []).append(
                                (err[:, j], rad[:, j], head.onorm[j], mem))

                pi = R.inclusion_probabilities(u, B, **kw)
                keep, pif, kf, A, oh = head.sample(pi, U)
                err = np.linalg.norm(oh - head.o, axis=-1)
                add("paper", "trace", trace_variance(head, pif, A, oh), keep, lambda kp: 0.0)
                add("paper", "oracle", oracle_variance(head, pif, oh), keep, lambda kp: 0.0)
                if args.page:
                    pages = PC.sketch_pages(certain, 16)
                    pi = R.inclusion_probabilities(u, PC.sketch_budget(B, L, d, dv, pages=pages), **kw)
                    keep, pif, kf, A, oh = head.sample(pi, U)
                    err = np.linalg.norm(oh - head.o, axis=-1)
                    Vb, G = page_variance(head, pi, keep, kf, oh, P=16)
                    add("page16", "page", Vb, keep,
                        lambda kp, G=G: G * (2 * d + PC.PAGE_SCALARS) + dv * (G > 0))
                for spec in args.clusters:
                    C, theta = (int(spec.split(":")[0]), spec.split(":")[1]) if ":" in spec else (int(spec), 1.0)
                    theta = ("cal", float(theta[3:])) if isinstance(theta, str) and theta.startswith("cal") \
                        else float(theta)
                    cl = SK.ClusterDesign(clusters=C)
                    b = B - cl.elements(d, dv) / (d + dv + 1)
                    kw2 = dict(kw, top=design_sizes(b, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION).top)
                    pi = R.inclusion_probabilities(u, b, **kw2)
                    keep, pif, kf, A, oh = head.sample(pi, U)
                    err = np.linalg.norm(oh - head.o, axis=-1)
                    if C not in labels:
                        labels[C] = SK.kmeans_assign(k[:L], C, iterations=cl.iterations)
                    ce = cl.elements(d, dv)
                    if isinstance(theta, tuple):
                        ce += C                                     # theta_c, one scalar per cluster
                    qw = cap["q"][layer][h * g:(h + 1) * g][:, L - 32:L].double().numpy().reshape(-1, d)
                    add(f"cl{spec}", "cluster", cluster_variance(head, pi, keep, kf, oh, labels[C], C, theta, qw),
                        keep, lambda kp, ce=ce: ce, cap=hull_cap(head, keep, kf)(oh) if args.hull else None)
                    if args.oracle_all:
                        add(f"cl{spec}", "oracle", oracle_variance(head, pif, oh), keep, lambda kp, ce=ce: ce)
                for spec in args.tilts:
                    parts = spec.split(":")
                    # ":cap": each step capped at tau (r.m~ + |r| R_c), R_c = max ||k_i - m~_c|| (research)
                    zhat, vmean, capped, trust = ("zhat" in parts, "vmean" in parts, "cap" in parts,
                                                  "trust" in parts)
                    parts = [x for x in parts if x not in ("zhat", "vmean", "cap", "trust")]
                    C, mode = int(parts[0]), parts[1]
                    theta = 1.0 if len(parts) < 3 else (("cal", float(parts[2][3:]) if len(parts[2]) > 3 else 1.0)
                                                         if parts[2].startswith("cal") else float(parts[2]))
                    per_head = mode == "head"
                    # the library's count (ClusterDesign(tilt=True).elements: C (4d + 4) + d + dv + 1), per query head
                    # for the research variant C:head
                    tilted_design = SK.ClusterDesign(clusters=C, tilt=True)
                    te = tilted_design.elements(d, dv) + (g - 1) * (tilted_design.elements(d, dv) - dv) * per_head
                    if isinstance(theta, tuple):
                        te += C                                     # theta_c, one scalar per cluster
                    if zhat:  # no Z-side moments (2d + 1 per cluster and tilt point)
                        te -= (g if per_head else 1) * C * (2 * d + 1)
                    if vmean:  # the tilted mean value (dv per cluster and tilt point)
                        te += (g if per_head else 1) * C * dv
                    if capped:  # R_c, one scalar per cluster and tilt point
                        te += (g if per_head else 1) * C
                    if trust:  # the trust radius rho, one scalar per head
                        te += 1
                    b = B - te / (d + dv + 1)
                    kw2 = dict(kw, top=design_sizes(b, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION).top)
                    pi = R.inclusion_probabilities(u, b, **kw2)
                    keep, pif, kf, A, oh = head.sample(pi, U)
                    err = np.linalg.norm(oh - head.o, axis=-1)
                    if C not in labels:
                        labels[C] = SK.kmeans_assign(k[:L], C, iterations=10)
                    qw = cap["q"][layer][h * g:(h + 1) * g][:, L - 32:L].double().numpy().reshape(-1, d)
                    Vt = tilted_variance(head, pi, keep, kf, oh, labels[C], C, qw, per_head, theta, zhat, vmean, capped)
                    if trust:  # beyond the window's spread around q0, the paper design's HT trace instead
                        q0 = qw.mean(0)
                        rho = np.linalg.norm(qw - q0, axis=1).max()
                        far = np.linalg.norm(head.q - q0, axis=1) > rho          # (m,)
                        Vt = np.where(far[None, :], trace_variance(head, pif, A, oh), Vt)
                        trust_far.append(far.mean())
                    add(f"tilt{spec}", "tilted", Vt, keep, lambda kp, te=te: te,
                        cap=hull_cap(head, keep, kf)(oh) if args.hull else None)
                for spec in args.diffs:
                    C, tilt_de = int(str(spec).split(":")[0]), str(spec).endswith(":tilt")
                    # per head: C (d + dv + 1) + d; per kept token two more scalars (tau q0.k_i and its label)
                    de = C * (d + dv + 1) + d
                    b = (B * (d + dv + 1) - de) / (d + dv + 3)
                    kw2 = dict(kw, top=design_sizes(b, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION).top)
                    pi = R.inclusion_probabilities(u, b, **kw2)
                    keep, pif, kf, A, oh = head.sample(pi, U)
                    if C not in labels:
                        labels[C] = SK.kmeans_assign(k[:L], C, iterations=10)
                    qw = cap["q"][layer][h * g:(h + 1) * g][:, L - 32:L].double().numpy().reshape(-1, d)
                    if tilt_de:  # + the tilted sketch's squares moments: C (2d + 2) more
                        de += C * (2 * d + 2)
                        b = (B * (d + dv + 1) - de) / (d + dv + 3)
                        kw2 = dict(kw, top=design_sizes(b, sinks=SINKS, window=WINDOW,
                                                        top_fraction=TOP_FRACTION).top)
                        pi = R.inclusion_probabilities(u, b, **kw2)
                        keep, pif, kf, A, oh = head.sample(pi, U)
                    od, Vht, Vor, Zd, Vsk = difference_estimate(head, pi, keep, kf, labels[C], C, qw)
                    zmin.append(float((Zd / head.Z[None]).min()))
                    err = np.linalg.norm(od - head.o, axis=-1)
                    add(f"de{C}", "ht", Vht, keep, lambda kp, de=de: de + 2 * kp.sum(1))
                    add(f"de{C}", "oracle", Vor, keep, lambda kp, de=de: de + 2 * kp.sum(1))
                    if tilt_de:
                        add(f"de{C}", "tilted", Vsk, keep, lambda kp, de=de: de + 2 * kp.sum(1))
                for name, cd in codes.items():
                    b = code_budget(B, L, d, dv, cd)
                    kw2 = dict(kw, top=design_sizes(b, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION).top)
                    pi = R.inclusion_probabilities(u, b, **kw2)
                    keep, pif, kf, A, oh = head.sample(pi, U)
                    err = np.linalg.norm(oh - head.o, axis=-1)
                    sk = PC.code_sketch(k[:L], v[:L], pi, np.zeros(L, bool), cd)
                    c_tok, c_head = cd.token_bits(dv) / 16.0, cd.head_elements(d, dv)
                    xm = (lambda kp, c_tok=c_tok, c_head=c_head: (L - kp.sum(1)) * c_tok + c_head)
                    add(name, "hybrid", hybrid_variance(head, pi, keep, kf, oh, sk), keep, xm)
                    if args.oracle_all:
                        add(name, "oracle", oracle_variance(head, pif, oh), keep, xm)
        print(f"[t2] layer {layer} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if zmin:
        print(f"[t2] difference estimator: min Z_DE / Z {min(zmin):.3g}", file=sys.stderr)
    if trust_far:
        print(f"[t2] trust: {100 * np.mean(trust_far):.1f}% of the queries beyond the window's spread", file=sys.stderr)
    return res, time.perf_counter() - t0


def check_against_reference(args, draws=3):
    """The vectorized variances equal the reference functions on one KV head (layer 5, head 1): the cluster,
    code, page and tilted (``ClusterDesign(tilt=True)`` with q0 the window's mean query) designs, and the
    hull bound."""
    cap = load_capture(Path(args.cache), args.text_seed)
    tau = float(cap["scaling"])
    layer, h, g, d, L = 5, 1, 3, 64, PREFIX
    u = importance_of_layer(cap, layer)[h]
    k = cap["k"][layer][h, :PREFIX + FUTURE].double().numpy()
    v = cap["v"][layer][h, :PREFIX + FUTURE].double().numpy()
    q = cap["q"][layer][h * g:(h + 1) * g][:, [L + o for o in OFFSETS]].double().numpy().reshape(-1, d)
    head = Head(q, k, v, u, tau)
    U = np.stack([design_uniforms(L, seed=s) for s in range(draws)])
    B = 0.3 * L * 128 / 129
    sz = design_sizes(B, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION)
    pi = R.inclusion_probabilities(u, B, sinks=sz.sinks, window=sz.window, top=sz.top, floor=FLOOR)
    keep, pif, kf, A, oh = head.sample(pi, U)
    cl = SK.ClusterDesign(clusters=8)
    lab = SK.kmeans_assign(k[:L], 8)
    Vc = cluster_variance(head, pi, keep, kf, oh, lab, 8)
    cd = PC.CodeDesign(rank=8, bits=4)
    sk_all = PC.code_sketch(k[:L], v[:L], pi, np.zeros(L, bool), cd)
    Vh = hybrid_variance(head, pi, keep, kf, oh, sk_all)
    Vb, _ = page_variance(head, pi, keep, kf, oh, P=16)
    qw = cap["q"][layer][h * g:(h + 1) * g][:, L - 32:L].double().numpy().reshape(-1, d)
    Vt = tilted_variance(head, pi, keep, kf, oh, lab, 8, qw, per_head=False)
    tl = SK.ClusterDesign(clusters=8, tilt=True)
    H = hull_cap(head, keep, kf)(oh)
    worst = 0.0
    for s in range(draws):
        assert np.array_equal(keep[s], R.poisson_sample(pi, seed=s))
        csk = SK.cluster_sketch(k[:L], v[:L], pi, keep[s], cl)
        tsk = SK.cluster_sketch(k[:L], v[:L], pi, keep[s], tl, tilt=qw, scale=tau)
        hsk = PC.code_sketch(k[:L], v[:L], pi, keep[s], cd)
        psk = PC.page_sketch(k[:L], v[:L], pi, keep[s], page_size=16)
        for j in range(q.shape[0]):
            lim = L + OFFSETS[j % len(OFFSETS)] + 1
            sel = np.concatenate([np.flatnonzero(keep[s]), np.arange(L, lim)])
            args_ = (q[j], k[sel], v[sel], pif[sel])
            est = R.hajek_attention(*args_, scale=tau)
            assert np.allclose(est.output, oh[s, j], rtol=1e-9, atol=1e-12)
            ref = (SK.cluster_variance(*args_, csk, output=oh[s, j], scale=tau),
                   PC.hybrid_variance(*args_, hsk, output=oh[s, j], scale=tau),
                   PC.variance_bound(*args_, psk, output=oh[s, j], scale=tau),
                   SK.cluster_variance(*args_, tsk, output=oh[s, j], scale=tau))
            ref = ref + (SK.hull_bound(v[sel], pif[sel], tsk, output=oh[s, j]),)
            for a, b in zip(ref, (Vc[s, j], Vh[s, j], Vb[s, j], Vt[s, j], H[s, j])):
                worst = max(worst, abs(a - b) / abs(a))
    print(f"[check] vectorized vs reference: worst relative difference {worst:.2e}", file=sys.stderr)
    assert worst < 1e-8, worst
    # the difference estimator (--diffs): at q = q0 every residual a_i - g_i is 0, so o_DE = o and its variance is 0
    q0 = qw.mean(0)
    at_q0 = Head(np.repeat(q0[None], len(OFFSETS), axis=0), k, v, u, tau)
    keep0, _, kf0, _, _ = at_q0.sample(pi, U)
    od, Vht, Vor, Zd, _ = difference_estimate(at_q0, pi, keep0, kf0, lab, 8, qw)
    gap = np.abs(od - at_q0.o[None]).max() / np.abs(at_q0.o).max()
    print(f"[check] difference estimator at q = q0: |o_DE - o| / |o| {gap:.1e}, V {Vor.max():.1e}, "
          f"Z_DE / Z - 1 {np.abs(Zd / at_q0.Z[None] - 1).max():.1e}", file=sys.stderr)
    assert gap < 1e-10 and Vor.max() < 1e-20 and Vht.max() < 1e-20


def summarize(res):
    rows = []
    for M in MEMORIES:
        paper = res[(M, "paper", "trace", next(iter(RULES)))]
        paper_rel = np.mean([e / on for e, r, on, m in paper])
        for key, cells in res.items():
            if key[0] != M:
                continue
            cov = np.array([np.mean(e <= r) for e, r, on, m in cells])
            worst = np.sort(cov)[: max(1, int(np.ceil(0.1 * cov.size)))].mean()
            pooled = np.mean(np.concatenate([e <= r for e, r, on, m in cells]))
            silent = np.mean(np.concatenate([(e / on > 0.05) & (e > r) for e, r, on, m in cells]))
            rms = np.array([np.sqrt(np.mean(e ** 2)) for e, r, on, m in cells])
            med = np.array([np.median(r) for e, r, on, m in cells])
            tight = float(np.median(med / np.where(rms > 0, rms, np.nan)))
            rel = np.mean([e / on for e, r, on, m in cells])
            mem = np.mean([m.mean() for e, r, on, m in cells])
            rows.append(dict(M=M, design=key[1], variance=key[2], rule=key[3], memory=mem, pooled=pooled,
                             worst=worst, silent=silent, tight=tight, rel=rel, ratio=rel / paper_rel,
                             cells=len(cells)))
    return rows


def markdown(rows):
    out = ["| M | design | variance | radius | memory held | pooled | worst decile | silent | tightness | "
           "mean rel err | vs paper | goal lines met |", "|" + "---|" * 12]
    for r in rows:
        met = goal_lines(r)
        out.append(f"| {r['M']} | {r['design']} | {r['variance']} | {r['rule']} | {r['memory']:.3f} | "
                   f"{r['pooled']:.3f} | {r['worst']:.3f} | {100 * r['silent']:.2f}% | {r['tight']:.3g} | "
                   f"{r['rel']:.4f} | {r['ratio']:.3f} | {met} |")
    return "\n".join(out)


def goal_lines(r):
    """Which of the five goal lines this row meets: P(ooled) W(orst) S(ilent) T(ightness) E(rror)."""
    ok = [("P", r["pooled"] >= 0.95), ("W", r["worst"] >= 0.90), ("S", r["silent"] <= 0.005),
          ("T", r["tight"] <= 3.0), ("E", r["ratio"] <= 1.1)]
    return "".join(c if o else "-" for c, o in ok)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=256)
    p.add_argument("--layer-step", type=int, default=1, help="every k-th layer (1 = all 30)")
    p.add_argument("--cache", default=None,
                   help="capture cache (default kvcert_issue14_capture[_full][_seedS].pt in the temporary folder)")
    p.add_argument("--text-seed", type=int, default=0, help="seed of the pydoc haystack order (0 = T2's text)")
    p.add_argument("--codes", nargs="*", default=[])
    p.add_argument("--clusters", nargs="*", default=["16"],
                   help="C, C:theta (the mgf's variance factor) or C:calQ (theta_c calibrated per cluster on the "
                        "observation window's queries, their Q-quantile; cal1 = the max)")
    p.add_argument("--rules", nargs="*", default=list(RULES), help="radius rules: chebyshev, gaussian or xC")
    p.add_argument("--tilts", nargs="*", default=[], help="C:group or C:head (research: tilted cluster moments)")
    p.add_argument("--diffs", nargs="*", default=[],
                   help="C or C:tilt: the difference estimator with a tilted C-cluster model (research)")
    p.add_argument("--no-hull", dest="hull", action="store_false",
                   help="cluster / tilted rows without the hull bound cap (the radius of the earlier runs)")
    p.add_argument("--no-page", dest="page", action="store_false")
    p.add_argument("--oracle-all", action="store_true", help="also the oracle V on each code design's sample")
    p.add_argument("--check", action="store_true", help="only check the vectorized code against the reference")
    p.add_argument("--save", help="write the per-row summary as .npy (pickled dicts)")
    p.add_argument("--full-size", action="store_true",
                   help="paper_repro's full-mode T2 sizes: prefix 4096, 64 future tokens, queries at +0/7/15/31/47/63")
    args = p.parse_args(argv)
    global PREFIX, FUTURE, OFFSETS
    if args.full_size:
        PREFIX, FUTURE, OFFSETS = 4096, 64, (0, 7, 15, 31, 47, 63)
    if args.cache is None:
        args.cache = default_cache(args.text_seed, args.full_size)
    RULES.clear()
    for r in args.rules:
        RULES[r] = {"chebyshev": 1 / np.sqrt(DELTA), "gaussian": Z}.get(r) or float(r[1:])
    if args.check:
        check_against_reference(args)
        return
    res, secs = run(args)
    rows = summarize(res)
    print(f"<!-- {secs:.0f} s; draws {args.draws}; layers every {args.layer_step}; text seed {args.text_seed}; "
          f"clusters {args.clusters}; codes {args.codes}; prefix {PREFIX}, future {FUTURE}, offsets {OFFSETS} -->")
    print(markdown(rows))
    if args.save:
        np.save(args.save, np.array(rows, dtype=object), allow_pickle=True)


if __name__ == "__main__":
    main()
