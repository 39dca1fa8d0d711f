/* float32 weights (no quantization) times float32 input rows, on AVX-512 or AVX2 FMA
 * (kvserve/model/cpu_kernels): every call of a float32 model's linear layers outside the
 * exact mode (kvserve/model/quant/panel_linear.py). quant_matmul.c includes it in both
 * of its vector paths.
 *
 * Why by hand: as dense_bf16.h. The fused decode (decode_layers.c) runs a step's layers as
 * one C call and oneDNN's matmul is not a function it can call, so a float32 decode step
 * ran its layers from Python; the weight is packed once, much as oneDNN packs its own.
 *
 * Layout (panel_linear.pack_panels): the weight [N, K] as [N16 / 16][K][16], N16 = N
 * rounded up to 16 with zero rows: a panel is 16 output columns, each 64-byte line their
 * weights for one input column. A tile is up to F32_ROWS input rows against F32_VECS
 * vectors of a line (AVX-512: 4 panels; AVX2: 1 panel, its 2 halves); threads, chunks of
 * input rows and tiles as in dense_bf16.h.
 *
 * Numbers: out[m, n] = fma(w[n, K-1], x[m, K-1], ... fma(w[n, 1], x[m, 1], w[n, 0] x[m, 0])),
 * one chain per output whatever the number of rows, the threads or the vector width: the
 * same bits on AVX-512 and AVX2, and a row's result never depends on its batch. The last
 * bits differ from oneDNN's and MKL's (another order of float32 sums).
 */
#ifndef KVSERVE_DENSE_F32_H
#define KVSERVE_DENSE_F32_H

#define F32_ROWS 6 /* input rows a tile */
#define F32_CHUNK 96 /* input rows against which a thread runs all its panels, in L2 */

#if PATH_AVX512
#define DENSE_F32 1
#define F32_VEC 16 /* lanes a vector */
#define F32_VECS 4 /* vectors a tile: 6 x 4 sums + 4 lines in 28 registers */
typedef __m512 F32Vec;
static inline F32Vec f32_load(const float *p) { return _mm512_loadu_ps(p); }
static inline F32Vec f32_broadcast(const float *p) { return _mm512_set1_ps(*p); }
static inline F32Vec f32_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline F32Vec f32_zero(void) { return _mm512_setzero_ps(); }
static inline void f32_store(float *p, F32Vec v, int64_t n) { /* n > 0 lanes */
    _mm512_mask_storeu_ps(p, n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1u), v);
}
#elif PATH_AVX2
#define DENSE_F32 1
#define F32_VEC 8
#define F32_VECS 2 /* one panel: 6 x 2 sums + 2 lines + the broadcast in 15 registers */
typedef __m256 F32Vec;
static inline F32Vec f32_load(const float *p) { return _mm256_loadu_ps(p); }
static inline F32Vec f32_broadcast(const float *p) { return _mm256_broadcast_ss(p); }
static inline F32Vec f32_fma(F32Vec a, F32Vec b, F32Vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline F32Vec f32_zero(void) { return _mm256_setzero_ps(); }
static inline void f32_store(float *p, F32Vec v, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 8 ? n : 8)), lanes), v);
}
#endif

#if DENSE_F32
#define F32_PANELS (F32_VECS * F32_VEC / 16) /* panels a tile */

/* out rows [0, MT) x vectors [0, NV) of one tile: x rows of `ldx` values, panels `stride`
 * floats apart, `cols` output columns of the tile that exist (the rest are padding). */
static inline __attribute__((always_inline)) void f32_tile(
    const float *x, int64_t ldx, const float *w, int64_t stride, int64_t K, float *out,
    int64_t ldo, int64_t cols, const int MT, const int NV) {
    F32Vec acc[F32_ROWS][F32_VECS];
#pragma GCC unroll 24
    for (int i = 0; i < F32_ROWS * F32_VECS; i++) acc[i / F32_VECS][i % F32_VECS] = f32_zero();
    for (int64_t k = 0; k < K; k++) {
        F32Vec line[F32_VECS];
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            line[j] = f32_load(w + (j * F32_VEC / 16) * stride + k * 16 + (j * F32_VEC) % 16);
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) {
            const F32Vec b = f32_broadcast(x + m * ldx + k);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) acc[m][j] = f32_fma(line[j], b, acc[m][j]);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            if (cols > j * F32_VEC)
                f32_store(out + m * ldo + j * F32_VEC, acc[m][j], cols - j * F32_VEC);
}

#define F32_FN(MT, NV)                                                                           \
    static __attribute__((noinline)) void f32_tile_##MT##_##NV(                                  \
        const float *x, int64_t ldx, const float *w, int64_t stride, int64_t K, float *out,      \
        int64_t ldo, int64_t cols) {                                                             \
        f32_tile(x, ldx, w, stride, K, out, ldo, cols, MT, NV);                                  \
    }
typedef void (*F32Fn)(const float *, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                      int64_t);
#if F32_VECS == 4
#define F32_FNS(MT) F32_FN(MT, 1) F32_FN(MT, 2) F32_FN(MT, 3) F32_FN(MT, 4)
#define F32_ROW(MT) {f32_tile_##MT##_1, f32_tile_##MT##_2, f32_tile_##MT##_3, f32_tile_##MT##_4}
#else
#define F32_FNS(MT) F32_FN(MT, 1) F32_FN(MT, 2)
#define F32_ROW(MT) {f32_tile_##MT##_1, f32_tile_##MT##_2}
#endif
F32_FNS(1) F32_FNS(2) F32_FNS(3) F32_FNS(4) F32_FNS(5) F32_FNS(6)
static const F32Fn F32_FNS_BY_SHAPE[F32_ROWS][F32_VECS] = {
    F32_ROW(1), F32_ROW(2), F32_ROW(3), F32_ROW(4), F32_ROW(5), F32_ROW(6)};

/* out [M, N] = x [M, K] @ w.T, float32, w in panels (above). Returns 0. */
static int dense_f32_matmul(const float *x, float *out, int64_t M, int64_t N, int64_t K,
                            const float *panels, int threads) {
    const int64_t count = (N + 15) / 16, stride = K * 16;
    threads = M * N * K >= 65536 && count > 1 ? threads : 1;
    threads = threads < count ? threads : (int)count;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t first = count * t / threads, end = count * (t + 1) / threads; /* its panels */
        for (int64_t c0 = 0; c0 < M; c0 += F32_CHUNK) {
            const int64_t c1 = M - c0 < F32_CHUNK ? M : c0 + F32_CHUNK;
            for (int64_t p0 = first; p0 < end; p0 += F32_PANELS) {
                const int np = end - p0 < F32_PANELS ? (int)(end - p0) : F32_PANELS;
                const int nv = np * 16 / F32_VEC;
                for (int64_t m0 = c0; m0 < c1; m0 += F32_ROWS) {
                    const int mt = c1 - m0 < F32_ROWS ? (int)(c1 - m0) : F32_ROWS;
                    F32_FNS_BY_SHAPE[mt - 1][nv - 1](x + m0 * K, K, panels + p0 * stride, stride,
                                                     K, out + m0 * N + 16 * p0, N, N - 16 * p0);
                }
            }
        }
    }
    return 0;
}
#endif
#endif
