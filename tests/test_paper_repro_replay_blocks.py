"""T2d's served systematic design (paper_repro.replay_blocks, ``servedsysB``) on a few layers of the real model:
a fixed kept count per head, exactly m blocks of memory, and the token design's estimate read from the
compacted slots."""

import numpy as np
import pytest
import torch
from model_fixtures import smollm2  # noqa: F401

import kvcert.fast
from paper_repro import replay_blocks as RB
from paper_repro.common import Config
from paper_repro.realmodel import Captured, capture, haystack_ids
from paper_repro.replay import layer_importance
from paper_repro.synthetic_coverage import draw_estimates

pytestmark = pytest.mark.model

L, FUT = 256, 32


@pytest.fixture(scope="module")
def cap(smollm2):  # noqa: F811
    model, tokenizer = smollm2
    full = capture(model, haystack_ids(tokenizer, L + FUT, seed=0))
    return Captured(full.queries[:2], full.keys[:2], full.values[:2], full.scaling)  # 2 layers: fast


@pytest.fixture(scope="module")
def importance(cap):
    T = L + FUT
    return torch.stack([torch.from_numpy(layer_importance("snapkv", cap.queries[layer][:, :T], cap.keys[layer][:, :T],
                                                           cap.values[layer][:, :T], L, cap.scaling, seed=layer))
                        for layer in range(cap.layers)])


def test_systematic_blocks():
    assert RB.systematic_blocks(1792, 0.1, 16) == 11 and RB.systematic_blocks(1792, 0.1, 64) == 3
    assert RB.systematic_blocks(256, 0.5, 64) == 2
    with pytest.raises(ValueError, match="cannot hold the sink and recent blocks"):
        RB.systematic_blocks(256, 0.25, 64)     # 1 block; the 36 sinks + window need 1, sampling one more
    with pytest.raises(ValueError, match="cannot hold"):
        RB.systematic_blocks(256, 0.1, 16)      # round(1.6) = 2 blocks < 3 + 1


@pytest.mark.parametrize("bs, fraction", [(16, 0.25), (64, 0.5), (32, 0.375)])
def test_systematic_draws_keep_exactly_B(cap, importance, bs, fraction):
    """Every draw: every (layer, KV head) keeps exactly B = m * bs tokens, the compacted layout is m full
    blocks (no padding slot), and its memory is m blocks plus the log pi buffer; Poisson draws of the same
    pi (negative control) do not."""
    d, dv = cap.keys[0].shape[-1], cap.values[0].shape[-1]
    m = RB.systematic_blocks(L, fraction, bs)
    B = m * bs
    pi = RB.token_pi(importance, B / L)
    assert float((pi.sum(-1) - B).abs().max()) < 1e-9
    draws = 32
    pos, lp, memory = RB._served_draws(pi, draws, bs, np.random.default_rng(3), d, dv, sampling="systematic")
    assert pos.shape == (draws, cap.layers, pi.shape[1], B)          # m blocks of slots, every draw
    assert bool((pos >= 0).all()) and bool(torch.isfinite(lp).all())  # no padding slot anywhere
    counts = (pos >= 0).sum(-1)
    assert bool((counts == B).all())
    # each head's slots are its own kept tokens, in position order, with their log pi
    assert bool((pos[..., 1:] > pos[..., :-1]).all())
    want = torch.log(pi).float().expand(draws, *pi.shape).gather(-1, pos.long())
    torch.testing.assert_close(lp, want)
    # memory: m blocks (L is a multiple of bs: no partly filled prompt block) + the log pi buffer
    exact = (m * bs * (d + dv) + m * bs) / (L * (d + dv))
    assert np.all(memory == pytest.approx(exact, rel=1e-12))
    # negative control: the served Poisson draws of the same pi vary their counts and pad
    pos_p, _, mem_p = RB._served_draws(pi, draws, bs, np.random.default_rng(3), d, dv)
    counts_p = (pos_p >= 0).sum(-1)
    assert bool((counts_p != B).any()) and mem_p.max() > exact


def test_systematic_served_estimate_is_the_token_estimate(cap, importance):
    """The served estimate over the compacted systematic sample is the token design's estimate (Table 2's
    draw_estimates) on the same keep mask, as test_paper_repro_model checks for the Poisson draws."""
    bs, fraction = 16, 0.25
    d, dv = cap.keys[0].shape[-1], cap.values[0].shape[-1]
    B = RB.systematic_blocks(L, fraction, bs) * bs
    pi = RB.token_pi(importance, B / L)
    draws = 16
    pos, lp, _ = RB._served_draws(pi, draws, bs, np.random.default_rng(5), d, dv, sampling="systematic")
    keep = torch.zeros(draws, *pi.shape, dtype=torch.bool).scatter_(-1, pos.long(), True)
    T = L + FUT
    qpos = torch.tensor([L, L + 10, L + 20, L + 31])
    g = cap.group
    eps = torch.finfo(torch.float32).eps
    for layer, h in ((0, 0), (1, 2)):
        q = cap.queries[layer][h * g:(h + 1) * g, :T][:, qpos]
        k, v = cap.keys[layer][h, :T], cap.values[layer][h, :T]
        served = RB.served_estimates(q, k, v, pos[:, layer, h], lp[:, layer, h], L, qpos, cap.scaling, (RB.KIND,))
        kp, p = keep[:, layer, h], pi[layer, h].float()
        token = draw_estimates(q, k, v, torch.cat([torch.where(kp, p, 0.0), torch.ones(draws, FUT)], 1), qpos,
                               cap.scaling, (RB.KIND,))
        # the same terms summed in another order (test_paper_repro_model's tolerances)
        gap = (served.output - token.output).abs().max()
        assert gap <= 8 * eps * token.output.abs().max(), gap
        scale = 4 * v.norm(dim=-1).max() ** 2 / token.n_eff
        assert ((served.trace - token.trace).abs() / (eps * scale)).max() <= 2
        # negative control: without the -log pi offset the slots give another estimate
        plain = RB.served_estimates(q, k, v, pos[:, layer, h], torch.zeros_like(lp[:, layer, h]), L, qpos,
                                    cap.scaling, (RB.KIND,))
        assert (plain.output - token.output).abs().max() > 100 * gap


def test_servedsys_rows(cap):
    """run(): servedsys rows at kept fraction m B / L with their exact memory, the equal-memory token run
    (one per distinct memory), and a row naming why servedsys64 cannot run at 0.25."""
    cfg = Config(quick=True, context=L, budgets=(0.25, 0.5), progress=False)
    names = ("token", "servedsys16", "servedsys64")
    t2d = RB.run(cfg, cap, designs=names, draws=8)
    rows = {(r["budget"], r["design"], r.get("delta")): r for r in t2d.rows}
    d = cap.keys[0].shape[-1]
    assert rows[0.25, "servedsys64", None]["cells"] == 0 and "cannot hold" in rows[0.25, "servedsys64", None]["note"]
    assert (0.25, "token_at_servedsys64", 0.05) not in rows
    for budget, bs in ((0.25, 16), (0.5, 16), (0.5, 64)):
        row = rows[budget, f"servedsys{bs}", 0.05]
        twin = rows[budget, f"token_at_servedsys{bs}", 0.05]
        token = rows[budget, "token", 0.05]
        assert row["cells"] == twin["cells"] == 2 * cap.queries[0].shape[0] * 4
        assert row["expected_kept"] == budget                       # round(M L / bs) blocks = M L here
        mem = budget * (1 + 1 / (2 * d))                             # m blocks + the log pi buffer
        assert row["memory"] == pytest.approx(mem, rel=1e-12)
        assert row["memory_max"] == pytest.approx(mem, rel=1e-12)
        assert row["memory_expected"] == pytest.approx(mem, rel=1e-12)
        assert twin["expected_kept"] == twin["memory"] == row["equal_memory"] == pytest.approx(mem, rel=1e-12)
        assert row["equal_memory_ratio"] == pytest.approx(row["mean_relative_error"] / twin["mean_relative_error"])
        assert row["error_ratio"] == pytest.approx(row["mean_relative_error"] / token["mean_relative_error"])
        assert 0.0 <= row["silent"] <= 1.0 - row["coverage"] + 1e-12
    # blocks of 16 and 64 hold the same 128 tokens at 0.5: one token run serves both
    assert rows[0.5, "token_at_servedsys16", 0.05] == {**rows[0.5, "token_at_servedsys64", 0.05],
                                                       "design": "token_at_servedsys16", "block_size": 16}
