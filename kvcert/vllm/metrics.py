"""The plugin in vLLM's API server process: Prometheus counters at ``/metrics`` and streamed certificates.

Two duties of the front end (the process that serves HTTP; the engine core's
scheduler uses only :func:`encode_stats` and :func:`radius_bucket`):

1. **Metrics.** :class:`CertifiedStatLogger` is a vLLM stat logger (entry
   point group ``vllm.stat_logger_plugins``, loaded by ``AsyncLLM``, so by
   ``vllm serve`` / ``python -m vllm.entrypoints.openai.api_server``). The
   engine core's :class:`kvcert.vllm.scheduler.CertifiedScheduler` puts its
   cumulative counters into every ``SchedulerStats`` it makes
   (:func:`encode_stats`); the logger takes them out again
   (:func:`take_stats`) and a collector on ``prometheus_client``'s default
   registry, the one vLLM's ``/metrics`` serves, exports them per engine:

   ================================================  =========  ==================================================
   name (Prometheus exposition)                      type       meaning
   ================================================  =========  ==================================================
   ``kvcert_blocks_freed_total``                     counter    KV blocks returned to the pool by eviction
   ``kvcert_requests_certified_total``               counter    finished requests that carried certificates
   ``kvcert_certified_requests_preempted_total``     counter    requests preempted after they evicted
   ``kvcert_requests_evicted_total``                 counter    requests whose design evicted something
   ``kvcert_tokens_evicted_total``                   counter    evicted (layer, KV head, token) triples (token design)
   ``kvcert_blocks_evicted_total``                   counter    evicted prompt blocks (block design)
   ``kvcert_requests_refused_total``                 counter    requests refused for a bad ``kvcert_*`` option
   ``kvcert_blocks_reused_while_owner_runs_total``   counter    freed blocks handed to another request while their
                                                                 owner still runs
   ``kvcert_mean_relative_radius``                   histogram  per certified request: the mean of its per-token
                                                                 certificates, :math:`\\bar r = \\frac{1}{T}
                                                                 \\sum_{t=1}^{T} r_t` (``_bucket``, ``_sum``,
                                                                 ``_count``; buckets :data:`RADIUS_BUCKETS`)
   ================================================  =========  ==================================================

   Labels: ``model_name`` (the served model name) and ``engine`` (the engine
   index), as vLLM's own ``vllm:`` metrics. vLLM 0.32's ``SchedulerStats``
   has no field for a plugin (the msgpack channel from the engine core drops
   attributes that are not fields), so the counters travel as integers in its
   ``waiting_lora_adapters`` dict under keys prefixed ``"kvcert:"`` (a field
   only read when LoRA is enabled; the scheduler sends nothing then) and the
   histogram's sum in units of 1e-9 (:data:`RADIUS_SCALE`).

2. **Streamed certificates.** vLLM 0.32 copies ``RequestOutput.kv_transfer_params``
   into non-streamed completion and chat responses only; its streaming
   generators drop it. :func:`install_stream_certificates` (called by the
   stat logger, so it runs in the serving process) wraps the two stream
   generators of ``OpenAIServingCompletion`` and ``OpenAIServingChat``: the
   chunk that carries a choice's ``finish_reason`` also carries
   ``kv_transfer_params = {"kvcert": record}`` (top level, as in the
   non-streamed response; other ``kv_transfer_params`` keys are not added); a
   choice whose finishing chunk was not sent gets a chunk of its own, with no
   choices, before ``data: [DONE]``. Other chunks are passed through
   unchanged. docs/serving.md, "The OpenAI-compatible server", says what each
   chunk carries.
"""

from __future__ import annotations

import functools
import json
import threading
from bisect import bisect_left

from vllm.v1.metrics.loggers import StatLoggerBase

__all__ = ["CertifiedStatLogger", "COUNTERS", "RADIUS_BUCKETS", "RADIUS_SCALE", "encode_stats", "take_stats",
           "radius_bucket", "install_stream_certificates"]

#: prefix of the plugin's keys in ``SchedulerStats.waiting_lora_adapters``
PREFIX = "kvcert:"
#: scheduler counter (``CertifiedScheduler.kvcert_stats`` key) -> (Prometheus name without ``_total``, help)
COUNTERS = {
    "blocks_freed": ("kvcert_blocks_freed", "KV blocks returned to the pool by kvcert eviction."),
    "requests_certified": ("kvcert_requests_certified", "Finished requests that carried kvcert certificates."),
    "evicted_requests_preempted": ("kvcert_certified_requests_preempted",
                                   "Requests preempted after their prompt was evicted (recomputed in full)."),
    "requests_evicted": ("kvcert_requests_evicted", "Requests whose design evicted at least one token or block."),
    "tokens_evicted": ("kvcert_tokens_evicted", "Evicted (layer, KV head, token) triples (token design)."),
    "blocks_evicted": ("kvcert_blocks_evicted", "Evicted prompt blocks (block design)."),
    "requests_refused": ("kvcert_requests_refused", "Requests refused for a bad kvcert_* option."),
    "blocks_reused_while_owner_runs": ("kvcert_blocks_reused_while_owner_runs",
                                       "Freed blocks handed to another request while their owner still runs."),
}
HISTOGRAM = ("kvcert_mean_relative_radius",
             "Per certified request: mean over its generated tokens of the certificate's relative radius.")
#: upper bounds of the histogram's buckets (relative radius = radius / ||o_hat||); +Inf is added
RADIUS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: the histogram's sum travels as an integer number of 1e-9 (SchedulerStats' dict holds integers)
RADIUS_SCALE = 10**9


def radius_bucket(value: float) -> int:
    """Index of the bucket of ``value``: the first bound >= value (``len(RADIUS_BUCKETS)`` for +Inf)."""
    return bisect_left(RADIUS_BUCKETS, float(value))


def encode_stats(counters: dict, radius_counts, radius_sum: float) -> dict[str, int]:
    """The scheduler's cumulative counters as the integer dict that rides in ``SchedulerStats``.

    Parameters
    ----------
    counters : dict
        Scheduler counters (keys of :data:`COUNTERS`; others are ignored).
    radius_counts : sequence of int, length ``len(RADIUS_BUCKETS) + 1``
        Non-cumulative count of certified requests per bucket (last: +Inf).
    radius_sum : float >= 0
        Sum of the per-request mean relative radii.
    """
    if len(radius_counts) != len(RADIUS_BUCKETS) + 1:
        raise ValueError(f"radius_counts: expected {len(RADIUS_BUCKETS) + 1} bucket counts, got {len(radius_counts)}")
    out = {PREFIX + name: int(counters.get(name, 0)) for name in COUNTERS}
    out.update({f"{PREFIX}radius_bucket_{i}": int(c) for i, c in enumerate(radius_counts)})
    out[PREFIX + "radius_sum_e9"] = int(round(float(radius_sum) * RADIUS_SCALE))
    return out


def take_stats(payload: dict) -> dict | None:
    """Remove the plugin's keys from ``payload`` (``SchedulerStats.waiting_lora_adapters``) and decode them:
    ``{"counters": {name: int}, "buckets": [int] * (len(RADIUS_BUCKETS) + 1), "sum": float}``, or None."""
    mine = {k: payload.pop(k) for k in [k for k in payload if k.startswith(PREFIX)]}
    if not mine:
        return None
    counters = {name: int(mine.get(PREFIX + name, 0)) for name in COUNTERS}
    buckets = [int(mine.get(f"{PREFIX}radius_bucket_{i}", 0)) for i in range(len(RADIUS_BUCKETS) + 1)]
    total = int(mine.get(PREFIX + "radius_sum_e9", 0)) / RADIUS_SCALE
    return {"counters": counters, "buckets": buckets, "sum": total}


# ---------------------------------------------------------------------------------------------- metrics

_LOCK = threading.Lock()
_SNAPSHOTS: dict[tuple[str, str], dict] = {}  # (model_name, engine index) -> latest take_stats() result
_COLLECTOR = None


class _Collector:
    """``prometheus_client`` collector of the latest snapshot of every engine (cumulative values)."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        with _LOCK:
            snaps = dict(_SNAPSHOTS)
        labels = ["model_name", "engine"]
        for key, (name, doc) in COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=labels)
            for lv, snap in snaps.items():
                fam.add_metric(list(lv), snap["counters"][key])
            yield fam
        fam = HistogramMetricFamily(HISTOGRAM[0], HISTOGRAM[1], labels=labels)
        for lv, snap in snaps.items():
            cum, buckets = 0, []
            for bound, count in zip([*map(str, RADIUS_BUCKETS), "+Inf"], snap["buckets"]):
                cum += count
                buckets.append((bound, cum))
            fam.add_metric(list(lv), buckets, sum_value=snap["sum"])
        yield fam

    def describe(self):  # no description at registration: collect() is not called then
        return []


def _register_collector() -> None:
    global _COLLECTOR
    with _LOCK:
        if _COLLECTOR is None:
            from prometheus_client import REGISTRY

            _COLLECTOR = _Collector()
            REGISTRY.register(_COLLECTOR)


class CertifiedStatLogger(StatLoggerBase):
    """vLLM stat logger (one per engine) that exports the plugin's counters to ``/metrics`` (module docstring).

    Registered as ``[project.entry-points."vllm.stat_logger_plugins"] kvcert =
    "kvcert.vllm.metrics:CertifiedStatLogger"``; ``AsyncLLM(..., stat_loggers=[CertifiedStatLogger])``
    for an engine built by hand. Also installs the streamed certificates
    (:func:`install_stream_certificates`).
    """

    def __init__(self, vllm_config, engine_index: int = 0):
        self.engine_index = int(engine_index)
        model_config = getattr(vllm_config, "model_config", None)
        self.model_name = str(getattr(model_config, "served_model_name", None) or
                              getattr(model_config, "model", "") or "")
        _register_collector()
        install_stream_certificates()

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        if scheduler_stats is None:
            return
        snap = take_stats(scheduler_stats.waiting_lora_adapters)
        if snap is not None:
            with _LOCK:
                _SNAPSHOTS[(self.model_name, str(engine_idx))] = snap

    def log_engine_initialized(self):
        pass


def snapshots() -> dict:
    """The latest decoded counters per (model_name, engine index) in this process (for tests and tools)."""
    with _LOCK:
        return {k: dict(v) for k, v in _SNAPSHOTS.items()}


# ---------------------------------------------------------------------------------------------- streams

_STREAMS_INSTALLED = False


def _with_transfer_params(gen_fn, results_at: int, indexed: bool, obj: str):
    """Wrap a vLLM stream generator method: tap its ``result_generator`` (``args[results_at]`` after
    ``self`` and ``request``, or the keyword; items ``(prompt index, RequestOutput)`` when ``indexed``) and
    add the finished request's ``kv_transfer_params`` to the chunk that carries the choice's finish
    reason (``obj``: the ``object`` of a chunk of its own)."""

    @functools.wraps(gen_fn)
    async def wrapper(self, request, *args, **kwargs):
        num_choices = getattr(request, "n", None) or 1
        pending: dict[int, dict] = {}  # choice index -> kv_transfer_params not yet sent

        async def tap(results):
            async for item in results:
                prompt_idx, res = item if indexed else (0, item)
                params = getattr(res, "kv_transfer_params", None) or {}
                if "kvcert" in params and res.finished:  # the plugin's record only, never a connector's
                    for out in res.outputs:
                        if out.finish_reason is not None:
                            pending[out.index + prompt_idx * num_choices] = {"kvcert": params["kvcert"]}
                yield item

        args = list(args)
        if "result_generator" in kwargs:
            kwargs["result_generator"] = tap(kwargs["result_generator"])
        else:
            args[results_at] = tap(args[results_at])
        async for line in gen_fn(self, request, *args, **kwargs):
            if pending and line.startswith("data: {"):
                line = _attach(line, pending)
            elif pending and line.startswith("data: [DONE]"):
                for params in pending.values():
                    yield "data: " + json.dumps({"object": obj, "choices": [],
                                                 "kv_transfer_params": params}) + "\n\n"
                pending.clear()
            yield line

    return wrapper


def _attach(line: str, pending: dict) -> str:
    """``line`` (``"data: {json}\\n\\n"``) with ``kv_transfer_params`` added when one of its choices finishes."""
    chunk = json.loads(line[len("data: "):])
    for choice in chunk.get("choices") or []:
        if choice.get("finish_reason") is not None and choice.get("index") in pending:
            chunk["kv_transfer_params"] = pending.pop(choice["index"])
            return "data: " + json.dumps(chunk) + "\n\n"
    return line


def install_stream_certificates() -> None:
    """Make vLLM's streamed completion and chat responses carry ``kv_transfer_params`` (module docstring).

    Idempotent; a no-op where the OpenAI serving modules of vLLM 0.32 are not
    importable.
    """
    global _STREAMS_INSTALLED
    if _STREAMS_INSTALLED:
        return
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    except ImportError:  # not the OpenAI server of vLLM 0.32
        return
    # completion_stream_generator(self, request, engine_inputs, result_generator, ...): (prompt index, output)
    OpenAIServingCompletion.completion_stream_generator = _with_transfer_params(
        OpenAIServingCompletion.completion_stream_generator, results_at=1, indexed=True, obj="text_completion")
    # chat_completion_stream_generator(self, request, result_generator, ...): outputs
    OpenAIServingChat.chat_completion_stream_generator = _with_transfer_params(
        OpenAIServingChat.chat_completion_stream_generator, results_at=0, indexed=False,
        obj="chat.completion.chunk")
    _STREAMS_INSTALLED = True
