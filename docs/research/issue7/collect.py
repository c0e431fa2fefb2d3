"""Dense re-implementation of the Table 2 replay loop (paper_repro/replay.py, quick mode,
design 'paper'), recording per draw every statistic the candidate certificates need.

Same cells and same random stream as replay.run(Config()) (rng = default_rng([0, 3]), one
(M, L) uniform block per (layer, kv head, budget)), so the baseline chebyshev row must
reproduce Table 2. Float64 throughout (replay uses float32 torch kernels).

usage: python collect.py OUT.npz [design] [--capture CAPTURE.pkl]   design in {paper, floor05}

The real-model capture (paper_repro.realmodel.capture of 1824 pydoc tokens) is read from CAPTURE.pkl,
default ``cap1824.pkl`` beside OUT.npz, and made there first if it is missing (loads the model).
"""
import argparse
import pickle
import time
from pathlib import Path

import numpy as np
import torch

import kvcert.fast as F
from kvcert import reference as R

WINDOW, SINKS = 32, 4
L, FUT, OFFS, M = 1792, 32, (0, 10, 20, 31), 64
BUDGETS = (0.1, 0.25, 0.5)
torch.set_num_threads(1)


def design_kwargs(u, fraction, design):
    n = u.size
    budget = fraction * n
    free = budget - SINKS - WINDOW
    kw = dict(sinks=SINKS, window=WINDOW, top=int(np.floor(0.5 * free)), floor=0.1)
    if design == "floor05":   # defensive mixture at the minimax weight alpha = 1/2
        kw["floor"] = 0.5
    return budget, kw


def load_capture(path) -> object:
    """The captured q, k, v of every layer over 1824 pydoc tokens (``paper_repro.realmodel.Captured``),
    read from ``path``, or captured (the model's one forward pass) and written there first."""
    path = Path(path)
    if not path.exists():
        import kvcert
        from paper_repro.realmodel import capture, haystack_ids

        model, tok = kvcert.load_model()
        with open(path, "wb") as f:
            pickle.dump(capture(model, haystack_ids(tok, L + FUT)), f)
    with open(path, "rb") as f:
        return pickle.load(f)


def main(out, design="paper", capture=None):
    cap = load_capture(Path(out).with_name("cap1824.pkl") if capture is None else capture)
    scale, g = cap.scaling, cap.group
    h_kv = cap.keys[0].shape[0]
    T = L + FUT
    qpos = np.array([L + o for o in OFFS])
    rng = np.random.default_rng([0, 3])
    rec = {k: [] for k in ["err", "trace", "sumx2", "frob2", "neff_tail", "tailshare", "bmax",
                           "nS_tail", "miss_w", "r_add", "r_add2", "cal_max", "cal_q90"]}
    cell = {k: [] for k in ["layer", "qhead", "off", "budget", "Vtrue", "pop_neff", "onorm",
                            "maxshare_true", "relse_future", "relse_held"]}
    causal = torch.from_numpy(np.arange(T)[None, :] <= qpos[:, None])  # (Q, T)
    t0 = time.time()
    for layer in range(cap.layers):
        qs = cap.queries[layer][None, :, :L]
        ks = cap.keys[layer][None, :, :L]
        imp = F.snapkv_scores(qs[:, :, L - WINDOW:], ks, scale=scale)[0].double().numpy()
        for h in range(h_kv):
            k = cap.keys[layer][h, :T].double()
            v = cap.values[layer][h, :T].double()
            q = cap.queries[layer][h * g:(h + 1) * g][:, qpos].double()  # (g, Q, d)
            s = scale * torch.einsum("gqd,td->gqt", q, k)
            s = torch.where(causal[None], s, -torch.inf)
            w = torch.softmax(s, -1)                       # (g, Q, T)
            o = w @ v                                      # (g, Q, dv)
            vn = (v * v).sum(-1)
            # held-out queries for eviction-time calibration: prefix positions L-64..L-33 (not in
            # the scorer's observation window), each query head its own 32
            hpos = np.arange(L - 64, L - 32)
            qh = cap.queries[layer][h * g:(h + 1) * g][:, hpos].double()          # (g, H, d)
            sh = scale * torch.einsum("gqd,td->gqt", qh, k)
            sh = torch.where(torch.from_numpy(np.arange(T)[None, :] <= hpos[:, None])[None], sh, -torch.inf)
            wh = torch.softmax(sh, -1)
            ohT = wh @ v
            u = imp[h]
            for fraction in BUDGETS:
                budget, kw = design_kwargs(u, fraction, design)
                pi_np = R.inclusion_probabilities(u, budget, **kw)
                # replay.py casts pi to float32 before sampling: keep that exactly
                pi32 = torch.from_numpy(pi_np).float()
                keep = torch.from_numpy(rng.random((M, L))) < pi32
                pi = torch.cat([pi32.double(), torch.ones(FUT, dtype=torch.float64)])
                keep = torch.cat([keep, torch.ones(M, FUT, dtype=torch.bool)], 1)  # (M, T)
                tail = pi < 1                                                     # (T,)
                # truth-side diagnostics (population)
                dvo = vn[None, None] - 2 * (o @ v.T) + (o * o).sum(-1, keepdim=True)  # ||v_i-o||^2
                tt = torch.where(tail, (1 - pi) / pi, 0.0) * w ** 2 * dvo             # (g,Q,T)
                Vtrue = tt.sum(-1)
                pop_neff = Vtrue ** 2 / (tt ** 2).sum(-1)
                maxshare = (tt.max(-1).values / Vtrue)
                relse_f = (torch.where(tail, (1 - pi) / pi, 0.0) * tt ** 2).sum(-1).sqrt() / Vtrue  # (g,Q)
                dvh = vn[None, None] - 2 * (ohT @ v.T) + (ohT * ohT).sum(-1, keepdim=True)
                tth = torch.where(tail, (1 - pi) / pi, 0.0) * wh ** 2 * dvh
                relse_h = ((torch.where(tail, (1 - pi) / pi, 0.0) * tth ** 2).sum(-1).sqrt()
                           / tth.sum(-1).clamp_min(1e-300)).median(-1).values                # (g,)
                lh = sh[None] - torch.log(pi)[None, None, None]
                ah = torch.softmax(torch.where(keep[:, None, None], lh, -torch.inf), -1)   # (M,g,H,T)
                ohh = ah @ v
                eh2 = ((ohh - ohT[None]) ** 2).sum(-1)
                rh = (vn - 2 * (ohh @ v.T) + (ohh * ohh).sum(-1, keepdim=True)).clamp_min(0)
                trh = ((1 - pi) * ah ** 2 * rh).sum(-1)
                ratio = eh2 / trh.clamp_min(1e-300)                                        # (M,g,H)
                rs = ratio.sort(-1).values
                cal_max = rs[..., -1]          # conformal index ceil(33 * 0.95) = 32 of 32
                cal_q90 = rs[..., 29]          # ceil(33 * 0.90) = 30 (delta 0.1), kept for reference
                del ah, lh, rh
                # sample side
                logit = s[None] - torch.log(pi)[None, None, None]
                logit = torch.where(keep[:, None, None], logit, -torch.inf)
                a = torch.softmax(logit, -1)                                          # (M,g,Q,T)
                oh = a @ v
                err = (oh - o[None]).norm(dim=-1)
                r = (vn - 2 * (oh @ v.T) + (oh * oh).sum(-1, keepdim=True)).clamp_min(0)
                c = (1 - pi) * a ** 2
                x = c * r
                trace = x.sum(-1)
                sumx2 = ((1 - pi) * x ** 2).sum(-1)
                at = torch.where(tail, a, 0.0)
                tailshare = at.sum(-1)
                neff = tailshare ** 2 / (at ** 2).sum(-1).clamp_min(1e-300)
                bmax = (torch.maximum(1 - pi, pi) * a * r.sqrt() * tail).max(-1).values
                nS_tail = (keep & tail).sum(-1).double()[:, None, None].expand_as(trace)
                miss = (w[None] * (tail & ~keep)[:, None, None]).sum(-1)
                # eviction-time sketch of the evicted set E (per draw): count, key mean and diagonal
                # variance, value mean and value spread; decode: log-normal model of Z_E(q)
                E = (tail & ~keep).double()                                        # (M, T)
                nE = E.sum(-1).clamp_min(1)
                mk = (E @ k) / nE[:, None]
                vk = ((E @ (k * k)) / nE[:, None] - mk ** 2).clamp_min(0)
                mv = (E @ v) / nE[:, None]
                sv = ((E @ vn) / nE - (mv * mv).sum(-1)).clamp_min(0).sqrt()        # (M,)
                smax = s.max(-1, keepdim=True).values                              # (g,Q,1)
                es = torch.exp(s - smax)[None] * keep[:, None, None]               # (M,g,Q,T)
                ZS = es.sum(-1)
                NS = es @ v
                Zimp = (es * (1 / pi - 1)).sum(-1)
                logZE = (torch.log(E.sum(-1))[:, None, None] + scale * torch.einsum("gqd,md->mgq", q, mk)
                         + 0.5 * scale ** 2 * torch.einsum("gqd,md->mgq", q * q, vk) - smax[None, ..., 0])
                ZE = torch.where(E.sum(-1)[:, None, None] > 0, torch.exp(logZE), 0.0)
                omod = (NS + ZE[..., None] * mv[:, None, None]) / (ZS + ZE)[..., None]
                r_add = (omod - oh).norm(dim=-1) + ZE / (ZS + ZE) * sv[:, None, None]
                excess = (ZE - Zimp).clamp_min(0)
                r_add2 = excess / (ZS + Zimp + excess) * ((mv[:, None, None] - oh).norm(dim=-1) + sv[:, None, None])
                # ||Sigma_hat||_F^2 with Sigma = V'diag(c)V - o b' - b o' + (sum c) o o'
                cf = c.reshape(-1, T).float()
                vf = v.float()
                S2 = torch.empty(cf.shape[0], v.shape[1], v.shape[1])
                for i in range(0, cf.shape[0], 64):
                    S2[i:i + 64] = torch.einsum("nt,td,te->nde", cf[i:i + 64], vf, vf)
                S2 = S2.double().reshape(*c.shape[:-1], v.shape[1], v.shape[1])
                bvec = c @ v
                csum = c.sum(-1)
                Sig = (S2 - oh[..., :, None] * bvec[..., None, :] - bvec[..., :, None] * oh[..., None, :]
                       + csum[..., None, None] * oh[..., :, None] * oh[..., None, :])
                frob2 = (Sig ** 2).sum((-1, -2))
                for j in range(g):
                    for t, off in enumerate(OFFS):
                        for key, arr in [("err", err), ("trace", trace), ("sumx2", sumx2), ("frob2", frob2),
                                         ("neff_tail", neff), ("tailshare", tailshare), ("bmax", bmax),
                                         ("nS_tail", nS_tail), ("miss_w", miss), ("r_add", r_add), ("r_add2", r_add2)]:
                            rec[key].append(arr[:, j, t].numpy())
                        cell["layer"].append(layer); cell["qhead"].append(h * g + j); cell["off"].append(off)
                        cell["budget"].append(fraction); cell["Vtrue"].append(float(Vtrue[j, t]))
                        cell["pop_neff"].append(float(pop_neff[j, t])); cell["onorm"].append(float(o[j, t].norm()))
                        cell["maxshare_true"].append(float(maxshare[j, t]))
                        cell["relse_future"].append(float(relse_f[j, t])); cell["relse_held"].append(float(relse_h[j]))
                        rec["cal_max"].append(cal_max[:, j].numpy()); rec["cal_q90"].append(cal_q90[:, j].numpy())
        print(f"layer {layer} done {time.time() - t0:.0f}s", flush=True)
    np.savez(out, **{k: np.array(vv) for k, vv in rec.items()}, **{k: np.array(vv) for k, vv in cell.items()})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the .npz of per-draw statistics to write")
    ap.add_argument("design", nargs="?", default="paper", choices=("paper", "floor05"))
    ap.add_argument("--capture", default=None, help="capture pickle (default cap1824.pkl beside OUT)")
    a = ap.parse_args()
    main(a.out, a.design, a.capture)
