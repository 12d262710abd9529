/* Python bindings of the thread pool and the executor. */
#include "py_common.h"

PyMethodDef bl_engine_methods[] = {
    {NULL, NULL, 0, NULL},
};

int bl_engine_module_init(PyObject *m) {
    (void)m;
    return 0;
}
