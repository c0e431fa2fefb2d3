"""What every press shares: the ``with press(model):`` context, :class:`Press`, the eviction engine
:class:`BasePress`, the hyperparameter checks and kvpress's field names.

A press is a dataclass of hyperparameters (validated in ``__post_init__``);
``press(model)`` is the context manager that switches the model to kvcert
attention and a compressible cache (:class:`_PressContext`). The session
(:class:`kvcert.attention.Session`) calls the press at its events
(``prefill_event``, ``decode_event``); :class:`BasePress` implements the
token designs' event once (per batch row: score, size the certainty set,
evict), so a press says only how it scores (``_score``) and evicts
(``_evict``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..fast import SCORERS, ClusterSketch, QuantizedKV, TokenDesign, design_sizes
from ..fast._checks import check_int, check_kernel_size
from ..fast.options import declare_fields
from ..fast.scorers import HEAD_POOLINGS, SNAPKV_POOLINGS, queries_needed, queries_read


# ---------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------
# the argument checks (check_int, check_kernel_size) are kvcert.fast._checks', shared with the design objects
def held_design(press):
    """The design object ``press`` holds: ``press._make_design()`` of its fields ``press._design_fields``,
    built (and so checked) again when one of them was reassigned. The press's fields take the design's
    checked values, so the checks live in the design only."""
    key = tuple(getattr(press, name) for name in press._design_fields)
    held = press.__dict__.get("held_design")
    if held is not None and held[0] == key:
        return held[1]
    design = press._make_design()
    for name in press._design_fields:
        if isinstance(getattr(press, name), (str, numbers.Real, type(None))):  # not a scorer object
            setattr(press, name, getattr(design, name))
    press.__dict__["held_design"] = (tuple(getattr(press, name) for name in press._design_fields), design)
    return design


#: scorer hyperparameters with a rule of their own: name -> (default, validator); any other
#: registered hyperparameter is an int >= 1
SCORER_PARAMS = {
    "observation_window": (32, lambda v: check_int("observation_window", v, low=1)),
    "kernel_size": (7, check_kernel_size),
    "seed": (0, lambda v: check_int("seed", v)),
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
        check = SCORER_PARAMS.get(name, (None, lambda v, n=name: check_int(n, v, low=1)))[1]
        setattr(press, name, check(getattr(press, name)))


#: kvpress's names of kvcert press fields that mean the same (docs/design.md section 10): kvpress's
#: ``window_size`` (SnapKV) is the *observation* window, kvcert's ``window`` the recent tokens kept
#: with certainty; kvpress's ``n_sink`` (StreamingLLM, ExpectedAttention) is kvcert's ``sinks``
KVPRESS_NAMES = {"window_size": "observation_window", "n_sink": "sinks"}


def records_given(cls):
    """Let ``cls(...)`` remember which fields its caller named (``_given``: the keywords and the positional
    fields), so a named design (``preset=``) fills only the others. ``dataclasses.replace`` names every field."""
    init = cls.__init__
    names = [f.name for f in dataclasses.fields(cls) if f.init]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        self.__dict__["_given"] = frozenset(names[:len(args)]) | frozenset(kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def accept_kvpress_names(cls):
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
        from .. import attention as A
        from ..cache import attention_layout, cache_keyword

        model, config = self.model, self.model.config
        attention_layout(config)  # refuses the layer types kvcert cannot run correctly
        self._previous = config._attn_implementation
        decoder = self._decoder()
        session = A.Session(self.press._for_model(config), A.resolve_base(self._previous), config,
                            cache_keyword(decoder))
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
        from .. import attention as A

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
    ``prefill_event``, ``decode_event``, ``queries_needed``, ``kind`` and ``delta``, and reads
    its capabilities (never its class): :attr:`decides_every_layer` and :attr:`compresses_at_decode`."""

    _session = None
    #: the press decides for every layer at once (the block design): a model with layers it leaves
    #: uncompressed (sliding-window layers) cannot run it
    decides_every_layer = False

    @property
    def compresses_at_decode(self) -> bool:
        """Whether the session calls ``decode_event`` after decode steps (a press whose decode event does
        nothing says False, so the session skips the call)."""
        return True

    def _for_model(self, config) -> "Press":
        """The press that runs on a model of this config: the press itself, unless its design cannot run
        there (:meth:`kvcert.PoissonPress._for_model`: the recommended default on a softcapped model)."""
        return self

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
#: the fields every press shares with :class:`kvcert.fast.TokenDesign`, which declares and checks them
_BASE_FIELDS = ("compression_ratio", "target_size", "sinks", "window", "delta", "kind")


@dataclass
@declare_fields(TokenDesign, _BASE_FIELDS)
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

    # the fields (compression_ratio, target_size, sinks, window, delta, kind) are TokenDesign's: declare_fields

    #: Poisson design (expected budget, top slice) or deterministic top-k (exact budget)
    _randomized = False

    def __post_init__(self):
        # the checks are the token design's (a deterministic press keeps its certainty set and budget rule)
        checked = TokenDesign(**{name: getattr(self, name) for name in _BASE_FIELDS})
        for name in _BASE_FIELDS:
            setattr(self, name, getattr(checked, name))
        _validate_params(self)

    @property
    def compresses(self) -> bool:
        """Whether this press may remove anything at the prefill event (a ratio or a size)."""
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
        layer; tilt (R, h_kv, d) the tilt points of a tilted sketch (None: a prefill's sketch is the
        design's event, :meth:`_prefill_row`) and scale the attention's. Row i must be evicted as if alone (a sequence's sample does not
        depend on its batch).
        """
        raise NotImplementedError

    # -- the events (called by the session) ------------------------------------------------------
    def prefill_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        self._compress(layer, layer_idx, queries, scale, prefill=True)

    def decode_event(self, layer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        """Nothing: decode-time compression is :class:`DecodingPress`'s."""

    @property
    def compresses_at_decode(self) -> bool:
        """False unless a subclass has a decode event of its own (this class's does nothing)."""
        return type(self).decode_event is not BasePress.decode_event

    # -- budgets --------------------------------------------------------------------------------
    def _budget(self, n: int) -> float:
        """Budget for n tokens: target_size (capped at n) or n (1 - ratio)."""
        if self.target_size is not None:
            return float(min(self.target_size, n))
        b = n * (1.0 - self.compression_ratio)
        return b if self._randomized else float(max(int(b), 1))

    def _sampled_budget(self, n: int, layer) -> float:
        """The expected kept count of a prefill event over n tokens: the budget (:meth:`_budget`)."""
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

    def _prefill_row(self, layer, r: int, queries, scale: float, *, layer_idx: int, event: int):
        """One row's prefill event -> :class:`RowEvent`: the row done (its slots after the event), or the plan
        of :meth:`_prefill_plan` for the batched :meth:`_evict` (a deterministic press's top-k)."""
        idx, plan = self._prefill_plan(layer, r, queries, scale, layer_idx=layer_idx, event=event)
        return RowEvent(row_slots(layer, r, idx)) if plan is None else RowEvent(None, plan=plan)

    def _prefill_plan(self, layer, r: int, queries, scale: float, *, layer_idx: int, event: int):
        """One row's prefill event: ``(idx, plan)``, ``idx`` the row's real slots (None: all) and ``plan``
        None when the row keeps every token, else (importance on the layer's slots (1, h_kv, slots), budget
        per KV head (h_kv,), DesignSizes, tilt (None), top per KV head (None: the sizes')); sets
        ``layer.budgets[r]``. Every head holds the same tokens: the row's real tokens are scored in one
        scorer call."""
        idx, n = real_slots(layer, r)
        budget = self._sampled_budget(n, layer) if n else 0.0
        layer.budgets[r] = budget
        if n == 0 or budget >= n:
            return idx, None
        k, v, q_r = row_tokens(layer, r, idx, queries)
        u = self._prefill_importance(q_r, k, v, scale=scale, layer_idx=layer_idx, event=event, row=r, tokens=idx)
        h_kv, n_slots = k.shape[1], layer.valid.shape[-1]
        if idx is not None:  # back onto the layer's slots (0 on padding)
            u = u.new_zeros((1, h_kv, n_slots)).index_copy_(-1, idx, u)
        return idx, (u, torch.full((h_kv,), float(budget), dtype=torch.float64), self._sizes(budget), None, None)

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
        a few batched calls.
        """
        if not prefill and getattr(layer, "quantized", None) is not None:
            raise ValueError("kv_bits: a quantized cache is compressed once per layer, at the prefill event; "
                             "decode-time compression (DecodingPress, streaming) is not supported: use kv_bits=16")
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
        h_kv = valid_all.shape[1]
        if prefill:
            layer.budgets = torch.full((b,), math.nan, dtype=torch.float64)
        plans = {}  # row -> (importance (1, h_kv, slots), budget (h_kv,), DesignSizes, tilt, top)
        rows = {}  # row -> its (keys, values, log_weights, positions) after the event
        sketches = {}  # row -> its ClusterSketch (1, h_kv, ...) when the design keeps one
        stored = {}  # row -> (its QuantizedKV (1, h_kv, ...), whether it kept every token): a quantized cache
        evicted = False  # a row evicted by its design's event (:meth:`_prefill_row`)
        for r in range(b):
            sl = slice(r, r + 1)
            valid = valid_all[sl]
            if prefill:
                done = self._prefill_row(layer, r, queries, scale, layer_idx=layer_idx, event=event)
                if done.plan is None:
                    rows[r] = done.row
                    evicted |= done.evicted
                    if done.sketch is not None:
                        sketches[r] = done.sketch
                    if done.stored is not None:
                        stored[r] = (done.stored, done.whole)
                    continue
                plans[r] = done.plan
            else:
                row_target = target
                if row_target is None and layer.budgets is not None and not math.isnan(float(layer.budgets[r])):
                    row_target = float(layer.budgets[r])
                n_h = valid.sum(-1)  # (1, h)
                if row_target is None or int(n_h.max()) <= row_target:
                    rows[r] = row_slots(layer, r, None)
                    continue
                budget = torch.clamp(n_h[0].to(torch.float64), max=float(row_target))
                seen = min(queries.shape[2], int(layer.next_position[r]))  # no left-padding queries
                u = self._row_importance(queries[sl][:, :, -seen:], layer.keys[sl], layer.values[sl], valid, scale,
                                         layer_idx=layer_idx, event=event)
                plans[r] = (u, budget, self._sizes(float(budget.max())), None, None)
        if not plans and not evicted:
            return
        groups = {}
        for r, (_, _, sz, _, _) in plans.items():
            groups.setdefault((sz.sinks, sz.window), []).append(r)
        for (sinks, window), members in groups.items():
            sel = None if len(members) == b else torch.tensor(members, device=layer.keys.device)

            def pick(x, sel=sel):
                return x if sel is None else x.index_select(0, sel)

            u = torch.cat([plans[r][0] for r in members]).to(layer.keys.device)
            budget = torch.stack([plans[r][1] for r in members]).to(layer.keys.device)
            top = torch.stack([torch.full((h_kv,), plans[r][2].top, dtype=torch.int64) if plans[r][4] is None
                               else plans[r][4] for r in members]).to(layer.keys.device)
            tilt = None if plans[members[0]][3] is None else torch.cat([plans[r][3] for r in members])
            cc = self._evict(pick(layer.keys), pick(layer.values), u, budget, sinks=sinks, window=window, top=top,
                             valid=pick(valid_all), log_weights=pick(layer.log_weights),
                             positions=pick(layer.positions), layer_idx=layer_idx, event=event, tilt=tilt,
                             scale=scale)
            if sel is None and len(groups) == 1 and not evicted:
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
        if stored:  # a quantized cache: every row's event stored its tokens (kvcert.fast.TokenDesign.event)
            layer.install_quantized(QuantizedKV.cat([stored[r][0] for r in range(b)]), self.design,
                                    torch.tensor([stored[r][1] for r in range(b)]), sketch)
            return
        layer.replace(*pad_rows([rows[r] for r in range(b)]), sketch)


class RowEvent(NamedTuple):
    """One batch row's prefill event (:meth:`Press._prefill_row`): ``row`` its (keys, values, log_weights,
    positions) after the event and ``sketch`` its sketch (1, h_kv, ...) or None, with ``evicted`` whether the
    event removed any token; or ``plan``, the row's share of a batched :meth:`Press._evict`. A quantized
    cache's row (``kv_bits`` < 16) gives ``stored`` (a ``kvcert.fast.QuantizedKV`` (1, h_kv, ...)) in place of
    ``row``, and ``whole`` whether its event kept every token."""

    row: tuple | None
    sketch: object = None
    plan: tuple | None = None
    evicted: bool = False
    stored: object = None
    whole: bool = False




def real_slots(layer, r: int):
    """Row r's real slots ``idx`` (None: every slot, no padding) and their count n (every head holds the same
    tokens at a prefill event)."""
    valid = layer.valid[r:r + 1]
    idx = None if bool(valid.all()) else valid[0, 0].nonzero().squeeze(-1)
    return idx, (valid.shape[-1] if idx is None else idx.numel())


def row_tokens(layer, r: int, idx, queries):
    """Row r's keys, values (1, h_kv, n, d) at its real slots ``idx`` and its prefill queries (1, h_q, w, d)
    at those slots (the queries may be the last few of the prefill only: a shared kvcert.prefill)."""
    sl = slice(r, r + 1)
    k, v, q_r = layer.keys[sl], layer.values[sl], queries[sl]
    if idx is not None:
        k, v = k[:, :, idx], v[:, :, idx]
        offset = layer.valid.shape[-1] - queries.shape[2]
        q_r = q_r[:, :, idx[idx >= offset] - offset]
    return k, v, q_r


def row_slots(layer, r: int, idx):
    """Row r of a layer as (keys, values, log_weights, positions), its slots ``idx`` only if given."""
    out = (layer.keys[r:r + 1], layer.values[r:r + 1], layer.log_weights[r:r + 1], layer.positions[r:r + 1])
    return out if idx is None else tuple(x[:, :, idx] for x in out)


def pad_rows(rows):
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
# the query recorder of kvcert.prefill
# ---------------------------------------------------------------------------------------------
class QueryRecorder(Press):
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
