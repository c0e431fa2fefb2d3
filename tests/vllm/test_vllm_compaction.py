"""The token design's compaction in the plugin's CPU backend, without an engine (docs/design.md section 7).

A 150-token prompt is written into a scattered paged cache with vLLM's own cache op; the backend's prefill
forward draws the token design (the press's ``TokenDesign.decide``), copies each KV head's kept tokens into
the first blocks, and the worker's step installs the request's state. Then "another request" overwrites the
freed blocks, three decode tokens are written, and the backend's decode forward must equal the Hajek estimator
over the kept tokens and the tail (float64, ``kvcert.fast.hajek_attention``) and give its certificate. Negative
controls: the same decode without the copy, and with the padding mask removed, are visibly wrong.

Tolerance: float32 attention over at most 153 tokens against float64: rtol 1e-5 / atol 1e-6 (measured gap
5.9e-7 on 2026-12-04, printed with -s).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import kvcert.fast as F
from backend_support import (BS, D, H, H_Q, Q, T, TABLE, decode_metadata, layer_forward, prefill_metadata,
                             setup_backend, write_cache)

def test_prefill_compacts_and_decode_equals_the_estimator_after_the_freed_blocks_are_reused(monkeypatch):
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    backend, worker, impl, cache, k, v, cfg, fake, layer, scale = setup_backend(sketch=None)  # the paper's design
    original = cache.clone()
    qp = torch.randn(Q, H_Q, D)
    md = prefill_metadata(backend, impl)
    step = worker.Step(fake)
    out = layer_forward(backend, impl, step, layer, qp, cache, md)
    ref = torch.nn.functional.scaled_dot_product_attention(  # the prefill itself is the stock attention
        qp.transpose(0, 1)[None], k[:Q].transpose(0, 1)[None], v[:Q].transpose(0, 1)[None], is_causal=True,
        enable_gqa=True, scale=scale)[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    compacted = step.results(BS).compacted
    state = fake.kvcert_states["a"]
    assert isinstance(state, worker.Compacted) and state.n_prompt == Q and set(compacted) == {"a"}
    # the design the backend drew: the press's, on the scorer's scores of this layer
    design = cfg.design
    u = design.score(qp[-8:].permute(1, 0, 2)[None], k[:Q].transpose(0, 1)[None], v[:Q].transpose(0, 1)[None],
                     scale=scale, layer=0)
    dec = design.decide(u[0], layer=0, event=0)
    layout = F.compact_slots(dec.keep, dec.pi, BS)
    assert compacted["a"]["counts"] == [dec.kept.tolist()] and compacted["a"]["m"] == layout.m == state.m
    assert layout.freed_blocks > 0
    # the compacted slots hold the kept tokens, in order, in the request's last full prompt blocks, the last
    # first (kvcert.vllm.handoff.compaction_targets); its first prompt blocks stay as computed (the scheduler
    # registers those in the prefix cache and frees them)
    from kvcert.vllm.backend import gather_blocks
    from kvcert.vllm.handoff import compaction_layout

    assert state.block_ids.tolist() == TABLE[0, : Q // BS].flip(0)[: layout.m].tolist()
    gk, gv = gather_blocks(cache, state.block_ids)
    for h in range(H):
        c = int(dec.kept[h])
        torch.testing.assert_close(gk[h, :c], k[:Q, h][dec.keep[h]], rtol=0, atol=0)
        torch.testing.assert_close(gv[h, :c], v[:Q, h][dec.keep[h]], rtol=0, atol=0)
    used, intact = compaction_layout(Q // BS, 0, layout.m)
    assert (used, intact) == (0, Q // BS - layout.m) and intact > 0
    torch.testing.assert_close(cache[TABLE[0, :intact]], original[TABLE[0, :intact]], rtol=0, atol=0)
    # another request is handed the freed blocks and writes there; then three decode tokens are written
    freed = TABLE[0, used:intact]
    cache[freed] = 1e4 * torch.randn_like(cache[freed])
    original[freed] = cache[freed]
    write_cache(cache, k[Q:], v[Q:], torch.arange(Q, Q + T))
    write_cache(original, k[Q:], v[Q:], torch.arange(Q, Q + T))
    qd = torch.randn(1, H_Q, D)
    md = decode_metadata()
    step = worker.Step(fake)
    out = layer_forward(backend, impl, step, layer, qd, cache, md)
    certs = step.results(BS).certs
    # the estimator over the kept prompt tokens (pi) and the decode tokens (pi = 1), in float64
    pi = torch.cat([torch.where(dec.keep, dec.pi, 0.0), torch.ones(H, T, dtype=torch.float64)], dim=1)
    est = F.hajek_attention(qd.double(), k.transpose(0, 1)[None].double(), v.transpose(0, 1)[None].double(),
                            pi[None], scale=scale, per_coordinate=False)
    print(f"max |decode - float64 estimator| = {(out.double() - est.output).abs().max():.2e}")
    torch.testing.assert_close(out.double(), est.output, rtol=1e-5, atol=1e-6)
    _, _, rel = F.radius_from_statistics("chebyshev", 0.05, **F.certificate_moments(est, "chebyshev"))
    assert certs["a"] == pytest.approx(float(rel.mean()), rel=1e-5) and certs["a"] > 0
    # the two routes of the decode (the compiled op's paged route, and gather + kvcert.dispatch) agree
    plan = step.plan(md, BS)
    ids, lp = plan.compacted_inputs(0)
    from kvcert import dispatch

    res = backend.token_decode(qd, cache, ids, lp, scale, "chebyshev", 0.05)
    first, rel1, route = res.output, res.radius, res.route.code
    assert res.route == (dispatch.PAGED_CPU_OP if dispatch.cpu_op_available() else dispatch.GATHER)
    monkeypatch.setenv("KVCERT_CPU_OP", "0")
    res = backend.token_decode(qd, cache, ids, lp, scale, "chebyshev", 0.05)
    other, rel2 = res.output, res.radius
    assert res.route == dispatch.GATHER and res.dense == dispatch.TORCH
    print(f"route {route}: max |paged - gather| = {(first - other).abs().max():.2e}")
    torch.testing.assert_close(first, other, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rel1, rel2, rtol=1e-4, atol=0)
    monkeypatch.delenv("KVCERT_CPU_OP")
    # negative control 1: without the copy (the prompt where it was) the same state reads the wrong tokens
    no_copy = backend.token_decode(qd, original, ids, lp, scale, "chebyshev", 0.05).output
    assert (no_copy.double() - est.output).abs().max() > 1e-2
    # negative control 2: without the padding mask the padding slots and the reused blocks' slots count
    unmasked = torch.where(torch.isneginf(lp), torch.zeros_like(lp), lp)
    no_mask = backend.token_decode(qd, cache, ids, unmasked, scale, "chebyshev", 0.05).output
    assert (no_mask.double() - est.output).abs().max() > 1e-2


def test_compacted_rows_read_the_compacted_blocks_then_the_tail():
    from kvcert.vllm import worker

    state = worker.Compacted(n_prompt=150, m=2, log_pi=torch.zeros(1, 2, 64))
    row = worker.Step._compacted_row("a", 0, TABLE[0], 153, state, BS)
    # blocks 0-1 (compacted), then block 4 (positions 128..159: the prompt's partial block, now the tail)
    assert row.block_ids.tolist() == [4, 0, 1]
    valid = torch.isfinite(row.tail_log_pi).nonzero().flatten() + 4 * BS
    assert valid.tolist() == [150, 151, 152]


def test_a_sketched_design_keeps_its_sketch_beside_the_compacted_blocks(monkeypatch):
    """``KVCertConfig(sketch="tilted", kind="tilted_hull")``: the prefill samples the budget less the sketch's
    memory (``TokenDesign.sampled_budget``), keeps the sketch of the evicted tokens in the request's state, and
    decode records min(3 sqrt(V_cl), H) of ``kvcert.fast.sketch_hajek_attention`` over the kept tokens and the
    tail with that sketch (float64 here: the same rtol 1e-5 as the estimator above, measured gap printed with
    -s). Negative control: the same state without its sketch records a different certificate."""
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    backend, worker, impl, cache, k, v, cfg, fake, layer, scale = setup_backend(sketch="tilted", kind="tilted_hull")
    qp = torch.randn(Q, H_Q, D)
    md = prefill_metadata(backend, impl)
    step = worker.Step(fake)
    layer_forward(backend, impl, step, layer, qp, cache, md)
    compacted = step.results(BS).compacted
    state = fake.kvcert_states["a"]
    design = cfg.design
    kk, vv = k[:Q].transpose(0, 1)[None], v[:Q].transpose(0, 1)[None]
    u = design.score(qp[-8:].permute(1, 0, 2)[None], kk, vv, scale=scale, layer=0)
    budget = design.sampled_budget(Q, D, D)
    assert budget == pytest.approx(Q * 0.4 - design.sketch.tokens(D, D))  # 60 - 2209 / 129
    dec = design.decide(u[0], layer=0, event=0, budget=budget)
    assert compacted["a"]["counts"] == [dec.kept.tolist()]
    sketch = design.sketch_of(kk, vv, dec, queries=qp[-8:].permute(1, 0, 2)[None], scale=scale)
    assert len(state.sketches) == 1 and compacted["a"]["sketch_bytes"] == state.sketch_bytes > 0
    torch.testing.assert_close(state.sketches[0].mean, sketch.mean, rtol=0, atol=0)
    # the kept values' sums and count per KV head, taken when the prompt was compacted (the decode's value centre
    # reads them instead of the compacted slots): float32 values summed in double, in another order than here
    kept_v = torch.where(dec.keep[..., None], vv[0].double(), 0.0)
    want_sums = torch.cat([kept_v.sum(1), dec.keep.sum(-1, keepdim=True).double()], dim=1)
    assert state.value_sums.shape == (1, H, D + 1)
    torch.testing.assert_close(state.value_sums[0], want_sums, rtol=1e-12, atol=1e-12)
    # decode after the freed blocks were overwritten by another request
    from kvcert.vllm.handoff import compaction_layout

    used, intact = compaction_layout(Q // BS, 0, state.m)  # the blocks the scheduler frees, no cached prefix
    freed = TABLE[0, used:intact]
    cache[freed] = 1e4 * torch.randn_like(cache[freed])
    write_cache(cache, k[Q:], v[Q:], torch.arange(Q, Q + T))
    qd = torch.randn(1, H_Q, D)
    md = decode_metadata()
    step = worker.Step(fake)
    seen, sketch_decode = [], backend.sketch_decode  # the centre the forward hands to the sketched decode, the route
    monkeypatch.setattr(backend, "sketch_decode", lambda *a, **kw: seen.append((a[8], sketch_decode(*a, **kw)))
                        or seen[-1][1])
    out = layer_forward(backend, impl, step, layer, qd, cache, md)
    monkeypatch.setattr(backend, "sketch_decode", sketch_decode)
    assert len(seen) == 1 and seen[0][0] is not None
    certs = step.results(BS).certs
    from kvcert import dispatch

    assert seen[0][1].route == (dispatch.PAGED_CPU_OP if dispatch.cpu_op_available() else dispatch.GATHER)
    # the two routes of the sketched decode (the compiled op read from the paged cache, its value centre its own;
    # and gather + kvcert.fast, the moments in torch) agree
    ids, lp = step.plan(md, BS).compacted_inputs(0)
    centre = step.plan(md, BS).compacted_centres(0)
    assert centre is not None and centre[1].tolist() == [state.m * BS]
    torch.testing.assert_close(centre[0], state.value_sums[0][None], rtol=0, atol=0)
    res = backend.sketch_decode(qd, cache, ids, lp, state.sketches[0], scale, "tilted_hull", 0.05)
    first, rel1, route = res.output, res.radius, res.route.code
    # the forward's route: the centre from the compacted prompt's sums and the tail's values; the same step as
    # the op's own read of every kept value within one float32 ulp of the centre (a few 1e-7 relative)
    res = backend.sketch_decode(qd, cache, ids, lp, state.sketches[0], scale, "tilted_hull", 0.05, centre)
    given, rel0 = res.output, res.radius
    torch.testing.assert_close(given, first, rtol=0, atol=0)
    torch.testing.assert_close(rel0, rel1, rtol=1e-6, atol=0)
    # the step takes the forward's radii once per step (Step.add_statistics): the same numbers, bit for bit, as
    # sketch_decode's per call
    assert certs["a"] == float(rel0.double().mean())
    monkeypatch.setenv("KVCERT_CPU_OP", "0")
    res = backend.sketch_decode(qd, cache, ids, lp, state.sketches[0], scale, "tilted_hull", 0.05)
    other, rel2 = res.output, res.radius
    monkeypatch.delenv("KVCERT_CPU_OP")
    assert res.route == dispatch.GATHER and res.dense == dispatch.TORCH
    print(f"route {route}: max |paged - gather| = {(first - other).abs().max():.2e}")
    torch.testing.assert_close(first, other, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rel1, rel2, rtol=1e-4, atol=0)
    # the sketched estimator over the kept prompt tokens (pi) and the decode tokens (pi = 1), float64
    pi = torch.cat([torch.where(dec.keep, dec.pi, 0.0), torch.ones(H, T, dtype=torch.float64)], dim=1)
    ce = F.sketch_hajek_attention(qd.double(), k.transpose(0, 1)[None].double(), v.transpose(0, 1)[None].double(),
                                   pi[None], sketch.map(lambda t: t.double()), scale=scale, delta=0.05)
    print(f"max |sketched decode - float64 estimator| = {(out.double() - ce.output).abs().max():.2e}")
    torch.testing.assert_close(out.double(), ce.output, rtol=1e-5, atol=1e-6)
    radius = torch.minimum(3.0 * ce.variance.sqrt(), ce.bound)  # min(3 sqrt(V_cl), H)
    want = float((radius / torch.linalg.vector_norm(ce.output, dim=-1)).mean())
    print(f"certificate {certs['a']:.6g} vs float64 {want:.6g}")
    assert certs["a"] == pytest.approx(want, rel=1e-4) and certs["a"] > 0
    # negative control: the same compacted state read without its sketch records the plain design's certificate
    fake.kvcert_states["a"] = worker.Compacted(state.n_prompt, state.m, state.log_pi, None)
    step = worker.Step(fake)
    layer_forward(backend, impl, step, layer, qd, cache, md)
    assert step.plan(md, BS).compacted_centres(0) is None  # no sums held: the op would read the centre itself
    plain = step.results(BS).certs
    assert abs(plain["a"] / certs["a"] - 1) > 0.05


def test_a_group_of_sketched_rows_joins_its_sketches_once_while_the_group_stays_the_same():
    """``Step.group_sketch``: a lone row reads its own sketch; two rows read the join of their sketches (equal to
    ``ClusterSketch.cat``), built at the first step and read again at the next one (the same object, so its decode
    form is not rebuilt); a request whose state was replaced (preempted and prefilled again), a different order
    of the rows, or a finished request in the scheduler's output rebuilds it. Negative control: the join of the
    rows in the other order differs."""
    from kvcert.vllm import worker

    torch.manual_seed(3)

    def state():
        k, v = torch.randn(1, H, 40, D), torch.randn(1, H, 40, D)
        pi = torch.full((1, H, 40), 0.5, dtype=torch.float64)
        keep = torch.rand(1, H, 40) < 0.5
        sk = F.cluster_sketch(k, v, pi, keep, F.ClusterDesign(clusters=4))
        return worker.Compacted(n_prompt=40, m=1, log_pi=torch.zeros(1, H, BS), sketches=[sk])

    a, b = state(), state()
    fake = SimpleNamespace(kvcert=None, kvcert_joined={})
    rows = [worker._CompactedRow("a", 0, TABLE[0], torch.zeros(0), a),
            worker._CompactedRow("b", 1, TABLE[0], torch.zeros(0), b)]
    group = ("tilted_hull", 0.05, True)
    assert worker.Step(fake).group_sketch(0, group, rows[:1]) is a.sketches[0]
    first = worker.Step(fake).group_sketch(0, group, rows)
    want = F.ClusterSketch.cat([a.sketches[0], b.sketches[0]])
    for name in ("mean", "var", "count", "weight"):
        assert torch.equal(getattr(first, name), getattr(want, name))
    assert worker.Step(fake).group_sketch(0, group, rows) is first  # the next step: the same join
    swapped = worker.Step(fake).group_sketch(0, group, rows[::-1])
    assert swapped is not first and not torch.equal(swapped.mean, first.mean)  # the order counts
    rows[1] = worker._CompactedRow("b", 1, TABLE[0], torch.zeros(0), state())  # b's state replaced
    again = worker.Step(fake).group_sketch(0, group, rows)
    assert again is not first and torch.equal(again.mean[:1], first.mean[:1]) and not torch.equal(again.mean, first.mean)
    # the scheduler's output of the next step: nothing finished keeps the joins, a finished request drops them
    from dataclasses import replace

    from vllm.v1.core.sched.output import SchedulerOutput

    from kvcert.vllm.handoff import CertifiedSchedulerOutput, StepOrders

    fake.__dict__.update(kvcert_states={"a": a}, kvcert_prompt_len={}, kvcert_decided=set(), kvcert_request={})
    out = lambda finished: CertifiedSchedulerOutput.of(  # noqa: E731
        replace(SchedulerOutput.make_empty(), finished_req_ids=finished), StepOrders())
    worker._CertifiedWorker._kvcert_before(fake, out(set()))
    assert len(fake.kvcert_joined) == 1
    worker._CertifiedWorker._kvcert_before(fake, out({"b"}))
    assert fake.kvcert_joined == {}


def test_value_centres_are_handed_per_row_to_the_rows_that_hold_them():
    """``_Plan.compacted_centres``: a step may mix a sketched request (its state holds the compacted prompt's
    kept-value sums) with a paper-design one (no sketch, no sums). The sketched group gets its rows' sums and
    tail starts (m bs); a selection with a row that holds none gets None (that group's decode reads the centre
    from the slots), and so does the whole step when no row holds sums."""
    from kvcert.vllm import worker

    sums = torch.rand(3, H, D + 1, dtype=torch.float64)
    sketched = worker.Compacted(n_prompt=40, m=1, log_pi=torch.zeros(3, H, BS), value_sums=sums)
    plain = worker.Compacted(n_prompt=70, m=2, log_pi=torch.zeros(3, H, 2 * BS))
    rows = [worker._CompactedRow(r, j, TABLE[0, :3], torch.zeros(BS), st)
            for j, (r, st) in enumerate((("b", plain), ("a", sketched)))]
    plan = worker._Plan(compacted=rows, block_size=BS)
    assert plan.compacted_centres(1) is None                                   # row 0 holds no sums
    got, start = plan.compacted_centres(2, torch.tensor([1]))
    assert torch.equal(got, sums[2][None]) and start.tolist() == [BS]
    assert plan.compacted_centres(0, torch.tensor([0])) is None
    only_plain = worker._Plan(compacted=rows[:1], block_size=BS)
    assert only_plain.compacted_centres(0) is None


@pytest.mark.parametrize("design", [{"sketch": None}, {"sketch": "tilted", "kind": "tilted_hull"}],
                         ids=["paper", "default"])
def test_a_bfloat16_cache_decodes_as_its_float32_upcast_and_within_its_rounding_of_float64(monkeypatch, design):
    """bfloat16 models (the cache holds bfloat16 K and V): the compacted decode on both routes (the compiled
    op's paged route and gather + kvcert.dispatch) computes in float32 from the loaded values, so it equals the
    same decode on a float32 cache holding the same values, exactly: the trace bit for bit and the output that
    float32 output rounded to bfloat16 once; the certificate differs only through ||o_hat|| of that rounded
    output (each coordinate within bfloat16's unit roundoff 2^-8 relative, so the relative radius within
    2^-8 / (1 - 2^-8)). Against the float64 estimator on the same (bfloat16-rounded) inputs the output is within
    2^-8 of the head's largest entry plus the float32 rounding (8 eps32 sqrt(n + 1) times the values' scale).
    Negative control: the same decode on a cache whose values are rounded again (another bfloat16 value per
    slot) is outside that tolerance."""
    from vllm.v1.attention.backends import cpu_attn

    bf16 = torch.bfloat16
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=bf16)))
    backend, worker, impl, cache, k, v, cfg, fake, layer, scale = setup_backend(bf16, **design)
    qp = torch.randn(Q, H_Q, D).to(bf16)
    step = worker.Step(fake)
    layer_forward(backend, impl, step, layer, qp, cache, prefill_metadata(backend, impl, bf16))
    step.results(BS)
    state = fake.kvcert_states["a"]
    assert isinstance(state, worker.Compacted) and state.m < Q // BS  # compacted, blocks freed
    write_cache(cache, k[Q:], v[Q:], torch.arange(Q, Q + T))
    qd = torch.randn(1, H_Q, D).to(bf16)
    md = decode_metadata()
    plan = worker.Step(fake).plan(md, BS)
    ids, lp = plan.compacted_inputs(0)
    sketch = state.sketches[0] if state.sketches else None

    def decode(q, c):  # (output, radius, the route's code)
        if sketch is None:
            res = backend.token_decode(q, c, ids, lp, scale, "chebyshev", 0.05)
        else:
            res = backend.sketch_decode(q, c, ids, lp, sketch, scale, "tilted_hull", 0.05)
        return res.output, res.radius, res.route.code

    eps_out = 2.0 ** -8  # bfloat16's unit roundoff: half its relative spacing 2^-7 (torch.finfo(bfloat16).eps)
    for op in ("1", "0"):
        monkeypatch.setenv("KVCERT_CPU_OP", op)
        out, rel, route = decode(qd, cache)
        out32, rel32, _ = decode(qd.float(), cache.float())
        assert out.dtype == bf16 and out32.dtype == torch.float32, route
        assert torch.equal(out, out32.to(bf16)), route
        assert torch.all((rel.double() / rel32.double() - 1).abs() <= eps_out / (1 - eps_out)), route
    monkeypatch.delenv("KVCERT_CPU_OP")
    # against the float64 estimator on the same rounded inputs (the kept prompt tokens with their pi, the tail)
    keep = torch.isfinite(lp[0].reshape(H, -1))
    pi_kept = lp[0].reshape(H, -1).double().exp()
    gk, gv = backend.gather_rows(cache, ids)
    est = F.hajek_attention(qd.double(), gk.double(), gv.double(), torch.where(keep, pi_kept, 0.0)[None], scale=scale,
                            per_coordinate=False)
    n = int(keep.sum(-1).max())
    head = est.output.abs().amax(-1, keepdim=True)
    vmax = gv.double().abs().amax((-2, -1))[..., None, None].expand(1, H, H_Q // H, 1).reshape(1, H_Q, 1)
    tol = eps_out * head + 8 * torch.finfo(torch.float32).eps * math.sqrt(n + 1) * vmax
    if sketch is None:  # the token design's output is the Hajek estimate itself
        assert torch.all((out.double() - est.output).abs() <= tol), (out.double() - est.output).abs().max()
        wrong = decode(qd, (cache.float() * (1 + 2 ** -7)).to(bf16))[0]  # every slot one bfloat16 step off
        assert not torch.all((wrong.double() - est.output).abs() <= tol)
