"""The plugin's CPU attention backend: the stock C++ kernel, plus the Hajek path for rows that evicted tokens.

Registered over vLLM's ``CPU_ATTN`` (on CPU, ``CpuPlatform.get_attn_backend_cls``
ignores any other selection). The step's context (:class:`kvcert.vllm.worker.Step`)
arrives on vLLM's per-step attention metadata: the plugin's worker
(:class:`kvcert.vllm.worker.CertifiedCPUWorker`) hands it to
:class:`CertifiedCPUAttentionMetadataBuilder` for the step's forward, whose
metadata (:class:`CertifiedCPUAttentionMetadata`) carries it in ``kvcert_step``
to every layer. Outside such a step (``kvcert_step`` None: warm-up and dummy
runs, an engine without the plugin's worker), and for every request that has
not evicted anything, it runs the stock ``CPUAttentionBackendImpl.forward``
unchanged, so an engine without eviction is the stock engine token for token.

Token design (the default, docs/design.md section 7): on the prompt's last
chunk, after the stock kernel has attended it, every layer scores the prompt
(:meth:`kvcert.fast.TokenDesign.score`), draws the token design
(:meth:`kvcert.fast.TokenDesign.decide`, the press's stream) and copies each KV
head's kept tokens, in position order, into m blocks of the request's own
(:func:`compact_prompt`, layout :func:`kvcert.fast.compact_slots`; the blocks
:func:`kvcert.vllm.handoff.compaction_targets`, never a cached prefix block). A decode row
of such a request attends over the compacted slots (offset -log pi_i, padding
-inf) and over the tokens after the prompt at their own positions (pi = 1),
through the estimator the Hugging Face path uses and its certificate
(:func:`token_decode`).

Every decode row goes through one router, :func:`kvcert.dispatch.paged_decode`
(its table :data:`kvcert.dispatch.ROUTER`, the paged layout's rows): it chooses
the code (the compiled op's paged route reading the slots in place, kvcert.fast's
paged block estimator, or the rows gathered by :func:`gather_rows` and the dense
route) and its result names the code that ran (``PagedDecode.route``). This
module reads and writes the paged cache (:func:`gather_blocks`,
:func:`gather_rows`, :func:`compact_prompt`) and hands the rows to the router
(:func:`token_decode`, :func:`block_decode`, :func:`sketch_decode`).

Per request (token design): a row is sampled with its request's design and certified with its request's
kind and delta (:meth:`kvcert.vllm.worker.Step.config_of`); decode rows are grouped by (kind, delta).

Models with sliding-window layers (Gemma 2 and 3): a sliding-window layer samples nothing and hands no
statistics to the certificate. Under vLLM's hybrid KV-cache manager (the default) it is in a KV-cache group of
its own (:attr:`kvcert.vllm.worker.Step.apart`) and runs the stock kernel over vLLM's window blocks, which
compaction never touches. With that manager off, every layer reads the request's one block table: at the eviction
event the layer keeps each KV head's last ``sliding_window`` prompt tokens (:func:`window_slots`, pi = 1) in the
compacted blocks, and its decode rows read those and the tail with every slot outside the query's window masked
(:meth:`kvcert.vllm.worker._Plan.compacted_inputs` with the window): the layer's exact attention. A model's logit softcap (Gemma 2) enters the token design's decode
(:func:`token_decode`'s ``softcap``: the compiled op's paged route takes the cap in its pass, the gather route as
a score bias, the Hugging Face decode's);
a sketch cannot carry it (refused by :func:`kvcert.vllm.config.check_softcap_design`).

Block design: for a request with an eviction decision (a decode row: one query token), the
stock C++ op cannot be used (it takes no additive bias and returns no
log-sum-exp), so :func:`block_decode` hands the row's kept blocks to the router:
kvcert.fast's paged block estimator (:func:`kvcert.fast.blocks.paged_block_hajek_attention`,
a chunked gather of the kept blocks) computes the Hajek estimate (offset
-log pi_b on every token of a kept sampled block; evicted blocks are simply
not gathered, i.e. masked with -inf) and the cluster-sampling trace (other
kinds: :func:`kvcert.fast.block_hajek_attention` on the gathered rows), from
which :func:`kvcert.fast.radius_from_statistics` gives the relative radius per
query head. Evicted blocks must be masked: the worker never learns that a block was
freed, and its old id may already hold another request's keys.

On the prompt's last chunk the backend also gathers the token scores of the
configured scorer (``KVCertConfig.scorer``, a key of ``kvcert.fast.SCORERS``,
through :meth:`kvcert.fast.BlockDesign.score`; default SnapKV without pooling)
on the prompt's keys and values and the prompt's last queries (the
observation window, every query when the prompt is one chunk, or none; under
chunked prefill the last chunk's after those kept from the earlier chunks,
:class:`kvcert.vllm.worker.PromptQueries`), per layer and KV head; the
worker aggregates them with :meth:`kvcert.fast.BlockDesign.block_importance`.

Cache layout read here (ISA ``vec``: float caches, block_size a multiple of
32, no AMX/bf16): the ``[num_blocks, h_kv, block_size, 2 * head_size]`` cache
holds, per (block, KV head), the keys transposed ``[head_size, block_size]``
then the values ``[block_size, head_size]`` (checked by
tests/vllm/test_vllm_backend.py against ``ops.cpu_attn_reshape_and_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)

from kvcert import dispatch
from kvcert.fast import ClusterSketch, compact_slots, radius_from_statistics
from kvcert.fast.blocks import block_chunks

from .handoff import extend

if TYPE_CHECKING:
    from .worker import Step

__all__ = ["CertifiedCPUAttentionBackend", "CertifiedCPUAttentionImpl", "CertifiedCPUAttentionMetadataBuilder",
           "CertifiedCPUAttentionMetadata", "plugin_isa", "compact_prompt", "token_decode",
           "gather_blocks", "gather_rows", "layer_index", "layer_index_of", "block_decode", "sketch_decode", "with_output_norm",
           "window_slots"]


def layer_index(layer) -> int:
    """The index of an attention layer in its model (from vLLM's ``layer_name``, e.g.
    ``model.layers.3.self_attn.attn`` -> 3), or 0 when it has none; the ``layer`` key of a scorer's stream."""
    return layer_index_of(getattr(layer, "layer_name", None))


def layer_index_of(name) -> int:
    """:func:`layer_index` of a layer name."""
    ints = [int(part) for part in name.split(".") if part.isdigit()] if isinstance(name, str) else []
    return ints[0] if len(ints) == 1 else 0


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (h_kv, m * block_size, head_size) of the blocks ``block_ids`` (m,) of a ``vec`` cache."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    flat = kv_cache.view(nb, h, bs * two_d)[block_ids]  # (m, h, 2 bs d)
    m = flat.shape[0]
    k = flat[..., : bs * d].reshape(m, h, d, bs).transpose(-1, -2)  # (m, h, bs, d)
    v = flat[..., bs * d:].reshape(m, h, bs, d)
    return (k.permute(1, 0, 2, 3).reshape(h, m * bs, d), v.permute(1, 0, 2, 3).reshape(h, m * bs, d))


def _pack(keys: torch.Tensor, values: torch.Tensor, bs: int) -> torch.Tensor:
    """(h, m * bs, d) keys and values -> (m, h, 2 * bs * d): the ``vec`` layout of m blocks (keys transposed)."""
    h, c, d = keys.shape
    m = c // bs
    kt = keys.reshape(h, m, bs, d).permute(1, 0, 3, 2).reshape(m, h, d * bs)
    vv = values.reshape(h, m, bs, d).permute(1, 0, 2, 3).reshape(m, h, bs * d)
    return torch.cat([kt, vv], dim=-1)


def compact_prompt(kv_cache: torch.Tensor, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """Copy each KV head's kept prompt tokens into the first slots of its request's blocks, in place; return the
    sums of the values copied and their count per KV head.

    Slot j of head h (logical block ``j // bs``, offset ``j % bs``, physical block ``block_ids[j // bs]``)
    receives the key and value of prompt position ``positions[h, j]``; padding slots (position -1) get zeros
    (they are masked with -inf and never read as tokens).

    Parameters
    ----------
    kv_cache : (num_blocks, h_kv, bs, 2 d), the ``vec`` layout (written in place)
    block_ids : int64 (nb,), the request's physical blocks in logical order (at least m = C / bs of them)
    keys, values : (h_kv, n, d), the prompt's keys and values read before the copy (:func:`gather_blocks`)
    positions : int64 (h_kv, C), C a multiple of bs (:attr:`kvcert.fast.Compaction.positions` of one layer)

    Returns
    -------
    float64 (h_kv, d + 1): per KV head the sum of the kept values as the cache now holds them (in its dtype),
    then their count. The sketched decode's value centre (the mean kept value) reads these instead of the
    compacted slots (:func:`sketch_decode`): those values do not change while the request decodes.
    """
    h, c = positions.shape
    bs = kv_cache.shape[2]
    if c == 0:
        return torch.zeros(h, values.shape[-1] + 1, dtype=torch.float64)
    if c % bs:
        raise ValueError(f"positions must hold a multiple of block_size={bs} slots per head, got {c}")
    valid = (positions >= 0)[..., None]
    src = positions.clamp_min(0)[..., None].expand(h, c, keys.shape[-1])
    kc = torch.where(valid, keys.gather(1, src), 0.0)
    vc = torch.where(valid, values.gather(1, src), 0.0)
    flat = kv_cache.view(kv_cache.shape[0], h, -1)
    flat.index_copy_(0, block_ids[: c // bs], _pack(kc, vc, bs).to(kv_cache.dtype))
    held = vc.to(kv_cache.dtype).double()  # padding slots hold zeros: they add nothing
    return torch.cat([held.sum(1), valid[..., 0].sum(1, keepdim=True).double()], dim=1)


def impl_window(impl) -> int | None:
    """An attention implementation's sliding window (Gemma 2 and 3's local layers; vLLM's ``sliding_window``),
    None for a full-attention layer (vLLM's -1, or no attribute)."""
    w = getattr(impl, "sliding_window", -1)
    return int(w) if w is not None and int(w) > 0 else None


def impl_softcap(impl) -> float | None:
    """An attention implementation's logit softcap (Gemma 2), None without one (vLLM's 0, or no attribute)."""
    c = getattr(impl, "logits_soft_cap", 0) or 0
    return float(c) if c > 0 else None


def window_slots(h_kv: int, n: int, window: int, block_size: int):
    """The compacted layout (:class:`kvcert.fast.Compaction`) of a sliding-window layer's prompt of ``n`` tokens:
    every KV head keeps its last ``min(n, window)`` tokens (positions ``max(0, n - window) .. n - 1``, pi = 1),
    all that a later query of the layer reads (its window ends at the query: a query at position t >= n reads
    positions > t - window). Nothing is sampled, so the layer adds nothing to the certificate."""
    keep = torch.zeros(h_kv, n, dtype=torch.bool)
    keep[:, max(0, n - window):] = True
    return compact_slots(keep, torch.ones(h_kv, n), block_size)


def gather_rows(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (E, h_kv, M * bs, d) of the blocks ``block_ids`` (E, M) of a ``vec`` cache, row by row."""
    nb, h, bs, two_d = kv_cache.shape
    d = two_d // 2
    E, M = block_ids.shape
    flat = kv_cache.view(nb, h, bs * two_d)[block_ids.reshape(-1)].view(E, M, h, bs * two_d)
    k = flat[..., : bs * d].reshape(E, M, h, d, bs).permute(0, 2, 1, 4, 3).reshape(E, h, M * bs, d)
    v = flat[..., bs * d:].reshape(E, M, h, bs, d).permute(0, 2, 1, 3, 4).reshape(E, h, M * bs, d)
    return k, v

def with_output_norm(stats: dict) -> dict:
    r"""A step's certificate statistics as :func:`kvcert.fast.radius_from_statistics` reads them: an ``"output"``
    entry (the estimate, (..., dv); what the decode layers leave, :meth:`kvcert.vllm.worker.Step.add_statistics`)
    replaced by its norm ``"output_norm"`` :math:`\lVert\hat o\rVert_2` (..., taken in float32); ``stats`` itself
    when it holds the norm already."""
    if "output" not in stats:
        return stats
    out = dict(stats)
    out["output_norm"] = torch.linalg.vector_norm(out.pop("output").float(), dim=-1)
    return out


def _certified(dec: dispatch.PagedDecode, kind: str, delta: float, radius: bool) -> dispatch.PagedDecode:
    """``dec`` with its relative radii (:func:`kvcert.fast.radius_from_statistics`) when ``radius``; the forward
    leaves them to :meth:`kvcert.vllm.worker.Step.add_statistics`, which takes them once per step."""
    if not radius:
        return dec
    return replace(dec, radius=radius_from_statistics(kind, delta, **with_output_norm(dec.statistics))[2])


def token_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, log_pi: torch.Tensor,
                 scale: float, kind: str, delta: float, *, radius: bool = True,
                 softcap: float | None = None) -> dispatch.PagedDecode:
    r"""Hajek decode attention of rows whose prompt was compacted, and their certificate.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i,\quad a = \operatorname{softmax}_S(\tau q\cdot k_i - \log\pi_i),\quad
        \mathrm{trace} = \sum_{i\in S}(1-\pi_i)\,a_i^2\,\lVert v_i - \hat o\rVert^2,

    over the slots with log pi > -inf (the compacted prompt tokens and the tokens after the prompt, pi = 1):
    :func:`kvcert.dispatch.paged_decode` of the token design on this cache (the compiled op's paged route
    :func:`kvcert.kernels.cpu.paged_hajek_attention` for a trace-only kind where the op builds, else the rows
    gathered by :func:`gather_rows` and :func:`kvcert.dispatch.hajek_attention`), the estimate and certificate of
    the Hugging Face decode.

    Parameters
    ----------
    query : (E, h_q, d)   kv_cache : (num_blocks, h_kv, bs, 2 d), ``vec`` layout
    block_ids : int64 (E, M), the blocks to read per row   log_pi : (E, h_kv, M * bs), -inf = not a token
    scale : float   kind : a served certificate kind   delta : float in (0, 1)
    radius : bool
        Take the relative radii (``False``: the forward, which takes them once per step).
    softcap : float, optional
        The model's attention logit softcap (Gemma 2): scores :math:`c\tanh(\tau q\cdot k_i/c)` before the
        offset (:func:`kvcert.dispatch.paged_decode`'s ``softcap``: in the compiled op's pass, or as a score bias
        on the gathered rows).

    Returns
    -------
    kvcert.dispatch.PagedDecode
        ``output`` (E, h_q, d) in the query's dtype, ``statistics``, ``radius`` (E, h_q) float32 (None without
        ``radius``) and ``route`` / ``dense``, the code that ran.
    """
    dec = dispatch.paged_decode("token", query, kv_cache, block_ids, log_pi, scale=scale, kind=kind, delta=delta,
                                gather=gather_rows, softcap=softcap)
    return _certified(dec, kind, delta, radius)


def block_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, log_pi: torch.Tensor,
                 scale: float, kind: str, delta: float, *, chunks=None, radius: bool = True) -> dispatch.PagedDecode:
    r"""Hajek decode attention over whole kept blocks (the block design), and its certificate.

    :func:`kvcert.dispatch.paged_decode` of the block design on this cache: for a trace-only kind (chebyshev)
    kvcert.fast's paged estimator (:func:`kvcert.fast.blocks.paged_block_hajek_attention`: offset -log pi_b on
    every token of a kept block, the cluster-sampling trace, a chunked gather of the kept blocks), else the rows
    gathered (:func:`gather_rows`) and :func:`kvcert.fast.block_hajek_attention` with the kind's options. Evicted
    blocks are not read: the worker never learns that a block was freed, and its old id may already hold another
    request's keys.

    Parameters
    ----------
    query : (E, h_q, d), one decode query per row   kv_cache : (num_blocks, h_kv, bs, 2 d), ``vec`` layout
    block_ids : int64 (E, M), kept physical blocks per row (padding last: any allocated block)
    log_pi : (E, M, bs) float32, log pi_b on every valid token of a kept block (0 on certain blocks and decode
        tokens), -inf on padding and on slots past the sequence end
    scale : float   kind : a served certificate kind   delta : float in (0, 1)
    chunks : list, optional
        :func:`kvcert.fast.blocks.block_chunks` of the rows (the forward computes them once per step)
    radius : bool
        Take the relative radii (``False``: the forward).

    Returns
    -------
    kvcert.dispatch.PagedDecode
        As :func:`token_decode`'s.
    """
    dec = dispatch.paged_decode("block", query, kv_cache, block_ids, log_pi, scale=scale, kind=kind, delta=delta,
                                gather=gather_rows, chunks=chunks)
    return _certified(dec, kind, delta, radius)


def sketch_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, log_pi: torch.Tensor,
                  sketch: ClusterSketch, scale: float, kind: str, delta: float, centre=None, *,
                  radius: bool = True) -> dispatch.PagedDecode:
    r"""Decode attention of compacted rows whose design keeps a sketch of the evicted tokens, and their certificate.

    The Hajek output over the held slots (:func:`token_decode`'s) and the sketched design's certificate,
    :func:`kvcert.fast.sketch_hajek_attention` on the held slots and the rows' sketches: the hybrid variance
    :math:`V_{\mathrm{cl}}` (kept tokens exact, evicted ones through the sketch's Gaussian moments) or the sample's HT
    trace, the larger (:func:`kvcert.fast.sketched_variance`), clipped at
    :math:`(H/c)^2` with :math:`H` the hull bound and :math:`c` the kind's factor (:math:`1/\sqrt\delta` for
    ``chebyshev``, 3 for ``tilted_hull``), so the radius is
    :math:`\min(c\sqrt{V}, H)`: what the Hugging Face decode of ``PoissonPress(sketch=...)``
    records (``kvcert.attention``). :func:`kvcert.dispatch.paged_decode` of the sketch design: on CPU where the
    compiled op builds, its paged sketch route (:func:`kvcert.kernels.cpu.paged_sketch_hajek_attention`) reads the
    slots in place and computes the value centre (the mean kept value; with ``centre``, from the compacted prompt's
    sums and the tail's values), the step and the recorded trace itself; ``KVCERT_CPU_OP=0`` and a machine where
    the op cannot be built gather the blocks (:func:`gather_rows`) and call
    :func:`kvcert.dispatch.sketch_hajek_attention`.

    Parameters
    ----------
    query : (E, h_q, d)   kv_cache : (num_blocks, h_kv, bs, 2 d), ``vec`` layout
    block_ids : int64 (E, M)   log_pi : (E, h_kv, M * bs), -inf = not a token
    sketch : ClusterSketch of the E rows (batch E)   scale : float
    kind : ``"chebyshev"`` or ``"tilted_hull"``   delta : float in (0, 1)
    centre : (float64 (E, h_kv, d + 1), int64 (E,)), optional
        Per row the kept value sums and count of its compacted prompt (:func:`compact_prompt`'s) and the slot
        where its tail starts (m bs): the op's value centre then reads only the tail's values
        (:func:`kvcert.kernels.cpu.paged_sketch_hajek_attention`'s ``center_sums`` and ``tail_start``); the
        gather route computes the centre itself.
    radius : bool
        Take the relative radii (``False``: the forward).

    Returns
    -------
    kvcert.dispatch.PagedDecode
        As :func:`token_decode`'s.
    """
    dec = dispatch.paged_decode("sketch", query, kv_cache, block_ids, log_pi, scale=scale, kind=kind, delta=delta,
                                sketch=sketch, centre=centre, gather=gather_rows)
    return _certified(dec, kind, delta, radius)


class CertifiedCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` with the Hajek path for rows that evicted tokens (module docstring)."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        step = attn_metadata.kvcert_step if isinstance(attn_metadata, CertifiedCPUAttentionMetadata) else None
        # outside a step, and a sliding-window layer in a KV-cache group of its own (vLLM's hybrid manager): the
        # stock kernel over vLLM's own window blocks, which compaction never touches
        if step is None or self.attn_type != AttentionType.DECODER or layer_index(layer) in step.apart:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        plan = step.plan(attn_metadata, kv_cache.shape[2])
        self._keep_queries(step, plan, layer, query)
        if not plan.masked and not plan.compacted:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
            return self._importance(step, plan, layer, query, kv_cache, output)
        if getattr(layer, "isa", "vec") != "vec":
            raise RuntimeError(f"kvcert.vllm reads the 'vec' cache layout; this layer uses {layer.isa!r}")
        if plan.stock_rows:
            self._stock_rows(plan, layer, query, kv_cache, attn_metadata, output)
        if plan.compacted:  # the token design: compacted prompt slots + the tokens after the prompt
            index = layer_index(layer)
            window, softcap = impl_window(self), impl_softcap(self)
            # a sliding-window layer: its last `window` prompt tokens and the tail, masked to the query's window
            ids, log_pi = plan.compacted_inputs(index, window)
            # rows by their request's (kind, delta, sketched)
            for (kind, delta, sketched), rows, sel, tokens, req_ids, in_order in plan.compacted_groups(
                    query.shape[0]):
                g_ids, g_log_pi = (ids, log_pi) if sel is None else (ids[sel], log_pi[sel])
                q_rows = query if in_order else query.index_select(0, tokens)
                if sketched and window is None:  # a row's own sketch, or the group's join kept across steps
                    # (Step.group_sketch); a window layer keeps none: exact attention over its window (pi = 1)
                    sketch = step.group_sketch(index, (kind, delta, sketched), [plan.compacted[j] for j in rows])
                    centre = plan.compacted_centres(index, sel)
                    dec = sketch_decode(q_rows, kv_cache, g_ids, g_log_pi, sketch, self.scale, kind, delta, centre,
                                        radius=False)
                else:
                    dec = token_decode(q_rows, kv_cache, g_ids, g_log_pi, self.scale, kind, delta, radius=False,
                                       softcap=softcap)
                o, stats = dec.output, dec.statistics
                if in_order:
                    output.copy_(o)
                else:
                    output.index_copy_(0, tokens, o.to(output.dtype))
                if window is None:  # certificates of the compressed (full-attention) layers only, as the press's
                    step.add_statistics(req_ids, kind, delta, stats)
        if plan.masked:
            self._masked_rows(step, plan, query, kv_cache, output)
        return self._importance(step, plan, layer, query, kv_cache, output)

    def _stock_rows(self, plan, layer, query, kv_cache, attn_metadata, output) -> None:
        """The stock C++ kernel on the rows without eviction state (a sub-batch of the step)."""
        num_blocks, h_kv, bs, _ = kv_cache.shape
        kvv = kv_cache.view((num_blocks, h_kv, bs * 2, -1))
        key_cache, value_cache = kvv.chunk(2, dim=2)
        sub = plan.stock_metadata(self, attn_metadata, query.dtype)
        q_sub = query.index_select(0, sub.token_index)
        out_sub = torch.empty_like(q_sub)
        ops.cpu_attention_with_kv_cache(
            query=q_sub, key_cache=key_cache, value_cache=value_cache, output=out_sub,
            query_start_loc=sub.query_start_loc, seq_lens=sub.seq_lens, scale=self.scale,
            causal=attn_metadata.causal, alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window,
            block_table=sub.block_table, softcap=self.logits_soft_cap,
            scheduler_metadata=sub.scheduler_metadata, s_aux=self.sinks,
            dynamic_causal=attn_metadata.dynamic_causal, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, kv_cache_dtype=self.kv_cache_dtype)
        output.index_copy_(0, sub.token_index, out_sub.to(output.dtype))

    def _masked_rows(self, step, plan, query, kv_cache, output) -> None:
        """The block design's decode rows: whole kept blocks, offset -log pi_b, the cluster-sampling trace
        (:func:`block_decode`, the rows' gather chunks computed by the step's first layer)."""
        cfg = step.config
        if plan.block_chunks is None:  # the same for every layer of the step
            plan.block_chunks = block_chunks(kv_cache, plan.masked_block_ids, plan.masked_log_pi)
        dec = block_decode(query.index_select(0, plan.masked_tokens), kv_cache, plan.masked_block_ids,
                           plan.masked_log_pi, self.scale, cfg.kind, cfg.delta, chunks=plan.block_chunks, radius=False)
        output.index_copy_(0, plan.masked_tokens, dec.output.to(output.dtype))
        step.add_statistics([row.req_id for row in plan.masked], cfg.kind, cfg.delta, dec.statistics)

    @staticmethod
    def _keep_queries(step, plan, layer, query) -> None:
        """The rows that process a chunk of a prompt before its last, whose eviction event is still to come:
        keep the prompt's last queries so far (those kept from its earlier chunks, then this chunk's; at most
        the event's window) for the event (:meth:`kvcert.vllm.worker.Step.keep_queries`)."""
        if not plan.chunks:
            return
        index = layer_index(layer)
        for c in plan.chunks:
            chunk = query[c.q_end - c.q_len : c.q_end]
            joined = chunk if c.past is None else c.past.join(index, chunk, c.seq_len - c.q_len)
            step.keep_queries(c.req_id, index, joined[-c.window:], c.seq_len)

    def _importance(self, step, plan, layer, query, kv_cache, output):
        """The rows that finish their prompt in this step, at their eviction event. Token design: the layer's
        event (:meth:`kvcert.fast.TokenDesign.event`: the scores, the budget or an error target's per-head
        budgets, the decision on the press's stream (layer index, event 0) and the sketch) on the prompt's keys
        and values and the prompt's last queries (this chunk's, after those the worker kept from the prompt's
        earlier chunks: the unchunked engine's), now, after the stock kernel has attended the chunk; then the
        copy of the kept tokens into the request's compaction blocks (:func:`compact_prompt`,
        :func:`kvcert.vllm.handoff.compaction_targets`). A layer where nothing is
        evicted keeps every token (pi = 1, so the request frees no block: blocks are shared by the layers).
        Block design: the scores (``design.score``), aggregated over layers by the worker."""
        if not plan.importance:
            return output
        index = layer_index(layer)
        bs = kv_cache.shape[2]
        window = impl_window(self)
        for row in plan.importance:
            cfg = row.config if row.config is not None else step.config  # the request's settings
            design = cfg.design
            nbt = -(-row.seq_len // bs)
            k, v = gather_blocks(kv_cache, row.all_block_ids[:nbt])
            k, v = k[:, : row.seq_len], v[:, : row.seq_len]
            if window is not None and cfg.tokens:  # a sliding-window layer: its window, exactly (never sampled)
                layout = window_slots(k.shape[0], row.seq_len, window, bs)
                compact_prompt(kv_cache, row.write_ids, k, v, layout.positions)
                step.add_compaction(row.req_id, index, layout, window=window)
                continue
            prompt_q = row.queries(index, query)
            avail = prompt_q.shape[0]
            w = design.event_queries(avail, row.seq_len) if cfg.tokens else design.queries_read(avail, row.seq_len)
            q = prompt_q[avail - w :].permute(1, 0, 2)[None]  # (1, h_q, w, d)
            if not cfg.tokens:
                step.add_importance(row.req_id, design.score(q, k[None], v[None], scale=self.scale, layer=index)[0])
                continue
            # a tensor-parallel rank's heads draw the layer's streams of those heads (the stream is keyed by KV head)
            ev = design.event(q, k[None], v[None], scale=self.scale, layer=index, event=0,
                              head_offset=step.tp_rank * k.shape[0])
            layout = compact_slots(ev.decision.keep, ev.decision.pi, bs)
            sums = compact_prompt(kv_cache, row.write_ids, k, v, layout.positions)
            step.add_compaction(row.req_id, index, layout, ev.sketch, sums if ev.sketch is not None else None)
        return output


@dataclass
class CertifiedCPUAttentionMetadata(CPUAttentionMetadata):
    """vLLM's CPU attention metadata of one step, with the step's context: the plugin's worker's
    :class:`kvcert.vllm.worker.Step` while it runs the step, else None (the stock attention)."""

    kvcert_step: Step | None = None


class CertifiedCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU metadata builder, every layer in the ``vec`` cache layout: where vLLM would pick ``amx``
    (bfloat16 models on CPUs with AMX tiles) it picks ``vec``, the layout the plugin reads and writes (the
    compaction's copy, :func:`gather_blocks`, the compiled op's paged routes). The stock kernel serves the
    requests without eviction state in that layout too (the same attention, its ``vec`` code path).

    Its metadata is :class:`CertifiedCPUAttentionMetadata`, carrying :attr:`kvcert_step`: the step's context the
    plugin's worker hands it for the step's forward (None outside)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa != plugin_isa(self.isa):
            self.isa = plugin_isa(self.isa)
            self._set_isa_to_layers(layer_names)
        self.kvcert_step: Step | None = None

    def build(self, *args, **kwargs) -> CertifiedCPUAttentionMetadata:
        return extend(CertifiedCPUAttentionMetadata, super().build(*args, **kwargs), kvcert_step=self.kvcert_step)


def plugin_isa(stock: str) -> str:
    """The CPU cache layout the plugin's engine uses where vLLM's own choice is ``stock``: ``vec`` for
    ``amx`` (the same attention, its portable code path), else vLLM's (which the worker refuses unless
    it is ``vec``)."""
    return "vec" if stock == "amx" else stock


class CertifiedCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend with :class:`CertifiedCPUAttentionImpl` (same name, same cache) and
    :class:`CertifiedCPUAttentionMetadataBuilder` (the ``vec`` layout on every CPU)."""

    @staticmethod
    def get_impl_cls():
        return CertifiedCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return CertifiedCPUAttentionMetadataBuilder


def stock_scheduler_metadata(impl: CPUAttentionBackendImpl, seq_lens, query_start_loc, causal, isa, dtype):
    """The C++ op's work partition for a sub-batch (as ``CPUAttentionMetadataBuilder.build`` computes it)."""
    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(seq_lens.shape[0]), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start_loc, causal=causal,
        sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype)
