/* The packed weights' layout, shared by quant_matmul.c and quant_dequantize.c (its
 * description: quant_matmul.c's header and kvserve/model/cpu_kernels/quant_layout.py). */
#ifndef KVSERVE_QUANT_LAYOUT_H
#define KVSERVE_QUANT_LAYOUT_H
#include <stdint.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#define BLOCK 32
#define WINDOW 16 /* blocks */
#define STEPS 8   /* 4-column steps of a block */

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) return sign ? -(float)man * 5.9604644775390625e-8f : (float)man * 5.9604644775390625e-8f;
    v.u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    return v.f;
#endif
}

static inline float scale_at(const void *s, int64_t i, int f16) { /* float16 or float32 */
    return f16 ? half_to_float(((const uint16_t *)s)[i]) : ((const float *)s)[i];
}

/* Blocks in window w of a row of `blocks` (16, or fewer in the last). */
static inline int window_blocks(int64_t blocks, int64_t w) {
    return blocks - w * WINDOW < WINDOW ? (int)(blocks - w * WINDOW) : WINDOW;
}

#endif
