"""Scrub: check every copy of a file's chunks against the chunk's checksum (kvfsctl scrub),
and with repair, drop the damaged copies that have a good one beside them and mark lost
the chunks that have none.

A chunk's NVMe record is read, decoded and hashed as a read would (`Fetches.read_record`);
its DRAM copy is hashed (a packed one decoded first). A DRAM copy that is not sealed (its
file is being written: no checksum covers its bytes yet) cannot be checked and is counted
as such. Each copy is checked in a worker thread, one at a time, so that a scrub takes one
of the store's I/O threads and the trio thread only between chunks: the mount stays usable.
A chunk that changes while it is checked is not judged (its new bytes have a new checksum).

Repairs never invent bytes: a damaged copy goes only when another copy checked out just
now; a chunk with no good copy becomes LOST (reads fail with EIO, as they did).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import trio

from kvfs.store.codec import CODEC_RAW, CodecError
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
    nvme_only,
)

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class Damage:
    """One damaged copy of a chunk (tier "dram" or "nvme"), or a chunk already lost (tier
    "none"), and what a repair did about it: "dropped" (the copy; a good one is left),
    "lost" (no good copy was left: reads give EIO), "left" (nothing could be done now),
    or None (no repair asked)."""
    chunk: int
    tier: str
    error: str
    repair: str | None = None


@dataclass
class ScrubPage:
    damage: list[Damage]
    checked: int  # copies checked
    unchecked: int  # DRAM copies no checksum covers yet (being written)
    next: int | None  # the chunk to go on from, or None when the file is done

    def as_dict(self) -> dict:
        return {"damage": [asdict(d) for d in self.damage], "checked": self.checked,
                "unchecked": self.unchecked, "next": self.next}


class Scrub:
    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.chunks = store.chunks
        self.dram = store.dram
        self.limiter = trio.CapacityLimiter(1)  # one copy at a time (and one I/O thread)
        self.damaged_copies = 0  # found since mount (status: scrub.damaged_copies)
        self.checked_copies = 0

    async def page(self, ino: int, size: int, start: int, count: int,
                   repair: bool) -> ScrubPage:
        """Check the copies of *count* chunks of file *ino* from chunk *start* on."""
        todo = [c for c in self.chunks.index.chunks_of(ino, self.chunks.nchunks(size))
                if c >= start]
        out = ScrubPage([], 0, 0, todo[count] if len(todo) > count else None)
        for c in todo[:count]:
            await self._chunk(ino, c, repair, out)
        return out

    async def _chunk(self, ino: int, c: int, repair: bool, out: ScrubPage) -> None:
        loc = self.chunks.get(ino, c)
        if loc is None:
            return  # truncated meanwhile
        if loc.flags & LOST:
            out.damage.append(Damage(c, "none", "lost: no copy is left (reads give EIO)"))
            return
        dram_error = nvme_error = None
        before = out.checked
        dram_ok = nvme_ok = False
        claim = self.dram.claim_ids.get((ino, c))
        if loc.dram_slot >= 0:
            if loc.flags & (SEALED | PACKED):
                dram_error = await self._check_dram(ino, c, loc)
                dram_ok = dram_error is None
                out.checked += 1
            else:
                out.unchecked += 1
        if loc.seg:
            nvme_error = await self._check_nvme(ino, c, loc)
            nvme_ok = nvme_error is None
            out.checked += 1
        self.checked_copies += out.checked - before
        if self.chunks.get(ino, c) != loc or self.dram.claim_ids.get((ino, c)) != claim:
            return  # changed meanwhile: a failed check may be of bytes that were replaced
        found = [Damage(c, tier, error) for tier, error in (("dram", dram_error),
                                                            ("nvme", nvme_error)) if error]
        if not found:
            return
        self.damaged_copies += len(found)
        self.store.counters.checksum_errors += dram_error is not None  # (read_record counts)
        for d in found:
            log.error("scrub: inode %d chunk %d: %s copy: %s", ino, c, d.tier, d.error)
        if repair:
            what = await self._repair(ino, c, loc, dram_ok, nvme_ok)
            for d in found:
                d.repair = what
        out.damage.extend(found)

    async def _check_dram(self, ino: int, c: int, loc: Loc) -> str | None:
        held = self.dram.hold(ino)
        try:
            return await trio.to_thread.run_sync(self._hash_region, held.fd, c, loc,
                                                 limiter=self.limiter)
        finally:
            self.dram.drop(held)

    def _hash_region(self, fd: int, c: int, loc: Loc) -> str | None:
        """Worker thread: what is wrong with the DRAM copy of *loc*, or None."""
        packed = bool(loc.flags & PACKED)
        buf = bytearray(loc.stored_len if packed else loc.raw_len)
        try:
            self.dram.read_region(fd, c * self.store.cs, buf)
        except OSError as exc:
            return f"cannot read: {exc}"
        data: bytes | bytearray = buf
        if packed:
            try:
                data = self.store.codec.decode(loc.codec, buf, loc.raw_len)
            except CodecError as exc:
                return f"cannot decode (packed): {exc}"
        if len(data) != loc.raw_len or hash_bytes(data) != loc.checksum:
            return "checksum mismatch" + (" (packed)" if packed else "")
        return None

    async def _check_nvme(self, ino: int, c: int, loc: Loc) -> str | None:
        nvme = self.store.nvme
        if loc.seg not in nvme.segments:
            return f"segment {loc.seg} is missing"
        seg = nvme.pin(loc.seg)
        try:
            await trio.to_thread.run_sync(self.store.fetches.read_record, ino, c, loc, seg,
                                          None, limiter=self.limiter)
        except ChunkError as exc:
            return str(exc).split(": ", 1)[-1]  # (without "inode I chunk C")
        finally:
            nvme.unpin(seg)
        return None

    async def _repair(self, ino: int, c: int, loc: Loc, dram_ok: bool, nvme_ok: bool) -> str:
        """Drop the damaged copy of a chunk whose other copy checked out, or mark it lost
        when none did; what was done (see Damage)."""
        if dram_ok and loc.flags & PACKED:
            return "left"  # a packed copy is the damaged record's payload: not a dirty copy
        if (loc.dram_slot >= 0 and not dram_ok and ino in self.dram.pins
                or ino in self.store.kernel_written):
            return "left"  # the kernel reads (or writes) its DRAM file itself
        with self.store.meta.write() as txn:
            if nvme_ok:
                self.chunks.replace(txn, ino, c, loc, nvme_only(loc))
                return "dropped"
            if dram_ok:
                # The good DRAM copy is the chunk's only one now: dirty, written back below
                # (a new seq, so that no record of the damaged one is ever taken for it).
                dirty = Loc(IN_DRAM, 0, 0, 0, loc.raw_len, 0, CODEC_RAW,
                            SEALED | loc.flags & TAIL_LOST, loc.checksum, self.chunks.next_seq())
                self.chunks.replace(txn, ino, c, loc, dirty)
            else:
                self.chunks.replace(txn, ino, c, loc, None)
                self.chunks.replace(txn, ino, c, None,
                                    Loc(-1, 0, 0, 0, loc.raw_len, 0, CODEC_RAW, LOST, 0,
                                        self.chunks.next_seq()))
                return "lost"
        try:
            await self.store.writeback((ino, c), drop=False)
        except (NoSpace, OSError) as exc:  # it stays dirty: the demoter writes it back later
            log.warning("scrub: inode %d chunk %d: writing the good DRAM copy back: %s",
                        ino, c, exc)
        return "dropped"
