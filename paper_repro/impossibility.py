"""Table 1: the impossibility result, and the randomized design under the same attack.

For each deterministic policy, the adversary modifies only the values of the
tokens the policy evicted. The retained state is bit-identical, so the
policy's estimate and its (zero) certificate cannot change, while the true
error reaches the requested size. The randomized design (Poisson tail,
SnapKV importance, the same budget) sees every token with pi > 0: on the
attacked cache its certificate widens with the attack and keeps coverage.
"""

from __future__ import annotations

import numpy as np

from kvcert import reference as R

from .common import Config, Table, progress
from .synthetic import design_pi, make_head

TARGETS = (1.0, 10.0, 100.0)
FRACTION = 0.25
KIND = "chebyshev"
DELTA = 0.05


def _policies() -> list[str]:
    """The registered scorers the value-shifting adversary applies to: those that read queries and
    keys only (a value-reading policy, ``reads_values``, could change its kept set under the attack)."""
    from kvcert.fast import SCORERS

    return [name for name, s in SCORERS.items() if not s.reads_values]


def _policy_note() -> str:
    from kvcert.fast import SCORERS

    left = [name for name, s in SCORERS.items() if s.reads_values]
    return (f"Policies: the registered scorers that read queries and keys only ({', '.join(_policies())})"
            + (f"; left out, as they read values the attack shifts: {', '.join(left)}." if left else "."))


def _policy_keep(name: str, head, budget: int) -> np.ndarray:
    """The kept set of the registered scorer ``name`` (reference twin), fed the queries it reads."""
    from kvcert.fast import SCORERS

    need = SCORERS[name].queries_read(head.queries.shape[0], head.keys.shape[0], head.window.shape[0])
    u = R.SCORERS[name](head.queries[-need:], head.keys, head.values, seed=0)
    return R.deterministic_keep(u, budget, sinks=4, window=32)


def _randomized(head, keys, values, pi, draws, rng):
    """Coverage, median radius and RMS error of the Poisson design on a cache."""
    cov, radius, err = _replay(head.q, keys, values, pi, draws, rng, None)
    return cov, radius, float(np.sqrt(np.mean(np.square(err))))


def _replay(q, keys, values, pi, draws, rng, scale):
    """(coverage, median radius, errors) of the Poisson design's certificate over ``draws`` samples,
    batched (:func:`paper_repro.synthetic_coverage.replay_draws`: the draws of ``reference.poisson_sample``)."""
    from .synthetic_coverage import replay_draws

    err, radius, hit = replay_draws(q, keys, values, pi, draws, rng, kinds=(KIND,), deltas=(DELTA,), scale=scale)
    return float(np.mean(hit[KIND, DELTA])), float(np.median(radius[KIND, DELTA])), err


def run(cfg: Config) -> Table:
    rng = np.random.default_rng([cfg.seed, 1])
    n = cfg.n
    head = make_head(rng, "peaked", n=n, d=cfg.d, dv=cfg.dv)
    budget = int(round(FRACTION * n))
    pi = design_pi(head, FRACTION)
    draws = cfg.draws * 2
    base_cov, base_rad, base_rms = _randomized(head, head.keys, head.values, pi, draws, rng)
    rows = []
    jobs = [(p, t) for p in _policies() for t in TARGETS]
    for policy, target in progress(jobs, desc="T1 impossibility", enabled=cfg.progress):
        keep = _policy_keep(policy, head, budget)
        orig_error = np.linalg.norm(R.attention(head.q, head.keys[keep], head.values[keep])
                                    - R.attention(head.q, head.keys, head.values))
        adv = R.adversarial_cache(head.q, head.keys, head.values, keep, target_error=target)
        retained_change = float(max(np.abs(adv.keys[keep] - head.keys[keep]).max(),
                                    np.abs(adv.values[keep] - head.values[keep]).max()))
        est = R.hajek_attention(head.q, adv.keys[keep], adv.values[keep], np.ones(int(keep.sum())))
        cov, rad, rms = _randomized(head, adv.keys, adv.values, pi, draws, rng)
        rows.append(dict(
            policy=policy, target_error=target,
            retained_change=retained_change,
            policy_error_before=float(orig_error),
            policy_error_after=adv.error,
            policy_radius=float(R.certificate(est, delta=DELTA, kind=KIND).radius),
            poisson_radius_before=base_rad,
            poisson_radius_after=rad,
            poisson_rms_error_after=rms,
            poisson_coverage_after=cov,
        ))
    notes = [
        f"One synthetic 'peaked' head, n = {n}, d = dv = {cfg.d}; kept {budget} tokens "
        f"({FRACTION:.0%}): sinks 4 + window 32 + policy's choice. The adversary shifts only the "
        "values of the evicted tokens; keys are unchanged, so every key-based policy keeps the same set.",
        _policy_note(),
        "retained_change: max |difference| of the kept keys and values (exactly 0 means bit-identical). "
        "policy_radius: the certificate a deterministic policy can give (pi = 1 on its kept set: 0).",
        f"Poisson design at the same expected budget (SnapKV importance, top slice half the free budget, "
        f"floor 0.1), {draws} draws, {KIND} certificate at delta = {DELTA}; before the attack its coverage "
        f"is {base_cov:.3f} and RMS error {base_rms:.3g}.",
    ]
    return Table("table1_impossibility", "Table 1: impossibility (deterministic) vs. the randomized design",
                 rows, notes)


#: real-model caches of Table 1b: (layer, KV head), the first query head of the group
REAL_CACHES = ((0, 0), (15, 1), (29, 2))


def _randomized_on(q, keys, values, pi, draws, rng, scale):
    """(coverage, median radius) of the Poisson design's certificate over ``draws`` samples."""
    return _replay(q, keys, values, pi, draws, rng, scale)[:2]


def run_real(cfg: Config, captured) -> Table:
    """Table 1b: the same attack on real-model caches (captured SmolLM2 attention over pydoc text).

    Cache: the first ``cfg.context`` tokens of a layer's KV head; query: the
    model's query of the next token (the group's first query head). Policies
    score with the real prefix queries (``replay.layer_importance``); the
    Poisson design is the paper's (SnapKV importance of the last 32 prefix
    queries) at the same budget.
    """
    from .replay import layer_importance
    from .synthetic import paper_press, press_pi

    rng = np.random.default_rng([cfg.seed, 4])
    L, scale, g = cfg.context, captured.scaling, captured.group
    draws = cfg.draws
    budget = int(round(FRACTION * L))
    rows = []
    jobs = [(c, p, t) for c in REAL_CACHES if c[0] < captured.layers for p in _policies() for t in TARGETS]
    cache = {}
    for (layer, h), policy, target in progress(jobs, desc="T1b impossibility, real caches", enabled=cfg.progress):
        if (layer, h) not in cache:
            imp = {name: layer_importance(name, captured.queries[layer], captured.keys[layer],
                                           captured.values[layer], L, scale, seed=cfg.seed + layer)[h]
                   for name in _policies()}
            k = captured.keys[layer][h, :L].double().numpy()
            v = captured.values[layer][h, :L].double().numpy()
            q = captured.queries[layer][h * g, L].double().numpy()
            pi = press_pi(paper_press(FRACTION), imp["snapkv"])
            cache[layer, h] = (imp, k, v, q, pi, _randomized_on(q, k, v, pi, draws, rng, scale))
        imp, k, v, q, pi, (base_cov, base_rad) = cache[layer, h]
        keep = R.deterministic_keep(imp[policy], budget, sinks=4, window=32)
        before = np.linalg.norm(R.attention(q, k[keep], v[keep], scale=scale) - R.attention(q, k, v, scale=scale))
        adv = R.adversarial_cache(q, k, v, keep, target_error=target, scale=scale)
        change = float(max(np.abs(adv.keys[keep] - k[keep]).max(), np.abs(adv.values[keep] - v[keep]).max()))
        cov, rad = _randomized_on(q, adv.keys, adv.values, pi, draws, rng, scale)
        rows.append(dict(layer=layer, kv_head=h, policy=policy, target_error=target, retained_change=change,
                         policy_error_before=float(before), policy_error_after=adv.error, policy_radius=0.0,
                         poisson_radius_before=base_rad, poisson_coverage_before=base_cov,
                         poisson_radius_after=rad, poisson_coverage_after=cov))
    notes = [
        f"Real caches: SmolLM2 keys and values of {L} pydoc tokens at (layer, KV head) {list(REAL_CACHES)}, "
        f"query = the next token's query (first query head of the group); kept {budget} tokens "
        f"({FRACTION:.0%}): sinks 4 + window 32 + the policy's top scores. The adversary shifts only the "
        "values of the evicted tokens, so the retained state is bit-identical (retained_change 0) and the "
        "deterministic certificate stays 0 while the true error reaches the target.",
        _policy_note(),
        f"Poisson design: the paper's (SnapKV importance, top slice half the free budget, floor 0.1) at the "
        f"same expected budget, {draws} draws, {KIND} at delta = {DELTA}, before and after the attack.",
    ]
    return Table("table1b_impossibility_real", "Table 1b: impossibility on real-model caches", rows, notes)
