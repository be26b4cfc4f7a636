"""DRAM tier: an arena of fixed-size chunk slots in one sparse file on tmpfs, mapped once.

Slot `i` lives at offset `i * chunk_size`. tmpfs allocates pages only where bytes are written,
so a 64 KiB chunk costs 64 KiB of RAM, not a whole slot. Filling fresh tmpfs pages is slow:
an allocation (or a page fault) and a zeroing per 4 KiB make pwrite into fresh pages ~4x
slower than into populated ones on the machines we measured (0.76 vs 3.0 GiB/s). So the
arena keeps pages: a freed slot stays *warm* (populated), and with `prefault` (the default)
the arena reserves its whole capacity up front, as inference engines do with their pinned
host-memory pools: a background task faults free slots in until the arena's RAM reaches the
capacity, and writes and NVMe reads then copy into populated pages. A small chunk in a
whole populated slot leaves the slot *fat* (populated past its chunk); over the capacity,
fat slots' tails are trimmed. Without `prefault`, warm slots hold at most WARM_SHARE of the
capacity and the rest of a freed slot's RAM goes back at once. Either way the arena's RAM
(`resident`) stays within the capacity.
Warm slots hold stale bytes past their new owner's length; the store never reads past a
chunk's length and zeroes any gap it creates (see ChunkStore._apply_write).
Punching a freed slot's pages takes tens of microseconds (tmpfs frees page by page), and a
run of demotions frees dozens of slots at once; with `defer_punches` set (by
ChunkStore.run_punches, while it runs) a freed slot that must give pages back is queued, and
its pages are punched in a worker thread before it can be taken again.
The file outlives the daemon, which is why a SIGKILL loses nothing: lmdb records which chunk
owns which slot, and slots nobody owns are free at the next mount.

A small `tag` file next to the arena holds the filesystem's uuid; a missing or foreign tag means
the DRAM contents are gone (reboot) or not ours, and the arena starts empty.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections import deque

from kvfs.store.osutil import populate_write, punch_hole

log = logging.getLogger(__name__)

PAGE = 4096
# Without prefault, populated-but-free slots may hold this share of the capacity: enough for
# bursts of demotion and promotion to reuse populated pages, little enough that deleted data
# gives most of its RAM back.
WARM_SHARE = 0.25


class DramFull(Exception):
    """No free slot in the arena (the caller must demote something first)."""


def is_tmpfs(path: str) -> bool:
    """True if *path* is on tmpfs (or ramfs-like shmem), judged from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mnt = parts[4].replace("\\040", " ")
            sep = parts.index("-")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, fstype = mnt, parts[sep + 1]
    return fstype in ("tmpfs", "ramfs")


def pages(n: int) -> int:
    """Bytes of RAM that *n* bytes of chunk data occupy."""
    return (n + PAGE - 1) & ~(PAGE - 1)


class DramArena:
    """Slot allocator over the mapped arena. Pure mechanism: what to evict is tiering's call."""

    def __init__(self, directory: str, fs_uuid: str, chunk_size: int, capacity: int,
                 prefault: bool = True) -> None:
        self.directory = directory
        self.prefault = prefault
        self.chunk_size = chunk_size
        self.capacity = capacity
        # Small chunks use a fraction of a slot, so allow more slots than capacity/chunk_size;
        # unused slots cost address space only.
        self.nslots = max(16, 8 * capacity // chunk_size)
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "arena")
        tag_path = os.path.join(directory, "tag")
        try:
            with open(tag_path) as f:
                tag = f.read().strip()
        except FileNotFoundError:
            tag = None
        self.survived = tag == fs_uuid and os.path.exists(self.path)
        if not self.survived:
            if tag is not None and tag != fs_uuid:
                log.warning("DRAM dir %s belonged to another kvfs (%s); starting it empty",
                            directory, tag)
            if os.path.exists(self.path):
                os.unlink(self.path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        size = self.nslots * chunk_size
        if os.fstat(self.fd).st_size < size:
            os.ftruncate(self.fd, size)
        else:
            self.nslots = os.fstat(self.fd).st_size // chunk_size
        self.map = mmap.mmap(self.fd, self.nslots * chunk_size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        self.view = memoryview(self.map)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))  # for madvise
        self._populate_by_madvise = True
        if not self.survived:
            with open(tag_path + ".tmp", "w") as f:
                f.write(fs_uuid)
            os.replace(tag_path + ".tmp", tag_path)
        self._free: list[int] = []
        self._warm: deque[int] = deque()  # free but populated: fastest to write into
        # Bytes of pages populated per slot (what its owners wrote since the last punch).
        self.populated = [0] * self.nslots
        self.resident = 0  # sum of populated: the arena's RAM
        # Bytes of pages a used slot's owner may hold (its chunk's length, page-rounded); a
        # used slot populated beyond that (a small chunk in a prefaulted slot) is *fat*: its
        # tail is RAM nobody reads, trimmed when the arena is over its capacity.
        self.need = [0] * self.nslots
        self._fat: set[int] = set()
        self.warm_bytes = 0  # ... of which in warm slots
        self.warm_max = capacity if prefault else int(WARM_SHARE * capacity)
        self._used_slots: set[int] = set()
        # Freed slots waiting for their pages to be punched: (slot, bytes kept, warm after).
        self._punching: list[tuple[int, int, bool]] = []
        self._leaving = 0  # bytes those punches will give back
        self.defer_punches = False
        self.on_punch_queued = lambda: None
        self.trimmed = 0  # fat slots' tails punched
        # Slots a worker thread is reading (a packed chunk being decoded) -> readers; a slot
        # freed meanwhile is given back when its last reader is done, never reused under it.
        self._pins: dict[int, int] = {}
        self._freed_pinned: set[int] = set()

    def adopt(self, used: dict[int, int]) -> None:
        """Start bookkeeping from the slots lmdb says are owned ({slot: bytes}); the others
        are free, warm where the surviving arena still has their pages."""
        self._used_slots = set(used)
        self.populated = self._scan_populated() if self.survived else [0] * self.nslots
        self.need = [0] * self.nslots
        for s, length in used.items():
            self.need[s] = pages(length)
            self.populated[s] = max(self.populated[s], self.need[s])
        self._fat = {s for s in used if self.populated[s] > self.need[s]}
        self.resident = sum(self.populated)
        self._warm, self._free, self.warm_bytes = deque(), [], 0
        for s in range(self.nslots - 1, -1, -1):
            if s in self._used_slots:
                continue
            held = self.populated[s]
            if held and self.warm_bytes + held <= self.warm_max and self.resident <= self.capacity:
                self._warm.append(s)  # a slot nobody owns (freed, or orphaned by a crash)
                self.warm_bytes += held
            else:
                self.punch(s, 0, self.chunk_size)
                self._free.append(s)

    def _scan_populated(self) -> list[int]:
        """Bytes populated per slot in the arena file (SEEK_DATA/SEEK_HOLE walk)."""
        out = [0] * self.nslots
        end = self.nslots * self.chunk_size
        pos = 0
        while pos < end:
            try:
                start = os.lseek(self.fd, pos, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: no data after pos
            stop = min(end, os.lseek(self.fd, start, os.SEEK_HOLE))
            while start < stop:
                slot = start // self.chunk_size
                upto = min(stop, (slot + 1) * self.chunk_size)
                out[slot] = max(out[slot], pages(upto - slot * self.chunk_size))
                start = upto
            pos = stop
        return out

    def close(self) -> None:
        """Unmap the arena. Free slots give their RAM back (chunks' pages stay: the next mount
        finds them, as after a crash)."""
        self.punch_queued(self.take_punches())
        for s in self._warm:
            self.punch(s, 0, self.chunk_size)
        self._warm.clear()
        self.view.release()
        self.map.close()
        os.close(self.fd)

    # -- allocation ------------------------------------------------------------------------
    def alloc(self, length: int = 0) -> int:
        """Take a free slot, populated if possible, for a chunk of up to *length* bytes."""
        return self.alloc_unfaulted(length)[0]

    def alloc_unfaulted(self, length: int) -> tuple[int, int]:
        """`alloc`, and where in the slot its pages stop being populated (>= *length*: all
        are), for a caller that will write through the mapping (see `ensure_pages`)."""
        if not self._warm and not self._free and self._punching:
            self.punch_queued([self._punching.pop()])  # the last free slots wait for a punch
        if self._warm:
            slot = self._warm.pop()
            self.warm_bytes -= self.populated[slot]
        elif self._free:
            slot = self._free.pop()
        else:
            raise DramFull()
        self._used_slots.add(slot)
        self.need[slot] = 0
        held = self.populated[slot]
        self.grow(slot, length)
        if self.populated[slot] > self.need[slot]:
            self._fat.add(slot)
        self._trim()
        return slot, held

    def grow(self, slot: int, end: int) -> None:
        """The owner of *slot* may now hold bytes up to *end* (it writes there next)."""
        if pages(end) > self.need[slot]:
            self.need[slot] = pages(end)
            if self.need[slot] >= self.populated[slot]:
                self._fat.discard(slot)
        self._populate(slot, end)

    def _populate(self, slot: int, end: int) -> None:
        grown = pages(end) - self.populated[slot]
        if grown > 0:
            self.populated[slot] += grown
            self.resident += grown
        if self.resident - self._leaving > self.capacity:
            self._trim()

    def _trim(self) -> None:
        """Over the capacity: punch fat slots' unused tails (on this thread: the owner may
        write into its slot right after) until the arena is within it again."""
        while self._fat and self.resident - self._leaving > self.capacity:
            slot = self._fat.pop()
            self.punch(slot, self.need[slot], self.chunk_size - self.need[slot])
            self.trimmed += 1

    def pin(self, slot: int) -> None:
        """A worker thread is about to read *slot*: a `free` waits until `unpin`."""
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> None:
        left = self._pins.pop(slot) - 1
        if left:
            self._pins[slot] = left
        elif slot in self._freed_pinned:
            self._freed_pinned.discard(slot)
            self.free(slot, 0)

    def free(self, slot: int, length: int) -> None:
        """Give the slot back: warm (still populated) while the RAM budget allows, else
        punched so its RAM returns. Over the budget, only the excess is punched: the rest of
        the slot stays warm for the next chunk (a small chunk in a prefaulted slot would
        otherwise make every later free punch a whole slot, and every alloc fault it in)."""
        if slot in self._pins:
            self._freed_pinned.add(slot)
            return
        self._used_slots.discard(slot)
        self._fat.discard(slot)
        self.need[slot] = 0
        held = self.populated[slot]
        resident = self.resident - self._leaving
        keep = held
        if held and resident > self.capacity:
            keep = max(0, held - pages(resident - self.capacity))
        if not (keep and self.warm_bytes + keep <= self.warm_max
                and resident - (held - keep) <= self.capacity):
            keep = 0
        if keep == held and keep:
            self._warm.append(slot)
            self.warm_bytes += held
        elif self.defer_punches:
            self._punching.append((slot, keep, keep > 0))
            self._leaving += held - keep
            self.on_punch_queued()
        else:
            self.punch(slot, keep, self.chunk_size - keep)
            self._settle(slot, keep > 0)

    def _settle(self, slot: int, warm: bool) -> None:
        """A freed slot whose pages beyond what it keeps are gone: warm or free."""
        if warm and self.populated[slot]:
            self._warm.append(slot)
            self.warm_bytes += self.populated[slot]
        else:
            self._free.append(slot)

    # -- punches in a worker thread (defer_punches) -------------------------------------------
    @property
    def pending_punches(self) -> int:
        return len(self._punching)

    def take_punches(self) -> list[tuple[int, int, bool]]:
        batch, self._punching = self._punching, []
        return batch

    def punch_many(self, batch: list[tuple[int, int, bool]]) -> list[bool]:
        """Worker thread: punch each queued slot beyond what it keeps. The slots belong to
        nobody meanwhile; no bookkeeping is touched here. Returns, per slot, whether its
        pages went (False: the kernel refused and the bytes were zeroed in place)."""
        return [self._drop_pages(slot, keep, self.chunk_size - keep) for slot, keep, _ in batch]

    def punched(self, batch: list[tuple[int, int, bool]], done: list[bool]) -> None:
        """The punches of *batch* are done: account for them and give the slots out again."""
        for (slot, keep, warm), ok in zip(batch, done, strict=True):
            gone = self.populated[slot] - keep
            self._leaving -= max(0, gone)
            if ok and gone > 0:
                self.resident -= gone
                self.populated[slot] = keep
            self._settle(slot, warm)

    def punch_queued(self, batch: list[tuple[int, int, bool]]) -> None:
        """Punch *batch* now, on the calling thread."""
        self.punched(batch, self.punch_many(batch))

    # -- prefaulting (the reserved arena) ---------------------------------------------------
    def to_prefault(self, nbytes: int) -> list[int]:
        """Take free unpopulated slots, up to *nbytes* and within the capacity, for the
        caller to populate (fill them, then hand them back with `prefaulted`)."""
        out: list[int] = []
        room = min(nbytes, self.capacity - self.resident)
        while self._free and room >= self.chunk_size:
            out.append(self._free.pop())
            room -= self.chunk_size
            self.resident += self.chunk_size  # counted now: allocations meanwhile see it
        return out

    def fill(self, slots: list[int]) -> None:
        """Populate whole slots (worker thread: the slots belong to nobody meanwhile).

        By a write fault of every page, not fallocate: tmpfs leaves fallocated pages
        unwritten, so the first write into them still pays the zeroing, and in a VM the
        host's own first touch (here a 256 KiB pwrite into a fallocated slot took ~370 us,
        into a faulted-in one ~45 us; `tools/bench_fs.py --configs kvfs-dram` writes)."""
        cs = self.chunk_size
        for s in slots:
            if not self._fault_in(s * cs, cs):
                os.posix_fallocate(self.fd, s * cs, cs)

    def _fault_in(self, offset: int, length: int) -> bool:
        """Write-fault the arena's pages of [offset, offset+length) in (MADV_POPULATE_WRITE).
        False: this kernel (before 5.14) cannot; OSError: the tmpfs has no room (EFAULT)."""
        if not self._populate_by_madvise:
            return False
        try:
            populate_write(self._base + offset, length)
            return True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self._populate_by_madvise = False
            return False

    def prefaulted(self, slots: list[int], ok: bool = True) -> None:
        """The slots from `to_prefault` are populated (or, not *ok*, given back as they were)."""
        for s in slots:
            if ok:
                self.populated[s] = self.chunk_size
                self._warm.appendleft(s)  # behind the recently freed ones, still in cache
                self.warm_bytes += self.chunk_size
            else:  # a fill cut short (tmpfs full) may have left some pages: drop them
                self._drop_pages(s, 0, self.chunk_size)
                self.resident -= self.chunk_size
                self._free.append(s)

    def write(self, slot: int, start: int, data) -> None:
        """Copy *data* into a slot at *start*. pwrite, not the mapping: the kernel fills fresh
        tmpfs pages without a page fault per 4 KiB."""
        off = slot * self.chunk_size + start
        self.grow(slot, start + len(data))
        done = os.pwrite(self.fd, data, off)
        if done != len(data):  # tmpfs writes are never short unless memory ran out
            raise OSError(errno.ENOSPC, f"short write to the DRAM arena ({done}/{len(data)})")

    def copy_in(self, slot: int, data) -> bool:
        """Worker thread: `write` *data* at the start of a slot taken with `alloc(len(data))`
        (which did the bookkeeping). False: the tmpfs has no room for its pages."""
        try:
            return os.pwrite(self.fd, data, slot * self.chunk_size) == len(data)
        except OSError:
            return False

    def punch(self, slot: int, start: int, length: int) -> None:
        """Drop the pages of [start, start+length) of a slot (page-aligned start)."""
        if length <= 0 or not self._drop_pages(slot, start, length):
            return
        if start + length >= self.populated[slot] > start:
            self.resident -= self.populated[slot] - start
            self.populated[slot] = start

    def _drop_pages(self, slot: int, start: int, length: int) -> bool:
        """The system call behind a punch (any thread; no bookkeeping). False: the kernel
        refused, and the bytes were zeroed instead (same effect for readers, keeps the RAM)."""
        off = slot * self.chunk_size + start
        try:
            punch_hole(self.fd, off, length)
            return True
        except OSError:
            self.map[off:off + length] = bytes(length)
            return False

    @property
    def free_slots(self) -> int:
        # queued slots count (alloc punches one itself if it must); a batch a worker is
        # punching right now does not
        return len(self._free) + len(self._warm) + len(self._punching)

    def ensure_pages(self, slot: int, start: int, length: int) -> bool:
        """Make the pages of [start, length) of a slot present before they are written
        through the mapping (any thread; *start* from `alloc_unfaulted`). False: the tmpfs
        has no room for them (the write would have been SIGBUS). Before Linux 5.14 this
        cannot be checked: True."""
        if start >= length:
            return True
        try:
            self._fault_in(slot * self.chunk_size + start, pages(length) - start)
            return True
        except OSError:
            return False

    def slot_view(self, slot: int, length: int) -> memoryview:
        off = slot * self.chunk_size
        return self.view[off:off + length]

