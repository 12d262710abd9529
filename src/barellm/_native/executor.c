/* The executor (see executor.h). */
#include "executor.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

static void run_qjobs(const bl_op *op, int r0, int r1) {
    for (int j = 0; j < op->n_qjobs; j++) {
        const bl_qjob *q = &op->qjobs[j];
        const float *x = q->x ? q->x : op->out;
        const size_t xs = q->x ? q->x_stride : op->out_stride;
        if (r1 > r0)
            bl_quantize_act(&q->w, x + (size_t)r0 * xs, xs, r1 - r0, (char *)q->dst + (size_t)r0 * q->dst_stride);
    }
}

static void op_embed(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    (void)seq;
    int t0, t1;
    bl_split(p->T, 1, tid, nth, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        float *out = op->out + (size_t)t * op->out_stride;
        bl_dequantize_row(&op->table, p->tokens[t], out); /* any layout: a tied table may be stored repacked */
        if (op->scale_embed != 0.0f && op->scale_embed != 1.0f)
            for (int i = 0; i < op->n; i++) out[i] *= op->scale_embed;
    }
}

static void op_rmsnorm(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    (void)seq;
    int i0, i1;
    bl_split(op->rows_sel ? p->n_out : p->T, 1, tid, nth, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        const int src = op->rows_sel ? p->out_rows[i] : i;
        float *out = op->out + (size_t)i * op->out_stride;
        bl_rmsnorm(op->x + (size_t)src * op->x_stride, op->w, out, op->n, op->eps);
        if (op->res) bl_add(op->res + (size_t)i * op->res_stride, out, op->n);
    }
    run_qjobs(op, i0, i1);
}

/* Whether each thread can take a range of whole blocks of every token's values: the qjobs convert the
 * op's own output, of the op's length, which is whole blocks. */
static int splits_by_blocks(const bl_op *op) {
    if (op->n % BL_ACT_BLOCK) return 0;
    for (int j = 0; j < op->n_qjobs; j++)
        if (op->qjobs[j].x || op->qjobs[j].w.cols != op->n) return 0;
    return 1;
}

static void op_silu_mul(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    (void)seq;
    void (*act)(const float *, const float *, float *, int) = op->gelu ? bl_gelu_mul : bl_silu_mul;
    if (p->T < nth && splits_by_blocks(op)) {
        /* fewer tokens than threads (decode): by tokens one thread would do it all while the others wait
         * at the barrier; elementwise work and block conversion give the same bits split either way */
        int b0, b1;
        bl_split(op->n / BL_ACT_BLOCK, 1, tid, nth, &b0, &b1);
        if (b0 >= b1) return;
        const int i0 = b0 * BL_ACT_BLOCK, len = (b1 - b0) * BL_ACT_BLOCK;
        for (int t = 0; t < p->T; t++) {
            float *out = op->out + (size_t)t * op->out_stride;
            act(op->x + (size_t)t * op->x_stride + i0, op->x2 + (size_t)t * op->x_stride + i0, out + i0, len);
            for (int j = 0; j < op->n_qjobs; j++) {
                const bl_qjob *q = &op->qjobs[j];
                bl_quantize_act_blocks(&q->w, out, (char *)q->dst + (size_t)t * q->dst_stride, b0, b1);
            }
        }
        return;
    }
    int t0, t1;
    bl_split(p->T, 1, tid, nth, &t0, &t1);
    for (int t = t0; t < t1; t++)
        act(op->x + (size_t)t * op->x_stride, op->x2 + (size_t)t * op->x_stride, op->out + (size_t)t * op->out_stride,
            op->n);
    run_qjobs(op, t0, t1);
}

#define PACK(seq, f, e) (((uint64_t)(seq) << 48) | ((uint64_t)(f) << 24) | (uint64_t)(e))
#define SEQ(w) ((unsigned)((w) >> 48))
#define FRONT(w) ((int)(((w) >> 24) & 0xFFFFFF))
#define END(w) ((int)((w) & 0xFFFFFF))

static int take_front(bl_steal_slot *s, unsigned seq, int *c) {
    uint64_t w = atomic_load_explicit(&s->w, memory_order_acquire);
    for (;;) {
        if (SEQ(w) != seq || FRONT(w) >= END(w)) return 0;
        if (atomic_compare_exchange_weak_explicit(&s->w, &w, PACK(seq, FRONT(w) + 1, END(w)), memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *c = FRONT(w);
            return 1;
        }
    }
}

static int take_back(bl_steal_slot *s, unsigned seq, int *c) {
    uint64_t w = atomic_load_explicit(&s->w, memory_order_acquire);
    for (;;) {
        if (SEQ(w) != seq || FRONT(w) >= END(w)) return 0;
        if (atomic_compare_exchange_weak_explicit(&s->w, &w, PACK(seq, FRONT(w), END(w) - 1), memory_order_acq_rel,
                                                  memory_order_acquire)) {
            *c = END(w) - 1;
            return 1;
        }
    }
}

/* The chunks of an op's [0, n) for this thread: first its own range from the front, then the others'
 * from the back. Call with *victim = -1 first; returns 0 when none is left. */
static void steal_init(const bl_plan *p, int tid, int nth, unsigned seq, int n) {
    int c0, c1;
    bl_split(n, 1, tid, nth, &c0, &c1);
    atomic_store_explicit(&p->steal[tid].w, PACK(seq, c0, c1), memory_order_release);
}

static int steal_next(const bl_plan *p, int tid, int nth, unsigned seq, int *victim, int *c) {
    if (*victim < 0) {
        if (take_front(&p->steal[tid], seq, c)) return 1;
        *victim = 1;
    }
    for (; *victim < nth; ++*victim)
        if (take_back(&p->steal[(tid + *victim) % nth], seq, c)) return 1;
    return 0;
}

static void matmul_rows(const bl_op *op, int T, int lo, int hi) {
    for (int k = 0; k < op->n_parts; k++) {
        const bl_mm_part *pt = &op->parts[k];
        const int a = lo > pt->row0 ? lo - pt->row0 : 0;
        const int b = hi - pt->row0 < pt->w.rows ? hi - pt->row0 : pt->w.rows;
        if (a >= b) continue;
        bl_matmul(&pt->w, pt->xq, T, pt->out, pt->ldo, a, b);
        if (pt->bias)
            for (int t = 0; t < T; t++) bl_add(pt->out + (size_t)t * pt->ldo + a, pt->bias + a, b - a);
        if (pt->res)
            for (int t = 0; t < T; t++)
                bl_add(pt->res + (size_t)t * pt->res_stride + a, pt->out + (size_t)t * pt->ldo + a, b - a);
    }
}

static void op_matmul(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    const int T = op->rows_sel ? p->n_out : p->T;
    if (T <= 0) return;
    if (!op->prequantized && op->n_qjobs) {
        int t0, t1;
        bl_split(T, 1, tid, nth, &t0, &t1);
        run_qjobs(op, t0, t1);
        bl_pool_barrier(p->pool, tid);
    }
    bl_shared_stream = nth > 1;
    if (nth == 1) {
        matmul_rows(op, T, 0, op->n_rows);
        return;
    }
    /* chunks of whole row groups, 8 per thread for a few tokens' worth of compute each; 2 when the op is a
     * stream of weights from memory (decode): each chunk starts its weights' stream and its prefetching
     * cold, and with 2 a chunk the 2-thread decode of SmolLM2 and of Qwen2.5-Coder-1.5B ran 4-5% faster
     * (prefill the same either way), while a slow thread's last chunk can still be taken by the others */
    const int per = T <= 4 ? 2 : 8;
    const int A = op->row_align, want = (op->n_rows + per * nth - 1) / (per * nth);
    const int CH = want > A ? (want + A - 1) / A * A : A;
    const int nch = (op->n_rows + CH - 1) / CH;
    int c, victim = -1;
    steal_init(p, tid, nth, seq, nch);
    while (steal_next(p, tid, nth, seq, &victim, &c))
        matmul_rows(op, T, c * CH, c + 1 < nch ? (c + 1) * CH : op->n_rows);
}

/* bytes of the unit slot_stride counts in: an element of an f32 or f16 cache, a byte of a q8_0 one */
static inline size_t kv_unit(int kv_type) { return kv_type == BL_KV_F32 ? 4 : kv_type == BL_KV_F16 ? 2 : 1; }

/* A q8_0 cache holds each key minus a constant vector (k_shift: the K projection's bias, where the model
 * has one) and turned by the Walsh-Hadamard transform H; the queries are turned alike (attend_items). A
 * constant added to every key adds the same q . c to all of a query's scores, which the softmax cancels,
 * and H is orthonormal: the attention is the same but for the rounding of what is stored. What the rounding
 * costs is the point: 8-bit blocks scaled by their largest value lose the small components of a key beside
 * a large one, and Qwen2's keys are dominated by a bias of a few large values (up to 270 against an
 * informative part of a few units in some layers). Without the shift and the transform, Qwen2.5-Coder-0.5B
 * lost 7.8% of perplexity to a q8_0 cache; llama.cpp turns keys and queries by H for the same reason. */
static void store_q8_keys(const bl_op *op, char *kc, char *vc, const float *k, const float *v, int pos) {
    const int hd = op->head_dim;
    const size_t head = (size_t)op->n_ctx * bl_kv_row_bytes(hd, op->kv_type);
    float kh[hd];
    for (int h = 0; h < op->n_kv_heads; h++) {
        const float *src = k + (size_t)h * hd;
        if (op->k_shift)
            for (int i = 0; i < hd; i++) kh[i] = src[i] - op->k_shift[(size_t)h * hd + i];
        else memcpy(kh, src, sizeof kh);
        bl_hadamard(kh, hd, bl_kv_rotation(hd));
        bl_kv_store(kc + h * head, vc + h * head, kh, v + (size_t)h * hd, pos, 1, hd, op->n_ctx, op->kv_type);
    }
}

static void op_rope_kv(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    (void)seq;
    int t0, t1;
    bl_split(p->T, 1, tid, nth, &t0, &t1);
    const int qd = op->n_heads * op->head_dim, kd = op->n_kv_heads * op->head_dim;
    for (int t = t0; t < t1; t++) {
        float *row = op->out + (size_t)t * op->out_stride;
        const float *cs = op->rope_cs + (size_t)p->pos[t] * op->rope_dim;
        if (op->q_norm)
            for (int h = 0; h < op->n_heads; h++)
                bl_rmsnorm(row + h * op->head_dim, op->q_norm, row + h * op->head_dim, op->head_dim, op->eps);
        if (op->k_norm)
            for (int h = 0; h < op->n_kv_heads; h++)
                bl_rmsnorm(row + qd + h * op->head_dim, op->k_norm, row + qd + h * op->head_dim, op->head_dim, op->eps);
        if (op->rope_dim) { /* 0: a layer without RoPE (SmolLM3's every fourth) */
            bl_rope(row, op->n_heads, op->head_dim, op->rope_dim, cs, op->rope_style);
            bl_rope(row + qd, op->n_kv_heads, op->head_dim, op->rope_dim, cs, op->rope_style);
        }
        const size_t s = (size_t)p->slot[t] * op->slot_stride * kv_unit(op->kv_type);
        if (op->kv_type == BL_KV_Q8_0) store_q8_keys(op, op->kc + s, op->vc + s, row + qd, row + qd + kd, p->pos[t]);
        else bl_kv_store(op->kc + s, op->vc + s, row + qd, row + qd + kd, p->pos[t], op->n_kv_heads, op->head_dim,
                         op->n_ctx, op->kv_type);
    }
}

/* Work items are (kv head g, token t, head j of g's group), g-major. They are dealt in units of
 * consecutive items (work stealing as for the matmuls: causal attention costs more for later tokens);
 * within a unit, consecutive items of one kv head and one slot go to bl_attend together. */
static void attend_items(const bl_plan *p, const bl_op *op, int u0, int u1) {
    const int grp = op->n_heads / op->n_kv_heads, per_g = p->T * grp, hd = op->head_dim;
    const size_t esz = kv_unit(op->kv_type), head = (size_t)op->n_ctx * bl_kv_row_bytes(hd, op->kv_type);
    const int turn = op->kv_type == BL_KV_Q8_0; /* the queries turned as the keys are (store_q8_keys) */
    float turned[turn ? BL_ATT_MAXQ * hd : 1];
    bl_attn_query qs[BL_ATT_MAXQ];
    int nq = 0, cur_g = -1, cur_slot = -1;
    for (int u = u0; u <= u1; u++) {
        int g = -1, t = 0, j = 0;
        if (u < u1) {
            g = u / per_g;
            t = (u % per_g) / grp;
            j = u % grp;
        }
        if (nq && (u == u1 || g != cur_g || p->slot[t] != cur_slot || nq == BL_ATT_MAXQ)) {
            const size_t off = (size_t)cur_slot * op->slot_stride * esz + (size_t)cur_g * head;
            bl_attend(qs, nq, op->kc + off, op->vc + off, hd, op->scale, op->softcap, op->kv_type);
            nq = 0;
        }
        if (u == u1) break;
        const int h = g * grp + j;
        cur_g = g;
        cur_slot = p->slot[t];
        qs[nq].q = op->x + (size_t)t * op->x_stride + (size_t)h * hd;
        if (turn) {
            float *q = turned + (size_t)nq * hd;
            memcpy(q, qs[nq].q, sizeof(float) * hd);
            bl_hadamard(q, hd, bl_kv_rotation(hd));
            qs[nq].q = q;
        }
        qs[nq].out = op->out + (size_t)t * op->out_stride + (size_t)h * hd;
        qs[nq].pos = p->pos[t];
        qs[nq].lo = op->window && p->pos[t] >= op->window ? p->pos[t] - op->window + 1 : 0;
        qs[nq].sink = op->sinks ? op->sinks[h] : -INFINITY;
        nq++;
    }
}

static void op_attention(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    const int n = p->T * op->n_heads;
    if (nth == 1) {
        attend_items(p, op, 0, n);
        return;
    }
    /* units: a token's heads of one kv head at least (decode: a few units to share), BL_ATT_MAXQ items
     * at most (prefill: K and V tiles shared by up to that many queries) */
    const int grp = op->n_heads / op->n_kv_heads, want = (n + 4 * nth - 1) / (4 * nth);
    const int U = want < grp ? grp : want > BL_ATT_MAXQ ? BL_ATT_MAXQ : want;
    const int nu = (n + U - 1) / U;
    int c, victim = -1;
    steal_init(p, tid, nth, seq, nu);
    while (steal_next(p, tid, nth, seq, &victim, &c)) attend_items(p, op, c * U, c + 1 < nu ? (c + 1) * U : n);
}

/* cap * tanh(x / cap) in plain C (libm's tanhf), the same on every tier. */
static void op_softcap(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    (void)seq;
    int i0, i1;
    bl_split(op->rows_sel ? p->n_out : p->T, 1, tid, nth, &i0, &i1);
    for (int i = i0; i < i1; i++) {
        float *row = op->out + (size_t)i * op->out_stride;
        for (int j = 0; j < op->n; j++) row[j] = op->softcap * tanhf(row[j] / op->softcap);
    }
}

/* A token's experts and their weights (bl_moe): the n_used largest logits, by selection (ties to the lower id),
 * and exp(l - max) over the sum of those of the chosen experts (norm_weights) or of all. llama.cpp takes the
 * softmax, its top n_used and renormalizes; the softmax keeps the logits' order, so choosing on the logits
 * picks the same experts without rounding, and in plain C (not a tier's kernel) on every ISA alike. */
static void moe_route(const bl_moe *m, const float *l, int32_t *choice, float *weight) {
    for (int k = 0; k < m->n_used; k++) {
        int best = -1;
        for (int e = 0; e < m->n_experts; e++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= choice[j] == e;
            if (!taken && (best < 0 || l[e] > l[best])) best = e;
        }
        choice[k] = best;
    }
    const double top = l[choice[0]];
    double sum = 0;
    if (m->norm_weights)
        for (int k = 0; k < m->n_used; k++) sum += exp((double)l[choice[k]] - top);
    else
        for (int e = 0; e < m->n_experts; e++) sum += exp((double)l[e] - top);
    for (int k = 0; k < m->n_used; k++) weight[k] = (float)(exp((double)l[choice[k]] - top) / sum);
}

/* g[0, n) = act(g[0, n), u = g[n, 2n)) in place; gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai, alpha 1.702,
 * limit 7) in plain C, the others by the tier's kernels */
static void moe_act(int act, float *g, int n) {
    if (act == BL_MOE_GELU) bl_gelu_mul(g, g + n, g, n);
    else if (act == BL_MOE_SILU) bl_silu_mul(g, g + n, g, n);
    else
        for (int i = 0; i < n; i++) {
            const float x = fminf(g[i], 7.0f), u = fminf(fmaxf(g[n + i], -7.0f), 7.0f);
            g[i] = x / (1.0f + expf(-1.702f * x)) * (u + 1.0f);
        }
}

/* Pairs [j0, j1) (each of expert pair_expert[j]): (the biases,) act(gate) * up over the gate half of their
 * products, converted for down. */
static void moe_act_pairs(const bl_moe *m, const int32_t *pair_expert, int j0, int j1) {
    const int F = m->ffn;
    for (int j = j0; j < j1; j++) {
        float *g = m->gu + (size_t)j * m->gu_stride;
        const size_t e = (size_t)pair_expert[j];
        if (m->gate_bias) bl_add(g, m->gate_bias + e * F, F);
        if (m->up_bias) bl_add(g + F, m->up_bias + e * F, F);
        moe_act(m->act, g, F);
        bl_quantize_act(&m->down, g, m->gu_stride, 1, (char *)m->aq + (size_t)j * m->aq_stride);
    }
}

/* Gate and up of every expert that has pairs, split over threads by (expert, chunk of its 2 ffn rows: gate's,
 * then up's), each pair's converted input giving its products in gu. Returns whether each expert went whole
 * to one thread, which then also ran moe_act_pairs over its pairs (so no other thread waits for them). */
static int moe_gate_up(const bl_moe *m, const int32_t *start, const int32_t *pair_expert, int tid, int nth) {
    const int F = m->ffn, rows_per = 2 * F, pairs = start[m->n_experts];
    int active = 0;
    for (int e = 0; e < m->n_experts; e++) active += start[e + 1] > start[e];
    int A = bl_matmul_row_align(&m->gate);
    if (bl_matmul_row_align(&m->up) > A) A = bl_matmul_row_align(&m->up);
    /* as op_matmul: 2 chunks per thread when the experts' weights are a stream from memory, else 8 */
    const int per = pairs <= 4 * m->n_used ? 2 : 8, want = (active * rows_per + per * nth - 1) / (per * nth);
    int CH = want > A ? (want + A - 1) / A * A : A;
    if (CH > rows_per) CH = rows_per;
    const int per_expert = (rows_per + CH - 1) / CH, whole = per_expert == 1;
    const char *xu = m->xg_up ? m->xg_up : m->xg;
    const size_t xu_stride = m->xg_up ? m->xg_up_stride : m->xg_stride;
    int i0, i1;
    bl_split(active * per_expert, 1, tid, nth, &i0, &i1);
    for (int e = 0, item = 0; e < m->n_experts && item < i1; e++) {
        const int n = start[e + 1] - start[e], j = start[e];
        if (!n) continue;
        const int ran = item >= i0; /* (whole: this expert's one item is this thread's) */
        for (int c = 0; c < per_expert; c++, item++) {
            if (item < i0 || item >= i1) continue;
            const int r0 = c * CH, r1 = r0 + CH < rows_per ? r0 + CH : rows_per;
            float *out = m->gu + (size_t)j * m->gu_stride;
            if (r0 < F) {
                const bl_matrix w = bl_moe_expert(&m->gate, F, e);
                bl_matmul(&w, (const char *)m->xg + (size_t)j * m->xg_stride, n, out, m->gu_stride, r0, r1 < F ? r1 : F);
            }
            if (r1 > F) {
                const bl_matrix w = bl_moe_expert(&m->up, F, e);
                bl_matmul(&w, xu + (size_t)j * xu_stride, n, out + F, m->gu_stride, r0 > F ? r0 - F : 0, r1 - F);
            }
        }
        if (whole && ran) moe_act_pairs(m, pair_expert, j, j + n);
    }
    return whole;
}

/* Down of every expert that has pairs, and each token's weighted sum of its experts' outputs, over this
 * thread's share of the output rows: each thread takes the same rows of every expert, so that the sums of
 * its columns need no other thread's results (no barrier), and the threads' shares are equal whatever the
 * experts' numbers of pairs. A token's experts are summed in the order they were chosen. */
static void moe_down(const bl_op *op, const bl_moe *m, const int32_t *start, int T, int tid, int nth) {
    const int K = m->n_used, n = op->n, A = bl_matmul_row_align(&m->down);
    const int32_t *pair_of = m->index + m->n_experts + 1 + (size_t)T * K;
    int g0, g1;
    bl_split((n + A - 1) / A, 1, tid, nth, &g0, &g1);
    const int r0 = g0 * A, r1 = g1 * A < n ? g1 * A : n;
    if (r0 >= r1) return;
    for (int e = 0; e < m->n_experts; e++) {
        const int np = start[e + 1] - start[e], j = start[e];
        if (!np) continue;
        const bl_matrix w = bl_moe_expert(&m->down, n, e);
        bl_matmul(&w, (const char *)m->aq + (size_t)j * m->aq_stride, np, m->y + (size_t)j * m->y_stride, m->y_stride,
                  r0, r1);
    }
    for (int t = 0; t < T; t++) {
        float *out = op->out + (size_t)t * op->out_stride;
        for (int k = 0; k < K; k++) {
            const float w = m->weight[(size_t)t * K + k];
            float *y = m->y + (size_t)pair_of[(size_t)t * K + k] * m->y_stride;
            if (m->down_bias) bl_add(y + r0, m->down_bias + (size_t)m->choice[(size_t)t * K + k] * n + r0, r1 - r0);
            if (k == 0)
                for (int i = r0; i < r1; i++) out[i] = w * y[i];
            else
                for (int i = r0; i < r1; i++) out[i] += w * y[i];
        }
        if (op->res) bl_add(op->res + (size_t)t * op->res_stride + r0, out + r0, r1 - r0);
    }
}

/* Tokens [t0, t1)'s inputs converted for gate (and up), once a token, into the rows of each of its pairs. */
static void moe_convert(const bl_op *op, const bl_moe *m, const int32_t *pair_of, int t0, int t1) {
    const int K = m->n_used;
    const size_t gb = bl_act_row_bytes(&m->gate, m->gate.cols), ub = m->xg_up ? bl_act_row_bytes(&m->up, m->up.cols) : 0;
    for (int t = t0; t < t1; t++) {
        const float *x = op->x + (size_t)t * op->x_stride;
        const int32_t *pj = pair_of + (size_t)t * K;
        char *g = (char *)m->xg + (size_t)pj[0] * m->xg_stride;
        bl_quantize_act(&m->gate, x, op->x_stride, 1, g);
        for (int k = 1; k < K; k++) memcpy((char *)m->xg + (size_t)pj[k] * m->xg_stride, g, gb);
        if (m->xg_up) {
            char *u = (char *)m->xg_up + (size_t)pj[0] * m->xg_up_stride;
            bl_quantize_act(&m->up, x, op->x_stride, 1, u);
            for (int k = 1; k < K; k++) memcpy((char *)m->xg_up + (size_t)pj[k] * m->xg_up_stride, u, ub);
        }
    }
}

/* Up to this many tokens, one thread routes, groups and converts them (a few microseconds a token) while the
 * others wait at one barrier, instead of three barriers between phases of a token or so each (decode). */
#define MOE_SOLO_T 4

static void op_moe(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    (void)seq;
    const bl_moe *m = &op->moe;
    const int T = p->T, K = m->n_used, E = m->n_experts, P = T * K;
    int32_t *start = m->index, *pair_token = m->index + E + 1, *pair_of = pair_token + P, *pair_expert = pair_of + P;
    const int solo = T <= MOE_SOLO_T;
    int a, b;
    /* route each token */
    if (!solo) {
        bl_split(T, 1, tid, nth, &a, &b);
        for (int t = a; t < b; t++)
            moe_route(m, m->logits + (size_t)t * m->logits_stride, m->choice + (size_t)t * K, m->weight + (size_t)t * K);
        bl_pool_barrier(p->pool, tid);
    }
    /* group the pairs by expert, each expert's in token order (T * n_used steps: one thread) */
    if (tid == 0) {
        if (solo)
            for (int t = 0; t < T; t++)
                moe_route(m, m->logits + (size_t)t * m->logits_stride, m->choice + (size_t)t * K,
                          m->weight + (size_t)t * K);
        memset(start, 0, sizeof(int32_t) * (E + 1));
        for (int i = 0; i < P; i++) start[m->choice[i] + 1]++;
        for (int e = 0; e < E; e++) start[e + 1] += start[e];
        int32_t next[E];
        memcpy(next, start, sizeof next);
        for (int i = 0; i < P; i++) {
            const int j = next[m->choice[i]]++;
            pair_token[j] = i / K;
            pair_of[i] = j;
            pair_expert[j] = m->choice[i];
        }
        if (solo) moe_convert(op, m, pair_of, 0, T);
    }
    bl_pool_barrier(p->pool, tid);
    if (!solo) {
        bl_split(T, 1, tid, nth, &a, &b);
        moe_convert(op, m, pair_of, a, b);
        bl_pool_barrier(p->pool, tid);
    }
    bl_shared_stream = nth > 1;
    if (!moe_gate_up(m, start, pair_expert, tid, nth)) {
        bl_pool_barrier(p->pool, tid);
        bl_split(P, 1, tid, nth, &a, &b);
        moe_act_pairs(m, pair_expert, a, b);
    }
    bl_pool_barrier(p->pool, tid);
    moe_down(op, m, start, T, tid, nth);
}

/* The dispatch, from the op table (executor.h): OP_RUN[kind] is op_<name>. */
typedef void (*op_fn)(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq);
#define OP_ENTRY(KIND, name, id, required, optional) [BL_OP_##KIND] = op_##name,
static const op_fn OP_RUN[BL_OP_KIND_END] = {BL_OP_KINDS(OP_ENTRY)};
#undef OP_ENTRY

static inline void exec_op(const bl_plan *p, const bl_op *op, int tid, int nth, unsigned seq) {
    if (op->kind > 0 && op->kind < BL_OP_KIND_END && OP_RUN[op->kind]) OP_RUN[op->kind](p, op, tid, nth, seq);
}

static void plan_task(void *ctx, int tid, int nth) {
    const bl_plan *p = ctx;
    uint64_t *prof = p->op_cycles ? p->op_cycles + (size_t)tid * p->n_ops : NULL;
    uint64_t c0 = prof ? bl_cycles() : 0;
    for (int i = p->begin; i < p->end; i++) {
        exec_op(p, &p->ops[i], tid, nth, (p->run_seq * 1024u + (unsigned)i) & 0xFFFFu);
        if (i + 1 < p->end) bl_pool_barrier(p->pool, tid);
        if (prof) {
            uint64_t c1 = bl_cycles();
            prof[i] += c1 - c0;
            c0 = c1;
        }
    }
}

static int adapt_choose(bl_adapt_state *a, int nth) {
    if (a->alone) {
        if (++a->since >= a->interval) { /* see whether the full pool helps again */
            a->since = 0;
            return nth;
        }
        return 1;
    }
    if (a->cool > 0) a->cool--;
    if (a->probe && a->cool == 0) {
        a->probe = 0;
        return 1;
    }
    return nth;
}

static void adapt_update(bl_adapt_state *a, int used, int nth, double per_token, double wait_frac) {
    const int k = used == 1 ? 0 : 1;
    const int current = (used == 1) == (a->alone != 0);
    a->cyc[k] = current && a->cyc[k] > 0 ? 0.7 * a->cyc[k] + 0.3 * per_token : per_token;
    if (!a->alone) {
        if (used == nth) {
            if (wait_frac > 0.25) a->probe = 1;
        } else if (a->cyc[0] < 0.9 * a->cyc[1]) {
            a->alone = 1;
            a->since = 0;
            a->interval = 8;
        } else { /* alone was no better: do not ask again for a while */
            a->cool = a->cool ? 2 * a->cool : 16;
            if (a->cool > 256) a->cool = 256;
        }
    } else if (used == nth) {
        if (a->cyc[1] < 0.85 * a->cyc[0]) { /* clearly better: back to the full pool */
            a->alone = 0;
            a->cool = 2;
        } else if (a->interval < 64) {
            a->interval *= 2;
        }
    }
}

void bl_plan_run(bl_plan *p, int T, int n_out, int begin, int end) {
    p->T = T;
    p->n_out = n_out;
    p->begin = begin;
    p->end = end;
    p->run_seq++;
    const int nth = bl_pool_size(p->pool);
    bl_adapt_state *a = &p->adapt[T > 1];
    const int whole = begin == 0 && end == p->n_ops;
    const int use = p->adaptive && nth > 1 && whole ? adapt_choose(a, nth) : nth;
    const uint64_t c0 = bl_cycles(), w0 = bl_pool_wait_cycles(p->pool);
    bl_pool_run_n(p->pool, plan_task, p, use);
    p->last_threads = use;
    if (p->adaptive && nth > 1 && whole) {
        const double dc = (double)(bl_cycles() - c0), dw = (double)(bl_pool_wait_cycles(p->pool) - w0);
        adapt_update(a, use, nth, dc / T, dc > 0 ? dw / dc : 0);
    }
}
