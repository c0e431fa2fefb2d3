"""Batched eviction: Poisson sampling + compaction into a padded cache.

:func:`evict` runs one eviction event on every KV head at once (inclusion
probabilities, Poisson draw, compaction) and packs the per-head kept tokens
into a padded :class:`~kvcert.fast.types.CompressedCache`. Nothing of size
O(n^2) is formed; the extra memory is a few (b, h_kv, n) vectors plus the
output cache. :func:`topk_evict` is the deterministic baseline (same output
type, pi = 1 on the kept tokens).
"""

from __future__ import annotations

import numbers

import torch

from ._checks import check_probabilities, check_tensor, stat_dtype
from .design import (value_at, certainty_rows, count_rows, check_sampling, design_uniforms, draw_sample, edge_mask,
                     inclusion_probabilities, poisson_sample, systematic_sample)
from .sketch import cluster_sketch
from .types import CompressedCache

__all__ = ["evict", "topk_evict", "compact"]


def _check_cache(keys, values, importance):
    keys = check_tensor("keys", keys, ndim=(4,), floating=True)
    values = check_tensor("values", values, ndim=(4,), floating=True)
    b, h, n, _ = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values must have shape (b, h_kv, n, dv) = ({b}, {h}, {n}, dv), got {tuple(values.shape)}")
    importance = check_tensor("importance", importance, floating=True)
    if tuple(importance.shape) != (b, h, n):
        raise ValueError(f"importance must have shape (b, h_kv, n) = ({b}, {h}, {n}), got {tuple(importance.shape)}")
    return keys, values, importance


def _prior(pi, positions, shape, device):
    """Validity, previous pi (or None) and positions of the input slots."""
    b, h, n = shape
    prev = None
    valid = None
    if pi is not None:
        pi = check_tensor("pi", pi, floating=True)
        if tuple(pi.shape) != shape:
            raise ValueError(f"pi must have shape (b, h_kv, n) = {shape}, got {tuple(pi.shape)}")
        check_probabilities("pi", pi)
        prev = pi
        valid = pi > 0
    if positions is not None:
        positions = check_tensor("positions", positions)
        if positions.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"positions must be an int64 tensor, got dtype {positions.dtype}")
        if tuple(positions.shape) != shape:
            raise ValueError(f"positions must have shape (b, h_kv, n) = {shape}, got {tuple(positions.shape)}")
        positions = positions.to(torch.int64)
        pv = positions >= 0
        if valid is not None and not bool((pv == valid).all()):
            raise ValueError("pi and positions disagree on padding (pi == 0 must be exactly positions == -1)")
        valid = pv if valid is None else valid
    else:
        positions = torch.arange(n, device=device).expand(b, h, n)
        if valid is not None:
            positions = positions.masked_fill(~valid, -1)
    return valid, prev, positions


def compact(keep: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pi: torch.Tensor,
            positions: torch.Tensor) -> CompressedCache:
    r"""Pack the kept slots of every head to the front, in slot order, padded.

    With :math:`k_r = \sum_i I_{ri}` the kept count of row r and
    :math:`m = \max_r k_r`, output slot j of row r holds the kept input slot
    i with :math:`\sum_{l \le i} I_{rl} = j + 1` (the inverse map is one
    scatter of the running count, O(n) per row; then one row gather of K and
    V); slots :math:`j \ge k_r` are padding (pi 0, position -1, zero K/V).

    Parameters
    ----------
    keep : bool (b, h, n); keys, values : (b, h, n, d/dv); pi : (b, h, n); positions : int64 (b, h, n)

    Returns
    -------
    CompressedCache
    """
    b, h, n = keep.shape
    R = b * h
    kept = keep.sum(-1)  # (b, h)
    m = int(kept.max()) if keep.numel() else 0
    kr = keep.reshape(R, n)
    run = kr.cumsum(-1, dtype=torch.int64)  # running kept count per row
    # inverse map by one scatter: kept slot i goes to output column run_i - 1, the rest to a
    # dump column m (dropped); columns never written stay -1 (padding)
    dest = torch.where(kr, run - 1, m)
    src = torch.full((R, m + 1), -1, dtype=torch.int64, device=keep.device)
    src.scatter_(1, dest, torch.arange(n, device=keep.device).expand(R, n))
    src = src[:, :m]
    pad = src < 0
    src.clamp_(min=0)
    d, dv = keys.shape[-1], values.shape[-1]
    if keys.is_contiguous() and values.is_contiguous():  # one row gather of the flat cache
        flat = (src + torch.arange(R, device=keep.device)[:, None] * n).reshape(-1)
        k_out = keys.reshape(R * n, d).index_select(0, flat).reshape(b, h, m, d)
        v_out = values.reshape(R * n, dv).index_select(0, flat).reshape(b, h, m, dv)
    else:  # e.g. one cache expanded over many samples (stride 0): gather in place, no flat copy of it
        idx = src.reshape(b, h, m, 1)
        k_out = torch.gather(keys, 2, idx.expand(b, h, m, d))
        v_out = torch.gather(values, 2, idx.expand(b, h, m, dv))
    p_out = torch.gather(pi, 2, src.reshape(b, h, m))
    pos_out = torch.gather(positions, 2, src.reshape(b, h, m))
    if bool(pad.any()):
        padm = pad.reshape(b, h, m)
        idx = padm.nonzero(as_tuple=True)
        k_out.index_put_(idx, torch.zeros((), dtype=k_out.dtype, device=k_out.device))
        v_out.index_put_(idx, torch.zeros((), dtype=v_out.dtype, device=v_out.device))
        p_out.masked_fill_(padm, 0.0)
        pos_out.masked_fill_(padm, -1)
    return CompressedCache(keys=k_out, values=v_out, pi=p_out, positions=pos_out, kept=kept)


def evict(keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor, budget, *, sinks: int = 4,
          window: int = 32, top=0, floor: float = 0.1, seed: int | None = 0, layer: int = 0, event: int = 0,
          pi: torch.Tensor | None = None, positions: torch.Tensor | None = None,
          uniforms: torch.Tensor | None = None, generator: torch.Generator | None = None,
          row_streams: bool = True, sketch=None, tilt: torch.Tensor | None = None,
          scale: float | None = None, sampling: str = "poisson", start: torch.Tensor | None = None) -> CompressedCache:
    r"""One Poisson eviction event on every KV head, compacted into a padded cache.

    .. math::

        \pi^{(e)} = \mathrm{inclusion\_probabilities}(u, B), \qquad
        I_i \sim \mathrm{Bernoulli}(\pi^{(e)}_i), \qquad
        \pi_i \leftarrow \pi^{\mathrm{prev}}_i\, \pi^{(e)}_i \ \text{on the kept tokens}.

    Parameters
    ----------
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv)
        The cache (possibly an earlier ``CompressedCache``, with padding).
    importance : (b, h_kv, n)
        Scorer output, >= 0 on the real slots (ignored on padding).
    budget : float or tensor broadcastable to (b, h_kv)
        Expected kept count per head among the real slots, ``|C| < budget <= n``.
    sinks, window, top, floor
        The design (see :func:`kvcert.fast.inclusion_probabilities`); sinks
        and window count the real slots of each head in slot order; ``top``
        an int or an int tensor broadcastable to (b, h_kv) (one per row).
    seed, layer, event : int
        The default random stream (see :mod:`kvcert.fast.design`); each token's
        uniform is indexed by its original position, so the draw does not
        depend on padding. Use a new ``event`` for every eviction of a layer.
    row_streams : bool
        True (default): batch row r draws from stream row r. False: every row
        from stream row 0, so a row draws the same sample alone or in any
        batch (:func:`kvcert.fast.design_uniforms`; the presses' rule).
    pi, positions : (b, h_kv, n), optional
        pi and positions of an earlier ``CompressedCache`` (pi = 0 /
        positions = -1 on padding; new tokens appended since carry pi = 1).
        The returned pi is the product of the earlier pi and this event's.
    uniforms, generator
        Alternative randomness for :func:`kvcert.fast.poisson_sample`
        (``uniforms`` of shape (b, h_kv, n) makes masks equal the reference's).
    sampling : {"poisson", "systematic"}
        The sample given pi: independent draws :math:`[U_i < \pi_i]` (default, the paper's) or
        randomized systematic sampling, a fixed kept count per head (:func:`kvcert.fast.systematic_sample`,
        its start from counter 0 of the head's stream).
    start : (b, h_kv) float in [0, 1), optional
        With ``uniforms`` and ``sampling="systematic"``: each head's start (the reference's).
    sketch : ``kvcert.fast.ClusterDesign`` (or any object with its fields), optional
        Also keep the cluster sketch of this event's evicted tokens
        (:func:`kvcert.fast.cluster_sketch` of the cache before the event, with the
        returned pi over every slot and the sample), as ``CompressedCache.sketch``.
        It describes the tokens evicted *here*: an earlier event's evicted tokens are
        not in ``keys`` any more, so a second event needs a sketch of its own.
    tilt, scale : (b, h_kv, d) and float, a tilted sketch's tilt points
        (:func:`kvcert.fast.window_tilt`) and the attention's scale (default 1/sqrt(d)),
        passed to :func:`kvcert.fast.cluster_sketch`.

    Returns
    -------
    CompressedCache
        keys/values (b, h_kv, m, d/dv) with m the largest kept count, pi
        (0 on padding), positions (-1 on padding), kept (b, h_kv). Kept slots
        keep the input slot order (original position order for caches made by
        this function and tokens appended after them).

    Notes
    -----
    **Composition of events.** The final pi of a token is the probability
    that it survived every event: :math:`\pi_i = \prod_e \pi^{(e)}_i` where
    :math:`\pi^{(e)}_i` is the probability of the e-th event given what
    survived the earlier ones. By the tower rule,
    :math:`E[\prod_e I^{(e)}_i / \prod_e \pi^{(e)}_i] = 1`, so Horvitz-Thompson
    and Hajek stay unbiased / consistent exactly as for one event (two-phase
    sampling, Sarndal et al. 1992, ch. 9). A token is certain (pi = 1) after
    the event only if it was certain before *and* this design gives it 1;
    a once-sampled token keeps its pi < 1 forever, even when it lands in a
    later certainty set (sinks, window, top). A token is never re-included:
    evicted tokens are gone.

    References
    ----------
    Sarndal, Swensson & Wretman (1992), ch. 9 (two-phase sampling); arXiv 2607.21475.

    Examples
    --------
    >>> import torch
    >>> from kvcert.fast import evict
    >>> k, v = torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    >>> cc = evict(k, v, torch.rand(1, 2, 200), 60.0, seed=0, layer=1)
    >>> real = cc.pi[..., 1:] > 0
    >>> bool((cc.pi[..., :4] == 1).all()), bool((cc.positions.diff(dim=-1)[real] > 0).all())
    (True, True)
    """
    keys, values, importance = _check_cache(keys, values, importance)
    valid, prev, pos = _event_prior(keys, pi, positions, seed, uniforms, generator)
    p_e = inclusion_probabilities(importance, budget, sinks=sinks, window=window, top=top, floor=floor, valid=valid)
    keep = _event_sample(p_e, check_sampling(sampling), None if positions is None else pos, seed, layer, event,
                         row_streams, uniforms, generator, start)
    return _event_cache(keys, values, p_e, keep, prev, pos, valid, sketch, tilt, scale)


def _event_prior(keys, pi, positions, seed, uniforms, generator):
    """A source of randomness given, then the validity, previous pi and positions of the slots (:func:`_prior`)."""
    if seed is None and uniforms is None and generator is None:
        raise TypeError("pass seed= (an int), uniforms= or generator=")
    return _prior(pi, positions, tuple(keys.shape[:3]), keys.device)


def _event_sample(p_e, sampling, positions, seed, layer, event, row_streams, uniforms, generator, start):
    """The event's sample of p_e: from the design's stream (each token's counter its original position, or its
    slot when the cache carries no ``positions``), or from the given ``uniforms`` / ``generator``."""
    if uniforms is None and generator is None:
        index = None if positions is None else positions.clamp(min=0)
        u = design_uniforms(tuple(p_e.shape), seed, layer=layer, event=event, index=index, device=p_e.device,
                            row_streams=row_streams)
        # poisson_sample's / systematic_sample's rule, without re-validating the pi we just made
        return draw_sample(sampling, p_e, u, seed, layer=layer, event=event, row_streams=row_streams)
    if sampling == "systematic":
        if generator is not None:
            raise TypeError("sampling='systematic' draws from seed= or from uniforms= with start=, not generator=")
        return systematic_sample(p_e, uniforms=uniforms, start=start)
    return poisson_sample(p_e, uniforms=uniforms, generator=generator)


def _event_cache(keys, values, p_e, keep, prev, pos, valid, sketch, tilt, scale) -> CompressedCache:
    """The kept slots compacted with their final pi (the earlier pi times this event's), and the cluster sketch
    of the evicted ones when ``sketch`` is given."""
    final = p_e if prev is None else (prev.to(p_e.dtype) * p_e)
    cc = compact(keep, keys, values, final, pos)
    if sketch is not None:
        cc.sketch = cluster_sketch(keys, values, final, keep, sketch, valid=valid, tilt=tilt, scale=scale)
    return cc


def topk_evict(keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor, budget: int, *,
               sinks: int = 4, window: int = 32, pi: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> CompressedCache:
    r"""Deterministic eviction: keep exactly ``budget`` tokens per head.

    The sinks and the recent window, then the highest importance (ties to the
    lower index), as ``reference.deterministic_keep`` on every head; pi = 1 on
    the kept tokens (times the earlier pi when given). Its Hajek estimate is
    plain attention over the kept set with variance 0: a deterministic policy
    carries no information about what it evicted.

    .. math:: K = E \cup \operatorname{top}_{B - |E|}(u \text{ on the rest}),
              \qquad \pi_i = \pi^{\mathrm{prev}}_i \ (i \in K).

    Parameters
    ----------
    keys, values : (b, h_kv, n, d), (b, h_kv, n, dv)
    importance : (b, h_kv, n), finite
    budget : int, or int tensor broadcastable to (b, h_kv)
        Kept count per head, in [|E|, n_valid] with E the sinks + window.
    sinks, window : int
    pi, positions : optional, of an earlier CompressedCache (padding allowed)

    Returns
    -------
    CompressedCache
    """
    keys, values, importance = _check_cache(keys, values, importance)
    b, h, n, _ = keys.shape
    if isinstance(budget, torch.Tensor):  # one kept count per (b, h_kv) head, broadcast
        budget = count_rows("budget", budget, b * h, (b, h), keys.device)
    elif isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
        raise TypeError(f"budget must be an int (a kept count), got {type(budget).__name__}")
    else:
        budget = int(budget)
    valid, prev, pos = _prior(pi, positions, (b, h, n), keys.device)
    u = importance if valid is None else importance.masked_fill(~valid, 0.0)
    if not bool(torch.isfinite(u).all()):
        raise ValueError("importance must be finite (found NaN or inf)")
    vr = None if valid is None else valid.reshape(b * h, n)
    edge = edge_mask(n, sinks=sinks, window=window, valid=vr, device=keys.device)
    edge = edge.expand(b * h, n) if vr is None else edge
    ne = edge.sum(-1)
    nv = torch.full_like(ne, n) if vr is None else vr.sum(-1)
    bad = (budget < ne) | (budget > nv)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"budget must be in [{int(ne[i])}, {int(nv[i])}] (sinks + window .. n), got {value_at(budget, i)}")
    ur = u.reshape(b * h, n).to(torch.float64)
    keep = certainty_rows(ur, sinks, window, budget - ne, vr).reshape(b, h, n)
    one = torch.ones((b, h, n), dtype=stat_dtype(importance), device=keys.device)
    final = one if prev is None else prev.to(one.dtype)
    return compact(keep, keys, values, final, pos)
