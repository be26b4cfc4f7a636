"""The prefetch scheduler's bounds, ordering and eviction rules, on a fake store in virtual
time (trio's MockClock): concurrency, bandwidth, demand first, DRAM budget, earliest deadline
first, and no prefetch that evicts a chunk predicted to be needed sooner."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from kvfs.readahead.scheduler import Scheduler, Tuning
from kvfs.store.events import StoreEvents
from kvfs.tiering import DramPolicy

CS = 65536


class FakeStore:
    """Chunks are 'nvme', 'dram' (clean copy) or 'dirty'. prefetch() takes *delay* seconds."""

    cs = CS

    def __init__(self, room_chunks: int = 1000, delay: float = 0.01) -> None:
        self.tier: dict = {}
        self.policy = DramPolicy(room_chunks)
        self.room = room_chunks
        self.delay = delay
        self.rec_len = CS  # NVMe record bytes of every chunk
        self.limiter = trio.CapacityLimiter(8)
        self.prefetch_limiter = trio.CapacityLimiter(4)
        self.prefetched: set = set()
        self.counters = SimpleNamespace(prefetch_issued=0)
        self.events = StoreEvents()
        self.dram = SimpleNamespace(capacity=room_chunks * CS)
        self.active = self.max_active = 0
        self.order: list = []
        self.starts: list[float] = []
        self.dropped: list = []
        self.written_back: list = []

    def add(self, key, tier="nvme"):
        self.tier[key] = tier
        if tier != "nvme":
            self.policy.inserted(key)

    def get(self, ino, c):
        t = self.tier.get((ino, c))
        if t is None:
            return None
        return SimpleNamespace(dram_slot=-1 if t == "nvme" else 0, seg=0 if t == "dirty" else 1,
                               flags=0, rec_len=self.rec_len)

    def fetching(self, key) -> bool:
        return False  # prefetch() below stages at once

    def in_dram(self) -> int:
        return sum(t != "nvme" for t in self.tier.values())

    def prefetch_room(self, nbytes):
        return self.in_dram() < self.room

    def is_clean(self, key):
        return self.tier.get(key) != "dirty"

    def drop_dram_copy(self, key):
        assert self.tier[key] == "dram"
        self.tier[key] = "nvme"
        self.policy.removed(key)
        self.prefetched.discard(key)
        self.dropped.append(key)


    async def writeback(self, key, drop):
        await trio.sleep(self.delay)
        self.tier[key] = "nvme"
        self.policy.removed(key)
        self.written_back.append(key)
        return True

    async def prefetch(self, ino, c, make_room=None):
        key = (ino, c)
        if self.tier.get(key) != "nvme":
            return None
        if not self.prefetch_room(CS) and not (make_room and make_room(CS)):
            return None
        self.counters.prefetch_issued += 1
        self.order.append(key)
        self.starts.append(trio.current_time())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await trio.sleep(self.delay)
        finally:
            self.active -= 1
        self.tier[key] = "dram"
        self.policy.inserted(key)
        self.prefetched.add(key)
        return True


def run_sched(store, body, **kw):
    """Run *body(sched)* next to a running scheduler, in virtual time."""
    tuning = Tuning(16)

    async def main():
        sched = Scheduler(store, tuning, clock=trio.current_time, **kw)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run)
            await body(sched)
            nursery.cancel_scope.cancel()
        return sched

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_concurrency_bound():
    store = FakeStore()
    for c in range(50):
        store.add((1, c))

    async def body(sched):
        for c in range(50):
            sched.want((1, c), "r", trio.current_time() + c, "x")
        await trio.sleep(5)

    sched = run_sched(store, body, concurrency=3)
    assert len(store.order) == 50
    assert store.max_active == 3 and sched.max_inflight == 3


def test_bandwidth_bound():
    store = FakeStore(delay=0.0001)
    for c in range(200):
        store.add((1, c))
    rate = 20 * CS  # 20 chunks a second

    async def body(sched):
        for c in range(200):
            sched.want((1, c), "r", trio.current_time(), "x")
        await trio.sleep(5)

    run_sched(store, body, concurrency=8, bandwidth=rate)
    # 5 s at 20 chunks/s, plus the initial burst (1/20 s of bandwidth, at least one chunk).
    assert 95 <= len(store.order) <= 5 * 20 + 2
    window = [t for t in store.starts if 2.0 <= t < 4.0]
    assert len(window) <= 2 * 20 + 1


def test_bandwidth_counts_the_bytes_read():
    """Small (or compressed) records cost their size, not a whole chunk's."""
    store = FakeStore(delay=0.0001)
    store.rec_len = CS // 4
    for c in range(400):
        store.add((1, c))

    async def body(sched):
        for c in range(400):
            sched.want((1, c), "r", trio.current_time(), "x")
        await trio.sleep(2)

    sched = run_sched(store, body, concurrency=8, bandwidth=20 * CS)
    # 2 s at 80 quarter-chunk records/s, plus the initial burst.
    assert 150 <= len(store.order) <= 2 * 80 + 6
    issued = sched.stats()["issued_bytes"]  # the ones still in flight at the end are not in
    assert issued % (CS // 4) == 0 and len(store.order) - 8 <= issued // (CS // 4) <= len(
        store.order)


def test_demand_reads_go_first():
    store = FakeStore()
    for c in range(10):
        store.add((1, c))

    async def body(sched):
        # Demand work holds every I/O thread and more is waiting for one.
        holders = [object() for _ in range(9)]
        async with trio.open_nursery() as n:
            for h in holders[:8]:
                await store.limiter.acquire_on_behalf_of(h)
            n.start_soon(store.limiter.acquire_on_behalf_of, holders[8])
            await trio.sleep(0.01)
            for c in range(10):
                sched.want((1, c), "r", trio.current_time(), "x")
            await trio.sleep(1)
            assert store.order == []  # nothing issued while demand waits
            for h in holders[:8]:
                store.limiter.release_on_behalf_of(h)
        store.limiter.release_on_behalf_of(holders[8])
        await trio.sleep(1)
        assert len(store.order) == 10
        assert sched.n["demand_waits"] > 0

    run_sched(store, body, concurrency=4)


def test_dram_budget_bounds_staged_unread_chunks():
    store = FakeStore()
    for c in range(40):
        store.add((1, c))

    async def body(sched):
        for c in range(40):
            sched.want((1, c), "r", trio.current_time() + c, "x")
        await trio.sleep(2)
        assert len(store.order) == 5 and len(sched.staged) == 5
        sched.consume((1, 0))  # the reader reads one: room for one more
        sched.unwant((1, 0), "r")
        await trio.sleep(1)
        assert len(store.order) == 6

    run_sched(store, body, concurrency=4, budget_chunks=5)


def test_earliest_deadline_first():
    store = FakeStore()
    for c in range(6):
        store.add((1, c))

    async def body(sched):
        now = trio.current_time()
        for c, due in [(0, 5), (1, 3), (2, 9), (3, 1), (4, 7), (5, 2)]:
            sched.want((1, c), "r", now + due, "x")
        await trio.sleep(1)

    run_sched(store, body, concurrency=1)
    assert store.order == [(1, 3), (1, 5), (1, 1), (1, 0), (1, 4), (1, 2)]


def test_prefetch_evicts_unpredicted_first_and_never_something_needed_sooner():
    store = FakeStore(room_chunks=4)
    for c in range(4):
        store.add((2, c), "dram")  # full of chunks: (2, 0) and (2, 1) are predicted
    for c in range(3):
        store.add((1, c))

    async def body(sched):
        now = trio.current_time()
        sched.want((2, 0), "r", now + 1, "x")
        sched.want((2, 1), "r", now + 10, "x")
        sched.want((1, 0), "r", now + 5, "x")
        sched.want((1, 1), "r", now + 6, "x")
        sched.want((1, 2), "r", now + 7, "x")
        await trio.sleep(2)

    sched = run_sched(store, body, concurrency=1)
    # Unpredicted (2, 2), (2, 3) go first; then (2, 1), predicted later than (1, 2) needs;
    # (2, 0), needed sooner than anything queued, stays.
    assert store.dropped == [(2, 2), (2, 3), (2, 1)]
    assert store.tier[(2, 0)] == "dram"
    assert store.order == [(1, 0), (1, 1), (1, 2)]
    assert sched.n["evicted_for"] == 3


def test_no_room_means_no_prefetch():
    store = FakeStore(room_chunks=2)
    store.add((2, 0), "dram")
    store.add((2, 1), "dram")
    store.add((1, 0))

    async def body(sched):
        now = trio.current_time()
        sched.want((2, 0), "r", now + 1, "x")  # both residents are needed sooner
        sched.want((2, 1), "r", now + 2, "x")
        sched.want((1, 0), "r", now + 3, "x")
        await trio.sleep(0.5)

    sched = run_sched(store, body, concurrency=2)
    assert store.order == [] and store.dropped == []
    assert sched.n["no_room"] > 0 and store.counters.prefetch_issued == 0


def test_dirty_victims_are_written_back_to_make_room():
    store = FakeStore(room_chunks=2)
    store.add((2, 0), "dirty")
    store.add((2, 1), "dirty")
    store.add((1, 0))

    async def body(sched):
        sched.want((1, 0), "r", trio.current_time() + 1, "x")
        await trio.sleep(1)

    sched = run_sched(store, body, concurrency=1)
    assert store.written_back and store.order == [(1, 0)]
    assert sched.n["demoted_for"] >= 1


def test_unwanted_and_resident_chunks_are_not_issued():
    store = FakeStore()
    store.add((1, 0))
    store.add((1, 1), "dram")

    async def body(sched):
        sched.want((1, 0), "r", trio.current_time() + 1, "x")
        sched.want((1, 1), "r", trio.current_time() + 1, "x")
        sched.unwant((1, 0), "r")
        await trio.sleep(1)

    run_sched(store, body, concurrency=1)
    assert store.order == []


def test_used_wasted_late_accounting():
    store = FakeStore(delay=1.0)
    for c in range(3):
        store.add((1, c))

    async def body(sched):
        now = trio.current_time()
        for c in range(3):
            sched.want((1, c), "r", now + c, "k")
        await trio.sleep(0.5)
        sched.consume((1, 0))  # in flight: late
        await trio.sleep(3)
        sched.consume((1, 1))  # staged: used
        sched.unwant((1, 1), "r")
        sched.unwant((1, 2), "r")  # staged, never read: wasted
        await trio.sleep(0)
        return sched

    sched = run_sched(store, body, concurrency=1)
    assert sched.n["late_inflight"] == 1 and sched.n["used"] == 1 and sched.n["wasted"] == 1
    assert sched.by_kind["k"]["issued"] == 3


def test_several_owners_share_one_prefetch():
    store = FakeStore()
    store.add((1, 0))

    async def body(sched):
        sched.want((1, 0), "reader-a", trio.current_time() + 2, "x")
        sched.want((1, 0), "reader-b", trio.current_time() + 1, "x")
        await trio.sleep(1)
        sched.unwant((1, 0), "reader-a")
        assert sched.wanted((1, 0))  # b still wants it
        sched.unwant((1, 0), "reader-b")
        assert not sched.wanted((1, 0))

    run_sched(store, body, concurrency=2)
    assert store.order == [(1, 0)]


@pytest.mark.parametrize("fetch,gap,lead", [(0.001, 0.001, 1), (0.003, 0.001, 3),
                                            (0.0005, 0.002, 1), (0.01, 0.0001, 100)])
def test_lead_follows_measured_latency(fetch, gap, lead):
    t = Tuning(8)
    for _ in range(200):
        t.observe_fetch(fetch)
        t.observe_gap(gap)
    assert t.lead == min(lead, t.max_depth)
    assert t.window() >= min(t.max_depth, 2 * t.lead)


def test_depth_adapts_to_waste_and_lateness():
    t = Tuning(32, max_depth=64)
    for _ in range(Tuning.EPOCH):
        t.outcome(used=False)
    assert t.depth < 32 and t.shrank == 1
    d = t.depth
    for i in range(Tuning.EPOCH):
        t.outcome(used=True, late=i % 10 == 0)
    assert t.depth > d and t.grew == 1
    for _ in range(20 * Tuning.EPOCH):
        t.outcome(used=True, late=True)
    assert t.depth == 64  # bounded
    assert math.isfinite(t.window())
