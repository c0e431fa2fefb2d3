"""Argument checks shared by the ``kvcert.fast`` modules (private).

Every check raises ``TypeError`` for a wrong kind of argument and
``ValueError`` for a wrong shape or range, naming the argument and what was
expected (STYLE.md rule 6).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__: list[str] = []


def check_tensor(name: str, x, *, ndim: tuple[int, ...] | None = None, floating: bool = False) -> torch.Tensor:
    """``x`` must be a torch.Tensor (of one of the ``ndim`` ranks; floating if asked)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim not in ndim:
        want = " or ".join(f"{k}-d" for k in ndim)
        raise ValueError(f"{name} must be {want}, got shape {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def check_nonneg_int(name: str, value) -> int:
    """A Python/NumPy integer >= 0 (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def check_scale(scale, d: int) -> float:
    """Softmax scale tau: default 1/sqrt(d); a finite positive float otherwise."""
    if scale is None:
        return 1.0 / float(d) ** 0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0.0 and scale < float("inf")):
        raise ValueError(f"scale must be a finite positive float, got {scale}")
    return scale


def check_softcap(softcap) -> float | None:
    """A model's attention logit softcap: None (no cap) or a finite number > 0, as a float (ValueError naming
    ``softcap`` otherwise)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) \
            or softcap <= 0:
        raise ValueError(f"softcap must be a finite number > 0 (the model's attn_logit_softcapping), got {softcap!r}")
    return float(softcap)


def check_probabilities(name: str, p: torch.Tensor) -> None:
    """Values in [0, 1] (NaN refused)."""
    if p.numel():
        lo, hi = torch.aminmax(p)  # NaN propagates into both
        if not (float(lo) >= 0.0 and float(hi) <= 1.0):
            raise ValueError(f"{name} must lie in [0, 1] (found a value outside, or NaN)")


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, float32 otherwise (fp32 accumulation)."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def stat_dtype(x: torch.Tensor) -> torch.dtype:
    """dtype of probabilities/statistics computed from ``x``: float64 stays, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def check_int(name: str, value, *, low: int = 0, optional: bool = False):
    """An int >= ``low`` (bool refused), or None when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_real(name: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> float:
    """A finite float in the interval [lo, hi] (open ends as asked; bool refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi and math.isfinite(value)):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def check_kernel_size(value) -> int:
    """An odd int >= 1 (a pooling kernel's size)."""
    value = check_int("kernel_size", value, low=1)
    if value % 2 == 0:
        raise ValueError(f"kernel_size must be odd, got {value}")
    return value
