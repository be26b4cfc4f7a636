# cython: language_level=3
"""What pyfuse3 lacks, added underneath it: fallocate(2), FUSE passthrough, and big copies
without the GIL.

Loaded with RTLD_GLOBAL before pyfuse3 (see kvfs/daemon.py), this module's definitions of
libfuse functions are found before libfuse's own when pyfuse3 calls them:

- `fuse_session_new`: pyfuse3 3.5 registers no `fallocate` handler, so the kernel would
  answer EOPNOTSUPP to every fallocate() on the mount. This copy of the call adds one to
  pyfuse3's operation table (it calls a Python function synchronously on the FUSE thread)
  and hands the table to libfuse's own `fuse_session_new`.
- pyfuse3's `write_buf` handler is wrapped: a write whose chunks all get fresh content (an
  engine writing a block) is copied by libfuse straight from the request into the DRAM
  arena file, instead of into a bytes object that kvfs then copies again
  (kvfs.fs.Operations.write_plan / write_done). Every other write goes to pyfuse3's handler
  unchanged.
- `fuse_session_process_buf`: the flags by which the kernel asks the server to clear
  set-user-ID and set-group-ID (which neither libfuse nor pyfuse3 pass on) are read from
  each request before it is dispatched; requests are never spliced, so that each is in
  memory to be read.
- pyfuse3's `read` handler and the write path check O_DIRECT alignment against the flags
  each READ and WRITE carries (the descriptor's flags now, so O_DIRECT set later with
  fcntl(F_SETFL) counts too) and answer EINVAL to unaligned offsets and lengths, as ext4
  does.
- `fuse_reply_buf` and `fuse_buf_copy`: pyfuse3 replies to a read (copying up to 1 MiB into
  the kernel) and copies a write's data out of libfuse's buffer while holding the GIL, so
  the worker threads that decode and compress chunks stall behind every large request.
  These wrappers release the GIL around large copies. That is safe: the memory being copied
  is pinned by the caller (a buffer export or a fresh bytes object nobody else can see), no
  Python object is touched, and the trio thread that could change a DRAM slot is the one
  blocked in the copy.

- `fuse_session_mount`, `fuse_reply_open` and `fuse_reply_create`: FUSE passthrough (Linux
  6.9+; libfuse 3.14 does not know it), see "FUSE passthrough" below.

If the interposition does not happen, `active()` stays False and kvfs behaves as before
(fallocate answers EOPNOTSUPP; engines fall back to ftruncate; copies keep the GIL; every
read comes to the daemon).
"""

cdef extern from *:
    """
    #define _GNU_SOURCE
    #define FUSE_USE_VERSION 35
    #include <dlfcn.h>
    #include <errno.h>
    #include <fcntl.h>
    #include <stdint.h>
    #include <string.h>
    #include <fuse_lowlevel.h>

    static PyObject *kvfs_fallocate_handler = NULL;
    static struct fuse_lowlevel_ops kvfs_ops;
    static int kvfs_shim_active = 0;

    /* The handler answers an errno (0: done), or -1: it replies later itself, through
       kvfs_fallocate_reply (a punched hole waits for NVMe reads in a trio task). */
    static void kvfs_fallocate(fuse_req_t req, fuse_ino_t ino, int mode, off_t offset,
                               off_t length, struct fuse_file_info *fi) {
        int err = EOPNOTSUPP;
        PyGILState_STATE gil = PyGILState_Ensure();
        if (kvfs_fallocate_handler != NULL) {
            PyObject *r = PyObject_CallFunction(kvfs_fallocate_handler, "KiLLKK",
                (unsigned long long)ino, mode, (long long)offset, (long long)length,
                (unsigned long long)(fi ? fi->fh : 0), (unsigned long long)(uintptr_t)req);
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
        if (err >= 0)
            fuse_reply_err(req, err);
    }

    static void kvfs_fallocate_reply(unsigned long long req, int err) {
        fuse_reply_err((fuse_req_t)(uintptr_t)req, err);
    }

    /* Writes into DRAM: see Operations.write_plan. The plan is (token, fd, ((pos, len), ...));
       None means "pyfuse3's handler", an int is an errno to answer. */
    /* getxattr("security.capability"), which the kernel asks before a passthrough write
       to an inode (to drop file capabilities; once per inode, see FUSE_HANDLE_KILLPRIV_V2
       below), answered ENODATA here while no file has any security.* xattr (kvfs_no_caps,
       kept by the namespace): one Python request less per file written. */
    static int kvfs_no_caps = 0;
    static void (*kvfs_pyfuse3_getxattr)(fuse_req_t, fuse_ino_t, const char *, size_t) = NULL;

    /* Every request is read into memory, none left in a pipe by splice (which libfuse does
       for big WRITEs when the filesystem has write_buf): the set-id kill flags of a WRITE
       are in its header, which fuse_session_process_buf below must see. The front thread
       reads requests into memory anyway. */
    static void (*kvfs_pyfuse3_init)(void *, struct fuse_conn_info *) = NULL;

    static void kvfs_init(void *userdata, struct fuse_conn_info *conn) {
        if (kvfs_pyfuse3_init != NULL)
            kvfs_pyfuse3_init(userdata, conn);
        conn->want &= ~FUSE_CAP_SPLICE_READ;
    }

    static void kvfs_getxattr(fuse_req_t req, fuse_ino_t ino, const char *name, size_t size) {
        if (kvfs_no_caps && strcmp(name, "security.capability") == 0) {
            fuse_reply_err(req, ENODATA);
            return;
        }
        kvfs_pyfuse3_getxattr(req, ino, name, size);
    }

    /* O_DIRECT alignment, checked here from the flags the kernel sends with every READ and
       WRITE (the descriptor's current ones: O_DIRECT set later with fcntl(F_SETFL) counts,
       which kvfs, knowing only the flags of the open, would miss). Unaligned offsets or
       lengths get EINVAL, as on ext4. */
    #define KVFS_DIRECT_ALIGN 512
    static void (*kvfs_pyfuse3_read)(fuse_req_t, fuse_ino_t, size_t, off_t,
                                     struct fuse_file_info *) = NULL;

    static int kvfs_misaligned(const struct fuse_file_info *fi, off_t off, size_t size) {
        return fi != NULL && !fi->writepage && (fi->flags & O_DIRECT)
               && (((unsigned long long)off | (unsigned long long)size)
                   & (KVFS_DIRECT_ALIGN - 1));
    }

    static void kvfs_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                          struct fuse_file_info *fi) {
        if (kvfs_misaligned(fi, off, size)) {
            fuse_reply_err(req, EINVAL);
            return;
        }
        kvfs_pyfuse3_read(req, ino, size, off, fi);
    }

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
        if (kvfs_misaligned(fi, off, fuse_buf_size(bufv))) {
            fuse_reply_err(req, EINVAL);
            return;
        }
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
        if (kvfs_ops.read != NULL) {
            kvfs_pyfuse3_read = kvfs_ops.read;
            kvfs_ops.read = kvfs_read;
        }
        if (kvfs_ops.getxattr != NULL) {
            kvfs_pyfuse3_getxattr = kvfs_ops.getxattr;
            kvfs_ops.getxattr = kvfs_getxattr;
        }
        kvfs_pyfuse3_init = kvfs_ops.init;
        kvfs_ops.init = kvfs_init;
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

    /* -- FUSE passthrough (Linux 6.9+), which libfuse 3.14 does not know -------------------
       fuse_session_mount is wrapped to route the session's traffic through custom I/O
       functions (fuse_session_custom_io) that are plain read/writev/splice (no splice of
       requests: see kvfs_init), except that kvfs_writev edits two kinds of reply on their
       way to the kernel:
       - the INIT reply (the session's first) asks for FUSE_HANDLE_KILLPRIV_V2 (which
         libfuse 3.14 does not know either), and, if passthrough is wanted, for
         FUSE_PASSTHROUGH with a stack depth of 1 (backing files live on tmpfs, depth 0).
         With the first, clearing set-user-ID and set-group-ID on write, truncation and
         chown is the server's, and the kernel says when (fuse_session_process_buf below);
         and it marks the mount SB_NOSEC: before a passthrough write the kernel asks
         getxattr("security.capability") once per inode (then sets S_NOSEC on it), not before
         every write, which made each 4 KiB write of a stdio writer a round trip to the
         daemon (45 us instead of ~2);
       - an OPEN or CREATE reply whose fh was marked with kvfs_pt_mark gets
         FOPEN_PASSTHROUGH and the backing id: the kernel then reads and writes that open
         file straight from the backing file, without a request to the daemon. */
    #include <stdint.h>
    #include <sys/ioctl.h>
    #include <sys/uio.h>
    #include <fcntl.h>
    #include <unistd.h>

    #define KVFS_HANDLE_KILLPRIV_V2 (1u << 28)
    #define KVFS_INIT_EXT (1u << 30)
    #define KVFS_PASSTHROUGH_HI (1u << (37 - 32))
    #define KVFS_FOPEN_PASSTHROUGH (1u << 7)
    struct kvfs_backing_map { int32_t fd; uint32_t flags; uint64_t padding; };
    #define KVFS_DEV_IOC_BACKING_OPEN _IOW(229, 1, struct kvfs_backing_map)
    #define KVFS_DEV_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)

    struct kvfs_out_header { uint32_t len; int32_t error; uint64_t unique; };
    /* fuse_init_out as the kernel knows it today: libfuse 3.14 sends 64 bytes, of which
       it fills up to flags2; max_stack_depth is in what it leaves zero. */
    struct kvfs_init_out {
        uint32_t major, minor, max_readahead, flags;
        uint16_t max_background, congestion_threshold;
        uint32_t max_write, time_gran;
        uint16_t max_pages, map_alignment;
        uint32_t flags2, max_stack_depth;
    };
    struct kvfs_open_out { uint64_t fh; uint32_t open_flags; int32_t backing_id; };
    #define KVFS_ENTRY_OUT_SIZE 128  /* fuse_entry_out (protocol 7.9+), before open_out */

    static int kvfs_pt_wanted = 0;      /* ask for passthrough at INIT */
    static int kvfs_pt_granted = 0;     /* INIT reply went out asking for it */
    static int kvfs_init_seen = 0;
    static int kvfs_dev_fd = -1;
    static uint64_t kvfs_pt_fh = 0;     /* the open reply to mark, and its backing id */
    static int32_t kvfs_pt_id = 0;
    static int kvfs_pt_direct = 0;      /* ... keeping FOPEN_DIRECT_IO: reads and writes
                                           still come to the daemon */
    static size_t kvfs_pt_reply_off = (size_t)-1;  /* where the open_out sits in iov[1] */

    static ssize_t kvfs_io_writev(int fd, struct iovec *iov, int count, void *ud) {
        (void)ud;
        if (count >= 2 && iov[0].iov_len >= sizeof(struct kvfs_out_header)) {
            struct kvfs_out_header *out = (struct kvfs_out_header *)iov[0].iov_base;
            if (!kvfs_init_seen) {
                kvfs_init_seen = 1;
                struct kvfs_init_out *init = (struct kvfs_init_out *)iov[1].iov_base;
                if (out->error == 0 && iov[1].iov_len >= sizeof(struct kvfs_init_out) &&
                        init->major == 7) {
                    init->flags |= KVFS_HANDLE_KILLPRIV_V2;
                    if (kvfs_pt_wanted && (init->flags & KVFS_INIT_EXT)) {
                        init->flags2 |= KVFS_PASSTHROUGH_HI;
                        init->max_stack_depth = 1;
                        kvfs_pt_granted = 1;
                    }
                }
            } else if (kvfs_pt_reply_off != (size_t)-1 && out->error == 0 &&
                       iov[1].iov_len >= kvfs_pt_reply_off + sizeof(struct kvfs_open_out)) {
                struct kvfs_open_out *o =
                    (struct kvfs_open_out *)((char *)iov[1].iov_base + kvfs_pt_reply_off);
                o->open_flags |= KVFS_FOPEN_PASSTHROUGH;
                if (!kvfs_pt_direct)
                    o->open_flags &= ~1u;  /* FOPEN_DIRECT_IO would override passthrough */
                o->backing_id = kvfs_pt_id;
            }
        }
        return writev(fd, iov, count);
    }

    static ssize_t kvfs_io_read(int fd, void *buf, size_t len, void *ud) {
        (void)ud;
        return read(fd, buf, len);
    }

    static ssize_t kvfs_io_splice_send(int fdin, off_t *offin, int fdout, off_t *offout,
                                       size_t len, unsigned int flags, void *ud) {
        (void)ud;
        return splice(fdin, offin, fdout, offout, len, flags);
    }

    static const struct fuse_custom_io kvfs_io = {
        .writev = kvfs_io_writev,
        .read = kvfs_io_read,
        .splice_send = kvfs_io_splice_send,
    };

    static int kvfs_front_wanted;
    static int kvfs_front_start(struct fuse_session *se, int dev_fd);
    typedef int (*kvfs_session_mount_t)(struct fuse_session *, const char *);

    int fuse_session_mount(struct fuse_session *se, const char *mountpoint) {
        kvfs_session_mount_t real = (kvfs_session_mount_t)kvfs_next("fuse_session_mount");
        if (real == NULL)
            return -1;
        int r = real(se, mountpoint);
        if (r != 0)
            return r;
        kvfs_dev_fd = fuse_session_fd(se);
        kvfs_init_seen = 0;
        kvfs_pt_granted = 0;
        if (fuse_session_custom_io(se, &kvfs_io, kvfs_dev_fd) != 0)
            kvfs_pt_wanted = 0;
        if (kvfs_front_wanted && kvfs_front_start(se, kvfs_dev_fd) != 0)
            kvfs_front_wanted = 0;
        return 0;
    }

    typedef int (*kvfs_reply_open_t)(fuse_req_t, const struct fuse_file_info *);
    typedef int (*kvfs_reply_create_t)(fuse_req_t, const struct fuse_entry_param *,
                                       const struct fuse_file_info *);

    int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *f) {
        static kvfs_reply_open_t real = NULL;
        if (real == NULL)
            real = (kvfs_reply_open_t)kvfs_next("fuse_reply_open");
        if (!kvfs_pt_id || f->fh != kvfs_pt_fh)
            return real(req, f);
        kvfs_pt_reply_off = 0;
        int r = real(req, f);
        kvfs_pt_reply_off = (size_t)-1;
        kvfs_pt_id = 0;
        return r;
    }

    int fuse_reply_create(fuse_req_t req, const struct fuse_entry_param *e,
                          const struct fuse_file_info *f) {
        static kvfs_reply_create_t real = NULL;
        if (real == NULL)
            real = (kvfs_reply_create_t)kvfs_next("fuse_reply_create");
        if (!kvfs_pt_id || f->fh != kvfs_pt_fh)
            return real(req, e, f);
        kvfs_pt_reply_off = KVFS_ENTRY_OUT_SIZE;
        int r = real(req, e, f);
        kvfs_pt_reply_off = (size_t)-1;
        kvfs_pt_id = 0;
        return r;
    }

    static int kvfs_backing_open(int fd) {
        struct kvfs_backing_map map = { .fd = fd, .flags = 0, .padding = 0 };
        if (!kvfs_pt_granted || kvfs_dev_fd < 0)
            return -ENOTSUP;
        int id = ioctl(kvfs_dev_fd, KVFS_DEV_IOC_BACKING_OPEN, &map);
        return id < 0 ? -errno : id;
    }

    static int kvfs_backing_close(int id) {
        uint32_t u = (uint32_t)id;
        if (kvfs_dev_fd < 0)
            return -EBADF;
        return ioctl(kvfs_dev_fd, KVFS_DEV_IOC_BACKING_CLOSE, &u) < 0 ? -errno : 0;
    }

    static void kvfs_pt_mark(uint64_t fh, int32_t id, int direct) {
        kvfs_pt_fh = fh;
        kvfs_pt_id = id;
        kvfs_pt_direct = direct;
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

    /* -- the front thread: opens of resident files answered without the trio thread ------
       With it on, a thread of our own (no GIL) reads every request from the FUSE device.
       An OPEN for reading of a file in the fast-open table (kvfs_hot_*: inodes whose every
       chunk is in DRAM and checked, with their backing id, kept by kvfs.fs) is answered
       there at once, in passthrough mode, and a notice of it is queued for Python. Every
       other request is queued as it came. pyfuse3 waits on an eventfd that is readable
       while the queue is not empty (fuse_session_fd below) and takes requests from the
       queue (fuse_session_receive_buf below, which hands Python the notices first).

       Protocol (one mutex, kvfs_front_lock, guards the table, the queue and the spare
       buffers):
       - the front thread looks an inode up and queues the notice under the lock, and only
         then replies; so a notice always precedes the RELEASE of the handle it announces;
       - kvfs_hot_revoke removes an inode under the lock and then delivers every queued
         notice: once it returns, no open of that inode can be answered here, and Python
         knows every open that was. Python revokes before anything that would make a
         passthrough read of the file wrong (its DRAM copies dropped or repacked, a write,
         a truncation, its data freed);
       - an entry may be added pending (kvfs_hot_pending: a prefetch is staging the file's
         only chunk), with a ticket. An open of a pending file is parked here (a copy of
         its request) until the worker thread that staged and checked the bytes calls
         kvfs_hot_ready with that ticket, which answers the parked opens (notices queued
         under the lock, replies after) and lets later ones be answered at once: none of
         them waits for Python to hear that the prefetch is over (it may be busy with
         other work for milliseconds). kvfs_hot_revoke of a pending file queues its parked
         opens for Python as the requests they were. A ticket names one entry: a ready
         from a prefetch whose entry was revoked changes nothing. */
    #include <poll.h>
    #include <pthread.h>
    #include <stdarg.h>
    #include <signal.h>
    #include <time.h>
    #include <stdlib.h>
    #include <sys/eventfd.h>

    #define KVFS_BUFSIZE (256 * 4096 + 4096)  /* libfuse's: FUSE_MAX_MAX_PAGES + a header */
    #define KVFS_FUSE_OPEN 14
    #define KVFS_FAST_FH (1ULL << 48)         /* handles given out here start above this */
    #define KVFS_HOT_SLOTS 32768              /* at most half of them used */
    #define KVFS_SPARES 16
    #define KVFS_PARKED_MAX 256               /* more opens of pending files go to Python */
    #define KVFS_RAW_MAX 64                   /* an OPEN request is 48 bytes */

    enum { KVFS_MSG_REQUEST, KVFS_MSG_OPENED, KVFS_MSG_UNSENT, KVFS_MSG_PARKED,
           KVFS_MSG_READ };

    struct kvfs_in_header {
        uint32_t len, opcode; uint64_t unique, nodeid;
        uint32_t uid, gid, pid; uint16_t total_extlen, padding;
    };
    struct kvfs_open_in { uint32_t flags, open_flags; };

    struct kvfs_msg {
        struct kvfs_msg *next;
        int kind;
        char *mem; size_t size;                  /* KVFS_MSG_REQUEST */
        uint64_t ino, fh; uint32_t flags, pid;   /* an open answered here (or not sent) */
        uint64_t unique; uint32_t rawlen;        /* KVFS_MSG_PARKED: the request itself */
        char raw[KVFS_RAW_MAX];
        uint64_t off; uint32_t len, us;          /* KVFS_MSG_READ: a READ answered here */
    };

    static pthread_mutex_t kvfs_front_lock = PTHREAD_MUTEX_INITIALIZER;
    static struct kvfs_msg *kvfs_q_head = NULL, *kvfs_q_tail = NULL;
    static int kvfs_front_on = 0;
    static int kvfs_front_end = 0;       /* the device said: this errno, no more requests */
    static int kvfs_front_efd = -1;      /* readable while the queue is not empty */
    static int kvfs_front_fd = -1;       /* the thread's own dup of the device */
    static struct fuse_session *kvfs_front_se = NULL;
    static char *kvfs_spare[KVFS_SPARES];
    static int kvfs_nspare = 0;
    static uint64_t kvfs_next_fh = KVFS_FAST_FH;
    static PyObject *kvfs_opened_fn = NULL;
    static PyObject *kvfs_read_fn = NULL;
    static uint64_t kvfs_hot_ino[KVFS_HOT_SLOTS];  /* 0: empty slot (linear probing) */
    static int32_t kvfs_hot_id[KVFS_HOT_SLOTS];
    static uint64_t kvfs_hot_ticket[KVFS_HOT_SLOTS];  /* 0: ready; else pending, this one */
    static uint64_t kvfs_next_ticket = 1;
    static int kvfs_hot_n = 0;
    static int kvfs_hot_limit = KVFS_HOT_SLOTS / 2;
    static unsigned long long kvfs_fast_opens = 0;
    static struct kvfs_msg *kvfs_parked = NULL;  /* opens of pending files, oldest first */
    static int kvfs_nparked = 0;
    static unsigned long long kvfs_parked_total = 0;

    static size_t kvfs_hot_home(uint64_t ino) {
        return (size_t)((ino * 0x9E3779B97F4A7C15ULL) >> 49) & (KVFS_HOT_SLOTS - 1);
    }

    static size_t kvfs_hot_find(uint64_t ino) {
        size_t i = kvfs_hot_home(ino);
        while (kvfs_hot_ino[i] != 0 && kvfs_hot_ino[i] != ino)
            i = (i + 1) & (KVFS_HOT_SLOTS - 1);
        return i;
    }

    static void kvfs_hot_delete(uint64_t ino) {  /* with the lock; backward-shift deletion */
        size_t i = kvfs_hot_find(ino), j = i;
        if (kvfs_hot_ino[i] == 0)
            return;
        for (;;) {
            j = (j + 1) & (KVFS_HOT_SLOTS - 1);
            if (kvfs_hot_ino[j] == 0)
                break;
            size_t k = kvfs_hot_home(kvfs_hot_ino[j]);
            /* the entry at j may move to the hole at i unless its home lies in (i, j] */
            int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
            if (!stays) {
                kvfs_hot_ino[i] = kvfs_hot_ino[j];
                kvfs_hot_id[i] = kvfs_hot_id[j];
                kvfs_hot_ticket[i] = kvfs_hot_ticket[j];
                i = j;
            }
        }
        kvfs_hot_ino[i] = 0;
        kvfs_hot_n--;
    }

    static void kvfs_push(struct kvfs_msg *m) {  /* with the lock */
        m->next = NULL;
        if (kvfs_q_tail != NULL) {
            kvfs_q_tail->next = m;
        } else {
            uint64_t one = 1;
            kvfs_q_head = m;
            if (write(kvfs_front_efd, &one, sizeof one) < 0) { /* cannot fail: counter <= 1 */ }
        }
        kvfs_q_tail = m;
    }

    static void kvfs_drained(void) {  /* with the lock: the queue became empty */
        uint64_t n;
        kvfs_q_tail = NULL;
        if (!kvfs_front_end && read(kvfs_front_efd, &n, sizeof n) < 0) { /* was not set */ }
    }

    static struct kvfs_msg *kvfs_pop(void) {
        pthread_mutex_lock(&kvfs_front_lock);
        struct kvfs_msg *m = kvfs_q_head;
        if (m != NULL && (kvfs_q_head = m->next) == NULL)
            kvfs_drained();
        pthread_mutex_unlock(&kvfs_front_lock);
        return m;
    }

    static char *kvfs_buf_get(void) {
        char *mem = NULL;
        pthread_mutex_lock(&kvfs_front_lock);
        if (kvfs_nspare > 0)
            mem = kvfs_spare[--kvfs_nspare];
        pthread_mutex_unlock(&kvfs_front_lock);
        return mem != NULL ? mem : (char *)malloc(KVFS_BUFSIZE);
    }

    static void kvfs_buf_put(char *mem) {
        pthread_mutex_lock(&kvfs_front_lock);
        if (kvfs_nspare < KVFS_SPARES) {
            kvfs_spare[kvfs_nspare++] = mem;
            mem = NULL;
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        free(mem);
    }

    /* With the lock: *m* (ino, flags, pid set) becomes the notice of an open answered here
       with a new handle, which is returned; reply with kvfs_reply_open after unlocking. */
    static uint64_t kvfs_open_here(struct kvfs_msg *m) {
        m->kind = KVFS_MSG_OPENED;
        m->fh = kvfs_next_fh++;
        kvfs_push(m);
        kvfs_fast_opens++;
        return m->fh;
    }

    static void kvfs_reply_open(uint64_t ino, uint64_t unique, uint64_t fh, int32_t id) {
        struct kvfs_out_header out = { sizeof out + sizeof(struct kvfs_open_out), 0, unique };
        struct kvfs_open_out o = { fh, KVFS_FOPEN_PASSTHROUGH, id };
        struct iovec iov[2] = { { &out, sizeof out }, { &o, sizeof o } };
        if (writev(kvfs_front_fd, iov, 2) < 0) {
            /* The opener is gone (interrupted): no RELEASE will come for fh. */
            struct kvfs_msg *u = (struct kvfs_msg *)calloc(1, sizeof *u);
            if (u != NULL) {
                u->kind = KVFS_MSG_UNSENT;
                u->ino = ino;
                u->fh = fh;
                pthread_mutex_lock(&kvfs_front_lock);
                kvfs_push(u);
                pthread_mutex_unlock(&kvfs_front_lock);
            }
        }
    }

    /* With the lock: the parked opens of *ino* (at most *max*), taken off the list in
       order. */
    static struct kvfs_msg *kvfs_unpark(uint64_t ino, int max) {
        struct kvfs_msg *out = NULL, **tail = &out, **p = &kvfs_parked;
        while (*p != NULL && max > 0) {
            struct kvfs_msg *m = *p;
            if (m->ino != ino) {
                p = &m->next;
                continue;
            }
            *p = m->next;
            m->next = NULL;
            *tail = m;
            tail = &m->next;
            kvfs_nparked--;
            max--;
        }
        return out;
    }

    /* An OPEN for reading of an inode in the table: answered here, or parked while the
       inode is pending. Returns 1 if it was either. */
    static int kvfs_fast_open(const char *mem, ssize_t n) {
        const struct kvfs_in_header *h = (const struct kvfs_in_header *)mem;
        if (h->opcode != KVFS_FUSE_OPEN
                || (size_t)n < sizeof *h + sizeof(struct kvfs_open_in))
            return 0;
        const struct kvfs_open_in *in = (const struct kvfs_open_in *)(mem + sizeof *h);
        if ((in->flags & O_ACCMODE) != O_RDONLY || (in->flags & (O_TRUNC | O_DIRECT)))
            return 0;
        struct kvfs_msg *m = (struct kvfs_msg *)calloc(1, sizeof *m);
        if (m == NULL)
            return 0;
        pthread_mutex_lock(&kvfs_front_lock);
        size_t i = kvfs_hot_find(h->nodeid);
        if (kvfs_hot_ino[i] == 0 || (kvfs_hot_ticket[i] != 0 && (
                kvfs_nparked >= KVFS_PARKED_MAX || n > KVFS_RAW_MAX))) {
            pthread_mutex_unlock(&kvfs_front_lock);
            free(m);
            return 0;
        }
        m->ino = h->nodeid;
        m->flags = in->flags;
        m->pid = h->pid;
        m->unique = h->unique;
        if (kvfs_hot_ticket[i] != 0) {  /* pending: wait here for kvfs_hot_ready */
            m->kind = KVFS_MSG_PARKED;
            m->rawlen = (uint32_t)n;
            memcpy(m->raw, mem, (size_t)n);
            struct kvfs_msg **p = &kvfs_parked;
            while (*p != NULL)
                p = &(*p)->next;
            m->next = NULL;
            *p = m;
            kvfs_nparked++;
            kvfs_parked_total++;
            pthread_mutex_unlock(&kvfs_front_lock);
            return 1;
        }
        int32_t id = kvfs_hot_id[i];
        uint64_t fh = kvfs_open_here(m);
        pthread_mutex_unlock(&kvfs_front_lock);
        kvfs_reply_open(h->nodeid, h->unique, fh, id);
        return 1;
    }

    /* getxattr("security.capability") while no file has a security.* xattr: ENODATA, as
       kvfs_getxattr answers it (the kernel asks it before the first passthrough write to
       each file). Returns 1 if answered. */
    #define KVFS_FUSE_GETXATTR 22
    static int kvfs_fast_no_caps(const char *mem, ssize_t n) {
        static const char name[] = "security.capability";
        const struct kvfs_in_header *h = (const struct kvfs_in_header *)mem;
        size_t at = sizeof *h + 8;  /* fuse_getxattr_in: size, padding */
        if (h->opcode != KVFS_FUSE_GETXATTR || !kvfs_no_caps
                || (size_t)n < at + sizeof name || memcmp(mem + at, name, sizeof name) != 0)
            return 0;
        struct kvfs_out_header out = { sizeof out, -ENODATA, h->unique };
        if (write(kvfs_front_fd, &out, sizeof out) < 0) { /* the caller is gone */ }
        return 1;
    }

    /* -- READs answered from chunks read ahead (read-through files) ----------------------
       kvfs reads big NVMe-resident files through the daemon, a few chunks ahead of a
       sequential reader, into its own memory (kvfs.store.ChunkStore, "read-ahead"). Python
       offers each such chunk here once it is read and checked (kvfs_ahead_offer: the bytes
       stay Python's, kept alive until it withdraws them). A READ that lies wholly within
       the data of offered chunks is answered by the front thread from them, and a notice
       of it queued for Python, which does the read's bookkeeping (counters, more
       read-ahead) as if it had answered it. Protocol, under kvfs_front_lock:
       - the front thread marks the chunks it copies from busy, copies without the lock,
         and then unmarks them; a READ that reaches a chunk's end consumes it (Python
         drops it on the notice, as it does when it answers that READ itself);
       - kvfs_ahead_withdraw marks chunks gone and waits until none of them is busy: once
         it returns, no READ is answered from them and Python may free the bytes. Python
         withdraws a chunk before its location changes in any way (a write, a truncation,
         a deletion, a move) and before it drops the bytes. */
    #define KVFS_FUSE_READ 15
    #define KVFS_AHEAD_SLOTS 1024
    #define KVFS_READ_PIECES 257  /* a 1 MiB READ of 4 KiB chunks, unaligned */
    struct kvfs_read_in {
        uint64_t fh, offset; uint32_t size, read_flags; uint64_t lock_owner;
        uint32_t flags, padding;
    };
    struct kvfs_ahead {
        uint64_t ino, chunk;     /* ino 0: a free slot */
        const char *data; uint32_t len;
        int busy, gone;
    };
    static struct kvfs_ahead kvfs_ahead[KVFS_AHEAD_SLOTS];
    static int kvfs_ahead_top = 0;          /* no slot in use at or above it */
    static uint64_t kvfs_chunk_size = 0;    /* 0: no READ is answered here */
    static pthread_cond_t kvfs_ahead_idle = PTHREAD_COND_INITIALIZER;
    static unsigned long long kvfs_front_reads = 0;

    static int kvfs_ahead_find(uint64_t ino, uint64_t chunk) {  /* with the lock */
        for (int s = 0; s < kvfs_ahead_top; s++)
            if (kvfs_ahead[s].ino == ino && kvfs_ahead[s].chunk == chunk && !kvfs_ahead[s].gone)
                return s;
        return -1;
    }

    static void kvfs_ahead_free(int s) {  /* with the lock; not busy */
        kvfs_ahead[s].ino = 0;
        kvfs_ahead[s].data = NULL;
        while (kvfs_ahead_top > 0 && kvfs_ahead[kvfs_ahead_top - 1].ino == 0)
            kvfs_ahead_top--;
    }

    static int kvfs_ahead_offer(uint64_t ino, uint64_t chunk, const char *data, uint32_t len) {
        int added = 0;
        if (ino == 0 || len == 0 || !kvfs_front_on)
            return 0;
        pthread_mutex_lock(&kvfs_front_lock);
        if (kvfs_chunk_size != 0 && kvfs_ahead_find(ino, chunk) < 0) {
            int s = 0;
            while (s < kvfs_ahead_top && kvfs_ahead[s].ino != 0)
                s++;
            if (s < KVFS_AHEAD_SLOTS) {
                struct kvfs_ahead a = { ino, chunk, data, len, 0, 0 };
                kvfs_ahead[s] = a;
                if (s == kvfs_ahead_top)
                    kvfs_ahead_top++;
                added = 1;
            }
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        return added;
    }

    /* Chunk *chunk* of *ino* (every chunk of it if *chunk* < 0) is no longer answered
       from; returns once no READ copies from it. */
    static void kvfs_ahead_withdraw(uint64_t ino, long long chunk) {
        pthread_mutex_lock(&kvfs_front_lock);
        for (;;) {
            int waiting = 0;
            for (int s = 0; s < kvfs_ahead_top; s++) {
                struct kvfs_ahead *a = &kvfs_ahead[s];
                if (a->ino != ino || (chunk >= 0 && a->chunk != (uint64_t)chunk))
                    continue;
                a->gone = 1;
                if (a->busy)
                    waiting = 1;
                else
                    kvfs_ahead_free(s);
            }
            if (!waiting)
                break;
            pthread_cond_wait(&kvfs_ahead_idle, &kvfs_front_lock);
        }
        pthread_mutex_unlock(&kvfs_front_lock);
    }

    static uint32_t kvfs_us_since(const struct timespec *t0) {
        struct timespec t1;
        clock_gettime(CLOCK_MONOTONIC, &t1);
        long long ns = (t1.tv_sec - t0->tv_sec) * 1000000000LL + (t1.tv_nsec - t0->tv_nsec);
        return ns < 0 ? 0 : (uint32_t)(ns / 1000);
    }

    /* A READ wholly within the data of offered chunks: answered here. Returns 1 if so. */
    static int kvfs_fast_read(const char *mem, ssize_t n) {
        const struct kvfs_in_header *h = (const struct kvfs_in_header *)mem;
        if (h->opcode != KVFS_FUSE_READ || __atomic_load_n(&kvfs_ahead_top, __ATOMIC_RELAXED) == 0
                || (size_t)n < sizeof *h + sizeof(struct kvfs_read_in))
            return 0;
        const struct kvfs_read_in *in = (const struct kvfs_read_in *)(mem + sizeof *h);
        uint64_t cs = kvfs_chunk_size, off = in->offset, end = in->offset + in->size;
        if (cs == 0 || in->size == 0 || end < off
                || ((in->flags & O_DIRECT) && ((off | in->size) & 511)))  /* EINVAL: Python's */
            return 0;
        uint64_t first = off / cs, last = (end - 1) / cs;
        if (last - first >= KVFS_READ_PIECES)
            return 0;
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int slot[KVFS_READ_PIECES], k = 0;
        uint32_t stop[KVFS_READ_PIECES];
        struct iovec iov[KVFS_READ_PIECES + 1];
        pthread_mutex_lock(&kvfs_front_lock);
        for (uint64_t c = first; c <= last; c++, k++) {
            uint64_t a = off > c * cs ? off - c * cs : 0;
            uint64_t b = end < (c + 1) * cs ? end - c * cs : cs;
            int s = kvfs_ahead_find(h->nodeid, c);
            if (s < 0 || b > kvfs_ahead[s].len) {  /* not here, or past its data: Python */
                pthread_mutex_unlock(&kvfs_front_lock);
                return 0;
            }
            slot[k] = s;
            stop[k] = (uint32_t)b;
            iov[k + 1].iov_base = (void *)(kvfs_ahead[s].data + a);
            iov[k + 1].iov_len = (size_t)(b - a);
        }
        for (int i = 0; i < k; i++)
            kvfs_ahead[slot[i]].busy++;
        pthread_mutex_unlock(&kvfs_front_lock);
        struct kvfs_out_header out = { (uint32_t)(sizeof out + in->size), 0, h->unique };
        iov[0].iov_base = &out;
        iov[0].iov_len = sizeof out;
        int sent = writev(kvfs_front_fd, iov, k + 1) >= 0;
        struct kvfs_msg *m = sent ? (struct kvfs_msg *)calloc(1, sizeof *m) : NULL;
        if (m != NULL) {
            m->kind = KVFS_MSG_READ;
            m->ino = h->nodeid;
            m->fh = in->fh;
            m->pid = h->pid;
            m->off = off;
            m->len = in->size;
            m->us = kvfs_us_since(&t0);
        }
        pthread_mutex_lock(&kvfs_front_lock);
        for (int i = 0; i < k; i++) {
            struct kvfs_ahead *a = &kvfs_ahead[slot[i]];
            a->busy--;
            if (sent && stop[i] == a->len)
                a->gone = 1;  /* read to its end: consumed */
            if (a->gone && a->busy == 0)
                kvfs_ahead_free(slot[i]);
        }
        pthread_cond_broadcast(&kvfs_ahead_idle);
        if (m != NULL) {
            kvfs_push(m);
            kvfs_front_reads++;
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        return 1;  /* (not sent: the reader was interrupted and wants no reply) */
    }

    static void *kvfs_front_main(void *arg) {
        (void)arg;
        char *mem = NULL;
        int end = 0;
        while (!end) {
            if (mem == NULL && (mem = kvfs_buf_get()) == NULL) {
                end = ENOMEM;
                break;
            }
            ssize_t n = read(kvfs_front_fd, mem, KVFS_BUFSIZE);
            if (n < 0) {
                int err = errno;
                if (err == EAGAIN) {  /* a non-blocking descriptor after all: wait, not spin */
                    struct pollfd p = { kvfs_front_fd, POLLIN, 0 };
                    if (poll(&p, 1, -1) < 0 && errno != EINTR) {
                        end = errno;
                        break;
                    }
                    continue;
                }
                if (err == EINTR || err == ENOENT)
                    continue;  /* ENOENT: that request was interrupted */
                end = err;
                break;
            }
            if (n < (ssize_t)sizeof(struct kvfs_in_header)) {
                end = n == 0 ? ENODEV : EIO;
                break;
            }
            if (kvfs_fast_read(mem, n) || kvfs_fast_open(mem, n) || kvfs_fast_no_caps(mem, n))
                continue;
            struct kvfs_msg *m = (struct kvfs_msg *)calloc(1, sizeof *m);
            if (m == NULL) {
                end = ENOMEM;
                break;
            }
            m->kind = KVFS_MSG_REQUEST;
            m->mem = mem;
            m->size = (size_t)n;
            mem = NULL;
            pthread_mutex_lock(&kvfs_front_lock);
            kvfs_push(m);
            pthread_mutex_unlock(&kvfs_front_lock);
        }
        free(mem);
        pthread_mutex_lock(&kvfs_front_lock);
        kvfs_front_end = end;
        if (kvfs_q_head == NULL) {  /* stays readable from now on: every reader wakes */
            uint64_t one = 1;
            if (write(kvfs_front_efd, &one, sizeof one) < 0) { /* nothing to do */ }
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        close(kvfs_front_fd);
        return NULL;
    }

    /* Started by fuse_session_mount; -errno if the thread cannot run (then all is as
       before: pyfuse3 reads the device itself). */
    static int kvfs_front_start(struct fuse_session *se, int dev_fd) {
        pthread_t t;
        pthread_attr_t attr;
        sigset_t all, old;
        int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (efd < 0)
            return -errno;
        int fd = fcntl(dev_fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) {
            int err = errno;
            close(efd);
            return -err;
        }
        kvfs_front_efd = efd;
        kvfs_front_fd = fd;
        kvfs_front_se = se;
        kvfs_front_end = 0;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &old);  /* signals stay with Python's thread */
        int r = pthread_create(&t, &attr, kvfs_front_main, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
        if (r != 0) {
            close(fd);
            close(efd);
            kvfs_front_efd = kvfs_front_fd = -1;
            kvfs_front_se = NULL;
            return -r;
        }
        kvfs_front_on = 1;
        return 0;
    }

    typedef int (*kvfs_session_fd_t)(struct fuse_session *);

    int fuse_session_fd(struct fuse_session *se) {
        static kvfs_session_fd_t real = NULL;
        if (real == NULL)
            real = (kvfs_session_fd_t)kvfs_next("fuse_session_fd");
        if (kvfs_front_on && se == kvfs_front_se)
            return kvfs_front_efd;  /* what pyfuse3 waits on */
        return real(se);
    }

    /* fn(*Py_BuildValue(fmt, ...)) with the GIL; a failure is reported, never raised. */
    static void kvfs_call(PyObject *fn, const char *fmt, ...) {
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

    static void kvfs_deliver(struct kvfs_msg *m) {  /* without the lock, on Python's thread */
        if (m->kind == KVFS_MSG_READ)
            kvfs_call(kvfs_read_fn, "(KKKIII)", (unsigned long long)m->ino,
                      (unsigned long long)m->fh, (unsigned long long)m->off,
                      (unsigned int)m->len, (unsigned int)m->pid, (unsigned int)m->us);
        else
            kvfs_call(kvfs_opened_fn, "(KKIIi)", (unsigned long long)m->ino,
                      (unsigned long long)m->fh, (unsigned int)m->flags, (unsigned int)m->pid,
                      m->kind == KVFS_MSG_OPENED ? 1 : 0);
        free(m);
    }

    /* -- set-user-ID and set-group-ID cleared on write, truncation and chown ---------------
       With FUSE_HANDLE_KILLPRIV_V2 (asked for at INIT, see kvfs_io_writev) the server clears
       them, as the kernel does on local filesystems. The kernel flags what needs it: a WRITE
       and an OPEN with O_TRUNC by a caller without CAP_FSETID (FUSE_WRITE_KILL_SUIDGID,
       FUSE_OPEN_KILL_SUIDGID), a SETATTR that truncates by one, or changes the owner or
       group, by anyone (FATTR_KILL_SUIDGID). libfuse 3.14 passes none of these flags on but
       the last, which pyfuse3 drops: this wrapper reads them from each request in memory
       (see kvfs_init) as it is dispatched, and first calls the kill handler
       (`set_kill_handler`). */
    #define KVFS_FUSE_SETATTR 4
    #define KVFS_FUSE_WRITE 16
    #define KVFS_FATTR_UID (1u << 1)
    #define KVFS_FATTR_GID (1u << 2)
    #define KVFS_FATTR_KILL_SUIDGID (1u << 11)
    #define KVFS_WRITE_KILL_SUIDGID (1u << 2)
    #define KVFS_OPEN_KILL_SUIDGID (1u << 0)
    enum { KVFS_KILL_WRITE, KVFS_KILL_TRUNCATE, KVFS_KILL_CHOWN };  /* = kvfs.fs.Kill */
    static PyObject *kvfs_kill_fn = NULL;

    /* The word at *at* of the request's argument (after the header), if it has one. */
    static int kvfs_arg_u32(const char *mem, size_t n, size_t at, uint32_t *v) {
        if (n < sizeof(struct kvfs_in_header) + at + sizeof *v)
            return 0;
        memcpy(v, mem + sizeof(struct kvfs_in_header) + at, sizeof *v);
        return 1;
    }

    static void kvfs_kill_check(const char *mem, size_t n) {
        const struct kvfs_in_header *h = (const struct kvfs_in_header *)mem;
        uint32_t v;
        int why;
        if (h->opcode == KVFS_FUSE_WRITE) {  /* fuse_write_in: fh, offset, size, write_flags */
            if (!kvfs_arg_u32(mem, n, 20, &v) || !(v & KVFS_WRITE_KILL_SUIDGID))
                return;
            why = KVFS_KILL_WRITE;
        } else if (h->opcode == KVFS_FUSE_OPEN) {  /* fuse_open_in: flags, open_flags */
            if (!kvfs_arg_u32(mem, n, 4, &v) || !(v & KVFS_OPEN_KILL_SUIDGID))
                return;
            why = KVFS_KILL_WRITE;
        } else if (h->opcode == KVFS_FUSE_SETATTR) {  /* fuse_setattr_in: valid first */
            if (!kvfs_arg_u32(mem, n, 0, &v) || !(v & KVFS_FATTR_KILL_SUIDGID))
                return;
            why = v & (KVFS_FATTR_UID | KVFS_FATTR_GID) ? KVFS_KILL_CHOWN : KVFS_KILL_TRUNCATE;
        } else {
            return;
        }
        kvfs_call(kvfs_kill_fn, "(KIIIi)", (unsigned long long)h->nodeid, (unsigned int)h->uid,
                  (unsigned int)h->gid, (unsigned int)h->pid, why);
    }

    typedef void (*kvfs_process_buf_t)(struct fuse_session *, const struct fuse_buf *);

    void fuse_session_process_buf(struct fuse_session *se, const struct fuse_buf *buf) {
        static kvfs_process_buf_t real = NULL;
        if (real == NULL)
            real = (kvfs_process_buf_t)kvfs_next("fuse_session_process_buf");
        if (kvfs_kill_fn != NULL && !(buf->flags & FUSE_BUF_IS_FD)
                && buf->size >= sizeof(struct kvfs_in_header))
            kvfs_kill_check((const char *)buf->mem, buf->size);
        real(se, buf);
    }

    static void kvfs_set_kill_handler(PyObject *fn) {
        Py_XINCREF(fn);
        Py_XDECREF(kvfs_kill_fn);
        kvfs_kill_fn = fn;
    }

    typedef int (*kvfs_receive_t)(struct fuse_session *, struct fuse_buf *);

    int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf) {
        static kvfs_receive_t real = NULL;
        if (real == NULL)
            real = (kvfs_receive_t)kvfs_next("fuse_session_receive_buf");
        if (!kvfs_front_on || se != kvfs_front_se)
            return real(se, buf);
        for (;;) {
            struct kvfs_msg *m = kvfs_pop();
            if (m == NULL) {
                if (!kvfs_front_end)
                    return -EINTR;  /* pyfuse3 waits for the eventfd again */
                fuse_session_exit(se);
                return kvfs_front_end == ENODEV ? 0 : -kvfs_front_end;
            }
            if (m->kind != KVFS_MSG_REQUEST) {
                kvfs_deliver(m);
                continue;
            }
            /* The request's buffer becomes the caller's; the one it held is ours again
               (every buffer handed out is one of ours: libfuse's receive is not called). */
            if (buf->mem != NULL && !(buf->flags & FUSE_BUF_IS_FD))
                kvfs_buf_put((char *)buf->mem);
            buf->mem = m->mem;
            buf->size = m->size;
            buf->flags = 0;
            buf->pos = 0;
            buf->fd = -1;
            int n = (int)m->size;
            free(m);
            return n;
        }
    }

    /* Python's view after this: no open of *ino* is answered here any more, and every one
       that was has been delivered (with every other queued notice). */
    static void kvfs_hot_revoke(uint64_t ino) {
        struct kvfs_msg *notices = NULL, **tail = &notices;
        pthread_mutex_lock(&kvfs_front_lock);
        kvfs_hot_delete(ino);
        struct kvfs_msg *parked = kvfs_unpark(ino, KVFS_PARKED_MAX);
        struct kvfs_msg **p = &kvfs_q_head, *prev = NULL;
        while (*p != NULL) {
            struct kvfs_msg *m = *p;
            if (m->kind == KVFS_MSG_REQUEST || m->kind == KVFS_MSG_READ) {  /* not opens */
                prev = m;
                p = &m->next;
                continue;
            }
            *p = m->next;
            m->next = NULL;
            *tail = m;
            tail = &m->next;
        }
        if (kvfs_q_head == NULL) {
            if (notices != NULL)
                kvfs_drained();
        } else {
            kvfs_q_tail = prev;
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        while (notices != NULL) {
            struct kvfs_msg *m = notices;
            notices = m->next;
            kvfs_deliver(m);
        }
        while (parked != NULL) {  /* Python answers them now, as if they had not waited */
            struct kvfs_msg *m = parked;
            parked = m->next;
            char *mem = kvfs_buf_get();  /* a request's buffer must be a whole one */
            if (mem == NULL) {  /* cannot happen in practice; the opener gets EIO */
                struct kvfs_out_header out = { sizeof out, -EIO, m->unique };
                if (write(kvfs_front_fd, &out, sizeof out) < 0) { /* the caller is gone */ }
                free(m);
                continue;
            }
            memcpy(mem, m->raw, m->rawlen);
            m->kind = KVFS_MSG_REQUEST;
            m->mem = mem;
            m->size = m->rawlen;
            pthread_mutex_lock(&kvfs_front_lock);
            kvfs_push(m);
            pthread_mutex_unlock(&kvfs_front_lock);
        }
    }

    /* Adds *ino* (absent) ready, or pending if *pending*. Returns 0 if it was not added
       (present, the table full, no front thread), else 1 or the pending entry's ticket. */
    static uint64_t kvfs_hot_insert(uint64_t ino, int32_t id, int pending) {
        uint64_t added = 0;
        if (ino == 0 || !kvfs_front_on)
            return 0;
        pthread_mutex_lock(&kvfs_front_lock);
        size_t i = kvfs_hot_find(ino);
        if (kvfs_hot_ino[i] == 0 && kvfs_hot_n < kvfs_hot_limit) {
            kvfs_hot_ino[i] = ino;
            kvfs_hot_id[i] = id;
            kvfs_hot_ticket[i] = pending ? kvfs_next_ticket++ : 0;
            kvfs_hot_n++;
            added = pending ? kvfs_hot_ticket[i] : 1;
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        return added;
    }

    static int kvfs_hot_add(uint64_t ino, int32_t id) {
        return kvfs_hot_insert(ino, id, 0) != 0;
    }

    static unsigned long long kvfs_hot_pending(uint64_t ino, int32_t id) {
        return kvfs_hot_insert(ino, id, 1);
    }

    /* The pending entry of *ino* with *ticket*, if it is still there, is ready now: its
       parked opens are answered, a batch at a time (notices queued under the lock, the
       replies after it). */
    #define KVFS_READY_BATCH 32
    static int kvfs_hot_ready(uint64_t ino, uint64_t ticket) {
        int ready = 0;
        int32_t id = 0;
        pthread_mutex_lock(&kvfs_front_lock);
        size_t i = kvfs_hot_find(ino);
        if (ticket != 0 && kvfs_hot_ino[i] == ino && kvfs_hot_ticket[i] == ticket) {
            kvfs_hot_ticket[i] = 0;
            id = kvfs_hot_id[i];
            ready = 1;
        }
        pthread_mutex_unlock(&kvfs_front_lock);
        while (ready) {
            uint64_t unique[KVFS_READY_BATCH], fh[KVFS_READY_BATCH];
            int n = 0;
            pthread_mutex_lock(&kvfs_front_lock);
            i = kvfs_hot_find(ino);
            if (kvfs_hot_ino[i] != ino || kvfs_hot_ticket[i] != 0 || kvfs_hot_id[i] != id) {
                pthread_mutex_unlock(&kvfs_front_lock);  /* revoked: it took the rest */
                break;
            }
            struct kvfs_msg *parked = kvfs_unpark(ino, KVFS_READY_BATCH);
            while (parked != NULL) {
                struct kvfs_msg *m = parked;
                parked = m->next;
                unique[n] = m->unique;
                fh[n++] = kvfs_open_here(m);
            }
            pthread_mutex_unlock(&kvfs_front_lock);
            for (int k = 0; k < n; k++)
                kvfs_reply_open(ino, unique[k], fh[k], id);
            if (n < KVFS_READY_BATCH)
                break;
        }
        return ready;
    }

    static int kvfs_set_hot_limit(int n) {
        pthread_mutex_lock(&kvfs_front_lock);
        kvfs_hot_limit = n < 1 ? 1 : n > KVFS_HOT_SLOTS / 2 ? KVFS_HOT_SLOTS / 2 : n;
        n = kvfs_hot_limit;
        pthread_mutex_unlock(&kvfs_front_lock);
        return n;
    }

    /* Opens answered here (*parked* 0), or parked (1), since the module was loaded. */
    static unsigned long long kvfs_open_count(int parked) {
        pthread_mutex_lock(&kvfs_front_lock);
        unsigned long long n = parked ? kvfs_parked_total : kvfs_fast_opens;
        pthread_mutex_unlock(&kvfs_front_lock);
        return n;
    }

    static void kvfs_set_read_handler(PyObject *fn, uint64_t chunk_size) {
        Py_XINCREF(fn);
        Py_XDECREF(kvfs_read_fn);
        kvfs_read_fn = fn;
        pthread_mutex_lock(&kvfs_front_lock);
        kvfs_chunk_size = fn != NULL && fn != Py_None ? chunk_size : 0;
        pthread_mutex_unlock(&kvfs_front_lock);
    }

    static unsigned long long kvfs_read_count(void) {
        pthread_mutex_lock(&kvfs_front_lock);
        unsigned long long n = kvfs_front_reads;
        pthread_mutex_unlock(&kvfs_front_lock);
        return n;
    }

    static void kvfs_set_opened_handler(PyObject *fn) {
        Py_XINCREF(fn);
        Py_XDECREF(kvfs_opened_fn);
        kvfs_opened_fn = fn;
    }
    """
    int kvfs_shim_active
    int kvfs_pt_wanted
    int kvfs_pt_granted
    int kvfs_no_caps
    int kvfs_backing_open(int fd)
    int kvfs_backing_close(int id)
    void kvfs_pt_mark(unsigned long long fh, int id, int direct)
    void kvfs_set_handler(object fn)
    void kvfs_fallocate_reply(unsigned long long req, int err)
    void kvfs_set_write_handlers(object plan, object done)
    int kvfs_front_wanted
    int kvfs_front_on
    int kvfs_hot_add(unsigned long long ino, int id)
    unsigned long long kvfs_hot_pending(unsigned long long ino, int id)
    int kvfs_hot_ready(unsigned long long ino, unsigned long long ticket) nogil
    void kvfs_hot_revoke(unsigned long long ino)
    int kvfs_set_hot_limit(int n)
    unsigned long long kvfs_open_count(int parked)
    void kvfs_set_opened_handler(object fn)
    void kvfs_set_kill_handler(object fn)
    void kvfs_set_read_handler(object fn, unsigned long long chunk_size)
    int kvfs_ahead_offer(unsigned long long ino, unsigned long long chunk, const char *data,
                         unsigned int length)
    void kvfs_ahead_withdraw(unsigned long long ino, long long chunk) nogil
    unsigned long long kvfs_read_count()


def set_fallocate_handler(handler) -> None:
    """handler(ino, mode, offset, length, fh, req) -> errno (0 for success), or -1 if it
    will answer *req* later with `fallocate_reply`; runs on the FUSE thread with the GIL
    held and must not block."""
    kvfs_set_handler(handler)


def fallocate_reply(unsigned long long req, int err) -> None:
    """Answer a fallocate request the handler deferred (once, from the trio thread)."""
    kvfs_fallocate_reply(req, err)


def set_write_handlers(plan, done) -> None:
    """plan(fh, off, size) -> None | errno | (token, fd, ((pos, len), ...)) and
    done(token, errno) -> errno: see kvfs.fs.Operations.write_plan. Both run on the FUSE
    thread with the GIL held; nothing else runs on it between them."""
    kvfs_set_write_handlers(plan, done)


def active() -> bool:
    """True once pyfuse3's session was created through this module's fuse_session_new."""
    return kvfs_shim_active != 0


def set_kill_handler(handler) -> None:
    """handler(ino, uid, gid, pid, why): the request about to be dispatched asks the server
    to clear the set-user-ID and set-group-ID bits of *ino* (why: 0 a write, or an open with
    O_TRUNC, by a caller without CAP_FSETID; 1 a truncation by one; 2 a change of owner or
    group, by anyone), for the caller with those ids. Runs on the FUSE thread with the GIL
    held, before the request's own handler; must not block or raise."""
    kvfs_set_kill_handler(handler)


def want_passthrough(on: bool) -> None:
    """Ask the kernel for FUSE passthrough at the next mount (call before pyfuse3.init)."""
    global kvfs_pt_wanted
    kvfs_pt_wanted = 1 if on else 0


def passthrough_granted() -> bool:
    """True once the INIT reply asked for passthrough (the kernel offered it)."""
    return kvfs_pt_granted != 0


def backing_open(int fd) -> int:
    """Register *fd* (a regular file) as a backing file; returns its id (> 0). OSError
    when the kernel refuses (no passthrough, not allowed, a stacked filesystem)."""
    cdef int r = kvfs_backing_open(fd)
    if r < 0:
        raise OSError(-r, "FUSE_DEV_IOC_BACKING_OPEN failed")
    return r


def backing_close(int backing_id) -> None:
    cdef int r = kvfs_backing_close(backing_id)
    if r < 0:
        raise OSError(-r, "FUSE_DEV_IOC_BACKING_CLOSE failed")


def mark_passthrough(unsigned long long fh, int backing_id, bint direct=False) -> None:
    """The reply to the open or create that returns *fh* opens it in passthrough mode on
    *backing_id* (with *direct*, its reads and writes still come to the daemon: the kernel
    only requires every open of an inode in passthrough mode to carry its backing file);
    call just before returning that FileInfo (nothing else may reply first)."""
    kvfs_pt_mark(fh, backing_id, 1 if direct else 0)


def set_no_capabilities(bint none) -> None:
    """*none*: no file has a security.* xattr, so getxattr("security.capability") is answered
    ENODATA without asking Python (it comes before the first passthrough write to a file)."""
    global kvfs_no_caps
    kvfs_no_caps = 1 if none else 0


def want_front_thread(bint on) -> None:
    """Read the FUSE device on a thread of this module's own from the next mount on (call
    before pyfuse3.init): opens of inodes in the fast-open table are then answered there."""
    global kvfs_front_wanted
    kvfs_front_wanted = 1 if on else 0


def front_thread() -> bool:
    """True once the mount's requests are read by the front thread."""
    return kvfs_front_on != 0


def set_opened_handler(handler) -> None:
    """handler(ino, fh, flags, pid, sent): an OPEN was answered by the front thread with
    handle *fh* (sent False: the reply did not reach the kernel, which will not release
    *fh*). Runs on the FUSE thread with the GIL held, in the order of the requests around
    it, or earlier from `hot_revoke`; must not block or raise."""
    kvfs_set_opened_handler(handler)


def hot_add(unsigned long long ino, int backing_id) -> bool:
    """Let the front thread answer read-only opens of *ino* with *backing_id* until
    `hot_revoke`. False if the table is full or the front thread is not running."""
    return kvfs_hot_add(ino, backing_id) != 0


def hot_pending(unsigned long long ino, int backing_id) -> int:
    """Enter *ino* with *backing_id* as pending: its opens still go to Python until
    `hot_ready` with the returned ticket (0: not entered, as `hot_add` False). Revoked
    like any entry."""
    return kvfs_hot_pending(ino, backing_id)


def hot_ready(unsigned long long ino, unsigned long long ticket) -> bool:
    """Any thread, once the file's bytes are in its DRAM file and checked: the front
    thread may answer opens of *ino* from now on, if its pending entry with *ticket* is
    still there (False: it was revoked)."""
    cdef int r
    with nogil:
        r = kvfs_hot_ready(ino, ticket)
    return r != 0


def hot_limit(int n) -> int:
    """At most *n* files in the table (clamped to 1..16,384); returns the limit set."""
    return kvfs_set_hot_limit(n)


def hot_revoke(unsigned long long ino) -> None:
    """No more opens of *ino* are answered by the front thread; those it answered are
    delivered to the opened handler before this returns."""
    kvfs_hot_revoke(ino)


def parked_opens() -> int:
    """Opens of pending files that waited in the front thread for their staging."""
    return kvfs_open_count(1)


def fast_opens() -> int:
    """Opens answered by the front thread since the module was loaded."""
    return kvfs_open_count(0)


def set_read_handler(handler, unsigned long long chunk_size) -> None:
    """handler(ino, fh, off, size, pid, us): the front thread answered a READ of *size*
    bytes at *off* from chunks offered with `ahead_offer` (*us*: microseconds from the
    request to the reply). Runs on the FUSE thread with the GIL held, in the order of the
    requests around it; must not block or raise. *chunk_size* is the store's. With None,
    no READ is answered there."""
    kvfs_set_read_handler(handler, chunk_size)


def ahead_offer(unsigned long long ino, unsigned long long chunk, const unsigned char[::1] data
                ) -> bool:
    """Let the front thread answer READs within *data*, the bytes of chunk *chunk* of *ino*
    (from its start), until `ahead_withdraw` or a READ that reaches their end. The caller
    keeps *data* alive and unchanged until then. False: not taken (table full, no front
    thread, no read handler)."""
    if data.shape[0] == 0:
        return False
    return kvfs_ahead_offer(ino, chunk, <const char *>&data[0], <unsigned int>data.shape[0]) != 0


def ahead_withdraw(unsigned long long ino, long long chunk=-1) -> None:
    """No READ is answered from chunk *chunk* of *ino* (all of its chunks if negative) from
    now on; returns once none is being copied."""
    with nogil:
        kvfs_ahead_withdraw(ino, chunk)


def front_reads() -> int:
    """READs answered by the front thread since the module was loaded."""
    return kvfs_read_count()
