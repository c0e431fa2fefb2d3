"""kvcert.fast.certificate vs the reference, and exact design properties by enumeration."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.fast as F
import kvcert.reference as R
from support import assert_certificate_matches_reference, float64_batches


@given(n=st.integers(1, 60), dv=st.sampled_from([1, 4, 9]), delta=st.sampled_from([0.01, 0.05, 0.3]),
       data=st.data())
def test_every_kind_matches_reference(n, dv, delta, data):
    b, h_kv, g = 2, 2, 2
    q, k, v, pi = data.draw(float64_batches(n, dv, b=b, h_kv=h_kv, g=g))
    est = F.hajek_attention(q, k, v, pi, return_max_term=True, return_covariance=True,
                             return_tail_moment=True)
    for kind in F.KINDS:
        cert = F.certificate(est, delta=delta, kind=kind)
        assert cert.kind == kind and cert.delta == delta
        assert_certificate_matches_reference(cert, q, k, v, pi, delta=delta, kind=kind)


def test_radius_shapes_and_zero_variance():
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 2, 30, 8), torch.randn(2, 2, 30, 5)
    est = F.hajek_attention(q, k, v, torch.ones(2, 2, 30), return_max_term=True, return_covariance=True,
                             return_tail_moment=True)
    for kind in F.KINDS:
        cert = F.certificate(est, kind=kind)
        want_shape = (2, 4, 5) if kind == "wald" else (2, 4)
        assert cert.radius.shape == want_shape and cert.relative_radius.shape == (2, 4)
        assert cert.lower.shape == (2, 4, 5)
        assert torch.all(cert.radius == 0) and torch.all(cert.relative_radius == 0)


def test_relative_radius_conventions():
    est = F.Estimate(output=torch.zeros(1, 2, 3), weights=None, variance=None, trace=torch.tensor([[1.0, 0.0]]),
                     lse=torch.zeros(1, 2))
    cert = F.certificate(est, kind="chebyshev")
    assert cert.relative_radius[0, 0] == math.inf and cert.relative_radius[0, 1] == 0.0


@pytest.mark.parametrize("kind, kw, words", [
    ("wald", dict(per_coordinate=False), "per_coordinate=True"),
    ("chi2", dict(), "return_covariance=True"),
    ("bernstein", dict(), "return_max_term=True"),
])
def test_missing_moments_are_named(kind, kw, words):
    est = F.hajek_attention(torch.randn(1, 1, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 2),
                            torch.full((1, 1, 6), 0.5), **kw)
    with pytest.raises(ValueError) as e:
        F.certificate(est, kind=kind)
    assert words in str(e.value)


def test_certificate_argument_errors():
    est = F.hajek_attention(torch.randn(1, 1, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 2),
                            torch.full((1, 1, 6), 0.5))
    with pytest.raises(ValueError, match="delta must be in"):
        F.certificate(est, delta=1.0)
    with pytest.raises(TypeError, match="delta must be a float"):
        F.certificate(est, delta="0.1")
    with pytest.raises(ValueError, match="kind must be one of"):
        F.certificate(est, kind="hoeffding")
    with pytest.raises(TypeError, match="kvcert.fast.types.Estimate"):
        F.certificate(R.hajek_attention(np.ones(2), np.ones((3, 2)), np.ones((3, 1)), np.ones(3)))


def test_horvitz_thompson_unbiased_by_enumeration():
    """E[Z_hat] = Z and E[N_hat] = N exactly over all 2^n Poisson samples (n = 10), batched."""
    rng = np.random.default_rng(0)
    n, d, dv = 10, 6, 3
    q = rng.normal(size=d)
    k, v = rng.normal(size=(n, d)), rng.normal(size=(n, dv))
    p = rng.uniform(0.1, 1.0, size=n)
    p[0] = 1.0
    masks = np.array(list(itertools.product([0, 1], repeat=n)), dtype=bool)  # (1024, n)
    prob = np.prod(np.where(masks, p, 1 - p), axis=1)
    pi_s = torch.from_numpy(np.where(masks, p, 0.0))[:, None, :]  # unsampled -> padding
    K = torch.from_numpy(k).expand(len(masks), 1, n, d)
    V = torch.from_numpy(v).expand(len(masks), 1, n, dv)
    Q = torch.from_numpy(q).expand(len(masks), 1, d)
    est = F.hajek_attention(Q, K, V, pi_s, per_coordinate=False)
    z_hat = torch.exp(est.lse[:, 0]).numpy()  # 0 for the empty sample (lse = -inf)
    n_hat = z_hat[:, None] * est.output[:, 0].numpy()
    s = k @ q / math.sqrt(d)
    Z, N = np.exp(s).sum(), np.exp(s) @ v
    assert abs(prob @ z_hat - Z) <= 1e-12 * Z
    assert np.allclose(prob @ n_hat, N, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", F.KINDS)
def test_the_reference_check_rejects_a_certificate_of_a_slightly_wrong_variance(kind):
    """Negative control of ``assert_certificate_matches_reference``: the certificate of an estimate
    whose variance moments (variance, covariance, trace) are 1e-6 too large relative (its radius
    moves by 5e-7 relative, far above the check's 1e-9 float64 allowance) fails the check."""
    import dataclasses

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((1, 2, 8), (1, 1, 40, 8), (1, 1, 40, 4)))
    pi = torch.rand(1, 1, 40, generator=gen, dtype=torch.float64) * 0.8 + 0.1
    est = F.hajek_attention(q, k, v, pi, return_max_term=True, return_covariance=True, return_tail_moment=True)
    assert_certificate_matches_reference(F.certificate(est, delta=0.05, kind=kind), q, k, v, pi, delta=0.05,
                                         kind=kind)
    up = 1 + 1e-6
    wrong = dataclasses.replace(est, variance=est.variance * up, covariance=est.covariance * up, trace=est.trace * up)
    with pytest.raises(AssertionError, match=f"{kind} "):
        assert_certificate_matches_reference(F.certificate(wrong, delta=0.05, kind=kind), q, k, v, pi, delta=0.05,
                                             kind=kind)
