"""Where a chunk is: its location (`Loc`), the flags on it and their lmdb encoding, and
what the store's components share about chunks (errors, counters, the checksum).

Every chunk has one location, the same tuple in the block index and in lmdb's `chunks`
table (docs/FORMAT.md has the byte layout). A chunk is in one of three states:

    DRAM only (dirty)   dram_slot >= 0, seg == 0   - newest bytes only in tmpfs
    both (clean copy)   dram_slot >= 0, seg > 0    - identical bytes on NVMe
    NVMe only           dram_slot < 0,  seg > 0

A DRAM copy lives in its *region*: the chunk's own offset in its inode's DRAM file
(kvfs/store/dram.py); `dram_slot` is IN_DRAM (0) for every copy since format 3. With
`dram_compress`, a clean copy may be *packed*: flag PACKED, and its region holds the NVMe
record's payload (`stored_len` bytes, encoded with `codec`) instead of the raw bytes.
"""

from __future__ import annotations

import errno
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import xxhash

from kvfs import _digest
from kvfs.store.codec import CODEC_RAW
from kvfs.store.fileinfo import MAX_INFO
from kvfs.store.meta import COUNTER_MAX
from kvfs.store.nvme import BLOCK, record_length

SEALED = 1  # checksum covers the current bytes
LOST = 2  # the only copy was in DRAM and DRAM was lost (reboot): reads fail with EIO
PACKED = 4  # the DRAM region holds the NVMe record's payload, not the raw bytes (format 2)
# Bytes past raw_len were written, then lost with DRAM (the chunk went back to its shadow):
# reads there fail with EIO instead of reading zeros (format 3).
TAIL_LOST = 8
IN_DRAM = 0  # dram_slot of a chunk with a DRAM copy (format 3: the region is implied)
# A location's lmdb value (`chunks`, and `shadows` followed by a U32): docs/FORMAT.md.
LOC = struct.Struct("<qIQIIIBBQQ")
U32 = struct.Struct("<I")


class Loc(NamedTuple):
    dram_slot: int
    seg: int
    off: int
    rec_len: int
    raw_len: int
    stored_len: int
    codec: int
    flags: int
    checksum: int
    seq: int


# The shadow of a chunk written into a hole from past its start (`ChunkStore._shadow`): no
# record, nothing but zeros up to where the write began.
HOLE = Loc(-1, 0, 0, 0, 0, 0, CODEC_RAW, 0, 0, 0)


def parse_loc(value: bytes, chunk_size: int) -> Loc:
    """A chunk location as stored in lmdb; ValueError (or struct.error) if it cannot be one
    (damaged metadata), so that no read trusts a length or an offset it never wrote."""
    loc = Loc._make(LOC.unpack(value))
    if loc.dram_slot < -1 or loc.raw_len > chunk_size or loc.flags >= TAIL_LOST << 1:
        raise ValueError(f"impossible chunk location {loc}")
    if loc.seq >= COUNTER_MAX or loc.flags & PACKED and not loc.seg:
        raise ValueError(f"impossible chunk location {loc}")
    if loc.seg and (loc.off < BLOCK or loc.off % BLOCK
                    or loc.rec_len % BLOCK or loc.rec_len < record_length(loc.stored_len)
                    or loc.rec_len > record_length(loc.stored_len, MAX_INFO)):
        raise ValueError(f"impossible record location {loc}")
    return loc


def slot_len(loc: Loc) -> int:
    """Bytes a chunk's DRAM region holds: its record's payload when packed, else its bytes."""
    return loc.stored_len if loc.flags & PACKED else loc.raw_len


def nvme_only(loc: Loc) -> Loc:
    """*loc* without its DRAM copy."""
    return loc._replace(dram_slot=-1, flags=loc.flags & ~PACKED)


class NoSpace(Exception):
    """Storing more bytes would exceed the capacity of the filesystem."""


class ChunkError(Exception):
    """A chunk cannot be read correctly; the message names the file and chunk."""

    errno = errno.EIO


# xxh3-64 of a chunk's raw bytes: kvfs._digest's releases the GIL (workers hash in parallel
# and the trio thread runs meanwhile); python-xxhash's, the same function, where it cannot run.
HASH_RELEASES_GIL = _digest.fast()
hash_bytes = _digest.xxh3 if HASH_RELEASES_GIL else xxhash.xxh3_64_intdigest


@dataclass
class Counters:
    # Chunks read, by where their bytes came from: a chunk counts at the READ that takes
    # its first byte (a reader's 32 READs of 32 KiB through a 1 MiB chunk read it once),
    # and for every chunk an open staged or handed to the kernel (passthrough).
    chunks_from_dram: int = 0
    chunks_from_nvme: int = 0
    chunks_from_holes: int = 0
    # READs the daemon served, each counted once per chunk it took bytes of.
    requests_from_dram: int = 0
    requests_from_nvme: int = 0
    requests_from_holes: int = 0
    promotions: int = 0
    demotions: int = 0
    writebacks: int = 0
    checksum_errors: int = 0
    dram_checks: int = 0  # DRAM copies hashed on the read path before being trusted
    user_bytes_written: int = 0  # record bytes written to NVMe for user data
    gc_bytes_written: int = 0
    read_latency_us: list[int] = field(default_factory=lambda: [0] * 24)  # log2 buckets
    read_latency_dram_us: list[int] = field(default_factory=lambda: [0] * 24)  # DRAM hits
    read_latency_nvme_us: list[int] = field(default_factory=lambda: [0] * 24)  # NVMe reads
    prefetch_issued: int = 0
    prefetch_used: int = 0  # a prefetched chunk was read while in DRAM
    prefetch_late: int = 0  # a demand read found its chunk's prefetch still in flight
    prefetch_wasted: int = 0  # a prefetched chunk left DRAM unread
    direct_writes: int = 0  # writes copied by the shim straight into DRAM (plan_write)
    passthrough_opens: int = 0  # opens the kernel serves from the DRAM file itself
    passthrough_chunks: int = 0  # ... their chunks (in chunks_from_dram, or from_nvme if:)
    staged_chunks: int = 0  # ... brought in from NVMe for such an open (stage_file)
    kernel_write_opens: int = 0  # new files the kernel wrote straight into their DRAM file
    kernel_write_adoptions: int = 0  # files in passthrough mode it went on to write
    streamed_chunks: int = 0  # ... chunks taken from them (at close or fsync)
    unseen_sums: int = 0  # ... the RAM they hold summed file by file (Room.fits)
    unpacked: int = 0  # DRAM hits that decoded a packed copy
    through_buffered: int = 0  # NVMe chunks read ahead of a read-through reader (into memory)
    through_buffer_used: int = 0  # ... and then read by it (in chunks_from_nvme)
    front_reads: int = 0  # READs the front thread answered from chunks read ahead
    front_notices: int = 0  # ... of which the trio thread had a notice (readthrough.py)

    def count_read(self, tier: str, first_byte: bool) -> None:
        """A READ took bytes of one chunk from *tier* ("dram", "nvme" or "holes"): one
        request, and a chunk read if they began at the chunk's *first_byte*."""
        name = f"requests_from_{tier}"
        setattr(self, name, getattr(self, name) + 1)
        if first_byte:
            name = f"chunks_from_{tier}"
            setattr(self, name, getattr(self, name) + 1)

    def request_counts(self) -> dict[str, int]:
        return {f"requests_from_{tier}": getattr(self, f"requests_from_{tier}")
                for tier in ("dram", "nvme", "holes")}
