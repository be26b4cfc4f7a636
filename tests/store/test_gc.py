"""Segment cleaning through a real mount: space comes back, nothing is lost or corrupted,
accounting adds up, and a crash in the middle of cleaning loses nothing."""

from __future__ import annotations

import os
import random

SMALL_NVME = {"dram_size": "2M", "nvme_size": "16M", "segment_size": "1M"}


def _churn(m, rounds: int, seed: int, live: dict[str, bytes]) -> None:
    """Per-request blocks come and go; a few long-lived ones stay; some are overwritten."""
    rng = random.Random(seed)
    for i in range(rounds):
        name = f"r{seed}_{i}"
        data = rng.randbytes(rng.choice([64 << 10, 128 << 10, 256 << 10]))
        (m.path / name).write_bytes(data)
        live[name] = data
        if len(live) > 24:
            victim = rng.choice(sorted(live))
            os.unlink(m.path / victim)
            del live[victim]
        if i % 7 == 0 and live:
            target = rng.choice(sorted(live))
            patch = rng.randbytes(1000)
            off = rng.randrange(0, len(live[target]) - 1000)
            with open(m.path / target, "r+b") as f:
                f.seek(off)
                f.write(patch)
            b = bytearray(live[target])
            b[off:off + 1000] = patch
            live[target] = bytes(b)


def _verify(m, live: dict[str, bytes]) -> None:
    for name, data in live.items():
        assert (m.path / name).read_bytes() == data, name


def test_churn_reclaims_space_and_keeps_data(mount_factory):
    m = mount_factory(**SMALL_NVME)
    live: dict[str, bytes] = {}
    _churn(m, 250, 1, live)  # ~40 MiB written through a 16 MiB NVMe tier
    _verify(m, live)
    st = m.status()
    g = st["gc"]
    assert g["user_bytes_written"] > 16 << 20
    assert g["write_amplification"] >= 1.0
    assert g["write_amplification"] == round(
        (g["user_bytes_written"] + g["gc_bytes_written"]) / g["user_bytes_written"], 4)
    assert st["tiers"]["nvme"]["segments"] <= 16
    m.unmount()
    m.start()
    _verify(m, live)


def test_crash_during_cleaning_loses_nothing(mount_factory):
    m = mount_factory(**SMALL_NVME)
    live: dict[str, bytes] = {}
    _churn(m, 150, 2, live)
    m.kill()  # cleaning and demotion are busy at this point
    m.start()
    _verify(m, live)
    _churn(m, 100, 3, live)
    _verify(m, live)
    assert m.status()["reads"]["checksum_errors"] == 0
