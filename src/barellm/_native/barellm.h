/* barellm native core: shared types and the contracts between its parts.
 *
 * Layout of the core:
 *   cpu.c            feature detection, the tier in use (BARELLM_ISA caps it)
 *   tier.c, tier.h   the kernel table every op calls, laid together from the tiers' tables
 *   scalar/ avx2/ avx512/ amx/   one folder per ISA tier: its kernels and its table
 *   quant*.c         the weight types' traits, activation quantization, weight repacking
 *   ops.c            the element-wise and attention entry points
 *   threadpool.c     persistent workers, spin barrier, row partitioning
 *   executor.c       runs a plan of ops over preallocated buffers
 *   sample*.c        the sampling chain over a row of logits (top-k heap, penalties, bias, token mask)
 *   py_*.c, module.c the Python binding, a file per concept: kernels, ops, pool, plan, sample (GIL released
 *                    around work)
 *
 * Conventions: matrices are row-major; a weight matrix W has `rows` output features and `cols` input
 * features, and a matmul computes out[t, r] = sum_k W[r, k] * x[t, k].
 */
#ifndef BARELLM_H
#define BARELLM_H

#include <stddef.h>
#include <stdint.h>

#define BL_API __attribute__((visibility("hidden")))
#define BL_CACHELINE 64

/* ggml type ids, kept so GGUF types map one to one */
enum bl_type {
    BL_F32 = 0, BL_F16 = 1, BL_Q4_0 = 2, BL_Q4_1 = 3, BL_Q5_0 = 6, BL_Q5_1 = 7, BL_Q8_0 = 8,
    BL_Q3_K = 11, BL_Q4_K = 12, BL_Q5_K = 13, BL_Q6_K = 14, BL_BF16 = 30, BL_MXFP4 = 39,
};

/* instruction-set tiers, in increasing order of capability; each adds to the ones below (tier.h) */
enum bl_isa { BL_ISA_SCALAR = 0, BL_ISA_AVX2 = 1, BL_ISA_AVX512 = 2, BL_ISA_AMX = 3, BL_ISA_COUNT };

/* cpu.c */
BL_API unsigned bl_cpu_tiers(void);      /* the tiers this CPU and OS can run, bit 1 << enum bl_isa each */
BL_API enum bl_isa bl_isa(void);         /* the tier in use: the best offered, capped by BARELLM_ISA */
BL_API enum bl_isa bl_set_isa(enum bl_isa isa); /* caps the tier (tests switch inside one process); returns
                                                   the tier in use: the best offered at or under isa */
BL_API const char *bl_isa_name(enum bl_isa isa); /* "scalar", "avx2", "avx512", "amx" */
BL_API int bl_isa_from_name(const char *name);   /* -1: not a tier's name */
/* Tests only: the best tier up to avx512 with the amx kernels over it, run on the tile emulation (amx/tile.h);
 * 0 where there is none (not x86-64). bl_set_isa ends it. bl_amx_emulated: whether it is in force. */
BL_API int bl_set_amx_emulated(void);
BL_API int bl_amx_emulated(void);

#endif
