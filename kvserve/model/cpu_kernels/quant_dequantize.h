/* One packed 4-bit or 8-bit weight row back to floats, in the packed column order (window w,
 * step t, position p < 4 * nb: column (16w + p / 4) * 32 + 4t + p % 4), float32 or bfloat16
 * (out_bf16): quant_dequantize.c's rows for a dense matmul, and quant_matmul_amx.h's tiles.
 * Plain loops the compiler vectorizes. */
#ifndef KVSERVE_QUANT_DEQUANTIZE_H
#define KVSERVE_QUANT_DEQUANTIZE_H
#include <stdint.h>
#include <string.h>

#include "bfloat16.h"
#include "quant_layout.h"

/* Window w of a row (s, o as dequantize_row's), out at the window's first position. */
static inline void dequantize_window(const uint8_t *row, int bits, const void *s, const void *o,
                                     int scales_f16, int64_t blocks, int64_t w, void *out,
                                     int out_bf16) {
    const int nb = window_blocks(blocks, w), width = 4 * nb;
    float scale[64], offset[64], value[64];
    for (int p = 0; p < width; p++) {
        const int64_t b = w * WINDOW + p / 4;
        scale[p] = bits == 4 ? scale_at(s, b, scales_f16) : *(const float *)s;
        offset[p] = bits == 8 ? -128.0f * scale[p] : o ? scale_at(o, b, scales_f16) : -8.0f * scale[p];
    }
    for (int t = 0; t < STEPS; t++) {
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
            for (int p = 0; p < width; p++) ((uint16_t *)out)[t * width + p] = to_bf(value[p]);
        else
            memcpy((float *)out + t * width, value, sizeof(float) * (size_t)width);
    }
}

/* s: the row's scales (4 bits: one per block, float16 when scales_f16; 8 bits: one float32),
 * o: its offsets or NULL (4 bits: -8 * scale, Q4_0's). */
static inline void dequantize_row(const uint8_t *row, int bits, const void *s, const void *o,
                                  int scales_f16, int64_t K, void *out, int out_bf16) {
    const int64_t blocks = K / BLOCK;
    for (int64_t w = 0; w * WINDOW < blocks; w++)
        dequantize_window(row, bits, s, o, scales_f16, blocks, w,
                          (char *)out + w * (WINDOW * BLOCK) * (out_bf16 ? 2 : 4), out_bf16);
}

#endif
