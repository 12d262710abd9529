/* CPU feature detection and the choice of kernel path. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

static int g_isa = -1;

int bl_cpu_has_avx2_fma(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static enum bl_isa detect(void) {
    enum bl_isa best = bl_cpu_has_avx2_fma() ? BL_ISA_AVX2 : BL_ISA_SCALAR;
    const char *want = getenv("BARELLM_ISA");
    if (want && strcmp(want, "scalar") == 0) return BL_ISA_SCALAR;
    /* asking for more than the CPU has falls back to what it has */
    return best;
}

enum bl_isa bl_isa(void) {
    if (g_isa < 0) {
        g_isa = (int)detect();
        bl_kernels_resolve(g_isa);
    }
    return (enum bl_isa)g_isa;
}

/* the kernels are looked up in the traits table once per change of path, not per call */
void bl_set_isa(enum bl_isa isa) {
    if (isa == BL_ISA_AVX2 && !bl_cpu_has_avx2_fma()) isa = BL_ISA_SCALAR;
    g_isa = (int)isa;
    bl_kernels_resolve(g_isa);
}

const char *bl_isa_name(enum bl_isa isa) {
    switch (isa) {
    case BL_ISA_AVX2: return "avx2+fma";
    default: return "scalar";
    }
}
