"""A calibrated escalation policy (:class:`kvcert.EscalationPolicy`, ``kvcert calibrate``) served by the plugin.

:func:`kvcert.vllm.generate_with_policy` runs every request under the policy's press as per-request
``kvcert_*`` keys and re-runs, uncompressed, the requests whose signal reaches the policy's threshold. This
module holds its parts: the engine's settings (:func:`engine_config`), the keys a request carries
(:func:`policy_request_args`), the checks of the sampling parameters (:func:`check_policy_params`) and the
cost of the re-runs (:func:`recomputed_tokens`).

The press fields of a policy (``kvcert.calibration.POLICY_PRESS_FIELDS``) with a per-request key
(``kvcert.vllm.config.REQUEST_KEYS``: ``compression_ratio``, ``preset``, ``seed``, ``delta``, ``kind``)
travel with each request; the others (``sinks``, ``window``, ``scorer``) are the engine's settings. Either
way the request's resolved design must be the design of the policy's press (``KVCertConfig(**press_fields)``,
whose defaults are ``PoissonPress``'s): where it is not, the policy is refused, naming the fields, since the
threshold was calibrated on that press's signals.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..calibration import POLICY_PRESS_FIELDS, EscalationPolicy
from .config import REQUEST_KEYS, KVCertConfig, request_options

__all__ = ["as_policy", "engine_config", "policy_request_args", "check_policy_params", "recomputed_tokens",
           "GREEDY_BELOW"]

#: vLLM samples greedily below this temperature (``vllm.sampling_params._SAMPLING_EPS``)
GREEDY_BELOW = 1e-5


def as_policy(policy) -> EscalationPolicy:
    """``policy`` as an :class:`~kvcert.calibration.EscalationPolicy`: one, or the path of a saved one
    (:meth:`~kvcert.calibration.EscalationPolicy.load`)."""
    if isinstance(policy, EscalationPolicy):
        return policy
    if isinstance(policy, (str, Path)):
        return EscalationPolicy.load(policy)
    raise TypeError(f"policy must be a kvcert.EscalationPolicy or the path of a saved one (kvcert calibrate "
                    f"--out FILE), got {type(policy).__name__}")


def engine_config(llm) -> KVCertConfig:
    """The plugin settings of a certified ``vllm.LLM`` (``llm.llm_engine.vllm_config``); ValueError when ``llm``
    was not started with them, or serves the block design (per-request keys need the token design)."""
    vllm_config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    config = None if vllm_config is None else KVCertConfig.from_vllm_config(vllm_config)
    if config is None:
        raise ValueError("llm: not a certified vllm.LLM (no kvcert settings in its configuration; start it with "
                         "kvcert.vllm.certified_llm)")
    if not config.tokens:
        raise ValueError(f"llm: serves granularity={config.granularity!r}; a policy runs as per-request options, "
                         f"which need the token design")
    return config


def policy_request_args(policy: EscalationPolicy, config: KVCertConfig) -> dict:
    """The ``kvcert_*`` extra_args under which a request on an engine with settings ``config`` runs the design
    of ``policy``'s press: its press fields that have a per-request key.

    Raises ValueError when the request's resolved design (``config`` with those keys,
    :func:`kvcert.vllm.config.request_options`) is not the press's, naming the fields that differ (a field
    without a per-request key, such as ``window``, is the engine's: start the engine with it).
    """
    key_of = {name: key for key, name in REQUEST_KEYS.items()}
    args = {key_of[name]: value for name, value in policy.press_fields.items() if name in key_of}
    try:
        served = dataclasses.replace(config, **(request_options(config, args) or {}))
        wanted = KVCertConfig(**policy.press_fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"policy: press fields {policy.press_fields} cannot be served by this engine: {e}") from None
    names = [f.name for f in dataclasses.fields(served.design)]
    differ = {n: (getattr(wanted.design, n), getattr(served.design, n)) for n in names
              if getattr(wanted.design, n) != getattr(served.design, n)}
    if differ:
        engine_only = sorted(n for n in differ if n in POLICY_PRESS_FIELDS and n not in key_of)
        shown = ", ".join(f"{n}: policy {w!r}, served {s!r}" for n, (w, s) in differ.items())
        hint = (f"; {engine_only} have no per-request key: start the engine with "
                f"kvcert={{{', '.join(f'{n!r}: {differ[n][0]!r}' for n in engine_only)}}}") if engine_only else ""
        raise ValueError(f"policy: this engine would serve another design than the policy's press ({shown})"
                         f"{hint}")
    return args


def check_policy_params(policy: EscalationPolicy, params: list) -> None:
    """Each ``SamplingParams`` as the policy was calibrated: greedy (temperature 0), ``max_tokens`` equal to
    ``policy.max_new_tokens`` (the signal is the largest over the answer's steps, so its law depends on the
    length), and no ``kvcert_*`` key of its own (the policy sets them). ValueError naming the argument."""
    for i, p in enumerate(params):
        where = f"sampling_params[{i}]"
        if p.max_tokens != policy.max_new_tokens:
            raise ValueError(f"{where}.max_tokens={p.max_tokens}: the policy was calibrated at max_new_tokens="
                             f"{policy.max_new_tokens} (its threshold holds at that answer length); pass "
                             f"max_tokens={policy.max_new_tokens}, or calibrate at this length")
        if p.temperature >= GREEDY_BELOW:
            raise ValueError(f"{where}.temperature={p.temperature}: the policy was calibrated on greedy answers "
                             f"(kvcert calibrate); pass temperature=0")
        own = sorted(k for k in (p.extra_args or {}) if isinstance(k, str) and k.startswith("kvcert_"))
        if own:
            raise ValueError(f"{where}.extra_args: {own} given; the policy sets the request's kvcert_* keys "
                             f"(its press fields)")


def recomputed_tokens(output) -> int:
    """Tokens a run computed (its cost when it is a re-run): the prompt's plus every completion's generated ones."""
    prompt = len(getattr(output, "prompt_token_ids", None) or [])
    return prompt + sum(len(c.token_ids) for c in (getattr(output, "outputs", None) or []))
