/* Python binding of the executor (executor.h): the Plan type, which parses the op dicts engine.py builds into
 * a bl_plan over the caller's buffers and runs it on a Pool. */
#include "py_common.h"

#include <stdatomic.h>
#include <string.h>

#include "executor.h"

typedef struct {
    PyObject_HEAD
    bl_plan plan;
    PoolObject *pool;
    Py_buffer *views;
    int n_views, cap_views;
    int max_T, max_out, n_vocab, n_ctx, n_slots;
    PyObject *profile; /* the uint64 array op_cycles points into */
} PlanObject;

static char *plan_buf(PlanObject *self, PyObject *spec, int writable, Py_ssize_t *avail) {
    if (self->n_views == self->cap_views) {
        int cap = self->cap_views ? 2 * self->cap_views : 64;
        Py_buffer *v = PyMem_Realloc(self->views, sizeof(Py_buffer) * cap);
        if (!v) {
            PyErr_NoMemory();
            return NULL;
        }
        self->views = v;
        self->cap_views = cap;
    }
    char *p = bl_get_view(spec, writable, &self->views[self->n_views], avail);
    if (p) self->n_views++;
    return p;
}

/* optional dict items */
static int d_int(PyObject *d, const char *key, int dflt, int *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v) { *out = dflt; return 0; }
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = (int)x;
    return 0;
}

static int d_size(PyObject *d, const char *key, size_t *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v) { *out = 0; return 0; }
    Py_ssize_t x = PyLong_AsSsize_t(v);
    if (x < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s must be >= 0", key);
        return -1;
    }
    *out = (size_t)x;
    return 0;
}

static int d_float(PyObject *d, const char *key, float *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v) { *out = 0; return 0; }
    double x = PyFloat_AsDouble(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    *out = (float)x;
    return 0;
}

static int d_ptr(PlanObject *self, PyObject *d, const char *key, int writable, void **out) {
    PyObject *v = PyDict_GetItemString(d, key);
    *out = NULL;
    if (!v || v == Py_None) return 0;
    *out = plan_buf(self, v, writable, NULL);
    return *out ? 0 : -1;
}

/* the list under key (NULL and 0 items when absent) of at most `max` items */
static int d_list(PyObject *d, const char *key, int max, PyObject **list, int *n) {
    *list = PyDict_GetItemString(d, key);
    *n = 0;
    if (!*list) return 0;
    if (!PyList_Check(*list) || PyList_GET_SIZE(*list) > max) {
        PyErr_Format(PyExc_ValueError, "%s must be a list of at most %d", key, max);
        return -1;
    }
    *n = (int)PyList_GET_SIZE(*list);
    return 0;
}

/* (type, layout, rows, cols, buffer[, act]) */
static int parse_matrix(PlanObject *self, PyObject *spec, bl_matrix *m) {
    PyObject *buf;
    m->act = BL_ACT_Q8;
    if (!PyArg_ParseTuple(spec, "iiiiO|i", &m->type, &m->layout, &m->rows, &m->cols, &buf, &m->act)) return -1;
    if (!bl_act_supported(m->type, m->act)) {
        PyErr_Format(PyExc_ValueError, "activation type %d is not supported for type %d", m->act, m->type);
        return -1;
    }
    if (buf == Py_None) {
        m->data = NULL;
        return 0;
    }
    Py_ssize_t avail;
    m->data = plan_buf(self, buf, 0, &avail);
    if (!m->data) return -1;
    size_t need = bl_matrix_bytes(m->type, m->layout, m->rows, m->cols);
    if (need == 0 || (size_t)avail < need) {
        PyErr_Format(PyExc_ValueError, "matrix type %d layout %d [%d, %d] needs %zu bytes, buffer has %zd",
                     m->type, m->layout, m->rows, m->cols, need, avail);
        return -1;
    }
    return 0;
}

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* The keys each op kind takes (engine.py builds the dicts), from the op table (executor.h): every required key
 * must be there and no other key may be, so a misspelt or forgotten key is an error naming it, never a silent
 * zero. */
typedef struct {
    const char *name;
    int kind;
    const char *const *required, *const *optional;
} op_keys;

#define OP_KEYS_ROW(KIND, name, id, required, optional) {#name, BL_OP_##KIND, required, optional},
static const op_keys OP_KEYS[] = {BL_OP_KINDS(OP_KEYS_ROW)};
#undef OP_KEYS_ROW
static const char *const COMMON_KEYS[] = {"kind", "name", "rows_sel", NULL};
static const char *const QJOB_REQUIRED[] = {"w", "x", "x_stride", "dst", "dst_stride", NULL};
static const char *const PART_REQUIRED[] = {"w", "xq", "out", "ldo", NULL};
static const char *const PART_OPTIONAL[] = {"res", "res_stride", "bias", NULL};

static int in_list(const char *const *list, const char *key) {
    for (; list && *list; list++)
        if (strcmp(*list, key) == 0) return 1;
    return 0;
}

/* Refuses a dict with an unknown key or without a required one; `what` names it in the error. */
static int check_keys(PyObject *d, const char *what, const char *const *required, const char *const *optional,
                      const char *const *common) {
    if (!PyDict_Check(d)) {
        PyErr_Format(PyExc_TypeError, "%s must be a dict", what);
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(d, &pos, &key, &value)) {
        const char *k = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        if (!k) {
            PyErr_Format(PyExc_ValueError, "%s: keys must be strings", what);
            return -1;
        }
        if (!in_list(required, k) && !in_list(optional, k) && !in_list(common, k)) {
            PyErr_Format(PyExc_ValueError, "%s: unknown key '%s'", what, k);
            return -1;
        }
    }
    for (; *required; required++)
        if (!PyDict_GetItemString(d, *required)) {
            PyErr_Format(PyExc_ValueError, "%s: missing key '%s'", what, *required);
            return -1;
        }
    return 0;
}

/* A buffer under key of at least `need` bytes (NULL and no error when absent and not required). */
static void *sized_buf(PlanObject *self, PyObject *d, const char *key, int writable, size_t need, int required) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v || v == Py_None) {
        if (required) PyErr_Format(PyExc_ValueError, "missing buffer '%s'", key);
        return NULL;
    }
    Py_ssize_t avail = 0;
    void *ptr = plan_buf(self, v, writable, &avail);
    if (ptr && (size_t)avail < need) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, needs %zu", key, avail, need);
        return NULL;
    }
    return ptr;
}

/* The moe op's bl_moe (executor.h): the stacks, whole row groups per expert, and scratch for max_T tokens. */
static int parse_moe(PlanObject *self, PyObject *d, bl_op *op) {
    bl_moe *m = &op->moe;
    int norm;
    if (d_int(d, "n_experts", 0, &m->n_experts) || d_int(d, "n_used", 0, &m->n_used) || d_int(d, "ffn", 0, &m->ffn) ||
        d_int(d, "act", 0, &m->act) ||
        d_int(d, "norm_weights", 0, &norm) || d_size(d, "logits_stride", &m->logits_stride) ||
        d_size(d, "xg_stride", &m->xg_stride) || d_size(d, "xg_up_stride", &m->xg_up_stride) ||
        d_size(d, "gu_stride", &m->gu_stride) || d_size(d, "aq_stride", &m->aq_stride) ||
        d_size(d, "y_stride", &m->y_stride))
        return -1;
    m->norm_weights = norm != 0;
    if (m->n_experts < 1 || m->n_used < 1 || m->n_used > m->n_experts || m->ffn < 1 || op->n < 1 || m->act < 0 ||
        m->act > BL_MOE_SWIGLU_OAI) {
        PyErr_Format(PyExc_ValueError, "moe: %d of %d experts of %d rows, width %d", m->n_used, m->n_experts, m->ffn,
                     op->n);
        return -1;
    }
    if (parse_matrix(self, PyDict_GetItemString(d, "gate"), &m->gate) ||
        parse_matrix(self, PyDict_GetItemString(d, "up"), &m->up) ||
        parse_matrix(self, PyDict_GetItemString(d, "down"), &m->down))
        return -1;
    const bl_matrix *stacks[3] = {&m->gate, &m->up, &m->down};
    for (int i = 0; i < 3; i++) {
        const int rows = i < 2 ? m->ffn : op->n, cols = i < 2 ? op->n : m->ffn;
        if (!stacks[i]->data || stacks[i]->rows != m->n_experts * rows || stacks[i]->cols != cols ||
            rows % bl_matmul_row_align(stacks[i])) {
            PyErr_Format(PyExc_ValueError, "moe: stack %d is [%d, %d], needs %d experts of [%d, %d] in whole row "
                         "groups of %d", i, stacks[i]->rows, stacks[i]->cols, m->n_experts, rows, cols,
                         bl_matmul_row_align(stacks[i]));
            return -1;
        }
    }
    const size_t pairs = (size_t)self->max_T * m->n_used;
    const size_t xg = bl_act_row_bytes(&m->gate, op->n), xg_up = bl_act_row_bytes(&m->up, op->n);
    const size_t aq = bl_act_row_bytes(&m->down, m->ffn);
    if (m->xg_stride < xg || m->gu_stride < 2 * (size_t)m->ffn || m->aq_stride < aq || m->y_stride < (size_t)op->n ||
        m->logits_stride < (size_t)m->n_experts) {
        PyErr_SetString(PyExc_ValueError, "moe: a scratch stride is too small for its rows");
        return -1;
    }
    if (!(m->logits = sized_buf(self, d, "logits", 0, 4 * ((self->max_T - 1) * m->logits_stride + m->n_experts), 1)) ||
        !(m->choice = sized_buf(self, d, "choice", 1, 4 * pairs, 1)) ||
        !(m->weight = sized_buf(self, d, "weight", 1, 4 * pairs, 1)) ||
        !(m->index = sized_buf(self, d, "index", 1, 4 * (m->n_experts + 1 + 3 * pairs), 1)) ||
        !(m->xg = sized_buf(self, d, "xg", 1, pairs * m->xg_stride, 1)) ||
        !(m->gu = sized_buf(self, d, "gu", 1, 4 * pairs * m->gu_stride, 1)) ||
        !(m->aq = sized_buf(self, d, "aq", 1, pairs * m->aq_stride, 1)) ||
        !(m->y = sized_buf(self, d, "y", 1, 4 * pairs * m->y_stride, 1)))
        return -1;
    m->xg_up = sized_buf(self, d, "xg_up", 1, pairs * m->xg_up_stride, 0);
    const size_t F = (size_t)m->n_experts * m->ffn, D = (size_t)m->n_experts * op->n;
    if (!PyErr_Occurred()) m->gate_bias = sized_buf(self, d, "gate_bias", 0, 4 * F, 0);
    if (!PyErr_Occurred()) m->up_bias = sized_buf(self, d, "up_bias", 0, 4 * F, 0);
    if (!PyErr_Occurred()) m->down_bias = sized_buf(self, d, "down_bias", 0, 4 * D, 0);
    if (PyErr_Occurred()) return -1;
    if (m->xg_up ? m->xg_up_stride < xg_up
                 : m->up.type != m->gate.type || m->up.layout != m->gate.layout || m->up.act != m->gate.act) {
        PyErr_SetString(PyExc_ValueError, "moe: up takes other activations than gate: it needs its own xg_up");
        return -1;
    }
    return 0;
}

static int parse_op(PlanObject *self, PyObject *d, bl_op *op) {
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "each op must be a dict");
        return -1;
    }
    memset(op, 0, sizeof *op);
    if (d_int(d, "kind", 0, &op->kind)) return -1;
    const op_keys *spec = NULL;
    for (size_t i = 0; i < sizeof OP_KEYS / sizeof OP_KEYS[0]; i++)
        if (OP_KEYS[i].kind == op->kind) spec = &OP_KEYS[i];
    if (!spec) {
        PyErr_Format(PyExc_ValueError, "unknown op kind %d", op->kind);
        return -1;
    }
    if (check_keys(d, spec->name, spec->required, spec->optional, COMMON_KEYS)) return -1;
    if (d_int(d, "rows_sel", 0, &op->rows_sel) ||
        d_int(d, "prequantized", 0, &op->prequantized) || d_int(d, "n", 0, &op->n) ||
        d_size(d, "out_stride", &op->out_stride) || d_size(d, "x_stride", &op->x_stride) ||
        d_float(d, "eps", &op->eps) || d_int(d, "n_heads", 0, &op->n_heads) ||
        d_int(d, "n_kv_heads", 0, &op->n_kv_heads) || d_int(d, "head_dim", 0, &op->head_dim) ||
        d_int(d, "rope_dim", 0, &op->rope_dim) || d_int(d, "rope_style", 0, &op->rope_style) ||
        d_int(d, "n_ctx", 0, &op->n_ctx) || d_size(d, "slot_stride", &op->slot_stride) ||
        d_float(d, "scale", &op->scale) ||
        d_int(d, "kv_type", 0, &op->kv_type) || d_int(d, "window", 0, &op->window) ||
        d_size(d, "res_stride", &op->res_stride) || d_int(d, "gelu", 0, &op->gelu) ||
        d_float(d, "scale_embed", &op->scale_embed) || d_float(d, "softcap", &op->softcap))
        return -1;
    if ((op->kind == BL_OP_ROPE_KV || op->kind == BL_OP_ATTENTION) && !bl_kv_row_bytes(op->head_dim, op->kv_type)) {
        PyErr_Format(PyExc_ValueError, "%s: kv_type %d cannot hold head_dim %d (q8_0: a multiple of %d)", spec->name,
                     op->kv_type, op->head_dim, BL_KV_QK);
        return -1;
    }
    void *p;
    /* obj->field = the buffer under the key named as the field (NULL: absent or None); nonzero on error */
#define FIELD_BUF(dict, obj, field, writable) (d_ptr(self, dict, #field, writable, &p) || ((obj)->field = p, 0))
    if (FIELD_BUF(d, op, out, 1) || FIELD_BUF(d, op, x, 0) || FIELD_BUF(d, op, x2, 0) || FIELD_BUF(d, op, w, 0) ||
        FIELD_BUF(d, op, rope_cs, 0) || FIELD_BUF(d, op, res, 1) || FIELD_BUF(d, op, q_norm, 0) ||
        FIELD_BUF(d, op, k_norm, 0))
        return -1;
    PyObject *shift = PyDict_GetItemString(d, "k_shift");
    if (shift && shift != Py_None) {
        Py_ssize_t avail = 0;
        op->k_shift = (const float *)plan_buf(self, shift, 0, &avail);
        if (!op->k_shift) return -1;
        if (avail < (Py_ssize_t)sizeof(float) * op->n_kv_heads * op->head_dim) {
            PyErr_Format(PyExc_ValueError, "%s: k_shift has %zd bytes for %d kv heads of %d", spec->name, avail,
                         op->n_kv_heads, op->head_dim);
            return -1;
        }
    }
    if (FIELD_BUF(d, op, kc, 1) || FIELD_BUF(d, op, vc, 1)) return -1;
    if (op->kind == BL_OP_ATTENTION &&
        !(op->sinks = sized_buf(self, d, "sinks", 0, sizeof(float) * op->n_heads, 0)) && PyErr_Occurred())
        return -1;
    PyObject *t = PyDict_GetItemString(d, "table");
    if (t && parse_matrix(self, t, &op->table)) return -1;
    if (op->kind == BL_OP_MOE && parse_moe(self, d, op)) return -1;

    PyObject *qj;
    if (d_list(d, "qjobs", BL_MAX_QJOBS, &qj, &op->n_qjobs)) return -1;
    for (int i = 0; i < op->n_qjobs; i++) {
        PyObject *j = PyList_GET_ITEM(qj, i);
        bl_qjob *q = &op->qjobs[i];
        if (check_keys(j, "qjob", QJOB_REQUIRED, NULL, NULL)) return -1;
        if (parse_matrix(self, PyDict_GetItemString(j, "w"), &q->w) || FIELD_BUF(j, q, x, 0) ||
            d_size(j, "x_stride", &q->x_stride) || FIELD_BUF(j, q, dst, 1) || d_size(j, "dst_stride", &q->dst_stride))
            return -1;
    }
    PyObject *parts;
    if (d_list(d, "parts", BL_MAX_PARTS, &parts, &op->n_parts)) return -1;
    if (parts) {
        int align = BL_CACHELINE / (int)sizeof(float);
        for (int i = 0; i < op->n_parts; i++) {
            PyObject *j = PyList_GET_ITEM(parts, i);
            bl_mm_part *pt = &op->parts[i];
            if (check_keys(j, "matmul part", PART_REQUIRED, PART_OPTIONAL, NULL)) return -1;
            if (parse_matrix(self, PyDict_GetItemString(j, "w"), &pt->w) || FIELD_BUF(j, pt, xq, 0) ||
                FIELD_BUF(j, pt, out, 1) || FIELD_BUF(j, pt, res, 1))
                return -1;
            Py_ssize_t avail = 0;
            PyObject *bias = PyDict_GetItemString(j, "bias");
            if (bias && bias != Py_None) {
                pt->bias = (const float *)plan_buf(self, bias, 0, &avail);
                if (!pt->bias) return -1;
                if (avail < (Py_ssize_t)sizeof(float) * pt->w.rows) {
                    PyErr_Format(PyExc_ValueError, "matmul part %d: bias has %zd bytes for %d rows", i, avail,
                                 pt->w.rows);
                    return -1;
                }
            }
            if (d_size(j, "ldo", &pt->ldo) || d_size(j, "res_stride", &pt->res_stride)) return -1;
            pt->row0 = op->n_rows;
            op->n_rows += pt->w.rows;
            int a = bl_matmul_row_align(&pt->w);
            align = align / gcd(align, a) * a;
        }
        for (int i = 0; i < op->n_parts; i++)
            if (op->parts[i].row0 % align) {
                PyErr_Format(PyExc_ValueError, "matmul part %d starts at row %d, not a multiple of %d", i,
                             op->parts[i].row0, align);
                return -1;
            }
        op->row_align = align;
    }
#undef FIELD_BUF
    return 0;
}

static int arr_i32(PlanObject *self, PyObject *obj, int n, const int32_t **out) {
    Py_ssize_t avail;
    *out = (const int32_t *)plan_buf(self, obj, 0, &avail);
    if (!*out) return -1;
    if (avail < (Py_ssize_t)sizeof(int32_t) * n) {
        PyErr_SetString(PyExc_ValueError, "runtime array too small");
        return -1;
    }
    return 0;
}

static void Plan_clear(PlanObject *self) {
    for (int i = 0; i < self->n_views; i++) PyBuffer_Release(&self->views[i]);
    self->n_views = 0;
    PyMem_Free(self->views);
    self->views = NULL;
    self->cap_views = 0;
    if (self->plan.ops) bl_free_aligned(self->plan.ops);
    self->plan.ops = NULL;
    if (self->plan.steal) bl_free_aligned(self->plan.steal);
    self->plan.steal = NULL;
    Py_CLEAR(self->pool);
    Py_CLEAR(self->profile);
}

/* Plan(pool, ops, tokens, pos, slot, out_rows, max_T, max_out, n_vocab, n_ctx, n_slots) */
static int Plan_init(PlanObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pool", "ops", "tokens", "pos", "slot", "out_rows", "max_T", "max_out",
                             "n_vocab", "n_ctx", "n_slots", NULL};
    PyObject *pool, *ops, *tok, *pos, *slot, *rows;
    int max_T, max_out, n_vocab, n_ctx, n_slots;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!OOOOiiiii", kwlist, &PoolType, &pool, &PyList_Type, &ops,
                                     &tok, &pos, &slot, &rows, &max_T, &max_out, &n_vocab, &n_ctx, &n_slots))
        return -1;
    Plan_clear(self);
    Py_INCREF(pool);
    self->pool = (PoolObject *)pool;
    self->plan.pool = self->pool->pool;
    self->max_T = max_T;
    self->max_out = max_out;
    self->n_vocab = n_vocab;
    self->n_ctx = n_ctx;
    self->n_slots = n_slots;
    if (arr_i32(self, tok, max_T, &self->plan.tokens) || arr_i32(self, pos, max_T, &self->plan.pos) ||
        arr_i32(self, slot, max_T, &self->plan.slot) || arr_i32(self, rows, max_out, &self->plan.out_rows))
        return -1;
    int n = (int)PyList_GET_SIZE(ops);
    self->plan.ops = bl_malloc_aligned(sizeof(bl_op) * (n ? n : 1));
    self->plan.steal = bl_malloc_aligned(sizeof(bl_steal_slot) * bl_pool_size(self->plan.pool));
    if (self->plan.steal)
        for (int i = 0; i < bl_pool_size(self->plan.pool); i++) atomic_init(&self->plan.steal[i].w, 0);
    if (!self->plan.ops || !self->plan.steal) {
        PyErr_NoMemory();
        return -1;
    }
    self->plan.n_ops = 0;
    for (int i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(ops, i);
        if (parse_op(self, d, &self->plan.ops[i]) < 0) {
            /* the same exception, its message prefixed with the op's index and name */
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *name = PyDict_Check(d) ? PyDict_GetItemString(d, "name") : NULL;
            if (name)
                PyErr_Format(type ? type : PyExc_ValueError, "op %d (%S): %S", i, name, value ? value : Py_None);
            else
                PyErr_Format(type ? type : PyExc_ValueError, "op %d: %S", i, value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return -1;
        }
        self->plan.n_ops = i + 1;
    }
    return 0;
}

static void Plan_dealloc(PlanObject *self) {
    Plan_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* run(T, n_out, begin=0, end=n_ops) */
static PyObject *Plan_run(PlanObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 4) {
        PyErr_SetString(PyExc_TypeError, "run(T, n_out, begin=0, end=n_ops)");
        return NULL;
    }
    long v[4] = {0, 0, 0, self->plan.n_ops};
    for (Py_ssize_t i = 0; i < nargs; i++) {
        v[i] = PyLong_AsLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    const int T = (int)v[0], n_out = (int)v[1], begin = (int)v[2], end = (int)v[3];
    if (!self->plan.ops || T < 1 || T > self->max_T || n_out < 0 || n_out > self->max_out || begin < 0 ||
        end > self->plan.n_ops || begin > end) {
        PyErr_Format(PyExc_ValueError, "run: bad arguments T=%d n_out=%d ops [%d, %d)", T, n_out, begin, end);
        return NULL;
    }
    const bl_plan *p = &self->plan;
    for (int t = 0; t < T; t++)
        if (p->tokens[t] < 0 || p->tokens[t] >= self->n_vocab || p->pos[t] < 0 || p->pos[t] >= self->n_ctx ||
            p->slot[t] < 0 || p->slot[t] >= self->n_slots) {
            PyErr_Format(PyExc_ValueError, "run: token %d (id %d, position %d, slot %d) out of range", t,
                         p->tokens[t], p->pos[t], p->slot[t]);
            return NULL;
        }
    for (int i = 0; i < n_out; i++)
        if (p->out_rows[i] < 0 || p->out_rows[i] >= T) {
            PyErr_Format(PyExc_ValueError, "run: output row %d out of range", p->out_rows[i]);
            return NULL;
        }
    if (self->pool->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the engine's thread pool is already running (one call at a time)");
        return NULL;
    }
    self->pool->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    bl_plan_run(&self->plan, T, n_out, begin, end);
    Py_END_ALLOW_THREADS
    self->pool->busy = 0;
    Py_RETURN_NONE;
}

/* set_profile(uint64 array [threads, n_ops] or None): each thread adds each op's cycles into its row */
static PyObject *Plan_set_profile(PlanObject *self, PyObject *arg) {
    Py_CLEAR(self->profile);
    self->plan.op_cycles = NULL;
    if (arg == Py_None) Py_RETURN_NONE;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_WRITABLE) < 0) return NULL;
    void *buf = view.buf;
    Py_ssize_t len = view.len;
    PyBuffer_Release(&view); /* the reference below keeps the array alive (numpy arrays do not move) */
    if (len < (Py_ssize_t)sizeof(uint64_t) * self->plan.n_ops * bl_pool_size(self->plan.pool)) {
        PyErr_SetString(PyExc_ValueError, "profile array needs threads * n_ops uint64 values");
        return NULL;
    }
    Py_INCREF(arg);
    self->profile = arg;
    self->plan.op_cycles = buf;
    Py_RETURN_NONE;
}

static PyObject *Plan_set_adaptive(PlanObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (on < 0) return NULL;
    self->plan.adaptive = on;
    memset(self->plan.adapt, 0, sizeof self->plan.adapt);
    Py_RETURN_NONE;
}

/* a Plan attribute: the int at byte offset `at` of its bl_plan */
static PyObject *Plan_int(PlanObject *self, void *at) {
    return PyLong_FromLong(*(const int *)((const char *)&self->plan + (uintptr_t)at));
}

static PyMethodDef Plan_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Plan_run, METH_FASTCALL,
     "run(T, n_out, begin=0, end=n_ops): ops [begin, end) on T tokens, n_out selected rows (GIL released)."},
    {"set_adaptive", (PyCFunction)Plan_set_adaptive, METH_O,
     "set_adaptive(bool): let each run use fewer threads when the others do not help"},
    {"set_profile", (PyCFunction)Plan_set_profile, METH_O, "set_profile(uint64 array [threads, n_ops] | None)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Plan_getset[] = {
    {"n_ops", (getter)Plan_int, NULL, "number of ops", (void *)offsetof(bl_plan, n_ops)},
    {"last_threads", (getter)Plan_int, NULL, "threads the last run used", (void *)offsetof(bl_plan, last_threads)},
    {NULL, NULL, NULL, NULL, NULL},
};

static BL_TYPE(Plan, Plan_getset, "A compiled forward plan bound to a Pool (built by barellm.engine).");

/* OP_KINDS: {op kind name: its id}, the kinds a plan's op dicts may name */
int bl_plan_module_init(PyObject *m) {
    if (PyModule_AddType(m, &PlanType) < 0) return -1;
    PyObject *kinds = PyDict_New();
    if (!kinds) return -1;
    for (size_t i = 0; i < sizeof OP_KEYS / sizeof OP_KEYS[0]; i++) {
        PyObject *v = PyLong_FromLong(OP_KEYS[i].kind);
        if (!v || PyDict_SetItemString(kinds, OP_KEYS[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(kinds);
            return -1;
        }
        Py_DECREF(v);
    }
    if (PyModule_AddObject(m, "OP_KINDS", kinds) < 0) {
        Py_DECREF(kinds);
        return -1;
    }
    return 0;
}
