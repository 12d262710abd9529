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

/* the quantized types' matmuls of both builds (quant_internal.h's list) */
BL_QUANT_MM_DECLARE(amx)
BL_QUANT_MM_DECLARE(amx_emulated)

#endif
