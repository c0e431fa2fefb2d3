"""The opt-in "expected" importance (issue 7): SnapKV mixed with expected attention.

kvcert.fast vs the float64 reference slice by slice (GQA groups); the Gaussian
log-MGF formula itself against Monte Carlo; the mix endpoints; edge cases and
bad input. Tolerances: the fast result at dtype D must satisfy
|fast - ref64| <= 2 |naive_D - ref64| + rounding (tests/support.py),
with naive_D the docstring's literal mu/C formula evaluated by plain torch at
the compute dtype; Monte Carlo checks allow 4 standard errors.
"""

from __future__ import annotations

import doctest
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy.special import softmax

import kvcert.fast as F
import kvcert.reference as R
from kvcert.reference import baselines as RB
from support import COMPUTE, EPS, assert_close, lengths, qk_windows, rounding


def _naive_expected(qw: torch.Tensor, k: torch.Tensor, tau: float, dt: torch.dtype) -> torch.Tensor:
    """The docstring's literal formula at dtype ``dt``: qw (m, d), k (n, d) -> softmax of the logit (n,)."""
    qw, k = qw.to(dt), k.to(dt)
    m, d = qw.shape
    mu = qw.mean(0)
    c = qw - mu
    cov = c.T @ c / (m - 1) if m > 1 else torch.zeros(d, d, dtype=dt)
    logit = tau * (k @ mu) + 0.5 * tau ** 2 * ((k @ cov) * k).sum(-1)
    return torch.softmax(logit, -1)


def _logit64(qw: np.ndarray, k: np.ndarray, tau: float) -> np.ndarray:
    """tau mu.k + tau^2/2 k'Ck with NumPy's own mean and covariance (ddof = 1)."""
    cov = np.atleast_2d(np.cov(qw.T)) if qw.shape[0] > 1 else np.zeros((qw.shape[1],) * 2)
    return tau * k @ qw.mean(0) + 0.5 * tau ** 2 * np.einsum("id,de,ie->i", k, cov, k)


def _snap_rel_tol(dtype, n, w):
    # relative error of a SnapKV entry (tests/test_fast_scorers.py: 4 w rounding), twice after
    # normalizing by the sum, plus the rounding of the sum itself
    return 8 * w * rounding(dtype, n) + rounding(dtype, n)


mixes = st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 1.0))


@given(n=lengths(130),
       w=st.integers(1, 12), kernel=st.sampled_from([1, 3, 7]), mix=mixes,
       b=st.integers(1, 2), h_kv=st.integers(1, 2), g=st.sampled_from([1, 3]), d=st.sampled_from([4, 16]),
       seed=st.integers(0, 10**6), dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       spread=st.sampled_from([1.0, 1.0, 3.0]), scale=st.sampled_from([None, None, 0.7]))
def test_fast_matches_reference(n, w, kernel, mix, b, h_kv, g, d, seed, dtype, spread, scale):
    w = min(w, n)
    q, k = qk_windows(b, h_kv, g, w, n, d, seed, dtype, spread)
    got = F.expected_attention_scores(q, k, scale=scale, kernel_size=kernel, mix=mix)
    dt = COMPUTE[dtype]
    assert got.shape == (b, h_kv, n) and got.dtype == dt
    tau = 1 / math.sqrt(d) if scale is None else scale
    for bi in range(b):
        for h in range(h_kv):
            qg, kh = q[bi, h * g:(h + 1) * g], k[bi, h]
            args = (qg.double().numpy(), kh.double().numpy())
            want = R.expected_attention_scores(*args, scale=scale, kernel_size=kernel, mix=mix)
            snap = R.snapkv_scores(*args, scale=scale, kernel_size=kernel)
            e_ref = R.expected_attention_scores(*args, scale=scale, kernel_size=kernel, mix=1.0)
            naive = _naive_expected(qg.reshape(-1, d), kh, tau, dt).double().numpy()
            # the low-precision error of the literal formula, relative, worst over the slice
            e_rel = float(np.max(np.abs(naive - e_ref) / np.maximum(e_ref, np.finfo(np.float64).tiny)))
            tol = ((1 - mix) * snap / snap.sum() * _snap_rel_tol(dtype, n, w)
                   + mix * e_ref * (2 * e_rel + 4 * rounding(dtype, n)) + EPS[dt] * want)
            assert_close("expected", got[bi, h].double().numpy(), want, tol)
    assert bool(torch.all(got >= 0))
    assert_close("sum", got.sum(-1).double().numpy(), np.ones((b, h_kv)), rounding(dtype, n))


@given(n=st.integers(1, 70), w=st.integers(1, 8), g=st.sampled_from([1, 2, 3]), kernel=st.sampled_from([1, 7]),
       seed=st.integers(0, 10**6), dtype=st.sampled_from([torch.float64, torch.float32]))
def test_mix_endpoints(n, w, g, kernel, seed, dtype):
    w = min(w, n)
    q, k = qk_windows(1, 2, g, w, n, 8, seed, dtype)
    # mix = 0: normalized SnapKV, bit for bit (same scores, same softmax, same pool)
    snap = F.snapkv_scores(q, k, kernel_size=kernel)
    assert torch.equal(F.expected_attention_scores(q, k, kernel_size=kernel, mix=0.0),
                       snap / snap.sum(-1, keepdim=True))
    tau = 1 / math.sqrt(8)
    for h in range(2):
        qg, kh = q[0, h * g:(h + 1) * g].double().numpy(), k[0, h].double().numpy()
        r_snap = R.snapkv_scores(qg, kh, kernel_size=kernel)
        assert np.array_equal(R.expected_attention_scores(qg, kh, kernel_size=kernel, mix=0), r_snap / r_snap.sum())
        # mix = 1: the softmax of the logit, here from NumPy's mean and covariance (no causal mask)
        e = softmax(_logit64(qg.reshape(-1, 8), kh, tau))
        assert_close("ref mix=1", R.expected_attention_scores(qg, kh, kernel_size=kernel, mix=1), e,
                     4 * rounding(torch.float64, n) * e)
        naive = _naive_expected(torch.from_numpy(qg.reshape(-1, 8)), torch.from_numpy(kh), tau,
                                COMPUTE[dtype]).double().numpy()
        tol = e * (2 * np.max(np.abs(naive - e) / e) + 4 * rounding(dtype, n))
        assert_close("fast mix=1", F.expected_attention_scores(q, k, kernel_size=kernel, mix=1)[0, h].numpy(), e, tol)


def _ratio_to_zero_key(backend, window, keys, tau):
    """exp(logit_i) read off the output as e_i / e_0, where keys[0] = 0 has logit 0 (mix = 1)."""
    if backend == "fast":
        u = F.expected_attention_scores(torch.from_numpy(window)[None], torch.from_numpy(keys)[None, None],
                                        scale=tau, mix=1.0)[0, 0].numpy()
    else:
        u = R.expected_attention_scores(window, keys, scale=tau, mix=1.0)
    return u / u[0]


def _test_keys(rng, cov, tau, n_test, d):
    """Keys with tau^2 k'Ck in [0.3, 1.2] (a moderate lognormal tail for the MC mean); key 0 = 0."""
    dirs = rng.normal(size=(n_test, d))
    target = rng.uniform(0.3, 1.2, size=n_test)
    dirs *= np.sqrt(target / (tau ** 2 * np.einsum("id,de,ie->i", dirs, cov, dirs)))[:, None]
    return np.vstack([np.zeros((1, d)), dirs])


def _mc(rng, mean, cov, keys, tau, draws):
    """Monte Carlo mean of exp(tau q.k_i) over fresh q ~ N(mean, cov), and its standard error."""
    x = np.exp(tau * rng.multivariate_normal(mean, cov, size=draws) @ keys.T)
    return x.mean(0), x.std(0, ddof=1) / np.sqrt(draws)


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_gaussian_formula_matches_monte_carlo_under_the_sample_fit(backend):
    # A small window (m = g w = 8) from N(mu, C): the formula must be the MGF of N(mu_hat, C_hat)
    # with C_hat's divisor m - 1; fresh q from that law, exp(logit) against the MC mean within 4 SE.
    rng = np.random.default_rng(7)
    d, g, w, tau, draws = 4, 2, 4, 0.5, 400_000
    a = rng.normal(size=(d, d))
    window = rng.multivariate_normal(rng.normal(size=d), a @ a.T / d + 0.5 * np.eye(d), size=(g, w))
    qw = window.reshape(-1, d)
    mu_hat, cov_hat = qw.mean(0), np.cov(qw.T)  # NumPy's, ddof = 1
    keys = _test_keys(rng, cov_hat, tau, 5, d)
    got = _ratio_to_zero_key(backend, window, keys, tau)
    mc, se = _mc(rng, mu_hat, cov_hat, keys, tau, draws)
    tol = 4 * se + 8 * EPS[torch.float32] * mc
    assert np.all(np.abs(got - mc) <= tol), (got, mc, tol)
    # power: the divisor m (ddof = 0) or a missing 1/2 on the variance term would be rejected
    quad = tau ** 2 * np.einsum("id,de,ie->i", keys, cov_hat, keys)
    lin = tau * keys @ mu_hat
    for wrong in (np.exp(lin + 0.5 * quad * (g * w - 1) / (g * w)), np.exp(lin + quad)):
        assert np.any(np.abs(wrong - mc) > tol)


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_gaussian_formula_matches_monte_carlo_under_the_true_law(backend):
    # A long window (m = 2048) of i.i.d. N(mu, C) queries; fresh q from the same N(mu, C).
    # log(MC mean) - logit_hat has variance (delta method, mu_hat independent of C_hat):
    # tau^2 k'Ck / m  +  tau^4 (k'Ck)^2 / (2 (m - 1))  +  (SE / MC mean)^2.
    rng = np.random.default_rng(11)
    d, g, w, tau, draws = 4, 2, 1024, 0.5, 400_000
    a = rng.normal(size=(d, d))
    mu, cov = rng.normal(size=d), a @ a.T / d + 0.5 * np.eye(d)
    window = rng.multivariate_normal(mu, cov, size=(g, w))
    keys = _test_keys(rng, cov, tau, 5, d)
    keys = np.vstack([keys, rng.normal(size=(w - keys.shape[0], d))])  # SnapKV needs n >= w: filler keys
    got = np.log(_ratio_to_zero_key(backend, window, keys, tau)[1:6])
    mc, se = _mc(rng, mu, cov, keys[1:6], tau, draws)
    m = g * w
    s2 = tau ** 2 * np.einsum("id,de,ie->i", keys[1:6], cov, keys[1:6])
    sd = np.sqrt(s2 / m + s2 ** 2 / (2 * (m - 1)) + (se / mc) ** 2)
    assert np.all(np.abs(got - np.log(mc)) <= 4 * sd), (got, np.log(mc), 4 * sd)
    assert np.all(np.abs(np.log(mc) - tau * keys[1:6] @ mu) > 4 * sd)  # power: the variance term matters


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_edge_cases_give_no_nan(dtype):
    # n = 1 with w = 1 (m = 1, C = 0): u = [1]
    one = F.expected_attention_scores(torch.randn(1, 1, 1, 4, dtype=dtype), torch.randn(1, 1, 1, 4, dtype=dtype))
    assert torch.equal(one, torch.ones(1, 1, 1, dtype=dtype))
    assert np.array_equal(R.expected_attention_scores(np.ones((1, 4)), np.ones((1, 4))), [1.0])
    # identical keys: every logit is the same, e is uniform
    q, k = torch.randn(1, 3, 4, 4, dtype=dtype), torch.ones(1, 1, 6, 4, dtype=dtype)
    assert_close("identical", F.expected_attention_scores(q, k, mix=1.0)[0, 0].numpy(), np.full(6, 1 / 6),
                 rounding(dtype, 6) / 6)
    assert_close("identical ref", R.expected_attention_scores(q[0].double().numpy(), k[0, 0].double().numpy(),
                                                              mix=1.0), np.full(6, 1 / 6), rounding(torch.float64, 6))
    # m = 1 (g = 1, w = 1): C = 0, the logit is tau q.k, i.e. the softmax of the last query
    q1, k1 = torch.randn(1, 1, 1, 4, dtype=torch.float64), torch.randn(1, 1, 9, 4, dtype=torch.float64)
    want = softmax(k1[0, 0].numpy() @ q1[0, 0, 0].numpy() / 2)
    assert_close("m=1", R.expected_attention_scores(q1[0, 0].numpy(), k1[0, 0].numpy(), mix=1.0), want,
                 rounding(torch.float64, 9) * want)
    # (w, d) and (1, w, d) are the same window in the reference
    qs, ks = np.random.default_rng(0).normal(size=(5, 4)), np.random.default_rng(1).normal(size=(9, 4))
    assert np.array_equal(R.expected_attention_scores(qs, ks), R.expected_attention_scores(qs[None], ks))


@pytest.mark.parametrize("scale", [1e3, 1e10, 1e18, 1e30])
def test_huge_scales_give_a_distribution(scale):
    q, k = qk_windows(1, 2, 3, 4, 20, 8, 3, torch.float32)
    for mix in (0.0, 0.5, 1.0):
        u = F.expected_attention_scores(q, k, scale=scale, mix=mix)
        assert bool(torch.isfinite(u).all()) and bool((u >= 0).all())
        assert_close("sum", u.sum(-1).numpy(), np.ones((1, 2)), rounding(torch.float32, 20))
        for h in range(2):
            r = R.expected_attention_scores(q[0, 3 * h:3 * h + 3].double().numpy(), k[0, h].double().numpy(),
                                            scale=scale, mix=mix)
            assert np.all(np.isfinite(r)) and abs(r.sum() - 1) <= rounding(torch.float64, 20)
    # at 1e3 the logits (~1e6) overflow exp without the max subtraction; both backends put
    # all of e on the same key, the argmax of the float64 logit
    for h in range(2):
        qw = q[0, 3 * h:3 * h + 3].double().numpy().reshape(-1, 8)
        top = int(np.argmax(_logit64(qw, k[0, h].double().numpy(), 1e3)))
        e = F.expected_attention_scores(q, k, scale=1e3, mix=1.0)[0, h]
        assert int(torch.argmax(e)) == top and float(e[top]) == 1.0


def test_overflowing_scores_raise_instead_of_nan():
    q, k = qk_windows(1, 1, 1, 2, 5, 4, 0, torch.float32)
    with pytest.raises(ValueError, match="must be finite"):
        F.expected_attention_scores(q, k * 1e20, scale=1e20)  # tau q.k ~ 1e40 overflows float32
    with pytest.raises(ValueError, match="must be finite"):
        F.expected_attention_scores(q, k.index_fill(2, torch.tensor([1]), float("nan")))
    with pytest.raises(ValueError, match="keys must be finite"):
        R.expected_attention_scores(np.ones((2, 4)), np.full((5, 4), np.nan))
    with pytest.raises(ValueError, match="queries must be finite"):
        R.expected_attention_scores(np.full((2, 4), np.inf), np.ones((5, 4)))


@pytest.mark.parametrize("call, exc, words", [
    (lambda q, k: F.expected_attention_scores(q, k, mix=1.5), ValueError, "mix must be a float in [0, 1]"),
    (lambda q, k: F.expected_attention_scores(q, k, mix=-0.1), ValueError, "mix must be a float in [0, 1]"),
    (lambda q, k: F.expected_attention_scores(q, k, mix=float("nan")), ValueError, "mix must be a float in [0, 1]"),
    (lambda q, k: F.expected_attention_scores(q, k, mix="half"), TypeError, "mix must be a float"),
    (lambda q, k: F.expected_attention_scores(q, k, mix=True), TypeError, "mix must be a float"),
    (lambda q, k: F.expected_attention_scores(q, k, kernel_size=4), ValueError, "kernel_size must be a positive odd"),
    (lambda q, k: F.expected_attention_scores(q[:, :, :, :3], k), ValueError, "queries must have shape"),
    (lambda q, k: F.expected_attention_scores(q[0], k), ValueError, "queries must be 4-d"),
    (lambda q, k: F.expected_attention_scores(q[:, :1].expand(1, 5, 4, 8), k), ValueError, "multiple of h_kv"),
    (lambda q, k: F.expected_attention_scores(q.repeat(1, 1, 5, 1), k), ValueError, "longer than the cache"),
    (lambda q, k: F.expected_attention_scores(q, k[0]), ValueError, "keys must be 4-d"),
    (lambda q, k: F.expected_attention_scores(q, k[:, :, :0]), ValueError, "n >= 1"),
    (lambda q, k: F.expected_attention_scores(q.numpy(), k), TypeError, "queries must be a torch.Tensor"),
    (lambda q, k: F.expected_attention_scores(q, k, scale=-1.0), ValueError, "scale must be a finite positive"),
    (lambda q, k: R.expected_attention_scores(q[0, 0], k[0, 0], mix=2), ValueError, "mix must be a float in [0, 1]"),
    (lambda q, k: R.expected_attention_scores(q[0, 0], k[0, 0], mix=None), TypeError, "mix must be a float"),
    (lambda q, k: R.expected_attention_scores(q[0, 0, :, :3], k[0, 0]), ValueError, "queries must have shape"),
    (lambda q, k: R.expected_attention_scores(q[0, 0], k[0]), ValueError, "keys must have shape (n, d)"),
    (lambda q, k: R.expected_attention_scores(q[0, 0].repeat(5, 1), k[0, 0]), ValueError, "longer than the cache"),
    (lambda q, k: R.expected_attention_scores(q[0, 0], k[0, 0], kernel_size=2), ValueError, "kernel_size"),
])
def test_bad_input_names_the_argument(call, exc, words):
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 10, 8)
    with pytest.raises(exc) as e:
        call(q, k)
    assert words in str(e.value)


def test_reference_docstring_example():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for t in finder.find(RB.expected_attention_scores, "expected_attention_scores"):
        runner.run(t)
    assert runner.tries > 0 and runner.failures == 0
