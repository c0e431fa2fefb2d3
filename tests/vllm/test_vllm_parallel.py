"""Parallel engines with the plugin (docs/serving.md, "Parallel engines"): tensor and data parallelism.

**Tensor parallelism** (``tensor_parallel_size=2``, CPU, vLLM's multiprocessing executor: two worker
processes over gloo). A tiny random-weight Llama (``test_vllm_matrix``'s: 2 layers, 4 query heads over 2 KV
heads of dim 32, so each rank holds one KV head and its two query heads) is served by the plugin at TP=1 and
at TP=2, one driver process per TP size (this file run as a script), each starting two engines in sequence:
the token design (engine default 0, the prompts plain and then with ``kvcert_compression_ratio=0.5``, the
default design) and the block design (``granularity="block"``, 0.5). Each rank decides the tokens of its own
KV heads from the layer's streams of those heads (``TokenDesign.decide(head_offset=...)``), and the worker
joins the ranks' certificates, block scores and compaction reports every step
(``kvcert.vllm.worker._tp_combine``). What must hold:

- the greedy tokens are the TP=1 engine's, plain and certified (measured: identical; the row-parallel
  all-reduce changes float32 sums in the last bits, which did not move a token here);
- the token design keeps exactly the TP=1 tokens: the same kept counts per (layer, KV head), the same
  compacted blocks and freed blocks; the block design keeps the same blocks with the same pi_b;
- the certificates (mean relative radius over layers and *all* query heads) equal TP=1's within
  ``CERT_RTOL`` (a rank alone would report the mean over its own two heads: measured differences of
  that kind are O(1), see the negative control);
- plain requests carry no report.

**Data parallelism** (``--data-parallel-size 2`` on the OpenAI-compatible server, the default model). vLLM
runs two independent engine cores (a dense model has no lockstep), each with the plugin's scheduler and
worker, and balances requests between them. Six certified and two plain requests are sent at once from
eight client threads. Each certified response carries the record of the engine that served it, equal to the
in-process single engine's for the same prompt and options (tokens exact, certificates within
``CERT_RTOL``); plain responses carry none; ``/metrics`` counts the certified requests per engine, both
engines served some, and their sum is six.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_support import (CACHE, SERVED_NAME, TINY_ENGINE, TINY_PROMPT_BLOCKS, metric_samples, prompts, run_engine,
                          save_tiny_model, serve, server_args, tiny_prompts, vllm_env)
from vllm_support import TINY_MAX_NEW as MAX_NEW, TINY_RATIO as RATIO

pytestmark = pytest.mark.slow

#: relative tolerance between TP=1 and TP=2 certificates, and between a data-parallel engine's and the
#: single engine's: the same float32 arithmetic except the order of the row-parallel all-reduce's sums
#: (TP) or the batch a request shares (DP), a few eps32 = 1.2e-7 per layer (measured TP: 1e-7); the bound
#: of test_vllm_requests.py and test_vllm_server.py
CERT_RTOL = 1e-5

# ---------------------------------------------------------------------------------------------
# tensor parallelism: tiny Llama, TP = 1 and TP = 2
# ---------------------------------------------------------------------------------------------
#: test_vllm_matrix's model, prompts (vllm_support.tiny_prompts), ratio and engine arguments
ENGINE_KW = dict(TINY_ENGINE)


def _drive(tp: str, folder: str, out_path: str) -> None:
    """Driver process (``python test_vllm_parallel.py TP FOLDER OUT``): the token-design engine, then the
    block-design engine, at tensor_parallel_size=TP; writes {"token": ..., "block": ...} as JSON."""
    import gc

    from vllm import SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from kvcert.vllm import certificate_report, certified_llm

    prompts_ = [{"prompt_token_ids": p} for p in tiny_prompts()]
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    half = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                          extra_args={"kvcert_compression_ratio": RATIO})
    results = {}
    for name, ratio, granularity, runs in (("token", 0.0, "token", (("plain", plain), ("half", half))),
                                           ("block", RATIO, "block", (("half", plain),))):
        llm = certified_llm(folder, compression_ratio=ratio, granularity=granularity, tensor_parallel_size=int(tp),
                            **ENGINE_KW)
        res = {}
        for key, sp in runs:
            outs = llm.generate(prompts_, sp, use_tqdm=False)
            res[key] = [list(o.outputs[0].token_ids) for o in outs]
            res[key + "_reports"] = [certificate_report(o) for o in outs]
        results[name] = res
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        print(f"tp={tp} {name}: ok", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def tp_engines() -> dict:
    """{1: ..., 2: ...}: the two driver processes, one after the other (in-process engine cores)."""
    CACHE.mkdir(exist_ok=True)
    out = {}
    with tempfile.TemporaryDirectory(dir=str(CACHE)) as tmp:
        folder = Path(tmp) / "llama"
        save_tiny_model("llama", folder)
        for tp in (1, 2):
            env = vllm_env(in_process=True)
            op = Path(tmp) / f"tp{tp}.json"
            t0 = time.monotonic()
            # outside the repository root: no top-level folder of the repository shadows an installed package
            proc = subprocess.run([sys.executable, __file__, str(tp), str(folder), str(op)], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0 and op.exists(), (proc.stdout + proc.stderr)[-4000:]
            print(f"tp={tp}: {time.monotonic() - t0:.0f} s")
            out[tp] = json.loads(op.read_text())
    return out


def _certs(reports) -> np.ndarray:
    return np.array([r["certificates"] for r in reports], dtype=np.float64)


def test_tensor_parallel_token_design_keeps_the_single_process_tokens(tp_engines):
    one, two = tp_engines[1]["token"], tp_engines[2]["token"]
    assert two["plain"] == one["plain"] and two["plain_reports"] == one["plain_reports"] == [None] * 4
    assert two["half"] == one["half"]
    assert one["half"] != one["plain"]  # the eviction moves tokens: the comparison is not of the stock engine
    for k, r1, r2 in zip(TINY_PROMPT_BLOCKS, one["half_reports"], two["half_reports"]):
        assert r1["granularity"] == r2["granularity"] == "token" and r1["evicted"] > 0
        # every head of every layer, in the single process's order (rank 0's head, then rank 1's)
        assert np.array(r2["kept_counts"]).shape == (2, 2)
        for key in ("kept_counts", "m", "n_prompt_tokens", "evicted", "blocks_freed", "sketch_bytes"):
            assert r2[key] == r1[key], (k, key, r1[key], r2[key])
        assert r2["blocks_freed"] == k - r2["m"] > 0
    c1, c2 = _certs(one["half_reports"]), _certs(two["half_reports"])
    print(f"TP=2 / TP=1 certificates: worst relative difference {np.abs(c2[:, 1:] / c1[:, 1:] - 1).max():.2e}")
    assert np.isfinite(c2).all() and (c2[:, 0] == 0).all() and (c2[:, 1:] > 0).all()
    np.testing.assert_allclose(c2, c1, rtol=CERT_RTOL, atol=0)


def test_tensor_parallel_block_design_keeps_the_single_process_blocks(tp_engines):
    one, two = tp_engines[1]["block"], tp_engines[2]["block"]
    assert two["half"] == one["half"]
    for r1, r2 in zip(one["half_reports"], two["half_reports"]):
        assert "granularity" not in r1 and len(r1["kept"]) == len(r1["pi"]) > 0  # the block design's record
        assert r2["kept"] == r1["kept"] and r2["evicted"] == r1["evicted"] and r2["blocks_freed"] == r1["blocks_freed"]
        # the block importance is computed from every head's scores (joined across the ranks)
        np.testing.assert_allclose(r2["importance"], r1["importance"], rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(r2["pi"], r1["pi"], rtol=1e-5, atol=1e-9)
    assert sum(r["blocks_freed"] for r in two["half_reports"]) > 0
    np.testing.assert_allclose(_certs(two["half_reports"]), _certs(one["half_reports"]), rtol=CERT_RTOL, atol=0)


def test_tp_combine_joins_the_ranks_results(monkeypatch):
    """``_tp_combine`` on two ranks' results (the gather stubbed: no process group): certificates averaged
    over the ranks (each a mean over its own query heads), block scores and kept counts joined along the KV
    heads in rank order, m the larger, sketch bytes summed; different request sets are refused. Negative
    control: rank 0's certificate alone is not the combined one."""
    import torch
    import torch.distributed as dist

    from kvcert.vllm import worker

    rank0 = ({"a": 1.0}, {"b": torch.ones(2, 1, 5)},
             {"c": {"m": 2, "n_prompt": 97, "counts": [[40], [41]], "sketch_bytes": 10}})
    rank1 = ({"a": 3.0}, {"b": torch.zeros(2, 1, 5)},
             {"c": {"m": 3, "n_prompt": 97, "counts": [[70], [20]], "sketch_bytes": 12}})

    def gather(parts, obj, group=None):
        parts[:] = [rank0, rank1]

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", gather)
    certs, scores, compacted = worker._tp_combine(None, *rank0)
    assert certs == {"a": 2.0} and certs["a"] != rank0[0]["a"]
    assert torch.equal(scores["b"], torch.cat([torch.ones(2, 1, 5), torch.zeros(2, 1, 5)], dim=1))
    assert compacted == {"c": {"m": 3, "n_prompt": 97, "counts": [[40, 70], [41, 20]], "sketch_bytes": 22}}
    rank1 = ({"x": 3.0}, rank1[1], rank1[2])
    with pytest.raises(RuntimeError, match="different requests"):
        worker._tp_combine(None, *rank0)


# ---------------------------------------------------------------------------------------------
# data parallelism: the OpenAI-compatible server with two engine cores
# ---------------------------------------------------------------------------------------------
DP_MAX_TOKENS = 4
DP_SEED = 3
DP_CERT = {"kvcert_compression_ratio": 0.5, "kvcert_seed": DP_SEED}
#: prompts 0-7 of vllm_support.prompts(): 6 certified, 2 plain
DP_PLAIN = (3, 7)
MODEL = SERVED_NAME
DP_ARGS = server_args(extra=("--data-parallel-size", "2"))


@pytest.fixture(scope="module")
def dp_reference() -> dict:
    """The certified prompts in one in-process engine, one request at a time (each alone in its batch)."""
    order = [i for i in range(8) if i not in DP_PLAIN]
    out = run_engine(plugin=True, compression_ratio=0.0,
                     runs=[{"order": [i], "max_tokens": DP_MAX_TOKENS, "extra_args": [DP_CERT]} for i in order])
    return {i: run["outputs"][str(i)] for i, run in zip(order, out["runs"])}


@pytest.fixture(scope="module")
def dp_session(dp_reference) -> dict:
    """Eight requests at once against the data-parallel server; the responses and /metrics."""
    openai = pytest.importorskip("openai")
    with serve(DP_ARGS) as srv:
        client = openai.OpenAI(base_url=srv["url"] + "/v1", api_key="none", max_retries=0, timeout=300)

        def one(i):
            extra = {"ignore_eos": True, "return_token_ids": True}
            if i not in DP_PLAIN:
                extra["vllm_xargs"] = DP_CERT
            r = client.completions.create(model=MODEL, prompt=list(prompts()[i]), max_tokens=DP_MAX_TOKENS,
                                          temperature=0.0, extra_body=extra)
            params = (r.model_extra or {}).get("kv_transfer_params") or {}
            return i, {"token_ids": r.choices[0].model_extra.get("token_ids"), "kvcert": params.get("kvcert")}

        with cf.ThreadPoolExecutor(8) as ex:
            responses = dict(ex.map(one, range(8)))
        deadline, metrics = time.monotonic() + 60, {}
        while time.monotonic() < deadline:  # the stat loggers see the last step a moment after it
            metrics = _certified_per_engine(srv["url"])
            if sum(metrics.values()) >= 6:
                break
            time.sleep(1)
    return {"responses": responses, "metrics": metrics}


def _certified_per_engine(url: str) -> dict:
    out = {}
    for s in metric_samples(url):
        if s.name == "kvcert_requests_certified_total" and s.labels.get("model_name") == MODEL:
            out[s.labels["engine"]] = out.get(s.labels["engine"], 0) + s.value
    return out


@pytest.mark.model
def test_data_parallel_engines_certify_their_own_requests(dp_session, dp_reference):
    responses = dp_session["responses"]
    for i in DP_PLAIN:
        assert responses[i]["kvcert"] is None, i
    for i, ref in dp_reference.items():
        rec = responses[i]["kvcert"]
        assert rec is not None and rec["granularity"] == "token" and rec["blocks_freed"] > 0, (i, rec)
        assert responses[i]["token_ids"] == ref["token_ids"], i
        for key in ("kept_counts", "m", "n_prompt_tokens", "evicted", "blocks_freed"):
            assert rec[key] == ref["report"][key], (i, key)
        np.testing.assert_allclose(rec["certificates"], ref["certificates"], rtol=CERT_RTOL, atol=0)


@pytest.mark.model
def test_data_parallel_metrics_count_each_engine(dp_session):
    per = dp_session["metrics"]
    print("certified requests per engine:", per)
    assert sorted(per) == ["0", "1"] and sum(per.values()) == 6
    assert min(per.values()) > 0  # both engine cores served certified requests


if __name__ == "__main__":
    _drive(*sys.argv[1:4])
