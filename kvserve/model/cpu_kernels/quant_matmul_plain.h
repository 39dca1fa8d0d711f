/* quant_matmul.c's window_rows for a build with neither AVX2 nor AVX-512: the same integer
 * sums and scalings, one block at a time (quant_matmul.c includes it; Quantized is
 * quant_input.h's). */
static inline void window_rows(const uint8_t *codes, int bits, int packed, const void *scales,
                               const void *offsets, int f16, const Quantized *q, int64_t m0,
                               const int mt, int64_t K, float *res) {
    const int64_t blocks = K / BLOCK;
    for (int m = 0; m < mt; m++) {
        float acc = 0.0f, off = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t w = b / WINDOW;
            const int j = (int)(b % WINDOW), half = window_blocks(blocks, w) / 2;
            const int h = j >= half, lane = j - h * half;
            const uint8_t *wc = codes + w * (packed ? 256 : 512);
            const int8_t *xq = q->xq + ((m0 + m) * q->windows + w) * (STEPS * 64) + 32 * h + 4 * lane;
            int dot = 0;
            for (int e = 0; e < BLOCK; e++) {
                const int t = e / 4, i = e % 4;
                const int code = packed ? (wc[t * 4 * half + 4 * lane + i] >> (4 * h)) & 0x0f
                                        : wc[t * 8 * half + h * 4 * half + 4 * lane + i] -
                                              (bits == 8 ? 128 : 0);
                dot += code * xq[t * 64 + i];
            }
            const int64_t at = ((m0 + m) * q->windows + w) * WINDOW + 8 * h + lane;
            if (bits == 4) {
                const float s = scale_at(scales, b, f16);
                acc += (float)dot * (s * q->dx[at]);
                off += (offsets ? scale_at(offsets, b, f16) : -8.0f * s) * q->xs[at];
            } else {
                acc += (float)dot * q->dx[at];
            }
        }
        res[m] = bits == 4 ? acc + off : *(const float *)scales * acc;
    }
}
