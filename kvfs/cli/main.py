"""`kvfs`: mount and unmount.

    kvfs mount MOUNTPOINT [--dram-dir DIR] [--dram-size SIZE] [--nvme-dir DIR]
               [--nvme-size SIZE] [--chunk-size SIZE] [--cache-mode] [--foreground] [-o OPTS]
    kvfs umount MOUNTPOINT
"""

from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys
import time

from kvfs import __version__
from kvfs.config import DEFAULT_DRAM_DIR, DEFAULT_NVME_DIR, ConfigError, Settings, apply_options


def add_mount_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("mountpoint", help="existing empty directory to mount kvfs on")
    p.add_argument("--dram-dir", default=DEFAULT_DRAM_DIR, metavar="DIR",
                   help="tmpfs directory for the DRAM tier's files (default %(default)s); it "
                        "outlives the daemon, so a crash loses no data")
    p.add_argument("--dram-size", default=d.dram_size, metavar="SIZE",
                   help="DRAM tier capacity: 64M, 8G or a percentage of available RAM "
                        "(default %(default)s)")
    p.add_argument("--nvme-dir", default=DEFAULT_NVME_DIR, metavar="DIR",
                   help="directory on the NVMe filesystem for segments and metadata "
                        "(default %(default)s)")
    p.add_argument("--nvme-size", default=d.nvme_size, metavar="SIZE",
                   help="NVMe tier capacity: 100G or a percentage of the free space of "
                        "--nvme-dir (default %(default)s)")
    p.add_argument("--chunk-size", default=None, metavar="SIZE",
                   help="unit of placement, checksumming and prefetch, a power of two from 4K "
                        "to 64M (default 1M); fixed when the filesystem is first created")
    p.add_argument("--segment-size", default=d.segment_size, metavar="SIZE",
                   help="NVMe segment file size, the unit of space reclamation "
                        "(default %(default)s)")
    p.add_argument("--cache-mode", action="store_true",
                   help="when full, evict whole least-recently-used files instead of failing "
                        "writes with ENOSPC")
    p.add_argument("--no-compress", dest="compress", action="store_false",
                   help="store chunks uncompressed on the NVMe tier")
    p.add_argument("--dram-compress", action="store_true",
                   help="keep clean DRAM copies compressed too: more KV blocks fit in DRAM, "
                        "and each DRAM hit costs a decode in a worker thread")
    p.add_argument("--pod", default=None, metavar="HOST:PORT",
                   help="join the pod whose Mooncake master is at HOST:PORT: files other "
                        "mounts of it wrote are read here (as -o pod=)")
    p.add_argument("--pod-name", default=None, metavar="NAME",
                   help="which pod on that master (as -o pod_name=; default kvfs)")
    p.add_argument("--foreground", "-f", action="store_true",
                   help="stay in the foreground and log to stderr (default: return once the "
                        "mount is ready and log to NVME_DIR/kvfs.log)")
    p.add_argument("--debug", action="store_true", help="verbose logging")
    p.add_argument("--log-file", default=None, metavar="PATH", help="log to this file")
    p.add_argument("-o", dest="options", default="", metavar="OPTS",
                   help="comma-separated key=value options, as in fstab: dram_dir=, "
                        "dram_size=, nvme_dir=, nvme_size=, chunk_size=, segment_size=, "
                        "cache_mode, nocompress, dram_high_watermark=, dram_low_watermark=, "
                        "io_threads=, readahead_chunks=, prefetch= (0 turns prediction off), "
                        "prefetch_bandwidth=, streams= (1-5 NVMe placement streams), "
                        "dram_compress (as --dram-compress), nopassthrough (every read "
                        "goes through the daemon, never straight from a DRAM file), "
                        "nofast_open (every open waits for the daemon's main thread; by "
                        "default a thread of its own answers opens for reading of files "
                        "whose chunks are all in DRAM and checked), fast_open_files= "
                        "(at most this many such files are kept ready, 1-16384, default "
                        "16384; the one opened least recently makes room), "
                        "nofront_reads (reads of big NVMe-resident files all wait for the "
                        "daemon's main thread; by default that thread answers those that "
                        "fall within chunks already read ahead), "
                        "dram_verify=once|open|ingest (when DRAM copies are checked "
                        "against their checksums: once, the default, as bytes enter DRAM "
                        "and again after anything may have changed them, a restart "
                        "included; open: at every open too, half the read bandwidth; "
                        "ingest: only as bytes enter DRAM), dram_huge (an empty "
                        "--dram-dir gets a tmpfs of its own with 2 MiB pages: faster dense "
                        "files, but a sparse file's scattered chunks take 2 MiB each), "
                        "read_through_min= (files at least this long, default 4M, 0 for "
                        "none, are read from NVMe through the daemon with read-ahead "
                        "instead of being staged whole in DRAM first), meta_size= (most "
                        "the metadata may grow to, default 64G), metrics=[ADDR:]PORT "
                        "(serve the counters of `kvfsctl status` in the Prometheus text "
                        "format at http://ADDR:PORT/metrics; ADDR is 127.0.0.1 unless "
                        "given, e.g. 0.0.0.0:9108; off by default; a port that cannot be "
                        "bound fails the mount), pod=HOST:PORT, pod_name=, "
                        "pod_segment_size= (memory given to the pod's pool, default 25%% "
                        "of dram_size), pod_timeout= (most a lookup waits for the pod, "
                        "default 50ms), pod_metrics=HOST:PORT (the master's metrics port, "
                        "default its host:9003), pod_replicas= (copies of each published "
                        "file in the pod, default 2)")


def settings_from_args(args: argparse.Namespace) -> Settings:
    s = Settings(mountpoint=os.path.abspath(args.mountpoint), dram_dir=args.dram_dir,
                 dram_size=args.dram_size, nvme_dir=args.nvme_dir, nvme_size=args.nvme_size,
                 segment_size=args.segment_size, cache_mode=args.cache_mode,
                 compress=args.compress, dram_compress=args.dram_compress,
                 foreground=args.foreground, debug=args.debug,
                 log_file=args.log_file)
    if args.chunk_size is not None:
        s.chunk_size = args.chunk_size
        s.extra["chunk_size_given"] = "1"
    if args.pod is not None:
        s.pod = args.pod
    if args.pod_name is not None:
        s.pod_name = args.pod_name
    apply_options(s, args.options)
    if "chunk_size=" in args.options:
        s.extra["chunk_size_given"] = "1"
    return s


def umount(mountpoint: str, timeout: float = 120.0) -> int:
    """Unmount and wait until the daemon has written back and exited; 1 (and what the
    daemon said) if it could not write everything back. A dead mount (its daemon gone,
    every access ENOTCONN) is detached, as nothing is left to write back."""
    mp = os.path.abspath(mountpoint)
    try:
        os.stat(mp)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return _detach_dead(mp)
    pid, lock = _daemon(mp)
    r = subprocess.run(["fusermount3", "-u", mp], capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(f"kvfs: {r.stderr.strip() or 'fusermount3 failed'}\n")
        return 1
    deadline = time.monotonic() + timeout
    while pid and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return _verdict(lock)
        time.sleep(0.05)
    if pid:
        sys.stderr.write(f"kvfs: daemon {pid} still running after {timeout:.0f}s\n")
        return 1
    return 0


def _detach_dead(mp: str) -> int:
    """Lazily unmount *mp*, a mount whose daemon is gone: what it held is in the tiers,
    where the next mount finds it."""
    r = subprocess.run(["fusermount3", "-u", "-z", mp], capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(f"kvfs: {r.stderr.strip() or 'fusermount3 failed'}\n")
        return 1
    sys.stderr.write(f"kvfs: {mp} was a dead mount (its daemon was gone): detached it; "
                     "mount again to get back what it held\n")
    return 0


def _daemon(mp: str) -> tuple[int | None, str | None]:
    """The pid of the daemon serving *mp* and its lock file (in its NVMe directory)."""
    try:
        import json

        raw = os.getxattr(mp, "user.kvfs.status")
        lock = os.path.join(json.loads(raw)["settings"]["nvme_dir"], "lock")
        with open(lock) as f:
            return int(f.read().strip() or 0) or None, lock
    except (OSError, ValueError, KeyError):
        return None, None


def _verdict(lock: str | None) -> int:
    """What the daemon left in its lock file when it exited: an unclean unmount says why."""
    from kvfs.daemon import UNCLEAN_PREFIX

    try:
        with open(lock) as f:
            said = f.read().strip()
    except (OSError, TypeError):
        return 0
    if said.startswith(UNCLEAN_PREFIX):
        sys.stderr.write(f"kvfs: {said[len(UNCLEAN_PREFIX):]}\n")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfs", description="kvfs: a tiered filesystem for "
                                     "LLM KV-cache blocks (DRAM tmpfs + NVMe log)")
    parser.add_argument("--version", action="version", version=f"kvfs {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_mount_arguments(sub.add_parser("mount", help="mount kvfs on a directory"))
    p = sub.add_parser("umount", help="unmount and wait for the daemon to finish")
    p.add_argument("mountpoint")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait")
    args = parser.parse_args(argv)
    if args.command == "umount":
        return umount(args.mountpoint, args.timeout)
    from kvfs.daemon import MountError, mount

    try:
        return mount(settings_from_args(args))
    except (ConfigError, MountError) as exc:
        sys.stderr.write(f"kvfs: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
