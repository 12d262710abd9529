/* GGUF's block formats (quant_internal.h): one dequantizer per type for the types that are not K-quants,
 * and the interleaved layout of Q4_0, Q4_1 and Q8_0. The traits table (quant.c) points here.
 *
 * Each dequantizer computes every value with the float32 operations of ggml's dequantize_row_* in the same
 * order (barellm.quant decodes the same way, and the tests hold the two to the same bits). */
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"

void bl_dequant_f32(const uint8_t *src, float *out, int n) { memcpy(out, src, (size_t)n * 4); }

void bl_dequant_f16(const uint8_t *src, float *out, int n) {
    for (int i = 0; i < n; i++) out[i] = bl_f16_to_f32(bl_rd16(src + 2 * i));
}

void bl_dequant_bf16(const uint8_t *src, float *out, int n) {
    for (int i = 0; i < n; i++) {
        const uint32_t bits = (uint32_t)bl_rd16(src + 2 * i) << 16;
        memcpy(out + i, &bits, 4);
    }
}

void bl_dequant_q4_0(const uint8_t *b, float *y, int n) {
    for (int i = 0; i < n / BL_QK; i++, b += 18, y += BL_QK) {
        const float d = bl_f16_to_f32(bl_rd16(b));
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((b[2 + j] & 15) - 8) * d;
            y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
        }
    }
}

void bl_dequant_q4_1(const uint8_t *b, float *y, int n) {
    for (int i = 0; i < n / BL_QK; i++, b += 20, y += BL_QK) {
        const float d = bl_f16_to_f32(bl_rd16(b)), m = bl_f16_to_f32(bl_rd16(b + 2));
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(b[4 + j] & 15) * d + m;
            y[j + 16] = (float)(b[4 + j] >> 4) * d + m;
        }
    }
}

/* Q5_0 and Q5_1: nibbles as Q4, the fifth bit of value j in bit j of the little-endian u32 qh */
static void dequant_q5(const uint8_t *b, float *y, int n, int has_min) {
    const int bb = has_min ? 24 : 22;
    for (int i = 0; i < n / BL_QK; i++, b += bb, y += BL_QK) {
        const float d = bl_f16_to_f32(bl_rd16(b)), m = has_min ? bl_f16_to_f32(bl_rd16(b + 2)) : 0.0f;
        const uint8_t *qhp = b + (has_min ? 4 : 2), *qs = qhp + 4;
        const uint32_t qh = (uint32_t)bl_rd32(qhp);
        for (int j = 0; j < 16; j++) {
            const int x0 = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
            const int x1 = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
            if (has_min) {
                y[j] = (float)x0 * d + m;
                y[j + 16] = (float)x1 * d + m;
            } else {
                y[j] = (float)(x0 - 16) * d;
                y[j + 16] = (float)(x1 - 16) * d;
            }
        }
    }
}

void bl_dequant_q5_0(const uint8_t *b, float *y, int n) { dequant_q5(b, y, n, 0); }
void bl_dequant_q5_1(const uint8_t *b, float *y, int n) { dequant_q5(b, y, n, 1); }

void bl_dequant_q8_0(const uint8_t *b, float *y, int n) {
    for (int i = 0; i < n / BL_QK; i++, b += 34, y += BL_QK) {
        const float d = bl_f16_to_f32(bl_rd16(b));
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
    }
}

void bl_dequant_mxfp4(const uint8_t *b, float *y, int n) {
    for (int i = 0; i < n / BL_QK; i++, b += 17, y += BL_QK) {
        const float d = bl_e8m0_half(b[0]);
        for (int j = 0; j < 16; j++) {
            y[j] = (float)bl_mxfp4_kv[b[1 + j] & 15] * d;
            y[j + 16] = (float)bl_mxfp4_kv[b[1 + j] >> 4] * d;
        }
    }
}

/* ---- BL_LAYOUT_INTERLEAVE8 of Q4_0, Q4_1, Q8_0, MXFP4 (quant_internal.h) ----
 * A GGUF block is hdr bytes of scale (f16 d, MXFP4's E8M0 byte) and min (Q4_1's f16) then nq quant bytes; a
 * group holds the nb blocks' quants of 8 rows (qb = 8 * nq bytes each), then the nb x 8 scales, then (Q4_1)
 * the nb x 8 mins. */

typedef struct {
    size_t bb, hdr, nq, ds; /* block bytes, bytes ahead of the quants, quant bytes, bytes of the scale */
} i8_format;

static const i8_format I8_Q4_0 = {18, 2, 16, 2}, I8_Q4_1 = {20, 4, 16, 2}, I8_Q8_0 = {34, 2, 32, 2},
                       I8_MXFP4 = {17, 1, 16, 1};

static void pack8(const i8_format f, int cols, const uint8_t *const rows[8], uint8_t *g) {
    const size_t nb = (size_t)cols / BL_QK, qb = 8 * f.nq;
    memset(g, 0, bl_round_up(8 * nb * f.bb, 64)); /* padding rows: d = m = 0, q = 0 */
    for (size_t l = 0; l < 8; l++) {
        if (!rows[l]) continue;
        for (size_t b = 0; b < nb; b++) {
            const uint8_t *blk = rows[l] + b * f.bb;
            for (size_t i = 0; i < f.nq; i++) g[b * qb + (i / 4) * 32 + l * 4 + i % 4] = blk[f.hdr + i];
            memcpy(g + nb * qb + (b * 8 + l) * f.ds, blk, f.ds);
            if (f.hdr == 4) memcpy(g + nb * (qb + 16) + (b * 8 + l) * 2, blk + 2, 2);
        }
    }
}

static void unpack8(const i8_format f, const uint8_t *g, int cols, int l, int b, uint8_t *blk) {
    const size_t nb = (size_t)cols / BL_QK, qb = 8 * f.nq;
    for (size_t i = 0; i < f.nq; i++) blk[f.hdr + i] = g[(size_t)b * qb + (i / 4) * 32 + (size_t)l * 4 + i % 4];
    memcpy(blk, g + nb * qb + ((size_t)b * 8 + (size_t)l) * f.ds, f.ds);
    if (f.hdr == 4) memcpy(blk + 2, g + nb * (qb + 16) + ((size_t)b * 8 + (size_t)l) * 2, 2);
}

#define I8_FNS(t, F)                                                                                     \
    void bl_pack8_##t(int cols, const uint8_t *const rows[8], uint8_t *g) { pack8(F, cols, rows, g); }    \
    void bl_unpack8_##t(const uint8_t *g, int cols, int l, int b, uint8_t *blk) { unpack8(F, g, cols, l, b, blk); }
I8_FNS(q4_0, I8_Q4_0)
I8_FNS(q4_1, I8_Q4_1)
I8_FNS(q8_0, I8_Q8_0)
I8_FNS(mxfp4, I8_MXFP4)
