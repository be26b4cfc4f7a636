"""After a rename, a record that says where the file is now (for `fsck.kvfs --rebuild`).

A record carries its file's description (kvfs/store/fileinfo.py) as of its write-back, and a
rename writes no record: a rebuild would find the file under the name it had then. Every
engine writes a block to a temporary name, fsyncs it (which writes it back) and renames it
into place, so that name would be the temporary one. Hence after a rename, one record of the
file on NVMe (its shortest) is copied, as the cleaner copies records, with the description
as it is now: its stamp is the newest, so a rebuild takes its name, and its path's
directories. A directory's rename does the same for one file below it that has a record
(the newest mention of a directory gives its name and parent at a rebuild).

Nothing is copied for a file with dirty chunks: their write-back will carry the description.
The copies are made in the background (a file renamed again meanwhile is copied once) and
count as the cleaner's (gc bytes written). The copy is made durable (fdatasync) before the
chunk points at it: the chunk's bytes were durable before, and stay so.
"""

from __future__ import annotations

import logging
import os
from collections import deque

import trio

from kvfs.store.location import LOST
from kvfs.store.nvme import NvmeFull, RecordError, RecordHeader, record_length

log = logging.getLogger(__name__)

# Entries looked at below a renamed directory for a file with a record: a rename must not
# cost a walk of a huge tree (past it, the files below keep the directory's old name at a
# rebuild until one of them is written back).
DIR_SCAN_MAX = 256


class Redescriber:
    """Told of renames by the filesystem (`renamed`, trio thread); `run` makes the copies."""

    def __init__(self, store, ns) -> None:
        self.store = store
        self.ns = ns
        self.due: dict[int, None] = {}  # renamed inodes, in order, each once
        self._wake = trio.Event()
        self.copies = 0
        self.copied_bytes = 0

    def renamed(self, ino: int) -> None:
        self.due[ino] = None
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            await self.flush()

    async def flush(self) -> None:
        """Make the copies for the renames so far (also at unmount)."""
        while self.due:
            ino = next(iter(self.due))
            del self.due[ino]
            target = self._target(ino)
            if target is not None:
                await self.copy(target)

    def stats(self) -> dict:
        return {"rebuild": {"rename_copies": self.copies,
                            "rename_copied_bytes": self.copied_bytes,
                            "renames_due": len(self.due)}}

    def _target(self, ino: int) -> tuple[int, int] | None:
        """(file, chunk) of the record to copy for renamed *ino*: its own, or one of a file
        below it; None if there is none, or a dirty file will describe it anyway."""
        todo = deque([ino])
        seen = 0
        while todo and seen < DIR_SCAN_MAX:
            node = self.ns.inodes.get(todo.popleft())
            seen += 1
            if node is None or not node.nlink:
                continue
            if node.is_dir:
                todo.extend(child for _, child in self.ns.entries(node.ino))
            elif node.is_reg:
                store = self.store
                chunks = list(store.index.chunks_of(node.ino, store.nchunks(node.size)))
                if any(not store.is_clean((node.ino, c)) for c in chunks):
                    return None  # its write-back will carry where it is
                on_nvme = [(loc.rec_len, c) for c in chunks
                           if (loc := store.get(node.ino, c)) is not None and loc.seg
                           and not loc.flags & LOST]
                if on_nvme:
                    return node.ino, min(on_nvme)[1]
        return None

    async def copy(self, key: tuple[int, int]) -> None:
        """Copy chunk *key*'s NVMe record with its file's description as it is now."""
        store, nvme = self.store, self.store.nvme
        ino, c = key
        loc = store.get(ino, c)
        info = store.events.file_info(ino)
        if loc is None or not loc.seg or not info:
            return  # (gone meanwhile)
        try:
            seg = nvme.pin(loc.seg)
        except RecordError:
            return  # (the cleaner moved it meanwhile)
        try:
            header, payload, _ = await trio.to_thread.run_sync(
                nvme.read_whole, seg, loc.off, loc.rec_len, limiter=store.limiter)
        except (RecordError, OSError) as exc:
            log.warning("inode %d chunk %d: record unreadable (%s): a rebuild would find the "
                        "file under its name before its rename", ino, c, exc)
            return
        finally:
            nvme.unpin(seg)
        rec_len = record_length(len(payload), len(info))
        try:
            dst, dst_off = nvme.reserve(seg.stream, rec_len)
        except NvmeFull:
            log.info("inode %d: no room for a record of its new name", ino)
            return
        copy = RecordHeader(header.codec, dst.stream, ino, c, header.seq, header.raw_len,
                            header.stored_len, header.checksum, len(info))

        def write() -> None:
            nvme.write_record(dst, dst_off, copy, payload, info)
            os.fdatasync(dst.fd)

        try:
            await trio.to_thread.run_sync(write, limiter=store.limiter)
        except OSError as exc:
            nvme.mark_dead(dst.seg_id, rec_len)
            log.error("inode %d: writing a record of its new name failed: %s", ino, exc)
            return
        except BaseException:
            nvme.mark_dead(dst.seg_id, rec_len)
            raise
        store.counters.gc_bytes_written += rec_len
        nvme.bytes_written += rec_len
        self.copies += 1
        self.copied_bytes += rec_len
        store.relocated(ino, c, loc, dst.seg_id, dst_off, rec_len)
