"""kvcert.kernels: Triton kernels. See DESIGN.md section 3 and docs/gpu.md.

:func:`hajek_attention` is the fused decode kernel: one pass over the
compressed K/V cache returns the Hajek output, the log-normalizer, the
per-coordinate survey variance, its trace and the effective sample size.
:func:`paged_hajek_attention` is its paged twin for the block design: it
reads a vLLM-style paged cache through the block table, skips evicted blocks
and returns the cluster-sampling variance in the same pass.
:func:`cluster_hajek_attention` is the cluster (sketch) design's decode step of
issue 14 with its one pass over the kept K/V in a kernel (kvcert.fast's twin).
Importing this package imports Triton; on a machine without a GPU set
``TRITON_INTERPRET=1`` before the import to run the kernels on CPU tensors.
"""

from .hajek import INTERPRETED, SUPPORTED_DTYPES, default_config, default_moments, hajek_attention
from .paged import kv_cache_views, paged_hajek_attention
from .sketch import cluster_hajek_attention

__all__ = ["INTERPRETED", "SUPPORTED_DTYPES", "cluster_hajek_attention", "default_config", "default_moments",
           "hajek_attention", "kv_cache_views", "paged_hajek_attention"]
