"""POSIX behaviour engines rely on, checked through a real mount (tmpfs is the reference)."""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import mmap
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Mount


def _err(fn, *args) -> int:
    with pytest.raises(OSError) as ei:
        fn(*args)
    return ei.value.errno


def test_create_write_read_roundtrip(kv):
    p = kv.path / "a.bin"
    data = os.urandom(300_000)
    p.write_bytes(data)
    assert p.read_bytes() == data
    assert p.stat().st_size == len(data)


def test_open_flags(kv):
    p = str(kv.path / "f")
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    os.write(fd, b"hello world")
    os.close(fd)
    assert _err(os.open, p, os.O_CREAT | os.O_EXCL | os.O_WRONLY) == errno.EEXIST
    fd = os.open(p, os.O_RDWR)
    os.pwrite(fd, b"HELLO", 0)
    assert os.pread(fd, 100, 0) == b"HELLO world"
    os.close(fd)
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert os.stat(p).st_size == 0
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert _err(os.open, str(kv.path / "missing"), os.O_RDONLY) == errno.ENOENT


def test_sparse_and_offsets(kv):
    p = str(kv.path / "sparse")
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    tib = 1 << 40
    os.ftruncate(fd, tib)
    os.pwrite(fd, b"x" * 5000, tib - 5000)
    os.pwrite(fd, b"y" * 100, 123_456_789)
    assert os.fstat(fd).st_size == tib
    assert os.pread(fd, 5000, tib - 5000) == b"x" * 5000
    assert os.pread(fd, 300, 123_456_689) == b"\0" * 100 + b"y" * 100 + b"\0" * 100
    assert os.pread(fd, 10, tib) == b""
    # st_blocks counts stored bytes, not the 1 TiB apparent size
    assert os.fstat(fd).st_blocks * 512 < 1 << 20
    os.pwritev(fd, [b"a" * 4096, b"b" * 4096], 65536 - 4096)
    assert os.preadv(fd, [bytearray(4096), bytearray(4096)], 65536 - 4096) == 8192
    assert os.pread(fd, 8192, 65536 - 4096) == b"a" * 4096 + b"b" * 4096
    os.close(fd)


def test_a_sparse_file_of_the_largest_size(kv):
    """2**50 bytes (1 PiB; ext4 with 4 KiB blocks stops at 16 TiB - 4 KiB, tmpfs at 2**63 - 1):
    what kvfs does for a file goes by the chunks it holds, never by its size (a loop over
    the 2**34 chunk numbers of this one never ends)."""
    top = 1 << 50
    p = kv.path / "huge"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.pwrite(fd, b"e" * 5000, top - 5000)
        os.pwrite(fd, b"s" * 5000, 0)
        assert _err(os.pwrite, fd, b"x", top) == errno.EFBIG
        assert _err(os.ftruncate, fd, top + 1) == errno.EFBIG
        assert _err(os.posix_fallocate, fd, top - 4096, 8192) == errno.EFBIG
        os.fsync(fd)
    finally:
        os.close(fd)
    assert os.stat(p).st_size == top
    with open(p, "rb") as f:  # all in DRAM: the kernel reads it (passthrough)
        assert os.pread(f.fileno(), 5000, top - 5000) == b"e" * 5000
        assert os.pread(f.fileno(), 100, top // 2) == bytes(100)
    os.setxattr(p, "user.kvfs.prefetch", b"1")
    kv.unmount()
    kv.start()
    with open(p, "rb") as f:
        assert os.pread(f.fileno(), 5000, 0) == b"s" * 5000
        assert os.pread(f.fileno(), 5000, top - 5000) == b"e" * 5000
    os.truncate(p, top // 2)
    os.truncate(p, top)
    with open(p, "rb") as f:
        assert os.pread(f.fileno(), 5000, top - 5000) == bytes(5000)
    p.unlink()


def test_truncate_shrink_and_grow(kv):
    p = kv.path / "t"
    data = os.urandom(200_000)
    p.write_bytes(data)
    os.truncate(p, 70_000)
    assert p.read_bytes() == data[:70_000]
    os.truncate(p, 150_000)
    assert p.read_bytes() == data[:70_000] + bytes(80_000)
    os.truncate(p, 0)
    assert p.read_bytes() == b""


def _crashed_at(kv, point: str, action) -> None:
    """Remount *kv* with crash point *point* armed, run *action* (which the crash makes
    fail), and remount it as it was."""
    kv.unmount()
    kv.start(crash_at=point)
    with contextlib.suppress(OSError):
        action()
    pid = kv.pid()
    for _ in range(500):  # the daemon killed itself; wait until it is gone
        if pid is None or not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.01)
    subprocess.run(["fusermount3", "-u", "-z", str(kv.path)], capture_output=True)
    assert f"crash point {point} reached" in kv.log()
    kv.start()


@pytest.mark.parametrize("how", ["O_TRUNC", "ftruncate"])
@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_a_crash_right_after_a_truncation_leaves_no_zeros(kv, how, tier):
    """The chunks a truncation removes and the file's new size are one commit: a crash
    just after it leaves the file truncated, never at its old size with its bytes gone
    (which read as zeros: 25 of 40 SIGKILLs in ../shared/repro/repro_trunc.py)."""
    p = kv.path / "f"
    data = os.urandom(3 * 65536 + 3)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if tier == "nvme":
        kv.unmount()
        kv.lose_dram()
        kv.start()
        assert kv.tiers("f") == {"nvme"}

    def truncate() -> None:
        if how == "O_TRUNC":
            os.close(os.open(p, os.O_WRONLY | os.O_TRUNC))
        else:
            os.truncate(p, 65536 + 10)

    _crashed_at(kv, "truncated", truncate)
    got = p.read_bytes()
    assert got in (data, data[:0] if how == "O_TRUNC" else data[:65536 + 10])
    kv.unmount()
    r = kv.fsck()
    assert r.returncode == 0, r.stdout


def test_a_crash_between_the_pieces_of_a_write_leaves_a_prefix_of_it(kv):
    """A write spanning chunks commits chunk by chunk, and the file's size grows with each
    commit: a crash between two leaves the file grown by what was committed, no chunk
    holding bytes past its end (which a file grown again would show instead of zeros)."""
    p = kv.path / "f"
    data = os.urandom(2 * 65536 + 32768)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    kv.unmount()
    kv.lose_dram()  # NVMe only: a write into part of a chunk takes the ordinary path
    more = os.urandom(2 * 65536)
    at = 2 * 65536 + 16384  # into chunk 2, past the file's end, then chunks 3 and 4

    def write() -> None:
        fd = os.open(p, os.O_WRONLY)
        try:
            os.pwrite(fd, more, at)
        finally:
            os.close(fd)

    _crashed_at(kv, "write.piece", write)  # after the piece in chunk 2
    got = p.read_bytes()
    assert got == data[:at] + more[:3 * 65536 - at]
    kv.unmount()
    r = kv.fsck()
    assert r.returncode == 0, r.stdout


def test_a_truncation_lost_with_dram_does_not_bring_old_bytes_back(kv):
    """An fsynced file cut inside a chunk, then DRAM lost: the cut chunk goes back to its
    last written-back record, but only to the bytes the file still has. Grown again, the
    file reads zeros past the cut, not the old bytes (they came back before the fix)."""
    p = kv.path / "f"
    data = os.urandom(3 * 65536)
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    cut = 65536 + 1000
    os.truncate(p, cut)
    kv.reboot()
    kv.start()
    assert p.read_bytes() == data[:cut]
    os.truncate(p, len(data))
    assert p.read_bytes() == data[:cut] + bytes(len(data) - cut)
    kv.unmount()
    r = kv.fsck()
    assert r.returncode == 0, r.stdout


def test_o_direct(kv):
    p = str(kv.path / "direct")
    fd = os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    buf = mmap.mmap(-1, 8192)
    buf.write(b"z" * 8192)
    assert os.pwrite(fd, buf, 0) == 8192
    rb = mmap.mmap(-1, 8192)
    assert os.preadv(fd, [rb], 0) == 8192
    assert rb[:] == b"z" * 8192
    assert _err(os.pwrite, fd, b"abc", 0) == errno.EINVAL  # unaligned length
    assert _err(os.pwrite, fd, bytes(512), 100) == errno.EINVAL  # unaligned offset
    os.close(fd)
    # O_DIRECT switched on later with fcntl(F_SETFL), as Dynamo does
    import fcntl

    fd = os.open(p, os.O_RDWR)
    assert os.pread(fd, 3, 1) == b"zzz"  # not O_DIRECT yet: any offset
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    assert os.pwrite(fd, buf, 8192) == 8192
    # the alignment rule holds from the fcntl on, as on ext4 (kvfs checks the flags each
    # request carries, not those of the open)
    assert _err(os.pwrite, fd, b"abc", 0) == errno.EINVAL
    assert _err(os.pread, fd, 100, 3) == errno.EINVAL
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    assert os.pread(fd, 3, 1) == b"zzz"
    os.close(fd)
    assert os.path.getsize(p) == 16384


def test_mmap_private_read(kv):
    p = kv.path / "m.safetensors"
    data = os.urandom(150_000)
    p.write_bytes(data)
    with open(p, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        assert m[:] == data
        m.close()
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m[0:4] = b"XXXX"  # private: not written back
        assert m[4:100] == data[4:100]
        m.close()
    assert p.read_bytes() == data


def test_shared_writable_mmap_is_refused_not_let_past_kvfs(kv):
    p = kv.path / "mapped"
    data = os.urandom(16384)
    p.write_bytes(data)
    kv.status()  # taken, and in the front thread's table: opens for reading are passthrough
    assert p.read_bytes() == data
    fd = os.open(p, os.O_RDWR)
    try:
        with pytest.raises(OSError) as ei:
            mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED)
        assert ei.value.errno == errno.ENODEV
        private = mmap.mmap(fd, len(data), flags=mmap.MAP_PRIVATE)
        private[0:4] = b"PRIV"  # a private copy: the file does not change
        private.close()
        assert os.pwrite(fd, b"WRIT", 0) == 4
    finally:
        os.close(fd)
    assert p.read_bytes() == b"WRIT" + data[4:]
    kv.unmount()
    kv.start()
    assert p.read_bytes() == b"WRIT" + data[4:]


@contextlib.contextmanager
def _adopted_writer(kv, name: str, size: int):
    """A file of *size* random bytes, a passthrough reader of it, and a writable open of it,
    which makes it one the kernel writes (`Operations._adopt_writer`): yields (path, data,
    reader fd, writer fd); both are closed after (quietly: the test may have killed kvfs)."""
    p = kv.path / name
    data = os.urandom(size)
    p.write_bytes(data)
    kv.status()  # taken: the next open for reading is a passthrough one
    r = os.open(p, os.O_RDONLY)
    fd = os.open(p, os.O_RDWR)
    try:
        yield p, data, r, fd
    finally:
        for f in (fd, r):
            with contextlib.suppress(OSError):
                os.close(f)


def test_shared_writable_mmap_of_a_file_read_by_passthrough(kv):
    """While a reader holds a passthrough open, a writable open must carry the backing id
    too, and mmap() of it maps the DRAM file: the file becomes one the kernel writes, and
    what the mapping wrote is taken at the close."""
    with _adopted_writer(kv, "mapped", 16384) as (p, data, _r, fd):
        assert kv.status()["passthrough"]["adopted_files"] == 1
        m = mmap.mmap(fd, len(data), flags=mmap.MAP_SHARED)
        m[0:4] = b"MMAP"
        m.flush()
        m.close()
    kv.status()
    assert p.read_bytes() == b"MMAP" + data[4:]
    kv.unmount()  # written back as the take at the close recorded it
    kv.start()
    assert p.read_bytes() == b"MMAP" + data[4:]
    assert kv.status()["reads"]["checksum_errors"] == 0


def test_writer_of_a_file_read_by_passthrough_fsyncs_durably(kv):
    """An fsync through an adopted writer makes everything durable, through a crash and the
    loss of DRAM."""
    with _adopted_writer(kv, "adopted", 200_000) as (p, data, r, fd):
        assert os.pwrite(fd, b"NEW!", 70_000) == 4
        assert os.pread(r, 4, 70_000) == b"NEW!"  # the reader sees it at once
        os.fsync(fd)
        kv.reboot()  # SIGKILL, and DRAM lost
    kv.start()
    assert p.read_bytes() == data[:70_000] + b"NEW!" + data[70_004:]
    assert kv.status()["reads"]["checksum_errors"] == 0


def test_adopted_file_after_a_crash_is_what_its_dram_file_holds(kv):
    with _adopted_writer(kv, "adopted", 150_000) as (p, data, _r, fd):
        assert os.pwrite(fd, b"late", 100_000) == 4  # no fsync: DRAM (tmpfs) outlives us
        kv.kill()
    kv.start()
    assert p.read_bytes() == data[:100_000] + b"late" + data[100_004:]
    kv.unmount()  # written back from what the mount took
    kv.start()
    assert p.read_bytes() == data[:100_000] + b"late" + data[100_004:]
    assert kv.status()["reads"]["checksum_errors"] == 0


def _libc_mmap():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def test_shared_mapping_written_after_the_close(kv):
    """As C programs may: mmap, close, write through the mapping, munmap. The file stays
    one the kernel writes while the mapping lives, and is taken again until it is gone (or
    at unmount)."""
    import ctypes

    libc = _libc_mmap()
    with _adopted_writer(kv, "mapped", 16384) as (p, data, r, fd):
        addr = libc.mmap(None, len(data), mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                         fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
    passthrough = kv.status()["passthrough"]  # (takes every closed file first)
    assert passthrough["writing_files"] == 1  # still mapped: kept
    ctypes.memmove(addr, b"MMAP", 4)
    assert p.read_bytes() == b"MMAP" + data[4:]  # a new open reads the DRAM file
    with open(p, "r+b") as f:  # and a new writer joins it
        f.seek(8)
        f.write(b"more")
    libc.munmap(addr, len(data))
    data = b"MMAP" + data[4:8] + b"more" + data[12:]
    deadline = time.monotonic() + 20  # the next check (every 5 s) finds no mapping left
    while kv.status()["passthrough"]["writing_files"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kv.status()["passthrough"]["writing_files"] == 0
    assert p.read_bytes() == data
    kv.unmount()  # the last take
    kv.start()
    assert p.read_bytes() == data
    assert kv.status()["reads"]["checksum_errors"] == 0


def test_a_mapped_file_unlinked_after_its_close_is_freed(kv):
    import ctypes

    libc = _libc_mmap()
    with _adopted_writer(kv, "mapped", 16384) as (p, data, r, fd):
        addr = libc.mmap(None, len(data), mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                         fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value)
    assert kv.status()["passthrough"]["writing_files"] == 1
    p.unlink()
    ctypes.memmove(addr, b"gone", 4)  # into a file nobody can open any more
    libc.munmap(addr, len(data))
    deadline = time.monotonic() + 10  # (the kernel sends the RELEASE after munmap returns)
    while True:
        st = kv.status()
        if st["passthrough"]["writing_files"] == 0 and st["tiers"]["dram"]["chunks"] == 0:
            break
        assert time.monotonic() < deadline, st["passthrough"]
        time.sleep(0.02)


def test_rename_replace_and_flags(kv):
    a, b = kv.path / "a", kv.path / "b"
    a.write_bytes(b"new")
    b.write_bytes(b"old" * 10000)
    os.replace(a, b)
    assert b.read_bytes() == b"new"
    assert not a.exists()
    os.mkdir(kv.path / "d1")
    os.mkdir(kv.path / "d1" / "sub")
    os.rename(kv.path / "d1", kv.path / "d2")
    assert (kv.path / "d2" / "sub").is_dir()
    assert _err(os.rename, kv.path / "d2", kv.path / "d2" / "sub" / "x") == errno.EINVAL
    (kv.path / "f").write_bytes(b"1")
    assert _err(os.rename, kv.path / "f", kv.path / "d2") == errno.EISDIR
    assert _err(os.rename, kv.path / "d2", kv.path / "f") == errno.ENOTDIR
    assert _err(os.rename, kv.path / "nope", kv.path / "x") == errno.ENOENT


def test_unlink_open_file_stays_readable(kv):
    p = kv.path / "u"
    data = os.urandom(500_000)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDWR)
    os.unlink(p)
    assert not p.exists()
    assert os.pread(fd, len(data), 0) == data
    os.pwrite(fd, b"more", len(data))
    assert os.fstat(fd).st_size == len(data) + 4
    os.close(fd)
    assert kv.status()["files"] == 0
    # The count follows creates, links, unlinks and renames over a file (and a remount).
    for name in ("a", "b", "c"):
        (kv.path / name).write_bytes(b"x")
    os.link(kv.path / "a", kv.path / "a2")
    (kv.path / "d").mkdir()
    os.symlink("a", kv.path / "s")
    assert kv.status()["files"] == 3
    os.unlink(kv.path / "a")
    assert kv.status()["files"] == 3  # a2 still names it
    os.replace(kv.path / "b", kv.path / "c")
    assert kv.status()["files"] == 2
    kv.unmount()
    kv.start()
    assert kv.status()["files"] == 2
    for name in ("a2", "c"):
        os.unlink(kv.path / name)
    assert kv.status()["files"] == 0
    # release() arrives asynchronously after close(); then the data is freed
    for _ in range(100):
        tiers = kv.status()["tiers"]
        if tiers["dram"]["chunks"] == tiers["nvme"]["chunks"] == 0:
            break
        time.sleep(0.05)
    assert tiers["dram"]["chunks"] == tiers["nvme"]["chunks"] == 0


def test_directories(kv):
    deep = kv.path / "a" / "b" / "c" / "d"
    os.makedirs(deep)
    (deep / "f").write_bytes(b"x")
    assert _err(os.rmdir, kv.path / "a" / "b" / "c" / "d") == errno.ENOTEMPTY
    assert _err(os.mkdir, kv.path / "a") == errno.EEXIST
    assert _err(os.rmdir, deep / "f") == errno.ENOTDIR
    assert _err(os.unlink, kv.path / "a") == errno.EISDIR
    os.unlink(deep / "f")
    os.rmdir(deep)
    assert sorted(os.listdir(kv.path / "a" / "b" / "c")) == []
    assert os.stat(kv.path / "a").st_nlink == 3
    assert _err(os.open, str(kv.path / "a" / "x" / "y"), os.O_CREAT | os.O_WRONLY) == \
        errno.ENOENT


def test_big_flat_directory(kv):
    n = 100_000 if os.environ.get("KVFS_BIG_DIR") else 20_000
    d = kv.path / "flat"
    d.mkdir()
    for i in range(n):
        fd = os.open(d / f"blk{i:06d}@x%y.bin", os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)
    names = os.listdir(d)
    assert len(names) == n
    assert len(set(names)) == n
    with os.scandir(d) as it:
        assert sum(1 for e in it if e.is_file()) == n
    for i in range(0, n, 997):
        assert not os.path.exists(d / f"absent{i}")  # negative lookups
        assert os.path.exists(d / f"blk{i:06d}@x%y.bin")


def test_names(kv):
    for name in ["model@1@0@abc@bf16.pt", "a%20b", ".hidden", "x" * 255, "ünïcode"]:
        (kv.path / name).write_bytes(name.encode())
        assert (kv.path / name).read_bytes() == name.encode()
    assert _err(open, kv.path / ("y" * 256), "wb") == errno.ENAMETOOLONG


def test_every_call_that_takes_a_name_past_name_max_is_enametoolong(kv):
    """As on tmpfs and ext4; the kernel itself only stops names past 1024 bytes."""
    long = kv.path / ("n" * 256)
    f, d = kv.path / "f", kv.path / "d"
    f.write_bytes(b"1")
    d.mkdir()
    calls = {
        "open": lambda: open(long, "rb"),
        "create": lambda: open(long, "wb"),
        "creat-excl": lambda: os.open(long, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644),
        "mkdir": lambda: os.mkdir(long),
        "mkfifo": lambda: os.mkfifo(long),
        "rmdir": lambda: os.rmdir(long),
        "unlink": lambda: os.unlink(long),
        "rename-from": lambda: os.rename(long, kv.path / "x"),
        "rename-to": lambda: os.rename(f, long),
        "rename-dir-to": lambda: os.rename(d, long),
        "link-from": lambda: os.link(long, kv.path / "y"),
        "link-to": lambda: os.link(f, long),
        "symlink": lambda: os.symlink("f", long),
        "readlink": lambda: os.readlink(long),
        "chmod": lambda: os.chmod(long, 0o600),
        "chown": lambda: os.chown(long, 1, 1),
        "truncate": lambda: os.truncate(long, 0),
        "stat": lambda: os.stat(long),
        "lstat": lambda: os.lstat(long),
        "utime": lambda: os.utime(long),
        "listdir": lambda: os.listdir(long),
        "statvfs": lambda: os.statvfs(long),
        "below it": lambda: os.stat(long / "x"),
        "setxattr": lambda: os.setxattr(long, "user.a", b"1"),
        "getxattr": lambda: os.getxattr(long, "user.a"),
        "listxattr": lambda: os.listxattr(long),
        "removexattr": lambda: os.removexattr(long, "user.a"),
    }
    got = {what: _err(call) for what, call in calls.items()}
    assert got == {what: errno.ENAMETOOLONG for what in calls}
    assert sorted(os.listdir(kv.path)) == ["d", "f"]
    assert os.statvfs(kv.path).f_namemax == 255


def test_statvfs_and_blocks(kv):
    st = os.statvfs(kv.path)
    assert st.f_bsize == 4096 and st.f_frsize == 4096
    cap = st.f_blocks * st.f_frsize
    assert 32 << 20 < cap <= 64 << 20
    free0 = st.f_bavail
    data = os.urandom(3 << 20)
    (kv.path / "x").write_bytes(data)
    st2 = os.statvfs(kv.path)
    assert (free0 - st2.f_bavail) * 4096 >= 3 << 20
    assert os.stat(kv.path / "x").st_blocks * 512 >= 3 << 20
    small = kv.path / "small"
    small.write_bytes(os.urandom(5000))
    assert os.stat(small).st_blocks * 512 == 8192  # pages, not a whole chunk


def test_buffered_io_fills_whole_requests(kv):
    """stdio and Python buffer by st_blksize; through FUSE each read() is a round trip, so a
    buffered reader of small records (llama.cpp's slot restore) must fill 1 MiB per read()."""
    p = kv.path / "slot.bin"
    data = os.urandom(3 << 20)
    p.write_bytes(data)
    assert os.stat(p).st_blksize == 1 << 20
    with open(p, "rb") as f:
        assert len(f.peek(1)) == 1 << 20  # the buffer's first fill is one whole read()
        got = b"".join(iter(lambda: f.read(4062), b""))
    assert got == data
    assert os.statvfs(kv.path).f_bsize == 4096  # O_DIRECT alignment stays the block's


def test_fsync_file_and_dir(kv):
    p = kv.path / "s"
    with open(p, "wb") as f:
        f.write(os.urandom(200_000))
        f.flush()
        os.fsync(f.fileno())
        os.fdatasync(f.fileno())
    fd = os.open(kv.path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(fd)
    os.close(fd)
    assert "nvme" in kv.tiers("s")


def test_attributes_links_xattrs(kv):
    p = kv.path / "f"
    p.write_bytes(b"data")
    os.chmod(p, 0o640)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o640
    os.chown(p, 1234, 5678)
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (1234, 5678)
    os.utime(p, ns=(1_000_000_000, 2_000_000_000))
    assert os.stat(p).st_mtime_ns == 2_000_000_000
    os.symlink("f", kv.path / "l")
    assert os.readlink(kv.path / "l") == "f"
    assert (kv.path / "l").read_bytes() == b"data"
    os.link(p, kv.path / "h")
    assert os.stat(p).st_nlink == 2
    os.unlink(p)
    assert (kv.path / "h").read_bytes() == b"data"
    h = kv.path / "h"
    os.setxattr(h, "user.model", b"llama")
    assert os.getxattr(h, "user.model") == b"llama"
    assert "user.model" in os.listxattr(h)
    os.removexattr(h, "user.model")
    assert _err(os.getxattr, h, "user.model") == errno.ENODATA
    assert _err(os.removexattr, h, "user.model") == errno.ENODATA
    # names outside user., trusted. and security. are EOPNOTSUPP, as on tmpfs
    assert _err(os.setxattr, h, "bogus.model", b"x") == errno.EOPNOTSUPP
    assert _err(os.getxattr, h, "bogus.model") == errno.EOPNOTSUPP
    assert _err(os.removexattr, h, "bogus.model") == errno.EOPNOTSUPP
    os.setxattr(h, "trusted.model", b"t")
    assert os.getxattr(h, "trusted.model") == b"t"


def test_concurrent_pwrite_pread_one_file(kv):
    p = str(kv.path / "shared")
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.ftruncate(fd, 1 << 40)
    page = 40 << 10
    blobs = {i: os.urandom(page) for i in range(64)}

    def writer(ids):
        for i in ids:
            os.pwrite(fd, blobs[i], i * 7_777_777)

    threads = [threading.Thread(target=writer, args=(range(j, 64, 8),)) for j in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = []

    def reader(ids):
        for i in ids:
            if os.pread(fd, page, i * 7_777_777) != blobs[i]:
                errors.append(i)

    threads = [threading.Thread(target=reader, args=(range(j, 64, 8),)) for j in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)
    assert errors == []


def test_fallocate_mode0(kv):
    p = str(kv.path / "falloc")
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.posix_fallocate(fd, 0, 3 << 20)
    assert os.fstat(fd).st_size == 3 << 20
    assert os.pread(fd, 100, 1 << 20) == bytes(100)
    os.pwrite(fd, b"k" * 4096, 2 << 20)
    assert os.pread(fd, 4096, 2 << 20) == b"k" * 4096
    with pytest.raises(OSError) as ei:
        os.posix_fallocate(fd, 0, 1 << 40)  # more than the tier holds
    assert ei.value.errno == errno.ENOSPC
    assert os.fstat(fd).st_size == 3 << 20
    os.close(fd)


def test_fallocate_reserves_space(kv):
    st0 = os.statvfs(kv.path)
    fd = os.open(kv.path / "reserved", os.O_CREAT | os.O_RDWR, 0o644)
    os.posix_fallocate(fd, 0, 16 << 20)
    assert os.fstat(fd).st_blocks * 512 >= 16 << 20
    st1 = os.statvfs(kv.path)
    assert (st0.f_bavail - st1.f_bavail) * st1.f_frsize >= 16 << 20
    filled = 0
    with pytest.raises(OSError) as ei:  # fill everything else
        for i in range(1000):
            (kv.path / f"fill{i}").write_bytes(os.urandom(1 << 20))
            filled += 1
    assert ei.value.errno == errno.ENOSPC
    blob = os.urandom(8 << 20)
    os.pwrite(fd, blob, 4 << 20)  # inside the reservation: must not fail
    assert os.pread(fd, 8 << 20, 4 << 20) == blob
    os.close(fd)
    os.unlink(kv.path / "reserved")
    time.sleep(0.5)
    (kv.path / "after").write_bytes(os.urandom(4 << 20))  # the reservation is returned


FALLOC_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _punch(fd: int, off: int, length: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_PUNCH, off, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@pytest.mark.parametrize("tier", ["dram", "nvme"])
def test_punched_holes_read_as_zeros_as_on_tmpfs(kv, tier, tmp_path):
    """fallocate(PUNCH_HOLE) frees and zeroes a range and keeps the size (Dynamo-style block
    files free space so): whole chunks go, the chunks it cuts into are zeroed there; the
    same punches on tmpfs give the same bytes, through a remount, a crash and fsck."""
    data = os.urandom(5 * 65536 + 1234)
    ref = Path(tempfile.mkdtemp(dir="/dev/shm")) / "ref"
    try:
        ref.write_bytes(data)
        (kv.path / "f").write_bytes(data)
        if tier == "nvme":
            kv.unmount()
            kv.lose_dram()
            kv.start()
        punches = [(65536, 65536), (3 * 65536 - 100, 300), (10, 20), (4 * 65536, 1 << 20),
                   (6 << 20, 4096)]
        fds = [os.open(p, os.O_RDWR) for p in (ref, kv.path / "f")]
        try:
            for off, n in punches:
                for fd in fds:
                    _punch(fd, off, n)
            os.fsync(fds[1])
            assert os.fstat(fds[1]).st_size == len(data)
            assert os.fstat(fds[1]).st_blocks < os.fstat(fds[0]).st_blocks + 64
        finally:
            for fd in fds:
                os.close(fd)
        want = ref.read_bytes()
        assert (kv.path / "f").read_bytes() == want
        kv.kill()
        kv.lose_dram()  # fsynced: the holes survive the loss of DRAM
        kv.start()
        assert (kv.path / "f").read_bytes() == want
        kv.unmount()
        r = kv.fsck()
        assert r.returncode == 0, r.stdout
    finally:
        shutil.rmtree(ref.parent)


# -- FUSE passthrough: reads served by the kernel straight from a file's DRAM file ----------
def _pt_opens(m) -> int:
    return m.status()["passthrough"]["opens"]


def test_reads_of_a_dram_resident_file_bypass_the_daemon(kv):
    data = os.urandom(200_000)
    (kv.path / "r").write_bytes(data)
    before = kv.status()
    with open(kv.path / "r", "rb") as f:
        assert kv.status()["passthrough"]["open_files"] == 1
        assert f.read() == data
        f.seek(70_000)
        assert f.read(1000) == data[70_000:71_000]
        m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert m[:] == data
        m.close()
    after = kv.status()
    assert after["passthrough"]["opens"] == before["passthrough"]["opens"] + 1
    assert after["passthrough"]["open_files"] == 0
    assert (after["reads"]["chunks_from_dram"] - before["reads"]["chunks_from_dram"]
            == after["passthrough"]["chunks"] - before["passthrough"]["chunks"] == 4)


def test_other_opens_of_a_file_in_passthrough_mode(kv):
    """While a reader holds a file in passthrough mode, every other open of it must still
    work (the kernel insists on one backing file per inode): more readers, a writer whose
    bytes the reader sees at once, an O_DIRECT reader (served from the DRAM file too, so
    unaligned reads are not refused), truncation and growth."""
    p = kv.path / "shared"
    data = bytearray(os.urandom(150_000))
    p.write_bytes(data)
    reader = os.open(p, os.O_RDONLY)
    try:
        second = os.open(p, os.O_RDONLY)
        assert os.pread(second, 10, 0) == data[:10]
        os.close(second)
        writer = os.open(p, os.O_RDWR)
        os.pwrite(writer, b"NEW", 100_000)
        data[100_000:100_003] = b"NEW"
        assert os.pread(reader, 10, 99_998) == bytes(data[99_998:100_008])
        os.pwrite(writer, b"tail", len(data))  # grows the file
        data += b"tail"
        assert os.pread(reader, 100, len(data) - 4) == b"tail"
        os.ftruncate(writer, 1000)
        assert os.pread(reader, 2000, 0) == bytes(data[:1000])
        os.ftruncate(writer, 5000)  # grows with a hole
        assert os.pread(reader, 6000, 0) == bytes(data[:1000]) + bytes(4000)
        os.close(writer)
        direct = os.open(p, os.O_RDONLY | os.O_DIRECT)
        assert os.pread(direct, 100, 3) == bytes(data[3:103])
        os.close(direct)
    finally:
        os.close(reader)
    assert p.read_bytes() == bytes(data[:1000]) + bytes(4000)


def test_o_direct_opens_of_dram_resident_files_skip_the_daemon(kv):
    """O_DIRECT, as vLLM's fs tier and LMCache use it: a new file's O_DIRECT writer (in a
    directory whose files' size is known) is written by the kernel into the DRAM file, and
    an O_DIRECT reader of a file wholly in DRAM reads it by passthrough. tmpfs does not
    refuse unaligned O_DIRECT, so there unaligned reads succeed, with the right bytes. Where
    the requests reach the daemon, ext4's EINVAL holds: an O_RDWR O_DIRECT open of the same
    file (and read-through files: tests/store/test_chunkstore.py)."""
    d = kv.path / "od"
    d.mkdir()
    _teach(kv, d, 128 << 10)
    buf = mmap.mmap(-1, 128 << 10)
    data = os.urandom(128 << 10)
    buf[:] = data
    writes = _stream_opens(kv)
    fd = os.open(d / "blk", os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT,
                 0o644)
    try:
        assert os.write(fd, buf) == len(data)
    finally:
        os.close(fd)
    assert _stream_opens(kv) == writes + 1
    reads = _pt_opens(kv)
    buf[:] = bytes(len(buf))
    fd = os.open(d / "blk", os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [buf], 0) == len(data) and buf[:] == data
        assert os.pread(fd, 100, 3) == data[3:103]
    finally:
        os.close(fd)
    assert _pt_opens(kv) > reads
    fd = os.open(d / "blk", os.O_RDWR | os.O_DIRECT)
    try:
        assert _err(os.pread, fd, 100, 3) == errno.EINVAL
        assert _err(os.pwrite, fd, b"x", 1) == errno.EINVAL
        assert os.preadv(fd, [buf], 0) == len(data) and buf[:] == data
    finally:
        os.close(fd)
    assert (d / "blk").read_bytes() == data


def test_passthrough_only_for_files_wholly_in_dram(kv):
    """A reader of a file with chunks on NVMe has them staged in DRAM before its open
    returns (counted as NVMe reads), then reads from DRAM, an O_DIRECT reader's too; a
    writer's open is served by the daemon; so is everything with passthrough off."""
    files = {f"n{i}": os.urandom(256 << 10) for i in range(40)}  # 10 MiB through 4 MiB
    for name, data in files.items():
        (kv.path / name).write_bytes(data)
    on_nvme = [n for n in files if kv.tiers(n) == {"nvme"}]
    assert on_nvme
    # Staging evicts nothing, and the demoter stops at its watermarks: make room by removing
    # the files that are in DRAM.
    for name in [n for n in files if n not in on_nvme]:
        os.unlink(kv.path / name)
        del files[name]
    deadline = time.monotonic() + 10
    while (d := kv.status()["tiers"]["dram"])["used_bytes"] > 0.5 * d["capacity_bytes"]:
        assert time.monotonic() < deadline, d
        time.sleep(0.05)
    before = kv.status()
    with open(kv.path / on_nvme[0], "rb") as f:
        assert "dram" in kv.tiers(on_nvme[0])
        assert f.read() == files[on_nvme[0]]
    after = kv.status()
    assert after["passthrough"]["opens"] == before["passthrough"]["opens"] + 1
    assert after["reads"]["chunks_from_nvme"] >= before["reads"]["chunks_from_nvme"] + 4
    opens = _pt_opens(kv)
    with open(kv.path / on_nvme[1], "r+b") as f:
        assert f.read(10) == files[on_nvme[1]][:10]
    assert _pt_opens(kv) == opens
    fd = os.open(kv.path / on_nvme[2], os.O_RDONLY | os.O_DIRECT)
    os.close(fd)
    assert _pt_opens(kv) == opens + 1
    kv.unmount()
    kv.start(passthrough="0")
    for name, data in files.items():
        assert (kv.path / name).read_bytes() == data
    assert _pt_opens(kv) == 0


def test_dram_verify_ingest_reads_every_byte_back(kv):
    """-o dram_verify=ingest: DRAM copies are checked on their way in, not at each open;
    files written, demoted, staged back by their opens and read after a SIGKILL come back
    byte for byte."""
    kv.unmount()
    kv.start(dram_verify="ingest")
    files = {f"g{i}": os.urandom(256 << 10) for i in range(30)}  # 7.5 MiB through 4 MiB
    for name, data in files.items():
        (kv.path / name).write_bytes(data)
    assert any(kv.tiers(n) == {"nvme"} for n in files)
    for _ in range(2):
        for name, data in files.items():
            assert (kv.path / name).read_bytes() == data, name
    assert _pt_opens(kv) > 0
    kv.kill()
    kv.start(dram_verify="ingest")
    for name, data in files.items():
        assert (kv.path / name).read_bytes() == data, name


def test_a_file_in_passthrough_mode_keeps_its_dram_copies(kv):
    """Demotion passes over a file the kernel is reading from its DRAM file."""
    data = os.urandom(300_000)
    (kv.path / "held").write_bytes(data)
    with open(kv.path / "held", "rb") as f:
        for i in range(40):  # 10 MiB of new writes through a 4 MiB tier
            (kv.path / f"w{i}").write_bytes(os.urandom(256 << 10))
        assert kv.tiers("held") == {"dram"}
        assert f.read() == data
    assert kv.status()["passthrough"]["open_files"] == 0
    assert (kv.path / "held").read_bytes() == data


# -- opens answered by the front thread (kvfs._fuseshim), without the trio thread ---------
def _fast(m) -> tuple[int, int]:
    pt = m.status()["passthrough"]
    return pt["fast_opens"], pt["fast_open_files"]


def test_reopens_of_a_resident_file_are_answered_by_the_front_thread(mount_factory):
    """The first passthrough open of a file finds it ready (checked, all in DRAM); later
    read-only opens are answered by the front thread, count as opens and DRAM reads all
    the same, and hold the file's DRAM copies while open, O_DIRECT ones too. Writers and
    O_TRUNC opens still go to the daemon. With -o nofast_open, none is answered there."""
    m = mount_factory()
    # Files the kernel wrote straight into DRAM are offered once taken: their first open
    # for reading is answered by the front thread too (while DRAM has room: nothing is
    # demoted, so none leaves the table before it is read).
    (m.path / "s").mkdir()
    blobs = [os.urandom(100_000) for _ in range(12)]
    for i, blob in enumerate(blobs):
        (m.path / "s" / str(i)).write_bytes(blob)
    time.sleep(0.5)  # the takes run when the daemon is idle
    for i, blob in enumerate(blobs):
        assert (m.path / "s" / str(i)).read_bytes() == blob
    assert _fast(m)[0] >= 8
    data = os.urandom(200_000)
    (m.path / "r").write_bytes(data)
    assert (m.path / "r").read_bytes() == data
    fast, files = _fast(m)
    assert files >= 1
    before = m.status()
    for _ in range(5):
        assert (m.path / "r").read_bytes() == data
    after = m.status()
    assert _fast(m) == (fast + 5, files)
    assert after["passthrough"]["opens"] == before["passthrough"]["opens"] + 5
    assert after["reads"]["chunks_from_dram"] == before["reads"]["chunks_from_dram"] + 20
    with open(m.path / "r", "rb") as f:
        assert m.status()["passthrough"]["open_files"] == 1
        for i in range(40):  # 10 MiB of new writes through a 4 MiB tier
            (m.path / f"w{i}").write_bytes(os.urandom(256 << 10))
        assert m.tiers("r") == {"dram"}
        assert f.read() == data
    fast += 6
    assert _fast(m)[0] == fast
    r = subprocess.run([sys.executable, "-m", "kvfs.cli.ctl", "status", str(m.path)],
                       capture_output=True, text=True)
    assert f"{fast} of them answered by the front thread" in r.stdout, r.stdout + r.stderr
    fd = os.open(m.path / "r", os.O_RDONLY | os.O_DIRECT)
    os.close(fd)
    fast += 1
    with open(m.path / "r", "r+b") as f:
        assert f.read(10) == data[:10]
    assert _fast(m)[0] == fast
    m.unmount()
    m.start(fast_open="0")
    for _ in range(3):
        assert (m.path / "r").read_bytes() == data
    assert _fast(m) == (0, 0)
    m.unmount()
    m.start(dram_verify="open")  # every open checks the file again: none skips the daemon
    for _ in range(3):
        assert (m.path / "r").read_bytes() == data
    assert _fast(m) == (0, 0)


def test_the_front_threads_table_keeps_the_files_opened_last(mount_factory):
    """The table is bounded (-o fast_open_files): a file found ready when it is full takes
    the place of the one opened least recently, instead of never getting in."""
    m = mount_factory(fast_open_files="3")
    blobs = {f"f{i}": os.urandom(50_000) for i in range(6)}
    for name, blob in blobs.items():
        (m.path / name).write_bytes(blob)
    time.sleep(0.5)  # taken (and offered) while the daemon is idle
    for name, blob in blobs.items():
        assert (m.path / name).read_bytes() == blob
    fast, files = _fast(m)
    assert files == 3
    # f3..f5 were offered last: their opens are answered there, and f3, opened again,
    # becomes the most recent, so f0's offer pushes out f4, the least recently opened.
    for name in ("f5", "f3"):
        assert (m.path / name).read_bytes() == blobs[name]
    assert _fast(m) == (fast + 2, 3)
    assert (m.path / "f0").read_bytes() == blobs["f0"]  # the daemon's open: offered again
    assert _fast(m) == (fast + 2, 3)
    for name in ("f0", "f3", "f5"):
        assert (m.path / name).read_bytes() == blobs[name]
    assert _fast(m) == (fast + 5, 3)
    assert (m.path / "f4").read_bytes() == blobs["f4"]  # out of the table: the daemon's
    assert _fast(m) == (fast + 5, 3)


def test_a_file_changed_after_its_fast_opens_reads_the_new_bytes(mount_factory):
    """Whatever changes a file through the daemon takes it out of the front thread's table
    first: a write, a truncation down or up, an O_TRUNC open, a rename over it, an unlink
    (a file opened there before stays readable to its last close), its DRAM copies
    pushed out to NVMe. Every read after returns the file as it is now."""
    m = mount_factory()
    p = m.path / "f"

    def make_hot(data: bytes) -> None:
        assert p.read_bytes() == data
        assert p.read_bytes() == data  # answered by the front thread
        assert m.status()["passthrough"]["fast_open_files"] >= 1

    data = bytearray(os.urandom(150_000))
    p.write_bytes(data)
    make_hot(bytes(data))
    with open(p, "r+b") as f:
        f.seek(100_000)
        f.write(b"NEW")
    data[100_000:100_003] = b"NEW"
    assert p.read_bytes() == data
    make_hot(bytes(data))
    os.truncate(p, 1000)
    assert p.read_bytes() == data[:1000]
    make_hot(bytes(data[:1000]))
    os.truncate(p, 70_000)
    assert p.read_bytes() == bytes(data[:1000]) + bytes(69_000)
    make_hot(bytes(data[:1000]) + bytes(69_000))
    with open(p, "wb") as f:  # O_TRUNC
        f.write(b"short")
    assert p.read_bytes() == b"short"
    make_hot(b"short")
    new = os.urandom(90_000)
    (m.path / "tmp").write_bytes(new)
    os.replace(m.path / "tmp", p)
    assert p.read_bytes() == new
    make_hot(new)
    held = open(p, "rb")  # a fast open
    os.unlink(p)
    assert not p.exists()
    assert held.read() == new
    held.close()
    assert _err(os.open, p, os.O_RDONLY) == errno.ENOENT
    files = {f"h{i}": os.urandom(256 << 10) for i in range(4)}
    for name, blob in files.items():
        (m.path / name).write_bytes(blob)
        for _ in range(2):
            assert (m.path / name).read_bytes() == blob
    for i in range(40):  # 10 MiB of files read again (reused: they compete) through 4 MiB
        blob = os.urandom(256 << 10)
        (m.path / f"w{i}").write_bytes(blob)
        for _ in range(2):
            assert (m.path / f"w{i}").read_bytes() == blob
    assert any(m.tiers(name) == {"nvme"} for name in files)
    for name, blob in files.items():
        for _ in range(2):
            assert (m.path / name).read_bytes() == blob, name
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0, r.stdout + r.stderr


def test_fast_opens_racing_replacement_and_demotion_read_whole_versions(mount_factory,
                                                                           race):
    """Readers keep opening resident files (most opens answered by the front thread) while
    another thread replaces them with new versions (os.replace) and a third pushes
    everything towards NVMe with new files. Every read is one whole version of its file:
    never a mix, a short read or another file's bytes."""
    m = mount_factory(dram_size="8M")
    names = [f"v{i}" for i in range(6)]
    size = 192 << 10

    def version(name: str, n: int) -> bytes:
        return f"{name}:{n:012d};".encode() * (size // 16)  # 16 bytes repeated

    for name in names:
        (m.path / name).write_bytes(version(name, 0))
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            for name in names:
                try:
                    got = (m.path / name).read_bytes()
                except FileNotFoundError:
                    continue
                reads[0] += 1
                head = got[:16]
                if (len(got) != size or not head.startswith(name.encode() + b":")
                        or got != head * (size // 16)):
                    errors.append(f"{name}: {len(got)} bytes, starts {got[:20]!r}")

    def replacer() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            for name in names:
                tmp = m.path / f".{name}.tmp"
                tmp.write_bytes(version(name, n))
                os.replace(tmp, m.path / name)
            time.sleep(0.01)

    def flooder() -> None:
        i = 0
        while not stop.is_set():
            (m.path / f"flood{i % 64}").write_bytes(os.urandom(256 << 10))
            i += 1

    race((reader, reader, replacer, flooder), 4, stop)
    assert not errors, errors[:5]
    assert reads[0] > 100
    assert _fast(m)[0] > 0
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0, r.stdout + r.stderr


# -- FUSE passthrough writers: new files the kernel writes straight into their DRAM file -----
def _stream_opens(m) -> int:
    return m.status()["passthrough"]["write_opens"]


def _teach(m, directory, size: int) -> None:
    """Close one file of *size* bytes in *directory*: files there are then expected at that
    size (tiering.KernelWritePolicy), and later write-only opens stream."""
    (directory / "first").write_bytes(os.urandom(size))


def test_what_follows_a_close_sees_the_file_before_and_after_its_take(kv):
    """A streamed file is taken after its last close, when the daemon has nothing else to
    do (Operations.run_takes): stat, open, truncate, rename over it and unlink right after
    the close must all see the file as written."""
    d = kv.path / "blocks"
    d.mkdir()
    _teach(kv, d, 100_000)
    files = {}
    for i in range(40):
        data = os.urandom(100_000 + i)
        with open(d / f"b{i}", "wb") as f:
            f.write(data)
        files[f"b{i}"] = data
        assert os.stat(d / f"b{i}").st_size == len(data)
        if i % 5 == 1:
            assert (d / f"b{i}").read_bytes() == data
        elif i % 5 == 2:
            os.truncate(d / f"b{i}", 1000)
            files[f"b{i}"] = data[:1000]
        elif i % 5 == 3:
            os.replace(d / f"b{i - 1}", d / f"b{i}")
            files[f"b{i}"] = files.pop(f"b{i - 1}")
        elif i % 5 == 4:
            os.unlink(d / f"b{i}")
            del files[f"b{i}"]
    assert _stream_opens(kv) >= 30
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name
    (d / "last").write_bytes(b"x" * 5000)  # its take may still wait: unmount takes it
    files["last"] = b"x" * 5000
    kv.unmount()
    kv.start()
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name
    assert sorted(os.listdir(d)) == sorted([*files, "first"])


def test_unlink_or_truncate_while_a_big_file_is_taken(mount_factory):
    """The take of a streamed file over 512 KiB hashes it in worker threads. An unlink or a
    truncate arriving meanwhile (right after the close) must wait for the take or be seen
    by it: the take once brought an unlinked inode back into the metadata with chunks in a
    DRAM file created anew (empty), and undid a truncation."""
    m = mount_factory(dram_size="64M", nvme_size="256M")
    d = m.path / "big"
    d.mkdir()
    _teach(m, d, 2 << 20)
    opens = _stream_opens(m)
    files = {"first": (d / "first").read_bytes()}
    for i in range(16):
        data = os.urandom(2 << 20)
        (d / f"b{i}").write_bytes(data)
        if i % 2:
            os.unlink(d / f"b{i}")
        else:
            os.truncate(d / f"b{i}", 1000 + i)
            files[f"b{i}"] = data[:1000 + i]
            assert os.stat(d / f"b{i}").st_size == 1000 + i
    assert _stream_opens(m) >= opens + 12
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name
    st = m.status()
    stored = st["tiers"]["dram"]["logical_bytes"] + st["tiers"]["nvme"]["logical_bytes"]
    assert stored <= sum(map(len, files.values())) + (64 << 10)
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0, r.stdout + r.stderr
    m.start()
    assert sorted(os.listdir(d)) == sorted(files)
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name


def test_an_open_racing_an_unlink_reads_the_file_or_finds_it_gone(mount_factory):
    """An open of an NVMe-resident file stages it into DRAM first, awaiting the disk. An
    unlink arriving then, or between the reader's lookup and its OPEN, freed the data under
    it: the open succeeded and read an empty file. Now the open either reads every byte (an
    unlink during it leaves the file to the last close) or fails with ENOENT (the unlink
    came first), as on a local filesystem."""
    m = mount_factory(dram_size="64M", nvme_size="256M")
    d = m.path / "f"
    d.mkdir()
    blobs = [os.urandom(2 << 20) for _ in range(16)]
    for i, blob in enumerate(blobs):
        (d / f"b{i}").write_bytes(blob)
    m.unmount()
    m.lose_dram()
    m.start()

    def reader(path, got):
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            got["gone"] = True
            return
        try:
            got["data"] = os.pread(fd, (2 << 20) + 1, 0)
        finally:
            os.close(fd)

    for i, blob in enumerate(blobs):
        got = {}
        t = threading.Thread(target=reader, args=(d / f"b{i}", got))
        t.start()
        time.sleep(0.0002 * (i % 8))
        os.unlink(d / f"b{i}")
        t.join()
        assert got.get("gone") or got["data"] == blob, (i, len(got.get("data", b"")))
    assert not os.listdir(d)


def test_new_files_are_written_straight_into_dram(kv):
    d = kv.path / "blocks"
    d.mkdir()
    _teach(kv, d, 200_000)
    opens = _stream_opens(kv)
    data = os.urandom(200_000)
    fd = os.open(d / "b", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, data[:70_000])
    assert os.stat(d / "b").st_size == 70_000  # the DRAM file's length, as it grows
    reader = os.open(d / "b", os.O_RDONLY)  # every other open joins the DRAM file
    assert os.read(reader, 70_000) == data[:70_000]
    os.write(fd, data[70_000:])
    assert os.pread(reader, 200_000, 0) == data
    os.close(reader)
    os.close(fd)
    assert _stream_opens(kv) == opens + 1
    assert (d / "b").read_bytes() == data
    assert os.stat(d / "b").st_blocks * 512 >= 200_000
    chunks = kv.where("blocks/b")
    assert [c["chunk"] for c in chunks] == [0, 1, 2, 3] and all(c["dirty"] for c in chunks)


def test_what_is_streamed_never_goes_unseen(kv):
    """A directory's first file (with no file closed in the two above it either) and
    read-write opens go through the daemon;
    a file streamed into DRAM is demoted once closed, like any other."""
    d = kv.path / "d"
    d.mkdir()
    opens = _stream_opens(kv)
    (d / "first").write_bytes(os.urandom(100_000))
    with open(d / "rw", "w+b") as f:
        f.write(b"x" * 1000)
    assert _stream_opens(kv) == opens
    files = {f"s{i}": os.urandom(100_000) for i in range(60)}  # 6 MiB through 4 MiB
    for name, data in files.items():
        (d / name).write_bytes(data)
    assert _stream_opens(kv) > opens
    deadline = time.monotonic() + 10
    while not any(kv.tiers(f"d/{n}") == {"nvme"} for n in files):
        assert time.monotonic() < deadline, "nothing streamed was ever demoted"
        time.sleep(0.1)
    for name, data in files.items():
        assert (d / name).read_bytes() == data


def test_a_new_directorys_first_file_streams_at_its_siblings_size(kv):
    """vLLM's fs tier fans blocks out into <model>/<hhh>/<hh>_g0/ directories, nearly each
    block in a new one: a directory with no file closed in it yet takes the size of the
    files of the nearest directory above it (up to two levels) that had some, and its first
    file is written by the kernel; further up, nothing is predicted."""
    model = kv.path / "m_r0"
    (model / "abc" / "de_g0").mkdir(parents=True)
    data = os.urandom(100_000)
    (model / "abc" / "de_g0" / "0.bin").write_bytes(data)
    opens = _stream_opens(kv)
    (model / "abc" / "ff_g0").mkdir()
    (model / "abc" / "ff_g0" / "1.bin").write_bytes(data)  # a sibling directory
    (model / "f01" / "00_g0").mkdir(parents=True)
    (model / "f01" / "00_g0" / "2.bin").write_bytes(data)  # a cousin
    assert _stream_opens(kv) == opens + 2
    (model / "x" / "y" / "z").mkdir(parents=True)
    (model / "x" / "y" / "z" / "3.bin").write_bytes(data)  # three levels below m_r0
    assert _stream_opens(kv) == opens + 2
    for name in ("abc/de_g0/0.bin", "abc/ff_g0/1.bin", "f01/00_g0/2.bin", "x/y/z/3.bin"):
        assert (model / name).read_bytes() == data


def test_a_streamed_file_survives_a_crash_while_open(kv):
    """SIGKILL while the kernel is writing: the remount takes what the DRAM file holds;
    after losing DRAM too, what the last fsync took is what is left."""
    d = kv.path / "c"
    d.mkdir()
    _teach(kv, d, 150_000)
    data = os.urandom(150_000)
    fd = os.open(d / "open", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, data[:100_000])
    os.fsync(fd)
    os.write(fd, data[100_000:])
    kv.kill()
    os.close(fd)
    kv.start()
    assert (d / "open").read_bytes() == data
    assert "was being written when the daemon stopped" in kv.log()
    d = kv.path / "c2"  # a directory this daemon has seen a file closed in
    d.mkdir()
    _teach(kv, d, 150_000)
    opens = _stream_opens(kv)
    fd = os.open(d / "again", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, data[:100_000])
    os.fsync(fd)
    os.write(fd, data[100_000:])
    assert _stream_opens(kv) == opens + 1
    kv.reboot()
    os.close(fd)
    kv.start()
    assert (d / "again").read_bytes() == data[:100_000]


def test_a_streamed_file_unlinked_while_open_frees_its_ram(kv):
    d = kv.path / "u"
    d.mkdir()
    _teach(kv, d, 300_000)
    before = kv.status()["tiers"]["dram"]["used_bytes"]
    fd = os.open(d / "gone", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, os.urandom(300_000))
    os.unlink(d / "gone")
    os.close(fd)
    deadline = time.monotonic() + 10
    while kv.status()["passthrough"]["writing_files"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert kv.status()["tiers"]["dram"]["used_bytes"] == before
    files = os.listdir(kv.dram_dir / "files")
    assert f"{os.stat(kv.path).st_ino:x}" not in files


def test_a_write_drops_file_capabilities(kv):
    """Like a local filesystem, whether the kernel writes the file itself (a new file,
    passthrough) or sends the write to the daemon (O_RDWR)."""
    cap = b"\x01\x00\x00\x02" + bytes(16)
    d = kv.path / "capw"
    d.mkdir()
    (d / "first").write_bytes(b"x" * 8192)  # later files of the directory are streamed
    p = d / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"a" * 4096)
        os.setxattr(p, "security.capability", cap)
        os.write(fd, b"b" * 4096)
        assert _err(os.getxattr, p, "security.capability") == errno.ENODATA
    finally:
        os.close(fd)
    os.setxattr(p, "security.capability", cap)
    fd = os.open(p, os.O_RDWR)
    try:
        os.pwrite(fd, b"c" * 10, 0)  # into a chunk the file has
        assert _err(os.getxattr, p, "security.capability") == errno.ENODATA
        os.setxattr(p, "security.capability", cap)
        os.pwrite(fd, b"d" * 4096, 3 << 20)  # a fresh chunk (copied straight into DRAM)
        assert _err(os.getxattr, p, "security.capability") == errno.ENODATA
    finally:
        os.close(fd)
    data = p.read_bytes()
    assert data[:8192] == b"c" * 10 + b"a" * 4086 + b"b" * 4096
    assert data[3 << 20:] == b"d" * 4096
    os.setxattr(p, "security.capability", cap)  # other xattrs and reads keep it
    os.setxattr(p, "user.x", b"1")
    p.read_bytes()
    assert os.getxattr(p, "security.capability") == cap


def test_security_capability_is_answered_truthfully(kv):
    """The shim answers getxattr("security.capability") itself (the kernel asks before the
    first passthrough write to a file) only while no file has a security.* xattr."""
    p = kv.path / "cap"
    p.write_bytes(b"x")
    assert _err(os.getxattr, p, "security.capability") == errno.ENODATA
    value = b"\x01\x00\x00\x02" + bytes(16)
    os.setxattr(p, "security.capability", value)
    assert os.getxattr(p, "security.capability") == value
    assert _err(os.getxattr, kv.path / "cap", "security.other") == errno.ENODATA
    kv.unmount()
    kv.start()
    assert os.getxattr(p, "security.capability") == value


# Owners and callers of the set-id tests: none of them root but the first.
_OWNER, _OTHER, _GROUP, _GROUP2 = 2000, 3000, 2000, 2001
_CALLERS = {"root": None, "owner": (_OWNER, _GROUP, [_GROUP, _GROUP2]),
            "in group": (_OTHER, _OTHER, [_GROUP]), "other": (_OTHER, _OTHER, [])}


def _as(caller, fn, cwd) -> int:
    """fn() in directory *cwd* (its ancestors may be closed to others) as *caller* (uid,
    gid, groups; None: root) in a child process: 0, or the errno it failed with."""
    pid = os.fork()
    if pid == 0:
        code = 255
        try:
            os.chdir(cwd)
            if caller is not None:
                os.setgroups(caller[2])
                os.setgid(caller[1])
                os.setuid(caller[0])
            fn()
            code = 0
        except OSError as exc:
            code = exc.errno
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _pwrite(p, data: bytes, off: int) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _ftruncate(p, size: int) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _statx_mode(p) -> int:
    """The mode as the kernel has it cached (statx for the mode alone asks no daemon)."""
    import ctypes

    buf = ctypes.create_string_buffer(256)  # struct statx; stx_mode at offset 28
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.statx(-100, os.fsencode(p), 0, 0x3, buf) == 0, ctypes.get_errno()
    return int.from_bytes(buf.raw[28:30], "little")


_SETID_OPS = {
    "write": lambda p: _pwrite(p, b"z", 0),
    "big write": lambda p: _pwrite(p, os.urandom(1 << 20), 1 << 20),
    "ftruncate": lambda p: _ftruncate(p, 10),
    "truncate": lambda p: os.truncate(p, 20),
    "O_TRUNC": lambda p: os.close(os.open(p, os.O_WRONLY | os.O_TRUNC)),
    "chgrp": lambda p: os.chown(p, -1, _GROUP2),
    "chown -1 -1": lambda p: os.chown(p, -1, -1),
}


def _setid_after(directory: Path) -> dict:
    """What each operation by each caller leaves of the set-id bits of files of each mode."""
    out = {}
    for op, do in _SETID_OPS.items():
        for who, caller in _CALLERS.items():
            for mode in (0o4777, 0o2777, 0o2767, 0o6777, 0o6767):
                p = directory / f"{op}-{who}-{mode:o}"
                p.write_bytes(b"x" * 100)
                os.chown(p, _OWNER, _GROUP)
                os.chmod(p, mode)
                err = _as(caller, functools.partial(do, p.name), directory)
                out[op, who, oct(mode)] = (oct(stat.S_IMODE(os.stat(p).st_mode)),
                                           oct(stat.S_IMODE(_statx_mode(p))), err)
                p.unlink()
    return out


@pytest.mark.parametrize("passthrough", ["1", "0"])
def test_writes_truncations_and_chowns_clear_setid_bits_as_on_tmpfs(mount_factory,
                                                                       passthrough):
    """Whoever writes or truncates (root excepted) and whoever changes the owner or group
    clears set-user-ID, and set-group-ID as the kernel decides (with group execute, or for
    a caller outside the group): a set-uid binary written by someone else on a shared
    mount would otherwise run with its owner's rights wherever it is copied."""
    kv = mount_factory(passthrough=passthrough)
    os.chmod(kv.path, 0o777)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as ref:
        os.chmod(ref, 0o777)
        want = _setid_after(Path(ref))
    assert want["write", "other", "0o6777"] == ("0o777", "0o777", 0)  # (the kernel's rules)
    assert want["chown -1 -1", "other", "0o4777"] == ("0o4777", "0o4777", errno.EPERM)
    assert _setid_after(kv.path) == want


def test_a_write_the_kernel_makes_itself_clears_setid_bits(kv):
    """A new file a writer writes straight into DRAM (passthrough): the kernel's own
    file_remove_privs asks kvfs with a SETATTR that has nothing to set."""
    d = kv.path / "pt"
    d.mkdir()
    os.chmod(d, 0o777)
    p = d / "f"

    def write() -> None:
        Path("first").write_bytes(b"x" * 8192)  # later files of the directory are streamed
        fd = os.open("f", os.O_WRONLY | os.O_CREAT, 0o755)
        try:
            os.fchmod(fd, 0o4755)
            os.write(fd, b"a" * 4096)
            assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o755
        finally:
            os.close(fd)

    assert _as(_CALLERS["other"], write, d) == 0
    assert "dram" in kv.tiers("pt/f")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o755
    os.chown(p, _OWNER, _GROUP)
    os.chmod(p, 0o4777)  # chown(f, -1, -1) is the other such SETATTR: only for the owner
    assert _as(_CALLERS["other"], lambda: os.chown("f", -1, -1), d) == errno.EPERM
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o4777
    assert _as(None, lambda: os.chown("f", -1, -1), d) == 0
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o777


def test_every_chown_moves_ctime(kv):
    """Root's chown and fchown, the owner's chgrp, and chown(f, -1, -1), which changes
    nothing else: each is a SETATTR, and ctime moves with every one."""
    p = kv.path / "owned"
    p.write_bytes(b"x" * 100)
    before = os.stat(p).st_ctime_ns
    for change in (lambda: os.chown(p, _OWNER, _GROUP), lambda: os.chown(p, -1, -1),
                   lambda: _as(_CALLERS["owner"], lambda: os.chown("owned", -1, _GROUP2),
                               kv.path),
                   lambda: _as(_CALLERS["owner"], lambda: os.chown("owned", -1, -1),
                               kv.path)):
        assert not change()
        after = os.stat(p).st_ctime_ns
        assert after > before
        before = after
    with open(p, "rb") as f:
        os.fchown(f.fileno(), 0, 0)
        assert os.fstat(f.fileno()).st_ctime_ns > before
    assert (os.stat(p).st_uid, os.stat(p).st_gid) == (0, 0)


def test_status_shows_the_tier_directories_only_to_root(kv):
    """kvfsctl status: anyone may see how the tiers do, only root (or the daemon's user)
    where they are."""
    settings = kv.status()["settings"]
    assert settings["dram_dir"] == str(kv.dram_dir) and settings["nvme_dir"] == str(kv.nvme_dir)

    def status_of_another_user() -> None:
        st = json.loads(os.getxattr(".", "user.kvfs.status"))
        assert st["settings"] == {"chunk_size": 65536, "cache_mode": False}
        assert str(kv.nvme_dir) not in json.dumps(st) and str(kv.dram_dir) not in json.dumps(st)

    assert _as(_CALLERS["other"], status_of_another_user, kv.path) == 0


def _ram_of(directory) -> int:
    out = 0
    for root, _, names in os.walk(directory):
        for n in names:
            try:
                out += os.lstat(os.path.join(root, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return out


def test_files_the_kernel_writes_at_once_stay_within_the_dram_tier(kv):
    """kvfs sees the bytes of a streamed file only when it is taken, after its close: the
    room each one is expected to take counts as used until then, or many writers at once
    (or a backlog of files waiting for their take) would fill tmpfs past the tier's size.
    Watched from the tmpfs itself, not through the mount."""
    d = kv.path / "burst"
    d.mkdir()
    _teach(kv, d, 512 << 10)
    opens = _stream_opens(kv)
    files = {f"b{i}": os.urandom(512 << 10) for i in range(12)}  # 6 MiB open at once
    fds = {n: os.open(d / n, os.O_CREAT | os.O_WRONLY, 0o644) for n in files}
    promised = kv.status()["tiers"]["dram"]["promised_bytes"]
    assert 0 < promised <= (4 << 20) - (512 << 10)
    peak = 0
    stop = threading.Event()

    def watch():  # the DRAM files only: a freed one waits in trash/ for a worker to unlink it
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _ram_of(kv.dram_dir / "files"))

    def write(name):
        os.write(fds[name], files[name])
        os.close(fds[name])

    watcher = threading.Thread(target=watch)
    writers = [threading.Thread(target=write, args=(n,)) for n in files]
    watcher.start()
    try:
        for t in writers:
            t.start()
        for t in writers:
            t.join()
    finally:
        stop.set()
        watcher.join()
    assert 0 < _stream_opens(kv) - opens < len(files)
    assert peak <= (4 << 20) + (256 << 10), peak
    assert kv.status()["tiers"]["dram"]["promised_bytes"] == 0  # all taken
    for name, data in files.items():
        assert (d / name).read_bytes() == data, name


def _same_files(ref: Path, other: Path) -> None:
    assert sorted(os.listdir(other)) == sorted(os.listdir(ref))
    for name in os.listdir(ref):
        assert (other / name).read_bytes() == (ref / name).read_bytes(), name


def _random_ops(roots: tuple[Path, Path], rng: random.Random, steps: int,
                crashes: Mount | None = None, crash_rate: float = 0.02) -> None:
    """*steps* random file operations done the same way under both *roots*; each one's
    result (bytes read, count written, errno) must agree. With *crashes* (the mount at
    roots[1]), its daemon is SIGKILLed before a step with probability *crash_rate*, with
    readers held open, and remounted: every file must still be as on roots[0]."""
    names = [f"f{i}" for i in range(5)]
    held: dict[Path, list[int]] = {root: [] for root in roots}

    def run(root: Path, op: str, name: str, off: int, data: bytes, other: str):
        p = root / name
        if op == "write":
            fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                return os.pwrite(fd, data, off)
            finally:
                os.close(fd)
        if op == "append":
            fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
            try:
                return os.write(fd, data[:5000])
            finally:
                os.close(fd)
        if op == "truncate":
            return os.truncate(p, off % (2 << 20))
        if op == "read":
            with open(p, "rb") as f:
                f.seek(off % (3 << 20))
                return f.read(len(data))
        if op == "mmap":
            with open(p, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if not size:
                    return b""
                with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ) as m:
                    return m[off % size:off % size + len(data)]
        if op == "hold":  # a reader kept open: a passthrough one while the file is in DRAM
            held[root].append(os.open(p, os.O_RDONLY))
            return None
        if op == "let go":
            while held[root]:
                os.close(held[root].pop())
            return None
        if op == "rename":
            return os.replace(p, root / other)
        if op == "unlink":
            return os.unlink(p)
        fd = os.open(p, os.O_RDONLY)  # fsync
        try:
            return os.fsync(fd)
        finally:
            os.close(fd)

    ops = ["write"] * 4 + ["append", "truncate", "read", "read", "mmap", "hold", "let go",
                           "rename", "unlink", "fsync"]
    try:
        for step in range(steps):
            if crashes is not None and rng.random() < crash_rate:
                crashes.kill()
                for root in roots:
                    while held[root]:
                        with contextlib.suppress(OSError):  # (the daemon is gone)
                            os.close(held[root].pop())
                crashes.start()
                _same_files(*roots)
            op, name, other = rng.choice(ops), rng.choice(names), rng.choice(names)
            off = rng.choice([0, rng.randrange(1 << 20), (64 << 10) - 3, rng.randrange(64 << 20)])
            data = rng.randbytes(rng.choice([1, 4096, 65536, rng.randrange(1, 300_000),
                                             1 << 20]))
            got = []
            for root in roots:
                try:
                    got.append(("ok", run(root, op, name, off, data, other)))
                except OSError as exc:
                    got.append(("errno", exc.errno))
            assert got[0] == got[1], (step, op, name, off, len(data))
    finally:
        for fds in held.values():
            for fd in fds:
                os.close(fd)


def test_random_operations_agree_with_tmpfs(kv):
    """Writes (sparse ones too), appends, truncations, reads and mmap reads, renames,
    unlinks, fsyncs and readers held open (passthrough ones, which make a writer of their
    file one the kernel writes): every result agrees with tmpfs doing the same, through
    demotion to NVMe and back, and after a remount from NVMe alone."""
    ref = Path(tempfile.mkdtemp(prefix="kvfs-reference-", dir="/dev/shm"))
    try:
        for seed in (1, 2):
            _random_ops((ref, kv.path), random.Random(seed), 300)
        assert kv.status()["moves"]["demotions"] > 0
        kv.unmount()
        kv.lose_dram()  # (written back by the unmount): every read is from NVMe, promoted
        kv.start()
        _same_files(ref, kv.path)
        status = kv.status()
        assert status["moves"]["promotions"] > 0 and status["reads"]["checksum_errors"] == 0
    finally:
        shutil.rmtree(ref, ignore_errors=True)


def test_writes_go_on_when_dram_is_full_of_files_read_by_passthrough(mount_factory):
    """Files read in passthrough mode are pinned in DRAM, and writers the kernel adopts grow
    them there: with a 1 MiB tier this sequence (found by the model test) fills DRAM with
    chunks nothing may evict. A write waiting for room waited for good (tmpfs takes it),
    then, with one deadline, 60 s and ENOSPC. Now, once the demoter finds nothing to take,
    such writes go over the tier's size. (Whether DRAM fills up depends on how fast the
    demoter runs, so the test asks only that every step agrees with tmpfs: none hangs and none
    gets ENOSPC.)"""
    kv = mount_factory(dram_size="1M")
    ref = Path(tempfile.mkdtemp(prefix="kvfs-reference-", dir="/dev/shm"))
    try:
        _random_ops((ref, kv.path), random.Random(10), 300, crashes=kv, crash_rate=0.03)
    finally:
        shutil.rmtree(ref, ignore_errors=True)


def test_random_operations_survive_crashes(kv):
    """The same random operations with SIGKILLs of the daemon between them (readers held
    open meanwhile): after each remount every file is as tmpfs has it (every completed
    operation survives, README Guarantees 3), and the comparison goes on."""
    ref = Path(tempfile.mkdtemp(prefix="kvfs-reference-", dir="/dev/shm"))
    try:
        _random_ops((ref, kv.path), random.Random(3), 250, crashes=kv)
        assert any("nvme" in kv.tiers(name) for name in os.listdir(kv.path))
        assert kv.status()["reads"]["checksum_errors"] == 0
        kv.kill()
        kv.start()
        _same_files(ref, kv.path)
    finally:
        shutil.rmtree(ref, ignore_errors=True)


def test_an_unlinked_small_file_frees_its_dram_file_at_once(kv):
    """A small file's DRAM file is unlinked on the spot, not renamed into the trash for a
    worker (the rename waits for the worker's unlinks there: ~40 us of every unlink of a
    small file in a storm); a big one still goes to the worker."""
    small, big = kv.path / "small", kv.path / "big"
    small.write_bytes(os.urandom(4096))  # (FREE_AT_ONCE: 64 KiB)
    big.write_bytes(os.urandom(1 << 20))
    ino = os.stat(small).st_ino
    freed = kv.status()["tiers"]["dram"]["files_freed_at_once"]
    small.unlink()
    big.unlink()
    deadline = time.monotonic() + 10  # the inode goes at the kernel's FORGET
    while (kv.status()["tiers"]["dram"]["files_freed_at_once"] == freed
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert kv.status()["tiers"]["dram"]["files_freed_at_once"] == freed + 1
    assert not (kv.dram_dir / "files" / f"{ino:x}").exists()
