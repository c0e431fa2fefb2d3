"""The paged Triton decode kernel (kvcert.kernels.paged_block_hajek_attention) against the block estimator.

Runs on Triton's CPU interpreter where there is no GPU:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kernels_paged.py -x -q

Oracle: ``kvcert.fast.block_hajek_attention`` in float64 over the kept blocks
gathered contiguous (and, on one case, ``kvcert.reference.block_hajek_attention``,
the NumPy oracle). Tolerances (STYLE.md, flash-attention style): for float32
inputs ``|kernel - f64| <= 2 |fast_f32 - f64| + allowance * scale`` with scale the
field's natural size (output: max|v|; lse: |lse| + 1; trace: W max ||v||^2,
W = sum_b (1 - pi_b) A_b^2 <= 1, the bound of the float32 rounding of the Chan
form, docs/gpu.md) and :func:`allowance` the shared table's (tests/support.py):
the tiled accumulation bound ``rounding(float32, n, block_t)`` plus one store of the
field; for half inputs the f64 oracle runs on the upcast half values and the
allowance adds one eps of the input dtype (p is rounded to it for the P V
product, as in flash attention: half an ulp per weight, one in a_i^2).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from kvcert import fast  # noqa: E402
from kvcert import reference as ref  # noqa: E402
from kernel_support import as_on_sms  # noqa: E402
from support import EPS, rounding, store_eps  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()),
    reason="needs a GPU or TRITON_INTERPRET=1 (Triton's CPU interpreter)",
)

kernels = pytest.importorskip("kvcert.kernels")
DEV = "cpu" if kernels.INTERPRETED else "cuda"
NEG_INF = float("-inf")


def paged(*args, **kwargs):
    """``kernels.paged_block_hajek_attention`` on DEV (CUDA when compiled, the CPU under the interpreter), its
    estimate brought back to the CPU beside the oracle (the cases are built on the CPU)."""
    to = lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x  # noqa: E731
    est = kernels.paged_block_hajek_attention(*map(to, args), **{k: to(v) for k, v in kwargs.items()})
    if DEV == "cpu":
        return est
    back = {f.name: getattr(est, f.name).cpu() for f in dataclasses.fields(est)
            if isinstance(getattr(est, f.name), torch.Tensor)}
    return dataclasses.replace(est, **back)


def allowance(dtype, field, n, bs, extra_tiles=0, block_t=None):
    """Rounding allowance of a paged kernel's ``field`` over n slots, relative to the field's scale: the
    shared table's tiled accumulation bound ``rounding(dtype, n, block_t)`` for whichever sub-tile
    block_t in [16, bs] the kernel picks, and ``block_t`` when given (the compacted kernel's tiles, gathered
    across blocks, are not bounded by bs) (``extra_tiles``: tile merges beyond ceil(n / block_t), e.g. the
    compacted kernel's second unit loop), one store of the field (``store_eps``), and for half inputs
    the probabilities rounded to the input dtype before P V (half an ulp each: one eps_dtype in a_i^2)."""
    tiles = [t for t in (16, 32, 64, 128, 256) if t <= max(bs, 16)] + ([block_t] if block_t else [])
    r = max(rounding(dtype, max(n, 1) + extra_tiles * t, t) for t in tiles) + store_eps(field, dtype)
    return r + (EPS[dtype] if dtype != torch.float32 else 0.0)


def make_case(*, seq_lens, h_kv, g, d, dv=None, bs, extra_blocks=3, evict=0.4, certain=0.2, dtype=torch.float32,
              seed=0, poison=True, value_offset=0.0):
    """Random paged cache, shuffled physical ids, per-block log pi (-inf evicted, 0 certain).

    ``poison``: NaN written into every evicted block, into the slots past each
    sequence's end, and garbage ids (-1, or past the cache) into the table
    entries of evicted blocks and past the end: none of it may be read.
    """
    gen = torch.Generator().manual_seed(seed)
    dv = dv or d
    S = len(seq_lens)
    nbt = [-(-L // bs) for L in seq_lens]
    M = max(max(nbt), 1) + 1  # one spare column past the longest sequence
    nb = sum(nbt) + extra_blocks
    kc = torch.randn(nb, bs, h_kv, d, generator=gen)
    vc = torch.randn(nb, bs, h_kv, dv, generator=gen) + value_offset
    ids = torch.randperm(nb, generator=gen)
    table = torch.full((S, M), nb + 7, dtype=torch.int32)  # garbage past the end
    lp = torch.full((S, M), NEG_INF)
    c = 0
    for s, n in enumerate(nbt):
        table[s, :n] = ids[c:c + n].to(torch.int32)
        c += n
        u = torch.rand(n, generator=gen)
        lp[s, :n] = torch.log(torch.rand(n, generator=gen) * 0.9 + 0.05)
        lp[s, :n] = torch.where(u < certain, 0.0, lp[s, :n])
        lp[s, :n] = torch.where((u > 1 - evict), NEG_INF, lp[s, :n])
        if n:
            lp[s, n - 1] = 0.0  # the decode block is certain (as in the plugin)
    if poison:
        for s, n in enumerate(nbt):
            for j in range(n):
                if lp[s, j] == NEG_INF:
                    kc[table[s, j].long()] = float("nan")
                    vc[table[s, j].long()] = float("nan")
                    table[s, j] = -1 if j % 2 else nb + 3
            L = seq_lens[s]
            if L % bs and n:
                kc[table[s, n - 1].long(), L % bs:] = float("nan")
                vc[table[s, n - 1].long(), L % bs:] = float("nan")
    q = torch.randn(S, h_kv * g, d, generator=gen)
    return dict(q=q.to(dtype), key_cache=kc.to(dtype), value_cache=vc.to(dtype), block_table=table,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), log_pi_blocks=lp.to(torch.float32), bs=bs)


def gathered(case, s):
    """Sequence s's kept blocks gathered contiguous: K, V (1, h_kv, m bs, d), log pi, positions (1, h_kv, m bs)."""
    bs, L = case["bs"], int(case["seq_lens"][s])
    lp = case["log_pi_blocks"][s]
    kept = [j for j in range(-(-L // bs)) if lp[j] > NEG_INF]
    h_kv, d = case["key_cache"].shape[2], case["key_cache"].shape[3]
    dv = case["value_cache"].shape[3]
    if not kept:
        z = torch.zeros(1, h_kv, 0, d, dtype=torch.float64)
        return z, torch.zeros(1, h_kv, 0, dv, dtype=torch.float64), torch.zeros(1, h_kv, 0), \
            torch.zeros(1, h_kv, 0, dtype=torch.int64)
    ids = case["block_table"][s, kept].long()
    k = case["key_cache"][ids].double().reshape(-1, h_kv, d)  # (m bs, h_kv, d)
    v = case["value_cache"][ids].double().reshape(-1, h_kv, dv)
    pos = (torch.tensor(kept)[:, None] * bs + torch.arange(bs)).reshape(-1)
    inside = pos < L
    lpt = torch.where(inside, lp[kept].double().repeat_interleave(bs), NEG_INF)
    k = torch.where(inside[:, None, None], k, 0.0)  # the slots past the end hold poison: padding is finite
    v = torch.where(inside[:, None, None], v, 0.0)
    pos = torch.where(inside, pos, -1)
    ex = lambda x: x.permute(1, 0, 2)[None]  # noqa: E731
    return ex(k), ex(v), lpt.expand(1, h_kv, -1), pos.expand(1, h_kv, -1)


def oracle(case, s, dtype=torch.float64, scale=None):
    k, v, lpt, pos = gathered(case, s)
    q = case["q"][s:s + 1].to(dtype)
    est = fast.block_hajek_attention(q, k.to(dtype), v.to(dtype), log_pi=lpt.to(dtype), block_size=case["bs"],
                                     positions=pos, scale=scale, per_coordinate=True, return_weights=True)
    return est, v


def _report(name, got, want, tol):
    err = (got.double() - want.double()).abs()
    bad = ~(err <= tol)
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{name}: max err {float(err.max()):.3g}, mean {float(err.mean()):.3g}, worst at {idx}: "
                             f"got {float(got[idx]):.8g} want {float(want[idx]):.8g} tol {float(torch.as_tensor(tol).expand_as(err)[idx]):.3g}")
    return float(err.max()) if err.numel() else 0.0


def check_against_fast(case, est, *, scale=None, nudge=None):
    """Compare every field of the kernel's estimate, per sequence, with the float64 (and float32) oracle.

    ``nudge``: (field, units) moves that field of the estimate by ``units`` of its rounding allowance
    (times the field's scale) before the comparison: the negative control."""
    dt = case["q"].dtype
    half = dt != torch.float32
    errs = {}
    for s in range(case["q"].shape[0]):
        n = gathered(case, s)[0].shape[2]  # the slots of the kept blocks
        if n == 0:  # nothing kept: the empty-sample convention
            assert bool((est.output[s] == 0).all()) and bool(torch.isneginf(est.lse[s]).all())
            assert bool(torch.isposinf(est.trace[s]).all()) and bool((est.n_eff[s] == 0).all())
            continue
        e64, v = oracle(case, s, torch.float64, scale)
        e32 = None if half else oracle(case, s, torch.float32, scale)[0]
        lse = e64.lse[0]
        vmax = float(v.abs().max()) if v.numel() else 0.0
        v2max = float((v * v).sum(-1).max()) if v.numel() else 0.0
        # W = sum_b (1 - pi_b) A_b^2 per query head (the weight mass of the certificate state)
        a = e64.weights[0]  # (h_q, m bs)
        bs = case["bs"]
        A = a.reshape(a.shape[0], -1, bs).sum(-1)
        omp = -torch.expm1(case["log_pi_blocks"][s].double())
        L = int(case["seq_lens"][s])
        kept = [j for j in range(-(-L // bs)) if case["log_pi_blocks"][s, j] > NEG_INF]
        W = (omp[kept][None, :] * A * A).sum(-1)

        def tol(fld, scl):
            base = 2 * (getattr(e32, fld)[0].double() - getattr(e64, fld)[0]).abs() if e32 is not None else 0.0
            return base + allowance(dt, fld, n, bs) * scl + 1e-30

        for fld, scl in (("output", vmax * 2), ("lse", lse.abs() + 1), ("trace", W * v2max + e64.trace[0].abs()),
                         ("variance", (W * v2max)[:, None] + e64.variance[0].abs()),
                         ("n_eff", e64.n_eff[0].abs())):
            got = getattr(est, fld)
            if got is None:
                continue
            got = got[s].double()
            if nudge is not None and nudge[0] == fld:
                got = got + nudge[1] * allowance(dt, fld, n, bs) * torch.as_tensor(scl, dtype=torch.float64)
            errs[fld] = max(errs.get(fld, 0.0), _report(f"seq {s} {fld}", got, getattr(e64, fld)[0],
                                                        tol(fld, scl)))
    return errs


GQA = [(1, 1), (2, 2), (1, 4)]  # (h_kv, g)


@pytest.mark.parametrize("bs,block_t", [(16, None), (32, None), (32, 16)])  # (32, 16): two sub-tiles per block
@pytest.mark.parametrize("h_kv,g", GQA)
@pytest.mark.parametrize("splits", [1, 3])
def test_matches_block_estimator_float32(bs, block_t, h_kv, g, splits):
    # lengths break the tiling: a full block, partial last blocks, a single token, a short one
    case = make_case(seq_lens=[3 * bs, 2 * bs + 5, 1, bs - 3, 5 * bs + 1], h_kv=h_kv, g=g, d=16, bs=bs,
                     seed=bs + 7 * h_kv + 13 * g + splits)
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], case["log_pi_blocks"], per_coordinate=True,
                                        num_splits=splits, block_t=block_t)
    errs = check_against_fast(case, est)
    assert set(errs) == {"output", "lse", "trace", "variance", "n_eff"}
    for x in (est.output, est.lse, est.trace, est.variance, est.n_eff):
        assert not bool(torch.isnan(x).any())  # the poison in evicted blocks and past the end is never read


def test_matches_numpy_reference():
    case = make_case(seq_lens=[40, 17], h_kv=2, g=2, d=8, dv=24, bs=16, seed=3, evict=0.3)
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], case["log_pi_blocks"], per_coordinate=True,
                                        num_splits=2, scale=0.3)
    for s in range(2):
        k, v, lpt, pos = gathered(case, s)
        pi = torch.exp(lpt[0, 0]).numpy()
        for h in range(4):
            kh = h // 2
            r = ref.block_hajek_attention(case["q"][s, h].double().numpy(), k[0, kh].numpy(), v[0, kh].numpy(), pi,
                                          block_size=16, positions=pos[0, 0].numpy(), scale=0.3)
            scl = float(np.abs(v[0, kh].numpy()).max())
            a = lambda f: allowance(torch.float32, f, k.shape[2], 16)  # noqa: E731
            np.testing.assert_allclose(est.output[s, h].double().numpy(), r.output, rtol=0, atol=a("output") * scl)
            np.testing.assert_allclose(float(est.lse[s, h]), r.lse, rtol=0, atol=a("lse") * (abs(r.lse) + 1))
            np.testing.assert_allclose(float(est.trace[s, h]), r.trace, rtol=0,
                                       atol=a("trace") * (scl * scl * 8 + r.trace))
            np.testing.assert_allclose(est.variance[s, h].double().numpy(), r.variance, rtol=0,
                                       atol=a("variance") * scl * scl)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_derived_tolerance_rejects_a_deliberate_error(dtype):
    """Negative control of :func:`check_against_fast` and :func:`check_compacted`: the kernel's estimate
    passes; every field moved by 20 units of its rounding allowance fails, and, for float32 inputs, so
    does the estimate of log pi off by 0.1% (the weights and 1 - pi off by about as much; a bfloat16
    allowance, eps_bf16 = 0.8%, is coarser than that)."""
    case = make_case(seq_lens=[48, 37], h_kv=2, g=2, d=16, bs=16, seed=21, dtype=dtype)
    args = [case[k] for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens")]
    est = paged(*args, case["log_pi_blocks"], per_coordinate=True, num_splits=2)
    check_against_fast(case, est)
    for fld in ("output", "lse", "trace", "variance", "n_eff"):
        with pytest.raises(AssertionError, match=fld):
            check_against_fast(case, est, nudge=(fld, 20))
    if dtype == torch.float32:
        bad = paged(*args, case["log_pi_blocks"] * (1 + 1e-3), per_coordinate=True, num_splits=2)
        with pytest.raises(AssertionError):
            check_against_fast(case, bad)
    comp = make_compacted(seqs=[(40, 50, [25, 10])], h_kv=2, g=2, d=16, bs=16, cmax=30, seed=8, dtype=dtype)
    est = run_compacted(comp, per_coordinate=True)
    check_compacted(comp, est)
    for fld in ("output", "lse", "trace", "variance", "n_eff"):
        with pytest.raises(AssertionError, match=fld):
            check_compacted(comp, est, nudge=(fld, 20))


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the deliberate NaN read at the end
def test_poison_does_not_change_the_result():
    """Negative control: the same case with and without NaN/garbage in evicted blocks, stale table entries
    and the slots past the end gives bit-identical results; and the poison is really there (a gather that
    reads every table entry would return NaN)."""
    kw = dict(seq_lens=[70, 33, 64], h_kv=2, g=2, d=16, bs=16, seed=11, evict=0.5)
    clean = make_case(poison=False, **kw)
    dirty = make_case(poison=True, **kw)
    run = lambda c: paged(c["q"], c["key_cache"], c["value_cache"], c["block_table"],  # noqa: E731
                                                  c["seq_lens"], c["log_pi_blocks"], per_coordinate=True)
    a, b = run(clean), run(dirty)
    for f in ("output", "lse", "trace", "variance", "n_eff"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert bool(torch.isnan(dirty["value_cache"]).any())
    assert bool((dirty["log_pi_blocks"][:, :5] == NEG_INF).any())
    # the control of the control: an unmasked read of an evicted block would show the NaN
    evicted = [(s, j) for s in range(3) for j in range(-(-int(dirty["seq_lens"][s]) // 16))
               if dirty["log_pi_blocks"][s, j] == NEG_INF]
    s, j = evicted[0]
    lp = dirty["log_pi_blocks"].clone()
    lp[s, j] = 0.0
    tab = dirty["block_table"].clone()
    tab[s, j] = int(torch.nonzero(torch.isnan(dirty["value_cache"][:, 0, 0, 0]))[0])
    bad = paged(dirty["q"], dirty["key_cache"], dirty["value_cache"], tab,
                                        dirty["seq_lens"], lp)
    assert bool(torch.isnan(bad.output[s]).any())


def test_all_certain_is_exact_attention_with_zero_trace():
    case = make_case(seq_lens=[50, 16, 7], h_kv=2, g=2, d=16, bs=16, seed=5, evict=0.0, certain=1.0, poison=False)
    lp = torch.where(case["log_pi_blocks"] > NEG_INF, 0.0, NEG_INF)
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], lp, per_coordinate=True, num_splits=2)
    for s in range(3):
        L = int(case["seq_lens"][s])
        ids = case["block_table"][s, : -(-L // 16)].long()
        k = case["key_cache"][ids].reshape(-1, 2, 16)[:L].double()
        v = case["value_cache"][ids].reshape(-1, 2, 16)[:L].double()
        q = case["q"][s].double().view(2, 2, 16)
        sc = torch.einsum("kgd,nkd->kgn", q, k) / 4.0
        o = torch.einsum("kgn,nkd->kgd", torch.softmax(sc, -1), v).reshape(4, 16)
        lse = torch.logsumexp(sc, -1).reshape(4)
        a = lambda f: allowance(torch.float32, f, L, 16)  # noqa: E731
        _report(f"seq {s} exact output", est.output[s], o, a("output") * float(v.abs().max()))
        _report(f"seq {s} exact lse", est.lse[s], lse, a("lse") * (lse.abs() + 1))
    assert bool((est.trace == 0).all()) and bool((est.variance == 0).all())


def test_empty_sequences():
    case = make_case(seq_lens=[0, 20, 33], h_kv=1, g=2, d=16, bs=16, seed=2, poison=False)
    case["log_pi_blocks"][1] = NEG_INF  # every block evicted
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], case["log_pi_blocks"], num_splits=2)
    for s in (0, 1):
        assert bool((est.output[s] == 0).all()) and bool(torch.isneginf(est.lse[s]).all())
        assert bool(torch.isposinf(est.trace[s]).all()) and bool((est.n_eff[s] == 0).all())
    assert bool(torch.isfinite(est.trace[2]).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs(dtype):
    case = make_case(seq_lens=[75, 16], h_kv=2, g=2, d=16, bs=32, seed=9, dtype=dtype)
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], case["log_pi_blocks"], per_coordinate=True,
                                        num_splits=2, block_t=16)
    assert est.output.dtype == dtype
    check_against_fast(case, est)


def test_value_offset_no_cancellation():
    """A large common offset in v: the Chan form keeps the trace at float32 resolution of the residuals
    (the raw expansion sum ||S_b||^2 - 2 o.S_b A_b + ||o||^2 A_b^2 would lose about log10(offset^2) digits)."""
    case = make_case(seq_lens=[64, 40], h_kv=1, g=2, d=16, bs=16, seed=4, value_offset=100.0, evict=0.3,
                     certain=0.0, poison=False)
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], case["log_pi_blocks"])
    for s in range(2):
        e64, v = oracle(case, s)
        e32 = oracle(case, s, torch.float32)[0]
        a = e64.weights[0]  # (h_q, m bs)
        A = a.reshape(a.shape[0], -1, 16).sum(-1)
        omp = -torch.expm1(case["log_pi_blocks"][s].double())
        kept = [j for j in range(-(-int(case["seq_lens"][s]) // 16)) if case["log_pi_blocks"][s, j] > NEG_INF]
        W = (omp[kept][None, :] * A * A).sum(-1)
        _check_residual_resolution(f"seq {s}", est.trace[s], e64, e32, v[0].repeat_interleave(2, 0), a > 0, W,
                                   allowance(torch.float32, "trace", a.shape[-1], 16))


def _check_residual_resolution(name, got, e64, e32, V, live, W, r):
    """The trace of a value offset at the float32 resolution of the residuals: |kernel - f64| <=
    2 |fast_f32 - f64| (whose o_hat carries eps |offset| too) + r (W max ||v_i - o||^2 + trace), the
    Chan form's bound with the residuals v_i - o in place of the raw values. The raw expansion
    sum ||S_b||^2 - 2 o.S_b A_b + ||o||^2 A_b^2 rounds at eps W max ||v||^2, offset^2 / trace ~ 1e5
    times more (2-23% of the trace on these cases): the last assertion checks the bound is 20x below that."""
    r2 = torch.where(live, ((V - e64.output[0][:, None]) ** 2).sum(-1), 0.0).amax(-1)  # max ||v_i - o||^2
    want = e64.trace[0]
    tol = 2 * (e32.trace[0].double() - want).abs() + r * (W * r2 + want)
    _report(f"{name} trace", got, want, tol)
    raw = EPS[torch.float32] * W * torch.where(live, (V * V).sum(-1), 0.0).amax(-1)
    assert bool((20 * tol < raw).all()), (tol / want, raw / want)


def test_kv_cache_views_read_vllm_flash_layout():
    """vLLM 0.32's FlashAttention cache (num_blocks, h_kv, block_size, 2 d): token t of block b, head h
    holds K in [..., :d] and V in [..., d:] of kv_cache[b, h, t] (FlashAttentionImpl.forward's
    ``kv_cache.transpose(1, 2).split(d, -1)``)."""
    nb, h, bs, d = 4, 2, 16, 8
    kv = torch.randn(nb, h, bs, 2 * d)
    k, v = kernels.kv_cache_views(kv, d)
    assert k.shape == (nb, bs, h, d) and v.shape == (nb, bs, h, d)
    assert torch.equal(k[2, 5, 1], kv[2, 1, 5, :d]) and torch.equal(v[3, 0, 0], kv[3, 0, 0, d:])
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    lp = torch.tensor([[0.0, NEG_INF, math.log(0.5)]])
    q = torch.randn(1, 4, d)
    a = paged(q, k, v, table, torch.tensor([40], dtype=torch.int32), lp)
    b = paged(q, k.contiguous(), v.contiguous(), table, torch.tensor([40], dtype=torch.int32),
                                      lp)
    torch.testing.assert_close(a.output, b.output, rtol=0, atol=0)
    torch.testing.assert_close(a.trace, b.trace, rtol=0, atol=0)


def test_refuses_bad_inputs():
    case = make_case(seq_lens=[20], h_kv=2, g=1, d=16, bs=16, seed=1, poison=False)
    args = [case[k] for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens", "log_pi_blocks")]
    f = paged
    with pytest.raises(ValueError, match="log_pi_blocks"):
        f(*args[:5], args[5].double())
    with pytest.raises(ValueError, match="seq_lens must lie"):
        f(*args[:4], torch.tensor([1000], dtype=torch.int32), args[5])
    with pytest.raises(ValueError, match="log_pi_blocks must lie"):
        f(*args[:5], args[5].abs())
    with pytest.raises(ValueError, match="physical block ids"):
        f(*args[:3], torch.full_like(args[3], 10 ** 6), *args[4:])
    with pytest.raises(ValueError, match="GQA"):
        f(torch.randn(1, 3, 16), *args[1:])
    with pytest.raises(ValueError, match="max_seq_len"):
        f(*args, max_seq_len=5)  # blocks past it would be skipped silently
    with pytest.raises(ValueError, match="block_t"):
        f(*args, block_t=24)
    with pytest.raises(TypeError, match="share one dtype"):
        f(args[0].half(), *args[1:])


@settings(max_examples=6)
@given(bs=st.sampled_from([16, 32]), h_kv=st.sampled_from([1, 2]), g=st.sampled_from([1, 3]),
       lens=st.lists(st.integers(0, 100), min_size=1, max_size=3), evict=st.sampled_from([0.0, 0.5, 0.9]),
       splits=st.sampled_from([1, 2, 5]), block_t=st.sampled_from([None, 16]), seed=st.integers(0, 2 ** 16))
def test_hypothesis_random_tables(bs, h_kv, g, lens, evict, splits, block_t, seed):
    case = make_case(seq_lens=lens, h_kv=h_kv, g=g, d=16, bs=bs, evict=evict, seed=seed)
    est = paged(case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                        case["seq_lens"], case["log_pi_blocks"], per_coordinate=True,
                                        num_splits=splits, block_t=block_t)
    check_against_fast(case, est)


def test_compiles_for_sm90_without_a_gpu():
    """The compiled (non-interpreted) paged kernel lowers to sm_90 cubins (bf16 split and fp32 unsplit, blocks
    of 16 and 128, default sub-tiles, d = 128, g = 4; compiled as the JIT compiles a launch on vLLM's cache
    views, ``compile_paged``'s ``specialize``): the interpreter cannot catch type or layout errors of the
    compiled path."""
    import json
    import subprocess
    import sys

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    code = ("import json\n"
            "from kvcert.kernels.paged import compile_paged\n"
            "rows = [compile_paged(dtype=dt, block_size=bs, split=sp) for dt, sp in (('bf16', True), ('fp32', False))"
            " for bs in (16, 128)]\n"
            "print(json.dumps(rows))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 4 and all(r["arch"] == "sm_90" for r in rows)
    counted = [r for r in rows if r["stack_bytes"] is not None]
    assert all(r["stack_bytes"] == 0 for r in counted), counted  # default sub-tiles: no register spills (docs/gpu.md)


# ----------------------------------------------------------------------------- compacted token slots
#
# kernels.paged.paged_hajek_attention: the token design served by compaction (docs/design.md
# section 7). Each KV head's kept prompt tokens sit in logical slots 0 .. C_h - 1 of the block table with
# a per-slot log pi; the tail [P_s, L_s) stays in place, certain. Oracle: the kept tokens gathered per
# (sequence, KV head) by hand and kvcert.fast.hajek_attention in float64 (and kvcert.reference on one
# case). Tolerances as above: |kernel - f64| <= 2 |fast_f32 - f64| + 32 eps32 scale, scale = 2 max|v|
# (output), |lse| + 1 (lse), W max ||v||^2 + trace (trace, variance; W = sum_i (1 - pi_i) a_i^2 <= 1, the
# float32 rounding bound of the Chan form with tokens as units), n_eff (n_eff); half inputs: 8 eps_dtype.


def paged_compacted(*args, **kwargs):
    """``paged_hajek_attention`` on DEV, brought back to the CPU (as :func:`paged`)."""
    from kvcert.kernels.paged import paged_hajek_attention

    to = lambda x: x.to(DEV) if isinstance(x, torch.Tensor) else x  # noqa: E731
    est = paged_hajek_attention(*map(to, args), **{k: to(v) for k, v in kwargs.items()})
    if DEV == "cpu":
        return est
    back = {f.name: getattr(est, f.name).cpu() for f in dataclasses.fields(est)
            if isinstance(getattr(est, f.name), torch.Tensor)}
    return dataclasses.replace(est, **back)


def make_compacted(*, seqs, h_kv, g, d, bs, cmax, dtype=torch.float32, seed=0, certain=0.2, holes=0.1,
                   poison=True, value_offset=0.0):
    """A paged cache after compaction. ``seqs``: (P_s, L_s, counts) with counts[h] = C_h <= min(P_s, cmax)
    (None: random). Slots j < C_h of head h hold a kept token with log pi in [log .05, log .95] (a fraction
    ``certain`` at 0, a fraction ``holes`` of -inf inside), the tail [P_s, L_s) stays at its positions.

    ``poison``: NaN in every (slot, head) the kernel must not read (padding slots, the prompt's leftovers
    in a partly compacted block, slots past L_s, the freed blocks) and garbage table entries for the
    logical blocks that hold neither a kept slot nor a tail token (freed blocks)."""
    gen = torch.Generator().manual_seed(seed)
    S = len(seqs)
    counts = []
    for P, L, c in seqs:
        assert 0 <= P <= L
        if c is None:
            c = [int(torch.randint(0, min(P, cmax) + 1, (1,), generator=gen)) for _ in range(h_kv)]
        assert len(c) == h_kv and all(0 <= x <= min(P, cmax) for x in c)
        counts.append(c)
    nbt = [-(-L // bs) for _, L, _ in seqs]
    M = max(max(nbt), 1) + 1
    nb = sum(nbt) + 2
    kc = torch.randn(nb, bs, h_kv, d, generator=gen)
    vc = torch.randn(nb, bs, h_kv, d, generator=gen) + value_offset
    ids = torch.randperm(nb, generator=gen)
    table = torch.full((S, M), nb + 7, dtype=torch.int32)
    lp = torch.full((S, h_kv, cmax), NEG_INF)
    read = torch.zeros(nb, bs, h_kv, dtype=torch.bool)  # what the kernel may read
    c0 = 0
    for s, ((P, L, _), n) in enumerate(zip(seqs, nbt)):
        table[s, :n] = ids[c0:c0 + n].to(torch.int32)
        c0 += n
        for h in range(h_kv):
            C = counts[s][h]
            x = torch.log(torch.rand(C, generator=gen) * 0.9 + 0.05)
            u = torch.rand(C, generator=gen)
            x = torch.where(u < certain, 0.0, x)
            x = torch.where(u > 1 - holes, NEG_INF, x)
            lp[s, h, :C] = x
            for j in range(C):
                if x[j] > NEG_INF:
                    read[table[s, j // bs].long(), j % bs, h] = True
        for p in range(P, L):
            read[table[s, p // bs].long(), p % bs, :] = True
    if poison:
        kc[~read] = float("nan")
        vc[~read] = float("nan")
        for s, n in enumerate(nbt):
            for j in range(n):
                if not bool(read[table[s, j].long()].any()):
                    table[s, j] = -1 if j % 2 else nb + 3  # a freed block: its id is stale
    q = torch.randn(S, h_kv * g, d, generator=gen)
    return dict(q=q.to(dtype), key_cache=kc.to(dtype), value_cache=vc.to(dtype), block_table=table,
                seq_lens=torch.tensor([L for _, L, _ in seqs], dtype=torch.int32),
                prompt_lens=torch.tensor([P for P, _, _ in seqs], dtype=torch.int32),
                log_pi_slots=lp.to(torch.float32), bs=bs, counts=counts)


CARGS = ("q", "key_cache", "value_cache", "block_table", "seq_lens", "prompt_lens", "log_pi_slots")


def run_compacted(case, **kw):
    return paged_compacted(*(case[k] for k in CARGS), **kw)


def gathered_tokens(case, s):
    """Sequence s's kept tokens per KV head, padded across heads with log pi = -inf (K, V = 0):
    K (1, h_kv, n, d), V (1, h_kv, n, dv) float64, log pi (1, h_kv, n) float64."""
    bs, P, L = case["bs"], int(case["prompt_lens"][s]), int(case["seq_lens"][s])
    kc, vc, tab, lp = case["key_cache"], case["value_cache"], case["block_table"][s].long(), case["log_pi_slots"][s]
    h_kv = kc.shape[2]
    per = []
    for h in range(h_kv):
        slots = [j for j in range(lp.shape[1]) if lp[h, j] > NEG_INF]
        ks = [kc[tab[j // bs], j % bs, h] for j in slots] + [kc[tab[p // bs], p % bs, h] for p in range(P, L)]
        vs = [vc[tab[j // bs], j % bs, h] for j in slots] + [vc[tab[p // bs], p % bs, h] for p in range(P, L)]
        lps = [float(lp[h, j]) for j in slots] + [0.0] * (L - P)
        per.append((ks, vs, lps))
    n = max(len(x[2]) for x in per)
    d, dv = kc.shape[3], vc.shape[3]
    K = torch.zeros(1, h_kv, n, d, dtype=torch.float64)
    V = torch.zeros(1, h_kv, n, dv, dtype=torch.float64)
    LP = torch.full((1, h_kv, n), NEG_INF, dtype=torch.float64)
    for h, (ks, vs, lps) in enumerate(per):
        if lps:
            K[0, h, :len(lps)] = torch.stack(ks).double()
            V[0, h, :len(lps)] = torch.stack(vs).double()
            LP[0, h, :len(lps)] = torch.tensor(lps, dtype=torch.float64)
    return K, V, LP


def check_compacted(case, est, nudge=None, block_t=None):
    """Every field of the estimate against the float64 token oracle (per sequence), empty heads by convention.
    Returns the max error per field. ``nudge``: as :func:`check_against_fast`'s; ``block_t``: the kernel's
    tile, when the allowance must count it (:func:`allowance`)."""
    dt = case["q"].dtype
    half = dt != torch.float32
    g = case["q"].shape[1] // case["key_cache"].shape[2]
    errs = {}
    for s in range(case["q"].shape[0]):
        K, V, LP = gathered_tokens(case, s)
        q = case["q"][s:s + 1]
        e64 = fast.hajek_attention(q.double(), K, V, log_pi=LP, return_weights=True)
        e32 = None if half else fast.hajek_attention(q.float(), K.float(), V.float(), log_pi=LP.float())
        empty = torch.isneginf(e64.lse[0])  # (h_q,)
        if bool(empty.any()):
            assert bool((est.output[s][empty] == 0).all()) and bool(torch.isneginf(est.lse[s][empty]).all())
            assert bool(torch.isposinf(est.trace[s][empty]).all()) and bool((est.n_eff[s][empty] == 0).all())
        if bool(empty.all()):
            continue
        full = ~empty
        Vh = V[0].repeat_interleave(g, 0)  # (h_q, n, dv): the KV head of each query head
        present = torch.isfinite(LP[0]).repeat_interleave(g, 0)
        vmax = Vh.abs().amax((-1, -2))  # per query head
        v2max = torch.where(present, (Vh * Vh).sum(-1), 0.0).amax(-1)
        omp = torch.where(present, -torch.expm1(LP[0].repeat_interleave(g, 0)), 0.0)
        W = (omp * e64.weights[0] ** 2).sum(-1)  # sum_i (1 - pi_i) a_i^2

        def tol(fld, scl):  # the kept slots and the tail: two unit loops, one more tile merge
            base = 2 * (getattr(e32, fld)[0].double() - getattr(e64, fld)[0]).abs() if e32 is not None else 0.0
            return base + allowance(dt, fld, K.shape[2], case["bs"], extra_tiles=1, block_t=block_t) * scl + 1e-30

        for fld, scl in (("output", (2 * vmax)[:, None]), ("lse", e64.lse[0].abs() + 1),
                         ("trace", W * v2max + e64.trace[0].abs()),
                         ("variance", (W * v2max)[:, None] + e64.variance[0].abs()), ("n_eff", e64.n_eff[0])):
            got = getattr(est, fld)
            if got is None:
                continue
            got = got[s].double()
            if nudge is not None and nudge[0] == fld:
                a = allowance(dt, fld, K.shape[2], case["bs"], extra_tiles=1, block_t=block_t)
                got = got + nudge[1] * a * torch.as_tensor(scl, dtype=torch.float64)
            t = torch.as_tensor(tol(fld, scl)).expand_as(getattr(e64, fld)[0])
            errs[fld] = max(errs.get(fld, 0.0), _report(f"seq {s} {fld}", got[full], getattr(e64, fld)[0][full],
                                                        t[full]))
    return errs


def compacted_seqs(bs, cmax, h_kv):
    """P_s, L_s, C_h: a tail across a block edge with one head empty (C_h = 0) and one full (C_h = Cmax),
    a sequence with no tail, a short prompt with a long tail, and random counts."""
    P0 = 2 * bs + 5
    return [(P0, P0 + 9, [cmax] + [0] * (h_kv - 1) if h_kv > 1 else [0]),
            (bs + 9, bs + 9, None),
            (3, 3 + bs + 2, None),
            (cmax + 4, cmax + 4 + bs, None)]


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("h_kv,g", [(2, 1), (1, 4), (2, 3)])
@pytest.mark.parametrize("splits", [1, 3])
def test_compacted_matches_token_estimator_float32(bs, h_kv, g, splits):
    cmax = bs + 7  # not a multiple of the block size
    case = make_compacted(seqs=compacted_seqs(bs, cmax, h_kv), h_kv=h_kv, g=g, d=16, bs=bs, cmax=cmax,
                          seed=bs + 7 * h_kv + 13 * g + splits)
    est = run_compacted(case, per_coordinate=True, num_splits=splits, block_t=16 if bs == 32 else None)
    errs = check_compacted(case, est)
    assert set(errs) == {"output", "lse", "trace", "variance", "n_eff"}
    for x in (est.output, est.lse, est.trace, est.variance, est.n_eff):
        assert not bool(torch.isnan(x).any())  # the NaN in padding slots and freed blocks is never read
    # the one-head-empty sequence: a C_h = 0 head sees only its (certain) tail, trace 0
    if h_kv > 1:
        assert bool((est.trace[0, g:2 * g] == 0).all()) and bool(torch.isfinite(est.lse[0]).all())


def gathered_tile_seqs(bs):
    """(P_s, L_s, C_h) whose slots and tails cross the 64-token tiles and the blocks at odd places: 150 of
    150 slots (tiles 0-63, 64-127, 128-149) with a 39-token tail from mid-block, a random head count with a
    113-token tail (two tiles, the second ragged), a head with no slot and a one-token tail, a one-slot
    prompt with a tail of exactly one tile, and a tail starting at P_s = bs + 1 (mid-block, mid-tile)."""
    return [(200, 239, [150, 63]), (130, 243, None), (65, 66, [64, 0]), (1, 65, [1, 1]), (bs + 1, bs + 1 + 3 * bs + 5,
                                                                                           [bs + 1, 7])]


@pytest.mark.parametrize("bs", [16, 128])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compacted_gathered_tiles_cross_blocks(bs, splits, dtype):
    """The compacted kernel's 64-token tiles, gathered row by row through the block table, at blocks of 16
    (a tile spans four blocks) and 128 (a block spans two tiles), ragged slot counts and tails that start
    mid-block: every field within the derived allowance (with the 64-token tile counted), the poison in
    padding slots and freed blocks never read. Negative control: the same estimate from a block table with
    two kept blocks swapped (the gather reading the wrong blocks) fails the check."""
    cmax = 150
    case = make_compacted(seqs=gathered_tile_seqs(bs), h_kv=2, g=2, d=16, bs=bs, cmax=cmax, seed=bs + splits,
                          dtype=dtype)
    est = run_compacted(case, per_coordinate=True, num_splits=splits, block_t=64)
    errs = check_compacted(case, est, block_t=64)
    assert set(errs) == {"output", "lse", "trace", "variance", "n_eff"}
    for x in (est.output, est.lse, est.trace, est.variance, est.n_eff):
        assert not bool(torch.isnan(x).any())
    assert bool((est.trace[2, 2:] == 0).all())  # head 1 of sequence 2 keeps no slot: its certain tail only
    # the control: sequence 0's logical blocks 0 and 1 (both hold kept slots of both heads) swapped
    tab = case["block_table"].clone()
    tab[0, [0, 1]] = tab[0, [1, 0]]
    bad = run_compacted({**case, "block_table": tab}, per_coordinate=True, num_splits=splits, block_t=64)
    with pytest.raises(AssertionError, match="seq 0"):
        check_compacted(case, bad, block_t=64)


def test_compacted_any_tile_size():
    """Tiles of 16, 32, 64 and 128 gathered tokens over the same case (blocks of 16): each within the derived
    allowance of its own tile (only the grouping of the sums changes with the tile)."""
    case = make_compacted(seqs=gathered_tile_seqs(16), h_kv=2, g=2, d=16, bs=16, cmax=150, seed=5)
    for bt in (16, 32, 64, 128):
        check_compacted(case, run_compacted(case, per_coordinate=True, block_t=bt), block_t=bt)


def test_paged_kernels_at_the_heuristics_splits(monkeypatch):
    """The paged kernels at the split count ``num_splits_heuristic`` picks on a 132-SM GPU when none is given
    (tests/test_kernels_splits.py derives it; the merge kernel sees it): the block kernel over 188 blocks of
    16 (3008 tokens, two programs: s_max = 3008 // 1024 = 2, under-filled: 2 splits) and the compacted kernel
    over 63 + 32 tiles of 32 gathered tokens (3040 tokens: 2 splits), each against its oracle."""
    spy, _ = as_on_sms(monkeypatch, 132)
    case = make_case(seq_lens=[3000], h_kv=2, g=2, d=16, bs=16, seed=1)
    est = paged(*(case[k] for k in ("q", "key_cache", "value_cache", "block_table", "seq_lens", "log_pi_blocks")),
                per_coordinate=True)
    assert spy.splits == [2], spy.splits
    check_against_fast(case, est)
    spy.splits.clear()
    comp = make_compacted(seqs=[(2100, 3100, [1500, 2000])], h_kv=2, g=2, d=16, bs=16, cmax=2000, seed=2)
    est = run_compacted(comp, per_coordinate=True)
    assert spy.splits == [2], spy.splits
    check_compacted(comp, est, block_t=32)


def test_compacted_matches_numpy_reference():
    """kvcert.reference.hajek_attention (plain float64 NumPy) with pi per token, one query head at a time."""
    bs, cmax = 16, 20
    case = make_compacted(seqs=[(30, 41, [20, 13]), (18, 18, [5, 0])], h_kv=2, g=2, d=8, bs=bs, cmax=cmax, seed=3)
    est = run_compacted(case, per_coordinate=True, num_splits=2, scale=0.3)
    for s in range(2):
        K, V, LP = gathered_tokens(case, s)
        for h in range(4):
            kh = h // 2
            keep = torch.isfinite(LP[0, kh])
            if not bool(keep.any()):
                assert float(est.output[s, h].abs().max()) == 0 and math.isinf(float(est.trace[s, h]))
                continue
            r = ref.hajek_attention(case["q"][s, h].double().numpy(), K[0, kh][keep].numpy(), V[0, kh][keep].numpy(),
                                    torch.exp(LP[0, kh][keep]).numpy(), scale=0.3)
            scl = float(V[0, kh][keep].abs().max())
            a = lambda f: allowance(torch.float32, f, K.shape[2], bs, extra_tiles=1)  # noqa: E731
            np.testing.assert_allclose(est.output[s, h].double().numpy(), r.output, rtol=0, atol=a("output") * scl)
            np.testing.assert_allclose(float(est.lse[s, h]), r.lse, rtol=0, atol=a("lse") * (abs(r.lse) + 1))
            np.testing.assert_allclose(float(est.trace[s, h]), r.trace, rtol=0,
                                       atol=a("trace") * (scl * scl * 8 + r.trace))
            np.testing.assert_allclose(est.variance[s, h].double().numpy(), r.variance, rtol=0,
                                       atol=a("variance") * scl * scl)


def test_compacted_negative_controls():
    """A padding slot's key and value (finite garbage) leave the result bit-identical; changing a kept
    slot's key changes it (so the comparison can fail)."""
    bs = 16
    case = make_compacted(seqs=[(40, 50, [25, 10])], h_kv=2, g=2, d=16, bs=bs, cmax=30, seed=8, poison=False,
                          holes=0.0)
    base = run_compacted(case, per_coordinate=True)
    tab = case["block_table"][0].long()
    pad = 12  # slot 12 of head 1 is padding (C_1 = 10); slot 5 of head 1 is kept
    assert case["log_pi_slots"][0, 1, pad] == NEG_INF and case["log_pi_slots"][0, 1, 5] > NEG_INF
    kc = case["key_cache"].clone()
    vc = case["value_cache"].clone()
    kc[tab[pad // bs], pad % bs, 1] = 1e4
    vc[tab[pad // bs], pad % bs, 1] = -1e4
    other = run_compacted({**case, "key_cache": kc, "value_cache": vc}, per_coordinate=True)
    for f in ("output", "lse", "trace", "variance", "n_eff"):
        assert torch.equal(getattr(base, f), getattr(other, f)), f
    kc = case["key_cache"].clone()
    kc[tab[5 // bs], 5 % bs, 1] += 3.0
    moved = run_compacted({**case, "key_cache": kc}, per_coordinate=True)
    assert not torch.equal(base.output[0, 2:], moved.output[0, 2:])  # head 1's query heads see the change
    assert torch.equal(base.output[0, :2], moved.output[0, :2])  # head 0's do not
    # and a NaN in the slot that padding covers is never read (poisoned cases compare to the oracle above)
    kc = case["key_cache"].clone()
    kc[tab[pad // bs], pad % bs, 1] = float("nan")
    assert torch.equal(run_compacted({**case, "key_cache": kc}).output, base.output)


def test_compacted_all_certain_is_exact_attention_and_empty_sequences():
    case = make_compacted(seqs=[(35, 47, [35, 20]), (0, 0, [0, 0]), (5, 5, [0, 0]), (0, 9, [0, 0])], h_kv=2, g=2,
                          d=16, bs=16, cmax=35, seed=5, certain=1.0, holes=0.0)
    est = run_compacted(case, per_coordinate=True, num_splits=2)
    check_compacted(case, est)
    assert bool((est.trace[[0, 3]] == 0).all()) and bool((est.variance[[0, 3]] == 0).all())
    for s in (1, 2):  # nothing kept: output 0, lse -inf, trace +inf, n_eff 0
        assert bool((est.output[s] == 0).all()) and bool(torch.isneginf(est.lse[s]).all())
        assert bool(torch.isposinf(est.trace[s]).all()) and bool((est.n_eff[s] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compacted_half_inputs(dtype):
    case = make_compacted(seqs=[(50, 61, None), (20, 37, None)], h_kv=2, g=2, d=16, bs=32, cmax=45, seed=9,
                          dtype=dtype)
    est = run_compacted(case, per_coordinate=True, num_splits=2, block_t=16)
    assert est.output.dtype == dtype
    check_compacted(case, est)


def test_compacted_value_offset_no_cancellation():
    """A common value offset of 100: tokens as Chan units keep the trace at float32 resolution of the
    residuals (offset^2 / trace ~ 1e5, so a raw sum-of-squares form would keep about 2 digits)."""
    case = make_compacted(seqs=[(60, 70, [40, 31])], h_kv=2, g=1, d=16, bs=16, cmax=40, seed=4, certain=0.0,
                          value_offset=100.0, poison=False, holes=0.0)
    est = run_compacted(case)
    K, V, LP = gathered_tokens(case, 0)
    e64 = fast.hajek_attention(case["q"][:1].double(), K, V, log_pi=LP, return_weights=True)
    e32 = fast.hajek_attention(case["q"][:1].float(), K.float(), V.float(), log_pi=LP.float())
    live = torch.isfinite(LP[0])  # (h_kv, n); g = 1
    W = (torch.where(live, -torch.expm1(LP[0]), 0.0) * e64.weights[0] ** 2).sum(-1)  # sum_i (1 - pi_i) a_i^2
    _check_residual_resolution("compacted", est.trace[0], e64, e32, V[0], live, W,
                               allowance(torch.float32, "trace", K.shape[2], 16, extra_tiles=1))


def test_compacted_refuses_bad_inputs():
    case = make_compacted(seqs=[(20, 25, [10, 4])], h_kv=2, g=1, d=16, bs=16, cmax=12, seed=1, poison=False)
    a = [case[k] for k in CARGS]
    f = paged_compacted
    with pytest.raises(ValueError, match="log_pi_slots must be a float32 tensor of shape"):
        f(*a[:6], a[6].double())
    with pytest.raises(ValueError, match="log_pi_slots must be a float32 tensor of shape"):
        f(*a[:6], a[6][:, :1])  # h_kv = 2 heads expected
    with pytest.raises(ValueError, match="prompt_lens must be an int32 tensor of shape"):
        f(*a[:5], a[5].repeat(2), a[6])
    with pytest.raises(ValueError, match="prompt_lens must lie in"):
        f(*a[:5], torch.tensor([30], dtype=torch.int32), a[6])  # P_s > L_s
    with pytest.raises(ValueError, match="log_pi_slots must lie in"):
        f(*a[:6], a[6].abs())
    with pytest.raises(ValueError, match=r"-inf at every slot j >= prompt_lens"):
        f(*a[:5], torch.tensor([8], dtype=torch.int32), a[6])  # head 0 keeps 10 > P_s slots
    with pytest.raises(ValueError, match="seq_lens must lie"):
        f(*a[:4], torch.tensor([1000], dtype=torch.int32), *a[5:])
    with pytest.raises(ValueError, match="physical block ids"):
        f(*a[:3], torch.full_like(a[3], 10 ** 6), *a[4:])
    with pytest.raises(ValueError, match="GQA"):
        f(torch.randn(1, 3, 16), *a[1:])
    with pytest.raises(ValueError, match="max_tail_len"):
        f(*a, max_tail_len=2)  # the tail has 5 tokens
    with pytest.raises(TypeError, match="prompt_lens must be a torch.Tensor"):
        f(*a[:5], [20], a[6])
    with pytest.raises(TypeError, match="share one dtype"):
        f(a[0].half(), *a[1:])


def test_compacted_compiles_for_sm90_without_a_gpu():
    """The compiled compacted kernel lowers to sm_90 cubins (bf16 split at blocks of 16 and 128, fp32 unsplit
    at 16; d = 128, g = 4, the default gathered tiles: 64 tokens for bf16, 32 for fp32) without register
    spills, compiled as the JIT compiles a launch on vLLM's cache views (``compile_paged``'s ``specialize``:
    unit innermost strides, aligned pointers and strides): the interpreter cannot catch type or layout errors
    of the compiled path (the per-token row gather, the two unit loops)."""
    import json
    import subprocess
    import sys

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this triton wheel ships no ptxas")
    code = ("import json\n"
            "from kvcert.kernels.paged import compile_paged\n"
            "rows = [compile_paged(dtype=dt, block_size=bs, split=sp, compacted=True)"
            " for dt, bs, sp in (('bf16', 16, True), ('bf16', 128, True), ('fp32', 16, False))]\n"
            "print(json.dumps(rows))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 3 and all(r["arch"] == "sm_90" and r["kernel"] == "paged_compacted" for r in rows)
    assert [r["block_t"] for r in rows] == [64, 64, 32] and all(r["specialize"] for r in rows)
    counted = [r for r in rows if r["stack_bytes"] is not None]
    assert all(r["stack_bytes"] == 0 for r in counted), counted
