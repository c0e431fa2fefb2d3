"""Microbenchmark: the plugin's masked decode attention against vLLM's C++ CPU kernel, 30 layers, no engine.

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/bench_masked_decode.py [--lengths 1025 2049 4097]
        [--designs block default paper]

One decode step of ``rows`` requests (SmolLM2-135M's attention shapes: 9
query heads, 3 KV heads, head size 64, block size 64) over 30 layer caches
(distinct tensors, so a layer's cache is not in the CPU cache when it is
read, as in a forward pass):

- ``stock``: ``ops.cpu_attention_with_kv_cache`` (the C++ kernel of vLLM's
  CPU backend) over every block of each sequence;
- ``kvcert``: ``CertifiedCPUAttentionImpl.forward`` inside a plugin step
  (:class:`kvcert.vllm.worker.Step`), by ``--designs``:

  - ``block`` (``granularity="block"``): the row plan, ``block_decode`` over
    the kept blocks (about half: every prompt block but the first is evicted
    with probability 0.5, as at compression 0.5) and the certificate;
  - ``default`` (the token design the plugin serves by default: the tilted
    sketch, ``tilted_hull``) and ``paper`` (``sketch=None``, ``chebyshev``):
    each request's prompt compacted as the plugin compacts it (every KV
    head keeps a Poisson sample of about half the prompt tokens, pi uniform
    in (0, 1], in the first m blocks of its table; the default design also
    holds each layer's cluster sketch of the evicted tokens,
    ``kvcert.fast.cluster_sketch`` of the plugin's design, and the compacted
    slots' kept value sums the plugin takes when it compacts), then the
    compacted rows' decode (``sketch_decode`` or ``token_decode``: the
    compiled op's paged route where it builds) and the certificate.

Interleaved repetitions; prints min and median ms per step and the ratio of
the minima. ``--fixed-mmap-threshold`` pins glibc's ``M_MMAP_THRESHOLD`` at
its 128 KiB default (glibc otherwise raises it after the first large free),
so every multi-MB temporary is mapped and page-faulted afresh, as it was
inside vLLM's worker. One thread is what vLLM's CPU worker gets on a 2-core machine
(it keeps one core for the engine core). No timing assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _compacted_states(ids, seq_len: int, bs: int, h: int, d: int, layers: int, caches, table, cfg) -> dict:
    """Each request's :class:`kvcert.vllm.worker.Compacted` state: per (layer, KV head) a Poisson sample of the
    n = seq_len - 1 prompt tokens (pi uniform in (0, 1], kept with probability pi: about n / 2), its slots
    first in the head's row of log pi, padding -inf, m = the most kept slots in blocks; with a sketched design
    each layer's sketch of the evicted tokens built from that layer's cache (the values the step reads)."""
    from kvcert import fast
    from kvcert.vllm.backend import gather_rows
    from kvcert.vllm.worker import Compacted

    n = seq_len - 1
    design = fast.resolve_sketch(cfg.sketch, cfg.kind)
    states = {}
    for j, rid in enumerate(ids):
        pi = torch.rand(layers, h, n, dtype=torch.float64).clamp_(min=1e-3)
        keep = torch.rand(layers, h, n, dtype=torch.float64) < pi
        counts = keep.sum(-1)
        m = -(-int(counts.max()) // bs)
        log_pi = torch.full((layers, h, m * bs), float("-inf"))
        for li in range(layers):
            for hh in range(h):
                c = int(counts[li, hh])
                log_pi[li, hh, :c] = pi[li, hh][keep[li, hh]].log().float()
        sketches = sums = None
        if design is not None:
            sketches, sums = [], torch.zeros(layers, h, d + 1, dtype=torch.float64)
            for li, c in enumerate(caches):  # the prompt's keys and values of this row's blocks
                k, v = gather_rows(c, table[j : j + 1, : -(-n // bs)].long())
                k, v = k[:, :, :n].contiguous(), v[:, :, :n].contiguous()
                tilt = torch.randn(1, h, d) if design.tilt else None
                sketches.append(fast.cluster_sketch(k, v, pi[li][None].float(), keep[li][None], design, tilt=tilt))
                # the kept values' sums and count of the compacted slots (what compact_prompt returns): the values
                # the step reads there, slot i of a head at offset i % bs of the row's block i // bs
                held = gather_rows(c, table[j : j + 1, :m].long())[1][0].double()  # (h, m * bs, d)
                live = torch.isfinite(log_pi[li])                              # (h, m * bs)
                sums[li, :, :d] = torch.where(live[..., None], held, 0.0).sum(1)
                sums[li, :, d] = live.sum(-1).double()
        states[rid] = Compacted(n_prompt=n, m=m, log_pi=log_pi, sketches=sketches, value_sums=sums)
    return states


def _route_code(design: str, cfg) -> str:
    """The code the router runs for this benchmark's decode rows (``kvcert.dispatch.paged_route``, what the
    backend's forward calls): ``paged_cpu_op``, ``paged_torch`` or ``gather``."""
    from kvcert import dispatch

    paged = "block" if design == "block" else ("token" if cfg.design.sketch is None else "sketch")
    return dispatch.paged_route(paged, "cpu", cfg.kind).code


def measure(seq_len: int, rows: int = 4, layers: int = 30, reps: int = 15, design: str = "block") -> dict:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    from kvcert.vllm import KVCertConfig, backend, worker

    # the impl's constructor reads the engine's config; outside an engine, give it the model dtype only
    cpu_attn.get_current_vllm_config = lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    torch.manual_seed(0)
    h, g, d, bs = 3, 3, 64, 64
    h_q, scale = h * g, d ** -0.5
    nbt = -(-seq_len // bs)
    nb = rows * nbt + 8
    impl = backend.CertifiedCPUAttentionImpl(num_heads=h_q, head_size=d, scale=scale, num_kv_heads=h,
                                             alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    caches = [torch.randn(nb, h, bs, 2 * d) for _ in range(layers)]
    table = torch.arange(rows * nbt, dtype=torch.int32).view(rows, nbt)
    ids = [f"r{j}" for j in range(rows)]
    if design == "block":
        cfg = KVCertConfig(compression_ratio=0.5, granularity="block")
        states = {}
        for j in range(rows):  # prompt blocks: the first certain, the others kept with probability 0.5
            lp = torch.log(torch.rand(nbt - 1, dtype=torch.float64))
            lp[torch.rand(nbt - 1) < 0.5] = float("-inf")
            lp[0] = 0.0
            states[f"r{j}"] = lp
    else:
        cfg = KVCertConfig(compression_ratio=0.5) if design == "default" else \
            KVCertConfig(compression_ratio=0.5, sketch=None, kind="chebyshev")
        states = _compacted_states(ids, seq_len, bs, h, d, layers, caches, table, cfg)
    # kvcert_joined: the worker's joins of a group's sketches, kept across steps while the group stays the same
    # (steady decode, as in the engine)
    fake = SimpleNamespace(kvcert=cfg, kvcert_states=states, kvcert_joined={},
                           kvcert_prompt_len={r: seq_len - 1 for r in ids}, kvcert_block_size=bs,
                           model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids)))
    q = torch.randn(rows, h_q, d)
    qsl = torch.arange(rows + 1, dtype=torch.int32)
    seq = torch.full((rows,), seq_len, dtype=torch.int32)
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    out = torch.empty_like(q)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows, num_heads=h_q, num_kv_heads=h, head_dim=d, seq_lens=seq, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
        dynamic_causal=None, kv_cache_dtype="auto")
    kvs = [c.view(nb, h, bs * 2, d).chunk(2, dim=2) for c in caches]

    def stock():
        for kc, vc in kvs:
            ops.cpu_attention_with_kv_cache(
                query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=qsl, seq_lens=seq, scale=scale,
                causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
                kv_cache_dtype="auto")

    def kvcert():
        step = worker.Step(fake)
        step_md = backend.CertifiedCPUAttentionMetadata(
            num_actual_tokens=rows, max_query_len=1, query_start_loc=qsl, max_seq_len=seq_len, seq_lens=seq,
            block_table=table, slot_mapping=None, scheduler_metadata=sched, kvcert_step=step)
        for c in caches:
            impl.forward(layer, q, None, None, c, step_md, out)
        step.results(bs)

    times = {"stock": [], "kvcert": []}
    for _ in range(3):
        stock(), kvcert()
    for _ in range(reps):
        for name, f in (("stock", stock), ("kvcert", kvcert)):
            t = time.perf_counter()
            for _ in range(3):
                f()
            times[name].append((time.perf_counter() - t) / 3 * 1e3)
    res = {"design": design, "seq_len": seq_len, "rows": rows, "layers": layers, "threads": torch.get_num_threads(),
           "route": _route_code(design, cfg)}
    if design == "block":
        res["kept_prompt_block_fraction"] = sum(int((lp > float("-inf")).sum()) for lp in states.values()) / (
            rows * (nbt - 1))
    else:
        res["kept_prompt_token_fraction"] = sum(float((st.log_pi > float("-inf")).sum()) for st in states.values()) / (
            rows * layers * h * (seq_len - 1))
        res["compacted_blocks_read_fraction"] = sum(st.m + 1 for st in states.values()) / (rows * nbt)
    for name, v in times.items():
        res[f"{name}_ms_min"], res[f"{name}_ms_median"] = min(v), statistics.median(v)
    res["ratio_of_minima"] = res["kvcert_ms_min"] / res["stock_ms_min"]
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1025, 2049, 4097])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--designs", nargs="+", choices=("block", "default", "paper"), default=["block", "default", "paper"],
                    help="the plugin's designs to time against stock (module docstring)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--fixed-mmap-threshold", action="store_true",
                    help="mallopt(M_MMAP_THRESHOLD, 128 KiB): large temporaries are page-faulted on every call")
    args = ap.parse_args(argv)
    if args.fixed_mmap_threshold:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)  # -3 = M_MMAP_THRESHOLD
    results = []
    for n in args.lengths:
        for design in args.designs:
            r = measure(n, rows=args.rows, design=design)
            r["fixed_mmap_threshold"] = args.fixed_mmap_threshold
            results.append(r)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
