/* The amx tier's prefill matmuls, one source for both builds: amx/quant.c includes it for the tile instructions,
 * amx/quant_emulated.c with BL_AMX_EMULATED for their plain-C emulation (amx/tile.h). Every quantized type of
 * the interleaved layout (Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q3_K, Q4_K, Q5_K, Q6_K), both activation precisions.
 *
 * Exactness: quant_internal.h and quant_kq.h fix the float work of one output (t, r): a float fma per
 * activation block of 32 (each block has its own activation scale) over that block's exact integer dot, then
 * the K-quants' unit scales. A tile dot product over one block is that exact integer (int32, no saturation), so
 * the kernels take tiles one block deep (32 bytes; Q6_K and Q3_K, whose halves of 16 have scales of their own,
 * 16 deep) and then do the scalar path's float operations in its order: the results are scalar's bits, for
 * every T and row split. A tile 64 deep would sum two blocks that carry different activation scales; holding
 * them apart is what keeps the bits, at half the tile unit's peak a dot product.
 *
 * Shape of a call. Rows go in panels of 32 (four interleaved groups, two B tiles of 16 columns). A panel's values
 * are unpacked once, from the stored layout into the tile unit's (for one block, 8 tile rows of 64 bytes: row k
 * holds values 4k..4k+3 of all 16 rows, four bytes a row), together with its scales, into the thread's scratch
 * (a panel of a row of 8,960 values: 280 KB of values, in L2 beside the activations), and serves every token of
 * the call. Tokens go 32 at a time (two A tiles of 16; with BL_ACT_Q8X2, 16 at a time, its two planes in the two
 * A tiles), read by the tile loads straight from the activation rows. Each block takes four dot products into
 * four C tiles (2 token tiles x 2 column tiles), stored to a 4 KB buffer that the float work then reads.
 * A call's token tail configures shorter A and C tiles; a panel's row tail unpacks zeros.
 *
 * Calls of fewer than bl_amx_min_tokens tokens (decode, short verifications) take the tier below's kernel,
 * which reads the same bytes (tier.h: bl_kernels_below_amx). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_kq.h"
#include "tier.h"
#include "amx/amx.h"
#include "amx/tile.h"

#ifndef AMX_NAME
#error "define AMX_NAME(t) before including amx/matmul.h"
#endif

#include "amx/lanes.h"
#include "amx/unpack.h"

/* The tiles (plain numbers: the instructions encode them): dots of token tile i and column tile j in Cij,
 * token tiles in A0, A1 (with BL_ACT_Q8X2: the hi and lo planes of one), column tiles in B0, B1 */
#define T_C00 0
#define T_C01 1
#define T_C10 2
#define T_C11 3
#define T_A0 4
#define T_A1 5
#define T_B0 6
#define T_B1 7

/* A type's shape as the tiles see it */
typedef struct {
    int unit_blocks; /* activation blocks a unit (K-quants: 8) */
    int halves;      /* 2: two separate dots of 16 a block (Q6_K, Q3_K) */
    int b_signed;    /* values stored as int8 (else uint8) */
    int offset;      /* Q4_0 8, Q5_0 16: the values' offset, taken off through the activations' sums */
} amx_shape;

static amx_shape shape_of(int type) {
    switch (type) {
    case BL_Q8_0: case BL_MXFP4: return (amx_shape){1, 1, 1, 0};
    case BL_Q4_0: return (amx_shape){1, 1, 0, 8};
    case BL_Q4_1: return (amx_shape){1, 1, 0, 0};
    case BL_Q5_0: return (amx_shape){1, 1, 0, 16};
    case BL_Q4_K: case BL_Q5_K: return (amx_shape){8, 1, 0, 0};
    default: return (amx_shape){8, 2, 1, 0}; /* Q6_K, Q3_K */
    }
}

/* The float accumulators of a token tile (32 tokens x a panel's 32 rows, [t * PANEL + r]) */
typedef struct {
    float *acc, *accm, *pu, *mu;
} amx_sums;

/* A batch: the blocks whose dot tiles are stored together (32 KB) before their float work, so that each output's
 * sums stay in registers across them: 8 blocks (a K-quant unit), 4 for the types of two dots a block */
enum { BATCH = 8, HALVES_BATCH = 4 };
/* int32s from one block's (or half's) four stored dot tiles to the next: 4 KB and a line, so that the float work,
 * which reads one row of each block's tiles, does not find them all in one L1 set */
enum { HALF_INTS = 4 * 256 + 16 };
/* tokens whose float work goes together, sharing the loads of the weights' scales: Q6_K and Q3_K (two integer
 * multiplies a block) gained from 4 (the tile ops made no-ops on Zen 4: 0.80 of avx512's kernel time where one
 * token at a time took 0.95); Q4_K did best one at a time (0.67-0.70, 0.76-0.79 with 4) */
#define TOKENS_AT_ONCE(fam) ((fam) == FAM_Q36K ? 4 : 1)

/* the float work's families */
enum { FAM_LEGACY, FAM_Q41, FAM_Q45K, FAM_Q36K };

#define AI LANES_AI

/* batch_sums for NT tokens from t0 and column tile c */
AI void batch_sums_tokens(const int fam, const int NT, const amx_shape *S, const int x2, const int32_t *C,
                          const bl_act_q8 *X, int t0, int b0, int nbk, int c, const amx_panel *P, const amx_sums *A) {
    const int u = b0 / 8, unit_start = b0 % 8 == 0, unit_end = (b0 + nbk) % 8 == 0;
    v16f acc[NT], accm[NT], pu[NT], mu[NT];
    int32_t row[NT]; /* the token's row in its C tile pair: (token tile, row) as an offset */
    for (int i = 0; i < NT; i++) {
        const int t = t0 + i, tt = x2 ? 0 : t / 16, m = x2 ? t : t % 16;
        const size_t o = (size_t)t * PANEL + 16 * c;
        row[i] = ((2 * tt + c) * 16 + m) * 16;
        acc[i] = vf_load(A->acc + o), accm[i] = pu[i] = mu[i] = vf_zero();
        if (fam == FAM_Q41 || fam == FAM_Q45K) accm[i] = vf_load(A->accm + o);
        if (!unit_start && (fam == FAM_Q45K || fam == FAM_Q36K)) pu[i] = vf_load(A->pu + o);
        if (!unit_start && fam == FAM_Q45K) mu[i] = vf_load(A->mu + o);
    }
    for (int jb = 0; jb < nbk; jb++) {
        const int b = b0 + jb;
        const int32_t *Cb = C + (size_t)jb * S->halves * HALF_INTS;
        const size_t pb = (size_t)b * PANEL + 16 * c;
        if (fam == FAM_LEGACY || fam == FAM_Q41) {
            const v16f wd = vf_load(P->bf + pb), wm = fam == FAM_Q41 ? vf_load(P->bf2 + pb) : vf_zero();
            for (int i = 0; i < NT; i++) {
                const bl_act_q8 *x = &X[t0 + i];
                v16i dot = vi_load(Cb + row[i]);
                if (x2) dot = vi_add(vi_mullo(dot, vi_set1(254)), vi_load(Cb + row[i] + 512)); /* + the lo tile */
                if (S->offset) dot = vi_sub(dot, vi_set1(S->offset * x->sq[b]));
                acc[i] = vf_fma(vi_to_f(dot), vf_mul(wd, vf_set1(x->d[b])), acc[i]);
                if (fam == FAM_Q41) accm[i] = vf_fma(wm, vf_set1(x->s[b]), accm[i]);
            }
        } else if (fam == FAM_Q45K) {
            const v16f sc = vf_load(P->bf2 + pb), m = vf_load(P->bf + pb);
            for (int i = 0; i < NT; i++) {
                const bl_act_q8 *x = &X[t0 + i];
                pu[i] = vf_fma(vf_mul(vi_to_f(vi_load(Cb + row[i])), sc), vf_set1(x->d[b]), pu[i]);
                mu[i] = vf_fma(m, vf_set1(x->s[b]), mu[i]);
            }
        } else {
            const v16i sa = vi_load(P->bi + pb), sb = vi_load(P->bi2 + pb);
            for (int i = 0; i < NT; i++) {
                const v16i isum = vi_add(vi_mullo(sa, vi_load(Cb + row[i])), vi_mullo(sb, vi_load(Cb + HALF_INTS + row[i])));
                pu[i] = vf_fma(vi_to_f(isum), vf_set1(X[t0 + i].d[b]), pu[i]);
            }
        }
    }
    const v16f ud = unit_end && fam >= FAM_Q45K ? vf_load(P->ud + (size_t)u * PANEL + 16 * c) : vf_zero();
    const v16f um = unit_end && fam == FAM_Q45K ? vf_load(P->um + (size_t)u * PANEL + 16 * c) : vf_zero();
    for (int i = 0; i < NT; i++) {
        const size_t o = (size_t)(t0 + i) * PANEL + 16 * c;
        if (unit_end && fam >= FAM_Q45K) acc[i] = vf_fma(pu[i], ud, acc[i]);
        if (unit_end && fam == FAM_Q45K) accm[i] = vf_fma(mu[i], um, accm[i]);
        vf_store(A->acc + o, acc[i]);
        if (fam == FAM_Q41 || fam == FAM_Q45K) vf_store(A->accm + o, accm[i]);
        if (!unit_end && (fam == FAM_Q45K || fam == FAM_Q36K)) vf_store(A->pu + o, pu[i]);
        if (!unit_end && fam == FAM_Q45K) vf_store(A->mu + o, mu[i]);
    }
}

/* The float work of blocks [b0, b0 + nbk) for the tile's nt tokens: quant_internal.h's and quant_kq.h's, in their
 * order, each output's sums in registers across the batch (several tokens at a time where sharing the loads of
 * the weights' scales paid). C: the batch's stored dot tiles, [block][half][tile][16][16]; x2: C's token tiles hold one token
 * tile's hi and lo planes. A batch that starts a K-quant unit starts its sums at zero, one that ends it applies
 * the unit's scales. Q4_K and Q5_K multiply the dot by the scale in float: their product is below 2^23
 * (quant_kq.h's bounds), so (float)dot * (float)sc is exact and equals scalar's (float)(sc * dot); Q6_K's and
 * Q3_K's block integer can pass 2^24 and is formed in int32 first, as scalar's. */
AI void batch_sums(const int fam, const amx_shape *S, const int x2, const int32_t *C, const bl_act_q8 *X, int nt,
                   int b0, int nbk, int ncol, const amx_panel *P, const amx_sums *A) {
    for (int c = 0; c < ncol; c++) {
        int t = 0;
        for (; t + TOKENS_AT_ONCE(fam) <= nt; t += TOKENS_AT_ONCE(fam))
            batch_sums_tokens(fam, TOKENS_AT_ONCE(fam), S, x2, C, X, t, b0, nbk, c, P, A);
        for (; t < nt; t++) batch_sums_tokens(fam, 1, S, x2, C, X, t, b0, nbk, c, P, A);
    }
}

static void batch_float_work(int type, const amx_shape *S, int x2, const int32_t *C, const bl_act_q8 *X, int nt,
                             int b0, int nbk, int ncol, const amx_panel *P, const amx_sums *A) {
    switch (type) {
    case BL_Q4_1:
        if (x2) batch_sums(FAM_Q41, S, 1, C, X, nt, b0, nbk, ncol, P, A);
        else batch_sums(FAM_Q41, S, 0, C, X, nt, b0, nbk, ncol, P, A);
        break;
    case BL_Q4_K: case BL_Q5_K: batch_sums(FAM_Q45K, S, 0, C, X, nt, b0, nbk, ncol, P, A); break;
    case BL_Q6_K: case BL_Q3_K: batch_sums(FAM_Q36K, S, 0, C, X, nt, b0, nbk, ncol, P, A); break;
    default:
        if (x2) batch_sums(FAM_LEGACY, S, 1, C, X, nt, b0, nbk, ncol, P, A);
        else batch_sums(FAM_LEGACY, S, 0, C, X, nt, b0, nbk, ncol, P, A);
        break;
    }
}

static void configure(bl_tile_config *cfg, int m0, int m1, int depth) {
    memset(cfg, 0, sizeof *cfg);
    bl_tile_shape(cfg, T_C00, m0, 64);
    bl_tile_shape(cfg, T_C01, m0, 64);
    bl_tile_shape(cfg, T_C10, m1 ? m1 : 1, 64);
    bl_tile_shape(cfg, T_C11, m1 ? m1 : 1, 64);
    bl_tile_shape(cfg, T_A0, m0, depth);
    bl_tile_shape(cfg, T_A1, m1 ? m1 : 1, depth);
    bl_tile_shape(cfg, T_B0, depth / 4, 64);
    bl_tile_shape(cfg, T_B1, depth / 4, 64);
    BL_TILE_CONFIG(cfg);
}

/* The dot tiles of block b, half h: [h][tile][16][16] in C */
static void block_dots(const amx_shape *S, const uint8_t *a0, const uint8_t *a1, size_t as, const uint8_t *vals,
                       int ncol, int32_t *C) {
    for (int h = 0; h < S->halves; h++) {
        const int off = 16 * h;
        int32_t *Ch = C + (size_t)h * HALF_INTS;
        BL_TILE_ZERO(T_C00);
        BL_TILE_ZERO(T_C01);
        BL_TILE_ZERO(T_C10);
        BL_TILE_ZERO(T_C11);
        BL_TILE_LOAD(T_A0, a0 + off, as);
        if (a1) BL_TILE_LOAD(T_A1, a1 + off, as);
        BL_TILE_LOAD(T_B0, vals + 256 * h, 64);
        if (ncol > 1) BL_TILE_LOAD(T_B1, vals + 512 + 256 * h, 64);
        if (S->b_signed) {
            BL_TILE_DPBSSD(T_C00, T_A0, T_B0);
            if (ncol > 1) BL_TILE_DPBSSD(T_C01, T_A0, T_B1);
            if (a1) BL_TILE_DPBSSD(T_C10, T_A1, T_B0);
            if (a1 && ncol > 1) BL_TILE_DPBSSD(T_C11, T_A1, T_B1);
        } else {
            BL_TILE_DPBSUD(T_C00, T_A0, T_B0);
            if (ncol > 1) BL_TILE_DPBSUD(T_C01, T_A0, T_B1);
            if (a1) BL_TILE_DPBSUD(T_C10, T_A1, T_B0);
            if (a1 && ncol > 1) BL_TILE_DPBSUD(T_C11, T_A1, T_B1);
        }
        BL_TILE_STORE(T_C00, Ch, 64);
        if (ncol > 1) BL_TILE_STORE(T_C01, Ch + 256, 64);
        if (a1) BL_TILE_STORE(T_C10, Ch + 512, 64);
        if (a1 && ncol > 1) BL_TILE_STORE(T_C11, Ch + 768, 64);
    }
}

static void AMX_NAME(tiles)(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const int type = w->type, cols = w->cols, nb = cols / BL_QK, x2 = w->act == BL_ACT_Q8X2;
    const amx_shape S = shape_of(type);
    const int nu = nb / S.unit_blocks, tok = x2 ? 16 : 32, depth = S.halves == 2 ? 16 : 32;
    const size_t xb = bl_act_row_bytes(w, cols);
    /* scratch: values, 4 block-scale and 2 unit-scale arrays, 4 accumulator arrays, the dot tiles */
    const size_t vals_b = (size_t)nb * BLOCK_VALS, bs_b = (size_t)nb * PANEL * 4, us_b = (size_t)nu * PANEL * 4;
    const size_t sums_b = (size_t)32 * PANEL * 4, dots_b = (size_t)BATCH * HALF_INTS * 4;
    uint8_t *s = bl_thread_scratch(vals_b + 4 * bs_b + 2 * us_b + 4 * sums_b + dots_b);
    if (!s) {
        bl_kernels_below_amx.matmul[type][w->layout](w, xq, T, out, ldo, r0, r1);
        return;
    }
    amx_panel P = {s, (float *)(s + vals_b), (float *)(s + vals_b + bs_b),
                   (float *)(s + vals_b + 4 * bs_b), (float *)(s + vals_b + 4 * bs_b + us_b),
                   (int32_t *)(s + vals_b + 2 * bs_b), (int32_t *)(s + vals_b + 3 * bs_b)};
    float *sums = (float *)(s + vals_b + 4 * bs_b + 2 * us_b);
    const amx_sums A = {sums, sums + 32 * PANEL, sums + 2 * 32 * PANEL, sums + 3 * 32 * PANEL};
    int32_t *C = (int32_t *)(sums + 4 * 32 * PANEL);
    bl_tile_config cfg;
    int cfg_m0 = -1, cfg_m1 = -1;
    bl_act_q8 X[32];
    for (int p0 = r0; p0 < r1; p0 += PANEL) {
        const int nr = r1 - p0 < PANEL ? r1 - p0 : PANEL, ncol = nr > 16 ? 2 : 1;
        unpack_panel(w, p0, nr, nu, nb, &P);
        for (int t0 = 0; t0 < T; t0 += tok) {
            const int nt = T - t0 < tok ? T - t0 : tok;
            const int m0 = nt < 16 ? nt : 16, m1 = x2 ? m0 : nt - m0;
            if (m0 != cfg_m0 || m1 != cfg_m1) configure(&cfg, m0, m1, depth), cfg_m0 = m0, cfg_m1 = m1;
            for (int t = 0; t < nt; t++) X[t] = bl_act_view((const uint8_t *)xq + (size_t)(t0 + t) * xb, cols, w->act);
            memset(sums, 0, 4 * sums_b);
            const uint8_t *a0 = (const uint8_t *)xq + (size_t)t0 * xb;
            const uint8_t *a1 = x2 ? (const uint8_t *)X[0].lo : m1 ? a0 + 16 * xb : NULL;
            const int batch = S.halves == 2 ? HALVES_BATCH : BATCH;
            for (int b0 = 0; b0 < nb; b0 += batch) {
                const int nbk = nb - b0 < batch ? nb - b0 : batch;
                for (int jb = 0; jb < nbk; jb++) {
                    const size_t b = (size_t)(b0 + jb);
                    block_dots(&S, a0 + b * BL_QK, a1 ? a1 + b * BL_QK : NULL, xb, P.vals + b * BLOCK_VALS, ncol,
                               C + (size_t)jb * S.halves * HALF_INTS);
                }
                batch_float_work(type, &S, x2, C, X, nt, b0, nbk, ncol, &P, &A);
            }
            for (int t = 0; t < nt; t++) {
                float *o = out + (size_t)(t0 + t) * ldo + p0;
                const float *acc = A.acc + (size_t)t * PANEL, *accm = A.accm + (size_t)t * PANEL;
                for (int r = 0; r < nr; r++)
                    o[r] = type == BL_Q4_1 ? acc[r] + accm[r] : S.unit_blocks > 1 && S.halves == 1 ? acc[r] - accm[r]
                                                                                                   : acc[r];
            }
        }
    }
    BL_TILE_RELEASE();
}

#define AMX_ENTRY(t)                                                                                        \
    void AMX_NAME(t)(BL_MM_ARGS) {                                                                          \
        if (T < bl_amx_min_tokens) {                                                                        \
            bl_kernels_below_amx.matmul[w->type][w->layout](w, xq, T, out, ldo, r0, r1);                    \
            return;                                                                                         \
        }                                                                                                   \
        AMX_NAME(tiles)(w, xq, T, out, ldo, r0, r1);                                                        \
    }
AMX_ENTRY(q4_0)
AMX_ENTRY(q4_1)
AMX_ENTRY(q5_0)
AMX_ENTRY(q8_0)
AMX_ENTRY(q3_k)
AMX_ENTRY(q4_k)
AMX_ENTRY(q5_k)
AMX_ENTRY(q6_k)
AMX_ENTRY(mxfp4)
#undef AMX_ENTRY
