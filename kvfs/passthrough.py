"""Files the kernel reads or writes straight from their DRAM files (FUSE passthrough), and
the opens of them that the daemon's front thread answers: one owner for all of it.

FUSE passthrough (Linux 6.9+): an open for reading of a file whose chunks are all in DRAM
(and check out) is answered with the backing id of its DRAM file, and the kernel serves its
reads (and mmap) from tmpfs without asking the daemon. The kernel allows one backing file per
inode while any such open lives, and refuses (EIO) an open of that inode without it; so while
an inode is in passthrough mode every open of it carries its backing id, and the ones that
must not bypass the daemon (writers, a file that does not check out) also carry
direct_io, which sends their reads and writes to the daemon as before. The store keeps the
DRAM copies of such a file where they are (`ChunkStore.pin_passthrough`) until its last
passthrough open is released.

Writers too: a file created (or truncated to nothing by O_TRUNC) by an open for writing, with
nothing else open and room to spare, is written by the kernel straight into its DRAM file
(`ChunkStore.start_kernel_write`). kvfs sees none of those writes; until the last writer closes,
every open of the file reads and writes the DRAM file too (O_DIRECT ones included, so their
alignment is not checked), its size is the DRAM file's, and an fsync takes what is there as
the file's chunks and makes them durable. After the last writer's close the store takes the
DRAM file's contents as the file (`take_kernel_written`), as soon as no request waits (`run_takes`);
until then the file is still one the kernel writes.

Opens answered by the front thread (`kvfs._fuseshim`): an OPEN for reading of a file in its
table is answered there, in passthrough mode, without waiting for the trio thread, which may
be busy for a millisecond with other work; `fast_opened` then does this side's part of that
open when the notice comes, in request order. A file enters the table at a passthrough open
that found it ready (every chunk in DRAM and checked), holding one reference to its backing
id, and leaves it (`revoke`) before anything that would make a later passthrough open of it
wrong: a write or truncation through the daemon, its DRAM copies dropped or repacked (the
store's `StoreEvents.revoke`), its data freed. Revoking delivers the notices still queued, so
that a file opened there counts as open (pinned) before such a change is decided. A file of
one chunk that a prefetch stages also enters the table when the prefetch starts, pending
(`stage_watch`): the front thread parks its opens, and the worker thread makes it ready
(answering them) once the bytes are staged and checked. The fetch cannot end any other way
than with those bytes as the chunk's copy unless something revoked the file first (which
hands parked opens to the trio thread): writes and truncations wait for it, and a freed file
is revoked.

All of this runs on the trio thread (the front thread only calls `fast_opened`, through the
shim's queue, on it). `kvfs.fs.Operations` is the host: it owns the handles.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio
import trio.testing

from kvfs.config import FAST_OPEN_FILES_MAX
from kvfs.namespace import Inode, Namespace
from kvfs.tiering import KernelWritePolicy

log = logging.getLogger(__name__)

# A file the kernel wrote is taken (hashed, recorded) after its last close, when no request
# is waiting (`run_takes`); at most TAKE_BACKLOG files wait, none over TAKE_WAIT_S.
TAKE_BACKLOG = 4
TAKE_WAIT_S = 0.02
# How often a file whose DRAM file a shared mapping still writes after its last close is
# taken again (`watch_mapped`).
MAPPED_CHECK_S = 5.0
# Files of at most this many chunks go to the front thread's table (a staged chunk checks
# its whole file; bigger files are read through the daemon anyway).
FAST_OPEN_MAX_CHUNKS = 16
# A new file's size is predicted from its directory's files, or those of the nearest of the
# SIZE_LEVELS - 1 directories above it (`Passthrough.directories`).
SIZE_LEVELS = 3

# How an open is answered: (backing id, direct_io, counted as one of the file's writers).
Mode = tuple[int, bool, bool]


class Host(Protocol):
    """What this needs of the FUSE operations, which own the open handles."""

    def add_opened(self, fh: int, node: Inode, flags: int, pid: int) -> None:
        """An open answered by the front thread is a handle now (carrying the backing id)."""

    def drop_handle(self, fh: int) -> None:
        """Forget handle *fh* as if it were released (its open never reached the opener)."""

    def via_daemon(self, ino: int) -> bool:
        """Does an open of *ino* read or write through the daemon?"""

    def maybe_free(self, node: Inode) -> None:
        """Free *node*'s data if nothing names or holds it any more."""


@dataclass
class _PendingOpen:
    """The StageWatch of a file entered pending in the front thread's table."""
    pt: Passthrough
    front: object  # the shim module (`pt.front` may be cleared meanwhile)
    ino: int
    ticket: int

    def ready(self) -> None:
        if self.front.hot_ready(self.ino, self.ticket):  # False: revoked meanwhile
            self.pt.fast_open_staged += 1

    def done(self, installed: bool) -> None:
        if self.pt.pending_hot.get(self.ino) != self.ticket:
            return  # revoked meanwhile
        del self.pt.pending_hot[self.ino]
        if not installed:
            self.pt.revoke(self.ino)


class Passthrough:
    """Attributes:
        shim      kvfs._fuseshim when FUSE passthrough may be used (`use`), else None
        front     the shim too when its front thread answers opens (`serve_opens`), else None
        backing   inodes in passthrough mode (ino -> [backing id, holders]: handles, entry)
        writers   inodes the kernel writes straight into their DRAM file (ino -> writers)
        mapped    of those, adopted files with no writer left whose DRAM file a shared
                  mapping may still write (`_end_writing`, `watch_mapped`)
        hot       the files in the front thread's table, opened least recently first
        pending_hot  of those, entered pending while a prefetch stages them -> ticket
        kernel_write_policy  which new files the kernel may write (tiering.KernelWritePolicy)
    """

    def __init__(self, ns: Namespace, store, readahead, host: Host) -> None:
        self.ns = ns
        self.store = store
        self.readahead = readahead
        self.host = host
        self.shim = None
        self.front = None
        self.mount_dev: int | None = None  # the mount's st_dev (a mapping shows it)
        self.backing: dict[int, list[int]] = {}
        self.writers: dict[int, int] = {}
        self.mapped: set[int] = set()
        self.kernel_write_policy = KernelWritePolicy()
        self.hot: OrderedDict[int, None] = OrderedDict()
        self.hot_capacity = FAST_OPEN_FILES_MAX
        self.pending_hot: dict[int, int] = {}
        self.fast_open_staged = 0  # pending entries made ready by their prefetch
        self.fast_opens = 0
        self._finishing: dict[int, trio.Event] = {}  # takes under way
        self._pending_takes: dict[int, None] = {}  # files whose last writer closed
        self._take_wakeup = trio.Event()

    # -- set-up (the daemon) ---------------------------------------------------------------
    def use(self, shim, hot_capacity: int) -> None:
        """FUSE passthrough through *shim*, whose table holds *hot_capacity* files."""
        self.shim = shim
        self.hot_capacity = hot_capacity

    def serve_opens(self, front, mount_dev: int | None) -> None:
        """The shim's front thread answers opens of the files in its table (*front* None:
        it does not); *mount_dev* is the mount's device, once mounted."""
        self.front = front
        self.mount_dev = mount_dev

    def stats(self) -> dict:
        return {"passthrough": {"fast_opens": self.fast_opens,
                                "fast_open_files": len(self.hot),
                                "fast_open_staged": self.fast_open_staged,
                                "fast_open_parked": (self.front.parked_opens()
                                                     if self.front is not None else 0)}}

    # -- sizes -----------------------------------------------------------------------------
    def size(self, inode: Inode) -> int:
        """*inode*'s size now: its DRAM file's while the kernel writes it without us. Its
        recorded size (`inode.size`, what lmdb has) is that of its last take: saved with
        anything else, a size its chunks do not reach yet would read as zeros after a
        crash that loses DRAM."""
        if inode.ino in self.writers:
            return self.store.kernel_written_size(inode.ino)
        return inode.size

    def blocks(self, inode: Inode, held: int) -> int:
        """Bytes *inode* holds, for st_blocks: *held*, or what the kernel wrote if more."""
        if inode.ino in self.writers:  # what the kernel wrote may not be counted yet
            return max(held, self.store.kernel_written_blocks(inode.ino))
        return held

    async def recorded(self, node: Inode) -> None:
        """Take what the kernel wrote so far into *node*, if it writes it: a change of its
        size must start from its bytes recorded, as an fsync records them."""
        if node.ino in self.writers and node.ino not in self._finishing:
            await self.store.take_kernel_written(node.ino, done=False, on_commit=self.sized(node))

    def sized(self, node: Inode) -> Callable[[int, bool], None]:
        """The inode update of a take of what the kernel wrote, or of a truncation to
        nothing: it is now *size* bytes (with *holes*, or none)."""
        def sized(size: int, holes: bool) -> None:
            node.resize(size, holes=holes)
            node.mtime_ns = node.ctime_ns = time.time_ns()
            self.ns.save(node)

        return sized

    def busy(self, ino: int) -> bool:
        """Is *ino* waiting to be taken, or being taken? (Its data stays till then.)"""
        return ino in self._pending_takes or ino in self._finishing

    def freed(self, ino: int) -> None:
        """*ino*'s data is about to be freed: a file kept for its mapping has nothing to take
        (the mapping may outlive the file)."""
        if ino in self.mapped:
            self.mapped.discard(ino)
            del self.writers[ino]
            self.store.end_kernel_write(ino)

    # -- opens -----------------------------------------------------------------------------
    def _parent(self, ino: int) -> int | None:
        names = self.ns.names_of(ino)
        return min(names)[0] if names else None

    def directories(self, d: int | None) -> list[int]:
        """Directory *d* and the ones above it, up to SIZE_LEVELS of them: what the size of a
        new file in *d* is predicted from. Engines fan blocks out under a tree of small
        directories (vLLM's <model>/<hhh>/<hh>_g<group>/) whose files share one size: a new
        leaf directory's first file takes the size its siblings' files reached."""
        dirs: list[int] = []
        while d is not None and len(dirs) < SIZE_LEVELS:
            dirs.append(d)
            d = self._parent(d)  # (None above the root, which has no name)
        return dirs

    async def mode(self, node: Inode, flags: int) -> Mode | None:
        """(backing id, direct_io, writer) for a new open of *node*, or None for an ordinary
        open. The open is then counted as one carrying the id (and, if *writer*, as one of
        the file's writers); no await may come between this and its handle's creation."""
        if self.shim is None or not node.is_reg:
            return None
        ino = node.ino
        writer = flags & os.O_ACCMODE != os.O_RDONLY
        if ino in self.writers:  # everything goes to the DRAM file while the kernel writes it
            return self._join_writing(node, writer)
        expected = self.kernel_write_expected(node, flags, self.directories(self._parent(ino)))
        if expected is not None:
            return self.start_writing(ino, expected)
        if writer:
            # An open carrying the backing id can be mmap()ed shared and writable, and such a
            # mapping writes the DRAM file itself, behind kvfs's back. The front thread's
            # entry holds the id: without it (and no reader holding it) the open is an
            # ordinary one, whose shared mappings are refused (ENODEV). While readers hold
            # it, this open must carry it too: the file becomes one the kernel writes.
            self.revoke(ino)
            if ino in self.backing and (adopted := self._adopt_writer(node, flags)) is not None:
                return adopted
        # O_DIRECT readers too: the kernel then reads the DRAM file itself, and tmpfs does not
        # check O_DIRECT's alignment (only requests that reach kvfs are checked: DESIGN.md).
        reader = not writer
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

    def mark(self, fh: int, mode: Mode) -> None:
        """The open reply of handle *fh* carries *mode*'s backing id."""
        self.shim.mark_passthrough(fh, mode[0], mode[1])

    def kernel_write_expected(self, node: Inode, flags: int, dirs: list[int]) -> int | None:
        """Should the kernel write this open's bytes straight into the DRAM file? Only for a
        write-only open (O_RDWR files are worked on, and must stay movable while open;
        O_DIRECT ones too: tmpfs takes their writes unchecked, see DESIGN.md) of a file with
        nothing in it and nothing else open, in a directory whose files have been small
        enough to fit (tiering.KernelWritePolicy), or, if none was closed there yet, in the
        nearest directory above it where files were (*dirs*: `directories`). Returns the size
        the file is expected to reach if so, else None."""
        if (self.shim is None or flags & os.O_ACCMODE != os.O_WRONLY or node.size or node.opens
                or node.ino in self.backing):
            return None
        expected = next((e for d in dirs
                         if (e := self.kernel_write_policy.expected(d)) is not None), None)
        return expected if expected is not None and self.store.kernel_may_write(expected) else None

    def start_writing(self, ino: int, expected: int) -> Mode | None:
        """The first writer of a file the kernel writes straight into its DRAM file."""
        backing_id = self._backing_open(self.store.start_kernel_write(ino, expected))
        if backing_id is None:
            self.store.end_kernel_write(ino)
            return None
        self.store.pin_passthrough(ino, 0, reads=False)
        self.backing[ino] = [backing_id, 1]
        self.writers[ino] = 1
        return backing_id, False, True

    def _adopt_writer(self, node: Inode, flags: int) -> Mode | None:
        """A writable open of a file in passthrough mode: the kernel writes the file's DRAM
        file from now on, as for a new file (`start_writing`), and kvfs takes its bytes at
        the last writer's close. Not for O_DIRECT opens (their alignment rule), nor while an
        open of the file reads or writes through kvfs, whose checks would meet bytes the
        kernel changed: such an open carries the id with direct_io (docs/DESIGN.md)."""
        ino = node.ino
        if flags & os.O_DIRECT or self.host.via_daemon(ino):
            return None
        if self.store.kernel_written_size(ino) != node.size:  # its size becomes its DRAM file's
            return None
        if not self.store.adopt_kernel_write(ino):
            return None
        self.writers[ino] = 0
        return self._join_writing(node, writer=True)

    def _join_writing(self, node: Inode, writer: bool) -> Mode | None:
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

    def released(self, ino: int, backed: bool, writer: bool) -> None:
        """A handle of *ino* is released: one that carried its backing id, or was one of
        the writers of a file the kernel writes (its last one leaves the file to be taken)."""
        if backed:
            self._unback(ino)
            self.store.unpin_passthrough(ino)
        if writer:
            self.writers[ino] -= 1
            if not self.writers[ino]:
                self._pending_takes[ino] = None  # taken by run_takes
                self._take_wakeup.set()

    def closed_writable(self, node: Inode) -> None:
        """A writable open of *node* was closed: what size the files of its directory (and of
        the directories above it, `directories`) reach."""
        size = self.size(node)
        for d in self.directories(self._parent(node.ino)):
            self.kernel_write_policy.closed(d, size)

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

    # -- opens answered by the front thread (see the module docstring) --------------------
    def _may_fast_open(self, node: Inode) -> bool:
        """Is *node* a file the front thread may serve, once ready (and not in its table)?"""
        ino = node.ino
        return not (self.front is None or self.shim is None or ino in self.hot
                    or not node.is_reg or node.nlink == 0 or ino in self.writers
                    or ino in self._pending_takes
                    or node.size > FAST_OPEN_MAX_CHUNKS * self.store.cs
                    or self.store.reads_through(ino, node.size))

    def offer(self, node: Inode, ready: bool = False) -> None:
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
        """A prefetch is about to stage chunk *c* of *ino* in its DRAM file *fd* (a store
        event): if that is the whole file, and one the front thread may serve, enter it
        pending; the watch makes it ready."""
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
        """A prefetch staged a chunk of *ino* (a store event): offer the file once it is
        wholly in DRAM."""
        node = self.ns.inodes.get(ino)
        if node is not None and ino not in self.hot:
            self.offer(node)

    def revoke(self, ino: int) -> None:
        """The front thread answers no more opens of *ino*; those it did are handles now.
        Called before anything changes the file's DRAM copies or frees its data."""
        if ino in self.hot:
            del self.hot[ino]
            self.pending_hot.pop(ino, None)
            self.front.hot_revoke(ino)  # calls fast_opened for each notice still queued
            self._unback(ino)

    def fast_opened(self, ino: int, fh: int, flags: int, pid: int, sent: bool) -> None:
        """The front thread answered an OPEN of *ino* with *fh*; *sent* False: the reply did
        not reach the opener, so no RELEASE will come for *fh*."""
        try:
            if not sent:
                self.host.drop_handle(fh)
                return
            node = self.ns.inodes[ino]
            if ino in self.hot:
                self.hot.move_to_end(ino)
            self.readahead.opened(ino, flags, node.size, pid)
            self.store.pin_passthrough(ino, node.size)
            self.backing[ino][1] += 1
            self.host.add_opened(fh, node, flags, pid)
            self.readahead.read(ino, 0, node.size, pid)
            self.fast_opens += 1
        except Exception:
            log.exception("an open of inode %d answered by the front thread", ino)

    # -- takes: what the kernel wrote becomes the file's chunks ----------------------------
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
                await self.store.take_kernel_written(ino, done=not keep, on_commit=self.sized(node))
            else:
                self.store.end_kernel_write(ino)
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

    async def taken(self, ino: int) -> None:
        """Until *ino* is no file the kernel's writer left to be taken: taken now if it
        waits, or its take under way finished (an open or a truncation needs its bytes
        still and recorded)."""
        if ino in self._pending_takes:
            await self._take_now(ino)
        while (finishing := self._finishing.get(ino)) is not None:
            await finishing.wait()

    def waits_take(self, ino: int) -> bool:
        """Did *ino*'s last writer close, its take not begun yet? (Its release seals nothing:
        the take does.)"""
        return ino in self._pending_takes

    async def _take_now(self, ino: int) -> None:
        """Take *ino* now if it waits to be (an open or a truncation of it needs it taken).
        Until then it is still one the kernel writes: its size comes from its DRAM file
        (`size`) and it is not freed (`Host.maybe_free` asks `busy`)."""
        if ino not in self._pending_takes:
            return
        del self._pending_takes[ino]
        node = self.ns.inodes.get(ino)
        try:
            await self._end_writing(ino, node)
        finally:
            if node is not None:
                self.host.maybe_free(node)
        if node is not None:
            self.offer(node)  # taken: wholly in DRAM, every chunk checked
