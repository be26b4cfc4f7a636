/* What pyfuse3 lacks, added underneath it: the C of the extension kvfs._fuseshim (its
   Python-facing functions and what each concern is for: native/_fuseshim.pyx).

   One file per concern:
     interpose.c    the libfuse functions defined here, found before libfuse's own (the module
                    is loaded with RTLD_GLOBAL before pyfuse3): fuse_session_new (the
                    operation table the files below add to), fuse_session_mount,
                    fuse_session_process_buf, fuse_session_receive_buf, fuse_session_fd,
                    fuse_reply_open, fuse_reply_create, and fuse_reply_buf and fuse_buf_copy
                    (big copies without the GIL)
     fallocate.c    the fallocate handler pyfuse3 does not register
     write.c        writes copied from the request straight into a DRAM file (the write plan)
     direct.c       O_DIRECT alignment, from the flags each READ and WRITE carries
     caps.c         getxattr("security.capability") answered while no file has any
     setid.c        set-user-ID and set-group-ID cleared when the kernel asks
     passthrough.c  FUSE passthrough: backing ids, the INIT and OPEN reply edits
     front.c        the front thread: reads the FUSE device, queues requests and notices
     hot.c          ... and answers opens of files in the fast-open table (or parks them)
     ahead.c        ... and answers READs from chunks read ahead
     pycall.c       calls into Python from any thread
   The kernel's ABI: fuse_abi.h.

   Each file keeps its state to itself (static); what several files share is declared here,
   with who writes it and under which lock. Every rule kvfs.fs applies too (O_DIRECT
   alignment, the file capabilities' name, the handles the front thread gives out, the
   reasons to clear set-id bits, the fast-open table's size) is Python's, handed over before
   the mount (set_rules, set_kill_handler, hot_limit); none is defined in C. */
#ifndef KVFS_SHIM_H
#define KVFS_SHIM_H

#include <Python.h>  /* first, as Python asks; it defines _GNU_SOURCE (dlvsym, splice) */

#define FUSE_USE_VERSION 35
#include <fuse_lowlevel.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "fuse_abi.h"

/* The libfuse functions interpose.c defines: visible to the dynamic linker, unlike
   everything else here (built with -fvisibility=hidden). */
#define KVFS_INTERPOSE __attribute__((visibility("default")))

/* -- called by _fuseshim.pyx ----------------------------------------------------------- */
int kvfs_shim_active(void);                                           /* interpose.c */
void kvfs_set_fallocate_handler(PyObject *fn);                        /* fallocate.c */
void kvfs_fallocate_reply(unsigned long long req, int err);
void kvfs_set_write_handlers(PyObject *plan, PyObject *done);         /* write.c */
void kvfs_set_direct_align(unsigned int align);                       /* direct.c */
int kvfs_set_caps_name(const char *name, size_t len);                 /* caps.c */
void kvfs_set_no_caps(int none);
void kvfs_set_kill_handler(PyObject *fn, int write, int truncate, int chown);  /* setid.c */
void kvfs_want_passthrough(int on);                                   /* passthrough.c */
int kvfs_backing_open(int fd);
int kvfs_backing_close(int id);
void kvfs_pt_mark(uint64_t fh, int32_t id, int direct);
void kvfs_want_front_thread(int on);                                  /* front.c */
int kvfs_front_running(void);
void kvfs_set_first_fast_fh(uint64_t fh);                             /* hot.c */
int kvfs_set_hot_limit(int n);
int kvfs_hot_add(uint64_t ino, int32_t id);
uint64_t kvfs_hot_pending(uint64_t ino, int32_t id);
int kvfs_hot_ready(uint64_t ino, uint64_t ticket);
void kvfs_hot_revoke(uint64_t ino);
unsigned long long kvfs_parked_count(void);
void kvfs_set_opened_handler(PyObject *fn);
void kvfs_set_read_handler(PyObject *fn, uint64_t chunk_size);        /* ahead.c */
int kvfs_ahead_offer(uint64_t ino, uint64_t chunk, const char *data, uint32_t len);
void kvfs_ahead_withdraw(uint64_t ino, long long chunk);
#define KVFS_LATENCY_BUCKETS 24  /* kvfs.store.reads: min(23, us.bit_length()) */
uint32_t kvfs_ahead_take_quiet(uint32_t hist[KVFS_LATENCY_BUCKETS]);

/* -- the operation table (interpose.c's fuse_session_new calls each, in this order) ----- */
int kvfs_fallocate_install(struct fuse_lowlevel_ops *ops);  /* 1: the handler was added */
void kvfs_write_install(struct fuse_lowlevel_ops *ops);
void kvfs_direct_install(struct fuse_lowlevel_ops *ops);   /* checks before the write plan */
void kvfs_caps_install(struct fuse_lowlevel_ops *ops);
void kvfs_setid_install(struct fuse_lowlevel_ops *ops);

/* -- what the other libfuse functions interpose.c defines hand over ---------------------- */
void kvfs_setid_check(const struct fuse_buf *buf);             /* each request, dispatched */
void kvfs_pt_attach(struct fuse_session *se, int dev_fd);       /* mounted */
int kvfs_pt_edit_begin(uint64_t fh, size_t at);  /* an OPEN reply with the fuse_open_out at
                                                    *at*; 1: it is edited (then _end after) */
void kvfs_pt_edit_end(void);
void kvfs_front_mounted(struct fuse_session *se, int dev_fd);   /* after kvfs_pt_attach */
int kvfs_front_event_fd(struct fuse_session *se);  /* what pyfuse3 waits on; -1: not ours */
int kvfs_front_receive(struct fuse_session *se, struct fuse_buf *buf);

/* libfuse's own definition of *name* (FUSE_3.0's where it has versions). */
void *kvfs_next(const char *name);

/* -- shared by the concerns ------------------------------------------------------------ */
/* The front thread's one mutex. It guards front.c's queue and spare buffers, hot.c's table
   and parked opens, ahead.c's table (whose withdrawals wait on a condition with it): one
   lock, so that a revoke sees the table and the queue in one state. */
extern pthread_mutex_t kvfs_front_lock;
/* 1 once the front thread runs: written once, by fuse_session_mount on the thread that
   mounts, before any request is read; read without the lock. */
extern int kvfs_front_on;

/* What the front thread queues for Python's thread (hot.c, ahead.c and front.c make them;
   delivered in order by fuse_session_receive_buf). */
enum { KVFS_MSG_REQUEST, KVFS_MSG_OPENED, KVFS_MSG_UNSENT, KVFS_MSG_PARKED, KVFS_MSG_READ };
#define KVFS_RAW_MAX 64  /* an OPEN request is 48 bytes */
struct kvfs_msg {
    struct kvfs_msg *next;
    int kind;
    char *mem; size_t size;                  /* KVFS_MSG_REQUEST */
    uint64_t ino, fh; uint32_t flags, pid;   /* an open answered here (or not sent) */
    uint64_t unique; uint32_t rawlen;        /* KVFS_MSG_PARKED: the request itself */
    char raw[KVFS_RAW_MAX];
    uint64_t off; uint32_t len, us;          /* KVFS_MSG_READ: a READ answered here */
};

/* front.c, for hot.c and ahead.c */
void kvfs_push(struct kvfs_msg *m);                 /* with the lock: queued for Python */
struct kvfs_msg *kvfs_take_open_notices(void);      /* with the lock: off the queue, in order */
void kvfs_deliver_all(struct kvfs_msg *notices);    /* without it, on Python's thread */
char *kvfs_buf_get(void);                            /* a request buffer (KVFS_BUFSIZE) */
int kvfs_front_send(const struct iovec *iov, int count);    /* a reply; -1: not sent */
void kvfs_front_reply_error(uint64_t unique, int err);

/* hot.c, ahead.c and caps.c, for the front thread: 1 if the request (*n* bytes, a whole
   fuse_in_header at least) was answered (or parked) there. */
int kvfs_fast_open(const char *mem, size_t n);
int kvfs_fast_read(const char *mem, size_t n);
int kvfs_fast_no_caps(const char *mem, size_t n);
void kvfs_hot_deliver(struct kvfs_msg *m);          /* an open notice, on Python's thread */
void kvfs_ahead_deliver(struct kvfs_msg *m);        /* a READ notice, on Python's thread */

/* direct.c, for ahead.c: a READ or WRITE with these flags the alignment rule refuses. */
int kvfs_direct_misaligned(uint32_t flags, uint64_t off, uint64_t size);

/* pycall.c */
void kvfs_call(PyObject *fn, const char *fmt, ...);  /* with the GIL; failures reported */
void kvfs_set_callback(PyObject **slot, PyObject *fn);  /* with the GIL */

#endif
