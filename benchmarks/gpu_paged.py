#!/usr/bin/env python
"""GPU benchmark of the paged Hajek decode kernel (kvcert.kernels.paged_hajek_attention).

Ready, not yet run: written on a machine without a GPU. On one CUDA GPU it writes
``<out>/gpu_paged.json`` (``--out`` folder, else ``$OUT``, else ``benchmarks/``) with

1. ``correctness`` (first): per (block size, dtype, splits), the kernel's max
   absolute error against ``kvcert.fast.block_hajek_attention`` in float64
   over the kept blocks gathered contiguous (output, lse, trace), beside the
   float32 torch estimator's own error, with ``ok`` = kernel error <=
   2 x torch error + 32 eps of the input dtype x the field's scale.
2. ``timings``: batch 8 (``--batch``), h_q = 32, h_kv = 8, d = 128, bfloat16,
   sequence lengths 4k, 8k, 16k, 32k, block sizes 16 and 128, compression 0.5
   (the first and last blocks certain, every other block kept with pi = 0.5,
   physical ids shuffled), ``triton.testing.do_bench`` median and 20/80 %
   quantiles (ms, L2 flushed) of
   - ``paged_hajek``: the kernel with the trace (certify=True),
   - ``paged_hajek_nocert``: without it,
   - ``sdpa_gathered[<backend>]``: torch SDPA (``enable_gqa=True``) with the
     bias -log pi_b as a float mask over the same kept tokens already gathered
     contiguous (the gather is not timed: a lower bound for a gather + SDPA
     route), per SDPA backend; ``gather+sdpa`` times the gather too,
   - ``vllm_flash_paged``: vLLM's own paged FlashAttention decode
     (``vllm.vllm_flash_attn.flash_attn_varlen_func`` with a block table of the
     kept blocks only, no bias: the speed of stock paged decode over the same
     memory), when importable,
   each with GB/s and the HBM roofline fraction, counting the kept K and V
   bytes (+ log pi and block table for the paged kernel).
3. ``summary``: per (block size, seq len), paged_hajek / fastest baseline
   time ratios and the certificate overhead.

Usage::

    python benchmarks/gpu_paged.py --out /tmp/bench        # on CUDA (a few minutes on an H200)
    python benchmarks/gpu_paged.py --dry-run               # tiny sizes, on CUDA
    python benchmarks/gpu_paged.py --dry-run --device cpu  # Triton interpreter: code paths only

Without a CUDA device (and without ``--dry-run --device cpu``) it refuses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu only with --dry-run (Triton interpreter; timings meaningless)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes and short timings: exercise every path")
    p.add_argument("--out", type=Path, default=None, help="output folder (default $OUT, else benchmarks/)")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak in GB/s (H200 HBM3e: 4800)")
    p.add_argument("--batch", type=int, default=None, help="sequences per decode step (default 8)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 4096 8192 16384 32768")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None, help="default 16 128")
    p.add_argument("--compression", type=float, default=0.5, help="expected fraction of tail blocks evicted")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new work after this many seconds")
    p.add_argument("--no-correctness", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cpu":
        if not args.dry_run:
            raise SystemExit("gpu_paged.py: --device cpu is only for --dry-run (the Triton interpreter's "
                             "timings mean nothing)")
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    sys.path.insert(0, str(ROOT))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_paged.py needs a CUDA device (none is visible); for a code-path check without "
                         "one run: python benchmarks/gpu_paged.py --dry-run --device cpu")
    import triton
    from gpu_decode import Clock, _environment, _timer, _write

    from kvcert import kernels as KN

    if args.device == "cpu" and not KN.INTERPRETED:
        raise SystemExit("--device cpu needs the Triton interpreter, but triton was imported before "
                         "TRITON_INTERPRET=1 could be set")
    dry = args.dry_run
    cfg = dict(batch=args.batch or (2 if dry else 8), seq_lens=args.seq_lens or ([100, 300] if dry else
                                                                                 [4096, 8192, 16384, 32768]),
               block_sizes=args.block_sizes or ([16, 32] if dry else [16, 128]),
               h_q=4 if dry else 32, h_kv=2 if dry else 8, d=16 if dry else 128, dtype="bfloat16",
               compression=args.compression, warmup_ms=5.0 if dry else 25.0, rep_ms=10.0 if dry else 100.0,
               peak_gbps=args.peak_gbps)
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks")
    out_path = out_dir / ("gpu_paged_dry.json" if dry else "gpu_paged.json")
    clock = Clock(args.budget_s)
    report = {"benchmark": "kvcert.kernels.paged_hajek_attention decode", "dry_run": dry, "device": args.device,
              "measured_on_gpu": args.device == "cuda",
              "note": ("timings on the CPU interpreter are wall-clock and meaningless" if args.device == "cpu" else
                       "do_bench medians, L2 flushed; bytes = kept K + V (+ log pi and block table for the "
                       "paged kernel)"),
              "config": cfg, "environment": _environment(torch, triton, args.device), "correctness": [],
              "timings": [], "skipped": []}
    _write(report, out_path)
    dev = torch.device(args.device)
    if not args.no_correctness:
        run_correctness(report, torch, KN, dev, dry)
        _write(report, out_path)
    bench = _timer(torch, triton, args.device, cfg["warmup_ms"], cfg["rep_ms"])
    flash = _vllm_flash()
    report["vllm_flash"] = flash[1]
    for bs in cfg["block_sizes"]:
        for n in cfg["seq_lens"]:
            if clock.out_of_time():
                report["skipped"].append({"block_size": bs, "seq_len": n, "why": "time budget"})
                continue
            try:
                report["timings"].append(time_case(torch, KN, dev, cfg, bs, n, bench, flash[0]))
            except Exception as e:  # record and go on (an OOM at the largest size must not lose the rest)
                report["timings"].append({"block_size": bs, "seq_len": n, "error": f"{type(e).__name__}: {e}"[:800]})
            _write(report, out_path)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    report["summary"] = _summary(report)
    report["elapsed_s"] = round(clock.elapsed(), 2)
    _write(report, out_path)
    print(json.dumps(report["summary"], indent=2))
    print(f"wrote {out_path} in {report['elapsed_s']} s")
    return report


# ----------------------------------------------------------------------------- data

def make_paged(torch, *, batch, seq_len, bs, h_kv, g, d, dtype, device, compression, seed=0):
    """A paged cache after block eviction: shuffled physical ids, log pi_b per logical block.

    Blocks 0 and the last (the decode block) are certain; every other block is kept with
    pi = 1 - compression (log pi recorded) or evicted (-inf; its table entry set to a stale id).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nbt = -(-seq_len // bs)
    nb = batch * nbt + 1
    kc = torch.randn(nb, bs, h_kv, d, generator=gen).to(device=device, dtype=dtype)
    vc = torch.randn(nb, bs, h_kv, d, generator=gen).to(device=device, dtype=dtype)
    table = torch.randperm(nb, generator=gen)[: batch * nbt].view(batch, nbt).to(torch.int32)
    pi = 1.0 - compression
    keep = torch.rand(batch, nbt, generator=gen) < pi
    lp = torch.where(keep, math.log(pi), float("-inf"))
    lp[:, 0] = 0.0
    lp[:, -1] = 0.0
    q = torch.randn(batch, h_kv * g, d, generator=gen).to(device=device, dtype=dtype)
    seq = torch.full((batch,), seq_len, dtype=torch.int32)
    return dict(q=q, key_cache=kc, value_cache=vc, block_table=table.to(device), seq_lens=seq.to(device),
                log_pi_blocks=lp.to(device=device, dtype=torch.float32), bs=bs)


def gather(torch, c):
    """Kept blocks gathered contiguous, padded to the longest row: K, V (b, h_kv, n, d), bias (b, 1, 1, n)
    (-log pi_b on kept tokens, -inf on padding) and the compact table / kept lengths for vLLM's kernel."""
    bs = c["bs"]
    keep = c["log_pi_blocks"] > float("-inf")
    counts = keep.sum(1)
    m = int(counts.max())
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :m]  # kept logical blocks first
    ids = torch.gather(c["block_table"].long(), 1, order)
    lp = torch.gather(c["log_pi_blocks"], 1, order)
    valid = torch.arange(m, device=ids.device)[None] < counts[:, None]
    lp = torch.where(valid, lp, float("-inf"))
    k = c["key_cache"][ids].flatten(1, 2).transpose(1, 2)  # (b, h_kv, m bs, d)
    v = c["value_cache"][ids].flatten(1, 2).transpose(1, 2)
    bias = (-lp).repeat_interleave(bs, dim=1)[:, None, None, :]
    compact = torch.where(valid, ids, 0).to(torch.int32)
    return k, v, bias, compact, (counts * bs).to(torch.int32), ids, lp, order


def run_correctness(report, torch, KN, dev, dry):
    from kvcert import fast

    for bs in (16, 32) if dry else (16, 128):
        for dtype in (torch.float32, torch.bfloat16):
            for splits in (1, 3):
                c = make_paged(torch, batch=2, seq_len=bs * 5 + 3, bs=bs, h_kv=2, g=2, d=32 if not dry else 16,
                               dtype=dtype, device=dev, compression=0.5, seed=bs + splits)
                est = KN.paged_hajek_attention(c["q"], c["key_cache"], c["value_cache"], c["block_table"],
                                               c["seq_lens"], c["log_pi_blocks"], num_splits=splits)
                row = {"block_size": bs, "dtype": str(dtype).split(".")[-1], "splits": splits}
                ok = True
                eps = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}[dtype]
                for s in range(2):
                    L = int(c["seq_lens"][s])
                    kept = [j for j in range(-(-L // bs)) if float(c["log_pi_blocks"][s, j]) > float("-inf")]
                    ids = c["block_table"][s, kept].long()
                    pos = (torch.tensor(kept, device=dev)[:, None] * bs + torch.arange(bs, device=dev)).flatten()
                    inside = pos < L
                    lpt = torch.where(inside, c["log_pi_blocks"][s, kept].double().repeat_interleave(bs),
                                      float("-inf"))
                    k = c["key_cache"][ids].flatten(0, 1).transpose(0, 1)[None]
                    v = c["value_cache"][ids].flatten(0, 1).transpose(0, 1)[None]
                    posm = torch.where(inside, pos, -1).expand(1, k.shape[1], -1)
                    res = {}
                    for name, dt in (("f64", torch.float64), ("f32", torch.float32)):
                        res[name] = fast.block_hajek_attention(c["q"][s:s + 1].to(dt), k.to(dt), v.to(dt),
                                                               log_pi=lpt.to(dt).expand(1, k.shape[1], -1),
                                                               block_size=bs, positions=posm)
                    vmax = float(v.float().abs().max())
                    for fld, scl in (("output", vmax), ("lse", float(res["f64"].lse.abs().max()) + 1),
                                     ("trace", vmax * vmax)):
                        ref = getattr(res["f64"], fld)[0].double()
                        e_k = float((getattr(est, fld)[s].double() - ref).abs().max())
                        e_t = float((getattr(res["f32"], fld)[0].double() - ref).abs().max())
                        row[f"{fld}_err"] = max(row.get(f"{fld}_err", 0.0), e_k)
                        row[f"{fld}_err_torch32"] = max(row.get(f"{fld}_err_torch32", 0.0), e_t)
                        ok &= e_k <= 2 * e_t + 32 * eps * scl
                row["ok"] = bool(ok)
                report["correctness"].append(row)


# ----------------------------------------------------------------------------- timings

def _vllm_flash():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func, "vllm.vllm_flash_attn.flash_attn_varlen_func"
    except Exception as e:  # not installed, or no CUDA build
        return None, f"unavailable: {type(e).__name__}: {e}"[:300]


def time_case(torch, KN, dev, cfg, bs, n, bench, flash_fn):
    import torch.nn.functional as F

    g = cfg["h_q"] // cfg["h_kv"]
    dtype = getattr(torch, cfg["dtype"])
    c = make_paged(torch, batch=cfg["batch"], seq_len=n, bs=bs, h_kv=cfg["h_kv"], g=g, d=cfg["d"], dtype=dtype,
                   device=dev, compression=cfg["compression"])
    k, v, bias, compact, kept_lens, ids, _, _ = gather(torch, c)
    kept_tokens = int(kept_lens.sum())
    el = c["key_cache"].element_size()
    kv_bytes = 2 * kept_tokens * cfg["h_kv"] * cfg["d"] * el
    meta_bytes = c["log_pi_blocks"].numel() * 4 + c["block_table"].numel() * 4
    row = {"block_size": bs, "seq_len": n, "batch": cfg["batch"], "kept_tokens": kept_tokens,
           "kept_fraction": kept_tokens / (cfg["batch"] * n), "variants": {}}
    peak = cfg["peak_gbps"]
    args = (c["q"], c["key_cache"], c["value_cache"], c["block_table"], c["seq_lens"], c["log_pi_blocks"])
    for name, certify in (("paged_hajek", True), ("paged_hajek_nocert", False)):
        fn = lambda certify=certify: KN.paged_hajek_attention(*args, certify=certify, validate=False,  # noqa: E731
                                                              max_seq_len=n)
        row["variants"][name] = _guard(lambda fn=fn: _record_bytes(bench, fn, kv_bytes + meta_bytes, peak))
    q4 = c["q"][:, :, None, :]
    from torch.nn.attention import sdpa_kernel

    mask = bias.to(dtype)
    for be_name, be in _sdpa_backends_safe(torch, dev):
        def sdpa(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=True)
        row["variants"][f"sdpa_gathered[{be_name}]"] = _guard(lambda f=sdpa: _record_bytes(bench, f, kv_bytes, peak))

    def gather_sdpa():
        kk = c["key_cache"][ids].flatten(1, 2).transpose(1, 2)
        vv = c["value_cache"][ids].flatten(1, 2).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, kk, vv, attn_mask=mask, enable_gqa=True)
    row["variants"]["gather+sdpa"] = _guard(lambda: _record_bytes(bench, gather_sdpa, kv_bytes, peak))
    if flash_fn is not None and dev.type == "cuda":
        cu_q = torch.arange(cfg["batch"] + 1, device=dev, dtype=torch.int32)
        maxk = int(kept_lens.max())

        def vllm_flash():
            return flash_fn(c["q"], c["key_cache"], c["value_cache"], max_seqlen_q=1, cu_seqlens_q=cu_q,
                            max_seqlen_k=maxk, seqused_k=kept_lens, block_table=compact,
                            softmax_scale=cfg["d"] ** -0.5, causal=True)
        row["variants"]["vllm_flash_paged"] = _guard(lambda: _record_bytes(bench, vllm_flash, kv_bytes, peak))
    return row


def _sdpa_backends_safe(torch, dev):
    from gpu_decode import _sdpa_backends

    if dev.type != "cuda":
        from torch.nn.attention import SDPBackend

        return [("math", SDPBackend.MATH)]
    return _sdpa_backends(torch, "cuda")


def _record_bytes(bench, fn, nbytes, peak):
    from gpu_decode import _record

    return _record(bench, fn, nbytes, peak)


def _guard(fn):
    try:
        return fn()
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:500]}


def _summary(report):
    out = []
    for row in report["timings"]:
        var = row.get("variants", {})
        t = {k: x["median_ms"] for k, x in var.items() if "median_ms" in x}
        if "paged_hajek" not in t:
            continue
        base = {k: x for k, x in t.items() if k.startswith(("sdpa_gathered", "vllm_flash"))}
        fastest = min(base, key=base.get) if base else None
        out.append({"block_size": row["block_size"], "seq_len": row["seq_len"],
                    "paged_hajek_ms": t["paged_hajek"],
                    "roofline": var["paged_hajek"].get("roofline"),
                    "fastest_baseline": fastest,
                    "time_vs_fastest_baseline": t["paged_hajek"] / base[fastest] if fastest else None,
                    "time_vs_gather_sdpa": t["paged_hajek"] / t["gather+sdpa"] if "gather+sdpa" in t else None,
                    "certificate_overhead": (t["paged_hajek"] / t["paged_hajek_nocert"] - 1
                                             if "paged_hajek_nocert" in t else None)})
    ok = [r["ok"] for r in report.get("correctness", [])]
    return {"correctness_ok": all(ok) if ok else None, "cases": out}


if __name__ == "__main__":
    main()
