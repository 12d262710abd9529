/* The avx512 tier's one-token (decode) matmuls on the interleaved layout: out[r] for r in [r0, r1) from one
 * activation row xq (bl_quantize_act's). avx512/decode_kq.c. */
#ifndef BARELLM_AVX512_DECODE_H
#define BARELLM_AVX512_DECODE_H

#include "kernels.h"

void bl_decode_q4_k_avx512(const bl_matrix *w, const void *xq, float *out, int r0, int r1);
void bl_decode_q5_k_avx512(const bl_matrix *w, const void *xq, float *out, int r0, int r1);

/* xp: the activation's per-block half sums (avx512/quant_kq.c) */
void bl_decode_q6_k_avx512(const bl_matrix *w, const void *xq, const int32_t *xp, float *out, int r0, int r1);

/* MXFP4, any T (avx512/decode_mxfp4.c: the calls under the prefill kernel's) */
void bl_decode_mxfp4_avx512(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1);

#endif
