r"""Sketched designs: a sketch of the evicted tokens beside the Poisson sample, at equal total memory.

One KV head, one query, float64 NumPy, written to be read beside docs/theory.md section 8
("Sketched designs").

The pure Poisson design (``design="paper"``) certifies with the HT trace
:math:`\hat V = \mathrm{tr}\hat\Sigma`, which misses any tail token the sample did not
draw. The *cluster* design keeps, at eviction time, weighted Gaussian moments of the
evicted keys per k-means cluster (:class:`ClusterDesign`, :func:`cluster_sketch`) and
certifies with the hybrid variance :math:`V_{\mathrm{cl}}` (:func:`cluster_variance`):
the kept tokens' terms exactly, the evicted ones through the sketch. The *tilted* design
(:data:`TILTED`, ``ClusterDesign(tilt=True)``) takes those moments at a tilt point
:math:`q_0`. Both radii are capped at the deterministic :func:`hull_bound`. A sketch's
memory counts: a sketched design samples fewer tokens so that kept K+V plus the sketch
plus the per-token scalars equal the paper design's memory at the same ``budget``
(:func:`evict_and_certify`). ``kvcert.fast`` batches the same designs.

Memory accounting (in elements of the K/V dtype, e.g. fp16; one head):

- full cache: :math:`n (d + d_v)`;
- a kept token: :math:`d + d_v + 1` (its key, value and :math:`\log\pi_i`);
  when nothing is evicted the cache *is* the full cache (no :math:`\log\pi`);
- a cluster sketch: :meth:`ClusterDesign.elements`.

``memory`` = held elements / :math:`n (d + d_v)`. Token positions and RoPE are
the same for every design and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Callable

import numpy as np
from scipy import stats
from scipy.special import logsumexp

from .certificates import TILTED_HULL_MULTIPLIER, certificate, radius_from_moments
from .design import SAMPLINGS, certainty_mask, inclusion_probabilities, poisson_sample, systematic_sample
from .estimators import as_qkv, hajek_attention, scores

__all__ = [
    "DESIGNS",
    "RADIUS_RULES",
    "RECOMMENDED",
    "RECOMMENDED_KIND",
    "ClusterDesign",
    "ClusterSketch",
    "EvictionResult",
    "RadiusRule",
    "TILTED",
    "cluster_sketch",
    "cluster_variance",
    "evict_and_certify",
    "hull_bound",
    "kmeans_assign",
    "memory_fraction",
    "radius_from_variance",
    "sketched_variance",
]

#: per-token scalars held beside each kept key/value (log pi)
TOKEN_SCALARS = 1

#: the designs ``evict_and_certify`` accepts by name; ``None`` means :data:`RECOMMENDED`.
#: ``"cluster"`` is ``ClusterDesign()`` and ``"tilted"`` is :data:`TILTED` (defined further down)
DESIGNS = ("paper", "cluster", "tilted")

#: the design ``design=None`` selects: the tilted design (:data:`TILTED`), whose radius is the registered
#: certificate kind :data:`RECOMMENDED_KIND`; it meets the coverage, silent-error, tightness and accuracy
#: goals on the real model's replay cells and on a held-out split at every memory measured, where the paper
#: design misses the worst-decile and silent-error goals (docs/theory.md section 8). ``"paper"`` stays by name
RECOMMENDED = "tilted"
#: the certificate kind of the recommended design's radius (``CERTIFICATE_KINDS["tilted_hull"]``):
#: min(3 sqrt(V), H), V = :func:`sketched_variance` (the larger of V_cl and the sample's HT trace),
#: H = :func:`hull_bound`
RECOMMENDED_KIND = "tilted_hull"


@dataclass(frozen=True)
class EvictionResult:
    """Result of :func:`evict_and_certify` for one query head.

    Attributes
    ----------
    output : (dv,) Hajek estimate o_hat from the kept tokens
    radius : float, certified bound on ||o_hat - o||_2 at level 1 - delta
    memory : float, fraction of the full cache's K+V memory held (see module docstring)
    design : str, one of :data:`DESIGNS`
    budget : float, expected kept tokens the design sampled with (smaller for a sketched design)
    kept : int, tokens actually kept
    variance : float, the variance used by the radius (HT trace for paper; for cluster and tilted the larger
        of V_cl and the sample's HT trace, :func:`sketched_variance`)
    cluster_variance : float or None, V_cl alone (:func:`cluster_variance`; None for the paper design)
    quantization_bound : float, B_q, the deterministic bound on the rounding's effect ||o_hat_q - o_hat|| of a
        quantized cache (``kv_bits`` < 16; ``kvcert.reference.quantized.quantization_bound``), added to
        ``radius`` by ``quantized_bound="strict"`` (reported, and a cap only where the whole cache is kept, by
        ``"variance"``); 0.0 at 16 bits
    quantization_variance : float, V_q, the variance stochastic rounding adds to o_hat_q
        (``quantized_bound="variance"``; ``kvcert.reference.quantized.quantization_variance``), already
        included in ``variance``; 0.0 at 16 bits and with ``"strict"``
    bits : ``kvcert.reference.BitsChoice`` or None, what ``kv_bits="auto"`` chose (the width and each
        width's predictions); None at a fixed width
    """

    output: np.ndarray
    radius: float
    memory: float
    design: str
    budget: float
    kept: int
    variance: float
    cluster_variance: float | None = None
    quantization_bound: float = 0.0
    quantization_variance: float = 0.0
    bits: object = None


def memory_fraction(n: int, d: int, dv: int, *, kept: int, extra: float = 0.0) -> float:
    r"""Fraction of the full cache's memory held.

    .. math::

        M = \frac{|S|\,(d + d_v + 1) + E}{n\,(d + d_v)},

    with :math:`|S|` = ``kept`` and E = ``extra`` elements of a sketch
    (:meth:`ClusterDesign.elements`); M = 1 when ``kept == n`` (nothing
    evicted: the full cache, no log pi needed).
    """
    for name, v in (("n", n), ("d", d), ("dv", dv)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if not (0 <= kept <= n):
        raise ValueError(f"kept must be in [0, n] = [0, {n}], got {kept}")
    if not extra >= 0:
        raise ValueError(f"extra must be >= 0, got {extra}")
    if kept == n:
        return 1.0
    held = kept * (d + dv + TOKEN_SCALARS) + float(extra)
    return float(held) / float(n * (d + dv))


def _kept_inputs(q, keys, values, pi, output):
    """``(q, keys, values, pi, output)`` of a sketched variance as float64 arrays, checked: the kept
    tokens' pi must be in (0, 1]."""
    q, k, v = as_qkv(q, keys, values)
    p = np.asarray(pi, dtype=np.float64)
    if p.shape != (k.shape[0],) or np.any(~(p > 0)) or np.any(p > 1):
        raise ValueError(f"pi must have shape ({k.shape[0]},) with values in (0, 1]")
    return q, k, v, p, np.asarray(output, dtype=np.float64)


def _sketch_inputs(keys, values, pi, keep):
    """``(keys (n, d), values (n, dv), pi (n,), keep (n,) bool)`` as float64 / bool arrays, checked: the
    inputs every sketch is built from (an evicted token needs pi > 0 to be observable)."""
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    if k.ndim != 2:
        raise ValueError(f"keys must have shape (n, d), got shape {k.shape}")
    n = k.shape[0]
    if v.ndim != 2 or v.shape[0] != n:
        raise ValueError(f"values must have shape (n, dv) = ({n}, dv), got shape {v.shape}")
    p = np.asarray(pi, dtype=np.float64)
    if p.shape != (n,):
        raise ValueError(f"pi must have shape (n,) = ({n},), got shape {p.shape}")
    keep = np.asarray(keep, dtype=bool)
    if keep.shape != (n,):
        raise ValueError(f"keep must have shape (n,) = ({n},), got shape {keep.shape}")
    if np.any(~keep & ~(p > 0)):
        raise ValueError("pi must be > 0 for every evicted token (an evicted token with pi = 0 is unobservable)")
    return k, v, p, keep



def _check_budget(budget, n: int) -> float:
    if isinstance(budget, bool):
        raise TypeError("budget must be a number, got bool")
    budget = float(budget)
    if not (np.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite number > 0 (expected kept tokens), got {budget}")
    return min(budget, float(n))




def _design(design):
    """None for the paper design, else the ClusterDesign."""
    if design is None:
        design = RECOMMENDED
    if isinstance(design, ClusterDesign):
        return design
    if isinstance(design, str):
        named = {"paper": None, "cluster": ClusterDesign(), "tilted": TILTED}
        if design in named:
            return named[design]
    raise ValueError(f"design must be None, one of {DESIGNS} or a ClusterDesign, got {design!r}")


def _design_name(spec) -> str:
    if spec is None:
        return "paper"
    return "tilted" if spec.tilt else "cluster"


@dataclass(frozen=True)
class RadiusRule:
    r"""One radius rule of the sketched designs: a radius on :math:`\lVert\hat o - o\rVert` from a variance V.

    Attributes
    ----------
    name : str
        The ``radius`` field of :class:`ClusterDesign` and the ``rule`` of :func:`radius_from_variance`.
    radius : callable
        ``radius(variance, delta, multiplier) -> float`` with ``variance`` >= 0 and ``delta`` in (0, 1).
    summary : str
        The formula in one line.
    """

    name: str
    radius: Callable[[float, float, float], float]
    summary: str


#: name -> :class:`RadiusRule`, read-only: the radius rules of the sketched designs (twin of
#: ``kvcert.fast.RADIUS_RULES``, same names and order)
RADIUS_RULES = MappingProxyType({rule.name: rule for rule in (
    RadiusRule("chebyshev", lambda v, delta, multiplier: float(np.sqrt(v / delta)),
               "sqrt(V / delta): Markov's inequality on the squared error"),
    RadiusRule("gaussian", lambda v, delta, multiplier: float(stats.norm.ppf(1.0 - delta / 2.0) * np.sqrt(v)),
               "z_{1-delta/2} sqrt(V): a Gaussian limit of the error"),
    RadiusRule("fixed", lambda v, delta, multiplier: float(multiplier * np.sqrt(v)),
               "c sqrt(V), c = the design's multiplier"),
)})


def radius_from_variance(variance: float, *, delta: float, rule: str, multiplier: float = 3.0) -> float:
    r"""Radius from a variance by a rule of :data:`RADIUS_RULES`: ``chebyshev`` :math:`\sqrt{V/\delta}`,
    ``gaussian`` :math:`z_{1-\delta/2}\sqrt V`, ``fixed`` :math:`c\sqrt V` (c = ``multiplier``); a negative
    V counts as 0."""
    if not isinstance(rule, str) or rule not in RADIUS_RULES:
        raise ValueError(f"rule must be one of {tuple(RADIUS_RULES)}, got {rule!r}")
    return RADIUS_RULES[rule].radius(max(float(variance), 0.0), delta, multiplier)


def _sample(pi, seed: int, sampling: str):
    """The sample of pi by ``sampling`` from the stream ``design_generator(seed)``."""
    return poisson_sample(pi, seed=seed) if sampling == "poisson" else systematic_sample(pi, seed=seed)


def evict_and_certify(q, keys, values, importance, budget, *, seed: int, delta: float = 0.05, design=None,
                      sinks: int = 4, window: int = 32, top: int = 0, floor: float = 0.1,
                      scale: float | None = None, tilt=None, sampling: str = "poisson",
                      kv_bits: int = 16, kv_layout: str = "channel",
                      quantized_bound: str = "variance") -> EvictionResult:
    r"""Evict one KV head's cache at random and certify one query's attention output.

    ``design="paper"`` (the paper's design, docs/theory.md):
    ``pi = inclusion_probabilities(importance, budget, ...)``,
    ``keep = poisson_sample(pi, seed=seed)``, the Hajek estimate
    ``hajek_attention`` over the kept tokens and the radius of
    ``certificate(kind="chebyshev")``: :math:`\sqrt{\mathrm{tr}\hat\Sigma/\delta}`.

    ``design="cluster"`` or a :class:`ClusterDesign`: sampling at
    ``budget - ClusterDesign.elements(d, dv) / (d + dv + 1)`` (equal expected
    memory), the same Hajek estimate, a :func:`cluster_sketch` of the evicted
    tokens and the radius of ``design.radius`` on
    :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})` (:func:`sketched_variance` of
    :func:`cluster_variance` and the sample's HT trace; :func:`radius_from_variance`),
    capped at the deterministic :func:`hull_bound`.

    ``design="tilted"`` (:data:`TILTED`) or a ``ClusterDesign(tilt=True)``: the
    same, with the sketch's moments tilted at ``tilt`` (the observation-window
    queries (w, d) of the head's query group, or their mean q0 (d,)), memory
    C (4d + 4) + d + dv + 1 (docs/theory.md section 8).

    Every sketched design keeps the given ``top`` (the certainty set is the
    paper design's); only the Poisson tail shrinks.

    ``design=None`` is :data:`RECOMMENDED`, the tilted design, whose radius is
    the registered certificate kind ``"tilted_hull"``
    (``radius_from_moments("tilted_hull", delta, trace=V, bound=hull_bound)``:
    :math:`\min(3\sqrt{V}, H)`, :math:`V = \max(V_{\mathrm{cl}}, \hat V_{\mathrm{HT}})`). Pass ``tilt`` (the
    observation-window queries, as an engine has them at eviction time: the
    design measured on the held-out split); without it ``design=None`` tilts
    at the certified query ``q`` itself (the hull cap still holds; that
    variant was not part of the held-out measurement). The paper's design
    stays available as ``design="paper"``. The hull cap is proven; the
    multiplier 3 is calibrated at delta = 0.05 and does not scale with delta
    (docs/theory.md section 8 has the measurements, on the replay cells and on
    a held-out split).

    ``kv_bits`` = 8 or 4 (every design): the kept tokens' keys and values are
    stored with per-token absmax scales (``kvcert.reference.quantized.quantize``,
    formats ``int8`` / ``int4``; two float16 scales per token). ``budget`` keeps
    its meaning, the memory to compare at, so the design samples more tokens:
    ``sampled_budget(budget, d, dv, kv_bits, extra=sketch elements)``, equal
    expected memory at :math:`(d + d_v)\,b/16 + 3` elements per kept token
    (``quantized.token_elements``); the sketch, when there is one, is taken at
    eviction from the unquantized cache and held in 16 bits. The output is the
    Hajek estimate :math:`\hat o_q` over the stored rows, and the radius covers
    both errors, :math:`\lVert\hat o_q - o\rVert \le B_q + r`: :math:`B_q`
    (``quantized.quantization_bound``, reported as ``quantization_bound``) is a
    deterministic bound on :math:`\lVert\hat o_q - \hat o\rVert` computed from
    the stored rows, scales and q, and r the design's sampling radius computed
    from the stored rows. A sketched design's hull cap applies to the sum:
    radius :math:`\min(B_q + r, H_q)`, :math:`H_q` = ``hull_bound`` of the
    stored kept values plus their largest value bound. When the whole cache
    fits at ``kv_bits`` it is kept (radius :math:`B_q`, ``budget`` = n).
    That is ``quantized_bound="strict"`` (round to nearest).
    ``quantized_bound="variance"`` rounds stochastically (unbiased codes, the
    uniforms from ``quantized.rounding_generator(seed)``, independent of the
    sampling stream) and adds the rounding's variance :math:`V_q`
    (``quantized.quantization_variance``, reported as
    ``quantization_variance``) to the design's variance before its radius
    rule: :math:`\sqrt{(\mathrm{tr}\hat\Sigma + V_q)/\delta}` for the paper
    design, :math:`\min(3\sqrt{V + V_q}, H_q)` for ``design=None``; where the
    whole cache fits, the rule on :math:`V_q` capped at :math:`B_q`. Its value
    part is exact, its key part the delta method's, the rule calibrated.
    ``kv_layout`` says what is stored: ``"token"`` (per-token scales),
    ``"channel"`` (keys per channel and group of 32 kept tokens, KIVI; values
    per token) or ``"values"`` (16-bit keys, values per token), with the
    budget converted by that layout's per-token memory.
    docs/quantized.md has the proofs.

    Parameters
    ----------
    q : (d,) query   keys : (n, d)   values : (n, dv), one KV head's full cache
    importance : (n,) scorer importance, >= 0
    budget : float > 0
        Expected kept tokens of the *paper* design at the memory to compare at;
        ``budget >= n`` keeps everything (radius 0, exact output, memory 1).
    seed : int >= 0, the sampling stream (``design_generator(seed)``)
    delta : float in (0, 1)
    design : None, one of :data:`DESIGNS`, or a :class:`ClusterDesign`
    sinks, window, top, floor : the certainty set and defensive floor of
        :func:`inclusion_probabilities`
    scale : float, default 1/sqrt(d)
    tilt : (w, d) or (d,), optional
        The tilt point of a tilted design: the observation-window queries of the
        head's query group, or their mean q0. Required by a tilted design named
        explicitly (``design=None`` defaults it to ``q``); every other design
        checks its shape and ignores it, so a caller can pass the same
        arguments whatever design ``None`` selects.
    sampling : {"poisson", "systematic"}
        How the tail is drawn given pi: independently (``poisson_sample``, the default) or by randomized
        systematic sampling (``systematic_sample``: the same pi, a fixed kept count), from the same
        stream ``design_generator(seed)``.
    kv_bits : {16, 8, 4, "auto"}
        Bits per stored key and value element; 16 (the default) stores them
        unquantized, exactly as without the argument. ``"auto"``: the width of
        the smallest predicted certificate at the budget's memory
        (``bits.choose_kv_bits`` for the window queries ``tilt``, or ``q``
        without one), then exactly that width's result, with the choice in
        ``bits`` (docs/quantized.md section 11).
    kv_layout : {"channel", "token", "values"}
        What a quantized cache stores (``quantized.KV_LAYOUTS``); the default
        ``"channel"`` (KIVI's key layout) measured best at 8 bits
        (docs/quantized.md section 7). Checked and unused at 16 bits.
    quantized_bound : {"variance", "strict"}
        The rounding term of a quantized certificate: :math:`V_q` added to the
        variance (stochastic rounding; the default, informative on real keys)
        or :math:`B_q` added to the radius (round to nearest; holds on every
        input, vacuous on real keys). Checked and unused at 16 bits.

    Returns
    -------
    EvictionResult
        At ``kv_bits`` < 16: ``radius`` = :math:`B_q + r` (capped as above) or
        the rule on :math:`V + V_q`, ``memory`` counted in 16-bit elements
        with the scales included, ``quantization_bound`` = :math:`B_q`,
        ``quantization_variance`` = :math:`V_q` (0 with ``"strict"``).

    Raises
    ------
    ValueError
        Bad shapes (naming the argument and the expected shape), non-finite
        q, keys or values, delta outside (0, 1), budget <= 0, kv_bits not in
        (16, 8, 4, "auto"), kv_layout or quantized_bound not one of theirs, a sketched
        design whose sketch leaves no budget above the certainty set.
    """
    q, k, v = as_qkv(q, keys, values)
    u, delta, budget = _check_eviction(k, importance, delta, budget, sampling)
    spec = _design(design)
    name = _design_name(spec)
    given_tilt, tilt = tilt, _design_tilt(spec, design, tilt, q, k.shape[1])
    from . import bits, quantized                        # here, not at the top: they build on this module
    kv_layout = quantized._check_layout(kv_layout)                 # checked at every kv_bits, used below 16
    quantized_bound = quantized._check_quantized_bound(quantized_bound)
    if bits.check_kv_bits_choice(kv_bits) == "auto":              # the width of least predicted certificate
        choice = bits.auto_kv_bits(q, k, v, u, budget, spec=spec, tilt=given_tilt, delta=delta, sinks=sinks,
                                        window=window, top=top, floor=floor, scale=scale, kv_layout=kv_layout,
                                        quantized_bound=quantized_bound)
        return replace(evict_and_certify(q, keys, values, importance, budget, seed=seed, delta=delta, design=design,
                                         sinks=sinks, window=window, top=top, floor=floor, scale=scale,
                                         tilt=given_tilt, sampling=sampling, kv_bits=choice.bits,
                                         kv_layout=kv_layout, quantized_bound=quantized_bound), bits=choice)
    if int(kv_bits) != 16:
        return quantized._evict_quantized(q, k, v, u, budget, seed=seed, delta=delta, spec=spec, name=name,
                                          sinks=sinks, window=window, top=top, floor=floor, scale=scale,
                                          tilt=tilt, sampling=sampling, kv_bits=int(kv_bits), kv_layout=kv_layout,
                                          quantized_bound=quantized_bound)
    n = k.shape[0]
    if budget >= n:
        return EvictionResult(output=hajek_attention(q, k, v, np.ones(n), scale=scale).output, radius=0.0,
                              memory=1.0, design=name, budget=float(n), kept=n, variance=0.0)
    certainty = dict(sinks=sinks, window=window, top=top, floor=floor)
    if spec is None:
        return _evict_paper(q, k, v, u, budget, seed, delta, scale, sampling, name, **certainty)
    return _evict_sketched(q, k, v, u, budget, seed, delta, scale, sampling, spec, name, tilt, **certainty)


def _check_eviction(k, importance, delta, budget, sampling):
    """:func:`evict_and_certify`'s checks of the cache (n >= 1 tokens), the sampling, the importance (n,), delta in
    (0, 1) and the budget: (importance as float64, delta, budget)."""
    n = k.shape[0]
    if n == 0:
        raise ValueError("keys must hold at least one token, got n = 0")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {SAMPLINGS}, got {sampling!r}")
    u = np.asarray(importance, dtype=np.float64)
    if u.shape != (n,):
        raise ValueError(f"importance must have shape (n,) = ({n},), got shape {u.shape}")
    delta = float(delta)
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return u, delta, _check_budget(budget, n)


def _design_tilt(spec, design, tilt, q, d: int):
    """The tilt point a design uses: the given one (checked for every design, so a wrong shape is never
    silent), the certified query for ``design=None`` without one, None for a design that does not tilt."""
    if design is None and spec is not None and spec.tilt and tilt is None:
        tilt = q  # design=None without a tilt point: tilt at the certified query (docstring)
    if tilt is not None or (spec is not None and spec.tilt):
        tilt = _tilt_point(tilt, d)
    if spec is None or not spec.tilt:
        tilt = None                                      # a design that does not tilt ignores the tilt point
    return tilt


def _evict_paper(q, k, v, u, budget, seed, delta, scale, sampling, name, *, sinks, window, top,
                 floor) -> EvictionResult:
    """The paper's design: pi at ``budget``, the sample, the Hajek estimate over it and the Chebyshev radius of
    its HT trace."""
    n, d = k.shape
    pi = inclusion_probabilities(u, budget, sinks=sinks, window=window, top=top, floor=floor)
    keep = _sample(pi, seed, sampling)
    est = hajek_attention(q, k[keep], v[keep], pi[keep], scale=scale)
    cert = certificate(est, delta=delta, kind="chebyshev")
    return EvictionResult(output=est.output, radius=float(cert.radius),
                          memory=memory_fraction(n, d, v.shape[1], kept=int(keep.sum())), design=name,
                          budget=budget, kept=int(keep.sum()), variance=float(est.trace))


def _evict_sketched(q, k, v, u, budget, seed, delta, scale, sampling, spec, name, tilt, *, sinks, window, top,
                    floor) -> EvictionResult:
    """A sketched design: pi at the budget the sketch leaves (equal expected memory), the sample, the Hajek
    estimate, the cluster sketch of the evicted tokens and the design's radius on max(V_cl, V_HT), capped at
    the hull bound."""
    n, d = k.shape
    dv = v.shape[1]
    certain = certainty_mask(u, sinks=sinks, window=window, top=top)
    b_design = budget - spec.tokens(d, dv)
    if b_design <= certain.sum():
        raise ValueError(
            f"budget = {budget} is too small for the {name} design: its sketch ({spec.clusters} clusters, "
            f"{spec.elements(d, dv)} elements) leaves an expected {b_design:.3g} kept tokens, not above the "
            f"certainty set |C| = {int(certain.sum())}; raise budget")
    pi = inclusion_probabilities(u, b_design, sinks=sinks, window=window, top=top, floor=floor)
    keep = _sample(pi, seed, sampling)
    est = hajek_attention(q, k[keep], v[keep], pi[keep], scale=scale)
    kept = int(keep.sum())
    sk = cluster_sketch(k, v, pi, keep, spec, tilt=tilt, scale=scale)
    v_cl = cluster_variance(q, k[keep], v[keep], pi[keep], sk, output=est.output, scale=scale)
    var = sketched_variance(v_cl, est.trace)
    cap = hull_bound(v[keep], pi[keep], sk, output=est.output)
    if spec == TILTED:                                   # the recommended design: its registered certificate kind
        radius = float(radius_from_moments(RECOMMENDED_KIND, delta, trace=var, bound=cap))
    else:
        radius = min(radius_from_variance(var, delta=delta, rule=spec.radius, multiplier=spec.multiplier), cap)
    memory = memory_fraction(n, d, dv, kept=kept, extra=spec.elements(d, dv) if kept < n else 0)
    return EvictionResult(output=est.output, radius=radius, memory=memory, design=name,
                          budget=b_design, kept=kept, variance=float(var), cluster_variance=float(v_cl))


# ----------------------------------------------------------------------------------------------------
# Cluster designs: per-cluster Gaussian moments of the evicted keys (no per-token memory).


@dataclass(frozen=True)
class ClusterDesign:
    r"""A cluster design: Poisson sampling plus weighted Gaussian moments of the evicted keys per cluster.

    At eviction the head's n keys are split into ``clusters`` groups by Lloyd's k-means
    (:func:`kmeans_assign`, deterministic). For every cluster c with evicted tokens U_c the
    sketch keeps, with :math:`w_i = (1-\pi_i)/\pi_i`: the w-weighted mean key :math:`m_c`
    and per-channel variance :math:`\sigma^2_c` (2d elements), :math:`W_c = \sum w_i`,
    :math:`Y_c = \sum w_i \nu_i^2` (:math:`\nu_i = \lVert v_i - \mu\rVert`) and
    :math:`N_c = |U_c|` (3 scalars); per head the value centre :math:`\mu` (dv).

    On the real model's replay cells (docs/theory.md section 8) the defaults
    (16 clusters, ``gaussian``) cover (pooled >= 0.996, worst decile >= 0.96, silent <= 0.32%)
    at <= 1.06x the paper design's error, but the radius is 5.7-7.8x the RMS error: the
    Gaussian moment step over-estimates the evicted part in most cells (it is exact only for
    Gaussian keys), so this design does not replace the default.

    With ``tilt=True`` (the *tilted* cluster design, docs/theory.md section 8, "Fifth
    slice") the moments are taken at a tilt point :math:`q_0` (the mean observation-window
    query of the KV head's query group, given at eviction): for the squared terms under the
    weights :math:`\omega_i \propto w_i e^{2\tau q_0\cdot k_i}` (mean :math:`\tilde m_c`,
    variance :math:`\tilde\sigma^2_c`, masses :math:`S_c = \sum w_i e^{2\tau q_0\cdot k_i}`,
    :math:`Y_c = \sum w_i \nu_i^2 e^{2\tau q_0\cdot k_i}`), for :math:`\tilde Z` under
    :math:`e^{\tau q_0\cdot k_i}` (mean :math:`m'_c`, variance :math:`\sigma'^2_c`, mass
    :math:`N_c = \sum e^{\tau q_0\cdot k_i}`), and the Gaussian step is taken in
    :math:`r = q - q_0`: exact at :math:`q = q_0` for any keys. The masses are held scaled by
    :math:`e^{-2h_c}` / :math:`e^{-h_c}` with :math:`h_c = \max_{U_c}\tau q_0\cdot k_i` (one
    more scalar, so no overflow): C (4d + 4) + d + dv + 1 elements per head with :math:`q_0`.

    Attributes
    ----------
    clusters : int >= 1
    iterations : int >= 0, Lloyd iterations
    radius : a name of :data:`RADIUS_RULES`   multiplier : float > 0 (``fixed``)
    tilt : bool, the tilted design (needs the tilt point at eviction)
    """

    clusters: int = 16
    iterations: int = 10
    radius: str = "gaussian"
    multiplier: float = 3.0
    tilt: bool = False

    def __post_init__(self):
        for name, low in (("clusters", 1), ("iterations", 0)):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < low:
                raise ValueError(f"{name} must be an int >= {low}, got {x!r}")
        if not isinstance(self.radius, str) or self.radius not in RADIUS_RULES:
            raise ValueError(f"radius must be one of {tuple(RADIUS_RULES)}, got {self.radius!r}")
        if not (np.isfinite(self.multiplier) and self.multiplier > 0):
            raise ValueError(f"multiplier must be a finite number > 0, got {self.multiplier!r}")
        if not isinstance(self.tilt, (bool, np.bool_)):
            raise ValueError(f"tilt must be a bool, got {self.tilt!r}")

    def elements(self, d: int, dv: int) -> int:
        """Elements held by the sketch of one head: C (2d + 3) + dv + 1, tilted C (4d + 4) + d + dv + 1
        (the + 1: ``reach``, the evicted values' largest distance to mu, for :func:`hull_bound`)."""
        if self.tilt:
            return self.clusters * (4 * d + TILTED_SCALARS) + d + dv + HEAD_SCALARS
        return self.clusters * (2 * d + CLUSTER_SCALARS) + dv + HEAD_SCALARS

    def tokens(self, d: int, dv: int) -> float:
        """:meth:`elements` in kept-token units of d + dv + 1 elements (key, value, log pi)."""
        return self.elements(d, dv) / float(d + dv + TOKEN_SCALARS)


#: per-cluster scalars beside the 2 d moments (W_c, Y_c, N_c)
CLUSTER_SCALARS = 3
#: per-head scalars of a cluster sketch beside mu (and q0): ``reach``, for :func:`hull_bound`
HEAD_SCALARS = 1
#: per-cluster scalars of the tilted design beside its 4 d moments (S_c, Y_c, N_c and the exponent h_c)
TILTED_SCALARS = 4
#: the tilted design ``design="tilted"`` names: 8 clusters (its memory is about the 16-cluster
#: design's) and the radius 3 sqrt(V) (docs/theory.md section 8, "Fifth slice")
TILTED = ClusterDesign(clusters=8, radius="fixed", multiplier=TILTED_HULL_MULTIPLIER, tilt=True)


@dataclass(frozen=True)
class ClusterSketch:
    """Per-cluster moments of the evicted tokens (clusters without an evicted token are dropped).

    Attributes
    ----------
    mean : (C, d) w-weighted mean key   var : (C, d) w-weighted per-channel variance
    weight : (C,) W_c = sum (1 - pi)/pi   wnorm : (C,) Y_c = sum (1 - pi)/pi nu^2   count : (C,) N_c
    mu : (dv,)

    A tilted sketch (``ClusterDesign(tilt=True)``) also holds ``tilt`` (d,) the tilt point q0,
    ``zmean`` / ``zvar`` (C, d) the moments under e^{tau q0.k} and ``shift`` (C,) h_c; then
    ``mean`` / ``var`` are the moments under w e^{2 tau q0.k}, ``weight`` = S_c e^{-2 h_c},
    ``wnorm`` = Y_c e^{-2 h_c}, ``count`` = N_c e^{-h_c}. Untilted: those four are None.
    ``reach`` is max over the evicted tokens of ||v_i - mu|| (0 when none is evicted), the sketch's
    part of :func:`hull_bound`; None (a sketch built by hand without it): no hull bound.
    """

    mean: np.ndarray
    var: np.ndarray
    weight: np.ndarray
    wnorm: np.ndarray
    count: np.ndarray
    mu: np.ndarray
    tilt: np.ndarray | None = None
    zmean: np.ndarray | None = None
    zvar: np.ndarray | None = None
    shift: np.ndarray | None = None
    reach: float | None = None


def _principal_direction(keys) -> np.ndarray:
    r"""The first principal direction (d,) of the keys (n, d), with a fixed sign.

    The unit eigenvector of the largest eigenvalue of the d x d scatter matrix
    :math:`\sum_i (k_i - \bar k)(k_i - \bar k)^\top` (``numpy.linalg.eigh``), the same direction as
    the first right singular vector of the centred keys at O(n d^2 + d^3) instead of an n x d SVD.
    An eigenvector's sign is LAPACK's arbitrary choice and decides the order of the k-means
    initial centres; it is fixed so that its largest-magnitude component (the first, on ties) is
    positive.
    """
    k = np.asarray(keys, dtype=np.float64)
    kc = k - k.mean(axis=0)
    _, vecs = np.linalg.eigh(kc.T @ kc)
    u = vecs[:, -1]                                                    # eigh: ascending eigenvalues
    return u if u[np.argmax(np.abs(u))] >= 0 else -u


def kmeans_assign(keys, clusters: int, *, iterations: int = 10) -> np.ndarray:
    r"""Deterministic Lloyd k-means of the keys: (n,) cluster index in [0, clusters).

    Initial centres: the keys at the evenly spaced quantiles ``floor((j + 1/2) n / C)`` of their
    projection :math:`(k_i - \bar k)\cdot u` on the first principal direction u
    (:func:`_principal_direction`; stable sort), then ``iterations + 1`` rounds of

    .. math::

        \ell_i = \arg\min_c\ \lVert m_c\rVert^2 - 2\, k_i\cdot m_c, \qquad
        m_c \leftarrow \text{mean of } \{k_i: \ell_i = c\}\ \text{(if non-empty)}

    (the squared distance less :math:`\lVert k_i\rVert^2`, the same for every c; ties to the lowest
    index, empty clusters keep their previous centre).
    """
    k = np.asarray(keys, dtype=np.float64)
    n = k.shape[0]
    C = min(int(clusters), n)
    order = np.argsort((k - k.mean(axis=0)) @ _principal_direction(k), kind="stable")
    centres = k[order[((np.arange(C) + 0.5) * n / C).astype(int)]].copy()
    for _ in range(iterations + 1):
        dist = (centres * centres).sum(1)[None, :] - 2.0 * k @ centres.T
        lab = np.argmin(dist, axis=1)
        cnt = np.bincount(lab, minlength=C)
        sums = _one_hot(lab, C).T @ k                                  # per-cluster sums of the keys
        nz = cnt > 0
        centres[nz] = sums[nz] / cnt[nz, None]
    return lab


def _one_hot(labels, C: int) -> np.ndarray:
    """(n, C) float64 indicator of ``labels``: ``_one_hot(l, C).T @ x`` sums the rows of x per label."""
    return (np.asarray(labels)[:, None] == np.arange(C)[None, :]).astype(np.float64)


def _weighted_moments(k, weights, inv, C: int):
    """Per-cluster mass, weighted mean and per-channel variance of keys ``k`` under ``weights``."""
    mass = np.bincount(inv, weights=weights, minlength=C)
    ms = np.where(mass > 0, mass, 1.0)
    hot = _one_hot(inv, C)
    mean = hot.T @ (weights[:, None] * k) / ms[:, None]
    var = hot.T @ (weights[:, None] * (k - mean[inv]) ** 2) / ms[:, None]
    return mass, mean, var


def cluster_sketch(keys, values, pi, keep, design: ClusterDesign | None = None, *, labels=None,
                   tilt=None, scale: float | None = None) -> ClusterSketch:
    r"""Build the cluster sketch of the evicted tokens (``keep == False``); ``labels`` (n,) overrides k-means.

    A tilted design (``design.tilt``) needs ``tilt``: the tilt point :math:`q_0` (d,), or the
    observation-window queries (w, d) whose mean it is; ``scale`` is :math:`\tau` (default
    1/sqrt(d)). With :math:`e_i = \tau q_0\cdot k_i` and :math:`h_c = \max_{U_c} e_i`:

    .. math::

        S_c e^{-2h_c} = \sum_{U_c} w_i e^{2(e_i - h_c)},\quad
        Y_c e^{-2h_c} = \sum_{U_c} w_i \nu_i^2 e^{2(e_i - h_c)},\quad
        N_c e^{-h_c} = \sum_{U_c} e^{e_i - h_c},

    ``mean`` / ``var`` weighted by :math:`w_i e^{2 e_i}`, ``zmean`` / ``zvar`` by :math:`e^{e_i}`.
    """
    design = ClusterDesign() if design is None else design
    k, v, p, keep = _sketch_inputs(keys, values, pi, keep)
    n, d = k.shape
    lab = kmeans_assign(k, design.clusters, iterations=design.iterations) if labels is None else np.asarray(labels)
    mu = v.mean(axis=0)
    gone = np.flatnonzero(~keep)
    used, inv = np.unique(lab[gone], return_inverse=True)
    C = used.size
    w = (1.0 - p[gone]) / p[gone]
    nu2 = np.sum((v[gone] - mu) ** 2, axis=1)
    reach = float(np.sqrt(nu2.max())) if gone.size else 0.0
    if not design.tilt:
        if tilt is not None:
            raise ValueError("tilt is for a tilted design (ClusterDesign(tilt=True)); this design has tilt=False")
        # w-weighted moments; a cluster whose evicted tokens all have pi = 1 cannot occur (pi = 1 is kept)
        W, mean, var = _weighted_moments(k[gone], w, inv, C)
        Y = np.bincount(inv, weights=w * nu2, minlength=C)
        N = np.bincount(inv, minlength=C).astype(np.float64)
        return ClusterSketch(mean=mean, var=var, weight=W, wnorm=Y, count=N, mu=mu, reach=reach)
    q0 = _tilt_point(tilt, d)
    tau = 1.0 / np.sqrt(d) if scale is None else float(scale)
    e = tau * k[gone] @ q0
    h = np.full(C, -np.inf)
    np.maximum.at(h, inv, e)
    x = e - h[inv]                                                     # <= 0
    S, mean, var = _weighted_moments(k[gone], w * np.exp(2.0 * x), inv, C)
    Y = np.bincount(inv, weights=w * nu2 * np.exp(2.0 * x), minlength=C)
    N, zmean, zvar = _weighted_moments(k[gone], np.exp(x), inv, C)
    return ClusterSketch(mean=mean, var=var, weight=S, wnorm=Y, count=N, mu=mu, tilt=q0, zmean=zmean, zvar=zvar,
                         shift=h, reach=reach)


def _tilt_point(tilt, d: int) -> np.ndarray:
    """The tilt point q0 (d,) from ``tilt``: q0 itself (d,) or window queries (w, d), averaged."""
    if tilt is None:
        raise ValueError("tilt is required by a tilted design (ClusterDesign(tilt=True)): the tilt point q0 (d,) "
                         "or the observation-window queries (w, d) whose mean it is")
    t = np.asarray(tilt, dtype=np.float64)
    if t.ndim == 2 and t.shape[0] >= 1 and t.shape[1] == d:
        t = t.mean(axis=0)
    if t.shape != (d,) or not np.all(np.isfinite(t)):
        raise ValueError(f"tilt must be a finite (d,) = ({d},) point or (w, d) = (w, {d}) window queries, "
                         f"got shape {np.shape(tilt)}")
    return t


def hull_bound(values, pi, sketch: ClusterSketch, *, output) -> float:
    r"""A deterministic bound on :math:`\lVert\hat o - o\rVert` from the values' convex hull.

    The exact output :math:`o` and the Hajek estimate :math:`\hat o` are both convex combinations of
    the head's values (every token: kept, evicted, and those added after the eviction), so for the
    sketch's centre :math:`\mu`

    .. math::

        \lVert\hat o - o\rVert \le \lVert\hat o - \mu\rVert + \max_i \lVert v_i - \mu\rVert
            \le \lVert\hat o - \mu\rVert + \max\big(\rho_U,\ \max_{i\in S}\lVert v_i - c\rVert
            + \lVert c - \mu\rVert\big),

    :math:`\rho_U` = ``sketch.reach`` (the evicted tokens' largest :math:`\lVert v_i - \mu\rVert`, held
    at eviction) and :math:`c` the mean of the kept values (``kvcert.fast.value_moments``: the kept
    part goes through the distances the decode already has). No probability is involved: it holds
    for every draw. The cluster designs' radius is the smaller of their rule's radius and this
    bound, which only binds where the rule's radius is large (docs/theory.md section 8).

    Parameters
    ----------
    values : (n, dv), the kept tokens' values   pi : (n,), 0 on padding
    sketch : ClusterSketch   output : (dv,), the Hajek estimate o_hat

    Returns
    -------
    float, +inf when the sketch holds no ``reach`` (built without it) or nothing is kept.
    """
    v = np.asarray(values, dtype=np.float64)
    p = np.asarray(pi, dtype=np.float64)
    o = np.asarray(output, dtype=np.float64)
    if v.ndim != 2 or p.shape != (v.shape[0],) or o.shape != (v.shape[1],):
        raise ValueError(f"values must be (n, dv), pi (n,) and output (dv,), got {v.shape}, {p.shape}, {o.shape}")
    kept = v[p > 0]
    if sketch.reach is None or kept.shape[0] == 0:
        return float("inf")
    mu = np.asarray(sketch.mu, dtype=np.float64)
    c = kept.mean(axis=0)
    inside = float(np.sqrt(np.max(np.sum((kept - c) ** 2, axis=1)))) + float(np.linalg.norm(c - mu))
    return float(np.linalg.norm(o - mu)) + max(float(sketch.reach), inside)


def sketched_variance(cluster_var: float, ht_trace: float) -> float:
    r"""The variance a sketched design certifies with: the larger of the sketch's and the sample's estimates.

    .. math::

        V = \max\big(V_{\mathrm{cl}},\ \hat V_{\mathrm{HT}}\big),\qquad
        \hat V_{\mathrm{HT}} = \mathrm{tr}\hat\Sigma = \frac{1}{\hat Z^2}\sum_{i\in S}\frac{1-\pi_i}{\pi_i^2}
            e^{2 s_i}\lVert v_i - \hat o\rVert^2 .

    Both estimate the same design variance and share its kept part
    :math:`\sum_S \frac{1-\pi_i}{\pi_i} e^{2 s_i}\lVert v_i-\hat o\rVert^2`; they differ in the evicted
    part :math:`\sum_U \frac{1-\pi_i}{\pi_i} e^{2 s_i}\lVert v_i - o\rVert^2`. :math:`V_{\mathrm{cl}}`
    (:func:`cluster_variance`) models it from the sketch's per-cluster moments, which depend on the
    clusters k-means lands in; the HT trace estimates it design-unbiasedly from the kept sample
    (:math:`\frac{1-\pi}{\pi^2} = \frac{1-\pi}{\pi}\,(1 + \frac{1-\pi}{\pi})`: each kept tail token
    also stands for the evicted tokens it represents), which no clustering enters. The larger of the two
    is what the calibrated multiplier of ``tilted_hull`` multiplies, so a clustering whose Gaussian step
    under-states the evicted mass cannot pull the radius below what the sample itself shows
    (docs/theory.md section 8, "The recommended design").

    Parameters
    ----------
    cluster_var : float, :math:`V_{\mathrm{cl}}`   ht_trace : float, the sample's HT trace
        (``hajek_attention(...).trace`` over the kept tokens)

    Returns
    -------
    float, +inf when either is +inf (an empty sample); NaN in either raises.
    """
    a, b = float(cluster_var), float(ht_trace)
    if np.isnan(a) or np.isnan(b):
        raise ValueError(f"cluster_var and ht_trace must not be NaN, got {a} and {b}")
    return max(a, b)


def cluster_variance(q, keys, values, pi, sketch: ClusterSketch, *, output, scale: float | None = None) -> float:
    r"""The hybrid variance with the evicted part from per-cluster Gaussian moments.

    .. math::

        V_{\mathrm{cl}} = \frac{1}{\tilde Z^2}\Big[\sum_{i\in S}\frac{1-\pi_i}{\pi_i} e^{2 s_i}
            \lVert v_i - \hat o\rVert^2 + \sum_c (Y_c + W_c \lVert\mu - \hat o\rVert^2)\,
            e^{2\tau q\cdot m_c + 2\tau^2 \sum_j q_j^2\sigma^2_{cj}}\Big],\quad
        \tilde Z = \sum_{i\in S} e^{s_i} + \sum_c N_c\, e^{\tau q\cdot m_c + \tau^2\sum_j q_j^2\sigma^2_{cj}/2}.

    The exponentials are the moment generating function of a Gaussian with the cluster's
    weighted mean and diagonal covariance: exact for Gaussian keys with independent channels,
    an approximation otherwise (heavy tails: too small; correlated channels: either way), and
    :math:`\nu_i^2 + \lVert\mu-\hat o\rVert^2` stands for :math:`\lVert v_i - \hat o\rVert^2`
    (exact on average when :math:`v_i - \mu` is uncorrelated with :math:`\mu - \hat o`).
    Its target is the design variance V itself.

    A tilted sketch (``sketch.tilt`` not None) takes the step in :math:`r = q - q_0` with its
    tilted moments (:func:`cluster_sketch`):

    .. math::

        \sum_c (Y_c + S_c \lVert\mu - \hat o\rVert^2)\, e^{2\tau r\cdot\tilde m_c
            + 2\tau^2\sum_j r_j^2\tilde\sigma^2_{cj}},\qquad
        \sum_c N_c\, e^{\tau r\cdot m'_c + \tau^2\sum_j r_j^2\sigma'^2_{cj}/2},

    the exponential-tilting identity :math:`\sum_{U_c} w_i e^{2\tau q\cdot k_i} =
    S_c\,E_\omega[e^{2\tau r\cdot k}]` with the Gaussian step on :math:`\omega`: exact at
    :math:`q = q_0` for any keys (docs/theory.md section 8, fifth slice).
    """
    q, k, v, p, o = _kept_inputs(q, keys, values, pi, output)
    tau = 1.0 / np.sqrt(q.shape[0]) if scale is None else float(scale)
    s = scores(q, k, scale=scale)
    r = q if sketch.tilt is None else q - sketch.tilt
    h = 0.0 if sketch.shift is None else sketch.shift
    lin = tau * sketch.mean @ r + h
    quad = tau ** 2 * sketch.var @ (r * r)
    zmean = sketch.mean if sketch.zmean is None else sketch.zmean
    zvar = sketch.var if sketch.zvar is None else sketch.zvar
    zexp = tau * zmean @ r + h + tau ** 2 * zvar @ (r * r) / 2.0
    log_z = logsumexp(np.concatenate([s, np.log(np.maximum(sketch.count, 1e-300)) + zexp]))
    a2 = float(np.sum((sketch.mu - o) ** 2))
    ratio = (1.0 - p) / p
    dd = np.sum((v - o) ** 2, axis=1)
    m = (ratio > 0) & (dd > 0)
    ev = sketch.wnorm + a2 * sketch.weight
    me = ev > 0
    terms = np.concatenate([np.log(ratio[m]) + 2.0 * s[m] + np.log(dd[m]),
                            np.log(ev[me]) + 2.0 * lin[me] + 2.0 * quad[me]])
    if terms.size == 0:
        return 0.0
    return float(np.exp(logsumexp(terms) - 2.0 * log_z))
