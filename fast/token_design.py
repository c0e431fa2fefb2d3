"""The token design as one object (docs/design.md section 2): :class:`TokenDesign`, its decision
(:class:`TokenDecision`) and its whole eviction event (:class:`TokenEvent`), the recommended design and the
named designs (:data:`TOKEN_DESIGNS`).

The top of ``kvcert.fast``'s design layer: it uses the streams, samplers and pi solver of
:mod:`kvcert.fast.design`, the scorers, the error target, the sketch and the eviction, and nothing below
imports it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ._checks import check_int, check_kernel_size, check_nonneg_int, check_real, check_tensor
from .certificates import TILTED_HULL_MULTIPLIER
from .design import (DesignSizes, check_sampling, design_sizes, design_uniforms, draw_sample,
                     inclusion_probabilities, nonnegative_importance)
from .eviction import compact, evict as _evict
from .options import check_kind, check_scorer, scorer_params, set_fields
from .scorers import SCORERS, queries_needed, queries_read
from .sketch import ClusterDesign, as_design, cluster_sketch, window_tilt
from . import quantized as _quantized
from .bits import BitsChoice, check_kv_bits_choice, choose_kv_bits, kept_at_bits
from . import target as _target
from .target import TARGET_KINDS, check_target_error, head_tops

__all__ = ["SKETCHES", "SKETCH_KINDS", "RECOMMENDED", "RECOMMENDED_FIELDS", "RECOMMENDED_SAMPLING", "TOKEN_DESIGNS",
           "QuantizedCertificate", "TokenDecision", "TokenDesign", "TokenEvent", "quantized_decode", "quantized_op_fits", "default_design", "default_sampling", "preset_fields",
           "register_design", "resolve_sketch"]


#: ``sketch=`` by name: ``"cluster"`` (16 clusters, moments at q = 0) and ``"tilted"`` (8 clusters, moments
#: tilted at the observation window's mean query; about the same memory), both recorded as Chebyshev unless
#: the kind is ``tilted_hull`` (:data:`SKETCH_KINDS`)
SKETCHES = {"cluster": ClusterDesign(radius="chebyshev"),
            "tilted": ClusterDesign(clusters=8, radius="chebyshev", tilt=True)}


#: the kinds a sketched design records -> the radius rule (and multiplier) its ClusterDesign carries:
#: ``chebyshev`` = sqrt(V / delta); ``tilted_hull`` (the recommended design's kind, with ``sketch="tilted"``)
#: = c sqrt(V), c = ``TILTED_HULL_MULTIPLIER``; V = max(V_cl, HT trace) (``kvcert.fast.sketched_variance``); both
#: capped at the hull bound
SKETCH_KINDS = {"chebyshev": ("chebyshev", None), "tilted_hull": ("fixed", TILTED_HULL_MULTIPLIER)}


#: the recommended design's fields where they differ from the paper design's (:class:`TokenDesign`'s defaults):
#: the tilted sketch with the ``tilted_hull`` radius (docs/theory.md section 8), its tail drawn with a fixed kept
#: count per head (:func:`systematic_sample`), so a paged engine pads nothing (docs/theory.md section 7.7).
#: The design of a press or engine that names none; a value of :data:`TOKEN_DESIGNS` (``"recommended"``)
RECOMMENDED_FIELDS = {"sketch": "tilted", "kind": "tilted_hull", "sampling": "systematic"}
#: ``(sketch, kind)`` of the recommended design (:data:`RECOMMENDED_FIELDS`)
RECOMMENDED = (RECOMMENDED_FIELDS["sketch"], RECOMMENDED_FIELDS["kind"])
#: how the recommended design draws its tail (:data:`RECOMMENDED_FIELDS`); the paper's design draws Poisson
RECOMMENDED_SAMPLING = RECOMMENDED_FIELDS["sampling"]


def default_sampling(sampling, sketch) -> str:
    """``sampling`` of a press or engine from what the user named: ``"auto"`` (their default) is
    :data:`RECOMMENDED_SAMPLING` when the design keeps the recommended design's sketch (``sketch`` as
    :func:`default_design` returns it: ``"tilted"``), whatever its kind (a kind changes the radius, not the
    sample), else ``"poisson"`` (the paper's design, and the other sketches, draw as the paper does); a name
    of :data:`SAMPLINGS` is kept as given."""
    if isinstance(sampling, str) and sampling == "auto":
        return RECOMMENDED_SAMPLING if isinstance(sketch, str) and sketch == RECOMMENDED[0] else "poisson"
    return check_sampling(sampling)


def default_design(sketch, kind, *, target_error=None):
    """``(sketch, kind)`` of a press or engine from what the user named (``PoissonPress``, the vLLM plugin).

    - ``sketch="auto"`` (their default): the recommended design, :data:`RECOMMENDED` (the tilted sketch,
      kind ``tilted_hull``), unless a kind other than ``tilted_hull`` is named: that kind certifies the
      paper's design, which has no sketch (``PoissonPress(kind="chi2")`` is the paper design with chi2);
    - a sketch named (None = the paper's design, ``"cluster"``, ``"tilted"`` or a ``ClusterDesign``) and no
      kind: ``chebyshev``;
    - ``sketch="auto"`` with a ``target_error``: the paper's design (``chebyshev`` unless a kind is named):
      the target rule predicts the paper design's variance (:func:`kvcert.fast.target_budget`), not a
      sketch's hybrid variance, which is only known once the sketch is built.
    """
    if isinstance(sketch, str) and sketch == "auto":
        if target_error is not None:
            return None, ("chebyshev" if kind is None else kind)
        if kind is None or kind == RECOMMENDED[1]:
            return RECOMMENDED
        return None, kind
    return sketch, ("chebyshev" if kind is None else kind)


def resolve_sketch(sketch, kind: str):
    """A design's ``sketch=``: None, a name of :data:`SKETCHES` or a ClusterDesign-like object -> None or a
    ``kvcert.fast.ClusterDesign`` whose radius rule is the recorded ``kind``'s: ``chebyshev`` records
    sqrt(V / delta), ``tilted_hull`` (``sketch="tilted"`` only) 3 sqrt(V), V = max(V_cl, HT trace); both capped at
    the hull bound.

    Raises
    ------
    ValueError / TypeError
        An unknown name, a rule that is not the kind's, ``kind="tilted_hull"`` without the tilted sketch.
    """
    rules = SKETCH_KINDS
    if sketch is None:
        if kind == "tilted_hull":
            raise ValueError("kind='tilted_hull' is the tilted sketch's radius, min(3 sqrt(V), H): use "
                             "PoissonPress(sketch='tilted', kind='tilted_hull'); without a sketch it is "
                             "uncalibrated (use kind='chebyshev')")
        return None
    if isinstance(sketch, str):
        if sketch not in SKETCHES:
            raise ValueError(f"sketch must be None, one of {tuple(SKETCHES)} or a kvcert.fast.ClusterDesign, "
                             f"got {sketch!r}")
        sketch = SKETCHES[sketch]
        if kind == "tilted_hull" and sketch.tilt:  # the recommended design: the rule of its kind
            sketch = dataclasses.replace(sketch, radius="fixed", multiplier=rules["tilted_hull"][1])
    elif isinstance(sketch, bool) or not hasattr(sketch, "clusters"):
        raise TypeError(f"sketch must be None, one of {tuple(SKETCHES)} or a kvcert.fast.ClusterDesign, "
                        f"got {type(sketch).__name__}")
    design = as_design(sketch)
    rule = rules.get(kind)
    if rule is None or design.radius != rule[0] or (rule[1] is not None and design.multiplier != rule[1]) \
            or (kind == "tilted_hull" and not design.tilt):
        raise ValueError(f"sketch: a sketched PoissonPress records kind='chebyshev' (a design with "
                         f"radius='chebyshev': sqrt(V / delta)) or kind='tilted_hull' (sketch='tilted': "
                         f"3 sqrt(V)), V = max(V_cl, HT trace), capped at the hull bound (got kind={kind!r}, "
                         f"radius={design.radius!r}, "
                         f"multiplier={design.multiplier!r}, tilt={design.tilt!r})")
    return design


@dataclass
class TokenDecision:
    """One eviction decision of the token design over n tokens (:meth:`TokenDesign.decide`).

    Attributes
    ----------
    budget : float
        Expected kept count per head (:meth:`TokenDesign.budget`; the largest of per-head budgets); ``>= n``:
        nothing is evicted.
    sizes : DesignSizes or None
        The certainty set (:func:`design_sizes`); None when nothing is evicted.
    importance : float64 tensor (..., h_kv, n)
        The importance the probabilities were solved on (>= 0, :func:`nonnegative_importance`).
    pi : float64 tensor (..., h_kv, n)
        Inclusion probabilities (1 on the certainty set; all 1 when nothing is evicted).
    keep : bool tensor (..., h_kv, n)
        The sample (``sampling``): :math:`I_i = [U_i < \\pi_i]` (Poisson) or systematic; U from
        :func:`design_uniforms` (``row_streams=False``).
    layer, event : int
        Stream coordinates of the draw.
    """

    budget: float
    sizes: DesignSizes | None
    importance: torch.Tensor
    pi: torch.Tensor
    keep: torch.Tensor
    layer: int
    event: int

    @property
    def kept(self) -> torch.Tensor:
        """Kept tokens per head (..., h_kv), int64."""
        return self.keep.sum(-1)

    @property
    def evicts(self) -> bool:
        """Whether any token is evicted."""
        return not bool(self.keep.all())


@dataclass
class TokenEvent:
    """One eviction event of the token design on one sequence's tokens (:meth:`TokenDesign.event`): what an
    engine needs to lay out the kept tokens (the Hugging Face press a dense cache, the vLLM plugin paged blocks).

    Attributes
    ----------
    decision : TokenDecision
        pi and the sample over the sequence's (h_kv, n) tokens (nothing evicted: pi 1, every token kept).
    sketch : kvcert.fast.ClusterSketch or None
        The sketch (1, h_kv, ...) of the evicted tokens, when the design keeps one and evicts anything.
    budget : float or float64 tensor (h_kv,)
        The expected kept count sampled: :meth:`TokenDesign.sampled_budget`, or each KV head's under a
        ``target_error`` (n where no head evicts).
    target : kvcert.fast.TargetBudget or None
        What an error target chose (:meth:`TokenDesign.target_budget`); None without one.
    stored : kvcert.fast.QuantizedKV or None
        At ``kv_bits`` < 16: the kept tokens as the cache stores them (codes and 16-bit scales, packed to the
        front of each head, with their log pi and positions; :meth:`TokenDesign.store`), every token when
        nothing is evicted; what the certificate's rounding terms read (:meth:`TokenDesign.certify`). None at
        16 bits.
    bits : kvcert.fast.BitsChoice or None
        At ``kv_bits="auto"``: the width chosen (:meth:`TokenDesign.choose_bits`; :meth:`BitsChoice.shared`
        is the width stored) and each width's predictions per KV head. None at a fixed width, and where no
        width evicts (the 16-bit event: every token kept, unquantized).
    """

    decision: TokenDecision
    sketch: object
    budget: object
    target: object = None
    stored: object = None
    bits: object = None

    @property
    def kv_bits(self) -> int:
        """The width the event stored its kept tokens at (16: unquantized)."""
        return 16 if self.stored is None else int(self.stored.kv_bits)

    @property
    def evicts(self) -> bool:
        """Whether any token is evicted."""
        return self.decision.evicts

    @property
    def sampled(self) -> bool:
        """Whether the event sampled (some pi < 1; a Poisson draw may still keep every token)."""
        return self.decision.sizes is not None


@dataclass(frozen=True)
class QuantizedCertificate:
    """What :meth:`TokenDesign.certify` returns for queries over a quantized cache, per (b, h_q).

    Attributes
    ----------
    output : (b, h_q, dv) the Hajek estimate over the stored rows
    radius : (b, h_q) the certified bound on its distance from the exact attention output
    variance : (b, h_q) the variance the radius rule read (V, plus V_q with ``quantized_bound="variance"``)
    quantization_bound : (b, h_q) B_q, the deterministic bound on the rounding's effect (reported either way)
    quantization_variance : (b, h_q) V_q (0 with ``"strict"``)
    lse : (b, h_q) log Z of the Hajek softmax over the held rows (``Estimate.lse``)
    """

    output: torch.Tensor
    radius: torch.Tensor
    variance: torch.Tensor
    quantization_bound: torch.Tensor
    quantization_variance: torch.Tensor
    lse: torch.Tensor | None = None


@dataclass(frozen=True)
class TokenDesign:
    r"""The token design (docs/design.md section 2): its fields and checks, budget, decision and memory, in one object.

    Per (layer, KV head) of a sequence, at an eviction event over n tokens:
    the first ``sinks``, the last ``window`` and the ``top`` most important
    other tokens are kept with certainty (:func:`design_sizes` at the budget
    :math:`B`), every other token independently with

    .. math:: \pi_i = \min(1, \lambda u'_i), \qquad
              u'_i = (1-\alpha)\frac{u_i}{\sum_{T} u_j} + \frac{\alpha}{|T|}, \qquad \sum_i \pi_i = B,

    (:func:`inclusion_probabilities`, :math:`\alpha` = ``floor``), the
    importance u from the registered scorer ``scorer``
    (``kvcert.fast.SCORERS``; negative scores shifted per head,
    :func:`nonnegative_importance`), the sample :math:`I_i = [U_i < \pi_i]`
    from the counter-based stream keyed by (seed, layer, KV head, event)
    and indexed by token position, the same for every batch row
    (:func:`design_uniforms`, ``row_streams=False``): a sequence draws the
    same tokens alone or in any batch, in any engine.

    Parameters
    ----------
    compression_ratio : float in [0, 1)
        Fraction removed: :math:`B = n (1 - \text{ratio})` expected kept tokens (kvpress's convention).
    target_size : int >= 1, optional
        A fixed budget instead, :math:`B = \min(\text{target\_size}, n)`; give one of the two.
    seed : int >= 0
        Key of the sampling stream (and of the ``random`` scorer).
    sinks, window : int >= 0
        First and last tokens kept with certainty (shrunk to fit the budget, :func:`design_sizes`).
    top_fraction : float in [0, 1)
        Share of the free budget :math:`B - \text{sinks} - \text{window}` kept by importance with certainty.
    floor : float in (0, 1]
        Defensive mixture weight :math:`\alpha`: every tail token has :math:`\pi_i > 0`.
    observation_window : int >= 1
        Queries a window scorer reads (the last ones before the event).
    scorer : str
        A key of ``kvcert.fast.SCORERS`` (default ``"snapkv"``).
    kernel_size : odd int >= 1
        The scorer's pooling width where it has one (SnapKV, expected attention).
    delta : float in (0, 1)
        Miscoverage of the certificates.
    kind : str
        Certificate kind, a key of ``kvcert.fast.CERTIFICATE_KINDS``.
    sketch : None, ``"cluster"``, ``"tilted"`` or a ``kvcert.fast.ClusterDesign``
        Also keep a cluster sketch of each event's evicted tokens (:func:`resolve_sketch`, with the
        radius rule of ``kind``; docs/theory.md section 8). At equal memory the event samples
        :meth:`sampled_budget` tokens, the budget less the sketch's memory in kept tokens. After
        construction the field holds the resolved ``ClusterDesign`` (or None).
    target_error : float > 0, optional
        Instead of a ratio or size, an error target eps: each event keeps, per KV head, the smallest
        budget whose predicted relative radius for the observation-window queries is at most eps
        (:meth:`target_budget`, :func:`kvcert.fast.target_budget`; docs/theory.md section 9). ``kind``
        must be one of ``kvcert.fast.TARGET_KINDS``.
    sampling : {"poisson", "systematic"}
        How the tail is drawn given pi (:data:`SAMPLINGS`): ``"poisson"`` (default, the paper's design)
        independently, :math:`I_i = [U_i < \pi_i]`; ``"systematic"`` by randomized systematic sampling
        (:func:`systematic_sample`: the same pi, the same uniforms as the random order, one more as the
        start), so every head keeps :math:`\lfloor B \rfloor` or :math:`\lceil B \rceil` tokens. A paged
        engine pads every head to the largest kept count (:func:`kvcert.fast.compact_slots`): a fixed count
        wastes no memory on padding (docs/theory.md section 7.7).
    kv_bits : {16, 8, 4, "auto"}
        Bits per stored key and value element (``kvcert.fast.KV_BITS``); 16 (the default) stores them
        unquantized, exactly as without the field. Below 16 the budget keeps its meaning (the memory of B
        16-bit tokens, scales included): the event samples :meth:`sampled_budget`, about 16/b times the
        tokens (``kvcert.fast.sampled_budget``), and stores the kept ones quantized (:meth:`store`), as
        ``kvcert.reference.evict_and_certify(kv_bits=...)`` does (docs/quantized.md). ``"auto"``: each event
        chooses the width (:meth:`choose_bits`: the smallest predicted certificate at the budget's memory,
        summed over the KV heads, one width per event since a cache layer stores one) and runs exactly that
        width's event (:meth:`with_bits`), the choice in :attr:`TokenEvent.bits` (docs/quantized.md section
        11). A kind of ``kvcert.fast.TARGET_KINDS``, no ``target_error``.
    kv_layout : {"channel", "token", "values"}
        What a quantized cache stores (``kvcert.fast.KV_LAYOUTS``; default ``"channel"``: keys per channel and
        group of 32 kept tokens, values per token). Checked and unused at 16 bits.
    quantized_bound : {"variance", "strict"}
        The rounding term of the certificate at ``kv_bits`` < 16 (``kvcert.fast.QUANTIZED_BOUNDS``):
        stochastic rounding and :math:`V_q` added to the variance (default), or round to nearest and
        :math:`B_q` added to the radius (:meth:`certify`). Checked and unused at 16 bits.

    Notes
    -----
    Memory: a kept token holds its key, value and log pi; :attr:`TokenDecision.kept`
    counts them per head (:meth:`memory`). When :math:`B \ge n` nothing is
    evicted (every pi is 1). Errors name the argument, as the presses' do.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import TokenDesign
    >>> design = TokenDesign(compression_ratio=0.5, seed=0)
    >>> design.budget(200), design.sizes(200)
    (100.0, DesignSizes(budget=100.0, sinks=4, window=32, top=32))
    >>> d = design.decide(torch.rand(3, 200), layer=0)
    >>> d.keep.shape, bool((d.pi[:, :4] == 1).all())
    (torch.Size([3, 200]), True)
    """

    compression_ratio: float = 0.0
    target_size: int | None = None
    seed: int = 0
    sinks: int = 4
    window: int = 32
    top_fraction: float = 0.5
    floor: float = 0.1
    observation_window: int = 32
    scorer: str = "snapkv"
    kernel_size: int = 7
    delta: float = 0.05
    kind: str = "chebyshev"
    sketch: object = None
    target_error: float | None = None
    sampling: str = "poisson"
    kv_bits: int | str = 16
    kv_layout: str = "channel"
    quantized_bound: str = "variance"

    def __post_init__(self):
        ratio = check_real("compression_ratio", self.compression_ratio, 0.0, 1.0, hi_open=True)
        target = check_int("target_size", self.target_size, low=1, optional=True)
        if target is not None and ratio > 0:
            raise ValueError(f"give compression_ratio or target_size, not both (got compression_ratio={ratio}, "
                             f"target_size={target})")
        if self.target_error is not None:
            eps = check_target_error("target_error", self.target_error)
            if ratio > 0 or target is not None:
                raise ValueError(f"give one of compression_ratio, target_size or target_error (got "
                                 f"compression_ratio={ratio}, target_size={target}, target_error={eps})")
            set_fields(self, target_error=eps)
        set_fields(self, compression_ratio=ratio, target_size=target, seed=check_int("seed", self.seed),
             sinks=check_int("sinks", self.sinks), window=check_int("window", self.window),
             top_fraction=check_real("top_fraction", self.top_fraction, 0.0, 1.0, hi_open=True),
             floor=check_real("floor", self.floor, 0.0, 1.0, lo_open=True),
             observation_window=check_int("observation_window", self.observation_window, low=1),
             scorer=check_scorer(self.scorer), kernel_size=check_kernel_size(self.kernel_size),
             delta=check_real("delta", self.delta, 0.0, 1.0, lo_open=True, hi_open=True),
             kind=check_kind(self.kind), sampling=check_sampling(self.sampling))
        set_fields(self, sketch=resolve_sketch(self.sketch, self.kind),
                   kv_bits=check_kv_bits_choice(self.kv_bits),
                   kv_layout=_quantized.check_kv_layout(self.kv_layout),
                   quantized_bound=_quantized.check_quantized_bound(self.quantized_bound))
        if self.target_error is not None and self.kv_bits != 16:
            raise ValueError(f"kv_bits: a target_error chooses budgets from the 16-bit design's variance "
                             f"(kvcert.fast.target_budget), which does not count the rounding: use kv_bits=16 "
                             f"with a target_error (got kv_bits={self.kv_bits!r})")
        if self.kv_bits == "auto" and self.kind not in TARGET_KINDS:
            raise ValueError(f"kind: kv_bits='auto' compares the widths' predicted radii, functions of the variance "
                             f"trace: a kind of {TARGET_KINDS}; got {self.kind!r}")
        if self.target_error is not None:
            if self.sketch is not None:
                raise ValueError("sketch: a target_error chooses budgets from the paper design's variance "
                                 "(kvcert.fast.target_budget); a sketch's hybrid variance is only known once "
                                 "the sketch is built, so the two do not combine: use sketch=None")

            if self.kind not in TARGET_KINDS:
                raise ValueError(f"kind: a target_error is stated in a kind whose radius is a function of the "
                                 f"variance trace, one of {TARGET_KINDS}; got {self.kind!r}")

    # -- the budget -----------------------------------------------------------------------------
    @property
    def compresses(self) -> bool:
        """Whether an event may evict anything (a ratio > 0, a target size or a target error)."""
        return self.compression_ratio > 0 or self.target_size is not None or self.target_error is not None

    def budget(self, n: int) -> float:
        r"""Expected kept tokens per head of an event over n tokens: :math:`\min(\text{target\_size}, n)` or
        :math:`n (1 - \text{compression\_ratio})`; n with a ``target_error`` (its budget is chosen per
        KV head at the event, :meth:`target_budget`)."""
        n = check_int("n", n)
        if self.target_error is not None:
            return float(n)
        if self.target_size is not None:
            return float(min(self.target_size, n))
        return n * (1.0 - self.compression_ratio)

    def sampled_budget(self, n: int, d: int, dv: int) -> float:
        r"""The expected kept count an event over n tokens samples: :meth:`budget`, less the sketch's memory
        in kept tokens when the design keeps one and evicts anything,

        .. math:: B_{\text{sampled}} = B - \frac{e_{\text{sketch}}(d, d_v)}{d + d_v + 1},

        ``ClusterDesign.tokens(d, dv)``: :math:`(C(2d+3)+d_v+1)/(d+d_v+1)`, tilted
        :math:`(C(4d+4)+d+d_v+1)/(d+d_v+1)` (a kept token holds its key, value and log pi), so kept
        tokens plus sketch hold what B tokens hold. A budget that cannot hold the sketch and one token
        returns n: the event evicts nothing (every token kept, exact attention, radius 0), in the press
        and in the vLLM plugin alike (a short prompt is not an error).

        At ``kv_bits`` < 16 the same memory in quantized tokens, ``kvcert.fast.sampled_budget(B, d, dv,
        kv_bits, extra=sketch elements, layout=kv_layout)`` (docs/quantized.md section 6); n when the whole
        cache fits at ``kv_bits`` (every token kept, stored quantized) or the sketch leaves less than one token.
        """
        budget = self.budget(n)
        if self.kv_bits == "auto":
            raise ValueError("kv_bits: with kv_bits='auto' the sampled budget is the width's chosen at the event "
                             "(TokenEvent.bits); ask design.with_bits(bits).sampled_budget(n, d, dv)")
        if self.kv_bits != 16:
            return self._quantized_budget(n, budget, d, dv)
        if self.sketch is None or budget >= n:
            return budget
        held = self.sketch.tokens(d, dv)
        return float(n) if budget - held < 1.0 else budget - held

    def _quantized_budget(self, n: int, budget: float, d: int, dv: int) -> float:
        """:meth:`sampled_budget` at ``kv_bits`` < 16 (as ``kvcert.reference.evict_and_certify``'s):
        :func:`kvcert.fast.kept_at_bits`, n where the sketch leaves less than one token."""
        extra = 0.0 if self.sketch is None else float(self.sketch.elements(d, dv))
        kept = kept_at_bits(budget, n, d, dv, self.kv_bits, extra=extra, layout=self.kv_layout)
        return float(n) if kept is None else kept

    def sketch_of(self, keys: torch.Tensor, values: torch.Tensor, decision: "TokenDecision", *,
                  queries: torch.Tensor | None = None, scale: float | None = None):
        """The cluster sketch (:func:`kvcert.fast.cluster_sketch`) of the tokens a decision evicts, or None (no
        sketch, or nothing evicted).

        Parameters
        ----------
        keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), the tokens the decision was taken on
        decision : :meth:`decide`'s result over them
        queries : (b, h_q, T, d), the prefill's last queries; a tilted sketch tilts at the mean of the last
            ``observation_window`` of them over each KV head's group (:func:`kvcert.fast.window_tilt`)
        scale : float, the score scale (default 1/sqrt(d))
        """
        if self.sketch is None or decision.sizes is None:
            return None
        tilt = None
        if self.sketch.tilt:
            if queries is None or queries.shape[2] == 0:
                raise ValueError("queries: a tilted sketch needs the prefill's observation-window queries "
                                 "(b, h_q, T >= 1, d)")
            tilt = window_tilt(queries, keys.shape[1], window=self.observation_window)
        lead = tuple(keys.shape[:3])  # a decision on (h_kv, n) scores serves keys (1, h_kv, n, d)
        return cluster_sketch(keys, values, decision.pi.reshape(lead), decision.keep.reshape(lead), self.sketch,
                              tilt=tilt, scale=scale)

    def target_budget(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      scores: torch.Tensor, *, scale: float | None = None):
        r"""The per-KV-head budgets of an event under ``target_error`` (:func:`kvcert.fast.target_budget`
        with this design's certainty set, floor, delta and kind; a sketched design's memory counted).

        Parameters
        ----------
        queries : (b, h_q, T, d), the prefill's last queries (the last ``observation_window`` are read)
        keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), the event's tokens (no padding)
        scores : (b, h_kv, n), the scorer's scores of them
        scale : float, default 1/sqrt(d)

        Returns
        -------
        kvcert.fast.TargetBudget
        """
        if self.target_error is None:
            raise ValueError("target_budget: this design has no target_error")
        queries = check_tensor("queries", queries, ndim=(4,), floating=True)
        if queries.shape[2] == 0:
            raise ValueError("queries: a target error needs the prefill's observation-window queries "
                             "(b, h_q, T >= 1, d)")
        tokens = 0.0 if self.sketch is None else self.sketch.tokens(keys.shape[-1], values.shape[-1])
        return _target.target_budget(queries[:, :, -self.observation_window:], keys, values, scores, self.target_error,
                             delta=self.delta, kind=self.kind, sinks=self.sinks, window=self.window,
                             top_fraction=self.top_fraction, floor=self.floor, scale=scale, sketch_tokens=tokens)

    def sizes(self, n: int, *, budget: float | None = None) -> DesignSizes:
        """The budget and certainty set of an event over n tokens (:func:`design_sizes`); ``budget`` replaces
        :meth:`budget` (a design that keeps a sketch of the evicted tokens samples a smaller one)."""
        b = self.budget(n) if budget is None else budget
        return design_sizes(b, sinks=self.sinks, window=self.window, top_fraction=self.top_fraction,
                            randomized=True)

    # -- the importance -------------------------------------------------------------------------
    @property
    def query_need(self) -> str:
        """Which queries the scorer reads: ``"window"``, ``"all"`` or ``"none"`` (``Scorer.queries``)."""
        return SCORERS[self.scorer].queries

    def queries_needed(self, n: int) -> int:
        """Prefill queries the scorer reads at an event over n tokens."""
        return queries_needed(self.query_need, n, self.observation_window)

    def queries_read(self, available: int, n: int) -> int:
        """How many of the last ``available`` queries :meth:`score` passes to the scorer at an event over n
        tokens (``kvcert.fast.scorers.queries_read``)."""
        return queries_read(self.query_need, available, n, self.observation_window)

    @property
    def scorer_params(self) -> dict:
        """The scorer's hyperparameters this design sets (fields of the same name: ``kernel_size``, ``seed``);
        the others keep their registry defaults."""
        return scorer_params(self, SCORERS[self.scorer])

    def score(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None, *,
              scale: float | None = None, layer: int = 0, event: int = 0) -> torch.Tensor:
        """The scorer's (b, h_kv, n) scores of keys/values (b, h_kv, n, d) from the last queries
        (b, h_q, w, d) given (:meth:`queries_read` of them are read)."""
        queries = check_tensor("queries", queries, ndim=(4,), floating=True)
        keys = check_tensor("keys", keys, ndim=(4,), floating=True)
        w = self.queries_read(queries.shape[2], keys.shape[2])
        return SCORERS[self.scorer](queries[:, :, -w:], keys, values, scale=scale, layer=layer, event=event,
                                    **self.scorer_params)

    # -- the event ------------------------------------------------------------------------------
    def evicts(self, n: int, d: int, dv: int) -> bool:
        """Whether an event over n tokens of key/value head dims d/dv may evict anything: an error target
        over more than ``sinks + window + 1`` tokens, or a :meth:`sampled_budget` below n."""
        if self.target_error is not None:
            return self.compresses and n > self.sinks + self.window + 1
        if self.kv_bits == "auto":  # some width evicts
            return any(self.with_bits(bits).evicts(n, d, dv) for bits in _quantized.KV_BITS)
        return self.compresses and self.sampled_budget(n, d, dv) < n

    def with_bits(self, bits: int) -> "TokenDesign":
        """This design at the fixed width ``bits`` (16, 8 or 4), its other fields kept: the design an event of
        ``kv_bits="auto"`` runs once it has chosen."""
        return self if bits == self.kv_bits else dataclasses.replace(self, kv_bits=bits)

    def choose_bits(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, *,
                    scale: float | None = None) -> BitsChoice:
        """Each KV head's width of the smallest predicted certificate at this design's budget memory
        (:func:`kvcert.fast.choose_kv_bits` for the last ``observation_window`` queries, at :meth:`budget`, with
        this design's certainty set, floor, delta, kind, layout, rounding term and sketch memory); the event
        stores :meth:`BitsChoice.shared`.

        Parameters
        ----------
        queries : (b, h_q, T >= 1, d)   keys, values : (b, h_kv, n, d), (b, h_kv, n, dv), no padding
        scores : (b, h_kv, n), the scorer's scores   scale : float, default 1/sqrt(d)
        """
        queries = check_tensor("queries", queries, ndim=(4,), floating=True)
        if queries.shape[2] == 0:
            raise ValueError("queries: kv_bits='auto' predicts for the prefill's observation-window queries "
                             "(b, h_q, T >= 1, d)")
        n, d, dv = keys.shape[2], keys.shape[3], values.shape[-1]
        extra = 0.0 if self.sketch is None else float(self.sketch.elements(d, dv))
        return choose_kv_bits(queries[:, :, -self.observation_window:], keys, values, scores, self.budget(n),
                              delta=self.delta, kind=self.kind, sinks=self.sinks, window=self.window,
                              top_fraction=self.top_fraction, floor=self.floor, scale=scale, layout=self.kv_layout,
                              quantized_bound=self.quantized_bound, extra=extra)

    def event_queries(self, available: int, n: int) -> int:
        """How many of the last ``available`` prefill queries :meth:`event` reads at an event over n tokens: the
        scorer's (:meth:`queries_read`), and at least the observation window for a tilted sketch's tilt or an
        error target's prediction."""
        w = self.queries_read(available, n)
        if self.target_error is not None or self.kv_bits == "auto" or (self.sketch is not None and self.sketch.tilt):
            w = max(w, min(self.observation_window, available))
        return w

    def event(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
              scale: float | None = None, layer: int = 0, event: int = 0, head_offset: int = 0,
              scores: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              budget: torch.Tensor | None = None) -> TokenEvent:
        """One eviction event on one sequence's tokens, whole: the scores, the budget (the sampled budget,
        or each KV head's under an error target), the decision and the sketch of what it evicts. The
        Hugging Face press and the vLLM plugin call this, and only lay out its result (a dense cache,
        paged blocks).

        Parameters
        ----------
        queries : (1, h_q, w, d)
            The prefill's last queries, at least :meth:`event_queries` of them (the last are read).
        keys, values : (1, h_kv, n, d), (1, h_kv, n, dv)
            The sequence's tokens, none of them padding.
        scale : float, the attention's score scale (default 1/sqrt(d))
        layer, event, head_offset : int >= 0
            Stream coordinates (:meth:`decide`).
        scores : (1, h_kv, n), optional
            Scores of a scorer outside the registry (a press's own); default :meth:`score`.
        positions : int64 (1, h_kv, n), optional
            The tokens' positions (default 0 .. n-1): at ``kv_bits`` < 16 the rounding stream's index and the
            stored positions (:meth:`store`); unused at 16 bits.
        budget : float tensor (h_kv,), optional
            Each KV head's expected kept count, chosen by the caller in place of :meth:`sampled_budget` and of an
            error target's (a press's allocation over every layer of the sequence, ``kvcert.fast.allocation``):
            sampled as given (no sketch's memory is taken off), each at least ``sinks + window + 1`` where below
            n (:meth:`decide`); nothing evicted when every head's is >= n.

        Returns
        -------
        TokenEvent
            Nothing evicted (pi 1, no sketch) when :meth:`evicts` is False. At ``kv_bits`` < 16 its ``stored``
            holds the kept tokens quantized (every token when nothing is evicted); the sketch, when there is
            one, is taken from the unquantized tokens, as the reference takes it.
        """
        keys = check_tensor("keys", keys, ndim=(4,), floating=True)
        if keys.shape[0] != 1:
            raise ValueError(f"keys: one sequence's tokens (1, h_kv, n, d), got shape {tuple(keys.shape)}")
        n, d, dv = keys.shape[2], keys.shape[3], values.shape[-1]
        where = dict(layer=layer, event=event, head_offset=head_offset, positions=positions)
        if self.kv_bits == "auto":
            return self._auto_event(queries, keys, values, scale=scale, scores=scores, budget=budget, **where)
        if budget is not None:
            budget = self._given_budget(budget, keys.shape[1], n)  # float n: no head evicts
        if not (isinstance(budget, torch.Tensor) if budget is not None else self.evicts(n, d, dv)):
            one = torch.ones(keys.shape[1:3], dtype=torch.float64, device=keys.device)
            keep = torch.ones(one.shape, dtype=torch.bool, device=keys.device)
            decision = TokenDecision(float(n), None, one, one, keep, layer, event)
            if self.kv_bits == 16:
                return TokenEvent(decision, None, float(n))
            return TokenEvent(decision, None, float(n), stored=self.store(keys, values, decision, **where))
        u = self.score(queries, keys, values, scale=scale, layer=layer, event=event) if scores is None else scores
        target = None
        if budget is None and self.target_error is not None:
            target = self.target_budget(queries, keys, values, u, scale=scale)
            budget = target.sampled[0] if bool(target.evicts.any()) else float(n)
        elif budget is None:
            budget = self.sampled_budget(n, d, dv)
        decision = self.decide(u[0], layer=layer, event=event, budget=budget, head_offset=head_offset)
        sketch = self.sketch_of(keys, values, decision, queries=queries, scale=scale)
        if self.kv_bits == 16:
            return TokenEvent(decision, sketch, budget, target)
        return TokenEvent(decision, sketch, budget, target, self.store(keys, values, decision, **where))

    def _auto_event(self, queries, keys, values, *, scale, scores, budget, **where) -> TokenEvent:
        """:meth:`event` at ``kv_bits="auto"``: the scores, the width (:meth:`choose_bits`, shared by the KV heads;
        16 where no width evicts) and exactly that width's event on the same scores, the choice recorded."""
        if budget is not None:
            raise ValueError("budget: kv_bits='auto' chooses the width at the design's budget; per-head budgets "
                             "(an allocation) are not combined with it: use kv_bits=16, 8 or 4")
        n, d, dv = keys.shape[2], keys.shape[3], values.shape[-1]
        if not self.evicts(n, d, dv):
            return self.with_bits(16).event(queries, keys, values, scale=scale, scores=scores, **where)
        layer, event = where["layer"], where["event"]
        u = self.score(queries, keys, values, scale=scale, layer=layer, event=event) if scores is None else scores
        choice = self.choose_bits(queries, keys, values, u, scale=scale)
        chosen = self.with_bits(choice.shared()).event(queries, keys, values, scale=scale, scores=u, **where)
        return dataclasses.replace(chosen, bits=choice)

    def _given_budget(self, budget, h_kv: int, n: int):
        """:meth:`event`'s ``budget``: the (h_kv,) float64 budgets capped at n, or float n when no head is below n."""
        if not isinstance(budget, torch.Tensor) or not budget.is_floating_point() or tuple(budget.shape) != (h_kv,):
            got = tuple(budget.shape) if isinstance(budget, torch.Tensor) else type(budget).__name__
            raise ValueError(f"budget: one expected kept count per KV head, a float tensor of shape ({h_kv},), "
                             f"got {got}")
        b = budget.to(torch.float64).clamp(max=float(n))
        return b if bool((b < n).any()) else float(n)

    def store(self, keys: torch.Tensor, values: torch.Tensor, decision: TokenDecision, *, layer: int = 0,
              event: int = 0, head_offset: int = 0, positions: torch.Tensor | None = None):
        """The kept tokens of a decision as a ``kv_bits`` cache stores them (``kvcert.fast.store_kv``): packed to
        the front of each head in position order (:func:`kvcert.fast.compact`), quantized in ``kv_layout``,
        rounded stochastically (``quantized_bound="variance"``, the stream of (seed, layer, KV head +
        ``head_offset``, event) indexed by token position) or to nearest (``"strict"``). None at 16 bits.

        Parameters
        ----------
        keys, values : (1, h_kv, n, d), (1, h_kv, n, dv), the tokens the decision was taken on
        decision : :meth:`decide`'s result over them
        layer, event, head_offset : int >= 0, the stream coordinates
        positions : int64 (1, h_kv, n), optional, the tokens' positions (default 0 .. n-1)
        """
        if self.kv_bits == 16:
            return None
        if self.kv_bits == "auto":
            raise ValueError("kv_bits: kv_bits='auto' stores at the width its event chose: use "
                             "design.with_bits(bits).store(...)")
        lead = tuple(keys.shape[:3])
        if positions is None:
            positions = torch.arange(lead[2], device=keys.device).expand(lead)
        positions = check_tensor("positions", positions)
        if tuple(positions.shape) != lead or positions.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"positions must be an int64 tensor of shape {lead}, got {positions.dtype} of shape "
                             f"{tuple(positions.shape)}")
        cc = compact(decision.keep.reshape(lead), keys, values, decision.pi.reshape(lead).to(torch.float64),
                     positions.to(torch.int64))
        rounding = "stochastic" if self.quantized_bound == "variance" else "nearest"
        return _quantized.store_kv(cc.keys, cc.values, torch.log(cc.pi), cc.positions, kv_bits=self.kv_bits,
                                   layout=self.kv_layout, rounding=rounding, seed=self.seed, layer=layer,
                                   event=event, head_offset=head_offset)

    def certify(self, stored, q: torch.Tensor, *, sketch=None, scale: float | None = None,
                whole: bool = False, tail: tuple | None = None) -> "QuantizedCertificate":
        r"""The certificate of a quantized cache's Hajek estimate for queries q, from what it stores
        (docs/quantized.md section 5; ``kvcert.reference.evict_and_certify(kv_bits=...)``'s radius):

        - ``quantized_bound="strict"``: :math:`B_q + r` (:func:`kvcert.fast.quantization_bound`), r the
          kind's radius of the stored rows' trace; with a sketch :math:`\min(B_q + \min(r, H_q), H_q)`,
          r the sketch's rule on :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})`;
        - ``"variance"``: the rule on :math:`V + V_q` (:func:`kvcert.fast.quantization_variance`), capped at
          :math:`H_q` with a sketch;

        :math:`H_q` the hull bound of the stored values plus their largest value bound :math:`\max_S\epsilon_i`.
        ``whole`` (nothing evicted: the stored tokens are the whole cache, :math:`\hat o = o`): :math:`B_q`
        (strict), or the rule on :math:`V_q` capped at :math:`B_q`.

        Parameters
        ----------
        stored : kvcert.fast.QuantizedKV (b, h_kv, m, ...), e.g. :attr:`TokenEvent.stored`
        q : (b, h_q, d) queries
        sketch : kvcert.fast.ClusterSketch (b, h_kv, ...) of the evicted tokens, when the design keeps one
        scale : float, default 1/sqrt(d)
        whole : bool, the stored tokens are every token of the cache
        tail : (keys (b, h_kv, r, d), values (b, h_kv, r, dv), log_pi (b, h_kv, r)), optional
            Exact tokens held after the stored ones (appended at 16 bits since the event, e.g. decoded tokens):
            part of the estimate, with rounding terms 0 (:func:`kvcert.fast.held_rounding_terms`).

        Returns
        -------
        QuantizedCertificate
            (b, h_q) fields; float64 for a float64 q, float32 otherwise.
        """
        from .certificates import radius_from_moments
        from .estimators import hajek_attention
        from .sketch import cluster_radius, sketch_hajek_attention

        q = check_tensor("q", q, ndim=(3,), floating=True)
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        k, v = stored.dequantize(dt)
        log_pi = stored.log_pi.to(dt)
        if tail is not None:
            k, v = torch.cat([k, tail[0].to(dt)], dim=2), torch.cat([v, tail[1].to(dt)], dim=2)
            log_pi = torch.cat([log_pi, tail[2].to(dt)], dim=-1)
        b_q, v_q = _quantized.held_rounding_terms(q, stored, tail=tail, scale=scale)
        by_variance = self.quantized_bound == "variance"
        if not by_variance:
            v_q = torch.zeros_like(b_q)
        kind = self.kind if sketch is None else None
        if whole:
            est = hajek_attention(q.to(dt), k, v, log_pi=log_pi, scale=scale, per_coordinate=False)
            radius = self._rule(v_q, b_q, sketch_rule=self.sketch) if by_variance else b_q
            return QuantizedCertificate(est.output, radius, v_q, b_q, v_q, est.lse)
        if sketch is None:
            est = hajek_attention(q.to(dt), k, v, log_pi=log_pi, scale=scale, per_coordinate=False)
            trace = est.trace.to(dt)
            if by_variance:
                radius = radius_from_moments(kind, self.delta, trace=trace + v_q)
                return QuantizedCertificate(est.output, radius, trace + v_q, b_q, v_q, est.lse)
            radius = b_q + radius_from_moments(kind, self.delta, trace=trace)
            return QuantizedCertificate(est.output, radius, trace, b_q, v_q, est.lse)
        ce = sketch_hajek_attention(q.to(dt), k, v, None, sketch, log_pi=log_pi, scale=scale, delta=self.delta)
        eps = _quantized.value_bound(stored.values, dtype=dt).masked_fill(stored.log_pi == float("-inf"), 0.0)
        g = q.shape[1] // k.shape[1]   # the exact tail adds no value bound
        cap = ce.bound.to(dt) + eps.amax(dim=-1).repeat_interleave(g, dim=1)
        var = ce.variance.to(dt)
        if by_variance:
            radius = torch.minimum(cluster_radius(var + v_q, delta=self.delta, rule=ce.rule,
                                                  multiplier=self.sketch.multiplier), cap)
            return QuantizedCertificate(ce.output, radius, var + v_q, b_q, v_q, ce.estimate.lse)
        r = torch.minimum(cluster_radius(var, delta=self.delta, rule=ce.rule, multiplier=self.sketch.multiplier), cap)
        return QuantizedCertificate(ce.output, torch.minimum(b_q + r, cap), var, b_q, v_q, ce.estimate.lse)

    def _rule(self, variance: torch.Tensor, cap: torch.Tensor, *, sketch_rule) -> torch.Tensor:
        """The design's radius rule on a variance, capped: the kind's (trace only) without a sketch, the sketch's
        rule with one."""
        from .certificates import radius_from_moments
        from .sketch import cluster_radius

        if sketch_rule is None:
            return torch.minimum(radius_from_moments(self.kind, self.delta, trace=variance), cap)
        return torch.minimum(cluster_radius(variance, delta=self.delta, rule=sketch_rule.radius,
                                            multiplier=sketch_rule.multiplier), cap)

    # -- the decision ---------------------------------------------------------------------------
    def decide(self, scores: torch.Tensor, *, layer: int = 0, event: int = 0,
               budget: float | None = None, head_offset: int = 0) -> TokenDecision:
        r"""Importance -> pi -> sample for one sequence's tokens at one event.

        Parameters
        ----------
        scores : floating tensor (h_kv, n) or (b, h_kv, n)
            The scorer's scores (:meth:`score`) of n tokens, none of them padding (b rows of the same n draw
            from the same streams, as one sequence would). Negative scores are shifted per head.
        layer, event : int >= 0
            Stream coordinates (the layer index and the layer's eviction event).
        budget : float or float tensor of the leading shape (h_kv,) / (b, h_kv), optional
            Expected kept count instead of :meth:`budget` (n); a tensor gives each KV head its own (an error
            target's :attr:`kvcert.fast.TargetBudget.sampled`), each at least ``sinks + window + 1`` where it
            is below n (the certainty edges are not shrunk), the top slice sized per head.
        head_offset : int >= 0
            The layer's KV head index of ``scores``' first head (default 0): a tensor-parallel rank holding
            heads o .. o + h_kv - 1 passes o and draws, for them, what one process deciding every head draws
            (the stream is keyed by the KV head, :func:`design_uniforms`).

        Returns
        -------
        TokenDecision
            ``pi`` (:func:`inclusion_probabilities` at :meth:`sizes`) and ``keep``
            (:func:`design_uniforms` with ``row_streams=False``, counter = token position); nothing
            evicted (pi = 1, keep all) when the budget is >= n.

        Raises
        ------
        ValueError
            Scores of the wrong shape, NaN or infinite (checked whatever the budget), a budget not above the
            certainty set.
        """
        scores = check_tensor("scores", scores, ndim=(2, 3), floating=True)
        layer = check_nonneg_int("layer", layer)
        event = check_nonneg_int("event", event)
        head_offset = check_nonneg_int("head_offset", head_offset)
        n = scores.shape[-1]
        if n == 0:
            raise ValueError(f"scores must have shape (h_kv, n) or (b, h_kv, n) with n >= 1, "
                             f"got shape {tuple(scores.shape)}")
        valid = torch.ones(scores.shape, dtype=torch.bool, device=scores.device)
        u = nonnegative_importance(scores.to(torch.float64), valid)
        if isinstance(budget, torch.Tensor):
            return self._decide_per_head(u, valid, budget, layer, event, head_offset)
        b = self.budget(n) if budget is None else check_real("budget", budget, 0.0, math.inf, lo_open=True)
        if b >= n:
            one = torch.ones_like(u)
            return TokenDecision(float(b), None, u, one, valid, layer, event)
        sz = self.sizes(n, budget=b)
        lead = tuple(scores.shape[:-1])
        top = torch.full(lead, sz.top, dtype=torch.int64, device=scores.device)
        pi = inclusion_probabilities(u, b, sinks=sz.sinks, window=sz.window, top=top, floor=self.floor, valid=valid)
        return TokenDecision(float(b), sz, u, pi, self._draw(pi, layer, event, head_offset), layer, event)

    def _decide_per_head(self, u, valid, budget, layer, event, head_offset=0) -> TokenDecision:
        """:meth:`decide` with one budget per KV head (sinks and window unshrunk, top per head)."""
        lead, n = tuple(u.shape[:-1]), u.shape[-1]
        if budget.is_complex() or not budget.is_floating_point() or tuple(budget.shape) != lead:
            raise ValueError(f"budget: a per-head budget must be a float tensor of shape {lead}, got "
                             f"{tuple(budget.shape)} {budget.dtype}")
        b = budget.to(torch.float64, copy=True).to(u.device)
        low = self.sinks + self.window + 1
        if bool((~torch.isfinite(b)).any()) or bool(((b < low) & (b < n)).any()):
            raise ValueError(f"budget: every per-head budget must be finite and >= sinks + window + 1 = {low} "
                             f"(or >= n = {n}: keep all), got min {float(b.min())}")
        b = b.clamp(max=float(n))
        if bool((b >= n).all()):
            return TokenDecision(float(n), None, u, torch.ones_like(u), valid, layer, event)
        sz = design_sizes(float(b[b < n].min()), sinks=self.sinks, window=self.window,
                          top_fraction=self.top_fraction, randomized=True)
        top = torch.where(b < n, head_tops(b, self.sinks, self.window, self.top_fraction), 0)
        pi = inclusion_probabilities(u, b, sinks=sz.sinks, window=sz.window, top=top, floor=self.floor, valid=valid)
        return TokenDecision(float(b.max()), sz, u, pi, self._draw(pi, layer, event, head_offset), layer, event)

    def _draw(self, pi: torch.Tensor, layer: int, event: int, head_offset: int = 0) -> torch.Tensor:
        """The sample of pi (..., h_kv, n) by ``sampling`` from the stream (seed, layer, KV head + head_offset,
        event), every leading row on row 0's stream, counter = slot."""
        uni = design_uniforms(tuple(pi.shape), self.seed, layer=layer, event=event, device=pi.device,
                              row_streams=False, head_offset=head_offset)
        return draw_sample(self.sampling, pi, uni, self.seed, layer=layer, event=event, row_streams=False,
                           head_offset=head_offset)

    def evict(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, budget, *, sinks: int,
              window: int, top, layer: int, event: int, valid: torch.Tensor | None = None,
              pi: torch.Tensor | None = None, positions: torch.Tensor | None = None, sketch=None,
              tilt: torch.Tensor | None = None, scale: float | None = None):
        """The decision on a batch of padded rows, compacted (:func:`kvcert.fast.evict`): what a press calls.

        ``scores`` (b, h_kv, n) are shifted per head on the ``valid`` slots (:func:`nonnegative_importance`),
        then :func:`kvcert.fast.evict` runs with this design's ``floor`` and ``seed``, ``row_streams=False``;
        ``budget`` (per row and head), ``sinks``/``window`` and ``top`` (per row) are the rows'
        :meth:`sizes`, ``pi``/``positions`` the cache's (padding pi = 0 / position -1). Each row draws what
        :meth:`decide` draws on its own tokens.
        """
        u = nonnegative_importance(scores.to(torch.float64), valid)
        return _evict(keys, values, u, budget, sinks=sinks, window=window, top=top, floor=self.floor, seed=self.seed,
                     layer=layer, event=event, pi=pi, positions=positions, row_streams=False, sketch=sketch,
                     tilt=tilt, scale=scale, sampling=self.sampling)

    # -- the memory -----------------------------------------------------------------------------
    @staticmethod
    def memory(decision: TokenDecision) -> torch.Tensor:
        """Kept tokens per head (..., h_kv) int64 of a decision: each holds its key, value and log pi."""
        return decision.kept


def quantized_decode(query: torch.Tensor, layer, *, scale: float, kind: str, delta: float, op=None):
    r"""The Hajek estimate of the new tokens over a quantized layer's held slots and its certificate, per query:
    ``(outputs (b, t, h_q, dv), [(Estimate, kept (b, h_kv)) per query])``.

    The certificate is :meth:`kvcert.fast.TokenDesign.certify` of the layer's design on the stored codes and
    scales, with the exact slots after them as its tail: :math:`B_q + r` (``quantized_bound="strict"``) or the
    rule on :math:`V + V_q` (``"variance"``), capped at :math:`H_q` with a sketch, as
    ``kvcert.reference.evict_and_certify(kv_bits=...)`` certifies the event's query. Each Estimate's ``trace`` is
    the trace whose radius of ``kind`` is that radius, :math:`(\mathrm{radius}/c)^2` with :math:`c` the kind's
    radius per unit square-root trace (a trace-only norm kind: ``chebyshev``, ``tilted_hull``), so the recorder
    computes it unchanged. Query j of a chunk sees the slots at or before its position.

    Two paths, the same certificate: ``op`` (the compiled CPU op's
    ``kvcert.kernels.cpu.quantized_hajek_attention``, passed by ``kvcert.dispatch.decode``) where the layer
    fits it (:func:`quantized_op_fits`: no sketch, ``quantized_bound="variance"``, no row that kept every token,
    int8 codes (``int8``, ``int4``), CPU tensors, float32 queries): one pass over the codes gives the estimate,
    the trace and :math:`V_q` (Estimate ``route="cpu_op"``); else the torch path (``route="torch"``), which
    dequantizes the codes at every step.

    ``layer``: a ``kvcert.cache.KVCertLayer`` holding a quantized state (``quantized``, ``quantized_design``,
    ``quantized_whole``, ``log_weights``, ``positions``, ``keys`` / ``values`` of the exact slots, ``sketch``);
    its last t slots are the new tokens.
    """
    from .certificates import radius_from_moments
    from .types import Estimate

    design, stored = layer.quantized_design, layer.quantized
    m = stored.log_pi.shape[-1]
    c = float(radius_from_moments(kind, delta, trace=torch.ones((), dtype=torch.float64)))
    whole = layer.quantized_whole
    every, none = bool(whole.all()), not bool(whole.any())
    on_op = op is not None and quantized_op_fits(query, layer)
    outs, records = [], []
    for j in range(query.shape[2]):
        qpos = layer.positions[:, 0, layer.positions.shape[-1] - query.shape[2] + j]
        log_pi = layer.log_weights.masked_fill(layer.positions > qpos[:, None, None], float("-inf"))
        q = query[:, :, j]
        if on_op:
            output, radius, lse = _op_certificate(op, q, layer, log_pi, scale)
            records.append((Estimate(output, None, None, (radius / c).square(), lse, backend="fast", route="cpu_op"),
                            (log_pi > float("-inf")).sum(-1)))
            outs.append(output)
            continue
        held = stored.__class__(stored.keys, stored.values, log_pi[..., :m].to(torch.float64), stored.positions,
                                stored.kv_bits, stored.layout)
        tail = (layer.keys, layer.values, log_pi[..., m:])
        kw = dict(sketch=layer.sketch, scale=scale, tail=tail)
        cert = design.certify(held, q, whole=every, **kw)
        if not (every or none):  # rows that kept every token take the whole-cache rule
            other = design.certify(held, q, whole=True, **kw)
            pick = whole[:, None].to(cert.radius.device)
            cert = cert.__class__(cert.output, torch.where(pick, other.radius, cert.radius),
                                  torch.where(pick, other.variance, cert.variance), cert.quantization_bound,
                                  cert.quantization_variance, cert.lse)
        trace = (cert.radius / c).square()
        records.append((Estimate(cert.output, None, None, trace, cert.lse, backend="fast", route="torch"),
                        (log_pi > float("-inf")).sum(-1)))
        outs.append(cert.output)
    return torch.stack(outs, dim=1), records


def quantized_op_fits(query: torch.Tensor, layer) -> bool:
    """Whether :func:`quantized_decode`'s compiled-op path covers this layer's step: its design certifies without
    a sketch by the rule on :math:`V + V_q` (``quantized_bound="variance"``: :math:`B_q` needs a second pass),
    no row kept every token (the whole-cache rule caps at :math:`B_q`), the codes are int8 (formats ``int8``,
    ``int4``; ``e4m3`` stays on the torch path), and the query is float32 with every tensor on the CPU."""
    design, stored = layer.quantized_design, layer.quantized
    if layer.sketch is not None or design.sketch is not None or design.quantized_bound != "variance":
        return False
    if bool(layer.quantized_whole.any()) or query.dtype != torch.float32 or not query.is_cpu:
        return False
    keys = stored.keys
    codes = [stored.values.codes] + ([keys.codes] if hasattr(keys, "codes") else [])
    return all(c.dtype == torch.int8 and c.is_cpu for c in codes) and layer.keys.is_cpu and layer.values.is_cpu


def _op_certificate(op, q: torch.Tensor, layer, log_pi: torch.Tensor, scale: float):
    """One query's (output, radius, lse) from the compiled op over a quantized layer's held slots: the estimate,
    the trace and V_q in one pass (``op``: ``kvcert.kernels.cpu.quantized_hajek_attention`` with ``combined=True``:
    its trace is trace + V_q), the radius the design's rule on it, as :meth:`TokenDesign.certify` with
    ``quantized_bound="variance"`` and no sketch."""
    from .certificates import radius_from_moments

    design, stored = layer.quantized_design, layer.quantized
    keys = stored.keys
    exact = not hasattr(keys, "codes")
    est, _ = op(q, keys.to(torch.float32) if exact else keys.codes, None if exact else keys.scales,
                stored.values.codes, stored.values.scales, log_pi, scale=scale, layout=stored.layout,
                group=getattr(keys, "group", _quantized.CHANNEL_GROUP), tail=(layer.keys, layer.values),
                combined=True, validate=False)
    radius = radius_from_moments(design.kind, design.delta, trace=est.trace)   # trace + V_q (combined)
    return est.output, radius, est.lse


#: the named token designs: name -> the :class:`TokenDesign` whose fields a press or engine starts from when
#: it names one (``PoissonPress(preset=name)``, ``KVCertConfig(preset=name)``, the request option
#: ``kvcert_preset``); the fields given beside the name override the preset's. ``"paper"``: the paper's design
#: (:class:`TokenDesign`'s defaults); ``"recommended"``: :data:`RECOMMENDED_FIELDS` (what names none runs).
#: Add one with :func:`register_design`; the budget fields (``compression_ratio``, ``target_size``,
#: ``target_error``) and the seed are the caller's, never a preset's.
TOKEN_DESIGNS: dict[str, TokenDesign] = {}

#: the fields a preset does not set (the caller's budget, stream and storage: bits are the memory split's)
_CALLER_FIELDS = ("compression_ratio", "target_size", "target_error", "seed", "kv_bits", "kv_layout",
                  "quantized_bound")


def register_design(name: str, design: TokenDesign) -> TokenDesign:
    """Add a named token design to :data:`TOKEN_DESIGNS` (a name is registered once). Its budget fields and
    seed must be the defaults: a preset is a design, the budget and the stream are the caller's."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if not isinstance(design, TokenDesign):
        raise TypeError(f"design must be a kvcert.fast.TokenDesign, got {type(design).__name__}")
    if name in TOKEN_DESIGNS:
        raise ValueError(f"a token design named {name!r} is already registered")
    base = TokenDesign()
    set_ = [f for f in _CALLER_FIELDS if getattr(design, f) != getattr(base, f)]
    if set_:
        raise ValueError(f"design: a preset leaves {', '.join(set_)} to the caller (got "
                         f"{', '.join(f'{f}={getattr(design, f)!r}' for f in set_)})")
    TOKEN_DESIGNS[name] = design
    return design


def preset_fields(name) -> dict:
    """The fields of the registered design ``name`` (:data:`TOKEN_DESIGNS`) that a press or engine takes from it:
    every field but the caller's (budget, seed); the sketch as its name where it is a registered one."""
    if not isinstance(name, str) or name not in TOKEN_DESIGNS:
        raise ValueError(f"preset must be one of {tuple(TOKEN_DESIGNS)}, got {name!r}")
    design = TOKEN_DESIGNS[name]
    out = {f.name: getattr(design, f.name) for f in dataclasses.fields(design) if f.name not in _CALLER_FIELDS}
    if out["sketch"] is not None:  # a registered sketch by its name (what a press or an engine is given)
        for key in SKETCHES:
            try:
                if resolve_sketch(key, out["kind"]) == out["sketch"]:
                    out["sketch"] = key
                    break
            except ValueError:  # that sketch does not carry this kind
                continue
    return out



register_design("paper", TokenDesign())
register_design("recommended", TokenDesign(**RECOMMENDED_FIELDS))
#: pi equal for every token outside the certainty set (the sinks and the window; no top slice): the floor's
#: mixture weight 1 makes every tail token's share 1/|T|, whatever its score; drawn systematically
register_design("uniform", TokenDesign(floor=1.0, top_fraction=0.0, scorer="random", sampling="systematic"))
