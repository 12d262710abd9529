/* ISA tiers as data: one kernel table per instruction-set tier, each filling only the entries it speeds up.
 *
 * Tiers, in increasing order (enum bl_isa), each a folder of kernels:
 *   scalar/   portable C, every entry filled: the reference every other tier is compared against
 *   avx2/     AVX2 + FMA + F16C
 *   avx512/   AVX-512 F + BW + VL + DQ + VNNI (on top of avx2)
 *   amx/      AMX-TILE + AMX-INT8 (on top of avx512)
 * At start (and when a test switches tiers) bl_tiers_resolve() starts from the scalar table and lays every
 * tier up to the chosen one over it, entry by entry: an entry a tier leaves NULL keeps the one below. Every
 * op of the core goes through the resolved table (bl_kernels); adding an ISA is a folder of kernels, its
 * table, and a detection line in cpu.c.
 *
 * A tier's kernels give the bits of the scalar ones wherever the float order is kept (every matmul, the
 * element-wise ops and attention); where it is not (exp and tanh approximations, sums of exponentials in
 * sampling) the tests hold them to a tight tolerance.
 */
#ifndef BARELLM_TIER_H
#define BARELLM_TIER_H

#include "kernels.h"
#include "ops.h"
#include "sample.h"

typedef void (*bl_act_fn)(const float *x, int cols, uint8_t *row, int b0, int b1);

/* The entries besides the activation converters and the matmuls, as X(name, return type, parameters):
 * the struct members, the overlay and the names `barellm info` prints all come from this one list. */
#define BL_TIER_OPS(X)                                                                                    \
    X(rmsnorm, void, (const float *x, const float *w, float *out, int n, float eps))                      \
    X(rope, void, (float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style))         \
    X(softmax, void, (float *x, int n))                                                                   \
    X(silu_mul, void, (const float *gate, const float *up, float *out, int n))                            \
    X(gelu_mul, void, (const float *gate, const float *up, float *out, int n))                            \
    X(add, void, (float *x, const float *y, int n))                                                       \
    X(hadamard, void, (float *x, int len, int n))                                                         \
    X(attend, void, (const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim,        \
                     float scale, float cap, int kv_type))                                                \
    X(kv_store, void, (void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads,        \
                       int head_dim, int n_ctx, int kv_type))                                             \
    X(argmax, int, (const float *x, int n, const uint32_t *allowed))                                      \
    X(top, int, (const float *x, int n, const uint32_t *allowed, int m, bl_cand *out))                    \
    X(sum_exp, double, (const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo)) \
    X(row_max, float, (const float *x, int n))                                                            \
    X(read_sum, uint64_t, (const uint64_t *p, size_t lo, size_t hi)) /* words [lo, hi), 32 at a time */

#define BL_TIER_MEMBER(name, ret, params) ret (*name) params;
typedef struct bl_kernel_table {
    bl_act_fn act[BL_ACT_COUNT];                          /* per enum bl_act */
    bl_matmul_fn matmul[BL_TYPE_COUNT][BL_LAYOUT_COUNT];  /* per weight type and layout; NULL: none */
    BL_TIER_OPS(BL_TIER_MEMBER)
} bl_kernel_table;
#undef BL_TIER_MEMBER

/* Which tier supplied each entry of the resolved table (enum bl_isa). */
#define BL_TIER_MEMBER(name, ret, params) uint8_t name;
typedef struct bl_kernel_sources {
    uint8_t act[BL_ACT_COUNT];
    uint8_t matmul[BL_TYPE_COUNT][BL_LAYOUT_COUNT];
    BL_TIER_OPS(BL_TIER_MEMBER)
} bl_kernel_sources;
#undef BL_TIER_MEMBER

/* Each tier's own entries (scalar/tier.c, avx2/tier.c, ...); bl_tier_amx_emulated: the amx tier's kernels on
 * the tile emulation (amx/tile.h), laid by tests only. */
extern const bl_kernel_table bl_tier_scalar, bl_tier_avx2, bl_tier_avx512, bl_tier_amx, bl_tier_amx_emulated;

/* The resolved table: what every op calls. Written only by bl_tiers_resolve (at start, before any worker
 * runs, and by tests between calls). */
extern bl_kernel_table bl_kernels;
extern bl_kernel_sources bl_kernel_source;

/* The table as resolved without the amx layer: where an amx kernel sends the calls its tiles do not pay for
 * (and a call whose scratch cannot be had), so that the emulated amx kernels fall back to what this CPU runs. */
extern bl_kernel_table bl_kernels_below_amx;

/* Lays the tiers scalar..isa over each other into bl_kernels. */
BL_API void bl_tiers_resolve(int isa);

/* Lays the tiers scalar..isa (at most avx512), then the emulated amx table over them (tests only). */
BL_API void bl_tiers_resolve_amx_emulated(int isa);

/* The scalar table: the kernels a tier falls back to inside a call (out of memory for its scratch). */
static inline const bl_kernel_table *bl_scalar_kernels(void) { return &bl_tier_scalar; }

#endif
