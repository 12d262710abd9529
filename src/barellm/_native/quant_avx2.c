/* AVX2/FMA kernels (placeholder: the scalar reference until the SIMD loops land). */
#include "quant_internal.h"

void bl_quantize_act_avx2(const bl_matrix *w, const float *x, size_t x_stride, int T, void *out) {
    bl_quantize_act_scalar(w, x, x_stride, T, out);
}

void bl_matmul_avx2(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    bl_matmul_scalar(w, xq, T, out, ldo, r0, r1);
}
