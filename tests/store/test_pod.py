"""The pod tier's room (kvfs/store/pod.py): its object format, and two members in processes of
their own sharing files through a real mooncake_master on loopback (started and always
stopped here)."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvfs.config import ConfigError, Settings, apply_options
from kvfs.store.codec import Codec
from kvfs.store.location import hash_bytes
from kvfs.store.pod import (
    Landing,
    LandingCancelled,
    PodHead,
    PodObjectError,
    decode_data,
    decode_head,
    encode_head,
    records_of,
)

try:
    import mooncake.store  # noqa: F401

    MOONCAKE = None
except ImportError as e:
    MOONCAKE = f"Mooncake's client does not import (pip install '.[pod]'): {e}"
needs_mooncake = pytest.mark.skipif(MOONCAKE is not None, reason=MOONCAKE or "")

MEMBER = Path(__file__).with_name("pod_member.py")
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 << 10
# How long any one answer may take before the test calls it a hang (not a speed goal:
# lookups must give up within pod_timeout, 50 ms here; this only catches a call stuck in
# Mooncake, which holds one ~4 s while the master is away).
HANG_S = 2.0


def kv_bytes(n: int, seed: int) -> bytes:
    """fp16 values like a KV block's (compressible planes, so records are encoded)."""
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, n // 2).astype(np.float16).tobytes() + b"\x07" * (n % 2)


# -- the object format (no Mooncake needed) ------------------------------------------------

def published(data: bytes, path: str = "dir/a.bin") -> tuple[PodHead, bytes]:
    records = records_of(data, CHUNK, Codec(), "fp16")
    entries, off = [], 0
    for c, rec in records:
        entries.append((c, off, len(rec)))
        off += len(rec)
    head = PodHead(path, "m1", 7, 0o100644, len(data), 123, CHUNK, tuple(entries))
    return head, b"".join(rec for _, rec in records)


def test_a_head_and_its_data_decode_to_the_file() -> None:
    data = kv_bytes(3 * CHUNK + 1001, 1)
    head, blob = published(data)
    got = decode_head(encode_head(head), head.path)
    assert got == head
    assert decode_data(got, blob, Codec()).data() == data
    assert len(blob) < len(data)  # the records are the encoded ones


def test_data_decoded_into_a_landing_is_the_file_with_the_checksums_of_its_bytes(
        tmp_path) -> None:
    # chunk 0 stored short of the chunk size (its tail zeros: a sparse write), the last
    # chunk short of the chunk size (the file's end)
    data = b"x" * 1000 + bytes(CHUNK - 1000) + kv_bytes(CHUNK + 777, 4)
    head, _ = published(data)
    records = records_of(b"x" * 1000, CHUNK, Codec()) + records_of(data, CHUNK, Codec())[1:]
    entries, off = [], 0
    for c, rec in records:
        entries.append((c, off, len(rec)))
        off += len(rec)
    head = dataclasses.replace(head, entries=tuple(entries))
    blob = b"".join(rec for _, rec in records)
    with open(tmp_path / "dram", "w+b") as f:
        got = decode_data(head, blob, Codec(), landing=Landing(f.fileno()))
        assert f.read() == data
    assert not got.chunks
    assert got.checksums == {c: hash_bytes(data[c * CHUNK:(c + 1) * CHUNK]) for c in (0, 1, 2)}
    cancelled = Landing(os.open(tmp_path / "dram", os.O_RDWR))
    cancelled.cancel()
    with pytest.raises(LandingCancelled):
        decode_data(head, blob, Codec(), landing=cancelled)
    os.close(cancelled.fd)


def test_a_damaged_head_is_refused() -> None:
    head, _ = published(kv_bytes(2 * CHUNK, 2))
    raw = encode_head(head)
    for i in range(0, len(raw), 7):
        bad = bytearray(raw)
        bad[i] ^= 0x10
        with pytest.raises(PodObjectError):
            decode_head(bytes(bad), head.path)
    with pytest.raises(PodObjectError):
        decode_head(raw[:-1], head.path)
    with pytest.raises(PodObjectError, match="another file"):
        decode_head(raw, "dir/b.bin")


def test_damaged_data_is_refused_never_partly_returned() -> None:
    data = kv_bytes(2 * CHUNK + 100, 3)
    head, blob = published(data)
    codec = Codec()
    for i in list(range(0, 64, 5)) + list(range(64, len(blob), 997)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(PodObjectError):
            decode_data(head, bytes(bad), codec)
    with pytest.raises(PodObjectError):
        decode_data(head, blob[:-1], codec)
    # a record put in another chunk's place
    (c0, o0, l0), (c1, o1, l1) = head.entries[:2]
    swapped = dataclasses.replace(head, entries=((c1, o0, l0), (c0, o1, l1)) + head.entries[2:])
    with pytest.raises(PodObjectError):
        decode_data(swapped, blob, codec)


def test_pod_options_are_parsed_and_checked() -> None:
    s = Settings(nvme_dir="/tmp", dram_size="1G", nvme_size="1G")
    apply_options(s, "pod=127.0.0.1:50051,pod_name=rack-2,pod_timeout=20ms,pod_segment_size=10%")
    r = s.resolve()
    assert (r.pod, r.pod_name, r.pod_timeout, r.pod_segment_size) == (
        "127.0.0.1:50051", "rack-2", 0.02, (1 << 30) // 10)
    d = Settings(nvme_dir="/tmp", dram_size="1G", nvme_size="1G").resolve()
    assert (d.pod, d.pod_timeout, d.pod_segment_size) == ("", 0.05, 1 << 28)
    for bad in ("pod=nohost", "pod=h:0", "pod_timeout=0", "pod_timeout=soon", "pod_name=a/b",
                "pod=h:1,pod_segment_size=1M"):
        s = Settings(nvme_dir="/tmp", dram_size="1G", nvme_size="1G")
        with pytest.raises(ConfigError):
            apply_options(s, bad)
            s.resolve()


# -- members and a master ------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master:
    """mooncake_master on loopback ports of its own; kill() and start() again keep them."""

    def __init__(self, log: Path) -> None:
        import mooncake

        binary = Path(mooncake.__file__).with_name("mooncake_master")
        self.cmd = [str(binary) if binary.exists() else shutil.which("mooncake_master") or "",
                    "--rpc_address=127.0.0.1", f"--rpc_port={free_port()}",
                    "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"]
        self.address = f"127.0.0.1:{self.cmd[2].split('=')[1]}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log)
        host, port = self.address.split(":")
        deadline = time.monotonic() + 30
        while True:
            assert self.proc.poll() is None, f"mooncake_master exited: see {self.log}"
            try:
                socket.create_connection((host, int(port)), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "mooncake_master did not listen in 30 s"
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


class Member:
    """A Pod in a process of its own (tests/store/pod_member.py)."""

    def __init__(self, master: Master, name: str, log: Path) -> None:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.log = log
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(MEMBER), master.address, "test", name],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        assert self._answer(60)["ready"]

    def _answer(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"pod member answered nothing in {timeout} s: see {self.log}"
        line = self.proc.stdout.readline()
        assert line, f"pod member exited: see {self.log}"
        return json.loads(line)

    def ask(self, timeout: float = 60, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout)

    def status(self) -> dict:
        return self.ask(op="status")["status"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()


@pytest.fixture
def pod(tmp_path):
    """A master and two members, a and b; everything is stopped at the end."""
    master = Master(tmp_path / "master.log")
    members: list[Member] = []
    try:
        master.start()
        for name in ("a", "b"):
            members.append(Member(master, name, tmp_path / f"{name}.log"))
        yield master, members[0], members[1]
    finally:
        for m in members:
            m.stop()
        master.kill()


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def read_on(member: Member, tmp_path: Path, path: str) -> bytes | None:
    dst = tmp_path / "fetched"
    dst.unlink(missing_ok=True)
    got = member.ask(op="read", path=path, dst=str(dst))
    assert got["seconds"] < HANG_S
    return dst.read_bytes() if got["hit"] else None


@needs_mooncake
def test_a_file_published_on_one_member_reads_byte_identical_on_another(pod, tmp_path) -> None:
    _, a, b = pod
    files = {"small.bin": kv_bytes(10_000, 1), "four.bin": kv_bytes(4 << 20, 2) + b"x",
             "empty.bin": b"", "dir/odd name.bin": os.urandom(3 * CHUNK + 17)}
    for i, (path, data) in enumerate(files.items()):
        done = a.ask(op="publish", path=path, src=write(tmp_path, f"src{i}", data), version=1)
        assert done["queued"]
    assert a.status()["published_files"] == len(files)
    for path, data in files.items():
        assert read_on(b, tmp_path, path) == data
    st = b.status()
    assert st["hits"] == len(files) and st["damaged"] == 0
    assert st["fetched_bytes"] > 0 and st["members"] in (2, None)


@needs_mooncake
def test_a_rewritten_file_reads_new_once_the_caches_expire(pod, tmp_path) -> None:
    _, a, b = pod
    old, new = kv_bytes(CHUNK + 5, 1), kv_bytes(2 * CHUNK, 2)
    a.ask(op="publish", path="f.bin", src=write(tmp_path, "old", old), version=1)
    assert read_on(b, tmp_path, "f.bin") == old
    a.ask(op="publish", path="f.bin", src=write(tmp_path, "new", new), version=2)
    time.sleep(0.3)  # the members' hit_ttl is 0.2 s
    assert read_on(b, tmp_path, "f.bin") == new


@needs_mooncake
def test_unknown_names_miss_and_misses_are_remembered(pod, tmp_path) -> None:
    _, _, b = pod
    for i in range(20):
        assert read_on(b, tmp_path, f"nobody/{i % 5}.bin") is None
    st = b.status()
    assert st["misses"] == 20 and st["hits"] == 0 and st["errors"] == 0
    assert st["lookup_p99_us"] > 0


@needs_mooncake
def test_a_damaged_object_reads_as_a_miss(pod, tmp_path) -> None:
    _, a, b = pod
    data = kv_bytes(3 * CHUNK, 4)
    a.ask(op="publish", path="bad.bin", src=write(tmp_path, "bad", data), version=1, damage=True)
    assert read_on(b, tmp_path, "bad.bin") is None
    assert b.status()["damaged"] == 1


@needs_mooncake
def test_a_dead_master_makes_misses_in_time_and_publishing_resumes(pod, tmp_path) -> None:
    master, a, b = pod
    data = kv_bytes(2 * CHUNK, 5)
    a.ask(op="publish", path="before.bin", src=write(tmp_path, "before", data), version=1)
    assert read_on(b, tmp_path, "before.bin") == data
    master.kill()
    # Every lookup answers (a miss) within the timeout, while Mooncake's own calls hang
    # for seconds; publishing neither waits nor fails the caller.
    for i in range(30):
        assert read_on(b, tmp_path, f"unknown{i}.bin") is None
        a.ask(op="publish", path=f"during{i}.bin", src=write(tmp_path, "d", data), version=1,
              wait=False)
    assert b.status()["timeouts"] + b.status()["errors"] > 0
    assert a.status()["dropped"] + a.status()["errors"] > 0
    master.start()
    # The members reconnect by themselves; the restarted master knows no object, so
    # publishing again is what brings files back.
    fresh = kv_bytes(CHUNK + 3, 6)
    deadline = time.monotonic() + 60
    while True:
        a.ask(op="publish", path="after.bin", src=write(tmp_path, "after", fresh), version=2)
        got = read_on(b, tmp_path, "after.bin")
        if got is not None:
            break
        assert time.monotonic() < deadline, "publishing did not resume within 60 s"
        time.sleep(0.5)
    assert got == fresh
