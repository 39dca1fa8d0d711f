"""Packed weights: the quantization modes, the int8 / int4 linear layers, GGUF's 4-bit
blocks kept as they are, and the projections fused after loading.

Imports of other model rooms: only `checkpoint` (the config, GGUF tensors).

Packed weights run on kvserve's own CPU kernel (kvserve.model.cpu_kernels.quant_matmul:
int8 activations times the codes, VNNI or AVX2), in the engine's dtype. Files:

    quantize.py     the quantization modes: which weights are packed, the module swap
    quant_linear.py packed linear layers (int8 per row, int4 per block of 32)
    gguf_blocks.py  GGUF 4-bit blocks (Q4_0, Q4_1, Q4_K) -> int4 kernel weights as they
                    are; quantization gguf's rule per tensor
    fusion.py       q/k/v and gate/up stacked into one layer each after loading (float,
                    int8 or int4 rows), or run one by one where they cannot stack
    onednn_linear.py bfloat16 and float32 linear layers (and a tied lm_head) with
                    their weights pre-packed for oneDNN on the CPU, no per-call
                    weight reorder, where panel_linear's kernels do not run:
                    F.linear's bits in bfloat16; packed modes left alone
    panel_linear.py bfloat16 (AVX-512 BF16) and float32 (AVX-512 or AVX2) linear
                    layers outside the exact mode: weights packed once in panels,
                    every call on cpu_kernels' dense_bf16.h or dense_f32.h, so the
                    fused decode takes float models too
"""
