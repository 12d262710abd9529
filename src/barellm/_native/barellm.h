/* barellm native core: shared types and the contracts between its parts.
 *
 * Layout of the core:
 *   cpu.c            feature detection, ISA choice (BARELLM_ISA override)
 *   quant_*.c        quantized matmul kernels per ISA, activation quantization, weight repacking
 *   ops_*.c          element-wise and attention kernels per ISA
 *   threadpool.c     persistent workers, spin barrier, row partitioning
 *   executor.c       runs a plan of ops over preallocated buffers
 *   py_*.c, module.c the Python binding (GIL released around work)
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
    BL_Q3_K = 11, BL_Q4_K = 12, BL_Q5_K = 13, BL_Q6_K = 14, BL_BF16 = 30,
};

/* instruction-set paths, in increasing order of capability */
enum bl_isa { BL_ISA_SCALAR = 0, BL_ISA_AVX2 = 1 };

/* cpu.c */
BL_API int bl_cpu_has_avx2_fma(void);   /* what the CPU offers */
BL_API enum bl_isa bl_isa(void);        /* what is used: the best offered, or BARELLM_ISA's choice */
BL_API void bl_set_isa(enum bl_isa isa); /* tests switch paths inside one process */
BL_API const char *bl_isa_name(enum bl_isa isa);

#endif
