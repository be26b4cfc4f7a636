/* O_DIRECT alignment, checked from the flags the kernel sends with every READ and WRITE (the
   descriptor's current ones: O_DIRECT set later with fcntl(F_SETFL) counts, which kvfs,
   knowing only the flags of the open, would miss). Unaligned offsets or lengths get EINVAL,
   as on ext4. The alignment is kvfs.fs.DIRECT_IO_ALIGN, handed over by set_rules. */
#include "kvfs_shim.h"

#include <errno.h>
#include <fcntl.h>

typedef void (*read_t)(fuse_req_t, fuse_ino_t, size_t, off_t, struct fuse_file_info *);
typedef void (*write_buf_t)(fuse_req_t, fuse_ino_t, struct fuse_bufvec *, off_t,
                            struct fuse_file_info *);

/* A power of two; 0 (until set_rules): nothing is checked here. Set before the mount, read
   by the FUSE and front threads. */
static unsigned int align = 0;
static read_t next_read = NULL;
static write_buf_t next_write_buf = NULL;

int kvfs_direct_misaligned(uint32_t flags, uint64_t off, uint64_t size) {
    return (flags & O_DIRECT) && align != 0 && ((off | size) & (align - 1));
}

static int misaligned(const struct fuse_file_info *fi, off_t off, size_t size) {
    return fi != NULL && !fi->writepage
           && kvfs_direct_misaligned((uint32_t)fi->flags, (uint64_t)off, size);
}

static void direct_read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off,
                        struct fuse_file_info *fi) {
    if (misaligned(fi, off, size)) {
        fuse_reply_err(req, EINVAL);
        return;
    }
    next_read(req, ino, size, off, fi);
}

static void direct_write_buf(fuse_req_t req, fuse_ino_t ino, struct fuse_bufvec *bufv,
                             off_t off, struct fuse_file_info *fi) {
    if (misaligned(fi, off, fuse_buf_size(bufv))) {
        fuse_reply_err(req, EINVAL);
        return;
    }
    next_write_buf(req, ino, bufv, off, fi);
}

void kvfs_direct_install(struct fuse_lowlevel_ops *ops) {
    if (ops->read != NULL) {
        next_read = ops->read;
        ops->read = direct_read;
    }
    if (ops->write_buf != NULL) {
        next_write_buf = ops->write_buf;
        ops->write_buf = direct_write_buf;
    }
}

void kvfs_set_direct_align(unsigned int a) {
    align = a;
}
