"""Control plane: the `user.kvfs.*` virtual xattrs that kvfsctl reads and writes.

Talking to the daemon through the mount itself (as S3QL does) works wherever the mount is
visible, containers included, and needs no socket or port. Names:

    user.kvfs.status          (get, any inode) one JSON object: tiers, reads, moves, gc, ...
                              (the tiers' directories only for root and the daemon's user)
    user.kvfs.where[.START]   (get, a file) JSON: tiers of the file's chunks from START, a page
                              at a time ({"chunks": [...], "next": N or null})
    user.kvfs.prefetch        (set, a file; any value) stage the file in DRAM: the engine will
                              read it soon

Other `user.kvfs.*` names (e.g. user.kvfs.dtype) are ordinary stored xattrs that act as hints.
"""

from __future__ import annotations

import errno
import json
import os
import time

from kvfs.namespace import NamespaceError

WHERE_PAGE = 256  # chunks per answer: keeps the JSON under the 64 KiB xattr limit
VIRTUAL = (b"user.kvfs.status", b"user.kvfs.where", b"user.kvfs.prefetch")


class Control:
    def __init__(self, ns, store, settings, readahead, extra_stats=(), pod=None) -> None:
        self.ns = ns
        self.pod = pod  # kvfs.podfiles.PodFiles, or None
        self.store = store
        self.readahead = readahead
        self.settings = settings
        self.extra_stats = extra_stats  # callables returning {section: {...}}; may grow
        self.started = time.time()

    @staticmethod
    def handles(name: bytes) -> bool:
        return any(name == v or name.startswith(v + b".") for v in VIRTUAL)

    def get(self, ino: int, name: bytes, uid: int) -> bytes:
        """The value of virtual xattr *name* of *ino*, for a caller with user id *uid*."""
        if name == b"status":
            paths = uid in (0, os.geteuid())  # where the tiers live is the admin's business
            return json.dumps(self.status(paths), separators=(",", ":")).encode()
        if name == b"prefetch":
            raise NamespaceError(errno.ENODATA)  # write-only
        if name == b"where" or name.startswith(b"where."):
            start = 0
            if name != b"where":
                try:
                    start = int(name[len(b"where."):])
                except ValueError:
                    raise NamespaceError(errno.ENODATA) from None
            return json.dumps(self.where(ino, start), separators=(",", ":")).encode()
        raise NamespaceError(errno.ENODATA)

    def set(self, ino: int, name: bytes, value: bytes) -> None:
        if name == b"prefetch":
            inode = self.ns.get(ino)
            if not inode.is_reg:
                raise NamespaceError(errno.EISDIR if inode.is_dir else errno.EINVAL)
            self.readahead.hint(ino, inode.size)
            return
        raise NamespaceError(errno.EPERM)  # status and where are read-only

    def status(self, paths: bool = True) -> dict:
        """Everything kvfsctl status shows; the tiers' directories only with *paths*."""
        out = self.store.stats()
        out["uptime_s"] = round(time.time() - self.started, 1)
        out["files"] = self.ns.files
        out["settings"] = {"chunk_size": self.store.cs, "cache_mode": self.settings.cache_mode}
        if paths:
            out["settings"] |= {"dram_dir": self.settings.dram_dir,
                                "nvme_dir": self.settings.nvme_dir}
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
