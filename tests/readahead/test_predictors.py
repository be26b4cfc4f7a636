"""Predictors and the per-reader windows, without a mount (a fake store, no trio task)."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from types import SimpleNamespace

import trio

from kvfs.readahead import IDLE_S, Readahead
from kvfs.readahead.predictors import (
    KIND_HINT,
    KIND_READ,
    KIND_WHOLE,
    KIND_WRITE,
    CallerStreams,
    HintBook,
    SuccessorGraph,
    predict,
)
from kvfs.tiering import DramPolicy

CS = 65536


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 0.001) -> None:
        self.t += dt


class FakeStore:
    """Just enough of ChunkStore for the event side: every chunk of every file is on NVMe."""

    cs = CS

    def __init__(self, sizes: dict[int, int]) -> None:
        self.sizes = sizes
        self.policy = DramPolicy(64)
        self.prefetch_limiter = trio.CapacityLimiter(4)
        self.dram = SimpleNamespace(capacity=64 * CS)
        self.in_dram: set = set()
        self.through: set = set()  # files read through the daemon, never prefetched
        self.index = SimpleNamespace(  # (ChunkIndex.chunks_of: the chunks a file has)
            chunks_of=lambda ino, upto: [c for c in range(upto) if self.get(ino, c)])

        self.read_ahead: list = []
        self.index = SimpleNamespace(chunks_of=lambda ino, upto: [
            c for c in range(upto) if self.get(ino, c) is not None])

    def reads_through(self, ino, size=None):
        return ino in self.through

    def buffer_predicted(self, ino, c):
        self.read_ahead.append((ino, c))

    def get(self, ino, c):
        size = self.sizes.get(ino)
        if size is None or c * CS >= size:
            return None
        return SimpleNamespace(dram_slot=0 if (ino, c) in self.in_dram else -1, seg=1, flags=0)


def make(sizes: dict[int, int], depth: int = 8, enabled: bool = True):
    clock = Clock()
    store = FakeStore(sizes)
    ra = Readahead(store, depth=depth, enabled=enabled, size_of=sizes.get, clock=clock)
    return ra, store, clock


def wanted_files(ra) -> list[int]:
    return sorted({k[0] for k in ra.sched.wants})


# -- CallerStreams --------------------------------------------------------------------------------
def test_streams_are_per_caller_and_break_when_idle():
    s = CallerStreams(idle_s=1.0)
    assert s.step(1, 10, 0.0) == (None, None)
    assert s.step(2, 20, 0.1) == (None, None)  # another caller: no edge 10 -> 20
    assert s.step(1, 11, 0.2)[0] == 10
    assert s.step(2, 21, 0.3)[0] == 20
    assert s.step(1, 11, 0.4)[0] is None  # same file again: no self edge
    assert s.step(1, 12, 5.0)[0] is None  # idle gap: a new run
    assert s.step(1, 13, 5.1)[0] == 12


def test_streams_read_write_read_order():
    """Reads, then writes continue a run (a request loads its prefix, then stores its new
    blocks); the read after writes starts a new one (the next request)."""
    s = CallerStreams(idle_s=1.0)
    s.step(1, 10, 0.0)
    assert s.step(1, 11, 0.1, write=True)[0] == 10  # read -> write: prefix continues
    assert s.step(1, 12, 0.2, write=True)[0] == 11
    assert s.new_run(1, 0.3)
    assert s.step(1, 20, 0.3)[0] is None  # write -> read: a new request
    assert not s.new_run(1, 0.4)
    assert s.step(1, 21, 0.4)[0] == 20


def test_one_caller_for_many_requests_links_no_requests_together():
    sizes = {i: CS for i in range(1, 40)}
    ra, store, clock = make(sizes)
    for ino in range(1, 6):  # request 1 writes 1..5
        ra.created(ino, 1, pid=1)
        clock.tick()
    for ino in range(1, 4):  # request 2 (same thread) reads 1..3, writes 10, 11
        ra.opened(ino, os.O_RDONLY, CS, pid=1)
        ra.read(ino, 0, CS, pid=1)
        clock.tick()
    ra.created(10, 1, pid=1)
    ra.created(11, 1, pid=1)
    ra.opened(20, os.O_RDONLY, CS, pid=1)  # request 3 starts elsewhere
    assert ra.graph.next(3) == (10, KIND_WRITE)
    assert ra.graph.next(11) is None  # nothing links request 2's last block to request 3


def test_streams_bounded():
    s = CallerStreams(max_callers=10)
    for pid in range(100):
        s.step(pid, pid, 0.0)
    assert len(s.last) == 10


# -- SuccessorGraph -------------------------------------------------------------------------------
def test_graph_follows_most_recent_successor_and_read_overrides_write():
    g = SuccessorGraph()
    g.link(1, 2, KIND_WRITE)
    g.link(2, 3, KIND_WRITE)
    assert list(g.chain(1, 10)) == [(2, KIND_WRITE), (3, KIND_WRITE)]
    g.link(1, 5, KIND_READ)
    assert g.next(1) == (5, KIND_READ)
    g.link(1, 2, KIND_READ)  # seen again, by a reader: most recent again, now a read edge
    assert g.next(1) == (2, KIND_READ)
    assert g.links == {KIND_WRITE: 2, KIND_READ: 2}


def test_graph_chain_stops_at_cycles_and_limit():
    g = SuccessorGraph()
    for a, b in [(1, 2), (2, 3), (3, 1)]:
        g.link(a, b, KIND_READ)
    assert [b for b, _ in g.chain(1, 10)] == [2, 3]
    assert [b for b, _ in g.chain(1, 1)] == [2]
    g.link(4, 4, KIND_READ)  # self edges are ignored
    assert g.next(4) is None


def test_graph_chain_stops_at_a_hub():
    g = SuccessorGraph()
    # every request starts with block 0 (a shared system prompt), then goes its own way
    for first in (10, 20, 30):
        g.link(0, first, KIND_WRITE)
        g.link(first, first + 1, KIND_WRITE)
    assert g.unsettled(0) and list(g.chain(0, 10)) == []
    assert [b for b, _ in g.chain(30, 10)] == [31]
    g.link(5, 0, KIND_READ)
    assert [b for b, _ in g.chain(5, 10)] == [0]  # a walk that reaches the hub ends there
    g.link(0, 30, KIND_READ)  # a successor seen twice: followed again
    assert not g.unsettled(0) and [b for b, _ in g.chain(0, 10)] == [30, 31]
    g.link(1, 2, KIND_WRITE)
    g.link(1, 3, KIND_READ)  # two successors are a fork, not a hub: the newest is followed
    assert not g.unsettled(1) and g.next(1) == (3, KIND_READ)


def test_graph_bounds_fanout_and_nodes():
    g = SuccessorGraph(max_nodes=5, fanout=2)
    for b in range(10, 20):
        g.link(1, b, KIND_READ)
    assert g.successors(1) == [18, 19]
    assert not g.predecessors(10)
    for a in range(100, 120):
        g.link(a, a + 1000, KIND_WRITE)
    assert len(g) == 5
    assert sum(len(g.predecessors(b)) for b in list(g.pred)) == g.edges()


def test_graph_shared_successor_and_relinking():
    g = SuccessorGraph(fanout=2)
    g.link(1, 9, KIND_WRITE)
    g.link(2, 9, KIND_WRITE)
    g.link(3, 9, KIND_WRITE)
    assert g.predecessors(9) == {1, 2, 3}
    g.link(1, 5, KIND_WRITE)
    g.link(1, 9, KIND_READ)  # again: most recent, now a read edge
    assert g.successors(1) == [5, 9] and g.next(1) == (9, KIND_READ)
    g.link(1, 6, KIND_WRITE)  # fanout 2: 5 goes
    assert g.successors(1) == [9, 6] and not g.predecessors(5)
    g.forget(2)
    g.forget(3)
    assert g.predecessors(9) == {1}
    g.forget(9)
    assert g.successors(1) == [6] and g.next(1) == (6, KIND_WRITE)
    assert sum(len(g.predecessors(b)) for b in list(g.pred)) == g.edges()


def test_graph_forget_removes_edges_both_ways():
    g = SuccessorGraph()
    g.link(1, 2, KIND_READ)
    g.link(2, 3, KIND_READ)
    g.forget(2)
    assert g.next(1) is None
    assert not g.successors(2) and not g.predecessors(2) and not g.predecessors(3)


def test_predict_whole_file_then_chain():
    g = SuccessorGraph()
    g.link(1, 2, KIND_WRITE)
    g.link(2, 3, KIND_READ)
    n = {1: 3, 2: 2, 3: 4}.get
    got = predict(g, (1, 0), n, 6)
    assert got == [((1, 1), KIND_WHOLE), ((1, 2), KIND_WHOLE), ((2, 0), KIND_WRITE),
                   ((2, 1), KIND_WHOLE), ((3, 0), KIND_READ), ((3, 1), KIND_WHOLE)]
    assert predict(g, (1, 0), n, 1) == [((1, 1), KIND_WHOLE)]


def test_hintbook_dedups_and_expires():
    h = HintBook(ttl_s=10)
    assert h.add((1, 0), 0.0)
    assert not h.add((1, 0), 1.0)
    assert h.repeats == 1
    assert h.add((2, 0), 5.0)
    assert h.expired(11.0) == [(1, 0)]
    assert h.consumed((2, 0)) and not h.consumed((2, 0))
    h.add((3, 0), 20.0)
    h.add((3, 1), 20.0)
    assert sorted(h.forget(3)) == [(3, 0), (3, 1)]
    assert h.forget(3) == [] and not h.keys and not h.by_ino  # nothing left behind


def test_hintbook_forgets_a_file_without_walking_every_hint():
    """Forgetting a file costs its own hints, not all of them (each deletion walked every
    outstanding hint: quadratic when an engine deletes many hinted files)."""

    class Walked(OrderedDict):
        walks = 0

        def __iter__(self):
            Walked.walks += 1
            return super().__iter__()

    h = HintBook(ttl_s=60)
    h.keys = Walked()
    for ino in range(1000):
        h.add((ino, 0), 0.0)
        h.add((ino, 1), 0.0)
    for ino in range(1000):
        assert sorted(h.forget(ino)) == [(ino, 0), (ino, 1)]
    assert Walked.walks == 0
    assert not h.keys and not h.by_ino


# -- the facade: events -> windows -> wanted chunks ----------------------------------------------
def test_write_order_predicts_first_read():
    sizes = {i: CS for i in range(10, 20)}
    ra, store, clock = make(sizes)
    for ino in range(10, 20):  # one writer creates the blocks of a request in prefix order
        ra.created(ino, 1, pid=7)
        clock.tick()
    clock.tick(5)
    ra.opened(10, os.O_RDONLY, CS, pid=8)  # a reader, before any read ever happened
    assert wanted_files(ra) == list(range(11, 19))
    assert {w.kind for w in ra.sched.wants.values()} == {KIND_WRITE}
    ra.read(10, 0, CS, pid=8)
    assert wanted_files(ra) == list(range(11, 19))
    ra.opened(11, os.O_RDONLY, CS, pid=8)
    assert wanted_files(ra) == list(range(11, 20))  # 11 was predicted: held until its read
    ra.read(11, 0, CS, pid=8)
    assert wanted_files(ra) == list(range(12, 20))


def test_read_order_learned_per_reader():
    sizes = {i: CS for i in range(100, 140)}
    ra, store, clock = make(sizes, depth=4)
    a, b = list(range(100, 110)), list(range(120, 130))
    for x, y in zip(a, b, strict=True):  # two readers interleaved
        ra.opened(x, os.O_RDONLY, CS, pid=1)
        ra.read(x, 0, CS, pid=1)
        ra.opened(y, os.O_RDONLY, CS, pid=2)
        ra.read(y, 0, CS, pid=2)
        clock.tick()
    assert ra.graph.next(100) == (101, KIND_READ)
    assert ra.graph.next(120) == (121, KIND_READ)
    assert all(n < 110 for n, _ in ra.graph.chain(100, 20))  # no edge into the other chain
    clock.tick(5)
    ra.sweep(clock())
    assert not ra.sched.wants
    ra.opened(120, os.O_RDONLY, CS, pid=3)
    ra.read(120, 0, CS, pid=3)
    assert wanted_files(ra) == [121, 122, 123, 124]


def test_whole_file_readahead_on_open():
    ra, store, clock = make({5: 5 * CS}, depth=3)
    ra.opened(5, os.O_RDONLY, 5 * CS, pid=1)
    assert sorted(ra.sched.wants) == [(5, 1), (5, 2), (5, 3)]
    ra.read(5, 0, 2 * CS, pid=1)  # one read covering chunks 0 and 1
    assert sorted(ra.sched.wants) == [(5, 2), (5, 3), (5, 4)]
    ra.read(5, 5 * CS, 4096, pid=1)  # the read at EOF is not a step
    assert sorted(ra.sched.wants) == [(5, 2), (5, 3), (5, 4)]


def test_read_through_files_are_read_ahead_not_prefetched():
    sizes = {i: 2 * CS for i in range(10, 14)}
    ra, store, clock = make(sizes, depth=6)
    store.through.add(12)  # the store reads this one ahead of its reader itself
    for ino in range(10, 14):
        ra.created(ino, 1, pid=7)
        clock.tick()
    ra.opened(10, os.O_RDONLY, 2 * CS, pid=8)
    assert wanted_files(ra) == [10, 11, 13]  # the chain goes on past it
    assert store.read_ahead == [(12, 0), (12, 1)]  # into memory, by the store


def test_write_only_open_predicts_nothing():
    ra, store, clock = make({5: 5 * CS})
    ra.opened(5, os.O_WRONLY, 5 * CS, pid=1)
    assert not ra.sched.wants


def test_divergence_and_skips_release_the_window():
    sizes = {i: CS for i in range(1, 30)}
    ra, store, clock = make(sizes, depth=4)
    for ino in range(1, 10):
        ra.created(ino, 1, pid=1)
        clock.tick()
    clock.tick(5)
    ra.opened(1, os.O_RDONLY, CS, pid=2)
    ra.read(1, 0, CS, pid=2)
    assert wanted_files(ra) == [2, 3, 4, 5]
    ra.opened(4, os.O_RDONLY, CS, pid=2)  # skipped 2 and 3
    ra.read(4, 0, CS, pid=2)
    assert wanted_files(ra) == [5, 6, 7, 8]
    ra.opened(20, os.O_RDONLY, CS, pid=2)  # off the predicted path: nothing known after 20
    ra.read(20, 0, CS, pid=2)
    assert wanted_files(ra) == []


def test_cheap_only_when_predicted_early_enough():
    sizes = {i: CS for i in range(1, 20)}
    ra, store, clock = make(sizes, depth=8)
    for ino in range(1, 20):
        ra.created(ino, 1, pid=1)
        clock.tick()
    clock.tick(5)
    assert ra.tuning.lead == 1
    for ino in range(1, 6):
        ra.opened(ino, os.O_RDONLY, CS, pid=2)
        ra.read(ino, 0, CS, pid=2)
        clock.tick()
    # 1 is the head (unpredicted); 2 was predicted one read ahead (== lead: no margin); the
    # others two or more reads ahead: prediction stages them in time, they are cheap.
    assert not store.policy.cheap((1, 0))
    assert not store.policy.cheap((2, 0))
    assert all(store.policy.cheap((i, 0)) for i in range(3, 6))
    assert not store.policy.cheap((3, 0))  # the answer is used once


def test_unpredicted_fetches_enter_protected():
    """A read nothing predicted (a request's first block) that brings its chunk in from NVMe
    protects the copy; chunks brought in by prediction (or by a read that is over) do not."""
    sizes = {i: CS for i in range(1, 20)}
    ra, store, clock = make(sizes, depth=8)
    for ino in range(1, 20):
        ra.created(ino, 1, pid=1)
        clock.tick()
    clock.tick(5)
    ra.opened(1, os.O_RDONLY, CS, pid=2)  # unpredicted: the head of a run
    ra.read(1, 0, CS, pid=2)
    store.policy.inserted((1, 0))  # its fetch promotes it
    assert (1, 0) in store.policy.protected
    store.policy.inserted((2, 0))  # a prefetch of the predicted next block
    assert (2, 0) in store.policy.probation
    ra.opened(7, os.O_RDONLY, CS, pid=3)  # another head, read from DRAM (a hit)...
    ra.read(7, 0, CS, pid=3)
    ra.opened(8, os.O_RDONLY, CS, pid=3)  # ...its reader moved on
    ra.read(8, 0, CS, pid=3)
    store.policy.inserted((7, 0))  # a later insertion of 7 is no unpredicted fetch
    assert (7, 0) in store.policy.probation
    assert ra.stats()["prefetch"]["unpredicted_fetches"] == 1


def test_write_heads_are_protected_on_close():
    sizes = {i: CS for i in range(1, 10)}
    ra, store, clock = make(sizes)
    for ino in range(1, 10):
        store.in_dram.add((ino, 0))
        store.policy.inserted((ino, 0))
        ra.created(ino, 1, pid=1)
        ra.closed(ino, pid=1)
        clock.tick()
    lead = ra.tuning.lead
    assert list(store.policy.protected) == [(i, 0) for i in range(1, 2 + lead)]


def test_hints_stage_once_and_are_consumed_by_the_read():
    ra, store, clock = make({3: 2 * CS})
    ra.hint(3, 2 * CS)
    ra.hint(3, 2 * CS)  # a second queued request wants it too
    assert sorted(ra.sched.wants) == [(3, 0), (3, 1)]
    assert ra.hints.repeats == 2
    assert {w.kind for w in ra.sched.wants.values()} == {KIND_HINT}
    assert ra.sched.n["requested"] == 2
    ra.opened(3, os.O_RDONLY, 2 * CS, pid=9)
    assert (3, 0) in ra.sched.wants  # opened, not read yet: still protected
    ra.read(3, 0, 2 * CS, pid=9)
    assert (3, 0) not in ra.sched.wants and (3, 1) not in ra.hints.keys


def test_hints_expire():
    ra, store, clock = make({3: CS})
    ra.hint(3, CS)
    clock.tick(ra.hints.ttl_s + 1)
    ra.sweep(clock())
    assert not ra.sched.wants


def test_forgotten_file_leaves_every_structure():
    sizes = {i: CS for i in range(1, 6)}
    ra, store, clock = make(sizes)
    for ino in range(1, 6):
        ra.created(ino, 1, pid=1)
        clock.tick()
    ra.hint(4, CS)
    ra.opened(1, os.O_RDONLY, CS, pid=2)
    ra.read(1, 0, CS, pid=2)
    ra.forgotten(3)
    assert 3 not in ra.graph.succ and 3 not in ra.graph.pred
    assert all(k[0] != 3 for k in ra.sched.wants)
    assert all(k[0] != 3 for r in ra.readers.values() for k in r.window)


def test_idle_reader_windows_are_dropped():
    sizes = {i: CS for i in range(1, 6)}
    ra, store, clock = make(sizes)
    for ino in range(1, 6):
        ra.created(ino, 1, pid=1)
        clock.tick()
    ra.opened(1, os.O_RDONLY, CS, pid=2)
    assert ra.sched.wants
    clock.tick(IDLE_S * 2)
    ra.sweep(clock())
    assert not ra.sched.wants and not ra.readers


def test_prediction_off_is_the_plain_policy():
    sizes = {i: CS for i in range(1, 6)}
    ra, store, clock = make(sizes, enabled=False)
    for ino in range(1, 6):
        ra.created(ino, 1, pid=1)
    ra.opened(1, os.O_RDONLY, CS, pid=2)
    ra.read(1, 0, CS, pid=2)
    ra.hint(2, CS)
    assert not ra.sched.wants and len(ra.graph) == 0
    assert ra.stats()["prefetch"] == {"enabled": False, "hints_ignored": 1}
    # The policy keeps its defaults: identical to a policy nobody attached to.
    plain = DramPolicy(64)
    assert store.policy.keep is plain.keep and store.policy.cheap is plain.cheap
    _ = make(sizes, depth=0)  # readahead_chunks=0 is "off" too
    assert not _[0].enabled


def test_hooked_policy_equals_plain_slru_when_nothing_is_predicted():
    """With readahead attached but no predictions, DramPolicy makes the same choices."""
    rng = random.Random(3)
    ra, store, clock = make({})
    hooked, plain = store.policy, DramPolicy(64)
    for _ in range(5000):
        key = (rng.randrange(200), 0)
        op = rng.random()
        for p in (hooked, plain):
            if op < 0.5:
                p.inserted(key)
            elif op < 0.9:
                p.hit(key)
            else:
                p.removed(key)
        assert [*hooked.probation, *hooked.protected] == [*plain.probation, *plain.protected]
        assert hooked.next_victim(set()) == plain.next_victim(set())
        assert hooked.next_victim(set()) == plain.next_victim(set())


def test_graph_edge_count_stays_the_sum_of_successor_lists():
    """`edges()` is a counter (status asks it on a live mount; a sum is O(files))."""
    rng = random.Random(7)
    g = SuccessorGraph(max_nodes=40, fanout=3)
    for step in range(3000):
        a, b = rng.randrange(60), rng.randrange(60)
        if step % 11 == 0:
            g.forget(a)
        else:
            g.link(a, b, rng.choice((KIND_READ, KIND_WRITE)))
        assert g.edges() == sum(len(out) for out in g.succ.values())
