"""Small C kernels for the CPU where torch ships none, or a slower one (packed weights).

Compiled by the system C compiler (-march=native, no torch headers: under a second) and
cached on disk; without a compiler torch's own ops run (packed layers dequantize per
call). Files:

    cpu_features.py the CPU's model and the flags that decide its fast dtype (avx2,
                    avx512f, avx512_bf16, amx_bf16, VNNI): native bfloat16 or not, from
                    /proc/cpuinfo or torch; KVSERVE_CPU_FEATURES overrides (no torch import)
    build.py        the compile and its cache (~/.cache/kvserve/kernels, keyed by source,
                    flags, compiler and CPU flags)
    attention.c     attention: paged decode for bfloat16 and float32 caches
                    (decode_attention.h, written once for both: each row's context
                    read in place through its slots) and a prefill's causal
                    attention, fresh or after a cached prefix (its keys read through
                    the slots; one pass of scores, exact row maxima, then the weights
                    times the values): bfloat16 on AVX-512's bfloat16 dot products,
                    SDPA's roundings; float32 in prefill_attention_f32.h. Decode and
                    the float32 prefill run on simd_f32.h's vectors (AVX-512, or AVX2
                    with FMA at half the width); prefill_attention_amx.h: the bfloat16
                    prefill on AMX tiles where the CPU has them (amx_tiles.h: the tiles'
                    permission and layout, shared with quant_matmul_amx.h)
    attention.py    their ctypes binding; with it on, a step's decodes are one group
                    in batch order (no padding read, no rows gathered)
    layer_ops.c, layer_ops.h, layer_ops.py  RMSNorm (with the residual add before
                    it), the rotary embedding, SiLU-and-multiply: one call each, for
                    bfloat16 (torch's roundings in torch's places) and float32
    quant_matmul.c, quant_matmul.py  4-bit and 8-bit weight matmuls: int8 activations
                    in blocks of 32 (quant_input.h), integer dot products on AVX-512
                    VNNI, AVX-VNNI, AVX2 or plain C, the weights prefetched 3 KiB ahead (a
                    decode step streams every weight once); enabled by the first packed
                    layer (kvserve.model.quant), any dtype; a prefill unpacks each weight
                    row once and meets its input rows in blocks that stay in L1;
                    quant_matmul_avx2.h, quant_matmul_plain.h: the AVX2 and plain C
                    paths; quant_matmul_pairs.h: a prefill's pass of two weight rows
                    against four input rows on AVX-512 VNNI (the same bits);
                    quant_matmul_amx.h: calls of 10 rows or more on AMX tiles,
                    16 weight rows at a time dequantized to bfloat16 (KVSERVE_AMX=0
                    keeps them off); quant_dequantize.c and .h: the weights as floats;
                    dense_bf16.h: bits 16, bfloat16 weights in panels (16 output
                    columns, input pairs interleaved) times bfloat16 rows on AVX-512
                    BF16; dense_f32.h: bits 32, float32 panels on AVX-512 or AVX2
                    (a float model's every matmul outside the exact mode)
    quant_layout.py, quant_layout.h  its weight layout (windows of 16 blocks, 8 steps of
                    4 columns), packed and unpacked with torch; the C side's constants
    decode_layers.c, decode_layers.py  a decode step's decoder layers in one call:
                    the kernels above through their addresses, in the modules' order
                    (kvserve.model.fused_decode plans it per model)
    switch.py       enabled once by a bfloat16 or a fast float32 CPU runner,
                    process-wide (KVSERVE_CPU_KERNELS=0 turns them off)
    float32_scope.py  float32 takes them only inside a fast float32 runner's step (per
                    thread): an exact engine of the same process keeps torch's ops
"""
