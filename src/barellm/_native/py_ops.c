/* Python bindings of the ops.h kernels, one call at a time (tests, the op-by-op debug path): each takes its
 * buffers as any buffer exporter or (buffer, byte offset), checks their sizes, and runs the kernel on them. */
#include "py_common.h"

#include <math.h>

#include <limits.h>

#include "ops.h"

/* a buffer of at least `count` items of `size` bytes, its view added to vs */
static void *vbuf(bl_views *vs, PyObject *obj, int writable, Py_ssize_t count, Py_ssize_t size, const char *what) {
    Py_ssize_t avail;
    char *p = bl_get_view(obj, writable, &vs->v[vs->n], &avail);
    if (!p) return NULL;
    vs->n++;
    if (avail < count * size) {
        PyErr_Format(PyExc_ValueError, "%s: needs %zd bytes, has %zd", what, count * size, avail);
        return NULL;
    }
    return p;
}

static PyObject *py_rmsnorm(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *wo, *oo;
    int T, n;
    float eps;
    if (!PyArg_ParseTuple(args, "OOOiif", &xo, &wo, &oo, &T, &n, &eps)) return NULL;
    bl_views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 0, (Py_ssize_t)T * n, 4, "x"), *w = x ? vbuf(&vs, wo, 0, n, 4, "w") : NULL;
    float *out = w ? vbuf(&vs, oo, 1, (Py_ssize_t)T * n, 4, "out") : NULL;
    if (out)
        for (int t = 0; t < T; t++) bl_rmsnorm(x + (size_t)t * n, w, out + (size_t)t * n, n, eps);
    bl_views_release(&vs);
    if (!out) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_rope(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *cso;
    int T, n_heads, head_dim, rope_dim, style;
    if (!PyArg_ParseTuple(args, "OOiiiii", &xo, &cso, &T, &n_heads, &head_dim, &rope_dim, &style)) return NULL;
    if (rope_dim < 2 || rope_dim > head_dim || rope_dim % 2) {
        PyErr_SetString(PyExc_ValueError, "rope_dim must be even and <= head_dim");
        return NULL;
    }
    bl_views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, (Py_ssize_t)T * n_heads * head_dim, 4, "x");
    float *cs = x ? vbuf(&vs, cso, 0, (Py_ssize_t)T * rope_dim, 4, "cs") : NULL;
    if (cs)
        for (int t = 0; t < T; t++)
            bl_rope(x + (size_t)t * n_heads * head_dim, n_heads, head_dim, rope_dim, cs + (size_t)t * rope_dim, style);
    bl_views_release(&vs);
    if (!cs) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_softmax(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo;
    int T, n;
    if (!PyArg_ParseTuple(args, "Oii", &xo, &T, &n)) return NULL;
    bl_views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, (Py_ssize_t)T * n, 4, "x");
    if (x)
        for (int t = 0; t < T; t++) bl_softmax(x + (size_t)t * n, n);
    bl_views_release(&vs);
    if (!x) return NULL;
    Py_RETURN_NONE;
}

/* out[n] = act(gate[n]) * up[n], for each gated activation kernel */
static PyObject *gated_act(PyObject *args, void (*act_mul)(const float *, const float *, float *, int)) {
    PyObject *go, *uo, *oo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOOn", &go, &uo, &oo, &n)) return NULL;
    bl_views vs = {.n = 0};
    float *g = vbuf(&vs, go, 0, n, 4, "gate"), *u = g ? vbuf(&vs, uo, 0, n, 4, "up") : NULL;
    float *o = u ? vbuf(&vs, oo, 1, n, 4, "out") : NULL;
    if (o) act_mul(g, u, o, (int)n);
    bl_views_release(&vs);
    if (!o) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    return gated_act(args, bl_silu_mul);
}

static PyObject *py_gelu_mul(PyObject *Py_UNUSED(self), PyObject *args) {
    return gated_act(args, bl_gelu_mul);
}

static PyObject *py_add(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *yo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn", &xo, &yo, &n)) return NULL;
    bl_views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, n, 4, "x"), *y = x ? vbuf(&vs, yo, 0, n, 4, "y") : NULL;
    if (y) bl_add(x, y, (int)n);
    bl_views_release(&vs);
    if (!y) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_hadamard(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo;
    Py_ssize_t len;
    int n;
    if (!PyArg_ParseTuple(args, "Oni", &xo, &len, &n)) return NULL;
    if (n < 1 || (n & (n - 1)) || len < 0 || len % n || len > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "hadamard: n must be a power of two dividing len, got n %d, len %zd", n, len);
        return NULL;
    }
    bl_views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 1, len, 4, "x");
    if (x) bl_hadamard(x, (int)len, n);
    bl_views_release(&vs);
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
static PyObject *py_kv_store(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *kco, *vco, *ko, *vo;
    int pos, nkv, hd, n_ctx, kvt = 0;
    if (!PyArg_ParseTuple(args, "OOOOiiii|i", &kco, &vco, &ko, &vo, &pos, &nkv, &hd, &n_ctx, &kvt)) return NULL;
    if (n_ctx % BL_KV_TILE || pos < 0 || pos >= n_ctx || nkv < 1) {
        PyErr_SetString(PyExc_ValueError, "kv_store: n_ctx must be a multiple of the tile, 0 <= pos < n_ctx");
        return NULL;
    }
    const Py_ssize_t head = kv_head_bytes(n_ctx, hd, kvt, "kv_store");
    if (!head) return NULL;
    bl_views vs = {.n = 0};
    void *kc = vbuf(&vs, kco, 1, head * nkv, 1, "kc"), *vc = kc ? vbuf(&vs, vco, 1, head * nkv, 1, "vc") : NULL;
    float *k = vc ? vbuf(&vs, ko, 0, (Py_ssize_t)nkv * hd, 4, "k") : NULL;
    float *v = k ? vbuf(&vs, vo, 0, (Py_ssize_t)nkv * hd, 4, "v") : NULL;
    if (v) bl_kv_store(kc, vc, k, v, pos, nkv, hd, n_ctx, kvt);
    bl_views_release(&vs);
    if (!v) return NULL;
    Py_RETURN_NONE;
}

/* attend(q [nq, hd], pos int32 [nq], kc, vc (one head: n_ctx positions each), out [nq, hd], nq, hd, n_ctx, scale,
 *        kv_type=0, window=0, softcap=0, sink=-inf): sink one logit for every query, or a float32 buffer of nq */
static PyObject *py_attend(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *qo, *po, *kco, *vco, *oo, *so = NULL;
    int nq, hd, n_ctx, kvt = 0, window = 0;
    float scale, cap = 0, sink = -INFINITY;
    if (!PyArg_ParseTuple(args, "OOOOOiiif|iifO", &qo, &po, &kco, &vco, &oo, &nq, &hd, &n_ctx, &scale, &kvt, &window,
                          &cap, &so))
        return NULL;
    const int sink_each = so && !PyFloat_Check(so) && !PyLong_Check(so) && PyObject_CheckBuffer(so);
    if (so && !sink_each) {
        sink = (float)PyFloat_AsDouble(so);
        if (sink == -1.0f && PyErr_Occurred()) return NULL;
    }
    if (nq < 1 || nq > BL_ATT_MAXQ || n_ctx % BL_KV_TILE || window < 0) {
        PyErr_Format(PyExc_ValueError, "attend: 1 <= nq <= %d, n_ctx a multiple of %d", BL_ATT_MAXQ, BL_KV_TILE);
        return NULL;
    }
    const Py_ssize_t head = kv_head_bytes(n_ctx, hd, kvt, "attend");
    if (!head) return NULL;
    bl_views vs = {.n = 0};
    float *q = vbuf(&vs, qo, 0, (Py_ssize_t)nq * hd, 4, "q");
    int32_t *pos = q ? vbuf(&vs, po, 0, nq, 4, "pos") : NULL;
    void *kc = pos ? vbuf(&vs, kco, 0, head, 1, "kc") : NULL;
    void *vc = kc ? vbuf(&vs, vco, 0, head, 1, "vc") : NULL;
    float *out = vc ? vbuf(&vs, oo, 1, (Py_ssize_t)nq * hd, 4, "out") : NULL;
    const float *sinks = out && sink_each ? vbuf(&vs, so, 0, nq, 4, "sink") : NULL;
    int ok = out != NULL && (!sink_each || sinks);
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
            qs[i].sink = sinks ? sinks[i] : sink;
        }
        bl_attend(qs, nq, kc, vc, hd, scale, cap, kvt);
    }
    bl_views_release(&vs);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* float_to_half(x f32[n], out u16[n]) */
static PyObject *py_float_to_half(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *xo, *oo;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OOn", &xo, &oo, &n)) return NULL;
    bl_views vs = {.n = 0};
    float *x = vbuf(&vs, xo, 0, n, 4, "x");
    uint16_t *o = x ? vbuf(&vs, oo, 1, n, 2, "out") : NULL;
    if (o)
        for (Py_ssize_t i = 0; i < n; i++) o[i] = bl_float_to_half(x[i]);
    bl_views_release(&vs);
    if (!o) return NULL;
    Py_RETURN_NONE;
}

PyMethodDef bl_op_methods[] = {
    BL_METHOD(rmsnorm, "rmsnorm(x, w, out, T, n, eps): T rows of n"),
    BL_METHOD(rope, "rope(x, cs, T, n_heads, head_dim, rope_dim, style): in place, cs [T, rope_dim]"),
    BL_METHOD(softmax, "softmax(x, T, n): in place"),
    BL_METHOD(silu_mul, "silu_mul(gate, up, out, n)"),
    BL_METHOD(gelu_mul, "gelu_mul(gate, up, out, n)"),
    BL_METHOD(add, "add(x, y, n): x += y"),
    BL_METHOD(hadamard, "hadamard(x, len, n): x = H x over each block of n, in place"),
    BL_METHOD(kv_store, "kv_store(kc, vc, k, v, pos, n_kv_heads, head_dim, n_ctx, kv_type=0)"),
    BL_METHOD(attend, "attend(q, pos, kc, vc, out, nq, head_dim, n_ctx, scale, kv_type=0, window=0, softcap=0, sink=-inf): one kv "
              "head; sink a float or nq float32"),
    BL_METHOD(float_to_half, "float_to_half(x_f32, out_u16, n): round to nearest even"),
    {NULL, NULL, 0, NULL},
};

/* the KV cache's geometry, which kv_store, attend and a plan's op dicts take */
int bl_op_module_init(PyObject *m) {
    if (PyModule_AddIntConstant(m, "KV_TILE", BL_KV_TILE) < 0 || PyModule_AddIntConstant(m, "KV_Q8_0", BL_KV_Q8_0) < 0 ||
        PyModule_AddIntConstant(m, "ATT_MAXQ", BL_ATT_MAXQ) < 0)
        return -1;
    return 0;
}
