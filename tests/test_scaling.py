"""What the daemon does per file or per chunk must not grow with how many there are (issue 33,
defects 4 and 5). No clocks: each test counts work the daemon reports and bounds it per unit
of work done, so that it fails however fast the machine is when that work grows with the
files a mount holds."""

from __future__ import annotations

import os

from kvfs.tiering import SCAN_STEP

SMALL_FILES = 700  # 4 KiB each: most of the 4 MiB DRAM tier of the test mount


def _write_small_files(directory, n: int) -> None:
    directory.mkdir()
    blob = os.urandom(4096)
    for i in range(n):
        fd = os.open(directory / f"{i:05d}", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, blob)
        os.close(fd)


def test_demotion_looks_at_each_key_about_once(kv):
    """Big writes after many small files in DRAM: the demoter moves the small files out.
    Each of its steps walked the whole DRAM queue from the cold end, and each write waiting
    for room copied it too, so the keys looked at per chunk moved grew with the files DRAM
    held (60,000 small files: 128 MiB of writes took ~170 s of daemon CPU)."""
    _write_small_files(kv.path / "small", SMALL_FILES)
    before = kv.status()["moves"]
    big = os.urandom(1 << 20)
    for i in range(8):
        (kv.path / f"big{i}").write_bytes(big)
    after = kv.status()
    moved = after["moves"]["demotions"] - before["demotions"]
    examined = after["moves"]["victim_keys_examined"] - before["victim_keys_examined"]
    assert moved >= SMALL_FILES // 2  # the small files did go
    # A pass looks at each key about once (once more where a write waiting for room looks
    # at the coldest, or a pass stops and the next starts over), whatever DRAM holds.
    assert examined <= 4 * moved + 4 * SCAN_STEP, (examined, moved)


def test_writing_small_files_does_not_scan_the_block_index(kv):
    """Each create asked how much RAM the files the kernel writes hold, and each of their
    takes which chunks their inode had: both walked the whole block index (every chunk of
    the store), so writing a file cost more the more files there were (defect 5)."""
    before = kv.status()["index"]["scanned_entries"]
    _write_small_files(kv.path / "small", SMALL_FILES)
    st = kv.status()
    assert st["passthrough"]["write_opens"] > SMALL_FILES // 2  # the kernel wrote them
    scanned = st["index"]["scanned_entries"] - before
    # A walk of the index is still the cheaper way to answer for a file of many chunks while
    # the index is small (tens of entries per chunk asked about): never more than that.
    assert scanned <= 32 * SMALL_FILES, scanned


def test_cache_mode_eviction_looks_at_the_files_it_evicts_only(mount_factory):
    """Each eviction (a write finding the store full, in cache mode) copied the list of every
    file to walk it from the cold end: writes into a full cache cost more the more files it
    held."""
    m = mount_factory(nvme_size="24M", segment_size="1M", cache_mode="1")
    blob = os.urandom(8192)
    d = m.path / "blocks"
    d.mkdir()
    for i in range(3000):
        (d / f"{i:05d}").write_bytes(blob)
    ev = m.status()["evictions"]
    assert ev["files"] >= 500
    assert ev["examined_files"] <= 2 * ev["files"] + 64, ev
