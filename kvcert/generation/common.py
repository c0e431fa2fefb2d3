"""What the generation protocols share: the result type, prompt encoding, the forward helpers and the decode loop.

:class:`GenerationResult` is what :func:`kvcert.generate` and
:func:`kvcert.answer` return; :func:`encode_prompts` turns prompts into
left-padded ids through the chat template; :func:`decode_loop` chooses the
generated tokens, one forward over the (compressed) cache per token.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch

from ..attention import Certificates
from ..cache import cache_keyword

__all__ = ["GenerationResult", "encode_prompts", "QUERY_AWARE", "QUERY_AGNOSTIC"]

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
    escalations : list[dict]
        ``generate(..., escalate=...)``: one entry per re-run, ``step`` (the first decoding step whose mean
        relative radius exceeded the target), ``mean_relative_radius``, ``target_error`` and ``press`` (the
        next run's press, ``"none"`` = uncompressed); empty otherwise.
    margins : tensor (steps,) or list of tensors, or None
        The greedy margin of each step: the largest log-probability minus the second largest, under the
        model run with the press (what a change of the logits must exceed to change a greedy token; with
        sampling, still the distribution's top-two gap). None where a result was not made by the decode loops.
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
    escalations: list = field(default_factory=list)
    margins: torch.Tensor | list | None = None

    def summary(self) -> dict:
        """Compact JSON-ready summary (one prompt): tokens, timings, and the
        certificate aggregates (:meth:`Certificates.summary`: mean / median / max
        relative radius over the decoding steps, layers and heads, the kept
        fraction, an error target's share of certificates above it; and mean
        kept tokens and mean memory at the last step: kept tokens plus a
        sketch's memory in kept-token units, :attr:`Certificates.memory`)."""
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
        if self.escalations:
            out["escalations"] = list(self.escalations)
        c = self.certificates
        if c is not None:
            # query-aware step 0 is the exact prefill; query-agnostic steps all attend over the compressed context
            out["certificate"] = {**c.summary(exact_first=self.protocol != QUERY_AGNOSTIC),
                                  "mean_kept": float(c.kept[-1].to(torch.float64).mean()),
                                  "mean_memory": float(c.memory[-1].mean())}
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
                             self.protocol, None if self.context_tokens is None else self.context_tokens[i],
                             margins=None if self.margins is None else self.margins[i])
            for i in range(n)
        ]


def encode_prompts(tokenizer, prompts: list[str], *, chat_template: bool | None = None,
                   system_prompt: str | None = None):
    """Tokenize prompts, left-padded, through the chat template when there is one.

    Returns ``(input_ids, attention_mask)`` tensors of shape (b, n).

    Raises
    ------
    ValueError
        ``chat_template=True`` with a tokenizer that has no chat template, or a
        ``system_prompt`` without the chat template (it would be dropped).
    """
    use_chat = getattr(tokenizer, "chat_template", None) is not None if chat_template is None else chat_template
    if use_chat and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    if system_prompt is not None and not use_chat:
        raise ValueError("system_prompt needs the chat template (chat_template=True, with a tokenizer that has one)")
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


def eos_token_ids(model, tokenizer) -> set[int]:
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


class LayerProgress:
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


def _prompt_name(single: bool, i: int, name: str = "prompt") -> str:
    """How an error names item ``i`` of a prompt argument: ``prompt`` for a str, ``prompt[i]`` in a list."""
    return name if single else f"{name}[{i}]"


def as_prompt_list(prompt, action: str) -> tuple[bool, list]:
    """(single, prompts) of a ``prompt`` argument: a str or a non-empty list of str, none empty or
    whitespace only."""
    single = isinstance(prompt, str)
    prompts = [prompt] if single else prompt
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompt must be a str or a non-empty list of str")
    for i, p in enumerate(prompts):
        if not p.strip():
            what = "an empty" if not p else "a whitespace-only"
            raise ValueError(f"{_prompt_name(single, i)}: {what} prompt cannot be {action}; give it some text")
    return single, prompts


def check_tokens(tokenizer, texts, single: bool, name: str = "prompt") -> None:
    """Refuse a text the tokenizer encodes to no token (it drops every character): after the chat
    template such a prompt would add nothing of its own. ``name`` is the argument's, for the error."""
    for i, text in enumerate(texts):
        if text and len(tokenizer.encode(text, add_special_tokens=False)) == 0:
            shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}..."
            raise ValueError(f"{_prompt_name(single, i, name)} encodes to no token (the tokenizer drops all of "
                             f"its text {shown}): nothing of it would follow the chat template")


def forward_kwargs(model) -> tuple[dict, str]:
    """(extra forward kwargs, the cache keyword) of a causal LM's forward."""
    params = inspect.signature(model.forward).parameters
    fwd_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    return fwd_kwargs, cache_keyword(model)


def mask_positions(attention_mask):
    """RoPE positions of left-padded rows (b, n): 0 at each row's first real token (padding at 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def prompt_ids(model, tokenizer, prompts, chat_template, system_prompt, prefilled=None, single=False):
    """``(input_ids, attention_mask)`` (b, n) on the model's device: encoded, or the shared prefill's.

    A prompt that encodes to no token is refused (ValueError naming it)."""
    if prefilled is not None:
        return prefilled.input_ids, prefilled.attention_mask
    check_tokens(tokenizer, prompts, single)
    device = next(model.parameters()).device
    input_ids, attention_mask = encode_prompts(tokenizer, list(prompts), chat_template=chat_template,
                                               system_prompt=system_prompt)
    return input_ids.to(device), attention_mask.to(device)


def prefill_forward(model, input_ids, attention_mask, position_ids, fwd_kwargs, progress):
    bar = LayerProgress(model, "prefill") if progress else None
    try:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     use_cache=True, **fwd_kwargs)
    finally:
        if bar is not None:
            bar.close()


@dataclass
class _Decoded:
    """What the decode loop produced: ``ids``, ``logprobs`` and ``margins`` (b, steps) on the CPU (padded with
    the pad id after a row's EOS), ``lengths`` (the tokens of each row, its EOS included), wall ``seconds``."""

    ids: torch.Tensor
    logprobs: torch.Tensor
    lengths: list[int]
    seconds: float
    margins: torch.Tensor | None = None


def greedy_margin(logp: torch.Tensor) -> torch.Tensor:
    """The largest minus the second largest of the log-probabilities ``logp`` (..., vocab): (...)."""
    top = logp.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def _choose_token(logits, generator, temperature, device):
    """(token, log p(token), greedy margin) per row: the argmax, or (``generator`` given) a draw at
    ``temperature``; the margin is :func:`greedy_margin` of the untempered log-probabilities."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if generator is not None:
        probs = torch.softmax(logits.float() / temperature, dim=-1).cpu()
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(device)
    else:
        tok = logp.argmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), greedy_margin(logp)


def decode_loop(model, tokenizer, cache, logits, attention_mask, max_new_tokens, *, do_sample, temperature,
                 sample_seed, stop_at_eos, progress) -> _Decoded:
    """Choose up to ``max_new_tokens`` tokens per row, one forward over ``cache`` per token after the first.

    ``logits`` are the last prompt position's and ``attention_mask`` the
    prompt's (b, n). A row that has emitted an EOS (with ``stop_at_eos``)
    gets the pad id from then on and stops counting; the loop ends when
    every row has or after ``max_new_tokens`` tokens.
    """
    device = next(model.parameters()).device
    fwd_kwargs, cache_kw = forward_kwargs(model)
    eos = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos), 0)
    eos_ids = torch.tensor(sorted(eos), device=device) if stop_at_eos and eos else None
    generator = torch.Generator(device="cpu").manual_seed(int(sample_seed)) if do_sample else None
    b = attention_mask.shape[0]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    lengths = torch.zeros(b, dtype=torch.long, device=device)
    next_pos = mask_positions(attention_mask)[:, -1]
    tokens, logps, margins = [], [], []
    t0 = time.perf_counter()
    steps = range(max_new_tokens)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="decode", unit="tok", leave=False)
    for step in steps:
        tok, lp, margin = _choose_token(logits, generator, temperature, device)
        margins.append(margin)
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
    return _Decoded(torch.stack(tokens, dim=1).cpu(), torch.stack(logps, dim=1).cpu(), lengths.tolist(), seconds,
                    torch.stack(margins, dim=1).cpu())


def _step_slice(c: Certificates, steps: slice) -> Certificates:
    """The certificates of one sequence restricted to the recorded ``steps``."""
    return c.map(lambda x: x[steps])

