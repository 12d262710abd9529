/* Choosing the next token from a row of logits, in llama.cpp's chain order:
 *   logit bias -> repetition / presence / frequency penalties -> top-k -> top-p -> min-p -> temperature -> draw
 * with an optional allowed-token bitmask (bit i of word i / 32 set: token i may be chosen) in front of all.
 *
 * The arithmetic mirrors barellm.sampling's NumPy reference (the oracle the tests hold it to): candidates
 * sorted best first (ties: the lower id first), probabilities in double, the draw one uniform u mapped
 * through the cumulative distribution. Greedy (temperature <= 0) is the argmax after bias and penalties,
 * the lowest id on ties.
 *
 * No full sort: the candidates come from one pass that keeps the best m in a heap (bl_top); only when
 * top-k is off and the top-p / min-p cut or the draw falls beyond those m is the pass repeated with 4 m.
 * The row is modified only while a call runs (bias and penalties are applied in place and undone).
 */
#ifndef BARELLM_SAMPLE_H
#define BARELLM_SAMPLE_H

#include "barellm.h"

typedef struct bl_cand {
    float logit;
    int32_t id;
} bl_cand;

typedef struct bl_sampling {
    double temperature; /* <= 0: greedy */
    int top_k;          /* 0: off */
    double top_p;       /* 1: off */
    double min_p;       /* 0: off */
    float repeat_penalty, presence_penalty, frequency_penalty; /* 1, 0, 0: off */
} bl_sampling;

typedef struct bl_sample_ctx {
    bl_sampling p;
    const int32_t *recent; /* the penalty window: the last repeat_last_n tokens */
    int n_recent;
    int32_t *counts;       /* n zeroed ints (left zeroed), needed when a penalty is on */
    const int32_t *bias_ids;
    const float *bias;
    int n_bias;
    const uint32_t *allowed; /* NULL: every token */
    bl_cand *scratch;        /* n entries */
    bl_cand *saved;          /* n_bias + min(n_recent, n) entries: values to restore */
} bl_sample_ctx;

/* The chosen token, or -1 when the mask allows none (or every allowed logit is NaN or -inf for sampling). */
BL_API int bl_sample(float *x, int n, const bl_sample_ctx *c, double u);
/* The candidates a draw chooses from and their probabilities (after temperature), best first; returns how
 * many. Always the exact (whole) candidate set: for tests and diagnostics, not the token loop. */
BL_API int bl_sample_candidates(float *x, int n, const bl_sample_ctx *c, int32_t *ids, double *probs);
/* log-softmax of the row: the value at `token` and the k best (ids and log-probabilities, best first). */
BL_API double bl_logprobs(const float *x, int n, int token, int k, bl_cand *top, double *top_lp, int *n_top);

/* kernels: the entry points call the resolved tier table (tier.h); the tiers' own ones follow */
BL_API int bl_argmax(const float *x, int n, const uint32_t *allowed);
BL_API int bl_top(const float *x, int n, const uint32_t *allowed, int m, bl_cand *out);
BL_API double bl_sum_exp(const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo);
BL_API float bl_row_max(const float *x, int n);

BL_API int bl_argmax_scalar(const float *x, int n, const uint32_t *allowed);
BL_API int bl_top_scalar(const float *x, int n, const uint32_t *allowed, int m, bl_cand *out);
BL_API double bl_sum_exp_scalar(const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo);
BL_API float bl_row_max_scalar(const float *x, int n);
BL_API int bl_argmax_avx2(const float *x, int n, const uint32_t *allowed);
BL_API int bl_top_avx2(const float *x, int n, const uint32_t *allowed, int m, bl_cand *out);
BL_API double bl_sum_exp_avx2(const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo);
BL_API float bl_row_max_avx2(const float *x, int n);

/* ---- what the kernels share: the top-m heap ----
 * A min-heap of m entries ordered by "worse" (lower logit; on equal logits the higher id), so the root is
 * the entry a better one replaces. It starts full of sentinels (-inf, INT32_MAX): a value enters when it is
 * greater than the root's. Scanning ids upwards, an equal value never enters, so ties keep the lower id. */

static inline int bl_cand_worse(bl_cand a, bl_cand b) {
    return a.logit < b.logit || (a.logit == b.logit && a.id > b.id);
}

static inline void bl_heap_init(bl_cand *h, int m) {
    for (int i = 0; i < m; i++) h[i] = (bl_cand){-__builtin_inff(), INT32_MAX};
}

/* replaces the root by (v, id) and restores the heap; returns the new root's logit (the entry threshold) */
static inline float bl_heap_replace(bl_cand *h, int m, float v, int32_t id) {
    bl_cand it = {v, id};
    int i = 0;
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        bl_cand best = it;
        if (l < m && bl_cand_worse(h[l], best)) { w = l; best = h[l]; }
        if (r < m && bl_cand_worse(h[r], best)) { w = r; }
        if (w == i) break;
        h[i] = h[w];
        i = w;
    }
    h[i] = it;
    return h[0].logit;
}

static inline int bl_allowed(const uint32_t *allowed, int i) {
    return !allowed || (allowed[i >> 5] >> (i & 31)) & 1u;
}

/* sorts the heap best first and returns how many entries are real (not sentinels) */
BL_API int bl_heap_finish(bl_cand *h, int m);

#endif
