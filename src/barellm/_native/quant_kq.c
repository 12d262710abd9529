/* Q5_0 and the K-quants: their interleaved layouts both ways, and the K-quants' dequantizers (layouts in
 * quant_kq.h). The traits table (quant.c) points here. */
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
    const uint8_t *q, *qh, *sc, *d, *dmin;
    size_t nq, nqh, nsc;
    uint8_t qbuf[192]; /* Q5_0, Q6_K: the packed values */
} kq_fields;

static void fields_q5_0(const uint8_t *blk, kq_fields *f) {
    q5_pack(blk, f->qbuf);
    f->q = f->qbuf, f->nq = 20, f->d = blk;
}
static void fields_q4_k(const uint8_t *blk, kq_fields *f) {
    f->d = blk, f->dmin = blk + 2, f->sc = blk + 4, f->nsc = 12, f->q = blk + 16, f->nq = 128;
}
static void fields_q5_k(const uint8_t *blk, kq_fields *f) {
    fields_q4_k(blk, f);
    f->qh = blk + 16, f->nqh = 32, f->q = blk + 48;
}
static void fields_q6_k(const uint8_t *blk, kq_fields *f) {
    q6k_pack(blk, f->qbuf);
    f->q = f->qbuf, f->nq = 192, f->sc = blk + 192, f->nsc = 16, f->d = blk + 208;
}
static void fields_q3_k(const uint8_t *blk, kq_fields *f) {
    f->qh = blk, f->nqh = 32, f->q = blk + 32, f->nq = 64, f->sc = blk + 96, f->nsc = 12, f->d = blk + 108;
}

/* n bytes of row l into an 8-row interleaved field at dst (and back) */
static void put8(uint8_t *dst, size_t l, const uint8_t *src, size_t n) {
    for (size_t g = 0; g < n / 4; g++) memcpy(dst + 32 * g + 4 * l, src + 4 * g, 4);
}

static void get8(uint8_t *dst, const uint8_t *src, size_t l, size_t n) {
    for (size_t g = 0; g < n / 4; g++) memcpy(dst + 4 * g, src + 32 * g + 4 * l, 4);
}

/* One group from 8 GGUF rows of nu units (rows[l] NULL: a zero row). */
static void interleave(const kq_fields8 F, void (*fields)(const uint8_t *, kq_fields *), size_t nu,
                       const uint8_t *const rows[8], uint8_t *g) {
    const size_t ub = F.unit / 8;
    memset(g, 0, bl_round_up(nu * F.unit, 64));
    for (size_t l = 0; l < 8; l++) {
        if (!rows[l]) continue;
        for (size_t u = 0; u < nu; u++) {
            kq_fields f = {0};
            fields(rows[l] + u * ub, &f);
            uint8_t *gu = g + u * F.unit;
            put8(gu + F.q, l, f.q, f.nq);
            if (f.nqh) put8(gu + F.qh, l, f.qh, f.nqh);
            if (f.nsc) put8(gu + F.sc, l, f.sc, f.nsc);
            memcpy(gu + F.d + 2 * l, f.d, 2);
            if (f.dmin) memcpy(gu + F.d + 16 + 2 * l, f.dmin, 2);
        }
    }
}

/* Unit u of row l of a group back in GGUF form. */
void bl_unpack8_q5_0(const uint8_t *g, int cols, int l, int u, uint8_t *blk) {
    const uint8_t *gu = g + (size_t)u * KQ_Q5_0.unit;
    uint8_t P[20];
    (void)cols;
    get8(P, gu + KQ_Q5_0.q, (size_t)l, 20);
    memcpy(blk, gu + KQ_Q5_0.d + 2 * l, 2);
    q5_unpack(P, blk);
}

/* Q4_K, or Q5_K (five: its qh between the scales and the nibbles) */
static void unpack8_q45_k(const kq_fields8 F, const int five, const uint8_t *g, int l, int u, uint8_t *blk) {
    const uint8_t *gu = g + (size_t)u * F.unit;
    memcpy(blk, gu + F.d + 2 * l, 2);
    memcpy(blk + 2, gu + F.d + 16 + 2 * l, 2);
    get8(blk + 4, gu + F.sc, (size_t)l, 12);
    if (five) get8(blk + 16, gu + F.qh, (size_t)l, 32);
    get8(blk + (five ? 48 : 16), gu + F.q, (size_t)l, 128);
}

void bl_unpack8_q4_k(const uint8_t *g, int cols, int l, int u, uint8_t *blk) {
    (void)cols;
    unpack8_q45_k(KQ_Q4_K, 0, g, l, u, blk);
}

void bl_unpack8_q5_k(const uint8_t *g, int cols, int l, int u, uint8_t *blk) {
    (void)cols;
    unpack8_q45_k(KQ_Q5_K, 1, g, l, u, blk);
}

void bl_unpack8_q6_k(const uint8_t *g, int cols, int l, int u, uint8_t *blk) {
    const uint8_t *gu = g + (size_t)u * KQ_Q6_K.unit;
    uint8_t P[192];
    (void)cols;
    get8(P, gu + KQ_Q6_K.q, (size_t)l, 192);
    q6k_unpack(P, blk);
    get8(blk + 192, gu + KQ_Q6_K.sc, (size_t)l, 16);
    memcpy(blk + 208, gu + KQ_Q6_K.d + 2 * l, 2);
}

void bl_unpack8_q3_k(const uint8_t *g, int cols, int l, int u, uint8_t *blk) {
    const uint8_t *gu = g + (size_t)u * KQ_Q3_K.unit;
    (void)cols;
    get8(blk, gu + KQ_Q3_K.qh, (size_t)l, 32);
    get8(blk + 32, gu + KQ_Q3_K.q, (size_t)l, 64);
    get8(blk + 96, gu + KQ_Q3_K.sc, (size_t)l, 12);
    memcpy(blk + 108, gu + KQ_Q3_K.d + 2 * l, 2);
}

void bl_pack8_q5_0(int cols, const uint8_t *const rows[8], uint8_t *g) {
    interleave(KQ_Q5_0, fields_q5_0, (size_t)cols / BL_QK, rows, g);
}
void bl_pack8_q4_k(int cols, const uint8_t *const rows[8], uint8_t *g) {
    interleave(KQ_Q4_K, fields_q4_k, (size_t)cols / BL_QK_K, rows, g);
}
void bl_pack8_q5_k(int cols, const uint8_t *const rows[8], uint8_t *g) {
    interleave(KQ_Q5_K, fields_q5_k, (size_t)cols / BL_QK_K, rows, g);
}
void bl_pack8_q6_k(int cols, const uint8_t *const rows[8], uint8_t *g) {
    interleave(KQ_Q6_K, fields_q6_k, (size_t)cols / BL_QK_K, rows, g);
}
void bl_pack8_q3_k(int cols, const uint8_t *const rows[8], uint8_t *g) {
    interleave(KQ_Q3_K, fields_q3_k, (size_t)cols / BL_QK_K, rows, g);
}

/* ---- the K-quants' dequantizers (as ggml's dequantize_row_*: the same float32 operations, in order) ---- */

/* Q4_K and Q5_K: d * sc and dmin * m first, then d1 * q - m1 (no contraction: this file has no FMA) */
static void dequant_q45_k(const uint8_t *blk, float *o, int n, int q5) {
    for (int u = 0; u < n / BL_QK_K; u++, blk += q5 ? 176 : 144, o += BL_QK_K) {
        const float d = bl_f16_to_f32(bl_rd16(blk)), dmin = bl_f16_to_f32(bl_rd16(blk + 2));
        const uint8_t *qh = blk + 16, *qs = blk + (q5 ? 48 : 16);
        uint8_t sc[8], m[8];
        kq_q4k_scales(blk + 4, sc, m);
        for (int j = 0; j < 8; j++) {
            const float d1 = d * (float)sc[j], m1 = dmin * (float)m[j];
            for (int e = 0; e < 32; e++) {
                const uint8_t b = qs[32 * (j / 2) + e];
                const int q = (j & 1 ? b >> 4 : b & 15) | (q5 ? ((qh[e] >> j) & 1) << 4 : 0);
                const float p = d1 * (float)q;
                o[32 * j + e] = p - m1;
            }
        }
    }
}

void bl_dequant_q4_k(const uint8_t *blk, float *o, int n) { dequant_q45_k(blk, o, n, 0); }
void bl_dequant_q5_k(const uint8_t *blk, float *o, int n) { dequant_q45_k(blk, o, n, 1); }

/* Q6_K (six) and Q3_K: d * sc first, then times q (Q6_K's q - 32) */
static void dequant_q36_k(const uint8_t *blk, float *o, int n, const int six) {
    for (int u = 0; u < n / BL_QK_K; u++, blk += six ? 210 : 110, o += BL_QK_K) {
        const float d = bl_f16_to_f32(bl_rd16(blk + (six ? 208 : 108)));
        int8_t sc[16];
        kq_q36k_scales(blk, six, sc);
        for (int E = 0; E < 256; E++) o[E] = d * (float)sc[E / 16] * (float)kq_q36k_value(blk, E, six);
    }
}

void bl_dequant_q6_k(const uint8_t *blk, float *o, int n) { dequant_q36_k(blk, o, n, 1); }
void bl_dequant_q3_k(const uint8_t *blk, float *o, int n) { dequant_q36_k(blk, o, n, 0); }
