"""kvcert.kernels: Triton kernels. See DESIGN.md section 3."""
