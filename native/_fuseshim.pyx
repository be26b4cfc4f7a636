# cython: language_level=3
"""fallocate(2) for pyfuse3 filesystems.

pyfuse3 3.5 registers no `fallocate` handler, so the kernel answers EOPNOTSUPP to every
fallocate() on the mount. This module defines its own `fuse_session_new`; loaded with
RTLD_GLOBAL before pyfuse3 (see kvfs/daemon.py), it is found first when pyfuse3 creates its
session, copies pyfuse3's operation table, adds a `fallocate` handler that calls a Python
function synchronously on the FUSE thread, and hands the table to libfuse's own
`fuse_session_new`. If the interposition does not happen, `active()` stays False and kvfs
behaves as before (fallocate answers EOPNOTSUPP; engines fall back to ftruncate).
"""

cdef extern from *:
    """
    #define _GNU_SOURCE
    #define FUSE_USE_VERSION 35
    #include <dlfcn.h>
    #include <errno.h>
    #include <string.h>
    #include <fuse_lowlevel.h>

    static PyObject *kvfs_fallocate_handler = NULL;
    static struct fuse_lowlevel_ops kvfs_ops;
    static int kvfs_shim_active = 0;

    static void kvfs_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset,
                               off_t length, struct fuse_file_info *fi) {
        int err = EOPNOTSUPP;
        PyGILState_STATE gil = PyGILState_Ensure();
        if (kvfs_fallocate_handler != NULL) {
            PyObject *r = PyObject_CallFunction(kvfs_fallocate_handler, "KiLLK",
                (unsigned long long)ino, mode, (long long)offset, (long long)length,
                (unsigned long long)(fi ? fi->fh : 0));
            if (r == NULL) {
                PyErr_WriteUnraisable(kvfs_fallocate_handler);
                err = EIO;
            } else {
                long v = PyLong_AsLong(r);
                if (v == -1 && PyErr_Occurred()) { PyErr_Clear(); err = EIO; }
                else err = (int)v;
                Py_DECREF(r);
            }
        }
        PyGILState_Release(gil);
        fuse_reply_err(req, err);
    }

    typedef struct fuse_session *(*kvfs_session_new_t)(
        struct fuse_args *, const struct fuse_lowlevel_ops *, size_t, void *);

    struct fuse_session *fuse_session_new(struct fuse_args *args,
                                          const struct fuse_lowlevel_ops *op,
                                          size_t op_size, void *userdata) {
        kvfs_session_new_t real = (kvfs_session_new_t)dlvsym(RTLD_NEXT, "fuse_session_new",
                                                             "FUSE_3.0");
        if (real == NULL)
            real = (kvfs_session_new_t)dlsym(RTLD_NEXT, "fuse_session_new");
        if (real == NULL)
            return NULL;
        if (op_size > sizeof kvfs_ops)
            return real(args, op, op_size, userdata);
        memset(&kvfs_ops, 0, sizeof kvfs_ops);
        memcpy(&kvfs_ops, op, op_size);
        if (kvfs_ops.fallocate == NULL) {
            kvfs_ops.fallocate = kvfs_fallocate;
            kvfs_shim_active = 1;
        }
        return real(args, &kvfs_ops, sizeof kvfs_ops, userdata);
    }

    static void kvfs_set_handler(PyObject *fn) {
        Py_XINCREF(fn);
        Py_XDECREF(kvfs_fallocate_handler);
        kvfs_fallocate_handler = fn;
    }
    """
    int kvfs_shim_active
    void kvfs_set_handler(object fn)


def set_fallocate_handler(handler) -> None:
    """handler(ino, mode, offset, length, fh) -> errno (0 for success); runs on the FUSE
    thread with the GIL held and must not block."""
    kvfs_set_handler(handler)


def active() -> bool:
    """True once pyfuse3's session was created through this module's fuse_session_new."""
    return kvfs_shim_active != 0
