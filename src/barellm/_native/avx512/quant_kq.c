/* AVX-512 VNNI kernels for Q5_0, Q3_K, Q4_K, Q5_K and Q6_K calls of several tokens (Gemma's, Qwen2.5's Q4_K_M
 * weights; Q5_K and Q3_K from the _M and _S mixes). They read the same interleaved layout as the avx2 tier
 * (quant_kq.h: one .blm file for every tier) and do quant_kq.h's float work in its order, so their bits are
 * the scalar path's. One-token calls of Q4_K, Q5_K and Q6_K go to avx512/decode_kq.c.
 *
 * A call's rows go 16 at a time (two groups of 8). A tile holds one 64-byte vector of values for 4
 * consecutive values of all 16 rows (a 32-bit lane per row) and runs up to NT = 8 tokens over it: one vpdpbusd
 * does 64 multiply-adds where avx2 took maddubs + add + madd for 32, each value vector serves every token of
 * the tile, and each activation granule is an embedded broadcast. The pair's scales are first unpacked into a
 * scratch that stays in cache (as floats, or int32 for Q6_K and Q3_K), and its values either
 *   - with PREFILL_MIN_T tokens or more (prefill): unpacked into the scratch too (plain u8), so that each
 *     later group of 8 tokens only loads them; the next pair's weights are fetched into L2 meanwhile;
 *   - with fewer (a verification of drafted tokens, a small batch of sequences; Q4_K, Q5_K and Q6_K): unpacked
 *     in registers as they are loaded, with the weights prefetched ahead as a decode's, since such a call
 *     reads its weights from memory and the unpacking would cost as much as several tokens' work.
 * Q5_K unpacks into Q4_K's layout (its fifth bit folded into the values) and runs Q4_K's loop; Q3_K into Q6_K's
 * (u = q + 4 < 8) and runs Q6_K's with the offset 4. Q5_0's and Q3_K's calls of fewer than PREFILL_MIN_T
 * tokens keep the avx2 tiles.
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
#include "avx512/simd.h"

#define AI static inline __attribute__((always_inline))
#define PREFILL_MIN_T 12 /* from here the values are unpacked into the scratch */
#define NT 8             /* tokens a tile runs at once */

/* byte k of every 32-bit lane of v, as 16 floats */
AI __m512 lane_byte_ps(const __m512i v, const int k) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * k), _mm512_set1_epi32(255)));
}

/* The arguments of one tile: a pair of groups (16 rows) x up to NT tokens */
typedef struct {
    const uint8_t *s;  /* the pair's scratch: unit u at s + u * su, its scales and, when unpacked, its values */
    size_t su;
    const uint8_t *ga, *gb; /* values unpacked in registers: the pair's groups (gb NULL: the last group alone);
                             * ga NULL: the values are in the scratch */
    size_t gbytes;     /* bytes of a group */
    size_t pf;         /* reading the weights: prefetch distance (0: none) */
    int fill;          /* reading the weights, first tokens: each unit's scales go into the scratch first */
    const uint8_t *end; /* the matrix's end: no prefetch past it */
    int nu;            /* the type's units (blocks or super-blocks) a row */
    int nb;            /* the activations' blocks of 32 a row */
    const uint8_t *xa; /* the first token's activation row */
    size_t xs;
    const int32_t *xp; /* Q6_K, Q3_K: per token (nb apart), per block: int16 pair (sum qx[0:16], sum qx[16:32]) */
    float *o;          /* out of the first token, the pair's first row */
    size_t ldo;
    __mmask16 store;   /* the rows of the 16 to store */
} tile_args;

/* the activations of a tile's tokens */
typedef struct {
    const int8_t *q[NT];
    const float *d[NT], *s[NT];
    const int32_t *sq[NT];
} tile_tokens;

AI void tokens_of(const int n, const tile_args *L, tile_tokens *X) {
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) {
        const bl_act_q8 a = bl_act_q8_view(L->xa + (size_t)t * L->xs, L->nb * BL_QK);
        X->q[t] = a.qs, X->d[t] = a.d, X->s[t] = a.s, X->sq[t] = a.sq;
    }
}

AI void store_tokens(const int n, const tile_args *L, const __m512 *acc) {
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, acc[t]);
}

/* Reading the weights: prefetches the span of unit u, L->pf ahead, in both groups' streams. The pair's groups
 * are read side by side, so a group's stream goes on past its end in the next pair's group of its side, one
 * group further on. */
AI void prefetch_unit(const tile_args *L, const size_t unit, const int u, const int hint) {
    const size_t from = (size_t)u * unit + L->pf;
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
        const uint8_t *g = k ? L->gb : L->ga;
        if (!g) continue;
        for (size_t o = from; o < from + unit; o += 64) {
            const uint8_t *p = g + (o < L->gbytes ? o : o + L->gbytes);
            if (p < L->end) bl_prefetch_line(p, hint);
        }
    }
}

/* ---- Q4_K, Q5_K ---- */

/* scratch per unit of a pair: sc [j] (16 f32: sub-block j's scale, 16 rows), m [j] (16 f32), d (16 f32),
 * dmin (16 f32), then, when unpacked, vals [j][jj] (64 B: granule jj of sub-block j, 16 rows) */
enum { Q4K_SC = 0, Q4K_M = 512, Q4K_D = 1024, Q4K_DMIN = 1088, Q4K_VALS = 1152, Q4K_UNIT = 5248 };

/* The 6-bit scales and mins of a unit of groups A and B (B NULL: zeros) as floats, kq_q4k_scales on 16 rows
 * at once: sc[16 j + r], m[16 j + r] for sub-block j and row r (A's rows, then B's) */
AI void q45k_scales16(const uint8_t *sa, const uint8_t *sb, float *sc, float *m) {
    const __m512i m4 = _mm512_set1_epi8(15), m6 = _mm512_set1_epi8(63), m30 = _mm512_set1_epi8(0x30);
    const __m512i A = pair32(sa, sb), B = pair32(sa + 32, sb ? sb + 32 : NULL), C = pair32(sa + 64, sb ? sb + 64 : NULL);
    const __m512i slo = _mm512_and_si512(A, m6), mlo = _mm512_and_si512(B, m6);
    const __m512i shi = _mm512_or_si512(_mm512_and_si512(C, m4), _mm512_and_si512(_mm512_srli_epi16(A, 2), m30));
    const __m512i mhi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(C, 4), m4),
                                        _mm512_and_si512(_mm512_srli_epi16(B, 2), m30));
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        _mm512_store_ps(sc + 16 * k, lane_byte_ps(slo, k));
        _mm512_store_ps(sc + 16 * (4 + k), lane_byte_ps(shi, k));
        _mm512_store_ps(m + 16 * k, lane_byte_ps(mlo, k));
        _mm512_store_ps(m + 16 * (4 + k), lane_byte_ps(mhi, k));
    }
}

/* the values of sub-blocks j and j + 1 (j even), granule jj of a unit's groups (at ua, ub): the low and high
 * nibbles of the same bytes (Q4_K), with Q5_K's fifth bits from qh (bits j and j + 1 of its granule jj) */
AI void q45k_values(const int five, const uint8_t *ua, const uint8_t *ub, const int j, const int jj, __m512i *lo,
                    __m512i *hi) {
    const kq_fields8 F = five ? KQ_Q5_K : KQ_Q4_K;
    const size_t q = F.q + 256 * (size_t)(j / 2) + 32 * (size_t)jj;
    const __m512i v = pair32(ua + q, ub ? ub + q : NULL), m4 = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(v, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (five) {
        const __m512i h = pair32(ua + F.qh + 32 * (size_t)jj, ub ? ub + F.qh + 32 * (size_t)jj : NULL);
        const __m512i sixteen = _mm512_set1_epi8(16);
        *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << j))), *lo, sixteen);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(2 << j))), *hi, sixteen);
    }
}

/* Q4_K, or Q5_K (five = 1): a unit's scales (and with vals its values) into the scratch at o */
AI void unit_q45k(const uint8_t *ua, const uint8_t *ub, uint8_t *o, const int five, const int vals) {
    const kq_fields8 F = five ? KQ_Q5_K : KQ_Q4_K;
    q45k_scales16(ua + F.sc, ub ? ub + F.sc : NULL, (float *)(void *)(o + Q4K_SC), (float *)(void *)(o + Q4K_M));
    _mm512_store_ps((float *)(void *)(o + Q4K_D), f16x16(ua + F.d, ub ? ub + F.d : NULL));
    _mm512_store_ps((float *)(void *)(o + Q4K_DMIN), f16x16(ua + F.d + 16, ub ? ub + F.d + 16 : NULL));
    if (vals)
        for (int j = 0; j < 8; j += 2)
            for (int jj = 0; jj < 8; jj++) {
                __m512i lo, hi;
                q45k_values(five, ua, ub, j, jj, &lo, &hi);
                _mm512_store_si512((void *)(o + Q4K_VALS + 64 * (8 * j + jj)), lo);
                _mm512_store_si512((void *)(o + Q4K_VALS + 64 * (8 * (j + 1) + jj)), hi);
            }
}

/* Sub-block j (block b of the row) of a unit into pu: its 8 granules' dots, times its scale; the values from the
 * scratch su (the prefill path; the few-token path takes two sub-blocks at once: block_pair_q45k). */
AI void block_q45k(const int n, const uint8_t *su, const tile_tokens *X, const int b, const int j, __m512 *pu) {
    __m512i dot[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; jj++) {
        const __m512i v = _mm512_load_si512((const void *)(su + Q4K_VALS + 64 * (8 * j + jj)));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], v, bcast(X->q[t] + (size_t)b * 32 + 4 * jj));
    }
    const __m512 sc = _mm512_load_ps((const float *)(const void *)(su + Q4K_SC + 64 * j));
#pragma GCC unroll 8
    for (int t = 0; t < n; t++)
        pu[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[t]), sc), _mm512_set1_ps(X->d[t][b]), pu[t]);
}

/* Sub-blocks j and j + 1 (j even; blocks b, b + 1) of a unit into pu, values from the weights at ua, ub: the two
 * sub-blocks are the low and high nibbles of the same bytes, so each granule's bytes (and Q5_K's fifth bits) are
 * loaded once for both; the dots and the float work are block_q45k's, j's before j + 1's (the same bits). The
 * few-token path's: with values unpacked as they are loaded, the loads and lane inserts are as much of the work
 * as the multiply-adds (at 2-8 tokens, 1.5B shapes on Zen 5: 10-25% faster than one sub-block at a time). */
AI void block_pair_q45k(const int n, const int five, const uint8_t *ua, const uint8_t *ub, const uint8_t *su,
                        const tile_tokens *X, const int b, const int j, __m512 *pu) {
    __m512i lo[NT], hi[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) lo[t] = hi[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int jj = 0; jj < 8; jj++) {
        __m512i xl, xh;
        q45k_values(five, ua, ub, j, jj, &xl, &xh);
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            lo[t] = _mm512_dpbusd_epi32(lo[t], xl, bcast(X->q[t] + (size_t)b * 32 + 4 * jj));
            hi[t] = _mm512_dpbusd_epi32(hi[t], xh, bcast(X->q[t] + (size_t)(b + 1) * 32 + 4 * jj));
        }
    }
    const __m512 sl = _mm512_load_ps((const float *)(const void *)(su + Q4K_SC + 64 * j));
    const __m512 sh = _mm512_load_ps((const float *)(const void *)(su + Q4K_SC + 64 * (j + 1)));
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) {
        pu[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo[t]), sl), _mm512_set1_ps(X->d[t][b]), pu[t]);
        pu[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi[t]), sh), _mm512_set1_ps(X->d[t][b + 1]), pu[t]);
    }
}

/* ---- Q5_0 ---- */

/* scratch per block of a pair: vals [g] (64 B: values 4g..4g+3 of the block, 0..31, 16 rows), d (16 f32) */
enum { Q50_VALS = 0, Q50_D = 512, Q50_UNIT = 576 };

/* always with the values: Q5_0 has no few-token tiles */
static void unit_q50(const uint8_t *ua, const uint8_t *ub, uint8_t *o) {
    const __m512i m5 = _mm512_set1_epi8(31), m7 = _mm512_set1_epi8(7), m18 = _mm512_set1_epi8(0x18);
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

AI void tile_q5_0(const int n, const tile_args *L) {
    const int nb = L->nb;
    tile_tokens X;
    tokens_of(n, L, &X);
    __m512 acc[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) acc[t] = _mm512_setzero_ps();
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
            for (int t = 0; t < n; t++) dot[t] = _mm512_dpbusd_epi32(dot[t], v, bcast(X.q[t] + (size_t)b * 32 + 4 * g));
        }
        const __m512 dw = _mm512_load_ps((const float *)(const void *)(su + Q50_D));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            const __m512i i = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(16 * X.sq[t][b]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_set1_ps(X.d[t][b])), acc[t]);
        }
    }
    store_tokens(n, L, acc);
}


/* ---- Q6_K, Q3_K ---- */

/* scratch per unit of a pair: sc [kb][half] (16 i32), sab [kb] (16 int16 pairs: both halves' scales, the offset
 * correction's operand), d (16 f32), then, when unpacked, vals [kb][g] (64 B: granule g of block kb, values
 * 0..63 (Q3_K: u = q + 4, 0..7), 16 rows) */
enum { Q6K_SC = 0, Q6K_SAB = 1024, Q6K_D = 1536, Q6K_VALS = 1600, Q6K_UNIT = 5696 };

/* Signed 8-bit scales of 16 rows into the scratch: V[g] holds scales 4g..4g+3 in each row's lane (byte k:
 * scale 4g + k, the half k % 2 of block 2g + k / 2) */
AI void signed_scales16(const __m512i V[4], uint8_t *o) {
    const __m512i low16 = _mm512_set1_epi32(0xffff);
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        const __m512i even = _mm512_srai_epi16(_mm512_slli_epi16(V[g], 8), 8), odd = _mm512_srai_epi16(V[g], 8);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
            _mm512_store_si512((void *)(o + Q6K_SC + 64 * (4 * g + k)), _mm512_srai_epi32(_mm512_slli_epi32(V[g], 24 - 8 * k), 24));
        _mm512_store_si512((void *)(o + Q6K_SAB + 64 * (2 * g)),
                           _mm512_or_si512(_mm512_and_si512(even, low16), _mm512_slli_epi32(odd, 16)));
        _mm512_store_si512((void *)(o + Q6K_SAB + 64 * (2 * g + 1)),
                           _mm512_or_si512(_mm512_srli_epi32(even, 16), _mm512_andnot_si512(low16, odd)));
    }
}

/* Q6_K's four value vectors of half h of block kb of unit u's groups (at ua, ub): three packed vectors hold
 * values 4p + i in their low 6 bits and, spread over their top 2 bits, the fourth's */
AI void q6k_values(const uint8_t *ua, const uint8_t *ub, const int kb, const int h, __m512i v[4]) {
    const __m512i m6 = _mm512_set1_epi8(63);
    const size_t q = 192 * (size_t)kb + 96 * (size_t)h;
    const __m512i V1 = pair32(ua + q, ub ? ub + q : NULL), V2 = pair32(ua + q + 32, ub ? ub + q + 32 : NULL);
    const __m512i V3 = pair32(ua + q + 64, ub ? ub + q + 64 : NULL);
    v[0] = _mm512_and_si512(V1, m6), v[1] = _mm512_and_si512(V2, m6), v[2] = _mm512_and_si512(V3, m6);
    v[3] = _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(V1, 6), _mm512_set1_epi8(3)),
                                           _mm512_and_si512(_mm512_srli_epi16(V2, 4), _mm512_set1_epi8(0x0c))),
                           _mm512_and_si512(_mm512_srli_epi16(V3, 2), _mm512_set1_epi8(0x30)));
}

AI void unit_q6k(const uint8_t *ua, const uint8_t *ub, uint8_t *o, const int vals) {
    __m512i V[4];
    for (int g = 0; g < 4; g++) V[g] = pair32(ua + 1536 + 32 * g, ub ? ub + 1536 + 32 * g : NULL);
    signed_scales16(V, o);
    _mm512_store_ps((float *)(void *)(o + Q6K_D), f16x16(ua + 1664, ub ? ub + 1664 : NULL));
    if (vals)
        for (int kb = 0; kb < 8; kb++)
            for (int h = 0; h < 2; h++) {
                __m512i v[4];
                q6k_values(ua, ub, kb, h, v);
                for (int g = 0; g < 4; g++) _mm512_store_si512((void *)(o + Q6K_VALS + 64 * (8 * kb + 4 * h + g)), v[g]);
            }
}

/* always with the values: Q3_K has no few-token tiles */
static void unit_q3k(const uint8_t *ua, const uint8_t *ub, uint8_t *o) {
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(4), m15 = _mm512_set1_epi8(15);
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
    /* kq_q3k_scales on 16 rows: byte k of V[i] is scale 4i + k, (low nibble | 2 high bits << 4) - 32. A
     * padding row's scales come out -32, not 0: harmless, its outputs are never stored. */
    const __m512i SA = pair32(ua + 768, ub ? ub + 768 : NULL), SB = pair32(ua + 800, ub ? ub + 800 : NULL);
    const __m512i SC = pair32(ua + 832, ub ? ub + 832 : NULL);
    const __m512i lo[4] = {_mm512_and_si512(SA, m15), _mm512_and_si512(SB, m15),
                           _mm512_and_si512(_mm512_srli_epi16(SA, 4), m15), _mm512_and_si512(_mm512_srli_epi16(SB, 4), m15)};
    __m512i V[4];
    for (int i = 0; i < 4; i++) {
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(SC, 2 * i), m3);
        V[i] = _mm512_sub_epi8(_mm512_or_si512(lo[i], _mm512_slli_epi16(hi, 4)), _mm512_set1_epi8(32));
    }
    signed_scales16(V, o);
    _mm512_store_ps((float *)(void *)(o + Q6K_D), f16x16(ua + 864, ub ? ub + 864 : NULL));
}

/* Block kb (block b of the row) of a unit into pu: both halves' dots times their scales, less the offset's
 * share. off: log2 of the values' offset (Q6_K q - 32: 5, Q3_K q - 4: 2), taken off once per block as
 * (sa * sum(qx[0:16]) + sb * sum(qx[16:32])) << off, so the unpacked values stay unsigned for vpdpbusd */
AI void block_q36k(const int n, const int off, const int w, const uint8_t *ua, const uint8_t *ub, const uint8_t *su,
                   const tile_args *L, const tile_tokens *X, const int b, const int kb, __m512 *pu) {
    const int nb = L->nb;
    __m512i i32[NT];
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512i v[4], dot[NT];
        if (w) q6k_values(ua, ub, kb, h, v);
        else
            for (int g = 0; g < 4; g++) v[g] = _mm512_load_si512((const void *)(su + Q6K_VALS + 64 * (8 * kb + 4 * h + g)));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) dot[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int g = 0; g < 4; g++)
#pragma GCC unroll 8
            for (int t = 0; t < n; t++)
                dot[t] = _mm512_dpbusd_epi32(dot[t], v[g], bcast(X->q[t] + (size_t)b * 32 + 16 * h + 4 * g));
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
        pu[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(X->d[t][b]), pu[t]);
    }
}

/* ---- the K-quant tiles ---- */

/* The scales chain of the Q4_K, Q5_K (kind 4, 5), Q6_K and Q3_K (6, 3) tiles: acc = fma(pu, d, acc) over the
 * units, pu the sum of a unit's 8 blocks (block_q45k, block_q36k), from 0. w: the values come from the weights
 * (the few-token path: their units are prefetched ahead and, with L->fill, their scales first go into the
 * scratch); a constant, as n and kind. */
AI void units_chain(const int n, const int kind, const int w, const tile_args *L, const tile_tokens *X, __m512 *acc) {
    const int six = kind == 6 || kind == 3;
    const size_t unit = six ? KQ_Q6_K.unit : kind == 5 ? KQ_Q5_K.unit : KQ_Q4_K.unit;
    const int nu = L->nu, hint = bl_prefetch_rules[BL_PF_KQUANTS][bl_shared_stream != 0].hint;
    for (int u = 0; u < nu; u++) {
        const uint8_t *su = L->s + (size_t)u * L->su;
        const uint8_t *ua = w ? L->ga + (size_t)u * unit : NULL, *ub = w && L->gb ? L->gb + (size_t)u * unit : NULL;
        if (w && L->pf) prefetch_unit(L, unit, u, hint);
        if (w && L->fill) {
            if (six) unit_q6k(ua, ub, (uint8_t *)su, 0);
            else unit_q45k(ua, ub, (uint8_t *)su, kind == 5, 0);
        }
        __m512 pu[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) pu[t] = _mm512_setzero_ps();
        if (!six && w) {
#pragma GCC unroll 1
            for (int j = 0; j < 8; j += 2) block_pair_q45k(n, kind == 5, ua, ub, su, X, 8 * u + j, j, pu);
        } else {
#pragma GCC unroll 1
            for (int j = 0; j < 8; j++) {
                if (six) block_q36k(n, kind == 3 ? 2 : 5, w, ua, ub, su, L, X, 8 * u + j, j, pu);
                else block_q45k(n, su, X, 8 * u + j, j, pu);
            }
        }
        const __m512 dw = _mm512_load_ps((const float *)(const void *)(su + (six ? Q6K_D : Q4K_D)));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) acc[t] = _mm512_fmadd_ps(pu[t], dw, acc[t]);
    }
}

AI void tile_q45_k(const int n, const int five, const int w, const tile_args *L) {
    const int nu = L->nu;
    tile_tokens X;
    tokens_of(n, L, &X);
    __m512 acc[NT], accm[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) acc[t] = accm[t] = _mm512_setzero_ps();
    units_chain(n, five ? 5 : 4, w, L, &X, acc);
    /* the mins chain, a pass of its own over the scratch: with it in the loop above the 8 tokens' chains do
     * not fit the 32 registers */
    for (int u = 0; u < nu; u++) {
        const uint8_t *su = L->s + (size_t)u * L->su;
        __m512 mu[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) mu[t] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m512 m = _mm512_load_ps((const float *)(const void *)(su + Q4K_M + 64 * j));
#pragma GCC unroll 8
            for (int t = 0; t < n; t++) mu[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(X.s[t][8 * u + j]), mu[t]);
        }
        const __m512 dm = _mm512_load_ps((const float *)(const void *)(su + Q4K_DMIN));
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) accm[t] = _mm512_fmadd_ps(mu[t], dm, accm[t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) acc[t] = _mm512_sub_ps(acc[t], accm[t]);
    store_tokens(n, L, acc);
}

/* Q6_K, or Q3_K (three = 1) */
AI void tile_q36_k(const int n, const int three, const int w, const tile_args *L) {
    tile_tokens X;
    tokens_of(n, L, &X);
    __m512 acc[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) acc[t] = _mm512_setzero_ps();
    units_chain(n, three ? 3 : 6, w, L, &X, acc);
    store_tokens(n, L, acc);
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

typedef void (*tile_fn)(const tile_args *);
#define TILE_FNS(name, call)                                                                            \
    static void name##1(const tile_args *L) { call(1, L); }                                               \
    static void name##2(const tile_args *L) { call(2, L); }                                               \
    static void name##3(const tile_args *L) { call(3, L); }                                               \
    static void name##4(const tile_args *L) { call(4, L); }                                               \
    static void name##5(const tile_args *L) { call(5, L); }                                               \
    static void name##6(const tile_args *L) { call(6, L); }                                               \
    static void name##7(const tile_args *L) { call(7, L); }                                               \
    static void name##8(const tile_args *L) { call(8, L); }                                               \
    static const tile_fn name[NT] = {name##1, name##2, name##3, name##4, name##5, name##6, name##7, name##8};
#define Q4K_TILE(n, L) tile_q45_k(n, 0, 0, L)
#define Q5K_TILE(n, L) tile_q45_k(n, 1, 0, L)
#define Q6K_TILE(n, L) tile_q36_k(n, 0, 0, L)
#define Q3K_TILE(n, L) tile_q36_k(n, 1, 0, L)
#define Q4K_FEW(n, L) tile_q45_k(n, 0, 1, L)
#define Q5K_FEW(n, L) tile_q45_k(n, 1, 1, L)
#define Q6K_FEW(n, L) tile_q36_k(n, 0, 1, L)
TILE_FNS(TQ4K, Q4K_TILE)
TILE_FNS(TQ5K, Q5K_TILE)
TILE_FNS(TQ6K, Q6K_TILE)
TILE_FNS(TQ3K, Q3K_TILE)
TILE_FNS(TQ50, tile_q5_0)
TILE_FNS(FQ4K, Q4K_FEW)
TILE_FNS(FQ5K, Q5K_FEW)
TILE_FNS(FQ6K, Q6K_FEW)

typedef struct {
    void (*unpack)(const uint8_t *ua, const uint8_t *ub, uint8_t *o); /* a unit, its values and scales */
    size_t in;          /* the unit's bytes in a group */
    size_t unit;        /* scratch bytes per unit with the values */
    size_t scales_unit; /* without them, for the few-token tiles (0: the type has none) */
    const tile_fn *fns, *few_fns;
    int half_sums;
} tile_path;

static void unit_q4k(const uint8_t *ua, const uint8_t *ub, uint8_t *o) { unit_q45k(ua, ub, o, 0, 1); }
static void unit_q5k(const uint8_t *ua, const uint8_t *ub, uint8_t *o) { unit_q45k(ua, ub, o, 1, 1); }
static void unit_q6kv(const uint8_t *ua, const uint8_t *ub, uint8_t *o) { unit_q6k(ua, ub, o, 1); }

static const tile_path PATH_Q4K = {unit_q4k, 1152, Q4K_UNIT, Q4K_VALS, TQ4K, FQ4K, 0};
static const tile_path PATH_Q5K = {unit_q5k, 1408, Q4K_UNIT, Q4K_VALS, TQ5K, FQ5K, 0};
static const tile_path PATH_Q6K = {unit_q6kv, 1680, Q6K_UNIT, Q6K_VALS, TQ6K, FQ6K, 1};
static const tile_path PATH_Q3K = {unit_q3k, 880, Q6K_UNIT, 0, TQ3K, NULL, 1};
static const tile_path PATH_Q50 = {unit_q50, 176, Q50_UNIT, 0, TQ50, NULL, 0};

static void matmul_tiles(const tile_path *P, const bl_matmul_fn fallback, BL_MM_ARGS) {
    const int type = w->type, cols = w->cols, nb = cols / BL_QK, nu = cols / bl_traits(type)->block_size;
    const int few = T < PREFILL_MIN_T;
    if ((few && !P->scales_unit) || w->layout != BL_LAYOUT_INTERLEAVE8) {
        fallback(w, xq, T, out, ldo, r0, r1);
        return;
    }
    const size_t gb = bl_i8_group_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    const size_t su = few ? P->scales_unit : P->unit, pair = bl_round_up((size_t)nu * su, 64);
    const size_t xp_bytes = P->half_sums ? (size_t)T * (size_t)nb * 4 : 0;
    uint8_t *s = bl_thread_scratch(pair + xp_bytes); /* the pair's scratch, then the half sums */
    if (!s) { /* out of memory: the avx2 tiles, which need none */
        fallback(w, xq, T, out, ldo, r0, r1);
        return;
    }
    int32_t *xp = P->half_sums ? (int32_t *)(void *)(s + pair) : NULL;
    if (xp) half_sums(xq, T, xb, nb, xp);
    const bl_prefetch_rule rule = bl_prefetch_rules[BL_PF_KQUANTS][bl_shared_stream != 0];
    const uint8_t *end = (const uint8_t *)w->data + (size_t)((r1 + 7) / 8) * gb;
    const int chunks = (T + NT - 1) / NT;
    for (int r = r0; r < r1; r += 16) {
        const uint8_t *ga = (const uint8_t *)w->data + (size_t)(r / 8) * gb;
        const int n = r1 - r < 16 ? r1 - r : 16;
        const uint8_t *gb2 = n > 8 ? ga + gb : NULL;
        if (!few) /* the first tokens' tiles fill the scales in as they read the weights */
            for (int u = 0; u < nu; u++)
                P->unpack(ga + (size_t)u * P->in, gb2 ? gb2 + (size_t)u * P->in : NULL, s + (size_t)u * su);
        tile_args L = {s, su, few ? ga : NULL, few ? gb2 : NULL, gb, 0, 0, end, nu, nb,
                       NULL, xb, NULL, NULL, ldo, (__mmask16)((1u << n) - 1)};
        /* unpacked: the next pair's weights are fetched into L2 while this pair's tokens run (the unpacking
         * then finds them there), spread over the token chunks so as not to flood the miss queue at once */
        const uint8_t *next = ga + 2 * gb;
        const size_t span = few ? 0 : next + 2 * gb <= end ? 2 * gb : next < end ? (size_t)(end - next) : 0;
        for (int t = 0, c = 0; t < T; t += NT, c++) {
            for (size_t o = span * (size_t)c / (size_t)chunks; o < span * (size_t)(c + 1) / (size_t)chunks; o += 64)
                bl_prefetch_line(next + o, BL_PF_L2);
            const int nt = T - t < NT ? T - t : NT;
            L.pf = few && t == 0 && rule.hint != BL_PF_NONE ? (size_t)rule.bytes : 0;
            L.fill = few && t == 0;
            L.xa = (const uint8_t *)xq + (size_t)t * xb;
            L.xp = xp ? xp + (size_t)t * nb : NULL;
            L.o = out + (size_t)t * ldo + r;
            (few ? P->few_fns : P->fns)[nt - 1](&L);
        }
    }
}

void bl_mm_q4_k_avx512(BL_MM_ARGS) {
    if (T == 1 && w->layout == BL_LAYOUT_INTERLEAVE8) bl_decode_q4_k_avx512(w, xq, out, r0, r1);
    else matmul_tiles(&PATH_Q4K, bl_mm_q4_k_avx2, w, xq, T, out, ldo, r0, r1);
}
void bl_mm_q5_k_avx512(BL_MM_ARGS) {
    if (T == 1 && w->layout == BL_LAYOUT_INTERLEAVE8) bl_decode_q5_k_avx512(w, xq, out, r0, r1);
    else matmul_tiles(&PATH_Q5K, bl_mm_q5_k_avx2, w, xq, T, out, ldo, r0, r1);
}
void bl_mm_q6_k_avx512(BL_MM_ARGS) {
    const int nb = w->cols / BL_QK;
    int32_t xp[1024];
    if (T == 1 && w->layout == BL_LAYOUT_INTERLEAVE8 && nb <= 1024) {
        half_sums(xq, 1, 0, nb, xp);
        bl_decode_q6_k_avx512(w, xq, xp, out, r0, r1);
    } else {
        matmul_tiles(&PATH_Q6K, bl_mm_q6_k_avx2, w, xq, T, out, ldo, r0, r1);
    }
}
void bl_mm_q5_0_avx512(BL_MM_ARGS) { matmul_tiles(&PATH_Q50, bl_mm_q5_0_avx2, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q3_k_avx512(BL_MM_ARGS) { matmul_tiles(&PATH_Q3K, bl_mm_q3_k_avx2, w, xq, T, out, ldo, r0, r1); }
