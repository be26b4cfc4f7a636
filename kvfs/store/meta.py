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

import json
import logging
import os
import struct
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import lmdb

log = logging.getLogger(__name__)

# Format 2 adds the PACKED chunk flag; format 3 moves DRAM copies from one arena file of
# slots to one file per inode; format 4 keeps the inode flag DENSE (kvfs.namespace), which
# files made before it lack (docs/FORMAT.md). Older formats are migrated at mount.
FORMAT_VERSION = 4
READABLE_FORMATS = (1, 2, 3, 4)
_U64 = struct.Struct(">Q")
_KEY2 = struct.Struct(">QQ")
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

    def __init__(self, path: str, *, map_size: int = 1 << 36) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        # 64 GiB of address space is only a ceiling; the file grows as it is used.
        self.env = lmdb.open(path, map_size=map_size, max_dbs=len(TABLES), writemap=True,
                             sync=False, metasync=False, map_async=False, readahead=False,
                             lock=True, subdir=True)
        self.db = {name.decode(): self.env.open_db(name) for name in TABLES}
        self._txn: lmdb.Transaction | None = None
        self._after: list = []
        # Runs after each commit's after_commit functions (the DRAM tier frees the regions
        # they released, all at once).
        self.on_settled = lambda: None

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()

    # -- superblock ------------------------------------------------------------------------
    def load_superblock(self) -> dict | None:
        with self.env.begin(db=self.db["super"]) as txn:
            raw = txn.get(b"superblock")
        if raw is None:
            return None
        try:
            sb = json.loads(raw)
        except ValueError as exc:
            raise FormatError(f"{self.path}: superblock is not readable ({exc})") from None
        if sb.get("magic") != "kvfs" or sb.get("format") not in READABLE_FORMATS:
            raise FormatError(
                f"{self.path}: metadata format {sb.get('format')!r} is not supported by this "
                f"kvfs (it reads formats {', '.join(map(str, READABLE_FORMATS))}); use a "
                f"matching kvfs version"
            )
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

    def counter(self, txn: lmdb.Transaction, name: bytes, default: int) -> int:
        raw = txn.get(name, db=self.db["counters"])
        return default if raw is None else from_u64(raw)

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

    def sync(self) -> None:
        """Make every committed transaction durable (blocking: call from a worker thread)."""
        self.env.sync(True)
