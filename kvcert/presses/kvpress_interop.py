"""kvpress interop: a kvpress score-based press as the importance of a :class:`~kvcert.presses.PoissonPress`.

kvcert never imports kvpress: a scorer is recognised by the shape of its
``score(module, hidden_states, keys, values, attentions, kwargs)``
(:func:`is_kvpress_scorer`), and :class:`KvpressInputs` hooks each attention
module's forward to keep the inputs kvpress's forward hook would give that
``score`` (docs/kvpress.md).
"""

from __future__ import annotations

import inspect

import torch

_KVPRESS_SCORE = ("module", "hidden_states", "keys", "values", "attentions", "kwargs")


def is_kvpress_scorer(s) -> bool:
    """Whether ``s`` is a kvpress-style scorer: ``s.score(module, hidden_states, keys, values,
    attentions, kwargs)``. Raises ``TypeError`` for a kvpress press without ``score`` (it has
    ``compress``/``forward_hook`` only) and for a ``score`` of another signature."""
    score = getattr(s, "score", None)
    if score is None:
        if hasattr(s, "compress") and hasattr(s, "forward_hook"):
            raise TypeError(
                f"scorer: {type(s).__module__}.{type(s).__name__} has no score(module, hidden_states, keys, values, "
                "attentions, kwargs); only a score-based press (a kvpress ScorerPress, e.g. SnapKVPress, "
                "ExpectedAttentionPress, KeyDiffPress, TOVAPress, KnormPress) gives an importance"
            )
        return False
    if not callable(score):
        raise TypeError(f"scorer: {type(s).__name__}.score must be a method, got {type(score).__name__}")
    try:
        sig = inspect.signature(score)
    except (TypeError, ValueError):  # no signature to read (a builtin): take it on trust
        return True
    try:
        sig.bind(*_KVPRESS_SCORE)
    except TypeError:
        raise TypeError(
            f"scorer: {type(s).__name__}.score must take (module, hidden_states, keys, values, attentions, kwargs) "
            f"and return (batch, kv_heads, seq) scores, as kvpress's ScorerPress.score; its signature is "
            f"score{sig}"
        ) from None
    return True


def row_slice(t, row: int, tokens):
    """Batch row ``row`` of a (b, n, ...) tensor (a batch of one is shared), its ``tokens`` only."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t[row:row + 1] if t.shape[0] > 1 else t
    return t if tokens is None else t[:, tokens.to(t.device)]


def _attention_modules(model) -> list:
    """The attention modules of a transformers model: kvpress's ``model.model(.language_model).layers[i]
    .self_attn``, else every submodule named ``...self_attn`` with a ``layer_idx``."""
    base = getattr(model, "model", None)
    base = getattr(base, "language_model", base)
    layers = getattr(base, "layers", None)
    if layers is not None and all(hasattr(layer, "self_attn") for layer in layers):
        return [layer.self_attn for layer in layers]
    return [m for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, "layer_idx")]


class KvpressInputs:
    """The context of a PoissonPress with a kvpress scorer: the press's own context, plus forward
    hooks on every attention module that keep its inputs (module, kwargs with ``hidden_states``)
    while the module runs, for the prefill event (kvpress's scorers read them)."""

    def __init__(self, press, model, context):
        self.press, self.model, self.context = press, model, context
        self._hooks, self._rotary = [], []

    def __getattr__(self, name):  # anything else the press's own context offers
        context = self.__dict__.get("context")
        if context is None:
            raise AttributeError(name)
        return getattr(context, name)

    def __enter__(self):
        press, model = self.press, self.model
        modules = _attention_modules(model)
        if not modules:
            raise ValueError(f"scorer: found no attention modules (layers[i].self_attn) in {type(model).__name__} "
                             "to read the hidden states a kvpress scorer needs")
        base = getattr(getattr(model, "model", None), "language_model", getattr(model, "model", None))
        rotary = getattr(base, "rotary_emb", None)
        inputs = press._layer_inputs

        def keep(module, args, kwargs):
            if "hidden_states" not in kwargs and args:
                kwargs = {**kwargs, "hidden_states": args[0]}
            inputs[module.layer_idx] = (module, kwargs)

        def drop(module, args, output):
            inputs.pop(module.layer_idx, None)

        try:
            for m in modules:
                if rotary is not None and getattr(m, "rotary_emb", None) is None:
                    m.rotary_emb = rotary  # as kvpress does: ExpectedAttentionPress reads module.rotary_emb
                    self._rotary.append(m)
                self._hooks.append(m.register_forward_pre_hook(keep, with_kwargs=True))
                self._hooks.append(m.register_forward_hook(drop))
            init = getattr(press.scorer, "post_init_from_model", None)
            if callable(init):
                init(model)
            return self.context.__enter__()
        except BaseException:
            self._undo()
            raise

    def __exit__(self, *exc):
        try:
            return self.context.__exit__(*exc)
        finally:
            self._undo()

    def _undo(self):
        for h in self._hooks:
            h.remove()
        for m in self._rotary:
            del m.rotary_emb
        self._hooks, self._rotary = [], []
        self.press._layer_inputs.clear()
