"""A quantized cache in the Hugging Face path: ``PoissonPress(kv_bits=8)`` (and 4).

What is checked, each against an independent computation:

- the cache layer holds the kept tokens as int8 codes and float16 scales (``layer.quantized``), the tokens
  decoded since at 16 bits, and the decode dequantizes them (the model generates);
- one decode step's recorded radius is the reference's formula (docs/quantized.md, Proposition 2 and
  section 4) on the layer's state: the stored codes and scales through ``kvcert.reference.quantized``
  (``logit_bound``, ``logit_variance``, ``value_bound``), the step's exact tokens with rounding terms 0, the
  Hajek weights over every held slot, float64 NumPy; ``"variance"`` (the rule on V + V_q) and ``"strict"``
  (B_q + r). Tolerance: float32 rounding of a length-n reduction (tests/support.py ``rounding``) against the
  radius. Negative control: the 16-bit radius of the same state (no rounding term) misses it;
- the memory the layer holds (``memory_elements``) is ``kvcert.reference.quantized_memory_fraction`` of its
  kept count, the sketch's elements counted, and ``kept`` counts the stored tokens;
- bad input is refused with the argument named.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import kvcert
import kvcert.cache as C
import kvcert.fast as F
import kvcert.fast.token_design as FT
import kvcert.reference.quantized as RQ
from kvcert.fast import TokenDesign
from model_fixtures import forced_logits, tiny_model
from support import rounding

N, D, DV, H_Q, H_KV = 300, 16, 16, 4, 2


def _spy(monkeypatch):
    """Record each quantized decode's query and a copy of the layer's state."""
    calls = []
    original = FT.quantized_decode

    def spy(query, layer, **kw):
        st = layer.quantized
        calls.append(dict(q=query.detach().clone(), stored=st, log_w=layer.log_weights.clone(),
                          tail_k=layer.keys.clone(), tail_v=layer.values.clone(), **kw))
        return original(query, layer, **kw)

    monkeypatch.setattr(FT, "quantized_decode", spy)
    return calls


def _run(press, steps: int = 1, n: int = N, seed: int = 0):
    model = tiny_model()
    ids = torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))
    cont = [torch.tensor([[5 + t]]) for t in range(steps)]
    logits, cache = forced_logits(model, ids, cont, press)
    return logits, cache


def _reference_radius(call, j: int, delta: float, bound: str) -> tuple[float, float]:
    """(the radius of the reference formula, the 16-bit radius of the same state) for query head j, float64."""
    st, g = call["stored"], H_Q // H_KV
    h = j // g
    m = st.log_pi.shape[-1]
    tau = call["scale"]
    q = call["q"][0, j, 0].double().numpy()
    keys = RQ.QuantizedChannels(st.keys.codes[0, h].double().numpy(), st.keys.scales[0, h].double().numpy(),
                                st.keys.group, st.keys.format, st.keys.rounding)
    values = RQ.QuantizedRows(st.values.codes[0, h].double().numpy(), st.values.scales[0, h].double().numpy(),
                              st.values.format, st.values.rounding)
    k = np.concatenate([keys.dequantize(), call["tail_k"][0, h].double().numpy()])
    v = np.concatenate([values.dequantize(), call["tail_v"][0, h].double().numpy()])
    log_pi = call["log_w"][0, h].double().numpy()
    r = k.shape[0] - m
    zero = np.zeros(r)
    eta = np.concatenate([RQ.logit_bound(q, keys, scale=tau), zero])
    eps = np.concatenate([RQ.value_bound(values), zero])
    on = log_pi > -np.inf
    s = np.where(on, tau * k @ q - np.where(on, log_pi, 0.0), -np.inf)
    w = np.exp(s - s.max())
    w /= w.sum()
    o = w @ v
    dist2 = np.sum((v - o) ** 2, axis=1)
    pi = np.exp(np.where(on, log_pi, -np.inf))
    trace = float(np.sum(np.where(on, (1 - pi) * w ** 2 * dist2, 0.0)))
    if bound == "variance":
        sigma2 = np.concatenate([RQ.logit_variance(q, keys, scale=tau), zero])
        vvar = np.concatenate([np.sum(values.variance_bound(), axis=1), zero])
        v_q = float(np.sum(np.where(on, w ** 2 * (sigma2 * dist2 + vvar), 0.0)))
        return math.sqrt((trace + v_q) / delta), math.sqrt(trace / delta)
    wo = w[on]
    f_low, f_high = np.sum(wo * np.exp(-eta[on])), np.sum(wo * np.exp(eta[on]))
    hh = np.exp(eta[on]) / f_low
    gg = np.maximum(hh - 1, 1 - np.exp(-eta[on]) / f_high)
    b_q = float(np.sum(wo * (gg * np.sqrt(dist2[on]) + hh * eps[on])))
    return b_q + math.sqrt(trace / delta), math.sqrt(trace / delta)


@pytest.mark.parametrize("bound, bits", [("variance", 4), ("strict", 8), ("strict", 4)])
def test_a_decode_steps_radius_is_the_reference_formula_on_the_stored_state(monkeypatch, bound, bits):
    """(At 8 bits this model's V_q is below the tolerance of the radius, so the variance rule is checked at 4.)"""
    press = kvcert.PoissonPress(compression_ratio=0.8, seed=2, sketch=None, kv_bits=bits, quantized_bound=bound)
    calls = _spy(monkeypatch)
    logits, cache = _run(press, steps=2)
    assert bool(torch.isfinite(logits).all())
    certs = press.certificates[0]
    assert len(calls) == 2 * 2                              # steps x layers, layer-major within a step
    for i, call in enumerate(calls):
        step, li = divmod(i, 2)
        st = call["stored"]
        assert st.keys.codes.dtype == torch.int8 and st.values.scales.dtype == torch.float16 and st.kv_bits == bits
        assert st.values.rounding == ("stochastic" if bound == "variance" else "nearest")
        assert call["tail_k"].shape[2] == step + 1          # the decoded tokens, exact
        tol = 4 * rounding(torch.float32, st.log_pi.shape[-1] + step + 1)
        for j in range(H_Q):
            want, sixteen = _reference_radius(call, j, press.delta, bound)
            got = float(certs.radius[step + 1, li, j])
            assert abs(got - want) <= tol * want, (step, li, j, got, want)
            assert abs(sixteen - want) > tol * want                 # the rounding term is there, and measurable


@pytest.mark.parametrize("fields", [dict(sketch=None), dict()], ids=["paper", "recommended"])
@pytest.mark.parametrize("bits", [8, 4])
def test_the_layer_counts_memory_as_the_reference(fields, bits):
    """After the prefill event the layer holds the reference's memory for its kept count (16-bit K+V units,
    codes, scales and log pi; the sketch's elements), and samples the budget of the same memory."""
    press = kvcert.PoissonPress(compression_ratio=0.8, seed=1, kv_bits=bits, **fields)
    _, cache = _run(press, steps=0)
    design = press.design
    extra = 0.0 if design.sketch is None else float(design.sketch.elements(D, DV))
    for layer in cache.layers:
        st = layer.quantized
        assert st is not None and layer.keys.shape[2] == 0 and not bool(layer.quantized_whole.any())
        kept = layer.kept[0]
        assert torch.equal(kept, st.kept[0])
        assert layer.budgets[0].item() == pytest.approx(F.sampled_budget(N * 0.2, D, DV, bits, extra=extra))
        for h in range(H_KV):
            want = RQ.quantized_memory_fraction(N, D, DV, kept=int(kept[h]), kv_bits=bits, extra=extra)
            got = float(layer.memory_elements()[0, h]) / (N * (D + DV))
            assert got == pytest.approx(want, rel=1e-12)
        # the same memory at 16 bits samples fewer tokens
        assert float(kept.double().min()) > dataclasses.replace(design, kv_bits=16).sampled_budget(N, D, DV) + 10


def test_a_prompt_that_fits_is_stored_whole():
    """A budget whose memory holds every token at 8 bits keeps them all, stored; the radius is then the
    whole-cache rule (the rule on V_q capped at B_q: nothing sampled)."""
    press = kvcert.PoissonPress(compression_ratio=0.4, seed=1, sketch=None, kv_bits=8)
    _, cache = _run(press, steps=1, n=120)
    for layer in cache.layers:
        assert bool(layer.quantized_whole.all()) and torch.equal(layer.quantized.kept[0], torch.full((H_KV,), 120))
    certs = press.certificates[0]
    assert bool((certs.radius[1] > 0).all()) and bool(torch.isfinite(certs.radius).all())


def test_sixteen_bits_is_the_unquantized_press():
    a, b = kvcert.PoissonPress(compression_ratio=0.8, seed=2), kvcert.PoissonPress(compression_ratio=0.8, seed=2,
                                                                                   kv_bits=16)
    la, ca = _run(a, steps=1)
    lb, cb = _run(b, steps=1)
    assert torch.equal(la, lb) and cb.layers[0].quantized is None
    assert torch.equal(a.certificates[0].radius, b.certificates[0].radius)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"kv_bits must be one of \(16, 8, 4\)"):
        kvcert.PoissonPress(compression_ratio=0.5, kv_bits=12)
    with pytest.raises(ValueError, match="kind: a quantized cache"):
        kvcert.PoissonPress(compression_ratio=0.5, kv_bits=8, sketch=None, kind="chi2")
    with pytest.raises(ValueError, match="kv_bits: a target_error"):
        kvcert.PoissonPress(target_error=0.1, kv_bits=8)
    codes = torch.ones(1, 1, 2, 4, dtype=torch.int8)
    with pytest.raises(ValueError, match="scales"):
        F.QuantizedRows(codes, torch.tensor([[[float("nan"), 1.0]]], dtype=torch.float16), "int8")
    with pytest.raises(ValueError, match="zero scale"):
        F.QuantizedRows(codes, torch.tensor([[[0.0, 1.0]]], dtype=torch.float16), "int8")
    k = torch.randn(1, 1, 5, D, dtype=torch.float64)
    design = TokenDesign(compression_ratio=0.5, kv_bits=8)
    ev = design.event(torch.randn(1, 2, 4, D, dtype=torch.float64), k, k)
    layer = C.KVCertLayer()
    layer.update(k.float(), k.float())
    with pytest.raises(ValueError, match=r"whole must have shape \(b,\)"):
        layer.install_quantized(ev.stored, design, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="kv_bits"):
        F.store_kv(k, k, torch.zeros(1, 1, 5), torch.zeros(1, 1, 5, dtype=torch.long), kv_bits=16)


def test_decode_time_compression_refuses_a_quantized_cache():
    """DecodingPress compresses the held keys and values again while decoding; a quantized cache's are codes,
    so the first decode-time event refuses it by name (negative control: the same at 16 bits decodes)."""
    for bits, fails in ((8, True), (16, False)):
        base = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch=None, kv_bits=bits)
        press = kvcert.DecodingPress(base_press=base, compression_interval=2, target_size=40)
        if fails:
            with pytest.raises(ValueError, match="kv_bits: a quantized cache is compressed once"):
                _run(press, steps=3, n=120)
        else:
            logits, _ = _run(press, steps=3, n=120)
            assert bool(torch.isfinite(logits).all())


def test_a_sequence_stores_the_same_codes_alone_or_in_a_padded_batch():
    """Each row of a left-padded batch stores what its event stores alone (the streams are keyed by token
    position, every row on row 0's stream), padded to the batch's longest row; its certificates match the
    alone run's to float32 rounding (negative control: another seed stores other codes)."""
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    long, short = torch.randint(1, 96, (1, 200), generator=g), torch.randint(1, 96, (1, 150), generator=g)
    ids = torch.cat([long, torch.cat([torch.zeros(1, 50, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    cont = [torch.tensor([[7]])]
    make = lambda seed=1: kvcert.PoissonPress(compression_ratio=0.7, seed=seed, sketch=None, kv_bits=8)  # noqa: E731
    batch = make()
    _, cache = forced_logits(model, ids, cont, batch, mask=mask)
    for row, x in ((0, long), (1, short)):
        alone, other = make(), make(seed=2)
        _, c1 = forced_logits(model, x, cont, alone)
        _, c2 = forced_logits(model, x, cont, other)
        for li in range(2):
            got, want = cache.layers[li].quantized, c1.layers[li].quantized
            kept = want.kept[0]
            assert torch.equal(got.kept[row], kept)
            for h in range(H_KV):
                k = int(kept[h])
                assert torch.equal(got.keys.codes[row, h, :k], want.keys.codes[0, h, :k])
                assert torch.equal(got.values.scales[row, h, :k], want.values.scales[0, h, :k])
                assert torch.equal(got.positions[row, h, :k], want.positions[0, h, :k])
                assert not bool((got.log_pi[row, h, k:] > float("-inf")).any())
            assert not torch.equal(c2.layers[li].quantized.values.codes, want.values.codes)
        a, b = alone.certificates[0].radius[1:], batch.certificates[row].radius[1:]
        assert torch.allclose(a, b, rtol=4 * rounding(torch.float32, 200), atol=0.0)
