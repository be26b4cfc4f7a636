#!/usr/bin/env python3
"""Benchmark kvfs._index.ChunkIndex against a plain dict {(ino, chunk): loc_tuple}.

Both structures get the same keys and location tuples, inserted in the same order, and the
same hit and miss lookup sequences. Keys are realistic: many inodes, each with a run of
chunks 0..len-1 (lognormal file lengths). Every call is a Python-level call as kvfs would
make it: ``idx.set(ino, c, loc)`` vs ``d[ino, c] = loc`` and ``idx.get(ino, c)`` vs
``d.get((ino, c))`` (building the key tuple is part of the dict's cost).

Memory: ChunkIndex.memory_bytes() (allocated C tables) and the VmRSS growth of each build
phase, run one after the other in this process. The dict's RSS growth covers the dict plus
the key and location tuples and ints it keeps alive.

    python tools/bench_index.py [--entries 10000000] [--lookups 2000000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

try:
    from kvfs._index import ChunkIndex
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from kvfs._index import ChunkIndex

BATCH = 50_000  # small, so transient batch tuples barely move RSS
CHUNK = 1 << 20  # 1 MiB chunks


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def settled_rss() -> int:
    gc.collect()
    return rss_bytes()


def make_keys(n: int, seed: int, mean_chunks: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ino, chunk) arrays of length n, file by file, plus each file's (ino, length)."""
    rng = np.random.default_rng(seed)
    # lognormal file lengths in chunks, median ~mean/2.7; enough files to cover n entries
    sigma = 1.4
    mu = np.log(mean_chunks) - sigma**2 / 2
    lens: list[np.ndarray] = []
    total = 0
    while total < n:
        part = np.maximum(1, rng.lognormal(mu, sigma, size=max(1024, n // int(mean_chunks))))
        part = part.astype(np.int64)
        lens.append(part)
        total += int(part.sum())
    flen = np.concatenate(lens)
    flen = flen[: int(np.searchsorted(np.cumsum(flen), n)) + 1]
    flen[-1] -= int(flen.sum()) - n  # trim the last file so the total is exactly n
    flen = flen[flen > 0]
    # inode numbers grow with small gaps, as a namespace allocating inodes would
    inos = 2 + np.cumsum(rng.integers(1, 4, size=flen.size, dtype=np.uint64), dtype=np.uint64)
    ino = np.repeat(inos, flen)
    starts = np.repeat(np.cumsum(flen) - flen, flen)
    chunk = (np.arange(n, dtype=np.int64) - starts).astype(np.uint64)
    files = np.stack([inos, flen.astype(np.uint64)], axis=1)
    return ino, chunk, files


def loc_batch(start: int, stop: int, seed: int) -> list[tuple]:
    """Location tuples for entries [start, stop); deterministic, so both builds get equal
    content without holding all tuples in memory at once."""
    rng = np.random.default_rng([seed, start])
    m = stop - start
    dram = np.where(rng.random(m) < 0.3, rng.integers(0, 1 << 20, size=m), -1)
    seg = rng.integers(1, 5000, size=m, dtype=np.uint32)
    off = rng.integers(0, 1 << 18, size=m, dtype=np.uint64) * 4096
    raw = np.full(m, CHUNK, dtype=np.uint32)
    stored = rng.integers(CHUNK // 2, CHUNK + 1, size=m, dtype=np.uint32)
    rec = (stored + 64 + 4095) // 4096 * 4096
    codec = rng.integers(0, 3, size=m, dtype=np.uint8)
    flags = rng.integers(0, 4, size=m, dtype=np.uint8)
    csum = rng.integers(0, np.iinfo(np.uint64).max, size=m, dtype=np.uint64, endpoint=True)
    seq = np.arange(start + 1, stop + 1, dtype=np.uint64)
    cols = [dram, seg, off, rec, raw, stored, codec, flags, csum, seq]
    return list(zip(*(c.tolist() for c in cols), strict=True))


def build(
    obj: ChunkIndex | dict, ino: np.ndarray, chunk: np.ndarray, seed: int
) -> tuple[float, int]:
    """Fills obj; returns (seconds spent inserting, RSS growth in bytes)."""
    n = ino.size
    rss0 = settled_rss()
    elapsed = 0.0
    for a in range(0, n, BATCH):
        b = min(n, a + BATCH)
        inos, chunks, locs = ino[a:b].tolist(), chunk[a:b].tolist(), loc_batch(a, b, seed)
        t0 = time.perf_counter()
        if isinstance(obj, ChunkIndex):
            put = obj.set
            for i, c, v in zip(inos, chunks, locs, strict=True):
                put(i, c, v)
        else:
            for i, c, v in zip(inos, chunks, locs, strict=True):
                obj[i, c] = v
        elapsed += time.perf_counter() - t0
        del inos, chunks, locs
    return elapsed, settled_rss() - rss0


def time_lookups(get: Callable, inos: list[int], chunks: list[int], as_key: bool) -> float:
    t0 = time.perf_counter()
    if as_key:
        for i, c in zip(inos, chunks, strict=True):
            get((i, c))
    else:
        for i, c in zip(inos, chunks, strict=True):
            get(i, c)
    return time.perf_counter() - t0


def time_loop(inos: list[int], chunks: list[int]) -> float:
    t0 = time.perf_counter()
    for _i, _c in zip(inos, chunks, strict=True):
        pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=10_000_000, help="chunks to index")
    ap.add_argument("--lookups", type=int, default=2_000_000, help="lookups per kind")
    ap.add_argument("--mean-chunks", type=float, default=64.0, help="mean chunks per file")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print results as JSON only")
    args = ap.parse_args(argv)
    n = args.entries
    if n < 1 or args.lookups < 1:
        ap.error("--entries and --lookups must be >= 1")
    say: Callable[..., None] = (lambda *a: None) if args.json else print
    command = " ".join(["python", *sys.argv]) if argv is None else " ".join(argv)

    say(f"generating {n:,} keys ...")
    ino, chunk, files = make_keys(n, args.seed, args.mean_chunks)
    rng = np.random.default_rng(args.seed + 1)
    hit_rows = rng.integers(0, n, size=args.lookups)
    hit_i, hit_c = ino[hit_rows].tolist(), chunk[hit_rows].tolist()
    # misses: existing files, chunks just past their end (reading a hole / EOF)
    mf = files[rng.integers(0, len(files), size=args.lookups)]
    miss_i = mf[:, 0].tolist()
    miss_c = (mf[:, 1] + rng.integers(0, 64, size=args.lookups, dtype=np.uint64)).tolist()
    del hit_rows, mf

    say("building ChunkIndex ...")
    idx = ChunkIndex()
    t_build_k, rss_k = build(idx, ino, chunk, args.seed)
    say("building dict ...")
    d: dict[tuple[int, int], tuple] = {}
    t_build_d, rss_d = build(d, ino, chunk, args.seed)
    assert len(idx) == len(d) == n

    # same answers on a sample of both lookup sequences (untimed)
    sample_i, sample_c = hit_i[:20_000] + miss_i[:20_000], hit_c[:20_000] + miss_c[:20_000]
    for i, c in zip(sample_i, sample_c, strict=True):
        assert idx.get(i, c) == d.get((i, c)), (i, c)

    say("timing lookups ...")
    t_loop = min(time_loop(hit_i, hit_c) for _ in range(2))
    t_hit_k = min(time_lookups(idx.get, hit_i, hit_c, False) for _ in range(2))
    t_hit_d = min(time_lookups(d.get, hit_i, hit_c, True) for _ in range(2))
    t_miss_k = min(time_lookups(idx.get, miss_i, miss_c, False) for _ in range(2))
    t_miss_d = min(time_lookups(d.get, miss_i, miss_c, True) for _ in range(2))

    # truncate/unlink of a 1 TiB sparse file: list present chunks below 2**20
    big = int(files[len(files) // 2, 0])
    upto = (1 << 40) // CHUNK
    reps = 3
    t0 = time.perf_counter()
    for _ in range(reps):
        got_k = idx.chunks_of(big, upto)
    t_trunc_k = (time.perf_counter() - t0) / reps
    t0 = time.perf_counter()
    got_d = [c for c in range(upto) if (big, c) in d]
    t_trunc_d = time.perf_counter() - t0
    assert got_k == got_d

    mem_k = idx.memory_bytes()
    L = args.lookups
    res = {
        "command": command,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "entries": n,
        "files": len(files),
        "lookups": L,
        "kvfs": {
            "build_per_s": n / t_build_k,
            "hit_lookup_per_s": L / t_hit_k,
            "miss_lookup_per_s": L / t_miss_k,
            "bytes_per_entry_tables": mem_k / n,
            "bytes_per_entry_rss": rss_k / n,
            "chunks_of_1tib_ms": t_trunc_k * 1e3,
        },
        "dict": {
            "build_per_s": n / t_build_d,
            "hit_lookup_per_s": L / t_hit_d,
            "miss_lookup_per_s": L / t_miss_d,
            "bytes_per_entry_rss": rss_d / n,
            "chunks_of_1tib_ms": t_trunc_d * 1e3,
        },
        "loop_overhead_ns": t_loop / L * 1e9,
    }
    if args.json:
        print(json.dumps(res, indent=2))
        return 0

    k, dd = res["kvfs"], res["dict"]
    rows = [
        ("build (inserts/s)", k["build_per_s"], dd["build_per_s"], "{:,.0f}"),
        ("lookup hit (lookups/s)", k["hit_lookup_per_s"], dd["hit_lookup_per_s"], "{:,.0f}"),
        ("lookup miss (lookups/s)", k["miss_lookup_per_s"], dd["miss_lookup_per_s"], "{:,.0f}"),
        ("bytes/entry (RSS growth)", k["bytes_per_entry_rss"], dd["bytes_per_entry_rss"], "{:.1f}"),
        ("bytes/entry (memory_bytes)", k["bytes_per_entry_tables"], None, "{:.1f}"),
        (f"chunks_of(ino, {upto}) ms", k["chunks_of_1tib_ms"], dd["chunks_of_1tib_ms"], "{:.2f}"),
    ]
    print()
    print(f"command: {command}")
    print(
        f"entries {n:,} in {len(files):,} files, {L:,} lookups of each kind, "
        f"Python {res['python']}, {res['cpus']} CPUs"
    )
    print(f"{'metric':<30}{'kvfs ChunkIndex':>18}{'dict':>18}{'kvfs/dict':>11}")
    print("-" * 77)
    for name, kv, dv, fmt in rows:
        ds = fmt.format(dv) if dv is not None else "-"
        ratio = f"{kv / dv:.3g}" if dv else "-"
        print(f"{name:<30}{fmt.format(kv):>18}{ds:>18}{ratio:>11}")
    print("-" * 77)
    print(
        f"Python loop overhead alone: {res['loop_overhead_ns']:.0f} ns per lookup "
        "(included in both lookup rates)."
    )
    print("dict build includes making the (ino, chunk) key tuple; dict chunks_of = probe loop.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
