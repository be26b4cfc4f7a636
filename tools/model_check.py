#!/usr/bin/env python3
"""The model-based test (tests/test_model.py) with a larger budget than CI's.

kvfs and a tmpfs directory get the same random file operations, remounts and SIGKILLs
(and, in test_model_crashes_lose_dram, losses of the DRAM tier); every result must agree.
By default every run draws new examples; a disagreement is shrunk by hypothesis and printed
as the sequence of steps that reproduces it (paste it into a test to replay it).

    python tools/model_check.py --examples 200            # ~10-20 min on the 2-core box
    python tools/model_check.py --examples 50 --steps 100 --events 3 -k lose_dram
    python tools/model_check.py --examples 50 -o dram_compress=1,passthrough=0
    python tools/model_check.py --fixed                   # CI's derandomized examples
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=100, help="examples per test (CI: 8)")
    ap.add_argument("--steps", type=int, default=60, help="steps per example, at most (CI: 40)")
    ap.add_argument("--events", type=int, default=2,
                    help="remounts and crashes per example, at most (CI: 1)")
    ap.add_argument("--fixed", action="store_true",
                    help="the derandomized examples CI runs, instead of new random ones")
    ap.add_argument("-o", "--options", default="",
                    help="mount options on top of the small tiers, e.g. dram_compress=1")
    ap.add_argument("-k", default="", help="pytest -k selection among the model's tests")
    args = ap.parse_args()
    env = dict(os.environ, KVFS_MODEL_EXAMPLES=str(args.examples),
               KVFS_MODEL_STEPS=str(args.steps), KVFS_MODEL_EVENTS=str(args.events),
               KVFS_MODEL_OPTIONS=args.options)
    if not args.fixed:
        env["KVFS_MODEL_RANDOM"] = "1"
    # Run this checkout's kvfs (the daemon is started as `python -m kvfs`).
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           str(ROOT / "tests" / "test_model.py")]
    if args.k:
        cmd += ["-k", args.k]
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
