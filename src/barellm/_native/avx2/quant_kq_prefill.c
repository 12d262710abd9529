/* The avx2 tier's prefill path for Q4_K and Q6_K (from PREFILL_MIN_T tokens, avx2/quant_kq.c): the same
 * integers and float work as the tiles there, with each group unpacked once. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>

#include "tier.h"
#include "avx2/kquants.h"

/* ---- prefill: each group unpacked once, then every token of the call ----
 *
 * With many tokens the tiles (avx2/quant_kq.c) unpack every weight vector again for each 4 tokens and broadcast every
 * activation granule once per 8 rows. Here a group's values are first unpacked into plain u8 vectors (and
 * its scales into the madd operands) in a scratch buffer that stays in cache, and a lean loop then runs
 * over two groups (16 rows) and PNT tokens at a time: each activation broadcast serves 16 rows, each loaded
 * vector PNT tokens, and no value is unpacked twice. The integer sums are the same exact integers and the
 * float work is the tiles' own, in the same order, so the bits are those of every other path. */
#define PNT 2
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
        UNIT(A, NG, NT, 1, six ? Q6K_UNIT_SCRATCH : Q4K_UNIT_SCRATCH, u); /* gu: the unit in the scratch */
#pragma GCC unroll 1
        for (int j = 0; j < 8; j++) {
            if (six) lean_q6k_block(NG, NT, A, gu, j, 8 * u + j, xq, xd, pu);
            else lean_q4k_block(NG, NT, gu, j, 8 * u + j, xq, xd, pu);
        }
        unit_end(NG, NT, gu, six ? 2816 : 2304, 0, pu, acc);
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

int bl_kq_prefill_q4_k_avx2(const bl_matrix *w, const void *xq, int T, const int32_t *xp, float *out, size_t ldo,
                            int r0, int r1) {
    return matmul_lean(&LEAN_Q4K, w, xq, T, xp, out, ldo, r0, r1);
}

int bl_kq_prefill_q6_k_avx2(const bl_matrix *w, const void *xq, int T, const int32_t *xp, float *out, size_t ldo,
                            int r0, int r1) {
    return matmul_lean(&LEAN_Q6K, w, xq, T, xp, out, ldo, r0, r1);
}
