"""Small C kernels for the CPU where torch ships none (built with the system compiler)."""
