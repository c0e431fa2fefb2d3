"""The randomized design of the paper as a press: :class:`PoissonPress` (token design, optional sketch)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..fast import SCORERS, TokenDesign, compact, default_design, default_sampling, nonnegative_importance, preset_fields
from ..fast.options import declare_fields
from ..fast import design as _fast_design
from .allocation import check_allocation, head_budgets, hold_prefill
from .base import (BasePress, RowEvent, accept_kvpress_names, held_design, real_slots, records_given, row_slots,
                   row_tokens)
from .kvpress_interop import is_kvpress_scorer, KvpressInputs, row_slice
from .recompute import CellRecompute, check_recompute_threshold
from .scorer import ScorerPress


@dataclass
@declare_fields(TokenDesign, ("top_fraction", "floor", "scorer", "seed", "observation_window", "kernel_size", "sketch",
                              "kind", "target_error", "sampling", "kv_bits", "kv_layout", "quantized_bound"),
                sketch="auto", kind=None, sampling="auto")
class PoissonPress(BasePress):
    r"""Randomized eviction with known inclusion probabilities (by default the recommended design: the
    paper's sample plus a tilted sketch of the evicted tokens, at equal memory).

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
    compression_ratio, target_size, sinks, window, delta
        See :class:`BasePress`. Defaults: sinks 4, window 32 (the last 32
        tokens), delta 0.05.
    kind : str, optional
        Certificate kind. Default (None): ``tilted_hull`` with the default sketch (the recommended design),
        ``chebyshev`` with a sketch named or ``sketch=None``. A kind other than ``tilted_hull`` with the
        default sketch certifies the paper's design (no sketch): ``PoissonPress(kind="chi2")``
        (:func:`kvcert.fast.default_design`).
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
    sketch : ``"auto"`` (default), None, ``"cluster"``, ``"tilted"`` or a ``kvcert.fast.ClusterDesign``
        ``"auto"``: the recommended design, ``sketch="tilted", kind="tilted_hull"`` (docs/theory.md
        section 8; under :class:`DecodingPress` the paper's design, whose events compose). None: the paper's
        design (no sketch), by name. Otherwise keep a sketch of the evicted tokens (the cluster design,
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
        slice). Both record ``kind="chebyshev"`` (a design whose ``radius`` is
        ``"chebyshev"``); ``sketch="tilted", kind="tilted_hull"`` records the
        recommended design's rule instead, :math:`\min(3\sqrt{V}, H)`,
        :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})` (the sketch's hybrid variance or the
        sample's HT trace, the larger)
        (the design of ``kvcert.reference.evict_and_certify(design=None)``,
        docs/theory.md section 8). One eviction event per layer (no DecodingPress). A budget that cannot
        hold the sketch and one token evicts nothing.
    target_error : float > 0, optional
        An error target instead of ``compression_ratio``/``target_size``
        (give one of the three): at the prefill event each layer, batch row
        and KV head keeps the smallest budget B (an integer, a sketch's
        memory counted) whose *predicted* relative radius for the
        observation-window queries is at most eps,

        .. math:: \rho(B) = r_{\text{kind}}\Bigl(\delta;\ \frac{1}{m}\sum_{q}
                  \frac{\sum_i (1/\pi_i(B) - 1)\, p_{qi}^2 \lVert v_i - o_q\rVert^2}
                  {\lVert o_q\rVert^2}\Bigr) \le \varepsilon,

        the design variance of the Hajek estimate computed over the full
        cache, every token still visible (:func:`kvcert.fast.target_budget`,
        docs/theory.md section 9). The certificate recorded at decode is the
        design's own; ``result.certificates.exceeds(eps)`` marks the steps
        whose recorded radius exceeds the target, and
        ``result.certificates.summary()`` reports the kept fraction chosen.
        The budgets of the last prefill: :attr:`chosen_budgets`. Prefill
        events only (not under :class:`DecodingPress`).
    sampling : {"auto", "poisson", "systematic"}
        How the tail is drawn given pi (:class:`kvcert.fast.TokenDesign`): ``"poisson"``, independently (the
        paper's); ``"systematic"``, randomized systematic sampling with the same pi, so every (layer, row, KV
        head) keeps :math:`\lfloor B \rfloor` or :math:`\lceil B \rceil` tokens
        (:func:`kvcert.fast.systematic_sample`; docs/theory.md section 7.7): no head's count exceeds the
        budget, so a paged engine's compaction pads nothing. ``"auto"`` (default): systematic with the
        recommended design's sketch (``"tilted"``, whatever the kind), Poisson for the paper's design and the
        other sketches (:func:`kvcert.fast.default_sampling`);
        after construction the field holds the resolved name.
    kv_bits : {16, 8, 4, "auto"}
        Bits per stored key and value element (:class:`kvcert.fast.TokenDesign`); 16 (default) stores them
        unquantized. At 8 or 4 the budget keeps its meaning (the memory of B 16-bit tokens, scales included),
        the prefill event samples about 16/b times the tokens and the cache stores the kept ones as int8 codes
        (int4: one code per byte, not packed) with float16 scales (:attr:`kvcert.cache.KVCertLayer.quantized`);
        the decode dequantizes them (the compiled CPU op's pass where it fits, else torch) and records the
        certificate of
        ``kvcert.reference.evict_and_certify(kv_bits=...)``: :math:`B_q + r` or the rule on :math:`V + V_q`
        (docs/quantized.md section 9). Prefill events only (not under :class:`DecodingPress`), a trace-only
        kind (``chebyshev``, ``tilted_hull``), no error target, no logit softcap; tokens decoded after the event
        are held at 16 bits. ``"auto"``: each layer's prefill event chooses the width of the smallest
        predicted certificate at the budget's memory, summed over the batch rows and KV heads (one width per
        layer: a cache layer stores one), then runs exactly that width's event
        (:meth:`kvcert.fast.TokenDesign.choose_bits`, docs/quantized.md section 11); :attr:`chosen_bits` holds
        each layer's width, :attr:`bits_choices` each (layer, row)'s predictions. Not with an ``allocation``.
    kv_layout : {"channel", "token", "values"}
        What the quantized cache stores (default ``"channel"``: keys per channel and group of 32 kept tokens).
    quantized_bound : {"variance", "strict"}
        The certificate's rounding term (default ``"variance"``: stochastic rounding, V_q added to the variance;
        ``"strict"``: round to nearest, B_q added to the radius).

    preset : str, optional
        A named design of :data:`kvcert.fast.TOKEN_DESIGNS` (``"paper"``, ``"recommended"``, or one
        registered with :func:`kvcert.fast.register_design`): its fields replace those not named here (the
        budget and the seed are always this press's), e.g. ``PoissonPress(compression_ratio=0.5,
        preset="paper")`` is ``PoissonPress(compression_ratio=0.5, sketch=None)``. The same name serves the
        design in the vLLM plugin (``KVCertConfig(preset=...)``, the request option ``kvcert_preset``).
    allocation : {None, "neyman"}
        None (default): every (layer, KV head) keeps the budget B of ``compression_ratio`` / ``target_size``.
        ``"neyman"``: per batch row, budgets per (layer, KV head) from the design's predicted relative variance
        for the observation-window queries (the target rule's prediction, summed over heads and minimized,
        :mod:`kvcert.fast.allocation`), at the memory of the uniform budget (round(B) kept tokens per head, in
        total), none below the floor :math:`\max(\text{sinks} + \text{window} + 1, \lceil\phi B\rceil)`;
        each head is then sampled at its budget. The paper's design (no sketch; ``sketch="auto"`` resolves to
        it), kinds of ``kvcert.fast.TARGET_KINDS``, prefill events only (not under :class:`DecodingPress`).
        The layers are held until the last compressible layer's prefill, whose event allocates and evicts them
        all (the whole prefill cache at once, as :func:`kvcert.prefill` holds it;
        :mod:`kvcert.presses.allocation`). :attr:`allocations` holds each row's ``RowAllocation``.
    allocation_floor : float in [0, 1]
        :math:`\phi`, each head's floor as a share of the uniform budget (default 0.5).
    allocation_step : int >= 1
        Spacing of the budgets the allocation compares per head (default 4; 1: every budget).
    recompute_threshold : float >= 0, optional
        Cell recompute (the paper's T4, :mod:`kvcert.presses.recompute`): keep each compressed layer's full
        prefill K/V aside and, at every decoding step, answer each (layer, query head) cell whose recorded
        relative radius is at least the threshold (or NaN) by exact attention over the full cache (the
        prefill's tokens and those decoded since); the certificates recorded stay the Hajek estimate's.
        :attr:`recompute_share`: per batch row, the share of (step, layer, KV head) reads recomputed. 16-bit
        caches, prefill events only (not under :class:`DecodingPress`), no logit softcap. Default None: no
        recompute.

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
    >>> press.kind, press.sketch.clusters, press.window, press.top_fraction
    ('tilted_hull', 8, 32, 0.5)
    >>> kvcert.PoissonPress(compression_ratio=0.5, sketch=None).kind   # the paper's design
    'chebyshev'
    """

    # the fields (top_fraction, floor, scorer, seed, observation_window, kernel_size, sketch, kind,
    # target_error, sampling) are TokenDesign's, declared by declare_fields below the class; preset is the press's
    preset: str | None = None
    allocation: str | None = None
    allocation_floor: float = 0.5
    allocation_step: int = 4
    recompute_threshold: float | None = None

    _randomized = True

    #: the press fields the :class:`kvcert.fast.TokenDesign` holds (and checks)
    _design_fields = ("compression_ratio", "target_size", "seed", "sinks", "window", "top_fraction", "floor",
                      "observation_window", "scorer", "kernel_size", "delta", "kind", "sketch", "target_error",
                      "sampling", "kv_bits", "kv_layout", "quantized_bound")
    #: the certificate kinds a quantized cache records (its radius is recorded as a trace, radius = c sqrt(trace))
    _QUANTIZED_KINDS = ("chebyshev", "tilted_hull")

    def __post_init__(self):
        s = self.scorer
        if not isinstance(s, str) and not isinstance(s, ScorerPress) and not is_kvpress_scorer(s) \
                and not callable(s):
            raise TypeError(f"scorer must be a registry name {tuple(SCORERS)}, a ScorerPress instance (kvcert's, "
                            f"or kvpress's: an object with score(module, hidden_states, keys, values, attentions, "
                            f"kwargs)) or a callable, got {type(s).__name__}")
        self._layer_inputs = {}  # layer -> (attention module, its forward kwargs) of the forward under way
        if self.preset is not None:  # a named design's fields, under those given
            for name, value in preset_fields(self.preset).items():
                if name not in self.__dict__.get("_given", ()):
                    setattr(self, name, value)
        #: (layer, batch row) -> the kvcert.fast.TargetBudget its last prefill event chose (target_error only)
        self.chosen_budgets = {}
        #: layer -> the width its last prefill event stored (kv_bits="auto" only; 16: unquantized)
        self.chosen_bits = {}
        #: (layer, batch row) -> the kvcert.fast.BitsChoice of its last prefill event (kv_bits="auto" only)
        self.bits_choices = {}
        if self.allocation is not None and isinstance(self.kv_bits, str) and self.kv_bits == "auto":
            raise ValueError(f"kv_bits='auto' and allocation={self.allocation!r} do not combine: the allocation "
                             f"predicts the 16-bit design's variance per head, 'auto' one width per layer at the "
                             f"uniform budget; use kv_bits=16 with the allocation, or allocation=None")
        #: batch row -> its kvcert.presses.allocation.RowAllocation at the last prefill (allocation only; None: a
        #: row whose uniform budget cannot hold every head's certainty set ran the uniform design)
        self.allocations = {}
        check_allocation(self)  # an allocation runs the paper's design (sketch="auto" resolved to None)
        # the defaults (sketch="auto", kind=None): the recommended design, or the paper's when a plain kind is named
        self._recommended_default = isinstance(self.sketch, str) and self.sketch == "auto" and \
            self.target_error is None
        self.sketch, self.kind = default_design(self.sketch, self.kind, target_error=self.target_error)
        self.sampling = default_sampling(self.sampling, self.sketch)
        self.sketch = held_design(self).sketch  # the fields' checks are the design's (the sketch resolved)
        self.recompute_threshold = check_recompute_threshold(self.recompute_threshold)
        if self.recompute_threshold is not None and self.kv_bits != 16:
            raise ValueError(f"recompute_threshold: cell recompute is verified on 16-bit caches only, got "
                             f"kv_bits={self.kv_bits!r}")
        if self.kv_bits != 16 and self.kind not in self._QUANTIZED_KINDS:
            raise ValueError(f"kind: a quantized cache (kv_bits={self.kv_bits}) records a trace-only certificate, "
                             f"one of {self._QUANTIZED_KINDS}; got kind={self.kind!r}")

    def _for_model(self, config) -> "PoissonPress":
        """The press that runs on a model of ``config``: itself, except that the default design (the
        recommended, sketched one) runs as the paper's design (``sketch=None, kind="chebyshev"``) on a model
        with an attention logit softcap (Gemma 2): the sketch's moments cannot carry the softcap's tanh, so
        the sketched estimate would not be of the softcapped attention. A warning says so; a sketch named
        explicitly on such a model is refused at decode."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        if not self._recommended_default or self.sketch is None or \
                getattr(text, "attn_logit_softcapping", None) is None:
            return self
        import warnings

        warnings.warn("kvcert: this model softcaps its attention logits (attn_logit_softcapping), which the "
                      "recommended design's sketch cannot carry; PoissonPress() runs the paper's design here "
                      "(sketch=None, kind='chebyshev'). Pass sketch=None to silence this.", stacklevel=3)
        paper = self.paper_design()
        paper._layer_inputs = self._layer_inputs  # the kvpress-scorer hooks write the original's
        return paper

    def paper_design(self) -> "PoissonPress":
        """This press with the paper's design in place of its own (``sketch=None, kind="chebyshev",
        sampling="poisson"``), its other fields kept: what runs where the default's sketch cannot (a
        softcapped model, :class:`DecodingPress`). The fields are resolved at construction, so all three are
        named."""
        return replace(self, sketch=None, kind="chebyshev", sampling="poisson")

    def _record_target(self, layer_idx: int, row: int, chosen) -> None:
        self.chosen_budgets[(layer_idx, row)] = chosen

    def _make_design(self) -> TokenDesign:
        fields = {name: getattr(self, name) for name in self._design_fields}
        if not isinstance(self.scorer, str):  # a ScorerPress, kvpress scorer or callable scores here
            fields["scorer"] = "snapkv"
            # the queries the scores are of: the tilt and an error target read the same window
            fields["observation_window"] = self._observation_window()
        return TokenDesign(**fields)

    @property
    def compresses(self) -> bool:
        """Whether the prefill event may remove anything (a ratio, a size or an error target)."""
        return self.design.compresses

    def _prefill_row(self, layer, r: int, queries, scale: float, *, layer_idx: int, event: int) -> RowEvent:
        """One row's prefill event: the design's whole event on the row's real tokens
        (:meth:`kvcert.fast.TokenDesign.event`: scores, budget or an error target's, decision, sketch), laid
        out here: the kept tokens packed to the front of each head (:func:`kvcert.fast.compact`), padded.
        Sets ``layer.budgets[r]`` (the sampled budget; the largest head's under a target)."""
        idx, n = real_slots(layer, r)
        design = self.design
        d, dv = layer.keys.shape[-1], layer.values.shape[-1]
        if n == 0 or not design.evicts(n, d, dv):
            layer.budgets[r] = float(n) if n == 0 or design.target_error is not None else \
                design.sampled_budget(n, d, dv)
            if design.kv_bits == 16:
                return RowEvent(row_slots(layer, r, idx))
        k, v, q_r = row_tokens(layer, r, idx, queries)
        scored = self.__dict__.get("_auto_scores", {})  # kv_bits="auto": the chooser's call of the scorer
        u = None if isinstance(self.scorer, str) or not design.evicts(n, d, dv) else scored[r] if r in scored else \
            self._prefill_importance(q_r, k, v, scale=scale, layer_idx=layer_idx, event=event, row=r, tokens=idx)
        pos = row_slots(layer, r, idx)[3]
        given = None if self.allocation is None else head_budgets(self, layer_idx, r)
        ev = design.event(q_r, k, v, scale=scale, layer=layer_idx, event=event, scores=u, positions=pos, budget=given)
        if ev.stored is not None:  # a quantized cache: the kept tokens as stored (every token when none is evicted)
            if ev.sampled:
                layer.budgets[r] = float(ev.budget)
            return RowEvent(None, ev.sketch, evicted=True, stored=ev.stored, whole=not ev.sampled)
        if ev.target is not None:
            self._record_target(layer_idx, r, ev.target)
        budget = ev.budget
        layer.budgets[r] = float(budget.max()) if isinstance(budget, torch.Tensor) else float(budget)
        if not ev.sampled:  # an error target under which no head evicts: every token kept, pi 1
            return RowEvent(row_slots(layer, r, idx))
        _, _, log_w, pos = row_slots(layer, r, idx)
        keep, pi = ev.decision.keep[None], ev.decision.pi[None]
        cc = compact(keep, k, v, log_w.exp().to(pi.dtype) * pi, pos)
        return RowEvent((cc.keys, cc.values, torch.log(cc.pi), cc.positions), ev.sketch, evicted=True)

    def prefill_event(self, layer, layer_idx: int, queries, scale: float) -> None:
        """The prefill event of one layer; under an ``allocation``, held until the last compressible layer's,
        which allocates the budgets and runs every held layer's event (:mod:`kvcert.presses.allocation`);
        at ``kv_bits="auto"``, the layer's width chosen first (:meth:`_choose_layer_bits`), then that width's
        event."""
        if self.recompute_threshold is not None:  # the full cache, kept before the event evicts
            self._cell_recompute().keep(layer, layer_idx)
        if self.allocation is None and self.kv_bits == "auto" and self.compresses:
            bits = self._choose_layer_bits(layer, layer_idx, queries, scale)
            self.chosen_bits[layer_idx] = bits
            self.__dict__["_event_design"] = held_design(self).with_bits(bits)
            try:
                return super().prefill_event(layer, layer_idx, queries, scale)
            finally:
                self.__dict__.pop("_event_design", None)
                self.__dict__.pop("_auto_scores", None)
        if self.allocation is None:
            return super().prefill_event(layer, layer_idx, queries, scale)
        session = self._session
        if session is None or session.press is not self:
            raise ValueError("allocation: PoissonPress(allocation=...) decides every layer's budgets at the prefill, "
                             "as the press of `with press(model)` or generate(press=...); it does not run under "
                             "DecodingPress")
        for held in hold_prefill(self, layer, layer_idx, queries, scale, compressed=session.compressed,
                                 importance=self._prefill_importance):
            self._compress(*held, prefill=True)

    def _cell_recompute(self) -> CellRecompute:
        """The press's cell-recompute state (one per threshold: reassigning the field starts a new one)."""
        state = self.__dict__.get("_recompute")
        if state is None or state.threshold != self.recompute_threshold:
            state = self.__dict__["_recompute"] = CellRecompute(self.recompute_threshold)
        return state

    def after_decode(self, session, layer, layer_idx: int, query, scale: float, dec, out, softcap=None):
        """The session's hook after each compressed layer's decoding step: the output, with cell recompute's
        flagged cells replaced by exact attention (``recompute_threshold``; unchanged otherwise)."""
        if self.recompute_threshold is None:
            return out
        return self._cell_recompute().apply(session, layer, layer_idx, query, scale, dec, out, softcap)

    @property
    def recompute_share(self) -> torch.Tensor | None:
        """(batch,) the share of each row's (step, layer, KV head) reads that cell recompute sent to the full
        cache in the last run; None without ``recompute_threshold`` or before a run."""
        state = self.__dict__.get("_recompute")
        return None if self.recompute_threshold is None or state is None else state.share()

    def _choose_layer_bits(self, layer, layer_idx: int, queries, scale: float) -> int:
        """``kv_bits="auto"``: the width of one layer's prefill event, the smallest sum over its batch rows and KV
        heads of the predicted totals (:meth:`kvcert.fast.TokenDesign.choose_bits` on each row's real tokens,
        recorded in :attr:`bits_choices`), ties to more bits; 16 when no row evicts at any width."""
        design = held_design(self)
        d, dv = layer.keys.shape[-1], layer.values.shape[-1]
        totals, scored = {}, {}
        self.__dict__["_auto_scores"] = scored
        for r in range(layer.keys.shape[0]):
            idx, n = real_slots(layer, r)
            if n == 0 or not design.evicts(n, d, dv):
                continue
            k, v, q_r = row_tokens(layer, r, idx, queries)
            u = self._prefill_importance(q_r, k, v, scale=scale, layer_idx=layer_idx, event=layer.events, row=r,
                                         tokens=idx)
            choice = design.choose_bits(q_r, k, v, u, scale=scale)
            self.bits_choices[(layer_idx, r)] = choice
            scored[r] = u  # the event reuses the scorer's scores (a kvpress scorer is called once per row)
            for pred in choice.predictions:
                totals[pred.bits] = totals.get(pred.bits, 0.0) + float(pred.total.sum())
        best = 16
        for bits, total in totals.items():  # KV_BITS order (16, 8, 4): strictly smaller keeps more bits on a tie
            if total < totals[best]:
                best = bits
        return best

    @property
    def design(self) -> TokenDesign:
        """The :class:`kvcert.fast.TokenDesign` of the press's fields (its budget, certainty set, scorer and
        decision); rebuilt, and so checked, when a field is reassigned. During a ``kv_bits="auto"`` layer's
        prefill event, that design at the layer's chosen width."""
        event_design = self.__dict__.get("_event_design")
        return held_design(self) if event_design is None else event_design

    @property
    def _external(self) -> bool:
        """The importance comes from a kvpress-style ``score(module, hidden_states, ...)``."""
        return not isinstance(self.scorer, (str, ScorerPress)) and is_kvpress_scorer(self.scorer)

    def __call__(self, model):
        """Context manager: ``with press(model):``; with a kvpress scorer it also hooks the
        attention modules to hand their inputs (module, hidden states, kwargs) to ``score``."""
        context = super().__call__(model)
        return KvpressInputs(self, model, context) if self._external else context

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
            return self.design.score(queries, keys, values, scale=scale, layer=layer, event=event)
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
        kw["hidden_states"] = row_slice(kwargs["hidden_states"], row, tokens)
        pe = kwargs.get("position_embeddings")
        if isinstance(pe, (tuple, list)):
            kw["position_embeddings"] = tuple(row_slice(t, row, tokens) for t in pe)
        if tokens is not None:
            kw["attention_mask"] = None  # the padding is gone; the row is one causal sequence
        hidden = kw["hidden_states"]
        if hidden.shape[1] != keys.shape[2]:
            raise ValueError(f"scorer: layer {layer_idx}'s hidden_states hold {hidden.shape[1]} tokens but its cache "
                             f"{keys.shape[2]}: a kvpress scorer needs the whole sequence in one prefill forward")
        u = s.score(module, hidden, keys, values, None, kw)
        return _checked_scores(u, keys, name, layer_idx)

    def inclusion_probabilities(self, importance: torch.Tensor, n: int | None = None, *,
                                head_dims: tuple[int, int] | None = None) -> torch.Tensor:
        """pi (..., n) this press's prefill event gives to tokens of this importance
        (every slot valid): :func:`kvcert.fast.inclusion_probabilities` with the
        press's budget and :func:`kvcert.fast.design_sizes`. A press that keeps a sketch
        samples the budget less the sketch's memory (:meth:`kvcert.fast.TokenDesign.sampled_budget`),
        which depends on the key and value head dims: give ``head_dims=(d, dv)``."""
        from .. import fast

        n = importance.shape[-1] if n is None else n
        if self.sketch is None:
            sizes = self.design_sizes(n)
        elif head_dims is None:
            raise ValueError("head_dims: this press keeps a sketch of the evicted tokens and samples the budget "
                             "less the sketch's memory, which depends on the key and value head dims: pass "
                             "head_dims=(d, dv)")
        else:
            sizes = self.design.sizes(n, budget=self.design.sampled_budget(n, *head_dims))
        return fast.inclusion_probabilities(nonnegative_importance(importance.to(torch.float64)), sizes.budget,
                                            sinks=sizes.sinks, window=sizes.window, top=sizes.top,
                                            floor=self.floor)

    def _budget(self, n: int) -> float:
        return self.design.budget(n)

    def design_sizes(self, n: int):
        """The budget and certainty set of this press's prefill event over n tokens (``design.sizes``)."""
        return self.design.sizes(n)

    def _sizes(self, budget: float):
        return self.design.sizes(0, budget=budget)  # n is not read when the budget is given

    def _evict(self, keys, values, importance, budget, *, sinks, window, top, valid, log_weights, positions,
               layer_idx, event, tilt=None, scale=None):
        return self.design.evict(keys, values, importance, budget, sinks=sinks, window=window, top=top, valid=valid,
                                 pi=log_weights.exp(), positions=positions, layer=layer_idx, event=event,
                                 sketch=self.sketch, tilt=tilt, scale=scale)

    def queries_needed(self, n: int) -> int:
        """Prefill queries the scorer reads, and at least the observation window with a tilted sketch or an
        error target."""
        need = super().queries_needed(n)
        if (self.sketch is not None and self.sketch.tilt) or self.target_error is not None or \
                self.allocation is not None or self.kv_bits == "auto":
            need = max(need, min(self._observation_window(), n))
        return need


#: ``PoissonPress(sketch=name)`` (``kvcert.fast.design.SKETCHES``): ``"cluster"`` (16 clusters, moments at q = 0)
#: and ``"tilted"`` (8 clusters, moments tilted at the observation window's mean query; about the same memory)
SKETCHES = _fast_design.SKETCHES
#: the kinds a sketched press records -> its radius rule (``kvcert.fast.design.SKETCH_KINDS``)
SKETCH_KINDS = _fast_design.SKETCH_KINDS


accept_kvpress_names(records_given(PoissonPress))


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
