"""Tiers through a real mount: demotion, promotion, scan resistance, persistence, integrity,
full-disk behaviour. Small tiers make every movement happen within a second or two."""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfs.store.meta import FORMAT_VERSION

CHUNK = 64 << 10


def _fill(m, prefix: str, n: int, size: int) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        data = os.urandom(size)
        (m.path / f"{prefix}{i}").write_bytes(data)
        files[f"{prefix}{i}"] = data
    return files


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.05)


def _check(m, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data, name


def test_demotion_and_nvme_reads(kv):
    files = _fill(kv, "f", 40, 256 << 10)  # 10 MiB through a 4 MiB DRAM tier
    st = kv.status()
    assert st["tiers"]["dram"]["used_bytes"] <= st["tiers"]["dram"]["capacity_bytes"]
    assert st["tiers"]["nvme"]["chunks"] > 0
    # which files went is the policy's choice (prediction may keep a chain's head); some did
    assert any(kv.tiers(name) == {"nvme"} for name in files)
    before = st["reads"]["chunks_from_nvme"] + st["prefetch"]["issued_chunks"]
    _check(kv, files)
    after = kv.status()
    # served from NVMe on demand, or staged ahead of the read by prefetch
    assert after["reads"]["chunks_from_nvme"] + after["prefetch"]["issued_chunks"] > before


def test_small_file_costs_its_pages(kv):
    (kv.path / "s").write_bytes(os.urandom(64 << 10 >> 4))  # 4 KiB
    st = kv.status()["tiers"]["dram"]
    assert st["used_bytes"] == 4096 and st["logical_bytes"] == 4096


def _dram_bytes(m) -> int:
    """RAM the DRAM tier's files hold (tmpfs pages)."""
    files = m.dram_dir / "files"
    return sum(os.stat(files / n).st_blocks * 512 for n in os.listdir(files))


def _dram_file(m, name: str) -> Path:
    return m.dram_dir / "files" / f"{os.stat(m.path / name).st_ino:x}"


def test_dram_tier_holds_only_its_chunks_and_never_exceeds_it(mount_factory):
    """DRAM files take pages as chunks arrive and give them back as they leave: the tier's
    RAM stays within its capacity through demotion, what a file no longer holds in DRAM is
    punched, and a file with nothing in DRAM has no DRAM file."""
    m = mount_factory(dram_size="8M")
    cap = m.status()["tiers"]["dram"]["capacity_bytes"]
    files = _fill(m, "p", 8, 100_000)
    _wait(lambda: m.status()["passthrough"]["writing_files"] == 0)  # their closes landed
    dram = m.status()["tiers"]["dram"]
    assert _dram_bytes(m) == dram["used_bytes"] <= cap
    big = _fill(m, "q", 12, 1 << 20)  # through a tier of 8 MiB: demotion
    assert _dram_bytes(m) <= cap
    _wait(lambda: _dram_bytes(m) == m.status()["tiers"]["dram"]["used_bytes"])
    gone = [n for n in {**files, **big} if m.tiers(n) == {"nvme"}]
    assert gone and not any(_dram_file(m, n).exists() for n in gone)
    _check(m, files)
    _check(m, big)
    m.unmount()
    held = _dram_bytes(m)
    m.start()
    assert _dram_bytes(m) == held == m.status()["tiers"]["dram"]["used_bytes"]
    for n in files:
        os.unlink(m.path / n)
    for n in big:
        os.unlink(m.path / n)
    _wait(lambda: _dram_bytes(m) == 0 and not os.listdir(m.dram_dir / "files"))


def test_scan_does_not_flush_reused_blocks(kv):
    hot = _fill(kv, "hot", 8, 128 << 10)  # 1 MiB of reused blocks
    for _ in range(2):
        _check(kv, hot)  # reads promote them to the protected segment
    assert all(kv.tiers(n) == {"dram"} for n in hot)
    _fill(kv, "scan", 48, 256 << 10)  # one pass of 12 MiB written once, never read
    assert all("dram" in kv.tiers(n) for n in hot), "a write scan evicted reused blocks"


def test_nvme_reads_promote_when_room(mount_factory):
    m = mount_factory(dram_size="4M")
    files = _fill(m, "f", 24, 256 << 10)
    for name in files:
        if m.tiers(name) == {"nvme"}:
            break
    else:
        pytest.fail("nothing was demoted")
    for n in list(files)[8:]:
        os.unlink(m.path / n)  # make room
    assert (m.path / name).read_bytes() == files[name]
    assert "dram" in m.tiers(name)
    assert m.status()["moves"]["promotions"] > 0


def test_small_reads_of_a_read_ahead_chunk_reach_the_trio_thread_only_where_they_matter(
        mount_factory):
    """A 4 KiB reader of a read-through file is answered by the front thread from chunks read
    ahead; of its READs only those that change something (the first from a chunk, one from
    its first byte, one reaching its end) are the trio thread's to hear of. The others are
    counted all the same: every READ once, in the requests and the latency histogram."""
    m = mount_factory(read_through_min="512K")
    data = os.urandom(16 * CHUNK)
    (m.path / "big").write_bytes(data)
    m.unmount()
    m.lose_dram()  # every chunk on NVMe only
    m.start()
    before = m.status()["reads"]
    got, reads = bytearray(), 0
    with open(m.path / "big", "rb", buffering=0) as f:
        _wait(lambda: m.status()["reads"]["read_through_buffered_chunks"] >= 16)
        while piece := f.read(4096):
            got += piece
            reads += 1
    assert got == data
    st = m.status()["reads"]
    front = st["read_through_front_reads"] - before["read_through_front_reads"]
    notices = st["read_through_front_notices"] - before["read_through_front_notices"]
    assert front >= 16 * (CHUNK // 4096) // 2  # most of them answered by the front thread
    assert notices <= 3 * 16 < front
    # every READ that returned bytes counted once (the last, at EOF, returns none)
    asked = reads + 1
    assert st["requests_from_nvme"] - before["requests_from_nvme"] in (reads, asked)
    assert (sum(st["nvme_latency_us_log2_histogram"])
            - sum(before["nvme_latency_us_log2_histogram"])) == (
        st["requests_from_nvme"] - before["requests_from_nvme"])


def test_an_o_direct_reader_of_a_small_nvme_resident_file_reads_it_through_not_staged(
        mount_factory):
    """A file below read_through_min that is only on NVMe is staged into DRAM for a
    buffered reader, but read through the daemon for an O_DIRECT one (it keeps its own
    cache): right bytes, aligned O_DIRECT rules kept, nothing brought into DRAM."""
    m = mount_factory(prefetch="off")
    direct, buffered = os.urandom(4 * CHUNK), os.urandom(4 * CHUNK)
    (m.path / "direct").write_bytes(direct)
    (m.path / "buffered").write_bytes(buffered)
    m.unmount()
    m.lose_dram()  # every chunk on NVMe only
    m.start()
    fd = os.open(m.path / "direct", os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, len(direct))
        assert os.preadv(fd, [buf], 0) == len(direct)
        assert buf[:] == direct
        with pytest.raises(OSError) as exc:
            os.preadv(fd, [buf], 100)  # unaligned: as ext4 says
        assert exc.value.errno == errno.EINVAL
    finally:
        os.close(fd)
    assert m.tiers("direct") == {"nvme"}
    assert (m.path / "buffered").read_bytes() == buffered
    assert m.tiers("buffered") == {"dram", "nvme"}  # staged for the kernel to read


def test_big_files_are_read_through_with_read_ahead(mount_factory):
    """A file of at least read_through_min is read from NVMe through the daemon, chunks
    read ahead of a sequential reader into memory: right bytes, nothing staged or promoted,
    and a chunk written after it was read ahead reads back new."""
    m = mount_factory(read_through_min="512K")
    big = os.urandom(40 * CHUNK + 123)  # 41 chunks
    small = os.urandom(4 * CHUNK)
    (m.path / "big").write_bytes(big)
    (m.path / "small").write_bytes(small)
    m.unmount()
    m.lose_dram()  # every chunk on NVMe only
    m.start()
    before = m.status()
    with open(m.path / "big", "rb", buffering=0) as f:
        head = f.read(CHUNK)
        # The chunks read ahead meanwhile are the front thread's to answer from.
        _wait(lambda: m.status()["reads"]["read_through_buffer_used_chunks"] >= 1
              and m.status()["reads"]["read_through_buffered_chunks"] >= 30)
        time.sleep(0.2)
        assert head + f.read() == big
    st = m.status()
    assert st["reads"]["read_through_buffered_chunks"] >= 30
    assert st["reads"]["read_through_buffer_used_chunks"] >= 30
    assert st["reads"]["read_through_front_reads"] > 0  # answered without the trio thread
    # (a chunk counts once per request that reads part of it)
    assert st["reads"]["chunks_from_nvme"] - before["reads"]["chunks_from_nvme"] >= 41
    assert m.tiers("big") == {"nvme"}  # neither staged nor promoted
    table = subprocess.run([sys.executable, "-m", "kvfs.cli.ctl", "status", str(m.path)],
                           capture_output=True, text=True, check=True).stdout
    assert "NVMe chunks read ahead into memory" in table
    assert "READs answered from them by the front thread" in table
    # A small file is still brought into DRAM for its reader (staged by its open, or
    # prefetched: the write order predicts it) and read by the kernel.
    assert (m.path / "small").read_bytes() == small
    assert m.tiers("small") == {"dram", "nvme"}
    assert m.status()["passthrough"]["opens"] == 1

    # O_DIRECT reads in 64 KiB steps, and reads at random places (no read-ahead for those).
    fd = os.open(m.path / "big", os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, CHUNK)
        got = bytearray()
        while True:
            n = os.preadv(fd, [buf], len(got))
            got += buf[:n]
            if n < CHUNK:  # (the next offset is unaligned: EINVAL)
                break
        assert bytes(got) == big
        # Unaligned O_DIRECT reads are EINVAL, also where the chunk was read ahead (the front
        # thread would answer an aligned one).
        for off in (0, 20 * CHUNK):
            assert os.preadv(fd, [buf], off) == CHUNK
            time.sleep(0.05)
            with pytest.raises(OSError) as exc:
                os.preadv(fd, [buf], off + CHUNK + 100)
            assert exc.value.errno == errno.EINVAL
        for off in (33 * CHUNK, 5 * CHUNK, 20 * CHUNK, 40 * CHUNK):
            n = os.preadv(fd, [buf], off)
            assert buf[:n] == big[off:off + CHUNK]
    finally:
        os.close(fd)
    # Read twice: reused, so its chunks are promoted (in the background, where room is).
    _wait(lambda: m.status()["moves"]["promotions"] >= 30)
    assert "dram" in m.tiers("big")

    # A chunk read ahead and then written over is read back as written.
    with open(m.path / "big", "rb", buffering=0) as r:
        assert r.read(CHUNK) == big[:CHUNK]  # the read-ahead of chunks 1-7 starts
        time.sleep(0.3)
        with open(m.path / "big", "r+b", buffering=0) as w:
            w.seek(3 * CHUNK + 5)
            w.write(b"new bytes")
        rest = r.read()
    want = bytearray(big)
    want[3 * CHUNK + 5:3 * CHUNK + 14] = b"new bytes"
    assert rest == bytes(want[CHUNK:])
    assert (m.path / "big").read_bytes() == bytes(want)


def test_reads_answered_from_read_ahead_never_return_bytes_older_than_a_finished_write(
        mount_factory, race):
    """The front thread answers READs of a read-through file from chunks read ahead. A
    writer rewrites chunks (each new version a pattern naming version and chunk) while
    readers read the file in chunk-sized preads and a small DRAM tier keeps demoting: no
    read returns bytes older than a write that had returned before the read began (a read
    racing a write may see part of each version, as on tmpfs)."""
    m = mount_factory(read_through_min="512K")
    nchunks = 32

    def pattern(v: int, c: int) -> bytes:
        return struct.pack("<II", v, c) * (CHUNK // 8)

    with open(m.path / "f", "wb") as f:
        f.write(b"".join(pattern(0, c) for c in range(nchunks)))
    m.unmount()
    m.lose_dram()
    m.start()
    done = [0] * nchunks  # the last version whose write returned, per chunk
    stop = threading.Event()
    errors: list[str] = []

    def write() -> None:
        fd = os.open(m.path / "f", os.O_WRONLY)
        try:
            v = 0
            while not stop.is_set():
                v += 1
                for c in range(0, nchunks, 3):
                    os.pwrite(fd, pattern(v, c), c * CHUNK)
                    done[c] = v
                time.sleep(0.01)
        finally:
            os.close(fd)

    def read() -> None:
        while not stop.is_set():
            fd = os.open(m.path / "f", os.O_RDONLY)
            try:
                for c in range(nchunks):
                    floor = done[c]
                    got = os.pread(fd, CHUNK, c * CHUNK)
                    units = set(struct.iter_unpack("<II", got))
                    if len(got) != CHUNK or min(units)[0] < floor or {u[1] for u in units} != {c}:
                        errors.append(f"chunk {c}: versions {sorted(units)[:4]}, finished "
                                      f"{floor}")
                        return
            finally:
                os.close(fd)

    race((write, read, read), 4, stop)
    assert not errors, errors[:3]
    assert m.status()["reads"]["read_through_front_reads"] > 0
    m.unmount()
    assert m.fsck().returncode == 0


def test_read_through_files_read_by_several_readers_and_mapped(mount_factory, race):
    """Readers of one read-through file at once (the front thread consumes a chunk at one
    reader's READ of its end; the others read it again from NVMe), and mmap(MAP_PRIVATE)
    of it meanwhile: every byte as written."""
    m = mount_factory(read_through_min="512K")
    big = os.urandom(24 * CHUNK + 4096)
    (m.path / "big").write_bytes(big)
    m.unmount()
    m.lose_dram()
    m.start()
    stop = threading.Event()
    errors: list[str] = []

    def read() -> None:
        while not stop.is_set():
            with open(m.path / "big", "rb", buffering=0) as f:
                got = b"".join(iter(lambda: f.read(CHUNK), b""))
            if got != big:
                errors.append(f"read {len(got)} bytes, not the file")

    def mapped() -> None:
        while not stop.is_set():
            with open(m.path / "big", "rb") as f, \
                    mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                              prot=mmap.PROT_READ) as mm:
                if mm[:] != big:
                    errors.append("the mapping differs from the file")

    race((read, read, read, mapped), 3, stop)
    assert not errors, errors[:3]
    assert m.status()["reads"]["read_through_front_reads"] > 0


def test_the_predicted_next_read_through_file_is_read_ahead(mount_factory):
    """Files written one after another are read in that order: while one read-through file
    is read, the next one's first chunks are being read ahead already (write-order chain).
    (An 8 MiB DRAM tier: read-ahead memory is half of it, predictions get half of that.)"""
    m = mount_factory(read_through_min="512K", dram_size="8M")
    files = {f"blk{i}": os.urandom(12 * CHUNK) for i in range(3)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    m.unmount()
    m.lose_dram()
    m.start()
    with open(m.path / "blk0", "rb", buffering=0) as f:
        assert f.read(CHUNK) == files["blk0"][:CHUNK]
        _wait(lambda: m.status()["reads"]["read_through_buffered_chunks"] > 12)  # blk1's too
        assert f.read() == files["blk0"][CHUNK:]
    before = m.status()["reads"]
    assert (m.path / "blk1").read_bytes() == files["blk1"]
    after = m.status()["reads"]
    used = "read_through_buffer_used_chunks"
    assert after[used] - before[used] == 12
    assert (m.path / "blk2").read_bytes() == files["blk2"]


def _nvme_only(m, files) -> list[str]:
    """Files whose every chunk is on NVMe only. Demotion runs in the background and a loaded
    machine can lag behind the writer, so wait a little for it."""
    names: list[str] = []

    def enough() -> bool:
        names[:] = [n for n in files if m.tiers(n) == {"nvme"}]
        return len(names) >= 2

    try:
        _wait(enough)
    except AssertionError:
        pytest.fail(f"nothing was demoted ({len(names)} NVMe-only files)")
    return names


def test_overwrite_nvme_chunk_partially(kv):
    files = _fill(kv, "f", 30, 256 << 10)
    a, b = _nvme_only(kv, files)[:2]
    fd = os.open(kv.path / a, os.O_RDWR)
    os.pwrite(fd, b"X" * 100, CHUNK + 10)  # read-modify-write of an NVMe-only chunk
    os.close(fd)
    want = bytearray(files[a])
    want[CHUNK + 10:CHUNK + 110] = b"X" * 100
    assert (kv.path / a).read_bytes() == bytes(want)
    os.truncate(kv.path / b, CHUNK + 7)  # truncation inside an NVMe-only chunk
    assert (kv.path / b).read_bytes() == files[b][:CHUNK + 7]


def test_remount_keeps_everything(kv):
    files = _fill(kv, "f", 30, 200_000)
    os.makedirs(kv.path / "d" / "e")
    os.symlink("../f1", kv.path / "d" / "link")
    kv.unmount()
    kv.start()
    _check(kv, files)
    assert os.readlink(kv.path / "d" / "link") == "../f1"
    # A clean unmount writes dirty chunks back: even losing DRAM now loses nothing.
    kv.unmount()

    kv.lose_dram()
    kv.start()
    _check(kv, files)


def test_writes_racing_batched_demotion_keep_the_newest_bytes(kv):
    """Demotion writes chunks back in batches (ChunkStore.writeback_many): chunks rewritten
    while their batch is being compressed or written must keep the new bytes, and a file's
    chunks in one batch share one codec choice."""
    import threading

    many = {f"m{i}": os.urandom(CHUNK) for i in range(48)}  # 3 MiB, single-chunk files
    wide = bytes(range(256)) * (12 * CHUNK // 256)  # 12 compressible chunks of one file
    (kv.path / "wide").write_bytes(wide)
    for name, data in many.items():
        (kv.path / name).write_bytes(data)
    newer = {name: os.urandom(CHUNK) for name in list(many)[::3]}

    def rewrite() -> None:
        for name, data in newer.items():
            with open(kv.path / name, "r+b") as f:
                f.write(data)

    t = threading.Thread(target=rewrite)
    t.start()
    flood = _fill(kv, "flood", 48, CHUNK)  # keeps the demoter busy meanwhile
    t.join()
    many.update(newer)
    assert kv.status()["moves"]["demotions"] >= 48
    stored = [c["codec"] for c in kv.where("wide") if "nvme" in c["tiers"]]
    assert len(set(stored)) <= 1, stored
    _check(kv, {**many, **flood, "wide": wide})
    kv.unmount()
    kv.start()
    _check(kv, {**many, **flood, "wide": wide})


def test_a_dram_file_missing_at_mount_costs_only_its_own_chunks(kv):
    """One inode's DRAM file gone while the rest of the tier survived: its synced chunk is
    read from NVMe, the unsynced file answers EIO, every other file is intact."""
    synced, lost = os.urandom(30_000), os.urandom(20_000)
    _write_durably(kv.path / "synced", synced)
    (kv.path / "lost").write_bytes(lost)
    others = _fill(kv, "o", 5, 10_000)
    inos = {n: os.stat(kv.path / n).st_ino for n in ("synced", "lost")}
    kv.status()  # every closed file taken (a file killed before its take is restreamed)
    kv.kill()  # (a clean unmount would write "lost" back to NVMe)
    for ino in inos.values():
        (kv.dram_dir / "files" / f"{ino:x}").unlink()
    kv.start()
    assert (kv.path / "synced").read_bytes() == synced
    with pytest.raises(OSError) as e:
        (kv.path / "lost").read_bytes()
    assert e.value.errno == errno.EIO
    _check(kv, others)


def test_small_files_go_to_nvme_many_records_a_write(kv):
    """Small chunks are written back up to WRITEBACK_BATCH_MAX a batch, their records one
    after another in one write: each must read back whole, at unmount and after demotion."""
    small = {f"s{i}": os.urandom(97 + 37 * i) for i in range(300)}
    for name, data in small.items():
        (kv.path / name).write_bytes(data)
    kv.unmount()  # writes all of them back
    kv.lose_dram()
    kv.start()
    _check(kv, small)
    more = {f"t{i}": os.urandom(5000 + i) for i in range(200)}
    for name, data in more.items():
        (kv.path / name).write_bytes(data)
    flood = _fill(kv, "flood", 96, CHUNK)  # 6 MiB through 4 MiB: demotes small files in batches
    assert sum("nvme" in c["tiers"] for n in more for c in kv.where(n)) > 0
    _check(kv, {**small, **more, **flood})


def test_sigkill_keeps_unsynced_data(kv):
    files = _fill(kv, "f", 20, 150_000)
    fd = os.open(kv.path / "open-while-killed", os.O_CREAT | os.O_WRONLY)
    os.write(fd, b"partial")
    kv.kill()
    try:
        os.close(fd)  # the mount is dead: close() may answer ENOTCONN
    except OSError:
        pass
    kv.start()
    _check(kv, files)
    assert (kv.path / "open-while-killed").read_bytes() == b"partial"
    assert kv.status()["reads"]["checksum_errors"] == 0


def test_fsync_survives_losing_dram(kv):
    data = os.urandom(300_000)
    with open(kv.path / "durable", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    (kv.path / "volatile").write_bytes(b"v" * 1000)
    # its close reaches the daemon after close() returns: let it land
    _wait(lambda: kv.status()["passthrough"]["writing_files"] == 0)
    kv.reboot()
    kv.start()
    assert (kv.path / "durable").read_bytes() == data
    assert os.path.getsize(kv.path / "durable") == len(data)
    # Never written back: the file exists but its lost bytes read as EIO, never as zeros.
    with pytest.raises(OSError) as ei:
        (kv.path / "volatile").read_bytes()
    assert ei.value.errno == errno.EIO


def test_fsynced_bytes_survive_losing_dram_after_being_written_over(kv):
    """A write into a chunk whose bytes an fsync made durable keeps that NVMe copy (its
    shadow) until the new bytes are written back: with DRAM lost meanwhile, the chunk goes
    back to what the fsync promised instead of being lost."""
    data = os.urandom(100_000)
    with open(kv.path / "log", "w+b") as f:  # read-write: through the daemon
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        f.write(b"appended" * 1000)  # into chunk 1, which held fsync'd bytes, and chunk 2
        f.seek(10)
        f.write(b"overwritten")  # chunk 0 too
    kv.reboot()
    kv.start()
    fd = os.open(kv.path / "log", os.O_RDONLY)
    try:
        assert os.pread(fd, 100_000, 0) == data
        with pytest.raises(OSError) as ei:  # what was appended is lost: EIO, never zeros
            os.pread(fd, 10, 100_000)
        assert ei.value.errno == errno.EIO
    finally:
        os.close(fd)
    assert "back to the bytes last written back" in kv.log()
    with open(kv.path / "log", "r+b") as f:  # writing there again makes it readable
        f.seek(100_000)
        f.write(b"z" * 8000)
    assert (kv.path / "log").read_bytes() == data + b"z" * 8000


@pytest.mark.parametrize("zeros", ["a hole chunk", "past a chunk's end"])
def test_fsynced_zeros_survive_losing_dram_after_a_write_into_their_chunk(kv, zeros):
    """Zeros an fsync made durable are data too. A later write into their chunk, lost with
    DRAM, takes the chunk back to its shadow (its bytes past the shadow's end EIO) or, with
    no record to go back to, loses it whole: the fsync'ed zeros before the write read EIO."""
    p = kv.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_RDWR)
    try:
        os.pwrite(fd, b"a" * (1000 if zeros == "a hole chunk" else CHUNK + 4464), 0)
        os.ftruncate(fd, CHUNK + 13175)
        os.fsync(fd)
    finally:
        os.close(fd)
    kv.unmount()  # everything on NVMe, clean
    kv.start()
    fd = os.open(p, os.O_WRONLY)
    os.pwrite(fd, b"b" * 5000, CHUNK + 13175)  # appended into chunk 1, never fsync'ed
    os.close(fd)
    kv.reboot()
    kv.start()
    fd = os.open(p, os.O_RDONLY)
    try:
        assert os.pread(fd, 13175, CHUNK).strip(b"\0") in (b"", b"a" * 4464)
    finally:
        os.close(fd)


def test_a_file_the_kernel_writes_reads_no_zeros_after_losing_dram(kv):
    """A new file written straight into its DRAM file by the kernel has, until its take,
    no chunks in lmdb. A stat updates its in-memory size, and anything that then saves
    its attributes (a chmod here; a rename, a utime) writes that size to lmdb. With DRAM
    lost the mount keeps what the last take recorded (nothing), yet at that size: the
    file reads as zeros nobody wrote, not as EIO or empty."""
    for name in ("first", "second"):  # a directory's first file never streams
        (kv.path / name).write_bytes(os.urandom(100_000))
    fd = os.open(kv.path / "s", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, os.urandom(300_000))
        assert kv.status()["passthrough"]["writing_files"] == 1
        assert os.stat(kv.path / "s").st_size == 300_000
        os.chmod(kv.path / "s", 0o600)
        kv.reboot()
    finally:
        with contextlib.suppress(OSError):  # (the mount is gone)
            os.close(fd)
    kv.start()
    try:
        got = (kv.path / "s").read_bytes()
    except OSError as exc:
        assert exc.errno == errno.EIO
    else:
        assert got == b"", f"{len(got)} bytes, {got.count(0)} zeros"


def test_shadows_move_with_cleaning_and_go_with_writeback(kv):
    """A shadow's record stays live for the cleaner until the chunk is written back."""
    files = {f"s{i}": os.urandom(130_000) for i in range(30)}
    for name, data in files.items():
        with open(kv.path / name, "w+b") as f:
            f.write(data)
            os.fsync(f.fileno())
    for name in files:  # written over in DRAM: every fsync'd chunk 0 gets a shadow
        with open(kv.path / name, "r+b") as f:
            f.write(b"new")
        files[name] = b"new" + files[name][3:]
    for i in range(120):  # churn: cleaning runs while the shadows live
        (kv.path / f"churn{i % 20}").write_bytes(os.urandom(200_000))
    for name, data in files.items():
        assert (kv.path / name).read_bytes() == data
    kv.unmount()  # writes everything back: no shadow is left
    from kvfs.store.meta import MetaStore

    meta = MetaStore(str(kv.nvme_dir / "meta"))
    try:
        assert list(meta.scan("shadows")) == []
    finally:
        meta.close()
    kv.start()
    for name, data in files.items():
        assert (kv.path / name).read_bytes() == data


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_dram_chunk_is_eio(kv):
    data = os.urandom(100_000)
    (kv.path / "c").write_bytes(data)
    path = _dram_file(kv, "c")
    kv.unmount()
    _flip_byte(path, 5)
    kv.start()
    with pytest.raises(OSError) as ei:
        (kv.path / "c").read_bytes()
    assert ei.value.errno == errno.EIO
    assert kv.status()["reads"]["checksum_errors"] >= 1
    assert "checksum mismatch" in kv.log()
    # the second chunk is intact and still readable
    with open(kv.path / "c", "rb") as f:
        f.seek(CHUNK)
        assert f.read() == data[CHUNK:]


def _dram_checks(kv) -> int:
    return kv.status()["reads"]["dram_checked_chunks"]


def test_dram_copies_are_checked_once_until_they_may_have_changed(kv):
    """dram_verify=once (default): bytes this daemon wrote or checked are trusted until they
    change; after a restart every DRAM copy is checked at its first read, once. With
    dram_verify=open every open checks them all again."""
    data = os.urandom(2 * CHUNK + 100)
    (kv.path / "v").write_bytes(data)
    before = _dram_checks(kv)
    for _ in range(2):
        assert (kv.path / "v").read_bytes() == data
    assert _dram_checks(kv) == before  # hashed as they were written
    kv.unmount()
    kv.start()
    assert "dram" in kv.tiers("v")  # (and on NVMe: the unmount wrote it back)
    before = _dram_checks(kv)
    assert (kv.path / "v").read_bytes() == data
    assert _dram_checks(kv) == before + 3  # the first read after the mount checks them
    assert (kv.path / "v").read_bytes() == data
    assert _dram_checks(kv) == before + 3
    (kv.path / "v").write_bytes(data[::-1])  # new bytes: hashed as they come in
    assert (kv.path / "v").read_bytes() == data[::-1]
    assert _dram_checks(kv) == before + 3
    kv.unmount()
    kv.start(dram_verify="open")
    before = _dram_checks(kv)
    for i in range(1, 3):
        assert (kv.path / "v").read_bytes() == data[::-1]
        assert _dram_checks(kv) == before + 3 * i


def test_prefetched_chunk_is_checked_again_after_its_first_read(kv):
    """dram_verify=open: a prefetch verifies the chunk in its DRAM slot, so the first read
    skips the hash; any later read checks it again: damage in DRAM after staging is EIO."""
    from kvfs.client import prefetch

    kv.unmount()
    kv.start(dram_verify="open")
    files = _fill(kv, "p", 30, 128 << 10)
    victim = _nvme_only(kv, files)[0]
    assert prefetch([kv.path / victim], strict=True) == 1
    _wait(lambda: "dram" in kv.tiers(victim))
    assert (kv.path / victim).read_bytes() == files[victim]  # the read that counts as checked
    assert "dram" in kv.tiers(victim)
    _flip_byte(_dram_file(kv, victim), 5)
    with pytest.raises(OSError) as ei:
        (kv.path / victim).read_bytes()
    assert ei.value.errno == errno.EIO


def _kv_blocks(n: int, size: int) -> list[bytes]:
    """n distinct blocks of real bf16 KV bytes (compressible, unlike os.urandom)."""
    raw = (Path(__file__).resolve().parents[3] / "shared/data/kv/smollm2_kv_bf16.npy").read_bytes()
    return [raw[4096 + i * size:4096 + (i + 1) * size] for i in range(n)]


@pytest.mark.parametrize("content", ["random", "kv"])
def test_corrupt_nvme_record_is_eio(kv, content):
    """Raw and compressed records alike: a damaged payload is EIO, never wrong bytes."""
    if content == "random":
        files = _fill(kv, "f", 30, 128 << 10)
    else:
        files = {f"f{i}": b for i, b in enumerate(_kv_blocks(30, 128 << 10))}
        for name, data in files.items():
            (kv.path / name).write_bytes(data)
    victim = _nvme_only(kv, files)[0]
    seg = kv.where(victim)[0]["segment"]
    codecs = {c["codec"] for c in kv.where(victim)}
    assert (0 in codecs) == (content == "random"), codecs
    kv.unmount()

    kv.lose_dram()  # make sure the read has to come from NVMe
    path = kv.nvme_dir / "segments" / f"seg-{seg:08d}.kvs"
    raw = bytearray(path.read_bytes())
    for off in range(4096, len(raw), 4096):  # a payload byte of every record in the segment
        if raw[off:off + 4] == b"KVR1":
            raw[off + 64 + 10] ^= 0x55
    path.write_bytes(bytes(raw))
    kv.start()
    bad = 0
    for name, data in files.items():
        try:
            got = (kv.path / name).read_bytes()
        except OSError as exc:
            assert exc.errno == errno.EIO
            bad += 1
            continue
        assert got == data  # never wrong bytes
    assert bad > 0


def test_enospc_keeps_what_was_stored(mount_factory):
    m = mount_factory(dram_size="4M", nvme_size="24M", segment_size="1M")
    stored = {}
    with pytest.raises(OSError) as ei:
        for i in range(100):
            data = os.urandom(512 << 10)
            (m.path / f"f{i}").write_bytes(data)
            stored[f"f{i}"] = data
    assert ei.value.errno == errno.ENOSPC
    st = os.statvfs(m.path)
    assert st.f_bavail * st.f_frsize < 1 << 20
    _check(m, stored)
    for name in list(stored)[:10]:
        os.unlink(m.path / name)
        del stored[name]
    (m.path / "after").write_bytes(b"room again" * 1000)  # deleting frees space
    m.unmount()
    m.start()
    _check(m, stored)


def test_cache_mode_evicts_whole_cold_files(mount_factory):
    m = mount_factory(dram_size="4M", nvme_size="24M", segment_size="1M", cache_mode="1")
    names = []
    for i in range(100):
        (m.path / f"f{i}").write_bytes(os.urandom(512 << 10))
        names.append(f"f{i}")
    st = m.status()
    assert st["evictions"]["files"] > 0
    present = [n for n in names if (m.path / n).exists()]
    assert "f99" in present and "f0" not in present
    for n in present:
        assert os.path.getsize(m.path / n) == 512 << 10
        (m.path / n).read_bytes()


def test_status_json_shape(kv):
    (kv.path / "x").write_bytes(b"x" * 1000)
    st = kv.status()
    for tier in ("dram", "nvme"):
        for key in ("capacity_bytes", "used_bytes", "logical_bytes", "chunks"):
            assert isinstance(st["tiers"][tier][key], int)
    assert {"chunks_from_dram", "chunks_from_nvme"} <= set(st["reads"])
    assert st["python_gc"]["frozen_objects"] > 0  # kvfs.collector runs in the daemon
    out = os.popen(f"python -m kvfs.cli.ctl status {kv.path} --json").read()
    assert json.loads(out)["tiers"]["dram"]["chunks"] == 1
    out = os.popen(f"python -m kvfs.cli.ctl where {kv.path / 'x'} --json").read()
    assert json.loads(out)["chunks"][0]["tiers"] == ["dram"]
    text = os.popen(f"python -m kvfs.cli.ctl status {kv.path}").read()
    assert "dram" in text and "hit rate" in text and "DRAM copies checked" in text


def test_where_pages_large_files(kv):
    p = str(kv.path / "big")
    fd = os.open(p, os.O_CREAT | os.O_WRONLY)
    for i in range(600):
        os.pwrite(fd, b"a", i * CHUNK * 3)
    os.close(fd)
    chunks = kv.where("big")
    assert [c["chunk"] for c in chunks] == [i * 3 for i in range(600)]


def test_unknown_format_refused(mount_factory):
    m = mount_factory()
    m.unmount()
    from kvfs.store.meta import MetaStore

    meta = MetaStore(str(m.nvme_dir / "meta"))
    with meta.env.begin(write=True, db=meta.db["super"]) as txn:
        sb = json.loads(txn.get(b"superblock"))
        sb["format"] = 99
        txn.put(b"superblock", json.dumps(sb).encode())
    meta.close()
    with pytest.raises(RuntimeError, match="format 99 is not supported"):
        m.start()
    assert not os.path.ismount(m.path)


def test_second_daemon_on_same_store_refused(mount_factory, tmp_path):
    m = mount_factory()
    other = tmp_path / "other"
    other.mkdir()
    clone = type(m)(Path(other), m.dram_dir, m.nvme_dir, m.options)
    with pytest.raises(RuntimeError, match="in use by another kvfs"):
        clone.start()


def test_fsck_clean_and_detects_corruption(kv):
    files = _fill(kv, "f", 30, 128 << 10)
    seg = kv.where(_nvme_only(kv, files)[0])[0]["segment"]
    kv.unmount()
    r = kv.fsck()
    assert r.returncode == 0, r.stdout + r.stderr
    assert " 0 errors" in r.stdout
    path = kv.nvme_dir / "segments" / f"seg-{seg:08d}.kvs"
    raw = bytearray(path.read_bytes())
    for off in range(4096, len(raw), 4096):
        if raw[off:off + 4] == b"KVR1":
            raw[off + 64 + 10] ^= 1
    path.write_bytes(bytes(raw))
    r = kv.fsck()
    assert r.returncode == 4
    assert "checksum mismatch" in r.stdout or "decode" in r.stdout.lower()
    assert len(files) == 30


def test_incompressible_chunk_in_compressible_file_survives_reboot(kv):
    """Each record carries the codec it was really stored with (raw when a chunk did not
    compress), not the file's codec choice."""
    import numpy as np

    npy = Path(__file__).resolve().parents[3] / "shared/data/kv/smollm2_kv_bf16.npy"
    kvdata = np.load(npy, mmap_mode="r")
    compressible = kvdata.reshape(-1).view(np.uint8)[:CHUNK].tobytes()
    data = compressible + os.urandom(CHUNK) + compressible
    with open(kv.path / "mixed", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    codecs = [c["codec"] for c in kv.where("mixed")]
    assert codecs[1] == 0 and codecs[0] != 0
    kv.reboot()
    kv.start()
    assert (kv.path / "mixed").read_bytes() == data


def test_dtype_hint_on_a_directory_applies_to_its_files(kv):
    """`user.kvfs.dtype` set once on a directory (an operator's hint for an engine's files)
    reaches every file below it; files elsewhere are detected as usual."""
    kv_bytes = Path(__file__).resolve().parents[3] / "shared/data/kv/smollm2_kv_bf16.npy"
    data = kv_bytes.read_bytes()[1 << 20:(1 << 20) + (256 << 10)]  # real bf16 KV, compressible
    (kv.path / "raw" / "deep").mkdir(parents=True)
    os.setxattr(kv.path / "raw", "user.kvfs.dtype", b"raw")
    (kv.path / "auto").mkdir()
    for d in ("raw/deep", "auto"):
        for i in range(8):
            (kv.path / d / f"b{i}").write_bytes(data)
    _fill(kv, "filler", 40, 256 << 10)  # push them to NVMe
    codecs = {d: {c["codec"] for i in range(8) for c in kv.where(f"{d}/b{i}") if c["segment"]}
              for d in ("raw/deep", "auto")}
    assert codecs["raw/deep"] == {0}, codecs
    assert codecs["auto"] and 0 not in codecs["auto"], codecs
    for d in ("raw/deep", "auto"):
        assert all((kv.path / d / f"b{i}").read_bytes() == data for i in range(8))


def test_files_take_their_directorys_codec_and_notice_a_change(kv):
    """After a directory's files agree on a codec, new files there take it on the random
    probe alone (status codec_choices.taken); bytes that disagree get a full choice at once."""
    kv_bytes = Path(__file__).resolve().parents[3] / "shared/data/kv/smollm2_kv_bf16.npy"
    bf16 = kv_bytes.read_bytes()[1 << 20:(1 << 20) + (128 << 10)]
    (kv.path / "d").mkdir()
    rnd = _fill(kv, "d/r", 24, 128 << 10)
    _fill(kv, "filler", 40, 256 << 10)  # push them to NVMe
    st = kv.status()["codec_choices"]
    assert st["taken"] > 0 and st["full"] > 0, st
    for i in range(8):
        (kv.path / "d" / f"b{i}").write_bytes(bf16)
    _fill(kv, "filler2", 40, 256 << 10)
    stored = {name: {c["codec"] for c in kv.where(name) if c["segment"]} for name in
              [*rnd, *(f"d/b{i}" for i in range(8))]}
    assert all(stored[name] <= {0} for name in rnd), stored
    assert all(stored[f"d/b{i}"] and 0 not in stored[f"d/b{i}"] for i in range(8)), stored
    _check(kv, rnd)
    assert all((kv.path / "d" / f"b{i}").read_bytes() == bf16 for i in range(8))


def test_a_directory_hint_outlives_a_remount_and_goes_with_its_removal(kv):
    """The hints are kept in memory as well as in lmdb: both must say the same thing after a
    remount, a removexattr and a new file."""
    kv_bytes = Path(__file__).resolve().parents[3] / "shared/data/kv/smollm2_kv_bf16.npy"
    data = kv_bytes.read_bytes()[1 << 20:(1 << 20) + CHUNK]
    (kv.path / "h").mkdir()
    os.setxattr(kv.path / "h", "user.kvfs.dtype", b"raw")
    kv.unmount()
    kv.start()
    assert os.getxattr(kv.path / "h", "user.kvfs.dtype") == b"raw"
    _write_durably(kv.path / "h" / "a", data)  # fsync writes it back: its codec is chosen
    os.removexattr(kv.path / "h", "user.kvfs.dtype")
    with pytest.raises(OSError) as e:
        os.getxattr(kv.path / "h", "user.kvfs.dtype")
    assert e.value.errno == errno.ENODATA
    _write_durably(kv.path / "h" / "b", data)
    assert [c["codec"] for c in kv.where("h/a")] == [0]
    assert 0 not in {c["codec"] for c in kv.where("h/b")}


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# ------------------------------------------------ packed DRAM copies (-o dram_compress)
def _superblock_format(m) -> int:
    from kvfs.store.meta import MetaStore

    meta = MetaStore(str(m.nvme_dir / "meta"))
    try:
        return meta.load_superblock()["format"]
    finally:
        meta.close()


def _packed(m, names) -> int:
    return sum(c["packed"] for n in names for c in m.where(n))


def test_fsync_keeps_a_packed_copy_that_reads_back(mount_factory):
    """With dram_compress, a written-back chunk's clean DRAM copy is its compressed record:
    DRAM is charged the record's pages, and reads decode it (verified) in a worker."""
    m = mount_factory(dram_compress="1")
    files = {f"k{i}": b for i, b in enumerate(_kv_blocks(6, 2 * CHUNK))}
    for name, data in files.items():
        _write_durably(m.path / name, data)
    st = m.status()
    dram = st["tiers"]["dram"]
    assert dram["packed_chunks"] == _packed(m, files) == 12, dram
    assert dram["used_bytes"] < 0.8 * dram["logical_bytes"], dram  # bf16: ~1.45x
    _check(m, files)
    after = m.status()
    assert after["reads"]["chunks_unpacked"] >= 12
    assert after["reads"]["chunks_from_dram"] - st["reads"]["chunks_from_dram"] >= 12


def test_nvme_reads_stage_packed_copies(mount_factory):
    """Chunks promoted or prefetched from NVMe take their record's pages in DRAM, not their
    raw length; random data (stored raw) is never packed."""
    m = mount_factory(dram_compress="1")
    files = {f"k{i}": b for i, b in enumerate(_kv_blocks(40, 2 * CHUNK))}  # 10 MiB > 4 MiB
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    rnd = _fill(m, "r", 4, 2 * CHUNK)
    victims = _nvme_only(m, files)
    _check(m, {n: files[n] for n in victims})  # read from NVMe: promoted, packed
    _wait(lambda: _packed(m, victims) > 0)
    _check(m, {n: files[n] for n in victims})  # and again, from the packed copies
    _check(m, rnd)
    assert _packed(m, rnd) == 0


def test_writes_into_packed_chunks(mount_factory):
    """A packed copy is never written in place: a write or a truncation drops it (it is
    clean) and works on the raw bytes."""
    m = mount_factory(dram_compress="1")
    data = bytearray(b"".join(_kv_blocks(3, CHUNK)))
    _write_durably(m.path / "w", bytes(data))
    assert _packed(m, ["w"]) == 3
    with open(m.path / "w", "r+b") as f:
        f.seek(1000)
        f.write(b"x" * 10)  # partial: read-modify-write of chunk 0
        f.seek(CHUNK)
        f.write(b"y" * CHUNK)  # covers chunk 1
    data[1000:1010] = b"x" * 10
    data[CHUNK:2 * CHUNK] = b"y" * CHUNK
    assert (m.path / "w").read_bytes() == data
    os.truncate(m.path / "w", 2 * CHUNK + 777)  # cuts into packed chunk 2
    del data[2 * CHUNK + 777:]
    assert (m.path / "w").read_bytes() == data
    assert [c["packed"] for c in m.where("w")] == [False, False, False]
    os.truncate(m.path / "w", 3 * CHUNK)
    assert (m.path / "w").read_bytes() == bytes(data) + bytes(CHUNK - 777)


def test_packed_copies_survive_remount_kill_and_reboot(mount_factory):
    m = mount_factory(dram_compress="1")
    files = {f"k{i}": b for i, b in enumerate(_kv_blocks(6, 2 * CHUNK))}
    for name, data in files.items():
        _write_durably(m.path / name, data)
    assert _packed(m, files) == 12
    m.unmount()
    assert _superblock_format(m) == FORMAT_VERSION
    r = m.fsck()
    assert r.returncode == 0 and " 0 errors" in r.stdout, r.stdout + r.stderr
    m.start()
    assert _packed(m, files) == 12 and m.status()["tiers"]["dram"]["packed_chunks"] == 12
    _check(m, files)
    m.kill()
    m.start()
    _check(m, files)
    m.reboot()
    m.start()
    assert m.status()["tiers"]["dram"]["packed_chunks"] == 0
    _check(m, files)


def test_corrupt_packed_copy_is_eio(mount_factory):
    m = mount_factory(dram_compress="1")
    data = _kv_blocks(1, CHUNK)[0]
    _write_durably(m.path / "c", data)
    assert _packed(m, ["c"]) == 1
    _flip_byte(_dram_file(m, "c"), 100)
    with pytest.raises(OSError) as ei:
        (m.path / "c").read_bytes()
    assert ei.value.errno == errno.EIO
    assert m.status()["reads"]["checksum_errors"] >= 1


def _to_arena_layout(m, format_version: int) -> None:
    """Rewrite an unmounted store's DRAM tier in the layout of formats 1-2 (docs/FORMAT.md
    of those versions): every DRAM copy in a slot of one `arena` file, lmdb naming the slot."""
    import struct

    from kvfs.store.location import LOC, PACKED
    from kvfs.store.meta import MetaStore, from_key2

    meta = MetaStore(str(m.nvme_dir / "meta"))
    files = m.dram_dir / "files"
    slot = 0
    try:
        with meta.env.begin(write=True) as txn, open(m.dram_dir / "arena", "wb") as arena:
            arena.truncate(64 * CHUNK)
            cur = txn.cursor(db=meta.db["chunks"])
            for k, v in list(cur):
                loc = list(LOC.unpack(v))
                if loc[0] < 0:
                    continue
                ino, c = from_key2(k)
                length = loc[5] if loc[7] & PACKED else loc[4]
                with open(files / f"{ino:x}", "rb") as f:
                    data = os.pread(f.fileno(), length, c * CHUNK)
                arena.seek(slot * CHUNK)
                arena.write(data)
                loc[0] = slot
                slot += 1
                txn.put(k, LOC.pack(*loc), db=meta.db["chunks"])
            sb = json.loads(txn.get(b"superblock", db=meta.db["super"]))
            sb["format"] = format_version
            txn.put(b"superblock", json.dumps(sb).encode(), db=meta.db["super"])
        assert slot > 0 and struct.calcsize("<q") == 8
    finally:
        meta.close()
    for name in os.listdir(files):
        os.unlink(files / name)


@pytest.mark.parametrize("old_format", [1, 2])
def test_an_arena_store_moves_to_dram_files_at_mount(mount_factory, old_format):
    """A store of formats 1-2 keeps its DRAM copies in one arena file: the first mount of
    this version copies each into its inode's DRAM file and marks the store with its own
    format, so nothing is lost, dirty chunks included (a crash before the mark copies them
    again)."""
    m = mount_factory(dram_compress="1" if old_format == 2 else "0")
    durable = {f"k{i}": b for i, b in enumerate(_kv_blocks(3, 2 * CHUNK))}
    for name, data in durable.items():
        _write_durably(m.path / name, data)  # clean copies (packed under format 2)
    dirty = _fill(m, "d", 3, CHUNK + 1000)  # only in DRAM
    _wait(lambda: m.status()["passthrough"]["writing_files"] == 0)  # their closes landed
    m.kill()
    _to_arena_layout(m, old_format)
    m.start()
    assert _superblock_format(m) == FORMAT_VERSION
    assert not (m.dram_dir / "arena").exists()
    _check(m, {**durable, **dirty})
    assert all(m.tiers(n) == {"dram"} for n in dirty)
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0 and " 0 errors" in r.stdout, r.stdout + r.stderr
    m.lose_dram()  # a reboot: what was made durable before is still there
    m.start()
    _check(m, durable)


def test_packed_copy_outlives_its_missing_segment(mount_factory):
    """A segment file lost behind kvfs's back: chunks with a packed DRAM copy keep their
    bytes (decoded into their slot at mount), like chunks with a raw one."""
    m = mount_factory(dram_compress="1")
    files = {f"k{i}": b for i, b in enumerate(_kv_blocks(3, 2 * CHUNK))}
    for name, data in files.items():
        _write_durably(m.path / name, data)
    assert _packed(m, files) == 6
    segs = {c["segment"] for n in files for c in m.where(n)}
    m.unmount()
    for seg in segs:
        (m.nvme_dir / "segments" / f"seg-{seg:08d}.kvs").unlink()
    m.start(dram_compress="1")
    _check(m, files)
    assert _packed(m, files) == 0
    assert all(c["tiers"] == ["dram"] for n in files for c in m.where(n))
