/* Quantized matmul: dispatch to the ISA paths, sizes, repacking, row access.
 * The layouts and the exact float work per output are described in quant_internal.h. */
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"

static int layout_ok(int type, int layout) {
    if (layout == BL_LAYOUT_ROWS) return bl_block_size(type) != 0;
    if (layout == BL_LAYOUT_INTERLEAVE8) return bl_is_quant(type);
    return 0;
}

int bl_matmul_row_align(const bl_matrix *w) { return w->layout == BL_LAYOUT_INTERLEAVE8 ? 8 : 1; }

int bl_act_supported(int type, int act) {
    if (act == BL_ACT_Q8) return bl_block_size(type) != 0;
    if (act == BL_ACT_Q8X2) return type == BL_Q4_0 || type == BL_Q4_1 || type == BL_Q8_0;
    return 0;
}

size_t bl_act_row_bytes(const bl_matrix *w, int cols) {
    if (bl_is_quant(w->type)) return w->act == BL_ACT_Q8X2 ? bl_act_q8x2_bytes(cols) : bl_act_q8_bytes(cols);
    return bl_round_up((size_t)cols * 4, 64);
}

void bl_quantize_act(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out) {
    if (T <= 0) return;
    if (bl_isa() == BL_ISA_AVX2) bl_quantize_act_avx2(w, x, x_stride, T, out);
    else bl_quantize_act_scalar(w, x, x_stride, T, out);
}

void bl_matmul(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    if (T <= 0 || r0 >= r1) return;
    if (bl_is_kq(w->type)) bl_matmul_kq(w, xq, T, out, ldo, r0, r1);
    else if (bl_isa() == BL_ISA_AVX2) bl_matmul_avx2(w, xq, T, out, ldo, r0, r1);
    else bl_matmul_scalar(w, xq, T, out, ldo, r0, r1);
}

size_t bl_matrix_bytes(int type, int layout, int rows, int cols) {
    size_t rb = bl_row_bytes(type, cols);
    if (rows <= 0 || rb == 0 || !layout_ok(type, layout)) return 0;
    if (layout == BL_LAYOUT_ROWS) return (size_t)rows * rb;
    return (size_t)((rows + 7) / 8) * bl_i8_group_bytes(type, cols);
}

int bl_repack(int type, int layout, int rows, int cols, const void *src, void *dst) {
    size_t bytes = bl_matrix_bytes(type, layout, rows, cols);
    if (bytes == 0) return -1;
    if (layout == BL_LAYOUT_ROWS) {
        memcpy(dst, src, bytes);
        return 0;
    }
    if (bl_is_kq(type)) return bl_repack_kq(type, rows, cols, src, dst);
    /* ROWS -> INTERLEAVE8 */
    const uint8_t *s = (const uint8_t *)src;
    uint8_t *d = (uint8_t *)dst;
    memset(d, 0, bytes); /* padding rows: d = m = 0, q = 0 */
    const size_t rb = bl_row_bytes(type, cols), gb = bl_i8_group_bytes(type, cols);
    const size_t nb = (size_t)cols / BL_QK, bb = rb / nb, qb = bl_i8_qs_block(type);
    const size_t nq = type == BL_Q8_0 ? 32 : 16;      /* quant bytes per row block */
    const size_t hdr = type == BL_Q4_1 ? 4 : 2;       /* f16 d (+ f16 m) ahead of the quants */
    for (int r = 0; r < rows; r++) {
        uint8_t *g = d + (size_t)(r / 8) * gb;
        const size_t l = (size_t)(r % 8);
        for (size_t b = 0; b < nb; b++) {
            const uint8_t *blk = s + (size_t)r * rb + b * bb;
            for (size_t i = 0; i < nq; i++) g[b * qb + (i / 4) * 32 + l * 4 + i % 4] = blk[hdr + i];
            memcpy(g + nb * qb + (b * 8 + l) * 2, blk, 2);
            if (type == BL_Q4_1) memcpy(g + nb * (qb + 16) + (b * 8 + l) * 2, blk + 2, 2);
        }
    }
    return 0;
}

int bl_dequantize_row(const bl_matrix *w, int r, float *out) {
    const int cols = w->cols;
    if (r < 0 || r >= w->rows || bl_matrix_bytes(w->type, w->layout, w->rows, cols) == 0) return -1;
    if (bl_is_kq(w->type)) return bl_dequantize_row_kq(w, r, out);
    const uint8_t *base = (const uint8_t *)w->data;
    if (w->type == BL_F32) {
        memcpy(out, base + (size_t)r * cols * 4, (size_t)cols * 4);
        return 0;
    }
    if (w->type == BL_F16) {
        for (int k = 0; k < cols; k++) out[k] = bl_f16_to_f32(bl_rd16(base + ((size_t)r * cols + k) * 2));
        return 0;
    }
    const size_t rb = bl_row_bytes(w->type, cols), nb = (size_t)cols / BL_QK, bb = rb / nb;
    const size_t nq = w->type == BL_Q8_0 ? 32 : 16, qb = bl_i8_qs_block(w->type);
    const size_t gb = bl_i8_group_bytes(w->type, cols), l = (size_t)(r % 8);
    const uint8_t *g = base + (size_t)(r / 8) * gb;
    for (size_t b = 0; b < nb; b++) {
        uint8_t q[32];
        uint16_t dh, mh = 0;
        if (w->layout == BL_LAYOUT_ROWS) {
            const uint8_t *blk = base + (size_t)r * rb + b * bb;
            dh = bl_rd16(blk);
            if (w->type == BL_Q4_1) mh = bl_rd16(blk + 2);
            memcpy(q, blk + (w->type == BL_Q4_1 ? 4 : 2), nq);
        } else {
            for (size_t i = 0; i < nq; i++) q[i] = g[b * qb + (i / 4) * 32 + l * 4 + i % 4];
            dh = bl_rd16(g + nb * qb + (b * 8 + l) * 2);
            if (w->type == BL_Q4_1) mh = bl_rd16(g + nb * (qb + 16) + (b * 8 + l) * 2);
        }
        const float dd = bl_f16_to_f32(dh), m = bl_f16_to_f32(mh);
        float *o = out + b * BL_QK;
        for (int i = 0; i < 16 && w->type != BL_Q8_0; i++) {
            const int lo = q[i] & 15, hi = q[i] >> 4;
            if (w->type == BL_Q4_0) {
                o[i] = (float)(lo - 8) * dd;
                o[i + 16] = (float)(hi - 8) * dd;
            } else {
                o[i] = (float)lo * dd + m;
                o[i + 16] = (float)hi * dd + m;
            }
        }
        for (int i = 0; i < 32 && w->type == BL_Q8_0; i++) o[i] = (float)(int8_t)q[i] * dd;
    }
    return 0;
}
