"""A registered scorer other than SnapKV drives the served block design, by configuration alone.

One plugin engine (``certified_llm(..., scorer="knorm")``), greedy, three prompts of 32 k + 1 tokens
in a small pool. K-norm scores every prompt token by the norm of its cached key (-||k||, shifted per
layer and KV head to >= 0), so the Hugging Face side needs only the keys of a plain forward of the
same float32 weights: per layer, ``BlockDesign.score`` on them, then ``BlockDesign.block_importance``
and ``BlockDesign.decide`` (the objects the engine runs) give the importance, pi and the kept blocks
to compare with what the engine reports.

Tolerance: the two engines' keys differ by float32 rounding accumulated over the layers, the
derivation of tests/vllm/test_vllm_hf_match.py (at most about 1e-3 relative); block importance
(block sums of the shifted scores, normalized shares, a mean) and pi (a smooth function of it) carry
the same order, so :data:`RTOL` = 1e-3. The kept blocks must agree exactly (a uniform within that
distance of its pi would flip a block: a loud failure, not a silent one). Negative control: the
importance of another key-only scorer (``keydiff``) on the same keys is far outside the tolerance,
so the comparison tells the scorers apart.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_support import BLOCK, hf_model, prompts

pytestmark = [pytest.mark.slow, pytest.mark.model]

SCORER = "knorm"
RATIO = 0.5
SEED = 3
PROMPTS = [1, 2, 6]  # 7, 8 and 9 blocks of 32 (the last one holds one token)
MAX_TOKENS = 4
#: relative tolerance of the importance and pi (module docstring)
RTOL = 1e-3
#: two prompts fit in the pool; the third runs on blocks the first two freed
POOL = 20

#: the module's engine (the ``engine`` fixture, tests/vllm/conftest.py)
ENGINE_SPEC = dict(plugin=True, compression_ratio=RATIO, seed=SEED, scorer=SCORER, kvcert={"granularity": "block"},
                   runs=[{"order": PROMPTS, "max_tokens": MAX_TOKENS}], num_gpu_blocks_override=POOL)


@pytest.fixture(scope="module")
def keys():
    """Per prompt: the (layers, h_kv, n, d) post-RoPE keys of a plain Hugging Face forward, and its values."""
    from kvcert.cache import cache_keyword

    model = hf_model()
    ckw = cache_keyword(model)
    out = {}
    with torch.no_grad():
        for i in PROMPTS:
            res = model(input_ids=torch.tensor([prompts()[i]]), use_cache=True)
            cache = res[ckw]
            out[i] = (torch.stack([layer.keys[0] for layer in cache.layers]),
                      torch.stack([layer.values[0] for layer in cache.layers]))
    return out


def _importance(design, k, v):
    """Block importance of one prompt: the design's scorer on every layer's keys/values (one dummy query:
    a key-only scorer reads none), stacked over layers, then the design's aggregation."""
    q = torch.zeros(1, k.shape[1], 1, k.shape[-1])
    scores = torch.stack([design.score(q, k[j][None], v[j][None], layer=j)[0] for j in range(k.shape[0])])
    return design.block_importance(scores[None], block_size=BLOCK)[0]


def test_configured_scorer_drives_the_served_decision(engine, keys):
    from kvcert.fast import prompt_event
    from kvcert.vllm import KVCertConfig

    design = KVCertConfig(compression_ratio=RATIO, seed=SEED, granularity="block", scorer=SCORER).design
    other = KVCertConfig(compression_ratio=RATIO, seed=SEED, granularity="block", scorer="keydiff").design
    evicted = 0
    for i in PROMPTS:
        rep = engine["runs"][0]["outputs"][str(i)]["report"]
        assert rep is not None, f"prompt {i}: the engine did not decide"
        k, v = keys[i]
        ub = _importance(design, k, v)
        u_v = np.asarray(rep["importance"])
        gap = np.abs(u_v / ub.numpy() - 1).max()
        control = np.abs(u_v / _importance(other, k, v).numpy() - 1).max()
        print(f"prompt {i}: importance max |vLLM / HF - 1| = {gap:.2e}; against keydiff {control:.2e}")
        np.testing.assert_allclose(u_v, ub.numpy(), rtol=RTOL, atol=0)
        assert control > 100 * RTOL, f"prompt {i}: knorm and keydiff importance are not told apart"
        d = design.decide(ub, event=prompt_event(prompts()[i]), n_tokens=len(prompts()[i]))
        np.testing.assert_allclose(np.asarray(rep["pi"]), d.pi.numpy(), rtol=RTOL, atol=0)
        assert rep["kept"] == d.kept.tolist(), f"prompt {i}: kept blocks differ"
        assert rep["evicted"] == d.evicted
        evicted += len(d.evicted)
    assert evicted > 0


def test_the_engine_runs_and_frees_the_evicted_blocks(engine):
    outs = engine["runs"][0]["outputs"]
    freed = 0
    for i in PROMPTS:
        out = outs[str(i)]
        rep = out["report"]
        assert len(out["token_ids"]) == MAX_TOKENS and not rep["preempted"]
        assert rep["blocks_freed"] == len(rep["evicted"])
        assert rep["free_after"] - rep["free_before"] == rep["blocks_freed"]
        certs = np.asarray(out["certificates"])
        assert certs[0] == 0.0 and bool(np.isfinite(certs).all())
        if any(p < 1 and kept for p, kept in zip(rep["pi"], rep["kept"])):  # a sampled block kept: variance > 0
            assert bool((certs[1:] > 0).all())
        freed += rep["blocks_freed"]
    assert freed > 0 and engine["blocks_freed"] == freed
    assert engine["stats"]["requests_decided"] == len(PROMPTS)
