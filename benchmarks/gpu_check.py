#!/usr/bin/env python
"""The prepared GPU check of the fused decode kernel and its one-pass certificate: one script, one JSON.

Written for a GPU session with 15 minutes of device time: it finishes in under 8 minutes on one
H100 or H200 (``--budget-s``, default 420 s, stops starting new work) and writes one JSON
(``--out``; default ``$OUT/gpu_check.json`` when ``OUT`` is set, else
``benchmarks/results/gpu_check.json``; ``gpu_check_dry.json`` for ``--dry-run``), flushed after
every part, so a failure or a timeout keeps what ran. Each part is wrapped: an error is recorded
in the JSON (``errors``) and the next part runs.

1. ``environment``: the card, driver, CUDA, torch and Triton versions, SM count, memory.
2. ``copy_bandwidth``: a device-to-device copy of 1 GiB timed by ``triton.testing.do_bench``
   (bytes read + written per second): the measured peak every roofline fraction below refers to.
3. ``correctness``: b in {1, 8}, kept n in {1000, 16384}, bfloat16 and float32, h_q 32, h_kv 8,
   d 128 (``gpu_decode.make_cache``: sinks and a window with pi = 1, ragged padding), every
   moments mode, the variance and the trace-only path: per field the kernel's per-head relative
   error against a float64 torch oracle (``gpu_decode.oracle64``) beside ``kvcert.fast``'s, with
   ``ok`` = kernel error <= 2 x fast's + 4 eps of the field (+ eps of the input dtype for the
   variance of half inputs): ``gpu_decode``'s rule. The derived bound of the one-pass mode is
   checked by ``tests/test_kernels_onepass.py``, which runs on the GPU too (command in docs/gpu.md).
4. ``timings``: b in {1, 8, 32} x kept n in {4k, 16k, 64k}, bfloat16, h_q 32, h_kv 8, d 128,
   ``do_bench`` median and 20/80 % quantiles (ms, L2 flushed) of
   - ``<mode>_trace`` / ``<mode>_var``: the kernel with the certificate (trace only, or the
     per-coordinate variance) for each moments mode, ``<mode>_nocert``: the same kernel without it
     (``certify=False``; its tiles, so the ratio is the certificate's cost alone),
   - ``sdpa_mask[<backend>]``: torch SDPA with ``enable_gqa=True`` and the bias -log pi (-inf on
     padding) as a float mask over the same kept tokens, per backend and ``auto``;
     ``sdpa_nomask[...]`` without the mask, for scale,
   - ``flashinfer_decode``: FlashInfer's batch decode over the same K/V (no bias) when it imports,
   with GB/s (bytes of K, V and log pi) and the fraction of the measured copy bandwidth.
5. ``sweep``: block_n x warps of the one-pass kernel (trace and variance) in three cells.
6. ``eviction``: the eviction event of one layer at prefill on the device, b = 1, n in {4k, 8k, 16k,
   32k} prompt tokens (bfloat16, h_q 32, h_kv 8, d 128), the recommended design
   (``kvcert.fast.TokenDesign`` with the tilted sketch, its radius and systematic sampling, compression
   0.5), each step timed by ``do_bench`` beside the same layer's prefill attention (torch SDPA, causal,
   ``enable_gqa=True``): ``score`` (the design's scorer over the observation window),
   ``decide`` (the inclusion probabilities and the systematic sample, ``TokenDesign.decide``),
   ``compact`` (``kvcert.fast.compact_slots`` and the gather of the kept K and V into the compacted
   slots of blocks of 16), ``sketch`` (``TokenDesign.sketch_of``: the k-means and the cluster sums of
   the evicted tokens), ``event`` (the four in one call) and ``prefill_sdpa``; ``event_over_prefill``
   = event / prefill (target <= 0.10), ``parts_over_prefill`` per step, and ``checks`` (kept counts of
   a systematic sample, the compacted slots holding the kept tokens in order).
7. ``compiled``: registers and spills of every compiled variant (``n_regs`` / ``n_spills`` of
   Triton's compiled kernels, where this Triton exposes them).
8. ``targets`` (top level): ``card``; ``certified_over_uncertified_max`` (the largest certified /
   uncertified time ratio measured, of ``headline``: the one-pass trace path) and
   ``certified_vs_sdpa_min_4k`` (the smallest fastest-SDPA time / certified time, i.e. throughput
   ratio, at kept n >= 4k), each also per variant (``by_variant``); ``eviction_over_prefill_max`` (the
   largest event / prefill time ratio over the eviction sizes); and the targets of docs/design.md
   section 6 they are read against (certificate <= 1.10x, >= 0.9x SDPA, >= 0.75 of the copy
   bandwidth at n >= 16k, eviction <= 0.10 of the prefill).

Usage::

    python benchmarks/gpu_check.py --out $OUT/gpu_check.json   # one H100/H200, < 8 min
    python benchmarks/gpu_check.py --dry-run                    # tiny sizes; without CUDA on the
                                                                # Triton interpreter (seconds)

Without CUDA (``--device cpu``, or none visible) it runs only with ``--dry-run``: TRITON_INTERPRET=1
is set before Triton is imported, timings are wall-clock and mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

#: the moments modes checked and timed, and the variant of the headline targets
MODES = ("onepass", "exact", "shifted")
HEADLINE = "onepass_trace"
FIELDS = ("output", "lse", "variance", "trace", "n_eff")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda if available, else cpu (Triton interpreter, --dry-run only)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes and short timings: every code path, seconds")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output (default $OUT/gpu_check.json, else benchmarks/results/gpu_check.json; "
                        "gpu_check_dry.json for --dry-run)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting new work after this many seconds (the JSON keeps what ran)")
    p.add_argument("--batch", type=int, nargs="+", default=None, help="timing batch sizes (default 1 8 32)")
    p.add_argument("--kept", type=int, nargs="+", default=None, help="timing kept tokens (default 4096 16384 65536)")
    p.add_argument("--no-sweep", action="store_true", help="skip the block_n x warps sweep")
    p.add_argument("--eviction-n", type=int, nargs="+", default=None,
                   help="prompt tokens of the eviction event (default 4096 8192 16384 32768)")
    p.add_argument("--no-eviction", action="store_true", help="skip the eviction event against the prefill")
    return p.parse_args(argv)


def default_out(dry: bool) -> Path:
    name = "gpu_check_dry.json" if dry else "gpu_check.json"
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else ROOT / "benchmarks" / "results" / name


def main(argv=None):
    args = parse_args(argv)
    device = args.device
    from gpu_decode import Clock, _cuda_available, resolve_device, write_report

    if device is None:
        device = "cuda" if _cuda_available() else "cpu"
    if device == "cpu" and not args.dry_run:
        raise SystemExit("gpu_check.py: without CUDA only --dry-run runs (the Triton interpreter's timings "
                         "mean nothing): python benchmarks/gpu_check.py --dry-run")
    device, torch, triton, KN = resolve_device(device)
    dry = args.dry_run
    cfg = dict(
        correctness=[(2, 2, 2, 100, 16)] if dry else
        [(b, 8, 4, n, 128) for b in (1, 8) for n in (1000, 16384)],
        batch=args.batch or ([1] if dry else [1, 8, 32]),
        kept=args.kept or ([64] if dry else [4096, 16384, 65536]),
        h_q=4 if dry else 32, h_kv=2 if dry else 8, d=16 if dry else 128,
        warmup_ms=1.0 if dry else 25.0, rep_ms=1.0 if dry else 100.0,
        copy_bytes=(1 << 20) if dry else (1 << 30),
        dtype="bfloat16", modes=list(MODES), budget_s=args.budget_s,
        # the kept lengths the SDPA and copy-bandwidth targets are read at (all of them in a dry run)
        sdpa_min_n=0 if dry else 4096, copy_min_n=0 if dry else 16384,
        # the eviction event: prompt lengths, the paged engine's block size
        eviction_n=args.eviction_n or ([200] if dry else [4096, 8192, 16384, 32768]), block_size=16,
    )
    out_path = args.out or default_out(dry)
    clock = Clock(args.budget_s)
    report = {
        "benchmark": "kvcert.kernels.hajek_attention decode: one-pass certificate check",
        "dry_run": dry, "device": device, "measured_on_gpu": device == "cuda" and not dry,
        "note": ("timings on the CPU interpreter are wall-clock and meaningless" if device == "cpu" else
                 "do_bench medians with L2 flushed; bytes = K + V + log pi (float32); roofline = GB/s / "
                 "the measured copy bandwidth"),
        "command": " ".join(["python", "benchmarks/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "git_commit": _git("rev-parse", "--short", "HEAD"), "config": cfg, "environment": {},
        "copy_bandwidth": {}, "correctness": [], "timings": [], "sweep": [], "eviction": [], "compiled": [],
        "targets": {},
        "skipped": [], "errors": [],
    }

    def part(name, fn):
        """Run one part: print progress, record an exception instead of raising, flush the JSON."""
        t0 = time.perf_counter()
        print(f"[gpu_check {clock.elapsed():6.1f}s] {name} ...", flush=True)
        try:
            fn()
        except Exception as e:  # one failure must not lose the rest
            report["errors"].append({"part": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"[gpu_check] {name} failed: {type(e).__name__}: {e}"[:500], flush=True)
        report["targets"] = targets(report)
        report["elapsed_s"] = round(clock.elapsed(), 2)
        write_report(report, out_path)
        print(f"[gpu_check {clock.elapsed():6.1f}s] {name} done in {time.perf_counter() - t0:.1f}s", flush=True)

    part("environment", lambda: report.update(environment=environment(torch, triton, device)))
    bench = make_bench(torch, triton, device, cfg["warmup_ms"], cfg["rep_ms"])
    part("copy_bandwidth", lambda: report.update(copy_bandwidth=copy_bandwidth(torch, bench, device,
                                                                                 cfg["copy_bytes"])))
    part("correctness", lambda: run_correctness(report, torch, KN, device, cfg, clock))
    part("timings", lambda: run_timings(report, torch, KN, device, cfg, bench, clock,
                                        lambda: write_report(report, out_path)))
    if not args.no_sweep:
        part("sweep", lambda: run_sweep(report, torch, KN, device, cfg, bench, clock, dry))
    if not args.no_eviction:
        part("eviction", lambda: run_eviction(report, torch, device, cfg, bench, clock,
                                              lambda: write_report(report, out_path)))
    part("compiled", lambda: report.update(compiled=compiled_kernels(KN)))
    report["summary"] = {"errors": len(report["errors"]), "skipped": len(report["skipped"]),
                         "correctness_ok": (all(r.get("ok", False) for r in report["correctness"])
                                            if report["correctness"] else None),
                         "timing_cells": len(report["timings"]), "targets": report["targets"]}
    write_report(report, out_path)
    print(json.dumps(report["summary"], indent=2, default=str))
    print(f"wrote {out_path} in {report['elapsed_s']} s")
    return report


def _git(*a):
    try:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return None


# ----------------------------------------------------------------------------- environment and the peak

def environment(torch, triton, device):
    from gpu_decode import environment as base

    env = base(torch, triton, device)
    if device == "cuda":
        env["driver"] = _driver()
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return env


def _driver():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else None
    except Exception:
        return None


def make_bench(torch, triton, device, warmup_ms, rep_ms):
    from gpu_decode import make_timer

    return make_timer(torch, triton, device, warmup_ms, rep_ms)


def copy_bandwidth(torch, bench, device, nbytes):
    """GB/s of ``dst.copy_(src)`` over ``nbytes`` (read + written), the measured peak."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    med, q20, q80 = bench(lambda: dst.copy_(src))
    del src, dst
    _free(torch, device)
    return {"bytes": nbytes, "median_ms": med, "q20_ms": q20, "q80_ms": q80, "gbps": 2 * nbytes / (med * 1e-3) / 1e9}


def _peak(report):
    return report.get("copy_bandwidth", {}).get("gbps")


# ----------------------------------------------------------------------------- correctness

def run_correctness(report, torch, KN, device, cfg, clock):
    import kvcert.fast as fast
    from gpu_decode import make_cache, oracle64, rel_err

    for (b, h_kv, g, n, d) in cfg["correctness"]:
        for dtype in (torch.bfloat16, torch.float32):
            if clock.out_of_time():
                report["skipped"].append(f"correctness b={b} n={n} {dtype}: time budget")
                continue
            q, k, v, pi = make_cache(torch, b, h_kv, g, n, d, dtype, device, seed=n + b)
            ref = {f: torch.cat([oracle64(torch, q[i:i + 1], k[i:i + 1], v[i:i + 1], pi[i:i + 1])[f]
                                 for i in range(b)]) for f in FIELDS}  # one row at a time: float64 memory
            fe = fast.hajek_attention(q, k, v, pi)
            log_pi = torch.log(pi)
            for mode in cfg["modes"]:
                for per_coordinate in (True, False):
                    row = {"b": b, "h_kv": h_kv, "g": g, "n": n, "d": d, "dtype": str(dtype).split(".")[-1],
                           "moments": mode, "per_coordinate": per_coordinate, "fields": {}}
                    try:
                        est = KN.hajek_attention(q, k, v, log_pi=log_pi, moments=mode, per_coordinate=per_coordinate)
                        row["ok"] = True
                        for f in FIELDS:
                            x = getattr(est, f)
                            if x is None:
                                continue
                            ek, ef = rel_err(torch, x, ref[f]), rel_err(torch, getattr(fe, f), ref[f])
                            eps_f = torch.finfo(dtype if f == "output" else torch.float32).eps
                            tol = 2 * ef + 4 * eps_f + (torch.finfo(dtype).eps if f in ("variance", "trace")
                                                        and dtype != torch.float32 else 0.0)
                            ok = not bool(torch.isnan(x).any()) and ek <= tol
                            row["fields"][f] = {"kernel_rel_err": ek, "fast_rel_err": ef, "tol": tol, "ok": ok}
                            row["ok"] &= ok
                    except Exception as e:
                        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:800])
                    report["correctness"].append(row)
            del q, k, v, pi, ref, fe, log_pi
            _free(torch, device)


# ----------------------------------------------------------------------------- timings

def variants(KN, q, k, v, log_pi, modes, extra=None):
    """name -> zero-argument call of the kernel: ``<mode>_trace``, ``<mode>_var``, ``<mode>_nocert``."""
    extra = extra or {}

    def call(**kw):
        return lambda: KN.hajek_attention(q, k, v, log_pi=log_pi, validate=False, **{**extra, **kw})

    out = {}
    for mode in modes:
        out[f"{mode}_trace"] = call(moments=mode, per_coordinate=False)
        out[f"{mode}_var"] = call(moments=mode, per_coordinate=True)
        out[f"{mode}_nocert"] = call(moments=mode, certify=False)
    return out


def run_timings(report, torch, KN, device, cfg, bench, clock, flush):
    import torch.nn.functional as F
    from gpu_decode import _guarded, make_cache, record_timing, sdpa_backends
    from torch.nn.attention import sdpa_kernel

    dtype = torch.bfloat16
    h_q, h_kv, d = cfg["h_q"], cfg["h_kv"], cfg["d"]
    g = h_q // h_kv
    peak = _peak(report) or float("nan")
    backends = sdpa_backends(torch, device)
    for n in cfg["kept"]:
        for b in cfg["batch"]:
            if clock.out_of_time():
                report["skipped"].append(f"timings b={b} n={n}: time budget")
                continue
            try:
                q, k, v, pi = make_cache(torch, b, h_kv, g, n, d, dtype, device, seed=b * 7 + n)
            except Exception as e:  # out of memory at the largest cell: record, go on
                report["skipped"].append(f"timings b={b} n={n}: {type(e).__name__}: {e}"[:300])
                continue
            log_pi = torch.log(pi)
            bias = (-log_pi).masked_fill(pi <= 0, float("-inf"))
            mask = bias.repeat_interleave(g, dim=1).unsqueeze(2).to(dtype).contiguous()  # (b, h_q, 1, n)
            q4 = q.unsqueeze(2)
            nbytes = (k.numel() + v.numel()) * k.element_size() + log_pi.numel() * 4
            row = {"b": b, "n": n, "h_q": h_q, "h_kv": h_kv, "d": d, "dtype": "bfloat16", "bytes": nbytes,
                   "results": {}}
            extra = {} if device == "cuda" else {"num_splits": 2}  # the merge kernels run on CPU too
            for name, fn in variants(KN, q, k, v, log_pi, cfg["modes"], extra).items():
                row["results"][name] = _guarded(lambda fn=fn: record_timing(bench, fn, nbytes, peak))
            for mname, m in (("sdpa_mask", mask), ("sdpa_nomask", None)):
                for bname, be in backends + [("auto", None)]:
                    def sdpa(m=m, be=be):
                        if be is None:
                            return F.scaled_dot_product_attention(q4, k, v, attn_mask=m, enable_gqa=True)
                        with sdpa_kernel([be]):
                            return F.scaled_dot_product_attention(q4, k, v, attn_mask=m, enable_gqa=True)

                    row["results"][f"{mname}[{bname}]"] = _guarded(lambda fn=sdpa: record_timing(bench, fn, nbytes,
                                                                                                  peak))
            fi = _guarded(lambda: flashinfer_decode(torch, q, k, v))
            if callable(fi):
                row["results"]["flashinfer_decode"] = _guarded(lambda: record_timing(bench, fi, nbytes, peak))
            else:
                row["results"]["flashinfer_decode"] = fi
            report["timings"].append(row)
            flush()
            print(f"[gpu_check] timings b={b} n={n}: " + ", ".join(
                f"{k_}={r_['median_ms']:.3f}ms" for k_, r_ in row["results"].items()
                if "median_ms" in r_ and (k_.endswith("_trace") or k_.endswith("nocert") or k_ == "sdpa_mask[auto]")),
                flush=True)
            del q, k, v, pi, log_pi, bias, mask, q4, fi
            _free(torch, device)


def flashinfer_decode(torch, q, k, v):
    """FlashInfer's batch decode over the same K/V (pages of 16 tokens, HND layout, no bias): a callable,
    or ``{"error": ...}`` when FlashInfer does not import or refuses the shapes."""
    import flashinfer

    b, h_kv, n, d = k.shape
    h_q, page = q.shape[1], 16
    pages = -(-n // page)
    pad = pages * page - n

    def paged(x):  # (b, h_kv, n, d) -> (b pages, h_kv, page, d)
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        return x.view(b, h_kv, pages, page, d).permute(0, 2, 1, 3, 4).reshape(b * pages, h_kv, page, d)

    kv = torch.stack([paged(k), paged(v)], dim=1).contiguous()  # (b pages, 2, h_kv, page, d)
    dev = q.device
    indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * pages
    indices = torch.arange(b * pages, dtype=torch.int32, device=dev)
    last = torch.full((b,), n - (pages - 1) * page, dtype=torch.int32, device=dev)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
    try:
        w.plan(indptr, indices, last, h_q, h_kv, d, page, q_data_type=q.dtype, kv_data_type=k.dtype)
    except TypeError:  # older FlashInfer: one data_type
        w.plan(indptr, indices, last, h_q, h_kv, d, page, data_type=k.dtype)
    qc = q.contiguous()
    w.run(qc, kv)
    return lambda: w.run(qc, kv)


def run_sweep(report, torch, KN, device, cfg, bench, clock, dry):
    """block_n x num_warps of the one-pass kernel (trace and variance) at the default split count, in the
    cells (b, n) = (1, 64k), (8, 16k), (32, 64k) (the largest first)."""
    from gpu_decode import _guarded, make_cache, record_timing

    h_q, h_kv, d = cfg["h_q"], cfg["h_kv"], cfg["d"]
    cells = [(1, 64)] if dry else [(32, 65536), (8, 16384), (1, 65536)]
    grid = [(16, 4), (32, 4)] if dry else [(16, 4), (16, 8), (32, 4), (32, 8), (64, 4), (64, 8)]
    peak = _peak(report) or float("nan")
    for b, n in cells:
        if clock.out_of_time():
            report["skipped"].append(f"sweep b={b} n={n}: time budget")
            continue
        q, k, v, pi = make_cache(torch, b, h_kv, h_q // h_kv, n, d, torch.bfloat16, device, seed=b * 7 + n)
        log_pi = torch.log(pi)
        nbytes = (k.numel() + v.numel()) * k.element_size() + log_pi.numel() * 4
        res = {"b": b, "n": n, "runs": []}
        for per_coordinate in (False, True):
            for bn, warps in grid:
                if clock.out_of_time():
                    break
                kw = dict(moments="onepass", per_coordinate=per_coordinate, block_n=bn, num_warps=warps)
                r = _guarded(lambda kw=kw: record_timing(bench, lambda: KN.hajek_attention(
                    q, k, v, log_pi=log_pi, validate=False, **kw), nbytes, peak))
                res["runs"].append({**kw, **r})
        ok = [r for r in res["runs"] if "median_ms" in r]
        for per_coordinate in (False, True):
            best = [r for r in ok if r["per_coordinate"] == per_coordinate]
            if best:
                res[f"best_{'var' if per_coordinate else 'trace'}"] = min(best, key=lambda r: r["median_ms"])
        report["sweep"].append(res)
        del q, k, v, pi, log_pi
        _free(torch, device)


# ----------------------------------------------------------------------------- the eviction event

def eviction_design():
    """The recommended design at compression 0.5 (the tilted sketch, its radius, systematic sampling)."""
    import kvcert.fast as fast

    return fast.TokenDesign(compression_ratio=0.5, sketch=fast.RECOMMENDED[0], kind=fast.RECOMMENDED[1],
                            sampling=fast.RECOMMENDED_SAMPLING, seed=0)


def compact_kv(torch, keys, values, decision, block_size):
    """The compaction of one sequence's layer as a paged engine does it: the layout
    (``kvcert.fast.compact_slots``) and the kept K and V gathered into the compacted slots, (h_kv, m bs, d)
    each (padding slots repeat token 0; the kernel masks them by log pi = -inf)."""
    import kvcert.fast as fast

    comp = fast.compact_slots(decision.keep, decision.pi, block_size)
    idx = comp.positions.clamp_min(0)
    k = torch.gather(keys[0], 1, idx[..., None].expand(-1, -1, keys.shape[-1]))
    v = torch.gather(values[0], 1, idx[..., None].expand(-1, -1, values.shape[-1]))
    return comp, k, v


def eviction_checks(torch, keys, decision, comp, packed_keys, budget):
    """What the timed steps must have produced: a systematic sample keeps floor(B) or ceil(B) tokens per
    head (B = sum pi); the compacted slots hold the kept tokens in position order (their keys), padding
    after them; m = ceil(max kept / block size) blocks."""
    kept = decision.keep.sum(-1)
    total = decision.pi.sum(-1)
    counts = bool(((kept >= torch.floor(total - 1e-6)) & (kept <= torch.ceil(total + 1e-6))).all())
    slots_ok = True
    for h in range(keys.shape[1]):
        pos = torch.nonzero(decision.keep[h]).flatten()
        c = int(pos.numel())
        slots_ok &= bool(torch.equal(comp.positions[h, :c], pos)) and bool((comp.positions[h, c:] == -1).all())
        slots_ok &= bool(torch.equal(packed_keys[h, :c], keys[0, h, pos]))
    blocks = comp.m == -(-int(kept.max()) // comp.block_size)
    return {"systematic_counts": counts, "slots_hold_kept_tokens": slots_ok, "blocks": blocks,
            "budget": budget, "ok": counts and slots_ok and blocks}


def run_eviction(report, torch, device, cfg, bench, clock, flush):
    """The eviction event of one layer (b = 1) against the layer's causal prefill attention, per prompt length."""
    import torch.nn.functional as F
    from gpu_decode import _guarded

    dtype = torch.bfloat16
    h_q, h_kv, d, bs = cfg["h_q"], cfg["h_kv"], cfg["d"], cfg["block_size"]
    design = eviction_design()
    for n in cfg["eviction_n"]:
        if clock.out_of_time():
            report["skipped"].append(f"eviction n={n}: time budget")
            continue
        gen = torch.Generator(device=device).manual_seed(n)
        q = torch.randn(1, h_q, n, d, generator=gen, device=device).to(dtype)
        k = torch.randn(1, h_kv, n, d, generator=gen, device=device).to(dtype)
        v = torch.randn(1, h_kv, n, d, generator=gen, device=device).to(dtype)
        window = q[:, :, -design.queries_read(n, n):]
        budget = design.sampled_budget(n, d, d)  # the budget less the sketch's memory in kept tokens
        scores = design.score(window, k, v)
        decision = design.decide(scores[0], budget=budget)

        def event():
            sc = design.score(window, k, v)
            dec = design.decide(sc[0], budget=budget)
            return compact_kv(torch, k, v, dec, bs), design.sketch_of(k, v, dec, queries=window)

        steps = {
            "score": lambda: design.score(window, k, v),
            "decide": lambda: design.decide(scores[0], budget=budget),
            "compact": lambda: compact_kv(torch, k, v, decision, bs),
            "sketch": lambda: design.sketch_of(k, v, decision, queries=window),
            "event": event,
            "prefill_sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        }
        comp, kc, _ = compact_kv(torch, k, v, decision, bs)
        row = {"n": n, "b": 1, "h_q": h_q, "h_kv": h_kv, "d": d, "dtype": "bfloat16", "block_size": bs,
               "design": repr(design), "kept": decision.keep.sum(-1).tolist(), "m_blocks": comp.m,
               "checks": eviction_checks(torch, k, decision, comp, kc, budget), "results": {}}
        for name, fn in steps.items():
            med = _guarded(lambda fn=fn: bench(fn))
            row["results"][name] = (med if isinstance(med, dict) else
                                    {"median_ms": med[0], "q20_ms": med[1], "q80_ms": med[2]})
        pre = row["results"]["prefill_sdpa"].get("median_ms")
        if pre:
            row["parts_over_prefill"] = {k_: r_["median_ms"] / pre for k_, r_ in row["results"].items()
                                         if "median_ms" in r_ and k_ != "prefill_sdpa"}
            row["event_over_prefill"] = row["parts_over_prefill"].get("event")
        report["eviction"].append(row)
        flush()
        print(f"[gpu_check] eviction n={n}: " + ", ".join(
            f"{k_}={r_['median_ms']:.3f}ms" for k_, r_ in row["results"].items() if "median_ms" in r_), flush=True)
        del q, k, v, window, scores, decision, comp, kc
        _free(torch, device)


# ----------------------------------------------------------------------------- compiled kernels

def compiled_kernels(KN):
    """Registers and spills of every variant Triton compiled in this process (empty on the interpreter)."""
    from kvcert.kernels import hajek as H

    rows = []
    for name in ("_hajek_onepass_kernel", "_onepass_merge_kernel", "_hajek_decode_kernel", "hajek_merge_kernel"):
        fn = getattr(H, name, None)
        caches = getattr(fn, "device_caches", None) or getattr(fn, "cache", None) or {}
        for _, entry in (caches.items() if isinstance(caches, dict) else []):
            cache = entry[0] if isinstance(entry, tuple) else entry
            for key, kern in (cache.items() if isinstance(cache, dict) else []):
                row = {"kernel": name}
                try:
                    if getattr(kern, "n_regs", None) is None and hasattr(kern, "_init_handles"):
                        kern._init_handles()
                    md = getattr(kern, "metadata", None)
                    row.update(n_regs=getattr(kern, "n_regs", None), n_spills=getattr(kern, "n_spills", None),
                               shared=getattr(md, "shared", None), num_warps=getattr(md, "num_warps", None),
                               num_stages=getattr(md, "num_stages", None))
                    src = getattr(kern, "src", None)
                    const = getattr(src, "constexprs", None) or getattr(src, "constants", None)
                    if const:
                        row["constexprs"] = {str(k_[0] if isinstance(k_, tuple) else k_): str(v_)
                                             for k_, v_ in dict(const).items()}
                    else:
                        row["key"] = str(key)[:400]
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------- targets

def _fastest_sdpa(res):
    times = {k: r["median_ms"] for k, r in res.items() if k.startswith("sdpa_mask") and "median_ms" in r}
    return min(times, key=times.get) if times else None


def targets(report):
    """The headline numbers, recomputed from what has run so far."""
    card = report.get("environment", {}).get("gpu") or report.get("device")
    by_variant = {}
    peak = _peak(report)
    cfg = report.get("config", {})
    sdpa_min_n, copy_min_n = cfg.get("sdpa_min_n", 4096), cfg.get("copy_min_n", 16384)
    for row in report.get("timings", []):
        res = row["results"]
        best = _fastest_sdpa(res)
        for name, r in res.items():
            if not (name.endswith("_trace") or name.endswith("_var")) or "median_ms" not in r:
                continue
            t = by_variant.setdefault(name, {"certified_over_uncertified": [], "certified_vs_sdpa": [],
                                             "copy_fraction_16k": []})
            base = res.get(name.rsplit("_", 1)[0] + "_nocert", {})
            if "median_ms" in base:
                t["certified_over_uncertified"].append(r["median_ms"] / base["median_ms"])
            if best is not None and row["n"] >= sdpa_min_n:
                t["certified_vs_sdpa"].append(res[best]["median_ms"] / r["median_ms"])
            if peak and row["n"] >= copy_min_n:
                t["copy_fraction_16k"].append(row["bytes"] / (r["median_ms"] * 1e-3) / 1e9 / peak)
    summary = {}
    for name, t in by_variant.items():
        summary[name] = {
            "certified_over_uncertified_max": max(t["certified_over_uncertified"], default=None),
            "certified_vs_sdpa_min_4k": min(t["certified_vs_sdpa"], default=None),
            "copy_fraction_min_16k": min(t["copy_fraction_16k"], default=None),
        }
    head = summary.get(HEADLINE, {})
    ev = [r["event_over_prefill"] for r in report.get("eviction", []) if r.get("event_over_prefill") is not None]
    return {
        "card": card,
        "measured_on_gpu": report.get("measured_on_gpu"),
        "headline": HEADLINE,
        "certified_over_uncertified_max": head.get("certified_over_uncertified_max"),
        "certified_vs_sdpa_min_4k": head.get("certified_vs_sdpa_min_4k"),
        "copy_fraction_min_16k": head.get("copy_fraction_min_16k"),
        "eviction_over_prefill_max": max(ev, default=None),
        "goal": {"certified_over_uncertified_max": "<= 1.10", "certified_vs_sdpa_min_4k": ">= 0.9",
                 "copy_fraction_min_16k": ">= 0.75", "eviction_over_prefill_max": "<= 0.10"},
        "by_variant": summary,
    }


def _free(torch, device):
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
