/* The amx tier's entry points and settings, shared by its two builds (amx/quant.c on the tile instructions,
 * amx/quant_emulated.c on their emulation) and the code that picks them (tier.c, cpu.c). */
#ifndef BARELLM_AMX_H
#define BARELLM_AMX_H

#include "quant_internal.h"
#include "tier.h"

/* Calls of fewer tokens than this take the tier below's kernel (decode, short verifications): set from
 * BARELLM_AMX_MIN_TOKENS when the core loads, or by tests (1: every call on tiles). */
extern int bl_amx_min_tokens;
#define BL_AMX_MIN_TOKENS_DEFAULT 16

#define BL_AMX_DECLARE(sfx)                                                                              \
    void bl_mm_q4_0_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q4_1_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q5_0_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q8_0_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q3_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q4_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q5_k_##sfx(BL_MM_ARGS);                                                                   \
    void bl_mm_q6_k_##sfx(BL_MM_ARGS);
BL_AMX_DECLARE(amx)
BL_AMX_DECLARE(amx_emulated)

#endif
