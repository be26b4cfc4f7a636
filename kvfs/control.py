"""Control plane: the `user.kvfs.*` virtual xattrs that kvfsctl reads and writes.

Talking to the daemon through the mount itself (as S3QL does) works wherever the mount is
visible, containers included, and needs no socket or port. Names:

    user.kvfs.status          (get, any inode) one JSON object: tiers, reads, moves, gc, ...
                              (the tiers' directories only for root and the daemon's user)
    user.kvfs.where[.START]   (get, a file) JSON: tiers of the file's chunks from START, a page
                              at a time ({"chunks": [...], "next": N or null})
    user.kvfs.prefetch        (set, a file; any value) stage the file in DRAM: the engine will
                              read it soon

Changing names, for root and the mount's owner (the daemon's user) only; anyone else gets
EPERM (the kernel asks first for write permission on the file, as for any user.* xattr):

    user.kvfs.pin             (set, a file; any value) keep the file's chunks in DRAM, staging
                              those on NVMe now; ENOSPC if the pinned files would hold more
                              than PIN_SHARE of the tier (nothing is pinned then). The pin is
                              this xattr itself, stored with the file: it survives remounts
                              (and is staged again at mount) and goes with the file.
                              (get) "1" if pinned, else ENODATA; (remove) unpin.
    user.kvfs.unpin           (set, a file) unpin (as removing user.kvfs.pin)
    user.kvfs.demote          (set, a file) write the file's dirty chunks back and drop its
                              DRAM copies now; EBUSY if it is pinned, or if copies stay
                              because the kernel reads or writes its DRAM file (passthrough)
    user.kvfs.evict           (set, a file) the same: drop the DRAM copies, dirty ones
                              written back first
    user.kvfs.scrub[.START]   (get, a file) check every copy of chunks START.. (SCRUB_PAGE of
                              them) against their checksums: JSON {"damage": [...], "checked",
                              "unchecked", "next"}; kvfs/store/scrub.py
    user.kvfs.scrub.repair[.START]  the same, dropping damaged copies that have a good one
                              and marking lost the chunks that have none
    user.kvfs.trace.start     (set, any inode; the value: an absolute path outside the
                              mount) record opens and creates there as a Mooncake trace
                              (kvfs/trace.py); EBUSY if one is being recorded
    user.kvfs.trace.stop      (set) stop recording (ENODATA if none), the file complete
    user.kvfs.trace           (get, anyone) JSON of the recording under way, else ENODATA
    user.kvfs.config          (get, anyone, any inode) JSON: {"settings": {name: value},
                              "live": [the names that may change while mounted]} (the
                              tiers' directories only for root and the daemon's user)
    user.kvfs.config.NAME     (get) NAME's value as JSON; ENODATA if there is no such
                              setting. (set) change a live setting until the unmount, the
                              value as in `-o NAME=VALUE` (kvfs/liveconfig.py): EPERM if
                              NAME changes only at the next mount, EINVAL if there is no
                              NAME or the value is not one it may take

Other `user.kvfs.*` names (e.g. user.kvfs.dtype) are ordinary stored xattrs that act as hints.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time

from kvfs.config import ConfigError
from kvfs.faults import Faults
from kvfs.liveconfig import LiveConfig, NotLive, UnknownSetting
from kvfs.namespace import PIN_XATTR, Inode, NamespaceError
from kvfs.store.dram import pages
from kvfs.store.location import LOST, ChunkError, NoSpace
from kvfs.store.scrub import Scrub
from kvfs.tiering import PIN_SHARE
from kvfs.trace import TraceRecorder

log = logging.getLogger(__name__)

WHERE_PAGE = 256  # chunks per answer: keeps the JSON under the 64 KiB xattr limit
# Chunks a scrub request checks: one request stays short (a 1 MiB chunk's check is about a
# millisecond), and kvfsctl can show progress between them.
SCRUB_PAGE = 32
VIRTUAL = (b"user.kvfs.status", b"user.kvfs.where", b"user.kvfs.prefetch", PIN_XATTR,
           b"user.kvfs.unpin", b"user.kvfs.demote", b"user.kvfs.evict", b"user.kvfs.scrub",
           b"user.kvfs.trace", b"user.kvfs.config")
# How many times `demote` writes back and drops what a file has in DRAM before it gives up
# (writes and prefetches may bring chunks back meanwhile).
DEMOTE_TRIES = 3


class Control:
    def __init__(self, ns, store, settings, readahead, extra_stats=(), pod=None,
                 live: LiveConfig | None = None, faults: Faults | None = None) -> None:
        self.ns = ns
        self.pod = pod  # kvfs.podfiles.PodFiles, or None
        self.store = store
        self.readahead = readahead
        self.settings = settings
        self.extra_stats = extra_stats  # callables returning {section: {...}}; may grow
        self.started = time.time()
        self.scrub = Scrub(store)
        self.live = live
        self.faults = faults or Faults()

    @staticmethod
    def handles(name: bytes) -> bool:
        return any(name == v or name.startswith(v + b".") for v in VIRTUAL)

    async def get(self, ino: int, name: bytes, uid: int) -> bytes:
        """The value of virtual xattr *name* of *ino*, for a caller with user id *uid*."""
        if name == b"status":
            paths = uid in (0, os.geteuid())  # where the tiers live is the admin's business
            return json.dumps(self.status(paths), separators=(",", ":")).encode()
        if name == b"where" or name.startswith(b"where."):
            start = _page_start(name, b"where")
            return json.dumps(self.where(ino, start), separators=(",", ":")).encode()
        if name == b"pin":
            self._file(ino)
            value = self.ns.getxattr(ino, PIN_XATTR)
            if value is None:
                raise NamespaceError(errno.ENODATA)
            return value
        if name == b"scrub" or name.startswith(b"scrub."):
            self._privileged(uid)
            repair = name == b"scrub.repair" or name.startswith(b"scrub.repair.")
            start = _page_start(name, b"scrub.repair" if repair else b"scrub")
            inode = self._file(ino)
            if ino in self.store.kernel_written:
                raise NamespaceError(errno.EBUSY)  # the kernel is writing its DRAM file
            page = await self.scrub.page(ino, inode.size, start, SCRUB_PAGE, repair)
            return json.dumps(page.as_dict(), separators=(",", ":")).encode()
        if name == b"trace":
            tracer = self.readahead.tracer
            if tracer is None:
                raise NamespaceError(errno.ENODATA)
            return json.dumps(tracer.status()).encode()
        if name == b"config" or name.startswith(b"config."):
            values = self.live.values(private=uid in (0, os.geteuid()))
            if name == b"config":
                return json.dumps(values).encode()
            key = os.fsdecode(name[len(b"config."):])
            if key not in values["settings"]:
                raise NamespaceError(errno.ENODATA)
            return json.dumps(values["settings"][key]).encode()
        raise NamespaceError(errno.ENODATA)  # prefetch, unpin, demote, evict: write-only

    async def set(self, ino: int, name: bytes, value: bytes, uid: int) -> None:
        self.faults.reached("control.set")  # (tests: the daemon dies mid-command)
        if name == b"prefetch":
            inode = self._file(ino)
            self.readahead.hint(ino, inode.size)
            return
        if name in (b"status", b"where", b"scrub", b"config") or name.startswith((b"where.",
                                                                                  b"scrub.")):
            raise NamespaceError(errno.EPERM)  # read-only
        self._privileged(uid)
        if name == b"pin":
            await self.pin(ino)
        elif name == b"unpin":
            self.unpin(ino)
        elif name in (b"demote", b"evict"):
            await self.demote(ino)
        elif name == b"trace.start":
            self.start_trace(value)
        elif name == b"trace.stop":
            if self.stop_trace() is None:
                raise NamespaceError(errno.ENODATA)
        elif name.startswith(b"config."):
            self.set_config(os.fsdecode(name[len(b"config."):]), value)
        else:
            raise NamespaceError(errno.EPERM)

    def remove(self, ino: int, name: bytes, uid: int) -> None:
        """removexattr of a virtual name: of user.kvfs.pin, unpin; of the others, ENODATA
        (none is stored)."""
        if name != b"pin":
            raise NamespaceError(errno.ENODATA)
        self._privileged(uid)
        if ino not in self.pins:
            raise NamespaceError(errno.ENODATA)
        self.unpin(ino)

    @staticmethod
    def _privileged(uid: int) -> None:
        """Changing the mount's tiers is for root and the mount's owner only."""
        if uid not in (0, os.geteuid()):
            raise NamespaceError(errno.EPERM)

    def _file(self, ino: int) -> Inode:
        inode = self.ns.get(ino)
        if not inode.is_reg:
            raise NamespaceError(errno.EISDIR if inode.is_dir else errno.EINVAL)
        return inode

    # -- pins, demotion ------------------------------------------------------------------
    @property
    def pins(self) -> dict[int, bytes]:
        """Pinned files (their user.kvfs.pin xattr): the namespace keeps them as they change."""
        return self.ns.hinted(PIN_XATTR)

    def pinned_bytes(self) -> int:
        """DRAM the pinned files hold (or will, once staged): their sizes in pages."""
        return sum(pages(inode.size) for ino in self.pins
                   if (inode := self.ns.inodes.get(ino)) is not None and inode.is_reg)

    @property
    def pin_limit(self) -> int:
        return int(PIN_SHARE * self.store.dram.capacity)

    async def pin(self, ino: int) -> None:
        """Pin a file: its chunks stay in DRAM until it is unpinned or deleted; those on
        NVMe are staged now. ENOSPC (nothing pinned) if it does not fit; a chunk that
        cannot be read is EIO (nothing pinned either)."""
        inode = self._file(ino)
        if ino in self.pins:
            await self._stage(ino)  # (staged again: e.g. after a demote of it failed)
            return
        if self.pinned_bytes() + pages(inode.size) > self.pin_limit:
            raise NamespaceError(errno.ENOSPC)
        self.store.check_room()
        self.ns.setxattr(ino, PIN_XATTR, b"1")
        try:
            await self._stage(ino)
        except BaseException:
            if ino in self.pins and ino in self.ns.inodes:
                self.ns.removexattr(ino, PIN_XATTR)
            raise

    def unpin(self, ino: int) -> None:
        self._file(ino)
        if ino in self.pins:
            self.ns.removexattr(ino, PIN_XATTR)
            self.store.events.dram_filling()  # the demoter may take its chunks now

    async def _stage(self, ino: int) -> None:
        """Bring every NVMe-only chunk of a pinned file into DRAM (making room: other
        files' chunks are demoted for it). NoSpace if DRAM cannot take one."""
        store = self.store
        inode = self.ns.get(ino)
        for c in store.index.chunks_of(ino, store.nchunks(inode.size)):
            loc = store.get(ino, c)
            if loc is None or loc.dram_slot >= 0 or loc.flags & LOST or ino not in self.pins:
                continue
            await store.wait_dram(pages(loc.raw_len))
            await store.fetch(ino, c, loc, stage=store.dram.capacity, raw=True, want=False)
            now = store.get(ino, c)
            if now is not None and now.seq == loc.seq and now.dram_slot < 0:
                raise NoSpace()  # the tier (or the tmpfs under it) had no room for it

    async def stage_pinned(self) -> None:
        """At mount: stage the pinned files again (DRAM may have been lost)."""
        for ino in list(self.pins):
            try:
                if ino in self.ns.inodes and self.ns.inodes[ino].is_reg:
                    await self._stage(ino)
            except (ChunkError, NoSpace) as exc:
                log.warning("pinned inode %d: cannot stage it in DRAM: %s", ino,
                            exc or "no room")

    async def demote(self, ino: int) -> None:
        """Write a file's dirty chunks back and drop its DRAM copies. EBUSY if it is pinned,
        or if copies stay (the kernel reads or writes its DRAM file: passthrough)."""
        self._file(ino)
        store = self.store
        if ino in self.pins or ino in store.kernel_written:
            raise NamespaceError(errno.EBUSY)
        for _ in range(DEMOTE_TRIES):
            size = self.ns.get(ino).size
            keys = [(ino, c) for c in store.index.chunks_of(ino, store.nchunks(size))
                    if store.get(ino, c).dram_slot >= 0]
            if not keys:
                break
            dirty = [key for key in keys if not store.is_clean(key)]
            for batch in store.writeback_batches(dirty):
                await store.writeback_many(batch, drop=True)
            if ino in store.dram.pins:
                break  # written back; the kernel reads the DRAM copies: they stay
            with store.meta.write():
                for key in keys:
                    loc = store.get(*key)
                    if loc is not None and loc.dram_slot >= 0 and loc.seg:
                        store.drop_dram_copy(key)
        size = self.ns.get(ino).size
        if any(store.get(ino, c).dram_slot >= 0
               for c in store.index.chunks_of(ino, store.nchunks(size))):
            raise NamespaceError(errno.EBUSY)

    # -- access traces -------------------------------------------------------------------
    def start_trace(self, value: bytes) -> None:
        if self.readahead.tracer is not None:
            raise NamespaceError(errno.EBUSY)
        path = os.fsdecode(value)
        mount = os.path.abspath(self.settings.mountpoint)
        if not os.path.isabs(path) or os.path.commonpath([mount, os.path.abspath(path)]) == mount:
            # (the daemon must never call into its own mount: it would wait for itself)
            raise NamespaceError(errno.EINVAL)
        try:
            self.readahead.tracer = TraceRecorder(path)
        except OSError as exc:
            raise NamespaceError(exc.errno or errno.EIO) from None
        log.info("recording an access trace in %s", path)

    def stop_trace(self) -> dict | None:
        """Stop the recording under way (and complete its file); None if there is none."""
        tracer, self.readahead.tracer = self.readahead.tracer, None
        if tracer is None:
            return None
        try:
            done = tracer.stop()
        except OSError as exc:
            log.error("access trace %s: %s", tracer.path, exc)
            raise NamespaceError(exc.errno or errno.EIO) from None
        log.info("access trace %s: %d requests", tracer.path, done["requests"])
        return done

    # -- settings ------------------------------------------------------------------------
    def set_config(self, key: str, value: bytes) -> None:
        try:
            self.live.set(key, os.fsdecode(value))
        except NotLive:
            raise NamespaceError(errno.EPERM) from None
        except (UnknownSetting, ConfigError) as exc:
            log.info("config %s=%r refused: %s", key, value, exc)
            raise NamespaceError(errno.EINVAL) from None

    def status(self, paths: bool = True) -> dict:
        """Everything kvfsctl status shows; the tiers' directories only with *paths*."""
        out = self.store.stats()
        out["uptime_s"] = round(time.time() - self.started, 1)
        out["files"] = self.ns.files
        out["settings"] = {"chunk_size": self.store.cs, "cache_mode": self.settings.cache_mode}
        if paths:
            out["settings"] |= {"dram_dir": self.settings.dram_dir,
                                "nvme_dir": self.settings.nvme_dir}
        out["tiers"]["dram"] |= {"pinned_files": len(self.pins),
                                 "pinned_bytes": self.pinned_bytes(),
                                 "pin_limit_bytes": self.pin_limit}
        out["scrub"] = {"checked_copies": self.scrub.checked_copies,
                        "damaged_copies": self.scrub.damaged_copies}
        for fn in self.extra_stats:
            for section, values in fn().items():
                out.setdefault(section, {}).update(values)
        return out

    def where(self, ino: int, start: int) -> dict:
        inode = self.ns.get(ino)
        if not inode.is_reg:
            raise NamespaceError(errno.EISDIR if inode.is_dir else errno.EINVAL)
        remote = self.pod.where(ino) if self.pod is not None else None
        chunks = [c for c in (self.store.where(ino, inode.size) if remote is None else remote)
                  if c["chunk"] >= start]
        page, rest = chunks[:WHERE_PAGE], chunks[WHERE_PAGE:]
        return {"ino": ino, "size": inode.size, "chunk_size": self.store.cs, "chunks": page,
                "next": rest[0]["chunk"] if rest else None}


def _page_start(name: bytes, base: bytes) -> int:
    """START of virtual name BASE[.START] (0 without it); ENODATA if it is not a number."""
    if name == base:
        return 0
    try:
        return int(name[len(base) + 1:])
    except ValueError:
        raise NamespaceError(errno.ENODATA) from None
