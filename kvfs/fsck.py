"""Offline consistency check of an unmounted kvfs (`fsck.kvfs`).

Reads the metadata and verifies, for every chunk, that the copy it names exists and matches
its checksum: NVMe records (header, identity, decode, xxh3) and DRAM copies (xxh3), read
from the inode's DRAM file (format 3; a format 1-2 store's arena is checked by a mount,
which moves it). Also checks
that every directory entry names an existing inode and reports files holding lost chunks.
Read-only: it repairs nothing, so it is always safe to run.
Exit codes follow fsck(8): 0 clean, 4 errors found, 8 operational error.
"""

from __future__ import annotations

import fcntl
import logging
import os

import xxhash

from kvfs.store.chunkstore import _LOC, LOST, PACKED, SEALED
from kvfs.store.codec import Codec, CodecError
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
    inodes = {from_u64(k) for k, _ in meta.scan("inodes")}
    for k, v in meta.scan("chunks"):
        ino, c = from_key2(k)
        dram_slot, seg, off, rec_len, raw_len, stored, codec_id, flags, csum, seq = \
            _LOC.unpack(v)
        chunks += 1
        where = f"inode {ino} chunk {c}"
        if ino not in inodes:
            out(f"{where}: belongs to no inode")
            errors += 1
        if flags & LOST:
            lost += 1
            out(f"{where}: lost (its only copy was in DRAM when DRAM was lost)")
            continue
        if seg:
            if seg not in nvme.segments:
                out(f"{where}: segment {seg} is missing")
                errors += 1
            else:
                try:
                    h, payload = nvme.read_record(nvme.segments[seg], off, rec_len)
                    if (h.ino, h.chunk, h.seq) != (ino, c, seq):
                        raise RecordError("record belongs to another chunk")
                    data = codec.decode(h.codec, payload, h.raw_len)
                    if len(data) != raw_len or xxhash.xxh3_64_intdigest(data) != csum:
                        raise RecordError("checksum mismatch")
                    nvme_ok += 1
                except (RecordError, CodecError, OSError) as exc:
                    out(f"{where}: NVMe record in segment {seg} at {off}: {exc}")
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
    for k, v in meta.scan("dirents"):
        if from_u64(v) not in inodes:
            out(f"directory {from_u64(k[:8])} entry {k[8:]!r}: names a missing inode")
            errors += 1
    nvme.close()
    out(f"{chunks} chunks: {nvme_ok} NVMe records and {dram_ok} DRAM copies verified, "
        f"{lost} lost, {errors} errors")
    return 4 if errors else 0


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
