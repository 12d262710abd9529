/* Private to quant*.c: the byte layouts the kernels share, and the per-ISA entry points.
 *
 * Weight layouts (W[rows, cols], quantized types need cols % 32 == 0; nb = cols / 32 blocks per row):
 *
 *   BL_LAYOUT_ROWS         GGUF's: rows one after another.
 *       Q8_0 block  f16 d, int8 q[32]                      value = q * d
 *       Q4_0 block  f16 d, uint8 qs[16]                    q_i = qs[i] & 15, q_{i+16} = qs[i] >> 4, value = (q - 8) * d
 *       Q4_1 block  f16 d, f16 m, uint8 qs[16]             same nibbles,                      value = q * d + m
 *       MXFP4 block u8 e (E8M0), uint8 qs[16]              same nibbles,                      value = kv[q] * d,
 *                   kv = ggml's kvalues_mxfp4 {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12} (the E2M1
 *                   values doubled), d = 2^(e - 128) (bl_e8m0_half: exact, a subnormal for e < 2, never inf)
 *       F16 / F32   plain values (any cols).
 *
 *   BL_LAYOUT_INTERLEAVE8  (Q4_0, Q4_1, Q8_0, MXFP4) rows in groups of 8 (the last group padded with zero rows);
 *       each group takes bl_i8_group_bytes() = round_up(8 * row_bytes, 64) bytes and holds, in order:
 *         qs region  nb blocks of 8 rows' quants. A block is 4 (Q4) or 8 (Q8_0) vectors of 32 bytes; byte
 *                    4 * l + i of vector j is byte 4 * j + i of row l's GGUF quants in that block
 *                    (so one 32-bit lane of a vector holds 4 consecutive quant bytes of one row);
 *         d region   nb x 8 f16 scales (block b, row l at [8 * b + l]); MXFP4: nb x 8 E8M0 bytes, the same way;
 *         m region   (Q4_1 only) nb x 8 f16 mins, the same way.
 *       For Q4 and MXFP4, vector j's low nibbles are the elements 4j..4j+3 and its high nibbles 16+4j..16+4j+3.
 *       MXFP4 keeps its scale as the file's byte, so a group is the GGUF rows' 17 bytes per 32 values (as
 *       stored, as read by decode): a float scale would be 20, 18% more to stream; the kernels turn 8 bytes
 *       into 8 floats with an integer shift (bl_e8m0_half's bits), once per block for all the tile's tokens.
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
 *               (isum_b the exact integer block dot; Q4_0: dot(q, qx) - 8 * sq[b]; MXFP4: dot(kv[q], qx), which
 *               the SIMD kernels form as dot(kv[q] + 12, qx) - 12 * sq[b] with unsigned bytes kv[q] + 12 <= 24;
 *               |isum_b| <= 32 * 12 * 32258 < 2^24 with Q8X2, so its conversion to float is exact too)
 *               Q4_1 also accm = 0; for b: accm = fma(m_w[b], s[b], accm); and then out = acc + accm
 *   float:      p[l] for l in 0..7: p[l] = fma(w[k], x[k], p[l]) for k = l, l + 8, ... (zero-padded to a
 *               multiple of 8); out = ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7))
 * so the scalar and the AVX2 paths agree bit for bit, for any T and any row split.
 *
 * Q5_0, Q3_K, Q4_K, Q5_K and Q6_K take the same activations; their layouts and float work are described in
 * quant_kq.h and their kernels live in quant_kq*.c.
 *
 * Which kernel runs for a matrix is the traits table's business (quant.c, kernels.h's bl_type_traits): each
 * type's row names its dequantizer, its packing into BL_LAYOUT_INTERLEAVE8 and back, and its matmul per ISA
 * and layout, declared below; bl_kernels_resolve() picks the ISA's column once.
 */
#ifndef BARELLM_QUANT_INTERNAL_H
#define BARELLM_QUANT_INTERNAL_H

#include <string.h>

#include "kernels.h"

#define BL_QK 32 /* elements per block of the quantized types handled here */
_Static_assert(BL_QK == BL_ACT_BLOCK, "activation rows convert in the blocks kernels.h promises");

static inline size_t bl_round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

#define BL_QK_K 256 /* elements per super-block of the K-quants */

/* the interleaved layout's group of 8 rows */
static inline size_t bl_i8_group_bytes(int type, int cols) { return bl_group_bytes(type, BL_LAYOUT_INTERLEAVE8, cols); }

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

/* Block b's d, s = d * sum and sum into an activation row of nb blocks of qb quant bytes (BL_ACT_Q8 32, BL_ACT_Q8X2
 * 64): every tier's converter ends a block so. */
static inline void bl_act_put_block(uint8_t *row, int nb, size_t qb, int b, float d, int32_t sum) {
    const float s = d * (float)sum;
    memcpy(row + (size_t)nb * qb + (size_t)b * 4, &d, 4);
    memcpy(row + (size_t)nb * (qb + 4) + (size_t)b * 4, &s, 4);
    memcpy(row + (size_t)nb * (qb + 8) + (size_t)b * 4, &sum, 4);
}

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

/* MXFP4's block scale from its E8M0 byte: 2^(e - 128), ggml's GGML_E8M0_TO_FP32_HALF bit for bit (the byte
 * holds 2^(e - 127) and the values kv are the E2M1 values doubled) */
static inline uint32_t bl_e8m0_half_bits(uint8_t e) { return e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23; }
static inline float bl_e8m0_half(uint8_t e) {
    const uint32_t bits = bl_e8m0_half_bits(e);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ggml's kvalues_mxfp4; and those + 12, the unsigned bytes the SIMD kernels multiply (quant_internal.h's sums) */
#define BL_MXFP4_KV 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12
#define BL_MXFP4_KV12 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0
#define BL_MXFP4_OFFSET 12
static const int8_t bl_mxfp4_kv[16] = {BL_MXFP4_KV};

/* Block b of row r of W in GGUF form (the type's block_bytes bytes), from either layout: a pointer into W
 * for rows, else the block unpacked into buf (which must hold the largest block, BL_MAX_BLOCK bytes). */
#define BL_MAX_BLOCK 292
static inline const uint8_t *bl_load_block(const bl_type_traits *t, const bl_matrix *w, int r, int b, uint8_t *buf) {
    if (w->layout == BL_LAYOUT_ROWS)
        return (const uint8_t *)w->data + (size_t)r * bl_row_bytes(w->type, w->cols) + (size_t)b * t->block_bytes;
    t->unpack8((const uint8_t *)w->data + (size_t)(r / 8) * bl_i8_group_bytes(w->type, w->cols), w->cols, r % 8, b,
               buf);
    return buf;
}

/* The scratch the calling thread's kernels unpack weights into, at least bytes long and 64-byte aligned (NULL:
 * out of memory, and the kernel takes a path that needs none). One buffer per thread for every kernel (none
 * calls another while it holds it), kept between calls: prefill's come one chunk after the other; grown when a
 * wider matrix needs more. quant.c. */
uint8_t *bl_thread_scratch(size_t bytes);

/* The tiers' kernels their tables (tier.h) point at (scalar/, avx2/, avx512/). Activation rows: blocks [b0, b1) of one vector of cols values into the integer blocks
 * of its row (the row's own layout, so threads can share one row). Matmuls: as
 * bl_matmul, for the type in the name and the layout(s) the table gives them. */
#define BL_MM_ARGS const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1
/* the quantized types' matmuls of one set of kernels (a tier's, or the amx tier's builds: amx/amx.h) */
#define BL_QUANT_MM_DECLARE(sfx)                                                                         \
    void bl_mm_q4_0_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q4_1_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q8_0_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q5_0_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q3_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q4_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q5_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q6_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_mxfp4_##sfx(BL_MM_ARGS);
#define BL_KERNELS_DECLARE(isa)                                                                          \
    void bl_act_q8_##isa(const float *x, int cols, uint8_t *row, int b0, int b1);                        \
    void bl_act_q8x2_##isa(const float *x, int cols, uint8_t *row, int b0, int b1);                      \
    void bl_mm_f32_##isa(BL_MM_ARGS);                                                                    \
    void bl_mm_f16_##isa(BL_MM_ARGS);                                                                    \
    BL_QUANT_MM_DECLARE(isa)
BL_KERNELS_DECLARE(scalar)
BL_KERNELS_DECLARE(avx2)
/* avx512: the quantized types' (avx512/tier.c) */
BL_QUANT_MM_DECLARE(avx512)
/* AVX2 Q4_0, Q4_1, Q8_0 read GGUF rows with kernels of their own */
void bl_mm_q4_0_rows_avx2(BL_MM_ARGS);
void bl_mm_q4_1_rows_avx2(BL_MM_ARGS);
void bl_mm_q8_0_rows_avx2(BL_MM_ARGS);

/* quant_rows.c: the dequantizers, and Q4_0, Q4_1, Q8_0, MXFP4's interleaved layout */
#define BL_ROWS_DECLARE(t)                                                                               \
    void bl_dequant_##t(const uint8_t *src, float *out, int n);                                         \
    void bl_pack8_##t(int cols, const uint8_t *const rows[8], uint8_t *group);                           \
    void bl_unpack8_##t(const uint8_t *group, int cols, int l, int b, uint8_t *block);
BL_ROWS_DECLARE(q4_0)
BL_ROWS_DECLARE(q4_1)
BL_ROWS_DECLARE(q8_0)
BL_ROWS_DECLARE(mxfp4)
/* quant_kq.c: the other types' interleaved layouts (quant_kq.h) */
BL_ROWS_DECLARE(q5_0)
BL_ROWS_DECLARE(q3_k)
BL_ROWS_DECLARE(q4_k)
BL_ROWS_DECLARE(q5_k)
BL_ROWS_DECLARE(q6_k)
void bl_dequant_f32(const uint8_t *src, float *out, int n);
void bl_dequant_f16(const uint8_t *src, float *out, int n);
void bl_dequant_bf16(const uint8_t *src, float *out, int n);
void bl_dequant_q5_1(const uint8_t *src, float *out, int n);

#endif
