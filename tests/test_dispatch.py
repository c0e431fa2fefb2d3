"""Backend dispatch (kvcert.dispatch): selection rules, forcing, routing and the reference loop."""

from __future__ import annotations

import threading
import warnings

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


def test_fast_routing_and_the_route_on_the_result():
    fast = pytest.importorskip("kvcert.fast")
    q, k, v, pi = _case()
    est = D.hajek_attention(q, k, v, pi, block_n=32, num_splits=2)  # kernel hints are dropped for fast
    assert (est.backend, est.route) == ("fast", "torch")  # per_coordinate: not the CPU op's call
    direct = fast.hajek_attention(q, k, v, pi)
    assert (direct.backend, direct.route) == (None, None)  # a backend called directly: not routed
    for f in ("output", "variance", "trace", "lse", "n_eff"):
        assert torch.equal(getattr(est, f), getattr(direct, f)), f
    ref = D.hajek_attention(q, k, v, pi, backend="reference")
    assert (ref.backend, ref.route) == ("reference", "reference")


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
        assert (est.backend, est.route) == ("triton", "triton")
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
    est = D.hajek_attention(q, k, v, pi)
    assert (est.backend, est.route) == ("triton", "triton")


# ----------------------------------------------------------------------------- the route on the result
def _op():
    """kvcert.kernels.cpu where the compiled op builds here, else a skip."""
    cpu = pytest.importorskip("kvcert.kernels.cpu")
    if not cpu.available():
        pytest.skip(f"the compiled CPU op cannot be built here: {cpu.unavailable_reason()}")
    return cpu


def _interpreted_kernels():
    """kvcert.kernels on the Triton interpreter, else a skip (CUDA runs are test_cuda_tensors_choose_triton's)."""
    pytest.importorskip("triton")
    from kvcert import kernels

    if not kernels.INTERPRETED:
        pytest.skip("needs TRITON_INTERPRET=1 to run the kernel on CPU tensors")
    return kernels


def _sketched(seed=0, n=40):
    """(q, k, v, log_pi, sketch, mu, r2): a kept cache and a tilted sketch of other tokens of the same heads."""
    fast = pytest.importorskip("kvcert.fast")
    q, k, v, pi = _case(seed, n=n, d=16, dv=16)
    g = torch.Generator().manual_seed(seed + 1)
    b, h_kv, _, d = k.shape
    ek, ev = torch.randn(b, h_kv, 3 * n, d, generator=g), torch.randn(b, h_kv, 3 * n, 16, generator=g)
    epi = torch.rand(b, h_kv, 3 * n, generator=g).clamp_(0.05, 0.95)
    keep = torch.rand(b, h_kv, 3 * n, generator=g) < 0.3
    design = fast.ClusterDesign(clusters=4, radius="chebyshev", tilt=True)
    sketch = fast.cluster_sketch(ek, ev, epi, keep, design, tilt=torch.randn(b, h_kv, d, generator=g))
    mu, r2 = fast.value_moments(v, pi)
    return q, k, v, pi.log(), sketch, mu, r2


def _layer(k, v, log_pi, mu, r2, **kw):
    """A stand-in cache layer with what kvcert.dispatch.decode reads."""
    from types import SimpleNamespace

    n = k.shape[2]
    attrs = dict(keys=k, values=v, log_weights=log_pi, positions=torch.arange(n).expand(*k.shape[:2], n),
                 valid=log_pi > float("-inf"), kept=(log_pi > float("-inf")).sum(-1), block_size=None, sketch=None,
                 value_moments=lambda distances=True: (mu, r2 if distances else None))
    return SimpleNamespace(**{**attrs, **kw})


def _direct(name):
    """The backend function a route's result must equal bit for bit (None: compared with the oracle elsewhere)."""
    fast = pytest.importorskip("kvcert.fast")
    return {"cpu_op": lambda q, k, v, pi, **kw: _op().hajek_attention(q, k, v, pi, **kw),
            "torch": fast.hajek_attention,
            "triton": lambda q, k, v, pi, **kw: _interpreted_kernels().hajek_attention(q, k, v, pi, block_n=16, **kw),
            "reference": None}[name]


#: each code's Route
CODES = {"cpu_op": D.CPU_OP, "torch": D.TORCH, "triton": D.TRITON, "reference": D.REFERENCE}
#: per code: the arguments of a kvcert.dispatch.hajek_attention call that runs it (on CPU tensors)
TOKEN_CALLS = {"cpu_op": dict(per_coordinate=False), "torch": dict(per_coordinate=True),
               "triton": dict(backend="triton", block_n=16), "reference": dict(backend="reference")}


@pytest.mark.parametrize("code", list(TOKEN_CALLS))
def test_each_token_route_is_on_its_result(code):
    """hajek_attention's estimate names the code that computed it, and that code's own call gives the same
    numbers bit for bit (the label is what ran, not a guess)."""
    if code == "cpu_op":
        _op()
    if code == "triton":
        _interpreted_kernels()
    q, k, v, pi = _case(n=40, d=16, dv=16)
    est = D.hajek_attention(q, k, v, pi, **TOKEN_CALLS[code])
    assert (est.backend, est.route) == (CODES[code].backend, CODES[code].code)
    direct = _direct(code)
    if direct is not None:
        want = direct(q, k, v, pi, per_coordinate=TOKEN_CALLS[code].get("per_coordinate", True))
        for f in ("output", "trace", "lse"):
            assert torch.equal(getattr(est, f), getattr(want, f)), f


@pytest.mark.parametrize("code", ["cpu_op", "torch"])
def test_the_sketch_route_is_on_its_result(code, monkeypatch):
    """sketch_hajek_attention's ``result.estimate`` names the code: the op for a trace=False call on CPU, kvcert.fast
    with KVCERT_CPU_OP=0 or for trace=True; and kvcert.dispatch.decode's sketch route says the same."""
    if code == "cpu_op":
        _op()
    else:
        monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    q, k, v, lp, sketch, mu, r2 = _sketched()
    ce = D.sketch_hajek_attention(q, k, v, None, sketch, log_pi=lp, trace=False, record="tilted_hull")
    assert (ce.estimate.backend, ce.estimate.route) == ("fast", code)
    full = D.sketch_hajek_attention(q, k, v, None, sketch, log_pi=lp, trace=True)  # the op lacks the HT trace pass
    assert (full.estimate.backend, full.estimate.route) == ("fast", "torch")
    dec = D.decode(q[:, :, None], _layer(k, v, lp, mu, r2, sketch=sketch), scale=0.25, options={},
                   kind="tilted_hull")
    assert dec.route == "sketch" and dec.ran == CODES[code] and dec.backend == CODES[code]
    assert torch.equal(dec.output[:, 0], ce.output)


def test_decode_routes_carry_their_code_and_resolve_a_typed_route(monkeypatch):
    """decode: the token route resolves a Route once (D.CPU_OP where the op computes trace-only calls here, else
    D.TORCH), handed back for the forward's next layer; the block route runs kvcert.fast (D.TORCH); every record's
    estimate names its code. No string stands for "resolved": a name that is not a backend is refused."""
    q, k, v, lp, sketch, mu, r2 = _sketched(seed=3)
    token = _layer(k, v, lp, mu, r2)
    kw = dict(scale=0.25, options={"per_coordinate": False}, kind="chebyshev")
    first = D.decode(q[:, :, None], token, **kw)
    assert isinstance(first.backend, D.Route) and first.backend in (D.CPU_OP, D.TORCH)
    assert first.ran == first.backend  # a one-query step runs the code resolved
    again = D.decode(q[:, :, None], token, backend=first.backend, **kw)  # the forward's next layer
    assert again.backend is first.backend and torch.equal(again.output, first.output)
    chunk = D.decode(torch.randn(*q.shape[:2], 3, q.shape[-1]), token, **kw)  # causal positions: kvcert.fast
    assert chunk.ran == D.TORCH and chunk.records[0].ran == D.TORCH
    block = D.decode(q[:, :, None], _layer(k, v, lp, mu, r2, block_size=8), **kw)
    assert (block.route, block.ran, block.backend) == ("block", D.TORCH, None)
    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    assert D.decode(q[:, :, None], token, **kw).backend == D.TORCH
    assert D.decode(q[:, :, None], token, backend="reference", **kw).ran == D.REFERENCE  # a name: forced
    with pytest.raises(ValueError, match="backend must be one of"):
        D.hajek_attention(q, k, v, log_pi=lp, backend="fast+cpu_op")


def test_the_router_lists_a_runner_for_every_code():
    """Every dense (design, layout, device) row of D.ROUTER ends with D.TORCH (always fits), every paged CPU row with
    D.GATHER (always fits), and each code a row names has the function that runs it; a device without a dense row
    runs D.TORCH, without a paged row D.GATHER."""
    for (design, layout, device), routes in D.ROUTER.items():
        assert design in D.DECODE_ROUTES and layout in ("dense", "paged") and device in ("cpu", "cuda")
        table = D._RUN if layout == "dense" else D._PAGED
        assert all((design, r) in table for r in routes), (design, layout, routes)
        if layout == "dense" or device == "cpu":
            assert routes[-1] == (D.TORCH if layout == "dense" else D.GATHER)
    assert D._route("token", torch.empty(1, device="meta"), lambda r: True) == D.TORCH
    assert D.paged_route("token", "meta", "chebyshev") == D.GATHER


def test_two_threads_each_see_their_own_route():
    """Two calls on two threads, both finished before either reads: each result names its own code, and the
    deprecated shim reads its own thread's (a ContextVar). Negative control: one "last route" written by every
    call, as the module global the shim replaced, answers one of the two threads wrongly."""
    q, k, v, pi = _case(n=40, d=16, dv=16)
    both_ran = threading.Barrier(2)
    one_global, seen = {}, {}

    def call(backend):
        est = D.hajek_attention(q, k, v, pi, backend=backend)
        one_global["route"] = est.route  # what a module global held: the last call of any thread
        both_ran.wait(timeout=60)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            seen[backend] = (est.route, D.last_route(), one_global["route"])

    threads = [threading.Thread(target=call, args=(b,)) for b in ("reference", "fast")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert seen["reference"][:2] == ("reference", "reference") and seen["fast"][:2] == ("torch", "torch")
    assert any(s[2] != s[0] for s in seen.values()), "the negative control: one global answers a thread wrongly"


def test_last_backend_and_last_route_are_deprecated_shims():
    """The deprecated functions warn, naming the result's field, and still answer for this thread's last call."""
    import kvcert

    q, k, v, pi = _case()
    est = D.hajek_attention(q, k, v, pi, backend="reference")
    with pytest.warns(DeprecationWarning, match=r"result's `backend` field \(Estimate.backend"):
        assert D.last_backend() == est.backend == "reference"
    with pytest.warns(DeprecationWarning, match=r"result's `route` field \(Estimate.route"):
        assert D.last_route() == est.route == "reference"
    assert kvcert.last_backend is D.last_backend


# ---------------------------------------------------------------------------------------------
# the paged layout (the vLLM plugin's cache, read through a block table)
# ---------------------------------------------------------------------------------------------
def _vec_cache(seed, dtype=torch.float32, h_q=6, h=2, d=16, bs=8, nb=20):
    """A paged cache in vLLM's CPU ``vec`` layout and rows of whole kept blocks: (q, cache, ids, log_pi (E, M, bs))
    with a certain first block, sampled blocks pi_b in (0.05, 0.95) and a partly filled last block."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(nb, h, bs, 2 * d, generator=g).to(dtype)
    lens = [3, 1, 5]
    ids = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    log_pi = torch.full((len(lens), max(lens), bs), float("-inf"))
    for j, m in enumerate(lens):
        pib = torch.rand(m, generator=g) * 0.9 + 0.05
        pib[0] = 1.0
        lp = pib.log()[:, None].expand(m, bs).clone()
        lp[-1, 3 + j:] = float("-inf")
        ids[j, :m] = torch.randperm(nb, generator=g)[:m]
        log_pi[j, :m] = lp
    return torch.randn(len(lens), h_q, d, generator=g).to(dtype), cache, ids, log_pi


def _gather(kv_cache, block_ids):
    """Keys and values (E, h_kv, M bs, d) of a ``vec`` cache's blocks (the vLLM plugin's ``gather_rows``)."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    E, M = block_ids.shape
    flat = kv_cache.view(nb, h, bs * two_d)[block_ids.reshape(-1)].view(E, M, h, bs * two_d)
    k = flat[..., : bs * d].reshape(E, M, h, d, bs).permute(0, 2, 1, 4, 3).reshape(E, h, M * bs, d)
    v = flat[..., bs * d:].reshape(E, M, h, bs, d).permute(0, 2, 1, 3, 4).reshape(E, h, M * bs, d)
    return k, v


def test_router_has_the_paged_rows():
    assert D.ROUTER["token", "paged", "cpu"] == (D.PAGED_CPU_OP, D.GATHER)
    assert D.ROUTER["sketch", "paged", "cpu"] == (D.PAGED_CPU_OP, D.GATHER)
    assert D.ROUTER["block", "paged", "cpu"] == (D.PAGED_TORCH, D.GATHER)
    assert D.ROUTER["block", "paged", "cuda"] == (D.PAGED_TRITON,)
    assert {r.backend for r in (D.PAGED_CPU_OP, D.PAGED_TORCH, D.GATHER)} == {"fast"}
    assert D.PAGED_TRITON.backend == "triton"


def test_paged_route_follows_the_kind_the_switch_and_the_device(monkeypatch):
    """The first code of the row that computes the kind: the op and the paged estimators for a trace-only kind,
    the gather route otherwise or with KVCERT_CPU_OP=0; a CUDA block row refuses a kind its kernel cannot compute."""
    op = D.PAGED_CPU_OP if D.cpu_op_available() else D.GATHER
    assert D.paged_route("token", "cpu", "chebyshev") == op
    assert D.paged_route("token", "cpu", "bernstein") == D.GATHER
    assert D.paged_route("sketch", "cpu", "tilted_hull") == op
    assert D.paged_route("block", "cpu", "chebyshev") == D.PAGED_TORCH
    assert D.paged_route("block", "cpu", "chi2") == D.GATHER
    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    assert D.paged_route("token", "cpu", "chebyshev") == D.GATHER
    assert D.paged_route("sketch", "cpu", "tilted_hull") == D.GATHER
    with pytest.raises(ValueError, match="kind='bernstein'"):
        D.paged_route("block", "cuda", "bernstein")
    with pytest.raises(ValueError, match="design must be one of"):
        D.paged_route("tokens", "cpu", "chebyshev")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_paged_block_estimator_is_the_block_estimator(dtype):
    """kvcert.fast's paged block estimator (the CPU plugin's block route) = kvcert.fast.block_hajek_attention on
    the gathered rows: output and trace against the float64 block estimator within twice the torch float32 path's
    own error plus the float32 rounding of sums over the row (8 eps32 sqrt(n) of the values' scale). Negative
    control: the same rows without the offset -log pi_b (every pi read as 1) are outside that tolerance."""
    from kvcert.fast import block_hajek_attention
    from kvcert.fast.blocks import paged_block_hajek_attention

    q, cache, ids, log_pi = _vec_cache(3, dtype)
    bs = cache.shape[2]
    dec = D.paged_decode("block", q, cache, ids, log_pi, scale=0.3, kind="chebyshev")
    assert dec.route == D.PAGED_TORCH and dec.dense is None
    est = paged_block_hajek_attention(q, cache, ids, log_pi, scale=0.3)
    assert torch.equal(est.output, dec.output) and torch.equal(est.trace, dec.statistics["trace"])
    assert est.output.dtype == dtype and est.trace.dtype == torch.float32
    wrong = paged_block_hajek_attention(q, cache, ids, torch.where(log_pi > float("-inf"), 0.0, log_pi), scale=0.3)
    eps32 = torch.finfo(torch.float32).eps
    for j in range(q.shape[0]):
        m = int((log_pi[j, :, 0] > float("-inf")).sum())
        k, v = _gather(cache, ids[j : j + 1, :m])
        pi = log_pi[j, :m].reshape(1, 1, -1).exp().expand(1, k.shape[1], m * bs)
        pos = torch.where(pi > 0, torch.arange(m * bs), -1)
        ref = block_hajek_attention(q[j : j + 1].double(), k.double(), v.double(), pi.double(), block_size=bs,
                                    positions=pos, scale=0.3, per_coordinate=False)
        f32 = block_hajek_attention(q[j : j + 1].float(), k.float(), v.float(), pi, block_size=bs, positions=pos,
                                    scale=0.3, per_coordinate=False)
        vmax = float(v.double().abs().max())
        rnd = 8 * eps32 * (m * bs) ** 0.5
        tol_o = 2 * float((f32.output.double() - ref.output).abs().max()) + rnd * vmax
        tol_t = 2 * float((f32.trace.double() - ref.trace).abs().max()) + rnd * vmax ** 2
        out = est.output[j : j + 1].double()
        if dtype == torch.bfloat16:  # the output is rounded to the query's dtype once
            tol_o += 2.0 ** -8 * float(ref.output.abs().max())
        err_o, err_t = float((out - ref.output).abs().max()), float((est.trace[j] - ref.trace[0]).abs().max())
        print(f"row {j}: |output - f64| {err_o:.2e} (tol {tol_o:.2e}), |trace - f64| {err_t:.2e} (tol {tol_t:.2e})")
        assert err_o <= tol_o and err_t <= tol_t
        if m > 1:  # a row with a sampled block: the offset matters
            assert float((wrong.output[j : j + 1].double() - ref.output).abs().max()) > tol_o


def test_paged_decode_gather_route_names_the_dense_code_and_needs_a_reader(monkeypatch):
    """The gather route: the rows read by the caller's reader, then the dense route (its code in ``dense``); the
    token design's op route gives the same estimate within float32 rounding (both float32 over at most 40 slots:
    rtol 1e-5). Without a reader the gather route says what it needs."""
    q, cache, ids, log_pi = _vec_cache(4)
    h, bs = cache.shape[1], cache.shape[2]
    lp = log_pi.repeat_interleave(1, 0).reshape(q.shape[0], 1, -1).expand(q.shape[0], h, ids.shape[1] * bs)
    first = D.paged_decode("token", q, cache, ids, lp, scale=0.3, kind="chebyshev", gather=_gather)
    monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    with pytest.raises(TypeError, match="gather="):
        D.paged_decode("token", q, cache, ids, lp, scale=0.3, kind="chebyshev")
    dec = D.paged_decode("token", q, cache, ids, lp, scale=0.3, kind="chebyshev", gather=_gather)
    assert dec.route == D.GATHER and dec.dense == D.TORCH and dec.radius is None
    assert set(dec.statistics) >= {"trace", "output_norm"}
    torch.testing.assert_close(first.output, dec.output, rtol=1e-5, atol=1e-6)
    blk = D.paged_decode("block", q, cache, ids, log_pi, scale=0.3, kind="bernstein", gather=_gather)
    assert blk.route == D.GATHER and blk.dense == D.TORCH and blk.statistics["max_term"].shape == (3, 6)
    torch.testing.assert_close(blk.output, D.paged_decode("block", q, cache, ids, log_pi, scale=0.3,
                                                          kind="chebyshev").output, rtol=1e-5, atol=1e-6)
