"""The decode attention step on a compressed cache: the compiled CPU op vs the torch path vs SDPA.

    OMP_NUM_THREADS=2 python benchmarks/bench_cpu_op.py            # writes benchmarks/results/cpu_op.json
    python benchmarks/bench_cpu_op.py --sizes 2048 --rounds 20 --out /tmp/x.json

Setup: the default model's attention shapes (SmolLM2-135M: b = 1, h_q = 9, h_kv = 3, d = dv = 64,
one query, float32) over a compressed cache of n kept tokens (4 sinks and 32 recent tokens with
pi = 1, the rest pi ~ U(0.05, 1)), held as views of a larger buffer with spare slots, as the
Hugging Face cache holds them. Variants, each returning the output and what the recorded
(chebyshev) certificate needs:

- ``op``: :func:`kvcert.kernels.cpu.hajek_attention` (output, lse, trace in one pass).
- ``dispatch_op``: the same through ``kvcert.dispatch.hajek_attention`` with the Hugging Face
  decode's arguments (backend "fast", cached value moments, ``validate=False``): the step the
  model runs per layer.
- ``torch``: :func:`kvcert.fast.hajek_attention` with the same arguments (its one-pass path with the
  cached moments): the torch path (``KVCERT_CPU_OP=0``).
- ``sdpa``: torch SDPA with ``enable_gqa=True`` and -log pi as a float mask built outside the timing
  (output only; its fastest form with a bias).

Rounds are interleaved (each round times every variant over ``--reps`` calls, in a rotating order),
so load on the machine hits the variants alike; the JSON has, per size and variant, the median and
the 20 / 80 % quantiles of the per-call time over rounds, and the medians (quantiles) of the
per-round ratios against ``sdpa`` and ``torch``.
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
import torch.nn.functional as Fn

import kvcert.dispatch as D
import kvcert.fast as F
from kvcert.kernels import cpu

B, H_Q, H_KV, DIM = 1, 9, 3, 64
OUT = Path(__file__).parent / "results" / "cpu_op.json"


def setup(n: int, seed: int = 0):
    """(q, keys, values, log_pi, mu, r2, mask) for n kept tokens, the cache tensors as views."""
    g = torch.Generator().manual_seed(seed)
    spare = n + max(64, n // 16)
    kb = torch.randn(B, H_KV, spare, DIM, generator=g)
    vb = torch.randn(B, H_KV, spare, DIM, generator=g)
    pb = torch.zeros(B, H_KV, spare)
    pi = torch.empty(B, H_KV, n).uniform_(0.05, 1.0, generator=g)
    pi[..., :4] = 1.0
    pi[..., -32:] = 1.0
    pb[..., :n] = pi.log()
    k, v, lp = kb[:, :, :n], vb[:, :, :n], pb[:, :, :n]
    q = torch.randn(B, H_Q, DIM, generator=g)
    mu, r2 = F.value_moments(v, log_pi=lp)
    mask = (-lp).repeat_interleave(H_Q // H_KV, 1)[:, :, None, :].contiguous()  # (b, h_q, 1, n)
    return q, k, v, lp, mu, r2, mask


def variants(n: int) -> dict:
    q, k, v, lp, mu, r2, mask = setup(n)
    kw = dict(log_pi=lp, per_coordinate=False, value_center=mu, validate=False)
    q4 = q[:, :, None]
    return {
        "op": lambda: cpu.hajek_attention(q, k, v, **kw),
        "dispatch_op": lambda: D.hajek_attention(q, k, v, value_sqdist=r2, backend="fast", **kw),
        "torch": lambda: F.hajek_attention(q, k, v, value_sqdist=r2, **kw),
        "sdpa": lambda: Fn.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True),
    }


def _quantiles(xs: list[float]) -> dict:
    qs = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return {"median": statistics.median(xs), "q20": qs[1], "q80": qs[7]}


def run(n: int, rounds: int, reps: int) -> dict:
    fns = variants(n)
    names = list(fns)
    for f in fns.values():  # warm-up (and the op's first-use build)
        for _ in range(3):
            f()
    times = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            f = fns[name]
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            times[name].append((time.perf_counter() - t0) / reps * 1e6)
    res = {k: _quantiles(v) for k, v in times.items()}
    for base in ("sdpa", "torch"):
        for name in names:
            if name != base:
                ratios = [a / b for a, b in zip(times[name], times[base])]
                res[f"{name}/{base}"] = _quantiles(ratios)
    return res


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if not cpu.available():
        raise SystemExit(f"the compiled CPU op is unavailable: {cpu.unavailable_reason()}")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "machine": platform.processor() or platform.machine(),
            "shape": {"b": B, "h_q": H_Q, "h_kv": H_KV, "d": DIM}, "rounds": args.rounds, "reps": args.reps,
            "unit": "microseconds per call"}
    results = {"meta": meta}
    for n in args.sizes:
        results[str(n)] = run(n, args.rounds, args.reps)
        r = results[str(n)]
        print(f"n={n}: " + ", ".join(f"{k} {r[k]['median']:.0f} us" for k in ("op", "dispatch_op", "torch", "sdpa"))
              + f"; op/sdpa {r['op/sdpa']['median']:.2f} ({r['op/sdpa']['q20']:.2f}-{r['op/sdpa']['q80']:.2f}),"
              f" dispatch_op/torch {r['dispatch_op/torch']['median']:.2f}", flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
