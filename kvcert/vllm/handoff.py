"""The plugin's hand-offs, typed and carried the way vLLM carries its own per-step records.

vLLM's KV connector is the model: what the scheduler decides rides to the
worker on one field of the step's ``SchedulerOutput``
(``kv_connector_metadata``, built by ``build_connector_meta``), and what the
worker learns rides back on one field of the ``ModelRunnerOutput``
(``kv_connector_output``), which the scheduler reads in
``update_from_output``. The plugin's records ride the same way, on the one
typed field ``kvcert`` of a dataclass subclass of each output, so no
attribute is ever added to an object of vLLM's:

- :class:`StepOrders` on :class:`CertifiedSchedulerOutput`: built by
  :meth:`kvcert.vllm.scheduler.CertifiedScheduler.schedule`, read by the
  worker before the step (:func:`orders_of`);
- :class:`StepReport` on :class:`CertifiedModelRunnerOutput`: built by the
  worker after the step (:func:`with_report`), read by
  :meth:`kvcert.vllm.scheduler.CertifiedScheduler.update_from_output`
  (:func:`report_of`).

Both are plain dataclasses of importable classes, so they cross vLLM's
process boundaries as vLLM's own outputs do: the multiprocessing executor
pickles the scheduler's output to every worker and the output rank's result
back (``MessageQueue.enqueue`` / ``dequeue``,
``vllm/distributed/device_communicators/shm_broadcast.py``).

Within the worker, the step's context (:class:`kvcert.vllm.worker.Step`)
reaches the attention layers on vLLM's per-step attention metadata: the
worker hands it to the plugin's metadata builders before the forward, and
each builder returns its metadata as a subclass with one field
``kvcert_step`` (:class:`kvcert.vllm.backend.CertifiedCPUAttentionMetadata`,
and the CUDA backend's twin), made with :func:`extend`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

__all__ = ["StepOrders", "StepReport", "CertifiedSchedulerOutput", "CertifiedModelRunnerOutput", "extend",
           "orders_of", "report_of", "with_report", "compaction_targets", "compaction_layout"]


def compaction_targets(ids, n_full: int, private):
    """The physical blocks a request's compaction (token design) writes, in the order of its compacted logical
    blocks 0, 1, ...: its full prompt blocks from the last back to the first it computed itself, then the blocks
    of its own standing in for the ``len(private)`` cached prefix blocks it read (``private``, from
    ``StepOrders.private``), then the partly filled last prompt block (used only when every token is kept).

    ``ids``: int64 (nbt,) the request's block table over its prompt, ``n_full`` = n_prompt // block_size. Never a
    shared block; a compaction of m blocks leaves the prompt's first ``compaction_layout(...)[1]`` blocks as
    computed (the scheduler registers those in the prefix cache). The worker writes by this list, and the
    scheduler frees by :func:`compaction_layout`, the same arithmetic."""
    import torch

    c = len(private)
    own = ids[c:n_full].flip(0)
    return torch.cat([own, torch.as_tensor(list(private), dtype=ids.dtype), ids[n_full:]])


def compaction_layout(n_full: int, c: int, m: int) -> tuple[int, int]:
    """Where :func:`compaction_targets` put a compaction of ``m`` blocks, once the scheduler has placed the ``c``
    blocks standing in for the cached prefix at the head of the request's block table: ``(used, intact)``, the
    first ``used`` of those hold compacted blocks, the request's own blocks ``c .. intact - 1`` hold the prompt
    as computed, and ``intact .. n_full - 1`` hold compacted blocks. The blocks ``used .. intact - 1`` are free
    after the event."""
    own = min(m, n_full - c)
    used = min(c, max(0, m - (n_full - c)))
    return used, n_full - own


@dataclass
class StepOrders:
    """What the scheduler hands the worker with one step.

    ``decisions``: block design, the requests decided since the last step: log pi_b per prompt block
    (-inf = evicted). ``clear``: requests whose eviction state the worker drops (preempted, or finished).
    ``options``: the per-request overrides of the engine's :class:`kvcert.vllm.config.KVCertConfig` of the
    requests scheduled for the first time (:func:`kvcert.vllm.config.request_options`). ``stats``: the
    scheduler's cumulative counters, which the worker keeps for ``LLM.collective_rpc("kvcert_stats")``.
    ``private``: per request that read cached prefix blocks (token design), the ids of the blocks of its own
    that stand in for them, in which its compaction writes instead (:func:`compaction_targets`), never into a
    shared block (:mod:`kvcert.vllm.scheduler`, module docstring 4).
    """

    decisions: dict[str, list[float]] = field(default_factory=dict)
    clear: list[str] = field(default_factory=list)
    options: dict[str, dict] = field(default_factory=dict)
    stats: dict[str, int] = field(default_factory=dict)
    private: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepReport:
    """What the worker reports to the scheduler after one step.

    ``certs``: per certified request, the mean relative radius over layers and query heads of the step.
    ``importance``: block design, per request that finished its prompt, the block importance (n_blocks,).
    ``compacted``: token design, per request compacted in the step, ``{"m", "n_prompt", "counts",
    "sketch_bytes"}`` and, with ``report_kept``, ``"kept_positions"`` (:meth:`kvcert.vllm.worker.Step.results`).
    Under tensor parallelism, those of every head of the layer (the ranks' joined).
    """

    certs: dict[str, float] = field(default_factory=dict)
    importance: dict[str, list[float]] = field(default_factory=dict)
    compacted: dict[str, dict] = field(default_factory=dict)


def extend(cls: type, base, **extra):
    """An instance of ``cls``, a dataclass subclass of ``base``'s dataclass, holding ``base``'s fields (the same
    objects, not copies) and ``extra`` (the subclass's own fields)."""
    own = {f.name for f in fields(base)} - set(extra)
    out = cls(**{f.name: getattr(base, f.name) for f in fields(base) if f.init and f.name in own}, **extra)
    for f in fields(base):
        if not f.init and f.name in own:
            setattr(out, f.name, getattr(base, f.name))
    return out


@dataclass
class CertifiedSchedulerOutput(SchedulerOutput):
    """vLLM's ``SchedulerOutput`` with the plugin's orders for the step."""

    kvcert: StepOrders = field(default_factory=StepOrders)

    @classmethod
    def of(cls, out: SchedulerOutput, orders: StepOrders) -> CertifiedSchedulerOutput:
        return extend(cls, out, kvcert=orders)


@dataclass
class CertifiedModelRunnerOutput(ModelRunnerOutput):
    """vLLM's ``ModelRunnerOutput`` with the plugin's report of the step."""

    kvcert: StepReport = field(default_factory=StepReport)

    @classmethod
    def of(cls, out: ModelRunnerOutput, report: StepReport) -> CertifiedModelRunnerOutput:
        return extend(cls, out, kvcert=report)


def orders_of(scheduler_output) -> StepOrders:
    """The orders a step's scheduler output carries; refuses an output from another scheduler."""
    if not isinstance(scheduler_output, CertifiedSchedulerOutput):
        raise RuntimeError(f"kvcert.vllm: the step's scheduler output ({type(scheduler_output).__name__}) carries "
                           "no kvcert orders; the plugin's worker needs the plugin's scheduler "
                           "(scheduler_cls='kvcert.vllm.scheduler.CertifiedScheduler')")
    return scheduler_output.kvcert


def report_of(model_runner_output) -> StepReport:
    """The report a step's model runner output carries; refuses an output from another worker."""
    if not isinstance(model_runner_output, CertifiedModelRunnerOutput):
        raise RuntimeError(f"kvcert.vllm: the model runner's output ({type(model_runner_output).__name__}) carries "
                           "no kvcert report; the plugin's scheduler needs the plugin's worker "
                           "(worker_cls='kvcert.vllm.worker.CertifiedCPUWorker')")
    return model_runner_output.kvcert


def with_report(out, report: StepReport) -> CertifiedModelRunnerOutput:
    """The worker's output ``out`` with the step's report; refuses an output that is not a ``ModelRunnerOutput``
    (under async scheduling the worker returns an ``AsyncModelRunnerOutput``, read later)."""
    if not isinstance(out, ModelRunnerOutput):
        raise RuntimeError("kvcert.vllm: cannot attach certificates to the model runner's output "
                           f"({type(out).__name__}); is async scheduling on?")
    return CertifiedModelRunnerOutput.of(out, report)
