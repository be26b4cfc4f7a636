"""What a mount does to load the chunk map from lmdb and repair it, once, before anything
else runs: the DRAM tier lost (a reboot) or some of its files missing, NVMe segments missing,
files the kernel was writing when the daemon stopped (their DRAM files are newer than
anything recorded), chunks caught unsealed by a crash, the shadows of chunks written over in
DRAM (a chunk whose DRAM copy was lost goes back to the bytes last written back, which an
fsync may have promised), and the move of a format 1-2 store's DRAM arena into per-inode
files. docs/FORMAT.md says what each table holds.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from collections.abc import Callable

from kvfs.store.chunkmap import ChunkMap
from kvfs.store.codec import CODEC_RAW, Codec, CodecError
from kvfs.store.dram import DramFiles
from kvfs.store.location import (
    IN_DRAM,
    LOC,
    LOST,
    PACKED,
    SEALED,
    TAIL_LOST,
    U32,
    ChunkError,
    Loc,
    hash_bytes,
    nvme_only,
    parse_loc,
    slot_len,
)
from kvfs.store.meta import FORMAT_VERSION, MetaStore, from_key2, from_u64, key2
from kvfs.store.nvme import NvmeLog, RecordError

log = logging.getLogger(__name__)


class Recovery:
    """Run once, from ChunkStore's constructor (`run`)."""

    def __init__(self, meta: MetaStore, chunks: ChunkMap, dram: DramFiles, nvme: NvmeLog,
                 policy, codec: Codec, *, chunk_size: int, read_record: Callable) -> None:
        self.meta = meta
        self.chunks = chunks
        self.dram = dram
        self.nvme = nvme
        self.policy = policy
        self.codec = codec
        self.cs = chunk_size
        # read_record(ino, c, loc, segment, None): a record's checked bytes (kvfs.store.fetch)
        self._read_record = read_record
        self.recovered_sizes: dict[int, tuple[int, bool]] = {}
        self._buf = bytearray(chunk_size)

    def _region(self, ino: int, c: int, length: int) -> memoryview:
        """The first *length* bytes of region (ino, c), valid until the next call."""
        view = memoryview(self._buf)[:length]
        self.dram.read_into(ino, c, view)
        return view

    def run(self) -> dict[int, tuple[int, bool]]:
        """Load the chunk map from lmdb and repair it; returns the sizes of the files the
        kernel was writing when the daemon stopped (ino -> (size, holes))."""
        with self.meta.env.begin() as txn:
            self.chunks.seq = self.meta.counter(txn, b"next_seq", 1)
        for ino, n in self.meta.load("alloc", lambda k, v: (from_u64(k), from_u64(v))):
            self.chunks.allocated[ino] = n
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
            self.chunks.seq = max(self.chunks.seq, loc.seq + 1)
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
            self.chunks.index.set(ino, c, tuple(loc))
            self.chunks.account(ino, None, loc)
            if loc.dram_slot >= 0:
                self.policy.inserted((ino, c))
                if not loc.seg:
                    self.chunks.dirty_since[(ino, c)] = time.monotonic()
            if loc.seg:
                self.nvme.segments[loc.seg].live_bytes += loc.rec_len
        for ino in sorted(restream):
            self._restream(ino, owned, fixes)
        stale_shadows = self._load_shadows(fixes, owned)
        self.chunks.reserved = sum(self.chunks.reservation(ino) for ino in self.chunks.allocated)
        self.dram.adopt(owned)
        # Chunks caught mid-write by a crash were never sealed: seal what is there now.
        with self.meta.write() as txn:
            # With the fixes: a migrated store must never be migrated again (slots are gone).
            self.meta.set_format(txn, FORMAT_VERSION)
            txn.drop(self.meta.db["writers"], delete=False)
            for ino, c, loc in fixes:
                self.chunks.store_loc(txn, ino, c, loc)
            for key in stale_shadows:
                txn.delete(key2(*key), db=self.meta.db["shadows"])
            for ino, c, loc in self.chunks.index.items():
                loc = Loc._make(loc)
                if loc.dram_slot >= 0 and not loc.flags & SEALED:
                    csum = hash_bytes(self._region(ino, c, loc.raw_len))
                    sealed = loc._replace(flags=loc.flags | SEALED, checksum=csum)
                    self.chunks.store_loc(txn, ino, c, sealed)
        if arena is not None:
            self.meta.sync()
            arena.close()
            os.unlink(self.dram.arena_path)
            log.info("DRAM tier: moved from the arena file to one file per inode")
        for seg in list(self.nvme.segments.values()):
            self.nvme.delete_if_unused(seg)
        return self.recovered_sizes

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
            now = self.chunks.get(*key)
            segment = self.nvme.segments.get(shadow.seg)  # (None for HOLE)
            if (now is None or now.seg or (shadow.seg and segment is None)
                    or not (now.dram_slot >= 0 or now.flags & LOST)):
                stale.append(key)  # written back meanwhile, gone, or its segment is
                continue
            if segment is not None:
                segment.live_bytes += shadow.rec_len
            if now.dram_slot >= 0:
                self.chunks.shadows[key] = shadow
                self.chunks.shadow_kept[key] = kept
                self.chunks.nvme_live += shadow.rec_len
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
                self.chunks.shadows[key] = shadow
                self.chunks.shadow_kept[key] = kept
                self.chunks.nvme_live += shadow.rec_len
                owned.setdefault(key[0], []).append((key[1], back.raw_len))
                self.policy.inserted(key)
                self.chunks.dirty_since[key] = time.monotonic()
            else:
                if back.seg != shadow.seg and segment is not None:
                    segment.live_bytes -= shadow.rec_len  # (nothing names it any more)
                stale.append(key)
            self.chunks.index.set(*key, tuple(back))
            self.chunks.account(key[0], now, back)
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
            return Loc(-1, 0, 0, 0, length, 0, CODEC_RAW, LOST, 0, self.chunks.next_seq())
        return Loc(IN_DRAM, 0, 0, 0, length, 0, CODEC_RAW, TAIL_LOST if tail_lost else 0, 0,
                   self.chunks.next_seq())

    def _restream(self, ino: int, owned: dict[int, list[tuple[int, int]]], fixes) -> None:
        """At mount: a file the kernel was writing (passthrough) takes what its DRAM file
        holds, as `KernelWritten.take` would have at its close: dirty chunks, sealed below with the
        other unsealed ones. Its size goes to the namespace through `recovered_sizes`."""
        if self.dram.missing(ino):
            log.error("inode %d was being written when the daemon stopped and its DRAM file "
                      "is gone: what was written to it since its last fsync is lost", ino)
            return
        size = self.dram.size(ino)
        data = self.dram.data_chunks(ino)
        self.recovered_sizes[ino] = size, len(data) < self.chunks.nchunks(size)
        for c in data:
            loc = Loc(IN_DRAM, 0, 0, 0, min(self.cs, size - c * self.cs), 0, CODEC_RAW, 0, 0,
                      self.chunks.next_seq())
            fixes.append((ino, c, loc))
            owned.setdefault(ino, []).append((c, loc.raw_len))
            self.chunks.index.set(ino, c, tuple(loc))
            self.chunks.account(ino, None, loc)
            self.policy.inserted((ino, c))
            self.chunks.dirty_since[(ino, c)] = time.monotonic()
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
            data = self.codec.decode(loc.codec, self._region(ino, c, loc.stored_len),
                                     loc.raw_len)
            if len(data) != loc.raw_len or hash_bytes(data) != loc.checksum:
                raise CodecError("checksum mismatch")
            self.dram.write(ino, c, 0, data)
        except (CodecError, OSError) as exc:
            log.error("inode %d chunk %d: packed DRAM copy unusable (%s)", ino, c, exc)
            return loc
        log.warning("inode %d chunk %d: kept from its packed DRAM copy", ino, c)
        return loc._replace(flags=loc.flags & TAIL_LOST | SEALED)
