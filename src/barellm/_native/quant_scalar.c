/* Portable reference kernels (and the fallback path): plain C doing exactly the float work described in
 * quant_internal.h, so the SIMD paths can be checked against them bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"

/* ---- activations ---- */

static float block_amax(const float *xb) {
    float amax = 0.0f;
    for (int i = 0; i < BL_QK; i++) {
        const float a = fabsf(xb[i]);
        amax = a > amax ? a : amax;
    }
    return amax;
}

static void quantize_row_q8(const float *x, int cols, void *row) {
    const int nb = cols / BL_QK;
    uint8_t *p = (uint8_t *)row;
    int8_t *qs = (int8_t *)p;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * BL_QK;
        const float amax = block_amax(xb);
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < BL_QK; i++) {
            long q = lrintf(xb[i] * id); /* round half to even, as the SIMD conversion does */
            q = q > 127 ? 127 : q < -128 ? -128 : q;
            qs[b * BL_QK + i] = (int8_t)q;
            sum += (int32_t)q;
        }
        const float s = d * (float)sum;
        memcpy(p + (size_t)nb * 32 + (size_t)b * 4, &d, 4);
        memcpy(p + (size_t)nb * 36 + (size_t)b * 4, &s, 4);
        memcpy(p + (size_t)nb * 40 + (size_t)b * 4, &sum, 4);
    }
}

static void quantize_row_q8x2(const float *x, int cols, void *row) {
    const int nb = cols / BL_QK;
    uint8_t *p = (uint8_t *)row;
    int8_t *hi = (int8_t *)p, *lo = hi + (size_t)nb * 32;
    for (int b = 0; b < nb; b++) {
        const float *xb = x + b * BL_QK;
        const float amax = block_amax(xb);
        const float d = amax / (float)BL_Q8X2_MAX, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < BL_QK; i++) {
            long q = lrintf(xb[i] * id);
            q = q > BL_Q8X2_MAX ? BL_Q8X2_MAX : q < -BL_Q8X2_MAX ? -BL_Q8X2_MAX : q;
            const long h = lrintf((float)q / 254.0f); /* q / 254 is exact to the half, so this rounds q / 254 */
            hi[b * BL_QK + i] = (int8_t)h;
            lo[b * BL_QK + i] = (int8_t)(q - 254 * h);
            sum += (int32_t)q;
        }
        const float s = d * (float)sum;
        memcpy(p + (size_t)nb * 64 + (size_t)b * 4, &d, 4);
        memcpy(p + (size_t)nb * 68 + (size_t)b * 4, &s, 4);
        memcpy(p + (size_t)nb * 72 + (size_t)b * 4, &sum, 4);
    }
}

void bl_quantize_act_scalar(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out) {
    const int cols = w->cols;
    const size_t ob = bl_act_row_bytes(w, cols);
    for (int t = 0; t < T; t++) {
        uint8_t *o = (uint8_t *)out + (size_t)t * ob;
        if (bl_is_quant(w->type) && w->act == BL_ACT_Q8X2) quantize_row_q8x2(x + (size_t)t * x_stride, cols, o);
        else if (bl_is_quant(w->type)) quantize_row_q8(x + (size_t)t * x_stride, cols, o);
        else memcpy(o, x + (size_t)t * x_stride, (size_t)cols * 4);
    }
}

/* ---- quantized weights ---- */

typedef struct {
    uint8_t q[32];  /* GGUF order: Q8_0 int8[32]; Q4 16 bytes of nibbles */
    float d, m;
} wblock;

static void load_block(const bl_matrix *w, int r, int b, wblock *o) {
    const int type = w->type, nb = w->cols / BL_QK;
    const size_t nq = type == BL_Q8_0 ? 32 : 16;
    const uint8_t *base = (const uint8_t *)w->data;
    uint16_t dh, mh = 0;
    if (w->layout == BL_LAYOUT_ROWS) {
        const size_t rb = bl_row_bytes(type, w->cols);
        const uint8_t *blk = base + (size_t)r * rb + (size_t)b * (rb / nb);
        dh = bl_rd16(blk);
        if (type == BL_Q4_1) mh = bl_rd16(blk + 2);
        memcpy(o->q, blk + (type == BL_Q4_1 ? 4 : 2), nq);
    } else { /* BL_LAYOUT_INTERLEAVE8 */
        const size_t qb = bl_i8_qs_block(type), l = (size_t)(r % 8);
        const uint8_t *g = base + (size_t)(r / 8) * bl_i8_group_bytes(type, w->cols);
        for (size_t i = 0; i < nq; i++) o->q[i] = g[(size_t)b * qb + (i / 4) * 32 + l * 4 + i % 4];
        dh = bl_rd16(g + nb * qb + ((size_t)b * 8 + l) * 2);
        if (type == BL_Q4_1) mh = bl_rd16(g + nb * (qb + 16) + ((size_t)b * 8 + l) * 2);
    }
    o->d = bl_f16_to_f32(dh);
    o->m = bl_f16_to_f32(mh);
}

static float dot_quant(const bl_matrix *w, int r, const void *xrow) {
    const int type = w->type, nb = w->cols / BL_QK;
    const bl_act_q8 a = bl_act_view(xrow, w->cols, w->act);
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++) {
        wblock wb;
        load_block(w, r, b, &wb);
        int32_t qx[32]; /* the block's activation integers (Q8X2: 254 * hi + lo) */
        for (int i = 0; i < 32; i++)
            qx[i] = a.lo ? 254 * a.qs[b * BL_QK + i] + a.lo[b * BL_QK + i] : a.qs[b * BL_QK + i];
        int32_t isum = 0;
        if (type == BL_Q8_0) {
            for (int i = 0; i < 32; i++) isum += (int32_t)(int8_t)wb.q[i] * qx[i];
        } else {
            for (int i = 0; i < 16; i++) isum += (wb.q[i] & 15) * qx[i] + (wb.q[i] >> 4) * qx[i + 16];
            if (type == BL_Q4_0) isum -= 8 * a.sq[b];
        }
        const float scale = wb.d * a.d[b];
        acc = fmaf((float)isum, scale, acc);
        if (type == BL_Q4_1) accm = fmaf(wb.m, a.s[b], accm);
    }
    return type == BL_Q4_1 ? acc + accm : acc;
}

/* ---- float weights ---- */

static float dot_float(const bl_matrix *w, int r, const float *x) {
    const int cols = w->cols;
    float p[8] = {0};
    const int kpad = (cols + 7) / 8 * 8;
    for (int k = 0; k < kpad; k++) {
        float wk = 0.0f, xk = 0.0f;
        if (k < cols) {
            xk = x[k];
            if (w->type == BL_F32) memcpy(&wk, (const uint8_t *)w->data + ((size_t)r * cols + k) * 4, 4);
            else wk = bl_f16_to_f32(bl_rd16((const uint8_t *)w->data + ((size_t)r * cols + k) * 2));
        }
        p[k % 8] = fmaf(wk, xk, p[k % 8]);
    }
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

void bl_matmul_scalar(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const size_t xb = bl_act_row_bytes(w, w->cols);
    const int q = bl_is_quant(w->type);
    for (int r = r0; r < r1; r++) {
        for (int t = 0; t < T; t++) {
            const void *xrow = (const uint8_t *)xq + (size_t)t * xb;
            out[(size_t)t * ldo + r] = q ? dot_quant(w, r, xrow) : dot_float(w, r, (const float *)xrow);
        }
    }
}
