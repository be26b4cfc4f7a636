"""kvfsctl against a real mount: `where` over files and directories, a path outside kvfs and
a mount whose daemon is gone."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvfs.cli.ctl import main as ctl_main
from kvfs.store.nvme import BLOCK, HEADER_SIZE, RecordError, unpack_header

KVFSCTL = [sys.executable, "-m", "kvfs.cli.ctl"]
CHUNK = 64 << 10  # conftest.SMALL


ROOT = Path(__file__).resolve().parent.parent


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
    for args in (["where", kv.path / "f"], ["status", kv.path], ["pin", kv.path / "f"],
                 ["demote", "-r", kv.path], ["scrub", kv.path],
                 ["trace", "start", "/tmp/kvfs-trace-of-the-dead", kv.path],
                 ["trace", "stop", kv.path], ["config", "list", kv.path],
                 ["config", "get", "dram_high_watermark", kv.path],
                 ["config", "set", "dram_high_watermark", "0.8", kv.path]):
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


def _wait(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def _pinned(path) -> bool:
    try:
        return os.getxattr(path, "user.kvfs.pin") == b"1"
    except OSError as exc:
        assert exc.errno == errno.ENODATA
        return False


def test_pin_keeps_a_file_in_dram_across_demotion_and_remounts(kv):
    """A pinned file is staged from NVMe, stays in DRAM while other writes push everything
    else out, refuses demotion, is pinned (and staged) again after a remount that lost
    DRAM; unpinned, it demotes. A pin past the tier's share is ENOSPC and pins nothing."""
    hot = os.urandom(16 * CHUNK)  # 1 MiB of the 4 MiB tier (pins may hold 2 MiB)
    (kv.path / "hot").write_bytes(hot)
    (kv.path / "big").write_bytes(os.urandom(40 * CHUNK))
    kv.unmount()
    kv.lose_dram()
    kv.start()
    assert kv.tiers("hot") == {"nvme"}
    ctl("pin", kv.path / "hot")
    assert _pinned(kv.path / "hot") and not _pinned(kv.path / "big")
    assert all(c["tiers"] == ["dram", "nvme"] for c in kv.where("hot"))
    demoted = kv.status()["moves"]["demotions"]
    for i in range(4):  # 8 MiB through a 4 MiB tier
        (kv.path / f"other{i}").write_bytes(os.urandom(32 * CHUNK))
    _wait(lambda: kv.status()["moves"]["demotions"] >= demoted + 64)  # others went
    assert all("dram" in c["tiers"] for c in kv.where("hot"))
    dram = kv.status()["tiers"]["dram"]
    assert (dram["pinned_files"], dram["pinned_bytes"], dram["pin_limit_bytes"]) == (
        1, 16 * CHUNK, 2 << 20)
    r = ctl("demote", kv.path / "hot", check=False)
    assert r.returncode == 1
    assert r.stderr == (f"kvfsctl: {kv.path / 'hot'}: pinned: `kvfsctl unpin` it first to "
                        f"demote it\n")

    r = ctl("pin", kv.path / "big", check=False)  # 2.5 MiB: more than the 1 MiB left
    assert r.returncode == 1
    assert r.stderr == (f"kvfsctl: {kv.path / 'big'}: does not fit: pinned files may hold "
                        f"2.0 MiB of DRAM, 1.0 MiB is pinned, this file is 2.5 MiB\n")
    assert not _pinned(kv.path / "big")

    kv.unmount()
    kv.lose_dram()
    kv.start()
    assert _pinned(kv.path / "hot")
    _wait(lambda: all("dram" in c["tiers"] for c in kv.where("hot")))  # staged at mount
    assert (kv.path / "hot").read_bytes() == hot

    ctl("unpin", kv.path / "hot")
    ctl("unpin", kv.path / "hot")  # not pinned: nothing to do
    assert not _pinned(kv.path / "hot")
    ctl("demote", kv.path / "hot")
    assert kv.tiers("hot") == {"nvme"}
    assert (kv.path / "hot").read_bytes() == hot

    ctl("pin", kv.path / "hot")
    os.unlink(kv.path / "hot")
    _wait(lambda: kv.status()["tiers"]["dram"]["pinned_files"] == 0)


def test_demote_and_evict_directories(kv):
    """demote and evict -r: dirty chunks written back, every DRAM copy dropped, the bytes
    the same."""
    chunks = _tree(kv.path)
    data = {n: (kv.path / n).read_bytes() for n in chunks}
    assert kv.tiers("d/a") == {"dram"}
    ctl("demote", kv.path / "d")  # one level: d/a
    assert kv.tiers("d/a") == {"nvme"} and kv.tiers("d/sub/b") == {"dram"}
    ctl("evict", "-r", kv.path)
    for n in chunks:
        assert kv.tiers(n) == {"nvme"}, n
    kv.unmount()
    kv.lose_dram()
    kv.start()
    for n, d in data.items():
        assert (kv.path / n).read_bytes() == d


def test_changing_commands_need_root_or_the_mounts_owner(kv):
    """Another user, even one who may write the file, gets EPERM with one clear line; the
    read-only commands work for them."""
    (kv.path / "f").write_bytes(os.urandom(CHUNK))
    os.chown(kv.path / "f", 2000, 2000)
    os.chmod(kv.path, 0o777)

    def as_user(*args) -> subprocess.CompletedProcess:
        """kvfsctl *args* in a child process run as user 2000 in the mount (the Python
        binary may be closed to others: the child calls kvfsctl's main)."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 255
            try:
                os.close(r)
                os.chdir(kv.path)
                os.setgroups([])
                os.setgid(2000)
                os.setuid(2000)
                sys.stdout = open(os.devnull, "w")
                sys.stderr = os.fdopen(w, "w")
                code = ctl_main(list(args))
                sys.stderr.flush()
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r) as f:
            err = f.read()
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        return subprocess.CompletedProcess(args, code, "", err)
    for cmd in ("pin", "unpin", "demote", "evict"):
        r = as_user(cmd, "f")
        assert (r.returncode, r.stderr) == (
            1, f"kvfsctl: f: {cmd} is for root and the user who mounted kvfs only\n"), r.stderr
    r = as_user("scrub", ".")
    assert (r.returncode, r.stderr) == (
        2, "kvfsctl: ./f: scrub is for root and the user who mounted kvfs only\n")
    assert not _pinned(kv.path / "f")
    r = as_user("where", "f")
    assert r.returncode == 0, r.stderr
    os.setxattr(kv.path / "f", "user.kvfs.pin", b"1")  # root may
    assert _pinned(kv.path / "f")
    r = as_user("unpin", "f")
    assert r.returncode == 1 and _pinned(kv.path / "f")
    r = as_user("trace", "start", "/tmp/kvfs-trace-by-2000", ".")
    assert (r.returncode, r.stderr) == (
        2, "kvfsctl: trace is for root and the user who mounted kvfs only\n"), r.stderr
    assert not os.path.exists("/tmp/kvfs-trace-by-2000")
    r = as_user("config", "set", "dram_low_watermark", "0.5", ".")
    assert (r.returncode, r.stderr) == (
        2, "kvfsctl: config set is for root and the user who mounted kvfs only\n"), r.stderr
    assert as_user("config", "get", "dram_low_watermark", ".").returncode == 0
    r = as_user("config", "get", "nvme_dir", ".")  # where the tiers live: not theirs to see
    assert r.returncode == 2 and "no such setting" in r.stderr, r.stderr
    assert ctl("config", "get", "dram_low_watermark", kv.path).stdout == "0.75\n"


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _record_offset(m, name: str, c: int) -> tuple[Path, int]:
    """The segment file and offset of the NVMe record chunk *c* of *name* reads from."""
    ino = os.stat(m.path / name).st_ino
    seg = m.where(name)[c]["segment"]
    path = m.nvme_dir / "segments" / f"seg-{seg:08d}.kvs"
    raw = path.read_bytes()
    best = None
    for off in range(BLOCK, len(raw) - HEADER_SIZE + 1, BLOCK):
        try:
            h = unpack_header(raw[off:off + HEADER_SIZE])
        except RecordError:
            continue
        if (h.ino, h.chunk) == (ino, c) and (best is None or h.seq > best[0]):
            best = (h.seq, off)
    assert best is not None
    return path, best[1]


def _scrub(m, *args) -> tuple[int, dict]:
    r = ctl("scrub", m.path, "--json", *args, check=False)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, json.loads(r.stdout)


def _damage_of(out: dict) -> set[tuple[str, int, str, str | None]]:
    return {(os.path.basename(d["path"]), d["chunk"], d["tier"], d["repair"])
            for d in out["damage"]}


def test_scrub_finds_damage_on_every_tier_and_repairs_what_it_can(kv):
    """A flipped payload byte in an NVMe-only record (no good copy: lost after --repair),
    in the record of a chunk with a good DRAM copy (the record dropped, the chunk written
    back again) and in a DRAM copy with a good record (the DRAM copy dropped): scrub finds
    each, --repair leaves only the lost chunk, every other byte reads as written."""
    files = {f"f{i}": os.urandom(2 * CHUNK) for i in range(3)}
    for name, data in files.items():
        (kv.path / name).write_bytes(data)
    kv.unmount()
    kv.lose_dram()
    kv.start()
    assert all(kv.tiers(n) == {"nvme"} for n in files)
    with open(kv.path / "f1", "rb") as f:  # f1, f2: staged, clean copies in both tiers
        f.read()
    with open(kv.path / "f2", "rb") as f:
        f.read()
    _wait(lambda: all(kv.where(n)[0]["tiers"] == ["dram", "nvme"] for n in ("f1", "f2")))
    assert _scrub(kv) == (0, {"files": 3, "checked_copies": 10, "unchecked_copies": 0,
                              "damage": [], "skipped": []})

    for name in ("f0", "f1"):
        path, off = _record_offset(kv, name, 0)
        _flip(path, off + HEADER_SIZE + 1000)
    _flip(kv.dram_dir / "files" / f"{os.stat(kv.path / 'f2').st_ino:x}", CHUNK + 7)
    code, out = _scrub(kv)
    assert code == 1
    assert _damage_of(out) == {("f0", 0, "nvme", None), ("f1", 0, "nvme", None),
                               ("f2", 1, "dram", None)}
    assert all("checksum mismatch" in d["error"] for d in out["damage"])
    text = ctl("scrub", kv.path, check=False).stdout
    assert f"{kv.path / 'f0'}: chunk 0, nvme: " in text
    assert text.splitlines()[-1] == ("scrub: 3 files, 10 copies checked (0 being written, "
                                      "not checked), 3 damaged in 3 files")

    code, out = _scrub(kv, "--repair")
    assert code == 1
    assert _damage_of(out) == {("f0", 0, "nvme", "lost"), ("f1", 0, "nvme", "dropped"),
                               ("f2", 1, "dram", "dropped")}
    code, out = _scrub(kv)
    assert code == 1
    assert _damage_of(out) == {("f0", 0, "none", None)}  # reads give EIO, as before
    fd = os.open(kv.path / "f0", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as ei:
            os.pread(fd, CHUNK, 0)
        assert ei.value.errno == errno.EIO
        assert os.pread(fd, CHUNK, CHUNK) == files["f0"][CHUNK:]
    finally:
        os.close(fd)
    for name in ("f1", "f2"):
        assert (kv.path / name).read_bytes() == files[name]
    kv.unmount()
    kv.lose_dram()
    kv.start()
    for name in ("f1", "f2"):
        assert (kv.path / name).read_bytes() == files[name]
    code, out = _scrub(kv)
    assert _damage_of(out) == {("f0", 0, "none", None)}
    assert "Traceback" not in kv.log()


def test_cache_mode_eviction_spares_pinned_files(mount_factory):
    """A cache-mode mount removes cold whole files when full, but never a pinned one (the
    coldest file here, else the first to go)."""
    m = mount_factory(dram_size="4M", nvme_size="24M", segment_size="1M", cache_mode="1")
    keep = os.urandom(512 << 10)
    (m.path / "f0").write_bytes(keep)
    ctl("pin", m.path / "f0")
    for i in range(1, 100):
        (m.path / f"f{i}").write_bytes(os.urandom(512 << 10))
    assert m.status()["evictions"]["files"] > 0
    assert not (m.path / "f1").exists()
    assert (m.path / "f0").read_bytes() == keep


def test_demote_of_a_file_the_kernel_reads_from_dram_is_busy(kv):
    """An open in passthrough mode reads the file's DRAM copy in the kernel: demote writes
    its chunks back but cannot drop them (EBUSY, one line); after the close it can."""
    data = os.urandom(3 * CHUNK)
    (kv.path / "f").write_bytes(data)
    with open(kv.path / "f", "rb") as f:
        if kv.status()["passthrough"]["open_files"] != 1:
            pytest.skip("no FUSE passthrough on this kernel")
        r = ctl("demote", kv.path / "f", check=False)
        assert (r.returncode, r.stderr) == (
            1, f"kvfsctl: {kv.path / 'f'}: in use: the kernel reads or writes its DRAM copy "
               f"itself (passthrough); try again once it is closed\n")
        assert all(c["tiers"] == ["dram", "nvme"] for c in kv.where("f"))  # written back
        assert f.read() == data
    ctl("demote", kv.path / "f")
    assert kv.tiers("f") == {"nvme"}


def test_trace_records_a_replayable_mooncake_trace(kv, tmp_path):
    """`kvfsctl trace start/stop`: each process's run of opens and creates is one request,
    each file one block; tools/trace_replay.py replays the file."""
    out = tmp_path / "trace.jsonl"
    ctl("trace", "start", str(out), str(kv.path))
    assert ctl("trace", "start", str(out), str(kv.path), check=False).returncode == 2  # busy
    # Two requests, as an engine's workers would make them: the second reuses the first's
    # two blocks (its prefix) and writes a new one.
    script = ("import sys, pathlib; d = pathlib.Path(sys.argv[1]); "
              "[(d / n).read_bytes() for n in sys.argv[2].split(',') if n]; "
              "[(d / n).write_bytes(b'x' * 4096) for n in sys.argv[3].split(',') if n]")
    subprocess.run([sys.executable, "-c", script, str(kv.path), "", "b0,b1"], check=True)
    time.sleep(0.2)  # (longer than a request's pause: the next process's is another)
    subprocess.run([sys.executable, "-c", script, str(kv.path), "b0,b1", "b2"], check=True)
    assert json.loads(os.getxattr(kv.path, "user.kvfs.trace"))["file"] == str(out)
    ctl("trace", "stop", str(kv.path))
    assert ctl("trace", "stop", str(kv.path), check=False).returncode == 2  # none now
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["hash_ids"] for r in rows] == [[0, 1], [0, 1, 2]]
    assert rows[0]["timestamp"] < rows[1]["timestamp"] and rows[1]["input_length"] == 3 * 512
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "trace_replay.py"), "--trace",
                        str(out), "--modes", "tmpfs", "--block-size", "4K",
                        "--work-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 requests" in r.stdout or "requests" in r.stdout, r.stdout


def test_a_trace_file_inside_the_mount_is_refused(kv):
    """The daemon would call into its own mount to write it (and wait for itself); the
    unprivileged case is in test_changing_commands_need_root_or_the_mounts_owner."""
    with pytest.raises(OSError) as exc:
        os.setxattr(kv.path, "user.kvfs.trace.start", os.fsencode(kv.path / "t"))
    assert exc.value.errno == errno.EINVAL
    assert ctl("trace", "start", str(kv.path / "t"), str(kv.path), check=False).returncode == 2


def test_config_shows_settings_and_changes_the_live_ones(kv):
    """`config list/get` show the mount's settings; `set` changes a live one at once (a
    lower high watermark: the demoter takes DRAM down to the low one) until the unmount;
    other settings, bad values and unknown names are refused in one line, nothing changed."""
    listed = ctl("config", "list", kv.path).stdout.splitlines()
    assert [" ".join(line.split()) for line in listed if "may change" in line] == [
        "dram_high_watermark = 0.9 (may change while mounted)",
        "dram_low_watermark = 0.75 (may change while mounted)",
        "prefetch_bandwidth = 0 (may change while mounted)"]
    assert ctl("config", "get", "chunk_size", kv.path).stdout == f"{CHUNK}\n"
    assert ctl("config", "get", "dram_verify", kv.path).stdout == "once\n"
    data = os.urandom(40 * CHUNK)  # 2.5 MiB of the 4 MiB tier: under both watermarks
    (kv.path / "f").write_bytes(data)
    assert kv.status()["tiers"]["dram"]["used_bytes"] >= 40 * CHUNK

    def refused(*args) -> str:
        r = ctl("config", "set", *args, kv.path, check=False)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        return r.stderr
    assert "need 0 < dram_low_watermark < dram_high_watermark <= 1" in refused(
        "dram_high_watermark", "0.5")  # (the low one first)
    assert "not a number" in refused("dram_low_watermark", "half")
    assert refused("chunk_size", "128K") == (
        "kvfsctl: chunk_size: cannot change while mounted (mount again with -o "
        "chunk_size=...); these may: dram_high_watermark, dram_low_watermark, "
        "prefetch_bandwidth\n")
    assert refused("no_such", "1") == "kvfsctl: no_such: no such setting\n"
    for name, value, err in (("chunk_size", b"128K", errno.EPERM),
                             ("no_such", b"1", errno.EINVAL),
                             ("dram_high_watermark", b"1.5", errno.EINVAL),
                             ("dram_high_watermark", b"0.95,debug", errno.EINVAL)):
        with pytest.raises(OSError) as exc:
            os.setxattr(kv.path, f"user.kvfs.config.{name}", value)
        assert exc.value.errno == err, name
    assert ctl("config", "get", "dram_high_watermark", kv.path).stdout == "0.9\n"

    assert ctl("config", "set", "dram_low_watermark", "0.25", kv.path).stdout == (
        "dram_low_watermark = 0.25 until the unmount\n")
    ctl("config", "set", "dram_high_watermark", "0.5", kv.path)
    _wait(lambda: kv.status()["tiers"]["dram"]["used_bytes"] <= (1 << 20))
    ctl("config", "set", "prefetch_bandwidth", "8M", kv.path)
    assert kv.status()["prefetch"]["scheduler"]["bandwidth_bytes_per_s"] == 8 << 20
    assert (kv.path / "f").read_bytes() == data
    kv.unmount()
    kv.start()
    assert ctl("config", "get", "dram_high_watermark", kv.path).stdout == "0.9\n"


def test_a_trace_keeps_its_ended_requests_when_the_daemon_dies(kv, tmp_path):
    """Requests are written as they end, each line whole: a daemon killed while recording
    leaves a file that replays as it is."""
    out = tmp_path / "trace.jsonl"
    ctl("trace", "start", out, kv.path)
    for name in ("a", "b", "a"):  # three processes, a pause after each: three requests
        subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'ab').close()",
                        str(kv.path / name)], check=True)
        time.sleep(0.2)
    os.kill(kv.pid(), signal.SIGKILL)  # (the third request had not ended: it goes)
    assert out.read_text().endswith("\n")
    assert [json.loads(line)["hash_ids"] for line in out.read_text().splitlines()] == [
        [0], [1]]


def test_the_daemon_dying_mid_command_is_one_clear_line(mount_factory, tmp_path):
    """The daemon dies in the middle of a `config set` (its second changing command, while
    a trace records): the command says the daemon is gone, and the trace holds every
    request that had ended."""
    m = mount_factory(crash_at="control.set:2")
    out = tmp_path / "trace.jsonl"
    ctl("trace", "start", out, m.path)
    (m.path / "a").write_bytes(b"a")
    time.sleep(0.2)  # (a pause: the next access ends the request)
    (m.path / "b").write_bytes(b"b")
    r = ctl("config", "set", "dram_low_watermark", "0.5", m.path, check=False)
    assert r.returncode == 2, r.stderr
    assert "the daemon of this kvfs mount is gone" in r.stderr and "Traceback" not in r.stderr
    assert [json.loads(line)["hash_ids"] for line in out.read_text().splitlines()] == [[0]]
