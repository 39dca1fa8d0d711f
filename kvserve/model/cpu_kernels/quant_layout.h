/* The packed weights' layout, shared by quant_matmul.c and quant_dequantize.c (its
 * description: quant_matmul.c's header and kvserve/model/cpu_kernels/quant_layout.py). */
#ifndef KVSERVE_QUANT_LAYOUT_H
#define KVSERVE_QUANT_LAYOUT_H
#include <stdint.h>
#if defined(__F16C__) || defined(__AVX2__)
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

#if defined(__AVX512BW__)
/* One step's 4-bit bytes (low lanes' codes | high lanes' << 4) as 64 codes a byte each, in
 * the input's lane order: the low nibbles, then the high ones. */
static inline __m512i split_nibbles(__m256i v) {
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(v), shift),
                            _mm512_set1_epi8(0x0f));
}
#endif

/* A 4-bit row's codes a byte each, each window laid out as 8-bit codes are (per step the low
 * lanes' 4 * half bytes, then the high lanes'): a prefill's row then feeds its many input rows
 * by plain loads, not a shift and a mask each time (quant_matmul.c). */
static inline void unpack_row(const uint8_t *packed, uint8_t *out, int64_t K) {
    const int64_t blocks = K / BLOCK;
    for (int64_t w = 0; w * WINDOW < blocks; w++) {
        const int half = window_blocks(blocks, w) / 2, n = 4 * half;
        const uint8_t *src = packed + w * 256;
        uint8_t *dst = out + w * 512;
        for (int t = 0; t < STEPS; t++) {
            int j = 0;
#if defined(__AVX512BW__)
            if (n == 32) { /* a whole window's step: both halves of the codes in one store */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + t * n));
                _mm512_storeu_si512(dst + t * 2 * n, split_nibbles(v));
                continue;
            }
#endif
#if defined(__AVX2__)
            const __m256i low = _mm256_set1_epi8(0x0f);
            for (; j + 32 <= n; j += 32) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(src + t * n + j));
                _mm256_storeu_si256((__m256i *)(dst + t * 2 * n + j), _mm256_and_si256(v, low));
                _mm256_storeu_si256((__m256i *)(dst + t * 2 * n + n + j),
                                    _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
            }
#endif
            for (; j < n; j++) {
                dst[t * 2 * n + j] = src[t * n + j] & 0x0f;
                dst[t * 2 * n + n + j] = src[t * n + j] >> 4;
            }
        }
    }
}

#endif
