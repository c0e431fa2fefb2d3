"""The sketch designs on a held-out split of real attention, through ``kvcert.reference.evict_and_certify``.

Research script (not library code): it calls the public API only and patches nothing.

The tilted design (``design="tilted"``: 8 clusters, radius 3 sqrt(V_cl) capped at the hull bound) was
tuned on paper_repro's Table 2 replay cells (docs/research/issue14/RESULTS_T2.md): SmolLM2-135M-Instruct
reading the first 1824 (quick) or 4160 (full size) tokens of ``paper_repro.realmodel.haystack_text(0)``,
with a check on the first 1824 tokens of ``haystack_text(1)``; all 30 layers, exploratory variants on
every third layer (0, 3, 6, ...); prefix 1792 / 4096, future queries at prefix + 0 / 10 / 20 / 31 (and
+ 7 / 15 / 47 / 63 at full size). This script measures the designs on other text, other layers and
other positions:

- text: the pydoc topics that do NOT occur in those four token spans, joined in the order of
  ``numpy.random.default_rng(TEXT_SEED).permutation`` (see :func:`heldout_topics`);
- layers ``LAYERS`` (none of them a multiple of 3, so none in the exploratory subset; every layer
  of the model was in the full T2 tables, so "held-out layers" means held out of the exploration);
- prefix ``PREFIX`` = 1536 tokens, future queries at prefix + ``OFFSETS`` = 5 / 17.

A cell is (layer, query head, offset); the cache of a query at prefix + t is the prefix and the t + 1
future tokens up to and including itself. Each call is ``evict_and_certify(q, keys, values, importance,
budget, seed=, delta=0.05, design=, tilt=, sinks=4, window=32 + t + 1, top=, floor=0.1, scale=)``: the
certainty window covers the prefix's last 32 tokens and the future ones, as in T2 (the future tokens
enter with pi = 1). Importance: SnapKV of the KV head's query group from the last 32 prefix queries
(``kvcert.fast.SCORERS["snapkv"]``, as paper_repro's replay); 0 on the future tokens (certain anyway).
Top slice: ``kvcert.fast.design_sizes(B, top_fraction=0.5).top`` at the paper design's prefix budget B
(every design keeps it: ``evict_and_certify`` takes ``top`` as given). Tilt point: the group's 3 x 32
observation-window queries (the design averages them). Memory: B = M L (d + dv) / (d + dv + 1) expected
kept prefix tokens for the paper design, budget = B + t + 1; a sketched design samples fewer so that its
expected total memory, sketch included, is the same (``EvictionResult.memory`` is reported).

Draw s of the KV head c (global index over layers) uses ``seed = c * draws + s`` for every design, query
head and offset (common random numbers). Metrics (delta = 0.05): pooled coverage; worst decile = mean
coverage of the worst ceil(cells / 10) cells; silent = share of draws with ||o_hat - o|| > 5% ||o|| and
outside the radius; tightness = median over cells of (median radius / RMS error); mean relative error
||o_hat - o|| / ||o||. Rows marked "derived" reuse the tilted design's draws: min(c sqrt(V_cl), radius)
is exactly the capped radius c sqrt(V_cl) for c <= 3 (the hull cap H is known where it bound, and
exceeds 3 sqrt(V_cl) >= c sqrt(V_cl) where it did not).

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue30/heldout.py            # the committed run
    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue30/heldout.py --quick    # smoke test, about 20 s

Writes ``results.json`` and ``table.md`` into ``--out`` (default: this folder; ``--quick`` writes
``quick_results.json`` and ``quick_table.md`` into the system's temporary folder). The capture is cached
in the system's temporary folder (``--cache``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import kvcert.fast as F
from kvcert import reference as R
from kvcert.reference import sketch as SK

DELTA = 0.05
MEMORIES = (0.15, 0.3, 0.55)
SINKS, WINDOW, FLOOR, TOP_FRACTION = 4, 32, 0.1, 0.5
PREFIX, OFFSETS = 1536, (5, 17)
LAYERS = (2, 8, 13, 19, 25)
TEXT_SEED = 30
#: (text seed, tokens) spans of haystack_text the tilted design was tuned or checked on (RESULTS_T2.md)
TUNED_SPANS = ((0, 4160), (1, 4160))
DESIGNS = ("paper", "tilted")
DERIVED = {"tilted x2.8 (derived)": 2.8, "tilted x2.5 (derived)": 2.5}
SILENT = 0.05
GOALS = "P pooled >= 0.95, W worst decile >= 0.90, S silent <= 0.5%, T tightness <= 1.1x paper, E error <= 1.1x paper"


def heldout_topics(tokenizer) -> tuple[list[str], list[str]]:
    """(held-out topic names in the order of rng(TEXT_SEED), the names excluded: those read by a TUNED_SPANS span)."""
    from pydoc_data.topics import topics

    from paper_repro.realmodel import haystack_text

    names = sorted(topics)
    used = set()
    for seed, tokens in TUNED_SPANS:
        order = np.random.default_rng(seed).permutation(len(names))
        text = haystack_text(seed)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        reach = len(tokenizer.decode(ids))            # characters the span covers (decode round-trips pydoc text)
        start = 0
        for i in order:
            if start >= reach + 200:                       # a margin for decode's spacing
                break
            used.add(names[i])
            start += len(topics[names[i]].strip()) + 2    # "\n\n" between topics
    rest = [n for n in names if n not in used]
    order = np.random.default_rng(TEXT_SEED).permutation(len(rest))
    return [rest[i] for i in order], sorted(used)


def load_capture(path: Path, tokens: int) -> dict:
    """Post-RoPE q, k, v of LAYERS over the first ``tokens`` tokens of the held-out text (cached)."""
    if path.exists():
        data = torch.load(path)
        if data["tokens"] >= tokens:
            return data
    import kvcert
    from pydoc_data.topics import topics

    from paper_repro.realmodel import capture

    model, tok = kvcert.load_model()
    names, used = heldout_topics(tok)
    text = "\n\n".join(topics[n].strip() for n in names)
    ids = tok(text, add_special_tokens=False)["input_ids"][:tokens]
    first = []
    acc = 0
    for n in names:                                     # the topics the captured span reads
        first.append(n)
        acc += len(topics[n].strip()) + 2
        if acc >= len(tok.decode(ids)):
            break
    c = capture(model, torch.tensor([ids], dtype=torch.long))
    data = dict(tokens=tokens, scaling=c.scaling, group=c.group, layers=list(LAYERS),
                q={i: c.queries[i] for i in LAYERS}, k={i: c.keys[i] for i in LAYERS},
                v={i: c.values[i] for i in LAYERS}, excluded=used, topics=first)
    torch.save(data, path)
    return data


def snapkv(cap, layer) -> np.ndarray:
    """(h_kv, PREFIX) SnapKV importance over the prefix from the last WINDOW prefix queries of each group."""
    q, k, v = cap["q"][layer], cap["k"][layer], cap["v"][layer]
    scorer = F.SCORERS["snapkv"]
    need = scorer.queries_read(PREFIX, PREFIX, WINDOW)
    params = {"seed": layer} if "seed" in scorer.params else {}
    u = scorer(q[None, :, PREFIX - need:PREFIX], k[None, :, :PREFIX], v[None, :, :PREFIX], scale=cap["scaling"],
               **params)
    return u[0].double().numpy()


def run(args) -> dict:
    tokens = PREFIX + max(args.offsets) + 1
    cap = load_capture(Path(args.cache), tokens)
    tau, g = float(cap["scaling"]), int(cap["group"])
    d = cap["k"][args.layers[0]].shape[-1]
    dv = cap["v"][args.layers[0]].shape[-1]
    h_kv = cap["k"][args.layers[0]].shape[0]
    heads = range(h_kv) if args.kv_heads is None else args.kv_heads
    cells = []                           # per cell: dict of arrays per (M, design)
    t0 = time.perf_counter()
    for li, layer in enumerate(args.layers):
        u_all = snapkv(cap, layer)
        for h in heads:
            c = li * h_kv + h
            k = cap["k"][layer][h].double().numpy()
            v = cap["v"][layer][h].double().numpy()
            window_q = cap["q"][layer][h * g:(h + 1) * g, PREFIX - WINDOW:PREFIX].double().numpy().reshape(-1, d)
            for j in range(h * g, (h + 1) * g):
                for t in args.offsets:
                    n = PREFIX + t + 1
                    q = cap["q"][layer][j, PREFIX + t].double().numpy()
                    kk, vv = k[:n], v[:n]
                    o = R.attention(q, kk, vv, scale=tau)
                    u = np.concatenate([u_all[h], np.zeros(t + 1)])
                    cell = dict(layer=layer, kv_head=h, query_head=j, offset=t, norm=float(np.linalg.norm(o)), M={})
                    for M in args.memories:
                        B = M * PREFIX * (d + dv) / (d + dv + 1)
                        top = F.design_sizes(B, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION).top
                        per = {}
                        for design in DESIGNS:
                            err = np.empty(args.draws)
                            rad = np.empty(args.draws)
                            var = np.empty(args.draws)
                            mem = np.empty(args.draws)
                            for s in range(args.draws):
                                r = SK.evict_and_certify(q, kk, vv, u, B + t + 1, seed=c * args.draws + s,
                                                         delta=DELTA, design=design, tilt=window_q, sinks=SINKS,
                                                         window=WINDOW + t + 1, top=top, floor=FLOOR, scale=tau,
                                                         sampling=args.sampling)
                                err[s] = np.linalg.norm(r.output - o)
                                rad[s], var[s], mem[s] = r.radius, r.variance, r.memory
                            per[design] = dict(err=err, radius=rad, variance=var, memory=mem)
                        tl = per["tilted"]
                        for name, cm in DERIVED.items():
                            capped = np.minimum(cm * np.sqrt(tl["variance"]), tl["radius"])
                            per[name] = dict(err=tl["err"], radius=capped, variance=tl["variance"],
                                             memory=tl["memory"])
                        cell["M"][M] = per
                    cells.append(cell)
            print(f"layer {layer} kv head {h}: {len(cells)} cells, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return dict(cells=cells, seconds=time.perf_counter() - t0, d=d, dv=dv, cap=cap)


def summarize(cells, M, design) -> dict:
    cov, tight, rel, silent, mem = [], [], [], [], []
    for cell in cells:
        x = cell["M"][M][design]
        err, rad = x["err"], x["radius"]
        hit = err <= rad
        cov.append(hit.mean())
        rms = math.sqrt(float(np.mean(err ** 2)))
        tight.append(float(np.median(rad)) / rms if rms > 0 else np.inf)
        rel.append(err / cell["norm"])
        silent.append((err > SILENT * cell["norm"]) & ~hit)
        mem.append(x["memory"].mean())
    cov = np.array(cov)
    k = max(1, int(np.ceil(0.1 * len(cov))))
    return dict(pooled=float(cov.mean()), worst_decile=float(np.sort(cov)[:k].mean()),
                silent=float(np.concatenate(silent).mean()), tightness=float(np.median(tight)),
                mean_rel_error=float(np.concatenate(rel).mean()), memory=float(np.mean(mem)), cells=len(cov))


def lines(row, paper) -> str:
    met = [row["pooled"] >= 0.95, row["worst_decile"] >= 0.90, row["silent"] <= 0.005,
           row["tightness"] <= 1.1 * paper["tightness"], row["mean_rel_error"] <= 1.1 * paper["mean_rel_error"]]
    return "".join(c if m else "-" for c, m in zip("PWSTE", met))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: one layer, one KV head, one offset, 8 draws")
    p.add_argument("--draws", type=int, default=256)
    p.add_argument("--layers", type=int, nargs="+", default=list(LAYERS))
    p.add_argument("--offsets", type=int, nargs="+", default=list(OFFSETS))
    p.add_argument("--memories", type=float, nargs="+", default=list(MEMORIES))
    p.add_argument("--kv-heads", type=int, nargs="+", default=None)
    p.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "kvcert_issue30_heldout.pt"))
    p.add_argument("--sampling", choices=("poisson", "systematic"), default="poisson",
                   help="how every design draws its tail given pi (evict_and_certify(sampling=)); the committed "
                        "run is poisson, systematic_results.json / systematic_table.md the systematic one")
    p.add_argument("--out", default=None, help="folder for results.json and table.md (default: this folder; "
                   "with --quick the system's temporary folder)")
    args = p.parse_args(argv)
    if args.quick:
        args.draws, args.layers, args.offsets, args.kv_heads = 8, [LAYERS[0]], [OFFSETS[0]], [0]
    if args.out is None:
        args.out = tempfile.gettempdir() if args.quick else str(Path(__file__).resolve().parent)
    bad = [x for x in args.layers if x not in LAYERS]
    if bad:
        p.error(f"--layers must be among the held-out layers {LAYERS} (the capture keeps only those), got {bad}")
    res = run(args)
    cells = res["cells"]
    from paper_repro.replay import noise_floor

    floor = noise_floor(0.95, args.draws, len(cells))
    table, out = [], {}
    for M in args.memories:
        paper = summarize(cells, M, "paper")
        for design in (*DESIGNS, *DERIVED):
            row = summarize(cells, M, design)
            row["tightness_vs_paper"] = row["tightness"] / paper["tightness"]
            row["error_vs_paper"] = row["mean_rel_error"] / paper["mean_rel_error"]
            row["lines_met"] = lines(row, paper)
            out.setdefault(str(M), {})[design] = row
            table.append(f"| {M} | {design} | {row['memory']:.3f} | {row['pooled']:.3f} | {row['worst_decile']:.3f} | "
                         f"{100 * row['silent']:.2f}% | {row['tightness']:.2f} | {row['tightness_vs_paper']:.2f} | "
                         f"{row['mean_rel_error']:.4f} | {row['error_vs_paper']:.3f} | {row['lines_met']} |")
    given = sys.argv[1:] if argv is None else list(argv)
    command = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue30/heldout.py", *given])
    meta = dict(command=command.strip(), seconds=round(res["seconds"], 1), draws=args.draws, cells=len(cells),
                sampling=args.sampling,
                layers=args.layers, offsets=args.offsets, kv_heads=args.kv_heads, prefix=PREFIX,
                text_seed=TEXT_SEED, tuned_spans=TUNED_SPANS, excluded_topics=res["cap"]["excluded"],
                captured_topics=res["cap"]["topics"], noise_floor_worst_decile=floor, goals=GOALS,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    md = [f"<!-- {meta['command']}; {meta['date']}; {meta['seconds']:.0f} s on a loaded 2-core machine -->",
          f"Held-out split: {len(cells)} cells ({len(args.layers)} layers x {len(cells) // len(args.layers)} "
          f"(query head, offset)), {args.draws} draws per cell, {args.sampling} sampling, delta {DELTA}; worst decile of an exact 0.95 "
          f"certificate at this size reads {floor:.3f} (noise floor). Goal lines: {GOALS}.", "",
          "| M | design | memory held | pooled | worst decile | silent | tightness | vs paper | mean rel err "
          "| vs paper | lines met |", "|---|---|---|---|---|---|---|---|---|---|---|", *table]
    stem = ("quick_" if args.quick else "") + ("systematic_" if args.sampling == "systematic" else "")
    outdir = Path(args.out)
    (outdir / f"{stem}results.json").write_text(json.dumps(dict(meta=meta, rows=out), indent=1) + "\n")
    (outdir / f"{stem}table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
