/* Set-user-ID and set-group-ID cleared on write, truncation and chown. With
   FUSE_HANDLE_KILLPRIV_V2 (asked for at INIT, see passthrough.c) the server clears them, as
   the kernel does on local filesystems. The kernel flags what needs it: a WRITE and an OPEN
   with O_TRUNC by a caller without CAP_FSETID (FUSE_WRITE_KILL_SUIDGID,
   FUSE_OPEN_KILL_SUIDGID), a SETATTR that truncates by one, or changes the owner or group,
   by anyone (FATTR_KILL_SUIDGID). libfuse 3.14 passes none of these flags on but the last,
   which pyfuse3 drops: fuse_session_process_buf (interpose.c) hands each request in memory
   here as it is dispatched, and the kill handler (set_kill_handler) is called first.

   Every request is read into memory, none left in a pipe by splice (which libfuse does for
   big WRITEs when the filesystem has write_buf): the kill flags of a WRITE are in its
   header. The front thread reads requests into memory anyway. */
#include "kvfs_shim.h"

#include <string.h>

typedef void (*init_t)(void *, struct fuse_conn_info *);

enum { KILL_WRITE, KILL_TRUNCATE, KILL_CHOWN };
static PyObject *kill_fn = NULL;
static int kill_why[3];  /* what the handler is told for each (kvfs.fs.Kill) */
static init_t pyfuse3_init = NULL;

static void setid_init(void *userdata, struct fuse_conn_info *conn) {
    if (pyfuse3_init != NULL)
        pyfuse3_init(userdata, conn);
    conn->want &= ~FUSE_CAP_SPLICE_READ;
}

void kvfs_setid_install(struct fuse_lowlevel_ops *ops) {
    pyfuse3_init = ops->init;
    ops->init = setid_init;
}

/* The word at *at* of the request's argument (after the header), if it has one. */
static int arg_u32(const char *mem, size_t n, size_t at, uint32_t *v) {
    if (n < sizeof(struct fuse_in_header) + at + sizeof *v)
        return 0;
    memcpy(v, mem + sizeof(struct fuse_in_header) + at, sizeof *v);
    return 1;
}

void kvfs_setid_check(const struct fuse_buf *buf) {
    if (kill_fn == NULL || (buf->flags & FUSE_BUF_IS_FD)
            || buf->size < sizeof(struct fuse_in_header))
        return;
    const char *mem = (const char *)buf->mem;
    const struct fuse_in_header *h = (const struct fuse_in_header *)mem;
    uint32_t v;
    int why;
    if (h->opcode == FUSE_WRITE) {
        if (!arg_u32(mem, buf->size, offsetof(struct fuse_write_in, write_flags), &v)
                || !(v & FUSE_WRITE_KILL_SUIDGID))
            return;
        why = KILL_WRITE;
    } else if (h->opcode == FUSE_OPEN) {
        if (!arg_u32(mem, buf->size, offsetof(struct fuse_open_in, open_flags), &v)
                || !(v & FUSE_OPEN_KILL_SUIDGID))
            return;
        why = KILL_WRITE;
    } else if (h->opcode == FUSE_SETATTR) {
        if (!arg_u32(mem, buf->size, offsetof(struct fuse_setattr_in, valid), &v)
                || !(v & FATTR_KILL_SUIDGID))
            return;
        why = v & (FATTR_UID | FATTR_GID) ? KILL_CHOWN : KILL_TRUNCATE;
    } else {
        return;
    }
    kvfs_call(kill_fn, "(KIIIi)", (unsigned long long)h->nodeid, (unsigned int)h->uid,
              (unsigned int)h->gid, (unsigned int)h->pid, kill_why[why]);
}

/* *write*, *truncate*, *chown*: what the handler is told for each reason (Python's). */
void kvfs_set_kill_handler(PyObject *fn, int write, int truncate, int chown) {
    kill_why[KILL_WRITE] = write;
    kill_why[KILL_TRUNCATE] = truncate;
    kill_why[KILL_CHOWN] = chown;
    kvfs_set_callback(&kill_fn, fn);
}
