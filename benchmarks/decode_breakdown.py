#!/usr/bin/env python
"""Where one certified decode step's time goes, per call, on the default model (issue 15).

Wraps the functions of the per-step path with ``time.perf_counter_ns`` (active during one-token
decode forwards only, so prefills and compression are not counted) and runs greedy decoding of
``--new-tokens`` tokens twice: ``kvcert.generate`` with ``PoissonPress(compression_ratio=r)``
(the certified path) and the plain SDPA loop over the same kept tokens (kvcert's deterministic
SnapKV tokens copied into a ``DynamicCache``; the ``truncated`` baseline of bench_generate.py).
Prints per decode step and per call: the forward, the cache update (``KVCertLayer.update`` /
``DynamicLayer.update``), the attention (``Session.attend`` / ``sdpa_attention_forward``) and,
inside kvcert's, the estimator and the recording. A wrapper costs about a microsecond; single
runs on a shared 2-core machine vary by 10-20 %.

Usage::

    python benchmarks/decode_breakdown.py --tokens 2000 --ratio 0.5 --new-tokens 18
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import kvcert  # noqa: E402
import kvcert.attention as A  # noqa: E402
import kvcert.cache as C  # noqa: E402
import kvcert.dispatch as D  # noqa: E402
from kvcert.fast import estimators as E  # noqa: E402

T: collections.Counter = collections.Counter()
N: collections.Counter = collections.Counter()
ON = [False]
ORDER: list[str] = []  # print order: the wrapping order, callers before callees


def wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def timed(*a, **k):
        if not ON[0]:
            return fn(*a, **k)
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            T[label] += time.perf_counter_ns() - t
            N[label] += 1

    setattr(owner, name, timed)
    ORDER.append(label)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--new-tokens", type=int, default=18)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench_generate import build_prompt, run_truncated_baseline
    from transformers import AttentionInterface
    from transformers.cache_utils import DynamicLayer
    from transformers.integrations import sdpa_attention

    from kvcert.generation import encode_prompts

    model, tok = kvcert.load_model()
    model.set_attn_implementation("sdpa")
    text, n = build_prompt(tok, args.tokens)
    ids = encode_prompts(tok, [text])[0]

    ORDER.append("forward (whole decode step)")
    wrap(C.KVCertLayer, "update", "KVCertLayer.update")
    wrap(A.Session, "attend", "Session.attend")
    wrap(D, "hajek_attention", "  dispatch.hajek_attention")
    wrap(E, "check_attention_inputs", "    check_attention_inputs")
    wrap(E, "_one_pass", "    fast._one_pass (the arithmetic)")
    wrap(C.KVCertLayer, "value_moments", "  KVCertLayer.value_moments")
    wrap(A.Session, "_record", "  Session._record")
    wrap(A.Session, "_check_finite", "  Session._check_finite")
    wrap(DynamicLayer, "update", "DynamicLayer.update")
    wrap(sdpa_attention, "sdpa_attention_forward", "sdpa_attention_forward")
    AttentionInterface._global_mapping["sdpa"] = sdpa_attention.sdpa_attention_forward
    A.BASE_ATTENTION["sdpa"] = sdpa_attention.sdpa_attention_forward

    clock = {"t": 0, "total": 0}

    def pre(module, a, kw):
        x = kw.get("input_ids", a[0] if a else None)
        ON[0] = x is not None and x.shape[1] == 1
        clock["t"] = time.perf_counter_ns()

    def post(module, a, kw, out):
        if ON[0]:
            T["forward (whole decode step)"] += time.perf_counter_ns() - clock["t"]
            N["forward (whole decode step)"] += 1
        ON[0] = False

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True)
    runs = {
        "certified (PoissonPress)": lambda k: kvcert.generate(
            model, tok, text, press=kvcert.PoissonPress(compression_ratio=args.ratio), max_new_tokens=k,
            stop_at_eos=False),
        "SDPA over the same kept tokens": lambda k: run_truncated_baseline(model, ids, args.ratio, k),
    }
    print(f"{n} prompt tokens, ratio {args.ratio:g}, {args.new_tokens} new tokens, {args.threads} threads")
    for label, run in runs.items():
        run(3)  # warm-up
        T.clear()
        N.clear()
        run(args.new_tokens)
        steps = N["forward (whole decode step)"]
        print(f"\n{label}: {steps} decode steps\n\n| function | ms / step | us / call |\n|---|---|---|")
        for k in ORDER:
            if not N[k]:
                continue
            print(f"| {k} | {T[k] / 1e6 / steps:.2f} | {T[k] / 1e3 / N[k]:.1f} |")


if __name__ == "__main__":
    main()
