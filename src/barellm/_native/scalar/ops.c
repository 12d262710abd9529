/* Portable kernels of ops.h (the reference path; also what runs without AVX2). */
#include <math.h>
#include <string.h>

#include "attend.h"
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

void bl_hadamard_scalar(float *x, int len, int n) {
    const float scale = (float)(1.0 / sqrt((double)n));
    for (int b = 0; b + n <= len; b += n) {
        float *v = x + b;
        for (int h = 1; h < n; h *= 2)
            for (int i = 0; i < n; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    const float a = v[j], c = v[j + h];
                    v[j] = a + c;
                    v[j + h] = a - c;
                }
        for (int i = 0; i < n; i++) v[i] *= scale;
    }
}

static inline float kv_at(const void *base, size_t i, int f16) {
    return f16 ? bl_half_to_float(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* A q8_0 tile's scores: s[k] = sum over blocks b of fma(chain_b[k], d_b[k], s[k]), chain_b[k] an fma chain
 * over the block's 32 values of q[d] * key int8 (the avx2 and avx512 kernels' order). */
static void qk_q8(const float *q, const uint8_t *tile, int head_dim, int k0, int k1, float *s) {
    enum { KT = BL_KV_TILE };
    const int8_t *kq = (const int8_t *)tile;
    const uint16_t *kd = (const uint16_t *)(tile + (size_t)KT * head_dim);
    for (int k = 0; k < KT; k++) s[k] = 0;
    for (int b = 0; b < head_dim / BL_KV_QK; b++) {
        float a[KT];
        for (int k = 0; k < KT; k++) a[k] = 0;
        for (int d = b * BL_KV_QK; d < (b + 1) * BL_KV_QK; d++)
            for (int k = k0; k < k1; k++) a[k] = fmaf(q[d], (float)kq[(size_t)d * KT + k], a[k]);
        for (int k = k0; k < k1; k++) s[k] = fmaf(a[k], bl_half_to_float(kd[b * KT + k]), s[k]);
    }
}

/* acc += p * dequantized V row (q8_0): per block, (p * d) times each int8, fma'd into acc */
static void pv_q8(float *acc, float p, const uint8_t *row, int head_dim) {
    const int8_t *vq = (const int8_t *)row;
    const uint16_t *vd = (const uint16_t *)(row + head_dim);
    for (int b = 0; b < head_dim / BL_KV_QK; b++) {
        const float pd = p * bl_half_to_float(vd[b]);
        for (int d = b * BL_KV_QK; d < (b + 1) * BL_KV_QK; d++) acc[d] = fmaf(pd, (float)vq[d], acc[d]);
    }
}

void bl_attend_scalar(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,
                      float cap, int kv_type) {
    enum { KT = BL_KV_TILE };
    const int f16 = kv_type == BL_KV_F16, q8 = kv_type == BL_KV_Q8_0;
    const size_t rb = bl_kv_row_bytes(head_dim, kv_type);
    bl_attend_walk w;
    float *m = w.m, *l = w.l;
    for (bl_attend_begin(&w, qs, nq, head_dim); bl_attend_next(&w, qs, nq);) {
        const size_t kt = (size_t)w.j * head_dim * KT, vt = (size_t)w.j * KT * head_dim, tb = (size_t)w.j * KT * rb;
        const uint8_t *ktile = (const uint8_t *)kc + tb, *vtile = (const uint8_t *)vc + tb;
        for (int i = 0; i < nq; i++) {
            const int k0 = w.r0[i], k1 = w.r1[i];
            if (k1 <= k0) continue;
            const float *q = qs[i].q;
            float *acc = qs[i].out;
            float s[KT];
            if (q8) qk_q8(q, ktile, head_dim, k0, k1, s);
            else {
                for (int k = 0; k < KT; k++) s[k] = 0;
                for (int d = 0; d < head_dim; d++) {
                    const float qd = q[d];
                    const size_t kr = kt + (size_t)d * KT;
                    for (int k = k0; k < k1; k++) s[k] += qd * kv_at(kc, kr + k, f16);
                }
            }
            float mt = -INFINITY;
            for (int k = k0; k < k1; k++) {
                s[k] *= scale;
                if (cap) s[k] = cap * tanhf(s[k] / cap);
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
                if (q8) {
                    pv_q8(acc, p, vtile + (size_t)k * rb, head_dim);
                    continue;
                }
                const size_t vr = vt + (size_t)k * head_dim;
                for (int d = 0; d < head_dim; d++) acc[d] += p * kv_at(vc, vr + d, f16);
            }
        }
    }
    bl_attend_sinks(qs, nq, m, l, expf);
    bl_attend_finish(qs, nq, head_dim, w.l);
}

/* ggml's quantize_row_q8_0_ref on one block of 32: d = amax / 127, q = roundf(x * (1 / d)); the clamp
 * changes nothing for finite x (|x / d| <= 127 up to rounding) and keeps a NaN's conversion defined */
static void q8_block(const float *x, int8_t *q, size_t q_step, uint16_t *d_out) {
    float amax = 0;
    for (int i = 0; i < BL_KV_QK; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d != 0 ? 1.0f / d : 0.0f;
    *d_out = bl_float_to_half(d);
    for (int i = 0; i < BL_KV_QK; i++)
        q[(size_t)i * q_step] = (int8_t)roundf(fminf(fmaxf(x[i] * id, -127.0f), 127.0f));
}

void bl_kv_store_scalar(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                 int n_ctx, int kv_type) {
    if (kv_type == BL_KV_Q8_0) {
        enum { KT = BL_KV_TILE };
        const size_t rb = bl_kv_row_bytes(head_dim, kv_type), head = (size_t)n_ctx * rb;
        for (int h = 0; h < n_kv_heads; h++) {
            const float *kh = k + (size_t)h * head_dim, *vh = v + (size_t)h * head_dim;
            uint8_t *tile = (uint8_t *)kc + h * head + (size_t)(pos / KT) * KT * rb;
            uint8_t *row = (uint8_t *)vc + h * head + (size_t)pos * rb;
            uint16_t *kd = (uint16_t *)(tile + (size_t)KT * head_dim), *vd = (uint16_t *)(row + head_dim);
            for (int b = 0; b < head_dim / BL_KV_QK; b++) {
                q8_block(kh + b * BL_KV_QK, (int8_t *)tile + (size_t)b * BL_KV_QK * KT + pos % KT, KT,
                         kd + b * KT + pos % KT);
                q8_block(vh + b * BL_KV_QK, (int8_t *)row + b * BL_KV_QK, 1, vd + b);
            }
        }
        return;
    }
    const int kv_f16 = kv_type == BL_KV_F16;
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
