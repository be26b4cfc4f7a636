"""The pod tier under network faults (issue 35): what tc netem on loopback would have tried,
with what this kernel has (no netem; the host's loopback is shared and never touched).

- an unresponsive master: SIGSTOP (its port still takes connections, nothing answers);
- an unresponsive member holding a replica: a bare Mooncake member (tests/store/pod_member.py)
  SIGSTOPped while a mount fetches;
- a partition: the master and the kvfs daemons in a network namespace of their own whose
  loopback is taken down and up again (the mounts are in the test's mount namespace, so the
  test still reaches them).

Timing bounds here are hang detectors (seconds), not speed goals. docs/DESIGN.md, Pod tier."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import test_pod_mounts as pm
from test_pod_mounts import HANG_S, MOONCAKE, kv_bytes, read_or_none, until

pytestmark = pytest.mark.skipif(MOONCAKE is not None, reason=MOONCAKE or "")
# (fixtures: a mooncake_master on loopback, and pod(n) mounts joined to it)
master, pod = pm.master, pm.pod


@contextlib.contextmanager
def stopped(proc: subprocess.Popen):
    """*proc* SIGSTOPped for the block (and always continued)."""
    proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        proc.send_signal(signal.SIGCONT)


def absent(path: Path) -> float:
    """Seconds a stat of *path* took to answer ENOENT (it must)."""
    t0 = time.monotonic()
    with pytest.raises(FileNotFoundError):
        os.stat(path)
    return time.monotonic() - t0


def test_an_unresponsive_master(pod, master) -> None:
    a, b = pod(2)
    data = kv_bytes(100_000, 20)
    (b.path / "local.bin").write_bytes(data)
    (a.path / "before.bin").write_bytes(data)
    assert until(lambda: read_or_none(b.path / "before.bin"), "B reads before.bin") == data
    with stopped(master.proc):
        for i in range(10):
            assert absent(b.path / f"absent{i}.bin") < HANG_S
        # local data is not slowed down to the pod's pace; the FUSE loop keeps serving
        # while a lookup waits on the pod
        misses = threading.Thread(target=lambda: [
            read_or_none(b.path / f"gone{i}.bin") for i in range(20)])
        misses.start()
        (b.path / "local.bin").stat()
        assert (b.path / "local.bin").read_bytes() == data
        assert (b.path / "before.bin").read_bytes() == data
        misses.join(timeout=20 * HANG_S)
        assert not misses.is_alive()
        # files written while the master does not answer
        during = [kv_bytes(50_000, 30 + i) for i in range(3)]
        for i, d in enumerate(during):
            (a.path / f"during{i}.bin").write_bytes(d)
    for i, d in enumerate(during):
        assert until(lambda i=i: read_or_none(b.path / f"during{i}.bin"),
                     f"B reads during{i}.bin") == d
    with stopped(master.proc):
        t0 = time.monotonic()
        a.unmount()
        assert time.monotonic() - t0 < 3 * HANG_S


class Member:
    """A bare pod member (tests/store/pod_member.py) in a process of its own: its memory
    holds replicas, and it can be stopped without stopping a FUSE daemon."""

    def __init__(self, master_address: str, name: str, log: Path) -> None:
        env = dict(os.environ,
                   PYTHONPATH=f"{pm.ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(pm.MEMBER), master_address, pm.POD_NAME, name],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        assert self.answer()["ready"]

    def answer(self) -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], pm.WAIT_S)
        assert ready, "the pod member answered nothing"
        return json.loads(self.proc.stdout.readline())

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_an_unresponsive_member_holding_replicas(pod, master, tmp_path) -> None:
    a, b = pod(2)
    member = Member(master.address, "w1", tmp_path / "member.log")
    try:
        files = {}
        for i in range(6):  # 2 copies each in 3 members' memory: most have one in w1's
            files[f"m{i}.bin"] = src = tmp_path / f"m{i}.bin"
            src.write_bytes(kv_bytes(2 * (64 << 10) + i, 40 + i))
            assert member.ask(op="publish", path=f"m{i}.bin", src=str(src), version=1)["queued"]
        local = kv_bytes(70_000, 50)
        (b.path / "local.bin").write_bytes(local)
        late = kv_bytes(60_000, 51)
        with stopped(member.proc):
            for name, src in files.items():
                t0 = time.monotonic()
                got = read_or_none(b.path / name)  # the other copy, or a miss
                assert time.monotonic() - t0 < HANG_S
                assert got in (src.read_bytes(), None)
                assert (b.path / "local.bin").read_bytes() == local
            (a.path / "late.bin").write_bytes(late)  # published with w1 stopped
            assert absent(b.path / "nobody.bin") < HANG_S
        for name, src in files.items():
            assert until(lambda n=name: read_or_none(b.path / n), f"B reads {name}") == (
                src.read_bytes())
        assert until(lambda: read_or_none(b.path / "late.bin"), "B reads late.bin") == late
        with stopped(member.proc):
            assert absent(b.path / "nobody2.bin") < HANG_S
            t0 = time.monotonic()
            b.unmount()
            assert time.monotonic() - t0 < 3 * HANG_S
    finally:
        member.close()


CLONE_NEWNET = 0x40000000
NETNS = (None if shutil.which("unshare") and shutil.which("ip")
         else "a partition needs unshare and ip (util-linux, iproute2)")


class Netns:
    """A network namespace of its own (held by a sleeping process) whose loopback the test
    takes down and up: a partition of everything in it, the host's loopback untouched."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "3600"])
        self.path = f"/proc/{self.holder.pid}/ns/net"
        until(lambda: os.readlink(self.path) != os.readlink("/proc/self/ns/net"),
              "unshare made a network namespace")
        self.link("up")

    def link(self, state: str) -> None:
        subprocess.run(["nsenter", f"--net={self.path}", "ip", "link", "set", "lo", state],
                       check=True)

    def enter(self) -> None:
        """(In a child before exec, or a thread of the test's own: setns is per thread.)"""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns")
        finally:
            os.close(fd)

    def call(self, fn):
        """fn() in a thread inside the namespace."""
        out: list = []

        def run() -> None:
            self.enter()
            out.append(fn())

        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert out, "the call in the namespace failed"
        return out[0]

    def close(self) -> None:
        self.holder.kill()
        self.holder.wait()


class NetnsMaster(pm.Master):
    """mooncake_master inside *netns* (its ports are the namespace's loopback's)."""

    def __init__(self, log: Path, netns: Netns) -> None:
        super().__init__(log)
        self.netns = netns

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=log,
                                         preexec_fn=self.netns.enter)

        def listens() -> bool:
            assert self.proc.poll() is None, f"mooncake_master exited: see {self.log}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                return False
            return True

        self.netns.call(lambda: until(listens, "mooncake_master listens"))


@pytest.mark.skipif(NETNS is not None, reason=NETNS or "")
def test_a_partitioned_pod(mount_factory, tmp_path) -> None:
    """The master and two daemons in a namespace whose loopback goes down: every pod
    connection is cut (established ones stall, new ones fail) while the mounts serve."""
    netns = Netns()
    master_ = NetnsMaster(tmp_path / "master.log", netns)
    try:
        master_.start()
        mounts = []
        for _ in range(2):
            m = mount_factory(start=False, pod=master_.address, pod_name=pm.POD_NAME,
                              pod_segment_size="16M",
                              pod_metrics=f"127.0.0.1:{master_.metrics_port}")
            m.start(preexec=netns.enter)
            assert os.readlink(f"/proc/{m.pid()}/ns/net") == os.readlink(netns.path)
            mounts.append(m)
        a, b = mounts
        data = kv_bytes(100_000, 70)
        (b.path / "local.bin").write_bytes(data)
        (a.path / "before.bin").write_bytes(data)
        assert until(lambda: read_or_none(b.path / "before.bin"), "B reads before.bin") == data
        netns.link("down")
        try:
            for i in range(10):
                assert absent(b.path / f"absent{i}.bin") < HANG_S
            assert (b.path / "local.bin").read_bytes() == data
            assert (b.path / "before.bin").read_bytes() == data
            assert b.status()["pod"]["timeouts"] + b.status()["pod"]["errors"] > 0
            during = [kv_bytes(50_000, 80 + i) for i in range(3)]
            for i, d in enumerate(during):
                (a.path / f"during{i}.bin").write_bytes(d)
            assert (a.path / "during0.bin").read_bytes() == during[0]
        finally:
            netns.link("up")
        for i, d in enumerate(during):
            assert until(lambda i=i: read_or_none(b.path / f"during{i}.bin"),
                         f"B reads during{i}.bin") == d
        netns.link("down")
        try:
            t0 = time.monotonic()
            a.unmount()
            assert time.monotonic() - t0 < 3 * HANG_S
        finally:
            netns.link("up")
    finally:
        master_.kill()
        netns.close()
