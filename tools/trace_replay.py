#!/usr/bin/env python3
"""Replay a Mooncake-format KV-cache trace through a mounted kvfs and compare with offline
caches on the same trace and DRAM capacity.

Each hash id becomes one block file of --block-size bytes in one flat directory. Requests
run in timestamp order: a request reads the blocks it shares with earlier requests (its
reused prefix) in order, then writes the blocks never seen before. Each request runs on its
own thread (an engine worker loading one request: kvfs sees a distinct caller per request),
or with --reader pool on a fixed pool of --workers threads. Arrival is as fast as possible
(--arrival fast, at most --workers requests at a time) or follows the trace's timestamps
divided by --time-scale.

For each mode (kvfs with prediction on, with prediction off) it mounts a fresh kvfs with a
DRAM tier of --dram-pct percent of the replayed unique blocks and an NVMe tier big enough for
all of them, replays, and reports from `kvfsctl status` counters and client-side timings:

  DRAM hit rate among reuse reads (chunks served from DRAM / chunks read), the share served
  on time (not waiting for an in-flight prefetch), the share answered from the daemon's
  read-ahead memory ("RA mem": blocks of at least -o read_through_min are read through, not
  staged in DRAM, and predicted ones are read ahead there), prefetch accuracy (used /
  issued), wasted prefetch bytes, p50/p99 block read latency (open+read+close, client
  side) and the p50 of DRAM hits (reads sampled with `user.kvfs.where` just before reading,
  every --sample-every reads), plus the offline LRU and Belady (OPT) hit rates for the same
  trace and capacity.

Two reference modes replay the same requests without kvfs, for the latency columns: `tmpfs`
(a directory in /dev/shm: every block in DRAM, no FUSE) and `fuse-null` (tools/nullfs.py,
the least a pyfuse3 filesystem can do, blocks kept in its memory: the FUSE floor). Both hold
every block in RAM, so they need the replayed data's size free.

    python tools/trace_replay.py --requests 1500          # a prefix of the trace
    python tools/trace_replay.py --requests 1500 --modes tmpfs,fuse-null,on
    python tools/trace_replay.py --block-size 64K --requests 400 --modes on
    python tools/trace_replay.py --content kv-bf16 --modes off,off+packed,on,on+packed

A `+packed` mode mounts with `-o dram_compress` (clean DRAM copies kept compressed): the DRAM
tier holds more blocks, and each DRAM hit pays a decode.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
NULLFS = Path(__file__).resolve().parent / "nullfs.py"
REFERENCES = ("tmpfs", "fuse-null")  # modes without kvfs: every read is a DRAM read
TRACE = SHARED / "traces" / "mooncake_synthetic_trace.jsonl"
KV_DATA = {"kv": SHARED / "kv" / "smollm2_kv_fp16.npy",
           "kv-bf16": SHARED / "kv" / "smollm2_kv_bf16.npy"}
sys.path.insert(0, str(ROOT))

import xxhash  # noqa: E402

from kvfs.config import format_size, parse_size  # noqa: E402
from kvfs.store.dram import remove_dram_dir  # noqa: E402


# -- the trace ---------------------------------------------------------------------------------
@dataclass
class Request:
    ts: float  # seconds
    reads: list[int]
    writes: list[int]


def load_trace(path: Path, limit: int | None) -> list[Request]:
    rows = [json.loads(line) for line in path.open() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
    if limit:
        rows = rows[:limit]
    seen: set[int] = set()
    out = []
    for r in rows:
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        new = [h for h in ids[k:] if h not in seen]  # all reuse is a prefix in Mooncake traces
        out.append(Request(r["timestamp"] / 1000.0, ids[:k], list(dict.fromkeys(new))))
        seen.update(ids)
    return out


def offline_lru(acc: list[tuple[int, bool]], cap: int) -> float:
    """Hit rate among reads of an LRU cache of *cap* blocks that every access goes through."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = reads = 0
    for b, is_read in acc:
        if is_read:
            reads += 1
            hits += b in cache
        cache[b] = None
        cache.move_to_end(b)
        if len(cache) > cap:
            cache.popitem(last=False)
    return hits / reads if reads else 0.0


def offline_belady(acc: list[tuple[int, bool]], cap: int) -> float:
    """Belady's OPT (demand-only, may bypass): evict the block used furthest in the future."""
    never = len(acc) + 1
    nxt = [never] * len(acc)
    last: dict[int, int] = {}
    for i in range(len(acc) - 1, -1, -1):
        b = acc[i][0]
        nxt[i] = last.get(b, never)
        last[b] = i
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = reads = 0
    for i, (b, is_read) in enumerate(acc):
        if is_read:
            reads += 1
            hits += b in cache
        cache[b] = nxt[i]
        heapq.heappush(heap, (-nxt[i], b))
        while len(cache) > cap:
            neg, victim = heapq.heappop(heap)
            if cache.get(victim) == -neg:
                del cache[victim]
    return hits / reads if reads else 0.0


# -- block contents ----------------------------------------------------------------------------
class Blocks:
    """Deterministic block bytes: real fp16 or bf16 KV data (or random bytes), stamped with
    the id."""

    def __init__(self, size: int, content: str) -> None:
        self.size = size
        pool = b""
        if content in KV_DATA and KV_DATA[content].exists():
            import numpy as np

            raw = np.load(KV_DATA[content], mmap_mode="r").reshape(-1).view(np.uint8)
            pool = bytes(raw[: (len(raw) // size) * size])
        if len(pool) < size:
            pool = os.urandom(max(64, (8 << 20) // size) * size)
        self.pool = pool
        self.n = len(pool) // size
        self.sums: dict[int, int] = {}

    def get(self, h: int) -> bytes:
        i = (h * 2654435761) % self.n
        data = h.to_bytes(8, "little") + self.pool[i * self.size + 8:(i + 1) * self.size]
        self.sums[h] = xxhash.xxh3_64_intdigest(data)
        return data

    def check(self, h: int, data: bytes) -> bool:
        """Is *data* what was written as block *h*? (Its xxh3, recorded when written.)"""
        return len(data) == self.size and xxhash.xxh3_64_intdigest(data) == self.sums.get(h)


# -- one kvfs run --------------------------------------------------------------------------------
@dataclass
class Run:
    mode: str
    lat_all: list[float] = field(default_factory=list)
    lat_hit: list[float] = field(default_factory=list)
    lat_miss: list[float] = field(default_factory=list)
    miss_pos: list[int] = field(default_factory=list)  # position in its request of sampled misses
    # reads over --slow-us: (CLOCK_MONOTONIC start, block, position, open, read, close seconds)
    slow: list[tuple] = field(default_factory=list)
    errors: int = 0
    wrong: int = 0
    seconds: float = 0.0
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def status(mnt: Path) -> dict:
    """kvfs's counters ({} on a reference mode, which has none)."""
    try:
        return json.loads(os.getxattr(mnt, "user.kvfs.status"))
    except OSError:
        return {}


def in_dram(path: str, reference: bool) -> bool | None:
    try:
        w = json.loads(os.getxattr(path, "user.kvfs.where"))
    except OSError:  # a reference mode has no such xattr, but pays the same system call
        return True if reference else None
    return all("dram" in c["tiers"] for c in w["chunks"])


def do_request(req: Request, d: str, blocks: Blocks, run: Run, sample_every: int,
               counter: list[int], slow_s: float = 0.001) -> None:
    reference = run.mode in REFERENCES
    lat, hit, miss, miss_pos, wrong, errors, slow = [], [], [], [], 0, 0, []
    bs = blocks.size
    for i, h in enumerate(req.reads):
        path = f"{d}/{h:010d}"
        counter[0] += 1  # racy across threads; only picks which reads are sampled
        sampled = sample_every and counter[0] % sample_every == 0
        tier = in_dram(path, reference) if sampled else None
        t0 = time.perf_counter()
        try:
            fd = os.open(path, os.O_RDONLY)
            t1 = time.perf_counter()
            try:
                data = os.read(fd, bs)
            finally:
                t2 = time.perf_counter()
                os.close(fd)
        except OSError:
            errors += 1
            continue
        t3 = time.perf_counter()
        dt = t3 - t0
        lat.append(dt)
        if dt > slow_s:  # perf_counter is CLOCK_MONOTONIC: joins with the daemon's own logs
            slow.append((t0, h, i, t1 - t0, t2 - t1, t3 - t2))
        if tier is True:
            hit.append(dt)
        elif tier is False:
            miss.append(dt)
            miss_pos.append(i)
        if not blocks.check(h, data):
            wrong += 1
    for h in req.writes:
        path = f"{d}/{h:010d}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, blocks.get(h))
            finally:
                os.close(fd)
        except OSError:
            errors += 1
    with run.lock:
        run.lat_all += lat
        run.lat_hit += hit
        run.lat_miss += miss
        run.miss_pos += miss_pos
        run.wrong += wrong
        run.errors += errors
        run.slow += slow


def start_hinter(d: str, ahead: int):
    """A thread that tells kvfs (kvfs.client.prefetch) which blocks queued requests will read,
    as an engine's scheduler can; the replay puts each request's reads on the queue once, when
    it is `ahead` requests from running. Hints already sent are not sent again while fresh."""
    import queue

    from kvfs.client import prefetch

    q: queue.Queue = queue.Queue()
    sent: OrderedDict[int, None] = OrderedDict()

    def run() -> None:
        while (reads := q.get()) is not None:
            todo = [h for h in reads if h not in sent]
            for h in reads:
                sent[h] = None
                sent.move_to_end(h)
            while len(sent) > 64 * ahead:
                sent.popitem(last=False)
            prefetch(f"{d}/{h:010d}" for h in todo)

    threading.Thread(target=run, daemon=True).start()
    return q


def replay(reqs: list[Request], mnt: Path, blocks: Blocks, run: Run, args) -> None:
    d = str(mnt / "blocks")
    os.mkdir(d)
    run.before = status(mnt)
    slots = threading.Semaphore(args.workers)
    counter = [0]
    threads: list[threading.Thread] = []
    t_start = time.perf_counter()
    step = max(1, len(reqs) // 10)

    def one(req: Request) -> None:
        try:
            do_request(req, d, blocks, run, args.sample_every, counter, args.slow_us / 1e6)
        finally:
            slots.release()

    pool_q: list = []
    if args.reader == "pool":
        import queue

        q: queue.Queue = queue.Queue()
        pool_q.append(q)

        def worker() -> None:
            while True:
                req = q.get()
                if req is None:
                    return
                one(req)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
        for t in threads:
            t.start()
    hints = (start_hinter(d, args.hint_ahead) if args.hint_ahead and run.mode not in REFERENCES
             else None)
    t0_trace = reqs[0].ts if reqs else 0.0
    for i, req in enumerate(reqs):
        if args.arrival == "timestamps":
            due = (req.ts - t0_trace) / args.time_scale
            delay = due - (time.perf_counter() - t_start)
            if delay > 0:
                time.sleep(delay)
        if hints is not None:  # the engine's scheduler: the queue's next requests will read these
            for ahead in reqs[i + args.hint_ahead if i else 0 : i + 1 + args.hint_ahead]:
                hints.put(ahead.reads)  # each request once, N requests before it runs
        slots.acquire()
        if pool_q:
            pool_q[0].put(req)
        else:
            t = threading.Thread(target=one, args=(req,), daemon=True)
            t.start()
            threads.append(t)
            if len(threads) > 64:
                threads = [t for t in threads if t.is_alive()]
        if (i + 1) % step == 0:
            print(f"  [{run.mode}] {i + 1}/{len(reqs)} requests, "
                  f"{time.perf_counter() - t_start:.0f}s", file=sys.stderr, flush=True)
    if pool_q:
        for _ in threads:
            pool_q[0].put(None)
    for t in threads:
        t.join()
    if hints is not None:
        hints.put(None)
    run.seconds = time.perf_counter() - t_start
    run.after = status(mnt)


def replay_reference(mode: str, reqs: list[Request], blocks: Blocks, args) -> Run:
    """The same requests on tmpfs, or on fuse-null (tools/nullfs.py) mounted for the run."""
    run = Run(mode)
    base = Path(tempfile.mkdtemp(prefix=f"kvfs-replay-{mode}-",
                                 dir="/dev/shm" if mode == "tmpfs" else args.work_dir))
    proc = None
    try:
        if mode == "fuse-null":
            proc = subprocess.Popen([sys.executable, str(NULLFS), str(base)], cwd="/",
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
            deadline = time.monotonic() + 30
            while not os.path.ismount(base):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("fuse-null did not mount")
                time.sleep(0.02)
        replay(reqs, base, blocks, run, args)
    finally:
        if proc is not None:
            subprocess.run(["fusermount3", "-u", str(base)], capture_output=True, timeout=120)
            proc.wait(timeout=120)
        shutil.rmtree(base, ignore_errors=True)
    return run


def mount_and_replay(mode: str, reqs: list[Request], blocks: Blocks, cap_blocks: int,
                     unique: int, args) -> Run:
    if mode in REFERENCES:
        return replay_reference(mode, reqs, blocks, args)
    run = Run(mode)
    base = Path(tempfile.mkdtemp(prefix=f"kvfs-replay-{mode}-", dir=args.work_dir))
    mnt, nvme = base / "mnt", base / "nvme"
    mnt.mkdir()
    dram = Path("/dev/shm") / f"kvfs-replay-{uuid.uuid4().hex[:12]}"
    bs = blocks.size
    seg = 64 << 20
    nvme_size = max(8 * seg, int(unique * bs * 1.3) + 16 * seg)  # "unbounded": all of it fits
    opts = {"dram_size": cap_blocks * bs, "nvme_size": nvme_size, "chunk_size": args.chunk_size,
            "segment_size": seg, "prefetch": "on" if mode.startswith("on") else "off"}
    if mode.endswith("+packed"):
        opts["dram_compress"] = "1"
    if args.options:
        opts.update(dict(o.split("=", 1) for o in args.options.split(",")))
    cmd = [sys.executable, "-m", "kvfs", "mount", str(mnt), "--dram-dir", str(dram),
           "--nvme-dir", str(nvme), "-o", ",".join(f"{k}={v}" for k, v in opts.items())]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        shutil.rmtree(base, ignore_errors=True)
        remove_dram_dir(str(dram))  # the daemon may have made its DRAM tier already
        raise SystemExit(f"mount failed: {r.stderr}")
    try:
        replay(reqs, mnt, blocks, run, args)
    finally:
        subprocess.run([sys.executable, "-m", "kvfs", "umount", str(mnt)], cwd=ROOT,
                       capture_output=True, timeout=600)
        remove_dram_dir(str(dram))
        if args.keep:
            print(f"  kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    return run


# -- report --------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def slow_steps(run: Run) -> dict:
    """How many reads were slow, and in how many of them each step (open, read, close)
    took most of the time."""
    most = [max(range(3), key=lambda k, r=r: r[3 + k]) for r in run.slow]
    return {"slow_reads": len(run.slow), "slowest_step": {
        name: most.count(k) for k, name in enumerate(("open", "read", "close"))}}


def write_slow_log(path: Path, runs: list[Run]) -> None:
    with path.open("w") as f:
        f.write("mode\tstart_monotonic_s\tblock\tposition\topen_us\tread_us\tclose_us\n")
        for run in runs:
            for t0, h, i, o, r, c in sorted(run.slow):
                f.write(f"{run.mode}\t{t0:.6f}\t{h}\t{i}\t{o * 1e6:.0f}\t{r * 1e6:.0f}"
                        f"\t{c * 1e6:.0f}\n")


def summarize(run: Run) -> dict:
    out = _summarize(run)
    out.update(slow_steps(run))
    return out


def _summarize(run: Run) -> dict:
    a, b = run.after, run.before
    us = 1e6
    if not a:  # a reference mode: latencies only
        return {"mode": run.mode, "seconds": round(run.seconds, 1),
                "block_reads": len(run.lat_all), "errors": run.errors, "wrong_bytes": run.wrong,
                "p50_us": _r(pct(run.lat_all, 0.5), us), "p99_us": _r(pct(run.lat_all, 0.99), us),
                "p999_us": _r(pct(run.lat_all, 0.999), us),
                "hit_p50_us": _r(pct(run.lat_hit, 0.5), us),
                "hit_p99_us": _r(pct(run.lat_hit, 0.99), us), "hit_samples": len(run.lat_hit)}
    rd = {k: a["reads"][k] - b["reads"].get(k, 0)
          for k in ("chunks_from_dram", "chunks_from_nvme", "read_through_buffer_used_chunks")}
    pf = {k: a["prefetch"][k] - b["prefetch"].get(k, 0)
          for k in ("issued_chunks", "used_chunks", "late_chunks", "wasted_chunks")}
    total = rd["chunks_from_dram"] + rd["chunks_from_nvme"]
    cs = a["settings"]["chunk_size"]
    return {
        "mode": run.mode, "seconds": round(run.seconds, 1), "block_reads": len(run.lat_all),
        "chunk_reads": total, "errors": run.errors, "wrong_bytes": run.wrong,
        "dram_hit_rate": rd["chunks_from_dram"] / total if total else None,
        "on_time_rate": (rd["chunks_from_dram"] - pf["late_chunks"]) / total if total else None,
        # NVMe reads answered from the daemon's read-ahead memory (files read through, i.e.
        # at least -o read_through_min long): read before they were asked for, not from DRAM
        "through_buffer_rate": rd["read_through_buffer_used_chunks"] / total if total else None,
        "prefetch_issued": pf["issued_chunks"], "prefetch_used": pf["used_chunks"],
        "prefetch_late": pf["late_chunks"], "prefetch_wasted": pf["wasted_chunks"],
        "prefetch_unread_at_end": a["prefetch"].get("resident_unread_chunks", 0),
        "accuracy": pf["used_chunks"] / pf["issued_chunks"] if pf["issued_chunks"] else None,
        "wasted_bytes": pf["wasted_chunks"] * cs,
        "p50_us": _r(pct(run.lat_all, 0.5), us), "p99_us": _r(pct(run.lat_all, 0.99), us),
        "p999_us": _r(pct(run.lat_all, 0.999), us),
        "hit_p50_us": _r(pct(run.lat_hit, 0.5), us), "hit_p99_us": _r(pct(run.lat_hit, 0.99), us),
        "hit_samples": len(run.lat_hit),
        "miss_p50_us": _r(pct(run.lat_miss, 0.5), us), "miss_samples": len(run.lat_miss),
        "miss_positions": {p: run.miss_pos.count(p) for p in sorted(set(run.miss_pos))[:8]},
        # inside the daemon, from its log2 histogram (bucket upper bounds): a DRAM chunk read
        # from the store's lookup to the copy, without the FUSE round trip
        "daemon_dram_p50_us": hist_pct(a, b, "dram_latency_us_log2_histogram", 0.5),
        "daemon_dram_p99_us": hist_pct(a, b, "dram_latency_us_log2_histogram", 0.99),
        "readahead": {k: v for k, v in a["prefetch"].items()
                      if k in ("depth_chunks", "lead_chunks", "fetch_latency_us",
                               "reader_gap_us", "cheap_hits")},
    }


def hist_pct(after: dict, before: dict, key: str, q: float) -> int | None:
    """Upper bound (us) of the log2 bucket holding quantile q of a status histogram's growth."""
    h = [x - y for x, y in zip(after["reads"][key], before["reads"][key], strict=True)]
    total, seen = sum(h), 0
    for b, n in enumerate(h):
        seen += n
        if total and seen >= q * total:
            return 1 << b
    return None


def _r(x: float | None, scale: float) -> float | None:
    return None if x is None else round(x * scale)


def _p(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _n(x) -> str:
    return "-" if x is None else str(x)


def print_table(meta: dict, runs: list[dict], lru: float, opt: float) -> None:
    print(f"\ntrace {meta['trace']}: first {meta['requests']} of {meta['trace_requests']} "
          f"requests, {meta['reuse_reads']} reuse reads, {meta['writes']} block writes, "
          f"{meta['unique']} unique blocks of {format_size(meta['block_size'])}")
    print(f"DRAM tier {meta['dram_pct']}% of unique blocks = {meta['cap_blocks']} blocks "
          f"({format_size(meta['cap_blocks'] * meta['block_size'])}), NVMe unbounded, chunk "
          f"{format_size(meta['chunk_size'])}, arrival {meta['arrival']}, {meta['workers']} "
          f"worker(s), reader per {'request' if meta['reader'] == 'request' else 'pool thread'}"
          + (f", engine hints {meta['hint_ahead']} request(s) ahead" if meta["hint_ahead"]
             else ", no engine hints"))
    hdr = (f"{'':22} {'DRAM hit':>8} {'on time':>8} {'RA mem':>7} {'accuracy':>8} "
           f"{'wasted':>10} "
           f"{'p50 us':>7} {'p99 us':>7} {'hit p50':>7} {'p99/hitp50':>10} {'secs':>6}")
    print(hdr)
    for s in runs:
        ratio = (f"{s['p99_us'] / s['hit_p50_us']:.2f}" if s["p99_us"] and s["hit_p50_us"]
                 else "-")
        if s["mode"] in REFERENCES:
            name = s["mode"] + (" (FUSE floor)" if s["mode"] == "fuse-null" else "")
            print(f"{name:22} {'-':>8} {'-':>8} {'-':>7} {'-':>8} {'-':>10} {_n(s['p50_us']):>7} "
                  f"{_n(s['p99_us']):>7} {_n(s['hit_p50_us']):>7} {ratio:>10} "
                  f"{s['seconds']:>6}")
            continue
        name = f"kvfs prediction {s['mode']}"
        wasted = format_size(s["wasted_bytes"]) if s["prefetch_issued"] else "-"
        print(f"{name:22} {_p(s['dram_hit_rate']):>8} {_p(s['on_time_rate']):>8} "
              f"{_p(s['through_buffer_rate']):>7} {_p(s['accuracy']):>8} {wasted:>10} "
              f"{_n(s['p50_us']):>7} {_n(s['p99_us']):>7} {_n(s['hit_p50_us']):>7} "
              f"{ratio:>10} {s['seconds']:>6}")
    print(f"{'offline LRU':22} {_p(lru):>8}")
    print(f"{'offline Belady (OPT)':22} {_p(opt):>8}")
    for s in runs:
        if s["errors"] or s["wrong_bytes"]:
            print(f"!! {s['mode']}: {s['errors']} I/O errors, {s['wrong_bytes']} wrong reads")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--requests", type=int, default=0, help="replay the first N (0: all)")
    p.add_argument("--block-size", default="256K")
    p.add_argument("--chunk-size", default=None, help="kvfs chunk size (default: block size)")
    p.add_argument("--dram-pct", type=float, default=5.0)
    p.add_argument("--modes", default="on,off",
                   help="comma-separated: on, off (kvfs with prediction on or off), "
                        "on+packed, off+packed (the same with -o dram_compress), tmpfs, "
                        "fuse-null (references without kvfs)")
    p.add_argument("--arrival", choices=("fast", "timestamps"), default="fast")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="with --arrival timestamps: replay this many times faster")
    p.add_argument("--workers", type=int, default=1, help="requests in progress at once")
    p.add_argument("--reader", choices=("request", "pool"), default="request",
                   help="a thread per request, or a fixed pool of --workers threads")
    p.add_argument("--content", choices=("kv", "kv-bf16", "random"), default="kv",
                   help="block bytes: real fp16 KV (kv), real bf16 KV or random")
    p.add_argument("--sample-every", type=int, default=20,
                   help="classify every Nth read as DRAM hit or miss (0: never)")
    p.add_argument("--options", default="", help="extra kvfs -o options, k=v,...")
    p.add_argument("--work-dir", default="/var/tmp")
    p.add_argument("--hint-ahead", type=int, default=0, metavar="N",
                   help="hint each request's reads (kvfs.client.prefetch) when it is N "
                        "requests from running, as an engine's scheduler could (0: no hints)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--slow-us", type=float, default=1000.0,
                   help="reads slower than this count as slow (see --slow-log)")
    p.add_argument("--slow-log", type=Path, default=None, metavar="FILE",
                   help="write every slow read here (TSV: mode, CLOCK_MONOTONIC start, block, "
                        "position in its request, open/read/close us), to join with the "
                        "daemon's own timestamps; the summary says which step was slow")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if args.work_dir:
        os.makedirs(args.work_dir, exist_ok=True)
    bs = parse_size(args.block_size)
    args.chunk_size = parse_size(args.chunk_size) if args.chunk_size else bs
    trace_requests = sum(1 for line in args.trace.open() if line.strip())
    reqs = load_trace(args.trace, args.requests or None)
    acc = [a for r in reqs for a in [(b, True) for b in r.reads] + [(b, False) for b in r.writes]]
    unique = len({b for b, _ in acc})
    cap = max(4, math.ceil(args.dram_pct / 100 * unique))
    cap = max(cap, math.ceil(4 * args.chunk_size / bs))
    meta = {"trace": str(args.trace), "trace_requests": trace_requests, "requests": len(reqs),
            "reuse_reads": sum(len(r.reads) for r in reqs),
            "writes": sum(len(r.writes) for r in reqs), "unique": unique, "block_size": bs,
            "chunk_size": args.chunk_size, "dram_pct": args.dram_pct, "cap_blocks": cap,
            "arrival": args.arrival if args.arrival == "fast"
            else f"timestamps/{args.time_scale:g}", "workers": args.workers,
            "reader": args.reader, "content": args.content, "hint_ahead": args.hint_ahead}
    lru, opt = offline_lru(acc, cap), offline_belady(acc, cap)
    print(f"offline on {len(reqs)} requests, capacity {cap} blocks: LRU {_p(lru)}, "
          f"Belady {_p(opt)}", file=sys.stderr)
    blocks = Blocks(bs, args.content)
    runs, replayed = [], []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        run = mount_and_replay(mode, reqs, blocks, cap, unique, args)
        replayed.append(run)
        runs.append(summarize(run))
        print(f"  [{mode}] {json.dumps(runs[-1])}", file=sys.stderr)
    if args.slow_log:
        write_slow_log(args.slow_log, replayed)
    print_table(meta, runs, lru, opt)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "offline": {"lru": lru, "belady": opt},
                                         "runs": runs}, indent=1))
    return 0 if all(not s["errors"] and not s["wrong_bytes"] for s in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
