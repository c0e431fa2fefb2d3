r"""An answer-level guarantee on a user's own prompts: conformal risk control of certificate escalation.

A press at a fixed budget answers most prompts as the full cache does; some it changes. The certificate
says, per request, how large the attention error may have been. :func:`calibrate_escalation` chooses,
from ``n`` labelled calibration prompts, the threshold ``t`` of an escalation rule

    re-run the request with the full cache when its signal >= t

(the signal: :func:`escalation_signal`, the largest per-step mean relative radius of the answer's
decoding steps, what ``kvcert.generate(..., escalate=...)`` reads) so that on a new prompt from the
same distribution (exchangeable with the calibration prompts)

.. math:: \mathbb{E}\,[\,\text{the served answer differs from the full cache's}\,] \le \alpha .

The loss of prompt i at threshold t, :math:`L_i(t) = d_i\,\mathbf{1}[s_i < t]` (:math:`d_i`: its answer
under the press differs from the full cache's; :math:`s_i`: its signal; an escalated answer is the full
cache's, loss 0), is non-decreasing and left-continuous in t and bounded by B = 1. Conformal risk control
(Angelopoulos, Bates, Fisch, Lei and Schuster, "Conformal Risk Control", ICLR 2024, Theorem 1, with
:math:`\lambda = -t`) takes

.. math:: \hat t = \sup\Big\{ t : \frac{n}{n+1}\,\hat R_n(t) + \frac{1}{n+1} \le \alpha \Big\},
          \qquad \hat R_n(t) = \frac1n \sum_{i=1}^n L_i(t),

and then :math:`\mathbb{E}[L_{n+1}(\hat t)] \le \alpha`: at most :math:`k = \lfloor \alpha (n+1) \rfloor - 1`
differing calibration prompts may stay below :math:`\hat t`, so :math:`\hat t` is the (k+1)-th smallest
signal among the differing prompts (+inf when there are at most k of them: never escalate; -inf when k < 0,
i.e. :math:`\alpha < 1/(n+1)`: escalate every request). With continuous signals the risk is exactly
:math:`(k+1)/(n+1)` when every prompt differs (tests/test_calibration.py).

:func:`calibrate_budget` is the same correction for the baseline that calibrates one fixed budget per
workload (as kvcalib does): the smallest budget of a grid whose monotonized loss
:math:`\max_{b' \ge b} d_i(b')` meets the same bound.

:class:`EscalationPolicy` is the calibrated rule with its press's fields; it is saved and loaded as JSON
(:meth:`EscalationPolicy.save`, :meth:`EscalationPolicy.load`), builds its press (:meth:`EscalationPolicy.press`)
and is accepted by ``kvcert.generate(..., escalate=policy)`` and ``kvcert generate --policy FILE``;
``kvcert calibrate`` makes one from a file of prompts.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = ["EscalationPolicy", "calibrate_budget", "calibrate_escalation", "escalation_signal",
           "largest_escalation_rank"]

#: the press fields a policy may carry (kvcert.PoissonPress keywords)
POLICY_PRESS_FIELDS = ("compression_ratio", "preset", "seed", "delta", "sinks", "window", "scorer", "kind")


def _check_alpha(alpha) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha must be a real number in (0, 1), got {alpha!r}")
    return float(alpha)


def largest_escalation_rank(n: int, alpha: float) -> int:
    r"""k = floor(alpha (n + 1)) - 1: how many differing calibration prompts conformal risk control lets stay
    below the threshold (negative: escalate every request)."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n (calibration prompts) must be an int >= 1, got {n!r}")
    # the small offset keeps alpha (n + 1) = 3 from rounding to 2.999...: the bound is met with equality
    return math.floor(_check_alpha(alpha) * (n + 1) + 1e-9) - 1


def calibrate_escalation(signals, differs, alpha: float) -> float:
    r"""The threshold t of "escalate when signal >= t" whose expected rate of served answers that differ from
    the full cache's is at most ``alpha`` (module docstring).

    Parameters
    ----------
    signals : sequence of float, (n,)
        Each calibration prompt's signal under the press (:func:`escalation_signal`); finite, or +inf.
    differs : sequence of bool, (n,)
        Whether the press's answer to that prompt differs from the full cache's.
    alpha : float in (0, 1)

    Returns
    -------
    float
        The threshold: +inf (never escalate) when at most k prompts differ, -inf (always escalate) when
        k < 0, else the (k+1)-th smallest signal among the differing prompts.
    """
    s = [float(x) for x in signals]
    d = list(differs)
    if len(s) != len(d) or not s:
        raise ValueError(f"signals and differs must be non-empty and of one length, got {len(s)} and {len(d)}")
    if any(math.isnan(x) or x == -math.inf for x in s):
        raise ValueError("signals must not hold NaN or -inf (a certificate that was not recorded?)")
    if any(isinstance(x, (float, str)) or x not in (0, 1) for x in d):  # bool, 0/1, numpy booleans
        raise ValueError("differs must hold booleans (does the press's answer differ from the full cache's?)")
    k = largest_escalation_rank(len(s), alpha)
    if k < 0:
        return -math.inf
    bad = sorted(x for x, flag in zip(s, d) if flag)
    return bad[k] if k < len(bad) else math.inf


def calibrate_budget(budgets, differs, alpha: float):
    r"""The smallest of ``budgets`` (ascending) at which the expected rate of answers that differ from the full
    cache's is at most ``alpha``, by the same correction: the loss of prompt i at budget b is
    :math:`\max_{b' \ge b} d_i(b')` (non-increasing in b, at least the answer's own loss).

    ``differs``: (n, len(budgets)) booleans, prompt i's answer at budget j differs from the full cache's.
    Returns None when no budget of the grid qualifies (serve the full cache).
    """
    b = list(budgets)
    if any(y <= x for x, y in zip(b, b[1:])):
        raise ValueError(f"budgets must be strictly increasing, got {b}")
    rows = [list(r) for r in differs]
    if not rows or any(len(r) != len(b) for r in rows):
        raise ValueError(f"differs must be (n >= 1, {len(b)}) booleans, one column per budget")
    n, alpha = len(rows), _check_alpha(alpha)
    for j, budget in enumerate(b):
        risk = sum(any(r[j:]) for r in rows) / n
        if (n * risk + 1) / (n + 1) <= alpha + 1e-12:
            return budget
    return None


def escalation_signal(certificates) -> float:
    """A generation's escalation signal: the largest per-step mean relative radius over its decoding steps
    (``certificates.per_step()``, step 0, the prompt's last query, left out when later steps exist; +inf
    when a radius is not finite). One sequence only.

    ``certificates``: a :class:`kvcert.Certificates`, or the per-step values themselves, a 1-D sequence of
    floats indexed as ``per_step()`` is (value t: the step that produced generated token t), such as
    ``kvcert.vllm.certificates(output)``."""
    if certificates is None:
        raise ValueError("escalation_signal: the generation recorded no certificates (no press?)")
    if hasattr(certificates, "per_step"):
        certificates = certificates.per_step()
    if getattr(certificates, "ndim", 1) != 1:
        raise ValueError("escalation_signal: one sequence at a time (index the batch: certificates[i])")
    try:
        per_step = [float(x) for x in certificates.tolist()] if hasattr(certificates, "tolist") else \
            [float(x) for x in certificates]
    except (TypeError, ValueError):
        raise ValueError("escalation_signal: one sequence at a time, a 1-D sequence of floats per step") from None
    if not per_step:
        raise ValueError("escalation_signal: no decoding step recorded (an empty answer)")
    steps = per_step[1:] if len(per_step) > 1 else per_step
    return math.inf if any(math.isnan(x) for x in steps) else max(steps)


@dataclass(frozen=True)
class EscalationPolicy:
    """A calibrated escalation rule: serve under :meth:`press`; re-run with the full cache when the signal
    (:func:`escalation_signal`) is >= ``threshold``.

    Attributes
    ----------
    threshold : float
        +inf never escalates, -inf always does.
    alpha : float
        The risk level it was calibrated at: expected rate of answers that differ from the full cache's.
    n : int
        Calibration prompts.
    press_fields : dict
        ``kvcert.PoissonPress`` keywords (:data:`POLICY_PRESS_FIELDS`).
    escalation_rate, empirical_risk : float
        On the calibration prompts: the share escalated, and the share served compressed that differ.
    max_new_tokens : int
        The answer length it was calibrated at.
    signal : str
        ``"step_max"``, the only signal so far.
    """

    threshold: float
    alpha: float
    n: int
    press_fields: dict = field(default_factory=dict)
    escalation_rate: float = 0.0
    empirical_risk: float = 0.0
    max_new_tokens: int = 32
    signal: str = "step_max"

    def __post_init__(self):
        _check_alpha(self.alpha)
        if math.isnan(float(self.threshold)):
            raise ValueError("threshold must not be NaN")
        unknown = set(self.press_fields) - set(POLICY_PRESS_FIELDS)
        if unknown:
            raise ValueError(f"press_fields: unknown keys {sorted(unknown)} (known: {POLICY_PRESS_FIELDS})")
        if self.signal != "step_max":
            raise ValueError(f"signal must be 'step_max', got {self.signal!r}")

    def escalates(self, signal: float) -> bool:
        """Whether a request with this signal is re-run with the full cache."""
        return float(signal) >= self.threshold

    def press(self):
        """The press the policy serves under (a new ``kvcert.PoissonPress``)."""
        from kvcert.presses import PoissonPress

        return PoissonPress(**self.press_fields)

    def to_json(self) -> dict:
        out = asdict(self)
        out["threshold"] = _encode(self.threshold)
        return out

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"kvcert_escalation_policy": 1, **self.to_json()}, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> "EscalationPolicy":
        """Read a policy :meth:`save` wrote; ValueError naming the file when it is not one."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"policy file {str(path)!r} could not be read as JSON: {e}") from None
        if not isinstance(raw, dict) or raw.pop("kvcert_escalation_policy", None) != 1:
            raise ValueError(f"policy file {str(path)!r} is not a kvcert escalation policy (kvcert calibrate)")
        raw["threshold"] = _decode(raw.get("threshold"))
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"policy file {str(path)!r}: {e}") from None


def _encode(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _decode(x) -> float:
    if x in ("inf", "-inf"):
        return float(x)
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"threshold must be a number, 'inf' or '-inf', got {x!r}")
    return float(x)
