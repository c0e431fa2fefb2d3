"""kvcert.reference: the exact float64 NumPy/SciPy oracle.

One query head, one KV head, no batching, no tricks: every estimator of
docs/design.md section 2 written to be read beside the paper (arXiv 2607.21475).
Shapes: q (d,), keys (n, d), values (n, dv), pi (n,).
"""

from .adversary import AdversarialCache, adversarial_cache
from .baselines import (
    SCORERS,
    deterministic_keep,
    expected_attention_scores,
    h2o_scores,
    knorm_scores,
    random_scores,
    snapkv_scores,
    streaming_llm_scores,
    tova_scores,
)
from .blocks import (
    BLOCK_REDUCTIONS,
    REDUCTIONS,
    block_count,
    block_hajek_attention,
    block_importance,
    block_inclusion_probabilities,
    block_keep,
    block_labels,
    block_linearized_variance,
    block_linearized_variance_ht,
    block_sample,
    block_stream_key,
    block_uniforms,
    expand_blocks,
)
from .certificates import (
    CERTIFICATE_KINDS,
    KINDS,
    Certificate,
    CertificateKind,
    certificate,
    covers,
    radius_from_moments,
)
from .design import (
    budget_from_fraction,
    certainty_mask,
    compact_slots,
    design_generator,
    design_uniforms,
    edge_mask,
    inclusion_probabilities,
    poisson_sample,
    SAMPLINGS,
    systematic_sample,
)
from .sketch import (
    ClusterDesign,
    EvictionResult,
    evict_and_certify,
    memory_fraction,
)
from .bits import BitsChoice, BitsPrediction, KV_BITS_CHOICES, check_kv_bits_choice, choose_kv_bits, kept_at_bits
from .quantized import (
    KV_BITS,
    KV_LAYOUTS,
    QUANTIZED_BOUNDS,
    QuantizedChannels,
    QuantizedRows,
    logit_bound,
    logit_variance,
    quantization_bound,
    quantization_variance,
    quantize,
    quantize_channels,
    quantized_memory_fraction,
    rounding_generator,
    sampled_budget,
    token_elements,
    value_bound,
)
from .target import (
    TARGET_KINDS,
    TargetBudget,
    predicted_radius,
    radius_at_budget,
    smallest_budget_scan,
    target_budget,
    window_variance_terms,
)
from .estimators import (
    Estimate,
    attention,
    hajek_attention,
    horvitz_thompson_totals,
    linearized_variance,
    linearized_variance_ht,
    scores,
)

__all__ = [
    "AdversarialCache", "adversarial_cache",
    "BLOCK_REDUCTIONS", "REDUCTIONS",
    "block_count", "block_hajek_attention", "block_importance", "block_inclusion_probabilities",
    "block_keep", "block_labels", "block_linearized_variance", "block_linearized_variance_ht", "block_sample",
    "block_stream_key", "block_uniforms", "expand_blocks",
    "SCORERS", "deterministic_keep", "expected_attention_scores", "h2o_scores", "knorm_scores", "random_scores",
    "snapkv_scores", "streaming_llm_scores", "tova_scores",
    "CERTIFICATE_KINDS", "CertificateKind", "KINDS", "Certificate", "certificate", "covers", "radius_from_moments",
    "budget_from_fraction", "certainty_mask", "design_generator", "design_uniforms",
    "edge_mask", "inclusion_probabilities", "poisson_sample", "compact_slots", "SAMPLINGS",
    "systematic_sample",
    "Estimate", "attention", "hajek_attention", "horvitz_thompson_totals",
    "linearized_variance", "linearized_variance_ht", "scores",
    "EvictionResult", "evict_and_certify", "memory_fraction", "ClusterDesign",
    "KV_BITS", "KV_BITS_CHOICES", "BitsChoice", "BitsPrediction", "check_kv_bits_choice", "choose_kv_bits",
    "kept_at_bits", "KV_LAYOUTS", "QUANTIZED_BOUNDS", "QuantizedChannels", "QuantizedRows", "logit_bound",
    "logit_variance", "quantization_bound", "quantization_variance", "quantize", "quantize_channels",
    "quantized_memory_fraction", "rounding_generator", "sampled_budget", "token_elements", "value_bound",
    "TARGET_KINDS", "TargetBudget", "predicted_radius", "radius_at_budget", "smallest_budget_scan", "target_budget",
    "window_variance_terms",
]
