"""Faults that tests inject into a daemon through its mount options (`-o crash_at=POINT`,
`-o fetch_delay=SECONDS:PATH`), handed to the parts that have them by the assembly.

A crash at a random moment (tools/crashloop.py) finds that some moment loses data; a crash
point reproduces that moment every time: the daemon SIGKILLs itself there, as a crash would
(nothing is cleaned up, nothing more is committed). Points are named where they are placed;
an unknown name is never reached. `POINT:N` crashes the Nth time POINT is reached. A fetch
delay makes each NVMe read that stages a chunk take SECONDS longer (in its worker thread)
while PATH exists, so that a test can act while fetches are in flight. Unset (the
default), each costs a comparison.
"""

from __future__ import annotations

import logging
import os
import signal
import time

log = logging.getLogger(__name__)


class Faults:
    def __init__(self, crash_at: str = "", fetch_delay: str = "") -> None:
        point, _, count = crash_at.partition(":")
        self._crash_point = point
        self._crash_countdown = int(count or 1)
        seconds, _, self._delay_path = fetch_delay.partition(":")
        self._delay_s = float(seconds or 0)

    def reached(self, point: str) -> None:
        """Crash here if this is the armed point (and its count is reached)."""
        if point != self._crash_point:
            return
        self._crash_countdown -= 1
        if self._crash_countdown > 0:
            return
        log.warning("crash point %s reached: the daemon kills itself (crash_at)", point)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)

    def fetch_delay(self) -> None:
        """Worker thread, before an NVMe read that stages a chunk."""
        if self._delay_path and os.path.exists(self._delay_path):
            time.sleep(self._delay_s)
