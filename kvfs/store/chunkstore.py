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
import math
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from kvfs._index import ChunkIndex
from kvfs.faults import Faults
from kvfs.nursery import open_nursery
from kvfs.store.codec import CODEC_RAW, Codec, CodecError
from kvfs.store.dram import OPEN_FILES, DramFile, DramFiles, pages
from kvfs.store.episode import Episode
from kvfs.store.fetch import Fetches, StageWatch
from kvfs.store.location import (
    HASH_RELEASES_GIL,
    HOLE,
    IN_DRAM,
    LOC,
    LOST,
    PACKED,
    SEALED,
    TAIL_LOST,
    U32,
    ChunkError,
    Counters,
    Loc,
    NoSpace,
    hash_bytes,
    nvme_only,
    parse_loc,
    slot_len,
)
from kvfs.store.meta import (
    FORMAT_VERSION,
    MetaStore,
    from_key2,
    from_u64,
    key2,
    u64,
)
from kvfs.store.nvme import (
    NvmeLog,
    RecordError,
)
from kvfs.store.osutil import mapped_shared_writable
from kvfs.store.readthrough import CHANGED, PROMOTE_SHARE, ReadThrough
from kvfs.store.writeback import WriteBack

log = logging.getLogger(__name__)
# Hashing this much inline (~30 us) is cheaper than a round trip to a worker thread.
INLINE_HASH_BYTES = 512 << 10
# ... and from this much on, two worker threads hash a file's halves at once.
PARALLEL_HASH_BYTES = 2 << 20
# A file opened for reading with chunks on NVMe only is staged whole in DRAM before the open
# returns, so that the kernel reads it from there (passthrough), if it is at most this long:
# the open then waits for all of it, which a reader of a KV block wants anyway.
STAGE_FILE_MAX = 64 << 20
# Files open in passthrough mode cannot lose their DRAM copies; they may hold at most this
# share of the tier, so that writes always find room to demote into.
PASSTHROUGH_SHARE = 0.5
# Files the kernel writes straight into their DRAM file (passthrough writers, `start_stream`):
# what they write is only counted when they are taken, so at most this many at once, each
# expected to take at most this share of the DRAM tier's free room (and of the store's); the
# room promised to them (their expected sizes) counts as used until then.
STREAMS_MAX = 16
STREAM_ROOM_SHARE = 0.25
# A write waiting for room in DRAM (the demoter writing chunks back to make it) gives up
# with ENOSPC after this long in all.
DRAM_WAIT_S = 60.0
# While writing back fails for want of room, the demoter tries again this often (not at
# every kick: each try costs a compression and a failed write), and a write needing DRAM
# room meanwhile gets ENOSPC at once; after that long it waits for the next try.
FULL_RETRY_S = 1.0


@dataclass
class WritePlan:
    """A write whose bytes are copied straight into DRAM regions (plan_write)."""

    ino: int
    # (chunk, start, stop, location before the write); in place if it had a DRAM copy
    pieces: list[tuple[int, int, int, Loc | None]]


class ChunkStore:
    """Mechanism for moving chunk bytes between tiers; policy objects decide what to move."""

    def __init__(self, meta: MetaStore, fs_uuid: str, *, chunk_size: int, dram_dir: str,
                 dram_size: int, nvme_dir: str, nvme_size: int, segment_size: int,
                 codec: Codec, io_threads: int, policy, dram_compress: bool = False,
                 dram_verify: str = "once", read_through_min: int = 0,
                 dram_open_files: int = OPEN_FILES, faults: Faults | None = None) -> None:
        self.meta = meta
        self.faults = faults or Faults()
        self.cs = chunk_size
        self.codec = codec
        # Clean DRAM copies are kept packed (compressed) when that saves pages.
        self.dram_compress = dram_compress
        # When a read hashes a chunk's DRAM copy first (see `_check_needed`).
        self.dram_verify = dram_verify
        self.policy = policy
        self.index = ChunkIndex(1 << 16)
        self.dram = DramFiles(dram_dir, fs_uuid, chunk_size, dram_size, dram_open_files)
        # Regions released by a commit give their pages back once the commit is done.
        meta.on_settled = self.dram.settle
        self.nvme = NvmeLog(nvme_dir, fs_uuid, nvme_size, segment_size)
        self.limiter = trio.CapacityLimiter(io_threads)
        self.counters = Counters()
        # Accounting (bytes), kept exact by _account() on every location change.
        self.dram_used = 0  # pages of chunk data in DRAM
        self.dram_filling = 0  # pages of regions NVMe reads are filling, not committed yet
        self.dram_logical = 0
        self.dram_chunks = 0
        self.dram_packed = 0  # chunks whose DRAM copy is packed
        self.nvme_live = 0  # record bytes of live NVMe copies
        self.nvme_logical = 0
        self.nvme_chunks = 0
        self.unbacked = 0  # DRAM pages that have no NVMe copy yet (count against capacity)
        self.dirty_since: dict[tuple[int, int], float] = {}
        self.file_bytes: dict[int, int] = {}
        self.allocated: dict[int, int] = {}  # fallocate()d bytes per file
        self.reserved = 0  # sum of reservation(ino): promised room not yet written
        self.seq = 0
        self.space_waiters = 0
        self._space = trio.Event()
        self.dram_pinned_full = Episode("DRAM tier full of files open in passthrough mode")
        # A file's dtype hint and its directory (the namespace's; set by the assembly).
        self.codec_context: Callable[[int], tuple[str | None, int | None]] = (
            lambda ino: (None, None))
        self.kick_demoter: Callable[[], None] = lambda: None
        self.cleaner = None  # set by the assembly (store.gc.Cleaner)
        # Placement: which stream a file's records go to (issue 5 classifies; default one).
        self.stream_of: Callable[[int], int] = lambda ino: 0
        self.file_deleted: Callable[[int], None] = lambda ino: None  # lifetime learning
        self.high_water = int(0.9 * dram_size)  # set by tiering; start demoting above it
        # Reads of DRAM copies land here: a read's reply is sent before any other task runs
        # (see `read`), so one buffer serves them all.
        self._scratch = bytearray(chunk_size)
        # Files open in passthrough mode -> DRAM bytes they held when first opened.
        self._pinned: dict[int, int] = {}
        self.pinned_bytes = 0
        # revoke(ino): called before a file's DRAM copies are dropped or repacked, so that
        # opens of it answered without the daemon (kvfs.fs, the front thread) are pins by
        # then. Set by the assembly.
        self.revoke: Callable[[int], None] = lambda ino: None
        # staged(ino): a prefetch brought a chunk of *ino* into DRAM, checked (the file may be
        # wholly resident now: kvfs.fs offers it to the front thread). Set by the assembly.
        self.staged: Callable[[int], None] = lambda ino: None
        # stage_watch(ino, c, fd): a prefetch is about to stage chunk *c* of *ino* in its
        # DRAM file *fd*; kvfs.fs may answer a StageWatch, to let the front thread serve
        # the file as soon as the worker has staged it. Set by the assembly.
        self.stage_watch: Callable[[int, int, int], StageWatch | None] = \
            lambda ino, c, fd: None
        # Chunks written over in DRAM -> the NVMe-only location of their last written-back
        # bytes, until the new ones are written back (`_shadow`).
        self.shadows: dict[tuple[int, int], Loc] = {}
        self.shadow_kept: dict[tuple[int, int], int] = {}  # ... its bytes still the file's
        # Files the kernel is writing straight into their DRAM file (start_stream), and the
        # ones whose bytes are being taken (take_stream) -> done; each -> the room promised
        # to it (its expected size), part of `dram_load` until it is taken.
        self.streaming: dict[int, int] = {}
        self.adopted: set[int] = set()  # of those, files that had data before (adopt_stream)
        self.stream_promised = 0
        self._taking: dict[int, trio.Event] = {}
        # Their sizes as found at mount (a crash while they were written): the assembly
        # gives them to the namespace.
        self.recovered_sizes: dict[int, tuple[int, bool]] = {}  # ino -> (size, holes)
        self.size_of: Callable[[int], int | None] = lambda ino: None  # set by the assembly
        # NVMe reads: demand reads, stagings, prefetches.
        self.fetches = Fetches(self, chunk_size=chunk_size, io_threads=io_threads,
                               faults=self.faults)
        f = self.fetches
        self.fetch, self.prefetch, self.prefetch_room = f.fetch, f.prefetch, f.prefetch_room
        self.prefetch_limiter, self.prefetched = f.prefetch_limiter, f.prefetched
        # Big NVMe-resident files are read through the daemon, with read-ahead.
        self.through = ReadThrough(self, chunk_size=chunk_size, dram_size=dram_size,
                                   read_through_min=read_through_min)
        t = self.through
        self.reads_through, self.start_read_through, self.read_ahead_predicted = (
            t.reads, t.start, t.predicted)
        self.front_read, self.end_read_through = t.front_read, t.end
        # Dirty chunks written back to NVMe (demotion, age, fsync, unmount).
        self.wb = WriteBack(self, chunk_size=chunk_size, nvme_dir=nvme_dir)
        w = self.wb
        self.writeback, self.writeback_many, self.writeback_all = (
            w.writeback, w.writeback_many, w.writeback_all)
        self.writeback_batches, self.batch_full, self.fsync, self.sync = (
            w.writeback_batches, w.batch_full, w.fsync, w.sync)
        self.nvme_full, self.nvme_failing, self.choices = w.nvme_full, w.nvme_failing, w.choices
        self._load()

    # -- startup ---------------------------------------------------------------------------
    def _load(self) -> None:
        with self.meta.env.begin() as txn:
            self.seq = self.meta.counter(txn, b"next_seq", 1)
        for ino, n in self.meta.load("alloc", lambda k, v: (from_u64(k), from_u64(v))):
            self.allocated[ino] = n
        arena = self._old_arena()
        lost_dram = not self.dram.survived
        fixes: list[tuple[int, int, Loc | None]] = []
        missing: set[int] = set()
        present = self.dram.present() if not lost_dram else set()  # inodes with a DRAM file
        owned: dict[int, list[tuple[int, int]]] = {}
        # Files the kernel was writing into their DRAM file when the daemon stopped: what
        # the DRAM file holds is newer than anything recorded (`_restream`).
        restream = set(self.meta.load("writers", lambda k, v: from_u64(k)))
        if lost_dram:
            restream = set()
        for (ino, c), loc in self.meta.load("chunks", self._parse_chunk):
            self.seq = max(self.seq, loc.seq + 1)
            if ino in restream:
                fixes.append((ino, c, None))  # replaced below; its NVMe record is dead
                continue
            if arena is not None and loc.dram_slot >= 0:
                loc = self._migrate_chunk(arena, ino, c, loc)
                fixes.append((ino, c, loc))
                present.add(ino)  # (its DRAM file was just made)
            if loc.dram_slot >= 0 and not lost_dram:
                if ino not in present:
                    log.error("inode %d chunk %d: its DRAM file is missing", ino, c)
                    loc = nvme_only(loc) if loc.seg else loc._replace(dram_slot=-1, flags=LOST)
                    fixes.append((ino, c, loc))
            if loc.seg and loc.seg not in self.nvme.segments:
                if loc.seg not in missing:
                    missing.add(loc.seg)
                    log.error("segment %d is missing: its chunks are lost (first: inode %d "
                              "chunk %d)", loc.seg, ino, c)
                if loc.flags & PACKED and not lost_dram and loc.dram_slot >= 0:
                    loc = self._unpack_at_mount(ino, c, loc)
                if loc.dram_slot < 0 or lost_dram or loc.flags & PACKED:
                    loc = loc._replace(dram_slot=-1, flags=LOST)
                loc = loc._replace(seg=0, off=0, rec_len=0, stored_len=0)
                fixes.append((ino, c, loc))
            elif loc.dram_slot >= 0 and lost_dram:
                if loc.seg:
                    loc = nvme_only(loc)
                else:
                    log.warning("inode %d chunk %d was only in DRAM, which is gone", ino, c)
                    loc = loc._replace(dram_slot=-1, flags=LOST)
                fixes.append((ino, c, loc))
            if loc.dram_slot >= 0:
                owned.setdefault(ino, []).append((c, slot_len(loc)))
            self.index.set(ino, c, tuple(loc))
            self._account(ino, None, loc)
            if loc.dram_slot >= 0:
                self.policy.inserted((ino, c))
                if not loc.seg:
                    self.dirty_since[(ino, c)] = time.monotonic()
            if loc.seg:
                self.nvme.segments[loc.seg].live_bytes += loc.rec_len
        for ino in sorted(restream):
            self._restream(ino, owned, fixes)
        stale_shadows = self._load_shadows(fixes, owned)
        self.reserved = sum(self.reservation(ino) for ino in self.allocated)
        self.dram.adopt(owned)
        # Chunks caught mid-write by a crash were never sealed: seal what is there now.
        with self.meta.write() as txn:
            # With the fixes: a migrated store must never be migrated again (slots are gone).
            self.meta.set_format(txn, FORMAT_VERSION)
            txn.drop(self.meta.db["writers"], delete=False)
            for ino, c, loc in fixes:
                self._store_loc(txn, ino, c, loc)
            for key in stale_shadows:
                txn.delete(key2(*key), db=self.meta.db["shadows"])
            for ino, c, loc in self.index.items():
                loc = Loc._make(loc)
                if loc.dram_slot >= 0 and not loc.flags & SEALED:
                    csum = hash_bytes(self._dram_bytes(ino, c, loc.raw_len))
                    self._store_loc(txn, ino, c, loc._replace(flags=loc.flags | SEALED,
                                                              checksum=csum))
        if arena is not None:
            self.meta.sync()
            arena.close()
            os.unlink(self.dram.arena_path)
            log.info("DRAM tier: moved from the arena file to one file per inode")
        for seg in list(self.nvme.segments.values()):
            self.nvme._maybe_delete(seg)

    def _parse_chunk(self, k: bytes, v: bytes) -> tuple[tuple[int, int], Loc]:
        return from_key2(k), parse_loc(v, self.cs)

    def _parse_shadow(self, k: bytes, v: bytes) -> tuple[tuple[int, int], Loc, int]:
        """A `shadows` entry: its key, location and (format 4) how many of the chunk's
        bytes it still holds for the file (before format 4, 0: the whole chunk is suspect)."""
        kept = U32.unpack(v[LOC.size:])[0] if len(v) != LOC.size else 0
        return from_key2(k), parse_loc(v[:LOC.size], self.cs), kept

    def _load_shadows(self, fixes, owned: dict[int, list[tuple[int, int]]]
                      ) -> list[tuple[int, int]]:
        """At mount: keep the shadows of chunks still dirty in DRAM; a chunk whose only copy
        was lost with DRAM goes back to its shadow (the bytes last written back, which an
        fsync may have promised). Returns the keys of shadows that are no more."""
        stale = []
        for key, shadow, kept in self.meta.load("shadows", self._parse_shadow):
            now = self.get(*key)
            segment = self.nvme.segments.get(shadow.seg)  # (None for HOLE)
            if (now is None or now.seg or (shadow.seg and segment is None)
                    or not (now.dram_slot >= 0 or now.flags & LOST)):
                stale.append(key)  # written back meanwhile, gone, or its segment is
                continue
            if segment is not None:
                segment.live_bytes += shadow.rec_len
            if now.dram_slot >= 0:
                self.shadows[key] = shadow
                self.shadow_kept[key] = kept
                self.nvme_live += shadow.rec_len
                continue
            log.warning("inode %d chunk %d: back to the bytes last written back (the newer "
                        "ones were only in DRAM, which is gone)", *key)
            # The chunk's first *kept* bytes go back to the shadow's (zeros past its end: a
            # hole then, as durable as the rest); what the file gained past them since was
            # only in DRAM: EIO there.
            if now.raw_len > kept and kept == 0:
                back = now._replace(dram_slot=-1, seg=0, flags=LOST)
            elif now.raw_len > kept and kept == shadow.raw_len and shadow.seg:
                back = shadow._replace(flags=shadow.flags | TAIL_LOST)
            elif now.raw_len > kept:
                back = self._shadow_start(*key, shadow, kept, tail_lost=True)
            elif now.raw_len == shadow.raw_len and shadow.seg:
                back = shadow
            else:
                back = self._shadow_start(*key, shadow, now.raw_len)
            if back.dram_slot >= 0:
                # Rebuilt in DRAM from the shadow (`_shadow_start`): the shadow stays until
                # those bytes are written back, so that DRAM lost again before that takes
                # the chunk back to it again (without it the chunk, fsync'ed bytes and all,
                # would be lost).
                self.shadows[key] = shadow
                self.shadow_kept[key] = kept
                self.nvme_live += shadow.rec_len
                owned.setdefault(key[0], []).append((key[1], back.raw_len))
                self.policy.inserted(key)
                self.dirty_since[key] = time.monotonic()
            else:
                if back.seg != shadow.seg and segment is not None:
                    segment.live_bytes -= shadow.rec_len  # (nothing names it any more)
                stale.append(key)
            self.index.set(*key, tuple(back))
            self._account(key[0], now, back)
            fixes.append((*key, back))
        return stale

    def _shadow_start(self, ino: int, c: int, shadow: Loc, length: int,
                      tail_lost: bool = False) -> Loc:
        """At mount, with DRAM lost: a chunk goes back to the first *length* bytes of its
        last written-back record (*shadow*; zeros past its end), copied into its region (a
        new DRAM file: the old ones are gone), dirty: the chunk was cut to *length* since
        (the record's bytes past it must not come back, a file grown later reads zeros
        there), or (*tail_lost*) written from *length* on, and what was written is lost
        (EIO). If the record cannot be read, the chunk is lost."""
        try:
            if shadow.seg:
                seg = self.nvme.pin(shadow.seg)
                try:
                    data = self.fetches.read_record(ino, c, shadow, seg, None)
                finally:
                    self.nvme.unpin(seg)
                self.dram.write(ino, c, 0, memoryview(data)[:length])
            else:  # it was a hole: zeros (the region is one)
                self.dram.fd(ino)
        except (ChunkError, RecordError, OSError) as exc:
            log.error("inode %d chunk %d: lost (%s)", ino, c, exc)
            return Loc(-1, 0, 0, 0, length, 0, CODEC_RAW, LOST, 0, self._next_seq())
        return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, TAIL_LOST if tail_lost else 0, 0,
                   self._next_seq())

    def _restream(self, ino: int, owned: dict[int, list[tuple[int, int]]], fixes) -> None:
        """At mount: a file the kernel was writing (passthrough) takes what its DRAM file
        holds, as `take_stream` would have at its close: dirty chunks, sealed below with the
        other unsealed ones. Its size goes to the namespace through `recovered_sizes`."""
        if self.dram.missing(ino):
            log.error("inode %d was being written when the daemon stopped and its DRAM file "
                      "is gone: what was written to it since its last fsync is lost", ino)
            return
        size = self.dram.size(ino)
        data = self.dram.data_chunks(ino)
        self.recovered_sizes[ino] = size, len(data) < self._nchunks(size)
        for c in data:
            loc = Loc(IN_DRAM, 0, 0, 0, min(self.cs, size - c * self.cs), 0, CODEC_RAW, 0, 0,
                      self._next_seq())
            fixes.append((ino, c, loc))
            owned.setdefault(ino, []).append((c, loc.raw_len))
            self.index.set(ino, c, tuple(loc))
            self._account(ino, None, loc)
            self.policy.inserted((ino, c))
            self.dirty_since[(ino, c)] = time.monotonic()
        log.warning("inode %d: was being written when the daemon stopped; kept as its DRAM "
                    "file holds it (%d bytes)", ino, size)

    def _old_arena(self) -> mmap.mmap | None:
        """The DRAM arena of a format 1-2 store, if it survived: its chunks are moved into
        per-inode files at this mount (`_migrate_chunk`)."""
        if not self.dram.survived or not os.path.exists(self.dram.arena_path):
            return None
        with open(self.dram.arena_path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return None
            return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)

    def _migrate_chunk(self, arena: mmap.mmap, ino: int, c: int, loc: Loc) -> Loc:
        """Copy a chunk's DRAM copy from its old arena slot into its region."""
        start = loc.dram_slot * self.cs
        self.dram.write(ino, c, 0, arena[start:start + slot_len(loc)])
        return loc._replace(dram_slot=IN_DRAM)

    def _unpack_at_mount(self, ino: int, c: int, loc: Loc) -> Loc:
        """A packed copy whose segment is gone becomes the chunk's only copy: decode it
        into its region (raw, sealed) if it checks out, else leave it PACKED (then lost)."""
        try:
            data = self.codec.decode(loc.codec, self._dram_bytes(ino, c, loc.stored_len),
                                     loc.raw_len)
            if len(data) != loc.raw_len or hash_bytes(data) != loc.checksum:
                raise CodecError("checksum mismatch")
            self.dram.write(ino, c, 0, data)
        except (CodecError, OSError) as exc:
            log.error("inode %d chunk %d: packed DRAM copy unusable (%s)", ino, c, exc)
            return loc
        log.warning("inode %d chunk %d: kept from its packed DRAM copy", ino, c)
        return loc._replace(flags=loc.flags & TAIL_LOST | SEALED)

    def close(self) -> None:
        self.through.close()
        with self.meta.write() as txn:
            self.meta.set_counter(txn, b"next_seq", self.seq)
        self.dram.close()
        self.nvme.close()

    def _dram_bytes_at(self, ino: int, c: int, start: int, length: int) -> memoryview:
        """`_dram_bytes` of [start, start+length) of the region (empty if length <= 0)."""
        view = memoryview(self._scratch)[:max(0, length)]
        if length > 0:
            self.dram.read_region(self.dram.fd(ino), c * self.cs + start, view)
        return view

    def _dram_bytes(self, ino: int, c: int, length: int) -> memoryview:
        """The first *length* bytes of region (ino, c), read into the scratch buffer: valid
        until the next read of a region on this thread (no await may come in between)."""
        view = memoryview(self._scratch)[:length]
        self.dram.read_into(ino, c, view)
        return view

    # -- location bookkeeping --------------------------------------------------------------
    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def _account(self, ino: int, old: Loc | None, new: Loc | None) -> None:
        reserved_before = self.reservation(ino) if ino in self.allocated else 0
        for loc, sign in ((old, -1), (new, 1)):
            if loc is None:
                continue
            # st_blocks: what the file really occupies (NVMe record, else DRAM pages).
            self.file_bytes[ino] = self.file_bytes.get(ino, 0) + sign * (
                loc.rec_len if loc.seg else pages(loc.raw_len))
            if loc.dram_slot >= 0:
                self.dram_used += sign * pages(slot_len(loc))
                self.dram_logical += sign * loc.raw_len
                self.dram_chunks += sign
                if loc.flags & PACKED:
                    self.dram_packed += sign
                if not loc.seg:
                    self.unbacked += sign * pages(loc.raw_len)
            if loc.seg:
                self.nvme_live += sign * loc.rec_len
                self.nvme_logical += sign * loc.raw_len
                self.nvme_chunks += sign
        if ino in self.allocated:
            self.reserved += self.reservation(ino) - reserved_before

    def _store_loc(self, txn, ino: int, c: int, loc: Loc | None) -> None:
        self.through.changing(ino, c)  # before any change: bytes read ahead may be old now
        if loc is None:
            txn.delete(key2(ino, c), db=self.meta.db["chunks"])
            self.index.pop(ino, c)
        else:
            txn.put(key2(ino, c), LOC.pack(*loc), db=self.meta.db["chunks"])
            self.index.set(ino, c, tuple(loc))

    def _replace(self, txn, ino: int, c: int, old: Loc | None, new: Loc | None,
                 kept: int | None = None) -> None:
        """Swap a chunk's location; copies the new one no longer names are released after
        the commit. *kept*, for a change of bytes: how many of the chunk's bytes before
        it are still the file's after it (a write's or a punch's chunk extent before it,
        `_extent`; a truncation's cut), for the shadow it may leave (`_shadow`); None for
        a change of no byte (sealing, unsealing, a write-back, a drop), which leaves a
        shadow as it is."""
        self._account(ino, old, new)
        self._store_loc(txn, ino, c, new)
        key = (ino, c)
        if old is not None and old.dram_slot >= 0 and (new is None or
                                                       new.dram_slot != old.dram_slot):
            self.policy.removed(key)
            self.dirty_since.pop(key, None)
            self.fetches.dropped(key)
            length = slot_len(old)
            self.meta.after_commit(lambda: self.dram.release(ino, c, length))
        if old is not None and old.seg and (new is None or (new.seg, new.off) !=
                                            (old.seg, old.off)):
            if new is not None and not new.seg and key not in self.shadows:
                # written over: kept until written back
                self._shadow(txn, key, nvme_only(old), kept or 0)
            else:
                seg, rec_len = old.seg, old.rec_len
                self.meta.after_commit(lambda: self.nvme.mark_dead(seg, rec_len))
        elif old is None and new is not None and not new.seg and kept and key not in self.shadows:
            self._shadow(txn, key, HOLE, kept)  # written into a hole inside the file
        if key in self.shadows and (new is None or new.seg):
            self._unshadow(txn, key)  # the new bytes are on NVMe (or the chunk is gone)
        elif key in self.shadows and kept is not None and kept < self.shadow_kept[key]:
            self._shadow(txn, key, self.shadows[key], kept)
        if new is not None and new.dram_slot >= 0:
            if old is None or old.dram_slot != new.dram_slot:
                self.policy.inserted(key)
            if not new.seg:
                self.dirty_since.setdefault(key, time.monotonic())
            else:
                self.dirty_since.pop(key, None)

    def _shadow(self, txn, key: tuple[int, int], loc: Loc, kept: int) -> None:
        """A chunk's NVMe record (*loc*), or the hole it was (HOLE), is written over in DRAM,
        and its first *kept* bytes (zeros past the record's end) are still the file's: keep
        it, in lmdb's `shadows`, until the new bytes are written back. An fsync may have
        made those bytes durable, and a DRAM tier lost before that writeback must take the
        chunk back to them, not lose them (`_load_shadows`). Bytes the file gained past
        *kept* since (appended, or after a cut) were only in DRAM: they are lost then."""
        if key not in self.shadows:
            self.nvme_live += loc.rec_len
        self.shadows[key] = loc
        self.shadow_kept[key] = kept
        txn.put(key2(*key), LOC.pack(*loc) + U32.pack(kept), db=self.meta.db["shadows"])

    def _unshadow(self, txn, key: tuple[int, int]) -> None:
        self.shadow_kept.pop(key, None)
        loc = self.shadows.pop(key)
        txn.delete(key2(*key), db=self.meta.db["shadows"])
        self.nvme_live -= loc.rec_len
        self.meta.after_commit(lambda: self.nvme.mark_dead(loc.seg, loc.rec_len))

    def relocated(self, ino: int, c: int, old: Loc, seg: int, off: int, rec_len: int) -> None:
        """The cleaner copied a record: point the chunk (or its shadow) at the copy if
        nothing changed."""
        now = self.get(ino, c)
        shadow = self.shadows.get((ino, c))
        if now is not None and (now.seg, now.off, now.seq) == (old.seg, old.off, old.seq):
            with self.meta.write() as txn:
                self._replace(txn, ino, c, now, now._replace(seg=seg, off=off, rec_len=rec_len))
        elif shadow is not None and (shadow.seg, shadow.off, shadow.seq) == (
                old.seg, old.off, old.seq):
            with self.meta.write() as txn:
                kept = self.shadow_kept.get((ino, c), 0)
                self._unshadow(txn, (ino, c))
                self._shadow(txn, (ino, c), shadow._replace(seg=seg, off=off, rec_len=rec_len),
                             kept)
        else:
            self.nvme.mark_dead(seg, rec_len)

    def live_record(self, ino: int, c: int, seg: int, off: int, seq: int) -> Loc | None:
        """The location (the chunk's, or its shadow) that names the record at (*seg*,
        *off*) with *seq*, or None if that record is dead (the cleaner's question)."""
        for loc in (self.get(ino, c), self.shadows.get((ino, c))):
            if loc is not None and (loc.seg, loc.off, loc.seq) == (seg, off, seq):
                return loc
        return None

    def get(self, ino: int, c: int) -> Loc | None:
        t = self.index.get(ino, c)
        return None if t is None else Loc._make(t)

    def dram_pages(self, key: tuple[int, int]) -> int:
        loc = self.get(*key)
        return pages(slot_len(loc)) if loc is not None and loc.dram_slot >= 0 else 0

    def is_clean(self, key: tuple[int, int]) -> bool:
        loc = self.get(*key)
        return loc is None or loc.seg > 0

    # -- capacity --------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Record bytes the files may hold: what the NVMe tier's segments hold (as many as
        nvme_size allows, or fewer while the filesystem below has no room for them: it may
        be shared, or smaller), less the room kept free so that cleaning always has
        somewhere to copy to (its reserved segments and 5%)."""
        nvme = self.nvme
        per_segment = nvme.usable(self.cs)
        tier = nvme.max_segments * per_segment
        return tier - nvme.gc_reserved * per_segment - tier // 20

    @property
    def used(self) -> int:
        return self.nvme_live + self.unbacked + self.reserved + (
            self.unseen_bytes() if self.streaming else 0)

    def _check_capacity(self, growth: int, ino: int) -> None:
        if growth > 0 and ino in self.allocated:
            growth -= min(growth, self.reservation(ino))  # fallocate()d room is already counted
        if growth > 0 and (self.meta.room_low or self.used + growth > self.capacity):
            raise NoSpace()

    def check_room(self) -> None:
        """NoSpace if the metadata has no room to grow (a create, a link, an xattr would
        need some): see kvfs.store.meta, META_STEP."""
        if self.meta.room_low:
            raise NoSpace()

    # -- fallocate reservations ------------------------------------------------------------
    def reservation(self, ino: int) -> int:
        """Bytes fallocate() promised a file beyond what it stores now."""
        return max(0, self.allocated.get(ino, 0) - self.file_bytes.get(ino, 0))

    def blocks_bytes(self, ino: int) -> int:
        """What the file occupies for st_blocks: stored bytes, or its allocation if larger."""
        return max(self.file_bytes.get(ino, 0), self.allocated.get(ino, 0))

    def allocate(self, ino: int, offset: int, length: int) -> None:
        """fallocate(mode 0): reserve room for the holes in [offset, offset+length) so that
        writes there cannot fail with ENOSPC. Raises NoSpace if it does not fit."""
        cs = self.cs
        missing = 0
        for c in range(offset // cs, (offset + length + cs - 1) // cs):
            if self.index.get(ino, c) is None:
                missing += min(offset + length, (c + 1) * cs) - max(offset, c * cs)
        if not missing:
            return
        missing = pages(missing)
        if self.used + missing > self.capacity:
            raise NoSpace()
        self._set_allocated(ino, max(self.allocated.get(ino, 0),
                                     self.file_bytes.get(ino, 0)) + missing)

    def _set_allocated(self, ino: int, value: int) -> None:
        before = self.reservation(ino)
        if value:
            self.allocated[ino] = value
        else:
            self.allocated.pop(ino, None)
        self.reserved += self.reservation(ino) - before
        with self.meta.write() as txn:
            if value:
                txn.put(u64(ino), u64(value), db=self.meta.db["alloc"])
            else:
                txn.delete(u64(ino), db=self.meta.db["alloc"])

    def notify_space(self) -> None:
        self._space.set()
        self._space = trio.Event()

    async def _wait_dram(self, growth: int) -> bool:
        """Wait until the DRAM tier has room for *growth* more bytes. True: there is none,
        but the bytes may go over the tier's size (nothing could ever make room for them);
        NoSpace at once while nothing can leave it (the NVMe tier is full), or after
        DRAM_WAIT_S in all."""
        deadline = trio.current_time() + DRAM_WAIT_S
        while self.dram_load + growth > self.dram.capacity:
            if not self._drop_one_clean():
                if self.dram_chunks == 0:
                    return True  # a single write bigger than DRAM: let it through
                if self.nvme_full.met_within(FULL_RETRY_S):
                    raise NoSpace()  # nothing leaves DRAM: at once, not after a wait
                if self.dram_pinned_full.met_within(FULL_RETRY_S):
                    return True  # nothing can leave it (see `nothing_leaves`)
                self.space_waiters += 1
                try:
                    self.kick_demoter()
                    with trio.move_on_at(deadline) as waited:
                        await self._space.wait()
                finally:
                    self.space_waiters -= 1
                if waited.cancelled_caught:
                    raise NoSpace()
        return False

    def nothing_leaves(self) -> None:
        """The demoter found nothing it may take out of a full DRAM tier: every chunk left
        belongs to a file the kernel reads or writes straight from its DRAM file
        (passthrough; adopted writers may grow such a file past PASSTHROUGH_SHARE). Writes
        waiting for room go over the tier's size for a while instead of waiting for good."""
        self.dram_pinned_full.failed(
            f"{self.dram_used >> 20} MiB in DRAM, all of it held by files open in "
            f"passthrough mode: writes go over the tier's {self.dram.capacity >> 20} MiB")
        self.notify_space()

    def _drop_one_clean(self) -> bool:
        key = self.policy.coldest()
        if key is not None and self.is_clean(key) and not self.policy.keep(key):
            self.drop_dram_copy(key)
            return True
        return False  # dirty, wanted by readahead or far: the demoter keeps eviction order

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

    # -- read ------------------------------------------------------------------------------
    async def read(self, ino: int, off: int, size: int, file_size: int,
                   verified: set | None = None) -> bytes | memoryview:
        """The bytes of [off, off+size) (short at the end of the file). A memoryview returned
        may be of the store's scratch buffer: valid until the caller's next await (pyfuse3
        sends it to the kernel before any other task runs)."""
        end = min(off + size, file_size)
        if off >= end:
            return b""
        cs = self.cs
        first, last = off // cs, (end - 1) // cs
        through = self.through.reads(ino, file_size)
        if through:
            self.through.sequential(ino, first, last, self._nchunks(file_size), end // cs)
        if first == last:
            return await self._read_piece(ino, first, off - first * cs, end - off, verified,
                                          through)
        parts = []
        for c in range(first, last + 1):
            start = max(off, c * cs) - c * cs
            stop = min(end, (c + 1) * cs) - c * cs
            try:
                part = await self._read_piece(ino, c, start, stop - start, verified, through)
            except ChunkError:
                if not parts:
                    raise
                break  # a short read of what checked out, as ext4 gives; EIO at the next
            # A view of the scratch buffer is only valid until the next await: copy it.
            parts.append(bytes(part) if isinstance(part, memoryview) else part)
        return b"".join(parts)

    async def _read_piece(self, ino: int, c: int, start: int, length: int,
                          verified: set | None, through: bool = False) -> bytes | memoryview:
        t0 = time.perf_counter()
        while True:
            loc = self.get(ino, c)
            if loc is None:
                # A hole, or a chunk that a truncation removed while this read waited (for a
                # fetch): zeros, but only up to the file's end as it is now.
                self.counters.count_read("holes", start == 0)
                size = self.size_of(ino)
                if size is not None:
                    length = max(0, min(length, size - c * self.cs - start))
                return bytes(length)
            if loc.flags & LOST:
                raise ChunkError(f"inode {ino} chunk {c}: its only copy was lost with DRAM")
            if loc.flags & TAIL_LOST and start + length > loc.raw_len:
                raise ChunkError(f"inode {ino} chunk {c}: its bytes past {loc.raw_len} were "
                                 f"lost with DRAM")
            if loc.flags & PACKED:
                data = await self.fetches.unpack(ino, c, loc)
                if data is None:
                    continue  # the chunk changed while we decoded it: start over
                self.policy.hit((ino, c))
                self.fetches.used((ino, c))
                self.counters.count_read("dram", start == 0)
                self._record_latency(t0, self.counters.read_latency_dram_us)
                return _slice(memoryview(data), start, length)
            if loc.dram_slot >= 0:
                check = ((verified is None or (c, loc.seq) not in verified)
                         and self._check_needed(ino, c, loc))
                if check:
                    self.counters.dram_checks += 1
                    view = self._dram_bytes(ino, c, loc.raw_len)
                    if hash_bytes(view) != loc.checksum:
                        self.counters.checksum_errors += 1
                        raise ChunkError(f"inode {ino} chunk {c}: checksum mismatch in DRAM")
                    self._mark_checked(ino, c, loc)
                    view = view[start:]
                else:  # only the bytes asked for
                    view = self._dram_bytes_at(ino, c, start, min(length, loc.raw_len - start))
                if check and verified is not None:
                    verified.add((c, loc.seq))
                self.policy.hit((ino, c))
                self.fetches.used((ino, c))
                self.counters.count_read("dram", start == 0)
                self._record_latency(t0, self.counters.read_latency_dram_us)
                return _slice(view, 0, length)
            if self.fetches.late((ino, c)):
                self.counters.prefetch_late += 1
            data = await self.through.use((ino, c), loc, start, length) if through else None
            if data is CHANGED:
                continue  # the chunk changed meanwhile: start over
            if data is None:  # (nothing read ahead, or it failed: this fetch says why, EIO)
                data = await self.fetches.fetch(
                    ino, c, loc, stage=None if through else self.dram.capacity * PROMOTE_SHARE)
                if data is None:
                    continue  # the chunk changed while we read it: start over
                if verified is not None:
                    verified.add((c, loc.seq))  # fetch verified it
            self.counters.count_read("nvme", start == 0)
            self._record_latency(t0, self.counters.read_latency_nvme_us)
            if through and start + length >= loc.raw_len:
                self.through.done(ino, c, loc, data)
            return _slice(memoryview(data), start, length)

    def _check_needed(self, ino: int, c: int, loc: Loc, consume: bool = True) -> bool:
        """Must a read hash this sealed DRAM copy before trusting it? `dram_verify=open`: yes,
        unless the fetch that staged it checked it (that counts for the next read only);
        `once`: only if this daemon has not checked it since its bytes last changed (after
        a restart, every copy is checked once); `ingest`: never (checked on the way in)."""
        if self.dram_verify == "ingest" or not loc.flags & SEALED:
            return False
        return not self.dram.checked(ino, c, loc.seq,
                                     consume=consume and self.dram_verify == "open")

    def _mark_checked(self, ino: int, c: int, loc: Loc) -> None:
        """The region holds exactly the bytes of *loc*'s checksum (dram_verify=once)."""
        if self.dram_verify == "once":
            self.dram.mark_checked(ino, c, loc.seq)

    def _record_latency(self, t0: float, tier: list[int]) -> None:
        self._record_us(int((time.perf_counter() - t0) * 1e6), tier)

    def _record_us(self, us: int, tier: list[int]) -> None:
        """A read of *us* microseconds in the histograms (log2 buckets): all, and *tier*'s."""
        bucket = min(23, us.bit_length())
        self.counters.read_latency_us[bucket] += 1
        tier[bucket] += 1

    @property
    def dram_load(self) -> int:
        """DRAM bytes in use: chunks' pages, regions that NVMe reads are filling and the room
        promised to files the kernel is writing (their bytes are counted when taken)."""
        return self.dram_used + self.dram_filling + self.stream_promised

    def promotion_room(self, nbytes: int, limit: float | None = None) -> bool:
        """May a promotion take *nbytes* of DRAM (below *limit* bytes, default 90%) without
        evicting anything?"""
        cap = self.dram.capacity * PROMOTE_SHARE if limit is None else limit
        return self.dram_load + nbytes <= cap

    # -- passthrough: the kernel reads a file straight from its DRAM file -------------------
    async def passthrough_ready(self, ino: int, size: int) -> bool:
        """May the kernel serve reads of this file from its DRAM file? Only if every chunk
        is in DRAM, raw, and checks out now (the reads will not come here to be checked: an
        open verifies what a handle's reads would), and the pinned files stay within
        PASSTHROUGH_SHARE of the tier. True means: pin it now (`pin_passthrough`), with no
        await in between."""
        locs = self._raw_in_dram(ino, size)
        if locs is None:
            return False
        need = sum(pages(loc.raw_len) for _, loc in locs)
        if (ino not in self.dram.pins
                and self.pinned_bytes + need > PASSTHROUGH_SHARE * self.dram.capacity):
            return False
        check = [(c, loc) for c, loc in locs if self._check_needed(ino, c, loc, consume=False)]
        self.counters.dram_checks += len(check)
        sums = await self._hash_chunks(ino, check)
        if any(self.get(ino, c) != loc for c, loc in locs):
            return False  # changed meanwhile: the ordinary path decides
        # A mismatch is left to the ordinary path, which reports it (EIO) chunk by chunk.
        if any(csum != loc.checksum for (_, loc), csum in zip(check, sums, strict=True)):
            return False
        for c, loc in check:
            self._mark_checked(ino, c, loc)
        return True

    async def stage_file(self, ino: int, size: int) -> int:
        """Bring a file's NVMe-only chunks into DRAM (clean, raw copies), all at once, for an
        open that will then be served from DRAM by the kernel. Returns how many were read
        from NVMe, or -1 if the file is too long, DRAM has no room (nothing is evicted for
        this) or a chunk could not be staged: the open then goes the ordinary way."""
        todo = [(c, loc) for c in self.index.chunks_of(ino, self._nchunks(size))
                if (loc := self.get(ino, c)).dram_slot < 0]
        if not todo:
            return 0
        if self.through.reads(ino, size):
            return -1
        need = sum(pages(loc.raw_len) for _, loc in todo)
        if (size > STAGE_FILE_MAX or any(loc.flags & LOST for _, loc in todo)
                or not self.promotion_room(need)):
            return -1
        t0 = time.perf_counter()
        # A chunk whose prefetch was already in flight is a (late) prefetch hit, as on the
        # daemon's read path; every other one is this open's NVMe read, whoever fetches it.
        late = {c for c, _ in todo if self.fetches.late((ino, c))}

        async def stage(c: int, loc: Loc) -> None:
            try:
                await self.fetches.fetch(ino, c, loc, stage=self.dram.capacity * PROMOTE_SHARE,
                                 raw=True, want=False)
            except ChunkError as exc:
                log.warning("staging for an open: %s", exc)  # its read will say EIO
            now = self.get(ino, c)
            if now is not None and now.dram_slot >= 0 and not now.flags & PACKED:
                self.dram.mark_checked(ino, c, now.seq)  # fetch checked these bytes

        async with open_nursery() as nursery:
            for c, loc in todo:
                nursery.start_soon(stage, c, loc)
        if any((loc := self.get(ino, c)) is None or loc.dram_slot < 0 for c, _ in todo):
            return -1
        fetched = len(todo) - len(late)
        self.counters.prefetch_late += len(late)
        self.counters.chunks_from_nvme += fetched
        self.counters.staged_chunks += fetched
        for _ in range(fetched):
            self._record_latency(t0, self.counters.read_latency_nvme_us)
        return fetched

    def passthrough_fd(self, ino: int, size: int) -> int | None:
        """The DRAM file of *ino*, at the file's size, if a passthrough open would find it
        ready now with nothing left to check (every chunk in DRAM, raw, checked since it
        last changed); else None. Synchronous: `passthrough_ready` without the hashing."""
        locs = self._raw_in_dram(ino, size) if size > 0 else None
        if locs is None or any(self._check_needed(ino, c, loc, consume=False)
                               for c, loc in locs):
            return None
        return self.dram.extend(ino, size)

    def _raw_in_dram(self, ino: int, size: int) -> list[tuple[int, Loc]] | None:
        """Every chunk of the file with its location, if all are raw DRAM copies that no
        fetch is filling; else None (a lost tail must read as EIO, which only we can say)."""
        locs = []
        for c in self.index.chunks_of(ino, self._nchunks(size)):
            loc = self.get(ino, c)
            if (loc.dram_slot < 0 or loc.flags & (PACKED | LOST | TAIL_LOST)
                    or self.fetches.busy((ino, c))):
                return None
            locs.append((c, loc))
        return locs

    def pin_passthrough(self, ino: int, size: int, reads: bool = True,
                        from_nvme: int = 0) -> int:
        """*ino* is opened in passthrough mode: its DRAM copies stay until
        `unpin_passthrough`, and the returned descriptor is its DRAM file, as long as the
        file. With *reads* (the open passed `passthrough_ready`; the kernel will read it
        without us), its chunks count as read now: from DRAM, but for the *from_nvme* that
        `stage_file` just brought in."""
        chunks = list(self.index.chunks_of(ino, self._nchunks(size)))
        if ino not in self.dram.pins:  # counted once per file
            held = self._pinned[ino] = sum(pages(self.get(ino, c).raw_len) for c in chunks)
            self.pinned_bytes += held
        self.dram.pin(ino)
        if not reads:
            return self.dram.fd(ino)
        self.counters.passthrough_opens += 1
        for c in chunks:
            key = (ino, c)
            if self.dram_verify == "open":
                self.dram.forget(ino, c)  # a check counts for one open only
            self.policy.hit(key)
            self.fetches.used(key)
        self.counters.chunks_from_dram += len(chunks) - from_nvme
        self.counters.passthrough_chunks += len(chunks)
        return self.dram.extend(ino, size)

    def unpin_passthrough(self, ino: int) -> None:
        """A passthrough open of *ino* was released."""
        self.dram.unpin(ino)
        if ino not in self.dram.pins:
            self.pinned_bytes -= self._pinned.pop(ino, 0)

    # -- passthrough writers: the kernel writes a new file straight into its DRAM file --------
    def can_stream(self, expected: int) -> bool:
        """May one more new file, expected to reach *expected* bytes, be written by the
        kernel without us (`start_stream`)? Not with dram_compress: the copies of such a
        file stay raw until it is closed, and packing is what that option is for."""
        room = min(self.dram.capacity - self.dram_load,
                   self.capacity - self.used - self.stream_promised)
        return (not self.dram_compress and len(self.streaming) < STREAMS_MAX
                and pages(expected) <= STREAM_ROOM_SHARE * room)

    def start_stream(self, ino: int, expected: int) -> int:
        """The kernel will write the (empty) file *ino*, expected to reach *expected* bytes,
        straight into its DRAM file (the returned descriptor) until `take_stream(ino,
        done=True)`. Recorded in lmdb first, so that a mount after a crash takes what the
        DRAM file holds (`_load`)."""
        with self.meta.write() as txn:
            txn.put(u64(ino), b"", db=self.meta.db["writers"])
        self.streaming[ino] = pages(expected)
        self.stream_promised += pages(expected)
        if self.dram_load > self.high_water:
            self.kick_demoter()
        self.dram.pin(ino)
        self.counters.stream_opens += 1
        return self.dram.extend(ino, 0)

    def adopt_stream(self, ino: int) -> bool:
        """The kernel will write *ino*, a file wholly in its DRAM file (open in passthrough
        mode), straight into it from now on, as it writes a new file (`start_stream`), until
        `take_stream(ino, done=True)`: a writable open of a file the kernel reads without us
        must carry its backing id, and a shared mapping of it writes the DRAM file. Recorded
        in lmdb as `start_stream` does. False if it may not be (dram_compress, too many).
        Its chunks stay as recorded until that take; a write-back meanwhile that finds one
        changed leaves it to the take (an fsync takes first)."""
        if self.dram_compress or len(self.streaming) >= STREAMS_MAX or ino in self.streaming:
            return False
        with self.meta.write() as txn:
            txn.put(u64(ino), b"", db=self.meta.db["writers"])
        self.streaming[ino] = 0  # nothing promised: its bytes are in DRAM already
        self.adopted.add(ino)
        self.dram.pin(ino)
        self.counters.stream_adoptions += 1
        return True

    def stream_size(self, ino: int) -> int:
        """The length of a file being written by the kernel: its DRAM file's."""
        return self.dram.size(ino)

    def stream_blocks(self, ino: int) -> int:
        """Bytes of RAM a file being written by the kernel holds so far."""
        return self.dram.ram(ino)

    async def take_stream(self, ino: int, *, done: bool,
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
            return await self._take_stream(ino, done, on_commit)
        finally:
            self._taking.pop(ino).set()

    async def _take_stream(self, ino: int, done: bool, on_commit) -> int:
        size = self.stream_size(ino)
        data = self.dram.data_chunks(ino)
        lens = [min(self.cs, size - c * self.cs) for c in data]
        sums = await self._hash_chunks(ino, [(c, Loc(IN_DRAM, 0, 0, 0, n, 0, CODEC_RAW, 0, 0, 0))
                                             for c, n in zip(data, lens, strict=True)])
        present = set(data)
        with self.meta.write() as txn:
            for c in self._stream_chunks(ino, size):
                if c not in present:  # (a set built per chunk made big files' takes O(n^2))
                    self._replace(txn, ino, c, self.get(ino, c), None)
            for c, n, csum in zip(data, lens, sums, strict=True):
                old = self.get(ino, c)
                if (old is not None and old.dram_slot >= 0 and old.flags & SEALED
                        and (old.raw_len, old.checksum) == (n, csum)):
                    continue
                if old is None or old.dram_slot < 0:
                    self.dram.claim(ino, c)
                new = Loc(IN_DRAM, 0, 0, 0, n, 0, CODEC_RAW, SEALED if done else 0,
                          csum if done else 0, self._next_seq())
                self._replace(txn, ino, c, old, new)
                if done:
                    self._mark_checked(ino, c, new)  # hashed from the region itself
                self.counters.streamed_chunks += 1
            if done:
                txn.delete(u64(ino), db=self.meta.db["writers"])
            if on_commit is not None:
                on_commit(size, len(data) < self._nchunks(size))
        if done:
            self._stream_ended(ino)
        if self.dram_load > self.high_water:
            self.kick_demoter()
        return size

    def unseen_bytes(self) -> int:
        """RAM that files the kernel is writing hold beyond what their chunks account for
        (what was written since they were opened or last taken)."""
        out = 0
        for ino in self.streaming:
            counted = sum(self.dram_pages((ino, c))
                          for c in self._stream_chunks(ino, self.stream_size(ino)))
            out += max(0, self.stream_blocks(ino) - counted)
        return out

    def _stream_chunks(self, ino: int, size: int) -> list[int]:
        """The chunks recorded for a file the kernel writes, whose DRAM file is *size* long.
        They all lie within it: the kernel only makes it longer, and a truncation cuts it
        and the chunks past its new end together (`truncate`). Asking the index for every
        chunk the inode might have scanned the whole index, at every create (issue 33)."""
        return self.index.chunks_of(ino, self._nchunks(size))

    def end_stream(self, ino: int) -> None:
        """The file being written by the kernel is gone (unlinked, last close) or could not
        be opened so: nothing to take; `delete_file` frees what an fsync recorded."""
        with self.meta.write() as txn:
            txn.delete(u64(ino), db=self.meta.db["writers"])
        self._stream_ended(ino)

    def _stream_ended(self, ino: int) -> None:
        self.stream_promised -= self.streaming.pop(ino, 0)
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
            mapped_shared_writable, files, limiter=self.limiter)

    def resized(self, ino: int, size: int) -> None:
        """A file open in passthrough mode grew to *size* without a write (truncate up,
        fallocate): its DRAM file must say so, or the kernel's reads stop at its old end."""
        if ino in self.dram.pins:
            self.dram.extend(ino, size)

    # -- write -----------------------------------------------------------------------------
    async def write(self, ino: int, off: int, data: bytes,
                    on_commit: Callable[[int], None] | None = None) -> int:
        """Store *data* at *off*; returns the bytes stored: all of them, or, when a piece
        after the first fails, those before it (a short write, as POSIX has it). Each piece
        (the part in one chunk) is its own commit, and *on_commit(end)* runs inside it,
        *end* being where the bytes stored so far end: the caller's inode update rides
        along, so that neither a crash nor a failure part way leaves a chunk holding bytes
        past the file's size (a file grown later must read zeros there)."""
        cs = self.cs
        pos, end = off, off + len(data)
        mv = memoryview(data)
        while pos < end:
            c = pos // cs
            start = pos - c * cs
            stop = min(cs, end - c * cs)
            try:
                await self._write_piece(ino, c, start, mv[pos - off:pos - off + stop - start],
                                        None if on_commit is None else
                                        partial(on_commit, c * cs + stop))
            except Exception:
                if pos == off:
                    raise
                log.warning("inode %d: a write stopped at %d of %d bytes (a short write)",
                            ino, pos - off, len(data))
                return pos - off
            pos = c * cs + stop
            if pos < end:
                self.faults.reached("write.piece")
        return len(data)

    async def _write_piece(self, ino: int, c: int, start: int, piece: memoryview,
                           on_commit: Callable[[], None] | None = None) -> None:
        stop = start + len(piece)
        over = False  # may go over the DRAM tier's size (`_wait_dram`)
        while True:
            pending = self.fetches.pending((ino, c))
            if pending is not None:  # an NVMe read is filling the region: let it finish
                await pending.wait()
                continue
            loc = self.get(ino, c)
            if loc is not None and loc.flags & PACKED:
                self.drop_dram_copy((ino, c))  # clean: its bytes are raw on NVMe
                continue
            covers = start == 0 and (loc is None or stop >= loc.raw_len)
            if loc is not None and loc.flags & TAIL_LOST and start > loc.raw_len:
                raise ChunkError(f"inode {ino} chunk {c}: its bytes past {loc.raw_len} were "
                                 f"lost with DRAM; a write past them would make them zeros")
            if loc is not None and loc.dram_slot < 0 and not covers:
                if loc.flags & LOST:
                    raise ChunkError(f"inode {ino} chunk {c}: its only copy was lost with DRAM")
                await self._make_resident(ino, c, loc)  # read-modify-write of an NVMe chunk
                continue
            in_dram = loc is not None and loc.dram_slot >= 0
            old_len = loc.raw_len if in_dram else 0
            new_len = max(old_len, stop)
            # After the write the chunk is DRAM-only: its pages count until written back, and
            # an NVMe copy it had is dead.
            before = 0 if loc is None else (
                (pages(loc.raw_len) if in_dram and not loc.seg else 0)
                + (loc.rec_len if loc.seg else 0))
            self._check_capacity(pages(new_len) - before, ino)
            growth = pages(new_len) - pages(old_len)
            if not over and self.dram_load + growth > self.dram.capacity:
                over = await self._wait_dram(growth)
                continue  # the world may have changed while we waited
            self._apply_write(ino, c, loc, start, piece, new_len, on_commit)
            return

    # -- writes straight into DRAM (kvfs._fuseshim copies the request's data) ----------------
    def plan_write(self, ino: int, off: int, size: int) -> WritePlan | None:
        """Prepare a write of *size* bytes at *off* into DRAM and return its plan, or None
        when the write needs the ordinary path (a chunk on NVMe only that it does not fully
        cover, a gap to zero-fill, a chunk being fetched, no room in DRAM without waiting,
        the filesystem full). Each chunk either starts in DRAM with this write or is written
        in place (it is in DRAM and the write starts within or right after its bytes: the
        next request of a stream). Its bytes go to the same offsets of the inode's DRAM file
        (`write_fd`). The caller copies the data and then calls finish_write or abort_write,
        with no await in between."""
        cs = self.cs
        pieces: list[tuple[int, int, int, Loc | None]] = []  # chunk, start, stop, location
        growth = dram_growth = 0
        pos, end = off, off + size
        while pos < end:
            c, start = divmod(pos, cs)
            stop = min(cs, end - c * cs)
            loc = self.get(ino, c)
            if (loc is not None and loc.flags & (LOST | PACKED | TAIL_LOST)
                    or self.fetches.busy((ino, c))):
                return None
            if loc is None or loc.dram_slot < 0:
                if start or (loc is not None and stop < loc.raw_len):
                    return None  # zero-fill, or a read-modify-write of an NVMe chunk
                growth += pages(stop) - (loc.rec_len if loc is not None else 0)
                dram_growth += pages(stop)
            else:
                if start > loc.raw_len:
                    return None  # a gap to zero-fill
                new_len = max(loc.raw_len, stop)
                before = (0 if loc.seg else pages(loc.raw_len)) + (loc.rec_len if loc.seg else 0)
                growth += pages(new_len) - before
                dram_growth += pages(new_len) - pages(loc.raw_len)
            pieces.append((c, start, stop, loc))
            pos = c * cs + stop
        try:
            self._check_capacity(growth, ino)
        except NoSpace:
            return None  # the ordinary path raises it (or, in cache mode, evicts)
        if self.dram_load + dram_growth > self.dram.capacity:
            return None
        unseal = [(c, loc) for c, _, _, loc in pieces
                  if loc is not None and loc.dram_slot >= 0 and loc.flags & SEALED]
        if unseal:  # in lmdb before the bytes change (crash safety, see the module doc)
            with self.meta.write() as txn:
                for c, loc in unseal:
                    self._replace(txn, ino, c, loc, loc._replace(flags=loc.flags & ~SEALED))
        planned = []
        for c, start, stop, _ in pieces:
            loc = self.get(ino, c)
            if loc is None or loc.dram_slot < 0:
                self.dram.claim(ino, c)
            else:
                self.dram.forget(ino, c)  # the shim writes it without DramFiles
            planned.append((c, start, stop, loc))
        return WritePlan(ino, planned)

    def write_fd(self, plan: WritePlan) -> int:
        """The file descriptor a planned write's bytes go to, at their own file offsets."""
        return self.dram.fd(plan.ino)

    def finish_write(self, plan: WritePlan, on_commit: Callable[[int], None] | None) -> None:
        """The planned bytes are in their regions: commit them (one transaction, in which
        *on_commit(end)* runs, *end* being where they end)."""
        if any(self.get(plan.ino, c) != loc for c, _, _, loc in plan.pieces):
            self.abort_write(plan)  # cannot happen: nothing runs between plan and finish
            raise RuntimeError(f"inode {plan.ino}: chunks changed during a write")
        with self.meta.write() as txn:
            for c, _start, stop, loc in plan.pieces:
                in_place = loc is not None and loc.dram_slot >= 0
                length = max(loc.raw_len, stop) if in_place else stop
                self._replace(txn, plan.ino, c, loc, self._dram_loc(length),
                              kept=self._extent(plan.ino, c))
            if on_commit is not None:
                c, _, stop, _ = plan.pieces[-1]
                on_commit(c * self.cs + stop)
        self.counters.direct_writes += 1
        if self.dram_load > self.high_water:
            self.kick_demoter()

    def _dram_loc(self, length: int, whole=None) -> Loc:
        """The location of a chunk just written in DRAM (a new seq). A chunk made whole
        by one piece of data we hold (*whole*: all chunk_size bytes; it cannot grow any
        more) is sealed at once, hashing the bytes while they are in cache (the usual case
        for an engine's blocks); others are sealed at close, so that the next write of a
        stream does not have to unseal them first."""
        if whole is not None:
            return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, SEALED, hash_bytes(whole),
                       self._next_seq())
        return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, 0, 0, self._next_seq())

    def abort_write(self, plan: WritePlan) -> None:
        """The copy failed part way: regions new to DRAM go back (punched); chunks written
        in place may hold some new bytes (`_written_part`)."""
        for c, _, stop, loc in plan.pieces:
            if loc is None or loc.dram_slot < 0:
                self.dram.release(plan.ino, c, stop)
            else:
                now = self.get(plan.ino, c)
                if now is not None:
                    self._written_part(plan.ino, c, now)
        self.dram.settle()

    def _written_part(self, ino: int, c: int, loc: Loc) -> None:
        """A write into a DRAM chunk failed part way: its bytes may have changed, so it takes
        a new seq (unsealed, same length), and whatever landed past its end is punched (the
        region holds nothing there)."""
        self.dram.punch(ino, c * self.cs + loc.raw_len, self.cs - loc.raw_len)
        with self.meta.write() as txn:
            self._replace(txn, ino, c, loc,
                          loc._replace(flags=loc.flags & ~SEALED, seq=self._next_seq()))

    async def _make_resident(self, ino: int, c: int, loc: Loc) -> None:
        """Bring an NVMe-only chunk into DRAM (for a partial write); the caller re-checks."""
        over = await self._wait_dram(pages(loc.raw_len))
        now = self.get(ino, c)
        if now is None or now.seq != loc.seq or now.dram_slot >= 0:
            return
        await self.fetches.fetch(ino, c, now, stage=math.inf if over else float(self.dram.capacity),
                         raw=True, want=False)

    def _apply_write(self, ino: int, c: int, loc: Loc | None, start: int, piece: memoryview,
                     new_len: int, on_commit: Callable[[], None] | None) -> None:
        """Synchronous part of a write: no await from here to the commit."""
        whole = piece if start == 0 and len(piece) == self.cs else None
        if loc is None or loc.dram_slot < 0:
            # New to DRAM: bytes first (the region is a hole: any gap before *start* reads
            # as zeros), then the commit that makes them part of the file.
            self.dram.claim(ino, c)
            try:
                self.dram.write(ino, c, start, piece)
            except BaseException:
                self.dram.release(ino, c, new_len)
                self.dram.settle()
                raise
        else:
            if loc.flags & SEALED:
                # Unseal in lmdb before the bytes change (crash safety, see module doc).
                with self.meta.write() as txn:
                    unsealed = loc._replace(flags=loc.flags & ~SEALED)
                    self._replace(txn, ino, c, loc, unsealed)
                loc = unsealed
            try:
                self.dram.write(ino, c, start, piece)
            except BaseException:
                self._written_part(ino, c, loc)
                raise
        new = self._dram_loc(new_len, whole)
        if loc is not None and loc.flags & TAIL_LOST and whole is None:
            new = new._replace(flags=new.flags | TAIL_LOST)  # its end is still lost
        with self.meta.write() as txn:
            self._replace(txn, ino, c, loc, new, kept=self._extent(ino, c))
            if on_commit is not None:
                on_commit()
        if whole is not None:
            self._mark_checked(ino, c, new)  # hashed from the bytes just written there
        if self.dram_load > self.high_water:
            self.kick_demoter()

    # -- sealing, writeback, fsync -----------------------------------------------------------
    async def seal(self, ino: int, size: int) -> None:
        """Checksum every unsealed DRAM chunk of a file (on close), in a worker thread when
        there is much of it."""
        todo = []
        for c in self.index.chunks_of(ino, self._nchunks(size)):
            loc = self.get(ino, c)
            if loc is not None and loc.dram_slot >= 0 and not loc.flags & SEALED:
                todo.append((c, loc))
        if not todo:
            return
        sums = await self._hash_chunks(ino, todo)
        with self.meta.write() as txn:
            for (c, loc), csum in zip(todo, sums, strict=True):
                now = self.get(ino, c)
                if now == loc:
                    self._replace(txn, ino, c, loc, loc._replace(flags=loc.flags | SEALED,
                                                                 checksum=csum))
                    self._mark_checked(ino, c, loc)  # hashed from the region itself

    async def _hash_chunks(self, ino: int, todo: list[tuple[int, Loc]]) -> list[int]:
        """xxh3 of each chunk's bytes in its region: inline when they are few, else in worker
        threads, two at once when there is much (an open may be waiting for this; the hash
        runs without the GIL)."""
        total = sum(loc.raw_len for _, loc in todo)
        if total <= INLINE_HASH_BYTES:
            return [hash_bytes(self._dram_bytes(ino, c, loc.raw_len)) for c, loc in todo]
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

    def _extent(self, ino: int, c: int) -> int:
        """How many bytes of chunk *c* lie inside the file now (0 if its size is unknown)."""
        size = self.size_of(ino) or 0
        return min(self.cs, max(0, size - c * self.cs))

    def _nchunks(self, size: int) -> int:
        return (size + self.cs - 1) // self.cs

    def drop_dram_copy(self, key: tuple[int, int]) -> None:
        """Free the DRAM copy of a chunk that is safely on NVMe (not of a file open in
        passthrough mode: the kernel reads its DRAM file)."""
        loc = self.get(*key)
        if loc is None or loc.dram_slot < 0:
            self.policy.removed(key)
            return
        self.revoke(key[0])
        if not loc.seg or (key[0] in self.dram.pins and not loc.flags & PACKED):
            return
        with self.meta.write() as txn:
            self._replace(txn, key[0], key[1], loc, nvme_only(loc))

    # -- truncate / delete -----------------------------------------------------------------
    async def truncate(self, ino: int, old_size: int, new_size: int,
                       on_commit: Callable[[], None] | None = None) -> None:
        """The file shrinks to *new_size*: chunks past it go, the last one is cut, and the
        DRAM file is cut to match. All of it is one commit, and *on_commit* runs inside it
        (the caller's inode update: the new size rides along), so a crash leaves the file
        as it was or truncated, never at its old size with its chunks gone (read as zeros).
        Only what must come first awaits, before that commit: NVMe reads staging chunks
        that go must end (a passthrough open may read a staged region before its fetch
        ends, see kvfs.fs stage_watch), and the chunk that is cut must be in DRAM, raw."""
        cs = self.cs
        keep = self._nchunks(new_size)
        cut = new_size - (keep - 1) * cs if new_size else 0
        last = keep - 1 if 0 < cut < cs else None  # the chunk that is cut, if any
        while True:  # until nothing is left to wait for (each await lets others in)
            end = max(old_size, self.size_of(ino) or 0)  # a write may have grown it meanwhile
            pending = self._fetch_of(ino, keep if last is None else last, self._nchunks(end))
            if pending is not None:
                await pending.wait()
                continue
            loc = self.get(ino, last) if last is not None else None
            if loc is not None and loc.raw_len > cut and not loc.flags & LOST:
                if loc.flags & PACKED:
                    self.drop_dram_copy((ino, last))
                    continue
                if loc.dram_slot < 0:
                    await self._make_resident(ino, last, loc)
                    continue
            break
        with self.meta.write() as txn:
            if self.allocated.get(ino, 0) > pages(new_size):
                self._set_allocated(ino, pages(new_size))  # space past the new end is released
            for c in self.index.chunks_of(ino, self._nchunks(end)):
                if c >= keep:
                    self._replace(txn, ino, c, self.get(ino, c), None)
            if loc is not None and loc.raw_len > cut:
                # Its bytes up to *cut* stay; the DRAM file's cut below takes the rest (a
                # crash before that leaves them outside the region, punched at mount). New
                # seq, unsealed: sealed again at close, or at mount.
                new = (loc._replace(raw_len=cut) if loc.flags & LOST else
                       Loc(IN_DRAM, 0, 0, 0, cut, 0, CODEC_RAW, 0, 0, self._next_seq()))
                self._replace(txn, ino, last, loc, new, kept=cut)
            if on_commit is not None:
                on_commit()
        self.dram.truncate(ino, new_size)

    async def punch(self, ino: int, off: int, length: int, size: int,
                    on_commit: Callable[[], None] | None = None) -> None:
        """Make [off, off+length) of a file of *size* bytes a hole (fallocate PUNCH_HOLE;
        the size stays): chunks wholly inside go, the ones it cuts into are zeroed there.
        As `truncate`, the waits come first (fetches of those chunks, the cut ones brought
        into DRAM raw), then one commit, in which *on_commit* runs; the cut chunks' bytes
        are zeroed right after it (they are unsealed in it, with a new seq: a crash in
        between leaves them as they were, which the mount seals again)."""
        end = min(off + length, size)
        if ino in self.streaming:  # the kernel writes its DRAM file: that is the file
            if end > off:
                self.dram.punch(ino, off, end - off)
            with self.meta.write():
                if on_commit is not None:
                    on_commit()
            return
        cs = self.cs
        first, last = off // cs, max(off, end - 1) // cs

        def inside(c: int) -> bool:
            return off <= c * cs and min((c + 1) * cs, size) <= end

        edges = [c for c in {first, last} if end > off and not inside(c)]
        while True:  # until nothing is left to wait for (each await lets others in)
            if end > off and (pending := self._fetch_of(ino, first, last + 1)) is not None:
                await pending.wait()
                continue
            for c in edges:
                loc = self.get(ino, c)
                if loc is None or loc.flags & LOST or loc.raw_len <= off - c * cs:
                    continue  # nothing there to zero (or nothing to be had)
                if loc.flags & PACKED:
                    self.drop_dram_copy((ino, c))
                    break
                if loc.dram_slot < 0:
                    await self._make_resident(ino, c, loc)
                    break
            else:
                break
        zero = []
        with self.meta.write() as txn:
            for c in self.index.chunks_of(ino, last + 1) if end > off else ():
                if c < first:
                    continue
                loc = self.get(ino, c)
                if c not in edges:
                    self._replace(txn, ino, c, loc, None)
                    continue
                start, stop = max(off - c * cs, 0), min(end - c * cs, loc.raw_len)
                if stop <= start or loc.flags & LOST:
                    continue
                self._replace(txn, ino, c, loc, Loc(IN_DRAM, 0, 0, 0, loc.raw_len, 0,
                                                    CODEC_RAW, loc.flags & TAIL_LOST, 0,
                                                    self._next_seq()),
                              kept=self._extent(ino, c))
                zero.append((c * cs + start, stop - start))
            if on_commit is not None:
                on_commit()
        for start, n in zero:
            self.dram.punch(ino, start, n)
        if ino in self.allocated:  # the room fallocate promised there is given back
            self._set_allocated(ino, max(self.file_bytes.get(ino, 0),
                                         self.allocated[ino] - (end - off)))

    def _fetch_of(self, ino: int, start: int, stop: int) -> trio.Event | None:
        """The end of a fetch of one of *ino*'s chunks *start*..*stop*-1, if one is on."""
        for c in self.index.chunks_of(ino, stop):
            if c >= start and (done := self.fetches.pending((ino, c))) is not None:
                return done
        return None

    def delete_file(self, ino: int, size: int) -> None:
        """Forget every chunk of a file (its inode is gone)."""
        with self.meta.write() as txn:
            for c in self.index.chunks_of(ino, self._nchunks(size)):
                self._replace(txn, ino, c, self.get(ino, c), None)
        self.wb.forget(ino)
        if ino in self.allocated:
            self._set_allocated(ino, 0)
        self.file_bytes.pop(ino, None)
        self.through.end(ino)
        self.file_deleted(ino)

    # -- introspection -----------------------------------------------------------------------
    def where(self, ino: int, size: int) -> list[dict]:
        if ino in self.streaming:
            return self._where_streaming(ino, size)
        out = []
        for c in self.index.chunks_of(ino, self._nchunks(size)):
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

    def _where_streaming(self, ino: int, size: int) -> list[dict]:
        """`where` of a file the kernel is writing: its DRAM file's chunks, all in DRAM,
        dirty unless an fsync wrote them back."""
        out = []
        for c in self.dram.data_chunks(ino):
            loc = self.get(ino, c)
            clean = loc is not None and loc.seg > 0
            out.append({"chunk": c, "tiers": ["dram", "nvme"] if clean else ["dram"],
                        "packed": False, "raw_len": min(self.cs, size - c * self.cs),
                        "stored_len": loc.stored_len if clean else 0, "codec": CODEC_RAW,
                        "segment": loc.seg if clean else None, "dirty": not clean,
                        "lost": False})
        return out

    def stats(self) -> dict:
        k = self.counters
        unseen = self.unseen_bytes() if self.streaming else 0
        segs = self.nvme.segments.values()
        return {
            "tiers": {
                "dram": {"capacity_bytes": self.dram.capacity,
                         "used_bytes": self.dram_used + unseen,
                         "logical_bytes": self.dram_logical, "chunks": self.dram_chunks,
                         "dirty_bytes": self.unbacked, "packed_chunks": self.dram_packed,
                         "promised_bytes": self.stream_promised,
                         "files": len(self.dram.claims), "passthrough_files": len(self.dram.pins)},
                "nvme": {"capacity_bytes": self.nvme.capacity, "used_bytes": self.nvme_live,
                         "logical_bytes": self.nvme_logical, "chunks": self.nvme_chunks,
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
                      "read_ahead_chunks": k.read_ahead,
                      "read_ahead_used_chunks": k.read_ahead_used,
                      # ... READs answered from them by the front thread (kvfs._fuseshim)
                      "read_ahead_front_reads": k.front_reads,
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
                            "write_opens": k.stream_opens, "adopted_files": k.stream_adoptions,
                            "written_chunks": k.streamed_chunks,
                            "writing_files": len(self.streaming)},
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


def _slice(view: memoryview, start: int, length: int) -> bytes | memoryview:
    """Bytes [start, start+length) of a chunk whose stored part is *view* (the rest is zeros)."""
    have = len(view)
    if start + length <= have:
        return view[start:start + length]
    if start >= have:
        return bytes(length)
    return bytes(view[start:]) + bytes(start + length - have)
