"""The adversary of the impossibility result (arXiv 2607.21475, sec. 3).

A deterministic policy keeps a set K and drops the rest E. Two caches that
differ only on E give bit-identical retained state, hence the same estimate,
yet their true attention outputs can differ by any amount: no estimator built
from the retained state can bound the error.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp

from .estimators import as_qkv, attention, scores

__all__ = ["AdversarialCache", "adversarial_cache"]


@dataclass(frozen=True)
class AdversarialCache:
    """A cache equal to the original on the kept rows.

    Attributes
    ----------
    keys, values : the modified cache (kept rows bit-identical to the input)
    retained_output : attention over the kept rows only (the policy's estimate,
        identical for the original and the modified cache)
    true_output : exact attention over the modified cache
    error : ||retained_output - true_output||_2 (the requested ``target_error``
        up to rounding)
    evicted_weight : attention mass W_E of the evicted rows (unchanged by the attack)
    """

    keys: np.ndarray
    values: np.ndarray
    retained_output: np.ndarray
    true_output: np.ndarray
    error: float
    evicted_weight: float


def adversarial_cache(q, keys, values, keep, *, target_error: float, direction=None,
                      scale: float | None = None) -> AdversarialCache:
    r"""Modify only the evicted values so that the true error is ``target_error``.

    Keys are left untouched, so every key-based scorer (all of
    :mod:`kvcert.reference.baselines`) picks the same kept set on the modified
    cache, and the attention weights :math:`w_i` do not change. With
    :math:`W_E = \sum_{j\in E} w_j > 0` and a unit vector u, shifting every
    evicted value by

    .. math:: x = (\hat o_K + t\,u - o) / W_E

    moves the true output to :math:`o' = o + W_E x = \hat o_K + t u`, so
    :math:`\lVert \hat o_K - o'\rVert = t` exactly while the retained rows
    are bit-identical.

    Parameters
    ----------
    q : (d,)   keys : (n, d)   values : (n, dv)
    keep : (n,) bool, the policy's kept set (at least one kept, one evicted)
    target_error : float >= 0
    direction : (dv,), optional; default the first coordinate axis
    scale : float, default 1/sqrt(d)
    """
    q, k, v = as_qkv(q, keys, values)
    keep = np.asarray(keep)
    if keep.dtype != bool or keep.shape != (k.shape[0],):
        raise ValueError(f"keep must be a bool mask of shape ({k.shape[0]},), got {keep.dtype} {keep.shape}")
    if keep.all() or not keep.any():
        raise ValueError("keep must keep at least one token and evict at least one")
    t = float(target_error)
    if not (np.isfinite(t) and t >= 0):
        raise ValueError(f"target_error must be finite and >= 0, got {target_error}")
    u = np.zeros(v.shape[1]) if direction is None else np.asarray(direction, dtype=np.float64).copy()
    if direction is None:
        u[0] = 1.0
    if u.shape != (v.shape[1],) or not np.linalg.norm(u) > 0:
        raise ValueError(f"direction must be a nonzero vector of shape ({v.shape[1]},)")
    u = u / np.linalg.norm(u)
    s = scores(q, k, scale=scale)
    w = np.exp(s - logsumexp(s))
    evicted = ~keep
    w_e = float(w[evicted].sum())
    if not w_e > 1e-300:
        raise ValueError("the evicted tokens carry no attention mass in float64; the attack needs W_E > 0")
    o = w @ v
    retained = attention(q, k[keep], v[keep], scale=scale)
    v2 = v.copy()
    v2[evicted] += (retained + t * u - o) / w_e
    true2 = attention(q, k, v2, scale=scale)
    return AdversarialCache(keys=k.copy(), values=v2, retained_output=retained, true_output=true2,
                            error=float(np.linalg.norm(retained - true2)), evicted_weight=w_e)
