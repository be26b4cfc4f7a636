"""The prefetch scheduler: one queue for every predictor, bounded, demand reads first.

Predictions arrive as `want(key, owner, deadline, kind)`: an owner (a reader's window, or the
hint book) expects to read chunk *key* around *deadline* (monotonic seconds). The scheduler
stages wanted NVMe-only chunks in DRAM through `ChunkStore.prefetch`, earliest deadline first,
and forgets a chunk when its last owner lets go of it (`unwant`).

Bounds:
- concurrency: at most `concurrency` prefetches in flight (they run on the store's own
  prefetch thread limiter, so a demand read never waits for a prefetch thread);
- bandwidth: a token bucket of `bandwidth` bytes/s (0: no limit);
- demand first: nothing is issued while demand work waits for the store's I/O threads;
- DRAM budget: at most `budget_chunks` chunks staged and not yet read;
- room: a prefetch that needs DRAM may only evict (clean) chunks nobody predicted, or chunks
  predicted for a *later* deadline than its own, never one predicted sooner. If no such
  victim exists the prefetch is not issued (and retried later).

`Tuning` adapts the look-ahead: the *lead* (how many chunks ahead a prefetch must start to
arrive in time) is the measured prefetch latency over the measured time readers spend per
chunk; the window *depth* grows when prefetches arrive late and shrinks when they are wasted.

Concurrency protocol: everything runs on the trio thread; `want`/`unwant` never await. The
only await that matters is the store's fetch inside `_one`: while it runs, the chunk may be
unwanted, read by demand, overwritten or deleted; the store re-checks the chunk's seq, and
`_one` re-checks `want` before counting the chunk as staged.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

log = logging.getLogger(__name__)

Key = tuple[int, int]
# How far down the policy's eviction order a prefetch looks for a clean victim.
VICTIM_SCAN = 512
# A prefetch that found no room waits before the queue is tried again: from this long,
# doubling while there is still no room, up to NO_ROOM_BACKOFF_MAX_S.
NO_ROOM_BACKOFF_S = 0.002
NO_ROOM_BACKOFF_MAX_S = 0.064


def _log2_bucket(us: int) -> int:
    return min(23, max(0, us).bit_length())


class Tuning:
    """Look-ahead that follows the measured prefetch latency, reader pace, hits and waste."""

    EWMA = 0.05
    EPOCH = 64  # outcomes between depth adjustments

    def __init__(self, depth: int, *, max_depth: int = 256) -> None:
        self.depth = self.base = max(1, depth)
        self.max_depth = max(self.depth, max_depth)
        self.fetch_s: float | None = None  # prefetch latency, queueing included
        self.gap_s: float | None = None  # time a reader spends per chunk
        self.used = self.wasted = self.late = 0  # this epoch
        self.grew = self.shrank = 0

    @staticmethod
    def _ewma(old: float | None, new: float, a: float) -> float:
        return new if old is None else old + a * (new - old)

    def observe_fetch(self, seconds: float) -> None:
        self.fetch_s = self._ewma(self.fetch_s, seconds, self.EWMA)

    def observe_gap(self, seconds: float) -> None:
        self.gap_s = self._ewma(self.gap_s, seconds, self.EWMA)

    @property
    def lead(self) -> int:
        """Chunks ahead a prefetch must start so that it is done when the reader arrives."""
        if not self.fetch_s or not self.gap_s:
            return 1
        return max(1, min(self.max_depth, math.ceil(self.fetch_s / self.gap_s)))

    def window(self) -> int:
        """Chunks to keep predicted ahead of each reader."""
        return min(self.max_depth, max(self.depth, 2 * self.lead))

    def outcome(self, *, used: bool, late: bool = False) -> None:
        if used:
            self.used += 1
            self.late += late
        else:
            self.wasted += 1
        n = self.used + self.wasted
        if n < self.EPOCH:
            return
        accuracy = self.used / n
        late_share = self.late / max(1, self.used)
        if accuracy < 0.85:
            self.depth = max(1, int(self.depth * 0.7))
            self.shrank += 1
        elif late_share > 0.02 and accuracy >= 0.9:
            self.depth = min(self.max_depth, self.depth + max(1, self.depth // 4))
            self.grew += 1
        elif late_share < 0.005 and self.depth > self.base:
            self.depth = max(self.base, self.depth - max(1, self.depth // 8))  # drift back
        self.used = self.wasted = self.late = 0


@dataclass
class Want:
    owners: dict = field(default_factory=dict)  # owner -> deadline
    kind: str = ""
    tries: int = 0  # prefetches that read the chunk but could not stage it

    @property
    def deadline(self) -> float:
        return min(self.owners.values())


class Scheduler:
    def __init__(self, store, tuning: Tuning, *, concurrency: int, bandwidth: int = 0,
                 budget_chunks: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.tuning = tuning
        self.concurrency = max(1, concurrency)
        self.bandwidth = bandwidth
        self.budget_chunks = budget_chunks or 1 << 30
        self.clock = clock
        self.wants: dict[Key, Want] = {}
        self._heap: list[tuple[float, int, Key]] = []
        self._queued: set[Key] = set()
        self.inflight: set[Key] = set()
        self.staged: dict[Key, str] = {}  # staged by us, wanted, not read yet -> kind
        self._seq = itertools.count()
        self._changed = trio.Event()
        self._slots = trio.Semaphore(self.concurrency)
        self._tokens = 0.0
        self._tokens_t = clock()
        self._backoff_until = 0.0
        self._backoff = NO_ROOM_BACKOFF_S
        self.max_inflight = 0
        self._nursery: trio.Nursery | None = None
        self._demoting: set[Key] = set()
        self.issued_bytes = 0
        self.n = {"requested": 0, "attempts": 0, "staged": 0, "no_room": 0, "evicted_for": 0,
                  "demoted_for": 0, "displaced": 0, "used": 0, "wasted": 0,
                  "late_inflight": 0, "late_queued": 0, "demand_waits": 0}
        self.by_kind = {}
        self.latency_us = [0] * 24

    # -- owners' side (trio thread, never blocks) -------------------------------------------
    def want(self, key: Key, owner, deadline: float, kind: str) -> None:
        w = self.wants.get(key)
        if w is None:
            w = self.wants[key] = Want(kind=kind)
            self.n["requested"] += 1
            self._kind(kind)["predicted"] += 1
        w.owners[owner] = deadline
        if key not in self._queued and key not in self.inflight and self._nvme_only(key):
            self._queued.add(key)
            heapq.heappush(self._heap, (deadline, next(self._seq), key))
            if len(self._heap) > 4 * len(self.wants) + 1024:
                self._compact()
            self._wake()

    def _compact(self) -> None:
        """Drop queue entries nobody wants any more (they are skipped anyway when popped)."""
        self._heap = [e for e in self._heap if e[2] in self.wants]
        heapq.heapify(self._heap)
        self._queued = {e[2] for e in self._heap}

    def unwant(self, key: Key, owner) -> None:
        """*owner* no longer expects *key* (it read it, skipped it, or went elsewhere)."""
        w = self.wants.get(key)
        if w is None or owner not in w.owners:
            return
        del w.owners[owner]
        if w.owners:
            return
        del self.wants[key]
        kind = self.staged.pop(key, None)
        if kind is not None:  # staged and never read by anyone who predicted it
            self.n["wasted"] += 1
            self._kind(kind)["wasted"] += 1
            self.tuning.outcome(used=False)
        self._wake()  # the budget may have room again

    def consume(self, key: Key, ahead: int = 0) -> None:
        """A reader is reading *key* now: count a staged chunk as used, a late one as late.
        *ahead*: reads since the reader's window predicted it (0: it did not)."""
        w = self.wants.get(key)
        # Late although predicted further ahead than the lead: a deeper window would help.
        # Late right after an unpredicted read is not the window's fault.
        deep = ahead > self.tuning.lead
        kind = self.staged.pop(key, None)
        if kind is not None:
            self.n["used"] += 1
            self._kind(kind)["used"] += 1
            self.tuning.outcome(used=True)
        elif key in self.inflight:
            self.n["late_inflight"] += 1
            if w is not None:
                self._kind(w.kind)["late"] += 1
            self.tuning.outcome(used=True, late=deep)
        elif key in self._queued:
            self.n["late_queued"] += 1
            if w is not None:
                self._kind(w.kind)["late"] += 1
            self.tuning.outcome(used=True, late=deep)

    def wanted(self, key: Key) -> bool:
        """DramPolicy.keep: is this chunk predicted to be read soon?"""
        return key in self.wants

    def deadline(self, key: Key) -> float | None:
        w = self.wants.get(key)
        return None if w is None else w.deadline

    def _kind(self, kind: str) -> dict:
        d = self.by_kind.get(kind)
        if d is None:
            d = self.by_kind[kind] = {"predicted": 0, "issued": 0, "used": 0, "late": 0,
                                      "wasted": 0}
        return d

    def _wake(self) -> None:
        self._changed.set()

    def _nvme_only(self, key: Key) -> bool:
        loc = self.store.get(*key)
        return loc is not None and loc.dram_slot < 0 and loc.seg > 0

    # -- room: eviction that knows predictions ----------------------------------------------
    def make_room(self, key: Key, need: int) -> bool:
        """Free DRAM for a prefetch of *key* by dropping clean chunks that nobody predicted,
        else ones predicted later than *key*. Never drops one predicted sooner. If only
        unsaved (dirty) chunks could go, start writing some back and report no room."""
        s = self.store
        mine = self.deadline(key)
        if mine is None:
            return False
        if s.prefetch_room(need):
            return True
        clean, later, dirty = self._victims(mine, max(1, -(-need // s.cs)))
        for victim in clean + later:
            s.drop_dram_copy(victim)
            self.n["evicted_for"] += 1
            if self.staged.pop(victim, None) is not None:
                # A staged chunk needed later than this one: stage it again when its turn
                # comes (it is still wanted).
                self.n["displaced"] += 1
                self._requeue(victim)
            if s.prefetch_room(need):
                return True
        if self._nursery is not None:
            for victim in dirty[:max(0, self.concurrency - len(self._demoting))]:
                if victim not in self._demoting:
                    self._demoting.add(victim)
                    self._nursery.start_soon(self._demote, victim)
        s.events.dram_filling()
        return False

    def _victims(self, mine: float, n: int) -> tuple[list[Key], list[Key], list[Key]]:
        """One pass down the policy's eviction order: up to *n* clean chunks nobody wants,
        clean chunks wanted later than *mine* (latest first), dirty chunks nobody wants."""
        s = self.store
        policy = s.policy
        clean: list[Key] = []
        later: list[tuple[float, Key]] = []
        dirty: list[Key] = []
        for key in itertools.islice(itertools.chain(policy.probation, policy.protected),
                                    VICTIM_SCAN):
            d = self.deadline(key)
            if d is not None and d <= mine:
                continue  # needed sooner: never a victim for this prefetch
            if not s.is_clean(key):
                if d is None and len(dirty) < self.concurrency:
                    dirty.append(key)
                continue
            if d is None:
                clean.append(key)
                if len(clean) >= n:
                    break
            else:
                later.append((d, key))
        later.sort(reverse=True)
        return clean, [k for _, k in later[:max(0, n - len(clean))]], dirty

    async def _demote(self, key: Key) -> None:
        try:
            await self.store.writeback(key, drop=True)
            self.n["demoted_for"] += 1
        except Exception as exc:  # NoSpace, I/O errors: the chunk stays dirty in DRAM
            log.warning("prefetch: demotion of chunk %s failed: %s", key, exc)
        finally:
            self._demoting.discard(key)
            self._wake()

    def _requeue(self, key: Key) -> None:
        w = self.wants.get(key)
        if w is not None and key not in self._queued and key not in self.inflight:
            self._queued.add(key)
            heapq.heappush(self._heap, (w.deadline, next(self._seq), key))

    # -- the scheduler task -----------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            while True:
                await self._slots.acquire()
                try:
                    key = await self._next()
                except BaseException:
                    self._slots.release()
                    raise
                self.inflight.add(key)
                self.max_inflight = max(self.max_inflight, len(self.inflight))
                nursery.start_soon(self._one, key)

    async def _next(self) -> Key:
        """Wait until a chunk may be issued under every bound, and return the most urgent."""
        while True:
            now = self.clock()
            if now < self._backoff_until:
                await trio.sleep(self._backoff_until - now)
                continue
            if not self._heap or len(self.staged) + len(self.inflight) >= self.budget_chunks:
                self._changed = trio.Event()
                await self._changed.wait()
                continue
            if self.store.limiter.statistics().tasks_waiting:
                self.n["demand_waits"] += 1
                await trio.sleep(0.0005)  # demand reads are queued for threads: they go first
                continue
            if self.bandwidth:
                wait = self._take_tokens(self._nvme_bytes(self._heap[0][2]), now)
                if wait > 0:
                    await trio.sleep(wait)
                    continue
            _, _, key = heapq.heappop(self._heap)
            self._queued.discard(key)
            if key in self.wants and self._nvme_only(key) and not self.store.fetching(key):
                return key

    def _nvme_bytes(self, key: Key) -> int:
        """What a prefetch of *key* reads from NVMe: its record (a 256 KiB file's chunk is no
        1 MiB read, nor is a compressed one); a whole chunk when it is not known."""
        loc = self.store.get(*key)
        return loc.rec_len if loc is not None and loc.seg else self.store.cs

    def _take_tokens(self, size: int, now: float) -> float:
        burst = max(size, self.bandwidth / 20)
        self._tokens = min(burst, self._tokens + (now - self._tokens_t) * self.bandwidth)
        self._tokens_t = now
        if self._tokens < size - 1:
            return max(0.0001, (size - self._tokens) / self.bandwidth)
        self._tokens -= size
        return 0.0

    async def _one(self, key: Key) -> None:
        t0 = self.clock()
        result = None
        try:
            self.n["attempts"] += 1
            result = await self.store.prefetch(
                key[0], key[1], make_room=lambda need: self.make_room(key, need))
        except Exception:
            log.exception("prefetch of inode %d chunk %d failed", *key)
            result = False  # counts as a try: a chunk that keeps failing is given up
        finally:
            self.inflight.discard(key)
            self._slots.release()
        w = self.wants.get(key)
        if result is not None:  # the chunk was read from NVMe (or the read failed)
            dt = self.clock() - t0
            self.tuning.observe_fetch(dt)
            self.latency_us[_log2_bucket(int(dt * 1e6))] += 1
            self.issued_bytes += self._nvme_bytes(key)
            if w is not None:
                self._kind(w.kind)["issued"] += 1
        if result is not None:
            self._backoff = NO_ROOM_BACKOFF_S
        if result and w is not None and key in self.store.prefetched:
            self.staged[key] = w.kind
            self.n["staged"] += 1
        elif w is not None and self._nvme_only(key) and (result is None or w.tries < 3):
            # No room without evicting something needed sooner (or DRAM filled while the
            # chunk was read): try again a little later.
            self.n["no_room"] += 1
            w.tries += 1
            self._backoff_until = self.clock() + self._backoff
            self._backoff = min(NO_ROOM_BACKOFF_MAX_S, 2 * self._backoff)
            self._requeue(key)
        self._wake()

    def stats(self) -> dict:
        return {**self.n, "queued": len(self._queued), "in_flight": len(self.inflight),
                "max_in_flight": self.max_inflight, "wanted": len(self.wants),
                "staged_unread": len(self.staged), "concurrency": self.concurrency,
                "bandwidth_bytes_per_s": self.bandwidth, "budget_chunks": self.budget_chunks,
                "issued_bytes": self.issued_bytes, "by_predictor": self.by_kind,
                "latency_us_log2_histogram": list(self.latency_us)}
