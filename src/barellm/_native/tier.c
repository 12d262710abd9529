/* The resolved kernel table (tier.h): the tiers' tables laid over each other, scalar at the bottom. */
#include "tier.h"

bl_kernel_table bl_kernels, bl_kernels_below_amx;
bl_kernel_sources bl_kernel_source;

static const bl_kernel_table *const TIERS[BL_ISA_COUNT] = {&bl_tier_scalar, &bl_tier_avx2, &bl_tier_avx512,
                                                           &bl_tier_amx};

/* tier i's table laid over k; its entries' source is tier i */
static void overlay(bl_kernel_table *k, bl_kernel_sources *src, const bl_kernel_table *t, int i) {
    for (int a = 0; a < BL_ACT_COUNT; a++)
        if (t->act[a]) k->act[a] = t->act[a], src->act[a] = (uint8_t)i;
    for (int ty = 0; ty < BL_TYPE_COUNT; ty++)
        for (int l = 0; l < BL_LAYOUT_COUNT; l++)
            if (t->matmul[ty][l]) k->matmul[ty][l] = t->matmul[ty][l], src->matmul[ty][l] = (uint8_t)i;
#define OVERLAY(name, ret, params) \
    if (t->name) k->name = t->name, src->name = (uint8_t)i;
    BL_TIER_OPS(OVERLAY)
#undef OVERLAY
}

static void resolve(int isa, const bl_kernel_table *amx) {
    bl_kernel_table k = {0};
    bl_kernel_sources src = {0};
    for (int i = 0; i <= isa && i < BL_ISA_AMX; i++) overlay(&k, &src, TIERS[i], i);
    bl_kernels_below_amx = k;
    if (amx) overlay(&k, &src, amx, BL_ISA_AMX);
    bl_kernels = k;
    bl_kernel_source = src;
}

void bl_tiers_resolve(int isa) { resolve(isa, isa >= BL_ISA_AMX ? TIERS[BL_ISA_AMX] : NULL); }

void bl_tiers_resolve_amx_emulated(int isa) {
    resolve(isa < BL_ISA_AMX ? isa : BL_ISA_AVX512, &bl_tier_amx_emulated);
}
