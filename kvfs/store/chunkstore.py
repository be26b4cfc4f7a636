"""ChunkStore: file byte ranges <-> chunks <-> copies in the DRAM tier and the NVMe log.

Every chunk has one location tuple (`Loc`) in the Cython index and the same tuple in lmdb's
`chunks` table. A chunk is in one of three states:

    DRAM only (dirty)   dram_slot >= 0, seg == 0   - newest bytes only in tmpfs
    both (clean copy)   dram_slot >= 0, seg > 0    - identical bytes on NVMe
    NVMe only           dram_slot < 0,  seg > 0

A DRAM copy lives in its *region*: the chunk's own offset in its inode's DRAM file
(kvfs/store/dram.py); `dram_slot` is IN_DRAM (0) for every copy since format 3.

With `dram_compress`, a clean copy may be *packed*: flag PACKED, and its region holds the
NVMe record's payload (`stored_len` bytes, encoded with `codec`) instead of the raw bytes. A
read decodes it in a worker; a write or truncation drops it first (it is clean), so a packed
region is never written in place. A file with a packed chunk is never opened in passthrough.

Concurrency protocol (all of this runs on the trio thread; see docs/DESIGN.md):
- Between two awaits a task owns every structure here. Index, lmdb and arena writes for one
  operation happen without an await in between, so readers never see half an update.
- Work in worker threads (NVMe I/O, compression, checksums of whole files) only reads a DRAM
  region and returns results; the trio side then re-checks the chunk's `seq`. Every change of a
  chunk's bytes takes a new seq, so a result computed from bytes that changed meanwhile is
  recognised and thrown away (its NVMe record is marked dead). The one writer is an NVMe read
  staging a chunk: it claims the region first, and until it is done (`Fetches.pending`) writes and
  truncations of that chunk wait (before they change anything: the staged bytes may be read
  by a passthrough open before the fetch ends, see `stage_watch`).
- A region or a record is released only after the location that replaces it is committed
  (MetaStore.after_commit): invariant 4.
- A sealed chunk (checksum valid) that is about to change is unsealed in lmdb *before* its
  bytes change, so a crash never leaves new bytes under an old checksum.
"""

from __future__ import annotations

import logging

import trio

from kvfs.faults import Faults
from kvfs.nursery import open_nursery
from kvfs.store.chunkmap import ChunkMap
from kvfs.store.codec import Codec
from kvfs.store.dram import OPEN_FILES, DramFile, DramFiles
from kvfs.store.events import StoreEvents
from kvfs.store.fetch import Fetches
from kvfs.store.kernel_written import KernelWritten, PassthroughReads
from kvfs.store.location import (
    HASH_RELEASES_GIL,
    LOST,
    PACKED,
    SEALED,
    Counters,
    Loc,
    hash_bytes,
    nvme_only,
)
from kvfs.store.meta import (
    MetaStore,
)
from kvfs.store.nvme import (
    NvmeLog,
)
from kvfs.store.reads import Reads
from kvfs.store.readthrough import ReadThrough
from kvfs.store.recovery import Recovery
from kvfs.store.room import Room
from kvfs.store.writeback import WriteBack
from kvfs.store.writes import Writes

log = logging.getLogger(__name__)
# Hashing this much inline (~30 us) is cheaper than a round trip to a worker thread.
INLINE_HASH_BYTES = 512 << 10
# ... and from this much on, two worker threads hash a file's halves at once.
PARALLEL_HASH_BYTES = 2 << 20


class ChunkStore:
    """Mechanism for moving chunk bytes between tiers; policy objects decide what to move."""

    def __init__(self, meta: MetaStore, fs_uuid: str, *, chunk_size: int, dram_dir: str,
                 dram_size: int, nvme_dir: str, nvme_size: int, segment_size: int,
                 codec: Codec, io_threads: int, policy, dram_compress: bool = False,
                 dram_verify: str = "once", read_through_min: int = 0,
                 dram_open_files: int = OPEN_FILES, faults: Faults | None = None,
                 events: StoreEvents | None = None) -> None:
        self.meta = meta
        self.faults = faults or Faults()
        # the only calls that go up, to the layers above (kvfs/store/events.py)
        self.events = events or StoreEvents()
        self.cs = chunk_size
        self.codec = codec
        # Clean DRAM copies are kept packed (compressed) when that saves pages.
        self.dram_compress = dram_compress
        # When a read hashes a chunk's DRAM copy first (see `check_needed`).
        self.dram_verify = dram_verify
        self.policy = policy
        self.dram = DramFiles(dram_dir, fs_uuid, chunk_size, dram_size, dram_open_files)
        # Regions released by a commit give their pages back once the commit is done.
        meta.on_settled = self.dram.settle
        self.nvme = NvmeLog(nvme_dir, fs_uuid, nvme_size, segment_size, chunk_size=chunk_size)
        self.limiter = trio.CapacityLimiter(io_threads)
        self.counters = Counters()
        # Locations, shadows and their accounting. A change tells the read-through memory
        # (bytes read ahead may be old now) and the fetches (a DRAM copy went).
        self.chunks = ChunkMap(meta, self.dram, self.nvme, policy, chunk_size=chunk_size,
                               changing=lambda ino, c: self.through.changing(ino, c),
                               dropped=lambda key: self.fetches.dropped(key))
        m = self.chunks
        self.index, self.shadows, self.dirty_since, self.file_bytes = (
            m.index, m.shadows, m.dirty_since, m.file_bytes)
        self.get, self.dram_pages, self.is_clean, self.nchunks = (
            m.get, m.dram_pages, m.is_clean, m.nchunks)
        self.relocated, self.live_record, self.reservation, self.blocks_bytes = (
            m.relocated, m.live_record, m.reservation, m.blocks_bytes)
        self.high_water = int(0.9 * dram_size)  # set by tiering; start demoting above it
        # NVMe reads: demand reads, stagings, prefetches.
        self.fetches = Fetches(self, chunk_size=chunk_size, io_threads=io_threads,
                               faults=self.faults)
        f = self.fetches
        self.fetch, self.prefetch, self.prefetch_room = f.fetch, f.prefetch, f.prefetch_room
        self.prefetch_limiter, self.prefetched = f.prefetch_limiter, f.prefetched
        self.fetching = f.busy  # is an NVMe read of this chunk in flight?
        self.nvme_record = f.record  # a chunk's record as stored, checked (for the pod)
        # Big NVMe-resident files are read through the daemon, with read-ahead.
        self.through = ReadThrough(self, chunk_size=chunk_size, dram_size=dram_size,
                                   read_through_min=read_through_min)
        t = self.through
        self.reads_through, self.start_read_through, self.buffer_predicted = (
            t.reads, t.start, t.predicted)
        self.front_read, self.end_read_through, self.read_direct = (
            t.front_read, t.end, t.read_direct)
        # Dirty chunks written back to NVMe (demotion, age, fsync, unmount).
        self.wb = WriteBack(self, chunk_size=chunk_size, nvme_dir=nvme_dir)
        w = self.wb
        self.writeback, self.writeback_many, self.writeback_all = (
            w.writeback, w.writeback_many, w.writeback_all)
        self.writeback_batches, self.batch_full, self.fsync, self.sync = (
            w.writeback_batches, w.batch_full, w.fsync, w.sync)
        self.nvme_full, self.nvme_failing, self.choices = w.nvme_full, w.nvme_failing, w.choices
        # Files the kernel reads (passthrough opens) or writes itself (kernel-written files).
        self.passthrough = PassthroughReads(self)
        p = self.passthrough
        self.passthrough_ready, self.stage_file, self.passthrough_fd = p.ready, p.stage, p.fd
        self.pin_passthrough, self.unpin_passthrough = p.pin, p.unpin
        self.kernel = KernelWritten(self)
        k = self.kernel
        self.kernel_written, self.adopted = k.files, k.adopted
        self.kernel_may_write, self.start_kernel_write = k.may_start, k.start
        self.adopt_kernel_write, self.take_kernel_written = k.adopt, k.take
        self.kernel_written_size, self.kernel_written_blocks = k.size, k.blocks
        self.unseen_bytes, self.end_kernel_write = k.unseen_bytes, k.end
        self.mapped_writable, self.resized = k.mapped_writable, k.resized
        # The store's room and the DRAM tier's.
        self.room = Room(self)
        r = self.room
        self.check_capacity, self.check_room, self.allocate = (
            r.check_capacity, r.check_room, r.allocate)
        self.notify_space, self.wait_dram, self.nothing_leaves, self.promotion_room = (
            r.notify_space, r.wait_dram, r.nothing_leaves, r.promotion_room)
        # Reads, and the checks of DRAM copies they make.
        self.reads = Reads(self)
        r = self.reads
        self.read, self.check_needed, self.mark_checked = r.read, r.check_needed, r.mark_checked
        self.record_latency, self.record_us = r.record_latency, r.record_us
        # Writes, truncations, holes punched.
        self.writes = Writes(self, self.kernel.files)
        w = self.writes
        self.write, self.plan_write, self.write_fd = w.write, w.plan_write, w.write_fd
        self.finish_write, self.abort_write = w.finish_write, w.abort_write
        self.truncate, self.punch = w.truncate, w.punch
        # What a mount loads and repairs (kvfs/store/recovery.py). The sizes of files the
        # kernel was writing when the daemon stopped: the assembly gives them to the namespace.
        self.recovered_sizes = Recovery(meta, self.chunks, self.dram, self.nvme, policy, codec,
                                        chunk_size=chunk_size,
                                        read_record=self.fetches.read_record).run()

    def close(self) -> None:
        self.through.close()
        with self.meta.write() as txn:
            self.meta.set_counter(txn, b"next_seq", self.chunks.seq)
        self.dram.close()
        self.nvme.close()

    # -- counts other layers read ----------------------------------------------------------
    @property
    def seq(self) -> int:
        return self.chunks.seq

    @property
    def dram_used(self) -> int:
        return self.chunks.dram_used

    @property
    def unbacked(self) -> int:
        return self.chunks.unbacked

    @property
    def nvme_live(self) -> int:
        return self.chunks.nvme_live

    async def run_disposals(self) -> None:
        """Remove DRAM files nobody needs any more in a worker thread, not on the trio thread
        (freeing a file's pages takes tens of microseconds per MiB); see DramFiles.dispose."""
        wake = trio.Event()
        self.dram.on_disposal_queued = wake.set
        try:
            while True:
                await wake.wait()
                wake = trio.Event()
                self.dram.on_disposal_queued = wake.set
                while self.dram.pending_disposals:
                    batch = self.dram.take_disposals()
                    try:
                        await trio.to_thread.run_sync(self.dram.dispose_many, batch,
                                                      limiter=self.limiter)
                    except trio.Cancelled:
                        self.dram.dispose_many(batch)  # cancelled before the thread ran
                        raise
        finally:
            self.dram.on_disposal_queued = lambda: None

    @property
    def capacity(self) -> int:
        return self.room.capacity

    @property
    def used(self) -> int:
        return self.room.used

    @property
    def dram_load(self) -> int:
        return self.room.dram_load

    @property
    def space_waiters(self) -> int:
        return self.room.space_waiters

    @property
    def dram_filling(self) -> int:
        return self.fetches.filling

    # -- sealing, writeback, fsync -----------------------------------------------------------
    async def seal(self, ino: int, size: int) -> None:
        """Checksum every unsealed DRAM chunk of a file (on close), in a worker thread when
        there is much of it."""
        todo = []
        for c in self.index.chunks_of(ino, self.nchunks(size)):
            loc = self.get(ino, c)
            if loc is not None and loc.dram_slot >= 0 and not loc.flags & SEALED:
                todo.append((c, loc))
        if not todo:
            return
        sums = await self.hash_chunks(ino, todo)
        with self.meta.write() as txn:
            for (c, loc), csum in zip(todo, sums, strict=True):
                now = self.get(ino, c)
                if now == loc:
                    self.chunks.replace(txn, ino, c, loc, loc._replace(flags=loc.flags | SEALED,
                                                                 checksum=csum))
                    self.mark_checked(ino, c, loc)  # hashed from the region itself

    async def hash_chunks(self, ino: int, todo: list[tuple[int, Loc]]) -> list[int]:
        """xxh3 of each chunk's bytes in its region: inline when they are few, else in worker
        threads, two at once when there is much (an open may be waiting for this; the hash
        runs without the GIL)."""
        total = sum(loc.raw_len for _, loc in todo)
        if total <= INLINE_HASH_BYTES:
            return [hash_bytes(self.reads.region(ino, c, loc.raw_len)) for c, loc in todo]
        half = len(todo) // 2 if total >= PARALLEL_HASH_BYTES and HASH_RELEASES_GIL else 0
        parts = [todo[:half], todo[half:]] if half else [todo]
        sums: list[list[int]] = [[] for _ in parts]
        held = self.dram.hold(ino)

        async def hash_part(i: int) -> None:
            sums[i] = await trio.to_thread.run_sync(self._hash_regions, held, parts[i],
                                                    limiter=self.limiter)
        try:
            async with open_nursery() as nursery:
                for i in range(len(parts)):
                    nursery.start_soon(hash_part, i)
        finally:
            self.dram.drop(held)
        return [csum for part in sums for csum in part]

    def _hash_regions(self, held: DramFile, todo: list[tuple[int, Loc]]) -> list[int]:
        """Worker thread: xxh3 of each chunk's bytes in its region. (pread, not a mapping:
        freshly written tmpfs pages cost a page fault each to map, more than the copy, and
        a read never meets SIGBUS.)"""
        buf = bytearray(self.cs)
        sums = []
        for c, loc in todo:
            view = memoryview(buf)[:loc.raw_len]
            self.dram.read_region(held.fd, c * self.cs, view)
            sums.append(hash_bytes(view))
        return sums

    def batch(self):
        """One commit for the changes made inside it (a context manager; no await inside):
        the demoter drops a run of clean copies at the cost of one."""
        return self.meta.write()

    def drop_dram_copy(self, key: tuple[int, int]) -> None:
        """Free the DRAM copy of a chunk that is safely on NVMe (not of a file open in
        passthrough mode: the kernel reads its DRAM file)."""
        loc = self.get(*key)
        if loc is None or loc.dram_slot < 0:
            self.policy.removed(key)
            return
        self.events.changing(key[0])
        if not loc.seg or (key[0] in self.dram.pins and not loc.flags & PACKED):
            return
        with self.meta.write() as txn:
            self.chunks.replace(txn, key[0], key[1], loc, nvme_only(loc))

    # -- truncate / delete -----------------------------------------------------------------
    def delete_file(self, ino: int, size: int) -> None:
        """Forget every chunk of a file (its inode is gone)."""
        with self.meta.write() as txn:
            for c in self.index.chunks_of(ino, self.nchunks(size)):
                self.chunks.replace(txn, ino, c, self.get(ino, c), None)
        self.wb.forget(ino)
        if ino in self.chunks.allocated:
            self.chunks.set_allocated(ino, 0)
        self.file_bytes.pop(ino, None)
        self.through.end(ino)
        self.events.file_deleted(ino)

    # -- introspection -----------------------------------------------------------------------
    def where(self, ino: int, size: int) -> list[dict]:
        if ino in self.kernel_written:
            return self.kernel.where(ino, size)
        out = []
        for c in self.index.chunks_of(ino, self.nchunks(size)):
            loc = self.get(ino, c)
            tiers = []
            if loc.dram_slot >= 0:
                tiers.append("dram")
            if loc.seg:
                tiers.append("nvme")
            out.append({"chunk": c, "tiers": tiers, "packed": bool(loc.flags & PACKED),
                        "raw_len": loc.raw_len,
                        "stored_len": loc.stored_len if loc.seg else loc.raw_len,
                        "codec": loc.codec, "segment": loc.seg or None,
                        "dirty": loc.dram_slot >= 0 and not loc.seg,
                        "lost": bool(loc.flags & LOST)})
        return out

    def stats(self) -> dict:
        self.through.count_quiet()
        k, m = self.counters, self.chunks
        unseen = self.unseen_bytes() if self.kernel_written else 0
        segs = self.nvme.segments.values()
        return {
            "tiers": {
                "dram": {"capacity_bytes": self.dram.capacity,
                         "used_bytes": m.dram_used + unseen,
                         "logical_bytes": m.dram_logical, "chunks": m.dram_chunks,
                         "dirty_bytes": m.unbacked, "packed_chunks": m.dram_packed,
                         "promised_bytes": self.kernel.promised,
                         "files": len(self.dram.claims), "passthrough_files": len(self.dram.pins),
                         "files_freed_at_once": self.dram.freed_at_once},
                "nvme": {"capacity_bytes": self.nvme.capacity, "used_bytes": m.nvme_live,
                         "logical_bytes": m.nvme_logical, "chunks": m.nvme_chunks,
                         "segments": len(self.nvme.segments),
                         "segment_bytes": sum(s.write_off for s in segs)},
            },
            "reads": {"chunks_from_dram": k.chunks_from_dram,
                      "chunks_from_nvme": k.chunks_from_nvme,
                      "chunks_from_holes": k.chunks_from_holes, **k.request_counts(),
                      "chunks_unpacked": k.unpacked,
                      "checksum_errors": k.checksum_errors,
                      # DRAM copies hashed before a read trusted them (-o dram_verify)
                      "dram_checked_chunks": k.dram_checks,
                      # read-through files (-o read_through_min): NVMe chunks read ahead of
                      # their reader into the daemon's memory, and how many it then read
                      "read_through_buffered_chunks": k.through_buffered,
                      "read_through_buffer_used_chunks": k.through_buffer_used,
                      # ... READs answered from them by the front thread (kvfs._fuseshim)
                      "read_through_front_reads": k.front_reads,
                      # ... of which the trio thread heard (the rest changed nothing there)
                      "read_through_front_notices": k.front_notices,
                      "latency_us_log2_histogram": list(k.read_latency_us),
                      "dram_latency_us_log2_histogram": list(k.read_latency_dram_us),
                      "nvme_latency_us_log2_histogram": list(k.read_latency_nvme_us)},
            "moves": {"promotions": k.promotions, "demotions": k.demotions,
                      "writebacks": k.writebacks},
            "writes": {"direct_to_dram": k.direct_writes},
            # opens the kernel served from DRAM files without the daemon (FUSE passthrough)
            "passthrough": {"opens": k.passthrough_opens, "chunks": k.passthrough_chunks,
                            "staged_chunks": k.staged_chunks,
                            "open_files": len(self.dram.pins),
                            "write_opens": k.kernel_write_opens,
                            "adopted_files": k.kernel_write_adoptions,
                            "written_chunks": k.streamed_chunks,
                            "writing_files": len(self.kernel_written),
                            "unseen_sums": k.unseen_sums},
            # files whose codec was chosen by trial vs taken from their directory (choices.py)
            "codec_choices": {"full": self.choices.full, "taken": self.choices.taken},
            "prefetch": {"issued_chunks": k.prefetch_issued, "used_chunks": k.prefetch_used,
                         "late_chunks": k.prefetch_late, "wasted_chunks": k.prefetch_wasted,
                         "resident_unread_chunks": len(self.prefetched)},
            "gc": {"user_bytes_written": k.user_bytes_written,
                   "gc_bytes_written": k.gc_bytes_written,
                   "write_amplification": round(
                       (k.user_bytes_written + k.gc_bytes_written) / k.user_bytes_written, 4)
                   if k.user_bytes_written else 1.0},
        }
