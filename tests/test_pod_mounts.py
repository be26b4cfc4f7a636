"""The pod tier end to end (issue 35): a mooncake_master and kvfs mounts (daemons of their
own, DRAM and NVMe tiers of their own) on loopback, all started and always stopped here. A
file one mount writes is read on the others through plain syscalls."""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

try:
    import mooncake.store  # noqa: F401

    MOONCAKE = None
except ImportError as e:
    MOONCAKE = f"Mooncake's client does not import (pip install '.[pod]'): {e}"
pytestmark = pytest.mark.skipif(MOONCAKE is not None, reason=MOONCAKE or "")

ROOT = Path(__file__).resolve().parents[1]
MEMBER = ROOT / "tests" / "store" / "pod_member.py"
POD_NAME = "test"  # (the name tests/store/pod_member.py publishes under)
# How long something the test waits for (a publication, a cache expiring, a reconnect) may
# take before the test calls it a hang. Not a speed goal.
WAIT_S = 60.0
# How long one lookup may take before the test calls it a hang: lookups give up after
# pod_timeout (50 ms); this only catches one stuck in Mooncake (~4 s with a dead master).
HANG_S = 2.0


def kv_bytes(n: int, seed: int) -> bytes:
    """fp16 values like a KV block's (compressible: records are encoded)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, n // 2).astype(np.float16).tobytes() + b"\x07" * (n % 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """mooncake_master on loopback ports of its own; kill() and start() again keep them."""

    def __init__(self, log: Path) -> None:
        import mooncake

        binary = Path(mooncake.__file__).with_name("mooncake_master")
        self.port, self.metrics_port = free_port(), free_port()
        self.cmd = [str(binary) if binary.exists() else shutil.which("mooncake_master") or "",
                    "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                    "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"]
        self.address = f"127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log)
        deadline = time.monotonic() + WAIT_S
        while True:
            assert self.proc.poll() is None, f"mooncake_master exited: see {self.log}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "mooncake_master did not listen"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


@pytest.fixture
def master(tmp_path):
    m = Master(tmp_path / "master.log")
    m.start()
    yield m
    m.kill()


@pytest.fixture
def pod(master, mount_factory):
    """pod(n): n kvfs mounts joined to the master (unmounted by mount_factory)."""
    def make(n: int = 3) -> list:
        # the last one joins by the command line's flags, the others by -o
        return [mount_factory(**({"pod": master.address, "pod_name": POD_NAME} if i < n - 1
                                 else {}),
                              flags=["--pod", master.address, "--pod-name", POD_NAME]
                              if i == n - 1 else None,
                              pod_segment_size="16M",
                              pod_metrics=f"127.0.0.1:{master.metrics_port}")
                for i in range(n)]

    return make


def until(what, description: str, timeout: float = WAIT_S):
    """what()'s first true answer, polling; fails after *timeout* (a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, f"never happened: {description}"
        time.sleep(0.05)


def read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def published(m, n: int) -> bool:
    return m.status()["pod"]["published_files"] >= n


def test_a_file_written_on_one_mount_is_read_on_the_others(pod) -> None:
    a, b, c = pod(3)
    for m in (a, b, c):
        (m.path / "blocks").mkdir()
    data = kv_bytes(5 * (64 << 10) + 123, 1)
    (a.path / "blocks" / "k1.bin").write_bytes(data)
    with open(a.path / "sparse.bin", "wb") as f:  # a hole between two chunks
        f.write(b"x" * 1000)
        f.seek(3 * (64 << 10))
        f.write(b"y" * 1000)
    sparse = (a.path / "sparse.bin").read_bytes()
    until(lambda: published(a, 2), "A published both files")
    # readdir lists local entries only
    assert os.listdir(c.path / "blocks") == []
    st = os.stat(c.path / "blocks" / "k1.bin")  # a lookup: the file appears, not fetched
    assert st.st_size == len(data)
    assert c.tiers("blocks/k1.bin") == {"pod"}
    assert os.listdir(c.path / "blocks") == ["k1.bin"]
    for m in (b, c):
        assert (m.path / "blocks" / "k1.bin").read_bytes() == data
        assert (m.path / "sparse.bin").read_bytes() == sparse
        assert "pod" not in m.tiers("blocks/k1.bin")
        # sealed with the records' checksums: a write-back checks the DRAM bytes against them
        fd = os.open(m.path / "blocks" / "k1.bin", os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        st = m.status()
        assert st["reads"]["checksum_errors"] == 0
        assert st["reads"]["chunks_from_pod"] == 6 + 2
        assert st["pod"]["hits"] >= 2 and st["pod"]["damaged"] == 0
    until(lambda: b.status()["pod"]["members"] == 3, "the master counts 3 members")
    # a file of the pod written over here (O_TRUNC) is not fetched first
    (a.path / "over.bin").write_bytes(data)
    until(lambda: published(a, 3), "A published over.bin")
    with open(b.path / "over.bin", "wb") as f:
        f.write(b"mine")
    assert (b.path / "over.bin").read_bytes() == b"mine"
    assert b.status()["reads"]["chunks_from_pod"] == 6 + 2
    # A's own files are local: nothing of them was fetched there
    assert a.status()["reads"]["chunks_from_pod"] == 0


def test_a_temp_file_renamed_into_place_is_published_under_its_new_name_only(pod) -> None:
    a, b = pod(2)
    data = kv_bytes(200_000, 2)
    tmp, final = a.path / ".k2.bin.tmp", a.path / "k2.bin"
    tmp.write_bytes(data)
    os.rename(tmp, final)
    assert until(lambda: read_or_none(b.path / "k2.bin"), "B reads k2.bin") == data
    assert not (b.path / ".k2.bin.tmp").exists()
    assert a.status()["pod"]["published_files"] == 1


def test_a_file_on_nvme_renamed_into_place_is_published_from_there(pod) -> None:
    a, b = pod(2)
    data = kv_bytes(300_000, 3)
    (a.path / "cold.tmp").write_bytes(data)
    a.unmount()  # written back; with DRAM lost, on NVMe only
    a.lose_dram()
    a.start()
    assert a.tiers("cold.tmp") == {"nvme"}
    os.rename(a.path / "cold.tmp", a.path / "cold.bin")
    assert until(lambda: read_or_none(b.path / "cold.bin"), "B reads cold.bin") == data
    assert a.tiers("cold.bin") == {"nvme"}  # its records were published as stored


def test_a_file_found_in_the_pod_but_not_fetched_is_gone_after_a_crash(pod) -> None:
    """Its inode has a size and no chunks: after a restart it must not read as zeros."""
    a, b = pod(2)
    data = kv_bytes(200_000, 8)
    (a.path / "k.bin").write_bytes(data)
    until(lambda: published(a, 1), "A published k.bin")
    assert os.stat(b.path / "k.bin").st_size == len(data)  # found, not fetched
    b.kill()
    b.start()
    assert os.listdir(b.path) == []
    assert b.status()["files"] == 0
    # found again (once the master let go of B's dead member: a copy was in its memory)
    assert until(lambda: read_or_none(b.path / "k.bin"), "B reads k.bin again") == data


def test_a_file_is_read_on_the_others_after_its_writer_was_killed(pod) -> None:
    a, b, c = pod(3)
    files = {f"k{i}.bin": kv_bytes(100_000 + i, 10 + i) for i in range(4)}
    for name, data in files.items():
        (a.path / name).write_bytes(data)
    until(lambda: published(a, len(files)), "A published its files")
    a.kill()
    # (each object has a copy in another member's memory, -o pod_replicas=2; for the master's
    # client_ttl, 10 s, a read may still try A's copy and miss)
    for m in (b, c):
        for name, data in files.items():
            assert until(lambda: read_or_none(m.path / name), f"{name} read") == data  # noqa: B023


def test_a_rewritten_file_reaches_the_others_once_their_caches_expire(pod) -> None:
    a, b = pod(2)
    old, new = kv_bytes(150_000, 4), kv_bytes(90_000, 5)
    (a.path / "k.bin").write_bytes(old)
    assert until(lambda: read_or_none(b.path / "k.bin"), "B reads k.bin") == old
    (a.path / "k.bin").write_bytes(new)  # O_TRUNC: a new mtime, a new version

    def seen() -> bytes:
        got = read_or_none(b.path / "k.bin")
        assert got in (old, new, None)  # never a mix
        return got == new

    until(seen, "B reads the new k.bin")
    assert os.stat(b.path / "k.bin").st_size == len(new)


def test_with_the_master_dead_lookups_miss_local_files_read_and_publishing_resumes(
        pod, master) -> None:
    a, b = pod(2)
    data = kv_bytes(100_000, 6)
    (b.path / "local.bin").write_bytes(data)
    (a.path / "before.bin").write_bytes(data)
    assert until(lambda: read_or_none(b.path / "before.bin"), "B reads before.bin") == data
    master.kill()
    for i in range(20):
        t0 = time.monotonic()
        with pytest.raises(FileNotFoundError):
            os.stat(b.path / f"absent{i}.bin")
        assert time.monotonic() - t0 < HANG_S
    assert (b.path / "local.bin").read_bytes() == data
    assert (b.path / "before.bin").read_bytes() == data  # fetched: local now
    assert b.status()["pod"]["timeouts"] + b.status()["pod"]["errors"] > 0
    # files closed while the pod is away are kept, and published once it is back
    during = [kv_bytes(50_000, 60 + i) for i in range(3)]
    for i, d in enumerate(during):
        (a.path / f"during{i}.bin").write_bytes(d)
    until(lambda: a.status()["pod"]["unpublished"] == 3, "A keeps the 3 files for later")
    assert not a.status()["pod"]["up"]
    master.start()  # an empty pod: the members reconnect by themselves
    for i, d in enumerate(during):
        assert until(lambda i=i: read_or_none(b.path / f"during{i}.bin"),
                     f"B reads during{i}.bin") == d
    assert a.status()["pod"]["unpublished"] == 0 and a.status()["pod"]["up"]
    # a mount leaves a dead master's pod at once (Mooncake's close and its client's
    # destructor retry for ~11 s each)
    master.kill()
    t0 = time.monotonic()
    a.unmount()
    assert time.monotonic() - t0 < 3 * HANG_S


def test_a_damaged_remote_object_reads_as_a_miss(pod, master, tmp_path) -> None:
    (b,) = pod(1)
    src = tmp_path / "src.bin"
    src.write_bytes(kv_bytes(3 * (64 << 10), 7))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    with open(tmp_path / "member.log", "ab") as err:
        member = subprocess.Popen([sys.executable, str(MEMBER), master.address, POD_NAME, "w1"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                  env=env, text=True)
    try:
        def answer() -> dict:
            ready, _, _ = select.select([member.stdout], [], [], 60)
            assert ready, "the pod member answered nothing"
            return json.loads(member.stdout.readline())

        def ask(**cmd) -> dict:
            member.stdin.write(json.dumps(cmd) + "\n")
            member.stdin.flush()
            return answer()

        assert answer()["ready"]
        assert ask(op="publish", path="bad.bin", src=str(src), version=1, damage=True,
                   wait=True)["queued"]
        assert ask(op="publish", path="bad2.bin", src=str(src), version=1, damage=True,
                   wait=True)["queued"]
        assert ask(op="publish", path="good.bin", src=str(src), version=1, wait=True)["queued"]
        assert (b.path / "good.bin").read_bytes() == src.read_bytes()
        for name in ("bad.bin", "bad2.bin"):
            os.stat(b.path / name)  # its head is fine: it appears
            with pytest.raises(OSError) as e:
                (b.path / name).read_bytes()
            assert e.value.errno == errno.ENOENT
        # and a miss it stays
        assert not (b.path / "bad.bin").exists()
        # an engine that found no block computes and writes it at once
        (b.path / "bad2.bin").write_bytes(b"computed here")
        assert (b.path / "bad2.bin").read_bytes() == b"computed here"
        st = b.status()
        assert st["pod"]["damaged"] == 2
        assert st["reads"]["chunks_from_pod"] == 3
    finally:
        member.stdin.close()
        try:
            member.wait(timeout=20)
        except subprocess.TimeoutExpired:
            member.kill()
            member.wait()
