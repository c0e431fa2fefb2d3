"""The shared tolerance table and naive oracle of tests/support.py, checked themselves.

The tolerance rule (STYLE.md, flash-attention style; see tests/support.py): a result at dtype D is
compared with the float64 reference on the *same* (D-rounded) inputs and must satisfy

    |result - ref64| <= 2 * |naive_D - ref64| + rounding(D, n) * scale

These tests check the oracle itself (the naive torch formulas at float64 agree with the NumPy
reference) and guard edits of the table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvcert.reference as R
from support import (COMPUTE, EPS, KERNEL_DTYPES, TILE_N, assert_close, lengths, make_case, naive_hajek,
                     naive_hajek_heads, naive_tail, output_cast, pi_vectors, reference_heads, rounding, store_eps)

# ---------------------------------------------------------------------------
# tests of the oracle itself
# ---------------------------------------------------------------------------


@given(n=lengths(200, tile_max=TILE_N[-1]), d=st.sampled_from([4, 16]), data=st.data())
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


@pytest.mark.parametrize("pad, pi_kind", [("none", "mixed"), ("ragged", "interior"), ("empty_head", "ones")])
@pytest.mark.parametrize("n", [1, 17, 113])
def test_batched_oracles_match_reference_in_float64(n, pad, pi_kind):
    """The kernels' batched naive mirror (GQA, max-shift-and-divide) and the naive s2 agree with the
    NumPy reference at float64, head by head."""
    q, k, v, pi = make_case(n, 2, 2, 3, n, 16, 5, torch.float64, regime="dominant", pad=pad, pi_kind=pi_kind)
    low = naive_hajek_heads(q, k, v, pi, torch.float64)
    for (bi, h), (e, vv, p) in reference_heads(q, k, v, pi).items():
        if e.lse == -np.inf:
            assert low["lse"][bi, h] == -np.inf
            continue
        for f in ("output", "variance", "trace", "lse", "n_eff"):
            want = np.asarray(getattr(e, f))
            assert_close(f"{f}[{bi}, {h}]", low[f][bi, h], want, 1e-9 * (1.0 + np.abs(want)))
        kv = h // 3
        s2 = naive_tail(q[bi, h].numpy(), k[bi, kv].numpy(), vv, p, None, torch.float64)
        assert_close(f"tail_moment[{bi}, {h}]", s2, e.tail_moment, 1e-9 * (1.0 + e.tail_moment))


def test_rounding_table_is_ordered():
    # a coarser dtype never gets a tighter allowance (guards edits of the table)
    assert rounding(torch.float64, 100) < rounding(torch.float32, 100) == rounding(torch.bfloat16, 100)
    assert output_cast(torch.float32) == 0.0 < output_cast(torch.float16) < output_cast(torch.bfloat16)
    for dtype in KERNEL_DTYPES:  # kernels store the statistics at the compute dtype, the output at the input's
        assert store_eps("lse", dtype) == EPS[COMPUTE[dtype]] == EPS[torch.float32]
        assert store_eps("output", dtype) == max(output_cast(dtype), EPS[torch.float32])


def test_tiled_rounding_is_the_tighter_bound_at_the_kernel_test_sizes():
    """One table, two reductions: the kernels' deterministic tiled bound never exceeds the torch
    path's sqrt(n) allowance at the sizes the kernel tests use (n <= 5000, block_n 16 to 128), so
    the kernel tests keep the tighter one rather than the shared sqrt(n) form."""
    for dtype in KERNEL_DTYPES:
        for block_n in (16, 32, 64, 128):
            for n in [*range(1, 301), 1000, 5000]:
                assert rounding(dtype, n, block_n) <= rounding(dtype, n), (dtype, block_n, n)


def test_no_test_module_imports_another():
    """Shared helpers live in tests/support.py (or a topic module beside it: model_fixtures.py,
    sketch_support.py): a test module imported by another would run its tests' module-level code
    (and skips) inside the importer, and hide what the importer depends on."""
    import ast
    from pathlib import Path

    offenders = []
    for path in sorted(Path(__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not offenders, offenders


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


@pytest.mark.parametrize("name", ["design", "estimators", "eviction", "certificates"])
def test_fast_docstring_examples(name):
    import doctest
    import importlib

    module = importlib.import_module(f"kvcert.fast.{name}")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
