/* AVX2/FMA matmuls of Q4_0, Q4_1 and Q8_0 weights on the interleaved layout (the tier's other matmul files:
 * act.c the activation quantizers, quant_rows.c these types in GGUF's row order, float.c F32 and F16,
 * quant_kq.c and quant_kq_prefill.c the K-quants). They do the float work described in quant_internal.h in
 * exactly the scalar path's order (every float operation is an explicit intrinsic, so no contraction can
 * differ between variants); the integer work is exact, so its order is free.
 *
 * The fast layout is BL_LAYOUT_INTERLEAVE8: one 32-byte vector holds 4 consecutive quant bytes of each of
 * 8 rows, so a broadcast of 4 activation bytes and one maddubs give each 32-bit lane one row's partial
 * dot: the 8 lanes of the result are the 8 rows' block sums, with no horizontal reduction. For Q4 the
 * int16 pair sums are at most 2 * 15 * 128 = 3840, so a block's 8 maddubs add up in int16 (<= 30720)
 * before one madd. A tile is 8 rows x NT tokens (NT <= 8): each weight vector loaded and unpacked once is
 * used for NT tokens (prefill); decode (T = 1) takes 16 rows x 1 token.
 */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"
#include "avx2/simd.h"
#include "avx2/tiles.h"

#define AI static inline __attribute__((always_inline))

/* Software prefetch (kernels.h's rules, BL_PF_BLOCKS). Measured on Zen 3: streaming a Q4_1 or Q8_0 matrix
 * from memory at T = 1 went from ~8-11 GB/s (hardware prefetchers alone) to ~16-19 GB/s at 4 KB ahead; 2 KB
 * was less, 8 KB no better. */
AI void prefetch_lines(const uint8_t *p, const int n, const int hint) {
    for (int i = 0; i < n; i++) bl_prefetch_line(p + 64 * i, hint);
}

/* block b of a group whose blocks take `bytes` bytes (the tiles' weights), once its share of the prefetch span
 * (n lines at pf + b * pfs; pf NULL: none) is on its way */
AI const uint8_t *block_at(const uint8_t *g, const int b, const size_t bytes, const uint8_t *pf, const size_t pfs,
                           const int n, const int hint) {
    if (pf) prefetch_lines(pf + (size_t)b * pfs, n, hint);
    return g + (size_t)b * bytes;
}

/* ---- interleaved quantized weights: tiles of 8 rows x NT tokens ---- */

/* Token t of a tile: its activation row is xa + t * xs. Per-token values live in separate variables
 * (suffix 0..3) rather than arrays, so that they stay in registers; FOR_T runs a statement per token. */
#define FOR_T(X)                                                                                         \
    do {                                                                                                 \
        X(0);                                                                                            \
        if (NT > 1) { X(1); }                                                                            \
        if (NT > 2) { X(2); }                                                                            \
        if (NT > 3) { X(3); }                                                                            \
        if (NT > 4) { X(4); }                                                                            \
        if (NT > 5) { X(5); }                                                                            \
        if (NT > 6) { X(6); }                                                                            \
        if (NT > 7) { X(7); }                                                                            \
    } while (0)

/* keeps the compiler from re-associating a token's integer sums into a tree that holds every product live
 * at once (which spills); the out-of-order core overlaps the chains anyway */
#define PIN(v) __asm__("" : "+x"(v))

/* x2: BL_ACT_Q8X2 activations. Each weight vector then meets the hi and the lo plane of every token; the
 * hi and lo sums stay apart through a block (each bounded as above) and meet in int32 as 254 * hi + lo.
 * Twice the accumulators per token, so tiles hold fewer tokens (matmul_i8). */
#define ACT_PTRS(t)                                                                                      \
    const int8_t *xq##t = (const int8_t *)(xa + (t) * xs);                                               \
    const int8_t *xl##t = xq##t + (size_t)nb * 32;                                                       \
    const float *xd##t = (const float *)(const void *)(xa + (t) * xs + (size_t)nb * (x2 ? 64 : 32));     \
    const float *xs##t = xd##t + nb;                                                                     \
    const int32_t *xsq##t = (const int32_t *)(const void *)(xd##t + 2 * nb);                             \
    (void)xq##t; (void)xl##t; (void)xd##t; (void)xs##t; (void)xsq##t;                                    \
    __m256 acc##t = _mm256_setzero_ps(), accm##t = _mm256_setzero_ps();                                  \
    __m256i s##t, sl##t;                                                                                 \
    (void)accm##t; (void)sl##t

/* a tile's arguments, and its tokens' pointers and accumulators */
#define TILE_VARS(A)                                                                                     \
    const uint8_t *g = (A)->g, *xa = (A)->xa, *pf = (A)->pf;                                             \
    const int nb = (A)->nu, nvalid = (A)->nvalid;                                                        \
    const size_t xs = (A)->xs, ldo = (A)->ldo, pfs = (A)->pfs;                                           \
    const int hint = (A)->hint;                                                                          \
    float *o = (A)->o;                                                                                   \
    ACT_PTRS(0);                                                                                         \
    ACT_PTRS(1);                                                                                         \
    ACT_PTRS(2);                                                                                         \
    ACT_PTRS(3);                                                                                         \
    ACT_PTRS(4);                                                                                         \
    ACT_PTRS(5);                                                                                         \
    ACT_PTRS(6);                                                                                         \
    ACT_PTRS(7)

AI void tile_q4(const int type, const int x2, const int NT, const tile_args *A) {
    TILE_VARS(A);
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i khi = x2 ? _mm256_set1_epi16(254) : ones; /* the weight of the (hi) plane */
    const uint8_t *dp = g + (size_t)nb * 128, *mp = dp + (size_t)nb * 16;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = block_at(g, b, 128, pf, pfs, 3, hint);
        const size_t xo = (size_t)b * 32;
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
#define Q4_DOT(t)                                                                                        \
    const __m256i p##t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(xq##t + xo + 4 * j)),         \
                                          _mm256_maddubs_epi16(hi, bcast32(xq##t + xo + 16 + 4 * j)));   \
    s##t = j ? _mm256_add_epi16(s##t, p##t) : p##t;                                                      \
    PIN(s##t);                                                                                           \
    if (x2) {                                                                                            \
        const __m256i pl##t = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(xl##t + xo + 4 * j)),    \
                                               _mm256_maddubs_epi16(hi, bcast32(xl##t + xo + 16 + 4 * j))); \
        sl##t = j ? _mm256_add_epi16(sl##t, pl##t) : pl##t;                                              \
        PIN(sl##t);                                                                                      \
    }
            FOR_T(Q4_DOT);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + (size_t)b * 16)));
#define Q4_SCALE(t)                                                                                      \
    __m256i i##t = _mm256_madd_epi16(s##t, khi);                                                         \
    if (x2) i##t = _mm256_add_epi32(i##t, _mm256_madd_epi16(sl##t, ones));                               \
    if (type == BL_Q4_0) i##t = _mm256_sub_epi32(i##t, _mm256_set1_epi32(8 * xsq##t[b]));                \
    acc##t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i##t), _mm256_mul_ps(dw, _mm256_set1_ps(xd##t[b])), acc##t)
        FOR_T(Q4_SCALE);
        if (type == BL_Q4_1 && NT <= 2) {
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp + (size_t)b * 16)));
#define Q4_MIN(t) accm##t = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs##t[b]), accm##t)
            FOR_T(Q4_MIN);
        }
    }
    if (type == BL_Q4_1 && NT > 2) { /* the min chain in a pass of its own: fewer live registers above */
        for (int b = 0; b < nb; b++) {
            const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp + (size_t)b * 16)));
            FOR_T(Q4_MIN);
        }
    }
#define Q4_STORE(t) store8(o + (t) * ldo, type == BL_Q4_1 ? _mm256_add_ps(acc##t, accm##t) : acc##t, nvalid)
    FOR_T(Q4_STORE);
}

AI void tile_q8(const int x2, const int NT, const tile_args *A) {
    TILE_VARS(A);
    const __m256i ones = _mm256_set1_epi16(1), khi = x2 ? _mm256_set1_epi16(254) : ones;
    const uint8_t *dp = g + (size_t)nb * 256;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = block_at(g, b, 256, pf, pfs, 5, hint);
        const size_t xo = (size_t)b * 32;
        for (int j = 0; j < 8; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
            const __m256i av = _mm256_abs_epi8(v);
#define Q8_DOT(t)                                                                                        \
    __m256i p##t = _mm256_madd_epi16(                                                                    \
        _mm256_maddubs_epi16(av, _mm256_sign_epi8(bcast32(xq##t + xo + 4 * j), v)), khi);               \
    if (x2)                                                                                              \
        p##t = _mm256_add_epi32(p##t, _mm256_madd_epi16(                                                 \
            _mm256_maddubs_epi16(av, _mm256_sign_epi8(bcast32(xl##t + xo + 4 * j), v)), ones));          \
    s##t = j ? _mm256_add_epi32(s##t, p##t) : p##t;                                                      \
    PIN(s##t)
            FOR_T(Q8_DOT);
        }
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + (size_t)b * 16)));
#define Q8_SCALE(t)                                                                                      \
    acc##t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s##t), _mm256_mul_ps(dw, _mm256_set1_ps(xd##t[b])), acc##t)
        FOR_T(Q8_SCALE);
    }
#define Q8_STORE(t) store8(o + (t) * ldo, acc##t, nvalid)
    FOR_T(Q8_STORE);
}

/* The tiles of one type and activation type for 1..N tokens, and their table */
#define UPTO3(X, k) X(k, 1) X(k, 2) X(k, 3)
#define UPTO4(X, k) UPTO3(X, k) X(k, 4)
#define UPTO8(X, k) UPTO4(X, k) X(k, 5) X(k, 6) X(k, 7) X(k, 8)
#define TILE(k, NT) static void k##_##NT(tile_args *A) { k(NT, A); }
#define ENTRY(k, NT) k##_##NT,
#define TILES(k, UPTO) UPTO(TILE, k) static const tile_fn k##_tiles[] = {UPTO(ENTRY, k)};
AI void q40(const int NT, const tile_args *A) { tile_q4(BL_Q4_0, 0, NT, A); }
AI void q41(const int NT, const tile_args *A) { tile_q4(BL_Q4_1, 0, NT, A); }
AI void q80(const int NT, const tile_args *A) { tile_q8(0, NT, A); }
AI void q40x2(const int NT, const tile_args *A) { tile_q4(BL_Q4_0, 1, NT, A); }
AI void q41x2(const int NT, const tile_args *A) { tile_q4(BL_Q4_1, 1, NT, A); }
AI void q80x2(const int NT, const tile_args *A) { tile_q8(1, NT, A); }
TILES(q40, UPTO8)
TILES(q41, UPTO8)
TILES(q80, UPTO4)
TILES(q40x2, UPTO3)
TILES(q41x2, UPTO3)
TILES(q80x2, UPTO3)

/* tile_q4_g2's int16 sums of one activation plane x over vector j (lo, hi: its nibbles; 2: the second group's) */
AI void q4_g2_plane(const __m256i lo, const __m256i hi, const __m256i lo2, const __m256i hi2, const int8_t *x,
                    const int j, __m256i *s, __m256i *s2) {
    const __m256i xl = bcast32(x + 4 * j), xh = bcast32(x + 16 + 4 * j);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
    const __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(lo2, xl), _mm256_maddubs_epi16(hi2, xh));
    *s = j ? _mm256_add_epi16(*s, p) : p;
    *s2 = j ? _mm256_add_epi16(*s2, p2) : p2;
    PIN(*s);
    PIN(*s2);
}

/* Decode (one token) over two groups of 8 rows, g and g2, from two streams (two_streams in avx2/tiles.h: the
 * first is a whole group): each activation broadcast serves both. Same float work per output as tile_q4. */
AI void tile_q4_g2(const int type, const int x2, const tile_args *A) {
    const uint8_t *g = A[0].g, *g2 = A[1].g, *xa = A->xa, *pf = A[0].pf, *pf2 = A[1].pf;
    const int nb = A->nu, nvalid2 = A[1].nvalid;
    const size_t pfs = A->pfs;
    const int hint = A->hint;
    float *o = A[0].o, *o2 = A[1].o;
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i khi = x2 ? _mm256_set1_epi16(254) : ones; /* the weight of the (hi) plane */
    const uint8_t *dp = g + (size_t)nb * 128, *mp = dp + (size_t)nb * 16;
    const uint8_t *dp2 = g2 + (size_t)nb * 128, *mp2 = dp2 + (size_t)nb * 16;
    const int8_t *xh = (const int8_t *)xa, *xl = xh + (size_t)nb * 32;
    const float *xd = (const float *)(const void *)(xa + (size_t)nb * (x2 ? 64 : 32)), *xsm = xd + nb;
    const int32_t *xsq = (const int32_t *)(const void *)(xd + 2 * nb);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    __m256 acc2 = _mm256_setzero_ps(), accm2 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = g + (size_t)b * 128, *q2 = g2 + (size_t)b * 128;
        const int8_t *h = xh + (size_t)b * 32, *l = xl + (size_t)b * 32;
        if (pf) prefetch_lines(pf + (size_t)b * pfs, 3, hint);
        if (pf2) prefetch_lines(pf2 + (size_t)b * pfs, 3, hint);
        __m256i sh, sl, sh2, sl2;
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
            const __m256i v2 = _mm256_loadu_si256((const __m256i *)(q2 + 32 * j));
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            const __m256i lo2 = _mm256_and_si256(v2, m4), hi2 = _mm256_and_si256(_mm256_srli_epi16(v2, 4), m4);
            q4_g2_plane(lo, hi, lo2, hi2, h, j, &sh, &sh2);
            if (x2) q4_g2_plane(lo, hi, lo2, hi2, l, j, &sl, &sl2);
        }
        __m256i i = _mm256_madd_epi16(sh, khi), i2 = _mm256_madd_epi16(sh2, khi);
        if (x2) {
            i = _mm256_add_epi32(i, _mm256_madd_epi16(sl, ones));
            i2 = _mm256_add_epi32(i2, _mm256_madd_epi16(sl2, ones));
        }
        if (type == BL_Q4_0) {
            const __m256i off = _mm256_set1_epi32(8 * xsq[b]);
            i = _mm256_sub_epi32(i, off);
            i2 = _mm256_sub_epi32(i2, off);
        }
        const __m256 dx = _mm256_set1_ps(xd[b]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + (size_t)b * 16)));
        const __m256 dw2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp2 + (size_t)b * 16)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dw, dx), acc);
        acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i2), _mm256_mul_ps(dw2, dx), acc2);
        if (type == BL_Q4_1) {
            const __m256 sx = _mm256_set1_ps(xsm[b]);
            accm = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp + (size_t)b * 16))), sx, accm);
            accm2 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mp2 + (size_t)b * 16))), sx, accm2);
        }
    }
    store8(o, type == BL_Q4_1 ? _mm256_add_ps(acc, accm) : acc, 8);
    store8(o2, type == BL_Q4_1 ? _mm256_add_ps(acc2, accm2) : acc2, nvalid2);
}

static void q40_g2(tile_args *A) { tile_q4_g2(BL_Q4_0, 0, A); }
static void q41_g2(tile_args *A) { tile_q4_g2(BL_Q4_1, 0, A); }
static void q40x2_g2(tile_args *A) { tile_q4_g2(BL_Q4_0, 1, A); }
static void q41x2_g2(tile_args *A) { tile_q4_g2(BL_Q4_1, 1, A); }

/* Q8_0 decode over two groups of 8 rows from two streams (as tile_q4_g2). x2: Q8X2 activations. Same float
 * work per output as tile_q8. */
AI void tile_q8_g2(const int x2, const tile_args *A) {
    const uint8_t *g = A[0].g, *g2 = A[1].g, *xa = A->xa, *pf = A[0].pf, *pf2 = A[1].pf;
    const int nb = A->nu, nvalid2 = A[1].nvalid;
    const size_t pfs = A->pfs;
    const int hint = A->hint;
    float *o = A[0].o, *o2 = A[1].o;
    const __m256i ones = _mm256_set1_epi16(1), khi = x2 ? _mm256_set1_epi16(254) : ones;
    const uint8_t *dp = g + (size_t)nb * 256, *dp2 = g2 + (size_t)nb * 256;
    const int8_t *xh = (const int8_t *)xa, *xl = xh + (size_t)nb * 32;
    const float *xd = (const float *)(const void *)(xa + (size_t)nb * (x2 ? 64 : 32));
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = g + (size_t)b * 256, *q2 = g2 + (size_t)b * 256;
        const size_t xo = (size_t)b * 32;
        if (pf) prefetch_lines(pf + (size_t)b * pfs, 5, hint);
        if (pf2) prefetch_lines(pf2 + (size_t)b * pfs, 5, hint);
        __m256i s, s2;
        for (int j = 0; j < 8; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * j));
            const __m256i v2 = _mm256_loadu_si256((const __m256i *)(q2 + 32 * j));
            const __m256i av = _mm256_abs_epi8(v), av2 = _mm256_abs_epi8(v2);
            const __m256i xv = bcast32(xh + xo + 4 * j);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, v)), khi);
            __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(av2, _mm256_sign_epi8(xv, v2)), khi);
            if (x2) {
                const __m256i xlv = bcast32(xl + xo + 4 * j);
                p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xlv, v)), ones));
                p2 = _mm256_add_epi32(p2, _mm256_madd_epi16(_mm256_maddubs_epi16(av2, _mm256_sign_epi8(xlv, v2)), ones));
            }
            s = j ? _mm256_add_epi32(s, p) : p;
            s2 = j ? _mm256_add_epi32(s2, p2) : p2;
            PIN(s);
            PIN(s2);
        }
        const __m256 dx = _mm256_set1_ps(xd[b]);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp + (size_t)b * 16)));
        const __m256 dw2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dp2 + (size_t)b * 16)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dx), acc);
        acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), _mm256_mul_ps(dw2, dx), acc2);
    }
    store8(o, acc, 8);
    store8(o2, acc2, nvalid2);
}

static void q80_g2(tile_args *A) { tile_q8_g2(0, A); }
static void q80x2_g2(tile_args *A) { tile_q8_g2(1, A); }

/* the matmul of one type (a constant: each caller below is its own specialization) */
AI void matmul_i8(const int type, BL_MM_ARGS) {
    const int x2 = w->act == BL_ACT_Q8X2;
    const tile_fn *fns = type == BL_Q4_0   ? (x2 ? q40x2_tiles : q40_tiles)
                         : type == BL_Q4_1 ? (x2 ? q41x2_tiles : q41_tiles)
                                           : (x2 ? q80x2_tiles : q80_tiles);
    const tile_fn two = type == BL_Q4_0   ? (x2 ? q40x2_g2 : q40_g2)
                        : type == BL_Q4_1 ? (x2 ? q41x2_g2 : q41_g2)
                                          : (x2 ? q80x2_g2 : q80_g2);
    /* tokens per tile: 8 for Q4 (~7% faster than 4 here), 4 for Q8_0 (its int32 sums need more registers),
     * 3 with Q8X2 activations (two sums per token: 3 was ~30% faster than 4, which spills, and level with 2) */
    const int ntmax = x2 ? 3 : type == BL_Q8_0 ? 4 : 8;
    run_tiles(fns, ntmax, two, BL_PF_BLOCKS, w, xq, T, NULL, out, ldo, r0, r1, NULL);
}

void bl_mm_q4_0_avx2(BL_MM_ARGS) { matmul_i8(BL_Q4_0, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_1_avx2(BL_MM_ARGS) { matmul_i8(BL_Q4_1, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q8_0_avx2(BL_MM_ARGS) { matmul_i8(BL_Q8_0, w, xq, T, out, ldo, r0, r1); }

/* ---- MXFP4 (quant_internal.h) ----
 * The interleaved layout of Q4 with E8M0 bytes for scales. The nibbles go through a byte shuffle (the 16
 * values kv + 12, unsigned bytes <= 24) into Q4's maddubs; the block's integer is dot(kv + 12, q) - 12 * sq[b],
 * the scalar path's dot(kv, q). A lane's int16 pair sums hold two vectors (at most 2 * 4 * 24 * 128 = 24576, where
 * Q4's <= 15 hold all four), so each pair of vectors goes to int32 through one madd. */

/* the values kv + 12 of vector v's low nibbles (elements 4j..) and its high ones (16 + 4j..) */
AI void fp4_vals(const uint8_t *v, const __m256i kv, const __m256i m4, __m256i *lo, __m256i *hi) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)v);
    *lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(q, m4));
    *hi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(q, 4), m4));
}

/* the int16 sums of one activation plane's block x over vectors 2jj and 2jj + 1 (their values in w[0..3]) */
AI __m256i fp4_pair(const __m256i *w, const int8_t *x, const int jj) {
    const int8_t *a = x + 8 * jj;
    return _mm256_add_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(w[0], bcast32(a)), _mm256_maddubs_epi16(w[1], bcast32(a + 16))),
        _mm256_add_epi16(_mm256_maddubs_epi16(w[2], bcast32(a + 4)), _mm256_maddubs_epi16(w[3], bcast32(a + 20))));
}

#define FP4_CONSTS                                                                                       \
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                                \
    const __m256i kv = _mm256_setr_epi8(BL_MXFP4_KV12, BL_MXFP4_KV12);                                   \
    const __m256i khi = x2 ? _mm256_set1_epi16(254) : ones /* the weight of the (hi) plane */

AI void tile_fp4(const int x2, const int NT, const tile_args *A) {
    TILE_VARS(A);
    FP4_CONSTS;
    const uint8_t *ep = g + (size_t)nb * 128;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = block_at(g, b, 128, pf, pfs, 3, hint);
        const size_t xo = (size_t)b * 32;
        for (int jj = 0; jj < 2; jj++) {
            __m256i wv[4];
            fp4_vals(q + 64 * jj, kv, m4, &wv[0], &wv[1]);
            fp4_vals(q + 64 * jj + 32, kv, m4, &wv[2], &wv[3]);
#define FP4_DOT(t)                                                                                       \
    __m256i p##t = _mm256_madd_epi16(fp4_pair(wv, xq##t + xo, jj), khi);                                 \
    if (x2) p##t = _mm256_add_epi32(p##t, _mm256_madd_epi16(fp4_pair(wv, xl##t + xo, jj), ones));       \
    s##t = jj ? _mm256_add_epi32(s##t, p##t) : p##t;                                                     \
    PIN(s##t)
            FOR_T(FP4_DOT);
        }
        const __m256 dw = e8m0x8(ep + (size_t)b * 8);
#define FP4_SCALE(t)                                                                                     \
    acc##t = _mm256_fmadd_ps(                                                                            \
        _mm256_cvtepi32_ps(_mm256_sub_epi32(s##t, _mm256_set1_epi32(BL_MXFP4_OFFSET * xsq##t[b]))),      \
        _mm256_mul_ps(dw, _mm256_set1_ps(xd##t[b])), acc##t)
        FOR_T(FP4_SCALE);
    }
    FOR_T(Q8_STORE);
}

/* Decode over two groups of 8 rows from two streams (as tile_q4_g2); the same float work per output as tile_fp4 */
AI void tile_fp4_g2(const int x2, const tile_args *A) {
    const uint8_t *g = A[0].g, *g2 = A[1].g, *xa = A->xa, *pf = A[0].pf, *pf2 = A[1].pf;
    const int nb = A->nu, nvalid2 = A[1].nvalid;
    const size_t pfs = A->pfs;
    const int hint = A->hint;
    float *o = A[0].o, *o2 = A[1].o;
    FP4_CONSTS;
    const uint8_t *ep = g + (size_t)nb * 128, *ep2 = g2 + (size_t)nb * 128;
    const int8_t *xh = (const int8_t *)xa, *xl = xh + (size_t)nb * 32;
    const float *xd = (const float *)(const void *)(xa + (size_t)nb * (x2 ? 64 : 32));
    const int32_t *xsq = (const int32_t *)(const void *)(xd + 2 * nb);
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = g + (size_t)b * 128, *q2 = g2 + (size_t)b * 128;
        const size_t xo = (size_t)b * 32;
        if (pf) prefetch_lines(pf + (size_t)b * pfs, 3, hint);
        if (pf2) prefetch_lines(pf2 + (size_t)b * pfs, 3, hint);
        __m256i s, s2;
        for (int jj = 0; jj < 2; jj++) {
            __m256i wv[4], wv2[4];
            fp4_vals(q + 64 * jj, kv, m4, &wv[0], &wv[1]);
            fp4_vals(q + 64 * jj + 32, kv, m4, &wv[2], &wv[3]);
            fp4_vals(q2 + 64 * jj, kv, m4, &wv2[0], &wv2[1]);
            fp4_vals(q2 + 64 * jj + 32, kv, m4, &wv2[2], &wv2[3]);
            __m256i p = _mm256_madd_epi16(fp4_pair(wv, xh + xo, jj), khi);
            __m256i p2 = _mm256_madd_epi16(fp4_pair(wv2, xh + xo, jj), khi);
            if (x2) {
                p = _mm256_add_epi32(p, _mm256_madd_epi16(fp4_pair(wv, xl + xo, jj), ones));
                p2 = _mm256_add_epi32(p2, _mm256_madd_epi16(fp4_pair(wv2, xl + xo, jj), ones));
            }
            s = jj ? _mm256_add_epi32(s, p) : p;
            s2 = jj ? _mm256_add_epi32(s2, p2) : p2;
            PIN(s);
            PIN(s2);
        }
        const __m256i off = _mm256_set1_epi32(BL_MXFP4_OFFSET * xsq[b]);
        const __m256 dx = _mm256_set1_ps(xd[b]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s, off)), _mm256_mul_ps(e8m0x8(ep + (size_t)b * 8), dx),
                              acc);
        acc2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s2, off)),
                               _mm256_mul_ps(e8m0x8(ep2 + (size_t)b * 8), dx), acc2);
    }
    store8(o, acc, 8);
    store8(o2, acc2, nvalid2);
}

AI void fp4(const int NT, const tile_args *A) { tile_fp4(0, NT, A); }
AI void fp4x2(const int NT, const tile_args *A) { tile_fp4(1, NT, A); }
TILES(fp4, UPTO4)
TILES(fp4x2, UPTO3)
static void fp4_g2(tile_args *A) { tile_fp4_g2(0, A); }
static void fp4x2_g2(tile_args *A) { tile_fp4_g2(1, A); }

/* Either layout: GGUF rows are interleaved 8 at a time into the thread's scratch first (run_tiles' pack) */
void bl_mm_mxfp4_avx2(BL_MM_ARGS) {
    const int x2 = w->act == BL_ACT_Q8X2;
    uint8_t *pack = NULL;
    if (w->layout == BL_LAYOUT_ROWS && !(pack = bl_thread_scratch(bl_i8_group_bytes(w->type, w->cols)))) {
        bl_mm_mxfp4_scalar(w, xq, T, out, ldo, r0, r1); /* out of memory: the same bits, slowly */
        return;
    }
    /* tokens per tile: 4 (3 with Q8X2), as Q8_0: each token holds an int32 sum besides its accumulator */
    run_tiles(x2 ? fp4x2_tiles : fp4_tiles, x2 ? 3 : 4, x2 ? fp4x2_g2 : fp4_g2, BL_PF_MXFP4, w, xq, T, NULL, out, ldo,
              r0, r1, pack);
}
