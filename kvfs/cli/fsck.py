"""`fsck.kvfs NVME_DIR`: check an unmounted kvfs offline.

Reads every chunk location in the metadata, reads its NVMe record (or DRAM slot), and verifies
headers and checksums. Read-only: it reports, it does not repair.
"""

from __future__ import annotations

import argparse
import sys

from kvfs.config import DEFAULT_DRAM_DIR


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsck.kvfs", description="check an unmounted kvfs")
    parser.add_argument("nvme_dir", help="the NVMe directory of the filesystem")
    parser.add_argument("--dram-dir", default=DEFAULT_DRAM_DIR,
                        help="its DRAM directory (default %(default)s)")
    args = parser.parse_args(argv)
    from kvfs.fsck import check

    return check(args.nvme_dir, args.dram_dir)


if __name__ == "__main__":
    sys.exit(main())
