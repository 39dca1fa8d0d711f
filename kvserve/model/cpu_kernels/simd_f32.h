/* float32 vectors for the CPU kernels (kvserve/model/cpu_kernels): one set of names over
 * AVX-512 (16 lanes) and AVX2 with FMA (8 lanes), so a kernel is written once and an
 * AVX2-only CPU (most laptops, AMD EPYC before Zen 4) runs the same loops at half width.
 * SIMD_F32 is defined when the build targets either; otherwise a kernel keeps its
 * portable path. Hand-written because the kernels need exactly these few operations and
 * their rounding fixed (no library of this size spans both instruction sets in C). */
#ifndef KVSERVE_SIMD_F32_H
#define KVSERVE_SIMD_F32_H

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define SIMD_F32 1
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define VLEN 16
typedef __m512 vf;
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf x) { return _mm512_reduce_add_ps(x); }
static inline float vf_top(vf x) { return _mm512_reduce_max_ps(x); }

/* the mask of lanes [0, count) (count may lie outside 0 .. 16) */
static inline __mmask16 first_lanes16(int count) {
    return (__mmask16)(count >= 16 ? 0xFFFF : count <= 0 ? 0 : ((1u << count) - 1));
}

/* lanes [0, count) of x, the others `fill` */
static inline vf vf_first(int count, vf x, vf fill) {
    return _mm512_mask_blend_ps(first_lanes16(count), fill, x);
}

static inline vf vf_round(vf x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf vf_below(vf x, vf floor, vf value) { /* x < floor ? 0 : value */
    return _mm512_maskz_mov_ps((__mmask16)~_mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ), value);
}
static inline vf vf_times_pow2(vf x, vf n) { return _mm512_scalef_ps(x, n); }

/* 16 bfloat16 -> 16 float */
static inline vf vf_load_bf16(const uint16_t *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* VLEN vectors -> one vector of their sums, lane i = the sum of v[i] (a transpose tree:
 * 45 instructions for 16 horizontal sums instead of 16 x 8) */
static inline vf vf_lane_sums(const vf *v) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}
#else
#define VLEN 8
typedef __m256 vf;
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float *p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }

static inline float vf_sum(vf x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float vf_top(vf x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

static inline vf vf_first(int count, vf x, vf fill) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane);
    return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(keep));
}

static inline vf vf_round(vf x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vf vf_below(vf x, vf floor, vf value) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, floor, _CMP_LT_OQ), value);
}
/* x * 2^n for whole n in [-126, 127]: n written into a float's exponent field */
static inline vf vf_times_pow2(vf x, vf n) {
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(x, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

static inline vf vf_load_bf16(const uint16_t *p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* 8 vectors -> lane i = the sum of v[i]: pairwise sums within each 128-bit half, then
 * the two halves added */
static inline vf vf_lane_sums(const vf *v) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* exp(x) within about 2 ulp: x = n ln2 + r (Cody-Waite), |r| <= ln2 / 2, exp(r) by its
 * degree-6 Taylor polynomial (error below 2^-23), times 2^n; about a third of glibc's
 * vector expf's time. Far below (x < -87) it is 0; x must stay below 88. */
static inline vf vf_exp(vf x) {
    const vf floor = vf_set1(-87.0f);
    vf clamped = vf_max(x, floor);
    vf n = vf_round(vf_mul(clamped, vf_set1(1.44269504088896341f)));
    vf r = vf_fmadd(n, vf_set1(-0.693145751953125f), clamped);
    r = vf_fmadd(n, vf_set1(-1.428606765330187e-06f), r);
    vf p = vf_set1(1.0f / 720.0f);
    p = vf_fmadd(p, r, vf_set1(1.0f / 120.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 24.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f / 6.0f));
    p = vf_fmadd(p, r, vf_set1(0.5f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    p = vf_fmadd(p, r, vf_set1(1.0f));
    return vf_below(x, floor, vf_times_pow2(p, n));
}
#endif /* SIMD_F32 */
#endif
