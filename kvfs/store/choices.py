"""Which codec a directory's files have been getting (policy; the chunk store asks it).

Engines write thousands of files of one dtype and layout into one directory, and choosing a
file's codec from scratch costs trial encodes of its first 64 KiB: ~20 us with the bytes in
cache, but 100-200 us inside the busy daemon, where the writeback reads a chunk written long
before (~10% of writing a 256 KiB file of random data). Once a directory's files have agreed
for a while, a new file there takes the same codec if only the cheap random-data probe agrees
(Codec.confirms); every `recheck`-th file still gets a full choice, so a directory whose content
changes is relearned within that many files. A wrong guess never costs bytes, only ratio: a
compressing codec falls back to raw per chunk when it does not save enough.

Used on the trio thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Run:
    codec: int
    agreed: int = 1  # full choices in a row that gave `codec`
    taken: int = 0  # files that asked since the last recheck


class ChoiceMemory:
    def __init__(self, trust: int = 4, recheck: int = 16, max_dirs: int = 4096) -> None:
        self.trust = trust
        self.recheck = recheck
        self.max_dirs = max_dirs
        self._runs: OrderedDict[int, _Run] = OrderedDict()
        self.full = 0  # files that got a full choice (counters, for status)
        self.taken = 0  # files that took their directory's codec

    def expected(self, directory: int | None) -> int | None:
        """The codec to try for a new file in *directory*, or None for a full choice."""
        run = self._runs.get(directory) if directory is not None else None
        if run is None or run.agreed < self.trust:
            return None
        self._runs.move_to_end(directory)
        # counted here, not in chose(): files asking at once (the demoter writes back several)
        # see one recheck between them, not one each
        run.taken += 1
        if run.taken >= self.recheck:
            run.taken = 0
            return None
        return run.codec

    def chose(self, directory: int | None, codec: int, *, full: bool) -> None:
        """A file in *directory* got *codec*, from a full choice or by taking expected()."""
        if directory is None:
            return
        if not full:
            self.taken += 1
            return
        self.full += 1
        run = self._runs.get(directory)
        if run is None or run.codec != codec:
            self._runs[directory] = _Run(codec)
        else:
            run.agreed += 1
        self._runs.move_to_end(directory)
        while len(self._runs) > self.max_dirs:
            self._runs.popitem(last=False)
