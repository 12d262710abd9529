/* AVX2 matmuls of Q4_0, Q4_1 and Q8_0 weights in GGUF's own row order (BL_LAYOUT_ROWS, the file's mapping as
 * it is): 8 rows at a time, one token at a time, the float work in the scalar path's order
 * (quant_internal.h). The interleaved layout's tiles (avx2/quant.c) are the fast path. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_internal.h"
#include "avx2/simd.h"

#define AI static inline __attribute__((always_inline))

/* lane l = the sum of the 8 int32 lanes of v[l] */
AI __m256i hsum8_epi32(const __m256i *v) {
    const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

AI __m256 f16x8(const uint8_t *const *p, size_t off) {
    return _mm256_cvtph_ps(_mm_setr_epi16((short)bl_rd16(p[0] + off), (short)bl_rd16(p[1] + off),
                                          (short)bl_rd16(p[2] + off), (short)bl_rd16(p[3] + off),
                                          (short)bl_rd16(p[4] + off), (short)bl_rd16(p[5] + off),
                                          (short)bl_rd16(p[6] + off), (short)bl_rd16(p[7] + off)));
}

AI void rows8_quant(const int type, const int x2, const uint8_t *const *p, const int nb, const bl_act_q8 a,
                    float *o, const int nvalid) {
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i khi = x2 ? _mm256_set1_epi16(254) : ones; /* the weight of the (hi) plane */
    const size_t bb = type == BL_Q8_0 ? 34 : type == BL_Q4_1 ? 20 : 18, hdr = type == BL_Q4_1 ? 4 : 2;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a.qs + b * 32));
        const __m256i xl = x2 ? _mm256_loadu_si256((const __m256i *)(a.lo + b * 32)) : x;
        const size_t off = (size_t)b * bb;
        __m256i s[8];
        for (int l = 0; l < 8; l++) {
            if (type == BL_Q8_0) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p[l] + off + hdr)), av = _mm256_abs_epi8(v);
                s[l] = _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(x, v)), khi);
                if (x2)
                    s[l] = _mm256_add_epi32(s[l], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(xl, v)), ones));
            } else {
                const __m128i v = _mm_loadu_si128((const __m128i *)(p[l] + off + hdr));
                const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4);
                s[l] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), khi);
                if (x2) s[l] = _mm256_add_epi32(s[l], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xl), ones));
            }
        }
        __m256i i32 = hsum8_epi32(s);
        if (type == BL_Q4_0) i32 = _mm256_sub_epi32(i32, _mm256_set1_epi32(8 * a.sq[b]));
        const __m256 scale = _mm256_mul_ps(f16x8(p, off), _mm256_set1_ps(a.d[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), scale, acc);
        if (type == BL_Q4_1) accm = _mm256_fmadd_ps(f16x8(p, off + 2), _mm256_set1_ps(a.s[b]), accm);
    }
    store8(o, type == BL_Q4_1 ? _mm256_add_ps(acc, accm) : acc, nvalid);
}

/* a type's kernels for both activation types */
#define ROWS8_FNS(name, type)                                                                            \
    static void name(const uint8_t *const *p, int nb, bl_act_q8 a, float *o, int n) {                    \
        rows8_quant(type, 0, p, nb, a, o, n);                                                            \
    }                                                                                                    \
    static void name##x2(const uint8_t *const *p, int nb, bl_act_q8 a, float *o, int n) {                \
        rows8_quant(type, 1, p, nb, a, o, n);                                                            \
    }
ROWS8_FNS(rows8_q40, BL_Q4_0)
ROWS8_FNS(rows8_q41, BL_Q4_1)
ROWS8_FNS(rows8_q80, BL_Q8_0)

AI void matmul_rows_quant(const int type, const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0,
                          int r1) {
    const int x2 = w->act == BL_ACT_Q8X2;
    void (*fn)(const uint8_t *const *, int, bl_act_q8, float *, int) =
        type == BL_Q4_0 ? (x2 ? rows8_q40x2 : rows8_q40) : type == BL_Q4_1 ? (x2 ? rows8_q41x2 : rows8_q41)
                                                                                  : (x2 ? rows8_q80x2 : rows8_q80);
    const int nb = w->cols / BL_QK;
    const size_t rb = bl_row_bytes(type, w->cols), xb = bl_act_row_bytes(w, w->cols);
    for (int r = r0; r < r1; r += 8) {
        const int n = r1 - r < 8 ? r1 - r : 8;
        const uint8_t *p[8];
        for (int l = 0; l < 8; l++) p[l] = (const uint8_t *)w->data + (size_t)(r + (l < n ? l : 0)) * rb;
        for (int t = 0; t < T; t++)
            fn(p, nb, bl_act_view((const uint8_t *)xq + (size_t)t * xb, w->cols, w->act), out + (size_t)t * ldo + r, n);
    }
}

void bl_mm_q4_0_rows_avx2(BL_MM_ARGS) { matmul_rows_quant(BL_Q4_0, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q4_1_rows_avx2(BL_MM_ARGS) { matmul_rows_quant(BL_Q4_1, w, xq, T, out, ldo, r0, r1); }
void bl_mm_q8_0_rows_avx2(BL_MM_ARGS) { matmul_rows_quant(BL_Q8_0, w, xq, T, out, ldo, r0, r1); }
