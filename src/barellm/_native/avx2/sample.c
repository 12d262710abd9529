/* AVX2 kernels of sample.h: the passes over a whole row of logits. Compiled for that target only; called
 * when bl_isa() says so. argmax and top-m give exactly the scalar results; sums of exponentials use a float
 * exp (about 2 ulp) summed in double, so they differ from the scalar ones in the last bits. */
#pragma GCC target("avx2,fma")
#include <immintrin.h>
#include <math.h>

#include "sample.h"
#include "avx2/simd.h"

/* the 8 allowed-mask bits of tokens i..i+7 (i a multiple of 8) */
static inline unsigned mask8(const uint32_t *allowed, int i) {
    return allowed ? (allowed[i >> 5] >> (i & 31)) & 0xFFu : 0xFFu;
}

static inline __m256 lanes_of(unsigned bits) {
    const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), sel), sel));
}

int bl_argmax_avx2(const float *x, int n, const uint32_t *allowed) {
    /* two passes: the largest allowed value (four independent maxima; NaN lanes keep the old value), then
     * the first allowed index holding it */
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
    int i = 0;
    if (!allowed) {
        for (; i + 32 <= n; i += 32) {
            m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
            m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
            m2 = _mm256_max_ps(_mm256_loadu_ps(x + i + 16), m2);
            m3 = _mm256_max_ps(_mm256_loadu_ps(x + i + 24), m3);
        }
    }
    for (; i + 8 <= n; i += 8) {
        unsigned bits = mask8(allowed, i);
        if (!bits) continue;
        __m256 v = _mm256_loadu_ps(x + i);
        if (bits != 0xFFu) v = _mm256_blendv_ps(ninf, v, lanes_of(bits));
        m0 = _mm256_max_ps(v, m0);
    }
    float t[8], best = -INFINITY;
    _mm256_storeu_ps(t, _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    for (int l = 0; l < 8; l++) best = t[l] > best ? t[l] : best;
    for (; i < n; i++)
        if (x[i] > best && bl_allowed(allowed, i)) best = x[i];
    if (best == -INFINITY) { /* every allowed value -inf or NaN: the first allowed, as the scalar path */
        for (i = 0; i < n; i++)
            if (bl_allowed(allowed, i)) return i;
        return -1;
    }
    const __m256 b = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), b, _CMP_EQ_OQ));
        bits &= mask8(allowed, i);
        if (bits) return i + __builtin_ctz(bits);
    }
    for (; i < n; i++)
        if (x[i] == best && bl_allowed(allowed, i)) return i;
    return -1; /* not reached */
}

int bl_top_avx2(const float *x, int n, const uint32_t *allowed, int m, bl_cand *h) {
    bl_heap_init(h, m);
    float thr = -INFINITY;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        /* most blocks hold nothing above the threshold: one test for 32 values */
        const __m256 t = _mm256_set1_ps(thr);
        __m256 c0 = _mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_GT_OQ);
        __m256 c1 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), t, _CMP_GT_OQ);
        __m256 c2 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), t, _CMP_GT_OQ);
        __m256 c3 = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), t, _CMP_GT_OQ);
        if (_mm256_testz_ps(_mm256_or_ps(_mm256_or_ps(c0, c1), _mm256_or_ps(c2, c3)),
                            _mm256_castsi256_ps(_mm256_set1_epi32(-1))))
            continue;
        uint32_t bits = (uint32_t)_mm256_movemask_ps(c0) | (uint32_t)_mm256_movemask_ps(c1) << 8 |
                        (uint32_t)_mm256_movemask_ps(c2) << 16 | (uint32_t)_mm256_movemask_ps(c3) << 24;
        if (allowed) bits &= allowed[i >> 5];
        while (bits) {
            int j = __builtin_ctz(bits);
            bits &= bits - 1;
            if (x[i + j] > thr) thr = bl_heap_replace(h, m, x[i + j], i + j);
        }
    }
    for (; i < n; i++)
        if (x[i] > thr && bl_allowed(allowed, i)) thr = bl_heap_replace(h, m, x[i], i);
    return bl_heap_finish(h, m);
}

static inline __m256d widen_lo(__m256 v) { return _mm256_cvtps_pd(_mm256_castps256_ps128(v)); }
static inline __m256d widen_hi(__m256 v) { return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)); }

double bl_sum_exp_avx2(const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo) {
    const __m256 r = _mm256_set1_ps(ref), s = _mm256_set1_ps(scale), l = _mm256_set1_ps(lo);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        unsigned bits = mask8(allowed, i), bits2 = mask8(allowed, i + 8);
        if (!(bits | bits2)) continue;
        __m256 v = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        __m256 kv = _mm256_cmp_ps(v, l, _CMP_GE_OQ), kw = _mm256_cmp_ps(w, l, _CMP_GE_OQ);
        if (bits != 0xFFu) kv = _mm256_and_ps(kv, lanes_of(bits));
        if (bits2 != 0xFFu) kw = _mm256_and_ps(kw, lanes_of(bits2));
        __m256 ev = _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(v, r), s)), kv);
        __m256 ew = _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(w, r), s)), kw);
        a0 = _mm256_add_pd(a0, widen_lo(ev));
        a1 = _mm256_add_pd(a1, widen_hi(ev));
        a2 = _mm256_add_pd(a2, widen_lo(ew));
        a3 = _mm256_add_pd(a3, widen_hi(ew));
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    double sum = (t[0] + t[1]) + (t[2] + t[3]);
    for (; i < n; i++)
        if (x[i] >= lo && bl_allowed(allowed, i)) sum += exp(((double)x[i] - ref) * scale);
    return sum;
}

float bl_row_max_avx2(const float *x, int n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(x + i));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(x + i + 8));
    }
    float t[8], m = -INFINITY;
    _mm256_storeu_ps(t, _mm256_max_ps(m0, m1));
    for (int l = 0; l < 8; l++) m = t[l] > m ? t[l] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}
