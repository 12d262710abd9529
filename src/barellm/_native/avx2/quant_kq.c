/* AVX2/FMA kernels for Q5_0 and the K-quants (Q3_K, Q4_K, Q5_K, Q6_K). They do the float work of quant_kq.h in exactly the scalar
 * path's order (every float operation an explicit intrinsic, so no contraction can differ); the integer
 * work is exact, so its order is free.
 *
 * All work is done on the interleaved layout (quant_kq.h): a 32-byte vector, once unpacked, holds 4
 * consecutive values of each of 8 rows, so a broadcast of the 4 matching activation bytes and one maddubs
 * give each 32-bit lane a partial dot of one row, and the 8 lanes end as the 8 rows' block sums with no
 * horizontal reduction. GGUF rows are interleaved 8 at a time into a scratch group first (slower: the
 * fast layout is the interleaved one). A tile is NG groups of 8 rows x NT tokens, one kernel per type for
 * both shapes it comes in: NG = 1, NT <= 4 (prefill: each weight vector loaded and unpacked once for NT
 * tokens) and NG = 2, NT = 1 (decode: each activation broadcast serves two groups read from two streams,
 * see two_streams). NG and NT are compile-time constants, so each instantiation has its own fully unrolled
 * loops, its accumulators in registers.
 *
 * 16-bit sums (maddubs lanes, each a sum of two products, add up in int16 before a madd widens them):
 *   Q5_0  q < 32: |pair| <= 2 * 31 * 128 = 7936, 4 pairs a madd;
 *   Q4_K  q < 16: |pair| <= 3840, the 8 vectors of a sub-block (30720) a madd, with the scale as the
 *         madd's other operand (sc * dot in one step);
 *   Q5_K  q < 32: |pair| <= 7936, 4 vectors a madd (31744), with the sub-block's scale;
 *   Q6_K  q < 64: |pair| <= 16128, 2 pairs a madd, again with the 16-value half's scale; the -32 offset
 *         is taken off once per block as 32 * (sa * sum(qx[0:16]) + sb * sum(qx[16:32]));
 *   Q3_K  u = q + 4 < 8: |pair| <= 1792, a 16-value half (4 vectors) a madd with its scale; the -4 offset
 *         taken off as Q6_K's -32.
 */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_kq.h"
#include "tier.h"
#include "avx2/simd.h"
#include "avx2/tiles.h"

#define AI static inline __attribute__((always_inline))
#define MAXNT 4
#define MAXNG 2 /* groups of a tile (decode's two streams) */
/* Software prefetch (kernels.h's rules, BL_PF_KQUANTS): without it the weights' stream from memory runs
 * well behind the compute (measured on Zen 3 at T = 1, weights from memory: 55-65% of a plain read's rate
 * without, 80-95% at 8 KB ahead; 4-12 KB do about as well). With two threads streaming at once, NTA
 * prefetches 16 KB ahead did better there: the Q4_K tile 94-95% -> 95-97% of a plain 2-thread read, Q6_K
 * 87-92% -> 93-96% (16-32 KB alike). cpu.c holds each CPU family's rule. */

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

/* ---- Q5_0 ---- */

AI void tile_q5_0(const int NG, const int NT, const tile_args *A) {
    const int nb = A->nu;
    const size_t U = 176; /* kq_fields8_of(BL_Q5_0): packed values 0, d 160 */
    const __m256i m5 = _mm256_set1_epi8(31), m7 = _mm256_set1_epi8(7), m18 = _mm256_set1_epi8(0x18);
    const __m256i ones = _mm256_set1_epi16(1);
    TOKENS(A, NG, NT);
    for (int b = 0; b < nb; b++) {
        const uint8_t *q[MAXNG];
        __m256i X[MAXNG], i32[MAXNG][MAXNT];
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            prefetch_part(&A[g], &pdone[g], b, 0, 1);
            q[g] = A[g].g + (size_t)b * U;
            /* vector j: values 4j + i in bits 0-4, 16 + 4j + i: low 3 bits in bits 5-7, top 2 bits in bits 2j,
             * 2j + 1 of X */
            X[g] = load(q[g] + 128);
        }
#pragma GCC unroll 2
        for (int jp = 0; jp < 2; jp++) {
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) {
                __m256i lo[2], hi[2];
#pragma GCC unroll 2
                for (int e = 0; e < 2; e++) {
                    const int j = 2 * jp + e;
                    const __m256i M = load(q[g] + 32 * j);
                    const __m256i xh = j == 0 ? _mm256_slli_epi16(X[g], 3) : j == 1 ? _mm256_slli_epi16(X[g], 1)
                                       : j == 2 ? _mm256_srli_epi16(X[g], 1) : _mm256_srli_epi16(X[g], 3);
                    lo[e] = _mm256_and_si256(M, m5);
                    hi[e] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(M, 5), m7), _mm256_and_si256(xh, m18));
                }
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const int8_t *x = xq[t] + (size_t)b * 32 + 8 * jp;
                    const __m256i s = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[0], bcast32(x)),
                                                                        _mm256_maddubs_epi16(hi[0], bcast32(x + 16))),
                                                       _mm256_add_epi16(_mm256_maddubs_epi16(lo[1], bcast32(x + 4)),
                                                                        _mm256_maddubs_epi16(hi[1], bcast32(x + 20))));
                    const __m256i p = _mm256_madd_epi16(s, ones);
                    i32[g][t] = jp ? _mm256_add_epi32(i32[g][t], p) : p;
                }
            }
        }
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            const __m256 dw = f16x8(q[g] + 160);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m256i i = _mm256_sub_epi32(i32[g][t], _mm256_set1_epi32(16 * xsq[t][b]));
                acc[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, _mm256_set1_ps(xd[t][b])),
                                            acc[g][t]);
            }
        }
    }
    STORE(A, NG, NT);
}

/* ---- Q4_K ---- */

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

/* The Q4_K (five = 0) or Q5_K (five = 1) tile. Q5_K adds each value's fifth bit from qh and, its 16-bit sums
 * being larger, takes a madd every 4 vectors instead of every 8. */
AI void tile_q45_k(const int NG, const int NT, const int five, const tile_args *A) {
    const int nu = A->nu, nb = nu * 8;
    /* kq_fields8_of: Q4_K qs 0, scales 1024, d 1120, dmin 1136; Q5_K qs 0, qh 1024, scales 1280, d 1376,
     * dmin 1392 */
    const size_t U = five ? 1408 : 1152, SO = five ? 1280 : 1024, DO = SO + 96;
    const __m256i m4 = _mm256_set1_epi8(15), m16 = _mm256_set1_epi8(16);
    TOKENS(A, NG, NT);
    /* acc: the scales chain */
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu[MAXNG];
        /* kept in memory, not in registers, across the loop below */
        __m256i scj[MAXNG][8];
        __m256 pu[MAXNG][MAXNT];
        unit_start(NG, NT, A, 0, U, u, gu, pu);
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) q4k_scale_pairs(gu[g] + SO, scj[g]);
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) {
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) prefetch_part(&A[g], &pdone[g], u, c, 4);
#pragma GCC unroll 2
            for (int hi = 0; hi < 2; hi++) {
                const int j = 2 * c + hi, b = 8 * u + j;
                const __m256i bit = _mm256_set1_epi8((char)(1 << j)); /* Q5_K: sub-block j's fifth bits */
                __m256i s[MAXNG][MAXNT], i32[MAXNG][MAXNT];
#pragma GCC unroll 8
                for (int jj = 0; jj < 8; jj++) {
#pragma GCC unroll 2
                    for (int g = 0; g < NG; g++) {
                        const __m256i v = load(gu[g] + 256 * c + 32 * jj);
                        __m256i n = hi ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
                        if (five) {
                            const __m256i h = load(gu[g] + 1024 + 32 * jj);
                            const __m256i h5 = _mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit);
                            n = _mm256_or_si256(n, _mm256_and_si256(h5, m16));
                        }
#pragma GCC unroll 4
                        for (int t = 0; t < NT; t++) {
                            const __m256i p = _mm256_maddubs_epi16(n, bcast32(xq[t] + (size_t)b * 32 + 4 * jj));
                            const int first = five ? (jj & 3) == 0 : jj == 0;
                            s[g][t] = first ? p : _mm256_add_epi16(s[g][t], p);
                            if (five && (jj & 3) == 3) {
                                const __m256i m = _mm256_madd_epi16(s[g][t], scj[g][j]);
                                i32[g][t] = jj == 3 ? m : _mm256_add_epi32(i32[g][t], m);
                            }
                        }
                    }
                }
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
                    for (int t = 0; t < NT; t++) {
                        const __m256i dot = five ? i32[g][t] : _mm256_madd_epi16(s[g][t], scj[g][j]);
                        pu[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[t][b]), pu[g][t]);
                    }
            }
        }
        unit_end(NG, NT, gu, DO, 1, pu, acc);
    }
    /* accm: the mins chain, a pass of its own (fewer live registers; the group is in cache by now) */
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) kq_minus_mins(NT, U, SO, DO + 16, A[g].g, nu, xs, acc[g]);
    STORE(A, NG, NT);
}

/* ---- Q6_K ---- */

AI void tile_q6_k(const int NG, const int NT, const tile_args *A) {
    const int nu = A->nu, nb = nu * 8;
    const size_t U = 1680; /* kq_fields8_of(BL_Q6_K): packed values 0, scales 1536, d 1664 */
    const __m256i m6 = _mm256_set1_epi8(63);
    TOKENS(A, NG, NT);
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu[MAXNG];
        __m256 pu[MAXNG][MAXNT];
        unit_start(NG, NT, A, 0, U, u, gu, pu);
#pragma GCC unroll 1
        for (int k2 = 0; k2 < 4; k2++) {
            /* scales 2 kb and 2 kb + 1 of blocks kb = 2 k2, 2 k2 + 1: bytes 0-3 of the lanes of SV */
            __m256i SV[MAXNG];
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) SV[g] = load(gu[g] + 1536 + 32 * k2);
#pragma GCC unroll 2
            for (int odd = 0; odd < 2; odd++) {
                const int kb = 2 * k2 + odd, b = 8 * u + kb, o = 2 * odd;
                __m256i i32[MAXNG][MAXNT];
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) prefetch_part(&A[g], &pdone[g], u, kb, 8);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
#pragma GCC unroll 2
                    for (int g = 0; g < NG; g++) {
                        /* values 4j + i, j = 4h .. 4h + 3, of the block: three vectors, the fourth spread over
                         * their top bits */
                        const uint8_t *q = gu[g] + 192 * kb + 96 * h;
                        const __m256i V1 = load(q), V2 = load(q + 32), V3 = load(q + 64);
                        const __m256i q0 = _mm256_and_si256(V1, m6), q1 = _mm256_and_si256(V2, m6);
                        const __m256i q2 = _mm256_and_si256(V3, m6);
                        const __m256i q3 = q6k_fourth(V1, V2, V3);
                        const __m256i sc = _mm256_srai_epi16(
                            _mm256_shuffle_epi8(SV[g], pick(-128, o + h, -128, o + h)), 8);
#pragma GCC unroll 4
                        for (int t = 0; t < NT; t++) {
                            const int8_t *x = xq[t] + (size_t)b * 32 + 16 * h;
                            const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(q0, bcast32(x)),
                                                                _mm256_maddubs_epi16(q1, bcast32(x + 4)));
                            const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(q2, bcast32(x + 8)),
                                                                _mm256_maddubs_epi16(q3, bcast32(x + 12)));
                            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(s0, sc), _mm256_madd_epi16(s1, sc));
                            i32[g][t] = h ? _mm256_add_epi32(i32[g][t], p) : p;
                        }
                    }
                }
                __m256i sab[MAXNG];
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++)
                    sab[g] = _mm256_srai_epi16(_mm256_shuffle_epi8(SV[g], pick(-128, o, -128, o + 1)), 8);
                q36k_block_end(NG, NT, A, b, 5, sab, i32, xd, pu);
            }
        }
        unit_end(NG, NT, gu, 1664, 1, pu, acc);
    }
    STORE(A, NG, NT);
}

/* ---- Q3_K ---- */

/* The 16 scales (sc - 32) of a unit's 8 rows from its 3 interleaved scale vectors: byte k of each lane of
 * v[i] is scale 4i + k of that row (see kq_q3k_scales). */
AI void q3k_scales8(const uint8_t *s, __m256i v[4]) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    const __m256i SA = load(s), SB = load(s + 32), SC = load(s + 64);
    const __m256i lo[4] = {_mm256_and_si256(SA, m4), _mm256_and_si256(SB, m4),
                           _mm256_and_si256(_mm256_srli_epi16(SA, 4), m4), _mm256_and_si256(_mm256_srli_epi16(SB, 4), m4)};
    const __m256i hi[4] = {_mm256_and_si256(SC, m3), _mm256_and_si256(_mm256_srli_epi16(SC, 2), m3),
                           _mm256_and_si256(_mm256_srli_epi16(SC, 4), m3), _mm256_and_si256(_mm256_srli_epi16(SC, 6), m3)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) v[i] = _mm256_sub_epi8(_mm256_or_si256(lo[i], _mm256_slli_epi16(hi[i], 4)), k32);
}

AI void tile_q3_k(const int NG, const int NT, const tile_args *A) {
    const int nu = A->nu, nb = nu * 8;
    const size_t U = 880; /* KQ_Q3_K: qs 0, hmask 512, scales 768, d 864 */
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    TOKENS(A, NG, NT);
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu[MAXNG];
        __m256i SV[MAXNG][4];
        __m256 pu[MAXNG][MAXNT];
        unit_start(NG, NT, A, 0, U, u, gu, pu);
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) q3k_scales8(gu[g] + 768, SV[g]);
#pragma GCC unroll 1
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb, h = kb / 4, k = kb % 4, o = 2 * (kb & 1);
            const __m256i bit = _mm256_set1_epi8((char)(1 << (4 * h + k))); /* the block's hmask bit */
            const __m128i sh = _mm_cvtsi32_si128(2 * k);
            __m256i i32[MAXNG][MAXNT];
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) prefetch_part(&A[g], &pdone[g], u, kb, 8);
#pragma GCC unroll 2
            for (int a = 0; a < 2; a++) {
                __m256i s[MAXNG][MAXNT];
#pragma GCC unroll 4
                for (int j4 = 0; j4 < 4; j4++) {
                    const int jj = 4 * a + j4;
#pragma GCC unroll 2
                    for (int g = 0; g < NG; g++) {
                        const __m256i qv = load(gu[g] + 32 * (8 * h + jj)), hv = load(gu[g] + 512 + 32 * jj);
                        const __m256i un =
                            _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(qv, sh), m3),
                                            _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit), m4));
#pragma GCC unroll 4
                        for (int t = 0; t < NT; t++) {
                            const __m256i p = _mm256_maddubs_epi16(un, bcast32(xq[t] + (size_t)b * 32 + 4 * jj));
                            s[g][t] = j4 ? _mm256_add_epi16(s[g][t], p) : p;
                        }
                    }
                }
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) {
                    /* scale 2 kb + a as an int16 pair (sign-extended from the high byte) */
                    const __m256i sc =
                        _mm256_srai_epi16(_mm256_shuffle_epi8(SV[g][kb / 2], pick(-128, o + a, -128, o + a)), 8);
#pragma GCC unroll 4
                    for (int t = 0; t < NT; t++) {
                        const __m256i p = _mm256_madd_epi16(s[g][t], sc);
                        i32[g][t] = a ? _mm256_add_epi32(i32[g][t], p) : p;
                    }
                }
            }
            __m256i sab[MAXNG];
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++)
                sab[g] = _mm256_srai_epi16(_mm256_shuffle_epi8(SV[g][kb / 2], pick(-128, o, -128, o + 1)), 8);
            q36k_block_end(NG, NT, A, b, 2, sab, i32, xd, pu);
        }
        unit_end(NG, NT, gu, 864, 1, pu, acc);
    }
    STORE(A, NG, NT);
}

#define TILES(name, tile)                                                                                \
    static void name##_1(tile_args *A) { tile(1, 1, A); }                                          \
    static void name##_2(tile_args *A) { tile(1, 2, A); }                                          \
    static void name##_3(tile_args *A) { tile(1, 3, A); }                                          \
    static void name##_4(tile_args *A) { tile(1, 4, A); }                                          \
    static void name##_g2(tile_args *A) { tile(2, 1, A); }
AI void tile_q4_k(const int NG, const int NT, const tile_args *A) { tile_q45_k(NG, NT, 0, A); }
AI void tile_q5_k(const int NG, const int NT, const tile_args *A) { tile_q45_k(NG, NT, 1, A); }
TILES(q50, tile_q5_0)
TILES(q4k, tile_q4_k)
TILES(q6k, tile_q6_k)
TILES(q5k, tile_q5_k)
TILES(q3k, tile_q3_k)

/* ---- prefill: each group unpacked once, then every token of the call ----
 *
 * With many tokens the tiles above unpack every weight vector again for each 4 tokens and broadcast every
 * activation granule once per 8 rows. Here a group's values are first unpacked into plain u8 vectors (and
 * its scales into the madd operands) in a scratch buffer that stays in cache, and a lean loop then runs
 * over two groups (16 rows) and PNT tokens at a time: each activation broadcast serves 16 rows, each loaded
 * vector PNT tokens, and no value is unpacked twice. The integer sums are the same exact integers and the
 * float work is the tiles' own, in the same order, so the bits are those of every other path. */
#define PNT 2
#define PREFILL_MIN_T 8
enum { Q4K_UNIT_SCRATCH = 64 * 32 + 8 * 32 + 32, Q6K_UNIT_SCRATCH = 64 * 32 + 24 * 32 + 32 };

/* Q4_K unit u of a group -> scratch: vals [sub-block j][granule jj] (32 B each), sc [j] (madd operands:
 * the sub-block's scale in both int16 halves of each row's lane), d (8 f32) */
static void unpack_q4k(const uint8_t *g, int nu, uint8_t *dst) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu = g + (size_t)u * 1152;
        uint8_t *o = dst + (size_t)u * Q4K_UNIT_SCRATCH;
        __m256i scj[8];
        q4k_scale_pairs(gu + 1024, scj);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)(void *)(o + 2048 + 32 * j), scj[j]);
        for (int c = 0; c < 4; c++)
            for (int jj = 0; jj < 8; jj++) {
                const __m256i v = load(gu + 256 * c + 32 * jj);
                _mm256_store_si256((__m256i *)(void *)(o + 32 * (8 * (2 * c) + jj)), _mm256_and_si256(v, m4));
                _mm256_store_si256((__m256i *)(void *)(o + 32 * (8 * (2 * c + 1) + jj)),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            }
        _mm256_store_ps((float *)(void *)(o + 2304), f16x8(gu + 1120));
    }
}

/* Q6_K unit u of a group -> scratch: vals [block kb][granule j] (values 0..63), sc [kb][half] (the half's
 * scale, sign-extended, in both int16 halves of each lane), sab [kb] (both halves' scales as one int16 pair:
 * the -32 correction's operand), d (8 f32) */
static void unpack_q6k(const uint8_t *g, int nu, uint8_t *dst) {
    const __m256i m6 = _mm256_set1_epi8(63);
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu = g + (size_t)u * 1680;
        uint8_t *o = dst + (size_t)u * Q6K_UNIT_SCRATCH;
        for (int kb = 0; kb < 8; kb++) {
            const __m256i SV = load(gu + 1536 + 32 * (kb / 2));
            const int w = 2 * (kb & 1);
            __m256i *sc = (__m256i *)(void *)(o + 2048 + 64 * kb);
            _mm256_store_si256(sc, _mm256_srai_epi16(_mm256_shuffle_epi8(SV, pick(-128, w, -128, w)), 8));
            _mm256_store_si256(sc + 1, _mm256_srai_epi16(_mm256_shuffle_epi8(SV, pick(-128, w + 1, -128, w + 1)), 8));
            _mm256_store_si256((__m256i *)(void *)(o + 2560 + 32 * kb),
                               _mm256_srai_epi16(_mm256_shuffle_epi8(SV, pick(-128, w, -128, w + 1)), 8));
            const uint8_t *q = gu + 192 * kb;
            for (int a = 0; a < 2; a++) {
                const __m256i V1 = load(q + 96 * a), V2 = load(q + 96 * a + 32), V3 = load(q + 96 * a + 64);
                const __m256i q3 = q6k_fourth(V1, V2, V3);
                __m256i *v = (__m256i *)(void *)(o + 32 * (8 * kb + 4 * a));
                _mm256_store_si256(v, _mm256_and_si256(V1, m6));
                _mm256_store_si256(v + 1, _mm256_and_si256(V2, m6));
                _mm256_store_si256(v + 2, _mm256_and_si256(V3, m6));
                _mm256_store_si256(v + 3, q3);
            }
        }
        _mm256_store_ps((float *)(void *)(o + 2816), f16x8(gu + 1664));
    }
}

/* Block j of a lean unit, Q4_K: sub-block j's dots, with its scale, into pu */
AI void lean_q4k_block(const int NG, const int NT, const uint8_t *const su[MAXNG], const int j, const int b,
                       const int8_t *const xq[MAXNT], const float *const xd[MAXNT], __m256 pu[MAXNG][MAXNT]) {
    __m256i s[MAXNG][MAXNT];
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < NT; t++) s[g][t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int jj = 0; jj < 8; jj++) {
        __m256i bx[MAXNT];
        for (int t = 0; t < NT; t++) bx[t] = bcast32(xq[t] + (size_t)b * 32 + 4 * jj);
        for (int g = 0; g < NG; g++) {
            const __m256i v = _mm256_load_si256((const __m256i *)(const void *)(su[g] + 32 * (8 * j + jj)));
            for (int t = 0; t < NT; t++) {
                s[g][t] = _mm256_add_epi16(s[g][t], _mm256_maddubs_epi16(v, bx[t]));
            }
        }
    }
    for (int g = 0; g < NG; g++) {
        const __m256i sc = _mm256_load_si256((const __m256i *)(const void *)(su[g] + 2048 + 32 * j));
        for (int t = 0; t < NT; t++)
            pu[g][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[g][t], sc)), _mm256_set1_ps(xd[t][b]),
                                       pu[g][t]);
    }
}

/* Block kb of a lean unit, Q6_K: both halves' dots with their scales, less the -32 offset's share, into pu */
AI void lean_q6k_block(const int NG, const int NT, const tile_args *A, const uint8_t *const su[MAXNG], const int kb,
                       const int b, const int8_t *const xq[MAXNT], const float *const xd[MAXNT],
                       __m256 pu[MAXNG][MAXNT]) {
    __m256i i32[MAXNG][MAXNT];
    for (int g = 0; g < NG; g++)
        for (int t = 0; t < NT; t++) i32[g][t] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int pr = 0; pr < 4; pr++) {  /* granules 2 pr, 2 pr + 1 (half pr / 2) */
        __m256i b0[MAXNT], b1[MAXNT];
        for (int t = 0; t < NT; t++) {
            b0[t] = bcast32(xq[t] + (size_t)b * 32 + 8 * pr);
            b1[t] = bcast32(xq[t] + (size_t)b * 32 + 8 * pr + 4);
        }
        for (int g = 0; g < NG; g++) {
            const __m256i *v = (const __m256i *)(const void *)(su[g] + 32 * (8 * kb + 2 * pr));
            const __m256i v0 = _mm256_load_si256(v), v1 = _mm256_load_si256(v + 1);
            const __m256i sc =
                _mm256_load_si256((const __m256i *)(const void *)(su[g] + 2048 + 64 * kb + 32 * (pr / 2)));
            for (int t = 0; t < NT; t++) {
                const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(v0, b0[t]), _mm256_maddubs_epi16(v1, b1[t]));
                i32[g][t] = _mm256_add_epi32(i32[g][t], _mm256_madd_epi16(s, sc));
            }
        }
    }
    __m256i sab[MAXNG];
    for (int g = 0; g < NG; g++) sab[g] = _mm256_load_si256((const __m256i *)(const void *)(su[g] + 2560 + 32 * kb));
    q36k_block_end(NG, NT, A, b, 5, sab, i32, xd, pu);
}

/* The lean tile of Q4_K (six = 0) or Q6_K (six = 1): NG <= 2 groups x NT <= PNT tokens. It takes tile_args too
 * (g: the interleaved group, for Q4_K's mins; s: its unpacked scratch). */
AI void lean_tile(const int NG, const int NT, const int six, const tile_args *A) {
    const int nu = A->nu, nb = nu * 8;
    TOKENS(A, NG, NT);
    for (int u = 0; u < nu; u++) {
        const uint8_t *su[MAXNG];
        __m256 pu[MAXNG][MAXNT];
        unit_start(NG, NT, A, 1, six ? Q6K_UNIT_SCRATCH : Q4K_UNIT_SCRATCH, u, su, pu);
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            if (six) lean_q6k_block(NG, NT, A, su, j, 8 * u + j, xq, xd, pu);
            else lean_q4k_block(NG, NT, su, j, 8 * u + j, xq, xd, pu);
        }
        unit_end(NG, NT, su, six ? 2816 : 2304, 0, pu, acc);
    }
    if (!six)
        for (int g = 0; g < NG; g++) q4k_minus_mins(NT, A[g].g, nu, xs, acc[g]);
    STORE(A, NG, NT);
}

#define LEAN_TILES(name, six)                                                                            \
    static void name##_11(tile_args *A) { lean_tile(1, 1, six, A); }                                     \
    static void name##_12(tile_args *A) { lean_tile(1, 2, six, A); }                                     \
    static void name##_21(tile_args *A) { lean_tile(2, 1, six, A); }                                     \
    static void name##_22(tile_args *A) { lean_tile(2, 2, six, A); }
LEAN_TILES(lq4k, 0)
LEAN_TILES(lq6k, 1)

/* A type's prefill path: its unpacking, scratch bytes per unit, and lean tiles [NG - 1][NT - 1]. */
typedef struct {
    void (*unpack)(const uint8_t *g, int nu, uint8_t *dst);
    size_t unit_scratch;
    tile_fn fns[MAXNG][PNT];
} lean_path;

static const lean_path LEAN_Q4K = {unpack_q4k, Q4K_UNIT_SCRATCH, {{lq4k_11, lq4k_12}, {lq4k_21, lq4k_22}}};
static const lean_path LEAN_Q6K = {unpack_q6k, Q6K_UNIT_SCRATCH, {{lq6k_11, lq6k_12}, {lq6k_21, lq6k_22}}};

/* 0 when it ran; -1 when there was no memory for the scratch (the caller takes the tiles instead) */
static int matmul_lean(const lean_path *P, const bl_matrix *w, const void *xq, int T, const int32_t *xp,
                       float *out, size_t ldo, int r0, int r1) {
    const int type = w->type, cols = w->cols, nb = cols / BL_QK, nu = cols / bl_traits(type)->block_size;
    const size_t gb = bl_i8_group_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    const size_t per_group = (size_t)nu * P->unit_scratch;
    uint8_t *scratch = bl_thread_scratch(2 * per_group);
    if (!scratch) return -1;
    for (int r = r0; r < r1; r += 16) {
        const int ng = r1 - r > 8 ? 2 : 1;
        tile_args L[MAXNG];
        for (int g = 0; g < ng; g++) {
            const int rg = r + 8 * g;
            L[g] = (tile_args){.g = (const uint8_t *)w->data + (size_t)(rg / 8) * gb, .nu = nu, .xs = xb, .ldo = ldo,
                               .nvalid = r1 - rg < 8 ? r1 - rg : 8, .s = scratch + (size_t)g * per_group};
            P->unpack(L[g].g, nu, scratch + (size_t)g * per_group);
        }
        for (int t = 0; t < T; t += PNT) {
            const int nt = T - t < PNT ? T - t : PNT;
            L[0].xa = (const uint8_t *)xq + (size_t)t * xb;
            L[0].xp = xp ? xp + (size_t)t * nb : NULL;
            for (int g = 0; g < ng; g++) L[g].o = out + (size_t)t * ldo + r + 8 * g;
            P->fns[ng - 1][nt - 1](L);
        }
    }
    return 0;
}


/* Q6_K's and Q3_K's per-block half sums of the activations, packed as int16 pairs */
static void half_sums(const void *xq, int T, size_t xb, int cols, int32_t *xp) {
    const int nb = cols / BL_QK;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = (const int8_t *)xq + (size_t)t * xb;
        for (int b = 0; b < nb; b++) {
            /* lanes 0-3 sum qx[0:16], lanes 4-7 qx[16:32] */
            __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, load((const uint8_t *)q + 32 * b)), ones16);
            v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0x4e));
            v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0xb1));
            const int32_t a = _mm256_cvtsi256_si32(v), c = _mm256_extract_epi32(v, 4);
            xp[(size_t)t * nb + b] = (int32_t)(((uint32_t)a & 0xffffu) | (uint32_t)c << 16);
        }
    }
}

/* fns: the type's tiles for 1..MAXNT tokens; two: its 2-group tile for one token (NULL: none); half:
 * whether they take the activations' half sums (xp) */
static void matmul_kq(const tile_fn *fns, const tile_fn two, const int half, const lean_path *lean,
                      const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const int type = w->type, cols = w->cols, nb = cols / BL_QK;
    const size_t gb = bl_i8_group_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    const int rows_layout = w->layout == BL_LAYOUT_ROWS;
    int32_t xp_stack[1024];
    int32_t *xp = NULL;
    uint8_t *scratch = NULL;
    if (half) {
        const size_t n = (size_t)T * (size_t)nb;
        xp = n <= 1024 ? xp_stack : malloc(n * sizeof *xp);
    }
    if (rows_layout) scratch = aligned_alloc(64, gb);
    if ((half && !xp) || (rows_layout && !scratch)) { /* out of memory: the same bits, slowly */
        if (xp != xp_stack) free(xp);
        free(scratch);
        bl_scalar_kernels()->matmul[type][w->layout](w, xq, T, out, ldo, r0, r1);
        return;
    }
    if (xp) half_sums(xq, T, xb, cols, xp);
    if (!lean || rows_layout || T < PREFILL_MIN_T || matmul_lean(lean, w, xq, T, xp, out, ldo, r0, r1) != 0)
        run_tiles(fns, MAXNT, two, BL_PF_KQUANTS, w, xq, T, xp, out, ldo, r0, r1, scratch);
    if (xp != xp_stack) free(xp);
    free(scratch);
}

static const tile_fn Q50[MAXNT] = {q50_1, q50_2, q50_3, q50_4}, Q3K[MAXNT] = {q3k_1, q3k_2, q3k_3, q3k_4},
                     Q4K[MAXNT] = {q4k_1, q4k_2, q4k_3, q4k_4}, Q5K[MAXNT] = {q5k_1, q5k_2, q5k_3, q5k_4},
                     Q6K[MAXNT] = {q6k_1, q6k_2, q6k_3, q6k_4};

void bl_mm_q5_0_avx2(BL_MM_ARGS) { matmul_kq(Q50, q50_g2, 0, NULL, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q3_k_avx2(BL_MM_ARGS) { matmul_kq(Q3K, q3k_g2, 1, NULL, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_k_avx2(BL_MM_ARGS) { matmul_kq(Q4K, q4k_g2, 0, &LEAN_Q4K, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q5_k_avx2(BL_MM_ARGS) { matmul_kq(Q5K, q5k_g2, 0, NULL, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q6_k_avx2(BL_MM_ARGS) { matmul_kq(Q6K, q6k_g2, 1, &LEAN_Q6K, w, xq, T, out, ldo, r0, r1); }
