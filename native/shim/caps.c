/* getxattr("security.capability"), which the kernel asks before a passthrough write to an
   inode (to drop file capabilities; once per inode, see FUSE_HANDLE_KILLPRIV_V2 in
   passthrough.c), answered ENODATA here while no file has any security.* xattr (kept by the
   namespace, handed over with set_no_capabilities): one Python request less per file
   written. The name is kvfs.fs.FILE_CAPS, handed over by set_rules. Answered on the FUSE
   thread (pyfuse3's getxattr handler wrapped) or, with the front thread, there. */
#include "kvfs_shim.h"

#include <errno.h>
#include <linux/limits.h>
#include <string.h>

typedef void (*getxattr_t)(fuse_req_t, fuse_ino_t, const char *, size_t);

/* Set before the mount; name_size 0 (until set_rules): no shortcut. */
static char name[XATTR_NAME_MAX + 1];
static size_t name_size = 0;  /* with its NUL, as the request carries it */
/* Written by Python's thread (a first security.* xattr), read by the FUSE and front
   threads: answering ENODATA while it is being set is answering just before. */
static int no_caps = 0;
static getxattr_t pyfuse3_getxattr = NULL;

static int asks_caps(const char *asked, size_t avail) {
    return no_caps && name_size != 0 && avail >= name_size
           && memcmp(asked, name, name_size) == 0;
}

static void caps_getxattr(fuse_req_t req, fuse_ino_t ino, const char *asked, size_t size) {
    if (asks_caps(asked, strlen(asked) + 1)) {
        fuse_reply_err(req, ENODATA);
        return;
    }
    pyfuse3_getxattr(req, ino, asked, size);
}

void kvfs_caps_install(struct fuse_lowlevel_ops *ops) {
    if (ops->getxattr == NULL)
        return;
    pyfuse3_getxattr = ops->getxattr;
    ops->getxattr = caps_getxattr;
}

int kvfs_fast_no_caps(const char *mem, size_t n) {
    const struct fuse_in_header *h = (const struct fuse_in_header *)mem;
    size_t at = sizeof *h + sizeof(struct fuse_getxattr_in);  /* the name follows */
    if (h->opcode != FUSE_GETXATTR || n < at || !asks_caps(mem + at, n - at))
        return 0;
    kvfs_front_reply_error(h->unique, ENODATA);
    return 1;
}

/* -EINVAL if *len* bytes cannot be an xattr name. */
int kvfs_set_caps_name(const char *s, size_t len) {
    if (len == 0 || len > XATTR_NAME_MAX || memchr(s, 0, len) != NULL)
        return -EINVAL;
    memcpy(name, s, len);
    name[len] = 0;
    name_size = len + 1;
    return 0;
}

void kvfs_set_no_caps(int none) {
    no_caps = none;
}
