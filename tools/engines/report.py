#!/usr/bin/env python3
"""Print the table of tools/engines/run_all.sh from the harness summaries (results/*.json).

    python3 tools/engines/report.py /var/tmp/kvfs-engines/results/{vllm,llamacpp}.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def io_cell(store: dict, loads: list[dict]) -> str:
    """Seconds in the engine's storage calls: store, then each load ('-': not separable)."""
    if store.get("io_seconds") is None:
        return "-"
    return " / ".join(f"{r['io_seconds']:.2f}" for r in [store, *loads])


def rows(summary: dict) -> list[list[str]]:
    out = []
    for kind, t in summary["targets"].items():
        if "error" in t:
            out.append([summary["engine"], kind, "FAILED: " + t["error"].splitlines()[0][:90]])
            continue
        loads = t["rounds"]
        out.append([
            summary["engine"], kind,
            f"{t['store']['seconds']:.2f}",
            " / ".join(f"{r['seconds']:.2f}" for r in loads),
            io_cell(t["store"], loads),
            f"{t['written']['files']} ({fmt_bytes(t['written']['bytes'])})",
            yes(all(r["hit"] for r in loads)) + ("" if not t["store"]["hit"] else
                                                  " (round 1 hit too!)"),
            yes(all(r["tokens_identical"] for r in loads)),
            ", ".join(f"{k} {v}" for k, v in t.get("residency_after_remount", {}).items())
            or "-",
        ])
    return out


def main(paths: list[str]) -> int:
    header = ["engine", "target", "store s", "load s", "engine I/O s", "files written", "cache hit",
              "tokens identical", "chunks after remount"]
    table = [header]
    ok = True
    for path in paths:
        summary = json.loads(Path(path).read_text())
        table += rows(summary)
        ok &= all(t.get("ok") for t in summary["targets"].values())
    widths = [max(len(r[i]) for r in table if len(r) > i) for i in range(len(header))]
    for r in table:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    print("\nstore s: round 1, the engine computes and writes its KV files; load s: the rounds"
          "\nthat read them back (kvfs: after a clean remount with the files on NVMe only,"
          "\nthen after SIGKILL of the daemon and a remount). Seconds of the engine's own"
          "\nstore/load work in its process, compute included; engine I/O s: the part of it in the"
          "\nengine's storage calls (store / loads). The KV files (ext4) or kvfs's NVMe files"
          "\nare evicted from the page cache before each load.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
