"""Small native kernels for block formats PyTorch has no kernel for (built on first use)."""
