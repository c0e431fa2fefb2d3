"""Compile the decode kernels for a CUDA target without a GPU, and report their resource usage.

Triton's wheel bundles ``ptxas`` and ``cuobjdump``, so the kernels can be lowered to a cubin for,
say, sm_90 on a CPU-only machine. That catches what the interpreter cannot (type or layout errors
of the compiled path) and gives static performance evidence: registers per thread, spilled stack
bytes, shared memory and SASS instruction counts.

    python -m kvcert.kernels.aot              # default configurations for sm_90, as JSON
    python -m kvcert.kernels.aot --arch 100 --block-n 32 --num-warps 8

Needs the compiled kernels: run it without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import hajek as H

__all__ = ["compile_decode", "compile_merge", "resource_usage"]

_DT = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "fp32": "fp32", "float32": "fp32"}


def pow2(x):
    return max(16, 1 << max(0, int(x) - 1).bit_length())


def _check_compiled():
    if H.INTERPRETED:
        raise RuntimeError("kvcert.kernels was imported with TRITON_INTERPRET=1: the interpreter cannot "
                           "compile ahead of time (run without TRITON_INTERPRET)")


def _bin(name):
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else None


def resource_usage(kernel) -> dict:
    """Registers, spilled stack bytes, shared memory and SASS counts of a compiled kernel."""
    out = {"shared_bytes": int(kernel.metadata.shared), "registers": None, "stack_bytes": None,
           "sass_instructions": None, "barriers": None, "mma": None}
    tool = _bin("cuobjdump")
    if tool is None or "cubin" not in kernel.asm:
        return out
    with tempfile.TemporaryDirectory() as td:
        cub = os.path.join(td, "k.cubin")
        with open(cub, "wb") as f:
            f.write(kernel.asm["cubin"])
        res = subprocess.run([tool, "-res-usage", cub], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", cub], capture_output=True, text=True).stdout
    reg, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    ops = collections.Counter(m.group(1).split(".")[0] for m in
                              re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
    out.update(registers=int(reg.group(1)) if reg else None, stack_bytes=int(stack.group(1)) if stack else None,
               sass_instructions=sum(ops.values()), barriers=ops.get("BAR", 0),
               mma=ops.get("HMMA", 0) + ops.get("HGMMA", 0))
    return out


def compile_decode(*, arch: int = 90, dtype: str = "bf16", d: int = 128, dv: int | None = None, g: int = 4,
                   block_n: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                   log_pi: bool = True, certify: bool = True, per_coordinate: bool = True, split: bool = True,
                   moments: str = "exact"):
    """Compile the decode kernel for ``sm_<arch>``; returns the compiled kernel.

    Defaults for ``block_n`` and ``num_warps`` are those of :func:`kvcert.kernels.default_config`.
    ``moments`` is ``"exact"`` or ``"shifted"`` (the two-pass kernel's modes); the one-pass kernel
    (``"onepass"``) is compiled by tests/test_kernels_onepass.py's check, not here.
    """
    if moments not in ("exact", "shifted"):
        raise ValueError(f"moments must be 'exact' or 'shifted' (this kernel's modes), got {moments!r}")
    dt, cfg, const = _tile_constants(dtype, d, dv, g, block_n, log_pi)
    const.update(CERTIFY=certify, PER_COORD=per_coordinate, SPLIT=split, ROUND_P=dt != "fp32",
                 EXACT_MOMENTS=moments == "exact")
    ptr = {"Q": dt, "K": dt, "V": dt, "Out": dt, "P": "fp32",
           **{name: "fp32" for name in ("Lse", "Var", "Tr", "Neff", "PartS", "PartV")}}
    src = ASTSource(H._hajek_decode_kernel, _signature(H._hajek_decode_kernel, const, ptr), constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages})


def _tile_constants(dtype: str, d: int, dv: int | None, g: int, block_n: int | None, log_pi: bool):
    """(dtype name, default config, constexprs) shared by the decode and tail-moment kernels."""
    _check_compiled()
    dt = _DT[dtype]
    dv = d if dv is None else dv
    import torch

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
    cfg = H.default_config(1, d, 1, torch.device("cpu"), block_n, tdt)
    g_block = min(g, H.MAX_ROWS)
    const = dict(D=d, DV=dv, D_PAD=pow2(d), DV_PAD=pow2(dv), G=g, G_BLOCK=g_block, N_RB=-(-g // g_block),
                 R_PAD=pow2(g_block), BLOCK_N=cfg["block_n"], LOG_PI=log_pi, DOT_F32=dt == "fp32")
    return dt, cfg, const


def _signature(kernel, const: dict, ptr: dict) -> dict:
    """Triton signature: constexprs, typed pointers (``ptr``: name -> element type), fp32 scale, i32 rest."""
    return {name: "constexpr" if name in const else "*" + ptr[name] if name in ptr else
            "fp32" if name == "scale" else "i32" for name in kernel.arg_names}


def compile_merge(*, arch: int = 90, dtype: str = "bf16", dv: int = 128, certify: bool = True,
                  per_coordinate: bool = True):
    """Compile the split-merge kernel for ``sm_<arch>``; returns the compiled kernel."""
    _check_compiled()
    dt = _DT[dtype]
    const = dict(DV=dv, DV_PAD=pow2(dv), BLOCK_R=16, CERTIFY=certify, PER_COORD=per_coordinate,
                 ROUND_P=dt != "fp32")
    ptr = {"Out": dt, **{name: "fp32" for name in ("PartS", "PartV", "Lse", "Var", "Tr", "Neff")}}
    sig = _signature(H.hajek_merge_kernel, const, ptr)
    return triton.compile(ASTSource(H.hajek_merge_kernel, sig, constexprs=const),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})


def compile_tail_moment(*, arch: int = 90, dtype: str = "bf16", d: int = 128, dv: int | None = None, g: int = 4,
                        block_n: int | None = None, num_warps: int | None = None, num_stages: int = 2,
                        log_pi: bool = True):
    """Compile the epilogue kernel of ``chebyshev_ucb`` (``return_tail_moment=True``) for ``sm_<arch>``."""
    dt, cfg, const = _tile_constants(dtype, d, dv, g, block_n, log_pi)
    const.update(STORE_LOW=dt != "fp32")
    ptr = {"Q": dt, "K": dt, "V": dt, "OutLow": dt, "P": "fp32", "O": "fp32", "Lse": "fp32", "Part": "fp32"}
    sig = _signature(H._tail_moment_kernel, const, ptr)
    return triton.compile(ASTSource(H._tail_moment_kernel, sig, constexprs=const),
                          target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="compile the kvcert decode kernels (decode, merge, the "
                                "chebyshev_ucb epilogue) for a CUDA target")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp16", "fp32"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--moments", nargs="+", default=["exact"], choices=["exact", "shifted"])
    args = p.parse_args(argv)
    rows, ok = [], True
    for dt in args.dtype:
        for mo in args.moments:
            for certify, split in ((True, True), (True, False), (False, True)):
                row = dict(kernel="decode", dtype=dt, moments=mo, certify=certify, split=split,
                           d=args.head_dim, g=args.group)
                try:
                    k = compile_decode(arch=args.arch, dtype=dt, d=args.head_dim, g=args.group,
                                       block_n=args.block_n, num_warps=args.num_warps, certify=certify,
                                       split=split, moments=mo)
                    row.update(resource_usage(k), ok=True)
                except Exception as e:  # report every failure, then exit non-zero
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
                    ok = False
                rows.append(row)
        try:
            row = dict(kernel="merge", dtype=dt, **resource_usage(compile_merge(arch=args.arch, dtype=dt,
                                                                                 dv=args.head_dim)), ok=True)
        except Exception as e:
            row = dict(kernel="merge", dtype=dt, ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            ok = False
        rows.append(row)
        try:
            row = dict(kernel="tail_moment", dtype=dt, d=args.head_dim, g=args.group,
                       **resource_usage(compile_tail_moment(arch=args.arch, dtype=dt, d=args.head_dim,
                                                            g=args.group, block_n=args.block_n,
                                                            num_warps=args.num_warps)), ok=True)
        except Exception as e:
            row = dict(kernel="tail_moment", dtype=dt, ok=False, error=f"{type(e).__name__}: {e}"[:2000])
            ok = False
        rows.append(row)
    json.dump({"arch": f"sm_{args.arch}", "triton": triton.__version__, "kernels": rows}, sys.stdout, indent=1)
    print()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
