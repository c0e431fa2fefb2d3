"""The block design (cluster sampling): blocks of ``block_size`` tokens are the sampling units.

Paged serving engines (vLLM, SGLang, FlashInfer) store K/V in blocks of
``block_size`` consecutive tokens that hold every head of a layer, and one
block table serves all layers of a KV-cache group: only whole blocks can be
freed. This module is the float64 NumPy oracle of the block design of
docs/design.md section 7 (derivation: docs/theory.md section 7), one query head at a
time, written to be read beside the token design of :mod:`.design` and
:mod:`.estimators`:

- block b holds the tokens at positions ``b * block_size .. (b + 1) * block_size - 1``
  (the last block may be partial);
- :func:`block_importance` aggregates token importance over the tokens of a
  block and over the layers and heads that share the block table;
- :func:`block_inclusion_probabilities` is the token design's capped-PPS
  solver (:func:`.design.inclusion_probabilities`) run on blocks: certainty
  set in blocks (sink blocks, recent blocks, top blocks), defensive floor,
  expected kept count ``budget`` in blocks;
- :func:`block_sample` draws independent Bernoulli(pi_b) from a counter-based
  stream keyed by (seed, event) and indexed by the block index, bit-identical
  to ``kvcert.fast.block_uniforms`` (so the kept blocks of a sequence depend
  neither on the batch it is served in nor on call order);
- :func:`block_hajek_attention` is the Hajek estimate (offset -log pi_b on
  every token of a kept block) with the cluster-sampling variance

  .. math:: \\hat\\Sigma = \\sum_{b\\in S} (1-\\pi_b)\\, z_b z_b^\\top, \\qquad
            z_b = \\sum_{i\\in b} a_i (v_i - \\hat o).

With ``block_size = 1`` (and one head) everything reduces to the token design.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
from scipy.special import logsumexp

from .design import check_nonneg_int, inclusion_probabilities
from .estimators import Estimate, as_qkv, check_pi, check_vector, empty_estimate, hajek_logits, scores

__all__ = [
    "BLOCK_REDUCTIONS",
    "REDUCTIONS",
    "block_count",
    "block_stream_key",
    "expand_blocks",
    "block_importance",
    "block_inclusion_probabilities",
    "block_uniforms",
    "block_sample",
    "block_keep",
    "block_labels",
    "block_hajek_attention",
    "block_linearized_variance",
    "block_linearized_variance_ht",
]

#: name -> how :func:`block_importance` combines the per-head block shares (heads, n_blocks) -> (n_blocks,) over
#: the heads and layers that share a block table; the float64 twin of ``kvcert.fast.REDUCTIONS`` (same names)
REDUCTIONS = MappingProxyType({
    "mean": lambda shares: shares.mean(axis=0),
    "max": lambda shares: shares.max(axis=0),
})
#: the names of :data:`REDUCTIONS`, in its order
BLOCK_REDUCTIONS = tuple(REDUCTIONS)

# ----------------------------------------------------------------------------- the block stream
# SplitMix64 (Steele, Lea & Flood 2014) on 64-bit words, as kvcert.fast.design; written with Python
# ints for the key chain and NumPy uint64 (wrapping) for the per-block counters.

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, SplitMix64's increment
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
#: domain tag of the block stream ("kvblocks" in ASCII): its keys never coincide with a token stream's
BLOCK_STREAM_TAG = 0x6B76626C6F636B73


def _mix_int(x: int) -> int:
    """SplitMix64 finalizer on one Python int (taken modulo 2**64)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def _mix_u64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer on a uint64 array (wrapping products)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def block_stream_key(seed: int, event: int = 0) -> int:
    """The 64-bit key of the block stream of (seed, event).

    ``k = mix(seed + G); k = mix((k ^ TAG) + G); k = mix((k ^ event) + G)``, with
    ``G = 0x9E3779B97F4A7C15`` and ``TAG = 0x6B76626C6F636B73`` ("kvblocks"),
    every integer modulo 2**64. No layer, head or batch row enters the key:
    the block choice is shared by every layer and head of a sequence, and a
    sequence draws the same blocks whatever batch it is served in.
    """
    seed = check_nonneg_int("seed", seed)
    event = check_nonneg_int("event", event)
    k = _mix_int(seed + _GOLDEN)
    k = _mix_int((k ^ BLOCK_STREAM_TAG) + _GOLDEN)
    return _mix_int((k ^ event) + _GOLDEN)


def block_uniforms(n_blocks: int, seed: int, *, event: int = 0, index=None) -> np.ndarray:
    r"""The uniforms :math:`U_b \in [0, 1)` that decide which blocks are kept (:math:`I_b = [U_b < \pi_b]`).

    Block b (its index in the sequence, or ``index[b]`` when given) draws
    :math:`U_b = (\mathrm{mix}(k + (b + 1) G) \gg 11)\, 2^{-53}`, the b-th output
    of a SplitMix64 generator whose state is the key of :func:`block_stream_key`:
    a float64 with 53 random bits. ``kvcert.fast.block_uniforms`` computes the
    same bits in torch.

    Parameters
    ----------
    n_blocks : int >= 0
    seed, event : int >= 0
    index : int array (n_blocks,), optional
        Block index of each entry (default ``arange(n_blocks)``), >= 0.

    Returns
    -------
    U : ndarray (n_blocks,), float64
    """
    n_blocks = check_nonneg_int("n_blocks", n_blocks)
    key = block_stream_key(seed, event)
    if index is None:
        idx = np.arange(n_blocks, dtype=np.uint64)
    else:
        raw = np.asarray(index)
        if raw.shape != (n_blocks,) or not np.issubdtype(raw.dtype, np.integer) or np.any(raw < 0):
            raise ValueError(f"index must be a non-negative int array of shape ({n_blocks},), "
                             f"got {raw.dtype} of shape {raw.shape}")
        idx = raw.astype(np.uint64)
    with np.errstate(over="ignore"):
        state = np.uint64(key) + (idx + np.uint64(1)) * np.uint64(_GOLDEN)
    z = _mix_u64(state)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


# ----------------------------------------------------------------------------- blocks and importance


def _check_block_size(block_size) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size must be an int >= 1, got {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size}")
    return int(block_size)


def block_count(n: int, block_size: int) -> int:
    """Number of blocks ``ceil(n / block_size)`` covering n tokens (the last one may be partial)."""
    n = check_nonneg_int("n", n)
    bs = _check_block_size(block_size)
    return -(-n // bs)


def expand_blocks(x, block_size: int, n: int) -> np.ndarray:
    """Per-block values (n_blocks,) -> per-token values (n,): token i gets ``x[i // block_size]``.

    Use it for the token-level pi of a block design (every token of block b has pi_b) and for the
    token mask of a block sample (:func:`block_keep`).
    """
    bs = _check_block_size(block_size)
    nb = block_count(n, bs)
    x = np.asarray(x)
    if x.shape != (nb,):
        raise ValueError(f"x must have shape (n_blocks,) = ({nb},) for n = {n}, block_size = {bs}, "
                         f"got shape {x.shape}")
    return x[np.arange(n) // bs]


def block_keep(keep_blocks, block_size: int, n: int) -> np.ndarray:
    """Token mask (n,) of a block sample: token i is kept iff its block ``i // block_size`` is."""
    kb = np.asarray(keep_blocks)
    if kb.dtype != bool:
        raise TypeError(f"keep_blocks must be a bool array, got dtype {kb.dtype}")
    return expand_blocks(kb, block_size, n)


def block_importance(importance, block_size: int, *, reduce: str = "mean", normalize: bool = True) -> np.ndarray:
    r"""Block importance, aggregated over the tokens of a block and the heads sharing the table.

    .. math::

        U_{hb} = \sum_{i\in b} u_{hi}, \qquad
        \tilde U_{hb} = U_{hb} / \textstyle\sum_{b'} U_{hb'} \ (\text{normalize}), \qquad
        u_b = \operatorname{mean}_h \tilde U_{hb} \ \ \text{or} \ \ \max_h \tilde U_{hb},

    where h runs over every (layer, KV head) that shares the block table. The
    token sum is the block's share of the attention mass (for SnapKV-style
    importance), i.e. the size measure of the cluster total that the design
    samples; normalizing each head to shares makes every head count equally
    whatever the scale of its scores (a head with zero total stays 0).
    ``"mean"`` (default) targets the average head; ``"max"`` protects the
    blocks that any single head needs (PPS on the max never gives a block a
    smaller size than its share in any head, at the price of spreading the
    budget).

    Parameters
    ----------
    importance : array_like, shape (n,) or (..., n)
        Non-negative, finite token importance; all leading axes (layers,
        heads) are aggregated.
    block_size : int >= 1
    reduce : {"mean", "max"}
    normalize : bool

    Returns
    -------
    ndarray (n_blocks,), float64, ``n_blocks = ceil(n / block_size)``

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import block_importance
    >>> block_importance(np.array([[1.0, 1, 2, 0, 4], [0, 0, 0, 0, 1]]), 2, normalize=False)
    array([1. , 1. , 2.5])
    """
    u = np.asarray(importance, dtype=np.float64)
    if u.ndim == 0 or u.shape[-1] == 0:
        raise ValueError(f"importance must have shape (n,) or (..., n) with n >= 1, got shape {u.shape}")
    if not np.all(np.isfinite(u)):
        raise ValueError("importance must be finite (found NaN or inf)")
    if np.any(u < 0):
        raise ValueError(f"importance must be >= 0, found min {u.min():.3g}")
    if not isinstance(reduce, str) or reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {BLOCK_REDUCTIONS}, got {reduce!r}")
    bs = _check_block_size(block_size)
    n = u.shape[-1]
    nb = block_count(n, bs)
    heads = u.reshape(-1, n)
    tot = np.zeros((heads.shape[0], nb))
    for b in range(nb):  # U_hb = sum of the block's tokens
        tot[:, b] = heads[:, b * bs : (b + 1) * bs].sum(axis=1)
    if normalize:
        mass = tot.sum(axis=1, keepdims=True)
        tot = np.divide(tot, mass, out=np.zeros_like(tot), where=mass > 0)
    return REDUCTIONS[reduce](tot)


def block_inclusion_probabilities(
    importance,
    budget: float,
    *,
    block_size: int,
    sink_blocks: int = 1,
    recent_blocks: int = 2,
    top_blocks: int = 0,
    floor: float = 0.1,
    reduce: str = "mean",
    normalize: bool = True,
) -> np.ndarray:
    r"""Inclusion probabilities pi_b of the block design (one per block).

    The token design's capped PPS (:func:`kvcert.reference.inclusion_probabilities`)
    applied to the block importance of :func:`block_importance`:

    .. math::

        u'_b = (1-\alpha)\,\frac{u_b}{\sum_{c\in T} u_c} + \frac{\alpha}{|T|},
        \qquad \pi_b = \min(1, \lambda u'_b)\ (b \in T), \qquad \pi_b = 1\ (b \in C),
        \qquad \sum_b \pi_b = B,

    with the certainty set C in blocks: the first ``sink_blocks``, the last
    ``recent_blocks`` (the partial last block is one of them) and the
    ``top_blocks`` most important others.

    Parameters
    ----------
    importance : array_like (n,) or (..., n)
        Token importance of every layer and head sharing the block table.
    budget : float
        Expected number of kept *blocks*, ``|C| < budget <= n_blocks``.
        The expected kept memory is ``sum_b pi_b |b|`` tokens (``budget *
        block_size`` when the last block is full or certain).
    block_size : int >= 1
    sink_blocks, recent_blocks, top_blocks : int >= 0
    floor : float in (0, 1]
    reduce, normalize : see :func:`block_importance`

    Returns
    -------
    pi_blocks : ndarray (n_blocks,), float64 in (0, 1]

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import block_inclusion_probabilities
    >>> pi = block_inclusion_probabilities(np.arange(40.0), 5.0, block_size=4, sink_blocks=1, recent_blocks=1)
    >>> pi.shape, round(float(pi.sum()), 12), float(pi[0]), float(pi[-1])
    ((10,), 5.0, 1.0, 1.0)
    """
    for name, value in (("sink_blocks", sink_blocks), ("recent_blocks", recent_blocks), ("top_blocks", top_blocks)):
        check_nonneg_int(name, value)
    ub = block_importance(importance, block_size, reduce=reduce, normalize=normalize)
    try:
        return inclusion_probabilities(ub, budget, sinks=sink_blocks, window=recent_blocks, top=top_blocks,
                                       floor=floor)
    except (TypeError, ValueError) as err:  # the token solver's message, in block units
        msg = str(err)
        for token, block in (("sinks=", "sink_blocks="), ("window=", "recent_blocks="), ("top=", "top_blocks="),
                             ("<= n =", "<= n_blocks ="), ("< n =", "< n_blocks =")):
            msg = msg.replace(token, block)
        raise type(err)(f"{msg} (block design: budget and the certainty set count blocks of "
                        f"{block_size} tokens)") from None


def block_sample(pi_blocks, *, seed: int | None = None, event: int = 0, uniforms=None) -> np.ndarray:
    r"""Poisson sampling of blocks: :math:`I_b = [U_b < \pi_b]`, independent over blocks.

    Parameters
    ----------
    pi_blocks : array_like (n_blocks,), values in [0, 1]
    seed : int, optional
        The stream of :func:`block_uniforms` (seed, event).
    event : int >= 0
    uniforms : array_like (n_blocks,), optional
        The uniforms themselves, instead of ``seed``.

    Returns
    -------
    keep_blocks : ndarray of bool (n_blocks,)
    """
    p = np.asarray(pi_blocks, dtype=np.float64)
    if p.ndim != 1:
        raise ValueError(f"pi_blocks must have shape (n_blocks,), got shape {p.shape}")
    if not np.all((p >= 0) & (p <= 1)):
        raise ValueError("pi_blocks must lie in [0, 1] (found a value outside, or NaN)")
    if (seed is None) == (uniforms is None):
        raise TypeError("pass exactly one of seed= or uniforms=")
    if uniforms is not None:
        u = np.asarray(uniforms, dtype=np.float64)
        if u.shape != p.shape:
            raise ValueError(f"uniforms must have shape {p.shape}, got {u.shape}")
        if not np.all((u >= 0) & (u < 1)):
            raise ValueError("uniforms must lie in [0, 1)")
    else:
        u = block_uniforms(p.size, seed, event=event)
    return u < p


# ----------------------------------------------------------------------------- the estimator


def block_labels(n: int, block_size: int, positions=None) -> np.ndarray:
    """Block of each slot, ``positions // block_size`` (-1 where positions is -1, i.e. padding).

    ``positions`` (n,) are the original token positions of a compressed cache (default
    ``arange(n)``: the slots are the sequence).
    """
    bs = _check_block_size(block_size)
    if positions is None:
        return np.arange(n) // bs
    pos = np.asarray(positions)
    if pos.shape != (n,) or not np.issubdtype(pos.dtype, np.integer) or np.any(pos < -1):
        raise ValueError(f"positions must be an int array of shape (n,) = ({n},) with values >= -1 "
                         f"(-1 = padding), got {pos.dtype} of shape {pos.shape}")
    return np.where(pos >= 0, pos // bs, -1)


def _clusters(p: np.ndarray, labels: np.ndarray, name: str = "pi"):
    """(cluster keys, slot -> cluster index or -1 (padding), pi per cluster).

    The sampling units: the tokens with 0 < pi < 1 grouped by block label, and every token with
    pi = 1 on its own (a certain token is never pooled into a sampled block, e.g. a decode token
    appended to the last block after an eviction; it contributes nothing to the variance either way).
    """
    present = p > 0
    if np.any(present & (labels < 0)):
        raise ValueError(f"{name} must be 0 on padding slots (positions == -1)")
    key = np.where(p < 1, labels, labels.max(initial=0) + 1 + np.arange(p.size))
    ids, inv = np.unique(key[present], return_inverse=True)
    member = np.full(p.size, -1)
    member[present] = inv
    pib = np.ones(ids.size)
    for c in range(ids.size):
        vals = p[member == c]
        if np.any(vals != vals[0]):
            raise ValueError(f"{name} must be equal on all sampled tokens (pi < 1) of a block "
                             f"(positions // block_size); block {ids[c]} has {name} in "
                             f"[{vals.min():.17g}, {vals.max():.17g}]")
        pib[c] = vals[0]
    return ids, member, pib


def block_hajek_attention(q, keys, values, pi, *, block_size: int, positions=None, scale: float | None = None,
                          per_coordinate: bool = True, bias=None) -> Estimate:
    r"""Hajek attention over a block sample and its cluster-sampling variance.

    .. math::

        \hat o = \sum_{i\in S} a_i v_i, \qquad a_i = \operatorname{softmax}_S(s_i - \log \pi_{b(i)}),

        \hat\Sigma = \sum_{b\in S} (1-\pi_b)\, z_b z_b^\top, \qquad
        z_b = \sum_{i\in b} a_i (v_i - \hat o), \qquad
        \mathrm{trace} = \sum_{b\in S} (1-\pi_b) \lVert z_b\rVert^2 .

    The output, weights and lse are those of the token estimator with every
    token of block b carrying pi_b (the offset -log pi_b); only the variance
    differs: a block is sampled as a whole, so the linearized error
    :math:`Z^{-1}\sum_b (I_b/\pi_b - 1) \sum_{i\in b} e^{s_i}(v_i - o)` is a sum
    over independent *blocks*, and its HT variance estimate keeps the
    cross-products of the tokens of a block (docs/theory.md section 7.4).

    The other fields follow the same cluster form:
    ``n_eff`` = 1 / sum_b A_b^2 (effective number of *blocks*, A_b = sum_{i in b} a_i; certain tokens count
    one by one);
    ``max_term`` = max over sampled tail blocks of max(1 - pi_b, pi_b) ||z_b||;
    ``tail_moment`` = sum_b (1 - pi_b) x_b^2 with x_b = (1 - pi_b) ||z_b||^2.
    With one token per block they are the token design's (:func:`hajek_attention`).

    Parameters
    ----------
    q : (d,)
    keys, values : (n, d), (n, dv)
        The kept tokens (rows with pi = 0 are padding).
    pi : (n,)
        Per-token inclusion probability: pi_b of the token's block (equal on
        all tokens of a block, checked), 0 on padding.
    block_size : int >= 1
    positions : int (n,), optional
        Original positions (-1 on padding); block of a slot = position //
        block_size. Default ``arange(n)``.
    scale : float, default 1/sqrt(d)
    per_coordinate : bool
        Signature parity; the reference always computes the covariance.
    bias : (n,), optional additive mask (-inf masks a token).

    Returns
    -------
    Estimate

    Notes
    -----
    Blocks with pi_b = 1 contribute 0; with all pi = 1 the estimate is exact
    attention and the variance is 0. Tokens with pi = 1 are sampling units of
    their own, never pooled into a sampled block (a decode token appended to
    a block after the eviction is certain even if the block was sampled); in
    ``n_eff`` they count one by one. Masked tokens (bias -inf) have a_i = 0
    and drop out of z_b. An empty sample gives the token design's
    convention (output 0, lse -inf, variance/trace/tail_moment +inf).

    References
    ----------
    Horvitz & Thompson (1952); Hajek (1971); Sarndal, Swensson & Wretman
    (1992), sec. 4.2 (cluster sampling), 5.6-5.7; arXiv 2607.21475.

    Examples
    --------
    >>> import numpy as np
    >>> from kvcert.reference import attention, block_hajek_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=4), rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    >>> est = block_hajek_attention(q, k, v, np.ones(6), block_size=4)
    >>> bool(np.allclose(est.output, attention(q, k, v))), est.trace
    (True, 0.0)
    """
    q, k, v = as_qkv(q, keys, values)
    n, dv = v.shape
    p = check_pi(pi, n)
    labels = block_labels(n, block_size, positions)
    _, member, pib = _clusters(p, labels)
    logits = hajek_logits(scores(q, k, scale=scale, bias=bias), p)
    if n == 0 or np.all(logits == -np.inf):
        return empty_estimate(n, dv)
    lse = float(logsumexp(logits))
    return _cluster_estimate(np.exp(logits - lse), lse, v, member, pib)


def _cluster_estimate(a: np.ndarray, lse: float, v: np.ndarray, member: np.ndarray, pib: np.ndarray) -> Estimate:
    """The estimate of the Hajek weights a (n,) under block sampling: o_hat = a v, the block sums z_b and A_b
    over the clusters ``member`` (-1 = padding) and the cluster-sampling covariance and statistics."""
    out = a @ v
    r = v - out
    nc = pib.size
    z = np.zeros((nc, v.shape[1]))  # z_b = sum_{i in b} a_i (v_i - o_hat)
    wb = np.zeros(nc)  # A_b = sum_{i in b} a_i
    for i in np.flatnonzero(member >= 0):
        z[member[i]] += a[i] * r[i]
        wb[member[i]] += a[i]
    cb = 1.0 - pib
    cov = (z * cb[:, None]).T @ z
    cov = 0.5 * (cov + cov.T)
    var = np.einsum("b,bj,bj->j", cb, z, z)
    z2 = np.einsum("bj,bj->b", z, z)
    xb = cb * z2
    tail = (pib < 1) & (wb > 0)
    terms = np.maximum(1.0 - pib, pib) * np.sqrt(z2)
    return Estimate(
        output=out,
        weights=a,
        variance=var,
        covariance=cov,
        trace=float(var.sum()),
        lse=lse,
        n_eff=float(1.0 / np.sum(wb * wb)),
        max_term=float(terms[tail].max()) if np.any(tail) else 0.0,
        tail_moment=float(np.sum(cb * xb * xb)),
    )


def _block_totals(q, k, v, p, labels, *, scale, bias, output, lse):
    """(pi per block, t_b = sum_{i in b} w_i (v_i - o)) over the population, w_i = e^{s_i - lse}."""
    ids, member, pib = _clusters(p, labels)
    s = scores(q, k, scale=scale, bias=bias)
    w = np.exp(s - float(lse))
    r = v - np.asarray(output, dtype=np.float64)
    t = np.zeros((ids.size, v.shape[1]))
    for i in np.flatnonzero(member >= 0):
        t[member[i]] += w[i] * r[i]
    return ids, member, pib, t


def block_linearized_variance(q, keys, values, pi, *, block_size: int, positions=None, scale: float | None = None,
                              bias=None) -> np.ndarray:
    r"""Design covariance of the linearized Hajek error under block sampling, over the *full* population.

    .. math:: V = \sum_b \frac{1-\pi_b}{\pi_b}\, t_b t_b^\top, \qquad
              t_b = \sum_{i\in b} w_i (v_i - o), \quad w_i = e^{s_i}/Z.

    ``pi`` (n,) is the per-token pi (pi_b on every token of block b, all > 0). Needs every token
    (the truth); :func:`block_hajek_attention` estimates it from the sample.
    """
    q, k, v = as_qkv(q, keys, values)
    p = check_vector("pi", pi, k.shape[0])
    if np.any(p <= 0) or np.any(p > 1):
        raise ValueError("pi must lie in (0, 1] over the population")
    labels = block_labels(k.shape[0], block_size, positions)
    s = scores(q, k, scale=scale, bias=bias)
    lse = float(logsumexp(s))
    o = np.exp(s - lse) @ v
    _, _, pib, t = _block_totals(q, k, v, p, labels, scale=scale, bias=bias, output=o, lse=lse)
    c = (1.0 - pib) / pib
    return (t * c[:, None]).T @ t


def block_linearized_variance_ht(q, keys, values, pi, keep, *, block_size: int, output, lse, positions=None,
                                 scale: float | None = None, bias=None) -> np.ndarray:
    r"""HT estimate of :func:`block_linearized_variance` from a block sample, with the *true* o and log Z.

    .. math:: \hat V = \sum_{b\in S} \frac{1-\pi_b}{\pi_b^2}\, t_b t_b^\top,

    exactly design-unbiased for V under Poisson sampling of blocks. With o_hat and Z_hat in place
    of o and Z, :math:`t_b/\pi_b = z_b` and it becomes the ``covariance`` of
    :func:`block_hajek_attention`.

    Parameters
    ----------
    keys, values, pi : the full population (pi per token, > 0); keep : (n,) bool token mask of the
        sample (whole blocks).
    output, lse : the true attention output o and log Z (or o_hat, log Z_hat).
    """
    q, k, v = as_qkv(q, keys, values)
    n = k.shape[0]
    p = check_vector("pi", pi, n)
    keep = np.asarray(keep)
    if keep.shape != (n,) or keep.dtype != bool:
        raise ValueError(f"keep must be a bool array of shape (n,) = ({n},), got {keep.dtype} of shape {keep.shape}")
    labels = block_labels(n, block_size, positions)
    ps = np.where(keep, p, 0.0)  # the sample: kept blocks only
    _, member, pib, t = _block_totals(q, k, v, ps, labels, scale=scale, bias=bias, output=output, lse=lse)
    lab_all = labels[keep]
    if np.any([np.any(~keep[labels == b]) for b in np.unique(lab_all)]):
        raise ValueError("keep must keep or drop whole blocks (positions // block_size)")
    c = (1.0 - pib) / pib ** 2
    return (t * c[:, None]).T @ t
