r"""The plugin's scheduler: frees a prompt's evicted blocks after its prefill, reports.

``CertifiedScheduler`` (engine argument ``scheduler_cls``) is vLLM's
synchronous ``Scheduler`` plus these duties. Its hand-offs with the worker
ride as vLLM's KV connector's do (:mod:`kvcert.vllm.handoff`): each step's
orders (:class:`~kvcert.vllm.handoff.StepOrders`) on the ``SchedulerOutput``
it returns (a :class:`~kvcert.vllm.handoff.CertifiedSchedulerOutput`), the
worker's :class:`~kvcert.vllm.handoff.StepReport` on the ``ModelRunnerOutput``
it reads (a :class:`~kvcert.vllm.handoff.CertifiedModelRunnerOutput`; any other
output is refused, naming the worker it needs).

1. **Free, token design** (``granularity="token"``, the default). The worker
   draws the token design and compacts the kept tokens of every (layer, KV
   head) into m blocks of the request's own, its last full prompt blocks first
   (:func:`kvcert.vllm.handoff.compaction_targets`), on the step that
   processes the prompt's last chunk (:mod:`kvcert.vllm.worker`), and reports
   ``StepReport.compacted`` = {request: {m, n_prompt, counts}}.
   The prompt's other full blocks (:func:`kvcert.vllm.handoff.compaction_layout`)
   are swapped for vLLM's ``null_block`` in the request's block table and
   returned to the pool (``BlockPool.free_blocks``), as vLLM's
   ``RSWAManager._remove_blocks_in_range`` does for a skipped range. The copy
   happened inside that step, before its output reached this scheduler, so
   before any freed block can be scheduled for another request's writes.
2. **Decide and free, block design** (``granularity="block"``). The worker
   reports the prompt's block importance (``StepReport.importance``); the
   configuration's :class:`kvcert.fast.BlockDesign` turns it into a decision
   (:meth:`~kvcert.fast.BlockDesign.decide`: pi_b at the budget
   ``(1 - compression_ratio) * n_blocks`` and the sample from the block stream
   keyed by the seed and :func:`prompt_event`, a hash of the prompt's token
   ids), the evicted blocks are freed as above, and the decision rides to the
   worker with the next step (``StepOrders.decisions``): the worker
   masks evicted blocks and adds -log pi_b to the sampled kept ones.
3. **Report.** Per-token certificates come back in
   ``StepReport.certs`` and leave with the finished request in
   ``RequestOutput.kv_transfer_params["kvcert"]`` (docs/serving.md, "The
   certificate channel"). The cumulative counters (``kvcert_stats``, plus
   ``requests_certified`` and the histogram of the per-request mean relative
   radius :math:`\bar r = \frac{1}{T} \sum_t r_t` over a finished certified
   request's T generated tokens) ride in every ``SchedulerStats`` this
   scheduler makes, for :class:`kvcert.vllm.metrics.CertifiedStatLogger`
   (``/metrics``; :func:`kvcert.vllm.metrics.encode_stats`).

4. **Prefix caching** (vLLM's ``enable_prefix_caching``, on by default). Requests
   without eviction use the prefix cache as in stock vLLM. A request that may
   evict (its configuration's ratio or error target) registers no block while
   it runs its prompt (the coordinator's ``cache_blocks`` is skipped for it),
   so no block its compaction overwrites is ever found by another request's
   prefix. With the token design and one KV-cache group it also reads the
   cache and feeds it:

   - its hit is cut to leave the event's queries to compute (the prompt's
     last :meth:`~kvcert.fast.TokenDesign.event_queries`, whole blocks:
     :meth:`_private_hit`), so its event reads the keys, values and queries it
     reads without the cache;
   - when the hit is taken (``allocate_slots``), the pool gives the request one
     block of its own per cached block (:meth:`_reserve`, ``StepOrders.private``):
     its compaction writes the kept tokens into its own prompt blocks, the last
     first, then into those (:func:`kvcert.vllm.handoff.compaction_targets`),
     never into a shared block;
   - after the event those blocks stand in for the cached ones in its block
     table and the cached blocks are released (:meth:`_compacted`): another
     request still holding them keeps them, and once free they wait in vLLM's
     free queue with their hashes, found by a later request with the prefix
     until the pool reuses them;
   - its compaction fills its last full prompt blocks first, so its first
     prompt blocks past the cached ones still hold the prompt as computed:
     after the event they are registered (:meth:`_register_intact`) and freed,
     and wait in the free queue with their hashes as well.

   The block design and models with several KV-cache groups (sliding-window
   layers under vLLM's hybrid manager) do not read it
   (``Request.skip_reading_prefix_cache``: the event sees the prompt it
   computed, as without the cache).

5. **Per-request options** (token design). A request's ``kvcert_*`` keys of
   ``SamplingParams.extra_args`` (:func:`kvcert.vllm.config.request_options`)
   are resolved when it is added and ride to the worker with the step
   that first schedules it (``StepOrders.options``); a
   request without them follows the engine's configuration. A request with a
   bad value is never scheduled: it finishes as aborted, with
   ``kv_transfer_params["kvcert"] = {"error": message naming the key}``, and
   the engine serves the others.

Preemption of a request that evicted: vLLM recomputes it from its tokens,
which restores the full cache; the worker is told to drop its state
(``StepOrders.clear``) and the request continues without eviction (certificate 0 for
the tokens after the resumption, flagged ``preempted`` in the report).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import torch
from vllm.v1.core.sched.scheduler import Scheduler

from kvcert.fast import prompt_event

from .config import KVCertConfig, check_softcap_design, check_vllm_config, request_options, softcap_of
from .handoff import CertifiedSchedulerOutput, StepOrders, compaction_layout, report_of
from .metrics import RADIUS_BUCKETS, encode_stats, radius_bucket

__all__ = ["CertifiedScheduler", "prompt_event"]


class CertifiedScheduler(Scheduler):
    """vLLM's synchronous scheduler with block eviction after prefill (module docstring)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        check_vllm_config(vllm_config)
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.kvcert = KVCertConfig.from_vllm_config(vllm_config) or KVCertConfig(compression_ratio=0.0)
        groups = kv_cache_config.kv_cache_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        # one group of full blocks, which the plugin compacts (a model with sliding-window layers under vLLM's
        # hybrid manager: beside it the windowed layers' groups, whose blocks vLLM's window manager frees and the
        # plugin never touches; with that manager off, the windowed layers share the one group and are compacted
        # to their window)
        full = [i for i, g in enumerate(groups) if type(g.kv_cache_spec) is FullAttentionSpec]
        others = [g for i, g in enumerate(groups) if i not in full]
        if len(full) != 1 or any(type(g.kv_cache_spec) is not SlidingWindowSpec for g in others):
            specs = [type(g.kv_cache_spec).__name__ for g in groups]
            raise ValueError(f"kvcert.vllm cannot serve model {vllm_config.model_config.model!r}: its KV cache "
                             f"groups {specs} are not one group of full blocks and sliding-window groups (MLA and "
                             f"state-space layers are unsupported)")
        self._group = full[0]  # the group the plugin compacts and frees blocks of
        self._manager = self.kv_cache_manager.coordinator.single_type_managers[self._group]
        self._bs = int(groups[self._group].kv_cache_spec.block_size)
        if self._bs != int(self.cache_config.block_size):
            raise ValueError(f"kvcert.vllm cannot serve model {vllm_config.model_config.model!r}: its full-attention "
                             f"KV-cache group has blocks of {self._bs} tokens, not the engine's block_size "
                             f"{self.cache_config.block_size}")
        self._design = self.kvcert.design  # kvcert.fast.TokenDesign or BlockDesign
        # a softcapped model (Gemma 2): a request whose design keeps a sketch is refused (check_softcap_design)
        self._softcap = softcap_of(getattr(vllm_config.model_config, "hf_text_config", None))
        self._pending: dict[str, list] = {}  # block design: log pi_b of the decisions for the next step
        self._clear: set[str] = set()  # requests whose mask the worker must drop
        self._records: dict[str, dict] = {}  # per evicted request: decision, certificates, pool counts
        self._decided: set[str] = set()  # requests already decided (never twice)
        self._freed_owner: dict[int, str] = {}  # freed block id -> former owner (while it runs)
        self._options: dict[str, dict] = {}  # per request with kvcert_* keys: its overrides of self.kvcert
        self._errors: dict[str, tuple[int, str]] = {}  # refused requests: (client index, message), not yet reported
        self.kvcert_stats = defaultdict(int)
        # the histogram of per-request mean relative radius (metrics.RADIUS_BUCKETS, last bucket +Inf)
        self._radius_counts = [0] * (len(RADIUS_BUCKETS) + 1)
        self._radius_sum = 0.0
        # the counters ride in SchedulerStats.waiting_lora_adapters, a field read only when LoRA is enabled
        self._send_metrics = getattr(vllm_config, "lora_config", None) is None
        self._private: set[str] = set()  # requests that may evict: never feed the prefix cache (module docstring, 4)
        self._reads: dict[str, KVCertConfig] = {}  # private requests that read it: their settings
        self._hits: dict[str, int] = {}  # private requests' cut hits (blocks), until allocate_slots takes them
        self._extras: dict[str, list] = {}  # blocks reserved for a request's compaction, until its event
        self._private_orders: dict[str, list[int]] = {}  # their ids, for the worker with the next step
        self._head_size = int(vllm_config.model_config.get_head_size())
        self._register = None  # vLLM's own cache_blocks (prefix caching on)
        if self.cache_config.enable_prefix_caching:
            coordinator = self.kv_cache_manager.coordinator
            register = self._register = coordinator.cache_blocks

            def cache_blocks(request, num_computed_tokens):
                if request.request_id not in self._private:
                    register(request, num_computed_tokens)

            coordinator.cache_blocks = cache_blocks
            allocate = self.kv_cache_manager.allocate_slots

            def allocate_slots(request, *args, **kwargs):
                out = allocate(request, *args, **kwargs)
                if out is not None:
                    self._reserve(request)
                return out

            self.kv_cache_manager.allocate_slots = allocate_slots

    # ------------------------------------------------------------------ a private request's prefix-cache hit

    def _private_hit(self, request, blocks, num_tokens: int) -> tuple[object, int]:
        """A private request's prefix-cache hit (``blocks``, ``num_tokens``: vLLM's) cut for its eviction event
        (module docstring, 4): whole blocks that leave the event's queries (the prompt's last
        :meth:`kvcert.fast.TokenDesign.event_queries`) to compute, and none unless the pool holds, besides the
        blocks the prompt's uncached rest needs, two per cached block (the hit's own, which may wait in the free
        queue, and one for the compaction to write in: :meth:`_reserve`). A prompt too short to evict keeps
        vLLM's hit: its blocks are never written."""
        cfg = self._reads[request.request_id]
        n = request.num_prompt_tokens
        if not cfg.evicts(n, self._bs, head_size=self._head_size):
            return blocks, num_tokens
        w = cfg.design.event_queries(n, n)
        c = min(num_tokens // self._bs, max(0, n - w) // self._bs)
        rest = -(-(n - c * self._bs) // self._bs)
        if c and self._manager.block_pool.get_num_free_blocks() < 2 * c + rest + 1:
            c = 0
        if c:
            self._hits[request.request_id] = c
        return type(blocks)(tuple(list(group[:c]) for group in blocks.blocks)), c * self._bs

    def _get_local_prefix_cache_hit(self, request):
        blocks, num_tokens, boundary, diverged = super()._get_local_prefix_cache_hit(request)
        if request.request_id in self._reads and num_tokens:
            blocks, num_tokens = self._private_hit(request, blocks, num_tokens)
        return blocks, num_tokens, boundary, diverged

    def _reserve(self, request) -> None:
        """After ``allocate_slots`` took a private request's cut hit (its c cached blocks now held by it): c blocks
        of its own from the pool, which its compaction writes in place of the cached ones (their ids ride to the
        worker with the next step, ``StepOrders.private``)."""
        c = self._hits.pop(request.request_id, 0)
        if not c or request.request_id in self._extras or request.request_id in self._decided:
            return
        pool = self._manager.block_pool
        if pool.get_num_free_blocks() < c:  # _private_hit left room for them: never reached
            raise RuntimeError(f"kvcert.vllm: request {request.request_id} read {c} cached blocks and the pool "
                               f"has {pool.get_num_free_blocks()} free for its compaction")
        extras = pool.get_new_blocks(c)
        self._extras[request.request_id] = extras
        self._private_orders[request.request_id] = [b.block_id for b in extras]

    def _release_extras(self, req_id: str) -> None:
        """Return the blocks reserved for a request's compaction (:meth:`_reserve`) that its event has not placed
        (it finished or was preempted first)."""
        extras = self._extras.pop(req_id, None)
        self._private_orders.pop(req_id, None)
        self._hits.pop(req_id, None)
        if extras:
            self._manager.block_pool.free_blocks(extras)

    # ------------------------------------------------------------------ decide and free

    def _free(self, req_id: str, indices) -> tuple[int, int, int]:
        """Return the request's logical blocks ``indices`` to the pool (tail first, as
        ``_remove_blocks_in_range``), swapped for ``null_block``; (freed, free before, free after)."""
        blocks = self._manager.req_to_blocks.get(req_id)
        pool = self._manager.block_pool
        free_before = pool.get_num_free_blocks()
        freed = 0
        if indices and self.kvcert.free_blocks and blocks is not None:
            null = self._manager._null_block
            out = []
            for j in sorted(indices, reverse=True):
                blk = blocks[j]
                if blk is null or blk.is_null:
                    continue
                out.append(blk)
                blocks[j] = null
                if self.kvcert.track_reuse:
                    self._freed_owner[blk.block_id] = req_id
            if out:
                pool.free_blocks(out)
                freed = len(out)
        return freed, free_before, pool.get_num_free_blocks()

    def _compacted(self, request, info: dict) -> None:
        """Token design: free the full prompt blocks past the compacted ones and open the request's record."""
        req_id = request.request_id
        self._decided.add(req_id)
        n_prompt, m = int(info["n_prompt"]), int(info["m"])
        n_full = n_prompt // self._bs
        used, intact = compaction_layout(n_full, len(self._extras.get(req_id, ())), m)
        registered = self._register_intact(request, intact)
        shared = self._place_extras(req_id)
        freed, free_before, free_after = self._free(req_id, list(range(used, intact)))
        counts = info["counts"]
        evicted = sum(n_prompt - c for layer in counts for c in layer)
        self._records[req_id] = {
            "granularity": "token", "n_prompt_tokens": n_prompt, "m": m, "kept_counts": counts,
            "evicted": evicted, "blocks_freed": freed, "free_before": free_before, "free_after": free_after,
            # a sketched design's sketches, held in the worker beside the compacted blocks (0 without)
            "sketch_bytes": int(info.get("sketch_bytes", 0)),
            "certificates": [0.0] * request.num_output_tokens,  # tokens sampled from the full cache
            "preempted": False,
            # cached prefix blocks the request read, released after its event, and the blocks it added to the
            # cache (module docstring, 4)
            "prefix_blocks_read": shared, "prefix_blocks_registered": registered,
        }
        if "kept_positions" in info:
            self._records[req_id]["kept_positions"] = info["kept_positions"]
        self.kvcert_stats["requests_decided"] += 1
        self.kvcert_stats["requests_evicted"] += 1 if evicted else 0
        self.kvcert_stats["tokens_evicted"] += evicted
        self.kvcert_stats["blocks_freed"] += freed

    def _register_intact(self, request, intact: int) -> int:
        """Register a private request's first ``intact`` prompt blocks in the prefix cache after its event: its
        compaction left them as computed (:func:`kvcert.vllm.handoff.compaction_layout`). Returns how many
        blocks were added (those it read from the cache are registered already)."""
        if self._register is None or request.request_id not in self._reads:
            return 0
        before = self._manager.num_cached_block.get(request.request_id, 0)
        if intact <= before:
            return 0
        self._register(request, intact * self._bs)
        return intact - before

    def _place_extras(self, req_id: str) -> int:
        """After a private request's event: the blocks its compaction wrote (:meth:`_reserve`) stand in for the
        cached blocks it read at the head of its block table, and those are released, tail first as vLLM frees a
        request's blocks (still cached: another holder keeps them; once free, they wait in the free queue with
        their hashes). Returns how many cached blocks it read."""
        extras = self._extras.pop(req_id, None)
        if not extras:
            return 0
        blocks = self._manager.req_to_blocks[req_id]
        c = len(extras)
        shared = list(blocks[:c])
        blocks[:c] = extras
        self._manager.block_pool.free_blocks(reversed(shared))
        return c

    def _decide(self, request, importance) -> None:
        req_id = request.request_id
        self._decided.add(req_id)
        n_prompt = request.num_prompt_tokens
        nb = -(-n_prompt // self._bs)
        # block importance per block (already aggregated over layers and heads by the worker)
        ub = torch.as_tensor(np.asarray(importance, dtype=np.float64))
        decision = None
        if ub.shape == (nb,):
            decision = self._design.decide(ub, event=prompt_event(request.prompt_token_ids), n_tokens=n_prompt)
        if decision is None:  # the certainty set fills the budget, or the importance is not the prompt's
            self.kvcert_stats["requests_not_evicted"] += 1
            return
        pi, keep, evicted = decision.pi, decision.kept, decision.evicted
        freed, free_before, free_after = self._free(req_id, evicted)
        self._pending[req_id] = decision.log_pi.tolist()
        self._records[req_id] = {
            "importance": ub.tolist(), "pi": pi.tolist(), "kept": [bool(k) for k in keep.tolist()], "evicted": evicted,
            "blocks_freed": freed, "free_before": free_before, "free_after": free_after,
            "certificates": [0.0] * request.num_output_tokens,  # tokens sampled from the full cache
            "preempted": False,
        }
        self.kvcert_stats["requests_evicted"] += 1 if evicted else 0
        self.kvcert_stats["requests_decided"] += 1
        self.kvcert_stats["blocks_evicted"] += len(evicted)
        self.kvcert_stats["blocks_freed"] += freed

    def _check_reuse(self, scheduler_output) -> None:
        if not self._freed_owner:
            return
        new = [(r.req_id, r.block_ids) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        new += [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids) if ids]
        for req_id, block_ids in new:
            for group in block_ids:
                for bid in group:
                    owner = self._freed_owner.get(bid)
                    if owner is not None and owner != req_id:
                        owner_req = self.requests.get(owner)
                        if owner_req is not None and not owner_req.is_finished():
                            self.kvcert_stats["blocks_reused_while_owner_runs"] += 1
                        del self._freed_owner[bid]

    # ------------------------------------------------------------------ engine hooks

    def add_request(self, request) -> None:
        if request.request_id not in self.requests:
            params = request.sampling_params
            try:
                options = request_options(self.kvcert, getattr(params, "extra_args", None) if params else None)
                # the request's settings: the engine's, with its kvcert_* overrides
                served = self.kvcert if options is None else replace(self.kvcert, **options)
                if self._softcap is not None and options is not None and served.enabled:
                    check_softcap_design(served)
            except ValueError as e:  # this request only: never scheduled, reported in update_from_output
                self._errors[request.request_id] = (request.client_index, str(e))
                self.kvcert_stats["requests_refused"] += 1
                return
            if options is not None:
                self._options[request.request_id] = options
            if self.cache_config.enable_prefix_caching and served.enabled:  # it may evict: private (docstring, 4)
                self._private.add(request.request_id)
                if served.tokens and len(self.kv_cache_config.kv_cache_groups) == 1:
                    self._reads[request.request_id] = served  # reads a cut hit (module docstring, 4)
                else:
                    request.skip_reading_prefix_cache = True
        super().add_request(request)

    def has_requests(self) -> bool:
        return bool(self._errors) or super().has_requests()

    def schedule(self, *args, **kwargs) -> CertifiedSchedulerOutput:
        """vLLM's step with the plugin's orders for it (:class:`kvcert.vllm.handoff.StepOrders`)."""
        out = super().schedule(*args, **kwargs)
        if self.kvcert.track_reuse:
            self._check_reuse(out)
        options = {r.req_id: self._options[r.req_id] for r in out.scheduled_new_reqs if r.req_id in self._options}
        orders = StepOrders(decisions=self._pending, clear=sorted(self._clear), options=options,
                            stats=dict(self.kvcert_stats), private=self._private_orders)
        self._pending, self._clear, self._private_orders = {}, set(), {}
        self._hits.clear()  # a cut hit not taken (its request was not scheduled) is looked up again
        return CertifiedSchedulerOutput.of(out, orders)

    def update_from_output(self, scheduler_output, model_runner_output):
        report = report_of(model_runner_output)  # the worker's StepReport of the step
        certs = report.certs
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        for req_id, rec in self._records.items():  # before super(): a request may finish in it
            i = index.get(req_id)
            if i is not None and sampled and len(sampled[i]) > 0 and req_id in scheduler_output.num_scheduled_tokens:
                rec["certificates"].extend([float(certs.get(req_id, 0.0))] * len(sampled[i]))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id, info in report.compacted.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished() and req_id not in self._decided:
                self._compacted(request, info)
        for req_id, imp in report.importance.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished() or req_id in self._decided:
                continue
            if request.num_computed_tokens < request.num_prompt_tokens:
                continue
            self._decide(request, imp)
        if self._errors:
            self._report_errors(outputs)
        return outputs

    def _report_errors(self, outputs: dict) -> None:
        """Finish the refused requests (:meth:`add_request`) as aborted, with the message in their
        ``kv_transfer_params["kvcert"]["error"]``."""
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        for req_id, (client, message) in self._errors.items():
            eco = outputs.get(client)
            if eco is None:
                eco = outputs[client] = EngineCoreOutputs(outputs=[])
            eco.outputs.append(EngineCoreOutput(request_id=req_id, new_token_ids=[], finish_reason=FinishReason.ABORT,
                                                kv_transfer_params={"kvcert": {"error": message}}))
        self._errors = {}

    def _preempt_request(self, request, *args, **kwargs):
        req_id = request.request_id
        if req_id in self._extras:  # preempted before its event: its reserved blocks go back, its orders too
            self._release_extras(req_id)
            self._clear.add(req_id)
        if req_id in self._records and not self._records[req_id]["preempted"]:
            # the recompute restores the full cache: drop the mask, no second eviction
            self._records[req_id]["preempted"] = True
            self._clear.add(req_id)
            self._pending.pop(req_id, None)
            self.kvcert_stats["evicted_requests_preempted"] += 1
        return super()._preempt_request(request, *args, **kwargs)

    def make_stats(self, *args, **kwargs):
        """vLLM's ``SchedulerStats`` plus the plugin's cumulative counters (module docstring, 3)."""
        stats = super().make_stats(*args, **kwargs)
        if stats is not None and self._send_metrics:
            stats.waiting_lora_adapters.update(encode_stats(self.kvcert_stats, self._radius_counts,
                                                            self._radius_sum))
        return stats

    def _free_request(self, request, *args, **kwargs):
        kv_params, ec_params = super()._free_request(request, *args, **kwargs)
        req_id = request.request_id
        rec = self._records.pop(req_id, None)
        self._options.pop(req_id, None)
        self._release_extras(req_id)
        self._reads.pop(req_id, None)
        self._private.discard(req_id)
        self._decided.discard(req_id)
        self._pending.pop(req_id, None)
        if rec is not None:
            if rec.get("granularity") == "token" or rec.get("evicted"):  # what certificates(output) returns
                certs = rec["certificates"]
                mean = float(np.mean(certs)) if certs else 0.0
                self.kvcert_stats["requests_certified"] += 1
                self._radius_counts[radius_bucket(mean)] += 1
                self._radius_sum += mean
            kv_params = dict(kv_params or {})
            kv_params["kvcert"] = rec
            self._clear.add(req_id)
        return kv_params, ec_params
