#!/usr/bin/env python3
"""Where a block file's time goes, request by request: kvfs beside the FUSE floor.

Every FUSE request the kernel sends is timed by the kernel itself (the fuse_request_send
and fuse_request_end tracepoints, Linux 6.x), so the figures include the time a request
waits in the daemon's queue behind others, which a profile of the daemon does not show.
For each target (fuse-null: tools/nullfs.py, the least a pyfuse3 filesystem can do; kvfs:
a fresh mount whose DRAM tier holds every file) it writes --files block files of --size,
each with one write() as an engine does, then reads them back (open, read, close), and
prints per phase and opcode: requests per file, p50 and mean latency, and the request time
per file; then files/s and kvfs / fuse-null ratios. The targets take turns batch by batch
(the machine is shared and noisy: a drift hits both).

    python tools/fuse_requests.py                  # 2,048 files of 256 KiB
    python tools/fuse_requests.py --size 4M --files 256

Needs root and tracefs (/sys/kernel/tracing). RELEASE is asynchronous (close() does not
wait for it), but the daemon serves it before whatever the caller sends next.
"""

from __future__ import annotations

import argparse
import collections
import mmap
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_fs as bench  # noqa: E402

TRACING = Path("/sys/kernel/tracing")
EVENTS = ("fuse_request_send", "fuse_request_end")
LINE = re.compile(r"\s(\d+\.\d+): fuse_request_(send|end): connection (\d+) req (\d+)"
                  r"(?: opcode \d+ \((\w+)\))?")
BATCHES = 8


class Tracer:
    """The FUSE tracepoints, on while a phase runs; requests of one connection only."""

    def __init__(self) -> None:
        if not (TRACING / "events/fuse/fuse_request_send").is_dir():
            sys.exit(f"{TRACING}/events/fuse not found: this needs root, tracefs and a "
                     "kernel with the FUSE tracepoints (Linux 6.x)")
        (TRACING / "buffer_size_kb").write_text("131072")

    def _switch(self, on: bool) -> None:
        for event in EVENTS:
            (TRACING / f"events/fuse/{event}/enable").write_text("1" if on else "0")

    def run(self, connection: int, fn) -> tuple[float, dict[str, list[float]]]:
        """Run *fn*; its seconds and {opcode: [latency in us]} of *connection*."""
        (TRACING / "trace").write_text("")
        self._switch(True)
        try:
            seconds = fn()
        finally:
            self._switch(False)
        sent: dict[str, tuple[float, str]] = {}
        out: dict[str, list[float]] = collections.defaultdict(list)
        with open(TRACING / "trace") as f:
            for line in f:
                m = LINE.search(line)
                if m is None or int(m[3]) != connection:
                    continue
                if m[2] == "send":
                    sent[m[4]] = (float(m[1]), m[5])
                elif m[4] in sent:
                    t0, op = sent.pop(m[4])
                    out[op.removeprefix("FUSE_")].append((float(m[1]) - t0) * 1e6)
        return seconds, out


def connection_of(path: Path) -> int:
    return os.minor(os.stat(path).st_dev)


def report(phase: str, files: dict[str, int], seconds: dict[str, float],
           lat: dict[str, dict[str, list[float]]]) -> None:
    names = list(lat)
    print(f"\n{phase}: " + ", ".join(f"{k} {files[k] / seconds[k]:,.0f} files/s"
                                      for k in names)
          + (f" ({seconds[names[0]] / seconds[names[1]]:.2f}x)" if len(names) == 2 else ""))
    head = f"  {'request':12s}" + "".join(f" | {k:>9s}: per file   p50 us  mean us" for k in names)
    print(head)
    per_file = {k: 0.0 for k in names}
    for op in sorted(set().union(*(lat[k] for k in names))):
        row = f"  {op:12s}"
        for k in names:
            v = lat[k].get(op, [])
            if v:
                per_file[k] += sum(v) / files[k]
                row += (f" | {'':9s}  {len(v) / files[k]:8.2f} {statistics.median(v):8.0f}"
                        f" {statistics.mean(v):8.0f}")
            else:
                row += f" | {'':9s}  {'-':>8s} {'':8s} {'':8s}"
        print(row)
    print("  request time per file: " + ", ".join(f"{k} {per_file[k]:,.0f} us" for k in names))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256K", help="block file size (default 256K)")
    p.add_argument("--files", type=int, default=2048, help="files per target (default 2048)")
    p.add_argument("--base-dir", default="/var/tmp", help="where the NVMe tier goes")
    p.add_argument("--kvfs-options", default="", help="more -o options for kvfs, k=v,...")
    args = p.parse_args()
    size, n = bench.parse_size(args.size), args.files
    blocks = bench.kv_blocks(bench.DATA, size)
    tracer = Tracer()
    tmp = Path(args.base_dir) / f"kvfs-fuse-requests-{os.getpid()}"
    tmp.mkdir(parents=True)
    bench.WATCHDOG.install()
    opts = {"dram_size": max(2 * size * n + (64 << 20), 256 << 20), "nvme_size": "8G",
            "chunk_size": "1M"}
    for item in filter(None, args.kvfs_options.split(",")):
        key, _, value = item.partition("=")
        opts[key] = value or 1
    mounts = {"fuse-null": bench.NullMount(tmp / "null"),
              "kvfs": bench.KvfsMount(tmp / "kvfs", bench.kvfs_env(), opts)}
    buf = memoryview(mmap.mmap(-1, size))
    try:
        for m in mounts.values():
            m.mount()
        paths = {k: bench.file_paths(str(m.path / "blocks"), n) for k, m in mounts.items()}
        bounds = [n * j // BATCHES for j in range(BATCHES + 1)]
        for phase in ("write", "read"):
            seconds = dict.fromkeys(mounts, 0.0)
            lat = {k: collections.defaultdict(list) for k in mounts}
            for j in range(BATCHES):
                lo, hi = bounds[j], bounds[j + 1]
                for k in (list(mounts) if j % 2 == 0 else list(mounts)[::-1]):
                    if phase == "write":
                        def fn(k=k, lo=lo, hi=hi):
                            return bench.write_files(paths[k][lo:hi], size, blocks, False,
                                                     first=lo)
                    else:
                        def fn(k=k, lo=lo, hi=hi):
                            return bench.read_files(paths[k][lo:hi], size, blocks, buf, False,
                                                    k != "fuse-null", first=lo)
                    t, got = tracer.run(connection_of(mounts[k].path), fn)
                    seconds[k] += t
                    for op, v in got.items():
                        lat[k][op].extend(v)
                    time.sleep(0.05)  # kvfs takes the last file it wrote when idle
            report(phase, dict.fromkeys(mounts, n), seconds, lat)
    finally:
        for m in mounts.values():
            m.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
