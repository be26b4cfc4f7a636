"""Segment cleaning: reclaim NVMe segments whose records have mostly died.

A victim segment is scanned record by record; a record is live if the index still names
exactly that (segment, offset). Live records are copied, payload as stored (no recompression),
to the GC stream's open segment; each new location is committed before the old record is
marked dead (invariant 4), and the victim is unlinked once nothing in it is live. A crash at
any point leaves either the old or the new location committed, never neither.

Victims are chosen by the classic LFS cost-benefit ratio (1 - u) * age / (1 + u): a segment
with little live data is cheap to clean, and old data that is still alive is likely to stay
alive, so moving it out frees space for longer.

Write amplification = (user bytes + GC bytes) / user bytes is counted by the store.
"""

from __future__ import annotations

import logging
import time

import trio

from kvfs.store.nvme import NvmeFull, RecordError, RecordHeader, Segment, record_length

log = logging.getLogger(__name__)

STREAM_GC = 1
# Clean in the background when fewer segments than this share of the tier are free.
FREE_TARGET = 0.10
# Segments kept back from user streams so cleaning always has somewhere to copy to.
GC_RESERVED_SEGMENTS = 2


class Cleaner:
    def __init__(self, store) -> None:
        self.store = store
        self.nvme = store.nvme
        self.segments_cleaned = 0
        self.records_moved = 0
        self._kick = trio.Event()
        self._lock = trio.Lock()

    def kick(self) -> None:
        self._kick.set()

    def _low(self) -> bool:
        return self.nvme.free_segments() < max(GC_RESERVED_SEGMENTS + 1,
                                               FREE_TARGET * self.nvme.max_segments)

    def pick_victim(self) -> Segment | None:
        now = time.time()
        best, best_score = None, 0.0
        open_ids = {s.seg_id for s in self.nvme.open_segment.values()}
        for seg in self.nvme.segments.values():
            if seg.seg_id in open_ids or seg.deleted:
                continue
            size = max(seg.write_off, 1)
            u = min(1.0, seg.live_bytes / size)
            if u >= 0.98:
                continue  # nothing to gain
            score = (1 - u) * (now - seg.created + 1) / (1 + u)
            if score > best_score:
                best, best_score = seg, score
        return best

    async def run(self) -> None:
        while True:
            with trio.move_on_after(2.0):
                await self._kick.wait()
            self._kick = trio.Event()
            try:
                while self._low():
                    if not await self.clean_one():
                        break
            except Exception:
                log.exception("segment cleaning failed")

    async def make_room(self) -> bool:
        """Called when an append found no free segment: clean until one is free."""
        for _ in range(8):
            if self.nvme.free_segments() > 0:
                return True
            if not await self.clean_one():
                return self.nvme.free_segments() > 0
        return self.nvme.free_segments() > 0

    async def clean_one(self) -> bool:
        async with self._lock:
            seg = self.pick_victim()
            if seg is None:
                return False
            await self._clean(seg)
            return True

    async def _clean(self, seg: Segment) -> None:
        store = self.store
        self.nvme.pin(seg.seg_id)
        try:
            records = await trio.to_thread.run_sync(self.nvme.scan, seg.seg_id,
                                                    limiter=store.limiter)
            for off, h in records:
                loc = store.get(h.ino, h.chunk)
                if loc is None or (loc.seg, loc.off) != (seg.seg_id, off) or loc.seq != h.seq:
                    continue
                await self._move(seg, off, h, loc)
        finally:
            self.nvme.unpin(seg)
        seg.sealed = True
        self.nvme._maybe_delete(seg)
        self.segments_cleaned += 1

    async def _move(self, seg: Segment, off: int, h: RecordHeader, loc) -> None:
        store = self.store
        try:
            header, payload = await trio.to_thread.run_sync(
                self.nvme.read_record, seg, off, loc.rec_len, limiter=store.limiter)
        except (RecordError, OSError) as exc:
            log.error("cleaning segment %d: record at %d unreadable (%s); left in place",
                      seg.seg_id, off, exc)
            return
        rec_len = record_length(len(payload))
        try:
            dst, dst_off = self.nvme.reserve(STREAM_GC, rec_len, for_gc=True)
        except NvmeFull:
            log.warning("cleaning segment %d: no free segment to copy into", seg.seg_id)
            return
        moved = RecordHeader(header.codec, STREAM_GC, header.ino, header.chunk, header.seq,
                             header.raw_len, header.stored_len, header.checksum)
        try:
            await trio.to_thread.run_sync(self.nvme.write_record, dst, dst_off, moved, payload,
                                          limiter=store.limiter)
        except BaseException:
            self.nvme.mark_dead(dst.seg_id, rec_len)
            raise
        store.counters.gc_bytes_written += rec_len
        self.nvme.bytes_written += rec_len
        store.relocated(h.ino, h.chunk, loc, dst.seg_id, dst_off, rec_len)
        self.records_moved += 1
