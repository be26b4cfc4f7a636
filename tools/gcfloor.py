"""An offline model of kvfs's NVMe segment log, for tools/bench_gc.py: the write-amplification
floor of a write/delete sequence.

The sequence is a benchmark's file-level trace: ("w", file id, bytes, chunk record lengths,
class) and
("d", file id), in the order the benchmark made them. A FIFO model of the DRAM tier turns it
into NVMe appends and deaths (a file deleted while all of it is still in DRAM never reaches
NVMe; kvfs demotes from 90% of the DRAM tier down to 75%, oldest write first, which is what its
SLRU does for blocks that are not read again). The log model then appends those records to
segments of the benchmark's size, with kvfs's reserve (GC_RESERVED_SEGMENTS: user records may
not take the last ones), kvfs's cleaner policy (on demand: when a user append finds no segment
beyond the reserve; or, as kvfs did before 2026-12-08, eagerly: background cleaning below a
low watermark up to a high one; victims by LFS cost-benefit, u <= 0.98) and kvfs's rule that a
segment is freed when its last record dies once sealed.
The model's cleaner works between two appends, not beside them, and is not paced.

Placements:
    floor   perfect knowledge of every record's death time: a record (user or copied by the
            cleaner) goes to the open segment of its class of *remaining* lifetime, in the
            user-byte clock: log2(remaining / segment size) rounded down, up to BUCKETS
            classes, and one class for records that outlive the trace. Records of one class
            that are written together die together, within a factor of two of each other's
            remaining life: a segment of them empties by itself, or is cleaned when most of
            it is dead. Each grouping is run twice: cleaned eagerly on watermarks, and
            only when a user append finds no segment (on demand, as kvfs does: victims as
            dead as they will get, but copies interleaved with user records). Each class's
            open segment takes room, so with little slack fewer, wider classes can win:
            the floor is the lowest WAF of these six runs and of the two `classes` runs
            below (whoever knows the death times knows the classes too).
    classes knows only each file's class as the trace gives it (the directory: what a
            perfect `user.kvfs.lifetime` hint says), no death times: one open segment per
            class, and one per class for the cleaner's copies; cleaned eagerly or on
            demand, the better of the two. What an online placement that never mixes
            classes gets with this cleaner: the bar for `hinted` when the floor's grouping
            by death time cannot be had online (memoryless deaths: DESIGN.md).
    one     one open segment for everything (kvfs streams=1), cleaned on demand: a check of
            the model against kvfs's own one-stream figure in the same run.

Write amplification = (user + copied record bytes) / user record bytes, between two points of
the trace (the benchmark's measured window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

BLOCK = 4096
HEADER_SIZE = 64
GC_RESERVED_SEGMENTS = 2  # kvfs/store/gc.py
FREE_TARGET = 0.02
FREE_HYSTERESIS = 0.02
MAX_U = 0.98
OPEN_IDLE_SHARE = 0.25
DRAM_HIGH, DRAM_LOW = 0.90, 0.75  # the demoter's watermarks (docs/DESIGN.md, Tiering policy)
BUCKETS = 14
IMMORTAL = math.inf


def record_length(stored_len: int) -> int:
    return (HEADER_SIZE + stored_len + BLOCK - 1) // BLOCK * BLOCK


@dataclass(eq=False)
class _Seg:
    sid: int
    clock: int
    fill: int = BLOCK  # the segment header block
    live: int = 0
    records: set = field(default_factory=set)


@dataclass
class Result:
    wa: float | None
    user_bytes: int
    gc_bytes: int
    cleaned: int
    peak_open: int


def nvme_events(trace: list[tuple], dram_size: int) -> list[tuple]:
    """The DRAM tier as a FIFO: ("w", fid, [record lengths], class) when a file leaves DRAM,
    ("d", fid) when a file that reached NVMe dies, ("mark", name) passed through."""
    out: list[tuple] = []
    in_dram: dict[int, tuple[int, list[int]]] = {}  # insertion order = write order
    on_nvme: set[int] = set()
    load = 0
    for ev in trace:
        if ev[0] == "w":
            _, fid, nbytes, recs, cls = ev
            in_dram[fid] = (nbytes, recs, cls)
            load += nbytes
            if load > DRAM_HIGH * dram_size:
                while in_dram and load > DRAM_LOW * dram_size:
                    old = next(iter(in_dram))
                    ob, orecs, ocls = in_dram.pop(old)
                    load -= ob
                    on_nvme.add(old)
                    out.append(("w", old, orecs, ocls))
        elif ev[0] == "d":
            fid = ev[1]
            if fid in in_dram:
                load -= in_dram.pop(fid)[0]
            elif fid in on_nvme:
                on_nvme.discard(fid)
                out.append(("d", fid))
        else:
            out.append(ev)
    return out


class LogModel:
    def __init__(self, nvme_size: int, segment_size: int, placement: str, base: float = 2.0,
                 eager: bool = True) -> None:
        self.size = segment_size
        self.max_segments = nvme_size // segment_size
        self.reserved = GC_RESERVED_SEGMENTS
        n = self.max_segments
        self.low_mark = max(self.reserved + 3, math.ceil(FREE_TARGET * n))
        self.high_mark = self.low_mark + max(1, math.ceil(FREE_HYSTERESIS * n))
        self.placement = placement
        self.base = base
        self.eager = eager
        self.segs: dict[int, _Seg] = {}
        self.open: dict[object, _Seg] = {}
        self.last_append: dict[object, int] = {}
        self.where: dict[tuple[int, int], tuple[int, int]] = {}  # record -> (segment, length)
        self.death: dict[int, float] = {}  # fid -> user clock at death
        self.cls_of: dict[int, object] = {}  # fid -> the class the trace gave its file
        self.next_sid = 1
        self.user = 0  # user record bytes appended (the clock of lifetimes)
        self.written = 0  # all record bytes appended (the cleaner's clock of ages)
        self.gc = 0
        self.cleaned = 0
        self.peak_open = 0

    # -- placement ---------------------------------------------------------------------------
    def _class(self, fid: int, for_gc: bool) -> object:
        if self.placement == "one":
            return 0
        if self.placement == "classes":
            return (self.cls_of.get(fid), for_gc)
        d = self.death.get(fid, IMMORTAL)
        if d == IMMORTAL:
            return "immortal"
        left = max(1.0, (d - self.user) / self.size)
        return min(BUCKETS - 1, int(math.log(left, self.base)))

    # -- segments ----------------------------------------------------------------------------
    def free(self) -> int:
        return self.max_segments - len(self.segs)

    def _append(self, key: tuple[int, int], rec_len: int, *, for_gc: bool) -> None:
        cls = self._class(key[0], for_gc)
        seg = self.open.get(cls)
        if seg is not None and seg.fill + rec_len > self.size:
            del self.open[cls]
            self._maybe_free(seg)
            seg = None
        if seg is None:
            if not for_gc:
                if self.free() <= self.reserved:
                    self._clean(until=self.reserved + 1)
                if self.free() <= self.reserved:
                    raise RuntimeError("model: the log is full (more live data than room)")
            elif self.free() <= 0:
                raise RuntimeError("model: no segment left for the cleaner's copies")
            seg = self.segs[self.next_sid] = _Seg(self.next_sid, self.written)
            self.next_sid += 1
            self.open[cls] = seg
            self.peak_open = max(self.peak_open, len(self.open))
        seg.fill += rec_len
        seg.live += rec_len
        seg.records.add(key)
        self.where[key] = (seg.sid, rec_len)
        self.written += rec_len
        self.last_append[cls] = self.written
        if self.eager and not for_gc and self.free() < self.low_mark:
            self._clean(until=self.high_mark)

    def _maybe_free(self, seg: _Seg) -> None:
        if seg.live <= 0 and all(seg is not o for o in self.open.values()):
            del self.segs[seg.sid]

    def _seal_idle(self) -> None:
        for cls, seg in list(self.open.items()):
            if self.written - self.last_append.get(cls, 0) >= OPEN_IDLE_SHARE * \
                    self.max_segments * self.size:
                del self.open[cls]
                self._maybe_free(seg)

    def _clean(self, until: int) -> None:
        self._seal_idle()
        while self.free() < until:
            open_ids = {s.sid for s in self.open.values()}
            best, best_score = None, 0.0
            for s in self.segs.values():
                if s.sid in open_ids:
                    continue
                u = min(1.0, s.live / self.size)
                if u > MAX_U:
                    continue
                score = (1 - u) * (self.written - s.clock + self.size) / (1 + u)
                if score > best_score:
                    best, best_score = s, score
            if best is None:
                return
            for key in sorted(best.records):  # the victim is held until its copies are made
                _, rec_len = self.where.pop(key)
                self.gc += rec_len
                self._append(key, rec_len, for_gc=True)
            del self.segs[best.sid]
            self.cleaned += 1

    # -- the sequence ------------------------------------------------------------------------
    def write(self, fid: int, recs: list[int]) -> None:
        for i, rec_len in enumerate(recs):
            self.user += rec_len
            self._append((fid, i), rec_len, for_gc=False)

    def delete(self, fid: int, n: int) -> None:
        for i in range(n):
            sid, rec_len = self.where.pop((fid, i))
            seg = self.segs[sid]
            seg.live -= rec_len
            seg.records.discard((fid, i))
            self._maybe_free(seg)


def simulate(trace: list[tuple], *, nvme_size: int, segment_size: int, dram_size: int,
             placement: str = "floor", start: str = "start", end: str = "end") -> Result:
    """WAF of *trace* between its ("mark", start) and ("mark", end) events, for *placement*
    (floor, classes or one: see the module's docstring)."""
    events = nvme_events(trace, dram_size)
    death: dict[int, float] = {}
    nrec: dict[int, int] = {}
    clock = 0
    for ev in events:  # first pass: every file's death on the user-byte clock
        if ev[0] == "w":
            clock += sum(ev[2])
            nrec[ev[1]] = len(ev[2])
        elif ev[0] == "d":
            death[ev[1]] = clock
    best = None
    if placement == "floor":  # knowing the death times, it may also place by class
        variants = [("floor", b, e) for b in (2.0, 4.0, 16.0) for e in (True, False)] + \
            [("classes", 2.0, True), ("classes", 2.0, False)]
    elif placement == "classes":
        variants = [("classes", 2.0, True), ("classes", 2.0, False)]
    else:
        variants = [(placement, 2.0, False)]
    for how, base, eager in variants:
        r = _run(events, death, nrec, LogModel(nvme_size, segment_size, how, base, eager),
                 start, end)
        if best is None or (r.wa or 0) < (best.wa or 0):
            best = r
    return best


def _run(events: list[tuple], death: dict, nrec: dict, m: LogModel, start: str,
         end: str) -> Result:
    m.death = death
    m.cls_of = {ev[1]: ev[3] for ev in events if ev[0] == "w"}
    at: dict[str, tuple[int, int]] = {}
    for ev in events:
        if ev[0] == "w":
            m.write(ev[1], ev[2])
        elif ev[0] == "d":
            m.delete(ev[1], nrec[ev[1]])
        else:
            at[ev[1]] = (m.user, m.gc)
    u0, g0 = at.get(start, (0, 0))
    u1, g1 = at.get(end, (m.user, m.gc))
    du, dg = u1 - u0, g1 - g0
    return Result(round((du + dg) / du, 4) if du else None, du, dg, m.cleaned, m.peak_open)
