"""The block (cluster) design as a press: :class:`BlockPoissonPress` samples whole blocks, once per
sequence for every layer and KV head (the vLLM plugin's design in the Hugging Face path), and records
each row's sample as a :class:`BlockDecision`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..fast import KINDS
from .base import Press, _int, _pad_rows, _real


@dataclass
class BlockDecision:
    """The block sample of one batch row (:attr:`BlockPoissonPress.decisions`).

    Attributes
    ----------
    n_tokens : int
        Prompt tokens of the row (padding excluded).
    importance : tensor (n_blocks,) float64
        Block importance u_b (:func:`kvcert.fast.block_importance` over every layer and KV head).
    pi : tensor (n_blocks,) float64
        Inclusion probabilities pi_b (1 on the certainty set).
    kept : bool tensor (n_blocks,)
        The sample: block b is kept iff U_b < pi_b, U from the block stream keyed by (seed, event).
    event : int
        ``kvcert.fast.prompt_event`` of the row's prompt token ids.
    """

    n_tokens: int
    importance: torch.Tensor
    pi: torch.Tensor
    kept: torch.Tensor
    event: int


@dataclass
class BlockPoissonPress(Press):
    r"""The block design of the vLLM plugin in the Hugging Face path: whole blocks sampled once per sequence.

    The prompt's tokens are grouped into blocks of ``block_size`` consecutive
    positions, counted from position 0 (the last block may be partial). After
    the exact prefill, one Poisson sample of blocks (clusters) with known
    inclusion probabilities pi_b is drawn per batch row and applied to every
    layer and KV head; every token of a kept block carries the offset
    :math:`-\log\pi_b`, and decoding reports the cluster-sampling certificate
    (DESIGN.md section 7, docs/theory.md section 7):

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \quad a = \operatorname{softmax}_S(\tau q\cdot k_i - \log\pi_{b(i)}),
        \qquad
        \mathrm{trace} = \sum_{b\in S} (1-\pi_b)\,\Big\lVert \sum_{i\in b} a_i (v_i - \hat o)\Big\rVert^2 .

    The decision is the plugin's (:mod:`kvcert.vllm.scheduler`), computed by
    the same :mod:`kvcert.fast` functions:

    1. token importance per layer and KV head: SnapKV attention
       (:func:`kvcert.fast.snapkv_scores`, ``kernel_size=1``, no pooling) of
       the prompt's last ``observation_window`` queries over all its keys;
    2. block importance (:func:`kvcert.fast.block_importance`): block totals
       normalized per (layer, KV head), then ``reduce`` (mean or max) over them;
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
    ``top_fraction``, ``target_size`` or pluggable scorer; the budget counts
    blocks), and so does the event: :class:`PoissonPress` compresses each
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
        Prompt queries the SnapKV importance reads (default 16).
    reduce : {"mean", "max"}
        How block shares are combined over layers and KV heads.
    delta : float in (0, 1)
        Miscoverage of the recorded certificates.
    kind : str
        Certificate kind (``kvcert.fast.KINDS``, default ``chebyshev``; the
        vLLM plugin serves ``chebyshev``, ``chi2`` and ``bernstein``).

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

    compression_ratio: float = 0.0
    block_size: int = 16
    seed: int = 0
    sink_blocks: int = 1
    recent_blocks: int = 1
    top_blocks: int = 0
    floor: float = 0.1
    observation_window: int = 16
    reduce: str = "mean"
    delta: float = 0.05
    kind: str = "chebyshev"

    def __post_init__(self):
        from ..fast import BLOCK_REDUCTIONS

        self.compression_ratio = _real("compression_ratio", self.compression_ratio, 0.0, 1.0, hi_open=True)
        self.block_size = _int("block_size", self.block_size, low=1)
        self.seed = _int("seed", self.seed)
        self.sink_blocks = _int("sink_blocks", self.sink_blocks)
        self.recent_blocks = _int("recent_blocks", self.recent_blocks, low=1)
        self.top_blocks = _int("top_blocks", self.top_blocks)
        self.floor = _real("floor", self.floor, 0.0, 1.0, lo_open=True)
        self.observation_window = _int("observation_window", self.observation_window, low=1)
        if not isinstance(self.reduce, str) or self.reduce not in BLOCK_REDUCTIONS:
            raise ValueError(f"reduce must be one of {BLOCK_REDUCTIONS}, got {self.reduce!r}")
        self.delta = _real("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        self.decisions: list = []
        self._pending: dict = {}  # layer -> (layer, per-row importance) of the prefill under way

    @property
    def compresses(self) -> bool:
        """Whether this press evicts anything at the prefill event."""
        return self.compression_ratio > 0

    def budget(self, n_blocks: int) -> float | None:
        """Expected kept blocks of a prompt of ``n_blocks`` blocks, or None when nothing is evicted
        (ratio 0, or the certainty set ``sink_blocks + recent_blocks + top_blocks`` fills the budget):
        ``kvcert.vllm.KVCertConfig.budget``'s rule."""
        from ..fast import block_budget

        return block_budget(n_blocks, self.compression_ratio, self.sink_blocks + self.recent_blocks + self.top_blocks)

    def queries_needed(self, n: int) -> int:
        """Prefill queries the importance reads at a prefill of n tokens (the observation window)."""
        return min(self.observation_window, n)

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
        """(h_kv, n_r) float64 SnapKV importance of each row's tokens (None for rows that evict nothing)."""
        from ..fast import snapkv_scores

        out = []
        slots = layer.physical_length
        offset = slots - queries.shape[2]  # the queries may be the last few only (kvcert.prefill)
        for r, idx in enumerate(self._rows(layer)):
            n = idx.numel()
            if n == 0 or self.budget(-(-n // self.block_size)) is None:
                out.append(None)
                continue
            w = min(self.observation_window, n)
            qi = idx[idx >= offset] - offset
            if qi.numel() < w:
                raise ValueError(f"BlockPoissonPress: layer {layer_idx} row {r} has {qi.numel()} prefill queries, "
                                 f"the observation window needs {w}")
            q = queries[r:r + 1][:, :, qi[-w:]]
            k = layer.keys[r:r + 1][:, :, idx]
            out.append(snapkv_scores(q, k, scale=scale, kernel_size=1)[0].to(torch.float64))
        return out

    def _decide(self, pending: list) -> None:
        """One block sample per row from every layer's importance, then compact every layer."""
        from ..fast import block_compact, block_importance, block_inclusion_probabilities, block_sample, prompt_event

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
            n = idx.numel()
            u = torch.stack([imp[r] for _, imp in pending])[None]  # (1, layers, h_kv, n)
            ub = block_importance(u, bs, reduce=self.reduce)[0]  # (n_blocks,) float64
            nb = ub.shape[0]
            pi = block_inclusion_probabilities(ub[None], self.budget(nb), block_size=1, sink_blocks=self.sink_blocks,
                                               recent_blocks=self.recent_blocks, top_blocks=self.top_blocks,
                                               floor=self.floor)[0]
            event = prompt_event(first.token_ids[r, idx.to(first.token_ids.device)].tolist())
            kept = block_sample(pi, seed=self.seed, event=event)
            decisions.append(BlockDecision(n, ub, pi, kept, event))
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
            layer.replace(*_pad_rows(out))
            layer.block_size = bs
