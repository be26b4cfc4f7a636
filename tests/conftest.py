"""The one fixture that matters: a real kvfs mounted through /dev/fuse with small tiers.

The daemon runs in its own process (a process that serves FUSE and also calls into its own
mount can deadlock). Tiers are tiny so that demotion, promotion and reclamation really happen
in tests. Every mount is unmounted at the end, even when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvfs.store.dram import remove_dram_dir

KVFS = [sys.executable, "-m", "kvfs"]
# Small enough that a few MiB of writes demote to NVMe; 64 KiB chunks make multi-chunk files
# out of small ones.
SMALL = {"dram_size": "4M", "nvme_size": "64M", "chunk_size": "64K", "segment_size": "1M"}


def _mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


@dataclass
class Mount:
    path: Path
    dram_dir: Path
    nvme_dir: Path
    options: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)

    def start(self, preexec=None, **extra) -> subprocess.CompletedProcess:
        """Mount (and wait for it); *preexec* runs in the child before kvfs starts."""
        opts = {**self.options, **extra}
        args = KVFS + ["mount", str(self.path), "--dram-dir", str(self.dram_dir),
                       "--nvme-dir", str(self.nvme_dir),
                       "--log-file", str(self.nvme_dir.parent / "kvfs.log")] + self.flags
        o = ",".join(f"{k}={v}" for k, v in opts.items())
        if o:
            args += ["-o", o]
        r = subprocess.run(args, capture_output=True, text=True, timeout=60, preexec_fn=preexec)
        if r.returncode != 0:
            raise RuntimeError(f"mount failed ({r.returncode}): {r.stderr}")
        assert _mounted(str(self.path))
        return r

    def status(self) -> dict:
        return json.loads(os.getxattr(self.path, "user.kvfs.status"))

    def where(self, rel: str) -> list[dict]:
        out = json.loads(os.getxattr(self.path / rel, "user.kvfs.where"))
        chunks = out["chunks"]
        while out["next"] is not None:
            out = json.loads(os.getxattr(self.path / rel, f"user.kvfs.where.{out['next']}"))
            chunks += out["chunks"]
        return chunks

    def tiers(self, rel: str) -> set[str]:
        return {t for c in self.where(rel) for t in c["tiers"]}

    def pid(self) -> int | None:
        try:
            return int((self.nvme_dir / "lock").read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def unmount(self) -> None:
        if not _mounted(str(self.path)):
            return
        r = subprocess.run(KVFS + ["umount", str(self.path)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr

    def fsck(self) -> subprocess.CompletedProcess:
        """kvfs.cli.fsck on this mount's tiers (unmount first)."""
        return subprocess.run([sys.executable, "-m", "kvfs.cli.fsck", str(self.nvme_dir),
                               "--dram-dir", str(self.dram_dir)], capture_output=True, text=True)

    def kill(self) -> None:
        """SIGKILL the daemon (a crash), then clear the dead mount."""
        pid = self.pid()
        assert pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def reboot(self) -> None:
        """Simulate losing the DRAM tier (power loss): SIGKILL and delete the tmpfs dir."""
        self.kill()
        self.lose_dram()

    def lose_dram(self) -> None:
        """Empty the DRAM tier, as a reboot would (the daemon must not be running). What it
        holds goes; the directory itself may be the tmpfs the daemon mounted: it stays."""
        for entry in self.dram_dir.iterdir() if self.dram_dir.exists() else ():
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def log(self) -> str:
        try:
            return (self.nvme_dir.parent / "kvfs.log").read_text()
        except OSError:
            return ""


def make_mount(tmp_path: Path, **options) -> Mount:
    base = tmp_path / f"kvfs-{uuid.uuid4().hex[:8]}"
    mnt = base / "mnt"
    mnt.mkdir(parents=True)
    return Mount(mnt, Path("/dev/shm") / f"kvfs-test-{uuid.uuid4().hex[:12]}", base / "nvme",
                 {**SMALL, **options})


@pytest.fixture
def mount_factory(tmp_path):
    """Make (and always clean up) any number of kvfs mounts with chosen options."""
    made: list[Mount] = []

    def factory(start: bool = True, flags: list | None = None, **options) -> Mount:
        m = make_mount(tmp_path, **options)
        m.flags = flags or []
        made.append(m)
        if start:
            m.start()
        return m

    yield factory
    for m in made:
        try:
            m.unmount()
        except Exception:
            pid = m.pid()
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
        remove_dram_dir(str(m.dram_dir))  # and the tmpfs of its own the daemon mounted


@pytest.fixture
def race():
    """race(targets, seconds, stop): run each of *targets* in a thread of its own for
    *seconds*, then set *stop* and join them, also when something fails meanwhile (a
    thread left spinning would keep the mount busy)."""
    def run(targets, seconds: float, stop: threading.Event) -> None:
        threads = [threading.Thread(target=t) for t in targets]
        try:
            for t in threads:
                t.start()
            time.sleep(seconds)
        finally:
            stop.set()
            for t in threads:
                if t.ident is not None:  # (started)
                    t.join()

    return run


@pytest.fixture
def kv(mount_factory) -> Mount:
    """A kvfs mount with small tiers (4 MiB DRAM, 64 MiB NVMe, 64 KiB chunks)."""
    return mount_factory()
