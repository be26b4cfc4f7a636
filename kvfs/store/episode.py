"""A failing condition that lasts (the NVMe tier full, its disk failing), logged as one
episode: a line when it begins, one when it ends with how often it was met meanwhile. A
demoter retrying a full disk used to log every attempt: 8,000 lines in 30 s."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class Episode:
    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None
        self.last = 0.0  # when it was last met
        self.failures = 0

    @property
    def on(self) -> bool:
        return self.since is not None

    def met_within(self, seconds: float) -> bool:
        """Is it on, and met no longer ago than *seconds*?"""
        return self.since is not None and time.monotonic() - self.last < seconds

    def failed(self, detail: object) -> None:
        self.failures += 1
        self.last = time.monotonic()
        if self.since is None:
            self.since = time.monotonic()
            log.error("%s: %s", self.what, detail)

    def over(self) -> None:
        if self.since is not None:
            log.warning("%s: over after %.1f s (%d failed attempts)", self.what,
                        time.monotonic() - self.since, self.failures)
            self.since, self.failures = None, 0
