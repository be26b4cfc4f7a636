"""DramPolicy's eviction order when readahead wants chunks kept."""

from __future__ import annotations

from kvfs.tiering import DramPolicy


def eviction_order(p: DramPolicy) -> list:
    """Every key, in the order victims leave (each dropped as it comes)."""
    got = []
    for key in p.victim_run(set()):
        got.append(key)
        p.removed(key)
    return got


def test_when_only_kept_chunks_are_left_the_one_wanted_last_goes_first():
    wanted = {(1, 0): 5.0, (1, 1): 1.0, (1, 2): 9.0, (1, 3): 2.0}  # (1, 4), (1, 5): not

    def policy() -> DramPolicy:
        p = DramPolicy(64)
        for c in range(6):
            p.inserted((1, c))
        p.keep = wanted.__contains__
        p.deadline = wanted.get
        return p

    assert eviction_order(policy()) == [(1, 4), (1, 5), (1, 2), (1, 0), (1, 3), (1, 1)]
    p = policy()
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
    assert p.next_victim({(1, 1)}) == (1, 2)
    assert eviction_order(p) == [(1, 1), (1, 2), (1, 3), (1, 0)]


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


def test_a_key_queue_walk_goes_on_while_the_queue_changes():
    """Victim searches walk the queues across awaits instead of copying them at every step:
    a walk must visit every key that is there at its turn, once where it stands."""
    from kvfs.tiering import KeyQueue

    q = KeyQueue()
    for k in range(6):
        q.append(k)
    spot = q.start_walk()
    assert q.step(spot) == 0
    q.discard(1)  # the key the walk stands on leaves: it goes on with the next
    q.append(2)  # moved to the hot end: visited there
    q.appendleft(5)  # moved behind the walk: not visited again
    assert [q.step(spot) for _ in range(3)] == [3, 4, 2]
    assert q.step(spot) is None
    q.append(9)  # added at the hot end after the walk got there
    assert q.step(spot) == 9 and q.step(spot) is None
    q.end_walk(spot)
    assert list(q) == [5, 0, 3, 4, 2, 9] and len(q) == 6
    assert q.popleft() == 5 and 5 not in q and 0 in q


def test_a_victim_search_looks_at_keys_it_passes_once_per_pass():
    """A demotion pass keeps one walk: pinned keys at the cold end are passed over once,
    not at every step (each step's fresh scan of the whole queue made demotion grow with
    the chunks in DRAM: issue 33, defect 4)."""
    from kvfs.tiering import SCAN_STEP

    p = DramPolicy(10_000)
    for c in range(5_000):
        p.inserted((1, c))  # a file open in passthrough: never a victim
    for c in range(1_000):
        p.inserted((2, c))
    p.pinned = lambda key: key[0] == 1
    run = p.victim_run(set(), pause=SCAN_STEP)
    got, pauses = [], 0
    for key in run:
        if key is None:
            pauses += 1  # where the demoter ends its step and lets requests in
            continue
        got.append(key)
        p.removed(key)
    assert got == [(2, c) for c in range(1_000)]
    assert pauses == 5_000 // SCAN_STEP
    assert p.examined == 6_000
    assert p.coldest() is None  # a writer waiting for room leaves the long walk alone
    assert p.examined == 6_000 + SCAN_STEP
