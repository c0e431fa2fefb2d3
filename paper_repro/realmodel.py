"""Real-model material for the tables: offline text and captured attention inputs.

Text comes from ``pydoc_data.topics`` (ships with CPython). The queries, keys
and values of every layer are captured from one forward pass through a
temporary attention function registered with transformers'
``AttentionInterface``: it records the post-RoPE tensors and then computes
exact SDPA attention, so the model's own forward is unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

CAPTURE = "kvcert_capture"


def haystack_text(seed: int = 0) -> str:
    """All pydoc topics joined in a seeded order (about 110k tokens of real English and code)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    order = np.random.default_rng(seed).permutation(len(names))
    return "\n\n".join(topics[names[i]].strip() for i in order)


def haystack_ids(tokenizer, n_tokens: int, seed: int = 0):
    """The first ``n_tokens`` token ids of :func:`haystack_text` (a (1, n) LongTensor)."""
    import torch

    ids = tokenizer(haystack_text(seed), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise ValueError(f"the pydoc haystack has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return torch.tensor([ids[:n_tokens]], dtype=torch.long)


@dataclass
class Captured:
    """Per layer: queries (h_q, T, d), keys and values (h_kv, T, d), float32 on CPU."""

    queries: list
    keys: list
    values: list
    scaling: float

    @property
    def layers(self) -> int:
        return len(self.keys)

    @property
    def group(self) -> int:
        return self.queries[0].shape[0] // self.keys[0].shape[0]


@contextmanager
def _capturing(model, store: dict):
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def capture_attention(module, query, key, value, attention_mask, **kwargs):
        store.setdefault("scaling", kwargs.get("scaling"))
        store.setdefault("layers", {})[module.layer_idx] = (
            query[0].detach().float().cpu(), key[0].detach().float().cpu(), value[0].detach().float().cpu())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(CAPTURE, capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        with torch.no_grad():
            yield
    finally:
        model.set_attn_implementation(previous)


def capture(model, input_ids) -> Captured:
    """One forward pass over ``input_ids`` (1, T), recording every layer's q, k, v."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape (1, T), got {tuple(input_ids.shape)}")
    store: dict = {}
    with _capturing(model, store):
        model(input_ids=input_ids, use_cache=False)
    layers = store["layers"]
    order = sorted(layers)
    d = layers[order[0]][0].shape[-1]
    scaling = store["scaling"] if store.get("scaling") is not None else d ** -0.5
    return Captured(queries=[layers[i][0] for i in order], keys=[layers[i][1] for i in order],
                    values=[layers[i][2] for i in order], scaling=float(scaling))
