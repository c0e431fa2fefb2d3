"""Where the plugin's time goes in one engine process: the prefill event and the decode step, against stock vLLM.

    .venv-vllm/bin/python benchmarks/profile_vllm_step.py {stock,plugin} [--tokens 1024] [--concurrency 4]
        [--block-size 64] [--rounds 2] [--profile]

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's Python runs here and can be
timed), float32, eager, the serving benchmark's engine arguments (benchmarks/bench_serving.py) at one prompt
length. Each round submits ``concurrency`` distinct prompts of ``tokens`` pydoc tokens together (new prompts
each round) and generates 33 greedy tokens: the first token ends the prefill step (all prompts in one step:
``max_num_batched_tokens`` = concurrency x tokens), the other 32 are decode steps. Printed per round:

- ``prefill_s``: the mean time to first token (vLLM's ``first_token_latency``);
- ``event_s`` (plugin): the time spent in the plugin's prefill event, the attention backend's
  ``_importance`` (score, sample, sketch and the copy of the kept tokens), summed over the layers;
- ``decode_ms``: the mean decode time per token ((last_token_ts - first_token_ts) / 32).

``--profile`` runs cProfile over the last round and prints the kvcert functions by cumulative time. In-process
times differ from the served ones (the engine core behind a process boundary, benchmarks/bench_serving.py):
only the ratios of the same script's runs compare. No timing assertion anywhere (STYLE.md rule 5).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", choices=("stock", "plugin"))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    for name, value in (("--tokens", args.tokens), ("--concurrency", args.concurrency),
                        ("--block-size", args.block_size), ("--rounds", args.rounds)):
        if value < 1:
            ap.error(f"{name} must be >= 1, got {value}")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_serving import _env, _prompts, engine_args

    os.environ.update(_env())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.engine == "stock":
        os.environ["VLLM_PLUGINS"] = ""
    from vllm import LLM, SamplingParams

    from kvcert.vllm import default_model_path

    model = default_model_path()
    n, bs = args.tokens, args.block_size
    pool = max(320 * 64 // bs, args.concurrency * (-(-(n + 64) // bs)))
    engine = engine_args(bs, pool, n + 64 + bs, n * args.concurrency)
    timer = {"s": 0.0}
    if args.engine == "plugin":
        from kvcert.vllm import backend, certified_llm

        engine.pop("enable_prefix_caching")
        llm = certified_llm(model, compression_ratio=0.5, seed=0, **engine)
        event = backend.CertifiedCPUAttentionImpl._importance

        def timed(self, step, plan, *a, **k):
            t = time.perf_counter()
            try:
                return event(self, step, plan, *a, **k)
            finally:
                if plan.importance:
                    timer["s"] += time.perf_counter() - t

        backend.CertifiedCPUAttentionImpl._importance = timed
    else:
        llm = LLM(model, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True)
    for r in range(args.rounds):
        prompts = [{"prompt_token_ids": p} for p in _prompts(model, [n], args.concurrency, offset=1000 * r)]
        timer["s"] = 0.0
        prof = None
        if args.profile and r == args.rounds - 1:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if prof is not None:
            prof.disable()
        m = [o.metrics for o in outs]
        prefill = sum(x.first_token_latency for x in m) / len(m)
        decode = sum((x.last_token_ts - x.first_token_ts) / 32 for x in m) / len(m)
        line = f"round {r}: {args.engine} tokens={n} concurrency={args.concurrency} bs={bs}: prefill_s {prefill:.2f}"
        if args.engine == "plugin":
            line += f", event_s {timer['s']:.2f}"
        print(line + f", decode_ms {decode * 1e3:.1f}" + (" (profiled)" if prof is not None else ""), flush=True)
        if prof is not None:
            import pstats

            pstats.Stats(prof).sort_stats("cumulative").print_stats("kvcert|fast|kernels", 30)


if __name__ == "__main__":
    main()
