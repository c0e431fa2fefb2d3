"""Load test: the OpenAI-compatible server with the plugin against the stock server, under the same load.

    .venv-vllm/bin/python benchmarks/load_test.py [--requests 64] [--clients 6] [--out benchmarks/results/load_test.json]

Two servers, one after the other, on 127.0.0.1 only (``python -m vllm.entrypoints.openai.api_server``,
started and stopped by ``tests/vllm/vllm_support.serve``): **stock** (no plugin loaded, ``VLLM_PLUGINS=""``)
and **kvcert** (the plugin's scheduler and worker, engine default ``compression_ratio=0``: a request is
certified only when it asks, ``vllm_xargs={"kvcert_compression_ratio": r}``). Both get the same engine
arguments, among them a fixed pool of ``--pool-blocks`` KV blocks small enough that running requests
outgrow it and vLLM preempts (recomputes) some, and the same load:

- a schedule of ``--requests`` requests fixed by ``--seed``: prompt lengths drawn uniformly from
  ``--min-prompt`` .. ``--max-prompt`` tokens (token ids from CPython's pydoc topics), each request
  certified with probability ``--certified-fraction`` (the stock server receives the same ``vllm_xargs``,
  which it ignores), ``--max-tokens`` greedy tokens with ``ignore_eos``, streamed;
- ``--clients`` concurrent clients (threads with the ``openai`` package), each sending its next request from
  the shared schedule as soon as its previous one finished (a closed loop), until the schedule is done or
  ``--time-limit`` seconds have passed (then no new request is sent; the run is marked incomplete).

Per server: wall time from the first request sent to the last finished, throughput (requests/s and output
tokens/s over that wall time), end-to-end latency and time to first token (first streamed text) percentiles
(p50/p90/p99, all requests and certified/plain apart), failed requests (an exception, or fewer tokens than
asked), and from the plugin's server: certificates lost (a certified request whose finishing chunk carried
no ``kv_transfer_params["kvcert"]`` record, or a record with a certificate count other than its tokens),
plain requests that carried a record, certified requests marked ``preempted: true``, and the server's
``/metrics`` (vLLM's ``vllm:num_preemptions_total``, the plugin's counters). The ratios kvcert / stock are
of the same schedule's runs. Results: JSON (``--out``) and a table on stdout (docs/serving.md, "Load test").
No timing assertion anywhere (STYLE.md rule 5).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
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


def schedule(n: int, seed: int, lo: int, hi: int, certified_fraction: float, model: str) -> list[dict]:
    """The load: n requests {prompt (token ids), certified (bool)}, the same for every server."""
    from bench_serving import _corpus

    corpus = _corpus(model)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(corpus) - length - 1)
        out.append({"prompt": list(corpus[start : start + length]), "certified": rng.random() < certified_fraction})
    return out


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


def run_load(url: str, load: list[dict], clients: int, max_tokens: int, ratio: float, seed: int,
             time_limit: float) -> dict:
    """The closed loop of ``clients`` threads over the schedule; per request results in schedule order."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
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

    with cf.ThreadPoolExecutor(clients) as ex:
        for f in [ex.submit(worker) for _ in range(clients)]:
            f.result()
    wall = time.monotonic() - t0
    return {"wall_s": wall, "results": results, "complete": all(r is not None for r in results)}


def metrics(url: str) -> dict:
    """vLLM's preemption counter and the plugin's ``kvcert_*`` samples from ``/metrics`` (summed over engines)."""
    from vllm_support import metric_samples

    out = {}
    for s in metric_samples(url):
        if s.name.startswith("kvcert_") and not s.name.startswith("kvcert_mean_relative_radius_bucket") \
                or s.name == "vllm:num_preemptions_total":
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


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
        "complete": run["complete"], "wall_s": run["wall_s"],
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--min-prompt", type=int, default=384)
    ap.add_argument("--max-prompt", type=int, default=768)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--certified-fraction", type=float, default=0.5)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds per server before no new request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", nargs="+", default=["stock", "kvcert"], choices=["stock", "kvcert"])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_test.json"))
    a = ap.parse_args(argv)
    for name in ("requests", "clients", "min_prompt", "max_tokens", "block_size", "pool_blocks"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.max_prompt < a.min_prompt:
        ap.error(f"--max-prompt ({a.max_prompt}) must be >= --min-prompt ({a.min_prompt})")
    if not 0 <= a.certified_fraction <= 1 or not 0 < a.ratio < 1:
        ap.error("--certified-fraction must be in [0, 1] and --ratio in (0, 1)")
    max_model_len = a.block_size * (-(-(a.max_prompt + a.max_tokens) // a.block_size))
    if max_model_len > a.pool_blocks * a.block_size:
        ap.error(f"--pool-blocks {a.pool_blocks} cannot hold one request of {max_model_len} tokens")

    from vllm_support import model_path, serve, server_args
    from runinfo import git

    load = schedule(a.requests, a.seed, a.min_prompt, a.max_prompt, a.certified_fraction, model_path())
    result = {"command": " ".join([".venv-vllm/bin/python", "benchmarks/load_test.py", *(sys.argv[1:] if argv is None
                                                                                       else argv)]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git("rev-parse", "--short",
                                                                                             "HEAD"),
              "settings": vars(a), "max_model_len": max_model_len,
              "certified_requests": sum(r["certified"] for r in load), "servers": {}}
    for name in a.servers:
        plugin = name == "kvcert"
        env = {} if plugin else {"VLLM_PLUGINS": ""}
        env["VLLM_CPU_KVCACHE_SPACE"] = "2"
        print(f"{name}: starting the server ({a.pool_blocks} blocks of {a.block_size})", flush=True)
        args = server_args(plugin=plugin, max_model_len=max_model_len, block_size=a.block_size, max_num_seqs=a.clients,
                           extra=("--num-gpu-blocks-override", str(a.pool_blocks)))
        with serve(args, env=env) as srv:
            run = run_load(srv["url"], load, a.clients, a.max_tokens, a.ratio, a.seed, a.time_limit)
            time.sleep(2)  # the stat loggers see the last step a moment after it
            summary = summarize(run, a.max_tokens, plugin)
            summary["metrics"] = metrics(srv["url"])
        result["servers"][name] = summary
        print(json.dumps({k: v for k, v in summary.items() if k not in ("latency_s", "ttft_s")}, indent=1), flush=True)
    if {"stock", "kvcert"} <= set(result["servers"]):
        s, k = result["servers"]["stock"], result["servers"]["kvcert"]
        result["ratios_kvcert_over_stock"] = {
            "requests_per_s": k["requests_per_s"] / s["requests_per_s"],
            **{f"latency_{p}": k["latency_s"]["all"][p] / s["latency_s"]["all"][p] for p in ("p50", "p90", "p99")},
            **{f"ttft_{p}": k["ttft_s"]["all"][p] / s["ttft_s"]["all"][p] for p in ("p50", "p90", "p99")}}
    Path(a.out).write_text(json.dumps(result, indent=1))
    _print_table(result)


def _print_table(result: dict) -> None:
    print("\n| server | completed / sent | failed | req/s | tok/s | latency p50 / p90 / p99 (s) | TTFT p50 / p90 / p99 (s)"
          " | preemptions | certified: lost / preempted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in result["servers"].items():
        lat, ttft = s["latency_s"]["all"], s["ttft_s"]["all"]
        pre = s["metrics"].get("vllm:num_preemptions_total", float("nan"))
        cert = f"{s['certificates_lost']} / {s['certified_preempted']} of {s['certified']}" if "certified" in s else "-"
        print(f"| {name} | {s['completed']} / {s['sent']} | {s['failed']} | {s['requests_per_s']:.3f} | "
              f"{s['output_tokens_per_s']:.1f} | {lat['p50']:.1f} / {lat['p90']:.1f} / {lat['p99']:.1f} | "
              f"{ttft['p50']:.2f} / {ttft['p90']:.2f} / {ttft['p99']:.2f} | {pre:.0f} | {cert} |")
    if "ratios_kvcert_over_stock" in result:
        print("kvcert / stock:", {k: round(v, 3) for k, v in result["ratios_kvcert_over_stock"].items()})


if __name__ == "__main__":
    main()
