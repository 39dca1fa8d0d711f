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

/* Subnormal floats flushed to zero inside a kernel only (each thread sets and restores its
 * own control register): the softmax's exp of a far-below-max score is subnormal, and x86
 * computes with subnormals by slow microcode. The process's own state is left alone. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define FLUSH_SUBNORMALS unsigned int saved_csr_ = _mm_getcsr(); _mm_setcsr(saved_csr_ | 0x8040u)
#define RESTORE_SUBNORMALS _mm_setcsr(saved_csr_)
#else
#define FLUSH_SUBNORMALS do {} while (0)
#define RESTORE_SUBNORMALS do {} while (0)
#endif

#endif
