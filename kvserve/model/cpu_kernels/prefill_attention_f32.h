/* The float32 prefill's causal attention (kvserve/model/cpu_kernels/attention.c includes
 * it after the decode kernels: MAX_GROUP, MAX_DIM, prefill_group and key_row are there).
 *
 * The same attention as the bfloat16 prefill (work items of (kv head, 32 query
 * positions), exact row maxima in a first pass over the key tiles, then the weights
 * exp(s - max) times the values), every product and sum in float32, nothing rounded.
 * Written once on simd_f32.h's vectors: AVX-512 runs register tiles of 4 score rows x 32
 * keys and 4 rows x 64 value dims, AVX2 4 x 16 and 4 x 16 (8 FMA chains each, within its
 * 16 registers). A build with neither keeps SDPA's flash kernel (the function says -1). */
#include "simd_f32.h"

#if defined(SIMD_F32)
#define TILE_ROWS 4
#define KEY_VECS 2
#define TILE_KEYS (KEY_VECS * VLEN)
#define VALUE_VECS (VLEN == 16 ? 4 : 2)
#define F32_QROWS 32 /* query positions per work item: the key tiles' transpose serves more */

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
        const vf lowest = vf_set1(-FLT_MAX), scaled = vf_set1(scale);
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
            for (int k0 = 0; k0 < last_key; k0 += TILE_KEYS) { /* the scores, row maxima */
                int nk = last_key - k0 < TILE_KEYS ? last_key - k0 : TILE_KEYS;
                for (int j = 0; j < TILE_KEYS; j++) {
                    const float *row = k + key_row(slots, k0 + (j < nk ? j : 0)) * k_stride + (int64_t)h * dim;
                    for (int d = 0; d < dim; d++) kt[d][j] = j < nk ? row[d] : 0.0f;
                }
                for (int s0 = 0; s0 < count; s0 += TILE_ROWS) {
                    vf acc[TILE_ROWS][KEY_VECS];
                    for (int r = 0; r < TILE_ROWS; r++)
                        for (int c = 0; c < KEY_VECS; c++) acc[r][c] = vf_zero();
                    for (int d = 0; d < dim; d++) {
                        vf key[KEY_VECS];
                        for (int c = 0; c < KEY_VECS; c++) key[c] = vf_load(&kt[d][c * VLEN]);
                        for (int r = 0; r < TILE_ROWS; r++) {
                            vf qd = vf_set1(qrow[s0 + r][d]);
                            for (int c = 0; c < KEY_VECS; c++) acc[r][c] = vf_fmadd(qd, key[c], acc[r][c]);
                        }
                    }
                    for (int r = 0; r < TILE_ROWS && s0 + r < count; r++) {
                        int st = s0 + r, visible = position[st] - k0 + 1 < nk ? position[st] - k0 + 1 : nk;
                        vf m = lowest;
                        for (int c = 0; c < KEY_VECS; c++) {
                            vf s = vf_first(visible - c * VLEN, vf_mul(acc[r][c], scaled), lowest);
                            vf_store(scores + (size_t)st * width + k0 + c * VLEN, s);
                            m = vf_max(m, s);
                        }
                        float row_top = vf_top(m);
                        if (row_top > top[st]) top[st] = row_top;
                    }
                }
            }
            for (int st = 0; st < padded; st++) { /* the weights (0 past a row's position) */
                float *p = scores + (size_t)st * width;
                int visible = position[st] + 1;
                vf sum = vf_zero(), m = vf_set1(top[st]);
                for (int t = 0; t < last_key; t += VLEN) {
                    vf e = vf_zero();
                    if (t < visible) e = vf_first(visible - t, vf_exp(vf_sub(vf_load(p + t), m)), vf_zero());
                    vf_store(p + t, e);
                    sum = vf_add(sum, e);
                }
                total[st] = vf_sum(sum);
            }
            for (int s0 = 0; s0 < count; s0 += TILE_ROWS) { /* the weights times the values */
                int tile = count - s0 < TILE_ROWS ? count - s0 : TILE_ROWS, keys = 0;
                for (int r = 0; r < tile; r++)
                    if (position[s0 + r] + 1 > keys) keys = position[s0 + r] + 1;
                const float *weights[TILE_ROWS];
                for (int r = 0; r < TILE_ROWS; r++) weights[r] = scores + (size_t)(s0 + r) * width;
                for (int d0 = 0; d0 < dim; d0 += VALUE_VECS * VLEN) {
                    vf sums[TILE_ROWS][VALUE_VECS];
                    for (int r = 0; r < TILE_ROWS; r++)
                        for (int c = 0; c < VALUE_VECS; c++) sums[r][c] = vf_zero();
                    for (int j = 0; j < keys; j++) {
                        const float *vj = v + key_row(slots, j) * v_stride + (int64_t)h * dim + d0;
                        vf value[VALUE_VECS];
                        for (int c = 0; c < VALUE_VECS; c++) value[c] = vf_load(vj + c * VLEN);
                        for (int r = 0; r < TILE_ROWS; r++) {
                            vf pw = vf_set1(weights[r][j]);
                            for (int c = 0; c < VALUE_VECS; c++) sums[r][c] = vf_fmadd(pw, value[c], sums[r][c]);
                        }
                    }
                    for (int r = 0; r < tile; r++) {
                        int st = s0 + r, g = st / rows, i = st % rows;
                        float *o = out + ((int64_t)(r0 + i) * heads + h * group + g) * dim + d0;
                        vf inv = vf_set1(1.0f / total[st]);
                        for (int c = 0; c < VALUE_VECS; c++) vf_store(o + c * VLEN, vf_mul(sums[r][c], inv));
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
