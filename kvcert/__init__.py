"""kvcert: randomized KV-cache eviction with statistical error certificates.

Poisson sampling with known inclusion probabilities, the Hajek-corrected
softmax (logit offset -log pi) and a survey-sampling variance estimate
computed from the retained tokens alone (arXiv 2607.21475).

Backends: ``kvcert.reference`` (NumPy float64 oracle), ``kvcert.fast``
(batched PyTorch), ``kvcert.kernels`` (Triton).
"""

__version__ = "0.1.0"
