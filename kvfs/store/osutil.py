"""Thin wrappers for Linux calls the os module lacks (fallocate modes, write-life hints)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with any mode; raises OSError like the os module does."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Deallocate a byte range (reads return zeros) without changing the file size."""
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)


def mapped_shared_writable(files: set[tuple[int, int]]) -> bool:
    """Does any process other than this one have a shared writable mapping of one of
    *files* ((st_dev, st_ino) pairs)? Read from /proc/*/maps: a few ms for a few hundred
    processes, so only for the rare file that needs it. (A mapping through FUSE passthrough
    shows the FUSE file's device and inode there, not the backing file's.)"""
    me = str(os.getpid())
    inos = {str(ino) for _, ino in files}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid == me:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if (len(parts) >= 5 and parts[4] in inos and parts[1][1] == "w"
                            and parts[1][3] == "s"):
                        major, _, minor = parts[3].partition(":")
                        dev = os.makedev(int(major, 16), int(minor, 16))
                        if (dev, int(parts[4])) in files:
                            return True
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return False
