"""Result records of a generation: per-step, per-layer, per-head certificates.

:class:`Certificates` is what ``kvcert.generate`` returns in
``result.certificates`` and what ``press.certificates`` holds after a run;
:class:`Recorder` collects its rows while a press is active (one per
:class:`kvcert.attention.Session`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Certificates", "Recorder"]


@dataclass
class Certificates:
    """Per-step, per-layer, per-query-head certificates of one generation.

    Tensors of shape (steps, layers, heads) for one sequence, or
    (batch, steps, layers, heads) for a batch (index it to get one sequence).
    Step s is the forward pass that produced generated token s: step 0 is the
    prefill, whose attention is exact (radius and trace 0, ``kept`` the
    prompt length); steps >= 1 are decoding steps over the compressed cache.

    Attributes
    ----------
    kind : str
        Certificate kind (``chebyshev``, ``wald``, ``chi2``, ``bernstein``).
    delta : float
        Nominal miscoverage of each certificate (level 1 - delta).
    radius : tensor
        Bound on ||o_hat - o||_2 of the head's attention output (for
        ``wald``: the Euclidean norm of the per-coordinate half-widths).
    relative_radius : tensor
        radius / ||o_hat||_2.
    trace : tensor
        tr(Sigma_hat), the estimated design variance of the output.
    kept : tensor (int64)
        Tokens the head attended over (its KV head's kept count).
    """

    kind: str
    delta: float
    radius: torch.Tensor
    relative_radius: torch.Tensor
    trace: torch.Tensor
    kept: torch.Tensor

    @property
    def batched(self) -> bool:
        return self.radius.dim() == 4

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.radius.shape)

    def __getitem__(self, i) -> "Certificates":
        """Select one sequence (int) or a sub-batch of a batched record."""
        if not self.batched:
            raise TypeError("this record holds a single sequence; index its tensors directly")
        pick = lambda x: x[i]  # noqa: E731
        return Certificates(self.kind, self.delta, pick(self.radius), pick(self.relative_radius),
                            pick(self.trace), pick(self.kept))

    def per_step(self) -> torch.Tensor:
        r"""Mean relative radius over layers and heads, per step.

        .. math:: \bar r_s = \frac{1}{L H} \sum_{l=1}^{L} \sum_{h=1}^{H}
                  \frac{\mathrm{radius}_{s,l,h}}{\lVert \hat o_{s,l,h} \rVert_2}

        Returns shape (steps,) (or (batch, steps)). It is a summary, not a
        certificate of the logits: each term certifies one head's attention
        output at level 1 - delta.
        """
        return self.relative_radius.mean(dim=(-1, -2))

    def per_layer(self) -> dict[str, torch.Tensor]:
        """Per layer, over decoding steps (step >= 1) and heads: min / median / max
        relative radius and mean kept count (one sequence only)."""
        if self.batched:
            raise TypeError("per_layer() summarizes one sequence: index the batch first (certs[i])")
        rel = self.relative_radius[1:] if self.radius.shape[0] > 1 else self.relative_radius
        kept = self.kept[1:] if self.kept.shape[0] > 1 else self.kept
        flat = rel.transpose(0, 1).reshape(rel.shape[1], -1).to(torch.float64)  # (layers, steps * heads)
        return {
            "min": flat.min(-1).values,
            "median": flat.median(-1).values,
            "max": flat.max(-1).values,
            "kept": kept.to(torch.float64).mean(dim=(0, 2)),
        }

    def to_dict(self) -> dict:
        """JSON-ready nested lists (inf becomes the string "inf")."""
        def clean(x: torch.Tensor):
            data = x.tolist()
            return _finite_json(data)
        return {
            "kind": self.kind,
            "delta": self.delta,
            "shape": ["batch", "step", "layer", "head"] if self.batched else ["step", "layer", "head"],
            "radius": clean(self.radius),
            "relative_radius": clean(self.relative_radius),
            "trace": clean(self.trace),
            "kept": self.kept.tolist(),
            "per_step_mean_relative_radius": clean(self.per_step()),
        }


def _finite_json(data):
    if isinstance(data, list):
        return [_finite_json(x) for x in data]
    if isinstance(data, float) and not math.isfinite(data):
        return "nan" if math.isnan(data) else ("inf" if data > 0 else "-inf")
    return data


class Recorder:
    """Collects (b, h_q) certificate tensors per layer and step; stacked once at the end."""

    def __init__(self, kind: str, delta: float):
        self.kind, self.delta = kind, delta
        self.rows: dict[int, list[tuple[torch.Tensor, ...]]] = {}

    def add(self, layer: int, radius, relative_radius, trace, kept) -> None:
        self.rows.setdefault(layer, []).append(
            tuple(x.detach() for x in (radius, relative_radius, trace, kept))
        )

    @property
    def steps(self) -> int:
        return min((len(v) for v in self.rows.values()), default=0)

    def result(self) -> Certificates | None:
        """(batch, steps, layers, heads) record, or None if nothing was recorded."""
        if not self.rows:
            return None
        layers = sorted(self.rows)
        steps = self.steps
        if any(len(self.rows[l]) != steps for l in layers):
            raise RuntimeError(
                f"kvcert: layers recorded different numbers of steps {[len(self.rows[l]) for l in layers]}"
            )
        fields = []
        for j in range(4):
            per_layer = [torch.stack([row[j] for row in self.rows[l]]) for l in layers]  # (steps, b, h)
            fields.append(torch.stack(per_layer, dim=1).permute(2, 0, 1, 3).cpu())  # (b, steps, layers, h)
        radius, rel, trace, kept = fields
        return Certificates(self.kind, self.delta, radius.float(), rel.float(), trace.float(), kept.long())
