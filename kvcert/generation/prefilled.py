"""The shared exact prefill: :func:`prefill` runs a prompt's prefill once, for any number of presses.

Under every press the prefill is exact attention (the press compresses each
layer after it), so one :class:`Prefill` serves :func:`kvcert.generate`
under several presses (``prefilled=``); :func:`kvcert.prefill_context`
makes the same object for the query-agnostic protocol.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .common import forward_kwargs, mask_positions, prefill_forward, prompt_ids, as_prompt_list

__all__ = ["Prefill", "prefill"]


@dataclass
class Prefill:
    """An exact prefill of some prompts, to share between :func:`generate` calls.

    Made by :func:`prefill`. Holds the uncompressed cache (a
    :class:`kvcert.KVCertCache`), the last-position logits, and per layer
    the last ``query_window`` prefill queries (post-RoPE) that the presses'
    scorers read. Every :func:`generate` call with ``prefilled=`` works on
    a copy, so the object can be reused for any number of presses.

    Attributes
    ----------
    prompts : list[str]
    input_ids, attention_mask : tensors (b, n), left-padded
    logits : tensor (b, vocab) of the last prompt position
    cache : KVCertCache
    query_window : int or None (None: every prefill query is kept)
    prefill_s : float, wall seconds of the prefill forward
    chat_template : bool, system_prompt : str or None
    """

    prompts: list
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: torch.Tensor
    cache: object
    query_window: int | None
    prefill_s: float
    chat_template: bool
    system_prompt: str | None
    model_id: int = 0

    def _compressed_copy(self, press):
        """A copy of the cache, compressed by ``press`` as its prefill event would.

        The copy shares the prefill's tensors instead of copying them (a deep copy of K and V
        was about 0.4 s per run on 8 prompts of 750 tokens): nothing in kvcert writes into a
        tensor a layer holds. A compression replaces them (:meth:`KVCertLayer.replace`) and
        decoding appends into buffers of the copy's own (:meth:`KVCertLayer._append`; the
        copy starts with none), so the prefill stays as it was for the next run
        (``tests/test_generation_prefilled.py`` checks it bit for bit).
        """
        import copy

        memo = {}

        def share(x):
            if isinstance(x, torch.Tensor):
                memo[id(x)] = x
            elif isinstance(x, (tuple, list)):
                for y in x:
                    share(y)
            elif isinstance(x, dict):
                for y in x.values():
                    share(y)

        for layer in self.cache.layers:
            share(vars(layer))
        cache = copy.deepcopy(self.cache, memo)
        for layer in cache.layers:
            layer._buffers = {}
        if press is not None:
            press._compress_prefilled(cache, query_window=self.query_window)
        else:
            for layer in cache.layers:
                layer.queries = None
        return cache


def prefill(
    model,
    tokenizer,
    prompt: str | list[str],
    *,
    query_window: int | None = 64,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
    progress: bool | None = False,
) -> Prefill:
    """Run the exact prefill of ``prompt`` once, for several presses.

    Under every press the prefill is exact attention (the press compresses
    each layer after it), so one prefill serves them all:

    >>> state = kvcert.prefill(model, tok, prompt)                      # doctest: +SKIP
    >>> for press in (kvcert.PoissonPress(compression_ratio=0.5), kvcert.SnapKVPress(compression_ratio=0.5)):
    ...     r = kvcert.generate(model, tok, prompt, press=press, prefilled=state)  # doctest: +SKIP

    Parameters
    ----------
    model, tokenizer, prompt, chat_template, system_prompt, progress
        As in :func:`generate`.
    query_window : int >= 1 or None
        Prefill queries kept per layer for the scorers (default 64, enough
        for the default observation window of 32). ``None`` keeps all of
        them, which ``H2OPress`` needs (it sums the attention of every
        prefill query).

    Returns
    -------
    Prefill
    """
    single, prompts = as_prompt_list(prompt, "prefilled")
    check_query_window(query_window)
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat_template is None else chat_template
    input_ids, attention_mask = prompt_ids(model, tokenizer, prompts, chat_template, system_prompt, single=single)
    out, cache, elapsed = recorded_prefill(model, input_ids, attention_mask, query_window, progress)
    return Prefill(list(prompts), input_ids, attention_mask, out.logits[:, -1].detach(), cache, query_window,
                   elapsed, bool(use_chat), system_prompt, id(model))


def check_query_window(query_window) -> None:
    if query_window is not None and (isinstance(query_window, bool) or not isinstance(query_window, int)
                                     or query_window < 1):
        raise ValueError(f"query_window must be an int >= 1 or None, got {query_window!r}")


def recorded_prefill(model, input_ids, attention_mask, query_window, progress):
    """One exact forward over the prompt(s), recording the last ``query_window`` queries per layer;
    returns ``(model output, cache, wall seconds)``."""
    from ..presses.base import QueryRecorder

    position_ids = mask_positions(attention_mask)
    fwd_kwargs, cache_kw = forward_kwargs(model)
    recorder = QueryRecorder(query_window=query_window)
    with torch.no_grad(), recorder(model):
        t0 = time.perf_counter()
        out = prefill_forward(model, input_ids, attention_mask, position_ids, fwd_kwargs, progress)
        elapsed = time.perf_counter() - t0
    return out, getattr(out, cache_kw, None), elapsed

