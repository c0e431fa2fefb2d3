"""Per-request opt-in: one engine serves certified and plain requests side by side (docs/serving.md,
"Per-request options").

Two plugin engines (token design, ``report_kept=True``, greedy, prompts of 32 k + 1 tokens):

- ``mixed``: engine default compression_ratio=0 (evicts nothing unless a request asks), run as a user's
  ``vllm.LLM`` runs by default (``run_engine(engine_process=True)``: the engine core in a process of its own,
  so the per-request options and the records cross the serialization between the processes; the suite's
  other engines run their core in-process, vllm_support.py). Run 0: every
  request plain. Run 1: prompts 0 and 6 ask for ``kvcert_compression_ratio=0.5, kvcert_seed=3``, prompts
  1 and 2 are plain. Run 2: two bad requests (``kvcert_compression_ratio=1.5``, ``kvcert_kind="wald"``),
  a plain one, prompt 0 certified with ``kvcert_sketch="tilted", kvcert_kind="chebyshev", kvcert_delta=0.1``
  (the default's sample, another radius) and prompt 6 with the defaults (``tilted_hull``, 0.05), so one step
  certifies rows of two (kind, delta) groups.
- ``default``: engine default 0.5 with seed 3 (test_vllm_token.py's design); prompts 0 and 6 plain (the
  engine's default), prompt 1 with ``kvcert_compression_ratio=0`` (opted out); then a batch of one bad
  request alone (the engine must still report it and return); then prompts 0 and 6 with
  ``kvcert_sampling="poisson"`` (the engine's default design, the recommended one, draws systematically:
  a fixed kept count per (layer, KV head); these requests draw Poisson) beside prompt 3 with a bad
  ``kvcert_sampling``.

What must agree: a plain request's tokens equal those of the all-plain run (which test_vllm_engine.py
checks against the stock engine) exactly; a certified request's kept positions, kept counts, freed blocks
and tokens equal those of the engine whose default is the same design exactly (both draw
``TokenDesign.decide`` with the same stream on the same float32 prompt forward), and its certificates
within :data:`CERT_RTOL`.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_support import prompts, run_engine

pytestmark = [pytest.mark.slow, pytest.mark.model]

SEED = 3
RATIO = 0.5
MAX_TOKENS = 6
CERT = {"kvcert_compression_ratio": RATIO, "kvcert_seed": SEED}
POISSON = {"kvcert_sampling": "poisson"}
#: relative tolerance between the certificates of the same request in two engines: the same float32
#: arithmetic on the request's own rows; only the other rows of the batch differ, which may change the
#: blocking of the linear layers' matrix products (a few eps32 = 1.2e-7 per layer, 30 layers: ~1e-5 at most)
CERT_RTOL = 1e-5


@pytest.fixture(scope="module")
def mixed():
    return run_engine(plugin=True, compression_ratio=0.0, kvcert={"report_kept": True}, engine_process=True, runs=[
        {"order": [0, 1, 2, 6], "max_tokens": MAX_TOKENS},
        {"order": [0, 1, 2, 6], "max_tokens": MAX_TOKENS, "extra_args": [CERT, None, None, CERT]},
        {"order": [1, 3, 4, 0, 6], "max_tokens": MAX_TOKENS,
         "extra_args": [{"kvcert_compression_ratio": 1.5}, None, {**CERT, "kvcert_kind": "wald"},
                        {**CERT, "kvcert_sketch": "tilted", "kvcert_kind": "chebyshev", "kvcert_delta": 0.1}, CERT]},
    ])


@pytest.fixture(scope="module")
def default():
    return run_engine(plugin=True, compression_ratio=RATIO, seed=SEED, kvcert={"report_kept": True}, runs=[
        {"order": [0, 6, 1], "max_tokens": MAX_TOKENS, "extra_args": [None, None, {"kvcert_compression_ratio": 0}]},
        {"order": [2], "max_tokens": MAX_TOKENS, "extra_args": [{"kvcert_seed": -1}]},
        {"order": [0, 6, 3], "max_tokens": MAX_TOKENS,
         "extra_args": [POISSON, POISSON, {"kvcert_sampling": "bernoulli"}]},
    ])


def _out(result, run, i):
    return result["runs"][run]["outputs"][str(i)]


def test_request_options_name_the_key():
    """No engine: the resolution the scheduler applies to every request's extra_args."""
    from kvcert.vllm.config import KVCertConfig, request_options

    engine = KVCertConfig(compression_ratio=0.0)
    assert (engine.sketch, engine.kind) == ("tilted", "tilted_hull")  # the default: the recommended design
    assert request_options(engine, None) is None
    assert request_options(engine, {"other": 1}) is None
    # a plain kind alone certifies the paper's design (no sketch), as PoissonPress(kind="chi2")
    assert request_options(engine, {**CERT, "kvcert_kind": "chi2"}) == {"compression_ratio": 0.5, "seed": 3,
                                                                        "sketch": None, "kind": "chi2",
                                                                        "sampling": "poisson"}
    for bad, key in (({"kvcert_compression_ratio": 1.5}, "kvcert_compression_ratio"),
                     ({"kvcert_kind": "wald"}, "kvcert_kind"), ({"kvcert_seed": -1}, "kvcert_seed"),
                     ({"kvcert_delta": 0.0}, "kvcert_delta"), ({"kvcert_seed": 1.5}, "kvcert_seed"),
                     ({"kvcert_ratio": 0.5}, "kvcert_ratio"), ({"kvcert_sampling": "bernoulli"}, "kvcert_sampling")):
        with pytest.raises(ValueError, match=key):
            request_options(engine, bad)
    assert engine.sampling == "systematic"  # the recommended design's default (kvcert.fast.default_sampling)
    assert request_options(engine, POISSON) == {"sampling": "poisson"}
    # a design named per request draws its own default: the paper's design draws Poisson
    assert request_options(engine, {"kvcert_kind": "chi2"})["sampling"] == "poisson"
    assert request_options(engine, {"kvcert_kind": "chebyshev", "kvcert_sketch": "tilted"})["sampling"] == \
        "systematic"  # the tilted sketch with another radius: the default's sample
    with pytest.raises(ValueError, match="kvcert_seed.*granularity='block'"):
        request_options(KVCertConfig(granularity="block"), {"kvcert_seed": 1})
    # the recommended design per request: the sketch is applied before the kind its radius needs
    # (and its sampling: a request that names a design draws that design's default, systematic here)
    assert request_options(engine, {"kvcert_kind": "tilted_hull", "kvcert_sketch": "tilted"}) == {
        "sketch": "tilted", "kind": "tilted_hull", "sampling": "systematic"}
    assert request_options(engine, {"kvcert_kind": "tilted_hull"}) == {"sketch": "tilted", "kind": "tilted_hull",
                                                                       "sampling": "systematic"}
    paper = KVCertConfig(compression_ratio=0.0, sketch=None)
    with pytest.raises(ValueError, match="kvcert_kind='tilted_hull'"):  # the paper design with the sketch's kind
        request_options(paper, {"kvcert_kind": "tilted_hull", "kvcert_sketch": None})
    with pytest.raises(ValueError, match="kvcert_sketch='page'"):
        request_options(engine, {"kvcert_sketch": "page"})
    sketched = KVCertConfig(compression_ratio=0.5, sketch="tilted", kind="tilted_hull")
    with pytest.raises(ValueError, match="kvcert_sketch=None"):  # the engine's kind needs its sketch
        request_options(sketched, {"kvcert_sketch": None})
    assert request_options(sketched, {"kvcert_sketch": None, "kvcert_kind": "chebyshev"}) is not None


def test_plain_requests_beside_certified_ones_are_unchanged(mixed):
    for i in (1, 2):
        plain, beside = _out(mixed, 0, i), _out(mixed, 1, i)
        assert len(plain["token_ids"]) == MAX_TOKENS
        assert beside["token_ids"] == plain["token_ids"], f"prompt {i}"
        assert beside["report"] is None and beside["certificates"] is None
    assert _out(mixed, 2, 3)["report"] is None
    for i in (0, 6):
        assert _out(mixed, 0, i)["report"] is None


def test_certified_requests_equal_the_engine_default_design(mixed, default):
    worst = 0.0
    for i in (0, 6):
        a, b = _out(mixed, 1, i), _out(default, 0, i)
        ra, rb = a["report"], b["report"]
        assert ra is not None and ra["granularity"] == "token" and ra["evicted"] > 0, f"prompt {i} not sampled"
        assert ra["kept_positions"] == rb["kept_positions"], f"prompt {i}: kept positions differ"
        for key in ("kept_counts", "m", "n_prompt_tokens", "evicted", "blocks_freed"):
            assert ra[key] == rb[key], f"prompt {i}: {key}"
        assert ra["blocks_freed"] == len(prompts()[i]) // 32 - ra["m"] > 0
        assert a["token_ids"] == b["token_ids"], f"prompt {i}"
        ca, cb = np.asarray(a["certificates"]), np.asarray(b["certificates"])
        assert ca.shape == (MAX_TOKENS,) and ca[0] == 0.0 and (ca[1:] > 0).all()
        worst = max(worst, float(np.abs(ca[1:] / cb[1:] - 1).max()))
        np.testing.assert_allclose(ca, cb, rtol=CERT_RTOL, atol=0)
    print(f"worst relative certificate difference between the engines: {worst:.2e} (tolerance {CERT_RTOL:g})")


def test_opt_out_on_an_evicting_engine(mixed, default):
    out = _out(default, 0, 1)
    assert out["report"] is None and out["certificates"] is None
    assert out["token_ids"] == _out(mixed, 0, 1)["token_ids"]


def test_a_batch_of_only_a_bad_request_returns(default):
    out = _out(default, 1, 2)
    assert out["token_ids"] == [] and out["finish_reason"] == "abort"
    assert "kvcert_seed" in out["report"]["error"]
    print(f"engine default: start {default['start_s']:.1f} s, runs {[round(x['gen_s'], 1) for x in default['runs']]} s")


def test_bad_values_fail_only_their_request(mixed):
    run = 2
    for i, key in ((1, "kvcert_compression_ratio"), (4, "kvcert_kind")):
        out = _out(mixed, run, i)
        assert out["token_ids"] == [] and out["finish_reason"] == "abort", f"prompt {i}: {out}"
        assert set(out["report"]) == {"error"} and key in out["report"]["error"], out["report"]
        assert out["certificates"] is None
        print(f"prompt {i}: {out['report']['error']}")
    assert mixed["stats"]["requests_refused"] == 2
    print(f"engine mixed: start {mixed['start_s']:.1f} s, runs {[round(x['gen_s'], 1) for x in mixed['runs']]} s")
    for i in (3, 0, 6):  # the other requests of the batch complete
        assert len(_out(mixed, run, i)["token_ids"]) == MAX_TOKENS, f"prompt {i}"
    # prompt 6 (defaults) is the same request as in run 1; prompt 0 keeps the same tokens in its prompt
    # (the same tilted sketch: the kind changes the certificate, not the sample) and is certified with
    # Chebyshev on V_cl at delta 0.1
    a, b = _out(mixed, run, 6), _out(mixed, 1, 6)
    assert a["token_ids"] == b["token_ids"]
    np.testing.assert_allclose(a["certificates"], b["certificates"], rtol=CERT_RTOL, atol=0)
    c, d = _out(mixed, run, 0), _out(mixed, 1, 0)
    assert c["report"]["kept_positions"] == d["report"]["kept_positions"]
    cc, cd = np.asarray(c["certificates"]), np.asarray(d["certificates"])
    assert cc.shape == (MAX_TOKENS,) and cc[0] == 0.0 and (cc[1:] > 0).all() and np.isfinite(cc).all()
    print(f"prompt 0: tilted_hull(0.05) {cd.tolist()}\n{'':10}chebyshev(0.1)   {cc.tolist()}")
    assert not np.allclose(cc[1:], cd[1:], rtol=1e-3), "the request's kind/delta did not reach its certificate"


def test_sampling_per_request(default):
    """The engine's default design (the recommended one) draws systematically: its kept counts (run 0) are
    floor(B) or ceil(B) in every (layer, KV head), B the sampled budget (the same for every head), and it
    frees the full prompt blocks past ceil(max count / 32). ``kvcert_sampling="poisson"`` on the same prompts
    (run 2): that request's counts vary by more than one (the negative control that the key reached the
    draw), and it frees no more blocks than the engine's draw. A bad value fails only its request, naming the
    key."""
    import math

    from kvcert.vllm.config import KVCertConfig

    design = KVCertConfig(compression_ratio=RATIO, seed=SEED).design
    assert design.sampling == "systematic"
    run = 2
    for i in (0, 6):
        out, own = _out(default, run, i), _out(default, 0, i)
        rep, orep = out["report"], own["report"]
        assert rep is not None and rep["granularity"] == "token" and rep["evicted"] > 0, f"prompt {i}: {rep}"
        n = len(prompts()[i])
        b = design.sampled_budget(n, 64, 64)  # head size 64
        counts = [c for layer in orep["kept_counts"] for c in layer]
        pcounts = [c for layer in rep["kept_counts"] for c in layer]
        assert set(counts) <= {math.floor(b - 1e-9), math.ceil(b + 1e-9)}, f"prompt {i}: B {b}, {sorted(set(counts))}"
        assert max(pcounts) - min(pcounts) > 1, f"prompt {i}: the request's Poisson draw"
        assert orep["m"] == math.ceil(max(counts) / 32) and orep["blocks_freed"] == n // 32 - orep["m"] > 0
        assert orep["blocks_freed"] >= rep["blocks_freed"]
        assert len(out["token_ids"]) == MAX_TOKENS
        c = np.asarray(out["certificates"])
        assert c.shape == (MAX_TOKENS,) and c[0] == 0.0 and (c[1:] > 0).all() and np.isfinite(c).all()
        print(f"prompt {i}: B {b:.2f}, engine (systematic) counts {min(counts)}..{max(counts)} freed "
              f"{orep['blocks_freed']}; request (Poisson) {min(pcounts)}..{max(pcounts)} freed {rep['blocks_freed']}")
    bad = _out(default, run, 3)
    assert bad["token_ids"] == [] and bad["finish_reason"] == "abort", bad
    assert set(bad["report"]) == {"error"} and "kvcert_sampling" in bad["report"]["error"], bad["report"]
    print(f"prompt 3: {bad['report']['error']}")
