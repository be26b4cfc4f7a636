#!/usr/bin/env python3
"""Crash loop: a KV workload, SIGKILL of the daemon at random moments, fsck, remount, check.

Each cycle:
1. A child process runs a KV workload on the mount, one operation after another, until the
   daemon dies under it: creates (written in 1-4 write() calls), O_TRUNC rewrites,
   ftruncate (shrink and grow), pwrite at offsets (also past the end: holes), fsync,
   rename over, unlink, and reads that it checks itself. Files are 4 KiB to 3 MiB, with
   64 KiB chunks, an 8 MiB DRAM tier and a 96 MiB NVMe tier of 1 MiB segments, so that
   files span many chunks and demotion, write-back, read-through and cleaning really run.
   Half the data is bf16-like (compressed on NVMe), half random (stored raw).
   Every operation goes to a journal *before* it starts and again when it has completed
   (with what it wrote: a seed per write). The journal is one write() per record to a
   file on local disk: it survives the SIGKILL of any process.
2. After a random delay the daemon is SIGKILLed; the child's calls then fail and it stops.
   In every fourth cycle (--dram-loss-every) the DRAM tier is also emptied, as a reboot would.
3. fsck (offline) runs on the tiers; then kvfs is mounted again (timed).
4. Every file is read back and checked against what the journal allows:
   - the namespace (names) is the one after the last completed operation, or after the
     one in flight (rename, create, unlink are atomic);
   - without DRAM loss, each file is exactly its state after the last completed
     operation; the file of the operation in flight may hold a partial application of it
     (per byte the value before or after it; its size before or after it, or for a write
     any size in between, since the kernel splits a write() into several requests; an
     O_TRUNC rewrite: the old file, or any prefix of the new one);
   - with DRAM loss, bytes fsync'ed and not changed since must read back exactly; any other
     byte may read as a value some write put there since its last fsync, the value it
     had at that fsync, zero where the file really had a hole since, or fail with EIO (a
     chunk lost with DRAM) - never a byte nobody wrote; the size may be any size the file
     had since its last fsync;
   - fsck exits 0 and reports nothing but chunks lost with DRAM (exit 0 or 4 then).
   Any error of the workload before the kill, any wrong byte its own reads saw, and a
   traceback in the daemon's log are failures too. Files with EIO ranges are unlinked
   before the next cycle; every other file continues with the bytes it was found with.

    python tools/crashloop.py [--cycles 20] [--seed 1] [--keep] [--max-delay 2.0]
                              [--dram-loss-every 4]

Prints one line per cycle and a summary (cycles, failures, DRAM-loss cycles, remount time).
Exit status 1 if any cycle failed. With --keep, the tiers as they were right after the
crash of the first failing cycle of each kind of failure (before fsck and the remount),
the journal and the daemon log are kept, and how to mount a copy of them is printed.
--dram-loss-every N empties the DRAM tier in every Nth cycle instead (1: every cycle). It
uses the kvfs of the repository it lives in. Ctrl-C (or SIGTERM) stops it: the child and
the daemon are killed, the mount is cleared (its FUSE connection aborted if it hangs) and
the directories removed.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
CHUNK = 64 << 10
MOUNT_ARGS = ["--dram-size", "8M", "--nvme-size", "96M", "--chunk-size", "64K",
              "--segment-size", "1M", "-o", "read_through_min=1M"]
MAX_FILE = 3 << 20
# The workload keeps its files below this in total, far from the tier's capacity: an
# ENOSPC would be a failure of the workload, not a finding.
TOTAL_CAP = 20 << 20
NAMES = [f"f{i}" for i in range(8)] + [f"t{i}" for i in range(3)]
LOST_LINE = "lost (its only copy was in DRAM when DRAM was lost)"


# -- data ------------------------------------------------------------------------------------
@lru_cache(maxsize=64)
def gen(seed: int, n: int) -> np.ndarray:
    """The bytes a write with *seed* writes (n of them): odd seeds bf16-like KV values
    (compressible by byte planes), even seeds random bytes (stored raw). Few zero bytes."""
    rng = np.random.default_rng(seed)
    if seed & 1:
        x = rng.standard_normal((n + 1) // 2, dtype=np.float32)
        out = (x.view(np.uint32) >> 16).astype("<u2").view(np.uint8)[:n]
    else:
        out = np.frombuffer(rng.bytes(n), dtype=np.uint8)
    out = out.copy()
    out.flags.writeable = False
    return out


# -- the model of one file (an inode: it keeps its history across renames) -----------------
@dataclass
class Layer:
    """Values some operation put at [off, off+n): gen(seed, total)[start:start+n], or zeros
    (seed None: a hole made by growing the file)."""

    off: int
    n: int
    seed: int | None = None
    total: int = 0
    start: int = 0

    def values(self) -> np.ndarray:
        if self.seed is None:
            return np.zeros(self.n, dtype=np.uint8)
        return gen(self.seed, self.total)[self.start:self.start + self.n]


@dataclass
class Inode:
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    # What the last fsync made durable, and which of its bytes changed since.
    durable: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    changed: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    layers: list[Layer] = field(default_factory=list)  # values written since that fsync
    sizes: set[int] = field(default_factory=lambda: {0})  # sizes it had since
    size_ranges: list[tuple[int, int]] = field(default_factory=list)

    def size(self) -> int:
        return len(self.data)

    def resize(self, size: int) -> None:
        old = len(self.data)
        if size > old:
            self.data = np.concatenate([self.data, np.zeros(size - old, np.uint8)])
            self.layers.append(Layer(old, size - old))
        else:
            self.data = self.data[:size].copy()
            self.changed[size:] = True
        self.changed[old:size] = True  # (only where the durable file was longer)
        self.sizes.add(size)

    def write(self, off: int, seed: int, total: int, start: int, n: int) -> None:
        old, end = len(self.data), off + n
        if end > old:
            self.data = np.concatenate([self.data, np.zeros(end - old, np.uint8)])
            if off > old:  # a hole between the old end and the write
                self.layers.append(Layer(old, off - old))
                self.changed[old:off] = True
        self.data[off:end] = gen(seed, total)[start:start + n]
        self.changed[off:end] = True
        self.layers.append(Layer(off, n, seed, total, start))
        self.sizes.add(len(self.data))

    def fsynced(self) -> None:
        self.durable = self.data.copy()
        self.changed = np.zeros(len(self.data), bool)
        self.layers = []
        self.sizes = {len(self.data)}
        self.size_ranges = []

    def size_allowed(self, size: int) -> bool:
        return size in self.sizes or any(lo <= size <= hi for lo, hi in self.size_ranges)


# -- operations --------------------------------------------------------------------------------
def apply(op: dict, files: dict[str, Inode], possibly: bool = False) -> None:
    """Apply a completed operation to the model (*possibly*: one that was in flight at the
    kill: its effects become possible values, its fsync counts for nothing)."""
    kind = op["op"]
    if kind in ("create", "rewrite"):
        if kind == "create":
            files[op["name"]] = Inode()
        ino = files[op["name"]]
        if kind == "rewrite":
            ino.resize(0)
        pos = 0
        for cut in op["cuts"]:
            ino.write(pos, op["seed"], op["size"], pos, cut - pos)
            pos = cut
        if possibly:
            ino.size_ranges.append((0, op["size"]))
    elif kind == "pwrite":
        ino = files[op["name"]]
        before = ino.size()
        ino.write(op["off"], op["seed"], op["len"], 0, op["len"])
        if possibly:
            ino.size_ranges.append((before, ino.size()))
    elif kind == "truncate":
        files[op["name"]].resize(op["size"])
    elif kind == "rename":
        files[op["dst"]] = files.pop(op["src"])
    elif kind == "unlink":
        del files[op["name"]]
    if op.get("fsync") and not possibly:
        files[op.get("name", op.get("dst"))].fsynced()


def make_op(rng: random.Random, files: dict[str, np.ndarray]) -> dict:
    """The next operation of the workload, given the current files (name -> bytes)."""
    total = sum(len(d) for d in files.values())
    free = [n for n in NAMES if n not in files]
    kinds = ["create"] * 14 + ["rewrite"] * 14 + ["pwrite"] * 20 + ["truncate"] * 10 \
        + ["fsync"] * 10 + ["rename"] * 8 + ["unlink"] * 5 + ["read"] * 19
    while True:
        kind = rng.choice(kinds)
        if total > TOTAL_CAP and kind in ("create", "rewrite", "pwrite"):
            kind = "unlink"
        if kind == "create" and not free or kind != "create" and not files:
            continue
        break
    fsync = rng.random() < 0.35
    seed = rng.getrandbits(48)
    if kind == "create":
        name = rng.choice(free)
    else:
        name = rng.choice(sorted(files))
    size = _file_size(rng)
    if kind in ("create", "rewrite"):
        k = rng.randint(1, 4)
        cuts = sorted(set(rng.sample(range(1, size), k - 1) if size > k else [])) + [size]
        return {"op": kind, "name": name, "size": size, "seed": seed, "cuts": cuts,
                "fsync": fsync}
    cur = len(files[name])
    if kind == "pwrite":
        n = min(_file_size(rng) // 2 + 1, MAX_FILE)
        where = rng.random()
        off = (rng.randrange(cur + 1) if where < 0.6 else cur if where < 0.8
               else cur + rng.randrange(1, 2 * CHUNK))  # inside, appending, past the end
        off = min(off, MAX_FILE)
        return {"op": "pwrite", "name": name, "off": off, "len": n, "seed": seed,
                "fsync": fsync}
    if kind == "truncate":
        new = rng.randrange(cur + 1) if rng.random() < 0.6 or cur >= MAX_FILE \
            else rng.randrange(cur + 1, MAX_FILE + 1)
        return {"op": "truncate", "name": name, "size": new, "fsync": fsync}
    if kind == "rename":
        dst = rng.choice([n for n in NAMES if n != name])
        return {"op": "rename", "src": name, "dst": dst}
    if kind == "read":
        off = rng.randrange(cur + 1)
        return {"op": "read", "name": name, "off": off,
                "len": rng.choice([cur - off, rng.randrange(cur - off + 1)])}
    return {"op": kind, "name": name}


def _file_size(rng: random.Random) -> int:
    """4 KiB to 3 MiB, log-uniform, often not a multiple of anything."""
    size = int(2 ** rng.uniform(12, 21.58))
    return size if rng.random() < 0.5 else size - size % CHUNK or CHUNK


# -- the workload (child process) --------------------------------------------------------------
def run_op(mnt: Path, op: dict, files: dict[str, np.ndarray]) -> str | None:
    """Do *op* on the mount and update *files*; returns a description of wrong bytes a read
    saw (None if none). OSError propagates: the operation did not complete."""
    kind = op["op"]
    path = str(mnt / op.get("name", ""))
    if kind in ("create", "rewrite"):
        flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if kind == "create" else os.O_TRUNC)
        data = gen(op["seed"], op["size"])
        fd = os.open(path, flags, 0o644)
        try:
            if kind == "rewrite":
                files[op["name"]] = np.zeros(0, np.uint8)
            pos = 0
            for cut in op["cuts"]:
                _write_all(fd, data[pos:cut], pos)
                pos = cut
            if op["fsync"]:
                os.fsync(fd)
        finally:
            os.close(fd)
        files[op["name"]] = data.copy()
    elif kind == "pwrite":
        data = gen(op["seed"], op["len"])
        fd = os.open(path, os.O_WRONLY if op["seed"] & 2 else os.O_RDWR)
        try:
            _write_all(fd, data, op["off"])
            if op["fsync"]:
                os.fsync(fd)
        finally:
            os.close(fd)
        old = files[op["name"]]
        new = np.zeros(max(len(old), op["off"] + op["len"]), np.uint8)
        new[:len(old)] = old
        new[op["off"]:op["off"] + op["len"]] = data
        files[op["name"]] = new
    elif kind == "truncate":
        fd = os.open(path, os.O_WRONLY)
        try:
            os.ftruncate(fd, op["size"])
            if op["fsync"]:
                os.fsync(fd)
        finally:
            os.close(fd)
        old = files[op["name"]]
        new = np.zeros(op["size"], np.uint8)
        new[:min(len(old), op["size"])] = old[:op["size"]]
        files[op["name"]] = new
    elif kind == "fsync":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    elif kind == "rename":
        os.rename(mnt / op["src"], mnt / op["dst"])
        files[op["dst"]] = files.pop(op["src"])
    elif kind == "unlink":
        os.unlink(path)
        del files[op["name"]]
    elif kind == "read":
        fd = os.open(path, os.O_RDONLY)
        try:
            got = _read_all(fd, op["off"], op["len"])
        finally:
            os.close(fd)
        want = files[op["name"]][op["off"]:op["off"] + op["len"]].tobytes()
        if got != want:
            return f"read of {op['name']} [{op['off']}, +{op['len']}): {_diff(got, want)}"
    return None


def _write_all(fd: int, data: np.ndarray, off: int) -> None:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _read_all(fd: int, off: int, n: int) -> bytes:
    parts = []
    while n > 0:
        b = os.pread(fd, min(n, 1 << 20), off)
        if not b:
            break
        parts.append(b)
        off, n = off + len(b), n - len(b)
    return b"".join(parts)


def _diff(got: bytes, want: bytes) -> str:
    if len(got) != len(want):
        return f"{len(got)} bytes instead of {len(want)}"
    g, w = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    bad = np.flatnonzero(g != w)
    return (f"{len(bad)} wrong bytes from {bad[0]} to {bad[-1]} "
            f"({int((g[bad] == 0).sum())} of them zeros)")


def child_main(argv: list[str]) -> int:
    mnt, journal, state, seed, first_id = Path(argv[0]), argv[1], argv[2], int(argv[3]), \
        int(argv[4])
    with open(state, "rb") as f:
        files: dict[str, np.ndarray] = {n: np.frombuffer(b, np.uint8)
                                        for n, b in pickle.load(f).items()}
    jfd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def note(rec: dict) -> None:
        os.write(jfd, (json.dumps(rec, separators=(",", ":")) + "\n").encode())

    rng = random.Random(seed)
    print("ready", flush=True)
    for op_id in range(first_id, first_id + 1_000_000):
        op = make_op(rng, files)
        note({"b": op_id, "op": op})
        try:
            wrong = run_op(mnt, op, files)
        except OSError as exc:
            note({"e": op_id, "errno": exc.errno, "t": time.monotonic(), "what": str(exc)})
            return 0
        if wrong:
            note({"x": op_id, "t": time.monotonic(), "what": wrong})
        note({"c": op_id})
    return 0


# -- the mount ---------------------------------------------------------------------------------
class Kvfs:
    """One kvfs store of this run: its mountpoint, tiers, log; mount, kill, fsck, clean up."""

    def __init__(self, base: Path, dram: Path) -> None:
        self.base, self.dram = base, dram
        self.mnt, self.nvme, self.log = base / "mnt", base / "nvme", base / "kvfs.log"
        self.mnt.mkdir(parents=True)
        self.pid: int | None = None
        self.conn: int | None = None  # its FUSE connection (minor of st_dev)
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + [p for p in self.env.get("PYTHONPATH", "").split(os.pathsep) if p])

    def mount(self) -> float:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(self.mnt),
                            "--dram-dir", str(self.dram), "--nvme-dir", str(self.nvme),
                            "--log-file", str(self.log)] + MOUNT_ARGS,
                           capture_output=True, text=True, timeout=120, env=self.env)
        dt = time.monotonic() - t0
        if r.returncode != 0:
            raise MountFailed(f"mount failed ({r.returncode}): {r.stderr.strip()}")
        self.pid = int((self.nvme / "lock").read_text().strip())
        self.conn = _connection(self.mnt)
        return dt

    def kill(self) -> None:
        """SIGKILL the daemon and wait until it is gone."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _wait_gone(self.pid, 30)
        self.pid = None

    def abort(self) -> None:
        """Abort this mount's FUSE connection: every request waiting on it fails."""
        if self.conn is not None and _connection(self.mnt) == self.conn:
            try:
                Path(f"/sys/fs/fuse/connections/{self.conn}/abort").write_text("1")
            except OSError:
                pass

    def clear(self) -> None:
        """Lazily unmount what is left of a dead mount."""
        if _connection(self.mnt) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        self.conn = None

    def unmount(self) -> None:
        if self.pid is None:
            return self.clear()
        r = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(self.mnt)],
                           capture_output=True, text=True, timeout=180, env=self.env)
        if r.returncode != 0:
            self.kill()
            self.abort()
            self.clear()
        self.pid = None

    def lose_dram(self) -> None:
        for entry in self.dram.iterdir() if self.dram.exists() else ():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()

    def fsck(self) -> tuple[int, str]:
        r = subprocess.run([sys.executable, "-m", "kvfs.cli.fsck", str(self.nvme),
                            "--dram-dir", str(self.dram)], capture_output=True, text=True,
                           timeout=300, env=self.env)
        return r.returncode, (r.stdout + r.stderr).strip()

    def snapshot(self, dest: Path) -> None:
        """Copy the tiers (the daemon must not be running) to *dest*."""
        dest.mkdir()
        for src, name in ((self.nvme, "nvme"), (self.dram, "dram")):
            # cp keeps lmdb's data file sparse (64 GiB long, a few MiB used)
            subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dest / name)],
                           check=True)


class MountFailed(Exception):
    pass


def _connection(mnt: Path) -> int | None:
    real = os.path.realpath(mnt)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            if parts[4] == real:
                return int(parts[2].split(":")[1])
    return None


def _wait_gone(pid: int, seconds: float) -> bool:
    """Wait until *pid* has exited (a zombie counts: the daemon is not our child, and
    whoever inherited it may be slow to reap it)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.01)
    return False


# -- checking ----------------------------------------------------------------------------------
@dataclass
class Found:
    """A file as read back: its bytes and which of them failed with EIO."""

    data: np.ndarray
    eio: np.ndarray  # bool per byte
    problem: str | None = None  # a read that ended before the file's size

    @property
    def size(self) -> int:
        return len(self.data)


def read_back(path: Path, must: np.ndarray | None) -> Found:
    """Read a file whole; where a read fails with EIO, split the range to find the failing
    bytes, down to single bytes only where *must* (bytes that must not fail) says so."""
    size = os.stat(path).st_size
    data = np.zeros(size, np.uint8)
    eio = np.zeros(size, bool)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        if exc.errno != errno.EIO:
            raise
        eio[:] = True
        return Found(data, eio)
    found = Found(data, eio)
    try:
        def read(off: int, n: int) -> None:
            try:
                b = _read_all(fd, off, n)
            except OSError as exc:
                if exc.errno != errno.EIO:
                    raise
                if n <= 1 or (must is None and n <= 4096) or (
                        must is not None and not must[off:off + n].any()):
                    eio[off:off + n] = True
                    return
                read(off, n // 2)
                read(off + n // 2, n - n // 2)
                return
            data[off:off + len(b)] = np.frombuffer(b, np.uint8)
            if len(b) < n and found.problem is None:
                found.problem = f"a read ended at {off + len(b)} of its {size} bytes"

        for off in range(0, size, CHUNK):
            read(off, min(CHUNK, size - off))
    finally:
        os.close(fd)
    return found


@dataclass
class Finding:
    """What is wrong with a file: *kind* classifies it (the summary counts kinds), *text*
    says where and how."""

    kind: str
    text: str


def check_exact(found: Found, want: np.ndarray) -> Finding | None:
    if found.problem:
        return Finding("short read", found.problem)
    if found.eio.any():
        return Finding("EIO", f"EIO at {_ranges(found.eio)}")
    if found.size != len(want):
        m = min(found.size, len(want))
        diff = _bytes_diff(found.data[:m], want[:m])
        return Finding("wrong size", f"size {found.size}, expected {len(want)}; in the first "
                                     f"{m} bytes: {diff or 'equal'}")
    if not np.array_equal(found.data, want):
        return Finding("wrong bytes", _bytes_diff(found.data, want))
    return None


def check_candidates(found: Found, cands: list[tuple]) -> Finding | None:
    """The file must match one of *cands*: ("exact", bytes), ("prefix", bytes) or
    ("between", before, after, sizes: a set or a (lo, hi) range); returns why not (the
    kind is the first candidate's)."""
    if found.problem:
        return Finding("short read", found.problem)
    if found.eio.any():
        return Finding("EIO", f"EIO at {_ranges(found.eio)}")
    why: list[Finding] = []
    for cand in cands:
        kind = cand[0]
        if kind == "exact":
            w = check_exact(found, cand[1])
        elif kind == "prefix":
            new = cand[1]
            w = (Finding("wrong size", f"size {found.size}, past the new {len(new)}")
                 if found.size > len(new) else None)
            if w is None and (diff := _bytes_diff(found.data, new[:found.size])):
                w = Finding("wrong bytes", diff)
        else:
            before, after, sizes = cand[1:]
            ok_size = (sizes[0] <= found.size <= sizes[1] if isinstance(sizes, tuple)
                       else found.size in sizes)
            w = None if ok_size else Finding("wrong size", f"size {found.size} not in {sizes}")
            bad = ~(_eq(found.data, before) | _eq(found.data, after))
            if w is None and bad.any():
                w = Finding("wrong bytes", f"size {found.size} (before {len(before)}, after "
                                           f"{len(after)}), neither the value before nor "
                                           f"after: {_where(bad, found.data)}")
        if w is None:
            return None
        why.append(Finding(w.kind, f"not the {kind} candidate: {w.text}"))
    return Finding(why[0].kind, "; ".join(w.text for w in why))


def check_after_loss(found: Found, ino: Inode) -> Finding | None:
    """DRAM lost: fsync'ed, unchanged bytes exact; others a value written since, the
    fsync'ed one, or EIO; the size one the file had since its last fsync."""
    if found.problem:
        return Finding("short read", found.problem)
    if not ino.size_allowed(found.size):
        return Finding("a size it never had since its fsync",
                       f"size {found.size}, not one it had since its last fsync "
                       f"({sorted(ino.sizes)}, ranges {ino.size_ranges})")
    n = found.size
    exact = np.zeros(n, bool)
    m = min(n, len(ino.durable))
    exact[:m] = ~ino.changed[:m]
    problems = []
    eio_exact = found.eio & exact
    if eio_exact.any():
        zeros = not ino.durable[:m][eio_exact[:m]].any()
        problems.append(Finding(
            "EIO on fsync'ed " + ("zeros (a hole, or past a chunk's end)" if zeros
                                  else "data"),
            f"EIO on fsync'ed bytes at {_ranges(eio_exact)}"))
    allowed = found.eio.copy()
    allowed[:m] |= found.data[:m] == ino.durable[:m]
    wrong_exact = exact & ~found.eio & ~allowed
    if wrong_exact.any():
        problems.append(Finding("fsync'ed bytes changed",
                                "fsync'ed bytes changed: " + _where(wrong_exact, found.data)))
    for layer in ino.layers:
        lo, hi = layer.off, min(n, layer.off + layer.n)
        if lo < hi:
            allowed[lo:hi] |= found.data[lo:hi] == layer.values()[:hi - lo]
    bad = ~allowed & ~exact
    if bad.any():
        problems.append(Finding("bytes nobody wrote",
                                "bytes no write put there: " + _where(bad, found.data)))
    if not problems:
        return None
    return Finding(problems[0].kind, "; ".join(f.text for f in problems))


def _eq(got: np.ndarray, model: np.ndarray) -> np.ndarray:
    out = np.zeros(len(got), bool)
    m = min(len(got), len(model))
    out[:m] = got[:m] == model[:m]
    return out


def _bytes_diff(got: np.ndarray, want: np.ndarray) -> str | None:
    bad = got != want
    return _where(bad, got) if bad.any() else None


def _where(bad: np.ndarray, got: np.ndarray) -> str:
    idx = np.flatnonzero(bad)
    zeros = int((got[idx] == 0).sum())
    return (f"{len(idx)} bytes at {_ranges(bad)}"
            + (", all zeros" if zeros == len(idx) else f", {zeros} of them zeros"))


def _ranges(mask: np.ndarray, most: int = 4) -> str:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.view(np.int8), [0]])))
    spans = [f"[{a}, {b})" for a, b in zip(edges[::2], edges[1::2], strict=True)]
    return " ".join(spans[:most]) + (f" and {len(spans) - most} more" if len(spans) > most
                                     else "")


# -- one cycle ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    line: str
    failures: list[Finding]
    remount_s: float | None
    dram_lost: bool


class Loop:
    def __init__(self, work: Path, dram: Path, seed: int, max_delay: float, keep: bool,
                 dram_loss_every: int) -> None:
        self.work, self.seed, self.max_delay, self.keep = work, seed, max_delay, keep
        self.dram_loss_every = dram_loss_every
        self.kvfs = Kvfs(work, dram)
        self.journal = work / "journal"
        self.state = work / "state.pickle"
        self.files: dict[str, Inode] = {}
        self.next_id = 1
        self.journal_read = 0  # the journal of every cycle: what was read of it
        self.child: subprocess.Popen | None = None
        self.kept: dict[str, Path] = {}  # failure kind -> the tiers of its first cycle
        self.log_seen = 0

    def start(self) -> float:
        return self.kvfs.mount()

    def cycle(self, i: int) -> Outcome:
        lose = i % self.dram_loss_every == self.dram_loss_every - 1
        rng = random.Random(self.seed * 1_000_003 + i)
        with open(self.state, "wb") as f:
            pickle.dump({n: ino.data.tobytes() for n, ino in self.files.items()}, f)
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--child", str(self.kvfs.mnt), str(self.journal),
             str(self.state), str(rng.getrandbits(48)), str(self.next_id)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=self.kvfs.env)
        ready = self.child.stdout.readline()
        if ready.strip() != b"ready":
            raise RuntimeError(f"the workload did not start: {ready!r}")
        time.sleep(rng.uniform(0.05, self.max_delay))
        t_kill = time.monotonic()
        self.kvfs.kill()
        failures = self._log_tracebacks()
        try:
            self.child.wait(20)
        except subprocess.TimeoutExpired:
            self.kvfs.abort()  # a request of the dead mount still waits: fail it
            try:
                self.child.wait(20)
            except subprocess.TimeoutExpired:
                self.child.kill()
                self.child.wait()
                failures.append(Finding("the workload hung", "it hung after the kill "
                                                             "(killed)"))
        if self.child.returncode not in (0, -signal.SIGKILL):
            failures.append(Finding("the workload crashed",
                                    f"it exited with {self.child.returncode}"))
        self.child = None
        self.kvfs.clear()
        if lose:
            self.kvfs.lose_dram()
        done, inflight, journal_failures = self._read_journal(t_kill)
        failures += journal_failures
        snap = None
        if self.keep:
            snap = self.work / f"crash-{i}"
            self.kvfs.snapshot(snap)
        rc, out = self.kvfs.fsck()
        fsck_note = self._judge_fsck(rc, out, failures)
        try:
            remount = self.kvfs.mount()
        except MountFailed:
            self._keep(snap, [Finding("mount failed", "")])
            raise
        check_failures, note = self._check(inflight, lose)
        failures += check_failures
        self._keep(snap, failures)
        what = _describe(inflight) if inflight else "nothing"
        line = (f"cycle {i}: {'FAIL' if failures else 'ok'}  {len(done)} ops, in flight: "
                f"{what}{', DRAM lost' if lose else ''}; fsck {fsck_note}; remount "
                f"{remount:.2f} s; {note}")
        return Outcome(line, failures, remount, lose)

    def _log_tracebacks(self) -> list[Finding]:
        try:
            with open(self.kvfs.log, errors="replace") as f:
                f.seek(self.log_seen)
                text = f.read()
                self.log_seen = f.tell()
        except OSError:
            return []
        n = text.count("Traceback")
        return [Finding("traceback in the daemon's log", f"{n} in its log since the mount")
                ] if n else []

    def _read_journal(self, t_kill: float) -> tuple[list[dict], dict | None, list[Finding]]:
        """Apply the completed operations; return them, the one in flight, and failures the
        workload saw (wrong bytes read, an error before the kill)."""
        done, inflight, failures = [], None, []
        with open(self.journal) as f:
            f.seek(self.journal_read)
            lines = f.readlines()
            self.journal_read = f.tell()
        for line in lines:
            if not line.endswith("\n"):
                break  # (a record cut short by a killed child: nothing after it either)
            rec = json.loads(line)
            if "b" in rec:
                inflight = rec["op"]
                self.next_id = rec["b"] + 1
            elif "c" in rec:
                apply(inflight, self.files)
                done.append(inflight)
                inflight = None
            elif "x" in rec:
                failures.append(Finding("the workload read wrong bytes", rec["what"]))
            elif "e" in rec and rec["t"] < t_kill:
                failures.append(Finding(
                    f"an error before the kill ({errno.errorcode.get(rec['errno'], '?')})",
                    f"{_describe(inflight)}: {rec['what']}"))
        return done, inflight, failures

    def _judge_fsck(self, rc: int, out: str, failures: list[Finding]) -> str:
        lines = out.splitlines()
        summary = lines[-1] if lines else ""
        other = [ln for ln in lines[:-1] if not ln.endswith(LOST_LINE)]
        lost = len(lines) - 1 - len(other)
        if other or rc not in ((0, 4) if lost else (0,)) or " chunks: " not in summary:
            failures.append(Finding("fsck", f"exit {rc}: " + " | ".join(lines[:6])))
            return f"FAILED (exit {rc})"
        return f"ok{f', {lost} chunks lost' if lost else ''}"

    def _check(self, inflight: dict | None, lost: bool) -> tuple[list[Finding], str]:
        """Compare the mount with what the journal allows; then make the model what was
        found (files with EIO or wrong bytes are unlinked and forgotten)."""
        alts = [(self.files, {})]  # (name -> Inode, name -> candidates for the op in flight)
        if inflight:
            after = copy.deepcopy(self.files)
            apply(inflight, after, possibly=True)
            alts = _alternatives(inflight, self.files, after)
        mnt = self.kvfs.mnt
        names = set(os.listdir(mnt))
        chosen = next((a for a in alts if set(a[0]) == names), None)
        failures = []
        if chosen is None:
            failures.append(Finding("names", f"{sorted(names)}, expected " + " or ".join(
                str(sorted(a[0])) for a in alts)))
            chosen = alts[-1]
        model, cands = chosen
        new_files: dict[str, Inode] = {}
        eio_files = 0
        for name in sorted(names):
            ino = model.get(name)
            if ino is None:
                os.unlink(mnt / name)
                continue
            must = None
            if lost:
                must = np.zeros(os.stat(mnt / name).st_size, bool)
                m = min(len(must), len(ino.durable))
                must[:m] = ~ino.changed[:m]
            found = read_back(mnt / name, must)
            if lost:
                why = check_after_loss(found, ino)
            elif name in cands:
                why = check_candidates(found, cands[name])
            else:
                why = check_exact(found, ino.data)
            if why:
                on_it = name in cands or inflight is not None and name in (
                    inflight.get("name"), inflight.get("dst"))
                context = (f"{inflight['op']} of it in flight" if on_it
                           else "no operation of it in flight")
                failures.append(Finding(
                    f"{why.kind} after {'DRAM loss' if lost else 'SIGKILL'}, {context}",
                    f"{name}: {why.text} (in flight: "
                    f"{_describe(inflight) if inflight else 'nothing'}; "
                    f"{_placement(mnt / name)})"))
            if why or found.eio.any():
                eio_files += found.eio.any()
                os.unlink(mnt / name)
                continue
            ino.data = found.data
            ino.sizes.add(found.size)
            new_files[name] = ino
        self.files = new_files
        note = f"{len(names)} files checked"
        if eio_files:
            note += f", {eio_files} with EIO ranges (unlinked)"
        return failures, note

    def _keep(self, snap: Path | None, failures: list[Finding]) -> None:
        """Keep *snap* if it is the first cycle of a kind of failure, else remove it."""
        if snap is None:
            return
        new = {f.kind for f in failures} - set(self.kept)
        if not new:
            shutil.rmtree(snap)
            return
        shutil.copy(self.kvfs.log, snap / "kvfs.log")
        shutil.copy(self.journal, snap / "journal")
        for kind in new:
            self.kept[kind] = snap

    def stop(self) -> None:
        """Kill what this loop started and clear its mount; leave no process behind."""
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
        self.kvfs.kill()
        if self.child is not None:
            self.kvfs.abort()
            self.child.wait()
            self.child = None
        self.kvfs.clear()

    def finish(self) -> None:
        self.kvfs.unmount()


def _alternatives(op: dict, before: dict[str, Inode], after: dict[str, Inode]):
    """What the mount may hold with *op* in flight: (name -> Inode, name -> candidates)
    pairs, one per possible namespace."""
    kind = op["op"]
    if kind in ("rename", "create", "unlink"):
        return [(before, {}), (after, {op.get("dst", op.get("name")): [
            ("prefix", gen(op["seed"], op["size"]))]} if kind == "create" else {})]
    name = op["name"]
    old = before[name].data
    new = after[name].data
    if kind == "rewrite":
        cands = [("exact", old), ("prefix", gen(op["seed"], op["size"]))]
    elif kind == "pwrite":
        cands = [("between", old, new, (len(old), len(new)))]
    elif kind == "truncate":
        cands = [("between", old, new, {len(old), len(new)})]
    else:
        cands = [("exact", old)]
    return [(after, {name: cands})]


def _describe(op: dict) -> str:
    kind = op["op"]
    if kind == "rename":
        return f"rename {op['src']} -> {op['dst']}"
    extra = {"create": f"{op.get('size')} bytes in {len(op.get('cuts', []))} writes",
             "rewrite": f"O_TRUNC, {op.get('size')} bytes in {len(op.get('cuts', []))} writes",
             "pwrite": f"{op.get('len')} bytes at {op.get('off')}",
             "truncate": f"to {op.get('size')}",
             "read": f"{op.get('len')} bytes at {op.get('off')}"}.get(kind, "")
    sync = " + fsync" if op.get("fsync") else ""
    return f"{kind} {op['name']}{' (' + extra + ')' if extra else ''}{sync}"


def _placement(path: Path) -> str:
    try:
        where = json.loads(os.getxattr(path, "user.kvfs.where"))
    except OSError as exc:
        return f"where: {exc.strerror}"
    tiers: dict[str, int] = {}
    for c in where["chunks"]:
        key = "+".join(c["tiers"]) or "none"
        tiers[key] = tiers.get(key, 0) + 1
    return "chunks " + (", ".join(f"{v} {k}" for k, v in tiers.items()) or "none")


# -- the run -----------------------------------------------------------------------------------
@dataclass
class Summary:
    cycles: int = 0
    failures: int = 0
    dram_lost: int = 0
    remounts: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    kept: dict[str, Path] = field(default_factory=dict)
    kinds: dict[str, list[int]] = field(default_factory=dict)  # kind -> cycles it was seen

    def text(self) -> str:
        mean = sum(self.remounts) / len(self.remounts) if self.remounts else 0.0
        lines = [f"{self.cycles} cycles, {self.failures} failed, {self.dram_lost} with the "
                 f"DRAM tier lost; remount mean {mean:.2f} s, max "
                 f"{max(self.remounts, default=0.0):.2f} s; wall {self.wall_s:.0f} s"]
        for kind, cycles in sorted(self.kinds.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"  {len(cycles)} x {kind} (cycles {', '.join(map(str, cycles[:8]))}"
                         f"{' ...' if len(cycles) > 8 else ''})")
        return "\n".join(lines)


def run(cycles: int, seed: int = 1, *, keep: bool = False, max_delay: float = 2.0,
        dram_loss_every: int = 4, out=print) -> Summary:
    """Run *cycles* crash cycles on a fresh store; print a line per cycle through *out*."""
    tag = f"crashloop-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    work = Path("/tmp") / tag
    dram = Path("/dev/shm") / tag
    loop = Loop(work, dram, seed, max_delay, keep, dram_loss_every)
    summary = Summary()
    t0 = time.monotonic()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        loop.start()
        for i in range(cycles):
            try:
                o = loop.cycle(i)
            except MountFailed as exc:
                summary.cycles += 1
                summary.failures += 1
                summary.kinds.setdefault("mount failed", []).append(i)
                out(f"cycle {i}: FAIL  {exc}; stopping")
                break
            summary.cycles += 1
            summary.dram_lost += o.dram_lost
            summary.remounts.append(o.remount_s)
            out(o.line)
            for f in o.failures:
                out(f"    {f.kind}: {f.text}")
                if i not in summary.kinds.setdefault(f.kind, []):
                    summary.kinds[f.kind].append(i)
            summary.failures += bool(o.failures)
        loop.finish()
    finally:
        loop.stop()
        signal.signal(signal.SIGTERM, previous)
        summary.kept = dict(loop.kept)
        if not loop.kept:
            shutil.rmtree(work, ignore_errors=True)
        for kind, snap in loop.kept.items():
            out(f"kept: {kind}: {snap}")
        if loop.kept:
            out("(the tiers as the crash left them, before fsck and the remount, the journal "
                "and the daemon's log; to look at a copy: cp -a --sparse=always DIR /tmp/c && "
                "python -m kvfs mount MNT --nvme-dir /tmp/c/nvme --dram-dir /tmp/c/dram "
                f"{' '.join(MOUNT_ARGS)})")
        shutil.rmtree(dram, ignore_errors=True)
        summary.wall_s = time.monotonic() - t0
        out(summary.text())  # (also of the cycles before a Ctrl-C)
    return summary


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", action="store_true",
                    help="keep the tiers of the first failing cycle of each kind of failure "
                         "(as its crash left them)")
    ap.add_argument("--dram-loss-every", type=int, default=4, metavar="N",
                    help="empty the DRAM tier in every Nth cycle (default %(default)s)")
    ap.add_argument("--max-delay", type=float, default=2.0,
                    help="the daemon is killed 0.05 s to this many seconds into a cycle")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("run as root (it mounts kvfs)")
    try:
        s = run(a.cycles, a.seed, keep=a.keep, max_delay=a.max_delay,
                dram_loss_every=a.dram_loss_every)
    except KeyboardInterrupt:
        return 130
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())
