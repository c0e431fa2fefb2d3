"""The block-level (cluster) design: reference oracle, exact checks, and kvcert.fast against it.

Tolerances are derived, not tuned (STYLE.md rule 3 and tests/support.py):

- enumeration sums of 2^B terms: a relative rounding of ``K eps`` with ``K = n + B + 2^B + 8`` (n for
  a token sum, B for the product P(S) of B factors, 2^B for the sum over samples, a few for the
  final operations) times the same sum taken over absolute values (the "abs-scale");
- reference vs reference formulas of the same quantity: ``rounding(float64, n)`` times the
  abs-scale of the terms;
- fast vs reference: ``|fast - ref64| <= 2 |naive_D - ref64| + rounding(D, n) * scale`` with
  ``scale`` the first-order error propagation of each field (see :func:`_scales`).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

import kvcert.fast as F
import kvcert.reference as R
from support import (COMPUTE, EPS, GOLDEN, TINY_PI, assert_close, attention_case, output_cast, pi_vectors, rounding,
                     splitmix64_py)

EPS64 = EPS[torch.float64]

# ----------------------------------------------------------------------------- helpers


def _pi_blocks(rng, nb, *, tiny=False):
    """Block pi: interior U(0.1, 0.95) with exact 1.0 on about 20% (and 1e-6 on 10% if ``tiny``)."""
    p = rng.uniform(0.1, 0.95, size=nb)
    u = rng.random(nb)
    p[u < 0.2] = 1.0
    if tiny:
        p[(u >= 0.2) & (u < 0.3)] = TINY_PI
    return p


def _population(seed, n, d=4, dv=3, offset=0.0):
    rng = np.random.default_rng(seed)
    return rng, rng.normal(size=d), rng.normal(size=(n, d)), rng.normal(size=(n, dv)) + offset


def _truth(q, k, v):
    s = R.scores(q, k)
    lse = float(logsumexp(s))
    w = np.exp(s - lse)
    return s, lse, w, w @ v


# ----------------------------------------------------------------------------- exact checks by enumeration


@pytest.mark.parametrize("n, bs, seed", [(11, 3, 0), (12, 2, 1), (7, 1, 2), (13, 4, 3), (9, 9, 4)])
def test_ht_block_totals_unbiased_by_enumeration(n, bs, seed):
    """E[N_hat] = N and E[Z_hat] = Z over all 2^B block samples (the last block partial when bs does not divide n)."""
    rng, q, k, v = _population(seed, n)
    nb = R.block_count(n, bs)
    pib = _pi_blocks(rng, nb)
    pi = R.expand_blocks(pib, bs, n)
    s, _, _, _ = _truth(q, k, v)
    N = np.exp(s) @ v
    Z = float(np.exp(s).sum())
    EN, EZ = np.zeros_like(N), 0.0
    total_p = 0.0
    for bits in itertools.product([False, True], repeat=nb):
        kb = np.array(bits)
        P = float(np.prod(np.where(kb, pib, 1.0 - pib)))
        keep = R.block_keep(kb, bs, n)
        if P == 0.0:
            continue
        Nh, Zh = R.horvitz_thompson_totals(q, k[keep], v[keep], pi[keep])
        EN += P * Nh
        EZ += P * Zh
        total_p += P
    K = n + nb + 2 ** nb + 8
    assert abs(total_p - 1.0) <= K * EPS64
    assert_close("E[N_hat]", EN, N, K * EPS64 * (np.exp(s) @ np.abs(v)))
    assert_close("E[Z_hat]", EZ, Z, K * EPS64 * Z)


@pytest.mark.parametrize("n, bs, seed", [(11, 3, 0), (12, 2, 5), (13, 4, 3), (10, 5, 7)])
def test_cluster_variance_is_the_exact_design_variance_and_its_ht_estimate_unbiased(n, bs, seed):
    """By enumeration of all 2^B block samples, with the true o and Z:

    1. the design covariance E[L L^T] of the linearized error L = sum_b (I_b/pi_b - 1) t_b equals
       ``block_linearized_variance`` V = sum_b (1 - pi_b)/pi_b t_b t_b^T (the cluster form);
    2. E[block_linearized_variance_ht] = V (the HT variance estimator is unbiased under Poisson sampling);
    3. negative control: the token form (each token on its own) is *not* the design variance here.
    """
    rng, q, k, v = _population(seed, n, offset=1.5)
    nb = R.block_count(n, bs)
    pib = _pi_blocks(rng, nb)
    pi = R.expand_blocks(pib, bs, n)
    _, lse, w, o = _truth(q, k, v)
    labels = R.block_labels(n, bs)
    t = np.array([(w[labels == b, None] * (v[labels == b] - o)).sum(0) for b in range(nb)])
    tau = np.array([(w[labels == b, None] * (np.abs(v[labels == b]) + np.abs(o))).sum(0) for b in range(nb)])
    V = R.block_linearized_variance(q, k, v, pi, block_size=bs)
    dv = v.shape[1]
    ELL, EVht, SL = np.zeros((dv, dv)), np.zeros((dv, dv)), np.zeros((dv, dv))
    for bits in itertools.product([False, True], repeat=nb):
        kb = np.array(bits)
        P = float(np.prod(np.where(kb, pib, 1.0 - pib)))
        if P == 0.0:
            continue
        f = np.where(kb, 1.0 / pib - 1.0, -1.0)  # I_b / pi_b - 1
        L = f @ t
        Lam = np.abs(f) @ tau
        ELL += P * np.outer(L, L)
        SL += P * np.outer(Lam, Lam)
        EVht += P * R.block_linearized_variance_ht(q, k, v, pi, R.block_keep(kb, bs, n), block_size=bs,
                                                   output=o, lse=lse)
    SV = (tau * ((1.0 - pib) / pib)[:, None]).T @ tau  # abs-scale of V and of E[V_ht]
    K = n + nb + 2 ** nb + 8
    assert_close("E[L L^T] vs V", ELL, V, 4 * K * EPS64 * (SL + SV))
    assert_close("E[V_ht] vs V", EVht, V, 8 * K * EPS64 * SV)
    token_form = R.linearized_variance(q, k, v, pi)
    gap = np.abs(token_form - V).max()
    assert gap > 1e3 * (4 * K * EPS64 * (SL + SV)).max(), "the token form should miss the within-block cross terms"


@pytest.mark.parametrize("n, bs, seed", [(15, 4, 0), (9, 2, 1), (6, 1, 2)])
def test_cluster_covariance_is_the_ht_form_with_estimates(n, bs, seed):
    """Sigma_hat of block_hajek_attention = block_linearized_variance_ht at (o_hat, log Z_hat): two code paths."""
    rng, q, k, v = _population(seed, n, offset=-2.0)
    nb = R.block_count(n, bs)
    pib = _pi_blocks(rng, nb, tiny=True)
    kb = R.block_sample(pib, seed=seed)
    kb[0] = True  # never an empty sample
    keep = R.block_keep(kb, bs, n)
    pi = R.expand_blocks(pib, bs, n)
    pos = np.flatnonzero(keep)
    est = R.block_hajek_attention(q, k[keep], v[keep], pi[keep], block_size=bs, positions=pos)
    plug = R.block_linearized_variance_ht(q, k, v, pi, keep, block_size=bs, output=est.output, lse=est.lse)
    r = np.abs(v[keep]) + np.abs(est.output)
    zabs = np.zeros((nb, v.shape[1]))
    np.add.at(zabs, pos // bs, est.weights[:, None] * r)
    scale = (zabs * (1 - pib)[:, None]).T @ zabs
    assert_close("covariance", est.covariance, plug, rounding(torch.float64, n) * scale)
    assert_close("variance", est.variance, np.diag(est.covariance), rounding(torch.float64, n) * np.diag(scale))
    assert math.isclose(est.trace, float(np.trace(est.covariance)), rel_tol=0,
                        abs_tol=rounding(torch.float64, n) * float(np.trace(scale)))


# ----------------------------------------------------------------------------- special cases


@given(attention_case(max_n=60), st.sampled_from([1, 2, 3, 16]))
def test_all_pi_one_is_exact_with_zero_variance(case, bs):
    q, k, v, bias = case
    n = k.shape[0]
    est = R.block_hajek_attention(q, k, v, np.ones(n), block_size=bs, bias=bias)
    exact = R.attention(q, k, v, bias=bias)
    a = est.weights
    logit = np.log(np.where(a > 0, a, 1.0)) + est.lse
    Lw = np.where(a > 0, np.abs(logit) + abs(est.lse) + 1.0, 0.0)
    scale = a @ (np.abs(v) + Lw[:, None] * np.abs(v - exact))
    assert_close("output", est.output, exact, rounding(torch.float64, n) * scale)
    assert est.trace == 0.0 and np.all(est.variance == 0) and np.all(est.covariance == 0)
    assert est.max_term == 0.0 and est.tail_moment == 0.0
    for kind in R.KINDS:
        assert np.all(np.asarray(R.certificate(est, kind=kind).radius) == 0)
    # the design with budget = n_blocks keeps every block with certainty
    nb = R.block_count(n, bs)
    pib = R.block_inclusion_probabilities(np.abs(k[:, 0]), float(nb), block_size=bs, sink_blocks=0, recent_blocks=0)
    assert np.all(pib == 1.0) and np.all(R.block_sample(pib, seed=0))


def test_fast_all_pi_one_is_exact_with_zero_variance():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 16, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 45, 16, generator=g, dtype=torch.float64), torch.randn(2, 2, 45, 5, generator=g,
                                                                                     dtype=torch.float64)
    est = F.block_hajek_attention(q, k, v, torch.ones(2, 2, 45, dtype=torch.float64), block_size=8,
                                  return_max_term=True, return_tail_moment=True, return_covariance=True)
    exact = F.attention(q, k, v)
    assert torch.allclose(est.output, exact, rtol=0, atol=rounding(torch.float64, 45) * float(v.abs().max()) * 4)
    for f in ("variance", "trace", "max_term", "tail_moment", "covariance"):
        assert torch.all(getattr(est, f) == 0), f


@given(attention_case(max_n=60), st.data())
def test_block_size_one_is_the_token_design(case, data):
    """block_size = 1: every field equals the token estimator's (hajek_attention), padding included."""
    q, k, v, bias = case
    n = k.shape[0]
    pi = data.draw(pi_vectors(n))
    tok = R.hajek_attention(q, k, v, pi, bias=bias)
    pos = np.where(pi > 0, np.arange(n), -1)
    blk = R.block_hajek_attention(q, k, v, pi, block_size=1, positions=pos, bias=bias)
    if tok.lse == -np.inf:
        assert blk.lse == -np.inf and blk.trace == np.inf and blk.tail_moment == np.inf
        return
    assert np.array_equal(blk.output, tok.output) and np.array_equal(blk.weights, tok.weights)
    assert blk.lse == tok.lse and blk.n_eff == pytest.approx(tok.n_eff, rel=rounding(torch.float64, n))
    a, r = tok.weights, np.abs(v - tok.output)
    c = (1 - pi) * a * a
    rnd = rounding(torch.float64, n)
    assert_close("covariance", blk.covariance, tok.covariance, rnd * ((r * c[:, None]).T @ r))
    assert_close("variance", blk.variance, tok.variance, rnd * (c @ (r * r)))
    assert_close("trace", blk.trace, tok.trace, rnd * float(c @ (r * r).sum(1)))
    assert_close("max_term", blk.max_term, tok.max_term, rnd * tok.max_term)
    assert_close("tail_moment", blk.tail_moment, tok.tail_moment, 4 * rnd * tok.tail_moment)


@given(st.integers(1, 80), st.integers(0, 2**32 - 1), st.data())
def test_block_size_one_design_is_the_token_design(n, seed, data):
    rng = np.random.default_rng(seed)
    u = rng.random(n) * (rng.random(n) < 0.7)
    sinks, window, top = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    c = int(R.certainty_mask(u, sinks=sinks, window=window, top=top).sum())
    assume(c < n)  # a Poisson tail to draw (else no budget lies strictly between c and n)
    budget = data.draw(st.floats(c + 0.01, n))
    want = R.inclusion_probabilities(u, budget, sinks=sinks, window=window, top=top)
    for reduce in R.BLOCK_REDUCTIONS:
        got = R.block_inclusion_probabilities(u, budget, block_size=1, sink_blocks=sinks, recent_blocks=window,
                                              top_blocks=top, reduce=reduce)
        assert_close(f"pi ({reduce})", got, want, 4 * rounding(torch.float64, n) * want)
    gotf = F.block_inclusion_probabilities(torch.from_numpy(u)[None], budget, block_size=1, sink_blocks=sinks,
                                           recent_blocks=window, top_blocks=top)
    assert_close("fast pi", gotf[0].numpy(), want, 4 * rounding(torch.float64, n) * want)


def test_block_importance_by_hand():
    u = np.array([[[1.0, 1, 2, 0, 4]], [[0, 0, 0, 0, 2]], [[0, 0, 0, 0, 0]]])  # 3 "layers", 1 head, n = 5
    tot = np.array([[2.0, 2, 4], [0, 0, 2], [0, 0, 0]])
    share = np.array([[0.25, 0.25, 0.5], [0, 0, 1], [0, 0, 0]])  # the zero head stays 0
    for reduce, fn in (("mean", np.mean), ("max", np.max)):
        assert np.allclose(R.block_importance(u, 2, reduce=reduce, normalize=False), fn(tot, 0), rtol=0, atol=0)
        assert np.allclose(R.block_importance(u, 2, reduce=reduce), fn(share, 0), rtol=0, atol=1e-16)
        got = F.block_importance(torch.from_numpy(u)[None], 2, reduce=reduce)  # (b=1, layers, heads, n)
        assert got.shape == (1, 3) and torch.allclose(got[0], torch.from_numpy(fn(share, 0)), rtol=0, atol=1e-16)
    # one head: the block importance is proportional to the block sums, so pi is the token design's on blocks
    one = np.array([3.0, 1, 0, 0, 5, 1, 2])
    assert np.allclose(R.block_importance(one, 3), np.array([4.0, 6, 2]) / 12, rtol=0, atol=1e-16)


# ----------------------------------------------------------------------------- the stream


def _uniform_py(seed, event, j):
    """The documented stream, spelled out with Python ints (an independent implementation)."""
    k = splitmix64_py(seed + GOLDEN)
    k = splitmix64_py((k ^ 0x6B76626C6F636B73) + GOLDEN)
    k = splitmix64_py((k ^ event) + GOLDEN)
    return (splitmix64_py(k + (j + 1) * GOLDEN) >> 11) * 2.0 ** -53


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.integers(0, 70))
def test_block_uniforms_reference_equals_fast_bit_for_bit(seed, event, nb):
    ref = R.block_uniforms(nb, seed, event=event)
    fast = F.block_uniforms((nb,), seed, event=event)
    assert np.array_equal(ref, fast.numpy())
    assert [_uniform_py(seed, event, j) for j in range(min(nb, 5))] == ref[:5].tolist()
    assert np.all((ref >= 0) & (ref < 1))
    if nb:  # a block index counter (e.g. only the blocks after the 10th) is the same draw
        idx = np.arange(nb) + 10
        assert np.array_equal(R.block_uniforms(nb, seed, event=event, index=idx),
                              R.block_uniforms(nb + 10, seed, event=event)[10:])
        assert np.array_equal(F.block_uniforms((nb,), seed, event=event, index=torch.from_numpy(idx)).numpy(),
                              R.block_uniforms(nb + 10, seed, event=event)[10:])


def test_per_row_seeds_and_events_give_their_own_streams():
    seeds = torch.tensor([5, 0, 2**62])
    u = F.block_uniforms((3, 20), seeds, event=1)
    for r, s in enumerate(seeds.tolist()):
        assert np.array_equal(u[r].numpy(), R.block_uniforms(20, s, event=1))
    assert not np.array_equal(R.block_uniforms(20, 5, event=1), R.block_uniforms(20, 5, event=2))
    assert not np.array_equal(R.block_uniforms(20, 5), R.block_uniforms(20, 6))
    # the block stream is not the token stream of the same seed
    assert not np.array_equal(F.block_uniforms((20,), 5).numpy(), F.design_uniforms((20,), 5).numpy())


def test_kept_blocks_do_not_depend_on_batch_composition():
    """The same seed and sequence keep the same blocks alone, first or second in a padded batch."""
    rng = np.random.default_rng(0)
    bs, L, h = 8, 3, 2
    na, nbq = 50, 83
    ua = rng.random((L, h, na))
    ub = rng.random((L, h, nbq))
    n = max(na, nbq)

    def pad(x):
        return np.concatenate([x, np.full(x.shape[:-1] + (n - x.shape[-1],), 7.0)], -1)  # loud padding

    kw = dict(block_size=bs, sink_blocks=1, recent_blocks=1, top_blocks=1)
    alone_pi = F.block_inclusion_probabilities(torch.from_numpy(ua)[None], 3.5, **kw)
    alone = F.block_sample(alone_pi, seed=11, event=4)[0]
    for order in ((ua, ub), (ub, ua)):
        imp = torch.from_numpy(np.stack([pad(x) for x in order]))
        lens = torch.tensor([x.shape[-1] for x in order])
        pi = F.block_inclusion_probabilities(imp, torch.tensor([3.5, 3.5]), lengths=lens, **kw)
        keep = F.block_sample(pi, seed=11, event=4)
        row = 0 if order[0] is ua else 1
        nba = R.block_count(na, bs)
        assert torch.equal(keep[row, :nba], alone) and not bool(keep[row, nba:].any())
        assert torch.allclose(pi[row, :nba], alone_pi[0], rtol=4 * rounding(torch.float64, nba), atol=0)
        assert torch.all(pi[row, nba:] == 0)
    # the reference draws the same blocks
    ref_pi = R.block_inclusion_probabilities(ua, 3.5, **kw)
    assert np.array_equal(R.block_sample(ref_pi, seed=11, event=4), alone.numpy())
    # and the compacted caches keep the same positions for every KV head and dtype of the layer
    k = torch.randn(1, h, na, 4, dtype=torch.float64)
    cc = F.block_evict(k, k, torch.from_numpy(ua)[None], 3.5, seed=11, event=4, **kw)
    want = np.flatnonzero(R.block_keep(alone.numpy(), bs, na))
    for hh in range(h):
        assert np.array_equal(cc.positions[0, hh, : int(cc.kept[0, hh])].numpy(), want)


# ----------------------------------------------------------------------------- fast = reference


def _naive_block(q, k, v, pi, lab, dt):
    """Textbook block estimator of one row in plain torch at dtype ``dt`` (None for an empty row)."""
    T = lambda x: torch.as_tensor(np.asarray(x), dtype=dt)  # noqa: E731
    q, k, v, p = T(q), T(k), T(v), T(pi)
    s = (k @ q) / math.sqrt(q.shape[0])
    logits = torch.where(p > 0, s - torch.log(torch.where(p > 0, p, torch.ones_like(p))), -math.inf)
    if logits.numel() == 0 or bool((logits == -math.inf).all()):
        return None
    lse = torch.logsumexp(logits, 0)
    a = torch.exp(logits - lse)
    o = a @ v
    out = {"output": o, "lse": lse, "weights": a}
    blocks = sorted(set(lab[pi > 0].tolist()))
    z = torch.stack([(a[torch.from_numpy(lab == b)][:, None] * (v[torch.from_numpy(lab == b)] - o)).sum(0)
                     for b in blocks]) if blocks else torch.zeros(0, v.shape[1], dtype=dt)
    cb = torch.stack([1 - p[torch.from_numpy(lab == b)][0] for b in blocks]) if blocks else torch.zeros(0, dtype=dt)
    out["variance"] = (cb[:, None] * z * z).sum(0)
    out["trace"] = out["variance"].sum()
    return out


def _scales(r, v, pi, lab, rnd):
    """First-order error propagation of every field of one row, per unit rounding of the compute dtype.

    a_i carries a relative error ~ L_i = |logit_i| + |lse| + 1, o_hat ~ sc_o = sum a_i (|v_i| + L_i |v_i - o|);
    z_b ~ zeta_b = sum_{i in b} a_i (L_i |v_i - o| + |v_i| + |o|) + A_b sc_o; then each field by the chain rule.
    """
    a = r.weights
    logit = np.log(np.where(a > 0, a, 1.0)) + r.lse
    Lw = np.where(a > 0, np.abs(logit) + abs(r.lse) + 1.0, 0.0)
    res = np.abs(v - r.output)
    sc_o = a @ (np.abs(v) + Lw[:, None] * res)
    ids = sorted(set(lab[pi > 0].tolist()))
    nb = len(ids)
    z, zeta, A, cb, pb = (np.zeros((nb, v.shape[1])), np.zeros((nb, v.shape[1])), np.zeros(nb), np.zeros(nb),
                          np.zeros(nb))
    for j, b in enumerate(ids):
        m = (lab == b) & (pi > 0)
        z[j] = a[m] @ (v[m] - r.output)
        A[j] = a[m].sum()
        zeta[j] = a[m] @ (Lw[m, None] * res[m] + np.abs(v[m]) + np.abs(r.output)) + A[j] * sc_o
        cb[j], pb[j] = 1 - pi[m][0], pi[m][0]
    # |z + dz|^2 - |z|^2 <= 2 |z| |dz| + |dz|^2 with |dz| <= rnd zeta: the second-order term matters when z ~ 0
    # (e.g. a single kept block, where z_b = sum a_i v_i - o_hat = 0 exactly); z^2 covers the rounding of c_b
    az = np.abs(z)
    sc_var = cb @ (2 * az * zeta + rnd * zeta * zeta + z * z)
    zn, zetan = np.linalg.norm(z, axis=1), np.linalg.norm(zeta, axis=1)
    live = (cb > 0) & (A > 0)
    cz = (az + rnd * zeta) * cb[:, None]
    return {
        "output": sc_o, "lse": Lw.max(), "weights": a * Lw, "variance": sc_var, "trace": sc_var.sum(),
        "n_eff": r.n_eff * 2 * (Lw.max() + 1),
        "covariance": cz.T @ zeta + (zeta * cb[:, None]).T @ az + (az * cb[:, None]).T @ az,
        "max_term": float(np.max(np.where(live, np.maximum(cb, pb) * zetan, 0.0), initial=0.0)) + r.max_term,
        "tail_moment": float(cb ** 3 @ (((zn + rnd * zetan) ** 4 - zn ** 4) / rnd + zn ** 4)),
    }


@st.composite
def block_problems(draw):
    """A batch of block samples: (dtype, q, keys, values, pi, positions, block_size) of a compacted cache."""
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    b, h_kv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 3]))
    bs = draw(st.sampled_from([1, 2, 3, 16]))
    n = draw(st.one_of(st.sampled_from([1, 15, 16, 17, 33, 64]), st.integers(1, 120)))
    d, dv = draw(st.sampled_from([4, 16])), draw(st.sampled_from([1, 3, 16]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    offset = draw(st.sampled_from([0.0, 0.0, 3.0, -50.0]))
    nb = R.block_count(n, bs)
    pib = np.stack([_pi_blocks(rng, nb, tiny=draw(st.booleans())) for _ in range(b)])
    lens = rng.integers(1, n + 1, size=b)
    lens[0] = n
    keep = F.block_sample(torch.from_numpy(pib), uniforms=torch.from_numpy(rng.random((b, nb))))
    keys = torch.from_numpy(rng.normal(size=(b, h_kv, n, d))).to(dtype)
    values = torch.from_numpy(rng.normal(size=(b, h_kv, n, dv)) + offset).to(dtype)
    cc = F.block_compact(keep, torch.from_numpy(pib), keys, values, block_size=bs, lengths=torch.from_numpy(lens))
    q = torch.from_numpy(rng.normal(size=(b, g * h_kv, d))).to(dtype)
    pdt = torch.float64 if dtype == torch.float64 else torch.float32
    return dtype, q, cc.keys, cc.values, cc.pi.to(pdt), cc.positions, bs


@settings(max_examples=40)
@given(block_problems(), st.booleans())
def test_fast_block_estimate_matches_reference(problem, use_log):
    dtype, q, k, v, pi, pos, bs = problem
    kw = dict(log_pi=torch.log(pi)) if use_log else dict(pi=pi)
    est = F.block_hajek_attention(q, k, v, block_size=bs, positions=pos, return_weights=True, return_max_term=True,
                                  return_tail_moment=True, return_covariance=True, **kw)
    qn, kn, vn, pn = (x.double().numpy() for x in (q, k, v, pi))
    posn = pos.numpy()
    g = q.shape[1] // k.shape[1]
    n = kn.shape[2]
    rnd = rounding(dtype, n)
    ct = COMPUTE[dtype]
    for bi in range(q.shape[0]):
        for hq in range(q.shape[1]):
            h = hq // g
            r = R.block_hajek_attention(qn[bi, hq], kn[bi, h], vn[bi, h], pn[bi, h], block_size=bs,
                                        positions=posn[bi, h])
            if r.lse == -np.inf:
                assert float(est.lse[bi, hq]) == -math.inf and float(est.trace[bi, hq]) == math.inf
                continue
            lab = np.where(posn[bi, h] >= 0, posn[bi, h] // bs, -1)
            sc = _scales(r, vn[bi, h], pn[bi, h], lab, rnd)
            naive = _naive_block(qn[bi, hq], kn[bi, h], vn[bi, h], pn[bi, h], lab, ct) if dtype != torch.float64 \
                else None
            want = {"output": r.output, "lse": r.lse, "weights": r.weights, "variance": r.variance,
                    "trace": r.trace, "n_eff": r.n_eff, "covariance": r.covariance, "max_term": r.max_term,
                    "tail_moment": r.tail_moment}
            for f, wv in want.items():
                tol = rnd * np.asarray(sc[f])
                if f == "output":
                    tol = tol + output_cast(dtype) * np.abs(wv)
                if naive is not None and f in naive:
                    tol = tol + 2.0 * np.abs(naive[f].double().numpy() - wv)
                assert_close(f"{f}[{bi},{hq}] {dtype} bs={bs}", getattr(est, f)[bi, hq].double().numpy(), wv, tol)


def test_fast_causal_queries_match_reference():
    rng = np.random.default_rng(4)
    bs, n, t, offset = 4, 40, 3, 30
    pib = _pi_blocks(rng, R.block_count(n, bs))
    kb = R.block_sample(pib, seed=1)
    keys = torch.from_numpy(rng.normal(size=(1, 1, n, 8)))
    vals = torch.from_numpy(rng.normal(size=(1, 1, n, 3)))
    cc = F.block_compact(torch.from_numpy(kb)[None], torch.from_numpy(pib)[None], keys, vals, block_size=bs)
    q = torch.from_numpy(rng.normal(size=(1, 2, t, 8)))
    est = F.block_hajek_attention(q, cc.keys, cc.values, cc.pi, block_size=bs, positions=cc.positions, offset=offset)
    pos = cc.positions[0, 0].numpy()
    for hq in range(2):
        for j in range(t):
            bias = np.where(pos <= offset + j, 0.0, -np.inf)
            r = R.block_hajek_attention(q[0, hq, j].numpy(), cc.keys[0, 0].numpy(), cc.values[0, 0].numpy(),
                                        cc.pi[0, 0].numpy(), block_size=bs, positions=pos, bias=bias)
            tol = 64 * rounding(torch.float64, n) * (1 + abs(r.trace))
            assert abs(float(est.trace[0, hq, j]) - r.trace) <= tol
            assert np.allclose(est.output[0, hq, j].numpy(), r.output, rtol=0, atol=tol)


def test_fast_block_certificates_match_reference():
    rng = np.random.default_rng(2)
    bs, n = 4, 30
    pib = _pi_blocks(rng, R.block_count(n, bs))
    kb = R.block_sample(pib, seed=3)
    kb[0] = True
    keys, vals = torch.from_numpy(rng.normal(size=(1, 1, n, 8))), torch.from_numpy(rng.normal(size=(1, 1, n, 3)))
    cc = F.block_compact(torch.from_numpy(kb)[None], torch.from_numpy(pib)[None], keys, vals, block_size=bs)
    q = torch.from_numpy(rng.normal(size=(1, 1, 8)))
    m = int(cc.kept[0, 0])
    ref = R.block_hajek_attention(q[0, 0].numpy(), cc.keys[0, 0, :m].numpy(), cc.values[0, 0, :m].numpy(),
                                  cc.pi[0, 0, :m].numpy(), block_size=bs, positions=cc.positions[0, 0, :m].numpy())
    assert ref.trace > 0
    for kind in ("chebyshev", "bernstein", "chebyshev_ucb", "wald"):
        est = F.block_hajek_attention(q, cc.keys, cc.values, cc.pi, block_size=bs, positions=cc.positions,
                                      **F.estimate_options(kind))
        got = F.certificate(est, kind=kind).radius[0, 0].numpy()
        want = R.certificate(ref, kind=kind).radius
        assert_close(kind, got, want, 1e-9 * (1 + np.abs(want)))
    assert R.certificate(ref, kind="chebyshev").radius == pytest.approx(math.sqrt(ref.trace / 0.05), rel=1e-15)


def test_fast_design_matches_reference_rows():
    rng = np.random.default_rng(9)
    u = rng.random((3, 2, 2, 70)) ** 3  # (b, layers, heads, n)
    for reduce in R.BLOCK_REDUCTIONS:
        pf = F.block_inclusion_probabilities(torch.from_numpy(u), 4.0, block_size=16, reduce=reduce, top_blocks=1,
                                             sink_blocks=0, recent_blocks=1)
        for bi in range(3):
            pr = R.block_inclusion_probabilities(u[bi], 4.0, block_size=16, reduce=reduce, top_blocks=1,
                                                 sink_blocks=0, recent_blocks=1)
            assert_close(f"pi {reduce}", pf[bi].numpy(), pr, 4 * rounding(torch.float64, 70) * pr)
            assert math.isclose(float(pr.sum()), 4.0, rel_tol=4 * rounding(torch.float64, 5))
    assert F.block_inclusion_probabilities(torch.from_numpy(u).float(), 4.0, block_size=16).dtype == torch.float32


# ----------------------------------------------------------------------------- errors


def _q():
    return np.zeros(4), np.zeros((6, 4)), np.zeros((6, 2))


@pytest.mark.parametrize("call, exc, match", [
    (lambda: R.block_count(10, 0), ValueError, r"block_size must be an int >= 1, got 0"),
    (lambda: R.block_count(10, True), TypeError, r"block_size must be an int"),
    (lambda: F.block_count(10, 2.0), TypeError, r"block_size must be an int"),
    (lambda: R.block_importance(np.ones(5), 2, reduce="sum"), ValueError, r"reduce must be one of \('mean', 'max'\)"),
    (lambda: F.block_importance(torch.ones(5), 2), ValueError, r"importance must have shape \(b, n\)"),
    (lambda: R.block_importance(-np.ones(5), 2), ValueError, r"importance must be >= 0"),
    (lambda: R.block_inclusion_probabilities(np.ones(40), 2.0, block_size=4), ValueError,
     r"budget must exceed the certainty set size \|C\| = 3 \(sink_blocks=1, recent_blocks=2, top_blocks=0\)"),
    (lambda: R.block_inclusion_probabilities(np.ones(40), 11.0, block_size=4), ValueError,
     r"budget must be <= n_blocks = 10"),
    (lambda: F.block_inclusion_probabilities(torch.ones(2, 40), 11.0, block_size=4), ValueError,
     r"budget must be <= n_blocks = 10"),
    (lambda: R.block_inclusion_probabilities(np.ones(40), 5.0, block_size=4, sink_blocks=-1), ValueError,
     r"sink_blocks must be >= 0"),
    (lambda: F.block_inclusion_probabilities(torch.ones(2, 40), 5.0, block_size=4, lengths=torch.tensor([40])),
     ValueError, r"lengths must be an int64 tensor of shape \(b,\) = \(2,\)"),
    (lambda: R.expand_blocks(np.ones(3), 4, 20), ValueError, r"x must have shape \(n_blocks,\) = \(5,\)"),
    (lambda: R.block_keep(np.ones(5), 4, 20), TypeError, r"keep_blocks must be a bool array"),
    (lambda: R.block_sample(np.array([0.5, 1.2]), seed=0), ValueError, r"pi_blocks must lie in \[0, 1\]"),
    (lambda: R.block_sample(np.array([0.5]), seed=0, uniforms=np.zeros(1)), TypeError, r"exactly one of seed="),
    (lambda: F.block_sample(torch.tensor([0.5]), seed=-1), ValueError, r"seed must be >= 0"),
    (lambda: F.block_uniforms((2, 3), torch.tensor([1, 2, 3])), ValueError, r"seed must be an int or a tensor "
     r"broadcastable to the leading dims \(2,\)"),
    (lambda: R.block_hajek_attention(*_q(), np.array([0.5, 0.5, 0.4, 0.4, 1, 1]), block_size=3), ValueError,
     r"pi must be equal on all sampled tokens \(pi < 1\) of a block"),
    (lambda: R.block_hajek_attention(*_q(), np.full(6, 0.5), block_size=2, positions=np.array([0, 1, 2, 3, 4, -1])),
     ValueError, r"pi must be 0 on padding slots"),
    (lambda: R.block_hajek_attention(*_q(), np.full(6, 0.5), block_size=2, positions=np.arange(5)), ValueError,
     r"positions must be an int array of shape \(n,\) = \(6,\)"),
    (lambda: F.block_hajek_attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 2),
                                     torch.tensor([[[0.5, 0.5, 0.4, 0.4, 1, 1]]]), block_size=3), ValueError,
     r"pi must be equal on all sampled tokens \(pi < 1\) of a block"),
    (lambda: F.block_hajek_attention(torch.zeros(1, 1, 4), torch.zeros(1, 1, 6, 4), torch.zeros(1, 1, 6, 2),
                                     torch.full((1, 1, 6), 0.5), block_size=3,
                                     positions=torch.zeros(1, 1, 5, dtype=torch.long)),
     ValueError, r"positions must be an int64 tensor of shape \(b, h_kv, n\) = \(1, 1, 6\)"),
    (lambda: F.block_compact(torch.ones(1, 2, dtype=torch.bool), torch.ones(1, 2), torch.zeros(1, 1, 9, 4),
                             torch.zeros(1, 1, 9, 4), block_size=4), ValueError,
     r"keep_blocks must have shape \(b, n_blocks\) = \(1, 3\)"),
])
def test_errors_name_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_certain_tokens_appended_to_a_sampled_block_are_units_of_their_own():
    """Decode tokens (pi = 1) written into the last, sampled block after the eviction are certain: the
    estimate is the one with those tokens in a block of their own, in both backends."""
    rng = np.random.default_rng(6)
    n, bs = 12, 4
    q, k, v = rng.normal(size=8), rng.normal(size=(n, 8)), rng.normal(size=(n, 3))
    pi = np.array([1.0] * 4 + [0.4] * 4 + [0.7] * 2 + [1.0] * 2)  # slots 10, 11: appended into block 2
    pos = np.arange(n)
    shared = R.block_hajek_attention(q, k, v, pi, block_size=bs, positions=pos)
    apart = R.block_hajek_attention(q, k, v, pi, block_size=bs, positions=np.r_[pos[:10], 40, 41])
    assert shared.trace > 0
    assert_close("trace", shared.trace, apart.trace, 4 * rounding(torch.float64, n) * shared.trace)
    assert_close("covariance", shared.covariance, apart.covariance,
                 4 * rounding(torch.float64, n) * np.abs(shared.covariance).max())
    T = lambda x: torch.from_numpy(np.asarray(x))[None, None]  # noqa: E731
    fast = F.block_hajek_attention(T(q), T(k), T(v), T(pi), block_size=bs, positions=T(pos),
                                   return_covariance=True, return_max_term=True, return_tail_moment=True)
    for f in ("trace", "max_term", "tail_moment", "n_eff"):
        want = getattr(shared, f)
        assert_close(f, getattr(fast, f)[0, 0].numpy(), want, 4 * rounding(torch.float64, n) * abs(want))


def test_block_docstring_examples():
    import doctest

    from kvcert.fast import blocks as fast_blocks
    from kvcert.reference import blocks as ref_blocks

    for module in (ref_blocks, fast_blocks):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_design_inclusion_probabilities_is_the_chain_decide_runs():
    """``BlockDesign.inclusion_probabilities(scores, budget)`` (the replay's call) is the block importance of
    ``block_importance`` followed by the pi of ``decide`` at the same budget (up to the second normalization
    of decide's block-level call, ~1e-15), and shifts a negative-score head as ``block_importance`` does."""
    g = torch.Generator().manual_seed(3)
    design = F.BlockDesign(compression_ratio=0.5, block_size=16, sink_blocks=1, recent_blocks=2, top_blocks=1,
                           reduce="max")
    scores = torch.rand(1, 4, 3, 200, generator=g, dtype=torch.float64)
    scores[0, 1, 2] -= 0.7  # one head with negative scores: shifted by its minimum
    nb = design.n_blocks(200)
    budget = design.budget(nb)
    pi = design.inclusion_probabilities(scores, budget)
    decided = design.decide(design.block_importance(scores)[0], event=0, n_tokens=200)
    assert pi.shape == (1, nb) and pi.dtype == torch.float64
    assert torch.allclose(pi[0], decided.pi, rtol=1e-13, atol=0)
    assert abs(float(pi.sum()) - budget) < 1e-9
    # the shift is what makes these scores admissible: unshifted, the function refuses them
    with pytest.raises(ValueError, match="importance must be >= 0"):
        F.block_inclusion_probabilities(scores, budget, block_size=16, sink_blocks=1, recent_blocks=2, top_blocks=1,
                                        reduce="max")
