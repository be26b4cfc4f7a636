/* Writes copied straight into DRAM. pyfuse3's write_buf handler copies a write's data into a
   bytes object, which kvfs then copies again into the file's DRAM file. This wrapper asks
   Python where the bytes go (kvfs.fs.Operations.write_plan) and, for the common write (fresh
   chunks, room in DRAM), has libfuse copy them from the request into the DRAM file, then
   tells Python (write_done). Every other write goes to pyfuse3's handler unchanged.
   The plan is (token, fd, ((pos, len), ...)); None means "pyfuse3's handler", an int is an
   errno to answer. */
#include "kvfs_shim.h"

#include <errno.h>

typedef void (*write_buf_t)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t,
                            struct fuse_file_info *);

static PyObject *plan_fn = NULL;
static PyObject *done_fn = NULL;
static write_buf_t pyfuse3_write_buf = NULL;

static int copy_pieces(struct fuse_bufvec *src, int fd, PyObject *pieces) {
    Py_ssize_t n = PyTuple_Size(pieces);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyTuple_GET_ITEM(pieces, i);
        long long pos = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 0));
        long long len = PyLong_AsLongLong(PyTuple_GET_ITEM(p, 1));
        if (PyErr_Occurred()) { PyErr_Clear(); return EIO; }
        struct fuse_bufvec dst = FUSE_BUFVEC_INIT((size_t)len);
        dst.buf[0].flags = FUSE_BUF_IS_FD | FUSE_BUF_FD_SEEK;
        dst.buf[0].fd = fd;
        dst.buf[0].pos = pos;
        /* Reads on from where the previous piece stopped (fuse_buf_copy advances src);
           releases the GIL for large pieces (interpose.c's fuse_buf_copy). */
        ssize_t done = fuse_buf_copy(&dst, src, 0);
        if (done < 0) return (int)-done;
        if (done != len) return EIO;
    }
    return 0;
}

static void kvfs_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv,
                           off_t off, struct fuse_file_info *fi) {
    if (plan_fn == NULL) {
        pyfuse3_write_buf(req, ino, bufv, off, fi);
        return;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *plan = PyObject_CallFunction(plan_fn, "KLn",
        (unsigned long long)fi->fh, (long long)off, (Py_ssize_t)fuse_buf_size(bufv));
    if (plan == NULL) {
        PyErr_WriteUnraisable(plan_fn);
        PyGILState_Release(gil);
        fuse_reply_err(req, EIO);
        return;
    }
    if (plan == Py_None) {
        Py_DECREF(plan);
        pyfuse3_write_buf(req, ino, bufv, off, fi);
        PyGILState_Release(gil);
        return;
    }
    int err = 0;
    if (PyLong_Check(plan)) {
        err = (int)PyLong_AsLong(plan);
        Py_DECREF(plan);
        PyGILState_Release(gil);
        fuse_reply_err(req, err > 0 ? err : EIO);
        return;
    }
    if (!PyTuple_Check(plan) || PyTuple_Size(plan) != 3 ||
            !PyTuple_Check(PyTuple_GET_ITEM(plan, 2))) {
        Py_DECREF(plan);
        PyGILState_Release(gil);
        fuse_reply_err(req, EIO);
        return;
    }
    int fd = (int)PyLong_AsLong(PyTuple_GET_ITEM(plan, 1));
    err = PyErr_Occurred() ? (PyErr_Clear(), EIO)
                           : copy_pieces(bufv, fd, PyTuple_GET_ITEM(plan, 2));
    PyObject *r = PyObject_CallFunction(done_fn, "Oi", PyTuple_GET_ITEM(plan, 0), err);
    Py_DECREF(plan);
    if (r == NULL) {
        PyErr_WriteUnraisable(done_fn);
        err = EIO;
    } else {
        long v = PyLong_AsLong(r);
        err = (v == -1 && PyErr_Occurred()) ? (PyErr_Clear(), EIO) : (int)v;
        Py_DECREF(r);
    }
    PyGILState_Release(gil);
    if (err)
        fuse_reply_err(req, err);
    else
        fuse_reply_write(req, fuse_buf_size(bufv));
}

void kvfs_write_install(struct fuse_lowlevel_ops *ops) {
    if (ops->write_buf == NULL)
        return;
    pyfuse3_write_buf = ops->write_buf;
    ops->write_buf = kvfs_write_buf;
}

void kvfs_set_write_handlers(PyObject *plan, PyObject *done) {
    kvfs_set_callback(&plan_fn, plan);
    kvfs_set_callback(&done_fn, done);
}
