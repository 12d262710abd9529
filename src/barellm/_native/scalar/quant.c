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

void bl_act_q8_scalar(const float *x, int cols, uint8_t *row, int b0, int b1) {
    const int nb = cols / BL_QK;
    uint8_t *p = (uint8_t *)row;
    int8_t *qs = (int8_t *)p;
    for (int b = b0; b < b1; b++) {
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
        bl_act_put_block(p, nb, 32, b, d, sum);
    }
}

void bl_act_q8x2_scalar(const float *x, int cols, uint8_t *row, int b0, int b1) {
    const int nb = cols / BL_QK;
    uint8_t *p = (uint8_t *)row;
    int8_t *hi = (int8_t *)p, *lo = hi + (size_t)nb * 32;
    for (int b = b0; b < b1; b++) {
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
        bl_act_put_block(p, nb, 64, b, d, sum);
    }
}

/* ---- quantized weights ---- */

/* one block of Q4_0, Q4_1, Q8_0 or MXFP4 from either layout */
typedef struct {
    uint8_t q[32];  /* GGUF order: Q8_0 int8[32]; Q4, MXFP4 16 bytes of nibbles */
    float d, m;
} wblock;

static void load_block(const bl_type_traits *t, const bl_matrix *w, int r, int b, wblock *o) {
    uint8_t buf[BL_MAX_BLOCK];
    const uint8_t *blk = bl_load_block(t, w, r, b, buf);
    const int q41 = w->type == BL_Q4_1, fp4 = w->type == BL_MXFP4;
    memcpy(o->q, blk + (q41 ? 4 : fp4 ? 1 : 2), w->type == BL_Q8_0 ? 32 : 16);
    o->d = fp4 ? bl_e8m0_half(blk[0]) : bl_f16_to_f32(bl_rd16(blk));
    o->m = q41 ? bl_f16_to_f32(bl_rd16(blk + 2)) : 0.0f;
}

static float dot_quant(const bl_type_traits *tr, const bl_matrix *w, int r, const void *xrow) {
    const int type = w->type, nb = w->cols / BL_QK;
    const bl_act_q8 a = bl_act_view(xrow, w->cols, w->act);
    float acc = 0.0f, accm = 0.0f;
    for (int b = 0; b < nb; b++) {
        wblock wb;
        load_block(tr, w, r, b, &wb);
        int32_t qx[32]; /* the block's activation integers (Q8X2: 254 * hi + lo) */
        for (int i = 0; i < 32; i++)
            qx[i] = a.lo ? 254 * a.qs[b * BL_QK + i] + a.lo[b * BL_QK + i] : a.qs[b * BL_QK + i];
        int32_t isum = 0;
        if (type == BL_Q8_0) {
            for (int i = 0; i < 32; i++) isum += (int32_t)(int8_t)wb.q[i] * qx[i];
        } else if (type == BL_MXFP4) {
            for (int i = 0; i < 16; i++) isum += bl_mxfp4_kv[wb.q[i] & 15] * qx[i] + bl_mxfp4_kv[wb.q[i] >> 4] * qx[i + 16];
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

static void matmul(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const bl_type_traits *tr = bl_traits(w->type);
    const size_t xb = bl_act_row_bytes(w, w->cols);
    for (int r = r0; r < r1; r++) {
        for (int t = 0; t < T; t++) {
            const void *xrow = (const uint8_t *)xq + (size_t)t * xb;
            out[(size_t)t * ldo + r] = tr->int_acts ? dot_quant(tr, w, r, xrow) : dot_float(w, r, (const float *)xrow);
        }
    }
}

void bl_mm_f32_scalar(BL_MM_ARGS) { matmul(w, xq, T, out, ldo, r0, r1); }
void bl_mm_f16_scalar(BL_MM_ARGS) { matmul(w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_0_scalar(BL_MM_ARGS) { matmul(w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_1_scalar(BL_MM_ARGS) { matmul(w, xq, T, out, ldo, r0, r1); }
void bl_mm_q8_0_scalar(BL_MM_ARGS) { matmul(w, xq, T, out, ldo, r0, r1); }
void bl_mm_mxfp4_scalar(BL_MM_ARGS) { matmul(w, xq, T, out, ldo, r0, r1); }
