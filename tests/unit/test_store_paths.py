"""The chunk store's paths, driven through the operations (as the kernel's requests would)
and through its own public methods (as the demoter, readahead and the cleaner call them):
writes, DRAM hits, NVMe fetches and their promotion, read-through with read-ahead,
write-back and demotion, prefetch and staging, fsync, truncation, punched holes,
fallocate, packed DRAM copies, a full NVMe tier, cleaning, and the store on its own."""

from __future__ import annotations

import errno
import os

import trio

from kvfs.fs import FALLOC_FL_KEEP_SIZE
from kvfs.store.chunkstore import ChunkStore
from kvfs.store.codec import Codec, CodecPolicy
from kvfs.store.meta import MetaStore
from kvfs.tiering import DramPolicy

CHUNK = 64 << 10


async def until(condition) -> None:
    """Wait until *condition()* (awaited) is true: background tasks (a promotion) finish
    when they finish; the test's deadline bounds the wait."""
    while not await condition():
        await trio.sleep(0.01)


async def on_nvme_only(tiers, files: dict[str, bytes], **options) -> None:
    """Write *files*, then unmount (writing everything back) and lose the DRAM tier: the
    next mount has them on NVMe only."""
    async with tiers.mount(**options) as kv:
        for name, data in files.items():
            await kv.write_file(name, data)
    tiers.lose_dram()


async def test_reads_of_dram_copies_are_dram_hits(tiers):
    async with tiers.mount(prefetch=False) as kv:
        data = os.urandom(3 * CHUNK + 10)
        await kv.write_file("f", data)
        before = (await kv.status())["reads"]
        assert await kv.read_file("f") == data
        after = (await kv.status())["reads"]
        assert after["chunks_from_dram"] - before["chunks_from_dram"] == 4
        assert after["chunks_from_nvme"] == before["chunks_from_nvme"]
        assert after["dram_checked_chunks"] == before["dram_checked_chunks"]  # hashed as written


async def test_writeback_keeps_a_clean_copy_and_demotion_drops_it(tiers):
    async with tiers.mount(prefetch=False) as kv:
        data = os.urandom(2 * CHUNK)
        await kv.write_file("f", data)
        assert [c["dirty"] for c in await kv.where("f")] == [True, True]
        fh = await kv.open("f", os.O_RDWR)
        await kv.fsync(fh)
        await kv.release(fh)
        assert all(c["tiers"] == ["dram", "nvme"] and not c["dirty"] for c in await kv.where("f"))
        await kv.demote_all()
        assert await kv.tiers("f") == {"nvme"}
        before = (await kv.status())["reads"]["chunks_from_nvme"]
        assert await kv.read_file("f") == data
        st = await kv.status()
        assert st["reads"]["chunks_from_nvme"] == before + 2
        assert st["moves"]["promotions"] == 2  # staged on the way: DRAM had room
        assert await kv.tiers("f") == {"dram", "nvme"}


async def test_demotion_writes_back_dirty_chunks_and_keeps_the_newest_bytes(tiers):
    async with tiers.mount(prefetch=False) as kv:
        ino = await kv.write_file("f", os.urandom(4 * CHUNK))
        newer = os.urandom(CHUNK)
        fh = await kv.open("f", os.O_RDWR)
        await kv.write(fh, CHUNK, newer)  # a chunk written back, then written over
        await kv.release(fh)
        assert await kv.store.writeback((ino, 1), drop=True)
        await kv.write_file("f", newer[::-1], at=2 * CHUNK)
        await kv.demote_all()
        assert await kv.tiers("f") == {"nvme"}
        got = await kv.read_file("f")
        assert got[CHUNK:2 * CHUNK] == newer and got[2 * CHUNK:3 * CHUNK] == newer[::-1]


async def test_writes_through_a_full_dram_tier_wait_for_demotion(tiers):
    """40 files of 256 KiB through a 4 MiB DRAM tier: the demoter (in the background, as in
    the daemon) makes room, and everything reads back, from either tier."""
    async with tiers.mount() as kv:
        files = {f"f{i}": os.urandom(256 << 10) for i in range(40)}
        for name, data in files.items():
            await kv.write_file(name, data)
        st = await kv.status()
        assert st["tiers"]["dram"]["used_bytes"] <= st["tiers"]["dram"]["capacity_bytes"]
        assert st["tiers"]["nvme"]["chunks"] > 0
        assert {"nvme"} in [await kv.tiers(name) for name in files]
        for name, data in files.items():
            assert await kv.read_file(name) == data


async def test_a_write_into_part_of_an_nvme_chunk_keeps_the_rest(tiers):
    data = os.urandom(3 * CHUNK)
    await on_nvme_only(tiers, {"f": data}, prefetch=False)
    async with tiers.mount(prefetch=False) as kv:
        assert await kv.tiers("f") == {"nvme"}
        fh = await kv.open("f", os.O_RDWR)
        await kv.write(fh, CHUNK + 1000, b"new bytes")
        await kv.release(fh)
        expected = data[:CHUNK + 1000] + b"new bytes" + data[CHUNK + 1009:]
        assert await kv.read_file("f") == expected
        await kv.demote_all()
        assert await kv.read_file("f") == expected


async def test_holes_read_as_zeros_and_hold_nothing(tiers):
    async with tiers.mount() as kv:
        await kv.write_file("f", b"tail", at=5 * CHUNK + 3)
        assert [c["chunk"] for c in await kv.where("f")] == [5]
        assert (await kv.getattr("f")).st_blocks * 512 == 4096
        before = (await kv.status())["reads"]["chunks_from_holes"]
        assert await kv.read_file("f") == bytes(5 * CHUNK + 3) + b"tail"
        assert (await kv.status())["reads"]["chunks_from_holes"] == before + 5


async def test_big_files_are_read_through_ahead_of_the_reader(tiers):
    """A file of read_through_min or more on NVMe is read through the daemon, chunks ahead
    of a sequential reader in memory, not staged in DRAM; a chunk read a second time is
    promoted (in the background)."""
    data = os.urandom(16 * CHUNK)
    await on_nvme_only(tiers, {"big": data}, prefetch=False, read_through_min="256K")
    async with tiers.mount(prefetch=False, read_through_min="256K") as kv:
        fh = await kv.open("big")
        got = b"".join([await kv.read(fh, off, CHUNK) for off in range(0, len(data), CHUNK)])
        await kv.release(fh)
        assert got == data
        reads = (await kv.status())["reads"]
        assert reads["read_through_buffered_chunks"] > 0
        assert reads["read_through_buffer_used_chunks"] > 0
        assert reads["chunks_from_nvme"] == 16
        assert await kv.tiers("big") == {"nvme"}  # nothing staged by the first read
        assert await kv.read_file("big") == data

        async def promoted() -> bool:
            return "dram" in await kv.tiers("big")

        await until(promoted)


async def test_prefetch_stages_a_chunk_that_its_read_then_finds_in_dram(tiers):
    data = os.urandom(2 * CHUNK)
    await on_nvme_only(tiers, {"f": data}, prefetch=False)
    async with tiers.mount(prefetch=False) as kv:
        ino = await kv.lookup("f")
        assert await kv.store.prefetch(ino, 1) is True
        assert await kv.store.prefetch(ino, 1) is None  # in DRAM already
        assert [c["tiers"] for c in await kv.where("f")] == [["nvme"], ["dram", "nvme"]]
        before = (await kv.status())["reads"]
        assert await kv.read_file("f") == data
        st = await kv.status()
        assert st["reads"]["chunks_from_dram"] == before["chunks_from_dram"] + 1
        assert st["reads"]["chunks_from_nvme"] == before["chunks_from_nvme"] + 1
        assert st["prefetch"]["used_chunks"] == 1


async def test_a_file_is_staged_whole_for_an_open(tiers):
    data = os.urandom(5 * CHUNK + 1)
    await on_nvme_only(tiers, {"f": data}, prefetch=False)
    async with tiers.mount(prefetch=False) as kv:
        ino = await kv.lookup("f")
        assert await kv.store.stage_file(ino, len(data)) == 6
        assert await kv.tiers("f") == {"dram", "nvme"}
        assert await kv.store.passthrough_ready(ino, len(data))
        assert await kv.store.stage_file(ino, len(data)) == 0
        assert await kv.read_file("f") == data


async def test_what_the_kernel_writes_into_a_dram_file_is_taken_as_the_file(tiers):
    """A file the kernel writes straight into its DRAM file (FUSE passthrough; here the
    test writes it): an fsync takes its bytes so far and makes them durable, the last
    close takes the rest; chunks the file no longer holds go."""
    async with tiers.mount(prefetch=False) as kv:
        await kv.release(await kv.create("s"))
        ino = await kv.lookup("s")
        fd = kv.store.start_kernel_write(ino, 4 * CHUNK)
        first = os.urandom(2 * CHUNK + 10)
        os.pwrite(fd, first, 0)
        assert await kv.store.take_kernel_written(ino, done=False, on_commit=kv.sized(ino)) == \
            len(first)
        await kv.store.fsync(ino, len(first))
        assert [c["dirty"] for c in await kv.where("s")] == [False, False, False]
        rest = os.urandom(CHUNK)
        os.pwrite(fd, rest, 4 * CHUNK)  # a hole at chunk 3 (chunk 2 still ends at 10)
        size = await kv.store.take_kernel_written(ino, done=True, on_commit=kv.sized(ino))
        assert size == 5 * CHUNK and await kv.size("s") == size
        assert [c["chunk"] for c in await kv.where("s")] == [0, 1, 2, 4]
        assert await kv.read_file("s") == first + bytes(2 * CHUNK - 10) + rest
        # chunks 0 and 1 kept what the fsync recorded; 2 grew (zeros past its 10 bytes)
        assert (await kv.status())["passthrough"]["written_chunks"] == 3 + 2


async def test_fsync_writes_back_every_dirty_chunk(tiers):
    async with tiers.mount() as kv:
        fh = await kv.create("f")
        await kv.write(fh, 0, os.urandom(3 * CHUNK))
        await kv.write(fh, 10 * CHUNK, b"far")
        await kv.fsync(fh)
        await kv.release(fh)
        chunks = await kv.where("f")
        assert [c["chunk"] for c in chunks] == [0, 1, 2, 10]
        assert not any(c["dirty"] for c in chunks)
        assert (await kv.status())["tiers"]["dram"]["dirty_bytes"] == 0


async def test_truncating_an_nvme_file_cuts_its_last_chunk(tiers):
    data = os.urandom(4 * CHUNK)
    await on_nvme_only(tiers, {"f": data}, prefetch=False)
    async with tiers.mount(prefetch=False) as kv:
        await kv.truncate("f", CHUNK + 100)
        assert [c["chunk"] for c in await kv.where("f")] == [0, 1]
        await kv.truncate("f", 3 * CHUNK)
        assert await kv.read_file("f") == data[:CHUNK + 100] + bytes(2 * CHUNK - 100)
        assert (await kv.status())["tiers"]["nvme"]["chunks"] <= 2


async def test_punched_holes_read_as_zeros_and_keep_the_size(tiers):
    """fallocate(PUNCH_HOLE): chunks wholly inside go, the ones cut are zeroed there, in
    DRAM and on NVMe alike."""
    data = os.urandom(6 * CHUNK)
    await on_nvme_only(tiers, {"nvme": data}, prefetch=False)
    async with tiers.mount(prefetch=False) as kv:
        await kv.write_file("dram", data)
        for name in ("nvme", "dram"):
            ino = await kv.lookup(name)
            await kv.ops.punch_hole(ino, CHUNK + 10, 3 * CHUNK)  # into chunk 1, to 4
            assert await kv.size(name) == len(data)
            expected = data[:CHUNK + 10] + bytes(3 * CHUNK) + data[4 * CHUNK + 10:]
            assert await kv.read_file(name) == expected, name
            assert [c["chunk"] for c in await kv.where(name)] == [0, 1, 4, 5]
        ino = await kv.lookup("dram")  # the store's own call: past the end changes nothing
        await kv.store.punch(ino, 5 * CHUNK, 10 * CHUNK, len(data))
        assert await kv.read_file("dram") == expected[:5 * CHUNK] + bytes(CHUNK)
        assert [c["chunk"] for c in await kv.where("dram")] == [0, 1, 4]


async def test_fallocate_reserves_room(tiers):
    async with tiers.mount() as kv:
        fh = await kv.create("f")
        ino = await kv.lookup("f")
        free = (await kv.ops.statfs(kv.ctx)).f_bavail
        assert kv.ops.fallocate_sync(ino, FALLOC_FL_KEEP_SIZE, 0, 4 * CHUNK, fh) == 0
        assert await kv.size("f") == 0 and (await kv.getattr("f")).st_blocks == 4 * CHUNK // 512
        assert kv.ops.fallocate_sync(ino, 0, 4 * CHUNK, 4 * CHUNK, fh) == 0
        assert await kv.size("f") == 8 * CHUNK
        assert free - (await kv.ops.statfs(kv.ctx)).f_bavail == 8 * CHUNK // 4096
        await kv.write(fh, 0, os.urandom(CHUNK))  # into reserved room: nothing more taken
        assert free - (await kv.ops.statfs(kv.ctx)).f_bavail == 8 * CHUNK // 4096
        assert kv.ops.fallocate_sync(ino, 0x10, 0, CHUNK, fh) == errno.EOPNOTSUPP  # ZERO_RANGE
        assert kv.ops.fallocate_sync(ino, 0, -1, CHUNK, fh) == errno.EINVAL
        assert kv.ops.fallocate_sync(ino, 0, 0, 1 << 40, fh) == errno.ENOSPC
        assert kv.ops.fallocate_sync(1, 0, 0, CHUNK, fh) == errno.EISDIR
        await kv.release(fh)
        await kv.truncate("f", 0)  # what is left of the reservation goes with the file's end
        assert (await kv.ops.statfs(kv.ctx)).f_bavail == free


async def test_fallocate_of_a_range_reserved_already_takes_nothing_more(tiers):
    """It once reserved the same holes again at every call (counting bytes, not ranges)."""
    async with tiers.mount() as kv:
        fh = await kv.create("f")
        ino = await kv.lookup("f")
        assert kv.ops.fallocate_sync(ino, 0, 0, 4 * CHUNK, fh) == 0
        assert kv.ops.fallocate_sync(ino, 0, 0, 4 * CHUNK, fh) == 0
        assert (await kv.getattr("f")).st_blocks == 4 * CHUNK // 512  # as on ext4 and tmpfs
        assert kv.ops.fallocate_sync(ino, 0, CHUNK // 2, CHUNK, fh) == 0  # inside: nothing
        assert kv.ops.fallocate_sync(ino, 0, 3 * CHUNK, 2 * CHUNK, fh) == 0  # one more chunk
        assert (await kv.getattr("f")).st_blocks == 5 * CHUNK // 512
        reserved = (await kv.status())["tiers"]["nvme"]
        await kv.write_file("f", b"x" * CHUNK, at=0)  # into the reservation: no more used
        assert (await kv.status())["tiers"]["nvme"]["used_bytes"] == reserved["used_bytes"]
        await kv.release(fh)


async def test_packed_dram_copies_read_and_take_writes(tiers, kv_bytes):
    """dram_compress: a clean DRAM copy is kept as its compressed record; reads decode it, a
    write drops it first."""
    data = kv_bytes(3 * CHUNK)
    async with tiers.mount(dram_compress=True, prefetch=False) as kv:
        await kv.write_file("f", data, fsync=True)
        assert [c["packed"] for c in await kv.where("f")] == [True, True, True]
        assert (await kv.status())["tiers"]["dram"]["used_bytes"] < len(data)
        assert await kv.read_file("f") == data
        assert (await kv.status())["reads"]["chunks_unpacked"] == 3
        await kv.write_file("f", b"x" * 100, at=CHUNK + 5)
        expected = data[:CHUNK + 5] + b"x" * 100 + data[CHUNK + 105:]
        assert await kv.read_file("f") == expected
        assert [c["packed"] for c in await kv.where("f")] == [True, False, True]
    async with tiers.mount(dram_compress=True, prefetch=False) as kv:
        assert await kv.read_file("f") == expected


async def test_a_full_nvme_tier_is_enospc_and_keeps_what_was_stored(tiers):
    async with tiers.mount(nvme_size="24M") as kv:
        stored = {}
        for i in range(100):
            data = os.urandom(512 << 10)
            try:
                await kv.write_file(f"f{i}", data)
            except Exception as exc:
                assert getattr(exc, "errno", None) == errno.ENOSPC, exc
                break
            stored[f"f{i}"] = data
        else:
            raise AssertionError("never full")
        st = await kv.ops.statfs(kv.ctx)
        assert st.f_bavail * st.f_frsize < 1 << 20
        for name, data in stored.items():
            assert await kv.read_file(name) == data
        for name in list(stored)[:10]:
            await kv.unlink(name)
            del stored[name]
        await kv.write_file("after", b"room again" * 1000)  # deleting frees space
    async with tiers.mount(nvme_size="24M") as kv:
        for name, data in stored.items():
            assert await kv.read_file(name) == data


async def test_cache_mode_evicts_whole_cold_files_instead_of_enospc(tiers):
    """(Eviction also asks the kernel to forget the names: pyfuse3 logs that it cannot,
    with no mount.)"""
    async with tiers.mount(nvme_size="24M", cache_mode=True) as kv:
        files = {f"f{i}": os.urandom(512 << 10) for i in range(100)}
        for name, data in files.items():
            await kv.write_file(name, data)
        assert (await kv.status())["evictions"]["files"] > 0
        present = []
        for name, data in files.items():
            try:
                got = await kv.read_file(name)
            except Exception as exc:
                assert exc.errno == errno.ENOENT
                continue
            assert got == data
            present.append(name)
        assert "f99" in present and "f0" not in present


async def test_a_write_in_cache_mode_evicts_and_completes(tiers):
    """A write(2) in cache mode is whole: it evicts cold files for the room it needs, as
    for its first chunk. (A writer that loops on short writes gets there anyway, above;
    one that takes a short write for the end of its block stores it truncated.)"""
    async with tiers.mount(nvme_size="24M", cache_mode=True) as kv:
        for i in range(100):
            fh = await kv.create(f"f{i}")
            assert await kv.write(fh, 0, os.urandom(512 << 10)) == 512 << 10, f"f{i}"
            await kv.release(fh)


async def test_cleaning_moves_live_records_and_frees_segments(tiers):
    async with tiers.mount(prefetch=False) as kv:
        files = {f"f{i}": os.urandom(200 << 10) for i in range(20)}
        for name, data in files.items():
            await kv.write_file(name, data, fsync=True)
        for name in list(files)[::2]:
            await kv.unlink(name)
            del files[name]
        await kv.demote_all()
        segments = (await kv.status())["tiers"]["nvme"]["segments"]
        cleaned = 0
        while await kv.asm.cleaner.clean_one("urgent"):
            cleaned += 1
        assert cleaned and (await kv.status())["tiers"]["nvme"]["segments"] < segments
        for name, data in files.items():
            assert await kv.read_file(name) == data
    tiers.lose_dram()
    async with tiers.mount(prefetch=False) as kv:
        for name, data in files.items():
            assert await kv.read_file(name) == data
    assert tiers.fsck()[0] == 0


async def test_the_store_on_its_own(tiers, kv_bytes):
    """ChunkStore needs nothing above it: a metadata store, a policy, its two directories.
    What it stores is there again when it is opened again, on NVMe once DRAM is lost."""
    def open_store() -> tuple[MetaStore, ChunkStore]:
        meta = MetaStore(str(tiers.nvme_dir / "meta"), map_size=64 << 20)
        sb = meta.load_superblock() or meta.create_superblock(CHUNK, 1 << 20)
        store = ChunkStore(meta, sb["uuid"], chunk_size=CHUNK, dram_dir=str(tiers.dram_dir),
                           dram_size=4 << 20, nvme_dir=str(tiers.nvme_dir), nvme_size=64 << 20,
                           segment_size=1 << 20, codec=Codec(CodecPolicy()), io_threads=2,
                           policy=DramPolicy(64))
        return meta, store

    data = kv_bytes(5 * CHUNK + 77)
    meta, store = open_store()
    try:
        assert await store.write(7, 0, data) == len(data)
        assert bytes(await store.read(7, 0, len(data), len(data))) == data
        await store.seal(7, len(data))
        await store.fsync(7, len(data))
        assert all(c["tiers"] == ["dram", "nvme"] for c in store.where(7, len(data)))
    finally:
        store.close()
        meta.close()
    tiers.lose_dram()
    meta, store = open_store()
    try:
        assert all(c["tiers"] == ["nvme"] for c in store.where(7, len(data)))
        assert bytes(await store.read(7, 0, len(data), len(data))) == data
        assert store.counters.chunks_from_nvme == 6
        await store.truncate(7, len(data), CHUNK + 1)
        assert bytes(await store.read(7, 0, len(data), CHUNK + 1)) == data[:CHUNK + 1]
        store.delete_file(7, CHUNK + 1)
        assert store.where(7, CHUNK + 1) == [] and store.used == 0
    finally:
        store.close()
        meta.close()
