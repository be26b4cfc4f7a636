"""Placement streams: the stream table, write-life hints, lifetime hints by xattr, lifetimes
learned per directory, and records of different classes landing in different segments of a
real mount."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvfs.namespace import Namespace
from kvfs.store.streams import (
    LIFETIME_XATTR,
    MIN_SAMPLES,
    RWH_WRITE_LIFE_EXTREME,
    RWH_WRITE_LIFE_LONG,
    RWH_WRITE_LIFE_NOT_SET,
    RWH_WRITE_LIFE_SHORT,
    LifetimeClassifier,
    StreamTable,
    device_info,
    set_write_hint,
)

# -- the table ---------------------------------------------------------------------------


def test_stream_tables():
    one = StreamTable.make(1)
    assert set(one.route.values()) == {0} and one.hints == (RWH_WRITE_LIFE_NOT_SET,)
    assert not one.separates_user_data and one.gc_destination(0) == 0
    two = StreamTable.make(2)
    assert two.names == ("user", "gc") and two.gc == 1
    assert {two.route[c] for c in ("short", "medium", "long")} == {0}
    three = StreamTable.make(3)
    assert three.route == {"short": 0, "gc": 1, "long": 2, "medium": 2, "cold": 1}
    four = StreamTable.make(4)
    assert four.names == ("short", "gc", "long", "medium")
    assert four.hints[:3] == (RWH_WRITE_LIFE_SHORT, RWH_WRITE_LIFE_EXTREME, RWH_WRITE_LIFE_LONG)
    assert four.gc_destination(0) == four.gc_destination(2) == four.gc_destination(1) == 1
    five = StreamTable.make(5)
    assert five.gc_destination(0) == 1 and five.gc_destination(1) == 4  # relocated twice: cold
    # a record of the short class goes back where short user data goes, with 3+ streams
    for table in (three, four, five):
        for victim in range(table.count):
            assert table.gc_destination(victim, "short") == table.route["short"]
        assert table.gc_destination(0, "long") == table.gc_destination(0)
    assert one.gc_destination(0, "short") == 0 and two.gc_destination(0, "short") == 1
    assert five.name(7) == "stream7"
    for bad in (0, 6):
        with pytest.raises(ValueError):
            StreamTable.make(bad)


def test_write_life_hint_is_kept_and_read_back(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert set_write_hint(fd, RWH_WRITE_LIFE_SHORT)
        assert set_write_hint(fd, RWH_WRITE_LIFE_EXTREME)
        assert not set_write_hint(fd, 99)  # EINVAL: reported, not raised
    finally:
        os.close(fd)
    assert not set_write_hint(fd, RWH_WRITE_LIFE_SHORT)  # closed fd
    info = device_info(str(tmp_path))
    assert set(info) == {"device", "write_streams", "discard", "fs_discard"}


# -- the classifier with a namespace stub --------------------------------------------------


class FakeNs:
    """/ (1) -> req (2) -> r7 (5); / -> prefix (3); / -> mixed (4); files under them."""

    def __init__(self) -> None:
        self.parent = {1: 1, 2: 1, 3: 1, 4: 1, 5: 2}
        self.names: dict[int, set] = {}
        self.xattrs: dict[tuple[int, bytes], bytes] = {}

    def add(self, ino: int, d: int) -> int:
        self.names[ino] = {(d, f"f{ino}".encode())}
        return ino

    def names_of(self, ino: int):
        return self.names.get(ino, set())

    def getxattr(self, ino: int, name: bytes):
        return self.xattrs.get((ino, name))

    ancestors = Namespace.ancestors  # walks names_of and parent, as above


class Clock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


def _classifier(streams: int = 4):
    ns, clock = FakeNs(), Clock()
    return ns, clock, LifetimeClassifier(ns, StreamTable.make(streams), clock, 1000)


def test_explicit_hints_file_then_nearest_directory():
    ns, clock, c = _classifier()
    f = ns.add(100, 5)  # /req/r7/f100
    assert c.classify(f) == "medium"  # nothing known
    ns.xattrs[(1, LIFETIME_XATTR)] = b"long"  # on the root: inherited by everything
    assert c.classify(f) == "long"
    ns.xattrs[(2, LIFETIME_XATTR)] = b"short"  # on /req: nearer wins
    assert c.classify(f) == "short" and c.stream_of(f) == 0
    ns.xattrs[(5, LIFETIME_XATTR)] = b"bogus"  # ignored, the search goes on
    assert c.classify(f) == "short"
    ns.xattrs[(f, LIFETIME_XATTR)] = b"LONG\n"  # on the file itself
    assert c.classify(f) == "long" and c.stream_of(f) == 2
    ns.xattrs[(f, LIFETIME_XATTR)] = b"auto"  # stop: ask the classifier (nothing learned)
    assert c.classify(f) == "medium" and c.stream_of(f) == 3
    assert c.decisions["hint"] == 6


def test_learns_short_and_long_directories_and_inherits_to_new_subdirectories():
    ns, clock, c = _classifier()
    ino = 1000
    for _ in range(3 * MIN_SAMPLES):
        # a request block under /req/r7: written back, deleted soon after
        f = ns.add(ino := ino + 1, 5)
        c.stream_of(f)
        clock.t += 10
        c.deleted(f)
        # a prefix block under /prefix: written back, still alive much later
        g = ns.add(ino := ino + 1, 3)
        c.stream_of(g)
        clock.t += 100
    clock.t += 1000
    c.stream_of(ns.add(ino := ino + 1, 3))  # expiry is noticed on the next call
    assert c.outcomes["died"] >= 3 * MIN_SAMPLES and c.outcomes["outlived"] >= MIN_SAMPLES
    assert c.classify(ns.add(ino := ino + 1, 5)) == "short"
    assert c.classify(ns.add(ino := ino + 1, 3)) == "long"
    # a brand-new request directory has no history: its parent /req decides
    ns.parent[6] = 2
    assert c.classify(ns.add(ino := ino + 1, 6)) == "short"
    # a directory of mixed lifetimes is "medium"; the root, which has seen both, too
    for i in range(2 * MIN_SAMPLES):
        f = ns.add(ino := ino + 1, 4)
        c.stream_of(f)
        clock.t += 1
        if i % 2:
            c.deleted(f)
    clock.t += 2000
    c.stream_of(ns.add(ino := ino + 1, 3))
    assert c.classify(ns.add(ino := ino + 1, 4)) == "medium"
    st = c.stats()["placement"]
    assert st["directories"]["short"] >= 1 and st["directories"]["long"] >= 1


def _fifo(ns, clock, c, ino: int, *, window: int, steps: int, prefixes: int) -> int:
    """A FIFO window of *window* request files in /req (2) beside *prefixes* files in
    /prefix (3) that never die; one request per step, each 10 bytes of the byte clock;
    the prefixes are written during the first *prefixes* steps."""
    live: list[int] = []
    for i in range(steps):
        if i < prefixes:
            c.stream_of(ns.add(ino := ino + 1, 3))
        f = ns.add(ino := ino + 1, 2)
        c.stream_of(f)
        live.append(f)
        clock.t += 10
        if len(live) > window:
            c.deleted(live.pop(0))
    return ino


@pytest.mark.parametrize("window_share", [0.05, 0.5, 0.7])
def test_request_window_is_short_beside_prefixes_whatever_its_size(window_share):
    """Issue 37: a FIFO window of per-request files is ranked `short` beside long-lived
    prefixes whether the window is 5% or 70% of the tier (a fixed threshold of 25% of the
    tier put windows of 50% and 70% in the prefixes' stream)."""
    ns, clock, c = _classifier()  # tier: 1000 bytes of the byte clock
    window = max(2, int(window_share * 1000 / 10))
    ino = _fifo(ns, clock, c, 1000, window=window, steps=window + 40 * MIN_SAMPLES,
                prefixes=2 * MIN_SAMPLES)
    assert c.classify(ns.add(ino + 1, 2)) == "short"
    assert c.classify(ns.add(ino + 2, 3)) == "long"
    assert c.stream_of(ns.add(ino + 3, 2)) != c.stream_of(ns.add(ino + 4, 3))


def test_a_directory_being_learned_is_not_decided_by_its_ancestors():
    """Requests in /req learned `short` (and the root with them); then prefixes in /prefix
    that have not outlived anything yet: they are not `short` by the root's verdict (they
    were, until they outlived the horizon: FIFO segments that never emptied). A new
    directory of a few files under /req still takes /req's verdict."""
    ns, clock, c = _classifier()
    ino = _fifo(ns, clock, c, 1000, window=25, steps=25 + 4 * MIN_SAMPLES, prefixes=0)
    assert c.classify(ns.add(ino := ino + 1, 2)) == "short"
    got = [c.classify(ns.add(ino := ino + 1, 3)) for _ in range(2 * MIN_SAMPLES)]
    assert got[:MIN_SAMPLES - 1] == ["short"] * (MIN_SAMPLES - 1)  # few: the root's
    assert "short" not in got[MIN_SAMPLES:]
    assert c.known_class(ino) is None
    ns.parent[6] = 2
    assert c.classify(ns.add(ino + 1, 6)) == "short"


def test_undecided_directories_are_kept_apart():
    """Issue 37: before anything is known, the records of two directories go to different
    streams (they were all `medium`, so requests and prefixes shared segments until the
    requests' lifetimes were learned); a third shares one of them."""
    ns, clock, c = _classifier()
    first, second, third = ns.add(10, 3), ns.add(11, 2), ns.add(12, 4)
    assert c.classify(first) == "medium" and c.classify(second) == "long"
    assert c.stream_of(ns.add(13, 3)) != c.stream_of(ns.add(14, 2))
    assert c.classify(third) == "medium"


def test_hints_win_over_what_was_learned():
    """A hint on a directory decides its files' class even where learning says otherwise."""
    ns, clock, c = _classifier()
    ino = _fifo(ns, clock, c, 1000, window=5, steps=20 * MIN_SAMPLES, prefixes=2 * MIN_SAMPLES)
    assert c.classify(ns.add(ino + 1, 2)) == "short"
    ns.xattrs[(2, LIFETIME_XATTR)] = b"long"
    ns.xattrs[(3, LIFETIME_XATTR)] = b"short"
    assert c.classify(ns.add(ino + 2, 2)) == "long"
    assert c.classify(ns.add(ino + 3, 3)) == "short"


def test_known_class_for_the_cleaners_copies_decides_nothing():
    """What the cleaner asks about a file it copies: a hint or a verdict, else None (not
    the turn-taking default); the file is not watched again (its lifetime would be
    measured from the copy) and no decision is counted."""
    ns, clock, c = _classifier()
    assert c.known_class(ns.add(10, 4)) is None  # nothing known yet
    ino = _fifo(ns, clock, c, 1000, window=5, steps=20 * MIN_SAMPLES, prefixes=2 * MIN_SAMPLES)
    watched, decisions = len(c._watch), dict(c.decisions)
    assert c.known_class(ns.add(ino + 1, 2)) == "short"
    ns.xattrs[(4, LIFETIME_XATTR)] = b"long"
    assert c.known_class(10) == "long"
    assert len(c._watch) == watched and c.decisions == decisions


def test_one_user_stream_does_not_classify():
    ns, clock, c = _classifier(streams=2)
    f = ns.add(10, 2)
    ns.xattrs[(2, LIFETIME_XATTR)] = b"long"
    assert c.stream_of(f) == 0
    assert c.decisions == {"hint": 0, "learned": 0, "default": 0}


def test_unlinked_file_without_names_gets_the_default():
    ns, clock, c = _classifier()
    assert c.classify(12345) == "medium"


# -- through a mount -----------------------------------------------------------------------


def _segments_of(m, rel: str) -> set[int]:
    return {c["segment"] for c in m.where(rel) if c["segment"]}


def _stream_of_segments(m) -> dict[int, int]:
    return {seg: stream for seg, stream, _, _ in m.status()["gc"]["segments"]}


def _write_synced(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def test_lifetime_xattr_routes_records_to_streams(mount_factory):
    m = mount_factory()
    (m.path / "req").mkdir()
    (m.path / "prefix").mkdir()
    (m.path / "other").mkdir()
    os.setxattr(m.path / "req", LIFETIME_XATTR.decode(), b"short")
    os.setxattr(m.path / "prefix", LIFETIME_XATTR.decode(), b"long")
    for i in range(4):
        _write_synced(m.path / "req" / f"r{i}", os.urandom(200 << 10))
        _write_synced(m.path / "prefix" / f"p{i}", os.urandom(200 << 10))
        _write_synced(m.path / "other" / f"o{i}", os.urandom(100 << 10))
    os.setxattr(m.path / "other" / "o0", LIFETIME_XATTR.decode(), b"long")  # too late for o0
    _write_synced(m.path / "other" / "late", os.urandom(10))
    os.setxattr(m.path / "other" / "late", LIFETIME_XATTR.decode(), b"long")
    with open(m.path / "other" / "late", "r+b") as f:  # rewritten: now it is "long"
        f.write(os.urandom(10))
        f.flush()
        os.fsync(f.fileno())
    streams = _stream_of_segments(m)
    st = m.status()
    names = list(st["streams"])
    assert names == ["short", "gc", "long", "medium"]

    def stream_names(rel):
        return {names[streams[s]] for s in _segments_of(m, rel)}

    for i in range(4):
        assert stream_names(f"req/r{i}") == {"short"}
        assert stream_names(f"prefix/p{i}") == {"long"}
        assert stream_names(f"other/o{i}") == {"medium"}
    assert stream_names("other/late") == {"long"}
    assert st["streams"]["short"]["hint_accepted"] is True
    assert st["streams"]["short"]["write_hint"] == "SHORT"
    assert st["gc"]["write_hints"]["kernel_accepted"] is True
    assert st["placement"]["decisions"]["hint"] > 0
    # and the segment files on disk carry the stream in their header
    for seg, stream in streams.items():
        raw = (m.nvme_dir / "segments" / f"seg-{seg:08d}.kvs").read_bytes()[:8]
        assert raw[6] == stream


def test_single_stream_mount_puts_everything_in_one_log(mount_factory):
    m = mount_factory(streams=1, nvme_size="16M", segment_size="1M", dram_size="2M")
    d = m.path / "prefix"
    d.mkdir()
    os.setxattr(d, LIFETIME_XATTR.decode(), b"long")
    for i in range(60):  # ~15 MiB through a 16 MiB tier: the cleaner must run
        (d / f"p{i % 12}").write_bytes(os.urandom(256 << 10))
    st = m.status()
    assert list(st["streams"]) == ["all"]
    assert {stream for _, stream, _, _ in st["gc"]["segments"]} <= {0}
    assert st["streams"]["all"]["write_hint"] == "NOT_SET"


def test_streams_option_is_checked(mount_factory):
    m = mount_factory(start=False, streams=9)
    with pytest.raises(RuntimeError, match="streams must be between 1 and 5"):
        m.start()


def test_learned_streams_through_a_mount(mount_factory):
    """No hints: files in a directory whose files die young go to the short stream, files in
    one whose files stay go to the long stream."""
    m = mount_factory(nvme_size="16M", segment_size="1M", dram_size="1M", chunk_size="64K")
    (m.path / "req").mkdir()
    (m.path / "keep").mkdir()
    # horizon = 1/4 of the 16 MiB tier = 4 MiB of user records
    for i in range(120):
        _write_synced(m.path / "req" / f"r{i}", os.urandom(64 << 10))
        if i >= 2:
            os.unlink(m.path / "req" / f"r{i - 2}")
        if i % 8 == 0:
            _write_synced(m.path / "keep" / f"k{i}", os.urandom(64 << 10))
    st = m.status()
    assert st["placement"]["directories"].get("short", 0) >= 1, st["placement"]
    assert st["placement"]["directories"].get("long", 0) >= 1, st["placement"]
    names = list(st["streams"])
    _write_synced(m.path / "req" / "new", os.urandom(64 << 10))
    _write_synced(m.path / "keep" / "new", os.urandom(64 << 10))
    streams = _stream_of_segments(m)
    assert {names[streams[s]] for s in _segments_of(m, "req/new")} == {"short"}
    assert {names[streams[s]] for s in _segments_of(m, "keep/new")} == {"long"}


def test_kvfsctl_shows_streams(kv):
    (kv.path / "f").write_bytes(os.urandom(64 << 10))
    os.sync()
    r = subprocess.run([sys.executable, "-m", "kvfs.cli.ctl", "status", str(kv.path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "stream" in r.stdout and "short" in r.stdout and "write-life hints" in r.stdout
    r = subprocess.run([sys.executable, "-m", "kvfs.cli.ctl", "status", str(kv.path),
                        "--json"], capture_output=True, text=True)
    st = json.loads(r.stdout)
    assert {"gc", "streams"} <= set(st)
    for key in ("user_bytes_written", "gc_bytes_written", "write_amplification"):
        assert key in st["gc"]
