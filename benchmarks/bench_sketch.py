#!/usr/bin/env python
"""Decode cost of the cluster design's certificate against today's trace certificate, on CPU (issue 14).

Issue 14's line: "decode cost of output + certificate (sketch reads included) <= 1.5x today's
trace certificate on CPU at n >= 4k kept tokens (benchmark, not test)".

Setup per kept count n (default 4096 and 8192): the default model's attention shape (batch 1,
h_kv = 3 KV heads, g = 3 query heads per KV head, d = dv = 64), float32, one decode query per
query head. Each head's full cache holds 2n tokens (4 sinks and 32 recent tokens with pi = 1,
the rest pi ~ U(0.05, 1)); exactly n are kept (the certain ones and a random subset), packed
as a compressed cache with log pi beside it, and the value moments (``value_moments``: mu and
||v_i - mu||^2) are computed once, as the Hugging Face cache keeps them. The cluster sketch of
the n evicted tokens (``cluster_sketch``, default ``ClusterDesign()``: 16 clusters, gaussian
radius) is built once beforehand. None of this setup is timed.

Timed per decode step (``validate=False``, the per-step path of kvcert/attention.py):

- ``trace``: today's trace certificate: ``kvcert.fast.hajek_attention(q, K, V, log_pi=...,
  per_coordinate=False, value_center=mu, value_sqdist=r2)`` (the one-pass path: output, lse and
  the HT trace from one [a; c] x V matmul) and its Chebyshev radius sqrt(trace / delta);
- ``cluster``: the cluster design's decode step, ``kvcert.fast.sketch_hajek_attention`` with
  the same cache and moments: output, lse, trace, V_cl (which reads the sketch: C (2d + 3) + dv + 1
  elements per KV head) and its radius;
- ``cluster_v``: the same step with ``trace=False`` (output, lse, V_cl and its radius, no HT
  trace: the pass reads [a; c'] instead of [a; c; c']), the call the Hugging Face decode of
  ``PoissonPress(sketch=...)`` makes: the design as shipped;
- ``tilted_v``: the tilted design as shipped (``PoissonPress(sketch="tilted")``: 8 clusters,
  moments tilted at a window point q0, C (4d + 4) + d + dv + 1 elements per KV head, built once
  beforehand like the other sketch), ``trace=False``: the step in q - q0 reads two moment pairs per
  cluster instead of one;
- ``sdpa``: torch SDPA with ``enable_gqa=True`` and the bias -log pi as a float mask (the
  output alone; context, docs/design.md section 6's baseline).

The variants run round-robin (the order rotated every round) after a warm-up, so machine noise
hits them alike; per variant the median and 20/80 % quantiles of the per-call time, and the
median (and 20/80 % quantiles) of the per-round ratios cluster / trace and cluster_v / trace:
the issue's target is <= 1.5. Writes JSON (``--out``) and prints a markdown table.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/bench_sketch.py             # n = 4096, 8192; 200 rounds
    OMP_NUM_THREADS=2 python benchmarks/bench_sketch.py --quick     # 50 rounds
    python benchmarks/bench_sketch.py --smoke --out /tmp/s.json     # tiny sizes, 3 rounds: checks it runs

Timings on a shared 2-core machine are noisy: compare runs only when ``uptime`` shows it idle.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as Fn  # noqa: E402

import kvcert.fast as F  # noqa: E402
from conftest import MALLOPT  # noqa: E402  (glibc keeps freed memory, as for bench_cpu.py)

H_KV, G, D, DV, SINKS, WINDOW = 3, 3, 64, 64, 4, 32
DELTA = 0.05
TARGET = 1.5
#: PoissonPress(sketch="tilted")'s design
TILTED = F.ClusterDesign(clusters=8, radius="chebyshev", tilt=True)


def setup(n: int, *, seed: int = 0, clusters: int = 16):
    """The compressed cache of n kept tokens per KV head, its value moments, the sketch of the n
    evicted ones, and the decode query (untimed)."""
    g = torch.Generator().manual_seed(seed)
    full = 2 * n
    k = torch.randn(1, H_KV, full, D, generator=g)
    v = torch.randn(1, H_KV, full, DV, generator=g)
    pi = 0.05 + 0.95 * torch.rand(1, H_KV, full, generator=g)
    certain = torch.zeros(full, dtype=torch.bool)
    certain[:SINKS] = True
    certain[-WINDOW:] = True
    pi[..., certain] = 1.0
    keep = torch.zeros(1, H_KV, full, dtype=torch.bool)
    for h in range(H_KV):
        rest = torch.nonzero(~certain).squeeze(-1)
        pick = rest[torch.randperm(rest.numel(), generator=g)[: n - int(certain.sum())]]
        keep[0, h, certain] = True
        keep[0, h, pick] = True
    sketch = F.cluster_sketch(k, v, pi, keep, F.ClusterDesign(clusters=clusters))
    window = torch.randn(1, H_KV * G, WINDOW, D, generator=g)       # stands in for the observation window
    tilted = F.cluster_sketch(k, v, pi, keep, TILTED, tilt=F.window_tilt(window, H_KV))
    idx = torch.stack([torch.nonzero(keep[0, h]).squeeze(-1) for h in range(H_KV)])[None]   # (1, h_kv, n)
    K = torch.gather(k, 2, idx[..., None].expand(-1, -1, -1, D)).contiguous()
    V = torch.gather(v, 2, idx[..., None].expand(-1, -1, -1, DV)).contiguous()
    log_pi = torch.log(torch.gather(pi, 2, idx)).contiguous()
    mu, r2 = F.value_moments(V, log_pi=log_pi)
    q = torch.randn(1, H_KV * G, D, generator=g)
    mask = (-log_pi).repeat_interleave(G, dim=1)[:, :, None, :].contiguous()   # (b, h_q, 1, n), built once
    return dict(q=q, K=K, V=V, log_pi=log_pi, mu=mu, r2=r2, sketch=sketch, mask=mask, tilted=tilted)


def variants(c: dict) -> dict:
    q, K, V, lp, mu, r2, sk, mask = (c[x] for x in ("q", "K", "V", "log_pi", "mu", "r2", "sketch", "mask"))
    q4 = q[:, :, None]

    def trace():
        est = F.hajek_attention(q, K, V, log_pi=lp, per_coordinate=False, value_center=mu, value_sqdist=r2,
                                validate=False)
        return est, est.trace.div(DELTA).sqrt_()

    def cluster():
        return F.sketch_hajek_attention(q, K, V, None, sk, log_pi=lp, value_center=mu, value_sqdist=r2,
                                         delta=DELTA, validate=False)

    def cluster_v():
        return F.sketch_hajek_attention(q, K, V, None, sk, log_pi=lp, value_center=mu, value_sqdist=r2,
                                         delta=DELTA, validate=False, trace=False)

    def tilted_v():
        return F.sketch_hajek_attention(q, K, V, None, c["tilted"], log_pi=lp, value_center=mu, value_sqdist=r2,
                                         delta=DELTA, validate=False, trace=False)

    def sdpa():
        return Fn.scaled_dot_product_attention(q4, K, V, attn_mask=mask, enable_gqa=True)

    return {"trace": trace, "cluster": cluster, "cluster_v": cluster_v, "tilted_v": tilted_v, "sdpa": sdpa}


def check(c: dict, fns: dict) -> None:
    """The two certified paths give the same output and trace (so the timing compares like with like)."""
    est, _ = fns["trace"]()
    ce = fns["cluster"]()
    assert torch.allclose(est.output, ce.output, rtol=1e-4, atol=1e-5), "outputs differ"
    assert torch.allclose(est.trace, ce.estimate.trace, rtol=1e-3, atol=1e-9), "traces differ"
    assert bool(torch.isfinite(ce.variance).all() & torch.isfinite(ce.radius).all()), "V_cl not finite"
    cv = fns["cluster_v"]()
    assert torch.allclose(cv.output, ce.output, rtol=1e-5, atol=1e-6), "outputs differ (trace=False)"
    assert torch.allclose(cv.variance, ce.variance, rtol=1e-4), "V_cl differs (trace=False)"
    tv = fns["tilted_v"]()
    assert torch.allclose(tv.output, ce.output, rtol=1e-5, atol=1e-6), "outputs differ (tilted)"
    assert bool(torch.isfinite(tv.variance).all()), "tilted V_cl not finite"


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return statistics.median(xs), q[1], q[7]


def run(n: int, rounds: int, warmup: int) -> dict:
    c = setup(n)
    fns = variants(c)
    check(c, fns)
    names = list(fns)
    for _ in range(warmup):
        for f in fns.values():
            f()
    times = {k: [] for k in names}
    ratios, ratios_v, ratios_t = [], [], []
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        this = {}
        for name in order:
            t = time.perf_counter_ns()
            fns[name]()
            this[name] = (time.perf_counter_ns() - t) / 1e3
        for k, x in this.items():
            times[k].append(x)
        ratios.append(this["cluster"] / this["trace"])
        ratios_v.append(this["cluster_v"] / this["trace"])
        ratios_t.append(this["tilted_v"] / this["trace"])
    row = {"n": n, "rounds": rounds}
    for k in names:
        med, lo, hi = quantiles(times[k])
        row[f"{k}_us"], row[f"{k}_us_q20"], row[f"{k}_us_q80"] = med, lo, hi
    med, lo, hi = quantiles(ratios)
    row["ratio_cluster_trace"], row["ratio_q20"], row["ratio_q80"] = med, lo, hi
    row["ratio_of_medians"] = row["cluster_us"] / row["trace_us"]
    med, lo, hi = quantiles(ratios_v)
    row["ratio_cluster_v_trace"], row["ratio_v_q20"], row["ratio_v_q80"] = med, lo, hi
    med, lo, hi = quantiles(ratios_t)
    row["ratio_tilted_v_trace"], row["ratio_t_q20"], row["ratio_t_q80"] = med, lo, hi
    row["sketch_elements_per_head"] = F.ClusterDesign().elements(D, DV)
    row["tilted_elements_per_head"] = TILTED.elements(D, DV)
    row["kv_bytes"] = 2 * H_KV * n * D * 4
    return row


def table(rows: list[dict]) -> str:
    head = ("| kept n | trace (us) | cluster (us) | cluster, no HT trace (us) | tilted, no HT trace (us) | sdpa (us) "
            "| cluster / trace (median of rounds, q20-q80) | no HT trace / trace | tilted / trace | target |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['n']} | {r['trace_us']:.1f} | {r['cluster_us']:.1f} | {r['cluster_v_us']:.1f} "
                     f"| {r['tilted_v_us']:.1f} | {r['sdpa_us']:.1f} "
                     f"| {r['ratio_cluster_trace']:.3f} ({r['ratio_q20']:.3f}-{r['ratio_q80']:.3f}) "
                     f"| {r['ratio_cluster_v_trace']:.3f} ({r['ratio_v_q20']:.3f}-{r['ratio_v_q80']:.3f}) "
                     f"| {r['ratio_tilted_v_trace']:.3f} ({r['ratio_t_q20']:.3f}-{r['ratio_t_q80']:.3f}) "
                     f"| <= {TARGET} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4096,8192", help="kept tokens per KV head, comma separated")
    p.add_argument("--rounds", type=int, default=200, help="timed rounds (each runs every variant once)")
    p.add_argument("--warmup", type=int, default=20, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--quick", action="store_true", help="50 rounds, 10 warm-up rounds")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes (n = 64, 256), 3 rounds, 1 warm-up: checks the script runs; writes JSON "
                        "only to an explicit --out")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default benchmarks/results/sketch_decode.json; none with --smoke)")
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    rounds, warmup = args.rounds, args.warmup
    if args.quick:
        rounds, warmup = 50, 10
    if args.smoke:
        sizes, rounds, warmup = [64, 256], 3, 1
    out = args.out if (args.out is not None or args.smoke) else ROOT / "benchmarks" / "results" / "sketch_decode.json"
    torch.set_num_threads(args.threads)
    rows = [run(n, rounds, warmup) for n in sizes]
    print(table(rows))
    if out is not None:
        result = {
            "what": "decode cost per step: sketch_hajek_attention (with and without the HT trace; the tilted "
                    "sketch without it) vs hajek_attention trace-only (one pass)",
            "target": f"cluster / trace <= {TARGET} at n >= 4096",
            "shape": {"b": 1, "h_kv": H_KV, "g": G, "d": D, "dv": DV, "dtype": "float32", "clusters": 16},
            "rows": rows,
            "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "mallopt_keep_freed_memory": MALLOPT,
                     "python": platform.python_version(), "machine": platform.machine(),
                     "load_average": os.getloadavg(), "smoke": bool(args.smoke), "quick": bool(args.quick)},
        }
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
