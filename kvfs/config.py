"""Mount settings: one dataclass, size parsing, and `-o key=val` option handling.

Every setting has a default that works on a fresh machine; sizes accept `64M`, `8G`, `25%`
(percent of the free space of the directory the tier lives in, or of RAM for the DRAM tier).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field

DEFAULT_DRAM_DIR = "/dev/shm/kvfs"
# The front thread's table of files whose opens it answers (native/shim/hot.c) holds this
# many at most (the shim sizes it from `fast_open_files`).
FAST_OPEN_FILES_MAX = 16384
DEFAULT_NVME_DIR = "/var/lib/kvfs"

log = logging.getLogger(__name__)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|)\s*$", re.IGNORECASE)
_POD_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class ConfigError(ValueError):
    """A setting has a value kvfs cannot use; the message says which and why."""


def parse_size(text: str | int, *, base: int | None = None, what: str = "size") -> int:
    """Parse `123`, `64K`, `64M`, `8G`, `1.5T` or `25%` (of *base*) into bytes."""
    if isinstance(text, int):
        return text
    m = _PERCENT_RE.match(text)
    if m:
        if base is None:
            raise ConfigError(f"{what}: a percentage is not allowed here: {text!r}")
        pct = float(m.group(1))
        if not 0 < pct <= 100:
            raise ConfigError(f"{what}: percentage must be in (0, 100]: {text!r}")
        return int(base * pct / 100)
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"{what}: not a size: {text!r} (use e.g. 64M, 8G or 25%)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_duration(text: str | float, *, what: str = "duration") -> float:
    """Parse `50ms`, `2s` or `0.05` (seconds) into seconds."""
    if isinstance(text, int | float):
        return float(text)
    m = _DURATION_RE.match(text)
    if not m:
        raise ConfigError(f"{what}: not a duration: {text!r} (use e.g. 50ms, 2s or 0.05)")
    return float(m.group(1)) * (0.001 if m.group(2).lower() == "ms" else 1.0)


def parse_address(text: str, *, what: str = "address") -> tuple[str, int]:
    """Split `HOST:PORT` (`[V6ADDR]:PORT` for IPv6), checking the port."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what}: not HOST:PORT: {text!r}")
    return host, int(port)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _free_bytes(path: str) -> int:
    """Free space of the filesystem that holds *path* (or its nearest existing parent)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path or "/")
    return st.f_bavail * st.f_frsize


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


DEFAULT_SEGMENT_SIZE = "64M"
# Fewest segments a tier may have: the cleaner's 2 reserved, one open per stream (up to 5), one.
MIN_SEGMENTS = 8


@dataclass
class Settings:
    """All knobs of one mount. String sizes are resolved by `resolve()`."""

    mountpoint: str = ""
    # DRAM tier: one sparse file per inode on tmpfs; it outlives the daemon, so a crash loses
    # nothing.
    dram_dir: str = DEFAULT_DRAM_DIR
    # 25% of available RAM: enough to hold the hot set without starving the inference engine.
    dram_size: str | int = "25%"
    # NVMe tier and metadata. 50% of the free disk leaves room for everything else on the machine.
    nvme_dir: str = DEFAULT_NVME_DIR
    nvme_size: str | int = "50%"
    # Unit of placement, checksumming, compression and prefetch; fixed when the filesystem is made.
    chunk_size: str | int = "1M"
    # Segment = unit of NVMe space reclamation (like an FDP reclaim unit). Left at its default,
    # it is halved (down to 4 chunks) until the tier holds 32 segments: the cleaner's reserve
    # and each stream's open segment are whole segments, not to be half of a small tier.
    segment_size: str | int = DEFAULT_SEGMENT_SIZE
    # Cache mode: when full, evict whole least-recently-used files instead of answering ENOSPC.
    cache_mode: bool = False
    foreground: bool = False
    debug: bool = False
    allow_other: bool = True
    # Demotion starts above the high watermark and stops below the low one (fractions of dram_size).
    dram_high_watermark: float = 0.90
    dram_low_watermark: float = 0.75
    # FUSE passthrough (Linux 6.9+): a file opened for reading whose chunks are all in DRAM
    # is read by the kernel straight from its DRAM file, without a request to the daemon.
    passthrough: bool = True
    # With passthrough: a thread of the daemon's own reads the FUSE device, and answers an
    # open for reading of a file still as a passthrough open found it (every chunk in DRAM
    # and checked) at once, instead of queueing it behind the daemon's other work.
    fast_open: bool = True
    # With passthrough: that thread also answers READs of big NVMe-resident files
    # (read_through_min) that fall within chunks already read ahead into the daemon's
    # memory, instead of queueing them for the daemon's main thread.
    front_reads: bool = True
    # At most this many files are in the front thread's table at once (each holds a kernel
    # reference to its DRAM file); when it is full, the file opened least recently leaves it.
    fast_open_files: int = FAST_OPEN_FILES_MAX
    # When DRAM copies are checked against their checksums (a passthrough open checks the
    # whole file for the reads the kernel will serve without us):
    # "once": bytes are checked as they enter DRAM (staged NVMe reads checked, written
    #   chunks hashed) and then again only if something may have changed them: any write
    #   into a region forgets its check, and after a restart every copy is checked at its
    #   first read. RAM is otherwise trusted, as the page cache is.
    # "open": every open (and every handle's first read of a chunk) hashes the chunks
    #   again: a second pass over the file's memory, about half the read bandwidth here.
    # "ingest": only as bytes enter DRAM, never after a restart either.
    dram_verify: str = "once"
    # Give the DRAM tier a tmpfs of its own at dram_dir, with transparent huge pages
    # (huge=within_size), if dram_dir is not a mountpoint yet and holds nothing: 2 MiB pages
    # make writing, reading and hashing a dense DRAM file ~1.5x faster here than 4 KiB ones.
    # Off by default: a sparse file's scattered chunks would each take a whole 2 MiB page,
    # and the mount's size (2 x dram_size) would then be reached long before the tier is.
    dram_huge: bool = False
    # Compression on the NVMe tier.
    compress: bool = True
    # Keep clean DRAM copies (prefetched, promoted, written back) compressed as on NVMe: more
    # chunks fit (1.2-1.5x for fp16/bf16 KV), and each DRAM hit pays a decode in a worker.
    dram_compress: bool = False
    # Files at least this long (0: none) are read from NVMe through the daemon, 8 MiB ahead
    # of the reader into its memory, instead of being staged whole in DRAM for the kernel to
    # read (nor prefetched into DRAM; a chunk read again is promoted): for a big file that
    # overlaps the disk with the copy to the reader and spares a copy into fresh tmpfs pages.
    read_through_min: str | int = "4M"
    # Worker threads for disk I/O, checksums and compression.
    io_threads: int = 8
    # Prefetch: chunks staged ahead of the reader (whole-file readahead on open).
    readahead_chunks: int = 16
    # Prediction-driven prefetch (issue 3); off: plain SLRU tiering, nothing prefetched.
    prefetch: bool = True
    # Prefetch bandwidth cap in bytes/s (0: none); demand reads always go first anyway.
    prefetch_bandwidth: str | int = 0
    # Prefetches in flight at most, on threads of their own (demand reads never wait for
    # them); a prefetch takes many DRAM hits' time, so several must run to keep ahead.
    prefetch_concurrency: int = 8
    # NVMe placement streams (1-5): short, gc, long, medium, cold; see kvfs/store/streams.py.
    streams: int = 4
    log_file: str | None = None
    # Serve the status counters in the Prometheus text format at http://[ADDR:]PORT/metrics
    # (kvfs/metrics.py); "" (the default): no endpoint. ADDR defaults to 127.0.0.1.
    metrics: str = ""
    # Most the metadata (lmdb) may grow to: ~100 bytes per chunk and per file. Only address
    # space until used.
    meta_size: str | int = "64G"
    # Tests only (kvfs/faults.py): the daemon kills itself at this crash point (POINT or
    # POINT:N); NVMe stagings take SECONDS longer while PATH exists (SECONDS:PATH).
    crash_at: str = ""
    fetch_delay: str = ""
    # The pod tier (issue 35, kvfs/store/pod.py, kvfs/podfiles.py).
    # The pod's Mooncake master, HOST:PORT ("": no pod).
    pod: str = ""
    # Which pod, on that master: part of every object key, so pods can share a master.
    pod_name: str = "kvfs"
    # Memory this member gives the pod's pool (Mooncake's global segment): a size, or a
    # percentage of dram_size.
    pod_segment_size: str | int = "25%"
    # Most a pod call may hold up a request before it counts as a miss: 50ms, 0.05 or 1s.
    pod_timeout: str | float = "50ms"
    # Where the master serves its metrics (HOST:PORT; "": the master's host, port 9003),
    # which say how many members the pod has.
    pod_metrics: str = ""
    # Copies the pod keeps of each published object, each in another member's memory: a
    # member's death loses none of what it published while another copy is left (1-4).
    pod_replicas: int = 2
    extra: dict[str, str] = field(default_factory=dict)

    def resolve(self) -> Settings:
        """Return a copy with every size in bytes, checked for sanity."""
        s = dataclasses.replace(self)
        s.chunk_size = parse_size(self.chunk_size, what="chunk_size")
        if s.chunk_size < 4096 or s.chunk_size > (64 << 20) or s.chunk_size & (s.chunk_size - 1):
            raise ConfigError(
                f"chunk_size must be a power of two between 4K and 64M, not {self.chunk_size}"
            )
        s.segment_size = parse_size(self.segment_size, what="segment_size")
        if s.segment_size < 2 * s.chunk_size + 8192:
            raise ConfigError(
                f"segment_size ({format_size(s.segment_size)}) must hold at least two chunks"
            )
        s.dram_size = parse_size(self.dram_size, base=_mem_available(), what="dram_size")
        s.nvme_size = parse_size(self.nvme_size, base=_free_bytes(self.nvme_dir), what="nvme_size")
        s.prefetch_bandwidth = parse_size(self.prefetch_bandwidth, what="prefetch_bandwidth")
        s.read_through_min = parse_size(self.read_through_min, what="read_through_min")
        s.meta_size = parse_size(self.meta_size, what="meta_size")
        if s.meta_size < (16 << 20):
            raise ConfigError(f"meta_size must be at least 16M, not {self.meta_size}")
        if s.dram_size < 4 * s.chunk_size:
            raise ConfigError(f"dram_size must hold at least 4 chunks, not {self.dram_size}")
        if self.segment_size == DEFAULT_SEGMENT_SIZE:
            while (s.nvme_size < 32 * s.segment_size
                   and s.segment_size // 2 >= max(4 * s.chunk_size, 2 * s.chunk_size + 8192)):
                s.segment_size //= 2
        if s.nvme_size < MIN_SEGMENTS * s.segment_size:
            raise ConfigError(
                f"nvme_size ({format_size(s.nvme_size)}) must hold at least {MIN_SEGMENTS} "
                f"segments of {format_size(s.segment_size)} (the cleaner's reserve and one "
                "open segment per stream are whole segments)"
            )
        if not 0 < s.dram_low_watermark < s.dram_high_watermark <= 1:
            raise ConfigError("need 0 < dram_low_watermark < dram_high_watermark <= 1")
        if s.io_threads < 1:
            raise ConfigError("io_threads must be >= 1")
        if s.prefetch_concurrency < 1:
            raise ConfigError("prefetch_concurrency must be >= 1")
        if s.dram_verify not in ("once", "open", "ingest"):
            raise ConfigError(f"dram_verify must be once, open or ingest, "
                              f"not {s.dram_verify!r}")
        if not 1 <= s.fast_open_files <= FAST_OPEN_FILES_MAX:
            raise ConfigError(f"fast_open_files must be between 1 and {FAST_OPEN_FILES_MAX}, "
                              f"not {s.fast_open_files}")
        if not 1 <= s.streams <= 5:
            raise ConfigError(f"streams must be between 1 and 5, not {s.streams}")
        if s.pod:
            parse_address(s.pod, what="pod")
        if s.pod_metrics:
            parse_address(s.pod_metrics, what="pod_metrics")
        if not 1 <= s.pod_replicas <= 4:
            raise ConfigError(f"pod_replicas must be between 1 and 4, not {s.pod_replicas}")
        if not _POD_NAME_RE.match(s.pod_name):
            raise ConfigError(f"pod_name must be 1-64 letters, digits, '.', '_' or '-', "
                              f"not {s.pod_name!r}")
        s.pod_segment_size = parse_size(self.pod_segment_size, base=s.dram_size,
                                        what="pod_segment_size")
        if s.pod and s.pod_segment_size < (16 << 20):
            raise ConfigError(f"pod_segment_size must be at least 16M, not "
                              f"{self.pod_segment_size}")
        s.pod_timeout = parse_duration(self.pod_timeout, what="pod_timeout")
        if not 0.001 <= s.pod_timeout <= 10:
            raise ConfigError(f"pod_timeout must be between 1ms and 10s, not {self.pod_timeout}")
        s.dram_dir = os.path.abspath(self.dram_dir)
        s.nvme_dir = os.path.abspath(self.nvme_dir)
        return s


_BOOL_OPTIONS = {"cache_mode", "foreground", "debug", "allow_other", "compress", "prefetch",
                 "dram_compress", "passthrough", "dram_huge", "fast_open", "front_reads"}
_FLOAT_OPTIONS = {"dram_high_watermark", "dram_low_watermark"}
_INT_OPTIONS = {"io_threads", "readahead_chunks", "streams", "prefetch_concurrency",
                "fast_open_files", "pod_replicas"}
# Generic mount options that mount(8) passes along and kvfs has nothing to do with.
IGNORED_MOUNT_OPTIONS = {"rw", "defaults", "auto", "noauto", "user", "nouser", "nofail", "_netdev",
                         "dev", "nodev", "suid", "nosuid", "exec", "noexec", "atime", "noatime",
                         "relatime", "x-systemd.automount"}
# Options of earlier versions that no longer do anything, and why: still accepted in any form
# (`name`, `noname`, `name=value`) so that the mount lines written for them keep working.
RETIRED_OPTIONS = {
    "dram_prefault": "it reserved the DRAM arena's RAM at mount; since format 3 each DRAM file "
                     "takes its pages as chunks arrive",
}


def apply_options(settings: Settings, options: str) -> None:
    """Apply a mount(8)-style `key=val,flag,...` string to *settings*."""
    names = {f.name for f in dataclasses.fields(Settings)} - {"mountpoint", "extra"}
    retired: dict[str, None] = {}  # in the order given, once each
    for item in filter(None, (o.strip() for o in options.split(","))):
        key, sep, value = item.partition("=")
        key = key.replace("-", "_")
        if key in IGNORED_MOUNT_OPTIONS or key.startswith("x-"):
            continue
        if (name := key[2:] if key.startswith("no") and not sep else key) in RETIRED_OPTIONS:
            retired[name] = None
            continue
        if key.startswith("no") and key[2:] in _BOOL_OPTIONS and not sep:
            setattr(settings, key[2:], False)
            continue
        if key not in names:
            raise ConfigError(f"unknown option {key!r}")
        if key in _BOOL_OPTIONS:
            setattr(settings, key, _parse_bool(key, value) if sep else True)
        elif not sep:
            raise ConfigError(f"option {key!r} needs a value ({key}=...)")
        elif key in _FLOAT_OPTIONS:
            try:
                setattr(settings, key, float(value))
            except ValueError:
                raise ConfigError(f"option {key}: not a number: {value!r}") from None
        elif key in _INT_OPTIONS:
            try:
                setattr(settings, key, int(value))
            except ValueError:
                raise ConfigError(f"option {key}: not an integer: {value!r}") from None
        else:
            setattr(settings, key, value)
    if retired:
        log.warning("ignoring retired mount option%s: %s", "s" if len(retired) > 1 else "",
                    "; ".join(f"{name} ({RETIRED_OPTIONS[name]})" for name in retired))


def _parse_bool(key: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"option {key}: not a boolean: {value!r}")
