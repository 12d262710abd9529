/* The amx tier's prefill matmuls, one source for both builds: amx/quant.c includes it for the tile instructions,
 * amx/quant_emulated.c with BL_AMX_EMULATED for their plain-C emulation (amx/tile.h). Every quantized type of
 * the interleaved layout (Q4_0, Q4_1, Q5_0, Q8_0, Q3_K, Q4_K, Q5_K, Q6_K), both activation precisions.
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

enum {
    PANEL = 32,        /* rows a panel: two B tiles of 16 columns */
    BLOCK_VALS = 1024, /* bytes of a block's unpacked values in a panel: 2 column tiles x 8 rows x 64 */
};

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
    case BL_Q8_0: return (amx_shape){1, 1, 1, 0};
    case BL_Q4_0: return (amx_shape){1, 1, 0, 8};
    case BL_Q4_1: return (amx_shape){1, 1, 0, 0};
    case BL_Q5_0: return (amx_shape){1, 1, 0, 16};
    case BL_Q4_K: case BL_Q5_K: return (amx_shape){8, 1, 0, 0};
    default: return (amx_shape){8, 2, 1, 0}; /* Q6_K, Q3_K */
    }
}

/* A panel's unpacked weights in the scratch (index [b * PANEL + r] for block b and panel row r, [u * PANEL + r]
 * for unit u):
 *   vals  block b's values at b * BLOCK_VALS: column tile c (rows 16c..16c+15) at + 512 c, tile row k at + 64 k,
 *         panel row 16c + n's values 4k..4k+3 at + 4 n
 *   bf    Q4_0, Q4_1, Q5_0, Q8_0: the block's d; Q4_K, Q5_K: m_j as a float
 *   bf2   Q4_1: the block's m
 *   bi    Q4_K, Q5_K: sc_j; Q6_K, Q3_K: the first half's scale
 *   bi2   Q6_K, Q3_K: the second half's scale
 *   ud, um  the K-quants' unit d and dmin */
typedef struct {
    uint8_t *vals;
    float *bf, *bf2, *ud, *um;
    int32_t *bi, *bi2;
} amx_panel;

/* Unit u of one row in GGUF form (blk) into the panel: its values and scales. Row r of the panel. */
static void unpack_unit(int type, const uint8_t *blk, int u, int r, const amx_panel *P) {
    const int c = r / 16, n = r % 16;
#define PUT(b, k, v) (P->vals[(size_t)(b) * BLOCK_VALS + 512 * c + 64 * ((k) / 4) + 4 * n + (k) % 4] = (uint8_t)(v))
    const size_t br = (size_t)u * PANEL + r; /* a one-block unit's scale index */
    switch (type) {
    case BL_Q8_0:
        P->bf[br] = bl_f16_to_f32(bl_rd16(blk));
        for (int k = 0; k < 32; k++) PUT(u, k, blk[2 + k]);
        break;
    case BL_Q4_0:
    case BL_Q4_1: {
        const int q41 = type == BL_Q4_1;
        const uint8_t *qs = blk + (q41 ? 4 : 2);
        P->bf[br] = bl_f16_to_f32(bl_rd16(blk));
        if (q41) P->bf2[br] = bl_f16_to_f32(bl_rd16(blk + 2));
        for (int k = 0; k < 16; k++) PUT(u, k, qs[k] & 15), PUT(u, k + 16, qs[k] >> 4);
        break;
    }
    case BL_Q5_0: {
        const uint32_t qh = (uint32_t)bl_rd32(blk + 2);
        P->bf[br] = bl_f16_to_f32(bl_rd16(blk));
        for (int k = 0; k < 16; k++) {
            PUT(u, k, (blk[6 + k] & 15) | ((qh >> k) & 1) << 4);
            PUT(u, k + 16, (blk[6 + k] >> 4) | ((qh >> (k + 16)) & 1) << 4);
        }
        break;
    }
    case BL_Q4_K:
    case BL_Q5_K: {
        const int q5 = type == BL_Q5_K;
        const uint8_t *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
        uint8_t sc[8], m[8];
        kq_q4k_scales(blk + 4, sc, m);
        P->ud[br] = bl_f16_to_f32(bl_rd16(blk));
        P->um[br] = bl_f16_to_f32(bl_rd16(blk + 2));
        for (int j = 0; j < 8; j++) {
            const int b = 8 * u + j;
            const uint8_t *q = qs + 32 * (j / 2);
            P->bi[(size_t)b * PANEL + r] = sc[j];
            P->bf[(size_t)b * PANEL + r] = (float)m[j];
            for (int k = 0; k < 32; k++)
                PUT(b, k, (j & 1 ? q[k] >> 4 : q[k] & 15) | (q5 ? ((qh[k] >> j) & 1) << 4 : 0));
        }
        break;
    }
    default: { /* Q6_K, Q3_K */
        const int six = type == BL_Q6_K;
        int8_t sc[16];
        kq_q36k_scales(blk, six, sc);
        P->ud[br] = bl_f16_to_f32(bl_rd16(blk + (six ? 208 : 108)));
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb;
            P->bi[(size_t)b * PANEL + r] = sc[2 * kb];
            P->bi2[(size_t)b * PANEL + r] = sc[2 * kb + 1];
            for (int k = 0; k < 32; k++) PUT(b, k, (int8_t)kq_q36k_value(blk, 32 * kb + k, six));
        }
        break;
    }
    }
#undef PUT
}

/* The panel of rows [p0, p0 + nr) */
static void unpack_panel(const bl_matrix *w, int p0, int nr, int nu, int nb, const amx_panel *P) {
    const bl_type_traits *tr = bl_traits(w->type);
    uint8_t buf[BL_MAX_BLOCK];
    if (nr < PANEL) { /* the missing rows: zeros, their outputs not stored */
        memset(P->vals, 0, (size_t)nb * BLOCK_VALS);
        memset(P->bf, 0, (size_t)nb * PANEL * 4), memset(P->bf2, 0, (size_t)nb * PANEL * 4);
        memset(P->bi, 0, (size_t)nb * PANEL * 4), memset(P->bi2, 0, (size_t)nb * PANEL * 4);
        memset(P->ud, 0, (size_t)nu * PANEL * 4), memset(P->um, 0, (size_t)nu * PANEL * 4);
    }
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nu; u++) unpack_unit(w->type, bl_load_block(tr, w, p0 + r, u, buf), u, r, P);
}

/* The float accumulators of a token tile (32 tokens x a panel's 32 rows, [t * PANEL + r]) */
typedef struct {
    float *acc, *accm, *pu, *mu;
} amx_sums;

/* The float work of block b for the tile's tokens: quant_internal.h's and quant_kq.h's, in their order.
 * C: the stored dot tiles [h][tile][16][16]; x2: C's token tiles hold one token tile's hi and lo planes. */
static void block_sums(int type, const amx_shape *S, int x2, const int32_t *C, const bl_act_q8 *X, int nt, int b,
                       int ncol, const amx_panel *P, const amx_sums *A) {
    for (int t = 0; t < nt; t++) {
        const int tt = x2 ? 0 : t / 16, m = x2 ? t : t % 16;
        const float xd = X[t].d[b], xs = X[t].s[b];
        const int32_t osq = S->offset * X[t].sq[b];
        for (int c = 0; c < ncol; c++) {
            const int32_t *c0 = C + ((size_t)(2 * tt + c) * 16 + m) * 16;     /* half 0 (Q8X2: hi) */
            const int32_t *c1 = C + ((size_t)(4 + 2 * tt + c) * 16 + m) * 16; /* half 1 */
            const int32_t *clo = C + ((size_t)(2 + c) * 16 + m) * 16;         /* Q8X2: lo */
            const size_t o = (size_t)t * PANEL + 16 * c, pb = (size_t)b * PANEL + 16 * c;
            float *acc = A->acc + o, *accm = A->accm + o, *pu = A->pu + o, *mu = A->mu + o;
            const float *bf = P->bf + pb, *bf2 = P->bf2 + pb;
            const int32_t *bi = P->bi + pb, *bi2 = P->bi2 + pb;
            switch (type) {
            case BL_Q8_0: case BL_Q4_0: case BL_Q4_1: case BL_Q5_0:
                for (int n = 0; n < 16; n++) {
                    const int32_t dot = x2 ? 254 * c0[n] + clo[n] : c0[n];
                    acc[n] = fmaf((float)(dot - osq), bf[n] * xd, acc[n]);
                }
                if (type == BL_Q4_1)
                    for (int n = 0; n < 16; n++) accm[n] = fmaf(bf2[n], xs, accm[n]);
                break;
            case BL_Q4_K: case BL_Q5_K:
                for (int n = 0; n < 16; n++) {
                    pu[n] = fmaf((float)(bi[n] * c0[n]), xd, pu[n]);
                    mu[n] = fmaf(bf[n], xs, mu[n]);
                }
                break;
            default:
                for (int n = 0; n < 16; n++) pu[n] = fmaf((float)(bi[n] * c0[n] + bi2[n] * c1[n]), xd, pu[n]);
                break;
            }
        }
    }
}

/* The K-quants' unit end: the unit's scales over its partial sums */
static void unit_sums(int type, int nt, int u, const amx_panel *P, const amx_sums *A) {
    const float *ud = P->ud + (size_t)u * PANEL, *um = P->um + (size_t)u * PANEL;
    const int q45 = type == BL_Q4_K || type == BL_Q5_K;
    for (int t = 0; t < nt; t++) {
        float *acc = A->acc + (size_t)t * PANEL, *pu = A->pu + (size_t)t * PANEL;
        float *accm = A->accm + (size_t)t * PANEL, *mu = A->mu + (size_t)t * PANEL;
        for (int r = 0; r < PANEL; r++) acc[r] = fmaf(pu[r], ud[r], acc[r]), pu[r] = 0.0f;
        if (q45)
            for (int r = 0; r < PANEL; r++) accm[r] = fmaf(mu[r], um[r], accm[r]), mu[r] = 0.0f;
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
        int32_t *Ch = C + (size_t)h * 4 * 256;
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
    const size_t sums_b = (size_t)32 * PANEL * 4, dots_b = (size_t)2 * 4 * 256 * 4;
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
            for (int u = 0; u < nu; u++) {
                for (int j = 0; j < S.unit_blocks; j++) {
                    const int b = u * S.unit_blocks + j;
                    block_dots(&S, a0 + (size_t)b * BL_QK, a1 ? a1 + (size_t)b * BL_QK : NULL, xb,
                               P.vals + (size_t)b * BLOCK_VALS, ncol, C);
                    block_sums(type, &S, x2, C, X, nt, b, ncol, &P, &A);
                }
                if (S.unit_blocks > 1) unit_sums(type, nt, u, &P, &A);
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
#undef AMX_ENTRY
