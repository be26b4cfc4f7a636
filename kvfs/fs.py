"""FUSE operations: translate kernel requests into namespace and chunk-store calls.

No policy lives here: where bytes go is the store's and tiering's business. This is the only
module that raises `pyfuse3.FUSEError`; everything below raises exceptions that say what
happened, and `_errors` maps them to the errno a local filesystem (tmpfs, ext4) would return.

Attributes of `Operations`:
    ns        Namespace: inodes, directory entries, xattrs
    store     ChunkStore: file bytes
    control   Control: answers the `user.kvfs.*` virtual xattrs used by kvfsctl
    handles   open file handles (fh -> Handle)
    dirs      open directory handles (fh -> snapshot of entries)
    shim      kvfs._fuseshim when FUSE passthrough may be used (set by the daemon), else None
    backing   inodes in passthrough mode (ino -> [backing id, opens carrying it])
    writers   inodes the kernel writes straight into their DRAM file (ino -> writer handles)
    stream_policy  which new files may be written so (tiering.StreamingPolicy)
    requests  FUSE requests answered by a handler so far (kvfs.collector waits for a pause)

FUSE passthrough (Linux 6.9+): an open for reading of a file whose chunks are all in DRAM
(and check out) is answered with the backing id of its DRAM file, and the kernel serves its
reads (and mmap) from tmpfs without asking the daemon. The kernel allows one backing file per
inode while any such open lives, and refuses (EIO) an open of that inode without it; so while
an inode is in passthrough mode every open of it carries its backing id, and the ones that
must not bypass the daemon (writers, O_DIRECT, a file that does not check out) also carry
direct_io, which sends their reads and writes here as before. The store keeps the DRAM copies
of such a file where they are (`pin_passthrough`) until its last passthrough open is released.

Writers too: a file created (or truncated to nothing by O_TRUNC) by an open for writing, with
nothing else open and room to spare, is written by the kernel straight into its DRAM file
(`ChunkStore.start_stream`). kvfs sees none of those writes; until the last writer closes,
every open of the file reads and writes the DRAM file too (O_DIRECT ones included, so their
alignment is not checked), its size is the DRAM file's, and an fsync takes what is there as
the file's chunks and makes them durable. After the last writer's close the store takes
the DRAM file's contents as the file (`take_stream`), as soon as no request waits
(`run_takes`); until then the file is still one the kernel writes.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import functools
import itertools
import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyfuse3
import trio
import trio.testing

from kvfs.config import FAST_OPEN_FILES_MAX
from kvfs.faults import CrashPoints
from kvfs.namespace import NAME_MAX, Inode, Namespace, NamespaceError
from kvfs.store.chunkstore import ChunkError, ChunkStore, NoSpace
from kvfs.tiering import StreamingPolicy

log = logging.getLogger(__name__)

# Every change goes through this kernel, which invalidates what it cached itself; kvfs only
# changes things behind its back on cache-mode eviction, and then it invalidates explicitly.
# Long timeouts spare engines a round trip per stat() and per negative lookup.
ATTR_TIMEOUT = 60.0
ENTRY_TIMEOUT = 60.0
# Alignment ext4 demands of O_DIRECT offsets and lengths (the logical block size).
DIRECT_IO_ALIGN = 512
MAX_FILE_SIZE = 1 << 50
XATTR_SIZE_MAX = 65536
BLOCK_SIZE = 4096  # st_blksize and f_bsize: what stdio and O_DIRECT users align to
CONTROL_PREFIX = b"user.kvfs."
FILE_CAPS = b"security.capability"
# Extended attribute namespaces kept (system.* would be ACLs, which kvfs does not have); any
# other name is EOPNOTSUPP, as on tmpfs and ext4 (the kernel passes every name to FUSE).
XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
# A file the kernel wrote is taken (hashed, recorded) after its last close, when no request
# is waiting (see Operations.run_takes); at most TAKE_BACKLOG files wait, none over TAKE_WAIT_S.
TAKE_BACKLOG = 4
TAKE_WAIT_S = 0.02
# How often a file whose DRAM file a shared mapping still writes after its last close is
# taken again (`Operations.watch_mapped`).
MAPPED_CHECK_S = 5.0
# Files of at most this many chunks go to the front thread's table (a staged chunk checks
# its whole file; bigger files are read through the daemon anyway).
FAST_OPEN_MAX_CHUNKS = 16
# Handles of opens the front thread answers start here; those `_open` gives out count up
# from 1, far below.
FAST_OPEN_FIRST_FH = 1 << 48


class Kill(enum.IntEnum):
    """Why the kernel asks kvfs to clear a file's set-user-ID and set-group-ID bits (the
    shim's kill handler, kvfs._fuseshim.set_kill_handler)."""
    WRITE = 0  # a write, or an open with O_TRUNC, by a caller without CAP_FSETID
    TRUNCATE = 1  # a truncation by such a caller
    CHOWN = 2  # a change of owner or group, by anyone


def _groups_of(pid: int) -> frozenset[int]:
    """The supplementary groups of process *pid* (a FUSE request names only its caller's
    fsuid and fsgid); none if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        pass
    return frozenset()


@dataclass
class _PendingOpen:
    """The StageWatch of a file entered pending in the front thread's table."""
    ops: Operations
    front: object  # the shim module (`ops.front` may be cleared meanwhile)
    ino: int
    ticket: int

    def ready(self) -> None:
        if self.front.hot_ready(self.ino, self.ticket):  # False: revoked meanwhile
            self.ops.fast_open_staged += 1

    def done(self, installed: bool) -> None:
        if self.ops.pending_hot.get(self.ino) != self.ticket:
            return  # revoked meanwhile
        del self.ops.pending_hot[self.ino]
        if not installed:
            self.ops.revoke(self.ino)


@dataclass
class Handle:
    ino: int
    flags: int
    pid: int = 0
    backed: bool = False  # carries its inode's passthrough backing id
    via_daemon: bool = False  # its reads and writes come here (direct_io)
    streams: bool = False  # writes a file the kernel writes straight into its DRAM file
    # Chunks (chunk, seq) whose checksum this handle already verified: a sequence of small
    # reads checks each chunk once, not once per read.
    verified: set = field(default_factory=set)

    @property
    def direct(self) -> bool:
        return bool(self.flags & os.O_DIRECT)


def _errors(fn):
    """Map internal exceptions to FUSEError at the boundary, with one log line."""

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        self.requests += 1
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except NamespaceError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except NoSpace:
            raise pyfuse3.FUSEError(errno.ENOSPC) from None
        except ChunkError as exc:
            log.error("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except OSError as exc:
            log.error("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class Operations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, ns: Namespace, store: ChunkStore, control, readahead, *,
                 cache_mode: bool, evictor=None, crash: CrashPoints | None = None) -> None:
        super().__init__()
        self.crash = crash or CrashPoints()
        self.ns = ns
        self.store = store
        self.readahead = readahead
        self.control = control
        self.cache_mode = cache_mode
        self.evictor = evictor
        self.handles: dict[int, Handle] = {}
        self.requests = 0
        self.dirs: dict[int, list[tuple[bytes, int]]] = {}
        self._fh = itertools.count(1)
        self.shim = None
        self.backing: dict[int, list[int]] = {}
        self.writers: dict[int, int] = {}
        # Of those, adopted files with no writer left whose DRAM file a shared mapping may
        # still write (`_end_writing`, `watch_mapped`).
        self.mapped: set[int] = set()
        self.mount_dev: int | None = None  # the mount's st_dev (set by the daemon)
        self._finishing: dict[int, trio.Event] = {}
        self._opening: dict[int, int] = {}  # ino -> opens under way (_opening_file)
        # Unlinked files whose data is freed but which the kernel still knows (see _open).
        self._data_freed: set[int] = set()
        self._pending_takes: dict[int, None] = {}
        self._take_wakeup = trio.Event()
        self.stream_policy = StreamingPolicy()
        # Files whose read-only opens the shim's front thread answers (see "Opens answered
        # by the front thread"); *front* is the shim when the daemon runs that thread.
        self.front = None
        # The files in that table, the one opened least recently first: when the table is
        # full, it makes room for a file just found ready.
        self.hot: OrderedDict[int, None] = OrderedDict()
        self.hot_capacity = FAST_OPEN_FILES_MAX
        # Those entered pending while a prefetch stages them (`stage_watch`) -> ticket.
        self.pending_hot: dict[int, int] = {}
        self.fast_open_staged = 0  # pending entries made ready by their prefetch
        self.fast_opens = 0
        # Starts a task in the daemon's nursery (set by the assembly while it runs), and
        # answers a fallocate request later (the shim's, set by the daemon).
        self.spawn: Callable | None = None
        self.reply_fallocate: Callable[[int, int], None] | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _parent(self, ino: int) -> int | None:
        """The directory holding *ino* (its first name), or None if it has none."""
        names = self.ns.names_of(ino)
        return min(names)[0] if names else None

    def _size(self, inode: Inode) -> int:
        """*inode*'s size now: its DRAM file's while the kernel writes it without us. Its
        recorded size (`inode.size`, what lmdb has) is that of its last take: saved with
        anything else, a size its chunks do not reach yet would read as zeros after a
        crash that loses DRAM."""
        if inode.ino in self.writers:
            return self.store.stream_size(inode.ino)
        return inode.size

    async def _recorded(self, node: Inode) -> None:
        """Take what the kernel wrote so far into *node*, if it writes it: a change of its
        size must start from its bytes recorded, as an fsync records them."""
        if node.ino in self.writers and node.ino not in self._finishing:
            await self.store.take_stream(node.ino, done=False, on_commit=self._sized(node))

    def _attr(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = inode.mode
        a.st_nlink = inode.nlink
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
        a.st_size = self._size(inode)
        a.st_blksize = BLOCK_SIZE
        held = self.store.blocks_bytes(inode.ino)
        if inode.ino in self.writers:  # what the kernel wrote may not be counted yet
            held = max(held, self.store.stream_blocks(inode.ino))
        a.st_blocks = (held + 511) // 512
        a.st_atime_ns = inode.atime_ns
        a.st_mtime_ns = inode.mtime_ns
        a.st_ctime_ns = inode.ctime_ns
        return a

    def _entry(self, inode: Inode) -> pyfuse3.EntryAttributes:
        inode.lookups += 1
        return self._attr(inode)

    def _maybe_free(self, inode: Inode) -> None:
        """Release an inode's data once nothing names or holds it, and the inode itself once
        the kernel has forgotten it too."""
        if inode.nlink == 0:
            self.revoke(inode.ino)  # opens the front thread answered count as opens
        if (inode.nlink > 0 or inode.opens > 0 or inode.ino in self._pending_takes
                or inode.ino in self._finishing  # the take's end frees it (_take_now)
                or inode.ino in self._opening):  # so does the open's (_opening_file)
            return
        if inode.is_reg:
            if inode.ino in self.mapped:  # a mapping may outlive the file: nothing to take
                self.mapped.discard(inode.ino)
                del self.writers[inode.ino]
                self.store.end_stream(inode.ino)
            self.readahead.forgotten(inode.ino)
            self.store.delete_file(inode.ino, inode.size)
            if inode.size:
                inode.size = 0
        if self.evictor is not None:
            self.evictor.forget(inode.ino)
        if inode.lookups <= 0:
            self._data_freed.discard(inode.ino)
            self.ns.forget_inode(inode)
        elif inode.is_reg:
            self._data_freed.add(inode.ino)  # an OPEN already on its way finds it gone
            self.crash.reached("freed")  # (lmdb keeps the inode, unnamed, until its FORGET)

    async def _space_retry(self, op, need: int):
        """Run *op*; in cache mode, evict cold files and retry when the store is full."""
        while True:
            try:
                return await op()
            except NoSpace:
                if not self.cache_mode or self.evictor is None or not self.evictor.evict(need):
                    raise

    # -- lookup and attributes -------------------------------------------------------------
    @_errors
    async def lookup(self, parent_inode, name, ctx=None):
        ino = self.ns.lookup(parent_inode, name)
        if ino is None:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0  # cached negative entry: engines probe for absent blocks a lot
            a.entry_timeout = ENTRY_TIMEOUT
            return a
        return self._entry(self.ns.get(ino))

    @_errors
    async def forget(self, inode_list):
        for ino, nlookup in inode_list:
            inode = self.ns.inodes.get(ino)
            if inode is None:
                continue
            inode.lookups -= nlookup
            if inode.nlink == 0:
                self._maybe_free(inode)

    @_errors
    async def getattr(self, inode, ctx=None):
        return self._attr(self.ns.get(inode))

    @_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        await self._taken(inode)
        node = self.ns.get(inode)
        if not (fields.update_size or fields.update_mode or fields.update_uid
                or fields.update_gid or fields.update_atime or fields.update_mtime
                or fields.update_ctime):
            self._remove_privs(node, ctx)
        if fields.update_size:
            self.revoke(inode)
            if not node.is_reg:
                raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            if attr.st_size > MAX_FILE_SIZE:
                raise pyfuse3.FUSEError(errno.EFBIG)
            await self._recorded(node)

        def apply() -> None:
            """Every attribute asked for, saved in one commit (a truncation's own)."""
            now = time.time_ns()
            if fields.update_size:
                node.resize(attr.st_size, holes=attr.st_size > node.size)
                node.mtime_ns = now
            if fields.update_mode:
                node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
            if fields.update_uid:
                node.uid = attr.st_uid
            if fields.update_gid:
                node.gid = attr.st_gid
            if fields.update_atime:
                node.atime_ns = attr.st_atime_ns
            if fields.update_mtime:
                node.mtime_ns = attr.st_mtime_ns
            node.ctime_ns = attr.st_ctime_ns if fields.update_ctime else now
            self.ns.save(node)

        if fields.update_size and attr.st_size < node.size:
            await self.store.truncate(inode, node.size, attr.st_size, on_commit=apply)
            self.crash.reached("truncated")
        else:
            if fields.update_size and attr.st_size > node.size:
                self.store.resized(inode, attr.st_size)
            apply()
        return self._attr(node)

    # -- set-user-ID and set-group-ID -------------------------------------------------------
    # Cleared as on a local filesystem, which the kernel leaves to kvfs (the shim asks for
    # FUSE_HANDLE_KILLPRIV_V2): by a write or a truncation whose caller lacks CAP_FSETID,
    # and by any change of owner or group. Set-group-ID without group execute (the file does
    # not run with the group's id) goes only for a caller outside the file's group, and not
    # for one with CAP_FSETID (root, here) changing its owner.
    def kill_suidgid(self, ino: int, uid: int, gid: int, pid: int, why: int) -> None:
        """The kernel asks for it in the request the shim is about to dispatch (on the FUSE
        thread, before the request's own handler)."""
        try:
            node = self.ns.inodes.get(ino)
            if node is None or node.is_dir:
                return
            mode = self._setid_cleared(node, gid, pid, capable=why == Kill.CHOWN and uid == 0)
            if mode == node.mode:
                return
            node.mode = mode
            node.ctime_ns = time.time_ns()
            self.ns.save(node)
            if why == Kill.WRITE:  # (a SETATTR's reply carries the new mode)
                with contextlib.suppress(OSError):  # ENOENT: the kernel has no copy
                    pyfuse3.invalidate_inode(ino, attr_only=True)
        except Exception:
            log.exception("clearing set-user-ID and set-group-ID of inode %d", ino)

    @staticmethod
    def _setid_cleared(node: Inode, gid: int, pid: int, capable: bool) -> int:
        """*node*'s mode without the set-id bits that go for the caller (fsgid *gid*)."""
        mode = node.mode & ~stat.S_ISUID
        if mode & stat.S_ISGID and (mode & stat.S_IXGRP or not capable and node.gid != gid
                                    and node.gid not in _groups_of(pid)):
            mode &= ~stat.S_ISGID
        return mode

    def _remove_privs(self, node: Inode, ctx) -> None:
        """A SETATTR with nothing to set. The kernel sends one, having taken out the bits it
        asks to clear, for chown(f, -1, -1), and for its file_remove_privs before a write it
        makes without kvfs (passthrough) by a writer without CAP_FSETID. Either clears what
        a chown would. A caller neither root nor the owner may not chown (EPERM, as on
        tmpfs, if a bit would go): while the file is open for writing, it is taken for the
        writer."""
        if node.is_dir:
            return
        mode = self._setid_cleared(node, ctx.gid, ctx.pid, capable=ctx.uid == 0)
        if mode == node.mode:
            return
        if ctx.uid not in (0, node.uid) and not any(
                h.ino == node.ino and h.flags & os.O_ACCMODE != os.O_RDONLY
                for h in self.handles.values()):
            raise pyfuse3.FUSEError(errno.EPERM)
        node.mode = mode

    @_errors
    async def readlink(self, inode, ctx):
        target = self.ns.symlinks.get(inode)
        if target is None:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return target

    # -- namespace changes -----------------------------------------------------------------
    @_errors
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        self.store.check_room()
        return self._entry(self.ns.create(parent_inode, name, mode & ~ctx.umask, ctx.uid,
                                          ctx.gid, rdev=rdev))

    @_errors
    async def mkdir(self, parent_inode, name, mode, ctx):
        self.store.check_room()
        mode = stat.S_IFDIR | (mode & ~ctx.umask & 0o7777)
        return self._entry(self.ns.create(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_errors
    async def symlink(self, parent_inode, name, target, ctx):
        self.store.check_room()
        if len(target) > 4095:
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        return self._entry(self.ns.create(parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid,
                                          ctx.gid, target=target))

    @_errors
    async def link(self, inode, new_parent_inode, new_name, ctx):
        self.store.check_room()
        return self._entry(self.ns.link(inode, new_parent_inode, new_name))

    @_errors
    async def unlink(self, parent_inode, name, ctx):
        self._maybe_free(self.ns.remove(parent_inode, name, want_dir=False))

    @_errors
    async def rmdir(self, parent_inode, name, ctx):
        self._maybe_free(self.ns.remove(parent_inode, name, want_dir=True))

    @_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        replaced = self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)
        if replaced is not None:
            self._maybe_free(replaced)

    # -- files -----------------------------------------------------------------------------
    def _open_handle(self, inode: Inode, flags: int, pid: int,
                     mode: tuple[int, bool, bool] | None = None) -> pyfuse3.FileInfo:
        """A new handle; *mode* (backing id, direct, streams) from `_passthrough_mode` marks
        its open reply for passthrough."""
        fh = next(self._fh)
        self._add_handle(fh, inode, Handle(inode.ino, flags, pid, backed=mode is not None,
                                           streams=mode is not None and mode[2],
                                           via_daemon=mode is None or mode[1]))
        if mode is not None:
            self.shim.mark_passthrough(fh, mode[0], mode[1])
        # direct_io: every read and write reaches kvfs in requests of up to 1 MiB (twice the
        # throughput of page-cache-sized 128 KiB requests), and the page cache never holds a
        # stale copy. mmap(MAP_PRIVATE) still works through the page cache. (A passthrough
        # open without direct_io is read by the kernel from the DRAM file instead.)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    def _add_handle(self, fh: int, inode: Inode, h: Handle) -> None:
        self.handles[fh] = h
        inode.opens += 1
        if self.evictor is not None:
            self.evictor.touch(inode.ino)

    async def _passthrough_mode(self, node: Inode, flags: int) -> tuple[int, bool, bool] | None:
        """(backing id, direct_io, streams) for a new open of *node*, or None for an ordinary
        open. The open is then counted as one carrying the id (and, if *streams*, as one of
        the file's writers); no await may come between this and `_open_handle`."""
        if self.shim is None or not node.is_reg:
            return None
        ino = node.ino
        writer = flags & os.O_ACCMODE != os.O_RDONLY
        if ino in self.writers:  # everything goes to the DRAM file while the kernel writes it
            return self._join_writing(node, writer)
        if (expected := self._stream_size(node, flags, self._parent(ino))) is not None:
            return self._start_writing(ino, expected)
        if writer:
            # An open carrying the backing id can be mmap()ed shared and writable, and such a
            # mapping writes the DRAM file itself, behind kvfs's back. The front thread's
            # entry holds the id: without it (and no reader holding it) the open is an
            # ordinary one, whose shared mappings are refused (ENODEV). While readers hold
            # it, this open must carry it too: the file becomes one the kernel writes.
            self.revoke(ino)
            if ino in self.backing and (adopted := self._adopt_writer(node, flags)) is not None:
                return adopted
        reader = not writer and not flags & os.O_DIRECT
        # a reader of a file on NVMe: bring it into DRAM first, the kernel reads it from there
        staged = await self.store.stage_file(ino, node.size) if reader else -1
        ready = staged >= 0 and await self.store.passthrough_ready(ino, node.size)
        b = self.backing.get(ino)  # looked up after the awaits: it may have changed
        if b is None:
            if not ready:
                return None
            backing_id = self._backing_open(self.store.pin_passthrough(ino, node.size,
                                                                       from_nvme=staged))
            if backing_id is None:
                self.store.unpin_passthrough(ino)
                return None
            b = self.backing[ino] = [backing_id, 0]
        else:
            self.store.pin_passthrough(ino, node.size, reads=ready, from_nvme=max(staged, 0))
        b[1] += 1
        return b[0], not ready, False

    def _stream_size(self, node: Inode, flags: int, parent: int | None) -> int | None:
        """Should the kernel write this open's bytes straight into the DRAM file? Only for a
        write-only open (O_RDWR files are worked on, and must stay movable while open; not
        O_DIRECT) of a file with nothing in it and nothing else open, in a directory whose
        files have been small enough to fit (tiering.StreamingPolicy). Returns the size the
        file is expected to reach if so, else None."""
        if (self.shim is None or flags & os.O_ACCMODE != os.O_WRONLY or flags & os.O_DIRECT
                or node.size or node.opens or node.ino in self.backing or parent is None):
            return None
        expected = self.stream_policy.expected(parent)
        return expected if expected is not None and self.store.can_stream(expected) else None

    def _start_writing(self, ino: int, expected: int) -> tuple[int, bool, bool] | None:
        """The first writer of a file the kernel writes straight into its DRAM file."""
        backing_id = self._backing_open(self.store.start_stream(ino, expected))
        if backing_id is None:
            self.store.end_stream(ino)
            return None
        self.store.pin_passthrough(ino, 0, reads=False)
        self.backing[ino] = [backing_id, 1]
        self.writers[ino] = 1
        return backing_id, False, True

    def _adopt_writer(self, node: Inode, flags: int) -> tuple[int, bool, bool] | None:
        """A writable open of a file in passthrough mode: the kernel writes the file's DRAM
        file from now on, as for a new file (`_start_writing`), and kvfs takes its bytes at
        the last writer's close. Not for O_DIRECT opens (their alignment rule), nor while an
        open of the file reads or writes through kvfs, whose checks would meet bytes the
        kernel changed: such an open carries the id with direct_io (docs/DESIGN.md)."""
        ino = node.ino
        if flags & os.O_DIRECT or any(h.via_daemon for h in self.handles.values()
                                      if h.ino == ino):
            return None
        if self.store.stream_size(ino) != node.size:  # the file's size becomes its DRAM file's
            return None
        if not self.store.adopt_stream(ino):
            return None
        self.writers[ino] = 0
        return self._join_writing(node, writer=True)

    def _join_writing(self, node: Inode, writer: bool) -> tuple[int, bool, bool] | None:
        """One more open of a file the kernel writes: its DRAM file, in plain passthrough
        (a *writer* is counted as one of the file's writers)."""
        ino = node.ino
        fd = self.store.pin_passthrough(ino, node.size, reads=False)
        b = self.backing.get(ino)
        if b is None:  # a file kept for its mapping (`mapped`) may have no open left
            backing_id = self._backing_open(fd)
            if backing_id is None:
                self.store.unpin_passthrough(ino)
                return None
            b = self.backing[ino] = [backing_id, 0]
        b[1] += 1
        if writer:
            self.writers[ino] += 1
        return b[0], False, writer

    def _backing_open(self, fd: int) -> int | None:
        """The backing id of a DRAM file, or None (and no more passthrough) if the kernel
        will not have it."""
        try:
            return self.shim.backing_open(fd)
        except OSError as exc:
            log.warning("FUSE passthrough unavailable (%s): every read and write goes through "
                        "the daemon", exc)
            for ino in list(self.hot):
                self.revoke(ino)
            self.front = self.shim = None
            return None

    def _end_passthrough(self, h: Handle) -> None:
        """A handle carrying its inode's backing id is released."""
        self._unback(h.ino)
        self.store.unpin_passthrough(h.ino)

    def _unback(self, ino: int) -> None:
        """One holder of *ino*'s backing id (a handle, or its fast-open entry) lets go."""
        b = self.backing[ino]
        b[1] -= 1
        if b[1] == 0:
            del self.backing[ino]
            self._backing_close(ino, b[0])

    def _backing_close(self, ino: int, backing_id: int) -> None:
        try:
            self.shim.backing_close(backing_id)
        except (OSError, AttributeError) as exc:
            log.error("closing passthrough backing %d of inode %d: %s", backing_id, ino, exc)

    # -- opens answered by the front thread ------------------------------------------------
    # With the shim's front thread (kvfs._fuseshim, "the front thread"), an OPEN for reading
    # of a file in its table is answered there, in passthrough mode, without waiting for
    # this thread, which may be busy for a millisecond with other work; `fast_opened` then
    # does this side's part of that open when the notice comes, in request order. A file
    # enters the table at a passthrough open that found it ready (every chunk in DRAM and
    # checked), holding one reference to its backing id, and leaves it (`revoke`) before
    # anything that would make a later passthrough open of it wrong: a write or truncation
    # through the daemon, its DRAM copies dropped or repacked (the store calls `revoke`),
    # its data freed. Revoking delivers the notices still queued, so that a file opened
    # there counts as open (pinned) before such a change is decided.
    # A file of one chunk that a prefetch stages also enters the table when the prefetch
    # starts, pending (`stage_watch`): the front thread parks its opens, and the worker
    # thread makes it ready (answering them) once the bytes are staged and checked. So an
    # open that comes while the prefetch is in flight, or before this thread has seen it
    # end (it may be milliseconds behind), waits for the staging only, not for this
    # thread. The fetch cannot end any other way than with those bytes as the chunk's
    # copy unless something revoked the file first (which hands parked opens to this
    # thread): writes and truncations wait for it, and a freed file is revoked.
    def _may_fast_open(self, node: Inode) -> bool:
        """Is *node* a file the front thread may serve, once ready (and not in its table)?"""
        ino = node.ino
        return not (self.front is None or self.shim is None or ino in self.hot
                    or not node.is_reg or node.nlink == 0 or ino in self.writers
                    or ino in self._pending_takes
                    or node.size > FAST_OPEN_MAX_CHUNKS * self.store.cs
                    or self.store.reads_through(ino, node.size))

    def _offer_fast_open(self, node: Inode, ready: bool = False) -> None:
        """Let the front thread answer *node*'s opens for reading from now on, if it is a
        file a passthrough open would find ready: *ready*, it was just found so (an open,
        with no await since); else it is checked here (just taken, or staged)."""
        if not self._may_fast_open(node):
            return
        fd = None
        if not ready:
            fd = self.store.passthrough_fd(node.ino, node.size)
            if fd is None:
                return
        self._enter_hot(node.ino, fd, pending=False)

    def _enter_hot(self, ino: int, fd: int | None, pending: bool) -> int:
        """Put *ino* in the front thread's table, ready or *pending*, with the backing id
        its handles hold, or one opened on its DRAM file *fd*. Returns 0 if it is not in,
        else the pending entry's ticket (1 if ready)."""
        b = self.backing.get(ino)
        if b is None:
            backing_id = self._backing_open(fd)
            if backing_id is None:
                return 0
            b = self.backing[ino] = [backing_id, 0]
        if len(self.hot) >= self.hot_capacity:
            self.revoke(next(iter(self.hot)))
        if pending:
            entered = self.front.hot_pending(ino, b[0])
        else:
            entered = int(self.front.hot_add(ino, b[0]))
        if entered:
            self.hot[ino] = None
            b[1] += 1
        elif not b[1]:  # opened above for nothing
            del self.backing[ino]
            self._backing_close(ino, b[0])
        return entered

    def stage_watch(self, ino: int, c: int, fd: int) -> _PendingOpen | None:
        """A prefetch is about to stage chunk *c* of *ino* in its DRAM file *fd* (the
        store's hook): if that is the whole file, and one the front thread may serve, enter
        it pending; the watch makes it ready."""
        node = self.ns.inodes.get(ino)
        if (c != 0 or node is None or not 0 < node.size <= self.store.cs
                or not self._may_fast_open(node)):
            return None
        ticket = self._enter_hot(ino, fd, pending=True)
        if not ticket:
            return None
        self.pending_hot[ino] = ticket
        return _PendingOpen(self, self.front, ino, ticket)

    def staged(self, ino: int) -> None:
        """A prefetch staged a chunk of *ino* (the store's hook): offer the file once it is
        wholly in DRAM."""
        node = self.ns.inodes.get(ino)
        if node is not None and ino not in self.hot:
            self._offer_fast_open(node)

    def revoke(self, ino: int) -> None:
        """The front thread answers no more opens of *ino*; those it did are handles now."""
        if ino in self.hot:
            del self.hot[ino]
            self.pending_hot.pop(ino, None)
            self.front.hot_revoke(ino)  # calls fast_opened for each notice still queued
            self._unback(ino)

    def fast_opened(self, ino: int, fh: int, flags: int, pid: int, sent: bool) -> None:
        """The front thread answered an OPEN of *ino* with *fh* (see above); *sent* False:
        the reply did not reach the opener, so no RELEASE will come for *fh*."""
        try:
            if not sent:
                h = self.handles.pop(fh, None)
                if h is not None and (node := self._closed(h)) is not None:
                    self._maybe_free(node)
                return
            node = self.ns.inodes[ino]
            if ino in self.hot:
                self.hot.move_to_end(ino)
            self.readahead.opened(ino, flags, node.size, pid)
            self.store.pin_passthrough(ino, node.size)
            self.backing[ino][1] += 1
            self._add_handle(fh, node, Handle(ino, flags, pid, backed=True))
            self.readahead.read(ino, 0, node.size, pid)
            self.fast_opens += 1
        except Exception:
            log.exception("an open of inode %d answered by the front thread", ino)

    def front_read(self, ino: int, fh: int, off: int, size: int, pid: int, us: int) -> None:
        """The front thread answered a READ of *fh* from chunks the store read ahead
        (`ChunkStore.front_read`): the bookkeeping `read` does besides the copy."""
        try:
            self.requests += 1
            node = self.ns.inodes.get(ino)
            if node is None:
                return
            h = self.handles.get(fh)
            self.readahead.read(ino, off, size, h.pid if h is not None else pid)
            self.store.front_read(ino, off, size, node.size, us)
        except Exception:
            log.exception("a read of inode %d answered by the front thread", ino)

    @_errors
    async def open(self, inode, flags, ctx):
        with self._opening_file(inode):
            return await self._open(inode, flags, ctx)

    @contextlib.contextmanager
    def _opening_file(self, ino: int) -> Iterator[None]:
        """An open under way, which may await (a take, a truncation, staging from NVMe): an
        unlink meanwhile must leave the file to its last close, as for an open file, not
        free it under the open (which then read an empty file)."""
        self._opening[ino] = self._opening.get(ino, 0) + 1
        try:
            yield
        finally:
            left = self._opening.pop(ino) - 1
            if left:
                self._opening[ino] = left
            elif (node := self.ns.inodes.get(ino)) is not None:
                self._maybe_free(node)  # the open failed, and nothing else names the file

    async def _open(self, inode, flags, ctx):
        await self._taken(inode)
        node = self.ns.get(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if node.nlink == 0 and inode in self._data_freed:
            # Unlinked, with no open, between the caller's lookup and this OPEN: its data is
            # gone. As if the unlink had come before the lookup, not an empty file.
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_TRUNC and self._size(node):
            # libfuse negotiates atomic O_TRUNC: the kernel leaves truncation to open().
            self.revoke(inode)
            await self._recorded(node)
            sized = self._sized(node)
            await self.store.truncate(inode, node.size, 0, on_commit=lambda: sized(0, False))
            self.crash.reached("truncated")
        # Readahead hears of the open first: its predictions of what comes next start now,
        # not after this file's own staging from NVMe.
        self.readahead.opened(inode, flags, node.size, ctx.pid)
        if flags & os.O_ACCMODE != os.O_WRONLY and self.store.reads_through(inode, node.size):
            self.store.start_read_through(inode, node.size)  # its first chunks, from NVMe
        mode = await self._passthrough_mode(node, flags)
        if mode is not None and not mode[1] and not mode[2]:
            # The kernel reads it without us: the whole file counts as read now.
            self.readahead.read_whole(inode, node.size, ctx.pid)
            self._offer_fast_open(node, ready=True)
        return self._open_handle(node, flags, ctx.pid, mode)

    @_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        self.store.check_room()
        mode = stat.S_IFREG | (mode & ~ctx.umask & 0o7777)
        if (expected := self._stream_size(Inode(0, mode), flags, parent_inode)) is not None:
            with self.store.meta.write():  # one commit: the inode and its writer's record
                node = self.ns.create(parent_inode, name, mode, ctx.uid, ctx.gid)
                pt = self._start_writing(node.ino, expected)
        else:
            node = self.ns.create(parent_inode, name, mode, ctx.uid, ctx.gid)
            pt = await self._passthrough_mode(node, flags)
        self.readahead.created(node.ino, parent_inode, ctx.pid)
        return self._open_handle(node, flags, ctx.pid, pt), self._entry(node)

    def _check_direct(self, h: Handle, off: int, size: int) -> None:
        if h.direct and (off % DIRECT_IO_ALIGN or size % DIRECT_IO_ALIGN):
            raise pyfuse3.FUSEError(errno.EINVAL)

    @_errors
    async def read(self, fh, off, size):
        h = self.handles[fh]
        self._check_direct(h, off, size)
        node = self.ns.get(h.ino)
        self.readahead.read(h.ino, off, size, h.pid)
        return await self.store.read(h.ino, off, size, node.size, h.verified)

    def _grown(self, ino: int, off: int) -> Callable[[int], None]:
        """The inode update of a write at *off* whose bytes up to *end* are stored; runs
        inside the commit that stores them. A write that starts past the end leaves a hole."""
        def grow_inode(end: int) -> None:
            node = self.ns.get(ino)
            if end > node.size:
                node.resize(end, holes=off > node.size)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self.ns.save(node)

        return grow_inode

    @_errors
    async def write(self, fh, off, buf):
        h = self.handles[fh]
        self._check_direct(h, off, len(buf))
        end = off + len(buf)
        if end > MAX_FILE_SIZE:
            raise pyfuse3.FUSEError(errno.EFBIG)
        self.revoke(h.ino)
        grow_inode = self._grown(h.ino, off)
        written = await self._space_retry(
            lambda: self.store.write(h.ino, off, buf, grow_inode), len(buf))
        if written:
            self._drop_capabilities(h.ino)
        return written

    def _drop_capabilities(self, ino: int) -> None:
        """A write drops the file's capabilities (security.capability), as on any local
        filesystem. The kernel does it itself before a write it makes (passthrough), not
        before one it sends here."""
        if self.ns.security_xattrs and self.ns.getxattr(ino, FILE_CAPS) is not None:
            self.ns.removexattr(ino, FILE_CAPS)

    # -- writes copied straight into DRAM (called synchronously by kvfs._fuseshim) -----------
    # pyfuse3 copies a write's data into a bytes object before write() sees it, and write()
    # copies it again into the DRAM file. For the common write (fresh chunks, room in DRAM)
    # the shim asks write_plan where the bytes go, copies (splices) them from the request
    # straight into the file's DRAM file (at the same offset) with the GIL released, and
    # calls write_done; nothing else runs on the trio thread in between. Everything else
    # takes the ordinary path above.
    def write_plan(self, fh: int, off: int, size: int):
        """None (use write()), an errno, or (token, DRAM file fd, [(offset, length), ...])."""
        try:
            h = self.handles.get(fh)
            if h is None:
                return None
            if h.direct and (off % DIRECT_IO_ALIGN or size % DIRECT_IO_ALIGN):
                return errno.EINVAL
            if off + size > MAX_FILE_SIZE:
                return errno.EFBIG
            self.revoke(h.ino)
            plan = self.store.plan_write(h.ino, off, size)
            if plan is None:
                return None
            return (h, plan, off), self.store.write_fd(plan), ((off, size),)
        except Exception:
            log.exception("write_plan failed")
            return None

    def write_done(self, token, err: int) -> int:
        """The shim copied the planned bytes (err 0) or failed with errno *err*; returns the
        errno to answer (0: the write succeeded)."""
        h, plan, off = token
        try:
            if err:
                self.store.abort_write(plan)
                log.error("write: copying into DRAM failed: %s", os.strerror(err))
                return err
            self.store.finish_write(plan, self._grown(h.ino, off))
            self._drop_capabilities(h.ino)
            return 0
        except Exception:
            log.exception("write_done failed")
            return errno.EIO

    # No flush(): pyfuse3 answers ENOSYS, after which the kernel stops sending FLUSH on every
    # close() (kvfs has nothing to do there: data is in the store when write() returns). That
    # is one FUSE round trip less per file an engine writes or reads.

    @_errors
    async def release(self, fh):
        h = self.handles.pop(fh)
        node = self._closed(h)
        if node is not None and node.nlink > 0 and h.ino not in self._pending_takes:
            await self.store.seal(h.ino, node.size)  # (a take seals)
        if node is not None:
            self._maybe_free(node)

    def _closed(self, h: Handle) -> Inode | None:
        """The bookkeeping of a released handle; returns its inode if it still has one."""
        if h.backed:
            self._end_passthrough(h)
        node = self.ns.inodes.get(h.ino)
        if h.streams:
            self.writers[h.ino] -= 1
            if not self.writers[h.ino]:
                self._pending_takes[h.ino] = None  # taken by run_takes
                self._take_wakeup.set()
        if node is None:
            return None
        if h.flags & os.O_ACCMODE != os.O_RDONLY and node.nlink > 0:
            parent = self._parent(h.ino)
            if parent is not None:  # the size files written in that directory reach
                self.stream_policy.closed(parent, self._size(node))
        node.opens -= 1
        if not node.opens:
            self.store.end_read_through(h.ino)
        self.readahead.closed(h.ino, h.pid)
        return node

    def _sized(self, node: Inode) -> Callable[[int, bool], None]:
        """The inode update of a take of what the kernel wrote, or of a truncation to
        nothing: it is now *size* bytes (with *holes*, or none)."""
        def sized(size: int, holes: bool) -> None:
            node.resize(size, holes=holes)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self.ns.save(node)

        return sized

    async def _end_writing(self, ino: int, node: Inode | None, final: bool = False) -> None:
        """The last writer of a file the kernel wrote into its DRAM file closed (and
        `run_takes` got to it): the store takes its bytes. Opens of it meanwhile wait
        (`_finishing`): the bytes must be still. An adopted file whose DRAM file is still
        mapped shared and writable (the mapping outlives the close) stays one the kernel
        writes, in `mapped`, taken again every MAPPED_CHECK_S until no mapping is left
        (`watch_mapped`), or for good when *final* (unmount)."""
        done = self._finishing[ino] = trio.Event()
        keep = False
        try:
            if node is not None and node.nlink > 0:
                keep = (not final and ino in self.store.adopted and await self.store
                        .mapped_writable(ino, None if self.mount_dev is None
                                         else (self.mount_dev, ino)))
                await self.store.take_stream(ino, done=not keep, on_commit=self._sized(node))
            else:
                self.store.end_stream(ino)
        finally:
            if keep:
                self.mapped.add(ino)  # its writers count stays, at 0
            else:
                self.mapped.discard(ino)
                del self.writers[ino]
            del self._finishing[ino]
            done.set()

    async def watch_mapped(self) -> None:
        """Every MAPPED_CHECK_S, each file in `mapped` is taken again (`_end_writing`): what
        its mapping wrote is recorded, and once no mapping is left the file is an ordinary
        one again."""
        while True:
            await trio.sleep(MAPPED_CHECK_S)
            for ino in list(self.mapped):
                if ino in self.mapped and not self.writers.get(ino):  # a writer's close decides
                    self._pending_takes[ino] = None
                    self._take_wakeup.set()

    async def finish_mapped(self) -> None:
        """Unmount: files still mapped are taken for good (nothing records a mapping's
        writes once the daemon is gone)."""
        await self.finish_takes()
        for ino in list(self.mapped):
            await self._end_writing(ino, self.ns.inodes.get(ino), final=True)

    async def run_takes(self) -> None:
        """Take the files whose last writer closed, each when no FUSE request is waiting
        (trio has nothing else to run and nothing to read: `wait_all_tasks_blocked`). An
        engine writing block after block closes one and creates the next at once; taken in
        its RELEASE, a file's take (a hash of its bytes and a commit) held up the next
        file's requests, and taken now it overlaps the engine's write() of the next file,
        which the kernel does without us. 256 KiB files: +5% files/s (interleaved runs)."""
        while True:
            await self._take_wakeup.wait()
            self._take_wakeup = trio.Event()
            while self._pending_takes:
                if len(self._pending_takes) < TAKE_BACKLOG:
                    with trio.move_on_after(TAKE_WAIT_S):
                        await trio.testing.wait_all_tasks_blocked()
                if self._pending_takes:
                    await self._take_logged(next(iter(self._pending_takes)))

    async def finish_takes(self) -> None:
        """Take every file still waiting (unmount, kvfsctl queries)."""
        while self._pending_takes:
            await self._take_logged(next(iter(self._pending_takes)))

    async def _take_logged(self, ino: int) -> None:
        """`_take_now` outside any request: a failure is logged, never let out (it would
        end the daemon); as when a take in a RELEASE failed, the file keeps what was
        recorded before."""
        try:
            await self._take_now(ino)
        except Exception:
            log.exception("taking inode %d after its last close failed", ino)

    async def _taken(self, ino: int) -> None:
        """Until *ino* is no file the kernel's writer left to be taken: taken now if it
        waits, or its take under way finished (an open or a truncation needs its bytes
        still and recorded)."""
        if ino in self._pending_takes:
            await self._take_now(ino)
        while (finishing := self._finishing.get(ino)) is not None:
            await finishing.wait()

    async def _take_now(self, ino: int) -> None:
        """Take *ino* now if it waits to be (an open or a truncation of it needs it taken).
        Until then it is still one the kernel writes: its size comes from its DRAM file
        (`_size`) and it is not freed (`_maybe_free`)."""
        if ino not in self._pending_takes:
            return
        del self._pending_takes[ino]
        node = self.ns.inodes.get(ino)
        try:
            await self._end_writing(ino, node)
        finally:
            if node is not None:
                self._maybe_free(node)
        if node is not None:
            self._offer_fast_open(node)  # taken: wholly in DRAM, every chunk checked

    @_errors
    async def fsync(self, fh, datasync):
        h = self.handles[fh]
        node = self.ns.get(h.ino)
        await self._recorded(node)  # what the kernel wrote so far becomes the file's chunks
        await self.store.fsync(h.ino, node.size)

    # -- directories -----------------------------------------------------------------------
    @_errors
    async def opendir(self, inode, ctx):
        entries = self.ns.entries(inode)
        fh = next(self._fh)
        self.dirs[fh] = entries
        return fh

    @_errors
    async def readdir(self, fh, start_id, token):
        entries = self.dirs[fh]
        for i in range(start_id, len(entries)):
            name, ino = entries[i]
            inode = self.ns.inodes.get(ino)
            if inode is None:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), i + 1):
                break
            inode.lookups += 1

    @_errors
    async def releasedir(self, fh):
        self.dirs.pop(fh, None)

    @_errors
    async def fsyncdir(self, fh, datasync):
        await self.store.sync()

    @_errors
    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        cap, used = self.store.capacity, self.store.used
        s.f_bsize = s.f_frsize = BLOCK_SIZE
        s.f_blocks = cap // BLOCK_SIZE
        s.f_bfree = s.f_bavail = max(0, cap - used) // BLOCK_SIZE
        s.f_files = max(1 << 24, 4 * len(self.ns.inodes))
        s.f_ffree = s.f_favail = s.f_files - len(self.ns.inodes)
        s.f_namemax = NAME_MAX
        return s

    @_errors
    async def access(self, inode, mode, ctx):
        self.ns.get(inode)  # default_permissions: the kernel already checked the mode bits
        return True

    # -- xattrs ----------------------------------------------------------------------------
    @_errors
    async def setxattr(self, inode, name, value, ctx):
        if self.control.handles(name):
            self.control.set(inode, name[len(CONTROL_PREFIX):], value)
            return
        self._check_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise pyfuse3.FUSEError(errno.E2BIG)
        self.store.check_room()
        self.ns.setxattr(inode, name, value)

    @_errors
    async def getxattr(self, inode, name, ctx):
        if self.control.handles(name):
            await self.finish_takes()  # `where` and `status` count closed files as taken
            return self.control.get(inode, name[len(CONTROL_PREFIX):], ctx.uid)
        self.ns.get(inode)
        self._check_xattr_name(name)
        value = self.ns.getxattr(inode, name)
        if value is None:
            raise pyfuse3.FUSEError(errno.ENODATA)
        return value

    @_errors
    async def listxattr(self, inode, ctx):
        self.ns.get(inode)
        return self.ns.listxattr(inode)

    @_errors
    async def removexattr(self, inode, name, ctx):
        self._check_xattr_name(name)
        self.ns.removexattr(inode, name)

    @staticmethod
    def _check_xattr_name(name: bytes) -> None:
        if not name.startswith(XATTR_NAMESPACES):  # system.* (ACLs) included: like tmpfs
            raise pyfuse3.FUSEError(errno.EOPNOTSUPP)  # without them

    # -- fallocate (called synchronously by kvfs._fuseshim, not by pyfuse3) ------------------
    def fallocate_sync(self, ino: int, mode: int, offset: int, length: int, fh: int,
                       req: int = 0) -> int:
        """fallocate(2) on the FUSE thread; returns an errno (0 = success), or -1 when it
        answers *req* later itself (`reply_fallocate`).

        Mode 0 and FALLOC_FL_KEEP_SIZE reserve room for the range's holes (counted in statvfs
        and st_blocks), so later writes there cannot fail with ENOSPC; mode 0 also extends the
        file. PUNCH_HOLE (with KEEP_SIZE, as Linux requires) makes the range a hole, in a
        task of its own: it may wait for NVMe reads. Zeroing, collapsing and inserting
        ranges answer EOPNOTSUPP, as on tmpfs."""
        try:
            node = self.ns.get(ino)
            if not node.is_reg:
                return errno.ENODEV if not node.is_dir else errno.EISDIR
            punch = mode == FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            if mode & ~FALLOC_FL_KEEP_SIZE and not (punch and self.spawn is not None
                                                    and self.reply_fallocate is not None):
                return errno.EOPNOTSUPP
            if offset < 0 or length <= 0:
                return errno.EINVAL
            end = offset + length
            if end > MAX_FILE_SIZE:
                return errno.EFBIG
            if punch:
                self.spawn(self._punch_hole_task, ino, offset, length, req)
                return -1
            if length > self.store.capacity:
                return errno.ENOSPC
            self.revoke(ino)
            self.store.allocate(ino, offset, length)
            if not mode & FALLOC_FL_KEEP_SIZE and ino in self.writers:
                self.store.resized(ino, max(end, self._size(node)))  # its DRAM file: taken later
            elif not mode & FALLOC_FL_KEEP_SIZE and end > node.size:
                self.store.resized(ino, end)
                node.resize(end, holes=True)  # reserved, not written: reads give zeros
                node.mtime_ns = node.ctime_ns = time.time_ns()
                self.ns.save(node)
            return 0
        except NamespaceError as exc:
            return exc.errno
        except NoSpace:
            return errno.ENOSPC
        except Exception:
            log.exception("fallocate failed")
            return errno.EIO

    async def _punch_hole_task(self, ino: int, offset: int, length: int, req: int) -> None:
        try:
            await self.punch_hole(ino, offset, length)
            err = 0
        except pyfuse3.FUSEError as exc:
            err = exc.errno
        self.reply_fallocate(req, err)

    @_errors
    async def punch_hole(self, ino: int, offset: int, length: int) -> None:
        await self._taken(ino)
        node = self.ns.get(ino)
        self.revoke(ino)

        def punched() -> None:
            node.resize(node.size, holes=True)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self.ns.save(node)

        await self.store.punch(ino, offset, length, self._size(node), on_commit=punched)

    # -- cache-mode eviction -----------------------------------------------------------------
    def remove_file(self, ino: int) -> bool:
        """Remove every name of a file (cache-mode eviction) and tell the kernel."""
        inode = self.ns.inodes.get(ino)
        self.revoke(ino)
        if inode is None or not inode.is_reg or inode.opens > 0 or inode.nlink == 0:
            return False
        for parent, name in list(self.ns.names_of(ino)):
            self.ns.remove(parent, name, want_dir=False)
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        self._maybe_free(inode)
        return True
