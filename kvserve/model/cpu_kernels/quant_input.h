/* The input side of quant_matmul.c: each row of activations quantized to int8 in blocks of
 * 32 and laid out as the weights' windows (quant_matmul.c's header says how), so that one
 * VNNI instruction meets 4 columns of 16 blocks of both.
 */
#ifndef KVSERVE_QUANT_INPUT_H
#define KVSERVE_QUANT_INPUT_H
#include <math.h>
#include <stdint.h>

#include "bfloat16.h"
#include "quant_layout.h"

/* The quantized input, in the weights' window layout: per (row, window) 512 bytes of xq and
 * 16 lanes of dx and xs = dx * sum(xq) (zeros in a short window's empty lanes); xtot per row
 * is the sum of its xs, in block order (the 8-bit codes' +128 taken back). */
typedef struct {
    int8_t *xq;
    float *dx, *xs, *xtot;
    int64_t windows; /* per row */
} Quantized;

static void quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t K, Quantized *q,
                          int threads) {
    const int64_t blocks = K / BLOCK;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows > 1)
    for (int64_t m = 0; m < rows; m++) {
        float total = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t w = b / WINDOW;
            const int j = (int)(b % WINDOW), half = window_blocks(blocks, w) / 2;
            const int lane = j < half ? j : 8 + j - half;
            int8_t *dst = q->xq + (m * q->windows + w) * (STEPS * 64) + 4 * lane;
            float v[BLOCK], amax = 0.0f;
            for (int e = 0; e < BLOCK; e++) {
                const int64_t at = m * K + b * BLOCK + e;
                v[e] = x_bf16 ? bf(((const uint16_t *)x)[at]) : ((const float *)x)[at];
                amax = fmaxf(amax, fabsf(v[e]));
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int e = 0; e < BLOCK; e++) {
                long r = lrintf(v[e] * id);
                r = r > 127 ? 127 : (r < -127 ? -127 : r);
                dst[(e / 4) * 64 + e % 4] = (int8_t)r;
                sum += (int)r;
            }
            const int64_t at = (m * q->windows + w) * WINDOW + lane;
            q->dx[at] = d;
            q->xs[at] = d * (float)sum;
            total += q->xs[at];
        }
        q->xtot[m] = total;
    }
}

#endif
