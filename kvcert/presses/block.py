"""The block design as a press: :class:`BlockPoissonPress` samples whole blocks, once per
sequence for every layer and KV head (the vLLM plugin's design in the Hugging Face path), and records
each row's sample as a :class:`BlockDecision`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import BlockDecision, BlockDesign
from ..fast.options import declare_fields
from .base import Press, held_design, pad_rows

__all__ = ["BlockDecision", "BlockPoissonPress"]  # BlockDecision: kvcert.fast's, re-exported


#: the fields of :class:`kvcert.fast.BlockDesign` the press declares (all but ``kernel_size``), in its order
_BLOCK_FIELDS = ("compression_ratio", "block_size", "seed", "sink_blocks", "recent_blocks", "top_blocks", "floor",
                 "observation_window", "reduce", "delta", "kind", "scorer")


@dataclass
@declare_fields(BlockDesign, _BLOCK_FIELDS)
class BlockPoissonPress(Press):
    r"""The block design of the vLLM plugin in the Hugging Face path: whole blocks sampled once per sequence.

    The prompt's tokens are grouped into blocks of ``block_size`` consecutive
    positions, counted from position 0 (the last block may be partial). After
    the exact prefill, one Poisson sample of blocks (clusters) with known
    inclusion probabilities pi_b is drawn per batch row and applied to every
    layer and KV head; every token of a kept block carries the offset
    :math:`-\log\pi_b`, and decoding reports the cluster-sampling certificate
    (docs/design.md section 7, docs/theory.md section 7):

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \quad a = \operatorname{softmax}_S(\tau q\cdot k_i - \log\pi_{b(i)}),
        \qquad
        \mathrm{trace} = \sum_{b\in S} (1-\pi_b)\,\Big\lVert \sum_{i\in b} a_i (v_i - \hat o)\Big\rVert^2 .

    The decision is the plugin's (:mod:`kvcert.vllm.scheduler`): both hold a
    :class:`kvcert.fast.BlockDesign` (:attr:`design`, built from the press's
    fields, which it checks):

    1. token scores per layer and KV head from the registered scorer
       ``scorer`` (``kvcert.fast.SCORERS``; default SnapKV attention without
       pooling, ``kernel_size=1``, of the prompt's last ``observation_window``
       queries over all its keys): :meth:`kvcert.fast.BlockDesign.score`;
    2. block importance (:meth:`kvcert.fast.BlockDesign.block_importance`):
       negative scores shifted per head, block totals normalized per
       (layer, KV head), then ``reduce`` (mean or max) over them;
    3. pi_b = :func:`kvcert.fast.block_inclusion_probabilities` on the block
       importance (``block_size=1``: blocks are the units) with budget
       ``(1 - compression_ratio) * n_blocks`` expected kept blocks and the
       certainty set ``sink_blocks`` + ``recent_blocks`` + ``top_blocks``;
       no eviction (pi = 1 everywhere) when the certainty set fills the
       budget (:meth:`budget`, as ``KVCertConfig.budget``);
    4. the sample :func:`kvcert.fast.block_sample` with ``seed`` and
       ``event = kvcert.fast.prompt_event(prompt token ids)``: the same
       prompt and seed keep the same blocks alone or in any batch, here and
       in the vLLM plugin (same ``block_size``).

    Why a press of its own rather than ``PoissonPress(granularity="block")``:
    the knobs differ (the certainty set is counted in blocks; no
    ``top_fraction`` or ``target_size``; the budget counts blocks), and
    so does the event: :class:`PoissonPress` compresses each
    layer when its own prefill ends (one independent design per layer and KV
    head), while the block design needs every layer's importance before it
    can decide once for all of them. It collects the per-layer importance at
    each layer's prefill event and decides and compacts every layer at the
    last one (or through :func:`kvcert.prefill` / ``generate(prefilled=...)``,
    which replay the same events). :class:`PoissonPress` is untouched.

    Parameters
    ----------
    compression_ratio : float in [0, 1)
        Fraction of the prompt's blocks evicted in expectation (0, the
        default: nothing is evicted and decoding is exact attention).
    block_size : int >= 1
        Tokens per block (default 16). Use the serving engine's block size to
        reproduce its decisions (vLLM's CPU backend needs a multiple of 32).
    seed : int >= 0
        Key of the block stream (:func:`kvcert.fast.block_uniforms`).
    sink_blocks : int >= 0
        First blocks kept with certainty (default 1).
    recent_blocks : int >= 1
        Last blocks kept with certainty (default 1): the last, possibly
        partial block, where decoding continues, is always kept.
    top_blocks : int >= 0
        Most important other blocks kept with certainty (default 0).
    floor : float in (0, 1]
        Defensive mixture weight of the design (default 0.1).
    observation_window : int >= 1
        Prompt queries a window scorer (SnapKV) reads (default 16).
    reduce : {"mean", "max"}
        How block shares are combined over layers and KV heads.
    delta : float in (0, 1)
        Miscoverage of the recorded certificates.
    kind : str
        Certificate kind (``kvcert.fast.KINDS``, default ``chebyshev``; the
        vLLM plugin serves ``chebyshev``, ``chi2`` and ``bernstein``).
    scorer : str
        Token importance, a key of ``kvcert.fast.SCORERS`` (default
        ``"snapkv"``): ``BlockPoissonPress(scorer="knorm")`` decides what the
        vLLM plugin with ``scorer="knorm"`` decides.

    Attributes
    ----------
    decisions : list of BlockDecision or None
        Per batch row of the last prefill: the row's block sample, or None
        where nothing was evicted (ratio 0, or the certainty set fills the budget).

    Notes
    -----
    The compressed layers hold the kept tokens of whole blocks (the same in
    every layer and KV head) and ``KVCertLayer.block_size``; a slot's block
    is ``position // block_size``, so tokens appended while decoding (pi = 1)
    are units of their own and add no variance. The block stream is keyed by
    the prompt's token ids, so the press needs ``input_ids`` (not
    ``inputs_embeds``) in the prefill forward; left padding is excluded from
    the ids and the blocks. The decision is taken once, on the first forward
    of a sequence (a streamed prefill, ``prefill_chunk``, decides on its
    first chunk); decode-time compression (:class:`DecodingPress`) does not
    apply to this press.

    Examples
    --------
    >>> import kvcert
    >>> press = kvcert.BlockPoissonPress(compression_ratio=0.5, block_size=32, seed=0)
    >>> press.budget(8), press.budget(2)
    (4.0, None)
    """

    # the fields are BlockDesign's (_design_fields), declared by declare_fields

    #: the press fields the :class:`kvcert.fast.BlockDesign` holds (and checks)
    _design_fields = _BLOCK_FIELDS
    decides_every_layer = True

    def __post_init__(self):
        if self.block_size is None:  # the design's "engine's block size" has no meaning in the press
            raise TypeError("block_size must be an int, got NoneType")
        held_design(self)  # the fields' checks are the design's
        self.decisions: list = []
        self._pending: dict = {}  # layer -> (layer, per-row importance) of the prefill under way

    def _make_design(self) -> BlockDesign:
        return BlockDesign(**{name: getattr(self, name) for name in self._design_fields})

    @property
    def design(self) -> BlockDesign:
        """The :class:`kvcert.fast.BlockDesign` of the press's fields (budget, scorer, block importance,
        decision), the one the vLLM plugin holds; rebuilt, and so checked, when a field is reassigned."""
        return held_design(self)

    @property
    def compresses(self) -> bool:
        """Whether this press evicts anything at the prefill event."""
        return self.design.compresses

    def budget(self, n_blocks: int) -> float | None:
        """Expected kept blocks of a prompt of ``n_blocks`` blocks, or None when nothing is evicted
        (ratio 0, or the certainty set ``sink_blocks + recent_blocks + top_blocks`` fills the budget):
        :meth:`kvcert.fast.BlockDesign.budget`, as ``kvcert.vllm.KVCertConfig.budget``."""
        return self.design.budget(n_blocks)

    def queries_needed(self, n: int) -> int:
        """Prefill queries the scorer reads at a prefill of n tokens (the observation window for SnapKV)."""
        return self.design.queries_needed(n)

    def decode_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        """Nothing: the block design decides once, after the prefill."""

    # -- the prefill event: collect each layer's importance, decide and compact at the last layer ---------
    def prefill_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        layer.events += 1
        layer.tokens_since_event = 0
        if layer_idx == 0:
            self._pending, self.decisions = {}, [None] * layer.keys.shape[0]
        if not self.compresses:
            return
        self._pending[layer_idx] = (layer, self._layer_importance(layer, layer_idx, queries, scale))
        if self._session is None:
            raise RuntimeError("BlockPoissonPress: prefill events come from its context (with press(model):)")
        n_layers = self._session.n_layers
        if layer_idx == n_layers - 1:
            pending, self._pending = self._pending, {}
            if sorted(pending) != list(range(n_layers)):
                raise RuntimeError(f"BlockPoissonPress: the prefill events of layers {sorted(pending)} arrived, "
                                   f"not all {n_layers}: the block design decides once for every layer")
            self._decide([pending[i] for i in range(n_layers)])

    def _rows(self, layer):
        """Per batch row: its real slots (the prefill's slots minus left padding)."""
        valid = layer.valid[:, 0]  # every head holds the same tokens after a prefill
        return [valid[r].nonzero().squeeze(-1) for r in range(valid.shape[0])]

    def _layer_importance(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> list:
        """(h_kv, n_r) float64 token scores of each row (the design's scorer; None for rows that evict nothing)."""
        design = self.design
        out = []
        slots = layer.physical_length
        offset = slots - queries.shape[2]  # the queries may be the last few only (kvcert.prefill)
        for r, idx in enumerate(self._rows(layer)):
            n = idx.numel()
            if n == 0 or self.budget(design.n_blocks(n)) is None:
                out.append(None)
                continue
            w = design.queries_needed(n)
            qi = idx[idx >= offset] - offset
            if qi.numel() < w:
                raise ValueError(f"BlockPoissonPress: layer {layer_idx} row {r} has {qi.numel()} prefill queries, "
                                 f"its scorer ({design.scorer!r}) reads {w}")
            q = queries[r:r + 1][:, :, qi]  # the design reads the last design.queries_read(...) of them
            k, v = layer.keys[r:r + 1][:, :, idx], layer.values[r:r + 1][:, :, idx]
            out.append(design.score(q, k, v, scale=scale, layer=layer_idx)[0].to(torch.float64))
        return out

    def _decide(self, pending: list) -> None:
        """One block sample per row from every layer's scores, then compact every layer."""
        from ..fast import block_compact, prompt_event

        design = self.design
        first = pending[0][0]
        rows = self._rows(first)
        bs = self.block_size
        decisions = []
        for r, idx in enumerate(rows):
            if pending[0][1][r] is None:
                decisions.append(None)
                continue
            if first.token_ids is None:
                raise ValueError("BlockPoissonPress keys its block stream by the prompt's token ids (as the vLLM "
                                 "plugin does): call the model with input_ids, not inputs_embeds")
            u = torch.stack([imp[r] for _, imp in pending])[None]  # (1, layers, h_kv, n)
            ub = design.block_importance(u)[0]  # (n_blocks,) float64
            event = prompt_event(first.token_ids[r, idx.to(first.token_ids.device)].tolist())
            decisions.append(design.decide(ub, event=event, n_tokens=idx.numel()))
        self.decisions = decisions
        if all(d is None for d in decisions):
            return
        for layer, _ in pending:
            out = []
            for r, idx in enumerate(rows):
                d = decisions[r]
                sl = slice(r, r + 1)
                if d is None:  # nothing evicted: the row as it is (padding included)
                    out.append((layer.keys[sl], layer.values[sl], layer.log_weights[sl], layer.positions[sl]))
                    continue
                k, v, pos = layer.keys[sl][:, :, idx], layer.values[sl][:, :, idx], layer.positions[sl][:, :, idx]
                if not torch.equal(pos[0, 0], torch.arange(idx.numel(), device=pos.device)):
                    raise RuntimeError("BlockPoissonPress: a prefill's tokens must sit at positions 0 .. n - 1")
                cc = block_compact(d.kept[None].to(k.device), d.pi[None].to(k.device), k, v, block_size=bs)
                out.append((cc.keys, cc.values, torch.log(cc.pi), cc.positions))
            layer.replace(*pad_rows(out))
            layer.block_size = bs
