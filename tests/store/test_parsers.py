"""Fuzzing of what kvfs reads back from disk: record headers, segment files, codec payloads,
the superblock, chunk locations and every lmdb table read at mount. A damaged store must give
EIO on the affected data or one clear message at mount (FormatError, naming what is
damaged): never a traceback, a crash or a hang.

The parsers are fuzzed without a mount (hypothesis, fast); a few tests damage an unmounted
store made by a real mount and mount it again."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import subprocess
import uuid
from pathlib import Path

import lmdb
import pytest
import xxhash
from conftest import make_mount
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfs import fsck
from kvfs.assemble import Assembly
from kvfs.config import Settings
from kvfs.namespace import _INODE, parse_inode
from kvfs.store.codec import CODEC_NAMES, Codec, CodecError, CodecPolicy
from kvfs.store.dram import remove_dram_dir
from kvfs.store.fileinfo import MAX_INFO
from kvfs.store.location import LOC, Loc, parse_loc
from kvfs.store.meta import TABLES, FormatError, MetaStore
from kvfs.store.nvme import (
    BLOCK,
    HEADER,
    HEADER_SIZE,
    RECORD_MAGIC,
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    NvmeLog,
    RecordError,
    pack_header,
    record_length,
    unpack_header,
)

CHUNK = 64 << 10
FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
U32, U64 = st.integers(0, (1 << 32) - 1), st.integers(0, (1 << 64) - 1)


def _checked(body: bytes) -> bytes:
    """A 60-byte record header body with its xxh32 check: a header that passes the check."""
    return body + struct.pack("<I", xxhash.xxh32_intdigest(body))


headers = st.builds(
    lambda version, codec, stream, ino, chunk, seq, raw, stored, csum, info: _checked(
        HEADER.pack(RECORD_MAGIC, version, codec, stream, ino, chunk, seq, raw, stored, csum,
                    info)),
    st.sampled_from([1, 1, 1, 0, 2, 2, 3, 0xFFFF]), st.integers(0, 255), st.integers(0, 255),
    U64, U64, U64, U32, st.one_of(st.integers(0, 3 * BLOCK), U32), U64,
    st.one_of(st.just(0), st.integers(0, 2 * BLOCK), U32))


# -- NVMe records and segments ---------------------------------------------------------------
@FUZZ
@given(st.one_of(st.binary(min_size=HEADER_SIZE, max_size=2 * HEADER_SIZE), headers))
def test_record_header_parser(raw):
    try:
        h = unpack_header(raw)
    except RecordError:
        return
    assert pack_header(h) == raw[:HEADER_SIZE]


def _segment(directory: Path, fs_uuid: uuid.UUID, seg_id: int, blocks: list[bytes]) -> None:
    (directory / "segments").mkdir(parents=True, exist_ok=True)
    head = SEGMENT_HEADER.pack(SEGMENT_MAGIC, 1, 0, seg_id, fs_uuid.bytes, 0)
    with open(directory / "segments" / f"seg-{seg_id:08d}.kvs", "wb") as f:
        f.write(head.ljust(BLOCK, b"\0"))
        for block in blocks:
            f.write(block.ljust(BLOCK, b"\0")[:BLOCK])


@settings(FUZZ, max_examples=50)
@given(blocks=st.lists(st.one_of(headers, st.binary(max_size=200)), max_size=6),
       reads=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 4)), max_size=4))
def test_scanning_and_reading_a_damaged_segment(tmp_path_factory, blocks, reads):
    """The cleaner's and fsck's scan of a segment full of garbage and of headers that pass
    their check but lie (about lengths, mostly) ends, and reads anywhere in it either parse
    a record whose payload lies within what was read or fail with RecordError."""
    d = tmp_path_factory.mktemp("seg")
    fs_uuid = uuid.uuid4()
    _segment(d, fs_uuid, 1, blocks)
    log = NvmeLog(str(d), str(fs_uuid), 1 << 30, 1 << 20)
    try:
        found = log.scan(1)
        assert all(off % BLOCK == 0 and off >= BLOCK for off, _ in found)
        seg = log.pin(1)
        for off, length in ((b * BLOCK, n * BLOCK) for b, n in reads):  # (O_DIRECT)
            try:
                header, payload = log.read_record(seg, off, length)
            except RecordError:
                continue
            assert len(payload) == header.stored_len <= length - HEADER_SIZE
        log.unpin(seg)
    finally:
        log.close()


def test_a_segment_whose_header_names_another_is_ignored(tmp_path, caplog):
    """A damaged segment id would otherwise let the file stand for another segment (whose
    records it does not hold) and be unlinked as that one."""
    fs_uuid = uuid.uuid4()
    _segment(tmp_path, fs_uuid, 3, [])
    segments = tmp_path / "segments"
    os.rename(segments / "seg-00000003.kvs", segments / "seg-00000002.kvs")
    with caplog.at_level(logging.WARNING):
        log = NvmeLog(str(tmp_path), str(fs_uuid), 1 << 30, 1 << 20)
    try:
        assert log.segments == {}
        assert "names segment 3" in caplog.text
    finally:
        log.close()


# -- codec payloads --------------------------------------------------------------------------
_codec, _lax = Codec(), Codec(CodecPolicy(verify=False))
_SAMPLE = bytes(range(256)) * 16 + bytes(1000) + b"kv" * 3000


@pytest.fixture(scope="module")
def encoded() -> list[tuple[int, bytes, int]]:
    out = []
    for cid in sorted(CODEC_NAMES):
        used, payload = _codec.encode(_SAMPLE, cid)
        out.append((used, bytes(payload), len(_SAMPLE)))
    return out


@FUZZ
@given(codec=st.integers(-1, 260), payload=st.binary(max_size=300),
       raw_len=st.integers(-1, 1 << 20))
def test_codec_decode_of_garbage(codec, payload, raw_len):
    for c in (_codec, _lax):
        try:
            out = c.decode(codec, payload, raw_len)
        except CodecError:
            continue
        assert len(out) == raw_len


@FUZZ
@given(data=st.data())
def test_codec_decode_of_damaged_payloads(encoded, data):
    """Bytes of real payloads changed, the check word not recomputed (the store decodes with
    verify off: its xxh3 of the decoded bytes is the check), also with a wrong raw_len: the
    right length or CodecError, and never a crash of the native decoders."""
    cid, payload, raw_len = data.draw(st.sampled_from(encoded))
    bad = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(bad) - 1))
        bad[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(bad)))
    length = data.draw(st.sampled_from([raw_len, raw_len - 1, raw_len + 1, 0]))
    for body in (bytes(bad), bytes(bad[:cut])):
        try:
            out = _lax.decode(cid, body, length)
        except CodecError:
            continue
        assert len(out) == length
        if body == payload and length == raw_len:
            assert out == _SAMPLE


# -- metadata values -------------------------------------------------------------------------
@FUZZ
@given(st.one_of(
    st.binary(max_size=200),
    st.dictionaries(st.sampled_from(["magic", "format", "uuid", "chunk_size", "segment_size"]),
                    st.one_of(st.none(), st.integers(-5, 1 << 70), st.text(max_size=40),
                              st.sampled_from(["kvfs", str(uuid.uuid4())]),
                              st.sampled_from([1, 2, 3, 4096, CHUNK, 1 << 20]))
                    ).map(lambda d: json.dumps(d).encode()),
    st.lists(st.integers()).map(lambda v: json.dumps(v).encode())))
def test_superblock_parser(tmp_path_factory, raw):
    meta = MetaStore(str(tmp_path_factory.mktemp("meta")), map_size=1 << 20)
    try:
        with meta.env.begin(write=True, db=meta.db["super"]) as txn:
            txn.put(b"superblock", raw)
        try:
            sb = meta.load_superblock()
        except FormatError:
            return
        # What a mount goes on to use is there.
        uuid.UUID(sb["uuid"])
        assert sb["chunk_size"] > 0 and sb["segment_size"] > 2 * sb["chunk_size"]
    finally:
        meta.env.close()


@FUZZ
@given(st.one_of(st.binary(min_size=LOC.size, max_size=LOC.size),
                 st.tuples(st.integers(-3, 3), st.integers(0, 9), st.integers(0, 5 * BLOCK),
                           U32, st.integers(0, 2 * CHUNK), U32, st.integers(0, 255),
                           st.integers(0, 255), U64, U64).map(lambda t: LOC.pack(*t))))
def test_chunk_location_parser(raw):
    try:
        loc = parse_loc(raw, CHUNK)
    except ValueError:
        return
    assert isinstance(loc, Loc) and loc.raw_len <= CHUNK and loc.dram_slot >= -1
    if loc.seg:
        # (a version 2 record may carry up to MAX_INFO bytes of its file's description)
        assert record_length(loc.stored_len) <= loc.rec_len <= record_length(
            loc.stored_len, MAX_INFO) and loc.rec_len % BLOCK == 0 and loc.off % BLOCK == 0


@FUZZ
@given(key=st.one_of(st.binary(max_size=10), U64.map(lambda n: struct.pack(">Q", n))),
       value=st.one_of(st.binary(max_size=70),
                       st.tuples(U32, U32, U32, U32, U64,
                                 st.one_of(st.sampled_from([1 << 50, 1 << 63, (1 << 64) - 1]),
                                           U64), st.integers(-(1 << 63), -1),
                                 st.integers(0, (1 << 63) - 1), st.integers(-5, 5), U64)
                       .map(lambda t: _INODE.pack(*t))))
def test_inode_parser(key, value):
    """Whatever an inode entry holds, it loads as an inode whose every field a FUSE reply
    can carry, or is refused as damaged (a size past 2^63 made every request about the
    file, a lookup or a readdir of its directory, fail with a traceback)."""
    try:
        inode = parse_inode(key, value)
    except (ValueError, struct.error):
        return
    assert 0 <= inode.size < 1 << 63 and 1 <= inode.ino < 1 << 62


# -- a whole store's metadata, as a mount loads it ---------------------------------------------
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """An unmounted store of a few files: on NVMe and in DRAM, a hard link, a symlink, xattrs,
    a directory, a learned read order."""
    m = make_mount(tmp_path_factory.mktemp("template"))
    m.start()
    try:
        os.mkdir(m.path / "d")
        for i in range(24):
            (m.path / "d" / f"f{i}").write_bytes(os.urandom(200_000))
        (m.path / "small").write_bytes(b"kv" * 300)
        os.setxattr(m.path / "small", "user.kvfs.dtype", b"fp16")
        os.link(m.path / "small", m.path / "hard")
        os.symlink("small", m.path / "sym")
        for i in range(3):
            (m.path / "d" / f"f{i}").read_bytes()
        with open(m.path / "d" / "f23", "r+b") as f:  # a DRAM copy over an NVMe record
            f.seek(5000)
            f.write(b"z" * 1000)
    finally:
        m.unmount()
    yield m
    remove_dram_dir(str(m.dram_dir))


def _copy(m, to: Path) -> tuple[str, str]:
    nvme, dram = to / "nvme", f"/dev/shm/kvfs-test-{uuid.uuid4().hex[:12]}"
    to.mkdir(parents=True)
    for src, dst in ((m.nvme_dir, nvme), (m.dram_dir, dram)):  # (lmdb's file is sparse)
        subprocess.run(["cp", "-a", "--sparse=always", str(src), str(dst)], check=True)
    return str(nvme), dram


def _damage(nvme: str, table: bytes, pick: int, how: str, noise: bytes) -> None:
    env = lmdb.open(os.path.join(nvme, "meta"), max_dbs=len(TABLES))
    try:
        db = env.open_db(table)
        with env.begin(write=True, db=db) as txn:
            keys = [k for k, _ in txn.cursor()]
            key = keys[pick % len(keys)] if keys and pick >= 0 else noise[:9] or b"\1"
            old = txn.get(key) or b""
            new = {"cut": old[:len(old) // 2], "longer": old + noise[:5] + b"\0",
                   "noise": (noise * 64)[:len(old) or 8], "max": b"\xff" * (len(old) or 8),
                   "flip": bytes(b ^ (0x80 if i == pick % max(1, len(old)) else 0)
                                 for i, b in enumerate(old))}[how]
            txn.put(key, new)
    finally:
        env.close()


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(table=st.sampled_from(TABLES), pick=st.integers(-1, 200),
       how=st.sampled_from(["cut", "longer", "noise", "max", "flip"]),
       noise=st.binary(min_size=1, max_size=16))
def test_loading_damaged_metadata(template, tmp_path_factory, table, pick, how, noise):
    """One lmdb value damaged (or a foreign entry added) in any table: fsck reports it
    without a traceback; loading the store either works or stops with one FormatError naming
    the table and key, and what loaded unloads again (its counters still fit their fields)."""
    nvme, dram = _copy(template, tmp_path_factory.mktemp("store") / "s")
    try:
        _damage(nvme, table, pick, how, noise)
        assert fsck.check(nvme, dram, out=lambda line: None) in (0, 4, 8)
        s = Settings(mountpoint="/nonexistent", dram_dir=dram, nvme_dir=nvme, **{
            k: v for k, v in template.options.items()}).resolve()
        try:
            asm = Assembly(s)
        except FormatError as exc:
            assert "damaged" in str(exc) or "format" in str(exc), exc
            return
        asm.close()
    finally:
        remove_dram_dir(dram)


# -- through a mount ---------------------------------------------------------------------------
def _store_of(mount_factory, files: dict[str, bytes]):
    m = mount_factory()
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    m.unmount()
    return m


def _put(m, table: bytes, key: bytes, value: bytes) -> None:
    env = lmdb.open(str(m.nvme_dir / "meta"), max_dbs=len(TABLES))
    try:
        with env.begin(write=True, db=env.open_db(table)) as txn:
            assert txn.get(key) is not None
            txn.put(key, value)
    finally:
        env.close()


def _first_key(m, table: bytes) -> tuple[bytes, bytes]:
    env = lmdb.open(str(m.nvme_dir / "meta"), max_dbs=len(TABLES), readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(table, create=False)) as txn:
            return next(iter(txn.cursor()))
    finally:
        env.close()


def test_a_mount_of_damaged_metadata_says_what_is_damaged(mount_factory):
    m = _store_of(mount_factory, {"a": os.urandom(300_000)})
    key, value = _first_key(m, b"chunks")
    _put(m, b"chunks", key, value[:-3])
    with pytest.raises(RuntimeError) as ei:
        m.start()
    msg = str(ei.value)
    assert "the metadata is damaged: table 'chunks', key " + key.hex() in msg, msg
    assert "Traceback" not in m.log() and "struct.error" not in msg
    _put(m, b"chunks", key, value)  # repaired, it mounts
    m.start()
    assert len((m.path / "a").read_bytes()) == 300_000


def test_a_mount_of_a_damaged_superblock_says_so(mount_factory):
    m = _store_of(mount_factory, {"a": b"x"})
    _put(m, b"super", b"superblock", json.dumps({"magic": "kvfs", "format": 3}).encode())
    with pytest.raises(RuntimeError) as ei:
        m.start()
    assert "the superblock is damaged" in str(ei.value)
    assert "Traceback" not in m.log()


def test_damaged_hints_are_dropped_at_mount(mount_factory):
    """The learned read order is only a hint: a damaged entry costs a prediction, not the
    mount."""
    files = {f"f{i}": os.urandom(100_000) for i in range(4)}
    m = _store_of(mount_factory, files)
    key, value = _first_key(m, b"successors")
    _put(m, b"successors", key, value + b"\0")
    m.start()
    assert "dropped 1 damaged entries of the learned read order" in m.log()
    for name, data in files.items():
        assert (m.path / name).read_bytes() == data


def test_a_segment_with_a_damaged_header_reads_eio(mount_factory):
    """A segment whose header no longer checks out is ignored at mount: the chunks it held
    fail with EIO (never zeros), the rest of the store reads as written."""
    m = mount_factory(dram_size="1M")
    files = {f"f{i}": os.urandom(150_000) for i in range(12)}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    m.unmount()
    m.lose_dram()  # every chunk from NVMe
    segs = sorted((m.nvme_dir / "segments").iterdir())
    with open(segs[0], "r+b") as f:
        f.write(b"XXXX")  # the magic
    m.start()
    eio = 0
    for name, data in files.items():
        try:
            assert (m.path / name).read_bytes() == data, name
        except OSError as exc:
            assert exc.errno == errno.EIO
            eio += 1
    assert 0 < eio < len(files)
    assert "Traceback" not in m.log()


def _locs(m, ino: int) -> dict[bytes, bytes]:
    env = lmdb.open(str(m.nvme_dir / "meta"), max_dbs=len(TABLES), readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
            prefix = struct.pack(">Q", ino)
            return {k: v for k, v in txn.cursor() if k.startswith(prefix)}
    finally:
        env.close()


@pytest.mark.parametrize("lose_dram", [True, False])
def test_a_location_damaged_into_another_reads_eio(mount_factory, lose_dram):
    """A chunk location that is well formed but names another chunk's copy (its record, or
    with the DRAM tier kept, a region holding other bytes under a wrong checksum): the
    chunk reads EIO, never the other chunk's bytes; the other files read as written."""
    m = mount_factory()
    files = {name: os.urandom(3 * CHUNK) for name in ("a", "b", "c")}
    for name, data in files.items():
        (m.path / name).write_bytes(data)
    ino_a, ino_b = os.stat(m.path / "a").st_ino, os.stat(m.path / "b").st_ino
    m.unmount()  # (everything written back to NVMe)
    if lose_dram:
        m.lose_dram()
    ka = sorted(_locs(m, ino_a))[1]
    vb = _locs(m, ino_b)[sorted(_locs(m, ino_b))[1]]
    _put(m, b"chunks", ka, vb)  # a's chunk 1 names b's chunk 1 (its record, seq, checksum)
    m.start()
    with pytest.raises(OSError) as ei:
        (m.path / "a").read_bytes()
    assert ei.value.errno == errno.EIO
    with open(m.path / "a", "rb") as f:  # the undamaged chunks still read
        assert f.read(CHUNK) == files["a"][:CHUNK]
    for name in ("b", "c"):
        assert (m.path / name).read_bytes() == files[name]
    assert "Traceback" not in m.log()
