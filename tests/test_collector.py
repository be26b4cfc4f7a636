"""kvfs.collector: no automatic full collection while mounted, young survivors frozen, and a
full pass (when the mount is quiet) that still reclaims cycles which died frozen."""

import gc
import weakref

import pytest
import trio
import trio.testing

from kvfs import collector
from kvfs.collector import CycleCollector


class Node:
    pass


def cycle() -> tuple[Node, weakref.ref]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


@pytest.fixture
def cc():
    before = gc.get_threshold()
    requests = [0]
    c = CycleCollector(lambda: requests[0])
    c.requests = requests
    c.install()
    try:
        yield c
    finally:
        c.uninstall()
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() == 0


def test_install_freezes_and_stops_full_collections(cc):
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[2] == collector.NO_FULL_COLLECTIONS


def test_a_cycle_that_dies_frozen_is_reclaimed_by_the_full_pass(cc):
    a, alive = cycle()
    frozen = gc.get_freeze_count()
    cc.freeze_young()
    assert gc.get_freeze_count() > frozen
    del a
    gc.collect()  # an ordinary collection no longer sees frozen objects
    assert alive() is not None
    assert cc.collect_all() >= 2
    assert alive() is None
    assert cc.stats()["python_gc"]["full_collections"] == 1


def test_young_cycles_are_still_collected(cc):
    a, alive = cycle()
    del a
    gc.collect(1)
    assert alive() is None


def test_run_freezes_often_and_collects_fully_only_when_quiet(cc, monkeypatch):
    monkeypatch.setattr(collector, "FREEZE_EVERY_S", 10.0)
    monkeypatch.setattr(collector, "FULL_EVERY_S", 100.0)
    monkeypatch.setattr(collector, "FULL_LATEST_S", 1000.0)
    events = []
    monkeypatch.setattr(cc, "freeze_young", lambda: events.append(("freeze", trio.current_time())))
    monkeypatch.setattr(cc, "collect_all", lambda: events.append(("full", trio.current_time())))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cc.run)
            while trio.current_time() < 300:  # busy: a request every half second
                cc.requests[0] += 1
                await trio.sleep(0.5)
            await trio.sleep(50)  # quiet
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    fulls = [t for kind, t in events if kind == "full"]
    freezes = [t for kind, t in events if kind == "freeze"]
    assert len(freezes) >= 25
    assert len(fulls) == 1 and 300 <= fulls[0] <= 302  # due at 100 s, done once quiet


def test_a_busy_mount_gets_its_full_pass_anyway(cc, monkeypatch):
    monkeypatch.setattr(collector, "FULL_EVERY_S", 100.0)
    monkeypatch.setattr(collector, "FULL_LATEST_S", 200.0)
    fulls = []
    monkeypatch.setattr(cc, "collect_all", lambda: fulls.append(trio.current_time()))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cc.run)
            while trio.current_time() < 450:
                cc.requests[0] += 1
                await trio.sleep(0.5)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(fulls) == 2 and 200 <= fulls[0] <= 202
