"""The one-pass certificate of the fused decode kernel (``moments="onepass"``) against the float64 oracle.

Without a GPU these run on Triton's CPU interpreter (TRITON_INTERPRET=1); on a CUDA device they run the
compiled kernel. The tolerance is tests/kernel_support.py's (``assert_matches_oracle``, test_kernels_hajek.py's check): twice the error of
the reference's formulas at the input precision, plus the tiled rounding, plus the variance's derived
allowance, which for this mode adds the floor of the centred sums,

    gamma * sum_i c_i (|v_i - c_(i)| + sum |e| + |o_hat - c|)^2,

(c_(i) the centre token i's terms were formed around, sum |e| the moves of the centre after that, c the
final centre; ``kernel_support._variance_rounding`` derives it, ``kernel_centres`` replays the centres).
With centres that are kept values the floor does not grow with a common offset of the values; with the
raw form (c = 0, passed as ``value_center``) it grows with the offset squared, and at an offset of 100
the raw form fails the centred bound (the negative control).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from support import assert_same_variant, make_case, triton_kernels
from kernel_support import FIELDS, _without_fpc, assert_matches_oracle

KN, DEVICE = triton_kernels()  # skips this module without triton, or without CUDA and TRITON_INTERPRET=1
_make_case = functools.partial(make_case, device=DEVICE)
ROOT = Path(__file__).resolve().parents[1]


def onepass(q, k, v, pi, *, use_log=False, **kw):
    kw.setdefault("moments", "onepass")
    if use_log:
        return KN.hajek_attention(q, k, v, log_pi=torch.log(pi), **kw)
    return KN.hajek_attention(q, k, v, pi, **kw)


# ----------------------------------------------------------------------------- against the oracle

# (g, num_splits, dtype, n, pad, per_coordinate, use_log, regime, dv): every G in {1, 2, 4, 8, 16}, splits
# 1 / 3 / 7, the three input dtypes, ragged and empty heads, lengths around the tile (block 16), both paths
CASES = [
    (1, 1, torch.float32, 113, "ragged", True, False, "typical", 16),
    (1, 7, torch.bfloat16, 130, "none", False, True, "offset", 16),
    (2, 3, torch.bfloat16, 77, "ragged", True, True, "dominant", 16),
    (4, 7, torch.float32, 130, "ragged", False, True, "offset", 24),
    (4, 1, torch.float16, 1, "none", True, False, "typical", 16),
    (8, 3, torch.float16, 65, "empty_head", True, False, "typical", 16),
    (8, 7, torch.float32, 200, "ragged", False, True, "dominant", 16),
    (16, 7, torch.bfloat16, 33, "ragged", False, False, "typical", 16),
    (16, 1, torch.float32, 17, "none", True, False, "dominant", 16),
]


@pytest.mark.parametrize("g, splits, dtype, n, pad, per_coordinate, use_log, regime, dv", CASES)
def test_matches_reference(g, splits, dtype, n, pad, per_coordinate, use_log, regime, dv):
    q, k, v, pi = _make_case(n + g, 2, 2, g, n, 16, dv, dtype, regime=regime, pad=pad)
    est = onepass(q, k, v, pi, use_log=use_log, block_n=16, num_splits=splits, per_coordinate=per_coordinate)
    assert est.output.dtype == dtype and est.output.shape == (2, 2 * g, dv)
    assert (est.variance is None) != per_coordinate
    fields = FIELDS if per_coordinate else tuple(f for f in FIELDS if f != "variance")
    assert_matches_oracle(est, q, k, v, pi, dtype, fields=fields, block_n=16, num_splits=splits, moments="onepass")


@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_heads_and_zero_length(num_splits):
    """All-padding heads and n = 0: output 0, lse -inf, variance and trace +inf, n_eff 0, never NaN."""
    q, k, v, pi = _make_case(7, 2, 2, 2, 100, 16, 16, torch.float32, pad="ragged")
    pi[0, 1] = 0.0
    pi[1, 0] = 0.0
    for per_coordinate in (True, False):
        est = onepass(q, k, v, pi, block_n=16, num_splits=num_splits, per_coordinate=per_coordinate)
        fields = FIELDS if per_coordinate else tuple(f for f in FIELDS if f != "variance")
        assert_matches_oracle(est, q, k, v, pi, torch.float32, fields=fields, block_n=16, num_splits=num_splits,
                              moments="onepass")
        assert torch.equal(est.output[0, 2:], torch.zeros_like(est.output[0, 2:]))
        assert torch.isposinf(est.trace[1, :2]).all() and torch.equal(est.n_eff[1, :2], torch.zeros(2, device=DEVICE))
    est = onepass(torch.randn(1, 2, 16, device=DEVICE), torch.randn(1, 1, 0, 16, device=DEVICE),
                  torch.randn(1, 1, 0, 8, device=DEVICE), torch.ones(1, 1, 0, device=DEVICE))
    assert torch.equal(est.output, torch.zeros(1, 2, 8, device=DEVICE))
    assert torch.isneginf(est.lse).all() and torch.isposinf(est.variance).all() and torch.isposinf(est.trace).all()
    assert torch.equal(est.n_eff, torch.zeros(1, 2, device=DEVICE))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_certain_tokens_give_exactly_zero_variance(num_splits):
    """All pi = 1: u_i = 0, so U = S1 = S2 = 0 and the variance and trace are exactly 0 (pi and log pi)."""
    q, k, v, pi = _make_case(3, 2, 2, 4, 90, 16, 24, torch.float32, pi_kind="ones")
    for use_log in (False, True):
        for per_coordinate in (True, False):
            est = onepass(q, k, v, pi, use_log=use_log, block_n=16, num_splits=num_splits,
                          per_coordinate=per_coordinate)
            assert torch.equal(est.trace, torch.zeros_like(est.trace))
            if per_coordinate:
                assert torch.equal(est.variance, torch.zeros_like(est.variance))
    assert_matches_oracle(est, q, k, v, pi, torch.float32, fields=("output", "lse", "n_eff"), block_n=16,
                          num_splits=num_splits, moments="onepass")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_and_lse_do_not_depend_on_the_certificate(dtype):
    """certify=False, the trace alone, the per-coordinate variance and a given centre: one output, lse and
    n_eff (bit for bit on the interpreter; compiled, each variant is a kernel of its own)."""
    n = 77
    q, k, v, pi = _make_case(2, 2, 2, 4, n, 16, 16, dtype, pad="ragged")
    kw = dict(block_n=16, num_splits=3)
    full = onepass(q, k, v, pi, **kw)
    center = v.float().mean(2)
    variants = {"certify=False": onepass(q, k, v, pi, certify=False, **kw),
                "per_coordinate=False": onepass(q, k, v, pi, per_coordinate=False, **kw),
                "value_center": onepass(q, k, v, pi, value_center=center, **kw)}
    assert variants["certify=False"].trace is None and variants["certify=False"].n_eff is None
    for name, est in variants.items():
        for f in ("output", "lse") + (("n_eff",) if est.n_eff is not None else ()):
            assert_same_variant(f, getattr(est, f), getattr(full, f), dtype, n, 16, exact=KN.INTERPRETED)
    assert_matches_oracle(variants["value_center"], q, k, v, pi, dtype, block_n=16, num_splits=3,
                          moments="onepass", value_center=center)


# ----------------------------------------------------------------------------- the offset: the centred form

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_value_offset_100_centred_passes_raw_fails(dtype, num_splits):
    """Values v + 100: the centred sums pass the derived bound; the raw form (c = 0, given as
    ``value_center``) fails that same bound (its sums cancel at the scale of 100^2 sum c).

    bfloat16 inputs round the probabilities before P V, which moves o_hat and with it the variance by
    ~2^-9 of the spread: an allowance larger than the raw form's error. So the bfloat16 case takes
    probabilities exact in bfloat16 (q = 0, pi = 2^-k: p_i = pi_min / pi_i), where that term is 0 and
    the bound is float32's; the float32 case is the realistic one (random q, interior pi)."""
    n = 113
    if dtype == torch.float32:
        q, k, v, pi = _make_case(n, 1, 2, 4, n, 16, 16, dtype, pad="ragged", pi_kind="interior")
        v = v + 100.0
    else:
        rng = np.random.default_rng(5)
        q = torch.zeros(1, 8, 16, dtype=dtype, device=DEVICE)
        k = torch.from_numpy(rng.normal(size=(1, 2, n, 16))).to(dtype).to(DEVICE)
        v = torch.from_numpy(rng.normal(size=(1, 2, n, 16)) + 100.0).to(dtype).to(DEVICE)
        pi = torch.from_numpy(2.0 ** -rng.integers(0, 6, size=(1, 2, n))).float().to(DEVICE)
    p_rounding = dtype == torch.float32  # (no effect for float32 inputs)
    kw = dict(block_n=16, num_splits=num_splits)
    check = functools.partial(assert_matches_oracle, q=q, k=k, v=v, pi=pi, dtype=dtype, fields=("variance", "trace"),
                              moments="onepass", p_rounding=p_rounding, **kw)
    centred = onepass(q, k, v, pi, **kw)
    check(centred)
    raw = onepass(q, k, v, pi, value_center=torch.zeros(1, 2, 16, device=DEVICE), **kw)
    with pytest.raises(AssertionError, match="variance error"):
        check(raw)
    # the raw form passes its own (offset-squared) bound: the bound is not vacuous, it is the centring
    assert_matches_oracle(raw, q, k, v, pi, dtype, fields=("variance", "trace"), moments="onepass",
                          p_rounding=p_rounding, value_center=torch.zeros(1, 2, 16, device=DEVICE), **kw)


def test_the_one_pass_floor_is_what_separates_it_from_exact():
    """Why ``moments="auto"`` stays "exact": the one-pass variance is within the exact mode's own allowance
    in the typical, offset and single-dominant regimes, but not where two query heads of one KV head are
    dominated by different tokens with pi < 1 (the shared centre follows one of them; the other head's
    variance, ~1e-4 of its c-weighted spread, carries the floor). There it stays within its own bound."""
    for case in ((1, "typical"), (2, "offset"), (3, "dominant")):
        q, k, v, pi = _make_case(case[0], 1, 2, 4, 113, 16, 16, torch.float32, regime=case[1], pad="ragged")
        est = onepass(q, k, v, pi, block_n=16, num_splits=3)
        assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=3, moments="exact")
    rng = np.random.default_rng(2)
    n = 64
    qn, kn, vn = rng.normal(size=(1, 2, 16)), rng.normal(size=(1, 1, n, 16)), rng.normal(size=(1, 1, n, 16))
    kn[0, 0, 10], kn[0, 0, 40] = 4.0 * qn[0, 0], 4.0 * qn[0, 1]  # head 0 reads token 10, head 1 token 40
    pn = rng.uniform(0.05, 1.0, size=(1, 1, n))
    pn[0, 0, [10, 40]] = 0.5
    q, k, v = (torch.from_numpy(x).float().to(DEVICE) for x in (qn, kn, vn))
    pi = torch.from_numpy(pn).float().to(DEVICE)
    est = onepass(q, k, v, pi, block_n=16, num_splits=1)
    assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=1, moments="onepass")
    with pytest.raises(AssertionError, match="trace error|variance error"):
        assert_matches_oracle(est, q, k, v, pi, torch.float32, block_n=16, num_splits=1, moments="exact")
    exact = KN.hajek_attention(q, k, v, pi, block_n=16, moments="exact")
    assert_matches_oracle(exact, q, k, v, pi, torch.float32, block_n=16, num_splits=1, moments="exact")


def test_a_deliberate_error_fails_the_one_pass_bound():
    """Negative control of the bound besides the raw form: the kernel's variance passes, the variance a
    kernel without the (1 - pi) factor would give fails (on the same tiles, splits and centres)."""
    n = 113
    q, k, v, pi = _make_case(n, 1, 2, 4, n, 16, 16, torch.float32, pad="ragged", pi_kind="interior")
    est = onepass(q, k, v, pi, block_n=16, num_splits=3)
    check = functools.partial(assert_matches_oracle, q=q, k=k, v=v, pi=pi, dtype=torch.float32, fields=("variance",),
                              block_n=16, num_splits=3, moments="onepass")
    check(est)
    with pytest.raises(AssertionError, match="variance error"):
        check(dataclasses.replace(est, variance=_without_fpc(est, q, k, v, pi)))


# ----------------------------------------------------------------------------- the argument

@pytest.mark.parametrize("kw, exc, match", [
    (dict(value_center=torch.zeros(1, 2, 4)), ValueError, r"value_center must have shape \(b, h_kv, dv\)"),
    (dict(value_center=np.zeros((1, 2, 8))), TypeError, "value_center must be a torch.Tensor"),
    (dict(value_center=torch.zeros(1, 2, 8, dtype=torch.int32)), TypeError, "floating-point"),
    (dict(value_center=torch.full((1, 2, 8), float("nan"))), ValueError, "value_center must be finite"),
    (dict(value_center=torch.zeros(1, 2, 8), moments="exact"), ValueError, "not of moments='exact'"),
    (dict(moments="one-pass"), ValueError, "moments must be 'auto', 'onepass'"),
])
def test_bad_arguments_raise(kw, exc, match):
    q, k, v, pi = (torch.randn(1, 4, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 8), torch.rand(1, 2, 5))
    kw = {key: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for key, x in kw.items()}
    kw.setdefault("moments", "onepass")
    with pytest.raises(exc, match=match):
        KN.hajek_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pi.to(DEVICE), **kw)


def test_default_tiles_are_halved_for_the_one_pass_moments():
    cpu = torch.device("cpu")
    assert KN.default_config(100, 128, 4, cpu, dtype=torch.bfloat16, moments="onepass")["block_n"] == 32
    assert KN.default_config(100, 128, 4, cpu, dtype=torch.float32, moments="onepass")["block_n"] == 16
    assert KN.default_config(100, 128, 4, cpu, dtype=torch.bfloat16)["block_n"] == 64
    assert KN.default_moments(torch.bfloat16) == "exact"


# ----------------------------------------------------------------------------- the prepared GPU check

def test_gpu_check_dry_run(tmp_path):
    """benchmarks/gpu_check.py --dry-run runs every part at tiny sizes and writes its JSON, with the
    top-level targets."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "gpu_check.json"
    mod.main(["--dry-run", "--device", DEVICE, "--out", str(out)])
    rep = json.loads(out.read_text())
    for key in ("environment", "copy_bandwidth", "correctness", "timings", "sweep", "eviction", "compiled", "targets",
                "errors", "summary"):
        assert key in rep, key
    assert rep["dry_run"] and rep["errors"] == [], rep["errors"]
    assert rep["summary"]["correctness_ok"] is True
    assert {r["moments"] for r in rep["correctness"]} == {"onepass", "exact", "shifted"}
    res = rep["timings"][0]["results"]
    for name in ("onepass_trace", "onepass_var", "onepass_nocert", "exact_trace", "shifted_trace", "sdpa_mask[auto]",
                 "sdpa_nomask[auto]"):
        assert res[name]["median_ms"] > 0 and res[name]["q20_ms"] <= res[name]["q80_ms"], name
    assert "flashinfer_decode" in res and rep["sweep"][0]["runs"]
    t = rep["targets"]
    for key in ("card", "certified_over_uncertified_max", "certified_vs_sdpa_min_4k", "copy_fraction_min_16k",
                "by_variant"):
        assert key in t, key
    assert t["certified_over_uncertified_max"] > 0 and t["certified_vs_sdpa_min_4k"] > 0
    assert set(t["by_variant"]) >= {"onepass_trace", "onepass_var", "exact_trace", "exact_var"}
    ev = rep["eviction"][0]  # the eviction event against the prefill (tests/test_gpu_check.py: the section)
    assert ev["checks"]["ok"] and t["eviction_over_prefill_max"] == ev["event_over_prefill"] > 0


def test_gpu_check_refuses_a_full_run_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--dry-run" in proc.stderr


# ----------------------------------------------------------------------------- the compiled path

_COMPILE = r"""
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvcert.kernels import aot, hajek as H

rows = []
for dt, per_coord, split in (("bf16", True, True), ("fp32", False, False)):
    _, cfg, const = aot._tile_constants(dt, 128, None, 4, None, True)
    const.update(BLOCK_N=cfg["block_n"] // 2, CERTIFY=True, PER_COORD=per_coord, SPLIT=split, ROUND_P=dt != "fp32",
                 HAS_CENTER=False)
    ptr = {"Q": dt, "K": dt, "V": dt, "Out": dt, "P": "fp32", "C": "fp32",
           **{n: "fp32" for n in ("Lse", "Var", "Tr", "Neff", "PartS", "PartV")}}
    src = ASTSource(H._hajek_onepass_kernel, aot._signature(H._hajek_onepass_kernel, const, ptr), constexprs=const)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
    rows.append(dict(kernel="onepass", dtype=dt, per_coordinate=per_coord, split=split, **aot.resource_usage(k)))
const = dict(DV=128, DV_PAD=128, BLOCK_R=16, CERTIFY=True, PER_COORD=False, ROUND_P=True)
ptr = {"Out": "bf16", **{n: "fp32" for n in ("PartS", "PartV", "Lse", "Var", "Tr", "Neff")}}
src = ASTSource(H._onepass_merge_kernel, aot._signature(H._onepass_merge_kernel, const, ptr), constexprs=const)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
rows.append(dict(kernel="onepass_merge", **aot.resource_usage(k)))
json.dump(rows, sys.stdout)
"""


@pytest.mark.slow
def test_onepass_compiles_for_sm90_without_a_gpu():
    """The compiled (not interpreted) one-pass kernel and its merge lower to sm_90 cubins at the default
    tiles, without register spills (ptxas; Triton's bundled one, no GPU needed)."""
    import json

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["kernel"] for r in rows] == ["onepass", "onepass", "onepass_merge"]
    for r in rows:
        assert r["stack_bytes"] in (0, None), r
