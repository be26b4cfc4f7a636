"""The pod's files in this mount (issue 35): what the FUSE operations ask of the pod tier.

fs calls this room as it calls `kvfs.passthrough`; it calls the namespace, the store and the
pod's member (`kvfs/store/pod.py`), never fs. Data flows one way: down from fs, and the pod
room never calls back.

- Publishing: `due(ino)` at a writable handle's close and after a rename; SETTLE_S later
  (`run`), once no writer has the file open and what the kernel wrote into its DRAM file is
  taken, its chunks are read through the store, encoded as records in a worker thread and
  queued with `Pod.publish` under the name the file has *then*: a temp name renamed within
  SETTLE_S of its close is never published. Files the pod did not take because it was away
  are due again when it is back (`_republish`).
- Lookups of names not in a directory (`lookup`): on a pod hit the file appears, its inode
  flagged REMOTE (its size, mode and mtime from the head, no chunks). Its first open fetches
  it whole (`fetch`), every record checked, and writes it into the store as if written here
  (without holes: decoded straight into its DRAM file and sealed in one commit,
  `_fetch_into_dram`);
  a failed fetch (gone, damaged, too slow) is a miss: the name goes and the open answers
  ENOENT. Per file, not per chunk.
- A file fetched from the pod (`imported`, in memory) follows later versions while nobody
  has it open and it is not changed here: a LOOKUP that finds a newer head (`changed`) makes
  it REMOTE again with that head (`replace`).
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Awaitable, Callable

import trio

from kvfs.namespace import REMOTE, ROOT_INODE, Inode, Namespace
from kvfs.store.chunkstore import ChunkStore
from kvfs.store.location import LOST, TAIL_LOST
from kvfs.store.nvme import HEADER_SIZE
from kvfs.store.pod import Landing, Pod, PodHead, record_of
from kvfs.store.writes import WritePlan

log = logging.getLogger(__name__)

# A closed file is published this long after its close (or rename), under its name then:
# engines write a temp file, close it and rename it at once.
SETTLE_S = 0.1
# Files waiting to be published at most; more are dropped (and counted) rather than queued.
DUE_MAX = 4096
# Directory levels a published path may have.
DEPTH_MAX = 64
# A version of a file whose fetch found it damaged is a miss for this long (one whose fetch
# failed otherwise, gone or too slow or a dead member's, for the pod's miss_ttl); at most
# FAILED_MAX of them: lookups do not bring back at once what the open could not give.
DAMAGED_TTL_S = 10.0
FAILED_MAX = 4096


class PodFiles:
    """Attributes:
        pod       this mount's member of the pod
        remote    inodes found in the pod, not fetched yet (ino -> head)
        imported  inodes fetched from the pod (ino -> (head version, mtime_ns they got)),
                  until changed here; in memory only
    """

    def __init__(self, pod: Pod, ns: Namespace, store: ChunkStore) -> None:
        self.pod = pod
        self.ns = ns
        self.store = store
        self.remote: dict[int, PodHead] = {}
        self.imported: dict[int, tuple[int, int]] = {}
        self.chunks_from_pod = 0
        self._fetching: dict[int, trio.Event] = {}
        self._failed: dict[str, tuple[int, float]] = {}  # path -> (version, until when)
        self._due: dict[int, float] = {}  # ino -> when it may be published, soonest first
        self._wakeup = trio.Event()

    # -- paths ----------------------------------------------------------------------------

    def path_of(self, ino: int) -> str | None:
        """*ino*'s path relative to the mount (its first name, for hard links), or None if
        it has none or it is not UTF-8."""
        parts: list[bytes] = []
        while ino != ROOT_INODE:
            names = self.ns.names_of(ino)
            if not names or len(parts) >= DEPTH_MAX:
                return None
            ino, name = min(names)
            parts.append(name)
        try:
            return b"/".join(reversed(parts)).decode()
        except UnicodeDecodeError:
            return None

    def _path_in(self, parent: int, name: bytes) -> str | None:
        base = "" if parent == ROOT_INODE else self.path_of(parent)
        if base is None:
            return None
        try:
            return f"{base}/{name.decode()}" if base else name.decode()
        except UnicodeDecodeError:
            return None

    # -- publishing -----------------------------------------------------------------------

    def due(self, ino: int) -> None:
        """*ino* may be complete (a writable handle's close, a rename): publish it soon."""
        self._due.pop(ino, None)
        if len(self._due) >= DUE_MAX:
            self.pod.counters.dropped += 1
            return
        self._due[ino] = time.monotonic() + SETTLE_S
        self._wakeup.set()

    async def run(self, settled: Callable[[int], Awaitable[Inode | None]]) -> None:
        """Publish the files due, each once its time came. *settled(ino)*: the inode once
        what the kernel wrote is taken, None if it is gone or a writer has it open (its
        close makes it due again)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._republish)
            await self._publish_due(settled)

    async def _republish(self) -> None:
        """Each time the pod is back (or first up), the files it missed are due again."""
        while True:
            await self.pod.wait_up()
            for ino in list(self.pod.unpublished):
                self.due(ino)
            await self.pod.wait_down()

    async def _publish_due(self, settled: Callable[[int], Awaitable[Inode | None]]) -> None:
        while True:
            if not self._due:
                await self._wakeup.wait()
                self._wakeup = trio.Event()
                continue
            ino, when = next(iter(self._due.items()))
            wait = when - time.monotonic()
            if wait > 0:
                await trio.sleep(wait)
                continue  # (it may have been made due again meanwhile)
            del self._due[ino]
            try:
                node = await settled(ino)
                if node is not None and ino not in self.remote:
                    await self._publish(node)
            except Exception:
                log.exception("pod: publishing inode %d failed", ino)

    async def _publish(self, node: Inode) -> None:
        """Queue the file's records (holes are left out): a chunk with an NVMe copy as its
        record is stored there (read and checked, not encoded again); a chunk only in DRAM
        read through the store and encoded in a worker thread as writeback would. A file
        changed meanwhile is not published (its close is due)."""
        ino, size, version = node.ino, node.size, node.mtime_ns
        path = self.path_of(ino)
        if path is None:
            return
        if not self.pod.up:
            self.pod.defer(ino)  # published when the pod is back
            return
        if not self.pod.can_take(size):
            return
        cs = self.store.cs

        def changed() -> bool:
            return node.mtime_ns != version or node.size != size or not node.nlink

        records: dict[int, bytes] = {}
        raw: list[tuple[int, bytes]] = []
        for c in range(self.store.nchunks(size)):
            loc = self.store.get(ino, c)
            if loc is None:
                continue  # a hole
            if loc.seg and not loc.flags & (LOST | TAIL_LOST):
                record = await self.store.nvme_record(ino, c, loc)
                if record is None:
                    return  # the chunk changed
                records[c] = record
            else:
                data = await self.store.read(ino, c * cs, cs, size)
                raw.append((c, bytes(data)))  # (a view of the store's scratch: copied now)
            if changed():
                return
        if raw:
            hint = self.ns.inherited_hint(ino, b"user.kvfs.dtype")
            hint_text = hint.decode(errors="replace") if hint else None
            codec = self.store.codec
            records |= await trio.to_thread.run_sync(
                lambda: {c: record_of(c, b, codec, hint_text) for c, b in raw})
            if changed():
                return
        self.pod.publish(path, sorted(records.items()), version=version, mode=node.mode,
                         size=size, mtime_ns=version, chunk_size=cs, tag=ino)

    # -- lookups --------------------------------------------------------------------------

    async def lookup(self, parent: int, name: bytes) -> Inode | None:
        """A file *name* in *parent* that some member published: it appears here (REMOTE),
        or None. Waits at most the pod's timeout."""
        path = self._path_in(parent, name)
        if path is None:
            return None
        head = await self.pod.lookup(path)
        if head is None or not stat.S_ISREG(head.mode) or self._failed_before(head):
            return None
        ino = self.ns.lookup(parent, name)  # created here meanwhile?
        if ino is not None:
            return self.ns.get(ino)
        d = self.ns.get(parent)
        with self.ns.meta.write():  # one commit: never an empty file without REMOTE
            # (owned by the directory's owner: no set-id bit another member asks for)
            node = self.ns.create(parent, name, stat.S_IFREG | (head.mode & 0o777), d.uid,
                                  d.gid)
            node.size, node.mtime_ns, node.flags = head.size, head.mtime_ns, REMOTE
            self.ns.save(node)
        self.remote[node.ino] = head
        return node

    async def fetch(self, node: Inode) -> bool:
        """Bring a REMOTE file's bytes into the store (for others, only wait for a fetch or
        `replace` under way); False if the pod does not give them (gone, damaged, too
        slow): the caller removes its names."""
        ino = node.ino
        while (busy := self._fetching.get(ino)) is not None:
            await busy.wait()
        head = self.remote.get(ino)
        if head is None:
            return True
        done = self._fetching[ino] = trio.Event()
        try:
            damaged = self.pod.counters.damaged
            plan = self._plan_landing(ino, head)
            if plan is None:
                got = await self._fetch_and_write(ino, head)
            else:
                got = await self._fetch_into_dram(plan, head)
            if got is None:
                self.remote.pop(ino, None)
                ttl = (DAMAGED_TTL_S if self.pod.counters.damaged > damaged
                       else self.pod.miss_ttl)
                self._failed.pop(head.path, None)
                self._failed[head.path] = (head.version, time.monotonic() + ttl)
                while len(self._failed) > FAILED_MAX:
                    del self._failed[next(iter(self._failed))]
                return False
            await self.store.seal(ino, head.size)
            node.flags &= ~REMOTE
            self.ns.save(node)
            self.remote.pop(ino, None)
            self.imported[ino] = (head.version, node.mtime_ns)
            self.chunks_from_pod += got
            return True
        finally:
            del self._fetching[ino]
            done.set()

    def _plan_landing(self, ino: int, head: PodHead) -> WritePlan | None:
        """The store's direct write of a whole fetched file whose head lists every chunk
        (no hole), or None: it has holes, or the store wants the ordinary path."""
        n = -(-head.size // head.chunk_size)
        if not n or [c for c, _, _ in head.entries] != list(range(n)):
            return None
        return self.store.plan_write(ino, 0, head.size)

    async def _fetch_into_dram(self, plan: WritePlan, head: PodHead) -> int | None:
        """Fetch *head*'s file straight into its planned DRAM regions: the decoding threads
        write each chunk there from their own buffers, and one commit seals them with the
        checksums of the bytes written (nothing is hashed twice). The chunks fetched, or
        None (a miss; the regions given back). The fetch awaits between plan_write and
        finish_write, which the shim never does: nothing else changes a REMOTE file's
        chunks meanwhile (its opens and truncations wait for this fetch, an unlink for
        the open that runs it; nothing else writes it), and finish_write checks that its
        chunks are as planned. The room plan_write found is not held meanwhile: another
        writer may take it too (DRAM over its size by at most this file)."""
        held = self.store.dram.hold(plan.ino)
        landing = Landing(held.fd)
        try:
            async with self.pod.fetched(head, landing) as got:
                pass
        except BaseException:
            landing.cancel()
            self.store.abort_write(plan)
            raise
        finally:
            self.store.dram.drop(held)
        if got is None:
            landing.cancel()  # (a fetch abandoned on its timeout may still be decoding)
            self.store.abort_write(plan)
            return None
        self.store.finish_write(plan, None, got.checksums)
        return len(got.checksums)

    async def _fetch_and_write(self, ino: int, head: PodHead) -> int | None:
        """Fetch *head*'s file and write it through the store chunk by chunk (a file with
        holes, or one the direct path does not take). The chunks fetched, or None."""
        async with self.pod.fetched(head) as got:
            if got is None:
                return None
            cs = head.chunk_size
            for c, raw in sorted(got.chunks.items()):
                pos = 0
                while pos < len(raw):  # (a short write: what failed is raised next)
                    pos += await self.store.write(ino, c * cs + pos, raw[pos:])
            return len(got.chunks)

    def _failed_before(self, head: PodHead) -> bool:
        failed = self._failed.get(head.path)
        if failed is None:
            return False
        if failed[0] == head.version and failed[1] > time.monotonic():
            return True
        del self._failed[head.path]
        return False

    async def emptied(self, node: Inode) -> None:
        """A REMOTE file opened with O_TRUNC: an empty local file, nothing fetched. A fetch
        another open started goes first (it would commit the pod's bytes into the emptied
        file); the file is then local, and the open truncates it like any other."""
        while (busy := self._fetching.get(node.ino)) is not None:
            await busy.wait()
        if self.remote.pop(node.ino, None) is None:
            return
        node.resize(0, holes=False)
        node.flags &= ~REMOTE
        node.mtime_ns = node.ctime_ns = time.time_ns()
        self.ns.save(node)

    async def changed(self, node: Inode) -> PodHead | None:
        """The pod's newer head of a file fetched from it, if it has one and the file is
        still as fetched and closed; None otherwise."""
        ino = node.ino
        had = self.imported.get(ino)
        if had is None:
            return None
        if node.mtime_ns != had[1]:
            del self.imported[ino]  # changed here: it is this mount's file now
            return None
        path = self.path_of(ino)
        head = await self.pod.lookup(path) if path is not None else None
        if (head is None or head.version == had[0] or not stat.S_ISREG(head.mode)
                or self._failed_before(head)
                or self.imported.get(ino) != had or node.mtime_ns != had[1] or node.opens
                or not node.nlink):
            return None
        return head

    async def replace(self, node: Inode, head: PodHead) -> None:
        """A fetched file becomes REMOTE again, with *head* (`changed`). An open meanwhile
        waits (`fetch`) and then fetches the new version."""
        ino = node.ino
        if ino in self._fetching:
            return

        def remote() -> None:
            node.resize(head.size, holes=True)
            node.mtime_ns, node.flags = head.mtime_ns, REMOTE
            self.ns.save(node)

        done = self._fetching[ino] = trio.Event()
        try:
            await self.store.truncate(ino, node.size, 0, on_commit=remote)
            self.imported.pop(ino, None)
            self.remote[ino] = head
        finally:
            del self._fetching[ino]
            done.set()

    def forgotten(self, ino: int) -> None:
        """*ino*'s data is freed."""
        self.remote.pop(ino, None)
        self.imported.pop(ino, None)
        self._due.pop(ino, None)
        self.pod.unpublished.pop(ino, None)

    def entry_timeout(self, ino: int) -> float | None:
        """How long the kernel may keep *ino*'s entry and attributes, if it must ask again
        sooner than for a local file: a REMOTE file at every use (a failed fetch takes its
        name away; a kernel still holding the entry would send a create of that name to the
        gone inode, ENOENT), a fetched one after hit_ttl (a newer version in the pod
        replaces it)."""
        if ino in self.remote:
            return 0.0
        return self.pod.hit_ttl if ino in self.imported else None

    # -- status ---------------------------------------------------------------------------

    def where(self, ino: int) -> list[dict] | None:
        """`kvfsctl where`'s chunks of a REMOTE file (by the publisher's chunk size)."""
        head = self.remote.get(ino)
        if head is None:
            return None
        cs = head.chunk_size
        return [{"chunk": c, "tiers": ["pod"], "packed": False,
                 "raw_len": min(cs, head.size - c * cs), "stored_len": length - HEADER_SIZE,
                 "codec": None, "segment": None, "dirty": False, "lost": False}
                for c, _, length in head.entries]

    def stats(self) -> dict:
        return {"pod": self.pod.status(), "reads": {"chunks_from_pod": self.chunks_from_pod}}
