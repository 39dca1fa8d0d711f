"""Packed weights: the quantization modes, the int8 / int4 linear layers, GGUF's 4-bit
blocks kept as they are, and the projections fused after loading.

Imports of other model rooms: only `checkpoint` (the config, GGUF tensors).
"""
