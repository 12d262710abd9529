/* Private to quant*.c: the byte layouts the kernels share, and the per-ISA entry points.
 *
 * Weight layouts (W[rows, cols], quantized types need cols % 32 == 0; nb = cols / 32 blocks per row):
 *
 *   BL_LAYOUT_ROWS         GGUF's: rows one after another.
 *       Q8_0 block  f16 d, int8 q[32]                      value = q * d
 *       Q4_0 block  f16 d, uint8 qs[16]                    q_i = qs[i] & 15, q_{i+16} = qs[i] >> 4, value = (q - 8) * d
 *       Q4_1 block  f16 d, f16 m, uint8 qs[16]             same nibbles,                      value = q * d + m
 *       F16 / F32   plain values (any cols).
 *
 *   BL_LAYOUT_INTERLEAVE8  (Q4_0, Q4_1, Q8_0) rows in groups of 8 (the last group padded with zero rows);
 *       each group takes bl_i8_group_bytes() = round_up(8 * row_bytes, 64) bytes and holds, in order:
 *         qs region  nb blocks of 8 rows' quants. A block is 4 (Q4) or 8 (Q8_0) vectors of 32 bytes; byte
 *                    4 * l + i of vector j is byte 4 * j + i of row l's GGUF quants in that block
 *                    (so one 32-bit lane of a vector holds 4 consecutive quant bytes of one row);
 *         d region   nb x 8 f16 scales (block b, row l at [8 * b + l]);
 *         m region   (Q4_1 only) nb x 8 f16 mins, the same way.
 *       For Q4, vector j's low nibbles are the elements 4j..4j+3 and its high nibbles 16+4j..16+4j+3.
 *
 * Activations for quantized weights (one vector of cols values, bl_act_q8_bytes(cols) bytes, 64-aligned):
 *   qs  int8 [nb * 32]   q = round_half_even(x * id), d = amax / 127, id = d ? 1 / d : 0
 *   d   f32  [nb]        the block scales d
 *   s   f32  [nb]        d * (float)sum(q)                 (Q4_1's min term)
 *   sq  i32  [nb]        sum(q)                            (Q4_0's -8 offset)
 * Activations of type BL_ACT_Q8X2 (Q4_0, Q4_1, Q8_0; bl_act_q8x2_bytes(cols) bytes, 64-aligned):
 *   hi  int8 [nb * 32]   with q = clamp(round_half_even(x * id), +-32258), d = amax / 32258, id = d ? 1 / d : 0:
 *   lo  int8 [nb * 32]   hi = round_half_even(q / 254) (in float: exact), lo = q - 254 * hi, so |hi|, |lo| <= 127
 *   d   f32  [nb]        the block scales d
 *   s   f32  [nb]        d * (float)sum(q)
 *   sq  i32  [nb]        sum(q)
 *   The kernels form dot(w, q) = 254 * dot(w, hi) + dot(w, lo) with the same int8 instructions as for Q8,
 *   so a value keeps ~15 bits instead of ~8; every integer stays exact and the float work is unchanged
 *   (isum_b below is dot(q_w, q); for Q4 |isum_b| < 2^24, so even its conversion to float is exact).
 * Activations for float weights: the f32 vector itself (padded to 64 bytes).
 *
 * The float work for one output (t, r) is, in this order, in every kernel of every ISA:
 *   quantized:  acc = 0; for b in 0..nb-1: acc = fma((float)isum_b, d_w[b] * d_x[b], acc)
 *               (isum_b the exact integer block dot; Q4_0: dot(q, qx) - 8 * sq[b])
 *               Q4_1 also accm = 0; for b: accm = fma(m_w[b], s[b], accm); and then out = acc + accm
 *   float:      p[l] for l in 0..7: p[l] = fma(w[k], x[k], p[l]) for k = l, l + 8, ... (zero-padded to a
 *               multiple of 8); out = ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))
 * so the scalar and the AVX2 paths agree bit for bit, for any T and any row split.
 *
 * Q5_0, Q4_K and Q6_K (bl_is_kq) take the same activations; their layouts and float work are described in
 * quant_kq.h and their kernels live in quant_kq*.c.
 */
#ifndef BARELLM_QUANT_INTERNAL_H
#define BARELLM_QUANT_INTERNAL_H

#include <string.h>

#include "kernels.h"

#define BL_QK 32 /* elements per block of the quantized types handled here */

static inline size_t bl_round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

#define BL_QK_K 256 /* elements per super-block of the K-quants */

/* the types of quant_kq*.c */
static inline int bl_is_kq(int type) { return type == BL_Q5_0 || type == BL_Q4_K || type == BL_Q6_K; }

/* quantized weights: 8-bit activation blocks (bl_act_q8) */
static inline int bl_is_quant(int type) {
    return type == BL_Q4_0 || type == BL_Q4_1 || type == BL_Q8_0 || bl_is_kq(type);
}

/* elements per block (cols must be a multiple of it); 0 if the type has no kernels */
static inline int bl_block_size(int type) {
    switch (type) {
    case BL_F32: case BL_F16: return 1;
    case BL_Q4_0: case BL_Q4_1: case BL_Q8_0: case BL_Q5_0: return BL_QK;
    case BL_Q4_K: case BL_Q6_K: return BL_QK_K;
    default: return 0;
    }
}

/* bytes of one GGUF row of `cols` values; 0 if the type is not handled or cols does not fit its blocks */
static inline size_t bl_row_bytes(int type, int cols) {
    if (cols <= 0) return 0;
    switch (type) {
    case BL_F32: return (size_t)cols * 4;
    case BL_F16: return (size_t)cols * 2;
    case BL_Q4_0: return cols % BL_QK ? 0 : (size_t)(cols / BL_QK) * 18;
    case BL_Q4_1: return cols % BL_QK ? 0 : (size_t)(cols / BL_QK) * 20;
    case BL_Q8_0: return cols % BL_QK ? 0 : (size_t)(cols / BL_QK) * 34;
    case BL_Q5_0: return cols % BL_QK ? 0 : (size_t)(cols / BL_QK) * 22;
    case BL_Q4_K: return cols % BL_QK_K ? 0 : (size_t)(cols / BL_QK_K) * 144;
    case BL_Q6_K: return cols % BL_QK_K ? 0 : (size_t)(cols / BL_QK_K) * 210;
    default: return 0;
    }
}

static inline size_t bl_i8_group_bytes(int type, int cols) { return bl_round_up(8 * bl_row_bytes(type, cols), 64); }

/* bytes of quants per block of 8 rows in the interleaved layout */
static inline size_t bl_i8_qs_block(int type) { return type == BL_Q8_0 ? 256 : 128; }

static inline size_t bl_act_q8_bytes(int cols) {
    size_t nb = (size_t)cols / BL_QK;
    return bl_round_up(nb * (BL_QK + 12), 64);
}

static inline size_t bl_act_q8x2_bytes(int cols) {
    size_t nb = (size_t)cols / BL_QK;
    return bl_round_up(nb * (2 * BL_QK + 12), 64);
}

/* the largest |q| of a BL_ACT_Q8X2 block: 254 * 127 */
#define BL_Q8X2_MAX 32258

/* A view of one activation vector of either integer type. */
typedef struct bl_act_q8 {
    const int8_t *qs;   /* BL_ACT_Q8: q; BL_ACT_Q8X2: hi */
    const int8_t *lo;   /* BL_ACT_Q8X2: lo; NULL for BL_ACT_Q8 */
    const float *d, *s;
    const int32_t *sq;
} bl_act_q8;

static inline bl_act_q8 bl_act_view(const void *row, int cols, int act) {
    size_t nb = (size_t)cols / BL_QK, q = act == BL_ACT_Q8X2 ? 64 : 32;
    const uint8_t *p = (const uint8_t *)row;
    bl_act_q8 a = {(const int8_t *)p, act == BL_ACT_Q8X2 ? (const int8_t *)(p + nb * 32) : NULL,
                   (const float *)(p + nb * q), (const float *)(p + nb * (q + 4)),
                   (const int32_t *)(p + nb * (q + 8))};
    return a;
}

static inline bl_act_q8 bl_act_q8_view(const void *row, int cols) { return bl_act_view(row, cols, BL_ACT_Q8); }

static inline uint16_t bl_rd16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline int32_t bl_rd32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* IEEE half -> float, exact (subnormals, inf, nan included) */
static inline float bl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do { mant <<= 1; e++; } while (!(mant & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* per-ISA entry points, called by quant.c after it has checked the arguments */
void bl_quantize_act_scalar(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out);
void bl_matmul_scalar(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);
void bl_quantize_act_avx2(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out);
void bl_matmul_avx2(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);
/* quant_kq.c: the bl_is_kq types (matmul dispatches to the ISA itself) */
void bl_matmul_kq(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);
int bl_repack_kq(int type, int rows, int cols, const void *src, void *dst);
int bl_dequantize_row_kq(const bl_matrix *w, int r, float *out);

#endif
