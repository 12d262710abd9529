/* The amx tier's table (AMX-TILE + AMX-INT8): detected (cpu.c) but with no kernels of its own yet, so every
 * entry is avx512's. */
#include "tier.h"

const bl_kernel_table bl_tier_amx = {0};
