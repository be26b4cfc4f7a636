"""Predictors: what will be read next, from what the filesystem has seen so far.

Everything here is plain bookkeeping on the trio thread (no awaits, no I/O); the scheduler
turns predictions into prefetches.

- `CallerStreams`: each caller (FUSE gives the pid of the calling thread) has its own access
  order. Two accesses by the same caller less than `idle_s` apart are consecutive; anything
  else starts a new run. Keeping one order per caller stops concurrent readers from inventing
  edges between each other's files.
- `SuccessorGraph`: file -> the files that followed it in some caller's access order, most
  recent last. Edges come from two predictors:
    * write-order chains (`KIND_WRITE`): engines write a request's blocks in prefix order and
      later read them back in that order, so "created B right after touching A" predicts "B
      is read right after A" before any read has happened;
    * the learned read order (`KIND_READ`): "read B right after A", which replaces what the
      write order said (it is more recent and it is what readers really do).
  The walk follows the most recent successor at each step (a chain, not a tree): reused KV
  prefixes are continued the way they were last continued.
- `whole_file`: the chunks of one file in order (opening a file for reading predicts reading
  it all).
- `HintBook`: explicit hints (`user.kvfs.prefetch`), staged once however often they repeat,
  and released when read or when they grow stale.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator

Key = tuple[int, int]

KIND_WHOLE = "whole_file"
KIND_WRITE = "write_order"
KIND_READ = "successor"
KIND_HINT = "hint"


class CallerStreams:
    """The last file each caller touched, how and when: the per-caller access order.

    A run ends after an idle gap, and where a caller goes from writing to reading: an engine
    loads a request's reused blocks, then stores its new ones; the read that follows the
    stores belongs to the next request, and an edge there would predict nothing."""

    def __init__(self, *, idle_s: float = 1.0, max_callers: int = 4096) -> None:
        self.idle_s = idle_s
        self.max_callers = max_callers
        # pid -> (ino, time, written)
        self.last: OrderedDict[int, tuple[int, float, bool]] = OrderedDict()

    def step(self, pid: int, ino: int, now: float, *, write: bool = False
             ) -> tuple[int | None, float | None]:
        """Record that *pid* read (or wrote) *ino* at *now*. Returns (previous file, gap)
        when this access continues the caller's run, else (None, gap-or-None). Touching the
        same file again changes nothing but the time."""
        prev = self.last.get(pid)
        self.last[pid] = (ino, now, write)
        self.last.move_to_end(pid)
        while len(self.last) > self.max_callers:
            self.last.popitem(last=False)
        if prev is None:
            return None, None
        gap = now - prev[1]
        if prev[0] == ino or gap > self.idle_s or (prev[2] and not write):
            return None, gap
        return prev[0], gap

    def new_run(self, pid: int, now: float, *, write: bool = False) -> bool:
        """Would an access by *pid* at *now* start a new run?"""
        prev = self.last.get(pid)
        return prev is None or now - prev[1] > self.idle_s or (prev[2] and not write)

    def forget(self, ino: int) -> None:
        for pid in [p for p, v in self.last.items() if v[0] == ino]:
            del self.last[pid]


class SuccessorGraph:
    """Bounded map file -> recent successors (most recent last) with edge kinds and counts.

    Kept compact, since it holds up to 2^20 files: a file's successors are a list of
    [successor, kind, count] (at most *fanout*, most recent last) and its predecessors one
    file, or a set of them when it has several. With a dict and a set per file the graph was
    ~830 bytes a file, the largest thing kvfs kept per file."""

    def __init__(self, *, max_nodes: int = 1 << 20, fanout: int = 4) -> None:
        self.max_nodes = max_nodes
        self.fanout = fanout
        # ino -> [[successor, kind, count], ...]; LRU by last link.
        self.succ: OrderedDict[int, list[list]] = OrderedDict()
        self.pred: dict[int, int | set[int]] = {}
        self.links = {KIND_WRITE: 0, KIND_READ: 0}
        self.nedges = 0  # kept as edges come and go: status asks, and a sum is O(files)
        # Files whose most recent successor changed since the last save (None: it has none).
        self.dirty: dict[int, tuple[int, str] | None] = {}

    def __len__(self) -> int:
        return len(self.succ)

    def edges(self) -> int:
        return self.nedges

    def successors(self, a: int) -> list[int]:
        """Oldest first."""
        return [edge[0] for edge in self.succ.get(a, ())]

    def predecessors(self, b: int) -> set[int]:
        p = self.pred.get(b)
        if p is None:
            return set()
        return set(p) if isinstance(p, set) else {p}

    def link(self, a: int, b: int, kind: str) -> None:
        """b followed a. A read edge overrides a write edge; the newest edge is followed."""
        if a == b:
            return
        self.links[kind] += 1
        out = self.succ.get(a)
        if out is None:
            out = self.succ[a] = []
        else:
            self.succ.move_to_end(a)
        for i, edge in enumerate(out):
            if edge[0] == b:
                del out[i]
                if kind == KIND_READ:
                    edge[1] = KIND_READ
                edge[2] += 1
                out.append(edge)
                break
        else:
            out.append([b, kind, 1])
            self._add_pred(b, a)
            self.nedges += 1
        while len(out) > self.fanout:
            self._unpred(out.pop(0)[0], a)
            self.nedges -= 1
        self.dirty[a] = (b, out[-1][1])
        while len(self.succ) > self.max_nodes:
            node, gone = self.succ.popitem(last=False)
            self.nedges -= len(gone)
            self.dirty[node] = None
            for edge in gone:
                self._unpred(edge[0], node)

    def _add_pred(self, b: int, a: int) -> None:
        p = self.pred.get(b)
        if p is None:
            self.pred[b] = a
        elif isinstance(p, set):
            p.add(a)
        elif p != a:
            self.pred[b] = {p, a}

    def _unpred(self, b: int, a: int) -> None:
        p = self.pred.get(b)
        if isinstance(p, set):
            p.discard(a)
            if len(p) == 1:
                self.pred[b] = p.pop()
        elif p == a:
            del self.pred[b]

    def next(self, a: int) -> tuple[int, str] | None:
        out = self.succ.get(a)
        if not out:
            return None
        return out[-1][0], out[-1][1]

    def unsettled(self, a: int) -> bool:
        """Has *a* been followed by a different file almost every time? (Its most recent
        successor is new, and so were the ones before it.) A block every request starts with,
        such as a shared system prompt, is such a hub: its most recent successor names the last
        request's next block, not the next request's, so a walk stops there."""
        out = self.succ.get(a)
        return out is not None and len(out) >= 3 and all(edge[2] == 1 for edge in out)

    def chain(self, a: int, limit: int) -> Iterator[tuple[int, str]]:
        """Up to *limit* files predicted to follow *a*, in order, each with the kind of the
        edge that led to it. Stops at a file already on the chain (no cycles)."""
        seen = {a}
        for _ in range(limit):
            if self.unsettled(a):
                return
            step = self.next(a)
            if step is None or step[0] in seen:
                return
            a = step[0]
            seen.add(a)
            yield step

    def forget(self, ino: int) -> None:
        """A file is gone: drop it and every edge to or from it."""
        if self.succ.get(ino) or ino in self.dirty:
            self.dirty[ino] = None
        for edge in self.succ.pop(ino, ()):
            self._unpred(edge[0], ino)
            self.nedges -= 1
        for a in self.predecessors(ino):
            out = self.succ.get(a)
            if out is not None:
                before = len(out)
                out[:] = [edge for edge in out if edge[0] != ino]
                self.nedges -= before - len(out)
                self.dirty[a] = self.next(a)
        self.pred.pop(ino, None)

    def take_dirty(self) -> dict[int, tuple[int, str] | None]:
        """What changed since the last call: file -> its most recent successor, or None."""
        dirty, self.dirty = self.dirty, {}
        return dirty


def whole_file(ino: int, first: int, nchunks: Callable[[int], int], limit: int
               ) -> Iterator[int]:
    """Chunks first, first+1, ... of a file, at most *limit* of them."""
    n = nchunks(ino)
    return iter(range(first, min(n, first + limit)))


def predict(graph: SuccessorGraph, key: Key, nchunks: Callable[[int], int], limit: int
            ) -> list[tuple[Key, str]]:
    """The *limit* chunks expected after *key*: the rest of its file (whole-file readahead),
    then the files of its successor chain, each from its first chunk."""
    ino, c = key
    out: list[tuple[Key, str]] = [((ino, x), KIND_WHOLE)
                                  for x in whole_file(ino, c + 1, nchunks, limit)]
    if len(out) >= limit:
        return out
    for nxt, kind in graph.chain(ino, limit):
        for x in itertools.islice(range(nchunks(nxt)), limit - len(out)):
            out.append(((nxt, x), kind if x == 0 else KIND_WHOLE))
        if len(out) >= limit:
            break
    return out


class HintBook:
    """Chunks an engine said it will read (user.kvfs.prefetch). A chunk hinted again while it
    is still wanted is not staged again."""

    def __init__(self, *, ttl_s: float = 60.0) -> None:
        self.ttl_s = ttl_s
        self.keys: OrderedDict[Key, float] = OrderedDict()  # key -> time of the first hint
        # ino -> its hinted chunks: a file's deletion forgets them without a walk of all
        # hints (an engine deleting many hinted files made that quadratic)
        self.by_ino: dict[int, set[int]] = {}
        self.repeats = 0

    def add(self, key: Key, now: float) -> bool:
        """True if *key* is new (the caller stages it), False if already wanted."""
        if key in self.keys:
            self.repeats += 1
            return False
        self.keys[key] = now
        self.by_ino.setdefault(key[0], set()).add(key[1])
        return True

    def _drop(self, key: Key) -> None:
        chunks = self.by_ino.get(key[0])
        if chunks is not None:
            chunks.discard(key[1])
            if not chunks:
                del self.by_ino[key[0]]

    def consumed(self, key: Key) -> bool:
        if self.keys.pop(key, None) is None:
            return False
        self._drop(key)
        return True

    def expired(self, now: float) -> list[Key]:
        out = []
        while self.keys:
            key, t = next(iter(self.keys.items()))
            if now - t < self.ttl_s:
                break
            self.keys.popitem(last=False)
            self._drop(key)
            out.append(key)
        return out

    def forget(self, ino: int) -> list[Key]:
        gone = [(ino, c) for c in self.by_ino.pop(ino, ())]
        for k in gone:
            del self.keys[k]
        return gone
