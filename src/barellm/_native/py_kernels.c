/* Python bindings of single kernels (tests, benchmarks, the op-by-op debug path).
 *
 * Weights are passed as (type, layout, rows, cols, w) with w any contiguous bytes-like object of exactly
 * matrix_bytes(type, layout, rows, cols) bytes; float inputs as C-contiguous float32 buffers (NumPy arrays).
 * Results come back as memoryviews of format 'f' (np.asarray() them). The GIL is released around kernel work.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"
#include "py_common.h"
#include "quant_internal.h"

/* ---- argument checking ---- */

static int check_matrix(bl_matrix *m, int type, int layout, int rows, int cols, int act) {
    m->type = type;
    m->layout = layout;
    m->rows = rows;
    m->cols = cols;
    m->data = NULL;
    m->act = act;
    if (rows <= 0 || cols <= 0) {
        PyErr_Format(PyExc_ValueError, "matrix shape (%d, %d) must be positive", rows, cols);
        return -1;
    }
    const bl_type_traits *t = bl_traits(type);
    if (!t || !t->acts) {
        PyErr_Format(PyExc_ValueError, "type %d is not supported by the matmul kernels", type);
        return -1;
    }
    if (cols % t->block_size) {
        PyErr_Format(PyExc_ValueError, "cols = %d is not a multiple of the block size %d", cols, t->block_size);
        return -1;
    }
    if (bl_matrix_bytes(type, layout, rows, cols) == 0) {
        PyErr_Format(PyExc_ValueError, "layout %d is not supported for type %d", layout, type);
        return -1;
    }
    if (!bl_act_supported(type, act)) {
        PyErr_Format(PyExc_ValueError, "activation type %d is not supported for type %d", act, type);
        return -1;
    }
    return 0;
}

/* w: exactly matrix_bytes bytes */
static int get_weights(PyObject *obj, bl_matrix *m, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0) return -1;
    size_t need = bl_matrix_bytes(m->type, m->layout, m->rows, m->cols);
    if ((size_t)view->len != need) {
        PyErr_Format(PyExc_ValueError, "weights have %zd bytes, expected %zu", view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    m->data = view->buf;
    return 0;
}

/* x: C-contiguous float32, a whole number of vectors of `cols`; sets *T */
static int get_f32(PyObject *obj, int cols, Py_buffer *view, int *T) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (view->itemsize != 4 || !(strcmp(f, "f") == 0 || strcmp(f, "<f") == 0 || strcmp(f, "=f") == 0)) {
        PyErr_Format(PyExc_ValueError, "x must be float32 (got format %s)", f);
        PyBuffer_Release(view);
        return -1;
    }
    Py_ssize_t n = view->len / 4;
    if (n == 0 || n % cols || n / cols > 1 << 24) {
        PyErr_Format(PyExc_ValueError, "x has %zd values, not a positive multiple of cols = %d", n, cols);
        PyBuffer_Release(view);
        return -1;
    }
    *T = (int)(n / cols);
    return 0;
}

static void *alloc64(size_t n) { return aligned_alloc(64, bl_round_up(n ? n : 1, 64)); }

/* a zeroed float32 result of the given shape: *buf receives its storage */
static PyObject *new_f32(Py_ssize_t d0, Py_ssize_t d1, int two_d, float **buf) {
    PyObject *ba = PyByteArray_FromStringAndSize(NULL, d0 * d1 * 4);
    if (!ba) return NULL;
    memset(PyByteArray_AS_STRING(ba), 0, (size_t)(d0 * d1 * 4));
    *buf = (float *)PyByteArray_AS_STRING(ba);
    PyObject *mv = PyMemoryView_FromObject(ba);
    Py_DECREF(ba);
    if (!mv) return NULL;
    PyObject *res = two_d ? PyObject_CallMethod(mv, "cast", "s(nn)", "f", d0, d1)
                          : PyObject_CallMethod(mv, "cast", "s", "f");
    Py_DECREF(mv);
    return res;
}

static int check_range(const bl_matrix *m, int *r0, int *r1) {
    if (*r1 < 0) *r1 = m->rows;
    if (*r0 < 0 || *r0 > *r1 || *r1 > m->rows) {
        PyErr_Format(PyExc_ValueError, "row range [%d, %d) not within [0, %d)", *r0, *r1, m->rows);
        return -1;
    }
    if (*r0 % bl_matmul_row_align(m)) {
        PyErr_Format(PyExc_ValueError, "r0 = %d is not a multiple of the row alignment %d", *r0,
                     bl_matmul_row_align(m));
        return -1;
    }
    return 0;
}

/* ---- functions ---- */

/* a (type, layout, shape) the table can store, kernels or not */
static int check_storage(int type, int layout, int rows, int cols) {
    const bl_type_traits *t = bl_traits(type);
    if (!t) {
        PyErr_Format(PyExc_ValueError, "type %d is not in the kernels' table", type);
        return -1;
    }
    if (rows <= 0 || cols <= 0 || cols % t->block_size) {
        PyErr_Format(PyExc_ValueError, "matrix shape (%d, %d) is not positive whole %s blocks of %d", rows, cols,
                     t->name, t->block_size);
        return -1;
    }
    if (bl_matrix_bytes(type, layout, rows, cols) == 0) {
        PyErr_Format(PyExc_ValueError, "layout %d is not supported for type %d", layout, type);
        return -1;
    }
    return 0;
}

static PyObject *py_matrix_bytes(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, rows, cols;
    if (!PyArg_ParseTuple(args, "iiii", &type, &layout, &rows, &cols)) return NULL;
    if (check_storage(type, layout, rows, cols) < 0) return NULL;
    return PyLong_FromSize_t(bl_matrix_bytes(type, layout, rows, cols));
}

/* type_info(type) -> dict of the table's row, or None for a type the table does not know */
static PyObject *py_type_info(PyObject *Py_UNUSED(self), PyObject *args) {
    int type;
    if (!PyArg_ParseTuple(args, "i", &type)) return NULL;
    const bl_type_traits *t = bl_traits(type);
    if (!t) Py_RETURN_NONE;
    PyObject *acts = PyList_New(0), *layouts = PyList_New(0);
    for (int a = 0; acts && a < BL_ACT_COUNT; a++)
        if (t->acts >> a & 1) {
            PyObject *v = PyLong_FromLong(a);
            if (!v || PyList_Append(acts, v) < 0) Py_CLEAR(acts);
            Py_XDECREF(v);
        }
    for (int l = 0; layouts && l < BL_LAYOUT_COUNT; l++)
        if (bl_group_bytes(type, l, t->block_size)) {
            PyObject *v = PyLong_FromLong(l);
            if (!v || PyList_Append(layouts, v) < 0) Py_CLEAR(layouts);
            Py_XDECREF(v);
        }
    if (!acts || !layouts) {
        Py_XDECREF(acts);
        Py_XDECREF(layouts);
        return NULL;
    }
    return Py_BuildValue("{s:s,s:i,s:i,s:N,s:O,s:i,s:N}", "name", t->name, "block_size", t->block_size,
                         "block_bytes", t->block_bytes, "acts", acts, "int_acts", t->int_acts ? Py_True : Py_False,
                         "layout", t->layout, "layouts", layouts);
}

static PyObject *py_row_bytes(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, cols;
    if (!PyArg_ParseTuple(args, "ii", &type, &cols)) return NULL;
    return PyLong_FromSize_t(bl_row_bytes(type, cols));
}

static PyObject *py_group_bytes(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, cols;
    if (!PyArg_ParseTuple(args, "iii", &type, &layout, &cols)) return NULL;
    return PyLong_FromSize_t(bl_group_bytes(type, layout, cols));
}

static PyObject *py_layout_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    int layout;
    if (!PyArg_ParseTuple(args, "i", &layout)) return NULL;
    if (layout < 0 || layout >= BL_LAYOUT_COUNT) return PyErr_Format(PyExc_ValueError, "unknown layout %d", layout);
    return PyLong_FromLong(bl_layout_rows(layout));
}

/* exactly n bytes of a buffer (writable or not) */
static int get_exact(PyObject *obj, Py_buffer *view, int writable, size_t n, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if ((size_t)view->len != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zu", what, view->len, n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* repack_into(type, layout, rows, cols, src_rows, dst) / unrepack_into(type, layout, rows, cols, src, dst_rows):
 * GGUF rows to `layout` and back, into a caller-owned buffer, without the GIL */
static PyObject *repack_dir(PyObject *args, int back) {
    int type, layout, rows, cols;
    PyObject *so, *dobj;
    if (!PyArg_ParseTuple(args, "iiiiOO", &type, &layout, &rows, &cols, &so, &dobj)) return NULL;
    if (check_storage(type, layout, rows, cols) < 0) return NULL;
    const size_t packed = bl_matrix_bytes(type, layout, rows, cols), plain = bl_matrix_bytes(type, BL_LAYOUT_ROWS, rows, cols);
    Py_buffer sv, dv;
    if (get_exact(so, &sv, 0, back ? packed : plain, "src") < 0) return NULL;
    if (get_exact(dobj, &dv, 1, back ? plain : packed, "dst") < 0) {
        PyBuffer_Release(&sv);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = back ? bl_unrepack(type, layout, rows, cols, sv.buf, dv.buf) : bl_repack(type, layout, rows, cols, sv.buf, dv.buf);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sv);
    PyBuffer_Release(&dv);
    if (rc) return PyErr_Format(PyExc_ValueError, "cannot convert type %d between rows and layout %d", type, layout);
    Py_RETURN_NONE;
}

static PyObject *py_repack_into(PyObject *Py_UNUSED(self), PyObject *args) {
    return repack_dir(args, 0);
}

static PyObject *py_unrepack_into(PyObject *Py_UNUSED(self), PyObject *args) {
    return repack_dir(args, 1);
}

/* dequantize_rows(type, layout, rows, cols, w, out, r0=0, r1=rows): rows [r0, r1) of W into out (f32,
 * (r1 - r0) * cols values), from any layout, with the type's one dequantizer */
static PyObject *py_dequantize_rows(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, rows, cols, r0 = 0, r1 = -1;
    PyObject *wo, *oo;
    if (!PyArg_ParseTuple(args, "iiiiOO|ii", &type, &layout, &rows, &cols, &wo, &oo, &r0, &r1)) return NULL;
    if (check_storage(type, layout, rows, cols) < 0) return NULL;
    if (!bl_traits(type)->dequant) return PyErr_Format(PyExc_ValueError, "type %d has no dequantizer", type);
    if (r1 < 0) r1 = rows;
    if (r0 < 0 || r0 > r1 || r1 > rows) return PyErr_Format(PyExc_ValueError, "rows [%d, %d) not within [0, %d)", r0, r1, rows);
    Py_buffer wv, ov;
    if (get_exact(wo, &wv, 0, bl_matrix_bytes(type, layout, rows, cols), "w") < 0) return NULL;
    if (get_exact(oo, &ov, 1, (size_t)(r1 - r0) * (size_t)cols * 4, "out") < 0) {
        PyBuffer_Release(&wv);
        return NULL;
    }
    const bl_matrix m = {type, layout, rows, cols, wv.buf, BL_ACT_Q8};
    Py_BEGIN_ALLOW_THREADS
    for (int r = r0; r < r1; r++) bl_dequantize_row(&m, r, (float *)ov.buf + (size_t)(r - r0) * cols);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wv);
    PyBuffer_Release(&ov);
    Py_RETURN_NONE;
}

static PyObject *py_act_row_bytes(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, cols, act = BL_ACT_Q8;
    bl_matrix m;
    if (!PyArg_ParseTuple(args, "iii|i", &type, &layout, &cols, &act)) return NULL;
    if (check_matrix(&m, type, layout, 8, cols, act) < 0) return NULL;
    return PyLong_FromSize_t(bl_act_row_bytes(&m, cols));
}

static PyObject *py_act_supported(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, act;
    if (!PyArg_ParseTuple(args, "ii", &type, &act)) return NULL;
    return PyBool_FromLong(bl_act_supported(type, act));
}

static PyObject *py_row_align(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout;
    bl_matrix m;
    if (!PyArg_ParseTuple(args, "ii", &type, &layout)) return NULL;
    if (check_matrix(&m, type, layout, 8, 256, BL_ACT_Q8) < 0) return NULL;
    return PyLong_FromLong(bl_matmul_row_align(&m));
}

static PyObject *py_repack(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, rows, cols;
    PyObject *wobj;
    bl_matrix m;
    Py_buffer wv;
    if (!PyArg_ParseTuple(args, "iiiiO", &type, &layout, &rows, &cols, &wobj)) return NULL;
    if (check_storage(type, BL_LAYOUT_ROWS, rows, cols) < 0) return NULL;
    m = (bl_matrix){type, BL_LAYOUT_ROWS, rows, cols, NULL, BL_ACT_Q8};
    if (get_weights(wobj, &m, &wv) < 0) return NULL;
    size_t n = bl_matrix_bytes(type, layout, rows, cols);
    if (n == 0) {
        PyBuffer_Release(&wv);
        return PyErr_Format(PyExc_ValueError, "layout %d is not supported for type %d", layout, type);
    }
    PyObject *ba = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (!ba) {
        PyBuffer_Release(&wv);
        return NULL;
    }
    char *dst = PyByteArray_AS_STRING(ba);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = bl_repack(type, layout, rows, cols, wv.buf, dst);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&wv);
    if (rc != 0) {
        Py_DECREF(ba);
        return PyErr_Format(PyExc_ValueError, "cannot repack type %d into layout %d", type, layout);
    }
    return ba;
}

static PyObject *py_quantize_act(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, cols, T, act = BL_ACT_Q8, piece = 0;
    PyObject *xobj;
    bl_matrix m;
    Py_buffer xv;
    if (!PyArg_ParseTuple(args, "iiiO|ii", &type, &layout, &cols, &xobj, &act, &piece)) return NULL;
    if (piece < 0) {
        PyErr_SetString(PyExc_ValueError, "piece must be >= 0");
        return NULL;
    }
    if (check_matrix(&m, type, layout, 8, cols, act) < 0 || get_f32(xobj, cols, &xv, &T) < 0) return NULL;
    size_t rb = bl_act_row_bytes(&m, cols);
    PyObject *ba = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(rb * T));
    if (!ba) {
        PyBuffer_Release(&xv);
        return NULL;
    }
    char *dst = PyByteArray_AS_STRING(ba);
    memset(dst, 0, rb * T);
    Py_BEGIN_ALLOW_THREADS
    if (!piece) bl_quantize_act(&m, (const float *)xv.buf, (size_t)cols, T, dst);
    else /* each row in ranges of `piece` blocks, last first, as threads sharing a row would */
        for (int t = 0; t < T; t++)
            for (int b = (cols + BL_ACT_BLOCK - 1) / BL_ACT_BLOCK / piece * piece; b >= 0; b -= piece)
                bl_quantize_act_blocks(&m, (const float *)xv.buf + (size_t)t * cols, dst + (size_t)t * rb, b, b + piece);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&xv);
    return ba;
}

static PyObject *py_matmul(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"type", "layout", "rows", "cols", "w", "x", "r0", "r1", "act", NULL};
    int type, layout, rows, cols, r0 = 0, r1 = -1, T, act = BL_ACT_Q8;
    PyObject *wobj, *xobj;
    bl_matrix m;
    Py_buffer wv, xv;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiOO|iii", kwlist, &type, &layout, &rows, &cols, &wobj, &xobj,
                                     &r0, &r1, &act))
        return NULL;
    if (check_matrix(&m, type, layout, rows, cols, act) < 0 || check_range(&m, &r0, &r1) < 0) return NULL;
    if (get_weights(wobj, &m, &wv) < 0) return NULL;
    if (get_f32(xobj, cols, &xv, &T) < 0) {
        PyBuffer_Release(&wv);
        return NULL;
    }
    float *out;
    PyObject *res = new_f32(T, rows, 1, &out);
    void *xq = res ? alloc64(bl_act_row_bytes(&m, cols) * T) : NULL;
    if (res && !xq) {
        Py_CLEAR(res);
        PyErr_NoMemory();
    }
    if (res) {
        Py_BEGIN_ALLOW_THREADS
        bl_quantize_act(&m, (const float *)xv.buf, (size_t)cols, T, xq);
        bl_matmul(&m, xq, T, out, (size_t)rows, r0, r1);
        Py_END_ALLOW_THREADS
    }
    free(xq);
    PyBuffer_Release(&wv);
    PyBuffer_Release(&xv);
    return res;
}

/* matmul_q(type, layout, rows, cols, w, xq, T, r0=0, r1=rows): from activations made by quantize_act */
static PyObject *py_matmul_q(PyObject *Py_UNUSED(self), PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"type", "layout", "rows", "cols", "w", "xq", "T", "r0", "r1", "act", NULL};
    int type, layout, rows, cols, T, r0 = 0, r1 = -1, act = BL_ACT_Q8;
    PyObject *wobj, *xobj;
    bl_matrix m;
    Py_buffer wv, xv;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiiiOOi|iii", kwlist, &type, &layout, &rows, &cols, &wobj, &xobj,
                                     &T, &r0, &r1, &act))
        return NULL;
    if (check_matrix(&m, type, layout, rows, cols, act) < 0 || check_range(&m, &r0, &r1) < 0) return NULL;
    if (T <= 0) return PyErr_Format(PyExc_ValueError, "T = %d must be positive", T);
    if (get_weights(wobj, &m, &wv) < 0) return NULL;
    if (PyObject_GetBuffer(xobj, &xv, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&wv);
        return NULL;
    }
    PyObject *res = NULL;
    if ((size_t)xv.len != bl_act_row_bytes(&m, cols) * (size_t)T) {
        PyErr_Format(PyExc_ValueError, "xq has %zd bytes, expected %zu", xv.len, bl_act_row_bytes(&m, cols) * T);
    } else {
        float *out;
        res = new_f32(T, rows, 1, &out);
        if (res) {
            Py_BEGIN_ALLOW_THREADS
            bl_matmul(&m, xv.buf, T, out, (size_t)rows, r0, r1);
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&wv);
    PyBuffer_Release(&xv);
    return res;
}

static PyObject *py_dequantize_row(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, rows, cols, r;
    PyObject *wobj;
    bl_matrix m;
    Py_buffer wv;
    if (!PyArg_ParseTuple(args, "iiiiOi", &type, &layout, &rows, &cols, &wobj, &r)) return NULL;
    if (check_storage(type, layout, rows, cols) < 0) return NULL;
    m = (bl_matrix){type, layout, rows, cols, NULL, BL_ACT_Q8};
    if (r < 0 || r >= rows) return PyErr_Format(PyExc_ValueError, "row %d not within [0, %d)", r, rows);
    if (get_weights(wobj, &m, &wv) < 0) return NULL;
    float *out;
    PyObject *res = new_f32(cols, 1, 0, &out);
    if (res) bl_dequantize_row(&m, r, out);
    PyBuffer_Release(&wv);
    return res;
}

static double now_s(int cpu) {
    struct timespec ts;
    clock_gettime(cpu ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* bench_matmul(type, layout, rows, cols, ws, x, iters, cpu=False) -> seconds per call (matmul only,
 * activations quantized once beforehand); ws is a sequence of weight buffers of the same shape, used
 * round-robin (many copies make the weights stream from memory instead of cache). cpu: count this thread's
 * CPU time instead of wall time (steadier on a shared machine). */
static PyObject *py_bench_matmul(PyObject *Py_UNUSED(self), PyObject *args) {
    int type, layout, rows, cols, iters, T, cpu = 0, act = BL_ACT_Q8;
    PyObject *wseq, *xobj;
    bl_matrix m;
    Py_buffer xv;
    if (!PyArg_ParseTuple(args, "iiiiOOi|pi", &type, &layout, &rows, &cols, &wseq, &xobj, &iters, &cpu, &act))
        return NULL;
    if (check_matrix(&m, type, layout, rows, cols, act) < 0) return NULL;
    if (iters <= 0) return PyErr_Format(PyExc_ValueError, "iters must be positive");
    PyObject *fast = PySequence_Fast(wseq, "ws must be a sequence of weight buffers");
    if (!fast) return NULL;
    Py_ssize_t nw = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *wv = nw > 0 ? calloc((size_t)nw, sizeof(Py_buffer)) : NULL;
    bl_matrix *ms = nw > 0 ? calloc((size_t)nw, sizeof(bl_matrix)) : NULL;
    Py_ssize_t got = 0;
    PyObject *res = NULL;
    void *xq = NULL;
    float *out = NULL;
    if (nw <= 0 || !wv || !ms) {
        PyErr_SetString(PyExc_ValueError, "ws must be a non-empty sequence");
        goto done;
    }
    for (; got < nw; got++) {
        ms[got] = m;
        if (get_weights(PySequence_Fast_GET_ITEM(fast, got), &ms[got], &wv[got]) < 0) goto done;
    }
    if (get_f32(xobj, cols, &xv, &T) < 0) goto done;
    xq = alloc64(bl_act_row_bytes(&m, cols) * T);
    out = alloc64((size_t)T * rows * 4);
    if (!xq || !out) {
        PyErr_NoMemory();
    } else {
        double dt;
        Py_BEGIN_ALLOW_THREADS
        bl_quantize_act(&m, (const float *)xv.buf, (size_t)cols, T, xq);
        double t0 = now_s(cpu);
        for (int i = 0; i < iters; i++) bl_matmul(&ms[i % nw], xq, T, out, (size_t)rows, 0, rows);
        dt = (now_s(cpu) - t0) / iters;
        Py_END_ALLOW_THREADS
        res = PyFloat_FromDouble(dt);
    }
    PyBuffer_Release(&xv);
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&wv[i]);
    free(wv);
    free(ms);
    free(xq);
    free(out);
    Py_DECREF(fast);
    return res;
}

PyMethodDef bl_kernel_methods[] = {
    BL_METHOD(type_info,
        "type_info(type) -> the traits table's row as a dict (name, block_size, block_bytes, acts, int_acts, layout,\n"
        "layouts), or None for a type it does not know."),
    BL_METHOD(row_bytes, "row_bytes(type, cols) -> bytes of one GGUF row; 0 if unsupported."),
    BL_METHOD(group_bytes,
        "group_bytes(type, layout, cols) -> bytes of one group of layout_rows(layout) rows; 0 if unsupported."),
    BL_METHOD(layout_rows, "layout_rows(layout) -> rows per group of the layout."),
    BL_METHOD(repack_into, "repack_into(type, layout, rows, cols, src_rows, dst)"),
    BL_METHOD(unrepack_into, "unrepack_into(type, layout, rows, cols, src, dst_rows)"),
    BL_METHOD(dequantize_rows,
        "dequantize_rows(type, layout, rows, cols, w, out_f32, r0=0, r1=rows): rows [r0, r1) of W as float32."),
    BL_METHOD(matrix_bytes,
        "matrix_bytes(type, layout, rows, cols) -> bytes of W[rows, cols] stored in that type and layout."),
    BL_METHOD(act_row_bytes,
        "act_row_bytes(type, layout, cols, act=0) -> bytes of one activation vector converted for such weights\n"
        "(act: 0 = 8-bit blocks, 1 = two 8-bit planes, for Q4_0 / Q4_1 / Q8_0 / MXFP4)."),
    BL_METHOD(act_supported,
        "act_supported(type, act) -> whether the kernels for `type` take activations of type `act`."),
    BL_METHOD(row_align,
        "row_align(type, layout) -> row ranges of a matmul must start at a multiple of this."),
    BL_METHOD(repack,
        "repack(type, layout, rows, cols, w_rows) -> bytearray: GGUF-ordered rows w_rows in `layout`."),
    BL_METHOD(quantize_act,
        "quantize_act(type, layout, cols, x_f32[T, cols], act=0, piece=0) -> bytearray of T activation vectors; "
        "piece > 0: each converted in ranges of that many blocks (bl_quantize_act_blocks)."),
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_VARARGS | METH_KEYWORDS,
     "matmul(type, layout, rows, cols, w, x_f32[T, cols], r0=0, r1=rows, act=0) -> f32 memoryview [T, rows]\n"
     "(out[t, r] = sum_k W[r, k] x[t, k] for r in [r0, r1), zero elsewhere)."},
    {"matmul_q", (PyCFunction)(void (*)(void))py_matmul_q, METH_VARARGS | METH_KEYWORDS,
     "matmul_q(type, layout, rows, cols, w, xq, T, r0=0, r1=rows, act=0) -> f32 memoryview [T, rows], xq from "
     "quantize_act."},
    BL_METHOD(dequantize_row,
        "dequantize_row(type, layout, rows, cols, w, r) -> f32 memoryview [cols]: row r of W."),
    BL_METHOD(bench_matmul,
        "bench_matmul(type, layout, rows, cols, ws, x_f32[T, cols], iters, cpu=False, act=0) -> seconds per call\n"
        "(cpu=True: this thread's CPU time rather than wall time)."),
    {NULL, NULL, 0, NULL},
};
