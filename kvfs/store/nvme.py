"""NVMe tier: a log of append-only segment files written and read with O_DIRECT.

Each stream (a placement class: data expected to die together) has its own open segment;
records of different streams never share one. Space is reserved on the trio thread (a plain
offset bump), so many appends to one or several streams proceed at once in worker threads.
A segment is the unit of reclamation: when its last live record dies it is unlinked, which
lets the filesystem below discard the blocks. Each new segment file gets its stream's Linux
write-life hint (F_SET_RW_HINT; see kvfs/store/streams.py). The byte layouts are in
docs/FORMAT.md.

Record: 64-byte header, payload, the file's description (version 2, kvfs/store/fileinfo.py:
what `fsck.kvfs --rebuild` makes the metadata from), zero padding to a 4 KiB boundary.
    magic u32 'KVR1' | version u16 | codec u8 | stream u8 | ino u64 | chunk u64 | seq u64 |
    raw_len u32 | stored_len u32 | checksum u64 (xxh3-64 of the raw bytes) | info_len u32
    (version 2; 0 in version 1) | 8 reserved bytes (zero) | header_check u32 (xxh32 of the
    60 bytes before it)
Segment: a 4 KiB header block (magic 'KVSG', version, segment id, stream, fs uuid, created,
and from version 2 the store's chunk and segment sizes), records after.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import struct
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import xxhash

from kvfs.store.osutil import FALLOC_FL_KEEP_SIZE, fallocate, punch_hole
from kvfs.store.streams import set_write_hint

log = logging.getLogger(__name__)

BLOCK = 4096
RECORD_MAGIC = 0x3152564B  # b"KVR1" little-endian
SEGMENT_MAGIC = 0x4753564B  # b"KVSG"
# Version 2 records carry the file's description after the payload (info_len bytes); version
# 1 records (info_len 0) read the same way.
RECORD_VERSION = 2
RECORD_VERSIONS = (1, 2)
# Version 2 segment headers add the store's chunk and segment sizes (for a rebuild).
SEGMENT_VERSION = 2
HEADER = struct.Struct("<IHBBQQQIIQI8x")  # 60 bytes, then header_check u32
HEADER_SIZE = 64
SEGMENT_HEADER = struct.Struct("<IHBxI16sQ")
SEGMENT_SIZES = struct.Struct("<IQ")  # (version 2) chunk_size, segment_size, after the header
SEGMENT_NAME = re.compile(r"seg-(\d{8})\.kvs")
T = TypeVar("T")


class NvmeFull(Exception):
    """The NVMe tier has no free segment for a new record."""


# How long a reading of the free space of the filesystem under the tier is trusted (a
# statvfs costs a few microseconds; the store asks at every write).
ROOM_TTL_S = 0.5


class RecordError(Exception):
    """A record on disk does not match what the index expects (corruption or a stale read)."""


def align_up(n: int) -> int:
    return (n + BLOCK - 1) & ~(BLOCK - 1)


def record_length(stored_len: int, info_len: int = 0) -> int:
    return align_up(HEADER_SIZE + stored_len + info_len)


@dataclass(frozen=True)
class RecordHeader:
    codec: int
    stream: int
    ino: int
    chunk: int
    seq: int
    raw_len: int
    stored_len: int
    checksum: int
    info_len: int = 0  # bytes of the file's description after the payload (version 2)
    version: int = RECORD_VERSION


def pack_header(h: RecordHeader) -> bytes:
    body = HEADER.pack(RECORD_MAGIC, h.version, h.codec, h.stream, h.ino, h.chunk, h.seq,
                       h.raw_len, h.stored_len, h.checksum, h.info_len)
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body))


def unpack_header(buf: bytes | memoryview) -> RecordHeader:
    body = bytes(buf[:60])
    (check,) = struct.unpack_from("<I", buf, 60)
    if xxhash.xxh32_intdigest(body) != check:
        raise RecordError("record header checksum mismatch")
    (magic, version, codec, stream, ino, chunk, seq, raw_len, stored_len, csum,
     info_len) = HEADER.unpack(body)
    if magic != RECORD_MAGIC or version not in RECORD_VERSIONS or version == 1 and info_len:
        raise RecordError(f"not a kvfs record (magic {magic:#x}, version {version})")
    return RecordHeader(codec, stream, ino, chunk, seq, raw_len, stored_len, csum, info_len,
                        version)


class AlignedBuffers:
    """A pool of page-aligned buffers (anonymous mmaps) for O_DIRECT I/O, shared by threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: dict[int, list[mmap.mmap]] = {}

    def get(self, size: int) -> mmap.mmap:
        cls = max(BLOCK, 1 << (size - 1).bit_length())
        with self._lock:
            lst = self._pool.get(cls)
            if lst:
                return lst.pop()
        return mmap.mmap(-1, cls)

    def put(self, buf: mmap.mmap) -> None:
        with self._lock:
            lst = self._pool.setdefault(len(buf), [])
            if len(lst) < 16:
                lst.append(buf)
                return
        buf.close()


@dataclass
class Segment:
    seg_id: int
    stream: int
    path: str
    fd: int
    write_off: int = BLOCK  # next free byte (records start after the header block)
    live_bytes: int = 0
    sealed: bool = False  # no more appends
    deleted: bool = False
    readers: int = 0  # in-flight reads: the fd stays open until they finish
    unsynced: bool = False
    created: float = 0.0
    hold: int = 0  # the cleaner is moving its records: not freed until it lets go
    clock: int = 0  # NvmeLog.bytes_written when it was created (age in bytes, for GC)


@dataclass
class StreamCounters:
    """Record bytes appended to one stream, and GC copies out of its segments."""

    user_bytes: int = 0  # user records written into this stream
    gc_bytes_in: int = 0  # records the cleaner copied into this stream
    gc_bytes_out: int = 0  # records the cleaner copied out of this stream's segments
    segments_freed: int = 0


class NvmeLog:
    """Segments, streams, appends and reads. Accounting of live bytes is driven by the store."""

    def __init__(self, directory: str, fs_uuid: str, capacity: int, segment_size: int, *,
                 read_only: bool = False, chunk_size: int = 0) -> None:
        self.directory = os.path.join(directory, "segments")
        os.makedirs(self.directory, exist_ok=True)
        self.fs_uuid = uuidlib.UUID(fs_uuid).bytes
        self.capacity = capacity
        self.segment_size = segment_size
        self.chunk_size = chunk_size  # (written into segment headers, for a rebuild)
        self._max_segments = capacity // segment_size  # what nvme_size allows
        self._room = 0  # free bytes of the filesystem below, as last read (`room`)
        self._room_read = -ROOM_TTL_S
        self.preallocate = True  # segments get their blocks at creation (`_new_segment`)
        self.segments: dict[int, Segment] = {}
        self.open_segment: dict[int, Segment] = {}  # stream -> segment being appended to
        self.next_seg = 1
        self.buffers = AlignedBuffers()
        self.bytes_written = 0  # every record byte appended (user + GC)
        self.hints_accepted: bool | None = None
        self.stream_hints: dict[int, int] = {}  # stream -> RWH_WRITE_LIFE_* (set by assembly)
        self.hint_result: dict[int, bool] = {}  # stream -> did the kernel keep the hint
        self.streams: dict[int, StreamCounters] = {}
        self.on_new_segment = lambda: None  # the cleaner's kick: free space just shrank
        self.gc_reserved = 2  # segments only the cleaner may open
        self.open_streams = 1  # streams, each holding an open segment (set by the cleaner)
        self._discover(read_only)

    # -- segments --------------------------------------------------------------------------
    def _discover(self, read_only: bool) -> None:
        for name in sorted(os.listdir(self.directory)):
            m = SEGMENT_NAME.fullmatch(name)
            if m is None:
                continue
            # A new segment never takes the name of a file that is there, whatever it holds
            # (its creation would fail with EEXIST, and every write-back with it).
            self.next_seg = max(self.next_seg, int(m.group(1)) + 1)
            path = os.path.join(self.directory, name)
            try:
                with open(path, "rb") as f:  # buffered: O_DIRECT wants aligned buffers
                    head = f.read(SEGMENT_HEADER.size)
            except OSError as exc:
                if not read_only:
                    # A file the daemon may not open fails the mount (the OSError names
                    # it): left out, its records would read as lost.
                    raise
                log.warning("ignoring %s: %s", path, exc.strerror)  # (fsck: they are lost)
                continue
            if not head:
                # Created, and the daemon stopped before it wrote the header block, which
                # comes before any record: the file never held anything.
                log.info("%s: an empty segment file left by a crash%s", path,
                         "" if read_only else "; removed")
                if not read_only:
                    os.unlink(path)
                continue
            try:
                magic, version, stream, seg_id, fsid, _ = SEGMENT_HEADER.unpack(head)
            except struct.error:
                log.warning("ignoring %s: too short for a segment header", path)
                continue
            if magic != SEGMENT_MAGIC or fsid != self.fs_uuid:
                log.warning("ignoring %s: not a segment of this filesystem", path)
                continue
            if name != f"seg-{seg_id:08d}.kvs":  # a damaged header: its id cannot be trusted
                log.warning("ignoring %s: its header names segment %d", path, seg_id)
                continue
            fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            size = os.fstat(fd).st_size
            self.segments[seg_id] = Segment(seg_id, stream, path, fd, write_off=align_up(size),
                                            sealed=True, created=os.stat(path).st_mtime)
            self.next_seg = max(self.next_seg, seg_id + 1)

    # -- room ------------------------------------------------------------------------------
    def room(self) -> int:
        """Free bytes of the filesystem under the tier (it may be shared with others, or
        smaller than nvme_size), read at most every ROOM_TTL_S."""
        now = time.monotonic()
        if now - self._room_read >= ROOM_TTL_S:
            st = os.statvfs(self.directory)
            self._room, self._room_read = st.f_bavail * st.f_frsize, now
        return self._room

    def room_changed(self) -> None:
        """The filesystem below answered ENOSPC (or space was freed): read it again."""
        self._room_read = -ROOM_TTL_S

    def usable(self, chunk_size: int) -> int:
        """Record bytes a segment surely holds: as many whole records of a full chunk
        stored raw (the biggest a record gets) as fit after its header block."""
        most = record_length(chunk_size)
        return (self.segment_size - BLOCK) // most * most

    @property
    def max_segments(self) -> int:
        """Segments the tier may hold: what nvme_size allows, or fewer when the filesystem
        below has no room for more (each new segment takes its whole size at creation).
        One segment's worth of that room is left out: it comes and goes with the log, the
        metadata and whoever else writes there, and a tier that counted on it would take
        writes it then cannot write back."""
        more = max(0, self.room() - self.segment_size) // self.segment_size
        return min(self._max_segments, len(self.segments) + more)

    def _new_segment(self, stream: int) -> Segment:
        if len(self.segments) >= self.max_segments:
            raise NvmeFull()
        seg_id = self.next_seg
        self.next_seg += 1
        path = os.path.join(self.directory, f"seg-{seg_id:08d}.kvs")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        buf = self.buffers.get(BLOCK)
        try:
            # Its blocks, all at once: a full filesystem says so here, cleanly, not in the
            # middle of a record write (KEEP_SIZE: the file's length stays what was written).
            if self.preallocate:
                try:
                    fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, self.segment_size)
                except OSError as exc:
                    if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    self.preallocate = False  # a filesystem without it: writes will say
            buf[:BLOCK] = bytes(BLOCK)
            buf[:SEGMENT_HEADER.size] = SEGMENT_HEADER.pack(
                SEGMENT_MAGIC, SEGMENT_VERSION, stream, seg_id, self.fs_uuid, time.time_ns())
            buf[SEGMENT_HEADER.size:SEGMENT_HEADER.size + SEGMENT_SIZES.size] = \
                SEGMENT_SIZES.pack(self.chunk_size, self.segment_size)
            os.pwrite(fd, memoryview(buf)[:BLOCK], 0)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.room_changed()
                raise NvmeFull() from None
            raise
        finally:
            self.buffers.put(buf)
        seg = Segment(seg_id, stream, path, fd, created=time.time(), unsynced=True,
                      clock=self.bytes_written)
        self.segments[seg_id] = seg
        hint = self.stream_hints.get(stream)
        if hint is not None:
            ok = set_write_hint(fd, hint)
            self.hint_result[stream] = ok
            self.hints_accepted = ok if self.hints_accepted is None else self.hints_accepted and ok
        self.on_new_segment()
        return seg

    def counters(self, stream: int) -> StreamCounters:
        c = self.streams.get(stream)
        if c is None:
            c = self.streams[stream] = StreamCounters()
        return c

    def reserve(self, stream: int, length: int, *, for_gc: bool = False
                ) -> tuple[Segment, int]:
        """Claim *length* bytes at the end of *stream*'s open segment (trio thread, no I/O
        except creating a segment file); the record goes to the segment's stream
        (`Segment.stream`). Only the cleaner may take the last free segments: it needs them
        to free others. Without one, a record goes where another stream's open segment has
        room: placement is a hint, and a full tier must take what fits."""
        seg = self.open_segment.get(stream)
        if seg is None or seg.write_off + length > self.segment_size:
            if not for_gc and self.free_segments() <= self.gc_reserved:
                for other in self.open_segment.values():
                    if other.write_off + length <= self.segment_size:
                        seg = other
                        break
                else:
                    raise NvmeFull()
                off = seg.write_off
                seg.write_off += length
                seg.live_bytes += length
                return seg, off
            if seg is not None:
                del self.open_segment[stream]
                self._seal(seg)
            seg = self._new_segment(stream)
            self.open_segment[stream] = seg
        off = seg.write_off
        seg.write_off += length
        seg.live_bytes += length
        return seg, off

    def seal_open(self, stream: int) -> None:
        """Stop appending to *stream*'s open segment (the cleaner closes idle ones so their
        dead space can be reclaimed); the next append opens a new one."""
        seg = self.open_segment.pop(stream, None)
        if seg is not None:
            self._seal(seg)

    def _seal(self, seg: Segment) -> None:
        """No more appends to *seg*: the blocks preallocated past its last record go back
        to the filesystem (a 1 MiB record does not fit a 4 MiB segment's last MiB)."""
        seg.sealed = True
        if self.preallocate and seg.write_off < self.segment_size:
            try:
                punch_hole(seg.fd, seg.write_off, self.segment_size - seg.write_off)
            except OSError as exc:
                log.warning("segment %d: giving back its unused end failed: %s", seg.seg_id, exc)
            self.room_changed()
        self.delete_if_unused(seg)

    def free_segments(self) -> int:
        return self.max_segments - len(self.segments)

    def mark_dead(self, seg_id: int, rec_len: int) -> None:
        """A record is no longer referenced (its replacement is already committed)."""
        seg = self.segments.get(seg_id)
        if seg is None:
            return
        seg.live_bytes -= rec_len
        self.delete_if_unused(seg)

    def delete_if_unused(self, seg: Segment) -> None:
        """Delete *seg* if it is sealed and nothing names its records any more."""
        if seg.sealed and seg.live_bytes <= 0 and not seg.deleted and not seg.hold:
            seg.deleted = True
            del self.segments[seg.seg_id]
            self.counters(seg.stream).segments_freed += 1
            try:
                os.unlink(seg.path)
            except OSError as exc:
                # Nothing names its records any more; what is at its path is not ours to
                # fix. The request whose commit let it go must not fail for it (this runs
                # after that commit), and its name is never reused (`_discover`).
                log.error("segment %d is no longer used but %s could not be removed: %s",
                          seg.seg_id, seg.path, exc.strerror)
            if seg.readers == 0:
                os.close(seg.fd)

    # -- I/O (worker threads) ---------------------------------------------------------------
    def write_record(self, seg: Segment, off: int, header: RecordHeader,
                     payload: bytes | memoryview, info: bytes = b"") -> int:
        """Write one record at *off*; returns its length on disk."""
        return self.write_records(seg, off, [(header, payload, info)])

    def write_records(self, seg: Segment, off: int,
                      records: list[tuple[RecordHeader, bytes | memoryview, bytes]]) -> int:
        """Write records (header, payload, the file's description: header.info_len bytes)
        that follow each other from *off* on, in one write; returns their length on disk."""
        total = sum(record_length(len(payload), len(info)) for _, payload, info in records)
        buf = self.buffers.get(total)
        try:
            pos = 0
            for header, payload, info in records:
                assert header.info_len == len(info)
                end = pos + record_length(len(payload), len(info))
                tail = pos + HEADER_SIZE + len(payload)
                buf[pos:pos + HEADER_SIZE] = pack_header(header)
                buf[pos + HEADER_SIZE:tail] = payload
                buf[tail:tail + len(info)] = info
                tail += len(info)
                buf[tail:end] = bytes(end - tail)
                pos = end
            if os.pwrite(seg.fd, memoryview(buf)[:total], off) != total:
                raise OSError(errno.EIO, f"short write to segment {seg.seg_id} at {off}")
        finally:
            self.buffers.put(buf)
        seg.unsynced = True
        return total

    def pin(self, seg_id: int) -> Segment:
        """Keep a segment's fd open across a read in a worker thread (trio thread)."""
        seg = self.segments.get(seg_id)
        if seg is None:
            raise RecordError(f"segment {seg_id} does not exist")
        seg.readers += 1
        return seg

    def unpin(self, seg: Segment) -> None:
        seg.readers -= 1
        if seg.deleted and seg.readers == 0:
            os.close(seg.fd)

    def read_record(self, seg: Segment, off: int, rec_len: int,
                    consume: Callable[[RecordHeader, memoryview], T] | None = None,
                    into: mmap.mmap | None = None) -> T | tuple[RecordHeader, bytes]:
        """Read and parse one record of a pinned segment (worker thread); the caller checks
        that it is the record it expected. Returns *consume(header, payload)*, called while
        the payload is still a view of the read buffer (no copy; the view must not outlive
        the call), or without *consume* the header and a copy of the payload. *into*: read
        into the caller's buffer (at least *rec_len* bytes), whose payload then starts at
        HEADER_SIZE and stays there for the caller."""
        buf = into if into is not None else self.buffers.get(rec_len)
        try:
            with memoryview(buf) as mv:
                n = os.preadv(seg.fd, [mv[:rec_len]], off)
                if n < HEADER_SIZE:
                    raise RecordError(f"short read in segment {seg.seg_id} at {off}")
                header = unpack_header(mv)
                if HEADER_SIZE + header.stored_len > n:
                    raise RecordError(f"record in segment {seg.seg_id} at {off} is truncated")
                payload = mv[HEADER_SIZE:HEADER_SIZE + header.stored_len]
                try:
                    if consume is None:
                        return header, payload.tobytes()
                    return consume(header, payload)
                finally:
                    payload.release()
        finally:
            if into is None:
                self.buffers.put(buf)

    def read_whole(self, seg: Segment, off: int, rec_len: int
                   ) -> tuple[RecordHeader, bytes, bytes]:
        """A record's header, payload and file description (copies; the cleaner moves it
        whole). Worker thread, *seg* pinned."""
        def split(h: RecordHeader, _payload: memoryview) -> tuple[RecordHeader, bytes, bytes]:
            start = HEADER_SIZE + h.stored_len
            if start + h.info_len > rec_len:
                raise RecordError(f"record in segment {seg.seg_id} at {off} is truncated")
            return h, bytes(_payload), bytes(memoryview(buf)[start:start + h.info_len])

        buf = self.buffers.get(rec_len)
        try:
            return self.read_record(seg, off, rec_len, split, into=buf)
        finally:
            self.buffers.put(buf)

    def sync(self) -> None:
        """fdatasync every segment with appended records (worker thread)."""
        for seg in list(self.segments.values()):
            if seg.unsynced and not seg.deleted:
                os.fdatasync(seg.fd)  # (a failure leaves it unsynced: the next sync retries)
                seg.unsynced = False
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)  # new segment files' directory entries
        finally:
            os.close(fd)

    def scan(self, seg_id: int) -> list[tuple[int, RecordHeader]]:
        """(offset, header) of every record in a segment, read sequentially (GC, fsck)."""
        seg = self.segments[seg_id]
        out: list[tuple[int, RecordHeader]] = []
        off, end = BLOCK, seg.write_off
        buf = self.buffers.get(BLOCK)
        try:
            while off < end:
                n = os.preadv(seg.fd, [memoryview(buf)[:BLOCK]], off)
                if n < HEADER_SIZE:
                    break
                try:
                    h = unpack_header(buf)
                except RecordError:
                    off += BLOCK  # a torn or never-written record: resynchronise on blocks
                    continue
                out.append((off, h))
                off += record_length(h.stored_len, h.info_len)
        finally:
            self.buffers.put(buf)
        return out

    def close(self) -> None:
        for seg in self.segments.values():
            os.close(seg.fd)
        self.segments.clear()
