/* AVX-512 attention (ops.h's bl_attend), the same bits as the avx2 tier's: the engine's greedy output must
 * not depend on the tier. Per query every float operation of avx2/ops.c is kept, in its order: the score
 * chains over d, the online-softmax update of each 64-key tile (exp8's and, for soft-capped scores, tanh8's
 * polynomials lane for lane, the tile's sum in avx2's tree), the value chains over keys from acc * corr, the
 * sink's exp1, the final 1 / l. What changes is how much is done per load: a tile's 64 keys are 4 zmm, 16
 * output values a zmm, and up to 4 queries with the same key range in a tile share each K and V load (the
 * avx2 kernel pairs at most 2 neighbours). A q8_0 cache (ops.h) keeps avx2's q8_0 order the same way. */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "attend.h"
#include "ops.h"
#include "avx2/simd.h"

#define ALWAYS static inline __attribute__((always_inline))
#define QMAX 4 /* queries per block: 4 x 4 score or value accumulators + 4 K or V vectors fit in 32 zmm */

/* avx2/simd.h's exp8 on 16 lanes */
BL_DEFINE_EXP(ALWAYS, exp16, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps)

ALWAYS __m512 lt_select16(__m512 a, __m512 b, __m512 x, __m512 y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), y, x);
}

/* attend.h's tanh on 16 lanes, tanh8's operations lane for lane */
BL_DEFINE_TANH(ALWAYS, tanh16, __m512, _mm512, exp16, lt_select16)

ALWAYS __m512 ld16(const void *base, size_t i, int f16) {
    return f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i)))
               : _mm512_loadu_ps((const float *)base + i);
}

/* One block: QB queries with the same key range [k0, k1) in a tile. */
typedef struct blk {
    const float *q[QMAX];
    float *out[QMAX], *m[QMAX], *l[QMAX];
} blk;

/* Scores of the block's queries against the tile's keys [0, 16 NC), unscaled, into s[i * KT + k]: each an
 * fma chain over d = 0 .. head_dim - 1, as in avx2's qk_pass. */
ALWAYS void qk_pass(int QB, int NC, const blk *b, const void *kc, size_t kt, int head_dim, int f16, float *s) {
    enum { KT = BL_KV_TILE };
    __m512 a[QMAX][4];
    for (int i = 0; i < QB; i++)
        for (int c = 0; c < NC; c++) a[i][c] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        const size_t kr = kt + (size_t)d * KT;
        __m512 k[4];
        for (int c = 0; c < NC; c++) k[c] = ld16(kc, kr + 16 * c, f16);
        for (int i = 0; i < QB; i++) {
            const __m512 qd = _mm512_set1_ps(b->q[i][d]);
            for (int c = 0; c < NC; c++) a[i][c] = _mm512_fmadd_ps(qd, k[c], a[i][c]);
        }
    }
    for (int i = 0; i < QB; i++)
        for (int c = 0; c < NC; c++) _mm512_store_ps(s + i * KT + 16 * c, a[i][c]);
}

/* avx2's softmax_tile on 4 zmm: s (scores) becomes p, 0 outside [k0, k1), the scaled scores soft-capped
 * where cap != 0; returns the rescale factor. The masked ops (mask_mul, maskz_mov) are builtins, not plain
 * vector arithmetic, so the compiler cannot fuse the scale (or cap) multiply or exp's last multiply with the
 * subtract and adds that follow. */
ALWAYS float softmax_tile(float *s, float *m, float *l, int k0, int k1, float scale, float cap) {
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY), vcap = _mm512_set1_ps(cap);
    /* keys [k0, k1) of the tile as a 64-bit mask, 16 bits per zmm */
    const uint64_t below_hi = k1 >= 64 ? ~0ull : (1ull << k1) - 1, below_lo = (1ull << k0) - 1;
    const uint64_t valid = below_hi & ~below_lo;
    __m512 v[4];
    __mmask16 vm[4];
    for (int c = 0; c < 4; c++) {
        vm[c] = (__mmask16)(valid >> (16 * c));
        if (cap != 0) /* avx2's cap * tanh(s * scale / cap), the last product masked */
            v[c] = _mm512_mask_mul_ps(ninf, vm[c], vcap,
                                      tanh16(_mm512_div_ps(_mm512_mul_ps(_mm512_load_ps(s + 16 * c), vscale), vcap)));
        else v[c] = _mm512_mask_mul_ps(ninf, vm[c], _mm512_load_ps(s + 16 * c), vscale);
    }
    const __m512 vmax = _mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3]));
    const float mt = hmax8(_mm256_max_ps(_mm512_castps512_ps256(vmax), _mm512_extractf32x8_ps(vmax, 1)));
    const float mn = mt > *m ? mt : *m;
    const float corr = exp1(*m - mn); /* first tile: m = -inf, clamped: a tiny factor times acc = 0 */
    const __m512 vmn = _mm512_set1_ps(mn);
    for (int c = 0; c < 4; c++) {
        v[c] = _mm512_maskz_mov_ps(vm[c], exp16(_mm512_sub_ps(v[c], vmn)));
        _mm512_store_ps(s + 16 * c, v[c]);
    }
    /* avx2 adds its 8-key vectors v0..v7 as ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)); here zmm c
     * holds v(2c) | v(2c+1), so the halves are regrouped to add the same pairs in the same tree */
    const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(1, 0, 1, 0)),  /* v0 | v2 */
                                     _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 2, 3, 2))); /* v1 | v3 */
    const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_f32x4(v[2], v[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(3, 2, 3, 2)));
    const float sum = hsum8(_mm256_add_ps(_mm512_castps512_ps256(q), _mm512_extractf32x8_ps(q, 1)));
    *l = fmaf(*l, corr, sum);
    *m = mn;
    return corr;
}

/* acc_i = acc_i * corr_i + sum over k in [k0, k1) of p_i[k] * V[k]: per output value an fma chain over k in
 * order, as in avx2's pv_pass; DV zmm of output values at a time. */
ALWAYS void pv_block(int QB, int DV, const blk *b, const float *p, const float *corr, const void *vc, size_t vt,
                     int d0, int k0, int k1, int head_dim, int f16) {
    enum { KT = BL_KV_TILE };
    __m512 a[QMAX][4];
    for (int i = 0; i < QB; i++) {
        const __m512 c = _mm512_set1_ps(corr[i]);
        for (int u = 0; u < DV; u++) a[i][u] = _mm512_mul_ps(_mm512_loadu_ps(b->out[i] + d0 + 16 * u), c);
    }
    for (int k = k0; k < k1; k++) {
        const size_t vr = vt + (size_t)k * head_dim + d0;
        __m512 v[4];
        for (int u = 0; u < DV; u++) v[u] = ld16(vc, vr + 16 * u, f16);
        for (int i = 0; i < QB; i++) {
            const __m512 pk = _mm512_set1_ps(p[i * KT + k]);
            for (int u = 0; u < DV; u++) a[i][u] = _mm512_fmadd_ps(pk, v[u], a[i][u]);
        }
    }
    for (int i = 0; i < QB; i++)
        for (int u = 0; u < DV; u++) _mm512_storeu_ps(b->out[i] + d0 + 16 * u, a[i][u]);
}

ALWAYS __m512 ld16_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* avx2's qk_pass_q8 on the tile's keys [0, 16 NC): per 32-value block an fma chain over its int8 keys, then
 * s = fma(chain, key scale, s) */
ALWAYS void qk_pass_q8(int QB, int NC, const blk *b, const uint8_t *tile, int head_dim, float *s) {
    enum { KT = BL_KV_TILE };
    const int8_t *kq = (const int8_t *)tile;
    const uint16_t *kd = (const uint16_t *)(tile + (size_t)KT * head_dim);
    for (int i = 0; i < QB; i++)
        for (int c = 0; c < NC; c++) _mm512_store_ps(s + i * KT + 16 * c, _mm512_setzero_ps());
    for (int bk = 0; bk < head_dim / BL_KV_QK; bk++) {
        __m512 a[QMAX][4];
        for (int i = 0; i < QB; i++)
            for (int c = 0; c < NC; c++) a[i][c] = _mm512_setzero_ps();
        for (int d = bk * BL_KV_QK; d < (bk + 1) * BL_KV_QK; d++) {
            const int8_t *kr = kq + (size_t)d * KT;
            __m512 k[4];
            for (int c = 0; c < NC; c++) k[c] = ld16_i8(kr + 16 * c);
            for (int i = 0; i < QB; i++) {
                const __m512 qd = _mm512_set1_ps(b->q[i][d]);
                for (int c = 0; c < NC; c++) a[i][c] = _mm512_fmadd_ps(qd, k[c], a[i][c]);
            }
        }
        for (int c = 0; c < NC; c++) {
            const __m512 dk = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(kd + bk * KT + 16 * c)));
            for (int i = 0; i < QB; i++) {
                float *si = s + i * KT + 16 * c;
                _mm512_store_ps(si, _mm512_fmadd_ps(a[i][c], dk, _mm512_load_ps(si)));
            }
        }
    }
}

/* avx2's pv_pass_q8, DB blocks of 32 output values (2 zmm each) at a time */
ALWAYS void pv_block_q8(int QB, int DB, const blk *b, const float *p, const float *corr, const uint8_t *vtile,
                        int d0, int k0, int k1, int head_dim) {
    enum { KT = BL_KV_TILE };
    const size_t rb = bl_kv_row_bytes(head_dim, BL_KV_Q8_0);
    __m512 a[QMAX][4];
    for (int i = 0; i < QB; i++) {
        const __m512 c = _mm512_set1_ps(corr[i]);
        for (int u = 0; u < 2 * DB; u++) a[i][u] = _mm512_mul_ps(_mm512_loadu_ps(b->out[i] + d0 + 16 * u), c);
    }
    for (int k = k0; k < k1; k++) {
        const uint8_t *row = vtile + (size_t)k * rb;
        const int8_t *vr = (const int8_t *)row + d0;
        const uint16_t *vd = (const uint16_t *)(row + head_dim) + d0 / BL_KV_QK;
        __m512 v[4];
        for (int u = 0; u < 2 * DB; u++) v[u] = ld16_i8(vr + 16 * u);
        float dv[2];
        for (int e = 0; e < DB; e++) dv[e] = bl_half_to_float(vd[e]);
        for (int i = 0; i < QB; i++)
            for (int e = 0; e < DB; e++) {
                const __m512 pk = _mm512_set1_ps(p[i * KT + k] * dv[e]);
                a[i][2 * e] = _mm512_fmadd_ps(pk, v[2 * e], a[i][2 * e]);
                a[i][2 * e + 1] = _mm512_fmadd_ps(pk, v[2 * e + 1], a[i][2 * e + 1]);
            }
    }
    for (int i = 0; i < QB; i++)
        for (int u = 0; u < 2 * DB; u++) _mm512_storeu_ps(b->out[i] + d0 + 16 * u, a[i][u]);
}

ALWAYS void tile_block(int QB, const blk *b, const void *kc, const void *vc, int j, int k0, int k1, int head_dim,
                       float scale, float cap, int kvt) {
    enum { KT = BL_KV_TILE };
    _Alignas(64) float s[QMAX * KT];
    float corr[QMAX];
    const int f16 = kvt == BL_KV_F16;
    const size_t kt = (size_t)j * head_dim * KT, vt = (size_t)j * KT * head_dim;
    const size_t tb = (size_t)j * KT * bl_kv_row_bytes(head_dim, kvt); /* the tile's byte offset (q8_0) */
    const int NC = k1 > 32 ? 4 : 2; /* keys past 32 are masked below: as avx2, their scores are not computed */
    if (kvt == BL_KV_Q8_0) {
        if (NC == 4) qk_pass_q8(QB, 4, b, (const uint8_t *)kc + tb, head_dim, s);
        else qk_pass_q8(QB, 2, b, (const uint8_t *)kc + tb, head_dim, s);
    } else if (NC == 4) qk_pass(QB, 4, b, kc, kt, head_dim, f16, s);
    else qk_pass(QB, 2, b, kc, kt, head_dim, f16, s);
    if (NC == 2)
        for (int i = 0; i < QB; i++) memset(s + i * KT + 32, 0, 32 * sizeof(float));
    for (int i = 0; i < QB; i++) corr[i] = softmax_tile(s + i * KT, b->m[i], b->l[i], k0, k1, scale, cap);
    int d0 = 0;
    if (kvt == BL_KV_Q8_0) {
        const uint8_t *vtile = (const uint8_t *)vc + tb;
        for (; d0 + 64 <= head_dim; d0 += 64) pv_block_q8(QB, 2, b, s, corr, vtile, d0, k0, k1, head_dim);
        for (; d0 < head_dim; d0 += 32) pv_block_q8(QB, 1, b, s, corr, vtile, d0, k0, k1, head_dim);
        return;
    }
    for (; d0 + 64 <= head_dim; d0 += 64) pv_block(QB, 4, b, s, corr, vc, vt, d0, k0, k1, head_dim, f16);
    for (; d0 < head_dim; d0 += 16) pv_block(QB, 1, b, s, corr, vc, vt, d0, k0, k1, head_dim, f16);
}

ALWAYS void attend(const bl_attn_query *qs, int nq, const void *kc, const void *vc, int head_dim, float scale,
                   float cap, int kvt) {
    bl_attend_walk w;
    for (bl_attend_begin(&w, qs, nq, head_dim); bl_attend_next(&w, qs, nq);) {
        const int j = w.j, *r0 = w.r0, *r1 = w.r1;
        /* blocks of up to QMAX queries with one key range, neighbours or not: a block only shares loads,
         * each query's operations are its own */
        unsigned todo = 0;
        for (int i = 0; i < nq; i++)
            if (r1[i] > r0[i]) todo |= 1u << i;
        while (todo) {
            const int i0 = __builtin_ctz(todo);
            blk b;
            int n = 0;
            for (unsigned t = todo; t && n < QMAX; t &= t - 1) {
                const int i = __builtin_ctz(t);
                if (r0[i] != r0[i0] || r1[i] != r1[i0]) continue;
                b.q[n] = qs[i].q;
                b.out[n] = qs[i].out;
                b.m[n] = w.m + i;
                b.l[n] = w.l + i;
                n++;
                todo &= ~(1u << i);
            }
            switch (n) {
            case 1: tile_block(1, &b, kc, vc, j, r0[i0], r1[i0], head_dim, scale, cap, kvt); break;
            case 2: tile_block(2, &b, kc, vc, j, r0[i0], r1[i0], head_dim, scale, cap, kvt); break;
            case 3: tile_block(3, &b, kc, vc, j, r0[i0], r1[i0], head_dim, scale, cap, kvt); break;
            default: tile_block(4, &b, kc, vc, j, r0[i0], r1[i0], head_dim, scale, cap, kvt); break;
            }
        }
    }
    bl_attend_sinks(qs, nq, w.m, w.l, exp1);
    bl_attend_finish(qs, nq, head_dim, w.l);
}

BL_ATTEND_TIER(bl_attend_avx512, 16, bl_attend_avx2)
