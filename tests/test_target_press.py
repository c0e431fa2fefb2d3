"""PoissonPress(target_error=eps): the error-targeted budget wired into the Hugging Face press.

The rule itself (``kvcert.fast.target_budget``, its NumPy twin and its Monte-Carlo honesty) is tested
in test_fast_target.py; here: the press runs without a ratio (the contract), each (layer, row, KV head)
keeps the per-head budget the rule chose on that layer's prefill inputs (the Poisson kept count
within a derived band of the chosen expected count), the record carries the target
(``Certificates.exceeds``, ``summary()``'s kept fraction) and misuse is refused by name. A tiny
random-weight Llama (model_fixtures.tiny_family_model: 2 layers, 2 KV heads of dim 16) and one run
of ``kvcert.generate`` on the default model.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from model_fixtures import forced_logits, long_prompt, model_sdpa, smollm2, tiny_family_model  # noqa: F401

import kvcert
import kvcert.fast.target as T

PROMPT = 300


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_family_model("llama")


def _ids(seed: int, n: int = PROMPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def _spy_targets(monkeypatch) -> list:
    """Record each call of kvcert.fast.target.target_budget (what the press's design calls) and its result."""
    calls = []
    original = T.target_budget

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(T, "target_budget", spy)
    return calls


def _run(press, steps: int = 3):
    return forced_logits(_model(), _ids(1), _ids(2, steps)[0], press)


def test_target_press_runs_without_a_ratio_and_keeps_the_chosen_budgets(monkeypatch):
    """The contract: PoissonPress(target_error=0.1, delta=0.05, seed=0) runs without compression_ratio.
    Each layer's prefill event asks the rule once, with the press's design (eps, delta, kind, certainty
    set); each evicting head's kept count at step 1 (the compressed prompt plus one token) is the Poisson
    sample at the chosen expected count B*: |kept - 1 - B*| <= 5 sqrt(B*) (Var kept = sum pi (1 - pi) <= B*,
    a 5-sigma band over the 4 (layer, head) pairs); the rule's prediction is at most the target."""
    calls = _spy_targets(monkeypatch)
    press = kvcert.PoissonPress(target_error=0.1, delta=0.05, seed=0)
    assert press.compression_ratio == 0.0 and press.target_size is None
    assert press.sketch is None and press.kind == "chebyshev"  # an error target runs the paper's design
    _run(press)
    certs = press.certificates[0]
    config = _model().config
    assert len(calls) == config.num_hidden_layers
    evicting = 0
    for layer, (args, kwargs, chosen) in enumerate(calls):
        assert args[4] == 0.1 and kwargs["delta"] == 0.05 and kwargs["kind"] == "chebyshev"
        assert (kwargs["sinks"], kwargs["window"]) == (press.sinks, press.window)
        assert press.chosen_budgets[(layer, 0)] is chosen
        for h in range(config.num_key_value_heads):
            kept = int(certs.kept[1, layer, h * 2])  # query heads 2h, 2h + 1 read KV head h
            if bool(chosen.evicts[0, h]):
                evicting += 1
                b = float(chosen.sampled[0, h])
                assert float(chosen.predicted[0, h]) <= 0.1
                assert abs(kept - 1 - b) <= 5 * math.sqrt(b), (layer, h, kept, b)
            else:
                assert kept == PROMPT + 1
    assert evicting > 0, "the target evicted somewhere (else this test checks nothing)"


def test_the_record_carries_the_target():
    """``Certificates.target_error``, ``exceeds()`` (relative radius > eps, never at the exact prefill)
    and ``summary()``: the kept fraction (the compressed prompt's share, from the record's kept counts)
    and the fraction of decode certificates above the target."""
    press = kvcert.PoissonPress(target_error=0.1, seed=0)
    _run(press, steps=4)
    certs = press.certificates[0]
    assert certs.target_error == 0.1
    over = certs.exceeds()
    assert torch.equal(over, certs.relative_radius > 0.1) and not bool(over[0].any())
    assert torch.equal(certs.exceeds(0.5), certs.relative_radius > 0.5)
    s = certs.summary()
    assert s["target_error"] == 0.1 and s["decode_steps"] == 4
    expected = float(((certs.kept[1].double() - 1) / PROMPT).mean())
    assert s["kept_fraction"] == pytest.approx(expected) and 0 < s["kept_fraction"] < 1
    assert s["fraction_over_target"] == pytest.approx(float(over[1:].double().mean()))


def test_a_smaller_target_keeps_more():
    """The same prompt and seed: every head's chosen budget at eps = 0.03 is at least its budget at
    eps = 0.3 (the predicted radius is non-increasing in B on these heads, so the smallest budget meeting a
    smaller target is larger), and the mean is strictly larger (negative control: the target matters)."""
    budgets = {}
    for eps in (0.03, 0.3):
        press = kvcert.PoissonPress(target_error=eps, seed=0)
        _run(press, steps=1)
        budgets[eps] = torch.stack([press.chosen_budgets[(layer, 0)].budget[0] for layer in range(2)])
    assert bool((budgets[0.03] >= budgets[0.3]).all())
    assert float(budgets[0.03].mean()) > float(budgets[0.3].mean())


def test_extreme_targets():
    """A target no budget can miss keeps the certainty set and one sampled token's worth (B* = sinks +
    window + 1); a target below any eviction's prediction keeps everything (radius 0 at every step)."""
    loose = kvcert.PoissonPress(target_error=1e6, seed=0)
    _run(loose, steps=1)
    for layer in range(2):
        assert bool((loose.chosen_budgets[(layer, 0)].budget == loose.sinks + loose.window + 1).all())
    tight = kvcert.PoissonPress(target_error=1e-12, seed=0)
    _run(tight, steps=2)
    certs = tight.certificates[0]
    assert torch.count_nonzero(certs.radius) == 0 and bool((certs.kept[1] == PROMPT + 1).all())


@pytest.mark.parametrize("kwargs, words", [
    (dict(target_error=0.0), "target_error must be a finite float > 0"),
    (dict(target_error=float("nan")), "target_error must be a finite float > 0"),
    (dict(target_error="0.1"), "target_error must be a finite float > 0"),
    (dict(target_error=0.1, compression_ratio=0.5), "give one of compression_ratio, target_size or target_error"),
    (dict(target_error=0.1, target_size=64), "give one of compression_ratio, target_size or target_error"),
    (dict(target_error=0.1, sketch="tilted"), "sketch: a target_error"),
    (dict(target_error=0.1, kind="chi2"), "kind: a target_error"),
])
def test_bad_targets_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError, match=words):
        kvcert.PoissonPress(**kwargs)


def test_decoding_press_and_exceeds_without_a_target_are_refused():
    with pytest.raises(ValueError, match="target_error"):
        kvcert.DecodingPress(kvcert.PoissonPress(target_error=0.1), compression_interval=4, target_size=64)
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None)
    _run(press, steps=1)
    with pytest.raises(ValueError, match="no target_error"):
        press.certificates[0].exceeds()
    with pytest.raises(ValueError, match="target must be a finite float > 0"):
        press.certificates[0].exceeds(0.0)


def test_generate_summary_reports_the_kept_fraction(model_sdpa):
    """On the default model through kvcert.generate: ``result.certificates.summary()`` has the target and the
    kept fraction chosen (below 1: the target evicted), and every recorded radius is finite."""
    model, tok = model_sdpa
    press = kvcert.PoissonPress(target_error=0.2, delta=0.05, seed=0)
    res = kvcert.generate(model, tok, long_prompt(1500), press=press, max_new_tokens=3)
    s = res.certificates.summary()
    assert s["target_error"] == 0.2 and 0 < s["kept_fraction"] < 1
    assert bool(torch.isfinite(res.certificates.radius).all())


def test_escalation_reruns_until_no_step_exceeds_the_target(model_sdpa, monkeypatch):
    """generate(..., escalate=...). On the default model the per-step mean relative radius of a
    target-chosen cache stays below the target (0.58-0.85 eps at eps 0.02-0.5 on long_prompt(1500),
    measured 2026-12-05), so the flag is forced: ``Certificates.per_step`` is scaled up 100x for the first
    ``flagged[0]`` runs. "full": one re-run, uncompressed (the plain model's tokens, no certificates);
    "tighten": the target halved 3 times (each re-run recorded), then uncompressed when every run is
    flagged, or it stops at the first run that is not; unscaled, a run is not re-run."""
    from kvcert.records import Certificates

    model, tok = model_sdpa
    prompt = long_prompt(600)
    flagged = [0]
    original = Certificates.per_step

    def scaled(self):
        if flagged[0] > 0:
            flagged[0] -= 1
            return original(self) * 100.0
        return original(self)

    monkeypatch.setattr(Certificates, "per_step", scaled)
    plain = kvcert.generate(model, tok, prompt, max_new_tokens=2)
    press = kvcert.PoissonPress(target_error=0.1, seed=0)
    once = kvcert.generate(model, tok, prompt, press, max_new_tokens=2, escalate="full")
    assert once.escalations == [] and once.certificates is not None
    assert bool((original(once.certificates)[1:] <= 0.1).all())  # the unforced run meets the target
    flagged[0] = 1
    full = kvcert.generate(model, tok, prompt, press, max_new_tokens=2, escalate="full")
    assert len(full.escalations) == 1 and full.escalations[0]["step"] == 1 and full.escalations[0]["press"] == "none"
    assert full.escalations[0]["mean_relative_radius"] > 0.1
    assert full.certificates is None and full.token_ids == plain.token_ids
    assert full.summary()["escalations"] == full.escalations
    flagged[0] = 4
    tight = kvcert.generate(model, tok, prompt, press, max_new_tokens=2, escalate="tighten")
    targets = [e["press"] for e in tight.escalations]
    assert len(targets) == 4 and targets[-1] == "none" and tight.token_ids == plain.token_ids
    for eps, text in zip((0.05, 0.025, 0.0125), targets):
        assert f"target_error={eps}" in text
    flagged[0] = 2
    tight = kvcert.generate(model, tok, prompt, press, max_new_tokens=2, escalate="tighten")
    assert [e["target_error"] for e in tight.escalations] == [0.1, 0.1]  # flags read the user's target
    assert tight.certificates is not None and tight.certificates.target_error == 0.025


def test_escalation_is_refused_without_a_target(model_sdpa):
    model, tok = model_sdpa
    with pytest.raises(ValueError, match="escalate: needs a press with an error target"):
        kvcert.generate(model, tok, "Hi", kvcert.PoissonPress(compression_ratio=0.5), escalate="full")
    with pytest.raises(ValueError, match="escalate must be None or one of"):
        kvcert.generate(model, tok, "Hi", kvcert.PoissonPress(target_error=0.1), escalate="always")
    with pytest.raises(ValueError, match="escalate: one prompt at a time"):
        kvcert.generate(model, tok, ["Hi", "Ho"], kvcert.PoissonPress(target_error=0.1), escalate="full")


def test_a_batch_row_chooses_what_it_chooses_alone(model_sdpa):
    """Left-padded batch rows of different lengths: each row's chosen budgets, kept counts and tokens are
    those of the same prompt run alone (the target is solved per row on its real tokens)."""
    model, tok = model_sdpa
    prompts = [long_prompt(600), long_prompt(1200)]
    press = kvcert.PoissonPress(target_error=0.2, seed=0)
    batch = kvcert.generate(model, tok, prompts, press=press, max_new_tokens=2)
    chosen = dict(press.chosen_budgets)
    for i, p in enumerate(prompts):
        alone_press = kvcert.PoissonPress(target_error=0.2, seed=0)
        alone = kvcert.generate(model, tok, p, press=alone_press, max_new_tokens=2)
        assert alone.token_ids == batch.token_ids[i]
        assert torch.equal(alone.certificates.kept[1], batch.certificates[i].kept[1])
        for layer in (0, 15, 29):
            assert torch.equal(alone_press.chosen_budgets[(layer, 0)].budget, chosen[(layer, i)].budget)
