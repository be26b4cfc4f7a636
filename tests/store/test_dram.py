"""The DRAM tier's files (kvfs/store/dram.py) on a real tmpfs, without a mount: regions,
punching and disposal, pins, held descriptors, and what a mount adopts after a crash."""

from __future__ import annotations

import errno
import os
import shutil
import uuid

import pytest

from kvfs.store.dram import FREE_AT_ONCE, DramFiles

CS = 64 << 10


@pytest.fixture
def dram():
    directory = f"/dev/shm/kvfs-test-dram-{uuid.uuid4().hex[:8]}"
    d = DramFiles(directory, "test", CS, 16 * CS)
    d.adopt({})
    yield d
    d.close()
    shutil.rmtree(directory, ignore_errors=True)


def put(d: DramFiles, ino: int, c: int, fill: int, n: int = CS) -> None:
    d.claim(ino, c)
    d.write(ino, c, 0, bytes([fill]) * n)


def ram(d: DramFiles, ino: int) -> int:
    return os.stat(d.path(ino)).st_blocks * 512


def test_chunks_sit_at_their_own_offsets(dram):
    put(dram, 7, 0, 1)
    put(dram, 7, 2, 3, 1000)
    with open(dram.path(7), "rb") as f:
        data = f.read()
    assert data == bytes([1]) * CS + bytes(CS) + bytes([3]) * 1000  # a hole reads as zeros
    assert ram(dram, 7) == CS + 4096  # holes cost nothing


def test_a_released_region_is_punched_after_settle(dram):
    put(dram, 7, 0, 1)
    put(dram, 7, 1, 2)
    dram.release(7, 0, CS)
    assert ram(dram, 7) == 2 * CS  # nothing happens before the commit settles
    dram.settle()
    assert ram(dram, 7) == CS
    with open(dram.path(7), "rb") as f:
        assert f.read(CS) == bytes(CS)


def test_a_file_with_nothing_left_goes_to_a_worker(dram):
    queued = []
    dram.on_disposal_queued = lambda: queued.append(1)
    chunks = range(FREE_AT_ONCE // CS + 1)  # too big to free on the spot
    for c in chunks:
        put(dram, 7, c, 1)
    for c in chunks:
        dram.release(7, c, CS)
    dram.settle()
    assert not os.path.exists(dram.path(7)) and queued
    batch = dram.take_disposals()
    assert len(batch) == 1 and os.path.exists(batch[0][0])  # renamed into the trash
    dram.dispose_many(batch)
    assert os.listdir(dram.trash_dir) == []
    put(dram, 7, 0, 9)  # the inode gets a new, empty file
    with open(dram.path(7), "rb") as f:
        assert f.read() == bytes([9]) * CS


def test_a_small_file_with_nothing_left_is_removed_at_once(dram):
    """No rename into the trash for a worker: that waits for the worker's unlinks there."""
    queued = []
    dram.on_disposal_queued = lambda: queued.append(1)
    put(dram, 7, 0, 1)
    dram.release(7, 0, CS)
    dram.settle()
    assert not os.path.exists(dram.path(7)) and not queued
    assert os.listdir(dram.trash_dir) == [] and dram.freed_at_once == 1
    put(dram, 7, 0, 9)  # the inode gets a new, empty file
    with open(dram.path(7), "rb") as f:
        assert f.read() == bytes([9]) * CS


def test_a_pinned_file_stays_until_unpinned(dram):
    put(dram, 7, 0, 1)
    dram.pin(7)
    dram.release(7, 0, CS)
    dram.settle()
    assert os.path.exists(dram.path(7))  # the kernel may be reading it
    dram.unpin(7)
    assert not os.path.exists(dram.path(7))


def test_a_held_descriptor_outlives_disposal(dram):
    put(dram, 7, 0, 5)
    held = dram.hold(7)
    dram.release(7, 0, CS)
    dram.settle()
    dram.dispose_many(dram.take_disposals())  # unlinked, not closed: a worker still reads
    buf = bytearray(16)
    dram.read_region(held.fd, 0, buf)
    assert buf == bytes([5]) * 16
    dram.drop(held)
    batch = dram.take_disposals()
    assert batch == [("", held.fd)]
    dram.dispose_many(batch)
    with pytest.raises(OSError):
        os.fstat(held.fd)


def test_extend_and_truncate_keep_the_file_as_long_as_asked(dram):
    put(dram, 7, 0, 1, 100)
    dram.extend(7, 3 * CS)
    assert os.path.getsize(dram.path(7)) == 3 * CS
    dram.truncate(7, 50)
    with open(dram.path(7), "rb") as f:
        assert f.read() == bytes([1]) * 50
    dram.truncate(8, 0)  # no file: nothing to do, nothing created
    assert not os.path.exists(dram.path(8))


def test_descriptors_are_bounded(dram):
    dram.max_fds = 8
    held = dram.hold(1)
    for ino in range(1, 40):
        put(dram, ino, 0, ino % 250, 4096)
    assert dram.open_files <= 9
    assert dram.fd(1) == held.fd  # held files are never closed under their holder
    dram.drop(held)


def test_adopt_keeps_owned_regions_and_clears_the_rest():
    """After a crash: a fetch's bytes never committed, a file nothing owns, a region longer
    than its chunk now is, a file longer than its last chunk."""
    directory = f"/dev/shm/kvfs-test-dram-{uuid.uuid4().hex[:8]}"
    try:
        d = DramFiles(directory, "fs", CS, 16 * CS)
        d.adopt({})
        put(d, 5, 0, 1)
        put(d, 5, 1, 2)  # not in lmdb: gone at the next mount
        put(d, 5, 3, 4)
        put(d, 6, 0, 6)  # a file nobody owns
        d.close()
        d = DramFiles(directory, "fs", CS, 16 * CS)
        assert d.survived
        d.adopt({5: [(0, 1000), (3, CS)]})
        with open(d.path(5), "rb") as f:
            data = f.read()
        assert data[:1000] == bytes([1]) * 1000 and data[1000:3 * CS] == bytes(3 * CS - 1000)
        assert data[3 * CS:] == bytes([4]) * CS and len(data) == 4 * CS
        assert not os.path.exists(d.path(6))
        assert d.claims == {5: 2}
        d.close()
        d = DramFiles(directory, "another fs", CS, 16 * CS)  # not ours: starts empty
        assert not d.survived and os.listdir(d.files_dir) == []
        d.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_any_change_of_a_region_forgets_its_check(dram):
    """dram_verify=once trusts a checked region only until something writes into it,
    whoever asked for the write: claim, write, punch, release, truncate, disposal."""
    def checked_after(change) -> bool:
        for c in range(3):
            put(dram, 5, c, 1)
            dram.mark_checked(5, c, 100 + c)
        change()
        return dram.checked(5, 1, 101)

    assert checked_after(lambda: None)
    assert not dram.checked(5, 1, 999)  # another seq: another chunk's bytes
    assert not checked_after(lambda: dram.write(5, 1, 10, b"x"))
    assert dram.checked(5, 0, 100) and dram.checked(5, 2, 102)  # neighbours keep theirs
    assert not checked_after(lambda: dram.claim(5, 1))
    assert not checked_after(lambda: dram.punch(5, CS + 4096, 4096))
    assert not checked_after(lambda: dram.release(5, 1, CS))
    assert not checked_after(lambda: dram.truncate(5, CS + 5))
    assert dram.checked(5, 0, 100)
    assert not checked_after(lambda: dram.dispose(5))
    put(dram, 6, 0, 1)
    dram.mark_checked(6, 0, 7)
    assert dram.checked(6, 0, 7, consume=True) and not dram.checked(6, 0, 7)  # one read only


def test_running_out_of_descriptors_closes_cached_ones(dram, monkeypatch):
    """EMFILE at an open (something else holds many descriptors): the unused cached
    descriptors go, the cache keeps fewer from then on, and the open succeeds."""
    for ino in range(1, 21):
        put(dram, ino, 0, ino, 4096)
    held = dram.hold(1)
    real_open = os.open
    failed = []

    def open_once_failing(path, flags, mode=0o777):
        if not failed and path == dram.path(21):
            failed.append(path)
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, mode)

    monkeypatch.setattr("kvfs.store.dram.os.open", open_once_failing)
    put(dram, 21, 0, 21, 4096)
    assert failed
    assert dram.max_fds == 16 and dram.open_files <= 2  # the held one and the new one
    assert dram.fd(1) == held.fd
    dram.drop(held)
    with open(dram.path(21), "rb") as f:
        assert f.read(4096) == bytes([21]) * 4096
