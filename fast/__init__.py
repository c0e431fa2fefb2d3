"""kvcert.fast: batched PyTorch backend (CPU/GPU). See docs/design.md section 3.

Same contract names as ``kvcert.reference`` for batched tensors: q (b, h_q, d)
or (b, h_q, t, d), keys/values (b, h_kv, n, d), pi (b, h_kv, n) with 0 on
padding, GQA by h_q = g * h_kv. Never imports ``kvcert.reference`` or
transformers.
"""

from . import scorers
from .estimators import attention, clear_workspace, hajek_attention, value_moments
from .blocks import (
    BLOCK_REDUCTIONS,
    REDUCTIONS,
    BlockDecision,
    BlockDesign,
    block_compact,
    block_count,
    block_evict,
    block_hajek_attention,
    block_importance,
    block_inclusion_probabilities,
    block_keep,
    block_budget,
    block_sample,
    block_uniforms,
    expand_blocks,
    paged_block_hajek_attention,
    prompt_event,
)
from .certificates import (
    CERTIFICATE_KINDS,
    KINDS,
    PLAIN_KINDS,
    SERVED_KINDS,
    CertificateKind,
    certificate,
    certificate_moments,
    estimate_options,
    radius_from_moments,
    radius_from_statistics,
)
from .design import (
    DesignSizes,
    budget_from_fraction,
    certainty_mask,
    design_sizes,
    design_uniforms,
    edge_mask,
    inclusion_probabilities,
    nonnegative_importance,
    poisson_sample,
    SAMPLINGS,
    start_uniforms,
    systematic_sample,
    splitmix64,
)
from .token_design import (
    RECOMMENDED,
    RECOMMENDED_FIELDS,
    RECOMMENDED_SAMPLING,
    TOKEN_DESIGNS,
    QuantizedCertificate,
    quantized_decode,
    TokenDecision,
    TokenDesign,
    TokenEvent,
    default_design,
    default_sampling,
    preset_fields,
    register_design,
    resolve_sketch,
)
from .compaction import Compaction, compact_slots
from .eviction import compact, evict, topk_evict
from .scorers import (
    SCORERS,
    Scorer,
    register_scorer,
    expected_attention_scores,
    h2o_scores,
    knorm_scores,
    random_scores,
    snapkv_scores,
    streaming_llm_scores,
    tova_scores,
)
from .sketch import (
    CLUSTER_RADII,
    RADIUS_RULES,
    RadiusRule,
    ClusterDesign,
    ClusterEstimate,
    ClusterSketch,
    sketch_hajek_attention,
    cluster_radius,
    cluster_sketch,
    cluster_variance,
    sketched_variance,
    kmeans_assign,
    recorded_trace,
    window_tilt,
)
from .allocation import Allocation, adakv_budgets, allocate_budgets, pyramid_budgets, uniform_budgets
from .target import TARGET_KINDS, TargetBudget, predicted_radius, target_budget, window_variance_terms
from .types import Certificate, CompressedCache, Estimate
from .quantized import (CHANNEL_GROUP, FORMATS, KV_BITS, KV_FORMAT, KV_LAYOUTS, QUANTIZED_BOUNDS, ROUNDINGS,
                        ROUNDING_EVENTS, QuantizedChannels, QuantizedKV, QuantizedRows, check_kv_bits,
                        check_kv_layout, check_quantized_bound, held_rounding_terms, logit_bound, logit_variance,
                        quantization_bound, quantization_variance, quantize, quantize_channels,
                        quantized_memory_fraction, rounding_uniforms, sampled_budget, store_kv, token_elements,
                        value_bound)
from .bits import BitsChoice, BitsPrediction, KV_BITS_CHOICES, check_kv_bits_choice, choose_kv_bits, kept_at_bits

__all__ = [
    "Estimate", "Certificate", "CompressedCache",
    "attention", "hajek_attention", "value_moments", "clear_workspace",
    "BLOCK_REDUCTIONS", "REDUCTIONS", "BlockDecision", "BlockDesign", "block_compact", "block_count", "block_evict", "block_hajek_attention", "block_importance",
    "block_inclusion_probabilities", "block_keep", "block_budget", "block_sample", "block_uniforms", "expand_blocks",
    "paged_block_hajek_attention", "prompt_event",
    "CERTIFICATE_KINDS", "CertificateKind", "KINDS", "PLAIN_KINDS", "SERVED_KINDS", "certificate", "certificate_moments", "estimate_options",
    "radius_from_moments", "radius_from_statistics",
    "budget_from_fraction", "certainty_mask", "DesignSizes", "design_sizes", "design_uniforms", "edge_mask",
    "inclusion_probabilities", "poisson_sample", "SAMPLINGS", "start_uniforms", "systematic_sample", "splitmix64", "nonnegative_importance", "TokenDecision",
    "TokenEvent", "RECOMMENDED_FIELDS", "TOKEN_DESIGNS", "preset_fields", "register_design",
    "TokenDesign", "default_design", "default_sampling", "RECOMMENDED", "RECOMMENDED_SAMPLING", "resolve_sketch",
    "Compaction", "compact_slots", "compact", "evict", "topk_evict",
    "scorers", "SCORERS", "Scorer", "register_scorer", "expected_attention_scores", "h2o_scores", "knorm_scores", "random_scores", "snapkv_scores",
    "streaming_llm_scores", "tova_scores",
    "CLUSTER_RADII", "RADIUS_RULES", "RadiusRule", "ClusterDesign", "ClusterEstimate", "ClusterSketch",
    "sketch_hajek_attention", "cluster_radius", "cluster_sketch", "cluster_variance", "kmeans_assign", "recorded_trace",
    "sketched_variance", "window_tilt",
    "TARGET_KINDS", "TargetBudget", "predicted_radius", "target_budget", "window_variance_terms",
    "Allocation", "adakv_budgets", "allocate_budgets", "pyramid_budgets", "uniform_budgets",
]

__all__ += [
    "CHANNEL_GROUP", "FORMATS", "KV_BITS", "KV_FORMAT", "KV_LAYOUTS", "QUANTIZED_BOUNDS", "ROUNDINGS", "ROUNDING_EVENTS",
    "QuantizedChannels", "QuantizedRows", "logit_bound", "logit_variance", "quantization_bound",
    "quantization_variance", "quantize", "quantize_channels", "quantized_memory_fraction", "rounding_uniforms",
    "sampled_budget", "token_elements", "value_bound",
    "QuantizedKV", "held_rounding_terms", "check_kv_bits", "check_kv_layout", "check_quantized_bound", "store_kv", "QuantizedCertificate", "quantized_decode",
    "BitsChoice", "BitsPrediction", "KV_BITS_CHOICES", "check_kv_bits_choice", "choose_kv_bits", "kept_at_bits",
]

#: names of earlier releases (one name per operation, docs/architecture.md "Names"): each still resolves,
#: with a DeprecationWarning naming its new name
RENAMED = {"cluster_hajek_attention": "sketch_hajek_attention"}


def __getattr__(name):
    new = RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    warnings.warn(f"kvcert.fast.{name} is renamed kvcert.fast.{new}", DeprecationWarning, stacklevel=2)
    return globals()[new]
