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
  staging a chunk: it claims the region first, and until it is done (`_fetching`) writes and
  truncations of that chunk wait (before they change anything: the staged bytes may be read
  by a passthrough open before the fetch ends, see `stage_watch`).
- A region or a record is released only after the location that replaces it is committed
  (MetaStore.after_commit): invariant 4.
- A sealed chunk (checksum valid) that is about to change is unsealed in lmdb *before* its
  bytes change, so a crash never leaves new bytes under an old checksum.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple, Protocol, TypeVar

import trio
import xxhash

from kvfs import _digest
from kvfs._index import ChunkIndex
from kvfs.faults import CrashPoints
from kvfs.nursery import open_nursery
from kvfs.store.choices import ChoiceMemory
from kvfs.store.codec import CODEC_RAW, Codec, CodecError
from kvfs.store.dram import OPEN_FILES, DramFile, DramFiles, pages
from kvfs.store.episode import Episode
from kvfs.store.meta import (
    COUNTER_MAX,
    FORMAT_VERSION,
    MetaStore,
    from_key2,
    from_u64,
    key2,
    u64,
)
from kvfs.store.nvme import (
    BLOCK,
    HEADER_SIZE,
    NvmeFull,
    NvmeLog,
    RecordError,
    RecordHeader,
    record_length,
)
from kvfs.store.osutil import mapped_shared_writable

log = logging.getLogger(__name__)
# Tests only: KVFS_TEST_FETCH_DELAY=SECONDS:PATH makes every NVMe read staging a chunk take
# SECONDS longer (in its worker thread) while PATH exists, so that tests can act while
# fetches are in flight. Unset in normal use.
_TEST_FETCH_DELAY = os.environ.get("KVFS_TEST_FETCH_DELAY", "").partition(":")[::2]


def _test_fetch_delay() -> None:
    if _TEST_FETCH_DELAY[1] and os.path.exists(_TEST_FETCH_DELAY[1]):
        time.sleep(float(_TEST_FETCH_DELAY[0]))

SEALED = 1  # checksum covers the current bytes
LOST = 2  # the only copy was in DRAM and DRAM was lost (reboot): reads fail with EIO
PACKED = 4  # the DRAM region holds the NVMe record's payload, not the raw bytes (format 2)
# Bytes past raw_len were written, then lost with DRAM (the chunk went back to its shadow):
# reads there fail with EIO instead of reading zeros (format 3).
TAIL_LOST = 8
IN_DRAM = 0  # dram_slot of a chunk with a DRAM copy (format 3: the region is implied)
STREAM_USER = 0
STREAM_GC = 1
_LOC = struct.Struct("<qIQIIIBBQQ")
_U32 = struct.Struct("<I")
# Hashing this much inline (~30 us) is cheaper than a round trip to a worker thread.
INLINE_HASH_BYTES = 512 << 10
# ... and from this much on, two worker threads hash a file's halves at once.
PARALLEL_HASH_BYTES = 2 << 20
# NVMe reads keep a clean DRAM copy while DRAM holds less than this share (no eviction for
# a promotion: the demoter keeps room for writes below the high watermark).
PROMOTE_SHARE = 0.9
# A file opened for reading with chunks on NVMe only is staged whole in DRAM before the open
# returns, so that the kernel reads it from there (passthrough), if it is at most this long:
# the open then waits for all of it, which a reader of a KV block wants anyway.
STAGE_FILE_MAX = 64 << 20
# A reader of a file at least `read_through_min` long (an option) is not staged: its NVMe
# chunks are read through the daemon, ahead of it into the daemon's memory (not the DRAM
# tier), and promoted only when read again. Staging such a file costs fresh tmpfs pages and
# a second copy for every byte, and the reader waits for all of it before its first byte;
# reading through overlaps the disk with the copies to the reader.
READ_AHEAD_BYTES = 8 << 20  # per sequential reader, in flight or ready (at least 2 chunks)
# The read-ahead memory (RAM beyond the DRAM tier) is READ_AHEAD_READERS x READ_AHEAD_BYTES,
# but at most half the DRAM tier's size (at least 2 chunks).
READ_AHEAD_READERS = 4
# A chunk read ahead on a prediction and not read within this long may make room for others.
AHEAD_STALE_S = 2.0
# Chunks of read-through files read once are remembered, up to this many DRAM tiers' worth:
# a chunk read again meanwhile is reused, and is promoted into DRAM.
READ_THROUGH_SEEN_SHARE = 2
# Files open in passthrough mode cannot lose their DRAM copies; they may hold at most this
# share of the tier, so that writes always find room to demote into.
PASSTHROUGH_SHARE = 0.5
# Files the kernel writes straight into their DRAM file (passthrough writers, `start_stream`):
# what they write is only counted when they are taken, so at most this many at once, each
# expected to take at most this share of the DRAM tier's free room (and of the store's); the
# room promised to them (their expected sizes) counts as used until then.
STREAMS_MAX = 16
STREAM_ROOM_SHARE = 0.25
# A writeback batch (see ChunkStore.writeback_many) holds WRITEBACK_BATCH full chunks' worth
# of DRAM bytes: 4 x 256 KiB..1 MiB keep a worker busy ~1-2 ms, about the lead a write
# waiting for room can afford. Small chunks (small files) fill a batch up to
# WRITEBACK_BATCH_MAX: per chunk, a batch's two worker hand-offs and its commit cost the trio
# thread more than the chunk's own bookkeeping, and its records go to disk in one write.
WRITEBACK_BATCH = 4
WRITEBACK_BATCH_MAX = 32
# A write waiting for room in DRAM (the demoter writing chunks back to make it) gives up
# with ENOSPC after this long in all.
DRAM_WAIT_S = 60.0
# While writing back fails for want of room, the demoter tries again this often (not at
# every kick: each try costs a compression and a failed write), and a write needing DRAM
# room meanwhile gets ENOSPC at once; after that long it waits for the next try.
FULL_RETRY_S = 1.0


class Loc(NamedTuple):
    dram_slot: int
    seg: int
    off: int
    rec_len: int
    raw_len: int
    stored_len: int
    codec: int
    flags: int
    checksum: int
    seq: int


# The shadow of a chunk written into a hole from past its start (`ChunkStore._shadow`): no
# record, nothing but zeros up to where the write began.
HOLE = Loc(-1, 0, 0, 0, 0, 0, CODEC_RAW, 0, 0, 0)


@dataclass
class WritePlan:
    """A write whose bytes are copied straight into DRAM regions (plan_write)."""

    ino: int
    # (chunk, start, stop, location before the write); in place if it had a DRAM copy
    pieces: list[tuple[int, int, int, Loc | None]]


def parse_loc(value: bytes, chunk_size: int) -> Loc:
    """A chunk location as stored in lmdb; ValueError (or struct.error) if it cannot be one
    (damaged metadata), so that no read trusts a length or an offset it never wrote."""
    loc = Loc._make(_LOC.unpack(value))
    if loc.dram_slot < -1 or loc.raw_len > chunk_size or loc.flags >= TAIL_LOST << 1:
        raise ValueError(f"impossible chunk location {loc}")
    if loc.seq >= COUNTER_MAX or loc.flags & PACKED and not loc.seg:
        raise ValueError(f"impossible chunk location {loc}")
    if loc.seg and (loc.off < BLOCK or loc.off % BLOCK
                    or loc.rec_len != record_length(loc.stored_len)):
        raise ValueError(f"impossible record location {loc}")
    return loc


def slot_len(loc: Loc) -> int:
    """Bytes a chunk's DRAM region holds: its record's payload when packed, else its bytes."""
    return loc.stored_len if loc.flags & PACKED else loc.raw_len


def nvme_only(loc: Loc) -> Loc:
    """*loc* without its DRAM copy."""
    return loc._replace(dram_slot=-1, flags=loc.flags & ~PACKED)


class NoSpace(Exception):
    """Storing more bytes would exceed the capacity of the filesystem."""


class ChunkError(Exception):
    """A chunk cannot be read correctly; the message names the file and chunk."""

    errno = errno.EIO


# xxh3-64 of a chunk's raw bytes: kvfs._digest's releases the GIL (workers hash in parallel
# and the trio thread runs meanwhile); python-xxhash's, the same function, where it cannot run.
xxhash_hash = xxhash.xxh3_64_intdigest
_hash = _digest.xxh3 if _digest.fast() else xxhash_hash


class StageWatch(Protocol):
    """Told how a prefetch's staging of a chunk goes (see `ChunkStore.stage_watch`)."""

    def ready(self) -> None:
        """Worker thread: the chunk's bytes are in its DRAM file, whole and checked, and
        will become its DRAM copy unless `done(False)` comes."""

    def done(self, installed: bool) -> None:
        """The fetch is over: the staged bytes are the chunk's DRAM copy now, or not
        (*installed* False: the region is released right after this returns)."""


class AheadServer(Protocol):
    """Answers READs from chunks read ahead, without the trio thread (the shim's front
    thread, kvfs._fuseshim): `ChunkStore.front_read` is told of each READ it answered."""

    def ahead_offer(self, ino: int, chunk: int, data: bytes) -> bool:
        """Answer READs within *data* (kept alive and unchanged by the caller) until
        withdrawn or read to its end. False: not taken."""

    def ahead_withdraw(self, ino: int, chunk: int) -> None:
        """No more READs are answered from the chunk once this returns."""


class _Mismatch(Exception):
    """A record's decoded bytes do not match its chunk's checksum (inside _read_record)."""


T = TypeVar("T")


@dataclass
class Counters:
    chunks_from_dram: int = 0
    chunks_from_nvme: int = 0
    chunks_from_holes: int = 0
    promotions: int = 0
    demotions: int = 0
    writebacks: int = 0
    checksum_errors: int = 0
    dram_checks: int = 0  # DRAM copies hashed on the read path before being trusted
    user_bytes_written: int = 0  # record bytes written to NVMe for user data
    gc_bytes_written: int = 0
    read_latency_us: list[int] = field(default_factory=lambda: [0] * 24)  # log2 buckets
    read_latency_dram_us: list[int] = field(default_factory=lambda: [0] * 24)  # DRAM hits
    read_latency_nvme_us: list[int] = field(default_factory=lambda: [0] * 24)  # NVMe reads
    prefetch_issued: int = 0
    prefetch_used: int = 0  # a prefetched chunk was read while in DRAM
    prefetch_late: int = 0  # a demand read found its chunk's prefetch still in flight
    prefetch_wasted: int = 0  # a prefetched chunk left DRAM unread
    direct_writes: int = 0  # writes copied by the shim straight into DRAM (plan_write)
    passthrough_opens: int = 0  # opens the kernel serves from the DRAM file itself
    passthrough_chunks: int = 0  # ... their chunks (in chunks_from_dram, or from_nvme if:)
    staged_chunks: int = 0  # ... brought in from NVMe for such an open (stage_file)
    stream_opens: int = 0  # new files the kernel wrote straight into their DRAM file
    stream_adoptions: int = 0  # files in passthrough mode it went on to write (adopt_stream)
    streamed_chunks: int = 0  # ... chunks taken from them (at close or fsync)
    unpacked: int = 0  # DRAM hits that decoded a packed copy
    read_ahead: int = 0  # NVMe chunks read ahead of a read-through reader (into memory)
    read_ahead_used: int = 0  # ... and then read by it (in chunks_from_nvme)
    front_reads: int = 0  # READs the front thread answered from chunks read ahead


@dataclass(eq=False)
class _Ahead:
    """A chunk read ahead of a sequential reader into the daemon's memory (read-through)."""
    loc: Loc  # the location it was read from: used only while the chunk is still there
    done: trio.Event = field(default_factory=trio.Event)
    since: float = field(default_factory=time.monotonic)
    data: bytes | memoryview | None = None  # verified bytes, None until done or if it failed
    served: bool = False  # offered to the AheadServer (withdrawn before anything changes)
    # The read buffer a raw record was read into (data is a view of it). It goes back to
    # the store's pool when the chunk is dropped: nobody may use data after that.
    buf: mmap.mmap | None = None


@dataclass(eq=False)
class _Job:
    """One chunk of a writeback batch: what the trio thread read, then what the worker made."""
    i: int  # its place in the caller's list
    ino: int
    c: int
    loc: Loc
    held: DramFile  # the chunk's DRAM file, open until the worker is done
    stream: int
    codec_id: int | None  # the file's codec (None: not chosen yet)
    chooses: bool = False  # this job makes the file's choice (from hint or expected)
    hint: str | None = None
    directory: object = None
    expected: int | None = None
    csum: int = 0
    used: int = 0  # the codec this chunk was stored with (raw when it did not compress)
    payload: bytes | memoryview = b""
    full: bool = False
    rec_len: int = 0
    seg: object = None
    off: int = 0
    mismatch: bool = False  # sealed, and the bytes read did not match the checksum


class ChunkStore:
    """Mechanism for moving chunk bytes between tiers; policy objects decide what to move."""

    def __init__(self, meta: MetaStore, fs_uuid: str, *, chunk_size: int, dram_dir: str,
                 dram_size: int, nvme_dir: str, nvme_size: int, segment_size: int,
                 codec: Codec, io_threads: int, policy, dram_compress: bool = False,
                 dram_verify: str = "once", read_through_min: int = 0,
                 dram_open_files: int = OPEN_FILES, crash: CrashPoints | None = None) -> None:
        self.meta = meta
        self.crash = crash or CrashPoints()
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
        # Writing back to NVMe fails: the tier (its filesystem) is full, or its I/O fails.
        self.nvme_full = Episode(f"NVMe tier {nvme_dir} full")
        self.nvme_failing = Episode(f"NVMe tier {nvme_dir}: writing back fails")
        self.dram_pinned_full = Episode("DRAM tier full of files open in passthrough mode")
        self._fetching: dict[tuple[int, int], trio.Event] = {}
        self._file_codec: dict[int, int] = {}
        # Files whose codec a writeback is choosing now: their other chunks wait for the
        # choice instead of each making it again (the demoter writes several at once).
        self._choosing: dict[int, trio.Event] = {}
        self.choices = ChoiceMemory()  # the codecs directories' files have been getting
        # A file's dtype hint and its directory (the namespace's; set by the assembly).
        self.codec_context: Callable[[int], tuple[str | None, int | None]] = (
            lambda ino: (None, None))
        self.kick_demoter: Callable[[], None] = lambda: None
        self.cleaner = None  # set by the assembly (store.gc.Cleaner)
        # Placement: which stream a file's records go to (issue 5 classifies; default one).
        self.stream_of: Callable[[int], int] = lambda ino: STREAM_USER
        self.file_deleted: Callable[[int], None] = lambda ino: None  # lifetime learning
        # Prefetch bookkeeping: chunks staged ahead of a read and not read yet, and in flight.
        self.prefetched: set[tuple[int, int]] = set()
        self._prefetching: set[tuple[int, int]] = set()
        # ... and the ones in flight that a passthrough open counted as read already: their
        # bytes were staged, and the open answered from them, before the fetch was over.
        self._used_in_flight: set[tuple[int, int]] = set()
        # Prefetch never takes the worker threads demand reads need.
        self.prefetch_limiter = trio.CapacityLimiter(max(1, io_threads // 2))
        self.high_water = int(0.9 * dram_size)  # set by tiering; start demoting above it
        # Reads of DRAM copies land here: a read's reply is sent before any other task runs
        # (see `read`), so one buffer serves them all.
        self._scratch = bytearray(chunk_size)
        self._buffers = threading.local()  # worker threads' own (`_thread_buffer`)
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
        self.shadow_from: dict[tuple[int, int], int] = {}  # ... rewritten from this byte on
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
        # Read-through (READ_AHEAD_BYTES): files at least this long (0: none) are read
        # from NVMe through the daemon with read-ahead instead of being staged in DRAM.
        self.read_through_min = read_through_min
        self.size_of: Callable[[int], int | None] = lambda ino: None  # set by the assembly
        self.spawn: Callable | None = None  # starts a read-ahead task (the daemon's nursery)
        self._ahead: dict[tuple[int, int], _Ahead] = {}  # oldest first
        self._ahead_bytes = 0
        self._ahead_max = max(2 * chunk_size,
                              min(READ_AHEAD_READERS * READ_AHEAD_BYTES, dram_size // 2))
        self._ahead_window = max(2, min(READ_AHEAD_BYTES, self._ahead_max) // chunk_size)
        self._next_read: dict[int, int] = {}  # read-through file -> chunk its reader reads next
        self._ahead_buffers: list[mmap.mmap] = []  # read buffers of dropped chunks, for reuse
        # Answers READs from chunks read ahead without the trio thread (set by the daemon).
        self.ahead_server: AheadServer | None = None
        # Chunks of read-through files read once lately (oldest first): a second read
        # promotes them (`_read_through_done`).
        self._seen_through: dict[tuple[int, int], bool] = {}
        self._seen_max = max(1024, READ_THROUGH_SEEN_SHARE * dram_size // chunk_size)
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
                    csum = _hash(self._dram_bytes(ino, c, loc.raw_len))
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
        """A `shadows` entry: its key, location and (format 4) the first byte written since
        (before format 4, 0: the whole chunk is suspect)."""
        written_from = _U32.unpack(v[_LOC.size:])[0] if len(v) != _LOC.size else 0
        return from_key2(k), parse_loc(v[:_LOC.size], self.cs), written_from

    def _load_shadows(self, fixes, owned: dict[int, list[tuple[int, int]]]
                      ) -> list[tuple[int, int]]:
        """At mount: keep the shadows of chunks still dirty in DRAM; a chunk whose only copy
        was lost with DRAM goes back to its shadow (the bytes last written back, which an
        fsync may have promised). Returns the keys of shadows that are no more."""
        stale = []
        for key, shadow, written_from in self.meta.load("shadows", self._parse_shadow):
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
                self.shadow_from[key] = written_from
                self.nvme_live += shadow.rec_len
                continue
            log.warning("inode %d chunk %d: back to the bytes last written back (the newer "
                        "ones were only in DRAM, which is gone)", *key)
            if now.raw_len > shadow.raw_len and written_from > shadow.raw_len:
                # what lay between its end and the first byte written since was zeros, and
                # as durable as the rest: those stay, what was written is lost (EIO)
                back = self._shadow_start(*key, shadow, written_from, tail_lost=True)
            elif now.raw_len > shadow.raw_len and shadow.seg:  # written past it: EIO there
                back = shadow._replace(flags=shadow.flags | TAIL_LOST)
            elif now.raw_len > shadow.raw_len:  # a hole written from its start: all lost
                back = now._replace(dram_slot=-1, seg=0, flags=LOST)
            elif now.raw_len < shadow.raw_len:  # truncated since: only its start is the file's
                back = self._shadow_start(*key, shadow, now.raw_len)
            else:
                back = shadow
            if back.dram_slot >= 0:
                # Rebuilt in DRAM from the shadow (`_shadow_start`): the shadow stays until
                # those bytes are written back, so that DRAM lost again before that takes
                # the chunk back to it again (without it the chunk, fsync'ed bytes and all,
                # would be lost).
                self.shadows[key] = shadow
                self.shadow_from[key] = written_from
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
                    data = self._read_record(ino, c, shadow, seg, None)
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
            if len(data) != loc.raw_len or _hash(data) != loc.checksum:
                raise CodecError("checksum mismatch")
            self.dram.write(ino, c, 0, data)
        except (CodecError, OSError) as exc:
            log.error("inode %d chunk %d: packed DRAM copy unusable (%s)", ino, c, exc)
            return loc
        log.warning("inode %d chunk %d: kept from its packed DRAM copy", ino, c)
        return loc._replace(flags=loc.flags & TAIL_LOST | SEALED)

    def close(self) -> None:
        for key, ahead in list(self._ahead.items()):
            self._drop_ahead(key, ahead)  # (withdrawn: no READ copies from them after this)
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
        ahead = self._ahead.get((ino, c)) if self._ahead else None
        if ahead is not None and ahead.served:
            self._withdraw(ino, c, ahead)  # before any change: its bytes may be old now
        if loc is None:
            txn.delete(key2(ino, c), db=self.meta.db["chunks"])
            self.index.pop(ino, c)
        else:
            txn.put(key2(ino, c), _LOC.pack(*loc), db=self.meta.db["chunks"])
            self.index.set(ino, c, tuple(loc))

    def _replace(self, txn, ino: int, c: int, old: Loc | None, new: Loc | None,
                 written_from: int | None = None) -> None:
        """Swap a chunk's location; copies the new one no longer names are released after
        the commit. *written_from*: the first byte of the chunk the change rewrote (a
        write's start, a truncation's cut), for the shadow it may leave (`_shadow`); None
        for a change of no byte (sealing, unsealing, a write-back, a drop), which leaves
        a shadow's as it is."""
        self._account(ino, old, new)
        self._store_loc(txn, ino, c, new)
        key = (ino, c)
        if old is not None and old.dram_slot >= 0 and (new is None or
                                                       new.dram_slot != old.dram_slot):
            self.policy.removed(key)
            self.dirty_since.pop(key, None)
            if key in self.prefetched:
                self.prefetched.discard(key)
                self.counters.prefetch_wasted += 1
            length = slot_len(old)
            self.meta.after_commit(lambda: self.dram.release(ino, c, length))
        if old is not None and old.seg and (new is None or (new.seg, new.off) !=
                                            (old.seg, old.off)):
            if new is not None and not new.seg and key not in self.shadows:
                # written over: kept until written back
                self._shadow(txn, key, nvme_only(old), written_from or 0)
            else:
                seg, rec_len = old.seg, old.rec_len
                self.meta.after_commit(lambda: self.nvme.mark_dead(seg, rec_len))
        elif (old is None and new is not None and not new.seg and written_from
              and key not in self.shadows):
            self._shadow(txn, key, HOLE, written_from)  # written into a hole, not from its start
        if key in self.shadows and (new is None or new.seg):
            self._unshadow(txn, key)  # the new bytes are on NVMe (or the chunk is gone)
        elif (key in self.shadows and written_from is not None
              and written_from < self.shadow_from.get(key, 0)):
            self._shadow(txn, key, self.shadows[key], written_from)
        if new is not None and new.dram_slot >= 0:
            if old is None or old.dram_slot != new.dram_slot:
                self.policy.inserted(key)
            if not new.seg:
                self.dirty_since.setdefault(key, time.monotonic())
            else:
                self.dirty_since.pop(key, None)

    def _shadow(self, txn, key: tuple[int, int], loc: Loc, written_from: int) -> None:
        """A chunk's NVMe record (*loc*), or the hole it was (HOLE), is written over in DRAM
        from byte *written_from* on (or lower, for a shadow kept already): keep it, in
        lmdb's `shadows`, until the new bytes are written back. An fsync may have made it
        durable, and a DRAM tier lost before that writeback must take the chunk back to it,
        not lose it (`_load`): and what lay between its end and *written_from* (zeros) was
        durable too."""
        if key not in self.shadows:
            self.nvme_live += loc.rec_len
        self.shadows[key] = loc
        self.shadow_from[key] = written_from
        txn.put(key2(*key), _LOC.pack(*loc) + _U32.pack(written_from),
                db=self.meta.db["shadows"])

    def _unshadow(self, txn, key: tuple[int, int]) -> None:
        self.shadow_from.pop(key, None)
        loc = self.shadows.pop(key)
        txn.delete(key2(*key), db=self.meta.db["shadows"])
        self.nvme_live -= loc.rec_len
        self.meta.after_commit(lambda: self.nvme.mark_dead(loc.seg, loc.rec_len))

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

    def batch_full(self, chunks: int, nbytes: int) -> bool:
        """Is a writeback batch of *chunks* chunks holding *nbytes* of DRAM full?"""
        return chunks >= WRITEBACK_BATCH_MAX or nbytes >= WRITEBACK_BATCH * self.cs

    def writeback_batches(self, keys: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
        """*keys* cut into writeback batches, in order."""
        batch: list[tuple[int, int]] = []
        nbytes = 0
        for key in keys:
            batch.append(key)
            nbytes += self.dram_pages(key)
            if self.batch_full(len(batch), nbytes):
                yield batch
                batch, nbytes = [], 0
        if batch:
            yield batch

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
        through = self.reads_through(ino, file_size)
        if through:
            self._sequential_read(ino, first, last, self._nchunks(file_size))
            self._next_read[ino] = end // cs
        if first == last:
            return await self._read_piece(ino, first, off - first * cs, end - off, verified,
                                          through)
        parts = []
        for c in range(first, last + 1):
            start = max(off, c * cs) - c * cs
            stop = min(end, (c + 1) * cs) - c * cs
            part = await self._read_piece(ino, c, start, stop - start, verified, through)
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
                self.counters.chunks_from_holes += 1
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
                data = await self._unpack(ino, c, loc)
                if data is None:
                    continue  # the chunk changed while we decoded it: start over
                self.policy.hit((ino, c))
                if self.prefetched:
                    self._prefetch_used((ino, c))
                self.counters.chunks_from_dram += 1
                self._record_latency(t0, self.counters.read_latency_dram_us)
                return _slice(memoryview(data), start, length)
            if loc.dram_slot >= 0:
                check = ((verified is None or (c, loc.seq) not in verified)
                         and self._check_needed(ino, c, loc))
                if check:
                    self.counters.dram_checks += 1
                    view = self._dram_bytes(ino, c, loc.raw_len)
                    if _hash(view) != loc.checksum:
                        self.counters.checksum_errors += 1
                        raise ChunkError(f"inode {ino} chunk {c}: checksum mismatch in DRAM")
                    self._mark_checked(ino, c, loc)
                    view = view[start:]
                else:  # only the bytes asked for
                    view = self._dram_bytes_at(ino, c, start, min(length, loc.raw_len - start))
                if check and verified is not None:
                    verified.add((c, loc.seq))
                self.policy.hit((ino, c))
                if self.prefetched:
                    self._prefetch_used((ino, c))
                self.counters.chunks_from_dram += 1
                self._record_latency(t0, self.counters.read_latency_dram_us)
                return _slice(view, 0, length)
            if (ino, c) in self._prefetching:
                self.counters.prefetch_late += 1
            ahead = self._ahead.get((ino, c)) if through else None
            if ahead is not None and ahead.loc != loc:
                self._drop_ahead((ino, c), ahead)  # read before the chunk changed
                ahead = None
            data = None
            if ahead is not None:
                await ahead.done.wait()
                # (Dropped meanwhile, by another reader say: its buffer may be reused.)
                data = ahead.data if self._ahead.get((ino, c)) is ahead else None
                if data is not None and self.get(ino, c) != loc:
                    continue  # the chunk changed meanwhile: start over
                if start + length >= loc.raw_len or data is None:
                    self._drop_ahead((ino, c), ahead)  # the reader is done with it, or failed
                if data is not None:
                    self.counters.read_ahead_used += start + length >= loc.raw_len
                # else the read-ahead failed (or is gone): the ordinary fetch below reads it
                # (and says why it failed: EIO).
            if data is None:
                data = await self.fetch(
                    ino, c, loc, stage=None if through else self.dram.capacity * PROMOTE_SHARE)
                if data is None:
                    continue  # the chunk changed while we read it: start over
                if verified is not None:
                    verified.add((c, loc.seq))  # fetch verified it
            self.counters.chunks_from_nvme += 1
            self._record_latency(t0, self.counters.read_latency_nvme_us)
            if through and start + length >= loc.raw_len:
                self._read_through_done(ino, c, loc, data)
            return _slice(memoryview(data), start, length)

    # -- read-through: NVMe chunks read ahead of a sequential reader, into memory ----------
    def reads_through(self, ino: int, size: int | None = None) -> bool:
        """Is this file read from NVMe through the daemon (read-ahead, no staging, no
        promotion, no prefetch into DRAM)? Files of at least `read_through_min` bytes are."""
        if not self.read_through_min:
            return False
        if size is None:
            size = self.size_of(ino)
        return size is not None and size >= self.read_through_min

    def start_read_through(self, ino: int, size: int) -> None:
        """A reader opened a read-through file: start reading its first chunks."""
        self._sequential_read(ino, 0, 0, self._nchunks(size))

    def _sequential_read(self, ino: int, c: int, last: int, nchunks: int) -> None:
        """A read of chunks c..last of a read-through file: if it goes on where the last
        read ended (or at the start), have them and READ_AHEAD_BYTES after them in flight or
        ready, each chunk read by its own worker. A read elsewhere is a seek: its chunks are
        read on demand, and nothing ahead of them."""
        if self.spawn is None or (c and self._next_read.get(ino) != c
                                  and (ino, c) not in self._ahead):
            return
        for n in range(c, min(last + 1 + self._ahead_window, nchunks)):
            loc = self._ahead_candidate(ino, n)
            if loc is None:
                continue
            if self._ahead_bytes + loc.raw_len > self._ahead_max and not self._evict_ahead(ino):
                return
            self._start_ahead((ino, n), loc)

    def read_ahead_predicted(self, ino: int, c: int) -> None:
        """Readahead predicts a read of chunk *c* of read-through file *ino* (the next file
        of a write-order chain, say): read it ahead into memory, within half the read-ahead
        memory (the rest is for the readers' own windows)."""
        loc = self._ahead_candidate(ino, c) if self.spawn is not None else None
        if loc is None:
            return
        if self._ahead_bytes + loc.raw_len > self._ahead_max // 2 and not self._evict_ahead(
                ino, older_than=time.monotonic() - AHEAD_STALE_S):
            return
        self._start_ahead((ino, c), loc)

    def _ahead_candidate(self, ino: int, c: int) -> Loc | None:
        """The location of an NVMe-only chunk to read ahead, or None."""
        key = (ino, c)
        if key in self._ahead or key in self._fetching:
            return None
        loc = self.get(ino, c)
        if loc is None or loc.dram_slot >= 0 or loc.flags & LOST:
            return None
        return loc

    def _start_ahead(self, key: tuple[int, int], loc: Loc) -> None:
        ahead = self._ahead[key] = _Ahead(loc)
        self._ahead_bytes += loc.raw_len
        self.counters.read_ahead += 1
        self.spawn(self._background, "read-ahead", partial(self._read_ahead, key, ahead))

    def _evict_ahead(self, ino: int, older_than: float | None = None) -> bool:
        """Make room for one more read-ahead chunk of *ino* by dropping the oldest ready
        chunk of another file (its reader went elsewhere, or is slower; a predicted read
        only takes one that waited longer than AHEAD_STALE_S). False if none."""
        for key, ahead in self._ahead.items():
            if older_than is not None and ahead.since > older_than:
                return False  # (oldest first: the rest are younger still)
            if key[0] != ino and ahead.done.is_set():
                self._drop_ahead(key, ahead)
                return True
        return False

    async def _read_ahead(self, key: tuple[int, int], ahead: _Ahead) -> None:
        if ahead.loc.codec == CODEC_RAW:  # read and kept in a buffer of its own: no copy
            ahead.buf = (self._ahead_buffers.pop() if self._ahead_buffers
                         else mmap.mmap(-1, self.cs + BLOCK))
        try:
            ahead.data = await self.fetch(key[0], key[1], ahead.loc, stage=None, into=ahead.buf)
        except ChunkError:
            ahead.data = None  # the reader's own fetch will report it
        finally:
            ahead.done.set()
            if ahead.data is None:
                self._drop_ahead(key, ahead)
        now = self.get(*key)
        if (self.ahead_server is not None and self._ahead.get(key) is ahead
                and now is not None and now.seq == ahead.loc.seq):
            ahead.served = self.ahead_server.ahead_offer(key[0], key[1], ahead.data)

    def front_read(self, ino: int, off: int, size: int, file_size: int, us: int) -> None:
        """The AheadServer answered a READ of *size* bytes at *off* of read-through file
        *ino* from chunks read ahead, in *us* microseconds: what `read` would have done
        besides the copy (more read-ahead, counters, the chunks read to their end)."""
        cs = self.cs
        first, last = off // cs, (off + size - 1) // cs
        self._sequential_read(ino, first, last, self._nchunks(file_size))
        self._next_read[ino] = (off + size) // cs
        self.counters.front_reads += 1
        for c in range(first, last + 1):
            self.counters.chunks_from_nvme += 1
            self._record_us(us, self.counters.read_latency_nvme_us)
            ahead = self._ahead.get((ino, c))
            if ahead is None or ahead.data is None:
                continue
            if min(off + size, (c + 1) * cs) - c * cs >= ahead.loc.raw_len:
                ahead.served = False  # the front thread dropped it: read to its end
                self.counters.read_ahead_used += 1
                self._read_through_done(ino, c, ahead.loc, ahead.data)
                self._drop_ahead((ino, c), ahead)

    def _withdraw(self, ino: int, c: int, ahead: _Ahead) -> None:
        ahead.served = False
        self.ahead_server.ahead_withdraw(ino, c)

    def _read_through_done(self, ino: int, c: int, loc: Loc, data) -> None:
        """A reader has read a whole chunk of a read-through file. The second time that
        happens while the chunk is remembered (the last READ_THROUGH_SEEN_SHARE x DRAM's
        worth of such chunks), the chunk is reused: its bytes are copied into DRAM in the
        background, if there is room without evicting anything (a promotion)."""
        key = (ino, c)
        if not self._seen_through.pop(key, False):
            self._seen_through[key] = True
            if len(self._seen_through) > self._seen_max:
                del self._seen_through[next(iter(self._seen_through))]
            return
        if (self.spawn is not None and key not in self._fetching
                and self.promotion_room(pages(loc.raw_len))):
            self.spawn(self._background, "promotion of a reused chunk", partial(
                self.fetch, ino, c, loc, stage=self.dram.capacity * PROMOTE_SHARE, raw=True,
                want=False, have=bytes(data) if isinstance(data, memoryview) else data,
                limiter=self.prefetch_limiter))

    @staticmethod
    async def _background(what: str, job: Callable) -> None:
        """Run a task of the daemon's nursery that nobody waits for: a failure is logged,
        never let out (it would end the daemon)."""
        try:
            await job()
        except Exception:
            log.exception("%s failed", what)

    def _drop_ahead(self, key: tuple[int, int], ahead: _Ahead) -> None:
        """Forget a chunk read ahead. Its bytes are gone after the caller's next await (its
        buffer is reused): a reader still waiting for it must read the chunk itself."""
        if ahead.served:
            self._withdraw(*key, ahead)
        if self._ahead.get(key) is ahead:
            del self._ahead[key]
            self._ahead_bytes -= ahead.loc.raw_len
            if ahead.buf is not None and ahead.done.is_set():  # (else the read still uses it)
                if len(self._ahead_buffers) < self._ahead_max // self.cs + 2:
                    self._ahead_buffers.append(ahead.buf)
                ahead.buf = None

    def end_read_through(self, ino: int) -> None:
        """The file's last handle is closed: what was read ahead for it goes."""
        self._next_read.pop(ino, None)
        for key in [k for k in self._ahead if k[0] == ino]:
            self._drop_ahead(key, self._ahead[key])

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

    async def _unpack(self, ino: int, c: int, loc: Loc) -> bytes | None:
        """Decode (and verify) a packed DRAM copy in a worker; None if the chunk changed
        meanwhile. A region released and claimed again while the worker read it may have
        given it other bytes: a failed check then means "changed", not "damaged"."""
        claim = self.dram.claim_ids.get((ino, c))
        held = self.dram.hold(ino)
        try:
            data = await trio.to_thread.run_sync(self._decode_packed, held, c, loc,
                                                 limiter=self.limiter)
        finally:
            self.dram.drop(held)
        now = self.get(ino, c)
        if now != loc or self.dram.claim_ids.get((ino, c)) != claim:
            return None
        if isinstance(data, str):
            self.counters.checksum_errors += 1
            raise ChunkError(f"inode {ino} chunk {c}: packed DRAM copy: {data}")
        self.counters.unpacked += 1
        return data

    def _decode_packed(self, held: DramFile, c: int, loc: Loc) -> bytes | str:
        """Worker thread: the raw bytes of a packed DRAM copy, checked against its checksum,
        or what is wrong with it."""
        payload = bytearray(loc.stored_len)
        self.dram.read_region(held.fd, c * self.cs, payload)
        try:
            data = self.codec.decode(loc.codec, payload, loc.raw_len)
        except CodecError as exc:
            return str(exc)
        if len(data) != loc.raw_len or _hash(data) != loc.checksum:
            return "checksum mismatch in DRAM (packed)"
        return data

    def _record_latency(self, t0: float, tier: list[int]) -> None:
        self._record_us(int((time.perf_counter() - t0) * 1e6), tier)

    def _record_us(self, us: int, tier: list[int]) -> None:
        """A read of *us* microseconds in the histograms (log2 buckets): all, and *tier*'s."""
        bucket = min(23, us.bit_length())
        self.counters.read_latency_us[bucket] += 1
        tier[bucket] += 1

    def _prefetch_used(self, key: tuple[int, int]) -> None:
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.counters.prefetch_used += 1
        elif key in self._prefetching:
            self._used_in_flight.add(key)  # counted when the prefetch is over

    async def prefetch(self, ino: int, c: int,
                       make_room: Callable[[int], bool] | None = None) -> bool | None:
        """Stage an NVMe-only chunk in DRAM ahead of its read. Returns None if nothing was
        read (no such chunk, already in DRAM or in flight, or no room), True if the chunk
        was read and staged, False if it was read but could not be staged.

        Promotion takes DRAM only below the prefetch limit; *make_room(nbytes)* may free
        some (synchronously, by dropping clean copies it chooses) when there is none. The
        region is claimed before the read, so what prefetches hold counts against DRAM
        while they run."""
        key = (ino, c)
        loc = self.get(ino, c)
        if (loc is None or loc.dram_slot >= 0 or loc.flags & LOST or key in self._prefetching
                or key in self._fetching):
            return None
        if not self._prefetch_room(pages(self.staged_len(loc)), make_room):
            self.kick_demoter()
            return None
        self.counters.prefetch_issued += 1
        self._prefetching.add(key)
        try:
            data = await self.fetch(ino, c, loc, stage=self.prefetch_limit,
                                    limiter=self.prefetch_limiter, want=False, watch=True)
        except ChunkError as exc:
            log.warning("prefetch: %s", exc)
            return False
        finally:
            self._prefetching.discard(key)
            used = key in self._used_in_flight
            self._used_in_flight.discard(key)
        now = self.get(ino, c)
        if data is None or now is None or now.seq != loc.seq or now.dram_slot < 0:
            return False  # changed meanwhile, or no room when the read began
        if used:
            self.counters.prefetch_used += 1
        else:
            self.prefetched.add(key)
        if not now.flags & PACKED:  # fetch checked the bytes it staged: the next read
            self.dram.mark_checked(ino, c, now.seq)  # counts as checked (dram_verify=open)
            self.staged(ino)
        if self.dram_used > self.high_water:
            self.kick_demoter()  # the demoter makes room in bulk, in eviction order
        return True

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

    @property
    def prefetch_limit(self) -> float:
        """Prefetches may fill half the room above the high watermark (writes keep the other
        half while the demoter, kicked, makes room in bulk and in eviction order)."""
        return max(self.dram.capacity * PROMOTE_SHARE, (self.high_water + self.dram.capacity) / 2)

    def prefetch_room(self, nbytes: int) -> bool:
        return self.promotion_room(nbytes, self.prefetch_limit)

    def _prefetch_room(self, need: int, make_room: Callable[[int], bool] | None) -> bool:
        if self.prefetch_room(need):
            return True
        return make_room is not None and make_room(need) and self.prefetch_room(need)

    def packs(self, loc: Loc) -> bool:
        """Would a clean DRAM copy of this NVMe chunk be kept packed (it saves pages)?"""
        return (self.dram_compress and loc.codec != CODEC_RAW
                and pages(loc.stored_len) < pages(loc.raw_len))

    def staged_len(self, loc: Loc) -> int:
        """Bytes of DRAM region a staged copy of this NVMe chunk takes."""
        return loc.stored_len if self.packs(loc) else loc.raw_len

    async def fetch(self, ino: int, c: int, loc: Loc, *, stage: float | None,
                    limiter: trio.CapacityLimiter | None = None,
                    raw: bool = False, want: bool = True,
                    have: bytes | bytearray | None = None,
                    watch: bool = False,
                    into: mmap.mmap | None = None) -> bytes | memoryview | bool | None:
        """Read an NVMe-only chunk (verified). If DRAM holds less than *stage* bytes, the
        worker also writes the bytes into the chunk's region, which becomes its clean DRAM
        copy (no eviction); with `dram_compress` (and not *raw*) it writes the record's
        payload there instead, a packed copy. Returns the bytes (True instead unless *want*),
        or None if the chunk changed meanwhile. Writes and truncations of the chunk wait
        until this is over. *have*: the chunk's verified bytes, read before (read-ahead):
        nothing is read, they are only staged. *watch*: ask `stage_watch` about a raw
        staging. *into*: without staging, read a raw record into this buffer (of at least
        chunk_size + BLOCK bytes) and return a view of it."""
        key = (ino, c)
        pending = self._fetching.get(key)
        if pending is not None:
            await pending.wait()
            return None
        now = self.get(ino, c)
        if now is None or now.seq != loc.seq or now.dram_slot >= 0:
            return None  # *loc* was read before an await: another fetch or a write came first
        done = self._fetching[key] = trio.Event()
        claimed = False
        pack = have is None and not raw and self.packs(loc) and ino not in self.dram.pins
        length = loc.stored_len if pack else loc.raw_len
        filling = pages(length)
        held = watcher = None
        installed = False
        try:
            if stage is not None and self.promotion_room(filling, stage):
                self.dram.claim(ino, c)
                claimed = True
                self.dram_filling += filling
                held = self.dram.hold(ino)
                if watch and not pack and have is None:
                    watcher = self.stage_watch(ino, c, held.fd)
            seg = self.nvme.pin(loc.seg)
            try:
                data, staged = await trio.to_thread.run_sync(
                    self._read_to_dram, ino, c, loc, seg, held, pack, want, have,
                    watcher.ready if watcher is not None else None, into,
                    limiter=limiter or self.limiter)
            finally:
                self.nvme.unpin(seg)
                if held is not None:
                    self.dram.drop(held)
            now = self.get(ino, c)
            if now is None or now.seq != loc.seq:
                return None
            if claimed and now.dram_slot >= 0:  # cannot be: writes wait for this fetch
                log.error("inode %d chunk %d: became resident during its fetch", ino, c)
                self.dram_filling -= filling
                self.dram.unclaim(ino)
                claimed = False
            if claimed and staged:
                self.dram_filling -= filling
                claimed = False  # the chunk owns the region now
                new = now._replace(dram_slot=IN_DRAM,
                                   flags=(now.flags | PACKED) if pack else now.flags)
                with self.meta.write() as txn:
                    self._replace(txn, ino, c, now, new)
                installed = True
                self.counters.promotions += 1
                if not pack:
                    self._mark_checked(ino, c, new)  # _read_record checked these bytes
            return data if want else True
        finally:
            if watcher is not None:
                watcher.done(installed)  # before the region is released, if it is
            if claimed:
                self.dram_filling -= filling
                self.dram.release(ino, c, length)
                self.dram.settle()
            del self._fetching[key]
            done.set()

    def _read_to_dram(self, ino: int, c: int, loc: Loc, seg, held: DramFile | None,
                      pack: bool, want: bool, have: bytes | bytearray | None = None,
                      ready: Callable[[], None] | None = None, into: mmap.mmap | None = None
                      ) -> tuple[bytes | memoryview | None, bool]:
        """Worker thread: `_read_record` (unless the bytes are *have*), and if *held* (the
        chunk's DRAM file, its region claimed) write the bytes (the payload if *pack*) into
        the region. Returns the bytes
        (None unless *want*) and whether the region was filled (False: not asked, or the
        tmpfs is full). Bytes nobody wants go to the region straight from the read buffer
        (a raw record) or from this thread's own buffer, warm in its cache, not from fresh
        memory that each chunk would fault in again. *ready* is called once a raw
        staging is done."""
        def stage(data: bytes | memoryview) -> bool:
            try:
                ok = os.pwrite(held.fd, data, c * self.cs) == len(data)
            except OSError as exc:
                log.warning("DRAM tier: cannot stage a chunk (%s)", exc)
                return False
            if ok and ready is not None and not pack:
                ready()
            return ok

        if have is not None:
            return have, held is not None and stage(have)
        if held is None:
            return self._read_record(ino, c, loc, seg, None, into=into), False
        _test_fetch_delay()
        if pack:
            payload = bytearray(loc.stored_len)
            data = self._read_record(ino, c, loc, seg, None, payload_to=memoryview(payload))
            return data, stage(payload)
        if want:
            data = self._read_record(ino, c, loc, seg, None)
            return data, stage(data)
        return None, self._read_record(ino, c, loc, seg, self._thread_buffer()[:loc.raw_len],
                                       then=stage)

    def _thread_buffer(self) -> memoryview:
        """A chunk-sized buffer of the calling worker thread's own."""
        buf = getattr(self._buffers, "chunk", None)
        if buf is None:
            buf = self._buffers.chunk = memoryview(bytearray(self.cs))
        return buf

    def _read_record(self, ino: int, c: int, loc: Loc, seg, target: memoryview | None,
                     payload_to: memoryview | None = None,
                     then: Callable[[memoryview], T] | None = None,
                     into: mmap.mmap | None = None) -> bytes | memoryview | T:
        """Worker thread: read, check, decode (into *target* if given) and verify one
        record; its payload is also copied to *payload_to* if given (a packed copy). With
        *then*, returns then(verified bytes), called while they may still be a view of the
        read buffer (a raw record is not copied at all). *into*: read into this buffer; a
        raw record's bytes are returned as a view of it (not copied)."""
        def decode(h: RecordHeader, payload: memoryview) -> bytes | memoryview | T:
            if (h.ino, h.chunk, h.seq) != (ino, c, loc.seq):
                raise RecordError(f"found inode {h.ino} chunk {h.chunk} seq {h.seq} instead")
            if h.raw_len != loc.raw_len:
                raise RecordError(f"record holds {h.raw_len} bytes, expected {loc.raw_len}")
            if payload_to is not None:
                if len(payload) != len(payload_to) or h.codec != loc.codec:
                    raise RecordError(f"payload of {len(payload)} bytes in codec {h.codec}, "
                                      f"expected {len(payload_to)} in codec {loc.codec}")
                payload_to[:] = payload
            if (then is not None or into is not None) and h.codec == CODEC_RAW:
                data = payload
            elif target is None:
                data = self.codec.decode(h.codec, payload, h.raw_len)
            else:
                self.codec.decode_into(h.codec, payload, h.raw_len, target)
                data = target
            if len(data) != loc.raw_len or _hash(data) != loc.checksum:
                raise _Mismatch
            if then is not None:
                return then(data)
            if data is payload:  # (into): a view that outlives the read, unlike *payload*
                return memoryview(into)[HEADER_SIZE:HEADER_SIZE + len(data)]
            return data

        try:
            return self.nvme.read_record(seg, loc.off, loc.rec_len, decode, into=into)
        except (RecordError, CodecError, OSError) as exc:
            self.counters.checksum_errors += 1
            raise ChunkError(f"inode {ino} chunk {c}: bad record in segment {loc.seg} at "
                             f"{loc.off}: {exc}") from None
        except _Mismatch:
            self.counters.checksum_errors += 1
            raise ChunkError(f"inode {ino} chunk {c}: checksum mismatch in segment "
                             f"{loc.seg}") from None

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
        if self.reads_through(ino, size):
            return -1
        need = sum(pages(loc.raw_len) for _, loc in todo)
        if (size > STAGE_FILE_MAX or any(loc.flags & LOST for _, loc in todo)
                or not self.promotion_room(need)):
            return -1
        t0 = time.perf_counter()
        # A chunk whose prefetch was already in flight is a (late) prefetch hit, as on the
        # daemon's read path; every other one is this open's NVMe read, whoever fetches it.
        late = {c for c, _ in todo if (ino, c) in self._prefetching}

        async def stage(c: int, loc: Loc) -> None:
            try:
                await self.fetch(ino, c, loc, stage=self.dram.capacity * PROMOTE_SHARE,
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
                    or (ino, c) in self._fetching):
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
            if self.prefetched or self._prefetching:
                self._prefetch_used(key)
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
                self.crash.reached("write.piece")
        return len(data)

    async def _write_piece(self, ino: int, c: int, start: int, piece: memoryview,
                           on_commit: Callable[[], None] | None = None) -> None:
        stop = start + len(piece)
        over = False  # may go over the DRAM tier's size (`_wait_dram`)
        while True:
            pending = self._fetching.get((ino, c))
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
                    or (ino, c) in self._fetching):
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
            for c, start, stop, loc in plan.pieces:
                in_place = loc is not None and loc.dram_slot >= 0
                length = max(loc.raw_len, stop) if in_place else stop
                self._replace(txn, plan.ino, c, loc, self._dram_loc(length), written_from=start)
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
            return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, SEALED, _hash(whole),
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
        await self.fetch(ino, c, now, stage=math.inf if over else float(self.dram.capacity),
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
            self._replace(txn, ino, c, loc, new, written_from=start)
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
            return [_hash(self._dram_bytes(ino, c, loc.raw_len)) for c, loc in todo]
        half = len(todo) // 2 if total >= PARALLEL_HASH_BYTES and _hash is not xxhash_hash else 0
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
            sums.append(_hash(view))
        return sums

    def _nchunks(self, size: int) -> int:
        return (size + self.cs - 1) // self.cs

    async def writeback(self, key: tuple[int, int], *, drop: bool, pack: bool = False) -> bool:
        """Copy a dirty DRAM chunk to NVMe; with *drop*, free its DRAM slot afterwards; with
        *pack* (and `dram_compress`), keep a packed copy instead of the raw one when it saves
        pages. Returns False if the chunk changed meanwhile (the caller may retry)."""
        return (await self.writeback_many([key], drop=drop, pack=pack))[0]

    async def writeback_many(self, keys: list[tuple[int, int]], *, drop: bool,
                             pack: bool = False) -> list[bool]:
        """`writeback` for several chunks at once: one worker hand-off compresses them all,
        one writes all their records, one transaction commits them. A hand-off costs the trio
        thread ~100 us on a small VM (futex and socket wake-ups), the Python of a commit a
        tenth of that, so demotion in batches leaves the thread to FUSE requests. Chunks of
        a file open in passthrough mode keep their DRAM copy (the kernel reads it)."""
        done = [True] * len(keys)
        # Another task choosing a file's codec decides for this batch's chunks of it too.
        while waits := [w for ino in {k[0] for k in keys}
                        if self._file_codec.get(ino) is None
                        and (w := self._choosing.get(ino)) is not None]:
            await waits[0].wait()
        jobs: list[_Job] = []
        choosing: dict[int, trio.Event] = {}  # the files whose codec this batch chooses
        for i, (ino, c) in enumerate(keys):
            loc = self.get(ino, c)
            if loc is None or loc.dram_slot < 0:
                continue
            if loc.seg:
                if drop:
                    self.drop_dram_copy((ino, c))
                continue
            job = _Job(i, ino, c, loc, self.dram.hold(ino), self.stream_of(ino),
                       self._file_codec.get(ino))
            if job.codec_id is None and ino not in choosing:
                # the hint is looked up here: the namespace belongs to the trio thread
                job.hint, job.directory = self.codec_context(ino)
                job.expected = self.choices.expected(job.directory) if job.hint is None else None
                job.chooses = True
                choosing[ino] = self._choosing[ino] = trio.Event()
            jobs.append(job)
        if not jobs:
            return done
        try:
            done = await self._writeback_jobs(jobs, choosing, done, drop=drop, pack=pack)
        except NoSpace:
            self.nvme_full.failed(
                f"the filesystem under {self.nvme.directory} has "
                f"{self.nvme.room() >> 20} MiB free: dirty data stays in DRAM, and writes "
                f"that need room get ENOSPC until space is freed (remove files here, or "
                f"free space on that filesystem)")
            raise
        except OSError as exc:
            self.nvme_failing.failed(f"{exc}: dirty data stays in DRAM")
            raise
        finally:
            for job in jobs:
                self.dram.drop(job.held)
        self.nvme_full.over()
        self.nvme_failing.over()
        return done

    async def _writeback_jobs(self, jobs: list[_Job], choosing: dict[int, trio.Event],
                              done: list[bool], *, drop: bool, pack: bool) -> list[bool]:
        try:
            await trio.to_thread.run_sync(self._encode_jobs, jobs, limiter=self.limiter)
            for job in jobs:
                if job.chooses:  # the file's choice; `used` is this chunk's
                    if job.hint is None:
                        self.choices.chose(job.directory, job.codec_id, full=job.full)
                    self._file_codec.setdefault(job.ino, job.codec_id)
        finally:
            for ino, event in choosing.items():
                del self._choosing[ino]
                event.set()
        todo: list[_Job] = []
        try:
            for job in jobs:
                if not self._still_dirty(job):
                    done[job.i] = False
                    continue
                if job.mismatch and job.ino in self.streaming:
                    # the kernel writes the file (an adopted one: `adopt_stream`); its next
                    # take records the bytes it holds then
                    done[job.i] = False
                    continue
                if job.mismatch:  # the bytes read are not the ones sealed, and no write says why
                    log.error("inode %d chunk %d: its DRAM copy does not match its checksum; "
                              "not written back", job.ino, job.c)
                    self.counters.checksum_errors += 1
                    done[job.i] = False
                    continue
                job.rec_len = record_length(len(job.payload))
                job.seg, job.off = await self._reserve(job.stream, job.rec_len)
                job.stream = job.seg.stream  # (another's, when the tier is nearly full)
                todo.append(job)
            if todo:
                await trio.to_thread.run_sync(self._write_jobs, todo, limiter=self.limiter)
        except BaseException as exc:
            for job in todo:
                self.nvme.mark_dead(job.seg.seg_id, job.rec_len)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.nvme.room_changed()  # (a filesystem that cannot preallocate segments)
                raise NoSpace() from exc
            raise
        if drop or (pack and self.dram_compress):
            for ino in {job.ino for job in todo}:
                self.revoke(ino)  # its opens answered by the front thread are pins now
        packing: list[_Job] = []
        with self.meta.write() as txn:
            for job in todo:
                self.nvme.bytes_written += job.rec_len
                self.counters.user_bytes_written += job.rec_len  # user data, any stream
                self.nvme.counters(job.stream).user_bytes += job.rec_len
                now = self.get(job.ino, job.c)
                if not self._still_dirty(job):
                    self.nvme.mark_dead(job.seg.seg_id, job.rec_len)
                    done[job.i] = False
                    continue
                keep = not drop or job.ino in self.dram.pins
                new = Loc(IN_DRAM if keep else -1, job.seg.seg_id, job.off, job.rec_len,
                          now.raw_len, len(job.payload), job.used,
                          SEALED | now.flags & TAIL_LOST, job.csum, now.seq)
                self._replace(txn, job.ino, job.c, now, new)
                self.counters.writebacks += 1
                if not keep:
                    self.counters.demotions += 1
                elif pack and self._packable(job.ino, new):
                    packing.append(job)
        for job in packing:
            self._repack(job.ino, job.c, job.payload)
        return done

    def _still_dirty(self, job: _Job) -> bool:
        """Is the job's chunk still the dirty DRAM copy it read (same seq, no NVMe copy)? A
        chunk written back by another task meanwhile may have been dropped and staged again
        in the same region: what the worker read there is then not to be trusted."""
        now = self.get(job.ino, job.c)
        return (now is not None and now.seq == job.loc.seq and now.dram_slot >= 0
                and not now.seg)

    def _packable(self, ino: int, loc: Loc) -> bool:
        """Should this clean raw DRAM copy be kept packed instead (dram_compress: it saves
        pages; never in a file the kernel reads directly)?"""
        return (self.dram_compress and loc.codec != CODEC_RAW and ino not in self.dram.pins
                and pages(loc.stored_len) < pages(loc.raw_len))

    def _repack(self, ino: int, c: int, payload) -> None:
        """Replace a clean raw DRAM copy with its record's *payload* (packed), in two commits
        around the rewrite of the region (its raw bytes first give way to NVMe, so that no
        crash leaves the region holding other bytes than lmdb says). Synchronous."""
        loc = self.get(ino, c)
        if loc is None or loc.dram_slot < 0 or loc.flags & PACKED or not loc.seg:
            return
        with self.meta.write() as txn:
            self._replace(txn, ino, c, loc, nvme_only(loc))
        self.dram.claim(ino, c)
        try:
            self.dram.write(ino, c, 0, payload)
        except OSError as exc:
            log.warning("DRAM tier: cannot keep a packed copy (%s)", exc)
            self.dram.release(ino, c, len(payload))
            self.dram.settle()
            return
        with self.meta.write() as txn:
            self._replace(txn, ino, c, nvme_only(loc),
                          loc._replace(dram_slot=IN_DRAM, flags=loc.flags | PACKED))

    def _encode_jobs(self, jobs: list[_Job]) -> None:
        """Worker thread: `_encode` each job (its bytes read from its region); a file's later
        chunks take the codec its first one chose."""
        chosen: dict[int, int] = {}
        for job in jobs:
            data = bytearray(job.loc.raw_len)  # the payload of a raw record: not reused
            self.dram.read_region(job.held.fd, job.c * self.cs, data)
            codec_id = job.codec_id if job.codec_id is not None else chosen.get(job.ino)
            job.csum, codec_id, job.used, job.payload, job.full = self._encode(
                data, job.loc, codec_id, job.hint, job.expected)
            job.mismatch = bool(job.loc.flags & SEALED) and job.csum != job.loc.checksum
            if job.codec_id is None:
                chosen.setdefault(job.ino, codec_id)
                job.codec_id = codec_id

    def _write_jobs(self, jobs: list[_Job]) -> None:
        """Worker thread: write each job's record where it was reserved; records reserved
        one after another in a segment go in one write."""
        run: list[_Job] = []
        for job in jobs:
            if run and (job.seg is not run[-1].seg or job.off != run[-1].off + run[-1].rec_len):
                self._write_run(run)
                run = []
            run.append(job)
        if run:
            self._write_run(run)

    def _write_run(self, run: list[_Job]) -> None:
        self.nvme.write_records(run[0].seg, run[0].off, [
            (RecordHeader(job.used, job.stream, job.ino, job.c, job.loc.seq, job.loc.raw_len,
                          len(job.payload), job.csum), job.payload) for job in run])

    async def _reserve(self, stream: int, rec_len: int):
        """Space for one record; cleans segments if none is free."""
        while True:
            try:
                return self.nvme.reserve(stream, rec_len)
            except NvmeFull:
                if self.cleaner is None or not await self.cleaner.make_room():
                    raise NoSpace() from None

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
                written_from = self.shadow_from.get((ino, c), 0)
                self._unshadow(txn, (ino, c))
                self._shadow(txn, (ino, c), shadow._replace(seg=seg, off=off, rec_len=rec_len),
                             written_from)
        else:
            self.nvme.mark_dead(seg, rec_len)

    def _encode(self, data: bytearray, loc: Loc, codec_id: int | None, hint: str | None,
                expected: int | None):
        """Worker thread: checksum and compress one chunk (*data*, a copy of its bytes that
        nobody else holds); without a codec choice for the file yet, take
        *expected* (its directory's) if the chunk confirms it, else make one (from *hint*
        and the chunk). Returns the file's codec choice, whether that was a full choice, and
        the codec this chunk was really stored with (raw when it did not compress)."""
        view = memoryview(data)
        csum = _hash(view)  # a record is written only with the checksum of its own bytes
        full = False
        if codec_id is None:
            sample = view[:65536]
            if expected is not None and self.codec.confirms(sample, expected):
                codec_id = expected
            else:
                codec_id, full = self.codec.choose(sample, hint), True
        used, payload = self.codec.encode(view, codec_id)  # may fall back to raw
        if used == CODEC_RAW:
            payload = data
        return csum, codec_id, used, payload, full

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

    async def fsync(self, ino: int, size: int) -> None:
        """Make a file's data durable on NVMe (its DRAM copies stay, clean)."""
        for _attempt in range(100):
            dirty = [c for c in self.index.chunks_of(ino, self._nchunks(size))
                     if not self.is_clean((ino, c))]
            if not dirty:
                break
            async with open_nursery() as nursery:
                for c in dirty:
                    nursery.start_soon(partial(self.writeback, (ino, c), drop=False,
                                               pack=True))
        await self.sync()

    async def sync(self) -> None:
        await trio.to_thread.run_sync(self._sync_all, limiter=self.limiter)

    def _sync_all(self) -> None:
        self.nvme.sync()
        self.meta.sync()

    async def writeback_all(self) -> int:
        """Write every dirty chunk to NVMe and make it durable (clean unmount). Returns the
        bytes left only in DRAM: 0, unless writing back failed (the tier full, its disk
        failing; the store logs the episode)."""
        keys = list(self.dirty_since)
        async with open_nursery() as nursery:
            limiter = trio.Semaphore(2)
            for batch in self.writeback_batches(keys):
                await limiter.acquire()
                nursery.start_soon(self._writeback_release, batch, limiter)
        try:
            await self.sync()
        except OSError as exc:
            log.error("unmount: making the NVMe tier durable failed: %s", exc)
            return self.dram_used
        return self.unbacked

    async def _writeback_release(self, keys, limiter) -> None:
        try:
            await self.writeback_many(keys, drop=False)
        except (NoSpace, OSError):
            pass  # logged as an episode; the chunks stay dirty in DRAM
        except Exception:
            log.exception("writeback of %d chunks (inode %d chunk %d first) failed",
                          len(keys), keys[0][0], keys[0][1])
        finally:
            limiter.release()

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
                self._replace(txn, ino, last, loc, new, written_from=cut)
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
                                                    self._next_seq()), written_from=start)
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
            if c >= start and (done := self._fetching.get((ino, c))) is not None:
                return done
        return None

    def delete_file(self, ino: int, size: int) -> None:
        """Forget every chunk of a file (its inode is gone)."""
        with self.meta.write() as txn:
            for c in self.index.chunks_of(ino, self._nchunks(size)):
                self._replace(txn, ino, c, self.get(ino, c), None)
        self._file_codec.pop(ino, None)
        if ino in self.allocated:
            self._set_allocated(ino, 0)
        self.file_bytes.pop(ino, None)
        self.end_read_through(ino)
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
                      "chunks_from_holes": k.chunks_from_holes,
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
