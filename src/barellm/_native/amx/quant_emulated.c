/* The amx tier's matmuls on the tile emulation (amx/tile.h, BL_AMX_EMULATED): the same kernel source as
 * amx/quant.c, built for the baseline x86-64 so that every machine's tests run it ("amx-emulated"). */
#define BL_AMX_EMULATED
#define AMX_NAME(t) bl_mm_##t##_amx_emulated
#include "amx/matmul.h"
