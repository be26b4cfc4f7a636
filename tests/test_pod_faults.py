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
import os
import signal
import subprocess
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
