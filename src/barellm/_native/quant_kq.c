/* Q5_0, Q4_K, Q6_K: repacking, row access and the choice of ISA (layouts in quant_kq.h). */
#include <stdint.h>
#include <string.h>

#include "quant_kq.h"

/* Q5_0's packed values of one row's block (20 bytes, see quant_kq.h), from the GGUF block and back: with
 * q[e] = low nibble of qs[e] | bit e of qh << 4 and q[16 + e] = high nibble | bit 16 + e << 4 (e < 16),
 * byte e = q[e] | (q[16 + e] & 7) << 5, and byte 16 + i, bits 2j, 2j + 1 = q[16 + 4j + i] >> 3. */
static void q5_pack(const uint8_t *blk, uint8_t P[20]) {
    const uint32_t qh = (uint32_t)bl_rd32(blk + 2);
    const uint8_t *qs = blk + 6;
    for (int e = 0; e < 16; e++) P[e] = (uint8_t)((qs[e] & 15) | ((qh >> e) & 1) << 4 | (qs[e] & 0x70) << 1);
    for (int i = 0; i < 4; i++) {
        uint32_t v = 0;
        for (int j = 0; j < 4; j++)
            v |= ((uint32_t)(qs[4 * j + i] >> 7) | ((qh >> (16 + 4 * j + i)) & 1) << 1) << (2 * j);
        P[16 + i] = (uint8_t)v;
    }
}

static void q5_unpack(const uint8_t P[20], uint8_t *blk) {
    uint32_t qh = 0;
    for (int e = 0; e < 16; e++) {
        const uint32_t hi3 = (uint32_t)(P[16 + e % 4] >> (2 * (e / 4))) & 3; /* q[16 + e] >> 3 */
        blk[6 + e] = (uint8_t)((P[e] & 15) | ((P[e] >> 5) | (hi3 & 1) << 3) << 4);
        qh |= (uint32_t)((P[e] >> 4) & 1) << e | (hi3 >> 1) << (16 + e);
    }
    memcpy(blk + 2, &qh, 4);
}

/* Q6_K's packed values of one row's unit (192 bytes, see quant_kq.h), from the GGUF unit and back: 4-byte
 * granule G = 6 kb + 3 a + p (block kb, half a, p < 3), byte i = q[32 kb + 16 a + 4p + i] | bits 2p, 2p + 1
 * of q[32 kb + 16 a + 12 + i] << 6 */
static void q6k_pack(const uint8_t *blk, uint8_t P[192]) {
    for (int kb = 0; kb < 8; kb++) {
        const int h = kb / 4, k = kb % 4, sh = k < 2 ? 0 : 4;
        const uint8_t *L = blk + 64 * h + 32 * (k & 1), *H = blk + 128 + 32 * h;
        uint8_t q[32];
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(((L[l] >> sh) & 15) | ((H[l] >> (2 * k)) & 3) << 4);
        for (int a = 0; a < 2; a++)
            for (int p = 0; p < 3; p++)
                for (int i = 0; i < 4; i++)
                    P[24 * kb + 12 * a + 4 * p + i] =
                        (uint8_t)(q[16 * a + 4 * p + i] | ((q[16 * a + 12 + i] >> (2 * p)) & 3) << 6);
    }
}

static void q6k_unpack(const uint8_t P[192], uint8_t *blk) {
    memset(blk, 0, 192);
    for (int kb = 0; kb < 8; kb++) {
        const int h = kb / 4, k = kb % 4, sh = k < 2 ? 0 : 4;
        uint8_t *L = blk + 64 * h + 32 * (k & 1), *H = blk + 128 + 32 * h;
        uint8_t q[32];
        for (int a = 0; a < 2; a++)
            for (int i = 0; i < 4; i++) {
                q[16 * a + 12 + i] = 0;
                for (int p = 0; p < 3; p++) {
                    const uint8_t v = P[24 * kb + 12 * a + 4 * p + i];
                    q[16 * a + 4 * p + i] = v & 63;
                    q[16 * a + 12 + i] |= (uint8_t)((v >> 6) << (2 * p));
                }
            }
        for (int l = 0; l < 32; l++) {
            L[l] |= (uint8_t)((q[l] & 15) << sh);
            H[l] |= (uint8_t)((q[l] >> 4) << (2 * k));
        }
    }
}

/* The fields of one GGUF unit as the interleaved layout orders them. */
typedef struct {
    const uint8_t *q, *sc, *d, *dmin;
    size_t nq, nsc;
    uint8_t qbuf[192]; /* Q5_0, Q6_K: the packed values */
} kq_fields;

static void fields_of(int type, const uint8_t *blk, kq_fields *f) {
    f->sc = f->dmin = NULL;
    f->nsc = 0;
    if (type == BL_Q5_0) {
        q5_pack(blk, f->qbuf);
        f->d = blk, f->q = f->qbuf, f->nq = 20;
    } else if (type == BL_Q4_K) {
        f->d = blk, f->dmin = blk + 2, f->sc = blk + 4, f->nsc = 12, f->q = blk + 16, f->nq = 128;
    } else {
        q6k_pack(blk, f->qbuf);
        f->q = f->qbuf, f->nq = 192, f->sc = blk + 192, f->nsc = 16, f->d = blk + 208;
    }
}

/* n bytes of row l into an 8-row interleaved field at dst (and back) */
static void put8(uint8_t *dst, size_t l, const uint8_t *src, size_t n) {
    for (size_t g = 0; g < n / 4; g++) memcpy(dst + 32 * g + 4 * l, src + 4 * g, 4);
}

static void get8(uint8_t *dst, const uint8_t *src, size_t l, size_t n) {
    for (size_t g = 0; g < n / 4; g++) memcpy(dst + 4 * g, src + 32 * g + 4 * l, 4);
}

void kq_interleave_group(int type, int cols, const uint8_t *const rows[8], uint8_t *g) {
    const size_t nu = (size_t)(cols / kq_unit(type)), ub = kq_unit_bytes(type);
    const kq_fields8 F = kq_fields8_of(type);
    memset(g, 0, bl_i8_group_bytes(type, cols));
    for (size_t l = 0; l < 8; l++) {
        if (!rows[l]) continue;
        for (size_t u = 0; u < nu; u++) {
            kq_fields f;
            fields_of(type, rows[l] + u * ub, &f);
            uint8_t *gu = g + u * F.unit;
            put8(gu + F.q, l, f.q, f.nq);
            if (f.nsc) put8(gu + F.sc, l, f.sc, f.nsc);
            memcpy(gu + F.d + 2 * l, f.d, 2);
            if (f.dmin) memcpy(gu + F.d + 16 + 2 * l, f.dmin, 2);
        }
    }
}

void kq_load_unit(const bl_matrix *w, int r, int u, uint8_t *blk) {
    const int type = w->type;
    const size_t ub = kq_unit_bytes(type);
    if (w->layout == BL_LAYOUT_ROWS) {
        memcpy(blk, (const uint8_t *)w->data + (size_t)r * bl_row_bytes(type, w->cols) + (size_t)u * ub, ub);
        return;
    }
    const size_t l = (size_t)(r % 8);
    const kq_fields8 F = kq_fields8_of(type);
    const uint8_t *gu = (const uint8_t *)w->data + (size_t)(r / 8) * bl_i8_group_bytes(type, w->cols) + u * F.unit;
    const uint8_t *gq = gu + F.q, *gs = gu + F.sc, *gd = gu + F.d + 2 * l;
    if (type == BL_Q5_0) {
        uint8_t P[20];
        get8(P, gq, l, 20);
        memcpy(blk, gd, 2);
        q5_unpack(P, blk);
    } else if (type == BL_Q4_K) {
        memcpy(blk, gd, 2);
        memcpy(blk + 2, gd + 16, 2);
        get8(blk + 4, gs, l, 12);
        get8(blk + 16, gq, l, 128);
    } else {
        uint8_t P[192];
        get8(P, gq, l, 192);
        q6k_unpack(P, blk);
        get8(blk + 192, gs, l, 16);
        memcpy(blk + 208, gd, 2);
    }
}

int bl_repack_kq(int type, int rows, int cols, const void *src, void *dst) {
    const size_t rb = bl_row_bytes(type, cols), gb = bl_i8_group_bytes(type, cols);
    for (int r = 0; r < rows; r += 8) {
        const uint8_t *p[8];
        for (int l = 0; l < 8; l++) p[l] = r + l < rows ? (const uint8_t *)src + (size_t)(r + l) * rb : NULL;
        kq_interleave_group(type, cols, p, (uint8_t *)dst + (size_t)(r / 8) * gb);
    }
    return 0;
}

int bl_dequantize_row_kq(const bl_matrix *w, int r, float *out) {
    const int type = w->type, nu = w->cols / kq_unit(type);
    uint8_t blk[210];
    for (int u = 0; u < nu; u++) {
        kq_load_unit(w, r, u, blk);
        float *o = out + (size_t)u * kq_unit(type);
        if (type == BL_Q5_0) {
            const float d = bl_f16_to_f32(bl_rd16(blk));
            const uint32_t qh = (uint32_t)bl_rd32(blk + 2);
            for (int i = 0; i < 16; i++) {
                const int lo = (blk[6 + i] & 15) | (int)((qh >> i) & 1) << 4;
                const int hi = (blk[6 + i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
                o[i] = (float)(lo - 16) * d;
                o[i + 16] = (float)(hi - 16) * d;
            }
        } else if (type == BL_Q4_K) { /* as ggml: d * sc and dmin * m first, then d1 * q - m1 */
            const float d = bl_f16_to_f32(bl_rd16(blk)), dmin = bl_f16_to_f32(bl_rd16(blk + 2));
            uint8_t sc[8], m[8];
            kq_q4k_scales(blk + 4, sc, m);
            for (int j = 0; j < 8; j++) {
                const float d1 = d * (float)sc[j], m1 = dmin * (float)m[j];
                for (int e = 0; e < 32; e++) {
                    const uint8_t b = blk[16 + 32 * (j / 2) + e];
                    const float p = d1 * (float)(j & 1 ? b >> 4 : b & 15); /* no contraction: as ggml */
                    o[32 * j + e] = p - m1;
                }
            }
        } else {
            const float d = bl_f16_to_f32(bl_rd16(blk + 208));
            for (int E = 0; E < 256; E++) {
                const int h = E / 128, k = (E / 32) % 4, l = E % 32;
                const uint8_t qb = blk[64 * h + 32 * (k & 1) + l];
                const int q = (k < 2 ? qb & 15 : qb >> 4) | ((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4;
                o[E] = d * (float)(int8_t)blk[192 + E / 16] * (float)(q - 32);
            }
        }
    }
    return 0;
}

void bl_matmul_kq(const bl_matrix *w, const void *xq, int T, float *out, size_t ldo, int r0, int r1) {
    if (bl_isa() == BL_ISA_AVX2) bl_matmul_kq_avx2(w, xq, T, out, ldo, r0, r1);
    else bl_matmul_kq_scalar(w, xq, T, out, ldo, r0, r1);
}
