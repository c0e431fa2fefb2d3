"""PoissonPress(scorer=<a kvpress 0.5.5 ScorerPress>) on the default model.

The scores kvcert's design receives are kvpress's own, bit for bit: kvpress's press run through
kvpress's forward hook and the same press class run as kvcert's scorer (inside
``kvcert.generate``) see the same layer inputs and return the same tensor in every layer; the
design then draws from those scores (the kept tokens' pi are the press's inclusion
probabilities of them), and the certificates are finite and informative.
"""

from __future__ import annotations

import kvpress
import pytest
import torch
from kvpress_support import Recording, kvcert_cache, kvpress_prefill

import kvcert

#: kvpress score-based presses, as a kvpress user makes them (their own defaults)
PRESSES = {
    "SnapKVPress": lambda: kvpress.SnapKVPress(),
    "ExpectedAttentionPress": lambda: kvpress.ExpectedAttentionPress(),
    "KeyDiffPress": lambda: kvpress.KeyDiffPress(),
    "TOVAPress": lambda: kvpress.TOVAPress(),
    "KnormPress": lambda: kvpress.KnormPress(),
}


@pytest.fixture(scope="module")
def kvpress_scores(inputs):
    """name -> {layer: the scores kvpress's own forward hook computes with PRESSES[name] on the
    prefill of the prompt} (each computed once per module)."""
    model, _, _, ids = inputs
    done = {}

    def scores(name):
        if name not in done:
            theirs = Recording(PRESSES[name]())
            theirs.press.compression_ratio = 0.5  # kvpress scores only when it compresses
            kvpress_prefill(model, theirs.press, ids)
            done[name] = theirs.by_layer()
        return done[name]

    return scores


@pytest.mark.parametrize("name", list(PRESSES))
def test_generate_with_a_kvpress_scorer_scores_as_kvpress(inputs, kvpress_scores, name):
    """kvcert.generate under PoissonPress(scorer=<kvpress press>): the scores kvcert's design gets
    in every layer equal, bit for bit, those kvpress computes on the same prompt; the certificates
    are finite and informative (> 0), and the cache was compressed."""
    model, tokenizer, prompt, ids = inputs
    want = kvpress_scores(name)
    ours = Recording(PRESSES[name]())
    r = kvcert.generate(model, tokenizer, prompt, press=kvcert.PoissonPress(compression_ratio=0.5, scorer=ours.press,
                                                                            seed=0), max_new_tokens=3)
    got = ours.by_layer()  # one call per layer: at the prefill, none at decoding
    assert sorted(got) == sorted(want) == list(range(model.config.num_hidden_layers))
    for layer in want:
        assert got[layer].shape == (1, model.config.num_key_value_heads, ids.shape[1])
        assert torch.equal(got[layer], want[layer]), f"layer {layer}: max diff {(got[layer] - want[layer]).abs().max()}"
    c = r.certificates
    assert r.prompt_tokens == ids.shape[1] and len(r.token_ids) == 3
    steps = c.relative_radius[1:]
    assert bool(torch.isfinite(steps).all()) and bool(torch.isfinite(c.trace).all())
    assert float(steps.max()) > 0  # randomized: informative, unlike a deterministic press's 0
    assert int(c.kept[1].max()) < r.prompt_tokens  # it compressed


def test_the_kept_tokens_carry_the_design_pi_of_kvpress_scores(inputs, kvpress_scores):
    """The design draws from kvpress's scores: every kept token's log pi is the press's inclusion
    probability of those scores, as stored (log pi rounded to the cache's float32)."""
    model, _, _, ids = inputs
    want = kvpress_scores("SnapKVPress")
    press = kvcert.PoissonPress(compression_ratio=0.5, scorer=PRESSES["SnapKVPress"](), seed=7)
    cache = kvcert_cache(model, press, ids)
    for layer, scores in want.items():
        c = cache.layers[layer]
        valid = c.positions >= 0
        # the default design samples the budget less its sketch's memory, which reads the head dims
        pi = press.inclusion_probabilities(scores, head_dims=(c.keys.shape[-1], c.values.shape[-1]))
        pi = pi.gather(-1, c.positions.clamp_min(0))[valid]
        # compressed: fewer slots than prompt tokens (the default draws a fixed count per head, so no padding)
        assert 0 < int(valid.sum()) and c.positions.shape[-1] < ids.shape[-1]
        stored = c.log_weights[valid]
        want_log = torch.log(pi).to(stored.dtype)
        ulp = torch.finfo(stored.dtype).eps * want_log.abs().clamp_min(torch.finfo(stored.dtype).tiny)
        assert bool(((stored - want_log).abs() <= ulp).all()), f"layer {layer}"
