/* quant_matmul.c's window_rows for AVX2 (with AVX-VNNI where present): the same integer sums
 * as the AVX-512 path, a window's 16 lanes as two halves of 8 (quant_matmul.c includes it;
 * Quantized is quant_input.h's). */
/* acc + u (codes 0..15) times x: with VNNI acc holds the sums over each 4 bytes; without,
 * the sums over each 2 bytes (int16: a window's 8 steps of 2 * 15 * 127 stay within 30,480),
 * turned into 4-byte sums once a window (U4_PAIRS). */
#if defined(__AVXVNNI__)
#define U4_PAIRS 0
static inline __m256i dot_u4_s8(__m256i acc, __m256i u, __m256i x) {
    return _mm256_dpbusd_avx_epi32(acc, u, x);
}
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define U4_PAIRS 0
static inline __m256i dot_u4_s8(__m256i acc, __m256i u, __m256i x) {
    return _mm256_dpbusd_epi32(acc, u, x);
}
#else
#define U4_PAIRS 1
static inline __m256i dot_u4_s8(__m256i acc, __m256i u, __m256i x) {
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, x));
}
#endif

/* sum over each 4 bytes of w * x, both int8 in -127..127 (|x| times w with x's sign). */
static inline __m256i dot_s8_s8(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(w, x)),
                             _mm256_set1_epi16(1));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 per-block factors from b0 (half of them in a short window, zeros after). */
static inline __m256 lanes8(const void *s, int64_t b0, int half, int f16) {
    if (half == 8) {
        if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + b0)));
        return _mm256_loadu_ps((const float *)s + b0);
    }
    float v[8] = {0};
    for (int i = 0; i < half; i++) v[i] = scale_at(s, b0 + i, f16);
    return _mm256_loadu_ps(v);
}

static inline __m256i load_bytes(const uint8_t *p, int half) {
    if (half == 8) return _mm256_loadu_si256((const __m256i *)p);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_epi32((const int *)p, _mm256_cmpgt_epi32(_mm256_set1_epi32(half), lane));
}

/* One window of one weight row against mt input rows, lanes 0-7 and 8-15 as two halves. */
static inline __attribute__((always_inline)) void one_window(
    const uint8_t *wc, const int bits, const int packed, const void *scales, const void *offsets,
    int f16, const Quantized *q, int64_t w, const int half, int64_t m0, const int mt,
    __m256 (*acc)[2], __m256 (*off)[2]) {
    const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
    __m256i dot[TILE][2];
    for (int m = 0; m < mt; m++) dot[m][0] = dot[m][1] = _mm256_setzero_si256();
    for (int t = 0; t < STEPS; t++) {
        __m256i u[2];
        if (packed) {
            const __m256i v = load_bytes(wc + t * 4 * half, half);
            u[0] = _mm256_and_si256(v, low);
            u[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        } else if (bits == 4) {
            u[0] = load_bytes(wc + t * 8 * half, half);
            u[1] = load_bytes(wc + t * 8 * half + 4 * half, half);
        } else {
            u[0] = _mm256_xor_si256(load_bytes(wc + t * 8 * half, half), flip);
            u[1] = _mm256_xor_si256(load_bytes(wc + t * 8 * half + 4 * half, half), flip);
        }
        for (int m = 0; m < mt; m++) {
            const int8_t *xq = q->xq + ((m0 + m) * q->windows + w) * (STEPS * 64) + t * 64;
            for (int h = 0; h < 2; h++) {
                const __m256i xv = _mm256_load_si256((const __m256i *)(xq + 32 * h));
                dot[m][h] = bits == 4 ? dot_u4_s8(dot[m][h], u[h], xv)
                                      : _mm256_add_epi32(dot[m][h], dot_s8_s8(u[h], xv));
            }
        }
    }
    if (bits == 4 && U4_PAIRS)
        for (int m = 0; m < mt; m++)
            for (int h = 0; h < 2; h++) dot[m][h] = _mm256_madd_epi16(dot[m][h], _mm256_set1_epi16(1));
    for (int h = 0; h < 2; h++) {
        const int64_t b0 = w * WINDOW + h * half;
        const __m256 s = bits == 4 ? lanes8(scales, b0, half, f16) : _mm256_set1_ps(1.0f);
        const __m256 o = bits != 4 ? _mm256_setzero_ps()
                         : offsets ? lanes8(offsets, b0, half, f16)
                                   : _mm256_mul_ps(s, _mm256_set1_ps(-8.0f));
        for (int m = 0; m < mt; m++) {
            const int64_t at = ((m0 + m) * q->windows + w) * WINDOW + 8 * h;
            const __m256 sd = _mm256_mul_ps(s, _mm256_load_ps(q->dx + at));
            acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m][h]), sd, acc[m][h]);
            off[m][h] = _mm256_fmadd_ps(o, _mm256_load_ps(q->xs + at), off[m][h]);
        }
    }
}

static inline __attribute__((always_inline)) void window_rows(
    const uint8_t *codes, const int bits, const int packed, const void *scales,
    const void *offsets, int f16, const Quantized *q, int64_t m0, const int mt, int64_t K,
    float *res) {
    const int64_t blocks = K / BLOCK, whole = blocks / WINDOW;
    const int64_t window_bytes = packed ? 256 : 512;
    __m256 acc[TILE][2], off[TILE][2];
    for (int m = 0; m < mt; m++)
        acc[m][0] = acc[m][1] = off[m][0] = off[m][1] = _mm256_setzero_ps();
    for (int64_t w = 0; w < whole; w++) {
        if (packed || bits == 8) /* not an unpacked row: that one is in L1 */
            prefetch_ahead(codes, w, window_bytes, scales, offsets, f16, bits);
        one_window(codes + w * window_bytes, bits, packed, scales, offsets, f16, q, w, 8, m0, mt,
                   acc, off);
    }
    if (whole < q->windows)
        one_window(codes + whole * window_bytes, bits, packed, scales, offsets, f16, q, whole,
                   window_blocks(blocks, whole) / 2, m0, mt, acc, off);
    for (int m = 0; m < mt; m++) {
        const float dot = sum8(_mm256_add_ps(acc[m][0], acc[m][1]));
        res[m] = bits == 4 ? dot + sum8(_mm256_add_ps(off[m][0], off[m][1]))
                           : *(const float *)scales * dot;
    }
}
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define PATH_NAME "avx2-vnni"
#else
#define PATH_NAME "avx2"
#endif

