"""Issue 14 diagnostic: does a per-cluster key box (Quest-style per-channel min / max) stop the tilted
sketch's exploding radii on generated tokens?

The tilted step estimates log E~[e^{2 tau r.k}] over a cluster's evicted tokens by the Gaussian
2 tau r.m~ + 2 tau^2 r^2.s~^2 (r = q - q0). Whatever the keys, the expectation is at most
e^{2 tau max_{U_c} r.k} <= e^{2 tau box_c(r)}, box_c(r) = sum_j max(r_j lo_cj, r_j hi_cj) with lo / hi the
per-channel min / max of the cluster's evicted keys (2d more elements per cluster). So the capped
step min(Gaussian, 2 tau box_c(r)) (and tau box_c(r) for Z~) is never below the true term: capping only
removes over-estimation. This script runs the docs/usage.md example (the section 2 prompt, compression
0.5, seed 0, 24 tokens, ``PoissonPress(sketch="tilted")``) twice, with the library's step and with the
capped step (monkeypatched; the same sample and tokens), and compares the relative radii.

    OMP_NUM_THREADS=2 .venv/bin/python docs/research/issue14/diag_box_usage.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import kvcert  # noqa: E402
import kvcert.attention as A  # noqa: E402
from kvcert.fast import sketch as FS  # noqa: E402

VMAX: list = []           # per eviction event: max over the evicted tokens of ||v_i - mu||, (b, h_kv)
HULL: list = []           # per sketched decode call: (the hull bound / ||o_hat|| (b, h_q), layer)
BOXES: list = []          # per eviction event (one per layer, in order): (lo, hi) (b, h_kv, C, d)
STATE = {"layer": None, "cap": False, "bound": [], "space": "q"}


def sketch_with_box(keys, values, pi, keep, design=None, *, labels=None, valid=None, tilt=None, scale=None):
    des = FS._as_design(design)
    if labels is None:
        labels = FS.kmeans_assign(keys, des.clusters, iterations=des.iterations, valid=valid)
    sk = ORIGINAL_SKETCH(keys, values, pi, keep, design, labels=labels, valid=valid, tilt=tilt, scale=scale)
    gone = ~keep if valid is None else (~keep & valid)
    b, h, n, d = keys.shape
    lo = torch.zeros(b, h, des.clusters, d, dtype=torch.float64)
    hi = torch.zeros_like(lo)
    k64 = keys.double()
    for c in range(des.clusters):
        m = (gone & (labels == c))[..., None]                               # (b, h, n, 1)
        some = m.any(-2)                                                     # (b, h, 1)
        lo[:, :, c] = torch.where(some, k64.masked_fill(~m, float("inf")).amin(-2), 0.0)
        hi[:, :, c] = torch.where(some, k64.masked_fill(~m, float("-inf")).amax(-2), 0.0)
    # the untilted sums the q-space bound multiplies: W_c = sum (1 - pi)/pi, Y_c = sum (1 - pi)/pi nu^2, N_c
    w = torch.where(gone, (1 - pi.double()) / pi.double(), 0.0)
    nu2 = ((values.double() - sk.mu.double()[:, :, None, :]) ** 2).sum(-1)
    W, Y, N = (torch.stack([(x * (labels == c)).sum(-1) for c in range(des.clusters)], -1)
               for x in (w, w * nu2, gone.double()))
    BOXES.append((lo, hi, W, Y, N))
    VMAX.append(torch.where(gone, nu2, 0.0).amax(-1).sqrt())             # (b, h_kv) max over U of ||v - mu||
    return sk


def spy_attention(q, keys, values, pi, sketch, **kw):
    """The library's step, plus the hull bound ||o_hat - mu|| + max_i ||v_i - mu|| (every token: o and o_hat
    lie in the values' convex hull) of each query head, kept per call (step-major, layer order)."""
    ce = ORIGINAL_ATTENTION(q, keys, values, pi, sketch, **kw)
    mu = sketch.mu.double()                                                # (b, h_kv, dv)
    lp = kw["log_pi"]
    kept = torch.where(lp > float("-inf"), ((values.double() - mu[:, :, None]) ** 2).sum(-1), 0.0).amax(-1).sqrt()
    R = torch.maximum(kept, VMAX[STATE["layer"]])                          # (b, h_kv)
    g = q.shape[1] // R.shape[1]
    o = ce.estimate.output.double()                                        # (b, h_q, dv)
    bound = (o - mu.repeat_interleave(g, 1)).norm(dim=-1) + R.repeat_interleave(g, 1)
    HULL.append((bound / o.norm(dim=-1), STATE["layer"]))
    return ce


def capped_log_variance(L, sketch, o, lse, kappa, t_kept, form=None):
    """``kvcert.fast.sketch._log_variance`` with each cluster's tilted step capped at the key box."""
    if not STATE["cap"] or sketch.tilt is None:
        return ORIGINAL_LOG_VARIANCE(L, sketch, o, lse, kappa, t_kept, form)
    dt, B = L.dtype, L.B
    C = sketch.mean.shape[-2]
    lo, hi, W, Y, N = BOXES[STATE["layer"]]
    lo, hi = lo.to(dt).reshape(B, C, L.d), hi.to(dt).reshape(B, C, L.d)
    W, Y, N = (x.to(dt).reshape(B, 1, C) for x in (W, Y, N))
    qs = (L.q.to(dt).reshape(B, L.G, L.d) - sketch.tilt.to(dt).view(B, 1, L.d)) * L.scale   # tau r
    space = STATE["space"]
    qb = qs if space == "r" else L.q.to(dt).reshape(B, L.G, L.d) * L.scale               # tau r or tau q
    bx = torch.maximum(qb[:, :, None, :] * lo[:, None], qb[:, :, None, :] * hi[:, None]).sum(-1)  # (B, G, C)
    q2 = qs * qs
    lin = torch.bmm(qs, sketch.mean.to(dt).view(B, C, L.d).transpose(1, 2))
    quad = torch.bmm(q2, sketch.var.to(dt).view(B, C, L.d).transpose(1, 2))
    zlin = torch.bmm(qs, sketch.zmean.to(dt).view(B, C, L.d).transpose(1, 2))
    zquad = torch.bmm(q2, sketch.zvar.to(dt).view(B, C, L.d).transpose(1, 2))
    sq, zz = lin + quad, zlin + 0.5 * zquad
    live = sketch.count.to(dt).view(B, 1, C) > 0
    dmu = sketch.mu.to(dt).view(B, 1, L.dv) - o
    a2 = torch.linalg.vecdot(dmu, dmu).unsqueeze(-1)
    ev = sketch.wnorm.to(dt).view(B, 1, C) + sketch.weight.to(dt).view(B, 1, C) * a2
    h = sketch.shift.to(dt).view(B, 1, C)
    log_count, log_ev = torch.log(sketch.count.to(dt).view(B, 1, C)) + h, torch.log(ev) + 2.0 * h
    sq_term, z_term = 2.0 * sq + log_ev, zz + log_count
    if space == "r":   # E~[e^{2 tau r.k}] <= e^{2 tau box_c(r)}
        sq_cap, z_cap = 2.0 * bx + log_ev, bx + log_count
    else:              # sum_U w e^{2 tau q.k} (nu^2 + ||mu - o||^2) <= (Y_c + W_c ||mu - o||^2) e^{2 tau box_c(q)}
        sq_cap, z_cap = torch.log(Y + W * a2) + 2.0 * bx, torch.log(N) + bx
    STATE["bound"].append((((sq_term > sq_cap) & live).sum().item(), live.expand_as(sq).sum().item()))
    log_zu = torch.logsumexp(torch.minimum(z_term, z_cap), dim=-1)
    log_nu = torch.logsumexp(torch.minimum(sq_term, sq_cap), dim=-1)
    log_z = torch.logaddexp(torch.log(kappa) + lse, log_zu)
    log_num = torch.logaddexp(torch.log(t_kept) + 2.0 * lse, log_nu)
    return log_num, log_z


def decode_sketch(self, layer, layer_idx, query, scale):
    STATE["layer"] = layer_idx
    return ORIGINAL_DECODE(self, layer, layer_idx, query, scale)


ORIGINAL_SKETCH, ORIGINAL_LOG_VARIANCE, ORIGINAL_DECODE = FS.cluster_sketch, FS._log_variance, A.Session._decode_sketch
ORIGINAL_ATTENTION = FS.cluster_hajek_attention


def main():
    from pydoc_data.topics import topics

    prompt = ("Read this documentation and answer the question at the end.\n\n" + topics["assert"]
              + topics["assignment"][:5200] + "\n\nQuestion: what does an augmented assignment statement do?")
    model, tok = kvcert.load_model()
    FS.cluster_sketch, FS._log_variance, A.Session._decode_sketch = sketch_with_box, capped_log_variance, decode_sketch
    import kvcert.fast as F
    F.cluster_hajek_attention = spy_attention
    out = {}
    for cap, space in ((False, "q"), ("r", "r"), ("q", "q")):
        STATE["cap"], STATE["space"], STATE["bound"] = cap, space, []
        BOXES.clear(), VMAX.clear(), HULL.clear()
        press = kvcert.PoissonPress(compression_ratio=0.5, seed=0, sketch="tilted")
        r = kvcert.generate(model, tok, prompt, press=press, max_new_tokens=24)
        out[cap] = r
        rel = r.certificates.relative_radius[1:].double()
        s = r.summary()["certificate"]
        if cap:
            bound, live = map(sum, zip(*STATE["bound"]))
            print(f"cap in {space}-space: binds in {bound} of {live} (query head, cluster) steps ({bound / live:.2%})")
        print(f"cap={cap}: events {len(BOXES)}, median rel radius {s['median_relative_radius']:.3f}, mean "
              f"{s['mean_relative_radius']:.3g}, max {s['max_relative_radius']:.3g}, share > 1 "
              f"{(rel > 1).double().mean():.3%}, q90 {rel.quantile(0.9):.3f}, q99 {rel.quantile(0.99):.3f}")
    a = out[False].certificates.relative_radius[1:].double()
    for cap in ("r", "q"):
        assert out[False].token_ids == out[cap].token_ids
        b = out[cap].certificates.relative_radius[1:].double()
        ratio = b / a
        print(f"{cap}-space cap / plain radius: min {ratio.min():.3g}, median {ratio.median():.3g}, share < 0.999 "
              f"{(ratio < 0.999).double().mean():.2%}; where plain > 1: capped median {b[a > 1].median():.3g}, "
              f"max {b[a > 1].max():.3g} ({int((a > 1).sum())} of {a.numel()})")
    # the hull cap on the library's radius: min(radius, hull bound), relative to ||o_hat||
    layers = len(out[False].certificates.relative_radius[0])
    hull = torch.stack([h for h, _ in HULL[-a.shape[0] * layers:]]).reshape(a.shape[0], layers, -1)
    capped = torch.minimum(a, hull[:, :, :a.shape[-1]].reshape(a.shape) if hull.shape == a.shape else hull)
    print(f"hull cap: bound / ||o_hat|| median {hull.median():.3g}, q90 {hull.quantile(0.9):.3g}, max {hull.max():.3g}; "
          f"capped relative radius median {capped.median():.3f}, mean {capped.mean():.3g}, max {capped.max():.3g}, "
          f"share capped {(hull < a).double().mean():.2%}")
    d = model.config.hidden_size // model.config.num_attention_heads
    print(f"memory: tilted {kvcert.presses.SKETCHES['tilted'].elements(d, d)} elements per head; the box "
          f"8 x 2d = {8 * 2 * d} more (r-space), + 8 x 3 (W_c, Y_c, N_c) for the q-space cap")


if __name__ == "__main__":
    main()
