"""Rounds of LMCache's local-disk backend (`LocalDiskBackend`) on a KV directory.

Runs in the LMCache virtual environment (tools/engines/lmcache.sh makes it). LMCache's GPU
connectors need its CUDA ops (lmcache.cuda_ops), so the KV comes from a tiny random-weights
Llama in transformers (hf_kv.py) and LMCache's own storage layer does the rest: its
ChunkedTokenDatabase keys the prompt's 256-token chunks (prefix hashes), a LocalCPUBackend
allocates the chunks' memory objects (KV_2LTD: [2, layers, tokens, kv_heads * head_dim])
and the LocalDiskBackend configured as by

    LMCACHE_LOCAL_DISK=file://KV_DIR/ LMCACHE_MAX_LOCAL_DISK_SIZE=<GiB> LMCACHE_LOCAL_CPU=False

writes one file per chunk (`<model>@<world>@<worker>@<hash>@<dtype>.pt`) with its 4 I/O
threads and reads them back with get_blocking.

LMCache keeps its disk index (which chunks are on disk) only in the serving process: a new
process starts with an empty one. So one process serves every round (--persistent: a round
number per line on stdin, one JSON result per line on stdout), and kvfs is remounted under
it, as it would be under a running vLLM + LMCache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_kv  # noqa: E402

CHUNK = 256
MODEL_NAME = "kvfs-tiny-random"


class Store:
    def __init__(self, kv_dir: str, odirect: bool) -> None:
        from lmcache.v1.config import load_engine_config_with_overrides
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
        from lmcache.v1.token_database import ChunkedTokenDatabase

        self.config = load_engine_config_with_overrides(overrides={
            "chunk_size": CHUNK, "local_cpu": False, "max_local_cpu_size": 1.0,
            "local_disk": f"file://{kv_dir}/", "max_local_disk_size": 8.0,
            "save_unfull_chunk": False,
            # LMCACHE_EXTRA_CONFIG='{"use_odirect": true}': O_DIRECT for block-sized files
            "extra_config": {"use_odirect": odirect}})
        layers, heads, dim = hf_kv.LAYERS, hf_kv.KV_HEADS, hf_kv.HEAD_DIM
        self.metadata = LMCacheMetadata(
            model_name=MODEL_NAME, world_size=1, local_world_size=1, worker_id=0,
            local_worker_id=0, kv_dtype=torch.float32,
            kv_shape=(layers, 2, CHUNK, heads, dim))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.disk = LocalDiskBackend(self.config, self.loop, self.cpu, dst_device="cpu",
                                     metadata=self.metadata)
        self.db = ChunkedTokenDatabase(self.config, self.metadata)

    def keys(self, tokens: list[int]) -> list:
        return [key for _start, _end, key in self.db.process_tokens(tokens)]

    def put(self, keys: list, kv: torch.Tensor) -> None:
        """Store *kv* ([2, layers, heads, len, dim]) chunk by chunk; wait until on disk."""
        from lmcache.v1.memory_management import MemoryFormat

        ltd = kv.permute(0, 1, 3, 2, 4).flatten(3)  # [2, layers, tokens, heads * dim]
        done = threading.Semaphore(0)
        for i, key in enumerate(keys):
            chunk = ltd[:, :, i * CHUNK:(i + 1) * CHUNK]
            obj = self.cpu.allocate(chunk.shape, chunk.dtype, MemoryFormat.KV_2LTD)
            if obj is None:
                raise SystemExit("LocalCPUBackend.allocate failed")
            obj.tensor.copy_(chunk)
            self.disk.submit_put_task(key, obj, on_complete_callback=lambda _k: done.release())
            obj.ref_count_down()
        for _ in keys:
            if not done.acquire(timeout=600):
                raise SystemExit("LMCache did not finish its disk writes within 600 s")

    def get(self, keys: list) -> torch.Tensor:
        objs = self.disk.batched_get_blocking(keys)
        if any(o is None for o in objs):
            raise SystemExit(f"get_blocking: {sum(o is None for o in objs)} chunks missing")
        ltd = torch.cat([o.tensor.clone() for o in objs], dim=2)
        for o in objs:
            o.ref_count_down()
        layers, heads, dim = hf_kv.LAYERS, hf_kv.KV_HEADS, hf_kv.HEAD_DIM
        return ltd.view(2, layers, -1, heads, dim).permute(0, 1, 3, 2, 4).contiguous()


def one_round(store: Store, model, args: argparse.Namespace) -> dict:
    tokens, found = [], []
    io = 0.0
    t0 = time.perf_counter()
    for prompt in hf_kv.prompts(args.prompts, args.prompt_len, model.config.vocab_size):
        cached_len = (len(prompt) - 1) // CHUNK * CHUNK
        keys = store.keys(prompt[:cached_len])
        t_io = time.perf_counter()
        present = next((i for i, k in enumerate(keys) if not store.disk.contains(k)),
                       len(keys))
        found.append(present)
        if present == len(keys):
            kv = store.get(keys)
            io += time.perf_counter() - t_io
        else:
            io += time.perf_counter() - t_io
            kv = hf_kv.prefill(model, prompt[:cached_len])
            t_io = time.perf_counter()
            store.put(keys, kv)
            io += time.perf_counter() - t_io
        tokens.append(hf_kv.continue_greedy(model, kv, prompt[cached_len:], args.max_tokens))
    want = (args.prompt_len - 1) // CHUNK
    return {"tokens": tokens, "seconds": round(time.perf_counter() - t0, 3),
            "io_seconds": round(io, 3),
            "hit": all(f == want for f in found),
            "evidence": f"LocalDiskBackend.contains: {found} of {want} chunks per prompt"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--kv-dir")
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--odirect", action="store_true",
                   help="LMCache's use_odirect: O_DIRECT writes and reads of its chunk files")
    p.add_argument("--build-model", action="store_true")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    if args.build_model:
        hf_kv.build_model(args.model_dir)
        return
    if not args.persistent:
        raise SystemExit("lmcache_round.py runs with --persistent (see its docstring)")
    # Results go to the harness on the original stdout; LMCache's log lines go to stderr.
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    model = hf_kv.load_model(args.model_dir)
    store = Store(args.kv_dir, args.odirect)
    for line in sys.stdin:
        args.round = int(line)
        results.write(json.dumps(one_round(store, model, args)) + "\n")
        results.flush()
    store.disk.close()


if __name__ == "__main__":
    main()
