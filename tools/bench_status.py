#!/usr/bin/env python3
"""What a `kvfsctl status` call costs a live mount, beside the cheapest request there is.

Status is answered on the daemon's one trio thread, so while it is computed every FUSE
request waits; monitoring polls it. It must not grow with the number of files. This mounts
a fresh kvfs, writes --files small files (each adds an inode and a write-order edge), then
times, taking turns, a status call (getxattr user.kvfs.status on the mount) and a getxattr
of a missing user xattr (a round trip to the same thread that does nothing: the floor).

    python tools/bench_status.py                  # 30,000 files
    python tools/bench_status.py --files 100000
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=30000)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--work-dir", default="/var/tmp")
    args = p.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvfs-status-", dir=args.work_dir))
    mnt, dram = base / "mnt", Path(f"/dev/shm/kvfs-status-{os.getpid()}")
    mnt.mkdir()
    subprocess.run([sys.executable, "-m", "kvfs", "mount", str(mnt), "--dram-dir", str(dram),
                    "--dram-size", "1G", "--nvme-dir", str(base / "nvme"), "--nvme-size", "8G"],
                   cwd=ROOT, check=True)
    try:
        d = mnt / "blocks"
        d.mkdir()
        t0 = time.perf_counter()
        for i in range(args.files):
            with open(d / f"{i:08d}", "wb") as f:
                f.write(b"k" * 4096)
        print(f"{args.files:,} files written in {time.perf_counter() - t0:.1f} s")
        time.sleep(1.0)  # the takes run when the daemon is idle

        def floor() -> None:
            try:
                os.getxattr(mnt, "user.kvfs-bench-missing")
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise

        status_s, floor_s = [], []
        for _ in range(args.calls):
            status_s.append(timed(lambda: os.getxattr(mnt, "user.kvfs.status")))
            floor_s.append(timed(floor))
        st = json.loads(os.getxattr(mnt, "user.kvfs.status"))
        print(f"status reports {st['files']:,} files, "
              f"{st['prefetch'].get('graph_edges', 0):,} successor edges")
        for name, xs in (("status", status_s), ("floor (missing xattr)", floor_s)):
            print(f"  {name:22s} p50 {statistics.median(xs) * 1e6:8.0f} us   "
                  f"max {max(xs) * 1e6:8.0f} us")
        ratio = statistics.median(status_s) / statistics.median(floor_s)
        print(f"  status / floor, p50: {ratio:.1f}x")
    finally:
        subprocess.run([sys.executable, "-m", "kvfs", "umount", str(mnt)], cwd=ROOT)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(dram, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
