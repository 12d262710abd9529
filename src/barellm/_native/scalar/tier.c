/* The scalar tier's table: every entry, in portable C. */
#include "quant_internal.h"
#include "tier.h"

#define I8 BL_LAYOUT_INTERLEAVE8
#define ROWS BL_LAYOUT_ROWS
#define BOTH(T, t) [BL_##T] = {[ROWS] = bl_mm_##t##_scalar, [I8] = bl_mm_##t##_scalar}

/* Sums of words [lo, hi) in 8 chains: the page-in read of a model file (Pool.read) */
static uint64_t read_sum_scalar(const uint64_t *p, size_t lo, size_t hi) {
    uint64_t a[8] = {0};
    for (size_t i = lo; i < hi; i += 32)
        for (int k = 0; k < 8; k++) a[k] += p[i + 4 * k] + p[i + 4 * k + 1] + p[i + 4 * k + 2] + p[i + 4 * k + 3];
    return a[0] + a[1] + a[2] + a[3] + a[4] + a[5] + a[6] + a[7];
}

const bl_kernel_table bl_tier_scalar = {
    .act = {[BL_ACT_Q8] = bl_act_q8_scalar, [BL_ACT_Q8X2] = bl_act_q8x2_scalar},
    .matmul = {
        [BL_F32] = {[ROWS] = bl_mm_f32_scalar},
        [BL_F16] = {[ROWS] = bl_mm_f16_scalar},
        BOTH(Q4_0, q4_0), BOTH(Q4_1, q4_1), BOTH(Q8_0, q8_0), BOTH(Q5_0, q5_0),
        BOTH(Q3_K, q3_k), BOTH(Q4_K, q4_k), BOTH(Q5_K, q5_k), BOTH(Q6_K, q6_k), BOTH(MXFP4, mxfp4),
    },
    .rmsnorm = bl_rmsnorm_scalar, .rope = bl_rope_scalar, .softmax = bl_softmax_scalar,
    .silu_mul = bl_silu_mul_scalar, .gelu_mul = bl_gelu_mul_scalar, .add = bl_add_scalar,
    .hadamard = bl_hadamard_scalar,
    .attend = bl_attend_scalar, .kv_store = bl_kv_store_scalar,
    .argmax = bl_argmax_scalar, .top = bl_top_scalar, .sum_exp = bl_sum_exp_scalar, .row_max = bl_row_max_scalar,
    .read_sum = read_sum_scalar,
};
