"""The plugin's hand-offs (kvcert.vllm.handoff): typed records on vLLM's own carriers, no attribute added to an
object of vLLM's.

- the records survive the pickling that carries them between vLLM's processes (the multiprocessing executor's
  message queues), with every field of vLLM's output and their subclass;
- an output without the plugin's record is refused where it is read, naming the piece that is missing;
- in an engine, the scheduler, the worker and every attention layer receive the plugin's typed subclasses, and
  no object they receive carries a ``kvcert*`` attribute its class does not declare. Negative control: a worker
  that adds the old ``kvcert_certs`` attribute to its output is caught by the same check.
"""

from __future__ import annotations

import pickle
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from vllm_driver import ad_hoc_attributes
from vllm_support import MAX_TOKENS, run_engine


def _outputs():
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    so = SchedulerOutput.make_empty()
    so.finished_req_ids = {"x"}
    so.num_scheduled_tokens = {"a": 1}
    mro = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[5]])
    return so, mro


def test_records_ride_on_subclasses_that_survive_pickling():
    """The subclasses hold vLLM's fields (the same objects) and the record; pickled as vLLM's message queues
    pickle them (``pickle.HIGHEST_PROTOCOL``) they come back as the same classes with equal contents."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import ModelRunnerOutput

    from kvcert.vllm.handoff import (CertifiedModelRunnerOutput, CertifiedSchedulerOutput, StepOrders, StepReport,
                                     orders_of, report_of, with_report)

    so, mro = _outputs()
    orders = StepOrders(decisions={"a": [0.0, float("-inf")]}, clear=["b"], options={"c": {"seed": 3}},
                        stats={"blocks_freed": 2})
    report = StepReport(certs={"a": 0.25}, importance={"d": [0.5, 0.5]},
                        compacted={"e": {"m": 1, "n_prompt": 40, "counts": [[20]], "sketch_bytes": 0}})
    cso = CertifiedSchedulerOutput.of(so, orders)
    cmro = with_report(mro, report)
    for base, ext, cls in ((so, cso, SchedulerOutput), (mro, cmro, ModelRunnerOutput)):
        assert isinstance(ext, cls) and all(getattr(ext, f.name) is getattr(base, f.name) for f in fields(cls))
        assert ad_hoc_attributes(ext) == [] and ad_hoc_attributes(base) == []
        back = pickle.loads(pickle.dumps(ext, protocol=pickle.HIGHEST_PROTOCOL))
        assert type(back) is type(ext) and back == ext
    assert type(cmro) is CertifiedModelRunnerOutput
    assert orders_of(pickle.loads(pickle.dumps(cso))) == orders
    assert report_of(pickle.loads(pickle.dumps(cmro))) == report


def test_an_output_without_the_record_is_refused_naming_what_is_missing():
    """The worker refuses a scheduler output without orders (another scheduler), the scheduler a model runner
    output without a report (another worker), and the worker an output it cannot extend (async scheduling's
    ``AsyncModelRunnerOutput``). Negative control: the check that flags an attribute added to vLLM's object."""
    from vllm.v1.outputs import AsyncModelRunnerOutput

    from kvcert.vllm.handoff import StepReport, with_report
    from kvcert.vllm.scheduler import CertifiedScheduler
    from kvcert.vllm.worker import _CertifiedWorker

    so, mro = _outputs()
    with pytest.raises(RuntimeError, match="scheduler_cls='kvcert.vllm.scheduler.CertifiedScheduler'"):
        _CertifiedWorker._kvcert_before(SimpleNamespace(), so)
    with pytest.raises(RuntimeError, match="worker_cls='kvcert.vllm.worker.CertifiedCPUWorker'"):
        CertifiedScheduler.update_from_output(SimpleNamespace(), so, mro)

    class Pending(AsyncModelRunnerOutput):
        def get_output(self):
            return mro

    with pytest.raises(RuntimeError, match="async scheduling"):
        with_report(Pending(), StepReport())
    mro.kvcert_certs = {"a": 0.5}  # the plugin's old carrier
    so.kvcert = {"clear": []}
    assert ad_hoc_attributes(mro) == ["kvcert_certs"] and ad_hoc_attributes(so) == ["kvcert"]


def test_the_attention_layers_read_the_step_from_the_metadata_only(monkeypatch):
    """The CPU backend runs the plugin's path only for metadata that carries a step: the same batch with vLLM's
    own metadata, or the plugin's without a step, runs the stock kernel (the masked row then reads its evicted
    block: a different output)."""
    from vllm.v1.attention.backends import cpu_attn

    from kvcert.vllm import KVCertConfig, backend
    from backend_support import BS, Q, TABLE, setup_backend, write_cache

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    _, worker, impl, cache, k, v, _, fake, layer, _ = setup_backend()
    write_cache(cache, k, v, torch.arange(Q + 3))
    fake.kvcert = KVCertConfig(compression_ratio=0.5, granularity="block")
    lp = torch.zeros(-(-Q // BS), dtype=torch.float64)
    lp[1] = float("-inf")  # block 1 evicted
    fake.kvcert_states = {"a": lp}
    q = torch.randn(1, impl.num_heads, k.shape[-1])
    seq = torch.tensor([Q + 3], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    sched = backend.stock_scheduler_metadata(impl, seq, qsl, True, "vec", torch.float32)
    fields_ = dict(num_actual_tokens=1, max_query_len=1, query_start_loc=qsl, max_seq_len=Q + 3, seq_lens=seq,
                   block_table=TABLE.to(torch.int32), slot_mapping=None, scheduler_metadata=sched)
    step = worker.Step(fake)
    with_step = backend.CertifiedCPUAttentionMetadata(**fields_, kvcert_step=step)
    masked = impl.forward(layer, q, None, None, cache, with_step, torch.empty_like(q))
    assert set(step.results(BS).certs) == {"a"}
    for md in (cpu_attn.CPUAttentionMetadata(**fields_), backend.CertifiedCPUAttentionMetadata(**fields_)):
        stock = impl.forward(layer, q, None, None, cache, md, torch.empty_like(q))
        assert not torch.allclose(stock, masked)


@pytest.fixture(scope="module")
def recorded() -> dict:
    """Two in-process engines of the default model (engine ratio 0, two of three prompts certified through
    their options, then a plain prompt, whose steps carry the clears of the finished certified requests), their
    hand-offs recorded: the plugin as it is, and with a worker that adds an attribute to its output (the
    negative control)."""
    runs = [{"order": [0, 1, 2], "max_tokens": MAX_TOKENS // 3,
             "extra_args": [{"kvcert_compression_ratio": 0.5}, None, {"kvcert_compression_ratio": 0.5}]},
            {"order": [3], "max_tokens": 2}]
    return {patch: run_engine(plugin=True, compression_ratio=0.0, seed=3, runs=runs, patch=patch)
            for patch in ("record_handoffs", "record_handoffs_adding_an_attribute")}


@pytest.mark.slow
@pytest.mark.model
def test_in_an_engine_every_handoff_is_typed_and_no_vllm_object_gains_an_attribute(recorded):
    rec = recorded["record_handoffs"]["handoffs"]
    types = rec["types"]
    assert types["scheduler: model runner output"] == ["kvcert.vllm.handoff.CertifiedModelRunnerOutput"]
    assert types["scheduler: scheduler output"] == ["kvcert.vllm.handoff.CertifiedSchedulerOutput"]
    assert types["worker: scheduler output"] == ["kvcert.vllm.handoff.CertifiedSchedulerOutput"]
    assert set(types["attention: metadata"]) <= {"kvcert.vllm.backend.CertifiedCPUAttentionMetadata",
                                                  "builtins.NoneType"}
    assert "kvcert.vllm.backend.CertifiedCPUAttentionMetadata" in types["attention: metadata"]
    assert all(v == [] for v in rec["ad_hoc"].values()), rec["ad_hoc"]
    # the carriers carried something: options and clears to the worker, certificates and compactions back,
    # the step to the layers
    counts = rec["counts"]
    assert all(counts[k] > 0 for k in ("orders with options", "orders with clear", "reports with certs",
                                       "reports with compacted", "forwards with a step")), counts
    outs = recorded["record_handoffs"]["runs"][0]["outputs"]
    assert outs["1"]["report"] is None and all(outs[i]["report"]["certificates"][1] > 0 for i in ("0", "2"))
    # negative control: the same engine whose worker adds an attribute to its output is caught
    bad = recorded["record_handoffs_adding_an_attribute"]["handoffs"]["ad_hoc"]
    assert bad["scheduler: model runner output"] == ["kvcert_certs"]
    assert [r["outputs"] for r in recorded["record_handoffs_adding_an_attribute"]["runs"]] == \
        [r["outputs"] for r in recorded["record_handoffs"]["runs"]]
