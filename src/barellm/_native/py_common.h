/* Shared by the binding files: each defines what module.c adds to the module (a method table, an init that
 * registers its types and constants, or both), and the helpers they have in common. */
#ifndef BARELLM_PY_COMMON_H
#define BARELLM_PY_COMMON_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "threadpool.h"

/* a method table's entry for the binding py_NAME of positional arguments, named once */
#define BL_METHOD(name, doc) {#name, py_##name, METH_VARARGS, doc}

/* the type barellm._native.Name, of NameObject instances made by Name_init and freed by Name_dealloc, with the
 * methods Name_methods and the attributes `getset` (NULL: none) */
#define BL_TYPE(Name, getset, doc)                                                                       \
    PyTypeObject Name##Type = {                                                                          \
        PyVarObject_HEAD_INIT(NULL, 0)                                                                   \
        .tp_name = "barellm._native." #Name,                                                             \
        .tp_basicsize = sizeof(Name##Object),                                                            \
        .tp_flags = Py_TPFLAGS_DEFAULT,                                                                  \
        .tp_doc = doc,                                                                                   \
        .tp_new = PyType_GenericNew,                                                                     \
        .tp_init = (initproc)Name##_init,                                                                \
        .tp_dealloc = (destructor)Name##_dealloc,                                                        \
        .tp_methods = Name##_methods,                                                                    \
        .tp_getset = getset,                                                                             \
    }

/* py_kernels.c: single kernels, for tests and the debug path */
extern PyMethodDef bl_kernel_methods[];
/* py_ops.c: the ops.h kernels one call at a time; its init adds the KV cache constants */
extern PyMethodDef bl_op_methods[];
int bl_op_module_init(PyObject *m);
/* py_pool.c: the thread pool (the Pool type, its counters) */
extern PyMethodDef bl_pool_methods[];
int bl_pool_module_init(PyObject *m);
/* py_plan.c: the executor (the Plan type, OP_KINDS) */
int bl_plan_module_init(PyObject *m);
/* py_sample.c: the sampling chain (the Sampler type, its row kernels) */
extern PyMethodDef bl_sample_methods[];
int bl_sample_module_init(PyObject *m);

/* A Pool: a Plan runs on one and marks it busy while it does, so two runs never share its threads. */
typedef struct {
    PyObject_HEAD
    bl_pool *pool;
    int busy;
} PoolObject;
extern PyTypeObject PoolType;

/* A contiguous buffer of obj (any buffer exporter), or of obj[0] at byte offset obj[1] when obj is a
 * (buffer, offset) tuple. The view is kept in *view until released. */
static inline char *bl_get_view(PyObject *obj, int writable, Py_buffer *view, Py_ssize_t *avail) {
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

/* The views one call of a kernel binding holds while the kernel runs: v[0 .. n - 1], released together. */
typedef struct {
    Py_buffer v[6];
    int n;
} bl_views;

static inline void bl_views_release(bl_views *vs) {
    for (int i = 0; i < vs->n; i++) PyBuffer_Release(&vs->v[i]);
    vs->n = 0;
}

#endif
