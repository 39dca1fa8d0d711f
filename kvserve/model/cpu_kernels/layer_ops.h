/* A decoder layer's small ops, written once for each element type (layer_ops.c includes
 * it for bfloat16 and float32). The includer defines ELEM (the element type), T(name)
 * (name with the type's suffix), TO_FLOAT(x), FROM_FLOAT(x) (rounded to an ELEM) and
 * ROUND(x): a float rounded where torch's ops store an intermediate in the ELEM type
 * (bfloat16), or left as is (float32).
 */
#include <math.h>
#include <stdint.h>

#define PARALLEL_ELEMENTS 8192

/* x[r] += delta[r] (when delta is given), then
 * out[r] = weight * ROUND(x[r] / sqrt(mean(x[r]^2) + eps)) */
void T(add_rms_norm)(ELEM *x, const ELEM *delta, const ELEM *weight, ELEM *out,
                      int64_t rows, int dim, float eps, int num_threads) {
    int threads = rows * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        ELEM *row = x + r * dim;
        if (delta != 0) {
            const ELEM *add = delta + r * dim;
            for (int d = 0; d < dim; d++) row[d] = FROM_FLOAT(TO_FLOAT(row[d]) + TO_FLOAT(add[d]));
        }
        float part[16] = {0};
        int d = 0;
        for (; d + 16 <= dim; d += 16)
            for (int j = 0; j < 16; j++) part[j] += TO_FLOAT(row[d + j]) * TO_FLOAT(row[d + j]);
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += part[j];
        for (; d < dim; d++) sum += TO_FLOAT(row[d]) * TO_FLOAT(row[d]);
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        ELEM *o = out + r * dim;
        for (d = 0; d < dim; d++) o[d] = FROM_FLOAT(TO_FLOAT(weight[d]) * ROUND(TO_FLOAT(row[d]) * inv));
    }
}

/* out[r, h] = ROUND(x * cos) + ROUND(rotate_half(x) * signed_sin) for the first `heads`
 * heads of each row of x (row stride x_stride elements); cos and signed_sin are
 * [rows, dim] (signed_sin: -sin on the first half, as RotaryEmbedding.cos_sin builds it) */
void T(rotary)(const ELEM *x, int64_t x_stride, const ELEM *cos, const ELEM *signed_sin,
               ELEM *out, int64_t rows, int heads, int dim,
                 int num_threads) {
    int half = dim / 2;
    int threads = rows * heads * dim >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *c = cos + r * dim, *s = signed_sin + r * dim;
        for (int h = 0; h < heads; h++) {
            const ELEM *in = x + r * x_stride + (int64_t)h * dim;
            ELEM *o = out + (r * heads + h) * dim;
            for (int d = 0; d < dim; d++) {
                float other = TO_FLOAT(in[d < half ? d + half : d - half]);
                o[d] = FROM_FLOAT(ROUND(TO_FLOAT(in[d]) * TO_FLOAT(c[d])) + ROUND(other * TO_FLOAT(s[d])));
            }
        }
    }
}

/* out[r] = ROUND(silu(gate)) * up where gate_up[r] = [gate | up], each `width` wide */
void T(silu_mul)(const ELEM *gate_up, ELEM *out, int64_t rows, int width,
                   int num_threads) {
    int threads = rows * width >= PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const ELEM *gate = gate_up + r * 2 * width, *up = gate + width;
        ELEM *o = out + r * width;
        for (int i = 0; i < width; i++) {
            float g = TO_FLOAT(gate[i]);
            o[i] = FROM_FLOAT(ROUND(g / (1.0f + expf(-g))) * TO_FLOAT(up[i]));
        }
    }
}
