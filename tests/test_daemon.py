"""Start-up and shut-down: bad input gets one clear message and touches nothing; every way
of mounting (kvfs mount, mount.kvfs, mount -t fuse.kvfs, fstab) works."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from kvfs.store.dram import remove_dram_dir

KVFS = [sys.executable, "-m", "kvfs"]


def _run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


@pytest.fixture
def dirs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    dram = f"/dev/shm/kvfs-test-{uuid.uuid4().hex[:12]}"
    yield mnt, dram, tmp_path / "nvme"
    subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
    remove_dram_dir(dram)


@pytest.mark.parametrize("extra, message", [
    (["-o", "bogus=1"], "unknown option 'bogus'"),
    (["--dram-size", "lots"], "not a size"),
    (["--chunk-size", "3000"], "power of two"),
    (["--dram-size", "150%"], "percentage"),
    (["-o", "dram_high_watermark=2"], "watermark"),
    (["--nvme-size", "1M"], "at least 8 segments"),
    (["-o", "dram_verify=never"], "dram_verify must be once, open or ingest"),
    (["-o", "read_through_min=big"], "read_through_min"),
    (["-o", "fast_open_files=0"], "fast_open_files must be between 1 and 16384"),
    (["-o", "fast_open_files=20000"], "fast_open_files must be between 1 and 16384"),
])
def test_bad_options(dirs, extra, message):
    mnt, dram, nvme = dirs
    r = _run(KVFS + ["mount", str(mnt), "--dram-dir", dram, "--nvme-dir", str(nvme),
                     "--dram-size", "8M", "--nvme-size", "1G"] + extra)
    assert r.returncode != 0
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not os.path.exists(nvme) and not os.path.exists(dram)


def test_bad_paths(dirs, tmp_path):
    mnt, dram, nvme = dirs
    base = KVFS + ["mount", "--dram-size", "8M", "--nvme-size", "1G"]
    cases = [
        ([str(tmp_path / "nope"), "--dram-dir", dram, "--nvme-dir", str(nvme)], "does not exist"),
        ([str(tmp_path / "file"), "--dram-dir", dram, "--nvme-dir", str(nvme)],
         "not a directory"),
        ([str(mnt), "--dram-dir", str(tmp_path / "notmpfs"), "--nvme-dir", str(nvme)],
         "not on tmpfs"),
        ([str(mnt), "--dram-dir", dram, "--nvme-dir", str(tmp_path / "file")],
         "not a directory"),
    ]
    (tmp_path / "file").write_text("x")
    for args, message in cases:
        r = _run(base + args)
        assert r.returncode != 0
        assert message in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(nvme)


def _mounted(path) -> bool:
    """(os.path.ismount says False for a dead FUSE mount: its stat fails.)"""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == os.path.realpath(path) for line in f)


def test_a_dead_mount_is_named_as_such_and_umount_clears_it(dirs):
    mnt, dram, nvme = dirs
    mount = KVFS + ["mount", str(mnt), "--dram-dir", dram, "--nvme-dir", str(nvme),
                    "--dram-size", "8M", "--nvme-size", "256M"]
    assert _run(mount).returncode == 0
    (mnt / "kept").write_bytes(b"written before the crash")
    os.kill(int((nvme / "lock").read_text()), signal.SIGKILL)
    for _ in range(200):
        try:
            os.stat(mnt)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                break
        time.sleep(0.02)
    r = _run(mount)
    assert r.returncode != 0
    assert "is a dead kvfs mount" in r.stderr and f"kvfs umount {mnt}" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _run(KVFS + ["umount", str(mnt)])
    assert r.returncode == 0, r.stderr
    assert "dead mount" in r.stderr
    assert not _mounted(mnt)
    assert _run(mount).returncode == 0
    assert (mnt / "kept").read_bytes() == b"written before the crash"
    assert _run(KVFS + ["umount", str(mnt)]).returncode == 0


def test_a_segment_the_daemon_may_not_open_is_named(dirs):
    mnt, dram, nvme = dirs
    mount = KVFS + ["mount", str(mnt), "--dram-dir", dram, "--nvme-dir", str(nvme),
                    "--dram-size", "8M", "--nvme-size", "256M"]
    assert _run(mount).returncode == 0
    (mnt / "x").write_bytes(os.urandom(3 << 20))
    assert _run(KVFS + ["umount", str(mnt)]).returncode == 0
    segment = sorted((nvme / "segments").iterdir())[0]
    if _run(["chattr", "+i", str(segment)]).returncode != 0:  # (even root may not write it)
        pytest.skip("no immutable files on this filesystem")
    try:
        r = _run(mount)
    finally:
        _run(["chattr", "-i", str(segment)])
    assert r.returncode != 0
    assert f"{segment}: Operation not permitted" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not _mounted(mnt)


def test_mount_helper_and_umount(dirs):
    mnt, dram, nvme = dirs
    r = _run([sys.executable, "-m", "kvfs.cli.mount_helper", "kvfs", str(mnt), "-o",
              f"rw,nofail,dram_dir={dram},dram_size=8M,nvme_dir={nvme},nvme_size=256M,"
              "chunk_size=256K"])
    assert r.returncode == 0, r.stderr
    assert os.path.ismount(mnt)
    (mnt / "x").write_bytes(b"hello")
    assert (mnt / "x").read_bytes() == b"hello"
    r = _run(KVFS + ["umount", str(mnt)])
    assert r.returncode == 0, r.stderr
    assert not os.path.ismount(mnt)
    # chunk_size is fixed at creation
    r = _run(KVFS + ["mount", str(mnt), "--dram-dir", dram, "--nvme-dir", str(nvme),
                     "--dram-size", "8M", "--nvme-size", "256M", "--chunk-size", "1M"])
    assert r.returncode != 0 and "chunk_size" in r.stderr


@pytest.mark.skipif(not os.path.exists("/sbin/mount.fuse.kvfs"),
                    reason="mount.kvfs helpers not installed (tools/install.sh)")
def test_mount_t_fuse_kvfs_and_fstab(dirs, tmp_path):
    mnt, dram, nvme = dirs
    opts = f"dram_dir={dram},dram_size=8M,nvme_dir={nvme},nvme_size=256M"
    r = _run(["mount", "-t", "fuse.kvfs", "kvfs", str(mnt), "-o", opts])
    assert r.returncode == 0, r.stderr
    assert os.path.ismount(mnt)
    (mnt / "y").write_bytes(b"via mount(8)")
    r = _run(["umount", str(mnt)])
    assert r.returncode == 0, r.stderr
    # fstab: a line in an alternative fstab file, mounted by mountpoint
    fstab = tmp_path / "fstab"
    fstab.write_text(f"kvfs {mnt} fuse.kvfs {opts},nofail 0 0\n")
    r = _run(["mount", "-T", str(fstab), str(mnt)])
    assert r.returncode == 0, r.stderr
    assert (mnt / "y").read_bytes() == b"via mount(8)"
    subprocess.run(KVFS + ["umount", str(mnt)], check=True, timeout=60)


def test_foreground_sigterm_unmounts(dirs):
    mnt, dram, nvme = dirs
    p = subprocess.Popen(KVFS + ["mount", str(mnt), "--foreground", "--dram-dir", dram,
                                 "--nvme-dir", str(nvme), "--dram-size", "8M",
                                 "--nvme-size", "256M"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import time

        for _ in range(200):
            if os.path.ismount(mnt):
                break
            time.sleep(0.05)
        assert os.path.ismount(mnt)
        (mnt / "z").write_bytes(b"z" * 100_000)
        p.terminate()
        assert p.wait(timeout=30) == 0
        assert not os.path.ismount(mnt)
    finally:
        if p.poll() is None:
            p.kill()


def test_dram_tier_gets_a_huge_page_tmpfs_of_its_own(mount_factory):
    """An empty DRAM directory becomes a tmpfs of its own with transparent huge pages, sized
    twice the tier; a directory that holds a DRAM tier already is never mounted over."""
    m = mount_factory(dram_size="8M", dram_huge="1")
    with open("/proc/self/mountinfo") as f:
        line = next(ln for ln in f if ln.split()[4] == str(m.dram_dir))
    assert " tmpfs kvfs-dram " in line and "huge=within_size" in line, line
    assert "size=16384k" in line, line
    m.unmount()
    m.start()  # a mount already: kept, with what it holds
    assert "is a mount already" in m.log()
    m.unmount()
    other = mount_factory(start=False, dram_huge="1")
    other.dram_dir.mkdir()
    (other.dram_dir / "something").write_text("kept")
    other.start()
    assert "no huge-page tmpfs mounted over it" in other.log()
    assert not os.path.ismount(other.dram_dir)


@pytest.mark.parametrize("soft, hard", [(1024, None), (400, 400)])
def test_more_files_than_the_open_files_limit(mount_factory, soft, hard):
    """Every DRAM file and NVMe segment holds a descriptor. Started under systemd's soft limit
    of 1,024 the daemon raises it; under a hard limit it keeps fewer DRAM files open. Either
    way every create succeeds (it failed with EMFILE after ~1,000 files) and every byte
    comes back."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    m = mount_factory(start=False)
    m.start(preexec=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard or before[1])))
    limits = open(f"/proc/{m.pid()}/limits").read()
    line = next(ln for ln in limits.splitlines() if ln.startswith("Max open files"))
    if hard is None:
        assert int(line.split()[3]) == before[1]  # soft raised to the hard limit
    n = 1300
    blobs = [os.urandom(1024) + i.to_bytes(4, "little") for i in range(n)]
    for i, blob in enumerate(blobs):
        (m.path / f"f{i}").write_bytes(blob)
    assert all((m.path / f"f{i}").read_bytes() == blob for i, blob in enumerate(blobs))
    assert len(os.listdir(f"/proc/{m.pid()}/fd")) < (hard or before[1])
    assert "Too many open files" not in m.log()
