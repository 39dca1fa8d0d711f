/* Attention for bfloat16 on the CPU (kvserve/model/cpu_kernels): paged decode, and a fresh
 * prefill's causal attention.
 *
 * Decode:
 * One query token per sequence reads its context straight from the paged K/V
 * cache through its slot list: no gathered copy of the context, no padding.
 * Work items are (sequence, kv head): the group's query heads share every key
 * and value row they read. Scores, the softmax and the sums are float32; the
 * probabilities are rounded to bfloat16 before they weight the values, as the
 * flash kernel of torch's SDPA does, so greedy tokens follow the path this
 * replaces; the output is rounded to bfloat16 (to nearest even).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bfloat16.h"

#define LANES 16
#define MAX_GROUP 16
#define MAX_DIM 256

static inline void row_to_float(const uint16_t *src, float *dst, int dim) {
    for (int d = 0; d < dim; d++) dst[d] = bf(src[d]);
}

/* dot product in LANES independent partial sums (vectorizes without -ffast-math) */
static inline float dot(const float *a, const float *b, int dim) {
    float part[LANES] = {0};
    for (int d = 0; d < dim; d += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[d + j] * b[d + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += part[j];
    return sum;
}


#if defined(__AVX512F__)
#include <immintrin.h>
#define TILE 16

/* 16 vectors -> one vector of their 16 sums, lane i = sum of v[i] (a transpose tree:
 * 45 instructions for 16 horizontal sums instead of 16 x 8) */
static inline __m512 sum16(const __m512 *v) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* 16 bfloat16 -> 16 float */
static inline __m512 load16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* The tile's scores for query head g: lane i = q_g . k(t0 + i), for count <= 16 tokens
 * (dim a multiple of 16; inlined with a constant dim, the 16 sums stay in registers) */
static inline __attribute__((always_inline)) __m512 tile_scores(
    const float *query, const uint16_t *const *keys, int count, int dim) {
    __m512 acc[TILE];
    for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
    for (int i = 0; i < count; i++)
        for (int d = 0; d < dim; d += 16)
            acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(query + d), load16(keys[i] + d), acc[i]);
    return sum16(acc);
}

/* out += sum over the tile's tokens of p(t) * v(t) (dim <= MAX_DIM, a multiple of 16) */
static inline __attribute__((always_inline)) void tile_values(
    float *out, const float *p, const uint16_t *const *values, int count, int dim) {
    for (int d = 0; d < dim; d += 64) {
        __m512 acc[4];
        int width = dim - d < 64 ? (dim - d) / 16 : 4;
        for (int j = 0; j < width; j++) acc[j] = _mm512_loadu_ps(out + d + 16 * j);
        for (int i = 0; i < count; i++) {
            __m512 weight = _mm512_set1_ps(p[i]);
            for (int j = 0; j < width; j++)
                acc[j] = _mm512_fmadd_ps(weight, load16(values[i] + d + 16 * j), acc[j]);
        }
        for (int j = 0; j < width; j++) _mm512_storeu_ps(out + d + 16 * j, acc[j]);
    }
}

static inline __attribute__((always_inline)) void attend_avx512(
    const float (*query)[MAX_DIM], float (*acc)[MAX_DIM], float *scores, const uint16_t *k,
    const uint16_t *v, const int64_t *row, int n, int kv_heads, int h, int group, int dim) {
    const uint16_t *rows[TILE];
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int count = n - t0 < TILE ? n - t0 : TILE;
        for (int i = 0; i < count; i++) rows[i] = k + (row[t0 + i] * kv_heads + h) * dim;
        for (int g = 0; g < group; g++) {
            float sums[TILE];
            _mm512_storeu_ps(sums, tile_scores(query[g], rows, count, dim));
            for (int i = 0; i < count; i++) scores[g * n + t0 + i] = sums[i];
        }
    }
}

static inline __attribute__((always_inline)) void values_avx512(
    float (*acc)[MAX_DIM], const float *scores, const uint16_t *v, const int64_t *row, int n,
    int kv_heads, int h, int group, int dim) {
    const uint16_t *rows[TILE];
    for (int t0 = 0; t0 < n; t0 += TILE) {
        int count = n - t0 < TILE ? n - t0 : TILE;
        for (int i = 0; i < count; i++) rows[i] = v + (row[t0 + i] * kv_heads + h) * dim;
        for (int g = 0; g < group; g++) tile_values(acc[g], scores + g * n + t0, rows, count, dim);
    }
}

/* the two passes with dim a compile-time constant where it is a common head size */
static void scores_pass(const float (*query)[MAX_DIM], float (*acc)[MAX_DIM], float *scores,
                        const uint16_t *k, const int64_t *row, int n, int kv_heads, int h,
                        int group, int dim) {
    if (dim == 64) attend_avx512(query, acc, scores, k, 0, row, n, kv_heads, h, group, 64);
    else if (dim == 128) attend_avx512(query, acc, scores, k, 0, row, n, kv_heads, h, group, 128);
    else attend_avx512(query, acc, scores, k, 0, row, n, kv_heads, h, group, dim);
}

static void values_pass(float (*acc)[MAX_DIM], const float *scores, const uint16_t *v,
                        const int64_t *row, int n, int kv_heads, int h, int group, int dim) {
    if (dim == 64) values_avx512(acc, scores, v, row, n, kv_heads, h, group, 64);
    else if (dim == 128) values_avx512(acc, scores, v, row, n, kv_heads, h, group, 128);
    else values_avx512(acc, scores, v, row, n, kv_heads, h, group, dim);
}
#endif

/* Returns 0, or -1 when a shape is outside what the kernel handles (nothing written). */
int decode_attention_bf16(
    const uint16_t *q,      /* [batch, heads, dim] */
    const uint16_t *k,      /* [slots, kv_heads, dim]: the flat cache */
    const uint16_t *v,
    const int64_t *slots,   /* [batch, width]: each row's context slots */
    const int32_t *bounds,  /* [batch, 2]: the row's keys are slots[begin:end] */
    uint16_t *out,          /* [batch, heads, dim] */
    int batch, int heads, int kv_heads, int dim, int width,
    float scale, float softcap, int num_threads)
{
    if (kv_heads <= 0 || heads % kv_heads != 0) return -1;
    int group = heads / kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || dim % LANES != 0) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        FLUSH_SUBNORMALS;
        float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)(width > 0 ? width : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < batch * kv_heads; item++) {
            if (scores == NULL) continue;
            int b = item / kv_heads, h = item % kv_heads;
            int begin = bounds[2 * b], n = bounds[2 * b + 1] - begin;
            const int64_t *row = slots + (int64_t)b * width + begin;
            float query[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], kv[MAX_DIM];
            (void)kv; /* the plain C loops' row */
            float top[MAX_GROUP], total[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                row_to_float(q + ((int64_t)b * heads + h * group + g) * dim, query[g], dim);
                top[g] = -FLT_MAX;
                total[g] = 0.0f;
                for (int d = 0; d < dim; d++) acc[g][d] = 0.0f;
            }
#if defined(__AVX512F__)
            scores_pass((const float (*)[MAX_DIM])query, acc, scores, k, row, n, kv_heads, h,
                        group, dim);
#else
            for (int t = 0; t < n; t++) {
                row_to_float(k + (row[t] * kv_heads + h) * dim, kv, dim);
                for (int g = 0; g < group; g++) scores[g * n + t] = dot(query[g], kv, dim);
            }
#endif
            for (int g = 0; g < group; g++) {
                float *p = scores + g * n;
                for (int t = 0; t < n; t++) {
                    float s = p[t] * scale;
                    if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                    p[t] = s;
                    if (s > top[g]) top[g] = s;
                }
            }
            for (int g = 0; g < group; g++) {
                float *p = scores + g * n;
                for (int t = 0; t < n; t++) {
                    float e = expf(p[t] - top[g]);
                    total[g] += e;
                    p[t] = bf(to_bf(e));
                }
            }
#if defined(__AVX512F__)
            values_pass(acc, scores, v, row, n, kv_heads, h, group, dim);
#else
            for (int t = 0; t < n; t++) {
                row_to_float(v + (row[t] * kv_heads + h) * dim, kv, dim);
                for (int g = 0; g < group; g++) {
                    float p = scores[g * n + t];
                    for (int d = 0; d < dim; d++) acc[g][d] += p * kv[d];
                }
            }
#endif
            for (int g = 0; g < group; g++) {
                uint16_t *o = out + ((int64_t)b * heads + h * group + g) * dim;
                float inv = n > 0 ? 1.0f / total[g] : 0.0f;
                for (int d = 0; d < dim; d++) o[d] = to_bf(acc[g][d] * inv);
            }
        }
        free(scores);
        RESTORE_SUBNORMALS;
    }
    return failed ? -1 : 0;
}

/* ---- a fresh prefill's causal attention ------------------------------------------- */

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define QROWS 16
#define KEYS 16

/* key j's row: through the context's slots, or the j-th row of a fresh prefill's own */
static inline int64_t key_row(const int64_t *slots, int j) { return slots ? slots[j] : j; }

static inline __m512 exp16(__m512 x) {
    float a[16];
    _mm512_storeu_ps(a, x);
    for (int i = 0; i < 16; i++) a[i] = expf(a[i]);
    return _mm512_loadu_ps(a);
}

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
    if (kv_heads <= 0 || heads % kv_heads != 0 || dim % 64 != 0 || dim > MAX_DIM) return -1;
    int group = heads / kv_heads;
    if (group > MAX_GROUP) return -1;
    if (context < len || (slots == 0 && context != len)) return -1;
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
                        __mmask16 keep = (__mmask16)(visible >= 16 ? 0xFFFF : ((1u << visible) - 1));
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
                        __mmask16 keep = (__mmask16)(visible >= 16 ? 0xFFFF : ((1u << visible) - 1));
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
