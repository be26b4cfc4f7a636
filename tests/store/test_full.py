"""Full is ENOSPC, never a hang, never corruption: the NVMe tier's filesystem full (a small
loop-mounted ext4), the DRAM tier's tmpfs full, the metadata's map full."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

MiB = 1 << 20


@contextlib.contextmanager
def small_ext4(path: Path, size: int):
    """An ext4 filesystem of *size* bytes mounted at *path* (a loop device), unmounted at
    the end whatever happens."""
    image = path.with_suffix(".img")
    with open(image, "wb") as f:
        f.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True)
    try:
        yield path
    finally:
        for _ in range(50):  # a daemon killed by a failed test may still hold files there
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
        image.unlink()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "kvfs-test", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _write_file(path: Path, data: bytes, fsync: bool = True, timeout: float = 60) -> str:
    """Write *data* to *path* in a child process (a hang must fail the test, not stall it):
    'ok', or the errno name of the call that failed."""
    code = (
        "import os, sys, errno\n"
        "data = sys.stdin.buffer.read()\n"
        "try:\n"
        "    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)\n"
        "except OSError as e:\n"
        "    print('open', errno.errorcode[e.errno]); sys.exit()\n"
        "try:\n"
        "    view = memoryview(data)\n"
        "    while view:\n"
        "        view = view[os.write(fd, view):]\n"
        f"    if {fsync}: os.fsync(fd)\n"
        "    print('ok')\n"
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\n"
        "finally:\n"
        "    os.close(fd)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], input=data, capture_output=True,
                       timeout=timeout)
    return r.stdout.decode().strip()


def _daemon_rss(m) -> int:
    with open(f"/proc/{m.pid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) << 10


def test_a_full_nvme_filesystem_is_enospc_not_a_hang(mount_factory, tmp_path):
    """Before 2026-12-07 (../shared/repro/repro_fullhang.py) a write hung for good once the
    filesystem under the NVMe tier filled, the daemon logged the failed demotion thousands
    of times and its memory grew. Now: ENOSPC at write() or fsync(), each within seconds,
    the log says it once, memory stays flat, what was fsynced reads back, and removing
    files makes room again."""
    with small_ext4(tmp_path / "nvmefs", 128 * MiB) as fs:
        m = mount_factory(start=False, dram_size="8M", nvme_size="1G", chunk_size="256K",
                          segment_size="2M")
        m.nvme_dir = fs / "kv"
        m.start()
        data = {}
        outcomes = []
        rss = []
        for i in range(40):
            blob = os.urandom(3 * MiB)
            outcome = _write_file(m.path / f"f{i:02d}", blob)
            outcomes.append(outcome)
            if outcome == "ok":
                data[f"f{i:02d}"] = blob
            rss.append(_daemon_rss(m))
        assert outcomes[0] == "ok" and "ENOSPC" in outcomes, outcomes
        assert set(outcomes) <= {"ok", "ENOSPC"}, outcomes
        assert len(data) >= 10, outcomes  # most of the filesystem was used
        full_at = outcomes.index("ENOSPC")
        assert rss[-1] - rss[full_at] < 8 * MiB, rss  # flat while every write is refused
        log = m.log()
        assert log.count("full:") <= 3, log  # once per episode, not per attempt
        assert "Traceback" not in log
        for name, blob in data.items():
            assert (m.path / name).read_bytes() == blob
        for name in list(data)[:4]:  # room again
            (m.path / name).unlink()
            del data[name]
        time.sleep(1.5)  # (the tier reads the filesystem's free space at most every 0.5 s)
        blob = os.urandom(3 * MiB)
        assert _write_file(m.path / "again", blob) == "ok"
        data["again"] = blob
        m.unmount()
        r = m.fsck()
        assert r.returncode == 0, r.stdout
        m.start()
        for name, blob in data.items():
            assert (m.path / name).read_bytes() == blob
        m.unmount()


def test_an_unmount_that_cannot_write_back_says_so_and_keeps_the_data(mount_factory,
                                                                      tmp_path):
    """Dirty data in DRAM, then the NVMe tier's filesystem filled by someone else: the
    unmount exits 1 with a message naming where the data is, and the next mount of the same
    directories (with room again) writes it back. Before 2026-12-07 it reported success
    and the data was left only in DRAM, lost at the next reboot."""
    with small_ext4(tmp_path / "nvmefs", 80 * MiB) as fs:
        m = mount_factory(start=False, dram_size="16M", nvme_size="1G", chunk_size="256K",
                          segment_size="2M")
        m.nvme_dir = fs / "kv"
        m.start()
        blob = os.urandom(4 * MiB)
        assert _write_file(m.path / "dirty", blob, fsync=False) == "ok"
        assert m.status()["tiers"]["dram"]["dirty_bytes"] >= 4 * MiB
        filler = fs / "filler"
        with open(filler, "wb") as f:  # the rest of the filesystem
            with contextlib.suppress(OSError):
                while True:
                    f.write(bytes(MiB))
                    f.flush()
        r = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(m.path)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, r.stderr
        assert "could not be written back" in r.stderr and str(m.dram_dir) in r.stderr
        filler.unlink()
        m.start()
        assert "the last unclean unmount" in m.log()
        assert (m.path / "dirty").read_bytes() == blob
        m.unmount()  # (raises if it exits non-zero)
        m.lose_dram()
        m.start()
        assert (m.path / "dirty").read_bytes() == blob  # written back by then


def test_a_full_dram_tmpfs_is_enospc_and_nothing_is_lost(mount_factory, tmp_path):
    """Someone else fills the tmpfs the DRAM tier lives on: writes that need DRAM get
    ENOSPC (or go on once the demoter made room), reads of what is stored go on, and once
    the tmpfs has room again everything works."""
    with small_tmpfs(tmp_path / "shm", 24 * MiB) as shm:
        m = mount_factory(start=False, dram_size="8M")
        m.dram_dir = shm / "dram"
        m.start()
        stored = {f"s{i}": os.urandom(500_000) for i in range(6)}
        for name, blob in stored.items():
            assert _write_file(m.path / name, blob) == "ok"
        filler = shm / "filler"
        with open(filler, "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(bytes(256 << 10))
                    f.flush()
        outcomes = [_write_file(m.path / f"w{i}", os.urandom(500_000)) for i in range(6)]
        assert set(outcomes) <= {"ok", "ENOSPC"}, outcomes
        for name, blob in stored.items():
            assert (m.path / name).read_bytes() == blob
        filler.unlink()
        blob = os.urandom(500_000)
        assert _write_file(m.path / "after", blob) == "ok"
        assert (m.path / "after").read_bytes() == blob
        assert "Traceback" not in m.log()
        m.unmount()
        r = m.fsck()
        assert r.returncode == 0, r.stdout


def test_full_metadata_is_enospc_and_deletions_still_work(mount_factory):
    """The lmdb map (meta_size) full of xattrs: creates and setxattrs get ENOSPC, the
    daemon stays up, removing xattrs and files works and makes room again."""
    m = mount_factory(meta_size="16M")
    (m.path / "f").write_bytes(b"x")
    value = os.urandom(60_000)
    errs = []
    for i in range(400):
        try:
            os.setxattr(m.path / "f", f"user.big{i}", value)
        except OSError as exc:
            errs.append(exc.errno)
            break
    assert errs == [errno.ENOSPC]
    with pytest.raises(OSError) as ei:
        (m.path / "g").write_bytes(b"y")
    assert ei.value.errno == errno.ENOSPC
    assert (m.path / "f").read_bytes() == b"x"
    for name in os.listxattr(m.path / "f"):
        os.removexattr(m.path / "f", name)
    deadline = time.monotonic() + 30
    while True:  # the metadata's room is looked at every few commits
        try:
            (m.path / "g").write_bytes(b"y")
            break
        except OSError:
            assert time.monotonic() < deadline
            (m.path / "f").write_bytes(b"x")  # a few commits
    assert (m.path / "g").read_bytes() == b"y"
    m.unmount()
    assert m.fsck().returncode == 0


def _passthrough(m) -> dict:
    return m.status()["passthrough"]


def test_what_files_the_kernel_writes_hold_counts_against_the_room(mount_factory):
    """The kernel writes a streamed file without telling kvfs, so the room such files hold
    is read from tmpfs. Far from full, a write is let through on a bound from one statvfs
    of the DRAM tier's tmpfs (no sum file by file: that cost ~125 us at every create and
    write); near full, the exact sum decides, so a write never takes room they hold."""
    m = mount_factory(dram_size="8M", nvme_size="24M", chunk_size="64K", segment_size="1M",
                      dram_huge="1")
    d = m.path / "blocks"
    d.mkdir()
    (d / "first").write_bytes(os.urandom(256 << 10))  # later write-only opens stream
    st = os.statvfs(m.path)
    free_before = st.f_bavail * st.f_frsize
    streamed = os.open(d / "w", os.O_CREAT | os.O_WRONLY, 0o644)
    other = os.open(m.path / "g", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        assert _passthrough(m)["writing_files"] == 1
        unseen = os.urandom(2 * MiB)
        os.write(streamed, unseen)
        piece = os.urandom(64 << 10)
        os.write(other, piece)  # far from full: the bound says yes
        assert _passthrough(m)["unseen_sums"] == 0
        written = len(piece)
        with pytest.raises(OSError) as exc:
            while written < free_before + 4 * MiB:
                written += os.write(other, piece)
        assert exc.value.errno == errno.ENOSPC
        assert written <= free_before - len(unseen) + len(piece), (written, free_before)
        assert _passthrough(m)["unseen_sums"] > 0
    finally:
        os.close(streamed)
        os.close(other)
    assert (d / "w").read_bytes() == unseen
    assert (m.path / "g").read_bytes() == piece * (written // len(piece))
