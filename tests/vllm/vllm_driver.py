"""Runs vLLM engines for the tests and writes what they compare (JSON).

    python tests/vllm/vllm_driver.py SPEC.json OUT.json    # one engine, then exit
    python tests/vllm/vllm_driver.py --loop                # engines in sequence, one per stdin line

Not a test module: tests/vllm/vllm_support.py launches it. The stock engine runs
without the plugin (``VLLM_PLUGINS=""`` set by the launcher), so stock and
plugin engines never share a process. In ``--loop`` mode each stdin line is
``SPEC_PATH<TAB>OUT_PATH``; the driver starts that engine in this process (the
launcher sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs here
too), generates, shuts it down, collects it, tears down vLLM's distributed
state, and writes OUT atomically: the result, or ``{"error": traceback}``. One
vLLM import then serves every engine of a kind (about 10 s each, and the
engine core's process about 20 s more, saved per engine). It exits at the end
of its input.

SPEC keys: ``plugin`` (bool), ``model``, ``compression_ratio``, ``seed``,
``kvcert`` (dict), ``scorer`` (optional, ``certified_llm``'s keyword),
``llm_kwargs`` (dict), ``prompts`` (token-id lists), ``runs`` (list of
{"order": [prompt indices], "max_tokens": int}, generated one ``generate`` call
each, greedy; optional ``"extra_args"``: a list parallel to ``order`` of
``SamplingParams.extra_args`` dicts or None, e.g.
``{"kvcert_compression_ratio": 0.5}``; a prompt index at most once per run); optional ``patch``:
``"compaction_writes_the_cached_prefix"`` runs that engine with the worker's compaction writing the block
table's first blocks, the cached prefix blocks a request read among them, ``"compacted_blocks_registered"``
with every full prompt block of a certified request registered in the prefix cache after its event, the
compacted ones among them (negative controls); ``"record_handoffs"`` records what the plugin's scheduler, worker and attention
layers receive from vLLM (:class:`HandoffRecorder`, the result's ``handoffs``), and
``"record_handoffs_adding_an_attribute"`` does so with a worker that also adds an attribute to its output (its
negative control). Each output records ``num_cached_tokens`` (vLLM's prefix-cache hits) too.
Each output records ``token_ids`` and ``finish_reason``, and with the plugin
``certificates`` and ``report``; the result records ``start_s`` and, per run,
``gen_s``, and with the plugin the engine's ``stats`` and ``blocks_freed``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import traceback


def run_spec(spec: dict) -> dict:
    """Start the spec's engine, generate its runs, shut it down; the result dict."""
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    original = None
    recorder = None
    if spec.get("patch", "") and spec["patch"].startswith("record_handoffs"):
        recorder = HandoffRecorder(add_attribute=spec["patch"] == "record_handoffs_adding_an_attribute")
    if spec.get("patch") == "compaction_writes_the_cached_prefix":  # a negative control's broken plugin
        from kvcert.vllm.worker import _Importance

        original = (_Importance, "write_ids", _Importance.__dict__["write_ids"])
        _Importance.write_ids = property(lambda row: row.all_block_ids)
    if spec.get("patch") == "compacted_blocks_registered":  # a negative control's broken plugin
        from kvcert.vllm.scheduler import CertifiedScheduler

        register = CertifiedScheduler.__dict__["_register_intact"]
        original = (CertifiedScheduler, "_register_intact", register)
        CertifiedScheduler._register_intact = lambda self, request, intact: register(
            self, request, request.num_prompt_tokens // self._bs)
    if spec["plugin"]:
        from kvcert.vllm import certified_llm

        llm = certified_llm(spec["model"], compression_ratio=spec["compression_ratio"], seed=spec["seed"],
                            kvcert=spec.get("kvcert") or None, scorer=spec.get("scorer"), **spec["llm_kwargs"])
    else:
        llm = LLM(model=spec["model"], **spec["llm_kwargs"])
    try:
        result = {"start_s": time.perf_counter() - t0, "runs": []}
        prompts = spec["prompts"]
        for run in spec["runs"]:
            order = run["order"]
            extra = run.get("extra_args") or [None] * len(order)
            sp = [SamplingParams(temperature=0.0, max_tokens=run["max_tokens"], ignore_eos=True, extra_args=e)
                  for e in extra]
            t = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], sp, use_tqdm=False)
            gen_s = time.perf_counter() - t
            per = {}
            for i, o in zip(order, outs):
                item = {"token_ids": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                        "num_cached_tokens": o.num_cached_tokens}
                if spec["plugin"]:
                    from kvcert.vllm import certificate_report, certificates

                    c = certificates(o)
                    item["certificates"] = None if c is None else c.tolist()
                    item["report"] = certificate_report(o)
                per[str(i)] = item
            result["runs"].append({"outputs": per, "gen_s": gen_s})
        if spec["plugin"]:
            from kvcert.vllm import blocks_freed, stats

            result["stats"] = stats(llm)
            result["blocks_freed"] = blocks_freed(llm)
        if recorder is not None:
            result["handoffs"] = recorder.summary()
        return result
    finally:
        if recorder is not None:
            recorder.undo()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the engine is dropped either way
            pass
        if original is not None:  # the next engine of this driver gets the plugin as it is
            setattr(*original)


def ad_hoc_attributes(obj) -> list[str]:
    """The ``kvcert*`` attributes of ``obj`` that its class does not declare as dataclass fields: attributes
    added to an object of vLLM's (the plugin's subclasses declare theirs, ``kvcert`` and ``kvcert_step``)."""
    declared = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
    return sorted(k for k in getattr(obj, "__dict__", {}) if k.startswith("kvcert") and k not in declared)


class HandoffRecorder:
    """Wraps the plugin's entry points in this process (an in-process engine: scheduler, worker and attention
    layers all run here) and records what each receives from vLLM: the type of the scheduler output the worker
    and the scheduler see, of the model runner output the scheduler reads, of the attention metadata each
    layer reads (and whether it carries a step), with every ad-hoc ``kvcert*`` attribute found on them
    (:func:`ad_hoc_attributes`), and how many steps carried orders and reports with content.
    ``add_attribute``: the worker also sets ``kvcert_certs`` on its output, as the plugin once did (the
    negative control: the recorder must see it)."""

    def __init__(self, add_attribute: bool = False):
        from kvcert.vllm.backend import CertifiedCPUAttentionImpl
        from kvcert.vllm.scheduler import CertifiedScheduler
        from kvcert.vllm.worker import _CertifiedWorker

        self.types: dict[str, set] = {}
        self.ad_hoc: dict[str, set] = {}
        self.counts: dict[str, int] = {}
        self._undo = []
        rec = self

        def wrap(cls, name, make):
            original = cls.__dict__[name]
            setattr(cls, name, make(original))
            self._undo.append((cls, name, original))

        def update_from_output(original):
            def f(sched, scheduler_output, model_runner_output):
                rec.note("scheduler: model runner output", model_runner_output)
                rec.note("scheduler: scheduler output", scheduler_output)
                report = getattr(model_runner_output, "kvcert", None)
                for key in ("certs", "compacted"):
                    rec.count(f"reports with {key}", bool(getattr(report, key, None)))
                return original(sched, scheduler_output, model_runner_output)
            return f

        def execute_model(original):
            def f(worker, scheduler_output, *args, **kwargs):
                rec.note("worker: scheduler output", scheduler_output)
                rec.note("worker: cached requests", scheduler_output.scheduled_cached_reqs)
                for req in scheduler_output.scheduled_new_reqs:
                    rec.note("worker: new request", req)
                orders = getattr(scheduler_output, "kvcert", None)
                for key in ("options", "clear"):
                    rec.count(f"orders with {key}", bool(getattr(orders, key, None)))
                return original(worker, scheduler_output, *args, **kwargs)
            return f

        def attach(original):
            def f(worker, out):
                out = original(worker, out)
                if add_attribute:
                    out.kvcert_certs = out.kvcert.certs
                return out
            return f

        def forward(original):
            def f(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
                rec.note("attention: metadata", attn_metadata)
                rec.count("forwards with a step", getattr(attn_metadata, "kvcert_step", None) is not None)
                return original(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            return f

        wrap(CertifiedScheduler, "update_from_output", update_from_output)
        wrap(_CertifiedWorker, "execute_model", execute_model)
        wrap(_CertifiedWorker, "_kvcert_attach", attach)
        wrap(CertifiedCPUAttentionImpl, "forward", forward)

    def note(self, where: str, obj) -> None:
        self.types.setdefault(where, set()).add(f"{type(obj).__module__}.{type(obj).__qualname__}")
        self.ad_hoc.setdefault(where, set()).update(ad_hoc_attributes(obj))

    def count(self, what: str, yes: bool) -> None:
        self.counts[what] = self.counts.get(what, 0) + int(yes)

    def summary(self) -> dict:
        return {"types": {k: sorted(v) for k, v in self.types.items()},
                "ad_hoc": {k: sorted(v) for k, v in self.ad_hoc.items()}, "counts": dict(self.counts)}

    def undo(self) -> None:
        for cls, name, original in reversed(self._undo):
            setattr(cls, name, original)
        self._undo = []


def _write(out_path: str, result: dict) -> None:
    """Write OUT atomically: the launcher polls for the file, so it never reads half of one."""
    with open(out_path + ".part", "w") as f:
        json.dump(result, f)
    os.replace(out_path + ".part", out_path)


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    _write(out_path, run_spec(spec))


def loop() -> None:
    """Engines in sequence, one per stdin line, until stdin closes."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for line in sys.stdin:
        if not line.strip():
            continue
        spec_path, out_path = line.rstrip("\n").split("\t")
        print(f"kvcert-driver: {spec_path}", flush=True)
        try:
            with open(spec_path) as f:
                result = run_spec(json.load(f))
        except Exception:  # noqa: BLE001 - handed to the test that asked, which raises it
            result = {"error": traceback.format_exc()}
        # the engine is collected before the next one starts: shut down above, its last reference gone
        # with run_spec's frame, then the cycles and vLLM's distributed state
        gc.collect()
        cleanup_dist_env_and_memory()
        _write(out_path, result)


if __name__ == "__main__":
    if sys.argv[1:] == ["--loop"]:
        loop()
    else:
        main(sys.argv[1], sys.argv[2])
