"""The DRAM tier lost (a reboot) while chunks written over since their last write-back are
only in DRAM: each goes back to its shadow (what an fsync may have promised), and that must
hold however often DRAM is lost before the chunk is written back again. Found by
tools/crashloop.py --dram-loss-every 1."""

from __future__ import annotations

import errno
import os

import pytest

CHUNK = 64 << 10


def _read(m, name: str, off: int, n: int) -> bytes:
    fd = os.open(m.path / name, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


@pytest.mark.parametrize("change", ["cut", "a hole chunk", "past a chunk's end"])
def test_fsynced_bytes_survive_losing_dram_twice(kv, change):
    """A chunk that a mount after the loss rebuilds in DRAM from its shadow (cut by a
    truncation since, or zeros before the first byte written since) keeps that shadow until
    it is written back: DRAM lost again before that takes it back to it again. (The shadow
    used to go at the first mount: the second loss lost the chunk, fsync'ed bytes and all.)
    And the seal at close does not change the first byte written since the shadow: it
    used to make it 0, so that the zeros before the write were lost with the rest."""
    p = kv.path / "f"
    data = os.urandom(CHUNK)
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        if change == "cut":
            os.pwrite(fd, data, 0)
            durable = (0, data[:43418])
        else:
            head = CHUNK + 4464 if change == "past a chunk's end" else 1000
            os.pwrite(fd, b"a" * head, 0)
            os.ftruncate(fd, CHUNK + 13175)  # zeros up to there in chunk 1
            durable = (CHUNK, (b"a" * max(0, head - CHUNK)).ljust(13175, b"\0"))
        os.fsync(fd)
    finally:
        os.close(fd)
    kv.unmount()  # everything written back, DRAM clean
    kv.start()
    if change == "cut":
        os.truncate(p, 43418)
    else:
        fd = os.open(p, os.O_WRONLY)
        os.pwrite(fd, b"b" * 5000, CHUNK + 13175)  # into chunk 1 past the zeros, no fsync
        os.close(fd)
    kv.status()  # (after the close's release: the chunk sealed, its shadow's start kept)
    for _ in range(2):
        kv.reboot()
        kv.start()
        off, want = durable
        assert _read(kv, "f", off, len(want)) == want


def test_a_hole_written_from_its_start_goes_back_to_the_hole_with_dram_lost(kv):
    """A hole an fsync made durable, written from its very start since, then DRAM lost:
    the chunk goes back to the hole (zeros: the bytes it had at the fsync), as a chunk with
    a record goes back to that record. It once became a chunk with no copy anywhere that
    was not marked lost, which failed the file's opens with a traceback (segment 0 does not
    exist) and made read-ahead retry it forever (365,000 tracebacks in a crash loop's
    log); then it was lost whole (EIO), the durable zeros after the write with it."""
    p = kv.path / "f"
    data = os.urandom(CHUNK)
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, 3 * CHUNK)  # chunks 1 and 2: holes
        os.fsync(fd)
    finally:
        os.close(fd)
    kv.unmount()
    kv.start()
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"b" * 100, CHUNK + 5000)  # into hole chunk 1, past its start...
        os.pwrite(fd, b"c" * 100, CHUNK)  # ...and from its start
    finally:
        os.close(fd)
    kv.reboot()
    kv.start()
    assert _read(kv, "f", 0, CHUNK) == data
    assert _read(kv, "f", CHUNK, 2 * CHUNK) == bytes(2 * CHUNK)
    assert "Traceback" not in kv.log()


def test_bytes_appended_to_a_hole_chunk_and_lost_read_eio_not_zeros(kv):
    """The file's end in a hole chunk (a truncation up), fsync'ed; then bytes appended
    there, never fsync'ed, and DRAM lost: the zeros up to the old end come back, the
    appended bytes read EIO, never zeros (they were never a hole)."""
    p = kv.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        os.pwrite(fd, b"a" * 1000, 0)
        os.ftruncate(fd, CHUNK + 3000)
        os.fsync(fd)
    finally:
        os.close(fd)
    kv.unmount()
    kv.start()
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, b"b" * 7000, CHUNK + 3000)
    finally:
        os.close(fd)
    kv.reboot()
    kv.start()
    assert _read(kv, "f", CHUNK, 3000) == bytes(3000)
    with pytest.raises(OSError) as ei:
        _read(kv, "f", CHUNK + 3000, 100)
    assert ei.value.errno == errno.EIO
    assert [c["lost"] for c in kv.where("f")] == [False, False]


def test_bytes_a_truncation_cut_off_never_come_back_with_dram_lost(kv):
    """Cut by a truncation, then written past the cut (the zeros between read as zeros),
    then DRAM lost: the chunk should go back to its shadow only up to the cut. It goes
    back up to its new length, so the cut-off bytes of the old record come back where the
    file had zeros and new bytes. (Going back only up to the first byte changed since
    instead loses fsync'ed bytes after a write before the cut: the test below.)"""
    p = kv.path / "f"
    data = os.urandom(CHUNK)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    kv.unmount()
    kv.start()
    os.truncate(p, 43418)
    with open(p, "r+b") as f:
        f.seek(50000)
        f.write(b"x" * 1000)  # [43418, 50000) reads zeros now
    kv.reboot()
    kv.start()
    assert _read(kv, "f", 0, 43418) == data[:43418]
    try:
        gap = _read(kv, "f", 43418, 50000 - 43418)
    except OSError as exc:
        assert exc.errno == errno.EIO
    else:
        assert gap == bytes(len(gap))


def test_fsynced_zeros_after_a_write_survive_losing_dram(kv):
    """A hole an fsync made durable, written at its start since (bytes 0-999 of the
    chunk), then DRAM lost: the written bytes are lost (EIO), but the zeros after them were
    durable and never written: they must read as zeros. They read EIO: the chunk is lost
    whole (2 of 100 cycles of tools/crashloop.py --dram-loss-every 1)."""
    p = kv.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        os.pwrite(fd, b"a" * 1000, 0)
        os.ftruncate(fd, 2 * CHUNK)  # chunk 1: a hole, fsync'ed
        os.fsync(fd)
    finally:
        os.close(fd)
    kv.unmount()
    kv.start()
    fd = os.open(p, os.O_WRONLY)
    os.pwrite(fd, b"b" * 1000, CHUNK)
    os.close(fd)
    kv.reboot()
    kv.start()
    assert _read(kv, "f", CHUNK + 1000, CHUNK - 1000) == bytes(CHUNK - 1000)


def test_fsynced_bytes_after_a_write_survive_a_cut_and_losing_dram(kv):
    """Written over in its middle, then cut short (neither fsync'ed), then DRAM lost: the
    fsync'ed bytes after the write and before the cut are the shadow's and must read back.
    (Going back only up to the first byte written since lost them: EIO, 1 of 300 cycles of
    tools/crashloop.py.)"""
    p = kv.path / "f"
    data = os.urandom(CHUNK)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    kv.unmount()
    kv.start()
    with open(p, "r+b") as f:
        f.seek(30000)
        f.write(b"x" * 100)
    os.truncate(p, 64971)
    kv.reboot()
    kv.start()
    assert _read(kv, "f", 30100, 64971 - 30100) == data[30100:64971]
