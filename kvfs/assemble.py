"""Wiring: build the metadata store, tiers, policies and FUSE operations for one mount, and
run the daemon's trio tasks. Owning the object graph in one place keeps every other module
free of construction details."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket

import pyfuse3
import trio

from kvfs.collector import CycleCollector
from kvfs.config import ConfigError, Settings
from kvfs.control import Control
from kvfs.faults import Faults
from kvfs.fs import Operations
from kvfs.liveconfig import LiveConfig
from kvfs.namespace import PIN_XATTR, REMOTE, ROOT_INODE, Namespace
from kvfs.podfiles import PodFiles
from kvfs.readahead import Readahead
from kvfs.store import fileinfo
from kvfs.store.chunkstore import ChunkStore
from kvfs.store.codec import Codec, CodecPolicy
from kvfs.store.describe import Redescriber
from kvfs.store.dram import OPEN_FILES
from kvfs.store.events import StoreEvents
from kvfs.store.fetch import StageWatch
from kvfs.store.fileinfo import Component, FileInfo
from kvfs.store.gc import Cleaner
from kvfs.store.meta import MetaStore
from kvfs.store.pod import Pod, PodUnavailable
from kvfs.store.streams import LifetimeClassifier, StreamTable
from kvfs.tiering import Demoter, DramPolicy, FileEvictor

log = logging.getLogger(__name__)

# Dirty DRAM data older than this is written back to NVMe in the background, so that a
# reboot loses at most this much unsynced work (like the kernel's dirty_expire).
WRITEBACK_AGE_S = 30.0


class _Events(StoreEvents):
    """The store's calls up (kvfs/store/events.py), forwarded to what the assembly builds
    after the store: the namespace, passthrough, the demoter, placement, the cleaner. Until
    each exists, the base class's answer stands."""

    def __init__(self, asm: Assembly) -> None:
        self.asm = asm

    def changing(self, ino: int) -> None:
        if self.asm.ops is not None:
            self.asm.ops.pt.revoke(ino)

    def staged(self, ino: int) -> None:
        if self.asm.ops is not None:
            self.asm.ops.pt.staged(ino)

    def stage_watch(self, ino: int, c: int, fd: int) -> StageWatch | None:
        return self.asm.ops.pt.stage_watch(ino, c, fd) if self.asm.ops is not None else None

    def dram_filling(self) -> None:
        if self.asm.demoter is not None:
            self.asm.demoter.kick()

    def file_deleted(self, ino: int) -> None:
        if self.asm.classifier is not None:
            self.asm.classifier.deleted(ino)

    async def make_nvme_room(self) -> bool:
        return self.asm.cleaner is not None and await self.asm.cleaner.make_room()

    def size_of(self, ino: int) -> int | None:
        return self.asm.size_of(ino)

    def codec_context(self, ino: int) -> tuple[str | None, int | None]:
        return self.asm.codec_context(ino)

    def file_info(self, ino: int) -> bytes:
        return self.asm.file_info(ino)

    def stream_of(self, ino: int) -> int:
        return self.asm.classifier.stream_of(ino) if self.asm.classifier is not None else 0


class Assembly:
    def __init__(self, s: Settings, dram_open_files: int = OPEN_FILES) -> None:
        self.settings = s
        self.faults = Faults(s.crash_at, s.fetch_delay)  # (tests only)
        self.meta = MetaStore(os.path.join(s.nvme_dir, "meta"), map_size=s.meta_size,
                              reserve=max(1 << 20, min(32 << 20, s.nvme_size // 32)))
        sb = self.meta.load_superblock()
        if sb is None:
            sb = self.meta.create_superblock(s.chunk_size, s.segment_size)
            log.info("created a new kvfs in %s (uuid %s)", s.nvme_dir, sb["uuid"])
        elif sb["chunk_size"] != s.chunk_size and s.extra.get("chunk_size_given"):
            raise ConfigError(f"{s.nvme_dir} was made with chunk_size {sb['chunk_size']}; "
                              f"it cannot change to {s.chunk_size}")
        self.policy = DramPolicy(s.dram_size // sb["chunk_size"])
        self.ns = self.ops = self.demoter = self.classifier = self.cleaner = None
        self.store = ChunkStore(
            self.meta, sb["uuid"], chunk_size=sb["chunk_size"], dram_dir=s.dram_dir,
            dram_size=s.dram_size, nvme_dir=s.nvme_dir, nvme_size=s.nvme_size,
            segment_size=sb["segment_size"],
            # verify=False: the store checks the xxh3 of every decoded chunk itself
            codec=Codec(CodecPolicy(enabled=s.compress, verify=False)),
            io_threads=s.io_threads, policy=self.policy, dram_compress=s.dram_compress,
            dram_verify=s.dram_verify, read_through_min=s.read_through_min,
            dram_open_files=dram_open_files, faults=self.faults, events=_Events(self))
        # (pins: the pinned files, below, once the namespace is loaded)
        self.policy.pinned = lambda key: key[0] in self.store.dram.pins or key[0] in pins
        self.ns = Namespace(self.meta)
        for ino, (size, holes) in self.store.recovered_sizes.items():
            inode = self.ns.inodes.get(ino)
            if inode is not None:  # a file written straight into DRAM when the daemon stopped
                inode.resize(size, holes=holes)
                self.ns.save(inode)
        pins = self.ns.hinted(PIN_XATTR)  # files an operator pinned (kvfsctl pin)
        # Files found in the pod and not fetched (or fetched part way) when the daemon
        # stopped: they have a size and no (or some) chunks. They go (as orphans, below): a
        # lookup finds them in the pod again.
        for inode in [i for i in self.ns.inodes.values() if i.flags & REMOTE]:
            for parent, name in list(self.ns.names_of(inode.ino)):
                self.ns.remove(parent, name, want_dir=False)
        self.pod = self.podfiles = None
        if s.pod:
            self.pod = self._pod(s)
            self.podfiles = PodFiles(self.pod, self.ns, self.store)
        self.evictor = None
        extra = []
        self.store.prefetch_limiter.total_tokens = s.prefetch_concurrency
        self.readahead = Readahead(
            self.store, depth=s.readahead_chunks, enabled=s.prefetch,
            bandwidth=s.prefetch_bandwidth, size_of=self.size_of, meta=self.meta)
        extra.append(self.readahead.stats)
        self.demoter = Demoter(self.store, high=s.dram_high_watermark, low=s.dram_low_watermark,
                               writeback_age=WRITEBACK_AGE_S)
        self.control = Control(self.ns, self.store, s, self.readahead, extra, pod=self.podfiles,
                               live=LiveConfig(s, self.store, self.demoter, self.readahead),
                               faults=self.faults)
        # after a rename, a record of the file's new name for fsck.kvfs --rebuild
        self.redescriber = Redescriber(self.store, self.ns)
        extra.append(self.redescriber.stats)
        self.ops = Operations(self.ns, self.store, self.control, self.readahead,
                              cache_mode=s.cache_mode, faults=self.faults, pod=self.podfiles,
                              renamed=self.redescriber.renamed)
        if self.podfiles is not None:
            extra.append(self.podfiles.stats)
        # opens answered by the shim's front thread, without waiting for the trio thread
        extra.append(self.ops.pt.stats)
        if s.cache_mode:
            self.evictor = FileEvictor(self.ops.remove_file, self.store.file_bytes)
            self.ops.evictor = self.evictor
            self.evictor.pinned = pins.__contains__
            files = sorted((i for i in self.ns.inodes.values() if i.is_reg and i.nlink),
                           key=lambda i: i.mtime_ns)
            for inode in files:
                self.evictor.touch(inode.ino)
            extra.append(lambda: {"evictions": {"files": self.evictor.evicted_files,
                                                "bytes": self.evictor.evicted_bytes,
                                                "examined_files": self.evictor.examined}})
        # keys the searches for victims looked at, index entries walked past by requests
        # for a file's chunks: per chunk demoted or file written, neither may grow with what
        # the mount holds (issue 33)
        extra.append(lambda: {"moves": {"demotion_passes": self.demoter.passes,
                                        "victim_keys_examined": self.policy.examined},
                              "index": {"scanned_entries": self.store.index.scanned}})
        # Placement streams (issue 5): classify files, hint segment files, clean per stream.
        self.streams = StreamTable.make(s.streams)
        self.classifier = LifetimeClassifier(
            self.ns, self.streams, lambda: self.store.counters.user_bytes_written,
            self.store.nvme.capacity)
        self.store.nvme.stream_hints = dict(enumerate(self.streams.hints))
        self.cleaner = Cleaner(self.store, self.streams, faults=self.faults,
                               class_of=self.classifier.known_class)
        extra += [self.cleaner.stats, self.classifier.stats]
        self.store.high_water = int(s.dram_high_watermark * s.dram_size)
        # Files unlinked while open when the daemon last stopped: nobody can reach them now.
        for inode in self.ns.orphans():
            self.store.delete_file(inode.ino, inode.size)
            self.ns.forget_inode(inode)
        self.readahead.load()
        self.collector = CycleCollector(lambda: self.ops.requests)
        extra.append(self.collector.stats)
        self.left_in_dram = 0  # bytes the unmount could not write back (`run`)
        self.metrics = None  # the daemon's MetricsServer (-o metrics), bound before we were

    @staticmethod
    def _pod(s: Settings) -> Pod:
        """This mount's member of the pod at s.pod. Its name is unique in the pod: this
        host, this mount, this daemon (a restarted daemon is a new member)."""
        mount = hashlib.blake2b(os.path.realpath(s.mountpoint).encode(), digest_size=4).hexdigest()
        member = f"{socket.gethostname()}-{mount}-{os.getpid()}"
        try:
            return Pod(s.pod, s.pod_name, member, s.pod_segment_size, timeout=s.pod_timeout,
                       metrics=s.pod_metrics or None, replicas=s.pod_replicas)
        except PodUnavailable as e:
            raise ConfigError(f"-o pod={s.pod}: {e}") from None

    def size_of(self, ino: int) -> int | None:
        if self.ns is None:  # (while the store loads)
            return None
        inode = self.ns.inodes.get(ino)
        return inode.size if inode is not None and inode.is_reg else None

    def codec_context(self, ino: int) -> tuple[str | None, int | None]:
        """A file's dtype hint (user.kvfs.dtype, inherited) and the directory it is in."""
        if self.ns is None:
            return None, None
        up = self.ns.ancestors(ino)
        value = self.ns.inherited_hint(ino, b"user.kvfs.dtype", up)
        return (value.decode(errors="replace") if value else None), (up[0] if up else None)

    def file_info(self, ino: int) -> bytes:
        """What a record of *ino* carries so that a rebuild finds the file again
        (kvfs/store/fileinfo.py): its attributes, chunks and path (its first name)."""
        if self.ns is None:
            return b""
        inode = self.ns.inodes.get(ino)
        if inode is None or not inode.is_reg:
            return b""
        path = []
        node = inode
        while True:
            names = self.ns.names_of(node.ino)
            if node.ino == ROOT_INODE:
                name = b""
            elif not names:
                return b""  # unlinked: nothing to find again
            else:
                name = min(names)[1]
            path.append(Component(node.ino, node.mode, node.uid, node.gid, name))
            if node.ino == ROOT_INODE or len(path) > 4096:
                break
            node = self.ns.inodes[min(names)[0]]
        store = self.store
        chunks = fileinfo.bitmap(store.index.chunks_of(ino, store.nchunks(inode.size)))
        return fileinfo.pack(FileInfo(
            store.chunks.next_seq(), inode.mode, inode.uid, inode.gid, inode.size,
            inode.mtime_ns, inode.ctime_ns, chunks, tuple(reversed(path))))

    async def run(self) -> None:
        self.collector.install()  # after loading: what the mount loaded is never scanned again
        if self.metrics is not None:  # scrapes read the status on this thread, between tasks
            self.metrics.collector.attach(trio.lowlevel.current_trio_token(),
                                          lambda: self.control.status(paths=False))
        try:
            async with trio.open_nursery() as nursery:
                self.start_tasks(nursery)
                nursery.start_soon(self._signals)
                nursery.start_soon(self.collector.run)
                # Enough request tasks that a slow NVMe read never holds up a DRAM hit.
                await pyfuse3.main(min_tasks=8, max_tasks=64)
                await self.finish()
                nursery.cancel_scope.cancel()
            if self.pod is not None:
                await self.pod.close()  # leave the pod (files not yet published are not)
        finally:
            if self.metrics is not None:
                self.metrics.collector.detach()

    def start_tasks(self, nursery: trio.Nursery) -> None:
        """Start the mount's background work in *nursery*: the daemon's, around
        pyfuse3.main, or a test's that calls the operations without a mount (tests/unit)."""
        self.store.through.start_tasks(nursery.start_soon)  # read-ahead of read-through files
        self.ops.spawn = nursery.start_soon  # punched holes
        nursery.start_soon(self.demoter.run)
        nursery.start_soon(self.redescriber.run)
        nursery.start_soon(self.cleaner.run)
        nursery.start_soon(self.readahead.run)
        nursery.start_soon(self.store.run_disposals)
        nursery.start_soon(self.ops.pt.run_takes)
        nursery.start_soon(self.ops.pt.watch_mapped)
        nursery.start_soon(self.control.stage_pinned)  # pinned files back in DRAM
        if self.pod is not None:
            nursery.start_soon(self.pod.run)
            nursery.start_soon(self.podfiles.run, self.ops.settled)

    async def finish(self) -> None:
        """An unmount, once no request can come any more: the files the kernel wrote are
        taken, every dirty chunk is written back (`left_in_dram`: the bytes that could not
        be), the records of renamed files' new names are written, the read-ahead's learned
        order is saved."""
        await self.ops.pt.finish_mapped()  # (and every other take)
        log.info("unmounting: writing dirty chunks back to NVMe")
        self.left_in_dram = await self.store.writeback_all()
        await self.redescriber.flush()
        self.readahead.save()
        self.control.stop_trace()  # (a recording under way ends complete)

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            async for sig in sigs:
                log.info("signal %d: unmounting %s", sig, self.settings.mountpoint)
                pyfuse3.terminate()
                return

    def close(self) -> None:
        self.collector.uninstall()
        self.store.close()
        self.meta.close()
