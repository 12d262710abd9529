/* Private to amx/matmul.h: a panel's weights from the interleaved layout (quant_internal.h, quant_kq.h) into the
 * tile unit's form, one group of 8 rows at a time.
 *
 * The interleaved layout already holds 4 consecutive values of a row in one 32-bit lane of a 32-byte granule
 * vector, 8 rows a vector: the tile unit's B form (a tile row: 4 values of each of 16 columns). So one tile row
 * of a column tile is the granule vectors of its two groups side by side, each turned from the stored packing
 * into plain values with a few byte operations on 32 bytes: loops the compiler vectorizes. The scales are
 * decoded row by row (a few bytes a unit). */
#ifndef BARELLM_AMX_UNPACK_H
#define BARELLM_AMX_UNPACK_H

#include "quant_kq.h"

enum {
    PANEL = 32,        /* rows a panel: two B tiles of 16 columns */
    BLOCK_VALS = 1024, /* bytes of a block's unpacked values in a panel: 2 column tiles x 8 rows x 64 */
};

/* A panel's unpacked weights in the scratch (index [b * PANEL + r] for block b and panel row r, [u * PANEL + r]
 * for unit u):
 *   vals  block b's values at b * BLOCK_VALS: column tile c (rows 16c..16c+15) at + 512 c, tile row k at + 64 k,
 *         panel row 16c + n's values 4k..4k+3 at + 4 n (uint8, or int8 for Q8_0, MXFP4: kv, Q6_K and Q3_K: q - 32,
 *         q - 4)
 *   bf    Q4_0, Q4_1, Q5_0, Q8_0, MXFP4: the block's d; Q4_K, Q5_K: m_j as a float
 *   bf2   Q4_1: the block's m; Q4_K, Q5_K: sc_j as a float
 *   bi    Q6_K, Q3_K: the first half's scale
 *   bi2   Q6_K, Q3_K: the second half's scale
 *   ud, um  the K-quants' unit d and dmin */
typedef struct {
    uint8_t *vals;
    float *bf, *bf2, *ud, *um;
    int32_t *bi, *bi2;
} amx_panel;

/* where group G's 32 bytes of tile row k of block b go */
static inline uint8_t *tile_row(const amx_panel *P, int b, int G, int k) {
    return P->vals + (size_t)b * BLOCK_VALS + 512 * (G / 2) + 64 * k + 32 * (G % 2);
}

/* the 4 * n bytes of row l of a group's n interleaved granule vectors at p (a row's scales) */
static inline void row_bytes(const uint8_t *p, int l, int n, uint8_t *out) {
    for (int s = 0; s < n; s++) memcpy(out + 4 * s, p + 32 * s + 4 * l, 4);
}

static inline float f16_at(const uint8_t *p) { return bl_f16_to_f32(bl_rd16(p)); }

/* Q4_0, Q4_1, Q8_0: group G's nb blocks: the quants' region (nb blocks of vectors), then nb x 8 d, then Q4_1's
 * nb x 8 m */
static void unpack_group_legacy(int type, const uint8_t *g, int G, int nb, const amx_panel *P) {
    const int q8 = type == BL_Q8_0, qb = q8 ? 256 : 128;
    const uint8_t *d = g + (size_t)nb * qb, *m = d + (size_t)nb * 16;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = g + (size_t)b * qb;
        if (q8) {
            for (int k = 0; k < 8; k++) memcpy(tile_row(P, b, G, k), q + 32 * k, 32);
        } else {
            for (int k = 0; k < 4; k++) {
                uint8_t *lo = tile_row(P, b, G, k), *hi = tile_row(P, b, G, k + 4);
                const uint8_t *v = q + 32 * k;
                for (int i = 0; i < 32; i++) lo[i] = v[i] & 15, hi[i] = v[i] >> 4;
            }
        }
        for (int l = 0; l < 8; l++) {
            const size_t r = (size_t)b * PANEL + 8 * G + l;
            P->bf[r] = f16_at(d + (8 * (size_t)b + l) * 2);
            if (type == BL_Q4_1) P->bf2[r] = f16_at(m + (8 * (size_t)b + l) * 2);
        }
    }
}

/* MXFP4: the layout of Q4 with nb x 8 E8M0 bytes for scales; the values as int8 kv (ggml's kvalues_mxfp4) */
static void unpack_group_mxfp4(const uint8_t *g, int G, int nb, const amx_panel *P) {
    const uint8_t *e = g + (size_t)nb * 128;
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = g + (size_t)b * 128;
        for (int k = 0; k < 4; k++) {
            uint8_t *lo = tile_row(P, b, G, k), *hi = tile_row(P, b, G, k + 4);
            const uint8_t *v = q + 32 * k;
            for (int i = 0; i < 32; i++) lo[i] = (uint8_t)bl_mxfp4_kv[v[i] & 15], hi[i] = (uint8_t)bl_mxfp4_kv[v[i] >> 4];
        }
        for (int l = 0; l < 8; l++) P->bf[(size_t)b * PANEL + 8 * G + l] = bl_e8m0_half(e[8 * (size_t)b + l]);
    }
}

/* Q5_0: units of 176 bytes: 5 packed granule vectors, then 8 f16 d */
static void unpack_group_q5_0(const uint8_t *g, int G, int nb, const amx_panel *P) {
    for (int b = 0; b < nb; b++) {
        const uint8_t *q = g + (size_t)b * 176, *top = q + 128;
        for (int j = 0; j < 4; j++) {
            uint8_t *lo = tile_row(P, b, G, j), *hi = tile_row(P, b, G, j + 4);
            const uint8_t *v = q + 32 * j;
            for (int i = 0; i < 32; i++) lo[i] = v[i] & 31, hi[i] = (uint8_t)(v[i] >> 5 | ((top[i] >> 2 * j) & 3) << 3);
        }
        for (int l = 0; l < 8; l++) P->bf[(size_t)b * PANEL + 8 * G + l] = f16_at(q + 160 + 2 * l);
    }
}

/* Q4_K (q5 = 0) and Q5_K: units of 1152 / 1408 bytes (quant_kq.h's KQ_Q4_K, KQ_Q5_K) */
static void unpack_group_q45_k(const int q5, const uint8_t *g, int G, int nu, const amx_panel *P) {
    const kq_fields8 F = q5 ? KQ_Q5_K : KQ_Q4_K;
    for (int u = 0; u < nu; u++) {
        const uint8_t *U = g + (size_t)u * F.unit, *qh = U + F.qh;
        for (int j = 0; j < 8; j++) {
            const int b = 8 * u + j, shift = j & 1 ? 4 : 0;
            for (int k = 0; k < 8; k++) {
                uint8_t *o = tile_row(P, b, G, k);
                const uint8_t *v = U + F.q + 32 * (8 * (j / 2) + k), *h = qh + 32 * k;
                if (q5)
                    for (int i = 0; i < 32; i++) o[i] = (uint8_t)(((v[i] >> shift) & 15) | ((h[i] >> j) & 1) << 4);
                else
                    for (int i = 0; i < 32; i++) o[i] = (v[i] >> shift) & 15;
            }
        }
        for (int l = 0; l < 8; l++) {
            uint8_t s[12], sc[8], m[8];
            row_bytes(U + F.sc, l, 3, s);
            kq_q4k_scales(s, sc, m);
            const size_t r = 8 * (size_t)G + l;
            for (int j = 0; j < 8; j++) {
                P->bf2[(size_t)(8 * u + j) * PANEL + r] = (float)sc[j];
                P->bf[(size_t)(8 * u + j) * PANEL + r] = (float)m[j];
            }
            P->ud[(size_t)u * PANEL + r] = f16_at(U + F.d + 2 * l);
            P->um[(size_t)u * PANEL + r] = f16_at(U + F.d + 16 + 2 * l);
        }
    }
}

/* Q6_K: units of 1680 bytes: granule 6 kb + 3 a + p holds values 32 kb + 16 a + 4 p + i in its low 6 bits and
 * two bits of value 32 kb + 16 a + 12 + i above them (quant_kq.h) */
static void unpack_group_q6_k(const uint8_t *g, int G, int nu, const amx_panel *P) {
    for (int u = 0; u < nu; u++) {
        const uint8_t *U = g + (size_t)u * KQ_Q6_K.unit;
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb;
            for (int a = 0; a < 2; a++) {
                const uint8_t *v0 = U + 32 * (6 * kb + 3 * a), *v1 = v0 + 32, *v2 = v0 + 64;
                uint8_t *o0 = tile_row(P, b, G, 4 * a), *o1 = tile_row(P, b, G, 4 * a + 1);
                uint8_t *o2 = tile_row(P, b, G, 4 * a + 2), *o3 = tile_row(P, b, G, 4 * a + 3);
                for (int i = 0; i < 32; i++) {
                    o0[i] = (uint8_t)((v0[i] & 63) - 32), o1[i] = (uint8_t)((v1[i] & 63) - 32);
                    o2[i] = (uint8_t)((v2[i] & 63) - 32);
                    o3[i] = (uint8_t)((v0[i] >> 6 | (v1[i] >> 6) << 2 | (v2[i] >> 6) << 4) - 32);
                }
            }
        }
        for (int l = 0; l < 8; l++) {
            uint8_t s[16];
            row_bytes(U + KQ_Q6_K.sc, l, 4, s);
            const size_t r = 8 * (size_t)G + l;
            for (int kb = 0; kb < 8; kb++) {
                P->bi[(size_t)(8 * u + kb) * PANEL + r] = (int8_t)s[2 * kb];
                P->bi2[(size_t)(8 * u + kb) * PANEL + r] = (int8_t)s[2 * kb + 1];
            }
            P->ud[(size_t)u * PANEL + r] = f16_at(U + KQ_Q6_K.d + 2 * l);
        }
    }
}

/* Q3_K: units of 880 bytes: qs granule 8 h + k holds the 2-bit fields of values 4k..4k+3 of half h, hmask
 * granule k their high bits (quant_kq.h) */
static void unpack_group_q3_k(const uint8_t *g, int G, int nu, const amx_panel *P) {
    for (int u = 0; u < nu; u++) {
        const uint8_t *U = g + (size_t)u * KQ_Q3_K.unit;
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb, h = kb / 4, f = kb % 4;
            for (int k = 0; k < 8; k++) {
                const uint8_t *q = U + 32 * (8 * h + k), *hm = U + KQ_Q3_K.qh + 32 * k;
                uint8_t *o = tile_row(P, b, G, k);
                for (int i = 0; i < 32; i++)
                    o[i] = (uint8_t)((((q[i] >> 2 * f) & 3) | ((hm[i] >> (4 * h + f)) & 1) << 2) - 4);
            }
        }
        for (int l = 0; l < 8; l++) {
            uint8_t s[12];
            int8_t sc[16];
            row_bytes(U + KQ_Q3_K.sc, l, 3, s);
            kq_q3k_scales(s, sc);
            const size_t r = 8 * (size_t)G + l;
            for (int kb = 0; kb < 8; kb++) {
                P->bi[(size_t)(8 * u + kb) * PANEL + r] = sc[2 * kb];
                P->bi2[(size_t)(8 * u + kb) * PANEL + r] = sc[2 * kb + 1];
            }
            P->ud[(size_t)u * PANEL + r] = f16_at(U + KQ_Q3_K.d + 2 * l);
        }
    }
}

/* The panel of rows [p0, p0 + nr) (p0 a multiple of 8; a group is whole or absent: the layout pads the last) */
static void unpack_panel(const bl_matrix *w, int p0, int nr, int nu, int nb, const amx_panel *P) {
    if (nr < PANEL) { /* the missing rows: zeros, their outputs not stored */
        memset(P->vals, 0, (size_t)nb * BLOCK_VALS);
        memset(P->bf, 0, (size_t)nb * PANEL * 4), memset(P->bf2, 0, (size_t)nb * PANEL * 4);
        memset(P->bi, 0, (size_t)nb * PANEL * 4), memset(P->bi2, 0, (size_t)nb * PANEL * 4);
        memset(P->ud, 0, (size_t)nu * PANEL * 4), memset(P->um, 0, (size_t)nu * PANEL * 4);
    }
    const size_t gb = bl_i8_group_bytes(w->type, w->cols);
    for (int G = 0; 8 * G < nr; G++) {
        const uint8_t *g = (const uint8_t *)w->data + (size_t)(p0 / 8 + G) * gb;
        switch (w->type) {
        case BL_Q4_0: case BL_Q4_1: case BL_Q8_0: unpack_group_legacy(w->type, g, G, nb, P); break;
        case BL_Q5_0: unpack_group_q5_0(g, G, nb, P); break;
        case BL_MXFP4: unpack_group_mxfp4(g, G, nb, P); break;
        case BL_Q4_K: unpack_group_q45_k(0, g, G, nu, P); break;
        case BL_Q5_K: unpack_group_q45_k(1, g, G, nu, P); break;
        case BL_Q6_K: unpack_group_q6_k(g, G, nu, P); break;
        default: unpack_group_q3_k(g, G, nu, P); break;
        }
    }
}

#endif
