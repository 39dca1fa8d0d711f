/* Attention on the CPU (kvserve/model/cpu_kernels): paged decode for bfloat16 and float32
 * caches, and a prefill's causal attention for each (float32: prefill_attention_f32.h).
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

#include "simd_f32.h"

#define ELEM uint16_t
#define T(name) name##_bf16
#define TO_FLOAT(x) bf(x)
#define FROM_FLOAT(x) to_bf(x)
#define ROUND_WEIGHT(x) round_bf(x)
#define LOADV(p) vf_load_bf16(p)
#include "decode_attention.h"
#undef ELEM
#undef T
#undef TO_FLOAT
#undef FROM_FLOAT
#undef ROUND_WEIGHT
#undef LOADV

#define ELEM float
#define T(name) name##_f32
#define TO_FLOAT(x) (x)
#define FROM_FLOAT(x) (x)
#define ROUND_WEIGHT(x) (x)
#define LOADV(p) vf_load(p)
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
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KEYS 16
#define PAIR_KEYS 32 /* keys the values' layout pairs, padded to (a tile instruction's) */

/* The keys and values of kv heads h0 .. h0 + n - 1 laid out for the dot products, once a call
 * (all of a head's items read them; the AMX tiles' operands too): per kv head, keys
 * [width / 16][dim / 2][16] (per 16 keys, pairs of dimensions) and values [width / 2][dim]
 * (pairs of keys, per dimension); zeros past the context. */
static void tile_keys_values(const uint16_t *k, int64_t k_stride, const uint16_t *v,
                             int64_t v_stride, const int64_t *slots, int context, int h0, int n,
                             int dim, int width, uint32_t *keys, uint32_t *values) {
    const int pairs = dim / 2;
#pragma omp for schedule(static)
    for (int item = 0; item < n * (width / PAIR_KEYS); item++) {
        const int h = h0 + item % n, j0 = item / n * PAIR_KEYS;
        uint32_t *kh = keys + (size_t)(h - h0) * width * pairs;
        uint32_t *vh = values + (size_t)(h - h0) * width / 2 * dim;
        for (int j = j0; j < j0 + PAIR_KEYS; j++) {
            const uint32_t *kr = j < context ? (const uint32_t *)(k + key_row(slots, j) * k_stride + (int64_t)h * dim) : NULL;
            const uint16_t *vr = j < context ? v + key_row(slots, j) * v_stride + (int64_t)h * dim : NULL;
            uint32_t *kt = kh + (size_t)(j / 16) * pairs * 16 + j % 16;
            for (int p = 0; p < pairs; p++) kt[p * 16] = kr ? kr[p] : 0;
            uint16_t *vt = (uint16_t *)(vh + (size_t)(j / 2) * dim) + j % 2;
            for (int d = 0; d < dim; d++) vt[2 * d] = vr ? vr[d] : 0;
        }
    }
}

#define LAYOUT_BYTES (32 << 20) /* the laid-out keys and values of a pass of kv heads */

/* tile_keys_values' buffers for the kv heads a pass lays out (as many as LAYOUT_BYTES hold,
 * at least one): their count, or -1 (nothing held) when out of memory */
static int keys_values_buffers(int kv_heads, int width, int dim, uint32_t **keys,
                               uint32_t **values) {
    const int64_t per_head = (int64_t)width * dim * 4;
    const int fit = (int)(LAYOUT_BYTES / per_head), heads = fit < 1 ? 1 : fit < kv_heads ? fit : kv_heads;
    *keys = aligned_alloc(64, (size_t)heads * width * dim * 2);
    *values = aligned_alloc(64, (size_t)heads * width * dim * 2);
    if (*keys != NULL && *values != NULL) return heads;
    if (*keys != NULL && *values != NULL) return 0;
    free(*keys), free(*values);
    return -1;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PREFILL_AMX 1
#include "prefill_attention_amx.h"
#endif

/* on 1: bfloat16 prefills on AMX tiles where the CPU has them (asked once a process;
 * KVSERVE_AMX=0 keeps them off, attention.py), 0: on AVX-512 BF16. Returns whether tiles run. */
int attention_tiles(int on) {
#if PREFILL_AMX
    amx_state = on ? 0 : -1;
    return on && amx_granted();
#else
    return on * 0;
#endif
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
#if PREFILL_AMX
    if (amx_granted())
        return prefill_attention_amx(q, q_stride, k, k_stride, v, v_stride, slots, context, out,
                                     len, heads, kv_heads, dim, scale, num_threads);
#endif
    int group = prefill_group(heads, kv_heads, dim, slots, context, len);
    if (group < 0) return -1;
    if (len == 0) return 0;
    int start = context - len; /* query row i is position start + i */
    int blocks = (len + QROWS - 1) / QROWS;
    int pairs = dim / 2, chunks = dim / 16;
    int width = (context + PAIR_KEYS - 1) / PAIR_KEYS * PAIR_KEYS; /* keys, padded */
    uint32_t *keys, *values;
    const int per_pass = keys_values_buffers(kv_heads, width, dim, &keys, &values);
    if (per_pass < 0) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        FLUSH_SUBNORMALS;
        float *scores = (float *)malloc(sizeof(float) * MAX_GROUP * QROWS * (size_t)(width > 0 ? width : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int h0 = 0; h0 < kv_heads; h0 += per_pass) { /* the kv heads whose keys fit */
            const int n = kv_heads - h0 < per_pass ? kv_heads - h0 : per_pass;
            tile_keys_values(k, k_stride, v, v_stride, slots, context, h0, n, dim, width, keys,
                             values);
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < n * blocks; item++) {
                if (scores == NULL) continue;
                int h = h0 + item % n, qb = blocks - 1 - item / n; /* longest first */
                int r0 = qb * QROWS, rows = len - r0 < QROWS ? len - r0 : QROWS;
                int last_key = start + r0 + rows;
                const uint32_t *kh = keys + (size_t)(h - h0) * width * pairs;
                const uint32_t *vh = values + (size_t)(h - h0) * width / 2 * dim;
                __m512 vmax[MAX_GROUP * QROWS], vsum[MAX_GROUP * QROWS];
                for (int st = 0; st < group * rows; st++) vmax[st] = _mm512_set1_ps(-FLT_MAX);
                for (int k0 = 0; k0 < last_key; k0 += KEYS) {
                    int nk = last_key - k0 < KEYS ? last_key - k0 : KEYS;
                    const uint32_t(*kt)[KEYS] = (const uint32_t(*)[KEYS])(kh + (size_t)(k0 / KEYS) * pairs * KEYS);
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
                            __mmask16 keep = first_lanes16(visible);
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
                    const uint32_t *vt = vh + (size_t)(k0 / 2) * dim; /* a pair of keys a row */
                    for (int g = 0; g < group; g++)
                        for (int i = 0; i < rows; i++) {
                            int row = start + r0 + i, st = g * rows + i;
                            if (row < k0) continue;
                            int visible = row - k0 + 1 < nk ? row - k0 + 1 : nk;
                            __mmask16 keep = first_lanes16(visible);
                            __m512 s = _mm512_loadu_ps(scores + (size_t)st * width + k0);
                            __m512 e = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(s, _mm512_set1_ps(top[st]))));
                            vsum[st] = _mm512_add_ps(vsum[st], e);
                            uint32_t pw[8];
                            _mm256_storeu_si256((__m256i *)pw, (__m256i)_mm512_cvtneps_pbh(e));
                            __m512 a0 = acc[st][0], a1 = acc[st][1], a2 = acc[st][2], a3 = acc[st][3];
                            for (int jj = 0; jj < (visible + 1) / 2; jj++) {
                                __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pw[jj]);
                                a0 = _mm512_dpbf16_ps(a0, pj, (__m512bh)_mm512_load_si512(vt + jj * dim + 0));
                                a1 = _mm512_dpbf16_ps(a1, pj, (__m512bh)_mm512_load_si512(vt + jj * dim + 16));
                                a2 = _mm512_dpbf16_ps(a2, pj, (__m512bh)_mm512_load_si512(vt + jj * dim + 32));
                                a3 = _mm512_dpbf16_ps(a3, pj, (__m512bh)_mm512_load_si512(vt + jj * dim + 48));
                                for (int c = 4; c < chunks; c++)
                                    acc[st][c] = _mm512_dpbf16_ps(acc[st][c], pj, (__m512bh)_mm512_load_si512(vt + jj * dim + c * 16));
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
        }
        free(scores);
        RESTORE_SUBNORMALS;
    }
    free(keys), free(values);
    return failed ? -1 : 0;
}
#else
int attention_tiles(int on) { return on * 0; } /* no bfloat16 prefill kernel here */

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

#include "prefill_attention_f32.h"
