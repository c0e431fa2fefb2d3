"""A calibrated escalation policy served by the vLLM plugin: ``kvcert.vllm.generate_with_policy`` (docs/serving.md,
"Calibrated escalation (kvcert calibrate)").

No engine: a stand-in ``vllm.LLM`` (:class:`_StubLLM`) reports, per request, the per-token certificates the test
gives it (token 0 first, as the plugin reports them) and none for a request run uncompressed
(``kvcert_compression_ratio`` 0); its settings are a :class:`kvcert.vllm.KVCertConfig` in the place a certified
engine holds them. The runs themselves (a request's extra_args resolved and served) are the engine's, tested
in test_vllm_requests.py and test_vllm_target.py; here what must hold is the client's part:

- every request's first run carries the policy's press fields as per-request keys, and those keys resolve, by
  ``kvcert.vllm.config.request_options``, to the design of the policy's press (``PoissonPress(**press_fields)``);
- a request's signal is the Hugging Face path's (``kvcert.calibration.escalation_signal`` on a
  ``kvcert.Certificates`` with the same per-step values); those at or over the threshold, and only those, run
  again uncompressed, in one batch; +inf escalates none, -inf all; a saved and loaded policy does the same;
- the report counts the re-runs' prompt and generated tokens;
- bad input is refused by name.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvcert.calibration import POLICY_PRESS_FIELDS, EscalationPolicy, escalation_signal
from kvcert.vllm import KVCertConfig, generate_with_policy
from kvcert.vllm.config import REQUEST_KEYS, request_options
from kvcert.vllm.policy import policy_request_args

MAX_TOKENS = 3
FIELDS = {"compression_ratio": 0.75, "seed": 3, "kind": "chebyshev"}
ARGS = {"kvcert_compression_ratio": 0.75, "kvcert_seed": 3, "kvcert_kind": "chebyshev"}
#: per prompt, the per-token certificates of a compressed run (token 0 first, 0 as the plugin reports it);
#: None: a prompt the design does not sample (no certificates)
CERTS = {"easy": [0.0, 0.1, 0.2], "hard": [0.0, 0.5, 0.1], "edge": [0.0, 0.3, 0.3], "short": None}


class _StubLLM:
    """Stands for a certified ``vllm.LLM``: ``llm_engine.vllm_config.additional_config["kvcert"]`` holds its
    settings; ``generate`` records each request's extra_args and answers ``MAX_TOKENS`` tokens with the
    certificates ``certs[prompt]`` (none when the request ran with ``kvcert_compression_ratio`` 0, or with
    ``error`` as the plugin's refusal)."""

    def __init__(self, certs=None, config=None, error=None):
        self.certs, self.error, self.calls = dict(CERTS if certs is None else certs), error, []
        cfg = (KVCertConfig() if config is None else config).to_dict()
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"kvcert": cfg}))

    def generate(self, prompts, params):
        self.calls.append([(p, dict(sp.extra_args)) for p, sp in zip(prompts, params)])
        outs = []
        for p, sp in zip(prompts, params):
            c = None if sp.extra_args.get("kvcert_compression_ratio") == 0.0 else self.certs[p]
            rep = {"error": self.error} if self.error else (None if c is None else {"granularity": "token",
                                                                                     "certificates": list(c)})
            outs.append(SimpleNamespace(prompt=p, prompt_token_ids=list(range(10 * len(p))),
                                        outputs=[SimpleNamespace(token_ids=list(range(sp.max_tokens)))],
                                        kv_transfer_params=None if rep is None else {"kvcert": rep}))
        return outs


def _params(**kw):
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_args": {"other": 1}, **kw})


def _policy(threshold, fields=FIELDS, **kw):
    return EscalationPolicy(threshold=threshold, alpha=0.1, n=20, press_fields=dict(fields),
                            max_new_tokens=MAX_TOKENS, **kw)


def _hf_signal(per_step) -> float:
    """The Hugging Face path's signal of a generation whose ``Certificates.per_step()`` is ``per_step`` (one layer,
    one head, float64: the mean is the value exactly)."""
    rel = torch.tensor(per_step, dtype=torch.float64)[:, None, None]
    from kvcert.records import Certificates

    cert = Certificates("chebyshev", 0.05, rel, rel, rel ** 2, torch.ones_like(rel))
    return escalation_signal(cert)


def test_requests_at_or_over_the_threshold_run_again_uncompressed():
    llm = _StubLLM()
    prompts = ["easy", "hard", "edge", "short"]
    outs, rep = generate_with_policy(llm, prompts, _params(), _policy(0.3))
    assert llm.calls[0] == [(p, {"other": 1, **ARGS}) for p in prompts]
    # 0.5 > 0.3 and 0.3 >= 0.3 escalate, in one batch, uncompressed; 0.2 and the unsampled prompt (signal 0) stay
    assert llm.calls[1] == [("hard", {"other": 1, "kvcert_compression_ratio": 0.0}),
                            ("edge", {"other": 1, "kvcert_compression_ratio": 0.0})] and len(llm.calls) == 2
    assert [r["signal"] for r in rep["requests"]] == pytest.approx([0.2, 0.5, 0.3, 0.0])
    assert [r["escalated"] for r in rep["requests"]] == [False, True, True, False]
    assert rep["escalated"] == 2 and rep["escalation_rate"] == 0.5 and rep["request_args"] == ARGS
    # the cost: prompt + generated tokens of the two re-runs (the stub's prompts have 10 tokens per letter)
    assert rep["tokens_recomputed"] == (40 + MAX_TOKENS) + (40 + MAX_TOKENS)
    assert rep["tokens_first_run"] == (40 + 40 + 40 + 50) + 4 * MAX_TOKENS
    assert [o.kv_transfer_params is None for o in outs] == [False, True, True, True]  # the re-runs' outputs
    assert (rep["threshold"], rep["alpha"]) == (0.3, 0.1)


@pytest.mark.parametrize("threshold, escalated", [(math.inf, []), (-math.inf, [0, 1, 2, 3])])
def test_infinite_thresholds_escalate_none_or_all(threshold, escalated):
    llm = _StubLLM()
    prompts = ["easy", "hard", "edge", "short"]
    _, rep = generate_with_policy(llm, prompts, [_params()] * 4, _policy(threshold))
    assert [i for i, r in enumerate(rep["requests"]) if r["escalated"]] == escalated
    assert len(llm.calls) == (2 if escalated else 1)
    if escalated:
        assert [p for p, _ in llm.calls[1]] == prompts
    assert rep["tokens_recomputed"] == (rep["tokens_first_run"] if escalated else 0)


def test_a_saved_policy_file_serves_the_same(tmp_path):
    policy = _policy(0.3)
    path = policy.save(tmp_path / "policy.json")
    runs = []
    for given in (policy, path, str(path)):
        llm = _StubLLM()
        outs, rep = generate_with_policy(llm, ["easy", "hard"], _params(), given)
        runs.append((llm.calls, rep))
    assert runs[0] == runs[1] == runs[2]
    inf = _policy(math.inf).save(tmp_path / "never.json")  # +inf travels as "inf" in the JSON
    llm = _StubLLM()
    assert generate_with_policy(llm, ["hard"], _params(), inf)[1]["escalated"] == 0


def test_the_signal_is_the_hugging_face_paths():
    """The same per-step values give the same signal in both paths: token 0 (the prompt's last query) left out,
    the largest of the others; a one-token answer's is its one value. Negative control: a constructed case
    where other conventions (token 0 counted; the values read one step off, the last token left out) give
    another escalation, so the test fails for them (the plugin's token 0 is always 0, so counting it changes
    nothing on a real engine's reports: only a constructed one tells the conventions apart)."""
    cases = {"lead": [0.9, 0.1, 0.2], "tail": [0.0, 0.1, 0.6], "one": [0.7], "nan": [0.0, float("nan"), 0.1]}
    llm = _StubLLM(certs=cases)
    prompts = list(cases)
    _, rep = generate_with_policy(llm, prompts, _params(), _policy(0.5))
    signals = [r["signal"] for r in rep["requests"]]
    assert signals == [_hf_signal(cases[p]) for p in prompts]
    assert signals[:2] == pytest.approx([0.2, 0.6]) and signals[2] == pytest.approx(0.7) and signals[3] == math.inf
    assert [r["escalated"] for r in rep["requests"]] == [False, True, True, True]
    wrong = {"token 0 counted": lambda c: max(c) >= 0.5,
             "one step off": lambda c: max(c[:-1]) >= 0.5}
    for name, escalates in wrong.items():
        assert [escalates(cases[p]) for p in prompts[:2]] != [False, True], name


def test_the_signal_convention_check_can_fail(monkeypatch):
    """Negative control of the test above, run: with the signal computed on every token (token 0 counted) the
    constructed case escalates a request the Hugging Face rule serves compressed."""
    import kvcert.calibration

    monkeypatch.setattr(kvcert.calibration, "escalation_signal", lambda c: float(max(c)))
    _, rep = generate_with_policy(_StubLLM(certs={"lead": [0.9, 0.1, 0.2]}), ["lead"], _params(), _policy(0.5))
    assert rep["requests"][0]["escalated"]  # what test_the_signal_is_the_hugging_face_paths rejects


@pytest.mark.parametrize("fields", [
    {"compression_ratio": 0.5},  # what kvcert calibrate writes by default
    FIELDS,
    {"compression_ratio": 0.5, "seed": 1, "delta": 0.1, "kind": "chi2"},
    {"compression_ratio": 0.5, "preset": "paper"},
    {"compression_ratio": 0.25, "kind": "tilted_hull", "delta": 0.2},
])
def test_the_policys_keys_are_per_request_options_of_its_press(fields):
    """Each press field with a per-request key travels as that key, ``request_options`` accepts it with the
    policy's value, and the request's resolved design is the press's (``PoissonPress(**fields).design``)."""
    from dataclasses import replace

    from kvcert.presses import PoissonPress

    config = KVCertConfig()
    args = policy_request_args(_policy(0.3, fields), config)
    key_of = {name: key for key, name in REQUEST_KEYS.items()}
    assert args == {key_of[n]: v for n, v in fields.items() if n in key_of}
    overrides = request_options(config, args)
    for key, value in args.items():
        assert overrides[REQUEST_KEYS[key]] == value, key
    assert replace(config, **overrides).design == PoissonPress(**fields).design


def test_fields_without_a_per_request_key_are_the_engines():
    """sinks, window and scorer have no per-request key: served when the engine has them, refused by name
    otherwise. So are an engine's settings that change the press's design (an engine-wide error target)."""
    assert set(POLICY_PRESS_FIELDS) - set(REQUEST_KEYS.values()) == {"sinks", "window", "scorer"}
    fields = {"compression_ratio": 0.5, "window": 16, "sinks": 2, "scorer": "keydiff"}
    with pytest.raises(ValueError, match=r"window.*start the engine with kvcert=\{.*'window': 16"):
        generate_with_policy(_StubLLM(), ["easy"], _params(), _policy(0.3, fields))
    engine = KVCertConfig(window=16, sinks=2, scorer="keydiff")
    llm = _StubLLM(config=engine)
    generate_with_policy(llm, ["easy"], _params(), _policy(0.3, fields))
    assert llm.calls[0][0][1] == {"other": 1, "kvcert_compression_ratio": 0.5}
    # an engine started with an error target serves the paper's design: a ratio replaces the target, not the
    # design, so a policy of the recommended design is refused and one of the paper's design is served
    target = KVCertConfig(target_error=0.5)
    with pytest.raises(ValueError, match="kind: policy 'tilted_hull', served 'chebyshev'"):
        policy_request_args(_policy(0.3, {"compression_ratio": 0.5}), target)
    paper = {"compression_ratio": 0.5, "kind": "chebyshev"}
    assert policy_request_args(_policy(0.3, paper), target) == {"kvcert_compression_ratio": 0.5,
                                                                "kvcert_kind": "chebyshev"}
    with pytest.raises(ValueError, match="compression_ratio: policy 0.5, served 0.0.*target_error: policy None"):
        policy_request_args(_policy(0.3, {}), target)


@pytest.mark.parametrize("call, error, match", [
    (lambda llm: generate_with_policy(llm, ["easy"], _params(), {"threshold": 0.3}), TypeError,
     "policy must be a kvcert.EscalationPolicy or the path"),
    (lambda llm: generate_with_policy(llm, ["easy"], _params(), "/nonexistent/policy.json"), ValueError,
     "could not be read"),
    (lambda llm: generate_with_policy(llm, ["easy", "hard"], [_params()] * 3, _policy(0.3)), ValueError,
     "sampling_params one or one per prompt"),
    (lambda llm: generate_with_policy(llm, [], _params(), _policy(0.3)), ValueError, "prompts must be non-empty"),
    (lambda llm: generate_with_policy(llm, ["easy"], _params(max_tokens=8), _policy(0.3)), ValueError,
     r"sampling_params\[0\].max_tokens=8: the policy was calibrated at max_new_tokens=3"),
    (lambda llm: generate_with_policy(llm, ["easy"], _params(temperature=0.8), _policy(0.3)), ValueError,
     r"temperature=0.8: the policy was calibrated on greedy answers"),
    (lambda llm: generate_with_policy(llm, ["easy"], _params(extra_args={"kvcert_seed": 1}), _policy(0.3)),
     ValueError, r"\['kvcert_seed'\] given; the policy sets"),
    (lambda llm: generate_with_policy(llm, ["easy"], _params(), _policy(0.3, {"kind": "wald"})), ValueError,
     "kvcert_kind='wald'"),
    (lambda llm: generate_with_policy(SimpleNamespace(generate=llm.generate), ["easy"], _params(), _policy(0.3)),
     ValueError, "llm: not a certified vllm.LLM"),
    (lambda llm: generate_with_policy(_StubLLM(config=KVCertConfig(granularity="block")), ["easy"], _params(),
                                      _policy(0.3)), ValueError, "llm: serves granularity='block'"),
    (lambda llm: generate_with_policy(_StubLLM(error="kvcert_seed=-1: bad"), ["easy"], _params(), _policy(0.3)),
     ValueError, "prompt 0: the engine refused the policy's options: kvcert_seed=-1"),
])
def test_bad_input_is_refused_by_name(call, error, match):
    llm = _StubLLM()
    with pytest.raises(error, match=match):
        call(llm)
    assert llm.calls == []  # refused before any request runs


def test_escalation_signal_takes_the_per_step_values():
    """The vLLM path hands ``escalation_signal`` the per-step values themselves (a list or an array); a batch or
    an empty answer is refused."""
    import numpy as np

    assert escalation_signal([0.0, 0.4, 0.2]) == escalation_signal(np.array([0.0, 0.4, 0.2])) == pytest.approx(0.4)
    for bad, match in ((np.zeros((2, 3)), "one sequence at a time"), ([[0.0, 1.0]], "one sequence at a time"),
                       ([], "no decoding step")):
        with pytest.raises(ValueError, match=match):
            escalation_signal(bad)
