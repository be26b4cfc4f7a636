"""Python's cycle collector, kept off the request path.

Everything kvfs keeps per file is a container CPython's cycle collector scans: inodes, the
namespace's name sets, the successor graph, the DRAM policy's queues. CPython's automatic
full collection walks all of them on the one trio thread, and every FUSE request waits: at
~33k files in a trace replay a full pass took 100-140 ms (measured with gc.callbacks, 150k
tracked objects), and it grows with the namespace. The young generations are cheap (0.2-4
ms) and find the short-lived cycles that trio and exceptions make.

So the daemon:

- freezes what the mount loaded (`gc.freeze`: never scanned again, still freed by reference
  counting when dropped);
- keeps CPython's young collections, and turns off its automatic full collection;
- every FREEZE_EVERY_S collects the young generations once more and freezes the survivors:
  an O(1) move, no scan of the old ones;
- every FULL_EVERY_S, at a moment when no FUSE request arrived for IDLE_S, unfreezes
  everything and runs one full collection, which reclaims cycles that died after they were
  frozen (few: the automatic full passes above found 0-164 objects each). A mount that is
  never idle gets it anyway after FULL_LATEST_S.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

import trio

log = logging.getLogger(__name__)

FREEZE_EVERY_S = 10.0
FULL_EVERY_S = 3600.0
FULL_LATEST_S = 6 * 3600.0
IDLE_S = 1.0
# Full collections happen when this many young collections have run since the last one:
# never, in practice (CPython has no switch for the oldest generation alone).
NO_FULL_COLLECTIONS = 1 << 30


class CycleCollector:
    """Owns the process's `gc` settings while the daemon runs. *activity* returns a number
    that changes whenever a FUSE request arrives (the request counter of kvfs.fs)."""

    def __init__(self, activity: Callable[[], int]) -> None:
        self.activity = activity
        self.thresholds = gc.get_threshold()
        self.full_collections = 0
        self.full_collected = 0
        self.last_full_ms = 0.0
        # Counted after the install and each full collection only: gc.get_freeze_count()
        # walks the whole frozen list (~15 ms at 30k files), too slow for every status call.
        self.frozen = 0
        self.installed = False

    def install(self) -> None:
        """Freeze what exists now and take over full collections."""
        gc.collect()
        gc.freeze()
        young, middle, _ = self.thresholds
        gc.set_threshold(young, middle, NO_FULL_COLLECTIONS)
        self.installed = True
        self.frozen = gc.get_freeze_count()
        log.debug("cycle collector: %d objects frozen", self.frozen)

    def uninstall(self) -> None:
        if self.installed:
            gc.unfreeze()
            gc.set_threshold(*self.thresholds)
            self.installed = False

    def freeze_young(self) -> None:
        gc.collect(1)
        gc.freeze()

    def collect_all(self) -> int:
        """The one full scan: everything, frozen objects included."""
        start = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        self.last_full_ms = (time.perf_counter() - start) * 1e3
        self.full_collections += 1
        self.full_collected += found
        self.frozen = gc.get_freeze_count()
        log.info("full cycle collection: %d objects reclaimed, %d kept, %.0f ms",
                 found, self.frozen, self.last_full_ms)
        return found

    async def run(self) -> None:
        seen = self.activity()
        now = trio.current_time()
        quiet_since = last_full = last_freeze = now
        while True:
            await trio.sleep(IDLE_S)
            now = trio.current_time()
            count = self.activity()
            if count != seen:
                seen, quiet_since = count, now
            due = now - last_full
            if (due >= FULL_EVERY_S and now - quiet_since >= IDLE_S) or due >= FULL_LATEST_S:
                self.collect_all()
                last_full = last_freeze = now
            elif now - last_freeze >= FREEZE_EVERY_S:
                self.freeze_young()
                last_freeze = now

    def stats(self) -> dict:
        """`python_gc` in `kvfsctl status --json` ("gc" is the NVMe cleaner's);
        frozen_objects as of the last full collection (or the mount)."""
        return {"python_gc": {"frozen_objects": self.frozen,
                              "full_collections": self.full_collections,
                              "full_collected_objects": self.full_collected,
                              "last_full_ms": round(self.last_full_ms, 1)}}
