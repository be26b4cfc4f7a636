#!/usr/bin/env python3
"""Foundation benchmark: kvfs against tmpfs and a raw O_DIRECT disk, KV block files.

For each file size (default 256 KiB, 4 MiB, 32 MiB) and each of four configurations

    tmpfs       plain files in a fresh directory under /dev/shm
    kvfs-dram   kvfs whose DRAM tier holds the whole working set (reads verified DRAM-resident)
    disk        plain files on the NVMe filesystem (ext4), O_DIRECT from aligned buffers,
                page cache dropped between the write and the read pass
    kvfs-nvme   kvfs with a DRAM tier much smaller than the data (writes stream through
                demotion); then a clean unmount, the DRAM tier is thrown away and the store
                remounted with a fresh one, so every chunk is on NVMe only (verified) before
                the read pass

it writes N = total/size files and reads them back, the way an engine does:

    write: open(O_CREAT|O_TRUNC) / one write() of the whole file / close   (per file)
    read:  open / readinto(whole file, preallocated page-aligned buffer) / close

and prints write and read throughput (GiB/s) and files/s side by side, the ratios
kvfs-dram/tmpfs and kvfs-nvme/disk, and the goals check. Data are real KV-cache bytes
(SmolLM2 bf16, /work/shared/data/kv/smollm2_kv_bf16.npy) sliced token-major into blocks and
cycled. Every read is checked against what was written (outside the timed region).

Timed: the write loop (kvfs-nvme: including waits for demotion, not the final write-back at
unmount, which is reported separately; disk: not the sync after it) and open/read/close of
each file. kvfs runs from this checkout (`python -m kvfs`); while kvfs/store/codec.py does not
exist yet, with the stand-in shim in $KVFS_SHIM (default /tmp/shim) on PYTHONPATH.

Each kvfs mount gets a fresh NVMe directory under a temporary directory (on the disk) and a
fresh DRAM directory under /dev/shm; mounts and directories are always removed, even on
Ctrl-C (a watchdog kills a daemon that keeps the benchmark stuck, and any phase longer than
--timeout). Run as root (drop_caches, FUSE allow_other).

    python tools/bench_fs.py [--sizes 256K,4M,32M] [--total 512M] [--repeat N]
                             [--stat median|best] [--configs tmpfs,kvfs-dram,disk,kvfs-nvme]
                             [--json | --json-out FILE] [--profile DIR [--profile-native]]

--repeat N runs everything N times, configurations interleaved; figures are the median (or
best) of the runs, ratios the median of per-run kvfs/baseline ratios. With --profile DIR,
py-spy samples the daemon during each timed kvfs phase and the top hotspots are printed
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

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parents[2] / "shared/data/kv/smollm2_kv_bf16.npy"
PAGE = mmap.PAGESIZE
GIB = 1 << 30
CONFIGS = ("tmpfs", "kvfs-dram", "disk", "kvfs-nvme")
LABELS = {"tmpfs": "tmpfs", "kvfs-dram": "kvfs DRAM-resident", "disk": "disk O_DIRECT",
          "kvfs-nvme": "kvfs NVMe-resident"}
# Goals (4-32 MiB files): ratios to the baselines; 256 KiB files: files/s.
GOAL_DRAM_READ = 0.6
GOAL_DRAM_WRITE = 0.4
GOAL_NVME_READ = 0.7
GOAL_SMALL_FPS = 2000
SMALL = 256 << 10
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
    """Real KV bytes in one page-aligned anonymous mmap; block i of size S is the slice at
    (i*S) mod L, so every block is page-aligned (usable for O_DIRECT) and the data cycle."""

    def __init__(self, path: Path, max_size: int) -> None:
        arr = np.load(path)  # [layer, K/V, token, head, dim]: token-major within a layer
        raw = arr.tobytes()
        self.period = len(raw) // PAGE * PAGE
        length = self.period + max_size
        self.buf = mmap.mmap(-1, (length + PAGE - 1) // PAGE * PAGE)
        pos = 0
        while pos < length:
            n = min(self.period, length - pos)
            self.buf[pos:pos + n] = raw[:n]
            pos += n
        self.view = memoryview(self.buf)
        self.source = f"{path} ({len(raw):,} bytes, shape {list(arr.shape)} {arr.dtype})"

    def block(self, i: int, size: int) -> memoryview:
        off = (i * size) % self.period
        return self.view[off:off + size]


# -- file I/O (the timed part) ----------------------------------------------------------------
def write_files(paths: list[str], size: int, blocks: Blocks, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    data = [blocks.block(i, size) for i in range(len(paths))]
    t0 = time.perf_counter()
    for path, mv in zip(paths, data, strict=True):
        fd = os.open(path, flags, 0o644)
        try:
            pos = 0
            while pos < size:
                pos += os.write(fd, mv[pos:])
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def read_files(paths: list[str], size: int, blocks: Blocks, buf: memoryview, direct: bool,
               verify: bool) -> float:
    """Seconds spent in open/read/close only; the check against the source is not timed."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
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
        elapsed += time.perf_counter() - t0
        if pos != size:
            raise BenchError(f"{path}: read {pos} bytes, expected {size}")
        if verify and not np.array_equal(
                got, np.frombuffer(blocks.block(i, size), dtype=np.uint8)):
            raise BenchError(f"{path}: data read back differ from the data written")
    return elapsed


def file_paths(directory: str, n: int) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [os.path.join(directory, f"blk{i:06d}.kv") for i in range(n)]


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# -- kvfs mounts ------------------------------------------------------------------------------
def kvfs_env() -> tuple[dict, str]:
    """Environment for `python -m kvfs` from this checkout, and a description of it."""
    env = dict(os.environ)
    desc = []
    if (REPO / "kvfs" / "store" / "codec.py").exists():
        env["PYTHONPATH"] = str(REPO)
        desc.append("codec: kvfs/store/codec.py")
    else:
        shim = Path(os.environ.get("KVFS_SHIM", "/tmp/shim"))
        if not (shim / "sitecustomize.py").exists():
            raise BenchError(f"kvfs/store/codec.py is missing and no shim at {shim}")
        env["PYTHONPATH"] = f"{shim}:{REPO}"
        desc.append(f"codec: stand-in shim {shim} (raw, no compression)")
        if list((REPO / "kvfs").glob("_index*.so")) and "KVFS_NO_SHIM__index" not in env:
            env["KVFS_NO_SHIM__index"] = "1"  # the native index is built: use it
        desc.append("index: " + ("native" if env.get("KVFS_NO_SHIM__index") else "shim (dict)"))
    return env, ", ".join(desc)


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "kvfs",
                                "native"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def mounted(path: str) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


class KvfsMount:
    def __init__(self, base: Path, env: dict, options: dict) -> None:
        self.base = base
        self.path = base / "mnt"
        self.nvme_dir = base / "nvme"
        self.dram_dir = Path(f"/dev/shm/kvfs-bench-{uuid.uuid4().hex[:12]}")
        self.log = base / "kvfs.log"
        self.env = env
        self.options = options
        self.path.mkdir(parents=True, exist_ok=True)

    def mount(self, **extra) -> None:
        opts = ",".join(f"{k}={v}" for k, v in {**self.options, **extra}.items())
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

    def force_unmount(self) -> None:
        pid = self.pid()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
        subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)

    def alive(self) -> bool:
        pid = self.pid()
        if not pid:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def cleanup(self) -> None:
        """Unmount (cleanly if possible) and remove both tier directories."""
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
            shutil.rmtree(self.dram_dir, ignore_errors=True)

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

    def log_tail(self, n: int = 15) -> str:
        try:
            return "".join(self.log.read_text().splitlines(keepends=True)[-n:])
        except OSError:
            return ""


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
    """Gets kvfs unstuck when the benchmark's own thread cannot act.

    A client blocked in a FUSE request does not take Ctrl-C until the daemon answers, so a
    wedged daemon would wedge the benchmark too. This thread polls the signals pending on the
    process (/proc: a signal the main thread cannot take yet stays pending) and the deadline
    of the current phase; if SIGINT/SIGTERM stays pending for GRACE seconds, or a phase
    overruns its deadline, it SIGKILLs the live kvfs daemons: the blocked syscall then fails,
    and the main thread unwinds through its cleanup.
    """

    GRACE = 3.0
    MASK = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))

    def __init__(self) -> None:
        super().__init__(name="bench-watchdog", daemon=True)
        self.mounts: set[KvfsMount] = set()
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
def result(size: int, n: int, t_write: float, t_read: float, **extra) -> dict:
    total = size * n
    return {"files": n, "bytes": total, "write_s": t_write, "read_s": t_read,
            "write_gibs": total / t_write / GIB, "read_gibs": total / t_read / GIB,
            "write_fps": n / t_write, "read_fps": n / t_read, **extra}


def run_plain(kind: str, size: int, n: int, blocks: Blocks, buf: memoryview, tmp: Path,
              args) -> dict:
    direct = kind == "disk"
    root = tmp / "disk" if direct else Path(f"/dev/shm/kvfs-bench-tmpfs-{uuid.uuid4().hex[:8]}")
    try:
        paths = file_paths(str(root / "blocks"), n)
        t_write = write_files(paths, size, blocks, direct)
        dropped = drop_caches() if direct else None
        t_read = read_files(paths, size, blocks, buf, direct, args.verify)
        return result(size, n, t_write, t_read, caches_dropped=dropped)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_kvfs(kind: str, size: int, n: int, blocks: Blocks, buf: memoryview, tmp: Path,
             args, env: dict, prof: Profiler) -> dict:
    total = size * n
    if kind == "kvfs-dram":
        dram = max(2 * total + (64 << 20), 256 << 20)  # the high watermark stays far away
    else:
        dram = args.nvme_dram
    opts = {"dram_size": dram, "nvme_size": args.nvme_size, "chunk_size": args.chunk_size,
            "segment_size": args.segment_size}
    m = KvfsMount(tmp / f"{kind}-{uuid.uuid4().hex[:8]}", env, opts)
    tag = f"{kind}-{fmt_size(size).replace(' ', '')}"
    extra: dict = {"dram_size": dram}
    step = "mount"
    try:
        m.mount()
        paths = file_paths(str(m.path / "blocks"), n)
        step = "write pass"
        with WATCHDOG.timed(step, args.timeout), prof.phase(f"{tag}-write", m.pid()):
            t_write = write_files(paths, size, blocks, direct=False)
        st = m.status()
        extra["after_write"] = {t: {k: st["tiers"][t][k] for k in ("used_bytes", "chunks")}
                                for t in ("dram", "nvme")}
        extra["after_write"]["demotions"] = st["moves"]["demotions"]
        step = "residency check"
        if kind == "kvfs-dram":
            with WATCHDOG.timed(step, args.timeout):
                extra["residency"] = check_residency(paths, size, args.chunk_size, "dram")
        else:
            # A clean unmount writes the rest back; then the DRAM tier is thrown away and the
            # store remounted with a fresh one: every chunk is on NVMe only.
            step = "unmount (write-back of dirty DRAM)"
            with WATCHDOG.timed(step, args.timeout):
                extra["drain_s"] = m.unmount()
            shutil.rmtree(m.dram_dir, ignore_errors=True)
            m.dram_dir = Path(f"/dev/shm/kvfs-bench-{uuid.uuid4().hex[:12]}")
            step = "remount"
            m.mount()
            step = "residency check"
            with WATCHDOG.timed(step, args.timeout):
                extra["residency"] = check_residency(paths, size, args.chunk_size, "nvme")
            extra["caches_dropped"] = drop_caches()
        before = m.status()
        step = "read pass"
        with WATCHDOG.timed(step, args.timeout), prof.phase(f"{tag}-read", m.pid()):
            t_read = read_files(paths, size, blocks, buf, direct=False, verify=args.verify)
        after = m.status()
        extra["read_chunks"] = {
            k: after["reads"][k] - before["reads"][k]
            for k in ("chunks_from_dram", "chunks_from_nvme", "checksum_errors")}
        extra["read_chunks"]["promotions"] = (after["moves"]["promotions"]
                                              - before["moves"]["promotions"])
        nbad, first = m.log_problems()
        if nbad:
            extra["log_problems"] = {"count": nbad, "first": first}
        return result(size, n, t_write, t_read, **extra)
    except (OSError, BenchError, subprocess.SubprocessError) as exc:
        why = WATCHDOG.fired or f"{step} failed"
        nbad, first = m.log_problems()
        msg = f"{why}: {exc}"
        if WATCHDOG.fired and "timed out" in WATCHDOG.fired:
            msg = f"{why} after {args.timeout:.0f} s (daemon killed)"
        if nbad:
            msg += f"; daemon log: {nbad} warnings/errors, e.g. " + " | ".join(first[:2])
        raise BenchError(msg) from None
    finally:
        prof.stop()
        m.cleanup()
        shutil.rmtree(m.base, ignore_errors=True)


# -- reporting ---------------------------------------------------------------------------------
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
            out[size][cfg] = {k: pick([r[k] for r in rs], stat)
                              for k in ("write_gibs", "read_gibs", "write_fps", "read_fps")}
            out[size][cfg]["files"] = rs[0]["files"]
            out[size][cfg]["runs"] = rs
        out[size]["stat"] = stat
    return out


def ratio(summary: dict, size: int, a: str, b: str, metric: str) -> float | None:
    """kvfs/baseline. Runs are paired (same repetition, measured one right after the other),
    so with --stat median this is the median of the per-run ratios, which a noisy machine
    disturbs less than a ratio of two medians; with --stat best it is best over best."""
    s = summary.get(size, {})
    if a not in s or b not in s:
        return None
    if s.get("stat") == "best":
        return s[a][metric] / s[b][metric] if s[b][metric] > 0 else None
    base = {r["rep"]: r[metric] for r in s[b]["runs"]}
    pairs = [r[metric] / base[r["rep"]] for r in s[a]["runs"] if base.get(r["rep"], 0) > 0]
    return statistics.median(pairs) if pairs else None


def goals(summary: dict, sizes: list[int]) -> list[dict]:
    out = []
    big = [s for s in sizes if (4 << 20) <= s <= (32 << 20)]
    checks = [("kvfs-dram", "tmpfs", "read_gibs", GOAL_DRAM_READ, "DRAM-resident reads"),
              ("kvfs-dram", "tmpfs", "write_gibs", GOAL_DRAM_WRITE, "DRAM-resident writes"),
              ("kvfs-nvme", "disk", "read_gibs", GOAL_NVME_READ, "NVMe-resident reads")]
    for a, b, metric, goal, what in checks:
        for size in big:
            r = ratio(summary, size, a, b, metric)
            entry = {"goal": f"{fmt_size(size)} {what} >= {goal}x {LABELS[b]}", "ratio": r,
                     "target": goal}
            if r is None:
                entry.update(verdict="n/a", figure="not measured")
            else:
                entry.update(verdict="PASS" if r >= goal else "FAIL",
                             figure=f"{r:.2f}x ({summary[size][a][metric]:.2f} vs "
                                    f"{summary[size][b][metric]:.2f} GiB/s)")
            out.append(entry)
        if not big:
            out.append({"goal": f"4-32 MiB {what}", "verdict": "n/a",
                        "figure": "no size in 4M..32M measured"})
    for cfg in ("kvfs-dram", "kvfs-nvme"):
        for metric, what in (("write_fps", "written"), ("read_fps", "read")):
            s = summary.get(SMALL, {}).get(cfg)
            entry = {"goal": f"256 KiB files {what} >= {GOAL_SMALL_FPS:,}/s ({LABELS[cfg]})",
                     "target": GOAL_SMALL_FPS}
            if s is None:
                why = ("add 256K to --sizes" if SMALL not in sizes
                       else "configuration not run or failed")
                entry.update(verdict="n/a", figure=f"not measured ({why})")
            else:
                entry.update(value=s[metric], figure=f"{s[metric]:,.0f} files/s",
                             verdict="PASS" if s[metric] >= GOAL_SMALL_FPS else "FAIL")
            out.append(entry)
    return out


def print_report(summary: dict, sizes: list[int], configs: list[str], header: list[str],
                 gl: list[dict], profiles: dict, stat: str, repeat: int,
                 errors: dict) -> None:
    p = print
    for line in header:
        p(line)
    p()
    p(f"Throughput ({stat} of {repeat} run{'s' if repeat > 1 else ''}; GiB/s = 2^30 bytes/s)")
    hdr = (f"{'size':>8}  {'configuration':<20} {'files':>6}  {'write GiB/s':>11} "
           f"{'read GiB/s':>10}  {'write files/s':>13} {'read files/s':>12}")
    p(hdr)
    p("-" * len(hdr))
    for size in sizes:
        first = True
        for cfg in configs:
            s = summary.get(size, {}).get(cfg)
            if s is None:
                if cfg in errors.get(size, {}):
                    p(f"{fmt_size(size) if first else '':>8}  {LABELS[cfg]:<20} "
                      f"{'FAILED (see Errors)':>24}")
                    first = False
                continue
            p(f"{fmt_size(size) if first else '':>8}  {LABELS[cfg]:<20} {s['files']:>6}  "
              f"{s['write_gibs']:>11.2f} {s['read_gibs']:>10.2f}  {s['write_fps']:>13,.0f} "
              f"{s['read_fps']:>12,.0f}")
            first = False
    if repeat > 1:
        p()
        p("Spread over runs (min-max GiB/s, write | read)")
        for size in sizes:
            for cfg in configs:
                s = summary.get(size, {}).get(cfg)
                if s is None:
                    continue
                w = [r["write_gibs"] for r in s["runs"]]
                r_ = [r["read_gibs"] for r in s["runs"]]
                p(f"{fmt_size(size):>8}  {LABELS[cfg]:<20} {min(w):5.2f}-{max(w):<5.2f} | "
                  f"{min(r_):5.2f}-{max(r_):<5.2f}")
    p()
    if stat == "median" and repeat > 1:
        p("Ratios (median of per-run ratios; each kvfs run is paired with the baseline run of "
          "the same repetition)")
    else:
        p(f"Ratios ({stat} kvfs figure / {stat} baseline figure)")
    hdr = (f"{'size':>8}  {'kvfs-DRAM/tmpfs write':>21} {'read':>6}   "
           f"{'kvfs-NVMe/disk write':>20} {'read':>6}")
    p(hdr)
    p("-" * len(hdr))

    def f(x):
        return f"{x:.2f}x" if x is not None else "n/a"

    for size in sizes:
        p(f"{fmt_size(size):>8}  {f(ratio(summary, size, 'kvfs-dram', 'tmpfs', 'write_gibs')):>21} "
          f"{f(ratio(summary, size, 'kvfs-dram', 'tmpfs', 'read_gibs')):>6}   "
          f"{f(ratio(summary, size, 'kvfs-nvme', 'disk', 'write_gibs')):>20} "
          f"{f(ratio(summary, size, 'kvfs-nvme', 'disk', 'read_gibs')):>6}")
    p("(kvfs-NVMe writes: DRAM tier smaller than the data, so they stream through demotion;"
      " the disk baseline writes straight to the device)")
    notes = []
    for size in sizes:
        for cfg in ("kvfs-dram", "kvfs-nvme"):
            s = summary.get(size, {}).get(cfg)
            if s is None:
                continue
            r = s["runs"][-1]
            rc = r["read_chunks"]
            aw = r["after_write"]
            line = (f"{fmt_size(size):>8}  {LABELS[cfg]:<20} DRAM tier {fmt_size(r['dram_size'])}; "
                    f"after writes {aw['dram']['chunks']} chunks in DRAM, {aw['nvme']['chunks']} "
                    f"on NVMe ({aw['demotions']} demotions); before reads "
                    + ", ".join(f"{k}: {v}" for k, v in r["residency"].items())
                    + f"; reads served {rc['chunks_from_dram']} chunks from DRAM, "
                      f"{rc['chunks_from_nvme']} from NVMe, {rc['promotions']} promoted")
            if "drain_s" in r:
                line += f"; unmount write-back {r['drain_s']:.1f} s"
            if "log_problems" in r:
                lp = r["log_problems"]
                line += f"; daemon log: {lp['count']} warnings/errors, e.g. {lp['first'][0]}"
            notes.append(line)
    if notes:
        p()
        p("kvfs placement (last run; tiers from user.kvfs.where, counts from user.kvfs.status)")
        for line in notes:
            p(line)
    if errors:
        p()
        p("Errors (the configuration is left out of the table for that size)")
        for size, per in errors.items():
            for cfg, msg in per.items():
                p(f"{fmt_size(size):>8}  {LABELS[cfg]}: {msg}")
    p()
    p("Goals")
    for g in gl:
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
    ap.add_argument("--repeat", type=int, default=1, help="runs of everything (default 1)")
    ap.add_argument("--stat", choices=("median", "best"), default="median",
                    help="how --repeat runs are combined (default median)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="subset of %(default)s")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    ap.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    ap.add_argument("--base-dir", default="/var/tmp",
                    help="directory on the NVMe filesystem for the disk baseline and kvfs's "
                         "NVMe tier (default %(default)s)")
    ap.add_argument("--nvme-dram", type=parse_size, default=parse_size("64M"),
                    help="DRAM tier of the kvfs-nvme configuration (default 64M)")
    ap.add_argument("--nvme-size", type=parse_size, default=parse_size("8G"),
                    help="NVMe tier capacity of every kvfs mount (default 8G)")
    ap.add_argument("--chunk-size", type=parse_size, default=parse_size("1M"),
                    help="kvfs chunk_size (default 1M)")
    ap.add_argument("--segment-size", type=parse_size, default=parse_size("64M"),
                    help="kvfs segment_size (default 64M)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds one kvfs phase may take before its daemon is killed and the "
                         "configuration reported as failed (default %(default)s)")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="do not compare the bytes read with the bytes written")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="py-spy the daemon during each timed kvfs phase; raw stacks to DIR")
    ap.add_argument("--profile-native", action="store_true",
                    help="with --profile: also sample C frames (py-spy --native)")
    args = ap.parse_args(argv)

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    if any(s <= 0 or s % 4096 for s in sizes):
        ap.error("sizes must be positive multiples of 4 KiB (O_DIRECT on the disk)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if bad := [c for c in configs if c not in CONFIGS]:
        ap.error(f"unknown configuration(s) {bad}; choose from {list(CONFIGS)}")
    configs = [c for c in CONFIGS if c in configs]  # fixed order
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")

    # Ctrl-C and SIGTERM both unwind through the finally blocks that unmount and clean up;
    # the watchdog kills a daemon that keeps the benchmark stuck in a FUSE request.
    WATCHDOG.install()

    env, kvfs_desc = kvfs_env()
    blocks = Blocks(DATA, max(sizes))
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
        f"kvfs: {REPO} @ {git_rev()}; {kvfs_desc}",
        f"kvfs options: chunk_size={fmt_size(args.chunk_size)}, segment_size="
        f"{fmt_size(args.segment_size)}, nvme_size={fmt_size(args.nvme_size)}; DRAM tier: "
        f"2 x data + 64 MiB (kvfs-dram), {fmt_size(args.nvme_dram)} (kvfs-nvme)",
        f"machine: {os.cpu_count()} CPUs, {platform.node()}, Linux {platform.release()}, "
        f"Python {platform.python_version()}",
        f"tmpfs: {mount_info('/dev/shm')}; disk: {args.base_dir} = {mount_info(args.base_dir)}",
        f"data: {blocks.source}, cycled; {fmt_size(args.total)} per configuration and size; "
        f"reads {'verified' if args.verify else 'not verified'}",
    ]
    if "kvfs-nvme" in configs and args.total <= args.nvme_dram:
        header.append(f"note: --total {fmt_size(args.total)} fits in the kvfs-nvme DRAM tier "
                      f"({fmt_size(args.nvme_dram)}): its writes do not stream through demotion")
    log("\n".join(header))

    runs: dict = {s: {c: [] for c in configs} for s in sizes}
    errors: dict = {}
    tmp = Path(tempfile.mkdtemp(prefix="kvfs-bench-", dir=args.base_dir))
    try:
        for rep in range(args.repeat):
            for size in sizes:
                n = max(1, args.total // size)
                for cfg in configs:
                    log(f"run {rep + 1}/{args.repeat}: {fmt_size(size)} x {n} files, {cfg} ...")
                    try:
                        if cfg.startswith("kvfs"):
                            r = run_kvfs(cfg, size, n, blocks, buf, tmp, args, env, prof)
                        else:
                            r = run_plain(cfg, size, n, blocks, buf, tmp, args)
                    except (BenchError, OSError) as exc:
                        log(f"    FAILED: {exc}")
                        errors.setdefault(size, {})[cfg] = str(exc)
                        continue
                    r["rep"] = rep
                    runs[size][cfg].append(r)
                    log(f"    write {r['write_gibs']:.2f} GiB/s ({r['write_fps']:,.0f} files/s)"
                        f", read {r['read_gibs']:.2f} GiB/s ({r['read_fps']:,.0f} files/s)")
    except KeyboardInterrupt:
        log("interrupted: mounts and directories cleaned up")
        return 130
    finally:
        prof.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    summary = aggregate(runs, args.stat)
    gl = goals(summary, sizes)
    out = {"command": cmd, "header": header, "stat": args.stat, "repeat": args.repeat,
           "results": {str(s): v for s, v in summary.items()},
           "ratios": {str(s): {
               "kvfs_dram_tmpfs_write": ratio(summary, s, "kvfs-dram", "tmpfs", "write_gibs"),
               "kvfs_dram_tmpfs_read": ratio(summary, s, "kvfs-dram", "tmpfs", "read_gibs"),
               "kvfs_nvme_disk_write": ratio(summary, s, "kvfs-nvme", "disk", "write_gibs"),
               "kvfs_nvme_disk_read": ratio(summary, s, "kvfs-nvme", "disk", "read_gibs")}
               for s in sizes},
           "goals": gl, "profiles": prof.reports,
           "errors": {str(k): v for k, v in errors.items()}}
    text = json.dumps(out, indent=1, default=str)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if args.json:
        print(text)
    else:
        print_report(summary, sizes, configs, header, gl, prof.reports, args.stat, args.repeat,
                     errors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
