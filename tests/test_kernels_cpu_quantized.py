"""The compiled CPU op's quantized decode (``kvcert.kernels.cpu.quantized_hajek_attention``): int8 codes (formats
int8 and int4, one code per byte) with float16 scales, dequantized in the op's pass.

What is checked, each against an independent computation:

- per query row, the output, log Z, n_eff, the trace and the rounding variance V_q (and, with ``combined=True``,
  the decode's call, trace + V_q from one set of sums) against the float64 oracle on
  the same codes (``kvcert.fast`` at float64 on the dequantized rows, which dequantize exactly:
  ``hajek_attention`` and ``held_rounding_terms``) and against the torch path at float32 (the same functions on
  float32 rows, what ``quantized_decode`` runs without the op). Tolerance: ``rounding(float32, n)`` (tests/support.py)
  times each quantity's scale, derived from the sums the op forms: the output against its row's largest kept
  |v|, log Z against max(|log Z|, 1), n_eff against itself, the trace and V_q against the centred form's
  terms (4 C diam^2 + 2 max|v| sum c |v - o|, with c the quantity's weights and diam a bound on the kept
  values' diameter; V_q plus its value term). The torch path is held to twice that (each within it of the
  exact value). Lengths 1, 31, 32, 33 and 1023 (the channel layout's groups of 32, the op's 64-slot tiles),
  GQA groups 1 and 4, head dims 64 and 128, the three layouts, 8 and 4 bits, an exact tail;
- padding slots (log pi = -inf) hold garbage codes and scales that change nothing (bit for bit); an all-certain
  row has trace exactly 0 and its V_q; an empty row the convention (0, -inf, +inf, +inf);
- negative controls: a value code flipped by one, a key code flipped by one and a value scale one float16 step
  off, each in the row's heaviest slot, move the output outside the tolerance of the original's oracle;
- bad input is refused naming the argument;
- a decode of ``PoissonPress(kv_bits=8, sketch=None)`` on the small model runs the op (route ``"cpu_op"``) and
  gives the same tokens and, per step, layer and head, the radius of the torch path (``KVCERT_CPU_OP=0``) within
  the float64 oracle's triangle on each run's own inputs; the sketched default stays on the torch path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvcert
import kvcert.dispatch as D
import kvcert.fast as F
import kvcert.fast.token_design as FT
from model_fixtures import forced_logits, tiny_model
from support import assert_close, rounding

cpu = pytest.importorskip("kvcert.kernels.cpu")

LENGTHS = [1, 31, 32, 33, 1023]
LAYOUTS = ("channel", "token", "values")


@pytest.fixture(scope="module")
def op():
    if not cpu.available():
        pytest.skip(f"the compiled CPU op cannot be built here: {cpu.unavailable_reason()}")
    return cpu


@pytest.fixture(autouse=True)
def _default_routes(monkeypatch):
    monkeypatch.delenv(D.CPU_OP_ENV_VAR, raising=False)


def _case(n, g, d, layout, bits=8, *, b=2, h_kv=2, tail=2, pad=3, certain=False, seed=0):
    """A stored cache of n slots per head (the last ``pad`` of them padding) and ``tail`` exact slots after it:
    ``(q, stored, tail (k, v, log_pi), log_pi of every held slot)``. Keys and values are float32 numbers (so
    the "values" layout's exact keys are the op's float32 keys)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h_kv, n, d, generator=gen).double()
    v = (torch.randn(b, h_kv, n, d, generator=gen) + 0.5).double()
    u = torch.rand(b, h_kv, n, generator=gen, dtype=torch.float64)
    log_pi = torch.log(torch.where(u < 0.2, 1.0, u.clamp_min(0.02)))
    if certain:
        log_pi = torch.zeros_like(log_pi)
    pad = min(pad, n - 1)
    if pad:
        log_pi[..., n - pad:] = float("-inf")
        k[..., n - pad:, :] = 0.0
        v[..., n - pad:, :] = 0.0
    pos = torch.arange(n).expand(b, h_kv, n).clone()
    stored = F.store_kv(k, v, log_pi, pos, kv_bits=bits, layout=layout, rounding="stochastic", seed=seed + 1)
    q = torch.randn(b, h_kv * g, d, generator=gen)
    tk, tv = torch.randn(b, h_kv, tail, d, generator=gen), torch.randn(b, h_kv, tail, d, generator=gen)
    t_lp = torch.zeros(b, h_kv, tail, dtype=torch.float64)
    return q, stored, (tk, tv, t_lp), torch.cat([stored.log_pi, t_lp], dim=-1)


def _op_args(stored):
    """The op's positional code arguments from a QuantizedKV."""
    keys = stored.keys
    if stored.layout == "values":
        return keys.to(torch.float32), None, stored.values.codes, stored.values.scales
    return keys.codes, keys.scales, stored.values.codes, stored.values.scales


def _run(stored, q, tail, log_pi, **kw):
    kc, ks, vc, vs = _op_args(stored)
    group = getattr(stored.keys, "group", F.CHANNEL_GROUP)
    return cpu.quantized_hajek_attention(q, kc, ks, vc, vs, log_pi, layout=stored.layout, group=group,
                                         tail=None if tail[0].shape[2] == 0 else tail[:2], **kw)


def _torch_path(q, stored, tail, dtype):
    """kvcert.fast at ``dtype`` on the dequantized rows: (Estimate with weights, V_q)."""
    k, v = stored.dequantize(dtype)
    r = tail[0].shape[2]
    t = (tail[0].to(dtype), tail[1].to(dtype), tail[2].to(dtype)) if r else None
    if r:
        k, v = torch.cat([k, t[0]], 2), torch.cat([v, t[1]], 2)
    log_pi = torch.cat([stored.log_pi, tail[2]], -1).to(dtype)
    est = F.hajek_attention(q.to(dtype), k, v, log_pi=log_pi, per_coordinate=False, return_weights=True)
    _, v_q = F.held_rounding_terms(q.to(dtype), stored, tail=t)
    return est, v_q, v


def _tolerances(q, stored, tail, est64, v64, n):
    """Per (b, h_q): each field's allowed rounding (module docstring), float64 numpy."""
    b, h_q = q.shape[:2]
    g = h_q // v64.shape[1]
    a = est64.weights.reshape(b, h_q, -1)
    log_pi = torch.cat([stored.log_pi, tail[2]], -1).repeat_interleave(g, 1)
    on = log_pi > float("-inf")
    v = v64.repeat_interleave(g, 1)                                                  # (b, h_q, n, dv)
    dist = torch.linalg.vector_norm(v - est64.output[:, :, None], dim=-1)
    vmax = torch.where(on[..., None], v.abs(), 0.0).amax(dim=(-1, -2))
    diam = 2.0 * torch.where(on, torch.linalg.vector_norm(v - v[:, :, :1], dim=-1), 0.0).amax(-1) + vmax
    c = torch.where(on, -torch.expm1(log_pi) * a * a, 0.0)
    r = tail[0].shape[2]
    sig = F.logit_variance(q.double(), stored.keys) if stored.layout != "values" else \
        torch.zeros(b, h_q, stored.log_pi.shape[-1], dtype=torch.float64)
    sig = torch.nn.functional.pad(sig, (0, r))
    e_v = torch.nn.functional.pad(stored.values.variance_bound(torch.float64).sum(-1), (0, r)).repeat_interleave(g, 1)
    cq = torch.where(on, a * a * sig, 0.0)
    rnd = rounding(torch.float32, n)
    tol = {"output": rnd * vmax[..., None].expand(est64.output.shape),
           "lse": rnd * est64.lse.abs().clamp_min(1.0),
           "n_eff": 3 * rnd * est64.n_eff,
           "trace": rnd * (4 * c.sum(-1) * diam ** 2 + 2 * vmax * (c * dist).sum(-1)),
           "v_q": rnd * (4 * cq.sum(-1) * diam ** 2 + 2 * vmax * (cq * dist).sum(-1)
                         + torch.where(on, a * a * e_v, 0.0).sum(-1))}
    return {f: torch.where(torch.isfinite(t), t, 0.0) for f, t in tol.items()}


def _fields(est, v_q):
    return {"output": est.output, "lse": est.lse, "n_eff": est.n_eff, "trace": est.trace, "v_q": v_q}


def _check(q, stored, tail, log_pi, n, **kw):
    est, v_q = _run(stored, q, tail, log_pi, **kw)
    e64, vq64, v64 = _torch_path(q, stored, tail, torch.float64)
    e32, vq32, _ = _torch_path(q, stored, tail, torch.float32)
    tol = _tolerances(q, stored, tail, e64, v64, n)
    got, want, mirror = _fields(est, v_q), _fields(e64, vq64), _fields(e32, vq32)
    for f in got:
        assert_close(f"{f} vs float64", got[f], want[f], tol[f])
        assert_close(f"{f} vs the torch path", got[f], mirror[f], 2 * tol[f])
    both, none = _run(stored, q, tail, log_pi, combined=True, **kw)   # the decode's call: trace + V_q in one sum
    assert none is None and torch.equal(both.output, est.output) and torch.equal(both.lse, est.lse)
    assert_close("trace + V_q vs float64", both.trace, e64.trace + vq64, tol["trace"] + tol["v_q"])
    assert_close("trace + V_q vs the torch path", both.trace, e32.trace + vq32, 2 * (tol["trace"] + tol["v_q"]))
    return est, v_q, e64, tol


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("n", LENGTHS)
def test_op_matches_the_float64_oracle_and_the_torch_path(op, n, g, d, layout):
    q, stored, tail, log_pi = _case(n, g, d, layout, seed=n + d + g)
    _, v_q, _, _ = _check(q, stored, tail, log_pi, n + 2)
    if layout != "values" or n > 3:
        assert bool((v_q > 0).all())          # the rounding term is there


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [33, 1023])
def test_four_bits_and_no_tail_and_forced_splits(op, n, layout):
    q, stored, tail, log_pi = _case(n, 4, 64, layout, bits=4, seed=7)
    _check(q, stored, tail, log_pi, n + 2)
    q, stored, tail, log_pi = _case(n, 2, 64, layout, bits=4, tail=0, seed=8)
    _check(q, stored, tail, log_pi, n, splits=3)


def test_a_chunk_of_query_rows(op):
    """q (b, h_q, t, d): the t rows of each head share the pass; each is the one-row call's."""
    q, stored, tail, log_pi = _case(97, 2, 64, "channel", seed=3)
    rows = torch.stack([q, q.flip(-1), 0.5 * q], dim=2)
    est, v_q = _run(stored, rows, tail, log_pi)
    for j in range(3):
        one, vq1 = _run(stored, rows[:, :, j].contiguous(), tail, log_pi)
        tol = 2 * rounding(torch.float32, 99)
        assert_close("output", est.output[:, :, j], one.output, tol * one.output.abs().amax(-1, keepdim=True))
        assert_close("v_q", v_q[:, :, j], vq1, tol * vq1)


def test_padding_slots_are_never_read(op):
    """Garbage codes and scales on every padding slot (and a padding-only group's key scales): bit for bit."""
    q, stored, tail, log_pi = _case(70, 2, 64, "channel", pad=40, seed=4)
    est, v_q = _run(stored, q, tail, log_pi)
    kc, ks, vc, vs = (x.clone() for x in _op_args(stored))
    pad = stored.log_pi == float("-inf")
    gen = torch.Generator().manual_seed(9)
    kc[pad] = torch.randint(-128, 128, kc[pad].shape, generator=gen, dtype=torch.int8)
    vc[pad] = torch.randint(-128, 128, vc[pad].shape, generator=gen, dtype=torch.int8)
    vs[pad] = 6.0e4
    ks[:, :, 2:] = 6.0e4                                     # slots 64..69: padding only
    est2, v_q2 = cpu.quantized_hajek_attention(q, kc, ks, vc, vs, log_pi, tail=tail[:2])
    assert torch.equal(est.output, est2.output) and torch.equal(est.trace, est2.trace) and torch.equal(v_q, v_q2)


def test_all_certain_rows_and_empty_rows(op):
    q, stored, tail, log_pi = _case(65, 4, 64, "channel", certain=True, seed=5)
    est, v_q, _, _ = _check(q, stored, tail, log_pi, 67)
    assert bool((est.trace == 0).all()) and bool((v_q > 0).all())
    empty = log_pi.clone()
    empty[0] = float("-inf")
    est, v_q = _run(stored, q, tail, empty)
    assert bool((est.output[0] == 0).all()) and bool((est.lse[0] == float("-inf")).all())
    assert bool(torch.isinf(est.trace[0]).all()) and bool(torch.isinf(v_q[0]).all())
    assert bool(torch.isfinite(v_q[1]).all())


@pytest.mark.parametrize("change", ["value code", "key code", "value scale"])
def test_negative_control_a_changed_code_or_scale_is_rejected(op, change):
    """One code off by one or one scale off by one float16 step, in the heaviest slot of row (0, 0): the op's
    output leaves the tolerance of the original's oracle (and the unchanged input passes it)."""
    q, stored, tail, log_pi = _case(33, 1, 64, "channel", tail=0, seed=6)
    est, _, e64, tol = _check(q, stored, tail, log_pi, 33)
    kc, ks, vc, vs = (x.clone() for x in _op_args(stored))
    i = int(e64.weights[0, 0].argmax())
    if change == "value code":
        j = int(vc[0, 0, i].abs().argmin())
        vc[0, 0, i, j] += 1
    elif change == "key code":
        j = int((q[0, 0].abs() * (vc[0, 0, i].abs() < 127)).argmax())
        kc[0, 0, i, j] += 1 if kc[0, 0, i, j] < 127 else -1
    else:
        vs[0, 0, i] = torch.nextafter(vs[0, 0, i], torch.tensor(float("inf"), dtype=torch.float16))
    bad, _ = cpu.quantized_hajek_attention(q, kc, ks, vc, vs, log_pi)
    excess = (bad.output[0, 0] - e64.output[0, 0]).abs() - tol["output"][0, 0]
    assert float(excess.max()) > 0, change


def test_bad_input_names_the_argument(op):
    q, stored, tail, log_pi = _case(33, 1, 64, "channel", tail=0)
    kc, ks, vc, vs = _op_args(stored)
    call = cpu.quantized_hajek_attention
    with pytest.raises(TypeError, match="value_codes must be int8"):
        call(q, kc, ks, vc.float().to(torch.float8_e4m3fn), vs, log_pi)
    with pytest.raises(TypeError, match="key_codes must be"):
        call(q, kc.float(), ks, vc, vs, log_pi)
    with pytest.raises(ValueError, match="key_scales must be a float16 tensor of shape"):
        call(q, kc, ks[:, :, :1], vc, vs, log_pi)
    bad = vs.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="value_scales must be finite"):
        call(q, kc, ks, vc, bad, log_pi)
    with pytest.raises(ValueError, match="log_pi must be"):
        call(q, kc, ks, vc, vs, log_pi[..., :-1])
    with pytest.raises(TypeError, match="q must be a float32"):
        call(q.double(), kc, ks, vc, vs, log_pi)
    with pytest.raises(ValueError, match="layout must be one of"):
        call(q, kc, ks, vc, vs, log_pi, layout="rows")
    with pytest.raises(ValueError, match="key_scales must be None"):
        call(q, kc.float(), ks, vc, vs, log_pi, layout="values")
    with pytest.raises(ValueError, match="key_scales must be a float16 tensor of shape"):   # the per-step call
        call(q, kc, ks[:, :, :1], vc, vs, log_pi, validate=False)
    with pytest.raises(ValueError, match="tail must hold"):
        call(q, kc, ks, vc, vs, log_pi, tail=(torch.zeros(1, 2, 1, 64), torch.zeros(1, 2, 1, 64)))


# ----------------------------------------------------------------------------- the press's decode


N = 300


def _decode_run(monkeypatch, press, *, torch_path: bool):
    """forced_logits of the small model under ``press`` with a spy on quantized_decode: (logits, press, calls),
    each call the decode's inputs and its records' routes."""
    if torch_path:
        monkeypatch.setenv(D.CPU_OP_ENV_VAR, "0")
    else:
        monkeypatch.delenv(D.CPU_OP_ENV_VAR, raising=False)
    calls, original = [], FT.quantized_decode

    def spy(query, layer, **kw):
        st = layer.quantized
        out, records = original(query, layer, **kw)
        calls.append(dict(q=query.detach().clone(), stored=st, log_w=layer.log_weights.clone(),
                          tail_k=layer.keys.clone(), tail_v=layer.values.clone(), scale=kw["scale"],
                          routes={est.route for est, _ in records}))
        return out, records

    monkeypatch.setattr(FT, "quantized_decode", spy)
    ids = torch.randint(1, 96, (1, N), generator=torch.Generator().manual_seed(0))
    cont = [torch.tensor([[5 + t]]) for t in range(3)]
    logits, _ = forced_logits(tiny_model(), ids, cont, press)
    monkeypatch.setattr(FT, "quantized_decode", original)
    return logits, press, calls


def _oracle_radius(call, delta: float) -> torch.Tensor:
    """(h_q,) the radius sqrt((trace + V_q) / delta) of a decode step's state, float64 (kvcert.fast at float64)."""
    st, m = call["stored"], call["stored"].log_pi.shape[-1]
    log_w = call["log_w"].double()
    held = st.__class__(st.keys, st.values, log_w[..., :m], st.positions, st.kv_bits, st.layout)
    tail = (call["tail_k"].double(), call["tail_v"].double(), log_w[..., m:])
    q = call["q"][:, :, 0].double()
    k, v = st.dequantize(torch.float64)
    est = F.hajek_attention(q, torch.cat([k, tail[0]], 2), torch.cat([v, tail[1]], 2), log_pi=log_w,
                            scale=call["scale"], per_coordinate=False)
    _, v_q = F.held_rounding_terms(q, held, tail=tail, scale=call["scale"])
    return torch.sqrt((est.trace + v_q) / delta)[0]


def test_the_press_decode_runs_the_op_and_matches_the_torch_path(op, monkeypatch):
    """PoissonPress(kv_bits=8, sketch=None): the op route on every step and layer (the torch one with
    KVCERT_CPU_OP=0), the same tokens, and per step, layer and head |r_op - r_torch| <= tol_op + tol_torch +
    |ref(op's inputs) - ref(torch's inputs)|, tol = 4 rounding(float32, n) ref (the radius of a trace of relative
    rounding 8 rounding moves by half of it)."""
    make = lambda: kvcert.PoissonPress(compression_ratio=0.8, seed=2, sketch=None, kv_bits=8)  # noqa: E731
    la, pa, ca = _decode_run(monkeypatch, make(), torch_path=False)
    lb, pb, cb = _decode_run(monkeypatch, make(), torch_path=True)
    assert {r for c in ca for r in c["routes"]} == {"cpu_op"}
    assert {r for c in cb for r in c["routes"]} == {"torch"}
    assert torch.equal(la.argmax(-1), lb.argmax(-1))
    assert len(ca) == len(cb) == 3 * 2
    ra, rb = pa.certificates[0].radius, pb.certificates[0].radius
    for i, (a, b) in enumerate(zip(ca, cb)):
        step, li = divmod(i, 2)
        n = a["log_w"].shape[-1]
        ref_a, ref_b = _oracle_radius(a, pa.delta), _oracle_radius(b, pb.delta)
        tol = 4 * rounding(torch.float32, n) * (ref_a + ref_b)
        got_a, got_b = ra[step + 1, li].double(), rb[step + 1, li].double()
        assert_close(f"radius step {step} layer {li}", got_a, got_b, tol + (ref_a - ref_b).abs())
        assert_close(f"op radius step {step} layer {li}", got_a, ref_a, 4 * rounding(torch.float32, n) * ref_a)


def test_what_the_op_lacks_stays_on_the_torch_path(op, monkeypatch):
    """The sketched default (PoissonPress(kv_bits=8)) and quantized_bound='strict' (B_q: a second pass) decode on
    the torch path with the op available."""
    for press in (kvcert.PoissonPress(compression_ratio=0.8, seed=2, kv_bits=8),
                  kvcert.PoissonPress(compression_ratio=0.8, seed=2, sketch=None, kv_bits=8,
                                      quantized_bound="strict")):
        logits, _, calls = _decode_run(monkeypatch, press, torch_path=False)
        assert bool(torch.isfinite(logits).all()) and {r for c in calls for r in c["routes"]} == {"torch"}
