"""Where the trio thread's time goes: an opt-in trio Instrument for performance work.

`KVFS_TRIO_PROFILE=FILE kvfs mount ...` makes the daemon time every task step. At unmount it
writes FILE: the thread's wall, I/O-wait and step time, a log2 histogram of step lengths,
the steps over 1 ms by where the task was suspended before and after, and the step time
per place. One trio thread serves every FUSE request, so any long step is a latency every
request waiting behind it pays. Cost: ~2 us per step; off by default.
"""

from __future__ import annotations

import collections
import heapq
import logging
import os
import time

import trio

log = logging.getLogger(__name__)

LONG_STEP_S = 0.001
LONGEST = 10


def _where(task: trio.lowlevel.Task, depth: int = 3) -> str:
    """The innermost coroutine frames the task is suspended in (Cython ones are opaque)."""
    frames = []
    coro = task.coro
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frames.append(f"{coro.cr_frame.f_code.co_qualname}:{coro.cr_frame.f_lineno}")
        coro = coro.cr_await
    return " > ".join(frames[-depth:]) or task.name


class StepProfile(trio.abc.Instrument):
    def __init__(self, path: str) -> None:
        self.path = path
        self.start = time.perf_counter()
        self.io_wait = 0.0
        self.step_s: collections.Counter[str] = collections.Counter()
        self.steps: collections.Counter[str] = collections.Counter()
        self.long_s: collections.Counter[str] = collections.Counter()
        self.long: collections.Counter[str] = collections.Counter()
        self.histogram = [0] * 24  # bucket k: steps of [2^(k-1), 2^k) us
        self.longest: list[tuple[float, str]] = []  # a min-heap of the LONGEST longest steps
        self._t0 = 0.0
        self._before = ""
        self._io0 = 0.0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._before = _where(task)
        self._t0 = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        dt = time.perf_counter() - self._t0
        self.histogram[min(23, int(dt * 1e6).bit_length())] += 1
        self.step_s[self._before] += dt
        self.steps[self._before] += 1
        if dt > LONG_STEP_S:
            key = f"{self._before}  ==>  {_where(task)}"
            self.long[key] += 1
            self.long_s[key] += dt
            entry = (dt, f"{task.name}: {key}")
            if len(self.longest) < LONGEST:
                heapq.heappush(self.longest, entry)
            elif dt > self.longest[0][0]:
                heapq.heapreplace(self.longest, entry)

    def before_io_wait(self, timeout: float) -> None:
        self._io0 = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        self.io_wait += time.perf_counter() - self._io0

    def write(self) -> None:
        wall = time.perf_counter() - self.start
        lines = [f"wall {wall:.2f} s, waiting for I/O {self.io_wait:.2f} s, "
                 f"task steps {sum(self.step_s.values()):.2f} s",
                 f"step length, log2 us buckets: {self.histogram}",
                 f"steps over {LONG_STEP_S * 1e3:g} ms (suspended at ==> next suspended at):"]
        for key, n in self.long.most_common(20):
            lines.append(f"  {n:7d} {self.long_s[key] * 1e3:9.1f} ms  {key}")
        lines.append(f"the {LONGEST} longest steps:")
        for dt, what in sorted(self.longest, reverse=True):
            lines.append(f"  {dt * 1e3:9.2f} ms  {what}")
        lines.append("step time by where the step began:")
        for key, t in self.step_s.most_common(30):
            n = self.steps[key]
            lines.append(f"  {t * 1e3:9.1f} ms {n:8d} steps {t / n * 1e6:7.1f} us  {key}")
        try:
            with open(self.path, "w") as f:
                f.write("\n".join(lines) + "\n")
        except OSError as exc:
            log.warning("cannot write the trio profile to %s: %s", self.path, exc)


def from_environment() -> StepProfile | None:
    path = os.environ.get("KVFS_TRIO_PROFILE")
    return StepProfile(path) if path else None
