"""kvcert.calibration: conformal risk control of certificate escalation (issue 55 item 4).

The guarantee is an expectation over exchangeable (calibration set, new prompt) draws, so it is checked by
simulation where the risk of a chosen threshold is known in closed form: signals U(0, 1), and a new prompt's
risk at threshold t is P(d = 1, s < t). Each check compares the mean over R calibrations with its bound within
4 standard errors of that mean (its own sample standard deviation / sqrt(R)); the negative controls are the
rule without the finite-sample correction (risk (k' + 1) / (n + 1) with k' = floor(alpha n)), which the same
test rejects.
"""

import json
import math

import numpy as np
import pytest

from kvcert.calibration import (EscalationPolicy, calibrate_budget, calibrate_escalation, escalation_signal,
                                largest_escalation_rank)
from model_fixtures import SHORT_PROMPT, long_prompt, model_sdpa, smollm2  # noqa: F401  (smollm2: model_sdpa needs it)

R = 4000  # calibrations per simulation
Z = 4.0  # standard errors allowed


def _mean_and_se(x):
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def _uncorrected(signals, differs, alpha):
    """The rule that ignores the finite-sample term: empirical risk <= alpha (k' = floor(alpha n))."""
    bad = sorted(s for s, d in zip(signals, differs) if d)
    k = math.floor(alpha * len(signals))
    return bad[k] if k < len(bad) else math.inf


def _risks_all_differ(rule, n, alpha, seed=0):
    """Risk of each of R calibrations when every prompt differs: P(s_new < t) = t for U(0, 1) signals."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(R):
        s = rng.random(n)
        t = rule(s, [True] * n, alpha)
        out.append(min(max(t, 0.0), 1.0))
    return out


def test_risk_is_exactly_k_plus_one_over_n_plus_one_when_every_answer_differs():
    """n = 20, alpha = 0.1: k = floor(2.1) - 1 = 1, risk 2 / 21 = 0.095 <= alpha."""
    n, alpha = 20, 0.1
    k = largest_escalation_rank(n, alpha)
    assert k == 1
    mean, se = _mean_and_se(_risks_all_differ(calibrate_escalation, n, alpha))
    assert abs(mean - (k + 1) / (n + 1)) <= Z * se, (mean, se)
    assert mean <= alpha + Z * se


def test_negative_control_the_uncorrected_rule_breaks_alpha():
    """Without the correction (k' = 2 at n = 20) the risk is 3 / 21 = 0.143: the same check rejects it."""
    n, alpha = 20, 0.1
    mean, se = _mean_and_se(_risks_all_differ(_uncorrected, n, alpha))
    assert abs(mean - 3 / 21) <= Z * se
    assert mean > alpha + Z * se, (mean, se)


def test_risk_at_most_alpha_when_differing_answers_have_larger_signals():
    """d ~ Bernoulli(s), s ~ U(0, 1): a new prompt's risk at t is the integral of s over [0, t], t^2 / 2; the
    rule meets alpha and escalates fewer than every request."""
    rng = np.random.default_rng(1)
    n, alpha = 50, 0.1
    risks, escalated = [], []
    for _ in range(R):
        s = rng.random(n)
        d = rng.random(n) < s
        t = min(max(calibrate_escalation(s, d, alpha), 0.0), 1.0)
        risks.append(t * t / 2)
        escalated.append(1 - t)
    mean, se = _mean_and_se(risks)
    assert mean <= alpha + Z * se, (mean, se)
    assert np.mean(escalated) < 0.9  # a lever, not "always escalate"


def test_budget_calibration_meets_alpha_and_its_negative_control_fails():
    """The fixed-budget baseline (kvcalib's shape): d_i(b) = 1[u_i > b], u ~ U(0, 1); at budget b the risk is
    1 - b; the chosen grid budget meets alpha, the uncorrected choice does not (n = 20, alpha = 0.1)."""
    rng = np.random.default_rng(2)
    n, alpha, grid = 20, 0.1, [float(b) for b in np.linspace(0.5, 0.995, 100)]
    ok, bad = [], []
    for _ in range(R // 2):
        u = rng.random(n)
        table = u[:, None] > np.asarray(grid)[None, :]
        chosen = calibrate_budget(grid, table.tolist(), alpha)
        ok.append(1.0 - (1.0 if chosen is None else chosen))
        counts = table.sum(axis=0)
        naive = next((b for b, c in zip(grid, counts) if c <= alpha * n), 1.0)
        bad.append(1.0 - naive)
    mean, se = _mean_and_se(ok)
    assert mean <= alpha + Z * se, (mean, se)
    mean, se = _mean_and_se(bad)
    assert mean > alpha + Z * se, (mean, se)


def test_edges_of_the_rule():
    assert calibrate_escalation([0.3, 0.1], [True, True], 0.2) == -math.inf  # alpha (n + 1) < 1: escalate all
    assert calibrate_escalation([0.3] * 9, [False] * 9, 0.2) == math.inf  # nothing differs: never escalate
    # n = 9, alpha = 0.2: k = 1, the second smallest differing signal
    assert calibrate_escalation([0.5, 0.2, 0.9, 0.4, 0.1, 0.7, 0.3, 0.8, 0.6],
                                [True, False, True, True, False, False, False, True, False], 0.2) == 0.5
    for args, match in [(([0.1], [True, False], 0.1), "one length"), (([float("nan")], [True], 0.1), "NaN"),
                        (([0.1], [True], 1.0), "alpha"), (([0.1], [0.5], 0.1), "booleans"),
                        (([], [], 0.1), "non-empty")]:
        with pytest.raises(ValueError, match=match):
            calibrate_escalation(*args)
    with pytest.raises(ValueError, match="strictly increasing"):
        calibrate_budget([0.5, 0.5], [[True, True]], 0.1)


def test_policy_saves_and_loads(tmp_path):
    for threshold in (0.25, math.inf, -math.inf):
        policy = EscalationPolicy(threshold=threshold, alpha=0.1, n=40, press_fields={"compression_ratio": 0.5},
                                  escalation_rate=0.3, empirical_risk=0.05, max_new_tokens=8)
        assert EscalationPolicy.load(policy.save(tmp_path / "p.json")) == policy
    (tmp_path / "bad.json").write_text(json.dumps({"threshold": 1.0}))
    with pytest.raises(ValueError, match="not a kvcert escalation policy"):
        EscalationPolicy.load(tmp_path / "bad.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="could not be read as JSON"):
        EscalationPolicy.load(tmp_path / "junk.json")
    with pytest.raises(ValueError, match="unknown keys"):
        EscalationPolicy(threshold=1.0, alpha=0.1, n=3, press_fields={"ratio": 0.5})
    with pytest.raises(ValueError, match="alpha"):
        EscalationPolicy(threshold=1.0, alpha=0.0, n=3)


def test_generate_under_a_policy_escalates_at_its_threshold(model_sdpa):
    """threshold -inf: every request is re-run with the full cache (the full cache's tokens, one escalation
    recorded); +inf: served under the policy's press (its tokens, its certificates)."""
    import kvcert

    model, tok = model_sdpa
    fields = {"compression_ratio": 0.5, "seed": 3}
    full = kvcert.generate(model, tok, SHORT_PROMPT, None, 4)
    pressed = kvcert.generate(model, tok, SHORT_PROMPT, kvcert.PoissonPress(**fields), 4)
    always = EscalationPolicy(threshold=-math.inf, alpha=0.1, n=10, press_fields=fields)
    never = EscalationPolicy(threshold=math.inf, alpha=0.1, n=10, press_fields=fields)
    r = kvcert.generate(model, tok, SHORT_PROMPT, max_new_tokens=4, escalate=always)
    assert r.token_ids == full.token_ids and r.certificates is None and len(r.escalations) == 1
    assert r.escalations[0]["signal"] == pytest.approx(escalation_signal(pressed.certificates))
    r = kvcert.generate(model, tok, SHORT_PROMPT, max_new_tokens=4, escalate=never)
    assert r.token_ids == pressed.token_ids and r.escalations == []
    with pytest.raises(ValueError, match="press=None"):
        kvcert.generate(model, tok, SHORT_PROMPT, kvcert.PoissonPress(**fields), 6, escalate=never)


def test_calibrate_on_prompts_meets_its_own_records(model_sdpa):
    """kvcert.calibrate: one record per prompt, the policy's threshold is calibrate_escalation of the records,
    and its reported escalation rate and empirical risk are the records' at that threshold."""
    import kvcert

    model, tok = model_sdpa
    prompts = [long_prompt(chars) for chars in (300, 400, 500)]  # past the sinks and the window
    policy, records = kvcert.calibrate(model, tok, prompts, alpha=0.5, max_new_tokens=3, compression_ratio=0.75)
    assert len(records) == 3 and policy.n == 3 and policy.press_fields == {"compression_ratio": 0.75}
    s, d = [r["signal"] for r in records], [r["differs"] for r in records]
    assert policy.threshold == calibrate_escalation(s, d, 0.5)
    esc = [x >= policy.threshold for x in s]
    assert policy.escalation_rate == sum(esc) / 3
    assert policy.empirical_risk == sum(a and not e for a, e in zip(d, esc)) / 3
    assert all(0 < r["kept_fraction"] < 1 for r in records)


def test_cli_calibrate_writes_a_policy_generate_reads(tmp_path, capsys):
    from kvcert import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps("Name a prime number.") + "\n\n" + json.dumps({"prompt": "Say hello."}) + "\n")
    out = tmp_path / "policy.json"
    assert cli.main(["calibrate", "--prompts", str(prompts), "--alpha", "0.5", "--out", str(out),
                     "--max-new-tokens", "3", "--records", str(tmp_path / "r.json")]) == 0
    policy = EscalationPolicy.load(out)
    assert policy.n == 2 and len(json.loads((tmp_path / "r.json").read_text())) == 2
    assert "policy written to" in capsys.readouterr().out
    assert cli.main(["generate", "--prompt", "Say hello.", "--policy", str(out), "--max-new-tokens", "3",
                     "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"]
    assert cli.main(["generate", "--prompt", "hi", "--policy", str(out), "--seed", "2"]) == 2
    assert "--policy carries its press: drop --seed" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert cli.main(["calibrate", "--prompts", str(tmp_path / "bad.jsonl"), "--alpha", "0.1", "--out", "x"]) == 2
    assert "bad.jsonl:1: not JSON" in capsys.readouterr().err
