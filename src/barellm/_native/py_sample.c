/* Python binding of the sampling chain (sample.h): the Sampler type and the row kernels, for sampling.py.
 *
 * Rows are C-contiguous float32 buffers (NumPy arrays) of at least n_vocab values; a sampled row must be
 * writable (bias and penalties are applied in place for the call and undone before it returns). The GIL is
 * kept: a call is a few microseconds, less than handing the GIL over and back would cost.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "py_common.h"
#include "sample.h"

/* a C-contiguous buffer of at least `count` items with the struct format `fmt` ("f", "i" or "I") */
static void *get_buf(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t count, char fmt, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return NULL;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = view->itemsize == 4 && f[0] && !f[1] &&
             (f[0] == fmt || (fmt == 'i' && f[0] == 'l' && sizeof(long) == 4) ||
              (fmt == 'I' && f[0] == 'L' && sizeof(long) == 4));
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s must be %s (got format %s, item size %zd)", what,
                     fmt == 'f' ? "float32" : fmt == 'i' ? "int32" : "uint32", view->format ? view->format : "B",
                     view->itemsize);
        PyBuffer_Release(view);
        return NULL;
    }
    if (view->len / 4 < count) {
        PyErr_Format(PyExc_ValueError, "%s has %zd values, needs %zd", what, view->len / 4, count);
        PyBuffer_Release(view);
        return NULL;
    }
    return view->buf;
}

typedef struct {
    PyObject_HEAD
    int n;
    bl_sampling p;
    bl_cand *scratch, *saved;
    int32_t *counts, *bias_ids;
    float *bias;
    int n_bias;
} SamplerObject;

static void Sampler_free(SamplerObject *s) {
    free(s->scratch);
    free(s->saved);
    free(s->counts);
    free(s->bias_ids);
    free(s->bias);
    s->scratch = s->saved = NULL;
    s->counts = s->bias_ids = NULL;
    s->bias = NULL;
}

static void Sampler_dealloc(SamplerObject *s) {
    Sampler_free(s);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int Sampler_init(SamplerObject *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"n_vocab", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                            "presence_penalty", "frequency_penalty", "bias_ids", "bias_values", NULL};
    int n, top_k;
    double temperature, top_p, min_p, rp, pp, fp;
    PyObject *ido = Py_None, *bvo = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ididdddd|OO", names, &n, &temperature, &top_k, &top_p, &min_p, &rp,
                                     &pp, &fp, &ido, &bvo))
        return -1;
    if (n < 1 || n > (1 << 26) || top_k < 0 || !(rp > 0) || !isfinite(temperature) || !isfinite(top_p) ||
        !isfinite(min_p) || !isfinite(rp) || !isfinite(pp) || !isfinite(fp)) {
        PyErr_SetString(PyExc_ValueError, "Sampler: n_vocab in 1..2^26, top_k >= 0, finite parameters, "
                                          "repeat_penalty > 0");
        return -1;
    }
    Sampler_free(s);
    s->n = n;
    s->p = (bl_sampling){temperature, top_k, top_p, min_p, (float)rp, (float)pp, (float)fp};
    s->n_bias = 0;
    if ((ido == Py_None) != (bvo == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "Sampler: bias_ids and bias_values go together");
        return -1;
    }
    if (ido != Py_None) {
        Py_buffer vi, vv;
        const int32_t *ids = get_buf(ido, &vi, 0, 0, 'i', "bias_ids");
        if (!ids) return -1;
        Py_ssize_t nb = vi.len / 4;
        const float *vals = get_buf(bvo, &vv, 0, nb, 'f', "bias_values");
        if (!vals) {
            PyBuffer_Release(&vi);
            return -1;
        }
        int ok = nb <= n;
        for (Py_ssize_t i = 0; ok && i < nb; i++) ok = ids[i] >= 0 && ids[i] < n && isfinite(vals[i]);
        if (ok && nb) {
            s->bias_ids = malloc(sizeof(int32_t) * nb);
            s->bias = malloc(sizeof(float) * nb);
            if (s->bias_ids && s->bias) {
                memcpy(s->bias_ids, ids, sizeof(int32_t) * nb);
                memcpy(s->bias, vals, sizeof(float) * nb);
                s->n_bias = (int)nb;
            }
        }
        PyBuffer_Release(&vi);
        PyBuffer_Release(&vv);
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "Sampler: at most n_vocab bias entries, ids in 0..n_vocab-1, "
                                              "finite values");
            return -1;
        }
        if (nb && !s->bias) {
            PyErr_NoMemory();
            return -1;
        }
    }
    int penalized = s->p.repeat_penalty != 1.0f || s->p.presence_penalty != 0.0f || s->p.frequency_penalty != 0.0f;
    s->scratch = malloc(sizeof(bl_cand) * n);
    s->saved = malloc(sizeof(bl_cand) * ((size_t)s->n_bias + n));
    s->counts = penalized ? calloc((size_t)n, sizeof(int32_t)) : NULL;
    if (!s->scratch || !s->saved || (penalized && !s->counts)) {
        Sampler_free(s);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* unless ao is None, the allowed-token mask of a row of n logits into *allowed, its view into vs; -1: an error */
static int get_allowed(PyObject *ao, Py_ssize_t n, const uint32_t **allowed, bl_views *vs) {
    if (ao == Py_None) return 0;
    *allowed = get_buf(ao, &vs->v[vs->n], 0, (n + 31) / 32, 'I', "allowed");
    if (!*allowed) return -1;
    vs->n++;
    return 0;
}

/* parses (logits, [u,] history=None, start=0, end=0, allowed=None) into a context; views to release into vs */
static float *prepare(SamplerObject *s, PyObject *lo, PyObject *ho, Py_ssize_t start, Py_ssize_t end, PyObject *ao,
                      bl_sample_ctx *c, bl_views *vs) {
    if (!s->scratch) {
        PyErr_SetString(PyExc_RuntimeError, "Sampler is not initialized");
        return NULL;
    }
    float *x = get_buf(lo, &vs->v[vs->n], 1, s->n, 'f', "logits");
    if (!x) return NULL;
    vs->n++;
    *c = (bl_sample_ctx){.p = s->p, .counts = s->counts, .bias_ids = s->bias_ids, .bias = s->bias,
                         .n_bias = s->n_bias, .scratch = s->scratch, .saved = s->saved};
    if (ho != Py_None) {
        Py_ssize_t avail;
        if (PyObject_GetBuffer(ho, &vs->v[vs->n], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
        avail = vs->v[vs->n].len / 4;
        PyBuffer_Release(&vs->v[vs->n]);
        if (start < 0 || end < start || end > avail) {
            PyErr_Format(PyExc_ValueError, "history window %zd..%zd is outside 0..%zd", start, end, avail);
            return NULL;
        }
        const int32_t *h = get_buf(ho, &vs->v[vs->n], 0, end, 'i', "history");
        if (!h) return NULL;
        vs->n++;
        /* the penalties need each distinct token once in `saved`: at most n of them */
        c->recent = h + start;
        c->n_recent = (int)(end - start);
    }
    return get_allowed(ao, s->n, &c->allowed, vs) < 0 ? NULL : x;
}

static PyObject *Sampler_sample(SamplerObject *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"logits", "u", "history", "start", "end", "allowed", NULL};
    PyObject *lo, *ho = Py_None, *ao = Py_None;
    double u;
    Py_ssize_t start = 0, end = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Od|OnnO", names, &lo, &u, &ho, &start, &end, &ao)) return NULL;
    bl_views vs = {.n = 0};
    bl_sample_ctx c;
    float *x = prepare(s, lo, ho, start, end, ao, &c, &vs);
    int tok = x ? bl_sample(x, s->n, &c, u) : -2;
    bl_views_release(&vs);
    if (tok == -2) return NULL;
    return PyLong_FromLong(tok);
}

static PyObject *Sampler_candidates(SamplerObject *s, PyObject *args, PyObject *kw) {
    static char *names[] = {"logits", "history", "start", "end", "allowed", NULL};
    PyObject *lo, *ho = Py_None, *ao = Py_None;
    Py_ssize_t start = 0, end = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OnnO", names, &lo, &ho, &start, &end, &ao)) return NULL;
    bl_views vs = {.n = 0};
    bl_sample_ctx c;
    float *x = prepare(s, lo, ho, start, end, ao, &c, &vs);
    if (!x) {
        bl_views_release(&vs);
        return NULL;
    }
    int32_t *ids = malloc(sizeof(int32_t) * s->n);
    double *probs = malloc(sizeof(double) * s->n);
    PyObject *res = NULL;
    if (ids && probs) {
        int k = bl_sample_candidates(x, s->n, &c, ids, probs);
        PyObject *li = PyList_New(k), *lp = PyList_New(k);
        if (li && lp) {
            for (int i = 0; i < k; i++) {
                PyList_SET_ITEM(li, i, PyLong_FromLong(ids[i]));
                PyList_SET_ITEM(lp, i, PyFloat_FromDouble(probs[i]));
            }
            res = Py_BuildValue("(NN)", li, lp);
        } else {
            Py_XDECREF(li);
            Py_XDECREF(lp);
        }
    } else {
        PyErr_NoMemory();
    }
    free(ids);
    free(probs);
    bl_views_release(&vs);
    return res;
}

static PyMethodDef Sampler_methods[] = {
    {"sample", (PyCFunction)(void (*)(void))Sampler_sample, METH_VARARGS | METH_KEYWORDS,
     "sample(logits, u, history=None, start=0, end=0, allowed=None) -> token id (-1: no token allowed).\n"
     "history[start:end] is the penalty window; u a uniform draw in [0, 1) (unused when greedy)."},
    {"candidates", (PyCFunction)(void (*)(void))Sampler_candidates, METH_VARARGS | METH_KEYWORDS,
     "candidates(logits, history=None, start=0, end=0, allowed=None) -> (ids, probabilities), best first"},
    {NULL, NULL, 0, NULL},
};

static BL_TYPE(Sampler, NULL,
               "Sampler(n_vocab, temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty, "
               "frequency_penalty, bias_ids=None, bias_values=None): the sampling chain of sample.h");

/* ---- row kernels ---- */

static PyObject *py_logprobs(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lo;
    Py_ssize_t n;
    int token, k;
    if (!PyArg_ParseTuple(args, "Onii", &lo, &n, &token, &k)) return NULL;
    if (n < 1 || token < 0 || token >= n || k < 0 || k > n) {
        PyErr_SetString(PyExc_ValueError, "logprobs: 0 <= token < n, 0 <= k <= n");
        return NULL;
    }
    Py_buffer v;
    const float *x = get_buf(lo, &v, 0, n, 'f', "logits");
    if (!x) return NULL;
    bl_cand *top = k ? malloc(sizeof(bl_cand) * k) : NULL;
    double *lps = k ? malloc(sizeof(double) * k) : NULL;
    PyObject *res = NULL;
    if (k && (!top || !lps)) {
        PyErr_NoMemory();
    } else {
        int nt = 0;
        double lp = bl_logprobs(x, (int)n, token, k, top, lps, &nt);
        PyObject *lst = PyList_New(nt);
        if (lst) {
            for (int i = 0; i < nt; i++) PyList_SET_ITEM(lst, i, Py_BuildValue("(id)", top[i].id, lps[i]));
            res = Py_BuildValue("(dN)", lp, lst);
        }
    }
    free(top);
    free(lps);
    PyBuffer_Release(&v);
    return res;
}

/* a row kernel's logits (n values) and allowed-token mask (ao None: none); their views into vs. fn: the kernel's
 * name, for the error of an n out of range */
static const float *row_views(const char *fn, PyObject *lo, Py_ssize_t n, PyObject *ao, const uint32_t **allowed,
                              bl_views *vs) {
    if (n < 1 || n > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: n must be positive", fn);
        return NULL;
    }
    const float *x = get_buf(lo, &vs->v[vs->n], 0, n, 'f', "logits");
    if (!x) return NULL;
    vs->n++;
    return get_allowed(ao, n, allowed, vs) < 0 ? NULL : x;
}

static PyObject *py_argmax(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lo, *ao = Py_None;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "On|O", &lo, &n, &ao)) return NULL;
    bl_views vs = {.n = 0};
    const uint32_t *allowed = NULL;
    const float *x = row_views("argmax", lo, n, ao, &allowed, &vs);
    const int r = x ? bl_argmax(x, (int)n, allowed) : 0;
    bl_views_release(&vs);
    return x ? PyLong_FromLong(r) : NULL;
}

static PyObject *py_top(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lo, *ao = Py_None;
    Py_ssize_t n;
    int m;
    if (!PyArg_ParseTuple(args, "Oni|O", &lo, &n, &m, &ao)) return NULL;
    if (n < 1 || n > INT32_MAX || m < 1 || m > n) {
        PyErr_SetString(PyExc_ValueError, "top: 1 <= m <= n");
        return NULL;
    }
    bl_views vs = {.n = 0};
    const uint32_t *allowed = NULL;
    const float *x = row_views("top", lo, n, ao, &allowed, &vs);
    bl_cand *h = x ? malloc(sizeof(bl_cand) * m) : NULL;
    PyObject *res = NULL;
    if (x && !h) {
        PyErr_NoMemory();
    } else if (x) {
        int k = bl_top(x, (int)n, allowed, m, h);
        res = PyList_New(k);
        for (int i = 0; res && i < k; i++) PyList_SET_ITEM(res, i, PyLong_FromLong(h[i].id));
    }
    free(h);
    bl_views_release(&vs);
    return res;
}

static PyObject *py_sum_exp(PyObject *Py_UNUSED(self), PyObject *args) {
    PyObject *lo, *ao = Py_None;
    Py_ssize_t n;
    float ref, scale, floor_;
    if (!PyArg_ParseTuple(args, "Onfff|O", &lo, &n, &ref, &scale, &floor_, &ao)) return NULL;
    bl_views vs = {.n = 0};
    const uint32_t *allowed = NULL;
    const float *x = row_views("sum_exp", lo, n, ao, &allowed, &vs);
    const double s = x ? bl_sum_exp(x, (int)n, allowed, ref, scale, floor_) : 0.0;
    bl_views_release(&vs);
    return x ? PyFloat_FromDouble(s) : NULL;
}

PyMethodDef bl_sample_methods[] = {
    BL_METHOD(logprobs,
        "logprobs(logits, n, token, k) -> (logprob of token, [(id, logprob)] of the k best, best first)"),
    BL_METHOD(argmax, "argmax(logits, n, allowed=None): first index of the largest allowed value"),
    BL_METHOD(top, "top(logits, n, m, allowed=None): ids of the m largest, best first, ties by id"),
    BL_METHOD(sum_exp,
        "sum_exp(logits, n, ref, scale, lo, allowed=None): sum of exp((x - ref) * scale) over allowed x >= lo"),
    {NULL, NULL, 0, NULL},
};

int bl_sample_module_init(PyObject *m) { return PyModule_AddType(m, &SamplerType); }
