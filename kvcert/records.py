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
    sketch_memory : tensor (float64) or None
        The memory of the sketch of evicted tokens the head's KV head held at
        that step (``PoissonPress(sketch=...)``), in kept-token units of
        d + dv + 1 elements (key, value, log pi), the shape of ``kept``; 0
        where the step read no sketch (the exact prefill). None when no step
        read one.
    target_error : float or None
        The press's error target eps (``PoissonPress(target_error=eps)``), else None: :meth:`exceeds`
        marks the steps whose recorded relative radius is above it.
    """

    kind: str
    delta: float
    radius: torch.Tensor
    relative_radius: torch.Tensor
    trace: torch.Tensor
    kept: torch.Tensor
    sketch_memory: torch.Tensor | None = None
    target_error: float | None = None

    @property
    def memory(self) -> torch.Tensor:
        """Memory each head held at each step, in kept-token units: ``kept + sketch_memory`` (float64,
        the shape of ``kept``); ``kept`` without a sketch."""
        mem = self.kept.to(torch.float64)
        return mem if self.sketch_memory is None else mem + self.sketch_memory

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
        return self.map(lambda x: x[i])

    def map(self, fn) -> "Certificates":
        """The same record with ``fn`` applied to each of its tensors (``sketch_memory`` too when held),
        e.g. a selection of steps or of batch rows; kind and delta are kept."""
        return Certificates(self.kind, self.delta, fn(self.radius), fn(self.relative_radius), fn(self.trace),
                            fn(self.kept), None if self.sketch_memory is None else fn(self.sketch_memory),
                            self.target_error)

    def exceeds(self, target: float | None = None) -> torch.Tensor:
        """Bool tensor of ``relative_radius``'s shape: where the recorded relative radius is above
        ``target`` (default :attr:`target_error`; the exact prefill, step 0, never is)."""
        eps = self.target_error if target is None else target
        if eps is None:
            raise ValueError("target: this record has no target_error (the press had none); pass target=eps")
        from .fast.target import check_target_error

        return self.relative_radius > check_target_error("target", eps)

    def summary(self, *, exact_first: bool = True) -> dict:
        r"""JSON-ready aggregates of one sequence's record.

        Kind, delta, decoding steps; the mean / median / max recorded relative radius over the decoding
        steps (step >= 1: step 0 is the exact prefill; every step with ``exact_first=False``, the
        query-agnostic protocol's questions), layers and heads; the kept fraction, the share of the prompt
        the compressed cache held (a sketch's memory counted), averaged over layers and heads,
        :math:`(\mathrm{memory}_1 - 1)/\mathrm{kept}_0` (step 1 holds the compressed prompt and the first
        generated token; with ``exact_first`` and at least one decoding step); with a ``target_error``, the
        target and the fraction of decoding (step, layer, head) certificates above it (:meth:`exceeds`).
        """
        if self.batched:
            raise TypeError("summary() summarizes one sequence: index the batch first (certs[i])")
        first = 1 if exact_first and self.radius.shape[0] > 1 else 0
        rel = self.relative_radius[first:].to(torch.float64)
        out = {"kind": self.kind, "delta": self.delta,
               "decode_steps": int(rel.shape[0]) if first or not exact_first else 0,
               "mean_relative_radius": float(rel.mean()), "median_relative_radius": float(rel.median()),
               "max_relative_radius": float(rel.max())}
        if first:
            out["kept_fraction"] = float(((self.memory[1] - 1.0) / self.kept[0].to(torch.float64)).mean())
        if self.target_error is not None:
            out["target_error"] = self.target_error
            out["fraction_over_target"] = float(self.exceeds()[first:].to(torch.float64).mean())
        return out

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
        relative radius, mean kept count and mean memory (kept + sketch, :attr:`memory`; one sequence only)."""
        if self.batched:
            raise TypeError("per_layer() summarizes one sequence: index the batch first (certs[i])")
        rel = self.relative_radius[1:] if self.radius.shape[0] > 1 else self.relative_radius
        kept = self.kept[1:] if self.kept.shape[0] > 1 else self.kept
        memory = self.memory[1:] if self.kept.shape[0] > 1 else self.memory
        flat = rel.transpose(0, 1).reshape(rel.shape[1], -1).to(torch.float64)  # (layers, steps * heads)
        return {
            "min": flat.min(-1).values,
            "median": flat.median(-1).values,
            "max": flat.max(-1).values,
            "kept": kept.to(torch.float64).mean(dim=(0, 2)),
            "memory": memory.mean(dim=(0, 2)),
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
            "sketch_memory": None if self.sketch_memory is None else self.sketch_memory.tolist(),
            "per_step_mean_relative_radius": clean(self.per_step()),
        }


def _finite_json(data):
    if isinstance(data, list):
        return [_finite_json(x) for x in data]
    if isinstance(data, float) and not math.isfinite(data):
        return "nan" if math.isnan(data) else ("inf" if data > 0 else "-inf")
    return data


class Recorder:
    """Collects a generation's certificate statistics per layer and step; radii are computed once,
    at the end.

    Each :meth:`add` keeps the small per-head tensors a certificate is made
    from (:func:`kvcert.fast.certificate_moments`: the trace, ||o_hat||, and
    what the kind reads besides); :meth:`result` stacks them and computes
    every radius in one batched call of
    :func:`kvcert.fast.radius_from_statistics`. The certificate is the one
    :func:`kvcert.fast.certificate` gives for the same estimate; the decode
    step pays for no certificate arithmetic (nor, for ``chebyshev_ucb``, a
    host transfer per layer).
    """

    def __init__(self, kind: str, delta: float, target_error: float | None = None):
        self.kind, self.delta, self.target_error = kind, delta, target_error
        #: per layer, in step order: (kept, stats, sketch memory, one_step). A one-step row holds the
        #: tensors :meth:`add` was given, (b, ...); a chunk's, steps first (q, b, ...)
        self.rows: dict[int, list[tuple[torch.Tensor, dict, float, bool]]] = {}

    def add(self, layer: int, stats: dict, kept: torch.Tensor, sketch: float = 0.0) -> None:
        """One step of one layer: ``stats`` (b, h_q) tensors from ``certificate_moments``
        (wald's ``variance`` (b, h_q, dv)), ``kept`` (b, h_kv) or (b, h_q) tokens attended over,
        ``sketch`` the memory of a sketch of evicted tokens read beside them (kept-token units).
        Kept as given (no tensor op per decode step); :meth:`result` stacks the steps."""
        self.rows.setdefault(layer, []).append((kept, stats, float(sketch), True))

    def add_steps(self, layer: int, stats: dict, kept: torch.Tensor) -> None:
        """q consecutive steps of one layer at once (a chunk of queries): ``stats`` (b, h_q, q)
        tensors (wald's ``variance`` (b, h_q, q, dv)), ``kept`` (b, h_kv, q) or (b, h_q, q); the
        same record as q calls of :meth:`add`, one step per query."""
        self.rows.setdefault(layer, []).append((kept.movedim(2, 0), {k: v.movedim(2, 0) for k, v in stats.items()},
                                                0.0, False))

    def _steps(self, layer: int) -> int:
        return sum(1 if row[3] else row[0].shape[0] for row in self.rows[layer])

    @property
    def steps(self) -> int:
        return min((self._steps(layer) for layer in self.rows), default=0)

    def result(self) -> Certificates | None:
        """(batch, steps, layers, heads) record, or None if nothing was recorded."""
        from .fast import radius_from_statistics

        if not self.rows:
            return None
        layers = sorted(self.rows)
        steps = self.steps
        if any(self._steps(l) != steps for l in layers):
            raise RuntimeError(
                f"kvcert: layers recorded different numbers of steps {[self._steps(l) for l in layers]}"
            )

        def stack(get):  # (steps, b, h, ...) per layer -> (b, steps, layers, h, ...)
            per_layer = [_in_steps(self.rows[l], get) for l in layers]
            x = torch.stack(per_layer, dim=1)
            return x.permute(2, 0, 1, *range(3, x.dim())).cpu()

        names = list(self.rows[layers[0]][0][1])
        stats = {k: stack(lambda row, k=k: row[1][k]) for k in names}
        h_q = stats["trace"].shape[-1]
        kept = stack(lambda row: row[0].repeat_interleave(h_q // row[0].shape[-1], dim=-1))
        _, radius, rel = radius_from_statistics(self.kind, self.delta, **stats)
        sketch = None
        if any(row[2] for l in layers for row in self.rows[l]):
            sketch = stack(lambda row: torch.full((*row[0].shape[:-1], h_q), row[2], dtype=torch.float64))
        return Certificates(self.kind, self.delta, radius.float(), rel.float(), stats["trace"].float(), kept.long(),
                            sketch, self.target_error)


def _in_steps(rows: list, get) -> torch.Tensor:
    """One layer's recorded rows as one (steps, b, ...) tensor, in step order: ``get(row)`` of each, the
    runs of one-step rows stacked (one op per run), the chunks' (already steps first) joined to them."""
    parts, run = [], []
    for row in rows:
        if row[3]:
            run.append(get(row))
            continue
        if run:
            parts.append(torch.stack(run))
            run = []
        parts.append(get(row))
    if run:
        parts.append(torch.stack(run))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
