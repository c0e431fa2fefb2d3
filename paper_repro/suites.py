"""Table 3: the synthetic suites on the real model, and failure prediction.

Each example is answered with the full cache, with PoissonPress and with the
deterministic SnapKV press at every budget (greedy decoding, raw completion:
the prompts end with the answer's lead-in, so no chat template), under one or
both protocols:

- query-aware (the paper's): the whole prompt, question included, is
  prefilled and compressed (``kvcert.generate``);
- query-agnostic (kvpress's pipeline): the context is compressed once and the
  question and the answer's lead-in attend over it uncompressed
  (``kvcert.compress_context`` + ``kvcert.answer``).

Where kvpress is installed (the kvpress venv), kvpress's own presses run
beside them as baselines, decoded as kvpress decodes. A Poisson run's
failure (wrong answer) is predicted from what the serving system sees:

- the certificate: mean relative radius over the decoding steps, layers and
  query heads of the run (``GenerationResult.certificates``);
- output confidence: minus the mean log-probability of the generated tokens.

AUC is the probability that a failed run scores higher than a correct one
(Mann-Whitney, ties count one half); it is undefined (blank) in a cell where
every run failed or every run succeeded.
"""

from __future__ import annotations

import numpy as np
import torch

from .common import Config, Table, progress
from .tasks import NEEDLE_SUITE, RULER_SUITE, make_examples

#: the needle tasks SmolLM2-135M can solve with a full cache at 0.5-1k tokens
#: (its full-cache accuracy on variable tracking, common words and key-value
#: retrieval is 0 in our runs, which leaves nothing to predict)
QUICK_TASKS = NEEDLE_SUITE + ("multikey_retrieval",)
MAX_NEW_TOKENS = 10
#: streaming compression (Table 4's recomputation claim): the prompt arrives in chunks of this many
#: tokens and PoissonPress compresses the cache back to budget x prompt length after each
STREAM_CHUNK = 128
STREAM_BUDGET = 0.25
#: issue 14's sketched designs beside the paper's: PoissonPress(sketch=name) at the same budget, i.e. the
#: same memory (the sketch's elements are taken off the sampled budget), run as method "poisson_<name>"; the
#: certificate is Chebyshev on the hybrid variance V_cl (docs/theory.md section 8), except for the
#: recommended design's sketch (``kvcert.fast.RECOMMENDED``, "tilted"), whose method runs the press's
#: default, ``PoissonPress()`` with no design arguments (kind ``tilted_hull``: 3 sqrt(V),
#: V = max(V_cl, HT trace), hull-capped)
SKETCHES = ("cluster", "tilted")


def sketch_press(name: str, ratio: float, seed: int):
    """The press of method ``poisson_<name>``: the default press for the recommended design's sketch (what a
    user gets from ``PoissonPress(compression_ratio=ratio)``), else ``PoissonPress(sketch=name)``."""
    import kvcert
    from kvcert.fast import RECOMMENDED

    if name == RECOMMENDED[0]:
        return kvcert.PoissonPress(compression_ratio=ratio, seed=seed)
    return kvcert.PoissonPress(compression_ratio=ratio, seed=seed, sketch=name)


def auc(scores, failed) -> float:
    """P(score of a failure > score of a success), ties 1/2; NaN without both classes."""
    s = np.asarray(scores, dtype=float)
    f = np.asarray(failed, dtype=bool)
    pos, neg = s[f], s[~f]
    if pos.size == 0 or neg.size == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum()
    ties = (pos[:, None] == neg[None, :]).sum()
    return float((greater + 0.5 * ties) / (pos.size * neg.size))


QUERY_AWARE, QUERY_AGNOSTIC = "query-aware", "query-agnostic"


def _cert_conf(r, press, *, agnostic: bool = False) -> tuple[float, float, float]:
    """(certificate score, confidence score, median certificate score) of one single-prompt result (module
    docstring): the mean relative radius over every certified query (the paper's score), minus the mean
    output log-probability, and the median relative radius over the same queries (a score robust to a few
    exploding radii, a diagnostic)."""
    lp = np.asarray(r.logprobs, dtype=float).ravel()
    cert = median = float("nan")
    if r.certificates is not None and press is not None:
        # every certified query: query-aware, the decoding steps (step 0 is the exact prefill, or with
        # chunks the last prompt query, already counted) and the streamed prompt's queries; query-agnostic,
        # the question's queries and the decoding steps (all over the compressed context)
        rel = [r.certificates.relative_radius[1:].flatten()]
        if r.prompt_certificates is not None:
            rel.append(r.prompt_certificates.relative_radius.flatten())
        rel = torch.cat(rel)
        if rel.numel():
            cert, median = float(rel.float().mean()), float(rel.float().median())
    return cert, float(-lp.mean()) if lp.size else float("nan"), median


def _run(model, tokenizer, examples, press, state, *, chunk=None) -> list[tuple]:
    """Query-aware runs of a batch of examples under one press: ``(correct, cert, conf)`` per example."""
    import kvcert

    r = kvcert.generate(model, tokenizer, [e.prompt for e in examples], press=press,
                        max_new_tokens=MAX_NEW_TOKENS, chat_template=False, prefilled=state, prefill_chunk=chunk)
    return [(bool(e.score(row.text)),) + _cert_conf(row, press) for e, row in zip(examples, r.rows())]


def _run_agnostic(model, tokenizer, example, press, state) -> tuple:
    """One query-agnostic run: the context compressed by ``press`` (from the shared context prefill
    ``state``), then the question and the answer's lead-in over it, uncompressed."""
    import kvcert

    ctx = kvcert.compress_context(model, tokenizer, example.context, press=press, chat_template=False,
                                  prefilled=state)
    r = kvcert.answer(model, tokenizer, ctx, example.question, answer_prefix=example.answer_prefix,
                      max_new_tokens=MAX_NEW_TOKENS)
    return (bool(example.score(r.text)),) + _cert_conf(r, press, agnostic=True)


def kvpress_available() -> bool:
    """Whether kvpress is importable (its baselines need transformers < 5.3: the kvpress venv)."""
    import importlib.util

    spec = importlib.util.find_spec("kvpress")
    return spec is not None and spec.origin is not None


def kvpress_press(name: str, budget: float):
    """kvpress's press ``name`` (a class of the kvpress package) keeping ``budget`` of the tokens."""
    import kvpress

    cls = getattr(kvpress, name, None)
    if cls is None:
        raise ValueError(f"kvpress has no press named {name!r}")
    return cls(compression_ratio=1.0 - budget)


_PIPELINES: dict = {}


def _kvpress_run(model, tokenizer, example, press, protocol: str) -> tuple:
    """One run of a kvpress press, decoded as kvpress decodes: plain attention over the compressed cache.

    Query-agnostic: kvpress's own pipeline (``kv-press-text-generation``; the context compressed, the
    question and ``answer_prefix`` not), formatted without the chat template as kvcert's runs.
    Query-aware: the whole prompt prefilled under ``with press(model):`` (kvpress compresses each layer
    after its prefill), then the greedy loop of kvpress's pipeline outside the press context.
    Certificate and confidence scores are NaN (kvpress has neither)."""
    from transformers import DynamicCache, pipeline

    from kvcert.generation import encode_prompts

    if protocol == QUERY_AGNOSTIC:
        template = tokenizer.chat_template
        tokenizer.chat_template = None  # kvpress formats without a template when the tokenizer has none
        try:
            if _PIPELINES.get("model") is not model:  # one pipeline per model (building one is slow)
                _PIPELINES.update(model=model, pipe=pipeline("kv-press-text-generation", model=model,
                                                             tokenizer=tokenizer))
            text = _PIPELINES["pipe"](example.context, question=example.question, answer_prefix=example.answer_prefix,
                        press=press, max_new_tokens=MAX_NEW_TOKENS)["answer"]
        finally:
            tokenizer.chat_template = template
        return bool(example.score(text)), float("nan"), float("nan")
    ids, _ = encode_prompts(tokenizer, [example.prompt], chat_template=False)
    ids = ids.to(model.device)
    n = ids.shape[1]
    cache = DynamicCache()
    stop = model.generation_config.eos_token_id
    stop = set(stop if isinstance(stop, list) else [stop])
    tokens = []
    with torch.no_grad():
        with press(model):
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
        for step in range(MAX_NEW_TOKENS):
            tokens.append(int(out.logits[0, -1].argmax()))
            if tokens[-1] in stop or step == MAX_NEW_TOKENS - 1:
                break
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=ids.device), past_key_values=cache,
                        position_ids=torch.tensor([[n + step]], device=ids.device), logits_to_keep=1)
    return bool(example.score(tokenizer.decode(tokens, skip_special_tokens=True))), float("nan"), float("nan")


def _prompt_tokens(tokenizer, example) -> int:
    """Tokens of an example's query-aware prompt (as ``kvcert.generate(..., chat_template=False)`` encodes it)."""
    return len(tokenizer(example.prompt)["input_ids"])


def batches(examples: list, size: int, tokenizer) -> list[list[int]]:
    """Indices of ``examples`` in batches of ``size``, by prompt length (little padding)."""
    lengths = [_prompt_tokens(tokenizer, e) for e in examples]
    order = sorted(range(len(examples)), key=lambda i: (lengths[i], i))
    return [order[i:i + size] for i in range(0, len(order), size)]


def collect(cfg: Config, model, tokenizer, methods=None) -> list[dict]:
    """Every run of the suites: one record per (protocol, task, example, method, budget).

    ``methods`` (a function ``(ratio, seed) -> [(method, press), ...]``) replaces the presses run at every
    budget (the paper design, the sketched designs, SnapKV) and leaves out kvpress's and the streaming run:
    a benchmark's own comparison on the same examples, prefills and protocols (the full cache still runs).

    Query-aware (the paper's protocol; the question is compressed with the
    context): examples are run in left-padded batches of ``cfg.suite_batch``
    (sorted by prompt length); each batch is prefilled once
    (``kvcert.prefill``; exact under every press) and decoded with the full
    cache, then with PoissonPress and SnapKVPress at every budget from
    copies of that prefill. With budget ``STREAM_BUDGET`` among the budgets,
    each batch is also run once with streaming compression (method
    "poisson_stream": the prompt in chunks of ``STREAM_CHUNK`` tokens,
    PoissonPress compressing back to ``STREAM_BUDGET`` x the batch's mean
    prompt length after each chunk; no shared prefill).

    Query-agnostic (kvpress's pipeline): each example's context is prefilled
    once (``kvcert.prefill_context``), compressed by each press
    (``kvcert.compress_context``), and the question and the answer's lead-in
    are answered over it uncompressed (``kvcert.answer``).

    Under both, with kvpress installed, each press of ``cfg.kvpress`` runs
    at every budget as kvpress runs it (method "kvpress:<name>").

    Every budget also runs the sketched designs of issue 14 (methods
    "poisson_cluster" and "poisson_tilted": ``PoissonPress(sketch=name)`` for
    each name of ``SKETCHES``, the same memory as "poisson", their certificate
    Chebyshev on the hybrid variance).

    Record: ``protocol, task, example, method`` ("full", "poisson", "poisson_<sketch>", "snapkv",
    "poisson_stream", "kvpress:<name>"), ``budget`` (1.0 for full),
    ``correct``, ``cert`` (mean relative radius, NaN without certificates),
    ``conf`` (minus the mean log-probability), ``cert_median`` (the median relative radius, NaN
    without certificates).
    """
    import kvcert

    tasks = QUICK_TASKS if cfg.quick else NEEDLE_SUITE + RULER_SUITE
    examples = {t: make_examples(t, cfg.suite_examples, context_tokens=cfg.suite_context, seed=cfg.seed,
                                 tokenizer=tokenizer) for t in tasks}
    baselines = cfg.kvpress if kvpress_available() and methods is None else ()
    records = []

    def add(protocol, task, i, method, budget, out):
        records.append(dict(protocol=protocol, task=task, example=i, method=method, budget=budget,
                            correct=out[0], cert=out[1], conf=out[2],
                            cert_median=out[3] if len(out) > 3 else float("nan")))

    jobs = []
    if QUERY_AWARE in cfg.protocols:
        jobs += [(QUERY_AWARE, t, b) for t in tasks for b in batches(examples[t], cfg.suite_batch, tokenizer)]
    if QUERY_AGNOSTIC in cfg.protocols:
        jobs += [(QUERY_AGNOSTIC, t, [i]) for t in tasks for i in range(len(examples[t]))]
    bar = progress(jobs, desc="T3/T4 synthetic suites", enabled=cfg.progress)
    for protocol, task, idx in bar:
        exs = [examples[task][i] for i in idx]
        if protocol == QUERY_AWARE:
            def runs(press, state, **kw):
                return zip(idx, _run(model, tokenizer, exs, press, state, **kw))

            state = kvcert.prefill(model, tokenizer, [e.prompt for e in exs], chat_template=False)
        else:
            def runs(press, state, **kw):
                return [(idx[0], _run_agnostic(model, tokenizer, exs[0], press, state))]

            state = kvcert.prefill_context(model, tokenizer, exs[0].context, chat_template=False)
        for i, out in runs(None, state):
            add(protocol, task, i, "full", 1.0, out)
        for b in cfg.budgets:
            ratio = 1.0 - b
            if methods is not None:
                presses = methods(ratio, cfg.seed)
            else:
                # the paper's design by name (sketch=None): PoissonPress's default is the recommended design
                presses = [("poisson", kvcert.PoissonPress(compression_ratio=ratio, seed=cfg.seed, sketch=None))]
                presses += [(f"poisson_{name}", sketch_press(name, ratio, cfg.seed)) for name in SKETCHES]
                presses += [("snapkv", kvcert.SnapKVPress(compression_ratio=ratio))]
            for method, press in presses:
                for i, out in runs(press, state):
                    add(protocol, task, i, method, b, out)
            for name in baselines:
                for i, ex in zip(idx, exs):
                    add(protocol, task, i, f"kvpress:{name}", b,
                        _kvpress_run(model, tokenizer, ex, kvpress_press(name, b), protocol))
        del state
        if protocol == QUERY_AWARE and STREAM_BUDGET in cfg.budgets and methods is None:
            n = float(np.mean([_prompt_tokens(tokenizer, e) for e in exs]))
            press = kvcert.DecodingPress(kvcert.PoissonPress(target_size=max(1, round(STREAM_BUDGET * n)),
                                                             seed=cfg.seed, sketch=None),
                                         compression_interval=STREAM_CHUNK)
            for i, out in runs(press, None, chunk=STREAM_CHUNK):
                add(protocol, task, i, "poisson_stream", STREAM_BUDGET, out)
    return records


def select(records, **match) -> list[dict]:
    """The records whose fields equal ``match``, sorted by (task, example)."""
    out = [r for r in records if all(r[k] == v for k, v in match.items())]
    return sorted(out, key=lambda r: (r["task"], r["example"]))


def _aucs(runs: list[dict], suffix: str = "") -> dict:
    """Failure-prediction AUCs of one method's runs: ``auc_certificate`` (mean relative radius),
    ``auc_confidence`` and ``auc_certificate_median`` (the median relative radius; NaN if a run has none:
    records made before it was kept, or a run without a certified query), each key with ``suffix``."""
    failed = [not r["correct"] for r in runs]
    medians = [r.get("cert_median", float("nan")) for r in runs]
    return {f"auc_certificate{suffix}": auc([r["cert"] for r in runs], failed),
            f"auc_confidence{suffix}": auc([r["conf"] for r in runs], failed),
            f"auc_certificate_median{suffix}": auc(medians, failed) if np.all(np.isfinite(medians))
            else float("nan")}


def _acc(runs) -> float:
    return float(np.mean([r["correct"] for r in runs])) if runs else float("nan")


def protocol_of(record: dict) -> str:
    """A record's protocol (records made before protocols existed are query-aware)."""
    return record.get("protocol", QUERY_AWARE)


def table(records: list[dict], cfg: Config) -> Table:
    """Table 3 from the records of :func:`collect`: one row per (protocol, task, budget)."""
    protocols = list(dict.fromkeys(protocol_of(r) for r in records))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    budgets = sorted({r["budget"] for r in records if r["method"] != "full"})
    baselines = sorted({r["method"] for r in records if r["method"].startswith("kvpress:")})
    rows = []
    for protocol in protocols:
        mine = [r for r in records if protocol_of(r) == protocol]
        for task in tasks:
            full = select(mine, task=task, method="full")
            for b in budgets:
                po = select(mine, task=task, method="poisson", budget=b)
                st = select(mine, task=task, method="poisson_stream", budget=b)
                row = dict(protocol=protocol, task=task, budget=b, examples=len(po), acc_full=_acc(full),
                           acc_poisson=_acc(po), acc_snapkv=_acc(select(mine, task=task, method="snapkv", budget=b)))
                for m in baselines:
                    row["acc_" + m.replace(":", "_")] = _acc(select(mine, task=task, method=m, budget=b))
                row.update(acc_poisson_streaming=_acc(st), failures=sum(not r["correct"] for r in po),
                           **_aucs(po))
                for name in SKETCHES:
                    cl = select(mine, task=task, method=f"poisson_{name}", budget=b)
                    row.update({f"acc_poisson_{name}": _acc(cl), **_aucs(cl, f"_{name}")})
                rows.append(row)
    count, ctx = cfg.suite_examples, cfg.suite_context
    notes = [
        f"{count} seeded examples per task at about {ctx} tokens of pydoc text, greedy decoding of "
        f"{MAX_NEW_TOKENS} tokens, exact match (every expected answer in the output). PoissonPress: the "
        "paper's design (sinks 4, window 32, top half of the free budget, SnapKV importance, floor 0.1), "
        "seed as configured; SnapKVPress keeps the same expected number of tokens.",
        "protocol query-aware (the paper's): the whole prompt, question included, is prefilled and compressed; "
        f"examples run in left-padded batches of up to {cfg.suite_batch} (sorted by length), one exact prefill "
        "per batch shared by all its runs (`kvcert.prefill`; the prefill is exact under every press). "
        "protocol query-agnostic (kvpress's pipeline): the context alone (BOS + text before the question) is "
        "compressed, once per example (`kvcert.prefill_context` + `kvcert.compress_context`); the question, "
        "a newline and the answer's lead-in are prefilled over it uncompressed (`kvcert.answer`). Both without "
        "the chat template.",
        f"acc_poisson_streaming (query-aware, budget {STREAM_BUDGET:g} only): the prompt arrives in chunks of "
        f"{STREAM_CHUNK} tokens and PoissonPress compresses the cache back to {STREAM_BUDGET:g} x the batch's "
        "mean prompt length after each chunk (no shared prefill).",
        ("acc_kvpress_<press>: kvpress's press at the same compression ratio, decoded as kvpress decodes "
         "(plain attention over the compressed cache; query-agnostic through kvpress's own pipeline)."
         if baselines else "No kvpress baseline: kvpress is not installed here (it needs transformers < 5.3; "
         "`make repro-kvpress` runs T3/T4 in the kvpress venv with them)."),
        "auc_certificate: AUC of the run's mean relative certificate radius for predicting a wrong Poisson "
        "answer; auc_confidence: the same for minus the mean output log-probability; auc_certificate_median: "
        "the same for the run's median relative radius (a diagnostic, robust to a few exploding radii). nan "
        "where a cell has no failure or no success.",
        "*_cluster (issue 14): PoissonPress(sketch='cluster') at the same budget, i.e. the same memory: 16 "
        "k-means clusters of each head's keys hold the evicted tokens' weighted mean key, per-channel "
        "variance and three sums (16 (2d + 3) + dv + 1 elements per head, taken off the sampled budget: about 17 "
        "tokens here); its certificate is Chebyshev on the hybrid variance V_cl (kept tokens exact, evicted "
        "ones through the sketch; docs/theory.md section 8). Its own answers, failures and AUCs.",
        "*_tilted (issues 14, 30): the recommended design, PoissonPress's default (PoissonPress(compression_ratio=r) "
        "with no design arguments: sketch 'tilted', kind tilted_hull), the same with 8 clusters whose moments are "
        "tilted at the mean of the observation window's queries of each KV head's group (8 (4d + 4) + d + dv + 1 "
        "elements per head: about 17 tokens here) and the decode's Gaussian step taken in q - q0; its "
        "certificate is 3 sqrt(V), V = max(V_cl, HT trace), capped at the hull bound (docs/theory.md "
        "section 8).",
        "Quick mode runs the needle-type tasks only: SmolLM2-135M answers variable tracking, common words "
        "and key-value retrieval wrongly even with the full cache at these lengths (0 of 3 each in a "
        "check at 500 and 1,000 tokens), so there is no failure to predict; --full runs all six tasks.",
    ]
    return Table("table3_synthetic_suites", "Table 3: synthetic suites on the real model, failure prediction",
                 rows, notes)


def run(cfg: Config, model, tokenizer) -> Table:
    """Table 3 alone (:func:`collect` then :func:`table`)."""
    return table(collect(cfg, model, tokenizer), cfg)
