/* A decoder's layers for one decode step in one call (kvserve/model/cpu_kernels), for
 * models whose projections are packed (4 or 8 bits: quant_matmul.c).
 *
 * Why: on a 1B model with 4-bit weights a decode step is 16 layers of 9 kernel calls,
 * and the Python between them (the modules, torch's small ops, ctypes' argument
 * conversions) cost about a fifth of the step, slowed further because each matmul's
 * weights stream through the caches the interpreter runs from. Here the same kernels run
 * in the same order on the same numbers, called through the function pointers their own
 * libraries export (kvserve/model/cpu_kernels/decode_layers.py passes them), so the bits
 * are the Python path's; only the glue between them is C: copies of q and of the new K/V
 * into the cache slots, the biases and the residual adds (bfloat16: the float sum
 * rounded, as torch's add_).
 *
 * A layer (DecoderLayer with GatedMLP): h = norm(x); qkv = h Wqkv (+ b); q, k rotated;
 * k, v written at the rows' slots; a = attention(q) over the cache; x += a Wo (+ b),
 * h = norm(x) (one call); x += down(silu(gate) * up)(h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bfloat16.h"

typedef int (*MatmulFn)(const void *x, void *out, int x_bf16, int64_t M, int64_t N, int64_t K,
                        const uint8_t *codes, int bits, const void *scales, const void *offsets,
                        int scales_f16, int threads);
typedef void (*NormFn)(void *x, const void *delta, const void *weight, void *out, int64_t rows,
                       int dim, float eps, int threads);
typedef void (*RotaryFn)(const void *x, int64_t x_stride, const void *cos, const void *signed_sin,
                         void *out, int64_t rows, int heads, int dim, int threads);
typedef void (*SiluMulFn)(const void *gate_up, void *out, int64_t rows, int width, int threads);
typedef int (*AttendFn)(const void *q, const void *k, const void *v, const int64_t *slots,
                        const int32_t *bounds, void *out, int batch, int heads, int kv_heads,
                        int dim, int width, float scale, float softcap, int threads);

/* One element type's kernels. */
typedef struct {
    MatmulFn matmul;
    NormFn norm;
    RotaryFn rotary;
    SiluMulFn silu_mul;
    AttendFn attend;
} Kernels;

/* A packed projection: quant_matmul's weight arguments, and an optional bias [N]. */
typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets, *bias;
    int64_t out_features, in_features, bits, scales_f16;
} Packed;

/* A layer's weights (norm weights in the rows' element type). */
typedef struct {
    Packed qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
} Layer;

/* What a layer's KV cache group says for the step: row b writes its new K/V at
 * write_slots[b] and reads slots[b, bounds[b][0]:bounds[b][1]]. */
typedef struct {
    const int64_t *write_slots, *slots;
    const int32_t *bounds;
    int64_t width;
} Reads;

/* The step and the model's shapes. */
typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate, bf16, threads;
    const void *cos, *signed_sin; /* [rows, head_dim] */
    float eps, scale;
} Step;

/* x += delta, elementwise over count elements (bfloat16: the float sum rounded) */
static void add_into(void *x, const void *delta, int64_t count, int64_t bf16) {
    if (bf16) {
        uint16_t *a = (uint16_t *)x;
        const uint16_t *b = (const uint16_t *)delta;
        for (int64_t i = 0; i < count; i++) a[i] = to_bf(bf(a[i]) + bf(b[i]));
    } else {
        float *a = (float *)x;
        const float *b = (const float *)delta;
        for (int64_t i = 0; i < count; i++) a[i] += b[i];
    }
}

/* out [rows, N] = x p.W^T (+ bias) */
static int project(const Kernels *k, const Step *s, const Packed *p, const void *x, void *out) {
    if (k->matmul(x, out, (int)s->bf16, s->rows, p->out_features, p->in_features, p->codes,
                  (int)p->bits, p->scales, p->offsets, (int)p->scales_f16, (int)s->threads))
        return -1;
    const int64_t n = p->out_features, elem = s->bf16 ? 2 : 4;
    for (int64_t r = 0; p->bias != NULL && r < s->rows; r++)
        add_into((char *)out + r * n * elem, p->bias, n, s->bf16);
    return 0;
}

/* Runs `count` layers on the residual stream x [rows, hidden] in place. caches: K and V of
 * each layer ([slots, kv_heads, head_dim]); reads: each layer's group's Reads. Returns 0,
 * -1 when a kernel refused its shapes (x is then partly updated: the caller fails the
 * step), -2 when out of memory (nothing done). */
int decode_layers(const Kernels *k, const Step *s, const Layer *layers, int64_t count,
                  void *const *caches, const Reads *const *reads, void *x) {
    const int64_t rows = s->rows, elem = s->bf16 ? 2 : 4, D = s->head_dim;
    const int64_t H = s->heads, KV = s->kv_heads, qkv_width = (H + 2 * KV) * D;
    const int64_t sizes[] = {
        rows * s->hidden,         /* h: a norm's output */
        rows * qkv_width,         /* qkv */
        rows * (H + KV) * D,      /* qk rotated */
        rows * H * D,             /* q, contiguous */
        rows * H * D,             /* attention's output */
        rows * s->hidden,         /* a projection back to the hidden size */
        rows * 2 * s->intermediate, /* gate | up */
        rows * s->intermediate,   /* silu(gate) * up */
    };
    char *buffers[8];
    int64_t total = 0;
    for (int i = 0; i < 8; i++) total += (sizes[i] * elem + 63) / 64 * 64;
    char *scratch = aligned_alloc(64, (size_t)total);
    if (scratch == NULL) return -2;
    for (int i = 0, at = 0; i < 8; at += (int)((sizes[i] * elem + 63) / 64 * 64), i++)
        buffers[i] = scratch + at;
    char *h = buffers[0], *qkv = buffers[1], *qk = buffers[2], *q = buffers[3];
    char *attended = buffers[4], *back = buffers[5], *gate_up = buffers[6], *act = buffers[7];
    const int hidden = (int)s->hidden, threads = (int)s->threads;
    int failed = 0;
    for (int64_t l = 0; l < count && !failed; l++) {
        const Layer *L = layers + l;
        const Reads *r = reads[l];
        char *kc = (char *)caches[2 * l], *vc = (char *)caches[2 * l + 1];
        k->norm(x, NULL, L->input_norm, h, rows, hidden, s->eps, threads);
        if (project(k, s, &L->qkv, h, qkv)) { failed = -1; break; }
        k->rotary(qkv, qkv_width, s->cos, s->signed_sin, qk, rows, (int)(H + KV), (int)D, threads);
        for (int64_t b = 0; b < rows; b++) { /* q contiguous; the new K and V at their slots */
            const int64_t slot = r->write_slots[b], kv_bytes = KV * D * elem;
            memcpy(q + b * H * D * elem, qk + b * (H + KV) * D * elem, (size_t)(H * D * elem));
            memcpy(kc + slot * kv_bytes, qk + (b * (H + KV) + H) * D * elem, (size_t)kv_bytes);
            memcpy(vc + slot * kv_bytes, qkv + (b * qkv_width + (H + KV) * D) * elem, (size_t)kv_bytes);
        }
        if (k->attend(q, kc, vc, r->slots, r->bounds, attended, (int)rows, (int)H, (int)KV, (int)D,
                      (int)r->width, s->scale, 0.0f, threads) ||
            project(k, s, &L->o, attended, back)) {
            failed = -1;
            break;
        }
        k->norm(x, back, L->post_norm, h, rows, hidden, s->eps, threads); /* x += back first */
        if (project(k, s, &L->gate_up, h, gate_up)) { failed = -1; break; }
        k->silu_mul(gate_up, act, rows, (int)s->intermediate, threads);
        if (project(k, s, &L->down, act, back)) { failed = -1; break; }
        add_into(x, back, rows * s->hidden, s->bf16);
    }
    free(scratch);
    return failed;
}
