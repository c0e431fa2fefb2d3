"""benchmarks/gpu_check.py's eviction section (the eviction event of one layer against its prefill attention) at
tiny sizes on the CPU, where the GPU run times it at 4k-32k tokens; and its checks of what the timed steps
produce, with a negative control. The whole dry run is tests/test_kernels_onepass.py's."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _layer(n, h_q=4, h_kv=2, d=16, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=gen, device=DEVICE).to(torch.bfloat16) for h in (h_q, h_kv, h_kv))


def test_eviction_section_at_tiny_sizes(gpu_check):
    """run_eviction at n = 150 (not a multiple of the block size): every step timed beside the prefill, the
    checks pass, the ratios and the top-level target are recorded."""
    from gpu_decode import Clock

    report = {"eviction": [], "skipped": []}
    cfg = dict(h_q=4, h_kv=2, d=16, block_size=16, eviction_n=[150])
    triton = None if DEVICE == "cpu" else pytest.importorskip("triton")  # do_bench on a GPU, wall-clock here
    bench = gpu_check.make_bench(torch, triton, DEVICE, 1.0, 1.0)
    gpu_check.run_eviction(report, torch, DEVICE, cfg, bench, Clock(600.0), lambda: None)
    assert report["skipped"] == [] and len(report["eviction"]) == 1
    row = report["eviction"][0]
    assert set(row["results"]) == {"score", "decide", "compact", "sketch", "event", "prefill_sdpa"}
    for name, r in row["results"].items():
        assert r["median_ms"] > 0 and r["q20_ms"] <= r["q80_ms"], (name, r)
    assert row["checks"]["ok"], row["checks"]
    assert row["m_blocks"] == math.ceil(max(row["kept"]) / 16)
    res = row["results"]
    assert row["event_over_prefill"] == res["event"]["median_ms"] / res["prefill_sdpa"]["median_ms"]
    assert gpu_check.targets(report)["eviction_over_prefill_max"] == row["event_over_prefill"]


def test_eviction_checks_reject_wrong_results(gpu_check):
    """Negative control of the section's checks: the right decision and compaction pass; compacted keys off by
    one slot, a compaction of another decision, and a sample with two more tokens than a systematic sample
    keeps each fail the check they concern."""
    design = gpu_check.eviction_design()
    n = 150
    q, k, v = _layer(n, seed=3)
    window = q[:, :, -design.queries_read(n, n):]
    budget = design.sampled_budget(n, 16, 16)
    dec = design.decide(design.score(window, k, v)[0], budget=budget)
    comp, kc, _ = gpu_check.compact_kv(torch, k, v, dec, 16)
    assert gpu_check.eviction_checks(torch, k, dec, comp, kc, budget)["ok"]

    shifted = torch.roll(kc, 1, dims=1)  # the gather one slot off
    bad = gpu_check.eviction_checks(torch, k, dec, comp, shifted, budget)
    assert not bad["slots_hold_kept_tokens"] and not bad["ok"]

    other = design.decide(design.score(window, k, v)[0], budget=budget, event=1)  # another draw
    assert not torch.equal(other.keep, dec.keep)
    comp2, kc2, _ = gpu_check.compact_kv(torch, k, v, other, 16)
    bad = gpu_check.eviction_checks(torch, k, dec, comp2, kc2, budget)
    assert not bad["slots_hold_kept_tokens"] and not bad["ok"]

    keep = dec.keep.clone()
    evicted = torch.nonzero(~keep[0]).flatten()[:2]
    keep[0, evicted] = True  # two more tokens on head 0 than floor / ceil of sum pi
    more = dataclasses.replace(dec, keep=keep)
    comp3, kc3, _ = gpu_check.compact_kv(torch, k, v, more, 16)
    bad = gpu_check.eviction_checks(torch, k, more, comp3, kc3, budget)
    assert not bad["systematic_counts"] and bad["slots_hold_kept_tokens"] and not bad["ok"]
