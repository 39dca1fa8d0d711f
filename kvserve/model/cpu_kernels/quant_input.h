/* The input side of quant_matmul.c: each row of activations quantized to int8 in blocks of
 * 32 and laid out as the weights' windows (quant_matmul.c's header says how), so that one
 * VNNI instruction meets 4 columns of 16 blocks of both. Every call quantizes its input,
 * so on AVX2 (and AVX-512) a block takes 8 values an instruction: the scalar loop was an
 * eighth of a 17-row prefill's matmul time.
 */
#ifndef KVSERVE_QUANT_INPUT_H
#define KVSERVE_QUANT_INPUT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "quant_layout.h"

/* The quantized input, in the weights' window layout: per (row, window) 512 bytes of xq and
 * 16 lanes of dx and xs = dx * sum(xq) (zeros in a short window's empty lanes); xtot per row
 * is the sum of its xs, in block order (the 8-bit codes' +128 taken back). */
typedef struct {
    int8_t *xq;
    float *dx, *xs, *xtot;
    int64_t windows; /* per row */
} Quantized;

/* amax / 127 rounded once, as torch divides: -ffast-math lets the compiler multiply by a
 * rounded 1/127 instead (it did, in the OpenMP loop), which moves a block's scale by an
 * ulp; the divisor hidden from it keeps the division. */
static volatile const float block_divisor = 127.0f;
static inline float block_scale(float amax) { return amax / block_divisor; }

#if defined(__AVX2__)
#include <immintrin.h>

/* 8 values of a row as float32 (a bfloat16 is the top half of one: exact). */
static inline __m256 load8(const void *x, int x_bf16, int64_t at) {
    if (!x_bf16) return _mm256_loadu_ps((const float *)x + at);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One block as the scalar loop below quantizes it, 8 values an instruction: the same
 * float32 multiply, rounding to nearest even (the control register's, as lrintf's) and
 * clamp, so the same bytes. Writes the 8 groups of 4 bytes 64 apart, returns their sum. */
static inline int quantize_block(const void *x, int x_bf16, int64_t at, int8_t *dst, float *d) {
    __m256 v[4], amax = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < 4; i++) {
        v[i] = load8(x, x_bf16, at + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], magnitude));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    *d = block_scale(_mm_cvtss_f32(m));
    const __m256 inverse = _mm256_set1_ps(*d != 0.0f ? 1.0f / *d : 0.0f);
    __m256i r[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
        r[i] = _mm256_min_epi32(_mm256_max_epi32(r[i], _mm256_set1_epi32(-127)), _mm256_set1_epi32(127));
        sum = _mm256_add_epi32(sum, r[i]);
    }
    /* packing interleaves 4-value groups across the halves: 0, 2, 4, 6 | 1, 3, 5, 7 */
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    int32_t groups[8];
    _mm256_storeu_si256((__m256i *)groups, bytes);
    for (int t = 0; t < 8; t++) memcpy(dst + t * 64, &groups[t], 4);
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#endif

static void quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t K, Quantized *q,
                          int threads) {
    const int64_t blocks = K / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t m = 0; m < rows; m++) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t w = b / WINDOW;
            const int j = (int)(b % WINDOW), half = window_blocks(blocks, w) / 2;
            const int lane = j < half ? j : 8 + j - half;
            int8_t *dst = q->xq + (m * q->windows + w) * (STEPS * 64) + 4 * lane;
            const int64_t at = (m * q->windows + w) * WINDOW + lane;
#if defined(__AVX2__)
            float d;
            const int sum = quantize_block(x, x_bf16, m * K + b * BLOCK, dst, &d);
#else
            float v[BLOCK], amax = 0.0f;
            for (int e = 0; e < BLOCK; e++) {
                const int64_t src = m * K + b * BLOCK + e;
                v[e] = x_bf16 ? bf(((const uint16_t *)x)[src]) : ((const float *)x)[src];
                amax = fmaxf(amax, fabsf(v[e]));
            }
            const float d = block_scale(amax), id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int e = 0; e < BLOCK; e++) {
                long r = lrintf(v[e] * id);
                r = r > 127 ? 127 : (r < -127 ? -127 : r);
                dst[(e / 4) * 64 + e % 4] = (int8_t)r;
                sum += (int)r;
            }
#endif
            q->dx[at] = d;
            q->xs[at] = d * (float)sum;
            total += q->xs[at];
        }
        q->xtot[m] = total;
    }
}

#endif
