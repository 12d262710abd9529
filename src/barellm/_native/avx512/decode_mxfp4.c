/* Calls of fewer tokens than the avx512 prefill takes (decode, short verifications) for MXFP4 on the interleaved
 * layout (quant_internal.h), in the scalar path's float order (the same bits).
 *
 * The avx2 tile turns each vector's two nibble planes into values kv + 12 with a byte shuffle and sums them in
 * int16 with maddubs, which two vectors fill (24 * 127 * 16 would pass 2^15 over four), so a block costs it two
 * madds and adds on top; here one 256-bit vpdpbusd per nibble plane multiplies, widens and accumulates in int32,
 * the block's integer starting at -12 * sq[b]. 256-bit vectors: Zen 4 splits 512-bit work in two, and 256 bits
 * pair with the layout's 8-row groups as they are. One token reads two groups at once from two streams, NT <= 4
 * tokens one group (the avx2 tier's driver, avx2/tiles.h, with its software prefetch).
 */
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#include <immintrin.h>
#include <stdint.h>

#include "quant_internal.h"
#include "tier.h"
#include "avx2/simd.h"
#include "avx2/tiles.h"

#define AI static inline __attribute__((always_inline))
#define MAXNT 4

/* NG groups (2: one token from two streams) x NT tokens; x2: BL_ACT_Q8X2 activations, whose hi and lo planes'
 * sums stay apart through a block and meet as 254 * hi + lo in int32 */
AI void tile(const int NG, const int NT, const int x2, const tile_args *A) {
    const int nb = A->nu;
    const __m256i m4 = _mm256_set1_epi8(15), kv = _mm256_setr_epi8(BL_MXFP4_KV12, BL_MXFP4_KV12);
    const int hint = A->hint;
    const int8_t *xq[MAXNT], *xl[MAXNT];
    const float *xd[MAXNT];
    const int32_t *xsq[MAXNT];
    __m256 acc[2 * MAXNT];
#pragma GCC unroll 4
    for (int t = 0; t < NT; t++) {
        const uint8_t *row = A->xa + (size_t)t * A->xs;
        xq[t] = (const int8_t *)row, xl[t] = xq[t] + (size_t)nb * 32;
        xd[t] = (const float *)(const void *)(row + (size_t)nb * (x2 ? 64 : 32));
        xsq[t] = (const int32_t *)(const void *)(xd[t] + 2 * nb);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NG * NT; i++) acc[i] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        /* each plane's sum in two chains, the low nibbles' and the high nibbles' (added at the block's end: the
         * integers are exact, so the bits are the same), so a block's dependent vpdpbusd are 4, not 8 */
        __m256i sh[2 * MAXNT], sl[2 * MAXNT], sh2[2 * MAXNT], sl2[2 * MAXNT];
#pragma GCC unroll 2
        for (int k = 0; k < NG; k++) {
            if (A[k].pf)
                for (int i = 0; i < 3; i++) bl_prefetch_line(A[k].pf + (size_t)b * A->pfs + 64 * i, hint);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const __m256i c = _mm256_set1_epi32(-BL_MXFP4_OFFSET * xsq[t][b]);
                sh[k * NT + t] = x2 ? _mm256_setzero_si256() : c;
                sl[k * NT + t] = c;
                sh2[k * NT + t] = sl2[k * NT + t] = _mm256_setzero_si256();
            }
        }
        const size_t xo = (size_t)b * 32;
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
#pragma GCC unroll 2
            for (int k = 0; k < NG; k++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(A[k].g + (size_t)b * 128 + 32 * j));
                const __m256i lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4));
                const __m256i hi = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
#pragma GCC unroll 4
                for (int t = 0; t < NT; t++) {
                    const int i = k * NT + t;
                    sh[i] = _mm256_dpbusd_epi32(sh[i], lo, bcast32(xq[t] + xo + 4 * j));
                    sh2[i] = _mm256_dpbusd_epi32(sh2[i], hi, bcast32(xq[t] + xo + 16 + 4 * j));
                    if (x2) {
                        sl[i] = _mm256_dpbusd_epi32(sl[i], lo, bcast32(xl[t] + xo + 4 * j));
                        sl2[i] = _mm256_dpbusd_epi32(sl2[i], hi, bcast32(xl[t] + xo + 16 + 4 * j));
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int k = 0; k < NG; k++) {
            const __m256 dw = e8m0x8(A[k].g + (size_t)nb * 128 + (size_t)b * 8);
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int i = k * NT + t;
                const __m256i h = _mm256_add_epi32(sh[i], sh2[i]), l = _mm256_add_epi32(sl[i], sl2[i]);
                const __m256i isum = x2 ? _mm256_add_epi32(_mm256_mullo_epi32(h, _mm256_set1_epi32(254)), l) : h;
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(xd[t][b])), acc[i]);
            }
        }
    }
#pragma GCC unroll 2
    for (int k = 0; k < NG; k++)
#pragma GCC unroll 4
        for (int t = 0; t < NT; t++) store8(A[k].o + (size_t)t * A->ldo, acc[k * NT + t], A[k].nvalid);
}

#define TILE(NT, x2, name) static void name(tile_args *A) { tile(1, NT, x2, A); }
TILE(1, 0, t1) TILE(2, 0, t2) TILE(3, 0, t3) TILE(4, 0, t4)
TILE(1, 1, u1) TILE(2, 1, u2) TILE(3, 1, u3) TILE(4, 1, u4)
static void t_g2(tile_args *A) { tile(2, 1, 0, A); }
static void u_g2(tile_args *A) { tile(2, 1, 1, A); }
static const tile_fn TILES_Q8[MAXNT] = {t1, t2, t3, t4}, TILES_Q8X2[MAXNT] = {u1, u2, u3, u4};

void bl_decode_mxfp4_avx512(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    const int x2 = w->act == BL_ACT_Q8X2;
    run_tiles(x2 ? TILES_Q8X2 : TILES_Q8, MAXNT, x2 ? u_g2 : t_g2, BL_PF_MXFP4, w, xq, T, NULL, out, ldo, r0, r1, NULL);
}
