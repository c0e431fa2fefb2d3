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


# ------------------------------------------------------------------ bootstrap intervals of T3 / T4

from math import erf, sqrt  # noqa: E402

import numpy as np  # noqa: E402

from paper_repro import bootstrap as BS  # noqa: E402


def _Phi(x):
    return 0.5 * (1 + erf(x / sqrt(2)))


def _paired_runs(n, rng, *, mu_a=1.0, mu_b=1.6, p=0.4, rho=0.6, keep=0.8, task="t", budget=0.5):
    """Records of one cell with two presses on the same n examples: press a fails with probability p,
    press b with the same failure as a with probability keep (else afresh), scores N(mu * failed, 1) with
    noise correlation rho between the presses. Each AUC is Phi(mu / sqrt 2) exactly (the score's law given
    the failure does not depend on the other press), so the true paired difference is known."""
    fa = rng.random(n) < p
    fb = np.where(rng.random(n) < keep, fa, rng.random(n) < p)
    ea = rng.normal(size=n)
    eb = rho * ea + sqrt(1 - rho ** 2) * rng.normal(size=n)
    out = []
    for i in range(n):
        out += [dict(task=task, example=i, method="full", budget=1.0, correct=True, cert=float("nan"), conf=0.0),
                dict(task=task, example=i, method="poisson", budget=budget, correct=not fa[i],
                     cert=mu_a * fa[i] + ea[i], conf=0.0),
                dict(task=task, example=i, method="poisson_tilted", budget=budget, correct=not fb[i],
                     cert=mu_b * fb[i] + eb[i], conf=0.0)]
    return out, _Phi(mu_b / sqrt(2)) - _Phi(mu_a / sqrt(2))


def _suite_records(n=12, seed=0, copy_default=False):
    """Records shaped as suites.collect writes them: 2 tasks x n examples, full, the four presses at three
    budgets and the streaming runs; with copy_default the tilted runs are the paper design's, verbatim."""
    rng = np.random.default_rng(seed)
    recs = []
    for task in ("a", "b"):
        for i in range(n):
            full = bool(rng.random() < 0.85)
            recs.append(dict(protocol="query-aware", task=task, example=i, method="full", budget=1.0,
                             correct=full, cert=float("nan"), conf=float(rng.normal()), cert_median=float("nan")))
            for b in (0.1, 0.25, 0.5):
                runs = {}
                for m in ("poisson", "poisson_cluster", "poisson_tilted", "snapkv"):
                    ok = bool(full and rng.random() < b + 0.25)
                    z = float(rng.normal())
                    runs[m] = dict(protocol="query-aware", task=task, example=i, method=m, budget=b, correct=ok,
                                   cert=z + (not ok), conf=float(rng.normal()), cert_median=z)
                if copy_default:
                    runs["poisson_tilted"] = dict(runs["poisson"], method="poisson_tilted")
                recs += runs.values()
            ok = bool(full and rng.random() < 0.3)
            recs.append(dict(protocol="query-aware", task=task, example=i, method="poisson_stream", budget=0.25,
                             correct=ok, cert=float(rng.normal()) + (not ok), conf=float(rng.normal()),
                             cert_median=0.0))
    return recs


def test_weighted_auc_at_unit_weights_is_suites_auc():
    """The weighted AUC at w = 1 is suites.auc exactly (ties, -inf and NaN scores included), and at
    integer weights it is suites.auc of the list with each item repeated w times."""
    from paper_repro.suites import auc

    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(2, 30))
        s = rng.integers(0, 5, size=n).astype(float)  # many ties
        s[rng.random(n) < 0.1] = -np.inf
        s[rng.random(n) < 0.1] = np.nan
        pos = rng.random(n) < 0.5
        got = BS.weighted_auc(s, pos, np.ones((1, n)))[0]
        want = auc(s, pos)
        assert (np.isnan(got) and np.isnan(want)) or got == want
        idx = rng.integers(0, n, size=n)
        w = BS.weights_of(idx[None, :], n)
        got = BS.weighted_auc(s, pos, w)[0]
        want = auc(s[idx], pos[idx])
        assert (np.isnan(got) and np.isnan(want)) or abs(got - want) < 1e-12


def test_resamples_are_stratified_seeded_and_paired():
    idx = BS.resample_indices([3, 5], resamples=200, seed=7)
    assert idx.shape == (200, 8)
    assert idx[:, :3].min() >= 0 and idx[:, :3].max() <= 2 and idx[:, 3:].min() >= 3 and idx[:, 3:].max() <= 7
    assert np.array_equal(idx, BS.resample_indices([3, 5], resamples=200, seed=7))
    assert not np.array_equal(idx, BS.resample_indices([3, 5], resamples=200, seed=8))
    assert np.array_equal(BS.weights_of(idx, 8).sum(axis=1), np.full(200, 8.0))


def test_point_estimates_are_the_tables():
    """At unit weights the bootstrap's statistics are Table 3's and Table 4's own numbers: T3's paired
    differences are the differences of the table's columns, T4's values the claims' headline figures."""
    from paper_repro import claims, report, suites
    from paper_repro.common import Config

    recs = _suite_records()
    cfg = Config(quick=True, progress=False)
    t3 = BS.with_intervals(suites.table(recs, cfg), recs, resamples=200)
    for row in t3.rows:
        assert row["acc_diff_vs_paper"] == pytest.approx(row["acc_poisson_tilted"] - row["acc_poisson"], abs=1e-12)
        if np.isfinite(row["auc_certificate"]) and np.isfinite(row["auc_certificate_tilted"]):
            assert row["auc_certificate_diff_vs_paper"] == pytest.approx(
                row["auc_certificate_tilted"] - row["auc_certificate"], abs=1e-12)
            assert row["auc_certificate_ci_low"] <= row["auc_certificate_ci_high"]
        assert 0 <= row["acc_poisson_ci_low"] <= row["acc_poisson_ci_high"] <= 1
        assert row["acc_diff_ci_low"] <= row["acc_diff_ci_high"]
    assert any("not a finding" in n for n in t3.notes)
    header = t3.markdown().split("\n")[2]  # the CSV has every interval, the Markdown the paired differences
    assert "acc_diff_vs_paper" in header and "acc_diff_ci_low" in header and "acc_poisson_ci_low" not in header
    assert "acc_poisson_ci_low" in t3.columns and "acc_poisson" in header
    t4, head = claims.run(recs, cfg)
    rows = {r["claim"]: r for r in t4.rows}
    assert rows["attribution"]["value"] == pytest.approx(head["attribution_auc"], abs=1e-12)
    assert rows["recompute"]["value"] == pytest.approx(head["recompute_gain_points"], abs=1e-9)
    assert rows["recompute:tilted"]["value"] == pytest.approx(head["recompute_gain_points_tilted"], abs=1e-9)
    assert rows["attribution:tilted"]["diff_vs_paper"] == pytest.approx(
        head["attribution_auc_tilted"] - head["attribution_auc"], abs=1e-12)
    assert rows["recompute:tilted"]["diff_vs_paper"] == pytest.approx(
        head["recompute_gain_points_tilted"] - head["recompute_gain_points_prefill"], abs=1e-9)
    assert rows["nearly_free"]["value"] is None and set(rows["nearly_free"]) == set(rows["attribution"])
    s = report.summary({"T3": t3, "T4": t4}, cfg, {"T4": head, "suites": recs})
    t3s = s["sketch_t3"]
    assert t3s["acc_poisson_tilted_diff"] == pytest.approx(t3s["acc_poisson_tilted"] - t3s["acc_poisson"], abs=1e-12)
    assert t3s["auc_certificate_tilted_diff"] == pytest.approx(
        t3s["auc_certificate_tilted"] - t3s["auc_certificate"], abs=1e-12)
    text = "\n".join(report._sketch_payoff(s))
    assert "tilted minus paper, paired [95% interval]" in text and "is not a finding" in text
    lo, hi = t3s["auc_certificate_tilted_diff_ci"]
    assert f"{t3s['auc_certificate_tilted_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]" in text


def test_identical_presses_differ_by_exactly_zero():
    """Paired: when the default design's runs are the paper design's, every resample sees the same
    examples for both, so each difference is exactly 0 with a zero-width interval."""
    from paper_repro import claims
    from paper_repro.common import Config

    recs = _suite_records(copy_default=True)
    for row in BS.t3_cells(recs, resamples=300).values():
        assert row["acc_diff_vs_paper"] == row["acc_diff_ci_low"] == row["acc_diff_ci_high"] == 0.0
        if np.isfinite(row["auc_certificate_diff_vs_paper"]):
            assert row["auc_certificate_diff_ci_low"] == row["auc_certificate_diff_ci_high"] == 0.0
    means = BS.t3_means(recs, resamples=300)
    for key in ("acc_poisson_tilted", "auc_certificate_tilted"):
        assert means[f"{key}_diff"] == 0.0 and means[f"{key}_diff_ci"] == [0.0, 0.0]
    t4 = {r["claim"]: r for r in claims.run(recs, Config(quick=True, progress=False))[0].rows}
    for claim in ("attribution:tilted", "recompute:tilted"):
        assert t4[claim]["diff_vs_paper"] == t4[claim]["diff_ci_low"] == t4[claim]["diff_ci_high"] == 0.0
    # the cluster design's runs differ: its difference is not identically 0
    assert t4["attribution:cluster"]["diff_ci_low"] < t4["attribution:cluster"]["diff_ci_high"]


def test_interval_covers_the_true_auc_difference_at_the_nominal_rate():
    """Over S simulated suites (one cell, n examples, two presses with known AUCs), Table 3's paired
    interval for auc_certificate_diff_vs_paper covers the true difference in about 95% of them. The count
    is Binomial(S, 0.95) for an exact interval: tolerance 3 standard errors, 3 sqrt(0.95 0.05 / S) = 0.038
    at S = 300 (the percentile bootstrap's own coverage error at this n, measured at S = 1000, is inside it)."""
    S, n, level = 300, 60, BS.LEVEL
    rng = np.random.default_rng(11)
    hits = 0
    for s in range(S):
        recs, truth = _paired_runs(n, rng)
        row = BS.t3_cells(recs, seed=s)["query-aware", "t", 0.5]
        hits += row["auc_certificate_diff_ci_low"] <= truth <= row["auc_certificate_diff_ci_high"]
    se = sqrt(level * (1 - level) / S)
    assert abs(hits / S - level) <= 3 * se, f"coverage {hits / S:.3f}, nominal {level}, 3 SE = {3 * se:.3f}"


def test_interval_shrinks_with_more_examples():
    """The interval's width goes as 1 / sqrt(n): from n to 4n examples the mean width over k suites halves.
    Tolerance: 4 standard errors of the ratio of means, from the widths' own spread."""
    k, n = 20, 40
    rng = np.random.default_rng(5)
    widths = {}
    for m in (n, 4 * n):
        w = []
        for s in range(k):
            row = BS.t3_cells(_paired_runs(m, rng)[0], resamples=400, seed=s)["query-aware", "t", 0.5]
            w.append(row["auc_certificate_diff_ci_high"] - row["auc_certificate_diff_ci_low"])
        widths[m] = np.array(w)
    a, b = widths[n], widths[4 * n]
    ratio = b.mean() / a.mean()
    rel_se = sqrt((a.std(ddof=1) / a.mean()) ** 2 / k + (b.std(ddof=1) / b.mean()) ** 2 / k)
    assert b.max() < a.mean()
    assert abs(ratio - 0.5) <= 4 * rel_se * ratio, f"width ratio {ratio:.3f}, expected 0.5 +- {4 * rel_se * ratio:.3f}"


def test_percentile_interval_rules():
    x = np.arange(1001, dtype=float) / 1000
    assert BS.percentile_interval(x) == pytest.approx((0.025, 0.975))
    half = np.where(np.arange(1000) < 499, np.nan, 1.0)  # 501 of 1000 defined: reported
    assert BS.percentile_interval(half) == (1.0, 1.0)
    assert np.isnan(BS.percentile_interval(np.where(np.arange(1000) < 501, np.nan, 1.0))).all()
    for kw, match in ((dict(samples=[]), "samples"), (dict(samples=[1.0], level=1.0), "level"),
                      (dict(samples=[1.0], min_defined=2), "min_defined")):
        with pytest.raises(ValueError, match=match):
            BS.percentile_interval(**kw)
    with pytest.raises(ValueError, match="sizes"):
        BS.resample_indices([0, 3])
