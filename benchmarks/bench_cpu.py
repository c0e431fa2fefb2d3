"""CPU benchmarks of kvcert.fast (pytest-benchmark; not part of the default test run).

Run (about 3-4 minutes on 2 cores):

    python -m pytest benchmarks/bench_cpu.py --benchmark-only -p no:randomly \
        --benchmark-json=benchmarks/results/cpu.json

Setups (docs/design.md section 6, issue 3):

- decode: b=4, h_q=32, h_kv=8, d=dv=128, fp32, kept n in {1k, 4k, 16k}; pi with
  4 sinks and 32 recent tokens certain, the rest in [0.05, 1). Baseline: torch
  SDPA with enable_gqa=True and the bias -log pi as a float attn_mask (its
  fastest form with a bias; the mask is built once, outside the timing).
  Ours: certified attention = hajek_attention + certificate, (a) with the
  per-coordinate variance (wald), (b) trace only (per_coordinate=False,
  chebyshev), (c) trace only with the value moments kept in the cache
  (value_center/value_sqdist, computed once outside the timing), (d) the
  strict kind chebyshev_ucb (trace plus the tail moment,
  return_tail_moment=True: one more reduction after o_hat).
- eviction: the same heads with a full cache of n tokens evicted to budget
  n/2: ours = inclusion_probabilities + poisson_sample + compaction
  (kvcert.fast.evict); baseline = torch.topk on the importance + sort of the
  indices + one index_select of the K and V rows (the fastest top-k
  eviction we found); also reported: the literal torch.gather form and
  kvcert.fast.topk_evict (top-k with the sinks/window certainty set).
- memory: peak resident-memory increase of one eviction (fresh subprocess;
  VmHWM reset through /proc/self/clear_refs, Linux) relative to the K+V
  cache size, with and without the output cache itself.

Every timing test records its median; the ``*_ratios`` tests time the
variants round-robin in one loop (so machine noise hits them alike) and
store the medians of the per-round ratios in ``extra_info`` and in
``benchmarks/results/cpu_ratios.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as Fn

import kvcert.fast as F

B, H_Q, H_KV, D = 4, 32, 8, 128
SIZES = [1024, 4096, 16384]
RESULTS = Path(os.environ.get("KVCERT_BENCH_RATIOS", str(Path(__file__).parent / "results" / "cpu_ratios.json")))
_ratios: dict = {}


def _decode_setup(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_Q, D, generator=g)
    k = torch.randn(B, H_KV, n, D, generator=g)
    v = torch.randn(B, H_KV, n, D, generator=g)
    pi = 0.05 + 0.95 * torch.rand(B, H_KV, n, generator=g)
    pi[..., :4] = 1.0
    pi[..., -32:] = 1.0
    mask = (-torch.log(pi)).repeat_interleave(H_Q // H_KV, dim=1)[:, :, None, :]  # (b, h_q, 1, n)
    mu, r2 = F.value_moments(v, pi)
    return q, k, v, pi, mask, mu, r2


def _decode_variants(n: int):
    q, k, v, pi, mask, mu, r2 = _decode_setup(n)
    q4 = q[:, :, None]
    return {
        "sdpa_bias": lambda: Fn.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True),
        "sdpa_nomask": lambda: Fn.scaled_dot_product_attention(q4, k, v, enable_gqa=True),
        "certified_variance": lambda: F.certificate(F.hajek_attention(q, k, v, pi), kind="wald"),
        "certified_trace": lambda: F.certificate(F.hajek_attention(q, k, v, pi, per_coordinate=False)),
        "certified_trace_cached": lambda: F.certificate(
            F.hajek_attention(q, k, v, pi, per_coordinate=False, value_center=mu, value_sqdist=r2)),
        "certified_ucb": lambda: F.certificate(
            F.hajek_attention(q, k, v, pi, per_coordinate=False, return_tail_moment=True), kind="chebyshev_ucb"),
    }


def _evict_setup(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_KV, n, D, generator=g)
    v = torch.randn(B, H_KV, n, D, generator=g)
    imp = torch.rand(B, H_KV, n, generator=g)
    return k, v, imp


def topk_gather(k, v, imp, budget: int):
    """Top-k eviction, literal form: topk + sort (keep position order) + torch.gather of K and V."""
    idx = torch.topk(imp, budget, dim=-1, sorted=False).indices.sort(dim=-1).values
    gi = idx[..., None].expand(-1, -1, -1, k.shape[-1])
    return torch.gather(k, 2, gi), torch.gather(v, 2, gi), idx


def topk_index_select(k, v, imp, budget: int):
    """Top-k eviction, fastest form (the baseline): topk + sort + one index_select of the rows."""
    b, h, n, d = k.shape
    idx = torch.topk(imp, budget, dim=-1, sorted=False).indices.sort(dim=-1).values
    flat = (idx + torch.arange(b * h, device=k.device).view(b, h, 1) * n).reshape(-1)
    return (k.reshape(-1, d).index_select(0, flat).view(b, h, budget, d),
            v.reshape(-1, v.shape[-1]).index_select(0, flat).view(b, h, budget, v.shape[-1]), idx)


def _evict_variants(n: int):
    k, v, imp = _evict_setup(n)
    budget = n // 2
    return {
        "topk_index_select": lambda: topk_index_select(k, v, imp, budget),
        "topk_gather": lambda: topk_gather(k, v, imp, budget),
        "poisson_evict": lambda: F.evict(k, v, imp, float(budget), seed=0),
        "topk_evict": lambda: F.topk_evict(k, v, imp, budget),
    }


def _round_robin(fns: dict, rounds: int, baseline: str) -> dict:
    for f in fns.values():  # warm-up
        f()
        f()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, ts in times.items():
        ratio = [a / b for a, b in zip(ts, times[baseline])]
        out[name] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts),
                     "ratio_median": statistics.median(ratio), "ratio_q20_q80": [
                         statistics.quantiles(ratio, n=5)[0], statistics.quantiles(ratio, n=5)[3]]}
    return out


def _store(key: str, value) -> None:
    _ratios[key] = value
    from conftest import MALLOPT

    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "mallopt_keep_freed_memory": MALLOPT, "load_average_at_write": os.getloadavg(),
            "setup": {"b": B, "h_q": H_Q, "h_kv": H_KV, "d": D, "dtype": "float32"}}
    RESULTS.write_text(json.dumps({"meta": meta, **_ratios}, indent=1))


ROUNDS = {1024: 30, 4096: 15, 16384: 6}


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("variant", ["sdpa_bias", "certified_variance", "certified_trace", "certified_trace_cached"])
def test_decode(benchmark, n, variant):
    benchmark.group = f"decode n={n}"
    f = _decode_variants(n)[variant]
    benchmark.pedantic(f, rounds=ROUNDS[n], iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("n", SIZES)
def test_decode_ratios(benchmark, n):
    benchmark.group = "ratios"
    res = {}
    benchmark.pedantic(lambda: res.update(_round_robin(_decode_variants(n), 2 * ROUNDS[n], "sdpa_bias")),
                       rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    _store(f"decode_n{n}", res)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("variant", ["topk_index_select", "topk_gather", "poisson_evict"])
def test_evict(benchmark, n, variant):
    benchmark.group = f"evict n={n}"
    f = _evict_variants(n)[variant]
    benchmark.pedantic(f, rounds=ROUNDS[n], iterations=1, warmup_rounds=2)


@pytest.mark.parametrize("n", SIZES)
def test_evict_ratios(benchmark, n):
    benchmark.group = "ratios"
    res = {}
    benchmark.pedantic(lambda: res.update(_round_robin(_evict_variants(n), 2 * ROUNDS[n], "topk_index_select")),
                       rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    _store(f"evict_n{n}", res)


_MEMORY_SCRIPT = r"""
import sys, torch, kvcert.fast as F
sys.path.insert(0, {bench_dir!r})
from bench_cpu import _evict_setup, topk_index_select

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
n, which = {n}, {which!r}
k, v, imp = _evict_setup(n)
small_k, small_v, small_imp = _evict_setup(64)
F.evict(small_k, small_v, small_imp, 32.0, seed=0, sinks=2, window=4)
topk_index_select(small_k, small_v, small_imp, 32)
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
out = F.evict(k, v, imp, float(n // 2), seed=0) if which == "poisson" else topk_index_select(k, v, imp, n // 2)
peak = status("VmHWM:")
out_bytes = out.keys.nbytes + out.values.nbytes if which == "poisson" else out[0].nbytes + out[1].nbytes
print(peak - before, k.nbytes + v.nbytes, out_bytes)
"""


@pytest.mark.parametrize("n", SIZES)
def test_evict_peak_memory(benchmark, n):
    """Peak RSS increase of one eviction / K+V cache bytes (output included; the output alone is ~0.5)."""
    benchmark.group = "memory"
    res = {}

    def measure():
        for which in ("poisson", "topk"):
            code = _MEMORY_SCRIPT.format(bench_dir=str(Path(__file__).parent), n=n, which=which)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            peak, cache, kept = (int(x) for x in out.split())
            res[which] = {"peak_bytes": peak, "cache_bytes": cache, "output_bytes": kept,
                          "peak_over_cache": peak / cache, "extra_over_cache": (peak - kept) / cache}

    benchmark.pedantic(measure, rounds=1, iterations=1)
    benchmark.extra_info.update(res)
    _store(f"memory_n{n}", res)
