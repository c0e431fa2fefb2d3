"""One certified decode step over a quantized cache (8 and 4 bits) against the 16-bit one, at the same kept count.

    .venv/bin/python benchmarks/bench_quantized_decode.py        # writes benchmarks/results/quantized_decode.json
    .venv/bin/python benchmarks/bench_quantized_decode.py --sizes 2048 --rounds 10 --out /tmp/x.json

Setup: n kept tokens per KV head (4 sinks and 32 recent ones with pi = 1, the rest pi ~ U(0.05, 1)), one query,
float32, at two attention shapes: SmolLM2-135M's (b = 1, h_q = 9, h_kv = 3, d = dv = 64) and an 8B model's
(b = 1, h_q = 32, h_kv = 8, d = dv = 128). Variants, each returning the output and what its certificate needs:

- ``q8``: :func:`kvcert.kernels.cpu.quantized_hajek_attention` on int8 codes, keys per channel and group of 32
  tokens, values per token, float16 scales (``kvcert.fast.store_kv``, the "channel" layout the press stores),
  ``combined=True`` (the decode's call): output, log Z and trace + V_q in one pass, dequantizing in the tile loop;
- ``q8_split``: the same with the trace and V_q apart (a third accumulator);
- ``q4``: ``q8`` on int4 codes (one code per byte, as stored: the same bytes as ``q8``);
- ``bf16``, ``f32``: :func:`kvcert.kernels.cpu.hajek_attention` on bfloat16 / float32 K and V (the 16-bit
  certified decode step, and the float32 cache the Hugging Face path holds), with the value centre;
- ``torch8``: what ``kvcert.fast.quantized_decode`` runs without the op (``KVCERT_CPU_OP=0``): dequantize,
  ``kvcert.fast.hajek_attention`` and ``kvcert.fast.held_rounding_terms`` (its B_q and V_q).

Rounds are interleaved (each round times every variant over ``--reps`` calls, in a rotating order), so load on
the machine hits the variants alike; per shape, size and variant the JSON has the median and the 20 / 80 %
quantiles of the per-call time over rounds, and of the per-round ratios ``q8/bf16``, ``q8/f32``,
``q8_split/bf16``, ``q4/bf16``, ``torch8/q8``; the bytes of K and V each reads per step (codes and scales)
beside them. ``run_info`` records the command, date, commit, threads and the load average (the machine is
shared); ``torch8`` runs a quarter of ``--reps`` per round (it is ~30-60x slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kvcert.fast as F  # noqa: E402
from benchmarks.runinfo import run_info  # noqa: E402
from kvcert.kernels import cpu  # noqa: E402

SHAPES = {"smollm2": (1, 9, 3, 64), "8b": (1, 32, 8, 128)}
OUT = Path(__file__).parent / "results" / "quantized_decode.json"
RATIOS = (("q8", "bf16"), ("q8", "f32"), ("q8_split", "bf16"), ("q4", "bf16"), ("torch8", "q8"))


def setup(shape: tuple, n: int, seed: int = 0):
    """(q, keys, values, log_pi (float32), stored at 8 bits, stored at 4 bits) for n kept tokens."""
    b, h_q, h_kv, d = shape
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h_kv, n, d, generator=g)
    v = torch.randn(b, h_kv, n, d, generator=g)
    pi = torch.empty(b, h_kv, n).uniform_(0.05, 1.0, generator=g)
    pi[..., :4] = 1.0
    pi[..., -32:] = 1.0
    lp = pi.log()
    pos = torch.arange(n).expand(b, h_kv, n).contiguous()
    q = torch.randn(b, h_q, d, generator=g)
    st = {bits: F.store_kv(k, v, lp.double(), pos, kv_bits=bits, layout="channel", rounding="stochastic", seed=1)
          for bits in (8, 4)}
    return q, k, v, lp, st


def _nbytes(*xs) -> int:
    return sum(x.numel() * x.element_size() for x in xs)


def variants(shape: tuple, n: int) -> tuple[dict, dict]:
    """The timed callables and the bytes of K and V each reads per step."""
    q, k, v, lp, st = setup(shape, n)
    mu = F.value_moments(v, log_pi=lp)[0]
    kb, vb = k.bfloat16(), v.bfloat16()
    kw = dict(log_pi=lp, per_coordinate=False, value_center=mu, validate=False)

    def quant(s, combined=True):
        args = (s.keys.codes, s.keys.scales, s.values.codes, s.values.scales, lp)
        return lambda: cpu.quantized_hajek_attention(q, *args, layout="channel", combined=combined, validate=False)

    def torch8():
        kk, vv = st[8].dequantize(torch.float32)
        est = F.hajek_attention(q, kk, vv, log_pi=lp, per_coordinate=False)
        return est, F.held_rounding_terms(q, st[8])

    fns = {"q8": quant(st[8]), "q8_split": quant(st[8], combined=False), "q4": quant(st[4]), "bf16": lambda: cpu.hajek_attention(q, kb, vb, **kw),
           "f32": lambda: cpu.hajek_attention(q, k, v, **kw), "torch8": torch8}
    s8 = st[8]
    code_bytes = _nbytes(s8.keys.codes, s8.keys.scales, s8.values.codes, s8.values.scales)
    nbytes = {"q8": code_bytes, "q8_split": code_bytes, "q4": code_bytes, "bf16": _nbytes(kb, vb), "f32": _nbytes(k, v),
              "torch8": code_bytes}
    return fns, nbytes


def _quantiles(xs: list[float]) -> dict:
    qs = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
    return {"median": statistics.median(xs), "q20": qs[1], "q80": qs[7]}


def run(shape: tuple, n: int, rounds: int, reps: int) -> dict:
    fns, nbytes = variants(shape, n)
    names = list(fns)
    for f in fns.values():  # warm-up
        for _ in range(3):
            f()
    times = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            f = fns[name]
            calls = reps if name != "torch8" else max(1, reps // 4)
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            times[name].append((time.perf_counter() - t0) / calls * 1e6)
    res = {k: dict(_quantiles(v), bytes=nbytes[k]) for k, v in times.items()}
    for a, b in RATIOS:
        res[f"{a}/{b}"] = _quantiles([x / y for x, y in zip(times[a], times[b])])
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu.available():
        raise SystemExit(f"the compiled CPU op is unavailable: {cpu.unavailable_reason()}")
    results = {"meta": run_info("bench_quantized_decode.py", argv, threads=args.threads,
                                note="2 CPU cores shared with other jobs: the load average is recorded"),
               "rounds": args.rounds, "reps": args.reps, "unit": "microseconds per call",
               "shapes": {s: dict(zip(("b", "h_q", "h_kv", "d"), SHAPES[s])) for s in args.shapes}}
    for s in args.shapes:
        for n in args.sizes:
            r = results[f"{s}/{n}"] = run(SHAPES[s], n, args.rounds, args.reps)
            print(f"{s} n={n}: " + ", ".join(f"{k} {r[k]['median']:.0f} us" for k in fns_order(r))
                  + "; " + ", ".join(f"{a}/{b} {r[f'{a}/{b}']['median']:.2f}" for a, b in RATIOS), flush=True)
    results["meta"]["loadavg_end"] = os.getloadavg()
    args.out.write_text(json.dumps(results, indent=1))
    return results


def fns_order(r: dict) -> list[str]:
    return [k for k in ("q8", "q8_split", "q4", "bf16", "f32", "torch8") if k in r]


if __name__ == "__main__":
    main()
