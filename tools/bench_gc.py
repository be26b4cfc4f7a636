#!/usr/bin/env python3
"""Issue 5 benchmark: NVMe write amplification of a KV-block churn, streams on and off.

A churn of KV block files with mixed lifetimes runs against a fresh kvfs whose DRAM tier is
small next to its NVMe tier (so blocks really reach NVMe before they die), at a steady NVMe
utilisation of 50% and of 90% of the capacity statvfs reports, once per configuration:

    off     streams=1: one log for everything (user records and GC copies)
    two     streams=2: user records and GC copies apart (the layout before issue 5)
    on      streams=4, no hints: kvfs learns lifetimes per directory
    hints   streams=4, `user.kvfs.lifetime` = short on req/, long on prefix/

Workload (all blocks BLOCK bytes, content checked at the end):
    request   writes 1-7 private blocks in req/, uses one shared prefix (Zipf-like
              popularity); it ends after about WINDOW requests (uniform 0.5-1.5x) and its
              blocks are deleted - the way an engine frees a finished request's blocks.
    prefix    with probability P_PREFIX a request also creates a new shared prefix of 4-16
              blocks in prefix/; prefixes are evicted least-recently-used when they exceed
              their byte budget, so popular prefixes live for many tier overwrites and
              unpopular ones die roughly in creation order. The budget is steered so that
              statvfs shows the target utilisation (used / capacity, record headers included).
The window of live requests is about 12% of the capacity; prefixes are about 20% of the bytes
written. Warm-up: the first prefixes are written until the utilisation target minus the
requests' window is reached (the system prompts exist), then the workload runs until one
tier's worth has been written; then the counters are read and the measured window runs until
OVERWRITES x nvme_size more user bytes have reached NVMe.

Write amplification = (user record bytes + GC record bytes) / user record bytes, over the
measured window, from `user.kvfs.status` (gc.* and streams.*).

Read latency (one configuration, by default `on` at 90%): after the churn, whole-block reads
of random prefix blocks are timed (open, read, close) in a thread while the status is polled
at 20 Hz: (a) with no writes and no cleaning ("idle"), then (b) while the cleaner drains the
garbage left by deleting every other block of every prefix (it cleans in idle mode: writes
have stopped; reads do not stop it but go first), in up to 4 rounds until as many reads as
in (a) fell into intervals in which the cleaner moved records. p99 (b) / p99 (a) is the
figure; the p99 of reads made during the churn itself is reported too.

    python tools/bench_gc.py [--nvme-size 256M] [--segment-size 1M] [--dram-size 8M]
        [--chunk-size 64K] [--block 256K] [--utils 50,90] [--configs off,two,on,hints]
        [--overwrites 4] [--window 0.12] [--prefix-share 0.2] [--latency on@90]
        [--latency-reads 400] [--seed 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import heapq
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfs.store.codec import Codec, CodecPolicy  # noqa: E402
from kvfs.store.dram import remove_dram_dir  # noqa: E402
from kvfs.store.nvme import record_length  # noqa: E402
from tools.gcfloor import simulate  # noqa: E402

KVFS = [sys.executable, "-m", "kvfs"]
MIB = 1 << 20
CONFIGS = {"off": {"streams": 1}, "two": {"streams": 2}, "on": {"streams": 4},
           "hints": {"streams": 4}}
GOAL_WA = 1.05
GOAL_RATIO = 0.5
GOAL_P99 = 1.5  # issue 37 (issue 5 asked for 2)
SHORT_WINDOW = 0.12  # live per-request blocks, share of capacity
PREFIX_SHARE = 0.20  # share of written bytes that are new shared prefixes
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    return int(float(t[:-1]) * _UNITS[t[-1]]) if t[-1] in _UNITS else int(t)


def status(mnt: Path) -> dict:
    return json.loads(os.getxattr(mnt, "user.kvfs.status"))


class Mount:
    def __init__(self, work: Path, options: dict) -> None:
        tag = uuid.uuid4().hex[:10]
        self.base = work / f"kvfs-{tag}"
        self.mnt = self.base / "mnt"
        self.nvme = self.base / "nvme"
        self.dram = Path("/dev/shm") / f"kvfs-bgc-{tag}"
        self.mnt.mkdir(parents=True)
        self.options = options

    def __enter__(self) -> Mount:
        o = ",".join(f"{k}={v}" for k, v in self.options.items())
        r = subprocess.run(KVFS + ["mount", str(self.mnt), "--dram-dir", str(self.dram),
                                   "--nvme-dir", str(self.nvme), "--log-file",
                                   str(self.base / "kvfs.log"), "-o", o],
                           capture_output=True, text=True, timeout=60, cwd=REPO)
        if r.returncode:
            raise RuntimeError(f"mount failed: {r.stderr}")
        return self

    def __exit__(self, *exc) -> None:
        r = subprocess.run(KVFS + ["umount", str(self.mnt)], capture_output=True, text=True,
                           timeout=300, cwd=REPO)
        if r.returncode:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        remove_dram_dir(str(self.dram))
        shutil.rmtree(self.base, ignore_errors=True)


class Blocks:
    """Block files with checkable contents, and the trace of their writes and deletes
    (tools/gcfloor.py replays it)."""

    def __init__(self, mnt: Path, block: int, seed: int, compressible: bool = False) -> None:
        self.mnt = mnt
        self.block = block
        self.rng = random.Random(seed)
        self.pool = [block_bytes(random.Random(seed * 1000 + i), block, compressible)
                     for i in range(32)]
        self.recs: list[int] = []  # record lengths of one block file on NVMe (set_records)
        self.trace: list[tuple] = []
        self.expected: dict[Path, int] = {}
        self.next_id = 0
        self.files_written = 0
        self.bytes_written = 0

    def set_records(self, chunk: int, compress: bool) -> None:
        """What one block file takes on NVMe: its chunks' records, compressed as kvfs would."""
        codec = Codec(CodecPolicy(enabled=compress, verify=False))
        data = self.pool[0]
        kind = codec.choose(data[:chunk], None)
        self.recs = [record_length(len(codec.encode(data[o:o + chunk], kind)[1]))
                     for o in range(0, len(data), chunk)]

    def _write(self, path: Path) -> None:
        fid = self.next_id
        self.next_id += 1
        data = bytearray(self.pool[fid % len(self.pool)])
        data[:16] = fid.to_bytes(8, "little") + len(path.name).to_bytes(8, "little")
        with open(path, "wb") as f:
            f.write(data)
        self.expected[path] = fid
        self.trace.append(("w", fid, self.block, self.recs, path.parent.name))
        self.files_written += 1
        self.bytes_written += self.block

    def expected_bytes(self, path: Path) -> bytes:
        fid = self.expected[path]
        data = bytearray(self.pool[fid % len(self.pool)])
        data[:16] = fid.to_bytes(8, "little") + len(path.name).to_bytes(8, "little")
        return bytes(data)

    def _delete(self, path: Path) -> None:
        os.unlink(path)
        self.trace.append(("d", self.expected.pop(path)))


def block_bytes(rng: random.Random, n: int, compressible: bool) -> bytes:
    """Random bytes, or fp16-like ones: random low bytes, high bytes (sign and exponent)
    from eight values, which kvfs's codec stores in about 0.7 of the size."""
    if not compressible:
        return rng.randbytes(n)
    out = bytearray(n)
    out[0::2] = rng.randbytes(n // 2)
    out[1::2] = rng.randbytes(n // 2).translate(bytes(0x38 + (i & 7) for i in range(256)))
    return bytes(out)


class Churn(Blocks):
    """The KV-block workload: per-request blocks and LRU-managed shared prefixes."""

    def __init__(self, mnt: Path, capacity: int, util: float, block: int, seed: int,
                 window: float = SHORT_WINDOW, prefix_share: float = PREFIX_SHARE) -> None:
        super().__init__(mnt, block, seed)
        self.req_dir = mnt / "req"
        self.prefix_dir = mnt / "prefix"
        req_bytes = 4 * block  # mean blocks per request: 4
        prefix_bytes = 10 * block  # mean blocks per prefix: 10
        self.window = max(4, int(window * capacity / req_bytes))
        self.capacity = capacity
        self.util = util
        self.budget = util * capacity - self.window * req_bytes
        if self.budget < 4 * prefix_bytes:
            raise SystemExit(f"utilisation {util} leaves no room for prefixes")
        self.min_budget = 4 * prefix_bytes
        self.p_prefix = prefix_share * req_bytes / ((1 - prefix_share) * prefix_bytes)
        self.active: list = []  # heap of (end step, request step, [paths])
        self.prefixes: OrderedDict[int, tuple[list[Path], float]] = OrderedDict()
        self.prefix_bytes = 0
        self.step = 0
        self.next_prefix = 0

    def new_prefix(self) -> None:
        pid = self.next_prefix
        self.next_prefix += 1
        paths = []
        for b in range(self.rng.randint(4, 16)):
            p = self.prefix_dir / f"p{pid}-{b}"
            self._write(p)
            paths.append(p)
        popularity = self.rng.paretovariate(1.2)
        self.prefixes[pid] = (paths, popularity)
        self.prefix_bytes += len(paths) * self.block
        self.evict()

    def steer(self, used_share: float) -> None:
        """Move the prefix budget so that the utilisation tracks the target."""
        self.budget += 0.5 * (self.util - used_share) * self.capacity
        self.budget = max(self.min_budget, self.budget)
        self.evict()

    def evict(self) -> None:
        while self.prefix_bytes > self.budget and len(self.prefixes) > 1:
            _, (old, _) = self.prefixes.popitem(last=False)
            for p in old:
                self._delete(p)
            self.prefix_bytes -= len(old) * self.block

    def request(self) -> None:
        self.step += 1
        s = self.step
        while self.active and self.active[0][0] <= s:
            for p in heapq.heappop(self.active)[2]:
                self._delete(p)
        paths = []
        for b in range(self.rng.randint(1, 7)):
            p = self.req_dir / f"r{s}-{b}"
            self._write(p)
            paths.append(p)
        end = s + self.rng.randint(self.window // 2, self.window * 3 // 2)
        heapq.heappush(self.active, (end, s, paths))
        if self.prefixes:  # the request uses a shared prefix: LRU touch
            keys = list(self.prefixes)
            weights = [self.prefixes[k][1] for k in keys]
            self.prefixes.move_to_end(self.rng.choices(keys, weights)[0])
        if self.rng.random() < self.p_prefix:
            self.new_prefix()


class FifoChurn(Blocks):
    """The sweep's workload (issue 37): a set of prefix blocks in prefix/ that lives for the
    whole run, static or with a tenth of it rewritten (deleted, written anew under another
    name) every half tier of writes, beside a first-in-first-out window of per-request
    blocks in req/: each step writes one and deletes the oldest beyond the window. The
    prefixes are written during the warm-up, among the requests (prompts come with traffic),
    so that a log that does not tell them apart mixes them with request blocks."""

    def __init__(self, mnt: Path, block: int, seed: int, compressible: bool, n_prefix: int,
                 n_window: int, rewrite_every: int | None) -> None:
        super().__init__(mnt, block, seed, compressible)
        self.n_prefix = n_prefix
        self.n_window = n_window
        self.rewrite_every = rewrite_every
        self.prefix: list[Path] = []
        self.window: deque[Path] = deque()
        self.next_name = 0
        self.since_rewrite = 0
        self.since_prefix = 0.0

    def record_bytes(self) -> int:
        return self.files_written * sum(self.recs)

    def _new(self, directory: str) -> Path:
        self.next_name += 1
        p = self.mnt / directory / f"b{self.next_name}"
        self._write(p)
        return p

    def step(self, new_prefixes: float = 0.0) -> None:
        """One request; and *new_prefixes* prefix blocks on average, while there are fewer
        than n_prefix."""
        self.since_prefix += new_prefixes
        while self.since_prefix >= 1 and len(self.prefix) < self.n_prefix:
            self.since_prefix -= 1
            self.prefix.append(self._new("prefix"))
        self.window.append(self._new("req"))
        if len(self.window) > self.n_window:
            self._delete(self.window.popleft())
        if self.rewrite_every is None:
            return
        self.since_rewrite += sum(self.recs)
        if self.since_rewrite >= self.rewrite_every:
            self.since_rewrite = 0
            for i in self.rng.sample(range(len(self.prefix)), max(1, len(self.prefix) // 10)):
                self._delete(self.prefix[i])
                self.prefix[i] = self._new("prefix")


SWEEP_CONFIGS = {"default": {"streams": 4}, "hinted": {"streams": 4}, "one": {"streams": 1}}


def sweep_options(a: argparse.Namespace, cfg: str) -> dict:
    return {"dram_size": a.dram_size, "nvme_size": a.nvme_size, "chunk_size": a.chunk_size,
            "segment_size": a.segment_size, "compress": "true", **SWEEP_CONFIGS[cfg]}


def run_cell(work: Path, cell: dict, cfg: str, a: argparse.Namespace) -> dict:
    """One configuration on one cell of the sweep: kvfs's WAF over the measured window, and
    the trace (the same for every configuration of the cell: nothing in it depends on kvfs)."""
    nvme_size = parse_size(a.nvme_size)
    with Mount(work, sweep_options(a, cfg)) as m:
        (m.mnt / "req").mkdir()
        (m.mnt / "prefix").mkdir()
        if cfg == "hinted":
            os.setxattr(m.mnt / "req", "user.kvfs.lifetime", b"short")
            os.setxattr(m.mnt / "prefix", "user.kvfs.lifetime", b"long")
        w = FifoChurn(m.mnt, parse_size(a.block), a.seed, cell["compressible"],
                      cell["n_prefix"], cell["n_window"],
                      nvme_size // 2 if cell["rewritten"] else None)
        w.set_records(parse_size(a.chunk_size), compress=True)
        try:
            return _run_cell(m, w, cfg, a)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            sv = os.statvfs(m.mnt)
            return {"config": cfg, "wa": None,
                    "error": f"ENOSPC after {w.record_bytes() / MIB:.0f} MiB of records, "
                             f"{1 - sv.f_bavail / sv.f_blocks:.3f} of the capacity used"}


def _run_cell(m: Mount, w: FifoChurn, cfg: str, a: argparse.Namespace) -> dict:
    nvme_size = parse_size(a.nvme_size)
    t0 = time.monotonic()
    steps = a.warmup * nvme_size / sum(w.recs)
    while w.record_bytes() < a.warmup * nvme_size or len(w.prefix) < w.n_prefix:
        w.step(1.25 * w.n_prefix / steps)  # all prefixes by 80% of it
    st0 = status(m.mnt)
    w.trace.append(("mark", "start"))
    base = w.record_bytes()
    used = []
    while w.record_bytes() - base < a.overwrites * nvme_size:
        for _ in range(16):
            w.step()
        sv = os.statvfs(m.mnt)
        used.append(1 - sv.f_bavail / sv.f_blocks)
    st1 = status(m.mnt)
    w.trace.append(("mark", "end"))
    du = st1["gc"]["user_bytes_written"] - st0["gc"]["user_bytes_written"]
    dg = st1["gc"]["gc_bytes_written"] - st0["gc"]["gc_bytes_written"]
    verified = _verify(w)
    return {"config": cfg, "wa": _wa(du, dg), "user_mib": round(du / MIB, 1),
            "util_mean": round(statistics.mean(used), 3), "verified_files": verified,
            "seconds": round(time.monotonic() - t0, 1), "trace": w.trace,
            "placement": st1.get("placement", {}).get("decisions"),
            "victims": st1["gc"]["victims"], "passes": st1["gc"]["passes"],
            "streams": {k: {"user_mib": round(v["user_bytes_written"] / MIB, 1),
                            "gc_out_mib": round(v["gc_bytes_copied_out"] / MIB, 1)}
                        for k, v in st1["streams"].items()}}


def sweep(work: Path, a: argparse.Namespace) -> list[dict]:
    """Every cell of the grid: kvfs default, hinted, one stream; the floor and the model's
    one-stream log from the cell's trace."""
    with Mount(work, sweep_options(a, "default")) as m:
        sv = os.statvfs(m.mnt)
        capacity = sv.f_blocks * sv.f_frsize
    nvme_size = parse_size(a.nvme_size)
    rows = []
    for data in a.sweep_data.split(","):
        probe = Blocks(Path("."), parse_size(a.block), a.seed, data == "compressible")
        probe.set_records(parse_size(a.chunk_size), compress=True)
        per_file = sum(probe.recs)
        for live in (int(x) / 100 for x in a.sweep_live.split(",")):
            for window in (int(x) / 100 for x in a.sweep_windows.split(",")):
                for prefixes in a.sweep_prefixes.split(","):
                    n_window = max(1, round(window * nvme_size / per_file))
                    n_prefix = int(live * capacity / per_file) - n_window
                    cell = {"data": data, "live": live, "window": window,
                            "prefixes": prefixes, "rewritten": prefixes == "rewritten",
                            "compressible": data == "compressible",
                            "n_window": n_window, "n_prefix": n_prefix,
                            "record_bytes_per_file": per_file, "capacity_bytes": capacity}
                    if n_prefix < 10:
                        cell["skipped"] = "the window alone is more than the live data"
                        rows.append(cell)
                        continue
                    trace = None
                    for cfg in a.sweep_configs.split(","):
                        print(f"... {data} live {live:.0%} window {window:.0%} {prefixes}: "
                              f"{cfg}", flush=True)
                        r = run_cell(work, cell, cfg, a)
                        trace = r.pop("trace") if "error" not in r else trace
                        cell[cfg] = r
                    if trace is not None:
                        cell.update(_models(trace, a))
                    rows.append(cell)
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def sweep_report(rows: list[dict], a: argparse.Namespace) -> list[dict]:
    print(f"\nkvfs placement sweep (issue 37): nvme {a.nvme_size}, segments {a.segment_size}, "
          f"dram {a.dram_size}, chunk {a.chunk_size}, block {a.block}; live = share of the "
          f"capacity statvfs reports, window = share of the tier; {a.overwrites} tier "
          f"overwrites measured after {a.warmup} of warm-up; WAF (floor: offline, perfect "
          f"death times; modelcl: the same model knowing only each file's directory, as a "
          f"perfect hint would; model1: the same model as one log, a check against `one`)")
    cfgs = a.sweep_configs.split(",")
    print(f"{'data':14} {'live':>4} {'window':>6} {'prefixes':9} " +
          " ".join(f"{c:>8}" for c in cfgs) + f" {'floor':>7} {'modelcl':>7} {'model1':>7}  "
          "goals missed")
    checks = []
    for c in rows:
        head = (f"{c['data']:14} {c['live']:>4.0%} {c['window']:>6.0%} {c['prefixes']:9} ")
        if "skipped" in c:
            print(head + "  (skipped: " + c["skipped"] + ")")
            continue
        wa = {k: c[k]["wa"] for k in cfgs if k in c}
        floor = c.get("floor")
        missed = []

        def goal(name: str, ok: bool | None, c=c, missed=missed) -> None:
            checks.append({"cell": f"{c['data']} live {c['live']:.0%} window "
                                   f"{c['window']:.0%} {c['prefixes']}",
                           "goal": name, "pass": bool(ok)})
            if not ok:
                missed.append(name)

        for k in cfgs:
            if "error" in c.get(k, {}):
                goal(f"{k} ENOSPC", False)  # below the capacity statvfs reported
        d, h, o = wa.get("default"), wa.get("hinted"), wa.get("one")
        if not c["rewritten"]:
            for k in ("default", "hinted"):
                if wa.get(k) is not None:
                    goal(f"{k}<=1.05", wa[k] <= 1.05)
        if floor and d is not None:
            goal("default<=1.15xfloor", d <= 1.15 * floor)
        if floor and h is not None:
            goal("hinted<=1.05xfloor", h <= 1.05 * floor)
        for k in ("default", "hinted"):
            if wa.get(k) is not None and o is not None:
                goal(f"{k}<=one", wa[k] <= o)
        if d is not None and h is not None:
            goal("hinted<=default", h <= d)
        print(head + " ".join(f"{wa[k]:>8.3f}" if wa.get(k) is not None else
                              f"{'ENOSPC' if 'error' in c.get(k, {}) else '-':>8}"
                              for k in cfgs) +
              f" {_fmt(floor):>7} {_fmt(c.get('model_classes')):>7} "
              f"{_fmt(c.get('model_one')):>7}  "
              + (", ".join(missed) or "-"))
    n_pass = sum(ch["pass"] for ch in checks)
    print(f"\ngoals met: {n_pass} of {len(checks)}")
    return checks


def _wa(d_user: int, d_gc: int) -> float | None:
    return round((d_user + d_gc) / d_user, 4) if d_user else None


def run_config(work: Path, name: str, util: float, a: argparse.Namespace,
               latency: bool) -> dict:
    opts = {"dram_size": a.dram_size, "nvme_size": a.nvme_size, "chunk_size": a.chunk_size,
            "segment_size": a.segment_size, "compress": "false", **CONFIGS[name]}
    nvme_size = parse_size(a.nvme_size)
    out: dict = {"config": name, "util_target": util, "options": opts}
    with Mount(work, opts) as m:
        (m.mnt / "req").mkdir()
        (m.mnt / "prefix").mkdir()
        if name == "hints":
            os.setxattr(m.mnt / "req", "user.kvfs.lifetime", b"short")
            os.setxattr(m.mnt / "prefix", "user.kvfs.lifetime", b"long")
        sv = os.statvfs(m.mnt)
        capacity = sv.f_blocks * sv.f_frsize
        w = Churn(m.mnt, capacity, util, parse_size(a.block), a.seed, a.window, a.prefix_share)
        w.set_records(parse_size(a.chunk_size), compress=False)
        t0 = time.monotonic()
        while True:  # warm-up 1: the shared prefixes exist
            sv = os.statvfs(m.mnt)
            if 1 - sv.f_bavail / sv.f_blocks >= util - a.window:
                break
            w.new_prefix()
        w.budget = w.prefix_bytes
        while status(m.mnt)["gc"]["user_bytes_written"] < a.warmup * nvme_size:
            for _ in range(20):
                w.request()
            sv = os.statvfs(m.mnt)
            w.steer(1 - sv.f_bavail / sv.f_blocks)
        st0 = status(m.mnt)
        w.trace.append(("mark", "start"))
        t1 = time.monotonic()
        utils = []
        target = st0["gc"]["user_bytes_written"] + a.overwrites * nvme_size
        lat_churn: list[float] = []
        while True:
            for i in range(20):
                w.request()
                if i % 5 == 0 and w.prefixes and latency:
                    lat_churn.append(_read_one(w))
            st = status(m.mnt)
            sv = os.statvfs(m.mnt)
            utils.append(1 - sv.f_bavail / sv.f_blocks)
            w.steer(utils[-1])
            if st["gc"]["user_bytes_written"] >= target:
                break
        t2 = time.monotonic()
        st1 = status(m.mnt)
        w.trace.append(("mark", "end"))
        g0, g1 = st0["gc"], st1["gc"]
        du = g1["user_bytes_written"] - g0["user_bytes_written"]
        dg = g1["gc_bytes_written"] - g0["gc_bytes_written"]
        streams = {}
        for sname, s1 in st1["streams"].items():
            s0 = st0["streams"].get(sname, {})
            su = s1["user_bytes_written"] - s0.get("user_bytes_written", 0)
            sgo = s1["gc_bytes_copied_out"] - s0.get("gc_bytes_copied_out", 0)
            sgi = s1["gc_bytes_written"] - s0.get("gc_bytes_written", 0)
            streams[sname] = {"user_mib": round(su / MIB, 1), "gc_in_mib": round(sgi / MIB, 1),
                              "gc_out_mib": round(sgo / MIB, 1), "wa": _wa(su, sgo),
                              "segments": s1["segments"], "hint": s1["write_hint"],
                              "hint_accepted": s1["hint_accepted"]}
        out.update({
            "capacity_bytes": capacity, "nvme_size": nvme_size,
            "wa": _wa(du, dg), "user_mib": round(du / MIB, 1), "gc_mib": round(dg / MIB, 1),
            "overwrites": round(du / nvme_size, 2),
            "wa_whole_run": g1["write_amplification"],
            "util_mean": round(statistics.mean(utils), 3),
            "util_min": round(min(utils), 3), "util_max": round(max(utils), 3),
            "streams": streams, "placement": st1.get("placement", {}).get("decisions"),
            "files_written": w.files_written, "fuse_mib_written": round(w.bytes_written / MIB),
            "warmup_s": round(t1 - t0, 1), "measured_s": round(t2 - t1, 1),
            "write_hints": st1["gc"]["write_hints"], "gc_passes": st1["gc"]["passes"],
            "victims": st1["gc"]["victims"],
            "checksum_errors": st1["reads"]["checksum_errors"],
        })
        if latency:
            out["latency"] = _latency(m, w, lat_churn, a.latency_reads)
        out["verified_files"] = _verify(w)
    out.update(_models(w.trace, a))
    return out


def _models(trace: list[tuple], a: argparse.Namespace) -> dict:
    """The offline floor of *trace* and the model's one-stream log (a check of the model
    against kvfs's own `off`), over the measured window."""
    out = {}
    for name, placement in (("floor", "floor"), ("model_classes", "classes"),
                            ("model_one", "one")):
        r = simulate(trace, nvme_size=parse_size(a.nvme_size),
                     segment_size=parse_size(a.segment_size),
                     dram_size=parse_size(a.dram_size), placement=placement)
        out[name] = r.wa
        out[name + "_user_mib"] = round(r.user_bytes / MIB, 1)
    return out


def _read_one(w: Churn, paths: list[Path] | None = None) -> float:
    if paths is None:
        key = w.rng.choice(list(w.prefixes))
        paths = w.prefixes[key][0]
    p = w.rng.choice(paths)
    buf = bytearray(w.block)
    t = time.perf_counter()
    fd = os.open(p, os.O_RDONLY)
    try:
        os.readv(fd, [buf])
    finally:
        os.close(fd)
    return time.perf_counter() - t


def _p(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(1000 * xs[min(len(xs) - 1, int(q * len(xs)))], 3)


def _quiet(m: Mount, seconds: float = 1.5, timeout: float = 60) -> dict:
    """Wait until the cleaner has moved nothing for *seconds*."""
    end = time.monotonic() + timeout
    st = status(m.mnt)
    last, since = st["gc"]["bytes_moved"], time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.1)
        st = status(m.mnt)
        if st["gc"]["bytes_moved"] != last or st["gc"]["cleaning"]:
            last, since = st["gc"]["bytes_moved"], time.monotonic()
        elif time.monotonic() - since >= seconds:
            break
    return st


def _watch(m: Mount, w: Churn, paths: list[Path], *, until_gc_done: bool, seconds: float
           ) -> tuple[list[float], list[float], int]:
    """Read random blocks of *paths* in a thread while polling the status at 20 Hz.
    Returns (latencies of reads that started while the cleaner was moving records, of the
    others, bytes moved). With *until_gc_done*: stop once cleaning started and has been
    quiet for 1.5 s (or after 30 s); otherwise stop after *seconds*."""
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            t = time.monotonic()
            samples.append((t, _read_one(w, paths)))

    active: list[tuple[float, float]] = []
    st = status(m.mnt)
    moved0 = last = st["gc"]["bytes_moved"]
    t_last = t0 = time.monotonic()
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    try:
        while True:
            time.sleep(0.05)
            st = status(m.mnt)
            now = time.monotonic()
            moved = st["gc"]["bytes_moved"]
            if moved != last or st["gc"]["cleaning"]:
                active.append((t_last, now))
            last, t_last = moved, now
            if until_gc_done:
                if (active and now - active[-1][1] > 1.5) or now - t0 > 30:
                    break
            elif now - t0 >= seconds:
                break
    finally:
        stop.set()
        th.join()
    during = [d for t, d in samples if any(a <= t <= b for a, b in active)]
    other = [d for t, d in samples if not any(a <= t <= b for a, b in active)]
    return during, other, last - moved0


def _latency(m: Mount, w: Churn, lat_churn: list[float], reads: int) -> dict:
    """Whole-block read latency with the cleaner idle, then while it drains garbage."""
    time.sleep(3)  # writeback of the last requests; then wait for cleaning to stop
    _quiet(m, seconds=3.0)
    paths = [p for ps, _ in w.prefixes.values() for p in ps]
    busy, idle, moved_idle = _watch(m, w, paths, until_gc_done=False, seconds=reads / 100)
    idle += busy  # (reads while idle cleaning ran, if it did: counted as idle, reported)
    gc: list[float] = []
    moved_gc, rounds = 0, 0
    while len(gc) < reads and rounds < 4:
        rounds += 1
        # Garbage in every prefix segment: delete every other block of each prefix.
        for key, (ps, pop) in list(w.prefixes.items()):
            keep = ps[::2]
            for p in ps[1::2]:
                w._delete(p)
            w.prefixes[key] = (keep, pop)
        paths = [p for ps, _ in w.prefixes.values() for p in ps]
        during, _, moved = _watch(m, w, paths, until_gc_done=True, seconds=0)
        gc += during
        moved_gc += moved
    p99_idle, p99_gc = _p(idle, 0.99), _p(gc, 0.99)
    return {
        "idle_reads": len(idle), "idle_p50_ms": _p(idle, 0.5), "idle_p99_ms": p99_idle,
        "idle_gc_moved_bytes": moved_idle,
        "gc_reads": len(gc), "gc_p50_ms": _p(gc, 0.5), "gc_p99_ms": p99_gc,
        "gc_moved_mib": round(moved_gc / MIB, 1), "gc_rounds": rounds,
        "ratio_p99": round(p99_gc / p99_idle, 2) if p99_gc and p99_idle else None,
        "churn_reads": len(lat_churn), "churn_p99_ms": _p(lat_churn, 0.99),
    }


def _verify(w: Churn) -> int:
    n = 0
    for p in list(w.expected):
        if open(p, "rb").read() != w.expected_bytes(p):
            raise SystemExit(f"CORRUPTION: {p} does not hold what was written")
        n += 1
    return n


def report(results: list[dict], args) -> list[dict]:
    print(f"\nkvfs GC benchmark: nvme {args.nvme_size}, segments {args.segment_size}, "
          f"dram {args.dram_size}, chunk {args.chunk_size}, block {args.block}, "
          f"{args.overwrites} tier overwrites measured after {args.warmup} of warm-up")
    print(f"{'util':>5} {'config':7} {'util mean(min-max)':>20} {'user MiB':>9} {'gc MiB':>8} "
          f"{'WA':>7} {'floor':>6} {'model1':>6} {'per stream WA (user MiB)':<52} {'time':>6}")
    for r in results:
        per = ", ".join(f"{k} {v['wa'] if v['wa'] is not None else '-'} ({v['user_mib']:.0f})"
                        for k, v in r["streams"].items() if v["user_mib"] or v["gc_in_mib"])
        print(f"{int(r['util_target'] * 100):>4}% {r['config']:7} "
              f"{r['util_mean']:>8.3f} ({r['util_min']:.2f}-{r['util_max']:.2f}) "
              f"{r['user_mib']:>9.1f} {r['gc_mib']:>8.1f} {r['wa']:>7.4f} {r['floor']:>6.3f} "
              f"{r['model_one']:>6.3f} {per:<52} "
              f"{r['warmup_s'] + r['measured_s']:>5.0f}s")
    checks = []
    by = {(r["config"], r["util_target"]): r for r in results}
    for util in sorted({r["util_target"] for r in results}):
        for cfg in ("on", "hints"):
            r = by.get((cfg, util))
            if r:
                checks.append({"goal": f"{cfg} @{util:.0%}: WA <= {GOAL_WA}", "value": r["wa"],
                               "pass": r["wa"] <= GOAL_WA})
                off = by.get(("off", util))
                if off and util >= 0.9:
                    checks.append({"goal": f"{cfg} @{util:.0%}: WA <= {GOAL_RATIO} x single "
                                           f"stream ({off['wa']})",
                                   "value": round(r["wa"] / off["wa"], 3),
                                   "pass": r["wa"] <= GOAL_RATIO * off["wa"]})
                    checks.append({"goal": f"{cfg} @{util:.0%}: GC overhead (WA-1) <= "
                                           f"{GOAL_RATIO} x single stream's",
                                   "value": round((r["wa"] - 1) / (off["wa"] - 1), 3)
                                   if off["wa"] > 1 else None,
                                   "pass": (r["wa"] - 1) <= GOAL_RATIO * (off["wa"] - 1)})
    for r in results:
        lat = r.get("latency")
        if lat:
            print(f"\nread latency ({r['config']} @{r['util_target']:.0%}, whole {args.block} "
                  f"blocks): idle p50 {lat['idle_p50_ms']} ms p99 {lat['idle_p99_ms']} ms "
                  f"({lat['idle_reads']} reads, cleaner moved {lat['idle_gc_moved_bytes']} B); "
                  f"during GC p50 {lat['gc_p50_ms']} ms p99 {lat['gc_p99_ms']} ms "
                  f"({lat['gc_reads']} reads in {lat['gc_rounds']} rounds while "
                  f"{lat['gc_moved_mib']} MiB were moved); during churn p99 "
                  f"{lat['churn_p99_ms']} ms ({lat['churn_reads']} reads)")
            checks.append({"goal": f"p99 read latency during GC <= {GOAL_P99} x idle",
                           "value": lat["ratio_p99"],
                           "pass": lat["ratio_p99"] is not None
                           and lat["ratio_p99"] <= GOAL_P99})
    hints = results[0]["write_hints"] if results else {}
    print(f"\nwrite-life hints: kernel accepted {hints.get('kernel_accepted')}, device "
          f"{hints.get('device')} write streams {hints.get('device_write_streams')}, discard "
          f"{hints.get('device_discard')} (fs mounted with discard: "
          f"{hints.get('fs_mounted_with_discard')})")
    print("\ngoals:")
    for c in checks:
        print(f"  {'PASS' if c['pass'] else 'FAIL'}  {c['goal']}: {c['value']}")
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme-size", default="256M")
    ap.add_argument("--segment-size", default="1M")
    ap.add_argument("--dram-size", default="8M")
    ap.add_argument("--chunk-size", default="64K")
    ap.add_argument("--block", default="256K")
    ap.add_argument("--utils", default="50,90")
    ap.add_argument("--configs", default="off,two,on,hints")
    ap.add_argument("--overwrites", type=float, default=4.0)
    ap.add_argument("--warmup", type=float, default=1.0)
    ap.add_argument("--latency", default="on@90", help="CONFIG@UTIL, or 'none'")
    ap.add_argument("--latency-reads", type=int, default=400)
    ap.add_argument("--window", type=float, default=SHORT_WINDOW,
                    help="live per-request blocks, share of capacity")
    ap.add_argument("--prefix-share", type=float, default=PREFIX_SHARE,
                    help="share of written bytes that are new shared prefixes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where mounts go (default: a temp dir "
                    "on the disk, not tmpfs)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--sweep", action="store_true",
                    help="issue 37's grid: FIFO request windows beside long-lived prefixes")
    ap.add_argument("--quick", action="store_true",
                    help="with --sweep: a small tier and grid (a few minutes)")
    ap.add_argument("--sweep-windows", default="5,25,50,70", help="percent of the tier")
    ap.add_argument("--sweep-live", default="50,80,90",
                    help="percent of the capacity statvfs reports")
    ap.add_argument("--sweep-prefixes", default="static,rewritten")
    ap.add_argument("--sweep-data", default="incompressible,compressible")
    ap.add_argument("--sweep-configs", default="default,hinted,one")
    args = ap.parse_args(argv)
    if args.sweep:
        return main_sweep(args, sys.argv[1:] if argv is None else argv)
    lat_cfg = None if args.latency == "none" else args.latency.split("@")
    results = []
    work = Path(tempfile.mkdtemp(prefix="kvfs-bench-gc-", dir=args.workdir or "/var/tmp"))
    try:
        for util in (int(u) / 100 for u in args.utils.split(",")):
            for cfg in args.configs.split(","):
                lat = lat_cfg is not None and lat_cfg[0] == cfg and \
                    int(lat_cfg[1]) / 100 == util
                print(f"... {cfg} @{util:.0%}", flush=True)
                results.append(run_config(work, cfg, util, args, lat))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    checks = report(results, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "checks": checks},
                                              indent=1))
    return 0 if all(c["pass"] for c in checks) else 1


QUICK = {"nvme_size": "32M", "segment_size": "1M", "dram_size": "1M", "overwrites": 2.0,
         "warmup": 1.0, "sweep_live": "50,90", "sweep_data": "incompressible"}
SWEEP = {"nvme_size": "256M", "segment_size": "8M", "dram_size": "16M", "block": "1M",
         "overwrites": 3.0}


def main_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    """--sweep: the defaults of the sweep (or of --quick) where the command line set none."""
    given = {x.split("=")[0].lstrip("-").replace("-", "_") for x in argv if x.startswith("--")}
    for k, v in (QUICK if args.quick else SWEEP).items():
        if k not in given:
            setattr(args, k, v)
    work = Path(tempfile.mkdtemp(prefix="kvfs-bench-gc-", dir=args.workdir or "/var/tmp"))
    try:
        rows = sweep(work, args)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    checks = sweep_report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"sweep": rows, "checks": checks}, indent=1))
    return 0 if all(c["pass"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
