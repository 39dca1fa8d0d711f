/* bfloat16 <-> float for the CPU kernels (kvserve/model/cpu_kernels): a bfloat16 is the
 * top half of a float32; rounding to it is to nearest even, NaN kept a NaN, as torch's. */
#ifndef KVSERVE_BFLOAT16_H
#define KVSERVE_BFLOAT16_H
#include <stdint.h>

static inline float bf(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t to_bf(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float round_bf(float f) { return bf(to_bf(f)); }

#endif
