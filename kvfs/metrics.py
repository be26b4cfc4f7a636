"""`-o metrics=[ADDR:]PORT`: the daemon's counters in the Prometheus text format.

The numbers are those of `kvfsctl status` (Control.status, the store's stats()), read afresh
at each scrape by a custom Collector: nothing is counted twice, and the two views never
disagree. The HTTP server (prometheus_client's) runs on a thread of its own; each scrape
asks the trio thread for the status (trio.from_thread), because the store's counters and
maps belong to that thread and change under any other.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator

import trio
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from kvfs.config import ConfigError

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"  # the counters say much about the workload: loopback unless asked
_ADDR_RE = re.compile(r"^(?:(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\[\]]+):)?(?P<port>\d+)$")


def parse_address(text: str) -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[IPV6]:PORT` into (host, port); no host means 127.0.0.1."""
    m = _ADDR_RE.match(text.strip())
    if not m or not 1 <= int(m.group("port")) <= 65535:
        raise ConfigError(f"metrics: not an address: {text!r} (use PORT, HOST:PORT or "
                          f"[IPV6]:PORT, e.g. metrics=9108 or metrics=0.0.0.0:9108)")
    host = (m.group("host") or DEFAULT_HOST).strip("[]")
    return host, int(m.group("port"))


class StatusCollector(Collector):
    """Prometheus metrics from the status that the function given to `attach` returns,
    called on the thread of the trio run whose token came with it."""

    def __init__(self) -> None:
        self.source: tuple[trio.lowlevel.TrioToken, Callable[[], dict]] | None = None

    def attach(self, token: trio.lowlevel.TrioToken, status_fn: Callable[[], dict]) -> None:
        self.source = token, status_fn

    def detach(self) -> None:
        self.source = None

    def collect(self) -> Iterator[Metric]:
        source = self.source
        if source is None:  # not serving yet, or no more: no numbers rather than stale ones
            return
        token, status_fn = source
        try:
            st = trio.from_thread.run_sync(status_fn, trio_token=token)
        except trio.RunFinishedError:
            return
        yield from metrics_of(st)


def metrics_of(st: dict) -> Iterator[Metric]:
    """The metric families for one status snapshot *st* (Control.status's shape)."""
    tiers = st["tiers"]
    for key, doc in (("capacity_bytes", "Capacity of the tier."),
                     ("used_bytes", "Bytes the tier's chunks take (after compression)."),
                     ("logical_bytes", "Bytes of file data the tier's chunks hold."),
                     ("chunks", "Chunks the tier holds.")):
        g = GaugeMetricFamily(f"kvfs_tier_{key}", doc, labels=["tier"])
        for name, t in tiers.items():
            g.add_metric([name], t[key])
        yield g
    yield GaugeMetricFamily("kvfs_dram_dirty_bytes", "DRAM bytes not yet written to NVMe.",
                            value=tiers["dram"].get("dirty_bytes", 0))
    for key, doc in (("pinned_files", "Files pinned in DRAM (kvfsctl pin)."),
                     ("pinned_bytes", "DRAM the pinned files hold, or will once staged."),
                     ("pin_limit_bytes", "Most DRAM the pinned files may hold.")):
        yield GaugeMetricFamily(f"kvfs_dram_{key}", doc, value=tiers["dram"][key])
    r = st["reads"]
    c = CounterMetricFamily(
        "kvfs_read_chunks", "Chunks read, by the tier that served them: dram is a DRAM hit, "
        "nvme a DRAM miss, hole a chunk never written. A chunk counts at the READ that "
        "takes its first byte, or when an open stages it or hands it to the kernel "
        "(passthrough).", labels=["tier"])
    for tier, key in (("dram", "chunks_from_dram"), ("nvme", "chunks_from_nvme"),
                      ("hole", "chunks_from_holes")):
        c.add_metric([tier], r[key])
    yield c
    c = CounterMetricFamily(
        "kvfs_read_requests", "READ requests the daemon served, once per chunk each took "
        "bytes of, by the tier that served them.", labels=["tier"])
    for tier, key in (("dram", "requests_from_dram"), ("nvme", "requests_from_nvme"),
                      ("hole", "requests_from_holes")):
        c.add_metric([tier], r[key])
    yield c
    yield CounterMetricFamily("kvfs_checksum_errors", "Chunks whose bytes failed their "
                              "checksum when read (the read got EIO).",
                              value=r["checksum_errors"])
    h = HistogramMetricFamily(
        "kvfs_read_latency_seconds", "Time the daemon took to serve a chunk of a READ, by "
        "tier (log2 buckets; no _sum: the daemon keeps bucket counts only).",
        labels=["tier"])
    for tier in ("dram", "nvme"):
        hist = r.get(f"{tier}_latency_us_log2_histogram")
        if hist:
            h.add_metric([tier], _buckets(hist), None)
    yield h
    pf = st.get("prefetch", {})
    for key, doc in (("issued", "Chunks prefetched from NVMe into DRAM."),
                     ("used", "Prefetched chunks read while in DRAM."),
                     ("late", "Reads that found their chunk's prefetch still in flight."),
                     ("wasted", "Prefetched chunks that left DRAM unread.")):
        yield CounterMetricFamily(f"kvfs_prefetch_{key}_chunks", doc,
                                  value=pf.get(f"{key}_chunks", 0))
    m = st["moves"]
    c = CounterMetricFamily("kvfs_chunk_moves", "Chunks moved between tiers: demotion (DRAM "
                            "to NVMe), writeback (copied to NVMe, kept in DRAM), promotion "
                            "(NVMe to DRAM).", labels=["kind"])
    for kind, key in (("demotion", "demotions"), ("writeback", "writebacks"),
                      ("promotion", "promotions")):
        c.add_metric([kind], m[key])
    yield c
    g = st["gc"]
    yield CounterMetricFamily("kvfs_nvme_user_written_bytes", "Bytes of records written to "
                              "NVMe for file data.", value=g["user_bytes_written"])
    yield CounterMetricFamily("kvfs_nvme_gc_written_bytes", "Bytes the cleaner copied to "
                              "free NVMe segments.", value=g["gc_bytes_written"])
    yield GaugeMetricFamily("kvfs_nvme_write_amplification", "(user + gc bytes written) / "
                            "user bytes written, since the mount.",
                            value=g["write_amplification"])
    if "evictions" in st:
        e = st["evictions"]
        yield CounterMetricFamily("kvfs_cache_evicted_files", "Files a cache-mode mount "
                                  "deleted to make room.", value=e["files"])
        yield CounterMetricFamily("kvfs_cache_evicted_bytes", "Bytes of the files a "
                                  "cache-mode mount deleted to make room.", value=e["bytes"])
    yield GaugeMetricFamily("kvfs_files", "Files in the filesystem.", value=st["files"])
    yield GaugeMetricFamily("kvfs_uptime_seconds", "Seconds since the mount.",
                            value=st["uptime_s"])


def _buckets(hist: list[int]) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets of a log2 histogram: bucket i counts reads of fewer
    than 2**i microseconds (and at least half that); the last one, all longer ones."""
    out, seen = [], 0
    for i, n in enumerate(hist[:-1]):
        seen += n
        out.append((repr((1 << i) / 1e6), seen))
    out.append(("+Inf", seen + hist[-1]))
    return out


class MetricsServer:
    """The HTTP endpoint: bound by `start` (which raises OSError if it cannot be), serving
    numbers while the daemon's trio run is attached (`collector.attach`)."""

    def __init__(self, address: str) -> None:
        self.host, self.port = parse_address(address)
        self.collector = StatusCollector()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self._httpd = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._httpd, self._thread = start_http_server(self.port, self.host, self.registry)
        log.info("metrics on http://%s/metrics", self.url_host())

    def url_host(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self._httpd.server_port if self._httpd else self.port}"

    def stop(self) -> None:
        self.collector.detach()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
