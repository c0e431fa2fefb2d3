"""Table 2d: the designs that free memory in a paged cache, beside the token design.

The replay cells of Table 2 (:mod:`paper_repro.replay`: real model, real text,
eviction after the prefix, future queries), with the two designs a paged
serving engine can free memory with.

**Block design** (docs/theory.md section 7): whole blocks of ``block_size``
tokens sampled with known pi_b, **the same blocks for every layer and KV head**
of the sequence (one block table), every token of a kept block offset by
-log pi_b, and the cluster-sampling certificate
(:func:`kvcert.fast.block_hajek_attention`). At kept fraction f of the prefix of
L tokens it keeps f L / block_size blocks in expectation. Its certainty set is
the token design's in blocks: sink blocks covering the 4 sinks, recent blocks
covering the 32-token window, and half of the free budget as certain top
blocks, sized by :func:`kvcert.fast.design_sizes` in block units. Block
importance: SnapKV importance (32-query window) of every layer and KV head,
each head's block totals normalized to shares, then the mean (``mean``) or the
max (``max``) over all heads (:func:`kvcert.fast.block_importance`). A draw
samples the blocks once for the whole model; each (layer, KV head) cell then
sees the same kept blocks, so the cells of one draw are dependent (the
coverage is still a per-cell frequency over independent draws).

**Served token design** (``servedB``, docs/design.md section 7): the token
design ``PoissonPress`` ships (Table 2's ``paper`` design: same pi, independent
Poisson draws per (layer, KV head)), held in a paged cache by compaction
(:func:`kvcert.fast.compact_slots`): every head's kept tokens are copied into
the request's first m = ceil(max_{l,h} C_{l,h} / B) blocks, shorter heads padded
(log pi = -inf). Its estimate and certificate per (layer, head) are the token
design's; only its memory differs: per draw, ``Compaction.memory(d, dv)``
(held blocks with the padding, plus the log pi side buffer), not the expected
kept fraction. Equal memory: at target memory M the served design runs the
token design at the kept fraction f_s whose *expected* memory, computed exactly
from pi (:func:`served_memory`), is M (bisection, :func:`equal_memory_fraction`);
it is compared with the token design at kept fraction M.

**Served systematic design** (``servedsysB``): the same served layout, estimates, certificates and memory
accounting as ``servedB``, only each (layer, KV head) draws the token design's pi by randomized systematic
sampling (:func:`kvcert.fast.systematic_sample`, fed the replay's own uniforms and one start per head) instead
of Poisson sampling. A head then keeps floor or ceil of sum pi tokens; at an integer budget of m blocks,
B = m * block_size tokens, every head keeps exactly B and the compacted prompt holds exactly m blocks, no
padding. Equal memory: m = round(M L / block_size) (no bisection; a design whose m is not at least one block
more than the sinks and window need cannot run at that M, and its row says so), kept fraction B / L, memory
``Compaction.memory(d, dv)`` = the m blocks (with the prompt's partly filled last block, if any) plus the
log pi buffer. That memory is not exactly M, so the token design also runs at the row's realized memory
(``token_at_servedsysB``) and ``equal_memory_ratio`` is the served row's error over that run's.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import kvcert.fast as F

from .common import Config, Table, progress
from .replay import layer_importance, setup_for
from .synthetic import SINKS, WINDOW, paper_press, press_pi
from .synthetic_coverage import draw_estimates, draw_statistics, summarize

#: compared block designs: name -> (block_size, reduce); block_size None = the token design ("paper" of Table 2)
BLOCK_DESIGNS = {"token": (None, None), "block16_mean": (16, "mean"), "block16_max": (16, "max"),
                 "block32_mean": (32, "mean"), "block64_mean": (64, "mean"), "block128_mean": (128, "mean")}
#: the served token design (compaction into the engine's blocks): name -> block_size
SERVED_DESIGNS = {"served16": 16, "served32": 32, "served64": 64}
#: the served token design drawn by systematic sampling (a fixed kept count per head): name -> block_size
SERVED_SYSTEMATIC_DESIGNS = {"servedsys16": 16, "servedsys32": 32, "servedsys64": 64}
DESIGNS = (*BLOCK_DESIGNS, *SERVED_DESIGNS, *SERVED_SYSTEMATIC_DESIGNS)
#: the row of the token design run at a servedsys row's realized memory (its equal-memory comparator)
TOKEN_AT = "token_at_"
KIND = "chebyshev"  # the default certificate; the block trace is the cluster-sampling trace
#: a silent material error: ||o_hat - o|| > SILENT ||o|| and outside the certificate
SILENT = 0.05
#: equal memory: the bisection stops when |E memory(f_s) - M| <= MEMORY_TOL (absolute, fraction of the prompt)
MEMORY_TOL = 1e-3


def block_design_pi(importance: torch.Tensor, fraction: float, block_size: int, reduce: str) -> torch.Tensor:
    """pi_b (n_blocks,) float64 of the block design at kept fraction ``fraction`` of the L prefix tokens.

    importance: (layers, h_kv, L) token importance of every head sharing the block table.
    Budget f L / block_size blocks; certainty set = the token design's sinks, window and top slice
    in blocks (``kvcert.fast.design_sizes``), held by a ``kvcert.fast.BlockDesign`` (the served design's
    object; :meth:`~kvcert.fast.BlockDesign.inclusion_probabilities`). Raises ValueError where the budget cannot hold the
    certainty set (e.g. f = 0.1 with 128-token blocks: 1.4 blocks).
    """
    L = importance.shape[-1]
    budget = fraction * L / block_size
    sizes = F.design_sizes(budget, sinks=math.ceil(SINKS / block_size), window=math.ceil(WINDOW / block_size),
                           top_fraction=0.5)
    if sizes.sinks + sizes.window < math.ceil(SINKS / block_size) + math.ceil(WINDOW / block_size):
        raise ValueError(f"budget {budget:.2f} blocks of {block_size} tokens cannot hold the sink and recent "
                         f"blocks")
    design = F.BlockDesign(block_size=block_size, sink_blocks=sizes.sinks, recent_blocks=sizes.window,
                           top_blocks=sizes.top, floor=0.1, reduce=reduce)
    return design.inclusion_probabilities(importance[None], budget)[0]


def token_pi(importance: torch.Tensor, fraction: float) -> torch.Tensor:
    """pi (layers, h_kv, L) float64 of Table 2's token design (``paper``) at kept fraction ``fraction``:
    :func:`paper_repro.synthetic.press_pi` of ``PoissonPress(compression_ratio=1 - fraction)`` per head."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    press = paper_press(fraction)
    imp = importance.double().numpy()
    return torch.from_numpy(np.stack([[press_pi(press, imp[layer, h]) for h in range(imp.shape[1])]
                                      for layer in range(imp.shape[0])]))


def max_count_cdf(pi: torch.Tensor) -> torch.Tensor:
    r"""P(max_h C_h <= c) for c = 0..n, C_h = sum_i I_{h,i}, I_{h,i} ~ Bernoulli(pi_{h,i}) independent.

    pi: (..., n) inclusion probabilities of independent Poisson designs (one per leading index h).
    Each C_h is Poisson-binomial; its pmf comes from the exact recursion
    p_{k}^{(i)} = (1 - pi_i) p_k^{(i-1)} + pi_i p_{k-1}^{(i-1)} (float64), and
    P(max_h C_h <= c) = prod_h P(C_h <= c). Returns (n + 1,) float64.
    """
    p = pi.reshape(-1, pi.shape[-1]).double()
    if p.numel() and not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError("pi must lie in [0, 1]")
    H, n = p.shape
    pmf = torch.zeros(H, n + 1, dtype=torch.float64)
    pmf[:, 0] = 1.0
    certain = (p >= 1).sum(-1)                         # pi = 1 only shifts the count
    tail = torch.where(p >= 1, 0.0, p)
    tail = tail.gather(-1, tail.argsort(-1, descending=True))
    width = int((tail > 0).sum(-1).max()) if H else 0  # pi = 0 changes nothing
    for i in range(width):
        t = tail[:, i:i + 1]
        upper = i + 2                                   # counts 0..i+1 are reachable after i + 1 tokens
        new = pmf[:, :upper] * (1 - t)
        new[:, 1:] += pmf[:, :upper - 1] * t
        pmf[:, :upper] = new
    cdf = pmf.cumsum(-1)
    shifted = torch.zeros_like(cdf)                    # C_h = certain_h + tail count
    for h in range(H):
        c0 = int(certain[h])
        shifted[h, c0:] = cdf[h, :n + 1 - c0]
    return shifted.clamp(max=1.0).prod(0)


def served_memory(pi: torch.Tensor, block_size: int, head_dim: int, value_dim: int | None = None) -> float:
    r"""Expected memory E[``Compaction.memory(d, dv)``] of the served token design, exactly from pi.

    pi: (layers, h_kv, n) of independent per-head Poisson designs over a prompt of n tokens.
    With c = max_{l,h} C_{l,h} (distribution from :func:`max_count_cdf`), m(c) = ceil(c / B),
    P = ceil(n / B) prompt blocks, full = floor(n / B), held(c) = P - max(0, full - m(c)):

    .. math:: E[\text{mem}] = \sum_c P(\max C = c)\,
              \frac{\text{held}(c)\, B (d + d_v) + m(c) B}{P B (d + d_v)}.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    d = int(head_dim)
    dv = d if value_dim is None else int(value_dim)
    n = pi.shape[-1]
    cdf = max_count_cdf(pi)
    pmf = torch.diff(cdf, prepend=torch.zeros(1, dtype=torch.float64))
    c = torch.arange(n + 1, dtype=torch.float64)
    m = torch.ceil(c / block_size)
    P, full = -(-n // block_size), n // block_size
    held = P - torch.clamp(full - m, min=0)
    mem = (held * block_size * (d + dv) + m * block_size) / (P * block_size * (d + dv))
    return float((pmf * mem).sum())


def equal_memory_fraction(importance: torch.Tensor, target: float, block_size: int, head_dim: int,
                          value_dim: int | None = None, *, tol: float = MEMORY_TOL,
                          iterations: int = 30) -> tuple[float, float]:
    """(f_s, E memory at f_s): the token design's kept fraction whose served memory is ``target``.

    Bisection on f in [f_min, target] of :func:`served_memory` of :func:`token_pi` (importance
    (layers, h_kv, L)); E memory >= f (the compacted slots hold the largest head's kept count), so
    f_s <= target. f_min = (sinks + window + 2) / L, the smallest budget that holds the certainty
    set and samples. Stops at |E memory - target| <= ``tol`` or after ``iterations`` halvings (then
    the closer end; the caller reports the gap). Raises ValueError when even f_min needs more
    memory than the target.
    """
    L = importance.shape[-1]
    lo, hi = (SINKS + WINDOW + 2) / L, float(target)
    if not 0 < lo < hi <= 1:
        raise ValueError(f"target memory must lie in ({lo:.4f}, 1], got {target}")

    def mem(f):
        return served_memory(token_pi(importance, f), block_size, head_dim, value_dim)

    m_lo, m_hi = mem(lo), mem(hi)
    if m_lo > target + tol:
        raise ValueError(f"served design with blocks of {block_size}: memory {m_lo:.4f} at the smallest kept "
                         f"fraction {lo:.4f} exceeds the target {target}")
    if abs(m_hi - target) <= tol:
        return hi, m_hi
    best = min(((lo, m_lo), (hi, m_hi)), key=lambda x: abs(x[1] - target))
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        m_mid = mem(mid)
        if abs(m_mid - target) < abs(best[1] - target):
            best = (mid, m_mid)
        if abs(m_mid - target) <= tol:
            break
        lo, hi = (mid, hi) if m_mid < target else (lo, mid)
    return best


def served_estimates(q, k, v, positions, log_pi, L, qpos, scale, kinds_need):
    """fast.hajek_attention over M served draws of one (layer, KV head), read from the compacted layout.

    q (g, Q, d); k/v (T, d) of the whole sequence; positions/log_pi (M, S): the compacted prompt slots
    of the head (``Compaction.positions`` / ``.log_pi``, -1 / -inf on padding); the later tokens
    L..T-1 follow at their logical positions with log pi = 0, as the engine holds them.
    """
    M, S = positions.shape
    T = k.shape[0]
    src = positions.long().clamp(min=0)
    later = torch.arange(L, T).expand(M, T - L)
    slots = torch.cat([src, later], dim=1)                                      # (M, S + T - L)
    keys, values = k[slots], v[slots]
    lp = torch.cat([log_pi.to(k.dtype), torch.zeros(M, T - L, dtype=k.dtype)], dim=1)
    kw = dict(scale=scale, positions=slots[:, None], query_positions=qpos, **F.estimate_options(kinds_need))
    return F.hajek_attention(q.expand(M, *q.shape), keys[:, None], values[:, None], log_pi=lp[:, None],
                             validate=False, **kw)


def systematic_blocks(n_tokens: int, target: float, block_size: int) -> int:
    """m: the blocks of ``block_size`` the served systematic design holds at target memory ``target`` (a
    fraction of the n_tokens prompt tokens), round(target n / block_size); its budget is m * block_size
    tokens, kept exactly by every head.

    Raises ValueError when m is not at least one block more than the sinks and recent window need
    (ceil((SINKS + WINDOW) / block_size)), or when m blocks exceed the prompt: the design cannot run at that
    target (rounding m up would change the memory it is compared at).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    m = round(target * n_tokens / block_size)
    need = math.ceil((SINKS + WINDOW) / block_size)
    if m < need + 1:
        raise ValueError(f"m = round({target} x {n_tokens} / {block_size}) = {m} blocks of {block_size} tokens "
                         f"cannot hold the sink and recent blocks ({need}) and one block to sample")
    if m * block_size > n_tokens:
        raise ValueError(f"m = {m} blocks of {block_size} tokens exceed the {n_tokens}-token prompt")
    return m


def _served_draws(pi, draws, block_size, rng, d, dv, sampling: str = "poisson"):
    """Draws of the token design over all (layers, h_kv, L) at once, compacted: (positions, log_pi)
    (draws, layers, h_kv, S_max) padded alike, and the realized memory (draws,) of each draw.

    ``sampling``: ``"poisson"`` (I = [U < pi], one uniform per token from ``rng``) or ``"systematic"``
    (:func:`kvcert.fast.systematic_sample` with one uniform per token and one start per head from ``rng``)."""
    comps, memory = [], []
    for _ in range(draws):
        if sampling == "poisson":
            keep = torch.from_numpy(rng.random(tuple(pi.shape))) < pi
        elif sampling == "systematic":
            u = torch.from_numpy(rng.random(tuple(pi.shape)))
            start = torch.from_numpy(rng.random(tuple(pi.shape[:-1])))
            keep = F.systematic_sample(pi, uniforms=u, start=start)
        else:
            raise ValueError(f"sampling must be 'poisson' or 'systematic', got {sampling!r}")
        c = F.compact_slots(keep, pi, block_size)
        comps.append(c)
        memory.append(c.memory(d, dv))
    S = max(c.positions.shape[-1] for c in comps)
    pos = torch.stack([torch.nn.functional.pad(c.positions.int(), (0, S - c.positions.shape[-1]), value=-1)
                       for c in comps])
    lp = torch.stack([torch.nn.functional.pad(c.log_pi.float(), (0, S - c.log_pi.shape[-1]), value=float("-inf"))
                      for c in comps])
    return pos, lp, np.array(memory)


def run(cfg: Config, captured, *, designs=None, draws: int | None = None) -> Table:
    """T2d: coverage, worst decile, silent errors, tightness and relative error of the block, served
    and token designs at equal memory.

    ``designs`` (names of :data:`DESIGNS`, default all) and ``draws`` (default: Table 2's draws per
    cell) shrink the run, e.g. for tests. ``budget`` of a row is the target memory M (the kept
    fraction of the token and block designs; the served design's f_s is its ``expected_kept``).
    """
    setup = setup_for(cfg)
    if draws is not None:
        setup.draws = draws
    names = tuple(designs or DESIGNS)
    unknown = [n for n in names if n not in DESIGNS]
    if unknown:
        raise ValueError(f"designs must be names of {DESIGNS}, got {unknown}")
    L, Fut = setup.prefix, setup.future
    T = L + Fut
    scale, g = captured.scaling, captured.group
    h_kv, d = captured.keys[0].shape[0], captured.keys[0].shape[-1]
    dv = captured.values[0].shape[-1]
    qpos = torch.tensor([L + o for o in setup.query_offsets])
    rng = np.random.default_rng([cfg.seed, 4])
    importance = torch.stack([torch.from_numpy(layer_importance("snapkv", captured.queries[layer],
                                                                  captured.keys[layer], captured.values[layer],
                                                                  L, scale, seed=cfg.seed + layer))
                              for layer in range(captured.layers)])          # (layers, h_kv, L)
    # (fraction, name) -> dict(kind="token"|"block"|"served", ...) | reason str
    specs = {}
    # (fraction, "token_at_servedsysB") -> the key of the token run it reads (one run per distinct kept fraction)
    alias = {}
    for fraction in cfg.budgets:
        for name in names:
            if name in SERVED_SYSTEMATIC_DESIGNS:
                bs = SERVED_SYSTEMATIC_DESIGNS[name]
                try:
                    m = systematic_blocks(L, fraction, bs)
                except ValueError as err:
                    specs[fraction, name] = str(err)
                    continue
                f_sys = m * bs / L
                pi = token_pi(importance, f_sys)
                pos, lp, memory = _served_draws(pi, setup.draws, bs, rng, d, dv, sampling="systematic")
                # the planned layout's memory (m blocks, no padding): Compaction.memory of m * bs slots per head
                planned = F.Compaction(bs, L, torch.zeros(0), torch.empty(0, m * bs), torch.empty(0, m * bs))
                specs[fraction, name] = dict(kind="served", bs=bs, f=f_sys, expected=f_sys,
                                             memory_expected=planned.memory(d, dv), blocks=m,
                                             positions=pos, log_pi=lp, memory=memory)
                # the token design at this row's realized memory (its memory is its kept fraction, capped at 1)
                f_tok = min(float(memory.mean()), 1.0)
                twin = next((key for key, spec in specs.items() if key[0] == fraction and
                             key[1].startswith(TOKEN_AT) and spec["f"] == f_tok), None)
                if twin is not None:
                    alias[fraction, TOKEN_AT + name] = twin
                else:
                    specs[fraction, TOKEN_AT + name] = dict(kind="token", bs=None, f=f_tok,
                                                            pi=token_pi(importance, f_tok))
            elif name == "token":
                specs[fraction, name] = dict(kind="token", bs=None, f=fraction, pi=token_pi(importance, fraction))
            elif name in BLOCK_DESIGNS:
                bs, reduce = BLOCK_DESIGNS[name]
                try:
                    pib = block_design_pi(importance, fraction, bs, reduce)
                except ValueError as err:
                    specs[fraction, name] = str(err)
                    continue
                keep = torch.from_numpy(rng.random((setup.draws, pib.shape[0]))) < pib
                sizes = F.expand_blocks(torch.ones(pib.shape[0], dtype=torch.float64), bs, L)  # 1 per token
                realized = (F.block_keep(keep, bs, L).double() * sizes).sum(-1) / L
                specs[fraction, name] = dict(kind="block", bs=bs, pib=pib, keep=keep, f=fraction,
                                             expected=float(F.expand_blocks(pib, bs, L).sum()) / L,
                                             memory=realized.numpy())
            else:
                bs = SERVED_DESIGNS[name]
                try:
                    f_s, m_exp = equal_memory_fraction(importance, fraction, bs, d, dv)
                except ValueError as err:
                    specs[fraction, name] = str(err)
                    continue
                pi = token_pi(importance, f_s)
                pos, lp, memory = _served_draws(pi, setup.draws, bs, rng, d, dv)
                specs[fraction, name] = dict(kind="served", bs=bs, f=f_s, expected=f_s, memory_expected=m_exp,
                                             positions=pos, log_pi=lp, memory=memory)
    cells, errors, silent = {}, {}, {}
    jobs = [(layer, h) for layer in range(captured.layers) for h in range(h_kv)]
    for layer, h in progress(jobs, desc="T2d paged-design replay", enabled=cfg.progress):
        k = captured.keys[layer][h, :T]
        v = captured.values[layer][h, :T]
        q = captured.queries[layer][h * g:(h + 1) * g, :T][:, qpos]          # (g, Q, d)
        exact = F.hajek_attention(q[None], k[None, None], v[None, None], torch.ones(1, 1, T), scale=scale,
                                  query_positions=qpos, per_coordinate=False).output[0]  # (g, Q, dv)
        onorm = exact.norm(dim=-1)
        for key, spec in specs.items():
            if isinstance(spec, str):
                continue
            if spec["kind"] == "served":
                est = served_estimates(q, k, v, spec["positions"][:, layer, h], spec["log_pi"][:, layer, h],
                                       L, qpos, scale, (KIND,))
            else:
                if spec["kind"] == "token":  # Table 2's token design, its own draws per cell
                    pi = spec["pi"][layer, h].float()
                    keep = torch.from_numpy(rng.random((setup.draws, L))) < pi
                else:
                    pi = F.expand_blocks(spec["pib"].float(), spec["bs"], L)
                    keep = F.block_keep(spec["keep"], spec["bs"], L)
                pis = torch.cat([torch.where(keep, pi, 0.0), torch.ones(setup.draws, Fut)], dim=1)
                est = draw_estimates(q, k, v, pis, qpos, scale, (KIND,), block_size=spec["bs"] if
                                     spec["kind"] == "block" else None)
            stats = draw_statistics(est, exact, (KIND,), cfg.deltas)
            cells.setdefault(key, []).extend(stats)
            rel = (est.output - exact).norm(dim=-1) / onorm                       # (M, g, Q)
            errors.setdefault(key, []).extend(rel.mean(0).flatten().tolist())
            material = (rel > SILENT).permute(1, 2, 0).reshape(-1, rel.shape[0]).numpy()  # j-major, as stats
            for dl in cfg.deltas:
                silent.setdefault((key, dl), []).extend(
                    float((m & ~(c[2][KIND, dl] > 0.5)).mean()) for m, c in zip(material, stats))
    rows = []

    def mean_error(key):
        key = alias.get(key, key)
        return float(np.mean(errors[key])) if key in errors else np.nan

    for fraction in cfg.budgets:
        token_err = mean_error((fraction, "token"))
        row_names = [x for name in names for x in
                     ((name, TOKEN_AT + name) if name in SERVED_SYSTEMATIC_DESIGNS and
                      not isinstance(specs[fraction, name], str) else (name,))]
        for name in row_names:
            key = alias.get((fraction, name), (fraction, name))
            spec = specs[key]
            bs_of = name[len(TOKEN_AT):] if name.startswith(TOKEN_AT) else name
            base = dict(budget=fraction, design=name,
                        block_size=SERVED_DESIGNS.get(name) or SERVED_SYSTEMATIC_DESIGNS.get(bs_of) or
                        BLOCK_DESIGNS.get(name, (None,))[0] or 1)
            if isinstance(spec, str):
                rows.append(dict(base, cells=0, note=spec))
                continue
            if spec["kind"] == "token":
                f = spec["f"]
                memory = dict(expected_kept=f, memory=f, memory_max=np.nan, memory_expected=f)
            else:
                memory = dict(expected_kept=spec["expected"], memory=float(spec["memory"].mean()),
                              memory_max=float(spec["memory"].max()),
                              memory_expected=spec.get("memory_expected", spec["expected"]))
            err = mean_error(key)
            ratio = err / token_err if token_err > 0 else np.nan   # nan where the token design is exact
            equal = dict(equal_memory=np.nan, equal_memory_ratio=np.nan)
            if name in SERVED_SYSTEMATIC_DESIGNS:  # over the token design at this row's realized memory
                twin = alias.get((fraction, TOKEN_AT + name), (fraction, TOKEN_AT + name))
                twin_err = mean_error(twin)
                equal = dict(equal_memory=specs[twin]["f"],
                             equal_memory_ratio=err / twin_err if twin_err > 0 else np.nan)
            for dl in cfg.deltas:
                rows.append(dict(base, **memory, kind=KIND, delta=dl, nominal=1 - dl,
                                 cells=len(cells[key]), **summarize(cells[key], KIND, dl),
                                 silent=float(np.mean(silent[key, dl])),
                                 mean_relative_error=err, error_ratio=ratio, **equal, note=""))
    notes = [
        f"Replay cells of Table 2 ({captured.layers} layers x {h_kv * g} query heads x "
        f"{len(setup.query_offsets)} future queries, eviction after {L} pydoc tokens), {setup.draws} draws "
        f"per cell; certificate `{KIND}` (for blocks: radius sqrt(trace / delta) with the cluster-sampling "
        "trace sum_{b in S} (1 - pi_b) ||sum_{i in b} a_i (v_i - o_hat)||^2).",
        "budget: the target memory M (fraction of the prompt's K/V). token: Table 2's `paper` design at kept "
        "fraction M (per KV head, SnapKV importance; memory = its expected kept fraction, no padding). "
        "blockB_mean / blockB_max: whole blocks of B tokens, one sample for all layers and heads, block "
        "importance = mean / max over the heads of each head's normalized block totals of SnapKV importance; "
        "certainty set in blocks (sink and recent blocks covering 4 sinks and a 32-token window, half the free "
        "budget as top blocks), floor 0.1; expected_kept = sum_b pi_b |b| / L = M, memory = realized kept "
        "blocks' tokens / L (mean, max over draws).",
        f"servedB: the token design served in blocks of B by compaction (kvcert.fast.compact_slots), one draw "
        f"for all layers and heads; expected_kept = f_s, the token design's kept fraction chosen by bisection "
        f"so that its expected memory, computed exactly from pi (memory_expected), is M within {MEMORY_TOL}; "
        f"memory / memory_max = mean / max over draws of Compaction.memory(d, dv) (held blocks with padding "
        f"plus the log pi buffer).",
        "servedsysB: the served token design drawn by randomized systematic sampling per (layer, KV head) "
        "(kvcert.fast.systematic_sample; same pi, a fixed kept count); m = round(M L / B) blocks, kept "
        "fraction expected_kept = m B / L exactly per head, memory = Compaction.memory(d, dv) (the m blocks plus "
        "the log pi buffer; memory_expected = the planned layout's). token_at_servedsysB: the token design at "
        "kept fraction = that row's realized memory (capped at 1); equal_memory / equal_memory_ratio: that "
        "memory and the servedsys row's error over that run's (its error_ratio stays over the token design at M).",
        f"silent: fraction of (cell, draw) pairs with ||o_hat - o|| > {SILENT} ||o|| outside the certificate. "
        "mean_relative_error: ||o_hat - o|| / ||o||, mean over draws, then cells; error_ratio: over the token "
        "design's at the same M. A row with cells = 0 names why the design cannot run at that budget.",
    ]
    columns = ["budget", "design", "block_size", "expected_kept", "memory", "memory_max", "memory_expected", "kind",
               "delta", "nominal", "cells", "coverage", "worst_decile", "silent", "spearman", "tightness",
               "mean_relative_error", "error_ratio", "equal_memory", "equal_memory_ratio", "note"]
    return Table("table2d_block_design", "Table 2d: paged designs (block, served token) vs the token design at "
                 "equal memory", rows, notes, columns=columns)
