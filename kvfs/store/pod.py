"""The pod tier (issue 35): files other kvfs mounts of the pod published, through Mooncake Store.

A `Pod` is this mount's member of the pod: one Mooncake client that also gives the pool
`segment_size` bytes of memory. It publishes complete files (their records as kvfs stores
them: no re-encode) and answers lookups and fetches of files others published. Nothing a pod
call does reaches the caller as an exception: a negative Mooncake return, a timeout, a dead
master or member, a damaged object are all a miss (and a counter).

Objects (docs/FORMAT.md, Pod objects): for a file at PATH (relative to the mount) in pod NAME,
the head `kvfs/NAME/h/PATH` (size, mode, chunk size, version, the records' places) and the
data `kvfs/NAME/d/PATH@MEMBER.VERSION` (the records back to back). A lookup reads heads only;
the head names the data, so a rewritten file (a new version) is a new data object and a
reader never mixes two versions.

Threads: every Mooncake call runs in a worker thread (they release the GIL), on one of three
lanes of one thread each: lookups, fetches, publishing. A lookup or fetch waits at most
`timeout` (fetches: plus their size at FETCH_FLOOR_BPS), then counts as a miss; its call
is abandoned and finishes on its own. While a lane's call has run past the timeout (a dead
master holds a call ~4 s in Mooncake 0.3.13.post1), calls on that lane miss at once instead
of queueing. Publishing goes through a queue with a byte cap, never waits for the pod:
what does not fit is dropped and counted; a file whose put failed (the pod is away) is
kept by its caller's tag (`unpublished`) for when a probe put works again. Fetched files
are decoded in two threads, into one landing buffer or, chunk by chunk, straight into the
caller's file (`Landing`). docs/DESIGN.md, Pod tier.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import logging
import mmap
import os
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import trio
import xxhash

from kvfs.store.codec import Codec, CodecError
from kvfs.store.location import hash_bytes
from kvfs.store.nvme import HEADER_SIZE, RecordError, RecordHeader, pack_header, unpack_header

log = logging.getLogger(__name__)
T = TypeVar("T")

HEAD_MAGIC = 0x4850564B  # b"KVPH" little-endian
HEAD_VERSION = 1
# magic, version, flags, mode, chunk_size, size, mtime_ns, file version, chunks,
# path length, member length
HEAD_FIXED = struct.Struct("<IHHIIQqQIHH")
HEAD_ENTRY = struct.Struct("<QQI")  # chunk number, offset in the data object, record length
HEAD_CHECK = struct.Struct("<Q")  # xxh3-64 of every byte before it
# A head is read into a slot of this size: a file of up to ~3,200 chunks (3 GiB at 1 MiB).
HEAD_MAX = 64 << 10
# Lookups answered by one Mooncake call at most.
BATCH_MAX = 32
# Data objects at least this big are decoded in two threads (below, the hand-off to the
# second thread and back costs more than it saves on a loaded machine: 4 MiB files measured
# slower).
PARALLEL_DECODE_BYTES = 8 << 20
# A fetch may take its size at this rate on top of the timeout before it is a miss.
FETCH_FLOOR_BPS = 64 << 20
# Mooncake's return codes (mooncake-store/include/types.h): the ones that mean "not there".
OBJECT_NOT_FOUND = -704
# Negative and positive lookup answers kept at most (the oldest go first).
CACHE_MAX = 1 << 16
MEMBERS_EVERY_S = 5.0
CONNECT_RETRY_S = 1.0
# While the pod is away (a publish failed), whether it is back is asked this often.
PROBE_EVERY_S = 0.5
# Files not published because the pod was away, kept to be published when it is back: at
# most this many (the oldest go first, counted as dropped), each put at most PUT_ATTEMPTS
# times.
UNPUBLISHED_MAX = 4096
PUT_ATTEMPTS = 3
# Most an unmount waits for the client to leave the pod.
CLOSE_S = 1.0


class PodObjectError(Exception):
    """A pod object is damaged or not what its key says (a miss for the reader)."""


class PodUnavailable(Exception):
    """The pod tier cannot run here (the Mooncake client is not installed or does not load)."""


@dataclass(frozen=True)
class PodHead:
    """What a lookup learns of a published file: enough to show it and to fetch it."""

    path: str
    member: str  # who published this version
    version: int
    mode: int
    size: int
    mtime_ns: int
    chunk_size: int
    # (chunk number, offset in the data object, record length), by chunk number
    entries: tuple[tuple[int, int, int], ...]

    @property
    def data_len(self) -> int:
        return sum(length for _, _, length in self.entries)


@dataclass
class PodFile:
    """A fetched file: its head and each present chunk's raw bytes, checked (views of
    one buffer that holds each chunk at its offset in the file), with their xxh3 (the
    records' checksums, which those very bytes matched)."""

    head: PodHead
    chunks: dict[int, memoryview]
    buf: memoryview  # the file's bytes at their offsets (where chunks are)
    checksums: dict[int, int] = field(default_factory=dict)
    # Where the chunks went instead (then `chunks` and `buf` are empty, and `checksums`
    # are of the bytes written there)
    landing: Landing | None = None

    @property
    def whole(self) -> memoryview | None:
        """The file's bytes in one view, if its chunks are all there and all full but the
        last (no hole: the buffer is not zeroed between fetches)."""
        if not self.chunks:
            return None
        c = max(self.chunks)
        view = self.chunks[c]
        if (len(self.chunks) != c + 1
                or c * self.head.chunk_size + len(view) != self.head.size
                or any(len(v) != self.head.chunk_size for k, v in self.chunks.items() if k < c)):
            return None
        return self.buf[:self.head.size]

    def data(self) -> bytes:
        """The whole file (holes as zeros), a copy."""
        out = bytearray(self.head.size)
        cs = self.head.chunk_size
        for c, raw in self.chunks.items():
            out[c * cs:c * cs + len(raw)] = raw
        return bytes(out)


def encode_head(head: PodHead) -> bytes:
    path, member = head.path.encode(), head.member.encode()
    body = b"".join([
        HEAD_FIXED.pack(HEAD_MAGIC, HEAD_VERSION, 0, head.mode, head.chunk_size, head.size,
                        head.mtime_ns, head.version, len(head.entries), len(path), len(member)),
        path, member, *(HEAD_ENTRY.pack(*e) for e in head.entries)])
    return body + HEAD_CHECK.pack(xxhash.xxh3_64_intdigest(body))


def decode_head(buf: bytes | memoryview, path: str) -> PodHead:
    """Parse and check a head read under *path*'s key; PodObjectError if it is not one."""
    mv = memoryview(buf)
    if len(mv) < HEAD_FIXED.size + HEAD_CHECK.size:
        raise PodObjectError(f"pod head of {path!r} is truncated ({len(mv)} bytes)")
    (check,) = HEAD_CHECK.unpack_from(mv, len(mv) - HEAD_CHECK.size)
    if xxhash.xxh3_64_intdigest(mv[:-HEAD_CHECK.size]) != check:
        raise PodObjectError(f"pod head of {path!r}: checksum mismatch")
    (magic, version, _flags, mode, chunk_size, size, mtime_ns, file_version, n, path_len,
     member_len) = HEAD_FIXED.unpack_from(mv)
    if magic != HEAD_MAGIC or version != HEAD_VERSION:
        raise PodObjectError(f"pod head of {path!r}: magic {magic:#x}, version {version}")
    off = HEAD_FIXED.size
    if off + path_len + member_len + n * HEAD_ENTRY.size + HEAD_CHECK.size != len(mv):
        raise PodObjectError(f"pod head of {path!r}: lengths do not add up")
    if bytes(mv[off:off + path_len]) != path.encode():
        raise PodObjectError(f"pod head under {path!r} is another file's")
    off += path_len
    member = bytes(mv[off:off + member_len]).decode(errors="replace")
    off += member_len
    entries = tuple(HEAD_ENTRY.unpack_from(mv, off + i * HEAD_ENTRY.size) for i in range(n))
    end = 0
    for c, o, length in entries:
        if o != end or length <= HEADER_SIZE or c * chunk_size >= max(size, 1):
            raise PodObjectError(f"pod head of {path!r}: bad entry for chunk {c}")
        end += length
    return PodHead(path, member, file_version, mode, size, mtime_ns, chunk_size, entries)


class LandingCancelled(Exception):
    """A fetch's landing was given up (its caller stopped waiting)."""


class Landing:
    """A file descriptor (a DRAM file) a fetch writes each decoded chunk into at its
    offset, from the threads that decode them, until `cancel`: a fetch abandoned on its
    timeout writes nothing after its caller gave the regions back."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()
        self._cancelled = False

    def write(self, off: int, view: memoryview) -> None:
        with self._lock:
            if self._cancelled:
                raise LandingCancelled(f"a landing at {off} given up")
            pos = 0
            while pos < len(view):
                pos += os.pwrite(self.fd, view[pos:], off + pos)

    def cancel(self) -> None:
        """No write after this returns (one under way is waited for)."""
        with self._lock:
            self._cancelled = True


def decode_data(head: PodHead, data: bytes | memoryview, codec: Codec,
                out: memoryview | None = None,
                pool: concurrent.futures.Executor | None = None,
                landing: Landing | None = None) -> PodFile:
    """Check and decode a data object against its head: every record's header check, its
    chunk number and lengths, its payload decoded and hashed against the record's checksum.
    PodObjectError on the first thing that does not match (never partly wrong bytes).
    Chunks are decoded into *out* (at least head.size bytes; a new buffer if None), at
    their offsets in the file; with *landing*, each into a buffer of its thread instead
    (reused, so still in cache), checked there and written from there to the landing (a
    chunk that ends short of the next one or of the file's end padded with its zeros:
    its checksum is then of them too). With *pool*, for a big object, half of them in its
    thread meanwhile (decode, hash and write run without the GIL)."""
    mv = memoryview(data)
    if len(mv) != head.data_len:
        raise PodObjectError(f"pod data of {head.path!r}: {len(mv)} bytes, head says "
                             f"{head.data_len}")
    if landing is not None:
        out = memoryview(b"")
    elif out is None:
        out = memoryview(bytearray(head.size))
    if landing is None and len(out) < head.size:
        raise ValueError(f"a buffer of {len(out)} bytes for a file of {head.size}")
    entries = head.entries
    got = PodFile(head, {}, out, landing=landing)
    if pool is None or len(entries) < 2 or len(mv) < PARALLEL_DECODE_BYTES:
        _decode_records(mv, entries, codec, got)
        return got
    half = len(entries) // 2
    other = pool.submit(_decode_records, mv, entries[half:], codec, got)
    try:
        _decode_records(mv, entries[:half], codec, got)
    finally:
        other.result()  # (waited for even on an error: it writes into out)
    return got


def _decode_records(mv: memoryview, entries: Sequence[tuple[int, int, int]], codec: Codec,
                    got: PodFile) -> None:
    """Decode and check *entries* into got.buf, adding them to got.chunks and
    got.checksums (two threads may fill one PodFile: each its own chunks)."""
    head, out, landing = got.head, got.buf, got.landing
    cs = head.chunk_size
    scratch = _scratch(cs) if landing is not None else out
    for c, off, length in entries:
        rec = mv[off:off + length]
        try:
            h = unpack_header(rec)
        except RecordError as e:
            raise PodObjectError(f"pod data of {head.path!r}, chunk {c}: {e}") from None
        if (h.chunk != c or HEADER_SIZE + h.stored_len != length or h.raw_len > cs
                or c * cs + h.raw_len > head.size):
            raise PodObjectError(f"pod data of {head.path!r}, chunk {c}: record does not fit")
        raw = scratch[:h.raw_len] if landing is not None else out[c * cs:c * cs + h.raw_len]
        try:
            codec.decode_into(h.codec, rec[HEADER_SIZE:], h.raw_len, raw)
        except CodecError as e:
            raise PodObjectError(f"pod data of {head.path!r}, chunk {c}: {e}") from None
        if hash_bytes(raw) != h.checksum:
            raise PodObjectError(f"pod data of {head.path!r}, chunk {c}: checksum mismatch")
        if landing is None:
            got.chunks[c] = raw
            got.checksums[c] = h.checksum
            continue
        extent = min(cs, head.size - c * cs)
        checksum = h.checksum
        if h.raw_len < extent:  # its last bytes are zeros (not stored)
            scratch[h.raw_len:extent] = bytes(extent - h.raw_len)
            checksum = hash_bytes(scratch[:extent])
        landing.write(c * cs, scratch[:extent])
        got.checksums[c] = checksum


_scratches = threading.local()


def _scratch(size: int) -> memoryview:
    """This thread's decode buffer of at least *size* bytes (kept: it stays in cache)."""
    buf = getattr(_scratches, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratches.buf = memoryview(bytearray(size))
    return buf


def records_of(data: bytes, chunk_size: int, codec: Codec,
               hint: str | None = None) -> list[tuple[int, bytes]]:
    """Records of *data* as the store writes them, for publishers that hold only bytes
    (tools, tests): (chunk number, 64-byte header + payload) per chunk."""
    return [(c, record_of(c, data[c * chunk_size:(c + 1) * chunk_size], codec, hint))
            for c in range(0, (len(data) + chunk_size - 1) // chunk_size)]


def record_of(c: int, raw: bytes, codec: Codec, hint: str | None = None) -> bytes:
    """Chunk *c*'s record (64-byte header + encoded payload) as the store writes one."""
    used, payload = codec.encode(raw, codec.choose(raw, hint))
    header = RecordHeader(used, 0, 0, c, 0, len(raw), len(payload), hash_bytes(raw))
    return pack_header(header) + bytes(payload)


def _mooncake_classes() -> tuple[Any, Any]:
    """Mooncake's MooncakeDistributedStore and ReplicateConfig."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as e:
        raise PodUnavailable(
            f"the pod tier needs Mooncake's client: pip install 'kvfs[pod]' and apt install "
            f"libibverbs1 ({e})") from None
    return MooncakeDistributedStore, ReplicateConfig


def _local_address(host: str, port: int) -> str:
    """The address of this machine the master's host is reached from: 127.0.0.1 for a
    master on loopback, so that peers are told a loopback address."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # UDP: chooses the route, sends nothing
        return s.getsockname()[0]


class _Buffer:
    """Memory Mooncake reads from and writes into (registered with the client)."""

    def __init__(self, size: int) -> None:
        self.mem = mmap.mmap(-1, size)
        self.size = size
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))


@dataclass
class _Lane:
    """One worker thread's worth of Mooncake calls, one at a time."""

    limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    busy_since: float | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        self.busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.busy_since = None

    def stuck(self, timeout: float) -> bool:
        since = self.busy_since
        return since is not None and time.monotonic() - since > timeout


@dataclass
class PodCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    published_files: int = 0
    published_bytes: int = 0
    fetched_bytes: int = 0
    errors: int = 0  # negative Mooncake returns other than "not found", failed setups
    timeouts: int = 0  # lookups and fetches that gave up waiting (also misses)
    damaged: int = 0  # heads or data objects that failed their checks (also misses)
    dropped: int = 0  # files not published: the queue was full, too big, or no pod


@dataclass
class _Job:
    head: PodHead
    head_bytes: bytes
    records: list[bytes]
    tag: int | None  # the caller's name for the file (`unpublished`)


class Pod:
    """This mount's member of a pod. `run()` must be running (in the daemon's nursery) for
    it to connect and publish; lookups and fetches miss until it has connected."""

    def __init__(self, master: str, name: str, member: str, segment_size: int, *,
                 timeout: float = 0.05, codec: Codec | None = None,
                 queue_bytes: int = 256 << 20, max_object: int = 64 << 20,
                 miss_ttl: float = 1.0, hit_ttl: float = 1.0,
                 metrics: str | None = None, replicas: int = 2) -> None:
        self.store_class, config_class = _mooncake_classes()
        # Copies Mooncake keeps of each object, in as many members' segments: with one, the
        # objects in a member's segment go with it (half of them, with 2 members).
        self.replicate = config_class()
        self.replicate.replica_num = replicas
        # A setup while the master is away retries 20 times at ~4.4 s each in Mooncake
        # (90 s in one call); run() retries every second itself instead.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        self.master = master
        host, _, port = master.rpartition(":")
        self.host, self.port = host.removeprefix("[").removesuffix("]"), int(port)
        self.name = name
        self.member = member
        self.segment_size = segment_size
        self.timeout = timeout
        self.codec = codec or Codec()
        self.queue_bytes = queue_bytes
        self.max_object = max_object
        self.miss_ttl = miss_ttl
        self.hit_ttl = hit_ttl
        # Mooncake's master reports its members on its metrics port (9003 by default).
        self.metrics = metrics or f"{host}:9003"
        self.counters = PodCounters()
        self.members: int | None = None
        self.queued_bytes = 0
        # The last put (or, while away, a probe) reached the pod.
        self.up = False
        self._up, self._down = trio.Event(), trio.Event()
        # Tags of files to publish when the pod is back (-> puts failed), oldest first.
        self.unpublished: dict[int, int] = {}
        self._client: Any = None
        self._count_lock = threading.Lock()
        self._lookup_lane, self._fetch_lane, self._publish_lane = _Lane(), _Lane(), _Lane()
        self._misses: dict[str, float] = {}  # path -> until when it is a known miss
        self._heads: dict[str, tuple[float, PodHead]] = {}  # path -> (until when, head)
        self._wanted: set[str] = set()  # paths waiting for a batch
        self._batching: trio.Event | None = None  # set when the batch in flight ends
        self._latencies_us: collections.deque[int] = collections.deque(maxlen=4096)
        self._send, self._recv = trio.open_memory_channel[_Job](float("inf"))
        self._head_buf = _Buffer(BATCH_MAX * HEAD_MAX)
        self._fetch_buf = _Buffer(max_object)
        # Fetched files are decoded into this, the second half of their chunks in
        # _decoder's thread.
        self._land_buf = _Buffer(max_object)
        self._landing = trio.Lock()
        self._decoder = concurrent.futures.ThreadPoolExecutor(1, "pod-decode")
        self._publish_buf = _Buffer(max_object)

    # -- keys ---------------------------------------------------------------------------

    def head_key(self, path: str) -> str:
        return f"kvfs/{self.name}/h/{path}"

    def data_key(self, head: PodHead) -> str:
        return f"kvfs/{self.name}/d/{head.path}@{head.member}.{head.version:016x}"

    # -- running ------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._client is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Connect (retrying while the master is away), then publish what is queued and
        keep the member count fresh. Cancel to stop; close() afterwards."""
        task_status.started()
        while self._client is None:
            client = await trio.to_thread.run_sync(self._publish_lane.run, self._connect,
                                                   limiter=self._publish_lane.limiter,
                                                   abandon_on_cancel=True)
            if client is None:
                await trio.sleep(CONNECT_RETRY_S)
            self._client = client
        self._set_up(True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._count_members)
            nursery.start_soon(self._probe)
            async for job in self._recv:
                ok = self.up and await trio.to_thread.run_sync(
                    self._publish_lane.run, self._put, job, limiter=self._publish_lane.limiter,
                    abandon_on_cancel=True)
                self.queued_bytes -= sum(map(len, job.records))
                if ok:
                    self.unpublished.pop(job.tag, None)  # type: ignore[arg-type]
                else:
                    self._set_up(False)
                    self.defer(job.tag, tried=True)

    def _set_up(self, up: bool) -> None:
        if up and not self.up:
            self._up.set()
            self._down = trio.Event()
        elif not up and self.up:
            self._down.set()
            self._up = trio.Event()
            log.warning("pod: publishing to %s failed; files closed meanwhile are published "
                        "when it answers again", self.master)
        self.up = up

    async def wait_up(self) -> None:
        """Return once the pod is up (at once if it is)."""
        await self._up.wait()

    async def wait_down(self) -> None:
        """Return once the pod is away (at once if it is, after it was up)."""
        await self._down.wait()

    async def _probe(self) -> None:
        """While the pod is away, ask it every PROBE_EVERY_S whether it is back."""
        while True:
            await self._down.wait()
            await trio.sleep(PROBE_EVERY_S)
            if await trio.to_thread.run_sync(
                    self._publish_lane.run, self._takes_puts, limiter=self._publish_lane.limiter,
                    abandon_on_cancel=True):
                log.info("pod: %s takes puts again", self.master)
                self._set_up(True)

    def _takes_puts(self) -> bool:
        """Worker thread: does the pod take a put (a master that answers, and memory in
        it: a restarted master has none until the members' segments are mounted again)?"""
        key = f"kvfs/{self.name}/probe/{self.member}"
        self._client.remove(key, True)
        if self._client.put_from(key, self._publish_buf.addr, 1, self.replicate) != 0:
            return False
        self._client.remove(key, True)
        return True

    def defer(self, tag: int | None, *, tried: bool = False) -> None:
        """The file *tag* was not published (the pod is away): keep it for when it is
        back (`unpublished`: the caller publishes them again after `wait_up`), unless it
        was put (*tried*) PUT_ATTEMPTS times already."""
        if tag is None:
            self.counters.dropped += 1
            return
        attempts = self.unpublished.pop(tag, 0) + tried
        if attempts >= PUT_ATTEMPTS:
            self.counters.dropped += 1
            return
        self.unpublished[tag] = attempts
        while len(self.unpublished) > UNPUBLISHED_MAX:
            del self.unpublished[next(iter(self.unpublished))]
            self.counters.dropped += 1

    def _connect(self) -> Any:
        """Worker thread: a Mooncake client set up and our buffers registered, or None."""
        client = self.store_class()
        local = _local_address(self.host, self.port)
        rc = client.setup(local, "P2PHANDSHAKE", self.segment_size, 0, "tcp", "", self.master)
        for buf in (self._head_buf, self._fetch_buf, self._publish_buf):
            if rc == 0:
                rc = client.register_buffer(buf.addr, buf.size)
        if rc != 0:
            self._count("errors")
            log.warning("pod: cannot join the pod at %s (Mooncake returned %d); retrying",
                        self.master, rc)
            client.close()
            return None
        log.info("pod: joined the pod %r at %s as %s (%s of memory)", self.name, self.master,
                 local, self.segment_size)
        return client

    async def close(self) -> None:
        """Leave the pod (after run() was cancelled): the client unmounts its segment."""
        self._decoder.shutdown(wait=False)
        client, self._client = self._client, None
        if client is None:
            return
        # Kept: Mooncake's destructor unmounts the segment again, holding the GIL for ~11 s
        # when the master is away (the daemon ends with os._exit, which runs no destructor).
        self._left_client = client
        # Mooncake's close with a dead master retries its segment's unmount for ~11 s, and
        # at times holds the GIL meanwhile: not tried then (the master lets go of this
        # member after its client_ttl, as after a crash).
        # A master that takes connections but does not answer (stopped, overloaded, a
        # network that drops replies) holds the close as long, GIL and all (~60 s, measured
        # with a SIGSTOPped master): a bounded call on the lookup lane must answer first.
        if not (await trio.to_thread.run_sync(self._master_listens)
                and await self._call(self._lookup_lane, CLOSE_S / 4, self._ask_master, client)):
            log.warning("pod: the master %s does not answer; leaving without telling it",
                        self.master)
            return
        # Calls abandoned by their callers may still be running on the lanes: wait for them,
        # and for the close, at most CLOSE_S.
        with trio.move_on_after(CLOSE_S):
            async with self._lookup_lane.limiter, self._fetch_lane.limiter:
                await trio.to_thread.run_sync(client.close, limiter=self._publish_lane.limiter,
                                              abandon_on_cancel=True)
            return
        log.warning("pod: leaving the pod at %s did not finish within %.1f s", self.master,
                    CLOSE_S)

    def _ask_master(self, client: Any) -> bool:
        """Worker thread: a lookup of a name nobody has (it releases the GIL while it
        waits), True once the master answered it at all."""
        client.batch_get_into([f"kvfs/{self.name}/probe/{self.member}"],
                              [self._head_buf.addr], [HEAD_MAX])
        return True

    def _master_listens(self) -> bool:
        try:
            socket.create_connection((self.host, self.port), timeout=CLOSE_S / 4).close()
        except OSError:
            return False
        return True

    async def _count_members(self) -> None:
        while True:
            self.members = await trio.to_thread.run_sync(self._read_members,
                                                         abandon_on_cancel=True)
            await trio.sleep(MEMBERS_EVERY_S)

    def _read_members(self) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=1) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("master_active_clients "):
                        return int(float(line.split()[1]))
        except (OSError, ValueError):
            pass
        return None

    def _count(self, name: str, n: int = 1) -> None:
        """Worker threads count too (an abandoned call still finishes and counts)."""
        with self._count_lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    async def _call(self, lane: _Lane, timeout: float, fn: Callable[..., T],
                    *args: Any) -> T | None:
        """fn(*args) on *lane*'s thread, or None if that takes more than *timeout*."""
        if lane.stuck(timeout):
            self._count("timeouts")
            return None
        with trio.move_on_after(timeout):
            return await trio.to_thread.run_sync(lane.run, fn, *args, limiter=lane.limiter,
                                                 abandon_on_cancel=True)
        self._count("timeouts")
        return None

    # -- publishing ---------------------------------------------------------------------

    def can_take(self, nbytes: int) -> bool:
        """Could a file of *nbytes* (raw: its records are at most that plus headers) be
        queued now? If not it is counted as dropped, and its caller need not read it."""
        if self._client is None or nbytes > self.max_object or (
                self.queued_bytes + nbytes > self.queue_bytes):
            self.counters.dropped += 1
            return False
        return True

    def publish(self, path: str, records: Sequence[tuple[int, bytes]], *, version: int,
                mode: int, size: int, mtime_ns: int, chunk_size: int,
                tag: int | None = None) -> bool:
        """Queue a complete file for the pod: its records (chunk number, header + payload)
        in chunk order. Never waits: False (and counted) if it was dropped instead. A file
        whose put fails is kept (`defer`) under *tag*, if given."""
        entries, off = [], 0
        for c, rec in records:
            entries.append((c, off, len(rec)))
            off += len(rec)
        head = PodHead(path, self.member, version, mode, size, mtime_ns, chunk_size,
                       tuple(entries))
        head_bytes = encode_head(head)
        if (self._client is None or off > self.max_object or len(head_bytes) > HEAD_MAX
                or self.queued_bytes + off > self.queue_bytes):
            self.counters.dropped += 1
            return False
        self.queued_bytes += off
        self._send.send_nowait(_Job(head, head_bytes, [rec for _, rec in records], tag))
        return True

    def _put(self, job: _Job) -> bool:
        """Worker thread: the data object, then the head that names it (replacing the
        previous version's: Mooncake keeps a key's first value, so it is removed first)."""
        mem, off = self._publish_buf.mem, 0
        for rec in job.records:
            mem[off:off + len(rec)] = rec
            off += len(rec)
        client = self._client
        # A file without records (empty, or all holes) is its head alone.
        rc = (client.put_from(self.data_key(job.head), self._publish_buf.addr, off,
                              self.replicate) if off else 0)
        if rc == 0:
            mem[off:off + len(job.head_bytes)] = job.head_bytes
            client.remove(self.head_key(job.head.path), True)  # absent is fine
            rc = client.put_from(self.head_key(job.head.path), self._publish_buf.addr + off,
                                 len(job.head_bytes), self.replicate)
        if rc != 0:
            self._count("errors")
            log.debug("pod: publishing %r failed (Mooncake returned %d)", job.head.path, rc)
            return False
        self._count("published_files")
        self._count("published_bytes", off)
        return True

    # -- lookups ------------------------------------------------------------------------

    async def lookup(self, path: str) -> PodHead | None:
        """The head of *path* if some member published it, else None (also on any failure),
        within the timeout."""
        t0 = time.perf_counter()
        self.counters.lookups += 1
        head = self._known(path)
        if head is None and self._client is not None and path not in self._misses:
            await self._batched(path)
            head = self._known(path)
        if head is None:
            self.counters.misses += 1
        else:
            self.counters.hits += 1
        self._latencies_us.append(int((time.perf_counter() - t0) * 1e6))
        return head

    def _known(self, path: str) -> PodHead | None:
        now = time.monotonic()
        until = self._misses.get(path)
        if until is not None and until < now:
            del self._misses[path]
        cached = self._heads.get(path)
        if cached is None:
            return None
        if cached[0] < now:
            del self._heads[path]
            return None
        return cached[1]

    def forget(self, path: str) -> None:
        """Drop what the caches say of *path* (e.g. the caller found it damaged)."""
        self._misses.pop(path, None)
        self._heads.pop(path, None)

    async def _batched(self, path: str) -> None:
        """Wait until a batch answered *path* (into the caches) or the timeout passed. The
        first waiter runs a batch of every path wanted; the others wait for it and for the
        next one, so concurrent lookups share Mooncake calls."""
        self._wanted.add(path)
        try:
            with trio.move_on_after(self.timeout):
                while path in self._wanted:
                    if self._batching is None:
                        await self._run_batch()
                    else:
                        await self._batching.wait()
        finally:
            self._wanted.discard(path)

    async def _run_batch(self) -> None:
        paths = list(self._wanted)[:BATCH_MAX]
        done = self._batching = trio.Event()
        try:
            answers = await self._call(self._lookup_lane, self.timeout, self._get_heads, paths)
        finally:
            self._wanted.difference_update(paths)
            self._batching = None
            done.set()
        if answers is None:
            return
        now = time.monotonic()
        for path, head in answers.items():
            if head is None:
                self._misses[path] = now + self.miss_ttl
            else:
                self._heads[path] = (now + self.hit_ttl, head)
        for cache in (self._misses, self._heads):
            while len(cache) > CACHE_MAX:
                del cache[next(iter(cache))]

    def _get_heads(self, paths: list[str]) -> dict[str, PodHead | None]:
        """Worker thread: every path's head, None where there is none; a path whose call
        failed otherwise (a dead member, no master) is left out (a miss, not remembered)."""
        buf = self._head_buf
        rcs = self._client.batch_get_into(
            [self.head_key(p) for p in paths], [buf.addr + i * HEAD_MAX for i in range(len(paths))],
            [HEAD_MAX] * len(paths))
        out: dict[str, PodHead | None] = {}
        for i, (path, rc) in enumerate(zip(paths, rcs, strict=True)):
            if rc == OBJECT_NOT_FOUND:
                out[path] = None
            elif rc <= 0:
                self._count("errors")
            else:
                try:
                    out[path] = decode_head(buf.mem[i * HEAD_MAX:i * HEAD_MAX + rc], path)
                except PodObjectError as e:
                    self._count("damaged")
                    log.warning("pod: %s", e)
                    out[path] = None
        return out

    # -- fetches ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def fetched(self, head: PodHead, landing: Landing | None = None
                      ) -> AsyncIterator[PodFile | None]:
        """The file *head* names, every record checked, or None (a miss: gone, damaged,
        too slow, no pod). Its chunks are views of a buffer the next fetch reuses: valid
        inside the `async with` only (fetches take turns). With *landing*, they are
        written there instead (see decode_data); after a miss the caller cancels it."""
        async with self._landing:
            yield await self._fetch(head, landing)

    async def _fetch(self, head: PodHead, landing: Landing | None) -> PodFile | None:
        if self._client is None or head.data_len > self.max_object:
            return None
        if not head.entries:
            return PodFile(head, {}, memoryview(b""), landing=landing)
        timeout = self.timeout + head.data_len / FETCH_FLOOR_BPS
        got = await self._call(self._fetch_lane, timeout, self._get_data, head, landing)
        if got is None:
            self.forget(head.path)
        return got

    def _get_data(self, head: PodHead, landing: Landing | None) -> PodFile | None:
        """Worker thread: get_into our buffer, then check and decode from there into the
        landing buffer (or *landing*), in two threads."""
        n = head.data_len
        rc = self._client.get_into(self.data_key(head), self._fetch_buf.addr, n)
        if rc != n:
            if rc != OBJECT_NOT_FOUND:
                self._count("errors")
            return None
        if landing is None and head.size > self._land_buf.size:  # (another member's file,
            self._land_buf = _Buffer(head.size)                   # over our max_object)
        try:
            got = decode_data(head, memoryview(self._fetch_buf.mem)[:n], self.codec,
                              memoryview(self._land_buf.mem), self._decoder, landing)
        except LandingCancelled:
            return None  # (its caller gave up on it already)
        except PodObjectError as e:
            self._count("damaged")
            log.warning("pod: %s", e)
            return None
        self._count("fetched_bytes", n)
        return got

    # -- status -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """`kvfsctl status`'s pod section."""
        lat = sorted(self._latencies_us)

        def pct(p: float) -> int:
            return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else 0

        c = self.counters
        return {"master": self.master, "name": self.name, "member": self.member,
                "connected": self.connected, "members": self.members,
                "lookups": c.lookups, "hits": c.hits, "misses": c.misses,
                "published_files": c.published_files, "published_bytes": c.published_bytes,
                "fetched_bytes": c.fetched_bytes, "errors": c.errors, "timeouts": c.timeouts,
                "damaged": c.damaged, "dropped": c.dropped, "queued_bytes": self.queued_bytes,
                "up": self.up, "unpublished": len(self.unpublished),
                "lookup_p50_us": pct(0.50), "lookup_p99_us": pct(0.99)}

