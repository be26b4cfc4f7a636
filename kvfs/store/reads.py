"""Reads: the bytes of a file's range from its chunks, wherever they are (a hole, a DRAM
copy raw or packed, the read-through memory, an NVMe record), checked before they are
trusted: a DRAM copy is hashed as `-o dram_verify` says, an NVMe record always. A damaged
or lost chunk is ChunkError (EIO), never other bytes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvfs.store.location import LOST, PACKED, SEALED, TAIL_LOST, ChunkError, Loc, hash_bytes
from kvfs.store.readthrough import CHANGED, PROMOTE_SHARE

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore


class Reads:
    """`read`, the checks of DRAM copies, and the read latency histograms."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.dram = store.dram
        self.chunks = store.chunks
        self.counters = store.counters
        self.cs = store.cs
        # Reads of DRAM copies land here: a read's reply is sent before any other task runs
        # (see `read`), so one buffer serves them all.
        self._scratch = bytearray(store.cs)

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
        through = self.store.through.reads(ino, file_size)
        if through:
            self.store.through.sequential(ino, first, last, self.chunks.nchunks(file_size),
                                          end // cs)
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
            loc = self.chunks.get(ino, c)
            if loc is None:
                # A hole, or a chunk that a truncation removed while this read waited (for a
                # fetch): zeros, but only up to the file's end as it is now.
                self.counters.count_read("holes", start == 0)
                size = self.store.events.size_of(ino)
                if size is not None:
                    length = max(0, min(length, size - c * self.cs - start))
                return bytes(length)
            if loc.flags & LOST:
                raise ChunkError(f"inode {ino} chunk {c}: its only copy was lost with DRAM")
            if loc.flags & TAIL_LOST and start + length > loc.raw_len:
                raise ChunkError(f"inode {ino} chunk {c}: its bytes past {loc.raw_len} were "
                                 f"lost with DRAM")
            if loc.flags & PACKED:
                data = await self.store.fetches.unpack(ino, c, loc)
                if data is None:
                    continue  # the chunk changed while we decoded it: start over
                self.store.policy.hit((ino, c))
                self.store.fetches.used((ino, c))
                self.counters.count_read("dram", start == 0)
                self.record_latency(t0, self.counters.read_latency_dram_us)
                return _slice(memoryview(data), start, length)
            if loc.dram_slot >= 0:
                check = ((verified is None or (c, loc.seq) not in verified)
                         and self.check_needed(ino, c, loc))
                if check:
                    self.counters.dram_checks += 1
                    view = self.region(ino, c, loc.raw_len)
                    if hash_bytes(view) != loc.checksum:
                        self.counters.checksum_errors += 1
                        raise ChunkError(f"inode {ino} chunk {c}: checksum mismatch in DRAM")
                    self.mark_checked(ino, c, loc)
                    view = view[start:]
                else:  # only the bytes asked for
                    view = self._region_at(ino, c, start, min(length, loc.raw_len - start))
                if check and verified is not None:
                    verified.add((c, loc.seq))
                self.store.policy.hit((ino, c))
                self.store.fetches.used((ino, c))
                self.counters.count_read("dram", start == 0)
                self.record_latency(t0, self.counters.read_latency_dram_us)
                return _slice(view, 0, length)
            if self.store.fetches.late((ino, c)):
                self.counters.prefetch_late += 1
            data = await self.store.through.use((ino, c), loc, start, length) if through else None
            if data is CHANGED:
                continue  # the chunk changed meanwhile: start over
            if data is None:  # (nothing read ahead, or it failed: this fetch says why, EIO)
                data = await self.store.fetches.fetch(
                    ino, c, loc, stage=None if through else self.dram.capacity * PROMOTE_SHARE)
                if data is None:
                    continue  # the chunk changed while we read it: start over
                if verified is not None:
                    verified.add((c, loc.seq))  # fetch verified it
            self.counters.count_read("nvme", start == 0)
            self.record_latency(t0, self.counters.read_latency_nvme_us)
            if through and start + length >= loc.raw_len:
                self.store.through.done(ino, c, loc, data)
            return _slice(memoryview(data), start, length)

    def check_needed(self, ino: int, c: int, loc: Loc, consume: bool = True) -> bool:
        """Must a read hash this sealed DRAM copy before trusting it? `dram_verify=open`: yes,
        unless the fetch that staged it checked it (that counts for the next read only);
        `once`: only if this daemon has not checked it since its bytes last changed (after
        a restart, every copy is checked once); `ingest`: never (checked on the way in)."""
        if self.store.dram_verify == "ingest" or not loc.flags & SEALED:
            return False
        return not self.dram.checked(ino, c, loc.seq,
                                     consume=consume and self.store.dram_verify == "open")

    def mark_checked(self, ino: int, c: int, loc: Loc) -> None:
        """The region holds exactly the bytes of *loc*'s checksum (dram_verify=once)."""
        if self.store.dram_verify == "once":
            self.dram.mark_checked(ino, c, loc.seq)

    def record_latency(self, t0: float, tier: list[int]) -> None:
        self.record_us(int((time.perf_counter() - t0) * 1e6), tier)

    def record_us(self, us: int, tier: list[int]) -> None:
        """A read of *us* microseconds in the histograms (log2 buckets): all, and *tier*'s."""
        bucket = min(23, us.bit_length())
        self.counters.read_latency_us[bucket] += 1
        tier[bucket] += 1

    def _region_at(self, ino: int, c: int, start: int, length: int) -> memoryview:
        """`region` of [start, start+length) of the region (empty if length <= 0)."""
        view = memoryview(self._scratch)[:max(0, length)]
        if length > 0:
            self.dram.read_region(self.dram.fd(ino), c * self.cs + start, view)
        return view

    def region(self, ino: int, c: int, length: int) -> memoryview:
        """The first *length* bytes of region (ino, c), read into the scratch buffer: valid
        until the next read of a region on this thread (no await may come in between)."""
        view = memoryview(self._scratch)[:length]
        self.dram.read_into(ino, c, view)
        return view


def _slice(view: memoryview, start: int, length: int) -> bytes | memoryview:
    """Bytes [start, start+length) of a chunk whose stored part is *view* (the rest is zeros)."""
    have = len(view)
    if start + length <= have:
        return view[start:start + length]
    if start >= have:
        return bytes(length)
    return bytes(view[start:]) + bytes(start + length - have)
