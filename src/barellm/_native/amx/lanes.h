/* Private to amx/matmul.h: 16 lanes of float or int32, the width of a tile row of dwords (one C tile row, 16
 * columns), for the float work after the dot products. The hardware build keeps them in AVX-512 registers;
 * the emulated build (BL_AMX_EMULATED, any x86-64 CPU) in plain arrays, each operation lane by lane with the
 * same rounding (fmaf is the fused operation either way; conversions round to nearest), so the tests of the
 * emulated kernels check the float work's order and operands exactly as the hardware build does them. */
#ifndef BARELLM_AMX_LANES_H
#define BARELLM_AMX_LANES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES_AI static inline __attribute__((always_inline))

#ifdef BL_AMX_EMULATED

typedef struct { float f[16]; } v16f;
typedef struct { int32_t i[16]; } v16i;

LANES_AI v16f vf_load(const float *p) { v16f r; memcpy(r.f, p, 64); return r; }
LANES_AI void vf_store(float *p, v16f a) { memcpy(p, a.f, 64); }
LANES_AI v16f vf_set1(float x) { v16f r; for (int n = 0; n < 16; n++) r.f[n] = x; return r; }
LANES_AI v16f vf_zero(void) { return vf_set1(0.0f); }
LANES_AI v16f vf_mul(v16f a, v16f b) { for (int n = 0; n < 16; n++) a.f[n] *= b.f[n]; return a; }
LANES_AI v16f vf_fma(v16f a, v16f b, v16f c) { for (int n = 0; n < 16; n++) c.f[n] = fmaf(a.f[n], b.f[n], c.f[n]); return c; }
LANES_AI v16i vi_load(const int32_t *p) { v16i r; memcpy(r.i, p, 64); return r; }
LANES_AI v16i vi_set1(int32_t x) { v16i r; for (int n = 0; n < 16; n++) r.i[n] = x; return r; }
/* wrapping, as the instructions: the sums here never overflow (quant_kq.h bounds them) */
LANES_AI v16i vi_add(v16i a, v16i b) { for (int n = 0; n < 16; n++) a.i[n] = (int32_t)((uint32_t)a.i[n] + (uint32_t)b.i[n]); return a; }
LANES_AI v16i vi_sub(v16i a, v16i b) { for (int n = 0; n < 16; n++) a.i[n] = (int32_t)((uint32_t)a.i[n] - (uint32_t)b.i[n]); return a; }
LANES_AI v16i vi_mullo(v16i a, v16i b) { for (int n = 0; n < 16; n++) a.i[n] = (int32_t)((uint32_t)a.i[n] * (uint32_t)b.i[n]); return a; }
LANES_AI v16f vi_to_f(v16i a) { v16f r; for (int n = 0; n < 16; n++) r.f[n] = (float)a.i[n]; return r; }

#else

#include <immintrin.h>

typedef __m512 v16f;
typedef __m512i v16i;

LANES_AI v16f vf_load(const float *p) { return _mm512_loadu_ps(p); }
LANES_AI void vf_store(float *p, v16f a) { _mm512_storeu_ps(p, a); }
LANES_AI v16f vf_set1(float x) { return _mm512_set1_ps(x); }
LANES_AI v16f vf_zero(void) { return _mm512_setzero_ps(); }
LANES_AI v16f vf_mul(v16f a, v16f b) { return _mm512_mul_ps(a, b); }
LANES_AI v16f vf_fma(v16f a, v16f b, v16f c) { return _mm512_fmadd_ps(a, b, c); }
LANES_AI v16i vi_load(const int32_t *p) { return _mm512_loadu_si512(p); }
LANES_AI v16i vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
LANES_AI v16i vi_add(v16i a, v16i b) { return _mm512_add_epi32(a, b); }
LANES_AI v16i vi_sub(v16i a, v16i b) { return _mm512_sub_epi32(a, b); }
LANES_AI v16i vi_mullo(v16i a, v16i b) { return _mm512_mullo_epi32(a, b); }
LANES_AI v16f vi_to_f(v16i a) { return _mm512_cvtepi32_ps(a); }

#endif

#endif
