/* The ops.h entry points: each calls the resolved tier table (tier.h). */
#include "tier.h"

void bl_rmsnorm(const float *x, const float *w, float *out, int n, float eps) { bl_kernels.rmsnorm(x, w, out, n, eps); }
void bl_rope(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style) {
    bl_kernels.rope(x, n_heads, head_dim, rope_dim, cs, style);
}
void bl_softmax(float *x, int n) { bl_kernels.softmax(x, n); }
void bl_silu_mul(const float *gate, const float *up, float *out, int n) { bl_kernels.silu_mul(gate, up, out, n); }
void bl_gelu_mul(const float *gate, const float *up, float *out, int n) { bl_kernels.gelu_mul(gate, up, out, n); }
void bl_add(float *x, const float *y, int n) { bl_kernels.add(x, y, n); }
void bl_hadamard(float *x, int len, int n) { bl_kernels.hadamard(x, len, n); }
void bl_attend(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,
               float cap, int kv_type) {
    bl_kernels.attend(qs, nq, kc, vc, head_dim, scale, cap, kv_type);
}
void bl_kv_store(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                 int n_ctx, int kv_type) {
    bl_kernels.kv_store(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx, kv_type);
}
