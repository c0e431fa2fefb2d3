#!/usr/bin/env python
"""The recommended design's cost on CPU against today's paper design: decode step and eviction.

The recommended design is the token design with the tilted cluster sketch and the ``tilted_hull``
radius, ``kvcert.fast.TokenDesign(compression_ratio=r, sketch="tilted", kind="tilted_hull")``; the
paper design is ``TokenDesign(compression_ratio=r)`` (no sketch, Chebyshev on the HT trace). The goal
lines (docs/design.md, the recommended design): the decode attention step <= 1.5x today's trace
certificate at 4k and 8k kept tokens; the eviction, the sketch's construction included, <= 2x
today's Poisson eviction at 2k-8k tokens.

Shapes: the default model's attention (SmolLM2-135M: b = 1, h_q = 9, h_kv = 3, d = dv = 64,
float32), scale 1/sqrt(d). **Random keys, values and queries** (standard normal) and a lognormal
importance (exp(2 z), z standard normal: a skewed importance, so the PPS capping iterates): the
timed work of both designs is fixed-shape (k-means runs a fixed number of Lloyd rounds, one SVD per
head), so its cost does not depend on the data beyond the capping loop, which both designs share.

Cells (each at torch.set_num_threads(1) and (2)):

1. ``decode`` at kept n (default 2048, 4096, 8192): the compressed cache is what the recommended
   design's eviction of 2n tokens at ratio 0.5 leaves (``TokenDesign.evict`` as ``PoissonPress`` runs
   it: about n - 17 kept tokens per head, padded to the largest head, log pi beside them, the tilted
   sketch of the evicted tokens); its value moments (``kvcert.fast.value_moments``) are computed once,
   as the Hugging Face cache keeps them. Both designs decode the same kept tokens. Timed, one
   decode query per query head:

   - ``paper_op``: today's trace certificate, ``kvcert.dispatch.hajek_attention(q, K, V, log_pi=...,
     per_coordinate=False, value_center=mu, value_sqdist=r2, validate=False, backend="fast")``: on CPU
     the compiled op (``kvcert.kernels.cpu``; the script checks the estimate's ``route``);
   - ``paper_torch``: the same call with ``KVCERT_CPU_OP=0`` (set outside the timer): ``kvcert.fast``;
   - ``rec``: the recommended decode, ``kvcert.fast.sketch_hajek_attention(q, K, V, None, sketch,
     log_pi=..., value_center=mu, value_sqdist=r2, validate=False, trace=False)`` and
     ``kvcert.fast.recorded_trace`` (V_cl clipped at (H / 3)^2: the radius min(3 sqrt(V_cl), H) that
     ``kvcert.dispatch.decode``'s sketch route records);
   - ``paper_route`` / ``rec_route``: the whole per-layer step, ``kvcert.dispatch.decode`` on a layer
     holding the same tensors (token route on the compiled op; sketch route), records included.

2. ``evict`` at n (default 2048, 4096, 8192) tokens, ratio 0.5, from a given importance (the scorer
   is not timed: both designs score alike). Timed:

   - ``paper``: ``TokenDesign.evict`` (importance shift, pi, the Poisson draw, compaction) at
     ``budget(n)`` and ``sizes``, as ``PoissonPress`` calls it for one layer;
   - ``rec``: the same at ``sampled_budget(n, d, dv)``, plus the tilt points
     (``kvcert.fast.window_tilt`` of 32 window queries) and the tilted sketch
     (``kvcert.fast.cluster_sketch``: k-means with its host SVD, the tilted moments), as
     ``PoissonPress(sketch="tilted", kind="tilted_hull")`` runs it;
   - ``paper_decide`` / ``rec_decide``: the decision object's route: ``TokenDesign.decide`` (at the
     sampled budget for rec) + ``kvcert.fast.compact``, and for rec ``TokenDesign.sketch_of``.

3. ``--vllm`` (in ``.venv-vllm``): the vLLM backend's decode routes on a paged ``vec`` cache
   (16-token blocks, shuffled block ids) holding n (default 1024, 2048, 4096) compacted tokens:
   ``kvcert.vllm.backend.token_decode`` (paged compiled op, kind chebyshev) vs
   ``sketch_decode`` (gather + ``sketch_hajek_attention``, kind tilted_hull).

Every cell is paired and interleaved: each round times every variant of the cell over ``--reps``
calls, in an order rotated every round (A, B, A, B ... then B, A ...), after a warm-up; per variant
the median and [min, max] of the per-call time over rounds, per ratio the median and [min, max] of
the per-round ratios. Writes JSON (``--out``, default benchmarks/results/recommended_cost.json) and prints a
progress line per cell.

Usage::

    .venv/bin/python benchmarks/bench_recommended.py                 # 15 rounds, 1 and 2 threads
    .venv/bin/python benchmarks/bench_recommended.py --quick         # 7 rounds, fewer reps
    .venv-vllm/bin/python benchmarks/bench_recommended.py --only vllm --vllm --out /tmp/v.json
    .venv/bin/python benchmarks/bench_recommended.py --profile --append   # where the time goes, into the JSON

Timings on a shared 2-core machine are noisy: the paired ratios are the numbers to read.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import kvcert.dispatch as D  # noqa: E402
import kvcert.fast as F  # noqa: E402
from conftest import MALLOPT  # noqa: E402  (glibc keeps freed memory, as a caching allocator would)

B, H_Q, H_KV, DIM = 1, 9, 3, 64
SCALE = 1.0 / math.sqrt(DIM)
RATIO, DELTA, OBS_WINDOW = 0.5, 0.05, 32
DECODE_TARGET, EVICT_TARGET = 1.5, 2.0
OUT = ROOT / "benchmarks" / "results" / "recommended_cost.json"


def paper_design() -> F.TokenDesign:
    """The paper's design, named in full (no sketch, Chebyshev on the HT trace) whatever the defaults become."""
    return F.TokenDesign(compression_ratio=RATIO, sketch=None, kind="chebyshev")


def recommended_design() -> F.TokenDesign:
    return F.TokenDesign(compression_ratio=RATIO, sketch="tilted", kind="tilted_hull")


@contextlib.contextmanager
def cpu_op(enabled: bool):
    """KVCERT_CPU_OP=0 while disabled (kvcert.dispatch reads it per call); restored after."""
    old = os.environ.get(D.CPU_OP_ENV_VAR)
    if not enabled:
        os.environ[D.CPU_OP_ENV_VAR] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(D.CPU_OP_ENV_VAR, None)
        else:
            os.environ[D.CPU_OP_ENV_VAR] = old


# ---------------------------------------------------------------------------------------------------
# inputs (untimed)

def prefill(n: int, seed: int = 0) -> dict:
    """A layer's prefill of n tokens: keys, values (1, h_kv, n, d), importance (1, h_kv, n) float32,
    the observation window's queries (1, h_q, 32, d), valid / pi / positions as a fresh cache holds them."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_KV, n, DIM, generator=g)
    v = torch.randn(B, H_KV, n, DIM, generator=g)
    u = torch.exp(2.0 * torch.randn(B, H_KV, n, generator=g))
    qwin = torch.randn(B, H_Q, OBS_WINDOW, DIM, generator=g)
    valid = torch.ones(B, H_KV, n, dtype=torch.bool)
    log_w = torch.zeros(B, H_KV, n)
    pos = torch.arange(n).expand(B, H_KV, n).contiguous()
    return dict(k=k, v=v, u=u, qwin=qwin, valid=valid, log_w=log_w, pos=pos, n=n)


def press_evict(design: F.TokenDesign, p: dict):
    """One layer's eviction as ``PoissonPress._compress`` runs it after scoring (all rows valid)."""
    n = p["n"]
    budget = design.sampled_budget(n, DIM, DIM)
    sz = design.sizes(0, budget=budget)
    tilt = None
    if design.sketch is not None and design.sketch.tilt:
        tilt = F.window_tilt(p["qwin"], H_KV, window=design.observation_window)
    top = torch.tensor([[sz.top]])
    bud = torch.full((B, H_KV), float(budget), dtype=torch.float64)
    return design.evict(p["k"], p["v"], p["u"], bud, sinks=sz.sinks, window=sz.window, top=top, valid=p["valid"],
                        pi=p["log_w"].exp(), positions=p["pos"], layer=0, event=0, sketch=design.sketch,
                        tilt=tilt, scale=SCALE)


def decide_evict(design: F.TokenDesign, p: dict):
    """The decision object's route: decide at the sampled budget, compact, and the sketch of the evicted."""
    n = p["n"]
    dec = design.decide(p["u"], layer=0, event=0, budget=design.sampled_budget(n, DIM, DIM))
    cc = F.compact(dec.keep, p["k"], p["v"], dec.pi, p["pos"])
    sketch = design.sketch_of(p["k"], p["v"], dec, queries=p["qwin"], scale=SCALE)
    return cc, sketch


def decode_inputs(kept: int, seed: int = 0) -> dict:
    """The compressed cache the recommended design leaves from 2 * kept tokens, with its value moments."""
    p = prefill(2 * kept, seed)
    cc = press_evict(recommended_design(), p)
    lp = torch.log(cc.pi).to(torch.float32).contiguous()
    mu, r2 = F.value_moments(cc.values, log_pi=lp)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(B, H_Q, DIM, generator=g)
    return dict(q=q, K=cc.keys, V=cc.values, log_pi=lp, mu=mu, r2=r2, sketch=cc.sketch, kept=cc.kept,
                positions=cc.positions)


class _Layer(SimpleNamespace):
    """The attributes of a cache layer ``kvcert.dispatch.decode`` reads, value moments cached."""

    def value_moments(self, distances=True):
        return self.mu, self.r2 if distances else None


def decode_variants(c: dict) -> dict:
    q, K, V, lp, mu, r2, sk = (c[x] for x in ("q", "K", "V", "log_pi", "mu", "r2", "sketch"))
    kw = dict(log_pi=lp, per_coordinate=False, value_center=mu, value_sqdist=r2, validate=False, backend="fast")
    tok_layer = _Layer(keys=K, values=V, log_weights=lp, positions=c["positions"], valid=lp > float("-inf"),
                       kept=c["kept"], block_size=None, sketch=None, mu=mu, r2=r2)
    sk_layer = _Layer(**{**vars(tok_layer), "sketch": sk})
    q4 = q[:, :, None]
    opts = F.estimate_options("chebyshev")

    def paper():
        return D.hajek_attention(q, K, V, **kw)

    def rec():
        ce = F.sketch_hajek_attention(q, K, V, None, sk, log_pi=lp, value_center=mu, value_sqdist=r2, delta=DELTA,
                                       validate=False, trace=False)
        return F.recorded_trace(ce, "tilted_hull")  # V_cl clipped at (H / 3)^2: radius min(3 sqrt(V_cl), H)

    def paper_route():
        return D.decode(q4, tok_layer, scale=SCALE, options=opts, kind="chebyshev", delta=DELTA, backend="fast")

    def rec_route():
        return D.decode(q4, sk_layer, scale=SCALE, options=opts, kind="tilted_hull", delta=DELTA)

    # (function, CPU op enabled)
    return {"paper_op": (paper, True), "paper_torch": (paper, False), "rec": (rec, True),
            "paper_route": (paper_route, True), "rec_route": (rec_route, True)}


def check_decode(c: dict, fns: dict) -> str | None:
    """Same output on every route (so the timing compares like with like), and the routes are the ones named;
    the route variants are dropped from ``fns`` (the error returned) when ``kvcert.dispatch.decode`` fails."""
    with cpu_op(True):
        a = fns["paper_op"][0]()
        assert a.route == "cpu_op", f"paper_op ran {a.route!r}, not the compiled op"
    with cpu_op(False):
        b = fns["paper_torch"][0]()
        assert b.route == "torch", f"paper_torch ran {b.route!r}"
    ce = F.sketch_hajek_attention(c["q"], c["K"], c["V"], None, c["sketch"], log_pi=c["log_pi"], trace=False)
    for name, x in (("paper_torch", b.output), ("rec", ce.output)):
        err = float((x - a.output).abs().max())
        assert err < 1e-4, f"{name} output differs from paper_op by {err}"
    assert bool(torch.isfinite(ce.radius).all()), "recommended radius not finite"
    try:
        routes = (fns["rec_route"][0]().route, fns["paper_route"][0]().route)
    except Exception as e:  # noqa: BLE001  (a library state this script cannot fix: time the functions alone)
        print(f"kvcert.dispatch.decode failed ({type(e).__name__}: {e}); the route variants are left out",
              flush=True)
        del fns["rec_route"], fns["paper_route"]
        return f"{type(e).__name__}: {e}"
    assert routes == ("sketch", "token"), routes
    return None


def evict_variants(p: dict) -> dict:
    dp, dr = paper_design(), recommended_design()
    return {"paper": (lambda: press_evict(dp, p), True), "rec": (lambda: press_evict(dr, p), True),
            "paper_decide": (lambda: decide_evict(dp, p), True), "rec_decide": (lambda: decide_evict(dr, p), True)}


def check_evict(p: dict) -> None:
    a = press_evict(paper_design(), p)
    b = press_evict(recommended_design(), p)
    assert a.sketch is None and b.sketch is not None
    kb, sk = decide_evict(recommended_design(), p)
    assert torch.equal(kb.kept, b.kept), "decide route keeps other tokens than the press route"
    assert torch.allclose(sk.mean, b.sketch.mean, atol=1e-5), "decide route's sketch differs"


# ---------------------------------------------------------------------------------------------------
# timing

def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def time_cell(fns: dict, rounds: int, reps: int, warmup: int, pairs: list[tuple[str, str]]) -> dict:
    """Interleaved rounds; per variant the per-call time (us), per pair (num, den) the per-round ratio."""
    names = list(fns)
    for _ in range(warmup):
        for f, op in fns.values():
            with cpu_op(op):
                f()
    times = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            f, op = fns[name]
            with cpu_op(op):
                t0 = time.perf_counter_ns()
                for _ in range(reps):
                    f()
                times[name].append((time.perf_counter_ns() - t0) / reps / 1e3)
    out = {"us": {k: _stats(v) for k, v in times.items()}, "ratios": {}}
    for num, den in pairs:
        out["ratios"][f"{num}/{den}"] = _stats([a / b for a, b in zip(times[num], times[den])])
    return out


DECODE_PAIRS = [("rec", "paper_op"), ("rec", "paper_torch"), ("paper_torch", "paper_op"),
                ("rec_route", "paper_route")]
EVICT_PAIRS = [("rec", "paper"), ("rec_decide", "paper_decide"), ("rec_decide", "paper")]


def run_decode(sizes, threads, rounds, reps, warmup) -> list[dict]:
    rows = []
    for n in sizes:
        c = decode_inputs(n)
        fns = decode_variants(c)
        route_error = check_decode(c, fns)
        pairs = [pr for pr in DECODE_PAIRS if pr[0] in fns and pr[1] in fns]
        for t in threads:
            torch.set_num_threads(t)
            res = time_cell(fns, rounds, reps, warmup, pairs)
            row = {"cell": "decode", "kept_target": n, "kept": [int(x) for x in c["kept"].reshape(-1)],
                   "slots": int(c["K"].shape[2]), "threads": t, "rounds": rounds, "reps": reps, **res}
            if route_error:
                row["route_error"] = route_error
            rows.append(row)
            rr, us = res["ratios"], res["us"]
            print(f"decode kept={n} threads={t}: paper_op {us['paper_op']['median']:.0f} us, "
                  f"paper_torch {us['paper_torch']['median']:.0f} us, rec {us['rec']['median']:.0f} us; "
                  f"rec/paper_op {rr['rec/paper_op']['median']:.2f} "
                  f"[{rr['rec/paper_op']['min']:.2f}, {rr['rec/paper_op']['max']:.2f}], "
                  f"rec/paper_torch {rr['rec/paper_torch']['median']:.2f}"
                  + (f", route {rr['rec_route/paper_route']['median']:.2f}" if "rec_route/paper_route" in rr else ""),
                  flush=True)
    return rows


def run_evict(sizes, threads, rounds, reps, warmup) -> list[dict]:
    rows = []
    for n in sizes:
        p = prefill(n)
        check_evict(p)
        fns = evict_variants(p)
        for t in threads:
            torch.set_num_threads(t)
            res = time_cell(fns, rounds, reps, warmup, EVICT_PAIRS)
            row = {"cell": "evict", "n": n, "ratio": RATIO, "threads": t, "rounds": rounds, "reps": reps, **res}
            rows.append(row)
            rr, us = res["ratios"], res["us"]
            print(f"evict n={n} threads={t}: paper {us['paper']['median']:.0f} us, rec {us['rec']['median']:.0f} us; "
                  f"rec/paper {rr['rec/paper']['median']:.2f} [{rr['rec/paper']['min']:.2f}, "
                  f"{rr['rec/paper']['max']:.2f}], decide route {rr['rec_decide/paper_decide']['median']:.2f}",
                  flush=True)
    return rows


def vllm_inputs(n: int, seed: int = 0, bs: int = 16) -> dict:
    """A paged ``vec`` cache (num_blocks, h_kv, bs, 2 d) holding n compacted tokens of one row in shuffled
    blocks, log pi (1, h_kv, M bs) (-inf past n), and the tilted sketch of n evicted tokens."""
    g = torch.Generator().manual_seed(seed)
    M = -(-n // bs)
    nb = 2 * M + 3
    cache = torch.randn(nb, H_KV, bs, 2 * DIM, generator=g)
    ids = torch.randperm(nb, generator=g)[:M].reshape(1, M)
    pi = torch.empty(1, H_KV, M * bs).uniform_(0.05, 1.0, generator=g)
    pi[..., :4] = 1.0
    pi[..., n - 32:n] = 1.0
    lp = pi.log()
    lp[..., n:] = float("-inf")
    p = prefill(2 * n, seed + 1)
    design = recommended_design()
    dec = design.decide(p["u"], budget=design.sampled_budget(2 * n, DIM, DIM))
    sketch = design.sketch_of(p["k"], p["v"], dec, queries=p["qwin"], scale=SCALE)
    q = torch.randn(1, H_Q, DIM, generator=g)
    return dict(q=q, cache=cache, ids=ids, lp=lp, sketch=sketch)


def run_vllm(sizes, threads, rounds, reps, warmup) -> list[dict]:
    from kvcert.vllm import backend as VB

    rows = []
    for n in sizes:
        c = vllm_inputs(n)
        args = (c["q"], c["cache"], c["ids"], c["lp"])
        fns = {"compacted": (lambda: VB.token_decode(*args, SCALE, "chebyshev", DELTA), True),
               "sketched": (lambda: VB.sketch_decode(*args, c["sketch"], SCALE, "tilted_hull", DELTA), True)}
        first = fns["compacted"][0]()
        assert first.route.code == "paged_cpu_op", first.route
        o1, o2 = first.output, fns["sketched"][0]().output
        err = float((o1 - o2).abs().max())
        assert err < 1e-4, f"sketched output differs from compacted by {err}"
        for t in threads:
            torch.set_num_threads(t)
            res = time_cell(fns, rounds, reps, warmup, [("sketched", "compacted")])
            rows.append({"cell": "vllm_decode", "kept": n, "threads": t, "rounds": rounds, "reps": reps, **res})
            rr, us = res["ratios"]["sketched/compacted"], res["us"]
            print(f"vllm decode kept={n} threads={t}: compacted {us['compacted']['median']:.0f} us, sketched "
                  f"{us['sketched']['median']:.0f} us; ratio {rr['median']:.2f} [{rr['min']:.2f}, {rr['max']:.2f}]",
                  flush=True)
    return rows


def profile_decode(n: int, threads: int, calls: int = 200) -> dict:
    """torch.profiler of the recommended decode step and the paper op (self CPU time per op, per call)."""
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    c = decode_inputs(n)
    fns = decode_variants(c)
    out = {}
    for name in ("rec", "paper_op", "paper_torch"):
        f, op = fns[name]
        with cpu_op(op):
            for _ in range(10):
                f()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls):
                    f()
        ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ev) / calls
        top = [{"op": e.key, "self_us_per_call": e.self_cpu_time_total / calls, "calls_per_step": e.count / calls}
               for e in ev[:15]]
        out[name] = {"self_us_per_call_total": total, "top": top}
        print(f"profile {name} kept={n} threads={threads}: {total:.0f} us of op self time per call", flush=True)
        for e in top[:12]:
            print(f"   {e['self_us_per_call']:8.1f} us  x{e['calls_per_step']:.0f}  {e['op']}", flush=True)
    return out


def evict_breakdown(n: int, threads: int, reps: int = 5) -> dict:
    """Median ms per call of the recommended eviction's parts at n tokens (public functions only, interleaved):
    the paper eviction, k-means with 0 Lloyd iterations (the host SVD initialisation + one assignment
    round) and with the design's 10, the tilted moments given the labels, and the whole eviction."""
    torch.set_num_threads(threads)
    p = prefill(n)
    dp, dr = paper_design(), recommended_design()
    sk = dr.sketch
    dec = dr.decide(p["u"], budget=dr.sampled_budget(n, DIM, DIM))
    pi, keep = dec.pi.reshape(B, H_KV, n), dec.keep.reshape(B, H_KV, n)   # float64 pi, as TokenDesign.evict passes
    tilt = F.window_tilt(p["qwin"], H_KV, window=dr.observation_window)
    lab = F.kmeans_assign(p["k"], sk.clusters, iterations=sk.iterations, valid=p["valid"])
    parts = {
        "paper_evict": lambda: press_evict(dp, p),
        "kmeans_0_iterations": lambda: F.kmeans_assign(p["k"], sk.clusters, iterations=0, valid=p["valid"]),
        "kmeans": lambda: F.kmeans_assign(p["k"], sk.clusters, iterations=sk.iterations, valid=p["valid"]),
        "moments_given_labels": lambda: F.cluster_sketch(p["k"], p["v"], pi, keep, sk, labels=lab, tilt=tilt,
                                                         scale=SCALE),
        "rec_evict": lambda: press_evict(dr, p),
    }
    times = {k: [] for k in parts}
    for f in parts.values():
        f()
    for _ in range(reps):
        for k, f in parts.items():
            t0 = time.perf_counter_ns()
            f()
            times[k].append((time.perf_counter_ns() - t0) / 1e6)
    out = {k: statistics.median(v) for k, v in times.items()}
    print(f"evict breakdown n={n} threads={threads}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in out.items()),
          flush=True)
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-sizes", type=int, nargs="+", default=[2048, 4096, 8192], help="kept tokens per head")
    ap.add_argument("--evict-sizes", type=int, nargs="+", default=[2048, 4096, 8192], help="tokens at the event")
    ap.add_argument("--vllm-sizes", type=int, nargs="+", default=[1024, 2048, 4096], help="paged tokens per head")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (>= 7)")
    ap.add_argument("--decode-reps", type=int, default=20, help="calls per variant per round (decode)")
    ap.add_argument("--evict-reps", type=int, default=3, help="calls per variant per round (eviction)")
    ap.add_argument("--only", nargs="+", choices=("decode", "evict", "vllm"), default=None,
                    help="run these cells only (default decode and evict, and vllm with --vllm)")
    ap.add_argument("--vllm", action="store_true", help="also the vLLM backend's decode routes (needs vllm)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing: torch.profiler of the decode step at the largest decode size and the "
                         "recommended eviction's parts at every eviction size (under 'profiles' in --out)")
    ap.add_argument("--quick", action="store_true", help="7 rounds, 10 decode reps, 2 eviction reps")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--append", action="store_true",
                    help="add this run's rows to those already in --out (e.g. a rerun with OPENBLAS_NUM_THREADS=1)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.decode_reps, args.evict_reps = 7, 10, 2
    if args.rounds < 7:
        ap.error(f"--rounds must be >= 7, got {args.rounds}")
    cells = set(args.only or ["decode", "evict"] + (["vllm"] if args.vllm else []))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": _commit(),
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "load_average_start": os.getloadavg(), "mallopt_keep_freed_memory": MALLOPT,
            "shape": {"b": B, "h_q": H_Q, "h_kv": H_KV, "d": DIM, "dv": DIM, "dtype": "float32"},
            "data": "random normal keys/values/queries, lognormal importance exp(2 z)",
            "designs": {"paper": "TokenDesign(compression_ratio=0.5, sketch=None, kind='chebyshev')",
                        "rec": "TokenDesign(compression_ratio=0.5, sketch='tilted', kind='tilted_hull')"},
            "targets": {"decode": f"rec/paper_op <= {DECODE_TARGET} at kept 4096 and 8192",
                        "evict": f"rec/paper <= {EVICT_TARGET} at n = 2048..8192"},
            "argv": sys.argv[1:], "unit": "microseconds per call; ratios per round, median [min, max]",
            "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                   "KVCERT_CPU_OP")}}
    if args.profile:
        n = max(args.decode_sizes)
        prof = {"meta": meta, "decode": {str(t): profile_decode(n, t) for t in args.threads},
                "evict_breakdown_ms": {str(m): {str(t): evict_breakdown(m, t) for t in args.threads}
                                       for m in args.evict_sizes}}
        result = json.loads(args.out.read_text()) if args.append and args.out.exists() else {}
        result.setdefault("profiles", []).append(prof)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
        return 0
    rows = []
    if "decode" in cells:
        rows += run_decode(args.decode_sizes, args.threads, args.rounds, args.decode_reps, 5)
    if "evict" in cells:
        rows += run_evict(args.evict_sizes, args.threads, args.rounds, args.evict_reps, 2)
    if "vllm" in cells:
        rows += run_vllm(args.vllm_sizes, args.threads, args.rounds, args.decode_reps, 5)
    meta["load_average_end"] = os.getloadavg()
    runs, old = [], []
    if args.append and args.out.exists():
        prev = json.loads(args.out.read_text())
        runs, old = prev.get("runs", []), prev.get("rows", [])
        extra = {k: v for k, v in prev.items() if k not in ("runs", "rows")}
    else:
        extra = {}
    for row in rows:  # which run (its meta, env included) measured the row
        row["run"] = len(runs)
        row["openblas_threads"] = os.environ.get("OPENBLAS_NUM_THREADS", "default")
    args.out.write_text(json.dumps({"runs": runs + [meta], "rows": old + rows, **extra}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
