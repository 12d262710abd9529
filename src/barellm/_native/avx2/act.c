/* AVX2 activation quantizers (quant_internal.h's BL_ACT_Q8 and BL_ACT_Q8X2 rows): a block's scale and int8
 * values computed as the scalar path does, so that every tier's matmuls see the same bytes. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"
#include "avx2/simd.h"

#define AI static inline __attribute__((always_inline))

/* int32 lanes of 4 vectors -> 32 int8 in element order (values already in int8 range) */
AI __m256i pack_i8(__m256i i0, __m256i i1, __m256i i2, __m256i i3) {
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

AI int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* max |x| over the 32 values of v[0..3] */
AI float block_amax(const __m256 *v) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

void bl_act_q8_avx2(const float *x, int cols, uint8_t *row, int b0, int b1) {
    const int nb = cols / BL_QK;
    for (int b = b0; b < b1; b++) {
        const float *xb = x + b * BL_QK;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        const float amax = block_amax(v);
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i[4];
        for (int k = 0; k < 4; k++) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));
        const __m256i p = pack_i8(i[0], i[1], i[2], i[3]);
        _mm256_storeu_si256((__m256i *)(row + (size_t)b * 32), p);
        /* the sum of the stored (saturated) bytes */
        const int32_t sum = hsum_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), p),
                                                         _mm256_set1_epi16(1)));
        bl_act_put_block(row, nb, 32, b, d, sum);
    }
}

void bl_act_q8x2_avx2(const float *x, int cols, uint8_t *row, int b0, int b1) {
    const int nb = cols / BL_QK;
    const __m256 c254 = _mm256_set1_ps(254.0f);
    const __m256i qmax = _mm256_set1_epi32(BL_Q8X2_MAX), qmin = _mm256_set1_epi32(-BL_Q8X2_MAX);
    const __m256i k254 = _mm256_set1_epi32(254);
    for (int b = b0; b < b1; b++) {
        const float *xb = x + b * BL_QK;
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(xb + 8 * k);
        const float amax = block_amax(v);
        const float d = amax / (float)BL_Q8X2_MAX, id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4], h[4], l[4], sum = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            q[k] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid)), qmin), qmax);
            h[k] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_cvtepi32_ps(q[k]), c254));
            l[k] = _mm256_sub_epi32(q[k], _mm256_mullo_epi32(h[k], k254));
            sum = _mm256_add_epi32(sum, q[k]);
        }
        _mm256_storeu_si256((__m256i *)(row + (size_t)b * 32), pack_i8(h[0], h[1], h[2], h[3]));
        _mm256_storeu_si256((__m256i *)(row + (size_t)(nb + b) * 32), pack_i8(l[0], l[1], l[2], l[3]));
        bl_act_put_block(row, nb, 64, b, d, hsum_epi32(sum));
    }
}
