"""kvcert: randomized KV-cache eviction with statistical error certificates.

Poisson sampling with known inclusion probabilities, the Hajek-corrected
softmax (logit offset -log pi) and a survey-sampling variance estimate
computed from the retained tokens alone (arXiv 2607.21475).

Backends: ``kvcert.reference`` (NumPy float64 oracle), ``kvcert.fast``
(batched PyTorch), ``kvcert.kernels`` (Triton). The names below are resolved
lazily, so ``import kvcert`` stays cheap and does not import torch or
transformers until they are used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    # backend dispatch (Triton on CUDA, kvcert.fast otherwise)
    "hajek_attention": "kvcert.dispatch",
    "last_backend": "kvcert.dispatch",  # deprecated: the result's ``backend`` field (Estimate.backend)
    "select_backend": "kvcert.dispatch",
    "BackendUnavailableError": "kvcert.dispatch",
    # batched torch building blocks
    "certificate": "kvcert.fast",
    "evict": "kvcert.fast",
    "inclusion_probabilities": "kvcert.fast",
    "poisson_sample": "kvcert.fast",
    # Hugging Face integration
    "load_model": "kvcert.models",
    "PoissonPress": "kvcert.presses",
    "BlockPoissonPress": "kvcert.presses",
    "BlockDecision": "kvcert.presses",
    "SnapKVPress": "kvcert.presses",
    "H2OPress": "kvcert.presses",
    "StreamingLLMPress": "kvcert.presses",
    "TOVAPress": "kvcert.presses",
    "KNormPress": "kvcert.presses",
    "RandomPress": "kvcert.presses",
    "ExpectedAttentionPress": "kvcert.presses",
    "ScorerPress": "kvcert.presses",
    "Press": "kvcert.presses",
    "DecodingPress": "kvcert.presses",
    "PRESSES": "kvcert.presses",
    "Certificates": "kvcert.records",
    "KVCertCache": "kvcert.cache",
    "generate": "kvcert.generation",
    "prefill": "kvcert.generation",
    "prefill_context": "kvcert.generation",
    "Prefill": "kvcert.generation",
    "compress_context": "kvcert.generation",
    "answer": "kvcert.generation",
    "answer_certificates": "kvcert.generation",
    "CompressedContext": "kvcert.generation",
    "GenerationResult": "kvcert.generation",
    "calibrate": "kvcert.generation",
    # an answer-level guarantee: conformal risk control of certificate escalation
    "EscalationPolicy": "kvcert.calibration",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None and name.endswith("Press"):  # the press of a scorer registered later
        module = "kvcert.presses"
    if module is None:
        raise AttributeError(f"module 'kvcert' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
