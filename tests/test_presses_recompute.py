"""Cell recompute (``PoissonPress(recompute_threshold=t)``, kvcert/presses/recompute.py): exact attention over the
full cache, kept aside, for every decoding cell whose relative radius exceeds t. At t = 0 the answers are the
full cache's, at t = inf the design's; on the default model, both protocols."""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import long_prompt, model_sdpa, smollm2  # noqa: F401

import kvcert

PROMPTS = [long_prompt(900), long_prompt(500)]  # left padding in the batch
NEW = 6


def _press(t=None, **kw):
    return kvcert.PoissonPress(compression_ratio=0.75, sketch=None, seed=2, recompute_threshold=t, **kw)


def _logp_gap(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a.logprobs, b.logprobs))


def test_threshold_zero_answers_as_the_full_cache_and_inf_as_the_design(model_sdpa):  # noqa: F811
    model, tok = model_sdpa
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    full = kvcert.generate(model, tok, PROMPTS, **kw)
    zero, inf, plain = _press(0.0), _press(math.inf), _press(None)
    r0 = kvcert.generate(model, tok, PROMPTS, press=zero, **kw)
    rinf = kvcert.generate(model, tok, PROMPTS, press=inf, **kw)
    rp = kvcert.generate(model, tok, PROMPTS, press=plain, **kw)
    # t = 0: every cell recomputed over the full cache: the full cache's tokens, and its
    # log-probabilities up to float32 rounding of two attention paths (sdpa and the recompute's einsum)
    assert r0.token_ids == full.token_ids
    assert _logp_gap(r0, full) < 1e-3
    # negative control: the design alone moves them by far more than that tolerance
    assert _logp_gap(rp, full) > 1e-2
    share = zero.recompute_share
    assert torch.equal(share, torch.ones(2, dtype=torch.float64))
    # t = inf: nothing recomputed, the design's run exactly (tokens, log-probabilities, certificates)
    assert rinf.token_ids == rp.token_ids and _logp_gap(rinf, rp) == 0.0
    assert torch.equal(rinf.certificates[0].radius, rp.certificates[0].radius)
    assert torch.equal(inf.recompute_share, torch.zeros(2, dtype=torch.float64))
    # the certificates recorded are the Hajek estimate's whatever is recomputed
    assert torch.equal(r0.certificates[1].kept, rp.certificates[1].kept)


def test_query_agnostic_threshold_zero_is_the_full_cache(model_sdpa):  # noqa: F811
    model, tok = model_sdpa
    doc, q = long_prompt(900), " What is this text about?"
    full = kvcert.answer(model, tok, kvcert.compress_context(model, tok, doc), q, max_new_tokens=NEW)
    press = _press(0.0)
    ctx = kvcert.compress_context(model, tok, doc, press=press)
    r = kvcert.answer(model, tok, ctx, q, max_new_tokens=NEW)
    assert r.token_ids == full.token_ids and _logp_gap(r, full) < 1e-3
    assert float(press.recompute_share[0]) == 1.0
    plain = kvcert.answer(model, tok, kvcert.compress_context(model, tok, doc, press=_press(None)), q,
                          max_new_tokens=NEW)
    assert _logp_gap(plain, full) > 1e-2  # the tolerance above can fail


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "1", True])
def test_bad_thresholds_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="recompute_threshold"):
        kvcert.PoissonPress(compression_ratio=0.5, recompute_threshold=bad)


def test_combinations_it_does_not_serve_are_refused():
    with pytest.raises(ValueError, match="recompute_threshold.*16-bit"):
        kvcert.PoissonPress(compression_ratio=0.5, kv_bits=8, recompute_threshold=1.0)
    with pytest.raises(ValueError, match="recompute_threshold"):
        kvcert.DecodingPress(base_press=kvcert.PoissonPress(compression_ratio=0.5, sketch=None,
                                                            recompute_threshold=1.0), target_size=64)
    from kvcert.cli import UsageError, build_parser, make_press

    args = build_parser().parse_args(["generate", "--prompt", "x", "--press", "snapkv", "--recompute-threshold", "1"])
    with pytest.raises(UsageError, match="--recompute-threshold does not apply"):
        make_press(args)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--recompute-threshold", "0.5"])
    assert make_press(args).recompute_threshold == 0.5
