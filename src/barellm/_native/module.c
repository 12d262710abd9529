/* The Python module barellm._native: collects the method tables of the binding files. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "barellm.h"
#include "py_common.h"

static PyObject *py_cpu_info(PyObject *self, PyObject *args) {
    (void)self; (void)args;
    return Py_BuildValue("{s:O,s:s}", "avx2_fma", bl_cpu_has_avx2_fma() ? Py_True : Py_False,
                         "isa", bl_isa_name(bl_isa()));
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (strcmp(name, "scalar") == 0) bl_set_isa(BL_ISA_SCALAR);
    else if (strcmp(name, "avx2") == 0) bl_set_isa(BL_ISA_AVX2);
    else { PyErr_Format(PyExc_ValueError, "unknown ISA %R (expected 'scalar' or 'avx2')", PyTuple_GET_ITEM(args, 0)); return NULL; }
    return PyUnicode_FromString(bl_isa_name(bl_isa()));
}

static PyMethodDef core_methods[] = {
    {"cpu_info", py_cpu_info, METH_NOARGS, "CPU features found and the kernel path in use."},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa('scalar'|'avx2'): choose the kernel path; returns the one in use."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "_native", "barellm's native core", -1, NULL,
                                       NULL, NULL, NULL, NULL};

static int add_methods(PyObject *m, PyMethodDef *defs) {
    for (PyMethodDef *d = defs; d->ml_name; d++) {
        PyObject *f = PyCFunction_NewEx(d, NULL, PyModule_GetNameObject(m));
        if (!f || PyModule_AddObject(m, d->ml_name, f) < 0) { Py_XDECREF(f); return -1; }
    }
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    bl_isa(); /* picks the kernel path and resolves its kernels from the traits table, before any thread runs */
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (add_methods(m, core_methods) < 0 || add_methods(m, bl_kernel_methods) < 0 ||
        add_methods(m, bl_engine_methods) < 0 || bl_engine_module_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
