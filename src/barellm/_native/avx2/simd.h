/* AVX2+FMA helpers shared by the AVX2 kernels (ops, sampling, the quantized matmuls). Include after the
 * file's `#pragma GCC target`, so that they are compiled for that target. */
#ifndef BL_SIMD_AVX2_H
#define BL_SIMD_AVX2_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x, about 2 ulp, for x in [-87.3, 88.7] (clamped outside; so never exactly 0 or inf), on a vector of any
 * width: P is the intrinsics' prefix (_mm256, _mm512), V and VI the float and int vectors, ROUND the
 * round-to-nearest intrinsic, CASTI the int-to-float bit cast. One body for exp8 here and the avx512 tier's
 * exp16, so that the two stay the same operations lane for lane (the tiers' attention gives the same bits). */
#define BL_DEFINE_EXP(QUAL, name, V, VI, P, ROUND, CASTI)                                                  \
    QUAL V name(V x) {                                                                                    \
        x = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.33654f)), P##_set1_ps(88.72283f));                   \
        V n = ROUND(P##_mul_ps(x, P##_set1_ps(1.44269504088896341f)),                                     \
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                       \
        V r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x);                                             \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                            \
        V y = P##_set1_ps(1.9875691500e-4f);                                                              \
        y = P##_fmadd_ps(y, r, P##_set1_ps(1.3981999507e-3f));                                            \
        y = P##_fmadd_ps(y, r, P##_set1_ps(8.3334519073e-3f));                                            \
        y = P##_fmadd_ps(y, r, P##_set1_ps(4.1665795894e-2f));                                            \
        y = P##_fmadd_ps(y, r, P##_set1_ps(1.6666665459e-1f));                                            \
        y = P##_fmadd_ps(y, r, P##_set1_ps(5.0000001201e-1f));                                            \
        y = P##_fmadd_ps(y, P##_mul_ps(r, r), P##_add_ps(r, P##_set1_ps(1.0f)));                          \
        /* 2^n in two steps so n = 128 (x near the top of the range) does not overflow the exponent */    \
        VI ni = P##_cvtps_epi32(n);                                                                       \
        VI half = P##_srai_epi32(ni, 1);                                                                  \
        V p1 = CASTI(P##_slli_epi32(P##_add_epi32(half, P##_set1_epi32(127)), 23));                       \
        V p2 = CASTI(P##_slli_epi32(P##_add_epi32(P##_sub_epi32(ni, half), P##_set1_epi32(127)), 23));    \
        return P##_mul_ps(P##_mul_ps(y, p1), p2);                                                         \
    }

BL_DEFINE_EXP(static inline, exp8, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps)

/* e^x of one float: exp8's lane, so a vector loop's scalar tail gives its lanes' bits */
static inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }

/* The quantized matmuls' helpers, forced inline: they sit in the decode tiles' hot loops. */

/* the 4 bytes at p (any alignment) in every 32-bit lane */
static inline __attribute__((always_inline)) __m256i bcast32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

static inline __attribute__((always_inline)) __m256i lane_mask(int n) { /* lanes [0, n) all ones */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* MXFP4: the 8 E8M0 bytes at e (a block of 8 rows) as their scales 2^(e - 128), bl_e8m0_half's bits: (e - 1) << 23,
 * or for e < 2 the subnormal 0x00200000 << e */
static inline __attribute__((always_inline)) __m256 e8m0x8(const uint8_t *e) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)e));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(x, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), x);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(big, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), x)));
}

/* the first n (<= 8) floats of v to o */
static inline __attribute__((always_inline)) void store8(float *o, __m256 v, int n) {
    if (n == 8) _mm256_storeu_ps(o, v);
    else _mm256_maskstore_ps(o, lane_mask(n), v);
}

/* pshufb indices filling each 32-bit lane's bytes 0-3 with bytes b0-b3 of that lane (-128: a zero byte) */
static inline __attribute__((always_inline)) __m256i pick(int b0, int b1, int b2, int b3) {
    const __m256i base = _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4,
                                          4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m256i off = _mm256_set1_epi32((int)((uint32_t)(uint8_t)b0 | (uint32_t)(uint8_t)b1 << 8 |
                                                (uint32_t)(uint8_t)b2 << 16 | (uint32_t)(uint8_t)b3 << 24));
    /* 0x80 entries stay >= 0x80 after adding a base < 16: still "zero this byte" */
    return _mm256_add_epi8(base, off);
}

/* The 6-bit scales (mins: m = 1) of a unit's 8 rows from its 3 interleaved scale vectors: byte k of each
 * lane of *lo is sub-block k's, of *hi sub-block 4 + k's (see kq_q4k_scales). */
static inline __attribute__((always_inline)) void q4k_scales8(const uint8_t *s, const int m, __m256i *lo, __m256i *hi) {
    const __m256i m4 = _mm256_set1_epi8(15), m6 = _mm256_set1_epi8(63), m30 = _mm256_set1_epi8(0x30);
    const __m256i SA = _mm256_loadu_si256((const __m256i *)(const void *)s),
                  SB = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32)),
                  SC = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64));
    if (!m) {
        *lo = _mm256_and_si256(SA, m6);
        *hi = _mm256_or_si256(_mm256_and_si256(SC, m4), _mm256_and_si256(_mm256_srli_epi16(SA, 2), m30));
    } else {
        *lo = _mm256_and_si256(SB, m6);
        *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(SC, 4), m4),
                              _mm256_and_si256(_mm256_srli_epi16(SB, 2), m30));
    }
}

/* Q6_K's interleaved packed values (quant_kq.h): of three vectors holding values 4p + i (p < 3) in their low
 * 6 bits, the fourth vector's values (p = 3), spread over their top 2 bits */
static inline __attribute__((always_inline)) __m256i q6k_fourth(__m256i v1, __m256i v2, __m256i v3) {
    return _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v1, 6), _mm256_set1_epi8(3)),
                                           _mm256_and_si256(_mm256_srli_epi16(v2, 4), _mm256_set1_epi8(0x0c))),
                           _mm256_and_si256(_mm256_srli_epi16(v3, 2), _mm256_set1_epi8(0x30)));
}

#endif
