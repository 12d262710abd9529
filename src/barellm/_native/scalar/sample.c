/* The portable kernels of sample.h: the reference the other tiers match. */
#include <math.h>

#include "sample.h"

int bl_argmax_scalar(const float *x, int n, const uint32_t *allowed) {
    int best = -1, first = -1;
    float bv = -INFINITY;
    for (int i = 0; i < n; i++) {
        if (!bl_allowed(allowed, i)) continue;
        if (first < 0) first = i;
        if (x[i] > bv) { bv = x[i]; best = i; }
    }
    return best >= 0 ? best : first; /* every allowed value -inf or NaN: the first allowed */
}

int bl_top_scalar(const float *x, int n, const uint32_t *allowed, int m, bl_cand *h) {
    bl_heap_init(h, m);
    float thr = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > thr && bl_allowed(allowed, i)) thr = bl_heap_replace(h, m, x[i], i);
    return bl_heap_finish(h, m);
}

double bl_sum_exp_scalar(const float *x, int n, const uint32_t *allowed, float ref, float scale, float lo) {
    double s = 0;
    for (int i = 0; i < n; i++)
        if (x[i] >= lo && bl_allowed(allowed, i)) s += exp(((double)x[i] - ref) * scale);
    return s;
}

float bl_row_max_scalar(const float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

