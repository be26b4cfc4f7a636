/* Calls into Python from C: from the FUSE thread, or from threads Python does not know. */
#include "kvfs_shim.h"

#include <stdarg.h>

/* fn(*Py_BuildValue(fmt, ...)) with the GIL; a failure is reported, never raised. */
void kvfs_call(PyObject *fn, const char *fmt, ...) {
    if (fn == NULL)
        return;
    PyGILState_STATE gil = PyGILState_Ensure();
    va_list va;
    va_start(va, fmt);
    PyObject *args = Py_VaBuildValue(fmt, va);
    va_end(va);
    PyObject *r = args != NULL ? PyObject_CallObject(fn, args) : NULL;
    Py_XDECREF(args);
    if (r == NULL)
        PyErr_WriteUnraisable(fn);
    else
        Py_DECREF(r);
    PyGILState_Release(gil);
}

/* *slot* holds *fn* (a reference to it) from now on, instead of what it held. */
void kvfs_set_callback(PyObject **slot, PyObject *fn) {
    Py_XINCREF(fn);
    Py_XDECREF(*slot);
    *slot = fn;
}
