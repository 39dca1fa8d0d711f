/* Paged decode attention, written once for each element type of the cache
 * (kvserve/model/cpu_kernels/attention.c includes it for bfloat16 and for float32).
 *
 * One query token per sequence reads its context straight from the paged K/V
 * cache through its slot list: no gathered copy of the context, no padding.
 * Work items are (sequence, kv head): the group's query heads share every key
 * and value row they read. Scores, the softmax and the sums are float32.
 *
 * The includer defines, before each inclusion:
 *   ELEM               the cache's element type (uint16_t for bfloat16, float)
 *   T(name)            name with the type's suffix (the function and its helpers)
 *   TO_FLOAT(x)        an ELEM as a float
 *   FROM_FLOAT(x)      a float rounded to an ELEM
 *   ROUND_WEIGHT(x)    a probability as it weights the values (bfloat16: rounded to
 *                      bfloat16, as the flash kernel of torch's SDPA does; float32: as is)
 *   LOADV(p)           VLEN ELEMs at p as a vector (simd_f32.h: AVX-512 or AVX2 builds)
 *
 * The vector paths run on simd_f32.h's vectors (16 lanes on AVX-512, 8 on AVX2 with
 * FMA): a tile is VLEN keys, whose scores come out of one transpose of VLEN sums.
 */

#ifndef KVSERVE_DECODE_ATTENTION_SHARED
#define KVSERVE_DECODE_ATTENTION_SHARED
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define LANES 16
#define MAX_GROUP 16
#define MAX_DIM 256

/* dot product in LANES independent partial sums (vectorizes without -ffast-math) */
static inline float dot(const float *a, const float *b, int dim) {
    float part[LANES] = {0};
    for (int d = 0; d < dim; d += LANES)
        for (int j = 0; j < LANES; j++) part[j] += a[d + j] * b[d + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += part[j];
    return sum;
}

#include "simd_f32.h"
#endif /* KVSERVE_DECODE_ATTENTION_SHARED */

static inline void T(row_to_float)(const ELEM *src, float *dst, int dim) {
    for (int d = 0; d < dim; d++) dst[d] = TO_FLOAT(src[d]);
}

#if defined(SIMD_F32)
/* The tile's scores for query head g: lane i = q_g . k(t0 + i), for count <= VLEN tokens
 * (dim a multiple of VLEN; inlined with a constant dim, the sums stay in registers) */
static inline __attribute__((always_inline)) vf T(tile_scores)(
    const float *query, const ELEM *const *keys, int count, int dim) {
    vf acc[VLEN];
    for (int i = 0; i < VLEN; i++) acc[i] = vf_zero();
    for (int i = 0; i < count; i++)
        for (int d = 0; d < dim; d += VLEN)
            acc[i] = vf_fmadd(vf_load(query + d), LOADV(keys[i] + d), acc[i]);
    return vf_lane_sums(acc);
}

/* out += sum over the tile's tokens of p(t) * v(t) (dim <= MAX_DIM, a multiple of VLEN),
 * 4 vectors of dims at a time */
static inline __attribute__((always_inline)) void T(tile_values)(
    float *out, const float *p, const ELEM *const *values, int count, int dim) {
    for (int d = 0; d < dim; d += 4 * VLEN) {
        vf acc[4];
        int width = dim - d < 4 * VLEN ? (dim - d) / VLEN : 4;
        for (int j = 0; j < width; j++) acc[j] = vf_load(out + d + VLEN * j);
        for (int i = 0; i < count; i++) {
            vf weight = vf_set1(p[i]);
            for (int j = 0; j < width; j++)
                acc[j] = vf_fmadd(weight, LOADV(values[i] + d + VLEN * j), acc[j]);
        }
        for (int j = 0; j < width; j++) vf_store(out + d + VLEN * j, acc[j]);
    }
}

static inline __attribute__((always_inline)) void T(attend_vectors)(
    const float (*query)[MAX_DIM], float *scores, const ELEM *k, const int64_t *row, int n,
    int kv_heads, int h, int group, int dim) {
    const ELEM *rows[VLEN];
    for (int t0 = 0; t0 < n; t0 += VLEN) {
        int count = n - t0 < VLEN ? n - t0 : VLEN;
        for (int i = 0; i < count; i++) rows[i] = k + (row[t0 + i] * kv_heads + h) * dim;
        for (int g = 0; g < group; g++) {
            float sums[VLEN];
            vf_store(sums, T(tile_scores)(query[g], rows, count, dim));
            for (int i = 0; i < count; i++) scores[g * n + t0 + i] = sums[i];
        }
    }
}

static inline __attribute__((always_inline)) void T(values_vectors)(
    float (*acc)[MAX_DIM], const float *scores, const ELEM *v, const int64_t *row, int n,
    int kv_heads, int h, int group, int dim) {
    const ELEM *rows[VLEN];
    for (int t0 = 0; t0 < n; t0 += VLEN) {
        int count = n - t0 < VLEN ? n - t0 : VLEN;
        for (int i = 0; i < count; i++) rows[i] = v + (row[t0 + i] * kv_heads + h) * dim;
        for (int g = 0; g < group; g++)
            T(tile_values)(acc[g], scores + g * n + t0, rows, count, dim);
    }
}
#endif

/* the two passes, with dim a compile-time constant where it is a common head size */
static void T(scores_pass)(const float (*query)[MAX_DIM], float *scores, const ELEM *k,
                           const int64_t *row, int n, int kv_heads, int h, int group, int dim) {
#if defined(SIMD_F32)
    if (dim == 64) T(attend_vectors)(query, scores, k, row, n, kv_heads, h, group, 64);
    else if (dim == 128) T(attend_vectors)(query, scores, k, row, n, kv_heads, h, group, 128);
    else T(attend_vectors)(query, scores, k, row, n, kv_heads, h, group, dim);
#else
    float kv[MAX_DIM];
    for (int t = 0; t < n; t++) {
        T(row_to_float)(k + (row[t] * kv_heads + h) * dim, kv, dim);
        for (int g = 0; g < group; g++) scores[g * n + t] = dot(query[g], kv, dim);
    }
#endif
}

static void T(values_pass)(float (*acc)[MAX_DIM], const float *scores, const ELEM *v,
                           const int64_t *row, int n, int kv_heads, int h, int group, int dim) {
#if defined(SIMD_F32)
    if (dim == 64) T(values_vectors)(acc, scores, v, row, n, kv_heads, h, group, 64);
    else if (dim == 128) T(values_vectors)(acc, scores, v, row, n, kv_heads, h, group, 128);
    else T(values_vectors)(acc, scores, v, row, n, kv_heads, h, group, dim);
#else
    float kv[MAX_DIM];
    for (int t = 0; t < n; t++) {
        T(row_to_float)(v + (row[t] * kv_heads + h) * dim, kv, dim);
        for (int g = 0; g < group; g++) {
            float p = scores[g * n + t];
            for (int d = 0; d < dim; d++) acc[g][d] += p * kv[d];
        }
    }
#endif
}

/* Returns 0, or -1 when a shape is outside what the kernel handles (nothing written). */
int T(decode_attention)(
    const ELEM *q,          /* [batch, heads, dim] */
    const ELEM *k,          /* [slots, kv_heads, dim]: the flat cache */
    const ELEM *v,
    const int64_t *slots,   /* [batch, width]: each row's context slots */
    const int32_t *bounds,  /* [batch, 2]: the row's keys are slots[begin:end] */
    ELEM *out,              /* [batch, heads, dim] */
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
            float query[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];
            float top[MAX_GROUP], total[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                T(row_to_float)(q + ((int64_t)b * heads + h * group + g) * dim, query[g], dim);
                top[g] = -FLT_MAX;
                total[g] = 0.0f;
                for (int d = 0; d < dim; d++) acc[g][d] = 0.0f;
            }
            T(scores_pass)((const float (*)[MAX_DIM])query, scores, k, row, n, kv_heads, h,
                           group, dim);
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
                    p[t] = ROUND_WEIGHT(e);
                }
            }
            T(values_pass)(acc, scores, v, row, n, kv_heads, h, group, dim);
            for (int g = 0; g < group; g++) {
                ELEM *o = out + ((int64_t)b * heads + h * group + g) * dim;
                float inv = n > 0 ? 1.0f / total[g] : 0.0f;
                for (int d = 0; d < dim; d++) o[d] = FROM_FLOAT(acc[g][d] * inv);
            }
        }
        free(scores);
        RESTORE_SUBNORMALS;
    }
    return failed ? -1 : 0;
}
