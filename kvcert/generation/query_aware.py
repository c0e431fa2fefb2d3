"""The query-aware protocol: :func:`generate`, a prompt in, tokens with per-step certificates out.

One prefill over the whole prompt, question included (exact attention; the
press compresses each layer right after it), then one forward per generated
token over the compressed cache with the Hajek-corrected attention.
:func:`generate` runs four phases, each a function below it: the argument
checks, the prefill (exact, streamed in chunks, or from a shared
:class:`~kvcert.generation.prefilled.Prefill`), the decode loop, and the
assembly of the result. With ``context=`` it answers over a compressed
context instead (:func:`kvcert.answer`, the query-agnostic protocol).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time

import torch

from ..calibration import EscalationPolicy, escalation_signal
from ..escalation import check_escalate, next_target
from .common import (GenerationResult, decode_loop, forward_kwargs, mask_positions, prefill_forward, prompt_ids,
                     as_prompt_list, _step_slice)
from .prefilled import Prefill
from .query_agnostic import CompressedContext, check_context_call, answer

__all__ = ["generate"]


def generate(model, tokenizer, prompt: str | list[str], press=None, max_new_tokens: int = 32, *,
             do_sample: bool = False, temperature: float = 1.0, sample_seed: int = 0,
             chat_template: bool | None = None, system_prompt: str | None = None, stop_at_eos: bool = True,
             progress: bool | None = False, prefilled: Prefill | None = None, prefill_chunk: int | None = None,
             context: CompressedContext | None = None, escalate: str | None = None) -> GenerationResult:
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
        cache as tokens). Each holds text the tokenizer encodes to at least
        one token (not empty, not whitespace only).
    press : kvcert press, optional
        E.g. ``kvcert.PoissonPress(compression_ratio=0.5, seed=0)``. None runs
        the plain model (no compression, no certificates).
    max_new_tokens : int >= 1
    do_sample : bool
        Sample from softmax(logits / ``temperature``) (a finite float > 0) with a generator seeded by
        ``sample_seed`` (an int) instead of greedy argmax.
    chat_template : bool, optional
        Wrap each prompt as a user message in the tokenizer's chat template
        (default: when the tokenizer has one).
    system_prompt : str, optional
        A system message for the chat template (refused without one).
    stop_at_eos : bool
        Stop a sequence at its first EOS token.
    progress : bool
        Progress bars for the prefill (per layer) and the decoding steps.
    prefilled : Prefill, optional
        An exact prefill of the same prompt(s) from :func:`kvcert.prefill`,
        shared between calls: the press compresses a copy of its cache (with
        the prefill queries it recorded), so the result equals a call without
        it while the prefill runs once (``timings["prefill_s"]`` is its time).
    prefill_chunk : int >= 1, optional
        Streaming: the prompt in chunks of this many tokens, the first an exact prefill, each later one
        attending over the compressed cache plus itself with the Hajek estimate (a ``DecodingPress``
        compresses back to its budget as chunks arrive). The prompt queries' certificates are in
        ``prompt_certificates``; ``certificates`` step 0 is then the last prompt query's.
    context : CompressedContext, optional
        The query-agnostic protocol: ``prompt`` is the question(s), answered over this compressed context
        (:func:`compress_context`) as :func:`answer` does (greedy; no ``prefilled``, ``prefill_chunk``,
        ``chat_template``, ``system_prompt``). Without it the whole prompt is compressed (query-aware).
    escalate : {"full", "tighten"} or kvcert.EscalationPolicy, optional
        With a ``PoissonPress(target_error=eps)`` and one prompt: while a decoding step's mean relative
        radius (``certificates.per_step()``) exceeds eps, re-run from the prompt, ``"full"`` uncompressed,
        ``"tighten"`` at eps/2, eps/4, eps/8, then uncompressed; ``result.escalations`` lists the re-runs.
        A :class:`kvcert.EscalationPolicy` (press=None): its press, re-run uncompressed at its threshold.

    Returns
    -------
    GenerationResult

    Raises
    ------
    TypeError, ValueError
        A bad prompt (empty, whitespace only), press or sampling argument, named.

    Examples
    --------
    >>> import kvcert                                                   # doctest: +SKIP
    >>> model, tok = kvcert.load_model()                                # doctest: +SKIP
    >>> press = kvcert.PoissonPress(compression_ratio=0.5, seed=0)      # doctest: +SKIP
    >>> r = kvcert.generate(model, tok, "What is 2 + 2?", press=press)  # doctest: +SKIP
    >>> r.certificates.per_step()   # mean relative radius per step     # doctest: +SKIP
    """
    if context is not None:
        check_context_call(context, press, prefilled, prefill_chunk, do_sample, chat_template, system_prompt)
        return answer(model, tokenizer, context, prompt, max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos,
                      progress=progress)
    single, prompts = _check_generate_args(model, prompt, press, max_new_tokens, do_sample, temperature,
                                           sample_seed, chat_template, system_prompt, prefilled, prefill_chunk)
    if escalate is not None:
        return _escalation(escalate, press, single, lambda p: generate(
            model, tokenizer, prompt, p, max_new_tokens, do_sample=do_sample, temperature=temperature,
            sample_seed=sample_seed, chat_template=chat_template, system_prompt=system_prompt,
            stop_at_eos=stop_at_eos, progress=progress, prefilled=prefilled, prefill_chunk=prefill_chunk))
    input_ids, attention_mask = prompt_ids(model, tokenizer, prompts, chat_template, system_prompt, prefilled, single)
    scope = press(model) if press is not None else contextlib.nullcontext()
    with torch.no_grad(), scope:
        cache, logits, prompt_rows, timings = _prefill_phase(model, input_ids, attention_mask, press, prefilled,
                                                             prefill_chunk, progress)
        decoded = decode_loop(model, tokenizer, cache, logits, attention_mask, max_new_tokens, do_sample=do_sample,
                               temperature=temperature, sample_seed=sample_seed, stop_at_eos=stop_at_eos,
                               progress=progress)
    certs = press.certificates if press is not None else None
    return _assemble_result(tokenizer, single, attention_mask, decoded, certs, prompt_rows, timings, press)


def _escalation(escalate, press, single: bool, run) -> GenerationResult:
    """:func:`generate` with ``escalate``: a calibrated policy's rule, or an error target's closing loop."""
    if isinstance(escalate, EscalationPolicy):
        if press is not None or not single:
            raise ValueError("escalate=EscalationPolicy: one prompt and press=None (the policy carries its press: "
                             "policy.press_fields)")
        return _policy_escalated(escalate, run)
    _check_escalate(escalate, press, single)
    return _escalated(press, escalate, run)


def _check_escalate(escalate, press, single: bool) -> None:
    check_escalate(escalate, optional=True)
    if getattr(press, "target_error", None) is None:
        raise ValueError("escalate: needs a press with an error target (kvcert.PoissonPress(target_error=eps)); "
                         "without one no step can exceed it")
    if not single:
        raise ValueError("escalate: one prompt at a time (a re-run repeats one request)")


def _escalated(press, policy: str, run) -> GenerationResult:
    """:func:`generate` under ``press``, re-run from the prompt while a step's mean relative radius exceeds the
    press's target (``policy``: the next run uncompressed, or the target halved)."""
    from dataclasses import replace

    eps = press.target_error
    result, current, escalations = run(press), press, []
    while result.certificates is not None:
        per_step = result.certificates.per_step()
        flagged = (per_step[1:] > eps).nonzero()
        if flagged.numel() == 0:
            break
        step = int(flagged[0, 0]) + 1
        tightened = sum(1 for e in escalations if e["press"] != "none")
        target = next_target(policy, current.target_error, tightened)
        nxt = None if target is None else replace(current, target_error=target)
        escalations.append({"step": step, "mean_relative_radius": float(per_step[step]), "target_error": eps,
                            "press": "none" if nxt is None else repr(nxt)})
        result, current = run(nxt), nxt
    result.escalations = escalations
    return result


def _policy_escalated(policy: EscalationPolicy, run) -> GenerationResult:
    """:func:`generate` under ``policy``'s press, re-run uncompressed when its signal reaches the threshold."""
    result = run(policy.press())
    signal = escalation_signal(result.certificates)
    if policy.escalates(signal):
        per_step = result.certificates.per_step()
        step = int(per_step[1:].argmax()) + 1 if per_step.shape[0] > 1 else 0
        result = run(None)
        result.escalations = [{"step": step, "signal": signal, "threshold": policy.threshold,
                               "alpha": policy.alpha, "press": "none"}]
    return result


def _check_sampling(do_sample, temperature, sample_seed) -> None:
    """When sampling: ``temperature`` a finite real > 0 (inf would sample uniformly, NaN gives NaN
    probabilities) and ``sample_seed`` an int."""
    if not do_sample:
        return
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real)
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"temperature must be a finite float > 0 when sampling, got {temperature!r}")
    if isinstance(sample_seed, bool) or not isinstance(sample_seed, numbers.Integral):
        raise TypeError(f"sample_seed must be an int when sampling, got {type(sample_seed).__name__}")


def _check_generate_args(model, prompt, press, max_new_tokens, do_sample, temperature, sample_seed, chat_template,
                         system_prompt, prefilled, prefill_chunk) -> tuple[bool, list]:
    """Validate :func:`generate`'s arguments; returns ``(single, prompts)`` as :func:`as_prompt_list`."""
    from ..presses import Press

    single, prompts = as_prompt_list(prompt, "generated from")
    if press is not None and not isinstance(press, Press):
        raise TypeError(f"press must be a kvcert press (e.g. kvcert.PoissonPress), got {type(press).__name__}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    _check_sampling(do_sample, temperature, sample_seed)

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
    fwd_kwargs, cache_kw = forward_kwargs(model)
    position_ids = mask_positions(attention_mask)
    t0 = time.perf_counter()
    n = input_ids.shape[1]
    chunk = n if prefill_chunk is None else min(prefill_chunk, n)
    out = prefill_forward(model, input_ids[:, :chunk], attention_mask[:, :chunk],
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
    texts, id_lists, lp_list, cert_list, prompt_list, margin_list = [], [], [], [], [], []
    first = prompt_rows - 1  # the recorded step that produced token 0
    for i, length in enumerate(decoded.lengths):
        row = decoded.ids[i, :length].tolist()
        id_lists.append(row)
        lp_list.append(decoded.logprobs[i, :length])
        margin_list.append(decoded.margins[i, :length])
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
                                prompt_tokens[0], timings, name, prompt_certs[0] if prompt_certs else None,
                                margins=margin_list[0])
    return GenerationResult(texts, id_lists, lp_list, cert_rows, prompt_tokens, timings, name, prompt_certs,
                            margins=margin_list)

