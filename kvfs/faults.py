"""Crash points: tests make the daemon die at an exact moment (`-o crash_at=POINT`).

A crash at a random moment (tools/crashloop.py) finds that some moment loses data; a crash
point reproduces that moment every time. The daemon SIGKILLs itself there, as a crash would:
nothing is cleaned up, nothing more is committed. Points are named where they are placed;
an unknown name is simply never reached. Unset (the default), `reached` costs a string
comparison.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CrashPoints:
    armed: str = ""

    def reached(self, point: str) -> None:
        if point == self.armed:
            log.warning("crash point %s reached: the daemon kills itself (crash_at)", point)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
