"""Nurseries whose failure is an exception of the type a task raised.

Trio 0.25 and later wrap whatever a nursery's tasks raise in an ExceptionGroup, even a
single exception (strict exception groups; 0.22-0.24 raised it bare). kvfs answers each
failure with the errno of its type at the FUSE boundary (NoSpace is ENOSPC, an OSError its
own errno), and callers catch the types they expect (a hash that fails with OSError), so a
group would turn an fsync on a full tier into EIO and let a clean unmount skip its
write-back. `open_nursery` raises the group's first real exception instead, whatever trio
is installed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


def first_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group that is not a cancellation (cancellations say
    only that something else failed), else its first leaf; *exc* itself if not a group."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for inner in e.exceptions:
                walk(inner)
        else:
            leaves.append(e)

    walk(exc)
    return next((e for e in leaves if not isinstance(e, trio.Cancelled)), leaves[0])


@asynccontextmanager
async def open_nursery() -> AsyncIterator[trio.Nursery]:
    """`trio.open_nursery()`, raising the first exception of its tasks (`first_error`)
    rather than a group of them."""
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        raise first_error(group) from group
