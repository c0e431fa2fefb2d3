"""A transformers cache layer that keeps log pi beside keys and values.

:class:`KVCertLayer` is a ``DynamicLayer`` (transformers 5.x ``cache_utils``)
with three extra per-slot tensors, modelled on ``DynamicIndexedLayer``:

- ``log_weights`` (b, h_kv, m) float32 (float64 for a float64 model): log pi_i, the log of the probability
  that slot i survived every eviction event so far (0 for tokens never
  sampled, -inf for padding slots: left padding of a batch, or the slots that
  pad heads with fewer kept tokens to a common length m);
- ``positions`` (b, h_kv, m) int64: the token's position in its own sequence
  (the RoPE position: left padding is not counted), -1 on padding;
- ``next_position`` (b,): the position the next token of each row takes.

After a block eviction (:class:`kvcert.presses.BlockPoissonPress`) the layer
also holds ``block_size``: the sampling unit of a slot with pi < 1 is its
block ``positions // block_size`` (one label per slot, read off the stored
positions, so no tensor of its own), and decoding uses the block design's
cluster-sampling certificate. Slots with pi = 1 (certain blocks, tokens
appended while decoding) are units of their own and contribute no variance.

After an eviction the cache is shorter than the sequence. The layer then
reports two lengths, as the transformers mask code expects:
:meth:`get_seq_length` is the *logical* length (tokens seen, the columns of
the 2-D attention mask, what ``generate`` and the default position ids
count), :meth:`get_mask_sizes` the *physical* one (slots held, what a mask
over the keys must cover). Layers may hold different physical lengths.

A quantized cache (``PoissonPress(kv_bits=8)``) holds the kept tokens of its prefill event as codes and
16-bit scales (:attr:`KVCertLayer.quantized`, a ``kvcert.fast.QuantizedKV``: int8 codes, int4 one code per
byte, not packed) in the first slots, and ``keys`` / ``values`` hold only the tokens appended since (exact,
pi = 1); ``log_weights`` and ``positions`` cover every slot. The decode dequantizes the codes when it reads
the layer (:meth:`KVCertLayer.held`, ``kvcert.fast.quantized_decode``: the compiled CPU op's pass where the layer
fits it, else the torch path).

Models that mix layer types (Gemma 2 and 3: sliding-window layers beside
global ones) get one layer class per type, read off the config by
:func:`attention_layout`: full-attention layers are :class:`KVCertLayer` and
are compressed; sliding-window layers are :class:`SlidingWindowLayer`, never
compressed, holding what transformers' ``DynamicSlidingWindowLayer`` holds
(the last ``sliding_window - 1`` tokens) and attended exactly as the stock
model attends them (its sliding-window mask). Layer types kvcert cannot
treat correctly (chunked, linear or bidirectional attention) are refused
by name.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

__all__ = ["KVCertLayer", "KVCertCache", "SlidingWindowLayer", "as_kvcert_cache", "attention_layout",
           "cache_keyword", "compressed_layers"]


class KVCertLayer(DynamicLayer):
    """One layer of a compressible KV cache with inclusion probabilities.

    New tokens enter with pi = 1 (``log_weights`` 0). A compression replaces
    the slots with :meth:`replace`, whose ``log_weights`` compose over
    repeated events: a token kept with probability pi_1 at the first event and
    pi_2 at the second carries log pi_1 + log pi_2.
    """

    is_croppable = True
    #: whether eviction events apply to this layer (False for :class:`SlidingWindowLayer`)
    compressible = True

    def __init__(self, **kwargs):
        super().__init__()
        self.log_weights: torch.Tensor | None = None
        self.stat_dtype = torch.float32
        self.positions: torch.Tensor | None = None
        self.next_position: torch.Tensor | None = None
        self.cumulative_length = 0
        #: physical length before the last :meth:`update` (0 means that update was a prefill)
        self.length_before_update = 0
        #: eviction events so far (part of the seed of each event's design)
        self.events = 0
        #: decoded tokens since the last eviction event (decode-time compression)
        self.tokens_since_event = 0
        #: recent queries (b, h_q, w, d) for scorers at decode-time events, or None
        self.queries: torch.Tensor | None = None
        #: (b,) float64 budget of each row's prefill event (NaN: none), the target of later events
        self.budgets: torch.Tensor | None = None
        #: (b, h_kv, dv) centre mu of the cached trace (the mean kept value at the last eviction event)
        #: and (b, h_kv, m') ||v_i - mu||^2 of the first m' <= m slots (``hajek_attention``'s ``value_center`` /
        #: ``value_sqdist``; :meth:`value_moments` brings them up to date), or None before the first decode step
        self.value_center: torch.Tensor | None = None
        self.value_sqdist: torch.Tensor | None = None
        self._kept: torch.Tensor | None = None
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        #: the state :meth:`mark` saved (the compressed context of the query-agnostic protocol), or None
        self._mark: tuple | None = None
        #: tokens per block of a block eviction (the slots' sampling units are ``positions // block_size``),
        #: or None for the token design (the default; decoding then takes the token path unchanged)
        self.block_size: int | None = None
        #: (b, q) token ids of the prefill forward (slot j of the prefill holds token ``token_ids[:, j]``;
        #: left padding included), kept by the session for designs keyed by the prompt, or None
        self.token_ids: torch.Tensor | None = None
        #: ``kvcert.fast.ClusterSketch`` of the tokens the eviction event evicted, per row and KV head,
        #: when the press keeps one (``PoissonPress(sketch=...)``); decoding then certifies with V_cl
        self.sketch = None
        #: ``kvcert.fast.QuantizedKV`` of the first slots (a quantized prefill event, ``PoissonPress(kv_bits=8)``):
        #: their codes and scales; ``keys`` / ``values`` then hold the slots after them only. None otherwise
        self.quantized = None
        #: the ``kvcert.fast.TokenDesign`` that stored :attr:`quantized` (its certificate's rule), and (b,) bool:
        #: whether each row's event kept every token (nothing evicted: B_q caps the radius)
        self.quantized_design = None
        self.quantized_whole: torch.Tensor | None = None

    # -- transformers interface ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h = key_states.shape[0], key_states.shape[1]
        # log pi in float32 (float64 for a float64 model, so a float64 run stays an oracle)
        self.stat_dtype = torch.float64 if key_states.dtype == torch.float64 else torch.float32
        self.log_weights = torch.zeros(b, h, 0, dtype=self.stat_dtype, device=self.device)
        self.positions = torch.zeros(b, h, 0, dtype=torch.int64, device=self.device)
        self.next_position = torch.zeros(b, dtype=torch.int64, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens (pi = 1) and return all keys and values held.

        The first update (the prefill) keeps the given tensors. Later ones
        write into slots reserved past the held length (:meth:`_append`), so
        a decode step copies its own token, not the whole cache as
        ``torch.cat`` would.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q = key_states.shape[0], key_states.shape[1], key_states.shape[-2]
        self.length_before_update = self.physical_length
        if self.keys.numel() == 0 and self.quantized is None:
            self.keys, self.values = key_states, value_states
            self.positions = (self.next_position[:, None, None] + torch.arange(q, device=self.device)).expand(b, h, q).contiguous()
            self.log_weights = torch.zeros(b, h, q, dtype=self.stat_dtype, device=self.device)
            self._kept = None
        else:
            self.keys, dst = self._append("keys", q)
            dst.copy_(key_states)
            self.values, dst = self._append("values", q)
            dst.copy_(value_states)
            self.positions, dst = self._append("positions", q)
            if q == 1:  # a decode step: its position is the row's next one
                dst.copy_(self.next_position.view(b, 1, 1))
            else:
                torch.add(self.next_position[:, None, None].expand(b, h, 1), torch.arange(q, device=self.device),
                          out=dst)
            self.log_weights, dst = self._append("log_weights", q)
            dst.zero_()
            if self._kept is not None:
                self._kept = self._kept + q
        self.next_position = self.next_position + q
        self.cumulative_length += q
        return self.keys, self.values

    def _append(self, name: str, q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``q`` more tokens after ``self.<name>``: (the grown view, its new slots to fill).

        What ``torch.cat([self.<name>, new], dim=2)`` would give, without
        copying the held tokens: the tensor lives in a reserved buffer, reused
        while ``self.<name>`` is exactly the view this method returned last
        (any other assignment, by :meth:`replace`, :meth:`mark_padding`, a
        batch operation, makes a new one). The buffer grows by 1/16 of the
        length (at least 64 slots), so a decode step copies only its own
        token and the cache holds at most about 6 % spare slots.
        """
        cur = getattr(self, name)
        m = cur.shape[2]  # (b, h, m, d) and (b, h, m)
        buf, view = self._buffers.get(name, (None, None))
        if view is not cur or buf.shape[2] < m + q:
            shape = list(cur.shape)
            shape[2] = m + q + max(64, (m + q) // 16)
            buf = cur.new_empty(shape)
            buf[:, :, :m] = cur
        view = buf.narrow(2, 0, m + q)  # narrow: the same views as buf[:, :, ...], without the indexing machinery
        self._buffers[name] = (buf, view)
        return view, buf.narrow(2, m, q)

    def reserved_bytes(self) -> int:
        """Bytes held by this layer's tensors, spare reserved slots included."""
        seen, total = set(), 0
        for name in ("keys", "values", "log_weights", "positions", "value_sqdist", "value_center"):
            x = getattr(self, name, None)
            if x is None:
                continue
            base = self._buffers.get(name, (None, None))
            t = base[0] if base[1] is x else x
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total + (0 if self.quantized is None else self.quantized.nbytes)

    def get_seq_length(self) -> int:
        """Logical length: the number of tokens (padding included) the layer has seen."""
        return self.cumulative_length

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """Physical (kv_length, kv_offset) of a mask over the held slots plus the new tokens."""
        if isinstance(query_length, torch.Tensor):  # transformers < 5.3 passes cache_position
            query_length = query_length.shape[-1]
        return self.physical_length + int(query_length), 0

    def reset(self) -> None:
        # dropped, not zeroed (update grows by concatenation); not delegated, as transformers
        # versions differ in what DynamicLayer.reset keeps
        self.keys = self.values = None
        self.is_initialized = False
        self.log_weights = self.positions = self.next_position = self.queries = self.budgets = None
        self.value_center = self.value_sqdist = self._kept = self._mark = None
        self.block_size = self.token_ids = self.sketch = None
        self.quantized = self.quantized_design = self.quantized_whole = None
        self._buffers = {}
        self.cumulative_length = self.length_before_update = self.events = self.tokens_since_event = 0

    def offload(self):
        super().offload()
        if self.is_initialized:
            self.log_weights = self.log_weights.to("cpu", non_blocking=True)
            self.positions = self.positions.to("cpu", non_blocking=True)
            self._invalidate()

    def prefetch(self):
        super().prefetch()
        if self.is_initialized and self.log_weights.device != self.device:
            self.log_weights = self.log_weights.to(self.device, non_blocking=True)
            self.positions = self.positions.to(self.device, non_blocking=True)

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        self.keys, self.values = fn(self.keys), fn(self.values)
        self.log_weights, self.positions = fn(self.log_weights), fn(self.positions)
        self.next_position = fn(self.next_position)
        if self.value_center is not None:
            self.value_center, self.value_sqdist = fn(self.value_center), fn(self.value_sqdist)
        self._kept, self._buffers = None, {}
        if self.queries is not None:
            self.queries = fn(self.queries)
        if self.budgets is not None:
            self.budgets = fn(self.budgets)
        if self.token_ids is not None:
            self.token_ids = fn(self.token_ids)
        if self.sketch is not None:
            self.sketch = self.sketch.map(fn)
        if self.quantized is not None:
            self.quantized, self.quantized_whole = self.quantized.map(fn), fn(self.quantized_whole)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda x: x[indices, ...])

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens of every row (as ``DynamicLayer.crop``)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"tokens_to_remove must be <= 0 (the number of tokens to drop, negated), got {tokens_to_remove}"
            )
        k = -int(tokens_to_remove)
        if k == 0 or not self.is_initialized:
            return
        if k > self.cumulative_length:
            raise ValueError(f"cannot crop {k} tokens from a layer that has seen {self.cumulative_length}")
        self.next_position = (self.next_position - k).clamp_min(0)
        drop = self.positions >= self.next_position[:, None, None]
        self.log_weights = self.log_weights.masked_fill(drop, float("-inf"))
        self.positions = self.positions.masked_fill(drop, -1)
        self.cumulative_length -= k
        self._invalidate()
        self._trim()

    # -- kvcert interface ---------------------------------------------------------------
    @property
    def physical_length(self) -> int:
        """Number of slots held (padding slots included; a quantized layer's stored slots too)."""
        if self.quantized is not None:
            return self.log_weights.shape[-1]
        if not self.is_initialized or self.keys.numel() == 0:
            return 0
        return self.keys.shape[-2]

    @property
    def valid(self) -> torch.Tensor:
        """(b, h_kv, m) bool: slots that hold a token (log pi > -inf)."""
        return self.log_weights > float("-inf")

    @property
    def kept(self) -> torch.Tensor:
        """(b, h_kv) int64: tokens held per KV head (counted after each change, then kept up to date
        by :meth:`update`)."""
        if self._kept is None:
            self._kept = self.valid.sum(-1)
        return self._kept

    def value_moments(self, distances: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""The centre and squared distances of the cached trace, ``(value_center, value_sqdist)``.

        .. math:: \mu = \frac{1}{|S|}\sum_{i \in S} v_i, \qquad r_i = \lVert v_i - \mu \rVert^2,

        over the held tokens S of each KV head (:func:`kvcert.fast.value_moments`),
        computed from the cache on first use after an eviction event (mu stays
        that of the event); the distances of the tokens appended since are
        added when next asked for, so a decode step that reads only the centre
        (the compiled CPU op computes the distances in its own pass) pays
        nothing for them. Any centre gives the same trace in exact arithmetic;
        the mean kept value keeps the fp32 expansion of
        :func:`kvcert.fast.hajek_attention` well conditioned.

        Parameters
        ----------
        distances : bool
            False: ``(value_center, None)``, the distances not brought up to date.
        """
        held = self.physical_length
        if self.value_center is None or self.value_sqdist.shape[-1] > held:
            from .fast import value_moments

            self.value_center, self.value_sqdist = value_moments(self.values, log_pi=self.log_weights)
            self.value_center = self.value_center.to(self.stat_dtype)
            self.value_sqdist = self.value_sqdist.to(self.stat_dtype)
        if not distances:
            return self.value_center, None
        m = self.value_sqdist.shape[-1]
        if m < held:  # the tokens appended since (pi = 1; padding marked later invalidates): ||v_i - mu||^2
            self.value_sqdist, dst = self._append("value_sqdist", held - m)
            v = self.values[:, :, m:]
            v = v if v.dtype == self.stat_dtype else v.to(self.stat_dtype)
            torch.sum(torch.sub(v, self.value_center[:, :, None]).square_(), -1, out=dst)
        return self.value_center, self.value_sqdist

    def _invalidate(self) -> None:
        """After a change other than an append: moments and counts are recomputed on use, and the
        reserved buffers are released (the next append makes a new one)."""
        self.value_center = self.value_sqdist = self._kept = None
        self._buffers = {}

    @property
    def pi(self) -> torch.Tensor:
        """(b, h_kv, m) inclusion probabilities, 0 on padding."""
        return self.log_weights.exp()

    def mark_padding(self, real: torch.Tensor) -> None:
        """Mark which of the tokens of the last :meth:`update` are real.

        ``real`` (b, q) bool (True = a token, False = padding, as in the
        2-D attention mask). Padding gets log pi = -inf and position -1;
        the real tokens are renumbered so that positions count real tokens
        only (the RoPE positions ``generate`` uses with left padding).
        """
        q = self.physical_length - self.length_before_update
        if real.dim() != 2 or real.shape[0] != self.keys.shape[0] or real.shape[1] != q:
            raise ValueError(
                f"real must have shape (b, q) = ({self.keys.shape[0]}, {q}), got {tuple(real.shape)}"
            )
        real = real.to(device=self.device, dtype=torch.bool)
        if bool(real.all()):
            return
        start = self.next_position - q  # positions of the new tokens began here
        new_pos = start[:, None] + real.long().cumsum(-1) - 1
        new_pos = new_pos.masked_fill(~real, -1)
        pad = torch.zeros(real.shape[0], self.physical_length, dtype=torch.bool, device=self.device)
        pad[:, -q:] = ~real
        positions = self.positions.clone()
        positions[..., -q:] = new_pos[:, None, :]
        self.positions = positions
        self.log_weights = self.log_weights.masked_fill(pad[:, None, :], float("-inf"))
        # padding K/V are never read (log pi = -inf); zero them so they stay finite whatever the model put there
        tail = pad[:, pad.shape[1] - self.keys.shape[2]:]  # the slots keys/values hold (after a quantized prefix)
        self.keys = self.keys.masked_fill(tail[:, None, :, None], 0.0)
        self.values = self.values.masked_fill(tail[:, None, :, None], 0.0)
        self.next_position = start + real.sum(-1)
        self._invalidate()

    def replace(self, keys: torch.Tensor, values: torch.Tensor, log_weights: torch.Tensor,
                positions: torch.Tensor, sketch=None) -> None:
        """Install a compressed state (every tensor padded to a common length m), with the sketch of
        the evicted tokens if the design keeps one (:attr:`sketch`; None clears it)."""
        b, h, m = log_weights.shape
        if keys.shape[:3] != (b, h, m) or values.shape[:3] != (b, h, m) or positions.shape != (b, h, m):
            raise ValueError(
                f"keys, values, positions must share the leading shape (b, h_kv, m) = {(b, h, m)} of log_weights; "
                f"got {tuple(keys.shape)}, {tuple(values.shape)}, {tuple(positions.shape)}"
            )
        log_weights = log_weights.to(self.stat_dtype)
        if bool((torch.isnan(log_weights) | (log_weights > 0)).any()):  # once per event, not per step
            raise ValueError("log_weights must be log inclusion probabilities, <= 0 (-inf on padding), without NaN")
        self.keys, self.values = keys, values
        self.log_weights = log_weights
        self.positions = positions.to(torch.int64)
        self.sketch = sketch
        self.quantized = self.quantized_design = self.quantized_whole = None
        self._invalidate()
        self._trim()

    def install_quantized(self, stored, design, whole: torch.Tensor, sketch=None) -> None:
        """Install a quantized compressed state: ``stored`` (``kvcert.fast.QuantizedKV`` (b, h_kv, m, ...), every
        row padded to m) in place of keys and values, which then hold no slot until the next append; log pi
        and positions are the stored ones. ``design`` is the ``kvcert.fast.TokenDesign`` that stored them (its
        certificate rule, :meth:`kvcert.fast.TokenDesign.certify`), ``whole`` (b,) bool whether each row kept
        every token, ``sketch`` the evicted tokens' sketch or None."""
        b, h, m = stored.log_pi.shape
        whole = torch.as_tensor(whole, dtype=torch.bool, device=stored.log_pi.device).reshape(-1)
        if whole.shape[0] != b:
            raise ValueError(f"whole must have shape (b,) = ({b},), got {tuple(whole.shape)}")
        log_weights = stored.log_pi.to(self.stat_dtype)
        if bool((torch.isnan(log_weights) | (log_weights > 0)).any()):
            raise ValueError("stored: log_pi must be log inclusion probabilities, <= 0 (-inf on padding), without NaN")
        self.keys = self.keys.new_zeros(b, h, 0, self.keys.shape[-1])
        self.values = self.values.new_zeros(b, h, 0, self.values.shape[-1])
        self.log_weights, self.positions = log_weights, stored.positions.to(torch.int64)
        self.quantized, self.quantized_design, self.quantized_whole = stored, design, whole
        self.sketch = sketch
        self._invalidate()

    def held(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys (b, h_kv, m, d), values (b, h_kv, m, dv)) of every held slot in ``dtype`` (default the stored
        tensors'): a quantized layer's stored slots dequantized, then the exact ones."""
        if self.quantized is None:
            return (self.keys, self.values) if dtype is None else (self.keys.to(dtype), self.values.to(dtype))
        dt = self.keys.dtype if dtype is None else dtype
        k, v = self.quantized.dequantize(torch.float64 if dt == torch.float64 else torch.float32)
        return torch.cat([k.to(dt), self.keys.to(dt)], dim=2), torch.cat([v.to(dt), self.values.to(dt)], dim=2)

    def memory_elements(self) -> torch.Tensor:
        r"""(b, h_kv) float64: 16-bit elements each KV head holds, as ``kvcert.reference`` counts them
        (``quantized_memory_fraction`` times :math:`n\,(d + d_v)`): a quantized slot its codes, scales and
        log pi (``kvcert.fast.token_elements``; the ``"channel"`` layout's key scales per started group of 32),
        an exact slot :math:`d + d_v + 1`, a sketch its elements; without log pi when a row kept every token."""
        from .fast import CHANNEL_GROUP, token_elements

        d, dv = self.keys.shape[-1], self.values.shape[-1]
        kept = self.kept.to(torch.float64)
        if self.quantized is None:
            out = kept * (d + dv + 1)
        else:
            q = self.quantized
            kq = (self.log_weights[..., :q.log_pi.shape[-1]] > float("-inf")).sum(-1).to(torch.float64)
            per = token_elements(d, dv, q.kv_bits, layout=q.layout)
            if q.layout == "channel":  # d / G per token amortized -> d per started group
                per_q = kq * (per - d / CHANNEL_GROUP) + torch.ceil(kq / CHANNEL_GROUP) * d
            else:
                per_q = kq * per
            out = per_q + (kept - kq) * (d + dv + 1)
            out = torch.where(self.quantized_whole[:, None].to(out.device), out - kept, out)  # no log pi
        if self.sketch is not None:
            out = out + float(self.sketch.elements)
        return out

    # -- the compressed context, shared by several questions (query-agnostic protocol) ------------
    _MARKED = ("keys", "values", "log_weights", "positions", "next_position", "cumulative_length", "events",
               "tokens_since_event", "budgets", "queries", "block_size", "sketch", "quantized", "quantized_design",
               "quantized_whole")

    def mark(self) -> None:
        """Remember the current state, to come back to with :meth:`restore_mark`.

        The query-agnostic protocol marks each layer after the context's
        compression, then answers each question from the mark. Only references
        are kept, no copy: nothing writes into a held tensor in place
        (appends go to a fresh reserved buffer once the layer is restored, an
        eviction event installs new tensors), so the marked tensors stay as
        they were.
        """
        self._mark = tuple(getattr(self, name) for name in self._MARKED)

    def restore_mark(self) -> None:
        """Return to the state of the last :meth:`mark` (forget every token added since)."""
        if self._mark is None:
            raise RuntimeError("restore_mark: this layer was never marked")
        for name, value in zip(self._MARKED, self._mark):
            setattr(self, name, value)
        self.length_before_update = self.physical_length
        self._invalidate()

    @property
    def at_mark(self) -> bool:
        """Whether the layer holds exactly its marked state (no token added since, no outside change)."""
        m = self._mark
        return m is not None and self.keys is m[0] and self.values is m[1] and self.cumulative_length == m[5]

    def remember_queries(self, queries: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` queries (b, h_q, t, d) for decode-time scorers."""
        q = queries.detach()
        if self.queries is not None and self.queries.shape[:2] == q.shape[:2]:
            q = torch.cat([self.queries, q], dim=2)
        self.queries = q[:, :, -window:]

    def _trim(self) -> None:
        """Drop trailing slots that are padding in every row and head."""
        if self.physical_length == 0:
            return
        any_valid = self.valid.flatten(0, 1).any(0)
        idx = torch.nonzero(any_valid)
        m = int(idx[-1]) + 1 if idx.numel() else 0
        stored = 0 if self.quantized is None else self.quantized.log_pi.shape[-1]
        m = max(m, stored)  # a quantized layer's stored slots stay (their padding is the codes')
        if m < self.physical_length:
            self.keys, self.values = self.keys[..., :m - stored, :], self.values[..., :m - stored, :]
            self.log_weights, self.positions = self.log_weights[..., :m], self.positions[..., :m]
            if self.value_sqdist is not None:
                self.value_sqdist = self.value_sqdist[..., :m]


class SlidingWindowLayer(KVCertLayer):
    """A sliding-window attention layer under a press: never compressed, attended exactly.

    It holds what transformers' ``DynamicSlidingWindowLayer`` holds, the last
    ``sliding_window - 1`` tokens (an update returns those and the new ones,
    then forgets the oldest), and reports the same mask sizes, so the stock
    sliding-window mask fits it and the model attends over it exactly as
    without kvcert. Every slot has pi = 1 (``log_weights`` 0, -inf on
    padding), eviction events never apply (:attr:`compressible` is False)
    and no certificate is recorded for it. The per-slot bookkeeping of
    :class:`KVCertLayer` (positions, padding, :meth:`mark` /
    :meth:`restore_mark`, batch operations) is kept, so code that walks a
    cache's layers treats both kinds alike.

    Parameters
    ----------
    sliding_window : int >= 1
        The model's window: a query at position p attends the keys at
        positions p - sliding_window < j <= p.
    """

    is_sliding = True
    is_croppable = False
    compressible = False

    def __init__(self, sliding_window: int, **kwargs):
        super().__init__()
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")
        self.sliding_window = int(sliding_window)
        #: tokens appended by the last :meth:`update`
        self.last_update_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new tokens; return the held and the new ones; keep the last ``sliding_window - 1``."""
        keys, values = super().update(key_states, value_states)
        self.last_update_length = key_states.shape[-2]
        self._keep_last(self.sliding_window - 1)
        return keys, values

    def _keep_last(self, keep: int) -> None:
        m = self.physical_length
        if m <= keep:
            return
        start = m - keep
        self.keys, self.values = self.keys[:, :, start:], self.values[:, :, start:]
        self.log_weights, self.positions = self.log_weights[..., start:], self.positions[..., start:]
        self._invalidate()

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv_length, kv_offset) as ``DynamicSlidingWindowLayer`` reports them."""
        if isinstance(query_length, torch.Tensor):  # transformers < 5.3 passes cache_position
            query_length = query_length.shape[-1]
        q, w, seen = int(query_length), self.sliding_window, self.cumulative_length
        kv_offset = max(seen - w + 1, 0)
        return (w - 1 + q if seen >= w else seen + q), kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def mark_padding(self, real: torch.Tensor) -> None:
        """Mark which of the tokens of the last :meth:`update` are real (``real`` (b, q) bool), as
        :meth:`KVCertLayer.mark_padding` does, on the new tokens the window still holds. Keys and
        values are left as the model wrote them: the stock mask excludes padding."""
        q = self.last_update_length
        b = self.keys.shape[0]
        if real.dim() != 2 or real.shape[0] != b or real.shape[1] != q:
            raise ValueError(f"real must have shape (b, q) = ({b}, {q}), got {tuple(real.shape)}")
        real = real.to(device=self.device, dtype=torch.bool)
        if bool(real.all()):
            return
        start = self.next_position - q
        new_pos = (start[:, None] + real.long().cumsum(-1) - 1).masked_fill(~real, -1)
        held = min(q, self.physical_length)  # the new tokens still in the window: the last ones
        if held > 0:
            positions = self.positions.clone()
            positions[..., -held:] = new_pos[:, None, -held:]
            self.positions = positions
            pad = torch.zeros(b, self.physical_length, dtype=torch.bool, device=self.device)
            pad[:, -held:] = ~real[:, -held:]
            self.log_weights = self.log_weights.masked_fill(pad[:, None, :], float("-inf"))
        self.next_position = start + real.sum(-1)
        self._invalidate()

    def replace(self, *args, **kwargs) -> None:
        raise RuntimeError("kvcert: a sliding-window layer is never compressed (SlidingWindowLayer.replace)")

    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`KVCertLayer.crop` while the layer still holds every token it has seen; once the
        window has dropped tokens a crop cannot bring them back (as ``DynamicSlidingWindowLayer``)."""
        if tokens_to_remove < 0 and self.cumulative_length >= self.sliding_window:
            raise RuntimeError(
                f"cannot crop a sliding-window layer that has seen {self.cumulative_length} tokens, more than its "
                f"window of {self.sliding_window}: the tokens before the window are gone"
            )
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.last_update_length = 0


class KVCertCache(DynamicCache):
    """A ``DynamicCache`` whose layers are :class:`KVCertLayer` (and :class:`SlidingWindowLayer`).

    Pass it as ``cache=`` (``past_key_values=``) to a model or to ``generate``;
    the presses also convert a fresh ``DynamicCache`` in place
    (:func:`as_kvcert_cache`), so passing nothing works too.

    Parameters
    ----------
    config : transformers.PretrainedConfig, optional
        If given, one layer per decoder layer is created up front, by
        :func:`attention_layout`: a :class:`KVCertLayer` for each
        full-attention layer, a :class:`SlidingWindowLayer` for each
        sliding-window layer (configs with other layer types are refused);
        otherwise :class:`KVCertLayer` layers are added lazily.
    """

    def __init__(self, config=None):
        if config is None:
            Cache.__init__(self, layer_class_to_replicate=KVCertLayer)
            return
        Cache.__init__(self, layers=[_new_layer(w) for w in attention_layout(config)])


def _new_layer(window: int | None) -> KVCertLayer:
    return KVCertLayer() if window is None else SlidingWindowLayer(window)


#: layer types of ``config.layer_types`` that kvcert runs: compressed, and left exact
_SUPPORTED_TYPES = ("full_attention", "sliding_attention")


def attention_layout(config) -> list[int | None]:
    """Per decoder layer of a model: None for a full-attention layer (compressed under a press), or
    the window of a sliding-window layer (left exact).

    Read off ``layer_types`` of the text config, or, without it, off
    ``sliding_window`` / ``use_sliding_window`` (every layer sliding when a
    window is set). A press compresses the full-attention layers only, so
    its certificates cover those (``Certificates`` has one layer entry per
    compressed layer, in order: :func:`compressed_layers`).

    Raises
    ------
    ValueError
        A layer type other than full and sliding-window attention (chunked,
        linear, ...), bidirectional attention, or no full-attention layer at
        all: each named in the message.
    """
    text = config.get_text_config(decoder=True)
    n = int(text.num_hidden_layers)
    if getattr(text, "use_bidirectional_attention", False) or getattr(text, "is_causal", True) is False:
        raise ValueError("kvcert: this model uses bidirectional attention; kvcert certifies causal decoding only")
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not types:
        if window is not None and getattr(text, "use_sliding_window", True):
            types = ["sliding_attention"] * n
        elif getattr(text, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    types = list(types)[:n]
    other = sorted({t for t in types if t not in _SUPPORTED_TYPES})
    if other or len(types) < n:
        raise ValueError(
            f"kvcert compresses full-attention layers only and leaves sliding-window layers exact; this model has "
            f"layer types {other or sorted(set(types))} (chunked, linear or other attention layers are not "
            "supported)"
        )
    if "sliding_attention" in types and not window:
        raise ValueError("kvcert: the config has sliding_attention layers but no sliding_window")
    if "full_attention" not in types:
        raise ValueError(
            f"kvcert compresses full-attention layers only; every layer of this model is a sliding-window layer "
            f"(sliding_window={window}), so a press would remove nothing (a model whose window exceeds every "
            "sequence it runs can set config.sliding_window = None)"
        )
    return [None if t == "full_attention" else int(window) for t in types]


def cache_keyword(module) -> str:
    """The cache argument of a model's (or decoder's) ``forward``: ``"cache"`` where transformers names it so,
    else ``"past_key_values"`` (the name of transformers releases before the rename, and of most models)."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def compressed_layers(config) -> tuple[int, ...]:
    """Indices of the decoder layers a press compresses (the full-attention layers, in order): the
    model layer of each entry of the layer axis of recorded ``Certificates``."""
    return tuple(i for i, w in enumerate(attention_layout(config)) if w is None)


def as_kvcert_cache(cache: Cache, config=None) -> Cache:
    """Make every layer of ``cache`` a :class:`KVCertLayer` (or :class:`SlidingWindowLayer`), in place.

    Fresh ``DynamicLayer`` layers are replaced; layers that already hold
    tokens are converted with pi = 1 for every token (no padding known).
    With ``config``, each layer takes the type :func:`attention_layout`
    gives (a lazily filled cache gets all its layers at once), so the
    sliding-window layers of a model stay exact even in a cache made without
    the config; without it, transformers' ``DynamicSlidingWindowLayer`` layers
    become :class:`SlidingWindowLayer` and every other layer a
    :class:`KVCertLayer`. The same object is returned, so a caller that holds
    it (``generate``) keeps a valid reference.

    Raises
    ------
    TypeError
        ``cache`` is not a ``transformers.Cache``.
    ValueError
        A layer is not a plain dynamic full-attention or sliding-window layer
        (static, quantized, offloaded, linear attention), or a layer holding
        tokens has another type than the config gives it.
    """
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache, got {type(cache).__name__}")
    if getattr(cache, "offloading", False):
        raise ValueError("cache: offloaded caches are not supported by kvcert (use offloading=False)")
    layout = None if config is None else attention_layout(config)
    if cache.layer_class_to_replicate is not None and cache.layer_class_to_replicate is not KVCertLayer:
        if cache.layer_class_to_replicate is not DynamicLayer:
            raise ValueError(
                f"cache: layers of type {cache.layer_class_to_replicate.__name__} cannot carry inclusion "
                "probabilities; use a DynamicCache or kvcert.cache.KVCertCache"
            )
        cache.layer_class_to_replicate = KVCertLayer
    if layout is not None and cache.layer_class_to_replicate is not None:
        while len(cache.layers) < len(layout):  # every layer now, each of its own type
            cache.layers.append(_new_layer(layout[len(cache.layers)]))
    for i, layer in enumerate(cache.layers):
        want = layout[i] if layout is not None and i < len(layout) else None
        held = layer.is_initialized and layer.get_seq_length() > 0
        if isinstance(layer, KVCertLayer):
            if layout is None or (want is None) == layer.compressible:
                continue
            if held:
                kinds = ("full-attention", "sliding-window")
                raise ValueError(
                    f"cache: layer {i} holds tokens as a {kinds[not layer.compressible]} layer but the model's layer "
                    f"{i} is a {kinds[want is not None]} layer"
                )
            cache.layers[i] = _new_layer(want)
            continue
        if type(layer) is DynamicSlidingWindowLayer:
            if layout is not None and want is None:
                raise ValueError(f"cache: layer {i} is a sliding-window layer but the model's layer {i} is "
                                 "full attention")
            new = SlidingWindowLayer(int(layer.sliding_window))
        elif type(layer) is DynamicLayer:
            new = _new_layer(want)
        elif "Quantized" in type(layer).__name__:  # transformers' QuantizedCache (quanto, hqq, fp8) and the like
            raise ValueError(
                f"cache: layer {i} is a {type(layer).__name__}, quantized by another library: kvcert cannot read its "
                "scales, so the certificate could not bound its rounding; for a certified quantized cache use "
                "PoissonPress(kv_bits=8 or 4) on a DynamicCache (docs/quantized.md)"
            )
        else:
            raise ValueError(
                f"cache: layer {i} is a {type(layer).__name__}; kvcert supports dynamic full-attention and "
                "sliding-window layers only (DynamicCache or kvcert.cache.KVCertCache)"
            )
        if held:
            new.update(layer.keys, layer.values)
            shift = layer.get_seq_length() - new.cumulative_length  # tokens a sliding window already dropped
            if shift:
                new.positions = new.positions + shift
                new.next_position = new.next_position + shift
                new.cumulative_length += shift
        cache.layers[i] = new
    return cache

