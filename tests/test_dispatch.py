"""Backend dispatch (kvcert.dispatch): selection rules, forcing, routing and the reference loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcert import dispatch as D
from kvcert import reference as R
from support import make_case


@pytest.fixture(autouse=True)
def _no_forced_backend(monkeypatch):
    monkeypatch.delenv(D.ENV_VAR, raising=False)


def _case(seed=0, b=2, h_kv=2, g=2, n=9, d=8, dv=5, t=None):
    """float32 (q, k, v, pi) with ragged padding; q (b, h_q, d), or (b, h_q, t, d) with t queries."""
    return make_case(seed, b, h_kv, g, n, d, dv, torch.float32, pad="ragged", pi_kind="interior", t=t)


def test_automatic_choice_on_cpu_is_fast():
    q = torch.randn(1, 2, 8)
    assert D.select_backend(q) == "fast"
    assert D.select_backend() == "fast"
    assert D.select_backend(q.double()) == "fast"


@pytest.mark.parametrize("name", D.BACKENDS)
def test_environment_variable_forces_and_argument_overrides(monkeypatch, name):
    q = torch.randn(1, 2, 8)
    monkeypatch.setenv(D.ENV_VAR, name.upper())
    assert D.select_backend(q) == name
    other = "reference" if name != "reference" else "fast"
    assert D.select_backend(q, backend=other) == other
    monkeypatch.setenv(D.ENV_VAR, "auto")
    assert D.select_backend(q) == "fast"


def test_bad_backend_names(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        D.select_backend(torch.zeros(1), backend="cuda")
    with pytest.raises(TypeError, match="backend must be a str"):
        D.select_backend(torch.zeros(1), backend=3)
    monkeypatch.setenv(D.ENV_VAR, "numpy")
    with pytest.raises(ValueError, match="KVCERT_BACKEND must be one of"):
        D.hajek_attention(*_case())
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        D.hajek_attention(np.zeros((1, 2, 8)), *_case()[1:], backend="fast")


def test_fast_routing_and_last_backend():
    fast = pytest.importorskip("kvcert.fast")
    q, k, v, pi = _case()
    est = D.hajek_attention(q, k, v, pi, block_n=32, num_splits=2)  # kernel hints are dropped for fast
    assert D.last_backend() == "fast"
    direct = fast.hajek_attention(q, k, v, pi)
    for f in ("output", "variance", "trace", "lse", "n_eff"):
        assert torch.equal(getattr(est, f), getattr(direct, f)), f
    D.hajek_attention(q, k, v, pi, backend="reference")
    assert D.last_backend() == "reference"


@pytest.mark.parametrize("t", [None, 3])
@pytest.mark.parametrize("use_log", [False, True])
def test_reference_loop_matches_the_oracle_slice_by_slice(t, use_log):
    """GQA mapping (query head h reads KV head h // g) and packing are exact: each slice equals
    kvcert.reference.hajek_attention cast to float32."""
    q, k, v, pi = _case(t=t)
    kw = dict(log_pi=torch.log(pi.double())) if use_log else dict(pi=pi)
    est = D.hajek_attention(q, k, v, backend="reference", return_covariance=True, **kw)
    g = q.shape[1] // k.shape[1]
    for bi in range(q.shape[0]):
        for h in range(q.shape[1]):
            for j in range(1 if t is None else t):
                qq = q[bi, h] if t is None else q[bi, h, j]
                e = R.hajek_attention(qq.double().numpy(), k[bi, h // g].double().numpy(),
                                      v[bi, h // g].double().numpy(), pi[bi, h // g].double().numpy())
                idx = (bi, h) if t is None else (bi, h, j)
                for f in ("output", "variance", "weights", "trace", "lse", "n_eff", "max_term", "covariance"):
                    want = torch.as_tensor(np.asarray(getattr(e, f))).float()
                    assert torch.equal(getattr(est, f)[idx], want), (f, idx)


def test_reference_masks_follow_fast():
    """bias and the causal mask (positions, query_positions / offset) mean the same as in kvcert.fast:
    the reference loop equals the oracle called with the equivalent additive bias."""
    q, k, v, pi = _case(t=2, n=7)
    pos = torch.arange(7).flip(0).expand(2, 2, 7).contiguous()
    est = D.hajek_attention(q, k, v, pi, backend="reference", positions=pos, offset=3)
    g = 2
    for bi in range(2):
        for h in range(4):
            for j in range(2):
                bias = np.where(pos[bi, h // g].numpy() <= 3 + j, 0.0, -np.inf)
                e = R.hajek_attention(q[bi, h, j].double().numpy(), k[bi, h // g].double().numpy(),
                                      v[bi, h // g].double().numpy(), pi[bi, h // g].double().numpy(), bias=bias)
                assert torch.equal(est.output[bi, h, j], torch.as_tensor(e.output).float())
                assert torch.equal(est.lse[bi, h, j], torch.tensor(e.lse, dtype=torch.float32))


def test_reference_input_errors():
    q, k, v, pi = _case()
    with pytest.raises(TypeError, match="exactly one of pi and log_pi"):
        D.hajek_attention(q, k, v, backend="reference")
    with pytest.raises(ValueError, match="pi must have shape"):
        D.hajek_attention(q, k, v, pi[..., :3], backend="reference")
    with pytest.raises(ValueError, match="multiple of h_kv"):
        D.hajek_attention(q[:, :3], k, v, pi, backend="reference")
    with pytest.raises(ValueError, match=r"log_pi must lie in \[-inf, 0\]"):
        D.hajek_attention(q, k, v, log_pi=pi, backend="reference")
    with pytest.raises(TypeError, match="unexpected keyword"):
        D.hajek_attention(q, k, v, pi, backend="reference", colour="red")


def test_fast_only_options_route_automatic_calls_to_fast():
    """return_max_term (bernstein) and the masks are kvcert.fast options: the automatic choice is
    "fast" whatever the device; forcing "triton" with them is a TypeError."""
    q = torch.randn(1, 2, 8)
    assert D.select_backend(q, return_max_term=True) == "fast"
    assert D.select_backend(q, return_max_term=False) == "fast"
    assert D._fast_only({"return_max_term": True, "bias": None, "offset": 0}) == ["offset", "return_max_term"]
    assert D._fast_only({"return_max_term": False, "block_n": 64}) == []
    pytest.importorskip("triton")
    from kvcert import kernels

    if not (kernels.INTERPRETED or torch.cuda.is_available()):
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA to reach the kernel")
    dev = "cpu" if kernels.INTERPRETED else "cuda"
    q, k, v, pi = (x.to(dev) for x in _case())
    with pytest.raises(TypeError, match="does not support return_max_term"):
        D.hajek_attention(q, k, v, pi, backend="triton", return_max_term=True)


def test_forced_triton_runs_the_kernel_or_says_why(monkeypatch):
    pytest.importorskip("triton")
    from kvcert import kernels

    q, k, v, pi = _case(n=40, d=16, dv=16)
    if kernels.INTERPRETED:
        est = D.hajek_attention(q, k, v, pi, backend="triton", block_n=16)
        assert D.last_backend() == "triton"
        direct = kernels.hajek_attention(q, k, v, pi, block_n=16)
        for f in ("output", "variance", "trace", "lse", "n_eff"):
            assert torch.equal(getattr(est, f), getattr(direct, f)), f
        monkeypatch.setattr(kernels, "INTERPRETED", False)  # as if TRITON_INTERPRET were unset
    monkeypatch.setenv(D.ENV_VAR, "triton")
    with pytest.raises(D.BackendUnavailableError, match="need CUDA tensors, or TRITON_INTERPRET=1"):
        D.hajek_attention(q, k, v, pi)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_choose_triton():
    pytest.importorskip("triton")
    q, k, v, pi = (x.cuda() for x in _case(n=70, d=64, dv=64))
    for dtype in (torch.float32, torch.bfloat16):
        assert D.select_backend(q.to(dtype)) == "triton"
    assert D.select_backend(q.double()) == "fast"
    assert D.select_backend(q.unsqueeze(2).expand(-1, -1, 2, -1)) == "fast"  # t > 1: not a decode
    assert D.select_backend(q, return_max_term=True) == "fast"
    D.hajek_attention(q, k, v, pi)
    assert D.last_backend() == "triton"
