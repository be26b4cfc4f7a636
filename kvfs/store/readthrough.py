"""Read-through: big NVMe-resident files read through the daemon, chunks read ahead of a
sequential reader into the daemon's memory (its read-through buffer; not the DRAM tier,
which kvfs/readahead's prefetches fill), and promoted only when read again.

A reader of a file at least `read_through_min` long (an option) is not staged: staging such
a file costs fresh tmpfs pages and a second copy for every byte, and the reader waits for
all of it before its first byte; reading through overlaps the disk with the copies to the
reader. READ_AHEAD_BYTES ahead of a sequential reader are in flight or ready, each chunk read
by its own worker (a read elsewhere is a seek: read on demand, nothing ahead). A chunk read
ahead is offered to the AheadServer (the shim's front thread), which answers the READs that
fall within it without the trio thread; anything that changes the chunk's location first
withdraws it (`changing`). docs/DESIGN.md, "Bigger files are read through".

Runs on the trio thread; reads are fetches (kvfs.store.chunkstore `fetch`) in the daemon's
nursery (`start_tasks`).
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol

import trio

from kvfs.store.codec import CODEC_RAW
from kvfs.store.dram import pages
from kvfs.store.location import LOST, ChunkError, Loc
from kvfs.store.nvme import BLOCK

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

log = logging.getLogger(__name__)

READ_AHEAD_BYTES = 8 << 20  # per sequential reader, in flight or ready (at least 2 chunks)
# The read-ahead memory (RAM beyond the DRAM tier) is READ_AHEAD_READERS x READ_AHEAD_BYTES,
# but at most half the DRAM tier's size (at least 2 chunks).
READ_AHEAD_READERS = 4
# A chunk read ahead on a prediction and not read within this long may make room for others.
AHEAD_STALE_S = 2.0
# Chunks of read-through files read once are remembered, up to this many DRAM tiers' worth:
# a chunk read again meanwhile is reused, and is promoted into DRAM.
READ_THROUGH_SEEN_SHARE = 2
# NVMe reads keep a clean DRAM copy while DRAM holds less than this share (no eviction for
# a promotion: the demoter keeps room for writes below the high watermark); so does a
# promotion of a reused chunk here.
PROMOTE_SHARE = 0.9
# What `use` says when the chunk changed while its reader waited: start over.
CHANGED = object()


class AheadServer(Protocol):
    """Answers READs from chunks read ahead, without the trio thread (the shim's front
    thread, kvfs._fuseshim): `ReadThrough.front_read` is told of each READ it answered."""

    def ahead_offer(self, ino: int, chunk: int, data: bytes) -> bool:
        """Answer READs within *data* (kept alive and unchanged by the caller) until
        withdrawn or read to its end. False: not taken."""

    def ahead_withdraw(self, ino: int, chunk: int) -> None:
        """No more READs are answered from the chunk once this returns."""

    def ahead_quiet(self) -> tuple[int, list[int]]:
        """The READs answered without a `front_read` notice since the last call (those in
        the middle of a chunk already noticed): how many, and their latency histogram."""


@dataclass(eq=False)
class _Ahead:
    """A chunk read ahead of a sequential reader into the daemon's memory."""
    loc: Loc  # the location it was read from: used only while the chunk is still there
    done: trio.Event = field(default_factory=trio.Event)
    since: float = field(default_factory=time.monotonic)
    data: bytes | memoryview | None = None  # verified bytes, None until done or if it failed
    served: bool = False  # offered to the AheadServer (withdrawn before anything changes)
    # The read buffer a raw record was read into (data is a view of it). It goes back to
    # the pool when the chunk is dropped: nobody may use data after that.
    buf: mmap.mmap | None = None


class ReadThrough:
    def __init__(self, store: ChunkStore, *, chunk_size: int, dram_size: int,
                 read_through_min: int) -> None:
        self.store = store
        self.cs = chunk_size
        # files at least this long (0: none) are read through
        self.read_through_min = read_through_min
        self.spawn: Callable | None = None  # starts a read-ahead task (`start_tasks`)
        self.ahead_server: AheadServer | None = None  # (`serve`)
        self._ahead: dict[tuple[int, int], _Ahead] = {}  # oldest first
        self._ahead_bytes = 0
        self._ahead_max = max(2 * chunk_size,
                              min(READ_AHEAD_READERS * READ_AHEAD_BYTES, dram_size // 2))
        self._ahead_window = max(2, min(READ_AHEAD_BYTES, self._ahead_max) // chunk_size)
        self._next_read: dict[int, int] = {}  # read-through file -> chunk its reader reads next
        # Files an O_DIRECT reader has open (`read_direct`), read through whatever their size
        self._direct: set[int] = set()
        self._ahead_buffers: list[mmap.mmap] = []  # read buffers of dropped chunks, for reuse
        # Chunks of read-through files read once lately (oldest first): a second read
        # promotes them (`done`).
        self._seen_through: dict[tuple[int, int], bool] = {}
        self._seen_max = max(1024, READ_THROUGH_SEEN_SHARE * dram_size // chunk_size)

    def start_tasks(self, spawn: Callable) -> None:
        """Read ahead in tasks *spawn* starts (the daemon's nursery's start_soon)."""
        self.spawn = spawn

    def serve(self, server: AheadServer) -> None:
        """Offer each chunk read ahead to *server* (the shim's front thread)."""
        self.ahead_server = server

    def close(self) -> None:
        for key, ahead in list(self._ahead.items()):
            self.drop(key, ahead)  # (withdrawn: no READ copies from them after this)

    def changing(self, ino: int, c: int) -> None:
        """Chunk *c* of *ino* is about to change its location: its bytes read ahead may be
        old from now on, so the AheadServer answers no more READs from them."""
        ahead = self._ahead.get((ino, c)) if self._ahead else None
        if ahead is not None and ahead.served:
            self._withdraw(ino, c, ahead)

    async def use(self, key: tuple[int, int], loc: Loc, start: int,
                  length: int) -> bytes | memoryview | object | None:
        """The bytes of chunk *key* (at *loc*) read ahead, for a read of [start,
        start+length) of it; None if there are none (the read fetches it, and says why the
        read-ahead failed: EIO), CHANGED if the chunk changed while this waited."""
        ahead = self._ahead.get(key)
        if ahead is not None and ahead.loc != loc:
            self.drop(key, ahead)  # read before the chunk changed
            ahead = None
        if ahead is None:
            return None
        await ahead.done.wait()
        # (Dropped meanwhile, by another reader say: its buffer may be reused.)
        data = ahead.data if self._ahead.get(key) is ahead else None
        if data is not None and self.store.get(*key) != loc:
            return CHANGED
        if start + length >= loc.raw_len or data is None:
            self.drop(key, ahead)  # the reader is done with it, or failed
        if data is not None:
            self.store.counters.through_buffer_used += start + length >= loc.raw_len
        return data

    def reads(self, ino: int, size: int | None = None) -> bool:
        """Is this file read from NVMe through the daemon (read-ahead, no staging, no
        promotion, no prefetch into DRAM)? Files of at least `read_through_min` bytes are."""
        if not self.read_through_min:
            return False
        if ino in self._direct:
            return True
        if size is None:
            size = self.store.events.size_of(ino)
        return size is not None and size >= self.read_through_min

    def read_direct(self, ino: int) -> None:
        """An O_DIRECT reader opened *ino*: until its last handle closes (`end`), its
        NVMe-only chunks are read through, whatever its size, not staged in DRAM. Such a
        reader keeps its own cache (vLLM's CPU tier, Dynamo's host blocks): staging the
        file costs a tmpfs copy of every byte and the open waits for all of it (vLLM's 2
        MiB blocks, 16 reader threads: 0.37-0.42x a cold ext4 directory staged, 0.68-0.73x
        read through). A file wholly in DRAM is still read by the kernel (passthrough)."""
        if self.read_through_min:
            self._direct.add(ino)

    def start(self, ino: int, size: int) -> None:
        """A reader opened a read-through file: start reading its first chunks."""
        self.sequential(ino, 0, 0, self.store.nchunks(size))

    def sequential(self, ino: int, c: int, last: int, nchunks: int,
                   next_chunk: int | None = None) -> None:
        """A read of chunks c..last of a read-through file (*next_chunk*: the one its next
        read would be if it goes on): if it goes on where the last read ended (or at the
        start), have them and READ_AHEAD_BYTES after them in flight or ready, each chunk
        read by its own worker. A read elsewhere is a seek: its chunks are read on demand,
        and nothing ahead of them."""
        go_on = not c or self._next_read.get(ino) == c or (ino, c) in self._ahead
        if next_chunk is not None:
            self._next_read[ino] = next_chunk
        if self.spawn is None or not go_on:
            return
        for n in range(c, min(last + 1 + self._ahead_window, nchunks)):
            loc = self._candidate(ino, n)
            if loc is None:
                continue
            if self._ahead_bytes + loc.raw_len > self._ahead_max and not self._evict(ino):
                return
            self._start((ino, n), loc)

    def predicted(self, ino: int, c: int) -> None:
        """Readahead predicts a read of chunk *c* of read-through file *ino* (the next file
        of a write-order chain, say): read it ahead into memory, within half the read-ahead
        memory (the rest is for the readers' own windows)."""
        loc = self._candidate(ino, c) if self.spawn is not None else None
        if loc is None:
            return
        if self._ahead_bytes + loc.raw_len > self._ahead_max // 2 and not self._evict(
                ino, older_than=time.monotonic() - AHEAD_STALE_S):
            return
        self._start((ino, c), loc)

    def _candidate(self, ino: int, c: int) -> Loc | None:
        """The location of an NVMe-only chunk to read ahead, or None."""
        key = (ino, c)
        if key in self._ahead or self.store.fetches.busy(key):
            return None
        loc = self.store.get(ino, c)
        if loc is None or loc.dram_slot >= 0 or loc.flags & LOST:
            return None
        return loc

    def _start(self, key: tuple[int, int], loc: Loc) -> None:
        ahead = self._ahead[key] = _Ahead(loc)
        self._ahead_bytes += loc.raw_len
        self.store.counters.through_buffered += 1
        self.spawn(self._background, "read-through buffer", partial(self._buffer_ahead, key, ahead))

    def _evict(self, ino: int, older_than: float | None = None) -> bool:
        """Make room for one more read-ahead chunk of *ino* by dropping the oldest ready
        chunk of another file (its reader went elsewhere, or is slower; a predicted read
        only takes one that waited longer than AHEAD_STALE_S). False if none."""
        for key, ahead in self._ahead.items():
            if older_than is not None and ahead.since > older_than:
                return False  # (oldest first: the rest are younger still)
            if key[0] != ino and ahead.done.is_set():
                self.drop(key, ahead)
                return True
        return False

    async def _buffer_ahead(self, key: tuple[int, int], ahead: _Ahead) -> None:
        if ahead.loc.codec == CODEC_RAW:  # read and kept in a buffer of its own: no copy
            ahead.buf = (self._ahead_buffers.pop() if self._ahead_buffers
                         else mmap.mmap(-1, self.cs + BLOCK))
        try:
            ahead.data = await self.store.fetches.fetch(key[0], key[1], ahead.loc, stage=None,
                                                into=ahead.buf)
        except ChunkError:
            ahead.data = None  # the reader's own fetch will report it
        finally:
            ahead.done.set()
            if ahead.data is None:
                self.drop(key, ahead)
        now = self.store.get(*key)
        if (self.ahead_server is not None and self._ahead.get(key) is ahead
                and now is not None and now.seq == ahead.loc.seq):
            ahead.served = self.ahead_server.ahead_offer(key[0], key[1], ahead.data)

    def front_read(self, ino: int, off: int, size: int, file_size: int, us: int) -> None:
        """The AheadServer answered a READ of *size* bytes at *off* of read-through file
        *ino* from chunks read ahead, in *us* microseconds: what `read` would have done
        besides the copy (more read-ahead, counters, the chunks read to their end)."""
        cs = self.cs
        first, last = off // cs, (off + size - 1) // cs
        self.sequential(ino, first, last, self.store.nchunks(file_size), (off + size) // cs)
        self.store.counters.front_reads += 1
        self.store.counters.front_notices += 1
        self.count_quiet()
        for c in range(first, last + 1):
            self.store.counters.count_read("nvme", off <= c * cs)
            self.store.record_us(us, self.store.counters.read_latency_nvme_us)
            ahead = self._ahead.get((ino, c))
            if ahead is None or ahead.data is None:
                continue
            if min(off + size, (c + 1) * cs) - c * cs >= ahead.loc.raw_len:
                ahead.served = False  # the front thread dropped it: read to its end
                self.store.counters.through_buffer_used += 1
                self.done(ino, c, ahead.loc, ahead.data)
                self.drop((ino, c), ahead)

    def count_quiet(self) -> None:
        """Count the READs the AheadServer answered without a notice (nothing else to do
        for them: they changed nothing `front_read` acts on)."""
        if self.ahead_server is None:
            return
        n, hist = self.ahead_server.ahead_quiet()
        if not n:
            return
        k = self.store.counters
        k.front_reads += n
        k.requests_from_nvme += n
        for bucket, count in enumerate(hist):
            k.read_latency_us[bucket] += count
            k.read_latency_nvme_us[bucket] += count

    def _withdraw(self, ino: int, c: int, ahead: _Ahead) -> None:
        ahead.served = False
        self.ahead_server.ahead_withdraw(ino, c)

    def done(self, ino: int, c: int, loc: Loc, data) -> None:
        """A reader has read a whole chunk of a read-through file. The second time that
        happens while the chunk is remembered (the last READ_THROUGH_SEEN_SHARE x DRAM's
        worth of such chunks), the chunk is reused: its bytes are copied into DRAM in the
        background, if there is room without evicting anything (a promotion)."""
        key = (ino, c)
        if not self._seen_through.pop(key, False):
            self._seen_through[key] = True
            if len(self._seen_through) > self._seen_max:
                del self._seen_through[next(iter(self._seen_through))]
            return
        store = self.store
        if (self.spawn is not None and not store.fetches.busy(key)
                and store.promotion_room(pages(loc.raw_len))):
            self.spawn(self._background, "promotion of a reused chunk", partial(
                store.fetches.fetch, ino, c, loc, stage=store.dram.capacity * PROMOTE_SHARE,
                raw=True, want=False,
                have=bytes(data) if isinstance(data, memoryview) else data,
                limiter=store.fetches.prefetch_limiter))

    @staticmethod
    async def _background(what: str, job: Callable) -> None:
        """Run a task of the daemon's nursery that nobody waits for: a failure is logged,
        never let out (it would end the daemon)."""
        try:
            await job()
        except Exception:
            log.exception("%s failed", what)

    def drop(self, key: tuple[int, int], ahead: _Ahead) -> None:
        """Forget a chunk read ahead. Its bytes are gone after the caller's next await (its
        buffer is reused): a reader still waiting for it must read the chunk itself."""
        if ahead.served:
            self._withdraw(*key, ahead)
        if self._ahead.get(key) is ahead:
            del self._ahead[key]
            self._ahead_bytes -= ahead.loc.raw_len
            if ahead.buf is not None and ahead.done.is_set():  # (else the read still uses it)
                if len(self._ahead_buffers) < self._ahead_max // self.cs + 2:
                    self._ahead_buffers.append(ahead.buf)
                ahead.buf = None

    def end(self, ino: int) -> None:
        """The file's last handle is closed: what was read ahead for it goes."""
        self._next_read.pop(ino, None)
        self._direct.discard(ino)
        for key in [k for k in self._ahead if k[0] == ino]:
            self.drop(key, self._ahead[key])
