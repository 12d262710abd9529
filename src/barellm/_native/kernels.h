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

/* Byte layouts of a weight matrix, one id per layout family; what the bytes of a (type, layout) pair are is
 * the type's business (quant_internal.h, quant_kq.h). */
enum bl_layout {
    BL_LAYOUT_ROWS = 0,          /* GGUF's: rows one after another */
    BL_LAYOUT_INTERLEAVE8 = 1,   /* rows in groups of 8, interleaved for the SIMD loops; each group
                                    round_up(8 * row bytes, 64) bytes, the last padded with zero rows */
    BL_LAYOUT_COUNT
};

/* Activation types of the quantized kernels (layouts in quant_internal.h). */
enum bl_act {
    BL_ACT_Q8 = 0,     /* blocks of 32: int8 q, scale amax / 127 */
    BL_ACT_Q8X2 = 1,   /* blocks of 32: q = 254 * hi + lo (hi, lo int8), scale amax / 32258 */
    BL_ACT_COUNT
};

typedef struct bl_matrix {
    int type;          /* enum bl_type */
    int layout;        /* enum bl_layout */
    int rows, cols;
    const void *data;  /* 64-byte aligned where possible */
    int act;           /* enum bl_act (float weights take f32 activations and need BL_ACT_Q8 here) */
} bl_matrix;

typedef void (*bl_matmul_fn)(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);

/* The type-and-layout traits table: one row per weight type, everything the core knows about it. The rest
 * of the core asks this table (bl_traits) and nothing else about a type. */
typedef struct bl_type_traits {
    const char *name;      /* NULL: a type the core does not know */
    int block_size;        /* values per block (a row is a whole number of blocks) */
    int block_bytes;       /* bytes per block in GGUF rows */
    int acts;              /* activation types the matmul kernels take, bits 1 << enum bl_act; 0: no kernels */
    int int_acts;          /* 1: activations are integer blocks (bl_act_q8); 0: the f32 vector itself */
    int layout;            /* the layout the matmul kernels read fastest (what a model file should store) */
    /* n values (whole blocks) of GGUF blocks to f32: the type's one dequantizer */
    void (*dequant)(const uint8_t *src, float *out, int n);
    /* BL_LAYOUT_INTERLEAVE8: one group from 8 GGUF rows (rows[l] NULL: a zero row), and block b of row l
     * of a group back in GGUF form (block_bytes bytes) */
    void (*pack8)(int cols, const uint8_t *const rows[8], uint8_t *group);
    void (*unpack8)(const uint8_t *group, int cols, int l, int b, uint8_t *block);
} bl_type_traits;

#define BL_TYPE_COUNT 40

/* The row of a type (a ggml type id); NULL for ids outside the table or types the core does not know. */
BL_API const bl_type_traits *bl_traits(int type);

/* Whether the kernels for `type` take activations of type `act`. */
BL_API int bl_act_supported(int type, int act);

/* Row ranges handed to bl_matmul must start at a multiple of this (the layout's row group). */
BL_API int bl_matmul_row_align(const bl_matrix *w);

/* Bytes of one activation vector of length cols converted for w's kernel. */
BL_API size_t bl_act_row_bytes(const bl_matrix *w, int cols);

/* Converts T vectors x[t * x_stride + k] (f32) into the activation type of w; out rows are
 * bl_act_row_bytes(w, cols) apart. */
BL_API void bl_quantize_act(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out);

/* The values of a vector that convert on their own: blocks of this many (every integer type's block). */
#define BL_ACT_BLOCK 32

/* The part of bl_quantize_act's row for one vector x that blocks [b0, b1) of its values make (a float
 * row's last block may be short): threads converting disjoint block ranges write one row together, with
 * the bits the whole-row conversion gives. */
BL_API void bl_quantize_act_blocks(const bl_matrix *w, const float *x, void *out, int b0, int b1);

/* How the calling thread's matmuls prefetch their weights: set by the executor for the threads of an op.
 * With several threads streaming weights at once, prefetches that bypass the outer caches (NTA) kept
 * Qwen2.5-Coder-1.5B's 2-thread decode 3% closer to the memory bandwidth on Zen 3; alone, a thread did
 * 3% better with ordinary (T0) prefetches. Speed only: the results are the same bits either way. */
extern _Thread_local int bl_shared_stream;

/* How the decode tiles prefetch the weights ahead of their compute: into which cache and how many bytes
 * ahead, per kernel family (BL_PF_BLOCKS: the Q4_0, Q4_1 and Q8_0 tiles; BL_PF_KQUANTS: Q5_0 and the
 * K-quants; BL_PF_MXFP4: the MXFP4 tiles; BL_PF_BLOCKS_LONG: the blocks' tiles over long rows) and per
 * bl_shared_stream (a thread streaming alone, or with others). Chosen per CPU family when the core loads
 * (cpu.c, with the figures that chose each rule), or given by BARELLM_PREFETCH. Speed only. */
enum bl_prefetch_hint { BL_PF_NONE, BL_PF_L1, BL_PF_L2, BL_PF_NTA };
enum { BL_PF_BLOCKS, BL_PF_KQUANTS, BL_PF_MXFP4, BL_PF_BLOCKS_LONG, BL_PF_FAMILIES };
typedef struct {
    int hint;   /* enum bl_prefetch_hint */
    int bytes;  /* distance ahead of the tile's loads; 0 with BL_PF_NONE */
} bl_prefetch_rule;
extern bl_prefetch_rule bl_prefetch_rules[BL_PF_FAMILIES][2]; /* [family][shared] */
/* BL_PF_BLOCKS_LONG: the Q4_0/Q4_1/Q8_0 tiles over long rows, groups of 8 rows of at least this many bytes */
#define BL_PF_LONG_GROUP 6144

/* the family whose rule a family's tiles follow over groups of `group` bytes */
static inline int bl_prefetch_family(int family, size_t group) {
    return family == BL_PF_BLOCKS && group >= BL_PF_LONG_GROUP ? BL_PF_BLOCKS_LONG : family;
}

/* The rules in force as text ("kquants l2:8192 nta:16384, blocks l1:4096 l1:4096, long blocks l1:4096 l1:4096,
 * mxfp4 l1:4096 l1:4096"), and why (the CPU family matched, or BARELLM_PREFETCH) */
BL_API const char *bl_prefetch_describe(void);

static inline void bl_prefetch_line(const void *p, int hint) {
    switch (hint) {
    case BL_PF_L1: __builtin_prefetch(p, 0, 3); break;
    case BL_PF_L2: __builtin_prefetch(p, 0, 2); break;
    case BL_PF_NTA: __builtin_prefetch(p, 0, 0); break;
    default: break;
    }
}

/* out[t * ldo + r] = sum_k W[r, k] * x[t, k] for r in [r0, r1), t in [0, T); xq from bl_quantize_act. */
BL_API void bl_matmul(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);

/* Sizes: bytes of one GGUF row of cols values (0 if the type is unknown or cols not a whole number of
 * blocks); rows per group of a layout (a matmul's row ranges start at multiples of it); bytes of one group;
 * bytes of W in `layout` (0 if the type has no such layout). */
BL_API size_t bl_row_bytes(int type, int cols);
BL_API int bl_layout_rows(int layout);
BL_API size_t bl_group_bytes(int type, int layout, int cols);
BL_API size_t bl_matrix_bytes(int type, int layout, int rows, int cols);

/* Repacking: GGUF rows into `layout`, and back (0 on success, -1 if unsupported). Rows move in whole
 * groups, so a range of groups converts on its own. */
BL_API int bl_repack(int type, int layout, int rows, int cols, const void *src, void *dst);
BL_API int bl_unrepack(int type, int layout, int rows, int cols, const void *src, void *dst);

/* Row r of W as f32 (out[cols]), from any layout (embedding lookups in a repacked tied matrix): the type's
 * dequantizer on the row's blocks; 0 on success, -1 if r or the type/layout is out of range. */
BL_API int bl_dequantize_row(const bl_matrix *w, int r, float *out);

#endif
