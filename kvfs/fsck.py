"""Offline consistency check of an unmounted kvfs (`fsck.kvfs`).

Reads the metadata and verifies, for every chunk, that the copy it names exists and matches
its checksum: NVMe records (header, identity, decode, xxh3), the records kept as shadows
(what an fsync made durable while newer bytes are only in DRAM), and DRAM copies (xxh3),
read from the inode's DRAM file (format 3; a format 1-2 store's arena is checked by a
mount, which moves it). Also checks that every directory entry names an existing inode,
that every file's size and chunks agree (`size_problems`), and reports files holding lost
chunks.
Read-only: it repairs nothing, so it is always safe to run.
Exit codes follow fsck(8): 0 clean, 4 errors found, 8 operational error.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct

import xxhash

from kvfs.namespace import DENSE, Inode
from kvfs.store.codec import Codec, CodecError
from kvfs.store.location import LOC, LOST, PACKED, SEALED, TAIL_LOST, parse_loc
from kvfs.store.meta import FormatError, MetaStore, from_key2, from_u64
from kvfs.store.nvme import NvmeLog, RecordError

log = logging.getLogger(__name__)


def check(nvme_dir: str, dram_dir: str, out=print) -> int:
    try:
        lock = os.open(os.path.join(nvme_dir, "lock"), os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        out(f"fsck.kvfs: {nvme_dir} holds no kvfs")
        return 8
    except OSError:
        out(f"fsck.kvfs: {nvme_dir} is mounted; unmount it first")
        return 8
    meta = MetaStore(os.path.join(nvme_dir, "meta"))
    try:
        sb = meta.load_superblock()
        if sb is None:
            out(f"fsck.kvfs: {nvme_dir} holds no kvfs superblock")
            return 8
        return _check(meta, sb, nvme_dir, dram_dir, out)
    except FormatError as exc:
        out(f"fsck.kvfs: {exc}")
        return 8
    finally:
        meta.env.close()
        os.close(lock)


def _check(meta: MetaStore, sb: dict, nvme_dir: str, dram_dir: str, out) -> int:
    cs = sb["chunk_size"]
    nvme = NvmeLog(nvme_dir, sb["uuid"], 1 << 62, sb["segment_size"], read_only=True)
    dram = _dram_files(dram_dir, sb)
    codec = Codec()
    errors = 0
    chunks = nvme_ok = dram_ok = lost = 0
    inodes: dict[int, Inode] = {}
    for k, v in meta.scan("inodes"):
        try:
            inodes[from_u64(k)] = Inode.unpack(from_u64(k), v)
        except struct.error:
            out(f"inodes entry {k.hex()}: damaged")
            errors += 1
    extents: dict[int, list[tuple[int, int, int]]] = {}  # ino -> [(chunk, raw_len, flags)]

    def check_record(where: str, seg: int, off: int, rec_len: int, ino: int, c: int, seq: int,
                     raw_len: int, csum: int) -> bool:
        if seg not in nvme.segments:
            out(f"{where}: segment {seg} is missing")
            return False
        try:
            h, payload = nvme.read_record(nvme.segments[seg], off, rec_len)
            if (h.ino, h.chunk, h.seq) != (ino, c, seq):
                raise RecordError("record belongs to another chunk")
            data = codec.decode(h.codec, payload, h.raw_len)
            if len(data) != raw_len or xxhash.xxh3_64_intdigest(data) != csum:
                raise RecordError("checksum mismatch")
            return True
        except (RecordError, CodecError, OSError) as exc:
            out(f"{where}: NVMe record in segment {seg} at {off}: {exc}")
            return False

    for k, v in meta.scan("chunks"):
        try:
            ino, c = from_key2(k)
            loc = parse_loc(v, cs)
        except (struct.error, ValueError) as exc:
            out(f"chunks entry {k.hex()}: damaged ({exc})")
            errors += 1
            continue
        dram_slot, seg, off, rec_len, raw_len, stored, codec_id, flags, csum, seq = loc
        chunks += 1
        extents.setdefault(ino, []).append((c, raw_len, flags))
        where = f"inode {ino} chunk {c}"
        if ino not in inodes:
            out(f"{where}: belongs to no inode")
            errors += 1
        if flags & LOST:
            lost += 1
            out(f"{where}: lost (its only copy was in DRAM when DRAM was lost)")
            continue
        if seg:
            if check_record(where, seg, off, rec_len, ino, c, seq, raw_len, csum):
                nvme_ok += 1
            else:
                errors += 1
        if dram_slot >= 0 and dram is not None and flags & SEALED:
            try:
                with open(os.path.join(dram, f"{ino:x}"), "rb") as f:
                    view = os.pread(f.fileno(), stored if flags & PACKED else raw_len, c * cs)
                data = codec.decode(codec_id, view, raw_len) if flags & PACKED else view
                ok = len(data) == raw_len and xxhash.xxh3_64_intdigest(data) == csum
                problem = "checksum mismatch"
            except FileNotFoundError:
                ok, problem = False, "its DRAM file is missing"
            except CodecError:
                ok, problem = False, "checksum mismatch"
            if not ok:
                out(f"{where}: DRAM copy: {problem}")
                errors += 1
            else:
                dram_ok += 1
    shadows = 0
    for k, v in meta.scan("shadows"):
        try:
            ino, c = from_key2(k)
            _, seg, off, rec_len, raw_len, _, _, _, csum, seq = LOC.unpack(v[:LOC.size])
        except struct.error:
            out(f"shadows entry {k.hex()}: damaged")
            errors += 1
            continue
        if not seg:
            continue  # the chunk was a hole (HOLE): no record to check
        if check_record(f"inode {ino} chunk {c} (shadow)", seg, off, rec_len, ino, c, seq,
                        raw_len, csum):
            shadows += 1
        else:
            errors += 1
    for k, v in meta.scan("dirents"):
        if len(k) <= 8 or len(v) != 8:
            out(f"dirents entry {k.hex()}: damaged")
            errors += 1
        elif from_u64(v) not in inodes:
            out(f"directory {from_u64(k[:8])} entry {k[8:]!r}: names a missing inode")
            errors += 1
    for ino, inode in inodes.items():
        if not inode.is_reg or inode.nlink == 0:
            # Unlinked: the next mount drops it; its chunks may be gone already, its size
            # saved before (the kernel still knew it when the daemon stopped).
            continue
        for problem in size_problems(inode.size, cs, bool(inode.flags & DENSE),
                                     extents.get(ino, [])):
            out(f"inode {ino} ({inode.size} bytes): {problem}")
            errors += 1
    nvme.close()
    out(f"{chunks} chunks: {nvme_ok} NVMe records, {shadows} shadow records and {dram_ok} "
        f"DRAM copies verified, {lost} lost, {errors} errors")
    return 4 if errors else 0


def size_problems(size: int, chunk_size: int, dense: bool,
                  chunks: list[tuple[int, int, int]]) -> list[str]:
    """How a file's *size* and its *chunks* [(chunk, raw_len, flags)] disagree, if they do.
    No chunk may hold bytes past the size (a file grown later must read zeros there). A
    *dense* file (no hole was ever made in it, kvfs.namespace.DENSE) must have every chunk
    below its size, each full but the last, which reaches the size: a missing one would
    read as zeros nobody wrote (a crash mid-truncation left such files before format 4).
    A chunk whose tail was lost with DRAM (TAIL_LOST) counts as reaching its end: those
    bytes read as EIO."""
    n = -(-size // chunk_size)
    out = []
    past = [c for c, _, _ in chunks if c >= n]
    if past:
        out.append(f"{len(past)} chunk(s) past its end (first: chunk {past[0]})")
    have = {c: (raw_len, flags) for c, raw_len, flags in chunks if c < n}
    if n and n - 1 in have and have[n - 1][0] > size - (n - 1) * chunk_size:
        out.append(f"chunk {n - 1} holds {have[n - 1][0] - (size - (n - 1) * chunk_size)} "
                   f"bytes past its end")
    if dense:
        gaps = [c for c in range(n) if c not in have or (
            have[c][0] < min(chunk_size, size - c * chunk_size) and not have[c][1] & TAIL_LOST)]
        if gaps:
            out.append(f"{len(gaps)} chunk(s) below its size missing or short (first: chunk "
                       f"{gaps[0]}), in a file that never had a hole: they would read as "
                       f"zeros")
    return out


def _dram_files(dram_dir: str, sb: dict) -> str | None:
    """The directory of the store's DRAM files, or None if the DRAM tier is not this store's
    (gone at a reboot, or another's) or not yet in the per-inode layout."""
    try:
        with open(os.path.join(dram_dir, "tag")) as f:
            if f.read().strip() != sb["uuid"]:
                return None
    except OSError:
        return None
    return os.path.join(dram_dir, "files") if sb.get("format", 0) >= 3 else None
