/* Matmuls with 4-bit or 8-bit weights on the CPU (kvserve/model/cpu_kernels): the
 * activations are quantized to int8 in blocks of 32, and each block's dot product is an
 * integer one (AVX-512 VNNI, AVX-VNNI, AVX2's maddubs, or plain C), scaled in float32.
 *
 * A block b of an input row is x ~= dx_b * xq (xq int8 in -127..127, dx_b = max|x| / 127):
 *   sum_k w_k x_k ~= sum_b dx_b * (scale_b * sum_k code_k xq_k + offset_b * sum_k xq_k)
 * with w = code * scale + offset. 4 bits: codes 0..15, a scale and an offset per block
 * (float32 or float16; no offsets means offset = -8 * scale, llama.cpp's Q4_0). 8 bits:
 * code = w + 128, one float32 scale per row.
 *
 * Layout: a row's columns are windows of 16 blocks (512 columns; the last window may hold
 * fewer, 2 to 14: K is a multiple of 64). A window has 16 lanes of 4 bytes, one lane per
 * block: blocks [0, half) in lanes 0.., blocks [half, nb) in lanes 8.. (half = nb / 2),
 * and 8 steps, step t holding each block's columns 4t..4t+3. So one VNNI instruction
 * multiplies 4 columns of 16 blocks, each block's sum stays in its own int32 lane over
 * the 8 steps, and the scales apply once per window, not once per step.
 * - 8 bits, per step: the low lanes' 4 * half bytes, then the high lanes'.
 * - 4 bits, per step: 4 * half bytes, byte j = low lanes' code j | high lanes' code j << 4.
 * The input is laid out the same way when it is quantized (kvserve/model/cpu_kernels/
 * quant_layout.py packs the weights).
 *
 * Each (input row, output row) pair runs the same integer sums and the same float32
 * instructions whatever the number of rows: a row's result does not depend on the batch it
 * came in (a prompt prefilled after a cached prefix gets the bits an uncached prefill gets).
 * With more than 2 * TILE input rows a 4-bit weight row is first unpacked to a byte a code
 * (quant_layout.h's unpack_row), so its many passes load codes instead of shifting and
 * masking them each time: integer sums, so the same bits. A change to the numbers bumps
 * kvserve/model/memory/kv_io.py's PACKED_NUMBERS (the tiers' key for packed weights).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"
#include "quant_input.h"
#include "quant_layout.h"

#define TILE 2 /* input rows sharing one pass over a weight row (with 4, registers spill) */
#define L1_BLOCK_BYTES 16384 /* a prefill's unpacked weight rows, and its input rows' codes */

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PATH_AVX512 1
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define PATH_AVX2 1
#endif

/* Decode reads every weight once, and on its own the hardware prefetcher keeps only about
 * 3/4 of the read bandwidth busy while the dot products fill the out-of-order window: each
 * window asks for the codes prefetch_bytes ahead (and their scales), into L2 because they
 * are read once. Rows are contiguous, so ahead of a row's end is the next row's start.
 * The distance is the CPU's: on an Intel Xeon 3 KiB was the fastest of 0.5-8 KiB on a 1B
 * model's matmuls (benchmarks/llama_1b.py); on an AMD EPYC (Zen 4) 12-24 KiB were, a
 * decode step 0.7x its time at 3 KiB (48 KiB: 0.9x). */
static int64_t prefetch_bytes = 3072;
__attribute__((constructor)) static void choose_prefetch_distance(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) prefetch_bytes = 16384;
#endif
}
static inline void prefetch_ahead(const uint8_t *codes, int64_t w, int64_t window_bytes,
                                  const void *scales, const void *offsets, int f16, int bits) {
    const char *at = (const char *)codes + w * window_bytes + prefetch_bytes;
    for (int64_t line = 0; line < window_bytes; line += 64) __builtin_prefetch(at + line, 0, 2);
    if (bits != 4) return; /* one scale per row */
    const int64_t scale_at = (w * WINDOW) * (f16 ? 2 : 4) + prefetch_bytes / 16 * (f16 ? 2 : 4);
    __builtin_prefetch((const char *)scales + scale_at, 0, 2);
    if (offsets) __builtin_prefetch((const char *)offsets + scale_at, 0, 2);
}

/* A prefill's next block of weight rows (their codes and scales), asked for before the
 * current block is unpacked: without it the unpacking waits on memory, and a 17-row matmul
 * of a 1B model's weights took 1.1x as long (an AMD EPYC, Zen 4, 2 threads). */
static inline void prefetch_rows(const uint8_t *codes, const char *scales, int64_t rows,
                                 int64_t row_bytes, int64_t row_scales) {
    for (int64_t at = 0; at < rows * row_bytes; at += 64) __builtin_prefetch(codes + at, 0, 2);
    for (int64_t at = 0; at < rows * row_scales; at += 64) __builtin_prefetch(scales + at, 0, 2);
}

#if PATH_AVX512
/* 16 per-block factors in lane order: blocks b0.. in lanes 0..half-1, b0+half.. in 8.. */
static inline __m512 lanes16(const void *s, int64_t b0, int half, int f16) {
    if (half == 8) {
        if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)s + b0)));
        return _mm512_loadu_ps((const float *)s + b0);
    }
    const __mmask8 k = (__mmask8)((1u << half) - 1u);
    if (f16) {
        const uint16_t *h = (const uint16_t *)s + b0;
        const __m128i a = _mm_maskz_loadu_epi16(k, h), b = _mm_maskz_loadu_epi16(k, h + half);
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
    }
    const float *f = (const float *)s + b0;
    const __m256 a = _mm256_maskz_loadu_ps(k, f), b = _mm256_maskz_loadu_ps(k, f + half);
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

/* One window step's 64 codes, lanes as the input's. */
static inline __m512i codes4(const uint8_t *p, int half) {
    return split_nibbles(half == 8 ? _mm256_loadu_si256((const __m256i *)p)
                                   : _mm256_maskz_loadu_epi8((__mmask32)((1ull << (4 * half)) - 1u), p));
}

static inline __m512i codes8(const uint8_t *p, int half) {
    if (half == 8) return _mm512_loadu_si512(p);
    const __mmask32 k = (__mmask32)((1ull << (4 * half)) - 1u);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_maskz_loadu_epi8(k, p)),
                              _mm256_maskz_loadu_epi8(k, p + 4 * half), 1);
}

/* One window of one weight row against mt input rows: acc += the window's scaled sums. */
static inline __attribute__((always_inline)) void one_window(
    const uint8_t *wc, const int bits, const int packed, const void *scales, const void *offsets,
    int f16, const Quantized *q, int64_t w, const int half, int64_t m0, const int mt, __m512 *acc,
    __m512 *off) {
    __m512i dot[TILE][2];
    for (int m = 0; m < mt; m++) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    for (int t = 0; t < STEPS; t++) {
        const __m512i u = packed ? codes4(wc + t * 4 * half, half) : codes8(wc + t * 8 * half, half);
        for (int m = 0; m < mt; m++) {
            const int8_t *xq = q->xq + ((m0 + m) * q->windows + w) * (STEPS * 64) + t * 64;
            dot[m][t & 1] = _mm512_dpbusd_epi32(dot[m][t & 1], u, _mm512_load_si512(xq));
        }
    }
    if (bits == 4) {
        const __m512 s = lanes16(scales, w * WINDOW, half, f16);
        const __m512 o = offsets ? lanes16(offsets, w * WINDOW, half, f16)
                                 : _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
        for (int m = 0; m < mt; m++) {
            const int64_t at = ((m0 + m) * q->windows + w) * WINDOW;
            const __m512 sd = _mm512_mul_ps(s, _mm512_load_ps(q->dx + at));
            const __m512i d = _mm512_add_epi32(dot[m][0], dot[m][1]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sd, acc[m]);
            off[m] = _mm512_fmadd_ps(o, _mm512_load_ps(q->xs + at), off[m]);
        }
    } else {
        for (int m = 0; m < mt; m++) {
            const int64_t at = ((m0 + m) * q->windows + w) * WINDOW;
            const __m512i d = _mm512_add_epi32(dot[m][0], dot[m][1]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_load_ps(q->dx + at), acc[m]);
        }
    }
}

static inline __attribute__((always_inline)) void window_rows(
    const uint8_t *codes, const int bits, const int packed, const void *scales,
    const void *offsets, int f16, const Quantized *q, int64_t m0, const int mt, int64_t K,
    float *res) {
    const int64_t blocks = K / BLOCK, whole = blocks / WINDOW;
    const int64_t window_bytes = packed ? 256 : 512;
    __m512 acc[TILE], off[TILE];
    for (int m = 0; m < mt; m++) acc[m] = off[m] = _mm512_setzero_ps();
    for (int64_t w = 0; w < whole; w++) {
        if (packed || bits == 8) /* not an unpacked row: that one is in L1 */
            prefetch_ahead(codes, w, window_bytes, scales, offsets, f16, bits);
        one_window(codes + w * window_bytes, bits, packed, scales, offsets, f16, q, w, 8, m0, mt,
                   acc, off);
    }
    if (whole < q->windows)
        one_window(codes + whole * window_bytes, bits, packed, scales, offsets, f16, q, whole,
                   window_blocks(blocks, whole) / 2, m0, mt, acc, off);
    for (int m = 0; m < mt; m++) {
        if (bits == 4)
            res[m] = _mm512_reduce_add_ps(acc[m]) + _mm512_reduce_add_ps(off[m]);
        else /* the codes are w + 128 */
            res[m] = *(const float *)scales * (_mm512_reduce_add_ps(acc[m]) - 128.0f * q->xtot[m0 + m]);
    }
}
#define PATH_NAME "avx512-vnni"
#include "dense_bf16.h"
#include "quant_matmul_pairs.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PATH_AMX 1
#include "quant_matmul_amx.h"
#endif

#elif PATH_AVX2
#include "quant_matmul_avx2.h"

#else /* plain C: the same sums, one block at a time */
#include "quant_matmul_plain.h"
#define PATH_NAME "portable"
#endif
#include "dense_f32.h"

/* window_rows with the codes' kind and the tile's rows as constants, each compiled on its own
 * so that its accumulators live in registers: 4 bits packed (two codes a byte), 4 bits
 * unpacked (a byte each: unpack_row's), 8 bits. */
#define ROWS(NAME, BITS, PACKED, MT)                                                            \
    static __attribute__((noinline)) void NAME##_##MT(                                          \
        const uint8_t *codes, const void *scales, const void *offsets, int f16,                 \
        const Quantized *q, int64_t m0, int64_t K, float *res) {                                \
        window_rows(codes, BITS, PACKED, scales, offsets, f16, q, m0, MT, K, res);              \
    }
ROWS(rows4, 4, 1, 1) ROWS(rows4, 4, 1, 2) ROWS(rows4u, 4, 0, 1) ROWS(rows4u, 4, 0, 2)
ROWS(rows8, 8, 0, 1) ROWS(rows8, 8, 0, 2)

typedef void (*RowsFn)(const uint8_t *, const void *, const void *, int, const Quantized *,
                       int64_t, int64_t, float *);
static const RowsFn ROWS4[TILE] = {rows4_1, rows4_2}, ROWS4U[TILE] = {rows4u_1, rows4u_2},
                    ROWS8[TILE] = {rows8_1, rows8_2};

/* Which instructions this build runs (the load log says it). */
const char *quant_matmul_path(void) { return PATH_NAME; }

/* Whether this build runs bits 16 (bfloat16 weights in panels: dense_bf16.h). */
int quant_matmul_dense_bf16(void) {
#if DENSE_BF16
    return 1;
#else
    return 0;
#endif
}

/* Whether this build runs bits 32 (float32 weights in panels: dense_f32.h). */
int quant_matmul_dense_f32(void) {
#if DENSE_F32
    return 1;
#else
    return 0;
#endif
}

#if !PATH_AMX
int quant_matmul_tiles(int on) { return on * 0; } /* no AMX tiles in this build */
#endif

/* out [M, N] = x [M, K] @ W.T, x and out float32 or bfloat16 (x_bf16).
 * bits 4: codes [N, K/2], scales and offsets [N, K/32] (float16 when scales_f16; offsets
 * may be NULL). bits 8: codes [N, K], scales [N] float32. K a multiple of 64.
 * bits 16 and 32: codes are bfloat16 or float32 weights in panels (dense_bf16.h, dense_f32.h;
 * any K, no scales), x and out of the same dtype.
 * Returns 0, or -1 when the shapes are not what this kernel runs, -2 when out of memory. */
int quant_matmul(const void *x, void *out, int x_bf16, int64_t M, int64_t N, int64_t K,
                 const uint8_t *codes, int bits, const void *scales, const void *offsets,
                 int scales_f16, int threads) {
    if (bits == 16) {
#if DENSE_BF16
        if (!x_bf16 || M < 0 || N < 0 || K <= 0) return -1;
        return dense_bf16_matmul(x, out, M, N, K, (const uint16_t *)codes, threads);
#else
        return -1;
#endif
    }
    if (bits == 32) {
#if DENSE_F32
        if (x_bf16 || M < 0 || N < 0 || K <= 0) return -1;
        return dense_f32_matmul(x, out, M, N, K, (const float *)codes, threads);
#else
        return -1;
#endif
    }
    if (K % 64 != 0 || (bits != 4 && bits != 8) || M < 0 || N < 0) return -1;
    if (M == 0 || N == 0) return 0;
#if PATH_AMX
    if (M >= AMX_ROWS && amx_granted())
        return tile_matmul(x, x_bf16, codes, bits, scales, offsets, scales_f16, M, N, K, out,
                           N * K >= 65536 ? threads : 1);
#endif
    Quantized q;
    q.windows = (K / BLOCK + WINDOW - 1) / WINDOW;
    /* 64-byte aligned, zeros in the short windows' empty lanes */
    const size_t xq_bytes = (size_t)(M * q.windows) * STEPS * 64;
    const size_t dx_bytes = ((size_t)(M * q.windows * 2 * WINDOW + M) * sizeof(float) + 63) / 64 * 64;
    q.xq = aligned_alloc(64, xq_bytes);
    q.dx = aligned_alloc(64, dx_bytes);
    if (q.xq == NULL || q.dx == NULL) {
        free(q.xq), free(q.dx);
        return -2;
    }
    memset(q.xq, 0, xq_bytes), memset(q.dx, 0, dx_bytes);
    q.xs = q.dx + M * q.windows * WINDOW, q.xtot = q.xs + M * q.windows * WINDOW;
    quantize_rows(x, x_bf16, M, K, &q, threads);
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    const int64_t row_scales = bits == 4 ? (K / BLOCK) * (scales_f16 ? 2 : 4) : 4;
    threads = N * K >= 65536 ? threads : 1;
    /* Three passes over a row or more: unpack it, and visit the rows in blocks (a few weight
     * rows against a chunk of input rows, both within L1) instead of every input row per
     * weight row, which reads all of the quantized input from L2 each time. */
    const int unpack = bits == 4 && M > 2 * TILE;
    const int64_t fit = unpack ? L1_BLOCK_BYTES / K : 0; /* K bytes a row, either kind */
    const int64_t block = fit > 1 ? fit : 1, chunk = unpack && fit > TILE ? fit / TILE * TILE : M;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint8_t *unpacked = unpack ? aligned_alloc(64, (size_t)(block * q.windows * 512)) : NULL;
        const RowsFn *fns = bits == 8 ? ROWS8 : unpacked ? ROWS4U : ROWS4;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += block) {
            const int64_t rows = N - n0 < block ? N - n0 : block;
            const int64_t next = n0 + block, next_rows = N - next < block ? N - next : block;
            if (unpacked && next_rows > 0) /* they arrive while this block runs */
                prefetch_rows(codes + next * row_bytes, (const char *)scales + next * row_scales,
                              next_rows, row_bytes, row_scales);
            for (int64_t j = 0; unpacked && j < rows; j++)
                unpack_row(codes + (n0 + j) * row_bytes, unpacked + j * q.windows * 512, K);
            for (int64_t m1 = 0; m1 < M; m1 += chunk) {
                const int64_t m_end = M - m1 < chunk ? M : m1 + chunk;
                for (int64_t n = n0; n < n0 + rows; n++) {
#ifdef KVSERVE_QUANT_MATMUL_PAIRS_H
                    if (unpacked && n + 1 < n0 + rows) { /* two weight rows a pass */
                        pair_pass(unpacked + (n - n0) * q.windows * 512, q.windows * 512, scales,
                                  offsets, row_scales, scales_f16, &q, n, m1, m_end, K, N,
                                  out, x_bf16);
                        n++;
                        continue;
                    }
#endif
                    const uint8_t *row = unpacked ? unpacked + (n - n0) * q.windows * 512
                                                  : codes + n * row_bytes;
                    const void *s = (const char *)scales + n * row_scales;
                    const void *o = offsets && bits == 4 ? (const char *)offsets + n * row_scales : NULL;
                    float res[TILE];
                    for (int64_t m0 = m1; m0 < m_end; m0 += TILE) {
                        const int mt = m_end - m0 < TILE ? (int)(m_end - m0) : TILE;
                        fns[mt - 1](row, s, o, scales_f16, &q, m0, K, res);
                        for (int m = 0; m < mt; m++) {
                            if (x_bf16) ((uint16_t *)out)[(m0 + m) * N + n] = to_bf(res[m]);
                            else ((float *)out)[(m0 + m) * N + n] = res[m];
                        }
                    }
                }
            }
        }
        free(unpacked);
    }
    free(q.xq), free(q.dx);
    return 0;
}

