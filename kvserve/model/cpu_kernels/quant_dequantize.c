/* Packed 4-bit or 8-bit weights back to floats (kvserve/model/cpu_kernels), for a matmul of
 * many rows: from DENSE_ROWS input rows (kvserve.model.quant.quant_linear) the dtype's own
 * matmul library, AMX or oneDNN's blocked kernels, outruns quant_matmul.c's integer one, and
 * one dequantization per call costs less than the difference.
 */
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "quant_layout.h"

/* The weights as floats in the packed column order (window w, step t, position p < 4 * nb:
 * column (16w + p / 4) * 32 + 4t + p % 4), float32 or bfloat16 (out_bf16): a matmul of many
 * rows multiplies them by its input's columns in that order (a prefill's oneDNN matmul
 * outruns the integer one once the rows are many). Plain loops the compiler vectorizes. */
void quant_dequantize(const uint8_t *codes, int bits, const void *scales, const void *offsets,
                      int scales_f16, int64_t N, int64_t K, void *out, int out_bf16, int threads) {
    const int64_t blocks = K / BLOCK, windows = (blocks + WINDOW - 1) / WINDOW;
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    const int64_t row_scales = bits == 4 ? blocks * (scales_f16 ? 2 : 4) : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = codes + n * row_bytes;
        const void *s = (const char *)scales + n * row_scales;
        const void *o = offsets && bits == 4 ? (const char *)offsets + n * row_scales : NULL;
        float scale[64], offset[64], value[64];
        for (int64_t w = 0; w < windows; w++) {
            const int nb = window_blocks(blocks, w), width = 4 * nb;
            for (int p = 0; p < width; p++) {
                const int64_t b = w * WINDOW + p / 4;
                scale[p] = bits == 4 ? scale_at(s, b, scales_f16) : *(const float *)s;
                offset[p] = bits == 8 ? -128.0f * scale[p] : o ? scale_at(o, b, scales_f16) : -8.0f * scale[p];
            }
            for (int t = 0; t < STEPS; t++) {
                const int64_t at = n * K + w * (WINDOW * BLOCK) + t * width;
                if (bits == 4) {
                    const uint8_t *step = row + w * 256 + t * (width / 2);
                    for (int p = 0; p < width / 2; p++) {
                        value[p] = (float)(step[p] & 0x0f) * scale[p] + offset[p];
                        value[p + width / 2] = (float)(step[p] >> 4) * scale[p + width / 2] + offset[p + width / 2];
                    }
                } else {
                    const uint8_t *step = row + w * 512 + t * width;
                    for (int p = 0; p < width; p++) value[p] = (float)step[p] * scale[p] + offset[p];
                }
                if (out_bf16)
                    for (int p = 0; p < width; p++) ((uint16_t *)out)[at + p] = to_bf(value[p]);
                else
                    memcpy((float *)out + at, value, sizeof(float) * (size_t)width);
            }
        }
    }
}
