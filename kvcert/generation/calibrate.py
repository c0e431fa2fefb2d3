"""``kvcert.calibrate``: an escalation policy calibrated on a user's prompts (:mod:`kvcert.calibration`).

Each prompt is answered twice from one exact prefill (:func:`kvcert.prefill`): with the full cache and
under the policy's press; the press's answer "differs" when its generated token ids are not the full
cache's. No labels are needed: the guarantee is on the rate of answers that differ from the full cache's.
"""

from __future__ import annotations

import math
import sys

from ..calibration import POLICY_PRESS_FIELDS, EscalationPolicy, calibrate_escalation, escalation_signal
from .prefilled import prefill
from .query_aware import generate

__all__ = ["CalibrationRecord", "calibrate"]


class CalibrationRecord(dict):
    """One calibration prompt: ``signal``, ``differs``, ``kept_fraction`` (the press's, a sketch's memory
    counted) and the answers' lengths; a dict, saved beside the policy."""


def calibrate(model, tokenizer, prompts, *, alpha: float, max_new_tokens: int = 32, progress: bool = False,
              **press_fields) -> tuple[EscalationPolicy, list[CalibrationRecord]]:
    """Calibrate an :class:`~kvcert.calibration.EscalationPolicy` on ``prompts``.

    Parameters
    ----------
    model, tokenizer
        As for :func:`kvcert.generate`.
    prompts : list[str]
        The calibration prompts, exchangeable with the prompts the policy will serve (at least
        ``ceil(1 / alpha) - 1`` of them, or every request escalates).
    alpha : float in (0, 1)
        The tolerated expected rate of served answers that differ from the full cache's.
    max_new_tokens : int >= 1
        The answer length, as the policy will serve it.
    **press_fields
        ``kvcert.PoissonPress`` keywords among :data:`kvcert.calibration.POLICY_PRESS_FIELDS`
        (default ``compression_ratio=0.5``).

    Returns
    -------
    (EscalationPolicy, list[CalibrationRecord])
    """
    if isinstance(prompts, str) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings (one calibration prompt each)")
    unknown = set(press_fields) - set(POLICY_PRESS_FIELDS)
    if unknown:
        raise ValueError(f"unknown press fields {sorted(unknown)} (known: {POLICY_PRESS_FIELDS})")
    fields = {"compression_ratio": 0.5, **press_fields}
    policy = EscalationPolicy(threshold=math.inf, alpha=alpha, n=len(prompts), press_fields=fields,
                              max_new_tokens=max_new_tokens)  # checks alpha and the fields before any model run
    records = []
    for i, prompt in enumerate(prompts):
        state = prefill(model, tokenizer, prompt)
        full = generate(model, tokenizer, prompt, None, max_new_tokens, prefilled=state)
        served = generate(model, tokenizer, prompt, policy.press(), max_new_tokens, prefilled=state)
        records.append(CalibrationRecord(
            signal=escalation_signal(served.certificates), differs=list(served.token_ids) != list(full.token_ids),
            kept_fraction=float(served.certificates.summary()["kept_fraction"]),
            tokens=len(served.token_ids), full_tokens=len(full.token_ids)))
        if progress:
            print(f"kvcert calibrate: {i + 1}/{len(prompts)} prompts (differs: "
                  f"{sum(r['differs'] for r in records)})", file=sys.stderr, flush=True)
    signals = [r["signal"] for r in records]
    threshold = calibrate_escalation(signals, [r["differs"] for r in records], alpha)
    escalated = [s >= threshold for s in signals]  # EscalationPolicy.escalates
    risk = sum(r["differs"] and not e for r, e in zip(records, escalated)) / len(records)
    policy = EscalationPolicy(threshold=threshold, alpha=alpha, n=len(prompts), press_fields=fields,
                              escalation_rate=sum(escalated) / len(records), empirical_risk=risk,
                              max_new_tokens=max_new_tokens)
    return policy, records
