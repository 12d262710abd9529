/* AVX-512 VNNI prefill kernels for Q5_0, Q3_K, Q4_K, Q5_K and Q6_K (Gemma's, Qwen2.5's Q4_K_M weights; Q5_K
 * and Q3_K from the _M and _S mixes). They read the same interleaved layout as the avx2 tier (quant_kq.h:
 * one .blm file for every tier) and do quant_kq.h's float work in its order, so their bits are the scalar
 * path's. One-token calls of Q4_K, Q5_K and Q6_K go to avx512/decode_kq.c, calls of 2 to PREFILL_MIN_T - 1
 * tokens to the few-token tiles below (values unpacked in registers, weights prefetched as a decode's: such
 * calls read their weights from memory); Q5_0's and Q3_K's short calls keep the avx2 tiles.
 *
 * A call's rows go 16 at a time (two groups of 8): each group pair is first unpacked into a scratch that
 * stays in cache (values as plain u8, one 64-byte vector holding 4 consecutive values of all 16 rows, the
 * scales as floats), then every token of the call runs over it NT = 8 at a time: one vpdpbusd does 64
 * multiply-adds where avx2 took maddubs + add + madd for 32, each loaded weight vector serves 8 tokens, and
 * each activation granule is an embedded broadcast. Q5_K unpacks into Q4_K's scratch (its fifth bit folded
 * into the values) and runs Q4_K's loop; Q3_K into Q6_K's (u = q + 4 < 8) and runs Q6_K's with the offset 4.
 *
 * Exactness (why the float work can use float scales):
 *   Q4_K  a sub-block's dot |sum q x| <= 32 * 15 * 127 < 2^16 and sc < 64, so sc * dot < 2^22: the float
 *         product (float)sc * (float)dot is exact and equals (float)(sc * dot), the scalar path's operand;
 *   Q5_K  the same with q < 32: dot <= 32 * 31 * 127 < 2^17, sc * dot < 2^23, still exact;
 *   Q5_0  the block's integer dot(q, x) - 16 sq is exact in int32 and converted once, as avx2's;
 *   Q6_K  a half's dot can reach 16 * 63 * 127 and its scale 128, and two halves' sum passes 2^24, so the
 *         block's integer is formed in int32 (vpmulld) and converted once, as everywhere else;
 *   Q3_K  the block's integer (both halves and the -4 offset's correction) formed as Q6_K's: the scalar
 *         path converts it once, so any earlier rounding would differ.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "quant_kq.h"
#include "tier.h"
#include "avx512/decode.h"

#define AI static inline __attribute__((always_inline))
#define PREFILL_MIN_T 12 /* from here the lean path; under it the few-token tiles (one token: decode_kq.c) */
#define NT 8            /* tokens a lean tile runs at once */

AI __m512i bcast(const int8_t *p) { return _mm512_set1_epi32(bl_rd32(p)); }


/* the 8 f16 of group A's rows then group B's (B NULL: zeros) as 16 floats */
AI __m512 f16x16(const uint8_t *a, const uint8_t *b) {
    const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)a));
    const __m256 hi = b ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)b)) : _mm256_setzero_ps();
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* a 32-byte granule vector of group A and the matching one of group B (NULL: zeros) as one 64-byte vector */
AI __m512i pair32(const uint8_t *a, const uint8_t *b) {
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)a);
    const __m256i hi = b ? _mm256_loadu_si256((const __m256i *)(const void *)b) : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* byte k of row l's n-byte field in an interleaved unit (granule k / 4 of row l) */
AI uint8_t field_byte(const uint8_t *f, int l, int k) { return f[32 * (k / 4) + 4 * l + k % 4]; }

typedef struct {
    const uint8_t *s;  /* the unpacked pair */
    int nu;
    const uint8_t *xa; /* the first token's activation row */
    size_t xs;
    const int32_t *xp; /* Q6_K: per token (nb apart), per block: int16 pair (sum qx[0:16], sum qx[16:32]) */
    float *o;          /* out of the first token, the pair's first row */
    size_t ldo;
    __mmask16 store;   /* the rows of the 16 to store */
} lean_args;

/* ---- Q4_K, Q5_K ---- */

/* scratch per unit of a pair: vals [j][jj] (64 B: granule jj of sub-block j, 16 rows), sc [j] (16 f32), d (16 f32),
 * m [j] (16 f32), dmin (16 f32) */
enum { Q4K_VALS = 0, Q4K_SC = 4096, Q4K_D = 4608, Q4K_M = 4672, Q4K_DMIN = 5184, Q4K_UNIT = 5248 };

/* byte k of every 32-bit lane of v, as 16 floats */
AI __m512 lane_byte_ps(const __m512i v, const int k) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(255)));
}

/* The 6-bit scales and mins of a unit of groups A and B (B NULL: zeros) as floats, kq_q4k_scales on 16 rows
 * at once: sc[16 j + r], m[16 j + r] for sub-block j and row r (A's rows, then B's). The odd sub-blocks'
 * scales are multiplied by `odd` (a power of two, so exactly): 1/16 for kernels that keep the high nibbles
 * in place. */
AI void q45k_scales16(const uint8_t *sa, const uint8_t *sb, const float odd, float *sc, float *m) {
    const __m512i m4 = _mm512_set1_epi8(15), m6 = _mm512_set1_epi8(63), m30 = _mm512_set1_epi8(0x30);
    const __m512i A = pair32(sa, sb), B = pair32(sa + 32, sb ? sb + 32 : NULL), C = pair32(sa + 64, sb ? sb + 64 : NULL);
    const __m512i slo = _mm512_and_si512(A, m6), mlo = _mm512_and_si512(B, m6);
    const __m512i shi = _mm512_or_si512(_mm512_and_si512(C, m4), _mm512_and_si512(_mm512_srli_epi16(A, 2), m30));
    const __m512i mhi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(C, 4), m4),
                                        _mm512_and_si512(_mm512_srli_epi16(B, 2), m30));
    const __m512 o = _mm512_set1_ps(odd);
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512 s0 = lane_byte_ps(slo, k), s1 = lane_byte_ps(shi, k);
        _mm512_store_ps(sc + 16 * k, (k & 1) ? _mm512_mul_ps(s0, o) : s0);
        _mm512_store_ps(sc + 16 * (4 + k), (k & 1) ? _mm512_mul_ps(s1, o) : s1);
        _mm512_store_ps(m + 16 * k, lane_byte_ps(mlo, k));
        _mm512_store_ps(m + 16 * (4 + k), lane_byte_ps(mhi, k));
    }
}

/* Q4_K, or Q5_K (five = 1: each value's fifth bit from qh, same scratch) */
AI void unpack_q45k(const uint8_t *ga, const uint8_t *gb, int nu, uint8_t *dst, const int five) {
    const __m512i m4 = _mm512_set1_epi8(15), m16 = _mm512_set1_epi8(16);
    const kq_fields8 F = five ? KQ_Q5_K : KQ_Q4_K;
    for (int u = 0; u < nu; u++) {
        const uint8_t *ua = ga + (size_t)u * F.unit, *ub = gb ? gb + (size_t)u * F.unit : NULL;
        uint8_t *o = dst + (size_t)u * Q4K_UNIT;
        for (int c = 0; c < 4; c++)
            for (int jj = 0; jj < 8; jj++) {
                const __m512i v = pair32(ua + 256 * c + 32 * jj, ub ? ub + 256 * c + 32 * jj : NULL);
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (five) { /* bit j of qh granule jj: sub-block j's fifth bits */
                    const __m512i h = pair32(ua + F.qh + 32 * jj, ub ? ub + F.qh + 32 * jj : NULL);
                    const __mmask64 b0 = _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << (2 * c))));
                    const __mmask64 b1 = _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(2 << (2 * c))));
                    lo = _mm512_mask_add_epi8(lo, b0, lo, m16), hi = _mm512_mask_add_epi8(hi, b1, hi, m16);
                }
                _mm512_store_si512((void *)(o + Q4K_VALS + 64 * (8 * (2 * c) + jj)), lo);
                _mm512_store_si512((void *)(o + Q4K_VALS + 64 * (8 * (2 * c + 1) + jj)), hi);
            }
        q45k_scales16(ua + F.sc, ub ? ub + F.sc : NULL, 1.0f, (float *)(void *)(o + Q4K_SC),
                      (float *)(void *)(o + Q4K_M));
        _mm512_store_ps((float *)(void *)(o + Q4K_D), f16x16(ua + F.d, ub ? ub + F.d : NULL));
        _mm512_store_ps((float *)(void *)(o + Q4K_DMIN), f16x16(ua + F.d + 16, ub ? ub + F.d + 16 : NULL));
    }
}

static void unpack_q4k(const uint8_t *ga, const uint8_t *gb, int nu, uint8_t *dst) { unpack_q45k(ga, gb, nu, dst, 0); }
static void unpack_q5k(const uint8_t *ga, const uint8_t *gb, int nu, uint8_t *dst) { unpack_q45k(ga, gb, nu, dst, 1); }

AI void lean_q4_k(const int n, const lean_args *L) {
    const int nu = L->nu, nb = nu * 8;
    const int8_t *xq[NT];
    const float *xd[NT], *xs[NT];
    __m512 acc[NT], accm[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) {
        const bl_act_q8 a = bl_act_q8_view(L->xa + (size_t)t * L->xs, nb * BL_QK);
        xq[t] = a.qs, xd[t] = a.d, xs[t] = a.s;
        acc[t] = _mm512_setzero_ps(), accm[t] = _mm512_setzero_ps();
    }
    for (int u = 0; u < nu; u++) {
        const uint8_t *su = L->s + (size_t)u * Q4K_UNIT;
        __m512 pu[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) pu[t] = _mm512_setzero_ps();
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            const int b = 8 * u + j;
            __m512i dot[NT];
#pragma GCC unroll 8
            for (int t = 0; t < n; t++) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int jj = 0; jj < 8; jj++) {
                const __m512i v = _mm512_load_si512((const void *)(su + Q4K_VALS + 64 * (8 * j + jj)));
#pragma GCC unroll 8
                for (int t = 0; t < n; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], v, bcast(xq[t] + (size_t)b * 32 + 4 * jj));
            }
            const __m512 sc = _mm512_load_ps((const float *)(const void *)(su + Q4K_SC + 64 * j));
#pragma GCC unroll 8
            for (int t = 0; t < n; t++)
                pu[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[t]), sc), _mm512_set1_ps(xd[t][b]), pu[t]);
        }
        const __m512 dw = _mm512_load_ps((const float *)(const void *)(su + Q4K_D));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) acc[t] = _mm512_fmadd_ps(pu[t], dw, acc[t]);
    }
    /* the mins chain, a pass of its own: with it in the loop above the 8 tokens' chains do not fit the 32
     * registers */
    for (int u = 0; u < nu; u++) {
        const uint8_t *su = L->s + (size_t)u * Q4K_UNIT;
        __m512 mu[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) mu[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m512 m = _mm512_load_ps((const float *)(const void *)(su + Q4K_M + 64 * j));
#pragma GCC unroll 8
            for (int t = 0; t < n; t++) mu[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t][8 * u + j]), mu[t]);
        }
        const __m512 dm = _mm512_load_ps((const float *)(const void *)(su + Q4K_DMIN));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) accm[t] = _mm512_fmadd_ps(mu[t], dm, accm[t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, _mm512_sub_ps(acc[t], accm[t]));
}

/* ---- Q5_0 ---- */

/* scratch per block of a pair: vals [g] (64 B: values 4g..4g+3 of the block, 0..31, 16 rows), d (16 f32) */
enum { Q50_VALS = 0, Q50_D = 512, Q50_UNIT = 576 };

static void unpack_q50(const uint8_t *ga, const uint8_t *gb, int nb, uint8_t *dst) {
    const __m512i m5 = _mm512_set1_epi8(31), m7 = _mm512_set1_epi8(7), m18 = _mm512_set1_epi8(0x18);
    for (int b = 0; b < nb; b++) {
        const uint8_t *ua = ga + (size_t)b * 176, *ub = gb ? gb + (size_t)b * 176 : NULL;
        uint8_t *o = dst + (size_t)b * Q50_UNIT;
        /* vector j: values 4j + i in bits 0-4, 16 + 4j + i: low 3 bits in bits 5-7, top 2 bits in bits 2j, 2j + 1
         * of X */
        const __m512i X = pair32(ua + 128, ub ? ub + 128 : NULL);
        for (int j = 0; j < 4; j++) {
            const __m512i M = pair32(ua + 32 * j, ub ? ub + 32 * j : NULL);
            const __m512i xh = j == 0 ? _mm512_slli_epi16(X, 3) : j == 1 ? _mm512_slli_epi16(X, 1)
                               : j == 2 ? _mm512_srli_epi16(X, 1) : _mm512_srli_epi16(X, 3);
            _mm512_store_si512((void *)(o + Q50_VALS + 64 * j), _mm512_and_si512(M, m5));
            _mm512_store_si512((void *)(o + Q50_VALS + 64 * (4 + j)),
                               _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(M, 5), m7), _mm512_and_si512(xh, m18)));
        }
        _mm512_store_ps((float *)(void *)(o + Q50_D), f16x16(ua + 160, ub ? ub + 160 : NULL));
    }
}

AI void lean_q5_0(const int n, const lean_args *L) {
    const int nb = L->nu;
    const int8_t *xq[NT];
    const float *xd[NT];
    const int32_t *xsq[NT];
    __m512 acc[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) {
        const bl_act_q8 a = bl_act_q8_view(L->xa + (size_t)t * L->xs, nb * BL_QK);
        xq[t] = a.qs, xd[t] = a.d, xsq[t] = a.sq;
        acc[t] = _mm512_setzero_ps();
    }
#pragma GCC unroll 1
    for (int b = 0; b < nb; b++) {
        const uint8_t *su = L->s + (size_t)b * Q50_UNIT;
        __m512i dot[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            const __m512i v = _mm512_load_si512((const void *)(su + Q50_VALS + 64 * g));
#pragma GCC unroll 8
            for (int t = 0; t < n; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], v, bcast(xq[t] + (size_t)b * 32 + 4 * g));
        }
        const __m512 dw = _mm512_load_ps((const float *)(const void *)(su + Q50_D));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            const __m512i i = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(16 * xsq[t][b]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_set1_ps(xd[t][b])), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, acc[t]);
}

/* ---- Q6_K, Q3_K ---- */

/* scratch per unit of a pair: vals [kb][g] (64 B: granule g of block kb, values 0..63 (Q3_K: u = q + 4, 0..7),
 * 16 rows), sc [kb][half] (16 i32), sab [kb] (16 int16 pairs: both halves' scales, the offset correction's
 * operand), d (16 f32) */
enum { Q6K_VALS = 0, Q6K_SC = 4096, Q6K_SAB = 5120, Q6K_D = 5632, Q6K_UNIT = 5696 };

/* Q6_K's signed scales of a unit of groups A and B (B NULL: zeros) for 16 rows at once: sc [2 kb + half][r]
 * (int32), sab [kb][r] (both halves' scales as an int16 pair, low = the first half's) */
AI void q6k_scales16(const uint8_t *sa, const uint8_t *sb, uint8_t *sc, uint8_t *sab) {
    const __m512i low16 = _mm512_set1_epi32(0xffff);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) { /* granule g: scale bytes 4g..4g+3, blocks 2g and 2g + 1 */
        const __m512i V = pair32(sa + 32 * g, sb ? sb + 32 * g : NULL);
        const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(V, 8), 8), odd = _mm512_srai_epi16(V, 8);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) /* byte k, sign-extended: block 2g + k / 2, half k % 2 */
            _mm512_store_si512((void *)(sc + 64 * (4 * g + k)), _mm512_srai_epi32(_mm512_slli_epi32(V, 24 - 8 * k), 24));
        _mm512_store_si512((void *)(sab + 64 * (2 * g)),
                           _mm512_or_si512(_mm512_and_si512(even, low16), _mm512_slli_epi32(odd, 16)));
        _mm512_store_si512((void *)(sab + 64 * (2 * g + 1)),
                           _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_andnot_si512(low16, odd)));
    }
}

static void unpack_q6k(const uint8_t *ga, const uint8_t *gb, int nu, uint8_t *dst) {
    const __m512i m6 = _mm512_set1_epi8(63), m3 = _mm512_set1_epi8(3), mc = _mm512_set1_epi8(0x0c);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    for (int u = 0; u < nu; u++) {
        const uint8_t *ua = ga + (size_t)u * 1680, *ub = gb ? gb + (size_t)u * 1680 : NULL;
        uint8_t *o = dst + (size_t)u * Q6K_UNIT;
        for (int kb = 0; kb < 8; kb++)
            for (int a = 0; a < 2; a++) {
                const size_t q = 192 * (size_t)kb + 96 * (size_t)a;
                const __m512i V1 = pair32(ua + q, ub ? ub + q : NULL), V2 = pair32(ua + q + 32, ub ? ub + q + 32 : NULL);
                const __m512i V3 = pair32(ua + q + 64, ub ? ub + q + 64 : NULL);
                const __m512i q3 = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(V1, 6), m3),
                                                                   _mm512_and_si512(_mm512_srli_epi16(V2, 4), mc)),
                                                   _mm512_and_si512(_mm512_srli_epi16(V3, 2), m30));
                uint8_t *v = o + Q6K_VALS + 64 * (8 * kb + 4 * a);
                _mm512_store_si512((void *)v, _mm512_and_si512(V1, m6));
                _mm512_store_si512((void *)(v + 64), _mm512_and_si512(V2, m6));
                _mm512_store_si512((void *)(v + 128), _mm512_and_si512(V3, m6));
                _mm512_store_si512((void *)(v + 192), q3);
            }
        q6k_scales16(ua + 1536, ub ? ub + 1536 : NULL, o + Q6K_SC, o + Q6K_SAB);
        _mm512_store_ps((float *)(void *)(o + Q6K_D), f16x16(ua + 1664, ub ? ub + 1664 : NULL));
    }
}

static void unpack_q3k(const uint8_t *ga, const uint8_t *gb, int nu, uint8_t *dst) {
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4);
    for (int u = 0; u < nu; u++) {
        const uint8_t *ua = ga + (size_t)u * 880, *ub = gb ? gb + (size_t)u * 880 : NULL;
        uint8_t *o = dst + (size_t)u * Q6K_UNIT;
        for (int kb = 0; kb < 8; kb++) {
            const int h = kb / 4, k = kb % 4;
            const __m512i bit = _mm512_set1_epi8((char)(1 << (4 * h + k))); /* the block's hmask bit */
            for (int jj = 0; jj < 8; jj++) {
                const size_t q = 32 * (size_t)(8 * h + jj), hm = 512 + 32 * (size_t)jj;
                const __m512i qv = pair32(ua + q, ub ? ub + q : NULL), hv = pair32(ua + hm, ub ? ub + hm : NULL);
                const __m512i lo = _mm512_and_si512(_mm512_srl_epi16(qv, _mm_cvtsi32_si128(2 * k)), m3);
                _mm512_store_si512((void *)(o + Q6K_VALS + 64 * (8 * kb + jj)),
                                   _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(hv, bit), lo, m4));
            }
        }
        int32_t *sc = (int32_t *)(void *)(o + Q6K_SC), *sab = (int32_t *)(void *)(o + Q6K_SAB);
        for (int r = 0; r < 16; r++) {
            const uint8_t *g = r < 8 ? ua : ub;
            uint8_t s12[12];
            int8_t s[16];
            for (int k = 0; k < 12; k++) s12[k] = g ? field_byte(g + 768, r % 8, k) : 0;
            kq_q3k_scales(s12, s);
            for (int kb = 0; kb < 8; kb++) {
                /* a padding row's scales come out -32, not 0: harmless, its outputs are never stored */
                const int8_t sa = s[2 * kb], sb = s[2 * kb + 1];
                sc[32 * kb + r] = sa, sc[32 * kb + 16 + r] = sb;
                sab[16 * kb + r] = (int32_t)((uint32_t)(uint16_t)sa | (uint32_t)(uint16_t)sb << 16);
            }
        }
        _mm512_store_ps((float *)(void *)(o + Q6K_D), f16x16(ua + 864, ub ? ub + 864 : NULL));
    }
}

/* off: log2 of the values' offset (Q6_K q - 32: 5, Q3_K q - 4: 2), taken off once per block as
 * (sa * sum(qx[0:16]) + sb * sum(qx[16:32])) << off, so the unpacked values stay unsigned for vpdpbusd */
AI void lean_q36_k(const int n, const int off, const lean_args *L) {
    const int nu = L->nu, nb = nu * 8;
    const int8_t *xq[NT];
    const float *xd[NT];
    __m512 acc[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) {
        const bl_act_q8 a = bl_act_q8_view(L->xa + (size_t)t * L->xs, nb * BL_QK);
        xq[t] = a.qs, xd[t] = a.d;
        acc[t] = _mm512_setzero_ps();
    }
    for (int u = 0; u < nu; u++) {
        const uint8_t *su = L->s + (size_t)u * Q6K_UNIT;
        __m512 pu[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) pu[t] = _mm512_setzero_ps();
#pragma GCC unroll 1
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb;
            __m512i i32[NT];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                __m512i dot[NT];
#pragma GCC unroll 8
                for (int t = 0; t < n; t++) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    const __m512i v = _mm512_load_si512((const void *)(su + Q6K_VALS + 64 * (8 * kb + 4 * h + g)));
#pragma GCC unroll 8
                    for (int t = 0; t < n; t++)
                        dot[t] = _mm512_dpbusd_epi32(dot[t], v, bcast(xq[t] + (size_t)b * 32 + 16 * h + 4 * g));
                }
                const __m512i sc = _mm512_load_si512((const void *)(su + Q6K_SC + 64 * (2 * kb + h)));
#pragma GCC unroll 8
                for (int t = 0; t < n; t++) {
                    const __m512i p = _mm512_mullo_epi32(dot[t], sc);
                    i32[t] = h ? _mm512_add_epi32(i32[t], p) : p;
                }
            }
            const __m512i sab = _mm512_load_si512((const void *)(su + Q6K_SAB + 64 * kb));
#pragma GCC unroll 8
            for (int t = 0; t < n; t++) {
                const __m512i corr = _mm512_madd_epi16(sab, _mm512_set1_epi32(L->xp[(size_t)t * nb + b]));
                const __m512i i = _mm512_sub_epi32(i32[t], _mm512_slli_epi32(corr, off));
                pu[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(xd[t][b]), pu[t]);
            }
        }
        const __m512 dw = _mm512_load_ps((const float *)(const void *)(su + Q6K_D));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) acc[t] = _mm512_fmadd_ps(pu[t], dw, acc[t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, acc[t]);
}

AI void lean_q6_k(const int n, const lean_args *L) { lean_q36_k(n, 5, L); }
AI void lean_q3_k(const int n, const lean_args *L) { lean_q36_k(n, 2, L); }

/* ---- Q4_K, Q5_K, Q6_K for a few tokens ----
 *
 * A verification of drafted tokens or a small batch of sequences is a call of 2 to 7 tokens, and its weights
 * come from memory as a decode's do. Unpacking a pair into the scratch first (the lean path) costs as much as
 * several tokens' work and reads the weights without prefetch; here each 64-byte vector of 16 rows' values is
 * unpacked in registers as it is loaded (an and, or a shift and an and), used for every token of the call,
 * and the weights are prefetched ahead by kernels.h's rules. Only the unit's scales go through the stack. */
#define FEW_NT 4 /* tokens a few-token tile runs at once: their chains fit the 32 registers with the mins */

typedef struct {
    const uint8_t *ga, *gb; /* the pair's groups (gb NULL: the last group alone) */
    int nu;
    const uint8_t *xa; /* the first token's activation row */
    size_t xs;
    float *o;
    size_t ldo;
    __mmask16 store;
    size_t pf;       /* prefetch distance in bytes (0: none) */
    size_t gbytes;   /* bytes of a group */
    const uint8_t *end; /* the matrix's end: no prefetch past it */
} few_args;

/* Prefetches bytes [from, to) ahead of the start of group g in its stream: the pair's groups are read side by
 * side, so group g's stream goes on past its end in the next pair's group of its side, one group further on */
AI void few_prefetch(const uint8_t *g, const size_t gb, const size_t from, const size_t to, const uint8_t *end,
                     const int hint) {
    for (size_t o = from; o < to; o += 64) {
        const uint8_t *p = g + (o < gb ? o : o + gb);
        if (p < end) bl_prefetch_line(p, hint);
    }
}

AI void few_q45k(const int n, const int five, const few_args *L) {
    const kq_fields8 F = five ? KQ_Q5_K : KQ_Q4_K;
    const int nu = L->nu, nb = nu * 8;
    const __m512i m4 = _mm512_set1_epi8(15), m16 = _mm512_set1_epi8(16);
    const int hint = bl_prefetch_rules[BL_PF_KQUANTS][bl_shared_stream != 0].hint;
    const int8_t *xq[FEW_NT];
    const float *xd[FEW_NT], *xs[FEW_NT];
    __m512 acc[FEW_NT], accm[FEW_NT];
    float sc[128] __attribute__((aligned(64))), m[128] __attribute__((aligned(64)));
#pragma GCC unroll 4
    for (int t = 0; t < n; t++) {
        const bl_act_q8 a = bl_act_q8_view(L->xa + (size_t)t * L->xs, nb * BL_QK);
        xq[t] = a.qs, xd[t] = a.d, xs[t] = a.s;
        acc[t] = accm[t] = _mm512_setzero_ps();
    }
    for (int u = 0; u < nu; u++) {
        const uint8_t *ua = L->ga + (size_t)u * F.unit, *ub = L->gb ? L->gb + (size_t)u * F.unit : NULL;
        if (L->pf) {
            const size_t at = (size_t)u * F.unit + L->pf;
            few_prefetch(L->ga, L->gbytes, at, at + F.unit, L->end, hint);
            if (ub) few_prefetch(L->gb, L->gbytes, at, at + F.unit, L->end, hint);
        }
        /* Q4_K keeps the high nibbles in place (16 times the value): their scales carry the 1/16 */
        q45k_scales16(ua + F.sc, ub ? ub + F.sc : NULL, five ? 1.0f : 0.0625f, sc, m);
        __m512 pu[FEW_NT], mu[FEW_NT];
#pragma GCC unroll 4
        for (int t = 0; t < n; t++) pu[t] = mu[t] = _mm512_setzero_ps();
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            const int b = 8 * u + j, c = j / 2, hi = j & 1;
            __m512i dot[FEW_NT];
#pragma GCC unroll 4
            for (int t = 0; t < n; t++) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int jj = 0; jj < 8; jj++) {
                const size_t q = 256 * (size_t)c + 32 * (size_t)jj;
                const __m512i v = pair32(ua + q, ub ? ub + q : NULL);
                __m512i x;
                if (five) {
                    x = _mm512_and_si512(hi ? _mm512_srli_epi16(v, 4) : v, m4);
                    const __m512i h = pair32(ua + F.qh + 32 * jj, ub ? ub + F.qh + 32 * jj : NULL);
                    x = _mm512_mask_add_epi8(x, _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << j))), x, m16);
                } else {
                    x = hi ? _mm512_andnot_si512(m4, v) : _mm512_and_si512(v, m4);
                }
#pragma GCC unroll 4
                for (int t = 0; t < n; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], x, bcast(xq[t] + (size_t)b * 32 + 4 * jj));
            }
            const __m512 s = _mm512_load_ps(sc + 16 * j), mj = _mm512_load_ps(m + 16 * j);
#pragma GCC unroll 4
            for (int t = 0; t < n; t++) {
                pu[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[t]), s), _mm512_set1_ps(xd[t][b]), pu[t]);
                mu[t] = _mm512_fmadd_ps(mj, _mm512_set1_ps(xs[t][b]), mu[t]);
            }
        }
        const __m512 dw = f16x16(ua + F.d, ub ? ub + F.d : NULL), dm = f16x16(ua + F.d + 16, ub ? ub + F.d + 16 : NULL);
#pragma GCC unroll 4
        for (int t = 0; t < n; t++) {
            acc[t] = _mm512_fmadd_ps(pu[t], dw, acc[t]);
            accm[t] = _mm512_fmadd_ps(mu[t], dm, accm[t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, _mm512_sub_ps(acc[t], accm[t]));
}

/* Q6_K: each 16-value half's three packed vectors give its four value vectors (q6k_fourth); the float work
 * as lean_q36_k's. xp: the tokens' half sums (half_sums), nb apart. */
AI void few_q6k(const int n, const few_args *L, const int32_t *xp) {
    const int nu = L->nu, nb = nu * 8;
    const __m512i m6 = _mm512_set1_epi8(63), m3 = _mm512_set1_epi8(3), mc = _mm512_set1_epi8(0x0c);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    const int hint = bl_prefetch_rules[BL_PF_KQUANTS][bl_shared_stream != 0].hint;
    const int8_t *xq[FEW_NT];
    const float *xd[FEW_NT];
    __m512 acc[FEW_NT];
    uint8_t scr[1536] __attribute__((aligned(64))); /* sc [16][16] i32, sab [8][16] i32 */
#pragma GCC unroll 4
    for (int t = 0; t < n; t++) {
        const bl_act_q8 a = bl_act_q8_view(L->xa + (size_t)t * L->xs, nb * BL_QK);
        xq[t] = a.qs, xd[t] = a.d;
        acc[t] = _mm512_setzero_ps();
    }
    for (int u = 0; u < nu; u++) {
        const uint8_t *ua = L->ga + (size_t)u * 1680, *ub = L->gb ? L->gb + (size_t)u * 1680 : NULL;
        if (L->pf) {
            const size_t at = (size_t)u * 1680 + L->pf;
            few_prefetch(L->ga, L->gbytes, at, at + 1680, L->end, hint);
            if (ub) few_prefetch(L->gb, L->gbytes, at, at + 1680, L->end, hint);
        }
        q6k_scales16(ua + 1536, ub ? ub + 1536 : NULL, scr, scr + 1024);
        __m512 pu[FEW_NT];
#pragma GCC unroll 4
        for (int t = 0; t < n; t++) pu[t] = _mm512_setzero_ps();
#pragma GCC unroll 1
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb;
            __m512i i32[FEW_NT];
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const size_t q = 192 * (size_t)kb + 96 * (size_t)h;
                const __m512i V1 = pair32(ua + q, ub ? ub + q : NULL), V2 = pair32(ua + q + 32, ub ? ub + q + 32 : NULL);
                const __m512i V3 = pair32(ua + q + 64, ub ? ub + q + 64 : NULL);
                const __m512i v[4] = {_mm512_and_si512(V1, m6), _mm512_and_si512(V2, m6), _mm512_and_si512(V3, m6),
                                      _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(V1, 6), m3),
                                                                      _mm512_and_si512(_mm512_srli_epi16(V2, 4), mc)),
                                                      _mm512_and_si512(_mm512_srli_epi16(V3, 2), m30))};
                __m512i dot[FEW_NT];
#pragma GCC unroll 4
                for (int t = 0; t < n; t++) {
                    const int8_t *x = xq[t] + (size_t)b * 32 + 16 * h;
                    dot[t] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], bcast(x));
                    dot[t] = _mm512_dpbusd_epi32(dot[t], v[1], bcast(x + 4));
                    dot[t] = _mm512_dpbusd_epi32(dot[t], v[2], bcast(x + 8));
                    dot[t] = _mm512_dpbusd_epi32(dot[t], v[3], bcast(x + 12));
                }
                const __m512i sc = _mm512_load_si512((const void *)(scr + 64 * (2 * kb + h)));
#pragma GCC unroll 4
                for (int t = 0; t < n; t++) {
                    const __m512i p = _mm512_mullo_epi32(dot[t], sc);
                    i32[t] = h ? _mm512_add_epi32(i32[t], p) : p;
                }
            }
            const __m512i sab = _mm512_load_si512((const void *)(scr + 1024 + 64 * kb));
#pragma GCC unroll 4
            for (int t = 0; t < n; t++) {
                const __m512i corr = _mm512_madd_epi16(sab, _mm512_set1_epi32(xp[(size_t)t * nb + b]));
                const __m512i i = _mm512_sub_epi32(i32[t], _mm512_slli_epi32(corr, 5));
                pu[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(xd[t][b]), pu[t]);
            }
        }
        const __m512 dw = f16x16(ua + 1664, ub ? ub + 1664 : NULL);
#pragma GCC unroll 4
        for (int t = 0; t < n; t++) acc[t] = _mm512_fmadd_ps(pu[t], dw, acc[t]);
    }
#pragma GCC unroll 4
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, acc[t]);
}

typedef void (*few_fn)(const few_args *, const int32_t *xp);
static void fq4k_1(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(1, 0, L); }
static void fq4k_2(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(2, 0, L); }
static void fq4k_3(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(3, 0, L); }
static void fq4k_4(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(4, 0, L); }
static void fq5k_1(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(1, 1, L); }
static void fq5k_2(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(2, 1, L); }
static void fq5k_3(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(3, 1, L); }
static void fq5k_4(const few_args *L, const int32_t *xp) { (void)xp, few_q45k(4, 1, L); }
static void fq6k_1(const few_args *L, const int32_t *xp) { few_q6k(1, L, xp); }
static void fq6k_2(const few_args *L, const int32_t *xp) { few_q6k(2, L, xp); }
static void fq6k_3(const few_args *L, const int32_t *xp) { few_q6k(3, L, xp); }
static void fq6k_4(const few_args *L, const int32_t *xp) { few_q6k(4, L, xp); }
static const few_fn FQ6K[FEW_NT] = {fq6k_1, fq6k_2, fq6k_3, fq6k_4};
static const few_fn FQ4K[FEW_NT] = {fq4k_1, fq4k_2, fq4k_3, fq4k_4}, FQ5K[FEW_NT] = {fq5k_1, fq5k_2, fq5k_3, fq5k_4};

/* rows [r0, r1) of a few tokens' call, a pair of groups at a time; the pair's bytes are read once from memory
 * for the first FEW_NT tokens, and from cache for the rest */
static void matmul_few(const few_fn *fns, const int32_t *xp, BL_MM_ARGS) {
    const int type = w->type, cols = w->cols, nu = cols / bl_traits(type)->block_size;
    const size_t gb = bl_i8_group_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    const bl_prefetch_rule rule = bl_prefetch_rules[BL_PF_KQUANTS][bl_shared_stream != 0];
    const uint8_t *end = (const uint8_t *)w->data + (size_t)((r1 + 7) / 8) * gb;
    for (int r = r0; r < r1; r += 16) {
        const uint8_t *ga = (const uint8_t *)w->data + (size_t)(r / 8) * gb;
        const int n = r1 - r < 16 ? r1 - r : 16;
        few_args L = {ga, n > 8 ? ga + gb : NULL, nu, NULL, xb, NULL, ldo, (__mmask16)((1u << n) - 1), 0, gb, end};
        for (int t = 0; t < T; t += FEW_NT) {
            const int nt = T - t < FEW_NT ? T - t : FEW_NT;
            L.xa = (const uint8_t *)xq + (size_t)t * xb;
            L.o = out + (size_t)t * ldo + r;
            L.pf = t == 0 && rule.hint != BL_PF_NONE ? (size_t)rule.bytes : 0;
            fns[nt - 1](&L, xp ? xp + (size_t)t * (size_t)(cols / BL_QK) : NULL);
        }
    }
}

/* Q6_K's and Q3_K's per-block half sums of the activations as int16 pairs (sum qx[0:16] | sum qx[16:32] << 16) */
static void half_sums(const void *xq, int T, size_t xb, int nb, int32_t *xp) {
    const __m256i ones = _mm256_set1_epi8(1);
    for (int t = 0; t < T; t++) {
        const int8_t *q = (const int8_t *)xq + (size_t)t * xb;
        for (int b = 0; b < nb; b++) {
            /* lanes 0-3 sum qx[0:16], lanes 4-7 qx[16:32] */
            __m256i v = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones,
                                            _mm256_loadu_si256((const __m256i *)(const void *)(q + 32 * b)));
            v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0x4e));
            v = _mm256_add_epi32(v, _mm256_shuffle_epi32(v, 0xb1));
            const int32_t lo = _mm256_cvtsi256_si32(v), hi = _mm256_extract_epi32(v, 4);
            xp[(size_t)t * nb + b] = (int32_t)(((uint32_t)lo & 0xffffu) | (uint32_t)hi << 16);
        }
    }
}

/* ---- the matmul ---- */

typedef void (*lean_fn)(const lean_args *);
#define LEAN_FNS(name, lean)                                                                             \
    static void name##1(const lean_args *L) { lean(1, L); }                                              \
    static void name##2(const lean_args *L) { lean(2, L); }                                              \
    static void name##3(const lean_args *L) { lean(3, L); }                                              \
    static void name##4(const lean_args *L) { lean(4, L); }                                              \
    static void name##5(const lean_args *L) { lean(5, L); }                                              \
    static void name##6(const lean_args *L) { lean(6, L); }                                              \
    static void name##7(const lean_args *L) { lean(7, L); }                                              \
    static void name##8(const lean_args *L) { lean(8, L); }                                              \
    static const lean_fn name[NT] = {name##1, name##2, name##3, name##4, name##5, name##6, name##7, name##8};
LEAN_FNS(LQ4K, lean_q4_k)
LEAN_FNS(LQ6K, lean_q6_k)
LEAN_FNS(LQ50, lean_q5_0)
LEAN_FNS(LQ3K, lean_q3_k)

typedef struct {
    void (*unpack)(const uint8_t *ga, const uint8_t *gb, int nu, uint8_t *dst);
    size_t unit_scratch;
    const lean_fn *fns;
    int half_sums;
} lean_path;

static const lean_path LEAN_Q4K = {unpack_q4k, Q4K_UNIT, LQ4K, 0};
static const lean_path LEAN_Q6K = {unpack_q6k, Q6K_UNIT, LQ6K, 1};
static const lean_path LEAN_Q50 = {unpack_q50, Q50_UNIT, LQ50, 0};
static const lean_path LEAN_Q5K = {unpack_q5k, Q4K_UNIT, LQ4K, 0};
static const lean_path LEAN_Q3K = {unpack_q3k, Q6K_UNIT, LQ3K, 1};

/* the scratch a thread unpacks its pairs into (and the half sums), kept between calls and grown as needed */
static _Thread_local uint8_t *scratch;
static _Thread_local size_t scratch_bytes;

static uint8_t *scratch_for(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, bl_round_up(bytes, 64));
        scratch_bytes = scratch ? bl_round_up(bytes, 64) : 0;
    }
    return scratch;
}

static void matmul_lean(const lean_path *P, const bl_matmul_fn fallback, BL_MM_ARGS) {
    const int type = w->type, cols = w->cols, nb = cols / BL_QK, nu = cols / bl_traits(type)->block_size;
    if (T < PREFILL_MIN_T || w->layout != BL_LAYOUT_INTERLEAVE8) {
        fallback(w, xq, T, out, ldo, r0, r1);
        return;
    }
    const size_t gb = bl_i8_group_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    const size_t pair = bl_round_up((size_t)nu * P->unit_scratch, 64);
    const size_t xp_bytes = P->half_sums ? (size_t)T * (size_t)nb * 4 : 0;
    uint8_t *s = scratch_for(pair + xp_bytes);
    if (!s) { /* out of memory: the tiles, which need none */
        fallback(w, xq, T, out, ldo, r0, r1);
        return;
    }
    int32_t *xp = P->half_sums ? (int32_t *)(void *)(s + pair) : NULL;
    if (xp) half_sums(xq, T, xb, nb, xp);
    const uint8_t *end = (const uint8_t *)w->data + (size_t)((r1 + 7) / 8) * gb;
    const int chunks = (T + NT - 1) / NT;
    for (int r = r0; r < r1; r += 16) {
        const uint8_t *ga = (const uint8_t *)w->data + (size_t)(r / 8) * gb;
        const int n = r1 - r < 16 ? r1 - r : 16;
        P->unpack(ga, n > 8 ? ga + gb : NULL, nu, s);
        lean_args L = {s, nu, NULL, xb, NULL, NULL, ldo, (__mmask16)((1u << n) - 1)};
        /* the next pair's weights are fetched into L2 while this pair's tokens run (the unpacking then finds
         * them there), spread over the token chunks so as not to flood the miss queue at once */
        const uint8_t *next = ga + 2 * gb;
        const size_t span = next + 2 * gb <= end ? 2 * gb : next < end ? (size_t)(end - next) : 0;
        for (int t = 0, c = 0; t < T; t += NT, c++) {
            for (size_t o = span * (size_t)c / (size_t)chunks; o < span * (size_t)(c + 1) / (size_t)chunks; o += 64)
                bl_prefetch_line(next + o, BL_PF_L2);
            const int nt = T - t < NT ? T - t : NT;
            L.xa = (const uint8_t *)xq + (size_t)t * xb;
            L.xp = xp ? xp + (size_t)t * nb : NULL;
            L.o = out + (size_t)t * ldo + r;
            P->fns[nt - 1](&L);
        }
    }
}

void bl_mm_q4_k_avx512(BL_MM_ARGS) {
    if (T == 1 && w->layout == BL_LAYOUT_INTERLEAVE8) bl_decode_q4_k_avx512(w, xq, out, r0, r1);
    else if (T < PREFILL_MIN_T && w->layout == BL_LAYOUT_INTERLEAVE8) matmul_few(FQ4K, NULL, w, xq, T, out, ldo, r0, r1);
    else matmul_lean(&LEAN_Q4K, bl_mm_q4_k_avx2, w, xq, T, out, ldo, r0, r1);
}
void bl_mm_q5_0_avx512(BL_MM_ARGS) { matmul_lean(&LEAN_Q50, bl_mm_q5_0_avx2, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q6_k_avx512(BL_MM_ARGS) {
    const int nb = w->cols / BL_QK;
    int32_t xp[4096]; /* the half sums of a few tokens (16 KB) */
    if (T == 1 && w->layout == BL_LAYOUT_INTERLEAVE8 && nb <= 1024) {
        half_sums(xq, 1, 0, nb, xp);
        bl_decode_q6_k_avx512(w, xq, xp, out, r0, r1);
    } else if (T < PREFILL_MIN_T && w->layout == BL_LAYOUT_INTERLEAVE8 && (size_t)T * (size_t)nb <= 4096) {
        half_sums(xq, T, bl_act_row_bytes(w, w->cols), nb, xp);
        matmul_few(FQ6K, xp, w, xq, T, out, ldo, r0, r1);
    } else {
        matmul_lean(&LEAN_Q6K, bl_mm_q6_k_avx2, w, xq, T, out, ldo, r0, r1);
    }
}
void bl_mm_q5_k_avx512(BL_MM_ARGS) {
    if (T == 1 && w->layout == BL_LAYOUT_INTERLEAVE8) bl_decode_q5_k_avx512(w, xq, out, r0, r1);
    else if (T < PREFILL_MIN_T && w->layout == BL_LAYOUT_INTERLEAVE8) matmul_few(FQ5K, NULL, w, xq, T, out, ldo, r0, r1);
    else matmul_lean(&LEAN_Q5K, bl_mm_q5_k_avx2, w, xq, T, out, ldo, r0, r1);
}
void bl_mm_q3_k_avx512(BL_MM_ARGS) { matmul_lean(&LEAN_Q3K, bl_mm_q3_k_avx2, w, xq, T, out, ldo, r0, r1); }
