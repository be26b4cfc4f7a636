"""The lmdb environment: superblock, tables and their key/value layouts.

All metadata lives in one lmdb environment under `<nvme_dir>/meta`. It is opened with
writemap and without sync: a commit lands in the shared page cache, so it survives SIGKILL of
the daemon (invariant 3) at the cost of a few microseconds; `sync()` makes everything durable
(fsync, invariant 2). Layouts (all integers big-endian in keys so that lmdb orders them):

    super     b"superblock"               -> JSON {"format": FORMAT_VERSION, "chunk_size", ...}
    inodes    ino:u64                    -> INODE (see namespace.Inode)
    dirents   parent:u64 + name          -> ino:u64
    symlinks  ino:u64                    -> target bytes
    xattrs    ino:u64 + name             -> value
    chunks    ino:u64 + chunk:u64        -> LOC (the 10 fields of a chunk location, see store.loc)
    counters  name                       -> u64 (next inode number, next sequence number, ...)
    alloc     ino:u64                    -> u64 bytes reserved by fallocate(mode 0)
    successors ino:u64                   -> succ:u64 + kind:u8 (readahead's learned order)

Write transactions are only ever opened on the trio thread, so they never contend.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import lmdb

from kvfs.store.episode import Episode
from kvfs.store.osutil import fallocate

log = logging.getLogger(__name__)

# lmdb writes through a shared mapping of its file (writemap), and a page of it that the
# filesystem below cannot back (it is full) is a SIGBUS: the daemon would die. So the file
# grows only into blocks reserved ahead of it, a step at a time (`reserve`: 1-32 MiB, by
# the tier's size); when less than half a step is left and the next cannot be had (or the
# map's end is near), `room_low` turns on and the store refuses what would grow the
# metadata (creates, writes: ENOSPC) while what is left lets deletions, truncations and
# write-backs go on. Checked every META_CHECK_EVERY commits (~5 us each).
META_CHECK_EVERY = 8

# Format 2 adds the PACKED chunk flag; format 3 moves DRAM copies from one arena file of
# slots to one file per inode; format 4 keeps the inode flag DENSE (kvfs.namespace), which
# files made before it lack (docs/FORMAT.md); format 5 writes version 2 records (each carries
# its file's description, for `fsck.kvfs --rebuild`), which a version without it cannot
# read or move. Older formats are migrated at mount.
FORMAT_VERSION = 5
READABLE_FORMATS = (1, 2, 3, 4, 5)
_U64 = struct.Struct(">Q")
_KEY2 = struct.Struct(">QQ")
T = TypeVar("T")
# Counters (inode and sequence numbers) grow by one per use: one near 2^64 is damage, and
# would overflow its u64 field at the next commit.
COUNTER_MAX = 1 << 62
TABLES = (b"super", b"inodes", b"dirents", b"symlinks", b"xattrs", b"chunks", b"counters",
          b"alloc", b"successors", b"writers", b"shadows")


class FormatError(Exception):
    """The metadata on disk is not something this version of kvfs can open."""


def u64(n: int) -> bytes:
    return _U64.pack(n)


def from_u64(b: bytes) -> int:
    return _U64.unpack(b)[0]


def key2(a: int, b: int) -> bytes:
    return _KEY2.pack(a, b)


def from_key2(b: bytes) -> tuple[int, int]:
    return _KEY2.unpack(b)


class MetaStore:
    """Owns the lmdb environment. Tables are attributes named after the table."""

    def __init__(self, path: str, *, map_size: int = 1 << 36, reserve: int = 0) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        # 64 GiB of address space is only a ceiling; the file grows as it is used.
        self.env = lmdb.open(path, map_size=map_size, max_dbs=len(TABLES), writemap=True,
                             sync=False, metasync=False, map_async=False, readahead=False,
                             lock=True, subdir=True)
        self.map_size = self.env.info()["map_size"]  # (never less than what is used)
        self.db = {name.decode(): self.env.open_db(name) for name in TABLES}
        self._txn: lmdb.Transaction | None = None
        self._after: list = []
        # Runs after each commit's after_commit functions (the DRAM tier frees the regions
        # they released, all at once).
        self.on_settled = lambda: None
        # Blocks reserved for the file to grow into, *reserve* bytes at a time (a mounted
        # store; fsck only reads). See META_CHECK_EVERY.
        self.room = Episode(f"metadata in {path}: no room to grow")
        self._file = os.open(os.path.join(path, "data.mdb"), os.O_RDWR) if reserve else None
        self._step = reserve
        self._psize = self.env.stat()["psize"]
        self._reserved = 0
        self._commits = 0
        if reserve:
            self._reserve()

    @property
    def room_low(self) -> bool:
        """Is the metadata out of room to grow (see META_CHECK_EVERY)?"""
        return self.room.on

    def _in_use(self) -> int:
        """Bytes of the map holding data (pages lmdb freed are reused before the file
        grows; it never shrinks)."""
        with self.env.begin() as txn:
            pages = 2  # the meta pages
            for db in (None, *self.db.values()):
                st = txn.stat(db) if db is not None else self.env.stat()
                pages += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        return pages * self._psize

    def _reserve(self) -> None:
        """Reserve the next step of the file once less than half a step is left ahead of
        what lmdb uses."""
        low = self._step // 2
        used = (self.env.info()["last_pgno"] + 1) * self._psize
        if used + low > self.map_size:  # the file reached the map's end: freed pages serve
            if (in_use := self._in_use()) + low > self.map_size:
                self.room.failed(f"{in_use >> 20} MiB used of a {self.map_size >> 20} MiB "
                                 f"map (meta_size)")
            else:
                self.room.over()
            return
        if used + low <= self._reserved:
            self.room.over()
            return
        start = max(self._reserved, used)
        try:
            fallocate(self._file, 0, start, min(self._step, self.map_size - start))
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                log.warning("metadata in %s: the filesystem cannot reserve room (%s); a full "
                            "filesystem there may stop the daemon", self.path, exc)
                os.close(self._file)
                self._file = None
                return
            self.room.failed(f"cannot reserve {self._step >> 20} MiB for it to grow ({exc}): "
                             "creates and writes get ENOSPC until space is freed")
            return
        self._reserved = start + self._step
        self.room.over()

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
        if self._file is not None:
            os.close(self._file)

    # -- superblock ------------------------------------------------------------------------
    def load_superblock(self) -> dict | None:
        with self.env.begin(db=self.db["super"]) as txn:
            raw = txn.get(b"superblock")
        if raw is None:
            return None
        try:
            sb = json.loads(raw)
        except ValueError as exc:
            raise FormatError(f"{self.path}: the superblock is damaged ({exc})") from None
        if not isinstance(sb, dict) or sb.get("magic") != "kvfs":
            raise FormatError(f"{self.path}: the superblock is damaged (no kvfs magic)")
        if sb.get("format") not in READABLE_FORMATS:
            raise FormatError(
                f"{self.path}: metadata format {sb.get('format')!r} is not supported by this "
                f"kvfs (it reads formats {', '.join(map(str, READABLE_FORMATS))}); use a "
                f"matching kvfs version"
            )
        try:
            uuid.UUID(sb["uuid"])
            cs, seg = sb["chunk_size"], sb["segment_size"]
            if type(cs) is not int or not 4096 <= cs <= 64 << 20 or cs & (cs - 1):
                raise ValueError(f"chunk_size {cs!r}")
            if type(seg) is not int or seg < 2 * cs + 8192:
                raise ValueError(f"segment_size {seg!r}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"{self.path}: the superblock is damaged ({exc!r})") from None
        return sb

    def set_format(self, txn: lmdb.Transaction, version: int) -> None:
        """Mark the store as (at least) *version* in the caller's transaction, with the
        changes that need it; the caller syncs."""
        raw = txn.get(b"superblock", db=self.db["super"])
        sb = json.loads(raw) if raw is not None else None
        if sb is not None and sb["format"] < version:
            sb["format"] = version
            txn.put(b"superblock", json.dumps(sb).encode(), db=self.db["super"])
            log.info("metadata format is now %d", version)

    def create_superblock(self, chunk_size: int, segment_size: int) -> dict:
        sb = {"magic": "kvfs", "format": FORMAT_VERSION, "uuid": str(uuid.uuid4()),
              "chunk_size": chunk_size, "segment_size": segment_size,
              "created": time.time()}
        with self.env.begin(write=True, db=self.db["super"]) as txn:
            txn.put(b"superblock", json.dumps(sb).encode())
        self.env.sync(True)
        return sb

    # -- transactions ----------------------------------------------------------------------
    @contextmanager
    def write(self) -> Iterator[lmdb.Transaction]:
        """One write transaction; nested calls share the outer one (committed once)."""
        if self._txn is not None:
            yield self._txn
            return
        txn = self.env.begin(write=True)
        self._txn = txn
        try:
            yield txn
        except BaseException:
            txn.abort()
            self._after.clear()
            raise
        else:
            txn.commit()
        finally:
            self._txn = None
        self._commits += 1
        if self._file is not None and self._commits % META_CHECK_EVERY == 0:
            self._reserve()
        # Old locations are released only now that their replacements are committed.
        after, self._after = self._after, []
        for fn in after:
            fn()
        if after:
            self.on_settled()

    def after_commit(self, fn) -> None:
        """Run *fn* once the current write transaction has committed (dropped on abort)."""
        assert self._txn is not None, "after_commit outside a write transaction"
        self._after.append(fn)

    def once_committed(self, fn) -> None:
        """Run *fn* after the current write transaction commits, or now if there is none."""
        if self._txn is None:
            fn()
        else:
            self._after.append(fn)

    def counter(self, txn: lmdb.Transaction, name: bytes, default: int) -> int:
        raw = txn.get(name, db=self.db["counters"])
        if raw is None:
            return default
        if len(raw) != 8 or from_u64(raw) >= COUNTER_MAX:
            raise FormatError(f"{self.path}: the metadata is damaged: counter {name!r} is "
                              f"{raw.hex()}")
        return from_u64(raw)

    def set_counter(self, txn: lmdb.Transaction, name: bytes, value: int) -> None:
        txn.put(name, u64(value), db=self.db["counters"])

    def scan(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """All (key, value) pairs of *table* whose key starts with *prefix* (a read snapshot)."""
        with self.env.begin(db=self.db[table], buffers=False) as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix):
                return
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                yield k, v

    def load(self, table: str, parse: Callable[[bytes, bytes], T]) -> Iterator[T]:
        """parse(key, value) of every entry of *table*, at mount. An entry *parse* cannot
        take (struct.error, ValueError: the wrong length, a field out of range) is damaged
        metadata: FormatError naming it, instead of a traceback or wrong bytes later."""
        for k, v in self.scan(table):
            try:
                item = parse(k, v)
            except (struct.error, ValueError) as exc:
                raise FormatError(
                    f"{self.path}: the metadata is damaged: table {table!r}, key {k.hex()}: "
                    f"{exc}") from None
            yield item

    def sync(self) -> None:
        """Make every committed transaction durable (blocking: call from a worker thread)."""
        self.env.sync(True)
