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

#include "tier.h"
#include "avx2/kquants.h"

/* Software prefetch (kernels.h's rules, BL_PF_KQUANTS): without it the weights' stream from memory runs
 * well behind the compute (measured on Zen 3 at T = 1, weights from memory: 55-65% of a plain read's rate
 * without, 80-95% at 8 KB ahead; 4-12 KB do about as well). With two threads streaming at once, NTA
 * prefetches 16 KB ahead did better there: the Q4_K tile 94-95% -> 95-97% of a plain 2-thread read, Q6_K
 * 87-92% -> 93-96% (16-32 KB alike). cpu.c holds each CPU family's rule. */

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
        UNIT(A, NG, NT, 0, U, u);
        /* kept in memory, not in registers, across the loop below */
        __m256i scj[MAXNG][8];
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
        UNIT(A, NG, NT, 0, U, u);
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

/* The 16 scales (sc - 32) of the 8 rows of each group's unit (at gu[g]) from its 3 interleaved scale vectors
 * (bytes 768-863): byte k of each lane of v[g][i] is scale 4i + k of that row (see kq_q3k_scales). */
AI void q3k_scales8(const int NG, const uint8_t *const gu[MAXNG], __m256i v[MAXNG][4]) {
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) {
        const uint8_t *s = gu[g] + 768;
        const __m256i SA = load(s), SB = load(s + 32), SC = load(s + 64);
        const __m256i lo[4] = {_mm256_and_si256(SA, m4), _mm256_and_si256(SB, m4),
                               _mm256_and_si256(_mm256_srli_epi16(SA, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(SB, 4), m4)};
        const __m256i hi[4] = {_mm256_and_si256(SC, m3), _mm256_and_si256(_mm256_srli_epi16(SC, 2), m3),
                               _mm256_and_si256(_mm256_srli_epi16(SC, 4), m3),
                               _mm256_and_si256(_mm256_srli_epi16(SC, 6), m3)};
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            v[g][i] = _mm256_sub_epi8(_mm256_or_si256(lo[i], _mm256_slli_epi16(hi[i], 4)), k32);
    }
}

AI void tile_q3_k(const int NG, const int NT, const tile_args *A) {
    const int nu = A->nu, nb = nu * 8;
    const size_t U = 880; /* KQ_Q3_K: qs 0, hmask 512, scales 768, d 864 */
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
    TOKENS(A, NG, NT);
    for (int u = 0; u < nu; u++) {
        UNIT(A, NG, NT, 0, U, u);
        __m256i SV[MAXNG][4];
        q3k_scales8(NG, gu, SV);
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

#define PREFILL_MIN_T 8 /* from here Q4_K and Q6_K take their prefill path (avx2/quant_kq_prefill.c) */
typedef int (*prefill_fn)(const bl_matrix *w, const void *xq, int T, const int32_t *xp, float *out, size_t ldo,
                          int r0, int r1);

/* fns: the type's tiles for 1..MAXNT tokens; two: its 2-group tile for one token (NULL: none); half:
 * whether they take the activations' half sums (xp); prefill: its prefill path (NULL: none) */
static void matmul_kq(const tile_fn *fns, const tile_fn two, const int half, const prefill_fn prefill,
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
    if (!prefill || rows_layout || T < PREFILL_MIN_T || prefill(w, xq, T, xp, out, ldo, r0, r1) != 0)
        run_tiles(fns, MAXNT, two, BL_PF_KQUANTS, w, xq, T, xp, out, ldo, r0, r1, scratch);
    if (xp != xp_stack) free(xp);
    free(scratch);
}

static const tile_fn Q50[MAXNT] = {q50_1, q50_2, q50_3, q50_4}, Q3K[MAXNT] = {q3k_1, q3k_2, q3k_3, q3k_4},
                     Q4K[MAXNT] = {q4k_1, q4k_2, q4k_3, q4k_4}, Q5K[MAXNT] = {q5k_1, q5k_2, q5k_3, q5k_4},
                     Q6K[MAXNT] = {q6k_1, q6k_2, q6k_3, q6k_4};

void bl_mm_q5_0_avx2(BL_MM_ARGS) { matmul_kq(Q50, q50_g2, 0, NULL, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q3_k_avx2(BL_MM_ARGS) { matmul_kq(Q3K, q3k_g2, 1, NULL, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_k_avx2(BL_MM_ARGS) { matmul_kq(Q4K, q4k_g2, 0, bl_kq_prefill_q4_k_avx2, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q5_k_avx2(BL_MM_ARGS) { matmul_kq(Q5K, q5k_g2, 0, NULL, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q6_k_avx2(BL_MM_ARGS) { matmul_kq(Q6K, q6k_g2, 1, bl_kq_prefill_q6_k_avx2, w, xq, T, out, ldo, r0, r1); }
