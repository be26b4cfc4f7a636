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
    pt        Passthrough: files the kernel reads or writes straight from DRAM, fast opens
    pod       PodFiles: files shared with the other mounts of a pod (None: no pod)
    requests  FUSE requests answered by a handler so far (kvfs.collector waits for a pause)

Opens in passthrough mode (the kernel reads or writes a file straight from its DRAM file)
and the opens the shim's front thread answers are `kvfs.passthrough.Passthrough`'s (`pt`);
this module owns the handles, and is its host.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import pyfuse3

from kvfs.faults import Faults
from kvfs.namespace import NAME_MAX, Inode, Namespace, NamespaceError
from kvfs.passthrough import Passthrough
from kvfs.podfiles import PodFiles
from kvfs.store.chunkstore import ChunkStore
from kvfs.store.location import ChunkError, NoSpace

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
BLOCK_SIZE = 4096  # f_bsize and f_frsize: what O_DIRECT users and statvfs accounting use
# st_blksize: stdio and Python size their buffers by it, and every read() or write() that
# reaches the daemon is a FUSE round trip, so a 4 KiB buffer made llama.cpp's slot restore
# (fread of 4 KiB rows) 5x slower than ext4. The largest FUSE request, as NFS's rsize.
IO_SIZE = 1 << 20
CONTROL_PREFIX = b"user.kvfs."
FILE_CAPS = b"security.capability"
# Extended attribute namespaces kept (system.* would be ACLs, which kvfs does not have); any
# other name is EOPNOTSUPP, as on tmpfs and ext4 (the kernel passes every name to FUSE).
XATTR_NAMESPACES = (b"user.", b"trusted.", b"security.")
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
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
                 cache_mode: bool, evictor=None, faults: Faults | None = None,
                 pod: PodFiles | None = None,
                 renamed: Callable[[int], None] = lambda ino: None) -> None:
        super().__init__()
        self.faults = faults or Faults()
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
        self.pt = Passthrough(ns, store, readahead, host=self)
        self.pod = pod
        self.renamed = renamed  # told of each rename's inode (kvfs/store/describe.py)
        self._opening: dict[int, int] = {}  # ino -> opens under way (_opening_file)
        # Unlinked files whose data is freed but which the kernel still knows (see _open).
        self._data_freed: set[int] = set()
        # Starts a task in the daemon's nursery (set by the assembly while it runs), and
        # answers a fallocate request later (the shim's, set by the daemon).
        self.spawn: Callable | None = None
        self.reply_fallocate: Callable[[int, int], None] | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _attr(self, inode: Inode) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode.ino
        a.generation = 0
        ttl = None if self.pod is None else self.pod.entry_timeout(inode.ino)
        if ttl is not None:  # the kernel asks again soon (kvfs/podfiles.py)
            a.entry_timeout = a.attr_timeout = ttl
        else:
            a.entry_timeout = ENTRY_TIMEOUT
            a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = inode.mode
        a.st_nlink = inode.nlink
        a.st_uid = inode.uid
        a.st_gid = inode.gid
        a.st_rdev = inode.rdev
        a.st_size = self.pt.size(inode)
        a.st_blksize = IO_SIZE
        a.st_blocks = (self.pt.blocks(inode, self.store.blocks_bytes(inode.ino)) + 511) // 512
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
            self.pt.revoke(inode.ino)  # opens the front thread answered count as opens
        if (inode.nlink > 0 or inode.opens > 0
                or self.pt.busy(inode.ino)  # the take's end frees it
                or inode.ino in self._opening):  # so does the open's (_opening_file)
            return
        if inode.is_reg and inode.ino not in self._data_freed:  # (else freed at its unlink)
            self.pt.freed(inode.ino)
            if self.pod is not None:
                self.pod.forgotten(inode.ino)
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
            # (lmdb keeps the inode, unnamed, until its FORGET; an unlink commits first)
            self.store.meta.once_committed(lambda: self.faults.reached("freed"))

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
        if ino is None and self.pod is not None:
            found = await self.pod.lookup(parent_inode, name)
            if found is not None:
                return self._entry(found)
        if ino is None:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0  # cached negative entry: engines probe for absent blocks a lot
            # (with a pod, only as long as the pod's own answer is: a file published since
            # must appear)
            a.entry_timeout = ENTRY_TIMEOUT if self.pod is None else self.pod.pod.miss_ttl
            return a
        node = self.ns.get(ino)
        if self.pod is not None and ino in self.pod.imported:
            head = await self.pod.changed(node)
            if (head is not None and not node.opens and not self.pt.busy(ino)
                    and ino not in self._opening):
                self.pt.revoke(ino)
                await self.pod.replace(node, head)
        return self._entry(node)

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
        await self.pt.taken(inode)
        node = self.ns.get(inode)
        if not (fields.update_size or fields.update_mode or fields.update_uid
                or fields.update_gid or fields.update_atime or fields.update_mtime
                or fields.update_ctime):
            self._remove_privs(node, ctx)
        if fields.update_size:
            self.pt.revoke(inode)
            if not node.is_reg:
                raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            with self._opening_file(inode):
                await self._fetched(node)
            if attr.st_size > MAX_FILE_SIZE:
                raise pyfuse3.FUSEError(errno.EFBIG)
            await self.pt.recorded(node)

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
            self.faults.reached("truncated")
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
        with self.store.meta.write():  # one commit: the name and, if it was the last, the data
            self._maybe_free(self.ns.remove(parent_inode, name, want_dir=False))

    @_errors
    async def rmdir(self, parent_inode, name, ctx):
        self._maybe_free(self.ns.remove(parent_inode, name, want_dir=True))

    @_errors
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        replaced = self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)
        if replaced is not None:
            self._maybe_free(replaced)
        moved = self.ns.lookup(parent_inode_new, name_new)
        if moved is not None:
            self.renamed(moved)
            if self.pod is not None and self.ns.inodes[moved].is_reg:
                self.pod.due(moved)  # published under its new name (renamed into place)

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
            self.pt.mark(fh, mode)
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

    # -- what kvfs.passthrough asks of its host (passthrough.Host) ------------------------
    def add_opened(self, fh: int, node: Inode, flags: int, pid: int) -> None:
        self._add_handle(fh, node, Handle(node.ino, flags, pid, backed=True))

    def drop_handle(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None and (node := self._closed(h)) is not None:
            self._maybe_free(node)

    def via_daemon(self, ino: int) -> bool:
        return any(h.via_daemon for h in self.handles.values() if h.ino == ino)

    def maybe_free(self, node: Inode) -> None:
        self._maybe_free(node)

    # -- the front thread (kvfs.passthrough has the opens it answers) -----------------------
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
        await self.pt.taken(inode)
        node = self.ns.get(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if node.nlink == 0 and inode in self._data_freed:
            # Unlinked, with no open, between the caller's lookup and this OPEN: its data is
            # gone. As if the unlink had come before the lookup, not an empty file.
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & os.O_TRUNC and self.pod is not None and inode in self.pod.remote:
            await self.pod.emptied(node)  # (what the pod has of it would be cut away at once)
        await self._fetched(node)
        if flags & os.O_TRUNC and self.pt.size(node):
            # libfuse negotiates atomic O_TRUNC: the kernel leaves truncation to open().
            self.pt.revoke(inode)
            await self.pt.recorded(node)
            sized = self.pt.sized(node)
            await self.store.truncate(inode, node.size, 0, on_commit=lambda: sized(0, False))
            self.faults.reached("truncated")
        reader = flags & os.O_ACCMODE != os.O_WRONLY
        if reader and flags & os.O_DIRECT:
            self.store.read_direct(inode)  # read through, not staged (before any prediction)
        # Readahead hears of the open first: its predictions of what comes next start now,
        # not after this file's own staging from NVMe.
        self.readahead.opened(inode, flags, node.size, ctx.pid)
        if reader and self.store.reads_through(inode, node.size):
            self.store.start_read_through(inode, node.size)  # its first chunks, from NVMe
        mode = await self.pt.mode(node, flags)
        if mode is not None and not mode[1] and not mode[2]:
            # The kernel reads it without us: the whole file counts as read now.
            self.readahead.read_whole(inode, node.size, ctx.pid)
            self.pt.offer(node, ready=True)
        return self._open_handle(node, flags, ctx.pid, mode)

    @_errors
    async def create(self, parent_inode, name, mode, flags, ctx):
        self.store.check_room()
        mode = stat.S_IFREG | (mode & ~ctx.umask & 0o7777)
        expected = self.pt.kernel_write_expected(Inode(0, mode), flags,
                                                 self.pt.directories(parent_inode))
        if expected is not None:
            with self.store.meta.write():  # one commit: the inode and its writer's record
                node = self.ns.create(parent_inode, name, mode, ctx.uid, ctx.gid)
                pt = self.pt.start_writing(node.ino, expected)
        else:
            node = self.ns.create(parent_inode, name, mode, ctx.uid, ctx.gid)
            pt = await self.pt.mode(node, flags)
        self.readahead.created(node.ino, parent_inode, ctx.pid)
        return self._open_handle(node, flags, ctx.pid, pt), self._entry(node)

    async def _fetched(self, node: Inode) -> None:
        """A file found in the pod is fetched before anything opens or cuts it. If the pod
        does not give it (gone, damaged, too slow) it was a miss after all: its names go
        and the caller gets ENOENT (as if it had been unlinked since its lookup)."""
        if self.pod is None:
            return
        if not await self.pod.fetch(node):
            for parent, name in list(self.ns.names_of(node.ino)):
                self.ns.remove(parent, name, want_dir=False)
                pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
            self._maybe_free(node)
            raise pyfuse3.FUSEError(errno.ENOENT)

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
        self.pt.revoke(h.ino)
        grow_inode = self._grown(h.ino, off)
        written = 0
        while written < len(buf):  # the store stops short where a piece fails: go on from
            # there, so that a full tier in cache mode evicts instead of ending it short
            pos, rest = off + written, memoryview(buf)[written:]
            try:
                written += await self._space_retry(
                    partial(self.store.write, h.ino, pos, rest, grow_inode), len(rest))
            except (NoSpace, ChunkError, OSError):
                if not written:
                    raise
                break  # a short write of what was stored
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
            self.pt.revoke(h.ino)
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
        if node is not None and node.nlink > 0 and not self.pt.waits_take(h.ino):
            await self.store.seal(h.ino, node.size)  # (a take seals)
        if (self.pod is not None and node is not None and node.nlink > 0 and node.is_reg
                and h.flags & os.O_ACCMODE != os.O_RDONLY):
            self.pod.due(h.ino)  # published once its last writer closed (`settled`)
        if node is not None:
            self._maybe_free(node)

    async def settled(self, ino: int) -> Inode | None:
        """*ino* ready to be published: what the kernel wrote taken, no writer left, still
        named; else None."""
        await self.pt.taken(ino)
        node = self.ns.inodes.get(ino)
        if (node is None or not node.is_reg or not node.nlink or ino in self.pt.writers
                or any(h.ino == ino and h.flags & os.O_ACCMODE != os.O_RDONLY
                       for h in self.handles.values())):
            return None
        return node

    def _closed(self, h: Handle) -> Inode | None:
        """The bookkeeping of a released handle; returns its inode if it still has one."""
        self.pt.released(h.ino, h.backed, h.streams)
        node = self.ns.inodes.get(h.ino)
        if node is None:
            return None
        if h.flags & os.O_ACCMODE != os.O_RDONLY and node.nlink > 0:
            self.pt.closed_writable(node)  # the size files written in its directory reach
        node.opens -= 1
        if not node.opens:
            self.store.end_read_through(h.ino)
        self.readahead.closed(h.ino, h.pid)
        return node

    @_errors
    async def fsync(self, fh, datasync):
        h = self.handles[fh]
        node = self.ns.get(h.ino)
        await self.pt.recorded(node)  # what the kernel wrote so far becomes the file's chunks
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
            await self.pt.finish_takes()  # a file the kernel wrote is the store's by then
            await self.control.set(inode, name[len(CONTROL_PREFIX):], value, ctx.uid)
            return
        self._check_xattr_name(name)
        if len(value) > XATTR_SIZE_MAX:
            raise pyfuse3.FUSEError(errno.E2BIG)
        self.store.check_room()
        self.ns.setxattr(inode, name, value)

    @_errors
    async def getxattr(self, inode, name, ctx):
        if self.control.handles(name):
            await self.pt.finish_takes()  # `where` and `status` count closed files as taken
            return await self.control.get(inode, name[len(CONTROL_PREFIX):], ctx.uid)
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
        if self.control.handles(name):
            self.control.remove(inode, name[len(CONTROL_PREFIX):], ctx.uid)
            return
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
            self.pt.revoke(ino)
            self.store.allocate(ino, offset, length)
            if not mode & FALLOC_FL_KEEP_SIZE and ino in self.pt.writers:
                self.store.resized(ino, max(end, self.pt.size(node)))  # its DRAM file: taken later
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
        await self.pt.taken(ino)
        node = self.ns.get(ino)
        self.pt.revoke(ino)

        def punched() -> None:
            node.resize(node.size, holes=True)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self.ns.save(node)

        await self.store.punch(ino, offset, length, self.pt.size(node), on_commit=punched)

    # -- cache-mode eviction -----------------------------------------------------------------
    def remove_file(self, ino: int) -> bool:
        """Remove every name of a file (cache-mode eviction) and tell the kernel."""
        inode = self.ns.inodes.get(ino)
        self.pt.revoke(ino)
        if inode is None or not inode.is_reg or inode.opens > 0 or inode.nlink == 0:
            return False
        for parent, name in list(self.ns.names_of(ino)):
            self.ns.remove(parent, name, want_dir=False)
            pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)
        self._maybe_free(inode)
        return True
