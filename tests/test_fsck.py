"""fsck.kvfs on stores damaged in the ways a crash or a bug could leave them."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import time

import pytest

from kvfs.store.location import LOC
from kvfs.store.meta import MetaStore, key2

CHUNK = 64 << 10


def _write_durably(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _damage(m, ino: int, change) -> None:
    """Run *change(txn, chunks db)* on the unmounted store's lmdb."""
    meta = MetaStore(str(m.nvme_dir / "meta"))
    try:
        with meta.env.begin(write=True) as txn:
            change(txn, meta.db["chunks"])
    finally:
        meta.close()


def test_a_file_missing_chunks_below_its_size_is_found(kv):
    """The state a crash mid-truncation used to leave: the old size, no chunks (reads gave
    zeros and fsck called the store clean)."""
    _write_durably(kv.path / "dense", os.urandom(3 * CHUNK))
    sparse = kv.path / "sparse"
    _write_durably(sparse, os.urandom(CHUNK))
    os.truncate(sparse, 3 * CHUNK)  # a hole: chunks 1-2 missing is right
    ino = os.stat(kv.path / "dense").st_ino
    kv.unmount()
    r = kv.fsck()
    assert r.returncode == 0 and " 0 errors" in r.stdout, r.stdout
    _damage(kv, ino, lambda txn, db: txn.delete(key2(ino, 1), db=db))
    r = kv.fsck()
    assert r.returncode == 4, r.stdout
    assert f"inode {ino} ({3 * CHUNK} bytes): 1 chunk(s) below its size missing" in r.stdout
    assert "1 errors" in r.stdout  # the sparse file is fine


@pytest.mark.parametrize("where", ["past the end", "long last chunk"])
def test_bytes_past_a_files_end_are_found(kv, where):
    """A chunk holding bytes past the file's size would show them if the file grew again."""
    _write_durably(kv.path / "f", os.urandom(2 * CHUNK))
    ino = os.stat(kv.path / "f").st_ino
    os.truncate(kv.path / "f", CHUNK + 100 if where == "long last chunk" else CHUNK)
    kv.unmount()
    assert kv.fsck().returncode == 0

    def change(txn, db):
        if where == "past the end":  # chunk 0 copied to chunk 5
            txn.put(key2(ino, 5), txn.get(key2(ino, 0), db=db), db=db)
        else:  # chunk 1 claims all of its bytes again
            loc = list(LOC.unpack(txn.get(key2(ino, 1), db=db)))
            loc[4] = CHUNK
            txn.put(key2(ino, 1), LOC.pack(*loc), db=db)

    _damage(kv, ino, change)
    r = kv.fsck()
    assert r.returncode == 4, r.stdout
    assert ("chunk(s) past its end" if where == "past the end"
            else "chunk 1 holds 65436 bytes past its end") in r.stdout


def test_a_file_unlinked_before_a_crash_is_no_finding(kv):
    """An unlinked file the kernel still knows keeps its inode (nlink 0) with its last size
    until the kernel forgets it, its chunks freed already. A crash then leaves it so; the
    next mount drops it. fsck must not call its size and chunks disagreeing (it did: 2 of 60
    cycles of tools/crashloop.py)."""
    _write_durably(kv.path / "gone", os.urandom(3 * CHUNK))
    kv.unmount()
    kv.start(crash_at="freed")
    with contextlib.suppress(OSError):
        os.unlink(kv.path / "gone")  # the daemon kills itself once the chunks are freed
    pid = kv.pid()
    for _ in range(500):  # the daemon killed itself; wait until it is gone
        if pid is None or not os.path.exists(f"/proc/{pid}"):
            break
        time.sleep(0.01)
    subprocess.run(["fusermount3", "-u", "-z", str(kv.path)], capture_output=True)
    assert "crash point freed reached" in kv.log()
    r = kv.fsck()
    assert r.returncode == 0 and " 0 errors" in r.stdout, r.stdout
    kv.start()
    assert os.listdir(kv.path) == []


def _tree(root) -> dict[str, tuple]:
    """Every file and directory under *root*: path -> (mode, size, sha of its bytes)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.stat(p)
            digest = None
            if name in files:
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_size, digest)
    return out


def _demote(path) -> None:
    os.setxattr(path, "user.kvfs.demote", b"1")  # (kvfsctl demote): records on NVMe now


def test_rebuild_brings_back_every_file_that_reached_nvme(kv):
    """The lmdb files deleted: `fsck.kvfs --rebuild` makes the metadata again from the
    records alone, every file back byte-identical under its name, with its mode; overwritten,
    truncated and re-grown files show their newest bytes, not stale records'. (Attributes
    changed after a file's last write-back come back as they were then: FORMAT.md.)"""
    p = kv.path
    (p / "d1" / "d2").mkdir(parents=True)
    (p / "old").mkdir()
    _write_durably(p / "d1" / "d2" / "a", os.urandom(3 * CHUNK + 5))
    _write_durably(p / "d1" / "b", os.urandom(CHUNK + CHUNK // 2))
    _write_durably(p / "c", b"small")
    (p / "tmp").write_bytes(os.urandom(2 * CHUNK))  # (no fsync: in DRAM only)
    os.rename(p / "tmp", p / "d1" / "d2" / "renamed")  # (before it reached NVMe)
    _write_durably(p / "old" / "x", os.urandom(CHUNK))
    _write_durably(p / "over", os.urandom(2 * CHUNK))
    _write_durably(p / "trunc", os.urandom(3 * CHUNK))
    _write_durably(p / "holey", os.urandom(3 * CHUNK))
    (p / "gone").write_bytes(os.urandom(CHUNK))
    for name in ("over", "trunc", "holey", "old/x"):
        _demote(p / name)
    # Changed after their records reached NVMe: the stale records must not come back.
    _write_durably(p / "over", os.urandom(2 * CHUNK))
    os.truncate(p / "trunc", CHUNK + 100)
    os.truncate(p / "holey", CHUNK // 2)
    os.truncate(p / "holey", 3 * CHUNK)  # chunks 1-2 are a hole now: zeros
    os.unlink(p / "gone")
    os.rename(p / "old", p / "new")  # a directory renamed before its file's next write-back
    _write_durably(p / "new" / "x", os.urandom(CHUNK))
    (p / "empty").touch()  # no record: it cannot come back (FORMAT.md)
    (p / "d1" / "b2").write_bytes(b"x")  # (no fsync: not written back yet)
    os.chmod(p / "d1" / "b2", 0o640)
    os.utime(p / "d1" / "b2", ns=(1_000_000_000, 1_234_567_890_123))
    _demote(p / "d1" / "b2")  # its one write-back is after the utime
    expected = _tree(p)
    kv.unmount()  # (writes back every dirty chunk)
    for name in os.listdir(kv.nvme_dir / "meta"):
        os.unlink(kv.nvme_dir / "meta" / name)
    r = subprocess.run([sys.executable, "-m", "kvfs.cli.fsck", "--rebuild", str(kv.nvme_dir)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 lost" in r.stdout and "0 in /lost+found" in r.stdout, r.stdout
    r = kv.fsck()
    assert r.returncode == 0 and " 0 errors" in r.stdout, r.stdout
    kv.start()
    got = _tree(p)
    del expected["empty"]
    assert got == expected
    assert not (p / "gone").exists()
    st = os.stat(p / "d1" / "b2")
    assert (st.st_mtime_ns, st.st_mode & 0o777) == (1_234_567_890_123, 0o640)
    with open(p / "holey", "rb") as f:
        assert f.read()[CHUNK // 2:] == bytes(3 * CHUNK - CHUNK // 2)
    # The rebuilt store takes new files and keeps them across a remount.
    _write_durably(p / "d1" / "after", b"new")
    kv.unmount()
    kv.start()
    assert (p / "d1" / "after").read_bytes() == b"new"
    assert _tree(p)["d1/d2/a"] == expected["d1/d2/a"]


def test_rebuild_finds_files_where_renames_put_them(kv):
    """The engines' pattern (write a temporary file, fsync, rename it into place, also over
    an older version) and a directory renamed after its files reached NVMe, then a crash
    that loses DRAM and lmdb: a rebuild finds every file under its name now, with its
    newest bytes; the replaced version goes to lost+found (kvfs/store/describe.py)."""
    p = kv.path
    (p / "blocks").mkdir()
    old = os.urandom(CHUNK)
    _write_durably(p / "blocks" / "k1", old)
    _write_durably(p / "blocks" / "k1.tmp", os.urandom(2 * CHUNK + 7))
    os.rename(p / "blocks" / "k1.tmp", p / "blocks" / "k1")
    _write_durably(p / "blocks" / "k2.tmp", os.urandom(CHUNK // 2))
    os.rename(p / "blocks" / "k2.tmp", p / "blocks" / "k2")
    (p / "staging" / "sub").mkdir(parents=True)
    _write_durably(p / "staging" / "sub" / "k3", os.urandom(CHUNK))
    os.rename(p / "staging", p / "done")
    expected = _tree(p)
    deadline = time.monotonic() + 30
    while kv.status()["rebuild"]["rename_copies"] < 3:  # (made in the background)
        assert time.monotonic() < deadline, kv.status()["rebuild"]
        time.sleep(0.05)
    kv.reboot()
    for name in os.listdir(kv.nvme_dir / "meta"):
        os.unlink(kv.nvme_dir / "meta" / name)
    r = subprocess.run([sys.executable, "-m", "kvfs.cli.fsck", "--rebuild", str(kv.nvme_dir)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 lost" in r.stdout and "1 in /lost+found" in r.stdout, r.stdout
    kv.start()
    got = _tree(p)
    found = [k for k in got if k.startswith("lost+found/")]
    assert len(found) == 1 and (p / found[0]).read_bytes() == old
    assert {k: v for k, v in got.items() if not k.startswith("lost+found")} == expected
