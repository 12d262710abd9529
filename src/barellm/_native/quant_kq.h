/* Private to quant_kq*.c: Q5_0, Q3_K, Q4_K, Q5_K and Q6_K, their layouts and the float work per output.
 *
 * The activations are quant_internal.h's bl_act_q8 (int8 blocks of 32, per block f32 d, s and i32 sq):
 * every type here splits into pieces of 32 values that line up with those blocks. A "unit" is the type's
 * block (Q5_0: 32 values) or super-block (the K-quants: 256 values = 8 activation blocks).
 *
 * GGUF rows (BL_LAYOUT_ROWS), per unit:
 *   Q5_0  22 bytes: f16 d, u32 qh (LE), u8 qs[16]
 *         q_i = (qs[i] & 15) | bit i of qh << 4, q_{i+16} = (qs[i] >> 4) | bit i+16 of qh << 4;
 *         value = (q - 16) * d
 *   Q4_K  144 bytes: f16 d, f16 dmin, u8 scales[12], u8 qs[128]
 *         8 sub-blocks j of 32 with 6-bit sc_j, m_j packed in scales (ggml's get_scale_min_k4);
 *         sub-block j's value e: q = qs[32 * (j / 2) + e], low nibble for even j, high for odd;
 *         value = d * sc_j * q - dmin * m_j
 *   Q5_K  176 bytes: f16 d, f16 dmin, u8 scales[12] (as Q4_K), u8 qh[32], u8 qs[128]
 *         as Q4_K with a fifth bit: q = nibble | (bit j of qh[e]) << 4 (q < 32)
 *   Q3_K  110 bytes: u8 hmask[32], u8 qs[64], u8 scales[12], f16 d
 *         value E = 128 h + 32 k + l (h < 2, k < 4, l < 32): u = ((qs[32 h + l] >> 2k) & 3) | (bit 4h + k of
 *         hmask[l]) << 2 (u < 8), q = u - 4; 16 scales of 6 bits, sc_i = (low 4 bits: nibble i % 8 of
 *         scales[i % 8], the low one for i < 8) | (bits 2 (i / 4), +1 of scales[8 + i % 4]) << 4;
 *         value = d * (sc_{E / 16} - 32) * q
 *   Q6_K  210 bytes: u8 ql[128], u8 qh[64], i8 scales[16], f16 d
 *         value E = 128 h + 32 k + l (h < 2, k < 4, l < 32):
 *         q = nibble | ((qh[32 h + l] >> 2k) & 3) << 4, nibble = low (k = 0, 1) or high (k = 2, 3) half
 *         of ql[64 h + 32 (k & 1) + l]; value = d * scales[E / 16] * (q - 32)
 *
 * BL_LAYOUT_INTERLEAVE8: rows in groups of 8 (the last padded with zero rows), bl_i8_group_bytes() =
 * round_up(8 * row bytes, 64) bytes per group, made of the nu units of the 8 rows one after the other,
 * 8 * unit bytes each, so the weights stream from memory in one sequence. "8 x N interleaved" means N bytes
 * of each of the 8 rows cut into 4-byte granules, granule g of row l stored at 32 g + 4 l: one 32-byte
 * vector holds granule g of all 8 rows, a 32-bit lane per row. The quants are stored as their values q,
 * repacked so that the SIMD loop gets each vector of values with few operations:
 *   Q5_0  (176 = 8 x 22 bytes per unit)
 *         0    8 x 20 interleaved packed values of the block: granule j < 4, byte i = q[4j + i] (bits 0-4)
 *              | low 3 bits of q[16 + 4j + i] (bits 5-7); granule 4, byte i, bits 2j, 2j + 1 = the top 2 bits
 *              of q[16 + 4j + i]
 *         160  8 x f16 d
 *   Q4_K  (1152 = 8 x 144)
 *         0    8 x 128 interleaved qs (as GGUF: byte 32c + e = sub-block 2c's value e in the low nibble,
 *              2c + 1's in the high one)
 *         1024 8 x 12 interleaved scales (as GGUF)
 *         1120 8 x f16 d, 1136 8 x f16 dmin
 *   Q6_K  (1680 = 8 x 210)
 *         0    8 x 192 interleaved packed values: granule G = 6 kb + 3 a + p (block kb < 8, half a < 2, p < 3),
 *              byte i = q[32 kb + 16 a + 4p + i] (bits 0-5) | bits 2p, 2p + 1 of q[32 kb + 16 a + 12 + i]
 *              (bits 6-7)
 *         1536 8 x 16 interleaved scales (as GGUF)
 *         1664 8 x f16 d
 *   Q5_K  (1408 = 8 x 176)
 *         0    8 x 128 interleaved qs (as Q4_K)
 *         1024 8 x 32 interleaved qh (as GGUF: granule j holds bytes 4j..4j+3, the fifth bits of values
 *              e = 4j + i of all 8 sub-blocks)
 *         1280 8 x 12 interleaved scales (as GGUF)
 *         1376 8 x f16 d, 1392 8 x f16 dmin
 *   Q3_K  (880 = 8 x 110)
 *         0    8 x 64 interleaved qs (as GGUF: granule 8h + j holds the 2-bit fields of l = 4j..4j+3, half h)
 *         512  8 x 32 interleaved hmask (as GGUF)
 *         768  8 x 12 interleaved scales (as GGUF)
 *         864  8 x f16 d
 *
 * The float work for one output (t, r), in this order in every kernel of every ISA (b the activation
 * block, xd = d of the activation, sq its sum; each integer below is exact in int32 and converted once):
 *   Q5_0  acc = 0; for b: acc = fma((float)(dot(q, qx_b) - 16 * sq_b), d_b * xd_b, acc); out = acc
 *   Q4_K, Q5_K  acc = 0, accm = 0; for unit u:
 *             pu = 0, mu = 0; for sub-block j (b = 8u + j):
 *                 pu = fma((float)(sc_j * dot(q, qx_b)), xd_b, pu)
 *                 mu = fma((float)m_j, s_b, mu)                      (s_b = xd_b * sq_b, the activation's s)
 *             acc = fma(pu, d_u, acc), accm = fma(mu, dmin_u, accm)
 *         out = acc - accm
 *   Q6_K, Q3_K  acc = 0; for unit u:
 *             pu = 0; for block k < 8 (b = 8u + k), halves of 16 with scales sa = scales[2k], sb = scales[2k + 1]
 *             (Q3_K: sc_2k - 32, sc_2k+1 - 32, and q - 4 in place of q - 32):
 *                 pu = fma((float)(sa * dot(q - 32, qx)[0:16] + sb * dot(q - 32, qx)[16:32]), xd_b, pu)
 *             acc = fma(pu, d_u, acc)
 *         out = acc
 * (the unit's scale applied once per unit: fewer float operations per block, for every token of a tile).
 */
#ifndef BARELLM_QUANT_KQ_H
#define BARELLM_QUANT_KQ_H

#include "quant_internal.h"

/* Where the fields of unit u of an interleaved group are: at u * unit + the field's offset. */
typedef struct {
    size_t q;    /* the (packed) values */
    size_t qh;   /* Q5_K: the fifth bits; Q3_K: hmask */
    size_t sc;   /* the K-quants' scales (Q5_0: none) */
    size_t d;    /* f16 d (Q4_K, Q5_K: 8 d then 8 dmin) */
    size_t unit; /* bytes of one unit of 8 rows: 8 * the type's block bytes */
} kq_fields8;

static const kq_fields8 KQ_Q5_0 = {0, 0, 160, 160, 176}, KQ_Q4_K = {0, 0, 1024, 1120, 1152},
                        KQ_Q5_K = {0, 1024, 1280, 1376, 1408}, KQ_Q6_K = {0, 0, 1536, 1664, 1680},
                        KQ_Q3_K = {0, 512, 768, 864, 880};

/* Q4_K: the 6-bit scales and mins of a unit from its 12 scale bytes (ggml's get_scale_min_k4) */
static inline void kq_q4k_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* Q3_K: the 16 scales (sc - 32, signed) of a unit from its 12 scale bytes */
static inline void kq_q3k_scales(const uint8_t *s, int8_t sc[16]) {
    for (int i = 0; i < 16; i++) {
        const int lo = i < 8 ? s[i] & 15 : s[i - 8] >> 4, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        sc[i] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* Q6_K (six) or Q3_K: value E's integer of a unit (Q6_K: q - 32; Q3_K: q = u - 4), and the unit's 16 scales */
static inline int kq_q36k_value(const uint8_t *blk, int E, const int six) {
    const int h = E / 128, k = (E / 32) % 4, l = E % 32;
    if (!six) return ((blk[32 + 32 * h + l] >> (2 * k)) & 3) - ((blk[l] >> (4 * h + k)) & 1 ? 0 : 4);
    const uint8_t qb = blk[64 * h + 32 * (k & 1) + l];
    return ((k < 2 ? qb & 15 : qb >> 4) | ((blk[128 + 32 * h + l] >> (2 * k)) & 3) << 4) - 32;
}

static inline void kq_q36k_scales(const uint8_t *blk, const int six, int8_t sc[16]) {
    if (six) memcpy(sc, blk + 192, 16);
    else kq_q3k_scales(blk + 96, sc);
}

#endif
