"""Result containers shared by the torch backends (``kvcert.fast``, ``kvcert.kernels``).

Field names follow docs/design.md section 3 (contract). Leading dimensions are the
batch dimensions of the call: (b, h_q) for decode, (b, h_q, t) for several
queries, (b, h_kv) for per-KV-head quantities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Estimate", "Certificate", "CompressedCache"]


@dataclass
class Estimate:
    """Hajek estimate and its variance summaries (torch, batched).

    output   : (..., dv)  o_hat, in the dtype of ``values``
    weights  : (..., n) corrected softmax weights a_i, or None when not requested
    variance : (..., dv) float32 per-coordinate variance, or None
               (``per_coordinate=False``)
    trace    : (...,) float32 tr(Sigma_hat) = sum_i (1 - pi_i) a_i^2 ||v_i - o_hat||^2
    lse      : (...,) float32 log Z_hat = logsumexp_i(s_i - log pi_i)
    n_eff    : (...,) float32 Kish effective sample size 1 / sum a_i^2, or None
    max_term : (...,) float32 max over sampled tail tokens of
               max(1 - pi_i, pi_i) a_i ||v_i - o_hat|| (bernstein), or None
    covariance : (..., dv, dv) float32 Sigma_hat, or None (only on request:
               ``return_covariance=True`` in kvcert.fast.hajek_attention; the
               chi2 certificate uses it)
    tail_moment : (...,) float32 s2 = sum_i (1 - pi_i)^3 a_i^4 ||v_i - o_hat||^4, the HT
               estimate of the design variance of the trace itself, or None (only on request:
               ``return_tail_moment=True``; the chebyshev_ucb certificate uses it)
    backend  : str or None, the backend that computed the estimate ("reference", "fast" or
               "triton"), set by ``kvcert.dispatch`` (None from a backend called directly)
    route    : str or None, the code of that backend that ran: "reference", "torch"
               (kvcert.fast), "cpu_op" (the compiled CPU op) or "triton"; set by
               ``kvcert.dispatch`` (``kvcert.dispatch.Route``), None from a direct call

    Empty sample (every slot padding): output 0, lse -inf, variance, trace
    and tail_moment +inf (the reference's convention).
    """

    output: torch.Tensor
    weights: torch.Tensor | None
    variance: torch.Tensor | None
    trace: torch.Tensor
    lse: torch.Tensor
    n_eff: torch.Tensor | None = None
    max_term: torch.Tensor | None = None
    covariance: torch.Tensor | None = None
    tail_moment: torch.Tensor | None = None
    backend: str | None = None
    route: str | None = None


@dataclass
class Certificate:
    """Batched certificate; see ``kvcert.reference.Certificate`` for the meaning.

    radius          : (...,) for norm kinds, (..., dv) for ``wald``
    relative_radius : (...,)
    lower, upper    : (..., dv)
    """

    kind: str
    delta: float
    radius: torch.Tensor
    relative_radius: torch.Tensor
    lower: torch.Tensor
    upper: torch.Tensor


@dataclass
class CompressedCache:
    """A compressed, padded KV cache (contract of ``evict``).

    keys, values : (b, h_kv, m, d), m = max kept count over heads
    pi           : (b, h_kv, m) inclusion probabilities, 0 on padding slots
    positions    : (b, h_kv, m) int64 original token index, -1 on padding
    kept         : (b, h_kv) int64 number of real slots per head
    sketch       : ``kvcert.fast.ClusterSketch`` of the evicted tokens when ``evict`` was given a
                   ``sketch=`` design (the cluster design), else None
    """

    keys: torch.Tensor
    values: torch.Tensor
    pi: torch.Tensor
    positions: torch.Tensor
    kept: torch.Tensor
    sketch: object = None

    @property
    def log_pi(self) -> torch.Tensor:
        """log pi, -inf on padding slots."""
        return torch.log(self.pi)

    @property
    def bias(self) -> torch.Tensor:
        """Additive attention bias -log pi, -inf on padding (never +inf)."""
        b = -torch.log(self.pi)
        return b.masked_fill(self.pi <= 0, float("-inf"))
