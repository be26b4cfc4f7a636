"""The pod tier on Mooncake's synthetic trace (issue 35): requests assigned round-robin to N
kvfs mounts on this machine, each with a DRAM tier of --dram-pct percent of the replayed
unique blocks (and an NVMe tier that holds them all), with and without the pod, against one
mount that gets every request. One run, one master, all daemons stopped at the end.

Each hash id is a block file of --block-size bytes in one flat directory. A request is an
engine's: it looks up its blocks in order and reads the prefix it finds (`where` says from
which tier: local DRAM, local NVMe, or the pod for a file found there); from the first block
it does not find, it recomputes and writes every block of the request (a block the trace
reused but this node cannot give is a recompute). Requests follow the trace's timestamps
divided by --time-scale, one at a time.

Reported per setup: the share of reuse reads (blocks the trace reuses) served without
recompute, and by which tier. Goal (the issue): with the pod within 2 points of one node,
DRAM + pod >= 95%; without it the share falls towards 1/N.

    python tools/bench_pod_trace.py --quick          # 1000 requests, 16K blocks (minutes)
    python tools/bench_pod_trace.py --requests 3000 --block-size 64K --time-scale 4

Needs the `pod` extra and /dev/fuse.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pod import start_master  # noqa: E402
from bench_pod_mounts import mount, status, unmount  # noqa: E402
from trace_replay import TRACE, Blocks, Request, load_trace  # noqa: E402

from kvfs.config import format_size, parse_size  # noqa: E402


@dataclass
class Tally:
    setup: str
    reuse: int = 0  # reads the trace reuses
    dram: int = 0
    nvme: int = 0
    pod: int = 0
    recomputed: int = 0
    wrong: int = 0  # blocks read with other bytes than written (must stay 0)
    written: int = 0
    late_s: float = 0.0  # how far behind the trace's time the replay fell, at most
    published: int = 0
    extra: dict = field(default_factory=dict)

    def share(self, n: int) -> float:
        return 100.0 * n / self.reuse if self.reuse else 0.0


def tier_of(path: str) -> str | None:
    """Where *path*'s bytes are (dram, nvme, pod), or None if there is no such file."""
    try:
        where = json.loads(os.getxattr(path, "user.kvfs.where"))
    except FileNotFoundError:
        return None
    tiers = {t for c in where["chunks"] for t in c["tiers"]}
    if "pod" in tiers:
        return "pod"
    return "dram" if all("dram" in c["tiers"] for c in where["chunks"]) else "nvme"


def run_request(req: Request, mnt: Path, blocks: Blocks, t: Tally) -> None:
    ids = req.reads + req.writes
    bs = blocks.size
    first_miss = len(req.reads)  # (then the request's new blocks)
    for i, h in enumerate(req.reads):
        path = f"{mnt}/{h:010d}"
        tier = tier_of(path)
        if tier is not None:
            try:
                with open(path, "rb") as f:
                    data = f.read(bs)
            except FileNotFoundError:  # (found in the pod, then its fetch missed)
                tier = None
        if tier is None:
            first_miss = i
            break
        setattr(t, tier, getattr(t, tier) + 1)
        t.wrong += not blocks.check(h, data)
    t.reuse += len(req.reads)
    t.recomputed += len(req.reads) - min(first_miss, len(req.reads))
    for h in ids[first_miss:]:
        with open(f"{mnt}/{h:010d}", "wb") as f:
            f.write(blocks.get(h))
        t.written += 1


def replay(setup: str, reqs: list[Request], mounts: list[Path], blocks: Blocks,
           scale: float) -> Tally:
    t = Tally(setup)
    start = time.monotonic()
    for i, req in enumerate(reqs):
        due = start + req.ts / scale
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        else:
            t.late_s = max(t.late_s, now - due)
        run_request(req, mounts[i % len(mounts)], blocks, t)
    for m in mounts:
        pod = status(m).get("pod")
        if pod:
            t.published += pod["published_files"]
            for k in ("dropped", "errors", "timeouts", "damaged", "unpublished"):
                t.extra[k] = t.extra.get(k, 0) + pod[k]
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1000 requests of 16K blocks")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--block-size", default="64K")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--dram-pct", type=float, default=5.0)
    ap.add_argument("--time-scale", type=float, default=10.0,
                    help="the trace's time is divided by this")
    ap.add_argument("--setups", default="single,nodes,pod")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.block_size = 1000, "16K"
    bs = parse_size(args.block_size)
    reqs = load_trace(TRACE, args.requests)
    unique = len({h for r in reqs for h in r.reads + r.writes})
    cap = max(1, math.ceil(unique * args.dram_pct / 100))
    blocks = Blocks(bs, "kv")
    dram = max(4 << 20, cap * bs)
    nvme = 2 * unique * bs + (256 << 20)
    # Room in the pool for every block twice (-o pod_replicas=2) and Mooncake's slack.
    segment = max(64 << 20, 3 * unique * bs // args.nodes)
    base_opts = f"dram_size={dram},nvme_size={nvme}"
    proc, master = start_master()
    base = Path(tempfile.mkdtemp(prefix="benchpodtrace-"))
    results: list[Tally] = []
    try:
        for setup in args.setups.split(","):
            n = 1 if setup == "single" else args.nodes
            opts = base_opts + (f",pod={master},pod_segment_size={segment},"
                                f"pod_name={setup}{os.getpid()}" if setup == "pod" else "")
            mounts: list[Path] = []
            try:
                for k in range(n):
                    mounts.append(mount(base, f"{setup}{k}", opts))
                t0 = time.monotonic()
                results.append(replay(setup, reqs, mounts, blocks, args.time_scale))
                results[-1].extra["seconds"] = round(time.monotonic() - t0, 1)
            finally:
                for m in mounts:
                    unmount(m)
                for k in range(n):
                    subprocess.run(["rm", "-rf", f"/dev/shm/benchpod-{base.name}-{setup}{k}"])
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["rm", "-rf", str(base)])
    print(f"{args.requests} requests of Mooncake's synthetic trace, {unique} unique blocks of "
          f"{format_size(bs)}, {results[0].reuse if results else 0} reuse reads; DRAM per "
          f"node {cap} blocks ({args.dram_pct:g}%); time / {args.time_scale:g}")
    print(f"{'setup':>8} {'nodes':>5} {'served':>7} {'DRAM':>6} {'NVMe':>6} {'pod':>6} "
          f"{'DRAM+pod':>8} {'recomp':>7} {'wrong':>5} {'late s':>6}  pod counters")
    for t in results:
        n = 1 if t.setup == "single" else args.nodes
        print(f"{t.setup:>8} {n:>5} {t.share(t.dram + t.nvme + t.pod):6.1f}% "
              f"{t.share(t.dram):5.1f}% {t.share(t.nvme):5.1f}% {t.share(t.pod):5.1f}% "
              f"{t.share(t.dram + t.pod):7.1f}% {t.share(t.recomputed):6.1f}% {t.wrong:>5} "
              f"{t.late_s:6.1f}  {json.dumps(t.extra | {'published': t.published})}")


if __name__ == "__main__":
    main()
