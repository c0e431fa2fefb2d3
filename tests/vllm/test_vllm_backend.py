"""Unit checks of the plugin without an engine: the cache layout it reads, registration, import hygiene."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from vllm_support import ROOT, step_metadata, vllm_env


def test_gather_blocks_reads_what_the_cpu_cache_op_wrote():
    from vllm import _custom_ops as ops

    from kvcert.vllm.backend import gather_blocks

    torch.manual_seed(0)
    nb, h, bs, d = 5, 3, 32, 64
    cache = torch.zeros(nb, h, bs, 2 * d)
    key_cache, value_cache = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    n = 70  # a sequence over blocks 3, 0, 4 (the last one partial)
    table = torch.tensor([3, 0, 4])
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    k, v = torch.randn(n, h, d), torch.randn(n, h, d)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    gk, gv = gather_blocks(cache, table)
    assert gk.shape == (h, 3 * bs, d)
    torch.testing.assert_close(gk[:, :n], k.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(gv[:, :n], v.transpose(0, 1), rtol=0, atol=0)
    # a subset of blocks, out of order: block 2 of the sequence then block 0
    gk, gv = gather_blocks(cache, table[[2, 0]])
    torch.testing.assert_close(gk[:, bs:], k[:bs].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(gv[:, : n - 2 * bs], v[2 * bs:].transpose(0, 1), rtol=0, atol=0)


def test_register_is_idempotent_and_overrides_cpu_attn():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import kvcert.vllm as kv

    kv.register()
    kv.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "kvcert.vllm.backend.CertifiedCPUAttentionBackend"


def test_prompt_event_is_a_function_of_the_prompt():
    from kvcert.vllm.scheduler import prompt_event

    a = prompt_event([1, 2, 3])
    assert a == prompt_event((1, 2, 3)) and 0 <= a < 2 ** 63
    assert a != prompt_event([1, 2, 4]) and a != prompt_event([1, 2])


def test_plugin_imports_no_hugging_face_module_of_kvcert():
    code = ("import sys, kvcert.vllm, kvcert.vllm.scheduler, kvcert.vllm.worker, kvcert.vllm.backend\n"
            "bad = [m for m in sys.modules if m.startswith(('kvcert.models', 'kvcert.presses', 'kvcert.generation',"
            " 'kvcert.attention', 'kvcert.cache', 'kvcert.records', 'kvcert.cli', 'kvcert.reference',"
            " 'paper_repro'))]\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvcert')))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=vllm_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kvcert.fast" in proc.stdout


@pytest.mark.parametrize("event", [0, 12345])
def test_block_stream_is_the_fast_one(event):
    # the scheduler's draw is kvcert.fast.block_sample on the seeded stream: pinned to the block uniforms
    from kvcert.fast import block_sample, block_uniforms

    pi = torch.tensor([1.0, 0.3, 0.6, 0.2, 1.0], dtype=torch.float64)
    u = block_uniforms((5,), 11, event=event)
    assert torch.equal(block_sample(pi, seed=11, event=event), u < pi)


def test_masked_forward_matches_the_block_estimator_on_a_compact_cache(monkeypatch):
    """One step with a stock prefill row and a masked decode row, against independent constructions.

    Row "b" (prefill, no eviction) must equal causal attention; row "a" (decode
    with evicted blocks) must equal kvcert.fast.block_hajek_attention over the
    cache compacted by kvcert.fast.block_compact from the original keys/values;
    the certificate the step records is that estimate's mean relative radius.
    """
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    from kvcert.fast import (block_compact, block_hajek_attention, certificate_moments, radius_from_statistics,
                             snapkv_scores)
    from kvcert.vllm import KVCertConfig, backend, worker

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    torch.manual_seed(1)
    h_q, h, d, bs = 6, 2, 64, 32
    scale = d ** -0.5
    impl = backend.CertifiedCPUAttentionImpl(num_heads=h_q, head_size=d, scale=scale, num_kv_heads=h,
                                             alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    nb = 12
    cache = torch.zeros(nb, h, bs, 2 * d)
    key_cache, value_cache = cache.view(nb, h, 2 * bs, d).chunk(2, dim=2)
    # request "a": 5-block prompt of 150 tokens + 1 decode token (seq 151); request "b": 40-token prompt
    S, Q = 151, 40
    ka, va = torch.randn(S, h, d), torch.randn(S, h, d)
    kb, vb = torch.randn(Q, h, d), torch.randn(Q, h, d)
    table = torch.tensor([[2, 11, 0, 0, 0], [7, 1, 9, 3, 5]])  # row 0 = "b" (2 blocks), row 1 = "a" (5)
    for keys, vals, row, n in ((kb, vb, 0, Q), (ka, va, 1, S)):
        slots = table[row][torch.arange(n) // bs] * bs + torch.arange(n) % bs
        ops.cpu_attn_reshape_and_cache(keys, vals, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")
    pi_blocks = torch.tensor([1.0, 0.4, 0.7, 0.3, 1.0], dtype=torch.float64)
    keep = torch.tensor([True, False, True, True, True])
    log_pi = torch.where(keep, pi_blocks.log(), torch.tensor(float("-inf"), dtype=torch.float64))
    # "b" (2 blocks) is long enough to be evicted only with a small certainty set and ratio: budget 1.5 > 1
    cfg = KVCertConfig(compression_ratio=0.25, granularity="block", sink_blocks=0, recent_blocks=1, observation_window=8)
    fake = SimpleNamespace(kvcert=cfg, kvcert_states={"a": log_pi}, kvcert_decided=set(), kvcert_prompt_len={"a": 150, "b": Q},
                           model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["b", "a"])))
    qb, qa = torch.randn(Q, h_q, d), torch.randn(1, h_q, d)
    query = torch.cat([qb, qa])
    md = SimpleNamespace(query_start_loc=torch.tensor([0, Q, Q + 1], dtype=torch.int32),
                         seq_lens=torch.tensor([Q, S], dtype=torch.int32), block_table=table.to(torch.int32),
                         causal=True, dynamic_causal=None)
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0)
    step = worker.Step(fake)
    out = impl.forward(layer, query, None, None, cache, step_metadata(md, step), torch.empty_like(query))
    # row "b": causal attention over its own prompt
    ref_b = torch.nn.functional.scaled_dot_product_attention(
        qb.transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], is_causal=True,
        enable_gqa=True, scale=scale)[0].transpose(0, 1)
    torch.testing.assert_close(out[:Q], ref_b, rtol=1e-4, atol=1e-5)
    # row "a": the block estimator over the compacted cache (the decode token's block 4 is certain)
    cc = block_compact(keep[None], pi_blocks[None].float(), ka.transpose(0, 1)[None], va.transpose(0, 1)[None],
                       block_size=bs)
    est = block_hajek_attention(qa, cc.keys, cc.values, cc.pi, block_size=bs, positions=cc.positions, scale=scale,
                                per_coordinate=False)
    torch.testing.assert_close(out[Q:], est.output, rtol=1e-5, atol=1e-6)
    _, _, rel = radius_from_statistics("chebyshev", 0.05, **certificate_moments(est, "chebyshev"))
    report = step.results(bs)
    certs, imp = report.certs, report.importance
    assert certs["a"] == pytest.approx(float(rel.double().mean()), rel=1e-5)
    assert certs["a"] > 0
    # the importance of the prompt that finished in this step: SnapKV of its last 8 queries, per KV head
    u = snapkv_scores(qb[-8:].permute(1, 0, 2)[None], kb.transpose(0, 1)[None], scale=scale, kernel_size=1)
    torch.testing.assert_close(step.importance["b"][0].float(), u[0], rtol=1e-5, atol=1e-7)
    assert len(imp["b"]) == 2 and "a" not in imp
    # with the default design the 2-block prompt cannot be evicted: its importance is not even computed
    fake.kvcert = KVCertConfig(compression_ratio=0.5, granularity="block")
    step = worker.Step(fake)
    impl.forward(layer, query, None, None, cache, step_metadata(md, step), torch.empty_like(query))
    assert step.importance == {} and set(step.results(bs).certs) == {"a"}


def test_masked_decode_is_the_block_estimator_and_batch_invariant(monkeypatch):
    """The batched fast path = kvcert.fast.block_hajek_attention per row; a row's result does not depend on its
    batch or on how the rows are chunked for the gather."""
    from kvcert.fast import block_hajek_attention
    from kvcert.fast import blocks as fast_blocks
    from kvcert.vllm.backend import block_decode as route_block_decode
    from kvcert.vllm.backend import gather_blocks

    def block_decode(q, cache, ids, log_pi, scale, chunks=None):  # the router's block route: (output, trace)
        dec = route_block_decode(q, cache, ids, log_pi, scale, "chebyshev", 0.05, chunks=chunks)
        assert dec.route.code == "paged_torch", dec.route
        return dec.output, dec.statistics["trace"]

    torch.manual_seed(2)
    h_q, h, d, bs, nb = 9, 3, 64, 32, 40
    cache = torch.randn(nb, h, bs, 2 * d)
    flat = cache.view(nb, h, 2 * bs * d)  # vec layout: keys transposed (d, bs), then values (bs, d)
    flat[7, :, : bs * d].view(h, d, bs)[:, :, 1:] = 1e4  # block 7: only slot 0 is the row's; the rest is an
    flat[7, :, bs * d:].view(h, bs, d)[:, 1:] = -1e4  # earlier owner's data (finite: zero-allocated cache)
    rows = [  # (kept physical blocks, pi_b per kept block, valid tokens in the last block)
        (torch.tensor([3, 9, 12, 7]), torch.tensor([1.0, 0.3, 0.55, 1.0]), 1),
        (torch.tensor([20, 5, 6, 30, 31, 1]), torch.tensor([1.0, 0.8, 0.2, 0.4, 1.0, 1.0]), 17),
        (torch.tensor([2, 4]), torch.tensor([1.0, 1.0]), 5),
    ]
    q = torch.randn(len(rows), h_q, d)
    M = max(len(r[0]) for r in rows)
    ids = torch.zeros(len(rows), M, dtype=torch.int64)
    log_pi = torch.full((len(rows), M, bs), float("-inf"))
    for j, (blocks, pib, last) in enumerate(rows):
        ids[j, : len(blocks)] = blocks
        lp = pib.log()[:, None].expand(len(blocks), bs).clone()
        lp[-1, last:] = float("-inf")
        log_pi[j, : len(blocks)] = lp
    out, trace = block_decode(q, cache, ids, log_pi, 0.125)
    assert torch.isfinite(out).all() and torch.isfinite(trace).all()
    for j, (blocks, pib, last) in enumerate(rows):
        k, v = gather_blocks(cache, blocks)
        n = len(blocks) * bs - (bs - last)
        pos = torch.arange(n)
        pi = pib.repeat_interleave(bs)[:n]
        shape = (1, h, n)
        est = block_hajek_attention(q[j : j + 1], k[None, :, :n], v[None, :, :n], pi.expand(shape), block_size=bs,
                                    positions=pos.expand(shape), scale=0.125, per_coordinate=False)
        torch.testing.assert_close(out[j], est.output[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(trace[j], est.trace[0], rtol=1e-4, atol=1e-9)
        alone, tr_alone = block_decode(q[j : j + 1], cache, ids[j : j + 1, : len(blocks)],
                                        log_pi[j : j + 1, : len(blocks)], 0.125)
        assert torch.equal(alone[0], out[j]) and torch.equal(tr_alone[0], trace[j]), f"row {j} depends on its batch"
    assert (trace[2] == 0).all() and (trace[:2] > 0).all()  # all-certain row: zero variance
    # chunked gathers (one row per chunk; rows 0-1 together, then row 2) give the same rows bit for bit
    one_block = cache[0].numel() * cache.element_size()
    for cap, spans in ((1, [(0, 1), (1, 2), (2, 3)]), (2 * M * one_block, [(0, 2), (2, 3)])):
        monkeypatch.setattr(fast_blocks, "GATHER_BYTES", cap)
        chunks = fast_blocks.block_chunks(cache, ids, log_pi)
        assert [(c.rows.start, c.rows.stop) for c in chunks] == spans
        o_c, t_c = block_decode(q, cache, ids, log_pi, 0.125)
        assert torch.equal(o_c, out) and torch.equal(t_c, trace), f"chunk cap {cap} changed a row"
        # the chunks are computed once per step and reused by every layer: another cache of the same geometry
        other = torch.randn_like(cache)
        o_r, t_r = block_decode(q, other, ids, log_pi, 0.125, chunks)
        o_f, t_f = block_decode(q, other, ids, log_pi, 0.125)
        assert torch.equal(o_r, o_f) and torch.equal(t_r, t_f)
        assert not torch.equal(o_r, out)


def test_step_sums_certificates_over_layers_per_request():
    """add_certificates keeps each layer's (rows, query heads) radii; results() gives each request the mean over
    its layers of the mean over query heads, whatever rows the layers certified together."""
    from types import SimpleNamespace

    from kvcert.vllm import KVCertConfig, worker

    step = worker.Step(SimpleNamespace(kvcert=KVCertConfig(compression_ratio=0.5, granularity="block")))
    rel = [torch.tensor([[0.1, 0.3], [1.0, 2.0]]), torch.tensor([[0.5, 0.5], [3.0, 5.0]])]
    for r in rel:
        step.add_certificates(["a", "b"], r)
    step.add_certificates(["c"], torch.tensor([[0.25, 0.75]]))
    step.add_certificates(["b"], torch.tensor([[8.0, 10.0]]))
    report = step.results(16)
    certs = report.certs
    assert certs == pytest.approx({"a": (0.2 + 0.5) / 2, "b": (1.5 + 4.0 + 9.0) / 3, "c": 0.5}, rel=1e-6)  # float32 radii
    assert report.importance == {}
    assert step.results(16).certs == certs  # summing twice adds nothing


def test_step_takes_the_radii_of_its_statistics_once_per_step():
    """add_statistics keeps each layer's certificate statistics; results() gives the relative radii of
    radius_from_statistics per layer (bit for bit: one call over the stacked layers is the same elementwise map),
    beside rows given as radii, whatever the order of the calls."""
    from types import SimpleNamespace

    from kvcert.fast import radius_from_statistics
    from kvcert.vllm import KVCertConfig, worker

    gen = torch.Generator().manual_seed(0)
    step = worker.Step(SimpleNamespace(kvcert=KVCertConfig(compression_ratio=0.5)))
    layers = [{"trace": torch.rand(2, 9, generator=gen), "output_norm": torch.rand(2, 9, generator=gen) + 0.1}
              for _ in range(3)]
    hull = [{"trace": torch.rand(1, 9, generator=gen), "output_norm": torch.rand(1, 9, generator=gen) + 0.1,
             "bound": torch.rand(1, 9, generator=gen)} for _ in range(2)]
    layers[1]["trace"][0, 0] = 0.0  # a zero radius
    layers[2]["output_norm"][1, 3] = 0.0  # a zero output: an infinite relative radius
    for j, stats in enumerate(layers):
        step.add_statistics(["a", "b"], "chebyshev", 0.05, stats)
        step.add_certificates(["c"], torch.tensor([[0.25 * (j + 1), 0.75]]))
        if j < 2:
            step.add_statistics(["d"], "tilted_hull", 0.1, hull[j])
    certs = step.results(16).certs
    rel = [radius_from_statistics("chebyshev", 0.05, **s)[2].double().mean(-1) for s in layers]
    rel_d = [radius_from_statistics("tilted_hull", 0.1, **s)[2].double().mean(-1) for s in hull]
    assert certs["a"] == sum(float(r[0]) for r in rel) / 3
    assert math.isinf(certs["b"]) and all(math.isfinite(float(r[1])) for r in rel[:2])
    assert certs["d"] == sum(float(r[0]) for r in rel_d) / 2
    assert certs["c"] == pytest.approx(((0.25 + 0.5 + 0.75) / 3 + 0.75) / 2)
    # negative control: the hull bound is read (without it the tilted radius is 3 sqrt(V) throughout)
    uncapped = [radius_from_statistics("tilted_hull", 0.1, trace=s["trace"], output_norm=s["output_norm"])[2]
                for s in hull]
    assert certs["d"] != pytest.approx(sum(float(r.double().mean()) for r in uncapped) / 2)


@pytest.mark.parametrize("scorer", ["snapkv", "tova", "h2o", "knorm", "lagkv", "random"])
def test_prompt_importance_is_the_configured_registry_scorer(monkeypatch, scorer):
    """The backend scores a finishing prompt with ``KVCertConfig.scorer`` (``kvcert.fast.SCORERS``): the
    queries the scorer reads (the last observation_window, all of a one-chunk prompt, or none), the keys and
    values gathered from the paged cache, the layer index from the layer's name (the random scorer's stream)."""
    from types import SimpleNamespace

    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends import cpu_attn

    from kvcert import fast as F
    from kvcert.vllm import KVCertConfig, backend, worker

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    torch.manual_seed(2)
    h_q, h, d, bs, Q = 6, 2, 64, 32, 150
    scale = d ** -0.5
    impl = backend.CertifiedCPUAttentionImpl(num_heads=h_q, head_size=d, scale=scale, num_kv_heads=h,
                                             alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    cache = torch.zeros(6, h, bs, 2 * d)
    key_cache, value_cache = cache.view(6, h, 2 * bs, d).chunk(2, dim=2)
    table = torch.tensor([[4, 0, 5, 2, 1]])
    k, v = torch.randn(Q, h, d), torch.randn(Q, h, d)
    slots = table[0][torch.arange(Q) // bs] * bs + torch.arange(Q) % bs
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    cfg = KVCertConfig(compression_ratio=0.5, granularity="block", observation_window=8, scorer=scorer)
    fake = SimpleNamespace(kvcert=cfg, kvcert_states={}, kvcert_decided=set(), kvcert_prompt_len={"b": Q},
                           model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["b"])))
    md = SimpleNamespace(query_start_loc=torch.tensor([0, Q], dtype=torch.int32),
                         seq_lens=torch.tensor([Q], dtype=torch.int32), block_table=table.to(torch.int32))
    step = worker.Step(fake)
    plan = step.plan(md, bs)
    assert [row.req_id for row in plan.importance] == ["b"] and not plan.masked
    query = torch.randn(Q, h_q, d)
    impl._importance(step, plan, SimpleNamespace(layer_name="model.layers.5.self_attn.attn"), query, cache, None)
    spec = F.SCORERS[scorer]
    w = Q if spec.queries == "all" else 8  # a one-chunk prompt gives an all-query scorer every query
    params = {p: value for p, value in (("kernel_size", 1), ("seed", 0)) if p in spec.params}
    expected = spec(query[-w:].permute(1, 0, 2)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    scale=scale, layer=5, event=0, **params)
    # the same function on the same float32 values, gathered in another memory layout (the first test's tolerance)
    got = step.importance["b"][0].to(expected.dtype)
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-7)
    report = step.results(bs)
    imp = report.importance
    assert report.compacted == {}  # the block design compacts nothing
    ub = F.block_importance(F.nonnegative_importance(step.importance["b"][0][None].double()), bs)
    assert imp["b"] == ub[0].tolist() and len(imp["b"]) == 5
