"""A file's description, carried by each of its NVMe records (record version 2).

The metadata (lmdb) can be lost or damaged while the segments are fine; `fsck.kvfs
--rebuild` then makes it again from the records alone (kvfs/rebuild.py). A record's header
says which chunk of which inode it holds and how new its bytes are (seq); the description
written after its payload says what the file was when the record was written: its
attributes and size, which of its chunks existed (so that chunks cut off or punched since
stay gone), and its path from the root as (inode, mode, owner, name) per directory, so that
directories and names come back too. `stamp` orders descriptions: the newest of a file (or
of a directory on the path) wins over older ones still in stale records. Layout in
docs/FORMAT.md, "File description".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

# Descriptions past this are not written (a path thousands of directories deep): the
# file's records then carry none and a rebuild puts it in lost+found.
MAX_INFO = 32 << 10
# A bitmap of more chunks than this (a sparse file of terabytes) is left out: a rebuild then
# takes every chunk below the size that has a record.
MAX_BITMAP_BYTES = 4096

# stamp, mode, uid, gid, size, mtime_ns, ctime_ns, bitmap bytes (u32), path components (u16)
_FIXED = struct.Struct("<QIIIQqqIH")
# per path component: ino, mode, uid, gid, name length
_COMPONENT = struct.Struct("<QIIIH")
_CHECK = struct.Struct("<I")


class InfoError(Exception):
    """A description that does not check (damage)."""


@dataclass(frozen=True)
class Component:
    """A directory on the path, root first (the root's name is empty), then the file."""
    ino: int
    mode: int
    uid: int
    gid: int
    name: bytes


@dataclass(frozen=True)
class FileInfo:
    stamp: int  # a sequence number taken when the description was made: newer wins
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    ctime_ns: int
    chunks: bytes | None  # bit c set: chunk c existed; None: not recorded (too many)
    path: tuple[Component, ...]  # the root, the directories, then the file itself

    def has_chunk(self, c: int) -> bool:
        if self.chunks is None:
            return True
        return c < len(self.chunks) * 8 and bool(self.chunks[c >> 3] >> (c & 7) & 1)


def bitmap(chunks) -> bytes | None:
    """The bitmap of chunk numbers *chunks* (None if too big to carry)."""
    chunks = list(chunks)
    if not chunks:
        return b""
    top = max(chunks)
    if top >= MAX_BITMAP_BYTES * 8:
        return None
    out = bytearray(top // 8 + 1)
    for c in chunks:
        out[c >> 3] |= 1 << (c & 7)
    return bytes(out)


def pack(info: FileInfo) -> bytes:
    """The description's bytes; b"" if it would exceed MAX_INFO."""
    chunks = info.chunks
    parts = [_FIXED.pack(info.stamp, info.mode, info.uid, info.gid, info.size, info.mtime_ns,
                         info.ctime_ns, 0xFFFFFFFF if chunks is None else len(chunks),
                         len(info.path)), chunks or b""]
    for p in info.path:
        parts += [_COMPONENT.pack(p.ino, p.mode, p.uid, p.gid, len(p.name)), p.name]
    body = b"".join(parts)
    if len(body) + _CHECK.size > MAX_INFO:
        return b""
    return body + _CHECK.pack(xxhash.xxh32_intdigest(body))


def unpack(raw: bytes) -> FileInfo:
    if len(raw) < _FIXED.size + _CHECK.size:
        raise InfoError("file description too short")
    body = raw[:-_CHECK.size]
    if xxhash.xxh32_intdigest(body) != _CHECK.unpack(raw[-_CHECK.size:])[0]:
        raise InfoError("file description check mismatch")
    try:
        stamp, mode, uid, gid, size, mtime, ctime, nbits, depth = _FIXED.unpack_from(body)
        pos = _FIXED.size
        chunks = None
        if nbits != 0xFFFFFFFF:
            chunks = bytes(body[pos:pos + nbits])
            pos += nbits
        path = []
        for _ in range(depth):
            ino, pmode, puid, pgid, n = _COMPONENT.unpack_from(body, pos)
            pos += _COMPONENT.size
            path.append(Component(ino, pmode, puid, pgid, bytes(body[pos:pos + n])))
            pos += n
    except struct.error as exc:
        raise InfoError(f"file description damaged ({exc})") from None
    if pos != len(body):
        raise InfoError("file description damaged (length)")
    return FileInfo(stamp, mode, uid, gid, size, mtime, ctime, chunks, tuple(path))
