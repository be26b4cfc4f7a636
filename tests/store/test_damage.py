"""Damage to the tiers behind kvfs's back, while it is mounted and before a mount.

Segment files truncated, replaced by a directory, given a foreign header, with a flipped bit
in a record header or a payload; a flipped bit in a DRAM file. Whatever the damage: reads of
the chunks it touched fail with EIO, every other byte reads back as written, the daemon stays
up and logs no traceback, unmount works, and a mount of the damaged store gives EIO on the
affected chunks with a clear log line (never a traceback or a hang). Damage before a mount of
one DRAM file or one payload is in test_chunkstore.py (test_corrupt_*,
test_a_dram_file_missing_at_mount_*); this file covers the rest.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.store.nvme import BLOCK, HEADER_SIZE, RecordError, unpack_header

CHUNK = 64 << 10


def _fill(m, prefix: str, n: int, size: int) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        files[f"{prefix}{i}"] = data = os.urandom(size)
        (m.path / f"{prefix}{i}").write_bytes(data)
    return files


def _wait(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def _nvme_only(m, files: dict[str, bytes]) -> list[str]:
    """Files whose every chunk is on NVMe only (demotion runs in the background)."""
    names: list[str] = []

    def enough() -> bool:
        names[:] = [n for n in files if m.tiers(n) == {"nvme"}]
        return len(names) >= 2

    _wait(enough)
    return names


def _segment(m, seg: int) -> Path:
    return m.nvme_dir / "segments" / f"seg-{seg:08d}.kvs"


def _live_records(m, files: dict[str, bytes], seg: int) -> dict[tuple[int, int], int]:
    """(inode, chunk) -> offset of the record in segment *seg* that each of *files*' chunks
    placed there reads from (its newest record there)."""
    placed = {(os.stat(m.path / name).st_ino, c["chunk"])
              for name in files for c in m.where(name) if c["segment"] == seg}
    raw = _segment(m, seg).read_bytes()
    newest: dict[tuple[int, int], tuple[int, int]] = {}
    for off in range(BLOCK, len(raw) - HEADER_SIZE + 1, BLOCK):
        try:
            h = unpack_header(raw[off:off + HEADER_SIZE])
        except RecordError:
            continue
        key = (h.ino, h.chunk)
        if key in placed and h.seq > newest.get(key, (-1, 0))[0]:
            newest[key] = (h.seq, off)
    assert set(newest) == placed
    return {key: off for key, (_, off) in newest.items()}


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _expect(m, files: dict[str, bytes], bad: set[tuple[int, int]]) -> None:
    """Every chunk in *bad* ((inode, chunk)) reads as EIO, every other byte as written."""
    assert bad
    for name, data in files.items():
        ino = os.stat(m.path / name).st_ino
        fd = os.open(m.path / name, os.O_RDONLY)
        try:
            for c in range((len(data) + CHUNK - 1) // CHUNK):
                if (ino, c) in bad:
                    with pytest.raises(OSError) as ei:
                        os.pread(fd, CHUNK, c * CHUNK)
                    assert ei.value.errno == errno.EIO, (name, c)
                else:
                    assert os.pread(fd, CHUNK, c * CHUNK) == data[c * CHUNK:(c + 1) * CHUNK], \
                        (name, c)
        finally:
            os.close(fd)


def _healthy(m) -> None:
    """The daemon is up, answers, and logged no traceback."""
    assert m.status()["tiers"]["nvme"]["capacity_bytes"] > 0
    os.kill(m.pid(), 0)
    assert "Traceback" not in m.log()


def _refused(m, path: Path) -> None:
    """A mount with a directory at segment *path* fails, naming it (a path the daemon may
    not open must not be taken for a lost segment); without it, it mounts."""
    with pytest.raises(RuntimeError, match=f"{path}: Is a directory"):
        m.start()
    assert not os.path.ismount(m.path)
    path.rmdir()


def _damage(m, how: str, seg: int, off: int) -> None:
    """Damage segment *seg* at the record at *off*, the way *how* says."""
    path = _segment(m, seg)
    if how == "truncate":  # the record, and all after it, cut off
        os.truncate(path, off + 100)
    elif how == "header":  # a bit of its chunk number
        _flip(path, off + 17)
    elif how == "payload":
        _flip(path, off + HEADER_SIZE + 1000)
    elif how == "directory":
        os.unlink(path)
        path.mkdir()
    elif how == "foreign":  # another filesystem's segment (its uuid is at 12..28)
        _flip(path, 12)
    else:
        raise AssertionError(how)


def _affected(how: str, records: dict[tuple[int, int], int], off: int) -> set:
    if how == "truncate":
        return {key for key, o in records.items() if o >= off}
    if how in ("header", "payload"):
        return {key for key, o in records.items() if o == off}
    return set(records)  # the whole segment


def _victim(m):
    """40 files of two chunks, random bytes (stored raw); one of them on NVMe only, its
    segment, the records there, and its first chunk's record."""
    files = _fill(m, "f", 40, 2 * CHUNK)
    victim = _nvme_only(m, files)[0]
    seg = m.where(victim)[0]["segment"]
    records = _live_records(m, files, seg)
    return files, seg, records, records[(os.stat(m.path / victim).st_ino, 0)]


@pytest.mark.parametrize("how", ["truncate", "header", "payload"])
def test_segment_damaged_while_mounted(kv, how):
    files, seg, records, off = _victim(kv)
    _damage(kv, how, seg, off)
    bad = _affected(how, records, off)
    _expect(kv, files, bad)
    ino, c = min(bad)
    assert f"inode {ino} chunk {c}: " in kv.log()  # the read that failed says which
    _healthy(kv)
    kv.unmount()
    r = kv.fsck()
    assert r.returncode == 4 and f"inode {ino} chunk {c}: NVMe record" in r.stdout, r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    kv.lose_dram()  # (what was staged from the good records goes too: reads from NVMe)
    kv.start()
    _expect(kv, files, bad)
    _healthy(kv)


@pytest.mark.parametrize("how", ["truncate", "header", "directory", "foreign"])
def test_segment_damaged_before_a_mount(kv, how):
    files, seg, records, off = _victim(kv)
    kv.unmount()
    kv.lose_dram()
    _damage(kv, how, seg, off)
    r = kv.fsck()
    assert r.returncode == 4, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    if how == "directory":  # a path the daemon cannot open: the mount names it and stops
        _refused(kv, _segment(kv, seg))
    kv.start()
    _expect(kv, files, _affected(how, records, off))
    if how in ("directory", "foreign"):
        assert kv.log().count(f"segment {seg} is missing") == 1
    _healthy(kv)
    more = _fill(kv, "g", 40, 2 * CHUNK)  # new segments, written back and read
    kv.unmount()
    kv.start()
    _expect(kv, {**files, **more}, _affected(how, records, off))


def test_segment_replaced_by_a_directory_while_mounted(kv):
    """The daemon reads on through the file it has open. When its records die and it
    removes the segment, the path holds a directory: that is logged, and the unlink whose
    commit let the segment go still succeeds (it used to fail with EISDIR after its
    commit, the file gone but the kernel told it was not)."""
    files, seg, _, off = _victim(kv)
    _damage(kv, "directory", seg, off)
    for name, data in files.items():
        assert (kv.path / name).read_bytes() == data
    for name in files:
        os.unlink(kv.path / name)
    assert not any(name in files for name in os.listdir(kv.path))
    assert f"segment {seg} is no longer used but" in kv.log()
    more = _fill(kv, "g", 40, 2 * CHUNK)
    _healthy(kv)
    kv.unmount()
    _refused(kv, _segment(kv, seg))  # (its records are all dead: nothing is lost)
    kv.start()
    for name, data in more.items():
        assert (kv.path / name).read_bytes() == data


@pytest.mark.parametrize("leftover", ["empty", "foreign"])
def test_a_segment_name_taken_at_mount_is_never_reused(kv, leftover):
    """A crash between the creation of a segment file and its header's write leaves an empty
    file; a name can also hold a file that is no segment of this store. A new segment must
    not take that name: its creation would fail with EEXIST, and every write-back and fsync
    with it."""
    (kv.path / "a").write_bytes(os.urandom(3 << 20))
    kv.unmount()
    names = sorted((kv.nvme_dir / "segments").iterdir())
    taken = _segment(kv, max(int(p.name[4:12]) for p in names) + 1)
    taken.write_bytes(b"" if leftover == "empty" else bytes(BLOCK))
    r = kv.fsck()
    assert r.returncode == 0, r.stdout + r.stderr
    if leftover == "empty":
        assert r.stderr == ""  # what a crash leaves is no finding
    kv.start()
    data = os.urandom(3 << 20)
    with open(kv.path / "b", "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    kv.unmount()
    assert taken.exists() == (leftover == "foreign")  # an empty one is removed
    kv.start()
    assert (kv.path / "b").read_bytes() == data
    _healthy(kv)


def test_cleaning_leaves_a_segment_it_cannot_empty(mount_factory):
    """A live record whose header no longer reads is not found by the cleaner's scan, so its
    segment never empties. The cleaner must not pick it again and again (it did: ~100
    passes a second in urgent mode, forever); it logs it once and cleans others."""
    m = mount_factory(nvme_size="24M")
    files, seg, records, off = _victim(m)
    _damage(m, "header", seg, off)
    for name in files:  # all but the one whose record is damaged
        if records.get((os.stat(m.path / name).st_ino, 0)) != off:
            os.unlink(m.path / name)
    sv = os.statvfs(m.path)
    n = sv.f_bavail * sv.f_frsize // (4 * (CHUNK + 4096)) - 1
    _fill(m, "keep", n, 4 * CHUNK)  # the tier nearly full
    for i in range(1, n, 2):  # and every other one replaced: cleaning is needed
        if "could not be moved" in m.log():
            break
        os.unlink(m.path / f"keep{i}")
        (m.path / f"new{i}").write_bytes(os.urandom(4 * CHUNK))
    _wait(lambda: "could not be moved" in m.log())
    passes = -1
    for _ in range(20):  # until it has cleaned what else the writes left (a few passes)
        if passes == (passes := sum(m.status()["gc"]["passes"].values())):
            break
        time.sleep(0.3)
    time.sleep(1)
    assert sum(m.status()["gc"]["passes"].values()) <= passes + 1
    assert m.log().count(f"cleaning segment {seg}: ") == 1
    _healthy(m)


@pytest.mark.parametrize("verify", ["once", "open"])
def test_bit_flip_in_a_dirty_dram_chunk_while_mounted(mount_factory, verify):
    """A DRAM copy not yet written back, changed behind the daemon's back: with
    dram_verify=open the next read fails; in any mode it is never written back as good data
    (unmount leaves it, and logs it), and after a restart it reads as EIO."""
    m = mount_factory(dram_size="16M", dram_verify=verify)
    files = _fill(m, "d", 4, 3 * CHUNK)
    _wait(lambda: m.status()["passthrough"]["writing_files"] == 0)  # taken: sealed
    assert all(c["dirty"] for name in files for c in m.where(name))
    ino = os.stat(m.path / "d1").st_ino
    _flip(m.dram_dir / "files" / f"{ino:x}", CHUNK + 7)
    bad = {(ino, 1)}
    if verify == "open":
        _expect(m, files, bad)
    _healthy(m)
    # The unmount ends; it exits 1, saying a chunk could not be written back (and that it
    # stays in DRAM): that chunk is the damaged one.
    r = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(m.path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1) and not os.path.ismount(m.path), r.stderr
    assert f"inode {ino} chunk 1: its DRAM copy does not match its checksum" in m.log()
    r = m.fsck()
    assert r.returncode == 4 and f"inode {ino} chunk 1: DRAM copy" in r.stdout, r.stdout
    m.start()
    _expect(m, files, bad)
    _healthy(m)
