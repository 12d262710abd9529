/* AVX-512 helpers shared by the avx512 tier's quantized matmuls. Include after the file's `#pragma GCC target`,
 * so that they are compiled for that target. */
#ifndef BL_SIMD_AVX512_H
#define BL_SIMD_AVX512_H

#include <immintrin.h>
#include <stdint.h>

#include "quant_internal.h"

/* the 4 bytes at p (any alignment) in every 32-bit lane */
static inline __attribute__((always_inline)) __m512i bcast(const int8_t *p) { return _mm512_set1_epi32(bl_rd32(p)); }

/* the 8 f16 of group A's rows then group B's (B NULL: zeros) as 16 floats */
static inline __attribute__((always_inline)) __m512 f16x16(const uint8_t *a, const uint8_t *b) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)a));
    const __m256 hi = b ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)b)) : _mm256_setzero_ps();
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* a 32-byte vector of group A and the matching one of group B (NULL: zeros) as one 64-byte vector */
static inline __attribute__((always_inline)) __m512i pair32(const uint8_t *a, const uint8_t *b) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)a);
    const __m256i hi = b ? _mm256_loadu_si256((const __m256i *)(const void *)b) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

#endif
