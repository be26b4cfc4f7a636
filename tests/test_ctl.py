"""kvfsctl against a real mount: `where` over files and directories, a path outside kvfs and
a mount whose daemon is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

KVFSCTL = [sys.executable, "-m", "kvfs.cli.ctl"]
CHUNK = 64 << 10  # conftest.SMALL


def ctl(*args, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(KVFSCTL + [str(a) for a in args], capture_output=True, text=True,
                       timeout=120)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def _tree(root) -> dict[str, int]:
    """d/a (3 chunks and a bit), d/sub/b (2), c (1 byte), a link in d; their chunk counts."""
    (root / "d" / "sub").mkdir(parents=True)
    (root / "d" / "a").write_bytes(os.urandom(3 * CHUNK + 5))
    (root / "d" / "sub" / "b").write_bytes(os.urandom(2 * CHUNK))
    (root / "c").write_bytes(b"c")
    (root / "d" / "link").symlink_to(root / "c")
    return {"d/a": 4, "d/sub/b": 2, "c": 1}


def test_where_files_and_directories(kv):
    chunks = _tree(kv.path)
    out = json.loads(ctl("where", "--json", kv.path / "d").stdout)
    assert [f["path"] for f in out["files"]] == [str(kv.path / "d" / "a")]  # no -r: one level
    out = json.loads(ctl("where", "-r", "--json", kv.path / "d", kv.path / "c").stdout)
    assert [f["path"] for f in out["files"]] == [str(kv.path / n) for n in ("d/a", "d/sub/b", "c")]
    for f, n in zip(out["files"], ("d/a", "d/sub/b", "c"), strict=True):
        assert f["summary"]["chunks"] == chunks[n] == len(f["chunks"])
        assert f["summary"]["dram"] == f["summary"]["dirty"] == chunks[n]  # not written back
        assert f["summary"]["nvme"] == 0
    assert out["total"] == {"chunks": 7, "dram": 7, "nvme": 0, "both": 0, "dirty": 7,
                            "lost": 0, "pod": 0, "files": 3,
                            "size": 3 * CHUNK + 5 + 2 * CHUNK + 1}
    text = ctl("where", "-r", kv.path).stdout.splitlines()
    assert text[-1] == ("total: 3 files, 320.0 KiB, 7 chunks: 7 in DRAM, 0 on NVMe "
                        "(0 in both), 7 dirty, 0 lost")
    assert [line.split()[-1] for line in text[1:-1]] == [
        str(kv.path / n) for n in ("c", "d/a", "d/sub/b")]

    # Written back at unmount and DRAM gone: every chunk on NVMe only.
    kv.unmount()
    kv.lose_dram()
    kv.start()
    out = json.loads(ctl("where", "-r", "--json", kv.path).stdout)
    assert out["total"] | {"size": 0} == {"chunks": 7, "dram": 0, "nvme": 7, "both": 0,
                                          "dirty": 0, "lost": 0, "pod": 0, "files": 3,
                                          "size": 0}
    # One file: its chunks, as before, and its summary.
    one = json.loads(ctl("where", "--json", kv.path / "d" / "a").stdout)
    assert [c["tiers"] for c in one["chunks"]] == [["nvme"]] * 4
    assert one["summary"]["nvme"] == 4
    assert "chunk        3: nvme" in ctl("where", kv.path / "d" / "a").stdout


def test_where_outside_kvfs_is_one_clear_error(kv, tmp_path):
    (kv.path / "f").write_bytes(b"f")
    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "x").write_bytes(b"x")
    for args in ([outside], [kv.path / "f", outside / "x"], ["-r", outside]):
        r = ctl("where", *args, check=False)
        assert r.returncode == 2
        assert r.stdout == ""
        assert r.stderr.splitlines() == [f"kvfsctl: {args[-1]} is not on a kvfs mount"]
    r = ctl("where", kv.path / "missing", check=False)
    assert (r.returncode, r.stderr) == (2, f"kvfsctl: {kv.path / 'missing'}: "
                                           "No such file or directory\n")


def test_ctl_on_a_dead_mount_says_so(kv):
    (kv.path / "f").write_bytes(b"f")
    pid = kv.pid()
    os.kill(pid, signal.SIGKILL)
    for args in (["where", kv.path / "f"], ["status", kv.path]):
        for _ in range(100):  # (until the kernel has seen the daemon go)
            r = ctl(*args, check=False)
            if r.returncode:
                break
        assert r.returncode == 2, r.stderr
        assert "the daemon of this kvfs mount is gone" in r.stderr
        assert "Traceback" not in r.stderr


def _frames(text: str) -> list[list[str]]:
    frames: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("kvfs "):
            frames.append([])
        frames[-1].append(line)
    return frames


def test_top_shows_rates_count_times(kv):
    data = os.urandom(1 << 20)
    (kv.path / "f").write_bytes(data)
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            with open(kv.path / "f", "rb") as f:
                assert f.read() == data

    t = threading.Thread(target=reader)
    t.start()
    try:
        r = ctl("top", kv.path, "--interval", "0.3", "--count", "3")
    finally:
        stop.set()
        t.join()
    frames = _frames(r.stdout)
    assert len(frames) == 3
    rates = []
    for frame in frames:
        tiers = {line.split()[0]: line.split() for line in frame[2:4]}
        assert set(tiers) == {"dram", "nvme"}
        rates.append(float(tiers["dram"][7]))  # reads/s (used and capacity are "N unit")
        assert frame[4].startswith("DRAM hit rate (chunks read from DRAM / from DRAM or NVMe)")
        assert frame[5].startswith("prefetch: ") and frame[6].startswith("gc: ")
    assert sum(rates) > 0  # the reader ran all along


def test_top_stops_when_the_daemon_dies(kv):
    p = subprocess.Popen(KVFSCTL + ["top", str(kv.path), "--interval", "0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().startswith(f"kvfs {kv.path} ")  # it runs
        os.kill(kv.pid(), signal.SIGKILL)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 2
    assert err.splitlines() == [f"kvfsctl: {kv.path}: the daemon of this kvfs mount is gone "
                                "(a crash?): clear it with `kvfs umount MOUNTPOINT`, then "
                                "mount again"]


def test_read_counters_count_chunks_and_requests(mount_factory):
    """Many READs through one chunk read it once (issue 38: sha256sum's 32 KiB reads of 48
    NVMe chunks counted 1,536); the READs are counted under requests_from_*."""
    m = mount_factory(chunk_size="1M", segment_size="4M", passthrough=0, prefetch=0)
    data = os.urandom(2 << 20)  # two chunks
    (m.path / "f").write_bytes(data)
    m.unmount()
    m.lose_dram()
    m.start()
    before = m.status()["reads"]
    with open(m.path / "f", "rb") as f:
        while f.read(32 << 10):  # the kernel asks in READs of up to its readahead window
            pass
    after = m.status()["reads"]
    delta = {k: after[k] - before[k] for k in after if isinstance(after[k], int)}
    assert delta["chunks_from_nvme"] == 2  # the first READ of each chunk fetched it
    assert delta["chunks_from_dram"] == 0  # ... and the rest of its READs found it staged
    requests = delta["requests_from_nvme"] + delta["requests_from_dram"]
    assert requests > 2
    assert delta["requests_from_nvme"] == 2
    assert sum(after["nvme_latency_us_log2_histogram"]) == after["requests_from_nvme"]
    text = ctl("status", m.path).stdout
    assert "(DRAM hit rate 0.0% of chunks read)" in text
    assert (f"READ requests served by the daemon, per chunk they touched: "
            f"{after['requests_from_dram']} from DRAM, 2 from NVMe") in text
