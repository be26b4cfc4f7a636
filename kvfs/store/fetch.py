"""NVMe reads of chunks: a demand read (verified), a staging into the chunk's DRAM region
(a promotion, or a prefetch ahead of its read), and the decode of a packed DRAM copy.

One fetch per chunk at a time (`pending`): writes and truncations of a chunk wait for its
fetch before they change anything, since a passthrough open may read a staged region before
the fetch ends (kvfs.passthrough, stage_watch). A staging claims the region first, so what
fetches hold counts against DRAM meanwhile (`filling`); the worker writes the bytes
into it; the trio thread commits them only if the chunk's seq did not change meanwhile,
else releases the region. Reads happen in worker threads (O_DIRECT into aligned buffers,
decode, xxh3 of the raw bytes: a record is used only if it is the chunk's and checks out).
docs/DESIGN.md, Concurrency protocol.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from kvfs.faults import Faults
from kvfs.store.codec import CODEC_RAW, CodecError
from kvfs.store.dram import DramFile, pages
from kvfs.store.location import IN_DRAM, LOST, PACKED, ChunkError, Loc, hash_bytes
from kvfs.store.nvme import HEADER_SIZE, RecordError, RecordHeader, pack_header
from kvfs.store.readthrough import PROMOTE_SHARE

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class StageWatch(Protocol):
    """Told how a prefetch's staging of a chunk goes (see `ChunkStore.stage_watch`)."""

    def ready(self) -> None:
        """Worker thread: the chunk's bytes are in its DRAM file, whole and checked, and
        will become its DRAM copy unless `done(False)` comes."""

    def done(self, installed: bool) -> None:
        """The fetch is over: the staged bytes are the chunk's DRAM copy now, or not
        (*installed* False: the region is released right after this returns)."""


class _Mismatch(Exception):
    """A record's decoded bytes do not match its chunk's checksum (inside _read_record)."""


class Fetches:
    """Attributes:
        prefetched      chunks staged ahead of a read and not read yet
        prefetch_limiter  prefetches' worker threads (never the ones demand reads need)
    """

    def __init__(self, store: ChunkStore, *, chunk_size: int, io_threads: int,
                 faults: Faults) -> None:
        self.store = store
        self.cs = chunk_size
        self.faults = faults
        self._fetching: dict[tuple[int, int], trio.Event] = {}  # in flight -> its end
        self.prefetched: set[tuple[int, int]] = set()
        self.filling = 0  # pages of regions NVMe reads are filling, not committed yet
        self._prefetching: set[tuple[int, int]] = set()
        # ... and the ones in flight that a passthrough open counted as read already: their
        # bytes were staged, and the open answered from them, before the fetch was over.
        self._used_in_flight: set[tuple[int, int]] = set()
        self.prefetch_limiter = trio.CapacityLimiter(max(1, io_threads // 2))
        self._buffers = threading.local()  # worker threads' own (`_thread_buffer`)

    def pending(self, key: tuple[int, int]) -> trio.Event | None:
        """The end of the fetch of chunk *key* in flight, if one is."""
        return self._fetching.get(key)

    def busy(self, key: tuple[int, int]) -> bool:
        return key in self._fetching

    def demand_reads(self) -> int:
        """Fetches in flight that a read waits for (not prefetches)."""
        return len(self._fetching) - len(self._prefetching)

    def late(self, key: tuple[int, int]) -> bool:
        """Is a prefetch of *key* still in flight (a demand read found it so)?"""
        return key in self._prefetching

    def dropped(self, key: tuple[int, int]) -> None:
        """Chunk *key* left DRAM: a prefetch that staged it was for nothing."""
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.store.counters.prefetch_wasted += 1

    def _delay(self) -> None:
        self.faults.fetch_delay()

    def used(self, key: tuple[int, int]) -> None:
        """Chunk *key* was read from DRAM: a prefetch that staged it was worth it."""
        if key in self.prefetched:
            self.prefetched.discard(key)
            self.store.counters.prefetch_used += 1
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
        loc = self.store.get(ino, c)
        if (loc is None or loc.dram_slot >= 0 or loc.flags & LOST or key in self._prefetching
                or key in self._fetching):
            return None
        if not self._prefetch_room(pages(self.staged_len(loc)), make_room):
            self.store.events.dram_filling()
            return None
        self.store.counters.prefetch_issued += 1
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
        now = self.store.get(ino, c)
        if data is None or now is None or now.seq != loc.seq or now.dram_slot < 0:
            return False  # changed meanwhile, or no room when the read began
        if used:
            self.store.counters.prefetch_used += 1
        else:
            self.prefetched.add(key)
        if not now.flags & PACKED:  # fetch checked the bytes it staged: the next read
            self.store.dram.mark_checked(ino, c, now.seq)  # counts as checked (dram_verify=open)
            self.store.events.staged(ino)
        if self.store.dram_used > self.store.high_water:
            self.store.events.dram_filling()  # the demoter makes room in bulk, in eviction order
        return True

    @property
    def prefetch_limit(self) -> float:
        """Prefetches may fill half the room above the high watermark (writes keep the other
        half while the demoter, kicked, makes room in bulk and in eviction order)."""
        cap = self.store.dram.capacity
        return max(cap * PROMOTE_SHARE, (self.store.high_water + cap) / 2)

    def prefetch_room(self, nbytes: int) -> bool:
        return self.store.promotion_room(nbytes, self.prefetch_limit)

    def _prefetch_room(self, need: int, make_room: Callable[[int], bool] | None) -> bool:
        if self.prefetch_room(need):
            return True
        return make_room is not None and make_room(need) and self.prefetch_room(need)

    def packs(self, loc: Loc) -> bool:
        """Would a clean DRAM copy of this NVMe chunk be kept packed (it saves pages)?"""
        return (self.store.dram_compress and loc.codec != CODEC_RAW
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
        now = self.store.get(ino, c)
        if now is None or now.seq != loc.seq or now.dram_slot >= 0:
            return None  # *loc* was read before an await: another fetch or a write came first
        done = self._fetching[key] = trio.Event()
        claimed = False
        pack = have is None and not raw and self.packs(loc) and ino not in self.store.dram.pins
        length = loc.stored_len if pack else loc.raw_len
        filling = pages(length)
        held = watcher = None
        installed = False
        try:
            if stage is not None and self.store.promotion_room(filling, stage):
                self.store.dram.claim(ino, c)
                claimed = True
                self.filling += filling
                held = self.store.dram.hold(ino)
                if watch and not pack and have is None:
                    watcher = self.store.events.stage_watch(ino, c, held.fd)
            seg = self.store.nvme.pin(loc.seg)
            try:
                data, staged = await trio.to_thread.run_sync(
                    self._read_to_dram, ino, c, loc, seg, held, pack, want, have,
                    watcher.ready if watcher is not None else None, into,
                    limiter=limiter or self.store.limiter)
            finally:
                self.store.nvme.unpin(seg)
                if held is not None:
                    self.store.dram.drop(held)
            now = self.store.get(ino, c)
            if now is None or now.seq != loc.seq:
                return None
            if claimed and now.dram_slot >= 0:  # cannot be: writes wait for this fetch
                log.error("inode %d chunk %d: became resident during its fetch", ino, c)
                self.filling -= filling
                self.store.dram.unclaim(ino)
                claimed = False
            if claimed and staged:
                self.filling -= filling
                claimed = False  # the chunk owns the region now
                new = now._replace(dram_slot=IN_DRAM,
                                   flags=(now.flags | PACKED) if pack else now.flags)
                with self.store.meta.write() as txn:
                    self.store.chunks.replace(txn, ino, c, now, new)
                installed = True
                self.store.counters.promotions += 1
                if not pack:
                    self.store.mark_checked(ino, c, new)  # _read_record checked these bytes
            return data if want else True
        finally:
            if watcher is not None:
                watcher.done(installed)  # before the region is released, if it is
            if claimed:
                self.filling -= filling
                self.store.dram.release(ino, c, length)
                self.store.dram.settle()
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
            return self.read_record(ino, c, loc, seg, None, into=into), False
        self._delay()
        if pack:
            payload = bytearray(loc.stored_len)
            data = self.read_record(ino, c, loc, seg, None, payload_to=memoryview(payload))
            return data, stage(payload)
        if want:
            data = self.read_record(ino, c, loc, seg, None)
            return data, stage(data)
        return None, self.read_record(ino, c, loc, seg, self._thread_buffer()[:loc.raw_len],
                                       then=stage)

    def _thread_buffer(self) -> memoryview:
        """A chunk-sized buffer of the calling worker thread's own."""
        buf = getattr(self._buffers, "chunk", None)
        if buf is None:
            buf = self._buffers.chunk = memoryview(bytearray(self.cs))
        return buf

    def read_record(self, ino: int, c: int, loc: Loc, seg, target: memoryview | None,
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
                data = self.store.codec.decode(h.codec, payload, h.raw_len)
            else:
                self.store.codec.decode_into(h.codec, payload, h.raw_len, target)
                data = target
            if len(data) != loc.raw_len or hash_bytes(data) != loc.checksum:
                raise _Mismatch
            if then is not None:
                return then(data)
            if data is payload:  # (into): a view that outlives the read, unlike *payload*
                return memoryview(into)[HEADER_SIZE:HEADER_SIZE + len(data)]
            return data

        try:
            return self.store.nvme.read_record(seg, loc.off, loc.rec_len, decode, into=into)
        except (RecordError, CodecError, OSError) as exc:
            self.store.counters.checksum_errors += 1
            raise ChunkError(f"inode {ino} chunk {c}: bad record in segment {loc.seg} at "
                             f"{loc.off}: {exc}") from None
        except _Mismatch:
            self.store.counters.checksum_errors += 1
            raise ChunkError(f"inode {ino} chunk {c}: checksum mismatch in segment "
                             f"{loc.seg}") from None

    async def record(self, ino: int, c: int, loc: Loc) -> bytes | None:
        """Chunk *c*'s NVMe record as stored (a 64-byte header, then the encoded payload),
        its bytes decoded and checked first: what the pod publishes, not encoded again. The
        header's inode, stream and seq are left 0 (they are this mount's). None if the
        chunk changed meanwhile."""
        payload = bytearray(loc.stored_len)
        seg = self.store.nvme.pin(loc.seg)
        try:
            await trio.to_thread.run_sync(self.read_record, ino, c, loc, seg, None,
                                          memoryview(payload), limiter=self.store.limiter)
        finally:
            self.store.nvme.unpin(seg)
        now = self.store.get(ino, c)
        if now is None or now.seq != loc.seq:
            return None
        return pack_header(RecordHeader(loc.codec, 0, 0, c, 0, loc.raw_len, loc.stored_len,
                                        loc.checksum)) + bytes(payload)

    async def unpack(self, ino: int, c: int, loc: Loc) -> bytes | None:
        """Decode (and verify) a packed DRAM copy in a worker; None if the chunk changed
        meanwhile. A region released and claimed again while the worker read it may have
        given it other bytes: a failed check then means "changed", not "damaged"."""
        claim = self.store.dram.claim_ids.get((ino, c))
        held = self.store.dram.hold(ino)
        try:
            data = await trio.to_thread.run_sync(self._decode_packed, held, c, loc,
                                                 limiter=self.store.limiter)
        finally:
            self.store.dram.drop(held)
        now = self.store.get(ino, c)
        if now != loc or self.store.dram.claim_ids.get((ino, c)) != claim:
            return None
        if isinstance(data, str):
            self.store.counters.checksum_errors += 1
            raise ChunkError(f"inode {ino} chunk {c}: packed DRAM copy: {data}")
        self.store.counters.unpacked += 1
        return data

    def _decode_packed(self, held: DramFile, c: int, loc: Loc) -> bytes | str:
        """Worker thread: the raw bytes of a packed DRAM copy, checked against its checksum,
        or what is wrong with it."""
        payload = bytearray(loc.stored_len)
        self.store.dram.read_region(held.fd, c * self.cs, payload)
        try:
            data = self.store.codec.decode(loc.codec, payload, loc.raw_len)
        except CodecError as exc:
            return str(exc)
        if len(data) != loc.raw_len or hash_bytes(data) != loc.checksum:
            return "checksum mismatch in DRAM (packed)"
        return data
