"""fsck.kvfs on stores damaged in the ways a crash or a bug could leave them."""

from __future__ import annotations

import contextlib
import os
import subprocess
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
