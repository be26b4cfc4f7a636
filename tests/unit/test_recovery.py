"""What a mount makes of the tiers a crashed daemon left: SIGKILL of a daemon that ran the
test's script (`Tiers.crash`), at a crash point or after the script, with or without the
DRAM tier lost too (a reboot), then a mount of the same directories (ChunkStore's recovery:
its load, the shadows of chunks written over since their last write-back, orphans)."""

from __future__ import annotations

import errno
import os

import pytest

CHUNK = 64 << 10


async def fsck_clean(tiers) -> None:
    code, report = tiers.fsck()
    assert code == 0, report


async def test_a_clean_unmount_writes_everything_back(tiers):
    files = {f"f{i}": os.urandom(i * CHUNK + 7) for i in range(4)}
    async with tiers.mount() as kv:
        for name, data in files.items():
            await kv.write_file(name, data)
    await fsck_clean(tiers)
    tiers.lose_dram()
    async with tiers.mount() as kv:
        for name, data in files.items():
            assert await kv.read_file(name) == data
            assert await kv.tiers(name) <= {"nvme", "dram"}


async def test_unsynced_writes_survive_a_crash(tiers):
    """Without fsync, data survives SIGKILL of the daemon: DRAM files and lmdb's commits
    are in the page cache (guarantee 3)."""
    files = {f"f{i}": os.urandom(2 * CHUNK + i) for i in range(5)}
    over = os.urandom(1000)

    async def write(kv) -> None:
        for name, data in files.items():
            await kv.write_file(name, data)
        await kv.write_file("f0", over, at=CHUNK - 500)  # across a chunk's end, in place
        await kv.mkdir("d")
        await kv.rename("f4", "d/f4")

    await tiers.crash(write)
    files["f0"] = files["f0"][:CHUNK - 500] + over + files["f0"][CHUNK + 500:]
    files["d/f4"] = files.pop("f4")
    async with tiers.mount() as kv:
        for name, data in files.items():
            assert await kv.read_file(name) == data
            assert {c["dirty"] for c in await kv.where(name)} == {True}
    await fsck_clean(tiers)


async def test_fsynced_data_survives_a_crash_and_the_loss_of_dram(tiers, caplog):
    """fsync means durable (guarantee 2); what was only in DRAM when it was lost reads as
    EIO, never as zeros."""
    synced, unsynced = os.urandom(3 * CHUNK), os.urandom(2 * CHUNK)

    async def write(kv) -> None:
        await kv.write_file("synced", synced, fsync=True)
        await kv.write_file("unsynced", unsynced)

    await tiers.crash(write)
    tiers.lose_dram()
    async with tiers.mount() as kv:
        assert await kv.read_file("synced") == synced
        assert await kv.size("unsynced") == len(unsynced)
        assert [c["lost"] for c in await kv.where("unsynced")] == [True, True]
        fh = await kv.open("unsynced")
        assert await kv.errno_of(kv.ops.read(fh, 0, 10)) == errno.EIO
        assert await kv.errno_of(kv.ops.read(fh, CHUNK, 10)) == errno.EIO
        await kv.release(fh)
    assert "was only in DRAM, which is gone" in caplog.text
    code, report = tiers.fsck()
    assert code == 0 and "2 lost" in report


async def test_fsynced_bytes_come_back_after_a_write_over_them_and_the_loss_of_dram(tiers):
    """A chunk written over in DRAM keeps its written-back record as a shadow until the new
    bytes are written back: a reboot before that takes it back to the fsynced bytes."""
    data = os.urandom(3 * CHUNK)

    async def write(kv) -> None:
        await kv.write_file("f", data, fsync=True)
        await kv.write_file("f", b"unsynced" * 100, at=CHUNK + 10)

    await tiers.crash(write)
    tiers.lose_dram()
    async with tiers.mount() as kv:
        assert await kv.read_file("f") == data
    await fsck_clean(tiers)


async def test_fsynced_bytes_survive_a_write_past_their_end_and_the_loss_of_dram(tiers):
    """A write past the end of an fsynced short chunk, lost with DRAM: the chunk goes back
    to its fsynced bytes, and the write's bytes read as EIO, never as zeros."""
    data = os.urandom(CHUNK + 100)

    async def write(kv) -> None:
        await kv.write_file("f", data, fsync=True)
        await kv.write_file("f", b"x" * 10, at=CHUNK + 1000)

    await tiers.crash(write)
    tiers.lose_dram()
    async with tiers.mount() as kv:
        assert await kv.size("f") == CHUNK + 1010
        fh = await kv.open("f")
        assert await kv.read(fh, 0, CHUNK + 100) == data
        assert await kv.errno_of(kv.ops.read(fh, CHUNK + 1000, 10)) == errno.EIO
        await kv.release(fh)


@pytest.mark.parametrize("kept", [0, 4464], ids=["a hole chunk", "past a chunk's end"])
async def test_fsynced_zeros_survive_a_write_after_them_a_close_and_the_loss_of_dram(tiers,
                                                                                      kept):
    """Zeros an fsync made durable (a file grown by truncate past its chunk's end) are data
    too: a later write after them, lost with DRAM, takes the chunk back to its shadow (or
    its hole) up to the file's end before the write, also after the seal at the writer's
    close (which once lowered the shadow's extent to 0: the whole chunk EIO)."""
    async with tiers.mount() as kv:
        fh = await kv.create("f")
        await kv.write(fh, 0, b"a" * (CHUNK + kept if kept else 1000))
        await kv.truncate("f", CHUNK + 13175)
        await kv.fsync(fh)
        await kv.release(fh)

    async def write(kv) -> None:
        await kv.write_file("f", b"b" * 5000, at=CHUNK + 13175)  # and closed: sealed

    await tiers.crash(write)
    tiers.lose_dram()
    async with tiers.mount() as kv:
        fh = await kv.open("f")
        assert await kv.read(fh, CHUNK, 13175) == b"a" * kept + bytes(13175 - kept)
        await kv.release(fh)


async def test_fsynced_bytes_come_back_cut_after_a_truncation_and_the_loss_of_dram(tiers):
    data = os.urandom(2 * CHUNK)

    async def write(kv) -> None:
        await kv.write_file("f", data, fsync=True)
        await kv.truncate("f", CHUNK + 50)

    await tiers.crash(write)
    tiers.lose_dram()
    async with tiers.mount() as kv:
        assert await kv.read_file("f") == data[:CHUNK + 50]
        await kv.truncate("f", 2 * CHUNK)  # what the truncation cut off never comes back
        assert await kv.read_file("f") == data[:CHUNK + 50] + bytes(CHUNK - 50)
    await fsck_clean(tiers)


@pytest.mark.parametrize("how", ["O_TRUNC", "ftruncate"])
@pytest.mark.parametrize("tier", ["dram", "nvme"])
async def test_a_crash_right_after_a_truncation_leaves_no_zeros(tiers, how, tier):
    """The chunks a truncation removes and the file's new size are one commit: a crash just
    after it leaves the file truncated, never at its old size with its bytes gone (issue
    33, defect 1)."""
    data = os.urandom(3 * CHUNK + 3)
    async with tiers.mount() as kv:
        await kv.write_file("f", data, fsync=True)
    if tier == "nvme":
        tiers.lose_dram()

    async def truncate(kv) -> None:
        if how == "O_TRUNC":
            await kv.open("f", os.O_WRONLY | os.O_TRUNC)
        else:
            await kv.truncate("f", 0)

    await tiers.crash(truncate, crash_at="truncated")
    async with tiers.mount() as kv:
        assert await kv.read_file("f") in (data, b"")
        assert await kv.where("f") == []
    await fsck_clean(tiers)


@pytest.mark.parametrize("grows", [False, True])
async def test_a_crash_between_the_pieces_of_a_write_leaves_whole_pieces(tiers, grows):
    """Each chunk's piece of a write is its own commit, the file's size riding along: a
    crash between two leaves the first written and the file no longer than what it
    holds."""
    old = os.urandom(3 * CHUNK)
    new = os.urandom(3 * CHUNK)
    if not grows:
        async with tiers.mount() as kv:
            await kv.write_file("f", old)

    async def write(kv) -> None:
        await kv.write_file("f", new)

    await tiers.crash(write, crash_at="write.piece")
    async with tiers.mount() as kv:
        expected = new[:CHUNK] if grows else new[:CHUNK] + old[CHUNK:]
        assert await kv.read_file("f") == expected
    await fsck_clean(tiers)


@pytest.mark.parametrize("dram", ["kept", "lost"])
async def test_a_file_the_kernel_was_writing_keeps_what_was_there(tiers, dram):
    """A file the kernel was writing straight into its DRAM file when the daemon died
    (passthrough; here the test writes it) is, at the next mount, what its DRAM file holds;
    with DRAM lost, what its last fsync took, never zeros."""
    synced, later = os.urandom(CHUNK + 100), os.urandom(2 * CHUNK)

    async def write(kv) -> None:
        await kv.release(await kv.create("s"))
        ino = await kv.lookup("s")
        fd = kv.store.start_kernel_write(ino, 4 * CHUNK)
        os.pwrite(fd, synced, 0)
        await kv.store.take_kernel_written(ino, done=False, on_commit=kv.sized(ino))
        await kv.store.fsync(ino, len(synced))
        os.pwrite(fd, later, CHUNK + 100)

    await tiers.crash(write)
    if dram == "lost":
        tiers.lose_dram()
    async with tiers.mount() as kv:
        assert await kv.read_file("s") == (synced + later if dram == "kept" else synced)
    await fsck_clean(tiers)


async def test_a_file_unlinked_while_open_is_freed_by_the_next_mount(tiers):
    async def write(kv) -> None:
        await kv.write_file("keep", b"k" * CHUNK)
        await kv.write_file("gone", os.urandom(4 * CHUNK), fsync=True)
        await kv.open("gone")
        await kv.unlink("gone")

    await tiers.crash(write)
    async with tiers.mount() as kv:
        assert sorted(i.ino for i in kv.ns.inodes.values() if i.is_reg) == [
            await kv.lookup("keep")]
        st = await kv.status()
        assert st["tiers"]["nvme"]["chunks"] == 0 and st["tiers"]["dram"]["chunks"] == 1
    await fsck_clean(tiers)


async def test_a_dram_file_missing_at_mount_costs_only_its_own_chunks(tiers, caplog):
    files = {name: os.urandom(2 * CHUNK) for name in ("a", "dirty", "clean")}

    async def write(kv) -> None:
        for name, data in files.items():
            await kv.write_file(name, data, fsync=name == "clean")
        for name in ("dirty", "clean"):
            (tiers.dram_dir / "files" / f"{await kv.lookup(name):x}").unlink()

    await tiers.crash(write)
    async with tiers.mount() as kv:
        assert await kv.read_file("a") == files["a"]
        assert await kv.read_file("clean") == files["clean"]  # from its NVMe copy
        assert await kv.errno_of(kv.read_file("dirty")) == errno.EIO
    assert "its DRAM file is missing" in caplog.text


@pytest.mark.parametrize("point", ["written", "committed", "moved", "synced"])
async def test_a_crash_at_each_step_of_a_cleaning_pass_loses_nothing(tiers, monkeypatch, point):
    """A segment is freed only after its live records are durable elsewhere: a crash at
    any step of its cleaning leaves every file readable (crash points gc.*)."""
    files = {f"f{i}": os.urandom(200 << 10) for i in range(12)}

    async def clean(kv) -> None:
        for name, data in files.items():
            await kv.write_file(name, data, fsync=True)
        for name in list(files)[::2]:
            await kv.unlink(name)
        await kv.demote_all()
        while await kv.asm.cleaner.clean_one("urgent"):
            pass

    assert not await tiers.crash(clean, crash_at=f"gc.{point}", prefetch=False)
    for name in list(files)[::2]:
        del files[name]
    tiers.lose_dram()
    async with tiers.mount() as kv:
        for name, data in files.items():
            assert await kv.read_file(name) == data
    await fsck_clean(tiers)
