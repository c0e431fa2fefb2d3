"""The plugin's CPU attention backend driven without an engine (not a test module): a scattered paged cache of a
150-token prompt written with vLLM's own cache op, the backend and a stand-in worker, and the metadata of a
prefill and a decode step (tests/vllm/test_vllm_compaction.py, test_vllm_target.py, test_vllm_handoff.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_support import step_metadata

H_Q, H, D, BS = 6, 2, 64, 32
Q, T = 150, 3  # prompt tokens (4 full blocks + 22), decode tokens after it
TABLE = torch.tensor([[4, 0, 5, 2, 1, 7]])  # logical block j -> physical block; block 7 is never written


def write_cache(cache, keys, values, positions):
    from vllm import _custom_ops as ops

    key_cache, value_cache = cache.view(cache.shape[0], H, 2 * BS, D).chunk(2, dim=2)
    slots = TABLE[0][positions // BS] * BS + positions % BS
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def setup_backend(dtype=torch.float32, **design):
    from kvcert.vllm import KVCertConfig, backend, worker

    torch.manual_seed(0)
    scale = D ** -0.5
    impl = backend.CertifiedCPUAttentionImpl(num_heads=H_Q, head_size=D, scale=scale, num_kv_heads=H,
                                             alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    cache = torch.zeros(9, H, BS, 2 * D, dtype=dtype)
    k, v = torch.randn(Q + T, H, D).to(dtype), torch.randn(Q + T, H, D).to(dtype)
    write_cache(cache, k[:Q], v[:Q], torch.arange(Q))
    cfg = KVCertConfig(compression_ratio=0.6, seed=5, observation_window=8, **design)
    fake = SimpleNamespace(kvcert=cfg, kvcert_states={}, kvcert_decided=set(), kvcert_prompt_len={"a": Q}, kvcert_head_size=D,
                           model_runner=SimpleNamespace(input_batch=SimpleNamespace(req_ids=["a"])))
    layer = SimpleNamespace(isa="vec", _k_scale_float=1.0, _v_scale_float=1.0, layer_name="model.layers.0.self_attn.attn")
    return backend, worker, impl, cache, k, v, cfg, fake, layer, scale


def prefill_metadata(backend, impl, dtype=torch.float32):
    """The attention metadata of the Q-token prompt's one prefill step (the stock op's work partition)."""
    qsl, seq = torch.tensor([0, Q], dtype=torch.int32), torch.tensor([Q], dtype=torch.int32)
    return SimpleNamespace(query_start_loc=qsl, seq_lens=seq, block_table=TABLE.to(torch.int32), causal=True,
                           dynamic_causal=None, num_actual_tokens=Q,
                           scheduler_metadata=backend.stock_scheduler_metadata(impl, seq, qsl, True, "vec", dtype))


def decode_metadata():
    """The attention metadata of one decode token after the prompt and the T tokens written after it."""
    return SimpleNamespace(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                           seq_lens=torch.tensor([Q + T], dtype=torch.int32), block_table=TABLE.to(torch.int32),
                           causal=True, dynamic_causal=None)


def layer_forward(backend, impl, step, layer, query, cache, md):
    """One layer's forward in a step of the plugin's worker: ``md`` carries ``step`` as the plugin's builder
    puts it there."""
    return impl.forward(layer, query, None, None, cache, step_metadata(md, step), torch.empty_like(query))
