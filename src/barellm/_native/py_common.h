/* Shared by the binding files: each defines one method table that module.c adds to the module. */
#ifndef BARELLM_PY_COMMON_H
#define BARELLM_PY_COMMON_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* a method table's entry for the binding py_NAME of positional arguments, named once */
#define BL_METHOD(name, doc) {#name, py_##name, METH_VARARGS, doc}

extern PyMethodDef bl_kernel_methods[]; /* py_kernels.c: single kernels, for tests and the debug path */
extern PyMethodDef bl_engine_methods[]; /* py_engine.c: thread pool and executor */
int bl_engine_module_init(PyObject *m); /* py_engine.c: registers its types; 0 on success */
extern PyMethodDef bl_sample_methods[]; /* py_sample.c: sampling-chain row kernels */
int bl_sample_module_init(PyObject *m); /* py_sample.c: registers the Sampler type; 0 on success */

#endif
