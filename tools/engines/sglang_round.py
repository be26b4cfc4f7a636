"""One round of SGLang's HiCache file storage backend (`HiCacheFile`) on a KV directory.

Runs in the SGLang virtual environment (tools/engines/sglang.sh makes it). SGLang's server
needs its CUDA kernels (or a source build for Intel AMX CPUs), so the KV comes from a tiny
random-weights Llama in transformers (hf_kv.py), and SGLang's own storage layer does the
rest, as its HiCache controller would with

    --enable-hierarchical-cache --hicache-storage-backend file
    SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR=KV_DIR   (or --hicache-storage-backend-extra-config
                                                      '{"file_storage_path": "KV_DIR"}')

Pages of 64 tokens are keyed by SGLang's sha256 chain (get_native_hash, its hash of a page
and the previous page's key) and laid out as its host pool's page_first layout: one
flattened [2, page, layers, kv_heads, head_dim] tensor per page, one file per page
(`<hash>_<model>_<tp_rank>_<tp_size>.bin`). A round asks batch_exists for the prompt's full
pages (the longest prefix present); round 1 finds none, computes the prefix and batch_sets
its pages; later rounds find all of them and batch_get them into page buffers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_kv  # noqa: E402

PAGE = 64
MODEL_NAME = "kvfs-tiny-random"


def to_pages(kv: torch.Tensor) -> list[torch.Tensor]:
    """[2, layers, heads, len, dim] -> flattened page_first pages [2, page, layers, heads, dim]."""
    tokens_first = kv.permute(0, 3, 1, 2, 4)
    return [tokens_first[:, i:i + PAGE].contiguous().flatten()
            for i in range(0, kv.shape[3], PAGE)]


def from_pages(pages: list[torch.Tensor], layers: int, heads: int, dim: int) -> torch.Tensor:
    tokens_first = torch.cat([p.view(2, PAGE, layers, heads, dim) for p in pages], dim=1)
    return tokens_first.permute(0, 2, 3, 1, 4).contiguous()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--kv-dir")
    p.add_argument("--round", type=int)
    p.add_argument("--out", type=Path)
    p.add_argument("--build-model", action="store_true")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args()
    if args.build_model:
        hf_kv.build_model(args.model_dir)
        return
    logging.basicConfig(level=logging.INFO)

    from sglang.srt.mem_cache.cpp_utils.native_hash import get_native_hash
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

    model = hf_kv.load_model(args.model_dir)
    config = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=False,
                                  enable_storage_metrics=False, is_page_first_layout=True,
                                  model_name=MODEL_NAME,
                                  extra_config={"file_storage_path": args.kv_dir})
    storage = HiCacheFile(config)
    layers, heads, dim = hf_kv.LAYERS, hf_kv.KV_HEADS, hf_kv.HEAD_DIM
    page_numel = 2 * PAGE * layers * heads * dim
    tokens, found = [], []
    io = 0.0
    t0 = time.perf_counter()
    for prompt in hf_kv.prompts(args.prompts, args.prompt_len, model.config.vocab_size):
        cached_len = (len(prompt) - 1) // PAGE * PAGE  # the last token is always computed
        keys = get_native_hash(prompt[:cached_len], None, PAGE)
        t_io = time.perf_counter()
        hit_pages = storage.batch_exists(keys)
        found.append(hit_pages)
        if hit_pages == len(keys):
            pages = [torch.empty(page_numel, dtype=torch.float32) for _ in keys]
            got = storage.batch_get(keys, pages)
            io += time.perf_counter() - t_io
            if any(g is None for g in got):
                raise SystemExit(f"batch_get returned {sum(g is None for g in got)} misses")
            kv = from_pages(pages, layers, heads, dim)
        else:
            io += time.perf_counter() - t_io
            kv = hf_kv.prefill(model, prompt[:cached_len])
            pages = to_pages(kv)
            t_io = time.perf_counter()
            if not storage.batch_set(keys, pages):
                raise SystemExit("batch_set failed")
            io += time.perf_counter() - t_io
        tokens.append(hf_kv.continue_greedy(model, kv, prompt[cached_len:], args.max_tokens))
    seconds = time.perf_counter() - t0
    want = (args.prompt_len - 1) // PAGE
    result = {"tokens": tokens, "seconds": round(seconds, 3), "io_seconds": round(io, 3),
              "hit": all(f == want for f in found),
              "evidence": f"batch_exists: {found} of {want} pages per prompt"}
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
