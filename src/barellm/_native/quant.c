/* The type-and-layout traits table (kernels.h's bl_type_traits), and the entry points of kernels.h, which
 * only ever ask the table: sizes, repacking both ways, row access, activation conversion, matmul dispatch.
 * Adding a weight type means adding its row here and its kernels to the tiers' tables (tier.h). */
#include <limits.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"
#include "tier.h"

#define ACT(a) (1 << BL_ACT_##a)
#define I8 BL_LAYOUT_INTERLEAVE8
#define PACK(t) bl_dequant_##t, bl_pack8_##t, bl_unpack8_##t

static const bl_type_traits TRAITS[BL_TYPE_COUNT] = {
    /*            name    block  bytes acts              int  layout          dequant, pack8, unpack8  */
    [BL_F32]  = {"f32",   1,     4,    ACT(Q8),          0,   BL_LAYOUT_ROWS, bl_dequant_f32, NULL, NULL},
    [BL_F16]  = {"f16",   1,     2,    ACT(Q8),          0,   BL_LAYOUT_ROWS, bl_dequant_f16, NULL, NULL},
    [BL_BF16] = {"bf16",  1,     2,    0,                0,   BL_LAYOUT_ROWS, bl_dequant_bf16, NULL, NULL},
    [BL_Q4_0] = {"q4_0",  32,    18,   ACT(Q8) | ACT(Q8X2), 1, I8,           PACK(q4_0)},
    [BL_Q4_1] = {"q4_1",  32,    20,   ACT(Q8) | ACT(Q8X2), 1, I8,           PACK(q4_1)},
    [BL_Q5_0] = {"q5_0",  32,    22,   ACT(Q8),          1,   I8,             PACK(q5_0)},
    [BL_Q5_1] = {"q5_1",  32,    24,   0,                1,   BL_LAYOUT_ROWS, bl_dequant_q5_1, NULL, NULL},
    [BL_Q8_0] = {"q8_0",  32,    34,   ACT(Q8) | ACT(Q8X2), 1, I8,           PACK(q8_0)},
    [BL_Q3_K] = {"q3_k",  256,   110,  ACT(Q8),          1,   I8,             PACK(q3_k)},
    [BL_Q4_K] = {"q4_k",  256,   144,  ACT(Q8),          1,   I8,             PACK(q4_k)},
    [BL_Q5_K] = {"q5_k",  256,   176,  ACT(Q8),          1,   I8,             PACK(q5_k)},
    [BL_Q6_K] = {"q6_k",  256,   210,  ACT(Q8),          1,   I8,             PACK(q6_k)},
    [BL_MXFP4] = {"mxfp4", 32,   17,   ACT(Q8) | ACT(Q8X2), 1, I8,           PACK(mxfp4)},
};

const bl_type_traits *bl_traits(int type) {
    if (type < 0 || type >= BL_TYPE_COUNT || !TRAITS[type].name) return NULL;
    return &TRAITS[type];
}

_Thread_local int bl_shared_stream;

/* ---- sizes ---- */

size_t bl_row_bytes(int type, int cols) {
    const bl_type_traits *t = bl_traits(type);
    if (!t || cols <= 0 || cols % t->block_size) return 0;
    return (size_t)(cols / t->block_size) * (size_t)t->block_bytes;
}

int bl_layout_rows(int layout) { return layout == BL_LAYOUT_INTERLEAVE8 ? 8 : 1; }

static int layout_ok(const bl_type_traits *t, int layout) {
    if (layout == BL_LAYOUT_ROWS) return 1;
    if (layout == BL_LAYOUT_INTERLEAVE8) return t->pack8 != NULL;
    return 0;
}

size_t bl_group_bytes(int type, int layout, int cols) {
    const bl_type_traits *t = bl_traits(type);
    const size_t rb = bl_row_bytes(type, cols);
    if (!t || !rb || !layout_ok(t, layout)) return 0;
    return layout == BL_LAYOUT_ROWS ? rb : bl_round_up(8 * rb, 64);
}

size_t bl_matrix_bytes(int type, int layout, int rows, int cols) {
    const size_t gb = bl_group_bytes(type, layout, cols);
    if (rows <= 0 || !gb) return 0;
    const int g = bl_layout_rows(layout);
    return (size_t)((rows + g - 1) / g) * gb;
}

int bl_matmul_row_align(const bl_matrix *w) { return bl_layout_rows(w->layout); }

int bl_act_supported(int type, int act) {
    const bl_type_traits *t = bl_traits(type);
    return t && act >= 0 && act < BL_ACT_COUNT && (t->acts >> act & 1);
}

/* ---- repacking and row access ---- */

/* What repacking either way does before it looks at groups: -1 for a (type, layout) without them, 0 after
 * copying rows to rows, 1 where the groups are the caller's to move */
static int repack_start(int type, int layout, int rows, int cols, const void *src, void *dst) {
    const size_t bytes = bl_matrix_bytes(type, layout, rows, cols);
    if (bytes == 0) return -1;
    if (layout != BL_LAYOUT_ROWS) return 1;
    memcpy(dst, src, bytes);
    return 0;
}

int bl_repack(int type, int layout, int rows, int cols, const void *src, void *dst) {
    const int start = repack_start(type, layout, rows, cols, src, dst);
    if (start <= 0) return start;
    const bl_type_traits *t = bl_traits(type);
    const size_t rb = bl_row_bytes(type, cols), gb = bl_group_bytes(type, layout, cols);
    for (int r = 0; r < rows; r += 8) {
        const uint8_t *p[8];
        for (int l = 0; l < 8; l++) p[l] = r + l < rows ? (const uint8_t *)src + (size_t)(r + l) * rb : NULL;
        t->pack8(cols, p, (uint8_t *)dst + (size_t)(r / 8) * gb);
    }
    return 0;
}

int bl_unrepack(int type, int layout, int rows, int cols, const void *src, void *dst) {
    const int start = repack_start(type, layout, rows, cols, src, dst);
    if (start <= 0) return start;
    const bl_type_traits *t = bl_traits(type);
    const bl_matrix w = {type, layout, rows, cols, src, BL_ACT_Q8};
    const int nb = cols / t->block_size;
    uint8_t *d = (uint8_t *)dst;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++, d += t->block_bytes) {
            uint8_t buf[BL_MAX_BLOCK];
            memcpy(d, bl_load_block(t, &w, r, b, buf), (size_t)t->block_bytes);
        }
    return 0;
}

int bl_dequantize_row(const bl_matrix *w, int r, float *out) {
    const bl_type_traits *t = bl_traits(w->type);
    if (!t || r < 0 || r >= w->rows || bl_matrix_bytes(w->type, w->layout, w->rows, w->cols) == 0) return -1;
    if (w->layout == BL_LAYOUT_ROWS) {
        t->dequant((const uint8_t *)w->data + (size_t)r * bl_row_bytes(w->type, w->cols), out, w->cols);
        return 0;
    }
    const int nb = w->cols / t->block_size;
    for (int b = 0; b < nb; b++) {
        uint8_t buf[BL_MAX_BLOCK];
        t->dequant(bl_load_block(t, w, r, b, buf), out + (size_t)b * t->block_size, t->block_size);
    }
    return 0;
}

/* ---- activations and matmuls ---- */

static _Thread_local uint8_t *scratch;
static _Thread_local size_t scratch_bytes;

uint8_t *bl_thread_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, bl_round_up(bytes, 64));
        scratch_bytes = scratch ? bl_round_up(bytes, 64) : 0;
    }
    return scratch;
}

size_t bl_act_row_bytes(const bl_matrix *w, int cols) {
    const bl_type_traits *t = bl_traits(w->type);
    if (t && t->int_acts) return w->act == BL_ACT_Q8X2 ? bl_act_q8x2_bytes(cols) : bl_act_q8_bytes(cols);
    return bl_round_up((size_t)cols * 4, 64);
}

void bl_quantize_act(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out) {
    const size_t ob = bl_act_row_bytes(w, w->cols);
    for (int t = 0; t < T; t++)
        bl_quantize_act_blocks(w, x + (size_t)t * x_stride, (uint8_t *)out + (size_t)t * ob, 0, INT_MAX);
}

void bl_quantize_act_blocks(const bl_matrix *w, const float *x, void *out, int b0, int b1) {
    const int cols = w->cols, nblk = (cols + BL_ACT_BLOCK - 1) / BL_ACT_BLOCK;
    if (b1 > nblk) b1 = nblk;
    if (b0 >= b1) return;
    const bl_act_fn f = bl_traits(w->type)->int_acts ? bl_kernels.act[w->act] : NULL;
    if (f) f(x, cols, out, b0, b1);
    else {
        const int i0 = b0 * BL_ACT_BLOCK, i1 = b1 * BL_ACT_BLOCK < cols ? b1 * BL_ACT_BLOCK : cols;
        memcpy((float *)out + i0, x + i0, (size_t)(i1 - i0) * 4);
    }
}

void bl_matmul(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    if (T <= 0 || r0 >= r1) return;
    bl_kernels.matmul[w->type][w->layout](w, xq, T, out, ldo, r0, r1);
}
