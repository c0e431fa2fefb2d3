"""The escalation policies of an error target's closing loop, shared by both engines.

``kvcert.generate(..., escalate=...)`` (Hugging Face) and ``kvcert.vllm.generate_within_target``
(vLLM) re-run a request whose certificate exceeds its error target eps: ``"full"`` re-runs it
uncompressed; ``"tighten"`` re-runs it with the target halved (eps/2, eps/4, eps/8), then
uncompressed. No imports beyond the standard library: ``import kvcert.vllm`` stays light.
"""

from __future__ import annotations

__all__ = ["ESCALATIONS", "TIGHTEN_STEPS", "check_escalate", "next_target"]

#: the escalation policies
ESCALATIONS = ("full", "tighten")
#: halvings of the target under "tighten" before the uncompressed run
TIGHTEN_STEPS = 3


def check_escalate(escalate, *, optional: bool = False):
    """``escalate`` as given: one of :data:`ESCALATIONS` (or None when ``optional``); ValueError otherwise."""
    if escalate is None and optional:
        return None
    if escalate not in ESCALATIONS:
        raise ValueError(f"escalate must be {'None or ' if optional else ''}one of {ESCALATIONS}, got {escalate!r}")
    return escalate


def next_target(policy: str, target: float | None, tightened: int) -> float | None:
    """The next run's error target after a run under ``target`` exceeded it: ``target / 2`` under
    ``"tighten"`` while fewer than :data:`TIGHTEN_STEPS` halvings have run (``tightened``), else None
    (the next run is uncompressed)."""
    if policy == "tighten" and target is not None and tightened < TIGHTEN_STEPS:
        return target / 2.0
    return None
