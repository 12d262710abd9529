/* AVX2+FMA kernels of ops.h. Compiled for that target only; called when bl_isa() says so. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "ops.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x, about 2 ulp, for x in [-87.3, 88.7] (clamped outside; so never exactly 0 or inf) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.72283f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n in two steps so n = 128 (x near the top of the range) does not overflow the exponent */
    __m256i ni = _mm256_cvtps_epi32(n);
    __m256i half = _mm256_srai_epi32(ni, 1);
    __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 p2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

static inline float exp1(float x) {
    return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x)));
}

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

void bl_add_avx2(float *x, const float *y, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) x[i] += y[i];
}

static inline __attribute__((always_inline)) __m256 ld8(const void *base, size_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
               : _mm256_loadu_ps((const float *)base + i);
}

/* One query against one tile of keys [k0, k1): scores, online-softmax update, values. */
static inline __attribute__((always_inline)) void attend_tile(const float *q, float *acc, float *m, float *l,
                                                              const void *kc, size_t kt, const void *vc, size_t vt,
                                                              int k0, int k1, int head_dim, float scale, int f16) {
    enum { KT = BL_KV_TILE };
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, s4 = s0, s5 = s0, s6 = s0, s7 = s0;
    for (int d = 0; d < head_dim; d++) {
        const __m256 qd = _mm256_broadcast_ss(q + d);
        const size_t kr = kt + (size_t)d * KT;
        s0 = _mm256_fmadd_ps(qd, ld8(kc, kr, f16), s0);
        s1 = _mm256_fmadd_ps(qd, ld8(kc, kr + 8, f16), s1);
        s2 = _mm256_fmadd_ps(qd, ld8(kc, kr + 16, f16), s2);
        s3 = _mm256_fmadd_ps(qd, ld8(kc, kr + 24, f16), s3);
        s4 = _mm256_fmadd_ps(qd, ld8(kc, kr + 32, f16), s4);
        s5 = _mm256_fmadd_ps(qd, ld8(kc, kr + 40, f16), s5);
        s6 = _mm256_fmadd_ps(qd, ld8(kc, kr + 48, f16), s6);
        s7 = _mm256_fmadd_ps(qd, ld8(kc, kr + 56, f16), s7);
    }
    __m256 s[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_set1_epi32(k0 - 1), hi = _mm256_set1_epi32(k1);
    __m256 valid[8];
    __m256 vmax = ninf;
    for (int b = 0; b < 8; b++) {
        const __m256i kk = _mm256_add_epi32(iota, _mm256_set1_epi32(8 * b));
        valid[b] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(hi, kk), _mm256_cmpgt_epi32(kk, lo)));
        s[b] = _mm256_blendv_ps(ninf, _mm256_mul_ps(s[b], vscale), valid[b]);
        vmax = _mm256_max_ps(vmax, s[b]);
    }
    const float mt = hmax8(vmax);
    const float mn = mt > *m ? mt : *m;
    const float corr = exp1(*m - mn); /* first tile: m = -inf, clamped: a tiny factor times acc = 0 */
    const __m256 vmn = _mm256_set1_ps(mn);
    _Alignas(32) float p[KT];
    for (int b = 0; b < 8; b++) {
        s[b] = _mm256_and_ps(exp8(_mm256_sub_ps(s[b], vmn)), valid[b]);
        _mm256_store_ps(p + 8 * b, s[b]);
    }
    const float sum = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[0], s[1]), _mm256_add_ps(s[2], s[3])),
                                          _mm256_add_ps(_mm256_add_ps(s[4], s[5]), _mm256_add_ps(s[6], s[7]))));
    *l = *l * corr + sum;
    *m = mn;
    const __m256 vcorr = _mm256_set1_ps(corr);
    for (int d0 = 0; d0 < head_dim; d0 += 64) {
        const int nd = head_dim - d0 < 64 ? (head_dim - d0) / 8 : 8;
        __m256 a[8];
        for (int u = 0; u < nd; u++) a[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * u), vcorr);
        if (nd == 8) {
            for (int k = k0; k < k1; k++) {
                const __m256 pk = _mm256_broadcast_ss(p + k);
                const size_t vr = vt + (size_t)k * head_dim + d0;
                a[0] = _mm256_fmadd_ps(pk, ld8(vc, vr, f16), a[0]);
                a[1] = _mm256_fmadd_ps(pk, ld8(vc, vr + 8, f16), a[1]);
                a[2] = _mm256_fmadd_ps(pk, ld8(vc, vr + 16, f16), a[2]);
                a[3] = _mm256_fmadd_ps(pk, ld8(vc, vr + 24, f16), a[3]);
                a[4] = _mm256_fmadd_ps(pk, ld8(vc, vr + 32, f16), a[4]);
                a[5] = _mm256_fmadd_ps(pk, ld8(vc, vr + 40, f16), a[5]);
                a[6] = _mm256_fmadd_ps(pk, ld8(vc, vr + 48, f16), a[6]);
                a[7] = _mm256_fmadd_ps(pk, ld8(vc, vr + 56, f16), a[7]);
            }
        } else {
            for (int k = k0; k < k1; k++) {
                const __m256 pk = _mm256_broadcast_ss(p + k);
                const size_t vr = vt + (size_t)k * head_dim + d0;
                for (int u = 0; u < nd; u++) a[u] = _mm256_fmadd_ps(pk, ld8(vc, vr + 8 * u, f16), a[u]);
            }
        }
        for (int u = 0; u < nd; u++) _mm256_storeu_ps(acc + d0 + 8 * u, a[u]);
    }
}

static inline __attribute__((always_inline)) void attend(const bl_attn_query *qs, int nq, const void *kc,
                                                         const void *vc, int head_dim, float scale, int f16) {
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
            attend_tile(qs[i].q, qs[i].out, &m[i], &l[i], kc, kt, vc, vt, k0, k1, head_dim, scale, f16);
        }
    }
    for (int i = 0; i < nq; i++) {
        const __m256 inv = _mm256_set1_ps(1.0f / l[i]);
        for (int d = 0; d < head_dim; d += 8)
            _mm256_storeu_ps(qs[i].out + d, _mm256_mul_ps(_mm256_loadu_ps(qs[i].out + d), inv));
    }
}

void bl_attend_avx2(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,
                    int kv_f16) {
    if (head_dim % 8) bl_attend_scalar(qs, nq, kc, vc, head_dim, scale, kv_f16);
    else if (kv_f16) attend(qs, nq, kc, vc, head_dim, scale, 1);
    else attend(qs, nq, kc, vc, head_dim, scale, 0);
}
