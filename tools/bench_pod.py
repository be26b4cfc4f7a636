"""The pod tier's transfer cost: Mooncake's own put_from/get_into of a file's bytes against
Pod.publish/lookup+fetch of the same file (its records, checked and decoded), side by side in
one run, one master and two members on loopback in this process.

    python tools/bench_pod.py [--sizes 4M,32M] [--reps 5]

Needs the `pod` extra. Throughput is of the file's bytes; the Pod's objects are its encoded
records (smaller for KV data), and its fetch includes their decode and checksums.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import socket
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import trio

from kvfs.config import format_size, parse_size
from kvfs.store.pod import Pod, records_of

CHUNK = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_bytes(n: int) -> bytes:
    return np.random.default_rng(0).normal(0, 1, n // 2).astype(np.float16).tobytes()


def start_master() -> tuple[subprocess.Popen, str]:
    import mooncake

    port = free_port()
    proc = subprocess.Popen([str(Path(mooncake.__file__).with_name("mooncake_master")),
                             "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                             "--metrics_host=127.0.0.1", f"--metrics_port={free_port()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("mooncake_master did not start")


def raw_mooncake(master: str, sizes: list[int], reps: int, segment: int) -> dict:
    """put_from on one client, get_into on another: MiB/s per size (median of reps)."""
    from mooncake.store import MooncakeDistributedStore

    clients, bufs = [], []
    for _ in range(2):
        c = MooncakeDistributedStore()
        assert c.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master) == 0
        mem = mmap.mmap(-1, max(sizes))
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        assert c.register_buffer(addr, max(sizes)) == 0
        clients.append(c)
        bufs.append((mem, addr))
    out = {}
    for size in sizes:
        bufs[0][0][:size] = kv_bytes(size)
        puts, gets = [], []
        for r in range(reps):
            key = f"bench/{size}/{r}"
            t0 = time.perf_counter()
            assert clients[0].put_from(key, bufs[0][1], size) == 0
            t1 = time.perf_counter()
            assert clients[1].get_into(key, bufs[1][1], size) == size
            t2 = time.perf_counter()
            puts.append(t1 - t0)
            gets.append(t2 - t1)
            clients[0].remove(key, True)
        out[size] = (size / statistics.median(puts), size / statistics.median(gets))
    for c in clients:
        c.close()
    return out


async def pod_members(master: str, sizes: list[int], reps: int, segment: int) -> dict:
    a = Pod(master, "bench", "a", segment, max_object=max(sizes) + (1 << 20))
    b = Pod(master, "bench", "b", segment, max_object=max(sizes) + (1 << 20))
    out = {}
    async with trio.open_nursery() as nursery:
        for pod in (a, b):
            await nursery.start(pod.run)
        while not (a.connected and b.connected):
            await trio.sleep(0.01)
        for size in sizes:
            data = kv_bytes(size)
            records = records_of(data, CHUNK, a.codec, "fp16")
            stored = sum(len(r) for _, r in records)
            pubs, fetches = [], []
            for r in range(reps):
                path = f"bench/{size}/{r}.bin"
                done = a.counters.published_files
                t0 = time.perf_counter()
                assert a.publish(path, records, version=1, mode=0o100644, size=size,
                                 mtime_ns=0, chunk_size=CHUNK)
                while a.counters.published_files == done:
                    await trio.sleep(0.0005)
                t1 = time.perf_counter()
                head = await b.lookup(path)
                assert head is not None, "lookup missed"
                async with b.fetched(head) as got:
                    t2 = time.perf_counter()
                    assert got is not None and got.data() == data, "fetch missed"
                pubs.append(t1 - t0)
                fetches.append(t2 - t1)
            out[size] = (size / statistics.median(pubs), size / statistics.median(fetches),
                         stored)
        nursery.cancel_scope.cancel()
    for pod in (a, b):
        await pod.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4M,32M")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    # Room for every rep's objects (the Pod's are not removed) in either member.
    segment = 2 * args.reps * sum(sizes) + (64 << 20)
    proc, master = start_master()
    try:
        raw = raw_mooncake(master, sizes, args.reps, segment)
        pod = trio.run(pod_members, master, sizes, args.reps, segment)
    finally:
        proc.kill()
        proc.wait()
    mib = 1 << 20
    print(f"{'size':>8} {'put MiB/s':>10} {'publish':>9} {'ratio':>6} {'get_into':>9} "
          f"{'fetch':>9} {'ratio':>6}  object")
    for size in sizes:
        put, get = raw[size]
        pub, fetch, stored = pod[size]
        print(f"{format_size(size):>8} {put / mib:10.0f} {pub / mib:9.0f} {pub / put:6.2f} "
              f"{get / mib:9.0f} {fetch / mib:9.0f} {fetch / get:6.2f}  "
              f"{stored / size:.2f} of the file")


if __name__ == "__main__":
    main()
