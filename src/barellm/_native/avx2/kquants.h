/* What the avx2 tier's K-quant kernels share: avx2/quant_kq.c's tiles and avx2/quant_kq_prefill.c's lean
 * tiles (the prefill path) walk a group of 8 rows unit by unit (a unit: a K-quant super-block, 8 rows of it
 * interleaved, quant_kq.h) with the same per-token state and the same float chains, so that every path gives
 * the scalar path's bits. Include after the file's `#pragma GCC target`. */
#ifndef BL_AVX2_KQUANTS_H
#define BL_AVX2_KQUANTS_H

#include <immintrin.h>
#include <stdint.h>

#include "quant_kq.h"
#include "avx2/simd.h"
#include "avx2/tiles.h"

#define AI static inline __attribute__((always_inline))
#define MAXNT 4
#define MAXNG 2 /* groups of a tile (decode's two streams) */

AI __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p)); }

AI __m256i load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }

/* A tile's per-token activation pointers, its accumulators acc[group][token] and each group's prefetch progress */
#define TOKENS(A, NG, NT)                                                                                \
    const int8_t *xq[MAXNT];                                                                             \
    const float *xd[MAXNT], *xs[MAXNT];                                                                  \
    const int32_t *xsq[MAXNT];                                                                           \
    __m256 acc[MAXNG][MAXNT];                                                                            \
    size_t pdone[MAXNG];                                                                                 \
    for (int g = 0; g < NG; g++) pdone[g] = 0;                                                           \
    for (int t = 0; t < NT; t++) {                                                                       \
        const bl_act_q8 a = bl_act_q8_view((A)->xa + (size_t)t * (A)->xs, nb * BL_QK);                    \
        xq[t] = a.qs, xd[t] = a.d, xs[t] = a.s, xsq[t] = a.sq;                                           \
        for (int g = 0; g < NG; g++) acc[g][t] = _mm256_setzero_ps();                                    \
    }                                                                                                    \
    (void)xsq, (void)xs, (void)pdone

#define STORE(A, NG, NT)                                                                                 \
    for (int g = 0; g < NG; g++)                                                                         \
        for (int t = 0; t < NT; t++) store8((A)[g].o + (size_t)t * (A)[g].ldo, acc[g][t], (A)[g].nvalid)

/* The start of unit u: where it is in each group (U bytes a unit; lean: in the group's scratch), and pu = 0 */
AI void unit_start(const int NG, const int NT, const tile_args *A, const int lean, const size_t U, const int u,
                   const uint8_t *p[MAXNG], __m256 pu[MAXNG][MAXNT]) {
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) {
        p[g] = (lean ? A[g].s : A[g].g) + (size_t)u * U;
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) pu[g][t] = _mm256_setzero_ps();
    }
}

/* Declares unit u's pointers gu and partial sums pu[group][token], and starts them (unit_start) */
#define UNIT(A, NG, NT, lean, U, u)                                                                      \
    const uint8_t *gu[MAXNG];                                                                            \
    __m256 pu[MAXNG][MAXNT];                                                                             \
    unit_start(NG, NT, A, lean, U, u, gu, pu)

/* The end of a unit: acc = fma(pu, d, acc), d the unit's 8 rows' scales at p[g] + off (f16 in a group, f32 in a
 * lean tile's scratch) */
AI void unit_end(const int NG, const int NT, const uint8_t *const p[MAXNG], const size_t off, const int f16,
                 __m256 pu[MAXNG][MAXNT], __m256 acc[MAXNG][MAXNT]) {
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) {
        const __m256 dw = f16 ? f16x8(p[g] + off) : _mm256_load_ps((const float *)(const void *)(p[g] + off));
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) acc[g][t] = _mm256_fmadd_ps(pu[g][t], dw, acc[g][t]);
    }
}

/* Q6_K's and Q3_K's block b into pu: its integer i32 less the offset's share 2^sh * (sa * sum(qx[0:16]) + sb *
 * sum(qx[16:32])) (sab: each row's two half scales as an int16 pair; A->xp: the half sums), converted once */
AI void q36k_block_end(const int NG, const int NT, const tile_args *A, const int b, const int sh,
                       const __m256i sab[MAXNG], __m256i i32[MAXNG][MAXNT], const float *const xd[MAXNT],
                       __m256 pu[MAXNG][MAXNT]) {
    const int nb = A->nu * 8;
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            const __m256i corr = _mm256_madd_epi16(sab[g], _mm256_set1_epi32(A->xp[(size_t)t * nb + b]));
            const __m256i i = _mm256_sub_epi32(i32[g][t], _mm256_slli_epi32(corr, sh));
            pu[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(xd[t][b]), pu[g][t]);
        }
}

/* Per sub-block j of a unit (Q4_K, Q5_K), its 6-bit scale as an int16 pair in each row's lane: the madd
 * partner of the sub-block's int16 dot sums. */
AI void q4k_scale_pairs(const uint8_t *s, __m256i scj[8]) {
    __m256i SL, SH;
    q4k_scales8(s, 0, &SL, &SH);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) scj[j] = _mm256_shuffle_epi8(j < 4 ? SL : SH, pick(j & 3, -128, j & 3, -128));
}

/* acc[t] -= the mins chain of Q4_K's and Q5_K's float work (quant_kq.h): accm = 0; for unit u: mu = 0; for
 * sub-block j: mu = fma(m_j, s_b, mu); accm = fma(mu, dmin_u, accm); then acc - accm. U: a unit's bytes,
 * SO and DMO: its scales' and dmin's offsets in it. */
AI void kq_minus_mins(const int NT, const size_t U, const size_t SO, const size_t DMO, const uint8_t *g, const int nu,
                      const float *const *xs, __m256 *acc) {
    __m256 accm[MAXNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) accm[t] = _mm256_setzero_ps();
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu = g + (size_t)u * U;
        __m256i ML, MH;
        q4k_scales8(gu + SO, 1, &ML, &MH);
        __m256 mf[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            mf[j] = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(j < 4 ? ML : MH, pick(j & 3, -128, -128, -128)));
        const __m256 dm = f16x8(gu + DMO);
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) {
            __m256 mu = _mm256_setzero_ps();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) mu = _mm256_fmadd_ps(mf[j], _mm256_set1_ps(xs[t][8 * u + j]), mu);
            accm[t] = _mm256_fmadd_ps(mu, dm, accm[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) acc[t] = _mm256_sub_ps(acc[t], accm[t]);
}

AI void q4k_minus_mins(const int NT, const uint8_t *g, const int nu, const float *const *xs, __m256 *acc) {
    kq_minus_mins(NT, 1152, 1024, 1136, g, nu, xs, acc);
}

/* avx2/quant_kq_prefill.c: the prefill path of Q4_K and Q6_K (xp: the activations' half sums, Q6_K's); 0 when
 * it ran, -1 when there was no memory for its scratch (the caller takes the tiles instead) */
int bl_kq_prefill_q4_k_avx2(const bl_matrix *w, const void *xq, int T, const int32_t *xp, float *out, size_t ldo,
                            int r0, int r1);
int bl_kq_prefill_q6_k_avx2(const bl_matrix *w, const void *xq, int T, const int32_t *xp, float *out, size_t ldo,
                            int r0, int r1);

#endif
