/* FUSE passthrough (Linux 6.9+), which libfuse 3.14 does not know. fuse_session_mount
   (interpose.c) routes the session's traffic through custom I/O functions
   (fuse_session_custom_io) that are plain read/writev/splice (no splice of requests: see
   setid.c), except that pt_writev edits two kinds of reply on their way to the kernel:
   - the INIT reply (the session's first) asks for FUSE_HANDLE_KILLPRIV_V2 (which libfuse
     3.14 does not know either), and, if passthrough is wanted, for FUSE_PASSTHROUGH with a
     stack depth of 1 (backing files live on tmpfs, depth 0). With the first, clearing
     set-user-ID and set-group-ID on write, truncation and chown is the server's, and the
     kernel says when (setid.c); and it marks the mount SB_NOSEC: before a passthrough write
     the kernel asks getxattr("security.capability") once per inode (then sets S_NOSEC on
     it), not before every write, which made each 4 KiB write of a stdio writer a round trip
     to the daemon (45 us instead of ~2);
   - an OPEN or CREATE reply whose fh was marked with kvfs_pt_mark gets FOPEN_PASSTHROUGH and
     the backing id (fuse_reply_open and fuse_reply_create, interpose.c): the kernel then
     reads and writes that open file straight from the backing file, without a request to
     the daemon.
   All of it runs on the FUSE thread (Python's), which marks a reply and then sends it. */
#include "kvfs_shim.h"

#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

static int wanted = 0;      /* ask for passthrough at INIT */
static int granted = 0;     /* INIT reply went out asking for it */
static int init_seen = 0;
static int dev_fd = -1;
static uint64_t mark_fh = 0;  /* the open reply to mark, and its backing id */
static int32_t mark_id = 0;
static int mark_direct = 0;   /* ... keeping FOPEN_DIRECT_IO: reads and writes still come to
                                 the daemon */
static size_t reply_at = (size_t)-1;  /* where the fuse_open_out sits in iov[1] */

static void edit_init(const struct fuse_out_header *out, struct iovec *arg) {
    struct fuse_init_out *init = (struct fuse_init_out *)arg->iov_base;
    if (out->error != 0 || arg->iov_len < KVFS_INIT_OUT_EDITED || init->major != 7)
        return;
    init->flags |= FUSE_HANDLE_KILLPRIV_V2;
    if (wanted && (init->flags & FUSE_INIT_EXT)) {
        init->flags2 |= (uint32_t)(FUSE_PASSTHROUGH >> 32);
        KVFS_INIT_OUT_STACK_DEPTH(init) = 1;
        granted = 1;
    }
}

static void edit_open(struct fuse_open_out *o) {
    o->open_flags |= FOPEN_PASSTHROUGH;
    if (!mark_direct)
        o->open_flags &= ~FOPEN_DIRECT_IO;  /* it would override passthrough */
    KVFS_OPEN_OUT_BACKING_ID(o) = mark_id;
}

static ssize_t pt_writev(int fd, struct iovec *iov, int count, void *ud) {
    (void)ud;
    if (count >= 2 && iov[0].iov_len >= sizeof(struct fuse_out_header)) {
        const struct fuse_out_header *out = (const struct fuse_out_header *)iov[0].iov_base;
        if (!init_seen) {
            init_seen = 1;
            edit_init(out, &iov[1]);
        } else if (reply_at != (size_t)-1 && out->error == 0 &&
                   iov[1].iov_len >= reply_at + sizeof(struct fuse_open_out)) {
            edit_open((struct fuse_open_out *)((char *)iov[1].iov_base + reply_at));
        }
    }
    return writev(fd, iov, count);
}

static ssize_t pt_read(int fd, void *buf, size_t len, void *ud) {
    (void)ud;
    return read(fd, buf, len);
}

static ssize_t pt_splice_send(int fdin, off_t *offin, int fdout, off_t *offout, size_t len,
                              unsigned int flags, void *ud) {
    (void)ud;
    return splice(fdin, offin, fdout, offout, len, flags);
}

static const struct fuse_custom_io pt_io = {
    .writev = pt_writev,
    .read = pt_read,
    .splice_send = pt_splice_send,
};

void kvfs_pt_attach(struct fuse_session *se, int fd) {
    dev_fd = fd;
    init_seen = 0;
    granted = 0;
    if (fuse_session_custom_io(se, &pt_io, fd) != 0)
        wanted = 0;
}

int kvfs_pt_edit_begin(uint64_t fh, size_t at) {
    if (!mark_id || fh != mark_fh)
        return 0;
    reply_at = at;
    return 1;
}

void kvfs_pt_edit_end(void) {
    reply_at = (size_t)-1;
    mark_id = 0;
}

void kvfs_want_passthrough(int on) {
    wanted = on;
}

int kvfs_backing_open(int fd) {
    struct fuse_backing_map map = { .fd = fd, .flags = 0, .padding = 0 };
    if (!granted || dev_fd < 0)
        return -ENOTSUP;
    int id = ioctl(dev_fd, FUSE_DEV_IOC_BACKING_OPEN, &map);
    return id < 0 ? -errno : id;
}

int kvfs_backing_close(int id) {
    uint32_t u = (uint32_t)id;
    if (dev_fd < 0)
        return -EBADF;
    return ioctl(dev_fd, FUSE_DEV_IOC_BACKING_CLOSE, &u) < 0 ? -errno : 0;
}

void kvfs_pt_mark(uint64_t fh, int32_t id, int direct) {
    mark_fh = fh;
    mark_id = id;
    mark_direct = direct;
}
