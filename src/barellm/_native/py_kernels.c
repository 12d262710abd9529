/* Python bindings of single kernels (tests, benchmarks, the op-by-op debug path). */
#include "py_common.h"

PyMethodDef bl_kernel_methods[] = {
    {NULL, NULL, 0, NULL},
};
