#!/usr/bin/env python
"""The compiled CPU op's sketch decode step of this tree against the same op built from another git revision.

For a change to ``kernels/cpu/hajek_decode.cpp``: the other revision's source (``git show REV:...``) is
built once under another library name (``kvcert_cpu_rev``, into ``--build``), and both ops are called with
the same arguments, the ones ``kvcert.kernels.cpu.sketch_hajek_attention`` passes for a recommended-design
decode step (the tilted sketch, one query per head). Shapes: the default model's attention (b = 1, h_q = 9,
h_kv = 3, d = dv = 64, float32), random normal keys, values and queries, kept n in ``--sizes``. Paired and
interleaved: each round times both ops over ``--reps`` calls, the order alternating every round; per size
the median time of each and the median [min, max] of the per-round ratios (this tree / the revision).
The other revision's op must take the same arguments (the op's schema unchanged). Writes JSON (``--out``).

``--model-decode N``: instead, inside the default model's own decode (``kvcert.generate`` of the first N tokens
of the pydoc haystack under ``PoissonPress(compression_ratio=--ratio)``, 40 new tokens) every sketch op call is
timed, the two ops alternating by decode step (30 layers each), so both see the model's cache state.

    .venv/bin/python benchmarks/bench_op_revision.py --rev a4f648b --threads 1 \\
        --out benchmarks/results/op_revision_sketch.json
    .venv/bin/python benchmarks/bench_op_revision.py --rev a4f648b --model-decode 2000 --ratio 0.75 \\
        --out benchmarks/results/op_revision_sketch_model.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

import kvcert.fast as F
from kvcert.kernels import cpu

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "kernels/cpu/hajek_decode.cpp"


def build_revision(rev: str, folder: Path):
    """The op of ``rev``, built under the library name ``kvcert_cpu_rev``; returns its sketch entry."""
    from torch.utils import cpp_extension

    src = subprocess.run(["git", "show", f"{rev}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    src = src.replace("TORCH_LIBRARY(kvcert_cpu,", "TORCH_LIBRARY(kvcert_cpu_rev,")
    src = src.replace("TORCH_LIBRARY_IMPL(kvcert_cpu,", "TORCH_LIBRARY_IMPL(kvcert_cpu_rev,")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "hajek_decode_rev.cpp"
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    print(f"building the op of {rev} in {folder} (about 2-4 minutes the first time)", flush=True)
    cpp_extension.load(name="kvcert_cpu_rev", sources=[str(path)], extra_cflags=list(cpu._CFLAGS),
                       extra_ldflags=list(cpu._LDFLAGS), build_directory=str(folder), is_python_module=False)
    return torch.ops.kvcert_cpu_rev.hajek_decode_sketch


@contextlib.contextmanager
def sketch_op_replaced(fn):
    """Within the block, ``kvcert.kernels.cpu``'s loaded op with its ``hajek_decode_sketch`` replaced by ``fn``."""
    ops = cpu.load()

    class Proxy:
        def __getattr__(self, name):
            return fn if name == "hajek_decode_sketch" else getattr(ops, name)

    cpu._state["ops"] = Proxy()
    try:
        yield ops
    finally:
        cpu._state["ops"] = ops


def op_arguments(n: int) -> tuple:
    """The arguments the library passes to ``hajek_decode_sketch`` for one decode step over n kept tokens."""
    g = torch.Generator().manual_seed(n)
    b, h_kv, G, d = 1, 3, 3, 64
    k, v = torch.randn(b, h_kv, 2 * n, d, generator=g), torch.randn(b, h_kv, 2 * n, d, generator=g)
    pi = torch.rand(b, h_kv, 2 * n, generator=g).clamp(0.2, 1.0)
    keep = torch.rand(b, h_kv, 2 * n, generator=g) < 0.5
    design = F.ClusterDesign(clusters=8, radius="fixed", multiplier=3.0, tilt=True)
    sketch = F.cluster_sketch(k, v, pi, keep, design, tilt=torch.randn(b, h_kv, d, generator=g))
    idx = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :n]
    K = torch.gather(k, 2, idx[..., None].expand(-1, -1, -1, d)).contiguous()
    V = torch.gather(v, 2, idx[..., None].expand(-1, -1, -1, d)).contiguous()
    log_pi = torch.log(torch.gather(pi, 2, idx) * torch.gather(keep, 2, idx)).float().contiguous()
    q = torch.randn(b, h_kv * G, d, generator=g)
    mu, r2 = F.value_moments(V, log_pi.exp())
    seen = {}
    op = cpu.load().hajek_decode_sketch
    with sketch_op_replaced(lambda *a: seen.setdefault("args", a) and op(*a)):  # the library's own call, recorded
        cpu.sketch_hajek_attention(q, K, V, None, sketch, log_pi=log_pi, value_center=mu, value_sqdist=r2,
                                   validate=False)
    return seen["args"]


def model_decode(other, tokens: int, ratio: float) -> list[dict]:
    """Per op: the calls, median and mean time of the sketch op inside the model's decode (module docstring)."""
    import kvcert
    from paper_repro.realmodel import haystack_ids

    fns = {"this tree": cpu.load().hajek_decode_sketch, "rev": other}
    times = {k: [] for k in fns}
    count = [0]

    def alternate(*a):
        which = "rev" if (count[0] // 30) % 2 == 0 else "this tree"   # by decode step of 30 layers
        t0 = time.perf_counter()
        out = fns[which](*a)
        times[which].append(time.perf_counter() - t0)
        count[0] += 1
        return out

    model, tok = kvcert.load_model()
    text = tok.decode(haystack_ids(tok, tokens)[0])
    with sketch_op_replaced(alternate):
        kvcert.generate(model, tok, text, press=kvcert.PoissonPress(compression_ratio=ratio, seed=0),
                        max_new_tokens=40, chat_template=False)
    return [dict(op=k, calls=len(v), median_us=1e6 * statistics.median(v), mean_us=1e6 * statistics.mean(v))
            for k, v in times.items()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", required=True, help="the git revision to compare with")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--build", default=str(Path.home() / ".cache" / "kvcert" / "op_revision"))
    p.add_argument("--out", default=None)
    p.add_argument("--model-decode", type=int, default=None, metavar="N",
                   help="time the two ops inside the default model's decode of an N-token prompt instead")
    p.add_argument("--ratio", type=float, default=0.75, help="compression ratio of --model-decode")
    args = p.parse_args(argv)
    other = build_revision(args.rev, Path(args.build))
    if args.model_decode:
        rows = model_decode(other, args.model_decode, args.ratio)
        for r in rows:
            print(f"{r['op']}: {r['calls']} calls, median {r['median_us']:.1f} us, mean {r['mean_us']:.1f} us")
        write(args, rows, dict(model_decode=args.model_decode, ratio=args.ratio))
        return
    torch.set_num_threads(args.threads)
    here = cpu.load().hajek_decode_sketch
    rows = []
    for n in args.sizes:
        a = op_arguments(n)
        calls = {"this tree": lambda: here(*a), args.rev: lambda: other(*a)}
        for f in calls.values():
            f()
            f()
        times = {k: [] for k in calls}
        for r in range(args.rounds):
            for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                t0 = time.perf_counter()
                for _ in range(args.reps):
                    calls[name]()
                times[name].append((time.perf_counter() - t0) / args.reps)
        ratios = [x / y for x, y in zip(times["this tree"], times[args.rev])]
        row = dict(n=n, this_ms=1e3 * statistics.median(times["this tree"]),
                   rev_ms=1e3 * statistics.median(times[args.rev]), ratio=statistics.median(ratios),
                   ratio_min=min(ratios), ratio_max=max(ratios))
        rows.append(row)
        print(f"n = {n}: this tree {row['this_ms']:.3f} ms, {args.rev} {row['rev_ms']:.3f} ms, ratio "
              f"{row['ratio']:.3f} [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]", flush=True)
    write(args, rows, dict(threads=args.threads, rounds=args.rounds, reps=args.reps))


def write(args, rows, extra: dict) -> None:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = dict(rev=args.rev, head=head.strip(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  **extra, rows=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
