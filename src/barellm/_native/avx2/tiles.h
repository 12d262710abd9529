/* The avx2 tier's matmul driver on the interleaved layout, one for its block types' tiles (avx2/quant.c: Q4_0,
 * Q4_1, Q8_0) and its K-quants' (avx2/quant_kq.c, and the avx512 tier's decode, avx512/decode_kq.c): which
 * groups of 8 rows a tile gets, with which tokens, and where it prefetches. Include after the file's
 * `#pragma GCC target`.
 *
 * Software prefetch follows kernels.h's rules for the tiles' family (BL_PF_BLOCKS, BL_PF_KQUANTS): a tile
 * fetches the rule's bytes ahead of its group, spread over its units (unit u's share up to pf + (u + 1) * pfs,
 * so every line of the range gets its prefetch), where that range lies inside the call's groups; only a
 * group's first token tile does it. */
#ifndef BL_AVX2_TILES_H
#define BL_AVX2_TILES_H

#include <stdint.h>

#include "kernels.h"

/* The arguments of one tile: 8 rows (a group of nu units) x NT tokens. A tile over NG groups takes NG of them,
 * one per group; the tokens' fields (xa, xs, xp, ldo) are read from the first. */
typedef struct {
    const uint8_t *g;   /* interleaved group */
    int nu;             /* units per row (a unit: the type's block, or a K-quant's super-block) */
    const uint8_t *xa;  /* the first token's activation row */
    size_t xs;          /* bytes from one token's row to the next */
    const int32_t *xp;  /* Q6_K, Q3_K: per token (nb apart), per block: int16 pair (sum qx[0:16], sum qx[16:32]) */
    float *o;           /* out for the first token and row of the tile */
    size_t ldo;
    int nvalid;         /* rows of the 8 to store */
    const uint8_t *pf;  /* software prefetch: unit u fetches up to pf + (u + 1) * pfs; NULL: none */
    size_t pfs;
    int hint;           /* how: the rule run_tiles chose (enum bl_prefetch_hint) */
    size_t pdone;       /* bytes of that span prefetched, for tiles that keep the count here (avx512/decode_kq.c:
                           kept in a register, its Q5_K tile's count cost it 40 more vector spills) */
    const uint8_t *s;   /* avx2/quant_kq_prefill.c's lean tiles: the group unpacked */
} tile_args;

typedef void (*tile_fn)(tile_args *A);

/* K-quant tiles: prefetches the lines of [pf + *done, pf + end) and moves *done past them: spread over a unit's
 * loop, a few lines at a time, each line once. */
static inline __attribute__((always_inline)) void prefetch_until(const tile_args *A, size_t *done, size_t end) {
    if (!A->pf) return;
    for (; *done < end; *done += 64) bl_prefetch_line(A->pf + *done, A->hint);
}

/* the end of part i of n of unit u's span */
static inline __attribute__((always_inline)) size_t prefetch_end(const size_t pfs, int u, int i, int n) {
    return (size_t)u * pfs + (size_t)(i + 1) * pfs / (size_t)n;
}

/* prefetch_until the end of part i of n of unit u's span (computed only where the tile prefetches: ~3% of a
 * decode tile's instructions otherwise) */
static inline __attribute__((always_inline)) void prefetch_part(const tile_args *A, size_t *done, int u, int i,
                                                                int n) {
    if (A->pf) prefetch_until(A, done, prefetch_end(A->pfs, u, i, n));
}

/* group g's prefetch base: pf bytes ahead, if the whole group there is still the call's */
static inline const uint8_t *prefetch_base(const uint8_t *g, const uint8_t *end, size_t pf, size_t gb) {
    return pf && (size_t)(end - g) >= pf + gb ? g + pf : NULL;
}

/* One token (decode): the groups of [r0, r1) walked as two streams, the first half's groups and the
 * second half's in step (a 2-group tile; Q4 from cache ~25% faster than two 1-group ones), and an odd group
 * left over on its own. A core streaming weights reads them faster from two places at once than from one:
 * on Zen 3 a plain read of 2 or 3 far-apart streams came 15-25% faster than of one, and
 * Qwen2.5-Coder-1.5B's decode went from 83.5% to 97.5% of a plain read of its weights at 1 thread (14.6 ->
 * 17.7 tok/s) and from 85.5% to 90% at 2 (22.5 -> 23.1), every one of 6 alternating rounds faster
 * (lab:bench/decode_share.py); the 0.5B, mostly Q5_0, 30.3 -> 35.9 and 43.0 -> 48.6 tok/s. A0: the tiles'
 * other arguments. */
static inline void two_streams(const tile_fn one, const tile_fn two, const tile_args *A0, const uint8_t *base,
                               size_t gb, float *out, int r0, int r1, const uint8_t *end, size_t pf) {
    const int ng = (r1 - r0 + 7) / 8, half = ng / 2;
    tile_args P[2] = {*A0, *A0};
    for (int i = 0; i < ng - half; i++) {
        const int n = i < half ? 2 : 1; /* the last, when ng is odd, alone */
        for (int k = 0; k < n; k++) {
            const int r = r0 + 8 * (i + k * (ng - half));
            P[k].g = base + (size_t)(r / 8) * gb;
            P[k].o = out + r;
            P[k].nvalid = r1 - r < 8 ? r1 - r : 8;
            P[k].pf = prefetch_base(P[k].g, end, pf, gb);
            P[k].pdone = 0;
        }
        if (n == 2) two(P);
        else one(P);
    }
}

/* out[t * ldo + r] for r in [r0, r1), t in [0, T): fns[nt - 1] runs nt <= ntmax tokens over a group; one token
 * goes to two_streams when there is a 2-group tile (two). family: the prefetch rule (BL_PF_BLOCKS, which long
 * rows turn into BL_PF_BLOCKS_LONG, BL_PF_KQUANTS or BL_PF_MXFP4), whose hint the tiles read from their args;
 * xp: the tiles' half sums (NULL: none). pack: NULL for the interleaved layout; for GGUF rows, a group's worth
 * of scratch each 8 rows are interleaved into (the type's pack8) before their tiles run. */
static inline void run_tiles(const tile_fn *fns, const int ntmax, const tile_fn two, const int family,
                             const bl_matrix *w, const void *xq, int T, const int32_t *xp, float *out, size_t ldo,
                             int r0, int r1, uint8_t *pack) {
    const bl_type_traits *tr = bl_traits(w->type);
    const int cols = w->cols, nb = cols / BL_ACT_BLOCK;
    const size_t gb = bl_group_bytes(w->type, BL_LAYOUT_INTERLEAVE8, cols), xb = bl_act_row_bytes(w, cols);
    tile_args A = {.nu = cols / tr->block_size, .xs = xb, .ldo = ldo, .nvalid = 8};
    A.pfs = (gb + (size_t)A.nu - 1) / (size_t)A.nu;
    const uint8_t *end = (const uint8_t *)w->data + (size_t)((r1 + 7) / 8) * gb;
    const bl_prefetch_rule rule = bl_prefetch_rules[bl_prefetch_family(family, gb)][bl_shared_stream != 0];
    const size_t pf = rule.hint == BL_PF_NONE || pack ? 0 : (size_t)rule.bytes;
    A.hint = rule.hint;
    if (two && T == 1 && !pack) {
        A.xa = xq;
        A.xp = xp;
        two_streams(fns[0], two, &A, w->data, gb, out, r0, r1, end, pf);
        return;
    }
    const size_t rb = bl_row_bytes(w->type, cols);
    for (int r = r0; r < r1; r += 8) {
        A.nvalid = r1 - r < 8 ? r1 - r : 8;
        if (pack) {
            const uint8_t *p[8];
            for (int l = 0; l < 8; l++) p[l] = l < A.nvalid ? (const uint8_t *)w->data + (size_t)(r + l) * rb : NULL;
            tr->pack8(cols, p, pack);
            A.g = pack;
        } else {
            A.g = (const uint8_t *)w->data + (size_t)(r / 8) * gb;
        }
        for (int t = 0; t < T; t += ntmax) {
            const int nt = T - t < ntmax ? T - t : ntmax;
            A.xa = (const uint8_t *)xq + (size_t)t * xb;
            A.xp = xp ? xp + (size_t)t * nb : NULL;
            A.o = out + (size_t)t * ldo + r;
            A.pf = t == 0 ? prefetch_base(A.g, end, pf, gb) : NULL;
            fns[nt - 1](&A);
        }
    }
}

#endif
