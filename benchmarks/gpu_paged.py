#!/usr/bin/env python
"""GPU benchmark of the paged Hajek decode kernel (kvcert.kernels.paged_block_hajek_attention).

On one CUDA GPU it writes
``<out>/gpu_paged.json`` (``--out`` folder, else ``$OUT``, else ``benchmarks/results/``) with

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
   With the compacted token-slot kernel (``paged_hajek_attention``,
   skipped with ``--no-compacted``) each timing row also holds, at the same
   total length and compression (prompt = length - ``--tail`` tokens, a
   Poisson sample per KV head compacted to slots 0 .. C_h - 1, the tail
   certain): ``paged_compacted``, ``paged_compacted_nocert`` and
   ``sdpa_compacted_gathered[<backend>]`` (SDPA with the per-token bias over
   the same kept tokens gathered per head, gather not timed), and
   ``compacted`` (Cmax, kept tokens, padding fraction); its correctness rows
   (``"kernel": "compacted"``) compare with ``kvcert.fast.hajek_attention``
   in float64 over the gathered kept tokens.
3. ``summary``: per (block size, seq len), paged_hajek / fastest baseline
   time ratios and the certificate overhead; under ``compacted`` the
   compacted kernel's time vs the block kernel and vs the fastest SDPA over
   its gathered tokens.

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
    p.add_argument("--out", type=Path, default=None, help="output folder (default $OUT, else benchmarks/results/)")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak in GB/s (H200 HBM3e: 4800)")
    p.add_argument("--batch", type=int, default=None, help="sequences per decode step (default 8)")
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 4096 8192 16384 32768")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None, help="default 16 128")
    p.add_argument("--compression", type=float, default=0.5, help="expected fraction of tail blocks evicted")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new work after this many seconds")
    p.add_argument("--no-correctness", action="store_true")
    p.add_argument("--no-compacted", action="store_true",
                   help="skip the compacted token-slot kernel (paged_hajek_attention)")
    p.add_argument("--tail", type=int, default=None, help="decode tail of the compacted case in tokens (default 128)")
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
    from gpu_decode import Clock, environment, make_timer, write_report

    from kvcert import kernels as KN

    if args.device == "cpu" and not KN.INTERPRETED:
        raise SystemExit("--device cpu needs the Triton interpreter, but triton was imported before "
                         "TRITON_INTERPRET=1 could be set")
    dry = args.dry_run
    cfg = dict(batch=args.batch or (2 if dry else 8), seq_lens=args.seq_lens or ([100, 300] if dry else
                                                                                 [4096, 8192, 16384, 32768]),
               block_sizes=args.block_sizes or ([16, 32] if dry else [16, 128]),
               h_q=4 if dry else 32, h_kv=2 if dry else 8, d=16 if dry else 128, dtype="bfloat16",
               compression=args.compression, tail=args.tail or (16 if dry else 128), warmup_ms=5.0 if dry else 25.0, rep_ms=10.0 if dry else 100.0,
               peak_gbps=args.peak_gbps)
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results")
    out_path = out_dir / ("gpu_paged_dry.json" if dry else "gpu_paged.json")
    clock = Clock(args.budget_s)
    report = {"benchmark": "kvcert.kernels.paged_block_hajek_attention decode", "dry_run": dry, "device": args.device,
              "measured_on_gpu": args.device == "cuda",
              "note": ("timings on the CPU interpreter are wall-clock and meaningless" if args.device == "cpu" else
                       "do_bench medians, L2 flushed; bytes = kept K + V (+ log pi and block table for the "
                       "paged kernel)"),
              "config": cfg, "environment": environment(torch, triton, args.device), "correctness": [],
              "timings": [], "skipped": []}
    write_report(report, out_path)
    dev = torch.device(args.device)
    if not args.no_correctness:
        run_correctness(report, torch, KN, dev, dry)
        write_report(report, out_path)
        if not args.no_compacted:
            run_compacted_correctness(report, torch, KN, dev, dry)
            write_report(report, out_path)
    bench = make_timer(torch, triton, args.device, cfg["warmup_ms"], cfg["rep_ms"])
    flash = _vllm_flash()
    report["vllm_flash"] = flash[1]
    for bs in cfg["block_sizes"]:
        for n in cfg["seq_lens"]:
            if clock.out_of_time():
                report["skipped"].append({"block_size": bs, "seq_len": n, "why": "time budget"})
                continue
            try:
                row = time_case(torch, KN, dev, cfg, bs, n, bench, flash[0])
                if not args.no_compacted:
                    err = _guard(lambda: time_compacted(torch, KN, dev, cfg, bs, n, bench, row))
                    if err:
                        row["compacted_error"] = err["error"]
                report["timings"].append(row)
            except Exception as e:  # record and go on (an OOM at the largest size must not lose the rest)
                report["timings"].append({"block_size": bs, "seq_len": n, "error": f"{type(e).__name__}: {e}"[:800]})
            write_report(report, out_path)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    report["summary"] = _summary(report)
    report["elapsed_s"] = round(clock.elapsed(), 2)
    write_report(report, out_path)
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
                est = KN.paged_block_hajek_attention(c["q"], c["key_cache"], c["value_cache"], c["block_table"],
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


# ----------------------------------------------------------------------------- compacted token slots

def make_compacted_paged(torch, *, batch, prompt_len, tail_len, bs, h_kv, g, d, dtype, device, compression, seed=0):
    """A paged cache after the token design's compaction (docs/design.md section 7): per (sequence, KV head)
    a Poisson sample of the prompt with pi = 1 - compression (the first 4 tokens certain), copied to slots
    0 .. C_h - 1 (log pi per slot, -inf padding up to Cmax = max C_h); the tail of ``tail_len`` tokens at
    positions [prompt_len, prompt_len + tail_len). Logical blocks that hold neither get stale ids."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    L = prompt_len + tail_len
    nbt = -(-L // bs)
    nb = batch * nbt + 1
    kc = torch.randn(nb, bs, h_kv, d, generator=gen).to(device=device, dtype=dtype)
    vc = torch.randn(nb, bs, h_kv, d, generator=gen).to(device=device, dtype=dtype)
    table = torch.randperm(nb, generator=gen)[: batch * nbt].view(batch, nbt).to(torch.int32)
    pi = 1.0 - compression
    keep = torch.rand(batch, h_kv, prompt_len, generator=gen) < pi
    keep[..., :4] = True
    counts = keep.sum(-1)  # (b, h_kv)
    cmax = max(1, int(counts.max()))
    lp_tok = torch.where(torch.arange(prompt_len) < 4, 0.0, math.log(pi)).expand(batch, h_kv, -1)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)[..., :cmax]  # kept tokens first
    lp = torch.gather(lp_tok, -1, order)
    lp = torch.where(torch.arange(cmax)[None, None] < counts[..., None], lp, float("-inf"))
    m = -(-cmax // bs)
    stale = (torch.arange(nbt)[None] >= m) & (torch.arange(nbt)[None] < prompt_len // bs)
    table = torch.where(stale, -1, table)  # the freed prompt blocks
    q = torch.randn(batch, h_kv * g, d, generator=gen).to(device=device, dtype=dtype)
    return dict(q=q, key_cache=kc, value_cache=vc, block_table=table.to(device),
                seq_lens=torch.full((batch,), L, dtype=torch.int32, device=device),
                prompt_lens=torch.full((batch,), prompt_len, dtype=torch.int32, device=device),
                log_pi_slots=lp.to(device=device, dtype=torch.float32), bs=bs, cmax=cmax,
                kept_tokens=int(counts.sum()) + batch * h_kv * tail_len)


def gather_compacted(torch, c):
    """The compacted slots then the tail, gathered per KV head: K, V (b, h_kv, Cmax + T, d) and log pi
    (b, h_kv, Cmax + T) (-inf on padding, 0 on the tail); the sequences share P and L here."""
    bs = c["bs"]
    lp = c["log_pi_slots"]
    b, h_kv, cmax = lp.shape
    dev = lp.device
    P, L = int(c["prompt_lens"][0]), int(c["seq_lens"][0])
    tab = c["block_table"].long().clamp_min(0)
    j = torch.arange(cmax, device=dev)
    heads = torch.arange(h_kv, device=dev)[None, :, None]
    phys = tab[:, j // bs][:, None, :]  # (b, 1, Cmax)
    k_c = c["key_cache"][phys, (j % bs)[None, None], heads]  # (b, h_kv, Cmax, d)
    v_c = c["value_cache"][phys, (j % bs)[None, None], heads]
    pos = torch.arange(P, L, device=dev)
    pt = tab[:, pos // bs]  # (b, T)
    k_t = c["key_cache"][pt, pos % bs].transpose(1, 2)  # (b, h_kv, T, d)
    v_t = c["value_cache"][pt, pos % bs].transpose(1, 2)
    pad = torch.isneginf(lp)[..., None]
    k = torch.cat([k_c.masked_fill(pad, 0), k_t], 2)
    v = torch.cat([v_c.masked_fill(pad, 0), v_t], 2)
    lpt = torch.cat([lp, torch.zeros(b, h_kv, L - P, device=dev)], 2)
    return k, v, lpt


def _compacted_kernel():
    from kvcert.kernels.paged import paged_hajek_attention

    return paged_hajek_attention


def run_compacted_correctness(report, torch, KN, dev, dry):
    """``paged_hajek_attention`` against kvcert.fast.hajek_attention in float64 over the gathered
    kept tokens: max errors and ``ok`` = kernel error <= 2 x the float32 torch error + 32 eps x scale."""
    from kvcert import fast

    for bs in (16, 32) if dry else (16, 128):
        for dtype in (torch.float32, torch.bfloat16):
            for splits in (1, 3):
                c = make_compacted_paged(torch, batch=2, prompt_len=bs * 5 + 3, tail_len=bs + 5, bs=bs, h_kv=2,
                                         g=2, d=16 if dry else 32, dtype=dtype, device=dev, compression=0.5,
                                         seed=bs + splits)
                est = _compacted_kernel()(c["q"], c["key_cache"], c["value_cache"], c["block_table"],
                                                         c["seq_lens"], c["prompt_lens"], c["log_pi_slots"],
                                                         num_splits=splits)
                k, v, lpt = gather_compacted(torch, c)
                res = {name: fast.hajek_attention(c["q"].to(dt), k.to(dt), v.to(dt), log_pi=lpt.to(dt))
                       for name, dt in (("f64", torch.float64), ("f32", torch.float32))}
                eps = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}[dtype]
                vmax = float(v.float().abs().max())
                row = {"kernel": "compacted", "block_size": bs, "dtype": str(dtype).split(".")[-1], "splits": splits,
                       "cmax": c["cmax"]}
                ok = True
                for fld, scl in (("output", vmax), ("lse", float(res["f64"].lse.abs().max()) + 1),
                                 ("trace", vmax * vmax)):
                    ref = getattr(res["f64"], fld).double()
                    e_k = float((getattr(est, fld).double() - ref).abs().max())
                    e_t = float((getattr(res["f32"], fld).double() - ref).abs().max())
                    row[f"{fld}_err"], row[f"{fld}_err_torch32"] = e_k, e_t
                    ok &= e_k <= 2 * e_t + 32 * eps * scl
                row["ok"] = bool(ok)
                report["correctness"].append(row)


def time_compacted(torch, KN, dev, cfg, bs, n, bench, row):
    """Adds to ``row`` the compacted kernel at the same total length (prompt n - tail, tail ``cfg["tail"]``
    tokens) and compression: ``paged_compacted`` (certify), ``paged_compacted_nocert`` and
    ``sdpa_compacted_gathered[<backend>]`` (SDPA with the per-token bias -log pi over the same kept tokens
    gathered per head, the gather not timed), bytes = kept K + V (+ log pi slots and block table)."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    g = cfg["h_q"] // cfg["h_kv"]
    tail = min(cfg["tail"], n - 1)
    c = make_compacted_paged(torch, batch=cfg["batch"], prompt_len=n - tail, tail_len=tail, bs=bs, h_kv=cfg["h_kv"],
                             g=g, d=cfg["d"], dtype=getattr(torch, cfg["dtype"]), device=dev,
                             compression=cfg["compression"])
    el = c["key_cache"].element_size()
    kv_bytes = 2 * c["kept_tokens"] * cfg["d"] * el
    meta = c["log_pi_slots"].numel() * 4 + c["block_table"].numel() * 4
    slots = cfg["batch"] * cfg["h_kv"] * (c["cmax"] + tail)
    row["compacted"] = {"prompt_len": n - tail, "tail_len": tail, "cmax": c["cmax"], "kept_tokens": c["kept_tokens"],
                        "padding_fraction": 1 - c["kept_tokens"] / slots}
    peak = cfg["peak_gbps"]
    args = (c["q"], c["key_cache"], c["value_cache"], c["block_table"], c["seq_lens"], c["prompt_lens"],
            c["log_pi_slots"])
    for name, certify in (("paged_compacted", True), ("paged_compacted_nocert", False)):
        fn = lambda certify=certify: _compacted_kernel()(  # noqa: E731
            *args, certify=certify, validate=False, max_tail_len=tail)
        row["variants"][name] = _guard(lambda fn=fn: _record_bytes(bench, fn, kv_bytes + meta, peak))
    k, v, lpt = gather_compacted(torch, c)
    bias = (-lpt).repeat_interleave(g, dim=1)[:, :, None, :].to(k.dtype)  # (b, h_q, 1, n); -log 0 = +inf -> mask
    bias = bias.masked_fill(torch.isinf(bias), float("-inf"))
    q4 = c["q"][:, :, None, :]
    for be_name, be in _sdpa_backends_safe(torch, dev):
        def sdpa(be=be):
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q4, k, v, attn_mask=bias, enable_gqa=True)
        row["variants"][f"sdpa_compacted_gathered[{be_name}]"] = _guard(
            lambda f=sdpa: _record_bytes(bench, f, kv_bytes, peak))


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
        fn = lambda certify=certify: KN.paged_block_hajek_attention(  # noqa: E731
            *args, certify=certify, validate=False, max_seq_len=n)
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
    from gpu_decode import sdpa_backends

    if dev.type != "cuda":
        from torch.nn.attention import SDPBackend

        return [("math", SDPBackend.MATH)]
    return sdpa_backends(torch, "cuda")


def _record_bytes(bench, fn, nbytes, peak):
    from gpu_decode import record_timing

    return record_timing(bench, fn, nbytes, peak)


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
        if "paged_compacted" in t:
            cb = {k: x for k, x in t.items() if k.startswith("sdpa_compacted_gathered")}
            cf = min(cb, key=cb.get) if cb else None
            out[-1]["compacted"] = {
                "paged_compacted_ms": t["paged_compacted"],
                "roofline": var["paged_compacted"].get("roofline"),
                "time_vs_block_kernel": t["paged_compacted"] / t["paged_hajek"],
                "fastest_sdpa_compacted": cf,
                "time_vs_fastest_sdpa_compacted": t["paged_compacted"] / cb[cf] if cf else None,
                "certificate_overhead": (t["paged_compacted"] / t["paged_compacted_nocert"] - 1
                                         if "paged_compacted_nocert" in t else None)}
    ok = [r["ok"] for r in report.get("correctness", [])]
    return {"correctness_ok": all(ok) if ok else None, "cases": out}


if __name__ == "__main__":
    main()
