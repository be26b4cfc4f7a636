"""Segment cleaning: space comes back, nothing is lost or corrupted, accounting adds up, a
victim is freed only after its live records are committed (and durable) elsewhere, and a crash
in the middle of a cleaning pass loses nothing. Through a real mount, and in process (a
ChunkStore + Cleaner without FUSE) where the order of events has to be checked exactly."""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import trio

from kvfs.store import gc as gcmod
from kvfs.store.chunkstore import ChunkStore
from kvfs.store.codec import Codec, CodecPolicy
from kvfs.store.events import StoreEvents
from kvfs.store.gc import Cleaner
from kvfs.store.location import LOC, Loc, NoSpace
from kvfs.store.meta import MetaStore, from_key2
from kvfs.store.nvme import BLOCK
from kvfs.store.room import Room
from kvfs.store.streams import StreamTable
from kvfs.tiering import DramPolicy

SMALL_NVME = {"dram_size": "2M", "nvme_size": "16M", "segment_size": "1M"}


def _churn(m, rounds: int, seed: int, live: dict[str, bytes]) -> None:
    """Per-request blocks come and go; a few long-lived ones stay; some are overwritten."""
    rng = random.Random(seed)
    for i in range(rounds):
        name = f"r{seed}_{i}"
        data = rng.randbytes(rng.choice([64 << 10, 128 << 10, 256 << 10]))
        (m.path / name).write_bytes(data)
        live[name] = data
        if len(live) > 24:
            victim = rng.choice(sorted(live))
            os.unlink(m.path / victim)
            del live[victim]
        if i % 7 == 0 and live:
            target = rng.choice(sorted(live))
            patch = rng.randbytes(1000)
            off = rng.randrange(0, len(live[target]) - 1000)
            with open(m.path / target, "r+b") as f:
                f.seek(off)
                f.write(patch)
            b = bytearray(live[target])
            b[off:off + 1000] = patch
            live[target] = bytes(b)


def _verify(m, live: dict[str, bytes]) -> None:
    for name, data in live.items():
        assert (m.path / name).read_bytes() == data, name


def test_a_tier_too_small_for_its_streams_has_no_capacity(mount_factory):
    """4 segments: the cleaner's reserve and the streams' open segments take them all.
    statvfs says 0 (it failed with EIO: a negative capacity), and writes get ENOSPC."""
    m = mount_factory(nvme_size="4M", segment_size="1M", dram_size="1M")
    sv = os.statvfs(m.path)
    assert sv.f_blocks == sv.f_bavail == 0
    with pytest.raises(OSError) as ei:
        (m.path / "f").write_bytes(bytes(100_000))
    assert ei.value.errno == errno.ENOSPC


def test_churn_reclaims_space_and_keeps_data(mount_factory):
    m = mount_factory(**SMALL_NVME)
    live: dict[str, bytes] = {}
    _churn(m, 250, 1, live)  # ~40 MiB written through a 16 MiB NVMe tier
    _verify(m, live)
    st = m.status()
    g = st["gc"]
    assert g["user_bytes_written"] > 16 << 20
    assert g["write_amplification"] >= 1.0
    assert g["write_amplification"] == round(
        (g["user_bytes_written"] + g["gc_bytes_written"]) / g["user_bytes_written"], 4)
    assert st["tiers"]["nvme"]["segments"] <= 16
    m.unmount()
    m.start()
    _verify(m, live)


def test_crash_during_cleaning_loses_nothing(mount_factory):
    m = mount_factory(**SMALL_NVME)
    live: dict[str, bytes] = {}
    _churn(m, 150, 2, live)
    m.kill()  # cleaning and demotion are busy at this point
    m.start()
    _verify(m, live)
    _churn(m, 100, 3, live)
    _verify(m, live)
    assert m.status()["reads"]["checksum_errors"] == 0


def _churn_until_crash(m, live: dict[str, bytes], uncertain: set[str], seed: int) -> bool:
    """Like _churn, until the daemon dies; an operation cut short by the crash makes its
    file uncertain (either outcome is correct). True if the daemon died."""
    rng = random.Random(seed)
    for i in range(3000):
        name = f"c{seed}_{i}"
        op = name
        try:
            data = rng.randbytes(rng.choice([64 << 10, 128 << 10, 256 << 10]))
            (m.path / name).write_bytes(data)
            live[name] = data
            if len(live) > 40:  # ~6 MiB live in a 9 MiB store: the cleaner has to work
                op = rng.choice(sorted(live))
                os.unlink(m.path / op)
                del live[op]
            if i % 5 == 0:
                op = rng.choice(sorted(live))
                patch = rng.randbytes(1000)
                off = rng.randrange(0, len(live[op]) - 1000)
                with open(m.path / op, "r+b") as f:
                    f.seek(off)
                    f.write(patch)
                b = bytearray(live[op])
                b[off:off + 1000] = patch
                live[op] = bytes(b)
        except OSError:
            uncertain.add(op)
            live.pop(op, None)
            return True
    return False


@pytest.mark.parametrize("point", ["written", "committed", "moved", "synced"])
def test_crash_at_each_step_of_a_cleaning_pass(mount_factory, monkeypatch, point):
    """SIGKILL of the daemon after a copy is written but not committed, after it is committed
    but the victim not yet freed, after all of a victim's records moved but before they are
    synced, and after the sync but before the unlink: nothing is lost, nothing is corrupt."""
    m = mount_factory(start=False, **SMALL_NVME)
    m.start(crash_at=f"gc.{point}:3")
    pid = m.pid()
    live: dict[str, bytes] = {}
    uncertain: set[str] = set()
    assert _churn_until_crash(m, live, uncertain, 7), "the cleaner never reached " + point
    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        raise AssertionError("the daemon did not die")
    assert f"crash point gc.{point} reached" in m.log()
    subprocess.run(["fusermount3", "-u", "-z", str(m.path)], capture_output=True)
    m.start()
    _verify(m, live)
    for name in uncertain:  # whatever it holds, it reads without error
        try:
            (m.path / name).read_bytes()
        except FileNotFoundError:
            pass
    assert m.status()["reads"]["checksum_errors"] == 0
    _churn(m, 60, 8, live)  # and cleaning goes on normally afterwards
    _verify(m, live)
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0, r.stdout + r.stderr

# -- in-process store: exact checks of the cleaner's ordering and accounting ------------------

CS = 16 << 10  # chunk
SEG = 256 << 10  # segment: 12 records of one chunk


class _Events(StoreEvents):
    """Placement by inode (every third file long-lived), cleaning when NVMe is full."""

    def __init__(self, rig) -> None:
        self.rig = rig

    def stream_of(self, ino: int) -> int:
        return self.rig.table.route[self.rig.classes[ino % 3]]

    async def make_nvme_room(self) -> bool:
        return self.rig.cleaner is not None and await self.rig.cleaner.make_room()


class Harness:
    """A ChunkStore + Cleaner without FUSE (opened inside trio.run)."""

    def __init__(self, tmp_path: Path, streams: int = 4, nvme_size: int = 8 << 20) -> None:
        self.nvme_dir = str(tmp_path / "nvme")
        self.dram_dir = f"/dev/shm/kvfs-gctest-{uuid.uuid4().hex[:10]}"
        self.streams = streams
        self.nvme_size = nvme_size
        self.uuid = None
        self.classes = ("long", "short", "short")  # by inode number modulo 3
        self.data: dict[tuple[int, int], bytes] = {}  # (ino, chunk) -> bytes it must hold

    def open(self) -> None:
        self.meta = MetaStore(os.path.join(self.nvme_dir, "meta"))
        sb = self.meta.load_superblock() or self.meta.create_superblock(CS, SEG)
        self.table = StreamTable.make(self.streams)
        self.cleaner = None
        self.store = ChunkStore(self.meta, sb["uuid"], chunk_size=CS, dram_dir=self.dram_dir,
                                dram_size=64 * CS, nvme_dir=self.nvme_dir,
                                nvme_size=self.nvme_size, segment_size=SEG,
                                codec=Codec(CodecPolicy(enabled=False)), io_threads=2,
                                policy=DramPolicy(64), events=_Events(self))
        self.store.nvme.stream_hints = dict(enumerate(self.table.hints))
        self.cleaner = Cleaner(self.store, self.table)

    def close(self) -> None:
        self.store.close()
        self.meta.close()

    def cleanup(self) -> None:
        shutil.rmtree(self.dram_dir, ignore_errors=True)

    async def put(self, ino: int, data: bytes) -> None:
        """Write one chunk-sized file and push it to NVMe."""
        await self.store.write(ino, 0, data)
        self.data[(ino, 0)] = data
        await self.store.writeback((ino, 0), drop=True)

    def delete(self, ino: int) -> None:
        self.store.delete_file(ino, CS)
        del self.data[(ino, 0)]

    async def verify(self) -> None:
        for (ino, c), data in self.data.items():
            got = await self.store.read(ino, c * CS, len(data), c * CS + len(data))
            assert bytes(got) == data, (ino, c)


@pytest.fixture
def harness(tmp_path):
    h = Harness(tmp_path)
    yield h
    h.cleanup()


def _committed_locations(meta, table: str = "chunks") -> dict[tuple[int, int], Loc]:
    out = {}
    with meta.env.begin(db=meta.db[table]) as txn:  # a fresh reader sees committed state only
        for k, v in txn.cursor():
            out[from_key2(k)] = Loc._make(LOC.unpack(v[:LOC.size]))  # (shadows: + a U32)
    return out


def test_victim_freed_only_after_copies_committed_and_durable(harness, monkeypatch):
    h = harness
    events: list[tuple] = []
    real_unlink, real_fdatasync = os.unlink, os.fdatasync

    def unlink(path, *a, **k):
        if str(path).endswith(".kvs"):
            seg = int(os.path.basename(path)[4:12])
            named = [key for key, loc in _committed_locations(h.meta).items() if loc.seg == seg]
            assert not named, f"segment {seg} unlinked while {named} still point into it"
            events.append(("unlink", seg))
        return real_unlink(path, *a, **k)

    def fdatasync(fd):
        events.append(("fdatasync", fd))
        return real_fdatasync(fd)

    async def main():
        h.open()
        real_relocated = h.store.relocated
        real_meta_sync = h.meta.sync

        def relocated(ino, c, old, seg, off, rec_len):
            real_relocated(ino, c, old, seg, off, rec_len)
            events.append(("relocated", old.seg, seg))

        def meta_sync():
            events.append(("meta_sync",))
            real_meta_sync()

        h.store.relocated = relocated
        h.meta.sync = meta_sync
        rng = random.Random(5)
        for ino in range(1, 121):
            await h.put(ino, rng.randbytes(CS))
        for ino in range(2, 121, 2):
            h.delete(ino)  # every segment is now about half dead
        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "fdatasync", fdatasync)
        cleaned = 0
        while await h.cleaner.clean_one("urgent"):
            cleaned += 1
            if cleaned > 20:
                break
        monkeypatch.undo()
        assert h.cleaner.records_moved > 0
        await h.verify()
        h.close()

    trio.run(main)
    # Every unlink of a segment that had records moved out comes after: the last relocation
    # out of it, then fdatasync of a destination and an lmdb sync.
    victims = {e[1] for e in events if e[0] == "relocated"}
    assert victims
    for seg in victims:
        i_unlink = events.index(("unlink", seg))
        last_move = max(i for i, e in enumerate(events) if e[0] == "relocated" and e[1] == seg)
        between = events[last_move:i_unlink]
        i_sync = max(i for i, e in enumerate(between) if e == ("meta_sync",))
        assert any(e[0] == "fdatasync" for e in between[:i_sync]), seg
    # and it survives a reopen (the relocations were committed)
    async def again():
        h.open()
        await h.verify()
        h.close()

    trio.run(again)


def test_gc_never_loses_or_corrupts_under_concurrent_churn(harness):
    """Writes, overwrites, deletes and writebacks race with cleaning of the same segments."""
    h = harness

    async def main():
        h.open()
        rng = random.Random(11)
        live: set[int] = set()
        next_ino = 1

        async def cleaner():
            while True:
                await h.cleaner.clean_one("urgent")
                await trio.sleep(0.001)

        async with trio.open_nursery() as n:
            n.start_soon(cleaner)
            for step in range(1500):
                r = rng.random()
                if r < 0.45 or len(live) < 20:
                    ino = next_ino
                    next_ino += 1
                    await h.put(ino, rng.randbytes(rng.choice([CS, CS // 2, 5000])))
                    live.add(ino)
                elif r < 0.8:
                    ino = rng.choice(sorted(live))
                    h.delete(ino)
                    live.discard(ino)
                else:  # overwrite in place (the NVMe copy dies, a new one is written)
                    ino = rng.choice(sorted(live))
                    old = h.data[(ino, 0)]
                    patch = rng.randbytes(100)
                    off = rng.randrange(0, len(old) - 100)
                    await h.store.write(ino, off, patch)
                    h.data[(ino, 0)] = old[:off] + patch + old[off + 100:]
                    if rng.random() < 0.7:
                        await h.store.writeback((ino, 0), drop=True)
                if step % 100 == 0:
                    await h.verify()
            n.cancel_scope.cancel()
        assert h.cleaner.records_moved > 50, h.cleaner.records_moved
        await h.verify()
        _check_accounting(h)
        h.close()

    trio.run(main)

    async def again():
        h.open()
        await h.verify()
        h.close()

    trio.run(again)


def _check_accounting(h: Harness) -> None:
    store, nvme = h.store, h.store.nvme
    k = store.counters
    st = store.stats()
    extra = h.cleaner.stats()
    streams = extra["streams"].values()
    assert sum(s["user_bytes_written"] for s in streams) == k.user_bytes_written
    assert sum(s["gc_bytes_written"] for s in streams) == k.gc_bytes_written
    assert sum(s["gc_bytes_copied_out"] for s in streams) == k.gc_bytes_written
    assert nvme.bytes_written == k.user_bytes_written + k.gc_bytes_written
    for s in streams:
        if s["user_bytes_written"]:
            assert s["write_amplification"] == round(
                (s["user_bytes_written"] + s["gc_bytes_copied_out"]) / s["user_bytes_written"],
                4)
    assert st["gc"]["write_amplification"] == round(
        (k.user_bytes_written + k.gc_bytes_written) / k.user_bytes_written, 4)
    # live bytes: per segment == the committed locations naming it (chunks' and shadows':
    # a record written over in DRAM stays live until the new bytes are written back);
    # in total == nvme_live
    by_seg: dict[int, int] = {}
    shadows = _committed_locations(h.meta, "shadows")
    assert shadows == store.shadows
    for loc in [*_committed_locations(h.meta).values(), *shadows.values()]:
        if loc.seg:
            by_seg[loc.seg] = by_seg.get(loc.seg, 0) + loc.rec_len
    for seg in nvme.segments.values():
        assert seg.live_bytes == by_seg.get(seg.seg_id, 0), seg.seg_id
        assert 0 <= seg.live_bytes <= seg.write_off - BLOCK
    assert set(by_seg) <= set(nvme.segments)
    assert sum(s["live_bytes"] for s in streams) == store.nvme_live
    listed = extra["gc"]["segments"]
    assert sum(x[2] for x in listed) == store.nvme_live
    assert sum(x[2] + x[3] for x in listed) == sum(
        s.write_off - BLOCK for s in nvme.segments.values())


def test_accounting_adds_up_in_process(harness):
    h = harness

    async def main():
        h.open()
        rng = random.Random(3)
        for ino in range(1, 200):
            await h.put(ino, rng.randbytes(CS))
            if ino > 40 and rng.random() < 0.8:
                victim = rng.choice([i for (i, _) in h.data if i != ino])
                h.delete(victim)
            if ino % 10 == 0:
                await h.cleaner.clean_one("urgent")
        assert h.store.counters.gc_bytes_written > 0
        _check_accounting(h)
        h.close()

    trio.run(main)


def test_tier_takes_what_its_capacity_promises(harness):
    """Filled to the capacity statvfs reports, with deaths scattered everywhere and three
    user streams each holding an open segment, the tier takes every write the capacity
    check lets through: no ENOSPC below the capacity (the capacity counted the room that
    each stream's open segment holds back, and a writer gave up on cleaning that was
    making progress, only slowly: ENOSPC at ~88% of it)."""
    h = harness
    h.classes = ("long", "short", "medium")

    async def main():
        h.open()
        rng = random.Random(5)
        ino = 0
        for _ in range(h.nvme_size // CS):
            while h.store.used + CS > h.store.capacity:
                h.delete(rng.choice(list(h.data))[0])
            ino += 1
            await h.put(ino, rng.randbytes(CS))
        await h.verify()
        h.close()

    trio.run(main)


def test_capacity_leaves_out_the_open_segments(harness):
    """Streams whose open segments hold only dead records (their files died before the
    segment filled): those segments come back only when their streams write again, or
    once sealed as idle. Meanwhile the tier still takes everything statvfs reports."""
    h = harness
    h.classes = ("long", "short", "medium")

    async def main():
        h.open()
        rng = random.Random(6)
        per_segment = h.store.nvme.usable(CS) // (CS + BLOCK)
        for ino in (*range(3, 3 * per_segment, 3), *range(2, 3 * per_segment - 1, 3)):
            await h.put(ino, rng.randbytes(CS))  # long and medium: all but the last record
            h.delete(ino)
        ino = 1
        while h.store.used + CS <= h.store.capacity:
            await h.put(ino, rng.randbytes(CS))  # short
            ino += 3
        await h.verify()
        h.close()

    trio.run(main)


def test_writer_waits_for_slow_cleaning_rather_than_enospc(harness, monkeypatch):
    """A tier full of segments that each hold one dead record: every victim nets one
    record's room, so a writer needs a dozen cleaning passes before a segment is free.
    It gets them (it used to give up after 8 and get ENOSPC)."""
    h = harness
    h.classes = ("short", "short", "short")
    monkeypatch.setattr(Room, "capacity", property(lambda self: 1 << 40))  # the tier decides

    async def main():
        h.open()
        rng = random.Random(7)
        ino = 1
        while True:
            try:
                await h.put(ino, rng.randbytes(CS))
            except NoSpace:
                h.delete(ino)  # (its bytes never left DRAM)
                break
            ino += 1
        nvme = h.store.nvme
        open_ids = {s.seg_id for s in nvme.open_segment.values()}
        one_per_segment = {loc.seg: k[0] for k in h.data
                           if (loc := h.store.get(*k)).seg not in open_ids}
        for dead in one_per_segment.values():
            h.delete(dead)
        await h.put(ino, rng.randbytes(CS))
        assert h.cleaner.segments_cleaned > 8
        await h.verify()
        h.close()

    trio.run(main)


def test_copies_of_short_records_go_back_to_the_short_stream(harness):
    """The cleaner copies a record of a file of the short class (by hint or as learned) to
    the short stream, not among the survivors in `gc` (it dies soon: there it would leave
    holes to clean around again); records of other classes go to `gc`."""
    h = harness
    h.classes = ("long", "short", "short")

    async def main():
        h.open()
        h.cleaner.class_of = lambda ino: h.classes[ino % 3]
        rng = random.Random(8)
        for ino in range(1, 61):
            await h.put(ino, rng.randbytes(CS))
        for ino in range(1, 61, 2):
            h.delete(ino)
        nvme, route = h.store.nvme, h.table.route
        while await h.cleaner.clean_one("urgent"):
            pass  # (ends: full segments are no victims, though their ends are unused)
        assert h.cleaner.records_moved > 0
        for (ino, c) in h.data:
            stream = nvme.segments[h.store.get(ino, c).seg].stream
            assert stream == (route["short"] if h.classes[ino % 3] == "short" else route["gc"]) \
                or stream == route[h.classes[ino % 3]]  # not moved
        moved_short = nvme.counters(route["short"]).gc_bytes_in
        assert moved_short > 0 and nvme.counters(route["gc"]).gc_bytes_in > 0
        await h.verify()
        h.close()

    trio.run(main)


def test_cost_benefit_prefers_empty_and_old(harness):
    h = harness

    async def main():
        h.open()
        rng = random.Random(1)
        for ino in range(1, 73):  # 6 segments of stream "short" (ino % 3 != 0) and "long"
            await h.put(ino, rng.randbytes(CS))
        nvme = h.store.nvme
        segs = sorted(nvme.segments.values(), key=lambda s: s.seg_id)
        open_ids = {s.seg_id for s in nvme.open_segment.values()}
        sealed = [s for s in segs if s.seg_id not in open_ids]
        assert len(sealed) >= 3
        old, young = sealed[0], sealed[-1]
        # same live share: the older one wins; much emptier young one beats a fuller old one
        old.live_bytes = young.live_bytes = SEG // 2
        for s in sealed[1:-1]:
            s.live_bytes = SEG
        assert h.cleaner.pick_victim() is old
        young.live_bytes = 0
        assert h.cleaner.pick_victim() is young
        young.hold = 1  # being cleaned: never picked twice
        assert h.cleaner.pick_victim() is old
        young.hold = 0
        for s in segs:
            s.live_bytes = SEG
        assert h.cleaner.pick_victim() is None  # nothing to gain anywhere
        for s in segs:  # full: the unused end of each holds no record of a whole chunk
            s.live_bytes = nvme.usable(CS)
        assert nvme.usable(CS) < 0.95 * SEG and h.cleaner.pick_victim() is None
        assert all(h.cleaner.pick_victim() is not s for s in nvme.open_segment.values())

    trio.run(main)


def test_cleaning_on_demand_and_pacing(harness, monkeypatch):
    """The cleaner waits until a user stream would find no segment beyond the reserve (by
    then more of every victim has died); no cleaning ahead of need on watermarks (it used to
    keep 5-6 of 32 segments free), except cheap victims in idle time."""
    h = harness

    async def main():
        h.open()
        c = h.cleaner
        nvme = h.store.nvme
        c.idle_after = 1000
        assert c.urgent_mark == nvme.gc_reserved
        monkeypatch.setattr(nvme, "free_segments", lambda: c.urgent_mark)
        assert c.mode() == "urgent"
        for free in (c.urgent_mark + 1, c.urgent_mark + 3, nvme.max_segments // 8):
            monkeypatch.setattr(nvme, "free_segments", lambda free=free: free)
            assert c.mode() is None
        c.idle_after = 0
        c._idle()
        monkeypatch.setattr(nvme, "free_segments", lambda: 0.2 * nvme.max_segments)
        assert c.mode() == "idle"
        # pacing: 10 x 64 KiB at 1 MiB/s takes about 0.6 s (50 ms of credit)
        t0 = trio.current_time()
        for _ in range(10):
            await c._pace(64 << 10, 1 << 20)
        assert trio.current_time() - t0 >= 0.5
        # foreground first: a demand read in flight holds the cleaner back (bounded)
        h.store.fetches._fetching[(999, 0)] = trio.Event()
        t0 = trio.current_time()
        await c._foreground_first("idle")
        waited = trio.current_time() - t0
        assert gcmod.FOREGROUND_WAIT * 0.9 <= waited < 1.0
        del h.store.fetches._fetching[(999, 0)]

    trio.run(main)


def test_idle_open_segment_is_sealed_and_reclaimed(harness):
    h = harness

    async def main():
        h.open()
        rng = random.Random(2)
        await h.put(3, rng.randbytes(CS))  # ino % 3 == 0: the "long" stream
        long_seg = h.store.nvme.open_segment[h.table.route["long"]]
        h.delete(3)
        c = h.cleaner
        c.seal_idle_open_segments()
        ino = 1
        while h.store.nvme.bytes_written < 0.3 * h.store.nvme.capacity:
            await h.put(ino, rng.randbytes(CS))  # short stream only
            h.delete(ino)
            ino += 2 if ino % 3 == 2 else 1  # never a multiple of 3 (the "long" stream)
            c.seal_idle_open_segments()
        assert long_seg.deleted  # sealed, and with nothing live in it: unlinked

    trio.run(main)


def test_fetch_with_a_stale_location_changes_nothing(harness):
    """A fetch whose Loc was read before an await, and which another fetch has since made
    resident, returns None and leaves the DRAM copy alone (it used to stage over it: over
    a packed copy, that made the chunk unreadable)."""
    h = harness

    async def main():
        h.open()
        data = random.Random(7).randbytes(CS)
        await h.put(1, data)
        stale = h.store.get(1, 0)
        assert stale.dram_slot < 0
        assert await h.store.fetch(1, 0, stale, stage=float(h.store.dram.capacity),
                                   want=False)
        now = h.store.get(1, 0)
        assert now.dram_slot >= 0
        filling = h.store.dram_filling
        assert await h.store.fetch(1, 0, stale, stage=float(h.store.dram.capacity)) is None
        assert h.store.get(1, 0) == now and h.store.dram_filling == filling
        await h.verify()
        h.close()

    trio.run(main)
