"""Writes: the bytes of a write, a truncation or a hole punched, into the chunks' DRAM
regions, and the commit that makes them part of the file.

Two write paths share the rules here: `write` (the daemon holds the data) and `plan_write`
/ `finish_write` (kvfs._fuseshim copies a request's data straight into the regions). Both
check the room first (the store's capacity, then DRAM's), unseal a sealed chunk in lmdb
before its bytes change (crash safety, see kvfs/store/chunkstore.py), and commit each piece
with the caller's inode update (*on_commit*), so that neither a crash nor a failure part way
leaves a chunk holding bytes past the file's size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from kvfs.store.codec import CODEC_RAW
from kvfs.store.dram import pages
from kvfs.store.location import (
    IN_DRAM,
    LOST,
    PACKED,
    SEALED,
    TAIL_LOST,
    ChunkError,
    Loc,
    NoSpace,
    hash_bytes,
)

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class WritePlan:
    """A write whose bytes are copied straight into DRAM regions (plan_write)."""

    ino: int
    # (chunk, start, stop, location before the write); in place if it had a DRAM copy
    pieces: list[tuple[int, int, int, Loc | None]]



def _growth(loc: Loc | None, stop: int) -> tuple[int, int, int]:
    """What a write up to byte *stop* of a chunk at *loc* (into its DRAM copy if it has one,
    else into a new one) makes of it: its new length, the store's growth and the DRAM tier's
    (both paths check the same room). After the write the chunk is DRAM-only: its pages
    count until written back, and an NVMe copy it had is dead."""
    in_dram = loc is not None and loc.dram_slot >= 0
    old_len = loc.raw_len if in_dram else 0
    new_len = max(old_len, stop)
    before = 0 if loc is None else (
        (pages(loc.raw_len) if in_dram and not loc.seg else 0)
        + (loc.rec_len if loc.seg else 0))
    return new_len, pages(new_len) - before, pages(new_len) - pages(old_len)


class Writes:
    """Writes, truncations and holes punched (`write`, `plan_write`, `truncate`, `punch`)."""

    def __init__(self, store: ChunkStore, kernel_written: dict[int, int]) -> None:
        self.store = store
        self.meta = store.meta
        self.dram = store.dram
        self.chunks = store.chunks
        self.fetches = store.fetches
        self.counters = store.counters
        self.faults = store.faults
        self.cs = store.cs
        # The kernel-written files (kvfs/store/kernel_written.py): their DRAM file is the file.
        self.kernel_written = kernel_written

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
            loc = self.chunks.get(ino, c)
            if loc is not None and loc.flags & PACKED:
                self.store.drop_dram_copy((ino, c))  # clean: its bytes are raw on NVMe
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
            new_len, growth, dram_growth = _growth(loc, stop)
            self.store.check_capacity(growth, ino)
            if not over and self.store.dram_load + dram_growth > self.dram.capacity:
                over = await self.store.wait_dram(dram_growth)
                continue  # the world may have changed while we waited
            self._apply_write(ino, c, loc, start, piece, new_len, on_commit)
            return

    def plan_write(self, ino: int, off: int, size: int) -> WritePlan | None:
        """Prepare a write of *size* bytes at *off* into DRAM and return its plan, or None
        when the write needs the ordinary path (a chunk on NVMe only that it does not fully
        cover, a gap to zero-fill, a chunk being fetched, no room in DRAM without waiting,
        the filesystem full). Each chunk either starts in DRAM with this write or is written
        in place (it is in DRAM and the write starts within or right after its bytes: the
        next request of a stream). Its bytes go to the same offsets of the inode's DRAM file
        (`write_fd`). The caller copies the data and then calls finish_write or abort_write,
        with no await in between (the shim); a pod fetch awaits, on a file nothing else
        changes meanwhile (kvfs/podfiles.py, `_fetch_into_dram`)."""
        cs = self.cs
        pieces: list[tuple[int, int, int, Loc | None]] = []  # chunk, start, stop, location
        growth = dram_growth = 0
        pos, end = off, off + size
        while pos < end:
            c, start = divmod(pos, cs)
            stop = min(cs, end - c * cs)
            loc = self.chunks.get(ino, c)
            if (loc is not None and loc.flags & (LOST | PACKED | TAIL_LOST)
                    or self.fetches.busy((ino, c))):
                return None
            if loc is None or loc.dram_slot < 0:
                if start or (loc is not None and stop < loc.raw_len):
                    return None  # zero-fill, or a read-modify-write of an NVMe chunk
            elif start > loc.raw_len:
                return None  # a gap to zero-fill
            _, piece_growth, piece_dram_growth = _growth(loc, stop)
            growth += piece_growth
            dram_growth += piece_dram_growth
            pieces.append((c, start, stop, loc))
            pos = c * cs + stop
        try:
            self.store.check_capacity(growth, ino)
        except NoSpace:
            return None  # the ordinary path raises it (or, in cache mode, evicts)
        if self.store.dram_load + dram_growth > self.dram.capacity:
            return None
        unseal = [(c, loc) for c, _, _, loc in pieces
                  if loc is not None and loc.dram_slot >= 0 and loc.flags & SEALED]
        if unseal:  # in lmdb before the bytes change (crash safety, see the module doc)
            with self.meta.write() as txn:
                for c, loc in unseal:
                    self.chunks.replace(txn, ino, c, loc, loc._replace(flags=loc.flags & ~SEALED))
        planned = []
        for c, start, stop, _ in pieces:
            loc = self.chunks.get(ino, c)
            if loc is None or loc.dram_slot < 0:
                self.dram.claim(ino, c)
            else:
                self.dram.forget(ino, c)  # the shim writes it without DramFiles
            planned.append((c, start, stop, loc))
        return WritePlan(ino, planned)

    def write_fd(self, plan: WritePlan) -> int:
        """The file descriptor a planned write's bytes go to, at their own file offsets."""
        return self.dram.fd(plan.ino)

    def finish_write(self, plan: WritePlan, on_commit: Callable[[int], None] | None,
                     checksums: Mapping[int, int] | None = None) -> None:
        """The planned bytes are in their regions: commit them (one transaction, in which
        *on_commit(end)* runs, *end* being where they end). *checksums* (chunk -> xxh3)
        vouches for the bytes of chunks this write holds whole (from 0 to their new
        length): the caller hashed exactly the bytes it copied there (a pod fetch checked
        them against their records), so they are sealed in this commit and not hashed
        again."""
        if any(self.chunks.get(plan.ino, c) != loc for c, _, _, loc in plan.pieces):
            self.abort_write(plan)  # cannot happen: nothing runs between plan and finish
            raise RuntimeError(f"inode {plan.ino}: chunks changed during a write")
        news, sealed = [], []
        for c, start, stop, loc in plan.pieces:
            in_place = loc is not None and loc.dram_slot >= 0
            length = max(loc.raw_len, stop) if in_place else stop
            new = self._dram_loc(length)
            if checksums is not None and c in checksums:
                if start or length != stop:
                    self.abort_write(plan)
                    raise ValueError(f"inode {plan.ino} chunk {c}: a checksum for a chunk "
                                     f"the write does not hold whole")
                new = new._replace(flags=SEALED, checksum=checksums[c])
                sealed.append((c, new))
            news.append((c, loc, new))
        with self.meta.write() as txn:
            for c, loc, new in news:
                self.chunks.replace(txn, plan.ino, c, loc, new, kept=self._extent(plan.ino, c))
            if on_commit is not None:
                c, _, stop, _ = plan.pieces[-1]
                on_commit(c * self.cs + stop)
        for c, new in sealed:
            self.store.mark_checked(plan.ino, c, new)  # hashed from the bytes copied there
        self.counters.direct_writes += 1
        if self.store.dram_load > self.store.high_water:
            self.store.events.dram_filling()

    def _extent(self, ino: int, c: int) -> int:
        """How many bytes of chunk *c* lie inside the file now (0 if its size is unknown):
        before a change of them, what its shadow still holds for the file."""
        size = self.store.events.size_of(ino) or 0
        return min(self.cs, max(0, size - c * self.cs))

    def _dram_loc(self, length: int, whole=None) -> Loc:
        """The location of a chunk just written in DRAM (a new seq). A chunk made whole
        by one piece of data we hold (*whole*: all chunk_size bytes; it cannot grow any
        more) is sealed at once, hashing the bytes while they are in cache (the usual case
        for an engine's blocks); others are sealed at close, so that the next write of a
        stream does not have to unseal them first."""
        if whole is not None:
            return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, SEALED, hash_bytes(whole),
                       self.chunks.next_seq())
        return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, 0, 0, self.chunks.next_seq())

    def abort_write(self, plan: WritePlan) -> None:
        """The copy failed part way: regions new to DRAM go back (punched); chunks written
        in place may hold some new bytes (`_written_part`)."""
        for c, _, stop, loc in plan.pieces:
            if loc is None or loc.dram_slot < 0:
                self.dram.release(plan.ino, c, stop)
            else:
                now = self.chunks.get(plan.ino, c)
                if now is not None:
                    self._written_part(plan.ino, c, now)
        self.dram.settle()

    def _written_part(self, ino: int, c: int, loc: Loc) -> None:
        """A write into a DRAM chunk failed part way: its bytes may have changed, so it takes
        a new seq (unsealed, same length), and whatever landed past its end is punched (the
        region holds nothing there)."""
        self.dram.punch(ino, c * self.cs + loc.raw_len, self.cs - loc.raw_len)
        with self.meta.write() as txn:
            self.chunks.replace(txn, ino, c, loc,
                          loc._replace(flags=loc.flags & ~SEALED, seq=self.chunks.next_seq()))

    async def _make_resident(self, ino: int, c: int, loc: Loc) -> None:
        """Bring an NVMe-only chunk into DRAM (for a partial write); the caller re-checks."""
        over = await self.store.wait_dram(pages(loc.raw_len))
        now = self.chunks.get(ino, c)
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
                    self.chunks.replace(txn, ino, c, loc, unsealed)
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
            self.chunks.replace(txn, ino, c, loc, new, kept=self._extent(ino, c))
            if on_commit is not None:
                on_commit()
        if whole is not None:
            self.store.mark_checked(ino, c, new)  # hashed from the bytes just written there
        if self.store.dram_load > self.store.high_water:
            self.store.events.dram_filling()

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
        keep = self.chunks.nchunks(new_size)
        cut = new_size - (keep - 1) * cs if new_size else 0
        last = keep - 1 if 0 < cut < cs else None  # the chunk that is cut, if any
        while True:  # until nothing is left to wait for (each await lets others in)
            # a write may have grown it meanwhile
            end = max(old_size, self.store.events.size_of(ino) or 0)
            pending = self._fetch_of(ino, keep if last is None else last, self.chunks.nchunks(end))
            if pending is not None:
                await pending.wait()
                continue
            loc = self.chunks.get(ino, last) if last is not None else None
            if loc is not None and loc.raw_len > cut and not loc.flags & LOST:
                if loc.flags & PACKED:
                    self.store.drop_dram_copy((ino, last))
                    continue
                if loc.dram_slot < 0:
                    await self._make_resident(ino, last, loc)
                    continue
            break
        with self.meta.write() as txn:
            if self.chunks.allocated.get(ino, 0) > pages(new_size):
                # space past the new end is released
                self.chunks.set_allocated(ino, pages(new_size))
            for c in self.chunks.index.chunks_of(ino, self.chunks.nchunks(end)):
                if c >= keep:
                    self.chunks.replace(txn, ino, c, self.chunks.get(ino, c), None)
            if loc is not None and loc.raw_len > cut:
                # Its bytes up to *cut* stay; the DRAM file's cut below takes the rest (a
                # crash before that leaves them outside the region, punched at mount). New
                # seq, unsealed: sealed again at close, or at mount.
                new = (loc._replace(raw_len=cut) if loc.flags & LOST else
                       Loc(IN_DRAM, 0, 0, 0, cut, 0, CODEC_RAW, 0, 0, self.chunks.next_seq()))
                self.chunks.replace(txn, ino, last, loc, new, kept=cut)
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
        if ino in self.kernel_written:  # the kernel writes its DRAM file: that is the file
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
                loc = self.chunks.get(ino, c)
                if loc is None or loc.flags & LOST or loc.raw_len <= off - c * cs:
                    continue  # nothing there to zero (or nothing to be had)
                if loc.flags & PACKED:
                    self.store.drop_dram_copy((ino, c))
                    break
                if loc.dram_slot < 0:
                    await self._make_resident(ino, c, loc)
                    break
            else:
                break
        zero = []
        with self.meta.write() as txn:
            for c in self.chunks.index.chunks_of(ino, last + 1) if end > off else ():
                if c < first:
                    continue
                loc = self.chunks.get(ino, c)
                if c not in edges:
                    self.chunks.replace(txn, ino, c, loc, None)
                    continue
                start, stop = max(off - c * cs, 0), min(end - c * cs, loc.raw_len)
                if stop <= start or loc.flags & LOST:
                    continue
                self.chunks.replace(txn, ino, c, loc, Loc(IN_DRAM, 0, 0, 0, loc.raw_len, 0,
                                                    CODEC_RAW, loc.flags & TAIL_LOST, 0,
                                                    self.chunks.next_seq()),
                                    kept=self._extent(ino, c))
                zero.append((c * cs + start, stop - start))
            if on_commit is not None:
                on_commit()
        for start, n in zero:
            self.dram.punch(ino, start, n)
        if ino in self.chunks.allocated:  # the room fallocate promised there is given back
            self.chunks.set_allocated(ino, max(self.chunks.file_bytes.get(ino, 0),
                                         self.chunks.allocated[ino] - (end - off)))

    def _fetch_of(self, ino: int, start: int, stop: int) -> trio.Event | None:
        """The end of a fetch of one of *ino*'s chunks *start*..*stop*-1, if one is on."""
        for c in self.chunks.index.chunks_of(ino, stop):
            if c >= start and (done := self.fetches.pending((ino, c))) is not None:
                return done
        return None
