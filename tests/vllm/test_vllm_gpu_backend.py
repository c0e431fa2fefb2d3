"""The CUDA attention backend (kvcert.vllm.gpu_backend) on a CPU machine: import hygiene, registration,
the row split and sub-batch metadata, and the paged kernel (Triton interpreter) against the CPU path.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_gpu_backend.py -q

The stock FlashAttention forward needs a CUDA device: the backend's forward is exercised with it stubbed
(routing, sub-batch, certificates, importance); nothing here runs FlashAttention itself (docs/gpu.md).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_support import ROOT, vllm_env

NEG_INF = float("-inf")
HERE = Path(__file__).resolve().parent


def _run(code: str, **env) -> subprocess.CompletedProcess:
    e = vllm_env()
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=e, capture_output=True, text=True,
                          timeout=300)


def test_imports_without_cuda_triton_or_vllm():
    code = ("import sys, torch, kvcert.vllm.gpu_backend as g\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('triton', 'vllm') or m.startswith('kvcert.kernels')]\n"
            "assert not bad, bad[:10]\n"
            "assert not torch.cuda.is_initialized()\n"
            "print('ok')\n")
    proc = _run(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_classes_resolve_by_class_path_and_register_as_custom():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    from kvcert.vllm import gpu_backend

    path = "kvcert.vllm.gpu_backend.CertifiedFlashAttentionBackend"
    cls = resolve_obj_by_qualname(path)  # what vLLM's registry does with the class path
    assert issubclass(cls, FlashAttentionBackend) and cls.get_name() == "CUSTOM"
    assert issubclass(cls.get_impl_cls(), FlashAttentionImpl)
    assert cls.get_impl_cls() is gpu_backend.CertifiedFlashAttentionImpl
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    builder = cls.get_builder_cls()  # same metadata, but no full CUDA graphs over the Python row split
    assert issubclass(builder, FlashAttentionMetadataBuilder)
    assert builder._cudagraph_support == AttentionCGSupport.NEVER
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM  # Attention layers map name -> enum
    before = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    try:
        gpu_backend.register_cuda()
        assert AttentionBackendEnum.CUSTOM.get_path() == path
        assert AttentionBackendEnum.CUSTOM.get_class() is cls
    finally:
        if before is None:
            _ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
        else:
            _ATTN_OVERRIDES[AttentionBackendEnum.CUSTOM] = before
    with pytest.raises(AttributeError):
        gpu_backend.NoSuchClass  # noqa: B018


def _batch():
    """Rows: 0 a prompt chunk (5 tokens, to score), 1 a decode row with a decision, 2 a decode row
    without, 3 a decode row whose sequence grew one block past its prompt (that block: certain)."""
    from kvcert.vllm.gpu_backend import RowState

    bs = 16
    qsl = torch.tensor([0, 5, 6, 7, 8], dtype=torch.int32)
    seq_lens = torch.tensor([5, 50, 20, 40], dtype=torch.int32)
    table = torch.tensor([[9, 0, 0, 0], [3, 7, 1, 5], [2, 0, 0, 0], [4, 6, 8, 0]], dtype=torch.int32)
    lp1 = torch.tensor([0.0, NEG_INF, math.log(0.4), 0.0], dtype=torch.float64)  # 4 prompt blocks
    lp3 = torch.tensor([0.0, math.log(0.5)], dtype=torch.float64)  # 2 prompt blocks, block 2 from decoding
    states = [RowState("a", None, importance=True), RowState("b", lp1), RowState("c", None), RowState("d", lp3)]
    return bs, qsl, seq_lens, table, states


def test_plan_rows_splits_like_the_cpu_worker():
    from kvcert.vllm.gpu_backend import RowState, plan_rows

    bs, qsl, seq_lens, table, states = _batch()
    plan = plan_rows(qsl, seq_lens, table, states, bs)
    assert plan.masked and plan.masked_rows == [1, 3] and plan.masked_req_ids == ["b", "d"]
    assert plan.masked_tokens.tolist() == [5, 7]
    assert plan.stock_rows == [0, 2] and plan.stock_tokens.tolist() == [0, 1, 2, 3, 4, 6]
    assert plan.importance_rows == [(0, "a")]
    assert plan.block_table.tolist() == [[3, 7, 1, 5], [4, 6, 8, 0]] and plan.block_table.dtype == torch.int32
    assert plan.seq_lens.tolist() == [50, 40]
    lp = plan.log_pi_blocks
    assert lp.dtype == torch.float32 and lp.shape == (2, 4)
    assert lp[0].tolist()[:2] == [0.0, NEG_INF] and math.isclose(lp[0, 2], math.log(0.4), rel_tol=1e-6)
    assert lp[0, 3] == 0.0
    assert lp[1, 0] == 0.0 and math.isclose(lp[1, 1], math.log(0.5), rel_tol=1e-6)
    assert lp[1, 2] == 0.0 and lp[1, 3] == NEG_INF  # decode-appended block certain, past the end -inf
    # no decision anywhere: nothing masked
    none = plan_rows(qsl, seq_lens, table, [None] * 4, bs)
    assert not none.masked and none.stock_rows == [0, 1, 2, 3]
    # a decision on a multi-token row is refused, as on CPU
    with pytest.raises(RuntimeError, match="single-token decode"):
        plan_rows(qsl, seq_lens, table, [RowState("a", torch.zeros(1))] + states[1:], bs)


def test_stock_sub_metadata_restricts_to_the_stock_rows():
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata

    from kvcert.vllm.gpu_backend import plan_rows, stock_sub_metadata

    bs, qsl, seq_lens, table, states = _batch()
    slots = torch.arange(8, dtype=torch.int64) + 100
    md = FlashAttentionMetadata(num_actual_tokens=8, max_query_len=5, query_start_loc=qsl, max_seq_len=50,
                                seq_lens=seq_lens, block_table=table, slot_mapping=slots,
                                scheduler_metadata=torch.zeros(3), max_num_splits=4)
    plan = plan_rows(qsl, seq_lens, table, states, bs)
    sub = stock_sub_metadata(md, plan)
    assert sub.num_actual_tokens == 6 and sub.max_query_len == 5 and sub.max_seq_len == 20
    assert sub.query_start_loc.tolist() == [0, 5, 6] and sub.query_start_loc.dtype == qsl.dtype
    assert sub.seq_lens.tolist() == [5, 20] and sub.block_table.tolist() == [[9, 0, 0, 0], [2, 0, 0, 0]]
    assert sub.slot_mapping.tolist() == [100, 101, 102, 103, 104, 106]
    assert sub.scheduler_metadata is None and sub.max_num_splits == 0
    assert md.num_actual_tokens == 8  # the step's metadata is untouched


def compare_with_cpu_path():
    """The router's CUDA block route (the paged Triton kernel on the interpreter, FlashAttention layout) against
    its CPU one (backend.block_decode: kvcert.fast's paged estimator, torch, ``vec`` cache layout) on the same
    tokens; run in a subprocess with TRITON_INTERPRET=1."""
    from kvcert import dispatch
    from kvcert.vllm.backend import block_decode as cpu_block_decode
    from kvcert.vllm.gpu_backend import plan_rows

    bs, qsl, seq_lens, table, states = _batch()
    torch.manual_seed(0)
    nb, h, g, d = 10, 2, 2, 16
    flash = torch.randn(nb, h, bs, 2 * d)  # FlashAttention layout: [..., :d] keys, [..., d:] values
    vec = torch.empty(nb, h, bs, 2 * d)  # CPU 'vec' layout: keys transposed (d, bs), then values (bs, d)
    flat = vec.view(nb, h, bs * 2 * d)
    flat[..., : bs * d] = flash[..., :d].transpose(-1, -2).reshape(nb, h, bs * d)
    flat[..., bs * d:] = flash[..., d:].reshape(nb, h, bs * d)
    query = torch.randn(8, h * g, d)
    plan = plan_rows(qsl, seq_lens, table, states, bs)
    # poison the evicted block (row 1, logical block 1 = physical 7): never read by either path
    flash[7] = float("nan")
    vec[7] = float("nan")
    # the router's block route on CUDA (PAGED_TRITON), here on the interpreter's CPU tensors
    from kvcert.kernels import kv_cache_views, paged_block_hajek_attention

    q_rows = query.index_select(0, plan.masked_tokens)
    est = paged_block_hajek_attention(q_rows, *kv_cache_views(flash, d), plan.block_table, plan.seq_lens,
                                      plan.log_pi_blocks, scale=0.25, max_seq_len=plan.max_seq_len, validate=True)
    o, trace = est.output, est.trace
    assert dispatch.ROUTER["block", "paged", "cuda"] == (dispatch.PAGED_TRITON,)
    # the CPU path's inputs: kept physical blocks per row, log pi per slot (-inf past the end)
    E = len(plan.masked_rows)
    ids, lps = [], []
    for j in range(E):
        L = int(plan.seq_lens[j])
        kept = [b for b in range(-(-L // bs)) if plan.log_pi_blocks[j, b] > NEG_INF]
        ids.append([int(plan.block_table[j, b]) for b in kept])
        pos = torch.tensor(kept)[:, None] * bs + torch.arange(bs)
        lps.append(torch.where(pos < L, plan.log_pi_blocks[j, kept][:, None], NEG_INF))
    M = max(len(x) for x in ids)
    block_ids = torch.zeros(E, M, dtype=torch.int64)
    log_pi = torch.full((E, M, bs), NEG_INF)
    for j in range(E):
        block_ids[j, : len(ids[j])] = torch.tensor(ids[j])
        log_pi[j, : len(ids[j])] = lps[j]
    dec = cpu_block_decode(q_rows, vec, block_ids, log_pi, 0.25, "chebyshev", 0.05)
    assert dec.route == dispatch.PAGED_TORCH
    o_cpu, tr_cpu = dec.output, dec.statistics["trace"]
    assert not bool(torch.isnan(o).any()) and not bool(torch.isnan(trace).any())
    # both float32; tolerance 64 eps32 of the value scale (output) and of its square (trace)
    vmax = float(flash[..., d:].nan_to_num(0).abs().max())
    eo, et = float((o - o_cpu).abs().max()), float((trace - tr_cpu).abs().max())
    assert eo <= 64 * 2 ** -23 * vmax, eo
    assert et <= 64 * 2 ** -23 * vmax ** 2, et
    assert bool((trace > 0).all())
    print(f"max |o - o_cpu| = {eo:.3g}, max |trace - trace_cpu| = {et:.3g}")

    # the importance pass of a prompt row (row 0: 5 tokens, block 9) against the CPU backend's
    from types import SimpleNamespace

    from kvcert.vllm import KVCertConfig, gpu_backend
    from kvcert.vllm.backend import CertifiedCPUAttentionImpl
    from kvcert.vllm.worker import _Importance

    class Ctx:
        config = KVCertConfig(granularity="block", observation_window=3)

        def __init__(self):
            self.u = {}

        def add_importance(self, rid, u):
            self.u[rid] = u

    md = SimpleNamespace(query_start_loc=qsl, seq_lens=seq_lens, block_table=table)
    gpu, cpu = Ctx(), Ctx()
    gpu_backend._importance(gpu, plan, md, query, flash, d, 0.25)
    cpu_plan = SimpleNamespace(importance=[_Importance("a", 5, 5, 5, table[0, :1].long())])
    CertifiedCPUAttentionImpl._importance(SimpleNamespace(scale=0.25), SimpleNamespace(config=Ctx.config, **{
        "add_importance": cpu.add_importance}), cpu_plan, None, query, vec, None)
    assert set(gpu.u) == set(cpu.u) == {"a"}
    torch.testing.assert_close(gpu.u["a"], cpu.u["a"], rtol=1e-6, atol=1e-7)
    print("importance ok")


def test_paged_kernel_matches_the_cpu_masked_decode():
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
            "import test_vllm_gpu_backend as t; t.compare_with_cpu_path()\n")
    proc = _run(code, TRITON_INTERPRET="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "importance ok" in proc.stdout


def test_refusal_names_the_gpu_backend():
    from types import SimpleNamespace

    import vllm.platforms

    from kvcert.vllm.config import check_vllm_config

    fake = SimpleNamespace(is_cpu=lambda: False, device_name="cuda")
    orig = vllm.platforms.current_platform
    try:
        vllm.platforms.current_platform = fake
        with pytest.raises(ValueError, match="untested on a device"):
            check_vllm_config(SimpleNamespace())
    finally:
        vllm.platforms.current_platform = orig


def exercise_forward():
    """CertifiedFlashAttentionImpl.forward with the stock FlashAttention forward replaced by a marker
    (it needs CUDA): the stock rows go to it as a sub-batch, the masked rows to the paged kernel, the
    certificates and importance reach the step context (carried by the metadata, as the plugin's builder
    makes it), the plan is built once per step. Run in a subprocess with TRITON_INTERPRET=1."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata

    from kvcert import dispatch
    from kvcert.vllm import gpu_backend as gb
    from kvcert.vllm.handoff import extend

    calls = []

    def stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                      output_block_scale=None):
        calls.append(attn_metadata)
        n = attn_metadata.num_actual_tokens
        output[:n] = 2 * query[:n]  # a marker of the stock path
        return output

    FlashAttentionImpl.forward = stock_forward
    bs, qsl, seq_lens, table, states = _batch()
    torch.manual_seed(1)
    nb, h, g, d = 10, 2, 2, 16
    flash = torch.randn(nb, h, bs, 2 * d)
    query, key, value = torch.randn(8, h * g, d), torch.randn(8, h, d), torch.randn(8, h, d)
    md = FlashAttentionMetadata(num_actual_tokens=8, max_query_len=5, query_start_loc=qsl, max_seq_len=50,
                                seq_lens=seq_lens, block_table=table, slot_mapping=torch.arange(8))

    def with_step(ctx):  # the metadata of a step of the plugin's worker, as its builder makes it
        return extend(gb.CertifiedFlashAttentionMetadata, md, kvcert_step=ctx)
    impl = object.__new__(gb.CertifiedFlashAttentionImpl)
    impl.attn_type, impl.scale, impl.head_size, impl.kv_cache_dtype = AttentionType.DECODER, 0.25, d, "auto"

    from kvcert.vllm import KVCertConfig

    class Ctx:
        config = KVCertConfig(granularity="block", kind="chebyshev", delta=0.05, observation_window=3)
        paged_plan = None

        def __init__(self):
            self.certs, self.imp, self.n_plans = {}, {}, 0

        def row_states(self, md_):
            self.n_plans += 1
            return states

        def add_certificates(self, rids, rel):
            for j, rid in enumerate(rids):
                self.certs.setdefault(rid, []).append(rel[j])

        def add_importance(self, rid, u):
            self.imp[rid] = u

    # outside a step (vLLM's own metadata, or the plugin's without a step): the stock forward on the whole batch
    for outside in (md, with_step(None)):
        out = torch.zeros(8, h * g, d)
        impl.forward(None, query, key, value, flash, outside, out)
        assert calls[-1] is outside and torch.equal(out, 2 * query)
    # inside a step, two layers reading the step's one metadata
    ctx = Ctx()
    step_md = with_step(ctx)
    for _ in range(2):
        out = torch.zeros(8, h * g, d)
        impl.forward(None, query, key, value, flash, step_md, out)
    assert ctx.n_plans == 1  # the plan is built once per step
    sub = calls[-1]
    assert sub.num_actual_tokens == 6 and sub.query_start_loc.tolist() == [0, 5, 6]
    stock = [0, 1, 2, 3, 4, 6]
    assert torch.equal(out[stock], 2 * query[stock])
    plan = ctx.paged_plan
    dec = dispatch.paged_decode("block", query.index_select(0, plan.masked_tokens), flash, plan.block_table,
                                plan.log_pi_blocks, scale=0.25, kind="chebyshev", seq_lens=plan.seq_lens,
                                max_seq_len=plan.max_seq_len, device="cuda")
    assert dec.route == dispatch.PAGED_TRITON and torch.equal(out[[5, 7]], dec.output)
    assert set(ctx.certs) == {"b", "d"} and all(len(v) == 2 for v in ctx.certs.values())
    rel = torch.stack(ctx.certs["b"])
    assert bool(torch.isfinite(rel).all()) and bool((rel > 0).all())
    assert set(ctx.imp) == {"a"} and ctx.imp["a"].shape == (h, 5)
    # a certificate kind the kernel cannot serve is refused
    ctx = Ctx()
    ctx.config = KVCertConfig(granularity="block", kind="chi2", delta=0.05, observation_window=3)
    try:
        impl.forward(None, query, key, value, flash, with_step(ctx), torch.zeros(8, h * g, d))
        raise AssertionError("kind='chi2' was not refused")
    except ValueError as e:  # the router: no paged code on CUDA computes chi2's covariance
        assert "chebyshev" in str(e)
    print("forward ok")


def test_forward_routes_rows_with_a_stubbed_flash_attention():
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
            "import test_vllm_gpu_backend as t; t.exercise_forward()\n")
    proc = _run(code, TRITON_INTERPRET="1")
    assert proc.returncode == 0 and "forward ok" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


def test_step_row_states_feed_the_cuda_backend(monkeypatch):
    """The CUDA worker's step context: Step.row_states gives each row its request, decision and whether to
    score it (the CPU plan's rule); CertifiedGPUWorker.execute_model hands the step to the CUDA backend's
    metadata builder for the stock step (and takes it back after), applies the scheduler's decisions first and
    returns the output with the step's report."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_worker import Worker

    from kvcert.vllm import KVCertConfig, backend, gpu_backend, worker
    from kvcert.vllm.handoff import CertifiedModelRunnerOutput, CertifiedSchedulerOutput, StepOrders

    lp = torch.tensor([0.0, NEG_INF, math.log(0.4), 0.0, 0.0, 0.0], dtype=torch.float64)
    fake = SimpleNamespace(kvcert=KVCertConfig(compression_ratio=0.5, granularity="block"), kvcert_states={"b": lp}, kvcert_decided=set(), kvcert_block_size=16,
                           kvcert_prompt_len={"a": 90, "b": 90, "c": 20, "e": 200, "f": 30},
                           model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a", "b", "c", "e", "f"])))
    # a: last chunk of a 6-block prompt (scored); b: decided; c: decoding, undecided; e: a middle chunk;
    # f: last chunk of a 2-block prompt (its certainty set fills the budget: not scored)
    md = SimpleNamespace(seq_lens=torch.tensor([90, 91, 21, 100, 30], dtype=torch.int32))
    states = worker.Step(fake).row_states(md)
    assert [st.req_id for st in states] == ["a", "b", "c", "e", "f"]
    assert [st.importance for st in states] == [True, False, False, False, False]
    assert states[1].log_pi is lp and all(st.log_pi is None for k, st in enumerate(states) if k != 1)

    assert issubclass(worker.CertifiedGPUWorker, Worker)
    # the model runner's builders: the CUDA backend's is handed the step for the forward, any other is not
    cuda_builder = object.__new__(gpu_backend.CertifiedFlashAttentionMetadataBuilder)
    cpu_builder = object.__new__(backend.CertifiedCPUAttentionMetadataBuilder)
    cuda_builder.kvcert_step = cpu_builder.kvcert_step = None
    seen = []

    def stock_step(self, scheduler_output, *args, **kwargs):
        ctx = cuda_builder.kvcert_step
        seen.append((ctx, dict(self.kvcert_states), cpu_builder.kvcert_step))
        ctx.add_certificates(["b"], torch.tensor([[0.25, 0.75]]))
        return ModelRunnerOutput(req_ids=["b"], req_id_to_index={"b": 0}, sampled_token_ids=[[7]])

    monkeypatch.setattr(Worker, "execute_model", stock_step)
    w = object.__new__(worker.CertifiedGPUWorker)
    w.__dict__.update(fake.__dict__)
    w.model_runner = SimpleNamespace(input_batch=fake.model_runner.input_batch,
                                     attn_groups=[[SimpleNamespace(metadata_builders=[b])
                                                   for b in (cuda_builder, cpu_builder)]])
    w.kvcert_states = {}
    w.kvcert_last_stats, w._kvcert_pending, w.kvcert_joined = {}, None, {}  # what __init__ sets
    so = CertifiedSchedulerOutput.of(SchedulerOutput.make_empty(), StepOrders(decisions={"b": lp.tolist()}))
    out = w.execute_model(so)
    ctx, states_seen, cpu_ctx = seen[0]
    assert isinstance(ctx, worker.Step) and cpu_ctx is None and cuda_builder.kvcert_step is None
    assert torch.equal(states_seen["b"], lp)  # decisions are applied before the step runs
    assert isinstance(out, CertifiedModelRunnerOutput) and out.sampled_token_ids == [[7]]
    assert out.kvcert.certs == {"b": pytest.approx(0.5)} and out.kvcert.importance == {}
    # a model runner without the CUDA backend's builder is refused, naming the builder
    w.model_runner.attn_groups = [[SimpleNamespace(metadata_builders=[cpu_builder])]]
    with pytest.raises(RuntimeError, match="CertifiedFlashAttentionMetadataBuilder"):
        w.execute_model(so)


def test_the_builders_put_the_step_they_hold_on_their_metadata(monkeypatch):
    """Both backends' metadata builders return vLLM's metadata (every field, the same objects) as their
    subclass carrying the step context they hold (None outside a step)."""
    from dataclasses import fields

    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, CPUAttentionMetadataBuilder
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata, FlashAttentionMetadataBuilder

    from kvcert.vllm import backend, gpu_backend

    tensors = dict(query_start_loc=torch.tensor([0, 3]), seq_lens=torch.tensor([3]), block_table=torch.zeros(1, 2),
                   slot_mapping=torch.arange(3))
    for base_builder, builder_cls, base_md, md_cls in (
            (FlashAttentionMetadataBuilder, gpu_backend.CertifiedFlashAttentionMetadataBuilder, FlashAttentionMetadata,
             gpu_backend.CertifiedFlashAttentionMetadata),
            (CPUAttentionMetadataBuilder, backend.CertifiedCPUAttentionMetadataBuilder, CPUAttentionMetadata,
             backend.CertifiedCPUAttentionMetadata)):
        extra = {"scheduler_metadata": None} if base_md is CPUAttentionMetadata else {}
        stock = base_md(num_actual_tokens=3, max_query_len=3, max_seq_len=3, **tensors, **extra)
        monkeypatch.setattr(base_builder, "build", lambda self, *a, **k: stock)
        builder = object.__new__(builder_cls)
        for step in (None, object()):
            builder.kvcert_step = step
            md = builder.build(0, None)
            assert type(md) is md_cls and issubclass(md_cls, base_md) and md.kvcert_step is step
            assert all(getattr(md, f.name) is getattr(stock, f.name) for f in fields(base_md))
