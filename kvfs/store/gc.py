"""Segment cleaning: reclaim NVMe segments whose records have mostly died.

A victim segment is scanned record by record; a record is live if the index still names
exactly that (segment, offset, seq). Live records are copied, payload as stored (no
recompression), to the open segment of the GC stream (kvfs/store/streams.py: `gc` for records
found in user segments, `cold` for records relocated a second time when there is such a
stream; with streams=1 the one shared log). Each new location is committed before the old
record is marked dead (invariant 4). The victim is *held* for the whole pass: even when its
last record dies it is not unlinked until the copies are durable (fdatasync of the
destination segments and their directory, then an lmdb sync), so neither a crash of the
daemon nor of the machine in the middle of a pass can leave a chunk pointing at nothing.
Unlinking a segment file lets the filesystem discard (TRIM) its blocks.

Victims are chosen by the LFS cost-benefit ratio (1 - u) * age / (1 + u), u = live bytes /
segment size, age = bytes written to the tier since the segment was opened: little live data
is cheap to clean, and old data that is still alive is likely to stay alive, so moving it out
frees space for longer. With lifetime streams most segments never need this: a segment of
per-request blocks empties by itself and is unlinked when its last record dies.

When it runs (checked at every kick and every TICK seconds):
- urgent:     on demand: free segments <= reserved (the next user stream that needs a segment
              would find none), or a writer found none (`make_room`): clean at full speed
              until one is free beyond the reserve, still letting demand reads go first.
              As late as the reserve allows, not ahead of need on free-segment watermarks:
              by then more of every victim has died, and the slack that watermarks keep
              free is room the cleaner's victims do not get (the offline model, DESIGN.md:
              rewritten-prefix cells at 90% live 1.93 / 1.72 / 1.59 with watermarks that
              kept 5-6 of 32 segments free, 1.13 / 1.05 / 1.01 on demand);
- idle:       no foreground writes for IDLE_AFTER seconds: cheap victims only (u <=
              IDLE_MAX_U), paced to IDLE_RATE, until IDLE_FREE_TARGET of the tier is free.
              Reads do not stop it (they take no space); they go first, as below.
Foreground first: before each record copy the cleaner waits (up to FOREGROUND_WAIT) while
demand reads are in flight, and it moves one record at a time through the store's worker
threads, so it never holds more than one of them.

An open segment that has not been appended to while OPEN_IDLE_SHARE of the tier was written
elsewhere (a stream that went quiet) is sealed, so that its dead records can be reclaimed too.
A segment that a whole pass could not empty (a live record that no longer reads: damage) is
not picked again until its live bytes change.

Write amplification = (user bytes + GC bytes) / user bytes, counted by the store in total and
per stream by the segment log; GC bytes are charged to the stream they were copied out of.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import trio

from kvfs.faults import Faults
from kvfs.store.episode import Episode
from kvfs.store.nvme import BLOCK, NvmeFull, RecordError, RecordHeader, Segment, record_length
from kvfs.store.streams import HINT_NAMES, StreamTable, device_info

log = logging.getLogger(__name__)

# Segments kept back from user streams so cleaning always has somewhere to copy to.
GC_RESERVED_SEGMENTS = 2
IDLE_RATE = 64 << 20  # bytes copied per second when cleaning in idle time
IDLE_AFTER = 2.0  # seconds without foreground writes
IDLE_MAX_U = 0.5
IDLE_FREE_TARGET = 0.25
FOREGROUND_WAIT = 0.05  # longest wait for in-flight demand reads before each record copy
URGENT_FOREGROUND_WAIT = 0.002
TICK = 0.25
OPEN_IDLE_SHARE = 0.25
SEGMENT_LIST_MAX = 256  # per-segment live/dead list in the status (keeps it well under 64 KiB)


class _NoRoom(Exception):
    pass


class Cleaner:
    def __init__(self, store, table: StreamTable | None = None, *,
                 idle_rate: float = IDLE_RATE, idle_after: float = IDLE_AFTER,
                 faults: Faults | None = None,
                 class_of: Callable[[int], str | None] = lambda ino: None) -> None:
        self.store = store
        self.faults = faults or Faults()  # crash points gc.written/committed/moved/synced
        self.nvme = store.nvme
        self.table = table or StreamTable.make(2)
        self.class_of = class_of  # a file's placement class now (LifetimeClassifier.known_class)
        self.nvme.gc_reserved = GC_RESERVED_SEGMENTS
        self.nvme.open_streams = self.table.count
        self.nvme.on_new_segment = self._segment_opened
        self.idle_rate = idle_rate
        self.idle_after = idle_after
        self.segments_cleaned = 0
        self.records_moved = 0
        self.bytes_moved = 0
        self.passes = {"urgent": 0, "idle": 0}
        self.victims: dict[int, list] = {}  # stream -> [segments cleaned, sum of live share]
        self.paced_s = 0.0
        self.yielded_s = 0.0
        self.cleaning = False
        self._kick = trio.Event()
        self._lock = trio.Lock()
        self._next_ok = 0.0
        self._activity: tuple = ()
        self._last_activity = time.monotonic()
        self._device: dict | None = None
        self._open_seen: dict[int, tuple[int, int, int]] = {}
        # Segments that a whole pass left with live records it could not move (one whose
        # header no longer reads is not even found; its readers get EIO) -> their live
        # bytes then. Cleaning such a segment again frees nothing, and in urgent mode it
        # would be picked again at once, forever: it waits until its live bytes change.
        self._unmovable: dict[int, int] = {}
        self.no_room = Episode("NVMe tier cleaning")

    def kick(self) -> None:
        self._kick.set()

    def _segment_opened(self) -> None:
        if self.nvme.free_segments() <= self.urgent_mark:
            self._kick.set()

    # -- when ------------------------------------------------------------------------------
    @property
    def urgent_mark(self) -> int:
        """Free segments at or below which cleaning is needed: the reserve."""
        return self.nvme.gc_reserved

    def _idle(self) -> bool:
        now = (self.store.seq, self.store.counters.user_bytes_written)
        t = time.monotonic()
        if now != self._activity:
            self._activity, self._last_activity = now, t
        return t - self._last_activity >= self.idle_after

    def mode(self) -> str | None:
        free = self.nvme.free_segments()
        if free <= self.urgent_mark:
            return "urgent"
        if self._idle() and free < IDLE_FREE_TARGET * self.nvme.max_segments:
            return "idle"
        return None

    # -- victims ---------------------------------------------------------------------------
    def pick_victim(self, max_u: float = 0.98) -> Segment | None:
        """The best victim by cost-benefit, its live share u measured against what a
        segment surely holds (whole records of a full chunk): the end of a full segment
        that no record fits is not room that cleaning it would win (with 256 KiB chunks in
        1 MiB segments, a full segment is 76% of its size: it was picked, its records
        copied to fill another segment as full, forever)."""
        now = self.nvme.bytes_written
        size = self.nvme.segment_size
        holds = self.nvme.usable(self.store.cs)
        best, best_score = None, 0.0
        open_ids = {s.seg_id for s in self.nvme.open_segment.values()}
        for seg in self.nvme.segments.values():
            if (seg.seg_id in open_ids or seg.deleted or seg.hold
                    or self._unmovable.get(seg.seg_id) == seg.live_bytes):
                continue
            u = min(1.0, max(0, seg.live_bytes) / holds)
            if u > max_u:
                continue  # nothing (or too little) to gain
            score = (1 - u) * (now - seg.clock + size) / (1 + u)
            if score > best_score:
                best, best_score = seg, score
        return best

    # -- tasks -----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            with trio.move_on_after(TICK):
                await self._kick.wait()
            self._kick = trio.Event()
            try:
                self.seal_idle_open_segments()
                await self.clean_while_needed()
            except Exception:
                log.exception("segment cleaning failed")

    async def clean_while_needed(self) -> None:
        mode = self.mode()
        while mode is not None:
            if not await self.clean_one(mode):
                break
            mode = self.mode()

    def seal_idle_open_segments(self) -> None:
        nvme = self.nvme
        for stream, seg in list(nvme.open_segment.items()):
            seen = self._open_seen.get(stream)
            if seen is None or seen[:2] != (seg.seg_id, seg.write_off):
                self._open_seen[stream] = (seg.seg_id, seg.write_off, nvme.bytes_written)
            elif nvme.bytes_written - seen[2] >= OPEN_IDLE_SHARE * nvme.capacity:
                nvme.seal_open(stream)
                del self._open_seen[stream]

    async def make_room(self) -> bool:
        """Called when a user append found no free segment (only the cleaner's reserve is
        left): clean until a user stream may open one again. False if cleaning cannot help.
        Each victim nets only its dead share, so with mostly-live victims freeing one
        segment takes many passes: up to one per segment of the tier (a writer waits
        rather than get ENOSPC below the capacity)."""
        def room() -> bool:
            return self.nvme.free_segments() > self.nvme.gc_reserved

        for _ in range(max(8, self.nvme.max_segments)):
            if room():
                return True
            if not await self.clean_one("urgent"):
                break
        await trio.sleep(0)  # callers retry in a loop: never spin without a checkpoint
        return room()

    async def clean_one(self, mode: str = "urgent") -> bool:
        """Clean one victim; False if there was none, or nothing could be copied out of it
        (no segment to copy into: cleaning more would only scan it again)."""
        async with self._lock:
            seg = self.pick_victim(IDLE_MAX_U if mode == "idle" else 0.98)
            if seg is None:
                return False
            self.passes[mode] += 1
            v = self.victims.setdefault(seg.stream, [0, 0.0])
            v[0] += 1
            v[1] += max(0, seg.live_bytes) / self.nvme.segment_size
            return await self._clean(seg, mode)

    # -- one victim ------------------------------------------------------------------------
    async def _clean(self, seg: Segment, mode: str) -> bool:
        """Copy *seg*'s live records elsewhere and free it; False if no record could be
        copied for want of room (it stays as it was)."""
        store = self.store
        stuck = False
        seg.hold += 1
        self.nvme.pin(seg.seg_id)
        self.cleaning = True
        moved_to: dict[int, Segment] = {}
        complete = False
        try:
            records = await trio.to_thread.run_sync(self.nvme.scan, seg.seg_id,
                                                    limiter=store.limiter)
            for off, h in records:
                if store.live_record(h.ino, h.chunk, seg.seg_id, off, h.seq) is None:
                    continue
                await self._foreground_first(mode)
                # it may have changed while we waited
                loc = store.live_record(h.ino, h.chunk, seg.seg_id, off, h.seq)
                if loc is None:
                    continue
                try:
                    dst = await self._move(seg, off, h, loc)
                except _NoRoom:
                    stuck = not moved_to
                    break  # leave the rest where it is
                if dst is not None:
                    moved_to[dst.seg_id] = dst
                if mode == "idle" and self.mode() != "urgent":
                    await self._pace(loc.rec_len, self.idle_rate)
            else:
                complete = True
            self.faults.reached("gc.moved")
            if moved_to:
                await self._make_durable(list(moved_to.values()))
            self.faults.reached("gc.synced")
        finally:
            self.cleaning = False
            self.nvme.unpin(seg)
            seg.hold -= 1
        seg.sealed = True
        self.nvme.delete_if_unused(seg)
        if seg.deleted:
            self.segments_cleaned += 1
            self._unmovable.pop(seg.seg_id, None)
            if self.nvme.free_segments() > self.nvme.gc_reserved:
                self.no_room.over()
        elif complete and self._unmovable.get(seg.seg_id) != seg.live_bytes:
            log.error("cleaning segment %d: %d bytes of live records in it could not be "
                      "moved (unreadable); left as they are", seg.seg_id, seg.live_bytes)
            self._unmovable[seg.seg_id] = seg.live_bytes
        return not stuck

    async def _move(self, seg: Segment, off: int, h: RecordHeader, loc) -> Segment | None:
        """Copy one live record; returns the segment it went to (None: left in place)."""
        store = self.store
        try:
            header, payload, info = await trio.to_thread.run_sync(
                self.nvme.read_whole, seg, off, loc.rec_len, limiter=store.limiter)
        except (RecordError, OSError) as exc:
            log.error("cleaning segment %d: record at %d unreadable (%s); left in place",
                      seg.seg_id, off, exc)
            return None  # not a reason to stop the pass
        rec_len = record_length(len(payload), len(info))
        stream = self.table.gc_destination(seg.stream, self.class_of(h.ino))
        try:
            dst, dst_off = self.nvme.reserve(stream, rec_len, for_gc=True)
        except NvmeFull:
            self.no_room.failed(f"no free segment to copy live records into (segment "
                                f"{seg.seg_id} and others stay as they are)")
            raise _NoRoom() from None
        moved = RecordHeader(header.codec, stream, header.ino, header.chunk, header.seq,
                             header.raw_len, header.stored_len, header.checksum, len(info))
        try:
            await trio.to_thread.run_sync(self.nvme.write_record, dst, dst_off, moved, payload,
                                          info, limiter=store.limiter)
        except BaseException:
            self.nvme.mark_dead(dst.seg_id, rec_len)
            raise
        store.counters.gc_bytes_written += rec_len
        self.nvme.bytes_written += rec_len
        self.nvme.counters(stream).gc_bytes_in += rec_len
        self.nvme.counters(seg.stream).gc_bytes_out += rec_len
        self.bytes_moved += rec_len
        self.faults.reached("gc.written")
        store.relocated(h.ino, h.chunk, loc, dst.seg_id, dst_off, rec_len)
        self.records_moved += 1
        self.faults.reached("gc.committed")
        return dst

    async def _make_durable(self, segs: list[Segment]) -> None:
        """fdatasync the segments copies went to, their directory, then lmdb: only then may
        the victim go (a machine crash must not find the chunk pointing at lost blocks)."""
        pinned = []
        for s in segs:
            if not s.deleted:
                pinned.append(self.nvme.pin(s.seg_id))
        try:
            await trio.to_thread.run_sync(self._sync, pinned, limiter=self.store.limiter)
        finally:
            for s in pinned:
                self.nvme.unpin(s)

    def _sync(self, segs: list[Segment]) -> None:
        for s in segs:
            os.fdatasync(s.fd)
        fd = os.open(self.nvme.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.store.meta.sync()

    # -- politeness ------------------------------------------------------------------------
    def _demand_reads(self) -> int:
        return self.store.fetches.demand_reads()

    async def _foreground_first(self, mode: str) -> None:
        limit = URGENT_FOREGROUND_WAIT if mode == "urgent" else FOREGROUND_WAIT
        t0 = time.monotonic()
        await trio.sleep(0)
        while self._demand_reads() > 0 and time.monotonic() - t0 < limit:
            await trio.sleep(0.0005)
        self.yielded_s += time.monotonic() - t0

    async def _pace(self, nbytes: int, rate: float) -> None:
        now = time.monotonic()
        self._next_ok = max(self._next_ok, now - 0.05) + nbytes / rate  # 50 ms of credit
        if self._next_ok > now:
            self.paced_s += self._next_ok - now
            await trio.sleep(self._next_ok - now)

    # -- accounting ------------------------------------------------------------------------
    def stats(self) -> dict:
        nvme = self.nvme
        size = nvme.segment_size
        per: dict[int, dict] = {}
        ids = set(range(self.table.count)) | set(nvme.streams)
        segs = sorted(nvme.segments.values(), key=lambda s: s.seg_id)
        ids |= {s.stream for s in segs}
        for i in sorted(ids):
            c = nvme.counters(i)
            hint = self.table.hints[i] if i < self.table.count else None
            wa = round((c.user_bytes + c.gc_bytes_out) / c.user_bytes, 4) if c.user_bytes \
                else None
            opened = nvme.open_segment.get(i)
            per[i] = {"id": i, "write_hint": HINT_NAMES.get(hint) if hint is not None else None,
                      "hint_accepted": nvme.hint_result.get(i),
                      "segments": 0, "open_segment": opened.seg_id if opened else None,
                      "live_bytes": 0, "dead_bytes": 0,
                      "user_bytes_written": c.user_bytes, "gc_bytes_written": c.gc_bytes_in,
                      "gc_bytes_copied_out": c.gc_bytes_out, "write_amplification": wa,
                      "segments_freed": c.segments_freed}
        seg_list = []
        for s in segs:
            written = max(0, s.write_off - BLOCK)
            live = max(0, s.live_bytes)
            p = per[s.stream]
            p["segments"] += 1
            p["live_bytes"] += live
            p["dead_bytes"] += max(0, written - live)
            if len(seg_list) < SEGMENT_LIST_MAX:
                seg_list.append([s.seg_id, s.stream, live, max(0, written - live)])
        if self._device is None:
            self._device = device_info(nvme.directory)
        free = nvme.free_segments()
        util = [0] * 10
        for s in segs:
            util[min(9, int(10 * max(0, s.live_bytes) / size))] += 1
        return {
            "gc": {
                "segments_cleaned": self.segments_cleaned,
                "records_moved": self.records_moved,
                "bytes_moved": self.bytes_moved,
                "passes": dict(self.passes),
                "victims": {self.table.name(i): {"segments": n, "mean_live_share": round(u / n, 3)}
                            for i, (n, u) in sorted(self.victims.items())},
                "paced_s": round(self.paced_s, 3),
                "yielded_to_reads_s": round(self.yielded_s, 3),
                "cleaning": self.cleaning,
                "free_segments": free,
                "watermarks": {"urgent": self.urgent_mark,
                               "idle_target": math.ceil(IDLE_FREE_TARGET * nvme.max_segments)},
                "segment_size": size,
                "max_segments": nvme.max_segments,
                "segment_utilisation_histogram": util,
                # [segment id, stream, live bytes, dead bytes]; the first SEGMENT_LIST_MAX
                "segments": seg_list,
                "segments_listed_all": len(seg_list) == len(segs),
                "write_hints": {"kernel_accepted": nvme.hints_accepted,
                                "device": self._device.get("device"),
                                "device_write_streams": self._device.get("write_streams"),
                                "device_discard": self._device.get("discard"),
                                "fs_mounted_with_discard": self._device.get("fs_discard")},
            },
            "streams": {self.table.name(i): p for i, p in per.items()},
        }
