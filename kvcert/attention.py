"""The ``kvcert`` attention function for transformers, and certificate recording.

Importing this module registers ``"kvcert"`` with transformers'
``AttentionInterface`` (the attention function) and
``AttentionMaskInterface`` (its mask function). A press (:mod:`kvcert.presses`)
switches a model to it for the duration of ``with press(model):``; outside a
press the function is exactly the model's own attention (``sdpa`` by default).

Inside a press, per layer and per forward call:

- **prefill** (the layer held nothing before this call): exact attention
  through the model's base implementation (``sdpa`` or ``eager``) with the
  causal/padding mask transformers built, then the press compresses the layer
  (the prefill queries see the full cache; the scorer sees these queries);
- **decoding** (one new token, or a chunk of several): Hajek-corrected
  attention over the held slots through :func:`kvcert.hajek_attention`
  (Triton on CUDA, :mod:`kvcert.fast` on CPU) with the per-slot bias
  -log pi from :attr:`KVCertLayer.log_weights` (-inf on padding slots); a
  chunk is causal by the stored token positions. The estimate gives a
  certificate of the press's ``kind`` and ``delta`` for every query head,
  recorded per step.

The mask function returns the base implementation's mask for a prefill and
``None`` afterwards: layers hold different physical lengths after eviction,
so no single mask fits them all, and a one-token decode needs no causal mask
among cached tokens (padding is carried by the -inf bias).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.models.llama.modeling_llama import eager_attention_forward

from .cache import KVCertLayer

__all__ = [
    "ATTENTION_NAME",
    "BASE_ATTENTION",
    "Certificates",
    "kvcert_attention_forward",
    "kvcert_mask",
]

#: the name registered with transformers' AttentionInterface / AttentionMaskInterface
ATTENTION_NAME = "kvcert"
#: exact attention functions a press runs the prefill with
BASE_ATTENTION = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
_DEFAULT_BASE = "sdpa"

# id(config) -> runtime of the press active on that model (see kvcert.presses)
_RUNTIMES: dict[int, "Runtime"] = {}


def resolve_base(implementation: str | None) -> str:
    """The exact attention a press runs the prefill with, for a model's implementation.

    ``sdpa`` and ``eager`` are kept. Anything else falls back to ``sdpa``
    with a warning: FlashAttention (and flex attention) kernels take no
    additive bias, so they cannot carry -log pi; kvcert decodes through its
    own function either way, and the prefill is exact attention, which sdpa
    computes.
    """
    if implementation in BASE_ATTENTION:
        return implementation
    if implementation in (None, ATTENTION_NAME):
        return _DEFAULT_BASE
    warnings.warn(
        f"kvcert: the model uses attn_implementation={implementation!r}, which cannot carry the "
        f"Hajek bias -log pi; under the press the prefill runs with 'sdpa' (exact attention) and "
        f"decoding with kvcert.hajek_attention",
        stacklevel=3,
    )
    return _DEFAULT_BASE


# ---------------------------------------------------------------------------------------------
# certificates
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# runtime state of an active press
# ---------------------------------------------------------------------------------------------
@dataclass
class Runtime:
    """What the attention and mask functions need while a press is active on a model."""

    press: object
    base: str
    cache: object = None
    mask2d: torch.Tensor | None = None
    recorder: Recorder | None = None
    estimate_kwargs: dict = field(default_factory=dict)

    def real_new(self, q_len: int) -> torch.Tensor | None:
        """(b, q_len) bool: which of the new tokens are real (from the 2-D attention mask)."""
        m = self.mask2d
        if m is None or m.dim() != 2 or m.shape[1] < q_len:
            return None
        return m[:, -q_len:].bool()


def runtime_of(config) -> Runtime | None:
    return _RUNTIMES.get(id(config))


def _real_from_4d(attention_mask, n: int) -> torch.Tensor | None:
    """Real keys of a prefill, read off the last query row of a 4-D mask."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4 or attention_mask.shape[-1] != n:
        return None
    row = attention_mask[:, 0, -1, :]
    if row.dtype == torch.bool:
        return row
    return row > torch.finfo(row.dtype).min / 2


def _estimate_kwargs(kind: str) -> dict:
    """hajek_attention options a certificate kind needs (per-coordinate variance only for wald)."""
    return {
        "per_coordinate": kind == "wald",
        **({"return_covariance": True} if kind == "chi2" else {}),
        **({"return_max_term": True} if kind == "bernstein" else {}),
        **({"return_tail_moment": True} if kind == "chebyshev_ucb" else {}),
    }


# ---------------------------------------------------------------------------------------------
# the registered functions
# ---------------------------------------------------------------------------------------------
def kvcert_mask(*args, **kwargs):
    """Mask function registered as ``"kvcert"``: the base mask for a prefill, else None."""
    rt = runtime_of(kwargs.get("config"))
    if rt is not None and rt.cache is not None and rt.cache.get_seq_length() > 0:
        return None
    base = rt.base if rt is not None else _DEFAULT_BASE
    return ALL_MASK_ATTENTION_FUNCTIONS[base](*args, **kwargs)


def kvcert_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    r"""Attention function registered as ``"kvcert"`` (transformers ``AttentionInterface``).

    Decoding computes the Hajek estimate over the compressed cache,

    .. math:: \hat o = \sum_{i \in S} a_i v_i, \qquad
              a_i = \operatorname{softmax}_S(\tau\, q \cdot k_i - \log \pi_i),

    with :math:`\log\pi_i` from the cache layer (-inf on padding), and records
    its certificate; the prefill is exact attention followed by compression.

    Parameters
    ----------
    module : the attention module (``layer_idx``, ``config``, ``num_key_value_groups``)
    query : (b, h_q, q, d)
    key, value : (b, h_kv, n, d), the layer's cache after the update
    attention_mask : the mask built by :func:`kvcert_mask` (a base mask or None)
    scaling : float, default 1/sqrt(d)

    Returns
    -------
    (attn_output (b, q, h_q, d), attn_weights or None)
    """
    rt = getattr(module, "_kvcert_runtime", None)
    if rt is None:
        rt = runtime_of(getattr(module, "config", None))
    base = BASE_ATTENTION[rt.base if rt is not None else _DEFAULT_BASE]
    if rt is None or rt.cache is None:
        return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("kvcert: sliding-window attention layers are not supported")
    layer_idx = module.layer_idx
    layer = rt.cache.layers[layer_idx]
    if not isinstance(layer, KVCertLayer):
        raise RuntimeError(f"kvcert: cache layer {layer_idx} is a {type(layer).__name__}, not a KVCertLayer")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    press = rt.press
    q_len = query.shape[2]
    b, h_q = query.shape[0], query.shape[1]

    if layer.length_before_update == 0:  # prefill: exact attention, then compress
        real = rt.real_new(q_len)
        if real is None:
            real = _real_from_4d(attention_mask, key.shape[-2])
        if real is not None:
            layer.mark_padding(real)
        out, weights = base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        zeros = torch.zeros(b, h_q, device=query.device)
        rt.recorder.add(layer_idx, zeros, zeros, zeros, _per_query_head(layer.kept, h_q))
        press._on_prefill(layer, layer_idx, query, scaling)
        return out, weights

    real = rt.real_new(q_len)
    if real is not None:
        layer.mark_padding(real)
    from kvcert.dispatch import hajek_attention
    from kvcert.fast import certificate

    opts = rt.estimate_kwargs
    if q_len == 1:
        est = hajek_attention(query[:, :, 0], layer.keys, layer.values, log_pi=layer.log_weights,
                              scale=scaling, **opts)
        out = est.output[:, None]  # (b, 1, h_q, dv)
    else:  # a chunk: causal by the stored positions
        qpos = layer.positions[:, 0, -q_len:]
        est = hajek_attention(query, layer.keys, layer.values, log_pi=layer.log_weights, scale=scaling,
                              positions=layer.positions, query_positions=qpos, **opts)
        out = est.output.transpose(1, 2)  # (b, q, h_q, dv)
    cert = certificate(est, delta=press.delta, kind=press.kind)
    radius = cert.radius
    if press.kind == "wald":
        radius = torch.linalg.vector_norm(radius, dim=-1)
    if q_len == 1:
        rt.recorder.add(layer_idx, radius, cert.relative_radius, est.trace, _per_query_head(layer.kept, h_q))
    else:
        valid = layer.valid
        for j in range(q_len):  # query j sees the kept tokens up to its own position
            seen = (valid & (layer.positions <= qpos[:, None, j:j + 1])).sum(-1)
            rt.recorder.add(layer_idx, radius[:, :, j], cert.relative_radius[:, :, j], est.trace[:, :, j],
                            _per_query_head(seen, h_q))
    press._on_decode(layer, layer_idx, query, scaling)
    return out.to(query.dtype).contiguous(), None


def _per_query_head(kept: torch.Tensor, h_q: int) -> torch.Tensor:
    """(b, h_kv) -> (b, h_q): query head j reads KV head j // g."""
    return kept.repeat_interleave(h_q // kept.shape[1], dim=1)


AttentionInterface.register(ATTENTION_NAME, kvcert_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, kvcert_mask)
