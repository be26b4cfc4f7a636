#!/usr/bin/env python3
"""Engine-shaped benchmark (issue 36): each real engine's file pattern through kvfs, against
tmpfs (DRAM-resident), a cold ext4 directory on the same disk (NVMe-resident) and an empty
FUSE filesystem (per-file operations), in one run, as ratios.

Patterns (../shared/docs/CLIENTS.md; sizes of Llama-3-8B in bf16, the engines' own flags and
thread counts):

    vllm-fs        vLLM's offloading fs tier: 2 MiB blocks under a two-level fan-out,
                   faccessat probe, temp file O_CREAT|O_EXCL|O_WRONLY|O_TRUNC|O_DIRECT, one
                   write, os.replace; reads O_RDONLY|O_DIRECT, one readv; 16 write and 16
                   read threads; O_DIRECT probed once with a 4 KiB aligned write
    sglang         SGLang HiCache file backend: 8 MiB pages in one flat directory, an
                   exists() of the (absent) name, `.<uuid>.tmp` written in one write,
                   os.replace; reads open(rb, buffering=0).readinto of the whole file
    lmcache        LMCache local disk: 32 MiB `.pt` files named with `@`, 4 threads,
                   open("wb").write / readinto
    lmcache-direct the same with O_DIRECT (the size is a multiple of statvfs().f_bsize)
    vllm-example   vLLM ExampleConnector: one directory per prompt, 2 MiB safetensors per
                   layer written `.tmpXXXXXX` (O_RDWR|O_CREAT|O_EXCL 0600), ftruncate, one
                   write, rename; read by page faults of an mmap(MAP_PRIVATE)
    llamacpp       llama.cpp slot save/restore: one state file of --state-size, written in
                   4 and 32 KiB write()s as stdio does, read back sequentially in 4 and 32 KiB
                   reads after an fstat and a seek to the end
    dynamo         NVIDIA Dynamo KVBM disk tier: one mkstemp file unlinked while open,
                   fcntl(F_SETFL, O_DIRECT), fallocate(0) of the whole size, pwrite / pread of
                   2 MiB blocks at block offsets from 4 threads

Targets: tmpfs (a directory under /dev/shm), kvfs-dram (a DRAM tier larger than everything
written: every read is DRAM-resident), disk (a plain directory on the ext4 filesystem under
--base-dir, written with the engine's own flags, then synced and the page cache dropped: read
cold), kvfs-nvme (a --nvme-dram DRAM tier, 64 MiB by default: writes bigger than it stream
through demotion; then every file is demoted (user.kvfs.demote, as `kvfsctl demote`), and the
page cache dropped before the read pass).

Per-file operations, on tmpfs, kvfs-dram and fuse-null (tools/nullfs.py): --files creates of
4 KiB files (O_CREAT|O_EXCL, one write, close), as many lookups of absent names (access(F_OK),
distinct names: each one a LOOKUP), stats of every file after the kernel's dentries are dropped
(each one a LOOKUP, as a restarted engine's listdir + stat of a directory of blocks), and
unlinks. The goal compares kvfs with fuse-null: what kvfs adds to FUSE's own round trip.

Every read is checked: the length of every file, and in every file its first, middle and last
4 KiB against what was written (inside the timed region; --verify full compares every byte,
outside it, with an untimed second read pass). Ratios compare runs of one round; with --repeat
N the report gives the median of the per-round ratios.

    python tools/bench_engines.py [--quick] [--patterns vllm-fs,sglang,...] [--total 256M]
                                  [--repeat N] [--kvfs-options K=V,...] [--json-out FILE]

A full run takes ~4-6 minutes here, --quick ~1-2. Run as root (drop_caches, FUSE).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import mmap
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fs as bf  # noqa: E402

PAGE = mmap.PAGESIZE
MIB = 1 << 20
PATTERNS = ("vllm-fs", "sglang", "lmcache", "lmcache-direct", "vllm-example", "llamacpp",
            "dynamo")
TARGETS = ("tmpfs", "kvfs-dram", "disk", "kvfs-nvme")
# Goals of issue 36.
GOAL_DRAM_READ = 0.8
GOAL_DRAM_WRITE = 0.6
GOAL_NVME_READ = 0.8
GOAL_FILE_OPS = 0.8
LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
LIBC.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- running work on the engine's threads ----------------------------------------------------
def on_threads(nthreads: int, n: int, work: Callable[[int, int], int]) -> tuple[float, int]:
    """Items 0..n-1 spread over *nthreads* threads (thread t takes t, t+nthreads, ...):
    work(thread, item) returns bytes moved. Returns (wall seconds, bytes); the first error
    of any thread is raised."""
    nthreads = max(1, min(nthreads, n))
    moved = [0] * nthreads
    errors: list[BaseException] = []
    start = threading.Barrier(nthreads + 1)

    def run(t: int) -> None:
        start.wait()
        try:
            for i in range(t, n, nthreads):
                moved[t] += work(t, i)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(nthreads)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return elapsed, sum(moved)


def aligned(size: int) -> memoryview:
    m = mmap.mmap(-1, max(PAGE, (size + PAGE - 1) // PAGE * PAGE))
    m.write(b"\0" * len(m))  # fault it in outside any timing
    return memoryview(m)


class Checker:
    """What was written, to check what is read: file i's bytes are blocks.block(i, size)."""

    def __init__(self, blocks: bf.Blocks) -> None:
        self.blocks = blocks

    def sample(self, what: str, got: memoryview, n: int, i: int, size: int) -> None:
        if n != size:
            raise bf.BenchError(f"{what}: read {n} bytes, expected {size}")
        want = self.blocks.block(i, size)
        for off in {0, (size // 2) // PAGE * PAGE, max(0, size - PAGE)}:
            if got[off:off + PAGE] != want[off:off + PAGE]:
                raise bf.BenchError(f"{what}: bytes at {off} differ from those written")

    def full(self, what: str, got: memoryview, i: int, size: int) -> None:
        if got[:size] != self.blocks.block(i, size):
            raise bf.BenchError(f"{what}: bytes differ from those written")


def read_fd(fd: int, buf: memoryview, size: int, piece: int = 0) -> int:
    """Read up to *size* bytes into buf with readv calls of *piece* bytes (0: the rest)."""
    pos = 0
    while pos < size:
        end = size if not piece else min(size, pos + piece)
        n = os.readv(fd, [buf[pos:end]])
        if n == 0:
            break
        pos += n
    return pos


def write_all(fd: int, data: memoryview) -> None:
    pos = 0
    while pos < len(data):
        pos += os.write(fd, data[pos:])


# -- patterns --------------------------------------------------------------------------------
@dataclass
class Run:
    """One pattern's files in one target directory."""
    root: str
    blocks: bf.Blocks
    check: Checker
    paths: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)  # files kept open (Dynamo's unlinked one)
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


class Pattern:
    name = ""
    size = 0  # bytes per file (per block for one-file patterns)
    wthreads = rthreads = 1

    def __init__(self, total: int, args) -> None:
        self.n = max(1, total // self.size)
        self.args = args

    @property
    def total(self) -> int:
        return self.n * self.size

    def describe(self) -> str:
        return (f"{self.n} x {bf.fmt_size(self.size)}, {self.wthreads} write / "
                f"{self.rthreads} read threads")

    def write(self, run: Run) -> tuple[float, int]:
        raise NotImplementedError

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        raise NotImplementedError

    def files(self, run: Run) -> list[str | int]:
        """What to demote to make the pattern NVMe-resident (paths or descriptors)."""
        return list(run.paths)


class VllmFs(Pattern):
    name, size, wthreads, rthreads = "vllm-fs", 2 * MIB, 16, 16

    def path(self, root: str, i: int) -> str:
        h = hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).hexdigest()
        return os.path.join(root, "Llama-3-8B_3f2a9c_r0", h[:3], f"{h[3:5]}_g0", f"{h}.bin")

    def write(self, run: Run) -> tuple[float, int]:
        direct = os.O_DIRECT
        probe = os.path.join(run.root, f".probe_{uuid.uuid4().hex[:8]}")
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_DIRECT, 0o644)
        try:
            os.write(fd, aligned(4096)[:4096])
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            direct = 0
            run.notes.append("O_DIRECT probe: EINVAL, buffered")
        finally:
            os.close(fd)
            os.unlink(probe)
        run.paths = [self.path(run.root, i) for i in range(self.n)]

        def one(t: int, i: int) -> int:
            dest = run.paths[i]
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            if os.access(dest, os.F_OK):
                return 0
            tmp = f"{dest}_{uuid.uuid4().hex[:8]}.tmp"
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_TRUNC | direct,
                         0o644)
            try:
                write_all(fd, run.blocks.block(i, self.size))
            finally:
                os.close(fd)
            os.replace(tmp, dest)
            return self.size

        return on_threads(self.wthreads, self.n, one)

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        bufs = [aligned(self.size) for _ in range(self.rthreads)]

        def one(t: int, i: int) -> int:
            path = run.paths[i]
            if not os.access(path, os.F_OK):
                raise bf.BenchError(f"{path}: gone")
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                n = os.readv(fd, [bufs[t][:self.size]])
            finally:
                os.close(fd)
            (run.check.full(path, bufs[t], i, self.size) if full
             else run.check.sample(path, bufs[t], n, i, self.size))
            return n

        return on_threads(self.rthreads, self.n, one)


class SGLang(Pattern):
    name, size = "sglang", 8 * MIB

    def write(self, run: Run) -> tuple[float, int]:
        run.paths = [os.path.join(run.root, f"{hashlib.sha256(str(i).encode()).hexdigest()}"
                                  f"_Llama-3-8B_0_1.bin") for i in range(self.n)]

        def one(t: int, i: int) -> int:
            dest = run.paths[i]
            if os.path.exists(dest):
                return 0
            tmp = os.path.join(run.root, f".{uuid.uuid4()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                write_all(fd, run.blocks.block(i, self.size))
            finally:
                os.close(fd)
            os.replace(tmp, dest)
            return self.size

        return on_threads(self.wthreads, self.n, one)

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        buf = aligned(self.size)

        def one(t: int, i: int) -> int:
            with open(run.paths[i], "rb", buffering=0) as f:
                n = f.readinto(buf)
            (run.check.full(run.paths[i], buf, i, self.size) if full
             else run.check.sample(run.paths[i], buf, n, i, self.size))
            return n

        return on_threads(self.rthreads, self.n, one)


class LMCache(Pattern):
    name, size, wthreads, rthreads = "lmcache", 32 * MIB, 4, 4
    direct = False

    def write(self, run: Run) -> tuple[float, int]:
        run.paths = [os.path.join(run.root, f"Llama-3-8B@1@0@{i:016x}%{i}@bfloat16.pt")
                     for i in range(self.n)]
        flags = 0
        if self.direct and self.size % os.statvfs(run.root).f_bsize == 0:
            flags = os.O_DIRECT

        def one(t: int, i: int) -> int:
            data = run.blocks.block(i, self.size)
            if flags:
                fd = os.open(run.paths[i], os.O_CREAT | os.O_WRONLY | flags, 0o644)
                try:
                    write_all(fd, data)
                finally:
                    os.close(fd)
            else:
                with open(run.paths[i], "wb") as f:
                    f.write(data)
            return self.size

        return on_threads(self.wthreads, self.n, one)

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        bufs = [aligned(self.size) for _ in range(self.rthreads)]

        def one(t: int, i: int) -> int:
            if self.direct:
                fd = os.open(run.paths[i], os.O_RDONLY | os.O_DIRECT)
                try:
                    n = read_fd(fd, bufs[t], self.size)
                finally:
                    os.close(fd)
            else:
                with open(run.paths[i], "rb", buffering=0) as f:
                    n = f.readinto(bufs[t][:self.size])
            (run.check.full(run.paths[i], bufs[t], i, self.size) if full
             else run.check.sample(run.paths[i], bufs[t], n, i, self.size))
            return n

        return on_threads(self.rthreads, self.n, one)


class LMCacheDirect(LMCache):
    name, direct = "lmcache-direct", True


class VllmExample(Pattern):
    name, size = "vllm-example", 2 * MIB
    layers = 32

    def write(self, run: Run) -> tuple[float, int]:
        run.paths = [os.path.join(run.root, f"{i // self.layers:08x}",
                                  f"model.layers.{i % self.layers}.safetensors")
                     for i in range(self.n)]

        def one(t: int, i: int) -> int:
            dest = run.paths[i]
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            tmp = os.path.join(os.path.dirname(dest), f".tmp{uuid.uuid4().hex[:6]}")
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, self.size)
                write_all(fd, run.blocks.block(i, self.size))
            finally:
                os.close(fd)
            os.rename(tmp, dest)
            return self.size

        return on_threads(self.wthreads, self.n, one)

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        buf = aligned(self.size)

        def one(t: int, i: int) -> int:
            with open(run.paths[i], "rb") as f:
                size = os.fstat(f.fileno()).st_size
                with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
                    buf[:size] = m[:size]  # every page faulted in
            (run.check.full(run.paths[i], buf, i, self.size) if full
             else run.check.sample(run.paths[i], buf, size, i, self.size))
            return size

        return on_threads(self.rthreads, self.n, one)


class LlamaCpp(Pattern):
    """One file: block i of the checker is the whole state file (i = 0)."""
    name = "llamacpp"
    pieces = (4096, 32768)

    def __init__(self, total: int, args) -> None:
        self.size = args.state_size
        super().__init__(self.size, args)
        self.n = 1

    def describe(self) -> str:
        return f"1 x {bf.fmt_size(self.size)}, 4/32 KiB writes and reads, 1 thread"

    def write(self, run: Run) -> tuple[float, int]:
        run.paths = [os.path.join(run.root, "slot0.bin")]
        data = run.blocks.block(0, self.size)
        t0 = time.perf_counter()
        fd = os.open(run.paths[0], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pos, k = 0, 0
            while pos < self.size:
                piece = self.pieces[k % 2]
                k += 1
                pos += os.write(fd, data[pos:pos + piece])
        finally:
            os.close(fd)
        return time.perf_counter() - t0, self.size

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        buf = aligned(self.size)
        t0 = time.perf_counter()
        fd = os.open(run.paths[0], os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            os.lseek(fd, 0, os.SEEK_END)
            os.lseek(fd, 0, os.SEEK_SET)
            pos, k = 0, 0
            while pos < size:
                n = os.readv(fd, [buf[pos:pos + self.pieces[k % 2]]])
                k += 1
                if n == 0:
                    break
                pos += n
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - t0
        (run.check.full(run.paths[0], buf, 0, self.size) if full
         else run.check.sample(run.paths[0], buf, pos, 0, self.size))
        return elapsed, pos


class Dynamo(Pattern):
    """One file of n blocks; the checker's block i is the file's block i."""
    name, size, wthreads, rthreads = "dynamo", 2 * MIB, 4, 4

    def describe(self) -> str:
        return (f"1 file of {self.n} x {bf.fmt_size(self.size)} blocks, {self.wthreads} "
                f"threads")

    def write(self, run: Run) -> tuple[float, int]:
        fd, path = tempfile.mkstemp(dir=run.root, prefix="kvbm-disk-")
        run.fds.append(fd)
        os.unlink(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        if LIBC.fallocate(fd, 0, 0, self.total) != 0:
            err = ctypes.get_errno()
            run.notes.append(f"fallocate: {os.strerror(err)}, ftruncate instead")
            os.ftruncate(fd, self.total)

        def one(t: int, i: int) -> int:
            return os.pwrite(fd, run.blocks.block(i, self.size), i * self.size)

        return on_threads(self.wthreads, self.n, one)

    def read(self, run: Run, full: bool = False) -> tuple[float, int]:
        fd = run.fds[0]
        bufs = [aligned(self.size) for _ in range(self.rthreads)]

        def one(t: int, i: int) -> int:
            n = os.preadv(fd, [bufs[t][:self.size]], i * self.size)
            (run.check.full(f"block {i}", bufs[t], i, self.size) if full
             else run.check.sample(f"block {i}", bufs[t], n, i, self.size))
            return n

        return on_threads(self.rthreads, self.n, one)

    def files(self, run: Run) -> list[str | int]:
        return list(run.fds)


PATTERN_CLASSES = {c.name: c for c in (VllmFs, SGLang, LMCache, LMCacheDirect, VllmExample,
                                       LlamaCpp, Dynamo)}


# -- targets ---------------------------------------------------------------------------------
class Target:
    """Where a pattern's files go: a directory per pattern under *path*."""

    def __init__(self, kind: str, path: Path, mount: bf.Mount | None = None) -> None:
        self.kind = kind
        self.path = path
        self.mount = mount

    def fresh_dir(self, name: str) -> str:
        d = self.path / f"{name}-{uuid.uuid4().hex[:6]}"
        d.mkdir(parents=True)
        return str(d)

    def before_read(self, pattern: Pattern, run: Run) -> dict:
        """Make the read pass start where this target's reads are meant to: cold."""
        facts: dict = {}
        if self.kind == "kvfs-nvme":
            for f in pattern.files(run):
                demote(f)
            dram = self.status()["tiers"]["dram"]
            facts["dram_after_demote"] = dram["used_bytes"]
        if self.kind in ("disk", "kvfs-nvme"):
            bf.drop_caches()
        return facts

    def status(self) -> dict:
        assert isinstance(self.mount, bf.KvfsMount)
        return self.mount.status()


def demote(f: str | int, wait_s: float = 30.0) -> None:
    """Write *f* back and drop it from DRAM, as `kvfsctl demote` does; EBUSY (a file the
    kernel wrote, not taken yet) is retried."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.setxattr(f, "user.kvfs.demote", b"1")
            return
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def kvfs_target(kind: str, tmp: Path, args, env: dict, dram: int) -> Target:
    opts = {"dram_size": dram, "nvme_size": args.nvme_size, "chunk_size": MIB,
            "segment_size": 64 * MIB}
    for item in filter(None, args.kvfs_options.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value or 1
    m = bf.KvfsMount(tmp / f"{kind}-{uuid.uuid4().hex[:8]}", env, opts)
    m.mount()
    return Target(kind, m.path, m)


# -- per-file operations ---------------------------------------------------------------------
FILE_OPS = ("create", "absent lookup", "stat (cold dentries)", "unlink")


def file_ops(root: str, n: int) -> dict[str, float]:
    """Operations per second of each of FILE_OPS, *n* files in one fresh directory."""
    d = os.path.join(root, f"ops-{uuid.uuid4().hex[:6]}")
    os.mkdir(d)
    names = [os.path.join(d, f"{hashlib.sha256(str(i).encode()).hexdigest()}.bin")
             for i in range(n)]
    absent = [os.path.join(d, f"{hashlib.sha256(b'x' + str(i).encode()).hexdigest()}.bin")
              for i in range(n)]
    data = b"k" * 4096
    rates: dict[str, float] = {}
    t0 = time.perf_counter()
    for p in names:
        fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, data)
        os.close(fd)
    rates["create"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for p in absent:
        if os.access(p, os.F_OK):
            raise bf.BenchError(f"{p} exists")
    rates["absent lookup"] = n / (time.perf_counter() - t0)
    drop_dentries()
    t0 = time.perf_counter()
    for p in names:
        if os.stat(p).st_size != 4096:
            raise bf.BenchError(f"{p}: wrong size")
    rates["stat (cold dentries)"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for p in names:
        os.unlink(p)
    rates["unlink"] = n / (time.perf_counter() - t0)
    with contextlib.suppress(OSError):  # fuse-null has no rmdir
        os.rmdir(d)
    return rates


def drop_dentries() -> None:
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


# -- the run ---------------------------------------------------------------------------------
def measure_pattern(pattern: Pattern, target: Target, blocks: bf.Blocks, args) -> dict:
    run = Run(target.fresh_dir(pattern.name), blocks, Checker(blocks))
    try:
        with bf.WATCHDOG.timed(f"{pattern.name} write on {target.kind}", args.timeout):
            tw, nw = pattern.write(run)
        if target.kind == "disk":
            os.sync()  # not timed: the page cache, as tmpfs's, holds what was written
        facts = target.before_read(pattern, run)
        with bf.WATCHDOG.timed(f"{pattern.name} read on {target.kind}", args.timeout):
            tr, nr = pattern.read(run)
        if args.verify == "full":
            pattern.read(run, full=True)
        out = {"write_gibs": nw / tw / bf.GIB, "read_gibs": nr / tr / bf.GIB,
               "write_s": tw, "read_s": tr, **facts}
        if run.notes:
            out["notes"] = run.notes
        if target.mount is not None and target.kind.startswith("kvfs"):
            st = target.status()
            out["reads"] = {k: st["reads"].get(k) for k in
                            ("chunks_from_dram", "chunks_from_nvme", "checksum_errors")}
        return out
    finally:
        run.close()
        shutil.rmtree(run.root, ignore_errors=True)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, goal: float | None = None) -> str:
    if x is None:
        return "-"
    mark = "" if goal is None else (" ok" if x >= goal else " NO")
    return f"{x:.2f}x{mark}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="half the data and files (~1-2 minutes)")
    ap.add_argument("--patterns", default=",".join(PATTERNS), help="subset of %(default)s")
    ap.add_argument("--targets", default=",".join(TARGETS) + ",fuse-null",
                    help="subset of %(default)s (fuse-null: per-file operations only)")
    ap.add_argument("--total", type=bf.parse_size, default=None,
                    help="bytes per pattern (default 256M, --quick 128M)")
    ap.add_argument("--state-size", type=bf.parse_size, default=None,
                    help="llama.cpp's state file (default 256M, --quick 128M)")
    ap.add_argument("--files", type=int, default=None,
                    help="files of the per-file operations (default 3000, --quick 1500)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (default 1)")
    ap.add_argument("--base-dir", default="/var/tmp",
                    help="directory on the disk for the ext4 reference and kvfs's NVMe tier")
    ap.add_argument("--nvme-dram", type=bf.parse_size, default=bf.parse_size("64M"),
                    help="DRAM tier of kvfs-nvme (default 64M)")
    ap.add_argument("--nvme-size", type=bf.parse_size, default=bf.parse_size("8G"))
    ap.add_argument("--kvfs-options", default="", metavar="K=V,...",
                    help="more -o options for both kvfs mounts")
    ap.add_argument("--verify", choices=("sample", "full"), default="sample",
                    help="check 3 pages per file in the timed pass (default), or also every "
                         "byte in an untimed second pass")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json-out", metavar="FILE")
    args = ap.parse_args(argv)
    scale = 2 if args.quick else 1
    args.total = args.total or (256 * MIB) // scale
    args.state_size = args.state_size or (256 * MIB) // scale
    args.files = args.files or 3000 // scale
    patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if bad := [p for p in patterns if p not in PATTERN_CLASSES]:
        ap.error(f"unknown pattern(s) {bad}")
    if bad := [t for t in targets if t not in (*TARGETS, "fuse-null")]:
        ap.error(f"unknown target(s) {bad}")

    bf.WATCHDOG.install()
    t_start = time.monotonic()
    env = bf.kvfs_env()
    pats = [PATTERN_CLASSES[p](args.total, args) for p in patterns]
    blocks = bf.kv_blocks(bf.DATA, max(p.total for p in pats))
    cmd = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    header = [f"command: {cmd}",
              f"kvfs: {bf.REPO} @ {bf.git_rev()}; machine: {os.cpu_count()} CPUs, Linux "
              f"{platform.release()}",
              f"disk: {args.base_dir} = {bf.mount_info(args.base_dir)}; kvfs-nvme DRAM tier "
              f"{bf.fmt_size(args.nvme_dram)}"
              f"{'; -o ' + args.kvfs_options if args.kvfs_options else ''}"]
    log("\n".join(header))
    tmp = Path(tempfile.mkdtemp(prefix="kvfs-bench-engines-", dir=args.base_dir))
    shm = Path(tempfile.mkdtemp(prefix="kvfs-bench-engines-", dir="/dev/shm"))
    mounts: list[bf.Mount] = []
    rounds: list[dict] = []
    try:
        tg: dict[str, Target] = {}
        for kind in targets:
            if kind == "tmpfs":
                tg[kind] = Target(kind, shm)
            elif kind == "disk":
                tg[kind] = Target(kind, tmp / "disk")
            elif kind == "kvfs-dram":
                tg[kind] = kvfs_target(kind, tmp, args, env,
                                       2 * max(p.total for p in pats) + 256 * MIB)
            elif kind == "kvfs-nvme":
                tg[kind] = kvfs_target(kind, tmp, args, env, args.nvme_dram)
            else:
                m = bf.NullMount(tmp / f"null-{uuid.uuid4().hex[:8]}")
                m.mount()
                tg[kind] = Target(kind, m.path, m)
            if tg[kind].mount is not None:
                mounts.append(tg[kind].mount)
        for rep in range(args.repeat):
            res: dict = {"patterns": {}, "file_ops": {}}
            for p in pats:
                res["patterns"][p.name] = {}
                for kind in (t for t in TARGETS if t in tg):
                    t0 = time.monotonic()
                    r = measure_pattern(p, tg[kind], blocks, args)
                    res["patterns"][p.name][kind] = r
                    log(f"round {rep + 1} {p.name} ({p.describe()}) on {kind}: write "
                        f"{r['write_gibs']:.2f} GiB/s, read {r['read_gibs']:.2f} GiB/s "
                        f"[{time.monotonic() - t0:.1f} s]")
            for kind in ("tmpfs", "kvfs-dram", "fuse-null"):
                if kind in tg:
                    res["file_ops"][kind] = file_ops(str(tg[kind].path), args.files)
                    log(f"round {rep + 1} file ops on {kind}: " + ", ".join(
                        f"{k} {v:,.0f}/s" for k, v in res["file_ops"][kind].items()))
            rounds.append(res)
    except KeyboardInterrupt:
        log("interrupted: mounts and directories cleaned up")
        return 130
    finally:
        for m in mounts:
            m.cleanup()
            shutil.rmtree(m.base, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    report(rounds, pats, header, time.monotonic() - t_start, args)
    return 0


def median_ratio(rounds: list[dict], get_a, get_b) -> float | None:
    vals = []
    for r in rounds:
        with contextlib.suppress(KeyError, TypeError):
            v = ratio(get_a(r), get_b(r))
            if v is not None:
                vals.append(v)
    return statistics.median(vals) if vals else None


def report(rounds: list[dict], pats: list[Pattern], header: list[str], elapsed: float,
           args) -> None:
    def pr(name: str, a: str, b: str, metric: str) -> float | None:
        return median_ratio(rounds, lambda r: r["patterns"][name][a][metric],
                            lambda r: r["patterns"][name][b][metric])

    def gibs(name: str, kind: str, metric: str) -> str:
        vals = [r["patterns"][name][kind][metric] for r in rounds
                if kind in r["patterns"].get(name, {})]
        return f"{statistics.median(vals):.2f}" if vals else "-"

    out = {"header": header, "rounds": rounds, "ratios": {}, "elapsed_s": round(elapsed, 1)}
    lines = ["", *header, "",
             "| pattern | kvfs DRAM / tmpfs write | read | kvfs NVMe / cold ext4 read | "
             "write | GiB/s write, read: tmpfs; kvfs DRAM; ext4; kvfs NVMe |",
             "|---|---|---|---|---|---|"]
    for p in pats:
        rr = {"dram_write": pr(p.name, "kvfs-dram", "tmpfs", "write_gibs"),
              "dram_read": pr(p.name, "kvfs-dram", "tmpfs", "read_gibs"),
              "nvme_read": pr(p.name, "kvfs-nvme", "disk", "read_gibs"),
              "nvme_write": pr(p.name, "kvfs-nvme", "disk", "write_gibs")}
        out["ratios"][p.name] = rr
        absolute = "; ".join(f"{gibs(p.name, k, 'write_gibs')}, {gibs(p.name, k, 'read_gibs')}"
                             for k in TARGETS)
        lines.append(f"| {p.name} ({p.describe()}) | {fmt(rr['dram_write'], GOAL_DRAM_WRITE)} | "
                     f"{fmt(rr['dram_read'], GOAL_DRAM_READ)} | "
                     f"{fmt(rr['nvme_read'], GOAL_NVME_READ)} | {fmt(rr['nvme_write'])} | "
                     f"{absolute} |")
    if any(r["file_ops"] for r in rounds):
        lines += ["", f"per-file operations ({args.files} files of 4 KiB, one directory, "
                      f"one thread), per second:", "",
                  "| operation | kvfs / fuse-null | kvfs | fuse-null | tmpfs |",
                  "|---|---|---|---|---|"]
        for op in FILE_OPS:
            def rate(kind: str, op: str = op) -> str:
                vals = [r["file_ops"][kind][op] for r in rounds if kind in r["file_ops"]]
                return f"{statistics.median(vals):,.0f}" if vals else "-"
            v = median_ratio(rounds, lambda r, op=op: r["file_ops"]["kvfs-dram"][op],
                             lambda r, op=op: r["file_ops"]["fuse-null"][op])
            out["ratios"][op] = v
            lines.append(f"| {op} | {fmt(v, GOAL_FILE_OPS)} | {rate('kvfs-dram')} | "
                         f"{rate('fuse-null')} | {rate('tmpfs')} |")
    lines += ["", f"goals: DRAM reads >= {GOAL_DRAM_READ}x tmpfs, writes >= {GOAL_DRAM_WRITE}x; "
                  f"NVMe reads >= {GOAL_NVME_READ}x cold ext4; per-file operations >= "
                  f"{GOAL_FILE_OPS}x fuse-null. {len(rounds)} round(s), {elapsed:.0f} s."]
    print("\n".join(lines))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1, default=str) + "\n")


if __name__ == "__main__":
    sys.exit(main())
