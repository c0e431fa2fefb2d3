"""The "uniform" named design: every token outside the certainty set kept with the same pi.

Registered with one line in fast/token_design.py (``TokenDesign(floor=1.0, top_fraction=0.0, ...)``: the floor's
mixture weight 1 gives every tail token the share 1/|T|); served by name in the press (``preset="uniform"``) and
in the vLLM plugin (``KVCertConfig(preset="uniform")``, the request option ``kvcert_preset``; the engine keeps
the press's tokens: tests/vllm/test_vllm_token.py runs it as one of its designs).
"""

from __future__ import annotations

import dataclasses

import torch
from model_fixtures import forced_logits, tiny_family_model

import kvcert
from kvcert.fast import TOKEN_DESIGNS, TokenDesign


def test_the_design_gives_every_tail_token_the_same_pi():
    design = TOKEN_DESIGNS["uniform"]
    scores = torch.rand(3, 400, generator=torch.Generator().manual_seed(0), dtype=torch.float64) ** 4
    d = dataclasses.replace(design, compression_ratio=0.5).decide(scores)
    tail = d.pi < 1
    assert int(tail.sum()) == 3 * (400 - 4 - 32)  # no top slice: the certainty set is the sinks and the window
    assert torch.allclose(d.pi[tail], torch.full_like(d.pi[tail], (200 - 36) / (400 - 36)), rtol=0, atol=1e-12)
    # negative control: the paper design on the same scores gives unequal tail probabilities
    paper = TokenDesign(compression_ratio=0.5).decide(scores)
    assert float(paper.pi[paper.pi < 1].std()) > 1e-3


def test_the_press_serves_it_by_name():
    model = tiny_family_model("llama")
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    press = kvcert.PoissonPress(compression_ratio=0.5, seed=2, preset="uniform")
    _, cache = forced_logits(model, ids, [], press)
    for layer in cache.layers:
        lw = layer.log_weights[0]  # (h_kv, slots): log pi, -inf on padding
        for h in range(lw.shape[0]):
            tail = lw[h][(lw[h] < 0) & torch.isfinite(lw[h])]
            assert tail.numel() > 100 and float(tail.max() - tail.min()) < 1e-12
            kept = int(torch.isfinite(lw[h]).sum())
            assert kept in (150, 151)  # systematic: floor or ceil of the budget 300 (1 - 0.5), no padding
