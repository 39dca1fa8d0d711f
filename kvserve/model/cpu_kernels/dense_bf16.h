/* bfloat16 weights (no quantization) times bfloat16 input rows, on AVX-512 BF16's dot
 * products (kvserve/model/cpu_kernels): every call of a bfloat16 model's linear layers,
 * decode steps and prefills alike (kvserve/model/quant/panel_linear.py).
 *
 * Why by hand: the fused decode (decode_layers.c) runs a step's layers as one C call, and
 * oneDNN's matmul (torch's F.linear) is not a C function it can call; F.linear also reorders
 * the weight on every call. The weight is packed once instead, much as oneDNN packs its own.
 *
 * Layout ("panels", panel_linear.pack_panels): the weight [N, K] as [N16 / 16][K2 / 2]
 * [16][2], N16 and K2 N and K rounded up to 16 and 2 with zeros: a panel is 16 output columns,
 * each 64-byte line their 16 pairs of weights for columns k, k + 1. One vdpbf16ps adds a
 * pair of input values (broadcast) times a line into 16 sums, one per output column: no
 * lane reductions. A tile is up to PANEL_TILE panels against up to PANEL_ROWS input rows
 * (24 sums in registers); each thread takes a run of whole panels and, for each PANEL_CHUNK
 * input rows (kept in L2), runs every tile of its panels against them: a weight line is read
 * from memory once per chunk, once per call for a decode step.
 *
 * Numbers: out[m, n] = bf16(float32 sum over k pairs in order of w[n, k] x[m, k] +
 * w[n, k + 1] x[m, k + 1]), one lane's chain whatever the number of rows or threads, so a
 * row's result never depends on the other rows of its call. The last bits differ from
 * oneDNN's (another order of the same float32 sums).
 */
#ifndef KVSERVE_DENSE_BF16_H
#define KVSERVE_DENSE_BF16_H

#define PANEL_ROWS 6 /* input rows a tile */
#define PANEL_TILE 4 /* panels a tile: 6 x 4 sums + 4 weight lines in 28 registers */
#define PANEL_CHUNK 96 /* input rows against which a thread runs all its panels, in L2 */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DENSE_BF16 1

/* torch's float -> bfloat16 of 16 sums: to nearest, ties to even. A NaN among them stays one
 * without torch's special case: it is quiet with its low 16 bits zero (the default NaN, or an
 * input's), so the rounding add never carries out of its mantissa. */
static inline __m256i round_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd);
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16));
}

/* out rows [0, MT) x panels [0, NP) of one tile: x rows of `ldx` values, `pairs` = K / 2 whole
 * pairs and an odd K's last column (`odd`), panels `stride` values apart, `cols` output
 * columns of the tile that exist (the rest are padding). */
static inline __attribute__((always_inline)) void panel_tile(
    const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t stride, int64_t pairs, int odd,
    uint16_t *out, int64_t ldo, int64_t cols, const int MT, const int NP) {
    __m512 acc[PANEL_ROWS][PANEL_TILE];
#pragma GCC unroll 24
    for (int i = 0; i < PANEL_ROWS * PANEL_TILE; i++)
        acc[i / PANEL_TILE][i % PANEL_TILE] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs + odd; p++) {
        __m512bh line[PANEL_TILE];
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) {
            const uint16_t *at = w + j * stride + p * 32;
            line[j] = (__m512bh)_mm512_loadu_si512(at);
        }
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) { /* an odd K's last pair: its one column, the other 0 */
            uint32_t two = x[m * ldx + 2 * p];
            if (p < pairs) memcpy(&two, x + m * ldx + 2 * p, sizeof two);
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)two);
#pragma GCC unroll 4
            for (int j = 0; j < NP; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], line[j], b);
        }
    }
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) {
            const int64_t left = cols - 16 * j;
            const __mmask16 keep = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1u);
            if (left > 0)
                _mm256_mask_storeu_epi16(out + m * ldo + 16 * j, keep, round_bf16x16(acc[m][j]));
        }
}

/* Each tile shape with its rows and panels as constants, so that its sums live in registers. */
#define PANEL_FN(MT, NP)                                                                         \
    static __attribute__((noinline)) void panel_tile_##MT##_##NP(                                \
        const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t stride, int64_t pairs,        \
        int odd, uint16_t *out, int64_t ldo, int64_t cols) {                                     \
        panel_tile(x, ldx, w, stride, pairs, odd, out, ldo, cols, MT, NP);                       \
    }
#define PANEL_FNS(MT) PANEL_FN(MT, 1) PANEL_FN(MT, 2) PANEL_FN(MT, 3) PANEL_FN(MT, 4)
PANEL_FNS(1) PANEL_FNS(2) PANEL_FNS(3) PANEL_FNS(4) PANEL_FNS(5) PANEL_FNS(6)

typedef void (*PanelFn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, int,
                        uint16_t *, int64_t, int64_t);
#define PANEL_ROW(MT)                                                                            \
    { panel_tile_##MT##_1, panel_tile_##MT##_2, panel_tile_##MT##_3, panel_tile_##MT##_4 }
static const PanelFn PANEL_FNS_BY_SHAPE[PANEL_ROWS][PANEL_TILE] = {
    PANEL_ROW(1), PANEL_ROW(2), PANEL_ROW(3), PANEL_ROW(4), PANEL_ROW(5), PANEL_ROW(6)};

/* out [M, N] = x [M, K] @ w.T, bfloat16, w in panels (above). Returns 0. */
static int dense_bf16_matmul(const uint16_t *x, uint16_t *out, int64_t M, int64_t N, int64_t K,
                             const uint16_t *panels, int threads) {
    const int64_t count = (N + 15) / 16, stride = (K + 1) / 2 * 32;
    threads = M * N * K >= 65536 && count > 1 ? threads : 1;
    threads = threads < count ? threads : (int)count;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int t = 0; t < threads; t++) {
        const int64_t first = count * t / threads, end = count * (t + 1) / threads; /* its panels */
        for (int64_t c0 = 0; c0 < M; c0 += PANEL_CHUNK) {
            const int64_t c1 = M - c0 < PANEL_CHUNK ? M : c0 + PANEL_CHUNK;
            for (int64_t p0 = first; p0 < end; p0 += PANEL_TILE) {
                const int np = end - p0 < PANEL_TILE ? (int)(end - p0) : PANEL_TILE;
                const int64_t cols = N - 16 * p0;
                for (int64_t m0 = c0; m0 < c1; m0 += PANEL_ROWS) {
                    const int mt = c1 - m0 < PANEL_ROWS ? (int)(c1 - m0) : PANEL_ROWS;
                    PANEL_FNS_BY_SHAPE[mt - 1][np - 1](x + m0 * K, K, panels + p0 * stride,
                                                       stride, K / 2, (int)(K & 1),
                                                       out + m0 * N + 16 * p0, N, cols);
                }
            }
        }
    }
    return 0;
}
#endif
#endif
