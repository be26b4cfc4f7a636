/* The libfuse functions this module defines. Loaded with RTLD_GLOBAL before pyfuse3 (see
   kvfs/daemon.py), these definitions are found before libfuse's own when pyfuse3 calls
   them; each hands over to the concern it serves and then calls libfuse's
   (kvfs_next). */
#include "kvfs_shim.h"

#include <dlfcn.h>
#include <string.h>

/* Copies below this size are cheaper than giving the GIL away and taking it back. */
#define NOGIL_COPY (64 * 1024)

typedef struct fuse_session *(*session_new_t)(struct fuse_args *,
                                              const struct fuse_lowlevel_ops *, size_t, void *);
typedef int (*session_mount_t)(struct fuse_session *, const char *);
typedef void (*process_buf_t)(struct fuse_session *, const struct fuse_buf *);
typedef int (*receive_buf_t)(struct fuse_session *, struct fuse_buf *);
typedef int (*session_fd_t)(struct fuse_session *);
typedef int (*reply_buf_t)(fuse_req_t, const char *, size_t);
typedef ssize_t (*buf_copy_t)(struct fuse_bufvec *, struct fuse_bufvec *,
                              enum fuse_buf_copy_flags);
typedef int (*reply_open_t)(fuse_req_t, const struct fuse_file_info *);
typedef int (*reply_create_t)(fuse_req_t, const struct fuse_entry_param *,
                              const struct fuse_file_info *);

static struct fuse_lowlevel_ops ops;
static int active = 0;

void *kvfs_next(const char *name) {
    void *fn = dlvsym(RTLD_NEXT, name, "FUSE_3.0");
    return fn != NULL ? fn : dlsym(RTLD_NEXT, name);
}

/* pyfuse3's operation table, with what the concerns add: fallocate (fallocate.c), writes
   straight into DRAM (write.c) checked for O_DIRECT alignment first (direct.c), as reads
   are, the capabilities shortcut (caps.c), and no splice of requests (setid.c). */
KVFS_INTERPOSE
struct fuse_session *fuse_session_new(struct fuse_args *args,
                                      const struct fuse_lowlevel_ops *op, size_t op_size,
                                      void *userdata) {
    session_new_t real = (session_new_t)kvfs_next("fuse_session_new");
    if (real == NULL)
        return NULL;
    if (op_size > sizeof ops)
        return real(args, op, op_size, userdata);
    memset(&ops, 0, sizeof ops);
    memcpy(&ops, op, op_size);
    if (kvfs_fallocate_install(&ops))
        active = 1;
    kvfs_write_install(&ops);
    kvfs_direct_install(&ops);
    kvfs_caps_install(&ops);
    kvfs_setid_install(&ops);
    return real(args, &ops, sizeof ops, userdata);
}

int kvfs_shim_active(void) {
    return active;
}

/* Mounted: the session's replies go through passthrough.c's custom I/O, and the front
   thread starts if it is wanted (front.c). */
KVFS_INTERPOSE
int fuse_session_mount(struct fuse_session *se, const char *mountpoint) {
    session_mount_t real = (session_mount_t)kvfs_next("fuse_session_mount");
    if (real == NULL)
        return -1;
    int r = real(se, mountpoint);
    if (r != 0)
        return r;
    int dev_fd = fuse_session_fd(se);
    kvfs_pt_attach(se, dev_fd);
    kvfs_front_mounted(se, dev_fd);
    return 0;
}

KVFS_INTERPOSE
void fuse_session_process_buf(struct fuse_session *se, const struct fuse_buf *buf) {
    static process_buf_t real = NULL;
    if (real == NULL)
        real = (process_buf_t)kvfs_next("fuse_session_process_buf");
    kvfs_setid_check(buf);
    real(se, buf);
}

/* With the front thread, requests come from its queue, and pyfuse3 waits on its eventfd. */
KVFS_INTERPOSE
int fuse_session_receive_buf(struct fuse_session *se, struct fuse_buf *buf) {
    static receive_buf_t real = NULL;
    if (real == NULL)
        real = (receive_buf_t)kvfs_next("fuse_session_receive_buf");
    if (kvfs_front_event_fd(se) < 0)
        return real(se, buf);
    return kvfs_front_receive(se, buf);
}

KVFS_INTERPOSE
int fuse_session_fd(struct fuse_session *se) {
    static session_fd_t real = NULL;
    if (real == NULL)
        real = (session_fd_t)kvfs_next("fuse_session_fd");
    int fd = kvfs_front_event_fd(se);
    return fd >= 0 ? fd : real(se);
}

/* An OPEN or CREATE reply marked for passthrough is edited on its way (passthrough.c). */
KVFS_INTERPOSE
int fuse_reply_open(fuse_req_t req, const struct fuse_file_info *f) {
    static reply_open_t real = NULL;
    if (real == NULL)
        real = (reply_open_t)kvfs_next("fuse_reply_open");
    if (!kvfs_pt_edit_begin(f->fh, 0))
        return real(req, f);
    int r = real(req, f);
    kvfs_pt_edit_end();
    return r;
}

KVFS_INTERPOSE
int fuse_reply_create(fuse_req_t req, const struct fuse_entry_param *e,
                      const struct fuse_file_info *f) {
    static reply_create_t real = NULL;
    if (real == NULL)
        real = (reply_create_t)kvfs_next("fuse_reply_create");
    if (!kvfs_pt_edit_begin(f->fh, sizeof(struct fuse_entry_out)))
        return real(req, e, f);
    int r = real(req, e, f);
    kvfs_pt_edit_end();
    return r;
}

/* Big copies without the GIL. pyfuse3 replies to a read (copying up to 1 MiB into the
   kernel) and copies a write's data out of libfuse's buffer while holding the GIL, so the
   worker threads that decode and compress chunks would stall behind every large request.
   That is safe: the memory being copied is pinned by the caller (a buffer export or a fresh
   bytes object nobody else can see), no Python object is touched, and the trio thread that
   could change a DRAM slot is the one blocked in the copy. */
KVFS_INTERPOSE
int fuse_reply_buf(fuse_req_t req, const char *buf, size_t size) {
    static reply_buf_t real = NULL;
    if (real == NULL)
        real = (reply_buf_t)kvfs_next("fuse_reply_buf");
    if (size < NOGIL_COPY || !Py_IsInitialized() || !PyGILState_Check())
        return real(req, buf, size);
    PyThreadState *ts = PyEval_SaveThread();
    int r = real(req, buf, size);
    PyEval_RestoreThread(ts);
    return r;
}

KVFS_INTERPOSE
ssize_t fuse_buf_copy(struct fuse_bufvec *dst, struct fuse_bufvec *src,
                      enum fuse_buf_copy_flags flags) {
    static buf_copy_t real = NULL;
    if (real == NULL)
        real = (buf_copy_t)kvfs_next("fuse_buf_copy");
    if (fuse_buf_size(src) < NOGIL_COPY || !Py_IsInitialized() || !PyGILState_Check())
        return real(dst, src, flags);
    PyThreadState *ts = PyEval_SaveThread();
    ssize_t r = real(dst, src, flags);
    PyEval_RestoreThread(ts);
    return r;
}
