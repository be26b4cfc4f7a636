"""tools/crashloop.py, short: a KV workload whose daemon is SIGKILLed at random moments (and
its DRAM tier lost in every fourth cycle), then fsck, a remount, and every file checked
against what the workload's journal allows. Eight cycles, two of them with DRAM lost; the
tool's own `--cycles 300` is the long run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "crashloop.py"


def _crashloop():
    spec = importlib.util.spec_from_file_location("crashloop", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["crashloop"] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_crash_loop_finds_nothing():
    lines: list[str] = []
    summary = _crashloop().run(8, seed=7, max_delay=1.0, out=lines.append)
    assert summary.cycles == 8 and summary.dram_lost == 2, "\n".join(lines)
    assert summary.failures == 0, "\n".join(lines)
