/* The avx512 tier's table (AVX-512 F + BW + VL + DQ + VNNI): the entries it speeds up; the rest stay avx2's. */
#include "quant_internal.h"
#include "tier.h"

const bl_kernel_table bl_tier_avx512 = {
    .matmul = {
        [BL_Q5_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q5_0_avx512},
        [BL_Q4_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_k_avx512},
        [BL_Q6_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q6_k_avx512},
    },
    .attend = bl_attend_avx512,
};
