"""Prefetch through a real mount: write-order chains, the learned read order, hints (xattr,
kvfsctl, kvfs.client), staged chunks surviving a write flood, prediction off, and the
metrics in `kvfsctl status`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from kvfs import client

KVFSCTL = [sys.executable, "-m", "kvfs.cli.ctl"]
CS = 64 << 10  # the fixture's chunk size
IDLE = 1.2  # a little more than kvfs.readahead.IDLE_S: the next access starts a new run


def block(tag: str, i: int, size: int = CS) -> bytes:
    head = f"{tag}{i:06d}".encode()
    return (head * (size // len(head) + 1))[:size]


def write(m, name: str, data: bytes) -> None:
    with open(m.path / name, "wb") as f:
        f.write(data)


def read(m, name: str) -> bytes:
    with open(m.path / name, "rb") as f:
        return f.read()


def on_nvme_only(m, name: str) -> bool:
    return all(c["tiers"] == ["nvme"] for c in m.where(name))


def in_dram(m, name: str) -> bool:
    chunks = m.where(name)
    return bool(chunks) and all("dram" in c["tiers"] for c in chunks)


def lead_in(m, tag: str) -> None:
    """Start a write run with a few files of no interest: kvfs keeps the first files of a run
    in DRAM (nothing predicts them), and the tests want their files to leave DRAM."""
    for i in range(6):
        write(m, f"{tag}-lead-in-{i}", block("L", i))


def push_to_nvme(m, names: list[str], tag: str = "filler") -> None:
    """Write filler until every file in *names* has left DRAM. Files that were read first
    by some reader sit in the protected segment: reading filler (each file by a new caller,
    so nothing predicts it) pushes them out."""
    for round_ in range(40):
        if all(on_nvme_only(m, n) for n in names):
            return
        fill = [f"{tag}-{round_}-{i}" for i in range(32)]
        for i, f in enumerate(fill):
            write(m, f, block("F", i))
        if round_ % 2:
            for f in fill:
                in_thread(read, m, f)
        time.sleep(0.05)
    raise AssertionError("files did not leave DRAM")


def wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def in_thread(fn, *args):
    """Run fn in a fresh thread: kvfs sees a new caller (FUSE reports the thread id)."""
    out = {}

    def run():
        out["value"] = fn(*args)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out.get("value")


def test_write_order_chain_prefetches_before_first_read(kv):
    names = [f"req1-{i:03d}" for i in range(12)]
    lead_in(kv, "req1")
    for i, n in enumerate(names):  # an engine writes a request's blocks in prefix order
        write(kv, n, block("A", i))
    push_to_nvme(kv, names)
    time.sleep(IDLE)
    before = kv.status()["prefetch"]
    assert in_thread(read, kv, names[0]) == block("A", 0)  # read by a new caller
    assert wait_for(lambda: all(in_dram(kv, n) for n in names[1:6]))

    def read_rest():
        return [read(kv, n) for n in names[:8]]

    assert in_thread(read_rest) == [block("A", i) for i in range(8)]
    st = kv.status()["prefetch"]
    assert st["used_chunks"] - before["used_chunks"] >= 5
    assert st["scheduler"]["by_predictor"]["write_order"]["used"] >= 5


def test_learned_order_survives_a_restart(kv):
    """The write order is saved in lmdb: after an unmount and the loss of DRAM (a reboot),
    the first read of a request's first block already stages the blocks that follow it."""
    names = [f"boot-{i:03d}" for i in range(10)]
    lead_in(kv, "boot")
    for i, n in enumerate(names):
        write(kv, n, block("R", i))
    kv.unmount()
    kv.lose_dram()  # everything is on NVMe now, nothing in DRAM
    kv.start()
    assert all(on_nvme_only(kv, n) for n in names)
    assert in_thread(read, kv, names[0]) == block("R", 0)
    assert wait_for(lambda: all(in_dram(kv, n) for n in names[1:6]))
    st = kv.status()["prefetch"]
    assert st["scheduler"]["by_predictor"]["write_order"]["issued"] >= 5
    # A deleted file's edges are gone after the next restart: the chain breaks there.
    (kv.path / names[5]).unlink()
    kv.unmount()
    kv.lose_dram()
    kv.start()
    assert in_thread(read, kv, names[4]) == block("R", 4)
    time.sleep(0.3)
    assert kv.status()["prefetch"]["issued_chunks"] == 0


def test_read_order_is_learned_per_reader(kv):
    b = [f"b-{i:03d}" for i in range(10)]
    c = [f"c-{i:03d}" for i in range(10)]
    lead_in(kv, "bc")
    for i in reversed(range(10)):  # written in the opposite order: write order misleads
        write(kv, b[i], block("B", i))
        write(kv, c[i], block("C", i))
    time.sleep(IDLE)
    # Two readers read their own chain, interleaved step by step.
    barrier = threading.Barrier(2)

    def reader(names, tag):
        for i, n in enumerate(names):
            barrier.wait()
            assert read(kv, n) == block(tag, i)

    ts = [threading.Thread(target=reader, args=(b, "B")),
          threading.Thread(target=reader, args=(c, "C"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    push_to_nvme(kv, b + c)
    time.sleep(IDLE)
    in_thread(read, kv, b[0])
    assert wait_for(lambda: all(in_dram(kv, n) for n in b[1:5]))
    # Nothing crossed over from the other reader. (Only the write order links b-009 to
    # c-009, written right after it, so a chain may end there.)
    assert not any(in_dram(kv, n) for n in c[:8])
    st = kv.status()["prefetch"]
    assert st["scheduler"]["by_predictor"]["successor"]["issued"] >= 4


def test_hints_stage_files_once(kv):
    size = 4 * CS
    lead_in(kv, "h")
    write(kv, "h1", block("H", 1, size))
    write(kv, "h2", block("H", 2, size))
    push_to_nvme(kv, ["h1", "h2"])
    before = kv.status()["prefetch"]["issued_chunks"]
    # Several queued requests want h1: it is staged once.
    assert client.prefetch([kv.path / "h1", kv.path / "h1", kv.path / "missing"]) == 2
    r = subprocess.run(KVFSCTL + ["prefetch", str(kv.path / "h1"), str(kv.path / "h2")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert wait_for(lambda: in_dram(kv, "h1") and in_dram(kv, "h2"))
    time.sleep(0.2)
    st = kv.status()["prefetch"]
    assert st["issued_chunks"] - before == 8
    assert st["hint_repeats"] >= 2
    assert read(kv, "h1") == block("H", 1, size)
    r = subprocess.run(KVFSCTL + ["prefetch", str(kv.path / "nope")], capture_output=True,
                       text=True)
    assert r.returncode == 1 and "nope" in r.stderr


def test_staged_chunks_survive_a_write_flood(kv):
    names = [f"s-{i}" for i in range(6)]
    lead_in(kv, "s")
    for i, n in enumerate(names):
        write(kv, n, block("S", i))
    push_to_nvme(kv, names)
    client.prefetch(kv.path / n for n in names)
    assert wait_for(lambda: all(in_dram(kv, n) for n in names))

    def flood():  # another caller writes twice the DRAM tier
        for i in range(128):
            write(kv, f"flood-{i}", block("W", i))

    in_thread(flood)
    assert all(in_dram(kv, n) for n in names)  # protected until read
    before = kv.status()["reads"]["chunks_from_dram"]
    assert [read(kv, n) for n in names] == [block("S", i) for i in range(6)]
    assert kv.status()["reads"]["chunks_from_dram"] - before == 6


def test_a_prefetched_file_is_ready_for_the_front_thread_when_staged(mount_factory):
    """A file of one chunk that a prefetch stages enters the front thread's table pending;
    the worker that staged and checked its bytes makes it ready, so its first open is
    answered there, even if the daemon's main thread has not seen the prefetch end."""
    m = mount_factory()
    lead_in(m, "p")
    blobs = {f"p{i}": os.urandom(50_000 + i) for i in range(4)}
    for name, blob in blobs.items():
        write(m, name, blob)
    push_to_nvme(m, list(blobs))
    st = m.status()["passthrough"]
    fast, staged = st["fast_opens"], st["fast_open_staged"]
    assert client.prefetch(m.path / name for name in blobs) == 4
    deadline = time.monotonic() + 10
    while m.status()["passthrough"]["fast_open_staged"] < staged + 4:
        assert time.monotonic() < deadline, m.status()["passthrough"]
        time.sleep(0.02)
    for name, blob in blobs.items():
        assert (m.path / name).read_bytes() == blob
    assert m.status()["passthrough"]["fast_opens"] == fast + 4
    assert m.status()["prefetch"]["used_chunks"] >= 4


def test_an_open_during_a_prefetch_waits_for_its_staging_not_for_the_daemon(
        mount_factory, monkeypatch, tmp_path):
    """With NVMe stagings slowed down (-o fetch_delay, a test hook), an open of a
    file whose prefetch is in flight is parked in the front thread and answered when the
    worker has staged the file. A change of the file meanwhile (an O_TRUNC rewrite) hands
    the parked open to the daemon, which answers it around the change: the reader gets one
    whole version, or the new one as far as it is written."""
    slow = tmp_path / "slow"
    # (long enough that the reader's open meets the staging even on a loaded machine)
    m = mount_factory(fetch_delay=f"1.0:{slow}")
    lead_in(m, "k")
    names = ["k0", "k1"]
    for i, name in enumerate(names):
        write(m, name, block("K", i))
    push_to_nvme(m, names)
    slow.touch()

    def parked() -> int:
        return m.status()["passthrough"]["fast_open_parked"]

    def timed_read(name: str, out: dict) -> None:
        t0 = time.monotonic()
        out["data"] = read(m, name)
        out["s"] = time.monotonic() - t0

    before, fast = parked(), m.status()["passthrough"]["fast_opens"]
    client.prefetch([m.path / "k0"])
    time.sleep(0.15)  # the prefetch is under way: k0 is pending
    got: dict = {}
    timed_read("k0", got)
    assert got["data"] == block("K", 0)
    assert got["s"] > 0.1  # it waited for the staging
    assert parked() == before + 1
    assert m.status()["passthrough"]["fast_opens"] == fast + 1
    r = subprocess.run(KVFSCTL + ["status", str(m.path)], capture_output=True, text=True)
    assert f"{before + 1} opens waited there for a prefetch" in r.stdout, r.stdout + r.stderr

    client.prefetch([m.path / "k1"])
    time.sleep(0.15)
    got = {}
    t = threading.Thread(target=timed_read, args=("k1", got))
    t.start()
    deadline = time.monotonic() + 10
    while parked() < before + 2:  # the reader's open is parked
        assert time.monotonic() < deadline
        time.sleep(0.01)
    new = block("N", 1)
    write(m, "k1", new)  # O_TRUNC: revokes k1, handing the parked open to the daemon
    t.join()
    assert parked() == before + 2
    old = block("K", 1)
    assert got["data"] in (old, new) or new.startswith(got["data"]), got["data"][:32]
    assert read(m, "k1") == new
    slow.unlink()
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0, r.stdout + r.stderr


def test_opens_racing_prefetches_and_changes_read_whole_versions(mount_factory):
    """Files on NVMe are hinted and read at once, over and over, while another thread
    rewrites them in place, truncates and refills them, or replaces them; then everything
    goes back to NVMe, and again. Opens meet files entered pending, made ready by a
    worker, revoked mid-fetch. Every read returns the file's own bytes."""
    m = mount_factory(dram_size="8M")
    names = [f"q{i}" for i in range(8)]
    size = 48 << 10

    def version(name: str, n: int) -> bytes:
        return f"{name}:{n:012d};".encode() * (size // 16)

    def whole_records(name: str, got: bytes) -> bool:
        """Records of 16 bytes, each one of *name*'s versions. A read racing a write may
        see part of it, as on any local filesystem: a mix of versions, or a file being
        written after O_TRUNC shorter; never zeros, or another file's bytes."""
        pattern = re.compile(re.escape(name.encode()) + rb":\d{12};")
        return len(got) <= size and all(
            pattern.fullmatch(got, i, i + 16) for i in range(0, len(got), 16)) and \
            len(got) % 16 == 0

    lead_in(m, "q")
    for name in names:
        write(m, name, version(name, 0))
    errors: list[str] = []
    reads = [0]

    def reader(stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                client.prefetch(m.path / name for name in names)
            except OSError:
                pass  # a file replaced between the listing and the hint
            for name in names:
                try:
                    got = (m.path / name).read_bytes()
                except FileNotFoundError:
                    continue
                reads[0] += 1
                if not whole_records(name, got):
                    errors.append(f"{name}: {len(got)} bytes, starts {got[:20]!r}")

    def change(n: int) -> None:
        for i, name in enumerate(names):
            data = version(name, n)
            way = (n + i) % 3
            if way == 0:
                with open(m.path / name, "r+b") as f:  # in place, through the daemon
                    f.write(data)
            elif way == 1:
                with open(m.path / name, "wb") as f:  # O_TRUNC: empty, then whole
                    f.write(data)
            else:
                tmp = m.path / f".{name}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, m.path / name)
            time.sleep(0.003)

    staged = m.status()["passthrough"]["fast_open_staged"]
    for n in range(1, 7):  # rounds: everything to NVMe, then hints, reads and changes race
        push_to_nvme(m, names, tag=f"fill{n}")
        stop = threading.Event()
        readers = [threading.Thread(target=reader, args=(stop,)) for _ in range(2)]
        for t in readers:
            t.start()
        try:
            time.sleep(0.002 * n)
            change(n)
            time.sleep(0.05)
        finally:
            stop.set()
            for t in readers:
                t.join()
    assert not errors, errors[:5]
    assert reads[0] > 100
    st = m.status()
    assert st["passthrough"]["fast_open_staged"] > staged
    m.unmount()
    r = m.fsck()
    assert r.returncode == 0, r.stdout + r.stderr


def test_prediction_off_is_the_plain_policy(mount_factory):
    m = mount_factory(prefetch="off")
    names = [f"p-{i:03d}" for i in range(8)]
    lead_in(m, "p")
    for i, n in enumerate(names):
        write(m, n, block("P", i))
    push_to_nvme(m, names)
    time.sleep(IDLE)
    in_thread(read, m, names[0])
    client.prefetch([m.path / names[5]])
    time.sleep(0.5)
    assert all(on_nvme_only(m, n) for n in names[1:])
    st = m.status()["prefetch"]
    assert st["enabled"] is False and st["issued_chunks"] == 0
    assert st["hints_ignored"] == 1


def test_status_metrics_and_table(kv):
    names = [f"t-{i}" for i in range(6)]
    lead_in(kv, "t")
    for i, n in enumerate(names):
        write(kv, n, block("T", i))
    push_to_nvme(kv, names)
    time.sleep(IDLE)
    in_thread(lambda: [read(kv, n) for n in names])
    st = kv.status()
    for k in ("issued_chunks", "used_chunks", "late_chunks", "wasted_chunks"):
        assert isinstance(st["prefetch"][k], int)
    for k in ("latency_us_log2_histogram", "dram_latency_us_log2_histogram",
              "nvme_latency_us_log2_histogram"):
        assert len(st["reads"][k]) == 24
    # the histogram times the reads the daemon served, once per chunk each took bytes of;
    # passthrough reads never reach it (an open that staged its file from NVMe times those
    # chunks as NVMe reads)
    pt = st["passthrough"]
    assert (sum(st["reads"]["dram_latency_us_log2_histogram"])
            == st["reads"]["requests_from_dram"])
    assert (sum(st["reads"]["nvme_latency_us_log2_histogram"])
            == st["reads"]["requests_from_nvme"] + pt["staged_chunks"])
    assert st["prefetch"]["scheduler"]["max_in_flight"] <= st["prefetch"]["scheduler"][
        "concurrency"]
    r = subprocess.run(KVFSCTL + ["status", str(kv.path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "DRAM hit rate" in r.stdout and "accuracy" in r.stdout
    assert "read latency" in r.stdout


def _abort_connection(dev: int) -> None:
    """Unblock the callers of a mount whose daemon hangs (this test's own mount)."""
    with open(f"/sys/fs/fuse/connections/{os.minor(dev)}/abort", "w") as f:
        f.write("1")


def test_whole_file_steps_of_a_huge_sparse_file_skip_its_holes(kv):
    """A file the kernel reads from DRAM counts as read whole at its open, and a hinted file
    is wanted whole: for a sparse file of a TiB, stepping through every chunk of its size
    kept the daemon busy for hours, every request waiting. Its chunks are the steps."""
    p = kv.path / "sparse"
    size = 1 << 40
    with open(p, "wb") as f:
        f.write(b"head")
        f.seek(5 * CS)
        f.write(b"mid")
        f.truncate(size)
    dev = os.stat(kv.path).st_dev
    out = {}

    def reader():
        with open(p, "rb") as f:
            out["head"] = f.read(4)
            f.seek(size - 4)
            out["tail"] = f.read(4)
        client.prefetch([p])
        out["closed"] = True

    t = threading.Thread(target=reader)
    t.start()
    t.join(60)  # (0.1 s normally; a hang guard, not a speed goal)
    if t.is_alive():
        _abort_connection(dev)
        t.join()
    assert out == {"head": b"head", "tail": bytes(4), "closed": True}
