"""`fsck.kvfs --rebuild`: make the metadata (lmdb) of an unmounted kvfs again from its
NVMe segments alone, when it is lost or damaged.

Every record names its inode, chunk and seq; a version 2 record also carries its file's
description (kvfs/store/fileinfo.py). For each chunk the record with the highest seq holds
its newest bytes that reached NVMe; for each file (and each directory on a file's path) the
description with the highest stamp says its newest attributes, size, chunks and name. Each
winning record is read and checked (decode, xxh3) before it is used; one that does not check
makes its chunk LOST (reads fail with EIO), never an older record's bytes. Files whose
records carry no description (version 1, or one too big), or whose name another file took
since, go to /lost+found as #INO. What cannot come back is in docs/FORMAT.md ("Rebuilding
the metadata").

The old metadata directory is kept, renamed meta.damaged-TIME; the DRAM tier's files are
left to the next mount, which drops those the new metadata does not name.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
import time
import uuid as uuidlib
from collections import Counter
from dataclasses import dataclass, field

import xxhash

from kvfs.namespace import ROOT_INODE, Inode
from kvfs.store import fileinfo
from kvfs.store.codec import Codec, CodecError
from kvfs.store.fileinfo import Component, FileInfo, InfoError
from kvfs.store.location import LOC, LOST, SEALED
from kvfs.store.meta import MetaStore, key2, u64
from kvfs.store.nvme import (
    SEGMENT_HEADER,
    SEGMENT_MAGIC,
    SEGMENT_NAME,
    SEGMENT_SIZES,
    NvmeLog,
    RecordError,
    RecordHeader,
    record_length,
)

log = logging.getLogger(__name__)

LOST_FOUND = b"lost+found"


class RebuildError(Exception):
    """The rebuild cannot be done (the message says why)."""


@dataclass
class _Record:
    seg: int
    off: int
    h: RecordHeader


@dataclass
class Report:
    files: int = 0
    directories: int = 0
    chunks: int = 0
    lost_chunks: int = 0
    lost_found: int = 0
    stale_records: int = 0
    notes: list[str] = field(default_factory=list)


def _segment_headers(nvme_dir: str) -> dict[int, tuple[bytes, int, int]]:
    """seg id -> (fs uuid, chunk_size, segment_size; 0 when the header predates them)."""
    out = {}
    directory = os.path.join(nvme_dir, "segments")
    for name in sorted(os.listdir(directory)):
        m = SEGMENT_NAME.fullmatch(name)
        if m is None:
            continue
        with open(os.path.join(directory, name), "rb") as f:
            head = f.read(SEGMENT_HEADER.size + SEGMENT_SIZES.size)
        if len(head) < SEGMENT_HEADER.size + SEGMENT_SIZES.size:
            continue
        magic, version, _, seg_id, fsid, _ = SEGMENT_HEADER.unpack_from(head)
        if magic != SEGMENT_MAGIC or seg_id != int(m.group(1)):
            continue
        cs, ss = SEGMENT_SIZES.unpack_from(head, SEGMENT_HEADER.size) if version >= 2 else (0, 0)
        out[seg_id] = (fsid, cs, ss)
    return out


def rebuild(nvme_dir: str, *, chunk_size: int = 0, segment_size: int = 0, out=print) -> int:
    """Rebuild *nvme_dir*'s metadata; exit code as fsck(8): 0 done, 8 not possible."""
    try:
        os.makedirs(nvme_dir, exist_ok=True)
        lock = os.open(os.path.join(nvme_dir, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        out(f"fsck.kvfs: {nvme_dir}: {exc.strerror}")
        return 8
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        out(f"fsck.kvfs: {nvme_dir} is mounted; unmount it first")
        return 8
    try:
        report = _rebuild(nvme_dir, chunk_size, segment_size)
    except (RebuildError, OSError) as exc:
        out(f"fsck.kvfs: cannot rebuild {nvme_dir}: {exc}")
        return 8
    finally:
        os.close(lock)
    for note in report.notes:
        out(note)
    out(f"rebuilt: {report.files} files, {report.directories} directories, {report.chunks} "
        f"chunks ({report.lost_chunks} lost), {report.lost_found} in /lost+found, "
        f"{report.stale_records} stale records passed over")
    return 0


def _rebuild(nvme_dir: str, chunk_size: int, segment_size: int) -> Report:
    heads = _segment_headers(nvme_dir) if os.path.isdir(os.path.join(nvme_dir, "segments")) \
        else {}
    if not heads:
        raise RebuildError("no segment of a kvfs in it")
    fsid = Counter(h[0] for h in heads.values()).most_common(1)[0][0]
    sizes = {(cs, ss) for fid, cs, ss in heads.values() if fid == fsid and cs}
    if len(sizes) > 1:
        raise RebuildError(f"segments disagree on the chunk and segment sizes: {sorted(sizes)}")
    if sizes:
        chunk_size, segment_size = sizes.pop()
    elif not chunk_size or not segment_size:
        raise RebuildError("its segments predate the sizes in their headers: give "
                           "--chunk-size and --segment-size (as it was made with)")
    fs_uuid = str(uuidlib.UUID(bytes=fsid))
    nvme = NvmeLog(nvme_dir, fs_uuid, 1 << 62, segment_size, read_only=True)
    try:
        return _from_records(nvme, nvme_dir, fs_uuid, chunk_size, segment_size)
    finally:
        nvme.close()


def _from_records(nvme: NvmeLog, nvme_dir: str, fs_uuid: str, cs: int,
                  segment_size: int) -> Report:
    report = Report()
    newest: dict[tuple[int, int], _Record] = {}  # (ino, chunk) -> its newest record
    infos: dict[int, FileInfo] = {}  # ino -> its newest description
    max_seq = 0
    for seg_id in sorted(nvme.segments):
        seg = nvme.segments[seg_id]
        for off, h in nvme.scan(seg_id):
            max_seq = max(max_seq, h.seq)
            key = (h.ino, h.chunk)
            have = newest.get(key)
            if have is None or h.seq > have.h.seq:
                if have is not None:
                    report.stale_records += 1
                newest[key] = _Record(seg_id, off, h)
            else:
                report.stale_records += 1
            if h.info_len:
                info = _read_info(nvme, seg, off, h)
                if info is not None:
                    max_seq = max(max_seq, info.stamp)
                    old = infos.get(h.ino)
                    if old is None or info.stamp > old.stamp:
                        infos[h.ino] = info
    # Directories: each one's newest mention on some file's path.
    dirs: dict[int, tuple[int, Component, int]] = {}  # ino -> (parent, component, stamp)
    for info in infos.values():
        parent = ROOT_INODE
        for comp in info.path[:-1]:
            old = dirs.get(comp.ino)
            if old is None or info.stamp > old[2]:
                dirs[comp.ino] = (parent, comp, info.stamp)
            parent = comp.ino
    codec = Codec()
    inodes: dict[int, Inode] = {}
    entries: dict[tuple[int, bytes], tuple[int, int]] = {}  # (parent, name) -> (ino, stamp)
    chunks: dict[tuple[int, int], tuple] = {}
    now = time.time_ns()
    root = dirs.get(ROOT_INODE)
    r = root[1] if root else Component(ROOT_INODE, stat.S_IFDIR | 0o755, 0, 0, b"")
    inodes[ROOT_INODE] = Inode(ROOT_INODE, r.mode, 2, r.uid, r.gid, 0, 0, now, now, now)
    for ino, (parent, comp, stamp) in dirs.items():
        if ino == ROOT_INODE or not stat.S_ISDIR(comp.mode):
            continue
        inodes[ino] = Inode(ino, comp.mode, 2, comp.uid, comp.gid, 0, 0, now, now, now)
        _claim(entries, parent, comp.name, ino, stamp)
    files = sorted({ino for ino, _ in newest})
    for ino in files:
        info = infos.get(ino)
        extent = [c for (i, c) in newest if i == ino]
        if info is None:  # no description: its bytes at least
            size = max((c * cs + newest[(ino, c)].h.raw_len for c in extent), default=0)
            inodes[ino] = Inode(ino, stat.S_IFREG | 0o600, 1, 0, 0, 0, size, now, now, now)
        else:
            size = info.size
            inodes[ino] = Inode(ino, info.mode, 1, info.uid, info.gid, 0, size,
                                info.mtime_ns, info.mtime_ns, info.ctime_ns)
            leaf = info.path[-1]
            _claim(entries, info.path[-2].ino if len(info.path) > 1 else ROOT_INODE,
                   leaf.name, ino, info.stamp)
        for c in extent:
            rec = newest[(ino, c)]
            h = rec.h
            if c * cs >= size or (info is not None and not info.has_chunk(c)):
                report.stale_records += 1  # cut off or punched after it was written
                continue
            good = h.raw_len <= size - c * cs and _verify(nvme, codec, rec)
            flags = SEALED if good else LOST
            if not good:
                report.lost_chunks += 1
                report.notes.append(f"inode {ino} chunk {c}: its newest record (segment "
                                    f"{rec.seg} at {rec.off}) "
                                    + ("does not check" if h.raw_len <= size - c * cs else
                                       "holds bytes past the file's size")
                                    + ": lost (reads fail with EIO)")
                chunks[(ino, c)] = (-1, 0, 0, 0, min(h.raw_len, size - c * cs), 0, 0, flags,
                                    0, h.seq)
                continue
            chunks[(ino, c)] = (-1, rec.seg, rec.off, record_length(h.stored_len, h.info_len),
                                h.raw_len, h.stored_len, h.codec, flags, h.checksum, h.seq)
    # Names: the newest claim of each (parent, name) holds it; directories must reach the
    # root; everything else goes to lost+found.
    named: dict[int, tuple[int, bytes]] = {}
    for (parent, name), (ino, _) in entries.items():
        if ino not in named:
            named[ino] = (parent, name)
    homeless = [ino for ino in inodes if ino != ROOT_INODE and not _reaches_root(
        ino, named, inodes)]
    lost_found = None
    if homeless:
        lost_found = max(inodes) + 1
        inodes[lost_found] = Inode(lost_found, stat.S_IFDIR | 0o700, 2, 0, 0, 0, 0, now, now,
                                   now)
        name = LOST_FOUND
        while (ROOT_INODE, name) in entries:
            name += b"_"
        named[lost_found] = (ROOT_INODE, name)
        for ino in homeless:
            named[ino] = (lost_found, f"#{ino}".encode())
            report.lost_found += 1
    for ino, (parent, _) in named.items():
        if inodes[ino].is_dir:
            inodes[parent].nlink += 1
    report.files = sum(1 for i in inodes.values() if i.is_reg)
    report.directories = sum(1 for i in inodes.values() if i.is_dir)
    report.chunks = len(chunks)
    _write(nvme_dir, fs_uuid, cs, segment_size, inodes, named, chunks,
           next_seq=max_seq + 1, next_ino=max(inodes) + 1)
    return report


def _claim(entries: dict, parent: int, name: bytes, ino: int, stamp: int) -> None:
    old = entries.get((parent, name))
    if old is None or stamp > old[1]:
        entries[(parent, name)] = (ino, stamp)


def _reaches_root(ino: int, named: dict[int, tuple[int, bytes]], inodes: dict) -> bool:
    seen = set()
    while ino != ROOT_INODE:
        if ino in seen or ino not in named:
            return False
        seen.add(ino)
        parent = named[ino][0]
        if parent not in inodes or not inodes[parent].is_dir:
            return False
        ino = parent
    return True


def _read_info(nvme: NvmeLog, seg, off: int, h: RecordHeader) -> FileInfo | None:
    try:
        _, _, raw = nvme.read_whole(seg, off, record_length(h.stored_len, h.info_len))
        return fileinfo.unpack(raw)
    except (RecordError, InfoError, OSError) as exc:
        log.warning("segment %d at %d: file description unreadable (%s)", seg.seg_id, off, exc)
        return None


def _verify(nvme: NvmeLog, codec: Codec, rec: _Record) -> bool:
    h = rec.h
    try:
        seg = nvme.segments[rec.seg]
        _, payload = nvme.read_record(seg, rec.off, record_length(h.stored_len, h.info_len))
        data = codec.decode(h.codec, payload, h.raw_len)
    except (RecordError, CodecError, OSError):
        return False
    return len(data) == h.raw_len and xxhash.xxh3_64_intdigest(data) == h.checksum


def _write(nvme_dir: str, fs_uuid: str, cs: int, segment_size: int, inodes: dict[int, Inode],
           named: dict[int, tuple[int, bytes]], chunks: dict, *, next_seq: int,
           next_ino: int) -> None:
    """A new metadata directory with these tables, put in place of the old one (kept)."""
    path = os.path.join(nvme_dir, "meta")
    fresh = path + ".rebuilt"
    if os.path.exists(fresh):
        for name in os.listdir(fresh):
            os.unlink(os.path.join(fresh, name))
        os.rmdir(fresh)
    meta = MetaStore(fresh)
    try:
        meta.create_superblock(cs, segment_size)
        with meta.env.begin(write=True) as txn:
            raw = txn.get(b"superblock", db=meta.db["super"])
            sb = json.loads(raw)
            sb["uuid"] = fs_uuid
            sb["rebuilt"] = time.time()
            txn.put(b"superblock", json.dumps(sb).encode(), db=meta.db["super"])
            for ino, inode in inodes.items():
                txn.put(u64(ino), inode.pack(), db=meta.db["inodes"])
            for ino, (parent, name) in named.items():
                txn.put(u64(parent) + name, u64(ino), db=meta.db["dirents"])
            for (ino, c), loc in chunks.items():
                txn.put(key2(ino, c), LOC.pack(*loc), db=meta.db["chunks"])
            meta.set_counter(txn, b"next_ino", next_ino)
            meta.set_counter(txn, b"next_seq", next_seq)
        meta.env.sync(True)
    finally:
        meta.env.close()
    if os.path.exists(path):
        os.rename(path, f"{path}.damaged-{int(time.time())}")
    os.rename(fresh, path)
    fd = os.open(nvme_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

