/* AVX2/FMA matmuls of float weights (F32, F16 rows): tiles of R rows x NT tokens, one 8-lane accumulator per
 * output, the float work in the scalar path's order (quant_internal.h). */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"
#include "avx2/simd.h"

#define AI static inline __attribute__((always_inline))

/* ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)), as the scalar path */
AI float hsum_ps(__m256 p) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_shuffle_ps(b, b, 1)));
}

AI __m256 loadw(const int type, const uint8_t *row, int k) {
    if (type == BL_F32) return _mm256_loadu_ps((const float *)(const void *)row + k);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + (size_t)k * 2)));
}

AI __m256 loadw_tail(const int type, const uint8_t *row, int k, int n) {
    if (type == BL_F32) return _mm256_maskload_ps((const float *)(const void *)row + k, lane_mask(n));
    uint16_t tmp[8] = {0};
    memcpy(tmp, row + (size_t)k * 2, (size_t)n * 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)tmp));
}

AI void tile_float(const int type, const int R, const int NT, const uint8_t *const *wr, const float *const *x,
                   const int cols, float *const *o /* [NT][R] */) {
    /* accumulator a<i><t> for row i, token t: separate variables so they stay in registers */
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const uint8_t *w0 = wr[0], *w1 = wr[R > 1 ? 1 : 0], *w2 = wr[R > 2 ? 2 : 0], *w3 = wr[R > 3 ? 3 : 0];
    const float *x0 = x[0], *x1 = x[NT > 1 ? 1 : 0];
#define FROW(i, LOAD)                                                                                    \
    if (R > i) {                                                                                         \
        const __m256 wv = LOAD;                                                                          \
        a##i##0 = _mm256_fmadd_ps(wv, xv0, a##i##0);                                                     \
        if (NT > 1) a##i##1 = _mm256_fmadd_ps(wv, xv1, a##i##1);                                         \
    }
    int k = 0;
    for (; k + 8 <= cols; k += 8) {
        const __m256 xv0 = _mm256_loadu_ps(x0 + k), xv1 = _mm256_loadu_ps(x1 + k);
        FROW(0, loadw(type, w0, k))
        FROW(1, loadw(type, w1, k))
        FROW(2, loadw(type, w2, k))
        FROW(3, loadw(type, w3, k))
    }
    if (k < cols) { /* zero-padded tail lanes: fma(0, 0, p) leaves p as the scalar path does */
        const int n = cols - k;
        const __m256 xv0 = _mm256_maskload_ps(x0 + k, lane_mask(n)), xv1 = _mm256_maskload_ps(x1 + k, lane_mask(n));
        FROW(0, loadw_tail(type, w0, k, n))
        FROW(1, loadw_tail(type, w1, k, n))
        FROW(2, loadw_tail(type, w2, k, n))
        FROW(3, loadw_tail(type, w3, k, n))
    }
#undef FROW
    const __m256 acc[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < R; i++) o[t][i] = hsum_ps(acc[i][t]);
}

#define FTILE_FN(name, type, R, NT)                                                                      \
    static void name(const uint8_t *const *wr, const float *const *x, int cols, float *const *o) {       \
        tile_float(type, R, NT, wr, x, cols, o);                                                         \
    }
FTILE_FN(f32_4x2, BL_F32, 4, 2)
FTILE_FN(f32_4x1, BL_F32, 4, 1)
FTILE_FN(f32_1x2, BL_F32, 1, 2)
FTILE_FN(f32_1x1, BL_F32, 1, 1)
FTILE_FN(f16_4x2, BL_F16, 4, 2)
FTILE_FN(f16_4x1, BL_F16, 4, 1)
FTILE_FN(f16_1x2, BL_F16, 1, 2)
FTILE_FN(f16_1x1, BL_F16, 1, 1)

AI void matmul_float(const int type, const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    typedef void (*fn)(const uint8_t *const *, const float *const *, int, float *const *);
    const int f16 = type == BL_F16, cols = w->cols;
    const fn fns[2][2] = {{f16 ? f16_1x1 : f32_1x1, f16 ? f16_1x2 : f32_1x2},
                          {f16 ? f16_4x1 : f32_4x1, f16 ? f16_4x2 : f32_4x2}};
    const size_t rb = bl_row_bytes(type, cols), xb = bl_act_row_bytes(w, cols);
    for (int r = r0; r < r1;) {
        const int R = r1 - r >= 4 ? 4 : 1;
        const uint8_t *wr[4];
        for (int i = 0; i < R; i++) wr[i] = (const uint8_t *)w->data + (size_t)(r + i) * rb;
        for (int t = 0; t < T;) {
            const int NT = T - t >= 2 ? 2 : 1;
            const float *x[2];
            float *o[2];
            for (int i = 0; i < NT; i++) {
                x[i] = (const float *)(const void *)((const uint8_t *)xq + (size_t)(t + i) * xb);
                o[i] = out + (size_t)(t + i) * ldo + r;
            }
            fns[R == 4][NT == 2](wr, x, cols, o);
            t += NT;
        }
        r += R;
    }
}

void bl_mm_f32_avx2(BL_MM_ARGS) { matmul_float(BL_F32, w, xq, T, out, ldo, r0, r1); }
void bl_mm_f16_avx2(BL_MM_ARGS) { matmul_float(BL_F16, w, xq, T, out, ldo, r0, r1); }
