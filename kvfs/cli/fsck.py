"""`fsck.kvfs NVME_DIR`: check an unmounted kvfs offline; `--rebuild`: make its metadata again.

Without --rebuild: reads every chunk location in the metadata, reads its NVMe record (or DRAM
slot), and verifies headers and checksums. Read-only: it reports, it does not repair.
With --rebuild: the metadata (lmdb) is made again from the NVMe segments' records
(kvfs/rebuild.py), the old one kept beside it as meta.damaged-TIME.
"""

from __future__ import annotations

import argparse
import sys

from kvfs.config import DEFAULT_DRAM_DIR, parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsck.kvfs", description="check an unmounted kvfs")
    parser.add_argument("nvme_dir", help="the NVMe directory of the filesystem")
    parser.add_argument("--dram-dir", default=DEFAULT_DRAM_DIR,
                        help="its DRAM directory (default %(default)s)")
    parser.add_argument("--rebuild", action="store_true",
                        help="make the metadata again from the NVMe segments (when it is lost "
                             "or damaged); the old one is kept as meta.damaged-TIME")
    parser.add_argument("--chunk-size", type=parse_size, default=0,
                        help="with --rebuild, for segments written before kvfs kept the sizes "
                             "in them: the store's chunk_size")
    parser.add_argument("--segment-size", type=parse_size, default=0,
                        help="the same for segment_size")
    args = parser.parse_args(argv)
    if args.rebuild:
        from kvfs.rebuild import rebuild

        return rebuild(args.nvme_dir, chunk_size=args.chunk_size,
                       segment_size=args.segment_size)
    from kvfs.fsck import check

    return check(args.nvme_dir, args.dram_dir)


if __name__ == "__main__":
    sys.exit(main())
