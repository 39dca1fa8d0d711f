/* A prefill's inner pass on AVX-512 VNNI (included by quant_matmul.c): two unpacked 4-bit
 * weight rows (a byte a code: unpack_row's) against up to PAIR_ROWS input rows.
 *
 * Why: one weight row against two input rows loads one and a half vectors per VNNI
 * instruction, and the loads, not the multiply-adds, bound a prefill's matmuls on a CPU
 * without AMX tiles (an AMD EPYC, Zen 4: one 512-bit VNNI instruction a cycle). Two weight
 * rows against four input rows load six vectors per eight instructions.
 *
 * Numbers: every (input row, weight row) pair gets one_window's integer sums (exact, in
 * any order) and its float steps in its order, so the bits are those of the one-row path,
 * and a row's result still never depends on its batch.
 */
#ifndef KVSERVE_QUANT_MATMUL_PAIRS_H
#define KVSERVE_QUANT_MATMUL_PAIRS_H

#define PAIR_ROWS 4 /* input rows a pass (8 integer and 16 float sums in registers) */

static inline __attribute__((always_inline)) void pair_window(
    const uint8_t *const wc[2], const void *const scales[2], const void *const offsets[2],
    int f16, const Quantized *q, int64_t w, const int half, int64_t m0, const int mt,
    __m512 acc[2][PAIR_ROWS], __m512 off[2][PAIR_ROWS]) {
    __m512i dot[2][PAIR_ROWS];
    for (int m = 0; m < mt; m++) dot[0][m] = dot[1][m] = _mm512_setzero_si512();
    for (int t = 0; t < STEPS; t++) {
        const __m512i u0 = codes8(wc[0] + t * 8 * half, half);
        const __m512i u1 = codes8(wc[1] + t * 8 * half, half);
        for (int m = 0; m < mt; m++) {
            const int8_t *xq = q->xq + ((m0 + m) * q->windows + w) * (STEPS * 64) + t * 64;
            const __m512i x = _mm512_load_si512(xq);
            dot[0][m] = _mm512_dpbusd_epi32(dot[0][m], u0, x);
            dot[1][m] = _mm512_dpbusd_epi32(dot[1][m], u1, x);
        }
    }
    for (int r = 0; r < 2; r++) { /* one_window's float steps, pair by pair */
        const __m512 s = lanes16(scales[r], w * WINDOW, half, f16);
        const __m512 o = offsets[r] ? lanes16(offsets[r], w * WINDOW, half, f16)
                                    : _mm512_mul_ps(s, _mm512_set1_ps(-8.0f));
        for (int m = 0; m < mt; m++) {
            const int64_t at = ((m0 + m) * q->windows + w) * WINDOW;
            const __m512 sd = _mm512_mul_ps(s, _mm512_load_ps(q->dx + at));
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][m]), sd, acc[r][m]);
            off[r][m] = _mm512_fmadd_ps(o, _mm512_load_ps(q->xs + at), off[r][m]);
        }
    }
}

/* res[r * PAIR_ROWS + m]: weight row r against input row m0 + m, over the whole row */
static inline __attribute__((always_inline)) void pair_rows(
    const uint8_t *const codes[2], const void *const scales[2], const void *const offsets[2],
    int f16, const Quantized *q, int64_t m0, const int mt, int64_t K, float *res) {
    const int64_t blocks = K / BLOCK, whole = blocks / WINDOW;
    __m512 acc[2][PAIR_ROWS], off[2][PAIR_ROWS];
    for (int m = 0; m < mt; m++)
        acc[0][m] = acc[1][m] = off[0][m] = off[1][m] = _mm512_setzero_ps();
    for (int64_t w = 0; w < whole; w++) {
        const uint8_t *const at[2] = {codes[0] + w * 512, codes[1] + w * 512};
        pair_window(at, scales, offsets, f16, q, w, 8, m0, mt, acc, off);
    }
    if (whole < q->windows) {
        const uint8_t *const at[2] = {codes[0] + whole * 512, codes[1] + whole * 512};
        pair_window(at, scales, offsets, f16, q, whole, window_blocks(blocks, whole) / 2, m0,
                    mt, acc, off);
    }
    for (int r = 0; r < 2; r++)
        for (int m = 0; m < mt; m++)
            res[r * PAIR_ROWS + m] = _mm512_reduce_add_ps(acc[r][m]) + _mm512_reduce_add_ps(off[r][m]);
}

#define PAIR(MT)                                                                              \
    static __attribute__((noinline)) void pair_rows_##MT(                                     \
        const uint8_t *const codes[2], const void *const scales[2],                           \
        const void *const offsets[2], int f16, const Quantized *q, int64_t m0, int64_t K,     \
        float *res) {                                                                         \
        pair_rows(codes, scales, offsets, f16, q, m0, MT, K, res);                            \
    }
PAIR(1) PAIR(2) PAIR(3) PAIR(4)

typedef void (*PairFn)(const uint8_t *const[2], const void *const[2], const void *const[2], int,
                       const Quantized *, int64_t, int64_t, float *);
static const PairFn PAIRS[PAIR_ROWS] = {pair_rows_1, pair_rows_2, pair_rows_3, pair_rows_4};


/* Weight rows n and n + 1 (unpacked, `stride` bytes apart) against input rows [m1, m_end):
 * their columns of out. */
static void pair_pass(const uint8_t *row, int64_t stride, const void *scales,
                      const void *offsets, int64_t row_scales, int f16, const Quantized *q,
                      int64_t n, int64_t m1, int64_t m_end, int64_t K, int64_t N, void *out,
                      int x_bf16) {
    const uint8_t *const codes[2] = {row, row + stride};
    const void *const s[2] = {(const char *)scales + n * row_scales,
                              (const char *)scales + (n + 1) * row_scales};
    const void *const o[2] = {offsets ? (const char *)offsets + n * row_scales : NULL,
                              offsets ? (const char *)offsets + (n + 1) * row_scales : NULL};
    float res[2 * PAIR_ROWS];
    for (int64_t m0 = m1; m0 < m_end; m0 += PAIR_ROWS) {
        const int mt = m_end - m0 < PAIR_ROWS ? (int)(m_end - m0) : PAIR_ROWS;
        PAIRS[mt - 1](codes, s, o, f16, q, m0, K, res);
        for (int r = 0; r < 2; r++)
            for (int m = 0; m < mt; m++) {
                const int64_t at = (m0 + m) * N + n + r;
                if (x_bf16) ((uint16_t *)out)[at] = to_bf(res[r * PAIR_ROWS + m]);
                else ((float *)out)[at] = res[r * PAIR_ROWS + m];
            }
    }
}

#endif
