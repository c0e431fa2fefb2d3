"""``kvcert.generate``: text generation under a press, with per-step certificates.

Two protocols (the names are kvpress's evaluation settings):

- **query-aware** (:func:`generate` with a prompt): one prefill over the whole
  prompt, question included (exact attention; the press compresses each layer
  right after it), then one forward per generated token over the compressed
  cache with the Hajek-corrected attention;
- **query-agnostic** (:func:`compress_context`, then :func:`answer` or
  ``generate(..., context=...)``): kvpress's ``kv-press-text-generation``
  pipeline. The context alone is prefilled and compressed once; each question
  (with the chat template's end of turn and an optional answer prefix) is then
  prefilled over the compressed context, never compressed, and answered
  greedily, every question from the same compressed context.

Every forward over a compressed cache records a certificate per layer and
query head (:class:`kvcert.attention.Certificates`).

:func:`generate` runs four phases, each a function below it: the argument
checks, the prefill (exact, streamed in chunks, or from a shared
:class:`Prefill`), the decode loop, and the assembly of the result.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass, field

import torch

from .attention import Certificates

__all__ = ["GenerationResult", "Prefill", "CompressedContext", "generate", "prefill", "compress_context", "answer",
           "answer_certificates", "encode_prompts", "QUERY_AWARE", "QUERY_AGNOSTIC"]

#: the protocol of :func:`generate` with a prompt: the question is inside the compressed prompt
QUERY_AWARE = "query-aware"
#: the protocol of :func:`compress_context` + :func:`answer` (kvpress's pipeline): the context alone is compressed
QUERY_AGNOSTIC = "query-agnostic"


@dataclass
class GenerationResult:
    """Output of :func:`generate`.

    For a single prompt (a ``str``) every field is for that prompt; for a
    list of prompts every field is a list with one entry per prompt.

    Attributes
    ----------
    text : str or list[str]
        The generated continuation (special tokens removed).
    token_ids : list[int] or list[list[int]]
        Generated token ids (the EOS token included when it ended the text).
    logprobs : tensor (steps,) or list of tensors
        log p(token) of each generated token under the model run with the press.
    certificates : Certificates or list[Certificates] or None
        Per step x layer x query head: ``radius``, ``relative_radius``,
        ``trace``, ``kept`` (tensors (steps, layers, heads)). Step s is the
        forward that produced token s (step 0: the exact prefill).
        ``certificates.per_step()`` is the documented aggregate, the mean
        relative radius over layers and heads. None without a press.
    prompt_tokens : int or list[int]
        Prompt length in tokens (chat template included, padding excluded).
    timings : dict
        ``prefill_s``, ``decode_s`` (wall seconds), ``decode_tokens_per_s``.
    press : str
        ``repr`` of the press (or "none").
    prompt_certificates : Certificates or list[Certificates] or None
        With ``prefill_chunk`` (streaming compression): the certificates of
        the prompt's queries after the first chunk, one step per prompt
        position (the first chunk is exact). Query-agnostic: those of the
        question's queries over the compressed context, one step per
        question token. In both, ``certificates`` step 0 is the last prompt
        query's. None otherwise.
    protocol : str
        ``"query-aware"`` (the question was compressed with the prompt) or
        ``"query-agnostic"`` (the context alone was compressed; the question
        and answer attend over it uncompressed).
    context_tokens : int or list[int] or None
        Query-agnostic: the context's length in tokens (``prompt_tokens`` is
        context + question); None for query-aware.
    """

    text: str | list[str]
    token_ids: list
    logprobs: torch.Tensor | list
    certificates: Certificates | list | None
    prompt_tokens: int | list[int]
    timings: dict = field(default_factory=dict)
    press: str = "none"
    prompt_certificates: Certificates | list | None = None
    protocol: str = QUERY_AWARE
    context_tokens: int | list[int] | None = None

    def summary(self) -> dict:
        """Compact JSON-ready summary (one prompt): tokens, timings, and the
        certificate aggregates (mean / median / max relative radius over the
        decoding steps, layers and heads; mean kept tokens, and mean memory:
        kept tokens plus a sketch's memory in kept-token units,
        :attr:`Certificates.memory`)."""
        if isinstance(self.text, list):
            raise TypeError("summary() is per prompt; for a batch call it on each of result.rows()")
        out = {
            "press": self.press,
            "protocol": self.protocol,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.token_ids),
            "timings": dict(self.timings),
        }
        if self.context_tokens is not None:
            out["context_tokens"] = self.context_tokens
        c = self.certificates
        if c is not None:
            # query-aware step 0 is the exact prefill; query-agnostic steps all attend over the compressed context
            agnostic = self.protocol == QUERY_AGNOSTIC
            rel = c.relative_radius[1:] if c.relative_radius.shape[0] > 1 and not agnostic else c.relative_radius
            rel = rel.to(torch.float64)
            out["certificate"] = {
                "kind": c.kind,
                "delta": c.delta,
                "decode_steps": int(rel.shape[0]) if c.relative_radius.shape[0] > 1 or agnostic else 0,
                "mean_relative_radius": float(rel.mean()),
                "median_relative_radius": float(rel.median()),
                "max_relative_radius": float(rel.max()),
                "mean_kept": float(c.kept[-1].to(torch.float64).mean()),
                "mean_memory": float(c.memory[-1].mean()),
            }
        p = self.prompt_certificates
        if p is not None:  # streaming: the prompt's queries after the first chunk
            prel = p.relative_radius.to(torch.float64)
            out["prompt_certificate"] = {
                "prompt_steps": int(prel.shape[0]),
                "mean_relative_radius": float(prel.mean()),
                "max_relative_radius": float(prel.max()),
                "max_kept": int(p.kept.max()),
            }
        return out

    def rows(self) -> list["GenerationResult"]:
        """One single-prompt result per prompt (a single result gives [self])."""
        if not isinstance(self.text, list):
            return [self]
        n = len(self.text)
        return [
            GenerationResult(self.text[i], self.token_ids[i], self.logprobs[i],
                             None if self.certificates is None else self.certificates[i],
                             self.prompt_tokens[i], dict(self.timings), self.press,
                             None if self.prompt_certificates is None else self.prompt_certificates[i],
                             self.protocol, None if self.context_tokens is None else self.context_tokens[i])
            for i in range(n)
        ]


def encode_prompts(tokenizer, prompts: list[str], *, chat_template: bool | None = None,
                   system_prompt: str | None = None):
    """Tokenize prompts, left-padded, through the chat template when there is one.

    Returns ``(input_ids, attention_mask)`` tensors of shape (b, n).
    """
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat_template is None else chat_template
    if use_chat and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    if use_chat:
        texts = []
        for p in prompts:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
                {"role": "user", "content": p}
            ]
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        add_special = False
    else:
        texts, add_special = list(prompts), True
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                    add_special_tokens=add_special)
    return enc["input_ids"], enc["attention_mask"]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


class _LayerProgress:
    """A tqdm bar advanced by each decoder layer of one forward (prefill progress)."""

    def __init__(self, model, desc: str):
        from tqdm.auto import tqdm

        self.layers = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
        self.bar = tqdm(total=len(self.layers), desc=desc, unit="layer", leave=False)
        self.handles = [m.register_forward_hook(self._tick) for m in self.layers]

    def _tick(self, *args) -> None:  # must return None: a forward hook's return value replaces the output
        self.bar.update(1)

    def close(self):
        for h in self.handles:
            h.remove()
        self.bar.close()


def _prompt_list(prompt, action: str) -> tuple[bool, list]:
    """(single, prompts) of a ``prompt`` argument: a str or a non-empty list of non-empty str."""
    single = isinstance(prompt, str)
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompt must be a str or a non-empty list of str")
    if any(not p for p in prompts):
        raise ValueError(f"prompt: empty prompts cannot be {action}")
    return single, prompts


def _forward_kwargs(model) -> tuple[dict, str]:
    """(extra forward kwargs, the cache keyword) of a causal LM's forward."""
    params = inspect.signature(model.forward).parameters
    fwd_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return fwd_kwargs, ("cache" if "cache" in params else "past_key_values")


def _position_ids(attention_mask):
    """RoPE positions of left-padded rows (b, n): 0 at each row's first real token (padding at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def _prompt_ids(model, tokenizer, prompts, chat_template, system_prompt, prefilled=None):
    """``(input_ids, attention_mask)`` (b, n) on the model's device: encoded, or the shared prefill's."""
    if prefilled is not None:
        return prefilled.input_ids, prefilled.attention_mask
    device = next(model.parameters()).device
    input_ids, attention_mask = encode_prompts(tokenizer, list(prompts), chat_template=chat_template,
                                               system_prompt=system_prompt)
    return input_ids.to(device), attention_mask.to(device)


def _prefill_forward(model, input_ids, attention_mask, position_ids, fwd_kwargs, progress):
    bar = _LayerProgress(model, "prefill") if progress else None
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=True, **fwd_kwargs)
    finally:
        if bar is not None:
            bar.close()


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
        (``tests/test_hf_prefill.py`` checks it bit for bit).
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
    _, prompts = _prompt_list(prompt, "prefilled")
    _check_query_window(query_window)
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat_template is None else chat_template
    input_ids, attention_mask = _prompt_ids(model, tokenizer, prompts, chat_template, system_prompt)
    out, cache, elapsed = _recorded_prefill(model, input_ids, attention_mask, query_window, progress)
    return Prefill(list(prompts), input_ids, attention_mask, out.logits[:, -1].detach(), cache, query_window,
                   elapsed, bool(use_chat), system_prompt, id(model))


def _check_query_window(query_window) -> None:
    if query_window is not None and (isinstance(query_window, bool) or not isinstance(query_window, int)
                                     or query_window < 1):
        raise ValueError(f"query_window must be an int >= 1 or None, got {query_window!r}")


def _recorded_prefill(model, input_ids, attention_mask, query_window, progress):
    """One exact forward over the prompt(s), recording the last ``query_window`` queries per layer;
    returns ``(model output, cache, wall seconds)``."""
    from .presses import _QueryRecorder

    position_ids = _position_ids(attention_mask)
    fwd_kwargs, cache_kw = _forward_kwargs(model)
    recorder = _QueryRecorder(query_window=query_window)
    with torch.no_grad(), recorder(model):
        t0 = time.perf_counter()
        out = _prefill_forward(model, input_ids, attention_mask, position_ids, fwd_kwargs, progress)
        elapsed = time.perf_counter() - t0
    return out, getattr(out, cache_kw, None), elapsed


def generate(
    model,
    tokenizer,
    prompt: str | list[str],
    press=None,
    max_new_tokens: int = 32,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    sample_seed: int = 0,
    chat_template: bool | None = None,
    system_prompt: str | None = None,
    stop_at_eos: bool = True,
    progress: bool | None = False,
    prefilled: "Prefill | None" = None,
    prefill_chunk: int | None = None,
    context: "CompressedContext | None" = None,
) -> GenerationResult:
    r"""Generate text with a press, recording per-step certificates.

    Greedy decoding by default. Under ``press`` the prefill is exact
    attention over the whole prompt, each layer is compressed right after it,
    and every later token attends over the kept tokens with the Hajek
    estimate

    .. math:: \hat o = \sum_{i\in S} a_i v_i, \qquad
              a_i = \operatorname{softmax}_S(\tau\, q\cdot k_i - \log\pi_i),

    whose certificate (radius on :math:`\lVert \hat o - o \rVert_2` at level
    1 - delta, per layer and query head) is recorded at every step.

    Parameters
    ----------
    model : transformers causal LM (Llama/Qwen/Mistral-style attention)
    tokenizer : its tokenizer
    prompt : str or list[str]
        One prompt, or a batch (left-padded; padded slots never enter the
        cache as tokens).
    press : kvcert press, optional
        E.g. ``kvcert.PoissonPress(compression_ratio=0.5, seed=0)``. None runs
        the plain model (no compression, no certificates).
    max_new_tokens : int >= 1
    do_sample : bool
        Sample with ``temperature`` from a generator seeded by
        ``sample_seed`` instead of greedy argmax.
    chat_template : bool, optional
        Wrap each prompt as a user message in the tokenizer's chat template
        (default: when the tokenizer has one).
    system_prompt : str, optional
        A system message for the chat template.
    stop_at_eos : bool
        Stop a sequence at its first EOS token.
    progress : bool
        Progress bars for the prefill (per layer) and the decoding steps.
    prefilled : Prefill, optional
        An exact prefill of the same prompt(s) from :func:`prefill`, shared
        between calls: the press compresses a copy of its cache (with the
        prefill queries it recorded) and decoding starts from its logits, so
        the result equals a call without ``prefilled`` (the prefill is exact
        attention under every press) while the prefill runs once.
        ``timings["prefill_s"]`` is then the shared prefill's time.
    prefill_chunk : int >= 1, optional
        Streaming: feed the prompt in chunks of this many tokens. The first
        chunk is an exact prefill (compressed by the press after it); each
        later chunk attends causally over the compressed cache plus itself
        with the Hajek estimate, and a press with ``target_size`` and
        ``compression_interval`` compresses the cache back to its budget as
        the chunks arrive (streaming compression). The certificates of the
        prompt's queries are in ``prompt_certificates``; ``certificates``
        step 0 is then the last prompt query's.
    context : CompressedContext, optional
        The query-agnostic protocol: ``prompt`` is then the question(s),
        answered over this compressed context (:func:`compress_context`);
        the same as :func:`answer` (``press`` is the context's; greedy; no
        ``prefilled``, ``prefill_chunk``, ``chat_template``, ``system_prompt``).
        Without it, the query-aware protocol: the whole prompt is compressed.

    Returns
    -------
    GenerationResult

    Raises
    ------
    TypeError, ValueError
        Bad prompt, press or sampling arguments.

    Examples
    --------
    >>> import kvcert                                                   # doctest: +SKIP
    >>> model, tok = kvcert.load_model()                                # doctest: +SKIP
    >>> press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)      # doctest: +SKIP
    >>> r = kvcert.generate(model, tok, "What is 2 + 2?", press=press)  # doctest: +SKIP
    >>> r.certificates.per_step()   # mean relative radius per step     # doctest: +SKIP
    """
    if context is not None:
        _check_context_call(context, press, prefilled, prefill_chunk, do_sample, chat_template, system_prompt)
        return answer(model, tokenizer, context, prompt, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos,
                      progress=progress)
    single, prompts = _check_generate_args(model, prompt, press, max_new_tokens, do_sample, temperature,
                                           chat_template, system_prompt, prefilled, prefill_chunk)
    input_ids, attention_mask = _prompt_ids(model, tokenizer, prompts, chat_template, system_prompt, prefilled)
    context = press(model) if press is not None else contextlib.nullcontext()
    with torch.no_grad(), context:
        cache, logits, prompt_rows, timings = _prefill_phase(model, input_ids, attention_mask, press, prefilled,
                                                             prefill_chunk, progress)
        decoded = _decode_loop(model, tokenizer, cache, logits, attention_mask, max_new_tokens, do_sample=do_sample,
                               temperature=temperature, sample_seed=sample_seed, stop_at_eos=stop_at_eos,
                               progress=progress)
    certs = press.certificates if press is not None else None
    return _assemble_result(tokenizer, single, attention_mask, decoded, certs, prompt_rows, timings, press)


# --- the query-agnostic protocol: compress a context once, answer questions over it ---


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
        Passed to the chat template (kvpress's pipeline argument).
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
    from transformers import DynamicCache

    from .presses import Press

    if press is not None and not isinstance(press, Press):
        raise TypeError(f"press must be a kvcert press (e.g. kvcert.PoissonPress), got {type(press).__name__}")
    ids, suffix, use_chat = _context_ids(model, tokenizer, context, chat_template, system_prompt, enable_thinking,
                                         max_context_length)
    scope = press(model) if press is not None else contextlib.nullcontext()
    if prefilled is not None:
        _check_context_prefill(prefilled, model, ids)
        with torch.no_grad(), scope:
            cache = prefilled._compressed_copy(press)
        if press is None:  # a plain cache, as compress_context without a press gives
            plain = DynamicCache()
            for i, layer in enumerate(cache.layers):
                plain.update(layer.keys[:, :, :ids.shape[1]], layer.values[:, :, :ids.shape[1]], i)
            cache = plain
        elapsed = prefilled.prefill_s
    else:
        decoder = getattr(model, "base_model", model)
        _, cache_kw = _forward_kwargs(decoder)
        cache = DynamicCache()
        bar = _LayerProgress(model, "prefill") if progress else None
        t0 = time.perf_counter()
        try:
            with torch.no_grad(), scope:
                decoder(input_ids=ids, **{cache_kw: cache})
        finally:
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t0
    carrier = getattr(scope, "carrier", None)
    if press is not None and carrier is None:
        raise RuntimeError("kvcert: the press left no compressed cache to answer over")
    return CompressedContext(context, ids, suffix, cache, press, elapsed, use_chat, system_prompt,
                             enable_thinking, id(model), carrier)


def _context_ids(model, tokenizer, context, chat_template, system_prompt, enable_thinking, max_context_length):
    """``(ids (1, n) on the model's device, question suffix, chat template used)`` of a context, formatted
    as kvpress's pipeline formats it (:func:`_context_texts`), cut to ``max_context_length`` tokens."""
    import warnings

    if not isinstance(context, str) or not context:
        raise TypeError("context must be a non-empty str (one context; pass several questions to answer)")
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
    _check_query_window(query_window)
    ids, _, use_chat = _context_ids(model, tokenizer, context, chat_template, system_prompt, enable_thinking,
                                    max_context_length)
    out, cache, elapsed = _recorded_prefill(model, ids, torch.ones_like(ids), query_window, progress)
    return Prefill([context], ids, torch.ones_like(ids), out.logits[:, -1].detach(), cache, query_window, elapsed,
                   bool(use_chat), system_prompt, id(model))


def _stop_ids(model, tokenizer) -> set[int]:
    """The answer's stop tokens: the generation config's EOS ids (kvpress's pipeline), else :func:`_eos_ids`."""
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(e, int):
        return {e}
    if isinstance(e, (list, tuple)) and e:
        return {int(x) for x in e}
    return _eos_ids(model, tokenizer)


def _check_context_call(context, press, prefilled, prefill_chunk, do_sample, chat_template, system_prompt) -> None:
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
    _check_context_call(context, None, None, None, False, None, None)
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
    rows = [_answer_one(model, tokenizer, context, q + context.question_suffix + answer_prefix, max_new_tokens,
                        stop_at_eos, progress) for q in questions]
    if single:
        return rows[0]
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
                            QUERY_AGNOSTIC, [r.context_tokens for r in rows])


def _answer_one(model, tokenizer, context: CompressedContext, text: str, max_new_tokens: int, stop_at_eos: bool,
                progress) -> GenerationResult:
    """One question over the compressed context (kvpress 0.5.5 ``generate_answer``, with certificates)."""
    device = next(model.parameters()).device
    fwd_kwargs, cache_kw = _forward_kwargs(model)
    q_ids = tokenizer.encode(text, return_tensors="pt", add_special_tokens=False).to(device)
    q = int(q_ids.shape[1])
    if q == 0:
        raise ValueError("the question, its suffix and the answer prefix encode to no token")
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
        tokens, logps = [], []
        steps = range(max_new_tokens)
        if progress:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="answer", unit="tok", leave=False)
        for step in steps:
            logits = out.logits[:, -1]
            tok = logits.argmax(-1)  # on the logits, as kvpress's loop
            tokens.append(int(tok[0]))  # the one host read per step (kvpress's loop reads it too)
            logps.append(torch.log_softmax(logits[0].float(), dim=-1)[tokens[-1]])
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
                            QUERY_AGNOSTIC, n)


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


# --- the phases of generate: checks, prefill, decode loop, result assembly ---


def _check_generate_args(model, prompt, press, max_new_tokens, do_sample, temperature, chat_template,
                         system_prompt, prefilled, prefill_chunk) -> tuple[bool, list]:
    """Validate :func:`generate`'s arguments; returns ``(single, prompts)`` as :func:`_prompt_list`."""
    from .presses import Press

    single, prompts = _prompt_list(prompt, "generated from")
    if press is not None and not isinstance(press, Press):
        raise TypeError(f"press must be a kvcert press (e.g. kvcert.PoissonPress), got {type(press).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if do_sample and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a float > 0 when sampling, got {temperature!r}")

    if prefilled is not None:
        if not isinstance(prefilled, Prefill):
            raise TypeError(f"prefilled must be a kvcert.Prefill (from kvcert.prefill), got {type(prefilled).__name__}")
        if list(prefilled.prompts) != list(prompts):
            raise ValueError("prefilled was computed for other prompts than prompt; pass the same prompt(s)")
        if prefilled.model_id != id(model):
            raise ValueError("prefilled was computed with another model")
        if chat_template is not None and chat_template != prefilled.chat_template:
            raise ValueError(f"chat_template={chat_template} differs from the prefill's ({prefilled.chat_template})")
        if system_prompt is not None and system_prompt != prefilled.system_prompt:
            raise ValueError("system_prompt differs from the one the prefill used")

    if prefill_chunk is not None:
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        if prefilled is not None:
            raise ValueError("give prefilled or prefill_chunk, not both (a shared prefill is one exact forward)")
    return single, prompts


def _prefill_phase(model, input_ids, attention_mask, press, prefilled, prefill_chunk, progress):
    """Fill the cache with the prompt; returns ``(cache, logits, prompt_rows, timings)``.

    Either one exact forward over the prompt, or (``prefill_chunk``) an exact
    first chunk followed by the later chunks over the compressed cache, or
    (``prefilled``) a copy of a shared prefill's cache compressed by ``press``.
    ``logits`` (b, vocab) are the last prompt position's; ``prompt_rows`` is
    the number of certificate steps the prompt recorded (1 + the prompt
    queries after the first chunk); ``timings`` holds ``prefill_s`` (and
    ``compress_s`` for a shared prefill).
    """
    if prefilled is not None:
        t0 = time.perf_counter()
        cache = prefilled._compressed_copy(press)
        timings = {"prefill_s": prefilled.prefill_s,  # the shared exact prefill (not repeated)
                   "compress_s": time.perf_counter() - t0}
        return cache, prefilled.logits, 1, timings
    fwd_kwargs, cache_kw = _forward_kwargs(model)
    position_ids = _position_ids(attention_mask)
    t0 = time.perf_counter()
    n = input_ids.shape[1]
    chunk = n if prefill_chunk is None else min(prefill_chunk, n)
    out = _prefill_forward(model, input_ids[:, :chunk], attention_mask[:, :chunk],
                           position_ids[:, :chunk], fwd_kwargs, progress)
    cache = getattr(out, cache_kw, None)
    for start in range(chunk, n, chunk):  # streaming: later chunks over the compressed cache
        end = min(start + chunk, n)
        out = model(input_ids=input_ids[:, start:end], attention_mask=attention_mask[:, :end],
                    position_ids=position_ids[:, start:end], use_cache=True, **{cache_kw: cache},
                    **fwd_kwargs)
        cache = getattr(out, cache_kw, None)
    logits = out.logits[:, -1]
    return cache, logits, 1 + (n - chunk), {"prefill_s": time.perf_counter() - t0}


@dataclass
class _Decoded:
    """What the decode loop produced: ``ids`` and ``logprobs`` (b, steps) on the CPU (padded with the pad
    id after a row's EOS), ``lengths`` (the tokens of each row, its EOS included), wall ``seconds``."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    lengths: list[int]
    seconds: float


def _choose_token(logits, generator, temperature, device):
    """(token, log p(token)) per row: the argmax, or (``generator`` given) a draw at ``temperature``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if generator is not None:
        probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
    else:
        tok = logp.argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _decode_loop(model, tokenizer, cache, logits, attention_mask, max_new_tokens, *, do_sample, temperature,
                 sample_seed, stop_at_eos, progress) -> _Decoded:
    """Choose up to ``max_new_tokens`` tokens per row, one forward over ``cache`` per token after the first.

    ``logits`` are the last prompt position's and ``attention_mask`` the
    prompt's (b, n). A row that has emitted an EOS (with ``stop_at_eos``)
    gets the pad id from then on and stops counting; the loop ends when
    every row has or after ``max_new_tokens`` tokens.
    """
    device = next(model.parameters()).device
    fwd_kwargs, cache_kw = _forward_kwargs(model)
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    eos_ids = torch.tensor(sorted(eos), device=device) if stop_at_eos and eos else None
    generator = torch.Generator(device="cpu").manual_seed(int(sample_seed)) if do_sample else None
    b = attention_mask.shape[0]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    next_pos = _position_ids(attention_mask)[:, -1]
    tokens, logps = [], []
    t0 = time.perf_counter()
    steps = range(max_new_tokens)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="decode", unit="tok", leave=False)
    for step in steps:
        tok, lp = _choose_token(logits, generator, temperature, device)
        tok = tok.masked_fill(done, pad_id)
        tokens.append(tok)
        logps.append(lp)
        lengths += ~done
        if eos_ids is not None:
            done = done | torch.isin(tok, eos_ids)
            if bool(done.all()):  # the one host sync per step
                break
        if step == max_new_tokens - 1:
            break
        next_pos = next_pos + 1
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)
        out = model(input_ids=tok[:, None], attention_mask=attention_mask, position_ids=next_pos[:, None],
                    use_cache=True, **{cache_kw: cache}, **fwd_kwargs)
        cache = getattr(out, cache_kw, None)
        logits = out.logits[:, -1]
    if progress:
        steps.close()
    seconds = time.perf_counter() - t0
    return _Decoded(torch.stack(tokens, dim=1).cpu(), torch.stack(logps, dim=1).cpu(), lengths.tolist(), seconds)


def _step_slice(c: Certificates, steps: slice) -> Certificates:
    """The certificates of one sequence restricted to the recorded ``steps``."""
    return c.map(lambda x: x[steps])


def _assemble_result(tokenizer, single, attention_mask, decoded, certs, prompt_rows, timings,
                     press) -> GenerationResult:
    """Per-row text, tokens, log-probabilities and certificate steps, as one :class:`GenerationResult`.

    ``certs`` (batched, or None without a press) holds every recorded step:
    row 0 the first prompt forward, rows 1 .. ``prompt_rows`` - 1 the later
    prompt queries (streaming), then one row per decoding forward. Token s
    was produced by recorded step ``prompt_rows - 1 + s``.
    """
    n_dec = max(decoded.ids.shape[1] - 1, 0)
    timings = {**timings, "decode_s": decoded.seconds,
               "decode_tokens_per_s": n_dec / decoded.seconds if decoded.seconds > 0 and n_dec else 0.0}
    prompt_tokens = [int(x) for x in attention_mask.sum(-1).tolist()]
    texts, id_lists, lp_list, cert_list, prompt_list = [], [], [], [], []
    first = prompt_rows - 1  # the recorded step that produced token 0
    for i, length in enumerate(decoded.lengths):
        row = decoded.ids[i, :length].tolist()
        id_lists.append(row)
        lp_list.append(decoded.logprobs[i, :length])
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
        if certs is not None:
            ci = certs[i]
            cert_list.append(_step_slice(ci, slice(first, first + length)))
            if prompt_rows > 1:
                prompt_list.append(_step_slice(ci, slice(1, prompt_rows)))
    name = repr(press) if press is not None else "none"
    cert_rows = cert_list if certs is not None else None
    prompt_certs = prompt_list if prompt_list else None
    if single:
        return GenerationResult(texts[0], id_lists[0], lp_list[0], cert_rows[0] if cert_rows is not None else None,
                                prompt_tokens[0], timings, name, prompt_certs[0] if prompt_certs else None)
    return GenerationResult(texts, id_lists, lp_list, cert_rows, prompt_tokens, timings, name, prompt_certs)
