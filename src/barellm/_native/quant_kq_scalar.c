/* Portable reference kernels for Q5_0, Q4_K and Q6_K: plain C doing exactly the float work described in
 * quant_kq.h, from GGUF-form units read out of either layout, so the SIMD paths can be checked against
 * them bit for bit. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_kq.h"

static float dot_q5_0(const bl_matrix *w, int r, const bl_act_q8 a) {
    const int nb = w->cols / BL_QK;
    uint8_t blk[22];
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        kq_load_unit(w, r, b, blk);
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

static float dot_q4_k(const bl_matrix *w, int r, const bl_act_q8 a) {
    const int nu = w->cols / BL_QK_K;
    uint8_t blk[144], sc[8], m[8];
    float acc = 0.0f, accm = 0.0f;
    for (int u = 0; u < nu; u++) {
        kq_load_unit(w, r, u, blk);
        const float d = bl_f16_to_f32(bl_rd16(blk)), dmin = bl_f16_to_f32(bl_rd16(blk + 2));
        kq_q4k_scales(blk + 4, sc, m);
        float pu = 0.0f, mu = 0.0f;
        for (int j = 0; j < 8; j++) {
            const int b = 8 * u + j;
            const uint8_t *q = blk + 16 + 32 * (j / 2);
            const int8_t *qx = a.qs + b * BL_QK;
            int32_t dot = 0;
            for (int e = 0; e < 32; e++) dot += (j & 1 ? q[e] >> 4 : q[e] & 15) * qx[e];
            pu = fmaf((float)(sc[j] * dot), a.d[b], pu);
            mu = fmaf((float)m[j], a.s[b], mu);
        }
        acc = fmaf(pu, d, acc);
        accm = fmaf(mu, dmin, accm);
    }
    return acc - accm;
}

static float dot_q6_k(const bl_matrix *w, int r, const bl_act_q8 a) {
    const int nu = w->cols / BL_QK_K;
    uint8_t blk[210];
    float acc = 0.0f;
    for (int u = 0; u < nu; u++) {
        kq_load_unit(w, r, u, blk);
        const float d = bl_f16_to_f32(bl_rd16(blk + 208));
        float pu = 0.0f;
        const int8_t *sc = (const int8_t *)(blk + 192);
        for (int kb = 0; kb < 8; kb++) {
            const int b = 8 * u + kb, h = kb / 4, k = kb % 4;
            const int8_t *qx = a.qs + b * BL_QK;
            int32_t half[2] = {0, 0};
            for (int l = 0; l < 32; l++) {
                const uint8_t qb = blk[64 * h + 32 * (k & 1) + l];
                const int q = (k < 2 ? qb & 15 : qb >> 4) | ((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4;
                half[l / 16] += (q - 32) * qx[l];
            }
            const int32_t isum = sc[2 * kb] * half[0] + sc[2 * kb + 1] * half[1];
            pu = fmaf((float)isum, a.d[b], pu);
        }
        acc = fmaf(pu, d, acc);
    }
    return acc;
}

void bl_matmul_kq_scalar(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const size_t xb = bl_act_row_bytes(w, w->cols);
    float (*dot)(const bl_matrix *, int, bl_act_q8) =
        w->type == BL_Q5_0 ? dot_q5_0 : w->type == BL_Q4_K ? dot_q4_k : dot_q6_k;
    for (int r = r0; r < r1; r++)
        for (int t = 0; t < T; t++)
            out[(size_t)t * ldo + r] = dot(w, r, bl_act_q8_view((const uint8_t *)xq + (size_t)t * xb, w->cols));
}
