# cython: language_level=3
"""What pyfuse3 lacks, added underneath it: fallocate(2), and big copies without the GIL.

Loaded with RTLD_GLOBAL before pyfuse3 (see kvfs/daemon.py), this module's definitions of
libfuse functions are found before libfuse's own when pyfuse3 calls them:

- `fuse_session_new`: pyfuse3 3.5 registers no `fallocate` handler, so the kernel would
  answer EOPNOTSUPP to every fallocate() on the mount. This copy of the call adds one to
  pyfuse3's operation table (it calls a Python function synchronously on the FUSE thread)
  and hands the table to libfuse's own `fuse_session_new`.
- pyfuse3's `write_buf` handler is wrapped: a write whose chunks all get fresh content (an
  engine writing a block) is copied by libfuse straight from the request (spliced, when the
  request came through a pipe) into the DRAM arena file, instead of into a bytes object
  that kvfs then copies again (kvfs.fs.Operations.write_plan / write_done). Every other
  write goes to pyfuse3's handler unchanged.
- `fuse_reply_buf` and `fuse_buf_copy`: pyfuse3 replies to a read (copying up to 1 MiB into
  the kernel) and copies a write's data out of libfuse's buffer while holding the GIL, so
  the worker threads that decode and compress chunks stall behind every large request.
  These wrappers release the GIL around large copies. That is safe: the memory being copied
  is pinned by the caller (a buffer export or a fresh bytes object nobody else can see), no
  Python object is touched, and the trio thread that could change a DRAM slot is the one
  blocked in the copy.

If the interposition does not happen, `active()` stays False and kvfs behaves as before
(fallocate answers EOPNOTSUPP; engines fall back to ftruncate; copies keep the GIL).
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

    /* Writes into DRAM: see Operations.write_plan. The plan is (token, fd, ((pos, len), ...));
       None means "pyfuse3's handler", an int is an errno to answer. */
    static PyObject *kvfs_write_plan_fn = NULL;
    static PyObject *kvfs_write_done_fn = NULL;
    static void (*kvfs_pyfuse3_write_buf)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t,
                                          struct fuse_file_info *) = NULL;

    static int kvfs_copy_pieces(struct fuse_bufvec *src, int fd, PyObject *pieces) {
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
               releases the GIL for large pieces (fuse_buf_copy below). */
            ssize_t done = fuse_buf_copy(&dst, src, 0);
            if (done < 0) return (int)-done;
            if (done != len) return EIO;
        }
        return 0;
    }

    static void kvfs_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv,
                               off_t off, struct fuse_file_info *fi) {
        if (kvfs_write_plan_fn == NULL) {
            kvfs_pyfuse3_write_buf(req, ino, bufv, off, fi);
            return;
        }
        PyGILState_STATE gil = PyGILState_Ensure();
        PyObject *plan = PyObject_CallFunction(kvfs_write_plan_fn, "KLn",
            (unsigned long long)fi->fh, (long long)off, (Py_ssize_t)fuse_buf_size(bufv));
        if (plan == NULL) {
            PyErr_WriteUnraisable(kvfs_write_plan_fn);
            PyGILState_Release(gil);
            fuse_reply_err(req, EIO);
            return;
        }
        if (plan == Py_None) {
            Py_DECREF(plan);
            kvfs_pyfuse3_write_buf(req, ino, bufv, off, fi);
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
                               : kvfs_copy_pieces(bufv, fd, PyTuple_GET_ITEM(plan, 2));
        PyObject *r = PyObject_CallFunction(kvfs_write_done_fn, "Oi",
                                            PyTuple_GET_ITEM(plan, 0), err);
        Py_DECREF(plan);
        if (r == NULL) {
            PyErr_WriteUnraisable(kvfs_write_done_fn);
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
        if (kvfs_ops.write_buf != NULL) {
            kvfs_pyfuse3_write_buf = kvfs_ops.write_buf;
            kvfs_ops.write_buf = kvfs_write_buf;
        }
        return real(args, &kvfs_ops, sizeof kvfs_ops, userdata);
    }

    /* Copies below this size are cheaper than giving the GIL away and taking it back. */
    #define KVFS_NOGIL_COPY (64 * 1024)

    typedef int (*kvfs_reply_buf_t)(fuse_req_t, const char *, size_t);
    typedef ssize_t (*kvfs_buf_copy_t)(struct fuse_bufvec *, struct fuse_bufvec *,
                                       enum fuse_buf_copy_flags);

    static void *kvfs_next(const char *name) {
        void *fn = dlvsym(RTLD_NEXT, name, "FUSE_3.0");
        return fn != NULL ? fn : dlsym(RTLD_NEXT, name);
    }

    int fuse_reply_buf(fuse_req_t req, const char *buf, size_t size) {
        static kvfs_reply_buf_t real = NULL;
        if (real == NULL)
            real = (kvfs_reply_buf_t)kvfs_next("fuse_reply_buf");
        if (size < KVFS_NOGIL_COPY || !Py_IsInitialized() || !PyGILState_Check())
            return real(req, buf, size);
        PyThreadState *ts = PyEval_SaveThread();
        int r = real(req, buf, size);
        PyEval_RestoreThread(ts);
        return r;
    }

    ssize_t fuse_buf_copy(struct fuse_bufvec *dst, struct fuse_bufvec *src,
                          enum fuse_buf_copy_flags flags) {
        static kvfs_buf_copy_t real = NULL;
        if (real == NULL)
            real = (kvfs_buf_copy_t)kvfs_next("fuse_buf_copy");
        if (fuse_buf_size(src) < KVFS_NOGIL_COPY || !Py_IsInitialized() || !PyGILState_Check())
            return real(dst, src, flags);
        PyThreadState *ts = PyEval_SaveThread();
        ssize_t r = real(dst, src, flags);
        PyEval_RestoreThread(ts);
        return r;
    }

    static void kvfs_set_write_handlers(PyObject *plan, PyObject *done) {
        Py_XINCREF(plan);
        Py_XINCREF(done);
        Py_XDECREF(kvfs_write_plan_fn);
        Py_XDECREF(kvfs_write_done_fn);
        kvfs_write_plan_fn = plan;
        kvfs_write_done_fn = done;
    }

    static void kvfs_set_handler(PyObject *fn) {
        Py_XINCREF(fn);
        Py_XDECREF(kvfs_fallocate_handler);
        kvfs_fallocate_handler = fn;
    }
    """
    int kvfs_shim_active
    void kvfs_set_handler(object fn)
    void kvfs_set_write_handlers(object plan, object done)


def set_fallocate_handler(handler) -> None:
    """handler(ino, mode, offset, length, fh) -> errno (0 for success); runs on the FUSE
    thread with the GIL held and must not block."""
    kvfs_set_handler(handler)


def set_write_handlers(plan, done) -> None:
    """plan(fh, off, size) -> None | errno | (token, fd, ((pos, len), ...)) and
    done(token, errno) -> errno: see kvfs.fs.Operations.write_plan. Both run on the FUSE
    thread with the GIL held; nothing else runs on it between them."""
    kvfs_set_write_handlers(plan, done)


def active() -> bool:
    """True once pyfuse3's session was created through this module's fuse_session_new."""
    return kvfs_shim_active != 0
