"""The chunk map: every chunk's location (`Loc`) in the Cython index and lmdb's `chunks`
table, the shadows of chunks written over in DRAM, and the bookkeeping every location change
keeps exact (per-tier bytes and chunks, st_blocks per file, fallocate reservations, the DRAM
policy's membership, the dirty chunks' ages).

Every change of a chunk's location goes through `replace`, inside the caller's lmdb
transaction; the copies the old location named are released after the commit
(MetaStore.after_commit, invariant 4). The map reaches nothing above it: what the store's
other rooms must hear of a change comes through the callbacks given to the constructor.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvfs._index import ChunkIndex
from kvfs.store.dram import DramFiles, pages
from kvfs.store.location import HOLE, LOC, PACKED, U32, Loc, nvme_only, slot_len
from kvfs.store.meta import MetaStore, key2, u64
from kvfs.store.nvme import NvmeLog


class ChunkMap:
    """Locations and their accounting (bytes, kept exact by `account` on every change)."""

    def __init__(self, meta: MetaStore, dram: DramFiles, nvme: NvmeLog, policy, *,
                 chunk_size: int, changing: Callable[[int, int], None],
                 dropped: Callable[[tuple[int, int]], None]) -> None:
        self.meta = meta
        self.dram = dram
        self.nvme = nvme
        self.policy = policy
        self.cs = chunk_size
        # changing(ino, c): before any change of a chunk's location (bytes read ahead of
        # it may be old now); dropped(key): its DRAM copy is gone.
        self._changing = changing
        self._dropped = dropped
        self.index = ChunkIndex(1 << 16)
        self.seq = 0
        self.dram_used = 0  # pages of chunk data in DRAM
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
        # ... and the hole ranges it covered, per chunk (a hull: [lo, hi)), so that a range
        # reserved again takes nothing more. In memory: a remount forgets them (a repeated
        # fallocate then reserves again), and any shrinking of the allocation drops them.
        self.allocated_holes: dict[int, dict[int, tuple[int, int]]] = {}
        self.reserved = 0  # sum of reservation(ino): promised room not yet written
        # Chunks written over in DRAM -> the NVMe-only location of their last written-back
        # bytes, until the new ones are written back (`shadow`).
        self.shadows: dict[tuple[int, int], Loc] = {}
        self.shadow_kept: dict[tuple[int, int], int] = {}  # ... its bytes still the file's

    def nchunks(self, size: int) -> int:
        return (size + self.cs - 1) // self.cs

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def account(self, ino: int, old: Loc | None, new: Loc | None) -> None:
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

    def store_loc(self, txn, ino: int, c: int, loc: Loc | None) -> None:
        self._changing(ino, c)  # before any change: bytes read ahead may be old now
        if loc is None:
            txn.delete(key2(ino, c), db=self.meta.db["chunks"])
            self.index.pop(ino, c)
        else:
            txn.put(key2(ino, c), LOC.pack(*loc), db=self.meta.db["chunks"])
            self.index.set(ino, c, tuple(loc))

    def replace(self, txn, ino: int, c: int, old: Loc | None, new: Loc | None,
                kept: int | None = None) -> None:
        """Swap a chunk's location; copies the new one no longer names are released after
        the commit. *kept*, for a change of bytes: how many of the chunk's bytes before
        it are still the file's after it (a write's or a punch's chunk extent before it;
        a truncation's cut), for the shadow it may leave (`shadow`); None for a change of
        no byte (sealing, unsealing, a write-back, a drop), which leaves a shadow as it
        is."""
        self.account(ino, old, new)
        self.store_loc(txn, ino, c, new)
        key = (ino, c)
        if old is not None and old.dram_slot >= 0 and (new is None or
                                                       new.dram_slot != old.dram_slot):
            self.policy.removed(key)
            self.dirty_since.pop(key, None)
            self._dropped(key)
            length = slot_len(old)
            self.meta.after_commit(lambda: self.dram.release(ino, c, length))
        if old is not None and old.seg and (new is None or (new.seg, new.off) !=
                                            (old.seg, old.off)):
            if new is not None and not new.seg and key not in self.shadows:
                # written over: kept until written back
                self.shadow(txn, key, nvme_only(old), kept or 0)
            else:
                seg, rec_len = old.seg, old.rec_len
                self.meta.after_commit(lambda: self.nvme.mark_dead(seg, rec_len))
        elif old is None and new is not None and not new.seg and kept and key not in self.shadows:
            self.shadow(txn, key, HOLE, kept)  # written into a hole inside the file
        if key in self.shadows and (new is None or new.seg):
            self.unshadow(txn, key)  # the new bytes are on NVMe (or the chunk is gone)
        elif key in self.shadows and kept is not None and kept < self.shadow_kept[key]:
            self.shadow(txn, key, self.shadows[key], kept)
        if new is not None and new.dram_slot >= 0:
            if old is None or old.dram_slot != new.dram_slot:
                self.policy.inserted(key)
            if not new.seg:
                self.dirty_since.setdefault(key, time.monotonic())
            else:
                self.dirty_since.pop(key, None)

    def shadow(self, txn, key: tuple[int, int], loc: Loc, kept: int) -> None:
        """A chunk's NVMe record (*loc*), or the hole it was (HOLE), is written over in DRAM,
        and its first *kept* bytes (zeros past the record's end) are still the file's: keep
        it, in lmdb's `shadows`, until the new bytes are written back. An fsync may have
        made those bytes durable, and a DRAM tier lost before that writeback must take the
        chunk back to them, not lose them (kvfs/store/recovery.py). Bytes the file gained
        past *kept* since (appended, or after a cut) were only in DRAM: lost then."""
        if key not in self.shadows:
            self.nvme_live += loc.rec_len
        self.shadows[key] = loc
        self.shadow_kept[key] = kept
        txn.put(key2(*key), LOC.pack(*loc) + U32.pack(kept), db=self.meta.db["shadows"])

    def unshadow(self, txn, key: tuple[int, int]) -> None:
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
                self.replace(txn, ino, c, now, now._replace(seg=seg, off=off, rec_len=rec_len))
        elif shadow is not None and (shadow.seg, shadow.off, shadow.seq) == (
                old.seg, old.off, old.seq):
            with self.meta.write() as txn:
                kept = self.shadow_kept.get((ino, c), 0)
                self.unshadow(txn, (ino, c))
                self.shadow(txn, (ino, c), shadow._replace(seg=seg, off=off, rec_len=rec_len),
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

    def reservation(self, ino: int) -> int:
        """Bytes fallocate() promised a file beyond what it stores now."""
        return max(0, self.allocated.get(ino, 0) - self.file_bytes.get(ino, 0))

    def blocks_bytes(self, ino: int) -> int:
        """What the file occupies for st_blocks: stored bytes, or its allocation if larger."""
        return max(self.file_bytes.get(ino, 0), self.allocated.get(ino, 0))

    def set_allocated(self, ino: int, value: int, holes: dict | None = None) -> None:
        """The file may occupy *value* bytes; *holes*: the hole ranges that fallocate
        reserved are these now (None: forget them, the allocation shrank or went)."""
        if holes is None:
            self.allocated_holes.pop(ino, None)
        else:
            self.allocated_holes[ino] = holes
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

