"""Presses: KV-cache compression policies for transformers models, kvpress style.

A press is a dataclass of hyperparameters (validated in ``__post_init__``)
used as a context manager around a model::

    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    with press(model):
        out = model.generate(**inputs, max_new_tokens=16)
    press.certificates          # per step x layer x query head (kvcert.attention.Certificates)

Inside the context the model runs the ``"kvcert"`` attention function
(:mod:`kvcert.attention`) and a :class:`~kvcert.cache.KVCertLayer` cache; each
layer is compressed right after its prefill (the prefill itself is exact
attention over the full prompt) and, with ``compression_interval``, every
``compression_interval`` decoded tokens back to the target size. Decoding
attends over the kept tokens with the Hajek correction -log pi and records
a certificate per step, layer and query head.

:class:`PoissonPress` is the randomized design of the paper (every token has a
known inclusion probability pi > 0, so the certificates are informative).
The deterministic baselines (:class:`SnapKVPress`, :class:`H2OPress`,
:class:`StreamingLLMPress`, :class:`TOVAPress`, :class:`KNormPress`,
:class:`RandomPress`) run on the same machinery with pi = 1 on the kept tokens
and pi = 0 on the evicted ones: their recorded certificates are identically
0, which is exactly the impossibility the paper proves (a deterministic
policy observes nothing of what it evicted), not a statement of zero error.

The budget at an event with n tokens held (per batch row, padding excluded):
``target_size`` if given (capped at n), else ``n * (1 - compression_ratio)``
(kvpress's convention: the ratio is the fraction removed). PoissonPress keeps
that many tokens *in expectation*; the deterministic presses keep
``int(n * (1 - compression_ratio))`` exactly.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass

import torch

__all__ = [
    "BasePress",
    "PoissonPress",
    "SnapKVPress",
    "H2OPress",
    "StreamingLLMPress",
    "TOVAPress",
    "KNormPress",
    "RandomPress",
    "PRESSES",
    "SCORER_NAMES",
]

#: scorers a PoissonPress can draw its importance from (kvcert.fast.scorers)
SCORER_NAMES = ("snapkv", "h2o", "tova", "knorm", "streaming_llm", "random", "expected")
_KINDS = ("wald", "chebyshev", "chi2", "bernstein", "chebyshev_ucb")


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


# ---------------------------------------------------------------------------------------------
# the context manager
# ---------------------------------------------------------------------------------------------
class _PressContext:
    """``with press(model):`` -- switch the model to kvcert attention and a compressible cache."""

    def __init__(self, press: "BasePress", model):
        if not hasattr(model, "config") or not hasattr(model, "set_attn_implementation"):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        self.press, self.model = press, model
        self._hook = None
        self._previous = None
        self._runtime = None

    def __enter__(self):
        from . import attention as A
        from .cache import KVCertCache, _check_full_attention, as_kvcert_cache

        model, press = self.model, self.press
        config = model.config
        if A.runtime_of(config) is not None:
            raise RuntimeError("a kvcert press is already active on this model (presses do not nest)")
        _check_full_attention(config)
        self._previous = config._attn_implementation
        rt = A.Runtime(press=press, base=A.resolve_base(self._previous),
                       recorder=A.Recorder(press.kind, press.delta),
                       estimate_kwargs=A._estimate_kwargs(press.kind))
        self._runtime = rt
        press._runtime = rt
        params = inspect.signature(model.forward).parameters
        cache_kw = "cache" if "cache" in params else "past_key_values"
        default_use_cache = getattr(config, "use_cache", True)

        def pre_hook(module, args, kwargs):
            cache = None
            for name in ("cache", "past_key_values"):
                if kwargs.get(name) is not None:
                    cache = kwargs[name]
            use_cache = kwargs.get("use_cache")
            use_cache = default_use_cache if use_cache is None else use_cache
            if cache is None and use_cache:
                cache = KVCertCache(config)
                kwargs[cache_kw] = cache
            elif cache is not None:
                as_kvcert_cache(cache)
            if cache is not None and cache.get_seq_length() == 0:
                rt.recorder = A.Recorder(press.kind, press.delta)  # a new sequence
            rt.cache = cache
            mask = kwargs.get("attention_mask")
            if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
                mask = args[1]
            rt.mask2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            return args, kwargs

        A._RUNTIMES[id(config)] = rt
        for module in model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "num_key_value_groups"):
                module._kvcert_runtime = rt
        self._hook = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
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
        for module in model.modules():
            if getattr(module, "_kvcert_runtime", None) is self._runtime:
                del module._kvcert_runtime
        A._RUNTIMES.pop(id(config), None)
        if self._runtime is not None:
            self._runtime.cache = None
            self._runtime.mask2d = None
        return False


# ---------------------------------------------------------------------------------------------
# presses
# ---------------------------------------------------------------------------------------------
@dataclass
class BasePress:
    r"""Common fields and the compression machinery of every press.

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
    compression_interval : int >= 1, optional
        Decode-time compression: every ``compression_interval`` decoded tokens,
        compress each layer back to ``target_size`` (or to the budget of the
        prefill event). Default: compress after the prefill only.
    sinks : int >= 0
        First tokens always kept (attention sinks).
    window : int >= 0
        Most recent tokens always kept.
    delta : float in (0, 1)
        Miscoverage of the recorded certificates.
    kind : {"chebyshev", "wald", "chi2", "bernstein", "chebyshev_ucb"}
        Certificate kind recorded per step, layer and head (``chebyshev_ucb``:
        the strict kind, a chi-square upper bound on the variance then
        Chebyshev, at the cost of a second pass over the kept tokens; see
        docs/theory.md).

    Notes
    -----
    When the budget is too small for the certainty set, the recent window
    shrinks first, then the sinks, so that the budget is met and (for the
    Poisson design) at least part of it is left to sampling.
    """

    compression_ratio: float = 0.0
    target_size: int | None = None
    compression_interval: int | None = None
    sinks: int = 4
    window: int = 32
    delta: float = 0.05
    kind: str = "chebyshev"

    #: the importance scorer (fixed per class for the deterministic presses)
    _scorer_name = "snapkv"
    #: randomized (Poisson) or deterministic (top-k) eviction
    randomized = False

    def __post_init__(self):
        self.compression_ratio = _real("compression_ratio", self.compression_ratio, 0.0, 1.0, hi_open=True)
        self.target_size = _int("target_size", self.target_size, low=1, optional=True)
        if self.target_size is not None and self.compression_ratio > 0:
            raise ValueError(
                f"give compression_ratio or target_size, not both (got compression_ratio="
                f"{self.compression_ratio}, target_size={self.target_size})"
            )
        self.compression_interval = _int("compression_interval", self.compression_interval, low=1, optional=True)
        self.sinks = _int("sinks", self.sinks)
        self.window = _int("window", self.window)
        self.delta = _real("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if not isinstance(self.kind, str) or self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        self._runtime = None

    # -- public ---------------------------------------------------------------------------------
    def __call__(self, model):
        """Context manager: ``with press(model): model.generate(...)``."""
        return _PressContext(self, model)

    @property
    def certificates(self):
        """Certificates recorded by the last sequence run under this press
        (:class:`kvcert.attention.Certificates`, batched: (b, steps, layers, heads)),
        or None before any run."""
        rt = self._runtime
        return None if rt is None or rt.recorder is None else rt.recorder.result()

    @property
    def compresses(self) -> bool:
        """Whether this press removes anything at the prefill event."""
        return self.compression_ratio > 0 or self.target_size is not None

    # -- hooks called by the attention function ---------------------------------------------------
    def _observation_window(self) -> int:
        return getattr(self, "observation_window", self.window) or 1

    def _on_prefill(self, layer, layer_idx: int, query: torch.Tensor, scale: float) -> None:
        if self.compression_interval is not None:
            layer.remember_queries(query, self._observation_window())
        self._compress(layer, layer_idx, query, scale, prefill=True)

    def _queries_needed(self, n: int) -> int:
        """Prefill queries the scorer reads at the prefill event of n tokens."""
        name = self._scorer_name
        if name == "h2o":
            return n
        if name in ("snapkv", "tova", "expected"):
            return min(self._observation_window(), n)
        return 0

    def _compress_prefilled(self, cache, *, query_window) -> None:
        """The prefill event on a cache filled under :class:`_QueryRecorder` (``kvcert.prefill``).

        Records the step-0 (exact prefill) certificate row as the attention
        function does, then compresses each layer with the recorded queries.
        """
        from .attention import _per_query_head

        rt = self._runtime
        for idx, layer in enumerate(cache.layers):
            queries, scale = layer.queries, getattr(layer, "query_scale", None)
            layer.queries = None
            if queries is None or scale is None:
                raise ValueError("prefilled: the cache holds no recorded queries (make it with kvcert.prefill)")
            n = layer.physical_length
            need = self._queries_needed(n)
            if need > queries.shape[2]:
                raise ValueError(
                    f"prefilled: {type(self).__name__} (scorer {self._scorer_name!r}) reads {need} prefill queries "
                    f"but kvcert.prefill kept {queries.shape[2]} (query_window={query_window}); call "
                    "kvcert.prefill(..., query_window=None) to keep all of them"
                )
            if rt is not None and rt.recorder is not None:
                zeros = torch.zeros(queries.shape[0], queries.shape[1], device=queries.device)
                rt.recorder.add(idx, zeros, zeros, zeros, _per_query_head(layer.kept, queries.shape[1]))
            self._on_prefill(layer, idx, queries, scale)

    def _on_decode(self, layer, layer_idx: int, query: torch.Tensor, scale: float) -> None:
        if self.compression_interval is None:
            return
        layer.remember_queries(query, self._observation_window())
        layer.tokens_since_event += query.shape[2]
        if layer.tokens_since_event >= self.compression_interval:
            self._compress(layer, layer_idx, layer.queries, scale, prefill=False)

    # -- budget and design sizes ----------------------------------------------------------------
    def _budget(self, n: int) -> float:
        """Budget for n tokens: target_size (capped at n) or n (1 - ratio)."""
        if self.target_size is not None:
            return float(min(self.target_size, n))
        b = n * (1.0 - self.compression_ratio)
        return float(max(int(b), 1)) if not self.randomized else b

    def _sizes(self, budget: float) -> tuple[int, int, int]:
        """(sinks, window, top) fitting under the budget (see the class Notes)."""
        sinks, window = self.sinks, self.window
        if self.randomized:
            cap = max(math.ceil(budget) - 1, 0)  # the largest certainty set strictly below the budget
        else:
            cap = int(budget)
        if sinks + window > cap:
            window = max(0, cap - sinks)
            sinks = min(sinks, cap)
        top = 0
        if self.randomized:
            top = min(int(math.floor(self.top_fraction * (budget - sinks - window))), cap - sinks - window)
            top = max(top, 0)
        return sinks, window, top

    # -- importance ----------------------------------------------------------------------------
    def _importance(self, queries, keys, scale, *, layer_idx: int, event: int, prefill: bool) -> torch.Tensor:
        """(1, h_kv, n) importance of one row's tokens (all valid)."""
        from .fast import scorers as S

        name = self._scorer_name
        n = keys.shape[2]
        w = min(self._observation_window(), queries.shape[2], n)
        if name == "snapkv":
            return S.snapkv_scores(queries[:, :, -w:], keys, scale=scale,
                                   kernel_size=getattr(self, "kernel_size", 7))
        if name == "h2o":
            if prefill and queries.shape[2] == n:
                return S.h2o_scores(queries, keys, scale=scale)
            # decode-time event: the attention of the evicted steps is not kept, so H2O
            # accumulates over the observation window only (SnapKV without pooling)
            return S.snapkv_scores(queries[:, :, -w:], keys, scale=scale, kernel_size=1)
        if name == "expected":
            return S.expected_attention_scores(queries[:, :, -w:], keys, scale=scale,
                                               kernel_size=getattr(self, "kernel_size", 7))
        if name == "tova":
            return S.tova_scores(queries[:, :, -1], keys, scale=scale)
        if name == "knorm":
            return S.knorm_scores(keys)
        if name == "streaming_llm":
            return S.streaming_llm_scores(keys)
        if name == "random":
            return S.random_scores(keys, seed=self.seed, layer=layer_idx, event=event)
        raise ValueError(f"unknown scorer {name!r}; expected one of {SCORER_NAMES}")

    def _row_importance(self, queries, keys, valid, scale, *, layer_idx, event, prefill) -> torch.Tensor:
        """Importance (1, h_kv, m) of one row of a cache with per-head padding (0 on padding)."""
        h_kv = keys.shape[1]
        g = queries.shape[1] // h_kv
        dtype = torch.float64 if keys.dtype == torch.float64 else torch.float32
        u = torch.zeros(valid.shape, dtype=dtype, device=keys.device)
        for h in range(h_kv):
            idx = valid[0, h].nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            uh = self._importance(queries[:, h * g:(h + 1) * g], keys[:, h:h + 1, idx], scale,
                                  layer_idx=layer_idx, event=event, prefill=prefill)
            u[0, h, idx] = uh[0, 0].to(dtype)
        return u

    # -- eviction ------------------------------------------------------------------------------
    def _evict(self, keys, values, importance, budget, *, valid, log_weights, positions, layer_idx, event):
        """One row's eviction; returns (keys, values, log_weights, positions)."""
        from . import fast

        n_valid = valid.sum(-1)  # (1, h)
        sinks, window, top = self._sizes(float(budget) if not torch.is_tensor(budget) else float(budget.max()))
        pi_prev = log_weights.exp()
        if self.randomized:
            u = importance.to(torch.float64).masked_fill(~valid, 0.0)
            low = u.masked_fill(~valid, math.inf).amin(-1, keepdim=True)
            if bool((low < 0).any()):  # e.g. knorm's -||k||: shift to >= 0 on the valid slots
                u = (u - low).masked_fill(~valid, 0.0)
            cc = fast.evict(keys, values, u, budget, sinks=sinks, window=window, top=top, floor=self.floor,
                            seed=self.seed, layer=layer_idx, event=event, pi=pi_prev, positions=positions)
        else:
            k = int(torch.as_tensor(budget).min()) if torch.is_tensor(budget) else int(budget)
            k = min(k, int(n_valid.min()))
            cc = fast.topk_evict(keys, values, importance, k, sinks=sinks, window=window,
                                 pi=pi_prev, positions=positions)
        return cc.keys, cc.values, torch.log(cc.pi), cc.positions

    def _compress(self, layer, layer_idx: int, queries, scale: float, *, prefill: bool) -> None:
        """One eviction event on every row of a layer (rows are independent designs)."""
        event = layer.events
        layer.events += 1
        layer.tokens_since_event = 0
        if prefill and not self.compresses:
            return
        b = layer.keys.shape[0]
        valid_all = layer.valid
        rows, changed = [], False
        if prefill:
            layer.budgets = torch.full((b,), math.nan, dtype=torch.float64)
        for r in range(b):
            sl = slice(r, r + 1)
            k, v = layer.keys[sl], layer.values[sl]
            lw, pos, valid = layer.log_weights[sl], layer.positions[sl], valid_all[sl]
            if prefill:
                # every head holds the same tokens: drop the padding, one scorer call for the row
                if not bool(valid.all()):
                    idx = valid[0, 0].nonzero().squeeze(-1)
                    k, v, lw, pos, valid = k[:, :, idx], v[:, :, idx], lw[:, :, idx], pos[:, :, idx], valid[:, :, idx]
                    # the queries may be the last few of the prefill only (a shared kvcert.prefill)
                    offset = valid_all.shape[-1] - queries.shape[2]
                    q_r = queries[sl][:, :, idx[idx >= offset] - offset]
                else:
                    q_r = queries[sl]
                n = k.shape[2]
                budget = self._budget(n) if n else 0.0
                layer.budgets[r] = budget
                if n == 0 or budget >= n:
                    rows.append((k, v, lw, pos))
                    continue
                u = self._importance(q_r, k, scale, layer_idx=layer_idx, event=event, prefill=True)
            else:
                target = self.target_size
                if target is None and layer.budgets is not None and not math.isnan(float(layer.budgets[r])):
                    target = float(layer.budgets[r])
                n_h = valid.sum(-1)  # (1, h)
                if target is None or int(n_h.max()) <= target:
                    rows.append((k, v, lw, pos))
                    continue
                budget = torch.clamp(n_h.to(torch.float64), max=float(target))
                seen = min(queries.shape[2], int(layer.next_position[r]))  # no left-padding queries
                u = self._row_importance(queries[sl][:, :, -seen:], k, valid, scale, layer_idx=layer_idx,
                                         event=event, prefill=False)
            rows.append(self._evict(k, v, u, budget, valid=valid, log_weights=lw, positions=pos,
                                    layer_idx=layer_idx, event=event))
            changed = True
        if changed:
            layer.replace(*_pad_rows(rows))


@dataclass
class _QueryRecorder(BasePress):
    """Keeps everything and records each layer's last ``query_window`` prefill
    queries and scale in the cache (``layer.queries``, ``layer.query_scale``)
    for :func:`kvcert.prefill`. Counts no eviction event."""

    query_window: int | None = 64

    def _on_prefill(self, layer, layer_idx: int, query: torch.Tensor, scale: float) -> None:
        q = query.detach()
        layer.queries = q if self.query_window is None else q[:, :, -self.query_window:]
        layer.query_scale = scale

    def _on_decode(self, layer, layer_idx: int, query: torch.Tensor, scale: float) -> None:
        raise RuntimeError("kvcert.prefill records a prefill only")


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


@dataclass
class PoissonPress(BasePress):
    r"""Randomized eviction with known inclusion probabilities (the paper's design).

    At each event, per layer, batch row and KV head: the first ``sinks``
    tokens, the last ``window`` tokens and the ``top`` most important others
    are kept with certainty (pi = 1), where
    :math:`\text{top} = \lfloor \text{top\_fraction}\,(B - \text{sinks} - \text{window})\rfloor`;
    every other token is kept independently with

    .. math:: \pi_i = \min(1, \lambda u'_i), \qquad
              u'_i = (1-\alpha)\frac{u_i}{\sum_{T} u_j} + \frac{\alpha}{|T|},

    :math:`\alpha` = ``floor``, :math:`\lambda` solved so that
    :math:`\sum_i \pi_i = B` (the budget, an expected count). Decoding then
    uses the Hajek estimate with logit offset :math:`-\log\pi_i` and records
    its certificate (:mod:`kvcert.attention`). Repeated events compose: a
    token's pi is the product over the events it survived.

    Parameters
    ----------
    compression_ratio, target_size, compression_interval, sinks, window, delta, kind
        See :class:`BasePress`. Defaults: sinks 4, window 32 (the last 32
        tokens), delta 0.05, kind ``chebyshev``.
    top_fraction : float in [0, 1)
        Share of the free budget B - sinks - window kept deterministically
        by importance (default 0.5); the rest of the budget is sampled.
    floor : float in (0, 1]
        Defensive mixture weight alpha (default 0.1): every tail token has
        pi >= alpha B_tail / |T| > 0.
    scorer : {"snapkv", "h2o", "tova", "knorm", "streaming_llm", "random", "expected"}
        Importance u (default ``snapkv``: attention of the last
        ``observation_window`` prefill queries, GQA-pooled, smoothed with
        ``kernel_size``). Negative scores (``knorm``) are shifted to >= 0.
        ``expected``: the mean of SnapKV's normalized importance and an
        expected-attention one (keys scored under a Gaussian fit of the
        window's queries, :func:`kvcert.fast.expected_attention_scores`);
        it lowered the attention error by 9-13% at equal budget on the
        real-model replay cells (docs/results.md, Table 2b, design
        ``expected``), at unchanged coverage.
    seed : int >= 0
        Seed of the sampling streams, one per (layer, batch row, KV head,
        event) and indexed by token position (:mod:`kvcert.fast.design`):
        the same seed replays the same draws, and a sequence draws the same
        sample alone or in a batch.
    observation_window : int >= 1
        Queries the ``snapkv``/``tova``/``h2o`` scorers look at (default 32).
    kernel_size : odd int >= 1
        SnapKV pooling width (default 7).

    Examples
    --------
    >>> import kvcert
    >>> press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)
    >>> press.kind, press.window, press.top_fraction
    ('chebyshev', 32, 0.5)
    """

    top_fraction: float = 0.5
    floor: float = 0.1
    scorer: str = "snapkv"
    seed: int = 0
    observation_window: int = 32
    kernel_size: int = 7

    randomized = True

    def __post_init__(self):
        super().__post_init__()
        self.top_fraction = _real("top_fraction", self.top_fraction, 0.0, 1.0, hi_open=True)
        self.floor = _real("floor", self.floor, 0.0, 1.0, lo_open=True)
        if not isinstance(self.scorer, str) or self.scorer not in SCORER_NAMES:
            raise ValueError(f"scorer must be one of {SCORER_NAMES}, got {self.scorer!r}")
        self.seed = _int("seed", self.seed)
        self.observation_window = _int("observation_window", self.observation_window, low=1)
        self.kernel_size = _int("kernel_size", self.kernel_size, low=1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {self.kernel_size}")

    @property
    def _scorer_name(self):  # the field chooses the scorer
        return self.scorer


@dataclass
class SnapKVPress(BasePress):
    """Deterministic SnapKV (Li et al. 2024): keep the sinks, the window and the
    tokens the last ``observation_window`` queries attend to most (pooled with
    ``kernel_size``). pi = 1 on kept tokens: certificates are 0 (uninformative)."""

    observation_window: int = 32
    kernel_size: int = 7
    _scorer_name = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        self.observation_window = _int("observation_window", self.observation_window, low=1)
        self.kernel_size = _int("kernel_size", self.kernel_size, low=1)
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd, got {self.kernel_size}")


@dataclass
class H2OPress(BasePress):
    """Deterministic H2O (Zhang et al. 2023): keep the heavy hitters of the
    accumulated causal attention of all prefill queries (decode-time events
    accumulate over the recent queries only)."""

    _scorer_name = "h2o"


@dataclass
class StreamingLLMPress(BasePress):
    """Deterministic StreamingLLM (Xiao et al. 2024): keep the sinks and the most recent tokens."""

    _scorer_name = "streaming_llm"


@dataclass
class TOVAPress(BasePress):
    """Deterministic TOVA (Oren et al. 2024): keep the tokens the last query attends to most."""

    _scorer_name = "tova"


@dataclass
class KNormPress(BasePress):
    """Deterministic K-norm (Devoto et al. 2024): keep the keys of smallest L2 norm."""

    _scorer_name = "knorm"


@dataclass
class RandomPress(BasePress):
    """Uniform random eviction *without* correction: a random kept set of the
    budget's size with pi treated as 1 (so its certificates are 0 and its
    estimate biased); the contrast to :class:`PoissonPress`."""

    seed: int = 0
    _scorer_name = "random"

    def __post_init__(self):
        super().__post_init__()
        self.seed = _int("seed", self.seed)


#: name -> press class (the CLI's --press choices)
PRESSES = {
    "poisson": PoissonPress,
    "snapkv": SnapKVPress,
    "h2o": H2OPress,
    "streaming_llm": StreamingLLMPress,
    "tova": TOVAPress,
    "knorm": KNormPress,
    "random": RandomPress,
}
