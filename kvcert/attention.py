"""The ``kvcert`` attention function for transformers, and the session it calls.

Importing this module registers ``"kvcert"`` with transformers'
``AttentionInterface`` (the attention function) and
``AttentionMaskInterface`` (its mask function). A press switches a model to
it for the duration of ``with press(model):``; outside a press the function
is exactly the model's own attention (``sdpa`` by default).

The protocol between the press context and the attention function is one
object, the :class:`Session`: the context (:mod:`kvcert.presses`) makes it
and :func:`activate`\\ s it for the model's config; the attention and mask
functions find it with :func:`active_session` (one way, keyed by the config
both receive) and call it. The session owns the cache handle, the padding
mask of the current forward and the certificate :class:`Recorder`; it calls
the press at two events only: ``press.prefill_event(layer, layer_idx,
queries, scale)`` after a layer's exact prefill, and
``press.decode_event(layer, layer_idx, queries, scale)`` after each
decoding forward of a layer.

Inside a press, per layer and per forward call:

- **prefill** (the layer held nothing before this call): exact attention
  through the model's base implementation (``sdpa`` or ``eager``) with the
  causal/padding mask transformers built, then the press compresses the layer
  (the prefill queries see the full cache; the scorer sees these queries);
- **decoding** (one new token, or a chunk of several): Hajek-corrected
  attention over the held slots through :func:`kvcert.dispatch.decode`, the
  one decode entry of every design: it picks the route from what the layer
  holds (token: :func:`kvcert.hajek_attention`, Triton on CUDA,
  :mod:`kvcert.fast` on CPU; block: the cluster-sampling trace; sketch: the
  hybrid variance with the layer's sketch), with the per-slot bias -log pi
  from :attr:`KVCertLayer.log_weights` (-inf on padding slots); a chunk is
  causal by the stored token positions. The estimate gives a certificate of
  the press's ``kind`` and ``delta`` for every query head, recorded per step.

The mask function returns the base implementation's mask for a prefill and
``None`` afterwards: layers hold different physical lengths after eviction,
so no single mask fits them all, and a one-token decode needs no causal mask
among cached tokens (padding is carried by the -inf bias).

Models with sliding-window layers beside global ones (Gemma 2 and 3): only
the full-attention layers are compressed and certified
(:func:`kvcert.cache.attention_layout`); a sliding-window layer
(:class:`kvcert.cache.SlidingWindowLayer`) is attended exactly as the stock
model attends it, by the model's own attention function with the stock
sliding-window mask (the mask function always returns that one), at every
step. The recorded certificates have one layer entry per compressed layer,
in order (:func:`kvcert.cache.compressed_layers` gives their model
indices), so summaries over layers (``Certificates.per_step``,
``per_layer``) run over the compressed layers only. Attention logit
softcapping (Gemma 2's ``attn_logit_softcapping``, passed to the attention
function as ``softcap``) is applied exactly: scores
:math:`s_i = c\\tanh(\\tau q\\cdot k_i / c)` before the :math:`-\\log\\pi_i`
offset, so the estimate and its certificate refer to the softcapped
attention, the model's own. Scalings and norms applied to queries and keys
before the attention function (Gemma's ``query_pre_attn_scalar``, QK norms)
reach kvcert through the query, the keys and ``scaling``. Features that
change the attention in a way the estimator does not model are refused by
name: attention sinks, additive position biases (ALiBi), non-causal
attention.
"""

from __future__ import annotations

import sys
import warnings
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

from . import dispatch
from .cache import KVCertCache, KVCertLayer, as_kvcert_cache, attention_layout
from .fast import certificate_moments
from .records import Certificates, Recorder

__all__ = [
    "ATTENTION_NAME",
    "BASE_ATTENTION",
    "Carrier",
    "Certificates",
    "Session",
    "activate",
    "active_session",
    "carry",
    "deactivate",
    "exact_attention",
    "kvcert_attention_forward",
    "kvcert_mask",
]

#: the name registered with transformers' AttentionInterface / AttentionMaskInterface
ATTENTION_NAME = "kvcert"
#: exact attention functions a press runs the prefill with
BASE_ATTENTION = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
_DEFAULT_BASE = "sdpa"


def resolve_base(implementation: str | None) -> str:
    """The exact attention a press runs the prefill with, for a model's implementation.

    ``sdpa`` and ``eager`` are kept. Anything else falls back to ``sdpa``
    with a warning: FlashAttention (and flex attention) kernels take no
    additive bias, so they cannot carry -log pi; kvcert decodes through its
    own function either way, and the prefill is exact attention, which sdpa
    computes.
    """
    if implementation in BASE_ATTENTION:
        return implementation
    if implementation in (None, ATTENTION_NAME):
        return _DEFAULT_BASE
    warnings.warn(
        f"kvcert: the model uses attn_implementation={implementation!r}, which cannot carry the "
        f"Hajek bias -log pi; under the press the prefill runs with 'sdpa' (exact attention) and "
        f"decoding with kvcert.hajek_attention",
        stacklevel=3,
    )
    return _DEFAULT_BASE


_MODULE_EAGER: dict[type, object] = {}


def exact_attention(module, base: str):
    """The exact attention function the stock model calls for implementation ``base``.

    For ``eager``, the model's own ``eager_attention_forward`` (the one its
    modeling module defines, which the model falls back to: Gemma's applies
    the logit softcap), else Llama's; for ``sdpa``, transformers'
    ``sdpa_attention_forward``.
    """
    if base != "eager":
        return BASE_ATTENTION[base]
    cls = type(module)
    if cls not in _MODULE_EAGER:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        _MODULE_EAGER[cls] = fn if callable(fn) else BASE_ATTENTION["eager"]
    return _MODULE_EAGER[cls]


def _refuse_unsupported(module, kwargs: dict) -> None:
    """Refuse, by name, attention features the Hajek estimate does not model."""
    if kwargs.get("s_aux") is not None:
        raise ValueError("kvcert: attention sinks (learned per-head sink logits, s_aux) are not supported")
    if kwargs.get("position_bias") is not None:
        raise ValueError("kvcert: an additive position bias in the attention scores (ALiBi, relative position "
                         "bias) is not supported")
    if getattr(module, "is_causal", True) is False:
        raise ValueError("kvcert: non-causal attention (bidirectional or cross-attention) is not supported")


# ---------------------------------------------------------------------------------------------
# the session: what a press context owns and the attention function calls
# ---------------------------------------------------------------------------------------------
class Session:
    """One active press on one model.

    Parameters
    ----------
    press : object
        Anything with ``kind`` and ``delta`` (the recorded certificate; ``kind``
        None records nothing), ``prefill_event(layer, layer_idx, queries, scale)``
        and ``decode_event(layer, layer_idx, queries, scale)``.
    base : str
        The exact attention of prefills (``"sdpa"`` or ``"eager"``).
    config : the model's config (the key :func:`active_session` finds it by)
    cache_keyword : str
        The model forward's cache argument (``past_key_values`` or ``cache``).
    """

    def __init__(self, press, base: str, config, cache_keyword: str = "past_key_values"):
        from .fast import estimate_options

        self.press, self.base, self.config, self.cache_keyword = press, base, config, cache_keyword
        self.kind, self.delta = press.kind, press.delta
        self.options = estimate_options(self.kind) if self.kind is not None else {"per_coordinate": False}
        self.n_layers = config.get_text_config(decoder=True).num_hidden_layers
        layout = attention_layout(config)
        #: model indices of the layers the press compresses (full attention): the certificates' layer axis
        self.compressed = tuple(i for i, w in enumerate(layout) if w is None)
        if len(self.compressed) < len(layout) and getattr(press, "decides_every_layer", False):
            raise ValueError(f"{type(press).__name__} decides for every layer at once; models with sliding-window "
                             "layers (left uncompressed) are not supported by it: use PoissonPress")
        self.cache = None
        self.mask2d: torch.Tensor | None = None
        self.input_ids: torch.Tensor | None = None
        self.recorder: Recorder | None = self._new_recorder()
        self._real: dict[int, torch.Tensor | None] = {}  # q_len -> the new tokens' real mask of this forward
        self._norms: list[torch.Tensor] = []  # this forward's decode output norms (the NaN check)
        self._backend: dispatch.Route | None = None  # the token route resolved for the forward
        #: the press's decode event, None where it has none that does anything (``compresses_at_decode``):
        #: resolved here, so a press's own decode_event is the one it has when its context opens
        self._decode_event = press.decode_event if getattr(press, "compresses_at_decode", True) else None
        #: decoding a compressed context after the press context closed (query-agnostic protocol,
        #: :class:`Carrier`): no press events, one record per question
        self.carried = False
        #: the carried questions answered so far: (question tokens, their Recorder), oldest first
        self.answers: list[tuple[int, Recorder]] = []
        self._question_tokens: int | None = None

    def _new_recorder(self) -> Recorder | None:
        return Recorder(self.kind, self.delta, getattr(self.press, "target_error", None)) \
            if self.kind is not None else None

    @property
    def certificates(self) -> Certificates | None:
        """The record of the current (or last) sequence, or None."""
        return None if self.recorder is None else self.recorder.result()

    def new_question(self) -> None:
        """Start the record of a new question over the carried context (query-agnostic protocol)."""
        self.recorder = self._new_recorder()
        self._question_tokens = None
        if self.recorder is not None:
            self.answers.append((0, self.recorder))

    def answer_certificates(self) -> list[Certificates]:
        """One record per question answered over the carried context, oldest first: row s is the
        forward that produced answer token s (the question's last query for s = 0). A context of
        one sequence gives (steps, layers, heads) tensors, a batch (batch, steps, layers, heads)."""
        out = []
        for q, recorder in self.answers:
            c = recorder.result()
            if c is None or q == 0:
                continue
            if c.radius.shape[0] == 1:
                c = c[0]
                cut = lambda x, q=q: x[q - 1:]  # noqa: E731
            else:
                cut = lambda x, q=q: x[:, q - 1:]  # noqa: E731
            out.append(c.map(cut))
        return out

    # -- per forward --------------------------------------------------------------------------
    def begin_forward(self, args: tuple, kwargs: dict) -> None:
        """Before each model forward (the context's pre-hook): give the model a kvcert cache,
        note the 2-D padding mask, and start a new record when a new sequence begins."""
        cache = None
        for name in ("cache", "past_key_values"):
            if kwargs.get(name) is not None:
                cache = kwargs[name]
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = KVCertCache(self.config)
            kwargs[self.cache_keyword] = cache
        elif cache is not None:
            as_kvcert_cache(cache, self.config)
        if cache is not None and cache.get_seq_length() == 0:
            self.recorder = self._new_recorder()  # a new sequence
        self.cache = cache
        mask = kwargs.get("attention_mask")
        if mask is None and len(args) > 1 and isinstance(args[1], torch.Tensor):
            mask = args[1]
        self.mask2d = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        #: (b, q) token ids of this forward, or None (inputs_embeds): a prefill leaves them on its
        #: layers (``KVCertLayer.token_ids``) for designs keyed by the prompt (the block design's event)
        self.input_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
        self._real, self._norms, self._backend = {}, [], None

    def end(self) -> None:
        self.cache, self.mask2d, self.input_ids = None, None, None

    def _real_new(self, q_len: int) -> torch.Tensor | None:
        """(b, q_len) bool: which of the new tokens are real (from the 2-D attention mask), or None
        when all are. Read once per forward (one host synchronisation), not per layer."""
        if q_len not in self._real:
            m = self.mask2d
            real = None
            if m is not None and m.shape[1] >= q_len:
                real = m[:, -q_len:].bool()
                if bool(real.all()):
                    real = None
            self._real[q_len] = real
        return self._real[q_len]

    def _record(self, layer_idx: int, estimate, kept, sketch: float = 0.0) -> torch.Tensor | None:
        """Keep the certificate statistics of one layer's estimate (and the memory of the sketch it read,
        in kept-token units); returns its output norms."""
        if self.recorder is None:
            return None
        stats = certificate_moments(estimate, self.kind)
        self.recorder.add(layer_idx, stats, kept, sketch)
        return stats["output_norm"]

    # -- per layer ----------------------------------------------------------------------------
    def layer(self, layer_idx: int) -> KVCertLayer:
        layer = self.cache.layers[layer_idx]
        if not isinstance(layer, KVCertLayer):
            raise RuntimeError(f"kvcert: cache layer {layer_idx} is a {type(layer).__name__}, not a KVCertLayer")
        return layer

    def prefill(self, layer: KVCertLayer, layer_idx: int, queries: torch.Tensor, scale: float) -> None:
        """The prefill event of one layer: record the exact step-0 row (radius 0), then let the press compress."""
        if self.recorder is not None:
            self._record(layer_idx, _exact_estimate(queries.shape[0], queries.shape[1], layer.values.shape[-1],
                                                    queries.device), layer.kept)
        self.press.prefill_event(layer, layer_idx, queries, scale)

    def prefill_recorded(self, cache, query_window) -> None:
        """The prefill event on a cache filled by ``kvcert.prefill`` (queries recorded in its layers)."""
        self.cache = cache  # the press context's carrier (query-agnostic protocol) carries this cache
        for idx, layer in enumerate(cache.layers):
            if not layer.compressible:  # a sliding-window layer: never compressed
                continue
            queries, scale = layer.queries, getattr(layer, "query_scale", None)
            layer.queries = None
            if queries is None or scale is None:
                raise ValueError("prefilled: the cache holds no recorded queries (make it with kvcert.prefill)")
            need = self.press.queries_needed(layer.physical_length)
            if need > queries.shape[2]:
                raise ValueError(
                    f"prefilled: {self.press!r} reads {need} prefill queries but kvcert.prefill kept "
                    f"{queries.shape[2]} (query_window={query_window}); call "
                    "kvcert.prefill(..., query_window=None) to keep all of them"
                )
            self.prefill(layer, idx, queries, scale)

    def attend(self, module, query, key, value, attention_mask, scaling, dropout, **kwargs):
        """The attention of one layer under the press: exact prefill, or the Hajek decode; a
        sliding-window layer exactly as the stock model attends it."""
        _refuse_unsupported(module, kwargs)
        layer_idx = module.layer_idx
        layer = self.layer(layer_idx)
        if not layer.compressible:
            real = self._real_new(query.shape[2])
            if real is not None:
                layer.mark_padding(real)
            return exact_attention(module, self.base)(module, query, key, value, attention_mask, scaling=scaling,
                                                      dropout=dropout, **kwargs)
        if kwargs.get("sliding_window") is not None:
            raise ValueError(f"kvcert: layer {layer_idx} attends with a sliding window but the config makes it a "
                             "full-attention layer; pass the model's config to KVCertCache / as_kvcert_cache")
        softcap = kwargs.get("softcap")
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        q_len = query.shape[2]
        real = self._real_new(q_len)
        if layer.length_before_update == 0:  # prefill: exact attention, then compress
            if real is None:
                real = _real_from_4d(attention_mask, key.shape[-2])
            if real is not None:
                layer.mark_padding(real)
            ids = self.input_ids
            layer.token_ids = ids if ids is not None and tuple(ids.shape) == (key.shape[0], key.shape[-2]) else None
            out, weights = exact_attention(module, self.base)(module, query, key, value, attention_mask,
                                                              scaling=scaling, dropout=dropout, **kwargs)
            self.prefill(layer, layer_idx, query, scaling)
            return out, weights
        if real is not None:
            layer.mark_padding(real)
        out = self._decode(layer, layer_idx, query, scaling, softcap)
        if not self.carried:  # the query-agnostic protocol compresses the context only
            if self._decode_event is not None:
                self._decode_event(layer, layer_idx, query, scaling)
        elif self._question_tokens is None and self.answers:  # the question's forward: note its length
            self._question_tokens = q_len
            self.answers[-1] = (q_len, self.answers[-1][1])
        if out.dtype != query.dtype:
            out = out.to(query.dtype)
        return out.contiguous(), None

    def _decode(self, layer: KVCertLayer, layer_idx: int, query: torch.Tensor, scale: float,
                softcap: float | None = None) -> torch.Tensor:
        r"""Hajek attention over the held slots and its certificate statistics; returns (b, q, h_q, dv).

        One entry for every design: :func:`kvcert.dispatch.decode` picks the route from what the
        layer holds (token, block or sketch; :func:`kvcert.dispatch.decode_route`) and returns the
        output and the statistics to record. With a logit softcap c the scores are
        :math:`c\tanh(\tau q\cdot k_i/c)` (the model's eager attention's; token route only).

        The per-step path has no host synchronisation per layer: every route runs with
        ``validate=False`` (log pi was checked when the eviction event installed it,
        :meth:`KVCertLayer.replace`), the certificate's radii are computed when the record is
        read (:class:`Recorder`), and the outputs of all layers are checked for NaN once, at the
        last layer. The token route's backend is resolved once per forward.
        """
        dec = dispatch.decode(query, layer, scale=scale, options=self.options, kind=self.kind, delta=self.delta,
                              softcap=softcap, backend=self._backend)
        self._backend = dec.backend
        norms = None
        if self.recorder is not None:
            for r in dec.records:
                if r.kept.dim() == 3:  # a chunk of queries: one step each
                    self.recorder.add_steps(layer_idx, certificate_moments(r.estimate, self.kind), r.kept)
                else:
                    norms = self._record(layer_idx, r.estimate, r.kept, r.memory)
        self._check_finite(layer_idx, dec.output, norms if len(dec.records) == 1 else None)
        hook = getattr(self.press, "after_decode", None)  # a press that acts on the step (cell recompute)
        if hook is not None:
            return hook(self, layer, layer_idx, query, scale, dec, dec.output, softcap)
        return dec.output

    def _check_finite(self, layer_idx: int, output: torch.Tensor, norms: torch.Tensor | None = None) -> None:
        """Collect each layer's output norms; at the last layer, one check for NaN over all of them."""
        self._norms.append(torch.linalg.vector_norm(output.detach(), dim=-1) if norms is None else norms)
        if layer_idx >= self.compressed[-1] or layer_idx + 1 >= len(self.cache.layers):
            norms, self._norms = torch.cat([x.flatten() for x in self._norms]), []
            if bool(torch.isnan(norms).any()):
                raise ValueError("kvcert: the Hajek attention output is NaN at this decoding step: the model's "
                                 "queries, keys and values (and the log inclusion probabilities) must be finite")


# ---------------------------------------------------------------------------------------------
# the carried cache: decoding a compressed context after its press context closed
# ---------------------------------------------------------------------------------------------
class Carrier:
    """Keeps a compressed cache decodable with the Hajek estimate after ``with press(model):`` ends.

    kvpress's pipeline (and kvcert's query-agnostic protocol, :func:`kvcert.answer`)
    compresses the context under the press, then decodes each question
    *outside* the press context. The cache carries what that needs: its
    layers hold log pi beside K/V, and the carrier, made by the press context
    when it closes over a cache that holds tokens, routes every later forward
    over *that* cache (and no other) to the press's session:

    - before the forward (a pre-hook on the decoder model): the session is
      activated for the model and the model's attention switched to
      ``"kvcert"`` for this forward only; a forward that finds the cache at
      its mark (the compressed context) starts the record of a new question;
    - after it (a hook that also runs when the forward raises): the previous
      attention implementation is back, the session deactivated.

    No press event runs on the carried cache: the question and the answer
    are never compressed (kvpress's pipeline semantics). When the cache is
    changed from outside between two forwards (kvpress's pipeline trims
    ``layer.keys`` / ``layer.values`` after each answer), every layer returns
    to the compressed context (:meth:`KVCertLayer.restore_mark`), so the next
    question starts from it. The hooks go away with the cache (a weak
    reference) or with :meth:`close`. A press context active on the model
    takes precedence: the carrier then does nothing.
    """

    def __init__(self, session: Session, module, cache):
        self.session, self.config = session, session.config
        self._cache = weakref.ref(cache)
        for layer in cache.layers:
            layer.mark()
        self._seen = self._held(cache)
        self._previous = None
        self._active = False
        session.carried = True
        self._handles = [module.register_forward_pre_hook(self._before, with_kwargs=True),
                         module.register_forward_hook(self._after, with_kwargs=True, always_call=True)]
        self._finalizer = weakref.finalize(cache, _remove_handles, list(self._handles))

    @staticmethod
    def _held(cache) -> list:
        return [(layer.keys, layer.values) for layer in cache.layers]

    @property
    def cache(self):
        """The carried cache (None once it is gone)."""
        return self._cache()

    def restore(self) -> None:
        """Return every layer of the carried cache to the compressed context."""
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the carried cache no longer exists")
        for layer in cache.layers:
            layer.restore_mark()
        self._seen = self._held(cache)

    def close(self) -> None:
        """Remove the hooks: the cache is no longer routed to the session."""
        self._finalizer()

    def _before(self, module, args, kwargs):
        cache = next((kwargs[n] for n in ("cache", "past_key_values") if kwargs.get(n) is not None), None)
        if cache is None or cache is not self._cache() or active_session(self.config) is not None:
            return None
        held = self._held(cache)
        if any(a is not b or c is not d for (a, c), (b, d) in zip(held, self._seen)) or len(held) != len(self._seen):
            self.restore()  # changed from outside (kvpress trims the answer): back to the context
        if all(layer.at_mark for layer in cache.layers):
            self.session.new_question()
        activate(self.session)
        self._previous = self.config._attn_implementation
        self.config._attn_implementation = ATTENTION_NAME
        self._active = True
        self.session.begin_forward(args, kwargs)
        return None

    def _after(self, module, args, kwargs, output):
        if not self._active:
            return None
        self._active = False
        cache = self._cache()
        if cache is not None:
            self._seen = self._held(cache)
        self.config._attn_implementation = self._previous
        deactivate(self.session)
        return None


def _remove_handles(handles) -> None:
    for h in handles:
        h.remove()


def carry(session: Session, module) -> "Carrier | None":
    """A :class:`Carrier` for the cache of the session's last forward, if it holds tokens in
    :class:`KVCertLayer` layers (called by the press context when it closes); else None."""
    cache = session.cache
    if cache is None or not getattr(cache, "layers", None) or cache.get_seq_length() == 0:
        return None
    if not all(isinstance(layer, KVCertLayer) and layer.is_initialized for layer in cache.layers):
        return None
    return Carrier(session, module, cache)


_SESSIONS: dict[int, Session] = {}


def activate(session: Session) -> None:
    """Make ``session`` the one the attention function finds for its model (presses do not nest)."""
    if id(session.config) in _SESSIONS:
        raise RuntimeError("a kvcert press is already active on this model (presses do not nest)")
    _SESSIONS[id(session.config)] = session


def deactivate(session: Session) -> None:
    """Undo :func:`activate`."""
    if _SESSIONS.get(id(session.config)) is session:
        del _SESSIONS[id(session.config)]
    session.end()


def active_session(config) -> Session | None:
    """The session of the press active on the model with this config, or None."""
    return _SESSIONS.get(id(config))


def _real_from_4d(attention_mask, n: int) -> torch.Tensor | None:
    """Real keys of a prefill, read off the last query row of a 4-D mask."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or attention_mask.shape[-1] != n:
        return None
    row = attention_mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2


def _exact_estimate(b: int, h_q: int, dv: int, device):
    """An estimate with every variance statistic 0 (the exact prefill step: radius 0 for every kind)."""
    from .fast import Estimate

    zeros = torch.zeros(b, h_q, device=device)
    return Estimate(output=torch.zeros(b, h_q, dv, device=device), weights=None,
                    variance=torch.zeros(b, h_q, dv, device=device), trace=zeros, lse=zeros, n_eff=None,
                    max_term=zeros, covariance=torch.zeros(b, h_q, dv, dv, device=device), tail_moment=zeros)


# ---------------------------------------------------------------------------------------------
# the registered functions
# ---------------------------------------------------------------------------------------------
def kvcert_mask(*args, **kwargs):
    """Mask function registered as ``"kvcert"``: the base mask for a prefill, else None; the
    sliding-window mask (``local_size`` given) always the base one (those layers attend exactly)."""
    session = active_session(kwargs.get("config"))
    base = session.base if session is not None else _DEFAULT_BASE
    if kwargs.get("local_size") is not None:
        return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)
    if session is not None and session.cache is not None and session.cache.get_seq_length() > 0:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)


def kvcert_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    r"""Attention function registered as ``"kvcert"`` (transformers ``AttentionInterface``).

    Decoding computes the Hajek estimate over the compressed cache,

    .. math:: \hat o = \sum_{i \in S} a_i v_i, \qquad
              a_i = \operatorname{softmax}_S(\tau\, q \cdot k_i - \log \pi_i),

    with :math:`\log\pi_i` from the cache layer (-inf on padding), and records
    its certificate; the prefill is exact attention followed by compression
    (:meth:`Session.attend`). Without an active press (or without a cache)
    it is the model's base attention.

    Parameters
    ----------
    module : the attention module (``layer_idx``, ``config``, ``num_key_value_groups``)
    query : (b, h_q, q, d)
    key, value : (b, h_kv, n, d), the layer's cache after the update
    attention_mask : the mask built by :func:`kvcert_mask` (a base mask or None)
    dropout : float, only 0 is meaningful (inference)
    scaling : float, default 1/sqrt(d)

    The argument order is that of transformers' ``sdpa_attention_forward``
    (``dropout`` sixth), which wrappers such as kvpress's attention patch
    pass positionally.

    Returns
    -------
    (attn_output (b, q, h_q, d), attn_weights or None)
    """
    session = active_session(getattr(module, "config", None))
    if session is None or session.cache is None:
        base = exact_attention(module, session.base if session is not None else _DEFAULT_BASE)
        return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return session.attend(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


AttentionInterface.register(ATTENTION_NAME, kvcert_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, kvcert_mask)
