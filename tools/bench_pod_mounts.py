"""The pod tier through kvfs mounts: a file written on mount A read on mount B (lookup, fetch
of the whole file, its store write, the reads) against Mooncake's own get_into of the same
bytes; and negative lookups (stat of absent names) on a pod mount against a mount without a
pod. One run, one master and three kvfs daemons on loopback, all stopped at the end.

    python tools/bench_pod_mounts.py [--sizes 4M,32M] [--reps 3] [--lookups 2000]

Needs the `pod` extra and /dev/fuse. Throughput is of the file's bytes, from B's open to the
end of its last read (after A published it); B's open (its lookup and the fetch) and its
read are also shown apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pod import kv_bytes, raw_mooncake, start_master  # noqa: E402

from kvfs.config import format_size, parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def mount(base: Path, name: str, options: str) -> Path:
    mnt = base / name / "mnt"
    mnt.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    subprocess.run([sys.executable, "-m", "kvfs", "mount", str(mnt),
                    "--dram-dir", f"/dev/shm/benchpod-{base.name}-{name}",
                    "--nvme-dir", str(base / name / "nvme"),
                    "--log-file", str(base / name / "kvfs.log"), "-o", options],
                   check=True, env=env, timeout=120)
    return mnt


def unmount(mnt: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run([sys.executable, "-m", "kvfs", "umount", str(mnt)], env=env,
                       capture_output=True, timeout=300)
    if r.returncode:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)


def status(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.kvfs.status"))


def a_to_b(a: Path, b: Path, sizes: list[int], reps: int
           ) -> dict[int, tuple[float, float, float]]:
    """Bytes/s of B's open + read of a file A wrote, and the seconds of its open (the
    lookup and the fetch) and of its read (medians of reps)."""
    out = {}
    for size in sizes:
        data = kv_bytes(size)
        times, opens, reads = [], [], []
        for r in range(reps):
            name = f"f{size}-{r}.bin"
            done = status(a)["pod"]["published_files"]
            (a / name).write_bytes(data)
            deadline = time.monotonic() + 60
            while status(a)["pod"]["published_files"] == done:
                if time.monotonic() > deadline:
                    raise SystemExit(f"A did not publish {name}: see its kvfs.log")
                time.sleep(0.01)
            t0 = time.perf_counter()
            with open(b / name, "rb") as f:
                t1 = time.perf_counter()
                got = f.read()
            t2 = time.perf_counter()
            times.append(t2 - t0)
            opens.append(t1 - t0)
            reads.append(t2 - t1)
            if got != data:
                raise SystemExit(f"B read other bytes of {name}")
        out[size] = (size / statistics.median(times), statistics.median(opens),
                     statistics.median(reads))
    return out


def negative_lookups(mnt: Path, n: int) -> tuple[float, float]:
    """p50 and p99 in microseconds of stat() of *n* names nobody has."""
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        try:
            os.stat(mnt / f"absent-{i}.bin")
        except FileNotFoundError:
            pass
        lat.append((time.perf_counter() - t0) * 1e6)
    lat.sort()
    return lat[len(lat) // 2], lat[min(n - 1, int(0.99 * n))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4M,32M")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lookups", type=int, default=2000)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    segment = 2 * args.reps * sum(sizes) + (64 << 20)  # (two copies of each file)
    proc, master = start_master()
    base = Path(tempfile.mkdtemp(prefix="benchpod-"))
    mounts: list[Path] = []
    try:
        raw = raw_mooncake(master, sizes, args.reps, 64 << 20)
        common = "dram_size=1G,nvme_size=2G"
        pod = f"{common},pod={master},pod_segment_size={segment}"
        for name, options in (("a", pod), ("b", pod), ("plain", common)):
            mounts.append(mount(base, name, options))
        a, b, plain = mounts
        got = a_to_b(a, b, sizes, args.reps)
        neg_pod = negative_lookups(b, args.lookups)
        neg_plain = negative_lookups(plain, args.lookups)
        st = status(b)["pod"]
    finally:
        for mnt in mounts:
            unmount(mnt)
        proc.kill()
        proc.wait()
        for name in ("a", "b", "plain"):
            subprocess.run(["rm", "-rf", f"/dev/shm/benchpod-{base.name}-{name}"])
        subprocess.run(["rm", "-rf", str(base)])
    mib = 1 << 20
    print(f"{'size':>8} {'get_into MiB/s':>15} {'A->B read MiB/s':>16} {'ratio':>6} "
          f"{'B open ms':>10} {'B read ms':>10}")
    for size in sizes:
        rate, opened, read = got[size]
        print(f"{format_size(size):>8} {raw[size][1] / mib:15.0f} {rate / mib:16.0f} "
              f"{rate / raw[size][1]:6.2f} {opened * 1e3:10.1f} {read * 1e3:10.1f}")
    print(f"negative lookups ({args.lookups} stat of absent names): pod p50 {neg_pod[0]:.0f} us"
          f" p99 {neg_pod[1]:.0f} us; no pod p50 {neg_plain[0]:.0f} us p99 {neg_plain[1]:.0f} us"
          f"; p50 ratio {neg_pod[0] / neg_plain[0]:.2f}")
    print(f"B's pod lookups (the daemon's view): p50 {st['lookup_p50_us']} us, "
          f"p99 {st['lookup_p99_us']} us")


if __name__ == "__main__":
    main()
