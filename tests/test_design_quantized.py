"""The token design at kv_bits < 16 (kvcert.fast.TokenDesign) against kvcert.reference.evict_and_certify(kv_bits=...).

The two backends draw their randomness from different generators (the reference from NumPy's PCG64 streams
``design_generator`` and ``rounding_generator``, kvcert.fast from its counter-based stream), so the comparison
hands the reference the fast design's own uniforms: ``design_generator`` and ``rounding_generator`` return a
generator that replays them (the sample's uniforms, then a systematic draw's start; the kept keys', then the
kept values'), in the order the reference draws. With the same randomness the two must keep the same tokens
and store the same codes and scales bit for bit (both quantize in float64), and the certificate computed from
the stored rows in float32 (:meth:`TokenDesign.certify`) must match the reference's float64 one within float32
rounding of a length-n reduction (tests/support.py ``rounding``), measured against the quantity's own scale.

Negative controls: the reference's 16-bit result (a different kept set and no rounding) and the stored value
scales moved by one float16 step each fail the same comparison.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kvcert.fast as F
import kvcert.reference.design as RD
import kvcert.reference.quantized as RQ
from kvcert.fast import TokenDesign
from kvcert.reference import sketch as SK

from support import assert_within_scale, field_scale, rounding

H_Q, H_KV, D, DV, W = 4, 2, 16, 16, 8
N, BUDGET, SEED = 700, 150, 5
DESIGNS = {"paper": dict(sketch=None), "recommended": dict(F.RECOMMENDED_FIELDS)}
#: float32 rounding of the certificate's sums over the n held tokens, with a factor for the few operations
#: after the sums (exp of the logits, sqrt, B_q's log-space sums): each a few eps of the result
TOL = 4 * rounding(torch.float32, N)


class Replay(np.random.Generator):
    """A numpy Generator that returns the given arrays, one per ``random`` call, in order."""

    def __init__(self, arrays):
        super().__init__(np.random.PCG64(0))
        self.arrays = list(arrays)

    def random(self, size=None, dtype=np.float64, out=None):
        a = np.asarray(self.arrays.pop(0), dtype=np.float64)
        return float(a) if size is None else a.reshape(size)


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, H_Q, W, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, H_KV, N, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, H_KV, N, DV, generator=g, dtype=torch.float64)
    u = torch.rand(1, H_KV, N, generator=g, dtype=torch.float64)
    return q, k, v, u


def _fast(name: str, bits: int, bound: str):
    q, k, v, u = _inputs()
    design = TokenDesign(target_size=BUDGET, seed=SEED, kv_bits=bits, quantized_bound=bound, observation_window=W,
                         **DESIGNS[name])
    ev = design.event(q, k, v, scores=u, layer=0, event=0)
    assert ev.sampled and ev.stored is not None
    return design, ev, (q, k, v, u)


def _reference(design, ev, inputs, h: int, j: int, monkeypatch, *, kv_bits=None):
    """evict_and_certify for query head j (KV head h) with the fast design's uniforms."""
    q, k, v, u = inputs
    keep = ev.decision.keep[h]
    kept = int(keep.sum())
    uni = F.design_uniforms((H_KV, N), SEED, row_streams=False)[h].numpy()
    start = float(F.start_uniforms((H_KV,), SEED, row_streams=False)[h])
    index = ev.stored.positions.clamp(min=0)
    shape = tuple(ev.stored.values.codes.shape)
    ku = F.rounding_uniforms(shape[:3] + (D,), SEED, part="keys", index=index, row_streams=False)[0, h, :kept]
    vu = F.rounding_uniforms(shape[:3] + (DV,), SEED, part="values", index=index, row_streams=False)[0, h, :kept]
    monkeypatch.setattr(RD, "design_generator", lambda *a, **kw: Replay([uni, start]))
    monkeypatch.setattr(RQ, "rounding_generator", lambda *a, **kw: Replay([ku.numpy(), vu.numpy()]))
    bits = design.kv_bits if kv_bits is None else kv_bits
    sz = design.sizes(N, budget=dataclasses.replace(design, kv_bits=bits).sampled_budget(N, D, DV))
    g = H_Q // H_KV
    tilt = q[0, h * g:(h + 1) * g, -design.observation_window:].reshape(-1, D).numpy()
    return SK.evict_and_certify(
        q[0, j, -1].numpy(), k[0, h].numpy(), v[0, h].numpy(), u[0, h].numpy(), float(BUDGET), seed=SEED,
        delta=design.delta, design="paper" if design.sketch is None else None, sinks=sz.sinks, window=sz.window,
        top=sz.top, floor=design.floor, tilt=tilt, sampling=design.sampling,
        kv_bits=bits, kv_layout=design.kv_layout,
        quantized_bound=design.quantized_bound)


def _certify(design, ev, q, stored=None):
    return design.certify(ev.stored if stored is None else stored, q[:, :, -1].float(), sketch=ev.sketch)


def _close(got, want, field: str) -> bool:
    return bool(np.all(np.abs(np.asarray(got, np.float64) - want) <= TOL * field_scale(field, want)))


@pytest.mark.parametrize("name", list(DESIGNS))
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bound", ["variance", "strict"])
def test_the_design_is_the_reference(name, bits, bound, monkeypatch):
    design, ev, inputs = _fast(name, bits, bound)
    q, k, v, u = inputs
    cert = _certify(design, ev, q)
    fmt = F.KV_FORMAT[bits]
    g = H_Q // H_KV
    for h in range(H_KV):
        keep = ev.decision.keep[h]
        kept = int(keep.sum())
        # the kept set: the reference's pi at the same sampled budget and the same uniforms
        sz = design.sizes(N, budget=ev.budget)
        pi = RD.inclusion_probabilities(u[0, h].numpy(), ev.budget, sinks=sz.sinks, window=sz.window, top=sz.top,
                                        floor=design.floor)
        uni = F.design_uniforms((H_KV, N), SEED, row_streams=False)[h].numpy()
        start = float(F.start_uniforms((H_KV,), SEED, row_streams=False)[h])
        ref_keep = RD.poisson_sample(pi, uniforms=uni) if design.sampling == "poisson" else \
            RD.systematic_sample(pi, uniforms=uni, start=start)
        assert np.array_equal(ref_keep, keep.numpy())
        # the stored codes and scales, bit for bit
        rounding_kw = {}
        if bound == "variance":
            index = ev.stored.positions.clamp(min=0)
            shape = tuple(ev.stored.values.codes.shape)
            ku = F.rounding_uniforms(shape[:3] + (D,), SEED, part="keys", index=index, row_streams=False)
            rounding_kw = dict(rounding="stochastic", uniforms=ku[0, h, :kept].numpy())
        ref_k = RQ.quantize_channels(k[0, h][keep].numpy(), fmt, **rounding_kw)
        assert np.array_equal(ev.stored.keys.codes[0, h, :kept].numpy(), ref_k.codes)
        assert np.array_equal(ev.stored.keys.scales[0, h].numpy().astype(np.float64)[:ref_k.scales.shape[0]],
                              ref_k.scales)
        for j in range(h * g, (h + 1) * g):
            res = _reference(design, ev, inputs, h, j, monkeypatch)
            assert res.kept == kept and res.budget == pytest.approx(ev.budget, rel=1e-15)
            assert res.memory == pytest.approx(F.quantized_memory_fraction(
                N, D, DV, kept=kept, kv_bits=bits,
                extra=0.0 if design.sketch is None else float(design.sketch.elements(D, DV))), rel=1e-12)
            assert_within_scale("output", cert.output[0, j].numpy(), res.output, TOL, "output")
            assert_within_scale("radius", cert.radius[0, j].item(), res.radius, TOL, "radius")
            assert_within_scale("B_q", cert.quantization_bound[0, j].item(), res.quantization_bound, TOL, "bound")
            assert_within_scale("V_q", cert.quantization_variance[0, j].item(), res.quantization_variance, TOL,
                                "variance_q")


@pytest.mark.parametrize("name", list(DESIGNS))
def test_negative_controls_fail_the_comparison(name, monkeypatch):
    """The reference at 16 bits (another sample, no rounding), and the design's stored rows with every value scale
    one float16 step up (scales rounded the other way: 1/1024 relative), each miss the tolerance the test
    above holds the design to."""
    design, ev, inputs = _fast(name, 8, "variance")
    q = inputs[0]
    cert = _certify(design, ev, q)
    res16 = _reference(design, ev, inputs, 0, 0, monkeypatch, kv_bits=16)
    assert not (_close(cert.output[0, 0].numpy(), res16.output, "output")
                and _close(cert.radius[0, 0].item(), res16.radius, "radius"))
    st = ev.stored
    scales = (st.values.scales.view(torch.int16) + 1).view(torch.float16)   # one float16 step up, every row
    moved = dataclasses.replace(st, values=F.QuantizedRows(st.values.codes, scales, st.values.format,
                                                           st.values.rounding))
    res = _reference(design, ev, inputs, 0, 0, monkeypatch)
    bad = _certify(design, ev, q, stored=moved)
    assert _close(cert.output[0, 0].numpy(), res.output, "output")          # the comparison passes unmoved
    assert not (_close(bad.output[0, 0].numpy(), res.output, "output")
                and _close(bad.quantization_variance[0, 0].item(), res.quantization_variance, "variance_q"))


def test_sixteen_bits_is_the_unquantized_event():
    """kv_bits=16 (the default) is the design without the field: the same event, no stored tokens; the
    layout and bound are checked and unused."""
    q, k, v, u = _inputs()
    base = TokenDesign(target_size=BUDGET, seed=SEED)
    same = TokenDesign(target_size=BUDGET, seed=SEED, kv_bits=16, kv_layout="token", quantized_bound="strict")
    a, b = base.event(q, k, v, scores=u), same.event(q, k, v, scores=u)
    assert torch.equal(a.decision.keep, b.decision.keep) and torch.equal(a.decision.pi, b.decision.pi)
    assert a.stored is None and b.stored is None and a.budget == b.budget == BUDGET


def test_the_budget_is_memory():
    """At 8 bits the design samples about twice the tokens in the memory of the 16-bit budget (the reference's
    ``sampled_budget``), and keeps every token, stored, when the whole cache fits."""
    d8 = TokenDesign(target_size=BUDGET, kv_bits=8)
    assert d8.sampled_budget(N, D, DV) == pytest.approx(RQ.sampled_budget(BUDGET, D, DV, 8))
    assert 1.7 < d8.sampled_budget(N, D, DV) / BUDGET < 2.0
    assert d8.sampled_budget(200, D, DV) == 200.0 and not d8.evicts(200, D, DV)
    q, k, v, u = _inputs()
    ev = d8.event(q, k[:, :, :200], v[:, :, :200], scores=u[:, :, :200])
    assert not ev.sampled and ev.stored is not None and bool((ev.stored.kept == 200).all())


@pytest.mark.parametrize("bad", [12, 16.0, True, "8", None])
def test_unsupported_bit_widths_name_the_argument(bad):
    with pytest.raises(ValueError, match=r"kv_bits must be one of \(16, 8, 4\)"):
        TokenDesign(compression_ratio=0.5, kv_bits=bad)


def test_bad_layout_bound_and_target():
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        TokenDesign(compression_ratio=0.5, kv_bits=8, kv_layout="block")
    with pytest.raises(ValueError, match="quantized_bound must be one of"):
        TokenDesign(compression_ratio=0.5, kv_bits=8, quantized_bound="loose")
    with pytest.raises(ValueError, match="kv_bits: a target_error"):
        TokenDesign(target_error=0.2, kv_bits=8)
