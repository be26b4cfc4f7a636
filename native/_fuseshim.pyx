# cython: language_level=3
"""What pyfuse3 lacks, added underneath it: fallocate(2), FUSE passthrough, and big copies
without the GIL.

Loaded with RTLD_GLOBAL before pyfuse3 (see kvfs/daemon.py), this module's definitions of
libfuse functions are found before libfuse's own when pyfuse3 calls them. The C is in
native/shim/, one file per concern (native/shim/kvfs_shim.h lists them):

- `fuse_session_new` (interpose.c): pyfuse3 3.5 registers no `fallocate` handler, so the
  kernel would answer EOPNOTSUPP to every fallocate() on the mount. This copy of the call
  adds one to pyfuse3's operation table (fallocate.c: it calls a Python function
  synchronously on the FUSE thread) and hands the table to libfuse's own `fuse_session_new`.
- pyfuse3's `write_buf` handler is wrapped (write.c): a write whose chunks all get fresh
  content (an engine writing a block) is copied by libfuse straight from the request into
  the file's DRAM file, instead of into a bytes object that kvfs then copies again
  (kvfs.fs.Operations.write_plan / write_done). Every other write goes to pyfuse3's handler
  unchanged.
- `fuse_session_process_buf` (setid.c): the flags by which the kernel asks the server to
  clear set-user-ID and set-group-ID (which neither libfuse nor pyfuse3 pass on) are read
  from each request before it is dispatched; requests are never spliced, so that each is in
  memory to be read.
- pyfuse3's `read` handler and the write path check O_DIRECT alignment against the flags
  each READ and WRITE carries (direct.c: the descriptor's flags now, so O_DIRECT set later
  with fcntl(F_SETFL) counts too) and answer EINVAL to unaligned offsets and lengths, as
  ext4 does.
- pyfuse3's `getxattr` handler answers getxattr("security.capability") ENODATA itself while
  no file has a security.* xattr (caps.c).
- `fuse_reply_buf` and `fuse_buf_copy` (interpose.c): pyfuse3 replies to a read (copying up
  to 1 MiB into the kernel) and copies a write's data out of libfuse's buffer while holding
  the GIL, so the worker threads that decode and compress chunks stall behind every large
  request. These wrappers release the GIL around large copies. That is safe: the memory
  being copied is pinned by the caller (a buffer export or a fresh bytes object nobody else
  can see), no Python object is touched, and the trio thread that could change a DRAM slot
  is the one blocked in the copy.
- `fuse_session_mount`, `fuse_reply_open` and `fuse_reply_create`: FUSE passthrough (Linux
  6.9+; libfuse 3.14 does not know it; passthrough.c).
- `fuse_session_fd` and `fuse_session_receive_buf`: the front thread (front.c), which reads
  the FUSE device itself and answers opens of files in the fast-open table (hot.c) and
  READs from chunks read ahead (ahead.c) without the trio thread.

The rules kvfs.fs applies too (O_DIRECT alignment, the file capabilities' name, the handles
the front thread gives out, why set-id bits are cleared, how many files the fast-open table
holds) are kvfs.fs's, handed over before the mount (`set_rules`, `set_kill_handler`,
`hot_limit`).

If the interposition does not happen, `active()` stays False and kvfs behaves as before
(fallocate answers EOPNOTSUPP; engines fall back to ftruncate; copies keep the GIL; every
read comes to the daemon).
"""

cdef extern from "kvfs_shim.h":
    int kvfs_shim_active()
    void kvfs_set_fallocate_handler(object fn)
    void kvfs_fallocate_reply(unsigned long long req, int err)
    void kvfs_set_write_handlers(object plan, object done)
    void kvfs_set_direct_align(unsigned int align)
    int kvfs_set_caps_name(const char *name, size_t len)
    void kvfs_set_no_caps(int none)
    void kvfs_set_kill_handler(object fn, int write, int truncate, int chown)
    void kvfs_want_passthrough(int on)
    int kvfs_backing_open(int fd)
    int kvfs_backing_close(int id)
    void kvfs_pt_mark(unsigned long long fh, int id, int direct)
    void kvfs_want_front_thread(int on)
    int kvfs_front_running()
    void kvfs_set_first_fast_fh(unsigned long long fh)
    int kvfs_set_hot_limit(int n)
    int kvfs_hot_add(unsigned long long ino, int id)
    unsigned long long kvfs_hot_pending(unsigned long long ino, int id)
    int kvfs_hot_ready(unsigned long long ino, unsigned long long ticket) nogil
    void kvfs_hot_revoke(unsigned long long ino)
    unsigned long long kvfs_parked_count()
    void kvfs_set_opened_handler(object fn)
    void kvfs_set_read_handler(object fn, unsigned long long chunk_size)
    int kvfs_ahead_offer(unsigned long long ino, unsigned long long chunk, const char *data,
                         unsigned int length)
    void kvfs_ahead_withdraw(unsigned long long ino, long long chunk) nogil
    unsigned int kvfs_ahead_take_quiet(unsigned int *hist)


def set_rules(*, unsigned int direct_align, bytes file_caps, unsigned long long first_fast_fh
              ) -> None:
    """The rules kvfs.fs applies, for the shim to apply too; call before pyfuse3.init.
    *direct_align*: the alignment of O_DIRECT offsets and lengths (a power of two).
    *file_caps*: the name of the xattr holding file capabilities. *first_fast_fh*: the first
    handle the front thread gives out (kvfs.fs's own stay below it). Until this is called,
    no O_DIRECT alignment is checked in the shim, getxattr of file capabilities always goes
    to Python, and no open is answered by the front thread."""
    if direct_align == 0 or direct_align & (direct_align - 1):
        raise ValueError(f"direct_align must be a power of two, not {direct_align}")
    if first_fast_fh == 0:
        raise ValueError("first_fast_fh must be above 0")
    if kvfs_set_caps_name(file_caps, len(file_caps)) != 0:
        raise ValueError(f"not an xattr name: {file_caps!r}")
    kvfs_set_direct_align(direct_align)
    kvfs_set_first_fast_fh(first_fast_fh)


def set_fallocate_handler(handler) -> None:
    """handler(ino, mode, offset, length, fh, req) -> errno (0 for success), or -1 if it
    will answer *req* later with `fallocate_reply`; runs on the FUSE thread with the GIL
    held and must not block."""
    kvfs_set_fallocate_handler(handler)


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
    return kvfs_shim_active() != 0


def set_kill_handler(handler, *, int write, int truncate, int chown) -> None:
    """handler(ino, uid, gid, pid, why): the request about to be dispatched asks the server
    to clear the set-user-ID and set-group-ID bits of *ino*, for the caller with those ids;
    *why* is *write* for a write, or an open with O_TRUNC, by a caller without CAP_FSETID,
    *truncate* for a truncation by one, *chown* for a change of owner or group, by anyone.
    Runs on the FUSE thread with the GIL held, before the request's own handler; must not
    block or raise."""
    kvfs_set_kill_handler(handler, write, truncate, chown)


def want_passthrough(on: bool) -> None:
    """Ask the kernel for FUSE passthrough at the next mount (call before pyfuse3.init)."""
    kvfs_want_passthrough(1 if on else 0)


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
    kvfs_set_no_caps(1 if none else 0)


def want_front_thread(bint on) -> None:
    """Read the FUSE device on a thread of this module's own from the next mount on (call
    before pyfuse3.init): opens of inodes in the fast-open table are then answered there."""
    kvfs_want_front_thread(1 if on else 0)


def front_thread() -> bool:
    """True once the mount's requests are read by the front thread."""
    return kvfs_front_running() != 0


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
    """At most *n* files in the table (at least 1; kvfs.config.FAST_OPEN_FILES_MAX bounds
    what kvfs asks), which grows to hold them; returns the limit set. Until it is called,
    the table holds none."""
    cdef int r = kvfs_set_hot_limit(n)
    if r < 0:
        raise MemoryError(f"no room for a fast-open table of {n} files")
    return r


def hot_revoke(unsigned long long ino) -> None:
    """No more opens of *ino* are answered by the front thread; those it answered are
    delivered to the opened handler before this returns."""
    kvfs_hot_revoke(ino)


def parked_opens() -> int:
    """Opens of pending files that waited in the front thread for their staging."""
    return kvfs_parked_count()


def set_read_handler(handler, unsigned long long chunk_size) -> None:
    """handler(ino, fh, off, size, pid, us): the front thread answered a READ of *size*
    bytes at *off* from chunks offered with `ahead_offer` (*us*: microseconds from the
    request to the reply) that was the first from a chunk, began at a chunk's first byte or
    reached a chunk's end; the others are only counted (`ahead_quiet`). Runs on the FUSE thread with the GIL held, in the order of the
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


def ahead_quiet() -> tuple[int, list[int]]:
    """The READs the front thread answered without calling the read handler since the last
    call: how many, and their latencies (counts by min(23, microseconds.bit_length()))."""
    cdef unsigned int hist[24]
    n = kvfs_ahead_take_quiet(hist)
    return n, [hist[i] for i in range(24)]
