"""The DRAM arena's slot bookkeeping when freed slots' pages are punched in a worker thread
(DramArena.defer_punches): a queued slot is not handed out before its punch, the RAM count
drops once the punch is done, and nothing queued is forgotten."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import uuid

import pytest

from kvfs.store.dram import DramArena

CS = 64 << 10


@pytest.fixture
def arena():
    directory = f"/dev/shm/kvfs-test-dram-{uuid.uuid4().hex[:8]}"
    a = DramArena(directory, "test", CS, 4 * CS, prefault=False)
    a.adopt({})
    yield a
    a.close()
    shutil.rmtree(directory, ignore_errors=True)


def fill(a: DramArena, n: int) -> list[int]:
    slots = []
    for i in range(n):
        s = a.alloc(CS)
        a.write(s, 0, bytes([i + 1]) * CS)
        slots.append(s)
    return slots


def test_a_deferred_punch_holds_the_slot_until_done(arena):
    queued = []
    arena.defer_punches = True
    arena.on_punch_queued = lambda: queued.append(1)
    slots = fill(arena, 8)  # 8 chunks in a 4-chunk budget: over it
    before = arena.resident
    free_before = arena.free_slots
    arena.free(slots[0], CS)
    assert queued and arena.pending_punches == 1
    assert arena.free_slots == free_before + 1  # counted as free: alloc could take it
    assert arena.resident == before  # the pages are still there
    batch = arena.take_punches()
    assert batch[0][0] == slots[0]
    arena.punched(batch, arena.punch_many(batch))
    assert arena.resident == before - CS
    assert arena.pending_punches == 0
    assert bytes(arena.slot_view(slots[0], 16)) == bytes(16)  # the pages are gone


def test_alloc_punches_a_queued_slot_itself_when_nothing_else_is_free(arena):
    arena.defer_punches = True
    slots = fill(arena, arena.nslots)
    assert arena.free_slots == 0
    arena.free(slots[3], CS)
    assert arena.pending_punches == 1
    again = arena.alloc(CS)
    assert again == slots[3] and arena.pending_punches == 0
    assert bytes(arena.slot_view(again, 16)) == bytes(16)


def test_close_finishes_the_queued_punches():
    directory = f"/dev/shm/kvfs-test-dram-{uuid.uuid4().hex[:8]}"
    a = DramArena(directory, "test", CS, 4 * CS, prefault=False)
    a.adopt({})
    try:
        a.defer_punches = True
        slots = fill(a, 8)
        for s in slots[:4]:
            a.free(s, CS)
        assert a.pending_punches == 4
        a.close()
        assert a.pending_punches == 0 and a.resident == 4 * CS
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_without_deferral_a_free_punches_at_once(arena):
    slots = fill(arena, 8)
    before = arena.resident
    arena.free(slots[0], CS)
    assert arena.pending_punches == 0 and arena.resident == before - CS


@pytest.fixture
def reserved():
    """An arena with prefault on (the daemon's default), its slots not populated yet."""
    directory = f"/dev/shm/kvfs-test-dram-{uuid.uuid4().hex[:8]}"
    a = DramArena(directory, "test", CS, 4 * CS)
    a.adopt({})
    yield a
    a.close()
    shutil.rmtree(directory, ignore_errors=True)


def prefault(a: DramArena) -> list[int]:
    """What ChunkStore.prefault_dram does, on this thread."""
    slots = a.to_prefault(a.capacity)
    a.fill(slots)
    a.prefaulted(slots)
    return slots


def test_prefaulted_slots_hold_their_pages_and_stay_zero_filled(reserved):
    before = os.stat(reserved.path).st_blocks
    slots = prefault(reserved)  # each page faulted in, as a write would
    assert len(slots) == 4
    assert os.stat(reserved.path).st_blocks - before == 4 * CS // 512
    assert reserved.resident == reserved.warm_bytes == 4 * CS
    s = reserved.alloc(CS)
    assert s in slots and bytes(reserved.slot_view(s, CS)) == bytes(CS)


def test_small_chunks_in_prefaulted_slots_keep_the_arena_within_its_capacity(reserved):
    """Prefaulted slots hold whole chunks' pages; quarter-size chunks in them leave tails
    nobody reads. When more chunks come than prefaulted slots, those tails are trimmed so
    the arena's RAM stays within its capacity, and no chunk loses a byte."""
    a = reserved
    prefault(a)
    quarter = CS // 4
    owned = []
    for i in range(12):  # 12 x CS/4 = 3 x CS of data in a 4 x CS arena
        s = a.alloc(quarter)
        a.write(s, 0, bytes([i + 1]) * quarter)
        owned.append(s)
        assert a.resident <= a.capacity
        assert os.stat(a.path).st_blocks * 512 == a.resident
    assert a.trimmed >= 3
    for i, s in enumerate(owned):
        assert bytes(a.slot_view(s, quarter)) == bytes([i + 1]) * quarter
    s = owned[0]  # an owner that grows its chunk in place gets its pages counted
    a.grow(s, CS)
    a.slot_view(s, CS)[quarter:] = b"x" * (CS - quarter)
    assert os.stat(a.path).st_blocks * 512 == a.resident


def test_prefault_falls_back_to_fallocate_on_kernels_without_populate_write(reserved,
                                                                           monkeypatch):
    import kvfs.store.dram as dram

    def no_populate(address, length):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(dram, "populate_write", no_populate)
    prefault(reserved)
    assert not reserved._populate_by_madvise
    assert os.stat(reserved.path).st_blocks * 512 == reserved.resident == 4 * CS


def test_prefault_into_a_full_tmpfs_is_an_error_not_a_crash(tmp_path):
    """MADV_POPULATE_WRITE reports a full tmpfs as EFAULT (no SIGBUS); the slots go back
    empty, and nothing counts pages the arena does not hold."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        a = DramArena(str(mnt / "arena"), "test", 1 << 20, 4 << 20)
        a.adopt({})
        slots = a.to_prefault(4 << 20)
        with pytest.raises(OSError):
            a.fill(slots)
        a.prefaulted(slots, ok=False)
        assert a.resident == 0 and os.stat(a.path).st_blocks == 0
        # a decode into a slot asks for its pages first: a full tmpfs is a False, not SIGBUS
        s, start = a.alloc_unfaulted(512 << 10)
        assert start == 0 and a.ensure_pages(s, start, 512 << 10)
        with open(mnt / "filler", "wb") as f:  # someone else fills the tmpfs
            with pytest.raises(OSError):
                f.write(bytes(1 << 20))
        assert not a.ensure_pages(*a.alloc_unfaulted(512 << 10), 512 << 10)
        a.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
