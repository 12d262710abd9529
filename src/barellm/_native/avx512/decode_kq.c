/* One-token (decode) kernels of the avx512 tier for Q4_K and Q5_K, on the interleaved layout (quant_kq.h), in
 * the scalar path's float order (the same bits).
 *
 * Decode reads every weight once, so its speed is how fast a core turns a stream of weights into sums: the
 * avx2 tile needs maddubs + add per 32 values and loads each vector twice (once per nibble); here each
 * loaded vector gives both nibbles and one vpdpbusd per nibble does the multiply-adds and the widening.
 * 256-bit vectors: Zen 4 splits 512-bit work in two, and 256 bits need no lane shuffles to pair groups.
 *
 * A call's groups are walked as two streams (the first half's and the second half's in step) by the avx2
 * tier's driver (avx2/tiles.h), with its software prefetch (kernels.h's rules).
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "quant_kq.h"
#include "tier.h"
#include "avx2/simd.h"
#include "avx2/tiles.h"
#include "avx512/decode.h"

#define AI static inline __attribute__((always_inline))

AI __m256 f16x8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p)); }
AI __m256i load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }

/* Q4_K (five = 0) or Q5_K (five = 1) for NG groups at once, each with quant_kq.h's float work in its order:
 * per sub-block pu = fma(dot * sc, xd, pu) (dot * sc exact in float: < 2^23, see avx512/quant_kq.c) and
 * mu = fma(m, s, mu); per unit acc = fma(pu, d, acc), accm = fma(mu, dmin, accm); out = acc - accm. */
AI void q45k_groups(const int NG, const int five, tile_args *A) {
    const kq_fields8 F = five ? KQ_Q5_K : KQ_Q4_K;
    const int nu = A->nu;
    const bl_act_q8 a = bl_act_q8_view(A->xa, nu * 8 * BL_QK);
    const __m256i m4 = _mm256_set1_epi8(15), m16 = _mm256_set1_epi8(16);
    __m256 acc[2], accm[2];
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) acc[g] = accm[g] = _mm256_setzero_ps();
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu[2];
        __m256i SL[2], SH[2], ML[2], MH[2];
        __m256 pu[2], mu[2];
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            gu[g] = A[g].g + (size_t)u * F.unit;
            q4k_scales8(gu[g] + F.sc, 0, &SL[g], &SH[g]);
            q4k_scales8(gu[g] + F.sc, 1, &ML[g], &MH[g]);
            pu[g] = mu[g] = _mm256_setzero_ps();
        }
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) {
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) prefetch_until(&A[g], &A[g].pdone, prefetch_end(A->pfs, u, c, 4));
            const int8_t *xl = a.qs + (size_t)(8 * u + 2 * c) * 32, *xh = xl + 32;
            /* [group][nibble][jj parity]: two chains a nibble, so that vpdpbusd's latency overlaps */
            __m256i d[2][2][2];
#pragma GCC unroll 8
            for (int jj = 0; jj < 8; jj++) {
                const __m256i bl = bcast32(xl + 4 * jj), bh = bcast32(xh + 4 * jj);
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) {
                    const __m256i v = load(gu[g] + 256 * c + 32 * jj);
                    /* Q4_K: the high nibbles in place, 16 q (their dots 16 times too big, taken off in the
                     * exact float scale): an and where a shift and an and would be */
                    __m256i lo = _mm256_and_si256(v, m4),
                            hi = five ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_andnot_si256(m4, v);
                    if (five) { /* bits 2c, 2c + 1 of qh granule jj: the fifth bits of sub-blocks 2c, 2c + 1 */
                        const __m256i h = load(gu[g] + F.qh + 32 * jj);
                        lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1 << (2 * c)))),
                                                  lo, m16);
                        hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(2 << (2 * c)))),
                                                  hi, m16);
                    }
                    const int p = jj & 1;
                    if (jj < 2) {
                        d[g][0][p] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, bl);
                        d[g][1][p] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), hi, bh);
                    } else {
                        d[g][0][p] = _mm256_dpbusd_epi32(d[g][0][p], lo, bl);
                        d[g][1][p] = _mm256_dpbusd_epi32(d[g][1][p], hi, bh);
                    }
                }
            }
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++)
#pragma GCC unroll 2
                for (int n = 0; n < 2; n++) {
                    const int j = 2 * c + n, b = 8 * u + j;
                    const __m256i one = pick(j & 3, -128, -128, -128);
                    __m256 sc = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(j < 4 ? SL[g] : SH[g], one));
                    if (!five && n) sc = _mm256_mul_ps(sc, _mm256_set1_ps(0.0625f));
                    const __m256 m = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(j < 4 ? ML[g] : MH[g], one));
                    const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(d[g][n][0], d[g][n][1]));
                    pu[g] = _mm256_fmadd_ps(_mm256_mul_ps(dot, sc), _mm256_set1_ps(a.d[b]), pu[g]);
                    mu[g] = _mm256_fmadd_ps(m, _mm256_set1_ps(a.s[b]), mu[g]);
                }
        }
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) {
            acc[g] = _mm256_fmadd_ps(pu[g], f16x8(gu[g] + F.d), acc[g]);
            accm[g] = _mm256_fmadd_ps(mu[g], f16x8(gu[g] + F.d + 16), accm[g]);
        }
    }
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) store8(A[g].o, _mm256_sub_ps(acc[g], accm[g]), A[g].nvalid);
}

/* Q6_K for NG groups at once, quant_kq.h's float work in its order: each block's integer
 * sa * dot(q, x)[0:16] + sb * dot(q, x)[16:32] - 32 (sa * sum x[0:16] + sb * sum x[16:32]) exact in int32 and
 * converted once; pu = fma(that, xd, pu) per block, acc = fma(pu, d, acc) per unit. A->xp: the activations'
 * half sums (int16 pairs, avx512/quant_kq.c's half_sums). */
AI void q6k_groups(const int NG, tile_args *A) {
    const kq_fields8 F = KQ_Q6_K;
    const int nu = A->nu;
    const bl_act_q8 a = bl_act_q8_view(A->xa, nu * 8 * BL_QK);
    const int32_t *xp = A->xp;
    const __m256i m6 = _mm256_set1_epi8(63);
    __m256 acc[2];
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) acc[g] = _mm256_setzero_ps();
    for (int u = 0; u < nu; u++) {
        const uint8_t *gu[2];
        __m256 pu[2];
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) gu[g] = A[g].g + (size_t)u * F.unit, pu[g] = _mm256_setzero_ps();
#pragma GCC unroll 1
        for (int k2 = 0; k2 < 4; k2++) {
            __m256i SV[2]; /* the 16-value halves' scales of blocks 2 k2, 2 k2 + 1: bytes 0-3 of each row's lane */
#pragma GCC unroll 2
            for (int g = 0; g < NG; g++) SV[g] = load(gu[g] + F.sc + 32 * k2);
#pragma GCC unroll 2
            for (int odd = 0; odd < 2; odd++) {
                const int kb = 2 * k2 + odd, b = 8 * u + kb, o = 2 * odd;
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) prefetch_until(&A[g], &A[g].pdone, prefetch_end(A->pfs, u, kb, 8));
                __m256i i32[2];
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const int8_t *x = a.qs + (size_t)b * 32 + 16 * h;
                    const __m256i x0 = bcast32(x), x1 = bcast32(x + 4), x2 = bcast32(x + 8), x3 = bcast32(x + 12);
#pragma GCC unroll 2
                    for (int g = 0; g < NG; g++) {
                        const uint8_t *q = gu[g] + 192 * kb + 96 * h;
                        const __m256i V1 = load(q), V2 = load(q + 32), V3 = load(q + 64);
                        const __m256i q3 = q6k_fourth(V1, V2, V3);
                        __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_and_si256(V1, m6), x0);
                        dot = _mm256_dpbusd_epi32(dot, _mm256_and_si256(V2, m6), x1);
                        dot = _mm256_dpbusd_epi32(dot, _mm256_and_si256(V3, m6), x2);
                        dot = _mm256_dpbusd_epi32(dot, q3, x3);
                        /* the half's signed scale, in each row's lane */
                        const __m256i sc = _mm256_srai_epi32(_mm256_shuffle_epi8(SV[g], pick(-128, -128, -128, o + h)), 24);
                        const __m256i p = _mm256_mullo_epi32(dot, sc);
                        i32[g] = h ? _mm256_add_epi32(i32[g], p) : p;
                    }
                }
#pragma GCC unroll 2
                for (int g = 0; g < NG; g++) {
                    const __m256i sab = _mm256_srai_epi16(_mm256_shuffle_epi8(SV[g], pick(-128, o, -128, o + 1)), 8);
                    const __m256i corr = _mm256_madd_epi16(sab, _mm256_set1_epi32(xp[b]));
                    const __m256i i = _mm256_sub_epi32(i32[g], _mm256_slli_epi32(corr, 5));
                    pu[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(a.d[b]), pu[g]);
                }
            }
        }
#pragma GCC unroll 2
        for (int g = 0; g < NG; g++) acc[g] = _mm256_fmadd_ps(pu[g], f16x8(gu[g] + F.d), acc[g]);
    }
#pragma GCC unroll 2
    for (int g = 0; g < NG; g++) store8(A[g].o, acc[g], A[g].nvalid);
}

static void q4k_1(tile_args *A) { q45k_groups(1, 0, A); }
static void q4k_2(tile_args *A) { q45k_groups(2, 0, A); }
static void q5k_1(tile_args *A) { q45k_groups(1, 1, A); }
static void q5k_2(tile_args *A) { q45k_groups(2, 1, A); }
static void q6k_1(tile_args *A) { q6k_groups(1, A); }
static void q6k_2(tile_args *A) { q6k_groups(2, A); }

/* The groups of [r0, r1) as two streams, the first half's and the second half's in step, the odd one out
 * alone (avx2/tiles.h's two_streams, the avx2 tier's walk and software prefetch) */
static void decode(const tile_fn one, const tile_fn two, const bl_matrix *w, const void *xq, const int32_t *xp,
                   float *out, int r0, int r1) {
    run_tiles(&one, 1, two, BL_PF_KQUANTS, w, xq, 1, xp, out, 0, r0, r1, NULL);
}

void bl_decode_q4_k_avx512(const bl_matrix *w, const void *xq, float *out, int r0, int r1) {
    decode(q4k_1, q4k_2, w, xq, NULL, out, r0, r1);
}

void bl_decode_q5_k_avx512(const bl_matrix *w, const void *xq, float *out, int r0, int r1) {
    decode(q5k_1, q5k_2, w, xq, NULL, out, r0, r1);
}

void bl_decode_q6_k_avx512(const bl_matrix *w, const void *xq, const int32_t *xp, float *out, int r0, int r1) {
    decode(q6k_1, q6k_2, w, xq, xp, out, r0, r1);
}
