/* The kernel's FUSE ABI, as the shim reads requests and writes or edits replies.

   The structs and constants come from the system's <linux/fuse.h> (linux-libc-dev). What an
   older header lacks is defined here, each only where it is missing, with the protocol
   version and Linux release that added it. Debian 12's header (Linux 6.1, protocol 7.38)
   lacks FUSE passthrough (7.40): the backing map, its ioctls, the INIT and OPEN flags, and
   the names of two reply fields (accessors below). Headers older than 7.36 (Linux 5.17: the
   INIT reply's flags2) are refused; from 7.36 on, a header has everything else the shim
   uses (the set-id kill flags and FUSE_HANDLE_KILLPRIV_V2 came in 7.33).

   libfuse 3.14 builds its replies from its own copy of these structs, which the shim edits
   in place: the layouts the code depends on are asserted below. */
#ifndef KVFS_FUSE_ABI_H
#define KVFS_FUSE_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <linux/fuse.h>

#if FUSE_KERNEL_MINOR_VERSION < 36
#error "<linux/fuse.h> of FUSE protocol 7.36 (Linux 5.17) or later needed: install a newer linux-libc-dev"
#endif

/* 7.40 (Linux 6.9): FUSE passthrough. */
#ifndef FUSE_PASSTHROUGH
#define FUSE_PASSTHROUGH (1ULL << 37)
#endif
#ifndef FOPEN_PASSTHROUGH
#define FOPEN_PASSTHROUGH (1 << 7)
#endif
#ifndef FUSE_DEV_IOC_BACKING_OPEN
struct fuse_backing_map {
    int32_t fd;
    uint32_t flags;
    uint64_t padding;
};
#define FUSE_DEV_IOC_BACKING_OPEN _IOW(FUSE_DEV_IOC_MAGIC, 1, struct fuse_backing_map)
#define FUSE_DEV_IOC_BACKING_CLOSE _IOW(FUSE_DEV_IOC_MAGIC, 2, uint32_t)
#endif

/* 7.40 (Linux 6.9) named fuse_init_out.max_stack_depth (the first of unused[]) and
   fuse_open_out.backing_id (padding). */
#if FUSE_KERNEL_MINOR_VERSION >= 40
#define KVFS_INIT_OUT_STACK_DEPTH(o) ((o)->max_stack_depth)
#define KVFS_OPEN_OUT_BACKING_ID(o) ((o)->backing_id)
_Static_assert(offsetof(struct fuse_init_out, max_stack_depth) == 36, "max_stack_depth");
_Static_assert(offsetof(struct fuse_open_out, backing_id) == 12, "backing_id");
#else
#define KVFS_INIT_OUT_STACK_DEPTH(o) ((o)->unused[0])
#define KVFS_OPEN_OUT_BACKING_ID(o) ((o)->padding)
_Static_assert(offsetof(struct fuse_init_out, unused) == 36, "max_stack_depth");
_Static_assert(offsetof(struct fuse_open_out, padding) == 12, "backing_id");
#endif

/* The end of what the INIT reply edit writes: libfuse 3.14 sends 64 bytes and fills them up
   to flags2; the stack depth is in what it leaves zero. */
#define KVFS_INIT_OUT_EDITED 40

_Static_assert(sizeof(struct fuse_in_header) == 40, "fuse_in_header");
_Static_assert(sizeof(struct fuse_out_header) == 16, "fuse_out_header");
_Static_assert(offsetof(struct fuse_init_out, flags2) == 32, "fuse_init_out.flags2");
_Static_assert(sizeof(struct fuse_open_out) == 16, "fuse_open_out");
/* What libfuse 3.14 writes before the fuse_open_out of a CREATE reply (protocol 7.9+). */
_Static_assert(sizeof(struct fuse_entry_out) == 128, "fuse_entry_out");
_Static_assert(sizeof(struct fuse_open_in) == 8, "fuse_open_in");
_Static_assert(sizeof(struct fuse_read_in) == 40, "fuse_read_in");
_Static_assert(offsetof(struct fuse_write_in, write_flags) == 20, "fuse_write_in.write_flags");
_Static_assert(offsetof(struct fuse_setattr_in, valid) == 0, "fuse_setattr_in.valid");
_Static_assert(sizeof(struct fuse_getxattr_in) == 8, "fuse_getxattr_in (the name follows)");
_Static_assert(sizeof(struct fuse_backing_map) == 16, "fuse_backing_map");

#endif
