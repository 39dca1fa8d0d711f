/* A decoder layer's small bfloat16 ops in one call each, on the CPU (kvserve/model/cpu_kernels).
 *
 * torch runs an RMSNorm as eight ops, the rotary embedding as four and the
 * gated activation as three, each a dispatch of a few microseconds over a few
 * thousand numbers in a decode step. These compute the same arithmetic, the
 * same roundings to bfloat16 in the same places (float32 in between), in one
 * call: RMSNorm as transformers computes it, with the residual add before it
 * fused in; the rotary embedding as x * cos + rotate_half(x) * sin; SiLU(gate)
 * rounded, then times up. Rows are split across threads only when there are
 * enough of them to pay for the fork.
 */
#include <math.h>
#include <stdint.h>

#include "bfloat16.h"

#define PARALLEL_ELEMENTS 8192

/* x[r] += delta[r] (bfloat16, when delta is given), then
 * out[r] = weight * bf16(x[r] / sqrt(mean(x[r]^2) + eps)) */
void add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight,
                       uint16_t *out, int64_t rows, int dim, float eps, int num_threads) {
    int threads = rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *row = x + r * dim;
        if (delta != 0) {
            const uint16_t *add = delta + r * dim;
            for (int d = 0; d < dim; d++) row[d] = to_bf(bf(row[d]) + bf(add[d]));
        }
        float part[16] = {0};
        int d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int j = 0; j < 16; j++) part[j] += bf(row[d + j]) * bf(row[d + j]);
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += part[j];
        for (; d < dim; d++) sum += bf(row[d]) * bf(row[d]);
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        uint16_t *o = out + r * dim;
        for (d = 0; d < dim; d++) o[d] = to_bf(bf(weight[d]) * round_bf(bf(row[d]) * inv));
    }
}

/* out[r, h] = bf16(bf16(x * cos) + bf16(rotate_half(x) * signed_sin)) for the first `heads`
 * heads of each row of x (row stride x_stride elements); cos and signed_sin are
 * [rows, dim] (signed_sin: -sin on the first half, as RotaryEmbedding.cos_sin builds it) */
void rotary_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *cos,
                 const uint16_t *signed_sin, uint16_t *out, int64_t rows, int heads, int dim,
                 int num_threads) {
    int half = dim / 2;
    int threads = rows * heads * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * dim, *s = signed_sin + r * dim;
        for (int h = 0; h < heads; h++) {
            const uint16_t *in = x + r * x_stride + (int64_t)h * dim;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int d = 0; d < dim; d++) {
                float other = bf(in[d < half ? d + half : d - half]);
                o[d] = to_bf(round_bf(bf(in[d]) * bf(c[d])) + round_bf(other * bf(s[d])));
            }
        }
    }
}

/* out[r] = bf16(bf16(silu(gate)) * up) where gate_up[r] = [gate | up], each `width` wide */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int width,
                   int num_threads) {
    int threads = rows * width >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * width, *up = gate + width;
        uint16_t *o = out + r * width;
        for (int i = 0; i < width; i++) {
            float g = bf(gate[i]);
            o[i] = to_bf(round_bf(g / (1.0f + expf(-g))) * bf(up[i]));
        }
    }
}
