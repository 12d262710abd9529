/* Python binding of the thread pool (threadpool.h): the Pool type, its bandwidth read pass, and the pool's and
 * the allocator's counters. */
#include "py_common.h"

#include <time.h>

#include "tier.h"

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

BL_TYPE(Pool, Pool_getset, "Pool(threads, pin=False): persistent worker threads (the caller is thread 0).");

static PyObject *py_pool_stats(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    long long b, i;
    bl_pool_stats(&b, &i);
    return Py_BuildValue("{s:L,s:L}", "barrier_sleeps", b, "idle_sleeps", i);
}

static PyObject *py_alloc_count(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    return PyLong_FromLongLong(bl_alloc_count());
}

PyMethodDef bl_pool_methods[] = {
    {"pool_stats", py_pool_stats, METH_NOARGS, "{'barrier_sleeps': n, 'idle_sleeps': n} so far"},
    {"alloc_count", py_alloc_count, METH_NOARGS, "native heap allocations so far"},
    {NULL, NULL, 0, NULL},
};

int bl_pool_module_init(PyObject *m) { return PyModule_AddType(m, &PoolType); }
