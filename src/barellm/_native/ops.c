/* Dispatch of the ops.h kernels by ISA, and the KV store. */
#include <string.h>

#include "ops.h"

#define DISPATCH(fn, ...) \
    do { if (bl_isa() == BL_ISA_AVX2) fn##_avx2(__VA_ARGS__); else fn##_scalar(__VA_ARGS__); } while (0)

void bl_rmsnorm(const float *x, const float *w, float *out, int n, float eps) { DISPATCH(bl_rmsnorm, x, w, out, n, eps); }
void bl_rope(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style) {
    DISPATCH(bl_rope, x, n_heads, head_dim, rope_dim, cs, style);
}
void bl_softmax(float *x, int n) { DISPATCH(bl_softmax, x, n); }
void bl_silu_mul(const float *gate, const float *up, float *out, int n) { DISPATCH(bl_silu_mul, gate, up, out, n); }
void bl_gelu_mul(const float *gate, const float *up, float *out, int n) { DISPATCH(bl_gelu_mul, gate, up, out, n); }
void bl_add(float *x, const float *y, int n) { DISPATCH(bl_add, x, y, n); }
void bl_attend(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,
               int kv_f16) {
    DISPATCH(bl_attend, qs, nq, kc, vc, head_dim, scale, kv_f16);
}

void bl_kv_store(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                 int n_ctx, int kv_f16) {
    if (kv_f16 && bl_isa() == BL_ISA_AVX2) {
        bl_kv_store_f16_avx2(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx);
        return;
    }
    const size_t head = (size_t)n_ctx * head_dim;
    const size_t kofs = (size_t)(pos / BL_KV_TILE) * head_dim * BL_KV_TILE + pos % BL_KV_TILE;
    for (int h = 0; h < n_kv_heads; h++) {
        const float *kh = k + (size_t)h * head_dim, *vh = v + (size_t)h * head_dim;
        const size_t vofs = h * head + (size_t)pos * head_dim;
        if (kv_f16) {
            uint16_t *kt = (uint16_t *)kc + h * head + kofs, *vt = (uint16_t *)vc + vofs;
            for (int d = 0; d < head_dim; d++) kt[(size_t)d * BL_KV_TILE] = bl_float_to_half(kh[d]);
            for (int d = 0; d < head_dim; d++) vt[d] = bl_float_to_half(vh[d]);
        } else {
            float *kt = (float *)kc + h * head + kofs;
            for (int d = 0; d < head_dim; d++) kt[(size_t)d * BL_KV_TILE] = kh[d];
            memcpy((float *)vc + vofs, vh, sizeof(float) * head_dim);
        }
    }
}
