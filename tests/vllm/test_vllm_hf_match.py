"""One block design, two paths: the vLLM plugin and the Hugging Face ``BlockPoissonPress`` agree.

One plugin engine for the module (in the session's plugin engine driver, tests/vllm/vllm_support.py), greedy, a
few prompts of 32 k + 1 tokens; the HF side runs in this process on the same float32 weights (the
folder vLLM reads), with ``BlockPoissonPress`` at the engine's block size (32) and the same design
and seed, decoding the tokens vLLM generated (teacher forcing, so every step's certificate is
about the same query).

What must agree, and how closely:

- the kept blocks: exactly (both draw ``kvcert.fast.block_sample`` with
  ``event = kvcert.fast.prompt_event(prompt)``; the inclusion probabilities come from the two
  engines' own float32 forwards, so they agree to float32 rounding only, and a block whose uniform
  fell within that distance of its pi_b could in principle flip: a loud failure, not a silent one);
- greedy tokens: the HF argmax equals vLLM's token at every step checked (the two engines' float32
  logits differ by rounding; a near tie could flip a token, which would show here);
- the per-token certificate (mean relative radius over layers and query heads, the same
  definition in ``kvcert.vllm.certificates`` and ``Certificates.per_step``) within
  :data:`CERT_RTOL`.

The tolerance: each engine computes every layer in float32 with its own kernels (vLLM's CPU
attention and fused ops, torch sdpa/matmuls here), so hidden states differ by accumulated float32
rounding. Per matmul of length k the relative difference is of order eps32 sqrt(k) (k = 576 hidden
units: 24 eps32 = 3e-6); about ten such reductions per layer over 30 layers compound to about
300 x 3e-6 = 1e-3 in the worst case (linear growth); the relative radius is a smooth ratio
(sqrt(trace) / ||o_hat||) of these quantities, so the same order bounds its relative difference.
CERT_RTOL = 1e-3 is that bound. Measured (2026-12-03, prompts 0, 1, 2, 6, eight tokens): inclusion
probabilities within 8.5e-7 relative, certificates within 1.1e-6 relative, greedy tokens identical;
the differences are printed with -s.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_support import hf_model, prompts

pytestmark = [pytest.mark.slow, pytest.mark.model]

BLOCK = 32
SEED = 3
RATIO = 0.5
DESIGN = {"sink_blocks": 1, "recent_blocks": 1, "top_blocks": 0, "floor": 0.1, "observation_window": 16,
          "reduce": "mean"}
PROMPTS = [0, 1, 6]  # 7, 8 and 10 blocks of 32 (the last holds one token); prompt 0 keeps no sampled block
MAX_TOKENS = 6
#: relative tolerance of the per-token certificates (module docstring)
CERT_RTOL = 1e-3
#: relative tolerance of the inclusion probabilities (float32 importance, same derivation)
PI_RTOL = 1e-3

#: the module's engine (the ``engine`` fixture, tests/vllm/conftest.py)
ENGINE_SPEC = dict(plugin=True, compression_ratio=RATIO, seed=SEED, kvcert={"granularity": "block", **DESIGN},
                   runs=[{"order": PROMPTS, "max_tokens": MAX_TOKENS}])


@pytest.fixture(scope="module")
def hf(engine):
    """Per prompt: the HF press (its decision and certificates) and the argmax of each teacher-forced step."""
    import kvcert
    from kvcert.cache import cache_keyword

    model = hf_model()
    ckw = cache_keyword(model)
    outs = engine["runs"][0]["outputs"]
    res = {}
    for i in PROMPTS:
        ids = torch.tensor([prompts()[i]])
        tokens = outs[str(i)]["token_ids"]
        press = kvcert.BlockPoissonPress(compression_ratio=RATIO, block_size=BLOCK, seed=SEED, **DESIGN)
        argmax = []
        with torch.no_grad(), press(model):
            out = model(input_ids=ids, use_cache=True)
            cache = out[ckw]
            argmax.append(int(out.logits[0, -1].argmax()))
            for t in tokens[:-1]:
                out = model(input_ids=torch.tensor([[t]]), use_cache=True, **{ckw: cache})
                cache = out[ckw]
                argmax.append(int(out.logits[0, -1].argmax()))
        res[i] = {"press": press, "argmax": argmax, "certs": press.certificates.per_step()[0].double().numpy()}
    return res


def test_same_kept_blocks_in_both_paths(engine, hf):
    evicted = 0
    for i in PROMPTS:
        rep = engine["runs"][0]["outputs"][str(i)]["report"]
        d = hf[i]["press"].decisions[0]
        assert rep is not None and d is not None, f"prompt {i}: one path did not evict"
        assert len(rep["kept"]) == d.kept.numel() == -(-len(prompts()[i]) // BLOCK)
        pi_v, pi_h = np.asarray(rep["pi"]), d.pi.numpy()
        print(f"prompt {i}: max |pi_vllm / pi_hf - 1| = {np.abs(pi_v / pi_h - 1).max():.2e}")
        np.testing.assert_allclose(pi_v, pi_h, rtol=PI_RTOL, atol=0)
        assert rep["kept"] == d.kept.tolist(), f"prompt {i}: kept blocks differ"
        evicted += len(rep["evicted"])
    assert evicted > 0


def test_greedy_tokens_identical(engine, hf):
    for i in PROMPTS:
        tokens = engine["runs"][0]["outputs"][str(i)]["token_ids"]
        assert len(tokens) == MAX_TOKENS
        assert hf[i]["argmax"] == tokens, f"prompt {i}: HF greedy {hf[i]['argmax']} vs vLLM {tokens}"


def test_certificates_agree(engine, hf):
    worst, compared = 0.0, 0
    for i in PROMPTS:
        v = np.asarray(engine["runs"][0]["outputs"][str(i)]["certificates"], dtype=np.float64)
        h = hf[i]["certs"]
        assert v.shape == h.shape == (MAX_TOKENS,)
        assert v[0] == 0.0 and h[0] == 0.0  # the first token comes from the full prompt cache
        d = hf[i]["press"].decisions[0]
        print(f"prompt {i}: pi {np.round(d.pi.numpy(), 3).tolist()} kept {d.kept.int().tolist()}")
        print(f"prompt {i}: certificates vLLM {v.tolist()}\n{'':10}HF   {h.tolist()}")
        if not bool((d.kept & (d.pi < 1)).any()):  # only the certainty set is left: no variance in either
            assert (v == 0).all() and (h == 0).all()
            continue
        assert (v[1:] > 0).all() and (h[1:] > 0).all()
        rel = np.abs(h[1:] / v[1:] - 1)
        worst = max(worst, float(rel.max()))
        print(f"prompt {i}: max relative certificate difference {rel.max():.2e}")
        np.testing.assert_allclose(h, v, rtol=CERT_RTOL, atol=0)
        compared += 1
    assert compared > 0
    print(f"worst relative certificate difference: {worst:.2e} (tolerance {CERT_RTOL:g})")
