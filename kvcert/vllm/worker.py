"""The plugin's worker: holds the eviction decisions, runs each step with them, reports back.

``CertifiedCPUWorker`` (engine argument ``worker_cls``) is vLLM's ``CPUWorker``
plus a per-step context (:class:`Step`) that the attention backend reads. The
hand-offs (:mod:`kvcert.vllm.handoff`) are vLLM's own carriers, as its KV
connector's: the scheduler's :class:`~kvcert.vllm.handoff.StepOrders` arrive on
the step's ``SchedulerOutput`` (a :class:`~kvcert.vllm.handoff.CertifiedSchedulerOutput`);
the step's context reaches the attention layers on the attention metadata
(the worker hands it to the plugin's metadata builders for the step's forward,
which put it on :attr:`kvcert.vllm.backend.CertifiedCPUAttentionMetadata.kvcert_step`);
the step's :class:`~kvcert.vllm.handoff.StepReport` leaves on the model
runner's output (a :class:`~kvcert.vllm.handoff.CertifiedModelRunnerOutput`).

Token design (``granularity="token"``, the default): the worker decides. On the
step that processes a prompt's last chunk, every layer of the backend draws
the token design and compacts the kept tokens into m blocks of the request's
own, its last full prompt blocks first (:func:`kvcert.vllm.handoff.compaction_targets`:
never a cached block it read, and its first prompt blocks stay as computed);
after the step the worker holds the request's :class:`Compacted` state (log pi
per layer, KV head and slot, the compacted blocks' ids) and reports
``StepReport.compacted`` = {request: {m, n_prompt, counts, ...}}, from which
the scheduler frees the prompt's other full blocks. The
copy is done within that step, before the step's output reaches the
scheduler, so before any freed block can be handed to another request.

Block design:

- before the step: the decisions of ``StepOrders.decisions``
  (log pi_b per prompt block, -inf = evicted) become per-request states;
  ``StepOrders.clear`` and finished requests drop theirs;
- during the step (in the backend): rows with a state take the masked,
  bias-corrected torch path and add their relative radii; rows that finish
  their prompt add their token scores (the configured scorer, per layer and
  KV head: ``kvcert.fast.BlockDesign.score``);
- after the step: ``StepReport.certs`` = {request: mean relative
  radius over layers and query heads} and ``StepReport.importance`` =
  {request: block importance (n_blocks,)} (``kvcert.fast.BlockDesign.block_importance``
  over the stacked (layer, KV head) scores, normalized per head, ``reduce``
  over them), read by :class:`kvcert.vllm.scheduler.CertifiedScheduler`.

Chunked prefill: a prompt longer than a step's token budget is processed over
several steps, and its eviction event runs on the last chunk. On each earlier
chunk of a prompt still to be decided, every layer keeps the prompt's last
queries (:meth:`Step.keep_queries`, at most the event's window,
:meth:`Step.event_window`), held on the worker between steps
(:class:`PromptQueries`, dropped at the event, when the request finishes or
is preempted); the event reads them joined with the last chunk's own, so it
reads the queries the unchunked engine's event reads.

Per-request options (token design): a request whose ``SamplingParams.extra_args``
carry ``kvcert_*`` keys arrives with its overrides on ``StepOrders.options``
(:func:`kvcert.vllm.config.request_options`); the worker keeps the request's
:class:`KVCertConfig` (:meth:`Step.config_of`), whose design decides whether
and how its prompt is sampled and whose kind and delta certify its decode rows.

The rows of a step are matched to requests through the model runner's
``input_batch.req_ids`` (the order the attention metadata is built in).

``CertifiedGPUWorker`` is the same context over vLLM's CUDA ``Worker`` for the
CUDA backend (:mod:`kvcert.vllm.gpu_backend`, which reads the rows through
:meth:`Step.row_states`); prepared, never run on a device (the platform
refusal of :func:`kvcert.vllm.config.check_vllm_config` keeps it from starting).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker as GPUWorker  # CPUWorker's own base class

from kvcert.fast import ClusterSketch, radius_from_statistics

from . import backend as _backend
from . import gpu_backend as _gpu_backend
from .config import KVCertConfig, check_vllm_config
from .handoff import StepReport, compaction_targets, orders_of, with_report

__all__ = ["CertifiedCPUWorker", "CertifiedGPUWorker", "Compacted", "PromptQueries", "Step"]

_NEG_INF = float("-inf")


@dataclass
class _Masked:
    req_id: str
    token: int  # index of the row's query token in the step's tokens
    block_ids: torch.Tensor  # physical ids of the kept blocks (m,)
    pi: torch.Tensor  # (1, 1, m * bs) pi_b per token, 0 past seq_len
    positions: torch.Tensor  # (1, 1, m * bs) token positions, -1 past seq_len
    log_pi: torch.Tensor  # (m, bs) float32 log pi_b per slot, -inf past seq_len


@dataclass
class Compacted:
    """A request whose prompt was compacted (token design): what its decode rows read.

    ``log_pi`` (layers, h_kv, m * bs) float32: log pi of compacted slot j of each layer and KV head, -inf on
    padding; the prompt's n_prompt tokens are represented only there, the later tokens sit at their own
    positions (>= n_prompt) with pi = 1. ``sketches``: with a sketched design (``KVCertConfig(sketch=...)``),
    each layer's :class:`kvcert.fast.ClusterSketch` (batch 1) of the evicted prompt tokens (None for a
    sliding-window layer, which keeps its window and samples nothing), held beside the
    compacted blocks in the worker's memory; else None. ``value_sums`` (layers, h_kv, dv + 1) float64, with a
    sketch: each layer and KV head's sum of the compacted prompt's kept values and their count
    (:func:`kvcert.vllm.backend.compact_prompt`'s), from which the sketched decode's value centre is formed
    without reading those values again at every step; else None."""

    n_prompt: int
    m: int
    log_pi: torch.Tensor
    sketches: list | None = None
    value_sums: torch.Tensor | None = None
    #: the physical ids (m,) of the compacted blocks (:func:`kvcert.vllm.handoff.compaction_targets`); None: the
    #: block table's first m
    block_ids: torch.Tensor | None = None

    @property
    def sketch_bytes(self) -> int:
        """Bytes the sketches hold (0 without a sketch): every tensor of every layer's sketch (a sliding-window
        layer holds none)."""
        return sum(sk.nbytes for sk in self.sketches or () if sk is not None)


@dataclass
class _CompactedRow:
    req_id: str
    token: int  # index of the row's query token in the step's tokens
    block_ids: torch.Tensor  # (m + t,) compacted blocks, then the blocks of positions n_prompt .. seq_len - 1
    tail_log_pi: torch.Tensor  # (t * bs,) 0 on positions n_prompt .. seq_len - 1, -inf elsewhere
    state: Compacted
    certificate: tuple | None = None  # (kind, delta, sketched) of the request's certificate
    seq_len: int = 0  # the row's sequence length (its query sits at position seq_len - 1)


@dataclass
class PromptQueries:
    """The last queries of a prompt's chunks before its last (chunked prefill), held by the worker between
    steps: with the last chunk's own queries, the queries the prompt's eviction event reads, as the unchunked
    engine's event reads them from one chunk.

    ``end``: the position after the last query held (the next chunk starts there). ``layers``: {layer:
    (w, h_q, d)} the queries of positions ``end - w .. end - 1``, w at most the event's window
    (:meth:`Step.event_window`), in the model's dtype. Dropped when the event is done, or when the request
    finishes or is preempted (:meth:`_CertifiedWorker._kvcert_before`)."""

    end: int
    layers: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes the held queries take."""
        return sum(q.numel() * q.element_size() for q in self.layers.values())

    def join(self, layer: int, chunk: torch.Tensor, start: int) -> torch.Tensor:
        """The queries (w + c, h_q, d) of positions ``end - w .. start + c - 1``: those held at ``layer`` then
        ``chunk`` (c, h_q, d), the chunk that starts at position ``start``; ``chunk`` alone when the held
        queries do not end where it starts (a prompt recomputed from its start after a preemption)."""
        held = self.layers.get(layer) if self.end == start else None
        return chunk if held is None else torch.cat([held, chunk])


@dataclass
class _Chunk:
    req_id: str
    q_len: int
    q_end: int
    seq_len: int  # the position after the chunk's last query
    window: int  # the queries the prompt's event reads (Step.event_window): the most kept
    past: PromptQueries | None = None  # the queries held from the prompt's earlier chunks


@dataclass
class _Importance:
    req_id: str
    q_len: int
    q_end: int
    seq_len: int
    all_block_ids: torch.Tensor
    config: KVCertConfig | None = None  # the request's settings (its design samples the prompt)
    past: PromptQueries | None = None  # the queries held from the prompt's earlier chunks (chunked prefill)
    # the blocks the compaction writes (kvcert.vllm.handoff.compaction_targets); None: all_block_ids in order
    targets: torch.Tensor | None = None

    @property
    def write_ids(self) -> torch.Tensor:
        """The physical blocks the compaction writes, in the order of the compacted blocks: never a block shared
        with another request (:func:`kvcert.vllm.handoff.compaction_targets`)."""
        return self.all_block_ids if self.targets is None else self.targets

    def queries(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """The prompt's last queries this worker has at ``layer`` (w, h_q, d): those held from its earlier
        chunks, then this chunk's (the step's ``query`` rows ``q_end - q_len .. q_end - 1``)."""
        chunk = query[self.q_end - self.q_len : self.q_end]
        return chunk if self.past is None else self.past.join(layer, chunk, self.seq_len - self.q_len)


@dataclass
class _SubBatch:
    token_index: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    scheduler_metadata: torch.Tensor


@dataclass
class _Plan:
    masked: list = field(default_factory=list)
    masked_tokens: torch.Tensor | None = None  # (E,) query token of each masked row
    masked_block_ids: torch.Tensor | None = None  # (E, M) kept physical blocks, padded
    masked_log_pi: torch.Tensor | None = None  # (E, M, bs) log pi per slot, -inf = padding / past the end
    block_chunks: list | None = None  # backend.block_chunks, set by the first layer of the step
    compacted: list = field(default_factory=list)
    compacted_tokens: torch.Tensor | None = None  # (E,) query token of each compacted row
    compacted_block_ids: torch.Tensor | None = None  # (E, M) blocks read per row, padded
    importance: list = field(default_factory=list)
    chunks: list = field(default_factory=list)  # _Chunk: prompt chunks before the last, whose queries are kept
    stock_rows: list = field(default_factory=list)
    block_size: int = 0
    _sub: _SubBatch | None = None
    _compacted_log_pi: torch.Tensor | None = None  # (layers, E, h_kv, M * bs), built at the step's first layer
    _compacted_sums: torch.Tensor | None = None  # (layers, E, h_kv, dv + 1), likewise, when every row has its sums
    _tail_start: torch.Tensor | None = None  # (E,) int64: the slot where each compacted row's tail starts, m bs
    _has_sums: torch.Tensor | None = None  # (E,) bool: the rows whose state holds its sums (a sketched design)
    _all_sums: bool = False  # every compacted row holds its sums
    _groups: list | None = None  # compacted_groups(), built at the step's first layer
    _windowed: dict = field(default_factory=dict)  # window -> its layers' log pi (E, h_kv, M * bs), built once

    def compacted_inputs(self, layer: int, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids (E, M) and log pi (E, h_kv, M * bs) of the compacted rows at one layer (-inf = not a token:
        padding slots, padding blocks, positions before the prompt's end in the tail blocks or past seq_len).

        ``window``: the layer is a sliding-window layer (compacted by :func:`kvcert.vllm.backend.window_slots`:
        slot j of the prompt holds position ``max(0, n_prompt - window) + j``); each row's slots whose position
        lies outside its query's window (position <= seq_len - 1 - window) get -inf too. Every such layer of a
        window holds the same layout, so the mask is built once per step and window."""
        if window is not None:
            if window not in self._windowed:
                self._windowed[window] = self._window_mask(self.compacted_inputs(layer)[1], window)
            return self.compacted_block_ids, self._windowed[window]
        lp = self._compacted_log_pi
        if lp is None:  # every layer's at the step's first call: one copy per row, not one per row and layer
            E, M = self.compacted_block_ids.shape
            n_layers, h = self.compacted[0].state.log_pi.shape[:2]
            lp = torch.full((n_layers, E, h, M * self.block_size), float("-inf"))
            for j, row in enumerate(self.compacted):
                heads = row.state.log_pi  # (layers, h, m * bs)
                c = heads.shape[-1]
                lp[:, j, :, :c] = heads
                lp[:, j, :, c : c + row.tail_log_pi.numel()] = row.tail_log_pi
            self._compacted_log_pi = lp
        return self.compacted_block_ids, lp[layer]

    def _window_mask(self, log_pi: torch.Tensor, window: int) -> torch.Tensor:
        """``log_pi`` (E, h_kv, M * bs) of a sliding-window layer with -inf on every slot outside its row's window."""
        bs, width = self.block_size, log_pi.shape[-1]
        pos = torch.full((len(self.compacted), width), -1, dtype=torch.int64)
        for j, row in enumerate(self.compacted):
            n, c = row.state.n_prompt, row.state.m * bs
            start = max(0, n - window)
            pos[j, : n - start] = torch.arange(start, n)  # the compacted window (the rest of the m blocks: padding)
            first = n // bs
            t = row.tail_log_pi.numel()
            pos[j, c : c + t] = torch.arange(first * bs, first * bs + t)  # the tail blocks at their positions
        seq = torch.tensor([row.seq_len for row in self.compacted], dtype=torch.int64)
        outside = pos <= (seq - 1 - window)[:, None]  # padding (-1) is -inf already
        return log_pi.masked_fill(outside[:, None, :], float("-inf"))

    def compacted_centres(self, layer: int, rows: torch.Tensor | None = None):
        """The sketched decode's value-centre inputs of the compacted rows ``rows`` (all: None) at one layer:
        (float64 (E, h_kv, dv + 1) the compacted prompt's kept value sums and count, int64 (E,) the slot where
        each row's tail starts, m bs), or None when one of those rows holds no sums (a row without a sketch; its
        group's decode then reads the centre from the slots)."""
        if self._compacted_sums is None:  # every layer's at the step's first call; zeros for a row without sums
            states = [row.state for row in self.compacted]
            like = next((st.value_sums for st in states if st.value_sums is not None), None)
            if like is None:
                return None
            self._compacted_sums = torch.stack([like.new_zeros(like.shape) if st.value_sums is None
                                                else st.value_sums for st in states], dim=1)
            self._tail_start = torch.tensor([st.m * self.block_size for st in states], dtype=torch.int64)
            self._has_sums = torch.tensor([st.value_sums is not None for st in states])
            self._all_sums = bool(self._has_sums.all())
        if not (self._all_sums if rows is None else bool(self._has_sums[rows].all())):
            return None
        sums, start = self._compacted_sums[layer], self._tail_start
        return (sums, start) if rows is None else (sums[rows], start[rows])

    def compacted_groups(self, n_tokens: int) -> list:
        """The compacted rows by their request's certificate (kind, delta, sketched), the same at every layer of
        the step: ``(certificate, rows, sel, tokens, req_ids, in_order)`` per group, ``rows`` the indices into
        :attr:`compacted`, ``sel`` them as a tensor (None: the group is every compacted row), ``tokens`` the
        rows' query tokens, and ``in_order`` True when those are the step's ``n_tokens`` tokens 0, 1, ... in
        order (the query and output are then read and written whole, without an index)."""
        if self._groups is None:
            by: dict[tuple, list] = {}
            for j, row in enumerate(self.compacted):
                by.setdefault(row.certificate, []).append(j)
            self._groups = []
            for certificate, rows in by.items():
                sel = None if len(by) == 1 else torch.tensor(rows, dtype=torch.int64)
                tokens = self.compacted_tokens if sel is None else self.compacted_tokens[sel]
                in_order = tokens.tolist() == list(range(n_tokens))
                self._groups.append((certificate, rows, sel, tokens, [self.compacted[j].req_id for j in rows],
                                     in_order))
        return self._groups

    def stack(self) -> None:
        """The batched inputs of the compacted and the masked rows, each row padded to the longest (a compacted
        row with its first block, a masked row with block 0 and log pi -inf)."""
        if self.compacted:
            M = max(len(c.block_ids) for c in self.compacted)
            self.compacted_tokens = torch.tensor([c.token for c in self.compacted], dtype=torch.int64)
            pad = [c.block_ids[:1].expand(M - len(c.block_ids)) for c in self.compacted]
            self.compacted_block_ids = torch.stack([torch.cat([c.block_ids, p]) for c, p in zip(self.compacted, pad)])
        if self.masked:
            E, M = len(self.masked), max(len(m.block_ids) for m in self.masked)
            self.masked_tokens = torch.tensor([m.token for m in self.masked], dtype=torch.int64)
            self.masked_block_ids = torch.zeros(E, M, dtype=torch.int64)
            self.masked_log_pi = torch.full((E, M, self.block_size), _NEG_INF)
            for j, m in enumerate(self.masked):
                self.masked_block_ids[j, : len(m.block_ids)] = m.block_ids
                self.masked_log_pi[j, : m.log_pi.shape[0]] = m.log_pi

    def stock_metadata(self, impl, md, dtype: torch.dtype) -> _SubBatch:
        """The stock rows as a sub-batch of the step's attention metadata ``md``, with the C++ op's work partition
        for the model's ``dtype`` (the query's)."""
        if self._sub is None:
            qsl = md.query_start_loc.tolist()
            rows = self.stock_rows
            tokens = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in rows])
            lens = torch.tensor([qsl[r + 1] - qsl[r] for r in rows], dtype=md.query_start_loc.dtype)
            sub_qsl = torch.zeros(len(rows) + 1, dtype=md.query_start_loc.dtype)
            sub_qsl[1:] = torch.cumsum(lens, 0)
            idx = torch.tensor(rows)
            seq = md.seq_lens.index_select(0, idx).contiguous()
            table = md.block_table.index_select(0, idx).contiguous()
            sched = _backend.stock_scheduler_metadata(impl, seq, sub_qsl, md.causal, "vec", dtype)
            self._sub = _SubBatch(tokens, sub_qsl, seq, table, sched)
        return self._sub


class _Certificates:
    """The certificates a step's layers leave, per request: each layer's relative radii (rows, query heads) or
    the statistics they are taken from, kept as given and summed once per step (:meth:`means`)."""

    def __init__(self):
        self.sum: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self._layers: list[tuple] = []  # (rows, relative radii or None, (kind, delta, statistics) or None)

    def add(self, req_ids: list, rel: torch.Tensor) -> None:
        self._layers.append((tuple(req_ids), rel, None))

    def add_statistics(self, req_ids: list, kind: str, delta: float, stats: dict) -> None:
        self._layers.append((tuple(req_ids), None, (kind, delta, stats)))

    def means(self) -> dict[str, float]:
        """{request: mean over the step's layers of the mean relative radius over query heads}."""
        self._sum()
        return {r: self.sum[r] / self.n[r] for r in self.sum}

    def _sum(self) -> None:
        pending: dict[tuple, list] = {}  # (rows, kind, delta) -> the layers' statistics, in call order
        for rids, _, stats in self._layers:
            if stats is not None:
                pending.setdefault((rids,) + stats[:2], []).append(stats[2])
        radii = {}
        for (rids, kind, delta), layers in pending.items():
            stacked = {k: None if layers[0][k] is None else torch.stack([x[k] for x in layers]) for k in layers[0]}
            stacked = _backend.with_output_norm(stacked)  # the outputs' norms, every layer's in one call
            radii[rids, kind, delta] = iter(radius_from_statistics(kind, delta, **stacked)[2])
        groups: dict[tuple, list] = {}
        for rids, rel, stats in self._layers:
            groups.setdefault(rids, []).append(rel if stats is None else next(radii[(rids,) + stats[:2]]))
        for rids, rels in groups.items():
            for means in torch.stack(rels).double().mean(-1).tolist():  # layer by layer, in call order
                for rid, mean in zip(rids, means):
                    self.sum[rid] = self.sum.get(rid, 0.0) + mean
                    self.n[rid] = self.n.get(rid, 0) + 1
        self._layers = []


def _compacted_state(rid: str, entries: dict, apart: set = frozenset()) -> tuple[Compacted, dict]:
    """A compacted request's :class:`Compacted` state from its layers' entries ({layer: (layout, sketch,
    value sums, window)}, :meth:`Step.add_compaction`), and its layouts by layer; refuses a request compacted in
    some layers only, or sketched in some of its sampled layers only (a sliding-window layer keeps its window and
    no sketch). The layers ``apart`` (sliding-window layers in KV-cache groups of their own) are never compacted:
    their rows of log pi stay -inf (never read) and they set nothing of the state."""
    n_layers = max(set(entries) | set(apart)) + 1
    if sorted(entries) != [i for i in range(n_layers) if i not in apart]:
        raise RuntimeError(f"kvcert.vllm: request {rid} was compacted in layers {sorted(entries)}, not in "
                           f"every layer 0..{n_layers - 1}" + (f" but {sorted(apart)}" if apart else ""))
    layers = {i: e[0] for i, e in entries.items()}
    empty = (None, None, None, None)
    entries = {i: entries.get(i, empty) for i in range(n_layers)}
    sampled = [i for i in range(n_layers) if i not in apart and entries[i][3] is None]
    sketches = [entries[i][1] for i in range(n_layers)]
    if any(sketches[i] is None for i in sampled) or not sampled:
        if any(sk is not None for sk in sketches):
            raise RuntimeError(f"kvcert.vllm: request {rid} has a sketch in some layers only")
        sketches = None
    sums = [entries[i][2] for i in sampled]
    if sketches is None or any(x is None for x in sums):
        sums = None
    else:  # a sliding-window layer's entry: zeros (its decode reads no value centre)
        sums = torch.stack([entries[i][2] if i in sampled else sums[0].new_zeros(sums[0].shape)
                            for i in range(n_layers)])
    first = layers[min(layers)]
    bs = first.block_size
    m = max(layout.m for layout in layers.values())
    log_pi = torch.full((n_layers, first.counts.shape[0], m * bs), _NEG_INF)
    for idx, layout in layers.items():
        log_pi[idx, :, : layout.log_pi.shape[-1]] = layout.log_pi.float()
    return Compacted(first.n_tokens, m, log_pi, sketches, sums), layers


def _compaction_report(state: Compacted, layers: dict, kept: bool, apart: dict | None = None) -> dict:
    """What the scheduler learns of a compacted request (``StepReport.compacted``), with the kept positions per
    layer and KV head when ``kept``. A layer ``apart`` ({index: window}: a sliding-window layer in a KV-cache group
    of its own) is reported as keeping what vLLM's window holds for a query after the prompt: the prompt's last
    ``min(n, window)`` tokens."""
    apart = apart or {}
    n, h = state.n_prompt, state.log_pi.shape[1]
    n_layers = len(layers) + len(apart)

    def window(i):  # positions max(0, n - window) .. n - 1 on every KV head
        return torch.arange(max(0, n - apart[i]), n).expand(h, -1)

    counts = [[min(n, apart[i])] * h if i in apart else layers[i].counts.tolist() for i in range(n_layers)]
    report = {"m": state.m, "n_prompt": state.n_prompt, "counts": counts, "sketch_bytes": state.sketch_bytes}
    if kept:
        report["kept_positions"] = [window(i).tolist() if i in apart else [p[p >= 0].tolist() for p in layers[i].positions]
                                    for i in range(n_layers)]
    return report


class Step:
    """One step of the plugin's worker: the plan of its rows, read by every attention layer; the certificates,
    importance and compactions the layers leave; and the results the worker reports to the scheduler."""

    def __init__(self, worker: CertifiedCPUWorker):
        self.worker = worker
        self.config = worker.kvcert
        # tensor parallelism: this rank holds KV heads tp_rank * h .. (tp_rank + 1) * h - 1 of every layer
        self.tp_rank, self.tp_size = getattr(worker, "kvcert_tp", (0, 1))  # (0, 1): a test's stand-in worker
        #: the sliding-window layers in KV-cache groups of their own (vLLM's hybrid manager), {layer index: window};
        #: the backend leaves them to the stock kernel and vLLM's window
        self.apart: dict = getattr(worker, "kvcert_apart", {})
        self._plan: _Plan | None = None
        #: the CUDA backend's plan of the step (:func:`kvcert.vllm.gpu_backend.plan_rows`), made at its first layer
        self.paged_plan = None
        self.certificates = _Certificates()
        self.importance: dict[str, list] = {}
        self.compactions: dict[str, dict] = {}
        #: the last queries of the step's prompt chunks before their last (:meth:`keep_queries`)
        self.kept_queries: dict[str, PromptQueries] = {}

    # ------------------------------------------------------------------ the plan of the rows

    def plan(self, md, block_size: int) -> _Plan:
        """The step's rows by kind, made at the step's first layer from its attention metadata ``md`` and read by
        every layer: decode rows of compacted requests (token design), decode rows with a block decision (block
        design), and the stock rows, among them those that finish a prompt (scored, or sampled and compacted)
        and those that process an earlier chunk of a prompt still to be decided (their last queries kept)."""
        if self._plan is not None:
            return self._plan
        plan = _Plan(block_size=block_size)
        qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
        req_ids = self.worker.model_runner.input_batch.req_ids
        for r, seq_len in enumerate(seq_lens):
            q_len = qsl[r + 1] - qsl[r]
            if q_len <= 0:
                continue
            rid = req_ids[r] if r < len(req_ids) else None
            state = self.worker.kvcert_states.get(rid) if rid is not None else None
            if state is not None and q_len != 1:
                raise RuntimeError(f"kvcert.vllm: request {rid} has evicted blocks and {q_len} query tokens "
                                   f"in one step; only single-token decode steps are supported")
            if isinstance(state, Compacted):
                cfg = self.config_of(rid)
                plan.compacted.append(self._compacted_row(rid, qsl[r], md.block_table[r], seq_len, state, block_size,
                                                          (cfg.kind, cfg.delta, state.sketches is not None)))
            elif state is not None:
                plan.masked.append(self._masked_row(rid, qsl[r], md.block_table[r], seq_len, state, block_size))
            else:
                plan.stock_rows.append(r)
                if self._wants_importance(rid, seq_len, block_size):
                    plan.importance.append(self._importance_row(rid, q_len, qsl[r + 1], seq_len, md.block_table[r],
                                                                block_size))
                elif self._keeps_queries(rid, seq_len, block_size):
                    n = self.worker.kvcert_prompt_len[rid]
                    plan.chunks.append(_Chunk(rid, q_len, qsl[r + 1], seq_len, self.event_window(rid, n),
                                              self._held_queries(rid)))
        plan.stack()
        self._plan = plan
        return plan

    @staticmethod
    def _compacted_row(rid, token: int, table: torch.Tensor, seq_len: int, state: Compacted, block_size: int,
                       certificate: tuple | None = None) -> _CompactedRow:
        """A decode row of a compacted request (token design): the blocks it reads, its m compacted blocks
        (``state.block_ids``, or the table's first m), then those of positions n_prompt .. seq_len - 1 (the last prompt block, partly filled, and the
        decode blocks), and the request's ``certificate`` (kind, delta, sketched)."""
        first, last = state.n_prompt // block_size, -(-seq_len // block_size)
        head = table[: state.m] if state.block_ids is None else state.block_ids.to(table.dtype)
        ids = torch.cat([head, table[first:last]]).to(torch.int64)
        pos = torch.arange(first * block_size, last * block_size)
        tail = torch.where((pos >= state.n_prompt) & (pos < seq_len), 0.0, _NEG_INF)
        return _CompactedRow(rid, token, ids, tail, state, certificate, seq_len)

    @staticmethod
    def _masked_row(rid, token: int, table: torch.Tensor, seq_len: int, log_pi: torch.Tensor,
                    block_size: int) -> _Masked:
        """A decode row of a request with a block decision (block design; ``log_pi`` (nb_prompt,) float64,
        -inf = evicted): its kept blocks (the prompt's sampled and certain ones, then the decode blocks, pi = 1),
        pi and the position of every slot (0 and -1 past seq_len), and log pi per slot."""
        nbt = -(-seq_len // block_size)
        nbp = log_pi.shape[0]
        full = torch.zeros(nbt, dtype=torch.float64)
        full[: min(nbp, nbt)] = log_pi[: min(nbp, nbt)]
        kept = torch.nonzero(full > _NEG_INF).flatten()
        ids = table[kept].to(torch.int64)
        pos = (kept[:, None] * block_size + torch.arange(block_size)[None]).flatten()
        pi = torch.exp(full[kept]).repeat_interleave(block_size)
        inside = pos < seq_len
        pi = torch.where(inside, pi, 0.0).to(torch.float32)
        pos = torch.where(inside, pos, -1)
        slot_log_pi = torch.where(inside, torch.log(pi.double()), _NEG_INF).float().reshape(-1, block_size)
        return _Masked(rid, token, ids, pi[None, None], pos[None, None], slot_log_pi)

    def _importance_row(self, rid, q_len: int, q_end: int, seq_len: int, table: torch.Tensor,
                        block_size: int) -> _Importance:
        """A stock row that finishes a prompt to be scored (block design) or sampled and compacted (token
        design): its query tokens, its blocks and its request's settings."""
        nbt = -(-seq_len // block_size)
        ids = table[:nbt].to(torch.int64)
        private = getattr(self.worker, "kvcert_private", {}).get(rid, [])
        hit = getattr(self.worker, "kvcert_hits", {}).get(rid, 0)
        if hit > len(private):  # the scheduler reserves one block per cached block it lets a request read
            raise RuntimeError(f"kvcert.vllm: request {rid} read {hit} cached prefix blocks and holds "
                               f"{len(private)} of its own for its compaction; its compaction would write shared "
                               "blocks")
        targets = compaction_targets(ids, seq_len // block_size, private)
        return _Importance(rid, q_len, q_end, seq_len, ids, self.config_of(rid), self._held_queries(rid), targets)

    def _held_queries(self, rid) -> PromptQueries | None:
        """The queries the worker holds from request ``rid``'s earlier prompt chunks, or None."""
        return getattr(self.worker, "kvcert_queries", {}).get(rid)

    def event_window(self, rid, n: int) -> int:
        """The most queries request ``rid``'s eviction event over its n-token prompt reads (the last ones): the
        token design's :meth:`kvcert.fast.TokenDesign.event_queries` (the scorer's, and at least the observation
        window for a tilted sketch or an error target), the block design's
        :meth:`kvcert.fast.BlockDesign.queries_read`, given all n of the prompt's queries (the unchunked
        engine's event)."""
        cfg = self.config_of(rid)
        return cfg.design.event_queries(n, n) if cfg.tokens else cfg.design.queries_read(n, n)

    def keep_queries(self, rid: str, layer: int, queries: torch.Tensor, end: int) -> None:
        """Keep one layer's last queries (w, h_q, d) of request ``rid``'s prompt, those of positions
        ``end - w .. end - 1``, for its eviction event on a later chunk; a copy, installed on the worker after
        the step (:meth:`results`)."""
        self.kept_queries.setdefault(rid, PromptQueries(end)).layers[layer] = queries.detach().clone()

    def _keeps_queries(self, rid, seq_len: int, block_size: int) -> bool:
        """True on a step that processes a chunk of a prompt before its last (chunked prefill), when the
        prompt's eviction event is still to come: its last queries are kept for that event."""
        w = self.worker
        n = w.kvcert_prompt_len.get(rid) if rid is not None else None
        return (n is not None and seq_len < n and rid not in w.kvcert_states and rid not in w.kvcert_decided
                and self.config_of(rid).evicts(n, block_size, head_size=getattr(w, "kvcert_head_size", None)))

    def config_of(self, rid) -> KVCertConfig:
        """The settings of request ``rid``: its per-request options over the engine's, or the engine's."""
        return getattr(self.worker, "kvcert_request", {}).get(rid, self.config)

    def _wants_importance(self, rid, seq_len: int, block_size: int) -> bool:
        """True on the step that processes the last chunk of a prompt that has not been decided and is long
        enough for the request's settings to evict anything (else its importance is not even computed)."""
        w = self.worker
        return (rid is not None and w.kvcert_prompt_len.get(rid) == seq_len and rid not in w.kvcert_states
                and rid not in w.kvcert_decided
                and self.config_of(rid).evicts(seq_len, block_size, head_size=getattr(w, "kvcert_head_size", None)))

    def row_states(self, md) -> list:
        """The CUDA backend's view of the step (:mod:`kvcert.vllm.gpu_backend`): one ``RowState`` per row."""
        w = self.worker
        if self.config.tokens:
            raise NotImplementedError("kvcert.vllm: the CUDA backend serves granularity='block' only; the token "
                                      "design's paged kernel is kvcert.kernels.paged (not wired to the CUDA backend)")
        req_ids = w.model_runner.input_batch.req_ids
        out = []
        for r, seq_len in enumerate(md.seq_lens.tolist()):
            rid = req_ids[r] if r < len(req_ids) else None
            log_pi = w.kvcert_states.get(rid) if rid is not None else None
            out.append(_gpu_backend.RowState(rid, log_pi, log_pi is None and self._wants_importance(
                rid, seq_len, w.kvcert_block_size)))
        return out

    def group_sketch(self, layer: int, group: tuple, rows: list):
        """The sketch (:class:`kvcert.fast.ClusterSketch`, batch len(rows)) of one layer for the compacted rows
        ``rows`` (``_CompactedRow``) of one certificate group ``group`` of the step: a lone row's own sketch, or
        the rows' sketches joined (:meth:`ClusterSketch.cat`).

        A join is kept on the worker, one per (layer, group), and read again while the same requests (the same
        :class:`Compacted` states) form the group: in steady decode the group is the same from step to step, so
        the join and its decode form (cached on the joined sketch) are built once, not at every step and layer.
        It holds the group's sketches a second time (their ``sketch_bytes`` once more) and is dropped when one
        of its requests finishes or loses its state (:meth:`_CertifiedWorker._kvcert_before`)."""
        states = tuple(row.state for row in rows)
        if len(states) == 1:
            return states[0].sketches[layer]
        cache = self.worker.kvcert_joined
        hit = cache.get((layer, group))
        if hit is not None and len(hit[0]) == len(states) and all(a is b for a, b in zip(hit[0], states)):
            return hit[1]
        joined = ClusterSketch.cat([s.sketches[layer] for s in states])
        cache[(layer, group)] = (states, joined)
        return joined

    # ------------------------------------------------------------------ the certificates

    def add_certificates(self, req_ids: list, rel: torch.Tensor) -> None:
        """Add each row's mean relative radius over query heads to its request: ``rel`` (len(req_ids), h_q).

        Kept as given and summed in :meth:`results`, once per step: the layers of a step certify the same rows,
        so their means are taken in one conversion instead of one per layer."""
        self.certificates.add(req_ids, rel)

    def add_statistics(self, req_ids: list, kind: str, delta: float, stats: dict) -> None:
        """:meth:`add_certificates` from the statistics of the rows' certificate of ``kind``: ``stats``, the
        trace, the output's norm and what else the kind reads, (len(req_ids), h_q) each
        (:func:`kvcert.fast.certificate_moments`' keywords), or in place of the norm the output itself,
        ``"output"`` (len(req_ids), h_q, dv), whose norms are then taken for every layer of the step in one
        call (:func:`kvcert.vllm.backend.with_output_norm`). The relative radii,
        :func:`kvcert.fast.radius_from_statistics`' of them, are computed in :meth:`results` for every layer of
        the step in one call per row group: an elementwise map, so they are those of one call per layer, and
        the step saves that call's fixed cost (about 40 us) at each layer."""
        self.certificates.add_statistics(req_ids, kind, delta, stats)

    # ------------------------------------------------------------------ the importance and the compactions

    def add_importance(self, req_id: str, u: torch.Tensor) -> None:
        """One layer's token scores (h_kv, n) of a request that finished its prompt (block design)."""
        self.importance.setdefault(req_id, []).append(u.detach().to(torch.float64))

    def add_compaction(self, req_id: str, layer: int, layout, sketch=None, value_sums=None,
                       window: int | None = None) -> None:
        """One layer's compacted layout (:class:`kvcert.fast.Compaction`, leading dim h_kv) of a request, and with
        a sketched design the sketch of its evicted tokens (:class:`kvcert.fast.ClusterSketch`, batch 1) and the
        kept values' sums and count (h_kv, dv + 1) float64 (:func:`kvcert.vllm.backend.compact_prompt`'s);
        ``window``: a sliding-window layer's window (its layout :func:`kvcert.vllm.backend.window_slots`)."""
        self.compactions.setdefault(req_id, {})[layer] = (layout, sketch, value_sums, window)

    def _install_compactions(self) -> dict:
        """Install each compacted request's :class:`Compacted` state in the worker; their reports for the
        scheduler."""
        out = {}
        rows = {row.req_id: row for row in self._plan.importance} if self._plan is not None else {}
        private = getattr(self.worker, "kvcert_private", {})
        for rid, entries in self.compactions.items():
            state, layers = _compacted_state(rid, entries, set(self.apart))
            row = rows.get(rid)
            if row is not None:  # the blocks its compaction wrote (handoff.compaction_targets)
                state.block_ids = row.write_ids[: state.m].clone()
            private.pop(rid, None)
            self.worker.kvcert_states[rid] = state
            out[rid] = _compaction_report(state, layers, self.config.report_kept, self.apart)
        return out

    def _install_queries(self) -> None:
        """Hold the queries kept in the step (:meth:`keep_queries`) on the worker, in place of the request's
        earlier ones; drop those of the requests whose eviction event the step ran."""
        held = getattr(self.worker, "kvcert_queries", None)
        if held is None:  # a stand-in worker without chunked prefill
            return
        for row in self._plan.importance if self._plan is not None else ():
            held.pop(row.req_id, None)
        held.update(self.kept_queries)

    # ------------------------------------------------------------------ the results

    def results(self, block_size: int) -> StepReport:
        """What the step leaves for the scheduler: the certificates ({request: mean relative radius over layers
        and query heads}), the block importance and the compaction reports; under tensor parallelism, those of
        every head of the layer (:func:`_tp_combine`)."""
        certs = self.certificates.means()
        scores = {r: torch.stack(us) for r, us in self.importance.items()}  # (layers, h_kv, n)
        compacted = self._install_compactions()
        self._install_queries()
        if self.tp_size > 1:
            certs, scores, compacted = _tp_combine(self.worker.kvcert_tp_group(), certs, scores, compacted)
        imp = {r: self.config.design.block_importance(u[None], block_size=block_size)[0].tolist()
               for r, u in scores.items()}
        return StepReport(certs=certs, importance=imp, compacted=compacted)


def _tp_combine(group, certs: dict, scores: dict, compacted: dict) -> tuple[dict, dict, dict]:
    """The step's results of every tensor-parallel rank combined into those of the whole layer (each rank
    holds h_kv / tp KV heads and their h_q / tp query heads, in rank order; vLLM shards heads that way).

    - certificate: the mean of the ranks' means (each a mean over the same layers and h_q / tp query heads),
      which is the mean over all query heads;
    - block-design scores: the ranks' (layers, h_kv / tp, n) joined along the KV heads, as one process
      scoring every head would hold them, before :meth:`kvcert.fast.BlockDesign.block_importance`;
    - compaction: m, the blocks the request keeps, is the largest of the ranks' (a rank whose heads kept
      fewer tokens leaves its last blocks unread); the counts and kept positions joined along the KV heads;
      the sketch bytes summed.

    Every rank runs the same steps with the same requests (the scheduler's output is broadcast), so every
    rank calls this once per step: one ``all_gather_object`` over the group's CPU (gloo) process group."""
    import torch.distributed as dist

    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (certs, scores, compacted), group=group)
    if any(set(p[0]) != set(certs) or set(p[1]) != set(scores) or set(p[2]) != set(compacted) for p in parts):
        raise RuntimeError("kvcert.vllm: the tensor-parallel ranks certified, scored or compacted different "
                           "requests in one step")
    certs = {r: sum(p[0][r] for p in parts) / len(parts) for r in certs}
    scores = {r: torch.cat([p[1][r] for p in parts], dim=1) for r in scores}
    out = {}
    for r, rep in compacted.items():
        reps = [p[2][r] for p in parts]

        def heads(key):  # per layer, the ranks' per-head lists one after the other
            return [sum((x[key][layer] for x in reps), []) for layer in range(len(rep[key]))]

        out[r] = dict(rep, m=max(x["m"] for x in reps), sketch_bytes=sum(x["sketch_bytes"] for x in reps),
                      counts=heads("counts"), **({"kept_positions": heads("kept_positions")}
                                                 if "kept_positions" in rep else {}))
    return certs, scores, out


class _CertifiedWorker:
    """The kvcert step context around a vLLM worker (module docstring), shared by the CPU and CUDA workers.

    A subclass names ``_kvcert_builder_cls``, its attention backend's metadata builder, which puts the step on the
    metadata it builds, and ``_kvcert_check_layers`` (run after the model is loaded: refuse layers it cannot
    serve).
    """

    def __init__(self, vllm_config, *args, **kwargs):
        check_vllm_config(vllm_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.kvcert = KVCertConfig.from_vllm_config(vllm_config) or KVCertConfig(compression_ratio=0.0)
        self.kvcert_states: dict[str, torch.Tensor | Compacted] = {}
        self.kvcert_decided: set[str] = set()  # token design: requests already compacted (never twice)
        self.kvcert_prompt_len: dict[str, int] = {}
        self.kvcert_request: dict[str, KVCertConfig] = {}  # requests with per-request options: their settings
        # requests that read cached prefix blocks: the ids of their own blocks standing in for them
        # (StepOrders.private), until their event
        self.kvcert_private: dict[str, list[int]] = {}
        self.kvcert_hits: dict[str, int] = {}  # cached prefix blocks a request read when first scheduled
        # chunked prefill: the last queries of a prompt's chunks before its last, for its eviction event
        self.kvcert_queries: dict[str, PromptQueries] = {}
        self.kvcert_last_stats: dict = {}
        self.kvcert_block_size = int(vllm_config.cache_config.block_size)
        # the head size d = dv, which sizes a sketch's memory in kept tokens (KVCertConfig.evicts)
        self.kvcert_head_size = int(vllm_config.model_config.get_head_size())
        self._kvcert_pending: StepReport | None = None
        # (layer, certificate group) -> (the group's Compacted states, their joined sketch): Step.group_sketch
        self.kvcert_joined: dict[tuple, tuple] = {}

    @cached_property
    def kvcert_tp(self) -> tuple[int, int]:
        """(rank, size) of this worker in its tensor-parallel group ((0, 1) without tensor parallelism); read
        at the first step, after vLLM has set up the group."""
        size = int(self.vllm_config.parallel_config.tensor_parallel_size)
        if size == 1:
            return (0, 1)
        from vllm.distributed import get_tensor_model_parallel_rank

        return (int(get_tensor_model_parallel_rank()), size)

    def kvcert_tp_group(self):
        """The tensor-parallel group's CPU (gloo) process group, over which :func:`_tp_combine` gathers."""
        from vllm.distributed import get_tp_group

        return get_tp_group().cpu_group

    def _kvcert_layers(self, impl_cls) -> dict:
        """The model's attention layers, refusing any whose implementation is not ``impl_cls``."""
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        model = self.vllm_config.model_config.model
        for name, layer in layers.items():
            if not isinstance(layer.impl, impl_cls):
                raise ValueError(f"kvcert.vllm cannot serve model {model!r}: layer {name} uses "
                                 f"{type(layer.impl).__name__}, not the plugin's attention (plugin not registered?)")
        return layers

    def _kvcert_check_layers(self) -> None:
        raise NotImplementedError

    def initialize_from_config(self, kv_cache_config, *args, **kwargs):
        """vLLM's, after noting the attention layers whose KV-cache group is not a full-attention one: under
        vLLM's hybrid manager a model's sliding-window layers (Gemma 2 and 3) have groups (block tables) of their
        own, with vLLM's window manager freeing their blocks; the backend leaves those layers to the stock kernel
        (:attr:`Step.apart`), and compacts the full-attention group only."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        self.kvcert_apart = {_backend.layer_index_of(name): int(g.kv_cache_spec.sliding_window)
                             for g in kv_cache_config.kv_cache_groups if type(g.kv_cache_spec) is not FullAttentionSpec
                             for name in g.layer_names}
        return super().initialize_from_config(kv_cache_config, *args, **kwargs)

    def _kvcert_builder_cls(self) -> type:
        raise NotImplementedError

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        self._kvcert_check_layers()
        return out

    # ------------------------------------------------------------------ the step

    def _kvcert_before(self, scheduler_output) -> None:
        """The scheduler's orders for the step (:class:`kvcert.vllm.handoff.StepOrders`) and its finished
        requests, applied to the worker's states before the step runs."""
        orders = orders_of(scheduler_output)
        held = getattr(self, "kvcert_queries", {})  # a test's stand-in worker may hold none
        hits = getattr(self, "kvcert_hits", {})
        for req in scheduler_output.scheduled_new_reqs:
            hits[req.req_id] = int(req.num_computed_tokens) // self.kvcert_block_size
            if req.prompt_token_ids is not None:
                self.kvcert_prompt_len[req.req_id] = len(req.prompt_token_ids)
            else:
                self.kvcert_prompt_len[req.req_id] = req.prompt_len
        if orders.clear or scheduler_output.finished_req_ids:
            self.kvcert_joined.clear()  # a compacted state leaves: no join may outlive its requests
        private = getattr(self, "kvcert_private", {})
        for rid in orders.clear:
            self.kvcert_states.pop(rid, None)
            held.pop(rid, None)
            private.pop(rid, None)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():  # recomputed from its start
            held.pop(rid, None)
            private.pop(rid, None)
            hits.pop(rid, None)
        private.update(orders.private)
        for rid, overrides in orders.options.items():
            self.kvcert_request[rid] = replace(self.kvcert, **overrides)
        for rid, log_pi in orders.decisions.items():
            self.kvcert_states[rid] = torch.tensor(log_pi, dtype=torch.float64)
        self.kvcert_last_stats = orders.stats
        for rid in scheduler_output.finished_req_ids:
            self.kvcert_states.pop(rid, None)
            self.kvcert_prompt_len.pop(rid, None)
            self.kvcert_decided.discard(rid)
            self.kvcert_request.pop(rid, None)
            held.pop(rid, None)
            private.pop(rid, None)
            hits.pop(rid, None)

    def _kvcert_builders(self) -> list:
        """The model runner's attention metadata builders of the plugin's backend (one per attention group)."""
        cls = self._kvcert_builder_cls()
        builders = [b for groups in self.model_runner.attn_groups for group in groups
                    for b in group.metadata_builders if isinstance(b, cls)]
        if not builders:
            raise RuntimeError(f"kvcert.vllm: the model runner has no {cls.__name__} (the plugin's attention "
                               "backend is not the one vLLM selected; plugin not registered?)")
        return builders

    @contextmanager
    def _kvcert_step_on_metadata(self, step: Step):
        """Hand ``step`` to the plugin's metadata builders for the step's forward: the attention metadata they
        build carries it (``kvcert_step``) to every attention layer; none is handed outside the step."""
        builders = self._kvcert_builders()
        for b in builders:
            b.kvcert_step = step
        try:
            yield
        finally:
            for b in builders:
                b.kvcert_step = None

    def execute_model(self, scheduler_output, *args, **kwargs):
        self._kvcert_before(scheduler_output)
        step = Step(self)
        with self._kvcert_step_on_metadata(step):
            out = super().execute_model(scheduler_output, *args, **kwargs)
        self._kvcert_pending = step.results(self.kvcert_block_size)
        self.kvcert_decided.update(self._kvcert_pending.compacted)
        return None if out is None else self._kvcert_attach(out)

    def _kvcert_attach(self, out):
        """The step's output with its report (:func:`kvcert.vllm.handoff.with_report`); an empty report when the
        step left none (an output without a forward)."""
        report, self._kvcert_pending = self._kvcert_pending or StepReport(), None
        return with_report(out, report)

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        return None if out is None else self._kvcert_attach(out)

    # ------------------------------------------------------------------ RPC (LLM.collective_rpc)

    def kvcert_stats(self) -> dict:
        """The scheduler's counters as of the last step (blocks_freed, blocks_evicted, ...)."""
        return dict(self.kvcert_last_stats)


class CertifiedCPUWorker(_CertifiedWorker, CPUWorker):
    """vLLM's CPU worker with the kvcert step context (module docstring)."""

    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        from kvcert.kernels import cpu

        if cpu.enabled():  # build (or load) the compiled op at start-up, announced, not inside a request's step
            cpu.available(warn=True)

    def _kvcert_builder_cls(self) -> type:
        return _backend.CertifiedCPUAttentionMetadataBuilder

    def _kvcert_check_layers(self) -> None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = self.vllm_config.model_config.model
        layers = self._kvcert_layers(_backend.CertifiedCPUAttentionImpl)
        # sliding-window layers keep their window (backend.window_slots) and softcaps enter the token design's
        # decode; a model whose every layer is windowed has nothing to compress (check_vllm_config refuses it by
        # its config; here by its layers, whatever the config says)
        if layers and all(_backend.impl_window(layer.impl) is not None for layer in layers.values()):
            raise ValueError(f"kvcert.vllm cannot serve model {model!r}: every attention layer uses a sliding window, "
                             "so there is nothing to compress")
        for name, layer in layers.items():
            impl = layer.impl
            bad = [what for what, on in (("alibi", impl.alibi_slopes is not None),
                                          ("attention sinks", impl.sinks is not None)) if on]
            if bad:
                raise ValueError(f"kvcert.vllm cannot serve model {model!r}: layer {name} uses {', '.join(bad)}")
            isa = _backend.plugin_isa(_get_attn_isa(self.vllm_config.model_config.dtype, self.kvcert_block_size,
                                                    impl.head_size, self.vllm_config.cache_config.cache_dtype))
            if isa != "vec":
                raise ValueError(f"kvcert.vllm cannot serve dtype={self.vllm_config.model_config.dtype} with "
                                 f"block_size={self.kvcert_block_size} and head size {impl.head_size} here: the "
                                 f"CPU cache layout would be {isa!r}, the plugin reads 'vec' (a block size and "
                                 f"head size that are multiples of 32 on x86)")


class CertifiedGPUWorker(_CertifiedWorker, GPUWorker):
    """vLLM's CUDA worker with the kvcert step context, for :mod:`kvcert.vllm.gpu_backend` (the ``CUSTOM`` backend).

    Prepared, never run on a device: :func:`kvcert.vllm.config.check_vllm_config`
    refuses non-CPU platforms, so it cannot start until a device run lifts that
    refusal. Its step context is the CPU worker's (:meth:`Step.row_states`
    feeds the CUDA backend), tested on CPU in tests/vllm/test_vllm_gpu_backend.py.
    """

    def _kvcert_builder_cls(self) -> type:
        return _gpu_backend.CertifiedFlashAttentionMetadataBuilder

    def _kvcert_check_layers(self) -> None:
        self._kvcert_layers(_gpu_backend.CertifiedFlashAttentionImpl)
