/* Element-wise and attention kernels (ops.c calls the resolved tier table, tier.h).
 *
 * Every kernel works on one row (one token) or one block of queries and does the same float operations
 * for a row whatever the other rows, the row count or the thread are: the executor's invariance rests
 * on that (greedy output independent of threads, chunking and batching).
 *
 * KV cache of one (slot, layer), f32, f16 (IEEE half, rounded to nearest even) or q8_0 (enum bl_kv_type),
 * n_ctx a multiple of BL_KV_TILE:
 *   K: [n_kv_heads][n_ctx / BL_KV_TILE][head_dim][BL_KV_TILE]  keys transposed tile by tile, so a
 *      query's scores against a tile of keys are BL_KV_TILE independent fma chains over head_dim;
 *   V: [n_kv_heads][n_ctx][head_dim]                            values row by row.
 * q8_0 quantizes each key and each value row in blocks of 32 along head_dim (head_dim a multiple of 32) as
 * ggml's q8_0 does: d = amax / 127, q = roundf(x / d) (x * (1 / d), halves away from 0), d kept as an f16;
 * the value is f16(d) * q. A K tile is then int8 [head_dim][BL_KV_TILE] followed by the scales
 * [head_dim / 32][BL_KV_TILE] (f16), a V row int8 [head_dim] followed by its head_dim / 32 scales: a
 * position takes bl_kv_row_bytes = head_dim + head_dim / 16 bytes of K and as many of V (53% of f16).
 * Attention dequantizes on the fly: a score is, block by block, an fma chain over the block's 32 int8 keys
 * (converted exactly to float) times the f32 query, scaled by the key's block scale; each value row adds
 * (p * its block scale) * int8 values. The query stays f32 (ggml quantizes it to q8_0 as well).
 * What a q8_0 cache is given to hold is the executor's choice (executor.c, op_rope_kv): each key minus a
 * constant vector, turned by a Walsh-Hadamard transform (bl_hadamard), and the queries turned alike. These
 * kernels store and attend whatever rows they get.
 * Attention for a query at position p visits keys in tiles [0,64), [64,128), ... up to p with an online
 * softmax: the same tiles and updates in decode and in prefill, so both give identical bits. A sliding
 * window only masks the keys before it: the tiles stay aligned to key 0.
 */
#ifndef BARELLM_OPS_H
#define BARELLM_OPS_H

#include "barellm.h"

#define BL_KV_TILE 64
#define BL_ATT_MAXQ 16 /* queries per attention block */

enum bl_rope_style { BL_ROPE_NORM = 0, BL_ROPE_NEOX = 1 };
enum bl_kv_type { BL_KV_F32 = 0, BL_KV_F16 = 1, BL_KV_Q8_0 = 2 };
#define BL_KV_QK 32 /* values per q8_0 block */

/* Bytes one position takes in K (and in V) of one kv head; 0 for a type or head_dim the cache cannot hold. */
static inline size_t bl_kv_row_bytes(int head_dim, int kv_type) {
    if (head_dim < 1) return 0;
    switch (kv_type) {
    case BL_KV_F32: return (size_t)head_dim * 4;
    case BL_KV_F16: return (size_t)head_dim * 2;
    case BL_KV_Q8_0: return head_dim % BL_KV_QK ? 0 : (size_t)head_dim + (size_t)head_dim / BL_KV_QK * 2;
    default: return 0;
    }
}

typedef struct bl_attn_query {
    const float *q; /* head_dim values */
    float *out;     /* head_dim values */
    int pos;        /* attends keys lo..pos */
    int lo;
    float sink;     /* a logit in the softmax's denominator alone, exp(sink) (gpt-oss; -INFINITY: none) */
} bl_attn_query;

/* out = x / sqrt(mean(x^2) + eps) * w over n values. */
BL_API void bl_rmsnorm(const float *x, const float *w, float *out, int n, float eps);
/* Rotates the first rope_dim values of each of n_heads heads (head_dim apart) in place;
 * cs = [cos_0 .. cos_{h-1}, sin_0 .. sin_{h-1}] for this position, h = rope_dim / 2;
 * style BL_ROPE_NORM rotates pairs (x[2i], x[2i+1]) by angle i, BL_ROPE_NEOX pairs (x[i], x[i+h]). */
BL_API void bl_rope(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style);
/* x = softmax(x) over n values, in place. */
BL_API void bl_softmax(float *x, int n);
/* out = silu(gate) * up = gate / (1 + exp(-gate)) * up. */
BL_API void bl_silu_mul(const float *gate, const float *up, float *out, int n);
/* out = gelu_tanh(gate) * up, gelu_tanh(g) = g / 2 * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 g^3))). */
BL_API void bl_gelu_mul(const float *gate, const float *up, float *out, int n);
/* x += y. */
BL_API void bl_add(float *x, const float *y, int n);

/* x = H x over each block of n values of x[0..len), H the orthonormal Walsh-Hadamard matrix of order n
 * (a power of two dividing len): its own inverse, so (H q) . (H k) = q . k. The butterflies in a fixed
 * order (kv_q8.hadamard gives the same bits), then one product by 1 / sqrt(n). */
BL_API void bl_hadamard(float *x, int len, int n);
/* The order of the transform a q8_0 cache turns keys by: the largest power of two dividing head_dim (at
 * least BL_KV_QK where the cache can hold head_dim), so an outlier's energy spreads over whole q8_0 blocks
 * and the transform stays within a head. */
static inline int bl_kv_rotation(int head_dim) { return head_dim & -head_dim; }

/* Writes one position's key and value rows (n_kv_heads * head_dim each) into a (slot, layer) cache. */
BL_API void bl_kv_store(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads,
                        int head_dim, int n_ctx, int kv_type);
/* Attention of nq queries (all of one KV head) over that head's keys and values:
 * kc = K + head * n_ctx * bl_kv_row_bytes, vc = V + as many bytes; nq <= BL_ATT_MAXQ. The scaled scores s are
 * soft-capped to cap * tanh(s / cap) where cap != 0 (Gemma 2), and each query's sink (bl_attn_query) adds
 * exp(sink) to its softmax's denominator. Every SIMD tier gives the avx2 kernel's bits (its exp and tanh
 * are polynomials); the scalar kernel, on libm's expf and tanhf, is within a few ulp of them. */
BL_API void bl_attend(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim,
                      float scale, float cap, int kv_type);

/* the per-ISA implementations, for tests and dispatch */
#define BL_OPS_DECLARE(sfx)                                                                            \
    void bl_rmsnorm_##sfx(const float *x, const float *w, float *out, int n, float eps);               \
    void bl_rope_##sfx(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style);  \
    void bl_softmax_##sfx(float *x, int n);                                                            \
    void bl_silu_mul_##sfx(const float *gate, const float *up, float *out, int n);                     \
    void bl_gelu_mul_##sfx(const float *gate, const float *up, float *out, int n);                     \
    void bl_add_##sfx(float *x, const float *y, int n);                                                \
    void bl_attend_##sfx(const bl_attn_query *qs, int nq, const void *kc, const void *vc,              \
                         int head_dim, float scale, float cap, int kv_type);
BL_OPS_DECLARE(scalar)
BL_OPS_DECLARE(avx2)
BL_OPS_DECLARE(avx512)
void bl_hadamard_scalar(float *x, int len, int n);
void bl_kv_store_scalar(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                        int n_ctx, int kv_type);
void bl_kv_store_f16_avx2(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                          int n_ctx);

/* IEEE half / bfloat16 to float */
static inline float bl_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (man) { /* subnormal: normalize */
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    } else bits = sign;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

/* float to IEEE half, rounded to nearest even (as F16C's vcvtps2ph does) */
static inline uint16_t bl_float_to_half(float f) {
    uint32_t x, sign, ax;
    __builtin_memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000;
    ax = x & 0x7fffffff;
    if (ax >= 0x7f800000) return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 : 0));
    if (ax >= 0x477ff000) return (uint16_t)(sign | 0x7c00); /* rounds past the largest half */
    if (ax < 0x38800000) {                                  /* half subnormal or zero */
        float a, magic = 0.5f;
        uint32_t r, mu;
        __builtin_memcpy(&a, &ax, 4);
        a += magic; /* the ulp of 0.5f is the half subnormal step, so the add rounds for us */
        __builtin_memcpy(&r, &a, 4);
        __builtin_memcpy(&mu, &magic, 4);
        return (uint16_t)(sign | (r - mu));
    }
    ax += 0xc8000fffu + ((ax >> 13) & 1); /* rebias the exponent, round to nearest even */
    return (uint16_t)(sign | (ax >> 13));
}

static inline float bl_bfloat_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, 4);
    return f;
}

#endif
