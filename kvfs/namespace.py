"""Inodes, directory entries, symlinks and xattrs: cached in memory, written through to lmdb.

The whole namespace is loaded at mount (a KV-cache directory holds up to millions of small
records; a dict lookup beats any lmdb transaction on the hot path). Every mutation updates the
dicts and puts the same change into the current lmdb write transaction, so metadata survives a
SIGKILL of the daemon. Nothing here knows about chunks or tiers; `fs` orchestrates both.
"""

from __future__ import annotations

import errno
import stat
import struct
import time
from dataclasses import dataclass, field

from kvfs.store.meta import COUNTER_MAX, MetaStore, from_u64, u64

ROOT_INODE = 1
NAME_MAX = 255
# mode, nlink, uid, gid, rdev, size, atime_ns, mtime_ns, ctime_ns, flags
_INODE = struct.Struct("<IIIIQQqqqQ")
# Inode flag (format 4): the regular file has no hole, every byte below its size was written
# (a create or a truncation to nothing sets it; anything that makes a hole clears it: a write
# past the end, growth by truncate or fallocate, a take of a DRAM file with holes). fsck
# checks that such a file has every chunk (a missing one would read as zeros nobody wrote);
# files written before format 4 never have it.
DENSE = 1
# Inode flag (format 4, issue 35): a file found in the pod whose bytes are not fetched yet:
# it has a size and no chunks. The first open fetches it (kvfs/podfiles.py); a mount drops
# such inodes, so that a file never reads as the zeros of chunks it does not have.
REMOTE = 2


class NamespaceError(Exception):
    """A namespace operation cannot be done; `errno` is what a local filesystem answers."""

    def __init__(self, err: int, what: str = "") -> None:
        super().__init__(what or errno.errorcode.get(err, str(err)))
        self.errno = err


@dataclass(slots=True)
class Inode:
    ino: int
    mode: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    flags: int = 0
    # In memory only: kernel lookup count and open handles keep an unlinked inode alive.
    lookups: int = field(default=0, compare=False)
    opens: int = field(default=0, compare=False)

    def pack(self) -> bytes:
        return _INODE.pack(self.mode, self.nlink, self.uid, self.gid, self.rdev, self.size,
                           self.atime_ns, self.mtime_ns, self.ctime_ns, self.flags)

    @classmethod
    def unpack(cls, ino: int, raw: bytes) -> Inode:
        return cls(ino, *_INODE.unpack(raw))

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)

    def resize(self, size: int, *, holes: bool) -> None:
        """The file is now *size* bytes; *holes*: and the change may have made a hole."""
        if holes:
            self.flags &= ~DENSE
        if size == 0:
            self.flags |= DENSE  # an empty file has none
        self.size = size


def parse_inode(k: bytes, v: bytes) -> Inode:
    ino = from_u64(k)
    if not ROOT_INODE <= ino < COUNTER_MAX:
        raise ValueError(f"inode number {ino}")
    inode = Inode.unpack(ino, v)
    if inode.size >= 1 << 63:  # beyond off_t: no request about it could be answered
        raise ValueError(f"inode {ino}: size {inode.size}")
    return inode


def _parse_dirent(k: bytes, v: bytes) -> tuple[int, bytes, int]:
    if len(k) <= 8:
        raise ValueError("a directory entry without a name")
    return from_u64(k[:8]), k[8:], from_u64(v)


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise NamespaceError(errno.ENAMETOOLONG)
    if not name or b"/" in name or name in (b".", b".."):
        raise NamespaceError(errno.EINVAL)


# xattrs that are policy hints (store/codec and store/streams read them on every writeback;
# tiering asks about pins, kvfs/control.py, for every chunk it would demote)
PIN_XATTR = b"user.kvfs.pin"
HINT_XATTRS = frozenset((b"user.kvfs.dtype", b"user.kvfs.lifetime", PIN_XATTR))


class Namespace:
    """Directory tree and inode attributes. All methods run on the trio thread and never await."""

    def __init__(self, meta: MetaStore) -> None:
        self.meta = meta
        self.inodes: dict[int, Inode] = {}
        self.dirs: dict[int, dict[bytes, int]] = {}
        self.parent: dict[int, int] = {}  # directory -> its parent, for '..' and rename checks
        self.symlinks: dict[int, bytes] = {}
        # file -> its name (parent, name), a set of them for a file with hard links: so that
        # cache-mode eviction can remove a file without a tree walk. (A set per file would
        # cost ~200 bytes each, a tenth of what kvfs keeps per file.)
        self._names: dict[int, tuple[int, bytes] | set[tuple[int, bytes]]] = {}
        # The policy hints every writeback reads (HINT_XATTRS), also kept here: an lmdb read
        # transaction on the trio thread costs more than a dict walk and lets go of the GIL.
        self._hints: dict[bytes, dict[int, bytes]] = {n: {} for n in HINT_XATTRS}
        # Has any file ever had a security.* xattr (file capabilities)? While none has, the
        # kernel's question before each passthrough write can be answered without us.
        self.security_xattrs = False
        self.on_security_xattr = lambda: None
        self.next_ino = ROOT_INODE + 1
        self.files = 0  # regular files with a name: kept as they change, for a cheap status
        self._load()

    # -- loading ---------------------------------------------------------------------------
    def _load(self) -> None:
        for inode in self.meta.load("inodes", parse_inode):
            self.inodes[inode.ino] = inode
        self.files = sum(1 for i in self.inodes.values() if i.is_reg and i.nlink)
        for parent, name, child in self.meta.load("dirents", _parse_dirent):
            self.dirs.setdefault(parent, {})[name] = child
            self._add_name(child, parent, name)
            if child in self.inodes and self.inodes[child].is_dir:
                self.parent[child] = parent
        for ino, target in self.meta.load("symlinks", lambda k, v: (from_u64(k), v)):
            self.symlinks[ino] = target
        for k, v in self.meta.scan("xattrs"):
            if k[8:] in HINT_XATTRS:
                self._hints[k[8:]][from_u64(k[:8])] = v
            if k[8:].startswith(b"security."):
                self.security_xattrs = True
        if ROOT_INODE not in self.inodes:
            now = time.time_ns()
            root = Inode(ROOT_INODE, stat.S_IFDIR | 0o755, nlink=2, atime_ns=now, mtime_ns=now,
                         ctime_ns=now)
            with self.meta.write() as txn:
                self._put(txn, root)
            self.inodes[ROOT_INODE] = root
        self.parent[ROOT_INODE] = ROOT_INODE
        for ino, inode in self.inodes.items():
            if inode.is_dir:
                self.dirs.setdefault(ino, {})
        with self.meta.env.begin() as txn:
            self.next_ino = max(self.meta.counter(txn, b"next_ino", ROOT_INODE + 1),
                                max(self.inodes) + 1)

    def orphans(self) -> list[Inode]:
        """Inodes no directory names (unlinked while open when the daemon stopped)."""
        return [i for i in self.inodes.values() if i.nlink == 0]

    # -- persistence -----------------------------------------------------------------------
    def _put(self, txn, inode: Inode) -> None:
        txn.put(u64(inode.ino), inode.pack(), db=self.meta.db["inodes"])

    def save(self, inode: Inode) -> None:
        """Write *inode*'s attributes into the current (or a new) transaction."""
        with self.meta.write() as txn:
            self._put(txn, inode)

    # -- queries ---------------------------------------------------------------------------
    def get(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise NamespaceError(errno.ENOENT) from None

    def lookup(self, parent: int, name: bytes) -> int | None:
        # The kernel lets names up to 1024 bytes (FUSE_NAME_MAX) through to LOOKUP, which
        # every call that takes a path starts with: past NAME_MAX this is where they fail.
        if len(name) > NAME_MAX:
            raise NamespaceError(errno.ENAMETOOLONG)
        if name == b".":
            return parent
        if name == b"..":
            return self.parent.get(parent, ROOT_INODE)
        d = self.dirs.get(parent)
        if d is None:
            raise NamespaceError(errno.ENOTDIR)
        return d.get(name)

    def names_of(self, ino: int) -> set[tuple[int, bytes]]:
        names = self._names.get(ino)
        if names is None:
            return set()
        return set(names) if isinstance(names, set) else {names}

    def _add_name(self, ino: int, parent: int, name: bytes) -> None:
        entry = (parent, name)
        have = self._names.get(ino)
        if have is None:
            self._names[ino] = entry
        elif isinstance(have, set):
            have.add(entry)
        elif have != entry:
            self._names[ino] = {have, entry}

    def _drop_name(self, ino: int, parent: int, name: bytes) -> None:
        entry = (parent, name)
        have = self._names.get(ino)
        if have == entry:
            del self._names[ino]
        elif isinstance(have, set):
            have.discard(entry)
            if len(have) == 1:
                self._names[ino] = have.pop()

    def ancestors(self, ino: int) -> tuple[int, ...]:
        """The directory holding *ino* (its first name, for hard links) and that directory's
        ancestors, nearest first, root last."""
        names = self.names_of(ino)
        if not names:
            return ()
        d = min(names)[0]
        out = [d]
        while len(out) < 64:
            up = self.parent.get(d, d)
            if up == d:
                break
            out.append(up)
            d = up
        return tuple(out)

    def inherited_hint(self, ino: int, name: bytes,
                       chain: tuple[int, ...] | None = None) -> bytes | None:
        """Hint xattr *name* (one of HINT_XATTRS) on the file, else on its nearest ancestor
        directory that has it (how operators set hints for a whole directory of an engine's
        files). *chain*: ancestors(ino), when the caller has it already."""
        values = self._hints[name]
        for i in (ino, *(self.ancestors(ino) if chain is None else chain)):
            value = values.get(i)
            if value is not None:
                return value
        return None

    def hinted(self, name: bytes) -> dict[int, bytes]:
        """The inodes that have hint xattr *name* (one of HINT_XATTRS) -> its value; kept
        as they change (do not change it)."""
        return self._hints[name]

    def entries(self, ino: int) -> list[tuple[bytes, int]]:
        d = self.dirs.get(ino)
        if d is None:
            raise NamespaceError(errno.ENOTDIR)
        return list(d.items())

    # -- mutations -------------------------------------------------------------------------
    def _dir(self, parent: int) -> dict[bytes, int]:
        d = self.dirs.get(parent)
        if d is None:
            raise NamespaceError(errno.ENOENT if parent not in self.inodes else errno.ENOTDIR)
        if self.inodes[parent].nlink == 0:
            raise NamespaceError(errno.ENOENT)  # creating in a removed directory
        return d

    def _touch_dir(self, txn, parent: int, now: int) -> None:
        p = self.inodes[parent]
        p.mtime_ns = p.ctime_ns = now
        self._put(txn, p)

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, rdev: int = 0,
               target: bytes | None = None) -> Inode:
        check_name(name)
        d = self._dir(parent)
        if name in d:
            raise NamespaceError(errno.EEXIST)
        now = time.time_ns()
        ino = self.next_ino
        self.next_ino += 1
        is_dir = stat.S_ISDIR(mode)
        inode = Inode(ino, mode, nlink=2 if is_dir else 1, uid=uid, gid=gid, rdev=rdev,
                      atime_ns=now, mtime_ns=now, ctime_ns=now,
                      size=len(target) if target is not None else 0,
                      flags=DENSE if stat.S_ISREG(mode) else 0)
        with self.meta.write() as txn:
            self._put(txn, inode)
            txn.put(u64(parent) + name, u64(ino), db=self.meta.db["dirents"])
            self.meta.set_counter(txn, b"next_ino", self.next_ino)
            if target is not None:
                txn.put(u64(ino), target, db=self.meta.db["symlinks"])
            if is_dir:
                self.inodes[parent].nlink += 1
            self._touch_dir(txn, parent, now)
        self.inodes[ino] = inode
        if inode.is_reg:
            self.files += 1
        d[name] = ino
        self._add_name(ino, parent, name)
        if is_dir:
            self.dirs[ino] = {}
            self.parent[ino] = parent
        if target is not None:
            self.symlinks[ino] = target
        return inode

    def link(self, ino: int, parent: int, name: bytes) -> Inode:
        check_name(name)
        inode = self.get(ino)
        if inode.is_dir:
            raise NamespaceError(errno.EPERM)
        d = self._dir(parent)
        if name in d:
            raise NamespaceError(errno.EEXIST)
        now = time.time_ns()
        inode.nlink += 1
        inode.ctime_ns = now
        with self.meta.write() as txn:
            self._put(txn, inode)
            txn.put(u64(parent) + name, u64(ino), db=self.meta.db["dirents"])
            self._touch_dir(txn, parent, now)
        d[name] = ino
        self._add_name(ino, parent, name)
        return inode

    def remove(self, parent: int, name: bytes, *, want_dir: bool) -> Inode:
        """Unlink or rmdir; returns the inode (nlink already decremented)."""
        d = self._dir(parent)
        ino = d.get(name)
        if ino is None:
            raise NamespaceError(errno.ENOENT)
        inode = self.inodes[ino]
        if want_dir and not inode.is_dir:
            raise NamespaceError(errno.ENOTDIR)
        if not want_dir and inode.is_dir:
            raise NamespaceError(errno.EISDIR)
        if want_dir and self.dirs[ino]:
            raise NamespaceError(errno.ENOTEMPTY)
        now = time.time_ns()
        with self.meta.write() as txn:
            txn.delete(u64(parent) + name, db=self.meta.db["dirents"])
            del d[name]
            self._drop_name(ino, parent, name)
            self._unref(txn, inode, parent, now)
            self._touch_dir(txn, parent, now)
        return inode

    def _unref(self, txn, inode: Inode, parent: int, now: int) -> None:
        if inode.is_dir:
            inode.nlink = 0
            self.inodes[parent].nlink -= 1
            self.dirs.pop(inode.ino, None)
            self.parent.pop(inode.ino, None)
        else:
            inode.nlink -= 1
            if inode.nlink == 0 and inode.is_reg:
                self.files -= 1
        inode.ctime_ns = now
        self._put(txn, inode)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               flags: int) -> Inode | None:
        """Move an entry; returns the inode that was replaced (its nlink decremented), if any."""
        check_name(new_name)
        src_dir, dst_dir = self._dir(old_parent), self._dir(new_parent)
        ino = src_dir.get(old_name)
        if ino is None:
            raise NamespaceError(errno.ENOENT)
        inode = self.inodes[ino]
        target_ino = dst_dir.get(new_name)
        noreplace, exchange = flags & 1, flags & 2  # RENAME_NOREPLACE, RENAME_EXCHANGE
        if noreplace and target_ino is not None:
            raise NamespaceError(errno.EEXIST)
        if exchange and target_ino is None:
            raise NamespaceError(errno.ENOENT)
        if inode.is_dir and self._is_ancestor(ino, new_parent):
            raise NamespaceError(errno.EINVAL)
        if target_ino == ino:
            return None
        target = self.inodes[target_ino] if target_ino is not None else None
        now = time.time_ns()
        if exchange:
            assert target is not None
            if target.is_dir and self._is_ancestor(target_ino, old_parent):
                raise NamespaceError(errno.EINVAL)
            with self.meta.write() as txn:
                txn.put(u64(old_parent) + old_name, u64(target_ino), db=self.meta.db["dirents"])
                txn.put(u64(new_parent) + new_name, u64(ino), db=self.meta.db["dirents"])
                src_dir[old_name], dst_dir[new_name] = target_ino, ino
                self._drop_name(ino, old_parent, old_name)
                self._add_name(ino, new_parent, new_name)
                self._drop_name(target_ino, new_parent, new_name)
                self._add_name(target_ino, old_parent, old_name)
                for moved, where in ((inode, new_parent), (target, old_parent)):
                    if moved.is_dir and old_parent != new_parent:
                        self.inodes[self.parent[moved.ino]].nlink -= 1
                        self.parent[moved.ino] = where
                        self.inodes[where].nlink += 1
                    moved.ctime_ns = now
                    self._put(txn, moved)
                self._touch_dir(txn, old_parent, now)
                self._touch_dir(txn, new_parent, now)
            return None
        if target is not None:
            if target.is_dir and not inode.is_dir:
                raise NamespaceError(errno.EISDIR)
            if inode.is_dir and not target.is_dir:
                raise NamespaceError(errno.ENOTDIR)
            if target.is_dir and self.dirs[target_ino]:
                raise NamespaceError(errno.ENOTEMPTY)
        with self.meta.write() as txn:
            txn.delete(u64(old_parent) + old_name, db=self.meta.db["dirents"])
            del src_dir[old_name]
            self._drop_name(ino, old_parent, old_name)
            if target is not None:
                self._drop_name(target_ino, new_parent, new_name)
                self._unref(txn, target, new_parent, now)
            txn.put(u64(new_parent) + new_name, u64(ino), db=self.meta.db["dirents"])
            dst_dir[new_name] = ino
            self._add_name(ino, new_parent, new_name)
            if inode.is_dir and old_parent != new_parent:
                self.inodes[old_parent].nlink -= 1
                self.inodes[new_parent].nlink += 1
                self.parent[ino] = new_parent
            inode.ctime_ns = now
            self._put(txn, inode)
            self._touch_dir(txn, old_parent, now)
            if new_parent != old_parent:
                self._touch_dir(txn, new_parent, now)
        return target

    def _is_ancestor(self, ino: int, of: int) -> bool:
        """True if directory *ino* is *of* or one of its ancestors."""
        while True:
            if of == ino:
                return True
            if of == ROOT_INODE:
                return False
            of = self.parent.get(of, ROOT_INODE)

    def forget_inode(self, inode: Inode) -> None:
        """Drop an inode that has no names, no lookups and no open handles."""
        with self.meta.write() as txn:
            txn.delete(u64(inode.ino), db=self.meta.db["inodes"])
            if inode.ino in self.symlinks:
                txn.delete(u64(inode.ino), db=self.meta.db["symlinks"])
            prefix = u64(inode.ino)
            cur = txn.cursor(db=self.meta.db["xattrs"])
            if cur.set_range(prefix):
                while cur.key().startswith(prefix):
                    if not cur.delete():
                        break
        self.inodes.pop(inode.ino, None)
        self.symlinks.pop(inode.ino, None)
        self._names.pop(inode.ino, None)
        for values in self._hints.values():
            values.pop(inode.ino, None)

    # -- xattrs (not cached, but for the hints: rare, and values can be large) -------------
    def getxattr(self, ino: int, name: bytes) -> bytes | None:
        if name in HINT_XATTRS:
            return self._hints[name].get(ino)
        with self.meta.env.begin(db=self.meta.db["xattrs"]) as txn:
            return txn.get(u64(ino) + name)

    def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        inode = self.get(ino)
        inode.ctime_ns = time.time_ns()
        with self.meta.write() as txn:
            txn.put(u64(ino) + name, value, db=self.meta.db["xattrs"])
            self._put(txn, inode)
        if name in HINT_XATTRS:
            self._hints[name][ino] = value
        if name.startswith(b"security.") and not self.security_xattrs:
            self.security_xattrs = True
            self.on_security_xattr()

    def removexattr(self, ino: int, name: bytes) -> None:
        inode = self.get(ino)
        with self.meta.write() as txn:
            if not txn.delete(u64(ino) + name, db=self.meta.db["xattrs"]):
                raise NamespaceError(errno.ENODATA)
            inode.ctime_ns = time.time_ns()
            self._put(txn, inode)
        if name in HINT_XATTRS:
            self._hints[name].pop(ino, None)

    def listxattr(self, ino: int) -> list[bytes]:
        return [k[8:] for k, _ in self.meta.scan("xattrs", u64(ino))]
