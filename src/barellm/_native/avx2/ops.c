/* AVX2+FMA kernels of ops.h. Compiled for that target only; called when bl_isa() says so. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attend.h"
#include "ops.h"
#include "avx2/simd.h"

void bl_rmsnorm_avx2(const float *x, const float *w, float *out, int n, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    float ss = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) ss += x[i] * x[i];
    const float scale = 1.0f / sqrtf(ss / (float)n + eps);
    const __m256 vs = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs), _mm256_loadu_ps(w + i)));
    for (; i < n; i++) out[i] = (x[i] * scale) * w[i];
}

void bl_rope_avx2(float *x, int n_heads, int head_dim, int rope_dim, const float *cs, int style) {
    const int h = rope_dim / 2;
    const float *cosv = cs, *sinv = cs + h;
    for (int hd = 0; hd < n_heads; hd++) {
        float *v = x + (size_t)hd * head_dim;
        int i = 0;
        if (style == BL_ROPE_NEOX) {
            for (; i + 8 <= h; i += 8) {
                __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + i + h);
                __m256 c = _mm256_loadu_ps(cosv + i), s = _mm256_loadu_ps(sinv + i);
                _mm256_storeu_ps(v + i, _mm256_fmsub_ps(a, c, _mm256_mul_ps(b, s)));
                _mm256_storeu_ps(v + i + h, _mm256_fmadd_ps(b, c, _mm256_mul_ps(a, s)));
            }
            for (; i < h; i++) {
                const float x0 = v[i], x1 = v[i + h];
                v[i] = x0 * cosv[i] - x1 * sinv[i];
                v[i + h] = x1 * cosv[i] + x0 * sinv[i];
            }
        } else {
            for (; i + 4 <= h; i += 4) {
                __m128 c4 = _mm_loadu_ps(cosv + i), s4 = _mm_loadu_ps(sinv + i);
                __m256 c = _mm256_set_m128(_mm_unpackhi_ps(c4, c4), _mm_unpacklo_ps(c4, c4));
                __m256 s = _mm256_set_m128(_mm_unpackhi_ps(s4, s4), _mm_unpacklo_ps(s4, s4));
                __m256 a = _mm256_loadu_ps(v + 2 * i);
                __m256 sw = _mm256_permute_ps(a, 0xB1); /* (x1, x0, x3, x2, ...) */
                /* even lanes x0 c - x1 s, odd lanes x1 c + x0 s */
                _mm256_storeu_ps(v + 2 * i, _mm256_fmaddsub_ps(a, c, _mm256_mul_ps(sw, s)));
            }
            for (; i < h; i++) {
                const float x0 = v[2 * i], x1 = v[2 * i + 1];
                v[2 * i] = x0 * cosv[i] - x1 * sinv[i];
                v[2 * i + 1] = x1 * cosv[i] + x0 * sinv[i];
            }
        }
    }
}

void bl_softmax_avx2(float *x, int n) {
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
    float m = hmax8(vm);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    const __m256 bm = _mm256_set1_ps(m);
    __m256 vs = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), bm));
        _mm256_storeu_ps(x + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = hsum8(vs);
    for (; i < n; i++) {
        x[i] = exp1(x[i] - m);
        sum += x[i];
    }
    const float inv = 1.0f / sum;
    const __m256 vi = _mm256_set1_ps(inv);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vi));
    for (; i < n; i++) x[i] *= inv;
}

void bl_silu_mul_avx2(const float *gate, const float *up, float *out, int n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp8(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gate[i] / (1.0f + exp1(-gate[i])) * up[i];
}

/* g / 2 * (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3): no cancellation where
 * tanh(u) is near -1 */
static inline float gelu1(float g) {
    const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp1(-2.0f * u));
}

void bl_gelu_mul_avx2(const float *gate, const float *up, float *out, int n) {
    const __m256 c = _mm256_set1_ps(-2.0f * 0.7978845608028654f), k = _mm256_set1_ps(0.044715f);
    const __m256 one = _mm256_set1_ps(1.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(k, g), _mm256_mul_ps(g, g), g)));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) out[i] = gelu1(gate[i]) * up[i];
}

void bl_add_avx2(float *x, const float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

static inline __attribute__((always_inline)) __m256 ld8(const void *base, size_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
               : _mm256_loadu_ps((const float *)base + i);
}

/* bl_kv_store for an f16 cache with F16C (the same rounding, to nearest even, as bl_float_to_half) */
void bl_kv_store_f16_avx2(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                          int n_ctx) {
    const size_t head = (size_t)n_ctx * head_dim;
    const size_t kofs = (size_t)(pos / BL_KV_TILE) * head_dim * BL_KV_TILE + pos % BL_KV_TILE;
    for (int h = 0; h < n_kv_heads; h++) {
        const float *kh = k + (size_t)h * head_dim, *vh = v + (size_t)h * head_dim;
        uint16_t *kt = (uint16_t *)kc + h * head + kofs, *vt = (uint16_t *)vc + h * head + (size_t)pos * head_dim;
        int d = 0;
        for (; d + 8 <= head_dim; d += 8) {
            _Alignas(16) uint16_t hk[8];
            _mm_store_si128((__m128i *)hk, _mm256_cvtps_ph(_mm256_loadu_ps(kh + d), _MM_FROUND_TO_NEAREST_INT));
            for (int i = 0; i < 8; i++) kt[(size_t)(d + i) * BL_KV_TILE] = hk[i];
            _mm_storeu_si128((__m128i *)(vt + d), _mm256_cvtps_ph(_mm256_loadu_ps(vh + d), _MM_FROUND_TO_NEAREST_INT));
        }
        for (; d < head_dim; d++) {
            kt[(size_t)d * BL_KV_TILE] = bl_float_to_half(kh[d]);
            vt[d] = bl_float_to_half(vh[d]);
        }
    }
}

#define ALWAYS static inline __attribute__((always_inline))

/* The attention passes keep, per query, 32 chains in 4 vectors a[i][0..3]: 32 keys' scores, or 32 output
 * values. */

/* a[u] = fma(x, v[u], a[u]), u < 4: one step of a query's 32 chains */
ALWAYS void fma4(__m256 a[4], const __m256 x, const __m256 v[4]) {
    for (int u = 0; u < 4; u++) a[u] = _mm256_fmadd_ps(x, v[u], a[u]);
}

ALWAYS void zero4(int QB, __m256 a[2][4]) {
    for (int i = 0; i < QB; i++)
        for (int u = 0; u < 4; u++) a[i][u] = _mm256_setzero_ps();
}

/* one step of the score chains over d: a[i][u] = fma(q_i[d], k[u], a[i][u]) */
ALWAYS void qk_step(int QB, const bl_attn_query *qs, int d, const __m256 k[4], __m256 a[2][4]) {
    for (int i = 0; i < QB; i++) fma4(a[i], _mm256_broadcast_ss(qs[i].q + d), k);
}

/* the value chains' start: each query's output values [d0, d0 + 32) times its rescale factor */
ALWAYS void pv_start(int QB, const bl_attn_query *qs, const float *corr, int d0, __m256 a[2][4]) {
    for (int i = 0; i < QB; i++) {
        const __m256 c = _mm256_set1_ps(corr[i]);
        for (int u = 0; u < 4; u++) a[i][u] = _mm256_mul_ps(_mm256_loadu_ps(qs[i].out + d0 + 8 * u), c);
    }
}

ALWAYS void pv_end(int QB, const bl_attn_query *qs, int d0, __m256 a[2][4]) {
    for (int i = 0; i < QB; i++)
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(qs[i].out + d0 + 8 * u, a[i][u]);
}

/* Scores of QB queries against keys [32 h, 32 h + 32) of a tile, unscaled, into s[i * KT + k]:
 * each score is an fma chain over d = 0 .. head_dim - 1 (the same chain for any QB). */
ALWAYS void qk_pass(int QB, const bl_attn_query *qs, const void *kc, size_t kt, int h, int head_dim, int f16,
                    float *s) {
    enum { KT = BL_KV_TILE };
    __m256 a[2][4];
    zero4(QB, a);
    for (int d = 0; d < head_dim; d++) {
        const size_t kr = kt + (size_t)d * KT + 32 * h;
        __m256 k[4];
        for (int u = 0; u < 4; u++) k[u] = ld8(kc, kr + 8 * u, f16);
        qk_step(QB, qs, d, k, a);
    }
    for (int i = 0; i < QB; i++)
        for (int u = 0; u < 4; u++) _mm256_store_ps(s + i * KT + 32 * h + 8 * u, a[i][u]);
}

ALWAYS __m256 lt_select8(__m256 a, __m256 b, __m256 x, __m256 y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}

BL_DEFINE_TANH(ALWAYS, tanh8, __m256, _mm256, exp8, lt_select8)

/* Online-softmax update of one query for the keys [k0, k1) of a tile: s (scores) becomes p, with 0
 * outside the range; returns the factor the query's accumulator is rescaled by. The scaled scores are
 * soft-capped, cap * tanh(s / cap), where cap != 0. */
ALWAYS float softmax_tile(float *s, float *m, float *l, int k0, int k1, float scale, float cap) {
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY), vcap = _mm256_set1_ps(cap);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_set1_epi32(k0 - 1), hi = _mm256_set1_epi32(k1);
    __m256 v[8], valid[8];
    __m256 vmax = ninf;
    for (int b = 0; b < 8; b++) {
        const __m256i kk = _mm256_add_epi32(iota, _mm256_set1_epi32(8 * b));
        valid[b] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(hi, kk), _mm256_cmpgt_epi32(kk, lo)));
        __m256 x = _mm256_mul_ps(_mm256_load_ps(s + 8 * b), vscale);
        if (cap != 0) x = _mm256_mul_ps(vcap, tanh8(_mm256_div_ps(x, vcap)));
        v[b] = _mm256_blendv_ps(ninf, x, valid[b]);
        vmax = _mm256_max_ps(vmax, v[b]);
    }
    const float mt = hmax8(vmax);
    const float mn = mt > *m ? mt : *m;
    const float corr = exp1(*m - mn); /* first tile: m = -inf, clamped: a tiny factor times acc = 0 */
    const __m256 vmn = _mm256_set1_ps(mn);
    for (int b = 0; b < 8; b++) {
        v[b] = _mm256_and_ps(exp8(_mm256_sub_ps(v[b], vmn)), valid[b]);
        _mm256_store_ps(s + 8 * b, v[b]);
    }
    const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])),
                                          _mm256_add_ps(_mm256_add_ps(v[4], v[5]), _mm256_add_ps(v[6], v[7]))));
    *l = fmaf(*l, corr, sum);
    *m = mn;
    return corr;
}

/* acc_i = acc_i * corr_i + sum over k in [k0, k1) of p_i[k] * V[k], for QB queries; per output value an
 * fma chain over k in order (the same chain for any QB). */
ALWAYS void pv_pass(int QB, const bl_attn_query *qs, const float *p, const float *corr, const void *vc, size_t vt,
                    int k0, int k1, int head_dim, int f16) {
    enum { KT = BL_KV_TILE };
    int d0 = 0;
    for (; d0 + 32 <= head_dim; d0 += 32) {
        __m256 a[2][4];
        pv_start(QB, qs, corr, d0, a);
        for (int k = k0; k < k1; k++) {
            const size_t vr = vt + (size_t)k * head_dim + d0;
            __m256 v[4];
            for (int u = 0; u < 4; u++) v[u] = ld8(vc, vr + 8 * u, f16);
            for (int i = 0; i < QB; i++) fma4(a[i], _mm256_broadcast_ss(p + i * KT + k), v);
        }
        pv_end(QB, qs, d0, a);
    }
    for (; d0 < head_dim; d0 += 8) { /* head_dim % 32: one vector at a time */
        __m256 a[2];
        for (int i = 0; i < QB; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(qs[i].out + d0), _mm256_set1_ps(corr[i]));
        for (int k = k0; k < k1; k++) {
            const __m256 v = ld8(vc, vt + (size_t)k * head_dim + d0, f16);
            for (int i = 0; i < QB; i++) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * KT + k), v, a[i]);
        }
        for (int i = 0; i < QB; i++) _mm256_storeu_ps(qs[i].out + d0, a[i]);
    }
}

ALWAYS __m256 ld8_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

/* 32 int8 at p as 4 vectors of floats */
ALWAYS void ld32_i8(const int8_t *p, __m256 v[4]) {
    for (int u = 0; u < 4; u++) v[u] = ld8_i8(p + 8 * u);
}

/* qk_pass on a q8_0 tile (ops.h): per 32-value block an fma chain over its int8 keys, then
 * s = fma(chain, key scale, s), s kept in memory between blocks (the registers hold one block's chains) */
ALWAYS void qk_pass_q8(int QB, const bl_attn_query *qs, const uint8_t *tile, int h, int head_dim, float *s) {
    enum { KT = BL_KV_TILE };
    const int8_t *kq = (const int8_t *)tile;
    const uint16_t *kd = (const uint16_t *)(tile + (size_t)KT * head_dim);
    for (int i = 0; i < QB; i++)
        for (int u = 0; u < 4; u++) _mm256_store_ps(s + i * KT + 32 * h + 8 * u, _mm256_setzero_ps());
    for (int b = 0; b < head_dim / BL_KV_QK; b++) {
        __m256 a[2][4];
        zero4(QB, a);
        /* the keys as 4 named vectors and the steps written out: with qk_step here the register allocator
         * kept 4 of the 8 chains of the second half (h = 1, QB = 2) in memory, 25% slower */
        for (int d = b * BL_KV_QK; d < (b + 1) * BL_KV_QK; d++) {
            const int8_t *kr = kq + (size_t)d * KT + 32 * h;
            const __m256 k0 = ld8_i8(kr), k1 = ld8_i8(kr + 8), k2 = ld8_i8(kr + 16), k3 = ld8_i8(kr + 24);
            for (int i = 0; i < QB; i++) {
                const __m256 qd = _mm256_broadcast_ss(qs[i].q + d);
                a[i][0] = _mm256_fmadd_ps(qd, k0, a[i][0]);
                a[i][1] = _mm256_fmadd_ps(qd, k1, a[i][1]);
                a[i][2] = _mm256_fmadd_ps(qd, k2, a[i][2]);
                a[i][3] = _mm256_fmadd_ps(qd, k3, a[i][3]);
            }
        }
        for (int u = 0; u < 4; u++) {
            const __m256 dk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(kd + b * KT + 32 * h + 8 * u)));
            for (int i = 0; i < QB; i++) {
                float *si = s + i * KT + 32 * h + 8 * u;
                _mm256_store_ps(si, _mm256_fmadd_ps(a[i][u], dk, _mm256_load_ps(si)));
            }
        }
    }
}

/* pv_pass on q8_0 value rows: per value an fma chain over k in order of (p[k] * the row's block scale) times
 * the int8 value; head_dim a multiple of 32, a block at a time */
ALWAYS void pv_pass_q8(int QB, const bl_attn_query *qs, const float *p, const float *corr, const uint8_t *vtile,
                       int k0, int k1, int head_dim) {
    enum { KT = BL_KV_TILE };
    const size_t rb = bl_kv_row_bytes(head_dim, BL_KV_Q8_0);
    for (int d0 = 0; d0 < head_dim; d0 += BL_KV_QK) {
        __m256 a[2][4];
        pv_start(QB, qs, corr, d0, a);
        for (int k = k0; k < k1; k++) {
            const uint8_t *row = vtile + (size_t)k * rb;
            const float dv = bl_half_to_float(((const uint16_t *)(row + head_dim))[d0 / BL_KV_QK]);
            __m256 v[4];
            ld32_i8((const int8_t *)row + d0, v);
            for (int i = 0; i < QB; i++) fma4(a[i], _mm256_set1_ps(p[i * KT + k] * dv), v);
        }
        pv_end(QB, qs, d0, a);
    }
}

/* QB queries (QB <= 2) with the same key range [k0, k1) in tile j: K and V loads are shared. */
ALWAYS void tile_block(int QB, const bl_attn_query *qs, float *m, float *l, const void *kc, const void *vc, int j,
                       int k0, int k1, int head_dim, float scale, float cap, int kvt) {
    enum { KT = BL_KV_TILE };
    _Alignas(32) float s[2 * KT];
    float corr[2];
    const int f16 = kvt == BL_KV_F16;
    const size_t kt = (size_t)j * head_dim * KT, vt = (size_t)j * KT * head_dim;
    const size_t tb = (size_t)j * KT * bl_kv_row_bytes(head_dim, kvt); /* the tile's byte offset (q8_0) */
    if (kvt == BL_KV_Q8_0) qk_pass_q8(QB, qs, (const uint8_t *)kc + tb, 0, head_dim, s);
    else qk_pass(QB, qs, kc, kt, 0, head_dim, f16, s);
    if (k1 > 32) {
        if (kvt == BL_KV_Q8_0) qk_pass_q8(QB, qs, (const uint8_t *)kc + tb, 1, head_dim, s);
        else qk_pass(QB, qs, kc, kt, 1, head_dim, f16, s);
    } else
        for (int i = 0; i < QB; i++) memset(s + i * KT + 32, 0, 32 * sizeof(float)); /* masked below */
    for (int i = 0; i < QB; i++) corr[i] = softmax_tile(s + i * KT, &m[i], &l[i], k0, k1, scale, cap);
    if (kvt == BL_KV_Q8_0) pv_pass_q8(QB, qs, s, corr, (const uint8_t *)vc + tb, k0, k1, head_dim);
    else pv_pass(QB, qs, s, corr, vc, vt, k0, k1, head_dim, f16);
}

ALWAYS void attend(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,
                   float cap, int kvt) {
    bl_attend_walk w;
    for (bl_attend_begin(&w, qs, nq, head_dim); bl_attend_next(&w, qs, nq);) {
        const int j = w.j, *r0 = w.r0, *r1 = w.r1;
        for (int i = 0; i < nq;) {
            if (r1[i] <= r0[i]) {
                i++;
                continue;
            }
            /* pair it with the next query in the tile if that one has the same key range */
            int n = i + 1;
            while (n < nq && r1[n] <= r0[n]) n++;
            if (n < nq && r0[n] == r0[i] && r1[n] == r1[i] && n == i + 1) {
                tile_block(2, qs + i, w.m + i, w.l + i, kc, vc, j, r0[i], r1[i], head_dim, scale, cap, kvt);
                i += 2;
            } else {
                tile_block(1, qs + i, w.m + i, w.l + i, kc, vc, j, r0[i], r1[i], head_dim, scale, cap, kvt);
                i++;
            }
        }
    }
    bl_attend_sinks(qs, nq, w.m, w.l, exp1);
    bl_attend_finish(qs, nq, head_dim, w.l);
}

BL_ATTEND_TIER(bl_attend_avx2, 8, bl_attend_scalar)
