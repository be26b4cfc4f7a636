"""The files the kernel reads or writes itself, in their DRAM files (FUSE passthrough).

`PassthroughReads`: a file whose chunks are all raw DRAM copies that check out may be opened
so that the kernel reads its DRAM file without the daemon; its DRAM copies are pinned until
the last such open is released, and pinned files hold at most PASSTHROUGH_SHARE of the tier.

`KernelWritten`: a kernel-written file is one the kernel writes straight into its DRAM file
(a new file, or an adopted one that was wholly in DRAM); what it writes becomes the file's
chunks only when it is taken (`KernelWritten.take`: at an fsync, or at its last close). It
is recorded in lmdb's `writers` first, so that a mount after a crash takes what the DRAM
file holds (kvfs/store/recovery.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from kvfs.nursery import open_nursery
from kvfs.store.codec import CODEC_RAW
from kvfs.store.dram import pages
from kvfs.store.location import IN_DRAM, LOST, PACKED, SEALED, TAIL_LOST, ChunkError, Loc
from kvfs.store.meta import u64
from kvfs.store.osutil import mapped_shared_writable
from kvfs.store.readthrough import PROMOTE_SHARE

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)
# A file opened for reading with chunks on NVMe only is staged whole in DRAM before the open
# returns, so that the kernel reads it from there (passthrough), if it is at most this long:
# the open then waits for all of it, which a reader of a KV block wants anyway.
STAGE_FILE_MAX = 64 << 20
# Files open in passthrough mode cannot lose their DRAM copies; they may hold at most this
# share of the tier, so that writes always find room to demote into.
PASSTHROUGH_SHARE = 0.5
# Kernel-written files: what they write is only counted when they are taken, so at most this
# many at once, each expected to take at most this share of the DRAM tier's free room (and of
# the store's); the room promised to them (their expected sizes) counts as used until then.
KERNEL_WRITTEN_MAX = 16
KERNEL_WRITTEN_ROOM_SHARE = 0.25


class PassthroughReads:
    """Opens the kernel serves from a file's DRAM file: the checks before, the pins during."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.dram = store.dram
        self.chunks = store.chunks
        self.counters = store.counters
        # Files open in passthrough mode -> DRAM bytes they held when first opened.
        self._pinned: dict[int, int] = {}
        self.pinned_bytes = 0

    async def ready(self, ino: int, size: int) -> bool:
        """May the kernel serve reads of this file from its DRAM file? Only if every chunk
        is in DRAM, raw, and checks out now (the reads will not come here to be checked: an
        open verifies what a handle's reads would), and the pinned files stay within
        PASSTHROUGH_SHARE of the tier. True means: pin it now (`pin`), with no
        await in between."""
        locs = self._raw_in_dram(ino, size)
        if locs is None:
            return False
        need = sum(pages(loc.raw_len) for _, loc in locs)
        if (ino not in self.dram.pins
                and self.pinned_bytes + need > PASSTHROUGH_SHARE * self.dram.capacity):
            return False
        check = [(c, loc) for c, loc in locs if self.store.check_needed(ino, c, loc, consume=False)]
        self.counters.dram_checks += len(check)
        sums = await self.store.hash_chunks(ino, check)
        if any(self.chunks.get(ino, c) != loc for c, loc in locs):
            return False  # changed meanwhile: the ordinary path decides
        # A mismatch is left to the ordinary path, which reports it (EIO) chunk by chunk.
        if any(csum != loc.checksum for (_, loc), csum in zip(check, sums, strict=True)):
            return False
        for c, loc in check:
            self.store.mark_checked(ino, c, loc)
        return True

    async def stage(self, ino: int, size: int) -> int:
        """Bring a file's NVMe-only chunks into DRAM (clean, raw copies), all at once, for an
        open that will then be served from DRAM by the kernel. Returns how many were read
        from NVMe, or -1 if the file is too long, DRAM has no room (nothing is evicted for
        this) or a chunk could not be staged: the open then goes the ordinary way."""
        todo = [(c, loc) for c in self.chunks.index.chunks_of(ino, self.chunks.nchunks(size))
                if (loc := self.chunks.get(ino, c)).dram_slot < 0]
        if not todo:
            return 0
        if self.store.through.reads(ino, size):
            return -1
        need = sum(pages(loc.raw_len) for _, loc in todo)
        if (size > STAGE_FILE_MAX or any(loc.flags & LOST for _, loc in todo)
                or not self.store.promotion_room(need)):
            return -1
        t0 = time.perf_counter()
        # A chunk whose prefetch was already in flight is a (late) prefetch hit, as on the
        # daemon's read path; every other one is this open's NVMe read, whoever fetches it.
        late = {c for c, _ in todo if self.store.fetches.late((ino, c))}

        async def stage(c: int, loc: Loc) -> None:
            try:
                await self.store.fetches.fetch(ino, c, loc,
                                               stage=self.dram.capacity * PROMOTE_SHARE,
                                               raw=True, want=False)
            except ChunkError as exc:
                log.warning("staging for an open: %s", exc)  # its read will say EIO
            now = self.chunks.get(ino, c)
            if now is not None and now.dram_slot >= 0 and not now.flags & PACKED:
                self.dram.mark_checked(ino, c, now.seq)  # fetch checked these bytes

        async with open_nursery() as nursery:
            for c, loc in todo:
                nursery.start_soon(stage, c, loc)
        if any((loc := self.chunks.get(ino, c)) is None or loc.dram_slot < 0 for c, _ in todo):
            return -1
        fetched = len(todo) - len(late)
        self.counters.prefetch_late += len(late)
        self.counters.chunks_from_nvme += fetched
        self.counters.staged_chunks += fetched
        for _ in range(fetched):
            self.store.record_latency(t0, self.counters.read_latency_nvme_us)
        return fetched

    def fd(self, ino: int, size: int) -> int | None:
        """The DRAM file of *ino*, at the file's size, if a passthrough open would find it
        ready now with nothing left to check (every chunk in DRAM, raw, checked since it
        last changed); else None. Synchronous: `ready` without the hashing."""
        locs = self._raw_in_dram(ino, size) if size > 0 else None
        if locs is None or any(self.store.check_needed(ino, c, loc, consume=False)
                               for c, loc in locs):
            return None
        return self.dram.extend(ino, size)

    def _raw_in_dram(self, ino: int, size: int) -> list[tuple[int, Loc]] | None:
        """Every chunk of the file with its location, if all are raw DRAM copies that no
        fetch is filling; else None (a lost tail must read as EIO, which only we can say)."""
        locs = []
        for c in self.chunks.index.chunks_of(ino, self.chunks.nchunks(size)):
            loc = self.chunks.get(ino, c)
            if (loc.dram_slot < 0 or loc.flags & (PACKED | LOST | TAIL_LOST)
                    or self.store.fetches.busy((ino, c))):
                return None
            locs.append((c, loc))
        return locs

    def pin(self, ino: int, size: int, reads: bool = True,
                        from_nvme: int = 0) -> int:
        """*ino* is opened in passthrough mode: its DRAM copies stay until
        `unpin`, and the returned descriptor is its DRAM file, as long as the
        file. With *reads* (the open passed `ready`; the kernel will read it
        without us), its chunks count as read now: from DRAM, but for the *from_nvme* that
        `stage` just brought in."""
        chunks = list(self.chunks.index.chunks_of(ino, self.chunks.nchunks(size)))
        if ino not in self.dram.pins:  # counted once per file
            held = self._pinned[ino] = sum(pages(self.chunks.get(ino, c).raw_len) for c in chunks)
            self.pinned_bytes += held
        self.dram.pin(ino)
        if not reads:
            return self.dram.fd(ino)
        self.counters.passthrough_opens += 1
        for c in chunks:
            key = (ino, c)
            if self.store.dram_verify == "open":
                self.dram.forget(ino, c)  # a check counts for one open only
            self.store.policy.hit(key)
            self.store.fetches.used(key)
        self.counters.chunks_from_dram += len(chunks) - from_nvme
        self.counters.passthrough_chunks += len(chunks)
        return self.dram.extend(ino, size)

    def unpin(self, ino: int) -> None:
        """A passthrough open of *ino* was released."""
        self.dram.unpin(ino)
        if ino not in self.dram.pins:
            self.pinned_bytes -= self._pinned.pop(ino, 0)


class KernelWritten:
    """Kernel-written files: started or adopted, taken, ended."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.meta = store.meta
        self.dram = store.dram
        self.chunks = store.chunks
        self.counters = store.counters
        self.cs = store.cs
        # Kernel-written files, and the ones being taken (`take`) -> done; each -> the room
        # promised to it (its expected size), part of the store's `dram_load` until taken.
        self.files: dict[int, int] = {}
        self.adopted: set[int] = set()  # of those, files that had data before (`adopt`)
        self.promised = 0
        self._taking: dict[int, trio.Event] = {}

    def may_start(self, expected: int) -> bool:
        """May one more new file, expected to reach *expected* bytes, be written by the
        kernel without us (`start`)? Not with dram_compress: the copies of such a
        file stay raw until it is closed, and packing is what that option is for."""
        need = pages(expected) / KERNEL_WRITTEN_ROOM_SHARE  # of the DRAM tier's and the store's
        return (not self.store.dram_compress and len(self.files) < KERNEL_WRITTEN_MAX
                and self.store.dram_load + need <= self.dram.capacity
                and self.store.room.fits(self.promised + need))

    def start(self, ino: int, expected: int) -> int:
        """The kernel will write the (empty) file *ino*, expected to reach *expected* bytes,
        straight into its DRAM file (the returned descriptor) until `take(ino, done=True)`.
        Recorded in lmdb first, so that a mount after a crash takes what the DRAM file holds
        (kvfs/store/recovery.py)."""
        with self.meta.write() as txn:
            txn.put(u64(ino), b"", db=self.meta.db["writers"])
        self.files[ino] = pages(expected)
        self.promised += pages(expected)
        if self.store.dram_load > self.store.high_water:
            self.store.events.dram_filling()
        self.dram.pin(ino)
        self.counters.kernel_write_opens += 1
        return self.dram.extend(ino, 0)

    def adopt(self, ino: int) -> bool:
        """The kernel will write *ino*, a file wholly in its DRAM file (open in passthrough
        mode), straight into it from now on, as it writes a new file (`start`), until
        `take(ino, done=True)`: a writable open of a file the kernel reads without us
        must carry its backing id, and a shared mapping of it writes the DRAM file. Recorded
        in lmdb as `start` does. False if it may not be (dram_compress, too many).
        Its chunks stay as recorded until that take; a write-back meanwhile that finds one
        changed leaves it to the take (an fsync takes first)."""
        if self.store.dram_compress or len(self.files) >= KERNEL_WRITTEN_MAX or ino in self.files:
            return False
        with self.meta.write() as txn:
            txn.put(u64(ino), b"", db=self.meta.db["writers"])
        self.files[ino] = 0  # nothing promised: its bytes are in DRAM already
        self.adopted.add(ino)
        self.dram.pin(ino)
        self.counters.kernel_write_adoptions += 1
        return True

    def size(self, ino: int) -> int:
        """The length of a file being written by the kernel: its DRAM file's."""
        return self.dram.size(ino)

    def blocks(self, ino: int) -> int:
        """Bytes of RAM a file being written by the kernel holds so far."""
        return self.dram.ram(ino)

    async def take(self, ino: int, *, done: bool,
                          on_commit: Callable[[int, bool], None] | None = None) -> int:
        """Take what the kernel wrote into *ino*'s DRAM file as the file's chunks (at an
        fsync, or *done*: its last writer closed, and it is an ordinary file again). A chunk
        whose bytes are still those of its sealed location (taken and written back by an
        earlier fsync) keeps it: nothing is written twice, and what an fsync made durable
        stays so. Any other chunk holding data becomes a dirty DRAM copy (new seq), sealed
        if *done*; at an fsync the writers may still be changing it, so it is left for the
        writeback to checksum what it reads. Chunks that are holes go. Returns the size;
        *on_commit(size, holes)* runs inside the commit (the caller's inode update rides
        along; *holes*: some chunk below the size holds no data)."""
        while (busy := self._taking.get(ino)) is not None:  # one take at a time per file
            await busy.wait()
        self._taking[ino] = trio.Event()
        try:
            return await self._take(ino, done, on_commit)
        finally:
            self._taking.pop(ino).set()

    async def _take(self, ino: int, done: bool, on_commit) -> int:
        size = self.size(ino)
        data = self.dram.data_chunks(ino)
        lens = [min(self.cs, size - c * self.cs) for c in data]
        sums = await self.store.hash_chunks(
            ino, [(c, Loc(IN_DRAM, 0, 0, 0, n, 0, CODEC_RAW, 0, 0, 0))
                  for c, n in zip(data, lens, strict=True)])
        present = set(data)
        with self.meta.write() as txn:
            for c in self._chunks(ino, size):
                if c not in present:  # (a set built per chunk made big files' takes O(n^2))
                    self.chunks.replace(txn, ino, c, self.chunks.get(ino, c), None)
            for c, n, csum in zip(data, lens, sums, strict=True):
                old = self.chunks.get(ino, c)
                if (old is not None and old.dram_slot >= 0 and old.flags & SEALED
                        and (old.raw_len, old.checksum) == (n, csum)):
                    continue
                if old is None or old.dram_slot < 0:
                    self.dram.claim(ino, c)
                new = Loc(IN_DRAM, 0, 0, 0, n, 0, CODEC_RAW, SEALED if done else 0,
                          csum if done else 0, self.chunks.next_seq())
                self.chunks.replace(txn, ino, c, old, new)
                if done:
                    self.store.mark_checked(ino, c, new)  # hashed from the region itself
                self.counters.streamed_chunks += 1
            if done:
                txn.delete(u64(ino), db=self.meta.db["writers"])
            if on_commit is not None:
                on_commit(size, len(data) < self.chunks.nchunks(size))
        if done:
            self._ended(ino)
        if self.store.dram_load > self.store.high_water:
            self.store.events.dram_filling()
        return size

    def unseen_bytes(self) -> int:
        """RAM that files the kernel is writing hold beyond what their chunks account for
        (what was written since they were opened or last taken)."""
        out = 0
        for ino in self.files:
            counted = sum(self.chunks.dram_pages((ino, c))
                          for c in self._chunks(ino, self.size(ino)))
            out += max(0, self.blocks(ino) - counted)
        return out

    def _chunks(self, ino: int, size: int) -> list[int]:
        """The chunks recorded for a file the kernel writes, whose DRAM file is *size* long.
        They all lie within it: the kernel only makes it longer, and a truncation cuts it
        and the chunks past its new end together (`truncate`). Asking the index for every
        chunk the inode might have scanned the whole index, at every create (issue 33)."""
        return self.chunks.index.chunks_of(ino, self.chunks.nchunks(size))

    def end(self, ino: int) -> None:
        """The file being written by the kernel is gone (unlinked, last close) or could not
        be opened so: nothing to take; `delete_file` frees what an fsync recorded."""
        with self.meta.write() as txn:
            txn.delete(u64(ino), db=self.meta.db["writers"])
        self._ended(ino)

    def _ended(self, ino: int) -> None:
        self.promised -= self.files.pop(ino, 0)
        self.adopted.discard(ino)
        self.dram.unpin(ino)

    async def mapped_writable(self, ino: int, as_seen: tuple[int, int] | None) -> bool:
        """Is *ino*'s DRAM file mapped shared and writable by some process (an adopted
        file's writer may have mapped it, and the mapping outlives the close)? *as_seen*:
        the (device, inode) such a mapping shows (the FUSE file's)."""
        files = {as_seen} if as_seen is not None else set()
        if not self.dram.missing_open(ino):
            st = os.fstat(self.dram.fd(ino))
            files.add((st.st_dev, st.st_ino))
        return bool(files) and await trio.to_thread.run_sync(
            mapped_shared_writable, files, limiter=self.store.limiter)

    def resized(self, ino: int, size: int) -> None:
        """A file open in passthrough mode grew to *size* without a write (truncate up,
        fallocate): its DRAM file must say so, or the kernel's reads stop at its old end."""
        if ino in self.dram.pins:
            self.dram.extend(ino, size)

    def where(self, ino: int, size: int) -> list[dict]:
        """`where` of a file the kernel is writing: its DRAM file's chunks, all in DRAM,
        dirty unless an fsync wrote them back."""
        out = []
        for c in self.dram.data_chunks(ino):
            loc = self.chunks.get(ino, c)
            clean = loc is not None and loc.seg > 0
            out.append({"chunk": c, "tiers": ["dram", "nvme"] if clean else ["dram"],
                        "packed": False, "raw_len": min(self.cs, size - c * self.cs),
                        "stored_len": loc.stored_len if clean else 0, "codec": CODEC_RAW,
                        "segment": loc.seg if clean else None, "dirty": not clean,
                        "lost": False})
        return out
