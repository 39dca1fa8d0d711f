/* bfloat16 weights as they are (no quantization) times bfloat16 input rows, on AVX-512
 * BF16's dot products (kvserve/model/cpu_kernels): a bfloat16 model's decode steps, batches
 * and short prefill chunks (kvserve/model/quant/dense_bf16_linear.py says how many rows).
 *
 * Why: the fused decode (decode_layers.c) runs a step's layers as one C call, and oneDNN's
 * matmul (torch's F.linear) is not a C function it can call; and at 1-8 rows oneDNN reads
 * the default model's weights at about 16 GB/s where this kernel reads 23 (an AMD EPYC,
 * 2 threads). Each thread streams its weight rows once, two at a time, prefetched
 * DENSE_PREFETCH_BYTES ahead, against up to 8 input rows held in L1.
 *
 * Numbers: out[m, n] = bf16(sum over k of w[n, k] * x[m, k]) in float32, summed by
 * vdpbf16ps in 16 lanes (lane i takes columns 32j + 2i and 32j + 2i + 1, j in order), then
 * the 16 lanes added in a fixed tree. The same instructions for every (m, n) pair whatever
 * the number of rows, so a row's result never depends on the other rows of its call. The
 * last bits differ from oneDNN's (another order of the same float32 sums).
 */
#ifndef KVSERVE_DENSE_BF16_H
#define KVSERVE_DENSE_BF16_H

#define DENSE_ROWS_MAX 8 /* input rows sharing one pass over two weight rows (16 sums) */
#define DENSE_PREFETCH_BYTES 2048 /* each weight row's line this far ahead, into L2 */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DENSE_BF16 1

/* The 16 vectors' lane sums as one vector (lane i: v[i]'s), by one fixed tree of adds: each
 * vector's 16 lanes are added in the same order whatever the others hold. */
static inline __m512 lane_sums16(const __m512 v[16]) {
    __m512 w[8], x[4];
    for (int j = 0; j < 8; j++) /* 128-bit chunk c: [a0+a2, b0+b2, a1+a3, b1+b3] */
        w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]),
                             _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
    for (int j = 0; j < 4; j++) { /* chunk c: its partial sums of v[4j], ..., v[4j + 3] */
        const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
        x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88),
                                    _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88),
                                    _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xdd));
}

/* acc[r][m] += the dot products of columns [k, k + 32) (those `keep` marks) of w_r and x_m */
static inline __attribute__((always_inline)) void dense_columns(
    __m512 acc[2][DENSE_ROWS_MAX], const uint16_t *w0, const uint16_t *w1, const uint16_t *x,
    int64_t K, int64_t k, __mmask32 keep, const int mt, const int nr) {
    const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(keep, w0 + k);
    const __m512bh b = nr > 1 ? (__m512bh)_mm512_maskz_loadu_epi16(keep, w1 + k) : a;
#pragma GCC unroll 8
    for (int m = 0; m < mt; m++) {
        const __m512bh v = (__m512bh)_mm512_maskz_loadu_epi16(keep, x + m * K + k);
        acc[0][m] = _mm512_dpbf16_ps(acc[0][m], a, v);
        if (nr > 1) acc[1][m] = _mm512_dpbf16_ps(acc[1][m], b, v);
    }
}

static inline __attribute__((always_inline)) void dense_pass(
    const uint16_t *w0, const uint16_t *w1, const uint16_t *x, int64_t K, const int mt,
    const int nr, float *sums) {
    __m512 acc[2][DENSE_ROWS_MAX];
#pragma GCC unroll 16
    for (int i = 0; i < 2 * DENSE_ROWS_MAX; i++)
        acc[i / DENSE_ROWS_MAX][i % DENSE_ROWS_MAX] = _mm512_setzero_ps();
    const int64_t whole = K / 32 * 32;
    for (int64_t k = 0; k < whole; k += 32) {
        __builtin_prefetch((const char *)(w0 + k) + DENSE_PREFETCH_BYTES, 0, 2);
        if (nr > 1) __builtin_prefetch((const char *)(w1 + k) + DENSE_PREFETCH_BYTES, 0, 2);
        dense_columns(acc, w0, w1, x, K, k, (__mmask32)-1, mt, nr);
    }
    if (whole < K) /* the last columns, zeros past K */
        dense_columns(acc, w0, w1, x, K, whole, (__mmask32)((1ull << (K - whole)) - 1u), mt, nr);
    __m512 all[2 * DENSE_ROWS_MAX]; /* unused sums stay zero: one tree for every count */
#pragma GCC unroll 16
    for (int i = 0; i < 2 * DENSE_ROWS_MAX; i++)
        all[i] = i / DENSE_ROWS_MAX < nr && i % DENSE_ROWS_MAX < mt
                     ? acc[i / DENSE_ROWS_MAX][i % DENSE_ROWS_MAX] : _mm512_setzero_ps();
    _mm512_storeu_ps(sums, lane_sums16(all));
}

/* Each variant with its rows as constants, so that its sums live in registers. */
#define DENSE_PASS(MT, NR)                                                                    \
    static __attribute__((noinline)) void dense_pass_##MT##_##NR(                             \
        const uint16_t *w0, const uint16_t *w1, const uint16_t *x, int64_t K, float *sums) { \
        dense_pass(w0, w1, x, K, MT, NR, sums);                                               \
    }
DENSE_PASS(1, 1) DENSE_PASS(2, 1) DENSE_PASS(3, 1) DENSE_PASS(4, 1) DENSE_PASS(5, 1)
DENSE_PASS(6, 1) DENSE_PASS(7, 1) DENSE_PASS(8, 1) DENSE_PASS(1, 2) DENSE_PASS(2, 2)
DENSE_PASS(3, 2) DENSE_PASS(4, 2) DENSE_PASS(5, 2) DENSE_PASS(6, 2) DENSE_PASS(7, 2)
DENSE_PASS(8, 2)

typedef void (*DensePassFn)(const uint16_t *, const uint16_t *, const uint16_t *, int64_t, float *);
static const DensePassFn DENSE_PASSES[2][DENSE_ROWS_MAX] = {
    {dense_pass_1_1, dense_pass_2_1, dense_pass_3_1, dense_pass_4_1, dense_pass_5_1,
     dense_pass_6_1, dense_pass_7_1, dense_pass_8_1},
    {dense_pass_1_2, dense_pass_2_2, dense_pass_3_2, dense_pass_4_2, dense_pass_5_2,
     dense_pass_6_2, dense_pass_7_2, dense_pass_8_2},
};

/* out [M, N] = x [M, K] @ w.T, all bfloat16 (w [N, K] row-major). Returns 0. */
static int dense_bf16_matmul(const uint16_t *x, uint16_t *out, int64_t M, int64_t N, int64_t K,
                             const uint16_t *w, int threads) {
    threads = N * K >= 65536 ? threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t n = 0; n < N; n += 2) {
        const int nr = N - n < 2 ? 1 : 2;
        float sums[2 * DENSE_ROWS_MAX];
        for (int64_t m0 = 0; m0 < M; m0 += DENSE_ROWS_MAX) {
            const int mt = M - m0 < DENSE_ROWS_MAX ? (int)(M - m0) : DENSE_ROWS_MAX;
            DENSE_PASSES[nr - 1][mt - 1](w + n * K, w + (n + nr - 1) * K, x + m0 * K, K, sums);
            for (int r = 0; r < nr; r++)
                for (int m = 0; m < mt; m++)
                    out[(m0 + m) * N + n + r] = to_bf(sums[r * DENSE_ROWS_MAX + m]);
        }
    }
    return 0;
}
#endif
#endif
