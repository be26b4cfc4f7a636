"""The unit tier: kvfs without FUSE. Runs as any user, on a machine without /dev/fuse.

Each test builds what the daemon builds for a mount (`kvfs.assemble.Assembly`: the lmdb
metadata, the chunk store with its DRAM and NVMe tiers, the namespace, `kvfs.fs.Operations`)
in directories of its own, runs the mount's background tasks (demotion, cleaning, prefetch,
disposals) around itself, and calls the FUSE handlers as the kernel's requests would, as
S3QL's tests/t3_fs_api.py drives its Operations. Nothing is mounted: pyfuse3 is imported
for its types only, and no test opens /dev/fuse. The DRAM tier is an ordinary directory
here (tmpfs is the daemon's requirement, for RAM; the store only needs sparse files).

`async def` tests run in `trio.run` (`pytest_pyfunc_call` below), each within TEST_DEADLINE_S
(a hang fails instead of blocking the suite). A crash of the daemon is a child process that
mounts the same directories, does what the test asks and dies by SIGKILL (`Tiers.crash`),
at a crash point of kvfs/faults.py if the test names one; the test then mounts again and
finds what the recovery made of it.

The mount tests (tests/ and its other folders, with tests/conftest.py's `kv`) stay: they
cover what needs the kernel (passthrough, the shim's front thread, the page cache, mmap).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyfuse3
import pytest
import trio

from kvfs.assemble import Assembly
from kvfs.config import Settings
from kvfs.fsck import check
from kvfs.nursery import open_nursery

# The tiers of tests/conftest.py's mounts: a few MiB of writes demote to NVMe, and 64 KiB
# chunks make multi-chunk files of small ones.
SMALL = {"dram_size": "4M", "nvme_size": "64M", "chunk_size": "64K", "segment_size": "1M",
         "meta_size": "64M"}
# The kernel sends a direct_io file's reads and writes in requests of at most this much.
MAX_REQUEST = 1 << 20
TEST_DEADLINE_S = 120.0
CHILD_FAILED = 3  # a crash child's exit code when the test's script failed before its crash


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run an `async def` test in trio.run, within TEST_DEADLINE_S."""
    fn = pyfuncitem.obj
    if not inspect.iscoroutinefunction(fn):
        return None
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

    async def bounded() -> None:
        with trio.fail_after(TEST_DEADLINE_S):
            await fn(**kwargs)

    trio.run(bounded)
    return True


@dataclass
class Ctx:
    """A request's caller (what pyfuse3.RequestContext carries; Python cannot make one)."""
    uid: int = 0
    gid: int = 0
    pid: int = field(default_factory=os.getpid)
    umask: int = 0o022


ROOT = Ctx()


@dataclass
class Fields:
    """Which attributes a SETATTR changes (pyfuse3.SetattrFields, which Python cannot make)."""
    update_size: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False


class Kvfs:
    """A mounted kvfs without the mount: `ops` answers what the kernel would ask, and the
    helpers below ask it by path, as a process's system calls would make the kernel do."""

    ctx = ROOT  # the caller of requests a test makes without naming one

    def __init__(self, asm: Assembly) -> None:
        self.asm = asm
        self.ops = asm.ops
        self.store = asm.store
        self.ns = asm.ns

    @staticmethod
    def caller(**ids) -> Ctx:
        """A caller other than root (uid, gid, umask: Ctx's fields)."""
        return Ctx(**ids)

    # -- names -----------------------------------------------------------------------------
    async def lookup(self, path: str, ctx: Ctx = ROOT) -> int:
        """The inode of *path* (relative to the root), looked up name by name as the kernel
        does; FUSEError ENOENT if a name is absent (kvfs answers a cached negative entry)."""
        ino = pyfuse3.ROOT_INODE
        for name in filter(None, path.split("/")):
            attr = await self.ops.lookup(ino, name.encode(), ctx)
            if attr.st_ino == 0:
                # what the kernel answers for us: kvfs cached a negative entry
                raise pyfuse3.FUSEError(errno.ENOENT)
            ino = attr.st_ino
        return ino

    async def parent_of(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rstrip("/").rpartition("/")
        return await self.lookup(head), name.encode()

    async def getattr(self, path: str) -> pyfuse3.EntryAttributes:
        return await self.ops.getattr(await self.lookup(path), ROOT)

    async def size(self, path: str) -> int:
        return (await self.getattr(path)).st_size

    async def mkdir(self, path: str, mode: int = 0o755, ctx: Ctx = ROOT) -> int:
        parent, name = await self.parent_of(path)
        return (await self.ops.mkdir(parent, name, mode, ctx)).st_ino

    async def unlink(self, path: str, ctx: Ctx = ROOT) -> None:
        parent, name = await self.parent_of(path)
        await self.ops.unlink(parent, name, ctx)

    async def rename(self, old: str, new: str, flags: int = 0) -> None:
        old_parent, old_name = await self.parent_of(old)
        new_parent, new_name = await self.parent_of(new)
        await self.ops.rename(old_parent, old_name, new_parent, new_name, flags, ROOT)

    async def listdir(self, path: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
        """The names READDIR gives (pyfuse3.readdir_reply sends them to the kernel, which
        there is none of here: *monkeypatch* collects them instead)."""
        names: list[str] = []

        def reply(token, name: bytes, attr, next_id: int) -> bool:
            names.append(name.decode())
            return True

        monkeypatch.setattr(pyfuse3, "readdir_reply", reply)
        fh = await self.ops.opendir(await self.lookup(path), ROOT)
        try:
            await self.ops.readdir(fh, 0, None)
        finally:
            await self.ops.releasedir(fh)
        return names

    # -- files -----------------------------------------------------------------------------
    async def create(self, path: str, mode: int = 0o644, flags: int = os.O_RDWR,
                     ctx: Ctx = ROOT) -> int:
        """A new file, open (O_CREAT|O_EXCL: the kernel looked it up first); its handle."""
        parent, name = await self.parent_of(path)
        fi, _ = await self.ops.create(parent, name, mode, flags | os.O_CREAT, ctx)
        return fi.fh

    async def open(self, path: str, flags: int = os.O_RDONLY, ctx: Ctx = ROOT) -> int:
        return (await self.ops.open(await self.lookup(path), flags, ctx)).fh

    async def write(self, fh: int, off: int, data: bytes) -> int:
        """write(2) at *off*, in the requests the kernel would send."""
        done = 0
        while done < len(data):
            piece = data[done:done + MAX_REQUEST]
            n = await self.ops.write(fh, off + done, piece)
            done += n
            if n < len(piece):
                break
        return done

    async def read(self, fh: int, off: int, size: int) -> bytes:
        """read(2) at *off* (short at the end of the file), in requests as the kernel's."""
        parts = []
        while size > 0:
            # (a reply may be a view of the store's scratch buffer: copied at once)
            got = bytes(await self.ops.read(fh, off, min(size, MAX_REQUEST)))
            parts.append(got)
            if len(got) < min(size, MAX_REQUEST):
                break
            off, size = off + len(got), size - len(got)
        return b"".join(parts)

    async def release(self, fh: int) -> None:
        await self.ops.release(fh)

    async def fsync(self, fh: int) -> None:
        await self.ops.fsync(fh, False)

    async def write_file(self, path: str, data: bytes, *, fsync: bool = False,
                         at: int = 0) -> int:
        """Write *data* at *at* into *path* (created if absent, else opened without
        O_TRUNC), then close it; returns its inode. A short write is followed by another
        from where it stopped, as Python's and stdio's writers do."""
        try:
            fh = await self.open(path, os.O_WRONLY)
        except pyfuse3.FUSEError as exc:
            if exc.errno != errno.ENOENT:
                raise
            fh = await self.create(path, flags=os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                n = await self.write(fh, at + done, data[done:])
                assert n > 0, "a write of nothing"
                done += n
            if fsync:
                await self.fsync(fh)
        finally:
            await self.release(fh)
        return await self.lookup(path)

    async def read_file(self, path: str) -> bytes:
        fh = await self.open(path)
        try:
            return await self.read(fh, 0, await self.size(path) + 1)
        finally:
            await self.release(fh)

    async def setattr(self, path: str, fh: int | None = None, ctx: Ctx = ROOT,
                      **values) -> pyfuse3.EntryAttributes:
        """SETATTR of the attributes given as st_* values (st_size=0: a truncation)."""
        attr = pyfuse3.EntryAttributes()
        fields = Fields()
        for key, value in values.items():
            setattr(attr, key, value)
            short = key.removeprefix("st_").removesuffix("_ns")
            setattr(fields, f"update_{short}", True)
        return await self.ops.setattr(await self.lookup(path), attr, fields, fh, ctx)

    async def truncate(self, path: str, size: int) -> None:
        await self.setattr(path, st_size=size)

    def sized(self, ino: int) -> Callable[[int, bool], None]:
        """The inode update that rides along the store's take of what the kernel wrote into
        *ino*'s DRAM file (`ChunkStore.take_kernel_written`'s on_commit; kvfs.fs makes the same)."""
        def update(size: int, holes: bool) -> None:
            node = self.ns.get(ino)
            node.resize(size, holes=holes)
            self.ns.save(node)

        return update

    # -- what kvfsctl asks ---------------------------------------------------------------------
    async def status(self) -> dict:
        return json.loads(await self.ops.getxattr(pyfuse3.ROOT_INODE, b"user.kvfs.status",
                                                  ROOT))

    async def where(self, path: str) -> list[dict]:
        ino = await self.lookup(path)
        out = json.loads(await self.ops.getxattr(ino, b"user.kvfs.where", ROOT))
        chunks = out["chunks"]
        while out["next"] is not None:
            out = json.loads(await self.ops.getxattr(
                ino, f"user.kvfs.where.{out['next']}".encode(), ROOT))
            chunks += out["chunks"]
        return chunks

    async def tiers(self, path: str) -> set[str]:
        return {t for c in await self.where(path) for t in c["tiers"]}

    # -- moves the background tasks make, made now -----------------------------------------
    async def demote_all(self) -> None:
        """Demote everything in DRAM to NVMe (the demoter's pass down to an empty tier)."""
        await self.asm.demoter.demote_until(0.0)

    @staticmethod
    async def errno_of(request: Awaitable) -> int:
        """The errno *request* fails with (as FUSEError); an AssertionError if it succeeds."""
        try:
            await request
        except pyfuse3.FUSEError as exc:
            return exc.errno
        raise AssertionError("the request succeeded")


class Tiers:
    """One kvfs's directories (DRAM tier, NVMe tier with its metadata) and its mounts."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.dram_dir = base / "dram"
        self.nvme_dir = base / "nvme"
        self.options = dict(SMALL)
        self.mounted = False

    def settings(self, **options) -> Settings:
        s = Settings(dram_dir=str(self.dram_dir), nvme_dir=str(self.nvme_dir))
        for key, value in {**self.options, **options}.items():
            setattr(s, key, value)
        return s.resolve()

    @contextlib.asynccontextmanager
    async def mount(self, **options) -> AsyncIterator[Kvfs]:
        """The tiers opened as a mount opens them (*options*: Settings fields, over SMALL),
        with its background tasks; left as an unmount leaves them (everything written back)
        unless the test failed (`asm.left_in_dram`: what the unmount could not write back).
        Only one at a time, as the daemon's lock allows."""
        assert not self.mounted, "one mount of the same tiers at a time"
        asm = Assembly(self.settings(**options))
        self.mounted = True
        try:
            async with open_nursery() as nursery:
                asm.start_tasks(nursery)
                yield Kvfs(asm)
                await asm.finish()
                nursery.cancel_scope.cancel()
        finally:
            asm.close()
            self.mounted = False

    async def crash(self, script: Callable[[Kvfs], Awaitable[None]], *, crash_at: str = "",
                    **options) -> bool:
        """A daemon that mounts the tiers, runs *script* and dies by SIGKILL: when *script*
        has returned, or, with *crash_at*, at that crash point (kvfs/faults.py), which
        *script* must reach. Nothing is written back, unmounted or closed. Returns whether
        *script* returned (False: something killed the daemon in it)."""
        assert not self.mounted, "the crash's daemon opens the tiers itself"
        # Forked from a worker thread: in the child it is the only thread, and not one that
        # runs trio already (the test's own trio.run is on the main thread).
        status = await trio.to_thread.run_sync(
            functools.partial(self._fork, script, crash_at, options))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the crash's daemon failed first (exit status {status:#x}; its traceback is "
            f"in the captured stderr)")
        returned = (self.base / "script-returned").exists()
        (self.base / "script-returned").unlink(missing_ok=True)
        assert not (crash_at and returned), f"crash point {crash_at!r} not reached"
        return returned

    def _fork(self, script, crash_at: str, options: dict) -> int:
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)  # the parent trio's, not the child's to share
                trio.run(self._crash_child, script, crash_at, options)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(CHILD_FAILED)  # (the script failed: its crash would have killed us)
        deadline = time.monotonic() + TEST_DEADLINE_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the crash's daemon hung")
            time.sleep(0.005)

    async def _crash_child(self, script, crash_at: str, options: dict) -> None:
        async with self.mount(crash_at=crash_at, **options) as kv:
            await script(kv)
            (self.base / "script-returned").touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def lose_dram(self) -> None:
        """Empty the DRAM tier, as a reboot does (no mount may be open)."""
        assert not self.mounted
        shutil.rmtree(self.dram_dir, ignore_errors=True)

    def fsck(self) -> tuple[int, str]:
        """kvfs.fsck of the tiers (no mount may be open): its exit code and report."""
        assert not self.mounted
        (self.nvme_dir / "lock").touch()  # (the daemon's: fsck takes it)
        lines: list[str] = []
        code = check(str(self.nvme_dir), str(self.dram_dir), out=lines.append)
        return code, "\n".join(lines)


@pytest.fixture
def tiers(tmp_path: Path) -> Tiers:
    """The directories of a kvfs with small tiers (4 MiB DRAM, 64 MiB NVMe, 64 KiB chunks),
    none mounted yet."""
    return Tiers(tmp_path)


@pytest.fixture
def kv_bytes() -> Callable[[int], bytes]:
    """kv_bytes(n): *n* bytes of bf16 values as a model's KV cache holds them (they
    compress, unlike random bytes)."""
    def make(n: int, seed: int = 0) -> bytes:
        values = np.random.default_rng(seed).standard_normal(n // 2).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()

    return make
