"""The fused Triton decode kernel (kvcert.kernels) against the float64 oracle and kvcert.fast.

Without a GPU these run on Triton's CPU interpreter (TRITON_INTERPRET=1, set by
``make test`` before anything imports Triton). Tolerances follow STYLE.md: the
kernel's error against the float64 reference must stay within twice the error
of the reference's own formulas evaluated at the input dtype (a naive torch
mirror, flash-attention's criterion) plus one unit of rounding of the field,
measured per query head relative to that head's scale (heads differ by orders
of magnitude in variance).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from kernel_support import DEVICE, FIELDS, KN, _make_case, _oracle, _without_fpc, assert_matches_oracle
from kvcert import reference as R
from support import (KERNEL_DTYPES, assert_same_variant, assert_within_scale, decode_case, field_scale, rounding,
                     store_eps, variant_tolerance)

DTYPES = KERNEL_DTYPES


def _run(q, k, v, pi, *, use_log=False, **kw):
    if use_log:
        return KN.hajek_attention(q, k, v, log_pi=torch.log(pi), **kw)
    return KN.hajek_attention(q, k, v, pi, **kw)


# ----------------------------------------------------------------------------- properties

@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(decode_case())
def test_matches_reference(c):
    case, kw = c
    q, k, v, pi = _make_case(**case)
    est = _run(q, k, v, pi, **kw)
    assert est.output.dtype == case["dtype"] and est.output.shape == (case["b"], q.shape[1], case["dv"])
    for f in ("lse", "variance", "trace", "n_eff"):
        assert getattr(est, f).dtype == torch.float32
    assert est.weights is None and est.max_term is None
    assert_matches_oracle(est, q, k, v, pi, case["dtype"], block_n=kw["block_n"], num_splits=kw["num_splits"],
                          moments=kw["moments"])


@settings(max_examples=15, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(decode_case())
def test_matches_fast(c):
    """|kernel - fast| within the kernel's budget plus fast's own error against the oracle."""
    fast = pytest.importorskip("kvcert.fast")
    case, kw = c
    q, k, v, pi = _make_case(**case)
    est = _run(q, k, v, pi, **kw)
    other = fast.hajek_attention(q, k, v, pi)
    assert_matches_oracle(est, q, k, v, pi, case["dtype"], block_n=kw["block_n"], num_splits=kw["num_splits"],
                          other=other, moments=kw["moments"])


# ----------------------------------------------------------------------------- tiling and splits

BLOCK = 32


@pytest.mark.parametrize("dtype, moments", [(torch.float32, "exact"), (torch.bfloat16, "shifted"),
                                            (torch.float32, "shifted"), (torch.bfloat16, "exact")])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("n", [1, 3, 113, BLOCK - 1, BLOCK, BLOCK + 1])
def test_tile_breaking_lengths(n, num_splits, dtype, moments):
    q, k, v, pi = _make_case(n, 1, 2, 4, n, 64, 64, dtype, pad="ragged", pi_kind="interior")
    est = KN.hajek_attention(q, k, v, pi, block_n=BLOCK, num_splits=num_splits, moments=moments)
    assert_matches_oracle(est, q, k, v, pi, dtype, block_n=BLOCK, num_splits=num_splits, moments=moments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_derived_tolerance_rejects_a_kernel_with_a_deliberate_error(dtype):
    """Negative control of :func:`assert_matches_oracle`: the kernel's estimate passes, and each of
    these deliberate errors fails it: the -log pi offset dropped (plain attention over the kept
    tokens), the variance without its (1 - pi) factor, and, for float32 inputs, every field moved by
    20 units of the tolerance's rounding term (a kernel whose error grows beyond its tiling's bound;
    for bfloat16 inputs the tolerance is the inputs' own rounding, far larger)."""
    import dataclasses

    n = 113
    q, k, v, pi = _make_case(n, 1, 2, 4, n, 64, 64, dtype, pad="ragged", pi_kind="interior")
    est = KN.hajek_attention(q, k, v, pi, block_n=BLOCK, num_splits=3)
    assert_matches_oracle(est, q, k, v, pi, dtype, block_n=BLOCK, num_splits=3)
    plain = KN.hajek_attention(q, k, v, torch.where(pi > 0, torch.ones_like(pi), pi), block_n=BLOCK, num_splits=3)
    wrong = {"output": dataclasses.replace(est, output=plain.output),
             "variance": dataclasses.replace(est, variance=_without_fpc(est, q, k, v, pi))}
    step = 20 * rounding(dtype, n, BLOCK)
    for f in FIELDS if dtype == torch.float32 else ():  # half inputs: their own rounding dominates
        x = getattr(est, f)
        wrong[f"{f} + 20 rounding"] = dataclasses.replace(est, **{f: x + step * x.abs().amax(-1, keepdim=True)
                                                                  if x.dim() == 3 else x + step * x.abs()})
    for name, bad in wrong.items():
        field = name.split()[0]
        with pytest.raises(AssertionError):
            assert_matches_oracle(bad, q, k, v, pi, dtype, block_n=BLOCK, num_splits=3, fields=(field,))


@pytest.mark.parametrize("d, dv, g, h_kv", [(128, 128, 4, 2), (40, 24, 3, 1), (16, 16, 20, 1)])
def test_head_dims_and_groups(d, dv, g, h_kv):
    """d = 128 (the realistic case), non-power-of-two dims, and g = 20 > 16 query heads per KV head
    (two row blocks per KV head)."""
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, pi = _make_case(d + g, 1, h_kv, g, 70, d, dv, dtype, pad="ragged")
        est = KN.hajek_attention(q, k, v, pi, block_n=32, num_splits=2)
        assert_matches_oracle(est, q, k, v, pi, dtype, block_n=32, num_splits=2)


# ----------------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_heads_follow_the_reference_convention(num_splits):
    """All-padding heads: output 0, lse -inf, variance/trace +inf, n_eff 0, no NaN anywhere."""
    q, k, v, pi = _make_case(7, 2, 2, 2, 100, 16, 16, torch.float32, pad="ragged")
    pi[0, 1] = 0.0
    pi[1, 0] = 0.0
    for use_log in (False, True):
        est = _run(q, k, v, pi, use_log=use_log, block_n=16, num_splits=num_splits)
        assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=num_splits)
        assert torch.equal(est.output[0, 2:], torch.zeros_like(est.output[0, 2:]))
        assert torch.isneginf(est.lse[0, 2:]).all() and torch.isposinf(est.trace[1, :2]).all()


def test_zero_length_cache():
    q = torch.randn(1, 2, 16, device=DEVICE)
    k = torch.randn(1, 1, 0, 16, device=DEVICE)
    v = torch.randn(1, 1, 0, 8, device=DEVICE)
    est = KN.hajek_attention(q, k, v, torch.ones(1, 1, 0, device=DEVICE))
    assert torch.equal(est.output, torch.zeros(1, 2, 8, device=DEVICE))
    assert torch.isneginf(est.lse).all() and torch.isposinf(est.variance).all() and torch.isposinf(est.trace).all()
    assert torch.equal(est.n_eff, torch.zeros(1, 2, device=DEVICE))


@pytest.mark.parametrize("use_log", [False, True])
def test_certain_tokens_give_exact_attention_and_zero_variance(use_log):
    """All pi = 1: the Hajek estimate is plain attention and every variance is exactly 0
    (1 - pi = 0 zeroes each weight, with log pi = 0 as well)."""
    q, k, v, pi = _make_case(3, 2, 2, 2, 90, 16, 24, torch.float32, pi_kind="ones")
    est = _run(q, k, v, pi, use_log=use_log, block_n=16, num_splits=2)
    assert torch.equal(est.variance, torch.zeros_like(est.variance))
    assert torch.equal(est.trace, torch.zeros_like(est.trace))
    assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=2, fields=("output", "lse", "n_eff"))
    g = 2
    for bi in range(2):
        for h in range(4):
            o = R.attention(q[bi, h].double().cpu().numpy(), k[bi, h // g].double().cpu().numpy(),
                            v[bi, h // g].double().cpu().numpy())
            assert np.allclose(est.output[bi, h].cpu().numpy(), o, rtol=0,
                               atol=rounding(torch.float32, 90, 16) * np.abs(v.cpu().numpy()).max())


def test_log_pi_path_matches_pi_path():
    """pi near 1 is where 1 - pi = -expm1(log pi) cancels: the two paths must agree to a few ulps.

    1 - pi is exact from pi (Sterbenz); from log pi it carries the rounding of log (eps/2,
    relative, propagated as eps/2) and of the series (7 fused steps): <= 8 eps relative on each
    positive weight c_i, so on the variance, plus the accumulation bound of the two runs."""
    rng = np.random.default_rng(11)
    q, k, v, _ = _make_case(11, 1, 2, 2, 150, 16, 16, torch.float32)
    pi = torch.from_numpy(rng.uniform(0.75, 1.0, size=(1, 2, 150))).float()
    pi[..., ::7] = 1.0
    pi = pi.to(DEVICE)
    a = KN.hajek_attention(q, k, v, pi, block_n=32)
    b = KN.hajek_attention(q, k, v, log_pi=torch.log(pi), block_n=32)
    eps = torch.finfo(torch.float32).eps
    tol = 8 * eps + 2 * rounding(torch.float32, 150, 32)
    assert not _paths_differ(a, b, tol), _paths_differ(a, b, tol)
    # negative control: log pi off by 0.1% (1 - pi by about as much) is caught
    bad = KN.hajek_attention(q, k, v, log_pi=torch.log(pi) * (1 + 1e-3), block_n=32)
    assert _paths_differ(a, bad, tol)


def _paths_differ(a, b, tol) -> list[str]:
    """The fields of two estimates whose difference exceeds ``tol`` against the field's scale: an output or
    per-coordinate variance row against its largest entry (a coordinate near 0 carries the row's rounding,
    not its own), lse against max(|lse|, 1) (log's rounding is absolute below 1), trace and n_eff against
    themselves."""
    out = []
    for f in ("variance", "trace", "output", "lse", "n_eff"):
        x, y = getattr(a, f).double().cpu().numpy(), getattr(b, f).double().cpu().numpy()
        rel = (np.abs(x - y) / np.maximum(field_scale(f, y), 1e-30)).max()
        if rel > tol:
            out.append(f"{f}: log_pi and pi paths differ by {rel:.2e} of its scale (tol {tol:.2e})")
    return out


def test_float64_probabilities_below_float32_range():
    """float64 pi of 1e-50 would round to 0 (= padding) in float32; the kernel keeps the token
    (its logit bias is +115, so it carries almost all the weight)."""
    q, k, v, pi = _make_case(5, 1, 1, 2, 40, 16, 16, torch.float32, pi_kind="interior")
    pi = pi.double()
    pi[0, 0, 3] = 1e-50
    est = KN.hajek_attention(q, k, v, pi, block_n=16)
    ref = _oracle(q, k, v, pi)
    # the table's lse allowance against max(|lse|, 1) (assert_matches_oracle's, less its low-precision
    # term: the float32 mirror would round pi = 1e-50 to padding): one store, the tiled sum of n = 40
    tol = store_eps("lse", torch.float32) + rounding(torch.float32, 40, 16)
    assert_within_scale("lse", est.lse, ref["lse"], tol, "lse")
    with pytest.raises(AssertionError):  # negative control: 20 units of it
        assert_within_scale("lse", ref["lse"] + 20 * tol * field_scale("lse", ref["lse"]), ref["lse"], tol, "lse")
    vmax = np.abs(v.cpu().numpy()).max()
    assert np.allclose(est.output.double().cpu().numpy(), ref["output"], rtol=0,
                       atol=rounding(torch.float32, 40, 16) * vmax)


def test_per_coordinate_false_and_certify_false():
    q, k, v, pi = _make_case(2, 1, 2, 2, 77, 16, 16, torch.bfloat16, pad="ragged")
    full = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=2)
    tr = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=2, per_coordinate=False)
    plain = KN.hajek_attention(q, k, v, pi, block_n=16, num_splits=2, certify=False)
    assert tr.variance is None and plain.variance is None and plain.trace is None and plain.n_eff is None
    for x, y, f in ((tr.trace, full.trace, "trace"), (tr.output, full.output, "output"),
                    (plain.output, full.output, "output"), (plain.lse, full.lse, "lse")):
        assert_same_variant(f, x, y, torch.bfloat16, 77, 16, exact=KN.INTERPRETED)
    # negative control of the compiled kernel's comparison (run here on the interpreter's results): each
    # field moved by 20 units of its allowance fails it
    for x, f in ((full.trace, "trace"), (full.output, "output"), (full.lse, "lse")):
        step = 20 * variant_tolerance(f, torch.bfloat16, 77, 16)
        moved = x.double().cpu() + step * torch.from_numpy(field_scale(f, x))
        assert_same_variant(f, x, x, torch.bfloat16, 77, 16, exact=False)
        with pytest.raises(AssertionError):
            assert_same_variant(f, moved, x, torch.bfloat16, 77, 16, exact=False)


def test_strided_inputs_and_4d_query():
    """Any strides (a (b, n, h, d) cache viewed as (b, h, n, d)) and q of shape (b, h_q, 1, d)."""
    q, k, v, pi = _make_case(4, 2, 2, 2, 50, 16, 16, torch.float32, pad="ragged")
    ks, vs = k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    ps = pi.transpose(1, 2).contiguous().transpose(1, 2)
    assert not ks.is_contiguous()
    base = KN.hajek_attention(q, k, v, pi, block_n=16)
    est = KN.hajek_attention(q.unsqueeze(2), ks, vs, ps, block_n=16)
    assert est.output.shape == (2, 4, 1, 16) and est.trace.shape == (2, 4, 1)
    for f in FIELDS:
        assert torch.equal(getattr(est, f).squeeze(2), getattr(base, f)), f


# ----------------------------------------------------------------------------- bad input

def _good():
    return (torch.randn(1, 4, 16, device=DEVICE), torch.randn(1, 2, 5, 16, device=DEVICE),
            torch.randn(1, 2, 5, 8, device=DEVICE), torch.rand(1, 2, 5, device=DEVICE))


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: dict(a, q=a["q"][0]), ValueError, "q must have shape"),
    (lambda a: dict(a, q=a["q"].unsqueeze(2).expand(1, 4, 2, 16)), ValueError, "decode kernel"),
    (lambda a: dict(a, keys=a["keys"][..., :8]), ValueError, "keys must have shape"),
    (lambda a: dict(a, values=a["values"][:, :, :4]), ValueError, "values must have shape"),
    (lambda a: dict(a, pi=a["pi"][..., :4]), ValueError, "pi must have shape"),
    (lambda a: dict(a, q=a["q"][:, :3]), ValueError, "multiple of h_kv"),
    (lambda a: dict(a, q=a["q"].double(), keys=a["keys"].double(), values=a["values"].double()),
     TypeError, "dtype float16, bfloat16 or float32"),
    (lambda a: dict(a, q=a["q"].half()), TypeError, "share one dtype"),
    (lambda a: dict(a, pi=None), TypeError, "exactly one of pi and log_pi"),
    (lambda a: dict(a, log_pi=torch.log(a["pi"])), TypeError, "exactly one of pi and log_pi"),
    (lambda a: dict(a, pi=a["pi"] + 1.5), ValueError, r"pi must lie in \[0, 1\]"),
    (lambda a: dict(a, pi=a["pi"].masked_fill(a["pi"] > 0.5, float("nan"))), ValueError, "pi must lie"),
    (lambda a: dict(a, pi=None, log_pi=torch.ones(1, 2, 5)), ValueError, r"log_pi must lie in \[-inf, 0\]"),
    (lambda a: dict(a, pi=(a["pi"] > 2).long()), TypeError, "floating-point"),
    (lambda a: dict(a, q=a["q"].masked_fill(a["q"] > 1, float("inf"))), ValueError, "q must be finite"),
    (lambda a: dict(a, block_n=24), ValueError, "block_n must be a power of two"),
    (lambda a: dict(a, num_splits=0), ValueError, "num_splits must be a positive int"),
    (lambda a: dict(a, scale=float("nan")), ValueError, "scale must be a finite positive"),
    (lambda a: dict(a, moments="fast"), ValueError, "moments must be"),
    (lambda a: dict(a, keys=a["keys"].numpy() if a["keys"].device.type == "cpu" else None),
     TypeError, "keys must be a torch.Tensor"),
])
def test_bad_input_raises(mutate, exc, match):
    q, k, v, pi = _good()
    args = mutate(dict(q=q, keys=k, values=v, pi=pi))
    if "log_pi" in args and args["log_pi"] is not None:
        args["log_pi"] = args["log_pi"].to(DEVICE)
    with pytest.raises(exc, match=match):
        KN.hajek_attention(**args)


# ----------------------------------------------------------------------------- real GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or KN.INTERPRETED,
                         reason="needs a CUDA device and the compiled (not interpreted) kernel")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_realistic_decode(dtype):
    """b=2, h_q=32, h_kv=8, d=128, n=5000 ragged, default block and split choice, against the
    oracle and kvcert.fast; the one-pass moments against the oracle."""
    fast = pytest.importorskip("kvcert.fast")
    q, k, v, pi = _make_case(0, 2, 8, 4, 5000, 128, 128, dtype, pad="ragged")
    est = KN.hajek_attention(q, k, v, pi)
    assert_matches_oracle(est, q, k, v, pi, dtype)
    assert_matches_oracle(est, q, k, v, pi, dtype, other=fast.hajek_attention(q, k, v, pi))
    est_log = KN.hajek_attention(q, k, v, log_pi=torch.log(pi), num_splits=7, block_n=32)
    assert_matches_oracle(est_log, q, k, v, pi, dtype, block_n=32, num_splits=7)
    for per_coordinate in (True, False):  # the one-pass moments at their default tiles and splits
        est_op = KN.hajek_attention(q, k, v, log_pi=torch.log(pi), moments="onepass", per_coordinate=per_coordinate)
        assert_matches_oracle(est_op, q, k, v, pi, dtype, moments="onepass",
                              fields=FIELDS if per_coordinate else ("output", "lse", "trace", "n_eff"))


# ----------------------------------------------------------------------------- benchmark script

def test_gpu_benchmark_dry_run(tmp_path):
    """benchmarks/gpu_decode.py runs every code path at tiny sizes and writes its JSON."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"
    spec = importlib.util.spec_from_file_location("gpu_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dry.json"
    mod.main(["--dry-run", "--device", DEVICE, "--batch", "1", "--kept", "40", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["dry_run"] and rep["summary"]["correctness_ok"] is True
    assert rep["summary"]["correctness_cases"] == 12 and len(rep["timings"]) == 1 and rep["tuning"]
    res = rep["timings"][0]["results"]
    for name in ("hajek", "hajek_nocert", "sdpa_mask[auto]", "sdpa_nomask[auto]"):
        assert res[name]["median_ms"] > 0 and res[name]["q20_ms"] <= res[name]["q80_ms"], name
    t = rep["targets"][0]
    assert t["fastest_sdpa"].startswith("sdpa") and t["throughput_vs_fastest_sdpa"] > 0
    assert rep["measured_on_gpu"] == (DEVICE == "cuda")


@pytest.mark.slow
def test_compiles_for_sm90_without_a_gpu():
    """The compiled (non-interpreted) kernels lower to sm_90 cubins: the interpreter cannot catch
    type or layout errors of the compiled path. Runs in a subprocess without TRITON_INTERPRET."""
    import json
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "kvcert.kernels.aot", "--dtype", "bf16"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["kernels"]
    assert len(rows) == 5 and all(r["ok"] for r in rows), rows
    assert [r["kernel"] for r in rows] == ["decode"] * 3 + ["merge", "tail_moment"]


def test_aot_refuses_a_moments_mode_its_kernel_does_not_have():
    """kernels.aot compiles the two-pass kernel: a mode it lacks ("onepass", a typo) is refused by name rather
    than silently compiled as another mode."""
    from kvcert.kernels import aot

    for bad in ("onepass", "exactt"):
        with pytest.raises(ValueError, match="moments must be 'exact' or 'shifted'"):
            aot.compile_decode(moments=bad)
