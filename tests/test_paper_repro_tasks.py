"""Task generators and scorers of paper_repro (no model needed)."""

import json

import pytest

from paper_repro import tasks as T


@pytest.mark.parametrize("task", T.TASKS)
def test_examples_are_seeded_and_contain_their_answers(task):
    a = T.make_examples(task, 3, context_tokens=400, seed=1)
    b = T.make_examples(task, 3, context_tokens=400, seed=1)
    c = T.make_examples(task, 3, context_tokens=400, seed=2)
    assert [e.prompt for e in a] == [e.prompt for e in b]
    assert [e.prompt for e in a] != [e.prompt for e in c]
    for e in a:
        assert e.task == task and e.answers
        # the facts are in the context (before the question), so the task is solvable
        for ans in e.answers:
            assert ans.lower() in e.prompt.lower()
        # the prompt scores itself as correct and an empty answer as wrong
        assert e.score(e.prompt) and not e.score("")
        # about the asked length (4 characters per token without a tokenizer)
        assert 0.6 * 400 <= len(e.prompt) / 4 <= 1.5 * 400
        # the query-agnostic split: the context holds every answer, the question and lead-in none
        assert e.prompt == f"{e.context}\n\n{e.question} {e.answer_prefix}"
        assert all(ans.lower() in e.context.lower() for ans in e.answers)
        assert e.question and e.answer_prefix and not any(
            ans.lower() in (e.question + e.answer_prefix).lower() for ans in e.answers if len(ans) > 4)


def test_needle_is_inside_real_text():
    (e,) = T.make_examples("niah_single", 1, context_tokens=1000, seed=0)
    before, _, after = e.prompt.partition("The special magic number for")
    assert len(before) > 100 or len(after) > 100


def test_common_words_are_most_frequent():
    (e,) = T.make_examples("common_words", 1, context_tokens=600, seed=3)
    words = [w for w in e.prompt.split() if w.isalpha()]
    counts = {w: words.count(w) for w in set(words)}
    for w in e.answers:
        others = [c for x, c in counts.items() if x not in e.answers and x in T._FILLER_WORDS]
        assert counts[w] > max(others)


def test_variable_tracking_chain():
    (e,) = T.make_examples("variable_tracking", 1, context_tokens=500, seed=4)
    value = e.meta["value"]
    assert f"VAR {e.answers[0]} = {value}." in e.prompt
    for prev, name in zip(e.answers, e.answers[1:]):
        assert f"VAR {name} = VAR {prev}." in e.prompt


def test_score_exact():
    assert T.score_exact("The number is 1234567.", ["1234567"])
    assert T.score_exact("A, b and C", ["a", "B", "c"])
    assert not T.score_exact("A and B", ["a", "b", "c"])
    with pytest.raises(ValueError, match="answers"):
        T.score_exact("x", [])


@pytest.mark.parametrize("kw, match", [
    (dict(task="nope", count=1, context_tokens=100), "task"),
    (dict(task="niah_single", count=0, context_tokens=100), "count"),
    (dict(task="niah_single", count=1, context_tokens=10), "context_tokens"),
])
def test_make_examples_errors(kw, match):
    task = kw.pop("task")
    with pytest.raises(ValueError, match=match):
        T.make_examples(task, **kw)


def test_load_longbench(tmp_path):
    p = tmp_path / "qa.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [
        {"context": "ctx one", "input": "q1?", "answers": ["alpha", "beta"], "dataset": "qa"},
        {"context": "ctx two", "input": "q2?", "answers": ["gamma"]},
    ]))
    ex = T.load_longbench(p)
    assert len(ex) == 2 and ex[0].task == "qa"
    assert (ex[0].context, ex[0].question, ex[0].answer_prefix) == ("ctx one", "q1?", "Answer:")
    assert ex[0].score("it is beta") and not ex[0].score("delta")
    assert len(T.load_longbench(p, limit=1)) == 1
    with pytest.raises(FileNotFoundError):
        T.load_longbench(tmp_path / "missing.jsonl")
