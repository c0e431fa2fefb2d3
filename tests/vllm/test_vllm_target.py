"""Error-targeted budgets in the vLLM plugin: ``SamplingParams(extra_args={"kvcert_target_error": eps})``
(docs/serving.md, "Per-request options"; the rule: :meth:`kvcert.fast.TokenDesign.target_budget`).

No engine: :class:`kvcert.vllm.KVCertConfig` and :func:`kvcert.vllm.config.request_options` resolve a target
(it replaces the engine's ratio and sketch for the request; a ratio replaces an engine-wide target) and refuse
bad values by name.

One plugin engine (token design, the engine's default ratio 0.5 and its default design, the tilted sketch,
``report_kept=True``, greedy): prompt 6 (9 blocks + 1 token) asks for ``kvcert_target_error`` = 0.02, 1 and
10 in three runs, beside prompt 0 with the engine's settings in the first. What must hold: every targeted
request is compacted with the paper design (no sketch), its report is consistent (kept counts, kept
positions, the blocks holding them and the blocks freed), its certificates are finite; a smaller target keeps
every head's tokens at least as many as a larger one (same stream, nested samples), so at least as many
blocks; the huge target 10 keeps the certainty set and about one sampled token per head and frees 7 of the 9
full blocks, the strict 0.02 frees none (some head of some layer needs nearly every token, and the blocks
are shared by the layers and heads).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_support import BLOCK, prompts

SEED = 3
MAX_TOKENS = 4
PROMPT = 6  # 9 * 32 + 1 tokens
#: the targets of the three runs, increasing: the kept tokens must not increase along them. Measured on
#: prompt 6 (seed 3): eps = 0.02 / 0.1 / 0.3 / 1 / 3 / 10 free 0 / 0 / 0 / 2 / 5 / 7 blocks (the largest
#: (layer, KV head) kept count sets the blocks held: 289, 286, 257, 202, 111, 50 tokens)
TARGETS = (0.02, 1.0, 10.0)
#: the token design's certainty set (TokenDesign's defaults, as the engine's): sinks + window
CERTAIN = 4 + 32


def test_config_resolves_a_target():
    """No engine: the engine-wide field and its defaults."""
    from kvcert.vllm import KVCertConfig

    plain = KVCertConfig()
    assert (plain.compression_ratio, plain.target_error, plain.sketch, plain.kind) == (0.5, None, "tilted",
                                                                                       "tilted_hull")
    cfg = KVCertConfig(target_error=0.1)
    # a target: nothing by ratio, the paper's design (the target predicts its variance), chebyshev
    assert (cfg.compression_ratio, cfg.target_error, cfg.sketch, cfg.kind) == (0.0, 0.1, None, "chebyshev")
    assert cfg.design.target_error == 0.1 and cfg.design.sketch is None and cfg.enabled
    assert KVCertConfig.from_dict(cfg.to_dict()) == cfg
    assert KVCertConfig(compression_ratio=0.0, target_error=0.1) == cfg  # an explicit 0 is no ratio
    # sampled only above the certainty set plus one token (the head size does not matter: no sketch)
    assert not cfg.evicts(CERTAIN + 1, BLOCK, 64) and cfg.evicts(CERTAIN + 2, BLOCK, 64)
    assert cfg.evicts(CERTAIN + 2, BLOCK)


@pytest.mark.parametrize("options, match", [
    ({"target_error": 0}, "target_error"), ({"target_error": -0.5}, "target_error"),
    ({"target_error": math.nan}, "target_error"), ({"target_error": math.inf}, "target_error"),
    ({"target_error": "0.1"}, "target_error"), ({"target_error": True}, "target_error"),
    ({"target_error": 0.1, "compression_ratio": 0.5}, "compression_ratio.*target_error"),
    ({"target_error": 0.1, "granularity": "block"}, "target_error.*granularity='block'"),
    ({"target_error": 0.1, "sketch": "tilted"}, "sketch"),
    ({"target_error": 0.1, "kind": "chi2"}, "kind"),
])
def test_config_refuses_bad_targets(options, match):
    from kvcert.vllm import KVCertConfig

    with pytest.raises(ValueError, match=match):
        KVCertConfig(**options)


def test_request_target_replaces_the_engine_ratio():
    from dataclasses import replace

    from kvcert.vllm.config import REQUEST_KEYS, KVCertConfig, request_options

    assert REQUEST_KEYS["kvcert_target_error"] == "target_error"
    engine = KVCertConfig()  # ratio 0.5, the recommended (sketched) design
    over = request_options(engine, {"kvcert_target_error": 0.1, "kvcert_seed": SEED})
    assert over == {"compression_ratio": 0.0, "sketch": None, "kind": "chebyshev", "sampling": "poisson",
                    "target_error": 0.1, "seed": SEED}
    mine = replace(engine, **over)  # what the worker applies
    assert mine.design.target_error == 0.1 and mine.design.compression_ratio == 0.0 and mine.design.sketch is None
    assert request_options(engine, {"kvcert_target_error": 1, "kvcert_kind": "chebyshev"})["target_error"] == 1.0
    # a ratio per request replaces an engine-wide target (0: nothing evicted for the request)
    targeted = KVCertConfig(target_error=0.1)
    assert request_options(targeted, {"kvcert_compression_ratio": 0.25}) == {"target_error": None,
                                                                             "compression_ratio": 0.25}
    off = replace(targeted, **request_options(targeted, {"kvcert_compression_ratio": 0}))
    assert not off.enabled and not off.evicts(1000, BLOCK)
    # another target replaces the engine's
    assert replace(targeted, **request_options(targeted, {"kvcert_target_error": 0.5})).design.target_error == 0.5


@pytest.mark.parametrize("extra", [
    {"kvcert_target_error": 0}, {"kvcert_target_error": -0.1}, {"kvcert_target_error": math.nan},
    {"kvcert_target_error": "0.1"}, {"kvcert_target_error": None}, {"kvcert_target_error": [0.1]},
    {"kvcert_target_error": 0.1, "kvcert_compression_ratio": 0.5},
    {"kvcert_target_error": 0.1, "kvcert_sketch": "tilted"},
    {"kvcert_target_error": 0.1, "kvcert_kind": "chi2"},
])
def test_request_refuses_bad_targets_by_name(extra):
    from kvcert.vllm.config import KVCertConfig, request_options

    with pytest.raises(ValueError, match="kvcert_target_error"):
        request_options(KVCertConfig(), extra)


def test_request_target_on_a_block_engine_is_refused():
    from kvcert.vllm.config import KVCertConfig, request_options

    with pytest.raises(ValueError, match="kvcert_target_error.*granularity='block'"):
        request_options(KVCertConfig(granularity="block"), {"kvcert_target_error": 0.1})


# ----------------------------------------------------------------------------- the backend, without an engine


def _prefill(monkeypatch, eps):
    """The backend's prefill forward of test_vllm_compaction.py's 150-token prompt (one layer, 2 KV heads,
    observation window 8) under ``KVCertConfig(target_error=eps)``; returns what the design must reproduce."""
    from vllm.v1.attention.backends import cpu_attn

    from kvcert.vllm import KVCertConfig
    from backend_support import BS, Q, layer_forward, prefill_metadata, setup_backend

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    backend, worker, impl, cache, k, v, _, fake, layer, scale = setup_backend()
    cfg = fake.kvcert = KVCertConfig(target_error=eps, seed=5, observation_window=8)
    qp = torch.randn(Q, impl.num_heads, k.shape[-1])
    step = worker.Step(fake)
    layer_forward(backend, impl, step, layer, qp, cache, prefill_metadata(backend, impl))
    compacted = step.results(BS).compacted
    q = qp[-8:].permute(1, 0, 2)[None]
    keys, values = k[:Q].transpose(0, 1)[None], v[:Q].transpose(0, 1)[None]
    u = cfg.design.score(q, keys, values, scale=scale, layer=0)
    chosen = cfg.design.target_budget(q, keys, values, u, scale=scale)
    return cfg, compacted["a"], fake.kvcert_states["a"], chosen, u


def test_backend_samples_each_head_at_its_target_budget(monkeypatch):
    """A moderate target: the backend's compaction is TokenDesign.decide at target_budget's per-head budgets
    (same scores, same stream), exactly. Measured: eps = 5 chooses 85 and 88 of the 150 tokens."""
    from backend_support import BS, Q

    cfg, report, state, chosen, u = _prefill(monkeypatch, 5.0)
    assert bool(chosen.evicts.all()) and (chosen.predicted <= 5.0).all(), chosen
    assert chosen.budget[0, 0] != chosen.budget[0, 1]  # each head its own budget
    dec = cfg.design.decide(u[0], layer=0, event=0, budget=chosen.sampled[0])
    assert report["counts"] == [dec.kept.tolist()] and (dec.kept < Q).all()
    assert report["m"] == state.m == -(-int(dec.kept.max()) // BS) < Q // BS  # a full block freed
    lp = state.log_pi[0]  # (h_kv, m * bs): log pi of the kept tokens in position order, -inf on padding
    for h in range(dec.kept.shape[0]):
        c = int(dec.kept[h])
        torch.testing.assert_close(lp[h, :c].double(), dec.pi[h][dec.keep[h]].log(), rtol=1e-6, atol=0)
        assert torch.isneginf(lp[h, c:]).all()
    print(f"eps=5: budgets {chosen.budget[0].tolist()}, kept {dec.kept.tolist()}, predicted "
          f"{chosen.predicted[0].tolist()}")


def test_backend_keeps_every_token_where_no_head_evicts(monkeypatch):
    """A target no budget below n meets (1e-9): the layer keeps every token at pi = 1 and the request holds
    all its blocks (m = ceil(n / bs), so nothing is freed)."""
    from backend_support import BS, Q

    _, report, state, chosen, _ = _prefill(monkeypatch, 1e-9)
    assert not bool(chosen.evicts.any())
    assert report["counts"] == [[Q, Q]] and report["m"] == state.m == -(-Q // BS)
    assert (state.log_pi[0, :, :Q] == 0).all() and torch.isneginf(state.log_pi[0, :, Q:]).all()


# ---------------------------------------------------------------------------------------------------- engine


#: the module's engine (the ``engine`` fixture, tests/vllm/conftest.py): run 0 the prompt at the first target
#: beside prompt 0 at the engine's settings, then one run per further target
ENGINE_SPEC = dict(plugin=True, compression_ratio=0.5, seed=SEED, kvcert={"report_kept": True}, runs=[
    {"order": [PROMPT, 0], "max_tokens": MAX_TOKENS,
     "extra_args": [{"kvcert_target_error": TARGETS[0], "kvcert_seed": SEED}, None]},
    *({"order": [PROMPT], "max_tokens": MAX_TOKENS, "extra_args": [{"kvcert_target_error": eps, "kvcert_seed": SEED}]}
      for eps in TARGETS[1:])])


def _out(result, run, i):
    return result["runs"][run]["outputs"][str(i)]


def _check_report(out, n):
    """The report of one compacted request is consistent with itself; returns its kept counts (layers, h_kv)."""
    r = out["report"]
    assert r is not None and r["granularity"] == "token" and r["n_prompt_tokens"] == n
    counts = np.asarray(r["kept_counts"])
    assert counts.ndim == 2 and (counts >= CERTAIN).all() and (counts <= n).all()
    kept = r["kept_positions"]
    assert [[len(p) for p in layer] for layer in kept] == counts.tolist()
    for layer in kept:
        for p in layer:  # each head's kept positions: increasing, inside the prompt, sinks and window among them
            assert p == sorted(set(p)) and 0 <= p[0] and p[-1] < n
            assert set(range(4)) <= set(p) and set(range(n - 32, n)) <= set(p)
    assert r["evicted"] == int((n - counts).sum())
    assert r["m"] == -(-int(counts.max()) // BLOCK)  # blocks holding the largest head's kept tokens
    assert r["blocks_freed"] == max(0, n // BLOCK - r["m"])
    c = np.asarray(out["certificates"])
    assert c.shape == (MAX_TOKENS,) and np.isfinite(c).all() and c[0] == 0.0 and (c[1:] >= 0).all()
    return counts


@pytest.mark.slow
@pytest.mark.model
def test_targeted_requests_are_compacted_consistently(engine):
    n = len(prompts()[PROMPT])
    for run, eps in enumerate(TARGETS):
        out = _out(engine, run, PROMPT)
        assert len(out["token_ids"]) == MAX_TOKENS
        counts = _check_report(out, n)
        r = out["report"]
        assert r["sketch_bytes"] == 0  # the paper design: the target replaced the engine's sketched design
        print(f"eps={eps:g}: kept {int(counts.sum())} of {counts.size * n} tokens (per head {int(counts.min())}.."
              f"{int(counts.max())}), m={r['m']}, blocks freed {r['blocks_freed']}, certificates "
              f"{np.round(out['certificates'], 4).tolist()}")
    # a moderate target frees blocks (measured: 2 of 9 at eps = 1, see TARGETS)
    assert _out(engine, 1, PROMPT)["report"]["blocks_freed"] > 0
    # the certificates follow the target: the strict one's recorded radii are below the loose one's
    certs = [float(np.mean(_out(engine, run, PROMPT)["certificates"][1:])) for run in range(len(TARGETS))]
    assert certs == sorted(certs), certs
    # beside them, prompt 0 follows the engine's settings: the recommended design with its sketch, ratio 0.5
    plain = _out(engine, 0, 0)["report"]
    assert plain["sketch_bytes"] > 0 and plain["blocks_freed"] > 0
    print(f"engine start {engine['start_s']:.1f} s, runs {[round(x['gen_s'], 1) for x in engine['runs']]} s")


@pytest.mark.slow
@pytest.mark.model
def test_smaller_target_keeps_more(engine):
    """Per head the chosen budget does not increase with the target; the inclusion probabilities do not
    decrease with the budget and the same uniforms draw every run (seed, layer, head, event 0), so the
    samples are nested: every head keeps at least as many tokens under a smaller target."""
    n = len(prompts()[PROMPT])
    counts = [np.asarray(_out(engine, run, PROMPT)["report"]["kept_counts"]) for run in range(len(TARGETS))]
    ms = [_out(engine, run, PROMPT)["report"]["m"] for run in range(len(TARGETS))]
    freed = [_out(engine, run, PROMPT)["report"]["blocks_freed"] for run in range(len(TARGETS))]
    for a, b, ea, eb in zip(counts, counts[1:], TARGETS, TARGETS[1:]):
        assert (a >= b).all(), f"eps {ea:g} keeps fewer tokens than eps {eb:g} in {int((a < b).sum())} heads"
    assert ms == sorted(ms, reverse=True) and freed == sorted(freed)
    # negative control: the huge target is met at the smallest budget, sinks + window + 1, in every head:
    # the certainty set (36 tokens) plus a Poisson number with mean 1 of sampled ones, so 2 blocks hold it
    big = counts[-1]
    assert (big >= CERTAIN).all() and (big < 2 * BLOCK).all() and ms[-1] == 2
    assert freed[-1] == n // BLOCK - 2 > freed[0], (freed, ms)
    assert counts[0].sum() > big.sum()


class _FakeLLM:
    """Stands for a certified vllm.LLM in :func:`kvcert.vllm.generate_within_target`'s control flow: a
    request's per-token certificates are ``radius(extra_args)`` (0 for the first token), None when it ran
    uncompressed (kvcert_compression_ratio 0), as the plugin reports them."""

    def __init__(self, radius):
        self.radius, self.calls = radius, []

    def generate(self, prompts, params):
        self.calls.append([(p, dict(sp.extra_args)) for p, sp in zip(prompts, params)])
        outs = []
        for p, sp in zip(prompts, params):
            args = dict(sp.extra_args)
            rep = None if args.get("kvcert_compression_ratio") == 0.0 else \
                {"granularity": "token", "certificates": [0.0, *self.radius(p, args)]}
            outs.append(SimpleNamespace(prompt=p, kv_transfer_params=None if rep is None else {"kvcert": rep}))
        return outs


def test_generate_within_target_reruns_the_requests_over_it():
    """The closing loop's control flow (the engine's own runs are the other tests'): every request runs
    under the target; the ones with a token over it are re-run together, uncompressed ("full") or with the
    target halved ("tighten", then uncompressed after 3 halvings); the others are not re-run."""
    from vllm import SamplingParams

    from kvcert.vllm import generate_within_target

    params = SamplingParams(max_tokens=3, extra_args={"kvcert_compression_ratio": 0.5, "other": 1})
    llm = _FakeLLM(lambda p, a: [0.05, 0.2] if p == "hard" else [0.01, 0.02])
    outs, esc = generate_within_target(llm, ["easy", "hard"], params, target_error=0.1)
    assert llm.calls[0] == [("easy", {"other": 1, "kvcert_target_error": 0.1}),
                            ("hard", {"other": 1, "kvcert_target_error": 0.1})]
    assert llm.calls[1] == [("hard", {"other": 1, "kvcert_compression_ratio": 0.0})] and len(llm.calls) == 2
    assert esc == {1: [{"token": 2, "mean_relative_radius": 0.2, "target_error": 0.1,
                        "next": {"kvcert_compression_ratio": 0.0}}]}
    assert outs[0].kv_transfer_params is not None and outs[1].kv_transfer_params is None
    # tighten: the radius halves with the target, so eps/2 still misses (0.15 > 0.1) and eps/4 meets it
    llm = _FakeLLM(lambda p, a: [0.3 * a["kvcert_target_error"] / 0.1])
    outs, esc = generate_within_target(llm, ["x"], params, target_error=0.1, escalate="tighten")
    assert [e["next"] for e in esc[0]] == [{"kvcert_target_error": 0.05}, {"kvcert_target_error": 0.025}]
    assert len(llm.calls) == 3 and outs[0].kv_transfer_params["kvcert"]["certificates"] == [0.0, 0.075]
    # a request no target meets: 3 halvings, then uncompressed
    llm = _FakeLLM(lambda p, a: [1.0])
    outs, esc = generate_within_target(llm, ["x"], params, target_error=0.1, escalate="tighten")
    assert [e["next"] for e in esc[0]][-1] == {"kvcert_compression_ratio": 0.0} and len(esc[0]) == 4
    with pytest.raises(ValueError, match="escalate must be one of"):
        generate_within_target(llm, ["x"], params, target_error=0.1, escalate="never")
    with pytest.raises(ValueError, match="target_error must be a finite float > 0"):
        generate_within_target(llm, ["x"], params, target_error=0)
    with pytest.raises(ValueError, match="sampling_params: give one or one per prompt"):
        generate_within_target(llm, ["x", "y"], [params] * 3, target_error=0.1)
