"""The query-agnostic protocol: compress a context once, answer questions over it.

kvpress's ``kv-press-text-generation`` pipeline: :func:`compress_context`
prefills and compresses the context alone, once (from a shared exact
prefill, :func:`prefill_context`, when several presses are compared);
:func:`answer` then prefills each question (with the chat template's end of
turn and an optional answer prefix) over the compressed context, never
compressed, and answers greedily, every question from the same compressed
context. Every forward over the compressed context records a certificate
per layer and query head.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..attention import Certificates
from .common import (QUERY_AGNOSTIC, GenerationResult, LayerProgress, check_tokens, eos_token_ids, forward_kwargs,
                     greedy_margin, _prompt_name, _step_slice)
from .prefilled import Prefill, check_query_window, recorded_prefill

__all__ = ["CompressedContext", "compress_context", "prefill_context", "answer", "answer_certificates"]


@dataclass
class CompressedContext:
    """A context prefilled and compressed once, for questions (the query-agnostic protocol).

    Made by :func:`compress_context`; answered by :func:`answer` (or
    ``generate(..., context=...)``) any number of times: each question starts
    from the compressed context (the tokens of an earlier question and its
    answer are forgotten, as kvpress's pipeline trims them).

    Attributes
    ----------
    context : str
    context_ids : tensor (1, n), the context as prefilled (chat template's
        opening included)
    question_suffix : str
        What follows each question: the chat template's end of the user turn
        and the assistant header (``"\n"`` without a template).
    cache : the compressed cache (a ``DynamicCache`` with :class:`kvcert.cache.KVCertLayer`
        layers under a press; a plain ``DynamicCache`` without one)
    press : the press, or None
    prefill_s : float, wall seconds of the context's prefill and compression
    chat_template : bool, system_prompt : str or None, enable_thinking : bool
    """

    context: str
    context_ids: torch.Tensor
    question_suffix: str
    cache: object
    press: object
    prefill_s: float
    chat_template: bool
    system_prompt: str | None = None
    enable_thinking: bool = False
    model_id: int = 0
    carrier: object = field(default=None, repr=False)

    @property
    def context_tokens(self) -> int:
        """Tokens of the context (before compression)."""
        return int(self.context_ids.shape[1])

    def kept(self) -> torch.Tensor | None:
        """(layers, h_kv) tokens each KV head holds of the compressed context (None without a press)."""
        if self.carrier is None:
            return None
        return torch.stack([layer._mark[2][0].isfinite().sum(-1) for layer in self.cache.layers])

    def _restore(self) -> None:
        """Back to the compressed context: forget any question and answer tokens."""
        if self.carrier is not None:
            self.carrier.restore()
            return
        n = self.context_tokens
        for layer in self.cache.layers:  # as kvpress's pipeline trims a plain cache
            if layer.is_initialized and layer.keys.shape[-2] > n:
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def _context_texts(tokenizer, context: str, chat_template, system_prompt, enable_thinking) -> tuple[str, str, bool]:
    """``(context text, question suffix, chat template used)`` as kvpress's pipeline makes them.

    With a chat template the context becomes a user message followed by a
    separator that no text contains, and the rendered conversation is cut at
    the separator: the context text is everything before it (system turn,
    user header, context), the question suffix everything after (end of
    turn, assistant header). Without one: the BOS token, the context, and
    ``"\n"`` after each question (kvpress 0.5.5 ``preprocess``).
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_chat = has_template if chat_template is None else bool(chat_template)
    if use_chat and not has_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    if not use_chat:
        if system_prompt is not None:
            raise ValueError("system_prompt needs the chat template (chat_template=True)")
        if enable_thinking:
            raise ValueError("enable_thinking needs the chat template (chat_template=True): it is an argument "
                             "of the template")
        return (getattr(tokenizer, "bos_token", "") or "") + context, "\n", False
    separator = "#" * (len(context) + 10)
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": context + separator}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=enable_thinking)
    before, after = text.split(separator)
    return before, after, True


def compress_context(
    model,
    tokenizer,
    context: str,
    press=None,
    *,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
    enable_thinking: bool = False,
    max_context_length: int | None = None,
    progress: bool | None = False,
    prefilled: "Prefill | None" = None,
) -> CompressedContext:
    """Prefill ``context`` once under ``press`` and keep the compressed cache for questions.

    The first half of the query-agnostic protocol (kvpress's
    ``kv-press-text-generation`` pipeline): the context is formatted as
    kvpress formats it (a user turn of the chat template cut before its end,
    or BOS + context without a template), prefilled with exact attention
    through the decoder model (no LM head) under ``with press(model):``, and
    each layer compressed right after its prefill. No question is known
    yet, so the scorer sees the context's own last queries.

    >>> press = kvcert.PoissonPress(compression_ratio=0.5)               # doctest: +SKIP
    >>> ctx = kvcert.compress_context(model, tok, document, press=press)  # doctest: +SKIP
    >>> r = kvcert.answer(model, tok, ctx, "Who wrote it?")            # doctest: +SKIP
    >>> r.protocol, r.certificates.radius.shape   # ('query-agnostic', (steps, layers, heads))  # doctest: +SKIP

    Parameters
    ----------
    model, tokenizer : as in :func:`generate`
    context : str
        The text to compress (one context; several questions go to :func:`answer`).
    press : kvcert press, optional
        None keeps the whole context (a plain ``DynamicCache``, the model's
        own attention: kvpress's pipeline without a press, token for token).
    chat_template : bool, optional
        Format with the tokenizer's chat template (default: when it has one).
    system_prompt : str, optional
        A system turn before the context (kvpress has none).
    enable_thinking : bool
        Passed to the chat template (kvpress's pipeline argument); refused,
        like ``system_prompt``, without one.
    max_context_length : int >= 1, optional
        Keep only the first this many context tokens (with a warning), as
        kvpress does; default the tokenizer's ``model_max_length``.
    progress : bool
        A progress bar over the layers of the prefill.
    prefilled : Prefill, optional
        An exact prefill of the same context from :func:`prefill_context`
        (same formatting arguments), shared between presses: the press
        compresses a copy of its cache, so the result equals a call without
        ``prefilled`` (the prefill is exact attention under every press) while
        the context is prefilled once. ``prefill_s`` is then the shared
        prefill's time.

    Returns
    -------
    CompressedContext
    """
    from ..presses import Press

    if press is not None and not isinstance(press, Press):
        raise TypeError(f"press must be a kvcert press (e.g. kvcert.PoissonPress), got {type(press).__name__}")
    ids, suffix, use_chat = _context_ids(model, tokenizer, context, chat_template, system_prompt, enable_thinking,
                                         max_context_length)
    scope = press(model) if press is not None else contextlib.nullcontext()
    if prefilled is not None:
        _check_context_prefill(prefilled, model, ids)
        cache, elapsed = _cache_from_prefill(prefilled, press, scope, ids.shape[1]), prefilled.prefill_s
    else:
        cache, elapsed = _prefill_context_cache(model, ids, scope, progress)
    carrier = getattr(scope, "carrier", None)
    if press is not None and carrier is None:
        raise RuntimeError("kvcert: the press left no compressed cache to answer over")
    return CompressedContext(context, ids, suffix, cache, press, elapsed, use_chat, system_prompt,
                             enable_thinking, id(model), carrier)


def _cache_from_prefill(prefilled: Prefill, press, scope, n: int):
    """A copy of the shared prefill's cache compressed under ``scope`` (``press(model)``); without a press,
    its first ``n`` tokens in a plain ``DynamicCache``, as :func:`compress_context` gives without one."""
    from transformers import DynamicCache

    with torch.no_grad(), scope:
        cache = prefilled._compressed_copy(press)
    if press is not None:
        return cache
    plain = DynamicCache()
    for i, layer in enumerate(cache.layers):
        plain.update(layer.keys[:, :, :n], layer.values[:, :, :n], i)
    return plain


def _prefill_context_cache(model, ids, scope, progress):
    """Prefill the context ``ids`` (1, n) through the decoder model (no LM head) under ``scope``;
    returns ``(cache, wall seconds)``."""
    from transformers import DynamicCache

    decoder = getattr(model, "base_model", model)
    _, cache_kw = forward_kwargs(decoder)
    cache = DynamicCache()
    bar = LayerProgress(model, "prefill") if progress else None
    t0 = time.perf_counter()
    try:
        with torch.no_grad(), scope:
            decoder(input_ids=ids, **{cache_kw: cache})
    finally:
        if bar is not None:
            bar.close()
    return cache, time.perf_counter() - t0


def _context_ids(model, tokenizer, context, chat_template, system_prompt, enable_thinking, max_context_length):
    """``(ids (1, n) on the model's device, question suffix, chat template used)`` of a context, formatted
    as kvpress's pipeline formats it (:func:`_context_texts`), cut to ``max_context_length`` tokens."""
    import warnings

    if not isinstance(context, str) or not context:
        raise TypeError("context must be a non-empty str (one context; pass several questions to answer)")
    if not context.strip():
        raise ValueError("context: a whitespace-only context cannot be compressed; give it some text")
    check_tokens(tokenizer, [context], True, "context")
    if max_context_length is not None and (isinstance(max_context_length, bool)
                                           or not isinstance(max_context_length, int) or max_context_length < 1):
        raise ValueError(f"max_context_length must be an int >= 1, got {max_context_length!r}")
    text, suffix, use_chat = _context_texts(tokenizer, context, chat_template, system_prompt, enable_thinking)
    ids = tokenizer.encode(text, return_tensors="pt", add_special_tokens=False)
    limit = max_context_length or min(int(getattr(tokenizer, "model_max_length", 10**10) or 10**10), 10**10)
    if ids.shape[1] > limit:
        warnings.warn(f"kvcert: the context was truncated from {ids.shape[1]} to {limit} tokens", stacklevel=3)
        ids = ids[:, :limit]
    return ids.to(next(model.parameters()).device), suffix, use_chat


def _check_context_prefill(prefilled, model, ids) -> None:
    if not isinstance(prefilled, Prefill):
        raise TypeError(f"prefilled must be a kvcert.Prefill from kvcert.prefill_context, got "
                        f"{type(prefilled).__name__}")
    if prefilled.model_id != id(model):
        raise ValueError("prefilled was made with another model")
    same = prefilled.input_ids.shape == ids.shape and bool((prefilled.input_ids == ids.to(
        prefilled.input_ids.device)).all())
    if not same:
        raise ValueError("prefilled is not a prefill of this context as compress_context formats it: make it "
                         "with kvcert.prefill_context(model, tokenizer, context, ...) and the same chat_template, "
                         "system_prompt, enable_thinking and max_context_length")


def prefill_context(
    model,
    tokenizer,
    context: str,
    *,
    query_window: int | None = 64,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
    enable_thinking: bool = False,
    max_context_length: int | None = None,
    progress: bool | None = False,
) -> Prefill:
    """The exact prefill of a context, once, for :func:`compress_context` under several presses.

    The context is formatted as :func:`compress_context` formats it (kvpress's
    pipeline); the result goes to ``compress_context(..., prefilled=...)``:

    >>> state = kvcert.prefill_context(model, tok, document)                                # doctest: +SKIP
    >>> for press in (kvcert.PoissonPress(compression_ratio=0.5), kvcert.SnapKVPress(compression_ratio=0.5)):
    ...     ctx = kvcert.compress_context(model, tok, document, press=press, prefilled=state)  # doctest: +SKIP
    ...     print(kvcert.answer(model, tok, ctx, "Who wrote it?").text)                       # doctest: +SKIP

    Parameters
    ----------
    model, tokenizer, context, chat_template, system_prompt, enable_thinking, max_context_length, progress
        As in :func:`compress_context`.
    query_window : int >= 1 or None
        As in :func:`prefill`.

    Returns
    -------
    Prefill
        Of the one formatted context (``prompts == [context]``).
    """
    check_query_window(query_window)
    ids, _, use_chat = _context_ids(model, tokenizer, context, chat_template, system_prompt, enable_thinking,
                                    max_context_length)
    out, cache, elapsed = recorded_prefill(model, ids, torch.ones_like(ids), query_window, progress)
    return Prefill([context], ids, torch.ones_like(ids), out.logits[:, -1].detach(), cache, query_window, elapsed,
                   bool(use_chat), system_prompt, id(model))


def _stop_ids(model, tokenizer) -> set[int]:
    """The answer's stop tokens: the generation config's EOS ids (kvpress's pipeline), else :func:`eos_token_ids`."""
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(e, int):
        return {e}
    if isinstance(e, (list, tuple)) and e:
        return {int(x) for x in e}
    return eos_token_ids(model, tokenizer)


def check_context_call(context, press, prefilled, prefill_chunk, do_sample, chat_template, system_prompt) -> None:
    if not isinstance(context, CompressedContext):
        raise TypeError(f"context must be a kvcert.CompressedContext (from kvcert.compress_context), "
                        f"got {type(context).__name__}")
    if press is not None and press is not context.press:
        raise ValueError("context= answers over the context's own press; leave press=None")
    if prefilled is not None or prefill_chunk is not None:
        raise ValueError("context= (query-agnostic) takes neither prefilled nor prefill_chunk")
    if do_sample:
        raise ValueError("the query-agnostic protocol decodes greedily (kvpress's pipeline); do_sample=False")
    if chat_template is not None or system_prompt is not None:
        raise ValueError("chat_template and system_prompt are the context's: give them to kvcert.compress_context")


def answer(
    model,
    tokenizer,
    context: CompressedContext,
    question: str | list[str],
    *,
    max_new_tokens: int = 32,
    answer_prefix: str = "",
    stop_at_eos: bool = True,
    progress: bool | None = False,
) -> GenerationResult:
    r"""Answer question(s) over a compressed context: the query-agnostic protocol.

    For each question, as kvpress's pipeline does: the cache returns to the
    compressed context; the question, the chat template's end of turn
    (``context.question_suffix``) and ``answer_prefix`` are prefilled in one
    forward over it at positions ``n, n + 1, ...`` after the *full* context
    length n (RoPE positions are not shifted by the compression), never
    compressed; then greedy decoding, one forward per token. Under a press
    every such forward attends over the kept context tokens with the Hajek
    estimate (the question's and answer's tokens with pi = 1) and records a
    certificate per layer and query head (:class:`kvcert.attention.Carrier`).

    Parameters
    ----------
    model, tokenizer : the ones :func:`compress_context` used
    context : CompressedContext
    question : str or list[str]
        One question, or several, each answered from the same compressed
        context (kvpress's ``questions=``).
    max_new_tokens : int >= 1
    answer_prefix : str
        Text the answer starts with (kvpress's ``answer_prefix``), prefilled
        with the question; not part of ``text``.
    stop_at_eos : bool
        Stop at the generation config's EOS token (kept in ``token_ids``).
        kvpress's loop does not test the first answer token; kvcert does.
    progress : bool
        A progress bar over the answer's tokens.

    Returns
    -------
    GenerationResult
        ``protocol == "query-agnostic"``; ``certificates`` step s is the
        forward that produced answer token s (step 0: the question's last
        query over the compressed context); ``prompt_certificates`` one step
        per question token (the last one is ``certificates`` step 0, as with
        ``prefill_chunk``); ``prompt_tokens`` context + question,
        ``context_tokens`` the context; ``timings`` ``prefill_s`` (the
        context's, shared), ``question_s``, ``decode_s``. A list of questions
        gives the list form of :func:`generate`'s batch result.
    """
    single, encoded = _answer_inputs(model, tokenizer, context, question, max_new_tokens, answer_prefix)
    rows = [_answer_one(model, tokenizer, context, q_ids, max_new_tokens, stop_at_eos, progress) for q_ids in encoded]
    return rows[0] if single else _joined(rows)


def _answer_inputs(model, tokenizer, context, question, max_new_tokens, answer_prefix) -> tuple[bool, list]:
    """Check :func:`answer`'s arguments; returns ``(single, ids)``: per question, its text with the
    question suffix and ``answer_prefix`` encoded (1, q), every question encoded before any is answered.

    An empty question is kvpress's "no question"; a non-empty one that is whitespace only or that the
    tokenizer drops entirely is refused, naming it (``question`` or ``question[i]``)."""
    check_context_call(context, None, None, None, False, None, None)
    single = isinstance(question, str)
    questions = [question] if single else question
    if not isinstance(questions, (list, tuple)) or not questions or not all(isinstance(q, str) for q in questions):
        raise TypeError("question must be a str or a non-empty list of str (an empty str is kvpress's no question)")
    if context.model_id != id(model):
        raise ValueError("context was compressed with another model")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not isinstance(answer_prefix, str):
        raise TypeError(f"answer_prefix must be a str, got {type(answer_prefix).__name__}")
    for i, q in enumerate(questions):
        if q and not q.strip():
            raise ValueError(f"{_prompt_name(single, i, 'question')}: a whitespace-only question; give it some "
                             f"text, or '' for no question (kvpress's default)")
    check_tokens(tokenizer, questions, single, "question")
    device = next(model.parameters()).device
    encoded = []
    for i, q in enumerate(questions):
        ids = tokenizer.encode(q + context.question_suffix + answer_prefix, return_tensors="pt",
                               add_special_tokens=False)
        if ids.shape[1] == 0:
            raise ValueError(f"{_prompt_name(single, i, 'question')}: the question, the question suffix and "
                             f"answer_prefix encode to no token")
        encoded.append(ids.to(device))
    return single, encoded


def _joined(rows: list[GenerationResult]) -> GenerationResult:
    """The list form of :func:`generate`'s batch result, from one result per question."""
    first = rows[0]
    certs = [r.certificates for r in rows]
    prompt_certs = [r.prompt_certificates for r in rows]
    timings = {"prefill_s": first.timings["prefill_s"],
               "question_s": sum(r.timings["question_s"] for r in rows),
               "decode_s": sum(r.timings["decode_s"] for r in rows)}
    n_dec = sum(max(len(r.token_ids) - 1, 0) for r in rows)
    timings["decode_tokens_per_s"] = n_dec / timings["decode_s"] if timings["decode_s"] > 0 and n_dec else 0.0
    return GenerationResult([r.text for r in rows], [r.token_ids for r in rows], [r.logprobs for r in rows],
                            None if certs[0] is None else certs, [r.prompt_tokens for r in rows], timings,
                            first.press, prompt_certs if any(p is not None for p in prompt_certs) else None,
                            QUERY_AGNOSTIC, [r.context_tokens for r in rows],
                            margins=None if any(r.margins is None for r in rows) else [r.margins for r in rows])


def _answer_one(model, tokenizer, context: CompressedContext, q_ids: torch.Tensor, max_new_tokens: int,
                stop_at_eos: bool, progress) -> GenerationResult:
    """One question over the compressed context (kvpress 0.5.5 ``generate_answer``, with certificates):
    ``q_ids`` (1, q) the question, its suffix and the answer prefix, encoded."""
    device = q_ids.device
    fwd_kwargs, cache_kw = forward_kwargs(model)
    q = int(q_ids.shape[1])
    n = context.context_tokens
    stop = _stop_ids(model, tokenizer) if stop_at_eos else set()
    cache = context.cache
    with torch.no_grad():
        context._restore()
        t0 = time.perf_counter()
        position = torch.arange(n, n + q, device=device)[None]
        out = model(input_ids=q_ids, position_ids=position, use_cache=True, **{cache_kw: cache}, **fwd_kwargs)
        t1 = time.perf_counter()
        position = position[:, -1:] + 1
        tokens, logps, margins = [], [], []
        steps = range(max_new_tokens)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="answer", unit="tok", leave=False)
        for step in steps:
            logits = out.logits[:, -1]
            tok = logits.argmax(-1)  # on the logits, as kvpress's loop
            tokens.append(int(tok[0]))  # the one host read per step (kvpress's loop reads it too)
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            logps.append(logp[tokens[-1]])
            margins.append(greedy_margin(logp))
            if tokens[-1] in stop or step == max_new_tokens - 1:
                break
            out = model(input_ids=tok[:, None], position_ids=position + step, use_cache=True,
                        **{cache_kw: cache}, **fwd_kwargs)
        if progress:
            steps.close()
        t2 = time.perf_counter()
    certs = prompt_certs = None
    if context.carrier is not None:
        q_rec, recorder = context.carrier.session.answers[-1]
        record = recorder.result()
        if record is not None:
            record = record[0]
            certs = _step_slice(record, slice(q - 1, q - 1 + len(tokens)))
            prompt_certs = _step_slice(record, slice(0, q))
    n_dec = len(tokens) - 1
    timings = {"prefill_s": context.prefill_s, "question_s": t1 - t0, "decode_s": t2 - t1,
               "decode_tokens_per_s": n_dec / (t2 - t1) if t2 > t1 and n_dec else 0.0}
    name = repr(context.press) if context.press is not None else "none"
    return GenerationResult(tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                            torch.stack(logps).cpu(), certs, n + q, timings, name, prompt_certs,
                            QUERY_AGNOSTIC, n, margins=torch.stack(margins).cpu())


def answer_certificates(press) -> list[Certificates]:
    """The certificates of every question answered over the context ``press`` compressed last.

    For a kvcert press run inside kvpress's pipeline
    (``pipeline(context, questions=[...], press=press)``): one
    :class:`Certificates` per question, in order, step s the forward that
    produced answer token s (as ``GenerationResult.certificates`` of
    :func:`answer`). ``press.certificates`` holds the last question's raw
    record (its question queries first).
    """
    session = getattr(press, "_session", None)
    return [] if session is None else session.answer_certificates()

