/* Portable kernels of ops.h (the reference path; also what runs without AVX2). */
#include <math.h>
#include <string.h>

#include "ops.h"

void bl_rmsnorm_scalar(const float *x, const float *w, float *out, int n, float eps) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += x[i + j] * x[i + j];
    float ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) ss += x[i] * x[i];
    const float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = (x[i] * scale) * w[i];
}

void bl_rope_scalar(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style) {
    const int h = rope_dim / 2;
    const float *cosv = cs, *sinv = cs + h;
    for (int hd = 0; hd < n_heads; hd++) {
        float *v = x + (size_t)hd * head_dim;
        for (int i = 0; i < h; i++) {
            float *a = style == BL_ROPE_NEOX ? v + i : v + 2 * i;
            float *b = style == BL_ROPE_NEOX ? v + i + h : v + 2 * i + 1;
            const float x0 = *a, x1 = *b, c = cosv[i], s = sinv[i];
            *a = x0 * c - x1 * s;
            *b = x1 * c + x0 * s;
        }
    }
}

void bl_softmax_scalar(float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    float sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    const float inv = 1.0f / sum;
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void bl_silu_mul_scalar(const float *gate, const float *up, float *out, int n) {
    for (int i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void bl_gelu_mul_scalar(const float *gate, const float *up, float *out, int n) {
    const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
    for (int i = 0; i < n; i++) {
        const float g = gate[i];
        /* g / 2 * (1 + tanh(u)) = g / (1 + e^(-2u)): no cancellation where tanh(u) is near -1 */
        out[i] = g / (1.0f + expf(-2.0f * c * (g + 0.044715f * g * g * g))) * up[i];
    }
}

void bl_add_scalar(float *x, const float *y, int n) {
    for (int i = 0; i < n; i++) x[i] += y[i];
}

static inline float kv_at(const void *base, size_t i, int f16) {
    return f16 ? bl_half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

void bl_attend_scalar(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim,
                      float scale, int f16) {
    enum { KT = BL_KV_TILE };
    float m[BL_ATT_MAXQ], l[BL_ATT_MAXQ];
    int tiles = 0, first = 1 << 30;
    for (int i = 0; i < nq; i++) {
        m[i] = -INFINITY;
        l[i] = 0;
        memset(qs[i].out, 0, sizeof(float) * head_dim);
        if (qs[i].pos / KT + 1 > tiles) tiles = qs[i].pos / KT + 1;
        if (qs[i].lo / KT < first) first = qs[i].lo / KT;
    }
    for (int j = first; j < tiles; j++) {
        const size_t kt = (size_t)j * head_dim * KT, vt = (size_t)j * KT * head_dim;
        for (int i = 0; i < nq; i++) {
            const int pos = qs[i].pos, lo = qs[i].lo;
            if (pos < j * KT || lo >= (j + 1) * KT) continue;
            const int k0 = lo > j * KT ? lo - j * KT : 0;
            const int k1 = pos - j * KT + 1 < KT ? pos - j * KT + 1 : KT;
            const float *q = qs[i].q;
            float *acc = qs[i].out;
            float s[KT];
            for (int k = 0; k < KT; k++) s[k] = 0;
            for (int d = 0; d < head_dim; d++) {
                const float qd = q[d];
                const size_t kr = kt + (size_t)d * KT;
                for (int k = k0; k < k1; k++) s[k] += qd * kv_at(kc, kr + k, f16);
            }
            float mt = -INFINITY;
            for (int k = k0; k < k1; k++) {
                s[k] *= scale;
                mt = s[k] > mt ? s[k] : mt;
            }
            const float mn = mt > m[i] ? mt : m[i];
            const float corr = expf(m[i] - mn);
            float sum = 0;
            for (int k = k0; k < k1; k++) {
                s[k] = expf(s[k] - mn);
                sum += s[k];
            }
            m[i] = mn;
            l[i] = l[i] * corr + sum;
            for (int d = 0; d < head_dim; d++) acc[d] *= corr;
            for (int k = k0; k < k1; k++) {
                const float p = s[k];
                const size_t vr = vt + (size_t)k * head_dim;
                for (int d = 0; d < head_dim; d++) acc[d] += p * kv_at(vc, vr + d, f16);
            }
        }
    }
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / l[i];
        for (int d = 0; d < head_dim; d++) qs[i].out[d] *= inv;
    }
}

void bl_kv_store_scalar(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                 int n_ctx, int kv_f16) {
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
