"""kvcert.fast: batched PyTorch backend (CPU/GPU). See DESIGN.md section 3."""
