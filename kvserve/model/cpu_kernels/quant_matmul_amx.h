/* quant_matmul.c's calls of AMX_ROWS input rows or more on AMX tiles (Intel's Advanced Matrix
 * Extensions, Sapphire Rapids and later): bfloat16 products summed in float32, 16 x 16 x 32 a
 * tile instruction (tdpbf16ps), many times the multiply-adds per cycle of AVX-512 VNNI.
 *
 * Why bfloat16 and not the tiles' int8: a Q4 block's 32 columns have their own scale, so int8
 * tiles must leave the tile unit after every 32 columns to be scaled in float32; measured, that
 * traffic cost as much as the tiles saved. Here each thread dequantizes 16 weight rows at a
 * time into bfloat16 (code * scale + offset in float32, rounded once: the numbers the dense
 * path of quant_linear.py multiplies in bfloat16), a window of 512 columns just before its
 * tile instructions run, and the sums stay in the tiles for the whole row. The input is
 * rounded to bfloat16 instead of int8 blocks (8 significant bits either way, measured about
 * half the integer path's error). So these rows' last bits differ from the integer path's;
 * within the tiles a row's result still does not depend on the rows beside it.
 *
 * Linux hands out the tiles' state only on request (arch_prctl): where that fails, the calls
 * stay on AVX-512 VNNI. */
#include "amx_tiles.h"
#include "quant_dequantize.h"

#define AMX_ROWS 10 /* input rows from which a call runs on tiles (8: as fast as VNNI) */
#define PANEL 16    /* rows of a tile: weight rows of a panel, input rows of a group */
#define STEP 32     /* columns a tile instruction sums (bfloat16 pairs of a 64-byte row) */
#define CHUNK_GROUPS 8 /* input groups a weight panel meets before the next panel: their
                          bfloat16 rows stay in L2 (more than 128 rows dequantize again) */

/* on 1: ask for the tiles (once a process; KVSERVE_AMX=0 keeps them off, quant_matmul.py),
 * 0: every call on AVX-512 VNNI. Returns the input rows from which calls run on tiles, or 0. */
int quant_matmul_tiles(int on) {
    amx_state = on ? 0 : -1;
    return on && amx_granted() ? AMX_ROWS : 0;
}

/* The input in the packed column order (quant_dequantize.h's), bfloat16, as tiles 5-7 take
 * it: per group of 16 rows and step of 32 columns, 16 rows of 64 bytes (row d: columns 2d and
 * 2d + 1 of each input row); zeros past row M. Whole windows are gathered a block's 4 columns
 * at a time and scattered a column pair at a time. */
static uint16_t *tile_input(const void *x, int x_bf16, int64_t M, int64_t K, int threads) {
    const int64_t groups = (M + PANEL - 1) / PANEL, steps = K / STEP, blocks = K / BLOCK;
    uint16_t *in = aligned_alloc(64, (size_t)(groups * steps) * 1024);
    if (in == NULL) return NULL;
    memset(in, 0, (size_t)(groups * steps) * 1024);
    /* a column pair's dword in its step; 8 blocks' 4 columns (bfloat16), 4 blocks' (float) */
    const __m512i pairs = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176,
                                            192, 208, 224, 240);
    const __m512i quads = _mm512_setr_epi64(0, 64, 128, 192, 256, 320, 384, 448);
    const __m512i pairs4 = _mm512_setr_epi64(0, 8, 128, 136, 256, 264, 384, 392);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t m = 0; m < M; m++) {
        uint16_t *group = in + (m / PANEL) * steps * 512 + (m % PANEL) * 2;
        for (int64_t w = 0; w * WINDOW < blocks; w++) {
            const int width = 4 * window_blocks(blocks, w);
            for (int t = 0; t < STEPS; t++) {
                const int64_t first = w * WINDOW * BLOCK + t * width; /* its first position */
                const int64_t column = m * K + w * WINDOW * BLOCK + 4 * t;
                if (width < 64) { /* a short last window */
                    for (int p = 0; p < width; p++) {
                        const int64_t at = column + (p / 4) * BLOCK + p % 4, i = first + p;
                        group[(i / STEP) * 512 + (i % STEP) / 2 * 32 + i % 2] =
                            x_bf16 ? ((const uint16_t *)x)[at] : to_bf(((const float *)x)[at]);
                    }
                    continue;
                }
                __m512i half[2]; /* blocks 0-7 and 8-15: 4 columns each, 32 bfloat16 */
                for (int h = 0; h < 2; h++) {
                    if (x_bf16) {
                        const uint16_t *base = (const uint16_t *)x + column + 8 * h * BLOCK;
                        half[h] = _mm512_i64gather_epi64(quads, base, 1);
                    } else {
                        const float *base = (const float *)x + column + 8 * h * BLOCK;
                        const __m512d lo = _mm512_i64gather_pd(pairs4, base, 1);
                        const __m512d hi = _mm512_i64gather_pd(pairs4, base + 4 * BLOCK, 1);
                        half[h] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_castpd_ps(hi),
                                                               _mm512_castpd_ps(lo));
                    }
                }
                for (int h = 0; h < 2; h++)
                    _mm512_i32scatter_epi32(group + (first / STEP + h) * 512, pairs, half[h], 4);
            }
        }
    }
    return in;
}

/* Tile C += weight rows (tile 4) x input group G's step s (tile X). */
#define GROUP_STEP(C, X, G)                                                                    \
    do {                                                                                       \
        _tile_loadd(X, in + ((g0 + (G)) * steps + s) * 512, 64);                               \
        _tile_dpbf16ps(C, 4, X);                                                               \
    } while (0)

/* 16 blocks' scales or offsets from block b, float32 or float16 (f16) */
static inline __m512 factors16(const void *p, int64_t b, int f16) {
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + b)));
    return _mm512_loadu_ps((const float *)p + b);
}

/* Window w of a weight row to bfloat16 (dequantize_row's numbers: code * scale + offset in
 * float32, rounded once), 64 columns at a time, as tile 4 takes them: the window's step j of 32
 * columns at out + j * 512 (out: the row's place in the first). */
static void bf16_window(const uint8_t *row, int bits, const void *s, const void *o, int f16,
                        int64_t blocks, int64_t w, uint16_t *out) {
    if (window_blocks(blocks, w) < WINDOW) { /* a short last window */
        uint16_t values[WINDOW * BLOCK];
        dequantize_window(row, bits, s, o, f16, blocks, w, values, 1);
        for (int i = 0; i < window_blocks(blocks, w) * BLOCK; i += STEP)
            memcpy(out + i / STEP * PANEL * STEP, values + i, STEP * 2);
        return;
    }
    const int64_t window_bytes = bits == 4 ? 256 : 512; /* the row's next window, into L1 */
    for (int64_t line = 0; (w + 1) * WINDOW < blocks && line < window_bytes; line += 64)
        _mm_prefetch((const char *)row + (w + 1) * window_bytes + line, _MM_HINT_T0);
    __m512 scale[4], offset[4]; /* positions 16j.. : blocks 4j..4j+3, four columns each */
    if (bits == 4) {
        const __m512 sv = factors16(s, w * WINDOW, f16);
        const __m512 ov = o ? factors16(o, w * WINDOW, f16)
                            : _mm512_mul_ps(sv, _mm512_set1_ps(-8.0f));
        const __m512i four = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (int j = 0; j < 4; j++) {
            const __m512i at = _mm512_add_epi32(four, _mm512_set1_epi32(4 * j));
            scale[j] = _mm512_permutexvar_ps(at, sv), offset[j] = _mm512_permutexvar_ps(at, ov);
        }
    } else {
        const float row_scale = *(const float *)s;
        for (int j = 0; j < 4; j++)
            scale[j] = _mm512_set1_ps(row_scale), offset[j] = _mm512_set1_ps(-128.0f * row_scale);
    }
    for (int t = 0; t < STEPS; t++) {
        __m128i code[4];
        if (bits == 4) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(row + w * 256 + t * 32));
            const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f));
            code[0] = _mm256_castsi256_si128(lo), code[1] = _mm256_extracti128_si256(lo, 1);
            code[2] = _mm256_castsi256_si128(hi), code[3] = _mm256_extracti128_si256(hi, 1);
        } else {
            for (int j = 0; j < 4; j++)
                code[j] = _mm_loadu_si128((const __m128i *)(row + w * 512 + t * 64 + 16 * j));
        }
        __m512 value[4];
        for (int j = 0; j < 4; j++)
            value[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(code[j])), scale[j],
                                       offset[j]);
        uint16_t *at = out + 2 * t * PANEL * STEP;
        _mm512_store_si512(at, (__m512i)_mm512_cvtne2ps_pbh(value[1], value[0]));
        _mm512_store_si512(at + PANEL * STEP, (__m512i)_mm512_cvtne2ps_pbh(value[3], value[2]));
    }
}

/* out [M, N] for weight rows n0.. (`rows` of them): up to four input groups at a time, each
 * group's sums in its own tile over all of K. The first pass dequantizes a window of the 16
 * weight rows into `panel` (K / 32 steps of 16 x 32 bfloat16) just before its steps run, while
 * it is in L1; passes after it (more than 64 input rows) read the panel again. */
static void panel_rows(const uint8_t *codes, int bits, const void *scales, const void *offsets,
                       int f16, const uint16_t *in, int64_t M, int64_t N, int64_t K, int64_t n0,
                       int64_t rows, int64_t first, int64_t groups, void *out, int out_bf16,
                       uint16_t *panel) {
    const int64_t steps = K / STEP, blocks = K / BLOCK;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    const int64_t row_scales = bits == 4 ? blocks * (f16 ? 2 : 4) : 4;
    float sums[4][PANEL * PANEL] __attribute__((aligned(64)));
    for (int64_t s = 0; rows < PANEL && s < steps; s++) /* rows past the last: zeros */
        memset(panel + (s * PANEL + rows) * STEP, 0, (size_t)((PANEL - rows) * STEP) * 2);
    for (int64_t g0 = first; g0 < groups; g0 += 4) {
        const int64_t n = groups - g0 < 4 ? groups - g0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t w = 0; w * WINDOW < blocks; w++) {
            for (int64_t r = 0; g0 == first && r < rows; r++) {
                const int64_t at = n0 + r;
                const void *o = offsets && bits == 4 ? (const char *)offsets + at * row_scales
                                                     : NULL;
                bf16_window(codes + at * row_bytes, bits, (const char *)scales + at * row_scales, o,
                            f16, blocks, w, panel + (w * WINDOW * PANEL + r) * STEP);
            }
            for (int64_t s = w * WINDOW; s < steps && s < (w + 1) * WINDOW; s++) {
                _tile_loadd(4, panel + s * PANEL * STEP, 64);
                switch (n) {
                default: GROUP_STEP(3, 5, 3); /* fall through */
                case 3: GROUP_STEP(2, 6, 2); /* fall through */
                case 2: GROUP_STEP(1, 7, 1); /* fall through */
                case 1: GROUP_STEP(0, 5, 0);
                }
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        const __mmask16 valid = rows == PANEL ? 0xffff : (__mmask16)((1u << rows) - 1u);
        const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160,
                                                 176, 192, 208, 224, 240); /* a tile column */
        for (int64_t g = 0; g < n; g++) /* each input row's 16 sums, a column of the tile */
            for (int64_t m = (g0 + g) * PANEL; m < M && m < (g0 + g + 1) * PANEL; m++) {
                const __m512 v = _mm512_i32gather_ps(column, sums[g] + m % PANEL, 4);
                if (out_bf16)
                    _mm256_mask_storeu_epi16((uint16_t *)out + m * N + n0, valid,
                                             (__m256i)_mm512_cvtneps_pbh(v));
                else
                    _mm512_mask_storeu_ps((float *)out + m * N + n0, valid, v);
            }
    }
}

/* The whole call on tiles: 0, or -2 when out of memory. */
static int tile_matmul(const void *x, int x_bf16, const uint8_t *codes, int bits,
                       const void *scales, const void *offsets, int f16, int64_t M, int64_t N,
                       int64_t K, void *out, int threads) {
    uint16_t *in = tile_input(x, x_bf16, M, K, threads);
    if (in == NULL) return -2;
    const int64_t groups = (M + PANEL - 1) / PANEL;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *panel = aligned_alloc(64, (size_t)(K * PANEL * 2));
        if (panel != NULL) configure_tiles();
        for (int64_t first = 0; first < groups; first += CHUNK_GROUPS) {
            const int64_t last = groups - first < CHUNK_GROUPS ? groups : first + CHUNK_GROUPS;
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < N; n0 += PANEL) {
                if (panel != NULL)
                    panel_rows(codes, bits, scales, offsets, f16, in, M, N, K, n0,
                               N - n0 < PANEL ? N - n0 : PANEL, first, last, out, x_bf16, panel);
                else
#pragma omp atomic write
                    failed = 1;
            }
        }
        if (panel != NULL) _tile_release();
        free(panel);
    }
    free(in);
    return failed ? -2 : 0;
}
