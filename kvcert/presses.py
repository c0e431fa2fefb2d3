"""Presses: KV-cache compression policies for transformers models, kvpress style.

A press is a dataclass of hyperparameters (validated in ``__post_init__``)
used as a context manager around a model::

    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    with press(model):
        out = model.generate(**inputs, max_new_tokens=16)
    press.certificates          # per step x layer x query head (kvcert.records.Certificates)

Inside the context the model runs the ``"kvcert"`` attention function and a
:class:`~kvcert.cache.KVCertLayer` cache (:mod:`kvcert.attention`: the
context owns a :class:`~kvcert.attention.Session` that the attention function
calls); each layer is compressed right after its prefill (the prefill itself
is exact attention over the full prompt). Decoding attends over the kept
tokens with the Hajek correction -log pi and records a certificate per step,
layer and query head.

The family, as kvpress users know it:

- :class:`ScorerPress`: deterministic top-k eviction by a score. A new method
  writes only ``score(queries, keys, values, *, scale, layer, event)``. One
  press per registered scorer (``kvcert.fast.SCORERS``) is made here:
  :class:`SnapKVPress`, :class:`H2OPress`, :class:`TOVAPress`,
  :class:`KNormPress`, :class:`StreamingLLMPress`, :class:`RandomPress`,
  :class:`ExpectedAttentionPress`, ... pi = 1 on the kept tokens and 0 on the
  evicted ones: their recorded certificates are identically 0, which is
  exactly the impossibility the paper proves (a deterministic policy observes
  nothing of what it evicted), not a statement of zero error.
- :class:`PoissonPress`: the randomized design of the paper (every token has
  a known inclusion probability pi > 0, so the certificates are informative),
  with its importance from ``scorer=``: a registry name, a
  :class:`ScorerPress` instance, a kvpress score-based press (duck-typed on
  kvpress's ``score(module, hidden_states, keys, values, attentions,
  kwargs)``; docs/kvpress.md) or a callable.
- :class:`DecodingPress`: decode-time compression around any press
  (kvpress's ``DecodingPress(base_press, compression_interval, target_size)``).

The budget at an event with n tokens held (per batch row, padding excluded):
``target_size`` if given (capped at n), else ``n * (1 - compression_ratio)``
(kvpress's convention: the ratio is the fraction removed). PoissonPress keeps
that many tokens *in expectation*; the deterministic presses keep
``int(n * (1 - compression_ratio))`` exactly. The certainty set that fits
under the budget is :func:`kvcert.fast.design_sizes` (the one sizing rule,
also used by paper_repro).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from dataclasses import dataclass

import torch

from .fast import KINDS, SCORERS, ClusterDesign, ClusterSketch, design_sizes, window_tilt
from .fast.scorers import HEAD_POOLINGS, SNAPKV_POOLINGS, queries_needed, queries_read

__all__ = [
    "Press",
    "BasePress",
    "ScorerPress",
    "PoissonPress",
    "BlockPoissonPress",
    "BlockDecision",
    "DecodingPress",
    "PRESSES",
    "PRESS_CASES",
    "SCORER_NAMES",
    "make_scorer_press",
    "KVPRESS_NAMES",
]


# ---------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------
def _int(name: str, value, *, low: int = 0, optional: bool = False):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _real(name: str, value, lo: float, hi: float, *, lo_open=False, hi_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi and math.isfinite(value)):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def _kernel_size(value) -> int:
    value = _int("kernel_size", value, low=1)
    if value % 2 == 0:
        raise ValueError(f"kernel_size must be odd, got {value}")
    return value


#: scorer hyperparameters with a rule of their own: name -> (default, validator); any other
#: registered hyperparameter is an int >= 1
SCORER_PARAMS = {
    "observation_window": (32, lambda v: _int("observation_window", v, low=1)),
    "kernel_size": (7, _kernel_size),
    "seed": (0, lambda v: _int("seed", v)),
    "pooling": ("replicate", lambda v: _choice("pooling", v, SNAPKV_POOLINGS)),
    "head_pooling": ("group", lambda v: _choice("head_pooling", v, HEAD_POOLINGS)),
}


def _choice(name: str, value, choices: tuple) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _validate_params(press) -> None:
    names = set(SCORER_PARAMS).union(*(s.params for s in SCORERS.values()))
    own = {f.name for f in dataclasses.fields(press)}  # fields only: not a kvpress-name property
    for name in sorted(names & own):
        check = SCORER_PARAMS.get(name, (None, lambda v, n=name: _int(n, v, low=1)))[1]
        setattr(press, name, check(getattr(press, name)))


#: kvpress's names of kvcert press fields that mean the same (DESIGN.md section 9): kvpress's
#: ``window_size`` (SnapKV) is the *observation* window, kvcert's ``window`` the recent tokens kept
#: with certainty; kvpress's ``n_sink`` (StreamingLLM, ExpectedAttention) is kvcert's ``sinks``
KVPRESS_NAMES = {"window_size": "observation_window", "n_sink": "sinks"}


def _accept_kvpress_names(cls):
    """Let ``cls(...)`` take kvpress's names (:data:`KVPRESS_NAMES`) of the fields it has, as
    keyword aliases, and read them back as properties; the fields keep kvcert's names (repr,
    ``dataclasses.fields``, ``dataclasses.replace``). A name that is a field of its own (LagKV's
    ``n_sink``) stays that field."""
    own = {f.name for f in dataclasses.fields(cls)}
    aliases = {a: n for a, n in KVPRESS_NAMES.items() if n in own and a not in own}
    if not aliases:
        return cls
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        for alias, name in aliases.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"give {name} or its kvpress name {alias}, not both (got {name}="
                                    f"{kwargs[name]!r}, {alias}={kwargs[alias]!r})")
                kwargs[name] = kwargs.pop(alias)
        init(self, *args, **kwargs)

    sig = inspect.signature(init)
    extra = [inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY, default=None) for a in aliases]
    __init__.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])
    __init__.__doc__, __init__.__qualname__ = init.__doc__, f"{cls.__qualname__}.__init__"
    cls.__init__ = __init__
    for alias, name in aliases.items():
        setattr(cls, alias, property(lambda self, n=name: getattr(self, n),
                                     lambda self, value, n=name: setattr(self, n, value),
                                     doc=f"kvpress's name of ``{name}``."))
    return cls


# ---------------------------------------------------------------------------------------------
# the context manager and the result every press shares
# ---------------------------------------------------------------------------------------------
class _PressContext:
    """``with press(model):`` -- switch the model to kvcert attention and a compressible cache.

    The forward pre-hook sits on the decoder model (``model.base_model``, e.g.
    ``LlamaModel``), which every path calls with the cache: the causal LM's
    forward, ``model.generate``, and kvpress's pipeline, which prefills the
    context through ``model.model(...)`` without the LM head. On exit, a cache
    that holds tokens stays decodable with the Hajek estimate outside the
    context (:class:`kvcert.attention.Carrier`, in :attr:`carrier`): the
    query-agnostic protocol (kvpress's pipeline, :func:`kvcert.answer`)
    decodes the questions there.
    """

    def __init__(self, press, model):
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        self.press, self.model = press, model
        self._hook = None
        self._previous = None
        self._session = None
        #: the :class:`kvcert.attention.Carrier` of the compressed cache after exit, or None
        self.carrier = None

    def _decoder(self):
        """The module that receives the cache: the decoder model inside a causal LM (or the model)."""
        base = getattr(self.model, "base_model", None)
        return base if isinstance(base, torch.nn.Module) else self.model

    def __enter__(self):
        from . import attention as A
        from .cache import _check_full_attention

        model, config = self.model, self.model.config
        _check_full_attention(config)
        self._previous = config._attn_implementation
        decoder = self._decoder()
        params = inspect.signature(decoder.forward).parameters
        session = A.Session(self.press, A.resolve_base(self._previous), config,
                            "cache" if "cache" in params else "past_key_values")
        A.activate(session)
        self._session = self.press._session = session

        def pre_hook(module, args, kwargs):
            session.begin_forward(args, kwargs)
            return args, kwargs

        self._hook = decoder.register_forward_pre_hook(pre_hook, with_kwargs=True)
        try:
            model.set_attn_implementation(A.ATTENTION_NAME)
        except Exception:
            self.__exit__(None, None, None)
            raise
        return model

    def __exit__(self, *exc):
        from . import attention as A

        model = self.model
        config = model.config
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if config._attn_implementation == A.ATTENTION_NAME and self._previous != A.ATTENTION_NAME:
            try:
                model.set_attn_implementation(self._previous)
            except Exception:  # e.g. a FlashAttention model on a machine without it
                config._attn_implementation_internal = self._previous
        if self._session is not None:
            if exc[0] is None:  # the compressed cache stays decodable outside the context
                self.carrier = A.carry(self._session, self._decoder())
            A.deactivate(self._session)
        return False


class Press:
    """What every press shares: ``with press(model):`` and the certificates of the last run.

    The base of every kvcert press (:class:`BasePress`, :class:`DecodingPress`); the
    session (:class:`kvcert.attention.Session`) calls a press at its events through
    ``prefill_event``, ``decode_event``, ``queries_needed``, ``kind`` and ``delta``."""

    _session = None

    def __call__(self, model):
        """Context manager: ``with press(model): model.generate(...)``."""
        return _PressContext(self, model)

    @property
    def certificates(self):
        """Certificates recorded by the last sequence run under this press
        (:class:`kvcert.records.Certificates`, batched: (b, steps, layers, heads)),
        or None before any run."""
        return None if self._session is None else self._session.certificates

    def _compress_prefilled(self, cache, *, query_window) -> None:
        """The prefill event on a cache filled by :func:`kvcert.prefill` (inside this press's context)."""
        if self._session is None:
            raise RuntimeError("_compress_prefilled runs inside the press's context (with press(model))")
        self._session.prefill_recorded(cache, query_window)


# ---------------------------------------------------------------------------------------------
# the compression engine
# ---------------------------------------------------------------------------------------------
@dataclass
class BasePress(Press):
    r"""Common fields and the compression engine of every press that evicts.

    A subclass says how it scores (:meth:`_score`, :meth:`queries_needed`;
    called per row on its real tokens) and how it evicts a stack of rows,
    each as if alone (:meth:`_evict`); the engine handles the batch rows,
    padding, budgets and the cache.

    Parameters
    ----------
    compression_ratio : float in [0, 1)
        Fraction of the tokens removed at an event (kvpress's convention);
        the budget is :math:`B = n\,(1 - \text{ratio})`. 0 (default) keeps
        everything (the model then decodes through the Hajek estimator with
        pi = 1, i.e. exact attention, with zero certificates).
    target_size : int >= 1, optional
        A fixed budget instead of the ratio: the number of tokens per head
        kept after an event (``min(target_size, n)``). Give one of the two.
    sinks : int >= 0
        First tokens always kept (attention sinks).
    window : int >= 0
        Most recent tokens always kept (kvpress's SnapKV ``window_size`` is
        the *observation* window, ``observation_window`` here).
    delta : float in (0, 1)
        Miscoverage of the recorded certificates.
    kind : str
        Certificate kind recorded per step, layer and head, one of
        ``kvcert.fast.KINDS`` (default ``chebyshev``; ``chebyshev_ucb`` is the
        strict kind, a chi-square upper bound on the variance then
        Chebyshev, at the cost of a second pass over the kept tokens; see
        docs/theory.md).

    Notes
    -----
    When the budget is too small for the certainty set, the recent window
    shrinks first, then the sinks (:func:`kvcert.fast.design_sizes`).
    """

    compression_ratio: float = 0.0
    target_size: int | None = None
    sinks: int = 4
    window: int = 32
    delta: float = 0.05
    kind: str = "chebyshev"

    #: Poisson design (expected budget, top slice) or deterministic top-k (exact budget)
    _randomized = False

    def __post_init__(self):
        self.compression_ratio = _real("compression_ratio", self.compression_ratio, 0.0, 1.0, hi_open=True)
        self.target_size = _int("target_size", self.target_size, low=1, optional=True)
        if self.target_size is not None and self.compression_ratio > 0:
            raise ValueError(
                f"give compression_ratio or target_size, not both (got compression_ratio="
                f"{self.compression_ratio}, target_size={self.target_size})"
            )
        self.sinks = _int("sinks", self.sinks)
        self.window = _int("window", self.window)
        self.delta = _real("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        _validate_params(self)

    @property
    def compresses(self) -> bool:
        """Whether this press removes anything at the prefill event."""
        return self.compression_ratio > 0 or self.target_size is not None

    # -- what a subclass provides ----------------------------------------------------------------
    def _score(self, queries, keys, values, *, scale: float, layer: int, event: int) -> torch.Tensor:
        """(1, h_kv, n) importance of one row's tokens (all valid)."""
        raise NotImplementedError

    def _query_need(self) -> str:
        """Which prefill queries the scorer reads (``kvcert.fast.scorers.QUERY_NEEDS``)."""
        return "none"

    def queries_needed(self, n: int) -> int:
        """Prefill queries the scorer reads at the prefill event of n tokens."""
        return queries_needed(self._query_need(), n, self._observation_window())

    def _observation_window(self) -> int:
        return getattr(self, "observation_window", self.window) or 1

    def _evict(self, keys, values, importance, budget, *, sinks, window, top, valid, log_weights, positions,
               layer_idx, event, tilt=None, scale=None):
        """The eviction of R batch rows at once -> a ``kvcert.fast.CompressedCache``.

        keys/values (R, h_kv, m, d), importance (R, h_kv, m) (0 on padding), budget (R, h_kv)
        float64 expected kept counts, sinks/window ints, top (R, 1) int64 (each row's
        :func:`kvcert.fast.design_sizes` top), valid/log_weights/positions (R, h_kv, m) of the
        layer; tilt (R, h_kv, d) the tilt points of a tilted sketch (:meth:`_tilt`, else None) and
        scale the attention's. Row i must be evicted as if alone (a sequence's sample does not
        depend on its batch).
        """
        raise NotImplementedError

    def _tilt(self, queries: torch.Tensor, h_kv: int):
        """The tilt points (1, h_kv, d) of one row's tilted sketch from its prefill queries, or None (no
        tilted sketch: every press but a ``PoissonPress(sketch="tilted")``)."""
        return None

    # -- the events (called by the session) ------------------------------------------------------
    def prefill_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        self._compress(layer, layer_idx, queries, scale, prefill=True)

    def decode_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        """Nothing: decode-time compression is :class:`DecodingPress`'s."""

    # -- budgets --------------------------------------------------------------------------------
    def _budget(self, n: int) -> float:
        """Budget for n tokens: target_size (capped at n) or n (1 - ratio)."""
        if self.target_size is not None:
            return float(min(self.target_size, n))
        b = n * (1.0 - self.compression_ratio)
        return b if self._randomized else float(max(int(b), 1))

    def _sampled_budget(self, n: int, layer) -> float:
        """The expected kept count of a prefill event over n tokens: the budget (:meth:`_budget`), less
        the memory of a sketch of the evicted tokens where the design keeps one (:class:`PoissonPress`)."""
        return self._budget(n)

    def design_sizes(self, n: int):
        """The budget and certainty set of this press's prefill event over n tokens
        (:func:`kvcert.fast.design_sizes`)."""
        return self._sizes(self._budget(n))

    def _sizes(self, budget: float):
        return design_sizes(budget, sinks=self.sinks, window=self.window,
                            top_fraction=getattr(self, "top_fraction", 0.0), randomized=self._randomized)

    def _window_queries(self, queries: torch.Tensor, n: int) -> torch.Tensor:
        """The queries the scorer reads, of those given (every one for an all-query scorer
        at a prefill event, else the last ``observation_window``)."""
        return queries[:, :, -queries_read(self._query_need(), queries.shape[2], n, self._observation_window()):]

    def _prefill_importance(self, queries, keys, values, *, scale, layer_idx, event, row, tokens) -> torch.Tensor:
        """Importance (1, h_kv, n) of batch row ``row`` at a prefill event: keys/values are its n
        real tokens (``tokens``: their slots in the layer, None when the row has no padding)."""
        return self._score(self._window_queries(queries, keys.shape[2]), keys, values, scale=scale,
                           layer=layer_idx, event=event)

    def _row_importance(self, queries, keys, values, valid, scale, *, layer_idx, event) -> torch.Tensor:
        """Importance (1, h_kv, m) of one row of a cache with per-head padding (0 on padding)."""
        h_kv = keys.shape[1]
        g = queries.shape[1] // h_kv
        dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
        u = torch.zeros(valid.shape, dtype=dtype, device=keys.device)
        for h in range(h_kv):
            idx = valid[0, h].nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            qh = self._window_queries(queries[:, h * g:(h + 1) * g], idx.numel())
            uh = self._score(qh, keys[:, h:h + 1, idx], values[:, h:h + 1, idx], scale=scale,
                             layer=layer_idx, event=event)
            u[0, h, idx] = uh[0, 0].to(dtype)
        return u

    def _compress(self, layer, layer_idx: int, queries, scale: float, *, prefill: bool,
                  target: float | None = None) -> None:
        """One eviction event on every row of a layer (rows are independent designs).

        A prefill event compresses to this press's budget; a decode-time event
        (``prefill=False``) compresses back to ``target``, or to the row's
        prefill budget when ``target`` is None.

        Each row is scored on its own tokens (its padding dropped), then the
        rows that evict are evicted together, one :meth:`_evict` call per
        certainty-set shape (sinks, window), with per-row budgets and top
        counts: the same design per row as one call per row would give, in
        a few batched calls (issue 15).
        """
        if not prefill and getattr(self, "sketch", None) is not None:
            raise ValueError("sketch: a sketched PoissonPress evicts once per layer, at the prefill event; "
                             "decode-time compression (DecodingPress, streaming) would need the sketches of "
                             "several events merged, which kvcert does not do: use sketch=None there")
        event = layer.events
        layer.events += 1
        layer.tokens_since_event = 0
        if prefill and not self.compresses:
            return
        b = layer.keys.shape[0]
        valid_all = layer.valid
        n_slots = valid_all.shape[-1]
        h_kv = valid_all.shape[1]
        if prefill:
            layer.budgets = torch.full((b,), math.nan, dtype=torch.float64)
        plans = {}  # row -> (importance (1, h_kv, slots), budget (h_kv,), DesignSizes)
        rows = {}  # row -> its (keys, values, log_weights, positions) after the event
        sketches = {}  # row -> its ClusterSketch (1, h_kv, ...) when the design keeps one
        for r in range(b):
            sl = slice(r, r + 1)
            valid = valid_all[sl]
            if prefill:
                # every head holds the same tokens: score the row's real tokens in one scorer call
                idx = None if bool(valid.all()) else valid[0, 0].nonzero().squeeze(-1)
                n = n_slots if idx is None else idx.numel()
                budget = self._sampled_budget(n, layer) if n else 0.0
                layer.budgets[r] = budget
                if n == 0 or budget >= n:
                    rows[r] = _row_slots(layer, r, idx)
                    continue
                k, v, q_r = layer.keys[sl], layer.values[sl], queries[sl]
                if idx is not None:
                    k, v = k[:, :, idx], v[:, :, idx]
                    # the queries may be the last few of the prefill only (a shared kvcert.prefill)
                    offset = n_slots - queries.shape[2]
                    q_r = q_r[:, :, idx[idx >= offset] - offset]
                u = self._prefill_importance(q_r, k, v, scale=scale, layer_idx=layer_idx, event=event, row=r,
                                             tokens=idx)
                if idx is not None:  # back onto the layer's slots (0 on padding)
                    u = u.new_zeros((1, h_kv, n_slots)).index_copy_(-1, idx, u)
                plans[r] = (u, torch.full((h_kv,), float(budget), dtype=torch.float64), self._sizes(budget),
                            self._tilt(q_r, h_kv))
            else:
                row_target = target
                if row_target is None and layer.budgets is not None and not math.isnan(float(layer.budgets[r])):
                    row_target = float(layer.budgets[r])
                n_h = valid.sum(-1)  # (1, h)
                if row_target is None or int(n_h.max()) <= row_target:
                    rows[r] = _row_slots(layer, r, None)
                    continue
                budget = torch.clamp(n_h[0].to(torch.float64), max=float(row_target))
                seen = min(queries.shape[2], int(layer.next_position[r]))  # no left-padding queries
                u = self._row_importance(queries[sl][:, :, -seen:], layer.keys[sl], layer.values[sl], valid, scale,
                                         layer_idx=layer_idx, event=event)
                plans[r] = (u, budget, self._sizes(float(budget.max())), None)
        if not plans:
            return
        groups = {}
        for r, (_, _, sz, _) in plans.items():
            groups.setdefault((sz.sinks, sz.window), []).append(r)
        for (sinks, window), members in groups.items():
            sel = None if len(members) == b else torch.tensor(members, device=layer.keys.device)

            def pick(x, sel=sel):
                return x if sel is None else x.index_select(0, sel)

            u = torch.cat([plans[r][0] for r in members]).to(layer.keys.device)
            budget = torch.stack([plans[r][1] for r in members]).to(layer.keys.device)
            top = torch.tensor([[plans[r][2].top] for r in members], device=layer.keys.device)
            tilt = None if plans[members[0]][3] is None else torch.cat([plans[r][3] for r in members])
            cc = self._evict(pick(layer.keys), pick(layer.values), u, budget, sinks=sinks, window=window, top=top,
                             valid=pick(valid_all), log_weights=pick(layer.log_weights),
                             positions=pick(layer.positions), layer_idx=layer_idx, event=event, tilt=tilt,
                             scale=scale)
            if sel is None and len(groups) == 1:
                layer.replace(cc.keys, cc.values, torch.log(cc.pi), cc.positions, cc.sketch)
                return
            for i, r in enumerate(members):
                rows[r] = (cc.keys[i:i + 1], cc.values[i:i + 1], torch.log(cc.pi[i:i + 1]), cc.positions[i:i + 1])
                if cc.sketch is not None:
                    sketches[r] = cc.sketch.map(lambda x, i=i: x[i:i + 1])
        sketch = None
        if sketches:  # a row that evicted nothing has an empty sketch (count 0: no term)
            blank = next(iter(sketches.values())).map(torch.zeros_like)
            sketch = ClusterSketch.cat([sketches.get(r, blank) for r in range(b)])
        layer.replace(*_pad_rows([rows[r] for r in range(b)]), sketch)


def _row_slots(layer, r: int, idx):
    """Row r of a layer as (keys, values, log_weights, positions), its slots ``idx`` only if given."""
    out = (layer.keys[r:r + 1], layer.values[r:r + 1], layer.log_weights[r:r + 1], layer.positions[r:r + 1])
    return out if idx is None else tuple(x[:, :, idx] for x in out)


def _pad_rows(rows):
    """Stack per-row (keys, values, log_weights, positions) padded to a common length."""
    m = max(r[0].shape[2] for r in rows)
    out = [[], [], [], []]
    for k, v, lw, pos in rows:
        p = m - k.shape[2]
        if p:
            k = torch.nn.functional.pad(k, (0, 0, 0, p))
            v = torch.nn.functional.pad(v, (0, 0, 0, p))
            lw = torch.nn.functional.pad(lw, (0, p), value=float("-inf"))
            pos = torch.nn.functional.pad(pos, (0, p), value=-1)
        for j, x in enumerate((k, v, lw, pos)):
            out[j].append(x)
    return tuple(torch.cat(x, dim=0) for x in out)


# ---------------------------------------------------------------------------------------------
# deterministic presses: top-k by a score
# ---------------------------------------------------------------------------------------------
@dataclass
class ScorerPress(BasePress):
    """Deterministic eviction by a score: keep the sinks, the window and the
    highest-scoring tokens, exactly the budget. pi = 1 on kept tokens, so the
    certificates are 0 (uninformative; the paper's impossibility).

    A new method subclasses it and writes only :meth:`score` (and, if it
    reads prefill queries, sets ``query_need`` to ``"window"`` or ``"all"``);
    an instance can also serve as ``PoissonPress(scorer=...)``.
    """

    #: which prefill queries :meth:`score` reads: "window" (the last observation_window), "all", "none"
    query_need = "window"

    def score(self, queries, keys, values, *, scale: float, layer: int = 0, event: int = 0) -> torch.Tensor:
        """Importance (b, h_kv, n) of the tokens (higher = keep); queries (b, h_q, w, d)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(queries, keys, values, *, scale, "
                                  "layer, event)")

    def _query_need(self) -> str:
        return self.query_need

    def _score(self, queries, keys, values, *, scale, layer, event):
        return self.score(queries, keys, values, scale=scale, layer=layer, event=event)

    def _evict(self, keys, values, importance, budget, *, sinks, window, top, valid, log_weights, positions,
               layer_idx, event, tilt=None, scale=None):
        from . import fast

        # one kept count per row: its smallest budget, at most its smallest head
        k = torch.minimum(budget.amin(-1).floor().to(torch.int64), valid.sum(-1).amin(-1))
        return fast.topk_evict(keys, values, importance, k[:, None], sinks=sinks, window=window,
                               pi=log_weights.exp(), positions=positions)


def _scorer_params(press, scorer) -> dict:
    """The registered scorer's hyperparameters that ``press`` sets (fields of the same name; a
    kvpress-name property such as ``n_sink`` -> ``sinks`` is not one)."""
    own = {f.name for f in dataclasses.fields(press)}
    return {p: getattr(press, p) for p in scorer.params if p in own}


class _RegistryScorer:
    """``score`` of a press made from a ``kvcert.fast.SCORERS`` entry (see :func:`make_scorer_press`)."""

    scorer_name = ""

    @property
    def query_need(self):
        return SCORERS[self.scorer_name].queries

    def score(self, queries, keys, values, *, scale, layer=0, event=0):
        scorer = SCORERS[self.scorer_name]
        return scorer(queries, keys, values, scale=scale, layer=layer, event=event,
                      **_scorer_params(self, scorer))


def make_scorer_press(name: str) -> type:
    """The deterministic press class of the registered scorer ``name``: a :class:`ScorerPress`
    whose fields are :class:`BasePress`'s, ``observation_window`` if the scorer reads a query
    window, and the scorer's ``params`` (with their registry defaults)."""
    scorer = SCORERS[name]
    names = (["observation_window"] if scorer.queries == "window" else []) + list(scorer.params)
    defaults = {"observation_window": SCORER_PARAMS["observation_window"][0], **scorer.params}
    fields = [(p, type(defaults[p]), dataclasses.field(default=defaults[p])) for p in names]
    doc = (f"Deterministic {scorer.summary} Keeps the sinks, the window and the top of the score "
           f"(scorer ``{name}``, :data:`kvcert.fast.SCORERS`); pi = 1 on kept tokens: certificates "
           "are 0 (uninformative).")
    cls = dataclasses.make_dataclass(scorer.press, fields, bases=(_RegistryScorer, ScorerPress),
                                     namespace={"scorer_name": name, "__doc__": doc})
    cls.__module__ = __name__
    return _accept_kvpress_names(cls)


# ---------------------------------------------------------------------------------------------
# the randomized design
# ---------------------------------------------------------------------------------------------
@dataclass
class PoissonPress(BasePress):
    r"""Randomized eviction with known inclusion probabilities (the paper's design).

    At each event, per layer, batch row and KV head: the first ``sinks``
    tokens, the last ``window`` tokens and the ``top`` most important others
    are kept with certainty (pi = 1), where
    :math:`\text{top} = \lfloor \text{top\_fraction}\,(B - \text{sinks} - \text{window})\rfloor`
    (:func:`kvcert.fast.design_sizes`); every other token is kept
    independently with

    .. math:: \pi_i = \min(1, \lambda u'_i), \qquad
              u'_i = (1-\alpha)\frac{u_i}{\sum_{T} u_j} + \frac{\alpha}{|T|},

    :math:`\alpha` = ``floor``, :math:`\lambda` solved so that
    :math:`\sum_i \pi_i = B` (the budget, an expected count). Decoding then
    uses the Hajek estimate with logit offset :math:`-\log\pi_i` and records
    its certificate (:mod:`kvcert.attention`). Repeated events compose: a
    token's pi is the product over the events it survived.

    Parameters
    ----------
    compression_ratio, target_size, sinks, window, delta, kind
        See :class:`BasePress`. Defaults: sinks 4, window 32 (the last 32
        tokens), delta 0.05, kind ``chebyshev``.
    top_fraction : float in [0, 1)
        Share of the free budget B - sinks - window kept deterministically
        by importance (default 0.5); the rest of the budget is sampled.
    floor : float in (0, 1]
        Defensive mixture weight alpha (default 0.1): every tail token has
        pi >= alpha B_tail / |T| > 0.
    scorer : str, ScorerPress, kvpress ScorerPress or callable
        Importance u (default ``"snapkv"``: attention of the last
        ``observation_window`` prefill queries, GQA-pooled, smoothed with
        ``kernel_size``). A name of ``kvcert.fast.SCORERS``; or a
        :class:`ScorerPress` instance (its ``score`` and its own
        hyperparameters); or any object with kvpress's
        ``score(module, hidden_states, keys, values, attentions, kwargs)
        -> (batch, kv_heads, seq)``, e.g. a kvpress ``ScorerPress``
        (duck-typed: kvcert never imports kvpress; see Notes); or a callable
        ``fn(queries, keys, values, *, scale, layer, event) -> (b, h_kv, n)``
        reading the last ``observation_window`` queries. Negative scores
        (``knorm``, ``keydiff``) are shifted to >= 0 per head; NaN or inf
        scores raise ``ValueError``.
    seed : int >= 0
        Seed of the sampling streams, one per (layer, KV head, event) and
        indexed by token position (:mod:`kvcert.fast.design`; every batch row
        draws from the stream of row 0, ``row_streams=False``): the same seed
        replays the same draws, and a sequence draws the same sample alone or
        in a batch.
    observation_window : int >= 1
        Queries the query-based scorers look at (default 32). kvpress's name
        ``window_size`` is accepted for it (``PoissonPress(window_size=64)``),
        and ``n_sink`` for ``sinks`` (docs/kvpress.md).
    kernel_size : odd int >= 1
        SnapKV pooling width (default 7).
    sketch : None, ``"cluster"`` or a ``kvcert.fast.ClusterDesign``
        Keep a sketch of the evicted tokens (issue 14's cluster design,
        docs/theory.md section 8): per layer, row and KV head, the
        w-weighted mean and per-channel variance of the evicted keys in each
        of C k-means clusters, with :math:`W_c, Y_c, N_c` and the value
        centre, and the evicted values' largest distance to it (the hull
        bound's part), C (2d + 3) + dv + 1 elements. **At equal memory**: the event
        samples :math:`B - (C(2d+3)+d_v+1)/(d+d_v+1)` expected tokens instead
        of B (the top slice re-sized at that budget), so kept tokens plus
        sketch hold what the pure design's B tokens hold. Decoding then
        records Chebyshev on the hybrid variance, capped at the deterministic
        hull bound H (``kvcert.reference.sketch.hull_bound``):
        :math:`\lVert\hat o - o\rVert_2 \le \min(\sqrt{V_{\mathrm{cl}}/\delta}, H)`
        (``Certificates.trace`` holds :math:`\min(V_{\mathrm{cl}}, \delta H^2)`): kept tokens
        exact, evicted ones through the sketch's Gaussian moments. Opt-in and
        empirical (it covers on the real model's replay cells but is
        13-21x the RMS error there; docs/research/issue14/RESULTS_T2.md).
        ``"cluster"`` is ``ClusterDesign(radius="chebyshev")`` (16 clusters);
        ``"tilted"`` is ``ClusterDesign(clusters=8, radius="chebyshev",
        tilt=True)``: the moments are tilted at the mean of the last
        ``observation_window`` prefill queries of each KV head's query group
        (:func:`kvcert.fast.window_tilt`), C (4d + 4) + d + dv + 1 elements (2,209
        at d = dv = 64, the 16-cluster design's 2,161), and the decode's
        Gaussian step is taken in q - q0 (docs/theory.md section 8, fifth
        slice). Both need ``kind="chebyshev"``, a design whose ``radius`` is
        ``"chebyshev"`` and one eviction event per layer (no DecodingPress).

    Notes
    -----
    A kvpress scorer is called once per layer, batch row and prefill event,
    right after the layer's exact prefill, with what kvpress's forward hook
    gives it: the attention module, the module's input ``hidden_states``
    (1, n, hidden) and its forward keyword arguments (``position_embeddings``
    ...), the row's cached keys and values (1, h_kv, n, d), and
    ``attentions=None`` (the scorer recomputes what it needs, as kvpress
    does under sdpa). A padded row passes its n real tokens only (the
    hidden states and position embeddings sliced alike, ``attention_mask``
    None). Inside ``with press(model):`` the press hooks each attention
    module's forward to see those inputs; like kvpress it sets the module's
    ``rotary_emb`` when missing and calls the scorer's
    ``post_init_from_model(model)`` if it has one. The scorer's own
    ``compression_ratio`` is not used (the budget is this press's), except
    by a ``score`` that reads it (kvpress's ``StreamingLLMPress``). A
    kvpress scorer scores prefills only: not under :class:`DecodingPress`,
    nor from a shared :func:`kvcert.prefill` (neither keeps the hidden
    states).

    Examples
    --------
    >>> import kvcert
    >>> press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    >>> press.kind, press.window, press.top_fraction
    ('chebyshev', 32, 0.5)
    """

    top_fraction: float = 0.5
    floor: float = 0.1
    scorer: object = "snapkv"
    seed: int = 0
    observation_window: int = 32
    kernel_size: int = 7
    sketch: object = None

    _randomized = True

    def __post_init__(self):
        super().__post_init__()
        self.top_fraction = _real("top_fraction", self.top_fraction, 0.0, 1.0, hi_open=True)
        self.floor = _real("floor", self.floor, 0.0, 1.0, lo_open=True)
        s = self.scorer
        if isinstance(s, str):
            if s not in SCORERS:
                raise ValueError(f"scorer must be one of {tuple(SCORERS)}, a ScorerPress or a callable, got {s!r}")
        elif not isinstance(s, ScorerPress) and not _is_kvpress_scorer(s) and not callable(s):
            raise TypeError(f"scorer must be a registry name {tuple(SCORERS)}, a ScorerPress instance (kvcert's, "
                            f"or kvpress's: an object with score(module, hidden_states, keys, values, attentions, "
                            f"kwargs)) or a callable, got {type(s).__name__}")
        self._layer_inputs = {}  # layer -> (attention module, its forward kwargs) of the forward under way
        self.sketch = _sketch_design(self.sketch, self.kind)

    @property
    def _external(self) -> bool:
        """The importance comes from a kvpress-style ``score(module, hidden_states, ...)``."""
        return not isinstance(self.scorer, (str, ScorerPress)) and _is_kvpress_scorer(self.scorer)

    def __call__(self, model):
        """Context manager: ``with press(model):``; with a kvpress scorer it also hooks the
        attention modules to hand their inputs (module, hidden states, kwargs) to ``score``."""
        context = super().__call__(model)
        return _KvpressInputs(self, model, context) if self._external else context

    def _query_need(self) -> str:
        s = self.scorer
        if isinstance(s, str):
            return SCORERS[s].queries
        if isinstance(s, ScorerPress):
            return s.query_need
        return "none" if self._external else "window"  # a kvpress scorer makes its own queries

    def _observation_window(self) -> int:
        s = self.scorer
        return s._observation_window() if isinstance(s, ScorerPress) else self.observation_window

    def _score(self, queries, keys, values, *, scale, layer, event):
        s = self.scorer
        if isinstance(s, str):
            return SCORERS[s](queries, keys, values, scale=scale, layer=layer, event=event,
                              **_scorer_params(self, SCORERS[s]))
        if isinstance(s, ScorerPress):
            return s.score(queries, keys, values, scale=scale, layer=layer, event=event)
        if self._external:
            raise ValueError(f"scorer: {type(s).__name__}.score(module, hidden_states, keys, values, attentions, "
                             "kwargs) reads a layer's hidden states, which only a prefill event under "
                             "`with press(model):` gives (not a decode-time event)")
        u = s(queries, keys, values, scale=scale, layer=layer, event=event)
        return _checked_scores(u, keys, "scorer(queries, keys, values, *, scale, layer, event)", layer)

    def _prefill_importance(self, queries, keys, values, *, scale, layer_idx, event, row, tokens):
        if not self._external:
            return super()._prefill_importance(queries, keys, values, scale=scale, layer_idx=layer_idx,
                                               event=event, row=row, tokens=tokens)
        s = self.scorer
        name = f"{type(s).__name__}.score(module, hidden_states, keys, values, attentions, kwargs)"
        entry = self._layer_inputs.get(layer_idx)
        if entry is None:
            raise ValueError(
                f"scorer: {name} needs layer {layer_idx}'s attention inputs (module, hidden_states, kwargs), "
                "which only a prefill forward under `with press(model):` gives; a cache filled by "
                "kvcert.prefill does not keep them: call generate without prefilled="
            )
        module, kwargs = entry
        kw = dict(kwargs)
        kw["hidden_states"] = _row_slice(kwargs["hidden_states"], row, tokens)
        pe = kwargs.get("position_embeddings")
        if isinstance(pe, (tuple, list)):
            kw["position_embeddings"] = tuple(_row_slice(t, row, tokens) for t in pe)
        if tokens is not None:
            kw["attention_mask"] = None  # the padding is gone; the row is one causal sequence
        hidden = kw["hidden_states"]
        if hidden.shape[1] != keys.shape[2]:
            raise ValueError(f"scorer: layer {layer_idx}'s hidden_states hold {hidden.shape[1]} tokens but its cache "
                             f"{keys.shape[2]}: a kvpress scorer needs the whole sequence in one prefill forward")
        u = s.score(module, hidden, keys, values, None, kw)
        return _checked_scores(u, keys, name, layer_idx)

    def inclusion_probabilities(self, importance: torch.Tensor, n: int | None = None) -> torch.Tensor:
        """pi (..., n) this press's prefill event gives to tokens of this importance
        (every slot valid): :func:`kvcert.fast.inclusion_probabilities` with the
        press's budget and :func:`kvcert.fast.design_sizes`."""
        from . import fast

        sizes = self.design_sizes(importance.shape[-1] if n is None else n)
        return fast.inclusion_probabilities(_shifted(importance.to(torch.float64)), sizes.budget,
                                            sinks=sizes.sinks, window=sizes.window, top=sizes.top,
                                            floor=self.floor)

    def _sampled_budget(self, n: int, layer) -> float:
        r"""The budget B, less the sketch's memory in kept tokens,
        ``ClusterDesign.tokens``: :math:`(C(2d+3)+d_v+1)/(d+d_v+1)`, tilted :math:`(C(4d+4)+d+d_v+1)/(d+d_v+1)`
        (a kept token holds its key, value and log pi)."""
        budget = self._budget(n)
        if self.sketch is None or budget >= n:
            return budget
        d, dv = layer.keys.shape[-1], layer.values.shape[-1]
        held = self.sketch.tokens(d, dv)
        if budget - held < 1.0:
            raise ValueError(f"sketch: {self.sketch.clusters} clusters hold {held:.1f} tokens' worth of memory per "
                             f"head (d = {d}, dv = {dv}), which leaves less than one token of the budget "
                             f"{budget:.1f} of this {n}-token prefill; use fewer clusters or a larger budget")
        return budget - held

    def _evict(self, keys, values, importance, budget, *, sinks, window, top, valid, log_weights, positions,
               layer_idx, event, tilt=None, scale=None):
        from . import fast

        u = _shifted(importance.to(torch.float64), valid)
        return fast.evict(keys, values, u, budget, sinks=sinks, window=window, top=top, floor=self.floor,
                          seed=self.seed, layer=layer_idx, event=event, pi=log_weights.exp(), positions=positions,
                          row_streams=False, sketch=self.sketch, tilt=tilt, scale=scale)

    def _tilt(self, queries: torch.Tensor, h_kv: int):
        """A tilted sketch's tilt points: the mean of the last ``observation_window`` prefill queries
        over each KV head's query group (:func:`kvcert.fast.window_tilt`)."""
        if self.sketch is None or not self.sketch.tilt:
            return None
        if queries.shape[2] == 0:
            raise ValueError("sketch: a tilted sketch needs the prefill's observation-window queries, and this "
                             "prefill kept none (a shared kvcert.prefill made for a scorer that reads no query)")
        return window_tilt(queries, h_kv, window=self._observation_window())

    def queries_needed(self, n: int) -> int:
        """Prefill queries the scorer reads, and at least the observation window with a tilted sketch."""
        need = super().queries_needed(n)
        if self.sketch is not None and self.sketch.tilt:
            need = max(need, min(self._observation_window(), n))
        return need


#: ``PoissonPress(sketch=name)``: ``"cluster"`` (16 clusters, moments at q = 0) and ``"tilted"`` (8 clusters,
#: moments tilted at the observation window's mean query; about the same memory), both recorded as Chebyshev
SKETCHES = {"cluster": ClusterDesign(radius="chebyshev"),
            "tilted": ClusterDesign(clusters=8, radius="chebyshev", tilt=True)}


def _sketch_design(sketch, kind: str):
    """PoissonPress's ``sketch=``: None, a name of :data:`SKETCHES` or a ClusterDesign-like object -> None or a
    ``kvcert.fast.ClusterDesign`` whose radius rule is the recorded kind's (Chebyshev)."""
    from .fast.sketch import _as_design

    if sketch is None:
        return None
    if isinstance(sketch, str):
        if sketch not in SKETCHES:
            raise ValueError(f"sketch must be None, one of {tuple(SKETCHES)} or a kvcert.fast.ClusterDesign, "
                             f"got {sketch!r}")
        sketch = SKETCHES[sketch]
    elif isinstance(sketch, bool) or not hasattr(sketch, "clusters"):
        raise TypeError(f"sketch must be None, one of {tuple(SKETCHES)} or a kvcert.fast.ClusterDesign, "
                        f"got {type(sketch).__name__}")
    design = _as_design(sketch)
    if kind != "chebyshev" or design.radius != "chebyshev":
        raise ValueError(f"sketch: a sketched PoissonPress records Chebyshev on the hybrid variance, "
                         f"sqrt(V_cl / delta); it needs kind='chebyshev' and a design with radius='chebyshev' "
                         f"(got kind={kind!r}, radius={design.radius!r})")
    return design


_accept_kvpress_names(PoissonPress)


# ---------------------------------------------------------------------------------------------
# the block (cluster) design: whole blocks, one sample per sequence for every layer and head
# ---------------------------------------------------------------------------------------------
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
        from .fast import BLOCK_REDUCTIONS

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
        from .fast import block_budget

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
        from .fast import snapkv_scores

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
        from .fast import block_compact, block_importance, block_inclusion_probabilities, block_sample, prompt_event

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


def _shifted(u: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Importance >= 0 on the valid slots (0 on the others): a head with a negative
    score (e.g. knorm's -||k||) is shifted by its minimum; other heads are left as they are."""
    if valid is None:
        valid = torch.ones_like(u, dtype=torch.bool)
    u = u.masked_fill(~valid, 0.0)
    low = u.masked_fill(~valid, math.inf).amin(-1, keepdim=True)
    neg = low < 0
    if bool(neg.any()):
        u = torch.where(neg, u - low, u).masked_fill(~valid, 0.0)
    return u


_KVPRESS_SCORE = ("module", "hidden_states", "keys", "values", "attentions", "kwargs")


def _is_kvpress_scorer(s) -> bool:
    """Whether ``s`` is a kvpress-style scorer: ``s.score(module, hidden_states, keys, values,
    attentions, kwargs)``. Raises ``TypeError`` for a kvpress press without ``score`` (it has
    ``compress``/``forward_hook`` only) and for a ``score`` of another signature."""
    score = getattr(s, "score", None)
    if score is None:
        if hasattr(s, "compress") and hasattr(s, "forward_hook"):
            raise TypeError(
                f"scorer: {type(s).__module__}.{type(s).__name__} has no score(module, hidden_states, keys, values, "
                "attentions, kwargs); only a score-based press (a kvpress ScorerPress, e.g. SnapKVPress, "
                "ExpectedAttentionPress, KeyDiffPress, TOVAPress, KnormPress) gives an importance"
            )
        return False
    if not callable(score):
        raise TypeError(f"scorer: {type(s).__name__}.score must be a method, got {type(score).__name__}")
    try:
        sig = inspect.signature(score)
    except (TypeError, ValueError):  # no signature to read (a builtin): take it on trust
        return True
    try:
        sig.bind(*_KVPRESS_SCORE)
    except TypeError:
        raise TypeError(
            f"scorer: {type(s).__name__}.score must take (module, hidden_states, keys, values, attentions, kwargs) "
            f"and return (batch, kv_heads, seq) scores, as kvpress's ScorerPress.score; its signature is "
            f"score{sig}"
        ) from None
    return True


def _checked_scores(u, keys: torch.Tensor, name: str, layer: int) -> torch.Tensor:
    """The scores of a user scorer, checked: a tensor of the keys' (batch, kv_heads, seq), finite."""
    want = tuple(keys.shape[:3])
    if not isinstance(u, torch.Tensor) or tuple(u.shape) != want:
        got = tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__
        raise ValueError(f"scorer must return a tensor of shape (b, h_kv, n) = (batch, kv_heads, seq) = {want}: "
                         f"{name} returned {got}")
    if not u.is_floating_point():
        u = u.to(torch.float32)
    if not bool(torch.isfinite(u).all()):
        bad = int((~torch.isfinite(u)).sum())
        raise ValueError(f"scorer: {name} returned {bad} NaN or inf scores of {u.numel()} at layer {layer} "
                         f"(shape (batch, kv_heads, seq) = {want}); scores must be finite")
    return u


def _row_slice(t, row: int, tokens):
    """Batch row ``row`` of a (b, n, ...) tensor (a batch of one is shared), its ``tokens`` only."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t[row:row + 1] if t.shape[0] > 1 else t
    return t if tokens is None else t[:, tokens.to(t.device)]


def _attention_modules(model) -> list:
    """The attention modules of a transformers model: kvpress's ``model.model(.language_model).layers[i]
    .self_attn``, else every submodule named ``...self_attn`` with a ``layer_idx``."""
    base = getattr(model, "model", None)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None)
    if layers is not None and all(hasattr(layer, "self_attn") for layer in layers):
        return [layer.self_attn for layer in layers]
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


class _KvpressInputs:
    """The context of a PoissonPress with a kvpress scorer: the press's own context, plus forward
    hooks on every attention module that keep its inputs (module, kwargs with ``hidden_states``)
    while the module runs, for the prefill event (kvpress's scorers read them)."""

    def __init__(self, press, model, context):
        self.press, self.model, self.context = press, model, context
        self._hooks, self._rotary = [], []

    def __getattr__(self, name):  # anything else the press's own context offers
        context = self.__dict__.get("context")
        if context is None:
            raise AttributeError(name)
        return getattr(context, name)

    def __enter__(self):
        press, model = self.press, self.model
        modules = _attention_modules(model)
        if not modules:
            raise ValueError(f"scorer: found no attention modules (layers[i].self_attn) in {type(model).__name__} "
                             "to read the hidden states a kvpress scorer needs")
        base = getattr(getattr(model, "model", None), "language_model", getattr(model, "model", None))
        rotary = getattr(base, "rotary_emb", None)
        inputs = press._layer_inputs

        def keep(module, args, kwargs):
            if "hidden_states" not in kwargs and args:
                kwargs = {**kwargs, "hidden_states": args[0]}
            inputs[module.layer_idx] = (module, kwargs)

        def drop(module, args, output):
            inputs.pop(module.layer_idx, None)

        try:
            for m in modules:
                if rotary is not None and getattr(m, "rotary_emb", None) is None:
                    m.rotary_emb = rotary  # as kvpress does: ExpectedAttentionPress reads module.rotary_emb
                    self._rotary.append(m)
                self._hooks.append(m.register_forward_pre_hook(keep, with_kwargs=True))
                self._hooks.append(m.register_forward_hook(drop))
            init = getattr(press.scorer, "post_init_from_model", None)
            if callable(init):
                init(model)
            return self.context.__enter__()
        except BaseException:
            self._undo()
            raise

    def __exit__(self, *exc):
        try:
            return self.context.__exit__(*exc)
        finally:
            self._undo()

    def _undo(self):
        for h in self._hooks:
            h.remove()
        for m in self._rotary:
            del m.rotary_emb
        self._hooks, self._rotary = [], []
        self.press._layer_inputs.clear()


# ---------------------------------------------------------------------------------------------
# decode-time compression, as a wrapper
# ---------------------------------------------------------------------------------------------
@dataclass
class DecodingPress(Press):
    """Decode-time compression around any press (kvpress's ``DecodingPress`` shape).

    The prefill event is the base press's own (it compresses if its
    ``compression_ratio``/``target_size`` say so); then every
    ``compression_interval`` new tokens each layer is compressed back to
    ``target_size`` by the base press's scorer and design, reading the last
    ``observation_window`` queries. Certificates are the base press's kind.

    Parameters
    ----------
    base_press : BasePress
        E.g. ``PoissonPress(seed=0)`` or ``SnapKVPress()``.
    compression_interval : int >= 1
        New tokens (decoded, or prompt tokens of a streaming prefill) between events.
    target_size : int >= 1, optional
        Tokens per head kept after each event. Default: the base press's
        ``target_size``, else the budget of each row's prefill event.
    """

    base_press: BasePress = None
    compression_interval: int = 512
    target_size: int | None = None

    def __post_init__(self):
        if isinstance(self.base_press, BlockPoissonPress):
            raise TypeError("base_press: BlockPoissonPress decides its block sample once, after the prefill "
                            "(as the vLLM plugin); decode-time compression applies to the token designs "
                            "(PoissonPress, ScorerPress)")
        if not isinstance(self.base_press, BasePress):
            raise TypeError(f"base_press must be a kvcert press (e.g. kvcert.PoissonPress()), got "
                            f"{type(self.base_press).__name__}")
        if getattr(self.base_press, "_external", False):
            raise TypeError(f"base_press: a PoissonPress whose scorer is a kvpress press "
                            f"({type(self.base_press.scorer).__name__}) scores prefills only (its score reads a "
                            "layer's hidden states, which decode-time events do not keep); give DecodingPress a "
                            "kvcert scorer")
        if getattr(self.base_press, "sketch", None) is not None:
            raise ValueError("base_press: a sketched PoissonPress (sketch=...) evicts once per layer, at the "
                             "prefill; decode-time events would need the sketches of several events merged, which "
                             "kvcert does not do")
        self.compression_interval = _int("compression_interval", self.compression_interval, low=1)
        self.target_size = _int("target_size", self.target_size, low=1, optional=True)
        if self.target_size is None:
            self.target_size = self.base_press.target_size
        if self.target_size is None and not self.base_press.compresses:
            raise ValueError("target_size: give DecodingPress a target_size (or a base press that compresses "
                             "at the prefill, whose budget is then the target)")

    kind = property(lambda self: self.base_press.kind)
    delta = property(lambda self: self.base_press.delta)

    def queries_needed(self, n: int) -> int:
        return self.base_press.queries_needed(n)

    def prefill_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        layer.remember_queries(queries, self.base_press._observation_window())
        self.base_press.prefill_event(layer, layer_idx, queries, scale)

    def decode_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        layer.remember_queries(queries, self.base_press._observation_window())
        layer.tokens_since_event += queries.shape[2]
        if layer.tokens_since_event >= self.compression_interval:
            self.base_press._compress(layer, layer_idx, layer.queries, scale, prefill=False,
                                      target=self.target_size)


# ---------------------------------------------------------------------------------------------
# the query recorder of kvcert.prefill
# ---------------------------------------------------------------------------------------------
class _QueryRecorder(Press):
    """Keeps everything and records each layer's last ``query_window`` prefill
    queries and scale in the cache (``layer.queries``, ``layer.query_scale``)
    for :func:`kvcert.prefill`. Records no certificate, counts no event."""

    kind = delta = None

    def __init__(self, query_window: int | None = 64):
        self.query_window = query_window

    def prefill_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        q = queries.detach()
        layer.queries = q if self.query_window is None else q[:, :, -self.query_window:]
        layer.query_scale = scale

    def decode_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        raise RuntimeError("kvcert.prefill records a prefill only")


# ---------------------------------------------------------------------------------------------
# registries
# ---------------------------------------------------------------------------------------------
for _name in SCORERS:  # SnapKVPress, H2OPress, ..., KeyDiffPress, LagKVPress
    globals()[SCORERS[_name].press] = make_scorer_press(_name)
    __all__.append(SCORERS[_name].press)

#: scorers a PoissonPress can draw its importance from (kvcert.fast.SCORERS)
SCORER_NAMES = tuple(SCORERS)

#: name -> press class (the CLI's --press choices): PoissonPress, and one deterministic
#: press per registered scorer
PRESSES = {"poisson": PoissonPress, **{name: globals()[s.press] for name, s in SCORERS.items()}}


def _cases(name: str, cls) -> tuple[dict, dict]:
    """(easy, hard) keyword sets of a press: a typical setting, and an edge one (a budget below
    sinks + window, the non-default hyperparameters)."""
    easy = {"compression_ratio": 0.5}
    hard = {"target_size": 5, "sinks": 2, "window": 6, "delta": 0.2}
    if cls is PoissonPress:
        return ({**easy, "seed": 1},
                {**hard, "top_fraction": 0.9, "floor": 1.0, "scorer": "tova", "kind": "wald", "seed": 3})
    extra = {"observation_window": 3, "kernel_size": 3, "seed": 4, "pooling": "kvpress", "head_pooling": "all"}
    fields = {f.name for f in dataclasses.fields(cls)}
    return easy, {**hard, **{p: extra.get(p, 2) for p in fields if p in extra or p in SCORERS[name].params}}


#: name -> (easy, hard) keyword sets that the shared press tests iterate: a new press is
#: covered without editing a test; DecodingPress wraps each (``decoding`` cases)
PRESS_CASES = {name: _cases(name, cls) for name, cls in PRESSES.items()}
