"""The plugin's CUDA attention backend (prepared, not yet run on a device): FlashAttention + the paged kernel.

Meant for vLLM 0.32's ``AttentionBackendEnum.CUSTOM`` route on CUDA
(``register_backend(AttentionBackendEnum.CUSTOM, "kvcert.vllm.gpu_backend.CertifiedFlashAttentionBackend")``,
then ``attention_config={"backend": "CUSTOM"}``; see :func:`register_cuda`).
It mirrors :mod:`kvcert.vllm.backend` (the CPU route):

- outside a step context (the metadata's ``kvcert_step`` None), for encoder layers, and for
  every row without an eviction decision, the stock ``FlashAttentionImpl.forward``
  runs (on the sub-batch of those rows when some rows are masked), so an
  engine without eviction is the stock engine;
- a decode row (one query token) of a request with an eviction decision goes
  to the router, :func:`kvcert.dispatch.paged_decode` (the block design on CUDA:
  :data:`kvcert.dispatch.PAGED_TRITON`, :func:`kvcert.kernels.paged_block_hajek_attention`), which reads the paged cache
  through the row's block table, skips evicted blocks (log pi_b = -inf, never
  read: a freed block may already hold another request's keys), adds the
  offset -log pi_b and returns the cluster-sampling trace in the same pass;
  the relative Chebyshev radius follows from
  :func:`kvcert.fast.radius_from_statistics`;
- on a prompt's last chunk, rows flagged for importance get the configured
  scorer's token scores (``kvcert.fast.BlockDesign.score``) on the prompt's
  keys and values gathered from the paged cache and its last queries (as on CPU).

Cache layout: vLLM 0.32 allocates the FlashAttention cache as
(num_blocks, h_kv, block_size, 2 * head_size) and reads it as
``kv_cache.transpose(1, 2).split(head_size, -1)``, two (num_blocks, block_size,
h_kv, head_size) strided views (:func:`kvcert.kernels.kv_cache_views`); the
kernel takes those views as they are.

Import hygiene: importing this module imports only torch and the standard
library. vLLM's FlashAttention classes, Triton and the kernels are imported
on first use: the backend and impl classes are built on first attribute
access (module ``__getattr__``, which is how vLLM's registry resolves a
class path), so the module imports on a CPU-only machine.

The step context arrives on vLLM's per-step attention metadata, as on CPU:
:class:`kvcert.vllm.worker.CertifiedGPUWorker` hands it to
``CertifiedFlashAttentionMetadataBuilder`` for the step's forward, whose
metadata (``CertifiedFlashAttentionMetadata``, vLLM's ``FlashAttentionMetadata``
with one field ``kvcert_step``) carries it to every layer. It is a protocol
(:class:`kvcert.vllm.worker.Step` implements it):
``ctx.row_states(attn_metadata)`` -> a list with one :class:`RowState` per
batch row, ``ctx.config`` (a :class:`kvcert.vllm.config.KVCertConfig`),
``ctx.add_certificates(req_ids, rel)`` and ``ctx.add_importance(req_id, u)``;
the plan is kept in ``ctx.paged_plan`` (None until the step's first layer; one
context per step, as on CPU).
The metadata builder declares no full-CUDA-graph support
(``AttentionCGSupport.NEVER``): a captured graph would freeze the Python row split.
Only the ``chebyshev`` certificate is served (the kernel returns the trace).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

# (plus CertifiedFlashAttentionBackend, CertifiedFlashAttentionImpl, CertifiedFlashAttentionMetadata and
# CertifiedFlashAttentionMetadataBuilder, built lazily by __getattr__)
__all__ = ["RowState", "PagedPlan", "plan_rows", "log_pi_table", "stock_sub_metadata", "register_cuda"]

_CLASS_NAMES = ("CertifiedFlashAttentionBackend", "CertifiedFlashAttentionImpl", "CertifiedFlashAttentionMetadata",
                "CertifiedFlashAttentionMetadataBuilder")

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class RowState:
    """What the step context knows about one batch row: its request, its decision, whether to score it.

    ``log_pi``: (n_prompt_blocks,) log pi_b of the request's prompt blocks
    (-inf = evicted, 0 = certain), or None (no eviction decision: stock path).
    ``importance``: gather the configured scorer's token scores of this row (its prompt's last chunk).
    """

    req_id: str | None = None
    log_pi: torch.Tensor | None = None
    importance: bool = False


@dataclass
class PagedPlan:
    """The rows of one step split between the paged kernel and the stock backend.

    ``masked_rows``/``masked_tokens``: batch rows with a decision and the index
    of their one query token; ``block_table`` (E, M), ``seq_lens`` (E,) and
    ``log_pi_blocks`` (E, M) float32 are the kernel's inputs for them;
    ``stock_rows`` the others (in batch order) and ``stock_tokens`` their query
    tokens; ``importance_rows`` the stock rows to score.
    """

    masked_rows: list = field(default_factory=list)
    masked_req_ids: list = field(default_factory=list)
    masked_tokens: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    log_pi_blocks: torch.Tensor | None = None
    max_seq_len: int = 0
    stock_rows: list = field(default_factory=list)
    stock_tokens: torch.Tensor | None = None
    stock_q_lens: list = field(default_factory=list)
    stock_max_seq_len: int = 0
    importance_rows: list = field(default_factory=list)

    @property
    def masked(self) -> bool:
        return bool(self.masked_rows)


def log_pi_table(log_pi: torch.Tensor, seq_len: int, block_size: int, width: int) -> torch.Tensor:
    """(width,) float32 log pi per logical block of a request: its prompt blocks' decision, 0 (certain) for
    the blocks decoding appended after the prompt, -inf past ``ceil(seq_len / block_size)``."""
    nbt = -(-int(seq_len) // block_size)
    if nbt > width:
        raise ValueError(f"seq_len {seq_len} needs {nbt} blocks of {block_size}, the block table has {width}")
    out = torch.full((width,), _NEG_INF, dtype=torch.float32)
    out[:nbt] = 0.0
    k = min(int(log_pi.shape[0]), nbt)
    out[:k] = log_pi[:k].to(torch.float32)
    return out


def plan_rows(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, states: list,
              block_size: int) -> PagedPlan:
    """Split a step's rows (the GPU twin of :meth:`kvcert.vllm.worker.Step.plan`).

    Parameters
    ----------
    query_start_loc : (R + 1,) int, seq_lens : (R,) int, block_table : (R, M) int32
        The attention metadata's (any device; read on the host once per step).
    states : list of :class:`RowState` (or None), one per row
    block_size : int

    Returns
    -------
    PagedPlan. A row with a decision and more than one query token is refused
    (the masked path serves single-token decode steps only, as on CPU).
    """
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if len(states) < len(lens):
        states = list(states) + [None] * (len(lens) - len(states))
    plan = PagedPlan()
    width = block_table.shape[1]
    lp_rows, stock_tok = [], []
    for r, seq_len in enumerate(lens):
        q_len = qsl[r + 1] - qsl[r]
        if q_len <= 0:
            continue
        st = states[r]
        if st is not None and st.log_pi is not None:
            if q_len != 1:
                raise RuntimeError(f"kvcert.vllm: request {st.req_id} has evicted blocks and {q_len} query tokens "
                                   f"in one step; only single-token decode steps are supported")
            plan.masked_rows.append(r)
            plan.masked_req_ids.append(st.req_id)
            lp_rows.append(log_pi_table(st.log_pi, seq_len, block_size, width))
        else:
            plan.stock_rows.append(r)
            plan.stock_q_lens.append(q_len)
            plan.stock_max_seq_len = max(plan.stock_max_seq_len, seq_len)
            stock_tok.extend(range(qsl[r], qsl[r + 1]))
            if st is not None and st.importance:
                plan.importance_rows.append((r, st.req_id))
    dev = block_table.device
    if plan.masked_rows:
        idx = torch.tensor(plan.masked_rows, dtype=torch.int64, device=dev)
        plan.masked_tokens = torch.tensor([qsl[r] for r in plan.masked_rows], dtype=torch.int64, device=dev)
        plan.block_table = block_table.index_select(0, idx)
        plan.seq_lens = seq_lens.to(dev).index_select(0, idx).to(torch.int32)
        plan.log_pi_blocks = torch.stack(lp_rows).to(dev)
        plan.max_seq_len = max(lens[r] for r in plan.masked_rows)  # host int: no device sync per layer
    plan.stock_tokens = torch.tensor(stock_tok, dtype=torch.int64, device=dev)
    return plan


def stock_sub_metadata(md, plan: PagedPlan):
    """The FlashAttention metadata of the stock rows only (their tokens packed in batch order).

    ``dataclasses.replace`` of vLLM's ``FlashAttentionMetadata``: query_start_loc,
    seq_lens, block_table and slot_mapping restricted to the stock rows, the
    max lengths recomputed, the ahead-of-time scheduler metadata dropped (the
    FlashAttention op then plans the sub-batch itself).
    """
    rows = plan.stock_rows
    dev = md.query_start_loc.device
    q_lens = plan.stock_q_lens  # host values from plan_rows: no device sync per layer
    sub_qsl = torch.zeros(len(rows) + 1, dtype=md.query_start_loc.dtype)
    if rows:
        sub_qsl[1:] = torch.cumsum(torch.tensor(q_lens, dtype=md.query_start_loc.dtype), 0)
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    seq = md.seq_lens.index_select(0, idx)
    tok = plan.stock_tokens
    changes = dict(num_actual_tokens=int(tok.numel()), max_query_len=max(q_lens, default=0),
                   query_start_loc=sub_qsl.to(dev), max_seq_len=plan.stock_max_seq_len, seq_lens=seq,
                   block_table=md.block_table.index_select(0, idx), slot_mapping=md.slot_mapping.index_select(0, tok),
                   scheduler_metadata=None)
    if hasattr(md, "max_num_splits"):
        changes["max_num_splits"] = 0
    return dataclasses.replace(md, **changes)


def _masked_rows(ctx, plan: PagedPlan, query: torch.Tensor, kv_cache: torch.Tensor, scale: float):
    """The masked rows through :func:`kvcert.dispatch.paged_decode` (the block design on CUDA: the paged Triton
    kernel, :data:`kvcert.dispatch.PAGED_TRITON`), their certificates handed to the step context; the output
    (E, h_q, d) in the query's dtype.

    ``kv_cache``: vLLM's FlashAttention cache (num_blocks, h_kv, block_size, 2 head_size). The kernel returns the
    trace only: the router refuses a kind that reads more (only ``chebyshev`` is served)."""
    from kvcert import dispatch
    from kvcert.fast import radius_from_statistics

    cfg = ctx.config
    dec = dispatch.paged_decode("block", query.index_select(0, plan.masked_tokens), kv_cache, plan.block_table,
                                plan.log_pi_blocks, scale=scale, kind=cfg.kind, delta=cfg.delta,
                                seq_lens=plan.seq_lens, max_seq_len=plan.max_seq_len, device="cuda")
    _, _, rel = radius_from_statistics(cfg.kind, cfg.delta, trace=dec.statistics["trace"],
                                       output_norm=torch.linalg.vector_norm(dec.output.float(), dim=-1))
    ctx.add_certificates(plan.masked_req_ids, rel)
    return dec.output


def _importance(ctx, plan, md, query, kv_cache, head_size, scale, layer=None):
    """The configured scorer's token scores (``BlockDesign.score``) of the rows that finish their prompt."""
    from kvcert.kernels import kv_cache_views

    from .backend import layer_index

    key_cache, value_cache = kv_cache_views(kv_cache, head_size)
    bs = key_cache.shape[1]
    qsl = md.query_start_loc.tolist()
    lens = md.seq_lens.tolist()
    design = ctx.config.design
    index = layer_index(layer)
    for r, rid in plan.importance_rows:
        seq_len = lens[r]
        ids = md.block_table[r, : -(-seq_len // bs)].to(torch.int64)
        k = key_cache.index_select(0, ids).reshape(-1, key_cache.shape[2], head_size)[:seq_len]  # (n, h_kv, d)
        v = value_cache.index_select(0, ids).reshape(-1, value_cache.shape[2], head_size)[:seq_len]
        w = design.queries_read(qsl[r + 1] - qsl[r], seq_len)
        q = query[qsl[r + 1] - w: qsl[r + 1]].permute(1, 0, 2)[None]  # (1, h_q, w, d)
        u = design.score(q, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], scale=scale, layer=index)
        ctx.add_importance(rid, u[0])


def _build_classes():
    """The CUDA backend's classes over vLLM's FlashAttention ones (metadata, builder, impl, backend)."""
    from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionImpl,
        FlashAttentionMetadata,
        FlashAttentionMetadataBuilder,
    )

    from .handoff import extend

    @dataclass
    class CertifiedFlashAttentionMetadata(FlashAttentionMetadata):
        """vLLM's FlashAttention metadata of one step, with the step's context (the plugin's worker's
        :class:`kvcert.vllm.worker.Step` while it runs the step, else None: the stock attention)."""

        kvcert_step: object = None

    class CertifiedFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
        """FlashAttention's builder, declaring no full-CUDA-graph support: the row split is Python that
        a captured graph would freeze, so vLLM runs attention eagerly (piecewise graphs around it). Its
        metadata carries ``kvcert_step``, the step context the plugin's worker hands it for the step's
        forward (None outside)."""

        _cudagraph_support = AttentionCGSupport.NEVER

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.kvcert_step = None

        def build(self, *args, **kwargs):
            return extend(CertifiedFlashAttentionMetadata, super().build(*args, **kwargs),
                          kvcert_step=self.kvcert_step)

    class CertifiedFlashAttentionImpl(FlashAttentionImpl):
        """``FlashAttentionImpl`` with the paged Hajek kernel for decode rows with evicted blocks."""

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            ctx = attn_metadata.kvcert_step if isinstance(attn_metadata, CertifiedFlashAttentionMetadata) else None
            if ctx is None or self.attn_type != AttentionType.DECODER:
                return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                       output_block_scale)
            plan = ctx.paged_plan
            if plan is None:
                md = attn_metadata
                plan = plan_rows(md.query_start_loc, md.seq_lens, md.block_table, ctx.row_states(md),
                                 kv_cache.shape[2])
                ctx.paged_plan = plan
            if not plan.masked:
                super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                output_block_scale)
            else:
                if self.kv_cache_dtype not in ("auto", None) or output_scale is not None:
                    raise RuntimeError("kvcert.vllm's paged kernel reads float caches without output quantization")
                if plan.stock_rows:
                    sub = stock_sub_metadata(attn_metadata, plan)
                    tok = plan.stock_tokens
                    out_sub = torch.empty((tok.numel(), *output.shape[1:]), dtype=output.dtype, device=output.device)
                    pick = lambda x: None if x is None else x.index_select(0, tok)  # noqa: E731
                    super().forward(layer, pick(query), pick(key), pick(value), kv_cache, sub, out_sub)
                    output.index_copy_(0, tok, out_sub)
                o = _masked_rows(ctx, plan, query, kv_cache, self.scale)
                output.index_copy_(0, plan.masked_tokens, o.reshape(o.shape[0], *output.shape[1:]).to(output.dtype))
            if plan.importance_rows:
                _importance(ctx, plan, attn_metadata, query, kv_cache, self.head_size, self.scale, layer)
            return output

    class CertifiedFlashAttentionBackend(FlashAttentionBackend):
        """vLLM's FlashAttention backend with :class:`CertifiedFlashAttentionImpl` and
        :class:`CertifiedFlashAttentionMetadataBuilder` (the same cache; the metadata with the step context)."""

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return CertifiedFlashAttentionImpl

        @staticmethod
        def get_builder_cls():
            return CertifiedFlashAttentionMetadataBuilder

    classes = {"CertifiedFlashAttentionImpl": CertifiedFlashAttentionImpl,
               "CertifiedFlashAttentionBackend": CertifiedFlashAttentionBackend,
               "CertifiedFlashAttentionMetadata": CertifiedFlashAttentionMetadata,
               "CertifiedFlashAttentionMetadataBuilder": CertifiedFlashAttentionMetadataBuilder}
    for c in classes.values():
        c.__module__ = __name__
    return classes


_CLASSES: dict = {}


def __getattr__(name):  # PEP 562: the vLLM classes are built on first access (vLLM imported then)
    if name in _CLASS_NAMES:
        if not _CLASSES:
            _CLASSES.update(_build_classes())
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_cuda() -> None:
    """Register :class:`CertifiedFlashAttentionBackend` as vLLM's ``CUSTOM`` attention backend (by class path).

    Select it with ``attention_config={"backend": "CUSTOM"}`` (or ``--attention-backend CUSTOM``).
    Not called by :func:`kvcert.vllm.register` yet: the CUDA route is untested on a device and
    :func:`kvcert.vllm.config.check_vllm_config` still refuses non-CPU platforms.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, f"{__name__}.CertifiedFlashAttentionBackend")
