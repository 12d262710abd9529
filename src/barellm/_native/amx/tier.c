/* The amx tier's tables (AMX-TILE + AMX-INT8): the prefill matmuls of every quantized type on the interleaved
 * layout (amx/matmul.h), on the tile instructions; the rest stay avx512's. bl_tier_amx_emulated holds the same
 * kernels on the tile emulation, laid only by tests (set_isa("amx-emulated")), never chosen at run time. */
#include <stdlib.h>

#include "amx/amx.h"

#define AMX_TABLE(sfx)                                                                                   \
    {                                                                                                    \
        .matmul = {                                                                                      \
            [BL_Q4_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_0_##sfx},                                    \
            [BL_Q4_1] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_1_##sfx},                                    \
            [BL_Q8_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q8_0_##sfx},                                    \
            [BL_Q5_0] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q5_0_##sfx},                                    \
            [BL_Q4_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q4_k_##sfx},                                    \
            [BL_Q6_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q6_k_##sfx},                                    \
            [BL_Q5_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q5_k_##sfx},                                    \
            [BL_Q3_K] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_q3_k_##sfx},                                    \
            [BL_MXFP4] = {[BL_LAYOUT_INTERLEAVE8] = bl_mm_mxfp4_##sfx},                                  \
        },                                                                                               \
    }

const bl_kernel_table bl_tier_amx = AMX_TABLE(amx);
const bl_kernel_table bl_tier_amx_emulated = AMX_TABLE(amx_emulated);

int bl_amx_min_tokens = BL_AMX_MIN_TOKENS_DEFAULT;
