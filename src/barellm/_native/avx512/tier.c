/* The avx512 tier's table (AVX-512 F + BW + VL + DQ + VNNI): the prefill matmuls of every quantized type on the
 * interleaved layout (avx512/quant.c, avx512/quant_kq.c) and the one-token (decode) matmuls of Q4_K, Q5_K and
 * Q6_K (avx512/decode_kq.c); the rest stay avx2's. */
#include "quant_internal.h"
#include "tier.h"

const bl_kernel_table bl_tier_avx512 = {
    .matmul = {
        [BL_Q4_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_0_avx512},
        [BL_Q4_1] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_1_avx512},
        [BL_Q8_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q8_0_avx512},
        [BL_Q5_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q5_0_avx512},
        [BL_Q4_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_k_avx512},
        [BL_Q6_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q6_k_avx512},
        [BL_Q5_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q5_k_avx512},
        [BL_Q3_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q3_k_avx512},
        [BL_MXFP4] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_mxfp4_avx512},
    },
    .attend = bl_attend_avx512,
};
