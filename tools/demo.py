#!/usr/bin/env python3
"""Mount kvfs with its embedded defaults (if it is not mounted yet) and show it working:
write a few KV-cache block files, read them back byte for byte, and print where their
chunks live. Leaves the mount up; `kvfs umount MOUNTPOINT` takes it down.

    python tools/demo.py [/mnt/kv]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "kv"


def kv_blocks(n: int, size: int) -> list[bytes]:
    """Real KV-cache bytes if the shared data is here, else a stand-in with fp16 structure."""
    try:
        import numpy as np

        arr = np.load(DATA / "smollm2_kv_bf16.npy", mmap_mode="r")
        raw = arr.reshape(-1).view(np.uint8)
        return [bytes(raw[i * size:(i + 1) * size]) for i in range(n)]
    except (OSError, ValueError):
        import numpy as np

        rng = np.random.default_rng(0)
        return [rng.standard_normal(size // 2).astype(np.float16).tobytes() for _ in range(n)]


def main() -> int:
    mnt = Path(sys.argv[1] if len(sys.argv) > 1 else "/mnt/kv")
    mnt.mkdir(parents=True, exist_ok=True)
    if not os.path.ismount(mnt):
        print(f"$ kvfs mount {mnt}")
        r = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(mnt)])
        if r.returncode:
            return r.returncode
    sizes = [(256 << 10), (4 << 20), (2 << 20) + 12345]
    blocks = [b for size in sizes for b in kv_blocks(1, size)]
    names = [f"llama@1@0@{i:016x}@bf16.pt" for i in range(len(blocks))]
    demo = mnt / "kvfs-demo"
    demo.mkdir(exist_ok=True)
    for name, data in zip(names, blocks, strict=True):
        (demo / name).write_bytes(data)
    for name, data in zip(names, blocks, strict=True):
        assert (demo / name).read_bytes() == data, f"{name}: bytes differ"
    print(f"wrote and read back {len(blocks)} KV block files in {demo}: bytes identical")
    for name in names:
        print(f"\n$ kvfsctl where {demo / name}")
        subprocess.run([sys.executable, "-m", "kvfs.cli.ctl", "where", str(demo / name)])
    print(f"\n$ kvfsctl status {mnt}")
    subprocess.run([sys.executable, "-m", "kvfs.cli.ctl", "status", str(mnt)])
    st = json.loads(os.getxattr(mnt, "user.kvfs.status"))
    print(f"\nkvfs is mounted on {mnt}: DRAM tier in {st['settings']['dram_dir']}, NVMe tier in "
          f"{st['settings']['nvme_dir']}. Unmount with: kvfs umount {mnt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
