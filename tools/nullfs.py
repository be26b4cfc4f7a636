#!/usr/bin/env python3
"""fuse-null: the FUSE floor of bench_fs.py, the least work a pyfuse3 filesystem can do.

Files live in memory as the very bytes objects the write requests arrived in (no copy), and
reads return memoryviews of them. No checksums, no tiers, no metadata store: what remains is
the cost of FUSE and pyfuse3 themselves. It makes the FUSE choices kvfs makes (kvfs/fs.py,
kvfs/daemon.py, kvfs/assemble.py), so kvfs / fuse-null shows what kvfs adds on top of them:

    FileInfo(direct_io=True, keep_cache=False); entry and attribute timeouts 60 s; negative
    lookups cached; pyfuse3.default_options + allow_other; pyfuse3.main(min_tasks=8,
    max_tasks=64)

Operations: lookup, getattr, mkdir, create, open, write, read, release, unlink, statfs; every
other one is pyfuse3's default (ENOSYS; for flush and xattrs the kernel then stops asking).

    python tools/nullfs.py MOUNTPOINT      # serves until unmounted (fusermount3 -u) or SIGTERM
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

# As kvfs: long timeouts spare a round trip per stat() and per negative lookup.
ENTRY_TIMEOUT = 60.0
ATTR_TIMEOUT = 60.0


class Node:
    __slots__ = ("ino", "mode", "size", "pieces", "children", "mtime_ns")

    def __init__(self, ino: int, mode: int) -> None:
        self.ino = ino
        self.mode = mode
        self.size = 0
        # Regular files: offset -> the bytes of one write request. Writes that do not simply
        # extend the file are merged into one bytearray at offset 0 (see NullFS.write).
        self.pieces: dict[int, bytes | bytearray] = {}
        self.children: dict[bytes, int] = {}
        self.mtime_ns = time.time_ns()


class NullFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self) -> None:
        super().__init__()
        root = Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755)
        self.nodes: dict[int, Node] = {root.ino: root}
        self.next_ino = root.ino + 1

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = 2 if stat.S_ISDIR(node.mode) else 1
        a.st_uid = os.getuid()
        a.st_gid = os.getgid()
        a.st_size = node.size
        a.st_blksize = 4096
        a.st_blocks = (node.size + 511) // 512
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = node.mtime_ns
        return a

    def _new(self, parent: int, name: bytes, mode: int) -> Node:
        siblings = self.nodes[parent].children
        if name in siblings:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = Node(self.next_ino, mode)
        self.next_ino += 1
        self.nodes[node.ino] = node
        siblings[name] = node.ino
        return node

    async def lookup(self, parent_inode, name, ctx=None):
        ino = self.nodes[parent_inode].children.get(name)
        if ino is None:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0  # a cached negative entry, as kvfs answers
            a.entry_timeout = ENTRY_TIMEOUT
            return a
        return self._attr(self.nodes[ino])

    async def getattr(self, inode, ctx=None):
        return self._attr(self.nodes[inode])

    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._attr(self._new(parent_inode, name, stat.S_IFDIR | (mode & 0o7777)))

    async def create(self, parent_inode, name, mode, flags, ctx):
        node = self._new(parent_inode, name, stat.S_IFREG | (mode & 0o7777))
        return self._file_info(node), self._attr(node)

    async def open(self, inode, flags, ctx):
        node = self.nodes[inode]
        if flags & os.O_TRUNC:  # libfuse negotiates atomic O_TRUNC: truncation comes here
            node.pieces, node.size = {}, 0
        return self._file_info(node)

    @staticmethod
    def _file_info(node: Node) -> pyfuse3.FileInfo:
        return pyfuse3.FileInfo(fh=node.ino, direct_io=True, keep_cache=False)

    async def write(self, fh, off, buf):
        node = self.nodes[fh]
        end = off + len(buf)
        if off >= node.size:  # extends the file (the benchmark's only case): keep buf as is
            node.pieces[off] = buf
        else:
            data = bytearray(self._gather(node, 0, max(node.size, end)))
            data[off:end] = buf
            node.pieces = {0: data}
        node.size = max(node.size, end)
        node.mtime_ns = time.time_ns()
        return len(buf)

    async def read(self, fh, off, size):
        node = self.nodes[fh]
        size = max(0, min(size, node.size - off))
        piece = node.pieces.get(off)
        if piece is not None and len(piece) >= size:  # one write request: zero-copy
            return memoryview(piece)[:size]
        return self._gather(node, off, size)

    @staticmethod
    def _gather(node: Node, off: int, size: int) -> bytes:
        """Bytes [off, off+size) from the pieces they overlap; holes read as zeros."""
        out = bytearray(size)
        for start, piece in node.pieces.items():
            lo, hi = max(off, start), min(off + size, start + len(piece))
            if lo < hi:
                out[lo - off:hi - off] = piece[lo - start:hi - start]
        return bytes(out)

    async def release(self, fh):
        pass

    async def unlink(self, parent_inode, name, ctx):
        ino = self.nodes[parent_inode].children.pop(name, None)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        del self.nodes[ino]  # the data of a file still open go with it: enough for a floor

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = 1 << 30
        s.f_files = s.f_ffree = s.f_favail = 1 << 24
        s.f_namemax = 255
        return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mountpoint")
    args = ap.parse_args(argv)
    options = set(pyfuse3.default_options) | {"fsname=fuse-null", "subtype=nullfs",
                                               "allow_other"}
    pyfuse3.init(NullFS(), args.mountpoint, options)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            async def on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
                    async for _ in sigs:
                        pyfuse3.terminate()
                        return
            nursery.start_soon(on_signal)
            await pyfuse3.main(min_tasks=8, max_tasks=64)
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    finally:
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
