#!/usr/bin/env python
"""Where one certified decode step's time goes, per call, on the default model.

Profiles the one-token decode forwards only (cProfile switched on and off by forward hooks on the
model, so prefills and compression are not counted) of greedy decoding of ``--new-tokens`` tokens,
run twice: ``kvcert.generate`` with ``PoissonPress(compression_ratio=r, sketch=...)`` (the certified
path; ``--sketch none`` is the paper design, the default the library's default) and the plain SDPA
loop over the same kept tokens (kvcert's deterministic SnapKV tokens copied into a ``DynamicCache``;
the ``truncated`` baseline of bench_generate.py). Prints per decode step and per call the cumulative
time of the functions of the step's path, found in the profile by file and function name (nothing
of the library is replaced or wrapped). cProfile adds a cost to every Python call (about a
microsecond), so the whole steps run slower than unprofiled and paths with more Python calls pay
more: compare the two runs of one invocation, and time whole steps with bench_generate.py.

Usage::

    python benchmarks/decode_breakdown.py --tokens 2000 --ratio 0.5 --new-tokens 18 [--sketch none]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import kvcert  # noqa: E402

#: the functions reported, in print order (callers before callees): (label, file suffix, function name);
#: a name defined more than once in its file (``update``) is told apart by its line (:func:`_line_of`)
PATH = [
    ("KVCertLayer.update", "kvcert/cache.py", "update"),
    ("Session.attend", "kvcert/attention.py", "attend"),
    ("  dispatch.decode", "kvcert/dispatch.py", "decode"),
    ("    dispatch.hajek_attention (token route)", "kvcert/dispatch.py", "hajek_attention"),
    ("    dispatch.sketch_hajek_attention (sketch route)", "kvcert/dispatch.py", "sketch_hajek_attention"),
    ("      compiled op, token pass", "kernels/cpu/__init__.py", "hajek_attention"),
    ("      sketch_step (checks, moments, epilogue)", "fast/sketch.py", "sketch_step"),
    ("        compiled op, sketch pass", "kernels/cpu/__init__.py", "_sketch_pass"),
    ("  Session._record", "kvcert/attention.py", "_record"),
    ("DynamicLayer.update", "transformers/cache_utils.py", "update"),
    ("sdpa_attention_forward", "transformers/integrations/sdpa_attention.py", "sdpa_attention_forward"),
]


def breakdown(stats: pstats.Stats, steps: int) -> list[tuple[str, float, float]]:
    """(label, ms per step, us per call) of each function of :data:`PATH` that ran, from a profile of
    ``steps`` decode steps: cumulative time (the function and what it calls), summed over the
    profile's entries of that file and name."""
    rows = []
    for label, suffix, name in PATH:
        calls, cum, line = 0, 0.0, _line_of(label)
        for (filename, lineno, func), (_, ncalls, _, ct, _) in stats.stats.items():
            if func == name and filename.replace("\\", "/").endswith(suffix) and line in (None, lineno):
                calls += ncalls
                cum += ct
        if calls:
            rows.append((label, cum * 1e3 / steps, cum * 1e6 / calls))
    return rows


def _line_of(label: str) -> int | None:
    """The first line of the method a label names where its file defines the name more than once."""
    if label == "KVCertLayer.update":
        from kvcert.cache import KVCertLayer

        return KVCertLayer.update.__code__.co_firstlineno
    if label == "DynamicLayer.update":
        from transformers.cache_utils import DynamicLayer

        return DynamicLayer.update.__code__.co_firstlineno
    return None


def profile_decode(model, run, new_tokens: int) -> tuple[pstats.Stats, int, float]:
    """Profile ``run(new_tokens)``'s one-token forwards: the stats, the number of decode steps and the
    profiled seconds per step (public forward hooks switch the profiler on and off)."""
    prof = cProfile.Profile()
    state = {"steps": 0, "on": False}

    def pre(module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        state["on"] = x is not None and x.shape[1] == 1
        if state["on"]:
            prof.enable()

    def post(module, args, kwargs, out):
        if state["on"]:
            prof.disable()
            state["steps"] += 1
        state["on"] = False

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True)]
    try:
        run(new_tokens)
    finally:
        for h in handles:
            h.remove()
    stats = pstats.Stats(prof)
    steps = max(state["steps"], 1)
    return stats, state["steps"], stats.total_tt / steps


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--new-tokens", type=int, default=18)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sketch", default="default",
                   help="'default' (the library's default design), 'none' (the paper design) or a sketch name")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench_generate import build_prompt, run_truncated_baseline

    from kvcert.generation import encode_prompts

    model, tok = kvcert.load_model()
    model.set_attn_implementation("sdpa")
    text, n = build_prompt(tok, args.tokens)
    ids = encode_prompts(tok, [text])[0]
    sketch = {} if args.sketch == "default" else {"sketch": None if args.sketch == "none" else args.sketch}
    press = kvcert.PoissonPress(compression_ratio=args.ratio, **sketch)
    runs = {
        f"certified (PoissonPress, sketch={args.sketch})": lambda k: kvcert.generate(
            model, tok, text, press=press, max_new_tokens=k, stop_at_eos=False),
        "SDPA over the same kept tokens": lambda k: run_truncated_baseline(model, ids, args.ratio, k),
    }
    print(f"{n} prompt tokens, ratio {args.ratio:g}, {args.new_tokens} new tokens, {args.threads} threads")
    for label, run in runs.items():
        run(3)  # warm-up
        stats, steps, per_step = profile_decode(model, run, args.new_tokens)
        print(f"\n{label}: {steps} decode steps, {per_step * 1e3:.2f} ms per step under the profiler\n")
        print("| function | ms / step | us / call |\n|---|---|---|")
        for name, ms, us in breakdown(stats, max(steps, 1)):
            print(f"| {name} | {ms:.2f} | {us:.1f} |")


if __name__ == "__main__":
    main()
