"""The vLLM plugin's token-design decode step with a logit softcap (Gemma 2): the compiled op's pass vs the gather route.

    .venv-vllm/bin/python benchmarks/bench_softcap_decode.py     # writes benchmarks/results/softcap_decode.json

Runs in the vLLM venv: it times :func:`kvcert.vllm.backend.token_decode`, the plugin's own call, on a paged cache
in vLLM's CPU ``vec`` layout. Shapes are Gemma 2 2B's attention (h_q = 8, h_kv = 4, head size 256, float32,
32-token blocks). E decode rows each hold n compacted slots (4 sinks and 32 recent tokens with pi = 1, the rest
pi ~ U(0.05, 1)) in scattered blocks. Variants, each giving the output and the chebyshev trace:

- ``op_softcap``: ``softcap=50.0`` (Gemma 2's value), the compiled op's paged route with the cap in its pass;
- ``op``: the same call without a softcap (what the cap costs the op);
- ``gather_softcap``: ``softcap=50.0`` with ``KVCERT_CPU_OP=0``: the rows gathered, the cap as a score bias of
  ``kvcert.dispatch.hajek_attention`` (the route before the op took the cap).

Rounds are interleaved, each timing every variant over ``--reps`` calls in a rotating order. The JSON has, per
size and variant, the median and the 20 / 80 % quantiles of the per-call time over rounds, and the median of the
per-round ratios against ``op``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

H_Q, H_KV, D, BS, CAP = 8, 4, 256, 32, 50.0
VARIANTS = ("op_softcap", "op", "gather_softcap")


def setup(rows: int, n: int, seed: int = 0):
    """A paged cache of ``rows`` rows with n slots each (scattered blocks), their log pi, and one query per row."""
    g = torch.Generator().manual_seed(seed)
    m = -(-n // BS)
    nb = rows * m + 4
    cache = torch.randn(nb, H_KV, BS, 2 * D, generator=g)
    ids = torch.randperm(nb, generator=g)[: rows * m].view(rows, m)
    pi = torch.rand(rows, H_KV, m * BS, generator=g) * 0.95 + 0.05
    pi[..., :4] = 1.0
    pi[..., n - 32 : n] = 1.0
    lp = pi.log()
    lp[..., n:] = float("-inf")
    q = torch.randn(rows, H_Q, D, generator=g)
    return q, cache, ids, lp


def call(variant: str, q, cache, ids, lp):
    from kvcert.vllm.backend import token_decode

    cap = None if variant == "op" else CAP
    if variant == "gather_softcap":
        os.environ["KVCERT_CPU_OP"] = "0"
    try:
        return token_decode(q, cache, ids, lp, D ** -0.5, "chebyshev", 0.05, radius=False, softcap=cap)
    finally:
        os.environ.pop("KVCERT_CPU_OP", None)


def _quantiles(xs: list[float]) -> dict:
    qs = statistics.quantiles(xs, n=5) if len(xs) > 1 else [xs[0]] * 4
    return {"median_ms": 1e3 * statistics.median(xs), "q20_ms": 1e3 * qs[0], "q80_ms": 1e3 * qs[3]}


def run(rows: int, n: int, rounds: int, reps: int) -> dict:
    args = setup(rows, n)
    routes = {}
    for v in VARIANTS:  # warm-up, and the code each variant ran
        routes[v] = call(v, *args).route.code
    assert routes["op"] == routes["op_softcap"] == "paged_cpu_op" and routes["gather_softcap"] == "gather", routes
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        for v in order:
            t0 = time.perf_counter()
            for _ in range(reps):
                call(v, *args)
            times[v].append((time.perf_counter() - t0) / reps)
    out = {v: _quantiles(times[v]) for v in VARIANTS}
    for v in VARIANTS:
        out[v]["route"] = routes[v]
        out[v]["ratio_to_op"] = statistics.median(a / b for a, b in zip(times[v], times["op"]))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=8, help="decode rows (requests) per call (default 8)")
    p.add_argument("--sizes", default="512,2048", help="kept slots per row, comma-separated (default 512,2048)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "softcap_decode.json"))
    a = p.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    res = {"command": "benchmarks/bench_softcap_decode.py " + " ".join(argv or []),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                      f"torch threads {torch.get_num_threads()}",
           "shapes": {"h_q": H_Q, "h_kv": H_KV, "head_size": D, "block_size": BS, "softcap": CAP, "rows": a.rows},
           "sizes": {}}
    for n in (int(x) for x in a.sizes.split(",")):
        res["sizes"][str(n)] = run(a.rows, n, a.rounds, a.reps)
        print(n, json.dumps(res["sizes"][str(n)], indent=1), flush=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
