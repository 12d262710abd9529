/* The walk over a KV head's tiles that every tier's bl_attend (ops.h) makes around its own tile kernels:
 * the same tiles, and in each the same key range per query, whatever the tier. Include after the file's
 * `#pragma GCC target`, if any. */
#ifndef BL_ATTEND_H
#define BL_ATTEND_H

#include <math.h>
#include <string.h>

#include "ops.h"

/* The walk over the tiles some query visits, in order: per query its online-softmax state (running max m, sum
 * l) and, in the current tile j, its keys [r0, r1) (r1 <= r0: none there). */
typedef struct {
    int j, tiles;
    float m[BL_ATT_MAXQ], l[BL_ATT_MAXQ];
    int r0[BL_ATT_MAXQ], r1[BL_ATT_MAXQ];
} bl_attend_walk;

/* Before the first tile: m = -inf, l = 0 and out = 0 for each query. */
static inline __attribute__((always_inline)) void bl_attend_begin(bl_attend_walk *w, const bl_attn_query *qs,
                                                                  int nq, int head_dim) {
    enum { KT = BL_KV_TILE };
    int first = 1 << 30;
    w->tiles = 0;
    for (int i = 0; i < nq; i++) {
        w->m[i] = -INFINITY;
        w->l[i] = 0;
        memset(qs[i].out, 0, sizeof(float) * head_dim);
        if (qs[i].pos / KT + 1 > w->tiles) w->tiles = qs[i].pos / KT + 1;
        if (qs[i].lo / KT < first) first = qs[i].lo / KT;
    }
    w->j = first - 1;
}

/* On to the next tile and each query's keys there; 0 when the walk is over. */
static inline __attribute__((always_inline)) int bl_attend_next(bl_attend_walk *w, const bl_attn_query *qs, int nq) {
    enum { KT = BL_KV_TILE };
    const int j = ++w->j;
    if (j >= w->tiles) return 0;
    for (int i = 0; i < nq; i++) {
        const int pos = qs[i].pos, lo = qs[i].lo;
        w->r0[i] = lo > j * KT ? lo - j * KT : 0;
        w->r1[i] = pos - j * KT + 1 < KT ? pos - j * KT + 1 : KT;
        if (pos < j * KT || lo >= (j + 1) * KT) w->r1[i] = 0; /* not in this tile */
    }
    return 1;
}

/* Each query's sink (bl_attn_query), exp(sink - m) in the tier's exp, added to its softmax sum after the last
 * tile, when the running max m is final. */
static inline __attribute__((always_inline)) void bl_attend_sinks(const bl_attn_query *qs, int nq, const float *m,
                                                                  float *l, float (*exp_fn)(float)) {
    for (int i = 0; i < nq; i++)
        if (qs[i].sink > -INFINITY) l[i] += exp_fn(qs[i].sink - m[i]);
}

/* Each query's output divided by its softmax sum: out *= 1 / l (a product per value, so any vector width
 * gives the same bits). */
static inline __attribute__((always_inline)) void bl_attend_finish(const bl_attn_query *qs, int nq, int head_dim,
                                                                   const float *l) {
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / l[i];
        for (int d = 0; d < head_dim; d++) qs[i].out[d] *= inv;
    }
}

/* tanh(x), within 1.5 ulp, on a vector of any width (the soft-capped scores of the SIMD tiers), one body for
 * every width as BL_DEFINE_EXP (avx2/simd.h) is, so that the tiers give the same bits lane for lane. P is the
 * intrinsics' prefix, EXP that width's exp, LT_SELECT(a, b, x, y) x where a < b else y. For |x| < 0.625
 * Cephes' odd polynomial x + x^3 P(x^2) (no cancellation near 0), beyond 1 - 2 / (e^(2|x|) + 1); the sign
 * put back. The max(e, 1) changes no value (e^(2|x|) >= 1) but keeps exp's last product apart from the add
 * after it, which the compiler could otherwise fuse into an fma (and then maybe at one width only). */
#define BL_DEFINE_TANH(QUAL, name, V, P, EXP, LT_SELECT)                                                   \
    QUAL V name(V x) {                                                                                    \
        const V sign = P##_set1_ps(-0.0f), one = P##_set1_ps(1.0f);                                       \
        const V a = P##_andnot_ps(sign, x), z = P##_mul_ps(a, a);                                         \
        V y = P##_set1_ps(-5.70498872745e-3f);                                                            \
        y = P##_fmadd_ps(y, z, P##_set1_ps(2.06390887954e-2f));                                           \
        y = P##_fmadd_ps(y, z, P##_set1_ps(-5.37397155531e-2f));                                          \
        y = P##_fmadd_ps(y, z, P##_set1_ps(1.33314422036e-1f));                                           \
        y = P##_fmadd_ps(y, z, P##_set1_ps(-3.33332819422e-1f));                                          \
        const V small = P##_fmadd_ps(P##_mul_ps(y, z), a, a);                                             \
        const V e = P##_max_ps(EXP(P##_add_ps(a, a)), one);                                               \
        const V large = P##_sub_ps(one, P##_div_ps(P##_set1_ps(2.0f), P##_add_ps(e, one)));               \
        return P##_or_ps(LT_SELECT(a, P##_set1_ps(0.625f), small, large), P##_and_ps(sign, x));           \
    }

/* A SIMD tier's bl_attend (ops.h), `name`: the file's attend(qs, nq, kc, vc, head_dim, scale, cap, kv_type)
 * with the cache type and whether scores are capped constants, so that each gets loops of its own (and the
 * uncapped ones no tanh); a head_dim that is not a multiple of the tier's vector width goes to the tier
 * below. */
#define BL_ATTEND_TIER(name, width, below)                                                                   \
    void name(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,     \
              float cap, int kv_type) {                                                                      \
        if (head_dim % (width)) below(qs, nq, kc, vc, head_dim, scale, cap, kv_type);                        \
        else if (cap != 0) {                                                                                 \
            if (kv_type == BL_KV_Q8_0) attend(qs, nq, kc, vc, head_dim, scale, cap, BL_KV_Q8_0);             \
            else if (kv_type == BL_KV_F16) attend(qs, nq, kc, vc, head_dim, scale, cap, BL_KV_F16);          \
            else attend(qs, nq, kc, vc, head_dim, scale, cap, BL_KV_F32);                                    \
        } else if (kv_type == BL_KV_Q8_0) attend(qs, nq, kc, vc, head_dim, scale, 0.0f, BL_KV_Q8_0);        \
        else if (kv_type == BL_KV_F16) attend(qs, nq, kc, vc, head_dim, scale, 0.0f, BL_KV_F16);            \
        else attend(qs, nq, kc, vc, head_dim, scale, 0.0f, BL_KV_F32);                                      \
    }

#endif
