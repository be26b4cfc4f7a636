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
