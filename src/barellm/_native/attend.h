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

/* Each query's output divided by its softmax sum: out *= 1 / l (a product per value, so any vector width
 * gives the same bits). */
static inline __attribute__((always_inline)) void bl_attend_finish(const bl_attn_query *qs, int nq, int head_dim,
                                                                   const float *l) {
    for (int i = 0; i < nq; i++) {
        const float inv = 1.0f / l[i];
        for (int d = 0; d < head_dim; d++) qs[i].out[d] *= inv;
    }
}

/* A SIMD tier's bl_attend (ops.h), `name`: the file's attend(qs, nq, kc, vc, head_dim, scale, kv_type) with the
 * cache type a constant, so that each type gets loops of its own; a head_dim that is not a multiple of the
 * tier's vector width goes to the tier below. */
#define BL_ATTEND_TIER(name, width, below)                                                                   \
    void name(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,     \
              int kv_type) {                                                                                 \
        if (head_dim % (width)) below(qs, nq, kc, vc, head_dim, scale, kv_type);                             \
        else if (kv_type == BL_KV_Q8_0) attend(qs, nq, kc, vc, head_dim, scale, BL_KV_Q8_0);                \
        else if (kv_type == BL_KV_F16) attend(qs, nq, kc, vc, head_dim, scale, BL_KV_F16);                  \
        else attend(qs, nq, kc, vc, head_dim, scale, BL_KV_F32);                                            \
    }

#endif
