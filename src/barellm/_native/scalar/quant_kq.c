/* Portable reference kernels for Q5_0 and the K-quants: plain C doing exactly the float work described in
 * quant_kq.h, from GGUF-form units read out of either layout, so the SIMD paths can be checked against
 * them bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_kq.h"

static float dot_q5_0(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a) {
    const int nb = w->cols / BL_QK;
    uint8_t buf[BL_MAX_BLOCK];
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = bl_load_block(tr, w, r, b, buf);
        const uint32_t qh = (uint32_t)bl_rd32(blk + 2);
        const int8_t *qx = a.qs + b * BL_QK;
        int32_t isum = 0;
        for (int i = 0; i < 16; i++) {
            const int lo = (blk[6 + i] & 15) | (int)((qh >> i) & 1) << 4;
            const int hi = (blk[6 + i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
            isum += lo * qx[i] + hi * qx[i + 16];
        }
        isum -= 16 * a.sq[b];
        const float scale = bl_f16_to_f32(bl_rd16(blk)) * a.d[b];
        acc = fmaf((float)isum, scale, acc);
    }
    return acc;
}

/* Q4_K, and Q5_K (q5: with the fifth bits) */
static float dot_q45_k(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a, const int q5) {
    const int nu = w->cols / BL_QK_K;
    uint8_t buf[BL_MAX_BLOCK], sc[8], m[8];
    float acc = 0.0f, accm = 0.0f;
    for (int u = 0; u < nu; u++) {
        const uint8_t *blk = bl_load_block(tr, w, r, u, buf), *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
        const float d = bl_f16_to_f32(bl_rd16(blk)), dmin = bl_f16_to_f32(bl_rd16(blk + 2));
        kq_q4k_scales(blk + 4, sc, m);
        float pu = 0.0f, mu = 0.0f;
        for (int j = 0; j < 8; j++) {
            const int b = 8 * u + j;
            const uint8_t *q = qs + 32 * (j / 2);
            const int8_t *qx = a.qs + b * BL_QK;
            int32_t dot = 0;
            for (int e = 0; e < 32; e++)
                dot += ((j & 1 ? q[e] >> 4 : q[e] & 15) | (q5 ? ((qh[e] >> j) & 1) << 4 : 0)) * qx[e];
            pu = fmaf((float)(sc[j] * dot), a.d[b], pu);
            mu = fmaf((float)m[j], a.s[b], mu);
        }
        acc = fmaf(pu, d, acc);
        accm = fmaf(mu, dmin, accm);
    }
    return acc - accm;
}

static float dot_q4_k(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a) {
    return dot_q45_k(tr, w, r, a, 0);
}
static float dot_q5_k(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a) {
    return dot_q45_k(tr, w, r, a, 1);
}

/* Q6_K (six) and Q3_K: per block of 32 two halves of 16 values with a scale each */
static float dot_q36_k(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a, const int six) {
    const int nu = w->cols / BL_QK_K;
    uint8_t buf[BL_MAX_BLOCK];
    float acc = 0.0f;
    for (int u = 0; u < nu; u++) {
        const uint8_t *blk = bl_load_block(tr, w, r, u, buf);
        const float d = bl_f16_to_f32(bl_rd16(blk + (six ? 208 : 108)));
        int8_t sc[16];
        kq_q36k_scales(blk, six, sc);
        float pu = 0.0f;
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb;
            const int8_t *qx = a.qs + b * BL_QK;
            int32_t half[2] = {0, 0};
            for (int l = 0; l < 32; l++) half[l / 16] += kq_q36k_value(blk, 32 * kb + l, six) * qx[l];
            const int32_t isum = sc[2 * kb] * half[0] + sc[2 * kb + 1] * half[1];
            pu = fmaf((float)isum, a.d[b], pu);
        }
        acc = fmaf(pu, d, acc);
    }
    return acc;
}

static float dot_q6_k(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a) {
    return dot_q36_k(tr, w, r, a, 1);
}
static float dot_q3_k(const bl_type_traits *tr, const bl_matrix *w, int r, const bl_act_q8 a) {
    return dot_q36_k(tr, w, r, a, 0);
}

typedef float (*dot_fn)(const bl_type_traits *, const bl_matrix *, int, bl_act_q8);

static void matmul(dot_fn dot, const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const bl_type_traits *tr = bl_traits(w->type);
    const size_t xb = bl_act_row_bytes(w, w->cols);
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++)
            out[(size_t)t * ldo + r] = dot(tr, w, r, bl_act_q8_view((const uint8_t *)xq + (size_t)t * xb, w->cols));
}

void bl_mm_q5_0_scalar(BL_MM_ARGS) { matmul(dot_q5_0, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q3_k_scalar(BL_MM_ARGS) { matmul(dot_q3_k, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_k_scalar(BL_MM_ARGS) { matmul(dot_q4_k, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q5_k_scalar(BL_MM_ARGS) { matmul(dot_q5_k, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q6_k_scalar(BL_MM_ARGS) { matmul(dot_q6_k, w, xq, T, out, ldo, r0, r1); }
