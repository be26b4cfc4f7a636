"""Placement streams: which open segment a record goes to, and the hints passed down.

KV blocks die in groups: a request's private blocks go when the request ends, a shared prefix
lives for hours, data the cleaner relocated is cold. Records of different streams never share
a segment (kvfs/store/nvme.py), so a segment of short-lived records empties by itself and is
unlinked without any copying, and long-lived records are not scattered among dying ones.

Streams (a small fixed number, like FDP placement handles; mount option `streams=N`, 1-5):

    id  name    holds                                          write-life hint
    0   short   per-request blocks                             RWH_WRITE_LIFE_SHORT
    1   gc      records relocated by the cleaner               RWH_WRITE_LIFE_EXTREME
    2   long    shared prefixes, anything that outlives churn  RWH_WRITE_LIFE_LONG
    3   medium  user data of unknown or middling lifetime      RWH_WRITE_LIFE_MEDIUM
    4   cold    records relocated a second time (from `gc`)    RWH_WRITE_LIFE_EXTREME

With fewer streams the classes fold: streams=1 is one log for everything (user and GC writes,
no hint); streams=2 is user data + GC (the old layout); streams=3 puts `medium` with `long`
(the `short` stream stays pure, so its segments keep emptying by themselves); streams=4 is the
default. Stream ids are what record and segment headers carry (docs/FORMAT.md).

Which class a file's records get, first match wins:
1. `user.kvfs.lifetime` on the file, else on its nearest ancestor directory that has it:
   `short`, `medium` or `long` (`auto` stops the search and asks the classifier). Set it on
   the engine's per-request and prefix directories once; new files inherit it.
2. Lifetimes kvfs observed for files under the same directories (LifetimeClassifier), ranked
   against each other rather than against a fixed threshold, whatever their scale. A file is
   watched from its first record on NVMe until it dies or outlives the horizon: RANK_FACTOR
   times the shortest typical lifetime of any directory (LONG_HORIZON tiers of writes while
   none is known). A directory most of whose files outlive it is `long`; one whose files die
   at a consistent age (most die, log2 spread <= SPREAD) is ranked by its mean log2
   lifetime: within SHORT_RANK of the shortest directory's, `short`; RANK_FACTOR times
   longer or more, `long`; between, `medium`; one of mixed lifetimes is `medium`. So a
   request window of 5% or of 70% of the tier is `short` beside prefixes that live for
   tiers, and the prefixes are `long` as soon as they have outlived a few windows. The
   nearest ancestor directory (parent first, root last) with MIN_SAMPLES observations
   decides, unless the file's own directory has MIN_SAMPLES files being watched: that one is
   learned on its own (the root, which learned from the requests first, would otherwise
   put the prefixes written meanwhile in `short` with them).
3. Otherwise (no directory of the chain decided yet) `medium` or `long`: undecided
   directories take them in turn, in the order they first write to NVMe, so that two
   directories are not mixed while their lifetimes are being learned.

Lifetimes are measured on a byte clock (user record bytes written to NVMe), not wall time:
what matters for cleaning is how much was written while a record lived.

Write-life hints: every segment file gets its stream's hint with fcntl(F_SET_RW_HINT), read
back with F_GET_RW_HINT; `kvfsctl status` reports whether the kernel kept them, how many write
streams the block device offers (0: the device ignores them) and whether it takes discards.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# <linux/fcntl.h>
F_GET_RW_HINT = 1024 + 11
F_SET_RW_HINT = 1024 + 12
RWH_WRITE_LIFE_NOT_SET = 0
RWH_WRITE_LIFE_NONE = 1
RWH_WRITE_LIFE_SHORT = 2
RWH_WRITE_LIFE_MEDIUM = 3
RWH_WRITE_LIFE_LONG = 4
RWH_WRITE_LIFE_EXTREME = 5
HINT_NAMES = {0: "NOT_SET", 1: "NONE", 2: "SHORT", 3: "MEDIUM", 4: "LONG", 5: "EXTREME"}

LIFETIME_XATTR = b"user.kvfs.lifetime"
CLASSES = ("short", "gc", "long", "medium", "cold")  # index = stream id with 5 streams
USER_CLASSES = ("short", "medium", "long")
MAX_STREAMS = len(CLASSES)
DEFAULT_STREAMS = 4
_HINTS = {"short": RWH_WRITE_LIFE_SHORT, "gc": RWH_WRITE_LIFE_EXTREME,
          "long": RWH_WRITE_LIFE_LONG, "medium": RWH_WRITE_LIFE_MEDIUM,
          "cold": RWH_WRITE_LIFE_EXTREME}

# A directory's verdict needs this many observations (deaths, or survivals as below).
MIN_SAMPLES = 8
# A clear majority of a directory's files outlive the horizon, or die before it; else "mixed".
DECISIVE = 0.75
# log2 spread (standard deviation) of a directory's lifetimes above which they are "mixed".
SPREAD = 1.5
# Within this factor of the shortest directory's typical lifetime: short.
SHORT_RANK = 2.0
# This many times the shortest typical lifetime, or more: long. A file still alive at that
# age is counted as having lived that long (and no longer watched).
RANK_FACTOR = 4.0
# ... and when no directory has a verdict yet, a file alive after this many tiers of writes.
LONG_HORIZON = 4.0
# Bounds on classifier memory: files being watched, directories with statistics.
MAX_TRACKED = 200_000
MAX_DIRS = 8192


@dataclass(frozen=True)
class StreamTable:
    """The streams of one mount: their names and hints, and where each class goes."""

    count: int
    names: tuple[str, ...]
    hints: tuple[int, ...]
    route: dict  # class name -> stream id

    @classmethod
    def make(cls, count: int = DEFAULT_STREAMS) -> StreamTable:
        if not 1 <= count <= MAX_STREAMS:
            raise ValueError(f"streams must be between 1 and {MAX_STREAMS}, not {count}")
        if count == 1:
            return cls(1, ("all",), (RWH_WRITE_LIFE_NOT_SET,), dict.fromkeys(CLASSES, 0))
        if count == 2:
            route = {"short": 0, "medium": 0, "long": 0, "gc": 1, "cold": 1}
            return cls(2, ("user", "gc"), (RWH_WRITE_LIFE_NOT_SET, RWH_WRITE_LIFE_EXTREME),
                       route)
        names = CLASSES[:count]
        route = {c: i for i, c in enumerate(names)}
        route.setdefault("medium", route["long"])
        route.setdefault("cold", route["gc"])
        return cls(count, names, tuple(_HINTS[n] for n in names), route)

    @property
    def gc(self) -> int:
        return self.route["gc"]

    @property
    def separates_user_data(self) -> bool:
        return len({self.route[c] for c in USER_CLASSES}) > 1

    def gc_destination(self, victim_stream: int, cls: str | None = None) -> int:
        """Where the cleaner copies a live record found in a segment of *victim_stream*,
        of a file of class *cls* now (None: not known): relocated data is cold; data
        relocated twice is colder still (if there is a stream). But a record of the `short`
        class goes back to the short stream, where user data has its own: it dies soon,
        in write order with the requests written now, and among the survivors it would
        leave holes that the cleaner would copy around again."""
        if cls == "short" and self.separates_user_data:
            return self.route["short"]
        if victim_stream in (self.route["gc"], self.route["cold"]):
            return self.route["cold"]
        return self.route["gc"]

    def name(self, stream: int) -> str:
        return self.names[stream] if stream < self.count else f"stream{stream}"


def set_write_hint(fd: int, hint: int) -> bool:
    """Give a file a write-life hint; True if the kernel kept it (read back)."""
    try:
        fcntl.fcntl(fd, F_SET_RW_HINT, struct.pack("Q", hint))
        got = fcntl.fcntl(fd, F_GET_RW_HINT, bytes(8))
        return struct.unpack("Q", got)[0] == hint
    except OSError:
        return False


def device_info(path: str) -> dict:
    """What the block device under *path* does with hints and discards (best effort)."""
    out: dict = {"device": None, "write_streams": None, "discard": None, "fs_discard": None}
    try:
        dev = os.stat(path).st_dev
        out["device"] = f"{os.major(dev)}:{os.minor(dev)}"
        base = f"/sys/dev/block/{out['device']}"
        queue = base + "/queue"
        if not os.path.isdir(queue):
            queue = base + "/../queue"  # a partition: the queue is its disk's
        for key, name in (("write_streams", "max_write_streams"),
                          ("discard", "discard_max_bytes")):
            try:
                with open(os.path.join(queue, name)) as f:
                    value = int(f.read().strip())
                out[key] = value if key == "write_streams" else value > 0
            except (OSError, ValueError):
                pass
        with open("/proc/self/mountinfo") as f:
            best = ""
            for line in f:
                parts = line.split()
                if parts[2] == out["device"] and path.startswith(parts[4]) and \
                        len(parts[4]) >= len(best):
                    best = parts[4]
                    sep = parts.index("-")
                    opts = parts[5].split(",") + parts[sep + 3].split(",")
                    out["fs_discard"] = "discard" in opts
    except OSError:
        pass
    return out


class _DirStats:
    """One directory's files: the share that outlived the horizon, and the running mean and
    variance of log2(lifetime in bytes) of those that died; the recent ones weigh most."""

    __slots__ = ("n", "outlived", "died", "mean", "var")

    def __init__(self) -> None:
        self.n = 0
        self.outlived = 0.0
        self.died = 0
        self.mean = 0.0
        self.var = 0.0

    def add(self, log_life: float | None) -> None:
        """*log_life*: log2 of a dead file's lifetime; None: it outlived the horizon."""
        self.n += 1
        self.outlived += (float(log_life is None) - self.outlived) / min(self.n, 32)
        if log_life is None:
            return
        self.died += 1
        w = 1 / min(self.died, 32)
        d = log_life - self.mean
        self.mean += w * d
        self.var = (1 - w) * (self.var + w * d * d)

    def kind(self) -> str | None:
        """None (too few observations), "outlives", "mixed", or "dies" (at a consistent
        age: then `mean` ranks it)."""
        if self.n < MIN_SAMPLES:
            return None
        if self.outlived >= DECISIVE:
            return "outlives"
        if self.outlived > 1 - DECISIVE or self.var > SPREAD * SPREAD:
            return "mixed"
        return "dies"


class LifetimeClassifier:
    """Chooses a stream for each file's records: explicit hint, else learned per directory.

    Runs on the trio thread only. `stream_of` is ChunkStore.stream_of (called once per chunk
    writeback); `deleted` is ChunkStore.file_deleted. A file is watched from the first time
    one of its records reaches NVMe until it dies or until it has outlived the horizon
    (RANK_FACTOR x the shortest typical lifetime, at most LONG_HORIZON tiers); its lifetime
    then (a lower bound for a survivor) updates its directory and every ancestor. State is in
    memory only: it is relearned after a remount.
    """

    def __init__(self, ns, table: StreamTable, clock: Callable[[], int],
                 tier_bytes: int) -> None:
        self.ns = ns
        self.table = table
        self.clock = clock
        self.long_horizon = max(1, int(LONG_HORIZON * tier_bytes))
        self._watch: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._pending: dict[int, int] = {}  # directory -> its files being watched
        self._dirs: OrderedDict[int, _DirStats] = OrderedDict()
        self._bad_values: set[bytes] = set()
        self._unknown: OrderedDict[int, int] = OrderedDict()  # directory -> _unknown_class slot
        self._next_unknown = 0
        # log2 of the shortest typical lifetime among consistent directories (None: none yet),
        # recomputed after RESCALE_EVERY outcomes
        self._scale: float | None = None
        self._since_rescale = 0
        self.decisions = {"hint": 0, "learned": 0, "default": 0}
        self.outcomes = {"died": 0, "outlived": 0}

    RESCALE_EVERY = 64

    # -- the store's hooks ---------------------------------------------------------------
    def stream_of(self, ino: int) -> int:
        return self.table.route[self.classify(ino)]

    def deleted(self, ino: int) -> None:
        self._expire()
        entry = self._watch.pop(ino, None)
        if entry is not None:
            self._unwatched(entry[1])
            self._outcome(entry[1], self.clock() - entry[0])

    # -- classification ------------------------------------------------------------------
    def classify(self, ino: int) -> str:
        self._expire()
        chain = self._chain(ino)
        if ino not in self._watch:
            if len(self._watch) >= MAX_TRACKED:
                # forget the oldest without an outcome
                self._unwatched(self._watch.popitem(last=False)[1][1])
            self._watch[ino] = (self.clock(), chain)
            if chain:
                self._pending[chain[0]] = self._pending.get(chain[0], 0) + 1
        if not self.table.separates_user_data:
            return "medium"  # one user stream: nothing to decide
        known = self._known_class(ino, chain)
        if known is not None:
            self.decisions[known[1]] += 1
            return known[0]
        self.decisions["default"] += 1
        return self._unknown_class(chain[0] if chain else ino)

    def known_class(self, ino: int) -> str | None:
        """The class a hint or what was learned gives *ino* now (None: neither decides),
        without watching it or counting a decision: for the cleaner's copies."""
        known = self._known_class(ino, self._chain(ino))
        return None if known is None else known[0]

    def _known_class(self, ino: int, chain: tuple[int, ...]) -> tuple[str, str] | None:
        """(class, "hint" or "learned"), or None if neither decides."""
        hinted = self._hint(ino, chain)
        if hinted is not None and hinted != "auto":
            return hinted, "hint"
        for d in chain:
            st = self._dirs.get(d)
            verdict = self._verdict(st) if st is not None else None
            if verdict is not None:
                return verdict, "learned"
            if d == chain[0] and self._pending.get(d, 0) >= MIN_SAMPLES:
                # Its own files are being learned: an ancestor's verdict speaks for a new
                # directory of a few files (a request's), not for one of its own kind
                # (the root learned from the requests would put the prefixes with them).
                return None
        return None

    def _unknown_class(self, d: int) -> str:
        """Directories not decided yet take `medium` and `long` in turn, in the order their
        files first reach NVMe: two directories whose lifetimes turn out to differ (requests
        and prefixes) are kept apart from their first records, before anything is known."""
        slot = self._unknown.get(d)
        if slot is None:
            if len(self._unknown) >= MAX_DIRS:
                self._unknown.popitem(last=False)
            slot = self._unknown[d] = self._next_unknown
            self._next_unknown ^= 1
        return ("medium", "long")[slot]

    def _verdict(self, st: _DirStats) -> str | None:
        kind = st.kind()
        if kind is None:
            return None
        if kind == "outlives":
            return "long"
        if kind == "mixed" or self._scale is None:
            return "medium"
        rank = st.mean - self._scale
        if rank <= math.log2(SHORT_RANK):
            return "short"
        if rank >= math.log2(RANK_FACTOR):
            return "long"
        return "medium"

    def _chain(self, ino: int) -> tuple[int, ...]:
        """The file's directory and its ancestors, nearest first, root last."""
        return self.ns.ancestors(ino)

    def _hint(self, ino: int, chain: tuple[int, ...]) -> str | None:
        for i in (ino, *chain):
            value = self.ns.getxattr(i, LIFETIME_XATTR)
            if value is None:
                continue
            v = value.strip().lower()
            if v in (b"short", b"medium", b"long", b"auto"):
                return v.decode()
            if value not in self._bad_values:
                self._bad_values.add(value)
                log.warning("inode %d: ignoring %s=%r (use short, medium, long or auto)", i,
                            LIFETIME_XATTR.decode(), value)
        return None

    # -- learning ------------------------------------------------------------------------
    @property
    def horizon(self) -> int:
        """Age at which a watched file counts as long-lived (and is no longer watched)."""
        if self._scale is None:
            return self.long_horizon
        return max(1, min(self.long_horizon, math.ceil(RANK_FACTOR * 2 ** self._scale)))

    def _expire(self) -> None:
        horizon = self.horizon
        cutoff = self.clock() - horizon
        watch = self._watch
        while watch:
            ino, (t, chain) = next(iter(watch.items()))
            if t > cutoff:
                break
            del watch[ino]
            self._unwatched(chain)
            # it lived at least the horizon: how much longer is not known (nor waited for)
            self._outcome(chain, None)

    def _unwatched(self, chain: tuple[int, ...]) -> None:
        if chain:
            n = self._pending.pop(chain[0]) - 1
            if n:
                self._pending[chain[0]] = n

    def _outcome(self, chain: tuple[int, ...], lifetime: int | None) -> None:
        """A watched file died after *lifetime* bytes, or (None) outlived the horizon."""
        self.outcomes["outlived" if lifetime is None else "died"] += 1
        log_life = None if lifetime is None else math.log2(max(1, lifetime))
        for d in chain:
            st = self._dirs.get(d)
            if st is None:
                if len(self._dirs) >= MAX_DIRS:
                    self._dirs.popitem(last=False)
                st = self._dirs[d] = _DirStats()
            else:
                self._dirs.move_to_end(d)
            st.add(log_life)
            if st.kind() == "dies" and (self._scale is None or st.mean < self._scale):
                self._scale = st.mean  # a new shortest: at once
        self._since_rescale += 1
        if self._since_rescale >= self.RESCALE_EVERY:
            self._rescale()

    def _rescale(self) -> None:
        """The shortest typical lifetime may also have grown (its directory went quiet, or
        its files live longer now): recomputed from every directory now and then."""
        self._since_rescale = 0
        means = [st.mean for st in self._dirs.values() if st.kind() == "dies"]
        self._scale = min(means) if means else None

    def stats(self) -> dict:
        verdicts: dict[str, int] = {}
        for st in self._dirs.values():
            v = self._verdict(st) or "undecided"
            verdicts[v] = verdicts.get(v, 0) + 1
        return {"placement": {"decisions": dict(self.decisions),
                              "outcomes": dict(self.outcomes),
                              "watched_files": len(self._watch),
                              "horizon_bytes": self.horizon,
                              "shortest_typical_lifetime_bytes":
                                  None if self._scale is None else round(2 ** self._scale),
                              "directories": verdicts}}
