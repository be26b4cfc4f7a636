#!/usr/bin/env python3
"""Metadata at scale: what kvfs costs per file as the number of files grows, beside tmpfs.

Issue 33 (defects 4 and 5): creating 100,000 small files took 211 s (tmpfs 3.9 s), and 128 MiB
of writes after 60,000 small files in a 256 MiB DRAM tier took ~170 s of daemon CPU (0.1 s on
a fresh mount). Both were work that grew with the number of files. This runs, in one go:

- `one-dir`: create + write + close of --files small files (--size bytes) in one directory,
  then stat of each, then unlink of each; `spread`: the same over directories of --per-dir
  files. For tmpfs (a directory under /dev/shm), fuse-null (tools/nullfs.py: the FUSE floor)
  and kvfs, each on a fresh mount; kvfs / tmpfs and kvfs / fuse-null as ratios of files per
  second. `tail/head`: files per second over the last tenth of a phase against the first
  tenth; well under 1.0 means the work per file grows with the files there are.
- kvfs's side also gives its daemon's CPU per file (all threads) and, after the spread
  creates, a remount: how long mounting a store of that many files takes, and the daemon's
  RSS afterwards per file.
- `big writes`: the repro's scenario. 32 x 4 MiB files written on a fresh mount, then
  --small-files 4 KiB files, then the 32 x 4 MiB again, twice (time and daemon CPU).

    python tools/bench_meta.py                                   # ~3.5 min on the 2-core box
    python tools/bench_meta.py --files 100000 --dram-size 256M --small-files 60000
    python tools/bench_meta.py --phases big --small-files 20000  # only the repro's scenario
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("tmpfs", "fuse-null", "kvfs")
BIG_FILES, BIG_SIZE = 32, 4 << 20


def mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == real for line in f)


@dataclass
class Target:
    """One filesystem under test: a directory to work in, and what serves it."""

    name: str
    base: Path
    args: argparse.Namespace
    path: Path = field(init=False)
    proc: subprocess.Popen | None = None

    def __post_init__(self) -> None:
        self.path = self.base / "mnt"
        self.dram = Path(f"/dev/shm/kvfs-meta-{os.getpid()}-{self.name}")

    def start(self) -> float:
        """Mount (or make the tmpfs directory); returns the seconds it took."""
        t = time.perf_counter()
        if self.name == "tmpfs":
            self.path = self.dram
            self.path.mkdir()
        elif self.name == "fuse-null":
            self.path.mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "nullfs.py"),
                                          str(self.path)])
            while not mounted(self.path):
                if self.proc.poll() is not None:
                    raise RuntimeError("fuse-null did not mount")
                time.sleep(0.02)
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            a = self.args
            subprocess.run([sys.executable, "-m", "kvfs", "mount", str(self.path),
                            "--dram-dir", str(self.dram), "--dram-size", a.dram_size,
                            "--nvme-dir", str(self.base / "nvme"), "--nvme-size", a.nvme_size,
                            "--log-file", str(self.base / "kvfs.log")],
                           cwd=ROOT, check=True, timeout=a.timeout)
        return time.perf_counter() - t

    def stop(self) -> float:
        """Unmount (a clean kvfs unmount writes every dirty chunk back); returns seconds."""
        t = time.perf_counter()
        if self.name == "kvfs" and mounted(self.path):
            r = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(self.path)],
                               cwd=ROOT, timeout=self.args.timeout)
            if r.returncode != 0:
                self.kill()
        elif self.name == "fuse-null" and self.proc is not None:
            subprocess.run(["fusermount3", "-u", str(self.path)], check=False)
            self.proc.wait(timeout=60)
            self.proc = None
        return time.perf_counter() - t

    def kill(self) -> None:
        pid = self.pid()
        if pid:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if mounted(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)

    def cleanup(self) -> None:
        try:
            self.stop()
        except Exception:  # a wedged daemon: kill it, the directories go anyway
            self.kill()
        if self.proc is not None:
            self.proc.kill()
        shutil.rmtree(self.base, ignore_errors=True)
        if self.dram.is_dir() and os.path.ismount(self.dram):
            subprocess.run(["umount", "-l", str(self.dram)], check=False)
        shutil.rmtree(self.dram, ignore_errors=True)

    def pid(self) -> int | None:
        if self.name != "kvfs":
            return None
        try:
            return int((self.base / "nvme" / "lock").read_text().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def cpu(self) -> float:
        """The kvfs daemon's CPU seconds so far, every thread (0 for the others)."""
        pid = self.pid()
        if pid is None:
            return 0.0
        with open(f"/proc/{pid}/stat") as f:
            p = f.read().rsplit(")", 1)[1].split()
        return (int(p[11]) + int(p[12])) / os.sysconf("SC_CLK_TCK")

    def rss(self) -> int:
        pid = self.pid()
        if pid is None:
            return 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def rss_of_empty_mount(self) -> int:
        """RSS of a kvfs daemon that holds no file, mounted beside this one (the baseline of
        memory per file)."""
        empty = Target("kvfs", Path(tempfile.mkdtemp(prefix="kvfs-meta-empty-",
                                                     dir=self.args.work_dir)), self.args)
        empty.dram = Path(f"{self.dram}-empty")
        try:
            empty.start()
            return empty.rss()
        finally:
            empty.cleanup()

    def status(self) -> dict:
        return json.loads(os.getxattr(self.path, "user.kvfs.status"))


def run_phase(target: Target, paths: list[Path], op) -> dict:
    """Time *op* over *paths*: files/s overall, in the first and the last tenth, and the
    kvfs daemon's CPU per file."""
    tenth = max(1, len(paths) // 10)
    c0, t0 = target.cpu(), time.perf_counter()
    head = tail = 0.0
    for i, p in enumerate(paths):
        op(p)
        if i + 1 == tenth:
            head = time.perf_counter() - t0
        elif i + 1 == len(paths) - tenth:
            tail = time.perf_counter()
    total = time.perf_counter() - t0
    tail = time.perf_counter() - tail if tail else total
    return {"files_per_s": len(paths) / total, "seconds": total,
            "tail_over_head": (tenth / tail) / (tenth / head) if head and tail else 1.0,
            "cpu_us_per_file": (target.cpu() - c0) / len(paths) * 1e6}


def layout(root: Path, n: int, per_dir: int | None) -> tuple[list[Path], list[Path]]:
    """(directories to make, file paths): all in one directory, or *per_dir* a directory."""
    if per_dir is None:
        return [root / "d"], [root / "d" / f"{i:08d}" for i in range(n)]
    dirs = [root / f"d{j:05d}" for j in range(-(-n // per_dir))]
    return dirs, [dirs[i // per_dir] / f"{i:08d}" for i in range(n)]


def bench_layout(target: Target, name: str, args: argparse.Namespace) -> dict:
    per_dir = None if name == "one-dir" else args.per_dir
    dirs, paths = layout(target.path, args.files, per_dir)
    for d in dirs:
        d.mkdir()
    blob = os.urandom(args.size)

    def create(p: Path) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, blob)
        os.close(fd)

    out = {"create": run_phase(target, paths, create)}
    if target.name == "kvfs" and name == "spread":
        time.sleep(1.0)  # the takes of the last files run when the daemon is idle
        out["umount_s"] = target.stop()
        rss_empty = target.rss_of_empty_mount()
        out["mount_s"] = target.start()
        out["rss_bytes_per_file"] = (target.rss() - rss_empty) / args.files
    out["stat"] = run_phase(target, paths, os.stat)
    out["unlink"] = run_phase(target, paths, os.unlink)
    return out


def bench_big(target: Target, args: argparse.Namespace) -> dict:
    """The repro's scenario: big writes on a fresh mount, then after many small files."""
    data = [os.urandom(BIG_SIZE) for _ in range(4)]

    def big(tag: str) -> dict:
        d = target.path / tag
        d.mkdir()
        c0, t0 = target.cpu(), time.perf_counter()
        for i in range(BIG_FILES):
            with open(d / f"{i}", "wb") as f:
                f.write(data[i % 4])
        return {"seconds": time.perf_counter() - t0, "cpu_s": target.cpu() - c0}

    out = {"fresh": big("fresh")}
    small = target.path / "small"
    small.mkdir()
    blob = os.urandom(4096)
    for i in range(args.small_files):
        fd = os.open(small / f"{i:08d}", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, blob)
        os.close(fd)
    time.sleep(2.0)
    out["after_small"] = big("after1")
    out["after_small_2"] = big("after2")
    if target.name == "kvfs":
        out["dram"] = target.status()["tiers"]["dram"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=20000, help="small files per layout")
    p.add_argument("--size", type=int, default=4096, help="bytes per small file")
    p.add_argument("--per-dir", type=int, default=100, help="files a directory, spread layout")
    p.add_argument("--small-files", type=int, default=20000,
                   help="4 KiB files written before the second big writes")
    p.add_argument("--dram-size", default="64M")
    p.add_argument("--nvme-size", default="8G")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--phases", default="one-dir,spread,big")
    p.add_argument("--work-dir", default="/var/tmp")
    p.add_argument("--timeout", type=float, default=600.0, help="per mount or unmount")
    p.add_argument("--json", action="store_true", help="print everything as JSON too")
    args = p.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    phases = [x for x in args.phases.split(",") if x]
    results: dict[str, dict] = {}
    for phase in phases:
        for name in configs if phase != "big" else [c for c in configs if c != "fuse-null"]:
            target = Target(name, Path(tempfile.mkdtemp(prefix=f"kvfs-meta-{name}-",
                                                        dir=args.work_dir)), args)
            try:
                target.start()
                r = bench_big(target, args) if phase == "big" else bench_layout(
                    target, phase, args)
            finally:
                target.cleanup()
            results.setdefault(phase, {})[name] = r
            print(f"{phase} {name}: done", file=sys.stderr, flush=True)
    report(results, args)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


def report(results: dict, args: argparse.Namespace) -> None:
    print(f"{args.files:,} files of {args.size:,} bytes; spread: {args.per_dir} a directory; "
          f"kvfs DRAM tier {args.dram_size}")
    for phase in ("one-dir", "spread"):
        r = results.get(phase)
        if not r:
            continue
        print(f"\n{phase}" + "".join(f" | {c:>24s}" for c in r) + " | kvfs/tmpfs | kvfs/fuse-null")
        for op in ("create", "stat", "unlink"):
            cells = []
            for c in r:
                x = r[c][op]
                cpu = f", {x['cpu_us_per_file']:.0f} us CPU" if c == "kvfs" else ""
                cells.append(f"{x['files_per_s']:8,.0f}/s t/h {x['tail_over_head']:.2f}{cpu}")
            ratios = [f"{r['kvfs'][op]['files_per_s'] / r[ref][op]['files_per_s']:.3f}x"
                      if "kvfs" in r and ref in r else "-" for ref in ("tmpfs", "fuse-null")]
            print(f"{op:7s}" + "".join(f" | {cell:>24s}" for cell in cells) + " | "
                  + " | ".join(ratios))
        k = r.get("kvfs", {})
        if "mount_s" in k:
            print(f"kvfs remount with {args.files:,} files: {k['mount_s']:.2f} s "
                  f"(unmount {k['umount_s']:.2f} s); RSS after it, beyond an empty mount's: "
                  f"{k['rss_bytes_per_file']:,.0f} bytes per file")
    big = results.get("big")
    if big:
        print(f"\nbig writes ({BIG_FILES} x 4 MiB) fresh, then after {args.small_files:,} "
              "4 KiB files (twice)")
        for c, r in big.items():
            cells = [f"{r[k]['seconds']:.2f} s" + (f" ({r[k]['cpu_s']:.1f} s CPU)"
                                                   if c == "kvfs" else "")
                     for k in ("fresh", "after_small", "after_small_2")]
            worst = max(r["after_small"]["seconds"], r["after_small_2"]["seconds"])
            print(f"  {c:6s} " + " | ".join(cells)
                  + f" | slower after / fresh: {worst / r['fresh']['seconds']:.1f}x")
        if "kvfs" in big and "tmpfs" in big:
            k, t = big["kvfs"], big["tmpfs"]
            print("  kvfs / tmpfs (MiB/s): " + ", ".join(
                f"{t[x]['seconds'] / k[x]['seconds']:.2f}x"
                for x in ("fresh", "after_small", "after_small_2")))


if __name__ == "__main__":
    sys.exit(main())
