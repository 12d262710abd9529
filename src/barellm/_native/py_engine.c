/* Python bindings of the thread pool, the executor and the ops.h kernels. */
#include "py_common.h"

#include <limits.h>

#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "executor.h"
#include "tier.h"

/* ------------------------------------------------------------------ buffers */

/* A contiguous buffer of obj (any buffer exporter), or of obj[0] at byte offset obj[1] when obj is a
 * (buffer, offset) tuple. The view is kept in *view until released. */
static char *get_view(PyObject *obj, int writable, Py_buffer *view, Py_ssize_t *avail) {
    Py_ssize_t off = 0;
    if (PyTuple_Check(obj)) {
        if (PyTuple_GET_SIZE(obj) != 2) {
            PyErr_SetString(PyExc_TypeError, "buffer spec must be an array or (array, byte_offset)");
            return NULL;
        }
        off = PyLong_AsSsize_t(PyTuple_GET_ITEM(obj, 1));
        if (off == -1 && PyErr_Occurred()) return NULL;
        obj = PyTuple_GET_ITEM(obj, 0);
    }
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return NULL;
    if (off < 0 || off > view->len) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "byte offset %zd outside a buffer of %zd bytes", off, view->len);
        return NULL;
    }
    if (avail) *avail = view->len - off;
    return (char *)view->buf + off;
}

/* ------------------------------------------------------------------ Pool */

typedef struct {
    PyObject_HEAD
    bl_pool *pool;
    int busy;
} PoolObject;

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", "pin", NULL};
    int n = 1, pin = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "i|p", kwlist, &n, &pin)) return -1;
    if (n < 1 || n > BL_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in 1..%d, got %d", BL_MAX_THREADS, n);
        return -1;
    }
    if (self->pool) bl_pool_destroy(self->pool);
    self->pool = bl_pool_create(n, pin);
    if (!self->pool) {
        PyErr_SetString(PyExc_OSError, "could not start the worker threads");
        return -1;
    }
    return 0;
}

static void Pool_dealloc(PoolObject *self) {
    if (self->pool) bl_pool_destroy(self->pool);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_size(PoolObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->pool ? bl_pool_size(self->pool) : 0);
}

static PyObject *Pool_set_spin_us(PoolObject *self, PyObject *arg) {
    long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred()) return NULL;
    bl_pool_set_spin_us(self->pool, (int)us);
    Py_RETURN_NONE;
}

/* Pool.read: every thread reads its contiguous share of a buffer once, as bench/roofline.c's bandwidth pass
 * does (several independent accumulators, so loads are not serialized on an add chain): the read rate of
 * the same bytes, threads and pages that a decode streams, for measuring decode as a share of it. */
typedef struct {
    const uint64_t *p;
    size_t n;             /* 8-byte words */
    uint64_t sink[BL_MAX_THREADS];
} read_job;

static void read_task(void *ctx, int tid, int nth) {
    read_job *j = ctx;
    size_t per = (j->n / (size_t)nth) & ~(size_t)31, lo = per * (size_t)tid;
    size_t hi = tid == nth - 1 ? j->n & ~(size_t)31 : lo + per;
    j->sink[tid] = bl_kernels.read_sum(j->p, lo, hi);
}

static PyObject *Pool_read(PoolObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    if (self->busy) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "the pool is running another task");
        return NULL;
    }
    read_job j = {(const uint64_t *)view.buf, (size_t)view.len / 8, {0}};
    self->busy = 1;
    struct timespec t0, t1;
    Py_BEGIN_ALLOW_THREADS
    clock_gettime(CLOCK_MONOTONIC, &t0);
    bl_pool_run(self->pool, read_task, &j);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    PyBuffer_Release(&view);
    uint64_t sink = 0;
    for (int i = 0; i < BL_MAX_THREADS; i++) sink += j.sink[i];
    return Py_BuildValue("(dK)", (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec),
                         (unsigned long long)sink);
}

static PyMethodDef Pool_methods[] = {
    {"set_spin_us", (PyCFunction)Pool_set_spin_us, METH_O, "How long idle workers spin before sleeping."},
    {"read", (PyCFunction)Pool_read, METH_O,
     "read(buffer) -> (seconds, checksum): every thread reads its share of the buffer once (a bandwidth pass)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"size", (getter)Pool_size, NULL, "number of threads (the caller included)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "barellm._native.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads, pin=False): persistent worker threads (the caller is thread 0).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

/* ------------------------------------------------------------------ Plan */

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
    char *p = get_view(spec, writable, &self->views[self->n_views], avail);
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

/* The keys each op kind takes (engine.py builds the dicts): every required key must be there and no other
 * key may be, so a misspelt or forgotten key is an error naming it, never a silent zero. */
#define KEYS(...) ((const char *const[]){__VA_ARGS__, NULL})
typedef struct {
    const char *name;
    int kind;
    const char *const *required, *const *optional;
} op_keys;

static const op_keys OP_KEYS[] = {
    {"embed", BL_OP_EMBED, KEYS("out", "out_stride", "n", "table", "scale_embed"), KEYS(NULL)},
    {"rmsnorm", BL_OP_RMSNORM, KEYS("x", "x_stride", "w", "eps", "n", "out", "out_stride"),
     KEYS("res", "res_stride", "qjobs")},
    {"matmul", BL_OP_MATMUL, KEYS("parts", "qjobs"), KEYS("prequantized")},
    {"rope_kv", BL_OP_ROPE_KV,
     KEYS("n_heads", "n_kv_heads", "head_dim", "n_ctx", "kc", "vc", "slot_stride", "kv_type", "out", "out_stride",
          "rope_dim", "eps", "rope_style", "rope_cs"),
     KEYS("q_norm", "k_norm", "k_shift")},
    {"attention", BL_OP_ATTENTION,
     KEYS("n_heads", "n_kv_heads", "head_dim", "n_ctx", "kc", "vc", "slot_stride", "kv_type", "window", "x",
          "x_stride", "out", "out_stride", "scale"),
     KEYS(NULL)},
    {"silu_mul", BL_OP_SILU_MUL, KEYS("x", "x2", "x_stride", "out", "out_stride", "n", "gelu"), KEYS("qjobs")},
};
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
        d_float(d, "scale_embed", &op->scale_embed))
        return -1;
    if ((op->kind == BL_OP_ROPE_KV || op->kind == BL_OP_ATTENTION) && !bl_kv_row_bytes(op->head_dim, op->kv_type)) {
        PyErr_Format(PyExc_ValueError, "%s: kv_type %d cannot hold head_dim %d (q8_0: a multiple of %d)", spec->name,
                     op->kv_type, op->head_dim, BL_KV_QK);
        return -1;
    }
    void *p;
    if (d_ptr(self, d, "out", 1, &p)) return -1;
    op->out = p;
    if (d_ptr(self, d, "x", 0, &p)) return -1;
    op->x = p;
    if (d_ptr(self, d, "x2", 0, &p)) return -1;
    op->x2 = p;
    if (d_ptr(self, d, "w", 0, &p)) return -1;
    op->w = p;
    if (d_ptr(self, d, "rope_cs", 0, &p)) return -1;
    op->rope_cs = p;
    if (d_ptr(self, d, "res", 1, &p)) return -1;
    op->res = p;
    if (d_ptr(self, d, "q_norm", 0, &p)) return -1;
    op->q_norm = p;
    if (d_ptr(self, d, "k_norm", 0, &p)) return -1;
    op->k_norm = p;
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
    if (d_ptr(self, d, "kc", 1, &p)) return -1;
    op->kc = p;
    if (d_ptr(self, d, "vc", 1, &p)) return -1;
    op->vc = p;
    PyObject *t = PyDict_GetItemString(d, "table");
    if (t && parse_matrix(self, t, &op->table)) return -1;

    PyObject *qj = PyDict_GetItemString(d, "qjobs");
    if (qj) {
        if (!PyList_Check(qj) || PyList_GET_SIZE(qj) > BL_MAX_QJOBS) {
            PyErr_Format(PyExc_ValueError, "qjobs must be a list of at most %d", BL_MAX_QJOBS);
            return -1;
        }
        op->n_qjobs = (int)PyList_GET_SIZE(qj);
        for (int i = 0; i < op->n_qjobs; i++) {
            PyObject *j = PyList_GET_ITEM(qj, i);
            bl_qjob *q = &op->qjobs[i];
            if (check_keys(j, "qjob", QJOB_REQUIRED, NULL, NULL)) return -1;
            if (parse_matrix(self, PyDict_GetItemString(j, "w"), &q->w) || d_ptr(self, j, "x", 0, &p)) return -1;
            q->x = p;
            if (d_size(j, "x_stride", &q->x_stride) || d_ptr(self, j, "dst", 1, &q->dst) ||
                d_size(j, "dst_stride", &q->dst_stride))
                return -1;
        }
    }
    PyObject *parts = PyDict_GetItemString(d, "parts");
    if (parts) {
        if (!PyList_Check(parts) || PyList_GET_SIZE(parts) > BL_MAX_PARTS) {
            PyErr_Format(PyExc_ValueError, "parts must be a list of at most %d", BL_MAX_PARTS);
            return -1;
        }
        op->n_parts = (int)PyList_GET_SIZE(parts);
        int align = BL_CACHELINE / (int)sizeof(float);
        for (int i = 0; i < op->n_parts; i++) {
            PyObject *j = PyList_GET_ITEM(parts, i);
            bl_mm_part *pt = &op->parts[i];
            if (check_keys(j, "matmul part", PART_REQUIRED, PART_OPTIONAL, NULL)) return -1;
            if (parse_matrix(self, PyDict_GetItemString(j, "w"), &pt->w) || d_ptr(self, j, "xq", 0, &p)) return -1;
            pt->xq = p;
            if (d_ptr(self, j, "out", 1, &p)) return -1;
            pt->out = p;
            if (d_ptr(self, j, "res", 1, &p)) return -1;
            pt->res = p;
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

static PyObject *Plan_last_threads(PlanObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->plan.last_threads);
}

static PyObject *Plan_n_ops(PlanObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->plan.n_ops);
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
    {"n_ops", (getter)Plan_n_ops, NULL, "number of ops", NULL},
    {"last_threads", (getter)Plan_last_threads, NULL, "threads the last run used", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "barellm._native.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A compiled forward plan bound to a Pool (built by barellm.engine).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Plan_init,
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
};

/* ------------------------------------------------------------------ single kernels */

typedef struct {
    Py_buffer v[6];
    int n;
} views;

static void views_release(views *vs) {
    for (int i = 0; i < vs->n; i++) PyBuffer_Release(&vs->v[i]);
    vs->n = 0;
}

/* a buffer of at least `count` items of `size` bytes */
static void *vbuf(views *vs, PyObject *obj, int writable, Py_ssize_t count, Py_ssize_t size, const char *what) {
    Py_ssize_t avail;
    char *p = get_view(obj, writable, &vs->v[vs->n], &avail);
    if (!p) return NULL;
    vs->n++;
    if (avail < count * size) {
        PyErr_Format(PyExc_ValueError, "%s: needs %zd bytes, has %zd", what, count * size, avail);
        return NULL;
    }
    return p;
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *oo;
    int T, n;
    float eps;
    if (!PyArg_ParseTuple(args, "OOOiif", &xo, &wo, &oo, &T, &n, &eps)) return NULL;
    views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 0, (Py_ssize_t)T * n, 4, "x"), *w = x ? vbuf(&vs, wo, 0, n, 4, "w") : NULL;
    float *out = w ? vbuf(&vs, oo, 1, (Py_ssize_t)T * n, 4, "out") : NULL;
    if (out)
        for (int t = 0; t < T; t++) bl_rmsnorm(x + (size_t)t * n, w, out + (size_t)t * n, n, eps);
    views_release(&vs);
    if (!out) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *cso;
    int T, n_heads, head_dim, rope_dim, style;
    if (!PyArg_ParseTuple(args, "OOiiiii", &xo, &cso, &T, &n_heads, &head_dim, &rope_dim, &style)) return NULL;
    if (rope_dim < 2 || rope_dim > head_dim || rope_dim % 2) {
        PyErr_SetString(PyExc_ValueError, "rope_dim must be even and <= head_dim");
        return NULL;
    }
    views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, (Py_ssize_t)T * n_heads * head_dim, 4, "x");
    float *cs = x ? vbuf(&vs, cso, 0, (Py_ssize_t)T * rope_dim, 4, "cs") : NULL;
    if (cs)
        for (int t = 0; t < T; t++)
            bl_rope(x + (size_t)t * n_heads * head_dim, n_heads, head_dim, rope_dim, cs + (size_t)t * rope_dim, style);
    views_release(&vs);
    if (!cs) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_softmax(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    int T, n;
    if (!PyArg_ParseTuple(args, "Oii", &xo, &T, &n)) return NULL;
    views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, (Py_ssize_t)T * n, 4, "x");
    if (x)
        for (int t = 0; t < T; t++) bl_softmax(x + (size_t)t * n, n);
    views_release(&vs);
    if (!x) return NULL;
    Py_RETURN_NONE;
}

/* out[n] = act(gate[n]) * up[n], for each gated activation kernel */
static PyObject *gated_act(PyObject *args, void (*act_mul)(const float *, const float *, float *, int)) {
    PyObject *go, *uo, *oo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOOn", &go, &uo, &oo, &n)) return NULL;
    views vs = {.n = 0};
    float *g = vbuf(&vs, go, 0, n, 4, "gate"), *u = g ? vbuf(&vs, uo, 0, n, 4, "up") : NULL;
    float *o = u ? vbuf(&vs, oo, 1, n, 4, "out") : NULL;
    if (o) act_mul(g, u, o, (int)n);
    views_release(&vs);
    if (!o) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    (void)self;
    return gated_act(args, bl_silu_mul);
}

static PyObject *py_gelu_mul(PyObject *self, PyObject *args) {
    (void)self;
    return gated_act(args, bl_gelu_mul);
}

static PyObject *py_add(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *yo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn", &xo, &yo, &n)) return NULL;
    views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, n, 4, "x"), *y = x ? vbuf(&vs, yo, 0, n, 4, "y") : NULL;
    if (y) bl_add(x, y, (int)n);
    views_release(&vs);
    if (!y) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_hadamard(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    Py_ssize_t len;
    int n;
    if (!PyArg_ParseTuple(args, "Oni", &xo, &len, &n)) return NULL;
    if (n < 1 || (n & (n - 1)) || len < 0 || len % n || len > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "hadamard: n must be a power of two dividing len, got n %d, len %zd", n, len);
        return NULL;
    }
    views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, len, 4, "x");
    if (x) bl_hadamard(x, (int)len, n);
    views_release(&vs);
    if (!x) return NULL;
    Py_RETURN_NONE;
}

/* bytes of one kv head's cache region of n_ctx positions; 0 (with the error set) for a bad type or head_dim */
static Py_ssize_t kv_head_bytes(int n_ctx, int hd, int kv_type, const char *what) {
    const size_t rb = bl_kv_row_bytes(hd, kv_type);
    if (!rb) PyErr_Format(PyExc_ValueError, "%s: kv_type %d cannot hold head_dim %d (q8_0: a multiple of %d)", what,
                          kv_type, hd, BL_KV_QK);
    return (Py_ssize_t)(rb * (size_t)n_ctx);
}

/* kv_store(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx, kv_type=0): kv_type 0 f32, 1 (True) f16, 2 q8_0 */
static PyObject *py_kv_store(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *kco, *vco, *ko, *vo;
    int pos, nkv, hd, n_ctx, kvt = 0;
    if (!PyArg_ParseTuple(args, "OOOOiiii|i", &kco, &vco, &ko, &vo, &pos, &nkv, &hd, &n_ctx, &kvt)) return NULL;
    if (n_ctx % BL_KV_TILE || pos < 0 || pos >= n_ctx || nkv < 1) {
        PyErr_SetString(PyExc_ValueError, "kv_store: n_ctx must be a multiple of the tile, 0 <= pos < n_ctx");
        return NULL;
    }
    const Py_ssize_t head = kv_head_bytes(n_ctx, hd, kvt, "kv_store");
    if (!head) return NULL;
    views vs = {.n = 0};
    void *kc = vbuf(&vs, kco, 1, head * nkv, 1, "kc"), *vc = kc ? vbuf(&vs, vco, 1, head * nkv, 1, "vc") : NULL;
    float *k = vc ? vbuf(&vs, ko, 0, (Py_ssize_t)nkv * hd, 4, "k") : NULL;
    float *v = k ? vbuf(&vs, vo, 0, (Py_ssize_t)nkv * hd, 4, "v") : NULL;
    if (v) bl_kv_store(kc, vc, k, v, pos, nkv, hd, n_ctx, kvt);
    views_release(&vs);
    if (!v) return NULL;
    Py_RETURN_NONE;
}

/* attend(q [nq, hd], pos int32 [nq], kc, vc (one head: n_ctx positions each), out [nq, hd], nq, hd, n_ctx, scale,
 *        kv_type=0, window=0) */
static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *qo, *po, *kco, *vco, *oo;
    int nq, hd, n_ctx, kvt = 0, window = 0;
    float scale;
    if (!PyArg_ParseTuple(args, "OOOOOiiif|ii", &qo, &po, &kco, &vco, &oo, &nq, &hd, &n_ctx, &scale, &kvt, &window))
        return NULL;
    if (nq < 1 || nq > BL_ATT_MAXQ || n_ctx % BL_KV_TILE || window < 0) {
        PyErr_Format(PyExc_ValueError, "attend: 1 <= nq <= %d, n_ctx a multiple of %d", BL_ATT_MAXQ, BL_KV_TILE);
        return NULL;
    }
    const Py_ssize_t head = kv_head_bytes(n_ctx, hd, kvt, "attend");
    if (!head) return NULL;
    views vs = {.n = 0};
    float *q = vbuf(&vs, qo, 0, (Py_ssize_t)nq * hd, 4, "q");
    int32_t *pos = q ? vbuf(&vs, po, 0, nq, 4, "pos") : NULL;
    void *kc = pos ? vbuf(&vs, kco, 0, head, 1, "kc") : NULL;
    void *vc = kc ? vbuf(&vs, vco, 0, head, 1, "vc") : NULL;
    float *out = vc ? vbuf(&vs, oo, 1, (Py_ssize_t)nq * hd, 4, "out") : NULL;
    int ok = out != NULL;
    for (int i = 0; ok && i < nq; i++)
        if (pos[i] < 0 || pos[i] >= n_ctx) {
            PyErr_SetString(PyExc_ValueError, "attend: position out of range");
            ok = 0;
        }
    if (ok) {
        bl_attn_query qs[BL_ATT_MAXQ];
        for (int i = 0; i < nq; i++) {
            qs[i].q = q + (size_t)i * hd;
            qs[i].out = out + (size_t)i * hd;
            qs[i].pos = pos[i];
            qs[i].lo = window && pos[i] >= window ? pos[i] - window + 1 : 0;
        }
        bl_attend(qs, nq, kc, vc, hd, scale, kvt);
    }
    views_release(&vs);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* float_to_half(x f32[n], out u16[n]) */
static PyObject *py_float_to_half(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *oo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn", &xo, &oo, &n)) return NULL;
    views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 0, n, 4, "x");
    uint16_t *o = x ? vbuf(&vs, oo, 1, n, 2, "out") : NULL;
    if (o)
        for (Py_ssize_t i = 0; i < n; i++) o[i] = bl_float_to_half(x[i]);
    views_release(&vs);
    if (!o) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_pool_stats(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    long long b, i;
    bl_pool_stats(&b, &i);
    return Py_BuildValue("{s:L,s:L}", "barrier_sleeps", b, "idle_sleeps", i);
}

static PyObject *py_alloc_count(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLongLong(bl_alloc_count());
}

PyMethodDef bl_engine_methods[] = {
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, w, out, T, n, eps): T rows of n"},
    {"rope", py_rope, METH_VARARGS, "rope(x, cs, T, n_heads, head_dim, rope_dim, style): in place, cs [T, rope_dim]"},
    {"softmax", py_softmax, METH_VARARGS, "softmax(x, T, n): in place"},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gate, up, out, n)"},
    {"gelu_mul", py_gelu_mul, METH_VARARGS, "gelu_mul(gate, up, out, n)"},
    {"add", py_add, METH_VARARGS, "add(x, y, n): x += y"},
    {"hadamard", py_hadamard, METH_VARARGS, "hadamard(x, len, n): x = H x over each block of n, in place"},
    {"kv_store", py_kv_store, METH_VARARGS, "kv_store(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx, kv_type=0)"},
    {"attend", py_attend, METH_VARARGS,
     "attend(q, pos, kc, vc, out, nq, head_dim, n_ctx, scale, kv_type=0, window=0): one kv head"},
    {"float_to_half", py_float_to_half, METH_VARARGS, "float_to_half(x_f32, out_u16, n): round to nearest even"},
    {"pool_stats", py_pool_stats, METH_NOARGS, "{'barrier_sleeps': n, 'idle_sleeps': n} so far"},
    {"alloc_count", py_alloc_count, METH_NOARGS, "native heap allocations so far"},
    {NULL, NULL, 0, NULL},
};

int bl_engine_module_init(PyObject *m) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&PlanType) < 0) return -1;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        return -1;
    }
    Py_INCREF(&PlanType);
    if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(&PlanType);
        return -1;
    }
    PyModule_AddIntConstant(m, "KV_TILE", BL_KV_TILE);
    PyModule_AddIntConstant(m, "KV_Q8_0", BL_KV_Q8_0);
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
    PyModule_AddIntConstant(m, "ATT_MAXQ", BL_ATT_MAXQ);
    return 0;
}
