"""Tiering policy: which DRAM chunks stay, which go, and when the demoter runs.

Policy only: the moves themselves are ChunkStore mechanisms (`writeback`, `drop_dram_copy`).

The DRAM tier is a segmented LRU (SLRU). A chunk enters *probation* when it is written or
promoted; a read hit moves it to *protected*. Victims come from the head of probation first,
so one pass of never-reused writes (a scan) cycles through probation and cannot flush the
blocks that engines actually reuse. Protected is capped at PROTECTED_SHARE of the chunks
DRAM can hold; its overflow falls back to probation's tail and gets one more chance.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

import trio

from kvfs.store.location import NoSpace
from kvfs.store.room import FULL_RETRY_S

log = logging.getLogger(__name__)

Key = tuple[int, int]
# Reused data may fill most of DRAM, but new writes always keep some room to land in.
PROTECTED_SHARE = 0.8
# When every DRAM chunk is one readahead wants, the demoter compares this many of the coldest.
KEPT_SCAN = 256
# Files an operator pins (kvfsctl pin) may hold at most this share of the DRAM tier, so
# that writes always find room to land in (passthrough pins have a share of their own).
PIN_SHARE = 0.5
# A search for victims looks at most at this many keys in one trio step (~0.2 ms) before it
# lets FUSE requests in: pinned, kept and leaving keys at the cold end may be many.
SCAN_STEP = 512


class KeyQueue:
    """Keys in order, the cold end first, as the keys of an OrderedDict, except that a walk
    (`start_walk`) survives changes to the queue: it stands on the next key it will visit and
    moves on when that key leaves. An OrderedDict's iterator fails at the first change, so
    each search for victims copied the whole queue first: with 60,000 small files in DRAM,
    every demotion step and every write waiting for room walked all their chunks (issue 33).
    Two dicts (key -> previous key, key -> next key) cost what an OrderedDict costs."""

    __slots__ = ("_next", "_prev", "_head", "_tail", "_walks")

    def __init__(self) -> None:
        self._next: dict[Hashable, Hashable | None] = {}
        self._prev: dict[Hashable, Hashable | None] = {}
        self._head: Hashable | None = None
        self._tail: Hashable | None = None
        self._walks: list[_Spot] = []

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: object) -> bool:
        return key in self._next

    def __iter__(self) -> Iterator[Hashable]:
        """The keys, cold end first; the queue must not change meanwhile (see `start_walk`)."""
        key = self._head
        while key is not None:
            yield key
            key = self._next[key]

    def append(self, key: Hashable) -> None:
        """Put *key* at the hot end (moved there if it is in the queue)."""
        if key == self._tail:
            return
        self.discard(key)
        self._prev[key] = self._tail
        self._next[key] = None
        if self._tail is None:
            self._head = key
        else:
            self._next[self._tail] = key
        self._tail = key
        for spot in self._walks:
            if spot.at_end:
                spot.key = key
                spot.at_end = False

    def appendleft(self, key: Hashable) -> None:
        """Put *key* at the cold end (moved there if it is in the queue)."""
        if key == self._head:
            return
        self.discard(key)
        self._next[key] = self._head
        self._prev[key] = None
        if self._head is None:
            self._tail = key
        else:
            self._prev[self._head] = key
        self._head = key

    def discard(self, key: Hashable) -> None:
        if key not in self._next:
            return
        after = self._next.pop(key)
        before = self._prev.pop(key)
        if before is None:
            self._head = after
        else:
            self._next[before] = after
        if after is None:
            self._tail = before
        else:
            self._prev[after] = before
        for spot in self._walks:
            if spot.key == key:
                spot.key = after
                spot.at_end = after is None

    def popleft(self) -> Hashable:
        key = self._head
        if key is None:
            raise KeyError("pop from an empty queue")
        self.discard(key)
        return key

    def start_walk(self) -> _Spot:
        """A walk from the cold end, key by key (`step`), while the caller changes the
        queue: a key that leaves before its turn is not visited, one that moves is visited
        where it is when the walk gets there, and keys added at the hot end are visited too,
        also after the walk got there. `end_walk` when done."""
        spot = _Spot(self._head)
        self._walks.append(spot)
        return spot

    def step(self, spot: _Spot) -> Hashable | None:
        """The key *spot* stands on (it moves on to the next), or None at the hot end."""
        key = spot.key
        if key is not None:
            spot.key = self._next[key]
            spot.at_end = spot.key is None
        return key

    def end_walk(self, spot: _Spot) -> None:
        self._walks.remove(spot)


class _Spot:
    """Where a walk of a KeyQueue stands: the next key it visits; at_end: past the hot end,
    where the next key added there is the next it visits. Compared by identity, so that a
    finished walk removes its own spot."""

    __slots__ = ("key", "at_end")

    def __init__(self, key: Hashable | None) -> None:
        self.key = key
        self.at_end = key is None


class DramPolicy:
    """SLRU bookkeeping of the chunks that have a DRAM copy."""

    def __init__(self, capacity_chunks: int) -> None:
        self.probation = KeyQueue()
        self.protected = KeyQueue()
        self.protected_limit = max(1, int(PROTECTED_SHARE * capacity_chunks))
        # Readahead's answers (issue 3; both stay "no" with prediction off: plain SLRU).
        # keep(key): predicted to be read soon - victims pass over it while others are left.
        # cheap(key): this read was predicted early enough that prediction will stage the
        # chunk again in time - a hit protects it at the cold end of protected, so it is
        # the first to fall back (reads nothing predicts keep their place).
        self.keep: Callable[[Key], bool] = _no
        # deadline(key): when a kept key is predicted to be read (None: not predicted). When
        # only kept keys are left, the one wanted last goes first.
        self.deadline: Callable[[Key], float | None] = _never
        # pinned(key): the chunk's file is open in passthrough mode (the kernel reads its DRAM
        # file), or an operator pinned it (kvfsctl pin): never a victim while it is.
        self.pinned: Callable[[Key], bool] = _no
        self.cheap: Callable[[Key], bool] = _no
        # unpredicted(key): a demand read that no prediction saw coming is bringing this chunk
        # in from NVMe. It enters protected like a hit: it was reused (written, then read),
        # and prefetching will not have it in time for the next such read either.
        self.unpredicted: Callable[[Key], bool] = _no
        # Keys that searches for victims looked at (`kvfsctl status --json`:
        # moves.victim_keys_examined): per chunk demoted, it must not grow with the number
        # of chunks in DRAM.
        self.examined = 0

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def inserted(self, key: Key) -> None:
        if key in self.protected:
            return
        if self.unpredicted(key):
            self.probation.discard(key)
            self._protect(key)
            return
        self.probation.append(key)

    def hit(self, key: Key) -> None:
        if key in self.protected:
            self.protected.append(key)
            return
        if key not in self.probation:
            return
        self.probation.discard(key)
        self._protect(key, cold=self.cheap(key))  # cheap: protected, but the first to go

    def _protect(self, key: Key, cold: bool = False) -> None:
        if cold:
            self.protected.appendleft(key)
        else:
            self.protected.append(key)
        while len(self.protected) > self.protected_limit:
            self.probation.append(self.protected.popleft())

    def removed(self, key: Key) -> None:
        self.probation.discard(key)
        self.protected.discard(key)

    def _wanted_at(self, key: Key) -> float:
        d = self.deadline(key)
        return math.inf if d is None else d

    def next_victim(self, skip: set[Key]) -> Key | None:
        """The coldest key not in *skip* (the ones already leaving); a key readahead wants
        kept only if there is no other and nothing is leaving (what leaves may be room
        enough), and then the one wanted last (of the coldest KEPT_SCAN)."""
        return next(self.victim_run(skip), None)

    def coldest(self) -> Key | None:
        """What `next_victim(set())` gives, if a walk of SCAN_STEP keys finds it, else None:
        a write waiting for room leaves longer searches to the demoter."""
        return next(self.victim_run(set(), pause=SCAN_STEP), None)

    def victim_run(self, skip: set[Key], pause: int = 0) -> Iterator[Key | None]:
        """The keys successive `next_victim(skip)` calls would return while the caller
        removes or skips each one it gets, from one walk of the queues (a scan per victim,
        past many kept or pinned keys at the cold end, had held the trio thread ~15 ms for a
        16-copy clean run). When only kept keys are left: the coldest KEPT_SCAN of them, the
        one wanted last first, while nothing leaves. Each key is checked again at its turn
        (the caller may have pinned its file meanwhile), and probation keys added meanwhile
        come before the rest of protected, so a run may be kept across awaits. With
        *pause*, None comes after every *pause* keys looked at without a victim: a caller
        that must not hold the trio thread long stops there (and may go on later)."""
        kept: list[Key] = []
        looked = 0
        cold, warm = self.probation.start_walk(), self.protected.start_walk()
        try:
            while True:
                key = self.probation.step(cold)
                if key is None:
                    key = self.protected.step(warm)
                    if key is None:
                        break
                self.examined += 1
                looked += 1
                if pause and looked >= pause:
                    looked = 0
                    yield None
                if not self.candidate(key, skip):
                    continue
                if not self.keep(key):
                    looked = 0
                    yield key
                elif len(kept) < KEPT_SCAN:
                    kept.append(key)
        finally:
            self.probation.end_walk(cold)
            self.protected.end_walk(warm)
        for key in sorted(kept, key=self._wanted_at, reverse=True):
            if skip:
                return  # kept ones are no candidates while any leave
            if self._holds(key) and not self.pinned(key):
                yield key

    def candidate(self, key: Key, skip: set[Key]) -> bool:
        """May *key* leave DRAM now (not leaving already, still there, not pinned)?"""
        return key not in skip and self._holds(key) and not self.pinned(key)

    def _holds(self, key: Key) -> bool:
        return key in self.probation or key in self.protected


_END = object()  # next(victims, _END): the walk is over


def _no(key: Key) -> bool:
    return False


def _never(key: Key) -> float | None:
    return None


class Demoter:
    """Background task keeping DRAM use between the watermarks and writing back old dirty data.

    Runs in the daemon's nursery. Each pass walks the policy's victims: clean chunks (already on
    NVMe) are dropped at once; dirty ones are written back and dropped, several at a time.
    """

    # Clean copies dropped per transaction at most: one commit each costs the trio thread a
    # tenth of its time in streaming reads, but a run is one trio step (~25 us per copy) that
    # every FUSE request waits behind; 16 keeps such a step under half a millisecond.
    CLEAN_RUN = 16

    def __init__(self, store, *, high: float, low: float, writeback_age: float,
                 parallel: int = 2) -> None:
        self.store = store
        self.high = high
        self.low = low
        self.writeback_age = writeback_age
        self.parallel = parallel
        self._kick = trio.Event()
        self._leaving = 0
        self._inflight: set[Key] = set()
        self.passes = 0
        self._next_key: Key | None = None

    def kick(self) -> None:
        self._kick.set()

    def over(self, mark: float, leaving: int = 0) -> bool:
        """Is DRAM above *mark*, not counting *leaving* bytes already being demoted?"""
        s = self.store
        return s.dram_load - leaving > mark * s.dram.capacity

    async def run(self) -> None:
        while True:
            with trio.move_on_after(1.0):
                await self._kick.wait()
            self._kick = trio.Event()
            try:
                if self.over(self.high) or self.store.space_waiters:
                    await self.demote_until(self.low)
                if self.writeback_age > 0:
                    await self.write_back_old()
            except Exception:
                log.exception("demotion pass failed")
            self.store.notify_space()
            if self.store.nvme_full.on or self.store.nvme_failing.on:
                await trio.sleep(FULL_RETRY_S)  # not once per kick: until the next try

    async def demote_until(self, mark: float) -> None:
        self.passes += 1
        self._leaving = 0
        self._inflight: set[Key] = set()
        # One walk down the policy's queues for the whole pass, each step going on where the
        # last one stopped: a walk from the cold end per step passed again over every chunk
        # the pass had left in DRAM (issue 33: 60,000 small files made writes crawl).
        victims = self.store.policy.victim_run(self._inflight, pause=SCAN_STEP)
        self._next_key = None
        try:
            async with trio.open_nursery() as nursery:
                limiter = trio.Semaphore(self.parallel)  # batches in flight
                exhausted = False
                took = self.store.dram_used
                while self._wanted(mark):
                    await limiter.acquire()
                    batch, exhausted = self._take_victims(mark, victims)
                    if batch:
                        nursery.start_soon(self._writeback, batch, limiter)
                        took = -1
                    else:
                        limiter.release()
                    if exhausted:
                        break
        finally:
            victims.close()
        if (exhausted and took == self.store.dram_used and self.store.space_waiters
                and self.over(1.0)):
            # A whole walk found nothing to take (no write-back, no copy dropped): what is
            # in DRAM belongs to files the kernel reads or writes straight from their DRAM
            # files (passthrough pins them). The waiting writes go over the tier's size
            # rather than wait for room nothing can make.
            self.store.nothing_leaves()

    def _wanted(self, mark: float) -> bool:
        """Is more to be demoted: DRAM above *mark*, or a write waiting and nothing leaving?"""
        return self.over(mark, self._leaving) or bool(self.store.space_waiters
                                                      and not self._leaving)

    def _take_victims(self, mark: float,
                      victims: Iterator[Key | None]) -> tuple[list[tuple[Key, int]], bool]:
        """A writeback batch of dirty victims (clean ones met on the way are dropped at
        once), each counted as leaving; and whether the policy ran out of victims."""
        s = self.store
        batch: list[tuple[Key, int]] = []
        nbytes = 0
        while not s.batch_full(len(batch), nbytes) and self._wanted(mark):
            key, self._next_key = self._next_key, None
            if key is not None and not s.policy.candidate(key, self._inflight):
                continue  # met at the end of the last step, and gone or pinned since
            if key is None:
                key = next(victims, _END)
            if key is _END:
                return batch, True
            if key is None:
                return batch, False  # a long walk: let waiting requests in first
            if s.is_clean(key):
                # One run per call: the caller's next acquire lets waiting requests in.
                self._drop_clean_run(key, victims, mark)
                return batch, False
            size = s.dram_pages(key)
            self._leaving += size
            nbytes += size
            self._inflight.add(key)
            batch.append((key, size))
        return batch, False

    def _drop_clean_run(self, key: Key, victims: Iterator[Key | None], mark: float) -> None:
        """Drop the clean DRAM copy of *key* and of the *victims* after it while they are
        clean too, in one transaction (no await in between): streaming reads through a small
        tier drop a copy per staged chunk, and a commit each was a tenth of the trio thread.
        A dirty victim met after them is the next step's first."""
        s = self.store
        with s.batch():
            for _ in range(self.CLEAN_RUN):
                s.drop_dram_copy(key)
                if not s.dram_load - self._leaving > mark * s.dram.capacity:
                    return
                key = next(victims, None)
                if key is None:
                    return
                if not s.is_clean(key):
                    self._next_key = key
                    return

    async def _writeback(self, batch: list[tuple[Key, int]], limiter: trio.Semaphore) -> None:
        try:
            await self.store.writeback_many([key for key, _ in batch], drop=True)
        except (NoSpace, OSError):
            pass  # the chunks stay dirty in DRAM; the store logs the episode
        except Exception:
            log.exception("demotion of %d chunks (%s first) failed", len(batch), batch[0][0])
        finally:
            for key, size in batch:
                self._leaving -= size
                self._inflight.discard(key)
            limiter.release()
            self.store.notify_space()

    async def write_back_old(self) -> None:
        """Dirty chunks older than writeback_age go to NVMe (kept in DRAM as clean copies)."""
        s = self.store
        cutoff = time.monotonic() - self.writeback_age
        # dirty_since is in the order chunks became dirty: the old ones are its head (a
        # walk over every dirty chunk at each kick grew with the files in DRAM).
        old = [k for k, _ in itertools.takewhile(lambda kt: kt[1] < cutoff,
                                                  s.dirty_since.items())]
        for batch in s.writeback_batches(old):
            try:
                await s.writeback_many(batch, drop=False, pack=True)
            except (NoSpace, OSError):
                return  # the store logs the episode
            except Exception:
                log.exception("writeback of chunk %s failed", batch[0])
                return


class FileEvictor:
    """Cache mode: when the store is full, remove whole least-recently-used files.

    A KV cache would rather lose a cold block (the engine recomputes it) than fail a write.
    `remove_file` is the filesystem's mechanism; this class only picks the victims.
    """

    def __init__(self, remove_file, file_bytes) -> None:
        self.remove_file = remove_file
        self.file_bytes = file_bytes
        # Least recently opened first. A KeyQueue, so that an eviction walks from the cold
        # end only as far as it evicts (it copied the whole list of files each time).
        self.lru = KeyQueue()
        # pinned(ino): an operator pinned the file (kvfsctl pin): it stays until unpinned.
        self.pinned: Callable[[int], bool] = _no
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.examined = 0  # files evictions looked at (status: evictions.examined_files)

    def touch(self, ino: int) -> None:
        self.lru.append(ino)

    def forget(self, ino: int) -> None:
        self.lru.discard(ino)

    def evict(self, need: int) -> bool:
        """Remove cold files until about *need* bytes are freed; False if nothing could go."""
        freed = 0
        spot = self.lru.start_walk()
        try:
            while freed < need and (ino := self.lru.step(spot)) is not None:
                self.examined += 1
                size = self.file_bytes.get(ino, 0)
                # remove_file is False for open files: they stay candidates
                if not self.pinned(ino) and self.remove_file(ino):
                    self.lru.discard(ino)
                    self.evicted_files += 1
                    self.evicted_bytes += size
                    freed += max(size, 1)
        finally:
            self.lru.end_walk(spot)
        return freed > 0


class KernelWritePolicy:
    """Which new files the kernel may write straight into their DRAM file (passthrough).

    kvfs sees nothing of such a file until its writer closes it, so it cannot demote any of
    it meanwhile nor answer ENOSPC: the file must fit in the DRAM tier's free room. Its size
    is predicted from its directory: engines write a directory's KV blocks at one size, so
    the largest of the last SIZE_MEMORY files closed there is the guess. Passthrough records
    each close in the file's directory and the two above it, and asks them in that order:
    a tree none of whose three levels saw a file closed gets no streaming (its first files
    teach the size).
    """

    SIZE_MEMORY = 16
    DIRECTORIES = 4096  # directories remembered (least recently used forgotten)

    def __init__(self) -> None:
        self.sizes: OrderedDict[int, list[int]] = OrderedDict()

    def expected(self, parent: int) -> int | None:
        """The size a new file in *parent* is expected to reach, or None if unknown."""
        sizes = self.sizes.get(parent)
        return max(sizes) if sizes else None

    def closed(self, parent: int, size: int) -> None:
        """A file written in *parent* was closed at *size* bytes."""
        sizes = self.sizes.setdefault(parent, [])
        self.sizes.move_to_end(parent)
        sizes.append(size)
        if len(sizes) > self.SIZE_MEMORY:
            del sizes[0]
        while len(self.sizes) > self.DIRECTORIES:
            self.sizes.popitem(last=False)
