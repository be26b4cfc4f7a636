"""Write-back: dirty DRAM chunks compressed and written to the NVMe log, and committed.

`writeback_many` takes a batch: one worker hand-off compresses every chunk of it (the file's
codec chosen on the way, kvfs/store/choices.py), records are reserved one after another in
the segment of each chunk's placement stream and written in one go, and one transaction
commits them. A chunk whose bytes changed meanwhile (its seq moved) is not committed: its
record is marked dead and the chunk stays dirty. A record is written only with the checksum
of its own bytes, and a sealed chunk whose bytes do not match its checksum is not written
back at all. Failures are episodes (kvfs/store/episode.py): the NVMe tier full, or failing.
Also fsync and the unmount's write-back of everything. docs/DESIGN.md, Concurrency protocol.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from kvfs.nursery import open_nursery
from kvfs.store.choices import ChoiceMemory
from kvfs.store.codec import CODEC_RAW
from kvfs.store.dram import DramFile, pages
from kvfs.store.episode import Episode
from kvfs.store.location import (
    IN_DRAM,
    PACKED,
    SEALED,
    TAIL_LOST,
    Loc,
    NoSpace,
    hash_bytes,
    nvme_only,
)
from kvfs.store.nvme import NvmeFull, RecordHeader, record_length

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)

# A writeback batch (see ChunkStore.writeback_many) holds WRITEBACK_BATCH full chunks' worth
# of DRAM bytes: 4 x 256 KiB..1 MiB keep a worker busy ~1-2 ms, about the lead a write
# waiting for room can afford. Small chunks (small files) fill a batch up to
# WRITEBACK_BATCH_MAX: per chunk, a batch's two worker hand-offs and its commit cost the trio
# thread more than the chunk's own bookkeeping, and its records go to disk in one write.
WRITEBACK_BATCH = 4
WRITEBACK_BATCH_MAX = 32


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
    info: bytes = b""  # the file's description (kvfs/store/fileinfo.py), after the payload
    full: bool = False
    rec_len: int = 0
    seg: object = None
    off: int = 0
    mismatch: bool = False  # sealed, and the bytes read did not match the checksum


class WriteBack:
    """Attributes:
        choices    the codecs directories' files have been getting
        nvme_full, nvme_failing   episodes of writing back failing for want of room, or I/O
    """

    def __init__(self, store: ChunkStore, *, chunk_size: int, nvme_dir: str) -> None:
        self.store = store
        self.cs = chunk_size
        self._file_codec: dict[int, int] = {}  # a file's codec, once chosen
        # Files whose codec a writeback is choosing now: their other chunks wait for the
        # choice instead of each making it again (the demoter writes several at once).
        self._choosing: dict[int, trio.Event] = {}
        self.choices = ChoiceMemory()
        self.nvme_full = Episode(f"NVMe tier {nvme_dir} full")
        self.nvme_failing = Episode(f"NVMe tier {nvme_dir}: writing back fails")

    def forget(self, ino: int) -> None:
        """The file is gone."""
        self._file_codec.pop(ino, None)

    def batch_full(self, chunks: int, nbytes: int) -> bool:
        """Is a writeback batch of *chunks* chunks holding *nbytes* of DRAM full?"""
        return chunks >= WRITEBACK_BATCH_MAX or nbytes >= WRITEBACK_BATCH * self.cs

    def writeback_batches(self, keys: list[tuple[int, int]]) -> Iterator[list[tuple[int, int]]]:
        """*keys* cut into writeback batches, in order."""
        batch: list[tuple[int, int]] = []
        nbytes = 0
        for key in keys:
            batch.append(key)
            nbytes += self.store.dram_pages(key)
            if self.batch_full(len(batch), nbytes):
                yield batch
                batch, nbytes = [], 0
        if batch:
            yield batch

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
            loc = self.store.get(ino, c)
            if loc is None or loc.dram_slot < 0:
                continue
            if loc.seg:
                if drop:
                    self.store.drop_dram_copy((ino, c))
                continue
            job = _Job(i, ino, c, loc, self.store.dram.hold(ino), self.store.events.stream_of(ino),
                       self._file_codec.get(ino))
            if job.codec_id is None and ino not in choosing:
                # the hint is looked up here: the namespace belongs to the trio thread
                job.hint, job.directory = self.store.events.codec_context(ino)
                job.expected = self.choices.expected(job.directory) if job.hint is None else None
                job.chooses = True
                choosing[ino] = self._choosing[ino] = trio.Event()
            jobs.append(job)
        if not jobs:
            return done
        infos = {ino: self.store.events.file_info(ino) for ino in {job.ino for job in jobs}}
        for job in jobs:
            job.info = infos[job.ino]
        try:
            done = await self._writeback_jobs(jobs, choosing, done, drop=drop, pack=pack)
        except NoSpace:
            self.nvme_full.failed(
                f"the filesystem under {self.store.nvme.directory} has "
                f"{self.store.nvme.room() >> 20} MiB free: dirty data stays in DRAM, and writes "
                f"that need room get ENOSPC until space is freed (remove files here, or "
                f"free space on that filesystem)")
            raise
        except OSError as exc:
            self.nvme_failing.failed(f"{exc}: dirty data stays in DRAM")
            raise
        finally:
            for job in jobs:
                self.store.dram.drop(job.held)
        self.nvme_full.over()
        self.nvme_failing.over()
        return done

    async def _writeback_jobs(self, jobs: list[_Job], choosing: dict[int, trio.Event],
                              done: list[bool], *, drop: bool, pack: bool) -> list[bool]:
        try:
            await trio.to_thread.run_sync(self._encode_jobs, jobs, limiter=self.store.limiter)
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
                if job.mismatch and job.ino in self.store.kernel_written:
                    # the kernel writes the file (an adopted one: `adopt_kernel_write`); its next
                    # take records the bytes it holds then
                    done[job.i] = False
                    continue
                if job.mismatch:  # the bytes read are not the ones sealed, and no write says why
                    log.error("inode %d chunk %d: its DRAM copy does not match its checksum; "
                              "not written back", job.ino, job.c)
                    self.store.counters.checksum_errors += 1
                    done[job.i] = False
                    continue
                job.rec_len = record_length(len(job.payload), len(job.info))
                job.seg, job.off = await self._reserve(job.stream, job.rec_len)
                job.stream = job.seg.stream  # (another's, when the tier is nearly full)
                todo.append(job)
            if todo:
                await trio.to_thread.run_sync(self._write_jobs, todo, limiter=self.store.limiter)
        except BaseException as exc:
            for job in todo:
                self.store.nvme.mark_dead(job.seg.seg_id, job.rec_len)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.store.nvme.room_changed()  # (a filesystem that cannot preallocate segments)
                raise NoSpace() from exc
            raise
        if drop or (pack and self.store.dram_compress):
            for ino in {job.ino for job in todo}:
                self.store.events.changing(ino)  # front-thread opens: pins now
        packing: list[_Job] = []
        with self.store.meta.write() as txn:
            for job in todo:
                self.store.nvme.bytes_written += job.rec_len
                self.store.counters.user_bytes_written += job.rec_len  # user data, any stream
                self.store.nvme.counters(job.stream).user_bytes += job.rec_len
                now = self.store.get(job.ino, job.c)
                if not self._still_dirty(job):
                    self.store.nvme.mark_dead(job.seg.seg_id, job.rec_len)
                    done[job.i] = False
                    continue
                keep = not drop or job.ino in self.store.dram.pins
                new = Loc(IN_DRAM if keep else -1, job.seg.seg_id, job.off, job.rec_len,
                          now.raw_len, len(job.payload), job.used,
                          SEALED | now.flags & TAIL_LOST, job.csum, now.seq)
                self.store.chunks.replace(txn, job.ino, job.c, now, new)
                self.store.counters.writebacks += 1
                if not keep:
                    self.store.counters.demotions += 1
                elif pack and self._packable(job.ino, new):
                    packing.append(job)
        for job in packing:
            self._repack(job.ino, job.c, job.payload)
        return done

    def _still_dirty(self, job: _Job) -> bool:
        """Is the job's chunk still the dirty DRAM copy it read (same seq, no NVMe copy)? A
        chunk written back by another task meanwhile may have been dropped and staged again
        in the same region: what the worker read there is then not to be trusted."""
        now = self.store.get(job.ino, job.c)
        return (now is not None and now.seq == job.loc.seq and now.dram_slot >= 0
                and not now.seg)

    def _packable(self, ino: int, loc: Loc) -> bool:
        """Should this clean raw DRAM copy be kept packed instead (dram_compress: it saves
        pages; never in a file the kernel reads directly)?"""
        store = self.store
        return (store.dram_compress and loc.codec != CODEC_RAW and ino not in store.dram.pins
                and pages(loc.stored_len) < pages(loc.raw_len))

    def _repack(self, ino: int, c: int, payload) -> None:
        """Replace a clean raw DRAM copy with its record's *payload* (packed), in two commits
        around the rewrite of the region (its raw bytes first give way to NVMe, so that no
        crash leaves the region holding other bytes than lmdb says). Synchronous."""
        loc = self.store.get(ino, c)
        if loc is None or loc.dram_slot < 0 or loc.flags & PACKED or not loc.seg:
            return
        with self.store.meta.write() as txn:
            self.store.chunks.replace(txn, ino, c, loc, nvme_only(loc))
        self.store.dram.claim(ino, c)
        try:
            self.store.dram.write(ino, c, 0, payload)
        except OSError as exc:
            log.warning("DRAM tier: cannot keep a packed copy (%s)", exc)
            self.store.dram.release(ino, c, len(payload))
            self.store.dram.settle()
            return
        with self.store.meta.write() as txn:
            self.store.chunks.replace(txn, ino, c, nvme_only(loc),
                          loc._replace(dram_slot=IN_DRAM, flags=loc.flags | PACKED))

    def _encode_jobs(self, jobs: list[_Job]) -> None:
        """Worker thread: `_encode` each job (its bytes read from its region); a file's later
        chunks take the codec its first one chose."""
        chosen: dict[int, int] = {}
        for job in jobs:
            data = bytearray(job.loc.raw_len)  # the payload of a raw record: not reused
            self.store.dram.read_region(job.held.fd, job.c * self.cs, data)
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
        self.store.nvme.write_records(run[0].seg, run[0].off, [
            (RecordHeader(job.used, job.stream, job.ino, job.c, job.loc.seq, job.loc.raw_len,
                          len(job.payload), job.csum, len(job.info)), job.payload, job.info)
            for job in run])

    async def _reserve(self, stream: int, rec_len: int):
        """Space for one record; cleans segments if none is free."""
        while True:
            try:
                return self.store.nvme.reserve(stream, rec_len)
            except NvmeFull:
                if not await self.store.events.make_nvme_room():
                    raise NoSpace() from None

    def _encode(self, data: bytearray, loc: Loc, codec_id: int | None, hint: str | None,
                expected: int | None):
        """Worker thread: checksum and compress one chunk (*data*, a copy of its bytes that
        nobody else holds); without a codec choice for the file yet, take
        *expected* (its directory's) if the chunk confirms it, else make one (from *hint*
        and the chunk). Returns the file's codec choice, whether that was a full choice, and
        the codec this chunk was really stored with (raw when it did not compress)."""
        view = memoryview(data)
        csum = hash_bytes(view)  # a record is written only with the checksum of its own bytes
        full = False
        if codec_id is None:
            sample = view[:65536]
            if expected is not None and self.store.codec.confirms(sample, expected):
                codec_id = expected
            else:
                codec_id, full = self.store.codec.choose(sample, hint), True
        used, payload = self.store.codec.encode(view, codec_id)  # may fall back to raw
        if used == CODEC_RAW:
            payload = data
        return csum, codec_id, used, payload, full

    async def fsync(self, ino: int, size: int) -> None:
        """Make a file's data durable on NVMe (its DRAM copies stay, clean)."""
        for _attempt in range(100):
            dirty = [c for c in self.store.index.chunks_of(ino, self.store.nchunks(size))
                     if not self.store.is_clean((ino, c))]
            if not dirty:
                break
            async with open_nursery() as nursery:
                for c in dirty:
                    nursery.start_soon(partial(self.writeback, (ino, c), drop=False,
                                               pack=True))
        await self.sync()

    async def sync(self) -> None:
        await trio.to_thread.run_sync(self._sync_all, limiter=self.store.limiter)

    def _sync_all(self) -> None:
        self.store.nvme.sync()
        self.store.meta.sync()

    async def writeback_all(self) -> int:
        """Write every dirty chunk to NVMe and make it durable (clean unmount). Returns the
        bytes left only in DRAM: 0, unless writing back failed (the tier full, its disk
        failing; the store logs the episode)."""
        keys = list(self.store.dirty_since)
        async with open_nursery() as nursery:
            limiter = trio.Semaphore(2)
            for batch in self.writeback_batches(keys):
                await limiter.acquire()
                nursery.start_soon(self._writeback_release, batch, limiter)
        try:
            await self.sync()
        except OSError as exc:
            log.error("unmount: making the NVMe tier durable failed: %s", exc)
            return self.store.dram_used
        return self.store.unbacked

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
