"""`kvfsctl trace start FILE` / `trace stop`: record the mount's accesses as a Mooncake trace.

Mooncake's trace format (../shared/data/traces, read by tools/trace_replay.py) is one JSON
object per request and line: {"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [block ids]}. Here a file is a block: it gets an id the first time it is
opened or created while recording (0, 1, ...), and a request is what one process opens and
creates with no pause longer than REQUEST_GAP_S (an engine worker loading a request's prefix,
then writing its new blocks). Its timestamp is its first access, in milliseconds since the
recording started; input_length counts TOKENS_PER_BLOCK per block (Mooncake's blocks are 512
tokens), output_length is 0 (what a filesystem sees holds no output length).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

REQUEST_GAP_S = 0.1
TOKENS_PER_BLOCK = 512


@dataclass
class _Request:
    start: float
    last: float
    ids: list[int] = field(default_factory=list)


class TraceRecorder:
    """Told of every open and create (by the read-ahead's hooks); writes requests as they
    end. Runs on the trio thread. Each request is one write() of its whole line, unbuffered:
    if the daemon dies while recording, the file holds every request that had ended, each
    line whole, and replays as it is (a buffer would lose the last few KiB and cut a line)."""

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
        self.path = path
        self.fd = fd
        self.clock = clock
        self.started = clock()
        self.ids: dict[int, int] = {}  # inode -> block id
        self.open: dict[int, _Request] = {}  # pid -> its request under way
        self.requests = 0
        # Why writing the file failed (e.g. its disk is full), then nothing more is written:
        # an open in the mount must not fail for its trace.
        self.error: str | None = None

    def access(self, ino: int, pid: int) -> None:
        now = self.clock()
        block = self.ids.setdefault(ino, len(self.ids))
        self._flush(now)
        req = self.open.get(pid)
        if req is None:
            req = self.open[pid] = _Request(now, now)
        req.last = now
        if not req.ids or req.ids[-1] != block:  # (a file opened again in a row: one use)
            req.ids.append(block)

    def _flush(self, now: float | None) -> None:
        """Write the requests whose process has paused (all of them when *now* is None)."""
        done = [pid for pid, r in self.open.items()
                if now is None or now - r.last > REQUEST_GAP_S]
        for pid in sorted(done, key=lambda p: self.open[p].start):
            r = self.open.pop(pid)
            line = memoryview(json.dumps({
                "timestamp": int((r.start - self.started) * 1000),
                "input_length": len(r.ids) * TOKENS_PER_BLOCK, "output_length": 0,
                "hash_ids": r.ids}).encode() + b"\n")
            if self.error is not None:
                continue
            try:
                while line:
                    line = line[os.write(self.fd, line):]
                self.requests += 1
            except OSError as exc:
                self.error = exc.strerror
                log.error("access trace %s: %s; recording no more", self.path, exc)

    def stop(self) -> dict:
        try:
            self._flush(None)
        finally:
            os.close(self.fd)
        return self.status()

    def status(self) -> dict:
        return {"file": self.path, "requests": self.requests, "blocks": len(self.ids),
                "seconds": round(self.clock() - self.started, 1), "error": self.error}
