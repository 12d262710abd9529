/* AVX-512 VNNI prefill kernels for Q4_0, Q4_1, Q8_0 and MXFP4 on the interleaved layout (SmolLM2's Q4_1 and
 * Q8_0 weights, gpt-oss's experts), for both activation types. They read the avx2 tier's layout (quant_internal.h) and do its float
 * work in its order, so their bits are the scalar path's; calls of fewer than PREFILL_MIN_T tokens (decode,
 * whose speed is the memory's) keep the avx2 tiles.
 *
 * As in avx512/quant_kq.c, a call's rows go 16 at a time (two groups of 8): each group pair is first unpacked
 * into a scratch that stays in cache (one 64-byte vector of u8 holding 4 consecutive values of all 16 rows, the
 * scales as floats), then the call's tokens run over it 8 at a time with vpdpbusd (u8 weights x s8 activation
 * broadcast): 64 multiply-adds an instruction where avx2 spends maddubs + add + madd on 32, and each loaded
 * weight vector serves 8 tokens (avx2's Q8X2 tiles hold 3).
 *
 * Exactness: every block's integer is the one avx2 forms before its conversion to float.
 *   Q4     the nibbles are u8 already; Q4_0's -8 offset is -8 * sq[b], as avx2 subtracts it.
 *   MXFP4  the nibbles through vpshufb into kv + 12 (u8 <= 24), then as Q4_0 with -12 * sq[b], as avx2 does.
 *   Q8_0   vpdpbusd wants an unsigned operand and AVX-512BW has no vpsignb, so the scratch holds w + 128 and the
 *          block's integer starts at -128 * sq[b] (sq = sum q = 254 * sum hi + sum lo): |dot| <= 32 * 255 * 127,
 *          254 times that < 2^31, so nothing wraps.
 *   Q8X2   the hi and lo planes' dots stay apart through a block and meet as 254 * hi + lo in int32.
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"
#include "tier.h"
#include "avx512/simd.h"
#include "avx512/decode.h"

#define AI static inline __attribute__((always_inline))
#define PREFILL_MIN_T 8 /* as avx512/quant_kq.c: under it the avx2 tiles run */
#define NT 8            /* tokens a tile runs at once */

/* scratch per block of a pair: 8 vectors of 64 B (vector k: values 4k..4k+3 of the 16 rows) */
#define VALS_BLOCK 512

/* the E8M0 bytes of a block of 8 rows of group A then group B (NULL: zeros) as 16 scales 2^(e - 128)
 * (bl_e8m0_half's bits) */
AI __m512 e8m0x16(const uint8_t *a, const uint8_t *b) {
    uint64_t ea, eb = 0;
    memcpy(&ea, a, 8);
    if (b) memcpy(&eb, b, 8);
    const __m512i x = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)eb, (long long)ea));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(x, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), x);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(x, _mm512_set1_epi32(2)), big, small));
}

/* The pair's scratch: vals [nb][8] (64 B each), then d [nb] (16 f32), then (Q4_1) m [nb] (16 f32). MXFP4's
 * values are kv + 12 (quant_internal.h), its d the E8M0 bytes' scales. */
AI void unpack(const int type, const uint8_t *ga, const uint8_t *gb, const int nb, uint8_t *dst) {
    const __m512i m4 = _mm512_set1_epi8(15), k80 = _mm512_set1_epi8((char)0x80);
    const __m512i kv = _mm512_broadcast_i32x4(_mm_setr_epi8(BL_MXFP4_KV12));
    const size_t qb = type == BL_Q8_0 ? 256 : 128; /* quant bytes of a block of 8 rows */
    float *d = (float *)(void *)(dst + (size_t)nb * VALS_BLOCK), *m = d + (size_t)nb * 16;
    for (int b = 0; b < nb; b++) {
        const uint8_t *qa = ga + (size_t)b * qb, *qbp = gb ? gb + (size_t)b * qb : NULL;
        uint8_t *o = dst + (size_t)b * VALS_BLOCK;
        if (type == BL_Q8_0) {
            for (int j = 0; j < 8; j++)
                _mm512_store_si512((void *)(o + 64 * j),
                                   _mm512_xor_si512(pair32(qa + 32 * j, qbp ? qbp + 32 * j : NULL), k80));
        } else { /* vector j's low nibbles are values 4j.., its high ones 16 + 4j.. */
            for (int j = 0; j < 4; j++) {
                const __m512i v = pair32(qa + 32 * j, qbp ? qbp + 32 * j : NULL);
                __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                if (type == BL_MXFP4) lo = _mm512_shuffle_epi8(kv, lo), hi = _mm512_shuffle_epi8(kv, hi);
                _mm512_store_si512((void *)(o + 64 * j), lo);
                _mm512_store_si512((void *)(o + 64 * (4 + j)), hi);
            }
        }
        if (type == BL_MXFP4) {
            const size_t eof = (size_t)nb * qb + (size_t)b * 8;
            _mm512_store_ps(d + 16 * (size_t)b, e8m0x16(ga + eof, gb ? gb + eof : NULL));
            continue;
        }
        const size_t dof = (size_t)nb * qb + (size_t)b * 16;
        _mm512_store_ps(d + 16 * (size_t)b, f16x16(ga + dof, gb ? gb + dof : NULL));
        if (type == BL_Q4_1) {
            const size_t mof = dof + (size_t)nb * 16;
            _mm512_store_ps(m + 16 * (size_t)b, f16x16(ga + mof, gb ? gb + mof : NULL));
        }
    }
}

typedef void (*unpack_fn)(const uint8_t *ga, const uint8_t *gb, int nb, uint8_t *dst);
static void unpack_q4_0(const uint8_t *ga, const uint8_t *gb, int nb, uint8_t *d) { unpack(BL_Q4_0, ga, gb, nb, d); }
static void unpack_q4_1(const uint8_t *ga, const uint8_t *gb, int nb, uint8_t *d) { unpack(BL_Q4_1, ga, gb, nb, d); }
static void unpack_q8_0(const uint8_t *ga, const uint8_t *gb, int nb, uint8_t *d) { unpack(BL_Q8_0, ga, gb, nb, d); }
static void unpack_mxfp4(const uint8_t *ga, const uint8_t *gb, int nb, uint8_t *d) { unpack(BL_MXFP4, ga, gb, nb, d); }

/* The call's activations laid out again per tile of NT tokens and block, so that a tile reaches every operand
 * from one pointer at fixed offsets: with a pointer per token's row (two with Q8X2) the tile ran out of
 * registers and reloaded them from the stack, and was ~8% slower with Q8X2 here. At (tile * nb + b) *
 * xt_block(x2): the planes' quants [t][hi | lo] (32 B each), then d [t], s [t] (f32) and koff * sq [t] (i32). */
AI size_t xt_block(const int x2) { return (x2 ? 512 : 256) + 3 * 4 * NT; }

static void relay_act(const void *xq, int T, size_t xb, int nb, int x2, int32_t koff, uint8_t *xt) {
    const size_t blk = xt_block(x2), pl = x2 ? 64 : 32, f = x2 ? 512 : 256;
    for (int t = 0; t < T; t++) {
        const bl_act_q8 a = bl_act_view((const uint8_t *)xq + (size_t)t * xb, nb * BL_QK, x2 ? BL_ACT_Q8X2 : BL_ACT_Q8);
        uint8_t *p = xt + (size_t)(t / NT) * nb * blk;
        const size_t ti = (size_t)(t % NT);
        for (int b = 0; b < nb; b++, p += blk) {
            _mm256_storeu_si256((__m256i *)(void *)(p + ti * pl),
                                _mm256_loadu_si256((const __m256i *)(const void *)(a.qs + 32 * (size_t)b)));
            if (x2)
                _mm256_storeu_si256((__m256i *)(void *)(p + ti * pl + 32),
                                    _mm256_loadu_si256((const __m256i *)(const void *)(a.lo + 32 * (size_t)b)));
            const int32_t c = koff * a.sq[b];
            memcpy(p + f + 4 * ti, &a.d[b], 4);
            memcpy(p + f + 4 * NT + 4 * ti, &a.s[b], 4);
            memcpy(p + f + 8 * NT + 4 * ti, &c, 4);
        }
    }
}

typedef struct {
    const uint8_t *s;  /* the unpacked pair */
    int nb;
    const uint8_t *xt; /* the tile's relaid activations */
    float *o;          /* out of the first token, the pair's first row */
    size_t ldo;
    __mmask16 store;   /* the rows of the 16 to store */
    const uint8_t *pf; /* NULL, or the next pair's bytes, to prefetch pfl lines a block */
    int pfl;
} tile_args;

AI float rdf(const uint8_t *p) {
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* n (<= NT) tokens over one unpacked pair; x2: BL_ACT_Q8X2 activations */
AI void tile(const int type, const int x2, const int n, const tile_args *L) {
    const int nb = L->nb;
    const size_t blk = xt_block(x2), pl = x2 ? 64 : 32, f = x2 ? 512 : 256;
    const float *sd = (const float *)(const void *)(L->s + (size_t)nb * VALS_BLOCK), *sm = sd + (size_t)nb * 16;
    __m512 acc[NT];
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) acc[t] = _mm512_setzero_ps();
    /* Q4_0's -8 * sq, MXFP4's -12 * sq (its values stored + 12) and Q8_0's -128 * sq (its weights stored + 128) */
    const int corr = type != BL_Q4_1;
    const uint8_t *p = L->xt;
    for (int b = 0; b < nb; b++, p += blk) {
        const uint8_t *v0 = L->s + (size_t)b * VALS_BLOCK;
        if (L->pf)
            for (int i = 0; i < L->pfl; i++)
                _mm_prefetch((const char *)L->pf + 64 * ((size_t)b * L->pfl + i), _MM_HINT_T0);
        __m512i dh[NT], dl[NT]; /* x2: the hi and lo planes' dots; else dh is the block's integer */
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            const __m512i c = corr ? _mm512_set1_epi32(bl_rd32(p + f + 8 * NT + 4 * t)) : _mm512_setzero_si512();
            if (x2) dh[t] = _mm512_setzero_si512(), dl[t] = c;
            else dh[t] = c;
        }
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            const __m512i v = _mm512_load_si512((const void *)(v0 + 64 * k));
#pragma GCC unroll 8
            for (int t = 0; t < n; t++) {
                dh[t] = _mm512_dpbusd_epi32(dh[t], v, bcast((const int8_t *)p + pl * t + 4 * k));
                if (x2) dl[t] = _mm512_dpbusd_epi32(dl[t], v, bcast((const int8_t *)p + pl * t + 32 + 4 * k));
            }
        }
        const __m512 dw = _mm512_load_ps(sd + 16 * (size_t)b);
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            const __m512i i = x2 ? _mm512_add_epi32(_mm512_mullo_epi32(dh[t], _mm512_set1_epi32(254)), dl[t]) : dh[t];
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dw, _mm512_set1_ps(rdf(p + f + 4 * t))),
                                     acc[t]);
        }
    }
    if (type == BL_Q4_1) { /* the min chain in a pass of its own, as avx2's wider tiles: fewer live registers */
        __m512 accm[NT];
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) accm[t] = _mm512_setzero_ps();
        p = L->xt;
        for (int b = 0; b < nb; b++, p += blk) {
            const __m512 mw = _mm512_load_ps(sm + 16 * (size_t)b);
#pragma GCC unroll 8
            for (int t = 0; t < n; t++)
                accm[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(rdf(p + f + 4 * NT + 4 * t)), accm[t]);
        }
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) acc[t] = _mm512_add_ps(acc[t], accm[t]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < n; t++) _mm512_mask_storeu_ps(L->o + (size_t)t * L->ldo, L->store, acc[t]);
}

typedef void (*tile_fn)(const tile_args *);
#define TILE_FNS(name, type, x2)                                                                         \
    static void name##1(const tile_args *L) { tile(type, x2, 1, L); }                                    \
    static void name##2(const tile_args *L) { tile(type, x2, 2, L); }                                    \
    static void name##3(const tile_args *L) { tile(type, x2, 3, L); }                                    \
    static void name##4(const tile_args *L) { tile(type, x2, 4, L); }                                    \
    static void name##5(const tile_args *L) { tile(type, x2, 5, L); }                                    \
    static void name##6(const tile_args *L) { tile(type, x2, 6, L); }                                    \
    static void name##7(const tile_args *L) { tile(type, x2, 7, L); }                                    \
    static void name##8(const tile_args *L) { tile(type, x2, 8, L); }                                    \
    static const tile_fn name[NT] = {name##1, name##2, name##3, name##4, name##5, name##6, name##7, name##8};
TILE_FNS(T40, BL_Q4_0, 0)
TILE_FNS(T41, BL_Q4_1, 0)
TILE_FNS(T80, BL_Q8_0, 0)
TILE_FNS(T40X2, BL_Q4_0, 1)
TILE_FNS(T41X2, BL_Q4_1, 1)
TILE_FNS(T80X2, BL_Q8_0, 1)
TILE_FNS(TFP4, BL_MXFP4, 0)
TILE_FNS(TFP4X2, BL_MXFP4, 1)

static void matmul(const unpack_fn unpack_pair, const tile_fn *fns, const tile_fn *fns_x2, const bl_matmul_fn fallback,
                   BL_MM_ARGS) {
    const int type = w->type, cols = w->cols, nb = cols / BL_QK, x2 = w->act == BL_ACT_Q8X2;
    if (T < PREFILL_MIN_T || w->layout != BL_LAYOUT_INTERLEAVE8) {
        fallback(w, xq, T, out, ldo, r0, r1);
        return;
    }
    const size_t gb = bl_i8_group_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    const size_t pair = (size_t)nb * (VALS_BLOCK + 2 * 64), tiles = (size_t)(T + NT - 1) / NT;
    uint8_t *s = bl_thread_scratch(pair + tiles * (size_t)nb * xt_block(x2));
    if (!s) { /* out of memory: the tiles, which need none */
        fallback(w, xq, T, out, ldo, r0, r1);
        return;
    }
    uint8_t *xt = s + pair;
    relay_act(xq, T, xb, nb, x2,
              type == BL_Q4_0 ? -8 : type == BL_Q8_0 ? -128 : type == BL_MXFP4 ? -BL_MXFP4_OFFSET : 0, xt);
    const tile_fn *f = x2 ? fns_x2 : fns;
    for (int r = r0; r < r1; r += 16) {
        const uint8_t *ga = (const uint8_t *)w->data + (size_t)(r / 8) * gb;
        const int n = r1 - r < 16 ? r1 - r : 16;
        unpack_pair(ga, n > 8 ? ga + gb : NULL, nb, s);
        /* the next pair streams in while the first token tile runs (from memory, the 49152-row output matrix
         * went from ~136 to ~149 GMAC/s with it) */
        const int nnext = r + 16 < r1 ? (r1 - r - 16 > 8 ? 2 : 1) : 0;
        tile_args L = {s, nb, NULL, NULL, ldo, (__mmask16)((1u << n) - 1), nnext ? ga + 2 * gb : NULL,
                       (int)(((size_t)nnext * gb / 64 + (size_t)nb - 1) / (size_t)nb)};
        for (int t = 0; t < T; t += NT) {
            const int nt = T - t < NT ? T - t : NT;
            if (t) L.pf = NULL;
            L.xt = xt + (size_t)(t / NT) * nb * xt_block(x2);
            L.o = out + (size_t)t * ldo + r;
            f[nt - 1](&L);
        }
    }
}

void bl_mm_q4_0_avx512(BL_MM_ARGS) { matmul(unpack_q4_0, T40, T40X2, bl_mm_q4_0_avx2, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_1_avx512(BL_MM_ARGS) { matmul(unpack_q4_1, T41, T41X2, bl_mm_q4_1_avx2, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q8_0_avx512(BL_MM_ARGS) { matmul(unpack_q8_0, T80, T80X2, bl_mm_q8_0_avx2, w, xq, T, out, ldo, r0, r1); }
/* fewer tokens: avx512/decode_mxfp4.c's VNNI tiles; GGUF rows: the avx2 kernel */
static void mxfp4_below(BL_MM_ARGS) {
    if (w->layout == BL_LAYOUT_INTERLEAVE8) bl_decode_mxfp4_avx512(w, xq, T, out, ldo, r0, r1);
    else bl_mm_mxfp4_avx2(w, xq, T, out, ldo, r0, r1);
}

void bl_mm_mxfp4_avx512(BL_MM_ARGS) { matmul(unpack_mxfp4, TFP4, TFP4X2, mxfp4_below, w, xq, T, out, ldo, r0, r1); }
