/* The Python module barellm._native: collects the method tables of the binding files. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "tier.h"
#include "amx/amx.h"
#include "py_common.h"

/* The name of the amx kernels on the tile emulation, as set_isa takes it and cpu_info gives it (tests only) */
#define AMX_EMULATED "amx-emulated"

static PyObject *py_cpu_info(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    PyObject *tiers = PyList_New(0);
    if (!tiers) return NULL;
    for (int i = 0; i < BL_ISA_COUNT; i++) {
        if (!(bl_cpu_tiers() >> i & 1)) continue;
        PyObject *n = PyUnicode_FromString(bl_isa_name((enum bl_isa)i));
        if (!n || PyList_Append(tiers, n) < 0) { Py_XDECREF(n); Py_DECREF(tiers); return NULL; }
        Py_DECREF(n);
    }
    const char *isa = bl_isa_name(bl_isa());
    return Py_BuildValue("{s:N,s:s,s:s,s:[s]}", "tiers", tiers, "isa", bl_amx_emulated() ? AMX_EMULATED : isa,
                         "prefetch", bl_prefetch_describe(), "emulated", AMX_EMULATED);
}

/* tier_names(): every kernel tier the core knows, lowest first (cpu.c's list, the one every other names) */
static PyObject *py_tier_names(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    PyObject *names = PyTuple_New(BL_ISA_COUNT);
    if (!names) return NULL;
    for (int i = 0; i < BL_ISA_COUNT; i++) {
        PyObject *n = PyUnicode_FromString(bl_isa_name((enum bl_isa)i));
        if (!n) { Py_DECREF(names); return NULL; }
        PyTuple_SET_ITEM(names, i, n);
    }
    return names;
}

static PyObject *py_set_isa(PyObject *Py_UNUSED(self), PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (strcmp(name, AMX_EMULATED) == 0 && bl_set_amx_emulated()) return PyUnicode_FromString(AMX_EMULATED);
    const int isa = bl_isa_from_name(name);
    if (isa < 0) {
        char expected[64] = "";
        for (int i = 0; i < BL_ISA_COUNT; i++) {
            strncat(expected, i ? ", " : "", sizeof expected - strlen(expected) - 1);
            strncat(expected, bl_isa_name((enum bl_isa)i), sizeof expected - strlen(expected) - 1);
        }
        PyErr_Format(PyExc_ValueError, "unknown ISA tier %R (expected one of %s)", PyTuple_GET_ITEM(args, 0),
                     expected);
        return NULL;
    }
    return PyUnicode_FromString(bl_isa_name(bl_set_isa((enum bl_isa)isa)));
}

/* amx_min_tokens(n=0): the fewest tokens a call takes the amx kernels' tiles for (n > 0 sets it); the value
 * before */
static PyObject *py_amx_min_tokens(PyObject *Py_UNUSED(self), PyObject *args) {
    int n = 0;
    if (!PyArg_ParseTuple(args, "|i", &n)) return NULL;
    bl_isa(); /* BARELLM_AMX_MIN_TOKENS is read when the tier is first chosen */
    const int before = bl_amx_min_tokens;
    if (n > 0) bl_amx_min_tokens = n;
    return PyLong_FromLong(before);
}

/* {entry: tier} for every entry of the resolved table: which tier's kernel each op and matmul runs */
static PyObject *py_kernel_sources(PyObject *Py_UNUSED(self), PyObject *Py_UNUSED(args)) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define PUT(key, tier)                                                                                   \
    do {                                                                                                 \
        PyObject *v = PyUnicode_FromString(bl_isa_name((enum bl_isa)(tier)));                            \
        if (!v || PyDict_SetItemString(d, key, v) < 0) { Py_XDECREF(v); Py_DECREF(d); return NULL; }      \
        Py_DECREF(v);                                                                                    \
    } while (0)
    static const char *const acts[BL_ACT_COUNT] = {"act q8", "act q8x2"};
    static const char *const layouts[BL_LAYOUT_COUNT] = {"rows", "interleave8"};
    for (int a = 0; a < BL_ACT_COUNT; a++) PUT(acts[a], bl_kernel_source.act[a]);
    for (int t = 0; t < BL_TYPE_COUNT; t++)
        for (int l = 0; l < BL_LAYOUT_COUNT; l++) {
            const bl_type_traits *tr = bl_traits(t);
            if (!tr || !bl_kernels.matmul[t][l]) continue;
            char key[64];
            snprintf(key, sizeof key, "matmul %s %s", tr->name, layouts[l]);
            PUT(key, bl_kernel_source.matmul[t][l]);
        }
#define OP(name, ret, params) PUT(#name, bl_kernel_source.name);
    BL_TIER_OPS(OP)
#undef OP
#undef PUT
    return d;
}

static PyMethodDef core_methods[] = {
    {"cpu_info", py_cpu_info, METH_NOARGS, "{'tiers': the ISA tiers this CPU can run, 'isa': the tier in use, 'prefetch': the decode tiles' prefetch rules}."},
    {"amx_min_tokens", py_amx_min_tokens, METH_VARARGS,
     "amx_min_tokens(n=0): the fewest tokens a matmul call runs on the amx kernels' tiles (fewer: the tier "
     "below's kernel); n > 0 sets it. Returns the value before."},
    {"tier_names", py_tier_names, METH_NOARGS, "tier_names(): every kernel tier, lowest first."},
    {"set_isa", py_set_isa, METH_VARARGS,
     "set_isa(tier): cap the kernel tier (one of tier_names()); returns the tier in use (the best the CPU "
     "offers at or under the cap). 'amx-emulated' (tests only): the amx kernels on the tile emulation over the "
     "best tier below amx."},
    {"kernel_sources", py_kernel_sources, METH_NOARGS, "{entry: tier}: the tier whose kernel each op runs."},
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

/* each binding file's functions and the init that adds its types and constants (NULL: none) */
static const struct {
    PyMethodDef *methods;
    int (*init)(PyObject *m);
} parts[] = {
    {core_methods, NULL},
    {bl_kernel_methods, NULL},
    {bl_op_methods, bl_op_module_init},
    {bl_pool_methods, bl_pool_module_init},
    {NULL, bl_plan_module_init},
    {bl_sample_methods, bl_sample_module_init},
};

PyMODINIT_FUNC PyInit__native(void) {
    bl_isa(); /* picks the tier and lays its kernel table together, before any thread runs */
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++)
        if ((parts[i].methods && add_methods(m, parts[i].methods) < 0) || (parts[i].init && parts[i].init(m) < 0)) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
