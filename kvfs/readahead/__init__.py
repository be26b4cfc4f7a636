"""Access prediction and the prefetch scheduler.

The filesystem reports events (a file opened, created, read, closed, forgotten; an explicit
hint); predictors turn them into chunks expected to be read soon; the scheduler stages those
chunks into DRAM through `ChunkStore.prefetch`, under bounded concurrency, demand reads first.

This module holds the interface and the first predictor, whole-file readahead: opening an
NVMe-resident file for reading stages its first chunks in order.
"""

from __future__ import annotations

import logging
import os

import trio

log = logging.getLogger(__name__)


class Readahead:
    """Event sink for the filesystem plus a bounded prefetch queue."""

    def __init__(self, store, *, depth: int) -> None:
        self.store = store
        self.depth = depth  # chunks staged ahead per opened file
        self._send, self._recv = trio.open_memory_channel(4096)

    # -- events from fs (trio thread, must not block) ---------------------------------------
    def opened(self, ino: int, flags: int, size: int, pid: int) -> None:
        if self.depth and flags & os.O_ACCMODE != os.O_WRONLY and size:
            nchunks = (size + self.store.cs - 1) // self.store.cs
            for c in range(min(nchunks, self.depth)):
                self.want(ino, c)

    def created(self, ino: int, parent: int, pid: int) -> None:
        pass

    def read(self, ino: int, off: int, size: int, pid: int) -> None:
        pass

    def closed(self, ino: int, pid: int) -> None:
        pass

    def forgotten(self, ino: int) -> None:
        pass

    def hint(self, ino: int, size: int) -> None:
        """An engine says it will read this file soon (user.kvfs.prefetch)."""
        nchunks = (size + self.store.cs - 1) // self.store.cs
        for c in range(nchunks):
            self.want(ino, c)

    def want(self, ino: int, c: int) -> None:
        loc = self.store.get(ino, c)
        if loc is None or loc.dram_slot >= 0:
            return
        try:
            self._send.send_nowait((ino, c))
        except trio.WouldBlock:
            pass  # queue full: prediction is best effort

    def stats(self) -> dict:
        return {}

    # -- scheduler task --------------------------------------------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            sem = trio.Semaphore(4)
            async for ino, c in self._recv:
                await sem.acquire()
                nursery.start_soon(self._one, ino, c, sem)

    async def _one(self, ino: int, c: int, sem: trio.Semaphore) -> None:
        try:
            await self.store.prefetch(ino, c)
        except Exception:
            log.exception("prefetch of inode %d chunk %d failed", ino, c)
        finally:
            sem.release()
