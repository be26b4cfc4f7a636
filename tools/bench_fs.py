#!/usr/bin/env python3
"""Foundation benchmark: kvfs against tmpfs, a raw O_DIRECT disk and the FUSE floor.

For each file size (default 256 KiB, 4 MiB, 32 MiB) and each configuration

    tmpfs           plain files in a fresh directory under /dev/shm
    fuse-null       tools/nullfs.py: an in-memory pyfuse3 filesystem that does the least any
                    pyfuse3 filesystem can, with kvfs's FUSE choices (direct_io, 60 s
                    timeouts, 8-64 request tasks): the floor FUSE itself sets on this machine
    kvfs-dram       kvfs whose DRAM tier holds the whole working set (reads verified
                    DRAM-resident)
    disk            plain files on the NVMe filesystem (ext4), O_DIRECT from aligned buffers,
                    page cache dropped between the write and the read pass; with kvfs-nvme
                    or kvfs-nvme-raw in the same run, its read pass takes turns with theirs
                    batch by batch (below), and the NVMe/disk ratio is the median of the
                    per-batch ratios: this disk's speed swings 2x within minutes
    kvfs-nvme       kvfs with a DRAM tier much smaller than the data (writes stream through
                    demotion, which compresses); then a clean unmount, the DRAM tier is thrown
                    away and the store remounted with a fresh one, so every chunk is on NVMe
                    only (verified) before the read pass
    kvfs-nvme-raw   kvfs-nvme with compression off (-o compress=0). With kvfs-nvme in the
                    same run, both stores are written in turn, then both remounted and their
                    read passes (and the disk's) alternate batch by batch (ABC CBA ...): the
                    compressed-read ratio is the median of per-batch ratios, as for the
                    random pair below
    kvfs-nvme-random, kvfs-nvme-raw-random
                    write pass only, of incompressible data (os.urandom), through kvfs-nvme
                    with compression on and off: what compression costs when it cannot win.
                    Both mounts are up at once and take turns in batches (AB BA ...), each
                    timed until its demoter is idle; a round's ratio is the median of the
                    per-batch ratios (a 5% goal is finer than the noise of separate runs)

it writes N = total/size files and reads them back, the way an engine does:

    write: open(O_CREAT|O_TRUNC) / one write() of the whole file / close   (per file;
           --write-size 4K: 4 KiB per write(), as a stdio writer like llama.cpp's)
    read:  open / readinto(whole file, preallocated page-aligned buffer) / close

and prints write and read throughput (GiB/s) and files/s side by side, the ratios (kvfs to
tmpfs, disk and fuse-null; compressed to uncompressed) and the goals of issues 2 and 4. Data
are real KV-cache bytes (SmolLM2 bf16, /work/shared/data/kv/smollm2_kv_bf16.npy) sliced
token-major into blocks and cycled; the random data are generated once, before any timing.
Every read is checked against what was written (outside the timed region).

Timed: the write loop (kvfs-nvme: including waits for demotion, not the final write-back at
unmount, which is reported separately; disk: not the sync after it) and open/read/close of
each file. kvfs runs from this checkout (`python -m kvfs`, its Cython extensions built in
place), fuse-null from tools/nullfs.py next to this file.

The machine is shared and noisy, so ratios come from pairs: each round (--repeat N rounds)
runs every configuration once per size, interleaved, in reverse order every other round so
that a drift of the machine does not always favour the same side; a ratio is computed within
each round and the report gives the median of the per-round ratios and their min-max.

Each mount gets fresh directories (kvfs: NVMe under a temporary directory on the disk, DRAM
under /dev/shm); mounts and directories are always removed, even on Ctrl-C (a watchdog kills
a daemon that keeps the benchmark stuck, and any phase longer than --timeout). Run as root
(drop_caches, FUSE allow_other).

    python tools/bench_fs.py [--sizes 256K,4M,32M] [--total 512M] [--repeat N]
                             [--stat median|best] [--configs tmpfs,fuse-null,...]
                             [--write-size SIZE] [--read-direct] [--disk-read-limit RATE]
                             [--json | --json-out FILE] [--profile DIR [--profile-native]]

--disk-read-limit 1G caps the disk's reads at 1 GiB/s for the whole run (the disk baseline and
the daemons alike, a cgroup): a slower or busier SSD than this one, where the disk rather than
the CPU sets the pace of NVMe-resident reads, as compression is meant for. The cap is loose:
the kernel lets a group that was idle burst, so the paired batches get more (under a 400 MiB/s
cap with --total 2G the disk baseline read 0.47 GiB/s; a 1 GiB/s cap did not hold at all).

With --stat best the table shows the best run and ratios are best over best. With --profile
DIR, py-spy samples the daemon during each timed FUSE phase and the top hotspots are printed
(profiled runs are slower, --profile-native much slower: compare unprofiled figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfs.store.dram import remove_dram_dir  # noqa: E402

NULLFS = Path(__file__).resolve().parent / "nullfs.py"
DATA = Path(__file__).resolve().parents[2] / "shared/data/kv/smollm2_kv_bf16.npy"
PAGE = mmap.PAGESIZE
GIB = 1 << 30
# Run order within a round: the members of each ratio's pair run next to each other.
CONFIGS = ("tmpfs", "fuse-null", "kvfs-dram", "disk", "kvfs-nvme", "kvfs-nvme-raw",
           "kvfs-nvme-random", "kvfs-nvme-raw-random")
LABELS = {"tmpfs": "tmpfs", "fuse-null": "fuse-null (FUSE floor)",
          "kvfs-dram": "kvfs DRAM-resident", "disk": "disk O_DIRECT",
          "kvfs-nvme": "kvfs NVMe-resident", "kvfs-nvme-raw": "kvfs NVMe, uncompressed",
          "kvfs-nvme-random": "kvfs NVMe, random data",
          "kvfs-nvme-raw-random": "  same, uncompressed"}
WRITE_ONLY = ("kvfs-nvme-random", "kvfs-nvme-raw-random")
# Run together when more than one is chosen: their read passes alternate batch by batch
# (the disk here gives anything from 0.6 to 1.6 GiB/s from one minute to the next).
READ_PAIR = ("disk", "kvfs-nvme", "kvfs-nvme-raw")
READ_BATCHES = 8
# Ratios printed for every size: (JSON key, numerator, denominator, label).
RATIOS = (("kvfs_dram_tmpfs", "kvfs-dram", "tmpfs", "kvfs DRAM / tmpfs"),
          ("fuse_null_tmpfs", "fuse-null", "tmpfs", "fuse-null / tmpfs"),
          ("kvfs_dram_fuse_null", "kvfs-dram", "fuse-null", "kvfs DRAM / fuse-null"),
          ("kvfs_nvme_disk", "kvfs-nvme", "disk", "kvfs NVMe / disk"),
          ("fuse_null_disk", "fuse-null", "disk", "fuse-null / disk"),
          ("kvfs_nvme_fuse_null", "kvfs-nvme", "fuse-null", "kvfs NVMe / fuse-null"),
          ("kvfs_nvme_compressed_raw", "kvfs-nvme", "kvfs-nvme-raw",
           "kvfs NVMe compressed / uncompr."),
          ("random_compress_on_off", "kvfs-nvme-random", "kvfs-nvme-raw-random",
           "random data: compress on / off"))
# Issue 2 (4-32 MiB files): ratios to the baselines; 256 KiB files: files/s.
GOAL_DRAM_READ = 0.6
GOAL_DRAM_WRITE = 0.4
GOAL_NVME_READ = 0.7
GOAL_SMALL_FPS = 2000
SMALL = 256 << 10
# Issue 4: compressed NVMe reads not slower than uncompressed; incompressible writes lose
# at most 5% to compression.
GOAL_COMPRESSED_READ = 1.0
GOAL_RANDOM_WRITE = 0.95
# Random data cycle through this many bytes: every chunk of a file is distinct.
RANDOM_PERIOD = 64 << 20
# The random-data pair alternates in this many batches (each at least one DRAM tier of data:
# every batch streams through demotion).
RANDOM_BATCHES = 8
# kvfs's default watermarks, passed explicitly: settle() must know the high one.
DRAM_HIGH = 0.90
DRAM_LOW = 0.75
SETTLE_POLL_S = 0.005
SETTLE_QUIET_S = 0.02
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class BenchError(RuntimeError):
    pass


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 256K, 4M, 1G)") from None


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


# -- data -----------------------------------------------------------------------------------
class Blocks:
    """Source bytes cycled through one page-aligned anonymous mmap; block i of size S is the
    slice at (i*S) mod period, so every block is page-aligned (usable for O_DIRECT)."""

    def __init__(self, raw: bytes, max_size: int, source: str) -> None:
        self.period = len(raw) // PAGE * PAGE
        length = self.period + max_size
        self.buf = mmap.mmap(-1, (length + PAGE - 1) // PAGE * PAGE)
        pos = 0
        while pos < length:
            n = min(self.period, length - pos)
            self.buf[pos:pos + n] = raw[:n]
            pos += n
        self.view = memoryview(self.buf)
        self.source = source

    def block(self, i: int, size: int) -> memoryview:
        off = (i * size) % self.period
        return self.view[off:off + size]


def kv_blocks(path: Path, max_size: int) -> Blocks:
    arr = np.load(path)  # [layer, K/V, token, head, dim]: token-major within a layer
    raw = arr.tobytes()
    return Blocks(raw, max_size,
                  f"{path} ({len(raw):,} bytes, shape {list(arr.shape)} {arr.dtype})")


def random_blocks(max_size: int) -> Blocks:
    return Blocks(os.urandom(RANDOM_PERIOD), max_size,
                  f"os.urandom, {fmt_size(RANDOM_PERIOD)} cycled")


# -- file I/O (the timed part) ----------------------------------------------------------------
# Bytes per write() call (--write-size); 0: each file in one call. A stdio writer such as
# llama.cpp's hands the kernel 4 KiB at a time.
WRITE_PIECE = 0
# --read-direct: every read pass opens its files O_DIRECT (vLLM's file tier reads so), not
# only the disk's.
READ_DIRECT = False


def write_files(paths: list[str], size: int, blocks: Blocks, direct: bool,
                first: int = 0) -> float:
    """Seconds to write paths[i] with block first+i each, WRITE_PIECE bytes per write()."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    data = [blocks.block(first + i, size) for i in range(len(paths))]
    piece = WRITE_PIECE or size
    t0 = time.perf_counter()
    for path, mv in zip(paths, data, strict=True):
        fd = os.open(path, flags, 0o644)
        try:
            pos = 0
            while pos < size:
                pos += os.write(fd, mv[pos:pos + piece])
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def read_files(paths: list[str], size: int, blocks: Blocks, buf: memoryview, direct: bool,
               verify: bool, lat: list[float] | None = None, first: int = 0) -> float:
    """Seconds spent in open/read/close only; the check against the source (paths[i] holds
    block first+i) is not timed. Each file's time is appended to *lat*."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct or READ_DIRECT else 0)
    target = buf[:size]
    got = np.frombuffer(buf, dtype=np.uint8, count=size)
    elapsed = 0.0
    for i, path in enumerate(paths):
        t0 = time.perf_counter()
        fd = os.open(path, flags)
        try:
            pos = 0
            while pos < size:
                n = os.readv(fd, [target[pos:]])
                if n == 0:
                    break
                pos += n
        finally:
            os.close(fd)
        dt = time.perf_counter() - t0
        elapsed += dt
        if lat is not None:
            lat.append(dt)
        if pos != size:
            raise BenchError(f"{path}: read {pos} bytes, expected {size}")
        if verify and not np.array_equal(
                got, np.frombuffer(blocks.block(first + i, size), dtype=np.uint8)):
            raise BenchError(f"{path}: data read back differ from the data written")
    return elapsed


def file_paths(directory: str, n: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [os.path.join(directory, f"blk{i:06d}.kv") for i in range(n)]


class DiskReadLimit:
    """Reads from the disk under *path* capped at *bps* bytes/s for this process and every
    process it starts from now on (the daemons included): a cgroup of its own, io.max on
    cgroup v2, blkio.throttle on v1. It stands in for a slower or busier SSD than this one,
    where the disk, not the CPU, sets the pace of NVMe-resident reads."""

    V2 = Path("/sys/fs/cgroup")
    V1 = Path("/sys/fs/cgroup/blkio")

    def __init__(self, path: str, bps: int) -> None:
        st = os.stat(path)
        dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
        if not dev.exists():
            raise BenchError(f"{path} is not on a block device: no disk read limit possible")
        if (dev / "partition").exists():  # throttles apply to the whole disk
            dev = dev.resolve().parent
        self.device = (dev / "dev").read_text().strip()
        name = f"kvfs-bench-{os.getpid()}"
        if "io" in self._read(self.V2 / "cgroup.controllers").split():
            self.parent, self.group = self.V2, self.V2 / name
            knob, value = "io.max", f"{self.device} rbps={bps}"
            if "io" not in self._read(self.V2 / "cgroup.subtree_control").split():
                (self.V2 / "cgroup.subtree_control").write_text("+io\n")
        elif (self.V1 / "blkio.throttle.read_bps_device").exists():
            self.parent, self.group = self.V1, self.V1 / name
            knob, value = "blkio.throttle.read_bps_device", f"{self.device} {bps}"
        else:
            raise BenchError("no cgroup io controller (v2 io.max or v1 blkio) to limit reads")
        self.group.mkdir(exist_ok=True)
        (self.group / knob).write_text(value + "\n")
        (self.group / "cgroup.procs").write_text(f"{os.getpid()}\n")

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text()
        except OSError:
            return ""

    def remove(self) -> None:
        """Back to the parent group; the group goes once its last process has left."""
        with contextlib.suppress(OSError):
            (self.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.group.rmdir()


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- FUSE mounts ------------------------------------------------------------------------------
def kvfs_env() -> dict:
    """Environment for `python -m kvfs` from this checkout."""
    if not list((REPO / "kvfs").glob("_index*.so")):
        raise BenchError(f"kvfs's Cython extensions are not built in {REPO}: run "
                         f"`python setup.py build_ext --inplace` there first")
    return {**os.environ, "PYTHONPATH": str(REPO)}


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "kvfs",
                                "native", "tools/nullfs.py"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


class Mount:
    """One FUSE filesystem process mounted at base/mnt for one measurement. Registered with
    the watchdog from the moment its process may exist until it is cleaned up."""

    def __init__(self, base: Path, log_name: str) -> None:
        self.base = base
        self.path = base / "mnt"
        self.log = base / log_name
        self.path.mkdir(parents=True, exist_ok=True)

    def pid(self) -> int | None:
        raise NotImplementedError

    def unmount(self) -> float:
        """Clean unmount; seconds it took."""
        raise NotImplementedError

    def remove_dirs(self) -> None:
        """Directories of the mount outside self.base (removed by the caller)."""

    def alive(self) -> bool:
        pid = self.pid()
        if not pid:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def force_unmount(self) -> None:
        pid = self.pid()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            for _ in range(100):
                if not self.alive():
                    break
                time.sleep(0.02)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def cleanup(self) -> None:
        """Unmount (cleanly if possible) and remove the directories outside self.base."""
        try:
            close_fds_under(str(self.path))  # e.g. opened just before a Ctrl-C landed
            if mounted(str(self.path)) and not self.alive():
                raise BenchError("the daemon is gone")
            self.unmount()
        except BaseException as exc:  # includes a second Ctrl-C: still tear down
            log(f"  clean unmount of {self.path} failed ({exc!r}); killing the daemon")
            self.force_unmount()
        finally:
            with WATCHDOG.lock:
                WATCHDOG.mounts.discard(self)
            self.remove_dirs()

    def log_tail(self, n: int = 15) -> str:
        try:
            return "".join(self.log.read_text().splitlines(keepends=True)[-n:])
        except OSError:
            return ""


class KvfsMount(Mount):
    def __init__(self, base: Path, env: dict, options: dict) -> None:
        super().__init__(base, "kvfs.log")
        self.nvme_dir = base / "nvme"
        self.dram_dir = Path(f"/dev/shm/kvfs-bench-{uuid.uuid4().hex[:12]}")
        self.env = env
        self.options = options

    def mount(self) -> None:
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        args = [sys.executable, "-m", "kvfs", "mount", str(self.path), "--dram-dir",
                str(self.dram_dir), "--nvme-dir", str(self.nvme_dir), "--log-file",
                str(self.log), "-o", opts]
        with WATCHDOG.lock:
            WATCHDOG.mounts.add(self)
        r = subprocess.run(args, capture_output=True, text=True, timeout=120, env=self.env,
                           cwd="/")
        if r.returncode != 0 or not mounted(str(self.path)):
            raise BenchError(f"kvfs mount failed ({r.returncode}): {r.stderr.strip()}\n"
                             f"{self.log_tail()}")

    def pid(self) -> int | None:
        try:
            return int((self.nvme_dir / "lock").read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def unmount(self) -> float:
        """Clean unmount (the daemon writes dirty chunks back first); seconds it took."""
        if not mounted(str(self.path)):
            return 0.0
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(self.path)],
                           capture_output=True, text=True, timeout=300, env=self.env, cwd="/")
        if r.returncode != 0:
            raise BenchError(f"kvfs umount failed: {r.stderr.strip()}\n{self.log_tail()}")
        return time.perf_counter() - t0

    def new_dram_tier(self) -> None:
        remove_dram_dir(str(self.dram_dir))
        self.dram_dir = Path(f"/dev/shm/kvfs-bench-{uuid.uuid4().hex[:12]}")

    def remove_dirs(self) -> None:
        remove_dram_dir(str(self.dram_dir))

    def status(self) -> dict:
        return json.loads(os.getxattr(self.path, "user.kvfs.status"))

    def log_problems(self, limit: int = 5) -> tuple[int, list[str]]:
        """Number of WARNING/ERROR lines in the daemon log and the first distinct ones."""
        try:
            lines = self.log.read_text().splitlines()
        except OSError:
            return 0, []
        bad = [ln.split(" ", 2)[-1] for ln in lines if " WARNING " in ln or " ERROR " in ln]
        seen: list[str] = []
        for msg in bad:
            key = msg.split(":", 1)[-1][:120]
            if all(key != s.split(":", 1)[-1][:120] for s in seen):
                seen.append(msg[:200])
            if len(seen) >= limit:
                break
        return len(bad), seen


class NullMount(Mount):
    """tools/nullfs.py in a session of its own (a Ctrl-C reaches the benchmark only, which
    then unmounts it like a kvfs mount)."""

    def __init__(self, base: Path) -> None:
        super().__init__(base, "nullfs.log")
        self.proc: subprocess.Popen | None = None

    def mount(self) -> None:
        with WATCHDOG.lock:
            WATCHDOG.mounts.add(self)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(NULLFS), str(self.path)],
                                         stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, cwd="/",
                                         start_new_session=True)
        deadline = time.monotonic() + 30
        while not mounted(str(self.path)):
            if self.proc.poll() is not None:
                raise BenchError(f"fuse-null exited ({self.proc.returncode}) instead of "
                                 f"mounting:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError("fuse-null did not mount within 30 s")
            time.sleep(0.02)

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def unmount(self) -> float:
        t0 = time.perf_counter()
        if mounted(str(self.path)):
            r = subprocess.run(["fusermount3", "-u", str(self.path)], capture_output=True,
                               text=True, timeout=60)
            if r.returncode != 0:
                raise BenchError(f"fusermount3 -u failed: {r.stderr.strip()}")
        if self.proc is not None:
            self.proc.wait(timeout=60)
        return time.perf_counter() - t0

    def force_unmount(self) -> None:
        super().force_unmount()
        if self.proc is not None:
            self.proc.wait()  # reap it


def close_fds_under(root: str) -> None:
    prefix = os.path.realpath(root).rstrip("/") + "/"
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError, ValueError):
            if os.readlink(f"/proc/self/fd/{name}").startswith(prefix):
                os.close(int(name))


def where(path: str) -> list[dict]:
    out = json.loads(os.getxattr(path, "user.kvfs.where"))
    chunks = out["chunks"]
    while out["next"] is not None:
        out = json.loads(os.getxattr(path, f"user.kvfs.where.{out['next']}"))
        chunks += out["chunks"]
    return chunks


def check_residency(paths: list[str], size: int, chunk_size: int, tier: str) -> dict:
    """Every chunk of every file must be in *tier* only ('dram': a DRAM copy, 'nvme': on
    NVMe and not in DRAM). Returns a summary; raises if the condition does not hold."""
    want = -(-size // chunk_size)
    tiers: Counter = Counter()
    for path in paths:
        chunks = where(path)
        if len(chunks) != want:
            raise BenchError(f"{path}: {len(chunks)} chunks, expected {want}")
        for c in chunks:
            tiers["+".join(c["tiers"]) or "none"] += 1
            ok = ("dram" in c["tiers"]) if tier == "dram" else (c["tiers"] == ["nvme"])
            if not ok:
                raise BenchError(f"{path} chunk {c['chunk']}: tiers {c['tiers']}, "
                                 f"expected {tier}-resident")
    return dict(tiers)


# -- watchdog ---------------------------------------------------------------------------------
class Watchdog(threading.Thread):
    """Gets a FUSE daemon unstuck when the benchmark's own thread cannot act.

    A client blocked in a FUSE request does not take Ctrl-C until the daemon answers, so a
    wedged daemon would wedge the benchmark too. This thread polls the signals pending on the
    process (/proc: a signal the main thread cannot take yet stays pending) and the deadline
    of the current phase; if SIGINT/SIGTERM stays pending for GRACE seconds, or a phase
    overruns its deadline, it SIGKILLs the live FUSE daemons (kvfs, fuse-null): the blocked
    syscall then fails, and the main thread unwinds through its cleanup.
    """

    GRACE = 3.0
    MASK = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))

    def __init__(self) -> None:
        super().__init__(name="bench-watchdog", daemon=True)
        self.mounts: set[Mount] = set()
        self.lock = threading.Lock()
        self.deadline: float | None = None
        self.phase = ""
        self.fired: str | None = None
        self.main_tid = threading.main_thread().native_id

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handler)
        signal.signal(signal.SIGTERM, self._handler)
        self.start()

    @staticmethod
    def _handler(signum, frame):
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def timed(self, phase: str, seconds: float):
        self.phase, self.fired = phase, None
        self.deadline = time.monotonic() + seconds
        try:
            yield
        finally:
            self.deadline = None

    def _pending(self) -> bool:
        bits = 0
        for path, key in (("/proc/self/status", "ShdPnd:"),
                          (f"/proc/self/task/{self.main_tid}/status", "SigPnd:")):
            try:
                with open(path) as f:
                    for line in f:
                        if line.startswith(key):
                            bits |= int(line.split()[1], 16)
            except (OSError, ValueError):
                pass
        return bool(bits & self.MASK)

    def run(self) -> None:
        since: float | None = None
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            if self._pending():
                since = since or now
                if now - since > self.GRACE:
                    since = None
                    self.kill(f"interrupted during {self.phase or 'setup'}")
            else:
                since = None
            if self.deadline is not None and now > self.deadline:
                self.deadline = None
                self.kill(f"{self.phase} timed out")

    def kill(self, reason: str) -> None:
        self.fired = reason
        with self.lock:
            mounts = list(self.mounts)
        for m in mounts:
            pid = m.pid()
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


WATCHDOG = Watchdog()


# -- profiling (optional) -----------------------------------------------------------------------
class Profiler:
    """py-spy record on the daemon during one phase; raw collapsed stacks to a file."""

    def __init__(self, directory: Path | None, native: bool = False) -> None:
        self.dir = directory
        self.native = native
        self.proc: subprocess.Popen | None = None
        self.out: Path | None = None
        self.reports: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, name: str, pid: int | None):
        if self.dir is None or pid is None:
            yield
            return
        exe = shutil.which("py-spy")
        if exe is None:
            raise BenchError("--profile needs py-spy (pip install py-spy)")
        self.out = self.dir / f"{name}.txt"
        # --native cannot sample without pausing the process (no --nonblocking with it).
        mode = ["--native"] if self.native else ["--nonblocking"]
        with open(self.dir / f"{name}.py-spy.log", "w") as err:
            self.proc = subprocess.Popen(
                [exe, "record", "--pid", str(pid), "--rate", "250", "--threads", "--format",
                 "raw", "-o", str(self.out), *mode], stdout=err, stderr=subprocess.STDOUT)
        time.sleep(1.0)  # let it attach
        try:
            yield
        finally:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
            if self.out.exists():
                self.reports[name] = summarize_profile(self.out)
            else:
                log(f"    py-spy wrote no profile; see {self.dir / (name + '.py-spy.log')}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _frame_name(frame: str) -> str:
    """'read (kvfs/fs.py:283)' -> 'read (kvfs/fs.py)'; long site-packages paths shortened."""
    name, _, where_ = frame.partition(" (")
    where_ = where_.rstrip(")")
    file_ = where_.rsplit(":", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/"):
        if marker in file_:
            file_ = file_.split(marker, 1)[1]
    return f"{name} ({file_})" if file_ else name


# Frames on every stack (entry points, event loop, thread plumbing): useless as "inclusive".
_BOILERPLATE = ("<module>", "runpy", "kvfs/cli/", "kvfs/daemon.py", "trio/_core/_run.py",
                "threading.py", "_thread_cache.py", "outcome/", "trio/_threads.py",
                "_pyfuse3.py", "_errors.<locals>", "_ki.py", "_start", "clone", "thread_start",
                "start_thread", "pthread_", "Py_", "_Py", "PyObject_", "PyEval", "PyRun",
                "pymain", "main (python")


_WAITING = ("acquire_lock_timed", "take_gil", "PyCOND_TIMEDWAIT", "PyThread_acquire_lock")
# Leaf frames of a thread that is waiting: trio's event loop polling for FUSE requests, a
# worker thread waiting for a job (py-spy's own idle detection misses some of these).
_IDLE_LEAF = ("epoll_wait", "futex", "syscall (libc", "EpollIOManager.get_events",
              "WorkerThread._work")


def summarize_profile(path: Path, top: int = 12) -> dict:
    self_t: Counter = Counter()
    incl: Counter = Counter()
    threads: Counter = Counter()
    total = waiting = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if f]
        if frames and frames[0].startswith(("process ", "thread ")):
            frames = frames[1:]
        if frames and frames[0].startswith("thread "):
            frames = frames[1:]
        if not frames:
            continue
        names = [_frame_name(f) for f in frames]
        if any(w in nm for nm in names for w in _WAITING) or names[-1].startswith(_IDLE_LEAF):
            waiting += n
            continue
        total += n
        kind = "worker" if any("_thread_cache" in f for f in names) else "trio/main"
        threads[kind] += n
        self_t[names[-1]] += n
        for name in set(names):
            incl[name] += n
    pct = (lambda c: round(100.0 * c / total, 1)) if total else (lambda c: 0.0)
    return {"samples": total, "waiting_samples": waiting,
            "threads": {k: pct(v) for k, v in threads.most_common()},
            "self": [(k, pct(v)) for k, v in self_t.most_common(top)],
            "inclusive": [(k, pct(v)) for k, v in incl.most_common()
                          if not any(b in k for b in _BOILERPLATE)][:top],
            "file": str(path)}


# -- one measurement per configuration -------------------------------------------------------------
def latency(lat: list[float]) -> dict:
    """Per-file read latency percentiles (microseconds) of one pass."""
    if not lat:
        return {}
    xs = sorted(lat)
    return {"read_p50_us": xs[len(xs) // 2] * 1e6,
            "read_p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6}


def result(size: int, n: int, t_write: float, t_read: float | None, **extra) -> dict:
    total = size * n
    return {"files": n, "bytes": total, "write_s": t_write, "read_s": t_read,
            "write_gibs": total / t_write / GIB, "write_fps": n / t_write,
            "read_gibs": total / t_read / GIB if t_read else None,
            "read_fps": n / t_read if t_read else None, **extra}


def failure(m: Mount, step: str, exc: BaseException, timeout: float) -> BenchError:
    why = WATCHDOG.fired or f"{step} failed"
    msg = f"{why}: {exc}"
    if WATCHDOG.fired and "timed out" in WATCHDOG.fired:
        msg = f"{why} after {timeout:.0f} s (daemon killed)"
    if isinstance(m, KvfsMount):
        nbad, first = m.log_problems()
        if nbad:
            msg += f"; daemon log: {nbad} warnings/errors, e.g. " + " | ".join(first[:2])
    elif tail := m.log_tail(3).strip():
        msg += f"; fuse-null log: {tail}"
    return BenchError(msg)


def run_plain(kind: str, size: int, n: int, blocks: Blocks, buf: memoryview, tmp: Path,
              args) -> dict:
    direct = kind == "disk"
    root = tmp / "disk" if direct else Path(f"/dev/shm/kvfs-bench-tmpfs-{uuid.uuid4().hex[:8]}")
    try:
        paths = file_paths(str(root / "blocks"), n)
        t_write = write_files(paths, size, blocks, direct)
        dropped = drop_caches() if direct else None
        lat: list[float] = []
        t_read = read_files(paths, size, blocks, buf, direct, args.verify, lat)
        return result(size, n, t_write, t_read, caches_dropped=dropped, **latency(lat))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_null(size: int, n: int, blocks: Blocks, buf: memoryview, tmp: Path, args,
             prof: Profiler) -> dict:
    m = NullMount(tmp / f"fuse-null-{uuid.uuid4().hex[:8]}")
    tag = f"fuse-null-{fmt_size(size).replace(' ', '')}"
    step = "mount"
    try:
        m.mount()
        paths = file_paths(str(m.path / "blocks"), n)
        step = "write pass"
        with WATCHDOG.timed(step, args.timeout), prof.phase(f"{tag}-write", m.pid()):
            t_write = write_files(paths, size, blocks, direct=False)
        step = "read pass"
        with WATCHDOG.timed(step, args.timeout), prof.phase(f"{tag}-read", m.pid()):
            lat: list[float] = []
            t_read = read_files(paths, size, blocks, buf, direct=False, verify=args.verify,
                                lat=lat)
        return result(size, n, t_write, t_read, **latency(lat))
    except (OSError, BenchError, subprocess.SubprocessError) as exc:
        raise failure(m, step, exc, args.timeout) from None
    finally:
        prof.stop()
        m.cleanup()
        shutil.rmtree(m.base, ignore_errors=True)


def tier_bytes(st: dict) -> dict:
    return {t: {k: st["tiers"][t][k] for k in ("used_bytes", "logical_bytes", "chunks")}
            for t in ("dram", "nvme")}


def kvfs_mount(kind: str, total: int, tmp: Path, args, env: dict) -> KvfsMount:
    if kind == "kvfs-dram":
        dram = max(2 * total + (64 << 20), 256 << 20)  # the high watermark stays far away
    else:
        dram = args.nvme_dram
    opts = {"dram_size": dram, "nvme_size": args.nvme_size, "chunk_size": args.chunk_size,
            "segment_size": args.segment_size, "compress": int("-raw" not in kind),
            "dram_high_watermark": DRAM_HIGH, "dram_low_watermark": DRAM_LOW}
    for item in filter(None, args.kvfs_options.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value or 1
    return KvfsMount(tmp / f"{kind}-{uuid.uuid4().hex[:8]}", env, opts)


def mount_facts(m: KvfsMount) -> dict:
    return {"dram_size": m.options["dram_size"], "compress": bool(m.options["compress"])}


def run_kvfs(kind: str, size: int, n: int, blocks: Blocks, buf: memoryview, tmp: Path,
             args, env: dict, prof: Profiler) -> dict:
    m = kvfs_mount(kind, size * n, tmp, args, env)
    tag = f"{kind}-{fmt_size(size).replace(' ', '')}"
    extra = mount_facts(m)
    step = ["mount"]
    try:
        m.mount()
        paths, t_write = kvfs_write_phase(m, kind, size, n, blocks, args, prof, extra, step)
        before = m.status()
        extra["before_read"] = tier_bytes(before)
        step[0] = "read pass"
        with WATCHDOG.timed(step[0], args.timeout), prof.phase(f"{tag}-read", m.pid()):
            lat: list[float] = []
            t_read = read_files(paths, size, blocks, buf, direct=False, verify=args.verify,
                                lat=lat)
        extra.update(latency(lat))
        read_facts(m, before, extra)
        return result(size, n, t_write, t_read, **extra)
    except (OSError, BenchError, subprocess.SubprocessError) as exc:
        raise failure(m, step[0], exc, args.timeout) from None
    finally:
        prof.stop()
        m.cleanup()
        shutil.rmtree(m.base, ignore_errors=True)


def kvfs_write_phase(m: KvfsMount, kind: str, size: int, n: int, blocks: Blocks, args,
                     prof: Profiler, extra: dict, step: list[str]) -> tuple[list[str], float]:
    """The timed write pass into a mounted kvfs, then what its kind's read pass starts from:
    every chunk in DRAM (kvfs-dram), or on NVMe only (the others: a clean unmount writes the
    rest back, the DRAM tier is thrown away and the store remounted with a fresh one).
    *step* names the current step, for the caller's error message."""
    tag = f"{kind}-{fmt_size(size).replace(' ', '')}"
    paths = file_paths(str(m.path / "blocks"), n)
    step[0] = "write pass"
    with WATCHDOG.timed(step[0], args.timeout), prof.phase(f"{tag}-write", m.pid()):
        t_write = write_files(paths, size, blocks, direct=False)
    st = m.status()
    extra["after_write"] = tier_bytes(st)
    extra["after_write"]["demotions"] = st["moves"]["demotions"]
    if kind == "kvfs-dram":
        step[0] = "residency check"
        with WATCHDOG.timed(step[0], args.timeout):
            extra["residency"] = check_residency(paths, size, args.chunk_size, "dram")
    else:
        step[0] = "unmount (write-back of dirty DRAM)"
        with WATCHDOG.timed(step[0], args.timeout):
            extra["drain_s"] = m.unmount()
        m.new_dram_tier()
        step[0] = "remount"
        m.mount()
        step[0] = "residency check"
        with WATCHDOG.timed(step[0], args.timeout):
            extra["residency"] = check_residency(paths, size, args.chunk_size, "nvme")
        extra["caches_dropped"] = drop_caches()
    return paths, t_write


def read_facts(m: KvfsMount, before: dict, extra: dict) -> None:
    """Where the read pass's chunks came from, and the daemon log's complaints."""
    after = m.status()
    extra["read_chunks"] = {
        k: after["reads"].get(k, 0) - before["reads"].get(k, 0)
        for k in ("chunks_from_dram", "chunks_from_nvme", "checksum_errors",
                  "read_through_front_reads")}
    extra["read_chunks"]["promotions"] = (after["moves"]["promotions"]
                                          - before["moves"]["promotions"])
    nbad, first = m.log_problems()
    if nbad:
        extra["log_problems"] = {"count": nbad, "first": first}


def run_paired_reads(kinds: list[str], size: int, n: int, blocks: Blocks, buf: memoryview,
                     tmp: Path, args, env: dict) -> dict[str, dict]:
    """The disk, kvfs-nvme and kvfs-nvme-raw together (any two of them or all three): the
    disk's O_DIRECT write pass and each mount's as in run_kvfs, one after the other; then
    every mount is up with every chunk on NVMe only, and the read passes go in batches, the
    kinds taking turns batch by batch (ABC CBA ABC ...), so that the read figures share the
    machine's mood to within a second: the disk's speed swings by 2x here from one minute to
    the next, and issue 4's "not slower" is finer than the noise of separate runs. Not
    profiled."""
    mounts = {k: kvfs_mount(k, size * n, tmp, args, env) for k in kinds if k != "disk"}
    nbatch = max(1, min(READ_BATCHES, n))
    bounds = [n * j // nbatch for j in range(nbatch + 1)]
    extras = {k: mount_facts(m) for k, m in mounts.items()}
    spent: dict[str, list[float]] = {k: [] for k in kinds}
    lats: dict[str, list[float]] = {k: [] for k in kinds}
    writes, paths, before = {}, {}, {}
    step, current = ["mount"], kinds[0]
    try:
        if "disk" in kinds:
            current, step[0] = "disk", "write pass"
            paths["disk"] = file_paths(str(tmp / "disk" / "blocks"), n)
            writes["disk"] = write_files(paths["disk"], size, blocks, direct=True)
            extras["disk"] = {}
        for current, m in mounts.items():
            step[0] = "mount"
            m.mount()
            paths[current], writes[current] = kvfs_write_phase(
                m, current, size, n, blocks, args, Profiler(None), extras[current], step)
        drop_caches()
        for current, m in mounts.items():
            before[current] = m.status()
            extras[current]["before_read"] = tier_bytes(before[current])
        step[0] = "interleaved read pass"
        with WATCHDOG.timed(step[0], args.timeout):
            for j in range(nbatch):
                lo, hi = bounds[j], bounds[j + 1]
                for current in kinds if j % 2 == 0 else kinds[::-1]:
                    spent[current].append(read_files(
                        paths[current][lo:hi], size, blocks, buf, direct=current == "disk",
                        verify=args.verify, lat=lats[current], first=lo))
        out = {}
        for current in kinds:
            extra = extras[current]
            extra.update(latency(lats[current]))
            extra["read_batch_s"] = spent[current]
            if current in mounts:
                read_facts(mounts[current], before[current], extra)
            out[current] = result(size, n, writes[current], sum(spent[current]), **extra)
        return out
    except (OSError, BenchError, subprocess.SubprocessError) as exc:
        if current not in mounts:
            raise BenchError(f"disk {step[0]}: {exc}") from None
        raise failure(mounts[current], step[0], exc, args.timeout) from None
    finally:
        for m in mounts.values():
            m.cleanup()
            shutil.rmtree(m.base, ignore_errors=True)
        shutil.rmtree(tmp / "disk", ignore_errors=True)


def settle(m: KvfsMount, timeout: float) -> None:
    """Return once the demoter is idle: DRAM not over the high watermark (the demoter only
    starts above it, and then goes down to the low one) and no demotion finishing for
    SETTLE_QUIET_S (several of them complete per millisecond while it works)."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        st = m.status()
        d = st["tiers"]["dram"]
        now = (st["moves"]["demotions"], d["used_bytes"])
        over = d["used_bytes"] > DRAM_HIGH * d["capacity_bytes"]
        t = time.monotonic()
        if over or now != last:
            last, since = now, t
        elif t - since >= SETTLE_QUIET_S:
            return
        if t > deadline:
            raise BenchError(f"demotion did not settle within {timeout:.0f} s")
        time.sleep(SETTLE_POLL_S)


def run_random_writes(kinds: list[str], size: int, n: int, blocks: Blocks, tmp: Path, args,
                      env: dict) -> dict[str, dict]:
    """Write pass only, into one mount per kind, all up at once. The files go in batches of
    at least one DRAM tier each, the kinds alternating batch by batch (AB BA AB ...), so the
    two figures share the machine's mood to within a second; a batch is timed until its
    mount's demoter is idle again, so no mount's background work is billed to the other.
    Not profiled (py-spy follows one daemon per phase)."""
    mounts = {k: kvfs_mount(k, size * n, tmp, args, env) for k in kinds}
    nbatch = max(1, min(RANDOM_BATCHES, n, size * n // args.nvme_dram))
    bounds = [n * j // nbatch for j in range(nbatch + 1)]
    spent: dict[str, list[float]] = {k: [] for k in kinds}
    step, current = "mount", kinds[0]
    try:
        for k, m in mounts.items():
            current = k  # the mount a failure is reported for
            m.mount()
        paths = {k: file_paths(str(m.path / "blocks"), n) for k, m in mounts.items()}
        step = "interleaved write pass"
        with WATCHDOG.timed(step, args.timeout):
            for j in range(nbatch):
                lo, hi = bounds[j], bounds[j + 1]
                for current in kinds if j % 2 == 0 else kinds[::-1]:
                    m = mounts[current]
                    t0 = time.perf_counter()
                    write_files(paths[current][lo:hi], size, blocks, direct=False, first=lo)
                    settle(m, args.timeout)
                    spent[current].append(time.perf_counter() - t0)
            cpu = {k: process_cpu_s(m.pid()) for k, m in mounts.items()}
        out = {}
        for current, m in mounts.items():
            st = m.status()
            extra = {**mount_facts(m), "batch_s": spent[current], "after_write": tier_bytes(st),
                     "daemon_cpu_s": cpu[current]}
            extra["after_write"]["demotions"] = st["moves"]["demotions"]
            nbad, first = m.log_problems()
            if nbad:
                extra["log_problems"] = {"count": nbad, "first": first}
            out[current] = result(size, n, sum(spent[current]), None, **extra)
        return out
    except (OSError, BenchError, subprocess.SubprocessError) as exc:
        raise failure(mounts[current], step, exc, args.timeout) from None
    finally:
        for m in mounts.values():
            m.cleanup()
            shutil.rmtree(m.base, ignore_errors=True)


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds a process has used so far (its threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, TypeError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(group: list[str], size: int, n: int, data: dict[str, Blocks], buf: memoryview,
            tmp: Path, args, env: dict, prof: Profiler) -> dict[str, dict]:
    """Results of the configurations of *group* (one, or the random-data pair)."""
    cfg = group[0]
    if cfg in WRITE_ONLY:
        return run_random_writes(group, size, n, data["random"], tmp, args, env)
    blocks = data["kv"]
    if len(group) > 1:  # READ_PAIR
        return run_paired_reads(group, size, n, blocks, buf, tmp, args, env)
    if cfg in ("tmpfs", "disk"):
        return {cfg: run_plain(cfg, size, n, blocks, buf, tmp, args)}
    if cfg == "fuse-null":
        return {cfg: run_null(size, n, blocks, buf, tmp, args, prof)}
    return {cfg: run_kvfs(cfg, size, n, blocks, buf, tmp, args, env, prof)}


# -- reporting ---------------------------------------------------------------------------------
METRICS = ("write_gibs", "read_gibs", "write_fps", "read_fps")
LATENCY_METRICS = ("read_p50_us", "read_p99_us")  # lower is better


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pick(values: list[float], stat: str) -> float:
    return max(values) if stat == "best" else statistics.median(values)


def aggregate(runs: dict, stat: str) -> dict:
    """runs[size][config] = [result, ...] -> summary[size][config] = {metric: value}."""
    out: dict = {}
    for size, per in runs.items():
        out[size] = {}
        for cfg, rs in per.items():
            if not rs:
                continue
            out[size][cfg] = {}
            for k in METRICS:
                values = [r[k] for r in rs if r[k] is not None]
                out[size][cfg][k] = pick(values, stat) if values else None
            for k in LATENCY_METRICS:
                values = [r[k] for r in rs if r.get(k) is not None]
                out[size][cfg][k] = ((min(values) if stat == "best" else
                                      statistics.median(values)) if values else None)
            out[size][cfg]["files"] = rs[0]["files"]
            out[size][cfg]["runs"] = rs
        out[size]["stat"] = stat
    return out


class Ratio(NamedTuple):
    value: float
    lo: float  # smallest and largest per-round ratio
    hi: float
    rounds: int


def ratio(summary: dict, size: int, a: str, b: str, metric: str) -> Ratio | None:
    """a / b. Each round's figure of a is divided by the same round's figure of b (measured
    close together, so they share the machine's mood): a noisy machine disturbs these
    per-round ratios much less than the figures. The value is their median; with --stat
    best it is best a over best b."""
    s = summary.get(size, {})
    if a not in s or b not in s:
        return None
    base = {r["rep"]: r for r in s[b]["runs"] if r[metric]}
    pairs = [round_ratio(r, base[r["rep"]], metric) for r in s[a]["runs"]
             if r[metric] is not None and r["rep"] in base]
    if not pairs:
        return None
    if s["stat"] == "best":
        value = s[a][metric] / s[b][metric]
    elif batches := batch_ratios(s[a]["runs"], base, metric):
        value = statistics.median(batches)  # all rounds' batches pooled: more pairs, less noise
    else:
        value = statistics.median(pairs)
    return Ratio(value, min(pairs), max(pairs), len(pairs))


def batch_ratios(runs_a: list[dict], base: dict, metric: str) -> list[float]:
    """Per-batch ratios a / b of batch-timed passes (writes: run_random_writes, reads:
    run_paired_reads), all rounds together."""
    key = _batch_key(metric)
    if key is None:
        return []
    out = []
    for ra in runs_a:
        rb = base.get(ra["rep"])
        if rb is None or key not in ra or key not in rb:
            return []
        out += _batch_pairs(ra, rb, key)
    return out


def _batch_key(metric: str) -> str | None:
    """Where a throughput metric's batch times are kept, if it has any."""
    if metric.startswith("write"):
        return "batch_s"
    return "read_batch_s" if metric in ("read_gibs", "read_fps") else None


def _batch_pairs(ra: dict, rb: dict, key: str) -> list[float]:
    """a / b of each batch pair (batch times: b's time over a's)."""
    return [tb / ta for ta, tb in zip(ra[key], rb[key], strict=True)]


def round_ratio(ra: dict, rb: dict, metric: str) -> float:
    """ra / rb of one round. Writes timed batch by batch (run_random_writes) pair batch with
    batch, and their median is taken: one batch that hit a stall of the machine (per-batch
    ratios of 0.4 and 3 occur here) does not decide the round."""
    key = _batch_key(metric)
    if key is not None and key in ra and key in rb:
        return statistics.median(_batch_pairs(ra, rb, key))
    return ra[metric] / rb[metric]


def fmt_ratio(r: Ratio | None, spread: bool) -> str:
    if r is None:
        return "-"
    return f"{r.value:.2f}x" + (f" ({r.lo:.2f}-{r.hi:.2f})" if spread else "")


def ratio_goal(summary: dict, size: int, issue: int, text: str, a: str, b: str, metric: str,
               target: float, floor: tuple[str, str] | None = None, digits: int = 2) -> dict:
    """One goal 'a/b >= target'; *floor* = (numerator, denominator) of the fuse-null ratio
    shown beside it, so a reader sees how much of the gap FUSE itself leaves."""
    r = ratio(summary, size, a, b, metric)
    entry: dict = {"issue": issue, "goal": f"{fmt_size(size)} {text}", "target": target,
                   "ratio": r.value if r else None}
    if r is None:
        return {**entry, "verdict": "n/a", "figure": "not measured"}
    fig = f"{r.value:.{digits}f}x"
    if r.rounds > 1:
        split = ", rounds on both sides of the goal" if r.lo < target <= r.hi else ""
        fig += f" (per round {r.lo:.{digits}f}-{r.hi:.{digits}f}{split})"
    fig += f"; {summary[size][a][metric]:.2f} vs {summary[size][b][metric]:.2f} GiB/s"
    if floor and (f := ratio(summary, size, *floor, metric)):
        fig += f"; {LABELS[floor[0]].split()[0]}/{LABELS[floor[1]].split()[0]} {f.value:.2f}x"
    return {**entry, "spread": [r.lo, r.hi], "rounds": r.rounds, "figure": fig,
            "verdict": "PASS" if r.value >= target else "FAIL"}


def goals(summary: dict, sizes: list[int]) -> list[dict]:
    out = []
    big = [s for s in sizes if (4 << 20) <= s <= (32 << 20)]
    checks = (("kvfs-dram", "tmpfs", "read_gibs", GOAL_DRAM_READ, "DRAM-resident reads",
               ("fuse-null", "tmpfs")),
              ("kvfs-dram", "tmpfs", "write_gibs", GOAL_DRAM_WRITE, "DRAM-resident writes",
               ("fuse-null", "tmpfs")),
              ("kvfs-nvme", "disk", "read_gibs", GOAL_NVME_READ, "NVMe-resident reads",
               ("fuse-null", "disk")))
    for a, b, metric, target, what, floor in checks:
        for size in big:
            out.append(ratio_goal(summary, size, 2, f"{what} >= {target}x {LABELS[b]}", a, b,
                                  metric, target, floor))
        if not big:
            out.append({"issue": 2, "goal": f"4-32 MiB {what}", "verdict": "n/a",
                        "figure": "no size in 4M..32M measured"})
    null = summary.get(SMALL, {}).get("fuse-null")
    for cfg in ("kvfs-dram", "kvfs-nvme"):
        for metric, what in (("write_fps", "written"), ("read_fps", "read")):
            s = summary.get(SMALL, {}).get(cfg)
            entry = {"issue": 2, "target": GOAL_SMALL_FPS,
                     "goal": f"256 KiB files {what} >= {GOAL_SMALL_FPS:,}/s ({LABELS[cfg]})"}
            if s is None:
                why = ("add 256K to --sizes" if SMALL not in sizes
                       else "configuration not run or failed")
                entry.update(verdict="n/a", figure=f"not measured ({why})")
            else:
                fig = f"{s[metric]:,.0f} files/s"
                if null is not None:
                    r = ratio(summary, SMALL, cfg, "fuse-null", metric)
                    fig += (f"; fuse-null {null[metric]:,.0f}/s"
                            + (", below the goal itself" if null[metric] < GOAL_SMALL_FPS
                               else "")
                            + (f"; kvfs/fuse-null {r.value:.2f}x" if r else ""))
                entry.update(value=s[metric], figure=fig,
                             verdict="PASS" if s[metric] >= GOAL_SMALL_FPS else "FAIL")
            out.append(entry)
    for size in sizes:
        out.append(ratio_goal(summary, size, 4, "NVMe-resident reads, compressed >= "
                              f"{GOAL_COMPRESSED_READ}x uncompressed", "kvfs-nvme",
                              "kvfs-nvme-raw", "read_gibs", GOAL_COMPRESSED_READ, digits=3))
    for size in sizes:
        g = ratio_goal(summary, size, 4, "random-data writes (kvfs NVMe), compression "
                       f"on >= {GOAL_RANDOM_WRITE}x off", "kvfs-nvme-random",
                       "kvfs-nvme-raw-random", "write_gibs", GOAL_RANDOM_WRITE, digits=3)
        if (cpu := cpu_ratio(summary.get(size, {}), "kvfs-nvme-random", "kvfs-nvme-raw-random")):
            # wall time on this shared disk is noisy; the daemon's CPU shows the codec's cost
            g["daemon_cpu_ratio"] = cpu
            g["figure"] += f"; daemon CPU on/off {cpu:.3f}x"
        out.append(g)
    return out


def cpu_ratio(s: dict, a: str, b: str) -> float | None:
    """Median over rounds of a's daemon CPU seconds / b's (same files written in both)."""
    if a not in s or b not in s:
        return None
    base = {r["rep"]: r.get("daemon_cpu_s") for r in s[b]["runs"]}
    pairs = [r["daemon_cpu_s"] / base[r["rep"]] for r in s[a]["runs"]
             if r.get("daemon_cpu_s") and base.get(r["rep"])]
    return statistics.median(pairs) if pairs else None


def placement_note(r: dict) -> str:
    """Where kvfs put the chunks and served the reads from, in the last run."""
    def nvme(t: dict) -> str:
        n = t["nvme"]
        if not n["chunks"]:
            return "0 on NVMe"
        return (f"{n['chunks']} on NVMe, {n['logical_bytes'] / 2**20:,.0f} MiB stored in "
                f"{n['used_bytes'] / 2**20:,.0f} MiB ({n['logical_bytes'] / n['used_bytes']:.2f}x)")

    aw = r["after_write"]
    line = (f"DRAM tier {fmt_size(r['dram_size'])}, compression "
            f"{'on' if r['compress'] else 'off'}; after writes {aw['dram']['chunks']} chunks in "
            f"DRAM, {nvme(aw)} ({aw['demotions']} demotions)")
    if "residency" in r:
        line += "; before reads " + ", ".join(f"{k}: {v}" for k, v in r["residency"].items())
        if r["before_read"]["nvme"]["chunks"]:
            line += f", {nvme(r['before_read'])}"
        rc = r["read_chunks"]
        line += (f"; reads served {rc['chunks_from_dram']} chunks from DRAM, "
                 f"{rc['chunks_from_nvme']} from NVMe, {rc['promotions']} promoted")
        if rc.get("read_through_front_reads"):
            line += (f", {rc['read_through_front_reads']} READs answered by the front thread "
                     f"from chunks read ahead")
    if "drain_s" in r:
        line += f"; unmount write-back {r['drain_s']:.1f} s"
    if r.get("daemon_cpu_s") is not None:
        line += f"; daemon CPU {r['daemon_cpu_s']:.2f} s since mount"
    if "log_problems" in r:
        lp = r["log_problems"]
        line += f"; daemon log: {lp['count']} warnings/errors, e.g. {lp['first'][0]}"
    return line


def print_report(summary: dict, sizes: list[int], configs: list[str], header: list[str],
                 gl: list[dict], profiles: dict, stat: str, repeat: int, errors: dict,
                 elapsed: float) -> None:
    p = print
    w = max(len(LABELS[c]) for c in configs)

    def num(x: float | None, width: int, spec: str) -> str:
        return f"{x:>{width}{spec}}" if x is not None else f"{'-':>{width}}"

    for line in header:
        p(line)
    p()
    p(f"Throughput ({stat} of {repeat} round{'s' if repeat > 1 else ''}; GiB/s = 2^30 "
      f"bytes/s)")
    hdr = (f"{'size':>8}  {'configuration':<{w}} {'files':>6}  {'write GiB/s':>11} "
           f"{'read GiB/s':>10}  {'write files/s':>13} {'read files/s':>12}")
    p(hdr)
    p("-" * len(hdr))
    for size in sizes:
        first = True
        for cfg in configs:
            s = summary.get(size, {}).get(cfg)
            col = f"{fmt_size(size) if first else '':>8}  {LABELS[cfg]:<{w}}"
            if s is None:
                if cfg in errors.get(size, {}):
                    p(f"{col} {'FAILED (see Errors)':>24}")
                    first = False
                continue
            p(f"{col} {s['files']:>6}  {num(s['write_gibs'], 11, '.2f')} "
              f"{num(s['read_gibs'], 10, '.2f')}  {num(s['write_fps'], 13, ',.0f')} "
              f"{num(s['read_fps'], 12, ',.0f')}")
            first = False
    if repeat > 1:
        p()
        p("Spread over rounds (min-max GiB/s, write | read)")
        for size in sizes:
            for cfg in configs:
                s = summary.get(size, {}).get(cfg)
                if s is None:
                    continue
                wr = [r["write_gibs"] for r in s["runs"]]
                rd = [r["read_gibs"] for r in s["runs"] if r["read_gibs"] is not None]
                p(f"{fmt_size(size):>8}  {LABELS[cfg]:<{w}} {min(wr):5.2f}-{max(wr):<5.2f} | "
                  + (f"{min(rd):5.2f}-{max(rd):<5.2f}" if rd else "-"))
    rows = [(size, cfg, summary[size][cfg]) for size in sizes for cfg in configs
            if summary.get(size, {}).get(cfg, {}).get("read_p50_us") is not None]
    if rows:
        p()
        p(f"Read latency per file (open + read + close, us; {stat} of the rounds' percentiles)")
        last = None
        for size, cfg, s in rows:
            p(f"{fmt_size(size) if size != last else '':>8}  {LABELS[cfg]:<{w}} "
              f"p50 {s['read_p50_us']:>8,.0f}  p99 {s['read_p99_us']:>8,.0f}  "
              f"p99/p50 {s['read_p99_us'] / s['read_p50_us']:5.2f}")
            last = size
    p()
    spread = repeat > 1
    if stat == "median":
        p("Ratios (median of the per-round ratios, each from two figures of the same round"
          + ("; per-round min-max in brackets)" if spread else ")"))
    else:
        p("Ratios (best figure / best figure" + ("; per-round min-max in brackets)"
                                                 if spread else ")"))
    cw = 17 if spread else 6
    hdr = f"{'size':>8}  {'ratio':<31} {'write':>{cw}} {'read':>{cw}}"
    p(hdr)
    p("-" * len(hdr))
    for size in sizes:
        first = True
        for _key, a, b, label in RATIOS:
            rw = ratio(summary, size, a, b, "write_gibs")
            rr = ratio(summary, size, a, b, "read_gibs")
            if rw is None and rr is None:
                continue
            p(f"{fmt_size(size) if first else '':>8}  {label:<31} "
              f"{fmt_ratio(rw, spread):>{cw}} {fmt_ratio(rr, spread):>{cw}}")
            first = False
    p("(files/s ratios equal the GiB/s ratios: same files. kvfs NVMe writes stream through "
      "demotion, its DRAM tier being small; the disk baseline writes straight to the device. "
      f"Random data: the two mounts take turns in {RANDOM_BATCHES} batches, a round's ratio is "
      "the median of its per-batch ratios, the ratio the median of all rounds' batches)")
    notes = []
    for size in sizes:
        for cfg in configs:
            s = summary.get(size, {}).get(cfg)
            if cfg.startswith("kvfs") and s is not None:
                notes.append(f"{fmt_size(size):>8}  {LABELS[cfg]:<{w}} "
                             + placement_note(s["runs"][-1]))
    if notes:
        p()
        p("kvfs placement (last round; tiers from user.kvfs.where, counts from "
          "user.kvfs.status)")
        for line in notes:
            p(line)
    if errors:
        p()
        p("Errors (the configuration is left out of the table for that size and round)")
        for size, per in errors.items():
            for cfg, msg in per.items():
                p(f"{fmt_size(size):>8}  {LABELS[cfg]}: {msg}")
    for issue in (2, 4):
        p()
        p(f"Goals (issue {issue})")
        for g in gl:
            if g["issue"] == issue:
                p(f"  [{g['verdict']:>4}] {g['goal']}: {g['figure']}")
    if profiles:
        p()
        p("Daemon profile (py-spy; % of the busy samples of each phase, idle/waiting samples "
          "left out)")
        for name, rep in profiles.items():
            threads = ", ".join(f"{k} {v}%" for k, v in rep["threads"].items())
            p(f"  {name}: {rep['samples']} busy samples ({threads}), {rep['waiting_samples']} "
              f"idle  [{rep['file']}]")
            p("    self:      " + "; ".join(f"{k} {v}%" for k, v in rep["self"][:8]))
            p("    inclusive: " + "; ".join(f"{k} {v}%" for k, v in rep["inclusive"][:8]))
    p()
    p(f"wall time {elapsed / 60:.1f} min")


def mount_info(path: str) -> str:
    real = os.path.realpath(path)
    best = ("", "?", "?")
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            mp = parts[4]
            if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[0]):
                i = parts.index("-")
                best = (mp, parts[i + 1], parts[i + 2])
    return f"{best[1]} on {best[2]} (mounted at {best[0]})"


# -- main ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256K,4M,32M",
                    help="comma-separated file sizes, multiples of 4 KiB (default %(default)s)")
    ap.add_argument("--total", type=parse_size, default=parse_size("512M"),
                    help="bytes written and read per configuration and size (default 512M)")
    ap.add_argument("--write-size", type=parse_size, default=0, metavar="SIZE",
                    help="write each file SIZE bytes per write() call (a multiple of 4 KiB; "
                         "default: the whole file in one call)")
    ap.add_argument("--read-direct", action="store_true",
                    help="read every configuration's files with O_DIRECT, as vLLM's file tier "
                         "does (default: only the disk's; kvfs then answers through the "
                         "daemon, never by passthrough)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds of everything, configurations interleaved (default 1)")
    ap.add_argument("--stat", choices=("median", "best"), default="median",
                    help="how --repeat rounds are combined (default median)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="subset of %(default)s")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    ap.add_argument("--base-dir", default="/var/tmp",
                    help="directory on the NVMe filesystem for the disk baseline and kvfs's "
                         "NVMe tier (default %(default)s)")
    ap.add_argument("--nvme-dram", type=parse_size, default=parse_size("64M"),
                    help="DRAM tier of the kvfs-nvme* configurations (default 64M)")
    ap.add_argument("--nvme-size", type=parse_size, default=parse_size("8G"),
                    help="NVMe tier capacity of every kvfs mount (default 8G)")
    ap.add_argument("--chunk-size", type=parse_size, default=parse_size("1M"),
                    help="kvfs chunk_size (default 1M)")
    ap.add_argument("--segment-size", type=parse_size, default=parse_size("64M"),
                    help="kvfs segment_size (default 64M)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one FUSE phase may take before its daemon is killed and the "
                         "configuration reported as failed (default %(default)s)")
    ap.add_argument("--kvfs-options", default="", metavar="K=V,...",
                    help="more -o options for every kvfs mount, e.g. dram_verify=ingest,"
                         "dram_huge (default none)")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="do not compare the bytes read with the bytes written")
    ap.add_argument("--disk-read-limit", type=parse_size, default=0, metavar="RATE",
                    help="cap reads from the disk under --base-dir at RATE bytes/s (e.g. 1G) "
                         "for the whole run, daemons included: a slower SSD than this one "
                         "(default: no cap)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="py-spy the daemon during each timed FUSE phase; raw stacks to DIR")
    ap.add_argument("--profile-native", action="store_true",
                    help="with --profile: also sample C frames (py-spy --native)")
    args = ap.parse_args(argv)

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    if any(s <= 0 or s % 4096 for s in sizes):
        ap.error("sizes must be positive multiples of 4 KiB (O_DIRECT on the disk)")
    if args.write_size < 0 or args.write_size % 4096:
        ap.error("--write-size must be a multiple of 4 KiB (O_DIRECT on the disk)")
    global WRITE_PIECE, READ_DIRECT
    WRITE_PIECE = args.write_size
    READ_DIRECT = args.read_direct
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if bad := [c for c in configs if c not in CONFIGS]:
        ap.error(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    configs = [c for c in CONFIGS if c in configs]  # fixed order
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    # Ctrl-C and SIGTERM both unwind through the finally blocks that unmount and clean up;
    # the watchdog kills a daemon that keeps the benchmark stuck in a FUSE request.
    WATCHDOG.install()
    t_start = time.monotonic()

    limit = None
    try:
        env = kvfs_env()
        if args.disk_read_limit:
            limit = DiskReadLimit(args.base_dir, args.disk_read_limit)
    except (BenchError, OSError) as exc:
        log(f"bench_fs: {exc}")
        return 2
    try:
        return run(args, sizes, configs, env, limit, t_start, argv)
    finally:
        if limit is not None:
            limit.remove()


def run(args, sizes: list[int], configs: list[str], env: dict, limit: DiskReadLimit | None,
        t_start: float, argv: list[str] | None) -> int:
    data = {"kv": kv_blocks(DATA, max(sizes))}
    if any(c in WRITE_ONLY for c in configs):
        data["random"] = random_blocks(max(sizes))  # generated once, outside any timing
    rbuf = mmap.mmap(-1, (max(sizes) + PAGE - 1) // PAGE * PAGE)
    rbuf.write(b"\0" * len(rbuf))  # fault the read buffer in once
    buf = memoryview(rbuf)
    prof_dir = Path(args.profile).resolve() if args.profile else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    prof = Profiler(prof_dir, args.profile_native)

    cmd = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    header = [
        f"command: {cmd}",
        f"kvfs: {REPO} @ {git_rev()}; fuse-null: {NULLFS.relative_to(REPO)}",
        f"kvfs options: chunk_size={fmt_size(args.chunk_size)}, segment_size="
        f"{fmt_size(args.segment_size)}, nvme_size={fmt_size(args.nvme_size)}; DRAM tier: "
        f"2 x data + 64 MiB (kvfs-dram), {fmt_size(args.nvme_dram)} (kvfs-nvme*); "
        f"compression on, off in *-raw* (-o compress=0)"
        f"{'; also -o ' + args.kvfs_options if args.kvfs_options else ''}",
        f"machine: {os.cpu_count()} CPUs, {platform.node()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}",
        f"tmpfs: {mount_info('/dev/shm')}; disk: {args.base_dir} = {mount_info(args.base_dir)}"
        + (f"; its reads capped at {fmt_size(args.disk_read_limit)}/s (device {limit.device}, "
           f"{limit.group})" if limit else ""),
        f"data: {data['kv'].source}, cycled; {fmt_size(args.total)} per configuration and "
        f"size; reads {'verified' if args.verify else 'not verified'}; written "
        f"{fmt_size(WRITE_PIECE) + ' per write()' if WRITE_PIECE else 'in one write() a file'}"
        f"{'; every read O_DIRECT' if READ_DIRECT else ''}",
        "order: each round runs every configuration per size, interleaved, reversed in every "
        "other round; ratios are paired within a round",
    ]
    if "random" in data:
        header.append(f"random data ({', '.join(c for c in configs if c in WRITE_ONLY)}): "
                      f"{data['random'].source}, write pass only")
    if any(c.startswith("kvfs-nvme") for c in configs) and args.total <= args.nvme_dram:
        header.append(f"note: --total {fmt_size(args.total)} fits in the kvfs-nvme DRAM tier "
                      f"({fmt_size(args.nvme_dram)}): its writes do not stream through demotion")
    log("\n".join(header))

    runs: dict = {s: {c: [] for c in configs} for s in sizes}
    errors: dict = {}
    orders: list[list[str]] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.base_dir))
    try:
        for rep in range(args.repeat):
            # Reversed every other round: a machine that speeds up or slows down over a round
            # then does not always favour the configuration that runs first in a pair.
            order = configs if rep % 2 == 0 else configs[::-1]
            orders.append(order)
            for size in sizes:
                n = max(1, args.total // size)
                # The random-data pair is measured together, batch by batch.
                groups = [[c] for c in order if c not in WRITE_ONLY + READ_PAIR]
                for members in (WRITE_ONLY, READ_PAIR):
                    pair = [c for c in order if c in members]
                    if pair:
                        groups.append(pair)
                groups.sort(key=lambda g: order.index(g[0]))
                for group in groups:
                    log(f"round {rep + 1}/{args.repeat}: {fmt_size(size)} x {n} files, "
                        f"{' + '.join(group)} ...")
                    WATCHDOG.fired = None
                    t0 = time.monotonic()
                    try:
                        got = measure(group, size, n, data, buf, tmp, args, env, prof)
                    except (BenchError, OSError) as exc:
                        log(f"    FAILED: {exc}")
                        for cfg in group:
                            errors.setdefault(size, {})[cfg] = f"round {rep + 1}: {exc}"
                        continue
                    for cfg, r in got.items():
                        r["rep"] = rep
                        runs[size][cfg].append(r)
                        read = (f", read {r['read_gibs']:.2f} GiB/s ({r['read_fps']:,.0f} "
                                f"files/s)" if r["read_gibs"] is not None else "")
                        log(f"    {cfg}: write {r['write_gibs']:.2f} GiB/s "
                            f"({r['write_fps']:,.0f} files/s){read}")
                    log(f"    [{time.monotonic() - t0:.1f} s]")
    except KeyboardInterrupt:
        log("interrupted: mounts and directories cleaned up")
        return 130
    finally:
        prof.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - t_start

    summary = aggregate(runs, args.stat)
    gl = goals(summary, sizes)
    ratios: dict = {}
    spreads: dict = {}
    for s in sizes:
        ratios[str(s)], spreads[str(s)] = {}, {}
        for key, a, b, _label in RATIOS:
            for metric, suffix in (("write_gibs", "write"), ("read_gibs", "read")):
                r = ratio(summary, s, a, b, metric)
                ratios[str(s)][f"{key}_{suffix}"] = r.value if r else None
                if r:
                    spreads[str(s)][f"{key}_{suffix}"] = r._asdict()
    out = {"command": cmd, "header": header, "stat": args.stat, "repeat": args.repeat,
           "orders": orders, "results": {str(s): v for s, v in summary.items()},
           "ratios": ratios, "ratio_spread": spreads, "goals": gl, "profiles": prof.reports,
           "errors": {str(k): v for k, v in errors.items()}, "elapsed_s": round(elapsed, 1)}
    text = json.dumps(out, indent=1, default=str)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_report(summary, sizes, configs, header, gl, prof.reports, args.stat, args.repeat,
                     errors, elapsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
