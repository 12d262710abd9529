/* Dispatch of the ops.h kernels by ISA, the KV store, and row dequantization (embedding lookup). */
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

/* ---- row dequantization, ggml block formats ---- */

static inline float f16(const uint8_t *p) { return bl_half_to_float((uint16_t)(p[0] | p[1] << 8)); }

static void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

static int block_of(int type, int *bytes) {
    switch (type) {
    case BL_F32: *bytes = 4; return 1;
    case BL_F16: case BL_BF16: *bytes = 2; return 1;
    case BL_Q4_0: *bytes = 18; return 32;
    case BL_Q4_1: *bytes = 20; return 32;
    case BL_Q5_0: *bytes = 22; return 32;
    case BL_Q5_1: *bytes = 24; return 32;
    case BL_Q8_0: *bytes = 34; return 32;
    case BL_Q4_K: *bytes = 144; return 256;
    case BL_Q5_K: *bytes = 176; return 256;
    case BL_Q6_K: *bytes = 210; return 256;
    default: *bytes = 0; return 0;
    }
}

size_t bl_type_row_bytes(int type, int n) {
    int bytes, bs = block_of(type, &bytes);
    if (!bs || n % bs) return 0;
    return (size_t)(n / bs) * bytes;
}

int bl_dequant_row(int type, const void *src, float *y, int n) {
    int bytes, bs = block_of(type, &bytes);
    if (!bs || n % bs) return -1;
    const uint8_t *b = src;
    const int nb = n / bs;
    switch (type) {
    case BL_F32: memcpy(y, src, sizeof(float) * n); return 0;
    case BL_F16: for (int i = 0; i < n; i++) y[i] = f16(b + 2 * i); return 0;
    case BL_BF16: for (int i = 0; i < n; i++) y[i] = bl_bfloat_to_float((uint16_t)(b[2 * i] | b[2 * i + 1] << 8)); return 0;
    default: break;
    }
    for (int i = 0; i < nb; i++, b += bytes, y += bs) {
        switch (type) {
        case BL_Q4_0: {
            const float d = f16(b);
            for (int j = 0; j < 16; j++) {
                y[j] = (float)((b[2 + j] & 0xF) - 8) * d;
                y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
            }
            break;
        }
        case BL_Q4_1: {
            const float d = f16(b), m = f16(b + 2);
            for (int j = 0; j < 16; j++) {
                y[j] = (float)(b[4 + j] & 0xF) * d + m;
                y[j + 16] = (float)(b[4 + j] >> 4) * d + m;
            }
            break;
        }
        case BL_Q5_0: case BL_Q5_1: {
            const int q51 = type == BL_Q5_1;
            const float d = f16(b), m = q51 ? f16(b + 2) : 0.0f;
            const uint8_t *qhp = b + (q51 ? 4 : 2), *qs = qhp + 4;
            const uint32_t qh = (uint32_t)qhp[0] | (uint32_t)qhp[1] << 8 | (uint32_t)qhp[2] << 16 | (uint32_t)qhp[3] << 24;
            for (int j = 0; j < 16; j++) {
                const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
                const int x0 = (qs[j] & 0xF) | h0, x1 = (qs[j] >> 4) | h1;
                if (q51) {
                    y[j] = (float)x0 * d + m;
                    y[j + 16] = (float)x1 * d + m;
                } else {
                    y[j] = (float)(x0 - 16) * d;
                    y[j + 16] = (float)(x1 - 16) * d;
                }
            }
            break;
        }
        case BL_Q8_0: {
            const float d = f16(b);
            for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
            break;
        }
        case BL_Q4_K: case BL_Q5_K: {
            const int k5 = type == BL_Q5_K;
            const float d = f16(b), dmin = f16(b + 2);
            const uint8_t *scales = b + 4, *qh = b + 16, *q = b + (k5 ? 48 : 16);
            float *yy = y;
            uint8_t u1 = 1, u2 = 2;
            for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32, u1 <<= 2, u2 <<= 2) {
                uint8_t sc, mm;
                get_scale_min_k4(is, scales, &sc, &mm);
                const float d1 = d * sc, m1 = dmin * mm;
                get_scale_min_k4(is + 1, scales, &sc, &mm);
                const float d2 = d * sc, m2 = dmin * mm;
                for (int l = 0; l < 32; l++)
                    *yy++ = d1 * (float)((q[l] & 0xF) + (k5 && (qh[l] & u1) ? 16 : 0)) - m1;
                for (int l = 0; l < 32; l++)
                    *yy++ = d2 * (float)((q[l] >> 4) + (k5 && (qh[l] & u2) ? 16 : 0)) - m2;
            }
            break;
        }
        case BL_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const float d = f16(b + 208);
            float *yy = y;
            for (int n0 = 0; n0 < 256; n0 += 128, yy += 128, ql += 64, qh += 32, sc += 8) {
                for (int l = 0; l < 32; l++) {
                    const int is = l / 16;
                    const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                    const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                    const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                    const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                    yy[l] = d * sc[is + 0] * q1;
                    yy[l + 32] = d * sc[is + 2] * q2;
                    yy[l + 64] = d * sc[is + 4] * q3;
                    yy[l + 96] = d * sc[is + 6] * q4;
                }
            }
            break;
        }
        default: return -1;
        }
    }
    return 0;
}
