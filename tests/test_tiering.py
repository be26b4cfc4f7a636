"""DramPolicy's eviction order when readahead wants chunks kept."""

from __future__ import annotations

from kvfs.tiering import DramPolicy


def test_when_only_kept_chunks_are_left_the_one_wanted_last_goes_first():
    p = DramPolicy(64)
    keys = [(1, c) for c in range(6)]
    for k in keys:
        p.inserted(k)
    wanted = {(1, 0): 5.0, (1, 1): 1.0, (1, 2): 9.0, (1, 3): 2.0}  # (1, 4), (1, 5): not
    p.keep = wanted.__contains__
    p.deadline = wanted.get
    assert list(p.victims()) == [(1, 4), (1, 5), (1, 2), (1, 0), (1, 3), (1, 1)]
    assert p.next_victim(set()) == (1, 4)  # unwanted ones go first, coldest first
    assert p.next_victim({(1, 4), (1, 5)}) is None  # while they leave, kept ones wait
    p.removed((1, 4))
    p.removed((1, 5))
    assert p.next_victim(set()) == (1, 2)  # then the one wanted last
    p.removed((1, 2))
    assert p.next_victim(set()) == (1, 0)


def test_without_predictions_the_order_is_plain_slru():
    p = DramPolicy(64)
    for c in range(4):
        p.inserted((1, c))
    p.hit((1, 0))  # protected: after every probation key
    assert list(p.victims()) == [(1, 1), (1, 2), (1, 3), (1, 0)]
    assert p.next_victim({(1, 1)}) == (1, 2)


def test_a_victim_run_gives_what_successive_next_victim_calls_would():
    """One scan for a demotion step's victims, in next_victim's order, each key checked again
    at its turn (a file pinned meanwhile is passed over)."""
    def policy() -> DramPolicy:
        p = DramPolicy(40)
        for c in range(40):
            p.inserted((c % 3 + 1, c))
        for c in range(0, 40, 5):
            p.hit((c % 3 + 1, c))
        wanted = {(c % 3 + 1, c): float(c % 7) for c in range(0, 40, 4)}
        p.keep = wanted.__contains__
        p.deadline = wanted.get
        p.pinned = lambda key: key[0] in pinned
        return p

    pinned: set[int] = {2}
    one, run = policy(), []
    skip: set = set()
    while (key := one.next_victim(skip)) is not None:
        run.append(key)
        if key[1] % 2:
            one.removed(key)  # dropped
        else:
            skip.add(key)  # leaving (written back)
    other, skip2 = policy(), set()
    got = []
    for key in other.victim_run(skip2):
        got.append(key)
        if key[1] % 2:
            other.removed(key)
        else:
            skip2.add(key)
    assert got == run and len(run) > 10

    pinned.clear()
    p, got = policy(), []
    for key in p.victim_run(set()):
        got.append(key)
        p.removed(key)
        if len(got) == 3:
            pinned.add(3)  # a file opened in passthrough meanwhile: its chunks stay
    assert any(k[0] == 3 for k in got[:3]) and len(got) > 10
    assert not any(k[0] == 3 for k in got[3:])


def test_a_victim_run_of_kept_chunks_only_gives_the_one_wanted_last_first():
    p = DramPolicy(64)
    for c in range(5):
        p.inserted((1, c))
    wanted = {(1, 0): 5.0, (1, 1): 1.0, (1, 2): 9.0, (1, 3): 2.0}
    p.keep = wanted.__contains__
    p.deadline = wanted.get
    got = []
    for key in p.victim_run(set()):
        got.append(key)
        p.removed(key)
    assert got == [(1, 4), (1, 2), (1, 0), (1, 3), (1, 1)]
    p2, skip = DramPolicy(64), set()
    for c in range(5):
        p2.inserted((1, c))
    p2.keep, p2.deadline = wanted.__contains__, wanted.get
    run = p2.victim_run(skip)
    skip.add(next(run))  # (1, 4) leaves (written back): the kept ones wait
    assert next(run, None) is None
