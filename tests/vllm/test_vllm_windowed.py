"""Models with sliding-window layers and a logit softcap (Gemma 2 and 3) in the plugin's CPU backend, no engine.

Two layers of one request, as a Gemma model has them: layer 0 attends with a sliding window of W tokens,
layer 1 in full; both softcap their logits (Gemma 2's ``attn_logit_softcapping``). A 150-token prompt is written
with vLLM's own cache op, the backend's prefill forward compacts both layers (layer 1: the token design, the
paper's; layer 0: its last W prompt tokens, :func:`kvcert.vllm.backend.window_slots`), "another request"
overwrites the freed blocks, and decode tokens are written after the prompt. Then:

- the window layer's decode equals **vLLM's own kernel** (``cpu_attention_with_kv_cache`` with the same window and
  softcap) on the cache as it was without compaction, at a step where every kept prompt token is in the window
  and at one where most have left it (float32 against float32: rtol 1e-5 / atol 1e-6; the kernels sum in
  different orders);
- the full layer's decode equals the Hajek estimator with the softcapped scores
  :math:`c\\tanh(\\tau q\\cdot k/c) - \\log\\pi` in float64 (rtol 1e-5 / atol 1e-6, as tests/vllm/test_vllm_compaction.py);
- the step's certificate is the full layer's alone (a window layer samples nothing).

Negative controls: the window layer without its window mask, and the full layer without its softcap, are
visibly different (> 1e-2).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvcert.fast as F
from backend_support import BS, D, H, H_Q, Q, TABLE, write_cache
from vllm_support import step_metadata

W = 40  # the window: 2 blocks of the compacted prompt (positions 110..149)
CAP = 2.0  # the softcap: small enough that tanh bends the scores (|scale q.k| reaches 3-4 here)
T_MAX = 30  # decode tokens written after the prompt


def _impl(window, cap):
    from kvcert.vllm import backend

    return backend.CertifiedCPUAttentionImpl(num_heads=H_Q, head_size=D, scale=D ** -0.5, num_kv_heads=H,
                                             alibi_slopes=None, sliding_window=window, kv_cache_dtype="auto",
                                             logits_soft_cap=cap)


def _stock(impl, query, cache, seq_len, window, cap):
    """vLLM's kernel on one decode query at position seq_len - 1 (its own window and softcap)."""
    from vllm import _custom_ops as ops

    qsl, seq = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32)
    sched = _sched(seq, qsl, window)
    key_cache, value_cache = cache.view(cache.shape[0], H, 2 * BS, D).chunk(2, dim=2)
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl, seq_lens=seq,
        scale=impl.scale, causal=True, alibi_slopes=None, sliding_window=window, block_table=TABLE.to(torch.int32),
        softcap=cap, scheduler_metadata=sched, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
        kv_cache_dtype="auto")
    return out


@pytest.fixture
def two_layers(monkeypatch):
    """The request after its prefill step (both layers compacted) and T_MAX decode tokens written."""
    from vllm.v1.attention.backends import cpu_attn

    from kvcert.vllm import KVCertConfig, backend, worker
    from kvcert.vllm.handoff import compaction_layout

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    torch.manual_seed(0)
    impls = {0: _impl(W, CAP), 1: _impl(None, CAP)}
    layers = {i: SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0,
                                 layer_name=f"model.layers.{i}.self_attn.attn") for i in impls}
    caches = {i: torch.zeros(9, H, BS, 2 * D) for i in impls}
    kv = {i: (torch.randn(Q + T_MAX, H, D) * 2, torch.randn(Q + T_MAX, H, D)) for i in impls}
    for i in impls:
        write_cache(caches[i], kv[i][0][:Q], kv[i][1][:Q], torch.arange(Q))
    originals = {i: caches[i].clone() for i in impls}
    cfg = KVCertConfig(compression_ratio=0.6, seed=5, observation_window=8, sketch=None)  # the paper's design
    fake = SimpleNamespace(kvcert=cfg, kvcert_states={}, kvcert_decided=set(), kvcert_prompt_len={"a": Q},
                           kvcert_head_size=D, model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a"])))
    qsl, seq = torch.tensor([0, Q], dtype=torch.int32), torch.tensor([Q], dtype=torch.int32)
    qp = torch.randn(Q, H_Q, D)
    step = worker.Step(fake)
    for i in impls:
        md = SimpleNamespace(query_start_loc=qsl, seq_lens=seq, block_table=TABLE.to(torch.int32), causal=True,
                             dynamic_causal=None, num_actual_tokens=Q,
                             scheduler_metadata=_sched(seq, qsl, -1 if i == 1 else W))
        impls[i].forward(layers[i], qp, None, None, caches[i], step_metadata(md, step), torch.empty_like(qp))
    report = step.results(BS).compacted["a"]
    state = fake.kvcert_states["a"]
    for i in impls:  # another request gets the freed blocks; then the decode tokens are written
        used, intact = compaction_layout(Q // BS, 0, state.m)  # the blocks the scheduler frees, no cached prefix
        freed = TABLE[0, used:intact]
        caches[i][freed] = 1e4 * torch.randn_like(caches[i][freed])
        for c in (caches[i], originals[i]):
            write_cache(c, kv[i][0][Q:], kv[i][1][Q:], torch.arange(Q, Q + T_MAX))
    return SimpleNamespace(backend=backend, worker=worker, impls=impls, layers=layers, caches=caches,
                           originals=originals, kv=kv, cfg=cfg, fake=fake, state=state, report=report, qp=qp)


def _sched(seq, qsl, window):
    """The stock kernel's work partition for one request (lengths ``seq``, query starts ``qsl``) and a window."""
    from vllm import _custom_ops as ops
    from vllm import envs

    return ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=H_Q, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=torch.float32,
        query_start_loc=qsl, causal=True, sliding_window_size=window, isa="vec",
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto")


def _decode(s, seq_len):
    """Both layers' decode forward of one query at position seq_len - 1; (outputs by layer, step certificates)."""
    qd = torch.randn(1, H_Q, D, generator=torch.Generator().manual_seed(seq_len))
    md = SimpleNamespace(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                         seq_lens=torch.tensor([seq_len], dtype=torch.int32), block_table=TABLE.to(torch.int32),
                         causal=True, dynamic_causal=None)
    step = s.worker.Step(s.fake)
    outs = {i: s.impls[i].forward(s.layers[i], qd, None, None, s.caches[i], step_metadata(md, step),
                                  torch.empty_like(qd)) for i in s.impls}
    return qd, outs, step


def test_the_window_layer_keeps_its_last_w_prompt_tokens_and_frees_the_rest(two_layers):
    s = two_layers
    counts = s.report["counts"]
    assert counts[0] == [W] * H  # the window layer: its last W prompt tokens, every KV head
    assert all(0 < c < Q for c in counts[1])  # the full layer: its sample
    assert s.state.m == -(-max(W, max(counts[1])) // BS) and s.state.m < Q // BS  # blocks are freed
    assert s.state.sketches is None
    from kvcert.vllm.backend import gather_blocks

    gk, gv = gather_blocks(s.caches[0], s.state.block_ids)
    k, v = s.kv[0]
    torch.testing.assert_close(gk[:, :W], k[Q - W : Q].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(gv[:, :W], v[Q - W : Q].transpose(0, 1), rtol=0, atol=0)


@pytest.mark.parametrize("t", [1, T_MAX])
def test_the_window_layer_decodes_as_vllms_windowed_kernel(two_layers, t):
    s = two_layers
    seq_len = Q + t
    qd, outs, step = _decode(s, seq_len)
    ref = _stock(s.impls[0], qd, s.originals[0], seq_len, W, CAP)
    gap = (outs[0] - ref).abs().max()
    print(f"t={t}: max |window layer - vLLM's windowed kernel| = {gap:.2e}")
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-6)
    # negative control: the same slots without the window mask attend to tokens that left the window
    plan = step.plan(step_metadata(SimpleNamespace(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=TABLE.to(torch.int32), causal=True, dynamic_causal=None), step), BS)
    ids, lp = plan.compacted_inputs(0)
    ids_w, lp_w = plan.compacted_inputs(0, W)
    visible = int(torch.isfinite(lp_w[0, 0]).sum())
    assert visible == min(W, seq_len)  # the query's window: W positions (its own included)
    if t == T_MAX:  # most compacted prompt tokens have left the window
        loose = s.backend.token_decode(qd, s.caches[0], ids, lp, s.impls[0].scale, "chebyshev", 0.05,
                                       softcap=CAP).output
        assert (loose - ref).abs().max() > 1e-2


@pytest.mark.parametrize("t", [1, T_MAX])
def test_the_full_layer_decodes_the_softcapped_hajek_estimate_and_alone_makes_the_certificate(two_layers, t):
    s = two_layers
    seq_len = Q + t
    qd, outs, step = _decode(s, seq_len)
    certs = step.results(BS).certs
    # the full layer's sample, from its compacted positions and log pi
    lp_full = s.state.log_pi[1]  # (h, m bs)
    k, v = s.kv[1]
    counts = s.report["counts"][1]
    pi = torch.zeros(H, seq_len, dtype=torch.float64)
    ids_positions = s.report.get("kept_positions")
    assert ids_positions is None  # report_kept off: positions read from the cache below
    from kvcert.vllm.backend import gather_blocks

    gk, _ = gather_blocks(s.caches[1], s.state.block_ids)
    for h in range(H):
        c = counts[h]
        # each kept slot holds one prompt token: find its position by its key (keys are distinct random rows)
        match = (gk[h, :c, None, :] == k[:Q, h][None]).all(-1)
        assert bool((match.sum(-1) == 1).all())
        pos = match.float().argmax(-1)
        pi[h, pos] = lp_full[h, :c].double().exp()
    pi[:, Q:seq_len] = 1.0
    kk, vv = k[:seq_len].transpose(0, 1)[None].double(), v[:seq_len].transpose(0, 1)[None].double()
    s_ = torch.einsum("bhgd,bhnd->bhgn", qd.double().reshape(1, H, H_Q // H, D), kk) * s.impls[1].scale
    bias = (CAP * torch.tanh(s_ / CAP) - s_).reshape(1, H_Q, seq_len)
    est = F.hajek_attention(qd.double(), kk, vv, pi[None], scale=s.impls[1].scale, per_coordinate=False, bias=bias)
    gap = (outs[1].double() - est.output).abs().max()
    print(f"t={t}: max |full layer - float64 softcapped estimator| = {gap:.2e}")
    torch.testing.assert_close(outs[1].double(), est.output, rtol=1e-5, atol=1e-6)
    _, _, rel = F.radius_from_statistics("chebyshev", 0.05, **F.certificate_moments(est, "chebyshev"))
    assert certs["a"] == pytest.approx(float(rel.mean()), rel=1e-5) and certs["a"] > 0
    # negative control: without the softcap the estimate is another one
    plain = F.hajek_attention(qd.double(), kk, vv, pi[None], scale=s.impls[1].scale, per_coordinate=False)
    assert (plain.output - est.output).abs().max() > 1e-2


def test_the_softcapped_decode_is_the_same_on_the_ops_route_and_the_gather_route(two_layers, monkeypatch):
    """``token_decode(..., softcap=c)``: the compiled op's paged route (the cap taken in its pass) where it builds,
    and the gather route (the cap as a score bias) with ``KVCERT_CPU_OP=0``, agree to float32 rounding (the
    estimator's tolerance above) on both layers, output and relative radius."""
    from kvcert import dispatch

    s = two_layers
    seq_len = Q + T_MAX
    qd, _, step = _decode(s, seq_len)
    plan = step.plan(step_metadata(SimpleNamespace(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32), seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_table=TABLE.to(torch.int32), causal=True, dynamic_causal=None), step), BS)
    for layer, window in ((0, W), (1, None)):
        ids, lp = plan.compacted_inputs(layer, window)
        first = s.backend.token_decode(qd, s.caches[layer], ids, lp, s.impls[layer].scale, "chebyshev", 0.05,
                                       softcap=CAP)
        assert first.route == (dispatch.PAGED_CPU_OP if dispatch.cpu_op_available() else dispatch.GATHER)
        monkeypatch.setenv("KVCERT_CPU_OP", "0")
        other = s.backend.token_decode(qd, s.caches[layer], ids, lp, s.impls[layer].scale, "chebyshev", 0.05,
                                       softcap=CAP)
        monkeypatch.delenv("KVCERT_CPU_OP")
        assert other.route == dispatch.GATHER
        print(f"layer {layer}: route {first.route.code}: max |op - gather| = "
              f"{(first.output - other.output).abs().max():.2e}")
        torch.testing.assert_close(first.output, other.output, rtol=1e-5, atol=1e-6)
        if window is None:  # a window layer's radius is 0 on both (pi = 1)
            torch.testing.assert_close(first.radius, other.radius, rtol=1e-4, atol=0)


def test_window_slots_layout():
    from kvcert.vllm.backend import window_slots

    lay = window_slots(2, 150, 40, BS)
    assert lay.positions.shape == (2, 64) and lay.counts.tolist() == [40, 40]
    assert lay.positions[0, :40].tolist() == list(range(110, 150)) and (lay.positions[:, 40:] == -1).all()
    assert torch.equal(lay.log_pi[:, :40], torch.zeros(2, 40, dtype=lay.log_pi.dtype))
    short = window_slots(1, 20, 40, BS)  # a prompt shorter than the window: every token
    assert short.counts.tolist() == [20] and short.positions[0, :20].tolist() == list(range(20))


def test_paged_decode_refuses_a_softcap_outside_the_token_design():
    from kvcert import dispatch

    q, cache = torch.randn(1, H_Q, D), torch.zeros(2, H, BS, 2 * D)
    ids, lp = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, H, BS)
    with pytest.raises(ValueError, match="softcap.*token design only"):
        dispatch.paged_decode("sketch", q, cache, ids, lp, scale=0.1, kind="chebyshev", softcap=2.0)
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        dispatch.paged_decode("token", q, cache, ids, lp, scale=0.1, kind="chebyshev", softcap=-1.0,
                              gather=lambda c, b: (None, None))
