"""`-o metrics=[ADDR:]PORT`: the daemon's Prometheus endpoint, scraped over HTTP from a real
mount, its numbers those of `kvfsctl status`; an address that cannot be bound fails the
mount with one message; the Grafana dashboard asks only for metrics that exist."""

from __future__ import annotations

import json
import os
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfs.metrics import metrics_of

DASHBOARD = Path(__file__).resolve().parent.parent / "tools" / "grafana-kvfs.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:PORT/metrics, keyed by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _reads(m: dict, tier: str) -> float:
    return m[("kvfs_read_chunks_total", (("tier", tier),))]


def _latency_count(m: dict, tier: str) -> float:
    return m[("kvfs_read_latency_seconds_bucket", (("le", "+Inf"), ("tier", tier)))]


def test_metrics_follow_the_mount(mount_factory):
    port = _free_port()
    m = mount_factory(metrics=port)
    first = scrape(port)
    st = m.status()
    for tier in ("dram", "nvme"):
        assert (first[("kvfs_tier_capacity_bytes", (("tier", tier),))]
                == st["tiers"][tier]["capacity_bytes"])
    assert first[("kvfs_files", ())] == 0
    assert _reads(first, "dram") == _reads(first, "nvme") == 0

    data = os.urandom(1 << 20)  # 16 chunks of 64 KiB
    (m.path / "blob").write_bytes(data)
    with open(m.path / "blob", "rb", buffering=0) as f:
        assert f.read() == data
    os.setxattr(m.path / "blob", "user.kvfs.pin", b"1")
    second = scrape(port)
    assert (second[("kvfs_dram_pinned_files", ())], second[("kvfs_dram_pinned_bytes", ())],
            second[("kvfs_dram_pin_limit_bytes", ())]) == (1, len(data), 2 << 20)
    os.removexattr(m.path / "blob", "user.kvfs.pin")
    _dashboard_asks_for_what_exists(second, m.status())
    assert second[("kvfs_files", ())] == 1
    assert second[("kvfs_tier_used_bytes", (("tier", "dram"),))] >= len(data)
    assert second[("kvfs_tier_logical_bytes", (("tier", "dram"),))] >= len(data)
    assert _reads(second, "dram") >= 16
    assert second[("kvfs_checksum_errors_total", ())] == 0

    # Written back at unmount, its DRAM copies gone: the next mount reads it from NVMe.
    m.unmount()
    with pytest.raises(urllib.error.URLError):  # the endpoint went with the daemon
        scrape(port)
    m.lose_dram()
    m.start()
    with open(m.path / "blob", "rb", buffering=0) as f:
        assert f.read() == data
    third = scrape(port)
    assert _reads(third, "nvme") >= 16
    assert third[("kvfs_read_requests_total", (("tier", "nvme"),))] == (
        m.status()["reads"]["requests_from_nvme"])
    assert third[("kvfs_tier_used_bytes", (("tier", "nvme"),))] > 0
    # a DRAM miss was timed (unless the kernel read it by passthrough, staged by an open)
    assert _latency_count(third, "nvme") > 0 or m.status()["passthrough"]["staged_chunks"]
    assert third[("kvfs_uptime_seconds", ())] >= 0
    st = m.status()
    assert _reads(third, "nvme") <= st["reads"]["chunks_from_nvme"]  # (only ever grows)


def test_metrics_port_in_use_fails_the_mount(mount_factory):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        m = mount_factory(start=False, metrics=port)
        with pytest.raises(RuntimeError, match=f"127.0.0.1:{port}: Address already in use"):
            m.start()
    assert not os.path.ismount(m.path)


@pytest.mark.parametrize("address", ["localhost:notaport", "70000", "a:b:1"])
def test_metrics_bad_address_is_refused(mount_factory, address):
    m = mount_factory(start=False, metrics=address)
    with pytest.raises(RuntimeError, match=r"mount failed \(2\): kvfs: metrics: not an "):
        m.start()
    assert not m.nvme_dir.exists()  # refused before anything was made


def _dashboard_asks_for_what_exists(scraped: dict, st: dict) -> None:
    """Every metric the dashboard's queries name is one the mount exports (the cache-mode
    eviction counters: one a cache-mode mount exports)."""
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"]
             for t in p.get("targets", ())]
    used = {name for e in exprs for name in re.findall(r"\bkvfs_\w+", e)}
    def names(status: dict) -> set[str]:
        return {s.name for family in metrics_of(status) for s in family.samples}
    exported = {name for name, _ in scraped}
    exported |= names(st | {"evictions": {"files": 0, "bytes": 0}}) - names(st)
    assert used and used <= exported, used - exported
