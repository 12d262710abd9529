/* The avx2 tier's table (AVX2 + FMA + F16C): every matmul, the ops and the sampler's scans. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "quant_internal.h"
#include "tier.h"

#define I8 BL_LAYOUT_INTERLEAVE8
#define ROWS BL_LAYOUT_ROWS
#define BOTH(T, t) [BL_##T] = {[ROWS] = bl_mm_##t##_avx2, [I8] = bl_mm_##t##_avx2}
/* Q4_0, Q4_1, Q8_0 read GGUF rows with kernels of their own */
#define SPLIT(T, t) [BL_##T] = {[ROWS] = bl_mm_##t##_rows_avx2, [I8] = bl_mm_##t##_avx2}

static void kv_store_avx2(void *kc, void *vc, const float *k, const float *v, int pos, int n_kv_heads, int head_dim,
                          int n_ctx, int kv_type) {
    if (kv_type == BL_KV_F16) bl_kv_store_f16_avx2(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx);
    else bl_tier_scalar.kv_store(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx, kv_type); /* f32, q8_0 */
}

static uint64_t read_sum_avx2(const uint64_t *p, size_t lo, size_t hi) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = lo; i < hi; i += 32) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 4)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 8)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 12)));
        a4 = _mm256_add_epi64(a4, _mm256_loadu_si256((const __m256i *)(p + i + 16)));
        a5 = _mm256_add_epi64(a5, _mm256_loadu_si256((const __m256i *)(p + i + 20)));
        a6 = _mm256_add_epi64(a6, _mm256_loadu_si256((const __m256i *)(p + i + 24)));
        a7 = _mm256_add_epi64(a7, _mm256_loadu_si256((const __m256i *)(p + i + 28)));
    }
    const __m256i s = _mm256_add_epi64(_mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)),
                                       _mm256_add_epi64(_mm256_add_epi64(a4, a5), _mm256_add_epi64(a6, a7)));
    return (uint64_t)_mm256_extract_epi64(s, 0) + (uint64_t)_mm256_extract_epi64(s, 1) +
           (uint64_t)_mm256_extract_epi64(s, 2) + (uint64_t)_mm256_extract_epi64(s, 3);
}

const bl_kernel_table bl_tier_avx2 = {
    .act = {[BL_ACT_Q8] = bl_act_q8_avx2, [BL_ACT_Q8X2] = bl_act_q8x2_avx2},
    .matmul = {
        [BL_F32] = {[ROWS] = bl_mm_f32_avx2},
        [BL_F16] = {[ROWS] = bl_mm_f16_avx2},
        SPLIT(Q4_0, q4_0), SPLIT(Q4_1, q4_1), SPLIT(Q8_0, q8_0),
        BOTH(Q5_0, q5_0), BOTH(Q3_K, q3_k), BOTH(Q4_K, q4_k), BOTH(Q5_K, q5_k), BOTH(Q6_K, q6_k),
        BOTH(MXFP4, mxfp4),
    },
    .rmsnorm = bl_rmsnorm_avx2, .rope = bl_rope_avx2, .softmax = bl_softmax_avx2,
    .silu_mul = bl_silu_mul_avx2, .gelu_mul = bl_gelu_mul_avx2, .add = bl_add_avx2,
    .attend = bl_attend_avx2, .kv_store = kv_store_avx2,
    .argmax = bl_argmax_avx2, .top = bl_top_avx2, .sum_exp = bl_sum_exp_avx2, .row_max = bl_row_max_avx2,
    .read_sum = read_sum_avx2,
};
