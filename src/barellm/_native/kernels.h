/* Contract of the quantized matmul kernels (quant_*.c) with their callers (executor.c, py_kernels.c).
 *
 * A weight matrix W[rows, cols] is stored in a type (enum bl_type) and a layout:
 *   BL_LAYOUT_ROWS   rows one after another, each row ceil(cols / block) blocks, as GGUF stores them;
 *   other layouts    repacked for the SIMD loops (rows interleaved in groups), made by bl_repack().
 * A matmul computes, for the rows r in [r0, r1) and the T input vectors t in [0, T):
 *     out[t * ldo + r] = sum_k W[r, k] * x[t, k]
 * where x was first converted by bl_quantize_act() into the activation type W's kernel takes
 * (blocks of 8-bit integers for quantized weights, f32 for float weights). w->act picks the precision of
 * the integer blocks: BL_ACT_Q8, one int8 per value, or BL_ACT_Q8X2, two int8 planes that together hold a
 * 16-bit value (~256x finer; twice the integer multiplies), for the types where bl_act_supported() says so.
 *
 * Invariance (what makes greedy output independent of threads and batching): the value computed for
 * one (t, r) depends only on row r of W and vector t of x: not on T, r0, r1, nor on the other rows
 * and vectors. The kernels for one vector and for many must do the same float operations per output.
 */
#ifndef BARELLM_KERNELS_H
#define BARELLM_KERNELS_H

#include "barellm.h"

enum bl_layout {
    BL_LAYOUT_ROWS = 0,
    BL_LAYOUT_INTERLEAVE8 = 1,   /* Q4_0, Q4_1, Q8_0: 8 rows interleaved per group, block by block
                                    (see quant_internal.h); Q5_0, Q4_K, Q6_K likewise (quant_kq.h);
                                    rows padded to a multiple of 8 */
};

/* Activation types of the quantized kernels (layouts in quant_internal.h). */
enum bl_act {
    BL_ACT_Q8 = 0,     /* blocks of 32: int8 q, scale amax / 127 */
    BL_ACT_Q8X2 = 1,   /* blocks of 32: q = 254 * hi + lo (hi, lo int8), scale amax / 32258 */
};

typedef struct bl_matrix {
    int type;          /* enum bl_type */
    int layout;        /* enum bl_layout */
    int rows, cols;
    const void *data;  /* 64-byte aligned where possible */
    int act;           /* enum bl_act (float weights take f32 activations and need BL_ACT_Q8 here) */
} bl_matrix;

/* Whether the kernels for `type` take activations of type `act`. */
BL_API int bl_act_supported(int type, int act);

/* Row ranges handed to bl_matmul must start at a multiple of this (the layout's row group). */
BL_API int bl_matmul_row_align(const bl_matrix *w);

/* Bytes of one activation vector of length cols converted for w's kernel. */
BL_API size_t bl_act_row_bytes(const bl_matrix *w, int cols);

/* Converts T vectors x[t * x_stride + k] (f32) into the activation type of w; out rows are
 * bl_act_row_bytes(w, cols) apart. */
BL_API void bl_quantize_act(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out);

/* out[t * ldo + r] = sum_k W[r, k] * x[t, k] for r in [r0, r1), t in [0, T); xq from bl_quantize_act. */
BL_API void bl_matmul(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);

/* Repacking: bytes needed for W in `layout`, and the copy itself (0 on success, -1 if unsupported). */
BL_API size_t bl_matrix_bytes(int type, int layout, int rows, int cols);
BL_API int bl_repack(int type, int layout, int rows, int cols, const void *src, void *dst);

/* Row r of W as f32 (out[cols]), from any layout (embedding lookups in a repacked tied matrix);
 * 0 on success, -1 if r or the type/layout is out of range. */
BL_API int bl_dequantize_row(const bl_matrix *w, int r, float *out);

#endif
