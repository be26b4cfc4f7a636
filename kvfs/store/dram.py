"""DRAM tier: one sparse tmpfs file per inode, each chunk at its own offset in it.

Chunk c of inode i lives in `<dram_dir>/files/<i in hex>` at bytes [c * chunk_size,
c * chunk_size + length): the *region* of (i, c). So a file whose chunks are all in DRAM is,
byte for byte, the file the engine wrote, and the kernel can serve reads of it straight from
tmpfs through FUSE passthrough, with no request to the daemon (kvfs/fs.py). tmpfs only
allocates pages where bytes were written: a 64 KiB chunk costs 64 KiB of RAM.

This module is mechanism only; the chunk store keeps these rules:
- A region holds bytes only while lmdb names it as the chunk's DRAM copy (or while an NVMe
  read that `claim`ed it fills it). Every other byte of a DRAM file is a hole, so it reads as
  zeros: the tail of a short chunk, the chunks on NVMe only, the holes of a sparse file.
  `adopt` restores this at mount after a crash; at run time a region is punched when it is
  `release`d (after the commit that stops naming it).
- A DRAM file is never longer than the file it mirrors (so that a passthrough reader never
  reads past the file's end): the store shrinks it on truncation.
- A file is kept while it holds a claimed region or is `pin`ned (open in passthrough mode);
  then it is disposed of: renamed into `trash/` at once (cheap) and unlinked and closed in a
  worker thread (freeing a file's pages takes tens of microseconds per MiB, which FUSE
  requests queued behind the trio thread would wait for).

A small `tag` file holds the filesystem's uuid; a missing or foreign tag means the DRAM
contents are gone (reboot) or not ours, and the tier starts empty.

Worker threads read and write regions through a held file (`hold`/`drop`): its descriptor
stays open, even if the file is disposed of meanwhile, until the last holder drops it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import itertools
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvfs.store.osutil import punch_hole

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2

log = logging.getLogger(__name__)

PAGE = 4096
# Descriptors of DRAM files kept open (least recently used closed first): opening a tmpfs
# file costs a few microseconds, a descriptor nothing, but the process has a limit (the
# daemon raises it and may ask for fewer: kvfs.daemon.descriptor_budget).
OPEN_FILES = 4096
# A disposed DRAM file holding at most this much RAM is removed on the spot (`dispose`):
# unlinking a 4 KiB tmpfs file takes ~11 us, a 64 KiB one ~26, a 256 KiB one ~75; the rename
# into the trash ~40 while the worker unlinks there.
FREE_AT_ONCE = 64 << 10


def _mounts() -> list[tuple[str, str, str]]:
    """(mountpoint, fstype, source) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            sep = parts.index("-")
            out.append((parts[4].replace("\\040", " "), parts[sep + 1], parts[sep + 2]))
    return out


def is_tmpfs(path: str) -> bool:
    """True if *path* is on tmpfs (or ramfs-like shmem), judged from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    for mnt, kind, _ in _mounts():
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, kind
    return fstype in ("tmpfs", "ramfs")


def own_tmpfs(directory: str, size: int) -> str:
    """Mount a tmpfs with transparent huge pages at *directory* for the DRAM tier, unless it
    is a mountpoint already or holds anything (a DRAM tier kept from before must not be
    hidden). Returns what was done, for the log; never raises (the tier works without)."""
    if os.path.ismount(directory):
        return f"{directory} is a mount already: kept as it is"
    if os.path.isdir(directory) and os.listdir(directory):
        return f"{directory} holds a DRAM tier already: no huge-page tmpfs mounted over it"
    os.makedirs(directory, mode=0o700, exist_ok=True)
    opts = f"size={size},huge=within_size,mode=0700".encode()
    if _libc.mount(b"kvfs-dram", directory.encode(), b"tmpfs", MS_NOSUID | MS_NODEV,
                   opts) != 0:
        err = ctypes.get_errno()
        return f"no huge-page tmpfs at {directory} ({os.strerror(err)}): using the directory"
    return f"mounted a huge-page tmpfs of {size >> 20} MiB at {directory}"


def remove_dram_dir(directory: str) -> None:
    """Delete a DRAM tier for good (benchmarks, tests): its tmpfs of its own unmounted
    (`own_tmpfs`), its files removed."""
    if os.path.ismount(directory) and _mount_source(directory) == "kvfs-dram":
        _libc.umount2(directory.encode(), MNT_DETACH)
    shutil.rmtree(directory, ignore_errors=True)


def _mount_source(path: str) -> str | None:
    real = os.path.realpath(path)
    return next((source for mnt, _, source in _mounts() if mnt == real), None)


def pages(n: int) -> int:
    """Bytes of RAM that *n* bytes of chunk data occupy."""
    return (n + PAGE - 1) & ~(PAGE - 1)


@dataclass(eq=False)
class DramFile:
    """An open DRAM file. `users`: worker threads holding it; `gone`: disposed of (renamed
    into the trash), closed when the last holder drops it."""

    ino: int
    fd: int
    users: int = 0
    gone: bool = False


class DramFiles:
    """The DRAM files of one mount: descriptors, claimed regions, pins, disposal."""

    def __init__(self, directory: str, fs_uuid: str, chunk_size: int, capacity: int,
                 max_fds: int = OPEN_FILES) -> None:
        self.directory = directory
        self.max_fds = max_fds
        self.chunk_size = chunk_size
        self.capacity = capacity
        self.files_dir = os.path.join(directory, "files")
        self.trash_dir = os.path.join(directory, "trash")
        tag_path = os.path.join(directory, "tag")
        os.makedirs(directory, exist_ok=True)
        try:
            with open(tag_path) as f:
                tag = f.read().strip()
        except FileNotFoundError:
            tag = None
        # The previous layout (one arena file of slots) is migrated by the chunk store.
        self.arena_path = os.path.join(directory, "arena")
        self.survived = tag == fs_uuid
        if not self.survived:
            if tag is not None:
                log.warning("DRAM dir %s belonged to another kvfs (%s); starting it empty",
                            directory, tag)
            for name in ("files", "trash"):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            if os.path.exists(self.arena_path):
                os.unlink(self.arena_path)
        os.makedirs(self.files_dir, exist_ok=True)
        shutil.rmtree(self.trash_dir, ignore_errors=True)  # what a crash left to unlink
        os.makedirs(self.trash_dir, exist_ok=True)
        if not self.survived:
            with open(tag_path + ".tmp", "w") as f:
                f.write(fs_uuid)
            os.replace(tag_path + ".tmp", tag_path)
        self._open: OrderedDict[int, DramFile] = OrderedDict()
        self.claims: dict[int, int] = {}  # ino -> regions claimed (chunks held or filling)
        # (ino, chunk) -> a number that changes with every claim of the region: a worker
        # that read a region can tell whether it was released and claimed again meanwhile.
        self.claim_ids: dict[tuple[int, int], int] = {}
        self._claim_seq = itertools.count(1)
        self.pins: dict[int, int] = {}  # ino -> passthrough opens (file must stay)
        # Regions whose bytes this daemon has checked against their chunk's checksum (or
        # written from bytes of that checksum) since they last changed: ino -> {chunk: the
        # chunk's seq then}. Every change of a region's bytes made through this class
        # forgets its entry, whoever asked for it, so that a bug writing into the wrong
        # region is still caught by the next check (dram_verify=once).
        self._checked: dict[int, dict[int, int]] = {}
        self._released: dict[int, list[tuple[int, int]]] = {}  # ino -> [(start, length)]
        self._trash_seq = itertools.count()
        self.freed_at_once = 0  # disposed of without the trash (`dispose`)
        self._disposals: list[tuple[str, int]] = []  # (trash path, fd or -1) to remove
        self.on_disposal_queued: Callable[[], None] = lambda: None

    def path(self, ino: int) -> str:
        return os.path.join(self.files_dir, f"{ino:x}")

    # -- checked regions (see _checked) ------------------------------------------------------
    def mark_checked(self, ino: int, c: int, seq: int) -> None:
        self._checked.setdefault(ino, {})[c] = seq

    def checked(self, ino: int, c: int, seq: int, consume: bool = False) -> bool:
        """Was region (ino, c) checked as holding the chunk of *seq*, and not changed since?
        With *consume*, the answer holds for this one read only."""
        marks = self._checked.get(ino)
        if marks is None:
            return False
        got = marks.pop(c, None) if consume else marks.get(c)
        return got == seq

    def forget(self, ino: int, c: int | None = None) -> None:
        """Region (ino, c), or every region of *ino* (c None), may change: drop its marks."""
        marks = self._checked.get(ino)
        if marks is None:
            return
        if c is None:
            del self._checked[ino]
        else:
            marks.pop(c, None)

    def _forget_range(self, ino: int, start: int, length: int) -> None:
        marks = self._checked.get(ino)
        if marks:
            first, last = start // self.chunk_size, (start + length - 1) // self.chunk_size
            for c in [c for c in marks if first <= c <= last]:
                del marks[c]

    # -- mount and unmount -------------------------------------------------------------------
    def adopt(self, owned: dict[int, list[tuple[int, int]]]) -> None:
        """Start from the regions lmdb names ({ino: [(chunk, length)]}, lengths in bytes of
        the region). Files nobody owns are removed; in the others, every byte outside an
        owned region is punched and the file cut after its last region (what a crash can
        leave: a fetch's bytes never committed, a truncation half done)."""
        self.claims = {ino: len(regions) for ino, regions in owned.items()}
        self.claim_ids = {(ino, c): next(self._claim_seq)
                          for ino, regions in owned.items() for c, _ in regions}
        for name, ino in self._listing():
            if ino not in owned:
                os.unlink(os.path.join(self.files_dir, name))
                continue
            keep = sorted((c * self.chunk_size, c * self.chunk_size + n) for c, n in owned[ino])
            fd = os.open(os.path.join(self.files_dir, name), os.O_RDWR)
            try:
                end = keep[-1][1] if keep else 0
                if os.fstat(fd).st_size > end:
                    os.ftruncate(fd, end)
                pos = 0
                for start, stop in keep + [(end, end)]:
                    if start > pos:
                        punch_hole(fd, pos, start - pos)
                    pos = max(pos, stop)
            finally:
                os.close(fd)

    def missing(self, ino: int) -> bool:
        """True if the DRAM file of *ino* does not exist (checked at mount)."""
        return not os.path.exists(self.path(ino))

    def present(self) -> set[int]:
        """The inodes that have a DRAM file (one directory listing: at mount, a stat per
        file was 0.4 s per 100,000 files)."""
        return {ino for _, ino in self._listing() if ino >= 0}

    def _listing(self) -> list[tuple[str, int]]:
        """(name, inode) of every file in the DRAM directory; -1 for a name that is not
        an inode number (nobody's)."""
        out = []
        for name in os.listdir(self.files_dir):
            try:
                out.append((name, int(name, 16)))
            except ValueError:
                out.append((name, -1))
        return out

    def close(self) -> None:
        """Close every descriptor and finish the queued disposals (unmount)."""
        self.dispose_many(self.take_disposals())
        for f in self._open.values():
            os.close(f.fd)
        self._open.clear()

    # -- descriptors -------------------------------------------------------------------------
    def fd(self, ino: int) -> int:
        """The descriptor of *ino*'s DRAM file, created (empty) if it does not exist."""
        f = self._open.get(ino)
        if f is not None:
            self._open.move_to_end(ino)
            return f.fd
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(self.path(ino), flags, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE) or not self._open:
                raise
            # Out of descriptors after all (something else holds many): give back the
            # cached ones nobody uses, and keep fewer from now on.
            self.max_fds = max(16, len(self._open) // 2)
            log.warning("out of file descriptors with %d DRAM files open: keeping at most %d",
                        len(self._open), self.max_fds)
            self._close_some(keep=0)
            fd = os.open(self.path(ino), flags, 0o600)
        f = DramFile(ino, fd)
        self._open[ino] = f
        if len(self._open) > self.max_fds:
            self._close_some()
        return f.fd

    def _close_some(self, keep: int | None = None) -> None:
        """Close the least recently used descriptors nobody holds, down to *keep* open (by
        default half the cache: closing one per open would cost a syscall each time)."""
        keep = self.max_fds // 2 if keep is None else keep
        for ino in list(itertools.islice(self._open, max(0, len(self._open) - keep))):
            f = self._open[ino]
            if f.users == 0:
                del self._open[ino]
                os.close(f.fd)

    def hold(self, ino: int) -> DramFile:
        """Keep *ino*'s DRAM file open for a worker thread until `drop`."""
        self.fd(ino)
        f = self._open[ino]
        f.users += 1
        return f

    def drop(self, f: DramFile) -> None:
        f.users -= 1
        if f.users == 0 and f.gone:
            self._queue_disposal("", f.fd)

    # -- regions -----------------------------------------------------------------------------
    def claim(self, ino: int, c: int) -> None:
        """Region (ino, c) is about to receive a chunk's bytes."""
        self.claims[ino] = self.claims.get(ino, 0) + 1
        self.claim_ids[(ino, c)] = next(self._claim_seq)
        self.forget(ino, c)

    def unclaim(self, ino: int) -> None:
        """Undo a `claim` whose region turned out to be someone else's (nothing to punch)."""
        left = self.claims.get(ino, 0) - 1
        if left > 0:
            self.claims[ino] = left
        else:
            self.claims.pop(ino, None)

    def release(self, ino: int, c: int, length: int) -> None:
        """Region (ino, c) no longer holds anything: its pages go at the next `settle`."""
        self.claim_ids.pop((ino, c), None)
        self.forget(ino, c)
        self.unclaim(ino)
        self._released.setdefault(ino, []).append((c * self.chunk_size, pages(length)))

    def settle(self) -> None:
        """Give back the pages of the regions released since the last call: whole files
        nobody holds any more are disposed of, other regions punched (runs after every
        commit, once its released regions are known)."""
        released, self._released = self._released, {}
        for ino, regions in released.items():
            if ino not in self.claims and ino not in self.pins:
                self.dispose(ino)
                continue
            if regions and not self.missing_open(ino):
                fd = self.fd(ino)
                for start, length in regions:
                    self._punch(fd, start, length)

    def punch(self, ino: int, start: int, length: int) -> None:
        """Drop the pages of [start, start+length) of *ino*'s DRAM file (reads give zeros)."""
        if length > 0 and not self.missing_open(ino):
            self._forget_range(ino, start, length)
            self._punch(self.fd(ino), start, length)

    def missing_open(self, ino: int) -> bool:
        return ino not in self._open and not os.path.exists(self.path(ino))

    @staticmethod
    def _punch(fd: int, start: int, length: int) -> None:
        try:
            punch_hole(fd, start, length)
        except OSError as exc:  # tmpfs always punches; zeroing keeps the rule, not the RAM
            log.warning("DRAM tier: punching failed (%s); zeroing instead", exc)
            os.pwrite(fd, bytes(length), start)

    def truncate(self, ino: int, size: int) -> None:
        """The file is now *size* bytes: cut its DRAM file if it is longer."""
        if self.missing_open(ino):
            return
        fd = self.fd(ino)
        if os.fstat(fd).st_size > size:
            self._forget_range(ino, size, 1 << 62)
            os.ftruncate(fd, size)

    def extend(self, ino: int, size: int) -> int:
        """Make *ino*'s DRAM file at least *size* bytes long (a passthrough reader must see
        the file's whole length: the kernel stops at the backing file's end) and return its
        descriptor."""
        fd = self.fd(ino)
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return fd

    def size(self, ino: int) -> int:
        """Length of *ino*'s DRAM file (0 if it has none)."""
        return 0 if self.missing_open(ino) else os.fstat(self.fd(ino)).st_size

    def ram(self, ino: int) -> int:
        """Bytes of RAM *ino*'s DRAM file holds (0 if it has none)."""
        return 0 if self.missing_open(ino) else os.fstat(self.fd(ino)).st_blocks * 512

    def data_chunks(self, ino: int) -> list[int]:
        """Chunks of *ino*'s DRAM file that hold any data (a SEEK_DATA/SEEK_HOLE walk): what
        a writer put there without telling us (passthrough writes)."""
        if self.missing_open(ino):
            return []
        return self._data_chunks(self.fd(ino), self.chunk_size)

    @staticmethod
    def _data_chunks(fd: int, chunk_size: int) -> list[int]:
        end = os.fstat(fd).st_size
        out: list[int] = []
        pos = 0
        while pos < end:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            stop = min(end, os.lseek(fd, start, os.SEEK_HOLE))
            first, last = start // chunk_size, (stop - 1) // chunk_size
            out.extend(c for c in range(first, last + 1) if not out or c > out[-1])
            pos = stop
        return out

    # -- byte movement (trio thread; workers use held files) ---------------------------------
    def write(self, ino: int, c: int, start: int, data) -> None:
        """Copy *data* into region (ino, c) at *start*."""
        off = c * self.chunk_size + start
        self.forget(ino, c)
        done = os.pwrite(self.fd(ino), data, off)
        if done != len(data):  # tmpfs writes are never short unless memory ran out
            raise OSError(errno.ENOSPC, f"short write to the DRAM tier ({done}/{len(data)})")

    def read_into(self, ino: int, c: int, buf) -> None:
        """Fill *buf* (a writable buffer) from the start of region (ino, c)."""
        self.read_region(self.fd(ino), self.chunk_size * c, buf)

    @staticmethod
    def read_region(fd: int, offset: int, buf) -> None:
        """pread *buf* full from *offset* (any thread); a short read means the file is
        shorter than the region (a chunk store bug or tampering): the rest reads as zeros."""
        view = memoryview(buf)
        done = os.preadv(fd, [view], offset)
        if done < len(view):
            view[done:] = bytes(len(view) - done)

    # -- passthrough pins ----------------------------------------------------------------------
    def pin(self, ino: int) -> None:
        """*ino* is open in passthrough mode: its file must stay (the kernel reads it)."""
        self.pins[ino] = self.pins.get(ino, 0) + 1

    def unpin(self, ino: int) -> None:
        left = self.pins.pop(ino) - 1
        if left:
            self.pins[ino] = left
        elif ino not in self.claims:
            self._released.setdefault(ino, [])
            self.settle()

    # -- disposal ------------------------------------------------------------------------------
    def dispose(self, ino: int) -> None:
        """Remove *ino*'s DRAM file: renamed into the trash now, its pages freed by a worker
        (`dispose_many`). Holders keep their descriptor until they drop it. A small file
        nobody holds goes at once (FREE_AT_ONCE): freeing its few pages costs less than
        the rename, which waits for the trash directory while the worker unlinks there."""
        f = self._open.pop(ino, None)
        self.forget(ino)
        if f is not None and not f.users and os.fstat(f.fd).st_blocks * 512 <= FREE_AT_ONCE:
            f.gone = True
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(ino))
            try:
                os.close(f.fd)
            except OSError as exc:
                log.warning("DRAM tier: closing a DRAM file failed: %s", exc)
            self.freed_at_once += 1
            return
        trash = os.path.join(self.trash_dir, f"{ino:x}.{next(self._trash_seq)}")
        try:
            os.rename(self.path(ino), trash)
        except FileNotFoundError:
            trash = ""
        if f is None:
            if trash:
                self._queue_disposal(trash, -1)
            return
        f.gone = True
        if f.users:
            if trash:
                self._queue_disposal(trash, -1)  # unlinked now, closed by the last drop
            return
        self._queue_disposal(trash, f.fd)

    def _queue_disposal(self, trash: str, fd: int) -> None:
        self._disposals.append((trash, fd))
        self.on_disposal_queued()

    @property
    def pending_disposals(self) -> int:
        return len(self._disposals)

    def take_disposals(self) -> list[tuple[str, int]]:
        batch, self._disposals = self._disposals, []
        return batch

    @staticmethod
    def dispose_many(batch: list[tuple[str, int]]) -> None:
        """Any thread: unlink trashed files and close their descriptors (the pages go with
        the last of the two). Never raises: each is done once, whatever happens."""
        for trash, fd in batch:
            if trash:
                try:
                    os.unlink(trash)
                except OSError as exc:
                    log.warning("DRAM tier: cannot remove %s: %s", trash, exc)
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError as exc:
                    log.warning("DRAM tier: closing a DRAM file failed: %s", exc)

    @property
    def open_files(self) -> int:
        return len(self._open)
