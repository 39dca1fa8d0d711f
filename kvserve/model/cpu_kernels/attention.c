/* Attention on the CPU (kvserve/model/cpu_kernels): paged decode for bfloat16 and float32
 * caches, and a bfloat16 prefill's causal attention.
 *
 * Decode (decode_attention.h, included once per element type): one query token per
 * sequence reads its context in place through its slots. bfloat16 rounds the
 * probabilities to bfloat16 before they weight the values, as the flash kernel of
 * torch's SDPA does, so greedy tokens follow the path this replaces, and rounds the
 * output to bfloat16 (to nearest even); float32 keeps every product in float32.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bfloat16.h"

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 -> 16 float */
static inline __m512 load16_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

#define ELEM uint16_t
#define T(name) name##_bf16
#define TO_FLOAT(x) bf(x)
#define FROM_FLOAT(x) to_bf(x)
#define ROUND_WEIGHT(x) round_bf(x)
#define LOAD16(p) load16_bf16(p)
#include "decode_attention.h"
#undef ELEM
#undef T
#undef TO_FLOAT
#undef FROM_FLOAT
#undef ROUND_WEIGHT
#undef LOAD16

#define ELEM float
#define T(name) name##_f32
#define TO_FLOAT(x) (x)
#define FROM_FLOAT(x) (x)
#define ROUND_WEIGHT(x) (x)
#define LOAD16(p) _mm512_loadu_ps(p)
#include "decode_attention.h"


/* ---- a prefill's causal attention ---------------------------------------------------- */

#define QROWS 16 /* query positions per work item (bfloat16) */

/* The query heads a kv head serves, or -1 for a shape the prefills do not compute: head
 * sizes in multiples of 64 up to MAX_DIM, at most MAX_GROUP query heads a kv head, a
 * context that holds the new rows (all of it, for a fresh prefill without slots). */
static int prefill_group(int heads, int kv_heads, int dim, const int64_t *slots, int context,
                         int len) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || dim % 64 != 0 || dim > MAX_DIM) return -1;
    if (heads / kv_heads > MAX_GROUP) return -1;
    if (context < len || (slots == 0 && context != len)) return -1;
    return heads / kv_heads;
}

/* key j's row: through the context's slots, or the j-th row of a fresh prefill's own */
static inline int64_t key_row(const int64_t *slots, int j) { return slots ? slots[j] : j; }

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    float a[16];
    _mm512_storeu_ps(a, x);
    for (int i = 0; i < 16; i++) a[i] = expf(a[i]);
    return _mm512_loadu_ps(a);
}

/* lanes [0, visible) of a tile of 16 keys */
static inline __mmask16 visible_mask(int visible) {
    return (__mmask16)(visible >= 16 ? 0xFFFF : visible <= 0 ? 0 : ((1u << visible) - 1));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KEYS 16

/* causal attention of one sequence's `len` new queries, at positions context - len ..
 * context - 1, over its keys 0 .. context - 1: a fresh prefill's own rows (slots NULL, the
 * context is the new tokens), or a prefill after a cached prefix, its keys read in place
 * through the context's slots in the paged cache (k, v the flat caches; every new key
 * was written before). Query i sees the keys up to its own position. Work items: (kv head, block of 16 query rows), all the group's query heads; two passes
 * over the key tiles: the scores (dot products of bfloat16 pairs, float32 sums) and their
 * row maxima, then the weights exp(s - max) (sums in float32, the weights rounded to
 * bfloat16, as SDPA's flash kernel does) times the values. */
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                           int64_t k_stride, const uint16_t *v, int64_t v_stride,
                           const int64_t *slots, int context, uint16_t *out, int len,
                           int heads, int kv_heads, int dim, float scale, int num_threads) {
    int group = prefill_group(heads, kv_heads, dim, slots, context, len);
    if (group < 0) return -1;
    int start = context - len; /* query row i is position start + i */
    int blocks = (len + QROWS - 1) / QROWS;
    int pairs = dim / 2, chunks = dim / 16;
    int width = (context + KEYS - 1) / KEYS * KEYS; /* keys, padded to whole tiles */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        FLUSH_SUBNORMALS;
        float *scores = (float *)malloc(sizeof(float) * MAX_GROUP * QROWS * (size_t)(width > 0 ? width : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kv_heads * blocks; item++) {
            if (scores == NULL) continue;
            int h = item % kv_heads, qb = blocks - 1 - item / kv_heads; /* longest first */
            int r0 = qb * QROWS, rows = len - r0 < QROWS ? len - r0 : QROWS;
            int last_key = start + r0 + rows;
            uint32_t kt[MAX_DIM / 2][KEYS] __attribute__((aligned(64)));
            uint32_t vt[KEYS / 2][MAX_DIM] __attribute__((aligned(64)));
            __m512 vmax[MAX_GROUP * QROWS], vsum[MAX_GROUP * QROWS];
            for (int st = 0; st < group * rows; st++) vmax[st] = _mm512_set1_ps(-FLT_MAX);
            for (int k0 = 0; k0 < last_key; k0 += KEYS) {
                int nk = last_key - k0 < KEYS ? last_key - k0 : KEYS;
                for (int j = 0; j < KEYS; j++) {
                    const uint32_t *row = (const uint32_t *)(k + key_row(slots, k0 + (j < nk ? j : 0)) * k_stride + (int64_t)h * dim);
                    for (int p = 0; p < pairs; p++) kt[p][j] = j < nk ? row[p] : 0;
                }
                for (int g = 0; g < group; g++)
                    for (int i = 0; i < rows; i++) {
                        int row = start + r0 + i, st = g * rows + i;
                        if (row < k0) continue;
                        const uint32_t *qrow = (const uint32_t *)(q + (int64_t)(r0 + i) * q_stride + (int64_t)(h * group + g) * dim);
                        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
                        for (int p = 0; p < pairs; p += 4) {
                            s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_set1_epi32((int)qrow[p]), (__m512bh)_mm512_load_si512(kt[p]));
                            s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_set1_epi32((int)qrow[p + 1]), (__m512bh)_mm512_load_si512(kt[p + 1]));
                            s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_set1_epi32((int)qrow[p + 2]), (__m512bh)_mm512_load_si512(kt[p + 2]));
                            s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_set1_epi32((int)qrow[p + 3]), (__m512bh)_mm512_load_si512(kt[p + 3]));
                        }
                        __m512 s = _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)), _mm512_set1_ps(scale));
                        int visible = row - k0 + 1 < nk ? row - k0 + 1 : nk;
                        __mmask16 keep = visible_mask(visible);
                        s = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-FLT_MAX), s);
                        _mm512_storeu_ps(scores + (size_t)st * width + k0, s);
                        vmax[st] = _mm512_max_ps(vmax[st], s);
                    }
            }
            float top[MAX_GROUP * QROWS];
            __m512 acc[MAX_GROUP * QROWS][MAX_DIM / 16];
            for (int st = 0; st < group * rows; st++) {
                top[st] = _mm512_reduce_max_ps(vmax[st]);
                vsum[st] = _mm512_setzero_ps();
                for (int c = 0; c < chunks; c++) acc[st][c] = _mm512_setzero_ps();
            }
            for (int k0 = 0; k0 < last_key; k0 += KEYS) {
                int nk = last_key - k0 < KEYS ? last_key - k0 : KEYS;
                for (int jj = 0; jj < KEYS / 2; jj++) {
                    int a = 2 * jj, b = 2 * jj + 1;
                    const uint16_t *va = v + key_row(slots, k0 + (a < nk ? a : 0)) * v_stride + (int64_t)h * dim;
                    const uint16_t *vb = v + key_row(slots, k0 + (b < nk ? b : 0)) * v_stride + (int64_t)h * dim;
                    for (int d = 0; d < dim; d++)
                        vt[jj][d] = (uint32_t)(a < nk ? va[d] : 0) | ((uint32_t)(b < nk ? vb[d] : 0) << 16);
                }
                for (int g = 0; g < group; g++)
                    for (int i = 0; i < rows; i++) {
                        int row = start + r0 + i, st = g * rows + i;
                        if (row < k0) continue;
                        int visible = row - k0 + 1 < nk ? row - k0 + 1 : nk;
                        __mmask16 keep = visible_mask(visible);
                        __m512 s = _mm512_loadu_ps(scores + (size_t)st * width + k0);
                        __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(s, _mm512_set1_ps(top[st]))));
                        vsum[st] = _mm512_add_ps(vsum[st], e);
                        uint32_t pw[8];
                        _mm256_storeu_si256((__m256i *)pw, (__m256i)_mm512_cvtneps_pbh(e));
                        __m512 a0 = acc[st][0], a1 = acc[st][1], a2 = acc[st][2], a3 = acc[st][3];
                        for (int jj = 0; jj < (visible + 1) / 2; jj++) {
                            __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pw[jj]);
                            a0 = _mm512_dpbf16_ps(a0, pj, (__m512bh)_mm512_load_si512(&vt[jj][0]));
                            a1 = _mm512_dpbf16_ps(a1, pj, (__m512bh)_mm512_load_si512(&vt[jj][16]));
                            a2 = _mm512_dpbf16_ps(a2, pj, (__m512bh)_mm512_load_si512(&vt[jj][32]));
                            a3 = _mm512_dpbf16_ps(a3, pj, (__m512bh)_mm512_load_si512(&vt[jj][48]));
                            for (int c = 4; c < chunks; c++)
                                acc[st][c] = _mm512_dpbf16_ps(acc[st][c], pj, (__m512bh)_mm512_load_si512(&vt[jj][c * 16]));
                        }
                        acc[st][0] = a0, acc[st][1] = a1, acc[st][2] = a2, acc[st][3] = a3;
                    }
            }
            for (int g = 0; g < group; g++)
                for (int i = 0; i < rows; i++) {
                    int st = g * rows + i;
                    uint16_t *o = out + ((int64_t)(r0 + i) * heads + h * group + g) * dim;
                    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum[st]));
                    float tmp[MAX_DIM];
                    for (int c = 0; c < chunks; c++) _mm512_storeu_ps(tmp + c * 16, _mm512_mul_ps(acc[st][c], inv));
                    for (int d = 0; d < dim; d++) o[d] = to_bf(tmp[d]);
                }
        }
        free(scores);
        RESTORE_SUBNORMALS;
    }
    return failed ? -1 : 0;
}
#else
/* Without AVX-512 BF16 the caller keeps SDPA's flash kernel. */
int prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                           int64_t k_stride, const uint16_t *v, int64_t v_stride,
                           const int64_t *slots, int context, uint16_t *out, int len,
                           int heads, int kv_heads, int dim, float scale, int num_threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)slots, (void)context;
    (void)len, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)num_threads;
    return -1;
}
#endif

/* The float32 prefill: the same causal attention (work items of (kv head, 32 query
 * positions), exact row maxima in a first pass over the key tiles, then the weights
 * exp(s - max) times the values), every product and sum in float32, nothing rounded.
 * Register tiles: 4 score rows x 32 keys for the scores, 4 rows x 64 value dims for the
 * weighted sums (8 and 16 independent FMA chains: the two FMA ports stay busy). */
#if defined(__AVX512F__)
#define TILE_ROWS 4
#define TILE_KEYS 32
#define F32_QROWS 32 /* query positions per work item: the key tiles' transpose serves more */

/* exp(x) of 16 floats, within about 2 ulp: x = n ln2 + r (Cody-Waite), |r| <= ln2 / 2,
 * exp(r) by its degree-6 Taylor polynomial (error below 2^-23), times 2^n (scalef); about
 * a third of glibc's vector expf's time. Far below the maximum (x < -87) it is 0. */
static inline __m512 exp16_f32(__m512 x) {
    const __m512 floor_x = _mm512_set1_ps(-87.0f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, floor_x, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor_x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(p, n));
}

int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, const int64_t *slots, int context,
                          float *out, int len, int heads, int kv_heads, int dim, float scale,
                          int num_threads) {
    int group = prefill_group(heads, kv_heads, dim, slots, context, len);
    if (group < 0) return -1;
    int start = context - len; /* query row i is position start + i */
    int blocks = (len + F32_QROWS - 1) / F32_QROWS;
    int width = (context + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        FLUSH_SUBNORMALS;
        float *scores = (float *)malloc(sizeof(float) * MAX_GROUP * F32_QROWS * (size_t)(width > 0 ? width : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < kv_heads * blocks; item++) {
            if (scores == NULL) continue;
            int h = item % kv_heads, qb = blocks - 1 - item / kv_heads; /* longest first */
            int r0 = qb * F32_QROWS, rows = len - r0 < F32_QROWS ? len - r0 : F32_QROWS;
            int last_key = start + r0 + rows, count = group * rows; /* score rows: (g, i) */
            int padded = (count + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS; /* whole tiles */
            const float *qrow[MAX_GROUP * F32_QROWS];
            int position[MAX_GROUP * F32_QROWS]; /* -1: a padding row, which sees no key */
            float top[MAX_GROUP * F32_QROWS], total[MAX_GROUP * F32_QROWS];
            for (int st = 0; st < padded; st++) {
                int g = st / rows, i = st % rows, real = st < count;
                qrow[st] = real ? q + (int64_t)(r0 + i) * q_stride + (int64_t)(h * group + g) * dim : q;
                position[st] = real ? start + r0 + i : -1;
                top[st] = -FLT_MAX, total[st] = 0.0f;
            }
            float kt[MAX_DIM][TILE_KEYS] __attribute__((aligned(64)));
            for (int k0 = 0; k0 < last_key; k0 += TILE_KEYS) {
                int nk = last_key - k0 < TILE_KEYS ? last_key - k0 : TILE_KEYS;
                for (int j = 0; j < TILE_KEYS; j++) {
                    const float *row = k + key_row(slots, k0 + (j < nk ? j : 0)) * k_stride + (int64_t)h * dim;
                    for (int d = 0; d < dim; d++) kt[d][j] = j < nk ? row[d] : 0.0f;
                }
                for (int s0 = 0; s0 < count; s0 += TILE_ROWS) {
                    __m512 lo[TILE_ROWS], hi[TILE_ROWS];
                    for (int r = 0; r < TILE_ROWS; r++) lo[r] = hi[r] = _mm512_setzero_ps();
                    for (int d = 0; d < dim; d++) {
                        __m512 k_lo = _mm512_load_ps(&kt[d][0]), k_hi = _mm512_load_ps(&kt[d][16]);
                        for (int r = 0; r < TILE_ROWS; r++) {
                            __m512 qd = _mm512_set1_ps(qrow[s0 + r][d]);
                            lo[r] = _mm512_fmadd_ps(qd, k_lo, lo[r]);
                            hi[r] = _mm512_fmadd_ps(qd, k_hi, hi[r]);
                        }
                    }
                    for (int r = 0; r < TILE_ROWS && s0 + r < count; r++) {
                        int st = s0 + r, visible = position[st] - k0 + 1 < nk ? position[st] - k0 + 1 : nk;
                        __m512 a = _mm512_mask_blend_ps(visible_mask(visible), _mm512_set1_ps(-FLT_MAX), _mm512_mul_ps(lo[r], _mm512_set1_ps(scale)));
                        __m512 b = _mm512_mask_blend_ps(visible_mask(visible - 16), _mm512_set1_ps(-FLT_MAX), _mm512_mul_ps(hi[r], _mm512_set1_ps(scale)));
                        _mm512_storeu_ps(scores + (size_t)st * width + k0, a);
                        _mm512_storeu_ps(scores + (size_t)st * width + k0 + 16, b);
                        float m = _mm512_reduce_max_ps(_mm512_max_ps(a, b));
                        if (m > top[st]) top[st] = m;
                    }
                }
            }
            for (int st = 0; st < padded; st++) { /* the weights (0 past a row's position) */
                float *p = scores + (size_t)st * width;
                int visible = position[st] + 1;
                __m512 sum = _mm512_setzero_ps(), m = _mm512_set1_ps(top[st]);
                for (int t = 0; t < last_key; t += 16) {
                    __m512 e = _mm512_setzero_ps();
                    if (t < visible)
                        e = _mm512_maskz_mov_ps(visible_mask(visible - t), exp16_f32(_mm512_sub_ps(_mm512_loadu_ps(p + t), m)));
                    _mm512_storeu_ps(p + t, e);
                    sum = _mm512_add_ps(sum, e);
                }
                total[st] = _mm512_reduce_add_ps(sum);
            }
            for (int s0 = 0; s0 < count; s0 += TILE_ROWS) {
                int tile = count - s0 < TILE_ROWS ? count - s0 : TILE_ROWS, keys = 0;
                for (int r = 0; r < tile; r++)
                    if (position[s0 + r] + 1 > keys) keys = position[s0 + r] + 1;
                const float *weights[TILE_ROWS];
                for (int r = 0; r < TILE_ROWS; r++) weights[r] = scores + (size_t)(s0 + r) * width;
                for (int d0 = 0; d0 < dim; d0 += 64) {
                    __m512 sums[TILE_ROWS][4];
                    for (int r = 0; r < TILE_ROWS; r++)
                        for (int c = 0; c < 4; c++) sums[r][c] = _mm512_setzero_ps();
                    for (int j = 0; j < keys; j++) {
                        const float *vj = v + key_row(slots, j) * v_stride + (int64_t)h * dim + d0;
                        __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16);
                        __m512 v2 = _mm512_loadu_ps(vj + 32), v3 = _mm512_loadu_ps(vj + 48);
                        for (int r = 0; r < TILE_ROWS; r++) {
                            __m512 pw = _mm512_set1_ps(weights[r][j]);
                            sums[r][0] = _mm512_fmadd_ps(pw, v0, sums[r][0]);
                            sums[r][1] = _mm512_fmadd_ps(pw, v1, sums[r][1]);
                            sums[r][2] = _mm512_fmadd_ps(pw, v2, sums[r][2]);
                            sums[r][3] = _mm512_fmadd_ps(pw, v3, sums[r][3]);
                        }
                    }
                    for (int r = 0; r < tile; r++) {
                        int st = s0 + r, g = st / rows, i = st % rows;
                        float *o = out + ((int64_t)(r0 + i) * heads + h * group + g) * dim + d0;
                        __m512 inv = _mm512_set1_ps(1.0f / total[st]);
                        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(sums[r][c], inv));
                    }
                }
            }
        }
        free(scores);
        RESTORE_SUBNORMALS;
    }
    return failed ? -1 : 0;
}
#else
/* Without AVX-512 the caller keeps SDPA's flash kernel. */
int prefill_attention_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                          const float *v, int64_t v_stride, const int64_t *slots, int context,
                          float *out, int len, int heads, int kv_heads, int dim, float scale,
                          int num_threads) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)out;
    (void)slots, (void)context;
    (void)len, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)num_threads;
    return -1;
}
#endif
