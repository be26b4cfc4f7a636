"""A tiny helper for inference engines: tell kvfs which block files will be read soon.

    from kvfs.client import prefetch
    prefetch(["/mnt/kv/blk-0001", "/mnt/kv/blk-0002"])   # before the request is scheduled

Each path costs one setxattr (one FUSE round trip) and returns at once; kvfs stages the files'
chunks in DRAM in the background, once per file even if several queued requests ask for it.
Only the standard library is used, so engines can vendor this file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

PREFETCH_XATTR = "user.kvfs.prefetch"


def prefetch(paths: Iterable[str | os.PathLike], *, strict: bool = False) -> int:
    """Ask kvfs to stage *paths* in DRAM. Returns how many requests it accepted.

    A hint is only a hint: missing files and files on other filesystems are skipped, unless
    *strict*, in which case the first OSError is raised."""
    accepted = 0
    for path in paths:
        try:
            os.setxattr(path, PREFETCH_XATTR, b"1")
        except OSError:
            if strict:
                raise
            continue
        accepted += 1
    return accepted
