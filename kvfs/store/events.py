"""What the store tells the layers above it, and the little it asks of them.

The store sits below the namespace, the FUSE layer (kvfs.fs, kvfs.passthrough), tiering and
placement, and never imports them. Where it must tell them something ("this inode's DRAM
copies are about to change") or needs a fact only they hold (a file's size, its placement
stream), it calls the one `StoreEvents` object its constructor was given. This base class
answers as a store on its own would (no file is open in passthrough mode, sizes are unknown,
one placement stream); the assembly (kvfs.assemble) gives the store one that forwards to the
objects it builds after the store. Data and calls flow down; only these calls go up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvfs.store.fetch import StageWatch


class StoreEvents:
    # -- the store tells ---------------------------------------------------------------------
    def changing(self, ino: int) -> None:
        """*ino*'s DRAM copies are about to be dropped, repacked or moved: opens of it answered
        without the daemon (passthrough, the front thread) must be pins by then."""

    def staged(self, ino: int) -> None:
        """A prefetch brought a checked chunk of *ino* into DRAM (the file may be wholly
        resident now, and its opens may be answered without the daemon)."""

    def stage_watch(self, ino: int, c: int, fd: int) -> StageWatch | None:
        """A prefetch is about to stage chunk *c* of *ino* into its DRAM file *fd*: a
        StageWatch lets the front thread serve the file as soon as it is there."""
        return None

    def dram_filling(self) -> None:
        """DRAM passed its high-water mark, or a write waits for room: demote now."""

    def file_deleted(self, ino: int) -> None:
        """Every chunk of *ino* is gone (placement learns lifetimes from this)."""

    async def make_nvme_room(self) -> bool:
        """The NVMe tier is full: clean now. True if that freed room to try again."""
        return False

    # -- the store asks ----------------------------------------------------------------------
    def size_of(self, ino: int) -> int | None:
        """The file's size as the namespace has it (None: not a regular file, or unknown)."""
        return None

    def codec_context(self, ino: int) -> tuple[str | None, int | None]:
        """The file's dtype hint (user.kvfs.dtype) and its directory's inode, for the codec."""
        return None, None

    def file_info(self, ino: int) -> bytes:
        """The file's description for its records (kvfs/store/fileinfo.py; b"": none)."""
        return b""

    def stream_of(self, ino: int) -> int:
        """The NVMe placement stream *ino*'s records go to."""
        return 0
