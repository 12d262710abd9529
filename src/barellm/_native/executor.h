/* The executor: runs a plan (an array of ops over preallocated buffers) on the thread pool.
 *
 * engine.py builds the plan once at load; one bl_plan_run() call then runs a whole forward step
 * (T tokens through every layer): each thread walks the op list, does its share of each op (disjoint
 * output rows, aligned to cache lines and to the matmul row groups) and meets the others at a barrier
 * between ops. Nothing here allocates or takes a lock.
 *
 * Per-call inputs are read from arrays the plan points at (filled by the caller before each run):
 * tokens[T], pos[T] (position of each token), slot[T] (KV cache region of each token), and
 * out_rows[n_out] (the rows whose logits are wanted, gathered by the ops flagged rows_sel).
 */
#ifndef BARELLM_EXECUTOR_H
#define BARELLM_EXECUTOR_H

#include "kernels.h"
#include "ops.h"
#include "threadpool.h"

/* The op kinds, one row each: X(KIND, name, id, required keys, optional keys). Everything else about an op
 * kind follows from its row: the enum (BL_OP_KIND), the executor's dispatch to op_<name> (executor.c), the
 * name and id Python sees (nat.OP_KINDS) and the keys py_plan.c accepts in its dict, where a required key
 * that is absent or any key not listed (besides kind, name and rows_sel) is an error naming it. Adding an
 * op is its row here, its op_<name> in executor.c over the kernels, and its Python side, found by the same name:
 * plan.py's dataclass of that kind, NativeEngine._spec_<name> (its dict) and Debugger._numpy_<name>. */
#define BL_KEYS(...) ((const char *const[]){__VA_ARGS__, NULL})
#define BL_OP_KINDS(X)                                                                                         \
    /* out[t] = dequant(table row tokens[t]) (* scale_embed) */                                               \
    X(EMBED, embed, 1, BL_KEYS("out", "out_stride", "n", "table", "scale_embed"), BL_KEYS(NULL))              \
    /* out[i] = rmsnorm(x[row i], w) (then res[i] += out[i] if res); then the qjobs */                       \
    X(RMSNORM, rmsnorm, 2, BL_KEYS("x", "x_stride", "w", "eps", "n", "out", "out_stride"),                    \
      BL_KEYS("res", "res_stride", "qjobs"))                                                                  \
    /* qjobs (unless prequantized), barrier, parts: out = W xq (+ bias) (res += out) */                       \
    X(MATMUL, matmul, 3, BL_KEYS("parts", "qjobs"), BL_KEYS("prequantized"))                                  \
    /* (rmsnorm each q and k head,) rotate q and k of x[t] in place; store k, v (into a q8_0 cache:          \
     * H (k - k_shift), see op_rope_kv) */                                                                    \
    X(ROPE_KV, rope_kv, 4,                                                                                    \
      BL_KEYS("n_heads", "n_kv_heads", "head_dim", "n_ctx", "kc", "vc", "slot_stride", "kv_type", "out",      \
              "out_stride", "rope_dim", "eps", "rope_style", "rope_cs"),                                      \
      BL_KEYS("q_norm", "k_norm", "k_shift"))                                                                 \
    /* out[t] = attention of the q heads of x[t] over the slot's cache (scores soft-capped if softcap; each   \
     * head's sink in its denominator if sinks) */                                                            \
    X(ATTENTION, attention, 5,                                                                                \
      BL_KEYS("n_heads", "n_kv_heads", "head_dim", "n_ctx", "kc", "vc", "slot_stride", "kv_type", "window",   \
              "x", "x_stride", "out", "out_stride", "scale"),                                                 \
      BL_KEYS("softcap", "sinks"))                                                                            \
    /* out[t] = act(x[t]) * x2[t] (act: silu, or gelu_tanh if gelu); then the qjobs */                        \
    X(SILU_MUL, silu_mul, 6, BL_KEYS("x", "x2", "x_stride", "out", "out_stride", "n", "gelu"), BL_KEYS("qjobs"))   \
    /* out[t] = sum over the experts x[t] is routed to of weight * down_e (act(gate_e x[t]) * up_e x[t])      \
     * (then res[t] += out[t] if res): see bl_moe */                                                         \
    X(MOE, moe, 7,                                                                                            \
      BL_KEYS("x", "x_stride", "out", "out_stride", "n", "act", "logits", "logits_stride", "gate", "up",        \
              "down", "n_experts", "n_used", "ffn", "norm_weights", "choice", "weight", "index", "xg",         \
              "xg_stride", "gu", "gu_stride", "aq", "aq_stride", "y", "y_stride"),                            \
      BL_KEYS("res", "res_stride", "xg_up", "xg_up_stride", "gate_bias", "up_bias", "down_bias"))                                                 \
    /* out[i] = softcap * tanh(out[i] / softcap) over n values of each row (Gemma 2's logits) */               \
    X(SOFTCAP, softcap, 8, BL_KEYS("out", "out_stride", "n", "softcap"), BL_KEYS(NULL))

#define BL_OP_ENUM(KIND, name, id, required, optional) BL_OP_##KIND = id,
enum bl_op_kind { BL_OP_KINDS(BL_OP_ENUM) BL_OP_KIND_END };
#undef BL_OP_ENUM

#define BL_MAX_PARTS 4
#define BL_MAX_QJOBS 4

typedef struct bl_qjob { /* convert f32 rows into w's activation type */
    bl_matrix w;         /* only its type, layout and cols matter */
    const float *x;      /* source rows (matmul phase); the op's own output rows for an epilogue */
    size_t x_stride;     /* floats */
    void *dst;
    size_t dst_stride;   /* bytes: bl_act_row_bytes(w, cols) */
} bl_qjob;

typedef struct bl_mm_part { /* rows [row0, row0 + w.rows) of a matmul op's row space */
    bl_matrix w;
    const void *xq;
    float *out;
    size_t ldo;
    const float *bias;     /* if set: out[t * ldo + r] += bias[r] (before res) */
    float *res;            /* if set: res[t * res_stride + r] += out[t * ldo + r] */
    size_t res_stride;
    int row0;
} bl_mm_part;

/* A mixture-of-experts MLP. Each token goes to the n_used experts with the largest router logits (ties to the
 * lower id), weighted by the softmax of the logits over all experts, or over the chosen ones with norm_weights.
 * The op works on (token, expert) pairs grouped by expert, each expert's in token order, so that an expert's
 * weights are read once per step for all its tokens (one matmul of as many vectors), and in decode only the
 * chosen experts' are read at all. A pair's values depend on its token and expert alone (the matmul kernels'
 * invariance), and each token sums its experts' outputs in the order they were chosen: the result is the
 * same whatever the batch, the chunking or the thread split. Rows of the scratch are pairs, at most
 * max_T * n_used of them. */
enum bl_moe_act { BL_MOE_SILU = 0, BL_MOE_GELU = 1, BL_MOE_SWIGLU_OAI = 2 };

typedef struct bl_moe {
    int n_experts, n_used;
    int ffn;                      /* rows of an expert's gate and up matrices */
    int norm_weights;
    int act;                      /* enum bl_moe_act: silu(g) u, gelu_tanh(g) u, or gpt-oss's clamped SwiGLU */
    const float *gate_bias, *up_bias, *down_bias; /* [n_experts][rows] added to each product (NULL: none) */
    bl_matrix gate, up, down;     /* the stacks: expert e is rows [e ffn, (e + 1) ffn) of gate and of up, and
                                     rows [e n, (e + 1) n) of down (whole row groups: bl_moe_expert) */
    const float *logits;          /* the router's, [T][n_experts] */
    size_t logits_stride;
    int32_t *choice;              /* [T][n_used] the chosen experts */
    float *weight;                /* [T][n_used] their weights */
    int32_t *index;               /* [n_experts + 1] where each expert's pairs start, then [pairs] each pair's
                                     token, then [T][n_used] each choice's pair, then [pairs] each pair's expert */
    void *xg, *xg_up;             /* [pairs] the token's x converted for gate, and for up (NULL: as for gate) */
    size_t xg_stride, xg_up_stride;
    float *gu;                    /* [pairs][2 ffn] gate | up products; act(gate) * up goes over the gate half */
    size_t gu_stride;
    void *aq;                     /* [pairs] act(gate) * up converted for down */
    size_t aq_stride;
    float *y;                     /* [pairs][n] each pair's expert output */
    size_t y_stride;
} bl_moe;

/* Expert e's rows of a stack whose experts have `rows` rows each: a view of the same bytes. */
static inline bl_matrix bl_moe_expert(const bl_matrix *stack, int rows, int e) {
    bl_matrix m = *stack;
    m.rows = rows;
    if (e) m.data = (const char *)stack->data + bl_matrix_bytes(stack->type, stack->layout, e * rows, stack->cols);
    return m;
}

typedef struct bl_op {
    int kind;
    int rows_sel;          /* rows are the n_out selected ones, not the T tokens */
    int prequantized;      /* matmul: the qjobs already ran in the previous op's epilogue */
    int n;                 /* row width */
    float *out;
    size_t out_stride;     /* floats */
    const float *x, *x2;
    size_t x_stride;
    const float *w;        /* rmsnorm weight */
    float eps;
    float *res;            /* rmsnorm: residual the normed row is added to */
    size_t res_stride;
    int gelu;              /* silu_mul: gelu_tanh instead of silu */
    float scale_embed;     /* embed: rows are multiplied by this unless it is 0 or 1 */
    const float *q_norm, *k_norm; /* rope_kv: per-head rmsnorm weights [head_dim] (none if NULL) */
    const float *k_shift;  /* rope_kv, q8_0 cache: subtracted from the keys [n_kv_heads * head_dim] (none if NULL) */
    /* matmul */
    int n_parts, n_rows, row_align;
    bl_mm_part parts[BL_MAX_PARTS];
    int n_qjobs;
    bl_qjob qjobs[BL_MAX_QJOBS];
    /* embedding */
    bl_matrix table;
    /* rope, kv, attention */
    int n_heads, n_kv_heads, head_dim, rope_dim, rope_style, n_ctx;
    const float *rope_cs;  /* [n_ctx][rope_dim]: cos then sin of each position */
    char *kc, *vc;         /* this layer's cache in slot 0 */
    size_t slot_stride;    /* elements from one slot's cache to the next */
    int kv_type;           /* enum bl_kv_type: f32, f16 or q8_0 cache (ops.h) */
    int window;            /* attention: keys a query sees, counting its own (0: all before it) */
    float scale;
    float softcap;         /* attention, softcap: values x become softcap * tanh(x / softcap) (0: none) */
    const float *sinks;    /* attention: each q head's sink logit [n_heads] (NULL: none) */
    bl_moe moe;
} bl_op;

/* Work stealing in a matmul's row space: each thread owns a contiguous range of row chunks, takes them
 * from the front, and then takes chunks from the back of the others' ranges. One word per thread,
 * (op sequence number, front, end), changed by compare-and-swap; a word still carrying the previous
 * op's number is left alone. Which thread computes a row never changes what is computed. */
typedef struct bl_steal_slot {
    _Alignas(BL_CACHELINE) _Atomic uint64_t w;
} bl_steal_slot;

/* Adaptive thread count: results do not depend on how many threads run a step, so the executor may use
 * fewer when the others do not help, which happens when other processes hold the cores (a barrier
 * then waits for a thread that is not running). Per kind of step (one token, or several), it keeps the
 * cycles per token of the full pool and of the calling thread alone; when thread 0 spends over a
 * quarter of a step waiting at barriers it tries one step alone, keeps whichever is faster, and goes
 * back to the full pool now and then to see whether the machine has calmed down. */
typedef struct bl_adapt_state {
    double cyc[2];   /* cycles per token: [0] alone, [1] full pool (0: not measured) */
    int alone;       /* running alone now */
    int probe;       /* try alone at the next step */
    int since, interval, cool;
} bl_adapt_state;

typedef struct bl_plan {
    bl_pool *pool;
    bl_steal_slot *steal;  /* one per thread */
    unsigned run_seq;      /* bumped per run, for the steal words */
    bl_op *ops;
    int n_ops;
    const int32_t *tokens, *pos, *slot, *out_rows;
    /* of the current run */
    int T, n_out, begin, end;
    uint64_t *op_cycles;   /* if set, [thread][op]: each thread adds each op's cycles (work + wait) */
    int adaptive;          /* choose the thread count per step (see bl_adapt_state) */
    int last_threads;      /* threads the last run used */
    bl_adapt_state adapt[2]; /* [0] one-token steps, [1] several tokens */
} bl_plan;

/* Runs ops [begin, end) for T tokens and n_out selected rows. */
BL_API void bl_plan_run(bl_plan *p, int T, int n_out, int begin, int end);

#endif
