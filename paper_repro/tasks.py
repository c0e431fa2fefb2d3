"""Offline, seeded long-context tasks over real text (needle and RULER-style).

Every generator returns :class:`Example` objects: a prompt (haystack of
``pydoc_data.topics`` text with the task's facts inserted, then a question),
the expected answers and a scorer. Scoring is exact match in RULER's
"string match all" sense: every expected answer must appear in the output
(case-insensitive, whitespace-normalized). Lengths are in tokens when a
tokenizer is given (the haystack is cut to fit), else approximated as 4
characters per token.

Tasks
-----
- ``niah_single``: one "special magic number" sentence at a random depth.
- ``niah_multikey``: four such sentences with different keys; one is asked for.
- ``multikey_retrieval``: RULER MK-NIAH: needles with distractor keys that
  share a prefix with the asked key.
- ``variable_tracking``: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ...
  scattered in the text; all names holding the value are asked for.
- ``common_words``: a list of words in which three words are much more
  frequent; the three are asked for.
- ``kv_retrieval``: a block of ``key: value`` pairs of random hex strings;
  the value of one key is asked for.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .realmodel import haystack_text

TASKS = ("niah_single", "niah_multikey", "multikey_retrieval", "variable_tracking", "common_words",
         "kv_retrieval")
#: the four-task RULER-style suite of the paper
RULER_SUITE = ("multikey_retrieval", "variable_tracking", "common_words", "kv_retrieval")
NEEDLE_SUITE = ("niah_single", "niah_multikey")

_KEY_WORDS = ("apple", "river", "falcon", "copper", "meadow", "violet", "harbor", "cedar", "ember",
              "glacier", "lantern", "orchid", "quartz", "saffron", "thistle", "walnut")
_FILLER_WORDS = ("module", "function", "object", "value", "string", "number", "method", "class",
                 "argument", "return", "default", "attribute", "statement", "expression", "keyword",
                 "sequence", "mapping", "integer", "operator", "exception", "variable", "builtin")


@dataclass
class Example:
    task: str
    prompt: str
    answers: list
    context_tokens: int
    meta: dict = field(default_factory=dict)
    #: the query-agnostic split of ``prompt``: ``context`` (what is compressed), ``question`` and the
    #: answer's lead-in ``answer_prefix``, with ``prompt == context + "\n\n" + question + " " + answer_prefix``
    #: (LongBench: ``"\n"`` before the prefix); None for an example made without the split
    context: str | None = None
    question: str | None = None
    answer_prefix: str | None = None

    def score(self, output: str) -> bool:
        if self.meta.get("match") == "any":  # LongBench: any one of the reference answers
            return any(score_exact(output, [a]) for a in self.answers)
        return score_exact(output, self.answers)


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s).strip().lower()


def score_exact(output: str, answers) -> bool:
    """True when every expected answer occurs in ``output`` (normalized)."""
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise ValueError("answers must not be empty")
    out = _norm(output)
    return all(_norm(str(a)) in out for a in answers)


class _Budget:
    """Token counting with the model's tokenizer, or 4 characters per token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return max(1, len(text) // 4)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def cut(self, text: str, tokens: int) -> str:
        if tokens <= 0:
            return ""
        if self.tokenizer is None:
            return text[: 4 * tokens]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        return self.tokenizer.decode(ids)


def _split_sentences(text: str) -> list:
    parts = re.split(r"(?<=[.!?])\s+", text)
    return [p for p in parts if p.strip()]


def _haystack_with(facts: list, tokens: int, budget: _Budget, rng: np.random.Generator, text: str) -> str:
    """Real text of about ``tokens`` tokens with ``facts`` inserted at random sentence boundaries."""
    fact_tokens = sum(budget.count(f) + 1 for f in facts)
    start = int(rng.integers(0, max(1, len(text) - 8 * tokens)))
    filler = budget.cut(text[start:start + 8 * tokens], max(0, tokens - fact_tokens))
    sentences = _split_sentences(filler)
    if not sentences:
        sentences = [filler]
    slots = np.sort(rng.integers(0, len(sentences) + 1, size=len(facts)))
    out, j = [], 0
    for i in range(len(sentences) + 1):
        while j < len(facts) and slots[j] == i:
            out.append(facts[j])
            j += 1
        if i < len(sentences):
            out.append(sentences[i])
    return " ".join(out)


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _hex(rng, n=8) -> str:
    return "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, size=n))


def _example(task, context, question, answer_prefix, answers, tokens, meta) -> Example:
    """An example whose prompt is ``context``, a blank line, ``question`` and the answer's lead-in."""
    return Example(task, f"{context}\n\n{question} {answer_prefix}", answers, tokens, meta, context, question,
                   answer_prefix)


def _make(task: str, rng: np.random.Generator, tokens: int, budget: _Budget, text: str) -> Example:
    if task in ("niah_single", "niah_multikey", "multikey_retrieval"):
        n_keys = {"niah_single": 1, "niah_multikey": 4, "multikey_retrieval": 4}[task]
        if task == "multikey_retrieval":
            stem = str(rng.choice(_KEY_WORDS))
            keys = [f"{stem}-{int(x)}" for x in rng.choice(90, size=n_keys, replace=False) + 10]
        else:
            keys = [str(k) for k in rng.choice(_KEY_WORDS, size=n_keys, replace=False)]
        values = [_number(rng) for _ in keys]
        facts = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, values)]
        ask = int(rng.integers(n_keys))
        question = f"What is the special magic number for {keys[ask]} mentioned in the text above?"
        body = _haystack_with(facts, tokens - budget.count(question) - 8, budget, rng, text)
        return _example(task, body, question, f"The special magic number for {keys[ask]} is:", [values[ask]],
                        tokens, {"keys": keys, "asked": keys[ask]})
    if task == "variable_tracking":
        names = ["".join(chr(65 + c) for c in rng.integers(0, 26, size=5)) for _ in range(4)]
        value = str(int(rng.integers(10_000, 100_000)))
        facts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        question = f"Find all variables that are assigned the value {value} in the text above."
        body = _haystack_with(facts, tokens - budget.count(question) - 12, budget, rng, text)
        return _example(task, body, question, "Answer: the variables are", names, tokens, {"value": value})
    if task == "common_words":
        common = [str(w) for w in rng.choice(_FILLER_WORDS, size=3, replace=False)]
        rare = [w for w in _FILLER_WORDS if w not in common]
        question = "What are the 3 most common words in the list above?"
        words, text_words = [], ""
        target = tokens - budget.count(question) - 12
        while budget.count(text_words) < target:
            block = list(common) * 6 + [str(w) for w in rng.choice(rare, size=12)]
            rng.shuffle(block)
            words += block
            text_words = " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return _example(task, f"Here is a list of words.\n{text_words}", question,
                        "Answer: the most common words are", common, tokens, {})
    if task == "kv_retrieval":
        pairs, block = [], ""
        question_stub = "What is the value of the key"
        target = tokens - 40
        while budget.count(block) < target:
            pairs.append((_hex(rng), _hex(rng)))
            block = "\n".join(f'"{k}": "{v}"' for k, v in pairs)
        k, v = pairs[int(rng.integers(len(pairs)))]
        return _example(task, f"JSON data:\n{{\n{block}\n}}", f"{question_stub} \"{k}\" in the JSON data above?",
                        f"The value of \"{k}\" is:", [v], tokens, {"pairs": len(pairs)})
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def make_examples(task: str, count: int, *, context_tokens: int, seed: int = 0, tokenizer=None) -> list:
    """``count`` seeded examples of ``task`` at about ``context_tokens`` tokens each."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if context_tokens < 64:
        raise ValueError(f"context_tokens must be >= 64, got {context_tokens}")
    rng = np.random.default_rng([seed, TASKS.index(task)])
    text = haystack_text(seed)
    budget = _Budget(tokenizer)
    return [_make(task, rng, context_tokens, budget, text) for _ in range(count)]


def load_longbench(path, *, limit: int | None = None) -> list:
    """Examples from a LongBench JSONL file the user already has (fields
    ``context``, ``input``, ``answers``); nothing is downloaded."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no LongBench file at {path}")
    out = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(out) >= limit:
                break
            rec = json.loads(line)
            for key in ("context", "input", "answers"):
                if key not in rec:
                    raise ValueError(f"{path}: a record lacks the field {key!r}")
            prompt = f"{rec['context']}\n\n{rec['input']}\nAnswer:"
            out.append(Example(rec.get("dataset", "longbench"), prompt, list(rec["answers"]),
                               rec.get("length", 0), {"match": "any"}, rec["context"], rec["input"], "Answer:"))
    return out
