"""Access prediction and the prefetch scheduler.

The filesystem reports events (a file opened, created, read, closed, forgotten; an explicit
hint). Predictors (`predictors.py`) turn them into chunks expected to be read soon; each
reader (a calling thread: FUSE gives its pid) keeps a *window* of the next chunks predicted
for it; the scheduler (`scheduler.py`) stages the NVMe-resident ones in DRAM through
`ChunkStore.prefetch`, bounded, earliest deadline first, demand reads first.

Predictors, all feeding the same windows and scheduler:
- whole-file readahead: reading chunk c of a file predicts chunks c+1, c+2, ...;
- write-order chains: the order in which one caller created files (usable before any read);
- the learned successor graph: the order in which each caller read files;
- explicit hints (`user.kvfs.prefetch`, `kvfsctl prefetch`, `kvfs.client.prefetch`).

The DRAM policy asks three questions (`DramPolicy.keep`, `.cheap` and `.unpredicted`):
- keep(key): is the chunk predicted to be read soon? Then victims pass over it while anything
  else is left, so new writes cannot flush staged chunks before they are read. A window lets
  go of chunks the reader skipped, and of all of them when it reads something unpredicted
  (the prediction was wrong) or goes idle: such chunks are then ordinary probation chunks.
- cheap(key): was this read predicted more than `lead` reads ahead (the lead is the measured
  prefetch latency over the measured time a reader spends per chunk)? Then prediction would
  stage it again in time, so a read hit puts it at the cold end of protected: still safe
  from write scans, but the first to fall back to probation. What keeps its place in
  protected is what prediction cannot bring in time: the first chunks of a run (a caller's
  burst of accesses), read or written, since nothing precedes them. Files written at the
  start of a run are protected when closed, for the same reason.
- unpredicted(key): is a read that nothing predicted fetching this chunk from NVMe? Then the
  copy it brings into DRAM enters protected (as a hit would), not probation: the next read
  of it will be just as unpredictable (on the Mooncake trace: the first block of a request).

With prediction off (`prefetch=off` or `readahead_chunks=0`) none of this is attached: the
policy is the plain SLRU and no chunk is ever prefetched (hints are accepted and ignored).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

import trio

from kvfs.readahead.predictors import (
    KIND_HINT,
    KIND_READ,
    KIND_WRITE,
    CallerStreams,
    HintBook,
    Key,
    SuccessorGraph,
    predict,
)
from kvfs.readahead.scheduler import Scheduler, Tuning
from kvfs.store.meta import from_u64, u64

log = logging.getLogger(__name__)

# Two accesses by one caller further apart than this are not one run (engines read a
# request's blocks in one burst); also how long an idle reader's window is kept.
IDLE_S = 1.0
# Staged-but-unread chunks may fill at most this share of DRAM.
BUDGET_SHARE = 0.25
HINT = "hint"  # owner of hinted chunks
# The learned order is saved to lmdb this often (and at unmount), so that a restarted daemon
# predicts from its first read; losing the last interval to a crash costs only predictions.
SAVE_INTERVAL_S = 1.0
# A read spanning more chunks than this steps through the chunks its file has, not its holes.
SPARSE_SCAN_CHUNKS = 64
# lmdb table `successors`: ino u64 (big-endian key) -> successor u64, edge kind u8.
_SUCC = struct.Struct("<QB")
_KIND_CODES = {KIND_WRITE: 0, KIND_READ: 1}
_CODE_KINDS = {v: k for k, v in _KIND_CODES.items()}


class Reader:
    """One caller's position in its own access order and its window of predicted chunks."""

    __slots__ = ("pid", "pos", "run_start", "cur", "last_t", "window", "held", "held_owned")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pos = 0  # chunks read (and files written) so far
        self.run_start = 0  # pos where the current run (no idle gap) began
        self.cur: Key | None = None
        self.last_t = 0.0
        self.window: OrderedDict[Key, int] = OrderedDict()  # key -> pos when predicted
        self.held: Key | None = None  # opened, not read yet: still protected
        self.held_owned = False  # ... because this reader had predicted it

    def __repr__(self) -> str:
        return f"Reader({self.pid})"


class Readahead:
    """Event sink for the filesystem: predictors, per-reader windows, the scheduler."""

    def __init__(self, store, *, depth: int, enabled: bool = True,
                 size_of: Callable[[int], int | None] | None = None,
                 concurrency: int | None = None, bandwidth: int = 0,
                 clock: Callable[[], float] = time.monotonic, meta=None) -> None:
        self.store = store
        self.meta = meta  # MetaStore to keep the learned order in (None: not kept)
        # An access trace being recorded (kvfs/trace.py, `kvfsctl trace`): told of every
        # open and create, which this object sees all of (passthrough's opens too).
        self.tracer = None
        self.enabled = bool(enabled and depth > 0)
        self.size_of = size_of
        self.clock = clock
        self.graph = SuccessorGraph()
        self.streams = CallerStreams(idle_s=IDLE_S)
        self.hints = HintBook()
        self.tuning = Tuning(max(1, depth))
        if concurrency is None:
            concurrency = store.prefetch_limiter.total_tokens
        budget = max(4, int(BUDGET_SHARE * store.dram.capacity) // store.cs)
        self.sched = Scheduler(store, self.tuning, concurrency=concurrency, bandwidth=bandwidth,
                               budget_chunks=budget, clock=clock)
        self.readers: OrderedDict[int, Reader] = OrderedDict()
        self._cheap: OrderedDict[Key, None] = OrderedDict()
        # Chunks just read (or opened) with nothing predicting them: if the read has to fetch
        # one from NVMe, the policy protects the copy it brings in (DramPolicy.unpredicted).
        self._unpredicted: OrderedDict[Key, None] = OrderedDict()
        self._heads: set[int] = set()  # files written at the start of a run, still open
        self.cheap_hits = 0
        self.unpredicted_fetches = 0
        self.hints_ignored = 0
        if self.enabled:
            store.policy.keep = self.sched.wanted
            store.policy.deadline = self.sched.deadline
            store.policy.cheap = self._take_cheap
            store.policy.unpredicted = self._take_unpredicted

    # -- events from fs (trio thread, must not block) ---------------------------------------
    def opened(self, ino: int, flags: int, size: int, pid: int) -> None:
        if self.tracer is not None:
            self.tracer.access(ino, pid)
        if not self.enabled:
            return
        if flags & os.O_ACCMODE == os.O_WRONLY:
            self._wrote(pid, ino)
        else:
            self._read(pid, (ino, 0), self.clock(), opening=True)

    def created(self, ino: int, parent: int, pid: int) -> None:
        if self.tracer is not None:
            self.tracer.access(ino, pid)
        if self.enabled:
            self._wrote(pid, ino)

    def read(self, ino: int, off: int, size: int, pid: int) -> None:
        if not self.enabled or size <= 0:
            return
        cs = self.store.cs
        end = off + size
        if self.size_of is not None:
            fsize = self.size_of(ino)
            if fsize is not None:
                end = min(end, fsize)  # the read at EOF that ends every read loop is no step
        if end <= off:
            return
        now = self.clock()
        first, last = off // cs, (end - 1) // cs
        chunks: Iterable[int] = range(first, last + 1)
        if last - first >= SPARSE_SCAN_CHUNKS:
            # A long range (the whole file at a passthrough open): only the chunks the file
            # has are steps. A sparse file of a TiB would otherwise take hours of steps
            # through its holes, with every request waiting.
            chunks = [c for c in self.store.index.chunks_of(ino, last + 1) if c >= first]
        for c in chunks:
            self._read(pid, (ino, c), now)

    def read_whole(self, ino: int, size: int, pid: int) -> None:
        """The kernel reads *ino* without kvfs (passthrough): each of its chunks counts as
        read, not its holes (a sparse file may be far bigger than what it holds)."""
        if not self.enabled:
            return
        now = self.clock()
        for c in self.store.index.chunks_of(ino, self._nchunks(ino, size)):
            self._read(pid, (ino, c), now)

    def closed(self, ino: int, pid: int) -> None:
        if ino in self._heads:
            # A file written at the start of a caller's run: nothing before it predicts it,
            # so when it is read again, no prefetch will have brought it in. Treat its
            # chunks like a read hit that prediction did not see coming (protected).
            self._heads.discard(ino)
            for c in self.store.index.chunks_of(ino, self._nchunks(ino)):  # not its holes
                loc = self.store.get(ino, c)
                if loc is not None and loc.dram_slot >= 0:
                    self.store.policy.hit((ino, c))

    def forgotten(self, ino: int) -> None:
        if not self.enabled:
            return
        self.graph.forget(ino)
        self.streams.forget(ino)
        self._heads.discard(ino)
        for key in self.hints.forget(ino):
            self.sched.unwant(key, HINT)
        for r in self.readers.values():
            if r.held is not None and r.held[0] == ino:
                self._release_held(r)
            for key in [k for k in r.window if k[0] == ino]:
                del r.window[key]
                self.sched.unwant(key, r)

    def hint(self, ino: int, size: int) -> None:
        """An engine says it will read this file soon (user.kvfs.prefetch)."""
        if not self.enabled:
            self.hints_ignored += 1
            return
        now = self.clock()
        for c in self.store.index.chunks_of(ino, self._nchunks(ino, size)):  # not its holes
            key = (ino, c)
            if self.hints.add(key, now):
                self.sched.want(key, HINT, now, KIND_HINT)

    def want(self, ino: int, c: int) -> None:
        """Stage one chunk as if hinted (kept for callers of the first interface)."""
        if self.enabled and self.hints.add((ino, c), self.clock()):
            self.sched.want((ino, c), HINT, self.clock(), KIND_HINT)

    # -- the policy's questions --------------------------------------------------------------
    def _take_unpredicted(self, key: Key) -> bool:
        if key in self._unpredicted:
            del self._unpredicted[key]
            self.unpredicted_fetches += 1
            return True
        return False

    def _take_cheap(self, key: Key) -> bool:
        if key in self._cheap:
            del self._cheap[key]
            self.cheap_hits += 1
            return True
        return False

    # -- per-caller access order and windows -------------------------------------------------
    def _reader(self, pid: int) -> Reader:
        r = self.readers.get(pid)
        if r is None:
            r = self.readers[pid] = Reader(pid)
            while len(self.readers) > self.streams.max_callers:
                _, old = self.readers.popitem(last=False)
                self._drop_window(old)
        else:
            self.readers.move_to_end(pid)
        return r

    def _wrote(self, pid: int, ino: int) -> None:
        """*pid* created (or opened for writing) *ino*: a step of its write order."""
        now = self.clock()
        r = self._reader(pid)
        if self.streams.new_run(pid, now, write=True):
            r.run_start = r.pos
        prev, _ = self.streams.step(pid, ino, now, write=True)
        if prev is not None:
            self.graph.link(prev, ino, KIND_WRITE)
        self._drop_window(r)  # a writer is not reading what we predicted
        if r.pos - r.run_start <= self.tuning.lead:
            self._heads.add(ino)
            while len(self._heads) > 4096:
                self._heads.pop()
        r.pos += 1
        r.cur = None
        r.last_t = now

    def _read(self, pid: int, key: Key, now: float, *, opening: bool = False) -> None:
        """*pid* reads *key* (or, *opening*, is about to: open comes before the read, and the
        chunk stays protected until the read itself arrives)."""
        r = self._reader(pid)
        if r.cur == key:
            if not opening:
                self._release_held(r)
            return
        self._release_held(r)
        if r.cur is not None:
            self._unpredicted.pop(r.cur, None)  # its read is over: it was a hit, or fetched
        ino = key[0]
        if r.cur is not None and now - r.last_t <= IDLE_S:
            self.tuning.observe_gap(now - r.last_t)
        if r.cur is None or r.cur[0] != ino:
            if self.streams.new_run(pid, now):
                r.run_start = r.pos
            prev, _ = self.streams.step(pid, ino, now)
            if prev is not None:
                self.graph.link(prev, ino, KIND_READ)
        since = r.window.get(key)
        self.sched.consume(key, ahead=0 if since is None else r.pos - since + 1)
        cheap = owned = False
        if since is not None:
            while True:  # chunks before it were skipped: no longer protected for this reader
                k, _ = r.window.popitem(last=False)
                if k == key:
                    break
                self.sched.unwant(k, r)
            # Reads since it was predicted, this one included, beat the lead by one: staged
            # in time with a margin, and would be again.
            cheap = r.pos - since + 1 > self.tuning.lead
            owned = True
        else:
            self._drop_window(r)  # the reader left the predicted path
            self._unpredicted[key] = None
            while len(self._unpredicted) > 4096:
                self._unpredicted.popitem(last=False)
        r.held, r.held_owned = key, owned
        if not opening:
            self._release_held(r)
        r.pos += 1
        r.cur = key
        r.last_t = now
        if cheap:
            self._cheap[key] = None
            while len(self._cheap) > 4096:
                self._cheap.popitem(last=False)
        self._refill(r, now)

    def _release_held(self, r: Reader) -> None:
        key = r.held
        if key is None:
            return
        r.held = None
        if r.held_owned:
            self.sched.unwant(key, r)
        if self.hints.consumed(key):
            self.sched.unwant(key, HINT)

    def _refill(self, r: Reader, now: float) -> None:
        """Extend the window to the current depth, continuing from its far end (each step
        usually adds one chunk: O(1) per read)."""
        depth = self.tuning.window()
        while len(r.window) > depth:
            key, _ = r.window.popitem(last=True)
            self.sched.unwant(key, r)
        need = depth - len(r.window)
        if need <= 0 or r.cur is None:
            return
        gap = self.tuning.gap_s or 0.001
        start = next(reversed(r.window)) if r.window else r.cur
        n = len(r.window)
        for key, kind in predict(self.graph, start, self._nchunks, need):
            if key in r.window or key == r.cur:
                break  # the chain came back on itself
            n += 1
            r.window[key] = r.pos
            if self.store.reads_through(key[0]):  # read ahead into memory, not DRAM
                self.store.buffer_predicted(*key)
            else:
                self.sched.want(key, r, now + n * gap, kind)

    def _drop_window(self, r: Reader) -> None:
        self._release_held(r)
        while r.window:
            key, _ = r.window.popitem(last=False)
            self.sched.unwant(key, r)

    def _nchunks(self, ino: int, size: int | None = None) -> int:
        if size is None and self.size_of is not None:
            size = self.size_of(ino)
        if size is not None:
            return (size + self.store.cs - 1) // self.store.cs
        n = 0  # no size known: count chunks until the first hole
        while n < 1 << 16 and self.store.get(ino, n) is not None:
            n += 1
        return n

    def sweep(self, now: float) -> None:
        """Let go of idle readers' windows and of stale hints."""
        for pid in [p for p, r in self.readers.items() if now - r.last_t > IDLE_S]:
            self._drop_window(self.readers.pop(pid))
        for key in self.hints.expired(now):
            self.sched.unwant(key, HINT)

    def stats(self) -> dict:
        out = {"enabled": self.enabled}
        if self.enabled:
            t = self.tuning
            out.update({
                "depth_chunks": t.window(), "lead_chunks": t.lead,
                "fetch_latency_us": round(t.fetch_s * 1e6) if t.fetch_s else None,
                "reader_gap_us": round(t.gap_s * 1e6) if t.gap_s else None,
                "depth_grew": t.grew, "depth_shrank": t.shrank,
                "readers": len(self.readers), "graph_files": len(self.graph),
                "graph_edges": self.graph.edges(),
                "graph_links": dict(self.graph.links),
                "hint_repeats": self.hints.repeats, "cheap_hits": self.cheap_hits,
                "unpredicted_fetches": self.unpredicted_fetches,
                "scheduler": self.sched.stats()})
        else:
            out["hints_ignored"] = self.hints_ignored
        return {"prefetch": out}

    # -- the learned order across restarts ----------------------------------------------------
    def load(self) -> int:
        """Read the successor edges saved by earlier runs (files that no longer exist are
        skipped); returns how many were loaded."""
        if not self.enabled or self.meta is None:
            return 0
        stale, n, damaged = [], 0, 0
        for k, v in self.meta.scan("successors"):
            if len(k) != 8 or len(v) != _SUCC.size:  # damaged: only a hint, dropped
                damaged += 1
                stale.append(k)
                continue
            a, (b, code) = from_u64(k), _SUCC.unpack(v)
            if self.size_of is not None and (self.size_of(a) is None or self.size_of(b) is None):
                stale.append(k)
                continue
            self.graph.link(a, b, _CODE_KINDS.get(code, KIND_WRITE))
            n += 1
        self.graph.take_dirty()
        if damaged:
            log.warning("dropped %d damaged entries of the learned read order", damaged)
        if stale:
            with self.meta.write() as txn:
                for k in stale:
                    txn.delete(k, db=self.meta.db["successors"])
        return n

    def save(self) -> None:
        """Write the edges that changed since the last save (one short transaction)."""
        if self.meta is None:
            return
        dirty = self.graph.take_dirty()
        if not dirty:
            return
        db = self.meta.db["successors"]
        with self.meta.write() as txn:
            for a, edge in dirty.items():
                if edge is None:
                    txn.delete(u64(a), db=db)
                else:
                    txn.put(u64(a), _SUCC.pack(edge[0], _KIND_CODES[edge[1]]), db=db)

    # -- scheduler task --------------------------------------------------------------------
    async def run(self) -> None:
        if not self.enabled:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sched.run)
            saved = self.clock()
            while True:
                await trio.sleep(IDLE_S / 2)
                now = self.clock()
                self.sweep(now)
                if now - saved >= SAVE_INTERVAL_S:
                    self.save()
                    saved = now


__all__ = ["Readahead", "Reader", "KIND_HINT", "KIND_READ", "KIND_WRITE"]
