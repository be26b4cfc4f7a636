"""One pod member in a process of its own, driven by tests/store/test_pod.py.

    python tests/store/pod_member.py MASTER NAME MEMBER

reads one JSON command per line on stdin and answers one JSON line on stdout:
  {"op": "publish", "path": P, "src": FILE, "version": N, "damage": false, "wait": true}
      publish FILE's bytes as P (records made as the store makes them; "damage": flip a
      payload byte of the last record after it was sealed); answers once the publisher has
      handled it (at once without "wait"): {"queued": bool, "status": {...}}
  {"op": "read", "path": P, "dst": FILE}
      lookup then fetch; writes the bytes to FILE on a hit: {"hit": bool, "seconds": s}
  {"op": "status"}    {"status": {...}}
Mooncake logs to stderr.
"""

from __future__ import annotations

import json
import sys
import time

import trio

from kvfs.store.pod import Pod, records_of

CHUNK = 64 << 10


async def main(master: str, name: str, member: str) -> None:
    pod = Pod(master, name, member, 32 << 20, timeout=0.05, miss_ttl=0.2, hit_ttl=0.2)
    stdin = trio.wrap_file(sys.stdin)
    async with trio.open_nursery() as nursery:
        await nursery.start(pod.run)
        while not pod.connected:
            await trio.sleep(0.05)
        print(json.dumps({"ready": True}), flush=True)
        async for line in stdin:
            cmd = json.loads(line)
            answer = await handle(pod, cmd)
            print(json.dumps(answer), flush=True)
        nursery.cancel_scope.cancel()
    await pod.close()


async def handle(pod: Pod, cmd: dict) -> dict:
    if cmd["op"] == "publish":
        with open(cmd["src"], "rb") as f:
            data = f.read()
        records = records_of(data, CHUNK, pod.codec, "fp16")
        if cmd.get("damage"):
            c, rec = records[-1]
            records[-1] = (c, rec[:-1] + bytes([rec[-1] ^ 0x40]))
        def handled() -> int:
            # (dropped: not tried while the pod is away)
            return pod.counters.published_files + pod.counters.errors + pod.counters.dropped

        before = handled()
        queued = pod.publish(cmd["path"], records, version=cmd["version"], mode=0o100644,
                             size=len(data), mtime_ns=time.time_ns(), chunk_size=CHUNK)
        while queued and cmd.get("wait", True) and handled() == before:
            await trio.sleep(0.01)
        return {"queued": queued, "status": pod.status()}
    if cmd["op"] == "read":
        t0 = time.monotonic()
        head = await pod.lookup(cmd["path"])
        if head is None:
            return {"hit": False, "seconds": time.monotonic() - t0}
        async with pod.fetched(head) as got:
            seconds = time.monotonic() - t0
            if got is not None:
                with open(cmd["dst"], "wb") as f:
                    f.write(got.data())
        return {"hit": got is not None, "seconds": seconds}
    if cmd["op"] == "status":
        return {"status": pod.status()}
    raise ValueError(f"unknown op {cmd['op']!r}")


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:4])
