#!/usr/bin/env python
"""Error-targeted budgets on the real default model: the memory they spend, the errors they leave.

``kvcert.fast.target_budget`` picks, per KV head, the smallest budget whose *predicted* relative
Chebyshev radius for the observation-window queries is at most eps (docs/theory.md section 9). This
script measures what that rule buys on replay cells of the default model (SmolLM2-135M, offline,
``kvcert.models.load_model()``), as ``paper_repro/replay.py`` builds them:

- Texts: ``--texts`` pydoc topics (``pydoc_data.topics``) **held out** from paper_repro's default replay
  text (``haystack_text(seed=0)``, whose first topics are :data:`REPLAY_TOPICS`; topics that embed one
  of them, such as ``specialnames`` or ``compound``, are avoided too). Each prompt is the first
  L + 32 tokens of one topic. One forward pass per prompt captures every layer's post-RoPE q, k, v
  (``paper_repro.realmodel.capture``).
- Per (text, layer, KV head): importance = SnapKV (``kvcert.fast.SCORERS["snapkv"]``) from the last
  32 prefix queries of the head's query group (as replay); the chosen budget B* =
  ``kvcert.fast.target_budget(window queries (1, h_q, 32, d), prefix keys/values, importance, eps,
  delta=0.05, kind="chebyshev", sinks=4, window=32, top_fraction=0.5, floor=0.1, scale=model's)``
  (one call per layer over its 3 KV heads; each head is independent, checked against an h_kv = 1 call).
- D Poisson draws of the prefix at the chosen design's pi (``TokenDesign(target_error=eps).decide(u,
  budget=B*.sampled, layer=l)``; draw e keeps ``design_uniforms(..., event=e) < pi``, exactly what
  ``decide(..., event=e)`` keeps, checked); the 32 future tokens are kept with pi = 1.
- ``future`` queries: the model's queries at L + offsets (causal), every query head;
  ``window`` queries: the 32 window queries the rule predicts for, attending to the whole prefix (as
  ``target_budget`` computes them: no causal mask inside the window, whose tokens are certain), and
  ``window_causal``: the same queries under the causal mask (what the model computes).
  Per (draw, query, query head): the Hajek estimate (``kvcert.fast.hajek_attention``), its recorded
  Chebyshev radius (``kvcert.fast.certificate``, delta = 0.05) and the realized relative error
  ||o_hat - o|| / ||o|| against exact attention over the full cache.

Reported per eps: the kept fraction B* / L (mean over heads, and min/median/max), the fraction of
(draw, query, head) whose relative error exceeds eps (window and future separately: the rule bounds the
window's pooled fraction by about delta, by Markov on the mean of V_q / ||o_q||^2 eps^2), the mean
recorded relative radius, pooled coverage (error <= radius), and the **fixed-ratio comparison**: the
paper design at one kept fraction f for every head (``TokenDesign(compression_ratio=1 - f)``, f on
0.05..1 step 0.05, same importance, same uniforms): the smallest f whose fraction-over-eps on future
queries is at most the target design's, the memory ratio (target mean kept fraction / that f), and
the fixed design at the target's mean memory (f = its mean kept fraction) beside the target design.

Usage::

    .venv/bin/python benchmarks/bench_target.py --quick      # 2 texts, L = 1024, 32 draws, eps 0.05/0.1/0.2
    .venv/bin/python benchmarks/bench_target.py --out benchmarks/results/target_full.json   # 4 texts, L = 2048, 128 draws

Writes JSON (``--out``, default benchmarks/results/target.json) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import kvcert.fast as F  # noqa: E402
from benchmarks.runinfo import run_info  # noqa: E402

#: the first topics of paper_repro's default replay text (haystack_text(seed=0)): its full mode reads
#: 4096 + 64 tokens (the first five), these seven cover its first ~8.8k tokens
REPLAY_TOPICS = ("numbers", "attribute-access", "class", "truth", "operator-summary", "binary", "strings")
#: topics that contain one of REPLAY_TOPICS's sections (the data model's special names, the compound
#: statements with class definitions, the data model's customization): not held out either
EMBEDS_REPLAY = ("specialnames", "compound", "customization")
#: held-out prompts in order (each has more than 2080 tokens): the pdb manual, the format mini-language,
#: str methods, sequence types
HELD_OUT = ("debugger", "formatstrings", "string-methods", "typesseq")
OFFSETS = (0, 10, 20, 31)
FUTURE = 32
WINDOW = 32
SINKS = 4
DELTA = 0.05
KIND = "chebyshev"
GRID = tuple(round(0.05 * i, 2) for i in range(1, 21))


def progress(iterable, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, file=sys.stderr, dynamic_ncols=True, **kw)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 texts, L = 1024, 32 draws, eps 0.05/0.1/0.2")
    p.add_argument("--texts", type=int, help="held-out prompts (default 2 quick / 4 full)")
    p.add_argument("--prefix", type=int, help="prefix tokens L (default 1024 quick / 2048 full)")
    p.add_argument("--draws", type=int, help="Poisson draws per cell (default 32 quick / 128 full)")
    p.add_argument("--eps", type=float, nargs="+", help="targets (default 0.05 0.1 0.2, full adds 0.3)")
    p.add_argument("--layers", type=int, help="first layers only (default all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: faster than 2 on the loaded 2-core machine)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/target.json)")
    args = p.parse_args(argv)
    quick = args.quick
    args.texts = args.texts or (2 if quick else 4)
    args.prefix = args.prefix or (1024 if quick else 2048)
    args.draws = args.draws or (32 if quick else 128)
    args.eps = tuple(args.eps or ((0.05, 0.1, 0.2) if quick else (0.05, 0.1, 0.2, 0.3)))
    args.out = args.out or ROOT / "benchmarks" / "results" / "target.json"
    if not 1 <= args.texts <= len(HELD_OUT):
        p.error(f"--texts must be in [1, {len(HELD_OUT)}], got {args.texts}")
    if args.prefix <= 2 * (SINKS + WINDOW + 1):
        p.error(f"--prefix must exceed {2 * (SINKS + WINDOW + 1)}, got {args.prefix}")
    return args


def held_out_prompts(tokenizer, count: int, length: int):
    """The first ``length`` token ids of each held-out topic, and a check that no 32-token run of them
    appears in the replay topics' tokens."""
    from pydoc_data.topics import topics

    seen = set()
    for name in REPLAY_TOPICS:
        ids = tokenizer(topics[name].strip(), add_special_tokens=False)["input_ids"]
        seen.update(tuple(ids[i:i + 32]) for i in range(len(ids) - 31))
    prompts = []
    for name in HELD_OUT[:count]:
        ids = tokenizer(topics[name].strip(), add_special_tokens=False)["input_ids"]
        if len(ids) < length:
            raise ValueError(f"topic {name!r} has {len(ids)} tokens, fewer than the {length} asked for")
        ids = ids[:length]
        shared = sum(tuple(ids[i:i + 32]) in seen for i in range(length - 31))
        prompts.append((name, torch.tensor([ids], dtype=torch.long), shared))
    return prompts


class Acc:
    """Pooled per-(draw, query, query head) records of one design on one query set."""

    def __init__(self):
        self.err, self.rad = [], []

    def add(self, err: torch.Tensor, rel: torch.Tensor, rad_abs: torch.Tensor):
        # err: relative error; rel: recorded relative radius (radius / ||o_hat||); rad_abs: radius / ||o||
        self.err.append(err.flatten().double().numpy())
        self.rad.append(np.stack([rel.flatten().double().numpy(), rad_abs.flatten().double().numpy()]))

    def arrays(self):
        r = np.concatenate(self.rad, axis=1)
        return np.concatenate(self.err), r[0], r[1]

    def summary(self, eps_list):
        err, rel, rad = self.arrays()
        out = dict(records=int(err.size), mean_relative_error=float(err.mean()),
                   median_relative_error=float(np.median(err)), p95_relative_error=float(np.quantile(err, 0.95)),
                   mean_relative_radius=float(rel[np.isfinite(rel)].mean()) if np.isfinite(rel).any() else None,
                   coverage=float((err <= rad).mean()))
        out["over"] = {f"{e:g}": float((err > e).mean()) for e in eps_list}
        out["radius_over"] = {f"{e:g}": float((rel > e).mean()) for e in eps_list}
        return out


def estimate(q, k, v, pis, scale, positions, qpos):
    """Hajek estimates of q (h_q, Q, d) over D draws: k/v (D, h_kv, n, d) (materialized: the stride-0
    expansion takes a slower path), pis (D, h_kv, n), causal when ``qpos`` is given; returns (output
    (D, h_q, Q, dv), Chebyshev radius (D, h_q, Q), relative radius radius / ||o_hat||)."""
    D = pis.shape[0]
    kw = {} if qpos is None else dict(positions=positions, query_positions=qpos)
    est = F.hajek_attention(q.expand(D, *q.shape).contiguous(), k, v, pis, scale=scale, per_coordinate=False,
                            validate=False, **kw)
    cert = F.certificate(est, delta=DELTA, kind=KIND)
    return est.output, cert.radius, cert.relative_radius


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from kvcert.models import load_model
    from paper_repro.realmodel import capture

    t0 = time.perf_counter()
    model, tokenizer = load_model()
    model.eval()
    L, D = args.prefix, args.draws
    T = L + FUTURE
    prompts = held_out_prompts(tokenizer, args.texts, T)
    qpos = torch.tensor([L + o for o in OFFSETS])
    wpos = torch.arange(L - WINDOW, L)

    # phase 1: capture each prompt, SnapKV importance and the target budgets per layer and eps
    cells = []  # per (text, layer): dict of tensors
    checks = {}
    for ti, (name, ids, _) in enumerate(progress(prompts, desc="capture + budgets")):
        cap = capture(model, ids)
        scale = cap.scaling
        n_layers = cap.layers if args.layers is None else min(args.layers, cap.layers)
        for layer in range(n_layers):
            q, k, v = cap.queries[layer], cap.keys[layer], cap.values[layer]  # (h_q, T, d), (h_kv, T, d)
            qwin = q[:, L - WINDOW:L]
            scores = F.SCORERS["snapkv"](qwin[None], k[None, :, :L], v[None, :, :L], scale=scale)[0]  # (h_kv, L)
            budgets = {}
            for eps in args.eps:
                tb = F.target_budget(qwin[None], k[None, :, :L], v[None, :, :L], scores[None], eps, delta=DELTA,
                                     kind=KIND, sinks=SINKS, window=WINDOW, top_fraction=0.5, floor=0.1,
                                     scale=scale)
                budgets[eps] = tb
                if ti == 0 and layer == 0:  # batched over KV heads == one call per KV head (h_kv = 1)
                    g = q.shape[0] // k.shape[0]
                    for h in range(k.shape[0]):
                        one = F.target_budget(qwin[None, h * g:(h + 1) * g], k[None, h:h + 1, :L],
                                              v[None, h:h + 1, :L], scores[None, h:h + 1], eps, delta=DELTA,
                                              kind=KIND, sinks=SINKS, window=WINDOW, top_fraction=0.5, floor=0.1,
                                              scale=scale)
                        checks.setdefault("per_head_equals_batched", True)
                        checks["per_head_equals_batched"] &= bool(one.budget[0, 0] == tb.budget[0, h])
            cells.append(dict(text=ti, layer=layer, scale=scale, qwin=qwin.clone(), qfut=q[:, qpos].clone(),
                              k=k[:, :T].clone(), v=v[:, :T].clone(), scores=scores, budgets=budgets))
        del cap
    t_phase1 = time.perf_counter() - t0

    kept = {eps: torch.stack([c["budgets"][eps].budget[0] for c in cells]).flatten().double() / L for eps in args.eps}
    mean_kept = {eps: float(kept[eps].mean()) for eps in args.eps}
    fixed_fs = sorted(set(GRID) | {round(mean_kept[e], 6) for e in args.eps})

    # phase 2: draws, estimates, errors
    acc_t = {(eps, which): Acc() for eps in args.eps for which in ("window", "window_causal", "future")}
    acc_f = {f: Acc() for f in fixed_fs}
    predicted = {eps: [] for eps in args.eps}
    realized_kept = {eps: [] for eps in args.eps}
    for c in progress(cells, desc="replay cells (text, layer)"):
        layer, scale, k, v = c["layer"], c["scale"], c["k"], c["v"]
        h_kv = k.shape[0]
        seed = c["text"]
        full = torch.ones(1, h_kv, T)
        exact_f = F.hajek_attention(c["qfut"][None], k[None], v[None], full, scale=scale, per_coordinate=False,
                                    positions=torch.arange(T).expand(1, h_kv, T), query_positions=qpos).output
        exact_w = F.hajek_attention(c["qwin"][None], k[None, :, :L], v[None, :, :L], full[..., :L], scale=scale,
                                    per_coordinate=False).output
        norm_f, norm_w = exact_f.norm(dim=-1), exact_w.norm(dim=-1)  # (1, h_q, Q)
        uni = torch.stack([F.design_uniforms((h_kv, L), seed, layer=layer, event=e, row_streams=False)
                           for e in range(D)])  # (D, h_kv, L)
        ones = torch.ones(D, h_kv, FUTURE)
        kd, vd = k.expand(D, *k.shape).contiguous(), v.expand(D, *v.shape).contiguous()
        kw_, vw_ = kd[:, :, :L].contiguous(), vd[:, :, :L].contiguous()
        positions = torch.arange(T).expand(D, h_kv, T).contiguous()

        exact_c = F.hajek_attention(c["qwin"][None], k[None, :, :L], v[None, :, :L], full[..., :L], scale=scale,
                                    per_coordinate=False, positions=torch.arange(L).expand(1, h_kv, L),
                                    query_positions=wpos).output
        norm_c = exact_c.norm(dim=-1)

        def run(pi, acc, window_acc=None, causal_acc=None):
            keep = uni < pi
            pis = torch.cat([torch.where(keep, pi, 0.0).float(), ones], dim=-1)
            out, rad, rel = estimate(c["qfut"], kd, vd, pis, scale, positions, qpos)
            acc.add((out - exact_f).norm(dim=-1) / norm_f, rel, rad / norm_f)
            if window_acc is not None:
                out, rad, rel = estimate(c["qwin"], kw_, vw_, pis[..., :L].contiguous(), scale, None, None)
                window_acc.add((out - exact_w).norm(dim=-1) / norm_w, rel, rad / norm_w)
                out, rad, rel = estimate(c["qwin"], kw_, vw_, pis[..., :L].contiguous(), scale,
                                         positions[..., :L].contiguous(), wpos)
                causal_acc.add((out - exact_c).norm(dim=-1) / norm_c, rel, rad / norm_c)
            return keep

        for eps in args.eps:
            tb = c["budgets"][eps]
            design = F.TokenDesign(target_error=eps, seed=seed)
            dec = design.decide(c["scores"], budget=tb.sampled[0], layer=layer, event=0)
            keep = run(dec.pi, acc_t[eps, "future"], acc_t[eps, "window"], acc_t[eps, "window_causal"])
            if c["text"] == 0 and layer == 0:
                checks.setdefault("uniform_draws_equal_decide", True)
                checks["uniform_draws_equal_decide"] &= bool(torch.equal(keep[0], dec.keep)) and bool(
                    torch.equal(keep[1], design.decide(c["scores"], budget=tb.sampled[0], layer=layer, event=1).keep))
            predicted[eps].append(tb.predicted[0])
            realized_kept[eps].append(keep.double().sum(-1).mean(0) / L)
        for f in fixed_fs:
            ratio = max(0.0, 1.0 - f)
            dec = F.TokenDesign(compression_ratio=ratio, seed=seed).decide(c["scores"], layer=layer, event=0)
            run(dec.pi, acc_f[f])

    # report
    def flat(summary, eps):
        rest = {k: v for k, v in summary.items() if k not in ("over", "radius_over")}
        return dict(over_eps=summary["over"][f"{eps:g}"], radius_over_eps=summary["radius_over"][f"{eps:g}"], **rest)

    results = []
    for eps in args.eps:
        fr = kept[eps].numpy()
        tw, tf = acc_t[eps, "window"].summary([eps]), acc_t[eps, "future"].summary([eps])
        tc = acc_t[eps, "window_causal"].summary([eps])
        over_t = tf["over"][f"{eps:g}"]
        curve = {f"{f:g}": acc_f[f].summary([eps]) for f in GRID}
        smallest = next((f for f in GRID if curve[f"{f:g}"]["over"][f"{eps:g}"] <= over_t), None)
        same = acc_f[round(mean_kept[eps], 6)].summary([eps])
        pred = torch.stack(predicted[eps]).flatten().numpy()
        results.append(dict(
            eps=eps,
            kept_fraction=dict(mean=float(fr.mean()), min=float(fr.min()), median=float(np.median(fr)),
                               max=float(fr.max()), heads_keeping_all=int((fr >= 1.0).sum()), heads=int(fr.size)),
            realized_kept_fraction_mean=float(torch.stack(realized_kept[eps]).mean()),
            predicted_window_radius=dict(mean=float(pred.mean()), max=float(pred.max())),
            window=flat(tw, eps), window_causal=flat(tc, eps), future=flat(tf, eps),
            fixed_matching=dict(
                f=smallest, over_eps=None if smallest is None else curve[f"{smallest:g}"]["over"][f"{eps:g}"],
                memory_ratio=None if smallest is None else float(fr.mean()) / smallest),
            fixed_same_memory=dict(f=mean_kept[eps], over_eps=same["over"][f"{eps:g}"],
                                   mean_relative_error=same["mean_relative_error"],
                                   mean_relative_radius=same["mean_relative_radius"], coverage=same["coverage"]),
            fixed_curve_over_eps={f: v["over"][f"{eps:g}"] for f, v in curve.items()},
        ))
    fixed_curve = {f"{f:g}": {k: v for k, v in acc_f[f].summary([]).items() if k not in ("over", "radius_over")}
                   for f in GRID}

    data = dict(
        **run_info("bench_target.py", argv, threads=args.threads,
                   note="measured on a loaded 2-core machine (shared by several agents)"),
        model="SmolLM2-135M-Instruct (kvcert.models.load_model(), offline)",
        setup=dict(texts=[dict(topic=n, overlapping_32_token_runs_with_replay_topics=s) for n, _, s in prompts],
                   replay_topics_avoided=list(REPLAY_TOPICS) + list(EMBEDS_REPLAY),
                   prefix=L, future=FUTURE, query_offsets=list(OFFSETS), draws=D, eps=list(args.eps), delta=DELTA,
                   kind=KIND, sinks=SINKS, window=WINDOW, top_fraction=0.5, floor=0.1,
                   layers=len({c["layer"] for c in cells}), kv_heads=int(cells[0]["k"].shape[0]),
                   query_heads=int(cells[0]["qfut"].shape[0]), fixed_grid=list(GRID)),
        checks=checks,
        notes=[
            "kept_fraction: chosen budget B* / L per (text, layer, KV head) (a head that evicts nothing has 1).",
            "over_eps: fraction of (draw, query, query head) records with ||o_hat - o|| / ||o|| > eps; read beside "
            "delta = 0.05. window: the 32 observation-window queries over the prefix (no causal mask, as the rule "
            "computes them); window_causal: the same queries attending causally (what the model computes); future: queries at L + offsets, causal, future tokens kept with pi = 1.",
            "mean_relative_radius: the recorded Chebyshev radius / ||o_hat||; radius_over_eps: the fraction of records "
            "whose recorded relative radius exceeds eps (what Certificates.exceeds() flags); coverage: "
            "||o_hat - o|| <= radius, pooled.",
            "fixed_matching: the smallest grid f whose future over_eps <= the target design's; memory_ratio = target "
            "mean kept fraction / f. fixed_same_memory: the paper design at f = the target's mean kept fraction.",
            "Fixed and target designs share the importance and the uniforms (seed = text index, event = draw).",
        ],
        results=results,
        fixed_curve=fixed_curve,
        seconds=dict(phase1=t_phase1, total=time.perf_counter() - t0),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2) + "\n")

    print(f"\nL = {L}, {len(prompts)} texts ({', '.join(n for n, _, _ in prompts)}), {D} draws, delta = {DELTA}; "
          f"{data['seconds']['total']:.0f} s\n")
    print("| eps | kept mean | kept min/med/max | window >eps (causal) | future >eps | mean rel radius (fut) | coverage (fut) "
          "| fixed f matching | memory ratio | fixed@same mem >eps | mean rel err target / fixed@same |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        kf, fm, fs = r["kept_fraction"], r["fixed_matching"], r["fixed_same_memory"]
        print(f"| {r['eps']:g} | {kf['mean']:.3f} | {kf['min']:.3f} / {kf['median']:.3f} / {kf['max']:.3f} "
              f"| {r['window']['over_eps']:.4f} ({r['window_causal']['over_eps']:.4f}) | {r['future']['over_eps']:.4f} | {r['future']['mean_relative_radius']:.4f} "
              f"| {r['future']['coverage']:.4f} | {fm['f']} | "
              f"{'-' if fm['memory_ratio'] is None else format(fm['memory_ratio'], '.3f')} | {fs['over_eps']:.4f} "
              f"| {r['future']['mean_relative_error']:.4f} / {fs['mean_relative_error']:.4f} |")
    print(f"\nchecks: {checks}; wrote {args.out}")


if __name__ == "__main__":
    main()
