/* fallocate(2) on the mount: pyfuse3 3.5 registers no fallocate handler, so the kernel would
   answer EOPNOTSUPP to every one. This adds one to pyfuse3's operation table, which calls a
   Python function synchronously on the FUSE thread (kvfs.fs.Operations.fallocate_sync). */
#include "kvfs_shim.h"

#include <errno.h>

static PyObject *handler = NULL;

/* The handler answers an errno (0: done), or -1: it replies later itself, through
   kvfs_fallocate_reply (a punched hole waits for NVMe reads in a trio task). */
static void kvfs_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset,
                           off_t length, struct fuse_file_info *fi) {
    int err = EOPNOTSUPP;
    PyGILState_STATE gil = PyGILState_Ensure();
    if (handler != NULL) {
        PyObject *r = PyObject_CallFunction(handler, "KiLLKK",
            (unsigned long long)ino, mode, (long long)offset, (long long)length,
            (unsigned long long)(fi ? fi->fh : 0), (unsigned long long)(uintptr_t)req);
        if (r == NULL) {
            PyErr_WriteUnraisable(handler);
            err = EIO;
        } else {
            long v = PyLong_AsLong(r);
            if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); err = EIO; }
            else err = (int)v;
            Py_DECREF(r);
        }
    }
    PyGILState_Release(gil);
    if (err >= 0)
        fuse_reply_err(req, err);
}

int kvfs_fallocate_install(struct fuse_lowlevel_ops *ops) {
    if (ops->fallocate != NULL)
        return 0;
    ops->fallocate = kvfs_fallocate;
    return 1;
}

void kvfs_fallocate_reply(unsigned long long req, int err) {
    fuse_reply_err((fuse_req_t)(uintptr_t)req, err);
}

void kvfs_set_fallocate_handler(PyObject *fn) {
    kvfs_set_callback(&handler, fn);
}
