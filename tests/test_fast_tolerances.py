"""Shared support for the kvcert.fast tests: dtype tolerance table, a naive torch
oracle at the input dtype, Hypothesis strategies, slice helpers.

Tolerances (STYLE.md, flash-attention style): a fast result at dtype D is
compared with the float64 reference on the *same* (D-rounded) inputs and must
satisfy

    |fast - ref64| <= 2 * |naive_D - ref64| + ROUNDING[D] * scale

where ``naive_D`` is the textbook formula evaluated by plain torch at the
compute dtype of the fast path (fp32 for fp32/bf16/fp16 inputs: the fast
path accumulates in fp32), and ``scale`` is the magnitude the formula
cancels (derived per quantity in :func:`scales`). ``ROUNDING`` is a few units
of the dtype's epsilon times a sqrt(n)-style accumulation factor, plus the
final cast of the output to the input dtype.

The tests in this module check the oracle itself: the naive torch formulas at
float64 agree with the NumPy reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.reference as R

EPS = {
    torch.float64: float(torch.finfo(torch.float64).eps),
    torch.float32: float(torch.finfo(torch.float32).eps),
    torch.bfloat16: float(torch.finfo(torch.bfloat16).eps),
    torch.float16: float(torch.finfo(torch.float16).eps),
}
#: dtype the fast path computes in for each input dtype
COMPUTE = {torch.float64: torch.float64, torch.float32: torch.float32,
           torch.bfloat16: torch.float32, torch.float16: torch.float32}
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

#: tile-breaking sizes (flash-attention's list, trimmed for 2 CPU cores) and small ones
TILE_N = [1, 2, 3, 7, 16, 17, 63, 64, 65, 113, 127, 128, 129, 239]


def rounding(dtype: torch.dtype, n: int) -> float:
    """Rounding allowance of a length-n reduction at the compute dtype: 8 eps sqrt(n + 1)."""
    return 8.0 * EPS[COMPUTE[dtype]] * math.sqrt(n + 1.0)


def output_cast(dtype: torch.dtype) -> float:
    """Relative error of casting the fp32 result to the input dtype (half an ulp, twice)."""
    return EPS[dtype] if dtype in (torch.bfloat16, torch.float16) else 0.0


def naive_hajek(q, k, v, pi, *, scale=None, bias=None):
    """Textbook Hajek estimate for one query head in plain torch at q's dtype.

    q (d,), k (n, d), v (n, dv), pi (n,), bias (n,) or None. Direct formulas:
    (v - o)^2 per coordinate, no moment tricks.
    """
    d = q.shape[-1]
    tau = 1.0 / math.sqrt(d) if scale is None else scale
    s = tau * (k @ q)
    if bias is not None:
        s = s + bias
    present = pi > 0
    logits = torch.where(present, s - torch.log(torch.where(present, pi, torch.ones_like(pi))),
                         torch.full_like(s, -math.inf))
    if logits.numel() == 0 or bool((logits == -math.inf).all()):
        return None
    lse = torch.logsumexp(logits, 0)
    a = torch.exp(logits - lse)
    o = a @ v
    c = (1 - pi) * a * a
    r = v - o
    var = (c[:, None] * r * r).sum(0)
    return {"output": o, "variance": var, "trace": var.sum(), "lse": lse, "n_eff": 1.0 / (a * a).sum(),
            "weights": a}


def expand_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """(b, h_kv, ...) -> (b, h_q, ...) by repeating each KV head g times (test-only)."""
    return x.repeat_interleave(g, dim=1)


def report(name: str, got: np.ndarray, want: np.ndarray, tol: np.ndarray) -> str:
    """Failure message: max/mean diff and the worst coordinate."""
    diff = np.abs(got - want)
    excess = np.where(np.isfinite(diff), diff - tol, np.inf)
    i = np.unravel_index(int(np.argmax(excess)), diff.shape) if diff.ndim else ()
    return (f"{name}: max diff {np.nanmax(diff):.3g}, mean diff {np.nanmean(diff):.3g}, worst at {i}: "
            f"got {got[i]!r} want {want[i]!r} tol {np.broadcast_to(tol, diff.shape)[i]:.3g}")


def assert_close(name: str, got, want, tol) -> None:
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    tol = np.broadcast_to(np.asarray(tol, dtype=np.float64), want.shape)
    same_inf = (got == want) & ~np.isfinite(want)
    with np.errstate(invalid="ignore"):  # inf - inf where both are inf: handled by same_inf
        ok = same_inf | (np.abs(got - want) <= tol)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert bool(ok.all()), report(name, got, want, tol)


# ---------------------------------------------------------------------------
# Hypothesis strategies (STYLE.md rule 4)
# ---------------------------------------------------------------------------

sizes_n = st.one_of(st.sampled_from(TILE_N), st.integers(1, 200))


@st.composite
def pi_vectors(draw, n: int, *, padding: bool = True):
    """Inclusion probabilities: interior values, exact 1.0, tiny 1e-6 and (optionally) padding 0."""
    kinds = draw(st.lists(st.sampled_from(["interior", "one", "tiny", "pad"] if padding
                                          else ["interior", "one", "tiny"]), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.02, 0.98, size=n)
    p = np.where(np.array(kinds) == "one", 1.0, p)
    p = np.where(np.array(kinds) == "tiny", 1e-6, p)
    p = np.where(np.array(kinds) == "pad", 0.0, p)
    return p


# ---------------------------------------------------------------------------
# tests of the oracle itself
# ---------------------------------------------------------------------------


@given(n=sizes_n, d=st.sampled_from([4, 16]), data=st.data())
def test_naive_oracle_matches_reference_in_float64(n, d, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 10**6)))
    q, k, v = rng.normal(size=d), rng.normal(size=(n, d)), rng.normal(size=(n, 3)) + 5.0
    pi = data.draw(pi_vectors(n))
    ref = R.hajek_attention(q, k, v, pi)
    got = naive_hajek(*(torch.from_numpy(x) for x in (q, k, v, pi)))
    if got is None:
        assert ref.lse == -np.inf
        return
    for f in ("output", "variance", "trace", "lse", "n_eff", "weights"):
        want = np.asarray(getattr(ref, f))
        assert_close(f, got[f].numpy(), want, 1e-9 * (1.0 + np.abs(want)))


def test_rounding_table_is_ordered():
    # a coarser dtype never gets a tighter allowance (guards edits of the table)
    assert rounding(torch.float64, 100) < rounding(torch.float32, 100) == rounding(torch.bfloat16, 100)
    assert output_cast(torch.float32) == 0.0 < output_cast(torch.float16) < output_cast(torch.bfloat16)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


@pytest.mark.parametrize("name", ["design", "estimators", "eviction", "certificates"])
def test_fast_docstring_examples(name):
    import doctest
    import importlib

    module = importlib.import_module(f"kvcert.fast.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
