"""A model-based random test: hypothesis drives file operations on a kvfs mount and on a
tmpfs directory side by side, and every result (bytes, errno, listing, size, link count,
xattrs) must agree. Remounts, SIGKILLs of the daemon (every completed operation must survive
them: README, Guarantees 3) and, in one variant, the loss of the DRAM tier (fsync'ed files
must read back exactly; the others may read EIO) happen between operations. Small tiers make
demotion to NVMe and promotion back happen within a few steps.

Budget: a few derandomized examples here; `tools/model_check.py --examples N` (or the
KVFS_MODEL_EXAMPLES / KVFS_MODEL_STEPS / KVFS_MODEL_RANDOM variables) runs more.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import stat
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

EXAMPLES = int(os.environ.get("KVFS_MODEL_EXAMPLES", "8"))
STEPS = int(os.environ.get("KVFS_MODEL_STEPS", "40"))
# Remounts and crashes per example, at most.
EVENTS = int(os.environ.get("KVFS_MODEL_EVENTS", "1"))
# Set by tools/model_check.py: new random examples on every run instead of the fixed ones,
# and mount options (`key=value,...`) on top of the small tiers.
RANDOM = bool(os.environ.get("KVFS_MODEL_RANDOM"))
OPTIONS = dict(o.split("=", 1) for o in os.environ.get("KVFS_MODEL_OPTIONS", "").split(",") if o)

DIRS = ["d", "e", "d/s"]
FILES = ["a", "b", "c", "d/a", "d/b", "e/a", "d/s/a"]
PATHS = FILES + DIRS
OPEN_FLAGS = [
    os.O_RDONLY, os.O_WRONLY, os.O_RDWR,
    os.O_CREAT | os.O_WRONLY, os.O_CREAT | os.O_RDWR,
    os.O_CREAT | os.O_EXCL | os.O_RDWR, os.O_CREAT | os.O_EXCL | os.O_WRONLY,
    os.O_TRUNC | os.O_WRONLY, os.O_CREAT | os.O_TRUNC | os.O_RDWR,
    os.O_APPEND | os.O_WRONLY, os.O_CREAT | os.O_APPEND | os.O_RDWR,
]
CHUNK = 64 << 10  # conftest.SMALL's chunk_size
# Offsets around chunk boundaries and past the end (sparse files).
OFFSETS = st.one_of(st.sampled_from([0, 1, CHUNK - 3, CHUNK, 3 * CHUNK + 5, 1 << 20]),
                    st.integers(0, 3 << 20))
LENGTHS = st.one_of(st.sampled_from([1, 4096, CHUNK, CHUNK + 7, 200_000]),
                    st.integers(1, 300_000))
XATTR_NAMES = ["user.a", "user.b", "trusted.t"]


def _bytes(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n)


def _result(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("errno", errno.errorcode.get(exc.errno, exc.errno))


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:  # a kvfs fd whose daemon was killed
        pass


def _mmap_read(path: Path, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return b""
        with mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as m:
            return m[off % size:off % size + n]


def _kind(mode: int) -> str:
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else oct(mode)


def _stat(path: Path) -> tuple:
    st_ = os.stat(path)
    size = st_.st_size if stat.S_ISREG(st_.st_mode) else None  # directory sizes differ
    return _kind(st_.st_mode), size, st_.st_nlink


def _xattrs(path: Path) -> dict[str, bytes]:
    return {n: os.getxattr(path, n) for n in sorted(os.listxattr(path))
            if not n.startswith("security.")}


def tree(root: Path) -> dict[str, tuple]:
    """Everything the model compares, of every name under *root*."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            content = p.read_bytes() if name in filenames else None
            out[rel] = (_stat(p), content, _xattrs(p))
    return out


def _assert_same_tree(ref: Path, kv: Path) -> None:
    want, got = tree(ref), tree(kv)
    assert sorted(got) == sorted(want)
    for rel in want:
        (ws, wc, wx), (gs, gc, gx) = want[rel], got[rel]
        assert gs == ws, rel
        assert gx == wx, rel
        if wc != gc:
            first = next((i for i, (a, b) in enumerate(zip(wc, gc, strict=False)) if a != b),
                         min(len(wc), len(gc)))
            raise AssertionError(f"{rel}: {len(gc)} bytes differ from {len(wc)} expected "
                                 f"from offset {first}")


class KvfsModel(RuleBasedStateMachine):
    """One example: a fresh pair of directories (the mount is shared by the examples of a
    test, and emptied between them)."""

    mount = None  # set by the test: a conftest.Mount
    ref: Path
    lose_dram = False  # the variant whose crashes also lose the DRAM tier

    def __init__(self) -> None:
        super().__init__()
        for root in (self.ref, self.mount.path):
            for entry in os.listdir(root):
                p = root / entry
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        # handles: (fd on tmpfs, fd on kvfs), opened by the same open()
        self.handles: list[tuple[int, int]] = []
        # Files (tmpfs inode numbers) whose bytes were fsync'ed and not changed since.
        self.synced: set[int] = set()
        self.events = 0

    @initialize(sizes=st.lists(st.sampled_from([0, 1000, CHUNK + 1, 300_000, 1 << 20]),
                               min_size=3, max_size=3), seed=st.integers(0, 255))
    def files(self, sizes, seed):
        """A few files and directories to start from, so that short examples have data."""
        for root in self.roots:
            os.mkdir(root / "d")
            for path, size in zip(["a", "b", "d/a"], sizes, strict=True):
                (root / path).write_bytes(_bytes(seed, size))

    @property
    def roots(self) -> tuple[Path, Path]:
        return self.ref, self.mount.path

    def both(self, fn, *args):
        """fn(root, *args) under each root: the results must agree."""
        want, got = (_result(fn, root, *args) for root in self.roots)
        assert got == want, (fn.__name__, args)
        return want

    def handle(self, i: int) -> tuple[int, int]:
        return self.handles[i % len(self.handles)]

    def on_handles(self, i: int, fn, *args):
        """fn(fd, *args) on both fds of handle *i*: the results must agree."""
        ref_fd, kv_fd = self.handle(i)
        want, got = _result(fn, ref_fd, *args), _result(fn, kv_fd, *args)
        assert got == want, (fn.__name__, args)
        return want

    def changed(self, ref_fd: int) -> None:
        self.synced.discard(os.fstat(ref_fd).st_ino)

    def unsynced(self, path: str) -> None:
        """The file at *path* (if any) is about to change."""
        try:
            self.synced.discard(os.stat(self.ref / path).st_ino)
        except OSError:
            pass

    # -- names -----------------------------------------------------------------------------
    @rule(path=st.sampled_from(FILES), flags=st.sampled_from(OPEN_FLAGS))
    def open(self, path, flags):
        fds = [_result(os.open, root / path, flags, 0o644) for root in self.roots]
        if fds[0][0] == "ok" and fds[1][0] == "ok":
            self.handles.append((fds[0][1], fds[1][1]))
            if flags & os.O_TRUNC:
                self.changed(fds[0][1])
            return
        for kind, fd in fds:
            if kind == "ok":
                _close_quietly(fd)
        assert fds[1] == fds[0], ("open", path, flags)

    @rule(path=st.sampled_from(DIRS))
    def mkdir(self, path):
        self.both(lambda root, p: os.mkdir(root / p), path)

    @rule(path=st.sampled_from(DIRS))
    def rmdir(self, path):
        self.both(lambda root, p: os.rmdir(root / p), path)

    @rule(path=st.sampled_from(PATHS))
    def unlink(self, path):
        self.both(lambda root, p: os.unlink(root / p), path)

    @rule(src=st.sampled_from(PATHS), dst=st.sampled_from(PATHS))
    def rename(self, src, dst):
        self.both(lambda root, s, d: os.rename(root / s, root / d), src, dst)

    @rule(src=st.sampled_from(FILES), dst=st.sampled_from(FILES))
    def link(self, src, dst):
        self.both(lambda root, s, d: os.link(root / s, root / d), src, dst)

    @rule(path=st.sampled_from(["", *PATHS]), how=st.sampled_from(["stat", "readdir"]))
    def look(self, path, how):
        if how == "stat":
            self.both(lambda root, p: _stat(root / p), path)
        else:
            self.both(lambda root, p: sorted(os.listdir(root / p)), path)

    @rule(path=st.sampled_from(PATHS), how=st.sampled_from(["set", "get", "remove", "list"]),
          name=st.sampled_from(XATTR_NAMES), value=st.binary(max_size=40),
          flags=st.sampled_from([0, os.XATTR_CREATE, os.XATTR_REPLACE]))
    def xattr(self, path, how, name, value, flags):
        if how == "set":
            self.both(lambda root, p: os.setxattr(root / p, name, value, flags), path)
        elif how == "get":
            self.both(lambda root, p: os.getxattr(root / p, name), path)
        elif how == "remove":
            self.both(lambda root, p: os.removexattr(root / p, name), path)
        else:
            self.both(lambda root, p: sorted(n for n in os.listxattr(root / p)
                                             if not n.startswith("security.")), path)

    @rule(path=st.sampled_from(FILES), flags=st.sampled_from(OPEN_FLAGS), off=OFFSETS,
          n=LENGTHS, seed=st.integers(0, 255), at_end=st.booleans())
    def write_file(self, path, flags, off, n, seed, at_end):
        """open, write (at *off*, or where the file position is), close."""
        data = _bytes(seed, n)

        def write(root, p):
            fd = os.open(root / p, flags, 0o644)
            try:
                if not at_end:
                    os.lseek(fd, off, os.SEEK_SET)
                return os.write(fd, data)
            finally:
                os.close(fd)

        self.unsynced(path)
        self.both(write, path)

    @rule(path=st.sampled_from(FILES), size=st.integers(0, 3 << 20))
    def truncate(self, path, size):
        self.unsynced(path)
        self.both(lambda root, p: os.truncate(root / p, size), path)

    @rule(path=st.sampled_from(FILES), off=OFFSETS, n=LENGTHS)
    def mmap_read(self, path, off, n):
        self.both(lambda root, p: _mmap_read(root / p, off, n), path)

    @rule(path=st.sampled_from(FILES))
    def read_whole(self, path):
        self.both(lambda root, p: (root / p).read_bytes(), path)

    # -- open files ------------------------------------------------------------------------
    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7), off=OFFSETS, n=LENGTHS, seed=st.integers(0, 255))
    def pwrite(self, i, off, n, seed):
        self.changed(self.handle(i)[0])
        self.on_handles(i, os.pwrite, _bytes(seed, n), off)

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7), n=LENGTHS, seed=st.integers(0, 255))
    def write(self, i, n, seed):
        """At the file position (the end for an O_APPEND handle)."""
        self.changed(self.handle(i)[0])
        self.on_handles(i, os.write, _bytes(seed, n))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7), off=OFFSETS, n=LENGTHS)
    def pread(self, i, off, n):
        self.on_handles(i, os.pread, n, off)

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7), off=OFFSETS, how=st.sampled_from([0, 1, 2]))
    def seek(self, i, off, how):
        self.on_handles(i, os.lseek, off if how != 2 else -(off % 100), how)

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7), size=st.one_of(st.sampled_from([0, 1, CHUNK - 1, CHUNK + 1]),
                                              st.integers(0, 3 << 20)))
    def ftruncate(self, i, size):
        self.changed(self.handle(i)[0])
        self.on_handles(i, os.ftruncate, size)

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7))
    def fstat(self, i):
        self.on_handles(i, lambda fd: (_kind(os.fstat(fd).st_mode), os.fstat(fd).st_size,
                                       os.fstat(fd).st_nlink))

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7))
    def fsync(self, i):
        ref_fd = self.handle(i)[0]
        if self.on_handles(i, os.fsync)[0] == "ok":
            self.synced.add(os.fstat(ref_fd).st_ino)

    @precondition(lambda self: self.handles)
    @rule(i=st.integers(0, 7))
    def close(self, i):
        ref_fd, kv_fd = self.handles.pop(i % len(self.handles))
        want, got = _result(os.close, ref_fd), _result(os.close, kv_fd)
        assert got == want, "close"

    # -- the daemon ------------------------------------------------------------------------
    def close_all(self, quietly: bool = False) -> None:
        while self.handles:
            ref_fd, kv_fd = self.handles.pop()
            os.close(ref_fd)
            if quietly:
                _close_quietly(kv_fd)
            else:
                os.close(kv_fd)

    # A remount or a crash costs as much as ~100 other steps: a few per example.
    @precondition(lambda self: self.events < EVENTS)
    @rule()
    def remount(self):
        self.events += 1
        self.close_all()
        self.mount.unmount()
        self.mount.start()
        _assert_same_tree(*self.roots)

    @precondition(lambda self: self.events < EVENTS)
    @rule()
    def crash(self):
        """SIGKILL of the daemon with files open: every completed operation survives."""
        self.events += 1
        self.mount.kill()
        self.close_all(quietly=True)
        if self.lose_dram:
            self.mount.lose_dram()
        self.mount.start()
        if self.lose_dram:
            self.check_after_dram_loss()
        _assert_same_tree(*self.roots)

    def check_after_dram_loss(self) -> None:
        """Files fsync'ed and not changed since read back exactly; the others may fail with
        EIO. Those are then removed from both sides, so that the comparison can go on."""
        doubtful: list[str] = []
        for dirpath, _, filenames in os.walk(self.ref):
            for name in filenames:
                rel = str((Path(dirpath) / name).relative_to(self.ref))
                if os.stat(Path(dirpath) / name).st_ino in self.synced:
                    continue
                doubtful.append(rel)
                try:
                    (self.mount.path / rel).read_bytes()
                except OSError as exc:
                    assert exc.errno == errno.EIO, (rel, exc)
        for rel in doubtful:
            for root in self.roots:
                os.unlink(root / rel)
        self.synced.clear()  # (inode numbers of removed files may come back)
        for dirpath, _, filenames in os.walk(self.ref):
            self.synced.update(os.stat(Path(dirpath) / n).st_ino for n in filenames)

    @invariant()
    def no_checksum_errors(self):
        # A wrong checksum is wrong bytes caught: never expected here.
        assert self.mount.status()["reads"]["checksum_errors"] == 0

    def teardown(self):
        try:
            _assert_same_tree(*self.roots)
        finally:
            self.close_all(quietly=True)


def _run(mount, lose_dram: bool = False) -> None:
    ref = Path(tempfile.mkdtemp(prefix="kvfs-model-", dir="/dev/shm"))
    machine = type("Model", (KvfsModel,), {"mount": mount, "ref": ref, "lose_dram": lose_dram})
    try:
        from hypothesis.stateful import run_state_machine_as_test
        run_state_machine_as_test(machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
            derandomize=not RANDOM, database=None, print_blob=True,
            suppress_health_check=list(HealthCheck)))
    finally:
        shutil.rmtree(ref, ignore_errors=True)


def test_model_small_tiers(mount_factory):
    _run(mount_factory(**OPTIONS))


def test_model_crashes_lose_dram(mount_factory):
    """With a 1 MiB DRAM tier, and crashes that lose it."""
    _run(mount_factory(**{"dram_size": "1M", **OPTIONS}), lose_dram=True)
