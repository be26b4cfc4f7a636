#!/usr/bin/env python3
"""Benchmark the kvfs chunk codec against ZipNN and plain zstd-1 on real KV-cache data.

Data: /work/shared/data/kv/smollm2_kv_{fp16,bf16}.npy, shape [30 layers, 2 (K, V), 1024 tokens,
3 heads, 64 dims]. The arrays are cut, in their native order (token-major within each layer's K and
V), into blocks of 256 KiB and 2 MiB, the last block of each size being shorter. Plus random bytes
(incompressible) and zeros.

Every contender runs single-threaded on one pinned CPU; each rep times all blocks of a data set,
contenders interleaved within a rep so that machine noise hits them alike; the table shows the best
rep (--reps), timed in CPU time of the process (on a shared machine this leaves out the time another
process holds our CPU). Ratio = total raw bytes / total stored bytes (kvfs counts the raw fallback
as stored raw); throughput = raw bytes / time, for both compression and decompression. Every
contender's output is checked to round-trip.

kvfs picks its codec as the chunk store does, with Codec.choose(first 64 KiB of the first block,
hint=None) (auto-detection; the chosen codec and the time choose() took are shown). ZipNN 0.5.4 is
told the dtype: ZipNN(input_format='byte', bytearray_dtype='float16'/'bfloat16', threads=1). It is
fed a fresh copy of each block every rep (not timed) because for bf16 it rewrites its input buffer
in place (its sign-bit reordering), even an immutable bytes object, which would otherwise corrupt
the data for every later contender and rep.

Creating the kvfs Codec sets glibc's malloc thresholds for the whole process (as it does in the
daemon: CodecPolicy.keep_freed_memory), so freed chunk-sized buffers are reused instead of being
page-faulted in anew; every contender, ZipNN included, runs with that setting.

kvfs runs as the daemon builds its codec (kvfs/assemble.py: CodecPolicy(verify=False), since the
chunk store checks the xxh3 of every chunk's raw bytes after decoding); the kvfs+check row, on KV
data, has the codec's own payload checksum on as well (--verify judges that setting instead).

    python tools/bench_codec.py [--reps 7] [--json] [--cpu N] [--verify] [--no-zipnn]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfs.store.codec import CODEC_HUF2, CODEC_NAMES, CODEC_RAW, Codec, CodecPolicy  # noqa: E402

KIB = 1024
MIB = 1024 * KIB


@dataclass
class Row:
    data: str
    block: str
    contender: str
    detail: str
    ratio: float
    comp_gbps: float
    decomp_gbps: float


def blocks_of(buf: bytes, size: int) -> list[bytes]:
    return [buf[i : i + size] for i in range(0, len(buf), size)]


def timed(fn: Callable[[], object], results: list[float]) -> None:
    # CPU time of the (pinned, single-CPU) process: on a shared, noisy machine this counts only
    # the cycles we got, not the time another process held our CPU
    t = time.process_time()
    fn()
    results.append(time.process_time() - t)


class Contender:
    name = ""
    detail = ""

    def prepare(self, blocks: list[bytes]) -> None: ...
    def compress_all(self) -> list: ...
    def decompress_all(self, stored: list) -> list: ...
    def stored_size(self, stored: list) -> int: ...


class Kvfs(Contender):
    name = "kvfs"

    def __init__(self, policy: CodecPolicy, forced: int | None = None, name: str = "kvfs") -> None:
        self.codec = Codec(policy)
        self.forced = forced
        self.name = "kvfs-forced" if forced is not None else name

    def prepare(self, blocks: list[bytes]) -> None:
        self.blocks = blocks
        if self.forced is None:
            # what the chunk store does once per file: choose from (64 KiB of) the first chunk
            sample = memoryview(blocks[0])[: 64 * KIB]
            times: list[float] = []
            for _ in range(20):
                timed(lambda: self.codec.choose(sample, None), times)
            self.choose_us = min(times) * 1e6
            self.cid = self.codec.choose(sample, None)
            self.detail = f"auto: {CODEC_NAMES[self.cid]} (choose {self.choose_us:.0f} us)"
        else:
            self.cid = self.forced
            self.detail = f"forced: {CODEC_NAMES[self.cid]}"

    def compress_all(self) -> list:
        enc = self.codec.encode
        return [enc(b, self.cid) for b in self.blocks]

    def decompress_all(self, stored: list) -> list:
        dec = self.codec.decode
        return [dec(c, p, len(b)) for (c, p), b in zip(stored, self.blocks, strict=True)]

    def stored_size(self, stored: list) -> int:
        n_raw = sum(1 for c, _ in stored if c == CODEC_RAW)
        if n_raw:
            self.detail += f", {n_raw}/{len(stored)} blocks raw"
        return sum(len(p) for _, p in stored)


class Zstd1(Contender):
    name = "zstd-1"

    def prepare(self, blocks: list[bytes]) -> None:
        self.blocks = blocks
        self.c = zstandard.ZstdCompressor(level=1)
        self.d = zstandard.ZstdDecompressor()

    def compress_all(self) -> list:
        return [self.c.compress(b) for b in self.blocks]

    def decompress_all(self, stored: list) -> list:
        return [self.d.decompress(p) for p in stored]

    def stored_size(self, stored: list) -> int:
        return sum(map(len, stored))


class ZipNNC(Contender):
    name = "zipnn"

    def __init__(self, dtype: str) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from zipnn import ZipNN
        self.z = ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
        self.detail = f"{dtype}, threads=1"

    def prepare(self, blocks: list[bytes]) -> None:
        self.blocks = blocks
        self.fresh: list[bytearray] = []

    def refill(self) -> None:
        # not timed: ZipNN reorders bf16 bits in place in the buffer it is given
        self.fresh = [bytearray(b) for b in self.blocks]

    def compress_all(self) -> list:
        return [self.z.compress(b) for b in self.fresh]

    def decompress_all(self, stored: list) -> list:
        return [self.z.decompress(p) for p in stored]

    def stored_size(self, stored: list) -> int:
        return sum(map(len, stored))


def memcpy_gbps(blocks: list[bytes], reps: int) -> float:
    dst = bytearray(max(map(len, blocks)))
    mv = memoryview(dst)
    times: list[float] = []
    total = sum(map(len, blocks))

    def run() -> None:
        for b in blocks:
            mv[: len(b)] = b

    for _ in range(reps):
        timed(run, times)
    return total / min(times) / 1e9


def bench(data: str, blocks: list[bytes], block: str, contenders: list[Contender], reps: int):
    total = sum(map(len, blocks))
    ctimes: dict[str, list[float]] = {c.name: [] for c in contenders}
    dtimes: dict[str, list[float]] = {c.name: [] for c in contenders}
    stored: dict[str, list] = {}
    for c in contenders:
        c.prepare(blocks)
    for _ in range(reps):
        for c in contenders:
            if isinstance(c, ZipNNC):
                c.refill()
            out: list = []
            timed(lambda c=c, out=out: out.extend(c.compress_all()), ctimes[c.name])
            stored[c.name] = out
            timed(lambda c=c, s=out: c.decompress_all(s), dtimes[c.name])
    rows = []
    for c in contenders:
        back = c.decompress_all(stored[c.name])
        if any(bytes(x) != b for x, b in zip(back, blocks, strict=True)):
            raise SystemExit(f"{c.name} failed to round-trip {data}/{block}")
        size = c.stored_size(stored[c.name])
        rows.append(
            Row(
                data=data,
                block=block,
                contender=c.name,
                detail=c.detail,
                ratio=total / size,
                comp_gbps=total / min(ctimes[c.name]) / 1e9,
                decomp_gbps=total / min(dtimes[c.name]) / 1e9,
            )
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shared = Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"
    ap.add_argument("--data-dir", default=str(shared))
    ap.add_argument("--reps", type=int, default=7, help="timed reps per data set; best is shown")
    ap.add_argument("--cpu", type=int, default=None, help="CPU to pin to (default: the last one)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--no-zipnn", action="store_true")
    ap.add_argument(
        "--verify",
        action="store_true",
        help="judge kvfs with CodecPolicy(verify=True), its own payload checksum checked on every "
        "decode (the daemon runs verify=False: the chunk store checks each chunk's xxh3 of the raw "
        "bytes itself); the kvfs+check row shows that setting in every run",
    )
    args = ap.parse_args()

    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])

    # as the daemon builds it (kvfs/assemble.py); kvfs+check adds the payload check
    policy = CodecPolicy(verify=args.verify)
    checked = CodecPolicy(verify=True)
    d = Path(args.data_dir)
    datasets: list[tuple[str, bytes, str]] = [
        ("fp16", np.load(d / "smollm2_kv_fp16.npy").tobytes(), "float16"),
        ("bf16", np.load(d / "smollm2_kv_bf16.npy").tobytes(), "bfloat16"),
        ("random", np.random.default_rng(42).bytes(16 * MIB), "float16"),
        ("zeros", bytes(16 * MIB), "float16"),
    ]
    rows: list[Row] = []
    memcpy: dict[str, float] = {}
    for name, buf, zdtype in datasets:
        for bsize, blabel in ((256 * KIB, "256K"), (2 * MIB, "2M")):
            blocks = blocks_of(buf, bsize)
            contenders: list[Contender] = [Kvfs(policy)]
            if name in ("fp16", "bf16") and not args.verify:
                contenders.append(Kvfs(checked, name="kvfs+check"))
            if not args.no_zipnn:
                contenders.append(ZipNNC(zdtype))
            contenders.append(Zstd1())
            if name == "random":
                # a chunk that does not compress inside a file whose codec is huf2
                contenders.append(Kvfs(policy, forced=CODEC_HUF2))
                memcpy[blabel] = memcpy_gbps(blocks, args.reps)
            rows += bench(name, blocks, blabel, contenders, args.reps)

    summary = []
    if not args.no_zipnn:
        for name in ("fp16", "bf16"):
            for blabel in ("256K", "2M"):
                k = next(
                    r for r in rows if (r.data, r.block, r.contender) == (name, blabel, "kvfs")
                )
                z = next(
                    r for r in rows if (r.data, r.block, r.contender) == (name, blabel, "zipnn")
                )
                need_ratio = 1.0 if name == "fp16" else 0.99
                s = {
                    "data": name,
                    "block": blabel,
                    "ratio_x": k.ratio / z.ratio,
                    "comp_x": k.comp_gbps / z.comp_gbps,
                    "decomp_x": k.decomp_gbps / z.decomp_gbps,
                }
                kc = [r for r in rows if (r.data, r.block, r.contender)
                      == (name, blabel, "kvfs+check")]
                if kc:
                    s["decomp_checked_x"] = kc[0].decomp_gbps / z.decomp_gbps
                s["pass"] = (
                    s["ratio_x"] >= need_ratio and s["comp_x"] >= 1.2 and s["decomp_x"] >= 1.0
                )
                summary.append(s)

    if args.json:
        out = {
            "command": cmd,
            "cpu": cpu,
            "reps": args.reps,
            "kvfs_policy": asdict(policy),
            "rows": [asdict(r) for r in rows],
            "memcpy_gbps": memcpy,
            "kvfs_vs_zipnn": summary,
        }
        print(json.dumps(out, indent=2))
        return

    print(f"$ {cmd}")
    print(
        f"single core (pinned to CPU {cpu}), best of {args.reps} reps (CPU time), GB/s of raw data;"
        f" kvfs {policy}\n"
    )
    hdr = (
        f"{'data':7} {'block':5} {'contender':12} {'ratio':>7} {'comp GB/s':>10}"
        f" {'decomp GB/s':>12}  detail"
    )
    print(hdr)
    print("-" * len(hdr))
    prev = None
    for r in rows:
        if prev is not None and (r.data, r.block) != prev:
            print()
        prev = (r.data, r.block)
        ratio = f"{r.ratio:7.4f}" if r.ratio < 100 else f"{r.ratio:7.0f}"
        print(
            f"{r.data:7} {r.block:5} {r.contender:12} {ratio} {r.comp_gbps:10.2f}"
            f" {r.decomp_gbps:12.2f}  {r.detail}"
        )
    print("\nrandom data (memcpy = copying each block into a preallocated buffer):")
    for blabel, g in memcpy.items():
        k = next(r for r in rows if (r.data, r.block, r.contender) == ("random", blabel, "kvfs"))
        f = next(
            r for r in rows if (r.data, r.block, r.contender) == ("random", blabel, "kvfs-forced")
        )
        print(
            f"  {blabel:4} memcpy {g:6.2f} GB/s | encode with the chosen codec (raw: returns the"
            f" input) {k.comp_gbps / g:5.0f}x memcpy | huf2 forced, falls back to raw:"
            f" {f.comp_gbps:5.2f} GB/s = {f.comp_gbps / g:.2f}x memcpy"
        )
    if summary:
        print(
            "\nkvfs / ZipNN   (goal: ratio >= 1.00x fp16, >= 0.99x bf16;"
            " comp >= 1.2x; decomp >= 1.0x)"
        )
        checked = "decomp_checked_x" in summary[0]
        print(f"{'data':7} {'block':5} {'ratio':>7} {'comp':>7} {'decomp':>7}"
              + (f" {'(+check)':>9}" if checked else ""))
        for s in summary:
            extra = f"  ({s['decomp_checked_x']:5.2f}x)" if checked else ""
            print(
                f"{s['data']:7} {s['block']:5} {s['ratio_x']:6.3f}x {s['comp_x']:6.2f}x"
                f" {s['decomp_x']:6.2f}x{extra}  {'PASS' if s['pass'] else 'FAIL'}"
            )
        if checked:
            print("(+check: decompression of kvfs+check, the codec's own payload checksum on; "
                  "the daemon leaves it off and checks every chunk's raw-data xxh3 instead)")


if __name__ == "__main__":
    main()
