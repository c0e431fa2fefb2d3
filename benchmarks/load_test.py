"""Load test: the OpenAI-compatible server with the plugin against the stock server, under the same load.

    .venv-vllm/bin/python benchmarks/load_test.py [--requests 64] [--clients 6] [--out benchmarks/results/load_test.json]
    .venv-vllm/bin/python benchmarks/load_test.py --preset memory      # the memory-bound load (below)

Servers, one after the other, on 127.0.0.1 only (``python -m vllm.entrypoints.openai.api_server``,
started and stopped by ``tests/vllm/vllm_support.serve``): **stock** (no plugin loaded, ``VLLM_PLUGINS=""``),
**kvcert** (the plugin's scheduler and worker, engine default ``compression_ratio=0``: a request is
certified only when it asks, ``vllm_xargs={"kvcert_compression_ratio": r}``) and, when ``--servers`` names it,
**kvcert_mixed** (the plugin again, the same prompts with ``--mixed-fraction`` of them certified). All get the
same engine arguments (``server_args``: ``--dtype`` and ``--enforce-eager`` as given, no prefix caching and no
async scheduling unless ``--engine-defaults`` keeps the engine's own), among them a fixed pool of
``--pool-blocks`` KV blocks (or ``--pool-requests`` N: N times the blocks of the longest request) small enough
that running requests outgrow it and vLLM preempts (recomputes) some, and the same load:

- a schedule of ``--requests`` requests fixed by ``--seed``: prompt lengths drawn uniformly from
  ``--min-prompt`` .. ``--max-prompt`` tokens (token ids from CPython's pydoc topics), each request
  certified with probability ``--certified-fraction`` (the stock server receives the same ``vllm_xargs``,
  which it ignores), ``--max-tokens`` greedy tokens with ``ignore_eos``, streamed; with
  ``--shared-prefix-tokens`` S, ``--shared-prefix-fraction`` of the prompts open with the same S-token system
  prompt (their lengths unchanged);
- ``--warmup-requests`` requests first, one at a time and not counted (certified on the plugin's servers: the
  first certified request of a fresh install may build the compiled op); the ``/metrics`` counters reported
  are the load's (read after the warm-up and subtracted);
- ``--clients`` concurrent clients (threads with the ``openai`` package), each sending its next request from
  the shared schedule as soon as its previous one finished (a closed loop), until the schedule is done or
  ``--time-limit`` seconds have passed (then no new request is sent; the run is marked incomplete).

Per server: wall time from the first request sent to the last finished, throughput (requests/s and output
tokens/s over that wall time), end-to-end latency and time to first token (first streamed text) percentiles
(p50/p90/p99, all requests and certified/plain apart), failed requests (an exception, or fewer tokens than
asked), and from the plugin's servers: certificates lost (a certified request whose finishing chunk carried
no ``kv_transfer_params["kvcert"]`` record, or a record with a certificate count other than its tokens),
plain requests that carried a record, certified requests marked ``preempted: true``, and the server's
``/metrics`` (vLLM's ``vllm:num_preemptions_total``, its prefix cache's queried and hit prompt tokens and
their ratio ``prefix_cache_hit_rate``, the plugin's counters), and ``occupancy``: the engine's running and
waiting requests (vLLM's ``vllm:num_requests_running`` / ``_waiting`` gauges, read from ``/metrics`` every 5 s
while the load runs; their mean and largest). The ratios kvcert / stock are of the same
schedule's runs; ``plain_vs_stock`` compares kvcert_mixed's plain requests with the same requests on the
stock server (latency and TTFT percentiles, within 5% or not). ``summary``: ``throughput_ratio`` (kvcert /
stock output tokens per second), ``throughput_cap`` (benchmarks/step_curve.py's cap 2 t(b) / t(2b) at the
pool's b requests, from ``--step-curve``), the goal (1.5, or 90% of a cap below 1.5), whether it is met with
p99 end-to-end latency no worse than stock's, certificates lost and failed requests.

``--preset memory`` sets the memory-bound load at once (``PRESETS``; flags beside it override): the engine's
defaults, 256 requests of 1-4k prompt tokens and 256 output tokens, a 512-token system prompt on half of them,
2 warm-up requests, 32 clients against a pool of 10 full requests, every request certified at ratio 0.5 on
``kvcert`` and half of them on ``kvcert_mixed``, the cap from benchmarks/results/step_curve.json, written to
benchmarks/results/load_test_memory.json. Results: JSON (``--out``, rewritten after each server) and a table on
stdout (docs/serving.md, "Load test"). No timing assertion anywhere (STYLE.md rule 5).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_support import SERVED_NAME as MODEL  # noqa: E402 - the servers' --served-model-name


def schedule(n: int, seed: int, lo: int, hi: int, certified_fraction: float, model: str,
             shared_prefix_tokens: int = 0, shared_prefix_fraction: float = 0.0) -> list[dict]:
    """The load: n requests {prompt (token ids), certified (bool), shared (bool)}, the same for every server.

    The prompt lengths and certified flags are drawn from ``random.Random(seed)`` as they always were, so a
    schedule without a shared prefix is the one earlier runs sent, and two certified fractions give the same
    prompts. With ``shared_prefix_tokens`` > 0, a request is marked shared with probability
    ``shared_prefix_fraction`` (drawn from a stream of its own, ``random.Random(f"{seed}-shared")``) and its
    prompt's first ``shared_prefix_tokens`` tokens are replaced by the system prompt, the corpus's first tokens
    (its length stays the drawn one)."""
    from bench_serving import _corpus

    if not 0 <= shared_prefix_tokens < lo:
        raise ValueError(f"shared_prefix_tokens must be in [0, lo={lo}), got {shared_prefix_tokens}")
    corpus = _corpus(model)
    rng, shared_rng = random.Random(seed), random.Random(f"{seed}-shared")
    system = list(corpus[:shared_prefix_tokens])
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(corpus) - length - 1)
        prompt = list(corpus[start : start + length])
        shared = shared_prefix_tokens > 0 and shared_rng.random() < shared_prefix_fraction
        if shared:
            prompt[:shared_prefix_tokens] = system
        out.append({"prompt": prompt, "certified": rng.random() < certified_fraction, "shared": shared})
    return out


def pool_blocks_for(pool_requests: int, max_prompt: int, max_tokens: int, block_size: int) -> int:
    """A pool of ``pool_requests`` full requests: that many times the blocks of the longest request
    (``max_prompt + max_tokens`` tokens)."""
    return pool_requests * -(-(max_prompt + max_tokens) // block_size)


def _one(client, req: dict, max_tokens: int, ratio: float, seed: int) -> dict:
    """One streamed completion: latency, time to first text, tokens, the kvcert record of its final chunk."""
    extra = {"ignore_eos": True}
    if req["certified"]:
        extra["vllm_xargs"] = {"kvcert_compression_ratio": ratio, "kvcert_seed": seed}
    t0 = time.monotonic()
    first, record, finish, usage = None, None, None, None
    try:
        for chunk in client.completions.create(model=MODEL, prompt=req["prompt"], max_tokens=max_tokens,
                                               temperature=0.0, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra):
            params = (chunk.model_extra or {}).get("kv_transfer_params") or {}
            if params.get("kvcert") is not None:
                record = params["kvcert"]
            for choice in chunk.choices:
                if choice.text and first is None:
                    first = time.monotonic() - t0
                if choice.finish_reason is not None:
                    finish = choice.finish_reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
    except Exception as e:  # noqa: BLE001 - a failed request is counted and reported, not raised
        return {"error": f"{type(e).__name__}: {e}", "latency_s": time.monotonic() - t0,
                "certified": req["certified"]}
    return {"latency_s": time.monotonic() - t0, "ttft_s": first, "tokens": usage or 0, "finish_reason": finish,
            "certified": req["certified"], "record": record, "prompt_tokens": len(req["prompt"])}


#: vLLM's gauges of the scheduler's queues (vllm/v1/metrics/loggers.py), sampled while the load runs: the requests
#: the engine runs at once, and those waiting for admission
VLLM_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def sample_occupancy(url: str, stop: threading.Event, every: float, t0: float, out: list) -> None:
    """Until ``stop`` is set, every ``every`` seconds append ``[seconds since t0, running, waiting]`` (vLLM's
    gauges, summed over engines) to ``out``; a failed read is skipped."""
    from vllm_support import metric_samples

    while not stop.wait(every):
        try:
            values = dict.fromkeys(VLLM_GAUGES, 0.0)
            for s in metric_samples(url):
                if s.name in values:
                    values[s.name] += s.value
            out.append([time.monotonic() - t0, *values.values()])
        except Exception:  # noqa: BLE001 - a sample missed is a sample fewer, not a failed load
            continue


def occupancy_summary(samples: list) -> dict:
    """The mean and largest running and waiting requests over the samples (None where there are none)."""
    if not samples:
        return {"samples": 0, "running_mean": None, "running_max": None, "waiting_mean": None}
    running, waiting = [s[1] for s in samples], [s[2] for s in samples]
    return {"samples": len(samples), "running_mean": statistics.fmean(running), "running_max": max(running),
            "waiting_mean": statistics.fmean(waiting)}


def run_load(url: str, load: list[dict], clients: int, max_tokens: int, ratio: float, seed: int,
             time_limit: float, sample_every: float = 5.0) -> dict:
    """The closed loop of ``clients`` threads over the schedule; per request results in schedule order, and the
    engine's running and waiting requests sampled every ``sample_every`` seconds (:func:`sample_occupancy`)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=max(900.0, time_limit))
    lock, nxt = threading.Lock(), [0]
    results: list = [None] * len(load)
    t0 = time.monotonic()
    done = [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                if i >= len(load) or time.monotonic() - t0 > time_limit:
                    return
                nxt[0] += 1
            results[i] = _one(client, load[i], max_tokens, ratio, seed)
            with lock:
                done[0] += 1
                if done[0] % 8 == 0 or done[0] == len(load):
                    print(f"  {done[0]}/{len(load)} requests, {time.monotonic() - t0:.0f} s", flush=True)

    stop, samples = threading.Event(), []
    sampler = threading.Thread(target=sample_occupancy, args=(url, stop, sample_every, t0, samples), daemon=True)
    sampler.start()
    try:
        with cf.ThreadPoolExecutor(clients) as ex:
            for f in [ex.submit(worker) for _ in range(clients)]:
                f.result()
    finally:
        stop.set()
        sampler.join()
    wall = time.monotonic() - t0
    return {"wall_s": wall, "results": results, "complete": all(r is not None for r in results),
            "occupancy": samples}


#: vLLM's counters read from ``/metrics`` besides the plugin's: preemptions and the prefix cache's queried and hit
#: prompt tokens (vllm/v1/metrics/loggers.py: ``vllm:num_preemptions``, ``vllm:prefix_cache_queries``,
#: ``vllm:prefix_cache_hits``; a counter's sample carries ``_total``)
VLLM_COUNTERS = ("vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def metrics(url: str) -> dict:
    """vLLM's preemption and prefix-cache counters and the plugin's ``kvcert_*`` samples from ``/metrics`` (summed
    over engines), and ``prefix_cache_hit_rate`` (hit / queried prompt tokens; None when nothing was queried)."""
    from vllm_support import metric_samples

    out = {}
    for s in metric_samples(url):
        if s.name.startswith("kvcert_") and not s.name.startswith("kvcert_mean_relative_radius_bucket") \
                or s.name in VLLM_COUNTERS:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return with_hit_rate(out)


def with_hit_rate(m: dict) -> dict:
    """``m`` with ``prefix_cache_hit_rate`` = ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``
    (None when no prompt token was queried, e.g. prefix caching off)."""
    queries = m.get("vllm:prefix_cache_queries_total", 0.0)
    return {**m, "prefix_cache_hit_rate": m.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else None}


def _pct(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)

    def q(p):  # nearest rank
        return xs[min(len(xs) - 1, max(0, int(round(p * len(xs) + 0.5)) - 1))]

    return {"n": len(xs), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "mean": statistics.fmean(xs)}


def summarize(run: dict, max_tokens: int, plugin: bool) -> dict:
    rs = [r for r in run["results"] if r is not None]
    ok = [r for r in rs if "error" not in r and r["tokens"] == max_tokens]
    failed = [r for r in rs if r not in ok]
    cert = [r for r in ok if r["certified"]]
    plain = [r for r in ok if not r["certified"]]
    out = {
        "sent": len(rs), "completed": len(ok), "failed": len(failed),
        "failures": [r.get("error") or f"{r['tokens']} tokens, finish {r.get('finish_reason')}" for r in failed][:10],
        "complete": run["complete"], "wall_s": run["wall_s"], "occupancy": occupancy_summary(run.get("occupancy", [])),
        "requests_per_s": len(ok) / run["wall_s"], "output_tokens_per_s": sum(r["tokens"] for r in ok) / run["wall_s"],
        "latency_s": {"all": _pct([r["latency_s"] for r in ok]), "certified": _pct([r["latency_s"] for r in cert]),
                      "plain": _pct([r["latency_s"] for r in plain])},
        "ttft_s": {"all": _pct([r["ttft_s"] for r in ok if r["ttft_s"] is not None]),
                   "certified": _pct([r["ttft_s"] for r in cert if r["ttft_s"] is not None]),
                   "plain": _pct([r["ttft_s"] for r in plain if r["ttft_s"] is not None])},
    }
    if plugin:
        lost = [i for i, r in enumerate(cert) if r["record"] is None
                or len(r["record"].get("certificates") or []) != r["tokens"]]
        out.update(certified=len(cert), certificates_lost=len(lost),
                   plain_with_record=sum(r["record"] is not None for r in plain),
                   certified_preempted=sum(bool(r["record"] and r["record"].get("preempted")) for r in cert),
                   blocks_freed=sum((r["record"] or {}).get("blocks_freed", 0) for r in cert))
    return out


#: ``--preset memory``: issue 52's memory-bound load (its "A memory-bound load test"): the engine's defaults,
#: a shared system prompt on half the requests, 32 closed-loop clients against a pool of 10 full requests, every
#: request certified at ratio 0.5, and a second plugin run with half of them certified
PRESETS = {"memory": dict(requests=256, clients=32, min_prompt=1024, max_prompt=4096, max_tokens=256,
                          certified_fraction=1.0, ratio=0.5, engine_defaults=True, shared_prefix_tokens=512,
                          shared_prefix_fraction=0.5, pool_requests=10, servers=["stock", "kvcert", "kvcert_mixed"],
                          mixed_fraction=0.5, warmup_requests=2, time_limit=7200.0,
                          step_curve=str(ROOT / "benchmarks" / "results" / "step_curve.json"),
                          out=str(ROOT / "benchmarks" / "results" / "load_test_memory.json"))}
#: the servers: stock (no plugin), kvcert (the plugin, the schedule's certified flags), kvcert_mixed (the plugin,
#: the same prompts with ``--mixed-fraction`` of them certified)
SERVERS = ("stock", "kvcert", "kvcert_mixed")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="set a load's numbers at once (flags given "
                    "beside it override them); 'memory': issue 52's memory-bound load")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--min-prompt", type=int, default=384)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--certified-fraction", type=float, default=0.5)
    ap.add_argument("--mixed-fraction", type=float, default=0.5,
                    help="the certified fraction of the kvcert_mixed server's schedule (the same prompts)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=None, help="KV blocks of every server (default 64)")
    ap.add_argument("--pool-requests", type=int, default=None,
                    help="a pool of N full requests: N x the blocks of the longest request (not with --pool-blocks)")
    ap.add_argument("--engine-defaults", action="store_true",
                    help="keep the engine's prefix caching and async scheduling (no --no-enable-prefix-caching, "
                         "no --no-async-scheduling)")
    ap.add_argument("--dtype", default="float32", help="the servers' --dtype")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="the servers' --enforce-eager")
    ap.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="a shared system prompt of this many tokens opens --shared-prefix-fraction of the prompts")
    ap.add_argument("--shared-prefix-fraction", type=float, default=0.5)
    ap.add_argument("--step-curve", metavar="PATH", default=None,
                    help="benchmarks/step_curve.py's JSON: the summary's throughput_cap at the pool's requests")
    ap.add_argument("--warmup-requests", type=int, default=0,
                    help="requests sent one at a time before the load (certified on the plugin's servers, "
                         "--min-prompt tokens, at most 16 output tokens), not counted: the first certified "
                         "request may build the compiled op; /metrics counters are taken after them")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per server before no new request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", nargs="+", default=["stock", "kvcert"], choices=SERVERS)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_test.json"))
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The options, a preset's values as defaults (flags given beside it override them), checked: each bad value
    is an error naming its flag. Adds ``max_model_len`` and resolves ``pool_blocks``."""
    ap = _parser()
    given = ap.parse_args(argv)  # without the preset's values: what the command line names
    if given.preset:
        ap.set_defaults(**PRESETS[given.preset])
    a = ap.parse_args(argv)
    for name in ("requests", "clients", "min_prompt", "max_tokens", "block_size", "pool_blocks", "pool_requests"):
        value = getattr(a, name)
        if value is not None and value < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if a.max_prompt < a.min_prompt:
        ap.error(f"--max-prompt ({a.max_prompt}) must be >= --min-prompt ({a.min_prompt})")
    for name in ("certified_fraction", "mixed_fraction", "shared_prefix_fraction"):
        if not 0 <= getattr(a, name) <= 1:
            ap.error(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(a, name)}")
    if not 0 < a.ratio < 1:
        ap.error(f"--ratio must be in (0, 1), got {a.ratio}")
    if a.warmup_requests < 0:
        ap.error(f"--warmup-requests must be >= 0, got {a.warmup_requests}")
    if not 0 <= a.shared_prefix_tokens < a.min_prompt:
        ap.error(f"--shared-prefix-tokens must be in [0, --min-prompt={a.min_prompt}), got {a.shared_prefix_tokens}")
    if given.pool_requests is not None and given.pool_blocks is not None:
        ap.error("give --pool-blocks or --pool-requests, not both")
    if given.pool_blocks is not None:  # blocks named on the command line replace a preset's pool of requests
        a.pool_requests = None
    a.max_model_len = a.block_size * (-(-(a.max_prompt + a.max_tokens) // a.block_size))
    if a.pool_blocks is None:
        a.pool_blocks = 64 if a.pool_requests is None else pool_blocks_for(a.pool_requests, a.max_prompt,
                                                                           a.max_tokens, a.block_size)
    if a.max_model_len > a.pool_blocks * a.block_size:
        ap.error(f"--pool-blocks {a.pool_blocks} cannot hold one request of {a.max_model_len} tokens")
    if a.step_curve is not None and not Path(a.step_curve).is_file():
        ap.error(f"--step-curve {a.step_curve}: no such file")
    return a


def _kv_space_gib(model: str, pool_tokens: int) -> int:
    """GiB of ``VLLM_CPU_KVCACHE_SPACE`` that hold ``pool_tokens`` of the model's K and V in float32 (at least 2)."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head * 4
    return max(2, -(-pool_tokens * per_token // 2**30))


def run_server(name: str, a: argparse.Namespace, load: list[dict], model: str) -> tuple[dict, dict]:
    """One server under the load: (its summary, the raw run)."""
    from vllm_support import serve, server_args

    plugin = name != "stock"
    env = {} if plugin else {"VLLM_PLUGINS": ""}
    env["VLLM_CPU_KVCACHE_SPACE"] = str(_kv_space_gib(model, a.pool_blocks * a.block_size))
    print(f"{name}: starting the server ({a.pool_blocks} blocks of {a.block_size})", flush=True)
    args = server_args(plugin=plugin, max_model_len=a.max_model_len, block_size=a.block_size, max_num_seqs=a.clients,
                       extra=("--num-gpu-blocks-override", str(a.pool_blocks)), engine_defaults=a.engine_defaults,
                       dtype=a.dtype, enforce_eager=a.enforce_eager)
    with serve(args, env=env) as srv:
        before = {}
        if a.warmup_requests:  # one at a time, certified on the plugin's servers; not counted
            warm = schedule(a.warmup_requests, -1 - a.seed, a.min_prompt, a.min_prompt, float(plugin), model)
            run_load(srv["url"], warm, 1, min(a.max_tokens, 16), a.ratio, a.seed, a.time_limit)
            time.sleep(2)
            before = metrics(srv["url"])
        run = run_load(srv["url"], load, a.clients, a.max_tokens, a.ratio, a.seed, a.time_limit)
        time.sleep(2)  # the stat loggers see the last step a moment after it
        summary = summarize(run, a.max_tokens, plugin)
        after = metrics(srv["url"])
    summary["metrics"] = with_hit_rate({k: v - before.get(k, 0.0) for k, v in after.items()
                                        if k != "prefix_cache_hit_rate"})
    summary["shared_prefix_requests"] = sum(r["shared"] for r in load)
    return summary, run


def plain_vs_stock(mixed: dict, stock: dict, load: list[dict], max_tokens: int) -> dict:
    """The plain requests of the mixed run against the same requests on the stock server (both completed):
    end-to-end latency and TTFT percentiles, mixed / stock, and the median of the per-request latency ratios;
    ``within_5_percent``: latency p50 and p99 ratios <= 1.05 (the goal: no slowdown beyond 5%)."""
    ok = lambda r: r is not None and "error" not in r and r["tokens"] == max_tokens  # noqa: E731
    idx = [i for i, req in enumerate(load) if not req["certified"] and ok(mixed["results"][i])
           and i < len(stock["results"]) and ok(stock["results"][i])]
    if not idx:
        return {"requests": 0}
    m, s = [mixed["results"][i] for i in idx], [stock["results"][i] for i in idx]
    out = {"requests": len(idx), "median_latency_ratio": statistics.median(x["latency_s"] / y["latency_s"]
                                                                           for x, y in zip(m, s))}
    for key in ("latency_s", "ttft_s"):
        pm, ps = _pct([x[key] for x in m if x[key] is not None]), _pct([y[key] for y in s if y[key] is not None])
        for p in ("p50", "p90", "p99"):
            out[f"{key[:-2]}_{p}_ratio"] = pm[p] / ps[p] if pm["n"] and ps["n"] else None
    out["within_5_percent"] = out["latency_p50_ratio"] <= 1.05 and out["latency_p99_ratio"] <= 1.05
    return out


def throughput_cap(path: str | None, requests: int) -> dict:
    """The cap that doubling the admitted requests can give at ``requests`` in the pool, from
    benchmarks/step_curve.py's JSON: its ``cap`` at that b, else 2 t(b) / t(2b) from its measured points, else
    None (with the reason)."""
    if path is None:
        return {"throughput_cap": None, "throughput_cap_note": "no --step-curve given"}
    curve = json.loads(Path(path).read_text())
    cap = curve["cap"]["cap"].get(str(requests))
    per = curve["per_batch"]
    if cap is None and str(requests) in per and str(2 * requests) in per:
        cap = 2 * per[str(requests)]["step_s"] / per[str(2 * requests)]["step_s"]
    name = Path(path).resolve()
    name = name.relative_to(ROOT).as_posix() if name.is_relative_to(ROOT) else str(name)
    note = (f"{name} ({curve.get('git_commit')}, {curve.get('date')}) at b = {requests}" if cap is not None
            else f"{name} measured no b = {requests} and 2b = {2 * requests}")
    return {"throughput_cap": cap, "throughput_cap_note": note}


def summary_of(result: dict, a: argparse.Namespace) -> dict:
    """The ``summary`` object (names that checks outside the project read): ``throughput_ratio`` (kvcert /
    stock output tokens per second), ``throughput_cap`` (the step-time curve's cap at the pool's requests),
    the goal (1.5, or 90% of a cap below 1.5) and whether it is met with p99 end-to-end latency no worse than
    stock's; certificates lost and failed requests over every server."""
    servers = result["servers"]
    requests = a.pool_requests if a.pool_requests is not None else a.pool_blocks * a.block_size // a.max_model_len
    out = {"pool_requests": requests, **throughput_cap(a.step_curve, requests)}
    if {"stock", "kvcert"} <= set(servers):
        s, k = servers["stock"], servers["kvcert"]
        out["throughput_ratio"] = k["output_tokens_per_s"] / s["output_tokens_per_s"]
        out["latency_p99_ratio"] = k["latency_s"]["all"]["p99"] / s["latency_s"]["all"]["p99"]
        cap = out["throughput_cap"]
        out["goal"] = 1.5 if cap is None or cap >= 1.5 else 0.9 * cap
        out["goal_met"] = out["throughput_ratio"] >= out["goal"] and out["latency_p99_ratio"] <= 1.0
    out["certificates_lost"] = sum(v.get("certificates_lost", 0) for v in servers.values())
    out["failed_requests"] = sum(v["failed"] for v in servers.values())
    if "plain_vs_stock" in result:
        out["plain_within_5_percent"] = result["plain_vs_stock"].get("within_5_percent")
    return out


def main(argv=None) -> None:
    a = parse_args(argv)
    from vllm_support import model_path
    from runinfo import git

    model = model_path()
    shape = (a.requests, a.seed, a.min_prompt, a.max_prompt)
    load = schedule(*shape, a.certified_fraction, model, a.shared_prefix_tokens, a.shared_prefix_fraction)
    mixed = schedule(*shape, a.mixed_fraction, model, a.shared_prefix_tokens, a.shared_prefix_fraction)
    result = {"command": " ".join([".venv-vllm/bin/python", "benchmarks/load_test.py", *(sys.argv[1:] if argv is None
                                                                                       else argv)]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git("rev-parse", "--short",
                                                                                             "HEAD"),
              "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()},
              "settings": vars(a), "max_model_len": a.max_model_len,
              "certified_requests": sum(r["certified"] for r in load),
              "mixed_certified_requests": sum(r["certified"] for r in mixed),
              "shared_prefix_requests": sum(r["shared"] for r in load), "servers": {}}
    runs = {}
    for name in a.servers:
        result["servers"][name], runs[name] = run_server(name, a, mixed if name == "kvcert_mixed" else load, model)
        print(json.dumps({k: v for k, v in result["servers"][name].items() if k not in ("latency_s", "ttft_s")},
                         indent=1), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1))  # what has run so far, should a later server fail
    if {"stock", "kvcert"} <= set(result["servers"]):
        s, k = result["servers"]["stock"], result["servers"]["kvcert"]
        result["ratios_kvcert_over_stock"] = {
            "requests_per_s": k["requests_per_s"] / s["requests_per_s"],
            "output_tokens_per_s": k["output_tokens_per_s"] / s["output_tokens_per_s"],
            **{f"latency_{p}": k["latency_s"]["all"][p] / s["latency_s"]["all"][p] for p in ("p50", "p90", "p99")},
            **{f"ttft_{p}": k["ttft_s"]["all"][p] / s["ttft_s"]["all"][p] for p in ("p50", "p90", "p99")}}
    if {"stock", "kvcert_mixed"} <= set(runs):
        result["plain_vs_stock"] = plain_vs_stock(runs["kvcert_mixed"], runs["stock"], mixed, a.max_tokens)
    result["summary"] = summary_of(result, a)
    result["machine"]["loadavg_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(result, indent=1))
    _print_table(result)


def _ps(d: dict, fmt: str) -> str:
    return " / ".join(format(d[p], fmt) for p in ("p50", "p90", "p99")) if d.get("n") else "-"


def _print_table(result: dict) -> None:
    print("\n| server | completed / sent | failed | req/s | tok/s | latency p50 / p90 / p99 (s) "
          "| TTFT p50 / p90 / p99 (s) | preemptions | prefix-cache hit rate | certified: lost / preempted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, s in result["servers"].items():
        pre = s["metrics"].get("vllm:num_preemptions_total", float("nan"))
        hit = s["metrics"].get("prefix_cache_hit_rate")
        cert = f"{s['certificates_lost']} / {s['certified_preempted']} of {s['certified']}" if "certified" in s else "-"
        print(f"| {name} | {s['completed']} / {s['sent']} | {s['failed']} | {s['requests_per_s']:.3f} | "
              f"{s['output_tokens_per_s']:.1f} | {_ps(s['latency_s']['all'], '.1f')} | {_ps(s['ttft_s']['all'], '.2f')}"
              f" | {pre:.0f} | {'-' if hit is None else format(hit, '.3f')} | {cert} |")
    for key, label in (("ratios_kvcert_over_stock", "kvcert / stock"),
                       ("plain_vs_stock", "kvcert_mixed plain requests / the same on stock"), ("summary", "summary")):
        if key in result:
            print(f"{label}:", {k: round(v, 3) if isinstance(v, float) else v for k, v in result[key].items()})


if __name__ == "__main__":
    main()
