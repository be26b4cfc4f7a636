"""Room: what the store may still take (its capacity, as the NVMe tier sets it, and what is
used of it), fallocate reservations, and the DRAM tier's room: a write that needs more waits
for the demoter to make some (`wait_dram`), and a promotion takes only what is free.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import trio

from kvfs.store.dram import pages
from kvfs.store.episode import Episode
from kvfs.store.location import NoSpace
from kvfs.store.readthrough import PROMOTE_SHARE

if TYPE_CHECKING:
    from kvfs.store.chunkstore import ChunkStore

# A write waiting for room in DRAM (the demoter writing chunks back to make it) gives up
# with ENOSPC after this long in all.
DRAM_WAIT_S = 60.0
# While writing back fails for want of room, the demoter tries again this often (not at
# every kick: each try costs a compression and a failed write), and a write needing DRAM
# room meanwhile gets ENOSPC at once; after that long it waits for the next try.
FULL_RETRY_S = 1.0


class Room:
    """The store's and the DRAM tier's room, and the writes waiting for it."""

    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.meta = store.meta
        self.dram = store.dram
        self.nvme = store.nvme
        self.chunks = store.chunks
        self.cs = store.cs
        self.space_waiters = 0
        self._space = trio.Event()
        self.dram_pinned_full = Episode("DRAM tier full of files open in passthrough mode")

    @property
    def capacity(self) -> int:
        """Record bytes the files may hold: what the NVMe tier's segments hold (as many as
        nvme_size allows, or fewer while the filesystem below has no room for them: it may
        be shared, or smaller), less the room kept free so that cleaning always has
        somewhere to copy to (its reserved segments and 5%), and less one segment per
        stream: each stream holds an open segment that its records alone fill, however
        little of it they use, and whose dead records wait for it to fill up before they
        can be reclaimed. None at all on a tier of too few segments for that."""
        nvme = self.nvme
        per_segment = nvme.usable(self.cs)
        tier = nvme.max_segments * per_segment
        return max(0, tier - (nvme.gc_reserved + nvme.open_streams) * per_segment - tier // 20)

    @property
    def used(self) -> int:
        return self._counted + (self.store.kernel.unseen_bytes() if self.store.kernel.files
                                else 0)

    @property
    def _counted(self) -> int:
        """`used` less what files the kernel is writing hold unseen."""
        return self.chunks.nvme_live + self.chunks.unbacked + self.chunks.reserved

    def fits(self, need: int) -> bool:
        """used + *need* <= capacity? The exact `used` fstats every file the kernel is
        writing (tens of microseconds each, at every create and write); first a bound of
        what they hold unseen: at most all the RAM their tmpfs holds (one statvfs). Only
        when that bound leaves too little room is the exact sum taken, so the answer is
        always the exact one."""
        room = self.capacity - need - self._counted
        if room < 0:
            return False
        if not self.store.kernel.files:
            return True
        st = os.statvfs(self.dram.files_dir)
        # f_blocks 0: a tmpfs of no size limit, which reports no usage either
        if st.f_blocks and (st.f_blocks - st.f_bfree) * st.f_frsize <= room:
            return True
        self.store.counters.unseen_sums += 1
        return self.store.kernel.unseen_bytes() <= room

    def check_capacity(self, growth: int, ino: int) -> None:
        if growth > 0 and ino in self.chunks.allocated:
            # fallocate()d room is already counted
            growth -= min(growth, self.chunks.reservation(ino))
        if growth > 0 and (self.meta.room_low or not self.fits(growth)):
            raise NoSpace()

    def check_room(self) -> None:
        """NoSpace if the metadata has no room to grow (a create, a link, an xattr would
        need some): see kvfs.store.meta, META_STEP."""
        if self.meta.room_low:
            raise NoSpace()

    def allocate(self, ino: int, offset: int, length: int) -> None:
        """fallocate(mode 0): reserve room for the holes in [offset, offset+length) so that
        writes there cannot fail with ENOSPC. Raises NoSpace if it does not fit."""
        cs = self.cs
        holes = dict(self.chunks.allocated_holes.get(ino, {}))
        missing = 0
        for c in range(offset // cs, (offset + length + cs - 1) // cs):
            if self.chunks.index.get(ino, c) is None:
                lo = max(offset, c * cs) - c * cs
                hi = min(offset + length, (c + 1) * cs) - c * cs
                had = holes.get(c)
                if had is not None:  # reserved before: only what the hull grows by
                    missing -= had[1] - had[0]
                    lo, hi = min(lo, had[0]), max(hi, had[1])
                missing += hi - lo
                holes[c] = (lo, hi)
        if not missing:
            return
        missing = pages(missing)
        if not self.fits(missing):
            raise NoSpace()
        self.chunks.set_allocated(ino, max(self.chunks.allocated.get(ino, 0),
                                           self.chunks.file_bytes.get(ino, 0)) + missing,
                                  holes)

    def notify_space(self) -> None:
        self._space.set()
        self._space = trio.Event()

    async def wait_dram(self, growth: int) -> bool:
        """Wait until the DRAM tier has room for *growth* more bytes. True: there is none,
        but the bytes may go over the tier's size (nothing could ever make room for them);
        NoSpace at once while nothing can leave it (the NVMe tier is full), or after
        DRAM_WAIT_S in all."""
        deadline = trio.current_time() + DRAM_WAIT_S
        while self.dram_load + growth > self.dram.capacity:
            if not self._drop_one_clean():
                if self.chunks.dram_chunks == 0:
                    return True  # a single write bigger than DRAM: let it through
                if self.store.nvme_full.met_within(FULL_RETRY_S):
                    raise NoSpace()  # nothing leaves DRAM: at once, not after a wait
                if self.dram_pinned_full.met_within(FULL_RETRY_S):
                    return True  # nothing can leave it (see `nothing_leaves`)
                self.space_waiters += 1
                try:
                    self.store.events.dram_filling()
                    with trio.move_on_at(deadline) as waited:
                        await self._space.wait()
                finally:
                    self.space_waiters -= 1
                if waited.cancelled_caught:
                    raise NoSpace()
        return False

    def nothing_leaves(self) -> None:
        """The demoter found nothing it may take out of a full DRAM tier: every chunk left
        belongs to a file the kernel reads or writes straight from its DRAM file
        (passthrough; adopted writers may grow such a file past PASSTHROUGH_SHARE). Writes
        waiting for room go over the tier's size for a while instead of waiting for good."""
        self.dram_pinned_full.failed(
            f"{self.chunks.dram_used >> 20} MiB in DRAM, all of it held by files open in "
            f"passthrough mode: writes go over the tier's {self.dram.capacity >> 20} MiB")
        self.notify_space()

    def _drop_one_clean(self) -> bool:
        key = self.store.policy.coldest()
        if key is not None and self.chunks.is_clean(key) and not self.store.policy.keep(key):
            self.store.drop_dram_copy(key)
            return True
        return False  # dirty, wanted by readahead or far: the demoter keeps eviction order

    @property
    def dram_load(self) -> int:
        """DRAM bytes in use: chunks' pages, regions that NVMe reads are filling and the room
        promised to files the kernel is writing (their bytes are counted when taken)."""
        return self.chunks.dram_used + self.store.fetches.filling + self.store.kernel.promised

    def promotion_room(self, nbytes: int, limit: float | None = None) -> bool:
        """May a promotion take *nbytes* of DRAM (below *limit* bytes, default 90%) without
        evicting anything?"""
        cap = self.dram.capacity * PROMOTE_SHARE if limit is None else limit
        return self.dram_load + nbytes <= cap
