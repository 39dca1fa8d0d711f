/* Packed 4-bit or 8-bit weights back to floats (kvserve/model/cpu_kernels), for a matmul of
 * many rows: from DENSE_ROWS input rows (kvserve.model.quant.quant_linear) the dtype's own
 * matmul library, AMX or oneDNN's blocked kernels, outruns quant_matmul.c's integer one, and
 * one dequantization per call costs less than the difference.
 */
#include <stdint.h>

#include "quant_dequantize.h"

/* The weights [N, K] as floats in the packed column order (quant_dequantize.h's
 * dequantize_row), float32 or bfloat16 (out_bf16): a matmul of many rows multiplies them by
 * its input's columns in that order. */
void quant_dequantize(const uint8_t *codes, int bits, const void *scales, const void *offsets,
                      int scales_f16, int64_t N, int64_t K, void *out, int out_bf16, int threads) {
    const int64_t row_bytes = bits == 4 ? K / 2 : K;
    const int64_t row_scales = bits == 4 ? K / BLOCK * (scales_f16 ? 2 : 4) : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const void *o = offsets && bits == 4 ? (const char *)offsets + n * row_scales : NULL;
        dequantize_row(codes + n * row_bytes, bits, (const char *)scales + n * row_scales, o,
                       scales_f16, K, (char *)out + n * K * (out_bf16 ? 2 : 4), out_bf16);
    }
}
