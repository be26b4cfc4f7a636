"""Damaged copies read as EIO, never as wrong bytes (guarantee 1): NVMe records (payload,
header, another chunk's record where one should be, a truncated or missing segment) and
DRAM copies (raw and packed), on every path that reads them (a read, an open's staging, a
prefetch, a write-back). Files are damaged where docs/FORMAT.md says their bytes are."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvfs.store.nvme import HEADER_SIZE

CHUNK = 64 << 10


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x55]))


async def on_nvme(tiers, data: bytes) -> tuple[Path, list[int], int]:
    """*data* as file "f", on NVMe only (an unmount, then DRAM lost): the segment file that
    holds its records, each chunk's record offset in it, and its inode."""
    async with tiers.mount(prefetch=False) as kv:
        ino = await kv.write_file("f", data)
        await kv.demote_all()
        locs = [kv.store.get(ino, c) for c in range(-(-len(data) // CHUNK))]
    tiers.lose_dram()
    assert len({loc.seg for loc in locs}) == 1
    return tiers.nvme_dir / "segments" / f"seg-{locs[0].seg:08d}.kvs", [
        loc.off for loc in locs], ino


async def read_chunks(kv, n: int) -> list[bytes | int]:
    """Each of file "f"'s first *n* chunks: its bytes, or the errno reading it fails with."""
    fh = await kv.open("f")
    out: list[bytes | int] = []
    for c in range(n):
        try:
            out.append(await kv.read(fh, c * CHUNK, CHUNK))
        except Exception as exc:
            out.append(exc.errno)
    await kv.release(fh)
    return out


def chunks_of(data: bytes) -> list[bytes]:
    return [data[i:i + CHUNK] for i in range(0, len(data), CHUNK)]


@pytest.mark.parametrize("content", ["random", "kv"])
async def test_a_damaged_record_payload_is_eio_for_its_chunk_only(tiers, content, kv_bytes):
    data = os.urandom(3 * CHUNK) if content == "random" else kv_bytes(3 * CHUNK)
    segment, offs, _ = await on_nvme(tiers, data)
    flip(segment, offs[1] + HEADER_SIZE + 100)
    async with tiers.mount(prefetch=False) as kv:
        assert {c["codec"] == 0 for c in await kv.where("f")} == {content == "random"}
        parts = chunks_of(data)
        assert await read_chunks(kv, 3) == [parts[0], errno.EIO, parts[2]]
        assert (await kv.status())["reads"]["checksum_errors"] >= 1
    code, report = tiers.fsck()
    assert code == 4 and "chunk 1" in report


@pytest.mark.parametrize("field", [0, 8, 24, 40, 60], ids=["magic", "inode", "seq",
                                                           "checksum", "header check"])
async def test_a_damaged_record_header_is_eio(tiers, field):
    data = os.urandom(2 * CHUNK)
    segment, offs, _ = await on_nvme(tiers, data)
    flip(segment, offs[0] + field)
    async with tiers.mount(prefetch=False) as kv:
        assert await read_chunks(kv, 2) == [errno.EIO, chunks_of(data)[1]]


async def test_another_chunks_record_where_one_should_be_is_eio(tiers):
    data = os.urandom(3 * CHUNK)
    segment, offs, _ = await on_nvme(tiers, data)
    raw = bytearray(segment.read_bytes())
    length = offs[2] - offs[1]
    raw[offs[1]:offs[2]] = raw[offs[2]:offs[2] + length]  # chunk 2's record, intact
    segment.write_bytes(bytes(raw))
    async with tiers.mount(prefetch=False) as kv:
        parts = chunks_of(data)
        assert await read_chunks(kv, 3) == [parts[0], errno.EIO, parts[2]]


async def test_a_truncated_segment_is_eio_past_its_end(tiers):
    data = os.urandom(3 * CHUNK)
    segment, offs, _ = await on_nvme(tiers, data)
    os.truncate(segment, offs[2] + HEADER_SIZE + 10)
    async with tiers.mount(prefetch=False) as kv:
        parts = chunks_of(data)
        assert await read_chunks(kv, 3) == [parts[0], parts[1], errno.EIO]


async def test_a_missing_segment_loses_only_its_chunks(tiers, caplog):
    segment, _, _ = await on_nvme(tiers, os.urandom(2 * CHUNK))
    async with tiers.mount(prefetch=False) as kv:
        await kv.write_file("other", b"elsewhere", fsync=True)
        assert segment.name != f"seg-{(await kv.where('other'))[0]['segment']:08d}.kvs"
    tiers.lose_dram()
    segment.unlink()
    async with tiers.mount(prefetch=False) as kv:
        assert await read_chunks(kv, 2) == [errno.EIO, errno.EIO]
        assert [c["lost"] for c in await kv.where("f")] == [True, True]
        assert await kv.read_file("other") == b"elsewhere"
    assert "is missing: its chunks are lost" in caplog.text


async def test_staging_or_prefetching_a_damaged_record_stages_nothing(tiers):
    data = os.urandom(2 * CHUNK)
    segment, offs, ino = await on_nvme(tiers, data)
    flip(segment, offs[1] + HEADER_SIZE + 5)
    async with tiers.mount(prefetch=False) as kv:
        assert await kv.store.prefetch(ino, 1) is False
        assert await kv.store.stage_file(ino, len(data)) == -1  # the open reads it itself
        assert [c["tiers"] for c in await kv.where("f")] == [["dram", "nvme"], ["nvme"]]
        assert await read_chunks(kv, 2) == [chunks_of(data)[0], errno.EIO]


async def test_a_damaged_dram_copy_is_eio_at_its_first_read_after_a_restart(tiers):
    """dram_verify=once: a restart checks every DRAM copy at its first read, dirty ones
    (their only copy) and clean ones alike."""
    data = os.urandom(3 * CHUNK)

    async def write(kv) -> None:
        await kv.write_file("f", data)
        fh = await kv.open("f", os.O_RDWR)
        await kv.ops.fsync(fh, False)  # chunk 0 is clean, the others dirty
        await kv.write(fh, CHUNK, data[CHUNK:])
        await kv.release(fh)

    await tiers.crash(write)
    ino_file = next((tiers.dram_dir / "files").iterdir())
    flip(ino_file, 10)
    flip(ino_file, 2 * CHUNK + 10)
    async with tiers.mount(prefetch=False) as kv:
        assert [c["dirty"] for c in await kv.where("f")] == [False, True, True]
        assert await read_chunks(kv, 3) == [errno.EIO, data[CHUNK:2 * CHUNK], errno.EIO]
        assert (await kv.status())["reads"]["checksum_errors"] == 2
    code, report = tiers.fsck()
    assert code == 4 and "chunk 0" in report and "chunk 2" in report


async def test_dram_verify_open_finds_damage_done_while_mounted(tiers):
    data = os.urandom(2 * CHUNK)
    async with tiers.mount(dram_verify="open") as kv:
        ino = await kv.write_file("f", data)
        assert await kv.read_file("f") == data
        flip(tiers.dram_dir / "files" / f"{ino:x}", CHUNK + 7)
        assert await read_chunks(kv, 2) == [data[:CHUNK], errno.EIO]


async def test_a_damaged_packed_copy_is_eio(tiers, kv_bytes):
    data = kv_bytes(2 * CHUNK)
    async with tiers.mount(dram_compress=True, prefetch=False) as kv:
        ino = await kv.write_file("f", data, fsync=True)
        assert [c["packed"] for c in await kv.where("f")] == [True, True]
        flip(tiers.dram_dir / "files" / f"{ino:x}", 100)
        assert await read_chunks(kv, 2) == [errno.EIO, data[CHUNK:]]


async def test_a_dram_copy_that_no_longer_matches_its_checksum_is_not_written_back(tiers,
                                                                                 caplog):
    """Damage to a sealed dirty DRAM copy is found by its write-back, which refuses to make
    those bytes durable: the chunk stays dirty (the unmount says it could not write it
    back), and its first read after a restart is EIO. (Until then this daemon trusts the
    copy it hashed, as the page cache is trusted: dram_verify=once.)"""
    data = os.urandom(2 * CHUNK)
    async with tiers.mount(prefetch=False) as kv:
        ino = await kv.write_file("f", data)
        flip(tiers.dram_dir / "files" / f"{ino:x}", 5)
        assert await kv.store.writeback((ino, 0), drop=True) is False
        assert await kv.store.writeback((ino, 1), drop=True) is True
        assert [c["dirty"] for c in await kv.where("f")] == [True, False]
        assert "does not match its checksum; not written back" in caplog.text
    assert kv.asm.left_in_dram == CHUNK
    async with tiers.mount(prefetch=False) as kv:
        assert await read_chunks(kv, 2) == [errno.EIO, data[CHUNK:]]
