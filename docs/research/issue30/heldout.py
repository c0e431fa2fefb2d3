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

Other held-out texts (``TEXTS``; issue 50): ``--text 2`` is a second text (the topics left after text 1's
captured span, in the order of default_rng(50); layers 2 / 8 / 15 / 22 / 28, queries at prefix + 3 / 11 / 29),
``--text 3`` the text of the held-out guard test's slice (``--write-slice tests/data/heldout_slice.npz``
writes it; layers 5 / 11 / 17, prefix 1024, queries at prefix + 4 / 13 / 29). Outputs of another text are
prefixed ``text2_`` / ``text3_``. Every table also has the row of the rule before issue 50 on the same draws,
min(3 sqrt(V_cl), H) = min(3 sqrt(V_cl), radius).

    OMP_NUM_THREADS=1 .venv/bin/python docs/research/issue30/heldout.py --text 2 --sampling systematic \
        --out docs/research/issue50
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
#: the held-out texts: pydoc topics read by no TUNED_SPANS span and by no earlier text's captured span, joined
#: in the order of default_rng(seed); per text the layers captured, the prefix and the query offsets. Text 1 is
#: issue 30's split; text 2 the second text of issue 50's re-measure; text 3 the slice of the held-out guard test
#: (tests/data/heldout_slice.npz, written by --write-slice; never read by any measurement that chose a rule)
TEXTS = {1: dict(seed=30, layers=(2, 8, 13, 19, 25), prefix=1536, offsets=(5, 17)),
         2: dict(seed=50, layers=(2, 8, 15, 22, 28), prefix=1536, offsets=(3, 11, 29)),
         3: dict(seed=51, layers=(5, 11, 17), prefix=1024, offsets=(4, 13, 29))}
PREFIX, OFFSETS = TEXTS[1]["prefix"], TEXTS[1]["offsets"]
LAYERS = TEXTS[1]["layers"]
TEXT_SEED = TEXTS[1]["seed"]
#: (text seed, tokens) spans of haystack_text the tilted design was tuned or checked on (RESULTS_T2.md)
TUNED_SPANS = ((0, 4160), (1, 4160))
DESIGNS = ("paper", "tilted")
DERIVED = {"tilted x2.8 (derived)": 2.8, "tilted x2.5 (derived)": 2.5}
#: the same tilted draws with the radius of the rule before issue 50, min(3 sqrt(V_cl), H) (V_cl alone):
#: exactly min(3 sqrt(V_cl), radius), since radius = min(3 sqrt(max(V_cl, V_HT)), H)
PREVIOUS = "tilted, V_cl alone (before issue 50)"
SILENT = 0.05
GOALS = "P pooled >= 0.95, W worst decile >= 0.90, S silent <= 0.5%, T tightness <= 1.1x paper, E error <= 1.1x paper"


def span_topics(tokenizer, names, tokens: int) -> list[str]:
    """The topics (of ``names``, joined in that order) that the first ``tokens`` tokens of their text read."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[n].strip() for n in names)
    reach = len(tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]))
    first, acc = [], 0
    for n in names:
        first.append(n)
        acc += len(topics[n].strip()) + 2                  # "\n\n" between topics
        if acc >= reach:
            break
    return first


def text_tokens(text: int) -> int:
    """Tokens a capture of held-out text ``text`` reads: its prefix and the future queries up to the last offset."""
    return TEXTS[text]["prefix"] + max(TEXTS[text]["offsets"]) + 1


def heldout_topics(tokenizer, text: int = 1) -> tuple[list[str], list[str]]:
    """(topic names of held-out text ``text`` in the order of rng(its seed), the names excluded: those read by a
    TUNED_SPANS span or by the captured span of an earlier text)."""
    from pydoc_data.topics import topics

    from paper_repro.realmodel import haystack_text

    names = sorted(topics)
    used = set()
    for seed, tokens in TUNED_SPANS:
        order = np.random.default_rng(seed).permutation(len(names))
        ids = tokenizer(haystack_text(seed), add_special_tokens=False)["input_ids"][:tokens]
        reach = len(tokenizer.decode(ids))            # characters the span covers (decode round-trips pydoc text)
        start = 0
        for i in order:
            if start >= reach + 200:                       # a margin for decode's spacing
                break
            used.add(names[i])
            start += len(topics[names[i]].strip()) + 2    # "\n\n" between topics
    for earlier in range(1, text + 1):
        rest = [n for n in names if n not in used]
        order = np.random.default_rng(TEXTS[earlier]["seed"]).permutation(len(rest))
        ordered = [rest[i] for i in order]
        if earlier == text:
            return ordered, sorted(used)
        used.update(span_topics(tokenizer, ordered, text_tokens(earlier)))
    raise ValueError(f"text must be one of {tuple(TEXTS)}, got {text}")


def load_capture(path: Path, tokens: int, text: int = 1) -> dict:
    """Post-RoPE q, k, v of the text's layers over the first ``tokens`` tokens of held-out text ``text`` (cached)."""
    if path.exists():
        data = torch.load(path)
        if data["tokens"] >= tokens and data.get("text", 1) == text:
            return data
    import kvcert
    from pydoc_data.topics import topics

    from paper_repro.realmodel import capture

    model, tok = kvcert.load_model()
    names, used = heldout_topics(tok, text)
    ids = tok("\n\n".join(topics[n].strip() for n in names), add_special_tokens=False)["input_ids"][:tokens]
    layers = TEXTS[text]["layers"]
    c = capture(model, torch.tensor([ids], dtype=torch.long))
    data = dict(tokens=tokens, text=text, scaling=c.scaling, group=c.group, layers=list(layers),
                q={i: c.queries[i] for i in layers}, k={i: c.keys[i] for i in layers},
                v={i: c.values[i] for i in layers}, excluded=used, topics=span_topics(tok, names, tokens))
    torch.save(data, path)
    return data


def snapkv(cap, layer, prefix: int = PREFIX) -> np.ndarray:
    """(h_kv, prefix) SnapKV importance over the prefix from the last WINDOW prefix queries of each group."""
    q, k, v = cap["q"][layer], cap["k"][layer], cap["v"][layer]
    scorer = F.SCORERS["snapkv"]
    need = scorer.queries_read(prefix, prefix, WINDOW)
    params = {"seed": layer} if "seed" in scorer.params else {}
    u = scorer(q[None, :, prefix - need:prefix], k[None, :, :prefix], v[None, :, :prefix], scale=cap["scaling"],
               **params)
    return u[0].double().numpy()


def run(args) -> dict:
    prefix = TEXTS[args.text]["prefix"]
    tokens = prefix + max(args.offsets) + 1
    cap = load_capture(Path(args.cache), tokens, args.text)
    tau, g = float(cap["scaling"]), int(cap["group"])
    d = cap["k"][args.layers[0]].shape[-1]
    dv = cap["v"][args.layers[0]].shape[-1]
    h_kv = cap["k"][args.layers[0]].shape[0]
    heads = range(h_kv) if args.kv_heads is None else args.kv_heads
    cells = []                           # per cell: dict of arrays per (M, design)
    t0 = time.perf_counter()
    for li, layer in enumerate(args.layers):
        u_all = snapkv(cap, layer, prefix)
        for h in heads:
            c = li * h_kv + h
            k = cap["k"][layer][h].double().numpy()
            v = cap["v"][layer][h].double().numpy()
            window_q = cap["q"][layer][h * g:(h + 1) * g, prefix - WINDOW:prefix].double().numpy().reshape(-1, d)
            for j in range(h * g, (h + 1) * g):
                for t in args.offsets:
                    n = prefix + t + 1
                    q = cap["q"][layer][j, prefix + t].double().numpy()
                    kk, vv = k[:n], v[:n]
                    o = R.attention(q, kk, vv, scale=tau)
                    u = np.concatenate([u_all[h], np.zeros(t + 1)])
                    cell = dict(layer=layer, kv_head=h, query_head=j, offset=t, norm=float(np.linalg.norm(o)), M={})
                    for M in args.memories:
                        B = M * prefix * (d + dv) / (d + dv + 1)
                        top = F.design_sizes(B, sinks=SINKS, window=WINDOW, top_fraction=TOP_FRACTION).top
                        per = {}
                        for design in DESIGNS:
                            err = np.empty(args.draws)
                            rad = np.empty(args.draws)
                            var = np.empty(args.draws)
                            vcl = np.full(args.draws, np.nan)
                            mem = np.empty(args.draws)
                            for s in range(args.draws):
                                r = SK.evict_and_certify(q, kk, vv, u, B + t + 1, seed=c * args.draws + s,
                                                         delta=DELTA, design=design, tilt=window_q, sinks=SINKS,
                                                         window=WINDOW + t + 1, top=top, floor=FLOOR, scale=tau,
                                                         sampling=args.sampling)
                                err[s] = np.linalg.norm(r.output - o)
                                rad[s], var[s], mem[s] = r.radius, r.variance, r.memory
                                if r.cluster_variance is not None:
                                    vcl[s] = r.cluster_variance
                            per[design] = dict(err=err, radius=rad, variance=var, memory=mem, cluster_variance=vcl)
                        tl = per["tilted"]
                        for name, cm in DERIVED.items():
                            capped = np.minimum(cm * np.sqrt(tl["variance"]), tl["radius"])
                            per[name] = dict(err=tl["err"], radius=capped, variance=tl["variance"],
                                             memory=tl["memory"])
                        per[PREVIOUS] = dict(err=tl["err"], radius=np.minimum(3.0 * np.sqrt(tl["cluster_variance"]),
                                                                               tl["radius"]),
                                             variance=tl["cluster_variance"], memory=tl["memory"])
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


def write_slice(args) -> None:
    """The text's capture as the held-out guard test's slice: per layer L the keys and values ``k{L}``, ``v{L}``
    (h_kv, prefix + max offset + 1, d), the observation-window queries ``qw{L}`` (h_q, WINDOW, d) and the certified
    queries ``qt{L}`` (h_q, offsets, d), float16; plus the scale, prefix, offsets, layers and the topics read."""
    spec = TEXTS[args.text]
    prefix = spec["prefix"]
    cap = load_capture(Path(args.cache), prefix + max(args.offsets) + 1, args.text)
    n = prefix + max(args.offsets) + 1
    half = lambda x: x.numpy().astype(np.float16)  # noqa: E731
    arrays = dict(scaling=np.float64(cap["scaling"]), prefix=np.int64(prefix), window=np.int64(WINDOW),
                  offsets=np.array(args.offsets, dtype=np.int64), layers=np.array(args.layers, dtype=np.int64),
                  topics=np.array(cap["topics"]), text_seed=np.int64(spec["seed"]))
    for L in args.layers:
        arrays[f"k{L}"] = half(cap["k"][L][:, :n])
        arrays[f"v{L}"] = half(cap["v"][L][:, :n])
        arrays[f"qw{L}"] = half(cap["q"][L][:, prefix - WINDOW:prefix])
        arrays[f"qt{L}"] = half(cap["q"][L][:, [prefix + t for t in args.offsets]])
    np.savez_compressed(args.write_slice, **arrays)
    print(f"wrote {args.write_slice}: text {args.text} (topics {', '.join(cap['topics'])}), layers {args.layers}, "
          f"prefix {prefix}, offsets {args.offsets}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke test: one layer, one KV head, one offset, 8 draws")
    p.add_argument("--text", type=int, choices=tuple(TEXTS), default=1,
                   help="the held-out text (TEXTS): 1 issue 30's split, 2 the second text, 3 the guard test's slice")
    p.add_argument("--draws", type=int, default=256)
    p.add_argument("--layers", type=int, nargs="+", default=None, help="default: the text's layers")
    p.add_argument("--offsets", type=int, nargs="+", default=None, help="default: the text's offsets")
    p.add_argument("--memories", type=float, nargs="+", default=list(MEMORIES))
    p.add_argument("--kv-heads", type=int, nargs="+", default=None)
    p.add_argument("--cache", default=None,
                   help="the capture's cache file (default: kvcert_issue30_heldout[_textN].pt in the temporary folder)")
    p.add_argument("--write-slice", default=None, metavar="NPZ",
                   help="write the text's capture as the held-out guard test's slice (float16 .npz) and stop")
    p.add_argument("--sampling", choices=("poisson", "systematic"), default="poisson",
                   help="how every design draws its tail given pi (evict_and_certify(sampling=)); the committed "
                        "run is poisson, systematic_results.json / systematic_table.md the systematic one")
    p.add_argument("--out", default=None, help="folder for results.json and table.md (default: this folder; "
                   "with --quick the system's temporary folder)")
    args = p.parse_args(argv)
    spec = TEXTS[args.text]
    args.layers = list(spec["layers"]) if args.layers is None else args.layers
    args.offsets = list(spec["offsets"]) if args.offsets is None else args.offsets
    if args.cache is None:
        suffix = "" if args.text == 1 else f"_text{args.text}"
        args.cache = str(Path(tempfile.gettempdir()) / f"kvcert_issue30_heldout{suffix}.pt")
    if args.quick:
        args.draws, args.layers, args.offsets, args.kv_heads = 8, args.layers[:1], args.offsets[:1], [0]
    if args.out is None:
        args.out = tempfile.gettempdir() if args.quick else str(Path(__file__).resolve().parent)
    bad = [x for x in args.layers if x not in spec["layers"]]
    if bad:
        p.error(f"--layers must be among text {args.text}'s layers {spec['layers']} (the capture keeps only those), "
                f"got {bad}")
    if args.write_slice:
        write_slice(args)
        return
    res = run(args)
    cells = res["cells"]
    from paper_repro.replay import noise_floor

    floor = noise_floor(0.95, args.draws, len(cells))
    table, out = [], {}
    for M in args.memories:
        paper = summarize(cells, M, "paper")
        for design in (*DESIGNS, PREVIOUS, *DERIVED):
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
                layers=args.layers, offsets=args.offsets, kv_heads=args.kv_heads, prefix=spec["prefix"],
                text=args.text, text_seed=spec["seed"], tuned_spans=TUNED_SPANS, excluded_topics=res["cap"]["excluded"],
                captured_topics=res["cap"]["topics"], noise_floor_worst_decile=floor, goals=GOALS,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    md = [f"<!-- {meta['command']}; {meta['date']}; {meta['seconds']:.0f} s on a loaded 2-core machine -->",
          f"Held-out split: {len(cells)} cells ({len(args.layers)} layers x {len(cells) // len(args.layers)} "
          f"(query head, offset)), {args.draws} draws per cell, {args.sampling} sampling, delta {DELTA}; worst decile of an exact 0.95 "
          f"certificate at this size reads {floor:.3f} (noise floor). Goal lines: {GOALS}.", "",
          "| M | design | memory held | pooled | worst decile | silent | tightness | vs paper | mean rel err "
          "| vs paper | lines met |", "|---|---|---|---|---|---|---|---|---|---|---|", *table]
    stem = (("quick_" if args.quick else "") + ("" if args.text == 1 else f"text{args.text}_")
            + ("systematic_" if args.sampling == "systematic" else ""))
    outdir = Path(args.out)
    (outdir / f"{stem}results.json").write_text(json.dumps(dict(meta=meta, rows=out), indent=1) + "\n")
    (outdir / f"{stem}table.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
