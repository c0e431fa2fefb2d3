r"""Exact attention where the certificate flags: cell recompute (the paper's T4, issue 55).

``PoissonPress(recompute_threshold=t)`` keeps each compressed layer's prefill K/V aside (the full cache, in
slower memory on a serving system) and, at every decoding step, replaces the Hajek estimate of every (layer,
query head, step) cell whose recorded relative radius is at least ``t`` (or NaN) by exact attention over the
full cache: the prefill's tokens plus the tokens decoded since. The recorded certificates stay those of the Hajek estimate
(what flagged the cell); :attr:`CellRecompute.recomputed` / :attr:`CellRecompute.cells` count, per batch row,
the (step, layer, KV head) reads that went to the full cache and all of them. ``t = 0`` recomputes every cell
(the full cache's answers: a cell can have evicted tokens and a zero radius, when its Poisson sample of the tail
came out empty); ``t = inf`` none but cells of infinite radius (the design's answers).

Measured on Table 3's tasks by benchmarks/bench_frontier.py (docs/frontier.md).
"""

from __future__ import annotations

import math

import torch

__all__ = ["CellRecompute", "check_recompute_threshold"]


def check_recompute_threshold(value):
    """None, or a real number >= 0 (inf allowed): the relative radius at or above which a cell is recomputed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)) or value < 0:
        raise ValueError(f"recompute_threshold must be None or a number >= 0 (a relative radius), got {value!r}")
    return float(value)


class CellRecompute:
    """The state of one press's cell recompute: the full cache of each compressed layer (kept at the layer's
    prefill event, before it evicts) and the per-row counters."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.full: dict[int, tuple] = {}
        self.recomputed: torch.Tensor | None = None  # (b,) float64: (step, layer, KV head) reads recomputed
        self.cells: torch.Tensor | None = None  # (b,) float64: all such reads

    def keep(self, layer, layer_idx: int) -> None:
        """Keep the layer's full cache, before its prefill event evicts; a new sequence (its first compressed
        layer again) starts the counters over."""
        if not self.full or layer_idx <= min(self.full):
            self.full = {}
            b = layer.keys.shape[0]
            self.recomputed = torch.zeros(b, dtype=torch.float64)
            self.cells = torch.zeros(b, dtype=torch.float64)
        self.full[layer_idx] = (layer.keys, layer.values, layer.valid, layer.positions)

    def share(self) -> torch.Tensor | None:
        """(b,) the share of each row's (step, layer, KV head) reads that went to the full cache."""
        if self.cells is None:
            return None
        return torch.where(self.cells > 0, self.recomputed / self.cells.clamp_min(1.0), torch.zeros_like(self.cells))

    def apply(self, session, layer, layer_idx: int, query: torch.Tensor, scale: float, dec, out: torch.Tensor,
              softcap=None) -> torch.Tensor:
        """The decoding step's output with its flagged cells recomputed exactly (``out``: (b, t, h_q, dv), the
        Hajek estimate; ``dec``: :func:`kvcert.dispatch.decode`'s result for it)."""
        full = self.full.get(layer_idx)
        if full is None or len(dec.records) != 1:
            return out
        if softcap is not None:
            raise ValueError("recompute_threshold: cell recompute attends without the model's logit softcap; "
                             "not supported on a softcapped model")
        from ..fast import certificate_moments, radius_from_statistics

        est = dec.records[0].estimate
        _, _, rel = radius_from_statistics(session.kind, session.delta, **certificate_moments(est, session.kind))
        b, h_q, t, d = query.shape
        rel = rel.reshape(b, h_q, t)  # a one-token step gives (b, h_q), a chunk of t queries (b, h_q, t)
        flag = ~(rel < self.threshold)  # at or above the threshold; a NaN radius is flagged too
        K0, V0, valid0, pos0 = full
        h_kv = K0.shape[1]
        g = h_q // h_kv
        kv_flag = flag.reshape(b, h_kv, g, t).any(2)  # (b, h_kv, t): a KV head's read is recomputed for its group
        self.recomputed += kv_flag.sum((1, 2)).to(torch.float64).cpu()
        self.cells += float(h_kv * t)
        if not bool(flag.any()):
            return out
        n_prompt = pos0.masked_fill(~valid0, -1).amax(-1, keepdim=True) + 1  # (b, h_kv, 1)
        new = (layer.positions >= n_prompt) & layer.valid  # the tokens decoded since the prefill
        K = torch.cat([K0, layer.keys], 2).to(torch.float32)
        V = torch.cat([V0, layer.values], 2).to(torch.float32)
        pos = torch.cat([pos0, layer.positions], 2)
        allowed = torch.cat([valid0, new], 2)  # (b, h_kv, N)
        qpos = layer.positions[:, 0, -t:]  # (b, t): the new tokens' positions
        q = query.to(torch.float32).reshape(b, h_kv, g, t, d)
        s = torch.einsum("bkgtd,bknd->bkgtn", q, K) * scale
        ok = allowed[:, :, None, None, :] & (pos[:, :, None, None, :] <= qpos[:, None, None, :, None])
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
        exact = torch.einsum("bkgtn,bknd->bkgtd", p, V).reshape(b, h_q, t, -1).transpose(1, 2)  # (b, t, h_q, dv)
        sel = flag.transpose(1, 2)[..., None]  # (b, t, h_q, 1)
        return torch.where(sel, exact.to(out.dtype), out)
