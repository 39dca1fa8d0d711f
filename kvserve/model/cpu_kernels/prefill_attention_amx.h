/* attention.c's bfloat16 prefill on AMX tiles (Sapphire Rapids and later): the same two
 * passes and roundings as its AVX-512 BF16 loops, the dot products 16 query rows x 16 keys
 * (scores) and 16 query rows x 16 dimensions over 32 keys (weights times values) a tile
 * instruction. The scores' and the outputs' sums run in another order than the AVX-512 loops'
 * (float32 rounding apart); each query row's numbers still depend on its own query and keys
 * only, so a prompt prefilled in chunks or after a cached prefix gets the bits of one whole
 * prefill. Work items as the AVX-512 loops': (kv head, block of 16 query rows).
 *
 * Tiles: 0-3 sums (the scores of one query head, or 64 output dimensions of one); 4 the
 * queries or the weights (16 rows of 32 bfloat16); 5-7 the keys (16 pairs of dimensions x 16
 * keys) or the values (16 pairs of keys x 16 dimensions), as tdpbf16ps takes them. */
#include "amx_tiles.h"

/* one item's buffers (per thread): its queries padded to 16 rows, one query head's weights */
typedef struct {
    uint16_t *queries;  /* [group][16][dim] */
    uint32_t *keys;     /* this kv head's, tile_keys_values' */
    uint32_t *values;
    uint16_t *weights;  /* [16][width] */
} AmxItem;

static int prefill_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k,
                                 int64_t k_stride, const uint16_t *v, int64_t v_stride,
                                 const int64_t *slots, int context, uint16_t *out, int len,
                                 int heads, int kv_heads, int dim, float scale, int num_threads) {
    const int group = prefill_group(heads, kv_heads, dim, slots, context, len);
    if (group < 0) return -1;
    if (len == 0) return 0;
    const int start = context - len, blocks = (len + QROWS - 1) / QROWS, pairs = dim / 2;
    const int width = (context + PAIR_KEYS - 1) / PAIR_KEYS * PAIR_KEYS; /* keys, padded */
    uint32_t *keys, *values;
    const int per_pass = keys_values_buffers(kv_heads, width, dim, &keys, &values);
    if (per_pass < 0) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        FLUSH_SUBNORMALS;
        AmxItem b;
        float *scores = malloc(sizeof(float) * MAX_GROUP * QROWS * (size_t)width);
        b.queries = aligned_alloc(64, (size_t)MAX_GROUP * QROWS * dim * 2);
        b.weights = aligned_alloc(64, (size_t)QROWS * width * 2);
        const int ready = scores && b.queries && b.weights;
        if (ready) configure_tiles();
        else {
#pragma omp atomic write
            failed = 1;
        }
        for (int h0 = 0; h0 < kv_heads; h0 += per_pass) { /* the kv heads whose keys fit */
            const int n = kv_heads - h0 < per_pass ? kv_heads - h0 : per_pass;
            tile_keys_values(k, k_stride, v, v_stride, slots, context, h0, n, dim, width, keys,
                             values);
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < n * blocks; item++) {
                if (!ready) continue;
                const int h = h0 + item % n, qb = blocks - 1 - item / n; /* longest first */
                const int r0 = qb * QROWS, rows = len - r0 < QROWS ? len - r0 : QROWS;
                const int last_key = start + r0 + rows;
                b.keys = keys + (size_t)(h - h0) * width * pairs;
                b.values = values + (size_t)(h - h0) * width / 2 * dim;
                memset(b.queries, 0, (size_t)group * QROWS * dim * 2);
                for (int g = 0; g < group; g++)
                    for (int i = 0; i < rows; i++)
                        memcpy(b.queries + ((size_t)g * QROWS + i) * dim,
                               q + (int64_t)(r0 + i) * q_stride + (int64_t)(h * group + g) * dim, (size_t)dim * 2);
                __m512 vmax[MAX_GROUP * QROWS], vsum[MAX_GROUP * QROWS];
                for (int st = 0; st < group * QROWS; st++) vmax[st] = _mm512_set1_ps(-FLT_MAX);
                for (int k0 = 0; k0 < last_key; k0 += 16) { /* the scores, a query head at a time */
                    const int nk = last_key - k0 < 16 ? last_key - k0 : 16;
                    for (int g = 0; g < group; g++) {
                        float *sg = scores + (size_t)g * QROWS * width + k0;
                        _tile_zero(0);
                        for (int p0 = 0; p0 < pairs; p0 += 16) {
                            _tile_loadd(4, b.queries + (size_t)g * QROWS * dim + 2 * p0, dim * 2);
                            _tile_loadd(5, b.keys + ((size_t)(k0 / 16) * pairs + p0) * 16, 64);
                            _tile_dpbf16ps(0, 4, 5);
                        }
                        _tile_stored(0, sg, width * 4);
                        for (int i = 0; i < rows; i++) {
                            const int row = start + r0 + i, st = g * QROWS + i;
                            const int visible = row - k0 + 1 < nk ? (row - k0 + 1 > 0 ? row - k0 + 1 : 0) : nk;
                            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sg + (size_t)i * width), _mm512_set1_ps(scale));
                            s = _mm512_mask_blend_ps(first_lanes16(visible), _mm512_set1_ps(-FLT_MAX), s);
                            _mm512_storeu_ps(sg + (size_t)i * width, s);
                            vmax[st] = _mm512_max_ps(vmax[st], s);
                        }
                    }
                }
                for (int g = 0; g < group; g++) { /* the weights, then times the values */
                    memset(b.weights, 0, (size_t)QROWS * width * 2);
                    for (int i = 0; i < rows; i++) {
                        const int row = start + r0 + i, st = g * QROWS + i;
                        const float top = _mm512_reduce_max_ps(vmax[st]);
                        const float *sr = scores + ((size_t)g * QROWS + i) * width;
                        vsum[st] = _mm512_setzero_ps();
                        for (int k0 = 0; k0 <= row && k0 < last_key; k0 += 16) {
                            const int nk = last_key - k0 < 16 ? last_key - k0 : 16;
                            const int visible = row - k0 + 1 < nk ? row - k0 + 1 : nk;
                            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + k0), _mm512_set1_ps(top)));
                            e = _mm512_maskz_mov_ps(first_lanes16(visible), e);
                            vsum[st] = _mm512_add_ps(vsum[st], e);
                            _mm256_storeu_si256((__m256i *)(b.weights + (size_t)i * width + k0),
                                                (__m256i)_mm512_cvtneps_pbh(e));
                        }
                    }
                    for (int d0 = 0; d0 < dim; d0 += 64) {
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        for (int k0 = 0; k0 < last_key; k0 += PAIR_KEYS) {
                            const uint32_t *vt = b.values + (size_t)(k0 / 2) * dim + d0;
                            _tile_loadd(4, b.weights + k0, width * 2);
                            _tile_loadd(5, vt, dim * 4);
                            _tile_dpbf16ps(0, 4, 5);
                            _tile_loadd(6, vt + 16, dim * 4);
                            _tile_dpbf16ps(1, 4, 6);
                            _tile_loadd(7, vt + 32, dim * 4); /* dim: whole 64s */
                            _tile_dpbf16ps(2, 4, 7);
                            _tile_loadd(5, vt + 48, dim * 4);
                            _tile_dpbf16ps(3, 4, 5);
                        }
                        float acc[QROWS][64] __attribute__((aligned(64)));
                        _tile_stored(0, &acc[0][0], 256);
                        _tile_stored(1, &acc[0][16], 256);
                        _tile_stored(2, &acc[0][32], 256);
                        _tile_stored(3, &acc[0][48], 256);
                        for (int i = 0; i < rows; i++) {
                            const int st = g * QROWS + i;
                            const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum[st]));
                            uint16_t *o = out + ((int64_t)(r0 + i) * heads + h * group + g) * dim + d0;
                            for (int c = 0; c < 4; c++)
                                _mm256_storeu_si256((__m256i *)(o + 16 * c),
                                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&acc[i][16 * c]), inv)));
                        }
                    }
                }
            }
        }
        if (ready) _tile_release();
        free(scores), free(b.queries), free(b.weights);
        RESTORE_SUBNORMALS;
    }
    free(keys), free(values);
    return failed ? -1 : 0;
}
