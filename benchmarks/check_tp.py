"""Tensor parallelism on the default model: the plugin at TP=T against TP=1, the same prompts and requests.

    .venv-vllm/bin/python benchmarks/check_tp.py [--tp 3] [--out benchmarks/results/check_tp.json]

SmolLM2-135M has 9 query heads over 3 KV heads, so T = 3 is the tensor-parallel size that divides both (the
tests use a tiny model at T = 2: tests/vllm/test_vllm_parallel.py). One engine per TP size, each in a process
of its own (this script with ``--child``; in-process engine core, vLLM's multiprocessing executor for T > 1),
engine default compression 0, prompts 0-3 of ``tests/vllm/vllm_support.prompts()`` (193-257 tokens), 8
greedy tokens, served three times: plain, the default design at ratio 0.5 (the tilted sketch, ``tilted_hull``)
and the paper design at ratio 0.5 (no sketch, Chebyshev), by per-request options. Reports per design whether
the tokens, kept counts and freed blocks are the TP=1 engine's, and the largest relative difference of the
per-token certificates. A check with a printed result, not a timing; docs/serving.md, "Parallel engines".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

SEED = 3
DESIGNS = {"plain": None,
           "default": {"kvcert_compression_ratio": 0.5, "kvcert_seed": SEED},
           "paper": {"kvcert_compression_ratio": 0.5, "kvcert_seed": SEED, "kvcert_sketch": None,
                     "kvcert_kind": "chebyshev"}}


def _child(tp: int, out_path: str) -> None:
    from vllm import SamplingParams
    from vllm_support import ENGINE, model_path, prompts

    from kvcert.vllm import certificate_report, certified_llm

    llm = certified_llm(model_path(), compression_ratio=0.0, tensor_parallel_size=tp,
                        max_model_len=ENGINE["max_model_len"], block_size=ENGINE["block_size"], max_num_seqs=4)
    ps = [{"prompt_token_ids": list(p)} for p in prompts()[:4]]
    out = {}
    for name, extra in DESIGNS.items():
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, extra_args=extra)
        out[name] = [{"tokens": list(o.outputs[0].token_ids), "report": certificate_report(o)}
                     for o in llm.generate(ps, sp, use_tqdm=False)]
    Path(out_path).write_text(json.dumps(out))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "check_tp.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(int(a.child[0]), a.child[1])
    if a.tp < 2:
        ap.error(f"--tp must be >= 2 (compared with TP=1), got {a.tp}")
    import numpy as np
    from runinfo import git
    from vllm_support import vllm_env

    env = vllm_env(in_process=True)
    runs = {}
    (ROOT / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=str(ROOT / ".cache")) as tmp:
        for tp in (1, a.tp):
            path = os.path.join(tmp, f"tp{tp}.json")
            proc = subprocess.run([sys.executable, __file__, "--child", str(tp), path], env=env, cwd=tmp,
                                  capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"TP={tp} engine failed:\n" + (proc.stdout + proc.stderr)[-4000:])
            runs[tp] = json.loads(Path(path).read_text())
    result = {"command": " ".join([".venv-vllm/bin/python", "benchmarks/check_tp.py", *(sys.argv[1:] if argv is None
                                                                                       else argv)]),
              "git_commit": git("rev-parse", "--short", "HEAD"), "tp": a.tp, "designs": {}}
    for name in DESIGNS:
        one, many = runs[1][name], runs[a.tp][name]
        row = {"tokens_equal": all(x["tokens"] == y["tokens"] for x, y in zip(one, many))}
        if DESIGNS[name] is not None:
            row["kept_counts_equal"] = all(x["report"]["kept_counts"] == y["report"]["kept_counts"]
                                           for x, y in zip(one, many))
            row["blocks_freed"] = [[x["report"]["blocks_freed"], y["report"]["blocks_freed"]] for x, y in zip(one, many)]
            rel = [np.abs(np.asarray(y["report"]["certificates"][1:]) / np.asarray(x["report"]["certificates"][1:]) - 1)
                   for x, y in zip(one, many)]
            row["certificate_rel_diff_max"] = float(max(r.max() for r in rel))
            row["certificate_rel_diff_median"] = float(np.median(np.concatenate(rel)))
        else:
            row["records"] = [y["report"] for y in many]
        result["designs"][name] = row
        print(name, row, flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
