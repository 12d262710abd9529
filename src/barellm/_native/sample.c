/* The sampling chain (sample.h); its kernels come from the resolved tier table (tier.h). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sample.h"
#include "tier.h"

int bl_argmax(const float *x, int n, const uint32_t *allowed) { return bl_kernels.argmax(x, n, allowed); }
int bl_top(const float *x, int n, const uint32_t *allowed, int m, bl_cand *out) {
    return bl_kernels.top(x, n, allowed, m, out);
}
double bl_sum_exp(const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo) {
    return bl_kernels.sum_exp(x, n, allowed, ref, scale, lo);
}
float bl_row_max(const float *x, int n) { return bl_kernels.row_max(x, n); }

static int cand_order(const void *a, const void *b) {
    const bl_cand *p = a, *q = b;
    return bl_cand_worse(*q, *p) ? -1 : bl_cand_worse(*p, *q) ? 1 : 0;
}

int bl_heap_finish(bl_cand *h, int m) {
    qsort(h, (size_t)m, sizeof *h, cand_order);
    int k = m;
    while (k > 0 && h[k - 1].id == INT32_MAX) k--;
    return k;
}

/* ---- the chain ---- */

/* bias, then penalties, in place; what they overwrote goes to c->saved (returns how many entries) */
static int adjust(float *x, int n, const bl_sample_ctx *c) {
    int s = 0;
    for (int b = 0; b < c->n_bias; b++) {
        int32_t t = c->bias_ids[b];
        if (t < 0 || t >= n) continue;
        c->saved[s++] = (bl_cand){x[t], t};
        x[t] += c->bias[b];
    }
    const float rp = c->p.repeat_penalty, pp = c->p.presence_penalty, fp = c->p.frequency_penalty;
    if (!c->counts || c->n_recent <= 0 || (rp == 1.0f && pp == 0.0f && fp == 0.0f)) return s;
    for (int i = 0; i < c->n_recent; i++) {
        int32_t t = c->recent[i];
        if (t >= 0 && t < n) c->counts[t]++;
    }
    for (int i = 0; i < c->n_recent; i++) {
        int32_t t = c->recent[i];
        if (t < 0 || t >= n || !c->counts[t]) continue;
        int32_t cnt = c->counts[t];
        c->counts[t] = 0; /* each distinct token once, and the counts are left zeroed */
        c->saved[s++] = (bl_cand){x[t], t};
        float v = x[t];
        if (rp != 1.0f) v = v > 0 ? v / rp : v * rp;
        /* as NumPy computes the reference: the int count times a float32 penalty is a double */
        x[t] = (float)((double)v - (double)cnt * (double)fp - (double)pp);
    }
    return s;
}

static void restore(float *x, const bl_cand *saved, int s) {
    for (int i = s - 1; i >= 0; i--) x[saved[i].id] = saved[i].logit; /* backwards: a token saved twice ends original */
}

static double temperature_of(const bl_sampling *p) { return p->temperature > 1e-6 ? p->temperature : 1e-6; }

/* the draw among the first `keep` candidates: u through the cumulative distribution after temperature */
static int draw(const bl_cand *c, int keep, double t, double u) {
    const double z0 = c[0].logit;
    double s = 0, acc = 0;
    for (int i = 0; i < keep; i++) s += exp(((double)c[i].logit - z0) / t);
    for (int i = 0; i < keep; i++) {
        acc += exp(((double)c[i].logit - z0) / t) / s;
        if (acc > u) return c[i].id;
    }
    return c[keep - 1].id;
}

/* top-p then min-p over m sorted candidates whose probabilities are exp(z - z0) / total. Returns the number
 * kept, or 0 when neither cut falls within the m (the kept set may extend past them). */
static int cuts(const bl_cand *c, int m, const bl_sampling *p, double total, int all_known) {
    const double z0 = c[0].logit;
    int keep = all_known ? m : 0;
    if (p->top_p < 1) {
        double acc = 0;
        for (int i = 0; i < m; i++) {
            acc += exp((double)c[i].logit - z0) / total;
            if (acc >= p->top_p) { keep = i + 1; break; }
        }
    }
    if (p->min_p > 0) {
        const double floor = p->min_p * (1.0 / total);
        int lim = keep ? keep : m, cnt = 0;
        for (int i = 0; i < lim; i++) cnt += exp((double)c[i].logit - z0) / total >= floor;
        if (cnt < lim || keep) keep = cnt > 1 ? cnt : 1;
    }
    return keep;
}

/* ---- top-k off: the wide path ----
 * With no top-k the candidates are the whole vocabulary. When the top-p / min-p cut or the draw falls past
 * the best 256, the cumulative distribution is walked in buckets of the logit's distance below the best
 * one instead of a full sort: each bucket's mass is summed in one pass, and only the bucket where the
 * cumulative crosses its target is gathered and sorted. */

#define WALK_BUCKETS 2048

typedef struct walk_set {
    double z0;   /* the best allowed logit */
    float lo;    /* members have x >= lo (min-p) and x > -inf */
    int bounded; /* and come no later than (zb, idb) in the best-first order (top-p) */
    float zb;
    int32_t idb;
} walk_set;

static inline int member(const float *x, int i, const uint32_t *allowed, const walk_set *w) {
    const float z = x[i];
    if (!(z >= w->lo) || z == -INFINITY || !bl_allowed(allowed, i)) return 0;
    return !w->bounded || z > w->zb || (z == w->zb && i <= w->idb);
}

static inline int bucket_of(float z, double z0, double inv) {
    double d = (z0 - (double)z) * inv;
    return d < WALK_BUCKETS - 1 ? (int)d : WALK_BUCKETS - 1;
}

/* The member where the running sum of exp((z - z0) / t) / (their total), best first, first reaches target
 * (>= when inclusive, > otherwise); the last member when rounding keeps it short. *total_out: the total. */
static bl_cand walk(const float *x, int n, const uint32_t *allowed, const walk_set *w, double t, double target,
                    int inclusive, bl_cand *scratch, double *total_out) {
    double mass[WALK_BUCKETS];
    int count[WALK_BUCKETS];
    const double inv = WALK_BUCKETS / (40.0 * (t > 1 ? t : 1)); /* past 40 t below the best: e^-40 each */
    memset(mass, 0, sizeof mass);
    memset(count, 0, sizeof count);
    for (int i = 0; i < n; i++) {
        if (!member(x, i, allowed, w)) continue;
        int b = bucket_of(x[i], w->z0, inv);
        mass[b] += exp(((double)x[i] - w->z0) / t);
        count[b]++;
    }
    double total = 0;
    int last_b = -1;
    for (int b = 0; b < WALK_BUCKETS; b++)
        if (count[b]) { total += mass[b]; last_b = b; }
    if (total_out) *total_out = total;
    bl_cand last = {-INFINITY, -1};
    double acc = 0;
    for (int b = 0; b <= last_b; b++) {
        if (!count[b]) continue;
        double next = acc + mass[b] / total;
        if (b < last_b && (inclusive ? next < target : next <= target)) {
            acc = next;
            continue;
        }
        int k = 0;
        for (int i = 0; i < n; i++)
            if (member(x, i, allowed, w) && bucket_of(x[i], w->z0, inv) == b) scratch[k++] = (bl_cand){x[i], i};
        qsort(scratch, (size_t)k, sizeof *scratch, cand_order);
        for (int j = 0; j < k; j++) {
            acc += exp(((double)scratch[j].logit - w->z0) / t) / total;
            if (inclusive ? acc >= target : acc > target) return scratch[j];
        }
        last = scratch[k - 1];
    }
    return last;
}

static int choose_wide(const float *x, int n, const bl_sample_ctx *c, double u, float z0) {
    const bl_sampling *p = &c->p;
    walk_set w = {.z0 = z0, .lo = -INFINITY, .bounded = 0};
    double total = 0;
    if (p->top_p < 1) {
        bl_cand b = walk(x, n, c->allowed, &w, 1.0, p->top_p, 1, c->scratch, &total);
        w.bounded = 1;
        w.zb = b.logit;
        w.idb = b.id;
    } else if (p->min_p > 0) {
        for (int i = 0; i < n; i++)
            if (member(x, i, c->allowed, &w)) total += exp((double)x[i] - w.z0);
    }
    if (p->min_p > 0) {
        /* the lowest float z the reference's test keeps: exp(z - z0) / total >= min_p * (1 / total) */
        const double floor = p->min_p * (1.0 / total);
#define KEEPS(z) (exp((double)(z) - w.z0) / total >= floor)
        float lo = (float)(w.z0 + log(p->min_p));
        while (!KEEPS(lo) && lo < z0) lo = nextafterf(lo, INFINITY);
        while (KEEPS(nextafterf(lo, -INFINITY)) && lo > -INFINITY) lo = nextafterf(lo, -INFINITY);
#undef KEEPS
        w.lo = lo;
    }
    return walk(x, n, c->allowed, &w, temperature_of(p), u, 0, c->scratch, NULL).id;
}

static int choose(const float *x, int n, const bl_sample_ctx *c, double u) {
    const bl_sampling *p = &c->p;
    if (p->temperature <= 0) return bl_argmax(x, n, c->allowed);
    const int k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    const double t = temperature_of(p);
    const int cap = k < n ? k : (n < 256 ? n : 256);
    const int m = bl_top(x, n, c->allowed, cap, c->scratch);
    if (m == 0) return -1;
    const bl_cand *cd = c->scratch;
    const double z0 = cd[0].logit;
    if (m < cap || cap >= k) { /* the whole candidate set */
        double total = 0;
        for (int i = 0; i < m; i++) total += exp((double)cd[i].logit - z0);
        return draw(cd, cuts(cd, m, p, total, 1), t, u);
    }
    /* top-k off and more candidates than these m: normalize over the whole row */
    const double total = bl_sum_exp(x, n, c->allowed, cd[0].logit, 1.0f, -INFINITY);
    const int keep = cuts(cd, m, p, total, 0);
    if (keep) return draw(cd, keep, t, u);
    if (p->top_p >= 1) {
        /* no cut within the m: every token min-p keeps takes part; the draw usually lands among the m */
        const float lo = p->min_p > 0 ? (float)(z0 + log(p->min_p)) : -INFINITY;
        const double s = bl_sum_exp(x, n, c->allowed, cd[0].logit, (float)(1.0 / t), lo);
        double acc = 0;
        for (int i = 0; i < m && cd[i].logit >= lo; i++) {
            acc += exp(((double)cd[i].logit - z0) / t) / s;
            if (acc > u) return cd[i].id;
        }
    }
    return choose_wide(x, n, c, u, cd[0].logit);
}

int bl_sample(float *x, int n, const bl_sample_ctx *c, double u) {
    int s = adjust(x, n, c);
    int tok = choose(x, n, c, u);
    restore(x, c->saved, s);
    return tok;
}

int bl_sample_candidates(float *x, int n, const bl_sample_ctx *c, int32_t *ids, double *probs) {
    int s = adjust(x, n, c);
    const bl_sampling *p = &c->p;
    int kept = 0;
    if (p->temperature <= 0) {
        int tok = bl_argmax(x, n, c->allowed);
        if (tok >= 0) { ids[0] = tok; probs[0] = 1; kept = 1; }
    } else {
        const int k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
        int m = bl_top(x, n, c->allowed, k, c->scratch);
        if (m > 0) {
            const bl_cand *cd = c->scratch;
            const double z0 = cd[0].logit, t = temperature_of(p);
            double total = 0, s2 = 0;
            for (int i = 0; i < m; i++) total += exp((double)cd[i].logit - z0);
            kept = cuts(cd, m, p, total, 1);
            for (int i = 0; i < kept; i++) s2 += exp(((double)cd[i].logit - z0) / t);
            for (int i = 0; i < kept; i++) {
                ids[i] = cd[i].id;
                probs[i] = exp(((double)cd[i].logit - z0) / t) / s2;
            }
        }
    }
    restore(x, c->saved, s);
    return kept;
}

double bl_logprobs(const float *x, int n, int token, int k, bl_cand *top, double *top_lp, int *n_top) {
    const float m = bl_row_max(x, n);
    const double lse = (double)m + log(bl_sum_exp(x, n, NULL, m, 1.0f, -INFINITY));
    *n_top = k > 0 ? bl_top(x, n, NULL, k, top) : 0;
    for (int i = 0; i < *n_top; i++) top_lp[i] = (double)top[i].logit - lse;
    return (double)x[token] - lse;
}
