"""DRAM tier: an arena of fixed-size chunk slots in one sparse file on tmpfs, mapped once.

Slot `i` lives at offset `i * chunk_size`. tmpfs allocates pages only where bytes are written,
so a 64 KiB chunk costs 64 KiB of RAM, not a whole slot; freeing a slot punches its pages out,
except for a small pool of *warm* slots kept populated: writing into fresh tmpfs pages costs a
page fault and a zeroing per 4 KiB (about half the speed of writing into populated ones).
Warm slots hold stale bytes past their new owner's length; the store never reads past a
chunk's length and zeroes any gap it creates (see ChunkStore._apply_write).
The file outlives the daemon, which is why a SIGKILL loses nothing: lmdb records which chunk
owns which slot, and slots nobody owns are free at the next mount.

A small `tag` file next to the arena holds the filesystem's uuid; a missing or foreign tag means
the DRAM contents are gone (reboot) or not ours, and the arena starts empty.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os

from kvfs.store.osutil import punch_hole

log = logging.getLogger(__name__)

PAGE = 4096


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

    def __init__(self, directory: str, fs_uuid: str, chunk_size: int, capacity: int) -> None:
        self.directory = directory
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
        if not self.survived:
            with open(tag_path + ".tmp", "w") as f:
                f.write(fs_uuid)
            os.replace(tag_path + ".tmp", tag_path)
        self._free: list[int] = []
        self._warm: list[int] = []  # free but still populated: fastest to write into
        # A few chunks' worth of populated pages: enough for a burst of writes to reuse them.
        self.warm_max = max(4, min(64 << 20, capacity // 16) // chunk_size)
        self._used_slots: set[int] = set()

    def adopt(self, used: dict[int, int]) -> None:
        """Start bookkeeping from the slots lmdb says are owned ({slot: bytes}); free the rest."""
        self._used_slots = set(used)
        self._warm = []
        self._free = [s for s in range(self.nslots - 1, -1, -1) if s not in self._used_slots]
        if self.survived:
            # Orphan slots (written but never committed before a crash) give their pages back.
            for s in self._free:
                self.punch(s, 0, self.chunk_size)

    def close(self) -> None:
        self.view.release()
        self.map.close()
        os.close(self.fd)

    # -- allocation ------------------------------------------------------------------------
    def alloc(self) -> int:
        if self._warm:
            slot = self._warm.pop()
        elif self._free:
            slot = self._free.pop()
        else:
            raise DramFull()
        self._used_slots.add(slot)
        return slot

    def free(self, slot: int, length: int) -> None:
        """Give the slot back: into the warm pool, or punched so the RAM returns."""
        self._used_slots.discard(slot)
        if len(self._warm) < self.warm_max:
            self._warm.append(slot)
            return
        self.punch(slot, 0, pages(length))
        self._free.append(slot)

    def write(self, slot: int, start: int, data) -> None:
        """Copy *data* into a slot at *start*. pwrite, not the mapping: the kernel fills fresh
        tmpfs pages without a page fault per 4 KiB."""
        off = slot * self.chunk_size + start
        done = os.pwrite(self.fd, data, off)
        if done != len(data):  # tmpfs writes are never short unless memory ran out
            raise OSError(errno.ENOSPC, f"short write to the DRAM arena ({done}/{len(data)})")

    def punch(self, slot: int, start: int, length: int) -> None:
        if length <= 0:
            return
        off = slot * self.chunk_size + start
        try:
            punch_hole(self.fd, off, length)
        except OSError:
            self.map[off:off + length] = bytes(length)  # same effect for readers, keeps the RAM

    @property
    def free_slots(self) -> int:
        return len(self._free) + len(self._warm)

    def slot_view(self, slot: int, length: int) -> memoryview:
        off = slot * self.chunk_size
        return self.view[off:off + length]

